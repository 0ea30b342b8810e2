//! Synchronization shim: std/parking_lot in normal builds, loom's models under
//! `--cfg loom`, so the same tree code is model-checked (see `tests/loom_*.rs`).
//!
//! # What the models check
//!
//! `tests/loom_*.rs` model-check, under loom, with the same code: two new
//! children of one node racing a lookup; a new owner racing a split of the
//! same node; lookups of a text racing its split; a child inserted in place
//! while a lookup searches for a later key (this model fails if the version
//! check of a walk step is removed, and two others fail without the parent
//! check); a third child moving the children to an array while the node
//! arena grows; inserts racing splits of their path, removals that free and
//! reuse its slots, and evictions; eviction and removal racing inserts. The
//! stress test (`tests/stress.rs`) runs writers, lookups and evictions on
//! threads and checks the counters against a recount.
//!
//! # Waiting for a node
//!
//! A thread that finds a node locked spins for a few dozen pauses (a writer
//! holds a node for tens of nanoseconds) and then yields, so that it does not
//! burn a time slice when the holder was descheduled ([`Backoff`]). Waiting
//! for a shard lock is `tree.rs`'s.

#[cfg(not(loom))]
pub(crate) use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering, fence};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering, fence};
#[cfg(loom)]
pub(crate) use loom::sync::{RwLockReadGuard, RwLockWriteGuard};

/// A busy wait for a node lock, or for a node a writer is changing: a few
/// dozen pause instructions (a writer holds a node for tens of
/// nanoseconds), then yields of the thread, so that waiters do not burn a
/// time slice when the holder was descheduled. Under loom every step yields,
/// so the model lets the holder run.
#[derive(Debug, Default)]
// Under loom every step yields, so the count is not read.
#[cfg_attr(loom, allow(dead_code))]
pub(crate) struct Backoff(u32);

/// Pauses before a waiter starts yielding.
#[cfg(not(loom))]
const SPINS_BEFORE_YIELD: u32 = 64;

impl Backoff {
    #[inline]
    pub(crate) fn snooze(&mut self) {
        #[cfg(loom)]
        loom::thread::yield_now();
        #[cfg(not(loom))]
        if self.0 < SPINS_BEFORE_YIELD {
            self.0 += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// A reader-writer lock with parking_lot's infallible `read`/`write` signatures,
/// backed by loom's modelled lock.
#[cfg(loom)]
#[derive(Debug)]
pub(crate) struct RwLock<T>(loom::sync::RwLock<T>);

#[cfg(loom)]
impl<T> RwLock<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(loom::sync::RwLock::new(value))
    }

    pub(crate) fn read(&self) -> RwLockReadGuard<'_, T> {
        // Poisoning only follows a panic, which already fails the model.
        self.0.read().unwrap_or_else(|poison| poison.into_inner())
    }

    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, T> {
        self.0.write().unwrap_or_else(|poison| poison.into_inner())
    }

    pub(crate) fn try_read(&self) -> Option<RwLockReadGuard<'_, T>> {
        self.0.try_read().ok()
    }

    pub(crate) fn try_write(&self) -> Option<RwLockWriteGuard<'_, T>> {
        self.0.try_write().ok()
    }
}

/// A mutex with parking_lot's infallible `lock` signature, backed by loom's
/// modelled mutex.
#[cfg(loom)]
#[derive(Debug)]
pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(loom::sync::Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.0
            .get_mut()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}
