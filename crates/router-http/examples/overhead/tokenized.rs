//! The `tokenized` group: tokenizers and multi-turn chat bodies

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

use super::Case;

/// The `tokenized` group: round_robin and cache_aware with the router
/// computing each request's token ids. By default the chat is rendered with
/// gpt-oss's harmony template and tokenized with the real `o200k_base`
/// vocabulary (the ranks the `tiktoken-rs` crate embeds: no download);
/// `--vocab trained` uses the Llama 3 template and a BPE `tokenizer.json`
/// trained at startup. The bodies are multi-turn chats
/// ([`make_chat_bodies`]) whose last message is new on every request, so
/// with the segment cache this is the warm path (the earlier messages'
/// ids cached, the new message tokenized); `cache_aware_cold` has no
/// cache, so every request tokenizes its whole rendering.
pub(super) const TOKENIZED: &str = "tokenized";

/// Whether and how the router tokenizes.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Tokens {
    /// Routing on text.
    Off,
    /// On token ids, with the segment cache.
    Warm,
    /// On token ids, without a segment cache: every request tokenizes its
    /// whole rendering.
    Cold,
}

/// The `tokenized` group's vocabulary and chat template.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Vocab {
    /// `o200k_base` and the harmony template.
    O200k,
    /// The same vocabulary as a `tokenizer.json`, encoded by the
    /// `tokenizers` crate's pipeline (how prompt-tokens encoded `.tiktoken`
    /// files before its direct encoder).
    O200kTokenizers,
    /// A small BPE trained at startup and the Llama 3 template.
    Trained,
    /// A real model directory ([`MODEL`]).
    Model,
}

/// `--chat-template FILE`, for `--vocab o200k` and `--vocab model`.
pub(super) fn chat_template_arg() -> Option<std::path::PathBuf> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--chat-template")
        .and_then(|i| args.get(i + 1))
        .map(std::path::PathBuf::from)
}

/// Set by `--tokenizers-encoder`: `tokenizer.json` files stay on the
/// `tokenizers` pipeline (prompt-tokens' `direct_encoder: false`).
pub(super) static TOKENIZERS_ENCODER: std::sync::OnceLock<()> = std::sync::OnceLock::new();

/// `--prefix-memo-bytes N`: the tokenizers' prefix memo bound (0 turns it
/// off; the default is prompt-tokens'), and the router's message memo's
/// (`Tokenizers::with_message_memo`). A cold tokenizer has neither.
pub(super) static PREFIX_MEMO_BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// `--model-dir` and `--chat-template` of `--vocab model`.
pub(super) static MODEL: std::sync::OnceLock<(std::path::PathBuf, Option<std::path::PathBuf>)> =
    std::sync::OnceLock::new();

impl Vocab {
    pub(super) fn describe(self) -> &'static str {
        match self {
            Vocab::O200k => "o200k_base (tiktoken-rs assets), harmony template",
            Vocab::O200kTokenizers => {
                "o200k_base as tokenizer.json (tokenizers pipeline), harmony template"
            }
            Vocab::Trained => "trained 600-token byte-level BPE, Llama 3 template",
            Vocab::Model => "a model directory (--model-dir, --chat-template)",
        }
    }
}

/// `o200k_base` in the tiktoken format, built once from the ranks
/// `tiktoken-rs` embeds.
fn o200k_text() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        let bpe = tiktoken_rs::o200k_base().expect("tiktoken-rs o200k_base");
        prompt_tokens::tiktoken::format_ranks(
            (0..prompt_tokens::tiktoken::O200K_FIRST_SPECIAL_ID)
                .map(|rank| (bpe.decode_bytes(&[rank]).expect("rank"), rank)),
        )
    })
}

pub(super) fn tokenizer(tokens: Tokens, vocab: Vocab) -> Arc<prompt_tokens::PromptTokenizer> {
    use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
    let options = prompt_tokens::TokenizerOptions {
        cache_bytes: if tokens == Tokens::Cold {
            0
        } else {
            prompt_tokens::TokenizerOptions::default().cache_bytes
        },
        direct_encoder: TOKENIZERS_ENCODER.get().is_none(),
        prefix_memo_bytes: if tokens == Tokens::Cold {
            0
        } else {
            PREFIX_MEMO_BYTES
                .get()
                .copied()
                .unwrap_or(prompt_tokens::DEFAULT_PREFIX_MEMO_BYTES)
        },
        ..prompt_tokens::TokenizerOptions::default()
    };
    let tokenizer = match vocab {
        Vocab::O200k => {
            // `--chat-template FILE` replaces the harmony template written
            // for prompt-tokens (gpt-oss's own, for instance).
            let template = chat_template_arg().map_or_else(
                || prompt_tokens::templates::HARMONY.to_owned(),
                |path| std::fs::read_to_string(path).expect("--chat-template"),
            );
            let config = prompt_tokens::TokenizerConfig {
                chat_template: Some(template),
                ..prompt_tokens::TokenizerConfig::default()
            };
            prompt_tokens::PromptTokenizer::from_tiktoken(o200k_text(), config, options)
                .expect("o200k tokenizer")
        }
        Vocab::O200kTokenizers => {
            static JSON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
            let json = JSON.get_or_init(|| {
                prompt_tokens::tiktoken::tokenizer_json(o200k_text()).expect("tokenizer.json")
            });
            let config = prompt_tokens::TokenizerConfig {
                chat_template: Some(prompt_tokens::templates::HARMONY.to_owned()),
                ..prompt_tokens::TokenizerConfig::default()
            };
            prompt_tokens::PromptTokenizer::from_parts(json.as_bytes(), config, options)
                .expect("o200k tokenizer.json")
        }
        Vocab::Trained => {
            let dir = std::env::temp_dir().join(format!("overhead-model-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("temp dir");
            write_model_dir(
                &dir,
                prompt_tokens::TemplateFamily::Llama3,
                TestTokenizerKind::ByteLevelRegex,
            )
            .expect("model dir");
            let tokenizer = prompt_tokens::PromptTokenizer::from_path_with(&dir, None, options)
                .expect("tokenizer");
            let _ = std::fs::remove_dir_all(&dir);
            tokenizer
        }
        Vocab::Model => {
            let (dir, template) = MODEL.get().expect("--model-dir");
            prompt_tokens::PromptTokenizer::from_path_with(dir, template.as_deref(), options)
                .expect("the model directory")
        }
    };
    Arc::new(tokenizer)
}

/// Where the request number goes in a [`make_chat_bodies`] body: the load
/// generator writes each request's own number over it, so that the last
/// message is new every time.
pub(super) const SERIAL: &[u8] = b"#000000000";

/// Multi-turn chats of `case.body_bytes` bytes: a system prompt, earlier
/// turns (the same in every body, as a conversation's history is from one
/// request to the next), and a new user message of about 200 bytes whose
/// [`SERIAL`] the load generator replaces with the request's number.
pub(super) fn make_chat_bodies(case: Case, count: usize) -> Vec<Bytes> {
    let body_of = |system: &str, history: &[serde_json::Value], question: &str| {
        let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
        messages.extend(history.iter().cloned());
        messages.push(serde_json::json!({"role": "user", "content": question}));
        serde_json::json!({
            "model": "m",
            "messages": messages,
            "max_tokens": 16,
            "stream": case.stream,
        })
        .to_string()
    };
    let question = |i: usize| {
        format!(
            "Question {} from pool {}: which engine served the request with the longest \
             shared prefix, how many tokens matched, and would the answer change under \
             twice the load?",
            String::from_utf8_lossy(SERIAL),
            i % 10
        )
    };
    // Earlier turns while a whole one (about 250 bytes) still fits, then
    // the system prompt padded to the exact size.
    let mut system = "You are a helpful assistant for an operations team. You answer \
                      questions about request routing, caches and engines."
        .to_owned();
    let mut history = Vec::new();
    let mut turn = 0;
    while body_of(&system, &history, &question(0)).len() + 300 < case.body_bytes {
        history.push(serde_json::json!({"role": "user", "content": format!(
            "Turn {turn}: the p99 latency of engine {} rose to {} ms after the deploy; \
             is its cache cold?", turn % 4, 180 + turn * 7)}));
        history.push(serde_json::json!({"role": "assistant", "content": format!(
            "Probably: engine {} restarted at 10:{:02} and has served few repeated \
             prefixes since.", turn % 4, turn % 60)}));
        turn += 1;
    }
    let pad = " Be terse and precise.";
    loop {
        let len = body_of(&system, &history, &question(0)).len();
        let Some(need) = case.body_bytes.checked_sub(len).filter(|n| *n > 0) else {
            break;
        };
        system.push_str(&pad[..need.min(pad.len())]);
    }
    (0..count)
        .map(|i| Bytes::from(body_of(&system, &history, &question(i))))
        .collect()
}

/// Request numbers for [`SERIAL`], unique in the whole run.
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(0);

/// `body` with its [`SERIAL`] (at `at`) replaced by the next request number.
pub(super) fn with_serial(body: &Bytes, at: usize) -> Bytes {
    let serial = format!(
        "#{:09}",
        NEXT_SERIAL.fetch_add(1, Ordering::Relaxed) % 1_000_000_000
    );
    let mut bytes = body.to_vec();
    bytes[at..at + SERIAL.len()].copy_from_slice(serial.as_bytes());
    Bytes::from(bytes)
}
