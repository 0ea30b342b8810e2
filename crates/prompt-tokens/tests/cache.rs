//! The segment cache against a naive reference model (proptest), and a
//! multi-threaded stress test: a hit always returns the ids inserted for
//! exactly that text.

use std::sync::Arc;

use prompt_tokens::{ENTRY_OVERHEAD_BYTES, SegmentCache};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Insert(u8, u8),
    Get(u8),
}

fn text(key: u8) -> String {
    format!("segment-{key}")
}

fn ids(key: u8, len: u8) -> Vec<u32> {
    (0..u32::from(len))
        .map(|i| u32::from(key) * 1000 + i)
        .collect()
}

/// Most recent last; evicts from the front until within budget.
#[derive(Default)]
struct Model {
    entries: Vec<(String, Vec<u32>)>,
}

impl Model {
    fn cost(e: &(String, Vec<u32>)) -> usize {
        e.0.len() + e.1.len() * 4 + ENTRY_OVERHEAD_BYTES
    }
    fn bytes(&self) -> usize {
        self.entries.iter().map(Self::cost).sum()
    }
    fn get(&mut self, t: &str) -> Option<Vec<u32>> {
        let at = self.entries.iter().position(|e| e.0 == t)?;
        let e = self.entries.remove(at);
        let ids = e.1.clone();
        self.entries.push(e);
        Some(ids)
    }
    fn insert(&mut self, t: String, v: Vec<u32>, budget: usize) -> u64 {
        let e = (t, v);
        if Self::cost(&e) > budget {
            return 0;
        }
        self.entries.retain(|x| x.0 != e.0);
        self.entries.push(e);
        let mut evicted = 0;
        while self.bytes() > budget {
            self.entries.remove(0);
            evicted += 1;
        }
        evicted
    }
}

proptest! {
    #[test]
    fn single_shard_cache_is_an_lru_by_bytes(
        ops in prop::collection::vec(prop_oneof![
            (0u8..12, 0u8..40).prop_map(|(k, n)| Op::Insert(k, n)),
            (0u8..12).prop_map(Op::Get),
        ], 1..200),
        budget in 0usize..1500,
    ) {
        let cache = SegmentCache::new(budget, 1);
        let mut model = Model::default();
        let (mut hits, mut misses, mut evictions) = (0, 0, 0);
        for op in ops {
            match op {
                Op::Insert(k, n) => {
                    cache.insert(&text(k), ids(k, n).into());
                    evictions += model.insert(text(k), ids(k, n), budget);
                }
                Op::Get(k) => {
                    let got = cache.get(&text(k)).map(|a| a.to_vec());
                    let want = model.get(&text(k));
                    if want.is_some() { hits += 1 } else { misses += 1 }
                    prop_assert_eq!(got, want);
                }
            }
            let stats = cache.stats();
            prop_assert_eq!(stats.bytes as usize, model.bytes());
            prop_assert_eq!(stats.entries as usize, model.entries.len());
            prop_assert!(stats.bytes as usize <= budget);
        }
        let stats = cache.stats();
        prop_assert_eq!((stats.hits, stats.misses, stats.evictions), (hits, misses, evictions));
    }
}

#[test]
fn concurrent_hits_return_the_ids_of_their_own_text() {
    let cache = Arc::new(SegmentCache::new(16 * 1024, 4));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let cache = Arc::clone(&cache);
            std::thread::spawn(move || {
                let mut hits = 0u32;
                for i in 0..5_000u32 {
                    let key = ((i * 7 + t * 13) % 200) as u8;
                    match cache.get(&text(key)) {
                        Some(found) => {
                            assert_eq!(&found[..], &ids(key, key % 30)[..]);
                            hits += 1;
                        }
                        None => cache.insert(&text(key), ids(key, key % 30).into()),
                    }
                }
                hits
            })
        })
        .collect();
    let hits: u32 = threads.into_iter().map(|h| h.join().unwrap()).sum();
    let stats = cache.stats();
    assert_eq!(stats.hits, u64::from(hits));
    assert!(stats.hits > 0 && stats.evictions > 0, "{stats:?}");
    assert!(stats.bytes <= 16 * 1024);
}
