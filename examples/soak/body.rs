//! Random numbers and request bodies

use std::fmt::Write as _;
use std::io::Write as _;

use bytes::Bytes;

/// SplitMix64 (Steele, Lea and Flood), radix-affinity's: one add and three
/// multiply-xorshift steps per number, plenty for making prompts distinct.
pub(super) use radix_affinity::workload::SplitMix64;

/// Plain English-like filler, ASCII without quotes or backslashes, so it is
/// valid inside a JSON string as it is.
const FILLER_WORDS: &[&str] = &[
    "the",
    "router",
    "keeps",
    "each",
    "prompt",
    "prefix",
    "where",
    "its",
    "cache",
    "lives",
    "and",
    "a",
    "busy",
    "fleet",
    "sees",
    "many",
    "distinct",
    "users",
    "asking",
    "about",
    "memory",
    "budgets",
    "latency",
    "tails",
    "eviction",
    "of",
    "old",
    "entries",
    "under",
    "load",
    "while",
    "new",
    "requests",
    "arrive",
    "every",
    "millisecond",
    "from",
    "agents",
    "with",
    "long",
];

/// `len` bytes of filler text, deterministic.
fn filler(len: usize, seed: u64) -> String {
    let mut rng = SplitMix64(seed);
    let mut text = String::with_capacity(len + 16);
    while text.len() < len {
        let word = FILLER_WORDS[(rng.next_u64() % FILLER_WORDS.len() as u64) as usize];
        text.push_str(word);
        text.push(' ');
    }
    text.truncate(len);
    text
}

/// A chat completion body with a hole for the number that makes it unique:
/// `head` + decimal number + `tail`.
pub(super) struct BodyTemplate {
    head: Vec<u8>,
    tail: Vec<u8>,
}

impl BodyTemplate {
    pub(super) fn new(
        model: &str,
        max_tokens: u32,
        system_bytes: usize,
        prompt_bytes: usize,
    ) -> Self {
        let mut head = format!(r#"{{"model":"{model}","max_tokens":{max_tokens},"messages":["#);
        if system_bytes > 0 {
            let system = filler(system_bytes, 0x5157);
            let _ = write!(head, r#"{{"role":"system","content":"{system}"}},"#);
        }
        head.push_str(r#"{"role":"user","content":""#);
        let text = filler(prompt_bytes, 0x7e57);
        let tail = format!(r#" {text}"}}]}}"#);
        Self {
            head: head.into_bytes(),
            tail: tail.into_bytes(),
        }
    }

    /// The body for `number`, in one allocation.
    pub(super) fn body(&self, number: u64) -> Bytes {
        let mut out = Vec::with_capacity(self.head.len() + 20 + self.tail.len());
        out.extend_from_slice(&self.head);
        let _ = write!(out, "{number}");
        out.extend_from_slice(&self.tail);
        Bytes::from(out)
    }
}
