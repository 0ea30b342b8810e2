//! Routing on the engine's token ids (feature `tokens`): the router
//! computes the ids engine-sim computes (its synthetic tokenizer), routes a
//! conversation's next turn to the engine that caches it, and reports the
//! mode and counters.
#![cfg(feature = "tokens")]

mod common;

use common::{Fixture, call, json};
use engine_sim::EngineConfig;
use http::StatusCode;
use prompt_tokens::PromptTokenizer;
use router_http::RouterConfig;
use router_http::tokens::Tokenizers;
use std::sync::Arc;

fn config() -> RouterConfig {
    let chars_per_token = engine_sim::ModelConfig::default().chars_per_token;
    RouterConfig {
        tokenizers: Tokenizers::default()
            .with_default(Arc::new(PromptTokenizer::synthetic(chars_per_token))),
        ..RouterConfig::default()
    }
}

fn conversation(turns: usize) -> serde_json::Value {
    let mut messages = vec![serde_json::json!({
        "role": "system",
        "content": "You answer questions about the tides of the North Sea. ".repeat(20),
    })];
    for turn in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": format!("Question {turn}?")}));
        messages
            .push(serde_json::json!({"role": "assistant", "content": format!("Answer {turn}.")}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "And next?"}));
    serde_json::json!({"model": "sim-model", "messages": messages, "max_tokens": 4})
}

#[tokio::test]
async fn a_conversation_follows_the_engine_that_caches_its_tokens() {
    let fixture = Fixture::start(config(), vec![EngineConfig::default(); 3]).await;
    let tokenizer = PromptTokenizer::synthetic(engine_sim::ModelConfig::default().chars_per_token);
    for turns in 0..4 {
        let body = conversation(turns);
        let (status, _, bytes) = call(
            fixture.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            body.to_string(),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let response = json(&bytes);
        // The router's ids are the engine's: same count.
        let request = prompt_tokens::ChatRequest::from_value(&body).unwrap();
        let ids = tokenizer.chat_tokens(&request).unwrap();
        assert_eq!(response["usage"]["prompt_tokens"], ids.len(), "{response}");
        if turns > 0 {
            // Every later turn finds the conversation's prefix cached.
            let cached = &response["usage"]["prompt_tokens_details"]["cached_tokens"];
            assert!(
                cached.as_u64().is_some_and(|n| n > 0),
                "turn {turns}: {response}"
            );
        }
    }
    let served: Vec<u64> = fixture
        .engines
        .iter()
        .map(|engine| engine.stats().requests_finished)
        .collect();
    assert!(
        served.contains(&4),
        "every turn went to the engine holding the conversation: {served:?}"
    );

    let (_, _, workers) = call(fixture.addr, "GET", "/workers", &[], "").await;
    let workers = json(&workers);
    for worker in workers.as_array().unwrap() {
        assert_eq!(worker["routing"], "tokens", "{worker}");
    }
    let (_, _, metrics) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8(metrics.to_vec()).unwrap();
    assert!(
        metrics.contains("router_tokens_routed_total{model=\"*\"} 4"),
        "{metrics}"
    );
    assert!(
        metrics.contains("router_tokens_fallbacks_total{model=\"*\"} 0"),
        "{metrics}"
    );
    // The time spent computing the ids is counted: four requests took some.
    let compute: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("router_tokens_compute_seconds_total{model=\"*\"} "))
        .and_then(|v| v.parse().ok())
        .expect("router_tokens_compute_seconds_total");
    assert!(compute > 0.0 && compute < 60.0, "{compute}");
    fixture.shutdown().await;
}

#[tokio::test]
async fn without_tokenizers_workers_say_text() {
    let fixture = Fixture::start(RouterConfig::default(), vec![EngineConfig::default()]).await;
    let (_, _, workers) = call(fixture.addr, "GET", "/workers", &[], "").await;
    assert_eq!(json(&workers)[0]["routing"], "text");
    let (_, _, metrics) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8(metrics.to_vec()).unwrap();
    assert!(!metrics.contains("router_tokens_"), "{metrics}");
    fixture.shutdown().await;
}

/// A content part of an unknown type is the client's mistake: the router
/// cannot compute its tokens (counted as a fallback, routed on text), and
/// the engine answers 400 naming the type, as vLLM does. The router stays
/// healthy: the next good request routes on tokens.
#[tokio::test]
async fn a_content_part_of_unknown_type_is_a_400_naming_it() {
    let fixture = Fixture::start(config(), vec![EngineConfig::default(); 2]).await;
    let bad = serde_json::json!({"model": "sim-model", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "bogus", "text": "x"}]}]});
    let (status, _, bytes) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        bad.to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let body = json(&bytes);
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("'bogus'"), "{body}");

    the_next_good_request_routes_on_tokens(&fixture).await;
    for engine in &fixture.engines {
        assert_eq!(engine.stats().running, 0, "no request left running");
    }
    fixture.shutdown().await;
}

/// A request the model's chat template refuses (`raise_exception`) is the
/// client's, not the router's error: the router routes it on text
/// (counted as a fallback) and the engine answers it, as vLLM does with a
/// 400 carrying the template's message (engine-sim renders no template
/// and answers 200). The router never answers it with a 500, and the next
/// request the template accepts routes on tokens.
#[tokio::test]
async fn a_request_the_template_refuses_is_left_for_the_engine_to_answer() {
    let tokenizer = trained_with_template(
        "raise",
        "{% if messages[0].role != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}\
         {% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    );
    let config = RouterConfig {
        tokenizers: Tokenizers::default().with_default(Arc::new(tokenizer)),
        ..RouterConfig::default()
    };
    let fixture = Fixture::start(config, vec![EngineConfig::default()]).await;
    let refused = serde_json::json!({"model": "sim-model", "max_tokens": 4, "messages": [
        {"role": "user", "content": "Hello?"}]});
    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        refused.to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "the engine's answer: {body:?}");
    assert_eq!(fixture.engines[0].stats().requests_finished, 1);
    the_next_good_request_routes_on_tokens(&fixture).await;
    fixture.shutdown().await;
}

/// After one request counted as a fallback to text, a conversation the
/// template accepts is answered and routed on tokens: `/metrics` counts
/// one of each.
async fn the_next_good_request_routes_on_tokens(fixture: &Fixture) {
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        conversation(0).to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (_, _, metrics) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8(metrics.to_vec()).unwrap();
    for line in [
        "router_tokens_fallbacks_total{model=\"*\"} 1",
        "router_tokens_routed_total{model=\"*\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
}

/// A trained BPE tokenizer with the ChatML template (a model directory of
/// its own, removed once loaded), built with `options`.
fn trained(name: &str, options: prompt_tokens::TokenizerOptions) -> PromptTokenizer {
    trained_in(name, None, options)
}

/// [`trained`] with the default options and `template` (a chat
/// template's source) in place of the model directory's own.
fn trained_with_template(name: &str, template: &str) -> PromptTokenizer {
    trained_in(
        name,
        Some(template),
        prompt_tokens::TokenizerOptions::default(),
    )
}

fn trained_in(
    name: &str,
    template: Option<&str>,
    options: prompt_tokens::TokenizerOptions,
) -> PromptTokenizer {
    use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
    let dir = std::env::temp_dir().join(format!("tokens-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_model_dir(
        &dir,
        prompt_tokens::TemplateFamily::ChatMl,
        TestTokenizerKind::ByteLevelRegex,
    )
    .unwrap();
    let template = template.map(|source| {
        let path = dir.join("override.jinja");
        std::fs::write(&path, source).unwrap();
        path
    });
    let tokenizer = PromptTokenizer::from_path_with(&dir, template.as_deref(), options).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    tokenizer
}

/// A real (trained) tokenizer behind the router: a conversation's later
/// turns take the ids of what they share with the earlier ones from the
/// prefix memo, and `/metrics` says so; the ids are those of the whole
/// rendering tokenized at once.
#[tokio::test]
async fn later_turns_reuse_the_earlier_renderings_ids_and_the_metrics_count_it() {
    let tokenizer = Arc::new(trained(
        "prefix",
        prompt_tokens::TokenizerOptions::default(),
    ));
    let config = RouterConfig {
        tokenizers: Tokenizers::default().with_default(Arc::clone(&tokenizer)),
        ..RouterConfig::default()
    };
    let fixture = Fixture::start(config, vec![EngineConfig::default(); 2]).await;
    // A fresh tokenizer of the same model, without the memo: the reference.
    let reference = trained(
        "reference",
        prompt_tokens::TokenizerOptions {
            prefix_memo_bytes: 0,
            ..prompt_tokens::TokenizerOptions::default()
        },
    );
    for turns in 0..4 {
        let mut body = conversation(turns);
        // Over 2 KB: the body is read through the message memo too.
        body["messages"][0]["content"] =
            serde_json::json!("You answer questions about the tides of the North Sea. ".repeat(45));
        let (status, _, _) = call(
            fixture.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            body.to_string(),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        // The router's tokenizer (memo and all) against the reference.
        let request = prompt_tokens::ChatRequest::from_value(&body).unwrap();
        assert_eq!(
            tokenizer.chat_tokens(&request).unwrap(),
            reference.chat_tokens_uncached(&request).unwrap(),
            "turn {turns}"
        );
    }
    let (_, _, metrics) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8(metrics.to_vec()).unwrap();
    // A sample's value: `series` is the name with its labels, if any.
    let sample = |series: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{series} in {metrics}"))
    };
    let value = |name: &str| sample(&format!("{name}{{model=\"*\"}}"));
    assert_eq!(value("router_tokens_routed_total"), 4.0, "{metrics}");
    // The system prompt alone is over 1 KB: every rendering after the
    // first reuses (the router's four, and this test's own four calls).
    assert!(
        value("router_tokens_prefix_reused_total") >= 3.0,
        "{metrics}"
    );
    assert!(
        value("router_tokens_prefix_reused_bytes_total") >= 3.0 * 1024.0,
        "{metrics}"
    );
    assert!(value("router_tokens_prefix_bytes") > 0.0, "{metrics}");
    // The system message (the only one of 48 bytes or more) was parsed
    // once; the three later bodies took it from the message memo.
    assert_eq!(
        sample("router_tokens_message_memo_lookups_total"),
        4.0,
        "{metrics}"
    );
    assert_eq!(
        sample("router_tokens_message_memo_hits_total"),
        3.0,
        "{metrics}"
    );
    fixture.shutdown().await;
}
