//! Criterion benches of single routing decisions, per policy, at 8 / 64 /
//! 1000 workers. Cache-aware routes texts of the radix-affinity workload
//! (set R) against a tree warmed with the first 2,000 texts of set W.
//! `examples/decision_bench` measures medians and p99 over the full sets.
#![allow(missing_docs)] // criterion_main! generates an undocumented main

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use lb_policies::{
    Backend, BasicBackend, MembershipEvent, Policy, PolicyConfig, PolicyRegistry, RequestContext,
};
use radix_affinity::workload;

const SIMPLE: [&str; 6] = [
    "random",
    "round_robin",
    "power_of_two",
    "least_loaded",
    "consistent_hash",
    "rendezvous_hash",
];

fn fleet(n: usize) -> Vec<BasicBackend> {
    (0..n)
        .map(|i| BasicBackend::new(format!("http://worker-{i}:8000")).with_load(i % 5))
        .collect()
}

fn registry(name: &str, fleet: &[BasicBackend]) -> PolicyRegistry<BasicBackend> {
    let r = PolicyRegistry::new(PolicyConfig::named(name).with_seed(1)).expect("built-in name");
    for b in fleet {
        r.on_membership(MembershipEvent::Added { key: b.key() });
    }
    r
}

fn simple_policies(c: &mut Criterion) {
    let users: Vec<String> = (0..1024).map(|i| format!("user-{i}")).collect();
    let mut group = c.benchmark_group("decision");
    for workers in [8usize, 64, 1000] {
        let fleet = fleet(workers);
        for name in SIMPLE {
            let registry = registry(name, &fleet);
            let policy = registry.policy("m").expect("built");
            let mut i = 0usize;
            group.bench_with_input(BenchmarkId::new(name, workers), &workers, |b, _| {
                b.iter(|| {
                    i = i.wrapping_add(1);
                    let ctx = RequestContext::new("m").with_user(&users[i % users.len()]);
                    black_box(policy.select(&fleet, &ctx))
                })
            });
        }
    }
    group.finish();
}

fn cache_aware(c: &mut Criterion) {
    let load = workload::Workload::new(workload::Variant::Ascii);
    let route = load.routes(2_000);
    let warm = &load.warm[..2_000];
    let mut group = c.benchmark_group("decision");
    for workers in [8usize, 64, 1000] {
        let fleet = fleet(workers);
        for name in ["cache_aware", "cache_aware_fleet_gate"] {
            let registry = registry(name, &fleet);
            let policy = registry.policy("m").expect("built");
            for r in warm {
                let owner = workload::owner(r.sp) % workers;
                policy.select(
                    &fleet[owner..=owner],
                    &RequestContext::new("m").with_text(&r.text),
                );
            }
            let mut i = 0usize;
            group.bench_with_input(BenchmarkId::new(name, workers), &workers, |b, _| {
                b.iter(|| {
                    i = i.wrapping_add(1);
                    let ctx = RequestContext::new("m").with_text(&route[i % route.len()].text);
                    black_box(policy.select(&fleet, &ctx))
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, simple_policies, cache_aware);
criterion_main!(benches);
