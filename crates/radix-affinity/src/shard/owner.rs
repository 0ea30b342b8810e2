//! A tenant's hold on a node, and a node's owners.

use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// A tenant's hold on one node. Every field is atomic so that a lookup can
/// read it while an insert holding the node's lock writes the array.
#[derive(Debug)]
pub(crate) struct Owner {
    pub(super) tenant: AtomicU32,
    /// Position of this node in the tenant's node list.
    pub(super) pos: AtomicU32,
    /// Children of this node that the tenant also holds; 0 means the node is
    /// one of the tenant's leaves, i.e. an eviction candidate.
    pub(super) held: AtomicU32,
    /// Last use of this node by the tenant.
    pub(super) stamp: AtomicU64,
}

impl Owner {
    #[inline]
    pub(crate) fn tenant(&self) -> u32 {
        self.tenant.load(Ordering::Relaxed)
    }

    #[inline]
    pub(crate) fn stamp(&self) -> u64 {
        self.stamp.load(Ordering::Relaxed)
    }

    #[inline]
    pub(crate) fn held(&self) -> u32 {
        self.held.load(Ordering::Relaxed)
    }

    /// Raises the stamp to `now`, writing only when it is stale so shared hot
    /// nodes are not written on every lookup.
    #[inline]
    pub(crate) fn touch(&self, now: u64) {
        if self.stamp.load(Ordering::Relaxed) < now {
            self.stamp.store(now, Ordering::Relaxed);
        }
    }

    pub(super) fn set(&self, tenant: u32, pos: u32, held: u32, stamp: u64) {
        self.tenant.store(tenant, Ordering::Relaxed);
        self.pos.store(pos, Ordering::Relaxed);
        self.held.store(held, Ordering::Relaxed);
        self.stamp.store(stamp, Ordering::Relaxed);
    }

    pub(super) fn add_held(&self, delta: i32) {
        let held = self.held.load(Ordering::Relaxed);
        self.held
            .store(held.saturating_add_signed(delta), Ordering::Relaxed);
    }
}

/// A node's owners: the inline one, if any, then the array.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Owners<'a> {
    pub(super) first: Option<&'a Owner>,
    pub(super) rest: &'a [Owner],
}

impl<'a> Owners<'a> {
    #[inline]
    pub(crate) fn iter(self) -> impl Iterator<Item = &'a Owner> {
        self.first.into_iter().chain(self.rest)
    }

    #[inline]
    pub(crate) fn is_empty(self) -> bool {
        self.first.is_none()
    }

    pub(super) fn len(self) -> usize {
        usize::from(self.first.is_some()) + self.rest.len()
    }

    #[inline]
    pub(crate) fn owner(self, tenant: u32) -> Option<&'a Owner> {
        self.iter().find(|o| o.tenant() == tenant)
    }

    /// The most recently used tenant of this node (ties: first entry).
    #[inline]
    pub(crate) fn most_recent(self) -> Option<&'a Owner> {
        let mut best: Option<&Owner> = None;
        for o in self.iter() {
            if best.is_none_or(|b| o.stamp() > b.stamp()) {
                best = Some(o);
            }
        }
        best
    }

    pub(super) fn get(self, i: usize) -> &'a Owner {
        match (i, self.first) {
            (0, Some(first)) => first,
            _ => &self.rest[i - 1],
        }
    }
}
