//! `--sustain SECS`: sustained load with unique prompts, RSS over time

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use router_http::{Router, RouterConfig};
use tokio::net::TcpListener;

use super::load::{make_bodies, run_load};
use super::threads::{spawn_runtime, thread_id};
use super::{Case, round3};

/// Sustained load with unique prompts; prints RSS over time as JSON lines.
pub(super) fn sustain(upstream: SocketAddr, duration: Duration) {
    let (addr, _) = spawn_runtime("router-sustain", move |rt| {
        rt.block_on(async move {
            let mut config = RouterConfig {
                policy: lb_policies::PolicyConfig::named("cache_aware"),
                eviction_interval: Duration::from_secs(10),
                ..RouterConfig::default()
            };
            config.policy.cache_aware.max_tree_size = 1 << 20;
            config.client.pool_max_idle_per_host = 1024;
            let router = Router::new(config).expect("config");
            // Two workers (two data-parallel ranks of the same upstream), so
            // the tree holds two tenants and eviction works per tenant.
            for rank in [0, 1] {
                router
                    .add_worker(
                        &format!("http://127.0.0.1:{}", upstream.port()),
                        Some(rank),
                        None,
                    )
                    .expect("worker");
            }
            let background = router.spawn_background();
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            tokio::spawn(async move {
                let _background = background; // as long as the server runs
                router.serve(listener, std::future::pending()).await;
            });
            (addr, thread_id())
        })
    });
    let case = Case {
        body_bytes: 1024,
        stream: false,
        connections: 32,
    };
    // One load-generator thread for the whole run: the figure is the
    // process's RSS, and a thread (and malloc arena) per round would grow it
    // on its own.
    spawn_runtime("loadgen-sustain", move |rt| {
        rt.block_on(async move {
            let started = Instant::now();
            let mut served = 0usize;
            let mut round = 0usize;
            while started.elapsed() < duration {
                // Fresh prompts every round: the tree keeps growing until evicted.
                let bodies = Arc::new(make_unique_bodies(case, 4096, round));
                round += 1;
                let window =
                    Duration::from_secs(30).min(duration.saturating_sub(started.elapsed()));
                served += run_load(addr, case, bodies, window, false).await.len();
                println!(
                    "{}",
                    serde_json::json!({
                        "elapsed_s": started.elapsed().as_secs(),
                        "requests": served,
                        "rss_mb": round3(rss_bytes() as f64 / 1e6),
                    })
                );
            }
        });
    });
}

fn make_unique_bodies(case: Case, count: usize, round: usize) -> Vec<Bytes> {
    make_bodies(case, count)
        .into_iter()
        .enumerate()
        .map(|(i, body)| {
            let text =
                String::from_utf8_lossy(&body).replacen("question ", &format!("r{round} q{i} "), 1);
            Bytes::from(text)
        })
        .collect()
}

/// Resident set size of this process.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|statm| statm.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}
