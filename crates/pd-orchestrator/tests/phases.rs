//! Guard timelines of both phases, failures of each phase, and prefill
//! retries, over a scripted transport.

mod support;

use std::sync::Arc;
use std::task::Poll;

use http::StatusCode;
use pd_orchestrator::{
    FlowConfig, ForwardHeaders, LegOutcome, Mooncake, MoriIo, MoriIoMode, Nixl, PdError, PdFlow,
    PdRequest, Phase,
};
use serde_json::json;
use support::*;

const P: &str = "http://10.0.0.1:8000";
const P2: &str = "http://10.0.0.3:8000";
const D: &str = "http://10.0.0.2:8000";

fn request(stream: bool) -> PdRequest {
    PdRequest {
        path: "/v1/completions".into(),
        body: json!({"model": "m", "prompt": "hello", "max_tokens": 16, "stream": stream}),
        request_id: "r1".into(),
        forward: ForwardHeaders::new(),
    }
}

fn nixl_prefill_answer() -> serde_json::Value {
    json!({"kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [1]}})
}

struct Setup {
    log: Log,
    transport: ScriptedTransport,
    backend: Arc<TestBackend>,
    flow: PdFlow<ScriptedTransport, TestBackend>,
}

fn setup(spares: Vec<Arc<pd_orchestrator::PdEndpoint>>, config: FlowConfig) -> Setup {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    let backend = TestBackend::with_spares(&log, spares);
    let flow = PdFlow::new(transport.clone(), Arc::clone(&backend), config);
    Setup {
        log,
        transport,
        backend,
        flow,
    }
}

fn events_of(log: &Log, prefixes: &[&str]) -> Vec<String> {
    log.events()
        .into_iter()
        .filter(|e| prefixes.iter().any(|p| e.starts_with(p)))
        .collect()
}

#[test]
fn sequential_prefill_guard_ends_at_prefill_completion_decode_guard_at_end_of_stream() {
    let s = setup(vec![], FlowConfig::default());
    let decode_gate = Permits::new(1); // the response head only
    s.transport
        .push(Phase::Prefill, Step::json(nixl_prefill_answer()));
    s.transport.push(
        Phase::Decode,
        Step::chunks(&["data: a\n\n", "data: b\n\n"]).gated(&decode_gate),
    );
    let (prefill, decode) = (endpoint(P), endpoint(D));
    let mut response = ready(
        s.flow
            .run(&Nixl, request(true), prefill.clone(), decode.clone()),
    )
    .unwrap();

    // Headers are back: prefill is over, decode is still load.
    assert_eq!(s.backend.live(&prefill, Phase::Prefill), 0);
    assert_eq!(s.backend.live(&decode, Phase::Decode), 1);
    assert!(response.body.decode_active());
    assert_eq!(
        s.log.events(),
        [
            format!("reserve prefill {P}"),
            "send prefill".to_owned(),
            "head prefill 200".to_owned(),
            "eof prefill".to_owned(),
            format!("release prefill {P}"),
            "outcome prefill Success".to_owned(),
            format!("reserve decode {D}"),
            "send decode".to_owned(),
            "head decode 200".to_owned(),
        ]
    );

    // A stalled upstream keeps decode counted.
    assert!(poll_frame(&mut response.body).is_pending());
    assert_eq!(s.backend.live(&decode, Phase::Decode), 1);
    decode_gate.add(1);
    assert!(matches!(
        poll_frame(&mut response.body),
        Poll::Ready(Some(Ok(_)))
    ));
    assert_eq!(s.backend.live(&decode, Phase::Decode), 1);
    decode_gate.add(2);
    assert!(matches!(
        poll_frame(&mut response.body),
        Poll::Ready(Some(Ok(_)))
    ));
    assert!(matches!(poll_frame(&mut response.body), Poll::Ready(None)));
    assert_eq!(s.backend.live(&decode, Phase::Decode), 0);
    assert!(!response.body.decode_active());
    assert_eq!(
        s.backend.outcome_kinds(),
        [
            (Phase::Prefill, LegOutcome::Success),
            (Phase::Decode, LegOutcome::Success)
        ]
    );
    drop(response);
    s.backend.assert_balanced();
}

#[test]
fn late_decode_is_selected_after_the_prefill_response_and_counted_from_its_dispatch() {
    let s = setup(vec![], FlowConfig::default());
    let prefill_gate = Permits::new(0);
    let decode_gate = Permits::new(1); // the response head only
    s.transport.push(
        Phase::Prefill,
        Step::json(nixl_prefill_answer()).gated(&prefill_gate),
    );
    s.transport.push(
        Phase::Decode,
        Step::chunks(&["data: a\n\n"]).gated(&decode_gate),
    );
    let decode = endpoint(D);
    s.backend.offer_decodes(vec![decode.clone()]);
    let prefill = endpoint(P);
    let mut run = Box::pin(
        s.flow
            .run_late_decode(&Nixl, request(true), prefill.clone()),
    );

    // The prefill is running: no decode chosen, no decode load.
    assert!(poll_n(run.as_mut(), 4).is_pending());
    assert_eq!(s.backend.live(&prefill, Phase::Prefill), 1);
    assert_eq!(s.backend.live(&decode, Phase::Decode), 0);
    assert!(
        !s.log
            .events()
            .iter()
            .any(|e| e.starts_with("select decode"))
    );

    prefill_gate.add(3); // head, body, end of body
    let Poll::Ready(Ok(mut response)) = poll_n(run.as_mut(), 64) else {
        panic!("the flow answers once the prefill completed");
    };
    assert_eq!(s.backend.live(&prefill, Phase::Prefill), 0);
    assert_eq!(s.backend.live(&decode, Phase::Decode), 1);
    assert_eq!(
        events_of(
            &s.log,
            &["reserve", "release", "select", "send", "eof prefill"]
        ),
        [
            format!("reserve prefill {P}"),
            "send prefill".to_owned(),
            "eof prefill".to_owned(),
            format!("release prefill {P}"),
            format!("select decode {D}"),
            format!("reserve decode {D}"),
            "send decode".to_owned(),
        ]
    );
    // Both legs carry one id, fixed before any decode worker was chosen.
    let sent = s.transport.sent();
    let id = "___prefill_addr_10.0.0.1:8000___decode_addr__r1";
    assert_eq!(sent[0].headers["x-request-id"], id);
    assert_eq!(sent[1].headers["x-request-id"], id);
    assert_eq!(sent[1].url, format!("{D}/v1/completions"));

    decode_gate.add(2);
    assert_eq!(read_all(&mut response.body).unwrap(), b"data: a\n\n");
    assert_eq!(s.backend.live(&decode, Phase::Decode), 0);
    drop(response);
    s.backend.assert_balanced();
}

/// Both legs carry the client's objects with their keys in the client's
/// order: the engine's chat template prints a dict (tool-call arguments,
/// through `tojson`) in its insertion order, as the router's tokenizer
/// renders it from the client's bytes; a leg that sorted the keys would
/// make the engine compute other tokens than the ones the request was
/// routed on.
#[test]
fn legs_keep_the_clients_key_order() {
    let s = setup(vec![], FlowConfig::default());
    s.transport
        .push(Phase::Prefill, Step::json(nixl_prefill_answer()));
    s.transport
        .push(Phase::Decode, Step::chunks(&["data: a\n\n"]));
    let client = r#"{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"type":"function","function":{"name":"f","arguments":{"zone":"z","amount":1,"currency":"EUR"}}}]},{"role":"user","content":"and?"}],"max_tokens":16,"stream":true}"#;
    let request = PdRequest {
        path: "/v1/chat/completions".into(),
        body: serde_json::from_str(client).unwrap(),
        request_id: "r1".into(),
        forward: ForwardHeaders::new(),
    };
    let response = ready(s.flow.run(&Nixl, request, endpoint(P), endpoint(D))).unwrap();
    drop(response);
    for leg in s.transport.sent() {
        let body = String::from_utf8(leg.body.to_vec()).unwrap();
        assert!(
            body.contains(r#""arguments":{"zone":"z","amount":1,"currency":"EUR"}"#),
            "{body}"
        );
        assert!(
            body.find(r#""role""#) < body.find(r#""tool_calls""#),
            "{body}"
        );
    }
}

#[test]
fn late_decode_with_no_decode_worker_left_fails_after_releasing_the_prefill() {
    let s = setup(vec![], FlowConfig::default());
    s.transport
        .push(Phase::Prefill, Step::json(nixl_prefill_answer()));
    let error = ready(s.flow.run_late_decode(&Nixl, request(false), endpoint(P))).unwrap_err();
    assert!(matches!(error, PdError::NoDecodeWorker), "{error:?}");
    assert_eq!(error.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(!error.is_retryable());
    assert_eq!(s.transport.sent().len(), 1, "no decode leg was sent");
    assert_eq!(
        s.backend.outcome_kinds(),
        [(Phase::Prefill, LegOutcome::Success)]
    );
    s.backend.assert_balanced();
}

#[test]
fn late_decode_refuses_connectors_that_need_the_decode_first() {
    let s = setup(vec![], FlowConfig::default());
    for connector in [
        &MoriIo::new(MoriIoMode::Read) as &dyn pd_orchestrator::KvConnector,
        &Mooncake::concurrent(),
    ] {
        let error = ready(
            s.flow
                .run_late_decode(connector, request(false), endpoint(P)),
        )
        .unwrap_err();
        assert!(matches!(error, PdError::DecodeNeededAtStart), "{error:?}");
    }
    assert!(s.transport.sent().is_empty());
    assert_eq!(s.backend.reserved(), 0);
}

#[test]
fn client_dropping_a_stalled_stream_releases_decode_promptly() {
    let s = setup(vec![], FlowConfig::default());
    let decode_gate = Permits::new(2); // head + first chunk, then the upstream stalls
    s.transport
        .push(Phase::Prefill, Step::json(nixl_prefill_answer()));
    s.transport.push(
        Phase::Decode,
        Step::chunks(&["data: a\n\n", "data: b\n\n"]).gated(&decode_gate),
    );
    let decode = endpoint(D);
    let mut response = ready(
        s.flow
            .run(&Nixl, request(true), endpoint(P), decode.clone()),
    )
    .unwrap();
    assert!(matches!(
        poll_frame(&mut response.body),
        Poll::Ready(Some(Ok(_)))
    ));
    assert!(poll_frame(&mut response.body).is_pending());
    assert_eq!(s.backend.live(&decode, Phase::Decode), 1);
    drop(response);
    assert_eq!(s.backend.live(&decode, Phase::Decode), 0);
    assert_eq!(
        s.backend.outcome_kinds()[1],
        (Phase::Decode, LegOutcome::Cancelled)
    );
    assert!(s.log.at("body-drop decode") < s.log.at("outcome decode Cancelled"));
    s.backend.assert_balanced();
}

#[test]
fn sequential_non_streaming_releases_decode_when_its_body_is_read() {
    let s = setup(vec![], FlowConfig::default());
    s.transport
        .push(Phase::Prefill, Step::json(nixl_prefill_answer()));
    s.transport.push(
        Phase::Decode,
        Step::json(json!({"choices": [{"text": "x"}]})),
    );
    let decode = endpoint(D);
    let mut response = ready(
        s.flow
            .run(&Nixl, request(false), endpoint(P), decode.clone()),
    )
    .unwrap();
    assert_eq!(s.backend.live(&decode, Phase::Decode), 0);
    assert!(s.log.at("eof decode") < s.log.at(&format!("release decode {D}")));
    let body: serde_json::Value =
        serde_json::from_slice(&read_all(&mut response.body).unwrap()).unwrap();
    assert_eq!(body, json!({"choices": [{"text": "x"}]}));
    s.backend.assert_balanced();
}

#[test]
fn concurrent_both_guards_live_at_once_and_each_ends_with_its_phase() {
    let s = setup(vec![], FlowConfig::default());
    let prefill_gate = Permits::new(0);
    s.transport.push(
        Phase::Prefill,
        Step::json(json!({"id": "p"})).gated(&prefill_gate),
    );
    s.transport
        .push(Phase::Decode, Step::chunks(&["data: a\n\n", "data: b\n\n"]));
    let (prefill, decode) = (mooncake_prefill(P, None), endpoint(D));
    let mut response = ready(s.flow.run(
        &Mooncake::concurrent(),
        request(true),
        prefill.clone(),
        decode.clone(),
    ))
    .unwrap();

    assert_eq!(s.backend.live(&prefill, Phase::Prefill), 1);
    assert_eq!(s.backend.live(&decode, Phase::Decode), 1);
    assert!(response.body.prefill_active());
    assert_eq!(
        events_of(&s.log, &["reserve", "send"]),
        [
            format!("reserve prefill {P}"),
            "send prefill".to_owned(),
            format!("reserve decode {D}"),
            "send decode".to_owned()
        ]
    );

    // The prefill completes while decode streams: only prefill is released.
    prefill_gate.add(3); // head, body chunk, end of body
    assert!(matches!(
        poll_frame(&mut response.body),
        Poll::Ready(Some(Ok(_)))
    ));
    assert!(!response.body.prefill_active());
    assert_eq!(s.backend.live(&prefill, Phase::Prefill), 0);
    assert_eq!(s.backend.live(&decode, Phase::Decode), 1);

    assert!(matches!(
        poll_frame(&mut response.body),
        Poll::Ready(Some(Ok(_)))
    ));
    assert!(matches!(poll_frame(&mut response.body), Poll::Ready(None)));
    assert_eq!(s.backend.live(&decode, Phase::Decode), 0);
    assert_eq!(
        s.backend.outcome_kinds(),
        [
            (Phase::Prefill, LegOutcome::Success),
            (Phase::Decode, LegOutcome::Success)
        ]
    );
    drop(response);
    s.backend.assert_balanced();
}

#[test]
fn concurrent_decode_ending_first_aborts_the_lingering_prefill() {
    let s = setup(vec![], FlowConfig::default());
    let prefill_gate = Permits::new(0);
    s.transport.push(
        Phase::Prefill,
        Step::json(json!({"id": "p"})).gated(&prefill_gate),
    );
    s.transport
        .push(Phase::Decode, Step::chunks(&["data: a\n\n"]));
    let prefill = mooncake_prefill(P, None);
    let mut response = ready(s.flow.run(
        &Mooncake::concurrent(),
        request(true),
        prefill.clone(),
        endpoint(D),
    ))
    .unwrap();
    assert_eq!(read_all(&mut response.body).unwrap(), b"data: a\n\n");
    assert_eq!(s.backend.live(&prefill, Phase::Prefill), 0);
    assert!(s.log.events().contains(&"abort prefill".to_owned()));
    assert_eq!(
        s.backend.outcome_kinds(),
        [
            (Phase::Decode, LegOutcome::Success),
            (Phase::Prefill, LegOutcome::Cancelled)
        ]
    );
    s.backend.assert_balanced();
}

#[test]
fn concurrent_decode_error_while_prefill_active_releases_both_once() {
    for decode_step in [
        Step::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "{\"error\":\"overloaded\"}",
        ),
        Step::transport_error("connection refused"),
    ] {
        let s = setup(vec![], FlowConfig::default());
        let prefill_gate = Permits::new(0);
        s.transport.push(
            Phase::Prefill,
            Step::json(json!({"id": "p"})).gated(&prefill_gate),
        );
        s.transport.push(Phase::Decode, decode_step);
        let prefill = moriio(P, 1, 2, 1, None);
        let decode = moriio(D, 3, 4, 1, None);
        let error = ready(s.flow.run(
            &MoriIo::new(MoriIoMode::Write),
            request(true),
            prefill.clone(),
            decode.clone(),
        ))
        .unwrap_err();
        assert!(error.is_retryable(), "{error}");
        match &error {
            PdError::DecodeRejected {
                status,
                body,
                worker,
            } => {
                assert_eq!(*status, StatusCode::SERVICE_UNAVAILABLE);
                assert_eq!(&body[..], b"{\"error\":\"overloaded\"}");
                assert_eq!(worker, D, "the error names the decode worker");
            }
            PdError::DecodeFailed { reason, worker } => {
                assert_eq!(reason, "connection refused");
                assert_eq!(worker, D, "the error names the decode worker");
            }
            other => panic!("unexpected {other}"),
        }
        assert_eq!(s.backend.live(&prefill, Phase::Prefill), 0);
        assert_eq!(s.backend.live(&decode, Phase::Decode), 0);
        assert!(s.log.events().contains(&"abort prefill".to_owned()));
        let expected_status = match &error {
            PdError::DecodeRejected { .. } => Some(503),
            _ => None,
        };
        assert!(
            s.backend
                .statuses()
                .contains(&(Phase::Decode, expected_status))
        );
        assert!(s.backend.statuses().contains(&(Phase::Prefill, None)));
        let outcomes = s.backend.outcome_kinds();
        assert!(outcomes.contains(&(Phase::Decode, LegOutcome::WorkerFailure)));
        assert!(outcomes.contains(&(Phase::Prefill, LegOutcome::Cancelled)));
        // Decode was not retried.
        assert_eq!(
            s.transport
                .sent()
                .iter()
                .filter(|l| l.phase == Phase::Decode)
                .count(),
            1
        );
        s.backend.assert_balanced();
    }
}

#[test]
fn concurrent_decode_body_error_mid_stream_ends_both_phases() {
    let s = setup(vec![], FlowConfig::default());
    let prefill_gate = Permits::new(0);
    s.transport.push(
        Phase::Prefill,
        Step::json(json!({"id": "p"})).gated(&prefill_gate),
    );
    s.transport
        .push(Phase::Decode, Step::body_error_after(&["data: a\n\n"]));
    let mut response = ready(s.flow.run(
        &Mooncake::concurrent(),
        request(true),
        mooncake_prefill(P, None),
        endpoint(D),
    ))
    .unwrap();
    assert!(matches!(
        poll_frame(&mut response.body),
        Poll::Ready(Some(Ok(_)))
    ));
    assert!(matches!(
        poll_frame(&mut response.body),
        Poll::Ready(Some(Err(_)))
    ));
    assert!(!response.body.decode_active() && !response.body.prefill_active());
    assert_eq!(
        s.backend.outcome_kinds(),
        [
            (Phase::Decode, LegOutcome::WorkerFailure),
            (Phase::Prefill, LegOutcome::Cancelled)
        ]
    );
    drop(response);
    s.backend.assert_balanced();
}

#[test]
fn concurrent_prefill_failure_before_decode_head_aborts_decode() {
    let s = setup(vec![], FlowConfig::default());
    let decode_gate = Permits::new(0);
    s.transport.push(
        Phase::Prefill,
        Step::status(StatusCode::INTERNAL_SERVER_ERROR, "boom"),
    );
    s.transport
        .push(Phase::Decode, Step::chunks(&["x"]).gated(&decode_gate));
    let error = ready(s.flow.run(
        &Mooncake::concurrent(),
        request(true),
        mooncake_prefill(P, None),
        endpoint(D),
    ))
    .unwrap_err();
    assert!(
        matches!(error, PdError::PrefillFailed { attempts: 1, .. }),
        "{error}"
    );
    assert!(s.log.events().contains(&"abort decode".to_owned()));
    assert_eq!(
        s.backend.outcome_kinds(),
        [
            (Phase::Prefill, LegOutcome::WorkerFailure),
            (Phase::Decode, LegOutcome::Cancelled)
        ]
    );
    s.backend.assert_balanced();
}

#[test]
fn concurrent_prefill_failure_after_decode_started_is_recorded_and_decode_finishes() {
    let s = setup(vec![], FlowConfig::default());
    let prefill_gate = Permits::new(0);
    s.transport.push(
        Phase::Prefill,
        Step::status(StatusCode::INTERNAL_SERVER_ERROR, "boom").gated(&prefill_gate),
    );
    s.transport
        .push(Phase::Decode, Step::chunks(&["data: a\n\n", "data: b\n\n"]));
    let mut response = ready(s.flow.run(
        &Mooncake::concurrent(),
        request(true),
        mooncake_prefill(P, None),
        endpoint(D),
    ))
    .unwrap();
    prefill_gate.add(3);
    assert_eq!(
        read_all(&mut response.body).unwrap(),
        b"data: a\n\ndata: b\n\n"
    );
    assert_eq!(
        s.backend.outcome_kinds(),
        [
            (Phase::Prefill, LegOutcome::WorkerFailure),
            (Phase::Decode, LegOutcome::Success)
        ]
    );
    assert_eq!(s.flow.stats().snapshot().prefill_failures_during_decode, 1);
    drop(response);
    s.backend.assert_balanced();
}

#[test]
fn prefill_failure_retries_on_a_fresh_worker_then_succeeds() {
    for failure in [
        Step::status(StatusCode::SERVICE_UNAVAILABLE, "busy"),
        Step::transport_error("reset"),
        Step::status(StatusCode::OK, "not json"),
    ] {
        let s = setup(vec![endpoint(P2)], FlowConfig::default());
        s.transport.push(Phase::Prefill, failure);
        s.transport
            .push(Phase::Prefill, Step::json(nixl_prefill_answer()));
        s.transport.push(Phase::Decode, Step::chunks(&["ok"]));
        let mut response =
            ready(s.flow.run(&Nixl, request(true), endpoint(P), endpoint(D))).unwrap();
        assert_eq!(read_all(&mut response.body).unwrap(), b"ok");
        assert_eq!(response.prefill_attempts, 2);
        assert_eq!(response.prefill.base_url(), P2);
        assert_eq!(s.flow.stats().snapshot().prefill_retries, 1);
        // The failed worker is released before the retry reserves the next.
        assert!(
            s.log.at(&format!("release prefill {P}")) < s.log.at(&format!("reserve prefill {P2}"))
        );
        assert_eq!(
            s.backend.outcomes(),
            [
                (P.to_owned(), Phase::Prefill, LegOutcome::WorkerFailure),
                (P2.to_owned(), Phase::Prefill, LegOutcome::Success),
                (D.to_owned(), Phase::Decode, LegOutcome::Success),
            ]
        );
        // Both the retried prefill and the decode name the worker that served.
        let sent = s.transport.sent();
        let id = "___prefill_addr_10.0.0.3:8000___decode_addr_10.0.0.2:8000_r1";
        assert_eq!(sent[1].headers["x-request-id"], id);
        assert_eq!(sent[2].headers["x-request-id"], id);
        assert_eq!(sent[1].url, format!("{P2}/v1/completions"));
        drop(response);
        s.backend.assert_balanced();
    }
}

#[test]
fn retried_transfer_ids_differ_from_the_failed_attempt() {
    let s = setup(vec![moriio(P2, 5, 6, 1, None)], FlowConfig::default());
    s.transport
        .push(Phase::Prefill, Step::status(StatusCode::BAD_GATEWAY, ""));
    s.transport.push(
        Phase::Prefill,
        Step::json(
            json!({"kv_transfer_params": {"remote_engine_id": "e2", "remote_block_ids": [3]}}),
        ),
    );
    s.transport.push(Phase::Decode, Step::chunks(&["ok"]));
    let response = ready(s.flow.run(
        &MoriIo::new(MoriIoMode::Read),
        request(true),
        moriio(P, 1, 2, 1, None),
        moriio(D, 3, 4, 1, None),
    ))
    .unwrap();
    assert_eq!(
        s.transport.sent_body(0)["kv_transfer_params"]["transfer_id"],
        "tx-r1"
    );
    assert_eq!(
        s.transport.sent_body(1)["kv_transfer_params"]["transfer_id"],
        "tx-r1-r1"
    );
    assert_eq!(
        s.transport.sent_body(2)["kv_transfer_params"]["transfer_id"],
        "tx-r1-r1"
    );
    assert_eq!(
        s.transport.sent_body(2)["kv_transfer_params"]["remote_handshake_port"],
        5
    );
    drop(response);
    s.backend.assert_balanced();
}

#[test]
fn prefill_client_error_is_passed_through_without_retry() {
    let s = setup(vec![endpoint(P2)], FlowConfig::default());
    s.transport.push(
        Phase::Prefill,
        Step::status(StatusCode::BAD_REQUEST, "{\"error\":\"prompt too long\"}"),
    );
    let error = ready(s.flow.run(&Nixl, request(true), endpoint(P), endpoint(D))).unwrap_err();
    match &error {
        PdError::PrefillRejected { status, body } => {
            assert_eq!(*status, StatusCode::BAD_REQUEST);
            assert_eq!(&body[..], b"{\"error\":\"prompt too long\"}");
        }
        other => panic!("unexpected {other}"),
    }
    assert!(!error.is_retryable());
    assert_eq!(error.status(), StatusCode::BAD_REQUEST);
    assert_eq!(s.transport.sent().len(), 1);
    assert_eq!(
        s.backend.outcome_kinds(),
        [(Phase::Prefill, LegOutcome::ClientError)]
    );
    s.backend.assert_balanced();
}

#[test]
fn prefill_retries_stop_at_the_attempt_limit_or_when_no_worker_is_left() {
    let config = FlowConfig {
        max_prefill_attempts: 2,
        ..FlowConfig::default()
    };
    let s = setup(vec![endpoint(P2), endpoint("http://10.0.0.9:1")], config);
    s.transport.push(
        Phase::Prefill,
        Step::status(StatusCode::INTERNAL_SERVER_ERROR, ""),
    );
    s.transport
        .push(Phase::Prefill, Step::transport_error("refused"));
    let error = ready(s.flow.run(&Nixl, request(true), endpoint(P), endpoint(D))).unwrap_err();
    match &error {
        PdError::PrefillFailed {
            attempts,
            last,
            worker,
        } => {
            assert_eq!(*attempts, 2);
            assert_eq!(last, "transport: refused");
            assert_eq!(worker, P2, "the error names the last prefill worker");
        }
        other => panic!("unexpected {other}"),
    }
    assert_eq!(error.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(s.backend.reserved(), 2);
    s.backend.assert_balanced();

    let s = setup(vec![], FlowConfig::default());
    s.transport.push(
        Phase::Prefill,
        Step::status(StatusCode::TOO_MANY_REQUESTS, ""),
    );
    let error = ready(s.flow.run(&Nixl, request(true), endpoint(P), endpoint(D))).unwrap_err();
    assert!(
        matches!(error, PdError::PrefillFailed { attempts: 1, .. }),
        "{error}"
    );
    s.backend.assert_balanced();
}

#[test]
fn decode_is_never_retried_after_its_first_byte() {
    let s = setup(vec![], FlowConfig::default());
    s.transport
        .push(Phase::Prefill, Step::json(nixl_prefill_answer()));
    s.transport
        .push(Phase::Decode, Step::body_error_after(&["data: a\n\n"]));
    let mut response = ready(s.flow.run(&Nixl, request(true), endpoint(P), endpoint(D))).unwrap();
    assert!(matches!(
        poll_frame(&mut response.body),
        Poll::Ready(Some(Ok(_)))
    ));
    assert!(matches!(
        poll_frame(&mut response.body),
        Poll::Ready(Some(Err(_)))
    ));
    assert!(matches!(poll_frame(&mut response.body), Poll::Ready(None)));
    assert_eq!(s.transport.sent().len(), 2);
    assert_eq!(
        s.backend.outcome_kinds()[1],
        (Phase::Decode, LegOutcome::WorkerFailure)
    );
    drop(response);
    s.backend.assert_balanced();
}

#[test]
fn decode_client_error_is_not_a_worker_failure() {
    let s = setup(vec![], FlowConfig::default());
    s.transport
        .push(Phase::Prefill, Step::json(nixl_prefill_answer()));
    s.transport.push(
        Phase::Decode,
        Step::status(StatusCode::UNPROCESSABLE_ENTITY, "bad"),
    );
    let error = ready(s.flow.run(&Nixl, request(true), endpoint(P), endpoint(D))).unwrap_err();
    assert!(!error.is_retryable());
    assert_eq!(error.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        s.backend.outcome_kinds()[1],
        (Phase::Decode, LegOutcome::ClientError)
    );
    s.backend.assert_balanced();
}

#[test]
fn a_leg_the_transport_could_not_send_is_the_callers_failure_and_is_not_retried() {
    // Prefill: the spare prefill worker is never tried.
    let s = setup(vec![endpoint(P2)], FlowConfig::default());
    s.transport
        .push(Phase::Prefill, Step::local_error("invalid header"));
    let error = ready(s.flow.run(&Nixl, request(false), endpoint(P), endpoint(D))).unwrap_err();
    match &error {
        PdError::LegNotSent { phase, reason } => {
            assert_eq!(*phase, Phase::Prefill);
            assert!(reason.contains("invalid header"), "{reason}");
        }
        other => panic!("unexpected {other}"),
    }
    assert!(!error.is_retryable());
    assert_eq!(error.failed_worker(), None, "no worker failed");
    assert_eq!(error.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(s.backend.reserved(), 1, "no second prefill attempt");
    assert_eq!(
        s.backend.outcome_kinds(),
        [(Phase::Prefill, LegOutcome::NotSent)]
    );
    s.backend.assert_balanced();

    // Decode: the prefill succeeded; the decode leg was never sent.
    let s = setup(vec![], FlowConfig::default());
    s.transport
        .push(Phase::Prefill, Step::json(nixl_prefill_answer()));
    s.transport
        .push(Phase::Decode, Step::local_error("invalid uri"));
    let error = ready(s.flow.run(&Nixl, request(false), endpoint(P), endpoint(D))).unwrap_err();
    assert!(
        matches!(
            error,
            PdError::LegNotSent {
                phase: Phase::Decode,
                ..
            }
        ),
        "{error}"
    );
    assert_eq!(
        s.backend.outcome_kinds(),
        [
            (Phase::Prefill, LegOutcome::Success),
            (Phase::Decode, LegOutcome::NotSent)
        ]
    );
    s.backend.assert_balanced();
}
