//! The prefix cache's changes per scheduler step, recorded as the vLLM
//! KV-cache events the engine publishes.
//!
//! vLLM's scheduler collects the block pool's events during a step and
//! publishes them as one batch; an engine with [`Engine::set_kv_events`]
//! on does the same, sans-IO: every step that changed the prefix index
//! leaves one [`KvBatch`] for the owner to drain
//! ([`Engine::drain_kv_batches`]). Its events are vLLM's wire events
//! ([`kv_events::KvEvent`]), exactly those the HTTP server publishes on a
//! ZMQ PUB socket (feature `kv-events`, [`KvBatch::into_event_batch`]), so
//! that there is one event type from the model to the wire; the routing
//! simulator converts them to a block index's events with the converter a
//! router uses on the events it receives (kv-block-index's `wire`
//! feature).
//!
//! What the model writes, as vLLM does for its GPU cache: a `BlockStored`
//! carries the engine's block size and medium `"GPU"`, a `BlockRemoved`
//! medium `"GPU"`; neither has a KV-cache group (one group: no hybrid
//! model), a LoRA or extra keys. Within one admission the cache's
//! evictions come first, as one `BlockRemoved`, then its new blocks as
//! `BlockStored` runs of consecutive blocks (one run per admitted request
//! unless a block in the middle was already cached). Reordering evictions
//! before stores of the same admission is safe: a block stored for a
//! request is referenced by it and cannot be evicted during that
//! admission. Applying a step's events in order to a set of hashes gives
//! the cache's set of hashed blocks after the step
//! ([`KvCache::cached_hashes`]).
//!
//! Block hashes are engine-sim's own chain hashes
//! ([`tokens::block_hashes`]), 64-bit, as [`BlockHash::Int`] (vLLM sends
//! ints or bytes; an int is what its builtin hash sends and what a
//! consumer keys on cheapest).
//!
//! [`Engine::set_kv_events`]: crate::Engine::set_kv_events
//! [`Engine::drain_kv_batches`]: crate::Engine::drain_kv_batches
//! [`KvCache::cached_hashes`]: crate::cache::KvCache::cached_hashes
//! [`tokens::block_hashes`]: crate::tokens::block_hashes

use std::time::Duration;

use kv_events::{BlockHash, BlockRemoved, BlockStored, EventBatch, KvEvent};

use crate::cache::CacheEvent;

/// The medium vLLM names its GPU cache's blocks with.
const GPU: &str = "GPU";

/// The events of one scheduler step.
#[derive(Debug, Clone, PartialEq)]
pub struct KvBatch {
    /// Model time of the step's start, when its admissions changed the
    /// cache.
    pub at: Duration,
    /// The events, in the order to apply them.
    pub events: Vec<KvEvent>,
}

impl KvBatch {
    /// This batch as the publisher sends it: its events, and `ts` (seconds
    /// since the Unix epoch) as given, since the batch itself only knows
    /// model time. No rank: the publisher writes its own.
    #[must_use]
    pub fn into_event_batch(self, ts: f64) -> EventBatch {
        EventBatch::new(ts, self.events)
    }
}

/// Appends one admission's cache events to `out`: evictions first (one
/// `BlockRemoved`), then runs of consecutive stored blocks with their
/// token ids from `prompt`.
pub(crate) fn group_admission(
    events: impl IntoIterator<Item = CacheEvent>,
    prompt: &[u32],
    block_size: usize,
    out: &mut Vec<KvEvent>,
) {
    // The wire's block size is 32 bits; an engine's never comes near.
    let wire_block_size = u32::try_from(block_size).unwrap_or(u32::MAX);
    let mut removed = Vec::new();
    let mut stored: Vec<BlockStored> = Vec::new();
    let mut last_index = None;
    for event in events {
        match event {
            CacheEvent::Removed { hash } => removed.push(BlockHash::Int(hash)),
            CacheEvent::Stored {
                hash,
                parent,
                block_index,
            } => {
                let start = block_index.saturating_mul(block_size).min(prompt.len());
                let end = start.saturating_add(block_size).min(prompt.len());
                let tokens = &prompt[start..end];
                let continues = last_index.is_some_and(|last: usize| last + 1 == block_index);
                match stored.last_mut() {
                    Some(run) if continues => {
                        run.block_hashes.push(BlockHash::Int(hash));
                        run.token_ids.extend_from_slice(tokens);
                    }
                    _ => {
                        let mut run = BlockStored::new(
                            vec![BlockHash::Int(hash)],
                            parent.map(BlockHash::Int),
                            tokens.to_vec(),
                            wire_block_size,
                        );
                        run.medium = Some(GPU.to_owned());
                        stored.push(run);
                    }
                }
                last_index = Some(block_index);
            }
        }
    }
    if !removed.is_empty() {
        let mut event = BlockRemoved::new(removed);
        event.medium = Some(GPU.to_owned());
        out.push(KvEvent::BlockRemoved(event));
    }
    out.extend(stored.into_iter().map(KvEvent::BlockStored));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evictions_first_then_runs_of_consecutive_blocks() {
        let prompt: Vec<u32> = (0..10).collect();
        let events = [
            CacheEvent::Removed { hash: 90 },
            CacheEvent::Stored {
                hash: 10,
                parent: None,
                block_index: 0,
            },
            CacheEvent::Removed { hash: 91 },
            CacheEvent::Stored {
                hash: 11,
                parent: Some(10),
                block_index: 1,
            },
            // Block 2 was already cached: a new run starts at block 3.
            CacheEvent::Stored {
                hash: 13,
                parent: Some(12),
                block_index: 3,
            },
        ];
        let mut out = Vec::new();
        group_admission(events, &prompt, 2, &mut out);
        let ints = |hashes: &[u64]| hashes.iter().map(|&h| BlockHash::Int(h)).collect();
        let gpu = Some("GPU".to_owned());
        let mut removed = BlockRemoved::new(ints(&[90, 91]));
        removed.medium = gpu.clone();
        let mut first = BlockStored::new(ints(&[10, 11]), None, vec![0, 1, 2, 3], 2);
        first.medium = gpu.clone();
        let mut second = BlockStored::new(ints(&[13]), Some(BlockHash::Int(12)), vec![6, 7], 2);
        second.medium = gpu;
        assert_eq!(
            out,
            vec![
                KvEvent::BlockRemoved(removed),
                KvEvent::BlockStored(first),
                KvEvent::BlockStored(second),
            ]
        );
    }

    #[test]
    fn a_batch_is_published_as_it_was_recorded() {
        let mut stored = BlockStored::new(vec![BlockHash::Int(1)], None, vec![5, 6], 2);
        stored.medium = Some("GPU".to_owned());
        let events = vec![KvEvent::BlockStored(stored), KvEvent::AllBlocksCleared];
        let batch = KvBatch {
            at: Duration::from_secs(3),
            events: events.clone(),
        };
        let published = batch.into_event_batch(1_700_000_000.5);
        assert_eq!(published, EventBatch::new(1_700_000_000.5, events));
    }
}
