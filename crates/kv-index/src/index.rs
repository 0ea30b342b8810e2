//! The index: block hash -> holders, fed by per-stream KV events, read by
//! the request path without locks.
//!
//! # Layout and why
//!
//! Our block hashes are already uniformly mixed 64-bit values, so the index
//! is a set of open-addressing tables (one per shard, chosen by the hash's
//! top bits) probed with the hash itself: no hashing on lookup, one or two
//! cache lines per block. A slot is 16 bytes (the key and a holder word); a
//! holder word keeps one or two holders inline, the common case, and points
//! to a shared sorted array only for blocks three or more workers hold
//! (module `table`). A (block, worker) pair therefore costs a table
//! slot (16 bytes at 50–75 % load) plus the worker's translation entry
//! (engine hash -> our hash, 16 bytes at up to 87 % load) when the block is
//! private, and 4 bytes plus the translation entry when it is shared.
//!
//! We considered storing runs of consecutive blocks with the same holder
//! set, which saves lookups on long shared prefixes; lookups instead skip
//! unchanged holder sets in constant time (see below), which gives most of
//! that benefit without splitting and merging runs on every event.
//!
//! # Lookup
//!
//! [`KvIndex::lookup`] walks the request's block hashes in order, keeping
//! the set of holders that held every block so far ("alive"). When block
//! `i`'s holder set has the alive set's size and fingerprint (a wrapping sum
//! of a 64-bit mix of each holder), nothing changes and the step costs one
//! probe; otherwise the two sets are intersected in time linear in the
//! smaller one (plus the dropped holders), and dropped holders record `i`
//! as their prefix length. The walk stops at the first block no alive
//! holder holds. Equal size and fingerprint stand for set equality: a false
//! match has a probability of about 2^-64 per step.
//!
//! # Concurrency: what is guaranteed
//!
//! - **Readers never block and never wait for writers.** A lookup announces
//!   itself to a two-counter grace-period scheme (module `rcu`), then does
//!   only atomic loads. Tables and holder arrays are replaced
//!   copy-on-write and freed only after every reader that could see them
//!   has left.
//! - **Writers are serialized** by one short lock per event (the table
//!   update); hashing the event's tokens and the translation of engine
//!   hashes happen under the stream's own lock, so streams of different
//!   workers prepare their events in parallel. A writer may wait for
//!   readers to leave before it frees replaced memory (about once per 64
//!   replaced holder arrays or per grown table).
//! - **Per-block atomicity, not snapshots.** Each block's holder set is
//!   read atomically, and a holder added or removed is visible to lookups
//!   that start after the event was applied. A lookup that runs while an
//!   event is applied may see some of that event's blocks and not others.
//!   For a prefix walk this means a concurrent store is seen as a shorter
//!   prefix, and a concurrent removal as a longer one, never anything that
//!   neither the state before nor the state after contains block by block.
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
//! One index describes one storage medium: a subscriber receiving vLLM's
//! `medium` field feeds GPU events to one index and offloaded tiers to
//! another (or drops them).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::atomic::AtomicU64 as StatU64;

use crate::hash::{BlockHash, BlockHasher, EngineHash};
use crate::rcu::Rcu;
use crate::sync::{Arc, AtomicPtr, AtomicU64, AtomicUsize, Mutex, Ordering};
use crate::table::{self, HeapSet, Holders, Table};

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
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            max_holders: 1 << 16,
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
}

/// Cumulative event counters of an index, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventCounters {
    /// Events applied.
    pub events: u64,
    /// Blocks recorded as held.
    pub stored_blocks: u64,
    /// Blocks no longer held (removed or cleared).
    pub removed_blocks: u64,
    /// Stored blocks skipped: parent unknown to the stream.
    pub unknown_parent_blocks: u64,
    /// Removed engine hashes unknown to the stream.
    pub unknown_removed_blocks: u64,
    /// Stored blocks skipped: block size or token count mismatch.
    pub malformed_blocks: u64,
    /// `AllBlocksCleared` events and [`KvIndex::clear_worker`] calls.
    pub clears: u64,
}

/// Memory and entries of one (worker, rank) stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HolderStats {
    /// The stream.
    pub holder: Holder,
    /// Engine blocks it holds (entries of its translation map).
    pub blocks: usize,
    /// Bytes of its translation map (the shared index is counted once, in
    /// [`IndexStats::index_bytes`]).
    pub bytes: usize,
}

/// Memory accounting of an index: a plain struct for metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct blocks (our hashes) held by at least one stream.
    pub blocks: usize,
    /// (block, holder) pairs.
    pub pairs: usize,
    /// Bytes of the shared index: tables and holder arrays.
    pub index_bytes: usize,
    /// Bytes of all streams' translation maps.
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
    alive: Vec<u32>,
    next: Vec<u32>,
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
    Set(*mut HeapSet),
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
            match item {
                // SAFETY: each pointer came from Box::into_raw, was unlinked
                // from every table, and no reader can still hold it.
                GarbageItem::Table(t) => drop(unsafe { Box::from_raw(t) }),
                // SAFETY: as above.
                GarbageItem::Set(s) => drop(unsafe { Box::from_raw(s) }),
            }
        }
    }
}

/// How many blocks ahead of the walk a lookup prefetches table slots.
const PREFETCH_AHEAD: usize = 24;

/// Replaced holder arrays gathered before a writer waits for a grace period.
const GARBAGE_BATCH: usize = 64;

struct Writer {
    /// Per shard: keys in the table (live and tombstones).
    used: Vec<usize>,
    /// Per shard: keys with at least one holder.
    live: Vec<usize>,
    heap_bytes: usize,
    pairs: usize,
    garbage: Garbage,
    /// Set when a table was retired: free it soon.
    urgent: bool,
}

struct Stream {
    holder: Holder,
    slot: u32,
    dead: bool,
    /// Engine hash -> our hash.
    map: IdMap<u64>,
    /// Our hashes mapped by more than one engine hash: the extra count.
    extra: IdMap<u32>,
    scratch: Vec<BlockHash>,
}

impl Stream {
    fn bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.map.capacity() * (16 + 1)
            + self.extra.capacity() * (12 + 1)
            + self.scratch.capacity() * 8
    }
}

struct Registry {
    streams: HashMap<WorkerId, HashMap<u32, Arc<Mutex<Stream>>>>,
    next_worker: u32,
    free_slots: Vec<u32>,
    next_slot: u32,
}

/// The key-independent part of the index, shared with stream writers.
struct Inner {
    hasher: BlockHasher,
    max_holders: u32,
    shard_shift: u32,
    shards: Box<[AtomicPtr<Table>]>,
    rcu: Rcu,
    writer: Mutex<Writer>,
    /// Holder slot -> packed (worker << 32 | rank); `VACANT` when free.
    slot_holder: Box<[AtomicU64]>,
    slot_high_water: AtomicUsize,
    registry: Mutex<Registry>,
    counters: [StatU64; 7],
}

const VACANT: u64 = u64::MAX;

const C_EVENTS: usize = 0;
const C_STORED: usize = 1;
const C_REMOVED: usize = 2;
const C_UNKNOWN_PARENT: usize = 3;
const C_UNKNOWN_REMOVED: usize = 4;
const C_MALFORMED: usize = 5;
const C_CLEARS: usize = 6;

#[cfg(not(loom))]
const SHARD_BITS: u32 = 6;
#[cfg(loom)]
const SHARD_BITS: u32 = 1;

#[cfg(not(loom))]
const INITIAL_CAPACITY: usize = 64;
#[cfg(loom)]
const INITIAL_CAPACITY: usize = 4;

impl Inner {
    fn new(config: IndexConfig) -> Self {
        let shards = (0..1usize << SHARD_BITS)
            .map(|_| {
                AtomicPtr::new(Box::into_raw(Box::new(Table::with_capacity(
                    INITIAL_CAPACITY,
                ))))
            })
            .collect();
        let max_holders = config.max_holders.clamp(1, 0x7fff_fffe);
        Self {
            hasher: BlockHasher::new(config.block_size),
            max_holders,
            shard_shift: 64 - SHARD_BITS,
            shards,
            rcu: Rcu::new(),
            writer: Mutex::new(Writer {
                used: vec![0; 1 << SHARD_BITS],
                live: vec![0; 1 << SHARD_BITS],
                heap_bytes: 0,
                pairs: 0,
                garbage: Garbage(Vec::new()),
                urgent: false,
            }),
            // Growing on demand would need another grace period; the array
            // costs 8 bytes per possible holder.
            slot_holder: (0..max_holders).map(|_| AtomicU64::new(VACANT)).collect(),
            slot_high_water: AtomicUsize::new(0),
            registry: Mutex::new(Registry {
                streams: HashMap::new(),
                next_worker: 0,
                free_slots: Vec::new(),
                next_slot: 0,
            }),
            counters: Default::default(),
        }
    }

    fn count(&self, counter: usize, n: u64) {
        if n > 0 {
            self.counters[counter].fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[inline]
    fn shard_of(&self, key: u64) -> usize {
        (key >> self.shard_shift) as usize
    }

    /// The table of a shard. Writers hold the writer lock; readers hold a
    /// read guard.
    #[inline]
    fn table(&self, shard: usize) -> &Table {
        // SAFETY: shard pointers always point to a live table: a replaced
        // table is freed only after a grace period, and the callers are
        // either the writer (which does the replacing) or inside a read
        // guard.
        unsafe { &*self.shards[shard].load(Ordering::Acquire) }
    }

    /// Adds `slot` to the holders of `key`; `false` if it already held it.
    fn add(&self, w: &mut Writer, key: u64, slot: u32) -> bool {
        let shard = self.shard_of(key);
        let mut table = self.table(shard);
        let (mut index, found) = table.find(key);
        if found {
            let word = table.slots[index].word.load(Ordering::Relaxed);
            if word == 0 {
                w.live[shard] += 1;
                w.pairs += 1;
                table.slots[index]
                    .word
                    .store(table::inline_word(&[slot]), Ordering::Release);
                return true;
            }
            // SAFETY: the writer decodes words of the current table, whose
            // heap sets it alone frees (after unlinking).
            let holders = unsafe { Holders::decode(word) };
            let current = holders.as_slice();
            let Err(at) = current.binary_search(&slot) else {
                return false;
            };
            let mut next = Vec::with_capacity(current.len() + 1);
            next.extend_from_slice(&current[..at]);
            next.push(slot);
            next.extend_from_slice(&current[at..]);
            self.replace_word(w, table, index, word, &next);
            w.pairs += 1;
            return true;
        }
        if !table.fits(w.used[shard] + 1) {
            self.grow(w, shard);
            table = self.table(shard);
            index = table.find(key).0;
        }
        table.publish_new(index, key, table::inline_word(&[slot]));
        w.used[shard] += 1;
        w.live[shard] += 1;
        w.pairs += 1;
        true
    }

    /// Removes `slot` from the holders of `key`; `false` if it did not hold it.
    fn remove(&self, w: &mut Writer, key: u64, slot: u32) -> bool {
        let shard = self.shard_of(key);
        let table = self.table(shard);
        let (index, found) = table.find(key);
        if !found {
            return false;
        }
        let word = table.slots[index].word.load(Ordering::Relaxed);
        if word == 0 {
            return false;
        }
        // SAFETY: as in `add`.
        let holders = unsafe { Holders::decode(word) };
        let current = holders.as_slice();
        let Ok(at) = current.binary_search(&slot) else {
            return false;
        };
        let mut next = Vec::with_capacity(current.len());
        next.extend_from_slice(&current[..at]);
        next.extend_from_slice(&current[at + 1..]);
        if next.is_empty() {
            w.live[shard] -= 1;
        }
        self.replace_word(w, table, index, word, &next);
        w.pairs -= 1;
        true
    }

    fn replace_word(&self, w: &mut Writer, table: &Table, index: usize, old: u64, slots: &[u32]) {
        let word = table::encode(slots);
        if table::is_heap(word) {
            // SAFETY: just built by `encode`, not yet shared.
            w.heap_bytes += unsafe { &*(word as *const HeapSet) }.bytes();
        }
        table.slots[index].word.store(word, Ordering::Release);
        if table::is_heap(old) {
            let set = old as *mut HeapSet;
            // SAFETY: the old set is still alive (freed only after a grace
            // period that starts after this unlink).
            w.heap_bytes -= unsafe { &*set }.bytes();
            w.garbage.0.push(GarbageItem::Set(set));
        }
    }

    /// Rebuilds a shard's table without tombstones, at twice the live size
    /// or more, and retires the old one.
    fn grow(&self, w: &mut Writer, shard: usize) {
        let old = self.table(shard);
        let live = w.live[shard];
        // At most 5/8 full after the rebuild, so the next one is a while
        // off; the power of two leaves it between 5/16 and 5/8 full.
        let new = Table::with_capacity((((live + 1) * 8).div_ceil(5)).max(INITIAL_CAPACITY));
        for slot in old.slots.iter() {
            let word = slot.word.load(Ordering::Relaxed);
            if word != 0 {
                let key = slot.key.load(Ordering::Relaxed);
                let (i, _) = new.find(key);
                new.publish_new(i, key, word);
            }
        }
        let new = Box::into_raw(Box::new(new));
        let old = self.shards[shard].swap(new, Ordering::AcqRel);
        w.used[shard] = live;
        w.garbage.0.push(GarbageItem::Table(old));
        w.urgent = true;
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

    /// Drops one engine hash's reference to our block.
    fn release(&self, w: &mut Writer, stream: &mut Stream, ours: u64) -> bool {
        if let Some(extra) = stream.extra.get_mut(&ours) {
            *extra -= 1;
            if *extra == 0 {
                stream.extra.remove(&ours);
            }
            return false;
        }
        self.remove(w, ours, stream.slot)
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
                        None => Some(hasher.root()),
                        Some(engine) => stream.map.get(&engine.0).map(|&h| BlockHash(h)),
                    };
                    match parent {
                        None => outcome.unknown_parent = n as u64,
                        Some(parent) => {
                            let mut ours = std::mem::take(&mut stream.scratch);
                            ours.clear();
                            hasher.chain_into(parent, token_ids, &mut ours);
                            for our in &ours {
                                self.table(self.shard_of(our.0)).prefetch(our.0);
                            }
                            let garbage = {
                                let mut w = self.writer.lock();
                                for (engine, our) in block_hashes.iter().zip(&ours) {
                                    if let Some(old) = stream.map.insert(engine.0, our.0) {
                                        if old == our.0 {
                                            continue;
                                        }
                                        if self.release(&mut w, stream, old) {
                                            outcome.removed += 1;
                                        }
                                    }
                                    if self.add(&mut w, our.0, stream.slot) {
                                        outcome.stored += 1;
                                    } else {
                                        *stream.extra.entry(our.0).or_insert(0) += 1;
                                    }
                                }
                                Self::take_garbage(&mut w)
                            };
                            stream.scratch = ours;
                            self.reclaim(garbage);
                        }
                    }
                }
            }
            KvEvent::BlockRemoved { block_hashes } => {
                let garbage = {
                    let mut w = self.writer.lock();
                    for engine in block_hashes {
                        match stream.map.remove(&engine.0) {
                            Some(ours) => {
                                if self.release(&mut w, stream, ours) {
                                    outcome.removed += 1;
                                }
                            }
                            None => outcome.unknown_removed += 1,
                        }
                    }
                    Self::take_garbage(&mut w)
                };
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

    /// Drops everything a stream holds; returns the blocks no longer held.
    fn clear_stream(&self, stream: &mut Stream) -> u64 {
        let mut removed = 0;
        let garbage = {
            let mut w = self.writer.lock();
            stream.extra.clear();
            for (_, ours) in stream.map.drain() {
                if self.remove(&mut w, ours, stream.slot) {
                    removed += 1;
                }
            }
            Self::take_garbage(&mut w)
        };
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
        let stream = Arc::new(Mutex::new(Stream {
            holder,
            slot,
            dead: false,
            map: IdMap::default(),
            extra: IdMap::default(),
            scratch: Vec::new(),
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
        let Some(streams) = self.registry.lock().streams.remove(&worker) else {
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
        s.alive.clear();
        s.drops.clear();
        let Some(first) = hashes.first() else {
            return;
        };
        let _guard = self.rcu.read();
        let word = self.table(self.shard_of(first.0)).get(first.0);
        if word == 0 {
            return;
        }
        // SAFETY: loaded under the read guard, which keeps heap sets alive.
        let holders = unsafe { Holders::decode(word) };
        s.alive.extend_from_slice(holders.as_slice());
        let mut alive_fp = holders.fingerprint();
        for &slot in &s.alive {
            bit_set(&mut s.in_alive, slot);
        }
        for hash in hashes.iter().take(PREFETCH_AHEAD).skip(1) {
            self.table(self.shard_of(hash.0)).prefetch(hash.0);
        }
        let mut end = hashes.len();
        for (i, hash) in hashes.iter().enumerate().skip(1) {
            if let Some(ahead) = hashes.get(i + PREFETCH_AHEAD) {
                self.table(self.shard_of(ahead.0)).prefetch(ahead.0);
            }
            let word = self.table(self.shard_of(hash.0)).get(hash.0);
            if word == 0 {
                end = i;
                break;
            }
            // SAFETY: as above.
            let holders = unsafe { Holders::decode(word) };
            let slots = holders.as_slice();
            if slots.len() == s.alive.len() && holders.fingerprint() == alive_fp {
                continue;
            }
            s.next.clear();
            if slots.len() < s.alive.len() {
                for &slot in slots {
                    if bit_get(&s.in_alive, slot) {
                        s.next.push(slot);
                        bit_set(&mut s.keep, slot);
                    }
                }
                for &slot in &s.alive {
                    if !bit_get(&s.keep, slot) {
                        s.drops.push((slot, i as u32));
                        bit_clear(&mut s.in_alive, slot);
                    }
                }
                for &slot in &s.next {
                    bit_clear(&mut s.keep, slot);
                }
            } else {
                for &slot in &s.alive {
                    if holders.contains(slot) {
                        s.next.push(slot);
                    } else {
                        s.drops.push((slot, i as u32));
                        bit_clear(&mut s.in_alive, slot);
                    }
                }
            }
            std::mem::swap(&mut s.alive, &mut s.next);
            if s.alive.is_empty() {
                end = i;
                break;
            }
            alive_fp = s
                .alive
                .iter()
                .fold(0u64, |acc, &slot| acc.wrapping_add(table::slot_term(slot)));
        }
        for &slot in &s.alive {
            s.drops.push((slot, end as u32));
            bit_clear(&mut s.in_alive, slot);
        }
        s.alive.clear();
        for &(slot, blocks) in s.drops.iter().rev() {
            if let Some(holder) = self.holder_of_slot(slot) {
                out.matches.push(HolderMatch {
                    holder,
                    blocks: blocks as usize,
                });
            }
        }
    }

    fn holders_of(&self, hash: BlockHash) -> Vec<Holder> {
        let _guard = self.rcu.read();
        let word = self.table(self.shard_of(hash.0)).get(hash.0);
        if word == 0 {
            return Vec::new();
        }
        // SAFETY: loaded under the read guard.
        let holders = unsafe { Holders::decode(word) };
        let mut out: Vec<Holder> = holders
            .as_slice()
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
                }
            })
            .collect();
        holders.sort_unstable_by_key(|h| h.holder);
        let w = self.writer.lock();
        let tables: usize = (0..self.shards.len())
            .map(|s| self.table(s).capacity() * std::mem::size_of::<table::Slot>())
            .sum();
        IndexStats {
            blocks: w.live.iter().sum(),
            pairs: w.pairs,
            index_bytes: tables + w.heap_bytes + self.slot_holder.len() * 8,
            translation_bytes: holders.iter().map(|h| h.bytes).sum(),
            holders,
            counters: self.counters(),
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.writer.lock().garbage.free();
        for shard in self.shards.iter() {
            let table = shard.load(Ordering::Acquire);
            // SAFETY: dropping the index: no reader or writer is left, and
            // every heap set is owned by exactly one current-table word.
            let table = unsafe { Box::from_raw(table) };
            for slot in table.slots.iter() {
                let word = slot.word.load(Ordering::Relaxed);
                if table::is_heap(word) {
                    // SAFETY: as above.
                    drop(unsafe { Box::from_raw(word as *mut HeapSet) });
                }
            }
        }
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
    /// hashes in order ([`KvIndex::block_hashes`]). Never blocks.
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

    /// The holders of one block, sorted.
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
