//! loom model: concurrent round-robin selections while the fleet changes.
//!
//! Bound: LOOM_MAX_PREEMPTIONS=2; two or three threads with one selection
//! each; runs in well under a second.
#![cfg(loom)]

use std::sync::Arc;

use lb_policies::{BasicBackend, Policy, RequestContext, RoundRobin};
use loom::thread;

fn fleet(n: usize) -> Vec<BasicBackend> {
    (0..n).map(|i| BasicBackend::new(format!("w{i}"))).collect()
}

/// Three concurrent selections over three workers take three distinct
/// turns: every worker exactly once, whatever the interleaving.
#[test]
fn concurrent_selections_take_distinct_turns() {
    loom::model(|| {
        let rr = Arc::new(RoundRobin::new());
        let workers = Arc::new(fleet(3));
        let spawn = |rr: Arc<RoundRobin>, workers: Arc<Vec<BasicBackend>>| {
            thread::spawn(move || {
                rr.select(&workers[..], &RequestContext::new("m"))
                    .expect("all available")
                    .index
            })
        };
        let a = spawn(Arc::clone(&rr), Arc::clone(&workers));
        let b = spawn(Arc::clone(&rr), Arc::clone(&workers));
        let c = rr
            .select(&workers[..], &RequestContext::new("m"))
            .expect("all available")
            .index;
        let mut seen = [a.join().expect("no panic"), b.join().expect("no panic"), c];
        seen.sort_unstable();
        assert_eq!(seen, [0, 1, 2]);
    });
}

/// One selection sees the old fleet of three, the other the new fleet of
/// two (a worker left): each stays inside its own slice and they still take
/// distinct turns.
#[test]
fn selection_racing_a_membership_change_stays_in_its_slice() {
    loom::model(|| {
        let rr = Arc::new(RoundRobin::new());
        let old = Arc::new(fleet(3));
        let new = Arc::new(fleet(2));
        let t = {
            let (rr, old) = (Arc::clone(&rr), Arc::clone(&old));
            thread::spawn(move || {
                rr.select(&old[..], &RequestContext::new("m"))
                    .expect("up")
                    .index
            })
        };
        let on_new = rr
            .select(&new[..], &RequestContext::new("m"))
            .expect("up")
            .index;
        let on_old = t.join().expect("no panic");
        // Turns 0 and 1 were handed out, one to each caller.
        assert!(on_new < 2 && on_old < 2);
        assert_ne!(on_new, on_old);
    });
}
