//! The reference router end to end, in-process: the default simulated mode,
//! real (separately started) engines, start-up waiting, the Prometheus
//! listener and graceful shutdown. tests/e2e_binary.rs runs the built
//! example as a user would.

use affinity_router::cli::{App, Settings, StartError, StopOutcome};
use affinity_router::sim::{EngineConfig, ServeOptions};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::net::SocketAddr;
use std::time::Duration;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

fn settings(args: &[&str]) -> Settings {
    Settings::from_args(std::iter::once("router").chain(args.iter().copied())).unwrap()
}

/// Every test binds the router and the metrics listener on free ports and
/// runs the engines without simulated latency.
const QUICK: [&str; 6] = [
    "--port",
    "0",
    "--prometheus-port",
    "0",
    "--sim-time-scale",
    "0",
];

fn with_quick(args: &[&str]) -> Settings {
    let mut all: Vec<&str> = QUICK.to_vec();
    all.extend_from_slice(args);
    settings(&all)
}

async fn send(
    client: &HttpClient,
    method: &str,
    url: String,
    body: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, http::HeaderMap, String) {
    let mut request = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    if !body.is_empty() {
        request = request.header("content-type", "application/json");
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), async {
        let response = client
            .request(request)
            .await
            .expect("the request is answered");
        let (parts, body) = response.into_parts();
        let bytes = body.collect().await.expect("the body completes").to_bytes();
        (
            parts.status,
            parts.headers,
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    })
    .await
    .expect("answered within 20 s")
}

async fn get(client: &HttpClient, addr: SocketAddr, path: &str) -> (StatusCode, String) {
    let (status, _, body) = send(client, "GET", format!("http://{addr}{path}"), "", &[]).await;
    (status, body)
}

const CHAT: &str = r#"{"model": "sim-model", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}"#;
const CHAT_STREAM: &str = r#"{"model": "sim-model", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "stream": true}"#;

/// Extracts the URL and the JSON body of the banner's curl line.
fn curl_from_banner(banner: &str) -> (String, String) {
    let line = banner
        .lines()
        .find(|line| line.contains("curl "))
        .expect("the banner has a curl line");
    let url = line
        .split_whitespace()
        .find(|word| word.starts_with("http://"))
        .expect("a URL")
        .to_owned();
    let body = line
        .split_once("-d '")
        .and_then(|(_, rest)| rest.strip_suffix('\''))
        .expect("a -d '...' body")
        .to_owned();
    (url, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_mode_serves_a_chat_completion_and_a_stream() {
    let app = App::start(&with_quick(&["--sim-workers", "2"]))
        .await
        .unwrap();
    assert_eq!(app.engines().count(), 2);
    assert_eq!(app.router().workers().len(), 2);
    let addr = app.addr();
    let banner = app.banner();
    assert!(
        banner.contains(&format!("http://127.0.0.1:{}", addr.port())),
        "{banner}"
    );
    assert!(banner.contains("policy cache_aware"), "{banner}");
    for (role, engine) in app.engines() {
        assert_eq!(role, "regular");
        assert!(banner.contains(&engine.url()), "{banner}");
    }
    let client = client();

    // The curl line of the banner works as printed.
    let (url, body) = curl_from_banner(&banner);
    let (status, _, text) = send(&client, "POST", url, &body, &[]).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["usage"]["completion_tokens"], 16);

    let chat = format!("http://{addr}/v1/chat/completions");
    let (status, headers, text) = send(&client, "POST", chat.clone(), CHAT, &[]).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(headers.contains_key("x-worker-id"));
    let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(
        answer["choices"][0]["message"]["content"]
            .as_str()
            .is_some()
    );

    let (status, headers, text) = send(&client, "POST", chat, CHAT_STREAM, &[]).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"),
        "{headers:?}"
    );
    let events = text.matches("data: ").count();
    assert!(events >= 9, "8 tokens and [DONE]: {text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");

    // Metrics: on the main port and on the Prometheus listener.
    let (status, metrics) = get(&client, addr, "/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert!(metrics.contains("router_worker_load"), "{metrics}");
    let prometheus = app.prometheus_addr().expect("the Prometheus port was free");
    let (status, scraped) = get(&client, prometheus, "/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert!(scraped.contains("router_worker_processed_total"));
    let (status, _) = get(&client, prometheus, "/v1/models").await;
    assert_eq!(
        status,
        StatusCode::NOT_FOUND,
        "the metrics listener serves only /metrics"
    );

    for worker in app.router().workers().iter() {
        assert_eq!(worker.load(), 0, "every guard was released");
    }
    assert_eq!(app.stop().await, StopOutcome::Drained);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_urls_front_separately_started_engines_with_dp_ranks() {
    let mut engines = Vec::new();
    for _ in 0..2 {
        engines.push(
            affinity_router::sim::spawn(EngineConfig::instant(), ServeOptions::default())
                .await
                .unwrap(),
        );
    }
    let urls: Vec<String> = engines.iter().map(|e| e.url()).collect();
    let mut args = vec!["--worker-urls", &urls[0], &urls[1]];
    args.extend([
        "--policy",
        "round_robin",
        "--intra-node-data-parallel-size",
        "2",
    ]);
    let app = App::start(&with_quick(&args)).await.unwrap();
    assert!(
        app.engines().next().is_none(),
        "no simulated engines with --worker-urls"
    );
    let workers = app.router().workers();
    let mut keys: Vec<String> = workers.iter().map(|w| w.endpoint().to_string()).collect();
    keys.sort();
    let mut expected = vec![
        format!("{}@0", urls[0]),
        format!("{}@1", urls[0]),
        format!("{}@0", urls[1]),
        format!("{}@1", urls[1]),
    ];
    expected.sort();
    assert_eq!(keys, expected);

    let client = client();
    let chat = format!("http://{}/v1/chat/completions", app.addr());
    let mut served_by = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let (status, headers, text) = send(
            &client,
            "POST",
            chat.clone(),
            CHAT,
            &[("x-data-parallel-rank", "7")],
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{text}");
        served_by.insert(headers["x-worker-id"].to_str().unwrap().to_owned());
    }
    let ids: std::collections::BTreeSet<String> =
        engines.iter().map(|e| e.engine_id().to_owned()).collect();
    assert_eq!(served_by, ids, "round robin reaches both engines");
    for worker in workers.iter() {
        assert_eq!(
            worker.processed(),
            1,
            "{} served one request",
            worker.endpoint()
        );
        assert_eq!(worker.load(), 0);
    }
    assert_eq!(app.stop().await, StopOutcome::Drained);
    for engine in engines {
        engine.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_workers_health_answers_and_readiness_waits() {
    let app = App::start(&with_quick(&["--worker-urls"])).await.unwrap();
    let client = client();
    let addr = app.addr();
    assert_eq!(get(&client, addr, "/health").await.0, StatusCode::OK);
    assert_eq!(get(&client, addr, "/liveness").await.0, StatusCode::OK);
    assert_eq!(
        get(&client, addr, "/readiness").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let (status, _, _) = send(
        &client,
        "POST",
        format!("http://{addr}/v1/chat/completions"),
        CHAT,
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(app.banner().contains("an empty fleet"));
    assert_eq!(app.stop().await, StopOutcome::Drained);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_waits_for_a_worker_that_comes_up_late() {
    // A free port, taken by an engine only after the router started waiting.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let engine_addr = SocketAddr::from(([127, 0, 0, 1], port));
    let late = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let options = ServeOptions {
            addr: engine_addr,
            ..ServeOptions::default()
        };
        affinity_router::sim::spawn(EngineConfig::instant(), options)
            .await
            .unwrap()
    });
    let url = format!("http://{engine_addr}");
    let settings = with_quick(&[
        "--worker-urls",
        &url,
        "--worker-startup-check-interval",
        "1",
        "--worker-startup-timeout-secs",
        "20",
    ]);
    let app = App::start(&settings).await.unwrap();
    let engine = late.await.unwrap();
    assert_eq!(app.router().workers().len(), 1);
    let client = client();
    assert_eq!(
        get(&client, app.addr(), "/readiness").await.0,
        StatusCode::OK
    );
    let chat = format!("http://{}/v1/chat/completions", app.addr());
    let (status, _, text) = send(&client, "POST", chat, CHAT, &[]).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the first request is served: {text}"
    );
    assert_eq!(app.stop().await, StopOutcome::Drained);
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_answers_fails_startup_naming_it() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let url = format!("http://{closed}");
    let settings = with_quick(&[
        "--worker-urls",
        &url,
        "--worker-startup-check-interval",
        "1",
        "--worker-startup-timeout-secs",
        "1",
    ]);
    let err = App::start(&settings).await.unwrap_err();
    let StartError::WorkersNotReady { urls, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(urls, &vec![url]);
    assert!(err.to_string().contains("/health"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_prometheus_port_is_a_warning_not_a_failure() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let settings = settings(&[
        "--port",
        "0",
        "--sim-time-scale",
        "0",
        "--sim-workers",
        "1",
        "--prometheus-port",
        &port,
    ]);
    let app = App::start(&settings).await.unwrap();
    assert_eq!(app.prometheus_addr(), None);
    let (status, metrics) = get(&client(), app.addr(), "/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert!(metrics.contains("router_"));
    assert_eq!(app.stop().await, StopOutcome::Drained);
    drop(busy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_pd_routes_prefill_then_decode_for_every_connector() {
    for connector in [
        "nixl",
        "mooncake",
        "mooncake-sequential",
        "moriio",
        "moriio-write",
    ] {
        let app = App::start(&with_quick(&[
            "--sim-pd",
            "2:1",
            "--kv-connector",
            connector,
        ]))
        .await
        .unwrap();
        let roles: Vec<&str> = app.engines().map(|(role, _)| role).collect();
        assert_eq!(roles, ["prefill", "prefill", "decode"]);
        let banner = app.banner();
        assert!(banner.contains("P/D over"), "{banner}");
        assert!(banner.contains("prefill: 2 engine-sim"), "{banner}");
        let client = client();
        let addr = app.addr();
        assert_eq!(get(&client, addr, "/readiness").await.0, StatusCode::OK);
        let (url, body) = curl_from_banner(&banner);
        let (status, _, text) = send(&client, "POST", url.clone(), &body, &[]).await;
        assert_eq!(status, StatusCode::OK, "{connector}: {text}");
        let (status, _, text) = send(&client, "POST", url, CHAT_STREAM, &[]).await;
        assert_eq!(status, StatusCode::OK, "{connector}: {text}");
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "{connector}: {text}"
        );
        // The decode engine received valid KV transfer parameters for both.
        let (_, decode) = app.engines().find(|(role, _)| *role == "decode").unwrap();
        let stats = decode.stats();
        assert_eq!(stats.kv_transfers_valid, 2, "{connector}: {stats:?}");
        assert_eq!(
            stats.kv_transfers_invalid.values().sum::<u64>(),
            0,
            "{connector}"
        );
        for worker in app.router().all_workers() {
            assert_eq!(worker.load(), 0, "{connector}: {}", worker.key());
        }
        assert_eq!(app.stop().await, StopOutcome::Drained);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_with_a_stream_in_flight_turns_readiness_503_and_lets_it_finish() {
    let settings = with_quick(&["--sim-workers", "1", "--shutdown-grace-period-secs", "20"]);
    let app = App::start(&settings).await.unwrap();
    let addr = app.addr();
    let client = client();
    // The engine sends headers, then nothing for 1 s, then the stream.
    let request = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-sim-fault", "stall-after-headers=1s")
        .body(Full::new(Bytes::from_static(CHAT_STREAM.as_bytes())))
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), client.request(request))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(app.router().in_flight(), 1);

    let started = std::time::Instant::now();
    let stopping = tokio::spawn(app.stop());
    // Readiness and health turn 503 at once; the listener is still open.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (status, _) = get(&client, addr, "/readiness").await;
        if status == StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "readiness stayed {status}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        get(&client, addr, "/health").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let (status, _, _) = send(
        &client,
        "POST",
        format!("http://{addr}/v1/chat/completions"),
        CHAT,
        &[],
    )
    .await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "new work is refused"
    );

    // The stream in flight completes.
    let body = tokio::time::timeout(Duration::from_secs(10), response.into_body().collect())
        .await
        .expect("the stream finishes")
        .expect("without an error")
        .to_bytes();
    let text = String::from_utf8_lossy(&body);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let outcome = tokio::time::timeout(Duration::from_secs(15), stopping)
        .await
        .expect("stop returns")
        .unwrap();
    assert_eq!(outcome, StopOutcome::Drained);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "well before the grace period"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_prefill_and_decode_urls_with_a_mooncake_bootstrap_port() {
    use affinity_router::sim::{Role, TransferRegistry};
    let connector = "mooncake";
    let (kv_connector, moriio_mode) =
        affinity_router::sim::for_deployment(connector.parse().unwrap())
            .expect("engine-sim simulates Mooncake");
    let transfers = TransferRegistry::new();
    let prefill = affinity_router::sim::spawn(
        EngineConfig {
            role: Role::Prefill,
            kv_connector,
            moriio_mode,
            ..EngineConfig::instant()
        },
        ServeOptions {
            registry: Some(transfers.clone()),
            bootstrap_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            ..ServeOptions::default()
        },
    )
    .await
    .unwrap();
    let decode = affinity_router::sim::spawn(
        EngineConfig {
            role: Role::Decode,
            kv_connector,
            moriio_mode,
            ..EngineConfig::instant()
        },
        ServeOptions {
            registry: Some(transfers),
            ..ServeOptions::default()
        },
    )
    .await
    .unwrap();
    let prefill_url = prefill.url();
    let bootstrap = prefill.bootstrap_addr().unwrap().port().to_string();
    let decode_url = decode.url();
    let settings = with_quick(&[
        "--vllm-pd-disaggregation",
        "--prefill",
        &prefill_url,
        &bootstrap,
        "--decode",
        &decode_url,
        "--kv-connector",
        connector,
        "--prefill-policy",
        "round_robin",
    ]);
    let app = App::start(&settings).await.unwrap();
    let banner = app.banner();
    assert!(banner.contains("P/D over mooncake"), "{banner}");
    assert!(
        banner.contains(&prefill_url) && banner.contains(&decode_url),
        "{banner}"
    );
    let client = client();
    let addr = app.addr();
    assert_eq!(get(&client, addr, "/readiness").await.0, StatusCode::OK);
    let chat = format!("http://{addr}/v1/chat/completions");
    let (status, _, text) = send(&client, "POST", chat.clone(), CHAT, &[]).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let (status, _, text) = send(&client, "POST", chat, CHAT_STREAM, &[]).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let stats = decode.stats();
    assert_eq!(stats.kv_transfers_valid, 2, "{stats:?}");
    let roles: Vec<String> = app
        .router()
        .all_workers()
        .iter()
        .map(|w| format!("{} {}", w.role().kind().as_str(), w.endpoint()))
        .collect();
    assert_eq!(
        roles,
        vec![
            format!("prefill {prefill_url}"),
            format!("decode {decode_url}")
        ]
    );
    assert_eq!(app.stop().await, StopOutcome::Drained);
    prefill.shutdown().await;
    decode.shutdown().await;
}

/// `--policy kv_aware` with simulated engines: the engines publish their KV
/// events, the router follows them, and a conversation's next turn is a
/// `kv_hit` on the engine that holds it; in P/D the prefill pool is scored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_routes_on_the_engines_kv_events() {
    let long_chat = |turns: usize| {
        let mut messages = vec![serde_json::json!({
            "role": "system",
            "content": "You keep the harbour's tide tables. ".repeat(16),
        })];
        for t in 0..turns {
            messages.push(serde_json::json!({"role": "user", "content": format!("Tide {t}?")}));
            messages.push(serde_json::json!({"role": "assistant", "content": "High at noon."}));
        }
        messages.push(serde_json::json!({"role": "user", "content": "And tomorrow?"}));
        serde_json::json!({"model": "sim-model", "messages": messages, "max_tokens": 2}).to_string()
    };
    for args in [
        &["--sim-workers", "2", "--policy", "kv_aware"][..],
        &["--sim-pd", "2:1", "--prefill-policy", "kv_aware"],
    ] {
        let app = App::start(&with_quick(args)).await.unwrap();
        let hub = app
            .router()
            .kv_events()
            .expect("kv_aware follows events")
            .clone();
        let client = client();
        let addr = app.addr();
        let url = format!("http://{addr}/v1/chat/completions");
        let (status, _, text) = send(&client, "POST", url.clone(), &long_chat(0), &[]).await;
        assert_eq!(status, StatusCode::OK, "{args:?}: {text}");
        // The first turn's blocks reach the index (asynchronously).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while hub.index().stats().pairs == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{args:?}: no events arrived"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (status, _, text) = send(&client, "POST", url, &long_chat(1), &[]).await;
        assert_eq!(status, StatusCode::OK, "{args:?}: {text}");
        let (_, metrics) = get(&client, addr, "/metrics").await;
        assert!(
            metrics.contains("reason=\"kv_hit\""),
            "{args:?}: the second turn is an exact hit\n{metrics}"
        );
        let (_, workers) = get(&client, addr, "/workers").await;
        let workers: serde_json::Value = serde_json::from_str(&workers).unwrap();
        let followed: Vec<&serde_json::Value> = workers
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w.get("kv_events").is_some())
            .collect();
        assert_eq!(
            followed.len(),
            2,
            "{args:?}: the kv_aware pool's workers: {workers}"
        );
        assert_eq!(app.stop().await, StopOutcome::Drained);
    }
}
