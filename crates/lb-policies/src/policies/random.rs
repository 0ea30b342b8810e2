//! Uniformly random choice among available candidates.

use super::random_available;
use crate::backend::Backend;
use crate::context::RequestContext;
use crate::decision::{Decision, DecisionReason};
use crate::policy::{Policy, PolicyState};
use crate::rng::{SharedRng, random_seed};

/// Picks a uniformly random available candidate. Stateless apart from its
/// random source; no allocation per decision.
#[derive(Debug)]
pub struct RandomPolicy {
    rng: SharedRng,
}

impl RandomPolicy {
    /// A policy seeded differently in every process.
    pub fn new() -> Self {
        Self::with_seed(random_seed())
    }

    /// A policy whose choices repeat for a given seed (single-threaded).
    pub fn with_seed(seed: u64) -> Self {
        RandomPolicy {
            rng: SharedRng::new(seed),
        }
    }
}

impl Default for RandomPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> Policy<B> for RandomPolicy {
    fn select(&self, candidates: &[B], _ctx: &RequestContext<'_>) -> Option<Decision> {
        random_available(candidates, &self.rng, None)
            .map(|i| Decision::new(i, DecisionReason::Random))
    }
}

impl PolicyState for RandomPolicy {
    fn name(&self) -> &str {
        "random"
    }
}
