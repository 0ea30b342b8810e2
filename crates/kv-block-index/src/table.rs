//! The head table: the first block hash of each chain -> the chain's id,
//! read without locks.
//!
//! Open addressing with linear probing over two atomic words per slot, the
//! key (our block hash, zero = never used) and the value (chain id plus one,
//! zero = no chain: a tombstone that a rebuild drops). Keys are written once
//! (after the value, with release ordering) and stay until the writer
//! rebuilds the table into a new one, published by a pointer swap; readers
//! probe with acquire loads and never retry. A value a reader loads may be
//! stale (the chain was freed and its id reused): readers check the chain's
//! first hash, so a stale value reads as "absent" or as the right chain.

use crate::sync::{AtomicU64, Ordering};

#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) key: AtomicU64,
    pub(crate) word: AtomicU64,
}

/// A power-of-two table of slots, never more than three quarters used
/// (live keys plus tombstones), so every probe ends at an empty slot.
#[derive(Debug)]
pub(crate) struct Table {
    pub(crate) mask: usize,
    pub(crate) slots: Box<[Slot]>,
}

impl Table {
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        let capacity = capacity.next_power_of_two().max(4);
        let slots = (0..capacity)
            .map(|_| Slot {
                key: AtomicU64::new(0),
                word: AtomicU64::new(0),
            })
            .collect();
        Self {
            mask: capacity - 1,
            slots,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Whether `used` keys fit without passing the load limit.
    pub(crate) fn fits(&self, used: usize) -> bool {
        used * 4 <= self.capacity() * 3
    }

    /// The holder word of `key` (zero when absent). Lock-free.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> u64 {
        let mut i = (key as usize) & self.mask;
        loop {
            let slot = &self.slots[i];
            let k = slot.key.load(Ordering::Acquire);
            if k == key {
                return slot.word.load(Ordering::Acquire);
            }
            if k == 0 {
                return 0;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Publishes a new key with its value at an empty slot found by
    /// [`Shadow::find`]: the word first, then the key, both release, so a
    /// reader that sees the key sees the word (and the set it points to).
    pub(crate) fn publish_new(&self, index: usize, key: u64, word: u64) {
        let slot = &self.slots[index];
        slot.word.store(word, Ordering::Release);
        slot.key.store(key, Ordering::Release);
    }
}

/// The writer's plain copy of the current table's keys and values. The
/// writer finds slots here and only ever stores to the shared table, never
/// loads from it: cheaper, and it leaves every reader load paired with the
/// writer store it races (which is what loom's models must see).
#[derive(Debug)]
pub(crate) struct Shadow {
    pub(crate) keys: Vec<u64>,
    pub(crate) words: Vec<u64>,
}

impl Shadow {
    /// The shadow of a new, empty table of `capacity` slots.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            keys: vec![0; capacity],
            words: vec![0; capacity],
        }
    }

    /// The slot index of `key`, or of the empty slot where it would go
    /// (`false`).
    pub(crate) fn find(&self, key: u64) -> (usize, bool) {
        let mask = self.keys.len() - 1;
        let mut i = (key as usize) & mask;
        loop {
            let k = self.keys[i];
            if k == key {
                return (i, true);
            }
            if k == 0 {
                return (i, false);
            }
            i = (i + 1) & mask;
        }
    }

    /// The value of `key` (zero when absent).
    pub(crate) fn get(&self, key: u64) -> u64 {
        match self.find(key) {
            (i, true) => self.words[i],
            _ => 0,
        }
    }
}
