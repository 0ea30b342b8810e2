//! One place that switches between `std` and `loom` synchronization types,
//! so the loom models exercise the same code the library runs.

#[cfg(loom)]
pub(crate) use loom::sync::{
    Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
    atomic::{AtomicU64, AtomicUsize, Ordering},
};
#[cfg(not(loom))]
pub(crate) use std::sync::{
    Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
    atomic::{AtomicU64, AtomicUsize, Ordering},
};

/// Read-locks, ignoring poisoning: every writer here leaves the protected
/// value consistent before it can panic, so a poisoned lock still holds a
/// usable value and a routing decision must not fail because of it.
pub(crate) fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T>
where
    T: ?Sized,
{
    lock.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Write-locks, ignoring poisoning (see [`read`]).
pub(crate) fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T>
where
    T: ?Sized,
{
    lock.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Locks a mutex, ignoring poisoning (see [`read`]).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T>
where
    T: ?Sized,
{
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
