//! A sans-IO circuit breaker: closed → open → half-open → closed.
//!
//! # States
//!
//! - **Closed**: every request is admitted. Worker failures (see
//!   [`Outcome::class`]) are counted; the breaker opens after
//!   [`failure_threshold`](CircuitBreakerConfig::failure_threshold)
//!   consecutive failures, or — if a [`FailureRateWindow`] is configured —
//!   when the failure rate over that sliding window reaches its threshold
//!   with at least `min_requests` outcomes in the window.
//! - **Open**: nothing is admitted until the open timeout has passed. The
//!   timeout grows exponentially with every opening that follows without a
//!   full close in between (`open_timeout × multiplier^(n-1)`, capped at
//!   `max_open_timeout`), then has jitter taken off so that a fleet of routers
//!   does not probe a recovering worker in lock step.
//! - **Half-open**: exactly
//!   [`half_open_probes`](CircuitBreakerConfig::half_open_probes) requests
//!   are admitted at a time, each holding a probe [`Admission`]; concurrent
//!   callers beyond that are refused. A probe failure reopens the breaker; after
//!   [`success_threshold`](CircuitBreakerConfig::success_threshold) probe
//!   successes it closes and the backoff resets. A probe whose outcome is
//!   neutral (client error, cancellation, the router's own rejection) or
//!   abandoned gives its slot back without counting.
//!
//! Time is always an argument: the breaker never reads a clock, so a test
//! can assert a timeline to the nanosecond.
//!
//! # Defaults, and why
//!
//! | setting | here | Envoy outlier detection | Linkerd failure accrual | vllm-router (command-line defaults of its sglang-derived breaker) |
//! |---|---|---|---|---|
//! | consecutive failures to open | 5 | 5 (`consecutive_5xx`) | 7 | 10 |
//! | open timeout | 5 s, ×2 per reopening, cap 60 s, up to 20 % jitter | 30 s × number of ejections, cap 300 s | exponential backoff 1 s … 60 s with jitter | 60 s, fixed |
//! | half-open probes | 1 at a time | n/a (host returns after the ejection time) | 1 probe | every request is let through |
//! | successes to close | 2 | n/a | 1 | 3 |
//! | failure-rate window | off by default; when set it is used | separate `failure_percentage` detector | n/a | 120 s `window_duration`, stored but never read |
//!
//! An LLM worker that fails five requests in a row is very likely down or
//! restarting, and a restart takes tens of seconds (model load), so the first
//! open period is short enough to notice a fast recovery and grows towards a
//! minute for a worker that stays down. One probe at a time protects a
//! worker that is still loading; two successes avoid closing on one lucky
//! probe. The window is off by default because a single router's traffic to
//! one worker is often too thin for a rate to mean much; enable it for busy
//! fleets.

use std::fmt;
use std::sync::Arc as StdArc;
use std::time::{Duration, Instant};

use crate::outcome::{Outcome, OutcomeClass};
use crate::rng::{RandomSource, SplitMix64};
use crate::sync::{AtomicU8, AtomicU32, AtomicU64, Mutex, Ordering};

/// A failure-rate trigger over a sliding time window.
#[derive(Debug, Clone, PartialEq)]
pub struct FailureRateWindow {
    /// Length of the sliding window.
    pub window: Duration,
    /// How many buckets the window is divided into (the window slides one
    /// bucket at a time). At least 1.
    pub buckets: u32,
    /// Fewest outcomes in the window before the rate is trusted.
    pub min_requests: u32,
    /// Failure fraction in `(0, 1]` at which the breaker opens.
    pub failure_rate: f64,
}

impl Default for FailureRateWindow {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(30),
            buckets: 10,
            min_requests: 20,
            failure_rate: 0.5,
        }
    }
}

/// Circuit breaker settings. See the module docs for the defaults and why.
#[derive(Debug, Clone, PartialEq)]
pub struct CircuitBreakerConfig {
    /// Whether the breaker does anything; a disabled breaker admits all
    /// requests and ignores outcomes.
    pub enabled: bool,
    /// Consecutive worker failures that open a closed breaker. At least 1.
    pub failure_threshold: u32,
    /// Optional failure-rate trigger, checked in addition to the
    /// consecutive-failure count.
    pub failure_rate: Option<FailureRateWindow>,
    /// Open timeout after the first opening.
    pub open_timeout: Duration,
    /// Growth factor of the open timeout on each reopening (at least 1.0).
    pub backoff_multiplier: f64,
    /// Upper bound of the open timeout (before jitter).
    pub max_open_timeout: Duration,
    /// Fraction in `[0, 1]` of the open timeout that jitter may take off:
    /// the actual timeout is in `[t × (1 − jitter), t]`.
    pub jitter: f64,
    /// Seed of the breaker's jitter generator. Equal seeds give equal
    /// timelines; `None` seeds from process entropy.
    pub jitter_seed: Option<u64>,
    /// Probe requests admitted at once while half-open. At least 1.
    pub half_open_probes: u32,
    /// Probe successes that close a half-open breaker. At least 1.
    pub success_threshold: u32,
}

impl Default for CircuitBreakerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            failure_threshold: 5,
            failure_rate: None,
            open_timeout: Duration::from_secs(5),
            backoff_multiplier: 2.0,
            max_open_timeout: Duration::from_secs(60),
            jitter: 0.2,
            jitter_seed: None,
            half_open_probes: 1,
            success_threshold: 2,
        }
    }
}

/// A rejected breaker configuration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum BreakerConfigError {
    /// `failure_threshold`, `half_open_probes` or `success_threshold` is 0.
    #[error("circuit breaker: {0} must be at least 1")]
    ZeroCount(&'static str),
    /// `backoff_multiplier` is below 1 or not a number.
    #[error("circuit breaker: backoff_multiplier must be a number >= 1, got {0}")]
    Multiplier(f64),
    /// `jitter` is outside `[0, 1]` or not a number.
    #[error("circuit breaker: jitter must be within [0, 1], got {0}")]
    Jitter(f64),
    /// `max_open_timeout` is shorter than `open_timeout`.
    #[error("circuit breaker: max_open_timeout is shorter than open_timeout")]
    TimeoutCap,
    /// The failure-rate window is empty, has no buckets, or a rate outside `(0, 1]`.
    #[error(
        "circuit breaker: failure-rate window needs a non-zero window, buckets >= 1 and a rate in (0, 1]"
    )]
    Window,
}

impl CircuitBreakerConfig {
    /// A breaker that admits everything and never opens.
    pub fn disabled() -> Self {
        Self {
            enabled: false,
            ..Self::default()
        }
    }

    /// Checks every setting; the constructors of pools and worker sets call
    /// this, so a bad flag is an error at startup, not a surprise later.
    pub fn validate(&self) -> Result<(), BreakerConfigError> {
        for (name, value) in [
            ("failure_threshold", self.failure_threshold),
            ("half_open_probes", self.half_open_probes),
            ("success_threshold", self.success_threshold),
        ] {
            if value == 0 {
                return Err(BreakerConfigError::ZeroCount(name));
            }
        }
        if !(self.backoff_multiplier >= 1.0 && self.backoff_multiplier.is_finite()) {
            return Err(BreakerConfigError::Multiplier(self.backoff_multiplier));
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(BreakerConfigError::Jitter(self.jitter));
        }
        if self.max_open_timeout < self.open_timeout {
            return Err(BreakerConfigError::TimeoutCap);
        }
        if let Some(w) = &self.failure_rate
            && (w.window.is_zero()
                || w.buckets == 0
                || !(w.failure_rate > 0.0 && w.failure_rate <= 1.0))
        {
            return Err(BreakerConfigError::Window);
        }
        Ok(())
    }

    /// The same settings with every out-of-range value clamped into range,
    /// so that constructing a breaker never fails or panics.
    fn sanitized(mut self) -> Self {
        self.failure_threshold = self.failure_threshold.max(1);
        self.half_open_probes = self.half_open_probes.max(1);
        self.success_threshold = self.success_threshold.max(1);
        if !(self.backoff_multiplier >= 1.0 && self.backoff_multiplier.is_finite()) {
            self.backoff_multiplier = 1.0;
        }
        self.jitter = if self.jitter.is_nan() {
            0.0
        } else {
            self.jitter.clamp(0.0, 1.0)
        };
        self.max_open_timeout = self.max_open_timeout.max(self.open_timeout);
        if let Some(w) = &mut self.failure_rate {
            w.buckets = w.buckets.max(1);
            if w.window.is_zero() {
                w.window = Duration::from_millis(1);
            }
            if !(w.failure_rate > 0.0 && w.failure_rate <= 1.0) {
                w.failure_rate = 1.0;
            }
        }
        self
    }

    /// The open timeout before jitter after `openings` consecutive openings
    /// (1 for the first).
    pub fn backoff_before_jitter(&self, openings: u32) -> Duration {
        let exponent = openings.saturating_sub(1).min(64) as i32;
        let secs = self.open_timeout.as_secs_f64() * self.backoff_multiplier.powi(exponent);
        let cap = self.max_open_timeout.as_secs_f64();
        if secs.is_finite() && secs < cap {
            Duration::from_secs_f64(secs)
        } else {
            self.max_open_timeout
        }
    }
}

/// The observable state of a breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Admitting all requests.
    Closed,
    /// Refusing requests until the open timeout passes.
    Open,
    /// Admitting a bounded number of probe requests.
    HalfOpen,
}

impl BreakerState {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Open,
            2 => Self::HalfOpen,
            _ => Self::Closed,
        }
    }

    fn as_u8(self) -> u8 {
        match self {
            Self::Closed => 0,
            Self::Open => 1,
            Self::HalfOpen => 2,
        }
    }

    /// Lower-case name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }
}

impl fmt::Display for BreakerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One state change, as passed to the transition hook.
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerTransition {
    /// The state left.
    pub from: BreakerState,
    /// The state entered.
    pub to: BreakerState,
    /// When it happened (the `now` the caller passed).
    pub at: Instant,
    /// For a transition to open: how long the breaker stays open.
    pub open_for: Option<Duration>,
    /// Openings since the breaker last closed (1 for the first).
    pub consecutive_openings: u32,
}

/// A callback told about every transition, for metrics and logs. It runs
/// after the breaker's lock is released, on the thread that caused the
/// transition; keep it short.
pub type TransitionHook = StdArc<dyn Fn(&str, &BreakerTransition) + Send + Sync>;

/// Permission to send one request, from [`CircuitBreaker::try_acquire`].
///
/// A probe admission (half-open) holds one of the breaker's probe slots
/// until it is handed back with [`CircuitBreaker::record`] or
/// [`CircuitBreaker::abandon`]. [`LoadGuard`](crate::LoadGuard) does this
/// for you (it hands the slot back when dropped without an outcome).
#[must_use = "a probe admission holds a half-open slot until recorded or abandoned"]
#[derive(Debug, PartialEq, Eq)]
pub struct Admission {
    probe_epoch: Option<u64>,
}

impl Admission {
    /// Whether this admission is one of the half-open probes.
    pub fn is_probe(&self) -> bool {
        self.probe_epoch.is_some()
    }

    /// An admission that is not a probe, for callers that bypass the breaker.
    pub(crate) fn unprobed() -> Self {
        Self { probe_epoch: None }
    }

    /// The probe epoch, consuming the admission (for compact storage).
    pub(crate) fn into_probe_epoch(self) -> Option<u64> {
        self.probe_epoch
    }

    /// Rebuilds an admission from [`into_probe_epoch`](Self::into_probe_epoch);
    /// `u64::MAX` means "not a probe".
    pub(crate) fn from_probe_epoch(epoch: u64) -> Self {
        Self {
            probe_epoch: (epoch != u64::MAX).then_some(epoch),
        }
    }
}

/// Why a breaker refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejected {
    /// The breaker is open.
    #[error("circuit breaker is open")]
    Open,
    /// The breaker is half-open and all probe slots are taken.
    #[error("circuit breaker is half-open and its probe slots are taken")]
    ProbesBusy,
}

/// Transition counters, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BreakerCounters {
    /// Transitions to open.
    pub opened: u64,
    /// Transitions to half-open.
    pub half_opened: u64,
    /// Transitions to closed.
    pub closed: u64,
    /// Requests refused.
    pub rejected: u64,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Closed,
    Open { until: Instant },
    HalfOpen { in_flight: u32, successes: u32 },
}

#[derive(Debug)]
struct Window {
    bucket_len: Duration,
    origin: Option<Instant>,
    // (bucket index since origin, successes, failures) per ring slot.
    slots: Vec<(u64, u32, u32)>,
}

impl Window {
    fn new(cfg: &FailureRateWindow) -> Self {
        let buckets = cfg.buckets.max(1);
        let bucket_len = (cfg.window / buckets).max(Duration::from_nanos(1));
        Self {
            bucket_len,
            origin: None,
            slots: vec![(u64::MAX, 0, 0); buckets as usize],
        }
    }

    fn index(&mut self, now: Instant) -> u64 {
        let origin = *self.origin.get_or_insert(now);
        let elapsed = now.saturating_duration_since(origin).as_nanos();
        (elapsed / self.bucket_len.as_nanos().max(1)) as u64
    }

    fn record(&mut self, now: Instant, failed: bool) {
        let idx = self.index(now);
        let n = self.slots.len() as u64;
        let slot = &mut self.slots[(idx % n) as usize];
        if slot.0 != idx {
            *slot = (idx, 0, 0);
        }
        if failed {
            slot.2 = slot.2.saturating_add(1);
        } else {
            slot.1 = slot.1.saturating_add(1);
        }
    }

    fn totals(&mut self, now: Instant) -> (u64, u64) {
        let idx = self.index(now);
        let n = self.slots.len() as u64;
        let (mut ok, mut failed) = (0u64, 0u64);
        for &(slot_idx, s, f) in &self.slots {
            if slot_idx != u64::MAX && slot_idx <= idx && idx - slot_idx < n {
                ok += u64::from(s);
                failed += u64::from(f);
            }
        }
        (ok, failed)
    }

    fn clear(&mut self) {
        for slot in &mut self.slots {
            *slot = (u64::MAX, 0, 0);
        }
    }
}

#[derive(Debug)]
struct Inner {
    phase: Phase,
    consecutive_failures: u32,
    openings: u32,
    epoch: u64,
    window: Option<Window>,
    rng: SplitMix64,
}

/// A circuit breaker. All methods take `&self`; state changes happen under
/// one short internal lock, and [`state`](Self::state) reads an atomic
/// mirror without locking.
pub struct CircuitBreaker {
    config: CircuitBreakerConfig,
    name: Box<str>,
    inner: Mutex<Inner>,
    state: AtomicU8,
    opened: AtomicU64,
    half_opened: AtomicU64,
    closed: AtomicU64,
    rejected: AtomicU64,
    probes_in_flight: AtomicU32,
    // Mirror of `Inner::consecutive_failures`, written under the lock, so a
    // success on a healthy closed breaker needs no lock at all.
    failure_streak: AtomicU32,
    hook: Option<TransitionHook>,
}

impl fmt::Debug for CircuitBreaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CircuitBreaker")
            .field("name", &self.name)
            .field("state", &self.state())
            .field("counters", &self.counters())
            .finish_non_exhaustive()
    }
}

impl CircuitBreaker {
    /// A closed breaker. Out-of-range settings are clamped (use
    /// [`CircuitBreakerConfig::validate`] to reject them instead).
    pub fn new(config: CircuitBreakerConfig) -> Self {
        Self::with_hook("", config, None)
    }

    /// A closed breaker named `name` (passed to the hook, usually the
    /// worker's key) that reports transitions to `hook`.
    pub fn with_hook(
        name: &str,
        config: CircuitBreakerConfig,
        hook: Option<TransitionHook>,
    ) -> Self {
        let config = config.sanitized();
        let rng = match config.jitter_seed {
            Some(seed) => SplitMix64::new(seed),
            None => SplitMix64::from_entropy(),
        };
        let window = config.failure_rate.as_ref().map(Window::new);
        Self {
            name: name.into(),
            inner: Mutex::new(Inner {
                phase: Phase::Closed,
                consecutive_failures: 0,
                openings: 0,
                epoch: 0,
                window,
                rng,
            }),
            state: AtomicU8::new(BreakerState::Closed.as_u8()),
            opened: AtomicU64::new(0),
            half_opened: AtomicU64::new(0),
            closed: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            probes_in_flight: AtomicU32::new(0),
            failure_streak: AtomicU32::new(0),
            hook,
            config,
        }
    }

    /// The configuration in force (after clamping).
    pub fn config(&self) -> &CircuitBreakerConfig {
        &self.config
    }

    /// The state as of the last transition. An open breaker whose timeout
    /// has passed still reads `Open` here until a caller asks for admission.
    pub fn state(&self) -> BreakerState {
        BreakerState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Transition and rejection counters.
    pub fn counters(&self) -> BreakerCounters {
        BreakerCounters {
            opened: self.opened.load(Ordering::Relaxed),
            half_opened: self.half_opened.load(Ordering::Relaxed),
            closed: self.closed.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
        }
    }

    /// Probe slots currently held (half-open only; 0 otherwise).
    pub fn probes_in_flight(&self) -> u32 {
        self.probes_in_flight.load(Ordering::Acquire)
    }

    /// Whether [`try_acquire`](Self::try_acquire) would admit a request at
    /// `now`, without taking a slot or changing state.
    pub fn would_admit(&self, now: Instant) -> bool {
        if !self.config.enabled {
            return true;
        }
        match self.state() {
            BreakerState::Closed => true,
            BreakerState::HalfOpen => self.probes_in_flight() < self.config.half_open_probes,
            BreakerState::Open => match self.inner.lock().phase {
                Phase::Open { until } => now >= until,
                Phase::HalfOpen { in_flight, .. } => in_flight < self.config.half_open_probes,
                Phase::Closed => true,
            },
        }
    }

    /// Asks to send one request at `now`.
    ///
    /// Closed: always admitted (no lock taken). Open: refused until the
    /// open timeout passes, then the breaker turns half-open. Half-open:
    /// admitted as a probe while a probe slot is free, refused otherwise.
    pub fn try_acquire(&self, now: Instant) -> Result<Admission, Rejected> {
        if !self.config.enabled || self.state() == BreakerState::Closed {
            return Ok(Admission::unprobed());
        }
        let mut transitions = Transitions::default();
        let result = {
            let mut guard = self.inner.lock();
            let inner = &mut *guard;
            if let Phase::Open { until } = inner.phase
                && now >= until
            {
                inner.epoch += 1;
                inner.phase = Phase::HalfOpen {
                    in_flight: 0,
                    successes: 0,
                };
                self.enter(
                    BreakerState::Open,
                    BreakerState::HalfOpen,
                    now,
                    inner,
                    None,
                    &mut transitions,
                );
            }
            match &mut inner.phase {
                Phase::Closed => Ok(Admission::unprobed()),
                Phase::Open { .. } => Err(Rejected::Open),
                Phase::HalfOpen { in_flight, .. } => {
                    if *in_flight < self.config.half_open_probes {
                        *in_flight += 1;
                        self.probes_in_flight.store(*in_flight, Ordering::Release);
                        Ok(Admission {
                            probe_epoch: Some(inner.epoch),
                        })
                    } else {
                        Err(Rejected::ProbesBusy)
                    }
                }
            }
        };
        if result.is_err() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
        }
        self.fire(transitions);
        result
    }

    /// Records the outcome of an admitted request at `now`, handing back its
    /// probe slot if it held one.
    pub fn record(&self, admission: Admission, outcome: Outcome, now: Instant) {
        if !self.config.enabled {
            return;
        }
        let class = outcome.class();
        if class == OutcomeClass::Neutral && !admission.is_probe() {
            return;
        }
        if class == OutcomeClass::Success
            && !admission.is_probe()
            && self.config.failure_rate.is_none()
            && self.state() == BreakerState::Closed
            && self.failure_streak.load(Ordering::Acquire) == 0
        {
            // Nothing to reset: the common case of a healthy worker.
            return;
        }
        let mut transitions = Transitions::default();
        {
            let mut inner = self.inner.lock();
            let current_probe = admission.probe_epoch.is_some_and(|e| e == inner.epoch);
            match inner.phase {
                Phase::Closed => match class {
                    OutcomeClass::Neutral => {}
                    OutcomeClass::Success => {
                        inner.consecutive_failures = 0;
                        self.failure_streak.store(0, Ordering::Release);
                        if let Some(w) = &mut inner.window {
                            w.record(now, false);
                        }
                    }
                    OutcomeClass::WorkerFailure => {
                        inner.consecutive_failures = inner.consecutive_failures.saturating_add(1);
                        self.failure_streak
                            .store(inner.consecutive_failures, Ordering::Release);
                        let rate_tripped = match (&mut inner.window, &self.config.failure_rate) {
                            (Some(w), Some(cfg)) => {
                                w.record(now, true);
                                let (ok, failed) = w.totals(now);
                                let total = ok + failed;
                                total >= u64::from(cfg.min_requests)
                                    && total > 0
                                    && failed as f64 >= cfg.failure_rate * total as f64
                            }
                            _ => false,
                        };
                        if rate_tripped
                            || inner.consecutive_failures >= self.config.failure_threshold
                        {
                            self.open(&mut inner, BreakerState::Closed, now, &mut transitions);
                        }
                    }
                },
                // Outcomes of requests admitted before the breaker opened say
                // nothing new: the breaker already decided.
                Phase::Open { .. } => {}
                Phase::HalfOpen {
                    in_flight,
                    successes,
                } => {
                    if current_probe {
                        let in_flight = in_flight.saturating_sub(1);
                        let successes = successes + u32::from(class == OutcomeClass::Success);
                        inner.phase = Phase::HalfOpen {
                            in_flight,
                            successes,
                        };
                        self.probes_in_flight.store(in_flight, Ordering::Release);
                        match class {
                            OutcomeClass::Success if successes >= self.config.success_threshold => {
                                self.close(&mut inner, now, &mut transitions);
                            }
                            OutcomeClass::WorkerFailure => {
                                self.open(
                                    &mut inner,
                                    BreakerState::HalfOpen,
                                    now,
                                    &mut transitions,
                                );
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
        self.fire(transitions);
    }

    /// Hands back an admission whose request ended without an outcome worth
    /// counting (for example, it was never sent). Frees its probe slot.
    pub fn abandon(&self, admission: Admission) {
        let Some(epoch) = admission.probe_epoch else {
            return;
        };
        let mut inner = self.inner.lock();
        if inner.epoch != epoch {
            return;
        }
        if let Phase::HalfOpen { in_flight, .. } = &mut inner.phase {
            *in_flight = in_flight.saturating_sub(1);
            self.probes_in_flight.store(*in_flight, Ordering::Release);
        }
    }

    /// Records a failure outcome for a request that bypassed admission —
    /// convenient for callers that only use the counting side.
    pub fn record_unadmitted(&self, outcome: Outcome, now: Instant) {
        self.record(Admission::unprobed(), outcome, now);
    }

    fn open(&self, inner: &mut Inner, from: BreakerState, now: Instant, out: &mut Transitions) {
        inner.openings = inner.openings.saturating_add(1);
        let base = self.config.backoff_before_jitter(inner.openings);
        let take_off = self.config.jitter * inner.rng.next_unit();
        let open_for = base.mul_f64(1.0 - take_off);
        inner.phase = Phase::Open {
            until: now + open_for,
        };
        inner.consecutive_failures = 0;
        self.failure_streak.store(0, Ordering::Release);
        inner.epoch += 1;
        self.probes_in_flight.store(0, Ordering::Release);
        if let Some(w) = &mut inner.window {
            w.clear();
        }
        self.enter(from, BreakerState::Open, now, inner, Some(open_for), out);
    }

    fn close(&self, inner: &mut Inner, now: Instant, out: &mut Transitions) {
        inner.phase = Phase::Closed;
        inner.openings = 0;
        inner.consecutive_failures = 0;
        self.failure_streak.store(0, Ordering::Release);
        inner.epoch += 1;
        self.probes_in_flight.store(0, Ordering::Release);
        self.enter(
            BreakerState::HalfOpen,
            BreakerState::Closed,
            now,
            inner,
            None,
            out,
        );
    }

    fn enter(
        &self,
        from: BreakerState,
        to: BreakerState,
        at: Instant,
        inner: &Inner,
        open_for: Option<Duration>,
        out: &mut Transitions,
    ) {
        self.state.store(to.as_u8(), Ordering::Release);
        let counter = match to {
            BreakerState::Open => &self.opened,
            BreakerState::HalfOpen => &self.half_opened,
            BreakerState::Closed => &self.closed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        out.push(BreakerTransition {
            from,
            to,
            at,
            open_for,
            consecutive_openings: inner.openings,
        });
    }

    fn fire(&self, transitions: Transitions) {
        for t in transitions.iter() {
            tracing::debug!(worker = %self.name, from = %t.from, to = %t.to, "circuit breaker transition");
            if let Some(hook) = &self.hook {
                hook(&self.name, t);
            }
        }
    }
}

/// At most two transitions happen in one call (open → half-open, then
/// half-open → something); kept on the stack.
#[derive(Default)]
struct Transitions {
    items: [Option<BreakerTransition>; 2],
}

impl Transitions {
    fn push(&mut self, t: BreakerTransition) {
        if let Some(slot) = self.items.iter_mut().find(|s| s.is_none()) {
            *slot = Some(t);
        }
    }

    fn iter(&self) -> impl Iterator<Item = &BreakerTransition> {
        self.items.iter().flatten()
    }
}
