//! loom: two streams write concurrently while a reader looks up. Each
//! writer's events are applied under its stream's lock and the shared
//! writer lock; the final state must equal applying both streams in any
//! order, and a lookup in between sees each stream's blocks as a prefix of
//! what it stored.
//!
//! Bound: 3 threads, one event each, `LOOM_MAX_PREEMPTIONS=2`.
#![cfg(loom)]

mod loom_support;

use kv_block_index::{EngineHash, Holder, IndexConfig, KvEvent, KvIndex};
use loom::sync::Arc;
use loom::thread;
use loom_support::{model, well_formed};

fn stored(n: u32, tag: i64) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: (0..n)
            .map(|b| EngineHash::from_int(tag * 100 + i64::from(b)))
            .collect(),
        parent_block_hash: None,
        token_ids: (0..n).collect(),
        block_size: 1,
        lora_id: None,
    }
}

#[test]
fn two_streams_store_the_same_prefix_while_a_lookup_runs() {
    model(|| {
        let index: Arc<KvIndex<u8>> = Arc::new(KvIndex::new(IndexConfig {
            block_size: 1,
            max_holders: 2,
            ..Default::default()
        }));
        let a = index.register_worker(0);
        let b = index.register_worker(1);
        let sa = index.stream(a, 0).unwrap();
        let sb = index.stream(b, 0).unwrap();
        let hashes = index.block_hashes(&[0, 1], None);
        let ta = thread::spawn(move || sa.apply(&stored(2, 1)).unwrap());
        let tb = thread::spawn(move || sb.apply(&stored(1, 2)).unwrap());
        let found = index.lookup(&hashes);
        well_formed(&found);
        assert!(found.blocks_of(Holder { worker: a, rank: 0 }) <= 2);
        assert!(found.blocks_of(Holder { worker: b, rank: 0 }) <= 1);
        ta.join().unwrap();
        tb.join().unwrap();
        let found = index.lookup(&hashes);
        well_formed(&found);
        assert_eq!(found.blocks_of(Holder { worker: a, rank: 0 }), 2);
        assert_eq!(found.blocks_of(Holder { worker: b, rank: 0 }), 1);
        assert_eq!(index.stats().pairs, 3);
    });
}
