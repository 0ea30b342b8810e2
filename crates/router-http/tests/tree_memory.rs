//! The prefix trees' memory budget, seen as an operator sees it: a stream
//! of distinct chat prompts through the router keeps `/metrics`'
//! `router_tree_memory_bytes` within `max_tree_bytes` at every scrape, counts
//! the evictions, still routes the latest prompts by affinity, and
//! `/workers` shows each worker's share of the tree.

mod common;

use common::{Connection, Fixture, call, chat_body, json};
use engine_sim::EngineConfig;
use http::StatusCode;
use http_body_util::BodyExt;
use router_http::RouterConfig;

const BUDGET: u64 = 128 * 1024;
const CONCURRENCY: usize = 8;

/// The value of the first sample of `name` whose line contains every one of
/// `labels`.
fn sample(metrics: &str, name: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|line| line.starts_with(name))
        .filter(|line| {
            let rest = &line[name.len()..];
            rest.starts_with(' ') || rest.starts_with('{')
        })
        .find(|line| labels.iter().all(|l| line.contains(l)))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
}

fn prompt(i: usize) -> String {
    // Distinct from the first characters on, about 1 KB.
    format!("{i:08} {}", "lorem ipsum dolor sit amet ".repeat(38))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_prompts_stay_within_the_tree_budget() {
    let mut config = RouterConfig {
        policy: lb_policies::PolicyConfig::named("cache_aware"),
        ..RouterConfig::default()
    };
    config.policy.cache_aware.max_tree_bytes = BUDGET;
    let fixture = Fixture::start(config, vec![EngineConfig::instant(); 2]).await;

    let mut connections = Vec::new();
    for _ in 0..CONCURRENCY {
        connections.push(Connection::open(fixture.addr).await);
    }
    let mut sent = 0;
    for round in 0..60 {
        let mut tasks = tokio::task::JoinSet::new();
        for mut connection in connections.drain(..) {
            let body = chat_body(&prompt(sent), false);
            sent += 1;
            tasks.spawn(async move {
                let response = connection
                    .send("POST", "/v1/chat/completions", &[], body)
                    .await;
                let status = response.status();
                response.into_body().collect().await.unwrap();
                (connection, status)
            });
        }
        while let Some(done) = tasks.join_next().await {
            let (connection, status) = done.unwrap();
            assert_eq!(status, StatusCode::OK);
            connections.push(connection);
        }
        if round % 10 == 9 {
            let (_, _, metrics) = call(fixture.addr, "GET", "/metrics", &[], "").await;
            let metrics = String::from_utf8_lossy(&metrics);
            let used = sample(&metrics, "router_tree_memory_bytes", &[]).unwrap();
            // Within the budget but for what the inserts in flight add
            // (about 1.3 KB each for these prompts).
            assert!(
                used <= (BUDGET + CONCURRENCY as u64 * 2048) as f64,
                "{used} bytes after {sent} prompts"
            );
        }
    }
    let (_, _, metrics) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8_lossy(&metrics);
    assert_eq!(
        sample(&metrics, "router_tree_memory_budget_bytes", &[]),
        Some(BUDGET as f64)
    );
    let evicted = sample(&metrics, "router_tree_evictions_total", &[]).unwrap();
    assert!(evicted > 0.0, "480 KB of prompts through a 128 KiB budget");
    let text = [
        r#"pool="regular""#,
        r#"model="sim-model""#,
        r#"tree="text""#,
    ];
    let bytes = sample(&metrics, "router_tree_bytes", &text).unwrap();
    assert!(
        bytes > 0.0 && bytes <= (BUDGET + 16 * 1024) as f64,
        "{bytes}"
    );
    assert!(sample(&metrics, "router_tree_entries", &text).unwrap() > 0.0);
    assert_eq!(
        sample(&metrics, "router_tree_evicted_entries_total", &text),
        Some(evicted),
        "one tree charged the budget"
    );

    // The newest prompt is still in the tree: sent again, it is an
    // affinity hit. It is sent alone, after the concurrent rounds: entries
    // stamped within one tick of the tree's coarse clock (about 1 ms) are
    // equally old to the eviction, so the last prompt of a concurrent
    // round may go before its round-mates.
    let newest = prompt(sent);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        chat_body(&newest, false),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (_, _, metrics) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8_lossy(&metrics).into_owned();
    let hits = |metrics: &str| {
        sample(
            metrics,
            "router_policy_decisions_total",
            &[r#"reason="cache_hit""#],
        )
        .unwrap_or(0.0)
    };
    let before = hits(&metrics);
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        chat_body(&newest, false),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (_, _, metrics) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    assert_eq!(hits(&String::from_utf8_lossy(&metrics)), before + 1.0);

    // `/workers` shows each worker's part of the tree.
    let (status, _, body) = call(fixture.addr, "GET", "/workers", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    let body = json(&body);
    let workers = body.as_array().expect("a list of workers");
    assert_eq!(workers.len(), 2);
    let shares: Vec<f64> = workers
        .iter()
        .map(|w| w["prefix_tree"]["share"].as_f64().unwrap())
        .collect();
    assert!(
        workers
            .iter()
            .all(|w| w["prefix_tree"]["symbols"].as_u64().unwrap() > 0),
        "{body}"
    );
    assert!(
        (shares.iter().sum::<f64>() - 1.0).abs() < 1e-9,
        "{shares:?}"
    );
}
