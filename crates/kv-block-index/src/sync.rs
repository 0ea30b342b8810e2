//! Synchronization shim: std atomics and parking_lot in normal builds,
//! loom's models under `--cfg loom`, so the same index code is model-checked
//! (see `tests/loom_*.rs`).

#[cfg(not(loom))]
pub(crate) use std::sync::Arc;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

#[cfg(loom)]
pub(crate) use loom::sync::Arc;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

#[cfg(not(loom))]
pub(crate) use parking_lot::Mutex;

#[cfg(loom)]
use loom::sync::MutexGuard;

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

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        // Poisoning only follows a panic, which already fails the model.
        self.0.lock().unwrap_or_else(|poison| poison.into_inner())
    }
}

/// One step of a wait for readers to leave: a spin hint in normal builds,
/// a yield under loom so the model lets the reader run.
#[inline]
pub(crate) fn wait_step(spins: &mut u32) {
    #[cfg(loom)]
    {
        let _ = spins;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    {
        if *spins < 64 {
            *spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}
