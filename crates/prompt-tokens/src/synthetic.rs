//! The synthetic tokenizer and chat rendering of `engine-sim`.
//!
//! A token is `chars_per_token` consecutive Unicode scalar values of the
//! whole prompt (the last may be shorter); its id is a stable 64-bit hash of
//! those characters folded to 32 bits, equal on every run and machine. The
//! chat rendering is `<|{role}|>\n{content}\n` per message (content as
//! vLLM passes it to a template of the `string` format: text parts joined
//! by `\n`, see [`messages`](crate::messages)), then `<|assistant|>\n`. This module is the one definition of
//! that rule: engine-sim's tests check they agree bit for bit.

use minijinja::value::Value;

use crate::error::{Error, Result};
use crate::messages::ContentFormat;

/// splitmix64's finaliser: cheap, stable and well mixed.
#[inline]
fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

const TOKEN_SEED: u64 = 0x5EED_0F70_CE4E_0001;

#[inline]
fn fold(hash: u64) -> u32 {
    // Truncation is the point: a 32-bit id from a 64-bit hash.
    (hash ^ (hash >> 32)) as u32
}

/// The number of synthetic tokens in `text`: `ceil(chars / chars_per_token)`
/// (a `chars_per_token` of 0 counts as 1).
pub fn synthetic_count(text: &str, chars_per_token: usize) -> usize {
    text.chars().count().div_ceil(chars_per_token.max(1))
}

/// Appends the synthetic token ids of `text` to `out`.
pub fn synthetic_tokenize_into(text: &str, chars_per_token: usize, out: &mut Vec<u32>) {
    let per = chars_per_token.max(1);
    if text.is_ascii() {
        tokenize_units(text.as_bytes(), per, out);
    } else {
        let chars: Vec<char> = text.chars().collect();
        tokenize_units(&chars, per, out);
    }
}

/// Tokens hashed side by side (see [`tokenize_units`]).
const LANES: usize = 4;

/// Tokens of `units` (bytes of ASCII text, or chars), `per` units each.
///
/// Each token's hash is a chain of dependent multiplications; the tokens
/// are independent, so four of them are hashed side by side (the processor
/// overlaps the four chains). The ids are those of the one-token-at-a-time
/// rule in the module docs.
fn tokenize_units<T: Copy + Into<u32>>(units: &[T], per: usize, out: &mut Vec<u32>) {
    out.reserve(units.len().div_ceil(per));
    let rest = if per == 4 {
        // The common setting, with the group size known to the compiler.
        let (groups, rest) = units.as_chunks::<{ LANES * 4 }>();
        for group in groups {
            hash_group(group, 4, out);
        }
        rest
    } else {
        let mut groups = units.chunks_exact(LANES * per);
        for group in &mut groups {
            hash_group(group, per, out);
        }
        groups.remainder()
    };
    for token in rest.chunks(per) {
        let hash = token.iter().fold(TOKEN_SEED, |hash, &unit| {
            mix64(hash ^ u64::from(unit.into()))
        });
        out.push(fold(hash));
    }
}

/// The ids of `LANES` consecutive tokens of `per` units each.
#[inline(always)]
fn hash_group<T: Copy + Into<u32>>(group: &[T], per: usize, out: &mut Vec<u32>) {
    let mut hashes = [TOKEN_SEED; LANES];
    for i in 0..per {
        for (lane, hash) in hashes.iter_mut().enumerate() {
            *hash = mix64(*hash ^ u64::from(group[lane * per + i].into()));
        }
    }
    out.extend(hashes.map(fold));
}

/// The synthetic token ids of `text`.
pub fn synthetic_tokenize(text: &str, chars_per_token: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(synthetic_count(text, chars_per_token));
    synthetic_tokenize_into(text, chars_per_token, &mut out);
    out
}

/// engine-sim's chat rendering of a `messages` JSON array.
///
/// Fails like engine-sim's request parsing does: `messages` not a list or
/// empty, a
/// message without a string `role`, `content` neither a string, a list of
/// part objects nor null, or a part's `text` not a string.
pub fn synthetic_chat_text(messages: &serde_json::Value) -> Result<String> {
    let value = Value::from_serialize(messages);
    render_value(&value)
}

pub(crate) fn render_value(messages: &Value) -> Result<String> {
    if messages.len() == Some(0) {
        return Err(Error::InvalidRequest("messages must not be empty".into()));
    }
    // vLLM's message preparation for a template that prints content as a
    // string: the same part types accepted, the same ones refused.
    let messages = crate::messages::prepare(messages, ContentFormat::String)?;
    let mut out = String::new();
    for message in messages.try_iter().into_iter().flatten() {
        out.push_str("<|");
        out.push_str(
            message
                .get_attr("role")
                .unwrap_or_default()
                .as_str()
                .unwrap_or(""),
        );
        out.push_str("|>\n");
        out.push_str(
            message
                .get_attr("content")
                .unwrap_or_default()
                .as_str()
                .unwrap_or(""),
        );
        out.push('\n');
    }
    out.push_str("<|assistant|>\n");
    Ok(out)
}
