//! Loom model: concurrent reserve / release / share / drop on one worker.
//! Bound: 2-3 threads, a few operations each, LOOM_MAX_PREEMPTIONS=2.
#![cfg(loom)]

use std::sync::Arc;

use loom::thread;
use worker_lifecycle::{Endpoint, Worker, WorkerOptions, WorkerRole, WorkerSpec};

fn worker() -> Arc<Worker> {
    let endpoint = Endpoint::new("http://127.0.0.1:1", None).unwrap();
    Worker::new(
        WorkerSpec::new(WorkerRole::Regular, endpoint),
        1,
        &WorkerOptions::default(),
    )
}

#[test]
fn shared_handles_dropped_on_two_threads_release_once() {
    loom::model(|| {
        let w = worker();
        let guard = w.reserve();
        let shared = guard.share();
        let t = thread::spawn(move || drop(shared));
        drop(guard);
        t.join().unwrap();
        assert_eq!(w.load(), 0);
        assert_eq!(w.processed(), 1);
        assert_eq!(w.underflows(), 0);
    });
}

#[test]
fn racing_release_and_drop_end_the_reservation_exactly_once() {
    loom::model(|| {
        let w = worker();
        let guard = w.reserve();
        let shared = guard.share();
        let t = thread::spawn(move || {
            let won = shared.release();
            drop(shared);
            won
        });
        let won_here = guard.release();
        drop(guard);
        let won_there = t.join().unwrap();
        assert!(won_here ^ won_there, "exactly one release wins");
        assert_eq!(w.load(), 0);
        assert_eq!(w.processed(), 1);
        assert_eq!(w.underflows(), 0);
    });
}

#[test]
fn concurrent_reservations_never_underflow_and_settle_at_zero() {
    loom::model(|| {
        let w = worker();
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let w = w.clone();
                thread::spawn(move || {
                    let g = w.reserve();
                    let load = w.load();
                    assert!(
                        (1..=2).contains(&load),
                        "load {load} with at most 2 live guards"
                    );
                    if i == 0 {
                        g.release();
                    } else {
                        let s = g.share();
                        drop(g);
                        drop(s);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(w.load(), 0);
        assert_eq!(w.processed(), 2);
        assert_eq!(w.underflows(), 0);
    });
}
