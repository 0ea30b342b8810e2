//! Cache accounting seen by a client: cached tokens in `usage` and the
//! prefix-cache counters in `/metrics`.

mod common;

use common::{metric, post};
use engine_sim::{EngineConfig, ServeOptions, spawn};
use serde_json::json;

fn fast() -> EngineConfig {
    EngineConfig {
        time_scale: 0.0,
        ..EngineConfig::default()
    }
}

#[tokio::test]
async fn same_prompt_twice_reports_cached_tokens() {
    let engine = spawn(fast(), ServeOptions::default()).await.expect("spawn");
    let body = json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Tell me about caches. ".repeat(30)}],
        "max_tokens": 3,
    });
    let first = post(engine.addr(), "/v1/chat/completions", &body)
        .await
        .json();
    let second = post(engine.addr(), "/v1/chat/completions", &body)
        .await
        .json();
    let prompt_tokens = first["usage"]["prompt_tokens"]
        .as_u64()
        .expect("prompt_tokens");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(first["usage"]["completion_tokens"], 3);
    // All full blocks but the one holding the last token.
    let expected = (prompt_tokens - 1) / 16 * 16;
    assert!(expected > 0);
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        expected
    );
    assert_eq!(second["usage"]["prompt_tokens"], prompt_tokens);
    // Deterministic text: the same prompt gets the same answer.
    assert_eq!(
        first["choices"][0]["message"]["content"],
        second["choices"][0]["message"]["content"]
    );
    assert_eq!(
        metric(engine.addr(), "vllm:prefix_cache_queries_total").await,
        (2 * prompt_tokens) as f64
    );
    assert_eq!(
        metric(engine.addr(), "vllm:prefix_cache_hits_total").await,
        expected as f64
    );
    engine.shutdown().await;
}

#[tokio::test]
async fn shared_prefix_with_different_suffixes_is_cached() {
    let engine = spawn(fast(), ServeOptions::default()).await.expect("spawn");
    let prefix = "abcdefghij".repeat(200); // 2,000 chars = 500 tokens
    let mut cached = Vec::new();
    for suffix in [
        "first question?",
        "a second, longer question here?",
        "third",
    ] {
        let body = json!({"prompt": format!("{prefix}{suffix}"), "max_tokens": 2});
        let reply = post(engine.addr(), "/v1/completions", &body).await.json();
        assert_eq!(reply["object"], "text_completion");
        cached.push(reply["usage"]["prompt_tokens_details"]["cached_tokens"].clone());
    }
    // Tokens 0..500 are shared; blocks 0..31 (496 tokens) are full and
    // shared, block 31 also holds suffix tokens.
    assert_eq!(cached, vec![json!(0), json!(496), json!(496)]);
    engine.shutdown().await;
}

#[tokio::test]
async fn capacity_pressure_evicts_the_oldest_prompt() {
    let mut config = fast();
    // 7 blocks: a 65-token prompt needs 4 full blocks plus one block for
    // its last token and output; two cached prompts do not fit.
    config.model.num_blocks = 7;
    let engine = spawn(config, ServeOptions::default()).await.expect("spawn");
    let prompt = |c: char| json!({"prompt": c.to_string().repeat(4 * 64 + 1), "max_tokens": 1});
    let cached =
        |reply: serde_json::Value| reply["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    let addr = engine.addr();
    assert_eq!(
        cached(post(addr, "/v1/completions", &prompt('a')).await.json()),
        0
    );
    assert_eq!(
        cached(post(addr, "/v1/completions", &prompt('a')).await.json()),
        64
    );
    // b needs 5 blocks: 3 are free, 2 come from evicting a's tail.
    assert_eq!(
        cached(post(addr, "/v1/completions", &prompt('b')).await.json()),
        0
    );
    // a lost its last two blocks; its first two are still there.
    assert_eq!(
        cached(post(addr, "/v1/completions", &prompt('a')).await.json()),
        32
    );
    engine.shutdown().await;
}
