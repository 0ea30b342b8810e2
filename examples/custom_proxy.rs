//! A minimal reverse proxy written directly on hyper that embeds
//! `lb-policies` for placement and `worker-lifecycle`'s load guards for
//! in-flight accounting — no `router-http`.
//!
//! What a proxy author needs, in order:
//!
//! 1. **Its own backend type** ([`Upstream`]: the proxy's upstream address
//!    next to a `worker_lifecycle::Worker`) implementing
//!    `lb_policies::Backend` by reading the worker's live counters.
//! 2. **A policy registry** (`cache_aware`, one instance per model) told
//!    about the fleet with membership events.
//! 3. **Per request:** read the body, derive the routing text, select,
//!    `try_reserve` the chosen worker, forward, and move the guard into the
//!    response body ([`GuardedBody`]) so the load stays counted until the
//!    last byte reaches the client — or the client goes away and the body
//!    is dropped.
//!
//! The proxy starts three `engine-sim` engines (no simulated latency) on
//! 127.0.0.1 and serves on 127.0.0.1:8080 (`--port N` to change) until
//! Ctrl-C.
//!
//! Run:
//!
//! ```text
//! cargo run --release --example custom_proxy
//! curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \
//!   -d '{"model":"sim-model","messages":[{"role":"user","content":"Hello"}]}'
//! ```
//!
//! With `--self-test` (or `CUSTOM_PROXY_SELF_TEST=1`) it binds a free port,
//! sends a few requests to itself, checks that they succeeded, that a
//! repeated conversation stayed on its engine and that every load returned
//! to zero, then exits (status 0 on success).
use std::convert::Infallible;
use std::error::Error;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use lb_policies::{Backend, MembershipEvent, PolicyConfig, PolicyRegistry, RequestContext};
use tokio::net::TcpListener;
use worker_lifecycle::{
    Endpoint, LoadGuard, Outcome, Worker, WorkerOptions, WorkerRole, WorkerSpec,
};

type BoxError = Box<dyn Error + Send + Sync>;
type ProxyBody = http_body_util::combinators::BoxBody<Bytes, BoxError>;

const ENGINES: usize = 3;
const MAX_BODY: usize = 16 << 20;
/// Request headers that describe the client's connection, not the request,
/// and so are not forwarded (hyper sets `host` and the framing itself).
const HOP_BY_HOP: [&str; 9] = [
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The proxy's own backend type: where to send requests, plus the
/// lifecycle worker whose atomics the policies read and whose guards count
/// the load.
struct Upstream {
    authority: Authority,
    worker: Arc<Worker>,
}

impl Backend for Upstream {
    fn key(&self) -> &str {
        self.worker.key()
    }
    fn load(&self) -> usize {
        self.worker.load()
    }
    fn processed(&self) -> u64 {
        self.worker.processed()
    }
    fn is_available(&self) -> bool {
        self.worker.is_available()
    }
}

struct Proxy {
    upstreams: Vec<Arc<Upstream>>,
    policies: PolicyRegistry<Arc<Upstream>>,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Proxy {
    fn new(urls: &[String]) -> Result<Self, BoxError> {
        let policies = PolicyRegistry::new(PolicyConfig::named("cache_aware"))?;
        let options = WorkerOptions::default();
        let mut upstreams = Vec::new();
        for url in urls {
            let endpoint = Endpoint::new(url, None)?;
            let authority: Authority = url.trim_start_matches("http://").parse()?;
            let worker = Worker::new(WorkerSpec::new(WorkerRole::Regular, endpoint), 0, &options);
            policies.on_membership(MembershipEvent::Added { key: worker.key() });
            upstreams.push(Arc::new(Upstream { authority, worker }));
        }
        let client = Client::builder(TokioExecutor::new()).build_http();
        Ok(Proxy {
            upstreams,
            policies,
            client,
        })
    }

    async fn handle(&self, request: Request<Incoming>) -> Response<ProxyBody> {
        match self.forward(request).await {
            Ok(response) => response,
            Err((status, message)) => {
                let body = serde_json::json!({"error": {"message": message}}).to_string();
                let mut response = Response::new(full(body));
                *response.status_mut() = status;
                response
            }
        }
    }

    async fn forward(
        &self,
        request: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, (StatusCode, String)> {
        let (parts, body) = request.into_parts();
        let bytes = Limited::new(body, MAX_BODY)
            .collect()
            .await
            .map_err(|err| {
                let status = if err.is::<http_body_util::LengthLimitError>() {
                    StatusCode::PAYLOAD_TOO_LARGE
                } else {
                    StatusCode::BAD_REQUEST
                };
                (status, format!("reading the body: {err}"))
            })?
            .to_bytes();
        let (model, text) = routing_text(&bytes);
        let mut ctx = RequestContext::new(&model);
        if let Some(text) = &text {
            ctx = ctx.with_text(text);
        }

        let bad_gateway = |message: String| (StatusCode::BAD_GATEWAY, message);
        let decision = self
            .policies
            .select(&self.upstreams, &ctx)
            .map_err(|err| bad_gateway(err.to_string()))?
            .ok_or_else(|| {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no upstream available".to_owned(),
                )
            })?;
        let upstream = &self.upstreams[decision.index];
        // The guard is the load: from here on, every exit path releases it
        // exactly once, by dropping it at the latest.
        let guard = upstream
            .worker
            .try_reserve()
            .map_err(|err| (StatusCode::SERVICE_UNAVAILABLE, err.to_string()))?;

        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let uri = format!("http://{}{path}", upstream.authority);
        let mut outgoing = Request::builder().method(parts.method).uri(uri);
        for (name, value) in &parts.headers {
            if !HOP_BY_HOP.contains(&name.as_str()) {
                outgoing = outgoing.header(name, value);
            }
        }
        let outgoing = outgoing
            .body(Full::new(bytes))
            .map_err(|err| bad_gateway(err.to_string()))?;

        let response = match self.client.request(outgoing).await {
            Ok(response) => response,
            Err(err) => {
                guard.record_outcome(if err.is_connect() {
                    Outcome::ConnectError
                } else {
                    Outcome::ConnectionReset
                });
                return Err(bad_gateway(format!("upstream: {err}")));
            }
        };
        let status = response.status();
        if !status.is_success() {
            guard.record_outcome(Outcome::from_status(status.as_u16()));
        }
        let (parts, body) = response.into_parts();
        let body = GuardedBody {
            inner: body,
            guard: Some(guard),
        };
        Ok(Response::from_parts(parts, body.boxed()))
    }
}

/// The model and the routing text of an OpenAI-style body: chat messages
/// rendered in order (so turn n is a prefix of turn n + 1), or a
/// completion's prompt. A real proxy would use `router_http::extract`; this
/// one shows that any text whose prefixes follow the engine's cache works.
fn routing_text(body: &[u8]) -> (String, Option<String>) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return (String::new(), None);
    };
    let model = value["model"].as_str().unwrap_or_default().to_owned();
    let text = if let Some(messages) = value["messages"].as_array() {
        let mut text = String::new();
        for message in messages {
            text.push_str(message["role"].as_str().unwrap_or_default());
            text.push('\n');
            text.push_str(message["content"].as_str().unwrap_or_default());
            text.push('\n');
        }
        Some(text)
    } else {
        value["prompt"].as_str().map(str::to_owned)
    };
    (model, text)
}

/// A response body that owns the request's load guard: the load is
/// released when the stream ends (with its outcome) or when the body is
/// dropped — the client went away — whichever comes first.
struct GuardedBody {
    inner: Incoming,
    guard: Option<LoadGuard>,
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => {
                if let Some(guard) = self.guard.take() {
                    guard.record_outcome(Outcome::Success);
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(guard) = self.guard.take() {
                    guard.record_outcome(Outcome::ConnectionReset);
                }
            }
            Poll::Ready(Some(Ok(_))) | Poll::Pending => {}
        }
        polled.map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

fn full(text: impl Into<Bytes>) -> ProxyBody {
    Full::new(text.into())
        .map_err(|never| match never {})
        .boxed()
}

/// Accepts connections until `shutdown` resolves.
async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    eprintln!("accept failed: {err}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let proxy = Arc::clone(&proxy);
                async move { Ok::<_, Infallible>(proxy.handle(request).await) }
            });
            if let Err(err) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                eprintln!("connection error: {err}");
            }
        });
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let self_test = args.iter().any(|a| a == "--self-test")
        || std::env::var_os("CUSTOM_PROXY_SELF_TEST").is_some_and(|v| v == "1");
    let port: u16 = match args.iter().position(|a| a == "--port") {
        Some(i) => args.get(i + 1).ok_or("--port needs a value")?.parse()?,
        None if self_test => 0,
        None => 8080,
    };

    let mut engines = Vec::new();
    for _ in 0..ENGINES {
        engines.push(
            engine_sim::spawn(
                engine_sim::EngineConfig::instant(),
                engine_sim::ServeOptions::default(),
            )
            .await?,
        );
    }
    let urls: Vec<String> = engines.iter().map(|e| e.url()).collect();
    let proxy = Arc::new(Proxy::new(&urls)?);
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await?;
    let addr = listener.local_addr()?;
    println!(
        "custom_proxy on http://{addr}, forwarding to {}",
        urls.join(", ")
    );

    let result = if self_test {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, Arc::clone(&proxy), async {
            let _ = stopped.await;
        }));
        let result = self_test_run(addr, &proxy, &engines).await;
        let _ = stop.send(());
        server.await?;
        result
    } else {
        serve(listener, Arc::clone(&proxy), async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
        println!("stopping");
        Ok(())
    };
    for engine in engines {
        engine.shutdown().await;
    }
    result
}

/// Sends requests to the proxy and checks what a proxy author cares about.
async fn self_test_run(
    addr: SocketAddr,
    proxy: &Proxy,
    engines: &[engine_sim::EngineHandle],
) -> Result<(), BoxError> {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let system = "You are a terse assistant who answers in one sentence. ".repeat(8);
    let mut first_engine = None;
    let mut sent = 0u64;
    for turn in 0..3 {
        for (user, stream) in [
            ("What is a radix tree?", false),
            ("Name a prime number.", true),
        ] {
            let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
            for t in 0..=turn {
                messages.push(
                    serde_json::json!({"role": "user", "content": format!("{user} (turn {t})")}),
                );
            }
            let body = serde_json::json!({"model": "sim-model", "messages": messages, "stream": stream, "max_tokens": 8});
            let request = Request::post(format!("http://{addr}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string())))?;
            let response = client.request(request).await?;
            let status = response.status();
            let engine = response
                .headers()
                .get("x-worker-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let text = response.into_body().collect().await?.to_bytes();
            sent += 1;
            if status != StatusCode::OK {
                return Err(format!("status {status}: {}", String::from_utf8_lossy(&text)).into());
            }
            if !String::from_utf8_lossy(&text).contains("choices") {
                return Err("the answer has no choices".into());
            }
            println!(
                "turn {turn}, stream {stream}: 200 from {}",
                engine.as_deref().unwrap_or("?")
            );
            if !stream {
                // The growing conversation keeps its prefix, so it should keep its engine.
                match (&first_engine, engine) {
                    (None, engine) => first_engine = engine,
                    (Some(first), Some(engine)) if *first != engine => {
                        return Err(
                            format!("the conversation moved from {first} to {engine}").into()
                        );
                    }
                    _ => {}
                }
            }
        }
    }

    // The last byte reached the client, so the guards end as the server
    // finishes each body; allow the server a moment to get there.
    let settled = async {
        while proxy.upstreams.iter().any(|u| u.worker.load() != 0) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), settled)
        .await
        .map_err(|_| "a load guard was never released")?;
    let processed: u64 = proxy.upstreams.iter().map(|u| u.worker.processed()).sum();
    let underflows: u64 = proxy.upstreams.iter().map(|u| u.worker.underflows()).sum();
    let engine_load: u64 = engines.iter().map(|e| e.server_load()).sum();
    println!(
        "loads back to 0; {processed} requests processed, {underflows} underflows, engine load {engine_load}"
    );
    if processed != sent || underflows != 0 {
        return Err(format!("processed {processed} of {sent}, {underflows} underflows").into());
    }
    println!("self-test ok");
    Ok(())
}
