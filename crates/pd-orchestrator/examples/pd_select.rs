//! What P/D pair selection costs per request, without HTTP: both roles'
//! serialized steps, both policies, the reservations, and the release and
//! outcome recording the flow does when each leg ends.
//!
//! Run with `cargo run --release -p pd-orchestrator --example pd_select`.

use lb_policies::{OwnedContext, PolicyConfig, RoutingInputBuf};
use pd_orchestrator::pools::{PdConfig, PdPools, PdScope, PdWorkerConfig};
use pd_orchestrator::{LegOutcome, PdBackend, PdConnector, Phase, PhaseGuard};
use std::sync::Arc;
use std::time::Instant;
use worker_lifecycle::{Endpoint, Registration, RoleKind, ServiceRegistry, WorkerOptions};

const WORKERS: usize = 8;
const REQUESTS: usize = 200_000;

fn static_pools(policy: &str) -> PdPools {
    let mut config = PdConfig::new(PdConnector::Nixl);
    for i in 0..WORKERS {
        config
            .prefill
            .push(PdWorkerConfig::new(format!("http://10.0.0.{i}:8000")));
        config
            .decode
            .push(PdWorkerConfig::new(format!("http://10.0.1.{i}:8000")));
    }
    PdPools::new(
        &config,
        &PolicyConfig::named(policy),
        &WorkerOptions::default(),
    )
    .unwrap()
}

fn discovered_pools(policy: &str) -> PdPools {
    let ttl = std::time::Duration::from_secs(3600);
    let prefill = Arc::new(ServiceRegistry::new(RoleKind::Prefill, ttl));
    let decode = Arc::new(ServiceRegistry::new(RoleKind::Decode, ttl));
    let now = Instant::now();
    for i in 0..WORKERS {
        let url = format!("http://10.0.2.{i}:8000");
        let endpoint = Endpoint::new(&url, None).unwrap();
        prefill.register(endpoint.clone(), Registration::default(), now);
        decode.register(endpoint, Registration::default(), now);
    }
    let mut config = PdConfig::new(PdConnector::Nixl);
    config.prefill_registry = Some(prefill);
    config.decode_registry = Some(decode);
    PdPools::new(
        &config,
        &PolicyConfig::named(policy),
        &WorkerOptions::default(),
    )
    .unwrap()
}

fn measure(name: &str, pools: &PdPools) {
    // A few distinct prompts with a shared prefix, as chat traffic has.
    let prompts: Vec<String> = (0..64)
        .map(|i| format!("You are a helpful assistant. Question {i}: what is a radix tree?"))
        .collect();
    let started = Instant::now();
    for i in 0..REQUESTS {
        let scope = Arc::new(PdScope::new(OwnedContext {
            model: "m".into(),
            routing: RoutingInputBuf::Text(prompts[i % prompts.len()].clone()),
            ..OwnedContext::default()
        }));
        let pair = pools.select_pair(&scope).expect("workers are available");
        for (target, phase) in [
            (&pair.prefill, Phase::Prefill),
            (&pair.decode, Phase::Decode),
        ] {
            let lease = pools.reserve(target, phase).expect("an idle worker admits");
            lease.finish(LegOutcome::Success, None);
        }
    }
    let per_request = started.elapsed() / REQUESTS as u32;
    println!("{name:<34} {per_request:>10.2?} per request ({WORKERS} + {WORKERS} workers)");
}

fn main() {
    for policy in ["round_robin", "least_loaded", "cache_aware"] {
        measure(&format!("static, {policy}"), &static_pools(policy));
        measure(&format!("discovered, {policy}"), &discovered_pools(policy));
    }
}
