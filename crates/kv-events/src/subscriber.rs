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
//! # Cancel safety
//!
//! Dropping a [`Subscriber`] aborts its task; batches not yet handed to the
//! sink are lost with it (a new subscriber starts cold).

use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::decode::decode_batch_with;
use crate::sequencer::{
    Action, ReplayId, ResetReason, Sequencer, SequencerConfig, Source, StreamState,
};
use crate::wire::{DecodeLimits, EventBatch};

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
    /// Bounds on decoded payloads.
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
/// address. `None` when a TCP address has no numeric port or the port would
/// overflow, or the transport is neither (vLLM refuses those too).
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
    let (base, port) = endpoint.rsplit_once(':')?;
    let port = port.parse::<u16>().ok()?.checked_add(rank)?;
    Some(format!("{base}:{port}"))
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
        };
        let status = Arc::new(Mutex::new(StreamStatus {
            state: StreamState::Connecting,
            counters: StreamCounters::default(),
            last_seq: None,
        }));
        let task = tokio::spawn(run(config, transport, sink, Arc::clone(&status)));
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

struct Loop<S> {
    config: SubscriberConfig,
    machine: Sequencer<(EventBatch, usize)>,
    counters: StreamCounters,
    sink: S,
    status: Arc<Mutex<StreamStatus>>,
    replay_task: Option<JoinHandle<()>>,
}

async fn run<T: Transport, S: EventSink>(
    mut config: SubscriberConfig,
    mut transport: T,
    sink: S,
    status: Arc<Mutex<StreamStatus>>,
) {
    if !transport.has_replay() {
        config.sequencer.replay = false;
    }
    let mut lp = Loop {
        machine: Sequencer::new(config.sequencer.clone()),
        config,
        counters: StreamCounters::default(),
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
        lp.apply(&transport, &answers_tx);
        loop {
            let deadline = lp.machine.poll_timeout().map(Instant::from_std);
            tokio::select! {
                msg = live.next() => match msg {
                    LiveMsg::Frames(frames) => lp.on_live(frames),
                    LiveMsg::Closed => break,
                },
                Some(answer) = answers.recv() => lp.on_answer(answer),
                () = sleep_until(deadline) => lp.machine.on_timeout(Instant::now().into_std()),
            }
            lp.apply(&transport, &answers_tx);
        }
        lp.counters.disconnects += 1;
        lp.machine.on_disconnected();
        // Ending the replay may deliver what was buffered (after a reset).
        lp.apply(&transport, &answers_tx);
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

impl<S: EventSink> Loop<S> {
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
        counters.duplicates = m.duplicates;
        counters.gaps = m.gaps;
        counters.replays = m.replays;
        counters.replay_timeouts = m.replay_timeouts;
        counters.resets = m.resets;
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
}

struct ZmqLive {
    socket: zeromq::SubSocket,
    /// The socket's events; a `Disconnected` ends the connection.
    monitor: futures_util::stream::BoxStream<'static, zeromq::SocketEvent>,
}

impl Transport for ZmqTransport {
    type Live = ZmqLive;

    fn connect(&mut self) -> impl Future<Output = Result<ZmqLive, String>> + Send {
        let endpoint = self.endpoint.clone();
        let topic = self.topic.clone();
        let timeout = self.connect_timeout;
        async move {
            use zeromq::Socket;
            let mut options = zeromq::SocketOptions::default();
            options.connect_timeout(timeout);
            let mut socket = zeromq::SubSocket::with_options(options);
            let monitor = socket.monitor();
            tokio::time::timeout(timeout, socket.connect(&endpoint))
                .await
                .map_err(|_| "connect timed out".to_owned())?
                .map_err(|e| e.to_string())?;
            socket.subscribe(&topic).await.map_err(|e| e.to_string())?;
            Ok(ZmqLive {
                socket,
                monitor: futures_util::StreamExt::boxed(monitor),
            })
        }
    }

    fn has_replay(&self) -> bool {
        self.replay_endpoint.is_some()
    }

    fn replay(&self, id: ReplayId, from: u64, answers: mpsc::Sender<ReplayMsg>) -> JoinHandle<()> {
        let endpoint = self.replay_endpoint.clone().unwrap_or_default();
        let timeout = self.connect_timeout;
        tokio::spawn(async move {
            let outcome = replay_once(&endpoint, timeout, id, from, &answers).await;
            if let Err(e) = outcome {
                tracing::debug!(%endpoint, error = %e, "KV event replay failed");
                let _ = answers.send(ReplayMsg::Failed(id)).await;
            }
        })
    }
}

async fn replay_once(
    endpoint: &str,
    timeout: Duration,
    id: ReplayId,
    from: u64,
    answers: &mpsc::Sender<ReplayMsg>,
) -> Result<(), String> {
    use zeromq::{Socket, SocketRecv, SocketSend};
    let mut options = zeromq::SocketOptions::default();
    options.connect_timeout(timeout);
    let mut dealer = zeromq::DealerSocket::with_options(options);
    tokio::time::timeout(timeout, dealer.connect(endpoint))
        .await
        .map_err(|_| "connect timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    let request =
        crate::publisher::frames([Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())]);
    dealer.send(request).await.map_err(|e| e.to_string())?;
    loop {
        let mut frames = dealer.recv().await.map_err(|e| e.to_string())?.into_vec();
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
        use futures_util::StreamExt;
        use zeromq::SocketRecv;
        loop {
            tokio::select! {
                msg = self.socket.recv() => return match msg {
                    Ok(msg) => LiveMsg::Frames(msg.into_vec()),
                    Err(_) => LiveMsg::Closed,
                },
                event = self.monitor.next() => match event {
                    Some(zeromq::SocketEvent::Disconnected(_)) | None => return LiveMsg::Closed,
                    Some(_) => {}
                },
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
        live: Option<mpsc::UnboundedReceiver<LiveMsg>>,
        replays: mpsc::UnboundedSender<(ReplayId, u64)>,
    }

    struct FakeLive(mpsc::UnboundedReceiver<LiveMsg>);

    impl LiveStream for FakeLive {
        async fn next(&mut self) -> LiveMsg {
            self.0.recv().await.unwrap_or(LiveMsg::Closed)
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
                self.live
                    .take()
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
        use zeromq::{Socket, SocketRecv, SocketSend};
        let mut router = zeromq::RouterSocket::new();
        let endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let server_sent = Arc::clone(&sent);
        let server = tokio::spawn(async move {
            let request = router.recv().await.unwrap().into_vec();
            let identity = request[0].clone();
            for seq in 0u64.. {
                let payload = encode_batch(&EventBatch::new(seq as f64, Vec::new()));
                let message = crate::publisher::frames([
                    identity.clone(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    Bytes::from(payload),
                ]);
                if router.send(message).await.is_err() {
                    break;
                }
                server_sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
        let (answers_tx, mut answers) = mpsc::channel(REPLAY_ANSWER_QUEUE);
        let replay = tokio::spawn(async move {
            replay_once(
                &endpoint,
                Duration::from_secs(5),
                ReplayId(1),
                0,
                &answers_tx,
            )
            .await
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
        server.abort();
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
            live: Some(live_rx),
            replays: replays_tx,
        };
        let status = Arc::new(Mutex::new(StreamStatus {
            state: StreamState::Connecting,
            counters: StreamCounters::default(),
            last_seq: None,
        }));
        let task = tokio::spawn(run(config, transport, events_tx, Arc::clone(&status)));
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
