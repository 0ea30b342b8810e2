//! The HTTP server: one [`Engine`] behind vLLM's OpenAI endpoints, driven in
//! real (tokio) time.
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

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, ready};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use parking_lot::Mutex;
use prompt_tokens::PromptTokenizer;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};

use crate::api::{self, ApiError, Endpoint, Prompt, ResponseMeta, SSE_DONE, Usage};
use crate::config::{EngineConfig, Role};
use crate::engine::{
    Engine, EngineEvent, EngineStats, EventKind, PdSettings, RequestId, RequestSummary, SimRequest,
};
use crate::fault::{FAULT_HEADER, RequestFaults, parse_fault_header};
use crate::metrics::{self, ServerCounters};
use crate::text::{output_text, output_token};
use crate::tokens::{mix64, sequence_hash, tokenize};
use crate::transfer::{KvTransferParams, ProducerAddress, TransferRegistry};

/// The header naming the engine on every response.
pub const WORKER_ID_HEADER: &str = "x-worker-id";

/// How long a reset waits after the first body bytes, so they reach the
/// client before the connection dies.
const RESET_DELAY: Duration = Duration::from_millis(50);

/// How long a graceful shutdown waits for in-flight responses.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Where an engine publishes its KV-cache events (feature `kv-events`):
/// vLLM's `--kv-events-config` with the ZMQ publisher.
///
/// Every scheduler step that stores or evicts prefix-cache blocks is one
/// batch on the PUB socket at `endpoint` (`[topic, seq, msgpack]`); with
/// `replay` set, a ROUTER socket there answers replay requests from the last
/// `buffer` batches. Block hashes are engine-sim's 64-bit chain hashes as
/// integers (see [`crate::kv`]).
#[cfg(feature = "kv-events")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsOptions {
    /// The PUB socket's address (vLLM's example uses port 5557); port 0
    /// picks a free port, see [`EngineHandle::kv_events_addr`].
    pub endpoint: SocketAddr,
    /// The replay (ROUTER) socket's address (vLLM's example: 5558); `None`
    /// serves no replays.
    pub replay: Option<SocketAddr>,
    /// The topic frame. Default empty, as vLLM's.
    pub topic: String,
    /// Batches kept for replay. Default 10 000 (vLLM's `buffer_steps`).
    pub buffer: usize,
    /// The data-parallel rank written into every batch. Default 0: one
    /// engine-sim is one rank.
    pub data_parallel_rank: u32,
    /// Fault injection: every `n`-th batch (the `n`-th, `2n`-th, ...) is
    /// numbered and kept for replay but not sent live, as when vLLM's PUB
    /// socket drops a message at its high-water mark; subscribers must
    /// recover it by replay. Default `None` (every batch is sent).
    pub drop_live_every: Option<std::num::NonZeroU64>,
}

#[cfg(feature = "kv-events")]
impl KvEventsOptions {
    /// Publishing on `endpoint`, no replay, vLLM's defaults otherwise.
    pub fn new(endpoint: SocketAddr) -> Self {
        KvEventsOptions {
            endpoint,
            replay: None,
            topic: String::new(),
            buffer: 10_000,
            data_parallel_rank: 0,
            drop_live_every: None,
        }
    }

    /// Also serving replays on `replay`.
    #[must_use]
    pub fn with_replay(mut self, replay: SocketAddr) -> Self {
        self.replay = Some(replay);
        self
    }
}

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

struct Shared {
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
    max_body_bytes: usize,
    tokenizer: Option<Arc<PromptTokenizer>>,
    bootstrap_port: Option<u16>,
    port: u16,
}

impl Shared {
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

/// A running engine. Dropping it stops the server (without waiting);
/// [`EngineHandle::shutdown`] stops it gracefully.
pub struct EngineHandle {
    addr: SocketAddr,
    bootstrap_addr: Option<SocketAddr>,
    shared: Arc<Shared>,
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
    let shared = Arc::new(Shared {
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
        max_body_bytes: options.max_body_bytes,
        tokenizer: options.tokenizer.clone(),
        bootstrap_port: bootstrap_addr.map(|a| a.port()),
        port: addr.port(),
        config,
    });
    if let Some(registry) = &options.registry {
        let weak: Weak<Shared> = Arc::downgrade(&shared);
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

/// A bound publisher: its queue, its task and the addresses it bound.
#[cfg(feature = "kv-events")]
struct KvEventsRunning {
    queue: mpsc::UnboundedSender<kv_events::EventBatch>,
    task: tokio::task::JoinHandle<()>,
    addr: SocketAddr,
    replay_addr: Option<SocketAddr>,
}

#[cfg(feature = "kv-events")]
async fn bind_kv_events(options: &KvEventsOptions) -> io::Result<KvEventsRunning> {
    let mut config = kv_events::PublisherConfig::new(format!("tcp://{}", options.endpoint));
    config.replay_endpoint = options.replay.map(|a| format!("tcp://{a}"));
    config.topic = options.topic.clone();
    config.buffer_steps = options.buffer.max(1);
    config.data_parallel_rank = Some(options.data_parallel_rank);
    let publisher = kv_events::Publisher::bind(config)
        .await
        .map_err(|e| io::Error::new(io::ErrorKind::AddrNotAvailable, e.to_string()))?;
    let addr = zmq_socket_addr(publisher.endpoint())?;
    let replay_addr = publisher
        .replay_endpoint()
        .map(zmq_socket_addr)
        .transpose()?;
    let (queue, batches) = mpsc::unbounded_channel();
    let task = tokio::spawn(publish_kv_events(
        publisher,
        batches,
        options.drop_live_every,
    ));
    Ok(KvEventsRunning {
        queue,
        task,
        addr,
        replay_addr,
    })
}

/// `tcp://ip:port` as libzmq reports a bound endpoint.
#[cfg(feature = "kv-events")]
fn zmq_socket_addr(endpoint: &str) -> io::Result<SocketAddr> {
    endpoint
        .strip_prefix("tcp://")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| {
            io::Error::other(format!(
                "the KV-events publisher bound an unexpected endpoint {endpoint}"
            ))
        })
}

/// Publishes queued batches in order until the queue closes (the server
/// stopped), then closes the sockets. With `drop_live_every`, every n-th
/// batch only goes to the replay buffer.
#[cfg(feature = "kv-events")]
async fn publish_kv_events(
    publisher: kv_events::Publisher,
    mut batches: mpsc::UnboundedReceiver<kv_events::EventBatch>,
    drop_live_every: Option<std::num::NonZeroU64>,
) {
    let mut count = 0u64;
    while let Some(batch) = batches.recv().await {
        count += 1;
        if drop_live_every.is_some_and(|n| count.is_multiple_of(n.get())) {
            publisher.publish_replay_only(&batch).await;
            continue;
        }
        if let Err(error) = publisher.publish(&batch).await {
            // Numbered and kept all the same: subscribers recover it by
            // replay, as from a message vLLM's PUB socket dropped.
            tracing::warn!(%error, "KV-events batch not sent live");
        }
    }
    publisher.shutdown().await;
}

async fn serve(
    listener: TcpListener,
    bootstrap: Option<TcpListener>,
    shared: Arc<Shared>,
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
                let io = TokioIo::new(ResettableStream {
                    inner: stream,
                    reset: reset.clone(),
                });
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
async fn drive(shared: Arc<Shared>) {
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

/// Hands the engine's per-step cache changes to the publisher, in order.
#[cfg(feature = "kv-events")]
fn queue_kv_events(core: &mut Core) {
    let Some(queue) = &core.kv_events else {
        return;
    };
    let block_size = core.engine.config().block_size;
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    for batch in core.engine.drain_kv_batches() {
        let _ = queue.send(batch.to_event_batch(ts, block_size));
    }
}

async fn handle(
    shared: Arc<Shared>,
    reset: Arc<AtomicBool>,
    req: Request<Incoming>,
) -> Response<SimBody> {
    let mut response = route(&shared, reset, req).await;
    response
        .headers_mut()
        .insert(WORKER_ID_HEADER, shared.worker_header.clone());
    response
}

async fn route(
    shared: &Arc<Shared>,
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

fn health(shared: &Shared) -> Response<SimBody> {
    let elapsed = shared.start.elapsed();
    let faults = &shared.config.faults;
    if faults.slow_start.is_some_and(|d| elapsed < d) {
        return error_response(&ApiError::with_status(503, "engine is starting"));
    }
    if faults.refuse_health_after.is_some_and(|d| elapsed >= d) {
        return error_response(&ApiError::with_status(
            503,
            "health check refused (injected fault)",
        ));
    }
    Response::new(SimBody::full(Bytes::new()))
}

fn models(shared: &Shared) -> Response<SimBody> {
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

fn error_response(error: &ApiError) -> Response<SimBody> {
    let status = StatusCode::from_u16(error.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, error.to_json())
}

/// Keeps `/load` counting while a generation request is in flight.
struct LoadGuard(Arc<Shared>);

impl LoadGuard {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.load.fetch_add(1, Ordering::Relaxed);
        LoadGuard(shared.clone())
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.0.load.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Aborts the request in the engine unless it finished.
struct AbortGuard {
    shared: Arc<Shared>,
    id: RequestId,
    armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            {
                let mut core = self.shared.core.lock();
                core.sinks.remove(&self.id);
                core.engine.abort(self.id);
            }
            self.shared.wake.notify_one();
        }
    }
}

fn injected_status(shared: &Shared, header: &RequestFaults) -> Option<u16> {
    if header.status.is_some() {
        return header.status;
    }
    let faults = &shared.config.faults;
    if faults.fixed_status.is_some() {
        return faults.fixed_status;
    }
    let n = shared.generation_requests.fetch_add(1, Ordering::Relaxed);
    let fail = faults.fail_status.unwrap_or(500);
    if n < u64::from(faults.fail_first) {
        return Some(fail);
    }
    if faults.failure_rate > 0.0 {
        let draw =
            mix64(shared.config.model.seed ^ 0xFA17_FA17 ^ mix64(n)) as f64 / u64::MAX as f64;
        if draw < faults.failure_rate {
            return Some(fail);
        }
    }
    None
}

async fn generate(
    shared: &Arc<Shared>,
    reset: Arc<AtomicBool>,
    endpoint: Endpoint,
    req: Request<Incoming>,
) -> Response<SimBody> {
    let load = LoadGuard::new(shared);
    let header_faults = match req.headers().get(FAULT_HEADER) {
        None => RequestFaults::default(),
        Some(value) => match value.to_str().map(parse_fault_header) {
            Ok(Ok(faults)) => faults,
            Ok(Err(e)) => return error_response(&ApiError::bad_request(e.to_string())),
            Err(_) => {
                return error_response(&ApiError::bad_request("x-sim-fault must be visible ASCII"));
            }
        },
    };
    let faults = &shared.config.faults;
    if let Some(warmup) = faults.slow_start {
        tokio::time::sleep_until(shared.start + warmup).await;
    }
    if let Some(status) = injected_status(shared, &header_faults) {
        shared.faults_injected.fetch_add(1, Ordering::Relaxed);
        return error_response(&ApiError::with_status(
            status,
            format!("injected fault: status {status}"),
        ));
    }
    if let Some(stall) = header_faults
        .stall_before_headers
        .or(faults.stall_before_headers)
    {
        shared.faults_injected.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(stall).await;
    }
    let body = match Limited::new(req.into_body(), shared.max_body_bytes)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            let too_large = e
                .downcast_ref::<http_body_util::LengthLimitError>()
                .is_some();
            return if too_large {
                error_response(&ApiError::with_status(413, "request body too large"))
            } else {
                error_response(&ApiError::bad_request(format!(
                    "could not read the request body: {e}"
                )))
            };
        }
    };
    let parsed = match api::parse_request_with(
        endpoint,
        &body,
        shared.tokenizer.as_deref(),
        Some(&shared.config.model.model_name),
    ) {
        Ok(parsed) => parsed,
        Err(e) => return error_response(&e),
    };
    let prompt = match parsed.prompt {
        Prompt::Text(text) => tokenize(&text, shared.config.model.chars_per_token),
        Prompt::Tokens(tokens) => tokens,
    };
    let prompt_hash = sequence_hash(&prompt);
    let prompt_len = prompt.len();
    let max_tokens = parsed
        .max_tokens
        .unwrap_or(shared.config.model.default_max_tokens);
    let kv_params = parsed
        .kv_transfer_params
        .as_ref()
        .map(KvTransferParams::from_json);
    if shared.config.role == Role::Decode {
        wait_for_push_transfer(shared, kv_params.as_ref()).await;
    }
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let (sink, events) = mpsc::unbounded_channel();
    {
        let mut core = shared.core.lock();
        let now = shared.model_now();
        let request = SimRequest {
            id,
            prompt,
            max_tokens,
            kv_transfer_params: kv_params,
        };
        if let Err(e) = core.engine.submit(now, request) {
            return error_response(&ApiError::bad_request(e.to_string()));
        }
        core.sinks.insert(id, sink);
    }
    shared.wake.notify_one();
    let abort = AbortGuard {
        shared: shared.clone(),
        id,
        armed: true,
    };
    let formatter = Formatter {
        meta: ResponseMeta {
            id: format!(
                "{}-{:016x}",
                ResponseMeta::id_prefix(endpoint),
                mix64(id ^ prompt_hash)
            ),
            created: unix_now(),
            model: shared.config.model.model_name.clone(),
            endpoint,
        },
        stream: parsed.stream,
        include_usage: parsed.include_usage,
        continuous_usage: parsed.continuous_usage,
        seed: shared.config.model.seed,
        prompt_hash,
        sent_first: false,
        prompt_tokens: prompt_len,
        cached_tokens: 0,
    };
    let stall_after = header_faults
        .stall_after_headers
        .or(faults.stall_after_headers);
    let reset_mid_body = header_faults.reset_mid_body || faults.reset_mid_body;
    if stall_after.is_some() {
        shared.faults_injected.fetch_add(1, Ordering::Relaxed);
    }
    if reset_mid_body {
        shared.faults_injected.fetch_add(1, Ordering::Relaxed);
    }
    let content_type = if parsed.stream {
        "text/event-stream; charset=utf-8"
    } else {
        "application/json"
    };
    let body = if !parsed.stream && stall_after.is_none() && !reset_mid_body {
        // Plain JSON: wait for the answer, send it with a content-length.
        let mut source = EventSource {
            events,
            formatter,
            abort,
        };
        let mut frames = VecDeque::new();
        loop {
            match source.events.recv().await {
                Some(event) => {
                    if source.formatter.on_event(event, &mut frames) {
                        source.abort.armed = false;
                        break;
                    }
                }
                None => {
                    return error_response(&ApiError::with_status(503, "engine stopped"));
                }
            }
        }
        let full: Vec<u8> = frames.into_iter().flatten().collect();
        let mut body = SimBody::full(full.into());
        body.load = Some(load);
        body
    } else {
        SimBody {
            pending: VecDeque::new(),
            source: Some(EventSource {
                events,
                formatter,
                abort,
            }),
            stall: stall_after.map(|d| Box::pin(tokio::time::sleep(d))),
            reset: reset_mid_body.then_some(reset),
            reset_timer: None,
            frames_sent: 0,
            exact_len: None,
            load: Some(load),
        }
    };
    let mut response = Response::new(body);
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// A decode engine with a shared registry waits (bounded) for a push
/// transfer that the named prefill has not produced yet: push connectors
/// may dispatch both legs at once.
async fn wait_for_push_transfer(shared: &Shared, params: Option<&KvTransferParams>) {
    let (Some(registry), Some(params)) = (&shared.registry, params) else {
        return;
    };
    let Some(transfer_id) = params
        .transfer_id
        .as_deref()
        .filter(|_| params.do_remote_prefill)
    else {
        return;
    };
    let deadline = Instant::now() + shared.config.kv_wait_timeout;
    loop {
        let notified = shared.registry_changed.notified();
        let mut notified = std::pin::pin!(notified);
        notified.as_mut().enable();
        if registry.has_pending_transfer_id(transfer_id) {
            return;
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return;
        }
    }
}

/// Turns engine events into response bytes.
struct Formatter {
    meta: ResponseMeta,
    stream: bool,
    include_usage: bool,
    continuous_usage: bool,
    seed: u64,
    prompt_hash: u64,
    sent_first: bool,
    prompt_tokens: usize,
    cached_tokens: usize,
}

impl Formatter {
    /// Appends the frames for `event`; returns true at the end.
    fn on_event(&mut self, event: EngineEvent, out: &mut VecDeque<Bytes>) -> bool {
        match event.kind {
            EventKind::Token { index } => {
                if self.stream {
                    let text = output_token(self.seed, self.prompt_hash, index);
                    let usage = self.continuous_usage.then_some(Usage {
                        prompt_tokens: self.prompt_tokens,
                        completion_tokens: index + 1,
                        cached_tokens: self.cached_tokens,
                    });
                    if !self.sent_first && self.meta.endpoint == Endpoint::Chat {
                        out.push_back(api::sse_event(&api::stream_chunk(
                            &self.meta, "", true, None, None,
                        )));
                    }
                    self.sent_first = true;
                    out.push_back(api::sse_event(&api::stream_chunk(
                        &self.meta, text, false, None, usage,
                    )));
                }
                false
            }
            EventKind::Finished(summary) => {
                self.finish(&summary, out);
                true
            }
        }
    }

    fn finish(&mut self, summary: &RequestSummary, out: &mut VecDeque<Bytes>) {
        let usage = Usage {
            prompt_tokens: summary.prompt_tokens,
            completion_tokens: summary.completion_tokens,
            cached_tokens: summary.cached_tokens,
        };
        if self.stream {
            let continuous = self.continuous_usage.then_some(usage);
            out.push_back(api::sse_event(&api::stream_chunk(
                &self.meta,
                "",
                false,
                Some("length"),
                continuous,
            )));
            if self.include_usage {
                out.push_back(api::sse_event(&api::usage_chunk(&self.meta, usage)));
            }
            out.push_back(Bytes::from_static(SSE_DONE));
        } else {
            let text = output_text(self.seed, self.prompt_hash, summary.completion_tokens);
            let body = api::full_response(
                &self.meta,
                &text,
                "length",
                usage,
                summary.kv_transfer_params.as_ref(),
            );
            out.push_back(body.to_string().into());
        }
    }
}

struct EventSource {
    events: mpsc::UnboundedReceiver<EngineEvent>,
    formatter: Formatter,
    abort: AbortGuard,
}

/// Why a response body ended early.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BodyError {
    /// The `reset-mid-body` fault fired.
    #[error("connection reset (injected fault)")]
    Reset,
    /// The engine stopped before the response was complete.
    #[error("engine stopped")]
    EngineStopped,
}

/// The response body of every route.
pub struct SimBody {
    pending: VecDeque<Bytes>,
    source: Option<EventSource>,
    stall: Option<Pin<Box<Sleep>>>,
    reset: Option<Arc<AtomicBool>>,
    reset_timer: Option<Pin<Box<Sleep>>>,
    frames_sent: usize,
    exact_len: Option<u64>,
    load: Option<LoadGuard>,
}

impl std::fmt::Debug for SimBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBody")
            .field("pending", &self.pending.len())
            .field("streaming", &self.source.is_some())
            .finish()
    }
}

impl SimBody {
    fn full(bytes: Bytes) -> Self {
        let exact_len = Some(bytes.len() as u64);
        let mut pending = VecDeque::new();
        if !bytes.is_empty() {
            pending.push_back(bytes);
        }
        SimBody {
            pending,
            source: None,
            stall: None,
            reset: None,
            reset_timer: None,
            frames_sent: 0,
            exact_len,
            load: None,
        }
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if let Some(stall) = this.stall.as_mut() {
            ready!(stall.as_mut().poll(cx));
            this.stall = None;
        }
        loop {
            if let Some(flag) = &this.reset
                && this.frames_sent >= 1
            {
                let timer = this
                    .reset_timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(RESET_DELAY)));
                ready!(timer.as_mut().poll(cx));
                flag.store(true, Ordering::SeqCst);
                this.source = None;
                this.pending.clear();
                this.reset = None;
                this.load = None;
                return Poll::Ready(Some(Err(BodyError::Reset)));
            }
            if let Some(bytes) = this.pending.pop_front() {
                this.frames_sent += 1;
                if this.pending.is_empty() && this.source.is_none() {
                    this.load = None;
                }
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            let Some(source) = this.source.as_mut() else {
                this.load = None;
                return Poll::Ready(None);
            };
            match ready!(source.events.poll_recv(cx)) {
                Some(event) => {
                    if source.formatter.on_event(event, &mut this.pending) {
                        source.abort.armed = false;
                        this.source = None;
                        if this.reset.is_some() {
                            split_single_frame(&mut this.pending);
                        }
                    }
                }
                None => {
                    this.source = None;
                    this.load = None;
                    return Poll::Ready(Some(Err(BodyError::EngineStopped)));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.stall.is_none()
            && self.pending.is_empty()
            && self.source.is_none()
            && self.reset.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.exact_len {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

/// A non-streamed answer is one frame; a reset should cut it in the middle.
fn split_single_frame(pending: &mut VecDeque<Bytes>) {
    if pending.len() == 1 && pending[0].len() > 1 {
        let mut whole = pending.pop_front().expect("one frame");
        let tail = whole.split_off(whole.len() / 2);
        pending.push_back(whole);
        pending.push_back(tail);
    }
}

/// A TCP stream that closes with a reset (RST) instead of a FIN when its
/// flag is set, for the `reset-mid-body` fault.
struct ResettableStream {
    inner: TcpStream,
    reset: Arc<AtomicBool>,
}

impl Drop for ResettableStream {
    fn drop(&mut self) {
        if self.reset.load(Ordering::SeqCst) {
            let _ = self.inner.set_zero_linger();
        }
    }
}

impl AsyncRead for ResettableStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for ResettableStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.reset.load(Ordering::SeqCst) {
            // No FIN: the drop that follows sends the RST.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
