//! tiktoken-format vocabularies (`*.tiktoken`), as OpenAI's `o200k_base`
//! ships for gpt-oss. Text is encoded with tiktoken's own algorithm run
//! directly on the ranks (the o200k split, then lowest-rank merges); the
//! vocabulary and its special tokens are also loaded into a `tokenizers`
//! byte-level BPE, so that the rest of the crate (segment cache,
//! special-token splitting, id look-ups) applies as for `tokenizer.json`.
//! [`tokenizer_json`] writes the complete equivalent `tokenizers` pipeline
//! described below, merges included, for other tools.
//!
//! # The format
//!
//! One token per line: the token's bytes in standard base64, a space, its
//! rank. Ranks are the ids, and a lower rank merges first. Blank lines are
//! skipped.
//!
//! # The equivalent `tokenizers` pipeline
//!
//! * **Pre-tokenization**: the o200k split pattern ([`O200K_PATTERN`],
//!   `tiktoken_ext/openai_public.py`, `o200k_base`), then byte-level
//!   mapping (GPT-2's byte-to-character table, no prefix space).
//! * **Model**: BPE over the ranks. tiktoken merges the adjacent pair whose
//!   concatenation has the lowest rank; the equivalent merge list has, for
//!   every token of two or more bytes, each split of it into two tokens,
//!   ordered by the merged token's rank (and, among splits of one token, by
//!   the ranks of the left then right part — the order transformers'
//!   tiktoken converter uses). A piece that is itself a token is emitted
//!   whole (`ignore_merges`), as tiktoken does.
//! * **Special tokens**: gpt-oss's harmony set ([`HARMONY_SPECIAL_TOKENS`],
//!   tiktoken's `o200k_harmony`), placed right after the ranks: the first,
//!   `<|startoftext|>`, takes id `n` (the number of ranks: 199,998 for
//!   `o200k_base`, so every id is the published one) and the others keep
//!   their published offsets from it. A test vocabulary of 300 ranks thus
//!   gets `<|start|>` at 308.
//!
//! Ranks missing from the file (a gap) are filled with placeholder entries
//! that no text can produce, so ids stay aligned.

use std::collections::HashMap;

use crate::o200k_split::O200kSplit;
use ahash::AHashMap;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{
    AddedToken, Model, ModelWrapper, SplitDelimiterBehavior, Tokenizer, TokenizerBuilder,
    TokenizerImpl,
};

/// The o200k pre-tokenization pattern (`o200k_base` in tiktoken's
/// `tiktoken_ext/openai_public.py`; gpt-oss's `o200k_harmony` uses it too):
/// words with an optional leading non-letter and English contractions,
/// numbers of up to three digits, punctuation runs, newlines, spaces.
pub const O200K_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// The id `o200k_base` gives its first special token: the number of ranks.
pub const O200K_FIRST_SPECIAL_ID: u32 = 199_998;

/// gpt-oss's named special tokens with their published ids (tiktoken's
/// `o200k_harmony`, and the harmony format guide). Ids 200013 to 201087
/// that are not named here are `<|reserved_{id}|>`; 200018 is
/// `<|endofprompt|>` (kept from `o200k_base`; tiktoken's harmony table also
/// maps `<|reserved_200018|>` to it, which one id cannot carry here).
pub const HARMONY_SPECIAL_TOKENS: &[(&str, u32)] = &[
    ("<|startoftext|>", 199_998),
    ("<|endoftext|>", 199_999),
    ("<|return|>", 200_002),
    ("<|constrain|>", 200_003),
    ("<|channel|>", 200_005),
    ("<|start|>", 200_006),
    ("<|end|>", 200_007),
    ("<|message|>", 200_008),
    ("<|call|>", 200_012),
    ("<|endofprompt|>", 200_018),
];

/// The last id of the harmony special-token range.
pub const HARMONY_LAST_SPECIAL_ID: u32 = 201_087;

/// The special token with published id `id` (named, or reserved).
fn harmony_token(id: u32) -> String {
    match HARMONY_SPECIAL_TOKENS.iter().find(|(_, i)| *i == id) {
        Some((name, _)) => (*name).to_owned(),
        None => format!("<|reserved_{id}|>"),
    }
}

/// GPT-2's reversible byte-to-character table: printable Latin-1 bytes map
/// to themselves, the others to U+0100 onwards in byte order.
pub(crate) fn byte_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        table[usize::from(b)] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{FFFD}');
            next += 1;
            c
        };
    }
    table
}

/// Whether `path` names a tiktoken vocabulary (`*.tiktoken`).
pub(crate) fn is_tiktoken_path(path: &std::path::Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("tiktoken"))
}

/// Parses the ranks of a `.tiktoken` file: token bytes by rank.
pub(crate) fn parse_ranks(text: &str) -> Result<HashMap<Vec<u8>, u32>, String> {
    let mut ranks = HashMap::new();
    let mut taken = std::collections::HashSet::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        let (token, rank) = line
            .split_once(' ')
            .ok_or_else(|| format!("line {}: expected `<base64 token> <rank>`", n + 1))?;
        let bytes = STANDARD
            .decode(token)
            .map_err(|e| format!("line {}: token is not base64: {e}", n + 1))?;
        let rank: u32 = rank
            .trim()
            .parse()
            .map_err(|_| format!("line {}: rank is not an integer", n + 1))?;
        if bytes.is_empty() {
            return Err(format!("line {}: empty token", n + 1));
        }
        if rank >= O200K_FIRST_SPECIAL_ID {
            return Err(format!(
                "line {}: rank {rank} is not below {O200K_FIRST_SPECIAL_ID}",
                n + 1
            ));
        }
        if !taken.insert(rank) {
            return Err(format!("line {}: rank {rank} given twice", n + 1));
        }
        if ranks.insert(bytes, rank).is_some() {
            return Err(format!("line {}: token listed twice", n + 1));
        }
    }
    if ranks.is_empty() {
        return Err("no tokens".to_owned());
    }
    for b in 0..=255u8 {
        if !ranks.contains_key(&[b][..]) {
            return Err(format!(
                "byte {b:#04x} has no token (byte-level BPE needs all 256)"
            ));
        }
    }
    Ok(ranks)
}

/// The `tokenizers` pipeline type with every stage wrapped (what a
/// `tokenizer.json` describes).
pub(crate) type Impl = TokenizerImpl<
    ModelWrapper,
    NormalizerWrapper,
    PreTokenizerWrapper,
    PostProcessorWrapper,
    DecoderWrapper,
>;

/// The tiktoken-format text of a vocabulary given as (token bytes, rank)
/// pairs: one `base64(token) rank` line each, in the order given. What
/// [`PromptTokenizer::from_tiktoken`](crate::PromptTokenizer::from_tiktoken)
/// and `*.tiktoken` files take; for vocabularies held in memory, such as
/// the ranks another crate embeds.
pub fn format_ranks<B: AsRef<[u8]>>(ranks: impl IntoIterator<Item = (B, u32)>) -> String {
    let mut text = String::new();
    for (token, rank) in ranks {
        STANDARD.encode_string(token.as_ref(), &mut text);
        text.push(' ');
        text.push_str(&rank.to_string());
        text.push('\n');
    }
    text
}

/// Builds the tokenizer of a `.tiktoken` file's text (see the module docs)
/// and the direct [`Encoder`] over the same ranks, which encodes its text.
///
/// The `tokenizers` model is built without its merges unless `with_merges`:
/// the crate encodes with the [`Encoder`] and asks the `tokenizers` object
/// only for its vocabulary and added tokens; the merges (about a million
/// for `o200k_base`) are most of the load time.
pub(crate) fn load(text: &str, with_merges: bool) -> Result<(Tokenizer, Encoder), String> {
    let ranks = parse_ranks(text)?;
    let tokenizer = build_tokenizer(&ranks, with_merges)?;
    Ok((tokenizer, Encoder::new(ranks)?))
}

/// The `tokenizer.json` text of a tiktoken vocabulary: the `tokenizers`
/// pipeline described in the module docs (o200k split, byte-level BPE
/// with merges derived from the ranks, the harmony special tokens),
/// readable by the `tokenizers` crate and Hugging Face `transformers`.
/// Large: `o200k_base` gives about a million merges. The error says why
/// the text is not a tiktoken vocabulary (the line, for a malformed one).
pub fn tokenizer_json(tiktoken_text: &str) -> Result<String, String> {
    let ranks = parse_ranks(tiktoken_text)?;
    build_tokenizer(&ranks, true)?
        .to_string(false)
        .map_err(|e| format!("serializing: {e}"))
}

fn build_tokenizer(ranks: &HashMap<Vec<u8>, u32>, with_merges: bool) -> Result<Tokenizer, String> {
    let table = byte_chars();
    let to_chars =
        |bytes: &[u8]| -> String { bytes.iter().map(|&b| table[usize::from(b)]).collect() };
    let n = ranks.values().max().map_or(0, |max| max + 1);
    let mut vocab: AHashMap<String, u32> = AHashMap::with_capacity(n as usize);
    for (bytes, &rank) in ranks {
        vocab.insert(to_chars(bytes), rank);
    }
    if vocab.len() < n as usize {
        let taken: std::collections::HashSet<u32> = vocab.values().copied().collect();
        for rank in (0..n).filter(|r| !taken.contains(r)) {
            // Byte-level text has no spaces, so no piece can equal this.
            vocab.insert(format!("<unused rank {rank}>"), rank);
        }
    }
    // Every split of every token into two tokens, in tiktoken's priority.
    /// (merged rank, left rank, right rank, left bytes, right bytes)
    type Candidate<'a> = (u32, u32, u32, &'a [u8], &'a [u8]);
    let mut merges: Vec<Candidate<'_>> = Vec::new();
    for (bytes, &rank) in ranks.iter().filter(|_| with_merges) {
        for at in 1..bytes.len() {
            let (left, right) = bytes.split_at(at);
            if let (Some(&l), Some(&r)) = (ranks.get(left), ranks.get(right)) {
                merges.push((rank, l, r, left, right));
            }
        }
    }
    merges.sort_unstable_by_key(|&(rank, l, r, _, _)| (rank, l, r));
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .map(|(_, _, _, left, right)| (to_chars(left), to_chars(right)))
        .collect();
    let model = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(true)
        .build()
        .map_err(|e| format!("BPE model: {e}"))?;
    let split = Split::new(
        SplitPattern::Regex(O200K_PATTERN.to_owned()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| format!("o200k pattern: {e}"))?;
    let pre_tokenizer = PreTokenizerWrapper::Sequence(Sequence::new(vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
    ]));
    let mut tokenizer: Impl = TokenizerBuilder::new()
        .with_model(ModelWrapper::BPE(model))
        .with_normalizer(None)
        .with_pre_tokenizer(Some(pre_tokenizer))
        .with_post_processor(None)
        .with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())))
        .build()
        .map_err(|e| e.to_string())?;
    // Added in id order, each takes the next id after the ranks; one that
    // is also a rank would keep the rank's id instead, so refuse that.
    let specials: Vec<AddedToken> = (O200K_FIRST_SPECIAL_ID..=HARMONY_LAST_SPECIAL_ID)
        .map(|id| AddedToken::from(harmony_token(id), true))
        .collect();
    if let Some(clash) = specials.iter().find(|t| {
        tokenizer
            .get_model()
            .token_to_id(&to_chars(t.content.as_bytes()))
            .is_some()
    }) {
        return Err(format!("special token {} is also a rank", clash.content));
    }
    tokenizer.add_special_tokens(&specials);
    Ok(Tokenizer::from(tokenizer))
}

/// Pieces longer than this (in bytes) are merged with a heap, in
/// `O(n log n)`; shorter ones with tiktoken's scan for the lowest pair,
/// `O(n^2)` but faster at these sizes.
const SHORT_PIECE: usize = 128;

/// tiktoken's encoding, done directly on the ranks: the o200k split, then
/// for each piece its rank if it is a token, else byte-pair merges — the
/// adjacent pair whose concatenation has the lowest rank first, the
/// leftmost on ties — until no adjacent pair is a token.
///
/// The same ids as the `tokenizers` pipeline [`load`] builds (the tests
/// check both against tiktoken's own encoder on `o200k_base`), without its
/// per-piece offset bookkeeping and byte-to-character mapping: several
/// times faster.
pub(crate) struct Encoder {
    ranks: AHashMap<Vec<u8>, u32>,
    /// The rank of each single byte (every byte is a token).
    byte_ranks: [u32; 256],
    /// The o200k split (an ASCII matcher, then the pattern's regex).
    split: O200kSplit,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("ranks", &self.ranks.len())
            .finish_non_exhaustive()
    }
}

impl Encoder {
    /// `ranks` as [`parse_ranks`] returns them (all 256 bytes present).
    fn new(ranks: HashMap<Vec<u8>, u32>) -> Result<Self, String> {
        let mut byte_ranks = [0u32; 256];
        for (b, slot) in byte_ranks.iter_mut().enumerate() {
            *slot = ranks
                .get(&[b as u8][..])
                .copied()
                .ok_or_else(|| format!("byte {b:#04x} has no token"))?;
        }
        Ok(Self {
            ranks: ranks.into_iter().collect(),
            byte_ranks,
            split: O200kSplit::new()?,
        })
    }

    /// Appends the ids of `text` (no special tokens: the caller cuts them
    /// out first) to `out`: each piece of the o200k split (see
    /// [`O200kSplit::piece_end`]) its rank, or its merges.
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let bytes = text.as_bytes();
        let mut cache = None;
        let mut at = 0;
        while at < text.len() {
            // Every character starts a match of some branch, so a piece
            // starts where the previous one ended.
            let end = self.split.piece_end(&mut cache, text, at);
            self.encode_piece(&bytes[at..end], out);
            at = end;
        }
    }

    fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        if let Some(&rank) = self.ranks.get(piece) {
            out.push(rank);
        } else if piece.len() <= SHORT_PIECE {
            self.merge_short(piece, out);
        } else {
            self.merge_long(piece, out);
        }
    }

    fn rank(&self, bytes: &[u8]) -> u32 {
        self.ranks.get(bytes).copied().unwrap_or(u32::MAX)
    }

    /// The final part `bytes`: a token by construction (a byte, or a merge
    /// of two tokens into a token); its bytes one by one otherwise.
    fn push_part(&self, bytes: &[u8], out: &mut Vec<u32>) {
        match self.ranks.get(bytes) {
            Some(&rank) => out.push(rank),
            None => out.extend(bytes.iter().map(|&b| self.byte_ranks[usize::from(b)])),
        }
    }

    /// tiktoken's loop: `parts[i]` is where part `i` starts and the rank of
    /// part `i` joined with part `i + 1`; each round merges the lowest.
    /// On the stack: pieces here are at most [`SHORT_PIECE`] bytes.
    fn merge_short(&self, piece: &[u8], out: &mut Vec<u32>) {
        let n = piece.len();
        if !(2..=SHORT_PIECE).contains(&n) {
            out.extend(piece.iter().map(|&b| self.byte_ranks[usize::from(b)]));
            return;
        }
        let mut storage = [(0usize, u32::MAX); SHORT_PIECE + 1];
        for (i, part) in storage[..n - 1].iter_mut().enumerate() {
            *part = (i, self.rank(&piece[i..i + 2]));
        }
        storage[n - 1] = (n - 1, u32::MAX);
        storage[n] = (n, u32::MAX);
        let mut len = n + 1;
        // The rank of parts i and i + 1 joined, given the part boundaries.
        let joined = |parts: &[(usize, u32)], i: usize| -> u32 {
            if i + 3 < parts.len() {
                self.rank(&piece[parts[i].0..parts[i + 3].0])
            } else {
                u32::MAX
            }
        };
        loop {
            let parts = &mut storage[..len];
            let mut best = (u32::MAX, 0);
            for (i, &(_, rank)) in parts[..len - 1].iter().enumerate() {
                if rank < best.0 {
                    best = (rank, i);
                }
            }
            let (rank, i) = best;
            if rank == u32::MAX {
                break;
            }
            // Part i absorbs part i + 1: the pairs of i - 1 and i change.
            if i > 0 {
                parts[i - 1].1 = joined(parts, i - 1);
            }
            parts[i].1 = joined(parts, i);
            parts.copy_within(i + 2.., i + 1);
            len -= 1;
        }
        for pair in storage[..len].windows(2) {
            self.push_part(&piece[pair[0].0..pair[1].0], out);
        }
    }

    /// The same merges with a heap of candidate pairs, for long pieces.
    /// A part is named by its first byte; `end[i]` is where part `i` ends
    /// (the next part's start) and `prev[i]` the previous part's start.
    fn merge_long(&self, piece: &[u8], out: &mut Vec<u32>) {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let n = piece.len();
        let mut end: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        // (rank of the pair, left part's start, right part's end): the
        // heap's order is tiktoken's (lowest rank, then leftmost).
        let mut heap: BinaryHeap<Reverse<(u32, usize, usize)>> = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            let rank = self.rank(&piece[i..i + 2]);
            if rank != u32::MAX {
                heap.push(Reverse((rank, i, i + 2)));
            }
        }
        while let Some(Reverse((_, left, right_end))) = heap.pop() {
            // Stale unless both parts are as they were when it was pushed.
            let right = end[left];
            if !alive[left] || right >= n || end[right] != right_end {
                continue;
            }
            alive[right] = false;
            end[left] = right_end;
            if right_end < n {
                prev[right_end] = left;
                let rank = self.rank(&piece[left..end[right_end]]);
                if rank != u32::MAX {
                    heap.push(Reverse((rank, left, end[right_end])));
                }
            }
            if left > 0 {
                let before = prev[left];
                let rank = self.rank(&piece[before..right_end]);
                if rank != u32::MAX {
                    heap.push(Reverse((rank, before, right_end)));
                }
            }
        }
        let mut i = 0;
        while i < n {
            self.push_part(&piece[i..end[i]], out);
            i = end[i];
        }
    }
}

/// The id the loaded tokenizer gives the harmony special token whose
/// published id is `published`, for a vocabulary whose highest rank is
/// `ranks - 1`; `None` outside the harmony range.
pub fn harmony_special_id(published: u32, ranks: u32) -> Option<u32> {
    if !(O200K_FIRST_SPECIAL_ID..=HARMONY_LAST_SPECIAL_ID).contains(&published) {
        return None;
    }
    (published - O200K_FIRST_SPECIAL_ID).checked_add(ranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection_onto_printable_chars() {
        let table = byte_chars();
        let distinct: std::collections::HashSet<char> = table.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(table[usize::from(b' ')], 'Ġ');
        assert_eq!(table[usize::from(b'\n')], 'Ċ');
        assert_eq!(table[usize::from(b'a')], 'a');
        assert!(table.iter().all(|c| !c.is_whitespace()));
    }

    #[test]
    fn bad_files_are_refused_with_the_line() {
        assert!(parse_ranks("").unwrap_err().contains("no tokens"));
        assert!(parse_ranks("YQ==\n").unwrap_err().contains("line 1"));
        assert!(parse_ranks("!!!! 0\n").unwrap_err().contains("base64"));
        assert!(parse_ranks("YQ== x\n").unwrap_err().contains("integer"));
        assert!(parse_ranks("YQ== 0\n").unwrap_err().contains("byte 0x00"));
        assert!(
            parse_ranks("YQ== 0\nYQ== 1\n")
                .unwrap_err()
                .contains("twice")
        );
        assert!(
            parse_ranks("YQ== 0\nYg== 0\n")
                .unwrap_err()
                .contains("rank 0 given twice")
        );
        assert!(
            parse_ranks("YQ== 199998\n")
                .unwrap_err()
                .contains("not below")
        );
    }
}
