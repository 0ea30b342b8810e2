//! Grace periods for the lock-free read path.
//!
//! Readers announce themselves in one of two counters (chosen by the current
//! parity) and re-check the parity after announcing; a reader never waits.
//! A writer that unlinked something (a replaced chain state or hash buffer,
//! a grown table) calls [`Rcu::synchronize`]: it flips the parity and waits
//! until the old parity's counter drains. Every reader that could still see
//! the unlinked object announced under the old parity before the flip, so
//! once that counter is zero the object can be freed. Readers that announced
//! under the old parity after the flip see the parity changed, withdraw and
//! retry, so they never delay the writer for long and never see freed
//! memory. Writers wait for readers; readers never wait for writers.

use crate::sync::{AtomicUsize, Mutex, Ordering, wait_step};

/// Two reader counters and the parity that picks one.
#[derive(Debug)]
pub(crate) struct Rcu {
    parity: AtomicUsize,
    readers: [AtomicUsize; 2],
    /// Serializes grace periods (two overlapping flips could each wait on
    /// the wrong counter).
    flips: Mutex<()>,
}

/// An announced reader: while it lives, nothing unlinked after it was
/// created is freed.
#[derive(Debug)]
pub(crate) struct ReadGuard<'a> {
    rcu: &'a Rcu,
    parity: usize,
}

impl Rcu {
    pub(crate) fn new() -> Self {
        Self {
            parity: AtomicUsize::new(0),
            readers: [AtomicUsize::new(0), AtomicUsize::new(0)],
            flips: Mutex::new(()),
        }
    }

    /// Announces a reader. Never blocks: it retries only when a writer
    /// flipped the parity between its two loads.
    pub(crate) fn read(&self) -> ReadGuard<'_> {
        loop {
            let parity = self.parity.load(Ordering::SeqCst);
            self.readers[parity].fetch_add(1, Ordering::SeqCst);
            // A read-modify-write, not a load: it reads the latest parity,
            // and if the writer's flip comes after it, the flip (also a
            // read-modify-write) synchronizes with it, so the writer then
            // sees this reader's announcement. This needs no store-load
            // ordering, which loom does not model for SeqCst accesses.
            if self.parity.fetch_add(0, Ordering::SeqCst) == parity {
                return ReadGuard { rcu: self, parity };
            }
            self.readers[parity].fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Waits until every reader announced before this call has left.
    pub(crate) fn synchronize(&self) {
        let _flip = self.flips.lock();
        let old = self.parity.fetch_xor(1, Ordering::SeqCst);
        let mut spins = 0;
        while self.readers[old].load(Ordering::SeqCst) != 0 {
            wait_step(&mut spins);
        }
    }
}

impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        self.rcu.readers[self.parity].fetch_sub(1, Ordering::SeqCst);
    }
}
