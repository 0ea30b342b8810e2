//! Lock-free round robin.

use crate::backend::Backend;
use crate::context::RequestContext;
use crate::decision::{Decision, DecisionReason};
use crate::policy::{Policy, PolicyState};
use crate::sync::{AtomicUsize, Ordering};

/// Visits the candidates in order, one atomic `fetch_add` per step.
///
/// An unavailable candidate consumes its turn (the counter moves past it),
/// so over any `n` consecutive steps each available candidate is chosen
/// exactly once: availability changes do not hand a neighbour a double
/// share. Concurrent callers each get a distinct step.
#[derive(Debug)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoundRobin {
    /// Starts at candidate 0.
    pub fn new() -> Self {
        Self::starting_at(0)
    }

    /// Starts at candidate `start` (modulo the slice length).
    pub fn starting_at(start: usize) -> Self {
        RoundRobin {
            next: AtomicUsize::new(start),
        }
    }
}

impl Default for RoundRobin {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> Policy<B> for RoundRobin {
    fn select(&self, candidates: &[B], _ctx: &RequestContext<'_>) -> Option<Decision> {
        let n = candidates.len();
        // At most one full cycle: after n unavailable turns there is nothing
        // to find (and the counter still advanced fairly).
        for _ in 0..n {
            let i = self.next.fetch_add(1, Ordering::Relaxed) % n;
            if candidates[i].is_available() {
                return Some(Decision::new(i, DecisionReason::RoundRobin));
            }
        }
        None
    }
}

impl PolicyState for RoundRobin {
    fn name(&self) -> &str {
        "round_robin"
    }
}
