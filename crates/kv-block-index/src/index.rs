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
//! [`KvIndex::lookup`] walks the request's block hashes, keeping the set of
//! holders that held every block so far ("live", a bitset by holder slot).
//! Within a chain the walk goes segment by segment. Since equal hashes mean
//! equal prefixes, a request follows a whole segment exactly when its hash
//! at the segment's last position is the chain's: one compare per segment,
//! and a binary search where the request leaves the chain. At a segment
//! boundary the live holders can only lose those of the previous segment's
//! holders the next one lacks, which each segment keeps (`gone`), so the
//! step costs that difference, not the sets. Entering a chain at its head
//! intersects the live set with the chain's first holder set, a word of the
//! bitset at a time. Dropped holders record the position as their prefix
//! length; the walk stops when no holder is live or a block is unknown.
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
//! The order is a queue of engine hashes per stream (8 bytes a block,
//! counted in [`HolderStats::bytes`]): a hash joins the back when the
//! stream begins to hold it; eviction pops the front. A removal cannot
//! take its hash out of the middle, so the entry goes stale, with a count
//! per hash (a hash's stale entries precede its live one, so the first one
//! met from the front is stale exactly when it has a count). Popping skips
//! stale entries, each paid for by the removal that made it; when they
//! outnumber half the live ones (plus 64) the queue is compacted, at most
//! three entries per removal. So every event costs O(1) amortized per
//! block on top of what it cost before; the one removal that triggers a
//! compaction walks the queue (at most 1.5 times the stream's blocks plus
//! 64 entries). All of it runs under the stream's own lock, except the
//! holder removals, which take the writer lock as a removal does; lookups
//! never wait for any of it. Memory: 8 bytes a held block, plus, while
//! they last, 8 bytes and a count entry (about 17 bytes) per stale entry.
//! A doubly linked list through the translation map would need no stale
//! entries but cost 24 bytes per held block.
//!
//! One index describes one storage medium: a subscriber receiving vLLM's
//! `medium` field feeds GPU events to one index and offloaded tiers to
//! another (or drops them).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::num::NonZeroUsize;
use std::sync::Arc as StdArc;
use std::sync::atomic::{AtomicU64 as StatU64, AtomicUsize as StatUsize};

use crate::chain::{self, ChainState, Edit, HashBuf, Set};
use crate::hash::{BlockHash, BlockHasher, EngineHash};
use crate::rcu::Rcu;
use crate::sync::{Arc, AtomicPtr, AtomicU64, AtomicUsize, Mutex, Ordering};
use crate::table::{self, Shadow, Table};

/// A worker as the index knows it: a small integer handed out by
/// [`KvIndex::register_worker`]. Ids are not reused within one index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId(u32);

impl WorkerId {
    /// The id as an integer (dense, from zero).
    pub fn get(self) -> u32 {
        self.0
    }
}

/// Who holds a block: a worker's data-parallel rank (0 without data
/// parallelism). Each (worker, rank) has its own KV cache and event stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Holder {
    /// The worker.
    pub worker: WorkerId,
    /// Its data-parallel rank.
    pub rank: u32,
}

/// Settings of a [`KvIndex`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Tokens per block; must match the engines' `block_size`. Default 16.
    pub block_size: usize,
    /// Most (worker, rank) streams that may hold blocks at once. Default
    /// 65,536. Lookups keep a bitset of this many bits at most.
    pub max_holders: u32,
    /// Most blocks one (worker, rank) stream may hold in the index unless
    /// [`KvIndex::set_worker_capacity`] sets its worker's own cap; beyond
    /// it the stream's oldest blocks are dropped (see the [module
    /// docs](self#bounds-a-cap-per-holder)). Default
    /// [`DEFAULT_MAX_BLOCKS_PER_HOLDER`].
    pub max_blocks_per_holder: NonZeroUsize,
}

/// The default [`IndexConfig::max_blocks_per_holder`]: 2^20 = 1,048,576
/// blocks, more than an H100 (80 GB) holds of the smallest common models.
/// Qwen2.5-0.5B: 24 layers x 2 KV heads x 64 dims x 2 (K and V) x 2 bytes
/// = 12 KiB per token, 192 KiB per 16-token block; vLLM's default 90% of
/// 80 GiB, less about 2 GiB of weights and activations, leaves about 70
/// GiB: some 380,000 blocks, 760,000 with an 8-bit KV cache. Larger models
/// hold far fewer (Llama-3.1-8B: 128 KiB per token, about 28,000 blocks).
/// A GPU with more memory can exceed it with a tiny model: an engine whose
/// `num_gpu_blocks` is known should get exactly that
/// ([`KvIndex::set_worker_capacity`]).
pub const DEFAULT_MAX_BLOCKS_PER_HOLDER: NonZeroUsize = match NonZeroUsize::new(1 << 20) {
    Some(n) => n,
    None => unreachable!(),
};

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            max_holders: 1 << 16,
            max_blocks_per_holder: DEFAULT_MAX_BLOCKS_PER_HOLDER,
        }
    }
}

/// A KV-cache event of one (worker, rank) stream, as the engine sent it,
/// with engine hashes made opaque ([`EngineHash`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// vLLM's `BlockStored`: new full blocks, in order, each the child of
    /// the one before; the first is the child of `parent_block_hash`.
    BlockStored {
        /// The engine's hashes of the stored blocks.
        block_hashes: Vec<EngineHash>,
        /// The engine's hash of the first block's parent (`None`: the
        /// blocks start a prompt).
        parent_block_hash: Option<EngineHash>,
        /// The blocks' token ids: `block_hashes.len() * block_size` of them.
        token_ids: Vec<u32>,
        /// Tokens per block, as the engine reports it.
        block_size: usize,
        /// The LoRA adapter the blocks were computed with (`None`: none).
        lora_id: Option<u64>,
    },
    /// vLLM's `BlockRemoved`: blocks evicted from the cache.
    BlockRemoved {
        /// The engine's hashes of the removed blocks.
        block_hashes: Vec<EngineHash>,
    },
    /// vLLM's `AllBlocksCleared`: the stream's cache was reset.
    AllBlocksCleared,
}

/// Errors of the index's write side.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvIndexError {
    /// The worker id was never registered with this index, or was
    /// unregistered.
    #[error("worker {0:?} is not registered with this index")]
    UnknownWorker(WorkerId),
    /// Every holder slot ([`IndexConfig::max_holders`]) is taken by a live
    /// (worker, rank) stream.
    #[error("all {max} holder slots are in use")]
    HolderCapacity {
        /// The configured limit.
        max: u32,
    },
}

/// What applying one event did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Blocks recorded as held.
    pub stored: u64,
    /// Blocks no longer held.
    pub removed: u64,
    /// Stored blocks skipped because their parent is unknown to the stream.
    pub unknown_parent: u64,
    /// Removed engine hashes the stream did not know.
    pub unknown_removed: u64,
    /// Stored blocks skipped because the block size or token count did not
    /// match.
    pub malformed: u64,
    /// Engine blocks the stream held that were dropped because it held
    /// more than its cap (its oldest; their (block, holder) pairs are also
    /// in `removed`).
    pub evicted: u64,
}

/// Cumulative event counters of an index, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventCounters {
    /// Events applied.
    pub events: u64,
    /// Blocks recorded as held.
    pub stored_blocks: u64,
    /// Blocks no longer held (removed, cleared or evicted over a cap).
    pub removed_blocks: u64,
    /// Stored blocks skipped: parent unknown to the stream.
    pub unknown_parent_blocks: u64,
    /// Removed engine hashes unknown to the stream.
    pub unknown_removed_blocks: u64,
    /// Stored blocks skipped: block size or token count mismatch.
    pub malformed_blocks: u64,
    /// `AllBlocksCleared` events and [`KvIndex::clear_worker`] calls.
    pub clears: u64,
    /// Engine blocks dropped because their stream held more than its cap
    /// (the stream's oldest; see [`KvIndex::set_worker_capacity`]).
    pub evicted_blocks: u64,
}

/// Memory and entries of one (worker, rank) stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HolderStats {
    /// The stream.
    pub holder: Holder,
    /// Engine blocks it holds (entries of its translation map).
    pub blocks: usize,
    /// Bytes of its translation map and eviction order (the shared index
    /// is counted once, in [`IndexStats::index_bytes`]).
    pub bytes: usize,
    /// Most engine blocks it may hold (its worker's cap).
    pub capacity: usize,
    /// Engine blocks dropped because it held more than its cap.
    pub evicted: u64,
}

/// Memory accounting of an index: a plain struct for metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct blocks (our hashes) held by at least one stream.
    pub blocks: usize,
    /// (block, holder) pairs.
    pub pairs: usize,
    /// Bytes of the shared index: chains (hash buffers, segments, holder
    /// sets), the head table, the chain directory and the writer's copies
    /// of them, and the holder slot table.
    pub index_bytes: usize,
    /// Bytes of all streams' translation maps and eviction orders.
    pub translation_bytes: usize,
    /// Per stream, ordered by holder.
    pub holders: Vec<HolderStats>,
    /// Event counters.
    pub counters: EventCounters,
}

impl IndexStats {
    /// All bytes: index plus translation maps.
    pub fn total_bytes(&self) -> usize {
        self.index_bytes + self.translation_bytes
    }

    /// Total bytes per (block, holder) pair (0 when empty).
    pub fn bytes_per_pair(&self) -> f64 {
        if self.pairs == 0 {
            0.0
        } else {
            self.total_bytes() as f64 / self.pairs as f64
        }
    }
}

/// One holder's longest held prefix of a lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HolderMatch {
    /// The holder.
    pub holder: Holder,
    /// Leading blocks of the request it holds (at least 1).
    pub blocks: usize,
}

/// The result of [`KvIndex::lookup`]: every holder of at least the first
/// block with its longest held prefix, longest first. Reusable across
/// lookups through [`KvIndex::lookup_into`] (its buffers are kept).
#[derive(Clone, Debug, Default)]
pub struct PrefixMatches {
    matches: Vec<HolderMatch>,
    request_blocks: usize,
    scratch: Scratch,
}

#[derive(Clone, Debug, Default)]
struct Scratch {
    /// Live holders (a bitset by slot; all zero between lookups).
    in_alive: Vec<u64>,
    keep: Vec<u64>,
    drops: Vec<(u32, u32)>,
}

impl PrefixMatches {
    /// Holders with their prefix lengths, longest first (ties in no
    /// particular order).
    pub fn matches(&self) -> &[HolderMatch] {
        &self.matches
    }

    /// The holder with the longest prefix, if any holds the first block.
    pub fn best(&self) -> Option<HolderMatch> {
        self.matches.first().copied()
    }

    /// The prefix length of `holder` (0 when it holds not even the first
    /// block).
    pub fn blocks_of(&self, holder: Holder) -> usize {
        self.matches
            .iter()
            .find(|m| m.holder == holder)
            .map_or(0, |m| m.blocks)
    }

    /// Blocks in the request that was looked up.
    pub fn request_blocks(&self) -> usize {
        self.request_blocks
    }
}

#[inline]
fn bit_set(bits: &mut Vec<u64>, slot: u32) {
    let w = (slot / 64) as usize;
    if w >= bits.len() {
        bits.resize(w + 1, 0);
    }
    bits[w] |= 1 << (slot % 64);
}

#[inline]
fn bit_clear(bits: &mut [u64], slot: u32) {
    if let Some(w) = bits.get_mut((slot / 64) as usize) {
        *w &= !(1 << (slot % 64));
    }
}

#[inline]
fn bit_get(bits: &[u64], slot: u32) -> bool {
    bits.get((slot / 64) as usize)
        .is_some_and(|w| w & (1 << (slot % 64)) != 0)
}

/// A hasher for keys that are already uniform 64-bit values.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// Unlinked memory waiting for a grace period.
struct Garbage(Vec<GarbageItem>);

enum GarbageItem {
    Table(*mut Table),
    Dir(*mut Dir),
    State(*mut ChainState),
    Buf(*mut HashBuf),
}

// SAFETY: the pointers are uniquely owned by the garbage list once unlinked
// (readers only borrow them until the grace period ends); freeing them from
// another thread is fine, as for a Box.
unsafe impl Send for Garbage {}

impl Garbage {
    /// Frees everything. Call only after a grace period that began after
    /// the items were unlinked.
    fn free(&mut self) {
        for item in self.0.drain(..) {
            // Each pointer came from Box::into_raw, was unlinked (no table,
            // directory or published state leads to it any more), and no
            // reader can still hold it.
            match item {
                // SAFETY: see above.
                GarbageItem::Table(t) => drop(unsafe { Box::from_raw(t) }),
                // SAFETY: see above.
                GarbageItem::Dir(d) => drop(unsafe { Box::from_raw(d) }),
                // SAFETY: see above (a state does not own its buffer).
                GarbageItem::State(s) => drop(unsafe { Box::from_raw(s) }),
                // SAFETY: see above.
                GarbageItem::Buf(b) => drop(unsafe { Box::from_raw(b) }),
            }
        }
    }
}

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

/// Replaced states and buffers gathered before a writer waits for a grace
/// period. Under loom every event that replaced something frees it, so the
/// models race readers against reclamation.
#[cfg(not(loom))]
const GARBAGE_BATCH: usize = 64;
#[cfg(loom)]
const GARBAGE_BATCH: usize = 1;

#[cfg(not(loom))]
const INITIAL_HEADS: usize = 64;
#[cfg(loom)]
const INITIAL_HEADS: usize = 4;

#[cfg(not(loom))]
const INITIAL_CHAINS: usize = 64;
#[cfg(loom)]
const INITIAL_CHAINS: usize = 1;

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

/// The writer's own view of the shared structures: it reads these and only
/// stores to the shared ones (see [`table::Shadow`]).
struct Writer {
    /// The current head table and its plain copy.
    heads: *mut Table,
    heads_shadow: Shadow,
    /// A bit per possible head (one bit per key of the table, by other bits
    /// of the hash than the table's): a clear bit means "no chain starts
    /// with this block" without a probe. Stale bits of freed chains are
    /// dropped when the table is rebuilt.
    head_bits: Vec<u64>,
    /// The current chain directory and, per chain id, its current state
    /// (null: none).
    dir: *mut Dir,
    states: Vec<*mut ChainState>,
    /// Keys in the head table (live and tombstones).
    heads_used: usize,
    /// Chains: heads with a chain.
    heads_live: usize,
    next_chain: u32,
    free_chains: Vec<u32>,
    /// Per chain id: the writer's copy of its numbers.
    meta: Vec<ChainMeta>,
    pairs: usize,
    blocks: usize,
    /// The chain being edited (published before another one is opened and
    /// at the end of every event).
    edit: Option<Edit>,
    /// Blocks waiting to get the current stream as holder: a chain and a
    /// range of positions (consecutive blocks are added as one range).
    pending: Option<(u32, u32, u32)>,
    /// Chains edited by the current event (cut back or freed at its end).
    touched: Vec<u32>,
    /// The shared empty holder set.
    empty: Set,
    /// The last edit's segment list, kept for its capacity.
    spare: Vec<chain::EditSeg>,
    scratch: Vec<u32>,
    garbage: Garbage,
    /// Set when a table or directory was retired: free it soon.
    urgent: bool,
}

// SAFETY: the raw pointers (the current table, directory and states, an
// open edit's hash buffer) point to memory the index owns and the writer
// only uses under the writer lock.
unsafe impl Send for Writer {}

/// The writer's copy of one chain's numbers: it reads these instead of the
/// published state's atomics.
#[derive(Debug, Default)]
struct ChainMeta {
    /// (block, holder) pairs the chain holds.
    pairs: u64,
    /// Its length.
    len: u32,
    /// Its segments' starts.
    starts: Vec<u32>,
}

/// What the streams of one worker share: its cap and eviction count.
/// Plain std atomics (also under loom): settings and counters, not part of
/// the memory protocol the loom models check.
#[derive(Debug)]
struct Share {
    /// Most engine blocks each of its streams may hold.
    cap: StatUsize,
    /// Engine blocks its streams dropped over the cap.
    evicted: StatU64,
}

/// Stale entries of a stream's eviction order kept before it is compacted:
/// compaction waits until they are more than half the live ones plus this,
/// so its cost is at most three entries per removal that made one stale.
const STALE_SLACK: usize = 64;

struct Stream {
    holder: Holder,
    slot: u32,
    dead: bool,
    /// Engine hash -> where our block lives (a packed `Loc`).
    map: IdMap<u64>,
    /// Blocks mapped by more than one engine hash: the extra count.
    extra: IdMap<u32>,
    /// The eviction order: every engine hash of `map` once, in the order
    /// the stream began to hold it, behind the stale entries of hashes
    /// removed since (see [`Stream::evict`]).
    order: VecDeque<u64>,
    /// Engine hash -> its stale entries in `order`. A hash's stale entries
    /// all come before its live one (an entry goes stale when the hash is
    /// removed, and a new one is pushed only when it is stored again), so
    /// the first entry of a hash met from the front is stale exactly when
    /// it has any.
    ghosts: IdMap<u32>,
    /// Stale entries in `order` (the sum of `ghosts`).
    stale: usize,
    /// Engine blocks this stream dropped over the cap.
    evicted: u64,
    /// The worker's cap and eviction count.
    share: StdArc<Share>,
    scratch: Vec<BlockHash>,
    locs: Vec<Loc>,
    /// The last block this stream stored (packed place, our hash): the
    /// parent of its next event when it decodes, read without a guard.
    last: Option<(u64, BlockHash)>,
}

impl Stream {
    fn bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.map.capacity() * (16 + 1)
            + self.extra.capacity() * (12 + 1)
            + self.order.capacity() * 8
            + self.ghosts.capacity() * (std::mem::size_of::<(u64, u32)>() + 1)
            + self.scratch.capacity() * 8
            + self.locs.capacity() * 8
    }

    /// Maps `engine` to a block; a hash the stream did not hold joins the
    /// back of the eviction order. Returns the previous place.
    fn map_insert(&mut self, engine: u64, place: u64) -> Option<u64> {
        let old = self.map.insert(engine, place);
        if old.is_none() {
            self.order.push_back(engine);
        }
        old
    }

    /// Unmaps `engine`; its entry in the eviction order goes stale.
    fn map_remove(&mut self, engine: u64) -> Option<u64> {
        let place = self.map.remove(&engine)?;
        *self.ghosts.entry(engine).or_insert(0) += 1;
        self.stale += 1;
        Some(place)
    }

    /// Whether an entry of `engine` met from the front of the order is
    /// stale; if so it is consumed (the caller drops the entry).
    fn take_ghost(ghosts: &mut IdMap<u32>, stale: &mut usize, engine: u64) -> bool {
        let Some(n) = ghosts.get_mut(&engine) else {
            return false;
        };
        *n -= 1;
        if *n == 0 {
            ghosts.remove(&engine);
        }
        *stale -= 1;
        true
    }

    /// Drops stale entries at the front of the order, and compacts the
    /// order when stale entries are more than half the live ones (plus
    /// [`STALE_SLACK`]): each removal pays for at most three entries of
    /// compaction, so the order holds at most 1.5 times the stream's
    /// blocks plus the slack. Stream-local work, under the stream's lock.
    fn tidy(&mut self) {
        while let Some(&front) = self.order.front() {
            if !Self::take_ghost(&mut self.ghosts, &mut self.stale, front) {
                break;
            }
            self.order.pop_front();
        }
        if self.stale > self.map.len() / 2 + STALE_SLACK {
            let Self {
                order,
                ghosts,
                stale,
                ..
            } = self;
            // Met front to back, a hash's stale entries come first.
            order.retain(|&engine| !Self::take_ghost(ghosts, stale, engine));
            debug_assert_eq!(*stale, 0);
            if order.capacity() > 4 * order.len() + STALE_SLACK {
                order.shrink_to(2 * order.len() + STALE_SLACK);
            }
            if ghosts.capacity() > 4 * STALE_SLACK {
                ghosts.shrink_to(STALE_SLACK);
            }
        }
        debug_assert_eq!(self.order.len(), self.map.len() + self.stale);
    }

    /// Drops the stream's oldest engine blocks (the ones it began to hold
    /// longest ago) until it holds at most `cap`; the blocks it no longer
    /// holds at all go to `locs`. Returns the engine blocks dropped. Each
    /// step pops the front of the order: a live entry is dropped, a stale
    /// one skipped (it was paid for by the removal that made it stale).
    fn evict(&mut self, cap: usize, locs: &mut Vec<Loc>) -> u64 {
        let mut dropped = 0;
        while self.map.len() > cap {
            let Some(engine) = self.order.pop_front() else {
                break;
            };
            if Self::take_ghost(&mut self.ghosts, &mut self.stale, engine) {
                continue;
            }
            if let Some(place) = self.map.remove(&engine) {
                let loc = Loc::unpack(place);
                if self.release(loc) {
                    locs.push(loc);
                }
                dropped += 1;
            }
        }
        self.tidy();
        self.evicted += dropped;
        self.share
            .evicted
            .fetch_add(dropped, std::sync::atomic::Ordering::Relaxed);
        dropped
    }

    /// Forgets the eviction order (the stream holds nothing).
    fn clear_order(&mut self) {
        self.order.clear();
        self.ghosts.clear();
        self.stale = 0;
    }

    /// Drops one engine hash's reference to a block: `true` when it was the
    /// last one, so the stream no longer holds the block.
    fn release(&mut self, loc: Loc) -> bool {
        let key = loc.pack();
        if let Some(extra) = self.extra.get_mut(&key) {
            *extra -= 1;
            if *extra == 0 {
                self.extra.remove(&key);
            }
            return false;
        }
        true
    }
}

struct Registry {
    streams: HashMap<WorkerId, HashMap<u32, Arc<Mutex<Stream>>>>,
    /// Per registered worker: its cap and eviction count.
    shares: HashMap<WorkerId, StdArc<Share>>,
    next_worker: u32,
    free_slots: Vec<u32>,
    next_slot: u32,
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

const VACANT: u64 = u64::MAX;

/// Words of the head bitset for a head table of `capacity` slots: eight
/// bits per slot, so at most 3/32 of the bits are set.
fn head_bits_words(capacity: usize) -> usize {
    (capacity / 8).max(1)
}

#[inline]
fn head_bit_index(bits: &[u64], key: u64) -> (usize, u64) {
    // The table probes from the low bits; take the high ones here.
    let bit = (key >> 32) as usize % (bits.len() * 64);
    (bit / 64, 1 << (bit % 64))
}

#[inline]
fn set_head_bit(bits: &mut [u64], key: u64) {
    let (word, mask) = head_bit_index(bits, key);
    bits[word] |= mask;
}

#[inline]
fn head_bit(bits: &[u64], key: u64) -> bool {
    let (word, mask) = head_bit_index(bits, key);
    bits[word] & mask != 0
}

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
        let heads = Box::into_raw(Box::new(Table::with_capacity(INITIAL_HEADS)));
        // SAFETY: just allocated.
        let heads_capacity = unsafe { &*heads }.capacity();
        let dir = Box::into_raw(Box::new(Dir::with_capacity(INITIAL_CHAINS)));
        Self {
            hasher: BlockHasher::new(config.block_size),
            max_holders,
            heads: AtomicPtr::new(heads),
            dir: AtomicPtr::new(dir),
            rcu: Rcu::new(),
            writer: Mutex::new(Writer {
                heads,
                heads_shadow: Shadow::new(heads_capacity),
                head_bits: vec![0; head_bits_words(heads_capacity)],
                dir,
                states: Vec::new(),
                heads_used: 0,
                heads_live: 0,
                next_chain: 0,
                free_chains: Vec::new(),
                meta: Vec::new(),
                pairs: 0,
                blocks: 0,
                edit: None,
                pending: None,
                touched: Vec::new(),
                empty: Set::from(Vec::new()),
                spare: Vec::new(),
                scratch: Vec::new(),
                garbage: Garbage(Vec::new()),
                urgent: false,
            }),
            // Growing on demand would need another grace period; the array
            // costs 8 bytes per possible holder.
            slot_holder: (0..max_holders).map(|_| AtomicU64::new(VACANT)).collect(),
            slot_high_water: AtomicUsize::new(0),
            registry: Mutex::new(Registry {
                streams: HashMap::new(),
                shares: HashMap::new(),
                next_worker: 0,
                free_slots: Vec::new(),
                next_slot: 0,
            }),
            default_cap: config.max_blocks_per_holder.get(),
            counters: Default::default(),
        }
    }

    fn count(&self, counter: usize, n: u64) {
        if n > 0 {
            self.counters[counter].fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The head table. Readers only (inside a read guard).
    #[inline]
    fn heads(&self) -> &Table {
        // SAFETY: always a live table: a replaced one is freed only after a
        // grace period, and callers are the writer or inside a read guard.
        unsafe { &*self.heads.load(Ordering::Acquire) }
    }

    /// The chain directory. Readers only (inside a read guard).
    #[inline]
    fn dir(&self) -> &Dir {
        // SAFETY: as in `heads`.
        unsafe { &*self.dir.load(Ordering::Acquire) }
    }

    /// The published state of chain `id`. Readers only (inside a guard).
    #[inline]
    fn state(&self, id: u32) -> Option<&ChainState> {
        let ptr = self.dir().slots.get(id as usize)?.load(Ordering::Acquire);
        // SAFETY: a published state is freed only after it was replaced and
        // a grace period passed; the caller is inside a read guard.
        (!ptr.is_null()).then(|| unsafe { &*ptr })
    }

    /// The current state of chain `id`, as the writer knows it.
    #[inline]
    fn current(w: &Writer, id: u32) -> Option<&ChainState> {
        let ptr = *w.states.get(id as usize)?;
        // SAFETY: the writer's current states are alive while it holds the
        // writer lock (they are retired only by the writer).
        (!ptr.is_null()).then(|| unsafe { &*ptr })
    }

    /// The writer's pointer to chain `id`'s current state (null: no such
    /// chain). Dereferencing it is the caller's business.
    #[inline]
    fn state_ptr(w: &Writer, id: u32) -> *mut ChainState {
        w.states
            .get(id as usize)
            .copied()
            .unwrap_or(std::ptr::null_mut())
    }

    /// The current chain directory, as the writer knows it.
    #[inline]
    fn wdir(w: &Writer) -> &Dir {
        // SAFETY: retired only by the writer.
        unsafe { &*w.dir }
    }

    /// The current head table, as the writer knows it.
    #[inline]
    fn wheads(w: &Writer) -> &Table {
        // SAFETY: retired only by the writer.
        unsafe { &*w.heads }
    }

    /// The length of chain `id` and its hash at `off` (if `off < len`), as
    /// the writer sees it (its open edit first).
    fn peek(&self, w: &Writer, id: u32, off: u32) -> (u32, Option<u64>) {
        if let Some(edit) = w.edit.as_ref().filter(|e| e.id == id) {
            return (edit.len, (off < edit.len).then(|| edit.hash(off)));
        }
        let len = w.meta.get(id as usize).map_or(0, |m| m.len);
        match Self::current(w, id) {
            // SAFETY: the writer reads a current state.
            Some(s) => (
                len,
                (off < len).then(|| unsafe { s.buf() }.get(off as usize)),
            ),
            None => (0, None),
        }
    }

    /// Opens chain `id` for editing, publishing the chain edited before.
    fn open(&self, w: &mut Writer, id: u32) {
        if w.edit.as_ref().is_some_and(|e| e.id == id) {
            return;
        }
        self.publish(w);
        let spare = std::mem::take(&mut w.spare);
        let state =
            Self::current(w, id).expect("a block a stream holds lives in a published chain");
        let meta = &w.meta[id as usize];
        // SAFETY: the chain's current state, opened by the writer.
        w.edit = Some(unsafe { Edit::open(id, state, spare, meta.len, &meta.starts) });
        if !w.touched.contains(&id) {
            w.touched.push(id);
        }
    }

    /// Publishes the open edit, if any, and retires the state it replaces.
    fn publish(&self, w: &mut Writer) {
        let Some(mut edit) = w.edit.take() else {
            return;
        };
        let id = edit.id as usize;
        let meta = &mut w.meta[id];
        meta.len = edit.len;
        let state = Box::into_raw(Box::new(edit.finish(
            &w.empty,
            &mut w.scratch,
            &mut meta.starts,
        )));
        w.spare = edit.segs;
        Self::wdir(w).slots[id].store(state, Ordering::Release);
        let old = std::mem::replace(&mut w.states[id], state);
        if !old.is_null() {
            w.garbage.0.push(GarbageItem::State(old));
        }
    }

    /// Starts a new chain whose first block is `head`, nobody holding it.
    fn new_chain(&self, w: &mut Writer, head: u64, more: usize) -> Loc {
        self.publish(w);
        let id = w.free_chains.pop().unwrap_or_else(|| {
            w.next_chain += 1;
            w.next_chain - 1
        });
        if w.meta.len() <= id as usize {
            w.meta.resize_with(id as usize + 1, ChainMeta::default);
            w.states.resize(id as usize + 1, std::ptr::null_mut());
        }
        if id as usize >= Self::wdir(w).slots.len() {
            self.grow_dir(w, id as usize + 1);
        }
        let meta = &mut w.meta[id as usize];
        meta.pairs = 0;
        meta.len = 0;
        meta.starts.clear();
        let mut segs = std::mem::take(&mut w.spare);
        segs.clear();
        let mut edit = Edit {
            id,
            len: 0,
            buf: Box::into_raw(Box::new(HashBuf::with_capacity(
                (more + 1).max(chain::MIN_BUF),
            ))),
            segs,
        };
        edit.append(head, more, &w.empty);
        w.edit = Some(edit);
        w.touched.push(id);
        self.heads_insert(w, head, id);
        Loc { chain: id, off: 0 }
    }

    fn grow_dir(&self, w: &mut Writer, need: usize) {
        let new = Dir::with_capacity(need.max(Self::wdir(w).slots.len() * 2));
        for (to, &from) in new.slots.iter().zip(&w.states) {
            to.store(from, Ordering::Relaxed);
        }
        let new = Box::into_raw(Box::new(new));
        self.dir.store(new, Ordering::Release);
        let old = std::mem::replace(&mut w.dir, new);
        w.garbage.0.push(GarbageItem::Dir(old));
        w.urgent = true;
    }

    fn heads_insert(&self, w: &mut Writer, key: u64, id: u32) {
        let word = u64::from(id) + 1;
        set_head_bit(&mut w.head_bits, key);
        let (mut index, found) = w.heads_shadow.find(key);
        if found {
            // A tombstone of a freed chain with the same head.
            Self::wheads(w).slots[index]
                .word
                .store(word, Ordering::Release);
            w.heads_shadow.words[index] = word;
            w.heads_live += 1;
            return;
        }
        if !Self::wheads(w).fits(w.heads_used + 1) {
            self.grow_heads(w);
            index = w.heads_shadow.find(key).0;
        }
        Self::wheads(w).publish_new(index, key, word);
        w.heads_shadow.keys[index] = key;
        w.heads_shadow.words[index] = word;
        w.heads_used += 1;
        w.heads_live += 1;
    }

    fn heads_remove(&self, w: &mut Writer, key: u64) {
        let (index, found) = w.heads_shadow.find(key);
        if found && w.heads_shadow.words[index] != 0 {
            Self::wheads(w).slots[index]
                .word
                .store(0, Ordering::Release);
            w.heads_shadow.words[index] = 0;
            w.heads_live -= 1;
        }
    }

    /// Rebuilds the head table without tombstones, at least twice the live
    /// size, and retires the old one.
    fn grow_heads(&self, w: &mut Writer) {
        let new = Table::with_capacity((((w.heads_live + 1) * 8).div_ceil(5)).max(INITIAL_HEADS));
        let mut shadow = Shadow::new(new.capacity());
        let mut bits = vec![0; head_bits_words(new.capacity())];
        for (&key, &word) in w.heads_shadow.keys.iter().zip(&w.heads_shadow.words) {
            if word != 0 {
                set_head_bit(&mut bits, key);
                let (i, _) = shadow.find(key);
                new.publish_new(i, key, word);
                shadow.keys[i] = key;
                shadow.words[i] = word;
            }
        }
        let new = Box::into_raw(Box::new(new));
        self.heads.store(new, Ordering::Release);
        let old = std::mem::replace(&mut w.heads, new);
        w.heads_shadow = shadow;
        w.head_bits = bits;
        w.heads_used = w.heads_live;
        w.garbage.0.push(GarbageItem::Table(old));
        w.urgent = true;
    }

    /// The chain whose first block is `hash`.
    fn head_chain(&self, w: &Writer, hash: u64) -> Option<u32> {
        if !head_bit(&w.head_bits, hash) {
            return None;
        }
        let id = w.heads_shadow.get(hash).checked_sub(1)? as u32;
        (self.peek(w, id, 0).1 == Some(hash)).then_some(id)
    }

    /// Where block `hash`, the child of the block at `prev` (`None`: of the
    /// root), lives; a block no chain has yet is appended to its parent's
    /// chain when the parent is that chain's last block, and starts a new
    /// chain otherwise.
    ///
    /// Every block is either the next block of its parent's chain or the
    /// first block of a chain (in the head table), so these two places are
    /// the only ones to look: no table of every block is needed.
    ///
    /// `more`: blocks of the event after this one (a new or growing hash
    /// buffer makes room for them). `holder`: the stream's slot, and
    /// whether the event's engine hash for this block is new to the stream;
    /// if so, a new block that can be appended to its parent's chain in
    /// place (see [`Inner::append_in_place`]) is, already held by that
    /// slot, and the second value says so.
    fn locate(
        &self,
        w: &mut Writer,
        prev: Option<Loc>,
        hash: u64,
        holder: (u32, &dyn Fn() -> bool),
        more: usize,
    ) -> (Loc, bool) {
        let mut parent_is_last = false;
        if let Some(p) = prev {
            let (len, next) = self.peek(w, p.chain, p.off + 1);
            if next == Some(hash) {
                let loc = Loc {
                    chain: p.chain,
                    off: p.off + 1,
                };
                return (loc, false);
            }
            parent_is_last = p.off + 1 == len;
        }
        if let Some(id) = self.head_chain(w, hash) {
            return (Loc { chain: id, off: 0 }, false);
        }
        match prev {
            Some(p) if parent_is_last => {
                let (slot, fresh) = holder;
                if fresh()
                    && let Some(loc) = self.append_in_place(w, p.chain, hash, slot)
                {
                    return (loc, true);
                }
                self.open(w, p.chain);
                let Writer { edit, empty, .. } = w;
                let edit = edit.as_mut().expect("just opened");
                let (off, retired) = edit.append(hash, more, empty);
                if let Some(buf) = retired {
                    w.garbage.0.push(GarbageItem::Buf(buf));
                }
                let loc = Loc {
                    chain: p.chain,
                    off,
                };
                (loc, false)
            }
            _ => (self.new_chain(w, hash, more), false),
        }
    }

    /// Appends a block held by `slot` alone to chain `id` without a new
    /// state, when the chain's last segment is held by `slot` alone, its
    /// buffer has room and no edit of it is open: the hash goes past the
    /// published length, then the length grows (release). A decode step.
    fn append_in_place(&self, w: &mut Writer, id: u32, hash: u64, slot: u32) -> Option<Loc> {
        if w.edit.as_ref().is_some_and(|e| e.id == id) {
            return None;
        }
        let ptr = *w.states.get(id as usize)?;
        if ptr.is_null() {
            return None;
        }
        // SAFETY: the writer's current state of a chain stays alive while
        // the writer holds the lock (only the writer retires it).
        let state = unsafe { &*ptr };
        let meta = &mut w.meta[id as usize];
        // SAFETY: as above, and the buffer lives as long as the state.
        let buf = unsafe { state.buf() };
        let last = state.segs.last()?;
        if *last.holders != [slot] || meta.len as usize >= buf.hashes.len() {
            return None;
        }
        let off = meta.len;
        buf.hashes[off as usize].store(hash, Ordering::Relaxed);
        state.len.store(off + 1, Ordering::Release);
        meta.len += 1;
        meta.pairs += 1;
        w.pairs += 1;
        w.blocks += 1;
        Some(Loc { chain: id, off })
    }

    /// Adds `slot` to blocks `a..b` of chain `id` without a new state, when
    /// they start a segment whose predecessor's holders are this segment's
    /// plus `slot` (a stream extending the run it holds) and the segment
    /// goes on past `b`: the segment's start moves to `b`. Returns whether
    /// it did.
    fn extend_in_place(&self, w: &mut Writer, id: u32, a: u32, b: u32, slot: u32) -> bool {
        if w.edit.as_ref().is_some_and(|e| e.id == id) {
            return false;
        }
        let ptr = Self::state_ptr(w, id);
        if ptr.is_null() {
            return false;
        }
        // SAFETY: as in `append_in_place`.
        let state = unsafe { &*ptr };
        let meta = &mut w.meta[id as usize];
        let i = meta.starts.partition_point(|&start| start <= a);
        if i < 2 || meta.starts[i - 1] != a {
            return false;
        }
        let i = i - 1;
        let end = meta.starts.get(i + 1).copied().unwrap_or(meta.len);
        let (before, seg) = (&state.segs[i - 1], &state.segs[i]);
        // `gone` is exactly {slot} and the sets differ in size by one: the
        // segment before holds this one's holders plus `slot`.
        if b >= end
            || *seg.gone != [slot]
            || before.holders.len() != seg.holders.len() + 1
            || seg.holders.binary_search(&slot).is_ok()
        {
            return false;
        }
        seg.start.store(b, Ordering::Release);
        meta.starts[i] = b;
        let n = u64::from(b - a);
        meta.pairs += n;
        w.pairs += n as usize;
        if seg.holders.is_empty() {
            w.blocks += n as usize;
        }
        true
    }

    /// Queues `loc` to be held by the stream (ranges of consecutive blocks
    /// are changed at once).
    fn add_later(&self, w: &mut Writer, stream: &mut Stream, loc: Loc, outcome: &mut ApplyOutcome) {
        if let Some((chain, _, end)) = &mut w.pending
            && *chain == loc.chain
            && *end == loc.off
        {
            *end += 1;
            return;
        }
        self.add_pending(w, stream, outcome);
        w.pending = Some((loc.chain, loc.off, loc.off + 1));
    }

    /// Adds the stream to the queued range's holders; blocks it already
    /// held get one more engine-hash reference instead.
    fn add_pending(&self, w: &mut Writer, stream: &mut Stream, outcome: &mut ApplyOutcome) {
        let Some((chain, a, b)) = w.pending.take() else {
            return;
        };
        if self.extend_in_place(w, chain, a, b, stream.slot) {
            outcome.stored += u64::from(b - a);
            return;
        }
        self.open(w, chain);
        let Writer { edit, empty, .. } = w;
        let edit = edit.as_mut().expect("just opened");
        let extra = &mut stream.extra;
        let delta = edit.change(a, b, stream.slot, true, empty, |x, y| {
            for off in x..y {
                *extra.entry(Loc { chain, off }.pack()).or_insert(0) += 1;
            }
        });
        outcome.stored += delta.pairs;
        w.pairs += delta.pairs as usize;
        w.blocks += delta.blocks as usize;
        w.meta[chain as usize].pairs += delta.pairs;
    }

    /// Removes `slot` from the holders of `locs` (sorted and deduplicated
    /// here); returns the pairs removed.
    fn remove_locs(&self, w: &mut Writer, slot: u32, locs: &mut Vec<Loc>) -> u64 {
        locs.sort_unstable();
        locs.dedup();
        let mut removed = 0;
        let mut i = 0;
        while i < locs.len() {
            let first = locs[i];
            let mut end = first.off + 1;
            i += 1;
            while i < locs.len() && locs[i].chain == first.chain && locs[i].off == end {
                end += 1;
                i += 1;
            }
            self.open(w, first.chain);
            let Writer { edit, empty, .. } = w;
            let edit = edit.as_mut().expect("just opened");
            let delta = edit.change(first.off, end, slot, false, empty, |_, _| {});
            removed += delta.pairs;
            w.pairs -= delta.pairs as usize;
            w.blocks -= delta.blocks as usize;
            w.meta[first.chain as usize].pairs -= delta.pairs;
        }
        locs.clear();
        removed
    }

    /// Ends an event: publishes the open edit, then frees chains nobody
    /// holds any more and cuts back chains whose unheld tail is at least
    /// half of them (so cutting, which copies the kept hashes, costs O(1)
    /// per removed block over time).
    fn end_event(&self, w: &mut Writer) {
        self.publish(w);
        let mut touched = std::mem::take(&mut w.touched);
        for &id in &touched {
            let ptr = Self::state_ptr(w, id);
            if ptr.is_null() {
                continue;
            }
            // SAFETY: the writer's current state of a chain; it is retired
            // only below, and freed only after a grace period.
            let state = unsafe { &*ptr };
            if w.meta[id as usize].pairs == 0 {
                Self::wdir(w).slots[id as usize].store(std::ptr::null_mut(), Ordering::Release);
                let old = std::mem::replace(&mut w.states[id as usize], std::ptr::null_mut());
                // SAFETY: the writer reads the state it just unlinked; it is
                // freed only after a grace period.
                let head = unsafe { state.buf() }.get(0);
                w.garbage.0.push(GarbageItem::State(old));
                w.garbage.0.push(GarbageItem::Buf(state.buf.cast_mut()));
                self.heads_remove(w, head);
                w.free_chains.push(id);
                continue;
            }
            let meta = &w.meta[id as usize];
            let held_end = state
                .segs
                .iter()
                .rposition(|s| !s.holders.is_empty())
                .map_or(0, |i| meta.starts.get(i + 1).copied().unwrap_or(meta.len));
            if held_end * 2 <= meta.len {
                self.open(w, id);
                let edit = w.edit.as_mut().expect("just opened");
                let old = edit.cut(held_end);
                w.garbage.0.push(GarbageItem::Buf(old));
                self.publish(w);
            }
        }
        touched.clear();
        w.touched = touched;
    }

    /// Takes the garbage out when it is worth a grace period.
    fn take_garbage(w: &mut Writer) -> Option<Garbage> {
        if w.urgent || w.garbage.0.len() >= GARBAGE_BATCH {
            w.urgent = false;
            Some(std::mem::replace(&mut w.garbage, Garbage(Vec::new())))
        } else {
            None
        }
    }

    /// Waits for a grace period and frees the garbage (outside the writer
    /// lock, so other writers go on).
    fn reclaim(&self, garbage: Option<Garbage>) {
        if let Some(mut garbage) = garbage {
            self.rcu.synchronize();
            garbage.free();
        }
    }

    /// Our hash of the block at `loc` (held by the calling stream, so its
    /// chain is alive).
    fn hash_at(&self, loc: Loc) -> Option<BlockHash> {
        let _guard = self.rcu.read();
        let state = self.state(loc.chain)?;
        // SAFETY: loaded under the read guard.
        let buf = unsafe { state.buf() };
        (loc.off < state.len()).then(|| BlockHash(buf.get(loc.off as usize)))
    }

    fn apply(&self, stream: &mut Stream, event: &KvEvent) -> Result<ApplyOutcome, KvIndexError> {
        if stream.dead {
            return Err(KvIndexError::UnknownWorker(stream.holder.worker));
        }
        self.count(C_EVENTS, 1);
        let mut outcome = ApplyOutcome::default();
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
            } => {
                let n = block_hashes.len();
                let hasher = self.hasher.with_lora(*lora_id);
                if *block_size != hasher.block_size()
                    || token_ids.len() != n.saturating_mul(*block_size)
                {
                    outcome.malformed = n as u64;
                } else {
                    let parent = match parent_block_hash {
                        None => Some((hasher.root(), None)),
                        Some(engine) => stream.map.get(&engine.0).and_then(|&p| {
                            let loc = Loc::unpack(p);
                            // A held block never moves nor changes its hash,
                            // so the remembered one is still right.
                            match stream.last {
                                Some((place, hash)) if place == p => Some((hash, Some(loc))),
                                _ => self.hash_at(loc).map(|h| (h, Some(loc))),
                            }
                        }),
                    };
                    match parent {
                        None => outcome.unknown_parent = n as u64,
                        Some((parent, parent_loc)) => {
                            let mut ours = std::mem::take(&mut stream.scratch);
                            ours.clear();
                            hasher.chain_into(parent, token_ids, &mut ours);
                            let mut prev = parent_loc;
                            let garbage = {
                                let mut w = self.writer.lock();
                                let w = &mut *w;
                                for (i, (engine, our)) in block_hashes.iter().zip(&ours).enumerate()
                                {
                                    // A block appended in place is held at
                                    // once, so only for an engine hash the
                                    // stream does not map yet (asked only
                                    // then: most blocks never need it).
                                    let map = &stream.map;
                                    let fresh = || !map.contains_key(&engine.0);
                                    let more = n - 1 - i;
                                    let (loc, held) =
                                        self.locate(w, prev, our.0, (stream.slot, &fresh), more);
                                    prev = Some(loc);
                                    if held {
                                        stream.map_insert(engine.0, loc.pack());
                                        outcome.stored += 1;
                                        continue;
                                    }
                                    if let Some(old) = stream.map_insert(engine.0, loc.pack()) {
                                        if old == loc.pack() {
                                            continue;
                                        }
                                        // The engine hash moves to another
                                        // block: let go of the old one.
                                        self.add_pending(w, stream, &mut outcome);
                                        let old = Loc::unpack(old);
                                        if stream.release(old) {
                                            let mut one = vec![old];
                                            outcome.removed +=
                                                self.remove_locs(w, stream.slot, &mut one);
                                        }
                                    }
                                    self.add_later(w, stream, loc, &mut outcome);
                                }
                                self.add_pending(w, stream, &mut outcome);
                                self.evict_over_cap(w, stream, &mut outcome);
                                self.end_event(w);
                                Self::take_garbage(w)
                            };
                            stream.last = prev.zip(ours.last()).map(|(loc, &h)| (loc.pack(), h));
                            stream.scratch = ours;
                            self.reclaim(garbage);
                        }
                    }
                }
            }
            KvEvent::BlockRemoved { block_hashes } => {
                let mut locs = std::mem::take(&mut stream.locs);
                for engine in block_hashes {
                    match stream.map_remove(engine.0) {
                        Some(p) => {
                            let loc = Loc::unpack(p);
                            if stream.release(loc) {
                                locs.push(loc);
                            }
                        }
                        None => outcome.unknown_removed += 1,
                    }
                }
                stream.tidy();
                let garbage = {
                    let mut w = self.writer.lock();
                    let w = &mut *w;
                    outcome.removed = self.remove_locs(w, stream.slot, &mut locs);
                    self.end_event(w);
                    Self::take_garbage(w)
                };
                stream.locs = locs;
                self.reclaim(garbage);
            }
            KvEvent::AllBlocksCleared => {
                self.count(C_CLEARS, 1);
                outcome.removed = self.clear_stream(stream);
            }
        }
        self.count(C_STORED, outcome.stored);
        self.count(C_REMOVED, outcome.removed);
        self.count(C_UNKNOWN_PARENT, outcome.unknown_parent);
        self.count(C_UNKNOWN_REMOVED, outcome.unknown_removed);
        self.count(C_MALFORMED, outcome.malformed);
        Ok(outcome)
    }

    /// Drops the stream's oldest blocks while it holds more than its
    /// worker's cap, through the path a `BlockRemoved` of them takes (so a
    /// dropped parent whose children stay held reads as vLLM evicting that
    /// block: prefixes stop before it). Under the writer lock, at the end
    /// of a stored event.
    fn evict_over_cap(&self, w: &mut Writer, stream: &mut Stream, outcome: &mut ApplyOutcome) {
        let cap = stream.share.cap.load(std::sync::atomic::Ordering::Relaxed);
        if stream.map.len() <= cap {
            return;
        }
        let mut locs = std::mem::take(&mut stream.locs);
        let evicted = stream.evict(cap, &mut locs);
        outcome.evicted += evicted;
        outcome.removed += self.remove_locs(w, stream.slot, &mut locs);
        stream.locs = locs;
        self.count(C_EVICTED, evicted);
    }

    /// Drops a stream's oldest blocks down to its worker's cap (after the
    /// cap was lowered); returns the engine blocks dropped.
    fn enforce_cap(&self, stream: &mut Stream) -> u64 {
        let mut outcome = ApplyOutcome::default();
        let garbage = {
            let mut w = self.writer.lock();
            let w = &mut *w;
            self.evict_over_cap(w, stream, &mut outcome);
            self.end_event(w);
            Self::take_garbage(w)
        };
        self.reclaim(garbage);
        self.count(C_REMOVED, outcome.removed);
        outcome.evicted
    }

    /// Drops everything a stream holds; returns the blocks no longer held.
    fn clear_stream(&self, stream: &mut Stream) -> u64 {
        stream.extra.clear();
        stream.clear_order();
        let mut locs = std::mem::take(&mut stream.locs);
        locs.extend(stream.map.drain().map(|(_, p)| Loc::unpack(p)));
        let (removed, garbage) = {
            let mut w = self.writer.lock();
            let w = &mut *w;
            let removed = self.remove_locs(w, stream.slot, &mut locs);
            self.end_event(w);
            (removed, Self::take_garbage(w))
        };
        stream.locs = locs;
        self.reclaim(garbage);
        removed
    }

    fn stream(&self, holder: Holder) -> Result<Arc<Mutex<Stream>>, KvIndexError> {
        let mut reg = self.registry.lock();
        let reg = &mut *reg;
        let streams = reg
            .streams
            .get_mut(&holder.worker)
            .ok_or(KvIndexError::UnknownWorker(holder.worker))?;
        if let Some(stream) = streams.get(&holder.rank) {
            return Ok(Arc::clone(stream));
        }
        let slot = match reg.free_slots.pop() {
            Some(slot) => slot,
            None if reg.next_slot < self.max_holders => {
                reg.next_slot += 1;
                self.slot_high_water
                    .store(reg.next_slot as usize, Ordering::Release);
                reg.next_slot - 1
            }
            None => {
                return Err(KvIndexError::HolderCapacity {
                    max: self.max_holders,
                });
            }
        };
        self.slot_holder[slot as usize].store(
            (u64::from(holder.worker.0) << 32) | u64::from(holder.rank),
            Ordering::Release,
        );
        let share = reg
            .shares
            .get(&holder.worker)
            .map(StdArc::clone)
            .ok_or(KvIndexError::UnknownWorker(holder.worker))?;
        let stream = Arc::new(Mutex::new(Stream {
            holder,
            slot,
            dead: false,
            map: IdMap::default(),
            extra: IdMap::default(),
            order: VecDeque::new(),
            ghosts: IdMap::default(),
            stale: 0,
            evicted: 0,
            share,
            scratch: Vec::new(),
            locs: Vec::new(),
            last: None,
        }));
        streams.insert(holder.rank, Arc::clone(&stream));
        Ok(stream)
    }

    fn streams_of(&self, worker: WorkerId) -> Option<Vec<Arc<Mutex<Stream>>>> {
        let reg = self.registry.lock();
        reg.streams
            .get(&worker)
            .map(|s| s.values().cloned().collect())
    }

    fn unregister(&self, worker: WorkerId) -> bool {
        let Some(streams) = ({
            let mut reg = self.registry.lock();
            reg.shares.remove(&worker);
            reg.streams.remove(&worker)
        }) else {
            return false;
        };
        let mut slots = Vec::new();
        for stream in streams.values() {
            let mut stream = stream.lock();
            stream.dead = true;
            self.clear_stream(&mut stream);
            slots.push(stream.slot);
        }
        // No reader that could still see these slots in a holder set is
        // left after a grace period; only then may a slot name someone else.
        self.rcu.synchronize();
        let mut reg = self.registry.lock();
        for slot in slots {
            self.slot_holder[slot as usize].store(VACANT, Ordering::Release);
            reg.free_slots.push(slot);
        }
        true
    }

    fn holder_of_slot(&self, slot: u32) -> Option<Holder> {
        let packed = self.slot_holder.get(slot as usize)?.load(Ordering::Acquire);
        (packed != VACANT).then_some(Holder {
            worker: WorkerId((packed >> 32) as u32),
            rank: packed as u32,
        })
    }

    fn lookup_into(&self, hashes: &[BlockHash], out: &mut PrefixMatches) {
        out.matches.clear();
        out.request_blocks = hashes.len();
        let s = &mut out.scratch;
        s.drops.clear();
        if hashes.is_empty() {
            return;
        }
        let _guard = self.rcu.read();
        let dir = self.dir();
        let heads = self.heads();
        let mut live = 0usize;
        let mut pos = 0usize;
        'chains: while pos < hashes.len() {
            // The block at `pos` is not the next block of the chain walked
            // so far, so it can only be a chain's first block -- unless it
            // is the first block looked up and the caller passed a part of
            // a request that starts inside a chain: then scan.
            let found = match self.chain_of_head(heads, dir, hashes[pos].0) {
                Some(state) => Some((state, 0)),
                None if pos == 0 => self.scan(dir, hashes[0].0),
                None => None,
            };
            let Some((state, start)) = found else { break };
            // One length per visit: blocks appended meanwhile are seen at
            // the next visit, if any.
            let len = state.len();
            // SAFETY: loaded under the read guard, which keeps published
            // states (and their buffers and sets) alive.
            let buf = unsafe { state.buf() };
            let mut si = state.seg_of(start);
            let first = &state.segs[si].holders;
            if pos == 0 {
                for &slot in first.iter() {
                    bit_set(&mut s.in_alive, slot);
                }
                live = first.len();
            } else {
                // Entering a chain: live holders it lacks leave here. A
                // word at a time, so the cost is the bitset's length plus
                // the chain's first holder set, not the live holders.
                for &slot in first.iter() {
                    bit_set(&mut s.keep, slot);
                }
                for (w, word) in s.in_alive.iter_mut().enumerate() {
                    let keep = s.keep.get(w).copied().unwrap_or(0);
                    let mut gone = *word & !keep;
                    if gone != 0 {
                        *word &= keep;
                        live -= gone.count_ones() as usize;
                        while gone != 0 {
                            let bit = gone.trailing_zeros();
                            s.drops.push(((w as u32) * 64 + bit, pos as u32));
                            gone &= gone - 1;
                        }
                    }
                }
                s.keep.fill(0);
            }
            let mut off = start;
            let mut entered = true;
            loop {
                let seg = &state.segs[si];
                if !entered {
                    if buf.get(off as usize) != hashes[pos].0 {
                        // The request leaves the chain here.
                        continue 'chains;
                    }
                    // Live holders held the previous segment: only those
                    // it lost can leave.
                    for &slot in seg.gone.iter() {
                        if bit_get(&s.in_alive, slot) {
                            bit_clear(&mut s.in_alive, slot);
                            s.drops.push((slot, pos as u32));
                            live -= 1;
                        }
                    }
                }
                entered = false;
                if live == 0 {
                    break 'chains;
                }
                let end = state.seg_end(si, len);
                let room = ((end - off) as usize).min(hashes.len() - pos);
                // `off + room` is at most the state's length.
                let matched = buf.matching(off as usize, &hashes[pos..pos + room]);
                pos += matched;
                off += matched as u32;
                if off < end || pos == hashes.len() {
                    continue 'chains;
                }
                si += 1;
                if si == state.segs.len() {
                    continue 'chains;
                }
            }
        }
        for (w, word) in s.in_alive.iter_mut().enumerate() {
            let mut left = std::mem::take(word);
            while left != 0 {
                let bit = left.trailing_zeros();
                s.drops.push(((w as u32) * 64 + bit, pos as u32));
                left &= left - 1;
            }
        }
        out.matches.reserve(s.drops.len());
        for &(slot, blocks) in s.drops.iter().rev() {
            if let Some(holder) = self.holder_of_slot(slot) {
                out.matches.push(HolderMatch {
                    holder,
                    blocks: blocks as usize,
                });
            }
        }
    }

    /// The chain whose first block is `hash`. Inside a read guard (`heads`
    /// and `dir` loaded under it).
    #[inline]
    fn chain_of_head<'a>(
        &'a self,
        heads: &Table,
        dir: &'a Dir,
        hash: u64,
    ) -> Option<&'a ChainState> {
        let id = heads.get(hash).checked_sub(1)?;
        let ptr = dir.slots.get(id as usize)?.load(Ordering::Acquire);
        if ptr.is_null() {
            return None;
        }
        // SAFETY: loaded under the caller's read guard, which keeps
        // published states (and their buffers and sets) alive.
        let state = unsafe { &*ptr };
        // SAFETY: as above.
        let buf = unsafe { state.buf() };
        // A stale head entry (the chain was freed and its id reused) names
        // a chain with another first block.
        (state.len() > 0 && buf.get(0) == hash).then_some(state)
    }

    /// Finds `hash` anywhere, by scanning every chain (no table maps every
    /// block: only chains' first blocks). Inside a read guard.
    fn scan<'a>(&'a self, dir: &'a Dir, hash: u64) -> Option<(&'a ChainState, u32)> {
        dir.slots.iter().find_map(|slot| {
            let ptr = slot.load(Ordering::Acquire);
            if ptr.is_null() {
                return None;
            }
            // SAFETY: as in `chain_of_head`.
            let state = unsafe { &*ptr };
            // SAFETY: as above.
            let buf = unsafe { state.buf() };
            (0..state.len())
                .find(|&i| buf.get(i as usize) == hash)
                .map(|off| (state, off))
        })
    }

    fn holders_of(&self, hash: BlockHash) -> Vec<Holder> {
        let _guard = self.rcu.read();
        let found = self
            .chain_of_head(self.heads(), self.dir(), hash.0)
            .map(|state| (state, 0))
            .or_else(|| self.scan(self.dir(), hash.0));
        let Some((state, off)) = found else {
            return Vec::new();
        };
        let mut out: Vec<Holder> = state.segs[state.seg_of(off)]
            .holders
            .iter()
            .filter_map(|&slot| self.holder_of_slot(slot))
            .collect();
        out.sort_unstable();
        out
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

impl Drop for Inner {
    fn drop(&mut self) {
        self.writer.lock().garbage.free();
        // Dropping the index: no reader or writer is left; the directory,
        // the head table and every current state and its buffer are owned
        // by the index alone.
        // SAFETY: see above.
        let dir = unsafe { Box::from_raw(self.dir.load(Ordering::Acquire)) };
        for slot in dir.slots.iter() {
            let ptr = slot.load(Ordering::Acquire);
            if !ptr.is_null() {
                // SAFETY: see above.
                let state = unsafe { Box::from_raw(ptr) };
                // SAFETY: see above; no other state names this buffer.
                drop(unsafe { Box::from_raw(state.buf.cast_mut()) });
            }
        }
        // SAFETY: see above.
        drop(unsafe { Box::from_raw(self.heads.load(Ordering::Acquire)) });
    }
}

/// A block index of the KV caches a fleet of engine workers holds, built
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
            reg.shares.insert(
                id,
                StdArc::new(Share {
                    cap: StatUsize::new(self.inner.default_cap),
                    evicted: StatU64::new(0),
                }),
            );
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

/// The write handle of one (worker, rank) event stream; see
/// [`KvIndex::stream`]. One task per stream applies its events in order;
/// handles of different streams apply concurrently.
pub struct StreamWriter {
    inner: Arc<Inner>,
    stream: Arc<Mutex<Stream>>,
}

impl std::fmt::Debug for StreamWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamWriter")
            .field("holder", &self.holder())
            .finish_non_exhaustive()
    }
}

impl StreamWriter {
    /// The stream's holder.
    pub fn holder(&self) -> Holder {
        self.stream.lock().holder
    }

    /// Applies one event. Fails only after the worker was unregistered.
    pub fn apply(&self, event: &KvEvent) -> Result<ApplyOutcome, KvIndexError> {
        let mut stream = self.stream.lock();
        self.inner.apply(&mut stream, event)
    }

    /// Drops everything this stream holds (as `AllBlocksCleared` would).
    pub fn clear(&self) -> Result<u64, KvIndexError> {
        self.apply(&KvEvent::AllBlocksCleared).map(|o| o.removed)
    }
}
