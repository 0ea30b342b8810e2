//! tiktoken-format vocabularies (`*.tiktoken`), as OpenAI's `o200k_base`
//! ships for gpt-oss, loaded into a `tokenizers` byte-level BPE so that the
//! rest of the crate (segment cache, special-token splitting) applies.
//!
//! # The format
//!
//! One token per line: the token's bytes in standard base64, a space, its
//! rank. Ranks are the ids, and a lower rank merges first. Blank lines are
//! skipped.
//!
//! # How it becomes a `tokenizers` pipeline
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
fn byte_chars() -> [char; 256] {
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

type Impl = TokenizerImpl<
    ModelWrapper,
    NormalizerWrapper,
    PreTokenizerWrapper,
    PostProcessorWrapper,
    DecoderWrapper,
>;

/// Builds the tokenizer of a `.tiktoken` file's text (see the module docs).
pub(crate) fn load(text: &str) -> Result<Tokenizer, String> {
    let ranks = parse_ranks(text)?;
    let table = byte_chars();
    let to_chars =
        |bytes: &[u8]| -> String { bytes.iter().map(|&b| table[usize::from(b)]).collect() };
    let n = ranks.values().max().map_or(0, |max| max + 1);
    let mut vocab: AHashMap<String, u32> = AHashMap::with_capacity(n as usize);
    for (bytes, &rank) in &ranks {
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
    for (bytes, &rank) in &ranks {
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
