//! One role's workers and their policies: [`RolePool`] (feature
//! `lb-policies`).
//!
//! A router keeps one pool per role it routes to — the regular workers, or
//! the prefill and the decode workers of a disaggregated fleet. Each pool
//! is the same three things, written once here:
//!
//! - a **worker source**: a [`StaticWorkerSet`] managed by hand, or a
//!   [`DiscoveryPool`] reconciled from a [`ServiceRegistry`];
//! - the **policy registry** that chooses among its workers, one policy per
//!   model;
//! - **membership forwarding**: every [`MembershipEvent`] of the source
//!   reaches the policies (a cache-aware policy's tree membership follows
//!   the pool, invariant 5 of docs/architecture.md) and then an optional
//!   listener of the host (a prefill/decode pool keeps per-worker connector
//!   facts).
//!
//! Selection is **select-then-reserve, breaker-aware**: [`RolePool::step`]
//! reconciles and hands the workers to a closure under the pool's lock;
//! [`RolePool::eligible`] narrows them to the request (model, exclusions,
//! host filter) without asking any policy; [`RolePool::require_available`]
//! refuses with a counted [`SelectError::Unavailable`] before any policy
//! runs (a refused request leaves no tree entry behind, invariant 13); and
//! [`RolePool::choose`] asks the policy, then reserves through the
//! worker's breaker ([`Worker::try_reserve`]). A worker that refuses (it
//! lost the race for its half-open probe slot) is left out and the policy
//! asked again, so a choice always comes with a guard that its breaker
//! admitted.
//!
//! ```
//! use lb_policies::{PolicyConfig, PolicyRegistry, RequestContext};
//! use worker_lifecycle::{Endpoint, RolePool, RoleKind, WorkerOptions, WorkerRole, WorkerSpec};
//!
//! let policies = PolicyRegistry::new(PolicyConfig::named("least_loaded")).unwrap();
//! let pool = RolePool::fixed(RoleKind::Regular, WorkerOptions::default(), policies).unwrap();
//! for port in [8001, 8002] {
//!     let endpoint = Endpoint::new(&format!("http://127.0.0.1:{port}"), None).unwrap();
//!     pool.add(WorkerSpec::new(WorkerRole::Regular, endpoint)).unwrap();
//! }
//!
//! let context = RequestContext::new("llama");
//! let first = pool
//!     .step(std::time::Instant::now(), |workers| {
//!         let eligible = pool.eligible(workers, "llama", |_| true)?;
//!         pool.require_available(&eligible)?;
//!         pool.choose_reserved(&eligible, &context)
//!     })
//!     .unwrap()
//!     .unwrap();
//! let worker = std::sync::Arc::clone(first.guard.worker());
//! assert_eq!(worker.load(), 1);
//! drop(first);
//! assert_eq!(worker.load(), 0);
//! ```

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use lb_policies::{PolicyRegistry, RequestContext};
use tokio::time::Instant as TokioInstant;

use crate::drain::DrainOutcome;
use crate::guard::LoadGuard;
use crate::membership::MembershipEvent;
use crate::pool::{DiscoveryPool, PoolError};
use crate::registry::ServiceRegistry;
use crate::static_set::{StaticSetError, StaticWorkerSet};
use crate::sync::{AtomicU64, Ordering};
use crate::worker::{FleetGuard, Lifecycle, RoleKind, Worker, WorkerOptions, WorkerSpec};

/// Where a role's workers come from.
#[derive(Debug)]
enum Source {
    Fixed(StaticWorkerSet),
    Discovered {
        pool: DiscoveryPool,
        registry: Arc<ServiceRegistry>,
    },
}

/// A host's view of membership changes, called after the policies saw them,
/// possibly under the pool's lock: keep it short and never block.
pub type MembershipListener = Box<dyn Fn(&MembershipEvent) + Send + Sync>;

/// A refused pool operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RolePoolError {
    /// The static set refused (duplicate, role mismatch, breaker settings).
    #[error(transparent)]
    Set(#[from] StaticSetError),
    /// The discovery pool refused (registry of another role, stale
    /// snapshot, breaker settings).
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The operation needs a hand-managed role, and this one is discovered.
    #[error("{0} workers are discovered; they join by registering and leave by deregistering")]
    Discovered(RoleKind),
}

/// Why no worker could be chosen for a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SelectError {
    /// Workers are registered, but none serves the request's model.
    #[error("no worker serves model {0:?}")]
    UnknownModel(String),
    /// No eligible worker is ready, healthy and admitted by its breaker.
    #[error(transparent)]
    Unavailable(#[from] NoWorkerAvailable),
    /// The policy refused the request (for instance an unknown per-model
    /// policy).
    #[error("{0}")]
    Policy(String),
    /// The role's discovery pool could not be reconciled.
    #[error("{role} pool: {reason}")]
    Pool {
        /// The role.
        role: RoleKind,
        /// What the pool said.
        reason: String,
    },
}

/// The counts behind a [`SelectError::Unavailable`], for the client's
/// message and for logs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct NoWorkerAvailable {
    /// The role that had no worker.
    pub role: RoleKind,
    /// Workers in the pool.
    pub registered: usize,
    /// Workers eligible for this request (serving its model, not excluded).
    pub eligible: usize,
    /// Eligible workers whose health check fails.
    pub unhealthy: usize,
    /// Eligible, healthy workers whose breaker refuses traffic.
    pub breaker_open: usize,
    /// Eligible workers draining or not yet ready.
    pub not_ready: usize,
}

impl fmt::Display for NoWorkerAvailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let role = match self.role {
            RoleKind::Regular => String::new(),
            other => format!("{other} "),
        };
        if self.registered == 0 {
            return write!(f, "no {role}workers are registered");
        }
        write!(
            f,
            "no {role}worker is available ({} registered, {} eligible for this request: \
             {} unhealthy, {} with an open circuit breaker, {} draining or not ready)",
            self.registered, self.eligible, self.unhealthy, self.breaker_open, self.not_ready
        )
    }
}

/// The workers of one request's choice in one role: those of the pool that
/// serve its model, are not excluded and pass the host's filter. Borrows the
/// pool's list when nothing was filtered out, the common case.
#[derive(Debug, Clone)]
pub struct Eligible<'a> {
    workers: Cow<'a, [Arc<Worker>]>,
    registered: usize,
}

impl<'a> Eligible<'a> {
    /// The eligible workers.
    pub fn workers(&self) -> &[Arc<Worker>] {
        &self.workers
    }

    /// Whether any eligible worker is available now.
    pub fn any_available(&self) -> bool {
        self.workers.iter().any(|w| w.is_available())
    }

    /// Workers in the pool when these were picked.
    pub fn registered(&self) -> usize {
        self.registered
    }
}

/// A policy's choice in a role, not reserved ([`RolePool::choose`]).
#[derive(Debug)]
pub struct Choice {
    /// The chosen worker.
    pub worker: Arc<Worker>,
    /// For prefix-matching policies, the request's best prefix match in
    /// thousandths of its input.
    pub match_permille: Option<u16>,
    /// For prefix-matching policies, that match's length in the request's
    /// units (token ids or characters; `Decision::matched`).
    pub matched: Option<usize>,
    /// Why the policy chose this worker.
    pub reason: lb_policies::DecisionReason,
}

/// A policy's choice in a role and its reservation through the worker's
/// breaker ([`RolePool::choose_reserved`]): the request counts in the
/// worker's load until the guard is dropped.
#[derive(Debug)]
pub struct Reserved {
    /// The chosen worker's load guard ([`LoadGuard::worker`] is the
    /// worker).
    pub guard: LoadGuard,
    /// For prefix-matching policies, the request's best prefix match in
    /// thousandths of its input.
    pub match_permille: Option<u16>,
    /// For prefix-matching policies, that match's length in the request's
    /// units (token ids or characters; `Decision::matched`).
    pub matched: Option<usize>,
    /// Why the policy chose this worker.
    pub reason: lb_policies::DecisionReason,
}

/// One role's workers, its policies and the forwarding between them. See
/// the module docs.
pub struct RolePool {
    role: RoleKind,
    source: Source,
    policies: PolicyRegistry<Arc<Worker>>,
    listener: Option<MembershipListener>,
    unavailable: AtomicU64,
    fleet: FleetGuard,
    panic_steps: AtomicU64,
    capped_steps: AtomicU64,
}

/// How often a pool's [`FleetGuard`] acted, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FleetCounts {
    /// Steps that found the pool below its panic threshold (every live
    /// worker seen).
    pub panic_steps: u64,
    /// Steps in which the breaker cap let breaker-refused workers through.
    pub capped_steps: u64,
}

impl fmt::Debug for RolePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RolePool")
            .field("role", &self.role)
            .field("workers", &self.workers().len())
            .field("discovered", &self.registry().is_some())
            .finish_non_exhaustive()
    }
}

impl RolePool {
    /// A pool of `role` whose workers are added and removed by hand.
    ///
    /// # Errors
    /// [`RolePoolError::Set`] for invalid breaker settings.
    pub fn fixed(
        role: RoleKind,
        options: WorkerOptions,
        policies: PolicyRegistry<Arc<Worker>>,
    ) -> Result<Self, RolePoolError> {
        let fleet = options.fleet;
        Ok(Self::with_source(
            role,
            Source::Fixed(StaticWorkerSet::new(role, options)?),
            policies,
            fleet,
        ))
    }

    /// A pool of `registry`'s role whose workers come from `registry`,
    /// reconciled at every [`step`](Self::step).
    ///
    /// # Errors
    /// [`RolePoolError::Pool`] for invalid breaker settings.
    pub fn discovered(
        registry: Arc<ServiceRegistry>,
        options: WorkerOptions,
        policies: PolicyRegistry<Arc<Worker>>,
    ) -> Result<Self, RolePoolError> {
        let role = registry.role();
        let fleet = options.fleet;
        let pool = DiscoveryPool::new(role, options)?;
        Ok(Self::with_source(
            role,
            Source::Discovered { pool, registry },
            policies,
            fleet,
        ))
    }

    fn with_source(
        role: RoleKind,
        source: Source,
        policies: PolicyRegistry<Arc<Worker>>,
        fleet: FleetGuard,
    ) -> Self {
        Self {
            role,
            source,
            policies,
            listener: None,
            unavailable: AtomicU64::new(0),
            fleet,
            panic_steps: AtomicU64::new(0),
            capped_steps: AtomicU64::new(0),
        }
    }

    /// Calls `listener` with every membership event, after the policies.
    #[must_use]
    pub fn with_listener(mut self, listener: MembershipListener) -> Self {
        self.listener = Some(listener);
        self
    }

    /// The role.
    pub fn role(&self) -> RoleKind {
        self.role
    }

    /// The workers as of the last reconciliation (a fixed pool: all of
    /// them), without reconciling.
    pub fn workers(&self) -> Arc<[Arc<Worker>]> {
        match &self.source {
            Source::Fixed(set) => set.workers(),
            Source::Discovered { pool, .. } => pool.workers(),
        }
    }

    /// The policies, one per model.
    pub fn policies(&self) -> &PolicyRegistry<Arc<Worker>> {
        &self.policies
    }

    /// The hand-managed set of a fixed pool.
    ///
    /// # Errors
    /// [`RolePoolError::Discovered`] for a discovered pool.
    pub fn static_set(&self) -> Result<&StaticWorkerSet, RolePoolError> {
        match &self.source {
            Source::Fixed(set) => Ok(set),
            Source::Discovered { .. } => Err(RolePoolError::Discovered(self.role)),
        }
    }

    /// The registry of a discovered pool.
    pub fn registry(&self) -> Option<&Arc<ServiceRegistry>> {
        match &self.source {
            Source::Fixed(_) => None,
            Source::Discovered { registry, .. } => Some(registry),
        }
    }

    /// Adds a worker to a fixed pool and tells the policies and the
    /// listener.
    ///
    /// # Errors
    /// [`RolePoolError::Discovered`] for a discovered pool;
    /// [`RolePoolError::Set`] for a duplicate or a worker of another role.
    pub fn add(&self, spec: WorkerSpec) -> Result<Arc<Worker>, RolePoolError> {
        let event = self.static_set()?.add(spec)?;
        self.apply(&event);
        match event {
            MembershipEvent::Added(worker)
            | MembershipEvent::Replaced { new: worker, .. }
            | MembershipEvent::Removed(worker) => Ok(worker),
        }
    }

    /// Drains exactly this worker lifetime of a fixed pool (no new work;
    /// waits until its load is 0 or `deadline`), removes it if it is still
    /// a member and tells the policies. Returns whether its load reached 0.
    ///
    /// # Errors
    /// [`RolePoolError::Discovered`] for a discovered pool (its workers
    /// leave by deregistering).
    pub async fn drain_and_remove(
        &self,
        worker: &Arc<Worker>,
        deadline: TokioInstant,
    ) -> Result<bool, RolePoolError> {
        let report = self.static_set()?.drain_lifetime(worker, deadline).await;
        for event in &report.events {
            self.apply(event);
        }
        Ok(matches!(report.outcome, DrainOutcome::Idle))
    }

    /// Forwards `event` to the policies (a replaced worker is the old
    /// lifetime's key leaving and the new one's joining), then to the
    /// listener. Hosts that change a fixed pool's set directly call this.
    pub fn apply(&self, event: &MembershipEvent) {
        for change in event.for_policies() {
            self.policies.on_membership(change);
        }
        if let Some(listener) = &self.listener {
            listener(event);
        }
    }

    /// The serialized step of this role: a discovered pool reads its
    /// registry at `now` and reconciles, the membership events reach the
    /// policies and the listener, then `f` runs on the workers — all under
    /// the pool's lock (invariant 4 of docs/architecture.md). A fixed pool
    /// runs `f` on its current list. Keep `f` short and never block in it.
    ///
    /// # Errors
    /// [`SelectError::Pool`] when the registry cannot be applied.
    pub fn step<R>(
        &self,
        now: Instant,
        f: impl FnOnce(&Arc<[Arc<Worker>]>) -> R,
    ) -> Result<R, SelectError> {
        match &self.source {
            Source::Fixed(set) => {
                let workers = set.workers();
                self.guard_fleet(&workers);
                Ok(f(&workers))
            }
            Source::Discovered { pool, registry } => pool
                .with_reconciled(registry, now, |view| {
                    for event in view.events() {
                        self.apply(event);
                    }
                    let workers = view.workers_arc();
                    self.guard_fleet(&workers);
                    f(&workers)
                })
                .map_err(|err| SelectError::Pool {
                    role: self.role,
                    reason: err.to_string(),
                }),
        }
    }

    /// How often the pool's [`FleetGuard`] acted.
    pub fn fleet_counts(&self) -> FleetCounts {
        FleetCounts {
            panic_steps: self.panic_steps.load(Ordering::Relaxed),
            capped_steps: self.capped_steps.load(Ordering::Relaxed),
        }
    }

    /// Applies the [`FleetGuard`] to `workers`: which of them the pool lets
    /// through although unhealthy or refused by their breaker. Atomics
    /// only; concurrent steps compute the same answer from the same state.
    fn guard_fleet(&self, workers: &[Arc<Worker>]) {
        let ready = |w: &Arc<Worker>| w.lifecycle() == Lifecycle::Ready;
        let live = workers.iter().filter(|w| ready(w)).count();
        if !self.fleet.acts_on(live) {
            // A small pool trusts every exclusion; a worker let through in
            // an earlier step (when the pool was larger) is not any more.
            for worker in workers {
                worker.set_pool_admitted(false);
            }
            return;
        }
        let available = workers
            .iter()
            .filter(|w| ready(w) && w.is_healthy() && w.breaker_admits())
            .count();
        if (available as f64) < self.fleet.panic_threshold * live as f64 {
            self.panic_steps.fetch_add(1, Ordering::Relaxed);
            for worker in workers {
                worker.set_pool_admitted(ready(worker));
            }
            return;
        }
        // Healthy workers that only their breaker keeps out, beyond the cap,
        // are let through: the first ones in the pool's order (a stable
        // choice, so the same workers stay in from step to step).
        let refused = |w: &Arc<Worker>| ready(w) && w.is_healthy() && !w.breaker_admits();
        let excluded = workers.iter().filter(|w| refused(w)).count();
        let share = self.fleet.max_breaker_exclusion.clamp(0.0, 1.0);
        let cap = (share * live as f64).floor() as usize;
        let mut let_through = excluded.saturating_sub(cap);
        if let_through > 0 {
            self.capped_steps.fetch_add(1, Ordering::Relaxed);
        }
        for worker in workers {
            let admit = let_through > 0 && refused(worker);
            if admit {
                let_through -= 1;
            }
            worker.set_pool_admitted(admit);
        }
    }

    /// Reconciles now and returns the workers.
    ///
    /// # Errors
    /// As [`step`](Self::step).
    pub fn refresh(&self) -> Result<Arc<[Arc<Worker>]>, SelectError> {
        self.step(Instant::now(), Arc::clone)
    }

    /// The workers of `workers` that serve `model` (every worker serves an
    /// empty model; a worker without a model id serves any) and pass `keep`
    /// (the request's exclusions, the host's own filter). Asks no policy.
    ///
    /// # Errors
    /// [`SelectError::UnknownModel`] when workers are registered and none
    /// serves `model`.
    pub fn eligible<'a>(
        &self,
        workers: &'a [Arc<Worker>],
        model: &str,
        keep: impl Fn(&Arc<Worker>) -> bool,
    ) -> Result<Eligible<'a>, SelectError> {
        let serves =
            |worker: &Arc<Worker>| model.is_empty() || worker.model_id().is_none_or(|m| m == model);
        let passes = |worker: &Arc<Worker>| serves(worker) && keep(worker);
        let registered = workers.len();
        if workers.iter().all(passes) {
            return Ok(Eligible {
                workers: Cow::Borrowed(workers),
                registered,
            });
        }
        if !workers.iter().any(serves) {
            return Err(SelectError::UnknownModel(model.to_owned()));
        }
        Ok(Eligible {
            workers: Cow::Owned(workers.iter().filter(|w| passes(w)).cloned().collect()),
            registered,
        })
    }

    /// Refuses, counting the refusal, when no eligible worker is available
    /// — before any policy is asked.
    ///
    /// # Errors
    /// [`SelectError::Unavailable`] with the reasons counted.
    pub fn require_available(&self, eligible: &Eligible<'_>) -> Result<(), SelectError> {
        if eligible.any_available() {
            return Ok(());
        }
        Err(self.unavailable(eligible))
    }

    /// Selections this role refused because no worker was available.
    pub fn unavailable_count(&self) -> u64 {
        self.unavailable.load(Ordering::Relaxed)
    }

    fn unavailable(&self, eligible: &Eligible<'_>) -> SelectError {
        self.unavailable.fetch_add(1, Ordering::Relaxed);
        let mut counts = NoWorkerAvailable {
            role: self.role,
            registered: eligible.registered,
            eligible: eligible.workers.len(),
            unhealthy: 0,
            breaker_open: 0,
            not_ready: 0,
        };
        for worker in eligible.workers.iter() {
            if worker.lifecycle() != Lifecycle::Ready {
                counts.not_ready += 1;
            } else if !worker.is_healthy() {
                counts.unhealthy += 1;
            } else {
                counts.breaker_open += 1;
            }
        }
        SelectError::Unavailable(counts)
    }

    /// Asks the policy of `context`'s model among `eligible`, without
    /// reserving the choice (a host that reserves later, as the P/D flow
    /// does once both of its workers are chosen).
    ///
    /// # Errors
    /// [`SelectError::Unavailable`] when the policy finds no available
    /// worker; [`SelectError::Policy`] when the policy refuses the request.
    pub fn choose(
        &self,
        eligible: &Eligible<'_>,
        context: &RequestContext<'_>,
    ) -> Result<Choice, SelectError> {
        let decision = self
            .policies
            .select(eligible.workers(), context)
            .map_err(|err| SelectError::Policy(err.to_string()))?
            .ok_or_else(|| self.unavailable(eligible))?;
        Ok(Choice {
            worker: Arc::clone(&eligible.workers()[decision.index]),
            match_permille: decision.match_permille,
            matched: decision.matched,
            reason: decision.reason,
        })
    }

    /// Asks the policy of `context`'s model among `eligible` and reserves
    /// the choice through its breaker. A worker that refuses the
    /// reservation (it lost the race for its half-open probe slot, or just
    /// became unavailable) is left out and the policy asked again.
    ///
    /// # Errors
    /// [`SelectError::Unavailable`] when the policy finds no available
    /// worker or every one refused; [`SelectError::Policy`] when the policy
    /// refuses the request.
    pub fn choose_reserved(
        &self,
        eligible: &Eligible<'_>,
        context: &RequestContext<'_>,
    ) -> Result<Reserved, SelectError> {
        let mut candidates: Cow<'_, [Arc<Worker>]> = Cow::Borrowed(eligible.workers());
        loop {
            let decision = self
                .policies
                .select(&candidates, context)
                .map_err(|err| SelectError::Policy(err.to_string()))?
                .ok_or_else(|| self.unavailable(eligible))?;
            match candidates[decision.index].try_reserve() {
                Ok(guard) => {
                    return Ok(Reserved {
                        guard,
                        match_permille: decision.match_permille,
                        matched: decision.matched,
                        reason: decision.reason,
                    });
                }
                Err(_) => {
                    candidates.to_mut().remove(decision.index);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Endpoint, Outcome, WorkerRole};
    use lb_policies::PolicyConfig;
    use std::time::Duration;

    /// A pool of `n` regular workers whose breakers open at the first
    /// failure and stay open for an hour.
    fn pool(n: usize, fleet: FleetGuard) -> RolePool {
        let mut options = WorkerOptions {
            fleet,
            ..WorkerOptions::default()
        };
        options.breaker.failure_threshold = 1;
        options.breaker.open_timeout = Duration::from_secs(3600);
        options.breaker.max_open_timeout = Duration::from_secs(3600);
        let policies = PolicyRegistry::new(PolicyConfig::named("round_robin")).unwrap();
        let pool = RolePool::fixed(RoleKind::Regular, options, policies).unwrap();
        for port in 0..n {
            let url = format!("http://127.0.0.1:{}", 9000 + port);
            let endpoint = Endpoint::new(&url, None).unwrap();
            pool.add(WorkerSpec::new(WorkerRole::Regular, endpoint))
                .unwrap();
        }
        pool
    }

    /// Opens the breaker of worker `i` with one failure.
    fn fail(pool: &RolePool, i: usize) {
        let worker = Arc::clone(&pool.workers()[i]);
        let guard = worker.try_reserve().unwrap();
        guard.record_outcome(Outcome::from_status(503));
    }

    /// The workers a step lets the policy see.
    fn seen(pool: &RolePool) -> Vec<bool> {
        pool.refresh()
            .unwrap()
            .iter()
            .map(|w| w.is_available())
            .collect()
    }

    #[test]
    fn three_of_four_failing_leaves_the_healthy_one_alone_in_service() {
        let pool = pool(4, FleetGuard::default());
        for i in 0..3 {
            fail(&pool, i);
        }
        assert_eq!(seen(&pool), [false, false, false, true]);
        assert_eq!(pool.fleet_counts(), FleetCounts::default());
    }

    #[test]
    fn open_breakers_exclude_no_more_than_the_cap() {
        let fleet = FleetGuard {
            max_breaker_exclusion: 0.5,
            panic_threshold: 0.0,
            ..FleetGuard::default()
        };
        let pool = pool(4, fleet);
        for i in 0..3 {
            fail(&pool, i);
        }
        // Two may be excluded: the first refused one is let through.
        assert_eq!(seen(&pool), [true, false, false, true]);
        assert_eq!(pool.fleet_counts().capped_steps, 1);
        // Let through, it is reserved without its breaker's admission.
        let guard = pool.workers()[0].try_reserve().expect("let through");
        drop(guard);
    }

    #[test]
    fn below_the_panic_threshold_every_live_worker_is_seen() {
        let pool = pool(4, FleetGuard::default());
        for i in 0..4 {
            fail(&pool, i);
        }
        assert_eq!(
            seen(&pool),
            [true; 4],
            "their own answers beat a blanket 503"
        );
        assert_eq!(pool.fleet_counts().panic_steps, 1);
        // A draining worker is not live: panic does not bring it back.
        pool.workers()[3].start_drain();
        assert_eq!(seen(&pool), [true, true, true, false]);
    }

    #[test]
    fn a_single_failing_worker_is_excluded_as_vllm_router_excludes_it() {
        let pool = pool(1, FleetGuard::default());
        fail(&pool, 0);
        assert_eq!(seen(&pool), [false], "no panic mode in a pool of one");
        let workers = pool.workers();
        let eligible = pool.eligible(&workers, "", |_| true).unwrap();
        assert!(matches!(
            pool.require_available(&eligible),
            Err(SelectError::Unavailable(_))
        ));
        assert_eq!(pool.fleet_counts(), FleetCounts::default());
    }

    #[test]
    fn below_the_minimum_pool_size_every_exclusion_is_trusted() {
        let pool = pool(2, FleetGuard::default());
        fail(&pool, 0);
        fail(&pool, 1);
        assert_eq!(seen(&pool), [false, false]);
        assert_eq!(pool.fleet_counts(), FleetCounts::default());
        // From the minimum up, the panic threshold acts again.
        let pool = pool_of_three_all_failing();
        assert_eq!(seen(&pool), [true; 3]);
        assert_eq!(pool.fleet_counts().panic_steps, 1);
    }

    #[test]
    fn a_pool_that_shrinks_below_the_minimum_stops_letting_workers_through() {
        let pool = pool_of_three_all_failing();
        assert_eq!(seen(&pool), [true; 3]);
        // One leaves: the two left are a small pool, their breakers trusted.
        pool.workers()[2].start_drain();
        assert_eq!(seen(&pool), [false, false, false]);
    }

    fn pool_of_three_all_failing() -> RolePool {
        let pool = pool(3, FleetGuard::default());
        for i in 0..3 {
            fail(&pool, i);
        }
        pool
    }

    #[test]
    fn turned_off_every_exclusion_is_trusted() {
        let pool = pool(4, FleetGuard::off());
        for i in 0..4 {
            fail(&pool, i);
        }
        assert_eq!(seen(&pool), [false; 4]);
        let workers = pool.workers();
        let eligible = pool.eligible(&workers, "", |_| true).unwrap();
        assert!(matches!(
            pool.require_available(&eligible),
            Err(SelectError::Unavailable(_))
        ));
    }
}
