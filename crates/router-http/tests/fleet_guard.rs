//! A fleet-wide failure must not become a total outage: open breakers may
//! exclude only so much of a pool, and below the panic threshold the router
//! sends to every live worker and passes on their own answers.

mod common;

use common::{Fixture, call, chat_body, json};
use engine_sim::{EngineConfig, FaultConfig};
use http::StatusCode;
use router_http::RouterConfig;
use std::time::{Duration, Instant};
use worker_lifecycle::{BreakerState, FleetGuard};

fn config() -> RouterConfig {
    let mut config = RouterConfig {
        policy: lb_policies::PolicyConfig::named("round_robin"),
        ..RouterConfig::default()
    };
    let breaker = &mut config.worker_options.breaker;
    breaker.failure_threshold = 1;
    breaker.success_threshold = 1;
    breaker.open_timeout = Duration::from_millis(50);
    breaker.max_open_timeout = Duration::from_millis(200);
    breaker.jitter = 0.0;
    // Enough retries to reach the one healthy worker of four, and a budget
    // that does not depend on warm-up traffic.
    config.retry.max_retries = 3;
    config.retry_budget.min_per_second = 1_000;
    config
}

fn engine(faults: FaultConfig) -> EngineConfig {
    EngineConfig {
        faults,
        ..EngineConfig::instant()
    }
}

#[tokio::test]
async fn three_failing_workers_of_four_leave_the_fleet_serving_and_recover() {
    let failing = || {
        engine(FaultConfig {
            fail_first: 3,
            fail_status: Some(503),
            ..FaultConfig::default()
        })
    };
    let engines = vec![failing(), failing(), failing(), EngineConfig::instant()];
    let fixture = Fixture::start(config(), engines).await;
    // Every request is answered: a failure opens that worker's breaker and
    // the request is retried on another; the healthy one stays in service.
    for i in 0..20 {
        let body = chat_body(&format!("request {i}"), false);
        let (status, _, bytes) =
            call(fixture.addr, "POST", "/v1/chat/completions", &[], body).await;
        assert_eq!(
            status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&bytes)
        );
    }
    // The failing workers recover through half-open probes (bounded wait).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut i = 0;
    loop {
        let workers = fixture.workers();
        let recovered = workers
            .iter()
            .all(|w| w.breaker().state() == BreakerState::Closed && w.processed() > 3);
        if recovered {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every worker recovered: {:?}",
            workers
                .iter()
                .map(|w| (w.breaker().state(), w.processed()))
                .collect::<Vec<_>>()
        );
        i += 1;
        let body = chat_body(&format!("later {i}"), false);
        let (status, _, _) = call(fixture.addr, "POST", "/v1/chat/completions", &[], body).await;
        assert_eq!(status, StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    fixture.assert_all_loads_return_to_zero().await;
    fixture.shutdown().await;
}

#[tokio::test]
async fn a_fleet_that_fails_entirely_answers_with_the_workers_errors() {
    let down = || {
        engine(FaultConfig {
            fixed_status: Some(503),
            ..FaultConfig::default()
        })
    };
    // Breakers that stay open for the whole test: no half-open probe
    // lets a worker back in; only the panic threshold does.
    let mut config = config();
    config.worker_options.breaker.open_timeout = Duration::from_secs(60);
    config.worker_options.breaker.max_open_timeout = Duration::from_secs(60);
    let fixture = Fixture::start(config.clone(), vec![down(), down(), down(), down()]).await;
    for i in 0..8 {
        let body = chat_body(&format!("request {i}"), false);
        let (status, _, bytes) =
            call(fixture.addr, "POST", "/v1/chat/completions", &[], body).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        let error = json(&bytes);
        assert_ne!(
            error["error"]["code"], "no_available_worker",
            "the router answered for the workers: {error}"
        );
    }
    let workers = fixture.workers();
    assert!(
        workers.iter().all(|w| w.processed() > 0),
        "panic mode sends to every live worker"
    );
    assert!(fixture.router.pool().fleet_counts().panic_steps > 0);
    let (_, _, metrics) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8_lossy(&metrics).into_owned();
    let panics = metrics
        .lines()
        .find_map(|line| line.strip_prefix("router_pool_panic_steps_total{role=\"regular\"} "))
        .and_then(|value| value.parse::<u64>().ok());
    assert!(panics.is_some_and(|n| n > 0), "{metrics}");
    fixture.shutdown().await;

    // Turned off, the router refuses once every breaker is open.
    let mut strict = config;
    strict.worker_options.fleet = FleetGuard::off();
    let fixture = Fixture::start(strict, vec![down(), down()]).await;
    let mut refused = false;
    for i in 0..8 {
        let body = chat_body(&format!("strict {i}"), false);
        let (_, _, bytes) = call(fixture.addr, "POST", "/v1/chat/completions", &[], body).await;
        refused |= json(&bytes)["error"]["code"] == "no_available_worker";
    }
    assert!(
        refused,
        "with the guard off, open breakers exclude everyone"
    );
    fixture.shutdown().await;
}

/// vllm-router's contract for a pool too small to guard: a single failing
/// engine opens its breaker within the failure threshold, and from then on
/// clients get the router's 503 at once instead of the engine's failures.
#[tokio::test]
async fn a_single_failing_worker_opens_its_breaker_and_clients_get_503() {
    let config = RouterConfig {
        policy: lb_policies::PolicyConfig::named("round_robin"),
        ..RouterConfig::default()
    };
    let threshold = config.worker_options.breaker.failure_threshold;
    let down = engine(FaultConfig {
        fixed_status: Some(500),
        ..FaultConfig::default()
    });
    let fixture = Fixture::start(config, vec![down]).await;
    let mut codes = Vec::new();
    for i in 0..threshold + 5 {
        let body = chat_body(&format!("request {i}"), false);
        let (status, _, bytes) =
            call(fixture.addr, "POST", "/v1/chat/completions", &[], body).await;
        let error = json(&bytes);
        codes.push((status, error["error"]["code"].as_str().map(str::to_owned)));
    }
    let worker = &fixture.workers()[0];
    assert_eq!(worker.breaker().state(), BreakerState::Open);
    // Every request after the breaker opened was refused by the router
    // without reaching the engine.
    let refused = codes
        .iter()
        .filter(|(status, code)| {
            *status == StatusCode::SERVICE_UNAVAILABLE
                && code.as_deref() == Some("no_available_worker")
        })
        .count();
    assert!(refused >= 5, "{codes:?}");
    assert!(
        worker.processed() <= u64::from(threshold) * 2,
        "the engine kept being sent requests: {} for threshold {threshold}",
        worker.processed()
    );
    assert_eq!(fixture.router.pool().fleet_counts().panic_steps, 0);
    fixture.shutdown().await;
}
