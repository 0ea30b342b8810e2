//! The engine's per-step KV-cache events against a reference consumer: for
//! random workloads (shared prefixes, a small cache, several requests in
//! flight, aborts), applying every drained [`KvBatch`] in order to a set of
//! hashes gives exactly the cache's hashed blocks after every operation;
//! nothing is stored twice or removed unheld; every `BlockStored` run
//! carries its blocks' tokens and the engine's block size, chained from its
//! parent.

use std::collections::HashSet;
use std::time::Duration;

use engine_sim::kv_events::{BlockHash, BlockStored, KvEvent};
use engine_sim::tokens::{block_hashes, block_hashes_after};
use engine_sim::{Engine, KvBatch, ModelConfig, SimRequest};
use proptest::prelude::*;

const BLOCK: usize = 4;

/// engine-sim's hashes travel as integers.
fn int(hash: &BlockHash) -> Result<u64, TestCaseError> {
    match hash {
        BlockHash::Int(value) => Ok(*value),
        BlockHash::Bytes(_) => Err(TestCaseError::fail("a bytes hash")),
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A prompt of these symbols (each one block of 4 equal tokens) plus a
    /// partial block of `tail` tokens, and its output length.
    Submit(Vec<u8>, usize, u32),
    /// Advance the clock by this many milliseconds.
    Advance(u64),
    /// Abort the n-th submitted request (if still live).
    Abort(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop::collection::vec(0u8..4, 1..6), 0usize..4, 1u32..6)
            .prop_map(|(s, tail, out)| Op::Submit(s, tail, out)),
        3 => (0u64..40).prop_map(Op::Advance),
        1 => (0usize..20).prop_map(Op::Abort),
    ]
}

fn tokens(symbols: &[u8], tail: usize) -> Vec<u32> {
    let mut out: Vec<u32> = symbols
        .iter()
        .flat_map(|&s| std::iter::repeat_n(u32::from(s), BLOCK))
        .collect();
    out.extend(std::iter::repeat_n(99, tail));
    out
}

/// The reference consumer: the set of held hashes.
#[derive(Default)]
struct Consumer {
    held: HashSet<u64>,
    last_at: Duration,
    stored_blocks: usize,
    removed_blocks: usize,
}

impl Consumer {
    fn apply(&mut self, batch: KvBatch) -> Result<(), TestCaseError> {
        prop_assert!(batch.at >= self.last_at, "batches in time order");
        prop_assert!(!batch.events.is_empty(), "no empty batch");
        self.last_at = batch.at;
        for event in batch.events {
            match event {
                KvEvent::BlockStored(stored) => {
                    prop_assert!(!stored.block_hashes.is_empty());
                    prop_assert_eq!(stored.block_size as usize, BLOCK);
                    prop_assert_eq!(stored.medium.as_deref(), Some("GPU"));
                    prop_assert_eq!(stored.group_idx, None);
                    prop_assert_eq!(stored.token_ids.len(), stored.block_hashes.len() * BLOCK);
                    let parent = stored.parent_block_hash.as_ref().map(int).transpose()?;
                    let hashes = stored
                        .block_hashes
                        .iter()
                        .map(int)
                        .collect::<Result<Vec<_>, _>>()?;
                    prop_assert_eq!(
                        &block_hashes_after(parent, &stored.token_ids, BLOCK),
                        &hashes
                    );
                    for hash in hashes {
                        prop_assert!(self.held.insert(hash), "stored twice");
                        self.stored_blocks += 1;
                    }
                }
                KvEvent::BlockRemoved(removed) => {
                    prop_assert_eq!(removed.medium.as_deref(), Some("GPU"));
                    prop_assert_eq!(removed.group_idx, None);
                    for hash in &removed.block_hashes {
                        prop_assert!(self.held.remove(&int(hash)?), "removed unheld");
                        self.removed_blocks += 1;
                    }
                }
                KvEvent::AllBlocksCleared => self.held.clear(),
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn applied_batches_equal_the_cache(
        num_blocks in 6usize..24,
        max_num_seqs in 1usize..4,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let config = ModelConfig {
            block_size: BLOCK,
            num_blocks,
            max_num_seqs,
            ..ModelConfig::default()
        };
        let mut engine = Engine::new(config);
        engine.set_kv_events(true);
        let mut consumer = Consumer::default();
        let mut now = Duration::ZERO;
        let mut next_id = 0u64;
        for op in ops {
            match op {
                Op::Submit(symbols, tail, max_tokens) => {
                    let prompt = tokens(&symbols, tail);
                    // Refusals (too large for the cache) change nothing.
                    let _ = engine.submit(now, SimRequest::new(next_id, prompt, max_tokens));
                    next_id += 1;
                }
                Op::Advance(ms) => {
                    now += Duration::from_millis(ms);
                    engine.advance_to(now);
                }
                Op::Abort(n) => {
                    engine.abort(n as u64);
                }
            }
            engine.drain_events().for_each(drop);
            for batch in engine.drain_kv_batches() {
                consumer.apply(batch)?;
            }
            let actual: HashSet<u64> = engine.cache().cached_hashes().collect();
            prop_assert_eq!(&consumer.held, &actual);
            prop_assert_eq!(consumer.held.len(), engine.stats().cached_blocks);
        }
        prop_assert_eq!(
            consumer.stored_blocks - consumer.removed_blocks,
            consumer.held.len()
        );
    }
}

#[test]
fn recording_is_off_by_default_and_a_prompt_is_stored_once() {
    let mut engine = Engine::new(ModelConfig {
        block_size: BLOCK,
        ..ModelConfig::default()
    });
    let prompt = tokens(&[1, 2, 3], 2);
    engine
        .submit(Duration::ZERO, SimRequest::new(1, prompt.clone(), 2))
        .expect("fits");
    engine.advance_to(Duration::from_secs(1));
    assert_eq!(engine.drain_kv_batches().count(), 0, "off by default");

    engine.set_kv_events(true);
    let other = tokens(&[1, 2, 0], 0);
    engine
        .submit(Duration::from_secs(1), SimRequest::new(2, other.clone(), 2))
        .expect("fits");
    let batches: Vec<KvBatch> = engine.drain_kv_batches().collect();
    assert_eq!(batches.len(), 1, "one admission step: {batches:?}");
    assert_eq!(batches[0].at, Duration::from_secs(1));
    // Blocks 1 and 2 were cached by the first prompt; only block 0 is new,
    // parented on the shared block 2.
    let shared = block_hashes(&other, BLOCK);
    let mut stored = BlockStored::new(
        vec![BlockHash::Int(shared[2])],
        Some(BlockHash::Int(shared[1])),
        vec![0; BLOCK],
        BLOCK as u32,
    );
    stored.medium = Some("GPU".to_owned());
    assert_eq!(batches[0].events, vec![KvEvent::BlockStored(stored)]);
}
