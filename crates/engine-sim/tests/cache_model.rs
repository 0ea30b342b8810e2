//! The KV cache against a simple reference model: hits, LRU eviction order
//! and refusal under capacity pressure, for random request sequences.

use engine_sim::cache::KvCache;
use engine_sim::tokens::block_hashes;
use proptest::prelude::*;

/// The reference: cached hashes in LRU order (oldest first); between
/// requests nothing is referenced, so every cached hash occupies a block.
struct Model {
    capacity: usize,
    lru: Vec<u64>,
}

impl Model {
    /// Returns the hit count, or None when the request cannot fit.
    fn run(&mut self, hashes: &[u64], extra: usize) -> Option<usize> {
        let hits = hashes.iter().take_while(|h| self.lru.contains(h)).count();
        if hits + (hashes.len() - hits) + extra > self.capacity {
            return None;
        }
        self.lru.retain(|h| !hashes[..hits].contains(h));
        let mut occupied = self.lru.len() + hits;
        let mut hashed = vec![true; hits];
        let mut take = |lru: &mut Vec<u64>| {
            if occupied < self.capacity {
                occupied += 1;
            } else {
                lru.remove(0);
            }
        };
        for (i, hash) in hashes.iter().enumerate().skip(hits) {
            take(&mut self.lru);
            let held = self.lru.contains(hash)
                || hashes[..i]
                    .iter()
                    .zip(&hashed)
                    .any(|(h, k)| h == hash && *k);
            hashed.push(!held);
        }
        for _ in 0..extra {
            take(&mut self.lru);
        }
        // Release, last block first.
        for (hash, is_hashed) in hashes.iter().zip(&hashed).rev() {
            if *is_hashed {
                self.lru.push(*hash);
            }
        }
        Some(hits)
    }
}

fn prompt(symbols: &[u8]) -> Vec<u64> {
    let tokens: Vec<u32> = symbols
        .iter()
        .flat_map(|&s| std::iter::repeat_n(u32::from(s), 16))
        .collect();
    block_hashes(&tokens, 16)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    #[test]
    fn cache_matches_the_reference_model(
        capacity in 3usize..12,
        requests in prop::collection::vec(
            (prop::collection::vec(0u8..3, 1..6), 0usize..3),
            1..40,
        ),
    ) {
        let mut cache = KvCache::new(capacity);
        let mut model = Model { capacity, lru: Vec::new() };
        for (symbols, extra) in requests {
            let hashes = prompt(&symbols);
            let expected = model.run(&hashes, extra);
            let got = cache.allocate(&hashes, hashes.len(), extra);
            prop_assert_eq!(got.as_ref().map(|a| a.hit_blocks), expected);
            if let Some(allocation) = got {
                prop_assert_eq!(allocation.block_ids.len(), hashes.len() + extra);
                cache.release(&allocation.block_ids);
            }
            prop_assert_eq!(cache.referenced_blocks(), 0);
            prop_assert_eq!(cache.cached_blocks(), model.lru.len());
            for hash in &model.lru {
                prop_assert!(cache.contains(*hash));
            }
        }
    }
}
