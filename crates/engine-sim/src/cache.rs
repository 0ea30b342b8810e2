//! The block-level prefix KV cache.
//!
//! `capacity` physical blocks, each either free, referenced by running (or
//! held) sequences, or cached-but-unreferenced. Full prompt blocks carry
//! their chain hash and stay findable after their sequence ends; when a
//! sequence needs blocks and none are free, the least recently released
//! unreferenced block is evicted. A sequence releases its blocks last to
//! first, so the tail of a prompt is evicted before its head, as in vLLM.

use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Copy, Default)]
struct BlockMeta {
    hash: Option<u64>,
    refs: u32,
    /// Position in the LRU order while unreferenced.
    lru_tick: u64,
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
        }
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
        for &hash in &hashes[hits..] {
            let id = self.take_block()?;
            // A block past the hit limit may already be cached (the whole
            // prompt was a hit): the cached copy stays, this one is private.
            if let std::collections::hash_map::Entry::Vacant(slot) = self.by_hash.entry(hash) {
                slot.insert(id);
                self.blocks[id as usize].hash = Some(hash);
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
}
