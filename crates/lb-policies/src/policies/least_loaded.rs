//! Least in-flight load, with fair ties.

use super::fair_least_loaded;
use crate::backend::Backend;
use crate::context::RequestContext;
use crate::decision::{Decision, DecisionReason};
use crate::policy::{Policy, PolicyState};
use crate::sync::{AtomicUsize, Ordering};

/// Chooses the available candidate with the least in-flight load; ties go
/// to the one that has processed fewer requests, then to the first met from
/// a start position that rotates with every decision. One scan of the
/// candidates per decision, no allocation.
#[derive(Debug, Default)]
pub struct LeastLoaded {
    rotation: AtomicUsize,
}

impl LeastLoaded {
    /// A new policy.
    pub fn new() -> Self {
        LeastLoaded {
            rotation: AtomicUsize::new(0),
        }
    }
}

impl<B: Backend> Policy<B> for LeastLoaded {
    fn select(&self, candidates: &[B], _ctx: &RequestContext<'_>) -> Option<Decision> {
        let start = self.rotation.fetch_add(1, Ordering::Relaxed);
        fair_least_loaded(candidates, start)
            .map(|(i, _)| Decision::new(i, DecisionReason::LeastLoaded))
    }
}

impl PolicyState for LeastLoaded {
    fn name(&self) -> &str {
        "least_loaded"
    }
}
