//! An append-only array whose items never move: a shard's node arena.
//!
//! Items live in chunks of doubling size (8, 16, 32, ... items), each
//! allocated once and never reallocated, and an index maps to its chunk with
//! one leading-zeros count. So growing the arena allocates one new chunk and
//! copies nothing: it needs no exclusive lock, and no request ever waits for
//! a shard to be moved (a `Vec` that doubles copies the whole shard while it
//! is write-locked). A chunk is requested zeroed, so its pages cost no
//! resident memory until slots in them are used.
//!
//! A new chunk is published with a release store before any slot in it is
//! handed out, and readers load it with acquire, so a reader that reaches a
//! slot sees it initialized; since nothing moves, a slot's address stays
//! valid for as long as the shard lives, without the exclusive lock.

use crate::heap::Block;
use crate::sync::{AtomicPtr, Ordering};

/// log2 of the first chunk's length.
#[cfg(not(loom))]
const BASE_LOG: u32 = 3;
#[cfg(loom)]
const BASE_LOG: u32 = 1;

/// Chunks needed to address every `u32` index.
const CHUNKS: usize = 33 - BASE_LOG as usize;

/// Where item `index` lives: (chunk, offset in it).
#[inline]
fn locate(index: u32) -> (usize, usize) {
    let j = u64::from(index) + (1 << BASE_LOG);
    let chunk = (63 - j.leading_zeros() - BASE_LOG) as usize;
    (chunk, (j - (1u64 << (chunk as u32 + BASE_LOG))) as usize)
}

/// Length of chunk `chunk`.
#[inline]
fn chunk_len(chunk: usize) -> usize {
    1 << (chunk as u32 + BASE_LOG)
}

/// Items of `T` in chunks that never move. Growth ([`Segmented::grow_to`])
/// must be serialized by the caller; reads are lock-free.
#[derive(Debug)]
pub(crate) struct Segmented<T> {
    chunks: [AtomicPtr<T>; CHUNKS],
}

impl<T> Segmented<T> {
    /// An empty array (no chunk allocated).
    pub(crate) fn new() -> Self {
        Self {
            chunks: std::array::from_fn(|_| AtomicPtr::new(std::ptr::null_mut())),
        }
    }

    /// Item `index`, or `None` if its chunk was never allocated.
    #[inline]
    pub(crate) fn get(&self, index: u32) -> Option<&T> {
        let (chunk, offset) = locate(index);
        // Acquire: the chunk's items were initialized before the pointer was
        // published.
        let ptr = self.chunks[chunk].load(Ordering::Acquire);
        if ptr.is_null() {
            return None;
        }
        // SAFETY: a published chunk holds `chunk_len(chunk)` initialized
        // items, `offset` is below that by `locate`, and chunks are freed only
        // by `drop`, which the borrow of `self` excludes.
        Some(unsafe { &*ptr.add(offset) })
    }

    /// Mutable item `index` (exclusive access), or `None`.
    pub(crate) fn get_mut(&mut self, index: u32) -> Option<&mut T> {
        let (chunk, offset) = locate(index);
        let ptr = self.chunks[chunk].load(Ordering::Relaxed);
        if ptr.is_null() {
            return None;
        }
        // SAFETY: as in `get`, and `&mut self` makes the access exclusive.
        Some(unsafe { &mut *ptr.add(offset) })
    }

    /// Number of items the allocated chunks hold (chunks are allocated in
    /// order, so this is also the first index without an item).
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.chunks
            .iter()
            .enumerate()
            .take_while(|(_, c)| !c.load(Ordering::Acquire).is_null())
            .map(|(i, _)| chunk_len(i))
            .sum()
    }

    /// Makes sure item `index` exists, allocating its chunk with `make` (which
    /// gets the chunk's length) if needed; returns the bytes allocated. The
    /// caller serializes growth (two racing growths of one chunk would leak
    /// one of them).
    pub(crate) fn grow_to(&self, index: u32, make: impl FnOnce(usize) -> Block<T>) -> usize {
        let (chunk, _) = locate(index);
        if !self.chunks[chunk].load(Ordering::Acquire).is_null() {
            return 0;
        }
        let len = chunk_len(chunk);
        let items = make(len);
        assert_eq!(
            items.len(),
            len,
            "a chunk is made with the length asked for"
        );
        let bytes = std::mem::size_of_val(&*items);
        // Release: publishes the initialized items with the pointer.
        self.chunks[chunk].store(items.into_raw(), Ordering::Release);
        bytes
    }
}

impl<T> Drop for Segmented<T> {
    fn drop(&mut self) {
        for (i, chunk) in self.chunks.iter().enumerate() {
            let ptr = chunk.load(Ordering::Relaxed);
            if !ptr.is_null() {
                // SAFETY: `ptr` came from `Block::into_raw` of a block of
                // `chunk_len(i)` items, and nothing can read it any more.
                drop(unsafe { Block::from_raw(ptr, chunk_len(i)) });
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn indices_map_to_doubling_chunks_without_gaps() {
        let mut expected = 0u64;
        for index in 0..100_000u32 {
            let (chunk, offset) = locate(index);
            let start: usize = (0..chunk).map(chunk_len).sum();
            assert_eq!(start + offset, index as usize);
            assert!(offset < chunk_len(chunk));
            expected += 1;
        }
        assert_eq!(expected, 100_000);
        assert_eq!(locate(u32::MAX).0, CHUNKS - 1);
    }

    #[test]
    fn items_never_move_as_the_array_grows() {
        let seg: Segmented<u64> = Segmented::new();
        let make = |len: usize| Block::from_fn(len, |i| i as u64 * 10);
        assert!(seg.get(0).is_none());
        assert_eq!(seg.grow_to(0, make), 8 * 8);
        let first = seg.get(3).map(|v| v as *const u64);
        for index in 8..5000 {
            seg.grow_to(index, |len| Block::from_fn(len, |_| 7));
        }
        assert_eq!(seg.get(3).map(|v| v as *const u64), first);
        assert_eq!(seg.get(3), Some(&30));
        assert_eq!(seg.get(4999), Some(&7));
        assert!(seg.capacity() >= 5000);
        assert_eq!(seg.grow_to(4000, |_| unreachable!()), 0);
    }
}
