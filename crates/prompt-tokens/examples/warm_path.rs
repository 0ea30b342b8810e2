//! Runs the warm multi-turn case of `benches/tokenize.rs` many times and
//! prints one JSON line: a loop small enough to profile under
//! `valgrind --tool=callgrind`, and a quick timing without criterion.
//!
//! `cargo run -p prompt-tokens --release --example warm_path -- [ITERATIONS] [bpe|synthetic|render]`
//!
//! `render` times the chat template alone (the request parsed once).

use std::hint::black_box;
use std::time::Instant;

use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
use prompt_tokens::{ChatRequest, PromptTokenizer, TemplateFamily};
use serde_json::{Value, json};

fn conversation(turns: usize) -> Vec<Value> {
    let system = "You are a careful assistant for a logistics company. Answer with the facts \
                  you are given, cite the document and section, and say so when unsure. "
        .repeat(40);
    let mut messages = vec![json!({"role": "system", "content": system})];
    for turn in 0..turns {
        messages.push(json!({"role": "user", "content": format!(
            "Turn {turn}: where is shipment {} now, and when will it reach the depot in Lyon?",
            1000 + turn)}));
        messages.push(json!({"role": "assistant", "content": format!(
            "Shipment {} left Marseille at 0{}:00 and should reach Lyon tomorrow morning.",
            1000 + turn, turn % 10)}));
    }
    messages
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let iterations: u32 = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(20_000);
    let mode = args.next().unwrap_or_else(|| "bpe".to_owned());
    let dir = tempfile::tempdir()?;
    let tokenizer = if mode == "synthetic" {
        PromptTokenizer::synthetic(4)
    } else {
        write_model_dir(
            dir.path(),
            TemplateFamily::ChatMl,
            TestTokenizerKind::ByteLevelRegex,
        )?;
        PromptTokenizer::from_path(dir.path(), None)?
    };
    let mut history = conversation(10);
    let previous = json!({"model": "m", "messages": history}).to_string();
    history.push(json!({"role": "user", "content": "And shipment 2042, is it on time?"}));
    let next = json!({"model": "m", "messages": history}).to_string();
    tokenizer.chat_tokens(&ChatRequest::from_json(previous.as_bytes())?)?;
    let tokens = tokenizer
        .chat_tokens(&ChatRequest::from_json(next.as_bytes())?)?
        .len();
    let parsed = ChatRequest::from_json(next.as_bytes())?;
    let start = Instant::now();
    for _ in 0..iterations {
        if mode == "render" {
            black_box(tokenizer.chat_text(black_box(&parsed))?);
            continue;
        }
        let request = ChatRequest::from_json(black_box(next.as_bytes()))?;
        black_box(tokenizer.chat_tokens(&request)?);
    }
    let elapsed = start.elapsed();
    println!(
        "{{\"mode\": \"{mode}\", \"iterations\": {iterations}, \"tokens\": {tokens}, \"body_bytes\": {}, \"mean_us\": {:.2}}}",
        next.len(),
        elapsed.as_secs_f64() * 1e6 / f64::from(iterations.max(1))
    );
    Ok(())
}
