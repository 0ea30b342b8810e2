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

/// A mutex that never reports poisoning: every critical section in this
/// crate leaves its data consistent before anything can panic, so a panic in
/// one caller must not take the worker set down for everyone else.
#[derive(Debug, Default)]
pub(crate) struct Mutex<T> {
    #[cfg(loom)]
    inner: loom::sync::Mutex<T>,
    #[cfg(not(loom))]
    inner: std::sync::Mutex<T>,
}

#[cfg(loom)]
pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;
#[cfg(not(loom))]
pub(crate) type MutexGuard<'a, T> = std::sync::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Self {
            #[cfg(loom)]
            inner: loom::sync::Mutex::new(value),
            #[cfg(not(loom))]
            inner: std::sync::Mutex::new(value),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
