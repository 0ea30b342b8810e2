//! Synchronization shim: std's mutex in normal builds, loom's model under
//! `--cfg loom`, so the replay buffer is model-checked as it is compiled
//! (see `tests/loom_replay_buffer.rs`).

#[cfg(loom)]
pub(crate) use loom::sync::Mutex;
#[cfg(not(loom))]
pub(crate) use std::sync::Mutex;

/// Locks `m`, going on after a panic elsewhere (the buffer's state is
/// valid after every statement, so a poisoned lock holds nothing broken).
pub(crate) fn lock<T>(m: &Mutex<T>) -> impl std::ops::DerefMut<Target = T> + '_ {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
