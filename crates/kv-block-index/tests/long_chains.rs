//! Long chains against the reference model: prompts of 120 blocks that
//! share prefixes and branch, conversations after them, stored in events
//! of random sizes and evicted from the tail, the middle and whole. This
//! grows hash buffers, the head table and the chain directory, cuts chains
//! back and frees them (reusing their ids), which the small universe of
//! the state machine never reaches. After every few steps every lookup and
//! the pair and block counts must agree with the model. A second test runs
//! the same kind of traffic from several threads while others look up.
#![cfg(not(loom))]

use std::collections::{BTreeMap, BTreeSet};

use kv_block_index::fuzzing::{BLOCK_SIZE, Model};
use kv_block_index::{BlockHash, BlockHasher, EngineHash, IndexConfig, KvEvent, KvIndex};

const WORKERS: u32 = 6;
const PROMPTS: u32 = 4;
const PROMPT_BLOCKS: u32 = 120;
const CONVERSATIONS: u32 = 40;
const CONVERSATION_BLOCKS: u32 = 30;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n)) as u32
    }
}

/// A text: a prompt, or a conversation after one (`conversation > 0`).
#[derive(Clone, Copy)]
struct Text {
    prompt: u32,
    conversation: u32,
}

impl Text {
    fn blocks(self) -> u32 {
        PROMPT_BLOCKS
            + if self.conversation > 0 {
                CONVERSATION_BLOCKS
            } else {
                0
            }
    }

    /// Tokens of block `b`. Prompts share their first 40 blocks in pairs
    /// (0 and 1, 2 and 3) and their first 10 all together.
    fn block_tokens(self, b: u32) -> [u32; BLOCK_SIZE] {
        let source = if b < 10 {
            0
        } else if b < 40 {
            1 + self.prompt / 2
        } else if b < PROMPT_BLOCKS {
            10 + self.prompt
        } else {
            100 + self.prompt * 10 + self.conversation
        };
        std::array::from_fn(|t| source * 100_000 + b * 8 + t as u32)
    }

    fn tokens(self, blocks: std::ops::Range<u32>) -> Vec<u32> {
        blocks.flat_map(|b| self.block_tokens(b)).collect()
    }

    /// The engine hash worker `w` gives block `b` (engines hash the prefix,
    /// so shared prefixes get the same hash on one worker).
    fn engine(self, w: u32, b: u32) -> EngineHash {
        let source = self.block_tokens(b)[0] / 100_000;
        EngineHash::from_int(i64::from(w) << 40 | i64::from(source) << 20 | i64::from(b))
    }
}

fn stored(text: Text, w: u32, blocks: std::ops::Range<u32>) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: blocks.clone().map(|b| text.engine(w, b)).collect(),
        parent_block_hash: blocks.start.checked_sub(1).map(|p| text.engine(w, p)),
        token_ids: text.tokens(blocks),
        block_size: BLOCK_SIZE,
        lora_id: None,
    }
}

fn removed(text: Text, w: u32, blocks: std::ops::Range<u32>) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: blocks.map(|b| text.engine(w, b)).collect(),
    }
}

fn check(index: &KvIndex<u32>, model: &Model, requests: &[Vec<BlockHash>]) {
    let holders = model.holders();
    let empty = BTreeSet::new();
    for request in requests {
        for end in [1, 10, 41, 120, request.len()] {
            let hashes = &request[..end.min(request.len())];
            // The model's answer (as `Model::prefixes`, from one holder map).
            let want: BTreeMap<(u32, u32), usize> = holders
                .get(&hashes[0].0)
                .unwrap_or(&empty)
                .iter()
                .map(|&stream| {
                    let held =
                        |h: &BlockHash| holders.get(&h.0).is_some_and(|s| s.contains(&stream));
                    (stream, hashes.iter().take_while(|h| held(h)).count())
                })
                .collect();
            let got: BTreeMap<(u32, u32), usize> = index
                .lookup(hashes)
                .matches()
                .iter()
                .map(|m| ((m.holder.worker.get(), m.holder.rank), m.blocks))
                .collect();
            assert_eq!(got, want, "lookup of {} blocks", hashes.len());
        }
    }
    let stats = index.stats();
    assert_eq!(
        stats.pairs,
        holders.values().map(BTreeSet::len).sum::<usize>()
    );
    assert_eq!(stats.blocks, holders.len());
    // A few blocks deep inside chains, found by the slow path.
    for request in requests.iter().step_by(3) {
        for &b in &[0usize, 55, request.len() - 1] {
            let want: BTreeSet<(u32, u32)> =
                holders.get(&request[b].0).cloned().unwrap_or_default();
            let got: BTreeSet<(u32, u32)> = index
                .holders_of(request[b])
                .iter()
                .map(|h| (h.worker.get(), h.rank))
                .collect();
            assert_eq!(got, want, "holders of block {b}");
        }
    }
}

#[test]
fn long_chains_grow_branch_cut_and_free_like_the_model() {
    let index: KvIndex<u32> = KvIndex::new(IndexConfig {
        block_size: BLOCK_SIZE,
        max_holders: 64,
        ..Default::default()
    });
    let hasher = BlockHasher::new(BLOCK_SIZE);
    let mut model = Model::default();
    let ids: Vec<_> = (0..WORKERS).map(|w| index.register_worker(w)).collect();
    for id in &ids {
        model.registered.insert(id.get());
    }
    let texts: Vec<Text> = (0..PROMPTS)
        .flat_map(|prompt| {
            (0..=CONVERSATIONS).map(move |conversation| Text {
                prompt,
                conversation,
            })
        })
        .collect();
    let requests: Vec<Vec<BlockHash>> = texts
        .iter()
        .map(|t| hasher.hash_blocks(&t.tokens(0..t.blocks())))
        .collect();
    let mut rng = Rng(7);
    for step in 0..500 {
        let w = rng.below(WORKERS);
        let id = ids[w as usize];
        let text = texts[rng.below(texts.len() as u32) as usize];
        let n = text.blocks();
        // The first steps only store, so that many chains live at once
        // (growing the head table and the chain directory).
        let kind = if step < 150 { 0 } else { rng.below(10) };
        let events = match kind {
            // Store from the start (or after a held block) in events of
            // 1 to 40 blocks, as prefill chunks and decode steps come.
            0..=6 => {
                let start = if rng.below(3) == 0 { rng.below(n) } else { 0 };
                let end = if step < 150 {
                    n
                } else {
                    (start + 1 + rng.below(n - start)).min(n)
                };
                let mut events = Vec::new();
                let mut at = start;
                while at < end {
                    let size = (1 + rng.below(40)).min(end - at);
                    events.push(stored(text, w, at..at + size));
                    at += size;
                }
                events
            }
            // Evict a tail, a middle part, or everything of this text.
            7 => {
                let start = rng.below(n);
                vec![removed(text, w, start..n)]
            }
            8 => {
                let start = rng.below(n);
                vec![removed(text, w, start..(start + 1 + rng.below(8)).min(n))]
            }
            _ => {
                if rng.below(4) == 0 {
                    vec![KvEvent::AllBlocksCleared]
                } else {
                    vec![removed(text, w, 0..n)]
                }
            }
        };
        for event in &events {
            assert!(model.apply(id.get(), 0, event));
            index.apply(id, 0, event).unwrap();
        }
        if step % 25 == 0 {
            check(&index, &model, &requests);
        }
    }
    check(&index, &model, &requests);
    // Every worker clears: nothing is left, every chain is freed.
    for &id in &ids {
        index.clear_worker(id).unwrap();
        model.clear_worker(id.get());
    }
    check(&index, &model, &requests);
    let stats = index.stats();
    assert_eq!((stats.pairs, stats.blocks), (0, 0));
}

#[test]
fn concurrent_writers_and_readers_end_where_the_model_does() {
    let index: std::sync::Arc<KvIndex<u32>> = std::sync::Arc::new(KvIndex::new(IndexConfig {
        block_size: BLOCK_SIZE,
        max_holders: 64,
        ..Default::default()
    }));
    let hasher = BlockHasher::new(BLOCK_SIZE);
    let ids: Vec<_> = (0..4).map(|w| index.register_worker(w)).collect();
    let texts: Vec<Text> = (0..PROMPTS)
        .flat_map(|prompt| {
            (0..=4).map(move |conversation| Text {
                prompt,
                conversation,
            })
        })
        .collect();
    let requests: Vec<Vec<BlockHash>> = texts
        .iter()
        .map(|t| hasher.hash_blocks(&t.tokens(0..t.blocks())))
        .collect();
    // Each writer owns one worker's stream and logs the events it applied.
    let writers: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(w, &id)| {
            let index = std::sync::Arc::clone(&index);
            let texts = texts.clone();
            std::thread::spawn(move || {
                let stream = index.stream(id, 0).unwrap();
                let mut rng = Rng(100 + w as u64);
                let mut log = Vec::new();
                for _ in 0..300 {
                    let text = texts[rng.below(texts.len() as u32) as usize];
                    let n = text.blocks();
                    let event = match rng.below(4) {
                        0 | 1 => {
                            let end = 1 + rng.below(n);
                            let start = if rng.below(2) == 0 { 0 } else { rng.below(end) };
                            stored(text, w as u32, start..end)
                        }
                        2 => {
                            let start = rng.below(n);
                            removed(text, w as u32, start..n)
                        }
                        _ => stored(text, w as u32, 0..n),
                    };
                    stream.apply(&event).unwrap();
                    log.push(event);
                }
                log
            })
        })
        .collect();
    let readers: Vec<_> = (0..2)
        .map(|r| {
            let index = std::sync::Arc::clone(&index);
            let requests = requests.clone();
            std::thread::spawn(move || {
                let mut lookups = 0;
                for round in 0..400 {
                    let request = &requests[(round * 7 + r) % requests.len()];
                    let found = index.lookup(request);
                    for m in found.matches() {
                        assert!((1..=request.len()).contains(&m.blocks), "{m:?}");
                    }
                    assert!(
                        found
                            .matches()
                            .windows(2)
                            .all(|w| w[0].blocks >= w[1].blocks)
                    );
                    lookups += 1;
                }
                lookups
            })
        })
        .collect();
    let mut model = Model::default();
    for id in &ids {
        model.registered.insert(id.get());
    }
    for (id, writer) in ids.iter().zip(writers) {
        for event in writer.join().unwrap() {
            assert!(model.apply(id.get(), 0, &event));
        }
    }
    for reader in readers {
        assert_eq!(reader.join().unwrap(), 400);
    }
    // Streams are independent, so applying each log in turn gives the
    // state the concurrent run must have reached.
    check(&index, &model, &requests);
}
