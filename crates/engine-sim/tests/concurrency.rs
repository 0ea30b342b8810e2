//! Many concurrent clients on a multi-threaded runtime: every response
//! completes, load and engine state return to zero.

mod common;

use std::time::Duration;

use common::{post, sse_data};
use engine_sim::{EngineConfig, ModelConfig, ServeOptions, spawn};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_and_json_all_complete() {
    let config = EngineConfig {
        // Model milliseconds become real microseconds.
        time_scale: 0.001,
        model: ModelConfig {
            max_num_seqs: 8,
            ..ModelConfig::default()
        },
        ..EngineConfig::default()
    };
    let engine = spawn(config, ServeOptions::default()).await.expect("spawn");
    let addr = engine.addr();
    let shared_prefix = "system prompt shared by everyone. ".repeat(8);
    let mut tasks = Vec::new();
    for i in 0..48 {
        let prompt = format!("{shared_prefix} question {i}");
        tasks.push(tokio::spawn(async move {
            let stream = i % 2 == 0;
            let reply = post(
                addr,
                "/v1/completions",
                &json!({"prompt": prompt, "max_tokens": 6, "stream": stream,
                        "stream_options": {"include_usage": true}}),
            )
            .await;
            assert_eq!(reply.status, 200);
            if stream {
                let data = sse_data(&reply.text());
                assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
                let usage: serde_json::Value =
                    serde_json::from_str(&data[data.len() - 2]).expect("usage chunk");
                usage["usage"]["completion_tokens"].as_u64()
            } else {
                reply.json()["usage"]["completion_tokens"].as_u64()
            }
        }));
    }
    let all = tokio::time::timeout(Duration::from_secs(60), async {
        let mut tokens = 0;
        for task in tasks {
            tokens += task.await.expect("task").expect("usage");
        }
        tokens
    })
    .await
    .expect("all requests finish");
    assert_eq!(all, 48 * 6);
    let stats = engine.stats();
    assert_eq!(stats.requests_finished, 48);
    assert_eq!((stats.running, stats.waiting), (0, 0));
    assert_eq!(stats.kv_cache_usage, 0.0);
    assert!(stats.prefix_cache_hits > 0, "the shared prefix was reused");
    assert_eq!(engine.server_load(), 0);
    engine.shutdown().await;
}
