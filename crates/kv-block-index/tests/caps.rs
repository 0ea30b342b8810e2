//! The cap per (worker, rank) stream (issue 32, "Hostile input, round 2"):
//! a publisher flooding valid unique blocks keeps at most its cap in the
//! index, its oldest blocks go first and are counted, other workers lose
//! nothing, and prefixes of what is kept stay right. Removals leave stale
//! entries in a stream's eviction order; churn must not grow it.
#![cfg(not(loom))]

use std::num::NonZeroUsize;

use kv_block_index::{BlockHash, EngineHash, Holder, IndexConfig, KvEvent, KvIndex, WorkerId};

const BS: usize = 4;
/// Blocks per flooded prompt.
const PROMPT: u32 = 16;

fn cap(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).expect("a test cap is not zero")
}

fn index(default_cap: usize) -> KvIndex<&'static str> {
    KvIndex::new(IndexConfig {
        block_size: BS,
        max_holders: 8,
        max_blocks_per_holder: cap(default_cap),
    })
}

/// Tokens of block `b` of prompt `p`: every block of every prompt unique.
fn block_tokens(p: u32, b: u32) -> impl Iterator<Item = u32> {
    (0..BS as u32).map(move |t| p * 1_000 + b * 8 + t)
}

/// Engine hash of block `b` of prompt `p` on a worker (`tag`).
fn engine(tag: i64, p: u32, b: u32) -> EngineHash {
    EngineHash::from_int(tag << 40 | i64::from(p) << 16 | i64::from(b))
}

/// A stored event of blocks `blocks` of prompt `p`.
fn stored(tag: i64, p: u32, blocks: std::ops::Range<u32>) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: blocks.clone().map(|b| engine(tag, p, b)).collect(),
        parent_block_hash: blocks.start.checked_sub(1).map(|b| engine(tag, p, b)),
        token_ids: blocks.flat_map(|b| block_tokens(p, b)).collect(),
        block_size: BS,
        lora_id: None,
    }
}

fn removed(tag: i64, p: u32, blocks: std::ops::Range<u32>) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: blocks.map(|b| engine(tag, p, b)).collect(),
    }
}

/// Our hashes of prompt `p`'s first `blocks` blocks.
fn request(index: &KvIndex<&'static str>, p: u32, blocks: u32) -> Vec<BlockHash> {
    let tokens: Vec<u32> = (0..blocks).flat_map(|b| block_tokens(p, b)).collect();
    index.block_hashes(&tokens, None)
}

fn holder(worker: WorkerId) -> Holder {
    Holder { worker, rank: 0 }
}

fn blocks_of(index: &KvIndex<&'static str>, worker: WorkerId) -> usize {
    index
        .stats()
        .holders
        .iter()
        .find(|h| h.holder == holder(worker))
        .map_or(0, |h| h.blocks)
}

#[test]
fn a_flood_of_unique_blocks_keeps_the_newest_up_to_the_cap() {
    const CAP: usize = 1_000;
    let index = index(1 << 20);
    let flood = index.register_worker("flood");
    let quiet = index.register_worker("quiet");
    assert_eq!(index.worker_capacity(flood), Some(1 << 20));
    assert_eq!(index.set_worker_capacity(flood, cap(CAP)), Ok(0));
    assert_eq!(index.worker_capacity(flood), Some(CAP));
    assert_eq!(index.worker_capacity(quiet), Some(1 << 20));

    // The quiet worker holds three prompts (two of them the flood's too).
    let q = index.stream(quiet, 0).unwrap();
    for p in [0, 1, 700] {
        q.apply(&stored(2, p, 0..PROMPT)).unwrap();
    }
    let quiet_before = blocks_of(&index, quiet);
    assert_eq!(quiet_before, 3 * PROMPT as usize);

    // Ten times the cap in unique prompts, one event per prompt.
    let total = 10 * CAP as u32;
    let prompts = total / PROMPT;
    let w = index.stream(flood, 0).unwrap();
    let mut bytes_at_cap = None;
    for p in 0..prompts {
        let out = w.apply(&stored(1, p, 0..PROMPT)).unwrap();
        assert_eq!(out.stored, u64::from(PROMPT));
        let held = blocks_of(&index, flood);
        // After every event: at most the cap (no slack between events).
        assert!(held <= CAP, "{held} blocks held after prompt {p}");
        if held + PROMPT as usize > CAP && bytes_at_cap.is_none() {
            bytes_at_cap = Some(index.stats().total_bytes());
        }
    }
    let stats = index.stats();
    let held = blocks_of(&index, flood);
    assert_eq!(held, CAP);
    let dropped = u64::from(prompts * PROMPT) - CAP as u64;
    assert_eq!(index.evicted_over_cap(flood), Some(dropped));
    assert_eq!(index.evicted_over_cap(quiet), Some(0));
    assert_eq!(stats.counters.evicted_blocks, dropped);
    let fs = stats
        .holders
        .iter()
        .find(|h| h.holder == holder(flood))
        .unwrap();
    assert_eq!((fs.capacity, fs.evicted), (CAP, dropped));
    // Memory stays where it was when the cap was first reached (the
    // flood's chains are freed as it moves on).
    let at_cap = bytes_at_cap.expect("the cap was reached");
    assert!(
        stats.total_bytes() < 2 * at_cap,
        "{} bytes after the flood, {at_cap} at the cap",
        stats.total_bytes()
    );
    // The index holds the quiet worker's blocks and the flood's newest.
    assert_eq!(stats.pairs, quiet_before + CAP);

    // The quiet worker lost nothing, also where it shares a prompt.
    assert_eq!(blocks_of(&index, quiet), quiet_before);
    for p in [0, 1, 700] {
        let found = index.lookup(&request(&index, p, PROMPT));
        assert_eq!(
            found.blocks_of(holder(quiet)),
            PROMPT as usize,
            "prompt {p}"
        );
    }
    // The newest prompts are whole on the flood; the oldest are gone.
    let kept_from = prompts * PROMPT - CAP as u32;
    for p in 0..prompts {
        let found = index.lookup(&request(&index, p, PROMPT));
        let want = if p * PROMPT >= kept_from {
            PROMPT as usize
        } else {
            0
        };
        assert_eq!(found.blocks_of(holder(flood)), want, "prompt {p}");
    }
    // The prompt cut by the cap: its first blocks went, its last stay.
    // Its children outlive the parent, as when vLLM evicts a parent: a
    // request from its start holds nothing; its kept part is still found.
    let cut = kept_from / PROMPT;
    let first_kept = kept_from % PROMPT;
    assert!(first_kept > 0, "the cap cuts a prompt in two");
    let whole = request(&index, cut, PROMPT);
    assert_eq!(index.lookup(&whole).blocks_of(holder(flood)), 0);
    let part = &whole[first_kept as usize..];
    assert_eq!(
        index.lookup(part).blocks_of(holder(flood)),
        (PROMPT - first_kept) as usize
    );
    assert!(index.holders_of(whole[0]).is_empty());
    assert_eq!(
        index.holders_of(whole[PROMPT as usize - 1]),
        vec![holder(flood)]
    );

    // The engine evicting blocks itself still works after the cap did.
    let out = w.apply(&removed(1, prompts - 1, 0..PROMPT)).unwrap();
    assert_eq!((out.removed, out.evicted), (u64::from(PROMPT), 0));
    assert_eq!(blocks_of(&index, flood), CAP - PROMPT as usize);
}

#[test]
fn the_default_cap_applies_until_a_worker_gets_its_own() {
    let index = index(20);
    let a = index.register_worker("a");
    let b = index.register_worker("b");
    for p in 0..3 {
        index.apply(a, 0, &stored(1, p, 0..10)).unwrap();
        index.apply(b, 0, &stored(2, p, 0..10)).unwrap();
    }
    assert_eq!(blocks_of(&index, a), 20);
    assert_eq!(index.evicted_over_cap(a), Some(10));
    // Each rank is an engine with its own cache: the cap is per rank.
    let out = index.apply(a, 1, &stored(3, 0, 0..10)).unwrap();
    assert_eq!(out.evicted, 0);
    // Lowering a worker's cap drops the excess at once, oldest first.
    assert_eq!(index.set_worker_capacity(b, cap(5)), Ok(15));
    assert_eq!(blocks_of(&index, b), 5);
    let last = request(&index, 2, 10);
    assert_eq!(index.lookup(&last).blocks_of(holder(b)), 0);
    assert_eq!(index.lookup(&last[5..]).blocks_of(holder(b)), 5);
    // Raising it drops nothing and lets the stream grow again.
    assert_eq!(index.set_worker_capacity(b, cap(100)), Ok(0));
    index.apply(b, 0, &stored(2, 9, 0..10)).unwrap();
    assert_eq!(blocks_of(&index, b), 15);
    // Worker a's own blocks were never touched by b's cap.
    assert_eq!(blocks_of(&index, a), 20);
    assert_eq!(index.evicted_over_cap(b), Some(10 + 15));
    // An unknown worker is refused and nothing changes.
    index.unregister_worker(a);
    assert_eq!(
        index.set_worker_capacity(a, cap(1)),
        Err(kv_block_index::KvIndexError::UnknownWorker(a))
    );
    assert_eq!(index.worker_capacity(a), None);
    assert_eq!(index.evicted_over_cap(a), None);
    assert_eq!(blocks_of(&index, b), 15);
}

#[test]
fn a_block_stored_again_after_its_removal_is_young() {
    let index = index(100);
    let a = index.register_worker("a");
    // w, x, y; x removed and stored again: the order is w, y, x (x's first
    // entry is stale, behind w which is still held).
    for p in 0..3 {
        index.apply(a, 0, &stored(1, p, 0..1)).unwrap();
    }
    index.apply(a, 0, &removed(1, 1, 0..1)).unwrap();
    index.apply(a, 0, &stored(1, 1, 0..1)).unwrap();
    // A repeated store of a held block does not make it younger.
    index.apply(a, 0, &stored(1, 2, 0..1)).unwrap();
    assert_eq!(index.set_worker_capacity(a, cap(1)), Ok(2));
    let held = |p| index.lookup(&request(&index, p, 1)).blocks_of(holder(a));
    assert_eq!((held(0), held(1), held(2)), (0, 1, 0));
}

#[test]
fn churn_does_not_grow_the_eviction_order() {
    let index = index(8);
    let a = index.register_worker("a");
    // One block held throughout, stored first: the order's front stays
    // live, so stale entries pile up behind it unless compacted.
    index.apply(a, 0, &stored(1, 0, 0..1)).unwrap();
    let bytes = |index: &KvIndex<&'static str>| {
        index
            .stats()
            .holders
            .iter()
            .find(|h| h.holder == holder(a))
            .map_or(0, |h| h.bytes)
    };
    let small = bytes(&index);
    for p in 1..20_000 {
        index.apply(a, 0, &stored(1, p, 0..2)).unwrap();
        index.apply(a, 0, &removed(1, p, 0..2)).unwrap();
    }
    // 40,000 stale entries would be 320 KB of order; compaction keeps it
    // within a few hundred.
    let after = bytes(&index);
    assert!(after < small + 16 * 1024, "{after} bytes, {small} before");
    assert_eq!(blocks_of(&index, a), 1);
    assert_eq!(index.evicted_over_cap(a), Some(0));
    // The order is still right: fill past the cap; the first block goes
    // first, then the oldest of the new ones.
    for p in 30_000..30_008 {
        index.apply(a, 0, &stored(1, p, 0..1)).unwrap();
    }
    assert_eq!(index.evicted_over_cap(a), Some(1));
    assert_eq!(blocks_of(&index, a), 8);
    assert_eq!(index.lookup(&request(&index, 0, 1)).blocks_of(holder(a)), 0);
    index.apply(a, 0, &stored(1, 40_000, 0..1)).unwrap();
    assert_eq!(
        index
            .lookup(&request(&index, 30_000, 1))
            .blocks_of(holder(a)),
        0
    );
    for p in (30_001..30_008).chain([40_000]) {
        let found = index.lookup(&request(&index, p, 1));
        assert_eq!(found.blocks_of(holder(a)), 1, "prompt {p}");
    }
}
