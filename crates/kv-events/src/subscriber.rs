//! A resilient subscriber: one task per engine stream that connects a SUB
//! socket, decodes batches, asks for replays on a DEALER socket, reconnects
//! with backoff, and hands ordered batches and resets to an [`EventSink`].
//!
//! # How it is put together
//!
//! The decisions live in [`Sequencer`]; this module only
//! moves bytes. The task waits on four things at once: the next live
//! message, the SUB socket's disconnect notice, answers of the replay in
//! flight, and the sequencer's replay deadline. Each replay uses a fresh
//! DEALER connection (gaps are rare; a fresh socket cannot mix answers of an
//! abandoned request into a new one), sending `["", start]` so that vLLM's
//! ROUTER sees the three frames it requires.
//!
//! The SUB socket is dropped and made again on disconnect, with exponential
//! backoff between attempts; the stream's position is kept, so a publisher
//! that comes back with the sequence it had loses nothing, and one that
//! restarted (sequence back at 0) is detected and reset.
//!
//! # Sockets and bounds
//!
//! The sockets are libzmq's, each read by its own thread (see
//! [`zmq_io`](crate::zmq_io) for why). The SUB and the replay DEALER refuse
//! any frame larger than [`DecodeLimits::max_payload_bytes`] before it is
//! allocated: libzmq closes such a connection, which the loop sees as a
//! disconnect (the stream goes to `Connecting`, then reconnects with
//! backoff). A connection counts as made when its ZMTP handshake succeeds
//! (libzmq's own reconnection is off: the loop decides when to retry).
//!
//! # Supervision
//!
//! The loop runs under a supervisor: if it ever ends (a panic in the sink
//! or the loop itself), the stream is marked `Connecting` at once (never
//! `Live` while nothing reads it), [`StreamCounters::restarts`] counts it,
//! the sink gets a [`ResetReason::ReaderRestarted`] reset (what it holds
//! from this stream is no longer vouched for), and after a backoff step a
//! fresh loop reconnects and catches up by replay as a new subscription
//! does.
//!
//! # Cancel safety
//!
//! Dropping a [`Subscriber`] aborts its task (and with it the socket
//! threads, joined within [`POLL_INTERVAL`](crate::zmq_io::POLL_INTERVAL));
//! batches not yet handed to the sink are lost with it (a new subscriber
//! starts cold).

use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::decode::decode_batch_with;
use crate::endpoint::ZmqEndpoint;
use crate::sequencer::{
    Action, ReplayId, ResetReason, Sequencer, SequencerConfig, Source, StreamState,
};
use crate::wire::{DecodeLimits, EventBatch};
use crate::zmq_io::{Incoming, SocketThread, context, harden};

/// What the subscriber hands to its sink.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum StreamEvent {
    /// The next batch of the stream, in order.
    Batch {
        /// Its sequence number.
        seq: u64,
        /// The decoded batch.
        batch: EventBatch,
        /// Events of unknown type that were skipped in it.
        unknown_events: usize,
        /// Live or replayed.
        source: Source,
    },
    /// Forget everything learned from this stream (the engine's blocks):
    /// what follows starts from scratch.
    Reset {
        /// Why.
        reason: ResetReason,
    },
}

/// Where a subscriber delivers. Called from the subscriber's task, in
/// stream order; it should be quick (an index update), or hand the event
/// on. Closures and tokio's unbounded senders are sinks.
pub trait EventSink: Send + 'static {
    /// One event of the stream.
    fn on_event(&mut self, event: StreamEvent);
}

impl<F: FnMut(StreamEvent) + Send + 'static> EventSink for F {
    fn on_event(&mut self, event: StreamEvent) {
        self(event);
    }
}

impl EventSink for mpsc::UnboundedSender<StreamEvent> {
    fn on_event(&mut self, event: StreamEvent) {
        // A receiver that is gone wants nothing more.
        let _ = self.send(event);
    }
}

/// Exponential backoff between connection attempts (no jitter: one
/// subscriber per engine, nothing to de-synchronise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    /// The first delay (default 100 ms).
    pub initial: Duration,
    /// The longest delay (default 5 s).
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(5),
        }
    }
}

impl Backoff {
    /// The delay before attempt `failures + 1`, after `failures`
    /// consecutive failures (`failures >= 1`): `initial * 2^(failures-1)`,
    /// capped at `max`.
    #[must_use]
    pub fn delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(30);
        self.initial.saturating_mul(1 << doublings).min(self.max)
    }
}

/// How a [`Subscriber`] connects and behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SubscriberConfig {
    /// The engine's PUB address, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The engine's replay (ROUTER) address, e.g. `tcp://10.0.0.5:5558`;
    /// `None` turns replay off (gaps then reset the stream).
    pub replay_endpoint: Option<String>,
    /// The topic prefix to subscribe to (vLLM's `topic`; empty takes all).
    pub topic: String,
    /// The sequencing rules (replay timeout, catch-up, buffering).
    pub sequencer: SequencerConfig,
    /// How long one connection attempt may take (default 1 s).
    pub connect_timeout: Duration,
    /// Delays between failed connection attempts.
    pub backoff: Backoff,
    /// Bounds on decoded payloads. Its `max_payload_bytes` is also the
    /// sockets' `ZMQ_MAXMSGSIZE`: no frame larger than the largest payload
    /// accepted is ever buffered.
    pub limits: DecodeLimits,
}

impl SubscriberConfig {
    /// A configuration for the engine at `endpoint` with the defaults and
    /// no replay endpoint.
    #[must_use]
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            sequencer: SequencerConfig::default(),
            connect_timeout: Duration::from_secs(1),
            backoff: Backoff::default(),
            limits: DecodeLimits::default(),
        }
    }

    /// Sets the replay address.
    #[must_use]
    pub fn with_replay(mut self, replay_endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(replay_endpoint.into());
        self
    }

    /// Sets the topic prefix.
    #[must_use]
    pub fn with_topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }
}

/// Counters of one stream, for metrics and status pages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamCounters {
    /// Batches delivered to the sink.
    pub batches: u64,
    /// Events in the delivered batches.
    pub events: u64,
    /// Events of unknown type skipped.
    pub unknown_events: u64,
    /// Live messages received (valid or not).
    pub messages: u64,
    /// Batches skipped as already delivered.
    pub duplicates: u64,
    /// Gaps seen in the live stream.
    pub gaps: u64,
    /// Replays requested.
    pub replays: u64,
    /// Replays that timed out or failed.
    pub replay_timeouts: u64,
    /// Resets sent to the sink.
    pub resets: u64,
    /// Messages or payloads that could not be decoded.
    pub decode_errors: u64,
    /// Successful connections.
    pub connects: u64,
    /// Failed connection attempts.
    pub connect_failures: u64,
    /// Connections lost.
    pub disconnects: u64,
    /// Times the receive loop ended (an error, a panic) and was restarted
    /// by its supervisor.
    pub restarts: u64,
}

/// A snapshot of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStatus {
    /// Where the stream is.
    pub state: StreamState,
    /// What happened so far.
    pub counters: StreamCounters,
    /// The last delivered sequence number, when warm.
    pub last_seq: Option<u64>,
}

/// The address of data-parallel rank `rank`'s socket, given the address
/// vLLM was configured with: vLLM's `offset_endpoint_port` adds the rank to
/// a TCP port and appends `_dp{rank}` to an `inproc` name; rank 0 keeps the
/// address. `None` when a TCP address is not a valid [`ZmqEndpoint`] (no
/// numeric port, a wildcard host, ...) or its port would overflow, or the
/// transport is neither (vLLM refuses those too).
#[must_use]
pub fn endpoint_for_rank(endpoint: &str, rank: u16) -> Option<String> {
    if rank == 0 {
        return Some(endpoint.to_owned());
    }
    if endpoint.contains("inproc") {
        return Some(format!("{endpoint}_dp{rank}"));
    }
    if !endpoint.contains("tcp") {
        return None;
    }
    let base = ZmqEndpoint::parse(endpoint).ok()?;
    let port = base.port().checked_add(rank)?;
    ZmqEndpoint::new(base.host(), port)
        .ok()
        .map(|at| at.to_string())
}

/// A running subscription to one engine's event stream.
#[derive(Debug)]
pub struct Subscriber {
    status: Arc<Mutex<StreamStatus>>,
    task: Option<JoinHandle<()>>,
}

impl Subscriber {
    /// Starts the subscription on the current tokio runtime.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime (as `tokio::spawn`).
    #[must_use]
    pub fn spawn(config: SubscriberConfig, sink: impl EventSink) -> Self {
        let transport = ZmqTransport {
            endpoint: config.endpoint.clone(),
            replay_endpoint: config.replay_endpoint.clone(),
            topic: config.topic.clone(),
            connect_timeout: config.connect_timeout,
            max_message_size: config.limits.max_payload_bytes,
        };
        let status = Arc::new(Mutex::new(StreamStatus {
            state: StreamState::Connecting,
            counters: StreamCounters::default(),
            last_seq: None,
        }));
        let task = tokio::spawn(supervise(config, transport, sink, Arc::clone(&status)));
        Self {
            status,
            task: Some(task),
        }
    }

    /// The stream's current state and counters.
    #[must_use]
    pub fn status(&self) -> StreamStatus {
        self.status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops the subscription and waits for its task to end.
    pub async fn shutdown(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// One live message's frames, or the end of the connection.
pub(crate) enum LiveMsg {
    Frames(Vec<Bytes>),
    Closed,
}

/// An answer on the replay channel.
pub(crate) enum ReplayMsg {
    Item(ReplayId, Bytes, Bytes),
    End(ReplayId),
    Failed(ReplayId),
}

/// The sockets, behind a trait so that the loop's timers are tested with
/// paused time and no network.
pub(crate) trait Transport: Send + 'static {
    type Live: LiveStream;
    fn connect(&mut self) -> impl Future<Output = Result<Self::Live, String>> + Send;
    fn has_replay(&self) -> bool;
    fn replay(&self, id: ReplayId, from: u64, answers: mpsc::Sender<ReplayMsg>) -> JoinHandle<()>;
}

/// Replay answers that may wait for the stream's loop. The replay task
/// stops reading its socket while this many wait, so a replay server that
/// sends more than it was asked for, or faster than the loop applies
/// batches, fills its own socket's buffers rather than the router's
/// memory; and a replay lasts at most the sequencer's `replay_timeout`.
const REPLAY_ANSWER_QUEUE: usize = 64;

pub(crate) trait LiveStream: Send {
    fn next(&mut self) -> impl Future<Output = LiveMsg> + Send;
}

struct Loop<'a, S> {
    config: SubscriberConfig,
    machine: Sequencer<(EventBatch, usize)>,
    counters: StreamCounters,
    /// The counters of the loops before this one (restarts), which the
    /// sequencer's own counters are added to.
    base: StreamCounters,
    sink: &'a mut S,
    status: Arc<Mutex<StreamStatus>>,
    replay_task: Option<JoinHandle<()>>,
}

/// Runs the loop and restarts it whenever it ends; see the module docs.
async fn supervise<T: Transport, S: EventSink>(
    config: SubscriberConfig,
    mut transport: T,
    mut sink: S,
    status: Arc<Mutex<StreamStatus>>,
) {
    let mut in_a_row = 0u32;
    loop {
        let started = Instant::now();
        let outcome = futures_util::FutureExt::catch_unwind(AssertUnwindSafe(run(
            config.clone(),
            &mut transport,
            &mut sink,
            Arc::clone(&status),
        )))
        .await;
        let why = match outcome {
            Ok(()) => "ended".to_owned(),
            Err(panic) => panic_message(&*panic),
        };
        {
            // Cold at once: nothing reads the stream now.
            let mut status = status.lock().unwrap_or_else(PoisonError::into_inner);
            status.state = StreamState::Connecting;
            status.counters.restarts += 1;
        }
        // A loop that ran a while is a new failure, not one in a row.
        if started.elapsed() > config.backoff.max.saturating_mul(2) {
            in_a_row = 0;
        }
        in_a_row = in_a_row.saturating_add(1);
        let delay = config.backoff.delay(in_a_row);
        tracing::error!(endpoint = %config.endpoint, reason = %why, ?delay, "KV event receive loop stopped; restarting it");
        let reset = StreamEvent::Reset {
            reason: ResetReason::ReaderRestarted,
        };
        // The sink may be what panicked: it must not take the supervisor.
        if std::panic::catch_unwind(AssertUnwindSafe(|| sink.on_event(reset))).is_ok() {
            let mut status = status.lock().unwrap_or_else(PoisonError::into_inner);
            status.counters.resets += 1;
        }
        tokio::time::sleep(delay).await;
    }
}

/// What a panic said, for the log.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        format!("panicked: {text}")
    } else if let Some(text) = panic.downcast_ref::<String>() {
        format!("panicked: {text}")
    } else {
        "panicked".to_owned()
    }
}

async fn run<T: Transport, S: EventSink>(
    mut config: SubscriberConfig,
    transport: &mut T,
    sink: &mut S,
    status: Arc<Mutex<StreamStatus>>,
) {
    if !transport.has_replay() {
        config.sequencer.replay = false;
    }
    let base = status
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .counters;
    let mut lp = Loop {
        machine: Sequencer::new(config.sequencer.clone()),
        config,
        counters: base,
        base,
        sink,
        status,
        replay_task: None,
    };
    let (answers_tx, mut answers) = mpsc::channel(REPLAY_ANSWER_QUEUE);
    let mut failures = 0u32;
    loop {
        lp.publish_status();
        let mut live = match transport.connect().await {
            Ok(live) => live,
            Err(e) => {
                failures = failures.saturating_add(1);
                lp.counters.connect_failures += 1;
                let delay = lp.config.backoff.delay(failures);
                tracing::debug!(endpoint = %lp.config.endpoint, error = %e, ?delay, "KV event stream: connect failed");
                lp.publish_status();
                tokio::time::sleep(delay).await;
                continue;
            }
        };
        lp.counters.connects += 1;
        lp.machine.on_connected();
        // Learn what the engine already holds, even if it is idle now.
        lp.machine.catch_up_now(Instant::now().into_std());
        lp.apply(&*transport, &answers_tx);
        loop {
            let deadline = lp.machine.poll_timeout().map(Instant::from_std);
            tokio::select! {
                // Replay answers first: a replay's end marker that is
                // already here is applied before a live batch that came
                // after it, so the replay is judged on everything it sent.
                biased;
                Some(answer) = answers.recv() => lp.on_answer(answer),
                msg = live.next() => match msg {
                    LiveMsg::Frames(frames) => lp.on_live(frames),
                    LiveMsg::Closed => break,
                },
                () = sleep_until(deadline) => lp.machine.on_timeout(Instant::now().into_std()),
            }
            lp.apply(&*transport, &answers_tx);
        }
        lp.counters.disconnects += 1;
        lp.machine.on_disconnected();
        // Ending the replay may deliver what was buffered (after a reset).
        lp.apply(&*transport, &answers_tx);
        if let Some(task) = lp.replay_task.take() {
            task.abort();
        }
        failures = 1;
        tokio::time::sleep(lp.config.backoff.delay(failures)).await;
    }
}

/// A payload's fingerprint, to recognise the same batch (a duplicate, or
/// the replay's anchor). Payloads carry the engine's timestamp, so two
/// different batches practically never share bytes.
fn fingerprint(payload: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    payload.hash(&mut hasher);
    hasher.finish()
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

impl<S> Drop for Loop<'_, S> {
    fn drop(&mut self) {
        // A loop that ends (or unwinds) takes its replay with it.
        if let Some(task) = self.replay_task.take() {
            task.abort();
        }
    }
}

impl<S: EventSink> Loop<'_, S> {
    fn on_live(&mut self, frames: Vec<Bytes>) {
        self.counters.messages += 1;
        let [_topic, seq, payload] = frames.as_slice() else {
            self.counters.decode_errors += 1;
            return;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
            self.counters.decode_errors += 1;
            return;
        };
        match decode_batch_with(payload, &self.config.limits) {
            Ok(decoded) => {
                self.machine.on_live(
                    seq,
                    fingerprint(payload),
                    (decoded.batch, decoded.unknown_events),
                    Instant::now().into_std(),
                );
            }
            Err(e) => {
                // Not fed to the sequencer: the batch is lost, which the
                // next one shows as a gap (and a replay may recover it).
                self.counters.decode_errors += 1;
                tracing::warn!(endpoint = %self.config.endpoint, seq, error = %e, "undecodable KV event batch");
            }
        }
    }

    fn on_answer(&mut self, answer: ReplayMsg) {
        match answer {
            ReplayMsg::Item(id, seq, payload) => {
                let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
                    self.counters.decode_errors += 1;
                    return;
                };
                match decode_batch_with(&payload, &self.config.limits) {
                    Ok(decoded) => self.machine.on_replay(
                        id,
                        seq,
                        fingerprint(&payload),
                        (decoded.batch, decoded.unknown_events),
                        Instant::now().into_std(),
                    ),
                    Err(_) => self.counters.decode_errors += 1,
                }
            }
            ReplayMsg::End(id) => self.machine.on_replay_end(id),
            ReplayMsg::Failed(id) => self.machine.on_replay_failed(id),
        }
    }

    fn apply<T: Transport>(&mut self, transport: &T, answers: &mpsc::Sender<ReplayMsg>) {
        while let Some(action) = self.machine.poll_action() {
            match action {
                Action::Deliver { seq, item, source } => {
                    let (batch, unknown_events) = item;
                    self.counters.batches += 1;
                    self.counters.events += batch.events.len() as u64;
                    self.counters.unknown_events += unknown_events as u64;
                    self.sink.on_event(StreamEvent::Batch {
                        seq,
                        batch,
                        unknown_events,
                        source,
                    });
                }
                Action::Reset(reason) => {
                    tracing::info!(endpoint = %self.config.endpoint, %reason, "KV event stream reset");
                    self.sink.on_event(StreamEvent::Reset { reason });
                }
                Action::RequestReplay { id, from } => {
                    if let Some(task) = self.replay_task.take() {
                        task.abort();
                    }
                    self.replay_task = Some(transport.replay(id, from, answers.clone()));
                }
            }
        }
        // A finished or abandoned replay needs its connection no more.
        if self.machine.poll_timeout().is_none()
            && let Some(task) = self.replay_task.take()
        {
            task.abort();
        }
        self.publish_status();
    }

    fn publish_status(&self) {
        let m = self.machine.counters();
        let mut counters = self.counters;
        counters.duplicates = self.base.duplicates + m.duplicates;
        counters.gaps = self.base.gaps + m.gaps;
        counters.replays = self.base.replays + m.replays;
        counters.replay_timeouts = self.base.replay_timeouts + m.replay_timeouts;
        counters.resets = self.base.resets + m.resets;
        let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        status.state = self.machine.state();
        status.counters = counters;
        status.last_seq = self.machine.last_delivered();
    }
}

/// The real sockets.
struct ZmqTransport {
    endpoint: String,
    replay_endpoint: Option<String>,
    topic: String,
    connect_timeout: Duration,
    max_message_size: usize,
}

/// Live messages a SUB socket's thread may hold for the loop; beyond them
/// the thread stops reading and libzmq's high-water mark takes over (a PUB
/// socket drops what a slow subscriber cannot take, as vLLM expects).
const LIVE_QUEUE: usize = 64;

/// Answers a replay socket's thread may hold for the replay task.
const REPLAY_THREAD_QUEUE: usize = 8;

struct ZmqLive {
    thread: SocketThread,
}

/// A SUB socket connected to `endpoint`, with its monitor; libzmq's own
/// reconnection is off (the loop reconnects with its backoff).
fn sub_socket(
    endpoint: &str,
    topic: &str,
    max_message_size: usize,
) -> zmq::Result<(zmq::Socket, zmq::Socket)> {
    let socket = context().socket(zmq::SUB)?;
    harden(
        &socket,
        max_message_size,
        crate::zmq_io::DEFAULT_RECEIVE_HWM,
    )?;
    socket.set_reconnect_ivl(-1)?;
    socket.set_subscribe(topic.as_bytes())?;
    let monitor = crate::zmq_io::monitor(&socket)?;
    socket.connect(endpoint)?;
    Ok((socket, monitor))
}

impl Transport for ZmqTransport {
    type Live = ZmqLive;

    fn connect(&mut self) -> impl Future<Output = Result<ZmqLive, String>> + Send {
        let endpoint = self.endpoint.clone();
        let topic = self.topic.clone();
        let timeout = self.connect_timeout;
        let max = self.max_message_size;
        async move {
            let (socket, monitor) =
                sub_socket(&endpoint, &topic, max).map_err(|e| e.to_string())?;
            let mut thread =
                SocketThread::spawn("kv-events-sub", socket, Some(monitor), LIVE_QUEUE)
                    .map_err(|e| e.to_string())?;
            // Connected once the ZMTP handshake succeeded: a listener that
            // is not a ZMQ publisher never makes the stream live.
            match tokio::time::timeout(timeout, thread.recv()).await {
                Ok(Some(Incoming::Connected)) => Ok(ZmqLive { thread }),
                Ok(Some(_) | None) => Err("the connection closed during the handshake".to_owned()),
                Err(_) => Err("connect timed out".to_owned()),
            }
        }
    }

    fn has_replay(&self) -> bool {
        self.replay_endpoint.is_some()
    }

    fn replay(&self, id: ReplayId, from: u64, answers: mpsc::Sender<ReplayMsg>) -> JoinHandle<()> {
        let endpoint = self.replay_endpoint.clone().unwrap_or_default();
        let max = self.max_message_size;
        tokio::spawn(async move {
            let outcome = replay_once(&endpoint, max, id, from, &answers).await;
            if let Err(e) = outcome {
                tracing::debug!(%endpoint, error = %e, "KV event replay failed");
                let _ = answers.send(ReplayMsg::Failed(id)).await;
            }
        })
    }
}

/// One replay over a fresh DEALER: the request, then answers until the
/// end marker. Aborting the task drops the socket thread (and the socket).
async fn replay_once(
    endpoint: &str,
    max_message_size: usize,
    id: ReplayId,
    from: u64,
    answers: &mpsc::Sender<ReplayMsg>,
) -> Result<(), String> {
    let dealer = context().socket(zmq::DEALER).map_err(|e| e.to_string())?;
    harden(
        &dealer,
        max_message_size,
        crate::zmq_io::DEFAULT_RECEIVE_HWM,
    )
    .map_err(|e| e.to_string())?;
    dealer.connect(endpoint).map_err(|e| e.to_string())?;
    // Queued until the connection is made (the sequencer's replay timeout
    // bounds the wait).
    dealer
        .send_multipart([&[][..], &from.to_be_bytes()[..]], zmq::DONTWAIT)
        .map_err(|e| e.to_string())?;
    let mut thread = SocketThread::spawn("kv-events-replay", dealer, None, REPLAY_THREAD_QUEUE)
        .map_err(|e| e.to_string())?;
    loop {
        let mut frames = match thread.recv().await {
            Some(Incoming::Message(frames)) => frames,
            Some(_) => continue,
            None => return Err("the replay socket's thread ended".to_owned()),
        };
        // A DEALER sees the ROUTER's empty delimiter; a REQ-style peer
        // would have stripped it.
        if frames.first().is_some_and(Bytes::is_empty) && frames.len() == 3 {
            frames.remove(0);
        }
        let [seq, payload] = <[Bytes; 2]>::try_from(frames)
            .map_err(|f| format!("replay answer with {} frames", f.len()))?;
        if payload.is_empty() || seq.as_ref() == crate::publisher::END_OF_REPLAY {
            let _ = answers.send(ReplayMsg::End(id)).await;
            return Ok(());
        }
        // Waits while the loop has REPLAY_ANSWER_QUEUE answers to apply.
        if answers
            .send(ReplayMsg::Item(id, seq, payload))
            .await
            .is_err()
        {
            return Ok(());
        }
    }
}

impl LiveStream for ZmqLive {
    async fn next(&mut self) -> LiveMsg {
        loop {
            match self.thread.recv().await {
                Some(Incoming::Message(frames)) => return LiveMsg::Frames(frames),
                Some(Incoming::Connected) => {}
                // libzmq closed the connection (the peer left, or broke the
                // protocol or the size bound), or the thread ended.
                Some(Incoming::Disconnected) | None => return LiveMsg::Closed,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The loop's timers (reconnect backoff, replay deadline) with paused
    //! time and an in-memory transport: exact virtual durations, no network.

    use super::*;
    use crate::encode::encode_batch;

    struct FakeTransport {
        attempts: Arc<Mutex<Vec<Instant>>>,
        fail_first: usize,
        /// The connections it makes, in order.
        lives: std::collections::VecDeque<mpsc::UnboundedReceiver<LiveMsg>>,
        replays: mpsc::UnboundedSender<(ReplayId, u64)>,
    }

    struct FakeLive(mpsc::UnboundedReceiver<LiveMsg>);

    impl LiveStream for FakeLive {
        async fn next(&mut self) -> LiveMsg {
            match self.0.recv().await {
                // The test's way to make the loop crash.
                Some(LiveMsg::Frames(frames)) if frames.first().is_some_and(|f| f == "panic") => {
                    panic!("the reader broke")
                }
                Some(msg) => msg,
                None => LiveMsg::Closed,
            }
        }
    }

    impl Transport for FakeTransport {
        type Live = FakeLive;

        fn connect(&mut self) -> impl Future<Output = Result<FakeLive, String>> + Send {
            let mut attempts = self.attempts.lock().unwrap();
            attempts.push(Instant::now());
            let result = if attempts.len() <= self.fail_first {
                Err("refused".to_owned())
            } else {
                self.lives
                    .pop_front()
                    .map(FakeLive)
                    .ok_or_else(|| "gone".to_owned())
            };
            std::future::ready(result)
        }

        fn has_replay(&self) -> bool {
            true
        }

        fn replay(
            &self,
            id: ReplayId,
            from: u64,
            _answers: mpsc::Sender<ReplayMsg>,
        ) -> JoinHandle<()> {
            // Recorded, never answered.
            let _ = self.replays.send((id, from));
            tokio::spawn(async {})
        }
    }

    fn frames(seq: u64) -> LiveMsg {
        let payload = encode_batch(&EventBatch::new(seq as f64, Vec::new()));
        LiveMsg::Frames(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ])
    }

    /// A replay server that answers one request with far more batches
    /// than were asked for and never ends: the replay task stops reading
    /// once REPLAY_ANSWER_QUEUE answers wait, and reads on as they are
    /// taken.
    #[tokio::test]
    async fn a_replay_flood_waits_for_the_loop_instead_of_queueing() {
        let router = context().socket(zmq::ROUTER).unwrap();
        router.set_linger(0).unwrap();
        router.set_sndtimeo(100).unwrap();
        router.bind("tcp://127.0.0.1:0").unwrap();
        let endpoint = crate::zmq_io::last_endpoint(&router).unwrap();
        let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let server_sent = Arc::clone(&sent);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let server_stop = Arc::clone(&stop);
        let server = std::thread::spawn(move || {
            router.set_rcvtimeo(10_000).unwrap();
            let request = router.recv_multipart(0).unwrap();
            let identity = request[0].clone();
            let mut seq = 0u64;
            while !server_stop.load(std::sync::atomic::Ordering::Relaxed) {
                let payload = encode_batch(&EventBatch::new(seq as f64, Vec::new()));
                let message = [
                    identity.clone(),
                    Vec::new(),
                    seq.to_be_bytes().to_vec(),
                    payload,
                ];
                // Blocks (up to the send timeout) while the client's
                // buffers are full.
                if router.send_multipart(message, 0).is_ok() {
                    server_sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    seq += 1;
                }
            }
        });
        let (answers_tx, mut answers) = mpsc::channel(REPLAY_ANSWER_QUEUE);
        let replay = tokio::spawn(async move {
            replay_once(&endpoint, 1 << 20, ReplayId(1), 0, &answers_tx).await
        });
        // Nobody takes answers: the queue fills and stays full.
        let deadline = Instant::now() + Duration::from_secs(10);
        while answers.len() < REPLAY_ANSWER_QUEUE && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(answers.len(), REPLAY_ANSWER_QUEUE);
        assert!(
            !replay.is_finished(),
            "the replay task waits, it does not end"
        );
        // Taking answers lets more in, in order.
        for expected in 0..(2 * REPLAY_ANSWER_QUEUE as u64) {
            match tokio::time::timeout(Duration::from_secs(10), answers.recv()).await {
                Ok(Some(ReplayMsg::Item(ReplayId(1), seq, _))) => {
                    assert_eq!(seq.as_ref(), expected.to_be_bytes());
                }
                _ => panic!("answer {expected} missing"),
            }
        }
        assert!(answers.len() <= REPLAY_ANSWER_QUEUE);
        assert!(sent.load(std::sync::atomic::Ordering::Relaxed) >= 2 * REPLAY_ANSWER_QUEUE);
        replay.abort();
        let _ = replay.await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        server.join().unwrap();
    }

    struct Rig {
        attempts: Arc<Mutex<Vec<Instant>>>,
        live: mpsc::UnboundedSender<LiveMsg>,
        replays: mpsc::UnboundedReceiver<(ReplayId, u64)>,
        events: mpsc::UnboundedReceiver<StreamEvent>,
        status: Arc<Mutex<StreamStatus>>,
        task: JoinHandle<()>,
    }

    fn rig(fail_first: usize, config: SubscriberConfig) -> Rig {
        let attempts = Arc::new(Mutex::new(Vec::new()));
        let (live_tx, live_rx) = mpsc::unbounded_channel();
        let (replays_tx, replays) = mpsc::unbounded_channel();
        let (events_tx, events) = mpsc::unbounded_channel();
        let transport = FakeTransport {
            attempts: Arc::clone(&attempts),
            fail_first,
            lives: [live_rx].into(),
            replays: replays_tx,
        };
        let status = Arc::new(Mutex::new(StreamStatus {
            state: StreamState::Connecting,
            counters: StreamCounters::default(),
            last_seq: None,
        }));
        let task = tokio::spawn(supervise(config, transport, events_tx, Arc::clone(&status)));
        Rig {
            attempts,
            live: live_tx,
            replays,
            events,
            status,
            task,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn reconnect_attempts_back_off_exponentially_up_to_the_cap() {
        let mut config = SubscriberConfig::new("tcp://fake:1").with_replay("tcp://fake:2");
        config.backoff = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(250),
        };
        let mut rig = rig(4, config);
        // The fifth attempt connects; a live batch then comes through.
        rig.live.send(frames(0)).unwrap();
        let event = rig.events.recv().await.unwrap();
        assert!(
            matches!(event, StreamEvent::Batch { seq: 0, .. }),
            "{event:?}"
        );
        let attempts = rig.attempts.lock().unwrap().clone();
        let gaps: Vec<_> = attempts.windows(2).map(|w| w[1] - w[0]).collect();
        let ms = Duration::from_millis;
        assert_eq!(gaps, vec![ms(100), ms(200), ms(250), ms(250)]);
        let status = rig.status.lock().unwrap().clone();
        assert_eq!(status.counters.connect_failures, 4);
        assert_eq!(status.counters.connects, 1);
        assert_eq!(status.state, StreamState::Live);
        rig.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_catches_up_at_once_without_waiting_for_a_live_batch() {
        let config = SubscriberConfig::new("tcp://fake:1").with_replay("tcp://fake:2");
        let mut rig = rig(0, config);
        let t0 = Instant::now();
        let (_, from) = rig.replays.recv().await.unwrap();
        assert_eq!(from, 0, "the whole buffer is asked for");
        assert_eq!(Instant::now(), t0, "at connection time, before any batch");
        let status = rig.status.lock().unwrap().clone();
        assert_eq!(status.state, StreamState::Replaying { from: 0 });
        assert_eq!(status.counters.replays, 1);
        rig.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn an_unanswered_replay_resets_exactly_at_its_deadline() {
        let mut config = SubscriberConfig::new("tcp://fake:1").with_replay("tcp://fake:2");
        config.sequencer.replay_timeout = Duration::from_millis(750);
        // Only the gap's replay is under test, not the catch-up on connect.
        config.sequencer.catch_up = false;
        let mut rig = rig(0, config);
        rig.live.send(frames(0)).unwrap();
        assert!(matches!(
            rig.events.recv().await.unwrap(),
            StreamEvent::Batch { seq: 0, .. }
        ));
        let t0 = Instant::now();
        rig.live.send(frames(2)).unwrap();
        let (_, from) = rig.replays.recv().await.unwrap();
        assert_eq!(
            from, 0,
            "the replay starts at the anchor, the last delivered batch"
        );
        let event = rig.events.recv().await.unwrap();
        assert_eq!(Instant::now() - t0, Duration::from_millis(750));
        assert!(
            matches!(
                event,
                StreamEvent::Reset {
                    reason: ResetReason::ReplayTimedOut { missing_from: 1 }
                }
            ),
            "{event:?}"
        );
        assert!(matches!(
            rig.events.recv().await.unwrap(),
            StreamEvent::Batch {
                seq: 2,
                source: Source::Live,
                ..
            }
        ));
        let counters = rig.status.lock().unwrap().counters;
        assert_eq!(
            (counters.gaps, counters.replay_timeouts, counters.resets),
            (1, 1, 1)
        );
        rig.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_connection_is_retried_after_the_first_backoff_step() {
        let mut config = SubscriberConfig::new("tcp://fake:1");
        config.backoff.initial = Duration::from_millis(300);
        let mut rig = rig(0, config);
        rig.live.send(frames(0)).unwrap();
        assert!(rig.events.recv().await.is_some());
        rig.live.send(LiveMsg::Closed).unwrap();
        // The fake has one connection only: the next attempt fails, and the
        // one after is another backoff step later.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let attempts = rig.attempts.lock().unwrap().clone();
        assert_eq!(attempts.len(), 3, "{attempts:?}");
        assert_eq!(attempts[2] - attempts[1], Duration::from_millis(600));
        let status = rig.status.lock().unwrap().clone();
        assert_eq!(status.state, StreamState::Connecting);
        assert_eq!(status.counters.disconnects, 1);
        rig.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_crashed_reader_is_restarted_counted_and_cold_until_it_reads_again() {
        let mut config = SubscriberConfig::new("tcp://fake:1");
        config.backoff.initial = Duration::from_millis(200);
        let (first_tx, first_rx) = mpsc::unbounded_channel();
        let (second_tx, second_rx) = mpsc::unbounded_channel();
        let (replays_tx, _replays) = mpsc::unbounded_channel();
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let transport = FakeTransport {
            attempts: Arc::new(Mutex::new(Vec::new())),
            fail_first: 0,
            lives: [first_rx, second_rx].into(),
            replays: replays_tx,
        };
        let status = Arc::new(Mutex::new(StreamStatus {
            state: StreamState::Connecting,
            counters: StreamCounters::default(),
            last_seq: None,
        }));
        let task = tokio::spawn(supervise(config, transport, events_tx, Arc::clone(&status)));
        let snapshot = || status.lock().unwrap().clone();
        first_tx.send(frames(0)).unwrap();
        assert!(matches!(
            events.recv().await.unwrap(),
            StreamEvent::Batch { seq: 0, .. }
        ));
        assert_eq!(snapshot().state, StreamState::Live);
        // The reader crashes: the stream is cold at once, the restart is
        // counted, and the sink is told to forget the stream.
        first_tx
            .send(LiveMsg::Frames(vec![Bytes::from_static(b"panic")]))
            .unwrap();
        let event = events.recv().await.unwrap();
        assert_eq!(
            event,
            StreamEvent::Reset {
                reason: ResetReason::ReaderRestarted
            }
        );
        let down = snapshot();
        assert_eq!(down.state, StreamState::Connecting);
        assert_eq!(down.counters.restarts, 1);
        assert_eq!(down.counters.batches, 1, "counters survive the restart");
        // After the backoff step a fresh loop connects and reads again.
        tokio::time::sleep(Duration::from_millis(250)).await;
        second_tx.send(frames(1)).unwrap();
        assert!(matches!(
            events.recv().await.unwrap(),
            StreamEvent::Batch { seq: 1, .. }
        ));
        let up = snapshot();
        assert_eq!(up.state, StreamState::Live);
        assert_eq!(up.counters.restarts, 1);
        assert_eq!(up.counters.batches, 2);
        assert_eq!(up.counters.connects, 2);
        task.abort();
    }

    #[test]
    fn rank_endpoints_follow_vllm() {
        assert_eq!(
            endpoint_for_rank("tcp://*:5557", 0).unwrap(),
            "tcp://*:5557"
        );
        assert_eq!(
            endpoint_for_rank("tcp://10.0.0.5:5557", 3).unwrap(),
            "tcp://10.0.0.5:5560"
        );
        assert_eq!(
            endpoint_for_rank("inproc://cache", 2).unwrap(),
            "inproc://cache_dp2"
        );
        assert_eq!(endpoint_for_rank("tcp://host:65535", 1), None);
        assert_eq!(endpoint_for_rank("ipc:///tmp/x", 1), None);
        // The TCP address is a `ZmqEndpoint`, or there is no rank's.
        assert_eq!(
            endpoint_for_rank("tcp://[::1]:5557", 2).unwrap(),
            "tcp://[::1]:5559"
        );
        assert_eq!(endpoint_for_rank("tcp://*:5557", 1), None);
        assert_eq!(endpoint_for_rank("tcp://host", 1), None);
        assert_eq!(endpoint_for_rank("tcp://h:1\r\nx:2", 1), None);
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let b = Backoff::default();
        assert_eq!(b.delay(1), Duration::from_millis(100));
        assert_eq!(b.delay(3), Duration::from_millis(400));
        assert_eq!(b.delay(10), Duration::from_secs(5));
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(5));
    }
}
