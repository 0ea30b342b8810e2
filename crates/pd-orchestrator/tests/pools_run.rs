//! The whole-request retry loop over real pools and a scripted transport:
//! a failed flow names its worker, the next attempt leaves it out, and the
//! client hears the last flow error when no fresh pair is left.
#![cfg(feature = "pools")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use lb_policies::{OwnedContext, PolicyConfig};
use pd_orchestrator::bootstrap::Sleeper;
use pd_orchestrator::pools::{
    PdCall, PdConfig, PdPools, PdScope, PdWorkerConfig, RunError, RunObserver, Selected, run,
    run_observed,
};
use pd_orchestrator::{FlowConfig, ForwardHeaders, Nixl, PdConnector, PdError, PdFlow, Phase};
use serde_json::json;
use support::*;
use worker_lifecycle::{
    RequestRetries, RetryBudget, RetryBudgetConfig, RetryPolicy, WorkerOptions,
};

const P: &str = "http://10.0.0.1:8000";
const D1: &str = "http://10.0.0.2:8000";
const D2: &str = "http://10.0.0.3:8000";

/// Records the backoffs it was asked to wait, and waits for none.
#[derive(Default)]
struct Waits(std::sync::Mutex<Vec<Duration>>);

impl Sleeper for Waits {
    fn sleep(&self, duration: Duration) -> impl std::future::Future<Output = ()> + Send {
        self.0.lock().unwrap().push(duration);
        std::future::ready(())
    }
}

fn pools(decodes: &[&str]) -> Arc<PdPools> {
    let mut config = PdConfig::new(PdConnector::Nixl);
    config.prefill = vec![PdWorkerConfig::new(P)];
    config.decode = decodes
        .iter()
        .map(|url| PdWorkerConfig::new(*url))
        .collect();
    let policy = PolicyConfig::named("round_robin");
    Arc::new(PdPools::new(&config, &policy, &WorkerOptions::default()).unwrap())
}

fn call() -> PdCall {
    let body = json!({"model": "m", "prompt": "hello", "max_tokens": 4});
    PdCall {
        path: "/v1/completions".into(),
        body: Bytes::from(serde_json::to_vec(&body).unwrap()),
        parsed: Some(body),
        request_id: "r1".into(),
        forward: ForwardHeaders::new(),
        scope: Arc::new(PdScope::new(OwnedContext::default())),
    }
}

fn prefill_ok() -> Step {
    Step::json(json!({"kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [1]}}))
}

#[test]
fn a_failed_decode_is_left_out_of_the_retry_which_runs_on_a_fresh_pair() {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    transport.push(Phase::Prefill, prefill_ok());
    transport.push(
        Phase::Decode,
        Step::status(StatusCode::SERVICE_UNAVAILABLE, "{}"),
    );
    transport.push(Phase::Prefill, prefill_ok());
    transport.push(
        Phase::Decode,
        Step::json(json!({"choices": [{"text": "ok"}]})),
    );
    let pools = pools(&[D1, D2]);
    let flow = PdFlow::new(transport, Arc::clone(&pools), FlowConfig::default());
    let policy = RetryPolicy::default();
    let budget = RetryBudget::new(RetryBudgetConfig::default(), Instant::now());
    let mut retries = RequestRetries::start(&policy, &budget, 1, Instant::now());
    let waits = Waits::default();
    let retried = AtomicUsize::new(0);
    let response = ready(run(&flow, &Nixl, call(), &mut retries, &waits, |error| {
        assert!(matches!(error, PdError::DecodeRejected { .. }), "{error}");
        retried.fetch_add(1, Ordering::Relaxed);
    }))
    .unwrap();
    assert_eq!(response.status, StatusCode::OK);
    assert_eq!(retried.load(Ordering::Relaxed), 1);
    assert_eq!(retries.count(), 1);
    assert_eq!(
        waits.0.lock().unwrap().len(),
        1,
        "one backoff, through the sleeper"
    );
    let decodes: Vec<String> = flow
        .transport()
        .sent()
        .iter()
        .filter(|leg| leg.phase == Phase::Decode)
        .map(|leg| leg.url.clone())
        .collect();
    assert_eq!(decodes.len(), 2);
    assert_ne!(
        decodes[0], decodes[1],
        "the failed decode worker is left out"
    );
    // The retry runs under its own id: transfer ids never meet the
    // abandoned attempt's.
    let ids: Vec<_> = flow
        .transport()
        .sent()
        .iter()
        .map(|leg| leg.headers["x-request-id"].to_str().unwrap().to_owned())
        .collect();
    assert!(
        ids[0].ends_with("_r1") && ids[2].ends_with("_r1-a1"),
        "{ids:?}"
    );
    drop(response);
    for worker in pools.workers() {
        assert_eq!(worker.load(), 0, "{}", worker.key());
    }
    assert_eq!(pools.metrics().outcomes(Phase::Decode, "worker_failure"), 1);
}

/// A flow over one prefill and one decode worker (D1), whose first
/// prefill answers and whose first decode leg finds its connection
/// refused: a retry has no fresh decode worker.
fn one_decode_that_refuses_connections() -> (PdFlow<ScriptedTransport, PdPools>, Arc<PdPools>) {
    let transport = ScriptedTransport::new(&Log::default());
    transport.push(Phase::Prefill, prefill_ok());
    transport.push(Phase::Decode, Step::transport_error("connection refused"));
    let pools = pools(&[D1]);
    let flow = PdFlow::new(transport, Arc::clone(&pools), FlowConfig::default());
    (flow, pools)
}

#[test]
fn with_no_fresh_pair_left_the_client_hears_the_last_flow_error() {
    let (flow, pools) = one_decode_that_refuses_connections();
    let policy = RetryPolicy::default();
    let budget = RetryBudget::new(RetryBudgetConfig::default(), Instant::now());
    let mut retries = RequestRetries::start(&policy, &budget, 1, Instant::now());
    let error = ready(run(
        &flow,
        &Nixl,
        call(),
        &mut retries,
        &Waits::default(),
        |_| {},
    ))
    .unwrap_err();
    match error {
        RunError::Flow(PdError::DecodeFailed { reason, worker }) => {
            assert_eq!(reason, "connection refused");
            assert!(worker.contains("10.0.0.2:8000"), "{worker}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(
        retries.count(),
        1,
        "one retry was granted, then no pair was left"
    );
    for worker in pools.workers() {
        assert_eq!(worker.load(), 0, "{}", worker.key());
    }
}

/// Writes down what [`run_observed`] tells it, in order.
#[derive(Default)]
struct Events(Vec<String>);

impl RunObserver for &mut Events {
    type Selection = u32;

    fn selecting(&mut self, n: u32) -> u32 {
        self.0.push(format!("selecting {n}"));
        n
    }

    fn selected(&mut self, n: u32, outcome: Result<Selected<'_>, &worker_lifecycle::SelectError>) {
        let event = match outcome {
            Ok(selected) => {
                let prefill = selected.prefill;
                format!(
                    "selected {n}: prefill {} among {} ({}), decode {}",
                    prefill.worker().key(),
                    prefill.decision().candidates,
                    prefill.decision().reason.as_str(),
                    selected
                        .decode
                        .map_or("late".into(), |d| d.worker().key().to_owned()),
                )
            }
            Err(err) => format!("selected {n}: none ({err})"),
        };
        self.0.push(event);
    }

    fn retrying(&mut self, error: &PdError) {
        self.0.push(format!("retrying: {error}"));
    }
}

#[test]
fn the_observer_sees_each_attempts_selection_and_each_retry_in_order() {
    let (flow, pools) = one_decode_that_refuses_connections();
    let policy = RetryPolicy::default();
    let budget = RetryBudget::new(RetryBudgetConfig::default(), Instant::now());
    let mut retries = RequestRetries::start(&policy, &budget, 1, Instant::now());
    let call = call();
    let scope = Arc::clone(&call.scope);
    let mut events = Events::default();
    let error = ready(run_observed(
        &flow,
        &Nixl,
        call,
        &mut retries,
        &Waits::default(),
        &mut events,
    ))
    .unwrap_err();
    assert!(
        matches!(error, RunError::Flow(PdError::DecodeFailed { .. })),
        "{error:?}"
    );
    let prefill_key = pools.prefill().workers()[0].key().to_owned();
    let events = events.0;
    assert_eq!(events.len(), 5, "{events:#?}");
    assert_eq!(events[0], "selecting 0");
    // NIXL chooses its decode worker late: the first selection names the
    // prefill alone, and the scope says how the decode was chosen.
    assert_eq!(
        events[1],
        format!("selected 0: prefill {prefill_key} among 1 (round_robin), decode late")
    );
    assert!(events[2].starts_with("retrying: "), "{events:#?}");
    assert_eq!(events[3], "selecting 1");
    // The retry finds no fresh decode worker: told as the selection's
    // error, though the client hears the flow's.
    assert!(events[4].starts_with("selected 1: none ("), "{events:#?}");
    let late = scope
        .late_decode()
        .expect("the first attempt chose its decode late");
    assert_eq!(late.candidates, 1);
    assert_eq!(late.reason.as_str(), "round_robin");
}

#[test]
fn a_pair_chosen_at_once_names_both_decisions() {
    let pools = pools(&[D1, D2]);
    let call = call();
    let pair = pools.select_pair(&call.scope).unwrap();
    assert_eq!(pair.prefill.decision().candidates, 1);
    assert_eq!(pair.decode.decision().candidates, 2);
    assert_eq!(pair.decode.decision().reason.as_str(), "round_robin");
    assert_eq!(pair.decode.decision().match_permille, None);
    assert_eq!(call.scope.late_decode(), None, "not a late choice");
}
