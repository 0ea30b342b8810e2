//! The reader: lookups of a request's prefix and of one block's holders,
//! and what they return.
//!
//! Everything here runs inside a read guard (module `rcu`) and does only
//! atomic loads and reads of memory no writer changes, so a lookup never
//! blocks and never waits for a writer; what it loads stays alive until
//! the guard is dropped (module `reclaim`). It is apart from the writer so
//! that the read side's safety argument is read in one place: every
//! dereference below is of a pointer loaded under the caller's guard.
//!
//! # The walk
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

use crate::chain::ChainState;
use crate::hash::BlockHash;
use crate::sync::Ordering;
use crate::table::Table;

use super::bits::{bit_clear, bit_get, bit_set};
use super::{Dir, Holder, Inner, Loc};

#[cfg(doc)]
use super::KvIndex;

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

impl Inner {
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

    /// Our hash of the block at `loc` (held by the calling stream, so its
    /// chain is alive).
    pub(super) fn hash_at(&self, loc: Loc) -> Option<BlockHash> {
        let _guard = self.rcu.read();
        let state = self.state(loc.chain)?;
        // SAFETY: loaded under the read guard.
        let buf = unsafe { state.buf() };
        (loc.off < state.len()).then(|| BlockHash(buf.get(loc.off as usize)))
    }

    /// The lookup behind [`KvIndex::lookup_into`] (see [the walk](self#the-walk)).
    pub(super) fn lookup_into(&self, hashes: &[BlockHash], out: &mut PrefixMatches) {
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

    /// The holders of one block, sorted; see [`KvIndex::holders_of`].
    pub(super) fn holders_of(&self, hash: BlockHash) -> Vec<Holder> {
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
}
