//! The writer: its own copy of the shared structures, and every change
//! made to them.
//!
//! Everything here runs under the writer lock (`Inner::writer`), which
//! serializes the changes of events to chains. The writer reads only its
//! own copies (the [`Writer`] fields, the current states it published) and
//! stores to the shared structures readers load: a chain's new state by
//! one pointer store, a new head by the table's publish order, a grown
//! table or directory by a pointer swap, and the two in-place changes
//! (a longer length, a segment start moved forward) by one release store
//! each. What it unlinks goes to the garbage (module `reclaim`).
//!
//! It is apart from the event handling (module `apply`) because that part
//! is stream-local work — hashing, translating engine hashes, caps —
//! which only ends in the calls here: where a block lives, which ranges
//! gain or lose a holder, and the end of an event.

use crate::chain::{self, ChainState, Edit, HashBuf, Set};
use crate::sync::Ordering;
use crate::table::{Shadow, Table};

use super::bits::{head_bit, head_bits_words, set_head_bit};
use super::reclaim::{Garbage, GarbageItem};
use super::stream::Stream;
use super::{ApplyOutcome, Dir, Inner, Loc};

/// The first head table's and chain directory's sizes: tiny under loom,
/// so models of a few chains already grow (and retire) them.
#[cfg(not(loom))]
const INITIAL_HEADS: usize = 64;
#[cfg(loom)]
const INITIAL_HEADS: usize = 4;

#[cfg(not(loom))]
const INITIAL_CHAINS: usize = 64;
#[cfg(loom)]
const INITIAL_CHAINS: usize = 1;

/// The writer's own view of the shared structures: it reads these and only
/// stores to the shared ones (see [`Shadow`]).
pub(super) struct Writer {
    /// The current head table and its plain copy.
    pub(super) heads: *mut Table,
    heads_shadow: Shadow,
    /// A bit per possible head (one bit per key of the table, by other bits
    /// of the hash than the table's): a clear bit means "no chain starts
    /// with this block" without a probe. Stale bits of freed chains are
    /// dropped when the table is rebuilt.
    pub(super) head_bits: Vec<u64>,
    /// The current chain directory and, per chain id, its current state
    /// (null: none).
    pub(super) dir: *mut Dir,
    pub(super) states: Vec<*mut ChainState>,
    /// Keys in the head table (live and tombstones).
    heads_used: usize,
    /// Chains: heads with a chain.
    heads_live: usize,
    next_chain: u32,
    free_chains: Vec<u32>,
    /// Per chain id: the writer's copy of its numbers.
    pub(super) meta: Vec<ChainMeta>,
    pub(super) pairs: usize,
    pub(super) blocks: usize,
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
    pub(super) garbage: Garbage,
    /// Set when a table or directory was retired: free it soon.
    pub(super) urgent: bool,
}

// SAFETY: the raw pointers (the current table, directory and states, an
// open edit's hash buffer) point to memory the index owns and the writer
// only uses under the writer lock.
unsafe impl Send for Writer {}

impl Writer {
    /// The writer of a new index, with its empty head table and chain
    /// directory: the caller publishes them (`heads`, `dir`) to readers.
    pub(super) fn new() -> Self {
        let heads = Table::with_capacity(INITIAL_HEADS);
        let heads_capacity = heads.capacity();
        Self {
            heads: Box::into_raw(Box::new(heads)),
            heads_shadow: Shadow::new(heads_capacity),
            head_bits: vec![0; head_bits_words(heads_capacity)],
            dir: Box::into_raw(Box::new(Dir::with_capacity(INITIAL_CHAINS))),
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
            garbage: Garbage::new(),
            urgent: false,
        }
    }
}

/// The writer's copy of one chain's numbers: it reads these instead of the
/// published state's atomics.
#[derive(Debug, Default)]
pub(super) struct ChainMeta {
    /// (block, holder) pairs the chain holds.
    pairs: u64,
    /// Its length.
    len: u32,
    /// Its segments' starts.
    pub(super) starts: Vec<u32>,
}

impl Inner {
    /// The current state of chain `id`, as the writer knows it.
    #[inline]
    pub(super) fn current(w: &Writer, id: u32) -> Option<&ChainState> {
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
    pub(super) fn wdir(w: &Writer) -> &Dir {
        // SAFETY: retired only by the writer.
        unsafe { &*w.dir }
    }

    /// The current head table, as the writer knows it.
    #[inline]
    pub(super) fn wheads(w: &Writer) -> &Table {
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
            w.garbage.push(GarbageItem::State(old));
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
        w.garbage.push(GarbageItem::Dir(old));
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
        w.garbage.push(GarbageItem::Table(old));
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
    pub(super) fn locate(
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
                    w.garbage.push(GarbageItem::Buf(buf));
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
    pub(super) fn add_later(
        &self,
        w: &mut Writer,
        stream: &mut Stream,
        loc: Loc,
        outcome: &mut ApplyOutcome,
    ) {
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
    pub(super) fn add_pending(
        &self,
        w: &mut Writer,
        stream: &mut Stream,
        outcome: &mut ApplyOutcome,
    ) {
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
    pub(super) fn remove_locs(&self, w: &mut Writer, slot: u32, locs: &mut Vec<Loc>) -> u64 {
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
    pub(super) fn end_event(&self, w: &mut Writer) {
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
                w.garbage.push(GarbageItem::State(old));
                w.garbage.push(GarbageItem::Buf(state.buf.cast_mut()));
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
                w.garbage.push(GarbageItem::Buf(old));
                self.publish(w);
            }
        }
        touched.clear();
        w.touched = touched;
    }
}
