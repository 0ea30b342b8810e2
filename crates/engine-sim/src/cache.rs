//! The block-level prefix KV cache.
//!
//! `capacity` physical blocks, each either free, referenced by running (or
//! held) sequences, or cached-but-unreferenced. Full prompt blocks carry
//! their chain hash and stay findable after their sequence ends; when a
//! sequence needs blocks and none are free, the least recently released
//! unreferenced block is evicted. A sequence releases its blocks last to
//! first, so the tail of a prompt is evicted before its head, as in vLLM.
//!
//! With [`KvCache::set_event_recording`] on, the cache also records every
//! change to its prefix index, in the order it happens, as [`CacheEvent`]s
//! the owner drains: a block becoming findable by its hash, and a hashed
//! block being evicted. No I/O here; the engine groups them per scheduler
//! step and the server publishes them as vLLM's KV events.

use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Copy, Default)]
struct BlockMeta {
    hash: Option<u64>,
    refs: u32,
    /// Position in the LRU order while unreferenced.
    lru_tick: u64,
}

/// One change to the prefix index, as the cache records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CacheEvent {
    /// A full block became findable by its chain hash.
    Stored {
        /// The block's chain hash.
        hash: u64,
        /// The chain hash of the block before it, `None` for a prompt's
        /// first block.
        parent: Option<u64>,
        /// The block's position in the hashes given to
        /// [`KvCache::allocate`] (block `i` holds the sequence's tokens
        /// `i * block_size .. (i + 1) * block_size`).
        block_index: usize,
    },
    /// A hashed block was evicted and its hash left the index.
    Removed {
        /// The evicted block's chain hash.
        hash: u64,
    },
}

/// The blocks granted to one sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// Physical block ids, prompt blocks first, in order.
    pub block_ids: Vec<u32>,
    /// How many leading blocks were prefix-cache hits.
    pub hit_blocks: usize,
}

/// A fixed-capacity pool of KV blocks with a prefix index and LRU eviction
/// of unreferenced blocks.
#[derive(Debug, Clone)]
pub struct KvCache {
    blocks: Vec<BlockMeta>,
    free: Vec<u32>,
    by_hash: HashMap<u64, u32>,
    lru: BTreeMap<u64, u32>,
    next_tick: u64,
    referenced: usize,
    record_events: bool,
    events: Vec<CacheEvent>,
}

impl KvCache {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        let capacity = u32::try_from(capacity).unwrap_or(u32::MAX);
        KvCache {
            blocks: vec![BlockMeta::default(); capacity as usize],
            // Popped from the end: block 0 is handed out first.
            free: (0..capacity).rev().collect(),
            by_hash: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 0,
            referenced: 0,
            record_events: false,
            events: Vec::new(),
        }
    }

    /// Turns the recording of [`CacheEvent`]s on or off (off by default, so
    /// a simulator that does not read them pays nothing). Turning it off
    /// drops what was recorded and not drained.
    pub fn set_event_recording(&mut self, on: bool) {
        self.record_events = on;
        if !on {
            self.events.clear();
        }
    }

    /// Whether [`CacheEvent`]s are recorded.
    pub fn records_events(&self) -> bool {
        self.record_events
    }

    /// Takes the recorded changes, oldest first.
    pub fn drain_events(&mut self) -> std::vec::Drain<'_, CacheEvent> {
        self.events.drain(..)
    }

    /// The chain hashes of every cached block (referenced or not), in no
    /// particular order: the set a consumer of the events should hold.
    pub fn cached_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_hash.keys().copied()
    }

    /// Total blocks.
    pub fn capacity(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks referenced by live sequences.
    pub fn referenced_blocks(&self) -> usize {
        self.referenced
    }

    /// Blocks that hold a hash (referenced or not).
    pub fn cached_blocks(&self) -> usize {
        self.by_hash.len()
    }

    /// The fraction of blocks in use by live sequences, as vLLM's
    /// `kv_cache_usage_perc` (cached but unreferenced blocks count as free).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            0.0
        } else {
            self.referenced as f64 / self.blocks.len() as f64
        }
    }

    /// Whether a block with this chain hash is cached.
    pub fn contains(&self, hash: u64) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// How many leading hashes of `hashes` are cached.
    pub fn prefix_hits(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|hash| self.by_hash.contains_key(hash))
            .count()
    }

    /// Grants a sequence one block per entry of `hashes` (its full prompt
    /// blocks, sharing any cached leading blocks, at most `max_hit_blocks` of
    /// them) plus `extra_blocks` private blocks (a partial prompt block and
    /// the output). Returns `None`, changing nothing, when the blocks do not
    /// fit even after evicting every unreferenced block.
    pub fn allocate(
        &mut self,
        hashes: &[u64],
        max_hit_blocks: usize,
        extra_blocks: usize,
    ) -> Option<Allocation> {
        let hits = self.prefix_hits(hashes).min(max_hit_blocks);
        let hit_ids: Vec<u32> = hashes[..hits].iter().map(|h| self.by_hash[h]).collect();
        let newly_referenced = hit_ids
            .iter()
            .filter(|&&id| self.blocks[id as usize].refs == 0)
            .count();
        let new_blocks = hashes.len() - hits + extra_blocks;
        if self.referenced + newly_referenced + new_blocks > self.blocks.len() {
            return None;
        }
        let mut block_ids = Vec::with_capacity(hashes.len() + extra_blocks);
        for id in hit_ids {
            self.acquire(id);
            block_ids.push(id);
        }
        for (index, &hash) in hashes.iter().enumerate().skip(hits) {
            let id = self.take_block()?;
            // A block past the hit limit may already be cached (the whole
            // prompt was a hit): the cached copy stays, this one is private.
            if let std::collections::hash_map::Entry::Vacant(slot) = self.by_hash.entry(hash) {
                slot.insert(id);
                self.blocks[id as usize].hash = Some(hash);
                if self.record_events {
                    self.events.push(CacheEvent::Stored {
                        hash,
                        parent: index.checked_sub(1).map(|p| hashes[p]),
                        block_index: index,
                    });
                }
            }
            block_ids.push(id);
        }
        for _ in 0..extra_blocks {
            let id = self.take_block()?;
            block_ids.push(id);
        }
        Some(Allocation {
            block_ids,
            hit_blocks: hits,
        })
    }

    /// Drops one reference to each block, last to first. Hashed blocks that
    /// become unreferenced join the LRU order; private ones become free.
    pub fn release(&mut self, block_ids: &[u32]) {
        for &id in block_ids.iter().rev() {
            let Some(meta) = self.blocks.get_mut(id as usize) else {
                continue;
            };
            if meta.refs == 0 {
                continue;
            }
            meta.refs -= 1;
            if meta.refs > 0 {
                continue;
            }
            self.referenced -= 1;
            if meta.hash.is_some() {
                meta.lru_tick = self.next_tick;
                self.lru.insert(self.next_tick, id);
                self.next_tick += 1;
            } else {
                self.free.push(id);
            }
        }
    }

    fn acquire(&mut self, id: u32) {
        let meta = &mut self.blocks[id as usize];
        if meta.refs == 0 {
            self.lru.remove(&meta.lru_tick);
            self.referenced += 1;
        }
        meta.refs += 1;
    }

    /// A free block, evicting the least recently used unreferenced one if
    /// needed; the block comes back referenced once and unhashed.
    fn take_block(&mut self) -> Option<u32> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let (_, id) = self.lru.pop_first()?;
                if let Some(hash) = self.blocks[id as usize].hash.take() {
                    self.by_hash.remove(&hash);
                    if self.record_events {
                        self.events.push(CacheEvent::Removed { hash });
                    }
                }
                id
            }
        };
        let meta = &mut self.blocks[id as usize];
        meta.refs = 1;
        meta.hash = None;
        self.referenced += 1;
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_share_blocks_and_eviction_is_lru() {
        let mut cache = KvCache::new(4);
        let a = cache.allocate(&[1, 2], 2, 0).expect("fits");
        assert_eq!(a.hit_blocks, 0);
        cache.release(&a.block_ids);
        let b = cache.allocate(&[1, 3], 2, 0).expect("fits");
        assert_eq!(b.hit_blocks, 1);
        assert_eq!(b.block_ids[0], a.block_ids[0]);
        cache.release(&b.block_ids);
        // 3 cached blocks (1, 2, 3); LRU order: 2 (oldest), 3, 1.
        let c = cache.allocate(&[9, 8], 2, 0).expect("fits by evicting");
        assert!(!cache.contains(2));
        assert!(cache.contains(1) && cache.contains(3));
        assert_eq!(cache.referenced_blocks(), 2);
        cache.release(&c.block_ids);
        assert!(cache.allocate(&[], 0, 5).is_none());
        assert_eq!(cache.referenced_blocks(), 0);
    }

    #[test]
    fn records_stores_and_evictions_in_order() {
        let mut cache = KvCache::new(3);
        let a = cache.allocate(&[1, 2], 2, 0).expect("fits");
        assert_eq!(cache.drain_events().count(), 0, "recording is off");
        cache.release(&a.block_ids);
        cache.set_event_recording(true);
        // Block 1 is a hit (no event); 5 is new; 6 needs an eviction of the
        // least recently released block, 2 (the prompt's tail).
        let b = cache.allocate(&[1, 5, 6], 3, 0).expect("fits");
        let events: Vec<_> = cache.drain_events().collect();
        assert_eq!(
            events,
            vec![
                CacheEvent::Stored {
                    hash: 5,
                    parent: Some(1),
                    block_index: 1
                },
                CacheEvent::Removed { hash: 2 },
                CacheEvent::Stored {
                    hash: 6,
                    parent: Some(5),
                    block_index: 2
                },
            ]
        );
        let mut held: Vec<u64> = cache.cached_hashes().collect();
        held.sort_unstable();
        assert_eq!(held, vec![1, 5, 6]);
        cache.release(&b.block_ids);
        // A private block takes the least recently released one: 6.
        let c = cache.allocate(&[], 0, 1).expect("fits");
        assert_eq!(
            cache.drain_events().collect::<Vec<_>>(),
            vec![CacheEvent::Removed { hash: 6 }]
        );
        cache.release(&c.block_ids);
    }
}
