//! Start-up as deployment scripts see it, in-process: `/health` does not
//! say ready before the configured workers are routable (a client that
//! sends its first request on the first 200 is served), and a command line
//! without a worker source starts an empty fleet, as vllm-router's does.

use affinity_router::cli::{App, Settings, StopOutcome};
use affinity_router::sim::{EngineConfig, EngineHandle, Role, ServeOptions, TransferRegistry};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::net::SocketAddr;
use std::time::Duration;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

const CHAT: &str = r#"{"model": "sim-model", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}"#;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

fn settings(args: &[&str]) -> Settings {
    Settings::from_args(std::iter::once("router").chain(args.iter().copied())).unwrap()
}

/// A loopback port nothing listens on (free when asked; the router or an
/// engine binds it a moment later).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One request; `None` while nothing listens on `url` yet.
async fn try_send(
    client: &HttpClient,
    method: &str,
    url: &str,
    body: &str,
) -> Option<(StatusCode, serde_json::Value)> {
    let request = Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let response = client.request(request).await.ok()?;
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.ok()?.to_bytes();
    let json = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
        serde_json::Value::String(String::from_utf8_lossy(&bytes).into_owned())
    });
    Some((parts.status, json))
}

async fn send(
    client: &HttpClient,
    method: &str,
    url: &str,
    body: &str,
) -> (StatusCode, serde_json::Value) {
    try_send(client, method, url, body)
        .await
        .unwrap_or_else(|| panic!("{method} {url} is answered"))
}

/// Engines whose `/health` answers 503 for `warmup` after they start.
async fn warming_engine(role: Role, warmup: Duration, options: ServeOptions) -> EngineHandle {
    let mooncake = affinity_router::sim::for_deployment("mooncake".parse().unwrap())
        .expect("engine-sim simulates Mooncake");
    let mut config = EngineConfig {
        role,
        ..EngineConfig::instant()
    };
    if role != Role::Regular {
        (config.kv_connector, config.moriio_mode) = mooncake;
    }
    config.faults.slow_start = Some(warmup);
    affinity_router::sim::spawn(config, options).await.unwrap()
}

/// What one round of the polling client saw.
#[derive(Debug, Default)]
struct Seen {
    not_listening: usize,
    awaiting: usize,
}

/// The deployment script: poll `/health` until the first 200, then send a
/// request, which must be served. A 503 before that must be the startup
/// gate naming workers from `configured`, never anything else.
async fn poll_then_send(client: &HttpClient, addr: SocketAddr, configured: &[String]) -> Seen {
    let mut seen = Seen::default();
    let health = format!("http://{addr}/health");
    loop {
        match try_send(client, "GET", &health, "").await {
            None => seen.not_listening += 1,
            Some((StatusCode::OK, _)) => break,
            Some((StatusCode::SERVICE_UNAVAILABLE, body)) => {
                assert_eq!(body["error"]["code"], "awaiting_workers", "{body}");
                let awaited = body["error"]["awaited_workers"].as_array().unwrap();
                assert!(!awaited.is_empty(), "{body}");
                for name in awaited {
                    assert!(
                        configured.iter().any(|url| name == url),
                        "{name} is not a configured worker: {body}"
                    );
                }
                seen.awaiting += 1;
            }
            Some(other) => panic!("/health answered {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let chat = format!("http://{addr}/v1/chat/completions");
    let (status, body) = send(client, "POST", &chat, CHAT).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "the first request after /health 200: {body}"
    );
    seen
}

/// Many rounds, each a fresh router started on engines that warm up for a
/// while, with a client polling from before the router even listens: the
/// first `/health` 200 always means the next request is served. The
/// warm-ups only vary the interleaving; nothing here depends on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_on_the_first_health_200_is_served() {
    tokio::time::timeout(Duration::from_secs(180), async {
        let client = client();
        let mut totals = Seen::default();
        for round in 0..12u64 {
            let warmup = Duration::from_millis([0, 10, 30, 60][(round % 4) as usize]);
            let port = free_port().to_string();
            let mut args = vec!["--port", &port, "--prometheus-port", "0"];
            let mut engines = Vec::new();
            let urls: Vec<String>;
            let bootstrap;
            match round % 3 {
                // Regular workers, one or two data-parallel ranks each.
                0 | 1 => {
                    for _ in 0..2 {
                        engines.push(
                            warming_engine(Role::Regular, warmup, ServeOptions::default()).await,
                        );
                    }
                    urls = engines.iter().map(EngineHandle::url).collect();
                    args.push("--worker-urls");
                    args.extend(urls.iter().map(String::as_str));
                    if round % 3 == 1 {
                        args.extend(["--intra-node-data-parallel-size", "2"]);
                    }
                }
                // Static prefill and decode workers over Mooncake (the
                // prefill joins after its bootstrap server answered).
                _ => {
                    let transfers = TransferRegistry::new();
                    let prefill = warming_engine(
                        Role::Prefill,
                        warmup,
                        ServeOptions {
                            registry: Some(transfers.clone()),
                            bootstrap_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
                            ..ServeOptions::default()
                        },
                    )
                    .await;
                    let decode = warming_engine(
                        Role::Decode,
                        warmup,
                        ServeOptions {
                            registry: Some(transfers),
                            ..ServeOptions::default()
                        },
                    )
                    .await;
                    bootstrap = prefill.bootstrap_addr().unwrap().port().to_string();
                    urls = vec![prefill.url(), decode.url()];
                    engines.extend([prefill, decode]);
                    args.extend([
                        "--vllm-pd-disaggregation",
                        "--kv-connector",
                        "mooncake",
                        "--prefill",
                        &urls[0],
                        &bootstrap,
                        "--decode",
                        &urls[1],
                    ]);
                }
            }
            let mut settings = settings(&args);
            // Probe often, so that rounds are quick (the flag is in seconds).
            settings.router.worker_startup_check_interval = Duration::from_millis(5);
            let starting = tokio::spawn(async move { App::start(&settings).await });
            let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
            let seen = poll_then_send(&client, addr, &urls).await;
            totals.not_listening += seen.not_listening;
            totals.awaiting += seen.awaiting;
            let app = starting.await.unwrap().expect("the router starts");
            assert_eq!(app.stop().await, StopOutcome::Drained);
            for engine in engines {
                engine.shutdown().await;
            }
        }
        eprintln!(
            "polls before the listener: {}, 503s naming awaited workers: {}",
            totals.not_listening, totals.awaiting
        );
    })
    .await
    .expect("12 rounds within 180 s");
}

/// While a configured worker is not up, `/health` and `/readiness` answer
/// 503 naming it and `/liveness` answers 200; once it is up and added,
/// `/health` is 200 and the first request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_names_the_awaited_worker_while_liveness_answers() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let client = client();
        // The worker's port stays closed until this test starts its engine.
        let engine_addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let url = format!("http://{engine_addr}");
        let port = free_port().to_string();
        let mut settings = settings(&[
            "--port",
            &port,
            "--prometheus-port",
            "0",
            "--worker-urls",
            &url,
        ]);
        settings.router.worker_startup_check_interval = Duration::from_millis(5);
        let starting = tokio::spawn(async move { App::start(&settings).await });
        let base = format!("http://127.0.0.1:{port}");

        let liveness = format!("{base}/liveness");
        let status = loop {
            match try_send(&client, "GET", &liveness, "").await {
                Some((status, _)) => break status,
                None => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        };
        assert_eq!(
            status,
            StatusCode::OK,
            "/liveness from the moment it listens"
        );
        let (status, body) = send(&client, "GET", &format!("{base}/health"), "").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(body["error"]["code"], "awaiting_workers");
        assert_eq!(body["error"]["awaited_workers"], serde_json::json!([url]));
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(&url), "{message}");
        let (status, body) = send(&client, "GET", &format!("{base}/readiness"), "").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(body["awaited_workers"], serde_json::json!([url]));

        let engine = affinity_router::sim::spawn(
            EngineConfig::instant(),
            ServeOptions {
                addr: engine_addr,
                ..ServeOptions::default()
            },
        )
        .await
        .unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        poll_then_send(&client, addr, std::slice::from_ref(&url)).await;
        let (status, body) = send(&client, "GET", &format!("{base}/readiness"), "").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let app = starting.await.unwrap().expect("the router starts");
        assert_eq!(app.stop().await, StopOutcome::Drained);
        engine.shutdown().await;
    })
    .await
    .expect("within 60 s");
}

/// vllm-router's command line without a worker source: no workers at all,
/// `/health` 200 at once, and the banner's `curl` adds one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flags_without_workers_start_an_empty_fleet_that_add_worker_fills() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let client = client();
        let settings = settings(&[
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--policy",
            "round_robin",
            "--prometheus-port",
            "0",
        ]);
        let app = App::start(&settings).await.unwrap();
        assert_eq!(app.engines().count(), 0, "no simulated engines");
        let base = format!("http://{}", app.addr());
        let (status, body) = send(&client, "GET", &format!("{base}/list_workers"), "").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, serde_json::json!({"urls": []}));
        assert_eq!(
            send(&client, "GET", &format!("{base}/health"), "").await.0,
            StatusCode::OK
        );

        let banner = app.banner();
        assert!(banner.contains("an empty fleet"), "{banner}");
        let add = banner
            .lines()
            .find(|line| line.contains("/add_worker"))
            .unwrap_or_else(|| panic!("the banner shows how to add a worker:\n{banner}"));
        assert!(add.contains("curl -s -X POST"), "{add}");
        // The banner's URL, with a real engine in place of its placeholder.
        let engine = affinity_router::sim::spawn(EngineConfig::instant(), ServeOptions::default())
            .await
            .unwrap();
        let add_url = add
            .split('\'')
            .find(|part| part.starts_with("http://"))
            .expect("a quoted URL")
            .replace("http://HOST:PORT", &engine.url());
        let (status, body) = send(&client, "POST", &add_url, "").await;
        assert!(status.is_success(), "{status} {body}");
        let (_, body) = send(&client, "GET", &format!("{base}/list_workers"), "").await;
        assert_eq!(body, serde_json::json!({"urls": [engine.url()]}));
        let chat = format!("{base}/v1/chat/completions");
        assert_eq!(send(&client, "POST", &chat, CHAT).await.0, StatusCode::OK);
        assert_eq!(app.stop().await, StopOutcome::Drained);
        engine.shutdown().await;
    })
    .await
    .expect("within 60 s");
}
