//! Consistent hashing on a ring of virtual nodes, with failover and an
//! optional bounded-load mode.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize as HintCell;

use super::{fair_least_loaded, find_candidate};
use crate::backend::Backend;
use crate::context::RequestContext;
use crate::decision::{Decision, DecisionReason};
use crate::error::PolicyError;
use crate::hash::stable_hash;
use crate::membership::MembershipEvent;
use crate::policy::{Policy, PolicyState};
use crate::sync::{AtomicUsize, Mutex, Ordering, RwLock};

/// Knobs of [`ConsistentHash`].
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(default)
)]
#[non_exhaustive]
pub struct ConsistentHashConfig {
    /// Points per worker on the ring. More points spread keys more evenly
    /// and cost memory (16 bytes each) and rebuild time. Default 160.
    pub virtual_nodes: u32,
    /// Bounded-load factor `c` (≥ 1.0). When set, a worker takes a request
    /// only if its load after taking it stays within
    /// `ceil(c × (total_load + 1) / available_workers)`; otherwise the key
    /// walks on to the next worker on the ring. `None` (default) disables
    /// the bound. 1.25 is a common choice.
    pub bounded_load: Option<f64>,
}

impl Default for ConsistentHashConfig {
    fn default() -> Self {
        ConsistentHashConfig {
            virtual_nodes: 160,
            bounded_load: None,
        }
    }
}

impl ConsistentHashConfig {
    /// Sets [`virtual_nodes`](Self::virtual_nodes).
    #[must_use]
    pub fn with_virtual_nodes(mut self, virtual_nodes: u32) -> Self {
        self.virtual_nodes = virtual_nodes;
        self
    }

    /// Sets [`bounded_load`](Self::bounded_load) to `Some(factor)`.
    #[must_use]
    pub fn with_bounded_load(mut self, factor: f64) -> Self {
        self.bounded_load = Some(factor);
        self
    }

    /// Checks every knob's range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.virtual_nodes == 0 || self.virtual_nodes > 65_536 {
            return Err(PolicyError::InvalidConfig {
                field: "virtual_nodes",
                reason: format!("must be in 1..=65536, got {}", self.virtual_nodes),
            });
        }
        if let Some(c) = self.bounded_load
            && !(c.is_finite() && c >= 1.0)
        {
            return Err(PolicyError::InvalidConfig {
                field: "bounded_load",
                reason: format!("must be a finite factor >= 1.0, got {c}"),
            });
        }
        Ok(())
    }
}

/// A ring member: its key and where it was last found in a candidate
/// slice (a hint that makes the usual lookup one string comparison).
#[derive(Debug)]
struct Member {
    key: Arc<str>,
    hint: HintCell,
}

impl Member {
    fn position_in<B: Backend>(&self, candidates: &[B]) -> Option<usize> {
        find_candidate(&self.key, &self.hint, candidates)
    }
}

/// An immutable ring: sorted `(point, member)` pairs.
#[derive(Debug, Default)]
struct Ring {
    points: Vec<(u64, u32)>,
    members: Vec<Arc<Member>>,
}

impl Ring {
    fn member_points(key: &str, virtual_nodes: u32, id: u32) -> Vec<(u64, u32)> {
        let mut points: Vec<_> = (0..virtual_nodes)
            .map(|v| (stable_hash(key.as_bytes(), u64::from(v) + 1), id))
            .collect();
        points.sort_unstable();
        points
    }

    fn with_added(&self, key: &str, virtual_nodes: u32) -> Ring {
        let id = self.members.len() as u32;
        let own = Self::member_points(key, virtual_nodes, id);
        // Merge two sorted runs: O(ring) per membership change.
        let mut points = Vec::with_capacity(self.points.len() + own.len());
        let (mut a, mut b) = (self.points.iter().peekable(), own.iter().peekable());
        while let (Some(x), Some(y)) = (a.peek(), b.peek()) {
            if x <= y {
                points.push(**x);
                a.next();
            } else {
                points.push(**y);
                b.next();
            }
        }
        points.extend(a);
        points.extend(b);
        let mut members = self.members.clone();
        members.push(Arc::new(Member {
            key: key.into(),
            hint: HintCell::new(0),
        }));
        Ring { points, members }
    }

    fn without(&self, index: usize) -> Ring {
        let gone = index as u32;
        let points = self
            .points
            .iter()
            .filter(|p| p.1 != gone)
            .map(|&(point, id)| (point, if id > gone { id - 1 } else { id }))
            .collect();
        let mut members = self.members.clone();
        members.remove(index);
        Ring { points, members }
    }

    fn index_of(&self, key: &str) -> Option<usize> {
        self.members.iter().position(|m| &*m.key == key)
    }
}

/// Consistent hashing: each worker owns `virtual_nodes` points on a 64-bit
/// ring; a request goes to the first worker clockwise of its hash key.
///
/// * The ring is rebuilt only on membership events (merge / filter, O(ring))
///   and swapped in whole; a decision takes a read lock just long enough to
///   clone an `Arc`, then binary-searches. No allocation per decision.
/// * Adding a worker moves about 1/N of the keys (to the new worker);
///   removing one moves only that worker's keys.
/// * Failover: an unavailable owner hands the key to the next worker on the
///   ring, so it comes back when the owner recovers.
/// * Bounded load (optional): see [`ConsistentHashConfig::bounded_load`].
/// * Keyless requests (see [`HashKeys`](crate::HashKeys) for precedence) go
///   least loaded with reason [`DecisionReason::NoHashKey`].
///
/// Workers join the ring only through [`MembershipEvent`]s. Candidates that
/// are not ring members are never hash owners; a ring member missing from
/// the slice is skipped (at the cost of a scan of the slice).
#[derive(Debug)]
pub struct ConsistentHash {
    config: ConsistentHashConfig,
    ring: RwLock<Arc<Ring>>,
    update: Mutex<()>,
    rotation: AtomicUsize,
}

impl ConsistentHash {
    /// A policy with an empty ring.
    pub fn new(config: ConsistentHashConfig) -> Result<Self, PolicyError> {
        config.validate()?;
        Ok(ConsistentHash {
            config,
            ring: RwLock::new(Arc::new(Ring::default())),
            update: Mutex::new(()),
            rotation: AtomicUsize::new(0),
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &ConsistentHashConfig {
        &self.config
    }

    /// Number of workers on the ring.
    pub fn member_count(&self) -> usize {
        self.ring.read().members.len()
    }

    fn fallback<B: Backend>(&self, candidates: &[B], reason: DecisionReason) -> Option<Decision> {
        let start = self.rotation.fetch_add(1, Ordering::Relaxed);
        fair_least_loaded(candidates, start).map(|(i, _)| Decision::new(i, reason))
    }

    /// `ceil(c × (total + 1) / available)` over available candidates, or
    /// `None` when nothing is available.
    fn load_cap<B: Backend>(c: f64, candidates: &[B]) -> Option<usize> {
        let (mut total, mut available) = (0usize, 0usize);
        for b in candidates.iter().filter(|b| b.is_available()) {
            total = total.saturating_add(b.load());
            available += 1;
        }
        (available > 0).then(|| (c * (total as f64 + 1.0) / available as f64).ceil() as usize)
    }
}

impl<B: Backend> Policy<B> for ConsistentHash {
    fn select(&self, candidates: &[B], ctx: &RequestContext<'_>) -> Option<Decision> {
        let Some((_, key)) = ctx.keys.first() else {
            return self.fallback(candidates, DecisionReason::NoHashKey);
        };
        let ring = Arc::clone(&self.ring.read());
        let len = ring.points.len();
        if len == 0 {
            return self.fallback(candidates, DecisionReason::HashUnmapped);
        }
        let cap = match self.config.bounded_load {
            Some(c) => Some(Self::load_cap(c, candidates)?),
            None => None,
        };
        let h = stable_hash(key.as_bytes(), 0);
        let start = ring.points.partition_point(|p| p.0 < h);
        let mut reason = DecisionReason::HashOwner;
        let mut previous = u32::MAX;
        for step in 0..len {
            let (_, id) = ring.points[(start + step) % len];
            if id == previous {
                continue;
            }
            previous = id;
            let Some(i) = ring.members[id as usize].position_in(candidates) else {
                continue;
            };
            let c = &candidates[i];
            if !c.is_available() {
                if reason == DecisionReason::HashOwner {
                    reason = DecisionReason::HashFailover;
                }
                continue;
            }
            if cap.is_some_and(|cap| c.load() >= cap) {
                reason = DecisionReason::HashBoundedLoad;
                continue;
            }
            return Some(Decision::new(i, reason));
        }
        self.fallback(candidates, DecisionReason::HashUnmapped)
    }
}

impl PolicyState for ConsistentHash {
    fn name(&self) -> &str {
        "consistent_hash"
    }
    fn on_membership(&self, event: MembershipEvent<'_>) {
        // One writer at a time computes the next ring from the current one
        // while readers keep using the current one.
        let _writer = self.update.lock();
        let current = Arc::clone(&self.ring.read());
        let next = match event {
            MembershipEvent::Added { key } if current.index_of(key).is_none() => {
                current.with_added(key, self.config.virtual_nodes)
            }
            MembershipEvent::Removed { key } => match current.index_of(key) {
                Some(index) => current.without(index),
                None => return,
            },
            // Same key, same points: a new lifetime changes nothing here.
            _ => return,
        };
        *self.ring.write() = Arc::new(next);
    }
}
