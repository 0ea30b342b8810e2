//! One switch between the real synchronization primitives and loom's models,
//! so that the code loom checks is the code that ships (the tokio `loom`
//! module pattern).

#[cfg(loom)]
pub(crate) use loom::sync::Arc;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize};

#[cfg(not(loom))]
pub(crate) use std::sync::Arc;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize};

pub(crate) use std::sync::atomic::Ordering;

/// The mutex of normal builds: parking_lot's, whose `lock` cannot fail. A
/// panic in one caller leaves every critical section here consistent, so
/// nothing is poisoned and the worker set stays usable for everyone else.
#[cfg(not(loom))]
pub(crate) use parking_lot::Mutex;

/// loom's mutex with parking_lot's infallible `lock` (the pattern
/// radix-affinity uses).
#[cfg(loom)]
#[derive(Debug)]
pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(loom::sync::Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
        // A poisoned lock follows a panic, which already fails the model.
        self.0.lock().unwrap_or_else(|poison| poison.into_inner())
    }
}
