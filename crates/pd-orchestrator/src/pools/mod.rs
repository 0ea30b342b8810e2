//! Prefill/decode pools of worker-lifecycle workers: pair selection, the
//! flow's backend, and the whole-request retry loop (feature `pools`, on by
//! default).
//!
//! [`PdPools`] keeps one [`PdRolePool`] per role, each a
//! [`RolePool`](worker_lifecycle::RolePool) (a static set or a discovered
//! pool, its policy registry, membership forwarding) plus the flow's
//! [`PdEndpoint`](crate::PdEndpoint) of each worker — from the static configuration, or from
//! the registration labels of [`worker_lifecycle::labels`]. A prefill and a
//! decode worker at the same URL are two workers with two loads
//! (invariant 2 of docs/architecture.md).
//!
//! # Pair selection
//!
//! [`PdPools::select_pair`] runs both roles' serialized steps nested
//! (prefill, then decode — always that order, so two requests cannot
//! deadlock): each step reads its registry, reconciles, and forwards the
//! membership events to that role's policies. Only when both roles are
//! reconciled does it decide: if either role has no available candidate the
//! answer is [`SelectError::Unavailable`] naming the role, decided *before*
//! either policy is asked (a cache-aware policy inserts the prompt into its
//! tree when it selects), so a refused request leaves no tree entry and no
//! load behind (invariant 13). Then each policy chooses.
//!
//! With NIXL and sequential Mooncake ([`PdPools::late_decode`]) a request
//! starts with [`PdPools::select_prefill`], which checks both roles the
//! same way but chooses only the prefill worker: the decode worker is
//! chosen when the prefill has completed, by the decode policy inside the
//! decode pool's step ([`PdBackend::select_decode`]), so a load-aware
//! decode policy sees every decode leg already running and decode load is
//! not counted during a long prefill (invariant 9). MoRI-IO READ is
//! sequential too, but its prefill leg names the decode engine, so its
//! decode worker is chosen at arrival.
//!
//! # Load and outcomes
//!
//! A choice holds no load. The flow reserves each phase when it dispatches
//! its leg, through [`PdBackend::reserve`]: the worker's breaker admits it
//! ([`Worker::try_reserve`]) or the reservation is refused and the worker
//! treated as failed. The reservation is a [`PdLease`], which records the
//! leg's outcome to the worker's breaker and to [`PdMetrics`], and then
//! releases the load, exactly once.
//!
//! # Retries
//!
//! A failed prefill leg is replaced by a fresh prefill choice that leaves
//! out every prefill worker that failed this request. A failed flow names
//! its worker ([`PdError::failed_worker`](crate::PdError::failed_worker)); [`run`] leaves it out and, within
//! the request's [`RequestRetries`](worker_lifecycle::RequestRetries),
//! selects a fresh pair and runs the whole request again.
//! [`run_observed`] is the same loop telling a [`RunObserver`] each
//! attempt's selection (every [`PdTarget`] carries its [`PdDecision`]:
//! why its policy chose it, the match, among how many) and each retry.
//!
//! ```
//! use std::sync::Arc;
//! use lb_policies::{OwnedContext, PolicyConfig, RoutingInputBuf};
//! use pd_orchestrator::pools::{PdConfig, PdPools, PdScope, PdWorkerConfig};
//! use pd_orchestrator::{PdConnector, PdWorker};
//! use worker_lifecycle::WorkerOptions;
//!
//! let mut config = PdConfig::new(PdConnector::Nixl);
//! config.prefill = vec![PdWorkerConfig::new("http://10.0.0.1:8000")];
//! config.decode = vec![PdWorkerConfig::new("http://10.0.0.1:8000")];
//! let policy = PolicyConfig::named("cache_aware");
//! let pools = PdPools::new(&config, &policy, &WorkerOptions::default()).unwrap();
//! assert!(pools.late_decode(), "NIXL chooses its decode worker late");
//!
//! let scope = Arc::new(PdScope::new(OwnedContext {
//!     routing: RoutingInputBuf::Text("You are a helpful assistant.".into()),
//!     ..OwnedContext::default()
//! }));
//! let pair = pools.select_pair(&scope).unwrap();
//! assert_eq!(pair.prefill.endpoint().base_url(), pair.decode.endpoint().base_url());
//! assert_ne!(pair.prefill.worker().key(), pair.decode.worker().key(), "two workers");
//! assert_eq!(pair.prefill.worker().load(), 0, "load is reserved at dispatch");
//! ```

mod config;
mod role;
mod run;
mod scope;

pub use config::{PdConfig, PdWorkerConfig, PoolsError};
pub use role::{LearnHook, PdRolePool, StaticWorker};
pub use run::{PdCall, RunError, RunObserver, Selected, flow_request_id, run, run_observed};

pub use scope::{PdDecision, PdPair, PdScope, PdTarget};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use http::StatusCode;
use lb_policies::PolicyConfig;
use worker_lifecycle::{
    Eligible, LoadGuard, Outcome, RoleKind, SelectError, Worker, WorkerOptions,
};

use crate::connector::{PdConnector, PhaseOrder};
use crate::flow::{LegOutcome, PdBackend, Phase, PhaseGuard, Refused};

/// The outcome names of [`PdMetrics::outcomes`], in counter order.
pub const LEG_OUTCOMES: [&str; 5] = [
    "success",
    "worker_failure",
    "client_error",
    "cancelled",
    "not_sent",
];

/// Per-phase leg outcomes of the P/D path.
#[derive(Debug, Default)]
pub struct PdMetrics {
    /// `[phase][outcome]`, phase 0 prefill, 1 decode.
    outcomes: [[AtomicU64; LEG_OUTCOMES.len()]; 2],
}

impl PdMetrics {
    fn record(&self, phase: Phase, outcome: LegOutcome) {
        let slot = match outcome {
            LegOutcome::Success => 0,
            LegOutcome::WorkerFailure => 1,
            LegOutcome::ClientError => 2,
            LegOutcome::NotSent => 4,
            _ => 3,
        };
        self.outcomes[phase_index(phase)][slot].fetch_add(1, Ordering::Relaxed);
    }

    /// Legs of `phase` that ended with `outcome` (one of [`LEG_OUTCOMES`]).
    pub fn outcomes(&self, phase: Phase, outcome: &str) -> u64 {
        LEG_OUTCOMES
            .iter()
            .position(|o| *o == outcome)
            .map_or(0, |slot| {
                self.outcomes[phase_index(phase)][slot].load(Ordering::Relaxed)
            })
    }
}

fn phase_index(phase: Phase) -> usize {
    match phase {
        Phase::Prefill => 0,
        Phase::Decode => 1,
    }
}

/// One phase's reservation on a worker: records the leg's outcome to the
/// worker's breaker and the metrics, then releases the load.
#[derive(Debug)]
pub struct PdLease {
    guard: LoadGuard,
    phase: Phase,
    metrics: Arc<PdMetrics>,
}

impl PdLease {
    /// The worker whose load this lease counts.
    pub fn worker(&self) -> &Arc<Worker> {
        self.guard.worker()
    }
}

impl PhaseGuard for PdLease {
    fn finish(self, outcome: LegOutcome, status: Option<StatusCode>) {
        self.metrics.record(self.phase, outcome);
        self.guard.record_outcome(breaker_outcome(outcome, status));
        // Dropping the guard, after the outcome, releases the load.
    }
}

/// The breaker outcome of a leg (docs/pd.md, "Wiring it into a router").
pub fn breaker_outcome(outcome: LegOutcome, status: Option<StatusCode>) -> Outcome {
    match (outcome, status) {
        (LegOutcome::Success, _) => Outcome::Success,
        (LegOutcome::WorkerFailure, Some(status)) if status.is_success() => {
            Outcome::ConnectionReset
        }
        (LegOutcome::WorkerFailure, Some(status)) => Outcome::from_status(status.as_u16()),
        (LegOutcome::WorkerFailure, None) => Outcome::ConnectError,
        (LegOutcome::ClientError, Some(status)) => Outcome::ClientError(status.as_u16()),
        (LegOutcome::ClientError, None) => Outcome::ClientError(400),
        (LegOutcome::NotSent, _) => Outcome::RouterRejected,
        _ => Outcome::ClientCancelled,
    }
}

/// Both roles' pools and policies: pair selection, and the flow's backend.
#[derive(Debug)]
pub struct PdPools {
    prefill: PdRolePool,
    decode: PdRolePool,
    connector: PdConnector,
    concurrent: bool,
    late_decode: bool,
    metrics: Arc<PdMetrics>,
}

impl PdPools {
    /// Builds both roles from `config`: static workers are added at once,
    /// discovered ones appear at the first step that reconciles them. The
    /// role policies default to `default_policy`.
    ///
    /// # Errors
    /// [`PoolsError`] naming the role or the worker that is refused.
    pub fn new(
        config: &PdConfig,
        default_policy: &PolicyConfig,
        options: &WorkerOptions,
    ) -> Result<Self, PoolsError> {
        let connector = config.connector;
        let role = |role, statics: &[PdWorkerConfig], registry: &Option<_>, policy: &Option<_>| {
            PdRolePool::new(
                role,
                connector,
                statics,
                registry.clone(),
                Option::clone(policy).unwrap_or_else(|| default_policy.clone()),
                options,
            )
        };
        let prefill = role(
            RoleKind::Prefill,
            &config.prefill,
            &config.prefill_registry,
            &config.prefill_policy,
        )?;
        let decode = role(
            RoleKind::Decode,
            &config.decode,
            &config.decode_registry,
            &config.decode_policy,
        )?;
        let kv = connector.build();
        let concurrent = kv.phase_order() == PhaseOrder::Concurrent;
        Ok(Self {
            prefill,
            decode,
            connector,
            concurrent,
            late_decode: !concurrent && !kv.prefill_names_decode(),
            metrics: Arc::default(),
        })
    }

    /// The prefill role.
    pub fn prefill(&self) -> &PdRolePool {
        &self.prefill
    }

    /// The decode role.
    pub fn decode(&self) -> &PdRolePool {
        &self.decode
    }

    /// The role of `kind` (prefill or decode).
    pub fn role(&self, kind: RoleKind) -> &PdRolePool {
        match kind {
            RoleKind::Prefill => &self.prefill,
            _ => &self.decode,
        }
    }

    /// The connector.
    pub fn connector(&self) -> PdConnector {
        self.connector
    }

    /// Whether the connector dispatches both legs at once.
    pub fn concurrent(&self) -> bool {
        self.concurrent
    }

    /// The per-phase leg outcomes.
    pub fn metrics(&self) -> &PdMetrics {
        &self.metrics
    }

    /// Whether the decode worker is chosen late, at decode dispatch (NIXL
    /// and sequential Mooncake): requests then start with
    /// [`select_prefill`](Self::select_prefill) and the flow's
    /// `run_late_decode`.
    pub fn late_decode(&self) -> bool {
        self.late_decode
    }

    /// Chooses a (prefill, decode) pair for `scope`; see the module docs.
    ///
    /// # Errors
    /// [`SelectError::Unavailable`] naming the role when a role has no
    /// available candidate — decided after both roles were reconciled and
    /// before either policy was asked, so nothing is left behind;
    /// [`SelectError::UnknownModel`] when no worker of a role serves the
    /// model.
    pub fn select_pair(&self, scope: &Arc<PdScope>) -> Result<PdPair, SelectError> {
        self.select_pair_at(scope, Instant::now())
    }

    /// [`select_pair`](Self::select_pair) with the registries read at `now`
    /// (entries whose time-to-live ended by then are expired).
    ///
    /// # Errors
    /// As [`select_pair`](Self::select_pair).
    pub fn select_pair_at(
        &self,
        scope: &Arc<PdScope>,
        now: Instant,
    ) -> Result<PdPair, SelectError> {
        self.both_steps(now, scope, |prefill, decode| {
            Ok(PdPair {
                prefill: self.choose(&self.prefill, prefill, scope)?,
                decode: self.choose(&self.decode, decode, scope)?,
            })
        })
    }

    /// Chooses only the prefill worker of a request whose decode worker is
    /// chosen late ([`late_decode`](Self::late_decode)). Both roles are
    /// still reconciled and checked exactly as in
    /// [`select_pair`](Self::select_pair), so a request that could not get
    /// a decode worker now is refused before any state is left behind.
    ///
    /// # Errors
    /// As [`select_pair`](Self::select_pair).
    pub fn select_prefill(&self, scope: &Arc<PdScope>) -> Result<PdTarget, SelectError> {
        self.select_prefill_at(scope, Instant::now())
    }

    /// [`select_prefill`](Self::select_prefill) with the registries read at
    /// `now`.
    ///
    /// # Errors
    /// As [`select_pair`](Self::select_pair).
    pub fn select_prefill_at(
        &self,
        scope: &Arc<PdScope>,
        now: Instant,
    ) -> Result<PdTarget, SelectError> {
        self.both_steps(now, scope, |prefill, _| {
            self.choose(&self.prefill, prefill, scope)
        })
    }

    /// Runs `choose` inside both roles' steps (prefill outside, always in
    /// that order) on each role's eligible workers, once both roles are
    /// known to have an available one.
    fn both_steps<R>(
        &self,
        now: Instant,
        scope: &PdScope,
        choose: impl FnOnce(&Eligible<'_>, &Eligible<'_>) -> Result<R, SelectError>,
    ) -> Result<R, SelectError> {
        self.prefill
            .pool()
            .step(now, |prefill_workers| {
                self.decode.pool().step(now, |decode_workers| {
                    let prefill = self.prefill.eligible(prefill_workers, scope)?;
                    let decode = self.decode.eligible(decode_workers, scope)?;
                    self.prefill.pool().require_available(&prefill)?;
                    self.decode.pool().require_available(&decode)?;
                    choose(&prefill, &decode)
                })
            })
            .and_then(|inner| inner)
            .and_then(|inner| inner)
    }

    /// The policy's choice among `eligible` in `role`, with its endpoint.
    fn choose(
        &self,
        role: &PdRolePool,
        eligible: &Eligible<'_>,
        scope: &Arc<PdScope>,
    ) -> Result<PdTarget, SelectError> {
        let choice = role.pool().choose(eligible, &scope.request().context())?;
        // Only a worker the connector refused has no endpoint, and the
        // eligibility filter already left those out: a 503 if it happens,
        // never the client's fault.
        let endpoint = role
            .endpoint(&choice.worker)
            .ok_or_else(|| SelectError::Pool {
                role: role.role(),
                reason: format!(
                    "{} cannot be addressed by the {} connector",
                    choice.worker.key(),
                    self.connector
                ),
            })?;
        let decision = PdDecision {
            reason: choice.reason,
            match_permille: choice.match_permille,
            matched: choice.matched,
            candidates: eligible.workers().len(),
        };
        Ok(PdTarget::new(choice.worker, endpoint, scope, decision))
    }

    /// The decode worker of a late decode choice, chosen by the decode
    /// policy inside the decode pool's serialized step.
    fn select_decode_at(
        &self,
        scope: &Arc<PdScope>,
        now: Instant,
    ) -> Result<PdTarget, SelectError> {
        self.decode
            .pool()
            .step(now, |workers| {
                let eligible = self.decode.eligible(workers, scope)?;
                self.decode.pool().require_available(&eligible)?;
                self.choose(&self.decode, &eligible, scope)
            })
            .and_then(|inner| inner)
    }

    /// Every worker of both roles (prefill first), as last reconciled.
    pub fn workers(&self) -> Vec<Arc<Worker>> {
        let mut all: Vec<Arc<Worker>> = self.prefill.workers().iter().cloned().collect();
        all.extend(self.decode.workers().iter().cloned());
        all
    }

    /// Whether each role has an available worker (after reconciling).
    pub fn is_ready(&self) -> bool {
        let available = |role: &PdRolePool| {
            role.pool()
                .refresh()
                .is_ok_and(|workers| workers.iter().any(|w| w.is_available()))
        };
        available(&self.prefill) && available(&self.decode)
    }
}

impl PdBackend for PdPools {
    type Worker = PdTarget;
    type Guard = PdLease;

    fn reserve(&self, target: &PdTarget, phase: Phase) -> Result<PdLease, Refused> {
        let guard = target
            .worker()
            .try_reserve()
            .map_err(|why| Refused(format!("{}: {why}", target.worker().key())))?;
        Ok(PdLease {
            guard,
            phase,
            metrics: Arc::clone(&self.metrics),
        })
    }

    fn reselect_prefill(&self, failed: &PdTarget, _attempt: u32) -> Option<PdTarget> {
        let scope = failed.scope();
        scope.exclude(RoleKind::Prefill, failed.worker().key());
        self.prefill
            .pool()
            .step(Instant::now(), |workers| {
                let eligible = self.prefill.eligible(workers, scope).ok()?;
                if !eligible.any_available() {
                    return None;
                }
                self.choose(&self.prefill, &eligible, scope).ok()
            })
            .ok()
            .flatten()
    }

    fn select_decode(&self, prefill: &PdTarget) -> Option<PdTarget> {
        let scope = prefill.scope();
        match self.select_decode_at(scope, Instant::now()) {
            Ok(decode) => {
                scope.set_late_decode(*decode.decision());
                Some(decode)
            }
            Err(err) => {
                tracing::warn!(
                    request_id = scope.request().request_id.as_deref().unwrap_or(""),
                    %err,
                    "no decode worker at decode dispatch"
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::role::discovered_endpoint;
    use super::*;
    use worker_lifecycle::{Endpoint, WorkerRole, WorkerSpec, labels};

    #[test]
    fn leg_outcomes_map_to_breaker_outcomes() {
        let ok = Some(StatusCode::OK);
        assert_eq!(breaker_outcome(LegOutcome::Success, ok), Outcome::Success);
        assert!(breaker_outcome(LegOutcome::WorkerFailure, ok).is_worker_failure());
        assert!(breaker_outcome(LegOutcome::WorkerFailure, None).is_worker_failure());
        assert_eq!(
            breaker_outcome(LegOutcome::WorkerFailure, Some(StatusCode::BAD_GATEWAY)),
            Outcome::ServerError(502)
        );
        assert!(!breaker_outcome(LegOutcome::ClientError, None).is_worker_failure());
        assert!(!breaker_outcome(LegOutcome::Cancelled, None).is_worker_failure());
    }

    fn labelled(role: WorkerRole, pairs: &[(&str, &str)]) -> Arc<Worker> {
        let mut spec = WorkerSpec::new(role, Endpoint::new("http://10.0.0.9:8000", None).unwrap());
        for (key, value) in pairs {
            spec = spec.with_label(*key, *value);
        }
        Worker::new(spec, 1, &WorkerOptions::default())
    }

    #[test]
    fn discovered_endpoints_come_from_registration_labels() {
        let ports = [
            (labels::MORIIO_HANDSHAKE_PORT, "7001"),
            (labels::MORIIO_NOTIFY_PORT, "7002"),
            (labels::DP_SIZE, "2"),
            (labels::KV_ADDR, "10.0.0.9:5555"),
        ];
        let read = PdConnector::MoriIo(crate::MoriIoMode::Read);
        let worker = labelled(WorkerRole::Decode, &ports);
        let endpoint = discovered_endpoint(&worker, read).unwrap();
        let moriio = endpoint.moriio().unwrap();
        assert_eq!((moriio.handshake_port, moriio.notify_port), (7001, 7002));
        assert_eq!((moriio.dp_size, moriio.tp_size), (2, 1));
        assert_eq!(endpoint.kv_addr(), "10.0.0.9:5555");

        // A registration in the other MoRI-IO mode is refused.
        let mut write = ports.to_vec();
        write.push((labels::MORIIO_MODE, "write"));
        assert!(discovered_endpoint(&labelled(WorkerRole::Decode, &write), read).is_none());
        let mut same = ports.to_vec();
        same.push((labels::MORIIO_MODE, "read"));
        assert!(discovered_endpoint(&labelled(WorkerRole::Decode, &same), read).is_some());

        // Mooncake engine ids announced by the listener.
        let prefill = labelled(
            WorkerRole::Prefill {
                bootstrap_port: Some(9000),
            },
            &[
                (labels::MOONCAKE_ENGINE_ID, "e0"),
                ("mooncake_engine_id.1", "e1"),
            ],
        );
        let endpoint =
            discovered_endpoint(&prefill, PdConnector::Mooncake { concurrent: true }).unwrap();
        let mooncake = endpoint.mooncake().unwrap();
        assert_eq!(mooncake.bootstrap_addr, "http://10.0.0.9:9000");
        assert_eq!(mooncake.engine_id(Some(1)), Some("e1"));
        assert_eq!(mooncake.engine_id(None), Some("e0"));
    }

    #[test]
    fn a_lease_records_its_outcome_to_the_breaker_and_the_metrics_then_releases() {
        let mut config = PdConfig::new(PdConnector::Nixl);
        config.prefill = vec![PdWorkerConfig::new("http://10.0.0.1:8000")];
        config.decode = vec![PdWorkerConfig::new("http://10.0.0.2:8000")];
        let policy = PolicyConfig::named("round_robin");
        let mut options = WorkerOptions::default();
        options.breaker.failure_threshold = 1;
        let pools = PdPools::new(&config, &policy, &options).unwrap();
        let scope = Arc::new(PdScope::new(lb_policies::OwnedContext::default()));
        let pair = pools.select_pair(&scope).unwrap();
        let lease = pools.reserve(&pair.decode, Phase::Decode).unwrap();
        assert_eq!(pair.decode.worker().load(), 1);
        lease.finish(LegOutcome::WorkerFailure, Some(StatusCode::BAD_GATEWAY));
        assert_eq!(pair.decode.worker().load(), 0);
        assert_eq!(pools.metrics().outcomes(Phase::Decode, "worker_failure"), 1);
        assert_eq!(
            pair.decode.worker().breaker().state(),
            worker_lifecycle::BreakerState::Open,
            "the 502 reached the breaker"
        );
    }
}
