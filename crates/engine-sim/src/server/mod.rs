//! The HTTP server: one [`Engine`] behind vLLM's OpenAI endpoints, driven in
//! real (tokio) time. This module binds, accepts, drives the model and
//! routes requests; the rest of the server lives beside it:
//!
//! - `generate`: the two generation endpoints, from request to response;
//! - `format`: how engine events become SSE chunks or one JSON answer;
//! - `body`: [`SimBody`], the response body of every route, and the guards
//!   it owns;
//! - `publish` (feature `kv-events`): the prefix cache's changes as vLLM's
//!   KV-cache events (`KvEventsOptions`);
//! - `reset`: the TCP stream that can end with a reset, for the
//!   `reset-mid-body` fault.
//!
//! Model time and tokio time are tied by [`EngineConfig::time_scale`]:
//! `model = elapsed / scale`. With scale 0 steps complete as soon as they
//! start and model time otherwise follows tokio time. A driver task sleeps
//! until the engine's next event and dispatches events to the requests'
//! bodies. Every timer is a tokio timer, so tests run it under paused time.
//!
//! A response body owns two guards: one keeps `/load` counting until the
//! body ends or is dropped, the other aborts the request in the engine (its
//! blocks are freed) if the client goes away before the end.

mod body;
mod format;
mod generate;
#[cfg(feature = "kv-events")]
mod publish;
mod reset;

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use parking_lot::Mutex;
use prompt_tokens::PromptTokenizer;
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::api::{Endpoint, EngineApiError};
use crate::config::EngineConfig;
use crate::engine::{Engine, EngineEvent, EngineStats, EventKind, PdSettings, RequestId};
use crate::metrics::{self, ServerCounters};
use crate::transfer::{ProducerAddress, TransferRegistry};

pub use body::{BodyError, SimBody};
#[cfg(feature = "kv-events")]
pub use publish::KvEventsOptions;

use generate::generate;
#[cfg(feature = "kv-events")]
use publish::{bind_kv_events, queue_kv_events};
use reset::ResettableStream;

/// The header naming the engine on every response.
pub const WORKER_ID_HEADER: &str = "x-worker-id";

/// How long a graceful shutdown waits for in-flight responses.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Where and with whom an engine serves.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The address to bind; port 0 picks a free port. Default `127.0.0.1:0`.
    pub addr: SocketAddr,
    /// The transfer registry shared with the other engines of this process;
    /// `None` accepts any well-formed `kv_transfer_params`.
    pub registry: Option<Arc<TransferRegistry>>,
    /// A second address serving the same API, for Mooncake's bootstrap
    /// `GET /query`. Default none.
    pub bootstrap_addr: Option<SocketAddr>,
    /// The largest request body accepted. Default 32 MiB.
    pub max_body_bytes: usize,
    /// The model's tokenizer and chat template. `Some`: a chat's prompt ids
    /// are [`PromptTokenizer::chat_tokens`] of the request body and a
    /// completion's [`PromptTokenizer::completion_tokens`], and the prefix
    /// cache, `usage.prompt_tokens`, `cached_tokens` and the latency model
    /// all count those ids; a prompt that cannot be rendered or tokenized
    /// is a 400 with the error's message. `None` (the default): the
    /// synthetic rule with [`ModelConfig::chars_per_token`](crate::ModelConfig).
    /// Here rather than in [`EngineConfig`], which stays plain serializable
    /// data; share one tokenizer between engines of the same model.
    pub tokenizer: Option<Arc<PromptTokenizer>>,
    /// Publish the prefix cache's changes as vLLM's KV-cache events.
    /// Default `None` (no sockets, no recording).
    #[cfg(feature = "kv-events")]
    pub kv_events: Option<KvEventsOptions>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            registry: None,
            bootstrap_addr: None,
            max_body_bytes: 32 << 20,
            tokenizer: None,
            #[cfg(feature = "kv-events")]
            kv_events: None,
        }
    }
}

struct Core {
    engine: Engine,
    sinks: HashMap<RequestId, mpsc::UnboundedSender<EngineEvent>>,
    /// The publisher task's queue: batches are queued under the core lock,
    /// so they are numbered in step order. `None` when not publishing.
    #[cfg(feature = "kv-events")]
    kv_events: Option<mpsc::UnboundedSender<kv_events::EventBatch>>,
}

struct ServerState {
    config: EngineConfig,
    engine_id: String,
    worker_header: HeaderValue,
    core: Mutex<Core>,
    wake: Notify,
    registry_changed: Notify,
    registry: Option<Arc<TransferRegistry>>,
    start: Instant,
    next_id: AtomicU64,
    load: AtomicU64,
    generation_requests: AtomicU64,
    faults_injected: AtomicU64,
    /// The last [`TRACEPARENTS_KEPT`] `traceparent` headers received.
    traceparents: Mutex<std::collections::VecDeque<String>>,
    max_body_bytes: usize,
    tokenizer: Option<Arc<PromptTokenizer>>,
    bootstrap_port: Option<u16>,
    port: u16,
}

impl ServerState {
    fn scale(&self) -> f64 {
        self.config.time_scale
    }

    fn model_now(&self) -> Duration {
        let elapsed = self.start.elapsed();
        if self.scale() > 0.0 {
            Duration::try_from_secs_f64(elapsed.as_secs_f64() / self.scale())
                .unwrap_or(Duration::MAX)
        } else {
            elapsed
        }
    }

    fn wall_at(&self, model: Duration) -> Instant {
        let offset = if self.scale() > 0.0 {
            Duration::try_from_secs_f64(model.as_secs_f64() * self.scale())
                .unwrap_or(crate::fault::FOREVER)
        } else {
            model
        };
        self.start
            .checked_add(offset)
            .unwrap_or_else(|| self.start + crate::fault::FOREVER)
    }

    fn counters(&self) -> ServerCounters {
        ServerCounters {
            server_load: self.load.load(Ordering::Relaxed),
            faults_injected: self.faults_injected.load(Ordering::Relaxed),
        }
    }

    fn stats(&self) -> EngineStats {
        let stats = {
            let mut core = self.core.lock();
            // Apply transfer claims other engines made since the driver
            // last ran, so a scrape right after a decode sees them.
            let now = core.engine.now();
            core.engine.advance_to(now);
            dispatch(&mut core);
            core.engine.stats()
        };
        self.wake.notify_one();
        stats
    }
}

/// How many received `traceparent` headers an engine keeps
/// ([`EngineHandle::traceparents`]).
pub const TRACEPARENTS_KEPT: usize = 64;

/// A running engine. Dropping it stops the server (without waiting);
/// [`EngineHandle::shutdown`] stops it gracefully.
pub struct EngineHandle {
    addr: SocketAddr,
    bootstrap_addr: Option<SocketAddr>,
    shared: Arc<ServerState>,
    shutdown: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
    #[cfg(feature = "kv-events")]
    kv_events_addr: Option<SocketAddr>,
    #[cfg(feature = "kv-events")]
    kv_events_replay_addr: Option<SocketAddr>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("addr", &self.addr)
            .field("engine_id", &self.shared.engine_id)
            .finish()
    }
}

impl EngineHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ip:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bootstrap address, when one was requested.
    pub fn bootstrap_addr(&self) -> Option<SocketAddr> {
        self.bootstrap_addr
    }

    /// The KV-events PUB address as bound (the port chosen for port 0),
    /// when [`ServeOptions::kv_events`] was set. Subscribe at
    /// `tcp://{addr}`.
    #[cfg(feature = "kv-events")]
    pub fn kv_events_addr(&self) -> Option<SocketAddr> {
        self.kv_events_addr
    }

    /// The KV-events replay (ROUTER) address as bound, when replays are
    /// served.
    #[cfg(feature = "kv-events")]
    pub fn kv_events_replay_addr(&self) -> Option<SocketAddr> {
        self.kv_events_replay_addr
    }

    /// The chain hashes of every block in the engine's prefix cache now, in
    /// no particular order: the set a consumer of the KV events holds once
    /// it has applied every batch published so far.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        self.shared
            .core
            .lock()
            .engine
            .cache()
            .cached_hashes()
            .collect()
    }

    /// The engine id (also sent as `x-worker-id`).
    pub fn engine_id(&self) -> &str {
        &self.shared.engine_id
    }

    /// The engine model's counters and gauges.
    pub fn stats(&self) -> EngineStats {
        self.shared.stats()
    }

    /// In-flight generation requests, as `/load` reports.
    pub fn server_load(&self) -> u64 {
        self.shared.load.load(Ordering::Relaxed)
    }

    /// Faults injected so far.
    pub fn faults_injected(&self) -> u64 {
        self.shared.faults_injected.load(Ordering::Relaxed)
    }

    /// The W3C `traceparent` headers of the last requests received (at
    /// most [`TRACEPARENTS_KEPT`], oldest first), as sent. The engine does
    /// not trace; this lets a test check the trace context a router
    /// propagates, as vLLM would join it.
    pub fn traceparents(&self) -> Vec<String> {
        self.shared.traceparents.lock().iter().cloned().collect()
    }

    /// Stops accepting, lets in-flight responses finish (at most 5 s), then
    /// stops the engine.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

/// Binds and starts an engine; returns once it accepts connections.
///
/// Errors: the bind fails, or `time_scale` is negative or not finite.
pub async fn spawn(config: EngineConfig, options: ServeOptions) -> io::Result<EngineHandle> {
    if !(config.time_scale.is_finite() && config.time_scale >= 0.0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "time_scale must be a finite number >= 0",
        ));
    }
    let listener = TcpListener::bind(options.addr).await?;
    let addr = listener.local_addr()?;
    let bootstrap = match options.bootstrap_addr {
        Some(a) => Some(TcpListener::bind(a).await?),
        None => None,
    };
    let bootstrap_addr = bootstrap
        .as_ref()
        .map(TcpListener::local_addr)
        .transpose()?;
    let engine_id = config
        .engine_id
        .clone()
        .unwrap_or_else(|| format!("engine-{}", addr.port()));
    let worker_header = HeaderValue::from_str(&engine_id).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "engine_id must be a valid header value",
        )
    })?;
    let pd = PdSettings {
        role: config.role,
        connector: config.kv_connector,
        moriio_mode: config.moriio_mode,
        address: ProducerAddress {
            engine_id: engine_id.clone(),
            host: config.advertise_host.clone(),
            port: addr.port(),
            bootstrap_port: bootstrap_addr.map(|a| a.port()),
        },
        registry: options.registry.clone(),
    };
    #[allow(unused_mut)] // only changed with the `kv-events` feature
    let mut engine = Engine::with_pd(config.model.clone(), pd);
    #[cfg(feature = "kv-events")]
    let kv = match &options.kv_events {
        Some(kv_options) => {
            engine.set_kv_events(true);
            Some(bind_kv_events(kv_options).await?)
        }
        None => None,
    };
    let shared = Arc::new(ServerState {
        engine_id,
        worker_header,
        core: Mutex::new(Core {
            engine,
            sinks: HashMap::new(),
            #[cfg(feature = "kv-events")]
            kv_events: kv.as_ref().map(|kv| kv.queue.clone()),
        }),
        wake: Notify::new(),
        registry_changed: Notify::new(),
        registry: options.registry.clone(),
        start: Instant::now(),
        next_id: AtomicU64::new(1),
        load: AtomicU64::new(0),
        generation_requests: AtomicU64::new(0),
        faults_injected: AtomicU64::new(0),
        traceparents: Mutex::new(std::collections::VecDeque::new()),
        max_body_bytes: options.max_body_bytes,
        tokenizer: options.tokenizer.clone(),
        bootstrap_port: bootstrap_addr.map(|a| a.port()),
        port: addr.port(),
        config,
    });
    if let Some(registry) = &options.registry {
        let weak: Weak<ServerState> = Arc::downgrade(&shared);
        registry.subscribe(Arc::new(move || {
            if let Some(shared) = weak.upgrade() {
                shared.wake.notify_one();
                shared.registry_changed.notify_waiters();
            }
        }));
    }
    let (shutdown, shutdown_rx) = watch::channel(false);
    #[cfg(feature = "kv-events")]
    let (kv_events_addr, kv_events_replay_addr, kv_task) = match kv {
        Some(kv) => (Some(kv.addr), kv.replay_addr, Some(kv.task)),
        None => (None, None, None),
    };
    #[cfg(not(feature = "kv-events"))]
    let kv_task = None;
    let task = tokio::spawn(serve(
        listener,
        bootstrap,
        shared.clone(),
        shutdown_rx,
        kv_task,
    ));
    Ok(EngineHandle {
        addr,
        bootstrap_addr,
        shared,
        shutdown,
        task: Some(task),
        #[cfg(feature = "kv-events")]
        kv_events_addr,
        #[cfg(feature = "kv-events")]
        kv_events_replay_addr,
    })
}

async fn serve(
    listener: TcpListener,
    bootstrap: Option<TcpListener>,
    shared: Arc<ServerState>,
    mut shutdown: watch::Receiver<bool>,
    kv_task: Option<tokio::task::JoinHandle<()>>,
) {
    // The driver outlives the accept loop so in-flight responses can finish
    // during the graceful shutdown; it is stopped after it.
    let driver = tokio::spawn(drive(shared.clone()));
    let graceful = GracefulShutdown::new();
    let mut conns = JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            accepted = accept_optional(bootstrap.as_ref()) => accepted,
            _ = shutdown.wait_for(|stop| *stop) => break,
        };
        match accepted {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                let reset = Arc::new(AtomicBool::new(false));
                let io = TokioIo::new(ResettableStream::new(stream, reset.clone()));
                let shared = shared.clone();
                let service = service_fn(move |req| {
                    let shared = shared.clone();
                    let reset = reset.clone();
                    async move { Ok::<_, Infallible>(handle(shared, reset, req).await) }
                });
                let conn = http1::Builder::new().serve_connection(io, service);
                let watched = graceful.watch(conn);
                conns.spawn(async move {
                    let _ = watched.await;
                });
            }
            Err(error) => {
                tracing::warn!(%error, "accept failed");
                // Out of descriptors and alike: back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    drop(listener);
    drop(bootstrap);
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await;
    driver.abort();
    // Bodies still waiting for the engine end with an error now.
    {
        let mut core = shared.core.lock();
        core.sinks.clear();
        // Closing the queue lets the publisher send what is queued, then
        // close its sockets.
        #[cfg(feature = "kv-events")]
        {
            core.kv_events = None;
        }
    }
    conns.shutdown().await;
    if let Some(kv_task) = kv_task {
        let _ = kv_task.await;
    }
}

async fn accept_optional(listener: Option<&TcpListener>) -> io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// Runs the engine model in tokio time.
async fn drive(shared: Arc<ServerState>) {
    let mut timer_target: Option<Duration> = None;
    loop {
        let next = {
            let mut core = shared.core.lock();
            let mut target = shared.model_now();
            if let Some(t) = timer_target.take() {
                target = target.max(t);
            }
            core.engine.advance_to(target);
            if shared.scale() == 0.0 {
                while let Some(end) = core.engine.next_step_end() {
                    core.engine.advance_to(end);
                    dispatch(&mut core);
                }
            }
            dispatch(&mut core);
            core.engine.next_event_time()
        };
        let sleep = tokio::time::sleep_until(shared.wall_at(next.unwrap_or_default()));
        tokio::select! {
            _ = shared.wake.notified() => {}
            _ = sleep, if next.is_some() => timer_target = next,
        }
    }
}

fn dispatch(core: &mut Core) {
    #[cfg(feature = "kv-events")]
    queue_kv_events(core);
    let Core { engine, sinks, .. } = core;
    for event in engine.drain_events() {
        let id = event.id;
        let finished = matches!(event.kind, EventKind::Finished(_));
        if let Some(sink) = sinks.get(&id) {
            let _ = sink.send(event);
        }
        if finished {
            sinks.remove(&id);
        }
    }
}

async fn handle(
    shared: Arc<ServerState>,
    reset: Arc<AtomicBool>,
    req: Request<Incoming>,
) -> Response<SimBody> {
    if let Some(value) = req.headers().get("traceparent")
        && let Ok(value) = value.to_str()
    {
        let mut kept = shared.traceparents.lock();
        if kept.len() == TRACEPARENTS_KEPT {
            kept.pop_front();
        }
        kept.push_back(value.to_owned());
    }
    let mut response = route(&shared, reset, req).await;
    response
        .headers_mut()
        .insert(WORKER_ID_HEADER, shared.worker_header.clone());
    response
}

async fn route(
    shared: &Arc<ServerState>,
    reset: Arc<AtomicBool>,
    req: Request<Incoming>,
) -> Response<SimBody> {
    let path = req.uri().path();
    match (req.method(), path) {
        (&Method::GET, "/health") => health(shared),
        (&Method::GET, "/load") => json_response(
            StatusCode::OK,
            json!({"server_load": shared.load.load(Ordering::Relaxed)}).to_string(),
        ),
        (&Method::GET, "/v1/models") => models(shared),
        (&Method::GET, "/metrics") => {
            let text = metrics::render(
                &shared.config.model.model_name,
                &shared.engine_id,
                &shared.stats(),
                shared.counters(),
            );
            let mut response = Response::new(SimBody::full(text.into()));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(prom_text::CONTENT_TYPE),
            );
            response
        }
        // Mooncake's bootstrap answer: engine id (and address) per DP rank.
        (&Method::GET, "/query") => json_response(
            StatusCode::OK,
            json!({
                "0": {
                    "engine_id": shared.engine_id,
                    "host": shared.config.advertise_host,
                    "port": shared.port,
                    "bootstrap_port": shared.bootstrap_port,
                    "dp_rank": 0,
                    "dp_size": 1,
                },
            })
            .to_string(),
        ),
        (&Method::POST, "/v1/chat/completions") => {
            generate(shared, reset, Endpoint::Chat, req).await
        }
        (&Method::POST, "/v1/completions") => {
            generate(shared, reset, Endpoint::Completions, req).await
        }
        (
            _,
            "/health"
            | "/load"
            | "/v1/models"
            | "/metrics"
            | "/query"
            | "/v1/chat/completions"
            | "/v1/completions",
        ) => json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            json!({"detail": "Method Not Allowed"}).to_string(),
        ),
        _ => json_response(
            StatusCode::NOT_FOUND,
            json!({"detail": "Not Found"}).to_string(),
        ),
    }
}

fn health(shared: &ServerState) -> Response<SimBody> {
    let elapsed = shared.start.elapsed();
    let faults = &shared.config.faults;
    if faults.slow_start.is_some_and(|d| elapsed < d) {
        return error_response(&EngineApiError::with_status(503, "engine is starting"));
    }
    if faults.refuse_health_after.is_some_and(|d| elapsed >= d) {
        return error_response(&EngineApiError::with_status(
            503,
            "health check refused (injected fault)",
        ));
    }
    Response::new(SimBody::full(Bytes::new()))
}

fn models(shared: &ServerState) -> Response<SimBody> {
    let name = &shared.config.model.model_name;
    let body = json!({
        "object": "list",
        "data": [{
            "id": name,
            "object": "model",
            "created": unix_now(),
            "owned_by": "vllm",
            "root": name,
            "parent": null,
            "max_model_len": shared.config.model.max_model_len,
        }],
    });
    json_response(StatusCode::OK, body.to_string())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

fn json_response(status: StatusCode, body: String) -> Response<SimBody> {
    let mut response = Response::new(SimBody::full(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn error_response(error: &EngineApiError) -> Response<SimBody> {
    let status = StatusCode::from_u16(error.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, error.to_json())
}
