//! Criterion benches of single routing decisions.
#![allow(missing_docs)] // criterion_main! generates an undocumented main

use criterion::{Criterion, criterion_group, criterion_main};
use lb_policies::{BasicBackend, Policy, RequestContext, RoundRobin};

fn round_robin(c: &mut Criterion) {
    let fleet: Vec<BasicBackend> = (0..8).map(|i| BasicBackend::new(format!("w{i}"))).collect();
    let policy = RoundRobin::new();
    let ctx = RequestContext::new("m");
    c.bench_function("round_robin/8", |b| b.iter(|| policy.select(&fleet, &ctx)));
}

criterion_group!(benches, round_robin);
criterion_main!(benches);
