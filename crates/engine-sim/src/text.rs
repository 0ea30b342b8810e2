//! Deterministic output text: token `i` of a request is a word chosen by
//! `mix(seed, prompt hash, i)`, so the same prompt, seed and `max_tokens`
//! always produce the same answer.

use crate::tokens::mix64;

const WORDS: [&str; 32] = [
    " the", " engine", " routes", " tokens", " to", " a", " cache", " that", " keeps", " prefix",
    " blocks", " warm", " while", " decode", " streams", " each", " reply", " with", " care",
    " and", " every", " request", " finds", " its", " worker", " quickly", " under", " load",
    " so", " latency", " stays", " low",
];

/// The text of output token `index` for a prompt with hash `prompt_hash`.
pub fn output_token(seed: u64, prompt_hash: u64, index: u32) -> &'static str {
    let draw = mix64(seed ^ mix64(prompt_hash ^ u64::from(index)));
    WORDS[(draw % WORDS.len() as u64) as usize]
}

/// The whole output text of `tokens` tokens.
pub fn output_text(seed: u64, prompt_hash: u64, tokens: u32) -> String {
    let mut out = String::with_capacity(tokens as usize * 7);
    for i in 0..tokens {
        out.push_str(output_token(seed, prompt_hash, i));
    }
    out
}
