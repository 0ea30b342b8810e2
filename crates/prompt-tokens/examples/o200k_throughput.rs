//! Encoding throughput on the real `o200k_base` vocabulary (as the
//! `tiktoken-rs` crate embeds it: no download), on the same texts, of:
//!
//! * `prompt-tokens`: `PromptTokenizer::from_tiktoken(..).text_tokens`
//!   (tiktoken's algorithm on the ranks, special tokens cut out first);
//! * `tokenizers`: the `tokenizers` crate's own `encode_fast` of the same
//!   vocabulary as a `tokenizer.json` (`prompt_tokens::tiktoken::tokenizer_json`:
//!   o200k split, byte-level BPE with merges derived from the ranks) — the
//!   pipeline prompt-tokens used for `.tiktoken` files before;
//! * `tiktoken-rs`: its `CoreBPE::encode_ordinary` (OpenAI's tiktoken core).
//!
//! Texts: English-like prose and code/JSON, 200 B, 1 KB and 16 KB. The ids
//! of the three are checked equal before timing. Each figure is the median
//! of `--rounds` rounds (default 7) of about 0.2 s each, one thread.
//!
//! Then `chat`: a 1 KB multi-turn chat body (system prompt, one earlier
//! turn, a new ~200-byte user message) through
//! `ChatRequest::from_json` + `chat_tokens` with the harmony template, per
//! request: `parse_render` (no tokenizing), `warm_new_message` (the
//! segment cache holds the earlier messages; the last message is new on
//! every request, as in a conversation), `warm_repeat` (the same body
//! again: every segment cached) and `cold` (no cache: the whole rendering
//! tokenized).
//!
//! `--model-dir DIR` instead measures a model's own `tokenizer.json` (a
//! directory as `--tokenizer-path` takes it) on the same texts: load time
//! and encoding by prompt-tokens' direct encoder, by prompt-tokens on the
//! `tokenizers` pipeline (`direct_encoder: false`) and by the `tokenizers`
//! crate itself, the ids of the three checked equal first.
//!
//! ```sh
//! cargo run --release -p prompt-tokens --example o200k_throughput
//! cargo run --release -p prompt-tokens --example o200k_throughput -- --json --rounds 11
//! cargo run --release -p prompt-tokens --example o200k_throughput -- --model-dir target/template-corpus/models/qwen3
//! ```

use std::hint::black_box;
use std::str::FromStr;
use std::time::{Duration, Instant};

use prompt_tokens::tiktoken::{O200K_FIRST_SPECIAL_ID, format_ranks, tokenizer_json};
use prompt_tokens::{ChatRequest, PromptTokenizer, TokenizerConfig, TokenizerOptions, templates};
use serde_json::json;

const PROSE: &str = "\
The router sits in front of a pool of inference engines and decides, for every \
request, which engine should serve it. A request whose prompt shares a long \
prefix with one an engine served a moment ago is cheaper there: the engine keeps \
the attention keys and values of that prefix in its cache and skips recomputing \
them. Measured on a busy cluster, a good placement halves the time to the first \
token for multi-turn chats, while a careless one leaves every engine recomputing \
the same system prompt. Load still matters, though. If one engine holds every \
popular prefix, it queues requests while its neighbours idle, so the policy \
weighs the expected cache hit against the work already waiting. Operators asked \
for three things: predictable tail latency, no configuration per model, and a \
way to see why a request went where it did. We wrote down the rules, tested them \
against traces from 2024 and 2025, and kept only those that paid for themselves. \
Don't guess; measure it again when the workload changes, and you'll find that \
yesterday's thresholds rarely survive next quarter's traffic. ";

const CODE: &str = r#"fn route(&self, request: &Request) -> Result<WorkerId, RouteError> {
    let tokens = self.tokenizer.chat_tokens(&request.chat)?;
    let (worker, matched) = self.tree.longest_prefix(&tokens);
    if matched * 2 < tokens.len() || self.load(worker) > self.threshold {
        return Ok(self.least_loaded());
    }
    Ok(worker)
}
{"model": "gpt-oss-20b", "messages": [{"role": "system", "content": "You are terse."},
 {"role": "user", "content": "List 3 ports in use: 8080, 9090, 11434?"}],
 "max_tokens": 256, "temperature": 0.2, "stream": true, "tools": [{"type": "function",
 "function": {"name": "get_weather", "parameters": {"type": "object", "properties":
 {"city": {"type": "string"}}, "required": ["city"]}}}]}
"#;

/// `len` bytes (cut at a character boundary) of `source` repeated, each
/// repetition numbered so that long texts are not one paragraph again and
/// again.
fn text_of(source: &str, len: usize) -> String {
    let mut text = String::with_capacity(len + source.len());
    let mut n = 0;
    while text.len() < len {
        text.push_str(&source.replace("2024", &format!("{}", 2024 + n)));
        n += 1;
    }
    let mut cut = len;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text.truncate(cut);
    text
}

/// Median seconds per call of `f` over `rounds` rounds of about 0.2 s.
fn median_secs(rounds: usize, mut f: impl FnMut() -> usize) -> f64 {
    let mut per_call = Vec::with_capacity(rounds);
    f(); // warm-up
    for _ in 0..rounds {
        let started = Instant::now();
        let mut calls = 0u64;
        while started.elapsed() < Duration::from_millis(200) {
            black_box(f());
            calls += 1;
        }
        per_call.push(started.elapsed().as_secs_f64() / calls as f64);
    }
    per_call.sort_by(f64::total_cmp);
    per_call[per_call.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let as_json = args.iter().any(|a| a == "--json");
    let rounds = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1)?.parse::<usize>().ok())
        .unwrap_or(7)
        .max(1);

    if let Some(dir) = args
        .iter()
        .position(|a| a == "--model-dir")
        .and_then(|i| args.get(i + 1))
    {
        println!("{}", model_figures(std::path::Path::new(dir), rounds));
        return;
    }
    let started = Instant::now();
    let reference = tiktoken_rs::o200k_base().expect("tiktoken-rs o200k_base");
    let reference_load = started.elapsed();
    let vocabulary = format_ranks(
        (0..O200K_FIRST_SPECIAL_ID).map(|r| (reference.decode_bytes(&[r]).expect("rank"), r)),
    );
    let started = Instant::now();
    let ours = PromptTokenizer::from_tiktoken(
        &vocabulary,
        TokenizerConfig::default(),
        TokenizerOptions::default(),
    )
    .expect("o200k loads");
    let ours_load = started.elapsed();
    let json_text = tokenizer_json(&vocabulary).expect("tokenizer.json");
    let started = Instant::now();
    let hf = tokenizers::Tokenizer::from_str(&json_text).expect("tokenizer.json loads");
    let hf_load = started.elapsed();
    drop(json_text);

    let mut results = Vec::new();
    for (kind, source) in [("prose", PROSE), ("code_json", CODE)] {
        for (size, len) in [("200B", 200), ("1KB", 1024), ("16KB", 16 * 1024)] {
            let text = text_of(source, len);
            let expected = reference.encode_ordinary(&text);
            let tokens = expected.len();
            assert_eq!(ours.text_tokens(&text, false).expect("tokens"), expected);
            let hf_ids = hf.encode_fast(text.as_str(), false).expect("tokens");
            assert_eq!(hf_ids.get_ids(), expected.as_slice());
            let mut row = serde_json::Map::new();
            row.insert("text".into(), json!(kind));
            row.insert("size".into(), json!(size));
            row.insert("bytes".into(), json!(text.len()));
            row.insert("tokens".into(), json!(tokens));
            let encoders: [(&str, &dyn Fn() -> usize); 3] = [
                ("prompt_tokens", &|| {
                    ours.text_tokens(black_box(&text), false)
                        .map_or(0, |ids| ids.len())
                }),
                ("tokenizers", &|| {
                    hf.encode_fast(black_box(text.as_str()), false)
                        .map_or(0, |e| e.len())
                }),
                ("tiktoken_rs", &|| {
                    reference.encode_ordinary(black_box(&text)).len()
                }),
            ];
            for (name, encode) in encoders {
                let secs = median_secs(rounds, encode);
                row.insert(
                    name.into(),
                    json!({
                        "us_per_call": (secs * 1e7).round() / 10.0,
                        "mb_per_s": (text.len() as f64 / secs / 1e4).round() / 100.0,
                        "mtokens_per_s": (tokens as f64 / secs / 1e4).round() / 100.0,
                    }),
                );
            }
            if !as_json {
                eprintln!("{}", serde_json::Value::Object(row.clone()));
            }
            results.push(serde_json::Value::Object(row));
        }
    }
    let chat = chat_figures(&vocabulary, rounds);
    if !as_json {
        eprintln!("{chat}");
    }
    let load_ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
    println!(
        "{}",
        json!({
            "vocabulary": "o200k_base (tiktoken-rs 0.12 assets)",
            "rounds": rounds,
            "load_ms": {
                "prompt_tokens": load_ms(ours_load),
                "tokenizers_from_json": load_ms(hf_load),
                "tiktoken_rs": load_ms(reference_load),
            },
            "cases": results,
            "chat": chat,
        })
    );
}

/// The `--model-dir` figures (see the module docs).
fn model_figures(dir: &std::path::Path, rounds: usize) -> serde_json::Value {
    let load = |direct_encoder: bool| {
        let started = Instant::now();
        let options = TokenizerOptions {
            direct_encoder,
            ..TokenizerOptions::default()
        };
        let tokenizer = PromptTokenizer::from_path_with(dir, None, options).expect("model loads");
        (tokenizer, started.elapsed())
    };
    let (direct, direct_load) = load(true);
    let (pipeline, pipeline_load) = load(false);
    let started = Instant::now();
    let hf = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).expect("tokenizer.json");
    let hf_load = started.elapsed();
    let mut cases = Vec::new();
    for (kind, source) in [("prose", PROSE), ("code_json", CODE)] {
        for (size, len) in [("200B", 200), ("1KB", 1024), ("16KB", 16 * 1024)] {
            let text = text_of(source, len);
            let expected = hf.encode_fast(text.as_str(), false).expect("tokens");
            assert_eq!(
                direct.text_tokens(&text, false).expect("tokens"),
                expected.get_ids()
            );
            assert_eq!(
                pipeline.text_tokens(&text, false).expect("tokens"),
                expected.get_ids()
            );
            let mut row = serde_json::Map::new();
            row.insert("text".into(), json!(kind));
            row.insert("size".into(), json!(size));
            row.insert("tokens".into(), json!(expected.len()));
            let encoders: [(&str, &dyn Fn() -> usize); 3] = [
                ("direct", &|| {
                    direct
                        .text_tokens(black_box(&text), false)
                        .map_or(0, |ids| ids.len())
                }),
                ("tokenizers_pipeline", &|| {
                    pipeline
                        .text_tokens(black_box(&text), false)
                        .map_or(0, |ids| ids.len())
                }),
                ("tokenizers_crate", &|| {
                    hf.encode_fast(black_box(text.as_str()), false)
                        .map_or(0, |e| e.len())
                }),
            ];
            for (name, encode) in encoders {
                let secs = median_secs(rounds, encode);
                row.insert(name.into(), json!((secs * 1e7).round() / 10.0));
            }
            cases.push(serde_json::Value::Object(row));
        }
    }
    let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
    json!({
        "model": dir.display().to_string(),
        "encoder": format!("{:?}", direct.text_encoder()),
        "load_ms": {"direct": ms(direct_load), "tokenizers_pipeline": ms(pipeline_load), "tokenizers_crate": ms(hf_load)},
        "us_per_call": cases,
    })
}

/// Where the request number goes in the chat body.
const SERIAL: &str = "#000000000";

/// A 1 KB harmony chat: system prompt, one earlier turn, a new question
/// carrying [`SERIAL`].
fn chat_body() -> String {
    let body = json!({
        "model": "gpt-oss-20b",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant for an operations team. \
                You answer questions about request routing, caches and engines. Be terse and \
                precise; give numbers with their units, and say when a figure is an estimate \
                rather than a measurement. Prefer short lists to long paragraphs, and name the \
                engine, the worker pool and the time window of every figure you quote, so that \
                an operator can check it."},
            {"role": "user", "content": "Turn 0: the p99 latency of engine 2 rose to 180 ms \
                after the deploy; is its cache cold? It served 40% of the traffic yesterday."},
            {"role": "assistant", "content": "Probably: engine 2 restarted at 10:04 and has \
                served few repeated prefixes since, so most requests pay a full prefill."},
            {"role": "user", "content": format!("Question {SERIAL} from pool 3: which engine \
                served the request with the longest shared prefix, how many tokens matched, \
                and would the answer change under twice the load? Answer in two lines.")},
        ],
        "max_tokens": 256,
        "stream": true,
    });
    body.to_string()
}

/// Median microseconds per chat request in each mode (see the module docs).
fn chat_figures(vocabulary: &str, rounds: usize) -> serde_json::Value {
    let config = || TokenizerConfig {
        chat_template: Some(templates::HARMONY.to_owned()),
        ..TokenizerConfig::default()
    };
    let warm = PromptTokenizer::from_tiktoken(vocabulary, config(), TokenizerOptions::default())
        .expect("o200k loads");
    let cold = PromptTokenizer::from_tiktoken(
        vocabulary,
        config(),
        TokenizerOptions {
            cache_bytes: 0,
            ..TokenizerOptions::default()
        },
    )
    .expect("o200k loads");
    let mut body = chat_body().into_bytes();
    let at = body
        .windows(SERIAL.len())
        .position(|w| w == SERIAL.as_bytes())
        .expect("serial");
    let parsed = ChatRequest::from_json(&body).expect("request");
    let tokens = warm.chat_tokens(&parsed).expect("tokens").len();
    let new_message_bytes = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|b| Some(b["messages"].as_array()?.last()?["content"].as_str()?.len()))
        .unwrap_or(0);
    let mut serial = 0u64;
    let mut next_body = move |body: &mut Vec<u8>| {
        serial += 1;
        body[at..at + SERIAL.len()].copy_from_slice(format!("#{serial:09}").as_bytes());
    };
    let us = |secs: f64| (secs * 1e7).round() / 10.0;
    let parse_render = median_secs(rounds, || {
        let request = ChatRequest::from_json(black_box(&body)).expect("request");
        warm.chat_text(&request).map_or(0, |t| t.len())
    });
    let repeat = median_secs(rounds, || {
        let request = ChatRequest::from_json(black_box(&body)).expect("request");
        warm.chat_tokens(&request).map_or(0, |ids| ids.len())
    });
    let mut fresh = body.clone();
    let new_message = median_secs(rounds, || {
        next_body(&mut fresh);
        let request = ChatRequest::from_json(black_box(&fresh)).expect("request");
        warm.chat_tokens(&request).map_or(0, |ids| ids.len())
    });
    let cold_secs = median_secs(rounds, || {
        next_body(&mut body);
        let request = ChatRequest::from_json(black_box(&body)).expect("request");
        cold.chat_tokens(&request).map_or(0, |ids| ids.len())
    });
    json!({
        "body_bytes": body.len(),
        "tokens": tokens,
        "new_message_bytes": new_message_bytes,
        "us_per_request": {
            "parse_render": us(parse_render),
            "warm_repeat": us(repeat),
            "warm_new_message": us(new_message),
            "cold": us(cold_secs),
        },
    })
}
