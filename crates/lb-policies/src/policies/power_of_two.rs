//! Power of two choices.

use std::fmt;
use std::sync::Arc;

use super::random_available;
use crate::backend::Backend;
use crate::context::RequestContext;
use crate::decision::{Decision, DecisionReason};
use crate::policy::{Policy, PolicyState};
use crate::rng::{SharedRng, random_seed};

/// A source of load figures other than the router's own in-flight count,
/// for example the queue length engines report in their metrics.
pub trait LoadSource: Send + Sync {
    /// The load of the worker with this key, or `None` when unknown (the
    /// policy then uses the backend's in-flight load).
    fn load(&self, key: &str) -> Option<usize>;
}

/// Draws two distinct random available candidates and takes the less
/// loaded one (ties: fewer processed requests, then the first draw).
///
/// Load is the backend's live in-flight count unless a [`LoadSource`] is
/// attached. Near-least-loaded placement at O(1) cost per decision, without
/// the herd effect of everyone choosing the single least loaded worker.
pub struct PowerOfTwo {
    rng: SharedRng,
    load_source: Option<Arc<dyn LoadSource>>,
}

impl PowerOfTwo {
    /// A policy seeded differently in every process, using in-flight load.
    pub fn new() -> Self {
        Self::with_seed(random_seed())
    }

    /// A policy whose draws repeat for a given seed (single-threaded).
    pub fn with_seed(seed: u64) -> Self {
        PowerOfTwo {
            rng: SharedRng::new(seed),
            load_source: None,
        }
    }

    /// Compares load figures from `source` instead of in-flight counts.
    #[must_use]
    pub fn with_load_source(mut self, source: Arc<dyn LoadSource>) -> Self {
        self.load_source = Some(source);
        self
    }

    fn load_of<B: Backend>(&self, b: &B) -> usize {
        self.load_source
            .as_ref()
            .and_then(|s| s.load(b.key()))
            .unwrap_or_else(|| b.load())
    }
}

impl Default for PowerOfTwo {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for PowerOfTwo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PowerOfTwo")
            .field("rng", &self.rng)
            .field("load_source", &self.load_source.is_some())
            .finish()
    }
}

impl<B: Backend> Policy<B> for PowerOfTwo {
    fn select(&self, candidates: &[B], _ctx: &RequestContext<'_>) -> Option<Decision> {
        let first = random_available(candidates, &self.rng, None)?;
        let chosen = match random_available(candidates, &self.rng, Some(first)) {
            None => first,
            Some(second) => {
                let (a, b) = (&candidates[first], &candidates[second]);
                if (self.load_of(b), b.processed()) < (self.load_of(a), a.processed()) {
                    second
                } else {
                    first
                }
            }
        };
        Some(Decision::new(chosen, DecisionReason::PowerOfTwo))
    }
}

impl PolicyState for PowerOfTwo {
    fn name(&self) -> &str {
        "power_of_two"
    }
}
