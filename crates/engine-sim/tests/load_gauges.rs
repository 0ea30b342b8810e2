//! `vllm:num_requests_running` and `vllm:num_requests_waiting` are the
//! scheduler's running batch and waiting queue at the instant of the
//! scrape: what a router polling the engine for its load reads.

mod common;

use std::time::Duration;

use common::get;
use engine_sim::metrics::sample;
use engine_sim::{EngineConfig, ModelConfig, ServeOptions, spawn};
use serde_json::json;

/// `(running, waiting, server_load)` from one scrape.
async fn scrape(addr: std::net::SocketAddr) -> (usize, usize, usize) {
    let text = get(addr, "/metrics").await.text();
    let read = |name: &str| sample(&text, name).unwrap_or_else(|| panic!("{name} in {text}"));
    (
        read("vllm:num_requests_running") as usize,
        read("vllm:num_requests_waiting") as usize,
        read("engine_sim:server_load") as usize,
    )
}

/// A streaming completion of `max_tokens`, read to its end on its own task.
fn stream(addr: std::net::SocketAddr, max_tokens: u32) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let body = json!({"prompt": "count the load", "max_tokens": max_tokens, "stream": true});
        let reply = common::send(
            addr,
            "POST",
            "/v1/completions",
            Some(&body.to_string()),
            &[],
        )
        .await;
        assert_eq!(reply.status, 200);
        assert!(reply.text().ends_with("data: [DONE]\n\n"));
    })
}

fn two_slots(time_scale: f64) -> EngineConfig {
    EngineConfig {
        model: ModelConfig {
            max_num_seqs: 2,
            ..ModelConfig::default()
        },
        time_scale,
        ..EngineConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gauges_are_the_running_batch_and_the_waiting_queue() {
    // Real time: five requests of 10,000 tokens keep the engine busy for
    // over a minute, so nothing finishes while the test looks.
    let engine = spawn(two_slots(1.0), ServeOptions::default())
        .await
        .expect("spawn");
    let addr = engine.addr();
    assert_eq!(scrape(addr).await, (0, 0, 0));
    let long: Vec<_> = (0..5).map(|_| stream(addr, 10_000)).collect();
    // Requests that arrive during a step wait for the next one to be
    // admitted; once the second slot is taken, nothing moves.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (running, waiting, server_load) = scrape(addr).await;
        // Counted by the HTTP server before it reaches the scheduler.
        assert!(running + waiting <= server_load);
        if running == 2 && server_load == 5 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "requests not seen");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Two slots: two run, three wait; the HTTP server has all five.
    let scraped = scrape(addr).await;
    assert_eq!(scraped, (2, 3, 5));
    let stats = engine.stats();
    assert_eq!((stats.running, stats.waiting), (2, 3));
    for task in long {
        task.abort();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while scrape(addr).await != (0, 0, 0) {
        assert!(tokio::time::Instant::now() < deadline, "aborts not seen");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    engine.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_scrape_reports_the_queues_of_its_own_instant() {
    // Requests of different lengths on two slots: sequences finish and
    // waiting ones are admitted at many scheduler steps. Whenever the
    // engine's state read just before a scrape equals the state read just
    // after it, nothing changed in between, and the scrape must say
    // exactly that state.
    let engine = spawn(two_slots(0.25), ServeOptions::default())
        .await
        .expect("spawn");
    let addr = engine.addr();
    let tasks: Vec<_> = (0..8u32).map(|i| stream(addr, 20 + 15 * i)).collect();
    let (mut agreed, mut with_waiting) = (0, 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !tasks.iter().all(|t| t.is_finished()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "streams did not end"
        );
        let before = engine.stats();
        let (running, waiting, _) = scrape(addr).await;
        let after = engine.stats();
        assert!(running <= 2, "more running than slots: {running}");
        if (before.running, before.waiting) == (after.running, after.waiting) {
            assert_eq!((running, waiting), (before.running, before.waiting));
            agreed += 1;
            if waiting > 0 {
                with_waiting += 1;
            }
        }
    }
    for task in tasks {
        task.await.expect("stream");
    }
    assert!(
        agreed >= 5,
        "only {agreed} scrapes between two equal states"
    );
    assert!(with_waiting >= 1, "no scrape saw a waiting request");
    assert_eq!(scrape(addr).await, (0, 0, 0));
    engine.shutdown().await;
}
