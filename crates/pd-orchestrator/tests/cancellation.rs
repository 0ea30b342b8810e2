//! Dropping the flow future, or the returned body, at every await point
//! releases each reserved phase exactly once and records one outcome each.
//!
//! Every await point of the scripted transport (response head, each body
//! chunk, end of body) takes one permit. A scenario first runs with
//! unlimited permits to count its await points N, then once per k in 0..=N
//! with only k permits: the flow (and then its body) is polled until it
//! stalls, and everything is dropped there. For concurrent connectors the
//! two legs also get separate permit pools, so every (prefill step, decode
//! step) combination is cut.

mod support;

use std::sync::Arc;
use std::task::Poll;

use http::StatusCode;
use pd_orchestrator::{
    FlowConfig, ForwardHeaders, KvConnector, LegOutcome, Mooncake, MoriIo, MoriIoMode, Nixl,
    PdEndpoint, PdFlow, PdRequest, Phase,
};
use serde_json::json;
use support::*;

const P: &str = "http://10.0.0.1:8000";
const D: &str = "http://10.0.0.2:8000";

struct Scenario {
    name: &'static str,
    connector: Box<dyn KvConnector>,
    prefill: Arc<PdEndpoint>,
    decode: Arc<PdEndpoint>,
    spare: Option<Arc<PdEndpoint>>,
    failing_first_prefill: bool,
    stream: bool,
    /// Streaming with `include_usage`: the usage event is rewritten, split
    /// across chunks, and the stream ends with an unterminated tail.
    usage: bool,
}

fn prefill_step() -> Step {
    Step::chunks(&[
        "{\"usage\":{\"prompt_tokens\":3},",
        "\"kv_transfer_params\":{\"remote_engine_id\":\"e\",\"remote_block_ids\":[1]}}",
    ])
}

fn decode_step(stream: bool, usage: bool) -> Step {
    if usage {
        Step::chunks(&[
            "data: {\"a\":1}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,",
            "\"completion_tokens\":2}}\n\n",
            "data: [DONE]",
        ])
    } else if stream {
        Step::chunks(&["data: {\"a\":1}\n\n", "data: [DONE]\n\n"])
    } else {
        Step::chunks(&[
            "{\"usage\":{\"prompt_tokens\":3,",
            "\"completion_tokens\":2}}",
        ])
    }
}

/// Runs `scenario` with the given gates; returns the permits consumed and
/// whether the whole exchange completed.
fn run(
    scenario: &Scenario,
    prefill_gate: &Arc<Permits>,
    decode_gate: &Arc<Permits>,
) -> (Arc<TestBackend>, bool) {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    if scenario.failing_first_prefill {
        transport.push(
            Phase::Prefill,
            Step::status(StatusCode::SERVICE_UNAVAILABLE, "busy").gated(prefill_gate),
        );
    }
    transport.push(Phase::Prefill, prefill_step().gated(prefill_gate));
    transport.push(
        Phase::Decode,
        decode_step(scenario.stream, scenario.usage).gated(decode_gate),
    );
    let backend = TestBackend::with_spares(&log, scenario.spare.iter().cloned().collect());
    let flow = PdFlow::new(transport, Arc::clone(&backend), FlowConfig::default());
    let request = PdRequest {
        path: "/v1/completions".into(),
        body: if scenario.usage {
            json!({"model": "m", "prompt": "abc", "stream": true, "stream_options": {"include_usage": true}})
        } else {
            json!({"model": "m", "prompt": "abc", "stream": scenario.stream})
        },
        request_id: "c".into(),
        forward: ForwardHeaders::new(),
    };
    let mut completed = false;
    {
        let mut future = std::pin::pin!(flow.run(
            &*scenario.connector,
            request,
            scenario.prefill.clone(),
            scenario.decode.clone()
        ));
        if let Poll::Ready(Ok(mut response)) = poll_n(future.as_mut(), 32) {
            for _ in 0..32 {
                match poll_frame(&mut response.body) {
                    Poll::Ready(None) => {
                        completed = !response.body.prefill_active();
                        break;
                    }
                    Poll::Ready(Some(Err(error))) => {
                        panic!("{}: unexpected body error {error}", scenario.name)
                    }
                    Poll::Ready(Some(Ok(_))) | Poll::Pending => {}
                }
            }
            // The response (and its body) drops here, mid-stream or not.
        }
        // The flow future drops here, at whatever await point it stalled.
    }
    backend.assert_balanced();
    (backend, completed)
}

fn unlimited() -> Arc<Permits> {
    Permits::new(1_000)
}

fn await_points(scenario: &Scenario) -> (usize, usize) {
    let (prefill_gate, decode_gate) = (unlimited(), unlimited());
    let (backend, completed) = run(scenario, &prefill_gate, &decode_gate);
    assert!(
        completed,
        "{} does not complete with every gate open",
        scenario.name
    );
    assert!(
        backend
            .outcome_kinds()
            .iter()
            .all(|(_, o)| matches!(o, LegOutcome::Success | LegOutcome::WorkerFailure)),
        "{}: {:?}",
        scenario.name,
        backend.outcome_kinds()
    );
    (1_000 - prefill_gate.left(), 1_000 - decode_gate.left())
}

fn scenarios() -> Vec<Scenario> {
    let mut out = Vec::new();
    for (name, connector, prefill) in [
        (
            "nixl-usage",
            Box::new(Nixl) as Box<dyn KvConnector>,
            endpoint(P),
        ),
        (
            "mooncake-usage",
            Box::new(Mooncake::concurrent()),
            mooncake_prefill(P, None),
        ),
    ] {
        out.push(Scenario {
            name,
            connector,
            prefill,
            decode: endpoint(D),
            spare: None,
            failing_first_prefill: false,
            stream: true,
            usage: true,
        });
    }
    for stream in [true, false] {
        out.push(Scenario {
            name: "nixl",
            connector: Box::new(Nixl),
            prefill: endpoint(P),
            decode: endpoint(D),
            spare: None,
            failing_first_prefill: false,
            stream,
            usage: false,
        });
        out.push(Scenario {
            name: "nixl-retry",
            connector: Box::new(Nixl),
            prefill: endpoint(P),
            decode: endpoint(D),
            spare: Some(endpoint("http://10.0.0.3:8000")),
            failing_first_prefill: true,
            stream,
            usage: false,
        });
        out.push(Scenario {
            name: "mooncake-concurrent",
            connector: Box::new(Mooncake::concurrent()),
            prefill: mooncake_prefill(P, Some(1)),
            decode: endpoint(D),
            spare: None,
            failing_first_prefill: false,
            stream,
            usage: false,
        });
        out.push(Scenario {
            name: "moriio-read",
            connector: Box::new(MoriIo::new(MoriIoMode::Read)),
            prefill: moriio(P, 1, 2, 2, Some(0)),
            decode: moriio(D, 3, 4, 1, None),
            spare: None,
            failing_first_prefill: false,
            stream,
            usage: false,
        });
        out.push(Scenario {
            name: "moriio-write",
            connector: Box::new(MoriIo::new(MoriIoMode::Write)),
            prefill: moriio(P, 1, 2, 1, None),
            decode: moriio(D, 3, 4, 1, None),
            spare: None,
            failing_first_prefill: false,
            stream,
            usage: false,
        });
    }
    out
}

#[test]
fn dropping_at_every_await_point_with_one_shared_permit_pool() {
    let mut cuts = 0;
    for scenario in scenarios() {
        let (prefill_points, decode_points) = await_points(&scenario);
        let total = prefill_points + decode_points;
        assert!(total >= 5, "{}: only {total} await points", scenario.name);
        for k in 0..=total {
            let gate = Permits::new(k);
            let (backend, completed) = run(&scenario, &gate, &gate);
            assert_eq!(completed, k == total, "{} cut at {k}", scenario.name);
            if k < total {
                assert!(
                    backend
                        .outcome_kinds()
                        .iter()
                        .any(|(_, o)| *o == LegOutcome::Cancelled),
                    "{} cut at {k} recorded no cancellation: {:?}",
                    scenario.name,
                    backend.outcome_kinds()
                );
            }
            cuts += 1;
        }
    }
    assert!(cuts > 60, "only {cuts} cuts");
}

#[test]
fn dropping_at_every_combination_of_prefill_and_decode_progress() {
    for scenario in scenarios() {
        let (prefill_points, decode_points) = await_points(&scenario);
        for kp in 0..=prefill_points {
            for kd in 0..=decode_points {
                let (backend, completed) = run(&scenario, &Permits::new(kp), &Permits::new(kd));
                // Concurrent decode streams may complete with the prefill cut
                // short (it is aborted at decode's end); sequential flows need
                // every prefill step first.
                if kp == prefill_points && kd == decode_points {
                    assert!(completed, "{} ({kp}, {kd})", scenario.name);
                }
                assert!(backend.reserved() <= 3, "{}", scenario.name);
            }
        }
    }
}
