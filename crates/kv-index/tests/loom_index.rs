//! loom: lookups race writers without locks. Under loom the index has two
//! shards of four slots, so a handful of blocks grows a table (a new table
//! is published and the old one retired after a grace period), and a third
//! holder moves a block's holders to a heap array (replaced copy-on-write,
//! the old array retired). Readers must only ever see states some order of
//! the events produces, block by block, and never freed memory (loom
//! tracks every allocation and reports use after free and leaks).
//!
//! Bound: 2 threads, `LOOM_MAX_PREEMPTIONS=2`.
#![cfg(loom)]

mod loom_support;

use kv_index::{EngineHash, Holder, IndexConfig, KvEvent, KvIndex};
use loom::sync::Arc;
use loom::thread;
use loom_support::model;

const BS: usize = 1;

fn config() -> IndexConfig {
    IndexConfig {
        block_size: BS,
        max_holders: 4,
    }
}

fn stored(first: u32, n: u32, tag: i64) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: (first..first + n)
            .map(|b| EngineHash::from_int(tag * 100 + i64::from(b)))
            .collect(),
        parent_block_hash: first
            .checked_sub(1)
            .map(|p| EngineHash::from_int(tag * 100 + i64::from(p))),
        token_ids: (first..first + n).collect(),
        block_size: BS,
        lora_id: None,
    }
}

#[test]
fn a_lookup_races_a_store_that_grows_a_table() {
    model(|| {
        let index: Arc<KvIndex<u8>> = Arc::new(KvIndex::new(config()));
        let a = index.register_worker(0);
        // Six blocks in two shards of four slots: at least one table grows.
        let prompt: Vec<u32> = (0..6).collect();
        let hashes = index.block_hashes(&prompt, None);
        index.apply(a, 0, &stored(0, 2, 1)).unwrap();
        let writer = {
            let index = Arc::clone(&index);
            thread::spawn(move || index.apply(a, 0, &stored(2, 4, 1)).unwrap())
        };
        let found = index.lookup(&hashes);
        let blocks = found.blocks_of(Holder { worker: a, rank: 0 });
        assert!((2..=6).contains(&blocks), "{blocks}");
        writer.join().unwrap();
        assert_eq!(
            index
                .lookup(&hashes)
                .blocks_of(Holder { worker: a, rank: 0 }),
            6
        );
    });
}

#[test]
fn a_lookup_races_a_third_holder_and_its_removal() {
    model(|| {
        let index: Arc<KvIndex<u8>> = Arc::new(KvIndex::new(config()));
        let ids: Vec<_> = (0..3).map(|k| index.register_worker(k)).collect();
        let hashes = index.block_hashes(&[7], None);
        let one = |tag| KvEvent::BlockStored {
            block_hashes: vec![EngineHash::from_int(tag)],
            parent_block_hash: None,
            token_ids: vec![7],
            block_size: BS,
            lora_id: None,
        };
        index.apply(ids[0], 0, &one(1)).unwrap();
        index.apply(ids[1], 0, &one(2)).unwrap();
        let writer = {
            let index = Arc::clone(&index);
            let c = ids[2];
            thread::spawn(move || {
                // Inline pair -> heap array of three -> back to two inline.
                index.apply(c, 0, &one(3)).unwrap();
                index
                    .apply(
                        c,
                        0,
                        &KvEvent::BlockRemoved {
                            block_hashes: vec![EngineHash::from_int(3)],
                        },
                    )
                    .unwrap();
            })
        };
        let found = index.lookup(&hashes);
        let n = found.matches().len();
        assert!(n == 2 || n == 3, "{n}");
        assert_eq!(
            found.blocks_of(Holder {
                worker: ids[0],
                rank: 0
            }),
            1
        );
        assert_eq!(
            found.blocks_of(Holder {
                worker: ids[1],
                rank: 0
            }),
            1
        );
        writer.join().unwrap();
        assert_eq!(index.holders_of(hashes[0]).len(), 2);
    });
}

#[test]
fn an_unregistered_slot_is_not_reported_for_its_next_owner() {
    model(|| {
        let index: Arc<KvIndex<u8>> = Arc::new(KvIndex::new(IndexConfig {
            block_size: BS,
            max_holders: 1,
        }));
        let old = index.register_worker(0);
        let hashes = index.block_hashes(&[5], None);
        index.apply(old, 0, &stored(5, 1, 1)).unwrap();
        let new = index.register_worker(1);
        let writer = {
            let index = Arc::clone(&index);
            thread::spawn(move || {
                assert!(index.unregister_worker(old));
                // The only slot is free again only after the grace period.
                index.apply(new, 0, &KvEvent::AllBlocksCleared).unwrap();
            })
        };
        // The block is held by the old worker or by nobody; never by the
        // new owner of the slot.
        let found = index.lookup(&hashes);
        assert_eq!(
            found.blocks_of(Holder {
                worker: new,
                rank: 0
            }),
            0
        );
        assert!(found.matches().len() <= 1);
        writer.join().unwrap();
        assert!(index.lookup(&hashes).matches().is_empty());
    });
}
