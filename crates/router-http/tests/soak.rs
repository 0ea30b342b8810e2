//! The soak: thousands of requests with faults injected at random (5xx,
//! resets mid-body, stalls before and after headers) and clients that go
//! away at random points. Afterwards every worker's load is exactly 0, no
//! decrement was clamped, no admission permit is held, and the router's open
//! upstream connections are back within its idle-pool bound.
//!
//! `SOAK_REQUESTS` sets the count (default 10,000); the figures are printed.

mod common;

use common::{Connection, Fixture, chat_body};
use engine_sim::EngineConfig;
use http_body_util::BodyExt;
use router_http::RouterConfig;
use std::collections::HashSet;
use std::time::{Duration, Instant};
use worker_lifecycle::{RandomSource, SplitMix64};

const CONCURRENCY: usize = 32;
const MAX_IDLE_PER_WORKER: usize = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_random_faults_and_cancellations_leaves_no_load_behind() {
    let requests: usize = std::env::var("SOAK_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let mut config = RouterConfig {
        policy: lb_policies::PolicyConfig::named("cache_aware"),
        stream_idle_timeout: Duration::from_secs(5),
        ..RouterConfig::default()
    };
    config.client.pool_max_idle_per_host = MAX_IDLE_PER_WORKER;
    // Faults are injected at random: keep every worker routable.
    config.worker_options.breaker.enabled = false;
    config.retry_budget.min_per_second = 1_000_000;
    let engines = vec![EngineConfig::instant(); 3];
    let fixture = Fixture::start(config, engines).await;
    let engine_ports: HashSet<u16> = fixture.engines.iter().map(|e| e.addr().port()).collect();

    let started = Instant::now();
    let mut seed = 0x50A4_u64;
    let mut tasks = tokio::task::JoinSet::new();
    let mut outcomes = [0usize; 4]; // completed, failed, cancelled, error status
    for index in 0..requests {
        // Each seed is SplitMix64's first output from the one before.
        seed = SplitMix64::new(seed).next_u64();
        let addr = fixture.addr;
        tasks.spawn(one_request(addr, index, seed));
        if tasks.len() >= CONCURRENCY {
            let outcome = tasks.join_next().await.unwrap().unwrap();
            outcomes[outcome] += 1;
        }
    }
    while let Some(outcome) = tasks.join_next().await {
        outcomes[outcome.unwrap()] += 1;
    }
    let elapsed = started.elapsed();

    fixture.assert_all_loads_return_to_zero().await;
    let processed: u64 = fixture.workers().iter().map(|w| w.processed()).sum();
    assert!(
        processed >= requests as u64 / 2,
        "only {processed} processed"
    );

    // Idle connections beyond the pool bound are closed as they return;
    // give the pool a moment to settle, then count the router's sockets.
    let deadline = Instant::now() + Duration::from_secs(10);
    let bound = MAX_IDLE_PER_WORKER * engine_ports.len();
    let mut open = upstream_connections(&engine_ports);
    while open > bound && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        open = upstream_connections(&engine_ports);
    }
    eprintln!(
        "soak: {requests} requests in {elapsed:?} ({:.0}/s); completed {}, body failed {}, \
         cancelled {}, error status {}; processed {processed}; retries {}; \
         open upstream connections after: {open} (bound {bound})",
        requests as f64 / elapsed.as_secs_f64(),
        outcomes[0],
        outcomes[1],
        outcomes[2],
        outcomes[3],
        fixture.router.metrics().retries.get(),
    );
    assert!(
        open <= bound,
        "{open} upstream connections still open (bound {bound})"
    );
}

/// One request with a fault and a client behaviour drawn from `seed`.
/// Returns 0 completed, 1 body failed, 2 cancelled by the client, 3 error status.
async fn one_request(addr: std::net::SocketAddr, index: usize, seed: u64) -> usize {
    let fault = match seed % 10 {
        0 => Some("status=500"),
        1 => Some("reset-mid-body"),
        2 => Some("stall-after-headers=30ms"),
        3 => Some("stall-before-headers=20ms"),
        _ => None,
    };
    let stream = (seed >> 8).is_multiple_of(2);
    let cancel_after = match (seed >> 16) % 8 {
        0 => Some(Duration::from_micros((seed >> 24) % 3_000)),
        _ => None,
    };
    let prefix =
        ["You are a helpful assistant.", "You are a terse assistant."][(seed >> 32) as usize % 2];
    let body = chat_body(&format!("{prefix} question {}", index % 97), stream);
    let work = async move {
        let mut connection = Connection::open(addr).await;
        let headers: Vec<(&str, &str)> = fault.map(|f| ("x-sim-fault", f)).into_iter().collect();
        let response = connection
            .send("POST", "/v1/chat/completions", &headers, body)
            .await;
        let status = response.status();
        match response.into_body().collect().await {
            Ok(_) if status.is_success() => 0,
            Ok(_) => 3,
            Err(_) => 1,
        }
    };
    match cancel_after {
        Some(after) => tokio::time::timeout(after, work).await.unwrap_or(2),
        None => work.await,
    }
}

/// Established TCP connections whose remote port is one of the engines':
/// the router's side of its upstream connections (this process is the only
/// one talking to these freshly bound ports).
fn upstream_connections(engine_ports: &HashSet<u16>) -> usize {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return 0;
    };
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let remote_port = fields
                .get(2)
                .and_then(|remote| remote.rsplit(':').next())
                .and_then(|port| u16::from_str_radix(port, 16).ok());
            fields.get(3) == Some(&"01") && remote_port.is_some_and(|p| engine_ports.contains(&p))
        })
        .count()
}
