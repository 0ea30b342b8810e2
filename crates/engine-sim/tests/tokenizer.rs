//! An engine with a model's tokenizer (`ServeOptions::tokenizer`): its
//! usage and prefix cache count the ids prompt-tokens computes for the same
//! request, for each of prompt-tokens' template families.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use common::send;
use engine_sim::{EngineConfig, ServeOptions, spawn};
use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
use prompt_tokens::{
    ChatRequest, CompletionRequest, FixedClock, PromptTokenizer, TemplateFamily, TokenizerOptions,
};
use serde_json::{Value, json};

/// 2024-07-26 12:34:56 UTC: templates that print today's date print this.
const NOW: i64 = 1_721_997_296;

/// Block size of the engines under test (engine-sim's default).
const BLOCK: usize = 16;

/// Each family with a different tokenizer pipeline, so all four shapes run.
const MODELS: [(TemplateFamily, TestTokenizerKind); 4] = [
    (TemplateFamily::ChatMl, TestTokenizerKind::Gpt2),
    (TemplateFamily::Llama3, TestTokenizerKind::ByteLevelRegex),
    (TemplateFamily::Mistral, TestTokenizerKind::MetaspaceFirst),
    (
        TemplateFamily::Harmony,
        TestTokenizerKind::PrependNormalizer,
    ),
];

fn load(dir: &Path) -> PromptTokenizer {
    let options = TokenizerOptions {
        clock: Arc::new(FixedClock(NOW)),
        ..TokenizerOptions::default()
    };
    PromptTokenizer::from_path_with(dir, None, options).expect("load the test model")
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn text(&mut self, words: usize) -> String {
        const WORDS: [&str; 16] = [
            "the",
            "router",
            "cache",
            "Paris",
            "weather",
            "tokens",
            "42",
            "München",
            "quickly",
            "assistant",
            "def",
            "{\"city\":",
            "sunny,",
            "🙂",
            "prefill",
            "blocks.",
        ];
        let mut out = String::new();
        for i in 0..words {
            if i > 0 {
                out.push(' ');
            }
            out.push_str(WORDS[self.below(WORDS.len())]);
        }
        out
    }
}

/// A chat body the four templates accept: an optional system message (one
/// of two, so chats share prefixes), then alternating user and assistant
/// turns ending with a user turn, sometimes with tools.
fn random_chat(rng: &mut Rng) -> (Vec<Value>, Option<Value>) {
    let mut messages = Vec::new();
    if rng.below(3) > 0 {
        let system = if rng.below(2) == 0 {
            "You are a helpful assistant. Answer briefly and cite your sources.".repeat(3)
        } else {
            "You route requests to the worker that holds their prompt.".repeat(4)
        };
        messages.push(json!({"role": "system", "content": system}));
    }
    let turns = 1 + rng.below(3);
    for turn in 0..turns {
        if turn > 0 {
            let words = 3 + rng.below(30);
            messages.push(json!({"role": "assistant", "content": rng.text(words)}));
        }
        let words = 1 + rng.below(60);
        messages.push(json!({"role": "user", "content": rng.text(words)}));
    }
    let tools = (rng.below(4) == 0).then(|| {
        json!([{"type": "function", "function": {"name": "get_weather",
            "description": "Current weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
    });
    (messages, tools)
}

fn chat_body(messages: &[Value], tools: Option<&Value>) -> String {
    let mut body = json!({"model": "sim-model", "messages": messages, "max_tokens": 2});
    if let Some(tools) = tools {
        body["tools"] = tools.clone();
    }
    body.to_string()
}

/// Full blocks two id sequences share from the start.
fn common_blocks(a: &[u32], b: &[u32]) -> usize {
    let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    same / BLOCK
}

/// What engine-sim's cache rule says request `ids` finds cached when every
/// earlier prompt in `sent` is still cached (nothing is evicted here):
/// whole blocks only, the leading run of blocks some earlier prompt
/// shares, and never the last prompt token (vLLM computes it).
fn expected_cached(sent: &[Vec<u32>], ids: &[u32]) -> usize {
    let leading = sent
        .iter()
        .map(|p| common_blocks(p, ids))
        .max()
        .unwrap_or(0);
    leading.min(ids.len().saturating_sub(1) / BLOCK) * BLOCK
}

async fn post_raw(addr: SocketAddr, path: &str, body: &str) -> (u16, Value) {
    let reply = send(addr, "POST", path, Some(body), &[]).await;
    (reply.status.as_u16(), reply.json())
}

#[tokio::test]
async fn usage_and_cache_count_the_tokenizers_ids() {
    for (family, kind) in MODELS {
        let dir = tempfile::tempdir().expect("temp dir");
        write_model_dir(dir.path(), family, kind).expect("write the model dir");
        let engine = spawn(
            EngineConfig::instant(),
            ServeOptions {
                tokenizer: Some(Arc::new(load(dir.path()))),
                ..ServeOptions::default()
            },
        )
        .await
        .expect("spawn");
        // The same model loaded separately: what a router would compute.
        let reference = load(dir.path());
        let addr = engine.addr();
        let mut rng = Rng(family as u64 + 1);
        let mut sent: Vec<Vec<u32>> = Vec::new();
        let mut hits = 0;
        for _ in 0..10 {
            let (mut messages, tools) = random_chat(&mut rng);
            // The chat, the same chat again, then one more turn of it.
            for step in 0..3 {
                if step == 2 {
                    let words = 2 + rng.below(20);
                    messages.push(json!({"role": "assistant", "content": rng.text(words)}));
                    let words = 1 + rng.below(20);
                    messages.push(json!({"role": "user", "content": rng.text(words)}));
                }
                let body = chat_body(&messages, tools.as_ref());
                let request = ChatRequest::from_json(body.as_bytes()).expect("a valid chat");
                let ids = reference
                    .chat_tokens(&request)
                    .expect("the model renders it");
                let (status, answer) = post_raw(addr, "/v1/chat/completions", &body).await;
                assert_eq!(status, 200, "{}: {answer}", family.name());
                let usage = &answer["usage"];
                assert_eq!(
                    usage["prompt_tokens"],
                    ids.len(),
                    "{}: prompt_tokens of {body}",
                    family.name()
                );
                let cached = expected_cached(&sent, &ids);
                assert_eq!(
                    usage["prompt_tokens_details"]["cached_tokens"],
                    cached,
                    "{}: cached_tokens of {body}",
                    family.name()
                );
                if step == 1 {
                    // A repeat finds every whole block but the last token's.
                    assert_eq!(cached, (ids.len() - 1) / BLOCK * BLOCK);
                }
                hits += usize::from(cached > 0);
                sent.push(ids);
            }
        }
        assert!(hits >= 10, "{}: repeats must hit the cache", family.name());
        engine.shutdown().await;
    }
}

#[tokio::test]
async fn completions_use_the_tokenizer_and_template_errors_are_400() {
    let dir = tempfile::tempdir().expect("temp dir");
    write_model_dir(dir.path(), TemplateFamily::Mistral, TestTokenizerKind::Gpt2)
        .expect("write the model dir");
    let reference = load(dir.path());
    let engine = spawn(
        EngineConfig::instant(),
        ServeOptions {
            tokenizer: Some(Arc::new(load(dir.path()))),
            ..ServeOptions::default()
        },
    )
    .await
    .expect("spawn");
    let addr = engine.addr();

    // A text prompt gets the tokenizer's BOS (add_special_tokens defaults
    // to true for completions); token ids are used as given.
    let text = "The router sends each request to the worker that already holds its prompt.";
    let ids = reference
        .completion_tokens(&CompletionRequest::text(text))
        .expect("tokenize");
    let bos = reference.text_tokens("<s>", false).expect("tokenize BOS");
    assert_eq!(ids[..1], bos[..], "BOS first");
    let (status, answer) = post_raw(
        addr,
        "/v1/completions",
        &json!({"prompt": text, "max_tokens": 1}).to_string(),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["prompt_tokens"], ids.len());
    let (status, answer) = post_raw(
        addr,
        "/v1/completions",
        &json!({"prompt": [5, 6, 7], "max_tokens": 1}).to_string(),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["prompt_tokens"], 3);

    // The template's own exception, as vLLM reports it.
    let (status, answer) = post_raw(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
            .to_string(),
    )
    .await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["error"]["type"], "BadRequestError");
    let message = answer["error"]["message"].as_str().expect("a message");
    assert!(message.contains("must alternate"), "{message}");
    // A request that is not a chat at all still gets engine-sim's message.
    let (status, answer) = post_raw(addr, "/v1/chat/completions", r#"{"messages": 3}"#).await;
    assert_eq!(status, 400, "{answer}");
    // Nothing of the refused requests stayed behind.
    assert_eq!(engine.server_load(), 0);
    assert_eq!(engine.stats().requests_finished, 2);
    engine.shutdown().await;
}

#[tokio::test]
async fn without_a_tokenizer_the_synthetic_rule_counts() {
    let engine = spawn(EngineConfig::instant(), ServeOptions::default())
        .await
        .expect("spawn");
    let body = json!({"messages": [{"role": "user", "content": "Hello there, engine!"}],
                      "max_tokens": 1})
    .to_string();
    let (status, answer) = post_raw(engine.addr(), "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    let synthetic = PromptTokenizer::synthetic(EngineConfig::default().model.chars_per_token);
    let ids = synthetic
        .chat_tokens(&ChatRequest::from_json(body.as_bytes()).expect("chat"))
        .expect("render");
    // "<|user|>\nHello there, engine!\n<|assistant|>\n": 44 characters.
    assert_eq!(ids.len(), 11);
    assert_eq!(answer["usage"]["prompt_tokens"], ids.len());
    engine.shutdown().await;
}
