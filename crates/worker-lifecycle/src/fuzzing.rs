//! Fuzz entry points (see the workspace's fuzz convention). Plain functions
//! that must never panic on any input; `fuzz/fuzz_targets/*.rs` and
//! `tests/fuzz_corpus.rs` call them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{
    DiscoveryPool, Endpoint, LoadGuard, Outcome, Registration, RoleKind, ServiceRegistry, Worker,
    WorkerOptions,
};

const URLS: [&str; 4] = ["http://a:1", "http://b:1", "http://a:1/", "https://c"];

/// Interprets `data` as a sequence of operations on two roles' registries
/// and pools, load guards and breaker outcomes, and checks after every one
/// that each worker's load equals the guards live on it, that nothing
/// underflowed and that pool members are ready. Panics only if an invariant
/// breaks (which is the bug a fuzzer looks for).
pub fn lifecycle_ops(data: &[u8]) {
    let start = Instant::now();
    let ttl = Duration::from_secs(8);
    let registries = [
        ServiceRegistry::new(RoleKind::Prefill, ttl),
        ServiceRegistry::new(RoleKind::Decode, ttl),
    ];
    let options = WorkerOptions::default();
    let Ok(prefill) = DiscoveryPool::new(RoleKind::Prefill, options.clone()) else {
        return;
    };
    let Ok(decode) = DiscoveryPool::new(RoleKind::Decode, options) else {
        return;
    };
    let pools = [prefill, decode];
    let mut now = start;
    let mut guards: Vec<LoadGuard> = Vec::new();
    let mut instance = 0u32;

    let mut bytes = data.iter().copied();
    while let (Some(op), Some(arg)) = (bytes.next(), bytes.next()) {
        let role = usize::from(arg & 1);
        let url = usize::from((arg >> 1) & 3);
        let endpoint = Endpoint::new(URLS[url], None).ok();
        match op % 10 {
            0 | 1 => {
                if let Some(ep) = endpoint {
                    let registration = Registration {
                        instance_id: Some(instance.to_string()),
                        ..Registration::default()
                    };
                    registries[role].register(ep, registration, now);
                }
            }
            2 => {
                if let Some(ep) = endpoint {
                    let _ = registries[role].heartbeat(&ep, None, now);
                }
            }
            3 => now += Duration::from_secs(u64::from(arg % 16)),
            4 => {
                registries[role].sweep(now);
            }
            5 | 6 => {
                let pick = usize::from(arg >> 3);
                let reserved = pools[role].with_reconciled(&registries[role], now, |view| {
                    let workers = view.workers();
                    if workers.is_empty() {
                        None
                    } else {
                        workers[pick % workers.len()].try_reserve_at(now).ok()
                    }
                });
                if let Ok(Some(guard)) = reserved {
                    guards.push(guard);
                }
            }
            7 => {
                if !guards.is_empty() {
                    let i = usize::from(arg) % guards.len();
                    if arg & 0x80 == 0 {
                        drop(guards.swap_remove(i));
                    } else {
                        guards[i].release();
                    }
                }
            }
            8 => {
                if !guards.is_empty() {
                    let i = usize::from(arg) % guards.len();
                    let shared = guards[i].share();
                    guards.push(shared);
                }
            }
            _ => {
                if !guards.is_empty() {
                    let i = usize::from(arg) % guards.len();
                    let status = 200 + u16::from(arg) * 2;
                    guards[i].record_outcome_at(Outcome::from_status(status), now);
                }
                instance = instance.wrapping_add(u32::from(arg >> 7));
            }
        }
        check(&pools, &guards);
    }
    let workers: Vec<Arc<Worker>> = guards.iter().map(|g| g.worker().clone()).collect();
    drop(guards);
    for w in workers {
        assert_eq!(w.load(), 0, "load left after every guard dropped");
        assert_eq!(w.underflows(), 0);
    }
}

fn check(pools: &[DiscoveryPool; 2], guards: &[LoadGuard]) {
    // Reservations live per worker: distinct unreleased reservations.
    let mut live: HashMap<*const Worker, (Arc<Worker>, Vec<*const ()>)> = HashMap::new();
    for g in guards {
        let entry = live
            .entry(Arc::as_ptr(g.worker()))
            .or_insert_with(|| (g.worker().clone(), Vec::new()));
        if !g.is_released() {
            let id = g.reservation_id();
            if !entry.1.contains(&id) {
                entry.1.push(id);
            }
        }
    }
    for (worker, reservations) in live.values() {
        assert_eq!(
            worker.load(),
            reservations.len(),
            "load of {}",
            worker.key()
        );
        assert_eq!(worker.underflows(), 0);
    }
    for pool in pools {
        for w in pool.workers().iter() {
            assert_eq!(w.lifecycle(), crate::Lifecycle::Ready);
            assert_eq!(w.role().kind(), pool.role());
            if !live.contains_key(&Arc::as_ptr(w)) {
                assert_eq!(w.load(), 0, "no guards, no load");
            }
        }
    }
}

/// Parses `data` as an endpoint URL; a parsed endpoint must print and
/// re-parse to itself.
pub fn endpoint_parse(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (url, rank) = match text.rsplit_once('@') {
        Some((u, r)) => (u, r.parse::<u32>().ok()),
        None => (&*text, None),
    };
    if let Ok(endpoint) = Endpoint::new(url, rank) {
        let again = Endpoint::new(endpoint.url(), endpoint.dp_rank());
        assert_eq!(again.as_ref(), Ok(&endpoint));
        assert!(!endpoint.url().ends_with('/'));
    }
}
