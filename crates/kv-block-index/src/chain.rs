//! Chains: runs of consecutive blocks stored once, with holder sets per
//! segment, published copy-on-write.
//!
//! A chain is a sequence of our block hashes in which every block is the
//! child of the one before (so the sequence is a path of the prefix tree).
//! Its published [`ChainState`] holds the chain's length, a pointer to its
//! hash buffer and its segments. A segment is a range of the chain
//! whose blocks all have the same holder set; it also keeps the holders of
//! the segment before it that it lacks (`gone`), so a lookup that walked the
//! previous segment updates its live holders in time linear in that
//! difference, not in the sets.
//!
//! The writer edits a private copy ([`Edit`]) and publishes a new state with
//! one pointer store; unchanged holder sets are shared between the old and
//! the new state (`Arc<[u32]>`), and the old state is freed after a grace
//! period (module `rcu`). The hash buffer is shared by successive states:
//! appends write positions beyond every published length, and a buffer is
//! replaced (and the old one retired) when it is full or the chain is cut
//! back, so a position below a published length never changes.
//!
//! The two most frequent small changes need no new state: a decode step
//! (a block appended whose holders are the last segment's) and a stream
//! extending the run it holds into the next segment. Each is one atomic
//! store into the published state (its length, or a segment's start); see
//! [`ChainState`] for why readers may see either value.

use std::sync::Arc as SetArc;

use crate::hash::BlockHash;
use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// A chain's hash storage: a fixed capacity, written only beyond the
/// lengths of the states that were published with it.
#[derive(Debug)]
pub(crate) struct HashBuf {
    pub(crate) hashes: Box<[AtomicU64]>,
}

impl HashBuf {
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self {
            hashes: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    #[inline]
    pub(crate) fn get(&self, i: usize) -> u64 {
        self.hashes[i].load(Ordering::Relaxed)
    }

    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of::<Self>() + 8 * self.hashes.len()
    }

    /// How many leading hashes of `other` equal this buffer's from `off`,
    /// for hashes that chain (each one names the whole prefix before it):
    /// then the matching positions are a prefix of the range, and equal
    /// hashes at one position stand for equal hashes at all before it. So
    /// the range's last position is compared first (a request that follows
    /// a whole segment costs one compare) and a mismatch is found by binary
    /// search, O(log n) reads instead of n. The caller keeps `off +
    /// other.len()` within the length of the state it loaded.
    #[inline]
    pub(crate) fn matching(&self, off: usize, other: &[BlockHash]) -> usize {
        let same = |k: usize| self.get(off + k) == other[k].0;
        let n = other.len();
        if n == 0 || !same(0) {
            return 0;
        }
        if same(n - 1) {
            return n;
        }
        // Invariant: positions below `lo` match, position `hi` does not.
        // (Hashes that do not chain, which callers should not pass, still
        // match at least the first position here, so walks always move.)
        let (mut lo, mut hi) = (1, n - 1);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if same(mid) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

/// A holder set: sorted holder slots.
pub(crate) type Set = SetArc<[u32]>;

/// A range of a chain with one holder set.
#[derive(Debug)]
pub(crate) struct Seg {
    /// First position of the segment (it ends where the next one starts, or
    /// at the chain's length). Moved in place when a holder of the segment
    /// before extends its run into this one (see [`ChainState`]).
    pub(crate) start: AtomicU32,
    /// Who holds every block of the segment.
    pub(crate) holders: Set,
    /// Holders of the previous segment that this one lacks (empty for the
    /// first segment).
    pub(crate) gone: Set,
}

/// A published state of one chain.
///
/// Immutable but for two in-place changes, each a single atomic store that
/// leaves a state readers may see at any moment:
///
/// - `len` grows when the writer appends blocks whose holders are those of
///   the last segment (a decode step), after writing their hashes past the
///   old length (release, so a reader that sees the length sees them);
/// - a segment's `start` moves forward when a stream that holds the segment
///   before it, and is the only holder that segment has more, stores blocks
///   at the start of this one: the blocks change sides, and the `gone` set
///   (that one stream) stays right. A segment never becomes empty this way.
///
/// Readers load `len` once per visit and every `start` when they use it;
/// whatever they load, starts ascend and each block's holders are its old
/// or its new ones.
#[derive(Debug)]
pub(crate) struct ChainState {
    pub(crate) len: AtomicU32,
    pub(crate) buf: *const HashBuf,
    pub(crate) segs: Box<[Seg]>,
}

impl ChainState {
    /// The hash buffer.
    ///
    /// # Safety
    /// The caller holds a read guard under which it loaded this state (or is
    /// the writer): the buffer is retired no earlier than the state.
    #[inline]
    pub(crate) unsafe fn buf(&self) -> &HashBuf {
        // SAFETY: see above.
        unsafe { &*self.buf }
    }

    /// The published length (load it once per visit).
    #[inline]
    pub(crate) fn len(&self) -> u32 {
        self.len.load(Ordering::Acquire)
    }

    /// The end of segment `i` in a visit that loaded length `len`.
    #[inline]
    pub(crate) fn seg_end(&self, i: usize, len: u32) -> u32 {
        self.segs
            .get(i + 1)
            .map_or(len, |s| s.start.load(Ordering::Acquire).min(len))
    }

    /// The segment holding position `off` (`off < len`).
    pub(crate) fn seg_of(&self, off: u32) -> usize {
        self.segs
            .partition_point(|s| s.start.load(Ordering::Acquire) <= off)
            .max(1)
            - 1
    }

    /// Bytes of the state (not of its buffer), counting every non-empty set
    /// at each segment that names it.
    pub(crate) fn bytes(&self) -> usize {
        let set = |s: &Set| if s.is_empty() { 0 } else { 16 + 4 * s.len() };
        std::mem::size_of::<Self>()
            + self
                .segs
                .iter()
                .map(|s| std::mem::size_of::<Seg>() + set(&s.holders) + set(&s.gone))
                .sum::<usize>()
    }
}

/// `a \ b` of two sorted sets. Neighbouring segments' sets mostly differ
/// in a few holders, so equal runs are skipped eight at a time.
pub(crate) fn difference(a: &[u32], b: &[u32], out: &mut Vec<u32>) {
    out.clear();
    let (mut i, mut j) = (0, 0);
    while i < a.len() {
        if i + 8 <= a.len() && j + 8 <= b.len() && a[i..i + 8] == b[j..j + 8] {
            i += 8;
            j += 8;
            continue;
        }
        let x = a[i];
        while j < b.len() && b[j] < x {
            j += 1;
        }
        if j < b.len() && b[j] == x {
            j += 1;
        } else {
            out.push(x);
        }
        i += 1;
    }
}

/// A segment being edited.
#[derive(Debug)]
pub(crate) struct EditSeg {
    pub(crate) start: u32,
    pub(crate) holders: Set,
    pub(crate) gone: Set,
    /// Its holders changed (or it is new): its `gone` and the next one's
    /// are recomputed on publication.
    pub(crate) changed: bool,
}

/// The writer's private copy of one chain.
#[derive(Debug)]
pub(crate) struct Edit {
    pub(crate) id: u32,
    pub(crate) len: u32,
    pub(crate) buf: *mut HashBuf,
    pub(crate) segs: Vec<EditSeg>,
}

/// What a holder change did, block by block.
#[derive(Debug, Default)]
pub(crate) struct Delta {
    /// (block, holder) pairs added (or removed).
    pub(crate) pairs: u64,
    /// Blocks that went from no holder to one (or back).
    pub(crate) blocks: u64,
}

impl Edit {
    /// An editable copy of a published state.
    ///
    /// # Safety
    /// `state` is the chain's current state and the caller is the writer.
    /// `len` and `starts` are the writer's copies of the state's length and
    /// segment starts (it does not load what readers load).
    pub(crate) unsafe fn open(
        id: u32,
        state: &ChainState,
        mut segs: Vec<EditSeg>,
        len: u32,
        starts: &[u32],
    ) -> Self {
        segs.clear();
        segs.extend(state.segs.iter().zip(starts).map(|(s, &start)| EditSeg {
            start,
            holders: SetArc::clone(&s.holders),
            gone: SetArc::clone(&s.gone),
            changed: false,
        }));
        Self {
            id,
            len,
            buf: state.buf.cast_mut(),
            segs,
        }
    }

    #[inline]
    pub(crate) fn buf(&self) -> &HashBuf {
        // SAFETY: the writer owns the edit's buffer until it is retired,
        // which happens only through this edit.
        unsafe { &*self.buf }
    }

    #[inline]
    pub(crate) fn hash(&self, off: u32) -> u64 {
        self.buf().get(off as usize)
    }

    fn seg_end(&self, i: usize) -> u32 {
        self.segs.get(i + 1).map_or(self.len, |s| s.start)
    }

    /// Makes a segment start at `p` (`p < len`) and returns its index.
    fn split_at(&mut self, p: u32, empty: &Set) -> usize {
        let i = self.segs.partition_point(|s| s.start <= p) - 1;
        if self.segs[i].start == p {
            return i;
        }
        let holders = SetArc::clone(&self.segs[i].holders);
        self.segs.insert(
            i + 1,
            EditSeg {
                start: p,
                holders,
                gone: SetArc::clone(empty),
                changed: true,
            },
        );
        i + 1
    }

    /// Appends one block nobody holds yet; returns its position. The
    /// returned buffer, if any, was replaced and must be retired. `more`:
    /// blocks the caller is about to append after this one (room is made
    /// for them at once).
    pub(crate) fn append(
        &mut self,
        hash: u64,
        more: usize,
        empty: &Set,
    ) -> (u32, Option<*mut HashBuf>) {
        let mut retired = None;
        let cap = self.buf().hashes.len();
        if self.len as usize == cap {
            let need = self.len as usize + 1 + more;
            let grown = HashBuf::with_capacity((cap * 2).max(need).max(MIN_BUF));
            for i in 0..self.len as usize {
                grown.hashes[i].store(self.buf().get(i), Ordering::Relaxed);
            }
            retired = Some(std::mem::replace(
                &mut self.buf,
                Box::into_raw(Box::new(grown)),
            ));
        }
        let at = self.len;
        self.buf().hashes[at as usize].store(hash, Ordering::Relaxed);
        if self.segs.last().is_none_or(|s| !s.holders.is_empty()) {
            self.segs.push(EditSeg {
                start: at,
                holders: SetArc::clone(empty),
                gone: SetArc::clone(empty),
                changed: true,
            });
        }
        self.len += 1;
        (at, retired)
    }

    /// Adds (`add`) or removes `slot` at positions `a..b`. Calls `unchanged`
    /// with each sub-range where `slot` already had (or lacked) that state.
    pub(crate) fn change(
        &mut self,
        a: u32,
        b: u32,
        slot: u32,
        add: bool,
        empty: &Set,
        mut unchanged: impl FnMut(u32, u32),
    ) -> Delta {
        let mut delta = Delta::default();
        if a >= b {
            return delta;
        }
        let i = self.split_at(a, empty);
        let j = if b < self.len {
            self.split_at(b, empty)
        } else {
            self.segs.len()
        };
        for k in i..j {
            let (start, end) = (self.segs[k].start, self.seg_end(k));
            let n = u64::from(end - start);
            let (before, rest) = self.segs.split_at_mut(k);
            let seg = &mut rest[0];
            let found = seg.holders.binary_search(&slot);
            match (add, found) {
                (true, Err(at)) => {
                    if seg.holders.is_empty() {
                        delta.blocks += n;
                    }
                    let (head, tail) = seg.holders.split_at(at);
                    let holders = match before.last().map(|p| &p.holders) {
                        // The block before already has exactly the new set
                        // (a stream extending what it holds, a decode
                        // step): share it, and the two segments merge.
                        Some(prev)
                            if prev.len() == head.len() + tail.len() + 1
                                && prev[at] == slot
                                && prev[..at] == *head
                                && prev[at + 1..] == *tail =>
                        {
                            SetArc::clone(prev)
                        }
                        // Exact-size iterators: one allocation, no Vec.
                        _ => head
                            .iter()
                            .copied()
                            .chain(std::iter::once(slot))
                            .chain(tail.iter().copied())
                            .collect(),
                    };
                    seg.holders = holders;
                }
                (false, Ok(at)) => {
                    if seg.holders.len() == 1 {
                        delta.blocks += n;
                        seg.holders = SetArc::clone(empty);
                    } else {
                        let (head, tail) = seg.holders.split_at(at);
                        seg.holders = head.iter().chain(&tail[1..]).copied().collect();
                    }
                }
                _ => {
                    unchanged(start, end);
                    continue;
                }
            }
            seg.changed = true;
            delta.pairs += n;
        }
        delta
    }

    /// Cuts the chain back to `len` blocks, into a new buffer; returns the
    /// old buffer (to retire).
    pub(crate) fn cut(&mut self, len: u32) -> *mut HashBuf {
        let fresh = HashBuf::with_capacity((len as usize).max(MIN_BUF));
        for i in 0..len as usize {
            fresh.hashes[i].store(self.buf().get(i), Ordering::Relaxed);
        }
        self.len = len;
        self.segs.retain(|s| s.start < len);
        std::mem::replace(&mut self.buf, Box::into_raw(Box::new(fresh)))
    }

    /// The state to publish: neighbours with equal holder sets merged, the
    /// `gone` sets of changed segments recomputed. Leaves the edit's
    /// segment list empty (for reuse).
    /// `starts` receives the segments' starts (the writer's copy).
    pub(crate) fn finish(
        &mut self,
        empty: &Set,
        scratch: &mut Vec<u32>,
        starts: &mut Vec<u32>,
    ) -> ChainState {
        starts.clear();
        let mut out: Vec<Seg> = Vec::with_capacity(self.segs.len());
        // Whether the last segment pushed changed (or absorbed a change).
        let mut last_changed = false;
        for seg in self.segs.drain(..) {
            let gone = match out.last() {
                None => SetArc::clone(empty),
                // Unchanged neighbours differ (they were merged when last
                // published), so only changed ones need a compare.
                Some(last)
                    if SetArc::ptr_eq(&last.holders, &seg.holders)
                        || ((last_changed || seg.changed) && *last.holders == *seg.holders) =>
                {
                    last_changed |= seg.changed;
                    continue;
                }
                Some(last) if last_changed || seg.changed => {
                    difference(&last.holders, &seg.holders, scratch);
                    if scratch.is_empty() {
                        SetArc::clone(empty)
                    } else {
                        scratch.as_slice().into()
                    }
                }
                Some(_) => seg.gone,
            };
            last_changed = seg.changed;
            starts.push(seg.start);
            out.push(Seg {
                start: AtomicU32::new(seg.start),
                holders: seg.holders,
                gone,
            });
        }
        ChainState {
            len: AtomicU32::new(self.len),
            buf: self.buf,
            segs: out.into_boxed_slice(),
        }
    }
}

/// The smallest hash buffer.
#[cfg(not(loom))]
pub(crate) const MIN_BUF: usize = 8;
#[cfg(loom)]
pub(crate) const MIN_BUF: usize = 2;

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn edit(empty: &Set) -> Edit {
        Edit {
            id: 0,
            len: 0,
            buf: Box::into_raw(Box::new(HashBuf::with_capacity(MIN_BUF))),
            segs: Vec::new(),
        }
        .tap(|e| {
            for h in 1..=20 {
                let (_, old) = e.append(h, 0, empty);
                if let Some(old) = old {
                    // SAFETY: replaced by the edit, never shared.
                    drop(unsafe { Box::from_raw(old) });
                }
            }
        })
    }

    trait Tap: Sized {
        fn tap(mut self, f: impl FnOnce(&mut Self)) -> Self {
            f(&mut self);
            self
        }
    }
    impl Tap for Edit {}

    #[test]
    fn segments_split_merge_and_record_what_is_gone() {
        let empty: Set = SetArc::from(Vec::new());
        let mut e = edit(&empty);
        assert_eq!(e.len, 20);
        assert_eq!(
            (1..=20).map(|i| e.hash(i - 1)).collect::<Vec<_>>(),
            (1..=20).collect::<Vec<u64>>()
        );
        let d = e.change(0, 20, 3, true, &empty, |_, _| panic!("all new"));
        assert_eq!((d.pairs, d.blocks), (20, 20));
        let d = e.change(0, 10, 5, true, &empty, |_, _| panic!("all new"));
        assert_eq!((d.pairs, d.blocks), (10, 0));
        let mut same = Vec::new();
        let d = e.change(5, 15, 5, true, &empty, |a, b| same.push((a, b)));
        assert_eq!((d.pairs, same), (5, vec![(5, 10)]));
        let d = e.change(15, 20, 3, false, &empty, |_, _| panic!("held"));
        assert_eq!((d.pairs, d.blocks), (5, 5));
        let mut scratch = Vec::new();
        let mut starts = Vec::new();
        let state = e.finish(&empty, &mut scratch, &mut starts);
        assert_eq!(starts, vec![0, 15]);
        assert!(e.segs.is_empty());
        let shape: Vec<(u32, Vec<u32>, Vec<u32>)> = state
            .segs
            .iter()
            .map(|s| {
                (
                    s.start.load(Ordering::Relaxed),
                    s.holders.to_vec(),
                    s.gone.to_vec(),
                )
            })
            .collect();
        assert_eq!(
            shape,
            vec![(0, vec![3, 5], vec![]), (15, vec![], vec![3, 5])]
        );
        assert_eq!(state.seg_of(14), 0);
        assert_eq!(state.seg_of(15), 1);
        // SAFETY: the buffer was never shared.
        drop(unsafe { Box::from_raw(state.buf.cast_mut()) });
    }

    #[test]
    fn difference_of_sorted_sets() {
        let mut out = Vec::new();
        difference(&[1, 3, 5, 7], &[2, 3, 7, 9], &mut out);
        assert_eq!(out, vec![1, 5]);
        difference(&[], &[1], &mut out);
        assert!(out.is_empty());
        // Long equal runs around the differences.
        let a: Vec<u32> = (0..100).collect();
        let b: Vec<u32> = (0..100).filter(|x| x % 37 != 5).chain([150]).collect();
        difference(&a, &b, &mut out);
        assert_eq!(out, vec![5, 42, 79]);
        difference(&b, &a, &mut out);
        assert_eq!(out, vec![150]);
    }
}
