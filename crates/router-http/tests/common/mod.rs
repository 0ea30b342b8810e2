//! Shared harness: engine-sim engines and a router on 127.0.0.1, and a raw
//! HTTP client whose connections the tests control.

#![allow(dead_code, unreachable_pub)] // Each test file uses a different part.

use bytes::Bytes;
use engine_sim::{EngineConfig, EngineHandle, ServeOptions};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use router_http::{Router, RouterConfig};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use worker_lifecycle::Worker;

/// A router serving on a free loopback port, and the engines behind it.
pub struct Fixture {
    pub router: Router,
    pub addr: SocketAddr,
    pub engines: Vec<EngineHandle>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<router_http::ShutdownOutcome>>,
}

impl Fixture {
    /// Starts `engines` and a router over them with `config`.
    pub async fn start(config: RouterConfig, engines: Vec<EngineConfig>) -> Self {
        let mut handles = Vec::new();
        for engine in engines {
            handles.push(
                engine_sim::spawn(engine, ServeOptions::default())
                    .await
                    .unwrap(),
            );
        }
        let urls: Vec<String> = handles.iter().map(EngineHandle::url).collect();
        Self::start_with_urls(config, handles, &urls).await
    }

    /// Starts a router over `urls` (which may include dead ones), keeping
    /// `engines` alive.
    pub async fn start_with_urls(
        config: RouterConfig,
        engines: Vec<EngineHandle>,
        urls: &[String],
    ) -> Self {
        let router = Router::new(config).unwrap();
        for url in urls {
            router.add_worker(url, None, None).unwrap();
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let serving = router.clone();
        let server = tokio::spawn(async move {
            serving
                .serve(listener, async {
                    let _ = stopped.await;
                })
                .await
        });
        Self {
            router,
            addr,
            engines,
            stop: Some(stop),
            server: Some(server),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn workers(&self) -> Arc<[Arc<Worker>]> {
        self.router.workers()
    }

    /// Waits (bounded) until every worker's load is 0, then checks that no
    /// decrement was ever clamped.
    pub async fn assert_all_loads_return_to_zero(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let loads: Vec<usize> = self.workers().iter().map(|w| w.load()).collect();
            if loads.iter().all(|&l| l == 0) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "loads did not return to 0: {loads:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for worker in self.workers().iter() {
            assert_eq!(worker.underflows(), 0, "underflow on {}", worker.url());
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.router.in_flight() != 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "admission permits leaked"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Sends the shutdown signal without waiting for the server to stop.
    pub fn signal_shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Waits for the server to stop (after [`signal_shutdown`](Self::signal_shutdown)).
    pub async fn stopped(mut self) -> router_http::ShutdownOutcome {
        self.server.take().unwrap().await.unwrap()
    }

    /// Stops the router gracefully and returns how it ended.
    pub async fn shutdown(mut self) -> router_http::ShutdownOutcome {
        let _ = self.stop.take().unwrap().send(());
        self.server.take().unwrap().await.unwrap()
    }
}

/// A chat completion body.
pub fn chat_body(content: &str, stream: bool) -> String {
    serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "stream": stream,
    })
    .to_string()
}

/// One HTTP/1.1 connection the test owns (dropping it closes the socket).
pub struct Connection {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

impl Connection {
    pub async fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(connection);
        Self { sender }
    }

    pub async fn send(
        &mut self,
        method: &str,
        uri: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> http::Response<Incoming> {
        let mut request = http::Request::builder()
            .method(method)
            .uri(uri)
            .header("host", "router");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body.into())).unwrap();
        self.sender.send_request(request).await.unwrap()
    }
}

/// Sends one request on a fresh connection and reads the whole response.
pub async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> (http::StatusCode, http::HeaderMap, Bytes) {
    let mut connection = Connection::open(addr).await;
    let response = connection.send(method, path, headers, body).await;
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, bytes)
}

/// Starts `n` engines with `config` that publish their KV events (a PUB
/// socket and a replay socket on free loopback ports).
#[cfg(feature = "kv-events")]
pub async fn kv_engines(config: EngineConfig, n: usize) -> Vec<EngineHandle> {
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut handles = Vec::new();
    for _ in 0..n {
        let options = ServeOptions {
            kv_events: Some(engine_sim::KvEventsOptions::new(loopback).with_replay(loopback)),
            ..ServeOptions::default()
        };
        handles.push(engine_sim::spawn(config.clone(), options).await.unwrap());
    }
    handles
}

/// A router's KV events configuration following where each of `engines`
/// publishes (by worker URL), its liveness re-read every 20 ms.
#[cfg(feature = "kv-events")]
pub fn kv_events_config(engines: &[EngineHandle]) -> router_http::kv_events::KvEventsConfig {
    use router_http::kv_events::{KvEndpoints, KvEventsConfig};
    let mut config = KvEventsConfig::default();
    config.sync_interval = Duration::from_millis(20);
    for engine in engines {
        config = config.with_endpoints(
            engine.url(),
            KvEndpoints::new(format!("tcp://{}", engine.kv_events_addr().unwrap())).with_replays(
                engine
                    .kv_events_replay_addr()
                    .map(|addr| format!("tcp://{addr}")),
            ),
        );
    }
    config
}

/// Waits (bounded) until `fixture`'s index has applied at least `blocks`
/// stored blocks: the engines' events are asynchronous, as in production.
#[cfg(feature = "kv-events")]
pub async fn wait_for_blocks(fixture: &Fixture, blocks: u64) {
    let hub = fixture
        .router
        .kv_events()
        .expect("kv_aware has a hub")
        .clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while hub.index().counters().stored_blocks < blocks {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the index applied {} of {blocks} blocks",
            hub.index().counters().stored_blocks
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The JSON of a body.
pub fn json(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes)
        .unwrap_or_else(|err| panic!("not JSON ({err}): {}", String::from_utf8_lossy(bytes)))
}
