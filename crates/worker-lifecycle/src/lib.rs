//! The lifecycle of inference workers, with load counted by ownership.
//!
//! This crate makes a router's bookkeeping about its workers correct by
//! construction:
//!
//! - **One identity per lifetime.** A [`Worker`] is built once per (role,
//!   endpoint, registration generation) and shared as `Arc<Worker>`; every
//!   decision sees its live load, processed count, health and breaker.
//! - **Load by ownership.** [`Worker::reserve`] returns a [`LoadGuard`] that
//!   brings the load down exactly once — when released or when its last
//!   handle is dropped (success, error, retry, cancellation, a streaming
//!   body dropped half-way). It is `'static`, so it moves into tasks and
//!   response bodies.
//! - **Fresh state for a new lifetime.** The [`ServiceRegistry`] gives each
//!   registration lifetime a generation; the [`DiscoveryPool`] maps
//!   (endpoint, generation) to one persistent worker, replaces it when the
//!   generation changes, and reports [`MembershipEvent`]s. Guards on the old
//!   worker can never touch the new one.
//! - **No going backwards.** [`DiscoveryPool::with_reconciled`] reads the
//!   registry and reconciles inside the pool's lock, then lets the caller
//!   select and reserve in the same critical section.
//! - **Health never touches load.** The [`HealthChecker`] changes health
//!   only.
//! - **Sans-IO decisions.** The [`CircuitBreaker`], registry and
//!   [`RetryBudget`] take time as an argument; jitter takes randomness from
//!   a [`RandomSource`]; probes come in through [`HealthProbe`].
//!
//! # Example: reserve, stream, release
//!
//! ```
//! use std::time::{Duration, Instant};
//! use worker_lifecycle::{
//!     DiscoveryPool, Endpoint, Outcome, Registration, RoleKind, ServiceRegistry, WorkerOptions,
//! };
//!
//! let registry = ServiceRegistry::new(RoleKind::Decode, Duration::from_secs(30));
//! let pool = DiscoveryPool::new(RoleKind::Decode, WorkerOptions::default()).unwrap();
//! let now = Instant::now();
//! for url in ["http://10.0.0.1:8000", "http://10.0.0.2:8000"] {
//!     registry.register(Endpoint::new(url, None).unwrap(), Registration::default(), now);
//! }
//!
//! // One serialized step: read the registry, reconcile, select, reserve.
//! let guard = pool
//!     .with_reconciled(&registry, now, |view| {
//!         // A policy would get `view.events()` first (two `Added` here).
//!         assert_eq!(view.events().len(), 2);
//!         let least_loaded = view
//!             .workers()
//!             .iter()
//!             .filter(|w| w.is_available())
//!             .min_by_key(|w| (w.load(), w.processed()))?;
//!         least_loaded.try_reserve().ok()
//!     })
//!     .unwrap()
//!     .expect("a worker is available");
//! let worker = guard.worker().clone();
//! assert_eq!(worker.load(), 1);
//!
//! // The guard moves into the response body; a second handle can live in
//! // the task that forwards it. The load stays counted while either holds it.
//! let body_handle = guard.share();
//! drop(guard);
//! assert_eq!(worker.load(), 1);
//!
//! // End of stream: record the outcome and release (dropping works too).
//! body_handle.record_outcome(Outcome::from_status(200));
//! assert!(body_handle.release());
//! assert!(!body_handle.release(), "release is idempotent");
//! assert_eq!(worker.load(), 0);
//! assert_eq!(worker.processed(), 1);
//! assert_eq!(worker.underflows(), 0);
//! ```
//!
//! # Feature flags
//!
//! - `lb-policies`: implements lb-policies' `Backend` for [`Worker`] (every
//!   policy selects among workers directly) and adds `RolePool`, the one
//!   pool of a role — a worker source, its policy registry, membership
//!   forwarding, and breaker-aware select-then-reserve — that the router,
//!   the prefill/decode pools and the simulator all use.
//!
//! tokio is used only by the health checker and drain (timers and
//! `Notify`); every decision is synchronous.
//!
//! # Concurrency and cancel safety
//!
//! Worker counters are atomics. Breakers, registries and pools each use one
//! short internal lock, never held across an `.await` (the selection closure
//! of [`DiscoveryPool::with_reconciled`] is synchronous). The lock order is
//! pool → registry. [`Worker::wait_idle`] and the drain futures are
//! cancel-safe. Loom models of the guard, the half-open probe slots and the
//! pool step live in `tests/loom_*.rs`.
//!
//! # Stability
//!
//! Pre-1.0: the API may change between minor versions. Error enums are
//! `#[non_exhaustive]`.
#![warn(missing_docs)]

mod attempts;
mod breaker;
mod clock;
#[cfg(not(loom))]
mod drain;
mod engine_load;
#[doc(hidden)]
pub mod fuzzing;
mod guard;
#[cfg(not(loom))]
mod health;
pub mod labels;
mod membership;
mod outcome;
#[cfg(feature = "lb-policies")]
mod policies;
mod pool;
mod registry;
mod retry;
mod rng;
#[cfg(all(feature = "lb-policies", not(loom)))]
mod role_pool;
mod static_set;
mod sync;
pub mod url;
mod worker;

pub use attempts::{Attempted, Attempts, run_attempts};
pub use breaker::{
    Admission, BreakerConfigError, BreakerCounters, BreakerState, BreakerTransition,
    CircuitBreaker, CircuitBreakerConfig, FailureRateWindow, Rejected, TransitionHook,
};
#[cfg(not(loom))]
pub use clock::TokioClock;
pub use clock::{Clock, ManualClock, SystemClock};
#[cfg(not(loom))]
pub use drain::{DrainOutcome, DrainReport, drain_worker};
pub use guard::LoadGuard;
#[cfg(not(loom))]
pub use health::{HealthCheckConfig, HealthChecker, HealthProbe, HealthReport, ProbeError};
pub use membership::MembershipEvent;
pub use outcome::{Outcome, OutcomeClass};
pub use pool::{DiscoveryPool, PoolError, PoolView};
pub use registry::{
    RegisterOutcome, Registration, RegistryError, RegistrySnapshot, ServiceRegistry, SnapshotEntry,
};
pub use retry::{
    DEFAULT_RETRYABLE_STATUSES, RequestRetries, RetryBudget, RetryBudgetConfig, RetryDecision,
    RetryPolicy,
};
pub use rng::{RandomSource, SplitMix64};
#[cfg(all(feature = "lb-policies", not(loom)))]
pub use role_pool::{
    Choice, Eligible, FleetCounts, MembershipListener, NoWorkerAvailable, Reserved, RolePool,
    RolePoolError, SelectError,
};
pub use static_set::{StaticSetError, StaticWorkerSet};
/// The README's example runs as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub use url::{WorkerUrl, WorkerUrlError};
pub use worker::{
    DEFAULT_FLEET_GUARD_MIN_WORKERS, Endpoint, FleetGuard, HealthChange, Lifecycle, RoleKind,
    Unavailable, Worker, WorkerOptions, WorkerRole, WorkerSpec,
};
