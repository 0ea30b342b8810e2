//! Random sequences of registrations, expiries and requests across both
//! P/D roles, at the selection level (no HTTP): after every step, each
//! worker's load equals the number of live guards on it, per role, and no
//! refused selection leaves anything behind.

#![cfg(feature = "pools")]

use lb_policies::{OwnedContext, RoutingInputBuf};
use pd_orchestrator::pools::{PdConfig, PdLease, PdPair, PdPools, PdScope};
use pd_orchestrator::{LegOutcome, PdBackend, PdConnector, Phase, PhaseGuard};
use proptest::prelude::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
use worker_lifecycle::{
    Endpoint, Registration, RoleKind, SelectError, ServiceRegistry, Worker, WorkerOptions, labels,
};

const TTL: Duration = Duration::from_secs(10);
const ENDPOINTS: usize = 3;

#[derive(Debug, Clone)]
enum Op {
    /// Register (or refresh) endpoint `index` of a role; a new `instance`
    /// is a restart at the same address.
    Register {
        prefill: bool,
        index: usize,
        instance: u8,
    },
    /// Deregister endpoint `index` of a role.
    Deregister { prefill: bool, index: usize },
    /// Let time pass (seconds): registrations not refreshed expire.
    Advance(u64),
    /// Select a pair and dispatch the prefill leg (and the decode leg too
    /// when the connector is concurrent).
    Start { prompt: u8 },
    /// The prefill leg of request `i` ends; a sequential decode leg is then
    /// dispatched.
    FinishPrefill(usize),
    /// Request `i`'s decode stream ends.
    FinishDecode(usize),
    /// Request `i` is dropped (client gone) at whatever point it is.
    Drop(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<bool>(), 0..ENDPOINTS, 0u8..2)
            .prop_map(|(prefill, index, instance)| Op::Register { prefill, index, instance }),
        1 => (any::<bool>(), 0..ENDPOINTS).prop_map(|(prefill, index)| Op::Deregister { prefill, index }),
        1 => (1u64..12).prop_map(Op::Advance),
        4 => (0u8..4).prop_map(|prompt| Op::Start { prompt }),
        2 => (0usize..8).prop_map(Op::FinishPrefill),
        2 => (0usize..8).prop_map(Op::FinishDecode),
        1 => (0usize..8).prop_map(Op::Drop),
    ]
}

/// One request in flight: its pair and the leases the flow would hold.
struct Live {
    pair: PdPair,
    prefill: Option<PdLease>,
    decode: Option<PdLease>,
}

struct Model {
    pools: Arc<PdPools>,
    prefill_registry: Arc<ServiceRegistry>,
    decode_registry: Arc<ServiceRegistry>,
    concurrent: bool,
    now: Instant,
    live: Vec<Live>,
    /// Every worker object ever handed out, old lifetimes included.
    seen: Vec<Arc<Worker>>,
}

impl Model {
    fn new(connector: PdConnector, policy: &str) -> Self {
        let prefill_registry = Arc::new(ServiceRegistry::new(RoleKind::Prefill, TTL));
        let decode_registry = Arc::new(ServiceRegistry::new(RoleKind::Decode, TTL));
        let mut config = PdConfig::new(connector);
        config.prefill_registry = Some(prefill_registry.clone());
        config.decode_registry = Some(decode_registry.clone());
        let pools = PdPools::new(
            &config,
            &lb_policies::PolicyConfig::named(policy),
            &WorkerOptions::default(),
        )
        .unwrap();
        Self {
            pools: Arc::new(pools),
            prefill_registry,
            decode_registry,
            concurrent: matches!(connector, PdConnector::MoriIo(_)),
            now: Instant::now(),
            live: Vec::new(),
            seen: Vec::new(),
        }
    }

    fn registry(&self, prefill: bool) -> &ServiceRegistry {
        if prefill {
            &self.prefill_registry
        } else {
            &self.decode_registry
        }
    }

    fn endpoint(index: usize) -> Endpoint {
        // The same URLs in both roles: separate workers all the same.
        Endpoint::new(&format!("http://10.0.0.{}:8000", index + 1), None).unwrap()
    }

    fn registration(instance: u8) -> Registration {
        let mut registration = Registration {
            instance_id: Some(format!("i{instance}")),
            ..Registration::default()
        };
        for (key, value) in [
            (labels::MORIIO_HANDSHAKE_PORT, "7001"),
            (labels::MORIIO_NOTIFY_PORT, "7002"),
        ] {
            registration.labels.insert(key.into(), value.into());
        }
        registration
    }

    fn note(&mut self, worker: &Arc<Worker>) {
        if !self.seen.iter().any(|w| Arc::ptr_eq(w, worker)) {
            self.seen.push(Arc::clone(worker));
        }
    }

    /// What the flow does when a leg succeeds: finish its lease (record,
    /// then release).
    fn record(lease: PdLease) {
        lease.finish(LegOutcome::Success, Some(http::StatusCode::OK));
    }

    fn reserve(&self, target: &pd_orchestrator::pools::PdTarget, phase: Phase) -> PdLease {
        self.pools
            .reserve(target, phase)
            .expect("an available worker admits")
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Register {
                prefill,
                index,
                instance,
            } => {
                let now = self.now;
                self.registry(prefill).register(
                    Self::endpoint(index),
                    Self::registration(instance),
                    now,
                );
            }
            Op::Deregister { prefill, index } => {
                self.registry(prefill).deregister(&Self::endpoint(index));
            }
            Op::Advance(seconds) => self.now += Duration::from_secs(seconds),
            Op::Start { prompt } => {
                let text = format!("prompt number {prompt} shares a prefix");
                let scope = Arc::new(PdScope::new(OwnedContext {
                    model: "m".into(),
                    routing: RoutingInputBuf::Text(text),
                    ..OwnedContext::default()
                }));
                let before = self.decision_count();
                match self.pools.select_pair_at(&scope, self.now) {
                    Ok(pair) => {
                        self.note(&pair.prefill.worker().clone());
                        self.note(&pair.decode.worker().clone());
                        assert_eq!(pair.prefill.worker().role().kind(), RoleKind::Prefill);
                        assert_eq!(pair.decode.worker().role().kind(), RoleKind::Decode);
                        // A choice holds no load: each phase is reserved
                        // when its leg is dispatched.
                        let loads = |pair: &PdPair| {
                            (pair.prefill.worker().load(), pair.decode.worker().load())
                        };
                        let before = loads(&pair);
                        let prefill = Some(self.reserve(&pair.prefill, Phase::Prefill));
                        assert_eq!(loads(&pair).0, before.0 + 1);
                        let decode = self
                            .concurrent
                            .then(|| self.reserve(&pair.decode, Phase::Decode));
                        self.live.push(Live {
                            pair,
                            prefill,
                            decode,
                        });
                    }
                    Err(SelectError::Unavailable(unavailable)) => {
                        let message = unavailable.to_string();
                        // A refusal asks no policy: no tree insertion.
                        assert_eq!(self.decision_count(), before, "{message}");
                        assert!(
                            message.contains("prefill") || message.contains("decode"),
                            "{message}"
                        );
                    }
                    Err(other) => panic!("unexpected error {other:?}"),
                }
            }
            Op::FinishPrefill(i) => {
                let Some(index) = self.index(i) else { return };
                let live = &mut self.live[index];
                if let Some(lease) = live.prefill.take() {
                    let dispatch_decode = live.decode.is_none() && !self.concurrent;
                    Self::record(lease);
                    if dispatch_decode {
                        let target = &self.live[index].pair.decode;
                        match self.pools.reserve(target, Phase::Decode) {
                            Ok(decode) => self.live[index].decode = Some(decode),
                            // The decode worker left while the prefill ran:
                            // its breaker-aware reservation is refused, and
                            // the flow fails the request (nothing counted).
                            Err(_) => {
                                assert!(!target.worker().is_available());
                                self.live.remove(index);
                            }
                        }
                    }
                }
            }
            Op::FinishDecode(i) => {
                let Some(index) = self.index(i) else { return };
                if let Some(lease) = self.live[index].decode.take() {
                    Self::record(lease);
                    let live = self.live.remove(index);
                    if let Some(prefill) = live.prefill {
                        Self::record(prefill);
                    }
                }
            }
            Op::Drop(i) => {
                let Some(index) = self.index(i) else { return };
                let live = self.live.remove(index);
                for lease in [live.prefill, live.decode].into_iter().flatten() {
                    lease.finish(LegOutcome::Cancelled, None);
                }
            }
        }
    }

    fn index(&self, i: usize) -> Option<usize> {
        (!self.live.is_empty()).then(|| i % self.live.len())
    }

    fn decision_count(&self) -> u64 {
        [self.pools.prefill(), self.pools.decode()]
            .iter()
            .flat_map(|role| role.policies().counts())
            .map(|(_, _, counts)| counts.total())
            .sum()
    }

    /// Each worker's load is the number of live guards on it; per role,
    /// the loads add up to the live guards of that role.
    fn check(&self) {
        let live_on = |worker: &Arc<Worker>| {
            self.live
                .iter()
                .flat_map(|l| [l.prefill.as_ref(), l.decode.as_ref()])
                .flatten()
                .filter(|lease| Arc::ptr_eq(lease.worker(), worker))
                .count()
        };
        for worker in &self.seen {
            assert_eq!(worker.load(), live_on(worker), "{}", worker.key());
            assert_eq!(worker.underflows(), 0, "{}", worker.key());
        }
        for (role, phase_guards) in [
            (
                RoleKind::Prefill,
                self.live.iter().filter(|l| l.prefill.is_some()).count(),
            ),
            (
                RoleKind::Decode,
                self.live.iter().filter(|l| l.decode.is_some()).count(),
            ),
        ] {
            let load: usize = self
                .seen
                .iter()
                .filter(|w| w.role().kind() == role)
                .map(|w| w.load())
                .sum();
            assert_eq!(load, phase_guards, "{role} load");
        }
    }
}

fn run(connector: PdConnector, policy: &str, ops: Vec<Op>) {
    let mut model = Model::new(connector, policy);
    for op in ops {
        model.apply(op);
        model.check();
    }
    // Everything ends: every load returns to 0.
    for i in (0..model.live.len()).rev() {
        model.apply(Op::Drop(i));
    }
    model.check();
    for worker in &model.seen {
        assert_eq!(worker.load(), 0);
    }
}

/// One walk through, with every step's loads spelled out.
#[test]
fn a_sequential_request_moves_load_from_prefill_to_decode() {
    let mut model = Model::new(PdConnector::Nixl, "cache_aware");
    model.apply(Op::Start { prompt: 0 });
    assert!(model.live.is_empty(), "no workers yet: refused");
    assert_eq!(model.pools.decode().unavailable_count(), 0);
    assert_eq!(model.pools.prefill().unavailable_count(), 1);
    for prefill in [true, false] {
        model.apply(Op::Register {
            prefill,
            index: 0,
            instance: 0,
        });
    }
    model.apply(Op::Start { prompt: 1 });
    assert_eq!(model.live.len(), 1);
    let (prefill, decode) = {
        let pair = &model.live[0].pair;
        (pair.prefill.worker().clone(), pair.decode.worker().clone())
    };
    assert_eq!(prefill.url(), decode.url(), "same URL, two workers");
    assert_eq!((prefill.load(), decode.load()), (1, 0));
    model.apply(Op::FinishPrefill(0));
    assert_eq!((prefill.load(), decode.load()), (0, 1));
    model.apply(Op::FinishDecode(0));
    assert_eq!((prefill.load(), decode.load()), (0, 0));
    assert_eq!((prefill.processed(), decode.processed()), (1, 1));

    // The decode registration expires: refused, naming decode, and the
    // prefill worker is left untouched.
    model.apply(Op::Advance(5));
    model.apply(Op::Register {
        prefill: true,
        index: 0,
        instance: 0,
    });
    model.apply(Op::Advance(6));
    model.apply(Op::Start { prompt: 1 });
    assert!(model.live.is_empty());
    assert_eq!(model.pools.decode().unavailable_count(), 1);
    assert_eq!(prefill.processed(), 1);
    model.check();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn sequential_loads_equal_live_guards(
        ops in proptest::collection::vec(op(), 1..60),
        cache_aware in any::<bool>(),
    ) {
        let policy = if cache_aware { "cache_aware" } else { "round_robin" };
        run(PdConnector::Nixl, policy, ops);
    }

    #[test]
    fn concurrent_loads_equal_live_guards(
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        run(PdConnector::MoriIo(pd_orchestrator::MoriIoMode::Write), "least_loaded", ops);
    }
}
