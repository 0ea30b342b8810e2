//! A direct encoder for byte-level BPE `tokenizer.json` files (Llama 3,
//! Qwen 2.5 / 3, DeepSeek V3, Mistral's Tekken and their kin): the same
//! ids as the `tokenizers` pipeline, without its per-call machinery.
//!
//! # Why
//!
//! `tokenizers` builds a normalized string with alignment tables for every
//! call, runs the split regexes through a backtracking engine (for their
//! one look-ahead) and allocates a `String` per piece and per token: about
//! 56 µs for a 200-byte chat message. The ids depend on none of that. This
//! encoder runs the same three steps on bytes:
//!
//! 1. **Pre-tokenization**: each `Split` of the pre-tokenizer in turn
//!    (matches and the text between them each become a piece, the
//!    `Isolated` behaviour), then byte-level mapping, which only renames
//!    bytes and so is implicit here.
//! 2. **Model**: BPE on each piece: a piece that is itself a token is
//!    emitted whole when the model has `ignore_merges`, otherwise its bytes
//!    are merged by the ranks of the merge list with `tokenizers`' own
//!    algorithm ([`Encoder::merge`]). Without `ignore_merges` (Qwen), a
//!    piece that is a token whose own merges give back that one token is
//!    emitted whole too: the set of such tokens is computed once at load,
//!    so most words skip the merge loop with the same ids.
//! 3. **Added tokens with `normalized: true`**, which `tokenizers` cuts
//!    out of each piece after normalizing it, are cut out the same way.
//!
//! # What it takes, and what it declines
//!
//! [`Encoder::for_tokenizer`] reads the loaded tokenizer's own
//! configuration (so merges, vocabulary and options are exactly what
//! `tokenizers` uses) and declines, with the reason, anything whose ids it
//! cannot guarantee: another model, dropout, a merge suffix or prefix, a
//! byte with no token, a normalizer other than none or NFC, a
//! pre-tokenizer other than a sequence of isolated regex splits and
//! byte-level mapping without a prefix space, a split pattern that can
//! match empty text or that uses look-around other than one top-level
//! `\s+(?!\S)` branch. The caller then keeps `tokenizers` for that file.
//!
//! Under NFC, text that is not ASCII is declined per call (NFC leaves
//! ASCII unchanged, and checking other text would need the normalization
//! tables), and the caller encodes that segment with `tokenizers`.
//!
//! # The look-ahead branch
//!
//! The split patterns of these families end in `\s+(?!\S)|\s+`, and a
//! finite automaton cannot run the look-ahead. The pattern is cut at that
//! branch into the branches before it and those after it, each run
//! anchored at a piece's start in order, with the branch itself decided
//! by hand between them: a whitespace run that reaches the end of the text
//! matches whole; one followed by other text matches without its last
//! character when that leaves at least one (the look-ahead then sees that
//! last whitespace character); a single character does not match. That is
//! what a backtracking engine does with the branch (greedy `\s+`, giving
//! back characters until the look-ahead holds), and `\s` is Unicode
//! `White_Space` in both the `regex` crate and [`char::is_whitespace`].
//!
//! Property tests compare the ids with the `tokenizers` crate on random
//! texts, and the template corpus (`scripts/template-corpus`) compares
//! them with Python's `tokenizers` on real models.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use ahash::AHashMap;
use regex_automata::util::pool::{Pool, PoolGuard};
use regex_automata::{Anchored, Input, meta};
use serde_json::Value;
use tokenizers::{ModelWrapper, Tokenizer};

use crate::added::AddedTokens;

/// The pattern of `ByteLevel`'s own split (`use_regex: true`), GPT-2's.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The one look-around the split patterns may use, as a whole branch.
const LOOKAHEAD_BRANCH: &str = r"\s+(?!\S)";

/// Makes a search cache for one regex.
type CacheFn = Box<dyn Fn() -> meta::Cache + Send + Sync>;

/// A regex with a pool of search caches (one is taken per encoded text,
/// not per piece: a thread other than a pool's first user pays a lock for
/// each take).
struct PooledRegex {
    regex: meta::Regex,
    caches: Pool<meta::Cache, CacheFn>,
}

impl PooledRegex {
    fn new(pattern: &str) -> Result<Self, String> {
        let hir = regex_automata::util::syntax::parse(pattern)
            .map_err(|e| format!("split pattern {pattern:?}: {e}"))?;
        let props = hir.properties();
        if props.minimum_len() == Some(0) || props.minimum_len().is_none() {
            return Err(format!("split pattern {pattern:?} can match empty text"));
        }
        if !props.look_set().is_empty() {
            return Err(format!("split pattern {pattern:?} has an assertion"));
        }
        let regex =
            meta::Regex::new(pattern).map_err(|e| format!("split pattern {pattern:?}: {e}"))?;
        let for_caches = regex.clone();
        let caches: Pool<meta::Cache, CacheFn> =
            Pool::new(Box::new(move || for_caches.create_cache()));
        Ok(Self { regex, caches })
    }
}

/// One `Split` of the pre-tokenizer.
enum PieceSplit {
    /// A pattern without look-around: the regex's own leftmost-first search.
    Plain(PooledRegex),
    /// A pattern with the `\s+(?!\S)` branch: the branches before it and
    /// after it (each `None` when there are none), tried anchored.
    Lookahead {
        before: Option<PooledRegex>,
        after: Option<PooledRegex>,
    },
}

/// The search caches of one split, held while one text is encoded.
struct SplitCaches<'a> {
    first: Option<PoolGuard<'a, meta::Cache, CacheFn>>,
    second: Option<PoolGuard<'a, meta::Cache, CacheFn>>,
}

impl PieceSplit {
    fn new(pattern: &str) -> Result<Self, String> {
        let branches = top_level_branches(pattern);
        let Some(at) = branches.iter().position(|b| *b == LOOKAHEAD_BRANCH) else {
            return PooledRegex::new(pattern).map(Self::Plain);
        };
        let part = |branches: &[&str]| -> Result<Option<PooledRegex>, String> {
            if branches.is_empty() {
                Ok(None)
            } else {
                PooledRegex::new(&branches.join("|")).map(Some)
            }
        };
        Ok(Self::Lookahead {
            before: part(&branches[..at])?,
            after: part(&branches[at + 1..])?,
        })
    }

    fn caches(&self) -> SplitCaches<'_> {
        match self {
            Self::Plain(regex) => SplitCaches {
                first: Some(regex.caches.get()),
                second: None,
            },
            Self::Lookahead { before, after } => SplitCaches {
                first: before.as_ref().map(|r| r.caches.get()),
                second: after.as_ref().map(|r| r.caches.get()),
            },
        }
    }

    /// The first match in `text` at or after `from`, as `tokenizers`'
    /// `find_iter` finds it.
    fn find(
        &self,
        caches: &mut SplitCaches<'_>,
        text: &str,
        from: usize,
    ) -> Option<(usize, usize)> {
        match self {
            Self::Plain(regex) => {
                let cache = caches.first.as_deref_mut()?;
                let input = Input::new(text).range(from..);
                regex
                    .regex
                    .search_with(cache, &input)
                    .map(|m| (m.start(), m.end()))
            }
            Self::Lookahead { before, after } => {
                // A backtracking engine tries each start in turn; the
                // patterns of real tokenizers match at nearly every one,
                // so this loop rarely moves.
                let mut at = from;
                while at < text.len() {
                    if let Some(end) = self.match_at(before, after, caches, text, at) {
                        return Some((at, end));
                    }
                    at += text[at..].chars().next().map_or(1, char::len_utf8);
                }
                None
            }
        }
    }

    /// The end of the match that starts at `at`, if one does.
    fn match_at(
        &self,
        before: &Option<PooledRegex>,
        after: &Option<PooledRegex>,
        caches: &mut SplitCaches<'_>,
        text: &str,
        at: usize,
    ) -> Option<usize> {
        let anchored =
            |regex: &Option<PooledRegex>, cache: Option<&mut meta::Cache>| -> Option<usize> {
                let (regex, cache) = (regex.as_ref()?, cache?);
                let input = Input::new(text).range(at..).anchored(Anchored::Yes);
                regex.regex.search_with(cache, &input).map(|m| m.end())
            };
        if let Some(end) = anchored(before, caches.first.as_deref_mut()) {
            return Some(end);
        }
        let mut run_end = at;
        let mut last_start = at;
        for (offset, c) in text[at..].char_indices() {
            if !c.is_whitespace() {
                break;
            }
            last_start = at + offset;
            run_end = last_start + c.len_utf8();
        }
        if run_end > at {
            if run_end == text.len() {
                return Some(run_end);
            }
            if last_start > at {
                return Some(last_start);
            }
        }
        anchored(after, caches.second.as_deref_mut())
    }
}

/// The top-level alternatives of a regex pattern: `|` outside groups and
/// classes, not escaped.
fn top_level_branches(pattern: &str) -> Vec<&str> {
    let bytes = pattern.as_bytes();
    let mut branches = Vec::new();
    let mut depth = 0usize;
    let mut class = 0usize;
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 1,
            b'[' => class += 1,
            b']' if class > 0 => class -= 1,
            b'(' if class == 0 => depth += 1,
            b')' if class == 0 => depth = depth.saturating_sub(1),
            b'|' if class == 0 && depth == 0 => {
                branches.push(&pattern[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    branches.push(&pattern[start..]);
    branches
}

/// A pair of adjacent symbols as a map key.
fn pair(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// One symbol of a piece being merged (`tokenizers`' `Symbol`): its id,
/// its neighbours' positions and its length in bytes (0 once merged away).
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: usize,
    next: usize,
    len: usize,
}

/// No neighbour.
const NONE: usize = usize::MAX;

/// Buffers reused across the pieces of one text.
#[derive(Default)]
struct Scratch {
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Reverse<(u32, usize, u32)>>,
}

/// The direct encoder of one byte-level BPE `tokenizer.json`.
pub(crate) struct Encoder {
    /// The tokens a piece that equals one is encoded to whole: every token
    /// with `ignore_merges`, otherwise those whose bytes merge back into
    /// the token itself.
    whole: AHashMap<Box<[u8]>, u32>,
    /// The id of each single byte.
    byte_ids: [u32; 256],
    /// `(left, right)` → `(rank, merged id)`, as `tokenizers` keeps them.
    merges: AHashMap<u64, (u32, u32)>,
    /// The pre-tokenizer's splits, applied in order.
    splits: Vec<PieceSplit>,
    /// The normalizer is NFC (otherwise it is the identity).
    nfc: bool,
    /// Added tokens with `normalized: true`, cut out of each segment.
    normalized_added: Option<AddedTokens>,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("whole", &self.whole.len())
            .field("merges", &self.merges.len())
            .field("splits", &self.splits.len())
            .field("nfc", &self.nfc)
            .finish_non_exhaustive()
    }
}

impl Encoder {
    /// The direct encoder of `tokenizer`, or why it cannot give the same
    /// ids (see the module docs).
    pub(crate) fn for_tokenizer(tokenizer: &Tokenizer) -> Result<Self, String> {
        let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
            return Err("the model is not BPE".to_owned());
        };
        let model = serde_json::to_value(bpe).map_err(|e| e.to_string())?;
        let nfc = match tokenizer.get_normalizer() {
            None => false,
            Some(normalizer) => {
                let json = serde_json::to_value(normalizer).map_err(|e| e.to_string())?;
                match json["type"].as_str() {
                    Some("NFC") => true,
                    Some("Sequence")
                        if json["normalizers"].as_array().is_some_and(Vec::is_empty) =>
                    {
                        false
                    }
                    _ => return Err(format!("normalizer {json}")),
                }
            }
        };
        let pre = tokenizer
            .get_pre_tokenizer()
            .ok_or("no pre-tokenizer (not byte-level)")?;
        let pre = serde_json::to_value(pre).map_err(|e| e.to_string())?;
        let splits = splits_of(&pre)?;
        let (tokens, ignore_merges, byte_ids, merges) = model_of(&model)?;
        let normalized: Vec<(String, u32)> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.normalized)
            .map(|(id, token)| (token.content, id))
            .collect();
        let normalized_added = AddedTokens::new(&normalized)?;
        let mut encoder = Self {
            whole: AHashMap::new(),
            byte_ids,
            merges,
            splits,
            nfc,
            normalized_added,
        };
        encoder.whole = if ignore_merges {
            tokens
        } else {
            let mut scratch = Scratch::default();
            let mut ids = Vec::new();
            tokens
                .into_iter()
                .filter(|(bytes, id)| {
                    ids.clear();
                    encoder.encode_piece(bytes, &mut scratch, &mut ids);
                    ids == [*id]
                })
                .collect()
        };
        Ok(encoder)
    }

    /// Appends the ids of `text` (a segment: no added token with
    /// `normalized: false` in it) to `out` and returns true; returns false,
    /// with `out` untouched, when the text needs a normalization this
    /// encoder does not do (non-ASCII text under NFC).
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) -> bool {
        if self.nfc && !text.is_ascii() {
            return false;
        }
        let mut caches: Vec<SplitCaches<'_>> = self.splits.iter().map(PieceSplit::caches).collect();
        let mut scratch = Scratch::default();
        let mut at = 0;
        if let Some(added) = &self.normalized_added {
            for found in added.find_iter(text) {
                self.split_from(0, &mut caches, &text[at..found.start], &mut scratch, out);
                out.push(found.id);
                at = found.end;
            }
        }
        self.split_from(0, &mut caches, &text[at..], &mut scratch, out);
        true
    }

    /// Pre-tokenizes `text` with the splits from `level` on, and encodes
    /// each final piece.
    fn split_from(
        &self,
        level: usize,
        caches: &mut [SplitCaches<'_>],
        text: &str,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) {
        if text.is_empty() {
            return;
        }
        let Some(split) = self.splits.get(level) else {
            self.encode_piece(text.as_bytes(), scratch, out);
            return;
        };
        let mut at = 0;
        while at < text.len() {
            let Some((start, end)) = split.find(&mut caches[level], text, at) else {
                break;
            };
            if start > at {
                self.split_from(level + 1, caches, &text[at..start], scratch, out);
            }
            self.split_from(level + 1, caches, &text[start..end], scratch, out);
            at = end;
        }
        if at < text.len() {
            self.split_from(level + 1, caches, &text[at..], scratch, out);
        }
    }

    fn encode_piece(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        if let Some(&id) = self.whole.get(piece) {
            out.push(id);
            return;
        }
        match piece {
            [] => {}
            [b] => out.push(self.byte_ids[usize::from(*b)]),
            _ => self.merge(piece, scratch, out),
        }
    }

    /// `tokenizers`' `Word::merge_all`, on the piece's bytes: a heap of
    /// candidate pairs ordered by rank then position; an entry whose pair
    /// no longer merges into the id it was pushed with is skipped; each
    /// merge pushes the pairs it forms with its neighbours. Kept to the
    /// letter (including which stale entries still pass), so that the ids
    /// are the same where merge lists hold several ways to one token.
    fn merge(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let Scratch { symbols, heap } = scratch;
        symbols.clear();
        heap.clear();
        let n = piece.len();
        symbols.extend(piece.iter().enumerate().map(|(i, &b)| Symbol {
            id: self.byte_ids[usize::from(b)],
            prev: if i == 0 { NONE } else { i - 1 },
            next: if i + 1 == n { NONE } else { i + 1 },
            len: 1,
        }));
        for i in 0..n - 1 {
            if let Some(&(rank, id)) = self.merges.get(&pair(symbols[i].id, symbols[i + 1].id)) {
                heap.push(Reverse((rank, i, id)));
            }
        }
        while let Some(Reverse((_, pos, new_id))) = heap.pop() {
            let current = symbols[pos];
            if current.len == 0 || current.next == NONE {
                continue;
            }
            let right = symbols[current.next];
            if self
                .merges
                .get(&pair(current.id, right.id))
                .is_none_or(|&(_, id)| id != new_id)
            {
                continue;
            }
            symbols[pos].id = new_id;
            symbols[pos].len += right.len;
            symbols[pos].next = right.next;
            symbols[current.next].len = 0;
            if right.next != NONE {
                symbols[right.next].prev = pos;
            }
            let merged = symbols[pos];
            if merged.prev != NONE
                && let Some(&(rank, id)) = self.merges.get(&pair(symbols[merged.prev].id, new_id))
            {
                heap.push(Reverse((rank, merged.prev, id)));
            }
            if merged.next != NONE
                && let Some(&(rank, id)) = self.merges.get(&pair(new_id, symbols[merged.next].id))
            {
                heap.push(Reverse((rank, pos, id)));
            }
        }
        out.extend(symbols.iter().filter(|s| s.len != 0).map(|s| s.id));
    }
}

/// The splits of a serialized pre-tokenizer (see the module docs).
fn splits_of(pre: &Value) -> Result<Vec<PieceSplit>, String> {
    let steps: Vec<&Value> = match pre["type"].as_str() {
        Some("Sequence") => pre["pretokenizers"]
            .as_array()
            .ok_or("pre-tokenizer sequence without steps")?
            .iter()
            .collect(),
        _ => vec![pre],
    };
    let Some((last, splits)) = steps.split_last() else {
        return Err("empty pre-tokenizer sequence".to_owned());
    };
    if last["type"].as_str() != Some("ByteLevel") {
        return Err(format!(
            "pre-tokenizer ends with {}, not ByteLevel",
            last["type"]
        ));
    }
    if last["add_prefix_space"].as_bool() != Some(false) {
        return Err("ByteLevel adds a prefix space".to_owned());
    }
    let mut out = Vec::with_capacity(splits.len() + 1);
    for split in splits {
        if split["type"].as_str() != Some("Split")
            || split["behavior"].as_str() != Some("Isolated")
            || split["invert"].as_bool() != Some(false)
        {
            return Err(format!("pre-tokenizer step {split}"));
        }
        let pattern = split["pattern"]["Regex"]
            .as_str()
            .ok_or_else(|| format!("split pattern {} is not a regex", split["pattern"]))?;
        out.push(PieceSplit::new(pattern)?);
    }
    if last["use_regex"].as_bool() != Some(false) {
        out.push(PieceSplit::new(GPT2_PATTERN)?);
    }
    Ok(out)
}

/// The model's token bytes, `ignore_merges`, byte ids and merge map.
type Model = (
    AHashMap<Box<[u8]>, u32>,
    bool,
    [u32; 256],
    AHashMap<u64, (u32, u32)>,
);

/// Reads a serialized BPE model (see the module docs for what it refuses).
fn model_of(model: &Value) -> Result<Model, String> {
    if !model["dropout"].is_null() {
        return Err("BPE dropout".to_owned());
    }
    for affix in ["continuing_subword_prefix", "end_of_word_suffix"] {
        if model[affix].as_str().is_some_and(|s| !s.is_empty()) {
            return Err(format!("BPE {affix}"));
        }
    }
    let ignore_merges = model["ignore_merges"].as_bool().unwrap_or(false);
    let vocab = model["vocab"]
        .as_object()
        .ok_or("BPE without a vocabulary")?;
    let mut from_char: AHashMap<char, u8> = AHashMap::with_capacity(256);
    for (b, c) in crate::tiktoken::byte_chars().into_iter().enumerate() {
        from_char.insert(c, b as u8);
    }
    let mut tokens: AHashMap<Box<[u8]>, u32> = AHashMap::with_capacity(vocab.len());
    let mut by_string: AHashMap<&str, u32> = AHashMap::with_capacity(vocab.len());
    for (token, id) in vocab {
        let id = id
            .as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or("BPE id out of range")?;
        by_string.insert(token.as_str(), id);
        // A token with a character outside the byte table can never come
        // out of byte-level text (it stays reachable only as an added
        // token, which is cut out before the model runs).
        let bytes: Option<Box<[u8]>> = token.chars().map(|c| from_char.get(&c).copied()).collect();
        if let Some(bytes) = bytes {
            tokens.insert(bytes, id);
        }
    }
    let mut byte_ids = [0u32; 256];
    for (b, slot) in byte_ids.iter_mut().enumerate() {
        *slot = *tokens
            .get(&[b as u8][..])
            .ok_or_else(|| format!("byte {b:#04x} has no token"))?;
    }
    let list = model["merges"].as_array().ok_or("BPE without merges")?;
    let mut merges = AHashMap::with_capacity(list.len());
    for (rank, merge) in list.iter().enumerate() {
        let (left, right) = match merge {
            Value::Array(parts) if parts.len() == 2 => (parts[0].as_str(), parts[1].as_str()),
            _ => (None, None),
        };
        let (Some(left), Some(right)) = (left, right) else {
            return Err(format!("merge {rank} is not a pair"));
        };
        let id = |s: &str| by_string.get(s).copied();
        let merged = format!("{left}{right}");
        match (id(left), id(right), id(&merged)) {
            (Some(l), Some(r), Some(m)) => {
                let rank = u32::try_from(rank).map_err(|_| "too many merges")?;
                merges.insert(pair(l, r), (rank, m));
            }
            _ => return Err(format!("merge {rank} names a token the vocabulary lacks")),
        }
    }
    Ok((tokens, ignore_merges, byte_ids, merges))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn branches_split_outside_groups_and_classes() {
        assert_eq!(
            top_level_branches(r"(?i:'s|'t)|[^\r\n|]?\p{L}+|\|x|\s+(?!\S)|\s+"),
            vec![
                r"(?i:'s|'t)",
                r"[^\r\n|]?\p{L}+",
                r"\|x",
                r"\s+(?!\S)",
                r"\s+"
            ]
        );
    }

    #[test]
    fn patterns_that_match_empty_or_assert_are_declined() {
        assert!(PieceSplit::new(r"a*").is_err());
        assert!(PieceSplit::new(r"\bword").is_err());
        assert!(PieceSplit::new(r"x(?=y)").is_err());
        assert!(PieceSplit::new(GPT2_PATTERN).is_ok());
    }
}
