//! Rendezvous (highest random weight) hashing.

use super::fair_least_loaded;
use crate::backend::Backend;
use crate::context::RequestContext;
use crate::decision::{Decision, DecisionReason};
use crate::hash::{mix64, stable_hash};
use crate::policy::{Policy, PolicyState};
use crate::sync::{AtomicUsize, Ordering};

/// Rendezvous hashing: every candidate gets a score from (request key,
/// candidate key) and the highest-scoring available candidate wins.
///
/// Stateless: no ring, no membership events needed, any candidate slice
/// works. Adding a worker moves only the keys it now wins (about 1/N);
/// removing one moves only its own keys. Costs one short hash per candidate
/// per decision (O(N)), no allocation. When the top scorer is unavailable
/// the runner-up takes the key (reason [`DecisionReason::HashFailover`]).
/// Keyless requests go least loaded ([`DecisionReason::NoHashKey`]).
#[derive(Debug, Default)]
pub struct RendezvousHash {
    rotation: AtomicUsize,
}

impl RendezvousHash {
    /// A new policy.
    pub fn new() -> Self {
        RendezvousHash {
            rotation: AtomicUsize::new(0),
        }
    }
}

impl<B: Backend> Policy<B> for RendezvousHash {
    fn select(&self, candidates: &[B], ctx: &RequestContext<'_>) -> Option<Decision> {
        let Some((_, key)) = ctx.keys.first() else {
            let start = self.rotation.fetch_add(1, Ordering::Relaxed);
            return fair_least_loaded(candidates, start)
                .map(|(i, _)| Decision::new(i, DecisionReason::NoHashKey));
        };
        let request = stable_hash(key.as_bytes(), 0);
        let mut best_any = (0u64, usize::MAX);
        let mut best_available: Option<(u64, usize)> = None;
        for (i, c) in candidates.iter().enumerate() {
            let score = mix64(stable_hash(c.key().as_bytes(), 0) ^ request);
            if best_any.1 == usize::MAX || score > best_any.0 {
                best_any = (score, i);
            }
            if c.is_available() && best_available.is_none_or(|(s, _)| score > s) {
                best_available = Some((score, i));
            }
        }
        let (_, chosen) = best_available?;
        let reason = if chosen == best_any.1 {
            DecisionReason::HashOwner
        } else {
            DecisionReason::HashFailover
        };
        Some(Decision::new(chosen, reason))
    }
}

impl PolicyState for RendezvousHash {
    fn name(&self) -> &str {
        "rendezvous_hash"
    }
}
