//! The segment cache: token ids of recently seen prompt segments.
//!
//! A segment is a stretch of rendered prompt between two special tokens
//! (a message's body, a role header, the separators). Multi-turn chats
//! repeat all but their newest segments, so a warm request tokenizes only
//! what is new.
//!
//! Keys are a 64-bit hash of the segment text (ahash, seeded randomly per
//! cache, so a client cannot aim collisions), and every hit **compares the
//! stored text with the looked-up text** before it is used: a collision is
//! a miss, never wrong ids. The text costs memory (about as much as the ids:
//! a token is ~4 bytes of text and 4 bytes of id) but makes the cache exact
//! by construction rather than probably exact; a 128-bit hash without
//! verification would save that memory and the comparison (a `memcmp`,
//! nanoseconds per kilobyte) at the price of an argument about
//! probabilities.
//!
//! Concurrency: `shards` independent `parking_lot::Mutex`es chosen by the
//! hash, each held only for a map lookup or insert (tokenization happens
//! outside the lock). Ids are shared as `Arc<[u32]>`, so a hit copies
//! nothing under the lock. There is no lock-free logic to model.
//!
//! Eviction: least recently used per shard, by bytes (text + ids + a fixed
//! per-entry overhead), each shard holding `capacity_bytes / shards`. A
//! recency queue with lazy deletion keeps hits O(1): a hit pushes a fresh
//! (key, stamp) record; eviction pops records and skips the stale ones; the
//! queue is compacted when stale records outnumber live entries.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use parking_lot::Mutex;

/// Bytes charged per entry on top of its text and ids (map slot, queue
/// record, allocation headers).
pub const ENTRY_OVERHEAD_BYTES: usize = 96;

/// How the segment cache served one rendering
/// ([`PromptTokenizer::chat_tokens_with_use`](crate::PromptTokenizer::chat_tokens_with_use)):
/// segments (the text between two added tokens) found in the cache, and
/// segments tokenized because it did not have them. Short segments a
/// tiktoken vocabulary encodes directly, and renderings a tokenizer cannot
/// cut into segments, count in neither.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentUse {
    /// Segments whose ids came from the cache, or from the prefix memo
    /// with the earlier rendering they repeat
    /// ([`PromptTokenizer::prefix_memo_stats`](crate::PromptTokenizer::prefix_memo_stats)).
    pub cache_hits: u32,
    /// Segments tokenized on a miss (and then cached).
    pub cache_misses: u32,
}

/// Counters of a [`SegmentCache`], for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups that found the segment.
    pub hits: u64,
    /// Lookups that did not (including hash collisions).
    pub misses: u64,
    /// Entries evicted to stay within the byte budget.
    pub evictions: u64,
    /// Bytes currently charged (text + ids + overhead per entry).
    pub bytes: u64,
    /// Entries currently held.
    pub entries: u64,
}

struct Entry {
    text: Box<str>,
    ids: Arc<[u32]>,
    stamp: u64,
}

impl Entry {
    fn cost(&self) -> usize {
        self.text.len() + self.ids.len() * 4 + ENTRY_OVERHEAD_BYTES
    }
}

/// The shard maps' hasher: their keys already are seeded 64-bit hashes of
/// the text, so hashing them again (SipHash, by default) would be wasted work.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed; fold anything else in all the same.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, key: u64) {
        self.0 = key;
    }
}

#[derive(Default)]
struct Shard {
    map: HashMap<u64, Entry, BuildHasherDefault<KeyHasher>>,
    recency: VecDeque<(u64, u64)>,
    clock: u64,
    bytes: usize,
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl Shard {
    fn touch(&mut self, key: u64) -> u64 {
        self.clock += 1;
        self.recency.push_back((key, self.clock));
        if self.recency.len() > 2 * self.map.len() + 32 {
            let map = &self.map;
            self.recency
                .retain(|(k, stamp)| map.get(k).is_some_and(|e| e.stamp == *stamp));
        }
        self.clock
    }

    fn evict_to(&mut self, budget: usize) {
        while self.bytes > budget {
            let Some((key, stamp)) = self.recency.pop_front() else {
                break;
            };
            if self.map.get(&key).is_some_and(|e| e.stamp == stamp)
                && let Some(entry) = self.map.remove(&key)
            {
                self.bytes -= entry.cost();
                self.evictions += 1;
            }
        }
    }
}

/// A bounded, sharded map from segment text to its token ids.
pub struct SegmentCache {
    shards: Box<[Mutex<Shard>]>,
    shard_budget: usize,
    hasher: ahash::RandomState,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache")
            .field("shards", &self.shards.len())
            .field("shard_budget", &self.shard_budget)
            .field("stats", &self.stats())
            .finish()
    }
}

impl SegmentCache {
    /// A cache holding at most `capacity_bytes` (split evenly over `shards`,
    /// at least one). A capacity of 0 caches nothing.
    pub fn new(capacity_bytes: usize, shards: usize) -> Self {
        let shards = shards.clamp(1, 1024);
        Self {
            shards: (0..shards).map(|_| Mutex::new(Shard::default())).collect(),
            shard_budget: capacity_bytes / shards,
            hasher: ahash::RandomState::new(),
        }
    }

    fn locate(&self, text: &str) -> (u64, &Mutex<Shard>) {
        let key = self.hasher.hash_one(text);
        // High bits pick the shard; the map hashes the whole key again.
        let index = ((key >> 40) as usize) % self.shards.len();
        (key, &self.shards[index])
    }

    /// The ids of `text`, if cached.
    pub fn get(&self, text: &str) -> Option<Arc<[u32]>> {
        let (key, shard) = self.locate(text);
        let mut guard = shard.lock();
        let shard = &mut *guard;
        let stamp = shard.clock + 1;
        let found = match shard.map.get_mut(&key) {
            Some(entry) if *entry.text == *text => {
                entry.stamp = stamp;
                Some(Arc::clone(&entry.ids))
            }
            _ => None,
        };
        if found.is_some() {
            shard.hits += 1;
            shard.touch(key);
        } else {
            shard.misses += 1;
        }
        found
    }

    /// Remembers `ids` as the tokens of `text`, evicting least recently
    /// used entries of the shard to stay within budget. A segment larger
    /// than a shard's budget is not kept.
    pub fn insert(&self, text: &str, ids: Arc<[u32]>) {
        let mut entry = Entry {
            text: text.into(),
            ids,
            stamp: 0,
        };
        let cost = entry.cost();
        if cost > self.shard_budget {
            return;
        }
        let (key, shard) = self.locate(text);
        let mut shard = shard.lock();
        // The entry goes into the map with its stamp before `touch` records
        // it: `touch` may compact the recency queue, keeping only records
        // whose stamp the map holds, and would otherwise drop the new one,
        // leaving an entry that eviction can never reach.
        entry.stamp = shard.clock + 1;
        if let Some(old) = shard.map.insert(key, entry) {
            shard.bytes -= old.cost();
        }
        shard.touch(key);
        shard.bytes += cost;
        let budget = self.shard_budget;
        shard.evict_to(budget);
    }

    /// The counters, summed over the shards.
    pub fn stats(&self) -> CacheStats {
        let mut stats = CacheStats::default();
        for shard in self.shards.iter() {
            let shard = shard.lock();
            stats.hits += shard.hits;
            stats.misses += shard.misses;
            stats.evictions += shard.evictions;
            stats.bytes += shard.bytes as u64;
            stats.entries += shard.map.len() as u64;
        }
        stats
    }

    /// The byte budget over all shards.
    pub fn capacity_bytes(&self) -> usize {
        self.shard_budget * self.shards.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u32) -> Arc<[u32]> {
        (0..n).collect::<Vec<_>>().into()
    }

    #[test]
    fn hit_returns_what_was_inserted_and_counts() {
        let cache = SegmentCache::new(1 << 20, 4);
        assert!(cache.get("hello").is_none());
        cache.insert("hello", ids(3));
        assert_eq!(cache.get("hello").as_deref(), Some(&[0, 1, 2][..]));
        let stats = cache.stats();
        assert_eq!((stats.hits, stats.misses, stats.entries), (1, 1, 1));
        assert_eq!(stats.bytes as usize, 5 + 12 + ENTRY_OVERHEAD_BYTES);
    }

    #[test]
    fn evicts_least_recently_used_within_budget() {
        let per = 1 + 4 + ENTRY_OVERHEAD_BYTES;
        let cache = SegmentCache::new(3 * per, 1);
        cache.insert("a", ids(1));
        cache.insert("b", ids(1));
        cache.insert("c", ids(1));
        assert!(cache.get("a").is_some()); // a is now the most recent
        cache.insert("d", ids(1)); // evicts b
        assert!(cache.get("b").is_none());
        assert!(cache.get("a").is_some());
        assert!(cache.get("c").is_some());
        assert!(cache.get("d").is_some());
        let stats = cache.stats();
        assert_eq!(stats.evictions, 1);
        assert_eq!(stats.entries, 3);
        assert!(stats.bytes as usize <= 3 * per);
    }

    #[test]
    fn oversized_segments_are_not_kept_and_zero_capacity_caches_nothing() {
        let cache = SegmentCache::new(0, 1);
        cache.insert("x", ids(1));
        assert!(cache.get("x").is_none());
        assert_eq!(cache.stats().entries, 0);
    }

    #[test]
    fn an_entry_reinserted_while_the_recency_queue_compacts_stays_evictable() {
        let per = 1 + 4 + ENTRY_OVERHEAD_BYTES;
        // Whichever re-insert compacts the queue, the entry it leaves must
        // still be the one evicted when another text needs the room.
        for reinserts in 1..80 {
            let cache = SegmentCache::new(per, 1);
            for _ in 0..reinserts {
                cache.insert("a", ids(1));
            }
            cache.insert("b", ids(1));
            assert!(cache.get("a").is_none(), "after {reinserts}: a evicted");
            assert_eq!(cache.get("b").as_deref(), Some(&[0][..]));
            let stats = cache.stats();
            assert_eq!((stats.entries, stats.bytes as usize), (1, per));
        }
    }

    #[test]
    fn recency_queue_stays_bounded_under_hits() {
        let cache = SegmentCache::new(1 << 20, 1);
        cache.insert("k", ids(2));
        for _ in 0..10_000 {
            assert!(cache.get("k").is_some());
        }
        let shard = cache.shards[0].lock();
        assert!(shard.recency.len() <= 2 * shard.map.len() + 33);
    }
}
