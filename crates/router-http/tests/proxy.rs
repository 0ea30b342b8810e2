//! The proxy path against engine-sim engines: pass-through, retries, errors,
//! and the load accounting matrix (every worker's load returns to exactly 0,
//! no decrement is ever clamped, whatever happens to the request).

mod common;

use common::{Connection, Fixture, call, chat_body, json};
use engine_sim::{EngineConfig, FaultConfig};
use http::StatusCode;
use http_body_util::BodyExt;
use router_http::RouterConfig;
use std::time::Duration;

fn config(policy: &str) -> RouterConfig {
    RouterConfig {
        policy: lb_policies::PolicyConfig::named(policy),
        ..RouterConfig::default()
    }
}

/// A router whose breakers open on the first worker failure.
fn touchy(policy: &str) -> RouterConfig {
    let mut config = config(policy);
    config.worker_options.breaker.failure_threshold = 1;
    config.retry = worker_lifecycle::RetryPolicy::no_retries();
    config
}

fn faulty(faults: FaultConfig) -> EngineConfig {
    EngineConfig {
        faults,
        ..EngineConfig::instant()
    }
}

/// Responses carry per-request ids and timestamps; everything else must match.
fn without_ids(mut value: serde_json::Value) -> serde_json::Value {
    if let Some(object) = value.as_object_mut() {
        object.remove("id");
        object.remove("created");
    }
    value
}

#[tokio::test]
async fn non_streaming_chat_passes_through_unchanged() {
    let fixture = Fixture::start(config("cache_aware"), vec![EngineConfig::instant()]).await;
    let body = chat_body("Tell me about radix trees.", false);
    let direct = call(
        fixture.engines[0].addr(),
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        body.clone(),
    )
    .await;
    let routed = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("x-request-id", "abc-1"),
        ],
        body,
    )
    .await;
    assert_eq!(routed.0, StatusCode::OK);
    assert_eq!(
        routed.1["x-request-id"], "abc-1",
        "the client's id is returned"
    );
    assert_eq!(routed.1["x-worker-id"], direct.1["x-worker-id"]);
    let (direct, routed) = (json(&direct.2), json(&routed.2));
    // The second call hits the engine's prefix cache; only usage differs.
    let strip_usage = |mut v: serde_json::Value| {
        v.as_object_mut().unwrap().remove("usage");
        without_ids(v)
    };
    assert_eq!(strip_usage(direct), strip_usage(routed));
    fixture.assert_all_loads_return_to_zero().await;
    assert_eq!(fixture.workers()[0].processed(), 1);
}

#[tokio::test]
async fn streaming_chat_passes_through_chunk_for_chunk() {
    let fixture = Fixture::start(config("round_robin"), vec![EngineConfig::instant()]).await;
    let body = chat_body("Stream me something.", true);
    let direct = call(
        fixture.engines[0].addr(),
        "POST",
        "/v1/chat/completions",
        &[],
        body.clone(),
    )
    .await;
    let routed = call(fixture.addr, "POST", "/v1/chat/completions", &[], body).await;
    assert_eq!(routed.0, StatusCode::OK);
    assert_eq!(routed.1["content-type"], direct.1["content-type"]);
    let events = |bytes: &[u8]| -> Vec<serde_json::Value> {
        String::from_utf8_lossy(bytes)
            .split("\n\n")
            .filter_map(|event| event.strip_prefix("data: "))
            .filter(|data| *data != "[DONE]")
            .map(|data| without_ids(json(data.as_bytes())))
            .collect()
    };
    let (direct_events, routed_events) = (events(&direct.2), events(&routed.2));
    assert!(direct_events.len() > 2);
    assert_eq!(direct_events.len(), routed_events.len());
    for (d, r) in direct_events.iter().zip(&routed_events) {
        assert_eq!(d["choices"], r["choices"]);
    }
    assert!(
        String::from_utf8_lossy(&routed.2)
            .trim_end()
            .ends_with("data: [DONE]")
    );
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn a_streamed_response_is_load_until_the_client_reads_its_end() {
    let slow = EngineConfig {
        time_scale: 1.0,
        ..EngineConfig::instant()
    };
    let fixture = Fixture::start(config("round_robin"), vec![slow]).await;
    let mut connection = Connection::open(fixture.addr).await;
    let response = connection
        .send(
            "POST",
            "/v1/chat/completions",
            &[],
            chat_body("count slowly", true),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        fixture.workers()[0].load(),
        1,
        "headers arrived, body pending: still load"
    );
    let mut body = response.into_body();
    while let Some(frame) = body.frame().await {
        frame.unwrap();
    }
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn upstream_5xx_is_retried_then_returned_unchanged_and_load_returns_to_zero() {
    let broken = faulty(FaultConfig {
        fixed_status: Some(500),
        ..FaultConfig::default()
    });
    let fixture = Fixture::start(config("round_robin"), vec![broken]).await;
    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/completions",
        &[],
        r#"{"prompt":"x"}"#,
    )
    .await;
    assert_eq!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "the worker's own status"
    );
    assert!(json(&body).get("error").is_some() || json(&body).get("message").is_some());
    let retries = fixture.router.config().retry.max_retries;
    assert_eq!(fixture.router.metrics().retries.get(), u64::from(retries));
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn a_refused_connection_is_retried_on_another_worker() {
    let good = engine_sim::spawn(EngineConfig::instant(), Default::default())
        .await
        .unwrap();
    let dead = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let urls = [dead, good.url()];
    let fixture = Fixture::start_with_urls(config("round_robin"), vec![good], &urls).await;
    for _ in 0..4 {
        let (status, headers, _) = call(
            fixture.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            chat_body("hi", false),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers["x-worker-id"], fixture.engines[0].engine_id());
    }
    fixture.assert_all_loads_return_to_zero().await;
    assert!(
        fixture.router.metrics().retries.get() >= 1,
        "the dead worker was tried and skipped"
    );
}

#[tokio::test]
async fn retry_then_success_releases_the_failed_attempt() {
    let flaky = faulty(FaultConfig {
        fail_first: 1,
        fail_status: Some(503),
        ..FaultConfig::default()
    });
    let fixture = Fixture::start(config("round_robin"), vec![flaky]).await;
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        chat_body("a", false),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(fixture.router.metrics().retries.get(), 1);
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn client_errors_are_neither_retried_nor_counted_against_the_worker() {
    let fixture = Fixture::start(touchy("round_robin"), vec![EngineConfig::instant()]).await;
    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[("x-sim-fault", "status=422")],
        chat_body("a", false),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(!body.is_empty());
    assert_eq!(fixture.router.metrics().retries.get(), 0);
    let breaker = fixture.workers()[0].breaker().counters();
    assert_eq!(breaker.opened, 0, "a 4xx never counts: {breaker:?}");
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn a_client_that_leaves_before_headers_releases_the_load() {
    let fixture = Fixture::start(config("round_robin"), vec![EngineConfig::instant()]).await;
    let mut connection = Connection::open(fixture.addr).await;
    let pending = tokio::spawn(async move {
        connection
            .send(
                "POST",
                "/v1/chat/completions",
                &[("x-sim-fault", "stall-before-headers")],
                chat_body("never answered", false),
            )
            .await
    });
    wait_for(|| fixture.workers()[0].load() == 1).await;
    pending.abort(); // drops the connection
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn a_client_that_leaves_a_stalled_stream_releases_the_load() {
    let fixture = Fixture::start(config("round_robin"), vec![EngineConfig::instant()]).await;
    let mut connection = Connection::open(fixture.addr).await;
    let response = connection
        .send(
            "POST",
            "/v1/chat/completions",
            &[("x-sim-fault", "stall-after-headers")],
            chat_body("stall", true),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(fixture.workers()[0].load(), 1);
    let left_at = std::time::Instant::now();
    drop(response);
    drop(connection);
    fixture.assert_all_loads_return_to_zero().await;
    eprintln!("released {:?} after the client left", left_at.elapsed());
}

#[tokio::test]
async fn an_upstream_reset_mid_body_releases_the_load_and_counts_against_the_worker() {
    let fixture = Fixture::start(touchy("round_robin"), vec![EngineConfig::instant()]).await;
    let mut connection = Connection::open(fixture.addr).await;
    let response = connection
        .send(
            "POST",
            "/v1/chat/completions",
            &[("x-sim-fault", "reset-mid-body")],
            chat_body("reset", true),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let collected = response.into_body().collect().await;
    assert!(collected.is_err(), "the client sees the stream fail");
    fixture.assert_all_loads_return_to_zero().await;
    assert_eq!(fixture.router.metrics().bodies_failed.get(), 1);
    assert_eq!(
        fixture.workers()[0].breaker().counters().opened,
        1,
        "a reset is a worker failure"
    );
}

#[tokio::test]
async fn the_request_timeout_and_the_stream_idle_timeout_release_everything() {
    for (request_timeout, idle) in [
        (Duration::from_millis(300), Duration::from_secs(60)),
        (Duration::from_secs(60), Duration::from_millis(300)),
    ] {
        let config = RouterConfig {
            request_timeout,
            stream_idle_timeout: idle,
            ..config("round_robin")
        };
        let fixture = Fixture::start(config, vec![EngineConfig::instant()]).await;
        let mut connection = Connection::open(fixture.addr).await;
        let response = connection
            .send(
                "POST",
                "/v1/chat/completions",
                &[("x-sim-fault", "stall-after-headers")],
                chat_body("stall", true),
            )
            .await;
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.into_body().collect().await.is_err());
        fixture.assert_all_loads_return_to_zero().await;
        assert_eq!(fixture.router.metrics().bodies_failed.get(), 1);
    }
}

/// Request headers, body, expected status and expected error code.
type ErrorCase<'a> = (&'a [(&'a str, &'a str)], String, StatusCode, &'a str);

#[tokio::test]
async fn router_errors_are_json_with_the_right_status() {
    let config = RouterConfig {
        max_payload_size: 128,
        api_key: Some("secret".into()),
        ..config("round_robin")
    };
    let fixture = Fixture::start(config, vec![]).await;
    let auth = ("authorization", "Bearer secret");
    let cases: [ErrorCase<'_>; 5] = [
        (
            &[],
            chat_body("x", false),
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
        ),
        (
            &[auth],
            "x".repeat(200),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        (
            &[auth],
            "{\"messages\": [".into(),
            StatusCode::BAD_REQUEST,
            "invalid_json",
        ),
        (
            &[auth],
            "{\"model\":\"m\"}".into(),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            &[auth],
            chat_body("x", false),
            StatusCode::SERVICE_UNAVAILABLE,
            "no_available_worker",
        ),
    ];
    for (headers, body, status, code) in cases {
        let (got, response_headers, bytes) =
            call(fixture.addr, "POST", "/v1/chat/completions", headers, body).await;
        assert_eq!(got, status, "{code}");
        assert_eq!(response_headers["content-type"], "application/json");
        let error = json(&bytes);
        assert_eq!(error["error"]["code"], code);
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    // Probes stay open without the key.
    let (status, _, _) = call(fixture.addr, "GET", "/health", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, body) = call(fixture.addr, "GET", "/readiness", &[], "").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(json(&body)["ready"], false);
}

#[tokio::test]
async fn status_routes_show_live_worker_state() {
    let fixture = Fixture::start(
        config("cache_aware"),
        vec![EngineConfig::instant(), EngineConfig::instant()],
    )
    .await;
    let (status, _, body) = call(fixture.addr, "GET", "/list_workers", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    let urls = json(&body)["urls"].as_array().unwrap().len();
    assert_eq!(urls, 2);
    let (_, _, body) = call(fixture.addr, "GET", "/workers", &[], "").await;
    let workers = json(&body);
    let first = &workers.as_array().unwrap()[0];
    for field in [
        "url",
        "role",
        "generation",
        "load",
        "processed",
        "healthy",
        "breaker",
        "lifecycle",
    ] {
        assert!(first.get(field).is_some(), "missing {field}: {first}");
    }
    assert_eq!(first["role"], "regular");
    assert_eq!(first["load"], 0);
    let (status, headers, body) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("router_worker_load{url=\""), "{text}");
    assert!(text.contains("# TYPE router_requests_total counter"));
}

#[tokio::test]
async fn list_workers_is_exactly_empty_urls_with_no_workers() {
    let fixture = Fixture::start(config("round_robin"), vec![]).await;
    let (status, _, body) = call(fixture.addr, "GET", "/list_workers", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(&body[..], br#"{"urls":[]}"#);
}

#[tokio::test]
async fn admin_add_and_remove_worker() {
    let config = RouterConfig {
        admin_api_key: Some("admin".into()),
        ..config("round_robin")
    };
    let fixture = Fixture::start(config, vec![]).await;
    let engine = engine_sim::spawn(EngineConfig::instant(), Default::default())
        .await
        .unwrap();
    let add = format!("/add_worker?url={}", engine.url());
    let (status, _, _) = call(fixture.addr, "POST", &add, &[], "").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "admin routes fail closed");
    let admin = [("authorization", "Bearer admin")];
    let (status, _, _) = call(fixture.addr, "POST", "/add_worker?url=ftp://x", &admin, "").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(fixture.workers().is_empty(), "bad input changes no state");
    let (status, _, body) = call(fixture.addr, "POST", &add, &admin, "").await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let (status, _, _) = call(fixture.addr, "POST", &add, &admin, "").await;
    assert_eq!(status, StatusCode::CONFLICT);
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        chat_body("hi", false),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let remove = format!("/remove_worker?url={}", engine.url());
    let (status, _, body) = call(fixture.addr, "POST", &remove, &admin, "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(json(&body)["drained"], true);
    assert!(fixture.workers().is_empty());
    let (status, _, _) = call(fixture.addr, "POST", &remove, &admin, "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn add_worker_outside_the_allowed_networks_is_refused_without_contacting_it() {
    let refusing = RouterConfig {
        worker_networks: vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()],
        ..config("round_robin")
    };
    let fixture = Fixture::start(refusing, vec![]).await;
    // A listener that counts connections: the router must not open one.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = std::sync::Arc::clone(&accepted);
    let accept_task = tokio::spawn(async move {
        while listener.accept().await.is_ok() {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    for url in [
        format!("http://127.0.0.1:{port}"),
        format!("http://localhost:{port}"),
    ] {
        let (status, _, body) = call(
            fixture.addr,
            "POST",
            &format!("/add_worker?url={url}"),
            &[],
            "",
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{url}");
        let body = json(&body);
        assert_eq!(body["error"]["code"], "worker_address_not_allowed");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("outside the allowed networks (10.0.0.0/8, fd00::/8)"),
            "{message}"
        );
    }
    assert!(
        fixture.workers().is_empty(),
        "a refused URL changes no state"
    );
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 0);
    accept_task.abort();

    // Inside the list, the worker joins as usual.
    let allowed = RouterConfig {
        worker_networks: vec!["127.0.0.0/8".parse().unwrap()],
        ..config("round_robin")
    };
    let fixture = Fixture::start(allowed, vec![]).await;
    let engine = engine_sim::spawn(EngineConfig::instant(), Default::default())
        .await
        .unwrap();
    let add = format!("/add_worker?url={}", engine.url());
    let (status, _, body) = call(fixture.addr, "POST", &add, &[], "").await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    assert_eq!(fixture.workers().len(), 1);
}

async fn wait_for(mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not reached"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test]
async fn a_full_queue_answers_429_with_retry_after_and_json() {
    let config = RouterConfig {
        concurrency: router_http::ConcurrencyConfig {
            max_concurrent: 1,
            queue_size: 0,
            queue_timeout: Duration::from_secs(1),
        },
        ..config("round_robin")
    };
    let fixture = Fixture::start(config, vec![EngineConfig::instant()]).await;
    let mut first = Connection::open(fixture.addr).await;
    let stalled = first
        .send(
            "POST",
            "/v1/chat/completions",
            &[("x-sim-fault", "stall-after-headers")],
            chat_body("hold the only permit", true),
        )
        .await;
    assert_eq!(stalled.status(), StatusCode::OK);
    let (status, headers, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        chat_body("x", false),
    )
    .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(headers.contains_key("retry-after"));
    assert_eq!(json(&body)["error"]["code"], "too_many_requests");
    drop(stalled);
    drop(first);
    fixture.assert_all_loads_return_to_zero().await;
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        chat_body("x", false),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "the permit came back with the body");
}

#[tokio::test]
async fn a_failure_after_the_first_byte_is_never_retried() {
    // Default retries are on; a reset after the first chunk reached the
    // client must not be retried (the client already has bytes).
    let fixture = Fixture::start(config("round_robin"), vec![EngineConfig::instant(); 2]).await;
    let mut connection = Connection::open(fixture.addr).await;
    let response = connection
        .send(
            "POST",
            "/v1/chat/completions",
            &[("x-sim-fault", "reset-mid-body")],
            chat_body("reset", true),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.into_body().collect().await.is_err());
    assert_eq!(fixture.router.metrics().retries.get(), 0);
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn the_breaker_opens_refuses_then_recovers_through_one_probe() {
    let mut config = touchy("round_robin");
    config.worker_options.breaker.open_timeout = Duration::from_millis(200);
    config.worker_options.breaker.jitter = 0.0;
    config.worker_options.breaker.success_threshold = 1;
    // The breaker alone: a one-worker pool would otherwise be in panic mode
    // (fleet_guard.rs tests that).
    config.worker_options.fleet = worker_lifecycle::FleetGuard::off();
    let fixture = Fixture::start(config, vec![EngineConfig::instant()]).await;
    let failing = [("x-sim-fault", "status=500")];
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &failing,
        chat_body("a", false),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let worker = fixture.workers()[0].clone();
    assert_eq!(worker.breaker().counters().opened, 1);

    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        chat_body("b", false),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "open breaker: not selected"
    );
    let message = json(&body)["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("circuit breaker"), "{message}");

    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        chat_body("c", false),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "the probe goes through");
    let counters = worker.breaker().counters();
    assert_eq!(
        (counters.half_opened, counters.closed),
        (1, 1),
        "{counters:?}"
    );
    assert_eq!(
        worker.breaker().state(),
        worker_lifecycle::BreakerState::Closed
    );
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn cache_aware_match_rates_are_exported() {
    let fixture = Fixture::start(config("cache_aware"), vec![EngineConfig::instant(); 2]).await;
    let body = chat_body(
        "A long shared system prompt about radix trees and caches.",
        false,
    );
    for _ in 0..3 {
        let (status, _, _) = call(
            fixture.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            body.clone(),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }
    let (_, _, metrics) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let text = String::from_utf8_lossy(&metrics);
    assert!(text.contains("router_cache_match_rate_count 3"), "{text}");
    // The two repeats matched fully: they sit in the le="1" bucket, not below.
    assert!(
        text.contains("router_cache_match_rate_bucket{le=\"0.95\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("reason=\"cache_hit\"} 2"),
        "two affinity hits counted: {text}"
    );
    // One worker holds the prompt in the tree, the other nothing.
    let sizes: Vec<u64> = text
        .lines()
        .filter(|line| line.starts_with("router_cache_tree_size{"))
        .map(|line| line.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(sizes.len(), 2, "{text}");
    assert_eq!(sizes.iter().filter(|&&s| s > 0).count(), 1, "{sizes:?}");
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn shutdown_turns_readiness_503_at_once_and_lets_the_stream_finish() {
    let slow = EngineConfig {
        time_scale: 1.0,
        ..EngineConfig::instant()
    };
    let mut fixture = Fixture::start(config("round_robin"), vec![slow]).await;
    let (status, _, _) = call(fixture.addr, "GET", "/readiness", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    let mut connection = Connection::open(fixture.addr).await;
    let response = connection
        .send(
            "POST",
            "/v1/chat/completions",
            &[],
            chat_body("a slow stream", true),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);

    fixture.signal_shutdown();
    wait_for(|| !fixture.router.is_accepting()).await;
    // The listener stays open while the stream drains: probes see 503.
    let (status, _, _) = call(fixture.addr, "GET", "/readiness", &[], "").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        chat_body("late", false),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(json(&body)["error"]["code"], "shutting_down");

    let body = response
        .into_body()
        .collect()
        .await
        .expect("the stream completes");
    assert!(String::from_utf8_lossy(&body.to_bytes()).contains("[DONE]"));
    drop(connection);
    fixture.assert_all_loads_return_to_zero().await;
    let outcome = fixture.stopped().await;
    assert_eq!(outcome, router_http::ShutdownOutcome::Drained);
}

#[tokio::test]
async fn metrics_sources_are_rendered_from_live_state_at_scrape_time() {
    use router_http::metrics::MetricsSource;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let sessions = Arc::new(AtomicU64::new(3));
    let read = Arc::clone(&sessions);
    let source = move |exposition: &mut prom_text::Exposition<'_>| {
        exposition
            .family(
                "gateway_sessions",
                prom_text::MetricType::Gauge,
                "Sessions the host holds.",
            )
            .sample(&[], read.load(Ordering::Relaxed));
    };
    let config = RouterConfig {
        metrics_sources: vec![Arc::new(source) as Arc<dyn MetricsSource>],
        ..RouterConfig::default()
    };
    let fixture = Fixture::start(config, Vec::new()).await;
    let scrape = || async {
        let (status, _, body) = call(fixture.addr, "GET", "/metrics", &[], "").await;
        assert_eq!(status, StatusCode::OK);
        String::from_utf8(body.to_vec()).unwrap()
    };
    let first = scrape().await;
    assert!(first.contains("# TYPE gateway_sessions gauge"), "{first}");
    assert!(first.contains("\ngateway_sessions 3\n"), "{first}");
    // The router's own families come first and stay.
    assert!(
        first.find("router_in_flight_requests") < first.find("gateway_sessions"),
        "{first}"
    );
    sessions.store(7, Ordering::Relaxed);
    let second = scrape().await;
    assert!(second.contains("\ngateway_sessions 7\n"), "{second}");
    fixture.shutdown().await;
}
