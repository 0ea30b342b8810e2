//! The publisher's memory of recent batches.
//!
//! Sequence numbers are assigned under the same lock that stores the
//! payload, so numbers are unique, consecutive, and stored in order whatever
//! the number of publishing tasks; a replay reads a consistent snapshot.
//! `tests/loom_replay_buffer.rs` checks this under every interleaving.

use std::collections::VecDeque;

use crate::sync::{Mutex, lock};

/// A bounded ring of `(sequence number, payload)` pairs, oldest first, that
/// also hands out the sequence numbers (from 0, as vLLM's publisher).
#[derive(Debug)]
pub struct ReplayBuffer<P> {
    inner: Mutex<Inner<P>>,
}

#[derive(Debug)]
struct Inner<P> {
    next_seq: u64,
    capacity: usize,
    entries: VecDeque<(u64, P)>,
}

impl<P: Clone> ReplayBuffer<P> {
    /// A buffer keeping the last `capacity` payloads (vLLM's
    /// `buffer_steps`, 10 000 by default). A capacity of 0 keeps nothing
    /// but still numbers payloads.
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                next_seq: 0,
                capacity,
                entries: VecDeque::with_capacity(capacity.min(1024)),
            }),
        }
    }

    /// Gives `payload` the next sequence number, keeps it (dropping the
    /// oldest when full) and returns the number.
    pub fn push(&self, payload: P) -> u64 {
        self.push_with(|_| payload)
    }

    /// Like [`push`](Self::push), with the payload built from its number
    /// while the lock is held, so that whatever the closure does (sending
    /// it, for the publisher) happens in sequence order.
    pub fn push_with(&self, make: impl FnOnce(u64) -> P) -> u64 {
        let mut inner = lock(&self.inner);
        let seq = inner.next_seq;
        inner.next_seq += 1;
        let payload = make(seq);
        if inner.capacity > 0 {
            if inner.entries.len() == inner.capacity {
                inner.entries.pop_front();
            }
            inner.entries.push_back((seq, payload));
        }
        seq
    }

    /// Every kept payload with a number of at least `from`, in order.
    #[must_use]
    pub fn since(&self, from: u64) -> Vec<(u64, P)> {
        let inner = lock(&self.inner);
        // Numbers are consecutive, so the start is an index.
        let skip = match inner.entries.front() {
            Some((first, _)) => usize::try_from(from.saturating_sub(*first)).unwrap_or(usize::MAX),
            None => 0,
        };
        inner.entries.iter().skip(skip).cloned().collect()
    }

    /// The number the next payload will get.
    #[must_use]
    pub fn next_seq(&self) -> u64 {
        lock(&self.inner).next_seq
    }

    /// How many payloads are kept.
    #[must_use]
    pub fn len(&self) -> usize {
        lock(&self.inner).entries.len()
    }

    /// Whether nothing is kept.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
