//! loom: lookups race writers without locks. Under loom a chain's hash
//! buffer starts with two slots, the chain directory with one and the head
//! table with four, so a few blocks grow a buffer (a new state points to a
//! copied buffer, the old one is retired), a second chain grows the
//! directory, and a holder change replaces a chain's state copy-on-write
//! (splitting or merging segments). Freed chains give their id to the next
//! chain, and cut-back chains move to a shorter buffer; decode steps and
//! runs extended by a block change a published state in place (its length,
//! a segment's start). Readers must only ever see states some order of the
//! events produces, block by block, every reported holder must hold at
//! least the first block, and a store that takes a stream over its cap
//! drops the stream's oldest block (a chain's head, whose children stay)
//! within the same event; no reader may touch freed memory (under loom
//! every replaced state is reclaimed at once; freeing without the grace
//! period crashes these models).
//!
//! Bound: 2 threads, `LOOM_MAX_PREEMPTIONS=2`.
#![cfg(loom)]

mod loom_support;

use kv_block_index::{EngineHash, Holder, IndexConfig, KvEvent, KvIndex};
use loom::sync::Arc;
use loom::thread;
use loom_support::{model, well_formed};

const BS: usize = 1;

fn config() -> IndexConfig {
    IndexConfig {
        block_size: BS,
        max_holders: 4,
        ..Default::default()
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
        well_formed(&found);
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
        well_formed(&found);
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
            ..Default::default()
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
        well_formed(&found);
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

#[test]
fn a_lookup_races_a_store_that_branches_off_a_chain() {
    model(|| {
        let index: Arc<KvIndex<u8>> = Arc::new(KvIndex::new(config()));
        let a = index.register_worker(0);
        let b = index.register_worker(1);
        // a holds 0, 1, 2; b stores 0, 1, 9: the chain's segment [0, 2)
        // gains b, and 9 starts a second chain (growing the directory).
        index.apply(a, 0, &stored(0, 3, 1)).unwrap();
        let branch = KvEvent::BlockStored {
            block_hashes: (0..3).map(|k| EngineHash::from_int(200 + k)).collect(),
            parent_block_hash: None,
            token_ids: vec![0, 1, 9],
            block_size: BS,
            lora_id: None,
        };
        let hashes = index.block_hashes(&[0, 1, 9], None);
        let writer = {
            let index = Arc::clone(&index);
            thread::spawn(move || index.apply(b, 0, &branch).unwrap())
        };
        let found = index.lookup(&hashes);
        well_formed(&found);
        assert_eq!(found.blocks_of(Holder { worker: a, rank: 0 }), 2);
        let of_b = found.blocks_of(Holder { worker: b, rank: 0 });
        assert!([0, 2, 3].contains(&of_b), "{of_b}");
        writer.join().unwrap();
        let found = index.lookup(&hashes);
        well_formed(&found);
        assert_eq!(found.blocks_of(Holder { worker: b, rank: 0 }), 3);
        assert_eq!(found.blocks_of(Holder { worker: a, rank: 0 }), 2);
    });
}

#[test]
fn a_lookup_races_a_chain_freed_and_its_id_reused() {
    model(|| {
        let index: Arc<KvIndex<u8>> = Arc::new(KvIndex::new(config()));
        let a = index.register_worker(0);
        index.apply(a, 0, &stored(0, 2, 1)).unwrap();
        let old = index.block_hashes(&[0, 1], None);
        let new = index.block_hashes(&[5], None);
        let writer = {
            let index = Arc::clone(&index);
            thread::spawn(move || {
                // The chain [0, 1] loses its last holder and is freed; the
                // next chain, [5], takes its id and its directory slot.
                index
                    .apply(
                        a,
                        0,
                        &KvEvent::BlockRemoved {
                            block_hashes: vec![
                                EngineHash::from_int(100),
                                EngineHash::from_int(101),
                            ],
                        },
                    )
                    .unwrap();
                index
                    .apply(
                        a,
                        0,
                        &KvEvent::BlockStored {
                            block_hashes: vec![EngineHash::from_int(300)],
                            parent_block_hash: None,
                            token_ids: vec![5],
                            block_size: BS,
                            lora_id: None,
                        },
                    )
                    .unwrap();
            })
        };
        let found = index.lookup(&old);
        well_formed(&found);
        let before = found.blocks_of(Holder { worker: a, rank: 0 });
        assert!(before == 0 || before == 2, "{before}");
        let found = index.lookup(&new);
        well_formed(&found);
        assert!(found.blocks_of(Holder { worker: a, rank: 0 }) <= 1);
        writer.join().unwrap();
        assert!(index.lookup(&old).matches().is_empty());
        assert_eq!(
            index.lookup(&new).blocks_of(Holder { worker: a, rank: 0 }),
            1
        );
        assert_eq!(index.stats().pairs, 1);
    });
}

#[test]
fn a_lookup_races_a_removal_that_cuts_a_chain_back() {
    model(|| {
        let index: Arc<KvIndex<u8>> = Arc::new(KvIndex::new(config()));
        let a = index.register_worker(0);
        index.apply(a, 0, &stored(0, 3, 1)).unwrap();
        let hashes = index.block_hashes(&[0, 1, 2], None);
        let writer = {
            let index = Arc::clone(&index);
            thread::spawn(move || {
                // Blocks 1 and 2 go: the unheld tail is most of the chain,
                // so the chain moves to a one-block buffer.
                index
                    .apply(
                        a,
                        0,
                        &KvEvent::BlockRemoved {
                            block_hashes: vec![
                                EngineHash::from_int(102),
                                EngineHash::from_int(101),
                            ],
                        },
                    )
                    .unwrap();
            })
        };
        let found = index.lookup(&hashes);
        well_formed(&found);
        let blocks = found.blocks_of(Holder { worker: a, rank: 0 });
        assert!(blocks == 1 || blocks == 3, "{blocks}");
        writer.join().unwrap();
        assert_eq!(
            index
                .lookup(&hashes)
                .blocks_of(Holder { worker: a, rank: 0 }),
            1
        );
    });
}

#[test]
fn a_lookup_races_a_head_table_that_grows() {
    model(|| {
        let index: Arc<KvIndex<u8>> = Arc::new(KvIndex::new(config()));
        let a = index.register_worker(0);
        let root = |token: u32| KvEvent::BlockStored {
            block_hashes: vec![EngineHash::from_int(400 + i64::from(token))],
            parent_block_hash: None,
            token_ids: vec![token],
            block_size: BS,
            lora_id: None,
        };
        // Three chains fill the four-slot head table as far as it goes
        // (three quarters); a fourth rebuilds it and retires the old one.
        for token in 0..3 {
            index.apply(a, 0, &root(token)).unwrap();
        }
        let first = index.block_hashes(&[0], None);
        let fourth = index.block_hashes(&[3], None);
        let writer = {
            let index = Arc::clone(&index);
            thread::spawn(move || index.apply(a, 0, &root(3)).unwrap())
        };
        let found = index.lookup(&first);
        well_formed(&found);
        assert_eq!(found.blocks_of(Holder { worker: a, rank: 0 }), 1);
        let found = index.lookup(&fourth);
        well_formed(&found);
        assert!(found.blocks_of(Holder { worker: a, rank: 0 }) <= 1);
        writer.join().unwrap();
        for token in 0..4 {
            let hashes = index.block_hashes(&[token], None);
            assert_eq!(
                index
                    .lookup(&hashes)
                    .blocks_of(Holder { worker: a, rank: 0 }),
                1
            );
        }
    });
}

#[test]
fn a_lookup_races_decode_steps_appended_in_place() {
    model(|| {
        let index: Arc<KvIndex<u8>> = Arc::new(KvIndex::new(config()));
        let a = index.register_worker(0);
        // One block in a two-slot buffer: the next block is appended in
        // place (hash, then length); the one after grows the buffer.
        index.apply(a, 0, &stored(0, 1, 1)).unwrap();
        let hashes = index.block_hashes(&[0, 1, 2], None);
        let writer = {
            let index = Arc::clone(&index);
            thread::spawn(move || {
                index.apply(a, 0, &stored(1, 1, 1)).unwrap();
                index.apply(a, 0, &stored(2, 1, 1)).unwrap();
            })
        };
        let found = index.lookup(&hashes);
        well_formed(&found);
        assert!((1..=3).contains(&found.blocks_of(Holder { worker: a, rank: 0 })));
        writer.join().unwrap();
        assert_eq!(
            index
                .lookup(&hashes)
                .blocks_of(Holder { worker: a, rank: 0 }),
            3
        );
        assert_eq!(index.stats().pairs, 3);
    });
}

#[test]
fn a_lookup_races_a_run_extended_in_place() {
    model(|| {
        let index: Arc<KvIndex<u8>> = Arc::new(KvIndex::new(config()));
        let a = index.register_worker(0);
        let b = index.register_worker(1);
        // a holds 0, 1, 2 and b holds 0: segments [0, 1) {a, b}, [1, 3) {a}.
        // b storing 1 moves the second segment's start to 2 in place.
        index.apply(a, 0, &stored(0, 3, 1)).unwrap();
        index.apply(b, 0, &stored(0, 1, 2)).unwrap();
        let hashes = index.block_hashes(&[0, 1, 2], None);
        let writer = {
            let index = Arc::clone(&index);
            thread::spawn(move || index.apply(b, 0, &stored(1, 1, 2)).unwrap())
        };
        let found = index.lookup(&hashes);
        well_formed(&found);
        assert_eq!(found.blocks_of(Holder { worker: a, rank: 0 }), 3);
        let of_b = found.blocks_of(Holder { worker: b, rank: 0 });
        assert!(of_b == 1 || of_b == 2, "{of_b}");
        writer.join().unwrap();
        let found = index.lookup(&hashes);
        assert_eq!(found.blocks_of(Holder { worker: b, rank: 0 }), 2);
        assert_eq!(index.stats().pairs, 5);
    });
}

#[test]
fn a_lookup_races_a_store_that_evicts_the_oldest_over_the_cap() {
    model(|| {
        // A cap of two blocks: storing a third drops the first, the head
        // of the chain, while its children stay held (what vLLM's own
        // eviction of that block would leave), through the removal path.
        let index: Arc<KvIndex<u8>> = Arc::new(KvIndex::new(IndexConfig {
            max_blocks_per_holder: std::num::NonZeroUsize::MIN.saturating_add(1),
            ..config()
        }));
        let a = index.register_worker(0);
        index.apply(a, 0, &stored(0, 2, 1)).unwrap();
        let hashes = index.block_hashes(&[0, 1, 2], None);
        let writer = {
            let index = Arc::clone(&index);
            thread::spawn(move || {
                let out = index.apply(a, 0, &stored(2, 1, 1)).unwrap();
                assert_eq!((out.stored, out.evicted), (1, 1));
            })
        };
        let found = index.lookup(&hashes);
        well_formed(&found);
        let blocks = found.blocks_of(Holder { worker: a, rank: 0 });
        assert!([0, 2, 3].contains(&blocks), "{blocks}");
        writer.join().unwrap();
        let holder = Holder { worker: a, rank: 0 };
        assert_eq!(index.lookup(&hashes).blocks_of(holder), 0);
        assert_eq!(index.lookup(&hashes[1..]).blocks_of(holder), 2);
        assert_eq!(index.evicted_over_cap(a), Some(1));
        assert_eq!(index.stats().pairs, 2);
    });
}
