//! The tokenizer rule and the block hash chain.
//!
//! The synthetic tokenizer is [`prompt_tokens::synthetic`]'s, the one
//! implementation the router shares: a token is `chars_per_token`
//! consecutive Unicode scalar values (the last token may be shorter), so
//! `tokens(text) = ceil(chars(text) / chars_per_token)`, and a token's id
//! is a stable hash of its characters: equal text gives equal ids on every
//! run and every machine. The functions here are thin wrappers kept for
//! callers of engine-sim's API. An engine given a
//! [`PromptTokenizer`](prompt_tokens::PromptTokenizer) (see
//! [`ServeOptions::tokenizer`](crate::ServeOptions)) uses a model's template and
//! tokenizer instead.
//!
//! Block `i` of a prompt holds tokens `i*B .. (i+1)*B` and is identified by
//! `hash_i = H(hash_{i-1}, tokens of block i)` with `hash_{-1}` a constant,
//! so two prompts share block `i` exactly when they share every token up to
//! the end of block `i`. Only full blocks get a hash, as in vLLM. The chain
//! works on any token ids, whichever tokenizer produced them.

/// A 64-bit finaliser (splitmix64): cheap, stable and well mixed.
///
/// The same function as prompt-tokens' `synthetic::mix64`, which hashes
/// the token ids and is private to that crate; this copy hashes the block
/// chain below, engine-sim's own.
#[inline]
pub(crate) fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

const TOKEN_SEED: u64 = 0x5EED_0F70_CE4E_0001;
const BLOCK_SEED: u64 = 0xB10C_C4A1_0000_0001;

/// Number of synthetic tokens in `text`: `ceil(chars / chars_per_token)`.
/// A `chars_per_token` of 0 is treated as 1.
pub fn count_tokens(text: &str, chars_per_token: usize) -> usize {
    prompt_tokens::synthetic_count(text, chars_per_token)
}

/// Appends the synthetic token ids of `text` to `out`.
pub fn tokenize_into(text: &str, chars_per_token: usize, out: &mut Vec<u32>) {
    prompt_tokens::synthetic_tokenize_into(text, chars_per_token, out);
}

/// The synthetic token ids of `text`.
pub fn tokenize(text: &str, chars_per_token: usize) -> Vec<u32> {
    prompt_tokens::synthetic_tokenize(text, chars_per_token)
}

/// The hash chain of the full blocks of `tokens` (a trailing partial block
/// gets no hash). A `block_size` of 0 is treated as 1.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    block_hashes_after(None, tokens, block_size)
}

/// The hash chain of the full blocks of `tokens` continuing after the block
/// hashed `parent` (`None`: the start of a prompt, as [`block_hashes`]).
/// What a KV-event consumer checks a `BlockStored` against: its hashes are
/// `block_hashes_after(parent_block_hash, token_ids, block_size)`.
pub fn block_hashes_after(parent: Option<u64>, tokens: &[u32], block_size: usize) -> Vec<u64> {
    let size = block_size.max(1);
    let mut out = Vec::with_capacity(tokens.len() / size);
    let mut prev = parent.unwrap_or(BLOCK_SEED);
    for block in tokens.chunks_exact(size) {
        let mut hash = mix64(prev);
        for &token in block {
            hash = mix64(hash ^ u64::from(token));
        }
        out.push(hash);
        prev = hash;
    }
    out
}

/// A stable hash of a whole token sequence; seeds the generated text so the
/// same prompt gets the same answer whatever else the engine is doing.
pub fn sequence_hash(tokens: &[u32]) -> u64 {
    tokens
        .iter()
        .fold(TOKEN_SEED ^ tokens.len() as u64, |hash, &token| {
            mix64(hash ^ u64::from(token))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_is_ceil_of_chars() {
        assert_eq!(count_tokens("", 4), 0);
        assert_eq!(count_tokens("abcd", 4), 1);
        assert_eq!(count_tokens("abcde", 4), 2);
        assert_eq!(count_tokens("héllo wörld", 4), 3);
        assert_eq!(tokenize("héllo wörld", 4).len(), 3);
    }

    #[test]
    fn shared_prefix_shares_block_hashes() {
        let a = tokenize(&format!("{}{}", "x".repeat(64 * 4), "tail one"), 4);
        let b = tokenize(&format!("{}{}", "x".repeat(64 * 4), "other tail!!"), 4);
        let ha = block_hashes(&a, 16);
        let hb = block_hashes(&b, 16);
        assert_eq!(ha.len(), 4);
        assert_eq!(ha, hb);
        let c = tokenize(&format!("y{}", "x".repeat(64 * 4 - 1)), 4);
        let hc = block_hashes(&c, 16);
        assert!(ha.iter().zip(&hc).all(|(x, y)| x != y));
    }

    /// The rule as engine-sim defined it before prompt-tokens took it over:
    /// ids must not change (cached traces and tests depend on them).
    fn reference(text: &str, per: usize) -> Vec<u32> {
        let per = per.max(1);
        let chars: Vec<char> = text.chars().collect();
        chars
            .chunks(per)
            .map(|chunk| {
                let hash = chunk
                    .iter()
                    .fold(TOKEN_SEED, |h, &c| mix64(h ^ u64::from(c)));
                (hash ^ (hash >> 32)) as u32
            })
            .collect()
    }

    proptest::proptest! {
        #[test]
        fn ids_are_the_original_rule(text in "\\PC{0,64}", per in 0usize..7) {
            proptest::prop_assert_eq!(tokenize(&text, per), reference(&text, per));
            proptest::prop_assert_eq!(count_tokens(&text, per), reference(&text, per).len());
        }
    }
}
