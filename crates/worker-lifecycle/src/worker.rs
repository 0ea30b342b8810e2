//! The worker: one persistent scheduling identity per registration lifetime.
//!
//! A [`Worker`] is created once per (role, endpoint, generation) and shared
//! as `Arc<Worker>` by every routing decision for that lifetime, so its
//! load, processed count, health and breaker state are the live ones. A new
//! registration lifetime gets a new `Worker` with fresh state; requests
//! still holding the old one finish against the old one.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use crate::breaker::{Admission, CircuitBreaker, CircuitBreakerConfig, Rejected, TransitionHook};
use crate::clock::{Clock, SystemClock};
use crate::engine_load::EngineLoad;
use crate::guard::LoadGuard;
use crate::sync::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use crate::url::{WorkerUrl, WorkerUrlError};

/// What a worker does in the serving topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkerRole {
    /// Serves whole requests (no disaggregation).
    Regular,
    /// Prefill side of a prefill/decode pair.
    Prefill {
        /// Port of the KV bootstrap server, for connectors that need one.
        bootstrap_port: Option<u16>,
    },
    /// Decode side of a prefill/decode pair.
    Decode,
}

impl WorkerRole {
    /// The role without its parameters.
    pub fn kind(self) -> RoleKind {
        match self {
            Self::Regular => RoleKind::Regular,
            Self::Prefill { .. } => RoleKind::Prefill,
            Self::Decode => RoleKind::Decode,
        }
    }
}

/// A role without parameters: what registries and pools are partitioned by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RoleKind {
    /// Regular workers.
    Regular,
    /// Prefill workers.
    Prefill,
    /// Decode workers.
    Decode,
}

impl RoleKind {
    /// Lower-case name: `regular`, `prefill` or `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Regular => "regular",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

impl fmt::Display for RoleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a worker listens: its base URL and, for data-parallel engines,
/// the rank addressed through that URL.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    url: WorkerUrl,
    dp_rank: Option<u32>,
}

impl Endpoint {
    /// Parses `url` into its canonical spelling ([`WorkerUrl`]), so that
    /// every way of writing one address is one endpoint:
    /// `HTTP://LOCALHOST:8000/`, `http://127.1:8000` and
    /// `http://[::ffff:127.0.0.1]:8000` are all `http://127.0.0.1:8000`.
    pub fn new(url: &str, dp_rank: Option<u32>) -> Result<Self, WorkerUrlError> {
        Ok(Self::from_url(WorkerUrl::parse(url)?, dp_rank))
    }

    /// An endpoint at an already parsed URL.
    pub fn from_url(url: WorkerUrl, dp_rank: Option<u32>) -> Self {
        Self { url, dp_rank }
    }

    /// The base URL, canonical.
    pub fn url(&self) -> &str {
        self.url.as_str()
    }

    /// The base URL as parsed.
    pub fn worker_url(&self) -> &WorkerUrl {
        &self.url
    }

    /// The data-parallel rank, if any.
    pub fn dp_rank(&self) -> Option<u32> {
        self.dp_rank
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dp_rank {
            Some(rank) => write!(f, "{}@{}", self.url, rank),
            None => f.write_str(self.url.as_str()),
        }
    }
}

/// The identity of a worker apart from its generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    /// Role (with the prefill bootstrap port).
    pub role: WorkerRole,
    /// Where it listens.
    pub endpoint: Endpoint,
    /// The model it serves, if known.
    pub model_id: Option<String>,
    /// Free-form labels (zone, hardware, version).
    pub labels: BTreeMap<String, String>,
}

impl WorkerSpec {
    /// A spec with no model id and no labels.
    pub fn new(role: WorkerRole, endpoint: Endpoint) -> Self {
        Self {
            role,
            endpoint,
            model_id: None,
            labels: BTreeMap::new(),
        }
    }

    /// Sets the model id.
    pub fn with_model(mut self, model_id: impl Into<String>) -> Self {
        self.model_id = Some(model_id.into());
        self
    }

    /// Adds a label.
    pub fn with_label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }
}

/// Where a worker is in its life. States only move forward:
/// pending → ready → draining → removed (any state may go straight to
/// removed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lifecycle {
    /// Known but not yet taking traffic.
    Pending,
    /// Taking traffic.
    Ready,
    /// Finishing its in-flight work; never selected for new work.
    Draining,
    /// Gone from its pool or set; in-flight guards may still finish on it.
    Removed,
}

impl Lifecycle {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Pending,
            1 => Self::Ready,
            2 => Self::Draining,
            _ => Self::Removed,
        }
    }

    fn as_u8(self) -> u8 {
        match self {
            Self::Pending => 0,
            Self::Ready => 1,
            Self::Draining => 2,
            Self::Removed => 3,
        }
    }
}

/// What runs alongside each worker: its breaker settings, the clock used by
/// the time-free convenience methods, and an optional breaker hook.
#[derive(Clone)]
pub struct WorkerOptions {
    /// Breaker settings for every worker built with these options.
    pub breaker: CircuitBreakerConfig,
    /// The clock behind [`Worker::is_available`] and [`Worker::try_reserve`].
    pub clock: Arc<dyn Clock>,
    /// Told about every breaker transition with the worker's key.
    pub breaker_hook: Option<TransitionHook>,
    /// The state a new worker starts in (`Ready` by default, so that a
    /// freshly discovered fleet is routable from the first request).
    pub initial_lifecycle: Lifecycle,
    /// How much of a pool failures may take away (used by the pools these
    /// options build workers for).
    pub fleet: FleetGuard,
}

/// How much of a pool its failing workers may take away, so that a
/// fleet-wide failure does not become a total outage.
///
/// - **Breaker cap.** Open breakers may exclude at most
///   `max_breaker_exclusion` of a pool's live (ready) workers; beyond that,
///   the pool lets the excess through (those whose breaker opened last
///   stay excluded), like Envoy's `max_ejection_percent` for outlier
///   detection.
/// - **Panic threshold.** When fewer than `panic_threshold` of the live
///   workers are available (healthy and admitted by their breaker), the
///   pool sees every live worker again, like Envoy's panic threshold:
///   their own answers beat a blanket 503 from the router.
///
/// - **Small pools.** Both act only in a pool of at least `min_workers`
///   live workers. In a smaller pool every exclusion is trusted, as
///   vllm-router trusts it: a single failing engine opens its breaker and
///   clients get a fast 503 instead of every request waiting on an engine
///   that fails it. A pool of one has no other worker to protect, and in a
///   pool of two the cap could only ever keep one failing engine in
///   service, which is what the breaker exists to prevent.
///
/// Defaults: cap 0.8, panic below 0.2, from 3 live workers up — a pool of 4
/// whose 3 workers fail keeps serving from the healthy one, a pool of 1 or
/// 2 whose workers all fail answers 503 fast (Envoy's defaults, 10 % and
/// 50 %, suit large fleets of interchangeable hosts; an LLM fleet is a
/// handful of engines). `FleetGuard::off()` trusts every exclusion.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FleetGuard {
    /// Largest share (0..=1) of live workers open breakers may exclude.
    pub max_breaker_exclusion: f64,
    /// Below this share (0..=1) of available live workers, every live
    /// worker is seen.
    pub panic_threshold: f64,
    /// The smallest number of live workers at which the cap and the panic
    /// threshold act; below it every exclusion is trusted.
    pub min_workers: usize,
}

/// The default of [`FleetGuard::min_workers`].
pub const DEFAULT_FLEET_GUARD_MIN_WORKERS: usize = 3;

impl Default for FleetGuard {
    fn default() -> Self {
        Self {
            max_breaker_exclusion: 0.8,
            panic_threshold: 0.2,
            min_workers: DEFAULT_FLEET_GUARD_MIN_WORKERS,
        }
    }
}

impl FleetGuard {
    /// No cap and no panic mode: every exclusion is trusted.
    pub fn off() -> Self {
        Self {
            max_breaker_exclusion: 1.0,
            panic_threshold: 0.0,
            min_workers: DEFAULT_FLEET_GUARD_MIN_WORKERS,
        }
    }

    /// Whether the guard acts in a pool of `live` live workers.
    pub fn acts_on(&self, live: usize) -> bool {
        live > 0 && live >= self.min_workers
    }
}

impl fmt::Debug for WorkerOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerOptions")
            .field("breaker", &self.breaker)
            .field("clock", &self.clock)
            .field("breaker_hook", &self.breaker_hook.is_some())
            .field("initial_lifecycle", &self.initial_lifecycle)
            .field("fleet", &self.fleet)
            .finish()
    }
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self {
            breaker: CircuitBreakerConfig::default(),
            clock: Arc::new(SystemClock),
            breaker_hook: None,
            initial_lifecycle: Lifecycle::Ready,
            fleet: FleetGuard::default(),
        }
    }
}

/// Why [`Worker::try_reserve`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unavailable {
    /// The worker is pending, draining or removed.
    #[error("worker is {0:?}, not ready")]
    NotReady(Lifecycle),
    /// The last health checks failed.
    #[error("worker is unhealthy")]
    Unhealthy,
    /// The circuit breaker refused.
    #[error(transparent)]
    Breaker(#[from] Rejected),
}

/// A health change reported by [`Worker::record_probe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthChange {
    /// The worker became healthy.
    BecameHealthy,
    /// The worker became unhealthy.
    BecameUnhealthy,
}

/// An inference worker for one registration lifetime.
///
/// Identity (role, endpoint, generation, model, labels) is immutable;
/// runtime state is atomic. Share it as `Arc<Worker>`.
///
/// Load changes only through [`LoadGuard`]s: there is deliberately no way to
/// set or reset it, so nothing (a health check, a recovery, an operator) can
/// erase the count of requests that are really in flight. A worker whose
/// process restarted gets a new `Worker` (new generation) instead.
///
/// For a load-balancing policy the useful accessors are [`key`](Self::key),
/// [`load`](Self::load), [`processed`](Self::processed) and
/// [`is_available`](Self::is_available); all are cheap.
pub struct Worker {
    spec: WorkerSpec,
    generation: u64,
    key: Box<str>,
    load: AtomicUsize,
    processed: AtomicU64,
    underflows: AtomicU64,
    healthy: AtomicBool,
    /// Let through by its pool although unhealthy or refused by its breaker
    /// (the pool's failure cap or panic mode; see `RolePool`).
    pool_admitted: AtomicBool,
    health_ok_streak: AtomicU32,
    health_fail_streak: AtomicU32,
    lifecycle: AtomicU8,
    breaker: CircuitBreaker,
    clock: Arc<dyn Clock>,
    idle_watchers: AtomicUsize,
    /// What the engine last reported about its load (load polling).
    engine_load: EngineLoad,
    #[cfg(not(loom))]
    idle: tokio::sync::Notify,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("key", &self.key)
            .field("load", &self.load())
            .field("processed", &self.processed())
            .field("healthy", &self.is_healthy())
            .field("lifecycle", &self.lifecycle())
            .field("breaker", &self.breaker.state())
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// A worker for registration `generation` of `spec`.
    pub fn new(spec: WorkerSpec, generation: u64, options: &WorkerOptions) -> Arc<Self> {
        let key = Self::make_key(&spec, generation);
        let breaker =
            CircuitBreaker::with_hook(&key, options.breaker.clone(), options.breaker_hook.clone());
        Arc::new(Self {
            spec,
            generation,
            key: key.into_boxed_str(),
            load: AtomicUsize::new(0),
            processed: AtomicU64::new(0),
            underflows: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            pool_admitted: AtomicBool::new(false),
            health_ok_streak: AtomicU32::new(0),
            health_fail_streak: AtomicU32::new(0),
            lifecycle: AtomicU8::new(options.initial_lifecycle.as_u8()),
            breaker,
            clock: options.clock.clone(),
            idle_watchers: AtomicUsize::new(0),
            engine_load: EngineLoad::new(),
            #[cfg(not(loom))]
            idle: tokio::sync::Notify::new(),
        })
    }

    fn make_key(spec: &WorkerSpec, generation: u64) -> String {
        use fmt::Write;
        let mut key = String::with_capacity(spec.endpoint.url().len() + 24);
        let _ = write!(key, "{}:{}#{}", spec.role.kind(), spec.endpoint, generation);
        key
    }

    /// A stable key for this worker lifetime, unique across roles, ranks and
    /// generations: `role:url[@rank]#generation`, for example
    /// `prefill:http://10.0.0.1:8000@1#7`. Policies can key their state on it.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Everything that identifies the worker apart from its generation.
    pub fn spec(&self) -> &WorkerSpec {
        &self.spec
    }

    /// The role.
    pub fn role(&self) -> WorkerRole {
        self.spec.role
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.spec.endpoint
    }

    /// The base URL.
    pub fn url(&self) -> &str {
        self.spec.endpoint.url()
    }

    /// The data-parallel rank, if any.
    pub fn dp_rank(&self) -> Option<u32> {
        self.spec.endpoint.dp_rank
    }

    /// The model id, if known.
    pub fn model_id(&self) -> Option<&str> {
        self.spec.model_id.as_deref()
    }

    /// The labels.
    pub fn labels(&self) -> &BTreeMap<String, String> {
        &self.spec.labels
    }

    /// The registration generation this worker object belongs to.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Requests currently reserved on this worker (live [`LoadGuard`]s):
    /// this router's own in-flight requests, exact.
    pub fn load(&self) -> usize {
        self.load.load(Ordering::Acquire)
    }

    /// The best estimate of the engine's whole in-flight load: this
    /// router's own requests now, plus the other routers' as of the
    /// engine's last report (its load minus what this router had in
    /// flight when it asked). Without a report, [`load`](Self::load).
    /// This is what policies compare (the `Backend::load` of a worker);
    /// guards count and release [`load`](Self::load) only.
    ///
    /// ```
    /// use worker_lifecycle::{Endpoint, Worker, WorkerOptions, WorkerRole, WorkerSpec};
    ///
    /// let spec = WorkerSpec::new(WorkerRole::Regular, Endpoint::new("http://e:8000", None).unwrap());
    /// let worker = Worker::new(spec, 1, &WorkerOptions::default());
    /// let mine = worker.try_reserve().unwrap();
    /// // Polled now: the engine runs 5, one of them ours.
    /// worker.record_engine_load(5, worker.load());
    /// assert_eq!(worker.estimated_load(), 5);
    /// // Two more sent before the next report count at once.
    /// let more = [worker.try_reserve().unwrap(), worker.try_reserve().unwrap()];
    /// assert_eq!(worker.estimated_load(), 7);
    /// drop((mine, more));
    /// assert_eq!((worker.load(), worker.estimated_load()), (0, 4));
    /// ```
    pub fn estimated_load(&self) -> usize {
        self.load().saturating_add(self.engine_load.others())
    }

    /// Records the engine's own count of its in-flight requests (running
    /// plus waiting, as vLLM's gauges give them) from a poll sent while
    /// this router had `own_at_poll` requests in flight on it (read
    /// [`load`](Self::load) just before sending the poll). Counts above
    /// `u32::MAX` are clamped. Changes [`estimated_load`] only.
    ///
    /// [`estimated_load`]: Self::estimated_load
    pub fn record_engine_load(&self, engine_in_flight: usize, own_at_poll: usize) {
        self.engine_load.record(engine_in_flight, own_at_poll);
    }

    /// Records the engine's KV-cache usage from a poll: the fraction of
    /// its cache held by the requests it runs (vLLM's
    /// `vllm:kv_cache_usage_perc`), clamped to `[0, 1]`; NaN withdraws it.
    /// Policies read it as `Backend::cache_usage`; it is withdrawn with
    /// the load report ([`clear_engine_load`](Self::clear_engine_load)).
    ///
    /// ```
    /// use worker_lifecycle::{Endpoint, Worker, WorkerOptions, WorkerRole, WorkerSpec};
    ///
    /// let spec = WorkerSpec::new(WorkerRole::Regular, Endpoint::new("http://e:8000", None).unwrap());
    /// let worker = Worker::new(spec, 1, &WorkerOptions::default());
    /// assert_eq!(worker.engine_cache_usage(), None);
    /// worker.record_engine_cache_usage(0.93);
    /// assert_eq!(worker.engine_cache_usage(), Some(0.93));
    /// worker.record_engine_cache_usage(1.7); // clamped
    /// assert_eq!(worker.engine_cache_usage(), Some(1.0));
    /// worker.clear_engine_load(); // withdrawn with the load report
    /// assert_eq!(worker.engine_cache_usage(), None);
    /// ```
    pub fn record_engine_cache_usage(&self, usage: f64) {
        self.engine_load.record_cache_usage(usage);
    }

    /// The engine's KV-cache usage in the last report that stands, if any.
    pub fn engine_cache_usage(&self) -> Option<f64> {
        self.engine_load.cache_usage()
    }

    /// Records how many of the engine's in-flight requests are waiting,
    /// admitted but not yet scheduled (vLLM's `vllm:num_requests_waiting`,
    /// from the same poll as [`record_engine_load`](Self::record_engine_load),
    /// whose count includes them; `None` (a reply without the figure)
    /// withdraws it. Counts above `u32::MAX` are clamped. Policies read it
    /// as `Backend::waiting`; it is withdrawn with the load report
    /// ([`clear_engine_load`](Self::clear_engine_load)). It changes no
    /// load count: [`estimated_load`](Self::estimated_load) already holds
    /// these requests.
    ///
    /// ```
    /// use worker_lifecycle::{Endpoint, Worker, WorkerOptions, WorkerRole, WorkerSpec};
    ///
    /// let spec = WorkerSpec::new(WorkerRole::Regular, Endpoint::new("http://e:8000", None).unwrap());
    /// let worker = Worker::new(spec, 1, &WorkerOptions::default());
    /// assert_eq!(worker.engine_waiting(), None);
    /// // Polled: 5 in flight, 2 of them queued.
    /// worker.record_engine_load(5, worker.load());
    /// worker.record_engine_waiting(Some(2));
    /// assert_eq!((worker.estimated_load(), worker.engine_waiting()), (5, Some(2)));
    /// worker.clear_engine_load(); // withdrawn with the load report
    /// assert_eq!(worker.engine_waiting(), None);
    /// ```
    pub fn record_engine_waiting(&self, waiting: Option<usize>) {
        self.engine_load.record_waiting(waiting);
    }

    /// The engine's waiting requests in the last report that stands, if
    /// any.
    pub fn engine_waiting(&self) -> Option<usize> {
        self.engine_load.waiting()
    }

    /// Withdraws the last engine report: the estimate is this router's
    /// own count again (the engine stopped answering its load polls, or
    /// answered something unusable).
    pub fn clear_engine_load(&self) {
        self.engine_load.clear();
    }

    /// The engine's in-flight count in the last report that stands, if
    /// any (the admin view).
    pub fn engine_reported_load(&self) -> Option<usize> {
        self.engine_load.reported()
    }

    /// Requests finished on this worker: every released reservation counts
    /// once, whatever its outcome (success, error, cancellation), because
    /// fair tie-breaking wants "how much work did this worker take", not
    /// "how much succeeded".
    pub fn processed(&self) -> u64 {
        self.processed.load(Ordering::Relaxed)
    }

    /// Times a load decrement would have gone below zero and was clamped.
    /// Guards make this impossible; it stays 0 unless there is a bug, and
    /// tests assert so.
    pub fn underflows(&self) -> u64 {
        self.underflows.load(Ordering::Relaxed)
    }

    /// Whether the health checker currently considers the worker healthy
    /// (workers start healthy).
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// The lifecycle state.
    pub fn lifecycle(&self) -> Lifecycle {
        Lifecycle::from_u8(self.lifecycle.load(Ordering::Acquire))
    }

    /// The circuit breaker.
    pub fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }

    /// Whether a policy may select this worker now: ready, healthy, and its
    /// breaker would admit a request. Cheap: atomics only, unless the
    /// breaker is open or half-open.
    pub fn is_available(&self) -> bool {
        self.lifecycle() == Lifecycle::Ready
            && (self.is_pool_admitted() || (self.is_healthy() && self.breaker_admits()))
    }

    /// Whether its breaker would admit a request now (closed, or a probe
    /// slot free).
    pub fn breaker_admits(&self) -> bool {
        self.breaker.state() == crate::BreakerState::Closed
            || self.breaker.would_admit(self.clock.now())
    }

    /// Whether its pool lets it through although it is unhealthy or its
    /// breaker refuses: the pool's cap on breaker exclusions, or its panic
    /// mode (see `RolePool`, feature `lb-policies`).
    pub fn is_pool_admitted(&self) -> bool {
        self.pool_admitted.load(Ordering::Acquire)
    }

    /// Sets [`is_pool_admitted`](Self::is_pool_admitted); the pool's
    /// business, called in its serialized step.
    pub fn set_pool_admitted(&self, admitted: bool) {
        self.pool_admitted.store(admitted, Ordering::Release);
    }

    /// Reserves one request on this worker unconditionally (load + 1) and
    /// returns the owning guard. Use it when the caller has already chosen
    /// this worker; [`try_reserve`](Self::try_reserve) also asks the breaker.
    pub fn reserve(self: &Arc<Self>) -> LoadGuard {
        self.load.fetch_add(1, Ordering::AcqRel);
        LoadGuard::new(self.clone(), Admission::unprobed())
    }

    /// Reserves one request if the worker is available now: ready, healthy
    /// and admitted by its breaker (which, half-open, hands out one of its
    /// probe slots; the guard returns the slot when it is dropped without an
    /// outcome).
    pub fn try_reserve(self: &Arc<Self>) -> Result<LoadGuard, Unavailable> {
        self.try_reserve_at(self.clock.now())
    }

    /// [`try_reserve`](Self::try_reserve) at an explicit time.
    pub fn try_reserve_at(self: &Arc<Self>, now: Instant) -> Result<LoadGuard, Unavailable> {
        let lifecycle = self.lifecycle();
        if lifecycle != Lifecycle::Ready {
            return Err(Unavailable::NotReady(lifecycle));
        }
        let admission = if self.is_pool_admitted() {
            // Let through by the pool: the breaker's admission when it
            // gives one (a half-open probe), otherwise none.
            self.breaker
                .try_acquire(now)
                .unwrap_or_else(|_| Admission::unprobed())
        } else {
            if !self.is_healthy() {
                return Err(Unavailable::Unhealthy);
            }
            self.breaker.try_acquire(now)?
        };
        self.load.fetch_add(1, Ordering::AcqRel);
        Ok(LoadGuard::new(self.clone(), admission))
    }

    /// The clock this worker was built with.
    pub fn clock(&self) -> &dyn Clock {
        &*self.clock
    }

    /// Called exactly once per reservation, by the guard.
    pub(crate) fn release_one(&self) {
        let previous = self
            .load
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| l.checked_sub(1));
        match previous {
            Ok(1) => self.wake_idle_watchers(),
            Ok(_) => {}
            Err(_) => {
                self.underflows.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(worker = %self.key, "load decrement below zero clamped");
            }
        }
        self.processed.fetch_add(1, Ordering::Relaxed);
    }

    fn wake_idle_watchers(&self) {
        // SeqCst pairs with the watcher's SeqCst increment and load check in
        // `wait_idle`: either the watcher sees load 0, or we see the watcher.
        if self.idle_watchers.load(Ordering::SeqCst) > 0 {
            #[cfg(not(loom))]
            self.idle.notify_waiters();
        }
    }

    /// Marks the worker ready (from pending). Returns false if it was not
    /// pending.
    pub fn mark_ready(&self) -> bool {
        self.transition(Lifecycle::Pending, Lifecycle::Ready)
    }

    /// Starts draining: the worker takes no new work. Returns false if it was
    /// already draining or removed.
    pub fn start_drain(&self) -> bool {
        self.transition(Lifecycle::Ready, Lifecycle::Draining)
            || self.transition(Lifecycle::Pending, Lifecycle::Draining)
    }

    /// Marks the worker removed. In-flight guards stay valid and finish on
    /// this object. Returns false if it was already removed.
    pub fn mark_removed(&self) -> bool {
        self.lifecycle
            .swap(Lifecycle::Removed.as_u8(), Ordering::AcqRel)
            != Lifecycle::Removed.as_u8()
    }

    fn transition(&self, from: Lifecycle, to: Lifecycle) -> bool {
        self.lifecycle
            .compare_exchange(
                from.as_u8(),
                to.as_u8(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// Feeds one health-probe result through the consecutive-count
    /// hysteresis: `failure_threshold` failures in a row make a healthy
    /// worker unhealthy, `success_threshold` successes in a row make an
    /// unhealthy one healthy. Never touches load. Meant for one writer (the
    /// health checker).
    pub fn record_probe(
        &self,
        ok: bool,
        failure_threshold: u32,
        success_threshold: u32,
    ) -> Option<HealthChange> {
        if ok {
            self.health_fail_streak.store(0, Ordering::Relaxed);
            let streak = self.health_ok_streak.fetch_add(1, Ordering::Relaxed) + 1;
            if !self.is_healthy() && streak >= success_threshold.max(1) {
                self.healthy.store(true, Ordering::Release);
                return Some(HealthChange::BecameHealthy);
            }
        } else {
            self.health_ok_streak.store(0, Ordering::Relaxed);
            let streak = self.health_fail_streak.fetch_add(1, Ordering::Relaxed) + 1;
            if self.is_healthy() && streak >= failure_threshold.max(1) {
                self.healthy.store(false, Ordering::Release);
                return Some(HealthChange::BecameUnhealthy);
            }
        }
        None
    }

    /// Waits until the load is 0 or `deadline` passes, whichever is first.
    /// Returns the load left (0 when the worker went idle). Cancel-safe.
    #[cfg(not(loom))]
    pub async fn wait_idle(&self, deadline: tokio::time::Instant) -> usize {
        struct Watching<'a>(&'a AtomicUsize);
        impl Drop for Watching<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.idle_watchers.fetch_add(1, Ordering::SeqCst);
        let _watching = Watching(&self.idle_watchers);
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.load.load(Ordering::SeqCst) == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.load();
            }
        }
    }
}
