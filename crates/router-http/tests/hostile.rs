//! Hostile and careless clients: request forms that must never reach a
//! worker, deadlines that must bound every phase, and an admin drain that
//! must finish when its caller goes away. Each test reproduces a defect an
//! attack on the reference router found; they failed before the fixes.

mod common;

use common::{Connection, Fixture, call, chat_body, json};
use engine_sim::EngineConfig;
use http::StatusCode;
use router_http::RouterConfig;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use worker_lifecycle::BreakerState;

/// Sends `raw` on a fresh connection and reads until the server closes it;
/// returns the status code and the whole response text.
async fn raw_exchange(addr: SocketAddr, raw: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(raw.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut response))
        .await
        .expect("the router did not answer and close within 30 s")
        .unwrap();
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    (status, text)
}

fn header<'a>(response: &'a str, name: &str) -> Option<&'a str> {
    response.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        key.eq_ignore_ascii_case(name).then(|| value.trim())
    })
}

/// A streamed chat completion that the worker stalls after its headers: it
/// keeps the worker loaded until the connection is dropped.
async fn stalled_stream(addr: SocketAddr) -> (Connection, http::Response<hyper::body::Incoming>) {
    let mut connection = Connection::open(addr).await;
    let response = connection
        .send(
            "POST",
            "/v1/chat/completions",
            &[
                ("content-type", "application/json"),
                ("x-sim-fault", "stall-after-headers=600s"),
            ],
            chat_body("a long stream", true),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    (connection, response)
}

/// A non-streamed chat completion on a fresh connection.
async fn chat(
    addr: SocketAddr,
    extra: &[(&str, &str)],
) -> (StatusCode, http::HeaderMap, bytes::Bytes) {
    let mut headers = vec![("content-type", "application/json")];
    headers.extend_from_slice(extra);
    call(
        addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        chat_body("hello", false),
    )
    .await
}

/// An admin `POST` without a body on a fresh connection.
async fn post(addr: SocketAddr, path: &str) -> (StatusCode, http::HeaderMap, bytes::Bytes) {
    call(addr, "POST", path, &[], "").await
}

/// Waits (bounded) until the fleet is empty, then checks the worker that
/// left has no load and never clamped a decrement.
async fn wait_until_the_fleet_is_empty(fixture: &Fixture, worker: &worker_lifecycle::Worker) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !fixture.workers().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the worker stayed {:?} with load {}",
            worker.lifecycle(),
            worker.load()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(worker.load(), 0);
    assert_eq!(worker.underflows(), 0);
}

#[tokio::test]
async fn asterisk_and_authority_form_targets_never_reach_a_worker_or_move_its_breaker() {
    // The default breaker and retries: the attack needed two requests.
    let fixture = Fixture::start(RouterConfig::default(), vec![EngineConfig::instant()]).await;
    for _ in 0..4 {
        let (status, response) = raw_exchange(
            fixture.addr,
            "OPTIONS * HTTP/1.1\r\nhost: router\r\nconnection: close\r\n\r\n",
        )
        .await;
        assert_eq!(status, 200, "{response}");
        let allow = header(&response, "allow").expect("OPTIONS * names the methods");
        assert!(allow.contains("POST") && allow.contains("GET"), "{allow}");
    }
    let (status, response) = raw_exchange(
        fixture.addr,
        "CONNECT 127.0.0.1:1 HTTP/1.1\r\nhost: 127.0.0.1:1\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 405, "{response}");
    assert!(response.contains("method_not_allowed"), "{response}");

    let worker = &fixture.workers()[0];
    assert_eq!(worker.breaker().state(), BreakerState::Closed);
    assert_eq!(worker.breaker().counters().opened, 0);
    assert_eq!(worker.processed(), 0, "nothing was sent to the worker");
    assert_eq!(fixture.router.metrics().retries.get(), 0);

    let (status, _, body) = chat(fixture.addr, &[]).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn the_request_deadline_covers_the_wait_for_response_headers() {
    let mut config = RouterConfig {
        request_timeout: Duration::from_secs(1),
        retry: worker_lifecycle::RetryPolicy::no_retries(),
        ..RouterConfig::default()
    };
    config.worker_options.breaker.failure_threshold = 1;
    let fixture = Fixture::start(config, vec![EngineConfig::instant()]).await;
    // The worker accepts the request and never answers (the header timeout
    // is 600 s): only the 1 s deadline can end the wait.
    let answer = tokio::time::timeout(
        Duration::from_secs(60),
        chat(
            fixture.addr,
            &[("x-sim-fault", "stall-before-headers=600s")],
        ),
    )
    .await
    .expect("the client waited past the request deadline");
    let (status, headers, body) = answer;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(headers["content-type"], "application/json");
    let error = json(&body);
    assert_eq!(error["error"]["code"], "request_timeout", "{error}");
    fixture.assert_all_loads_return_to_zero().await;
    // The worker did not answer in time: a timeout counts against it.
    let worker = &fixture.workers()[0];
    assert_eq!(worker.breaker().counters().opened, 1);
}

#[tokio::test]
async fn a_drain_completes_after_the_admin_caller_disconnects() {
    let fixture = Fixture::start(RouterConfig::default(), vec![EngineConfig::instant()]).await;
    let url = fixture.engines[0].url();
    let worker = std::sync::Arc::clone(&fixture.workers()[0]);

    // A stream stalled after its headers keeps the worker loaded.
    let (streaming, stalled) = stalled_stream(fixture.addr).await;
    assert_eq!(worker.load(), 1);

    // The operator asks for the removal and goes away while it drains.
    let remove = format!("/remove_worker?url={url}");
    let admin = tokio::spawn(async move {
        let mut connection = Connection::open(fixture.addr).await;
        connection.send("POST", &remove, &[], "").await
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while worker.lifecycle() != worker_lifecycle::Lifecycle::Draining {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the drain never began"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    admin.abort();
    let _ = admin.await;

    // The stream ends (its client leaves): the load reaches 0 and the
    // worker must leave on its own.
    drop(stalled);
    drop(streaming);
    wait_until_the_fleet_is_empty(&fixture, &worker).await;

    // The same URL can join again, as a new lifetime.
    let (status, _, body) = post(fixture.addr, &format!("/add_worker?url={url}")).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    assert_eq!(fixture.workers().len(), 1);
    assert!(fixture.workers()[0].generation() > worker.generation());
}

#[tokio::test]
async fn only_named_routes_reach_workers_unless_passed_through() {
    let config = RouterConfig {
        passthrough_paths: vec!["/version".into(), "/v1/audio/*".into()],
        ..RouterConfig::default()
    };
    let fixture = Fixture::start(config, vec![EngineConfig::instant()]).await;
    for (method, path, status, code) in [
        ("GET", "/add_worker", 405, "method_not_allowed"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
        ("PUT", "/remove_worker", 405, "method_not_allowed"),
        ("POST", "/admin/secret", 404, "not_found"),
        ("GET", "/", 404, "not_found"),
        ("GET", "/v1/audio", 404, "not_found"),
        ("GET", "/../../etc/passwd", 400, "invalid_request"),
        ("GET", "/v1/audio/%2e%2e/x", 400, "invalid_request"),
    ] {
        let (got, headers, body) = call(fixture.addr, method, path, &[], "").await;
        assert_eq!(got.as_u16(), status, "{method} {path}");
        assert_eq!(json(&body)["error"]["code"], code, "{method} {path}");
        if status == 405 {
            assert!(headers.contains_key("allow"), "{method} {path}");
        }
    }
    assert_eq!(
        fixture.workers()[0].processed(),
        0,
        "nothing reached the worker"
    );
    // Listed paths are proxied (engine-sim has no /version: its 404 comes
    // through unchanged, counted on the worker).
    let (status, _, _) = call(fixture.addr, "GET", "/version", &[], "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(fixture.workers()[0].processed(), 1);
    let (status, _, _) = call(fixture.addr, "POST", "/v1/audio/speech", &[], "{}").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(fixture.workers()[0].processed(), 2);
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn admin_reads_need_the_admin_key_and_probes_stay_open() {
    let config = RouterConfig {
        api_key: Some("inference".into()),
        admin_api_key: Some("admin".into()),
        ..RouterConfig::default()
    };
    let fixture = Fixture::start(config, vec![EngineConfig::instant()]).await;
    // `/metrics` lists every worker URL in its `url` labels: an admin read.
    for path in ["/workers", "/list_workers", "/metrics"] {
        for key in [None, Some("Bearer inference")] {
            let headers: Vec<(&str, &str)> =
                key.map(|k| ("authorization", k)).into_iter().collect();
            let (status, _, body) = call(fixture.addr, "GET", path, &headers, "").await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{path} with {key:?}");
            assert!(
                !String::from_utf8_lossy(&body).contains("127.0.0.1"),
                "{path} revealed a worker URL"
            );
        }
        let (status, _, body) = call(
            fixture.addr,
            "GET",
            path,
            &[("authorization", "Bearer admin")],
            "",
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert!(String::from_utf8_lossy(&body).contains(&fixture.engines[0].url()));
    }
    for path in ["/health", "/liveness", "/readiness"] {
        let (status, _, _) = call(fixture.addr, "GET", path, &[], "").await;
        assert_eq!(status, StatusCode::OK, "{path} must stay open");
    }
}

/// Issue 32: `/metrics` listed every worker URL without a key while
/// `/workers` needed the admin key. With an admin key it needs it now,
/// unless the host opts out for a scraper without credentials; without any
/// admin key it is open as before, an inference key alone included.
#[tokio::test]
async fn metrics_need_the_admin_key_unless_opened() {
    let scrape = |addr, key: Option<&'static str>| async move {
        let headers: Vec<(&str, &str)> = key.map(|k| ("authorization", k)).into_iter().collect();
        let (status, _, body) = call(addr, "GET", "/metrics", &headers, "").await;
        (status, String::from_utf8_lossy(&body).into_owned())
    };
    let guarded = RouterConfig {
        api_key: Some("inference".into()),
        admin_api_key: Some("admin".into()),
        ..RouterConfig::default()
    };
    let fixture = Fixture::start(guarded.clone(), vec![EngineConfig::instant()]).await;
    let worker = fixture.engines[0].url();
    for key in [None, Some("Bearer inference"), Some("Bearer wrong")] {
        let (status, body) = scrape(fixture.addr, key).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{key:?}");
        assert!(!body.contains(&worker), "the refusal revealed {worker}");
        assert_eq!(
            json(body.as_bytes())["error"]["type"],
            "authentication_error"
        );
    }
    let (status, body) = scrape(fixture.addr, Some("Bearer admin")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains(&format!("url=\"{worker}\"")), "{body}");

    let open = RouterConfig {
        metrics_open: true,
        ..guarded
    };
    let fixture = Fixture::start(open, vec![EngineConfig::instant()]).await;
    let (status, body) = scrape(fixture.addr, None).await;
    assert_eq!(status, StatusCode::OK, "opted out: open");
    assert!(body.contains("router_worker_load{"), "{body}");

    for unguarded in [
        RouterConfig::default(),
        RouterConfig {
            api_key: Some("inference".into()),
            ..RouterConfig::default()
        },
    ] {
        let fixture = Fixture::start(unguarded, vec![EngineConfig::instant()]).await;
        let (status, _) = scrape(fixture.addr, None).await;
        assert_eq!(status, StatusCode::OK, "no admin key: unchanged, open");
    }
}

/// Issue 32: port 0 is no worker's port, and a bad `bootstrap_port` is
/// refused (outside P/D mode it used to be ignored; in P/D mode it was read
/// only after the worker answered its first health check).
#[tokio::test]
async fn add_worker_refuses_port_zero_at_once() {
    let fixture = Fixture::start(RouterConfig::default(), vec![]).await;
    let engine = engine_sim::spawn(EngineConfig::instant(), Default::default())
        .await
        .unwrap();
    for query in [
        "url=http://127.0.0.1:0".to_owned(),
        format!("url={}&bootstrap_port=0", engine.url()),
        format!("url={}&bootstrap_port=65536", engine.url()),
        format!("url={}&bootstrap_port=x", engine.url()),
    ] {
        let (status, _, body) = call(
            fixture.addr,
            "POST",
            &format!("/add_worker?{query}"),
            &[],
            "",
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}");
        let message = json(&body)["error"]["message"].to_string();
        assert!(message.contains("port"), "{query}: {message}");
    }
    assert!(fixture.workers().is_empty(), "bad input changes no state");
    // The same worker with a good port joins.
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        &format!("/add_worker?url={}&bootstrap_port=8998", engine.url()),
        &[],
        "",
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(fixture.workers().len(), 1);
}

#[tokio::test]
async fn aliases_of_a_worker_address_are_one_worker() {
    let fixture = Fixture::start(RouterConfig::default(), vec![EngineConfig::instant()]).await;
    let port = fixture.engines[0].addr().port();
    assert_eq!(
        fixture.workers()[0].url(),
        format!("http://127.0.0.1:{port}")
    );
    for alias in [
        format!("http://localhost:{port}"),
        format!("http://LOCALHOST:{port}/"),
        format!("http://127.1:{port}"),
        format!("http://2130706433:{port}"),
        format!("http://[::ffff:127.0.0.1]:{port}"),
        format!("http://0x7f.0.0.1:0{port}"),
    ] {
        let encoded = alias.replace('[', "%5B").replace(']', "%5D");
        let (status, _, body) = post(fixture.addr, &format!("/add_worker?url={encoded}")).await;
        assert_eq!(
            status,
            StatusCode::CONFLICT,
            "{alias}: {}",
            String::from_utf8_lossy(&body)
        );
        assert_eq!(json(&body)["error"]["code"], "worker_exists");
    }
    assert_eq!(fixture.workers().len(), 1);
}

#[tokio::test]
async fn remove_worker_can_answer_at_once_while_the_drain_goes_on() {
    let fixture = Fixture::start(RouterConfig::default(), vec![EngineConfig::instant()]).await;
    let url = fixture.engines[0].url();
    let worker = std::sync::Arc::clone(&fixture.workers()[0]);
    let (streaming, stalled) = stalled_stream(fixture.addr).await;
    let (status, _, body) = post(
        fixture.addr,
        &format!("/remove_worker?url={url}&wait=false"),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let body = json(&body);
    assert_eq!(body["status"], "draining");
    assert_eq!(body["load"], 1);
    // Draining: no new work, and the same URL cannot be added yet.
    let (status, _, _) = chat(fixture.addr, &[]).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, _, body) = post(fixture.addr, &format!("/add_worker?url={url}")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(String::from_utf8_lossy(&body).contains("draining"));
    let (status, _, _) = post(
        fixture.addr,
        &format!("/remove_worker?url={url}&wait=maybe"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    drop(stalled);
    drop(streaming);
    wait_until_the_fleet_is_empty(&fixture, &worker).await;
}

/// A router with `server` limits and no workers, serving on loopback.
async fn limited_server(server: router_http::ServerConfig) -> Fixture {
    let config = RouterConfig {
        server,
        ..RouterConfig::default()
    };
    Fixture::start(config, Vec::new()).await
}

/// Waits (bounded) until the server counts no open connection.
async fn wait_until_every_connection_closed(stats: &router_http::ServerStats) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while stats.open_connections() != 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} connections are still counted open",
            stats.open_connections()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_client_that_trickles_its_headers_is_disconnected() {
    let fixture = limited_server(router_http::ServerConfig {
        header_read_timeout: Some(Duration::from_millis(500)),
        ..router_http::ServerConfig::default()
    })
    .await;
    let mut stream = TcpStream::connect(fixture.addr).await.unwrap();
    stream.write_all(b"GET /hea").await.unwrap();
    // The rest would come a byte at a time; the router closes first.
    let mut buffer = [0u8; 256];
    let read = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut buffer))
        .await
        .expect("the connection stayed open past the header-read timeout");
    assert!(
        matches!(read, Ok(0) | Err(_)) || buffer.starts_with(b"HTTP/1.1 408"),
        "{read:?}"
    );
    // Its slot is free again.
    let stats = &fixture.router.config().server.stats;
    wait_until_every_connection_closed(stats).await;
    assert_eq!(stats.header_timeouts(), 1);
}

#[tokio::test]
async fn connections_over_the_cap_wait_until_one_closes() {
    let fixture = limited_server(router_http::ServerConfig {
        max_connections: 2,
        ..router_http::ServerConfig::default()
    })
    .await;
    let mut held = vec![
        Connection::open(fixture.addr).await,
        Connection::open(fixture.addr).await,
    ];
    for connection in &mut held {
        let response = connection.send("GET", "/health", &[], "").await;
        assert_eq!(response.status(), StatusCode::OK);
    }
    // The kernel completes the third handshake, but the router does not
    // serve it while two connections are open.
    let third = tokio::spawn(call(fixture.addr, "GET", "/health", &[], ""));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !third.is_finished(),
        "a third connection was served over the cap"
    );
    assert!(fixture.router.config().server.stats.at_limit() >= 1);
    held.pop();
    let (status, _, _) = tokio::time::timeout(Duration::from_secs(30), third)
        .await
        .expect("the waiting connection was never served")
        .unwrap();
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_body_that_does_not_arrive_in_time_is_a_408_and_charges_no_worker() {
    let config = RouterConfig {
        request_body_timeout: Duration::from_millis(500),
        ..RouterConfig::default()
    };
    let fixture = Fixture::start(config, vec![EngineConfig::instant()]).await;
    let mut stream = TcpStream::connect(fixture.addr).await.unwrap();
    stream
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
              content-length: 1000\r\n\r\n{\"model\":",
        )
        .await
        .unwrap();
    let mut response = vec![0u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut response))
        .await
        .expect("no answer past the body timeout")
        .unwrap();
    let text = String::from_utf8_lossy(&response[..read]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("request_body_timeout"), "{text}");
    assert_eq!(fixture.workers()[0].processed(), 0);
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn a_client_that_connects_and_sends_nothing_is_disconnected() {
    let fixture = limited_server(router_http::ServerConfig {
        header_read_timeout: Some(Duration::from_millis(500)),
        ..router_http::ServerConfig::default()
    })
    .await;
    // Nothing at all, and the first bytes of an HTTP/2 preface: neither
    // lets the server choose a protocol, and neither may hold a slot.
    for sent in [&b""[..], b"PRI * HT"] {
        let mut stream = TcpStream::connect(fixture.addr).await.unwrap();
        stream.write_all(sent).await.unwrap();
        let mut buffer = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut buffer))
            .await
            .expect("a silent connection stayed open past the header-read timeout");
        assert!(matches!(read, Ok(0) | Err(_)), "{sent:?}: {read:?}");
    }
    let stats = &fixture.router.config().server.stats;
    wait_until_every_connection_closed(stats).await;
    assert_eq!(stats.header_timeouts(), 2);
}

#[tokio::test]
async fn a_silent_connection_does_not_hold_up_shutdown() {
    // The default 30 s header-read timeout: shutdown must not wait for it.
    let config = RouterConfig {
        shutdown_grace: Duration::from_secs(20),
        ..RouterConfig::default()
    };
    let fixture = Fixture::start(config, Vec::new()).await;
    let _silent = TcpStream::connect(fixture.addr).await.unwrap();
    let stats = &fixture.router.config().server.stats;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while stats.open_connections() == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never accepted");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let outcome = tokio::time::timeout(Duration::from_secs(15), fixture.shutdown())
        .await
        .expect("shutdown waited for a connection that never sent a byte");
    assert_eq!(outcome, router_http::ShutdownOutcome::Drained);
}

#[tokio::test]
async fn made_up_model_names_keep_the_routing_state_and_metrics_bounded() {
    // The workers declare no model, so they serve any name, and the name
    // comes from the client: before the bound every new one added a policy
    // instance with its prefix trees and about 25 `/metrics` series.
    let config = RouterConfig {
        policy: lb_policies::PolicyConfig::named("cache_aware"),
        max_models: 4,
        ..RouterConfig::default()
    };
    let fixture = Fixture::start(config, vec![EngineConfig::instant()]).await;
    for i in 0..40 {
        let body = serde_json::json!({
            "model": format!("made-up-{i}"),
            "messages": [{"role": "user", "content": format!("hello {i}")}],
            "max_tokens": 1,
        });
        let (status, _, _) = call(
            fixture.addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            body.to_string(),
        )
        .await;
        assert_ne!(status, StatusCode::INTERNAL_SERVER_ERROR);
    }
    let (status, _, metrics) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(metrics.to_vec()).unwrap();
    let models: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with("router_policy_decisions_total{"))
        .filter_map(|l| l.split("model=\"").nth(1)?.split('"').next())
        .collect();
    // The four most recent names, nothing older.
    let expected: std::collections::BTreeSet<String> =
        (36..40).map(|i| format!("made-up-{i}")).collect();
    assert_eq!(
        models,
        expected.iter().map(String::as_str).collect(),
        "{text}"
    );
    assert!(
        text.contains("router_policy_models_evicted_total{pool=\"regular\"} 36"),
        "{text}"
    );
    // A known model still routes.
    let (status, _, _) = chat(fixture.addr, &[]).await;
    assert_eq!(status, StatusCode::OK);
}

/// A model name is a label of the per-model `/metrics` series and a key of
/// per-model state: a client naming a 5 MB model made every scrape 125 MB.
/// A name over the bound is a 400 naming the field, reaches no worker and
/// adds no series; one at the bound is routed as usual.
#[tokio::test]
async fn a_model_name_over_the_bound_is_refused_and_adds_no_state() {
    let fixture = Fixture::start(RouterConfig::default(), vec![EngineConfig::instant()]).await;
    let body = |model: &str| {
        serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "prompt": "hi",
            "max_tokens": 2,
        })
        .to_string()
    };
    let long = "m".repeat(router_http::MAX_MODEL_BYTES + 1);
    let headers = [("content-type", "application/json")];
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let (status, _, answer) = call(fixture.addr, "POST", path, &headers, body(&long)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}");
        let answer = json(&answer);
        assert_eq!(answer["error"]["code"], "invalid_request", "{path}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains("`model` is 1025 bytes long"), "{message}");
    }
    assert_eq!(
        fixture.workers()[0].processed(),
        0,
        "nothing reached the worker"
    );
    let (_, _, metrics) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(
        !metrics.contains(&long[..64]),
        "no series for the long name"
    );
    // At the bound: routed (engine-sim answers its 404 for an unknown model).
    let at_bound = "m".repeat(router_http::MAX_MODEL_BYTES);
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        body(&at_bound),
    )
    .await;
    assert_ne!(status, StatusCode::BAD_REQUEST);
    assert_eq!(fixture.workers()[0].processed(), 1);
    fixture.assert_all_loads_return_to_zero().await;
}
