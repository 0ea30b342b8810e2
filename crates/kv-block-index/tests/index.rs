//! Behaviour a router sees: prefixes across workers and ranks, evictions,
//! clears, unknown parents, shared blocks, slot reuse and memory stats.
#![cfg(not(loom))]

use kv_block_index::{
    BlockHasher, EngineHash, Holder, IndexConfig, KvEvent, KvIndex, KvIndexError, WorkerId,
};

const BS: usize = 4;

fn index() -> KvIndex<String> {
    KvIndex::new(IndexConfig {
        block_size: BS,
        max_holders: 8,
        ..Default::default()
    })
}

fn tokens(blocks: std::ops::Range<u32>, seed: u32) -> Vec<u32> {
    blocks
        .flat_map(|b| (0..BS as u32).map(move |t| seed * 100_000 + b * 16 + t))
        .collect()
}

/// A stored event for blocks `range` of a prompt, engine hashes `tag*1000 + block`.
fn stored(range: std::ops::Range<u32>, seed: u32, tag: i64) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: range
            .clone()
            .map(|b| EngineHash::from_int(tag * 1000 + i64::from(b)))
            .collect(),
        parent_block_hash: range
            .start
            .checked_sub(1)
            .map(|p| EngineHash::from_int(tag * 1000 + i64::from(p))),
        token_ids: tokens(range, seed),
        block_size: BS,
        lora_id: None,
    }
}

fn removed(range: std::ops::Range<u32>, tag: i64) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: range
            .map(|b| EngineHash::from_int(tag * 1000 + i64::from(b)))
            .collect(),
    }
}

fn h(worker: WorkerId, rank: u32) -> Holder {
    Holder { worker, rank }
}

#[test]
fn prefixes_per_worker_and_rank() {
    let index = index();
    let a = index.register_worker("a".into());
    let b = index.register_worker("b".into());
    assert_eq!(index.register_worker("a".into()), a);
    assert_ne!(a, b);
    // a/0 holds 8 blocks, a/1 holds 3, b/0 holds 5 of the same prompt.
    index.apply(a, 0, &stored(0..8, 1, 1)).unwrap();
    index.apply(a, 1, &stored(0..3, 1, 2)).unwrap();
    let sb = index.stream(b, 0).unwrap();
    sb.apply(&stored(0..2, 1, 3)).unwrap();
    sb.apply(&stored(2..5, 1, 3)).unwrap();

    let request = index.block_hashes(&tokens(0..10, 1), None);
    assert_eq!(request.len(), 10);
    let found = index.lookup(&request);
    let got: Vec<(Holder, usize)> = found
        .matches()
        .iter()
        .map(|m| (m.holder, m.blocks))
        .collect();
    assert_eq!(got, vec![(h(a, 0), 8), (h(b, 0), 5), (h(a, 1), 3)]);
    assert_eq!(found.request_blocks(), 10);
    // A different prompt shares nothing.
    let other = index.block_hashes(&tokens(0..10, 2), None);
    assert!(index.lookup(&other).matches().is_empty());
    // The same tokens under a LoRA adapter share nothing either.
    let lora = index.block_hashes(&tokens(0..10, 1), Some(7));
    assert!(index.lookup(&lora).best().is_none());
}

#[test]
fn removal_in_the_middle_cuts_the_prefix_and_clear_drops_everything() {
    let index = index();
    let a = index.register_worker("a".into());
    let b = index.register_worker("b".into());
    index.apply(a, 0, &stored(0..6, 1, 1)).unwrap();
    index.apply(b, 0, &stored(0..6, 1, 1)).unwrap();
    let request = index.block_hashes(&tokens(0..6, 1), None);
    let out = index.apply(a, 0, &removed(2..3, 1)).unwrap();
    assert_eq!(out.removed, 1);
    let found = index.lookup(&request);
    assert_eq!(found.blocks_of(h(a, 0)), 2);
    assert_eq!(found.blocks_of(h(b, 0)), 6);
    assert_eq!(index.clear_worker(b).unwrap(), 6);
    let found = index.lookup(&request);
    assert_eq!(found.blocks_of(h(b, 0)), 0);
    assert_eq!(found.blocks_of(h(a, 0)), 2);
    let out = index.apply(a, 0, &KvEvent::AllBlocksCleared).unwrap();
    assert_eq!(out.removed, 5);
    assert!(index.lookup(&request).matches().is_empty());
    assert_eq!(index.stats().pairs, 0);
    assert_eq!(index.stats().blocks, 0);
}

#[test]
fn unknown_parents_and_removals_are_counted_and_skipped() {
    let index = index();
    let a = index.register_worker("a".into());
    // Blocks 3..5 whose parent (block 2) the stream never stored.
    let out = index.apply(a, 0, &stored(3..5, 1, 1)).unwrap();
    assert_eq!((out.stored, out.unknown_parent), (0, 2));
    let out = index.apply(a, 0, &removed(0..4, 9)).unwrap();
    assert_eq!(out.unknown_removed, 4);
    // Wrong block size and wrong token count.
    let mut bad = stored(0..2, 1, 1);
    if let KvEvent::BlockStored { block_size, .. } = &mut bad {
        *block_size = 8;
    }
    assert_eq!(index.apply(a, 0, &bad).unwrap().malformed, 2);
    let mut short = stored(0..2, 1, 1);
    if let KvEvent::BlockStored { token_ids, .. } = &mut short {
        token_ids.pop();
    }
    assert_eq!(index.apply(a, 0, &short).unwrap().malformed, 2);
    let c = index.counters();
    assert_eq!(c.unknown_parent_blocks, 2);
    assert_eq!(c.unknown_removed_blocks, 4);
    assert_eq!(c.malformed_blocks, 4);
    assert_eq!(c.events, 4);
    assert_eq!(index.stats().pairs, 0);
}

#[test]
fn two_engine_hashes_for_one_block_hold_it_until_both_go() {
    let index = index();
    let a = index.register_worker("a".into());
    // Same tokens, different engine hashes (as with a cache salt).
    index.apply(a, 0, &stored(0..2, 1, 1)).unwrap();
    let out = index.apply(a, 0, &stored(0..2, 1, 2)).unwrap();
    assert_eq!(out.stored, 0);
    let request = index.block_hashes(&tokens(0..2, 1), None);
    assert_eq!(index.stats().pairs, 2);
    index.apply(a, 0, &removed(0..2, 1)).unwrap();
    assert_eq!(index.lookup(&request).blocks_of(h(a, 0)), 2);
    index.apply(a, 0, &removed(0..2, 2)).unwrap();
    assert_eq!(index.lookup(&request).blocks_of(h(a, 0)), 0);
    // A stored duplicate of the same engine hash changes nothing.
    index.apply(a, 0, &stored(0..2, 1, 1)).unwrap();
    let again = index.apply(a, 0, &stored(0..2, 1, 1)).unwrap();
    assert_eq!(again.stored, 0);
    assert_eq!(index.stats().holders[0].blocks, 2);
}

#[test]
fn a_same_sized_but_different_holder_set_ends_a_prefix() {
    let index = index();
    let a = index.register_worker("a".into());
    let b = index.register_worker("b".into());
    let c = index.register_worker("c".into());
    for w in [a, b, c] {
        index.apply(w, 0, &stored(0..4, 1, 1)).unwrap();
    }
    // Block 0: {a, b}; block 1: {b, c}; block 2: {a, b, c}; block 3: {c}.
    index.apply(c, 0, &removed(0..1, 1)).unwrap();
    index.apply(a, 0, &removed(1..2, 1)).unwrap();
    index.apply(a, 0, &removed(3..4, 1)).unwrap();
    index.apply(b, 0, &removed(3..4, 1)).unwrap();
    let request = index.block_hashes(&tokens(0..4, 1), None);
    let found = index.lookup(&request);
    assert_eq!(found.blocks_of(h(a, 0)), 1);
    assert_eq!(found.blocks_of(h(b, 0)), 3);
    assert_eq!(found.blocks_of(h(c, 0)), 0);
    assert_eq!(found.matches().len(), 2);
    // Only c holds block 1 onwards without block 0.
    let found = index.lookup(&request[1..]);
    assert_eq!(found.blocks_of(h(c, 0)), 3);
    assert_eq!(found.blocks_of(h(b, 0)), 2);
}

#[test]
fn many_holders_share_blocks_and_drop_out_in_steps() {
    let index: KvIndex<u32> = KvIndex::new(IndexConfig {
        block_size: BS,
        max_holders: 64,
        ..Default::default()
    });
    // 40 workers hold a staircase of the same prompt: worker i holds i+1 blocks.
    let ids: Vec<WorkerId> = (0..40).map(|i| index.register_worker(i)).collect();
    for (i, &id) in ids.iter().enumerate() {
        index
            .apply(id, 0, &stored(0..(i as u32 + 1), 5, 1))
            .unwrap();
    }
    let request = index.block_hashes(&tokens(0..50, 5), None);
    let found = index.lookup(&request);
    assert_eq!(found.matches().len(), 40);
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(found.blocks_of(h(id, 0)), i + 1);
    }
    assert_eq!(found.best().unwrap().holder.worker, ids[39]);
    assert_eq!(index.holders_of(request[0]).len(), 40);
    assert_eq!(index.holders_of(request[39]), vec![h(ids[39], 0)]);
    // Reusing the result buffer gives the same answer.
    let mut reused = index.lookup(&request[..10]);
    index.lookup_into(&request, &mut reused);
    assert_eq!(reused.matches(), found.matches());
    let stats = index.stats();
    assert_eq!(stats.pairs, (1..=40).sum::<usize>());
    assert_eq!(stats.blocks, 40);
    assert!(stats.index_bytes > 0 && stats.translation_bytes > 0);
    assert!(stats.bytes_per_pair() > 0.0);
}

#[test]
fn unregistered_workers_are_refused_and_their_slots_reused() {
    let index = index();
    let ids: Vec<WorkerId> = (0..8)
        .map(|i| index.register_worker(format!("w{i}")))
        .collect();
    for &id in &ids {
        index.apply(id, 0, &stored(0..2, 1, 1)).unwrap();
    }
    let extra = index.register_worker("w8".into());
    assert_eq!(
        index.apply(extra, 0, &stored(0..2, 1, 1)),
        Err(KvIndexError::HolderCapacity { max: 8 })
    );
    let writer = index.stream(ids[0], 0).unwrap();
    assert!(index.unregister_worker(ids[0]));
    assert!(!index.unregister_worker(ids[0]));
    assert_eq!(
        writer.apply(&stored(2..3, 1, 1)),
        Err(KvIndexError::UnknownWorker(ids[0]))
    );
    assert_eq!(index.worker_id(&"w0".to_string()), None);
    assert_eq!(
        index.clear_worker(ids[0]),
        Err(KvIndexError::UnknownWorker(ids[0]))
    );
    // The freed slot now serves the new worker; no block names the old one.
    index.apply(extra, 0, &stored(0..1, 1, 1)).unwrap();
    let request = index.block_hashes(&tokens(0..2, 1), None);
    let found = index.lookup(&request);
    assert_eq!(found.blocks_of(h(ids[0], 0)), 0);
    assert_eq!(found.blocks_of(h(extra, 0)), 1);
    assert_eq!(found.matches().len(), 8);
    // A re-registered key gets a new id.
    let again = index.register_worker("w0".into());
    assert!(!ids.contains(&again) && again != extra);
}

#[test]
fn tables_grow_and_shrink_without_losing_blocks() {
    let index = index();
    let a = index.register_worker("a".into());
    let b = index.register_worker("b".into());
    // 3,000 blocks in 30 events, removed and stored again.
    for round in 0..2 {
        for chunk in 0..30u32 {
            index
                .apply(a, 0, &stored(chunk * 100..chunk * 100 + 100, 3, 1))
                .unwrap();
        }
        index.apply(b, 0, &stored(0..1500, 3, 1)).unwrap();
        let request = index.block_hashes(&tokens(0..3000, 3), None);
        let found = index.lookup(&request);
        assert_eq!(found.blocks_of(h(a, 0)), 3000, "round {round}");
        assert_eq!(found.blocks_of(h(b, 0)), 1500);
        assert_eq!(index.stats().pairs, 4500);
        index.apply(a, 0, &removed(0..3000, 1)).unwrap();
        index.apply(b, 0, &KvEvent::AllBlocksCleared).unwrap();
        assert_eq!(index.stats().blocks, 0);
    }
}

#[test]
fn the_block_hash_is_stable() {
    // Pinned outputs: the hash is a documented, stable contract shared by
    // router replicas; a change here is a breaking change.
    let hasher = BlockHasher::new(16);
    let tokens: Vec<u32> = (0..32).collect();
    let hashes = hasher.hash_blocks(&tokens);
    assert_eq!(hashes.len(), 2);
    let pinned = [hashes[0].0, hashes[1].0];
    assert_eq!(pinned, STABLE);
}

const STABLE: [u64; 2] = [0xf1a4_e6b8_ed62_8039, 0xe764_ed41_4976_1076];

#[test]
fn hashes_that_do_not_chain_still_get_an_answer() {
    let index = index();
    let a = index.register_worker("a".into());
    index.apply(a, 0, &stored(0..12, 1, 1)).unwrap();
    let request = index.block_hashes(&tokens(0..12, 1), None);
    // Not a request's hashes: reversed, shuffled, repeated. The lookup must
    // end and report every holder with at least one and at most all blocks.
    let mut reversed = request.clone();
    reversed.reverse();
    let mut swapped = request.clone();
    swapped.swap(3, 7);
    let repeated: Vec<_> = request.iter().chain(&request).copied().collect();
    for hashes in [reversed, swapped, repeated] {
        let found = index.lookup(&hashes);
        for m in found.matches() {
            assert!((1..=hashes.len()).contains(&m.blocks), "{m:?}");
        }
    }
    // A request and a contiguous part of it are answered exactly.
    assert_eq!(index.lookup(&request).blocks_of(h(a, 0)), 12);
    assert_eq!(index.lookup(&request[5..]).blocks_of(h(a, 0)), 7);
}
