//! A proptest state machine: random sequences of registrations, stored and
//! removed blocks (shared prefixes, unknown parents, malformed events, LoRA
//! chains, duplicate engine hashes), stream and worker clears and
//! unregistrations, and per-worker caps (a small default, `HARNESS_CAP`,
//! and caps set and lowered by `SetCapacity`), applied to a `KvIndex` and
//! to the reference model (`BTreeMap<our hash, BTreeSet<(worker, rank)>>`
//! recomputed from per-stream engine-hash maps; a stream over its cap drops
//! the engine hashes it began to hold first, from a plain list). After
//! every step each stream holds at most its cap, and the holders of every
//! block, every prompt's lookup, the pair and block counts, the eviction
//! counts and the skip counters must agree.
#![cfg(not(loom))]

use kv_block_index::fuzzing::{
    self, HARNESS_CAP, MAX_SET_CAP, Model, Op, PROMPT_BLOCKS, PROMPTS, WORKERS,
};
use kv_block_index::{KvEvent, KvIndex, KvIndexError, WorkerId};
use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

/// The reference: the model plus the worker ids the index will hand out
/// (dense, in registration order).
#[derive(Clone, Debug)]
struct Reference {
    model: Model,
    ids: [Option<u32>; WORKERS as usize],
    next_id: u32,
    last_retired: Option<u32>,
}

impl Default for Reference {
    fn default() -> Self {
        Self {
            model: Model::with_cap(HARNESS_CAP),
            ids: [None; WORKERS as usize],
            next_id: 0,
            last_retired: None,
        }
    }
}

impl Reference {
    fn id(&self, w: u8) -> Option<u32> {
        self.ids[(w % WORKERS) as usize].or(self.last_retired)
    }
}

struct RefMachine;

impl ReferenceStateMachine for RefMachine {
    type State = Reference;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Self::State> {
        Just(Reference::default()).boxed()
    }

    fn transitions(_state: &Self::State) -> BoxedStrategy<Self::Transition> {
        let w = 0..WORKERS;
        let stored = (
            0..WORKERS,
            0..2u8,
            0..PROMPTS,
            // Mostly from the start, so that chains (and shared prefixes)
            // grow instead of being skipped for an unknown parent.
            prop_oneof![2 => Just(0), 1 => 0..PROMPT_BLOCKS],
            1..=PROMPT_BLOCKS,
            prop::bool::weighted(0.15),
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.05),
        )
            .prop_map(
                |(worker, rank, prompt, start, len, salt, lora, bad_size)| Op::Stored {
                    worker,
                    rank,
                    prompt,
                    start,
                    len,
                    salt: u8::from(salt),
                    lora,
                    bad_size,
                },
            );
        let removed = (
            0..WORKERS,
            0..2u8,
            0..PROMPTS,
            0..PROMPT_BLOCKS,
            1..=3u8,
            prop::bool::weighted(0.1),
        )
            .prop_map(|(worker, rank, prompt, start, len, salt)| Op::Removed {
                worker,
                rank,
                prompt,
                start,
                len,
                salt: u8::from(salt),
            });
        prop_oneof![
            4 => w.clone().prop_map(Op::Register),
            1 => w.clone().prop_map(Op::Unregister),
            10 => stored,
            8 => removed,
            1 => (0..WORKERS, 0..2u8).prop_map(|(worker, rank)| Op::Cleared { worker, rank }),
            1 => w.clone().prop_map(Op::ClearWorker),
            // Mostly small caps (evictions), sometimes ones above all a
            // stream can hold.
            2 => (w, prop_oneof![3 => 1..=8u8, 1 => 0..=MAX_SET_CAP])
                .prop_map(|(worker, blocks)| Op::SetCapacity { worker, blocks }),
        ]
        .boxed()
    }

    fn apply(mut state: Self::State, op: &Self::Transition) -> Self::State {
        match *op {
            Op::Register(w) => {
                let slot = &mut state.ids[(w % WORKERS) as usize];
                if slot.is_none() {
                    *slot = Some(state.next_id);
                    state.model.registered.insert(state.next_id);
                    state.next_id += 1;
                }
            }
            Op::Unregister(w) => {
                if let Some(id) = state.id(w)
                    && state.model.unregister(id)
                {
                    state.ids[(w % WORKERS) as usize] = None;
                    state.last_retired = Some(id);
                }
            }
            Op::Stored { worker, rank, .. } | Op::Removed { worker, rank, .. } => {
                if let (Some(id), Some(event)) = (state.id(worker), fuzzing::event_of(op)) {
                    state.model.apply(id, u32::from(rank), &event);
                }
            }
            Op::Cleared { worker, rank } => {
                if let Some(id) = state.id(worker) {
                    state
                        .model
                        .apply(id, u32::from(rank), &KvEvent::AllBlocksCleared);
                }
            }
            Op::ClearWorker(w) => {
                if let Some(id) = state.id(w) {
                    state.model.clear_worker(id);
                }
            }
            Op::SetCapacity { worker, blocks } => {
                if let Some(id) = state.id(worker) {
                    state.model.set_capacity(id, Op::cap_of(blocks).get());
                }
            }
        }
        state
    }
}

struct Sut {
    index: KvIndex<u8>,
    ids: [Option<WorkerId>; WORKERS as usize],
    last_retired: Option<WorkerId>,
}

impl Sut {
    fn id(&self, w: u8) -> Option<WorkerId> {
        self.ids[(w % WORKERS) as usize].or(self.last_retired)
    }
}

struct IndexTest;

impl StateMachineTest for IndexTest {
    type SystemUnderTest = Sut;
    type Reference = RefMachine;

    fn init_test(_ref_state: &Reference) -> Sut {
        Sut {
            index: KvIndex::new(fuzzing::config()),
            ids: [None; WORKERS as usize],
            last_retired: None,
        }
    }

    fn apply(mut sut: Sut, reference: &Reference, op: Op) -> Sut {
        let refused = |r: Result<(), KvIndexError>, id: Option<WorkerId>| match (r, id) {
            (Ok(()), Some(id)) => assert!(reference.model.registered.contains(&id.get())),
            (Err(KvIndexError::UnknownWorker(w)), Some(id)) => {
                assert_eq!(w, id);
                assert!(!reference.model.registered.contains(&id.get()));
            }
            (other, id) => panic!("{other:?} for {id:?}"),
        };
        match op {
            Op::Register(w) => {
                let id = sut.index.register_worker(w % WORKERS);
                sut.ids[(w % WORKERS) as usize] = Some(id);
                assert_eq!(Some(id.get()), reference.ids[(w % WORKERS) as usize]);
            }
            Op::Unregister(w) => {
                if let Some(id) = sut.id(w) {
                    let was = sut.index.unregister_worker(id);
                    // `reference` is the state after this op.
                    assert!(!reference.model.registered.contains(&id.get()));
                    if was {
                        assert_eq!(reference.last_retired, Some(id.get()));
                        sut.ids[(w % WORKERS) as usize] = None;
                        sut.last_retired = Some(id);
                    }
                }
            }
            Op::Stored { worker, rank, .. } | Op::Removed { worker, rank, .. } => {
                if let (Some(id), Some(event)) = (sut.id(worker), fuzzing::event_of(&op)) {
                    refused(
                        sut.index.apply(id, u32::from(rank), &event).map(drop),
                        Some(id),
                    );
                }
            }
            Op::Cleared { worker, rank } => {
                if let Some(id) = sut.id(worker) {
                    let r = sut
                        .index
                        .stream(id, u32::from(rank))
                        .and_then(|s| s.clear());
                    refused(r.map(drop), Some(id));
                }
            }
            Op::ClearWorker(w) => {
                if let Some(id) = sut.id(w) {
                    refused(sut.index.clear_worker(id).map(drop), Some(id));
                }
            }
            Op::SetCapacity { worker, blocks } => {
                if let Some(id) = sut.id(worker) {
                    refused(
                        sut.index
                            .set_worker_capacity(id, Op::cap_of(blocks))
                            .map(drop),
                        Some(id),
                    );
                }
            }
        }
        sut
    }

    fn check_invariants(sut: &Sut, reference: &Reference) {
        fuzzing::check_index(&sut.index, &reference.model);
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        .. ProptestConfig::default()
    })]

    #[test]
    fn index_matches_the_reference_model(sequential 1..80 => IndexTest);
}
