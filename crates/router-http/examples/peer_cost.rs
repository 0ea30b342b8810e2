//! What sharing routing choices between replicas costs a replica
//! (`RouterConfig::peers`): queueing a choice on the request path, encoding
//! the batches, and recording a peer's batch in the tree, per choice, for
//! distinct 1 KB chat routing texts over 8 workers (`cache_aware`), beside
//! the replica's own decision for the same texts.
//!
//! ```sh
//! cargo run --release -p router-http --example peer_cost -- --choices 20000
//! ```
//! Prints nanoseconds per choice for each step (the best of 5 rounds, each
//! on fresh trees).

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::Arc;
use std::time::Instant;

use lb_policies::{PolicyConfig, PolicyRegistry, RequestContext, RoutingInput};
use router_http::{PeerConfig, PeerSync};
use worker_lifecycle::{Endpoint, RoleKind, RolePool, WorkerOptions, WorkerRole, WorkerSpec};

const MODEL: &str = "m";
const WORKERS: usize = 8;

fn pool() -> RolePool {
    let registry = PolicyRegistry::new(PolicyConfig::named("cache_aware")).expect("policy");
    let pool =
        RolePool::fixed(RoleKind::Regular, WorkerOptions::default(), registry).expect("pool");
    for i in 0..WORKERS {
        let endpoint = Endpoint::new(&format!("http://10.0.0.{i}:8000"), None).expect("url");
        pool.add(WorkerSpec::new(WorkerRole::Regular, endpoint).with_model(MODEL))
            .expect("worker");
    }
    pool.policies().policy(MODEL).expect("instance");
    pool
}

/// `n` distinct chat routing texts of about 1 KB: a shared system prompt,
/// then a user message that begins with a number of its own.
fn texts(n: usize) -> Vec<String> {
    let system = "system: You are a helpful assistant. ".repeat(8);
    let filler = "Tell me more about the weather and the sea. ".repeat(16);
    (0..n)
        .map(|i| {
            format!(
                "{system}user: {}{i} {filler}",
                i.wrapping_mul(2_654_435_761)
            )
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args
        .iter()
        .position(|a| a == "--choices")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let texts = texts(n);
    let per = |start: Instant| start.elapsed().as_nanos() as f64 / n as f64;
    let mut best = [f64::MAX; 4];
    let mut bytes = 0usize;
    for _ in 0..5 {
        // The sender: its own decisions, then the choices queued.
        let sender = pool();
        let workers: Arc<[_]> = sender.workers();
        let start = Instant::now();
        let mut chosen = Vec::with_capacity(n);
        for text in &texts {
            let ctx = RequestContext::new(MODEL).with_text(text);
            let decision = sender
                .policies()
                .select(&workers, &ctx)
                .expect("policy")
                .expect("a worker");
            chosen.push(decision.index);
        }
        best[0] = best[0].min(per(start));
        let sync = PeerSync::new(PeerConfig {
            urls: vec!["http://127.0.0.1:9".into()],
            token: Some("t".into()),
            max_pending: n,
            ..PeerConfig::default()
        })
        .expect("config")
        .expect("sharing");
        let start = Instant::now();
        for (text, &i) in texts.iter().zip(&chosen) {
            sync.share(MODEL, &workers[i], RoutingInput::Text(text));
        }
        best[1] = best[1].min(per(start));
        let start = Instant::now();
        let batches = sync.take_batches();
        best[2] = best[2].min(per(start));
        bytes = batches.iter().map(|(b, _)| b.len()).sum();
        // The receiver: the peer's batches into its own tree.
        let receiver = pool();
        let start = Instant::now();
        let mut recorded = 0;
        for (body, _) in &batches {
            let received = sync
                .receive(receiver.policies(), receiver.workers(), body)
                .expect("valid");
            recorded += received.recorded;
        }
        best[3] = best[3].min(per(start));
        assert_eq!(recorded as usize, n, "every choice recorded");
    }
    println!(
        "{n} choices of about 1 KB, {WORKERS} workers, cache_aware; ns per choice (best of 5):"
    );
    println!("  own decision (select + tree insert): {:>8.0}", best[0]);
    println!("  queue for the peers (share):         {:>8.0}", best[1]);
    println!("  encode the batches:                  {:>8.0}", best[2]);
    println!("  record a peer's batch (receive):     {:>8.0}", best[3]);
    println!(
        "  batch bytes per choice:              {:>8.0}",
        bytes as f64 / n as f64
    );
}
