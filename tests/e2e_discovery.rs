//! ZMQ registration discovery end to end: engine-sim prefill and decode
//! engines, a test client that registers them over a real DEALER socket,
//! and requests through the router while they heartbeat, fall silent and
//! come back.

use affinity_router::cli::args::Args;
use affinity_router::cli::{App, Settings, StopOutcome};
use affinity_router::sim::{EngineConfig, EngineHandle, Role, ServeOptions};
use affinity_router::workers::RoleKind;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::sync::Arc;
use std::time::{Duration, Instant};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

const CHAT: &str =
    r#"{"model": "sim-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}"#;

async fn chat(client: &HttpClient, base: &str) -> (StatusCode, String) {
    let request = Request::post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(CHAT.as_bytes())))
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        let response = client.request(request).await.unwrap();
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    })
    .await
    .expect("answered in time")
}

/// A test engine's DEALER (libzmq) connected to the discovery ROUTER; it
/// queues what is sent until the connection is made.
fn engine_dealer(address: std::net::SocketAddr) -> zmq::Socket {
    let socket = zmq::Context::new().socket(zmq::DEALER).unwrap();
    socket.set_linger(0).unwrap();
    socket.connect(&format!("tcp://{address}")).unwrap();
    socket
}

fn registration(kind: &str, engine: &EngineHandle) -> Vec<u8> {
    let map = serde_json::json!({
        "type": kind,
        "http_address": engine.addr().to_string(),
        "zmq_address": format!("127.0.0.1:{}", engine.addr().port() + 1),
    });
    rmp_serde::to_vec_named(&map).unwrap()
}

/// An engine speaking the router's default connector.
async fn engine(role: Role) -> EngineHandle {
    let (kv_connector, moriio_mode) =
        affinity_router::sim::for_deployment(Args::default().kv_connector).unwrap();
    let config = EngineConfig {
        role,
        kv_connector,
        moriio_mode,
        ..EngineConfig::instant()
    };
    affinity_router::sim::spawn(config, ServeOptions::default())
        .await
        .unwrap()
}

/// The prefill worker the router's pool holds, as last reconciled.
fn prefill_worker(app: &App) -> Option<Arc<affinity_router::workers::Worker>> {
    app.router()
        .all_workers()
        .into_iter()
        .find(|w| w.role().kind() == RoleKind::Prefill)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_engines_serve_heartbeats_keep_them_and_silence_expires_them() {
    let prefill = engine(Role::Prefill).await;
    let decode = engine(Role::Decode).await;
    let ttl_secs = 1;
    let args = [
        "router",
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--vllm-pd-disaggregation",
        "--vllm-discovery-address",
        "127.0.0.1:0",
        "--vllm-discovery-ttl-secs",
        "1",
    ];
    let app = App::start(&Settings::from_args(args).unwrap())
        .await
        .unwrap();
    let discovery = app.discovery().expect("the discovery listener runs");
    assert!(app.banner().contains(&discovery.local_addr().to_string()));
    let base = format!("http://{}", app.addr());
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();

    // Nobody registered yet: no worker in either role.
    let (status, body) = chat(&client, &base).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");

    let socket = engine_dealer(discovery.local_addr());
    socket.send(registration("P", &prefill), 0).unwrap();
    socket.send(registration("D", &decode), 0).unwrap();

    // Requests flow once both registrations arrived.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, body) = chat(&client, &base).await;
        if status == StatusCode::OK {
            break;
        }
        assert!(Instant::now() < deadline, "never served: {status} {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let first = prefill_worker(&app).expect("a prefill worker");
    let first_generation = first.generation();
    assert_eq!(first.endpoint().to_string(), prefill.url());
    assert_eq!(decode.stats().kv_transfers_valid, 1);

    // Heartbeats for twice the TTL: the same worker serves every request.
    let until = Instant::now() + Duration::from_secs(2 * ttl_secs);
    while Instant::now() < until {
        socket.send(registration("P", &prefill), 0).unwrap();
        socket.send(registration("D", &decode), 0).unwrap();
        let (status, body) = chat(&client, &base).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let same = prefill_worker(&app).unwrap();
    assert!(Arc::ptr_eq(&same, &first), "heartbeats keep the worker");
    assert_eq!(same.generation(), first_generation);
    assert!(same.processed() >= 5, "processed {}", same.processed());
    assert_eq!(same.load(), 0);

    // Silence: both expire, and the router answers 503.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, body) = chat(&client, &base).await;
        if status == StatusCode::SERVICE_UNAVAILABLE {
            assert!(
                body.contains("prefill") || body.contains("decode"),
                "{body}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "never expired: {status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Registering again at the same URL: a fresh worker with load 0.
    socket.send(registration("P", &prefill), 0).unwrap();
    socket.send(registration("D", &decode), 0).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, _) = chat(&client, &base).await;
        if status == StatusCode::OK {
            break;
        }
        assert!(Instant::now() < deadline, "never served again: {status}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let fresh = prefill_worker(&app).unwrap();
    assert!(!Arc::ptr_eq(&fresh, &first));
    assert!(fresh.generation() > first_generation);
    assert_eq!(
        fresh.processed(),
        1,
        "fresh state: only the request just served"
    );
    assert_eq!(fresh.load(), 0);
    assert_eq!(app.discovery().unwrap().malformed_messages(), 0);

    assert_eq!(app.stop().await, StopOutcome::Drained);
    prefill.shutdown().await;
    decode.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_can_register_over_http_with_the_admin_key() {
    let prefill = engine(Role::Prefill).await;
    let decode = engine(Role::Decode).await;
    let args = [
        "router",
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--vllm-pd-disaggregation",
        "--vllm-discovery-address",
        "127.0.0.1:0",
        "--admin-api-key",
        "admin-key",
    ];
    let app = App::start(&Settings::from_args(args).unwrap())
        .await
        .unwrap();
    let base = format!("http://{}", app.addr());
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let register = |body: serde_json::Value, key: Option<&str>| {
        let mut request =
            Request::post(format!("{base}/register")).header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let client = client.clone();
        async move {
            let response = client.request(request).await.unwrap();
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8_lossy(&body).into_owned())
        }
    };
    let p = serde_json::json!({"type": "P", "http_address": prefill.addr().to_string()});
    let d = serde_json::json!({"type": "D", "http_address": decode.addr().to_string()});

    let (status, _) = register(p.clone(), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = register(p.clone(), Some("wrong")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, body) = register(serde_json::json!({"type": "X"}), Some("admin-key")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("invalid registration"), "{body}");

    let (status, body) = register(p.clone(), Some("admin-key")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["role"], "prefill");
    assert_eq!(answer["url"], prefill.url());
    let generation = answer["generation"].as_u64().unwrap();
    let (status, body) = register(d, Some("admin-key")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // Registering again within the TTL is a heartbeat: same generation.
    let (_, body) = register(p, Some("admin-key")).await;
    let again: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(again["generation"].as_u64(), Some(generation));

    let (status, body) = chat(&client, &base).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(decode.stats().kv_transfers_valid, 1);
    assert_eq!(app.discovery().unwrap().malformed_messages(), 1);
    // /metrics shows the listener (with the admin key, which it needs now).
    let request = Request::get(format!("{base}/metrics"))
        .header("authorization", "Bearer admin-key")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let metrics = String::from_utf8_lossy(&body);
    for line in [
        "router_discovery_receiving 1",
        "router_discovery_receive_restarts_total 0",
        "router_discovery_refused_total{reason=\"malformed\"} 1",
        "router_discovery_refused_total{reason=\"address\"} 0",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "{line} not in {metrics}"
        );
    }
    assert_eq!(app.stop().await, StopOutcome::Drained);
    prefill.shutdown().await;
    decode.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moriio_engines_register_in_their_own_form() {
    let connector = "moriio";
    let (kv_connector, moriio_mode) =
        affinity_router::sim::for_deployment(connector.parse().unwrap()).unwrap();
    let spawn = |role| async move {
        let config = EngineConfig {
            role,
            kv_connector,
            moriio_mode,
            ..EngineConfig::instant()
        };
        affinity_router::sim::spawn(config, ServeOptions::default())
            .await
            .unwrap()
    };
    let prefill = spawn(Role::Prefill).await;
    let decode = spawn(Role::Decode).await;
    let args = [
        "router",
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--vllm-pd-disaggregation",
        "--kv-connector",
        connector,
        "--vllm-discovery-address",
        "127.0.0.1:0",
    ];
    let app = App::start(&Settings::from_args(args).unwrap())
        .await
        .unwrap();
    let discovery = app.discovery().unwrap();
    let socket = engine_dealer(discovery.local_addr());
    for (role, engine, ports) in [("P", &prefill, (7101, 7102)), ("D", &decode, (7201, 7202))] {
        let map = serde_json::json!({
            "type": "register", "role": role,
            "request_address": format!("{}/v1/completions", engine.url()),
            "handshake_port": ports.0, "notify_port": ports.1, "dp_size": 1, "tp_size": 1,
            "transfer_mode": "READ",
        });
        socket
            .send(rmp_serde::to_vec_named(&map).unwrap(), 0)
            .unwrap();
    }
    let base = format!("http://{}", app.addr());
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, body) = chat(&client, &base).await;
        if status == StatusCode::OK {
            break;
        }
        assert!(Instant::now() < deadline, "never served: {status} {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(decode.stats().kv_transfers_valid, 1);
    assert_eq!(discovery.malformed_messages(), 0);
    assert_eq!(app.stop().await, StopOutcome::Drained);
    prefill.shutdown().await;
    decode.shutdown().await;
}
