//! The HTTP surface: endpoints, errors, identity header, load accounting.

mod common;

use std::time::Duration;

use common::{get, post, send};
use engine_sim::{EngineConfig, ServeOptions, spawn};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn fast() -> EngineConfig {
    EngineConfig {
        time_scale: 0.0,
        ..EngineConfig::default()
    }
}

#[tokio::test]
async fn metadata_endpoints_answer_like_vllm() {
    let engine = spawn(fast(), ServeOptions::default()).await.expect("spawn");
    let addr = engine.addr();
    let health = get(addr, "/health").await;
    assert_eq!(health.status, 200);
    assert!(health.body.is_empty());
    assert_eq!(get(addr, "/load").await.json(), json!({"server_load": 0}));
    let models = get(addr, "/v1/models").await.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "sim-model");
    let metrics = get(addr, "/metrics").await;
    assert!(
        metrics.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let text = metrics.text();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "engine_sim:kv_transfers_valid_total",
        "engine_sim:kv_transfers_invalid_total",
    ] {
        assert!(
            text.contains(&format!("{name}{{engine=\"0\",model_name=\"sim-model\"}} ")),
            "{name} missing"
        );
    }
    // Every response names the engine, errors included.
    for path in ["/health", "/load", "/v1/models", "/metrics", "/nope"] {
        let reply = get(addr, path).await;
        assert_eq!(reply.headers["x-worker-id"], engine.engine_id(), "{path}");
    }
    assert_eq!(get(addr, "/nope").await.status, 404);
    assert_eq!(get(addr, "/v1/completions").await.status, 405);
    engine.shutdown().await;
}

#[tokio::test]
async fn bad_requests_get_vllm_style_errors() {
    let engine = spawn(fast(), ServeOptions::default()).await.expect("spawn");
    let addr = engine.addr();
    let cases: [(&str, &str, u16, &str); 6] = [
        (
            "/v1/chat/completions",
            "{\"messages\": [",
            400,
            "Invalid JSON",
        ),
        ("/v1/chat/completions", "[1, 2]", 400, "JSON object"),
        (
            "/v1/chat/completions",
            "{\"model\": \"sim-model\"}",
            400,
            "messages",
        ),
        ("/v1/completions", "{\"prompt\": 5}", 400, "Invalid request"),
        (
            "/v1/completions",
            "{\"prompt\": \"hi\", \"model\": \"gpt-9\"}",
            404,
            "gpt-9",
        ),
        (
            "/v1/completions",
            "{\"prompt\": \"hi\", \"max_tokens\": 40000}",
            400,
            "maximum context length",
        ),
    ];
    for (path, body, status, needle) in cases {
        let reply = send(addr, "POST", path, Some(body), &[]).await;
        assert_eq!(reply.status.as_u16(), status, "{body}");
        let error = reply.json();
        assert_eq!(error["error"]["code"], status);
        let message = error["error"]["message"].as_str().expect("message");
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        assert_eq!(reply.headers["x-worker-id"], engine.engine_id());
    }
    // Unknown fields are ignored, token-id prompts are accepted.
    let ok = post(
        addr,
        "/v1/completions",
        &json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "top_k": 5, "foo": {"bar": 1}}),
    )
    .await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.json()["usage"]["prompt_tokens"], 5);
    assert_eq!(get(addr, "/load").await.json()["server_load"], 0);
    engine.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_mid_stream_frees_load_and_engine_slot() {
    let config = EngineConfig::default(); // real latency model, paused clock
    let engine = spawn(config, ServeOptions::default()).await.expect("spawn");
    let body = json!({"prompt": "stream a lot", "max_tokens": 10_000, "stream": true}).to_string();
    let mut stream = TcpStream::connect(engine.addr()).await.expect("connect");
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut buf = vec![0u8; 4096];
    let mut seen = String::new();
    while !seen.contains("data: ") {
        let n = stream.read(&mut buf).await.expect("read");
        assert!(n > 0);
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(seen.starts_with("HTTP/1.1 200"));
    assert_eq!(engine.server_load(), 1);
    assert_eq!(engine.stats().running, 1);
    drop(stream);
    // Give the server a moment (of paused time) to notice the close.
    for _ in 0..50 {
        if engine.server_load() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(engine.server_load(), 0);
    let stats = engine.stats();
    assert_eq!(stats.running, 0);
    assert_eq!(stats.requests_aborted, 1);
    assert_eq!(stats.kv_cache_usage, 0.0);
    engine.shutdown().await;
}

#[tokio::test]
async fn many_engines_run_in_one_process() {
    let mut engines = Vec::new();
    for _ in 0..4 {
        engines.push(spawn(fast(), ServeOptions::default()).await.expect("spawn"));
    }
    let mut ids = std::collections::HashSet::new();
    for engine in &engines {
        let reply = post(engine.addr(), "/v1/completions", &json!({"prompt": "hi"})).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.json()["usage"]["completion_tokens"], 16);
        ids.insert(reply.headers["x-worker-id"].to_str().unwrap().to_owned());
    }
    assert_eq!(ids.len(), 4);
    for engine in engines {
        engine.shutdown().await;
    }
}

#[tokio::test(start_paused = true)]
async fn graceful_shutdown_finishes_in_flight_streams() {
    let engine = spawn(EngineConfig::default(), ServeOptions::default())
        .await
        .expect("spawn");
    let addr = engine.addr();
    let response = common::open(
        addr,
        "POST",
        "/v1/completions",
        Some(&json!({"prompt": "long answer", "max_tokens": 50, "stream": true}).to_string()),
        &[],
    )
    .await
    .expect("headers");
    let shutdown = tokio::spawn(engine.shutdown());
    use http_body_util::BodyExt;
    let body = response
        .into_body()
        .collect()
        .await
        .expect("complete body")
        .to_bytes();
    assert!(String::from_utf8_lossy(&body).ends_with("data: [DONE]\n\n"));
    shutdown.await.expect("shutdown");
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "no longer listening"
    );
}
