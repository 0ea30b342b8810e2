//! The streams: per (worker, rank), the translation from the engine's block
//! hashes to places in the index and the order its blocks are dropped in
//! over a cap; and the registry that hands out workers, their shared caps
//! and the holder slots lookups name holders by.
//!
//! A stream's state is its own, behind the stream's own lock, so streams
//! of different workers translate their events in parallel; only the
//! changes to chains an event ends in take the writer lock (module
//! `write`). The registry has a lock of its own, taken to find, open and
//! close streams and released before an event is applied.
//!
//! # The eviction order
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

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc as StdArc;
use std::sync::atomic::{AtomicU64 as StatU64, AtomicUsize as StatUsize};

use crate::hash::BlockHash;
use crate::sync::{Arc, Mutex, Ordering};

use super::{Holder, Inner, KvIndexError, Loc, VACANT, WorkerId};

#[cfg(doc)]
use super::{HolderStats, IndexConfig};

/// A hasher for keys that are already uniform 64-bit values.
#[derive(Default)]
pub(super) struct IdHasher(u64);

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

pub(super) type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// What the streams of one worker share: its cap and eviction count.
/// Plain std atomics (also under loom): settings and counters, not part of
/// the memory protocol the loom models check.
#[derive(Debug)]
pub(super) struct Share {
    /// Most engine blocks each of its streams may hold.
    pub(super) cap: StatUsize,
    /// Engine blocks its streams dropped over the cap.
    pub(super) evicted: StatU64,
}

impl Share {
    /// A fresh worker's: cap `cap`, nothing evicted.
    pub(super) fn new(cap: usize) -> Self {
        Self {
            cap: StatUsize::new(cap),
            evicted: StatU64::new(0),
        }
    }
}

/// Stale entries of a stream's eviction order kept before it is compacted:
/// compaction waits until they are more than half the live ones plus this,
/// so its cost is at most three entries per removal that made one stale.
const STALE_SLACK: usize = 64;

/// One (worker, rank) stream's own state, behind its own lock.
pub(super) struct Stream {
    pub(super) holder: Holder,
    pub(super) slot: u32,
    pub(super) dead: bool,
    /// Engine hash -> where our block lives (a packed `Loc`).
    pub(super) map: IdMap<u64>,
    /// Blocks mapped by more than one engine hash: the extra count.
    pub(super) extra: IdMap<u32>,
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
    pub(super) evicted: u64,
    /// The worker's cap and eviction count.
    pub(super) share: StdArc<Share>,
    pub(super) scratch: Vec<BlockHash>,
    pub(super) locs: Vec<Loc>,
    /// The last block this stream stored (packed place, our hash): the
    /// parent of its next event when it decodes, read without a guard.
    pub(super) last: Option<(u64, BlockHash)>,
}

impl Stream {
    pub(super) fn bytes(&self) -> usize {
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
    pub(super) fn map_insert(&mut self, engine: u64, place: u64) -> Option<u64> {
        let old = self.map.insert(engine, place);
        if old.is_none() {
            self.order.push_back(engine);
        }
        old
    }

    /// Unmaps `engine`; its entry in the eviction order goes stale.
    pub(super) fn map_remove(&mut self, engine: u64) -> Option<u64> {
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
    pub(super) fn tidy(&mut self) {
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
    pub(super) fn evict(&mut self, cap: usize, locs: &mut Vec<Loc>) -> u64 {
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
    pub(super) fn clear_order(&mut self) {
        self.order.clear();
        self.ghosts.clear();
        self.stale = 0;
    }

    /// Drops one engine hash's reference to a block: `true` when it was the
    /// last one, so the stream no longer holds the block.
    pub(super) fn release(&mut self, loc: Loc) -> bool {
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

/// Workers, their streams and shares, and the holder slots in use.
pub(super) struct Registry {
    pub(super) streams: HashMap<WorkerId, HashMap<u32, Arc<Mutex<Stream>>>>,
    /// Per registered worker: its cap and eviction count.
    pub(super) shares: HashMap<WorkerId, StdArc<Share>>,
    pub(super) next_worker: u32,
    pub(super) free_slots: Vec<u32>,
    pub(super) next_slot: u32,
}

impl Registry {
    /// No workers, every holder slot free.
    pub(super) fn new() -> Self {
        Self {
            streams: HashMap::new(),
            shares: HashMap::new(),
            next_worker: 0,
            free_slots: Vec::new(),
            next_slot: 0,
        }
    }
}

impl Inner {
    /// The stream of `holder`, opened on first use: it takes a free holder
    /// slot (or a new one, up to [`IndexConfig::max_holders`]).
    pub(super) fn stream(&self, holder: Holder) -> Result<Arc<Mutex<Stream>>, KvIndexError> {
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

    /// The streams `worker` has opened (`None`: not registered).
    pub(super) fn streams_of(&self, worker: WorkerId) -> Option<Vec<Arc<Mutex<Stream>>>> {
        let reg = self.registry.lock();
        reg.streams
            .get(&worker)
            .map(|s| s.values().cloned().collect())
    }

    /// Closes and clears every stream of `worker`, then frees its holder
    /// slots; `false` when it was not registered.
    pub(super) fn unregister(&self, worker: WorkerId) -> bool {
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

    /// The holder a slot names now (`None`: vacant).
    pub(super) fn holder_of_slot(&self, slot: u32) -> Option<Holder> {
        let packed = self.slot_holder.get(slot as usize)?.load(Ordering::Acquire);
        (packed != VACANT).then_some(Holder {
            worker: WorkerId((packed >> 32) as u32),
            rank: packed as u32,
        })
    }
}
