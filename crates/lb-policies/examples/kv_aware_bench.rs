//! Per-decision cost of `kv_aware` (feature `kv-block-index`) at 8, 64 and 1,000
//! workers, beside `cache_aware` on the same token requests (by its gate,
//! and by the cost, `cache_aware_cost`).
//!
//! ```text
//! cargo run --release -p lb-policies --features kv-block-index --example kv_aware_bench -- --json
//! ```
//!
//! Requests are the first `--requests` (default 20,000) texts of set R of
//! the radix-affinity workload, tokenized with its synthetic tokenizer
//! (4 characters a token). Before timing, every text of set W is stored
//! (as engine events, 16-token blocks) on its owner `owner(sp) % workers`
//! and routed once to it, so the index and the fallback tree agree. Three
//! fleets: every stream live, half live (even workers), none live (all
//! cold: the approximate tree decides), and every stream live with every
//! engine reporting a queue (`kv_aware_overloaded`: the overload state,
//! the gate plus the tree's memory). Decisions are timed one by one;
//! loads are live as in `decision_bench`. Prints one JSON line with
//! `--json`, else a table; decision reasons go to stderr.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use kv_block_index::{EngineHash, IndexConfig, KvEvent, KvIndex};
use lb_policies::{
    Backend, BasicBackend, CacheAware, CacheAwareConfig, KvAware, KvSources, KvStreams,
    MembershipEvent, Policy, PolicyState, RequestContext, TokenChoice,
};
use radix_affinity::workload::{self, Variant, Workload};

const BLOCK: usize = 16;

fn summarize(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let at = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize];
    (at(0.5), at(0.99))
}

fn tokens_of(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    workload::tokenize(text, &mut out);
    out
}

/// Times `policy` over `route`, with live loads; returns (median, p99) ns.
fn run(
    policy: &dyn Policy<BasicBackend>,
    fleet: &[BasicBackend],
    route: &[Vec<u32>],
) -> (f64, f64) {
    let mut window = VecDeque::new();
    let mut samples = Vec::with_capacity(route.len());
    for tokens in route {
        let ctx = RequestContext::new("bench").with_tokens(tokens);
        let t0 = Instant::now();
        let decision = policy.select(fleet, &ctx);
        samples.push(t0.elapsed().as_nanos() as f64);
        if let Some(d) = decision {
            fleet[d.index].begin_request();
            window.push_back(d.index);
            if window.len() > 4 * fleet.len()
                && let Some(done) = window.pop_front()
            {
                fleet[done].end_request();
            }
        }
    }
    summarize(samples)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let requests = args
        .iter()
        .position(|a| a == "--requests")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(20_000);
    let generator = Workload::new(Variant::Ascii);
    let warm: Vec<(usize, Vec<u32>)> = generator
        .warm
        .iter()
        .map(|r| (workload::owner(r.sp), tokens_of(&r.text)))
        .collect();
    let route: Vec<Vec<u32>> = generator
        .routes(requests)
        .iter()
        .map(|r| tokens_of(&r.text))
        .collect();

    let mut rows = Vec::new();
    for workers in [8usize, 64, 1000] {
        let fleet: Vec<BasicBackend> = (0..workers)
            .map(|i| BasicBackend::new(format!("http://worker-{i}:8000")))
            .collect();
        let index = Arc::new(KvIndex::new(IndexConfig::default()));
        let streams = Arc::new(KvStreams::new());
        let ids: Vec<_> = fleet
            .iter()
            .map(|b| index.register_worker(b.key().to_owned()))
            .collect();
        let kv = KvAware::new(
            CacheAwareConfig::default(),
            KvSources::new(Arc::clone(&index), Arc::clone(&streams)),
        )
        .expect("valid");
        // The same scores placed by the threshold gate (`kv_aware_gate`):
        // what the least-cost choice costs over it, in the same run.
        let gate = KvAware::gated(
            CacheAwareConfig::default(),
            KvSources::new(Arc::clone(&index), Arc::clone(&streams)),
        )
        .expect("valid");
        let cache = CacheAware::new(CacheAwareConfig::default()).expect("valid");
        let mut by_cost = CacheAwareConfig::default();
        by_cost.token_choice = TokenChoice::Cost;
        let cache_cost = CacheAware::new(by_cost).expect("valid");
        for b in &fleet {
            kv.on_membership(MembershipEvent::Added { key: b.key() });
            gate.on_membership(MembershipEvent::Added { key: b.key() });
            cache.on_membership(MembershipEvent::Added { key: b.key() });
            cache_cost.on_membership(MembershipEvent::Added { key: b.key() });
        }
        for (n, (owner, tokens)) in warm.iter().enumerate() {
            let w = owner % workers;
            let hashes = index.block_hashes(tokens, None);
            let event = KvEvent::BlockStored {
                block_hashes: (0..hashes.len())
                    .map(|b| EngineHash::from_int((n * 10_000 + b) as i64))
                    .collect(),
                parent_block_hash: None,
                token_ids: tokens[..hashes.len() * BLOCK].to_vec(),
                block_size: BLOCK,
                lora_id: None,
            };
            index.apply(ids[w], 0, &event).expect("registered");
            let ctx = RequestContext::new("bench").with_tokens(tokens);
            kv.select(&fleet[w..=w], &ctx);
            gate.select(&fleet[w..=w], &ctx);
            cache.select(&fleet[w..=w], &ctx);
            cache_cost.select(&fleet[w..=w], &ctx);
        }
        for (label, live) in [("all_live", 2usize), ("half_live", 1), ("none_live", 0)] {
            for (i, id) in ids.iter().enumerate() {
                streams.set_live(*id, live == 2 || (live == 1 && i % 2 == 0));
            }
            for b in &fleet {
                b.set_load(0);
            }
            let figures = run(&kv, &fleet, &route);
            rows.push((workers, format!("kv_aware_{label}"), figures));
            if live == 2 {
                for b in &fleet {
                    b.set_load(0);
                }
                let figures = run(&gate, &fleet, &route);
                rows.push((workers, "kv_aware_gate_all_live".to_owned(), figures));
                // The overload state: every engine reports a queue, so
                // each decision is the gate's plus a walk of the tree for
                // the worker last sent the prefix.
                for b in &fleet {
                    b.set_load(0);
                    b.set_waiting(lb_policies::DEFAULT_OVERLOAD_ENTER as usize);
                }
                let figures = run(&kv, &fleet, &route);
                assert!(kv.is_overloaded(), "the bench's fleet is overloaded");
                rows.push((workers, "kv_aware_overloaded".to_owned(), figures));
                for b in &fleet {
                    b.set_waiting(0);
                }
            }
        }
        for b in &fleet {
            b.set_load(0);
        }
        let figures = run(&cache, &fleet, &route);
        rows.push((workers, "cache_aware_tokens".to_owned(), figures));
        for b in &fleet {
            b.set_load(0);
        }
        let figures = run(&cache_cost, &fleet, &route);
        rows.push((workers, "cache_aware_cost_tokens".to_owned(), figures));
        eprintln!(
            "{workers} workers: index {} blocks, {} pairs",
            index.stats().blocks,
            index.stats().pairs
        );
    }
    if json {
        let cells: Vec<String> = rows
            .iter()
            .map(|(w, name, (median, p99))| {
                format!("\"{w}/{name}\": {{\"median_ns\": {median:.1}, \"p99_ns\": {p99:.1}}}")
            })
            .collect();
        println!("{{\"requests\": {requests}, {}}}", cells.join(", "));
    } else {
        println!(
            "{:<24} {:>8} {:>12} {:>12}",
            "policy", "workers", "median ns", "p99 ns"
        );
        for (w, name, (median, p99)) in &rows {
            println!("{name:<24} {w:>8} {median:>12.1} {p99:>12.1}");
        }
    }
}
