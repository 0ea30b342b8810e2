//! The index: block hash -> holders, fed by per-stream KV events, read by
//! the request path without locks.
//!
//! # Layout and why
//!
//! Our block hashes chain (`hash_i` depends on `hash_{i-1}`), so the blocks
//! every worker holds form a prefix tree, and a request's hashes are a path
//! from its root. The index stores that tree as **chains**: runs of
//! consecutive blocks, each the child of the one before, kept once in a
//! contiguous hash buffer, split into **segments** of blocks with the same
//! holder set (module `chain`). A **head table** maps the first block of
//! each chain to the chain (module `table`); nothing maps every block.
//!
//! That is enough to find any block, because a block is either the next
//! block of its parent's chain or the first block of a chain: a new block
//! is appended to its parent's chain when the parent is that chain's last
//! block, and starts a new chain otherwise (a branch, or no parent). So a
//! writer placing a child of a known block looks at one position of one
//! chain and then, at most, at the head table; and a lookup walking a
//! request probes the head table only where the request leaves a chain.
//!
//! Why not a map of every block (the previous layout: open addressing,
//! holders per block)? A 1,000-block lookup then costs about a thousand
//! random probes, one cache miss each, and an event one random write per
//! block; at 1,000 workers and two million blocks that measured 85 µs at
//! the 99th percentile and 4 M blocks/s. A radix tree with a child map per
//! node (not built) would follow the tree, but pay a child lookup at every
//! node and an allocation per node; since a block's hash names its whole
//! prefix, a table of chains' first blocks finds the next node directly.
//! Chains cost a probe per chain (a handful per request) and a write per
//! event per chain, and memory per block is one 8-byte hash plus, per
//! segment, its holder sets. A chain keeps blocks nobody holds any more:
//! an unheld tail until it is half the chain (then the chain is cut back to
//! its last held block), other unheld blocks until nobody holds any block
//! of the chain (then it is freed); [`IndexStats`] counts their bytes. Measured on the acceptance bench (2-core
//! machine, both layouts run alternately under the same load): lookups
//! about 15 times faster, events 2 to 4 times faster, and 33 instead of
//! 46 bytes per (block, worker) pair (figures in the README).
//!
//! An event that changes a chain publishes a new state of it, copying its
//! segment list (holder sets are shared, not copied), which would make
//! events of one block cost more than a table write. The two common ones
//! avoid it: a decode step appending a block to its conversation's chain,
//! and a stream extending the run it holds by a block, each change the
//! published state in place with one atomic store (module `chain`). With
//! them, events of one block are faster than with the table too (README).
//!
//! Streams translate engine hashes to a block's *place* (chain id and
//! position), not to our hash: a stream only ever names blocks it holds,
//! and a held block never moves (a chain is only cut back past its last
//! held block, and freed when nobody holds any of it). Removal therefore
//! needs no search at all.
//!
//! # Lookup
//!
//! [`KvIndex::lookup`] walks the request's block hashes chain by chain and
//! segment by segment (a run of blocks with one holder set): one compare
//! per segment, a binary search where the request leaves a chain, and
//! work per holder only where holders change. So its cost grows with the
//! chains and holder changes along the request, not with its length;
//! module `lookup` has the walk. Each holder's prefix length is where it
//! stopped holding; the walk stops when no holder is left or a block is
//! unknown.
//!
//! The hashes must chain as [`KvIndex::block_hashes`] returns them: a whole
//! request, or a contiguous part of one. A part that starts inside a chain
//! (not at a request's first block) is found by scanning every chain, a
//! slow path meant for diagnostics, as is [`KvIndex::holders_of`].
//!
//! # Concurrency: what is guaranteed
//!
//! - **Readers never block and never wait for writers.** A lookup announces
//!   itself to a two-counter grace-period scheme (module `rcu`), then does
//!   only atomic loads and reads of memory no writer changes. A chain's
//!   state (its length, buffer and segments) is replaced as a whole by one
//!   pointer store, except for two single-store changes in place (a longer
//!   length, a segment start moved forward) that leave each block with its
//!   old or its new holders; hash buffers are written only past every
//!   published length. Replaced states, buffers, the head table and the
//!   chain directory are freed only after every reader that could see them
//!   has left.
//! - **Writers are serialized** by one lock held while an event changes
//!   chains; hashing the event's tokens and the translation of engine
//!   hashes happen under the stream's own lock, so streams of different
//!   workers prepare their events in parallel. A writer may wait for
//!   readers to leave before it frees replaced memory (about once per 64
//!   replaced states or buffers, or per grown table or directory).
//! - **Per-chain atomicity, not snapshots.** Each chain's state is read
//!   atomically, and a holder added or removed is visible to lookups that
//!   start after the event was applied. An event that changes several
//!   chains publishes them one at a time, so a lookup that runs meanwhile
//!   may see some of its blocks and not others. For a prefix walk this
//!   means a concurrent store is seen as a shorter prefix, and a
//!   concurrent removal as a longer one, never anything that neither the
//!   state before nor the state after contains block by block.
//!
//! # Events and their edge cases
//!
//! Per (worker, rank) stream the index keeps a map from the engine's block
//! hash to ours. A `BlockStored` chains our hashes from its parent's (looked
//! up in that map; the chain root when there is no parent) over its token
//! ids. **A stored event whose parent the stream does not know cannot be
//! placed in the chain: all its blocks are skipped and counted**
//! (`unknown_parent_blocks`); so are events whose block size or token count
//! do not match (`malformed_blocks`). Removing an unknown engine hash is
//! counted (`unknown_removed_blocks`) and otherwise ignored. Storing an
//! engine hash the stream already maps changes nothing when it maps to the
//! same block, and moves it otherwise. Two engine hashes of one stream can
//! map to the same block of ours (vLLM adds extra keys, such as a cache
//! salt or multimodal hashes, that our token-only hash does not see); the
//! stream then holds the block until both are removed.
//!
//! # Bounds: a cap per holder
//!
//! A publisher can send valid, unique blocks without end (measured: 16.8 M
//! blocks, 634 MB in 60 s from one stream). An engine, though, never holds
//! more blocks than its cache has (vLLM's `num_gpu_blocks`), so each
//! (worker, rank) stream has a cap on the engine blocks (engine hashes) it
//! holds: its worker's, set by [`KvIndex::set_worker_capacity`], or
//! [`IndexConfig::max_blocks_per_holder`]. The cap is per rank because
//! each data-parallel rank is an engine with its own cache; ranks are the
//! router's configuration (a subscription each), not the publisher's
//! choice, so a worker holds at most its ranks times the cap.
//!
//! When a stored event leaves a stream over its cap, the stream drops its
//! **oldest** blocks: those it began to hold longest ago. A repeated store
//! of an engine hash the stream holds does not make it younger: vLLM
//! emits `BlockStored` once, when a block enters its prefix cache, and
//! reports no cache hits, so a repeat carries no news of use. Dropping
//! goes through the path of a `BlockRemoved` of those blocks (same
//! translation release, same holder removal, same cut-back and freeing of
//! chains, readers never blocked): a dropped parent whose children stay
//! held reads as the engine having evicted that block, so prefixes stop
//! before it. After every event a stream holds at most its cap; within a
//! stored event it may hold the event's blocks more. Lowering a cap drops
//! the excess at once.
//!
//! Keeping that order costs 8 bytes a held block (counted in
//! [`HolderStats::bytes`]), plus, for a while, about 17 bytes per block
//! removed before it was the oldest, and O(1) amortized work per block of
//! an event. The bookkeeping runs under the stream's own lock (dropped
//! blocks leave their chains as removed ones do), and lookups never wait
//! for any of it; module `stream` says how.
//!
//! One index describes one storage medium: a subscriber receiving vLLM's
//! `medium` field feeds GPU events to one index and offloaded tiers to
//! another (or drops them).

// The index by concern; this module ties them into `KvIndex` and holds
// the shared layout (`Inner`, the chain directory, a block's place). An
// event goes through apply (with its stream's state) into write; lookups
// read what write published; reclaim frees what write unlinked.
mod apply; // a stream's events into writer calls; `StreamWriter`
mod bits; // the holder and head bitsets
mod lookup; // the reader; `PrefixMatches`
mod reclaim; // retired memory and the teardown
mod stream; // per-stream translation, eviction order, registry
mod types; // ids, settings, events, errors, outcomes, stats
mod write; // the writer's copies and every store readers see

use std::collections::HashMap;
use std::hash::Hash;
use std::num::NonZeroUsize;
use std::sync::Arc as StdArc;
use std::sync::atomic::AtomicU64 as StatU64;

use crate::chain::ChainState;
use crate::hash::{BlockHash, BlockHasher};
use crate::rcu::Rcu;
use crate::sync::{Arc, AtomicPtr, AtomicU64, AtomicUsize, Mutex};
use crate::table::{self, Table};

pub use apply::StreamWriter;
pub use lookup::{HolderMatch, PrefixMatches};
pub use types::{
    ApplyOutcome, DEFAULT_MAX_BLOCKS_PER_HOLDER, EventCounters, Holder, HolderStats, IndexConfig,
    IndexStats, KvEvent, KvIndexError, Tier, WorkerId,
};

use stream::{Registry, Share, Stream};
use write::{ChainMeta, Writer};

/// Chain id -> the chain's current state (null: no chain with this id).
/// Replaced by a larger copy when ids run out.
struct Dir {
    slots: Box<[AtomicPtr<ChainState>]>,
}

impl Dir {
    fn with_capacity(capacity: usize) -> Self {
        Self {
            slots: (0..capacity)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
        }
    }
}

/// Where a block lives: a chain and a position in it. Stable while any
/// stream holds the block (chains are cut back or freed only past their
/// last held block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Loc {
    chain: u32,
    off: u32,
}

impl Loc {
    fn pack(self) -> u64 {
        (u64::from(self.chain) << 32) | u64::from(self.off)
    }

    fn unpack(word: u64) -> Self {
        Self {
            chain: (word >> 32) as u32,
            off: word as u32,
        }
    }
}

/// The key-independent part of the index, shared with stream writers.
struct Inner {
    hasher: BlockHasher,
    max_holders: u32,
    /// First block hash of each chain -> chain id + 1.
    heads: AtomicPtr<Table>,
    /// Chain id -> state.
    dir: AtomicPtr<Dir>,
    rcu: Rcu,
    writer: Mutex<Writer>,
    /// Holder slot -> packed (worker << 32 | rank); `VACANT` when free.
    slot_holder: Box<[AtomicU64]>,
    slot_high_water: AtomicUsize,
    registry: Mutex<Registry>,
    /// The cap of a worker before [`KvIndex::set_worker_capacity`].
    default_cap: usize,
    counters: [StatU64; 8],
}

/// A free holder slot's word in `slot_holder`.
const VACANT: u64 = u64::MAX;

// Indices into `Inner::counters`, one per field of `EventCounters`.
const C_EVENTS: usize = 0;
const C_STORED: usize = 1;
const C_REMOVED: usize = 2;
const C_UNKNOWN_PARENT: usize = 3;
const C_UNKNOWN_REMOVED: usize = 4;
const C_MALFORMED: usize = 5;
const C_CLEARS: usize = 6;
const C_EVICTED: usize = 7;

impl Inner {
    fn new(config: IndexConfig) -> Self {
        let max_holders = config.max_holders.clamp(1, 0x7fff_fffe);
        let writer = Writer::new();
        Self {
            hasher: BlockHasher::new(config.block_size),
            max_holders,
            heads: AtomicPtr::new(writer.heads),
            dir: AtomicPtr::new(writer.dir),
            rcu: Rcu::new(),
            writer: Mutex::new(writer),
            // Growing on demand would need another grace period; the array
            // costs 8 bytes per possible holder.
            slot_holder: (0..max_holders).map(|_| AtomicU64::new(VACANT)).collect(),
            slot_high_water: AtomicUsize::new(0),
            registry: Mutex::new(Registry::new()),
            default_cap: config.max_blocks_per_holder.get(),
            counters: Default::default(),
        }
    }

    fn count(&self, counter: usize, n: u64) {
        if n > 0 {
            self.counters[counter].fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn counters(&self) -> EventCounters {
        let c = |i: usize| self.counters[i].load(std::sync::atomic::Ordering::Relaxed);
        EventCounters {
            events: c(C_EVENTS),
            stored_blocks: c(C_STORED),
            removed_blocks: c(C_REMOVED),
            unknown_parent_blocks: c(C_UNKNOWN_PARENT),
            unknown_removed_blocks: c(C_UNKNOWN_REMOVED),
            malformed_blocks: c(C_MALFORMED),
            clears: c(C_CLEARS),
            evicted_blocks: c(C_EVICTED),
        }
    }

    fn stats(&self) -> IndexStats {
        let streams: Vec<Arc<Mutex<Stream>>> = {
            let reg = self.registry.lock();
            reg.streams
                .values()
                .flat_map(|s| s.values().cloned())
                .collect()
        };
        let mut holders: Vec<HolderStats> = streams
            .iter()
            .map(|s| {
                let s = s.lock();
                HolderStats {
                    holder: s.holder,
                    blocks: s.map.len(),
                    bytes: s.bytes(),
                    capacity: s.share.cap.load(std::sync::atomic::Ordering::Relaxed),
                    evicted: s.evicted,
                }
            })
            .collect();
        holders.sort_unstable_by_key(|h| h.holder);
        let w = self.writer.lock();
        let chains: usize = (0..w.states.len() as u32)
            .filter_map(|id| Self::current(&w, id))
            // SAFETY: the writer lock keeps current states alive.
            .map(|state| state.bytes() + unsafe { state.buf() }.bytes())
            .sum();
        let heads = Self::wheads(&w).capacity();
        IndexStats {
            blocks: w.blocks,
            pairs: w.pairs,
            // Chains; the head table and the writer's copy of it; the chain
            // directory and the writer's per-chain arrays; holder slots.
            index_bytes: chains
                + heads * (std::mem::size_of::<table::Slot>() + 16)
                + w.head_bits.len() * 8
                + Self::wdir(&w).slots.len() * 8
                + w.states.capacity() * 8
                + w.meta.capacity() * std::mem::size_of::<ChainMeta>()
                + w.meta
                    .iter()
                    .map(|m| m.starts.capacity() * 4)
                    .sum::<usize>()
                + self.slot_holder.len() * 8,
            translation_bytes: holders.iter().map(|h| h.bytes).sum(),
            holders,
            counters: self.counters(),
        }
    }
}

/// from their KV events. See the [module docs](self) for the layout and the
/// concurrency guarantee.
///
/// `K` is the router's own key for a worker (its URL, or a richer identity
/// with a registration generation); the index interns it to a [`WorkerId`].
pub struct KvIndex<K = String> {
    inner: Arc<Inner>,
    keys: Mutex<HashMap<K, WorkerId>>,
}

impl<K> std::fmt::Debug for KvIndex<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndex")
            .field("block_size", &self.inner.hasher.block_size())
            .field("max_holders", &self.inner.max_holders)
            .finish_non_exhaustive()
    }
}

impl<K: Hash + Eq + Clone> Default for KvIndex<K> {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

impl<K: Hash + Eq + Clone> KvIndex<K> {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Self {
        Self {
            inner: Arc::new(Inner::new(config)),
            keys: Mutex::new(HashMap::new()),
        }
    }

    /// The hasher for request token ids, with this index's block size.
    pub fn hasher(&self) -> BlockHasher {
        self.inner.hasher
    }

    /// Our block hashes of a request's token ids (full blocks only), for
    /// the base model or LoRA adapter `lora_id`.
    pub fn block_hashes(&self, token_ids: &[u32], lora_id: Option<u64>) -> Vec<BlockHash> {
        self.inner.hasher.with_lora(lora_id).hash_blocks(token_ids)
    }

    /// The id of worker `key`, registering it on first sight. The same key
    /// gets the same id until [`KvIndex::unregister_worker`].
    pub fn register_worker(&self, key: K) -> WorkerId {
        let mut keys = self.keys.lock();
        if let Some(&id) = keys.get(&key) {
            return id;
        }
        let id = {
            let mut reg = self.inner.registry.lock();
            let id = WorkerId(reg.next_worker);
            reg.next_worker += 1;
            reg.streams.insert(id, HashMap::new());
            reg.shares
                .insert(id, StdArc::new(Share::new(self.inner.default_cap)));
            id
        };
        keys.insert(key, id);
        id
    }

    /// The id of a registered worker.
    pub fn worker_id(&self, key: &K) -> Option<WorkerId> {
        self.keys.lock().get(key).copied()
    }

    /// Forgets a worker: drops every block its streams hold, closes its
    /// [`StreamWriter`]s (they then return [`KvIndexError::UnknownWorker`])
    /// and frees its holder slots once no lookup can still see them.
    /// Returns whether the worker was registered. Its id is not reused.
    pub fn unregister_worker(&self, worker: WorkerId) -> bool {
        self.keys.lock().retain(|_, id| *id != worker);
        self.inner.unregister(worker)
    }

    /// Drops everything `worker` holds on every rank (for example when its
    /// event stream was lost and will be replayed). The worker stays
    /// registered. Returns the blocks no longer held.
    pub fn clear_worker(&self, worker: WorkerId) -> Result<u64, KvIndexError> {
        let streams = self
            .inner
            .streams_of(worker)
            .ok_or(KvIndexError::UnknownWorker(worker))?;
        self.inner.count(C_CLEARS, 1);
        let mut removed = 0;
        for stream in streams {
            let mut stream = stream.lock();
            if !stream.dead {
                removed += self.inner.clear_stream(&mut stream);
            }
        }
        Ok(removed)
    }

    /// Sets the most engine blocks each data-parallel rank of `worker` may
    /// hold in the index (now and for ranks it opens later): the engine's
    /// `num_gpu_blocks` when known (vLLM exports it as the `num_gpu_blocks`
    /// label of `vllm:cache_config_info`), since an engine never holds more.
    /// A rank that holds more drops its oldest blocks at once, and whenever
    /// a stored event takes it over the cap (see the [module
    /// docs](self#bounds-a-cap-per-holder)). Returns the engine blocks
    /// dropped now.
    pub fn set_worker_capacity(
        &self,
        worker: WorkerId,
        blocks: NonZeroUsize,
    ) -> Result<u64, KvIndexError> {
        let (share, streams) = {
            let reg = self.inner.registry.lock();
            let share = reg
                .shares
                .get(&worker)
                .map(StdArc::clone)
                .ok_or(KvIndexError::UnknownWorker(worker))?;
            let streams: Vec<_> = reg
                .streams
                .get(&worker)
                .map(|s| s.values().cloned().collect())
                .unwrap_or_default();
            (share, streams)
        };
        share
            .cap
            .store(blocks.get(), std::sync::atomic::Ordering::Relaxed);
        let mut evicted = 0;
        for stream in streams {
            let mut stream = stream.lock();
            if !stream.dead {
                evicted += self.inner.enforce_cap(&mut stream);
            }
        }
        Ok(evicted)
    }

    /// The most engine blocks each rank of `worker` may hold (`None`: not
    /// registered).
    pub fn worker_capacity(&self, worker: WorkerId) -> Option<usize> {
        let reg = self.inner.registry.lock();
        let share = reg.shares.get(&worker)?;
        Some(share.cap.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Engine blocks `worker`'s ranks dropped because they held more than
    /// its cap, since it was registered (`None`: not registered). Cheap: a
    /// counter for metrics (per worker "evicted over cap").
    pub fn evicted_over_cap(&self, worker: WorkerId) -> Option<u64> {
        let reg = self.inner.registry.lock();
        let share = reg.shares.get(&worker)?;
        Some(share.evicted.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// A writer for the event stream of `worker`'s data-parallel `rank`,
    /// taking a holder slot on first use. Keep it: applying through it skips
    /// the registry lock.
    pub fn stream(&self, worker: WorkerId, rank: u32) -> Result<StreamWriter, KvIndexError> {
        let stream = self.inner.stream(Holder { worker, rank })?;
        Ok(StreamWriter {
            inner: Arc::clone(&self.inner),
            stream,
        })
    }

    /// Applies one event of `worker`'s `rank` stream (see
    /// [`KvIndex::stream`] for repeated use).
    pub fn apply(
        &self,
        worker: WorkerId,
        rank: u32,
        event: &KvEvent,
    ) -> Result<ApplyOutcome, KvIndexError> {
        let stream = self.inner.stream(Holder { worker, rank })?;
        let mut stream = stream.lock();
        self.inner.apply(&mut stream, event)
    }

    /// Every holder's longest held prefix of a request, given its block
    /// hashes in order ([`KvIndex::block_hashes`]). Never blocks. The cost
    /// grows with the chains and holder changes along the request, not with
    /// its length; a sequence that starts inside a chain (a part of a
    /// request) is first found by a scan of the whole index (see the
    /// [module docs](self)).
    pub fn lookup(&self, hashes: &[BlockHash]) -> PrefixMatches {
        let mut out = PrefixMatches::default();
        self.inner.lookup_into(hashes, &mut out);
        out
    }

    /// [`KvIndex::lookup`] into a reused result, without allocating once
    /// its buffers have grown.
    pub fn lookup_into(&self, hashes: &[BlockHash], out: &mut PrefixMatches) {
        self.inner.lookup_into(hashes, out);
    }

    /// The holders of one block, sorted. A diagnostic: a block that does
    /// not start a chain is found by scanning the whole index.
    pub fn holders_of(&self, hash: BlockHash) -> Vec<Holder> {
        self.inner.holders_of(hash)
    }

    /// Cumulative event counters.
    pub fn counters(&self) -> EventCounters {
        self.inner.counters()
    }

    /// Memory and entry counts, per stream and in total.
    pub fn stats(&self) -> IndexStats {
        self.inner.stats()
    }
}
