//! What reading a tokenized chat costs the router, one path at a time: for
//! instruction counts (callgrind) or timings of `Tokenizers::extract` on
//! the overhead example's multi-turn chats, o200k_base and the harmony
//! template, the segment cache warm.
//!
//! `--path once` is the router's `Tokenizers::extract`, which reads a chat
//! in one parse (`tokens::once`); `--path two` is what it did before, with
//! the same public calls: `extract_deferred`, then
//! `ChatRequest::from_json` and `chat_tokens`. `--path fallback` is
//! `Tokenizers::extract` on the same chats with `"prompt": ""` added last,
//! a field of another route that makes the one parse give up at the end
//! of the body and leave it to the two parses: the worst case of a body
//! the one parse does not read.
//!
//! ```sh
//! cargo build --release -p router-http --example extract_cost
//! valgrind --tool=callgrind --collect-atstart=no \
//!     --toggle-collect='extract_cost::read' \
//!     target/release/examples/extract_cost --bytes 8192 --path once --loop 200
//! ```
//! `Collected` is the instruction count; the difference between runs of
//! `--loop 100` and `--loop 300` divided by 200 is one warm request's.
//! Without valgrind it prints the mean time per request.

use std::sync::Arc;
use std::time::Instant;

use prompt_tokens::{ChatRequest, PromptTokenizer};
use router_http::extract::{ApiKind, RoutingInputBuf};
use router_http::tokens::Tokenizers;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// A multi-turn chat of about `bytes` bytes whose last message carries `n`.
fn chat(bytes: usize, n: usize, two: bool) -> Vec<u8> {
    let mut messages = vec![serde_json::json!({"role": "system",
        "content": "You are a helpful assistant for an operations team."})];
    let mut turn = 0;
    while serde_json::to_vec(&messages).map_or(0, |v| v.len()) + 400 < bytes {
        messages.push(serde_json::json!({"role": "user", "content": format!(
            "Turn {turn}: the p99 latency of engine {} rose to {} ms after the deploy; \
             is its cache cold?", turn % 4, 180 + turn * 7)}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!(
            "Probably: engine {} restarted at 10:{:02} and has served few repeated \
             prefixes since.", turn % 4, turn % 60)}));
        turn += 1;
    }
    messages.push(serde_json::json!({"role": "user",
        "content": format!("Question {n}: which engine served it?")}));
    let mut body = serde_json::json!({"model": "m", "messages": messages, "max_tokens": 16});
    if two {
        body["prompt"] = serde_json::json!("");
    }
    serde_json::to_vec(&body).unwrap_or_default()
}

fn main() {
    let bytes: usize = arg("--bytes").and_then(|b| b.parse().ok()).unwrap_or(8192);
    let count: usize = arg("--loop").and_then(|n| n.parse().ok()).unwrap_or(2000);
    let path = arg("--path").unwrap_or_else(|| "once".into());
    let two = path == "fallback";
    let bpe = tiktoken_rs::o200k_base().expect("tiktoken-rs o200k_base");
    let ranks = prompt_tokens::tiktoken::format_ranks(
        (0..prompt_tokens::tiktoken::O200K_FIRST_SPECIAL_ID)
            .map(|rank| (bpe.decode_bytes(&[rank]).expect("rank"), rank)),
    );
    let config = prompt_tokens::TokenizerConfig {
        chat_template: Some(prompt_tokens::templates::HARMONY.to_owned()),
        ..prompt_tokens::TokenizerConfig::default()
    };
    let tokenizer =
        PromptTokenizer::from_tiktoken(&ranks, config, prompt_tokens::TokenizerOptions::default())
            .expect("o200k tokenizer");
    let tokenizer = Arc::new(tokenizer);
    let tokenizers = Tokenizers::default().with_default(tokenizer.clone());
    let one_parse = path != "two";
    // Warm the segment cache with the conversation's history.
    let warm = chat(bytes, 0, two);
    let routing = read(&tokenizers, &tokenizer, one_parse, &warm);
    assert!(routing.tokens().is_some(), "routes on tokens");
    let bodies: Vec<Vec<u8>> = (1..=count).map(|n| chat(bytes, n, two)).collect();
    let started = Instant::now();
    let mut ids = 0;
    for body in &bodies {
        let routing = read(&tokenizers, &tokenizer, one_parse, body);
        ids += routing.tokens().map_or(0, <[u32]>::len);
    }
    let per = started.elapsed() / u32::try_from(count).unwrap_or(u32::MAX);
    println!(
        "{} B body, {path}: {:.1} µs per request ({} ids each)",
        warm.len(),
        per.as_secs_f64() * 1e6,
        ids / count
    );
}

/// One chat's routing input, by the router's path or the two parses.
#[inline(never)]
fn read(
    tokenizers: &Tokenizers,
    tokenizer: &PromptTokenizer,
    one_parse: bool,
    body: &[u8],
) -> RoutingInputBuf {
    if one_parse {
        let info = tokenizers
            .extract(ApiKind::ChatCompletions, body)
            .expect("a valid chat");
        return info.routing;
    }
    let extracted =
        router_http::extract_deferred(ApiKind::ChatCompletions, body).expect("a valid chat");
    let ids = ChatRequest::from_json(body).and_then(|request| tokenizer.chat_tokens(&request));
    match ids {
        Ok(ids) => RoutingInputBuf::Tokens(ids),
        Err(_) => extracted.into_info().routing,
    }
}
