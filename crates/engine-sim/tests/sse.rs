//! Streaming: valid SSE framing, valid JSON, order, `[DONE]`, usage.

mod common;

use common::{post, sse_data};
use engine_sim::{EngineConfig, ServeOptions, spawn};
use serde_json::{Value, json};

fn fast() -> EngineConfig {
    EngineConfig {
        time_scale: 0.0,
        ..EngineConfig::default()
    }
}

fn chunks(body: &str) -> (Vec<Value>, bool) {
    let data = sse_data(body);
    let done = data.last().map(String::as_str) == Some("[DONE]");
    let json = data
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("bad JSON {d}: {e}")))
        .collect();
    (json, done)
}

#[tokio::test]
async fn chat_stream_is_ordered_and_ends_with_usage_and_done() {
    let engine = spawn(fast(), ServeOptions::default()).await.expect("spawn");
    let messages = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]);
    let reply = post(
        engine.addr(),
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 5, "stream": true,
                "stream_options": {"include_usage": true}, "unknown_field": 1}),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.headers["x-worker-id"], engine.engine_id());
    assert!(
        reply.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let (chunks, done) = chunks(&reply.text());
    assert!(done, "stream must end with [DONE]");
    let id = chunks[0]["id"].clone();
    assert!(id.as_str().unwrap().starts_with("chatcmpl-"));
    assert!(
        chunks
            .iter()
            .all(|c| c["id"] == id && c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    // role chunk, 5 token chunks, finish chunk, usage chunk
    assert_eq!(chunks.len(), 8);
    let text: String = chunks[1..6]
        .iter()
        .map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .expect("content")
                .to_owned()
        })
        .collect();
    assert!(
        chunks[..6]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null())
    );
    assert_eq!(chunks[6]["choices"][0]["finish_reason"], "length");
    let usage_chunk = &chunks[7];
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 5);
    assert!(usage_chunk["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(chunks[..7].iter().all(|c| c.get("usage").is_none()));

    // The same request without streaming returns the same text.
    let full = post(
        engine.addr(),
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 5}),
    )
    .await
    .json();
    assert_eq!(full["choices"][0]["message"]["content"], text.as_str());
    engine.shutdown().await;
}

#[tokio::test]
async fn completions_stream_without_usage_has_no_usage_chunk() {
    let engine = spawn(fast(), ServeOptions::default()).await.expect("spawn");
    let reply = post(
        engine.addr(),
        "/v1/completions",
        &json!({"prompt": "once upon a time", "max_tokens": 3, "stream": true}),
    )
    .await;
    let (chunks, done) = chunks(&reply.text());
    assert!(done);
    assert_eq!(chunks.len(), 4);
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "text_completion" && c.get("usage").is_none())
    );
    assert!(chunks[..3].iter().all(|c| {
        c["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
    }));
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    engine.shutdown().await;
}

#[tokio::test]
async fn continuous_usage_reports_growing_completion_tokens() {
    let engine = spawn(fast(), ServeOptions::default()).await.expect("spawn");
    let reply = post(
        engine.addr(),
        "/v1/completions",
        &json!({"prompt": "count with me", "max_tokens": 3, "stream": true,
                "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
    )
    .await;
    let (chunks, _) = chunks(&reply.text());
    let counts: Vec<u64> = chunks
        .iter()
        .map(|c| {
            c["usage"]["completion_tokens"]
                .as_u64()
                .expect("usage on every chunk")
        })
        .collect();
    assert_eq!(counts, vec![1, 2, 3, 3, 3]);
    engine.shutdown().await;
}
