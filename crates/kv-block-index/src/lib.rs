//! A block index of the KV caches a fleet of LLM engine workers holds,
//! built from the engines' own KV-cache events.
//!
//! A router's prefix tree (such as `radix-affinity`) records where the
//! router *sent* prompts; engines evict, restart and share prefixes behind
//! its back. vLLM publishes what each worker and data-parallel rank actually
//! holds as events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). Fed
//! with those events, a [`KvIndex`] answers, for a request's token ids, how
//! many leading blocks each worker holds — and every router replica that
//! sees the same events holds the same index.
//!
//! The crate knows no transport: a subscriber decodes the engine's messages
//! (ZMQ + msgpack for vLLM) into [`KvEvent`]s and applies them through a
//! [`StreamWriter`] per (worker, rank); a routing policy hashes the request
//! ([`KvIndex::block_hashes`]) and calls [`KvIndex::lookup`]. The one
//! conversion from vLLM's wire events to [`KvEvent`]s is `wire`'s
//! `to_index_event` (feature `wire`).
//!
//! # Example
//!
//! ```
//! use kv_block_index::{EngineHash, Holder, IndexConfig, KvEvent, KvIndex};
//!
//! let index: KvIndex<&str> = KvIndex::new(IndexConfig { block_size: 4, ..Default::default() });
//! let a = index.register_worker("http://engine-a:8000");
//! let b = index.register_worker("http://engine-b:8000");
//!
//! // Engine a cached two blocks of a prompt, engine b only the first.
//! let prompt: Vec<u32> = (1..=10).collect();
//! index
//!     .apply(a, 0, &KvEvent::BlockStored {
//!         block_hashes: vec![EngineHash::from_int(11), EngineHash::from_int(12)],
//!         parent_block_hash: None,
//!         token_ids: prompt[..8].to_vec(),
//!         block_size: 4,
//!         lora_id: None,
//!     })
//!     .unwrap();
//! let stream_b = index.stream(b, 0).unwrap();
//! stream_b
//!     .apply(&KvEvent::BlockStored {
//!         block_hashes: vec![EngineHash::from_bytes(b"engine b's first block")],
//!         parent_block_hash: None,
//!         token_ids: prompt[..4].to_vec(),
//!         block_size: 4,
//!         lora_id: None,
//!     })
//!     .unwrap();
//!
//! // A request with this prompt (two full blocks; the last two tokens are
//! // a partial block and not hashed).
//! let hashes = index.block_hashes(&prompt, None);
//! assert_eq!(hashes.len(), 2);
//! let found = index.lookup(&hashes);
//! assert_eq!(found.best().map(|m| (m.holder.worker, m.blocks)), Some((a, 2)));
//! assert_eq!(found.blocks_of(Holder { worker: b, rank: 0 }), 1);
//!
//! // Engine a evicts its second block.
//! index
//!     .apply(a, 0, &KvEvent::BlockRemoved { block_hashes: vec![EngineHash::from_int(12)] })
//!     .unwrap();
//! assert_eq!(index.lookup(&hashes).blocks_of(Holder { worker: a, rank: 0 }), 1);
//! ```
//!
//! # Design
//!
//! - [`hash`]: our own chained block hash, stable across processes,
//!   machines and versions; how engine hashes (ints or bytes) are made
//!   opaque.
//! - [`index`]: the layout (chains of consecutive blocks stored once,
//!   split into segments with one holder set each, found through a table of
//!   chains' first blocks), the lookup (a step per chain and holder change,
//!   not per block), the event edge cases (unknown parents are counted and
//!   skipped) and the concurrency guarantee: **lookups never block and
//!   never wait for writers**; writers are serialized per event by one
//!   lock and may wait for readers before freeing memory.
//! - Bounds: each (worker, rank) holds at most a cap of blocks (the
//!   engine's `num_gpu_blocks` through [`KvIndex::set_worker_capacity`], or
//!   [`IndexConfig::max_blocks_per_holder`]); a stream over it drops its
//!   oldest blocks, counted ([`KvIndex::evicted_over_cap`]), so a publisher
//!   flooding valid unique blocks cannot grow the index without bound.
//!
//! # Feature flags and testing
//!
//! - `wire` (off by default): the `wire` module, converting vLLM's KV
//!   events as the `kv-events` crate decodes them (its wire types only, no
//!   sockets) into [`KvEvent`]s; events for another medium or KV-cache
//!   group are skipped. The router (through kv-event-bridge) and the
//!   routing simulator both convert with it.
//!
//! The shared-memory protocol is model-checked with loom
//! (`RUSTFLAGS="--cfg loom" cargo test --release --test 'loom_*'`), the
//! event semantics by a proptest state machine and a fuzz target
//! ([`fuzzing`]) against a plain reference model.
//!
//! # Stability
//!
//! The block hash ([`BlockHasher`]) is stable: the same tokens, block size
//! and LoRA id hash the same in every version of the same major release.
#![warn(missing_docs)]

mod chain;
pub mod fuzzing;
pub mod hash;
pub mod index;
mod rcu;
mod sync;
mod table;
#[cfg(feature = "wire")]
pub mod wire;

pub use hash::{BlockHash, BlockHasher, EngineHash};
pub use index::{
    ApplyOutcome, DEFAULT_MAX_BLOCKS_PER_HOLDER, EventCounters, Holder, HolderMatch, HolderStats,
    IndexConfig, IndexStats, KvEvent, KvIndex, KvIndexError, PrefixMatches, StreamWriter, Tier,
    WorkerId,
};
