//! Where a warm multi-turn chat's tokenizing time goes, phase by phase, on
//! a real model's template and tokenizer: the conversations of the
//! router's `overhead` example (1 KB: 6 messages; 8 KB: 68), whose last
//! message is new on every request, so the segment cache holds the rest.
//!
//! Per request, microseconds, the median of `--rounds` rounds:
//!
//! * `parse`: `ChatRequest::from_json` of the body;
//! * `render`: `PromptTokenizer::chat_text` of the parsed request (the
//!   chat template: message preparation, context, rendering);
//! * `warm`: `from_json` + `chat_tokens`, the whole warm path (render,
//!   then the rendering cut at the added tokens, every segment but the new
//!   one found in the cache, the new one encoded).
//!
//! `warm - parse - render` is the segment lookups and the encoding.
//!
//! ```sh
//! M=target/template-corpus/models T=target/template-corpus/templates
//! cargo run --release -p prompt-tokens --example chat_phases -- \
//!     --model-dir $M/llama3_1 --chat-template $T/meta-llama-Llama-3.1-8B-Instruct.jinja
//! cargo run --release -p prompt-tokens --example chat_phases -- \
//!     --o200k --chat-template $T/openai-gpt-oss-120b.jinja
//! ```
//!
//! `--loop PHASE CALLS` runs one phase (`parse`, `render`, `warm`) on
//! `CALLS` fresh 8 KB bodies (`--bytes N`: of N bytes) and prints nothing
//! else: a loop for `perf
//! record`, or for counting instructions where the machine is too busy
//! for timings to mean much (callgrind's inclusive counts of the phases'
//! functions, divided by `CALLS`):
//!
//! ```sh
//! valgrind --tool=callgrind --collect-atstart=no \
//!     --toggle-collect='prompt_tokens::request::ChatRequest::from_json*' \
//!     --toggle-collect='prompt_tokens::tokenizer::PromptTokenizer::chat_tokens' \
//!     target/release/examples/chat_phases --model-dir ... --loop warm 200
//! callgrind_annotate --inclusive=yes callgrind.out.PID | grep -E 'from_json|chat_tokens|render_until|encode_chat'
//! ```
//!
//! `--memo-bytes N` bounds the chat template's render memo
//! (`TokenizerOptions::render_memo_bytes`; 0 turns it off, to compare),
//! `--prefix-memo-bytes N` the tokenizer's prefix memo
//! (`TokenizerOptions::prefix_memo_bytes`; 0 turns it off), and
//! `--message-memo-bytes N` the message memo the `parse` and `warm`
//! phases read bodies through (`ChatRequest::from_json_with`, as the
//! router does; 0 reads them with `ChatRequest::from_json`).

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use prompt_tokens::tiktoken::{O200K_FIRST_SPECIAL_ID, format_ranks};
use prompt_tokens::{ChatRequest, PromptTokenizer, TokenizerConfig, TokenizerOptions};
use serde_json::{Value, json};

/// A chat body of about `bytes` bytes as the overhead example sends it: a
/// system prompt, earlier user/assistant turns while a whole one fits, the
/// system prompt padded to the size, and a new ~200-byte question carrying
/// `serial`.
fn chat_body(bytes: usize, serial: u64) -> String {
    let body = |system: &str, history: &[Value], serial: u64| {
        let mut messages = vec![json!({"role": "system", "content": system})];
        messages.extend(history.iter().cloned());
        messages.push(json!({"role": "user", "content": format!(
            "Question #{serial:09} from pool {}: which engine served the request with the \
             longest shared prefix, how many tokens matched, and would the answer change \
             under twice the load?", serial % 10)}));
        json!({"model": "m", "messages": messages, "max_tokens": 16, "stream": false}).to_string()
    };
    let mut system = "You are a helpful assistant for an operations team. You answer \
                      questions about request routing, caches and engines."
        .to_owned();
    let mut history = Vec::new();
    let mut turn = 0;
    while body(&system, &history, 0).len() + 300 < bytes {
        history.push(json!({"role": "user", "content": format!(
            "Turn {turn}: the p99 latency of engine {} rose to {} ms after the deploy; \
             is its cache cold?", turn % 4, 180 + turn * 7)}));
        history.push(json!({"role": "assistant", "content": format!(
            "Probably: engine {} restarted at 10:{:02} and has served few repeated \
             prefixes since.", turn % 4, turn % 60)}));
        turn += 1;
    }
    while body(&system, &history, 0).len() < bytes {
        system.push_str(" Be terse.");
    }
    body(&system, &history, serial)
}

struct Args {
    model_dir: Option<PathBuf>,
    o200k: bool,
    template: Option<PathBuf>,
    rounds: usize,
    looped: Option<(String, usize)>,
    loop_bytes: usize,
    memo_bytes: usize,
    prefix_memo_bytes: usize,
    message_memo_bytes: usize,
}

fn args() -> Result<Args, String> {
    let mut out = Args {
        model_dir: None,
        o200k: false,
        template: None,
        rounds: 7,
        looped: None,
        loop_bytes: 8192,
        memo_bytes: prompt_tokens::DEFAULT_RENDER_MEMO_BYTES,
        prefix_memo_bytes: prompt_tokens::DEFAULT_PREFIX_MEMO_BYTES,
        message_memo_bytes: prompt_tokens::DEFAULT_MESSAGE_MEMO_BYTES,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--model-dir" => out.model_dir = Some(value()?.into()),
            "--chat-template" => out.template = Some(value()?.into()),
            "--o200k" => out.o200k = true,
            "--bytes" => {
                out.loop_bytes = value()?.parse().map_err(|e| format!("--bytes: {e}"))?;
            }
            "--memo-bytes" => {
                out.memo_bytes = value()?.parse().map_err(|e| format!("--memo-bytes: {e}"))?;
            }
            "--message-memo-bytes" => {
                out.message_memo_bytes = value()?
                    .parse()
                    .map_err(|e| format!("--message-memo-bytes: {e}"))?;
            }
            "--prefix-memo-bytes" => {
                out.prefix_memo_bytes = value()?
                    .parse()
                    .map_err(|e| format!("--prefix-memo-bytes: {e}"))?;
            }
            "--rounds" => out.rounds = value()?.parse().map_err(|e| format!("--rounds: {e}"))?,
            "--loop" => {
                let phase = value()?;
                let calls = value()?.parse().map_err(|e| format!("--loop: {e}"))?;
                out.looped = Some((phase, calls));
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if out.model_dir.is_none() && !out.o200k {
        return Err("give --model-dir DIR or --o200k".into());
    }
    Ok(out)
}

fn tokenizer(args: &Args) -> Result<PromptTokenizer, Box<dyn std::error::Error>> {
    let options = TokenizerOptions {
        render_memo_bytes: args.memo_bytes,
        prefix_memo_bytes: args.prefix_memo_bytes,
        ..TokenizerOptions::default()
    };
    if let Some(dir) = &args.model_dir {
        return Ok(PromptTokenizer::from_path_with(
            dir,
            args.template.as_deref(),
            options,
        )?);
    }
    let bpe = tiktoken_rs::o200k_base()?;
    let ranks = (0..O200K_FIRST_SPECIAL_ID)
        .map(|rank| bpe.decode_bytes(&[rank]).map(|bytes| (bytes, rank)))
        .collect::<Result<Vec<_>, _>>()?;
    let template = match &args.template {
        Some(path) => std::fs::read_to_string(path)?,
        None => prompt_tokens::templates::HARMONY.to_owned(),
    };
    let config = TokenizerConfig {
        chat_template: Some(template),
        ..TokenizerConfig::default()
    };
    Ok(PromptTokenizer::from_tiktoken(
        &format_ranks(ranks),
        config,
        options,
    )?)
}

/// Where the serial sits in a [`chat_body`] made with serial 0.
const SERIAL_ZERO: &str = "#000000000";

/// `count` bodies of `bytes` bytes, each with the next serial: a new last
/// message each, as a conversation's next turn has.
fn fresh_bodies(bytes: usize, count: usize, serial: &mut u64) -> Vec<String> {
    let template = chat_body(bytes, 0);
    let at = template.find(SERIAL_ZERO).unwrap_or(0);
    (0..count)
        .map(|_| {
            *serial += 1;
            let mut body = template.clone();
            body.replace_range(at..at + SERIAL_ZERO.len(), &format!("#{:09}", *serial));
            body
        })
        .collect()
}

/// Microseconds per call of `phase` over `count` fresh bodies of `bytes`
/// bytes (made, and parsed for `render`, before the clock starts).
fn time_phase(
    tokenizer: &PromptTokenizer,
    phase: &str,
    bytes: usize,
    count: usize,
    serial: &mut u64,
) -> Result<f64, Box<dyn std::error::Error>> {
    let bodies = fresh_bodies(bytes, count, serial);
    let parsed: Vec<ChatRequest> = if phase == "render" {
        bodies
            .iter()
            .map(|b| ChatRequest::from_json(b.as_bytes()))
            .collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    let started = Instant::now();
    match phase {
        "parse" => {
            for body in &bodies {
                black_box(parse(black_box(body.as_bytes()))?);
            }
        }
        "render" => {
            for request in &parsed {
                black_box(tokenizer.chat_text(black_box(request))?);
            }
        }
        _ => {
            for body in &bodies {
                let request = parse(black_box(body.as_bytes()))?;
                black_box(tokenizer.chat_tokens(&request)?);
            }
        }
    }
    Ok(started.elapsed().as_secs_f64() * 1e6 / count.max(1) as f64)
}

/// The message memo `--message-memo-bytes` asks for (none for 0).
static MESSAGE_MEMO: std::sync::OnceLock<Option<prompt_tokens::MessageMemo>> =
    std::sync::OnceLock::new();

/// A body read as the router reads it: through the message memo when
/// there is one.
fn parse(body: &[u8]) -> prompt_tokens::Result<ChatRequest> {
    match MESSAGE_MEMO.get().and_then(Option::as_ref) {
        Some(memo) => ChatRequest::from_json_with(body, memo),
        None => ChatRequest::from_json(body),
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = args()?;
    let _ = MESSAGE_MEMO.set(
        (args.message_memo_bytes > 0)
            .then(|| prompt_tokens::MessageMemo::new(args.message_memo_bytes)),
    );
    let tokenizer = tokenizer(&args)?;
    let mut serial = 0;
    // Warm the segment cache with the history every body shares.
    for bytes in [1024, 8192] {
        tokenizer.chat_tokens(&parse(chat_body(bytes, 0).as_bytes())?)?;
    }
    if let Some((phase, calls)) = &args.looped {
        time_phase(&tokenizer, phase, args.loop_bytes, *calls, &mut serial)?;
        let memo = tokenizer.prefix_memo_stats();
        eprintln!(
            "prefix memo: {} lookups, {} reused, {} bytes reused",
            memo.lookups, memo.reused, memo.reused_bytes
        );
        return Ok(());
    }
    for bytes in [1024, 8192] {
        let body = chat_body(bytes, 0);
        let messages = ChatRequest::from_json(body.as_bytes())?
            .message_count()
            .unwrap_or(0);
        let mut figures = Vec::new();
        for phase in ["parse", "render", "warm"] {
            let rounds: Vec<f64> = (0..args.rounds.max(1))
                // About 0.2 s a round.
                .map(|_| time_phase(&tokenizer, phase, bytes, 8_000_000 / bytes, &mut serial))
                .collect::<Result<_, _>>()?;
            figures.push(format!("\"{phase}_us\": {:.1}", median(rounds)));
        }
        println!(
            "{{\"body_bytes\": {}, \"messages\": {messages}, {}}}",
            body.len(),
            figures.join(", ")
        );
    }
    Ok(())
}
