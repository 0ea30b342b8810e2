//! The prefix memo: a rendering that begins as an earlier one did takes
//! that one's ids for the text they share, up to the last added token
//! whose place the difference cannot have moved.
//!
//! A conversation's next request renders to the previous request's text
//! with a little more (or a little other) at its end. The segment cache
//! already makes each repeated segment a lookup, but a lookup per segment
//! and the search for added tokens over the whole text are still linear in
//! the conversation: at 8 KB, a third of a warm request's instructions.
//! With this memo they are linear in what is new.
//!
//! # Why the reused ids are exact
//!
//! [`encode_chat`](crate::hf::HfTokenizer) cuts a rendering at its added
//! tokens — leftmost, longest, then on from the match's end — and encodes
//! each piece between two cuts on its own. So the ids of `text[..end]`,
//! for `end` the end of an added token the cutting found, are a function
//! of the cuts before `end` and the pieces between them, nothing after.
//! Whether the cutting finds a token at position `s`, and which, depends
//! on `text[s..s + longest]` (`longest`: the longest added token's length)
//! and on where the previous match ended. Two texts that agree on their
//! first `end + longest` bytes therefore cut identically up to `end` and
//! have the same ids before it; the cutting of the new text goes on from
//! `end` as it would have from the start (matches never start inside an
//! earlier match, and nothing looks behind a match). A stored rendering
//! keeps, for every cut, its byte offset and the number of ids before it;
//! a new text takes the latest cut at least `longest` bytes before the
//! first byte where the two differ ([`PrefixMemo::find`]).
//!
//! Texts are compared byte for byte; the hash that keys them only finds
//! candidates. A text identical to a stored one takes all of its ids.
//!
//! # Bounds and concurrency
//!
//! Renderings are keyed by a seeded hash of their first [`HEAD_BYTES`]
//! (a conversation's system prompt and first turn, usually), at most
//! [`PER_KEY`] per key, most recent first; a new rendering supersedes the
//! one it reused when it shares at least three quarters of that one's
//! text (the conversation moved on), and otherwise sits beside it
//! (another conversation that begins the same way). The memory is bounded
//! by bytes (text, ids, cuts and a fixed overhead per rendering) over 16
//! shards by key, each evicting its oldest renderings first. A shard's
//! `parking_lot::Mutex` is held for a map lookup or insert only: the
//! comparison runs on `Arc`s taken out of it. There is no lock-free logic
//! to model.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::cache::KeyHasher;

/// The default bound of a tokenizer's prefix memo, in bytes
/// ([`TokenizerOptions::prefix_memo_bytes`](crate::TokenizerOptions::prefix_memo_bytes)):
/// about a thousand 8 KB conversations.
pub const DEFAULT_PREFIX_MEMO_BYTES: usize = 16 * 1024 * 1024;

/// Renderings shorter than this are cut and looked up as before: storing
/// and comparing one costs about what its cutting costs.
pub(crate) const MIN_TEXT_BYTES: usize = 1024;

/// The beginning of a rendering that keys it.
const HEAD_BYTES: usize = 256;

/// Renderings kept under one key: conversations that begin alike.
const PER_KEY: usize = 4;

const SHARDS: usize = 16;

/// Bytes charged per rendering on top of its text, ids and cuts (the
/// `Arc`, the map slot, the queue record).
const ENTRY_OVERHEAD_BYTES: usize = 128;

/// A place in a stored rendering just after an added token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cut {
    /// The byte offset of the end of the added token.
    pub(crate) end: u32,
    /// The ids before `end`.
    pub(crate) ids: u32,
    /// The segments before `end` that went through the segment cache (hits
    /// and misses), reported as hits when the cut is reused.
    pub(crate) segments: u32,
}

/// A rendering, its ids and its cuts.
#[derive(Debug)]
pub(crate) struct Rendering {
    text: String,
    ids: Box<[u32]>,
    /// In increasing order of `end`.
    cuts: Box<[Cut]>,
    /// The segments of the whole rendering that went through the segment
    /// cache.
    segments: u32,
    /// Tells apart the renderings of a shard, for its eviction queue.
    serial: u64,
}

impl Rendering {
    fn cost(&self) -> usize {
        self.text.len()
            + self.ids.len() * 4
            + self.cuts.len() * std::mem::size_of::<Cut>()
            + ENTRY_OVERHEAD_BYTES
    }
}

/// What a new text takes from a stored rendering: the ids before `cut`.
#[derive(Debug)]
pub(crate) struct Reuse {
    rendering: Arc<Rendering>,
    /// How many bytes the two texts share from their start.
    shared: usize,
    /// `None` when the texts are identical (all the ids are reused).
    cut: Option<Cut>,
}

impl Reuse {
    /// The reused ids.
    pub(crate) fn ids(&self) -> &[u32] {
        match self.cut {
            Some(cut) => &self.rendering.ids[..cut.ids as usize],
            None => &self.rendering.ids,
        }
    }

    /// The cut the new text's cutting goes on from, `None` when the texts
    /// are identical.
    pub(crate) fn cut(&self) -> Option<Cut> {
        self.cut
    }

    /// The cuts of the reused prefix, for the new text's own record.
    pub(crate) fn cuts(&self) -> &[Cut] {
        match self.cut {
            Some(cut) => {
                let through = self.rendering.cuts.partition_point(|c| c.end <= cut.end);
                &self.rendering.cuts[..through]
            }
            None => &self.rendering.cuts,
        }
    }

    /// The segments of the reused part that went through the segment cache.
    pub(crate) fn segments(&self) -> u32 {
        match self.cut {
            Some(cut) => cut.segments,
            None => self.rendering.segments,
        }
    }
}

/// Counters of a prefix memo, for metrics and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixMemoStats {
    /// Renderings looked up (those of at least 1 KB).
    pub lookups: u64,
    /// Lookups that reused ids of an earlier rendering.
    pub reused: u64,
    /// Bytes of text whose ids were reused, in all.
    pub reused_bytes: u64,
    /// Renderings currently held.
    pub entries: u64,
    /// Bytes currently charged.
    pub bytes: u64,
}

#[derive(Debug, Default)]
struct Shard {
    /// Keyed by the head's seeded hash, which the map uses as it is.
    map: HashMap<u64, Vec<Arc<Rendering>>, BuildHasherDefault<KeyHasher>>,
    /// (key, serial) in order of insertion; records of renderings already
    /// gone are skipped when popped.
    order: VecDeque<(u64, u64)>,
    entries: usize,
    bytes: usize,
    next_serial: u64,
}

impl Shard {
    fn remove(&mut self, key: u64, serial: u64) {
        let Some(list) = self.map.get_mut(&key) else {
            return;
        };
        if let Some(at) = list.iter().position(|r| r.serial == serial) {
            let gone = list.remove(at);
            self.entries -= 1;
            self.bytes -= gone.cost();
            if list.is_empty() {
                self.map.remove(&key);
            }
        }
    }

    fn insert(
        &mut self,
        key: u64,
        mut rendering: Rendering,
        supersedes: Option<u64>,
        budget: usize,
    ) {
        rendering.serial = self.next_serial;
        self.next_serial += 1;
        if let Some(serial) = supersedes {
            self.remove(key, serial);
        }
        let cost = rendering.cost();
        if cost > budget {
            return;
        }
        let serial = rendering.serial;
        let list = self.map.entry(key).or_default();
        list.insert(0, Arc::new(rendering));
        self.entries += 1;
        self.bytes += cost;
        if list.len() > PER_KEY
            && let Some(oldest) = list.pop()
        {
            self.entries -= 1;
            self.bytes -= oldest.cost();
        }
        self.order.push_back((key, serial));
        while self.bytes > budget {
            let Some((key, serial)) = self.order.pop_front() else {
                break;
            };
            self.remove(key, serial);
        }
        if self.order.len() > 2 * self.entries + 32 {
            let map = &self.map;
            self.order.retain(|(key, serial)| {
                map.get(key)
                    .is_some_and(|list| list.iter().any(|r| r.serial == *serial))
            });
        }
    }
}

/// Earlier renderings of one tokenizer and their ids (module docs).
#[derive(Debug)]
pub(crate) struct PrefixMemo {
    shards: Box<[Mutex<Shard>]>,
    shard_budget: usize,
    hasher: ahash::RandomState,
    lookups: AtomicU64,
    reused: AtomicU64,
    reused_bytes: AtomicU64,
}

impl PrefixMemo {
    /// A memo of at most `bytes` (0: off).
    pub(crate) fn new(bytes: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            shard_budget: bytes / SHARDS,
            hasher: ahash::RandomState::new(),
            lookups: AtomicU64::new(0),
            reused: AtomicU64::new(0),
            reused_bytes: AtomicU64::new(0),
        }
    }

    /// Whether `text` is one the memo looks up and stores.
    pub(crate) fn takes(&self, text: &str) -> bool {
        self.shard_budget > 0 && text.len() >= MIN_TEXT_BYTES
    }

    fn key(&self, text: &str) -> u64 {
        let head = &text.as_bytes()[..text.len().min(HEAD_BYTES)];
        self.hasher.hash_one(head)
    }

    fn shard(&self, key: u64) -> &Mutex<Shard> {
        // The map hashes the key again; the shard takes its top bits.
        &self.shards[(key >> 60) as usize % SHARDS]
    }

    /// The stored rendering sharing the most of `text`'s beginning, and the
    /// latest of its cuts whose ids `text` may take: one at least
    /// `longest` bytes (the longest added token) before the first byte
    /// where they differ. `None` when no stored rendering offers a cut.
    pub(crate) fn find(&self, text: &str, longest: usize) -> Option<Reuse> {
        if !self.takes(text) {
            return None;
        }
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let key = self.key(text);
        // At most PER_KEY `Arc`s, cloned under the lock; compared outside.
        let candidates: Vec<Arc<Rendering>> = self
            .shard(key)
            .lock()
            .map
            .get(&key)
            .map(|list| list.to_vec())
            .unwrap_or_default();
        let (rendering, shared) = candidates
            .into_iter()
            .map(|r| {
                let shared = shared_prefix(text.as_bytes(), r.text.as_bytes());
                (r, shared)
            })
            .max_by_key(|(_, shared)| *shared)?;
        let reuse = if shared == text.len() && shared == rendering.text.len() {
            Reuse {
                rendering,
                shared,
                cut: None,
            }
        } else {
            let usable = rendering
                .cuts
                .partition_point(|c| c.end as usize + longest <= shared);
            let cut = *rendering.cuts.get(usable.checked_sub(1)?)?;
            Reuse {
                rendering,
                shared,
                cut: Some(cut),
            }
        };
        self.reused.fetch_add(1, Ordering::Relaxed);
        let reused = reuse.cut.map_or(text.len(), |c| c.end as usize);
        self.reused_bytes
            .fetch_add(reused as u64, Ordering::Relaxed);
        Some(reuse)
    }

    /// Stores `text`'s rendering (its ids, its cuts and the number of its
    /// segments that went through the segment cache), superseding the one
    /// it reused when it shares at least three quarters of it.
    pub(crate) fn store(
        &self,
        text: String,
        ids: &[u32],
        cuts: Vec<Cut>,
        segments: u32,
        reused: Option<&Reuse>,
    ) {
        if !self.takes(&text) {
            return;
        }
        let key = self.key(&text);
        let supersedes = reused
            .filter(|r| r.shared * 4 >= r.rendering.text.len() * 3)
            .map(|r| r.rendering.serial);
        let rendering = Rendering {
            text,
            ids: ids.into(),
            cuts: cuts.into(),
            segments,
            serial: 0,
        };
        self.shard(key)
            .lock()
            .insert(key, rendering, supersedes, self.shard_budget);
    }

    /// The memo's counters.
    pub(crate) fn stats(&self) -> PrefixMemoStats {
        let mut stats = PrefixMemoStats {
            lookups: self.lookups.load(Ordering::Relaxed),
            reused: self.reused.load(Ordering::Relaxed),
            reused_bytes: self.reused_bytes.load(Ordering::Relaxed),
            ..PrefixMemoStats::default()
        };
        for shard in self.shards.iter() {
            let shard = shard.lock();
            stats.entries += shard.entries as u64;
            stats.bytes += shard.bytes as u64;
        }
        stats
    }
}

/// How many bytes `a` and `b` share from their start.
fn shared_prefix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 128;
    let n = a.len().min(b.len());
    let mut at = 0;
    // Whole blocks by `memcmp`, then the differing block byte by byte.
    while at + BLOCK <= n && a[at..at + BLOCK] == b[at..at + BLOCK] {
        at += BLOCK;
    }
    at + a[at..n]
        .iter()
        .zip(&b[at..n])
        .take_while(|(x, y)| x == y)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rendering(text: &str, cuts: &[(u32, u32)]) -> (String, Vec<u32>, Vec<Cut>) {
        let ids: Vec<u32> = (0..text.len() as u32 / 4).collect();
        let cuts = cuts
            .iter()
            .enumerate()
            .map(|(n, &(end, ids))| Cut {
                end,
                ids,
                segments: n as u32 + 1,
            })
            .collect();
        (text.to_owned(), ids, cuts)
    }

    #[test]
    fn shared_prefix_counts_equal_bytes_across_blocks() {
        let a = vec![7u8; 1000];
        let mut b = a.clone();
        assert_eq!(shared_prefix(&a, &b), 1000);
        b[517] = 0;
        assert_eq!(shared_prefix(&a, &b), 517);
        assert_eq!(shared_prefix(&a, &b[..300]), 300);
        assert_eq!(shared_prefix(&[], &b), 0);
    }

    #[test]
    fn the_latest_cut_a_token_length_before_the_difference_is_reused() {
        let memo = PrefixMemo::new(1 << 20);
        let base = "x".repeat(2000);
        let (text, ids, cuts) = rendering(&base, &[(100, 20), (1500, 300), (1900, 380)]);
        memo.store(text, &ids, cuts, 4, None);
        let mut other = base.clone();
        other.replace_range(1905..1906, "y");
        // The difference at 1905: the cut at 1900 is 5 bytes before it, too
        // close for tokens of 8 bytes; the one at 1500 is reused.
        let reuse = memo.find(&other, 8).expect("a cut");
        assert_eq!(reuse.cut().map(|c| c.end), Some(1500));
        assert_eq!(reuse.ids(), &ids[..300]);
        assert_eq!(reuse.cuts().len(), 2);
        assert_eq!(reuse.segments(), 2);
        let reuse = memo.find(&other, 5).expect("a cut");
        assert_eq!(reuse.cut().map(|c| c.end), Some(1900));
        // Identical: every id.
        let same = memo.find(&base, 8).expect("the same text");
        assert_eq!(same.cut(), None);
        assert_eq!(same.ids().len(), ids.len());
        assert_eq!(same.segments(), 4);
        // Differing before the first cut, or too short to be kept: nothing.
        let mut early = base.clone();
        early.replace_range(50..51, "y");
        assert!(memo.find(&early, 8).is_none());
        assert!(memo.find(&base[..500], 8).is_none());
        let stats = memo.stats();
        assert_eq!((stats.lookups, stats.reused, stats.entries), (4, 3, 1));
    }

    #[test]
    fn a_rendering_supersedes_the_one_it_extends_and_sits_beside_others() {
        let memo = PrefixMemo::new(1 << 20);
        let turn = |n: usize| format!("{}{}", "s".repeat(1200), "t".repeat(n));
        let (text, ids, cuts) = rendering(&turn(400), &[(1100, 220)]);
        memo.store(text, &ids, cuts, 4, None);
        let next = turn(500);
        let reuse = memo.find(&next, 4).expect("the earlier turn");
        let (text, ids, cuts) = rendering(&next, &[(1100, 220), (1650, 330)]);
        memo.store(text, &ids, cuts, 4, Some(&reuse));
        assert_eq!(memo.stats().entries, 1, "the earlier turn is superseded");
        // Another conversation with the same beginning: kept beside it.
        let other = format!("{}{}", "s".repeat(1200), "u".repeat(2000));
        let reuse = memo.find(&other, 4).expect("the shared beginning");
        assert_eq!(reuse.cut().map(|c| c.end), Some(1100));
        let (text, ids, cuts) = rendering(&other, &[(1100, 220)]);
        memo.store(text, &ids, cuts, 4, Some(&reuse));
        assert_eq!(memo.stats().entries, 2);
        // Each finds its own.
        let again = memo.find(&turn(600), 4).expect("its own");
        assert_eq!(again.cut().map(|c| c.end), Some(1650));
    }

    #[test]
    fn the_bound_holds_and_the_oldest_go_first() {
        let budget = SHARDS * 40_000;
        let memo = PrefixMemo::new(budget);
        for n in 0..400 {
            let text = format!("{n:04}{}", "z".repeat(4000));
            let (text, ids, cuts) = rendering(&text, &[(100, 10)]);
            memo.store(text, &ids, cuts, 4, None);
            assert!(memo.stats().bytes as usize <= budget);
        }
        assert!(memo.stats().entries > 0);
        assert!(memo.find(&format!("0399{}", "z".repeat(4000)), 4).is_some());
        assert!(memo.find(&format!("0000{}", "z".repeat(4000)), 4).is_none());
        let off = PrefixMemo::new(0);
        let (text, ids, cuts) = rendering(&"z".repeat(4000), &[(100, 10)]);
        off.store(text, &ids, cuts, 4, None);
        assert_eq!(off.stats().entries, 0);
        assert!(off.find(&"z".repeat(4000), 4).is_none());
    }
}

/// The memo inside the tokenizer: every rendering's ids equal those of the
/// whole text tokenized at once, whatever earlier renderings it reused.
#[cfg(test)]
mod exact {
    use std::path::Path;

    use proptest::prelude::*;

    use crate::cache::{SegmentCache, SegmentUse};
    use crate::hf::HfTokenizer;
    use crate::testing::{TestTokenizerKind, train_tokenizer_json};

    /// Added tokens where one is the beginning of another (the cutting
    /// must read past the shorter one to choose), and ChatML's.
    const SPECIAL: [&str; 5] = ["<|im_start|>", "<|im_end|>", "<|a|>", "<|a|>b", "<|a|>bc|>"];

    fn tokenizer(kind: TestTokenizerKind, memo_bytes: usize) -> HfTokenizer {
        // Trained once per kind: the cases load it.
        static TRAINED: std::sync::Mutex<Vec<(TestTokenizerKind, String)>> =
            std::sync::Mutex::new(Vec::new());
        let json = {
            let mut trained = TRAINED.lock().expect("not poisoned");
            match trained.iter().find(|(k, _)| *k == kind) {
                Some((_, json)) => json.clone(),
                None => {
                    let json = train_tokenizer_json(kind, &SPECIAL, None).expect("trains");
                    trained.push((kind, json.clone()));
                    json
                }
            }
        };
        let mut tokenizer = HfTokenizer::from_bytes(
            json.as_bytes(),
            Path::new("<test>"),
            SegmentCache::new(1 << 20, 4),
            true,
        )
        .expect("loads");
        tokenizer.prefix = super::PrefixMemo::new(memo_bytes);
        tokenizer
    }

    /// Pieces a rendering is made of: added tokens, their beginnings and
    /// ends, words, spaces, newlines and multi-byte text.
    fn piece() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "<|im_start|>",
            "<|im_end|>",
            "<|a|>",
            "<|a|>b",
            "<|a|>bc|>",
            "<|",
            "<|a",
            "|>",
            "b",
            "c|>",
            "user\n",
            "assistant\n",
            "hello ",
            "world",
            " ",
            "\n",
            "\n\n",
            "été ",
            "日本語",
            "🙂",
            "The quick brown fox jumps over the lazy dog. ",
        ])
    }

    fn text() -> impl Strategy<Value = String> {
        prop::collection::vec(piece(), 40..160).prop_map(|pieces| pieces.concat())
    }

    /// A change to a text: cut it (at any place, rounded down to a
    /// character boundary, or right after an added token, where what
    /// follows decides which token was there) and append pieces.
    type Edit = (bool, prop::sample::Index, Vec<&'static str>);

    fn edit() -> impl Strategy<Value = Edit> {
        (
            any::<bool>(),
            any::<prop::sample::Index>(),
            prop::collection::vec(piece(), 0..40),
        )
    }

    fn apply(base: &str, (after_token, at, tail): &Edit) -> String {
        let token_ends: Vec<usize> = SPECIAL
            .iter()
            .flat_map(|token| base.match_indices(token).map(|(at, t)| at + t.len()))
            .collect();
        let cut = if *after_token && !token_ends.is_empty() {
            token_ends[at.index(token_ends.len())]
        } else {
            let mut cut = at.index(base.len() + 1);
            while !base.is_char_boundary(cut) {
                cut -= 1;
            }
            cut
        };
        format!("{}{}", &base[..cut], tail.concat())
    }

    fn check(kind: TestTokenizerKind, base: &str, edits: &[Edit]) -> Result<(), TestCaseError> {
        let memo = tokenizer(kind, 1 << 20);
        let plain = tokenizer(kind, 0);
        // A conversation: each text built from the previous one or the base,
        // some repeated as they were.
        let mut texts = vec![base.to_owned(), base.to_owned()];
        for (n, edit) in edits.iter().enumerate() {
            let from = if n % 3 == 2 {
                base
            } else {
                texts.last().expect("one")
            };
            let text = apply(from, edit);
            texts.push(text);
        }
        for text in &texts {
            let whole = memo.encode_whole(text, false).expect("whole");
            let mut uses = SegmentUse::default();
            let ids = memo
                .encode_chat(text.clone(), None, &mut uses)
                .expect("memo");
            prop_assert_eq!(&ids, &whole, "{:?}", text);
            let mut plain_uses = SegmentUse::default();
            let plain_ids = plain
                .encode_chat(text.clone(), None, &mut plain_uses)
                .expect("plain");
            prop_assert_eq!(&plain_ids, &whole);
            // Every segment is counted once, reused or looked up.
            prop_assert_eq!(
                uses.cache_hits + uses.cache_misses,
                plain_uses.cache_hits + plain_uses.cache_misses
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn reused_ids_equal_the_whole_texts_ids(
            base in text(),
            edits in prop::collection::vec(edit(), 1..8),
            kind in prop::sample::select(vec![TestTokenizerKind::ByteLevelRegex, TestTokenizerKind::PrependNormalizer]),
        ) {
            check(kind, &base, &edits)?;
        }
    }
}
