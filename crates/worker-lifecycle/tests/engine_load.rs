//! The engine-reported load estimate against a model of what it promises:
//! any sequence of reservations, releases, polls (sent and answered later,
//! possibly out of order), garbage-clearing and huge reports keeps
//!
//! - the guards' count exact (reports never change `load`),
//! - `estimated_load = own now + max(0, report − own when polled)` for the
//!   last answer applied, and own counts alone after a clear,
//! - the engine's waiting count as the last answer gave it (clamped),
//!   withdrawn by a clear, and never part of the estimate twice.

use proptest::prelude::*;
use worker_lifecycle::{Endpoint, LoadGuard, Worker, WorkerOptions, WorkerRole, WorkerSpec};

#[derive(Clone, Debug)]
enum Op {
    Reserve,
    /// Release the guard at this position (modulo those held).
    Release(usize),
    /// Send a poll: the replica's own count is noted now.
    Poll,
    /// The engine answers the poll at this position (modulo those
    /// outstanding) with this in-flight count, of which this many wait.
    Answer(usize, usize, usize),
    /// The source failed: back to own counts.
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Reserve),
        3 => any::<usize>().prop_map(Op::Release),
        2 => Just(Op::Poll),
        2 => (
            any::<usize>(),
            prop_oneof![0usize..200, Just(usize::MAX), Just(u32::MAX as usize + 7)],
            prop_oneof![0usize..200, Just(usize::MAX)],
        )
            .prop_map(|(i, n, w)| Op::Answer(i, n, w.min(n))),
        1 => Just(Op::Clear),
    ]
}

fn worker() -> std::sync::Arc<Worker> {
    let endpoint = Endpoint::new("http://engine:8000", None).unwrap();
    Worker::new(
        WorkerSpec::new(WorkerRole::Regular, endpoint),
        1,
        &WorkerOptions::default(),
    )
}

proptest! {
    #[test]
    fn the_estimate_is_own_load_now_plus_the_others_at_the_last_report(
        ops in proptest::collection::vec(op(), 1..80)
    ) {
        let worker = worker();
        let mut held: Vec<LoadGuard> = Vec::new();
        let mut outstanding: Vec<usize> = Vec::new();
        // The model: the others' load of the last applied answer.
        let mut others: Option<usize> = None;
        let mut reported: Option<usize> = None;
        let mut waiting: Option<usize> = None;
        for op in ops {
            match op {
                Op::Reserve => held.push(worker.try_reserve().unwrap()),
                Op::Release(i) if !held.is_empty() => {
                    let i = i % held.len();
                    drop(held.swap_remove(i));
                }
                Op::Release(_) => {}
                Op::Poll => outstanding.push(worker.load()),
                Op::Answer(i, n, w) if !outstanding.is_empty() => {
                    let own_at_poll = outstanding.remove(i % outstanding.len());
                    worker.record_engine_load(n, own_at_poll);
                    worker.record_engine_waiting(Some(w));
                    waiting = Some(w.min(u32::MAX as usize));
                    let clamped = n.min(u32::MAX as usize);
                    reported = Some(clamped);
                    others = Some(clamped.saturating_sub(own_at_poll));
                }
                Op::Answer(..) => {}
                Op::Clear => {
                    worker.clear_engine_load();
                    others = None;
                    reported = None;
                    waiting = None;
                }
            }
            prop_assert_eq!(worker.load(), held.len(), "reports never change the guards' count");
            prop_assert_eq!(worker.estimated_load(), held.len() + others.unwrap_or(0));
            prop_assert_eq!(worker.engine_reported_load(), reported);
            prop_assert_eq!(worker.engine_waiting(), waiting);
            prop_assert!(worker.estimated_load() >= worker.load());
        }
        drop(held);
        prop_assert_eq!(worker.load(), 0);
        prop_assert_eq!(worker.underflows(), 0);
    }
}

#[test]
fn a_burst_sent_after_a_report_counts_at_once_and_the_others_arrive_with_the_next() {
    let worker = worker();
    // Another replica runs 10 requests; this one none. Polled.
    worker.record_engine_load(10, worker.load());
    assert_eq!(worker.estimated_load(), 10);
    // This replica sends 3 before the next report: visible to it now.
    let burst: Vec<_> = (0..3).map(|_| worker.try_reserve().unwrap()).collect();
    assert_eq!(worker.estimated_load(), 13);
    // Next poll while the 3 are in flight: the others finished 4.
    worker.record_engine_load(9, worker.load());
    assert_eq!(worker.estimated_load(), 9);
    drop(burst);
    assert_eq!(worker.estimated_load(), 6);
    // The source fails: own counts only, which are exact.
    worker.clear_engine_load();
    assert_eq!((worker.estimated_load(), worker.load()), (0, 0));
}

#[test]
fn a_report_below_own_load_never_lowers_the_estimate_below_own_load() {
    let worker = worker();
    let mine: Vec<_> = (0..5).map(|_| worker.try_reserve().unwrap()).collect();
    // A stale or short answer (the engine has not seen all 5 yet).
    worker.record_engine_load(2, worker.load());
    assert_eq!(worker.estimated_load(), 5);
    drop(mine);
}
