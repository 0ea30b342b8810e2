//! The router's warm chat path on a real vocabulary, in a loop small enough
//! for `valgrind --tool=callgrind`: a 1 KB harmony chat of six messages
//! (system prompt, two earlier turns, a new question) whose last message is
//! new on every request, from the body bytes, with `o200k_base` (the ranks
//! `tiktoken-rs` embeds) and the crate's harmony template.
//!
//! ```sh
//! cargo run --release -p prompt-tokens --example harmony_warm -- tokens 100000
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='harmony_warm::run' \
//!     target/release/examples/harmony_warm tokens 2000
//! ```
//!
//! Modes: `parse` (the body only), `render` (parse and render), `tokens`
//! (parse, render and tokenize: what the router does per request). Prints
//! microseconds per request; callgrind's total over the iterations gives
//! instructions per request.

use std::hint::black_box;
use std::time::Instant;

use prompt_tokens::{ChatRequest, PromptTokenizer, TokenizerConfig, TokenizerOptions, templates};

/// Where the request number goes: every request's question is new.
const SERIAL: &[u8] = b"#000000000";

const BODY: &str = r#"{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant for an operations team. You answer questions about request routing, caches and engines. Be terse and precise; give numbers with their units, and say when a figure is an estimate rather than a measurement. Prefer short lists."},{"role":"user","content":"Turn 0: the p99 latency of engine 2 rose to 180 ms after the deploy; is its cache cold? It served 40% of the traffic yesterday."},{"role":"assistant","content":"Probably: engine 2 restarted at 10:04 and has served few repeated prefixes since, so most requests pay a full prefill."},{"role":"user","content":"Turn 1: the p99 latency of engine 3 rose to 187 ms after the deploy; is its cache cold?"},{"role":"assistant","content":"Probably: engine 3 restarted at 10:05 and has served few repeated prefixes since."},{"role":"user","content":"Question #000000000 from pool 3: which engine served the request with the longest shared prefix, how many tokens matched, and would the answer change under twice the load? Answer in two lines."}],"max_tokens":16,"stream":false}"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "tokens".to_owned());
    let iterations: usize = args
        .next()
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(100_000);
    if !["parse", "render", "tokens"].contains(&mode.as_str()) {
        return Err(format!("mode {mode}: expected parse, render or tokens").into());
    }
    let bpe = tiktoken_rs::o200k_base()?;
    let ranks = prompt_tokens::tiktoken::format_ranks(
        (0..prompt_tokens::tiktoken::O200K_FIRST_SPECIAL_ID)
            .map(|rank| (bpe.decode_bytes(&[rank]).expect("rank"), rank)),
    );
    let config = TokenizerConfig {
        chat_template: Some(templates::HARMONY.to_owned()),
        ..TokenizerConfig::default()
    };
    let tokenizer = PromptTokenizer::from_tiktoken(&ranks, config, TokenizerOptions::default())?;
    let mut body = BODY.as_bytes().to_vec();
    let at = body
        .windows(SERIAL.len())
        .position(|w| w == SERIAL)
        .ok_or("no serial in the body")?;
    // Warm: the earlier messages' segments cached.
    run(&tokenizer, &mode, 100, &mut body, at, 0);
    let started = Instant::now();
    let total = run(&tokenizer, &mode, iterations, &mut body, at, 100);
    let us = started.elapsed().as_secs_f64() * 1e6 / iterations as f64;
    println!(
        "{{\"mode\":\"{mode}\",\"body_bytes\":{},\"us_per_request\":{us:.2},\"checksum\":{total}}}",
        body.len()
    );
    Ok(())
}

/// `iterations` requests, numbered from `first`; a sum of the output sizes
/// so nothing is optimized away.
#[inline(never)]
fn run(
    tokenizer: &PromptTokenizer,
    mode: &str,
    iterations: usize,
    body: &mut [u8],
    at: usize,
    first: usize,
) -> usize {
    let mut total = 0;
    for i in first..first + iterations {
        body[at..at + SERIAL.len()].copy_from_slice(format!("#{i:09}").as_bytes());
        let request = ChatRequest::from_json(black_box(&*body)).expect("the body parses");
        total += match mode {
            "parse" => request.message_count().unwrap_or(0),
            "render" => tokenizer.chat_text(&request).expect("renders").len(),
            _ => tokenizer.chat_tokens(&request).expect("tokenizes").len(),
        };
    }
    total
}
