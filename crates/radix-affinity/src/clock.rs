//! Last-use timestamps.

#[cfg(not(loom))]
use std::time::Instant;

use crate::sync::{AtomicU64, Ordering};

/// How a tree stamps the last use of a node by a tenant.
///
/// Stamps order eviction (least recently used first) and decide which tenant a
/// lookup returns (the most recently used owner of the deepest matching node).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Clock {
    /// Ticks of about one millisecond (2^20 ns) since the tree was created.
    ///
    /// Reading it is a vDSO clock read, and a lookup stores a stamp only when
    /// the stored one is from an older tick, so hot shared nodes are written at
    /// most about once per millisecond per tenant instead of on every lookup.
    /// Uses within one tick are unordered between themselves.
    #[default]
    Coarse,
    /// A counter incremented by every operation: exact order of uses, at the
    /// price of one shared atomic increment per operation. For tests,
    /// simulations and reference comparisons.
    Logical,
}

#[derive(Debug)]
pub(crate) struct Ticker {
    kind: Clock,
    #[cfg(not(loom))]
    start: Instant,
    counter: AtomicU64,
}

impl Ticker {
    pub(crate) fn new(kind: Clock) -> Self {
        Self {
            kind,
            #[cfg(not(loom))]
            start: Instant::now(),
            counter: AtomicU64::new(1),
        }
    }

    /// The current stamp; never 0.
    #[inline]
    pub(crate) fn now(&self) -> u64 {
        match self.kind {
            #[cfg(not(loom))]
            Clock::Coarse => (self.start.elapsed().as_nanos() as u64 >> 20) + 1,
            // Under loom the stamp must be a function of the schedule alone.
            _ => self.counter.fetch_add(1, Ordering::Relaxed) + 1,
        }
    }
}
