//! Token-accurate routing, end to end: for each chat-template family, the
//! reference router (`--tokenizer-path DIR`) computes exactly the prompt
//! token ids an engine-sim engine computes with its own copy of the same
//! model directory, and the engine's `prompt_tokens` and `cached_tokens`
//! agree with the router's ids.

use affinity_router::cli::{App, Settings};
use affinity_router::http::{ApiKind, RoutingInputBuf};
use bytes::Bytes;
use engine_sim::api::{Endpoint, Prompt, parse_request_with};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
use prompt_tokens::{PromptTokenizer, TemplateFamily};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

const BLOCK: usize = 16;

/// Random conversations: a system prompt, alternating turns (the Mistral
/// template refuses others), texts with spaces, punctuation, non-ASCII and
/// lengths around block boundaries.
fn conversation() -> impl Strategy<Value = Value> {
    let text = "[a-zA-Z0-9 ,.!?éü中]{1,80}";
    (text, prop::collection::vec((text, text), 0..4), text).prop_map(|(system, turns, last)| {
        let mut messages = vec![json!({"role": "system", "content": system})];
        for (user, assistant) in turns {
            messages.push(json!({"role": "user", "content": user}));
            messages.push(json!({"role": "assistant", "content": assistant}));
        }
        messages.push(json!({"role": "user", "content": last}));
        json!({"model": "sim-model", "messages": messages, "max_tokens": 2})
    })
}

async fn post(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    url: &str,
    body: &Value,
) -> (StatusCode, Value) {
    let request = Request::post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(20), client.request(request))
        .await
        .expect("answered within 20 s")
        .unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_and_engine_compute_the_same_ids_for_every_template_family() {
    for family in TemplateFamily::ALL {
        let dir = tempfile::tempdir().unwrap();
        write_model_dir(dir.path(), family, TestTokenizerKind::ByteLevelRegex).unwrap();
        // The engine loads the model directory itself.
        let engine_tokenizer = Arc::new(PromptTokenizer::from_path(dir.path(), None).unwrap());
        let engine = engine_sim::spawn(
            engine_sim::EngineConfig {
                time_scale: 0.0,
                ..engine_sim::EngineConfig::default()
            },
            engine_sim::ServeOptions {
                tokenizer: Some(Arc::clone(&engine_tokenizer)),
                ..engine_sim::ServeOptions::default()
            },
        )
        .await
        .unwrap();
        let settings = Settings::from_args([
            "router",
            "--port",
            "0",
            "--prometheus-port",
            "0",
            "--worker-urls",
            &engine.url(),
            "--tokenizer-path",
            dir.path().to_str().unwrap(),
            "--block-size",
            "16",
        ])
        .unwrap();
        let app = App::start(&settings).await.unwrap();
        let url = format!("http://{}", app.addr());
        let client = Client::builder(TokioExecutor::new()).build_http();
        let tokenizers = settings.router.tokenizers.clone();

        // The strategy's values are drawn synchronously; each case is then
        // checked against the running router and engine.
        let mut runner = TestRunner::new(Config {
            cases: 12,
            ..Config::default()
        });
        let mut bodies = Vec::new();
        for _ in 0..12 {
            bodies.push(conversation().new_tree(&mut runner).unwrap().current());
        }
        for body in bodies {
            let bytes = body.to_string();
            // What the router routes on: the code path of every request.
            let RoutingInputBuf::Tokens(router_ids) = tokenizers.route(
                ApiKind::ChatCompletions,
                bytes.as_bytes(),
                "m",
                RoutingInputBuf::None,
            ) else {
                panic!("{family:?}: the router did not route on tokens for {body}");
            };
            // What the engine counts, from its own copy of the model.
            let parsed = parse_request_with(
                Endpoint::Chat,
                bytes.as_bytes(),
                Some(&engine_tokenizer),
                None,
            )
            .unwrap();
            let Prompt::Tokens(engine_ids) = parsed.prompt else {
                panic!("{family:?}: the engine did not tokenize")
            };
            assert_eq!(router_ids, engine_ids, "{family:?}: {body}");

            // Through HTTP: prompt_tokens, then the repeat's cached tokens.
            let (status, first) = post(&client, &url, &body).await;
            assert_eq!(status, StatusCode::OK, "{family:?}: {first}");
            assert_eq!(
                first["usage"]["prompt_tokens"],
                router_ids.len(),
                "{family:?}"
            );
            let (_, again) = post(&client, &url, &body).await;
            // The engine reuses whole blocks and recomputes the last token.
            let expected = (router_ids.len() - 1) / BLOCK * BLOCK;
            let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            assert_eq!(cached as usize, expected, "{family:?}: {again}");
        }
        let entry = tokenizers.for_model("sim-model").unwrap();
        assert_eq!(entry.failed(), 0, "{family:?}");
        app.stop().await;
        let _ = engine.shutdown().await;
    }
}
