//! The prefix cache's changes per scheduler step: what the engine publishes
//! as vLLM's KV-cache events.
//!
//! vLLM's scheduler collects the block pool's events during a step and
//! publishes them as one batch; an engine with [`Engine::set_kv_events`]
//! on does the same, sans-IO: every step that changed the prefix index
//! leaves one [`KvBatch`] for the owner to drain
//! ([`Engine::drain_kv_batches`]). The HTTP server publishes each batch on
//! a ZMQ PUB socket (feature `kv-events`, `KvBatch::to_event_batch`); the
//! routing simulator can feed them to a block index without sockets.
//!
//! Within one admission the cache's evictions come first, as one
//! [`KvChange::Removed`], then its new blocks as [`KvChange::Stored`] runs
//! of consecutive blocks (one run per admitted request unless a block in
//! the middle was already cached). Reordering evictions before stores of
//! the same admission is safe: a block stored for a request is referenced
//! by it and cannot be evicted during that admission. Applying a step's
//! changes in order to a set of hashes gives the cache's set of hashed
//! blocks after the step ([`KvCache::cached_hashes`]).
//!
//! Block hashes are engine-sim's own chain hashes
//! ([`tokens::block_hashes`]), 64-bit; on the wire they travel as
//! `BlockHash::Int` (vLLM sends ints or bytes; an int is what its builtin
//! hash sends and what a consumer keys on cheapest).
//!
//! [`Engine::set_kv_events`]: crate::Engine::set_kv_events
//! [`Engine::drain_kv_batches`]: crate::Engine::drain_kv_batches
//! [`KvCache::cached_hashes`]: crate::cache::KvCache::cached_hashes
//! [`tokens::block_hashes`]: crate::tokens::block_hashes

use std::time::Duration;

use crate::cache::CacheEvent;

/// One change to the prefix index, grouped as vLLM groups its events.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvChange {
    /// Consecutive full blocks of one prompt became cached.
    Stored {
        /// The blocks' chain hashes, first block first.
        block_hashes: Vec<u64>,
        /// The hash of the block before the first one; `None` when the
        /// first one starts the prompt.
        parent: Option<u64>,
        /// The blocks' token ids, concatenated (`block_size` per block).
        token_ids: Vec<u32>,
    },
    /// Cached blocks were evicted.
    Removed {
        /// The evicted blocks' chain hashes, in eviction order.
        block_hashes: Vec<u64>,
    },
    /// Every cached block was dropped.
    Cleared,
}

/// The changes of one scheduler step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvBatch {
    /// Model time of the step's start, when its admissions changed the
    /// cache.
    pub at: Duration,
    /// The changes, in the order to apply them.
    pub changes: Vec<KvChange>,
}

/// Appends one admission's cache events to `out`: evictions first (one
/// `Removed`), then runs of consecutive stored blocks with their token ids
/// from `prompt`.
pub(crate) fn group_admission(
    events: impl IntoIterator<Item = CacheEvent>,
    prompt: &[u32],
    block_size: usize,
    out: &mut Vec<KvChange>,
) {
    let mut removed = Vec::new();
    let mut stored: Vec<KvChange> = Vec::new();
    let mut last_index = None;
    for event in events {
        match event {
            CacheEvent::Removed { hash } => removed.push(hash),
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
                    Some(KvChange::Stored {
                        block_hashes,
                        token_ids,
                        ..
                    }) if continues => {
                        block_hashes.push(hash);
                        token_ids.extend_from_slice(tokens);
                    }
                    _ => stored.push(KvChange::Stored {
                        block_hashes: vec![hash],
                        parent,
                        token_ids: tokens.to_vec(),
                    }),
                }
                last_index = Some(block_index);
            }
        }
    }
    if !removed.is_empty() {
        out.push(KvChange::Removed {
            block_hashes: removed,
        });
    }
    out.extend(stored);
}

#[cfg(all(feature = "kv-events", not(loom)))]
impl KvBatch {
    /// This batch in the `kv-events` crate's types, ready to publish: hashes
    /// as [`kv_events::BlockHash::Int`], `block_size` on every
    /// `BlockStored`, `medium` `"GPU"` as vLLM sends for its GPU cache, and
    /// `ts` (seconds since the Unix epoch) as given, since the batch
    /// itself only knows model time.
    pub fn to_event_batch(&self, ts: f64, block_size: usize) -> kv_events::EventBatch {
        use kv_events::{BlockHash, BlockRemoved, BlockStored, KvEvent};
        let block_size = u32::try_from(block_size).unwrap_or(u32::MAX);
        let events = self
            .changes
            .iter()
            .map(|change| match change {
                KvChange::Stored {
                    block_hashes,
                    parent,
                    token_ids,
                } => {
                    let mut stored = BlockStored::new(
                        block_hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
                        parent.map(BlockHash::Int),
                        token_ids.clone(),
                        block_size,
                    );
                    stored.medium = Some("GPU".to_owned());
                    KvEvent::BlockStored(stored)
                }
                KvChange::Removed { block_hashes } => {
                    let mut removed = BlockRemoved::new(
                        block_hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
                    );
                    removed.medium = Some("GPU".to_owned());
                    KvEvent::BlockRemoved(removed)
                }
                KvChange::Cleared => KvEvent::AllBlocksCleared,
            })
            .collect();
        kv_events::EventBatch::new(ts, events)
    }
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
        assert_eq!(
            out,
            vec![
                KvChange::Removed {
                    block_hashes: vec![90, 91]
                },
                KvChange::Stored {
                    block_hashes: vec![10, 11],
                    parent: None,
                    token_ids: vec![0, 1, 2, 3],
                },
                KvChange::Stored {
                    block_hashes: vec![13],
                    parent: Some(12),
                    token_ids: vec![6, 7],
                },
            ]
        );
    }
}
