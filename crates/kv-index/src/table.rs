//! One shard's open-addressing table: block hash -> holder set, read
//! without locks.
//!
//! Each slot is two atomic words, the key (our block hash, zero = never
//! used) and the holder word. Keys are written once (after the holder word,
//! with release ordering) and stay until the writer rebuilds the table;
//! a block nobody holds keeps its key with an empty holder word (a
//! tombstone) that a rebuild drops. Readers probe linearly with acquire
//! loads and never retry: every holder word they can load is a complete,
//! consistent holder set.
//!
//! The holder word is the compact holder representation:
//! - `0`: nobody holds the block;
//! - low bit set: one or two holder slots inline (bits 1..32 and 32..64,
//!   each stored plus one, zero for "none") — most blocks are held by one
//!   to three workers, and these cost nothing beyond the table slot;
//! - otherwise: a pointer to an immutable [`HeapSet`] (sorted slots plus
//!   their fingerprint), replaced copy-on-write and freed after a grace
//!   period (module `rcu`).

use crate::hash::mix64;
use crate::sync::{AtomicU64, Ordering};

/// A holder set of three or more slots: sorted, immutable once published.
#[derive(Debug)]
pub(crate) struct HeapSet {
    pub(crate) fingerprint: u64,
    pub(crate) slots: Box<[u32]>,
}

impl HeapSet {
    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of::<Self>() + 4 * self.slots.len()
    }
}

/// The fingerprint term of one holder slot; a set's fingerprint is the
/// wrapping sum of its slots' terms.
#[inline]
pub(crate) fn slot_term(slot: u32) -> u64 {
    mix64(u64::from(slot) + 1)
}

/// A decoded holder word, borrowed from the table or a heap set.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Holders<'a> {
    /// One or two slots, sorted (`len` of `slots` used).
    Inline { slots: [u32; 2], len: usize },
    /// Three or more slots.
    Heap(&'a HeapSet),
}

impl<'a> Holders<'a> {
    /// Decodes a non-zero holder word.
    ///
    /// # Safety
    /// A heap word must point to a live [`HeapSet`] for `'a`: the caller
    /// loaded it under a read guard (or is the writer, which frees sets only
    /// after unlinking them and a grace period).
    #[inline]
    pub(crate) unsafe fn decode(word: u64) -> Self {
        if word & 1 == 1 {
            let a = ((word >> 1) & 0x7fff_ffff) as u32;
            let b = (word >> 32) as u32;
            if b == 0 {
                Holders::Inline {
                    slots: [a - 1, 0],
                    len: 1,
                }
            } else {
                Holders::Inline {
                    slots: [a - 1, b - 1],
                    len: 2,
                }
            }
        } else {
            // SAFETY: the caller guarantees the set outlives 'a (see above).
            Holders::Heap(unsafe { &*(word as *const HeapSet) })
        }
    }

    #[inline]
    pub(crate) fn as_slice(&self) -> &[u32] {
        match self {
            Holders::Inline { slots, len } => &slots[..*len],
            Holders::Heap(set) => &set.slots,
        }
    }

    #[inline]
    pub(crate) fn fingerprint(&self) -> u64 {
        match self {
            Holders::Inline { slots, len } => slots[..*len]
                .iter()
                .fold(0u64, |acc, &s| acc.wrapping_add(slot_term(s))),
            Holders::Heap(set) => set.fingerprint,
        }
    }

    #[inline]
    pub(crate) fn contains(&self, slot: u32) -> bool {
        match self {
            Holders::Inline { slots, len } => slots[..*len].contains(&slot),
            Holders::Heap(set) => set.slots.binary_search(&slot).is_ok(),
        }
    }
}

/// The holder word of one or two inline slots (sorted, each below 2^31 - 1).
#[inline]
pub(crate) fn inline_word(slots: &[u32]) -> u64 {
    debug_assert!(!slots.is_empty() && slots.len() <= 2);
    let a = u64::from(slots[0]) + 1;
    let b = slots.get(1).map_or(0, |&s| u64::from(s) + 1);
    1 | (a << 1) | (b << 32)
}

/// Builds the holder word of a sorted slot list; sets of three or more go
/// to a new heap set whose ownership passes to the word.
pub(crate) fn encode(slots: &[u32]) -> u64 {
    match slots.len() {
        0 => 0,
        1 | 2 => inline_word(slots),
        _ => {
            let fingerprint = slots
                .iter()
                .fold(0u64, |acc, &s| acc.wrapping_add(slot_term(s)));
            let set = Box::new(HeapSet {
                fingerprint,
                slots: slots.into(),
            });
            Box::into_raw(set) as u64
        }
    }
}

/// Whether a holder word owns a heap set.
#[inline]
pub(crate) fn is_heap(word: u64) -> bool {
    word != 0 && word & 1 == 0
}

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

    /// Starts loading `key`'s home slot into the cache: lookups and event
    /// batches know their keys in advance, so the misses of many keys
    /// overlap instead of queueing.
    #[inline(always)]
    pub(crate) fn prefetch(&self, key: u64) {
        #[cfg(all(target_arch = "x86_64", not(loom)))]
        {
            let slot: *const Slot = &self.slots[(key as usize) & self.mask];
            // SAFETY: a prefetch is only a hint: it reads nothing the program
            // sees and never faults; the address is in bounds anyway.
            unsafe {
                std::arch::x86_64::_mm_prefetch(slot.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0)
            };
        }
        #[cfg(not(all(target_arch = "x86_64", not(loom))))]
        let _ = key;
    }

    /// The slot index of `key`, or of the empty slot where it would go
    /// (`false`). Writer only.
    pub(crate) fn find(&self, key: u64) -> (usize, bool) {
        let mut i = (key as usize) & self.mask;
        loop {
            let k = self.slots[i].key.load(Ordering::Relaxed);
            if k == key {
                return (i, true);
            }
            if k == 0 {
                return (i, false);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Publishes a new key with its holder word at an empty slot found by
    /// [`Table::find`]: the word first, then the key, both release, so a
    /// reader that sees the key sees the word (and the set it points to).
    pub(crate) fn publish_new(&self, index: usize, key: u64, word: u64) {
        let slot = &self.slots[index];
        slot.word.store(word, Ordering::Release);
        slot.key.store(key, Ordering::Release);
    }
}
