//! Cost of the request-path operations on a worker: reserve + release,
//! reserve + share + release, try_reserve (breaker admission) + outcome +
//! release, and a pool step with no membership change.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use worker_lifecycle::{
    DiscoveryPool, Endpoint, Outcome, Registration, RoleKind, ServiceRegistry, Worker,
    WorkerOptions, WorkerRole, WorkerSpec,
};

fn guards(c: &mut Criterion) {
    let spec = WorkerSpec::new(
        WorkerRole::Regular,
        Endpoint::new("http://127.0.0.1:8000", None).expect("valid endpoint"),
    );
    let worker = Worker::new(spec, 1, &WorkerOptions::default());

    c.bench_function("reserve+drop", |b| {
        b.iter(|| {
            let guard = black_box(&worker).reserve();
            drop(black_box(guard));
        })
    });
    c.bench_function("reserve+release", |b| {
        b.iter(|| {
            let guard = black_box(&worker).reserve();
            black_box(guard.release());
        })
    });
    c.bench_function("reserve+share+drop both", |b| {
        b.iter(|| {
            let guard = black_box(&worker).reserve();
            let shared = guard.share();
            drop(black_box(guard));
            drop(black_box(shared));
        })
    });
    c.bench_function("try_reserve+record+drop (breaker closed)", |b| {
        b.iter(|| {
            let guard = black_box(&worker).try_reserve().expect("available");
            guard.record_outcome(Outcome::Success);
            drop(black_box(guard));
        })
    });
    assert_eq!(worker.load(), 0);
    assert_eq!(worker.underflows(), 0);

    let registry = ServiceRegistry::new(RoleKind::Regular, Duration::from_secs(3600));
    let now = Instant::now();
    for i in 0..16 {
        let url = format!("http://10.0.0.{i}:8000");
        registry.register(
            Endpoint::new(&url, None).expect("valid endpoint"),
            Registration::default(),
            now,
        );
    }
    let pool = DiscoveryPool::new(RoleKind::Regular, WorkerOptions::default()).expect("config");
    c.bench_function(
        "pool step (16 workers, steady) + least-loaded reserve",
        |b| {
            b.iter(|| {
                let guard = pool
                    .with_reconciled(&registry, now, |view| {
                        view.workers()
                            .iter()
                            .min_by_key(|w| (w.load(), w.processed()))
                            .map(|w| w.reserve())
                    })
                    .expect("same role");
                drop(black_box(guard));
            })
        },
    );
}

/// Two threads reserving and dropping on the same worker: the cost of the
/// shared load counter's cache line moving between cores.
fn contended(c: &mut Criterion) {
    let spec = WorkerSpec::new(
        WorkerRole::Regular,
        Endpoint::new("http://127.0.0.1:8001", None).expect("valid endpoint"),
    );
    let worker = Worker::new(spec, 1, &WorkerOptions::default());
    c.bench_function("reserve+drop, 2 threads on one worker (per op)", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..2 {
                    let worker = &worker;
                    s.spawn(move || {
                        for _ in 0..iters {
                            drop(black_box(worker.reserve()));
                        }
                    });
                }
            });
            // Two threads did `iters` operations each: wall time per operation.
            start.elapsed() / 2
        })
    });
    assert_eq!(worker.load(), 0);
    assert_eq!(worker.underflows(), 0);
}

criterion_group!(benches, guards, contended);
criterion_main!(benches);
