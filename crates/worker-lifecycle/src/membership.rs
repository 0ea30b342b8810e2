//! Membership events: how policies learn who is in a pool.

use std::sync::Arc;

use crate::worker::Worker;

/// A change of a pool's or set's membership. Forward these to the
/// load-balancing policies (a cache-aware policy adds the worker to its tree
/// on `Added`, drops its affinity on `Removed`, and does both on `Replaced`).
#[derive(Debug, Clone)]
pub enum MembershipEvent {
    /// A worker joined.
    Added(Arc<Worker>),
    /// A worker left (expired, deregistered, drained or removed by an operator).
    Removed(Arc<Worker>),
    /// The endpoint started a new registration lifetime: `old` left and
    /// `new`, with fresh state, took its place.
    Replaced {
        /// The previous lifetime's worker.
        old: Arc<Worker>,
        /// The new lifetime's worker.
        new: Arc<Worker>,
    },
}

impl MembershipEvent {
    /// The worker that joined, if any.
    pub fn added(&self) -> Option<&Arc<Worker>> {
        match self {
            Self::Added(w) | Self::Replaced { new: w, .. } => Some(w),
            Self::Removed(_) => None,
        }
    }

    /// The worker that left, if any.
    pub fn removed(&self) -> Option<&Arc<Worker>> {
        match self {
            Self::Removed(w) | Self::Replaced { old: w, .. } => Some(w),
            Self::Added(_) => None,
        }
    }
}
