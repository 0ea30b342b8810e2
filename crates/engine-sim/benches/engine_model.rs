//! How fast the sans-IO engine model simulates: a multi-turn chat workload
//! (sessions sharing a system prompt, each turn extending its history)
//! through one engine on the virtual clock, token events off, as the
//! routing-quality simulator drives it.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use engine_sim::{Engine, EventKind, ModelConfig, SimRequest};

const SESSIONS: u64 = 32;
const TURNS: u64 = 8;

fn workload() -> Vec<(Duration, Vec<u32>)> {
    let system: Vec<u32> = (0..512).collect();
    let mut histories: Vec<Vec<u32>> = (0..SESSIONS).map(|_| system.clone()).collect();
    let mut requests = Vec::new();
    for turn in 0..TURNS {
        for (s, history) in histories.iter_mut().enumerate() {
            let s = s as u64;
            history.extend((0..64).map(|i| (1_000_000 + s * 10_000 + turn * 100 + i) as u32));
            let at = Duration::from_millis(turn * 400 + s * 7);
            requests.push((at, history.clone()));
        }
    }
    requests
}

fn run(requests: &[(Duration, Vec<u32>)]) -> u64 {
    let mut engine = Engine::new(ModelConfig::default());
    engine.set_token_events(false);
    let mut finished = 0;
    for (id, (at, prompt)) in requests.iter().enumerate() {
        engine
            .submit(*at, SimRequest::new(id as u64, prompt.clone(), 32))
            .expect("fits");
        finished += engine
            .drain_events()
            .filter(|e| matches!(e.kind, EventKind::Finished(_)))
            .count() as u64;
    }
    engine.advance_to(Duration::from_secs(3600));
    finished += engine
        .drain_events()
        .filter(|e| matches!(e.kind, EventKind::Finished(_)))
        .count() as u64;
    finished
}

fn bench(c: &mut Criterion) {
    let requests = workload();
    let mut group = c.benchmark_group("engine_model");
    group.throughput(Throughput::Elements(requests.len() as u64));
    group.bench_function("multi_turn_256_requests", |b| {
        b.iter(|| assert_eq!(black_box(run(&requests)), SESSIONS * TURNS));
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
