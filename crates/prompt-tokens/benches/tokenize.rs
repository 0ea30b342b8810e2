//! Cold vs warm tokenization of a multi-turn chat: a ~2k-token system
//! prompt and 10 turns; the warm request is the previous conversation plus
//! one new user message (the routing hot path). Trained BPE tokenizer
//! (ChatML template, Llama 3-style byte-level pre-tokenizer) and the
//! synthetic one.

use std::hint::black_box;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
use prompt_tokens::{ChatRequest, PromptTokenizer, TemplateFamily, TokenizerOptions};
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

fn body(messages: &[Value]) -> Vec<u8> {
    json!({"model": "m", "messages": messages})
        .to_string()
        .into_bytes()
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    write_model_dir(
        dir.path(),
        TemplateFamily::ChatMl,
        TestTokenizerKind::ByteLevelRegex,
    )
    .expect("train");
    let mut history = conversation(10);
    let previous = body(&history);
    history.push(json!({"role": "user", "content": "And shipment 2042, is it on time?"}));
    let next = body(&history);

    let bpe = PromptTokenizer::from_path(dir.path(), None).expect("load");
    let request = ChatRequest::from_json(&next).expect("request");
    let tokens = bpe.chat_tokens(&request).expect("tokens").len();
    println!("bpe prompt: {tokens} tokens, {} bytes of body", next.len());

    let mut group = c.benchmark_group("chat_tokens");
    group.bench_function("bpe/cold (fresh cache)", |b| {
        b.iter_batched_ref(
            || {
                PromptTokenizer::from_path_with(dir.path(), None, TokenizerOptions::default())
                    .expect("load")
            },
            |fresh| black_box(fresh.chat_tokens(&request).expect("tokens")),
            BatchSize::PerIteration,
        )
    });
    group.bench_function(
        "bpe/warm (one new message, parse + render + tokenize)",
        |b| {
            let warm = PromptTokenizer::from_path(dir.path(), None).expect("load");
            warm.chat_tokens(&ChatRequest::from_json(&previous).expect("request"))
                .expect("tokens");
            b.iter(|| {
                let request = ChatRequest::from_json(black_box(&next)).expect("request");
                black_box(warm.chat_tokens(&request).expect("tokens"))
            })
        },
    );
    group.bench_function("bpe/render only", |b| {
        b.iter(|| black_box(bpe.chat_text(&request).expect("text")))
    });
    group.bench_function("bpe/uncached whole text", |b| {
        b.iter(|| black_box(bpe.chat_tokens_uncached(&request).expect("tokens")))
    });
    let synthetic = PromptTokenizer::synthetic(4);
    group.bench_function("synthetic/parse + render + tokenize", |b| {
        b.iter(|| {
            let request = ChatRequest::from_json(black_box(&next)).expect("request");
            black_box(synthetic.chat_tokens(&request).expect("tokens"))
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
