//! Decisions, the reasons behind them, and counters of those reasons.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a policy chose the candidate it chose. Counted per policy instance
/// (see [`DecisionCounters`]) and exported by the host as metrics, with
/// [`as_str`](Self::as_str) as the label value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DecisionReason {
    /// Uniformly random among available candidates.
    Random,
    /// Next available candidate in round-robin order.
    RoundRobin,
    /// The less loaded of two random available candidates.
    PowerOfTwo,
    /// Least loaded, ties by processed count, then a rotating start.
    LeastLoaded,
    /// The hash key's owner took the request.
    HashOwner,
    /// The owner was unavailable; the next owner in hash order took it.
    HashFailover,
    /// The owner was over the bounded-load limit; the next one in hash order
    /// with room took it.
    HashBoundedLoad,
    /// No hash key on the request: placed least loaded instead.
    NoHashKey,
    /// A hash key was present but no ring member is an available candidate
    /// (e.g. no membership event arrived yet): placed least loaded.
    HashUnmapped,
    /// Cache-aware: prefix match above the threshold and the owner is not
    /// overloaded, so affinity was honoured.
    CacheHit,
    /// Cache-aware: match rate at or below the threshold (or no routing
    /// input): placed least loaded.
    CacheLowMatch,
    /// Cache-aware: the matched owner is overloaded compared with the least
    /// loaded available candidate, so it yielded.
    CacheOverloaded,
    /// Cache-aware: the matched owner is not an available candidate (down,
    /// draining or not in this slice): placed least loaded.
    CacheOwnerUnavailable,
    /// Cache-aware with the fleet-wide gate: the fleet's load spread was over
    /// the thresholds, so affinity was ignored for this request.
    CacheFleetImbalance,
    /// A custom policy's own reason.
    Custom,
    /// Kv-aware: the worker holding the most cached blocks of the request,
    /// by its engine's own KV events (an exact score), took it; the match
    /// was above the threshold and the worker not overloaded. A hit scored
    /// from the approximate tree (a worker without a live event stream)
    /// counts as [`CacheHit`](Self::CacheHit).
    KvHit,
    /// Kv-aware with soft session affinity: the worker the request's
    /// session went to last (within the idle TTL) took it, being available
    /// and not overloaded.
    SessionAffinity,
}

impl DecisionReason {
    /// Every reason, in counter order.
    pub const ALL: [DecisionReason; 17] = [
        DecisionReason::Random,
        DecisionReason::RoundRobin,
        DecisionReason::PowerOfTwo,
        DecisionReason::LeastLoaded,
        DecisionReason::HashOwner,
        DecisionReason::HashFailover,
        DecisionReason::HashBoundedLoad,
        DecisionReason::NoHashKey,
        DecisionReason::HashUnmapped,
        DecisionReason::CacheHit,
        DecisionReason::CacheLowMatch,
        DecisionReason::CacheOverloaded,
        DecisionReason::CacheOwnerUnavailable,
        DecisionReason::CacheFleetImbalance,
        DecisionReason::Custom,
        DecisionReason::KvHit,
        DecisionReason::SessionAffinity,
    ];

    /// A stable snake_case name, suitable as a metrics label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            DecisionReason::Random => "random",
            DecisionReason::RoundRobin => "round_robin",
            DecisionReason::PowerOfTwo => "power_of_two",
            DecisionReason::LeastLoaded => "least_loaded",
            DecisionReason::HashOwner => "hash_owner",
            DecisionReason::HashFailover => "hash_failover",
            DecisionReason::HashBoundedLoad => "hash_bounded_load",
            DecisionReason::NoHashKey => "no_hash_key",
            DecisionReason::HashUnmapped => "hash_unmapped",
            DecisionReason::CacheHit => "cache_hit",
            DecisionReason::CacheLowMatch => "cache_low_match",
            DecisionReason::CacheOverloaded => "cache_overloaded",
            DecisionReason::CacheOwnerUnavailable => "cache_owner_unavailable",
            DecisionReason::CacheFleetImbalance => "cache_fleet_imbalance",
            DecisionReason::Custom => "custom",
            DecisionReason::KvHit => "kv_hit",
            DecisionReason::SessionAffinity => "session_affinity",
        }
    }

    /// Position in [`ALL`](Self::ALL).
    const fn slot(self) -> usize {
        match self {
            DecisionReason::Random => 0,
            DecisionReason::RoundRobin => 1,
            DecisionReason::PowerOfTwo => 2,
            DecisionReason::LeastLoaded => 3,
            DecisionReason::HashOwner => 4,
            DecisionReason::HashFailover => 5,
            DecisionReason::HashBoundedLoad => 6,
            DecisionReason::NoHashKey => 7,
            DecisionReason::HashUnmapped => 8,
            DecisionReason::CacheHit => 9,
            DecisionReason::CacheLowMatch => 10,
            DecisionReason::CacheOverloaded => 11,
            DecisionReason::CacheOwnerUnavailable => 12,
            DecisionReason::CacheFleetImbalance => 13,
            DecisionReason::Custom => 14,
            DecisionReason::KvHit => 15,
            DecisionReason::SessionAffinity => 16,
        }
    }
}

impl fmt::Display for DecisionReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy's choice: an index into the candidate slice it was given, and
/// why.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Decision {
    /// Index into the candidate slice passed to `select`.
    pub index: usize,
    /// Why this candidate.
    pub reason: DecisionReason,
    /// For prefix-matching policies: the best prefix match of the request
    /// in thousandths of its input (0..=1000), whatever the decision; the
    /// host exports it as a match-rate histogram. `None` for other policies.
    pub match_permille: Option<u16>,
    /// For prefix-matching policies: that best match's length in the
    /// request's own units (token ids, whole blocks of them for a
    /// block-matching policy, or characters of a routing text), whatever
    /// the decision. `None` for other policies.
    pub matched: Option<usize>,
}

impl Decision {
    /// A decision for `index` with `reason`.
    pub const fn new(index: usize, reason: DecisionReason) -> Self {
        Decision {
            index,
            reason,
            match_permille: None,
            matched: None,
        }
    }

    /// The same decision, carrying the request's best prefix match:
    /// `matched` of its `input` units (the rate is `matched / input`, 0
    /// for an empty input).
    pub fn with_match(self, matched: usize, input: usize) -> Self {
        let rate = if input == 0 {
            0.0
        } else {
            matched as f64 / input as f64
        };
        let mut decision = self.with_match_rate(rate);
        decision.matched = Some(matched);
        decision
    }

    /// The same decision, carrying the request's prefix match rate
    /// (`matched / input`, clamped to `[0, 1]`).
    pub fn with_match_rate(mut self, rate: f64) -> Self {
        let permille = (rate.clamp(0.0, 1.0) * 1000.0).round() as u16;
        self.match_permille = Some(permille);
        self
    }
}

const REASONS: usize = DecisionReason::ALL.len();

/// Lock-free counters, one per [`DecisionReason`], plus a count of
/// selections that found no available candidate.
#[derive(Debug, Default)]
pub struct DecisionCounters {
    by_reason: [AtomicU64; REASONS],
    none: AtomicU64,
}

impl DecisionCounters {
    /// All counters at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one decision (or one "no candidate" outcome for `None`).
    pub fn record(&self, outcome: Option<&Decision>) {
        let counter = match outcome {
            Some(d) => &self.by_reason[d.reason.slot()],
            None => &self.none,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// A copy of the current counts.
    pub fn snapshot(&self) -> DecisionCounts {
        DecisionCounts {
            by_reason: std::array::from_fn(|i| self.by_reason[i].load(Ordering::Relaxed)),
            none: self.none.load(Ordering::Relaxed),
        }
    }
}

/// A snapshot of [`DecisionCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecisionCounts {
    by_reason: [u64; REASONS],
    none: u64,
}

impl DecisionCounts {
    /// Decisions made for `reason`.
    pub fn get(&self, reason: DecisionReason) -> u64 {
        self.by_reason[reason.slot()]
    }

    /// Selections that found no available candidate.
    pub fn no_candidate(&self) -> u64 {
        self.none
    }

    /// Decisions made, all reasons together (without "no candidate").
    pub fn total(&self) -> u64 {
        self.by_reason.iter().sum()
    }

    /// `(reason, count)` for every reason, zeros included, in a fixed order.
    pub fn iter(&self) -> impl Iterator<Item = (DecisionReason, u64)> + '_ {
        DecisionReason::ALL.iter().map(|r| (*r, self.get(*r)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_the_all_order_and_names_are_unique() {
        for (i, r) in DecisionReason::ALL.iter().enumerate() {
            assert_eq!(r.slot(), i);
        }
        let mut names: Vec<_> = DecisionReason::ALL.iter().map(|r| r.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), REASONS);
    }

    #[test]
    fn counters_count_per_reason() {
        let c = DecisionCounters::new();
        c.record(Some(&Decision::new(0, DecisionReason::CacheHit)));
        c.record(Some(&Decision::new(3, DecisionReason::CacheHit)));
        c.record(Some(&Decision::new(1, DecisionReason::LeastLoaded)));
        c.record(None);
        let s = c.snapshot();
        assert_eq!(s.get(DecisionReason::CacheHit), 2);
        assert_eq!(s.get(DecisionReason::LeastLoaded), 1);
        assert_eq!(s.get(DecisionReason::Random), 0);
        assert_eq!(s.no_candidate(), 1);
        assert_eq!(s.total(), 3);
        assert_eq!(s.iter().count(), REASONS);
    }
}
