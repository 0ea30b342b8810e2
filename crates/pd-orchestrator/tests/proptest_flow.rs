//! Random flows: any connector, any mix of leg outcomes, cut at any point.
//! Whatever happens, every reserved phase is released exactly once with
//! exactly one outcome, decode is sent at most once, and prefill retries
//! stay within their budget (and never happen in concurrent mode).

mod support;

use std::sync::Arc;
use std::task::Poll;

use http::StatusCode;
use pd_orchestrator::{
    FlowConfig, ForwardHeaders, KvConnector, LegOutcome, Mooncake, MoriIo, MoriIoMode, Nixl,
    PdEndpoint, PdFlow, PdRequest, Phase, PhaseOrder,
};
use proptest::prelude::*;
use serde_json::json;
use support::*;

#[derive(Debug, Clone, Copy)]
enum LegScript {
    Ok,
    OkSplit,
    Status(u16),
    TransportError,
    BodyError,
    NotJson,
}

fn leg_script() -> impl Strategy<Value = LegScript> {
    prop_oneof![
        3 => Just(LegScript::Ok),
        2 => Just(LegScript::OkSplit),
        1 => prop::sample::select(vec![400u16, 408, 422, 429, 500, 503]).prop_map(LegScript::Status),
        1 => Just(LegScript::TransportError),
        1 => Just(LegScript::BodyError),
        1 => Just(LegScript::NotJson),
    ]
}

fn step(script: LegScript, phase: Phase, stream: bool) -> Step {
    let ok = match (phase, stream) {
        (Phase::Prefill, _) => vec![
            "{\"usage\":{\"prompt_tokens\":3},".to_owned(),
            "\"kv_transfer_params\":{\"remote_engine_id\":\"e\",\"remote_block_ids\":[1]}}"
                .to_owned(),
        ],
        (Phase::Decode, true) => vec![
            "data: {\"a\":1}\n\n".to_owned(),
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,".to_owned(),
            "\"completion_tokens\":1}}\n\ndata: [DONE]".to_owned(),
        ],
        (Phase::Decode, false) => vec![
            "{\"usage\":{\"prompt_tokens\":3,".to_owned(),
            "\"completion_tokens\":1}}".to_owned(),
        ],
    };
    let joined = ok.concat();
    match script {
        LegScript::Ok => Step::chunks(&[&joined]),
        LegScript::OkSplit => Step::chunks(&ok.iter().map(String::as_str).collect::<Vec<_>>()),
        LegScript::Status(code) => {
            Step::status(StatusCode::from_u16(code).unwrap(), "{\"error\":\"x\"}")
        }
        LegScript::TransportError => Step::transport_error("refused"),
        LegScript::BodyError => Step::body_error_after(&[&ok[0]]),
        LegScript::NotJson => Step::chunks(&["<html>"]),
    }
}

/// A connector with its prefill, decode and spare prefill endpoints.
type Setup = (
    Box<dyn KvConnector>,
    Arc<PdEndpoint>,
    Arc<PdEndpoint>,
    Vec<Arc<PdEndpoint>>,
);

fn connector(index: usize) -> Setup {
    let spares = |make: &dyn Fn(&str) -> Arc<PdEndpoint>| {
        vec![make("http://10.0.0.5:1"), make("http://10.0.0.6:1")]
    };
    match index {
        0 => (
            Box::new(Nixl),
            endpoint("http://10.0.0.1:1"),
            endpoint("http://10.0.0.2:1"),
            spares(&|u| endpoint(u)),
        ),
        1 | 2 => {
            let connector: Box<dyn KvConnector> = if index == 1 {
                Box::new(Mooncake::concurrent())
            } else {
                Box::new(Mooncake::sequential())
            };
            (
                connector,
                mooncake_prefill("http://10.0.0.1:1", Some(1)),
                endpoint("http://10.0.0.2:1"),
                spares(&|u| mooncake_prefill(u, None)),
            )
        }
        _ => {
            let mode = if index == 3 {
                MoriIoMode::Read
            } else {
                MoriIoMode::Write
            };
            (
                Box::new(MoriIo::new(mode)),
                moriio("http://10.0.0.1:1", 1, 2, 2, Some(1)),
                moriio("http://10.0.0.2:1", 3, 4, 1, None),
                spares(&|u| moriio(u, 5, 6, 1, None)),
            )
        }
    }
}

#[derive(Debug, Clone)]
struct Case {
    connector: usize,
    stream: bool,
    usage: bool,
    prefill: Vec<LegScript>,
    decode: LegScript,
    spares: usize,
    /// Permits of one shared pool (None: every gate open).
    permits: Option<usize>,
    /// Drop the body after this many frame polls.
    body_polls: usize,
}

fn case() -> impl Strategy<Value = Case> {
    (
        0usize..5,
        any::<bool>(),
        any::<bool>(),
        prop::collection::vec(leg_script(), 3),
        leg_script(),
        0usize..=2,
        prop::option::of(0usize..24),
        0usize..12,
    )
        .prop_map(
            |(connector, stream, usage, prefill, decode, spares, permits, body_polls)| Case {
                connector,
                stream,
                usage,
                prefill,
                decode,
                spares,
                permits,
                body_polls,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_phase_is_released_once_whatever_happens(case in case()) {
        let (connector, prefill, decode, mut spares) = connector(case.connector);
        spares.truncate(case.spares);
        let log = Log::default();
        let transport = ScriptedTransport::new(&log);
        let gate = case.permits.map(Permits::new);
        for script in &case.prefill {
            let mut s = step(*script, Phase::Prefill, case.stream);
            if let Some(gate) = &gate {
                s = s.gated(gate);
            }
            transport.push(Phase::Prefill, s);
        }
        let mut s = step(case.decode, Phase::Decode, case.stream);
        if let Some(gate) = &gate {
            s = s.gated(gate);
        }
        transport.push(Phase::Decode, s);
        let backend = TestBackend::with_spares(&log, spares);
        let flow = PdFlow::new(transport.clone(), Arc::clone(&backend), FlowConfig::default());
        let body = if case.usage {
            json!({"prompt": "p", "stream": case.stream, "stream_options": {"include_usage": true}})
        } else {
            json!({"prompt": "p", "stream": case.stream})
        };
        let request = PdRequest {
            path: "/v1/completions".into(),
            body,
            request_id: "prop".into(),
            forward: ForwardHeaders::new(),
        };
        {
            let mut run = std::pin::pin!(flow.run(&*connector, request, prefill, decode));
            if let Poll::Ready(Ok(mut response)) = poll_n(run.as_mut(), 64) {
                for _ in 0..case.body_polls {
                    if let Poll::Ready(None) = poll_frame(&mut response.body) {
                        prop_assert!(!response.body.decode_active());
                        break;
                    }
                }
            }
        }
        backend.assert_balanced();
        let sent = transport.sent();
        let prefill_sends = sent.iter().filter(|l| l.phase == Phase::Prefill).count();
        let decode_sends = sent.iter().filter(|l| l.phase == Phase::Decode).count();
        prop_assert!(decode_sends <= 1);
        prop_assert!(prefill_sends <= 1 + case.spares && prefill_sends <= 3);
        if connector.phase_order() == PhaseOrder::Concurrent {
            prop_assert!(prefill_sends <= 1);
        }
        // Prefill legs after the first only follow a worker-side failure.
        let prefill_outcomes: Vec<LegOutcome> = backend
            .outcome_kinds()
            .into_iter()
            .filter(|(p, _)| *p == Phase::Prefill)
            .map(|(_, o)| o)
            .collect();
        for pair in prefill_outcomes.windows(2) {
            prop_assert_eq!(pair[0], LegOutcome::WorkerFailure);
        }
    }
}
