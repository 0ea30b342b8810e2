//! One place that switches between the shipped synchronization types and
//! loom's models, so the loom models exercise the code the library runs.
//!
//! Normal builds use parking_lot's locks, whose `read`, `write` and `lock`
//! cannot fail: a panic while a lock is held leaves nothing half-written
//! here, so there is no poisoning to handle. Under `--cfg loom` thin wrappers
//! give loom's locks the same signatures (the pattern radix-affinity uses).

#[cfg(not(loom))]
pub(crate) use parking_lot::{Mutex, RwLock};
/// kv-aware's overload state.
#[cfg(all(not(loom), feature = "kv-block-index"))]
pub(crate) use std::sync::atomic::AtomicBool;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

#[cfg(all(loom, feature = "kv-block-index"))]
pub(crate) use loom::sync::atomic::AtomicBool;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// loom's reader-writer lock with parking_lot's infallible signatures.
#[cfg(loom)]
#[derive(Debug)]
pub(crate) struct RwLock<T>(loom::sync::RwLock<T>);

#[cfg(loom)]
impl<T> RwLock<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(loom::sync::RwLock::new(value))
    }

    pub(crate) fn read(&self) -> loom::sync::RwLockReadGuard<'_, T> {
        // A poisoned lock follows a panic, which already fails the model.
        self.0.read().unwrap_or_else(|poison| poison.into_inner())
    }

    pub(crate) fn write(&self) -> loom::sync::RwLockWriteGuard<'_, T> {
        self.0.write().unwrap_or_else(|poison| poison.into_inner())
    }
}

/// loom's mutex with parking_lot's infallible `lock`.
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
}
