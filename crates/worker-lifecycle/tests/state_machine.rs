//! A proptest state machine over two roles' registries and pools plus load
//! guards, checked against a plain reference model after every step:
//! per generation, load equals the live reservations; a replaced
//! generation's guards never change the new worker; membership events match
//! the model; prefill and decode stay independent even at the same URLs.
#![cfg(not(loom))]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use worker_lifecycle::{
    DiscoveryPool, Endpoint, Lifecycle, LoadGuard, MembershipEvent, Registration, RoleKind,
    ServiceRegistry, Worker, WorkerOptions,
};

const TTL_SECS: u64 = 10;
const URLS: [&str; 3] = ["http://a:1", "http://b:1", "http://c:1"];
const ROLES: [RoleKind; 2] = [RoleKind::Prefill, RoleKind::Decode];

#[derive(Debug, Clone)]
enum Step {
    Register { role: usize, url: usize },
    Restart { role: usize, url: usize },
    Heartbeat { role: usize, url: usize },
    Advance { secs: u64 },
    Sweep { role: usize },
    Reconcile { role: usize },
    Reserve { role: usize, url: usize },
    Share { handle: usize },
    DropHandle { handle: usize },
    Release { handle: usize },
}

/// (kind, url, old generation, new generation) — kind 'A'dded, 'R'emoved, re'P'laced.
type EventSig = (char, usize, u64, u64);

#[derive(Debug, Clone, Copy)]
struct Entry {
    generation: u64,
    expires: u64,
    instance: u32,
}

#[derive(Debug, Clone)]
struct Reservation {
    role: usize,
    url: usize,
    generation: u64,
    handles: usize,
    released: bool,
}

#[derive(Debug, Clone, Default)]
struct Model {
    now: u64,
    registries: [BTreeMap<usize, Entry>; 2],
    next_generation: [u64; 2],
    instances: [[u32; 3]; 2],
    pools: [BTreeMap<usize, u64>; 2],
    /// Handle index → reservation index.
    handles: Vec<usize>,
    reservations: Vec<Reservation>,
    last_events: Vec<EventSig>,
    last_heartbeat_ok: bool,
    last_reserved: Option<(usize, usize, u64)>,
}

impl Model {
    fn live(&self, role: usize) -> BTreeMap<usize, u64> {
        self.registries[role]
            .iter()
            .filter(|(_, e)| self.now < e.expires)
            .map(|(&u, e)| (u, e.generation))
            .collect()
    }

    fn reconcile(&mut self, role: usize) {
        let live = self.live(role);
        let mut events = Vec::new();
        for (&url, &generation) in &live {
            match self.pools[role].get(&url) {
                Some(&old) if old == generation => {}
                Some(&old) => events.push(('P', url, old, generation)),
                None => events.push(('A', url, 0, generation)),
            }
        }
        for (&url, &old) in &self.pools[role] {
            if !live.contains_key(&url) {
                events.push(('R', url, old, 0));
            }
        }
        self.pools[role] = live;
        self.last_events = events;
    }

    fn register(&mut self, role: usize, url: usize) {
        let now = self.now;
        let instance = self.instances[role][url];
        match self.registries[role].get_mut(&url) {
            Some(e) if now < e.expires && e.instance == instance => e.expires = now + TTL_SECS,
            _ => {
                self.next_generation[role] += 1;
                let generation = self.next_generation[role];
                self.registries[role].insert(
                    url,
                    Entry {
                        generation,
                        expires: now + TTL_SECS,
                        instance,
                    },
                );
            }
        }
    }
}

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = Step;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::default()).boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Step> {
        let role = 0..2usize;
        let url = 0..3usize;
        let base = prop_oneof![
            4 => (role.clone(), url.clone()).prop_map(|(role, url)| Step::Register { role, url }),
            1 => (role.clone(), url.clone()).prop_map(|(role, url)| Step::Restart { role, url }),
            3 => (role.clone(), url.clone()).prop_map(|(role, url)| Step::Heartbeat { role, url }),
            2 => (1..=12u64).prop_map(|secs| Step::Advance { secs }),
            1 => role.clone().prop_map(|role| Step::Sweep { role }),
            2 => role.clone().prop_map(|role| Step::Reconcile { role }),
            5 => (role, url).prop_map(|(role, url)| Step::Reserve { role, url }),
        ];
        if state.handles.is_empty() {
            return base.boxed();
        }
        let n = state.handles.len();
        prop_oneof![
            6 => base,
            1 => (0..n).prop_map(|handle| Step::Share { handle }),
            2 => (0..n).prop_map(|handle| Step::DropHandle { handle }),
            1 => (0..n).prop_map(|handle| Step::Release { handle }),
        ]
        .boxed()
    }

    fn preconditions(state: &Model, step: &Step) -> bool {
        match step {
            Step::Share { handle } | Step::DropHandle { handle } | Step::Release { handle } => {
                *handle < state.handles.len()
            }
            _ => true,
        }
    }

    fn apply(mut state: Model, step: &Step) -> Model {
        state.last_events.clear();
        state.last_reserved = None;
        match *step {
            Step::Register { role, url } => state.register(role, url),
            Step::Restart { role, url } => {
                state.instances[role][url] += 1;
                state.register(role, url);
            }
            Step::Heartbeat { role, url } => {
                let now = state.now;
                state.last_heartbeat_ok = match state.registries[role].get_mut(&url) {
                    Some(e) if now < e.expires => {
                        e.expires = now + TTL_SECS;
                        true
                    }
                    _ => false,
                };
            }
            Step::Advance { secs } => state.now += secs,
            Step::Sweep { role } => {
                let now = state.now;
                state.registries[role].retain(|_, e| now < e.expires);
            }
            Step::Reconcile { role } => state.reconcile(role),
            Step::Reserve { role, url } => {
                state.reconcile(role);
                if let Some(&generation) = state.pools[role].get(&url) {
                    state.reservations.push(Reservation {
                        role,
                        url,
                        generation,
                        handles: 1,
                        released: false,
                    });
                    state.handles.push(state.reservations.len() - 1);
                    state.last_reserved = Some((role, url, generation));
                }
            }
            Step::Share { handle } => {
                let r = state.handles[handle];
                state.reservations[r].handles += 1;
                state.handles.push(r);
            }
            Step::DropHandle { handle } => {
                let r = state.handles.remove(handle);
                let res = &mut state.reservations[r];
                res.handles -= 1;
                if res.handles == 0 {
                    res.released = true;
                }
            }
            Step::Release { handle } => {
                let r = state.handles[handle];
                state.reservations[r].released = true;
            }
        }
        state
    }
}

struct System {
    start: Instant,
    registries: [ServiceRegistry; 2],
    pools: [DiscoveryPool; 2],
    handles: Vec<LoadGuard>,
    /// Every worker object ever seen, by (role, url, generation).
    seen: HashMap<(usize, usize, u64), Arc<Worker>>,
}

impl System {
    fn now(&self, model: &Model) -> Instant {
        self.start + Duration::from_secs(model.now)
    }

    fn note(&mut self, role: usize, events: &[MembershipEvent]) -> Vec<EventSig> {
        let url_of = |w: &Worker| URLS.iter().position(|u| *u == w.url()).unwrap();
        let mut sigs = Vec::new();
        for e in events {
            if let Some(w) = e.added() {
                assert_eq!(w.role().kind(), ROLES[role]);
                let previous = self
                    .seen
                    .insert((role, url_of(w), w.generation()), w.clone());
                assert!(
                    previous.is_none(),
                    "a generation gets exactly one worker object"
                );
            }
            sigs.push(match e {
                MembershipEvent::Added(w) => ('A', url_of(w), 0, w.generation()),
                MembershipEvent::Removed(w) => ('R', url_of(w), w.generation(), 0),
                MembershipEvent::Replaced { old, new } => {
                    assert_eq!(url_of(old), url_of(new));
                    ('P', url_of(new), old.generation(), new.generation())
                }
            });
        }
        sigs.sort();
        sigs
    }
}

fn registration(instance: u32) -> Registration {
    Registration {
        instance_id: Some(format!("instance-{instance}")),
        ..Registration::default()
    }
}

fn endpoint(url: usize) -> Endpoint {
    Endpoint::new(URLS[url], None).unwrap()
}

struct Machine;

impl StateMachineTest for Machine {
    type SystemUnderTest = System;
    type Reference = Reference;

    fn init_test(_: &Model) -> System {
        let ttl = Duration::from_secs(TTL_SECS);
        System {
            start: Instant::now(),
            registries: ROLES.map(|r| ServiceRegistry::new(r, ttl)),
            pools: ROLES.map(|r| DiscoveryPool::new(r, WorkerOptions::default()).unwrap()),
            handles: Vec::new(),
            seen: HashMap::new(),
        }
    }

    fn apply(mut sut: System, model: &Model, step: Step) -> System {
        let now = sut.now(model);
        match step {
            Step::Register { role, url } | Step::Restart { role, url } => {
                let instance = model.instances[role][url];
                let out = sut.registries[role].register(endpoint(url), registration(instance), now);
                assert_eq!(out.generation, model.registries[role][&url].generation);
            }
            Step::Heartbeat { role, url } => {
                let result = sut.registries[role].heartbeat(&endpoint(url), None, now);
                assert_eq!(result.is_ok(), model.last_heartbeat_ok);
            }
            Step::Advance { .. } => {}
            Step::Sweep { role } => {
                sut.registries[role].sweep(now);
                assert_eq!(sut.registries[role].len(), model.registries[role].len());
            }
            Step::Reconcile { role } => {
                let events = sut.pools[role]
                    .with_reconciled(&sut.registries[role], now, |v| v.events().to_vec())
                    .unwrap();
                let sigs = sut.note(role, &events);
                let mut expected = model.last_events.clone();
                expected.sort();
                assert_eq!(sigs, expected, "membership events match the model");
            }
            Step::Reserve { role, url } => {
                let target = endpoint(url);
                let (events, guard) = sut.pools[role]
                    .with_reconciled(&sut.registries[role], now, |v| {
                        let guard = v
                            .workers()
                            .iter()
                            .find(|w| *w.endpoint() == target)
                            .map(|w| w.reserve());
                        (v.events().to_vec(), guard)
                    })
                    .unwrap();
                let sigs = sut.note(role, &events);
                let mut expected = model.last_events.clone();
                expected.sort();
                assert_eq!(sigs, expected, "membership events match the model");
                match (guard, model.last_reserved) {
                    (Some(g), Some((_, _, generation))) => {
                        assert_eq!(g.worker().generation(), generation);
                        assert_eq!(g.worker().lifecycle(), Lifecycle::Ready);
                        sut.handles.push(g);
                    }
                    (None, None) => {}
                    (got, want) => panic!("reserve: got {got:?}, model {want:?}"),
                }
            }
            Step::Share { handle } => {
                let shared = sut.handles[handle].share();
                sut.handles.push(shared);
            }
            Step::DropHandle { handle } => {
                drop(sut.handles.remove(handle));
            }
            Step::Release { handle } => {
                sut.handles[handle].release();
            }
        }
        sut
    }

    fn check_invariants(sut: &System, model: &Model) {
        // Per generation: load = live reservations, processed = ended ones.
        for (&(role, url, generation), worker) in &sut.seen {
            let mine = model
                .reservations
                .iter()
                .filter(|r| r.role == role && r.url == url && r.generation == generation);
            let live = mine.clone().filter(|r| !r.released).count();
            let ended = mine.filter(|r| r.released).count() as u64;
            assert_eq!(worker.load(), live, "load of {}", worker.key());
            assert_eq!(worker.processed(), ended, "processed of {}", worker.key());
            assert_eq!(worker.underflows(), 0);
        }
        // Pool membership matches the model, role by role.
        for role in 0..2 {
            let members: BTreeMap<usize, u64> = sut.pools[role]
                .workers()
                .iter()
                .map(|w| {
                    assert_eq!(w.lifecycle(), Lifecycle::Ready);
                    (
                        URLS.iter().position(|u| *u == w.url()).unwrap(),
                        w.generation(),
                    )
                })
                .collect();
            assert_eq!(members, model.pools[role], "pool of role {role}");
            for (&(r, url, generation), w) in &sut.seen {
                if r == role && model.pools[role].get(&url) != Some(&generation) {
                    assert_eq!(w.lifecycle(), Lifecycle::Removed, "{} left", w.key());
                }
            }
        }
        assert_eq!(sut.handles.len(), model.handles.len());
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig {
        cases: 128,
        failure_persistence: None,
        .. ProptestConfig::default()
    })]

    #[test]
    fn registry_pool_and_guards_match_the_model(sequential 1..60 => Machine);
}
