//! The ZMQ listener: a ROUTER socket and its receive loop.
//!
//! # Why the address check runs beside the loop
//!
//! One loop receives every engine's messages. If it awaited each message's
//! address check in turn, one host name that takes five seconds to resolve
//! would hold up every registration queued behind it, heartbeats included,
//! and engines with a short TTL would expire while the loop waited. So the
//! loop only decodes (cheap, synchronous) and hands the check to a task in
//! a bounded set; a registration is applied when its own check finishes,
//! whatever the others are doing.
//!
//! Two rules keep that correct:
//!
//! - **One engine, one check at a time, newest message wins.** Checks of
//!   the same (role, URL) never run concurrently: a message that arrives
//!   while its engine's check is running waits behind it, replacing any
//!   older message waiting there. So an engine's registrations are applied
//!   in the order it sent them (a restart's new labels are never
//!   overwritten by an older heartbeat that happened to resolve later), and
//!   a slow engine that keeps sending costs one task, not one per message.
//! - **Bounded.** At most [`DiscoveryConfig::max_pending_checks`] checks run
//!   at once, each within [`DiscoveryConfig::check_timeout`]. When the set
//!   is full the loop stops reading until one finishes: ZMQ queues the
//!   messages meanwhile, and nothing grows without bound.
//!
//! # The socket: libzmq, bounded
//!
//! The ROUTER port is open to anyone who can reach it, before any check.
//! It is libzmq's (through the `zmq` crate, read by its own thread: see
//! [`kv_events::zmq_io`] for that design), with `ZMQ_MAXMSGSIZE` set to
//! [`DiscoveryConfig::max_message_size`]: a frame that declares more is
//! refused by libzmq before any byte of it is buffered, and only that
//! peer's connection is closed. (The pure-Rust `zeromq` crate used before
//! reserved whatever length a peer declared: 127 connections claiming
//! 2^40 bytes each aborted the router.)
//!
//! # Supervision
//!
//! The loop runs as a task under a supervisor. If it ever ends (its socket
//! thread failed, or it panicked), the supervisor marks the listener as not
//! receiving ([`ZmqDiscovery::is_receiving`]), counts a restart
//! ([`ZmqDiscovery::receive_restarts`]), logs it, waits a backoff step
//! (100 ms doubling to 5 s) and starts a fresh loop on a fresh socket bound
//! to the same address; engines' DEALERs reconnect by themselves. The
//! registries are untouched: an entry lives its TTL whatever happens to the
//! loop.

use crate::message::{EngineRegistration, RegisteredRole, decode_registration, payload_of};
use crate::registrar::{AddressCheck, AddressRefused, DEFAULT_CHECK_TIMEOUT, Registrar};
use crate::registries::Registries;
use bytes::Bytes;
use kv_events::LogThrottle;
use kv_events::zmq_io::{Incoming, SocketThread, context, harden, last_endpoint};
use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::task::{Id, JoinError, JoinSet};
use worker_lifecycle::WorkerUrl;

/// How long a registration lives without a new message (vLLM engines send
/// one every few seconds).
pub const DEFAULT_TTL: Duration = Duration::from_secs(5);

/// How many address checks run at once by default.
pub const DEFAULT_MAX_PENDING_CHECKS: usize = 64;

/// The largest ZMQ frame the ROUTER accepts by default: 64 KiB.
///
/// A registration is a MessagePack map of a few short strings (`type`,
/// `http_address`, `zmq_address`, optional labels such as a model name or
/// a data-parallel rank): a few hundred bytes, a few KB with generous
/// labels. 64 KiB leaves over ten times that, and bounds what one
/// connection can make the router buffer (times `ZMQ_RCVHWM` messages
/// queued per peer).
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 64 << 10;

/// Messages queued per engine connection before libzmq stops reading it.
const RECEIVE_HWM: i32 = 1000;

/// Messages the socket thread may hold for the loop.
const SOCKET_QUEUE: usize = 256;

/// The supervisor's backoff between restarts: doubles from the first to
/// the last.
const RESTART_BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));

/// How a [`ZmqDiscovery`] listener runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryConfig {
    /// How long a registration lives after its last message (default 5 s).
    pub ttl: Duration,
    /// How long one address check may take before its registration is
    /// refused (default 5 s).
    pub check_timeout: Duration,
    /// How many address checks run at once (default 64; 0 counts as 1).
    /// When that many are running, the loop reads no further message until
    /// one finishes.
    pub max_pending_checks: usize,
    /// The largest ZMQ frame accepted, in bytes (default
    /// [`DEFAULT_MAX_MESSAGE_SIZE`]): libzmq's `ZMQ_MAXMSGSIZE`, enforced
    /// before the frame is buffered.
    pub max_message_size: usize,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            check_timeout: DEFAULT_CHECK_TIMEOUT,
            max_pending_checks: DEFAULT_MAX_PENDING_CHECKS,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
        }
    }
}

/// Why discovery could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The address is not `HOST:PORT`.
    #[error("invalid discovery address {0:?} (expected HOST:PORT)")]
    Address(String),
    /// The ROUTER socket could not be bound.
    #[error("cannot bind the ZMQ ROUTER socket on {address}: {reason}")]
    Bind {
        /// The address.
        address: String,
        /// What went wrong.
        reason: String,
    },
}

/// A running ZMQ discovery listener. Dropping it stops the listener and
/// every address check it started.
#[derive(Debug)]
pub struct ZmqDiscovery {
    registrar: Registrar,
    local_addr: SocketAddr,
    health: Arc<ReceiveHealth>,
    task: tokio::task::JoinHandle<()>,
}

/// Whether the receive loop runs, and how often it was restarted.
#[derive(Debug, Default)]
struct ReceiveHealth {
    receiving: AtomicBool,
    restarts: AtomicU64,
}

impl ZmqDiscovery {
    /// Binds a ROUTER socket on `address` (`HOST:PORT`; port 0 picks a free
    /// one) and registers every well-formed message, with entries living
    /// `ttl`. No address check.
    pub async fn bind(address: &str, ttl: Duration) -> Result<Self, DiscoveryError> {
        let config = DiscoveryConfig {
            ttl,
            ..DiscoveryConfig::default()
        };
        Self::bind_with(address, &config, None).await
    }

    /// [`ZmqDiscovery::bind`] with a configuration and an optional address
    /// check that every registration must pass before it is applied.
    pub async fn bind_with(
        address: &str,
        config: &DiscoveryConfig,
        check: Option<Arc<dyn AddressCheck>>,
    ) -> Result<Self, DiscoveryError> {
        let (host, port) = address
            .rsplit_once(':')
            .filter(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
            .ok_or_else(|| DiscoveryError::Address(address.to_owned()))?;
        let bind_error = |reason: String| DiscoveryError::Bind {
            address: address.to_owned(),
            reason,
        };
        let ip = resolve_bind_host(host)
            .await
            .ok_or_else(|| bind_error(format!("cannot resolve {host:?} to an address")))?;
        let port: u16 = port.parse().unwrap_or_default();
        let max_message_size = config.max_message_size;
        let socket =
            open_router(SocketAddr::new(ip, port), max_message_size).map_err(bind_error)?;
        let local_addr = socket.1;
        let mut registrar = Registrar::new(Registries::new(config.ttl));
        if let Some(check) = check {
            registrar = registrar.with_check(check, config.check_timeout);
        }
        let health = Arc::new(ReceiveHealth {
            receiving: AtomicBool::new(true),
            restarts: AtomicU64::new(0),
        });
        let open = move || open_router(local_addr, max_message_size).map(|(thread, _)| thread);
        let task = tokio::spawn(supervise(
            registrar.clone(),
            config.max_pending_checks,
            Some(socket.0),
            open,
            Arc::clone(&health),
        ));
        tracing::info!(
            %local_addr,
            ttl_secs = config.ttl.as_secs_f64(),
            "ZMQ discovery listening"
        );
        Ok(Self {
            registrar,
            local_addr,
            health,
            task,
        })
    }

    /// The registries this listener feeds.
    pub fn registries(&self) -> &Registries {
        self.registrar.registries()
    }

    /// The registrar this listener applies registrations with: the same
    /// registries and address check, for registrations that arrive another
    /// way (an HTTP `POST /register`).
    pub fn registrar(&self) -> &Registrar {
        &self.registrar
    }

    /// Messages refused as malformed so far (both transports).
    pub fn malformed_messages(&self) -> u64 {
        self.registries().malformed_messages()
    }

    /// Registrations refused by the address check so far.
    pub fn refused_addresses(&self) -> u64 {
        self.registries().refused_addresses()
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Whether the receive loop is running now (false between a failure
    /// and its restart).
    pub fn is_receiving(&self) -> bool {
        self.health.receiving.load(Ordering::Acquire)
    }

    /// How many times the receive loop ended (its socket failed, or it
    /// panicked) and was restarted: a counter for `/metrics`.
    pub fn receive_restarts(&self) -> u64 {
        self.health.restarts.load(Ordering::Relaxed)
    }

    /// A handle that reads this listener's counters after it was moved
    /// elsewhere (a host's `/metrics` reads it at each scrape). It keeps
    /// no socket or task alive.
    pub fn counters(&self) -> DiscoveryCounters {
        DiscoveryCounters {
            registries: self.registrar.registries().clone(),
            health: Arc::clone(&self.health),
        }
    }
}

/// What a [`ZmqDiscovery`] listener did so far, readable from any thread
/// ([`ZmqDiscovery::counters`]).
#[derive(Debug, Clone)]
pub struct DiscoveryCounters {
    registries: Registries,
    health: Arc<ReceiveHealth>,
}

impl DiscoveryCounters {
    /// Whether the receive loop is running now.
    pub fn is_receiving(&self) -> bool {
        self.health.receiving.load(Ordering::Acquire)
    }

    /// How many times the receive loop was restarted.
    pub fn receive_restarts(&self) -> u64 {
        self.health.restarts.load(Ordering::Relaxed)
    }

    /// Messages refused as malformed (both transports).
    pub fn malformed_messages(&self) -> u64 {
        self.registries.malformed_messages()
    }

    /// Registrations refused by the address check (both transports).
    pub fn refused_addresses(&self) -> u64 {
        self.registries.refused_addresses()
    }
}

impl Drop for ZmqDiscovery {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Where the loop's messages come from: the ROUTER socket, or a channel in
/// the tests. `None` ends the loop.
trait FrameSource: Send + 'static {
    /// The next multipart message. Must be cancel safe: the loop drops it
    /// when a check finishes first.
    fn next_frames(&mut self) -> impl Future<Output = Option<Result<Vec<Bytes>, String>>> + Send;
}

impl FrameSource for SocketThread {
    // Cancel safe: a tokio channel's `recv`.
    async fn next_frames(&mut self) -> Option<Result<Vec<Bytes>, String>> {
        loop {
            // No monitor on this socket: messages are all that comes.
            if let Incoming::Message(frames) = self.recv().await? {
                return Some(Ok(frames));
            }
        }
    }
}

/// The address to bind for `host`: an IP (IPv6 with or without brackets),
/// `*` for every IPv4 interface, or a name resolved once.
async fn resolve_bind_host(host: &str) -> Option<IpAddr> {
    if host == "*" {
        return Some(IpAddr::from([0, 0, 0, 0]));
    }
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse() {
        return Some(ip);
    }
    let mut addresses = tokio::net::lookup_host((bare, 0)).await.ok()?;
    addresses.next().map(|address| address.ip())
}

/// A hardened ROUTER bound on `address`, read by its own thread, with the
/// address it bound (the port chosen for port 0).
fn open_router(
    address: SocketAddr,
    max_message_size: usize,
) -> Result<(SocketThread, SocketAddr), String> {
    let socket = context().socket(zmq::ROUTER).map_err(|e| e.to_string())?;
    harden(&socket, max_message_size, RECEIVE_HWM).map_err(|e| e.to_string())?;
    socket
        .set_ipv6(address.is_ipv6())
        .map_err(|e| e.to_string())?;
    socket
        .bind(&format!("tcp://{address}"))
        .map_err(|e| e.to_string())?;
    let bound = last_endpoint(&socket)?;
    // libzmq reports `tcp://IP:PORT`: an endpoint whose host is an address.
    let local_addr = bound
        .parse::<kv_events::ZmqEndpoint>()
        .ok()
        .and_then(|endpoint| endpoint.socket_addr())
        .ok_or_else(|| format!("bound an unexpected endpoint {bound}"))?;
    let thread = SocketThread::spawn("discovery-router", socket, None, SOCKET_QUEUE)
        .map_err(|e| e.to_string())?;
    Ok((thread, local_addr))
}

/// Aborts a task when dropped: the supervisor's loop task goes with it.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs the receive loop on `first` (or a source from `open`), and again
/// on a fresh source whenever it ends; see the module docs.
async fn supervise<S: FrameSource>(
    registrar: Registrar,
    max_pending: usize,
    first: Option<S>,
    mut open: impl FnMut() -> Result<S, String> + Send + 'static,
    health: Arc<ReceiveHealth>,
) {
    let (initial, max) = RESTART_BACKOFF;
    let backoff = |in_a_row: u32| {
        initial
            .saturating_mul(1 << in_a_row.saturating_sub(1).min(16))
            .min(max)
    };
    let mut next = first;
    let mut in_a_row = 0u32;
    loop {
        let source = match next.take() {
            Some(source) => source,
            None => match open() {
                Ok(source) => source,
                Err(err) => {
                    in_a_row = in_a_row.saturating_add(1);
                    tracing::error!(error = %err, "cannot reopen the ZMQ discovery socket");
                    tokio::time::sleep(backoff(in_a_row)).await;
                    continue;
                }
            },
        };
        let started = tokio::time::Instant::now();
        health.receiving.store(true, Ordering::Release);
        let mut task = AbortOnDrop(tokio::spawn(
            Intake::new(registrar.clone(), max_pending).run(source),
        ));
        let outcome = (&mut task.0).await;
        health.receiving.store(false, Ordering::Release);
        health.restarts.fetch_add(1, Ordering::Relaxed);
        if started.elapsed() > max.saturating_mul(2) {
            in_a_row = 0;
        }
        in_a_row = in_a_row.saturating_add(1);
        let delay = backoff(in_a_row);
        match outcome {
            Ok(()) => {
                tracing::error!(?delay, "ZMQ discovery receive loop ended; restarting it");
            }
            Err(err) => {
                tracing::error!(error = %err, ?delay, "ZMQ discovery receive loop failed; restarting it");
            }
        }
        tokio::time::sleep(delay).await;
    }
}

/// An engine: the same URL in two roles is two engines.
type EngineKey = (RegisteredRole, WorkerUrl);

/// A finished address check.
struct Checked {
    registration: EngineRegistration,
    verdict: Result<(), AddressRefused>,
}

/// The receive loop's state: the checks in flight and what waits behind
/// them. Owned by the loop task alone, so it needs no lock.
struct Intake {
    registrar: Registrar,
    max_pending: usize,
    checks: JoinSet<Checked>,
    /// The engine each running check is for.
    running: HashMap<Id, EngineKey>,
    /// Engines with a check running, each with the newest message that
    /// arrived meanwhile.
    waiting: HashMap<EngineKey, Option<EngineRegistration>>,
    /// Anyone who reaches the socket can send malformed messages at will:
    /// each is counted (`router_discovery_refused_total`), and one warning
    /// per period says how many came since the last.
    malformed_log: LogThrottle,
}

impl Intake {
    fn new(registrar: Registrar, max_pending: usize) -> Self {
        Self {
            registrar,
            max_pending: max_pending.max(1),
            checks: JoinSet::new(),
            running: HashMap::new(),
            waiting: HashMap::new(),
            malformed_log: LogThrottle::default(),
        }
    }

    /// Receives until the source ends (never, for a socket: the task is
    /// aborted when the listener is dropped).
    async fn run(mut self, mut source: impl FrameSource) {
        loop {
            let may_read = self.checks.len() < self.max_pending;
            tokio::select! {
                // Finished checks first: they free room for reading.
                biased;
                Some(done) = self.checks.join_next_with_id(), if !self.checks.is_empty() => {
                    self.finished(done);
                }
                frames = source.next_frames(), if may_read => match frames {
                    Some(Ok(frames)) => self.offer(&frames),
                    Some(Err(err)) => {
                        // A peer's broken frame: count it and keep serving.
                        self.registrar.registries().count_malformed();
                        if let Some(suppressed) = self.malformed_log.admit() {
                            tracing::warn!(error = %err, suppressed, "ZMQ receive failed");
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    None => break,
                },
            }
        }
    }

    /// One received message: refused at once when malformed, applied at
    /// once when there is no check, otherwise checked beside the loop.
    fn offer(&mut self, frames: &[Bytes]) {
        let registries = self.registrar.registries();
        let registration = match registries
            .decoded(payload_of(frames).and_then(decode_registration))
        {
            Ok(registration) => registration,
            Err(err) => {
                if let Some(suppressed) = self.malformed_log.admit() {
                    tracing::warn!(
                        error = %err,
                        malformed_total = registries.malformed_messages(),
                        suppressed,
                        "ignoring a malformed ZMQ registration (suppressed: malformed messages not logged before it)"
                    );
                }
                return;
            }
        };
        if !self.registrar.has_check() {
            registries.register(&registration, Instant::now());
            return;
        }
        let key = (registration.role, registration.worker_url.clone());
        match self.waiting.get_mut(&key) {
            // Its engine's check is running: wait behind it, newest wins.
            Some(next) => *next = Some(registration),
            None => self.start_check(key, registration),
        }
    }

    fn start_check(&mut self, key: EngineKey, registration: EngineRegistration) {
        let registrar = self.registrar.clone();
        let handle = self.checks.spawn(async move {
            let verdict = registrar.admit(&registration).await;
            Checked {
                registration,
                verdict,
            }
        });
        self.running.insert(handle.id(), key.clone());
        self.waiting.insert(key, None);
    }

    /// A check finished: apply its registration if admitted (the refusal
    /// was counted and logged by the registrar), then start the check of
    /// the message that waited behind it.
    fn finished(&mut self, done: Result<(Id, Checked), JoinError>) {
        let id = match done {
            Ok((id, checked)) => {
                if checked.verdict.is_ok() {
                    self.registrar
                        .registries()
                        .register(&checked.registration, Instant::now());
                }
                id
            }
            Err(err) => {
                // The host's check panicked: refuse, keep serving.
                self.registrar.registries().count_refused();
                tracing::warn!(error = %err, "an address check failed; registration ignored");
                err.id()
            }
        };
        let Some(key) = self.running.remove(&id) else {
            return;
        };
        if let Some(Some(next)) = self.waiting.remove(&key) {
            self.start_check(key, next);
        }
    }
}

/// The frames of a channel: what the tests feed the loop with.
#[cfg(test)]
impl FrameSource for tokio::sync::mpsc::Receiver<Vec<Bytes>> {
    async fn next_frames(&mut self) -> Option<Result<Vec<Bytes>, String>> {
        self.recv().await.map(Ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registrar::CheckFuture;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::sync::{Semaphore, mpsc};

    /// Resolves `slow.example` only when the test adds a permit (or never);
    /// every other host at once. Counts the checks that started.
    struct GatedResolver {
        slow_gate: Semaphore,
        started: AtomicUsize,
    }

    impl AddressCheck for GatedResolver {
        fn check<'a>(&'a self, url: &'a WorkerUrl) -> CheckFuture<'a> {
            self.started.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                if url.host() == "slow.example" {
                    let permit = self.slow_gate.acquire().await;
                    permit
                        .map_err(|_| AddressRefused::new("gate closed"))?
                        .forget();
                }
                Ok(())
            })
        }
    }

    struct Harness {
        resolver: Arc<GatedResolver>,
        registries: Registries,
        send: mpsc::Sender<Vec<Bytes>>,
        _loop: tokio::task::JoinHandle<()>,
    }

    fn harness(max_pending: usize) -> Harness {
        let resolver = Arc::new(GatedResolver {
            slow_gate: Semaphore::new(0),
            started: AtomicUsize::new(0),
        });
        let registrar = Registrar::new(Registries::new(Duration::from_secs(60)))
            .with_check(resolver.clone(), Duration::from_secs(5));
        let registries = registrar.registries().clone();
        let (send, receive) = mpsc::channel(16);
        let task = tokio::spawn(Intake::new(registrar, max_pending).run(receive));
        Harness {
            resolver,
            registries,
            send,
            _loop: task,
        }
    }

    fn message(kind: &str, http: &str, zmq: &str) -> Vec<Bytes> {
        let map = serde_json::json!({"type": kind, "http_address": http, "zmq_address": zmq});
        let payload = rmp_serde::to_vec_named(&map).unwrap();
        vec![Bytes::from_static(b"engine"), Bytes::from(payload)]
    }

    fn urls(registries: &Registries, role: RegisteredRole) -> Vec<String> {
        let snapshot = registries.of(role).snapshot(Instant::now());
        snapshot
            .entries
            .iter()
            .map(|entry| entry.endpoint.to_string())
            .collect()
    }

    /// Lets every ready task run, without moving the paused clock.
    async fn settle() {
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_lookup_never_delays_another_registration() {
        let h = harness(8);
        h.send
            .send(message("P", "slow.example:8100", "10.0.0.1:21001"))
            .await
            .unwrap();
        h.send
            .send(message("P", "10.0.0.2:8100", "10.0.0.2:21001"))
            .await
            .unwrap();
        settle().await;
        // The fast engine is registered while the slow one's lookup has
        // started and is still pending.
        assert_eq!(h.resolver.started.load(Ordering::SeqCst), 2);
        assert_eq!(
            urls(&h.registries, RegisteredRole::Prefill),
            ["http://10.0.0.2:8100"]
        );
        // Its lookup answers: it is registered too.
        h.resolver.slow_gate.add_permits(1);
        settle().await;
        assert_eq!(
            urls(&h.registries, RegisteredRole::Prefill),
            ["http://10.0.0.2:8100", "http://slow.example:8100"]
        );
        assert_eq!(h.registries.refused_addresses(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lookup_that_outlives_the_timeout_is_refused_and_others_go_on() {
        let h = harness(8);
        h.send
            .send(message("D", "slow.example:8200", "10.0.0.1:22001"))
            .await
            .unwrap();
        settle().await;
        tokio::time::advance(Duration::from_secs(4)).await;
        h.send
            .send(message("D", "10.0.0.3:8200", "10.0.0.3:22001"))
            .await
            .unwrap();
        settle().await;
        assert_eq!(
            urls(&h.registries, RegisteredRole::Decode),
            ["http://10.0.0.3:8200"]
        );
        assert_eq!(h.registries.refused_addresses(), 0, "still within 5 s");
        tokio::time::advance(Duration::from_secs(2)).await;
        settle().await;
        assert_eq!(h.registries.refused_addresses(), 1);
        assert_eq!(
            urls(&h.registries, RegisteredRole::Decode),
            ["http://10.0.0.3:8200"]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn one_engine_is_checked_once_at_a_time_and_its_newest_message_wins() {
        let h = harness(8);
        // Three messages while its first lookup is pending: the restart's
        // new KV address (the last one) is what stays.
        for zmq in ["10.0.0.1:1", "10.0.0.1:2", "10.0.0.1:3"] {
            h.send
                .send(message("P", "slow.example:8100", zmq))
                .await
                .unwrap();
        }
        settle().await;
        assert_eq!(h.resolver.started.load(Ordering::SeqCst), 1);
        h.resolver.slow_gate.add_permits(2);
        settle().await;
        assert_eq!(
            h.resolver.started.load(Ordering::SeqCst),
            2,
            "the second message was dropped for the third"
        );
        let snapshot = h.registries.prefill.snapshot(Instant::now());
        assert_eq!(snapshot.entries.len(), 1);
        assert_eq!(
            snapshot.entries[0]
                .registration
                .labels
                .get(worker_lifecycle::labels::KV_ADDR)
                .map(String::as_str),
            Some("10.0.0.1:3")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_set_of_checks_stops_reading_until_one_finishes() {
        let h = harness(1);
        h.send
            .send(message("P", "slow.example:8100", "10.0.0.1:1"))
            .await
            .unwrap();
        h.send
            .send(message("D", "10.0.0.5:8200", "10.0.0.5:1"))
            .await
            .unwrap();
        settle().await;
        assert_eq!(h.resolver.started.load(Ordering::SeqCst), 1);
        assert!(h.registries.decode.is_empty(), "not read yet");
        h.resolver.slow_gate.add_permits(1);
        settle().await;
        assert_eq!(h.resolver.started.load(Ordering::SeqCst), 2);
        assert_eq!(h.registries.prefill.len(), 1);
        assert_eq!(h.registries.decode.len(), 1);
    }

    /// A channel that panics on a message whose first frame is `panic`.
    struct CrashingSource(mpsc::Receiver<Vec<Bytes>>);

    impl FrameSource for CrashingSource {
        async fn next_frames(&mut self) -> Option<Result<Vec<Bytes>, String>> {
            let frames = self.0.recv().await?;
            assert_ne!(frames[0].as_ref(), b"panic", "the source broke");
            Some(Ok(frames))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_loop_that_ends_or_panics_is_restarted_counted_and_reported_down() {
        let registrar = Registrar::new(Registries::new(Duration::from_secs(60)));
        let registries = registrar.registries().clone();
        let health = Arc::new(ReceiveHealth::default());
        let mut senders = Vec::new();
        let mut sources = std::collections::VecDeque::new();
        for _ in 0..3 {
            let (send, receive) = mpsc::channel(4);
            senders.push(send);
            sources.push_back(CrashingSource(receive));
        }
        let first = sources.pop_front();
        let opened = Arc::new(AtomicUsize::new(0));
        let opens = Arc::clone(&opened);
        let open = move || {
            opens.fetch_add(1, Ordering::SeqCst);
            sources
                .pop_front()
                .ok_or_else(|| "no more sources".to_owned())
        };
        let _supervisor = AbortOnDrop(tokio::spawn(supervise(
            registrar,
            4,
            first,
            open,
            Arc::clone(&health),
        )));
        settle().await;
        assert!(health.receiving.load(Ordering::SeqCst));
        senders[0]
            .send(message("P", "10.0.0.1:8100", "10.0.0.1:1"))
            .await
            .unwrap();
        settle().await;
        assert_eq!(registries.prefill.len(), 1);
        // The socket's thread ends: the loop stops, is counted, and is down
        // until the backoff step has passed.
        drop(senders.remove(0));
        settle().await;
        assert!(!health.receiving.load(Ordering::SeqCst));
        assert_eq!(health.restarts.load(Ordering::SeqCst), 1);
        assert_eq!(opened.load(Ordering::SeqCst), 0);
        tokio::time::advance(Duration::from_millis(100)).await;
        settle().await;
        assert!(health.receiving.load(Ordering::SeqCst));
        assert_eq!(opened.load(Ordering::SeqCst), 1);
        // A panic in the loop: the same, one backoff step longer.
        senders[0]
            .send(vec![Bytes::from_static(b"panic")])
            .await
            .unwrap();
        settle().await;
        assert!(!health.receiving.load(Ordering::SeqCst));
        assert_eq!(health.restarts.load(Ordering::SeqCst), 2);
        tokio::time::advance(Duration::from_millis(150)).await;
        settle().await;
        assert!(!health.receiving.load(Ordering::SeqCst), "backoff doubled");
        tokio::time::advance(Duration::from_millis(50)).await;
        settle().await;
        assert!(health.receiving.load(Ordering::SeqCst));
        // The fresh loop registers again; the registries kept the entry.
        senders[1]
            .send(message("D", "10.0.0.2:8200", "10.0.0.2:1"))
            .await
            .unwrap();
        settle().await;
        assert_eq!(registries.decode.len(), 1);
        assert_eq!(registries.prefill.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_check_messages_are_applied_in_the_loop() {
        let registrar = Registrar::new(Registries::new(Duration::from_secs(60)));
        let registries = registrar.registries().clone();
        let (send, receive) = mpsc::channel(4);
        let task = tokio::spawn(Intake::new(registrar, 4).run(receive));
        send.send(message("D", "10.0.0.6:8200", "10.0.0.6:1"))
            .await
            .unwrap();
        send.send(vec![Bytes::from_static(b"engine")])
            .await
            .unwrap();
        drop(send);
        task.await.unwrap();
        assert_eq!(registries.decode.len(), 1);
        assert_eq!(registries.malformed_messages(), 1);
    }

    /// What a `tracing` subscriber writes, kept for the test to read.
    #[derive(Clone, Default)]
    struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_flood_of_malformed_messages_is_counted_each_and_logged_at_a_bounded_rate() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);
        let started = std::time::Instant::now();
        let registrar = Registrar::new(Registries::new(Duration::from_secs(60)));
        let registries = registrar.registries().clone();
        let (send, receive) = mpsc::channel(16);
        let task = tokio::spawn(Intake::new(registrar, 8).run(receive));
        const FLOOD: u64 = 2_000;
        for i in 0..FLOOD {
            let garbage = Bytes::from(vec![(i % 251) as u8; (i % 7) as usize]);
            send.send(vec![Bytes::from_static(b"peer"), garbage])
                .await
                .unwrap();
        }
        drop(send);
        task.await.unwrap();
        let elapsed = started.elapsed();
        // Every message is counted...
        assert_eq!(registries.malformed_messages(), FLOOD);
        // ...but one warning per period went out, not one per message.
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let lines = text
            .lines()
            .filter(|line| line.contains("ignoring a malformed ZMQ registration"))
            .count() as u64;
        let periods = elapsed.as_secs() / kv_events::DEFAULT_LOG_PERIOD.as_secs() + 1;
        assert!(lines >= 1, "the first malformed message is logged:\n{text}");
        assert!(
            lines <= periods,
            "{lines} warnings for {FLOOD} messages in {elapsed:?}:\n{text}"
        );
    }
}
