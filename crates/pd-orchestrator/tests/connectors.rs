//! The exact bodies and headers of both legs, for every connector.

mod support;

use std::sync::Arc;

use http::HeaderValue;
use pd_orchestrator::{
    FlowConfig, ForwardHeaders, Handoff, KvConnector, Mooncake, MoriIo, MoriIoMode, Nixl, PdError,
    PdFlow, PdRequest, Phase,
};
use serde_json::{Value, json};
use support::*;

fn client_body() -> Value {
    json!({
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
        "max_completion_tokens": 64,
        "min_tokens": 4,
        "stream": true,
        "stream_options": {"include_usage": true},
        "temperature": 0.2,
        "kv_transfer_params": {"injected": "by the client"}
    })
}

/// The client body as the decode leg must see it: everything the client
/// set, minus the client's own `kv_transfer_params`.
fn client_settings() -> Value {
    let mut body = client_body();
    body.as_object_mut().unwrap().remove("kv_transfer_params");
    body
}

fn expected_prefill_body(kv: Value) -> Value {
    json!({
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "min_tokens": 1,
        "stream": false,
        "temperature": 0.2,
        "kv_transfer_params": kv
    })
}

fn with_kv(mut body: Value, kv: Value) -> Value {
    body["kv_transfer_params"] = kv;
    body
}

fn request() -> PdRequest {
    PdRequest {
        path: "/v1/chat/completions".into(),
        body: client_body(),
        request_id: "req-7".into(),
        forward: ForwardHeaders::new()
            .with_authorization(HeaderValue::from_static("Bearer client-key")),
    }
}

struct Run {
    transport: ScriptedTransport,
    backend: Arc<TestBackend>,
    handoff: Handoff,
}

fn run(
    connector: &dyn KvConnector,
    prefill: Arc<pd_orchestrator::PdEndpoint>,
    decode: Arc<pd_orchestrator::PdEndpoint>,
    prefill_answer: Value,
) -> Run {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    transport.push(Phase::Prefill, Step::json(prefill_answer));
    transport.push(
        Phase::Decode,
        Step::chunks(&["data: {}\n\n", "data: [DONE]\n\n"]),
    );
    let backend = TestBackend::new(&log);
    let flow = PdFlow::new(
        transport.clone(),
        Arc::clone(&backend),
        FlowConfig::default(),
    );
    let mut response = ready(flow.run(connector, request(), prefill, decode)).unwrap();
    assert_eq!(
        read_all(&mut response.body).unwrap(),
        b"data: {}\n\ndata: [DONE]\n\n"
    );
    drop(response.body);
    backend.assert_balanced();
    Run {
        transport,
        backend,
        handoff: response.handoff,
    }
}

fn header<'a>(leg: &'a pd_orchestrator::LegRequest, name: &str) -> Option<&'a str> {
    leg.headers.get(name).map(|v| v.to_str().unwrap())
}

#[test]
fn nixl_prefill_params_exact_and_decode_gets_prefill_params_verbatim() {
    let returned = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": "eng-1", "remote_block_ids": [4, 5, 6], "remote_host": "10.0.0.1",
        "remote_port": 5600, "tp_size": 1});
    let prefill = endpoint("http://10.0.0.1:8000");
    let decode = endpoint("http://10.0.0.2:8000");
    let run = run(
        &Nixl,
        prefill,
        decode,
        json!({"id": "p", "choices": [{"index": 0}], "kv_transfer_params": returned.clone()}),
    );
    let sent = run.transport.sent();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0].url, "http://10.0.0.1:8000/v1/chat/completions");
    assert_eq!(sent[1].url, "http://10.0.0.2:8000/v1/chat/completions");
    assert_eq!(
        run.transport.sent_body(0),
        expected_prefill_body(json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}))
    );
    assert_eq!(
        run.transport.sent_body(1),
        with_kv(client_settings(), returned)
    );
    let id = "___prefill_addr_10.0.0.1:8000___decode_addr_10.0.0.2:8000_req-7";
    for leg in &sent {
        assert_eq!(header(leg, "x-request-id"), Some(id));
        assert_eq!(header(leg, "authorization"), Some("Bearer client-key"));
        assert_eq!(header(leg, "content-type"), Some("application/json"));
        assert_eq!(header(leg, "x-data-parallel-rank"), None);
        assert_eq!(leg.headers.len(), 3);
    }
    assert_eq!(run.handoff, Handoff::Params);
}

#[test]
fn nixl_prefill_without_params_proceeds_counted_and_strips_client_params() {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    transport.push(
        Phase::Prefill,
        Step::json(json!({"id": "p", "choices": []})),
    );
    transport.push(Phase::Decode, Step::chunks(&["data: [DONE]\n\n"]));
    let backend = TestBackend::new(&log);
    let flow = PdFlow::new(
        transport.clone(),
        Arc::clone(&backend),
        FlowConfig::default(),
    );
    let response = ready(flow.run(
        &Nixl,
        request(),
        endpoint("http://10.0.0.1:8000"),
        endpoint("http://10.0.0.2:8000"),
    ))
    .unwrap();
    assert_eq!(response.handoff, Handoff::MissingPrefillParams);
    assert_eq!(flow.stats().snapshot().missing_prefill_kv_params, 1);
    // No parameters at all: neither the client's nor invented ones.
    assert_eq!(transport.sent_body(1), client_settings());
    drop(response);
    backend.assert_balanced();
}

#[test]
fn mooncake_concurrent_bodies_headers_and_dp_rank() {
    let prefill = mooncake_prefill("http://10.0.0.1:8000", Some(1));
    let decode = Arc::new(
        pd_orchestrator::PdEndpoint::new("http://10.0.0.2:8000")
            .unwrap()
            .with_dp_rank(0)
            .with_kv_addr("10.0.0.2:22001"),
    );
    let run = run(&Mooncake::concurrent(), prefill, decode, json!({"id": "p"}));
    let sent = run.transport.sent();
    assert_eq!(
        run.transport.sent_body(0),
        expected_prefill_body(json!({"do_remote_decode": true, "do_remote_prefill": false,
            "transfer_id": "xfer-req-7"}))
    );
    assert_eq!(
        run.transport.sent_body(1),
        with_kv(
            client_settings(),
            json!({"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": "xfer-req-7",
                "remote_bootstrap_addr": "http://10.0.0.1:8998", "remote_engine_id": "engine-p-1"})
        )
    );
    let id = "___prefill_addr_10.0.0.1:8000___decode_addr_10.0.0.2:22001_req-7";
    assert_eq!(header(&sent[0], "x-request-id"), Some(id));
    assert_eq!(header(&sent[1], "x-request-id"), Some(id));
    assert_eq!(header(&sent[0], "x-data-parallel-rank"), Some("1"));
    assert_eq!(header(&sent[1], "x-data-parallel-rank"), Some("0"));
    // Concurrent: both legs dispatched before either answered.
    let log = run.transport.log.clone();
    assert!(log.at("send decode") < log.at("head prefill 200"));
}

#[test]
fn mooncake_sequential_sends_the_same_params_after_the_prefill() {
    let run = run(
        &Mooncake::sequential(),
        mooncake_prefill("http://p:8000", None),
        endpoint("http://d:8000"),
        json!({"id": "p"}),
    );
    assert_eq!(
        run.transport.sent_body(1)["kv_transfer_params"],
        json!({"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": "xfer-req-7",
            "remote_bootstrap_addr": "http://p:8998", "remote_engine_id": "engine-p-0"})
    );
    let log = run.transport.log.clone();
    assert!(log.at("release prefill http://p:8000") < log.at("send decode"));
}

#[test]
fn mooncake_without_bootstrap_data_fails_before_any_load() {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    let backend = TestBackend::new(&log);
    let flow = PdFlow::new(
        transport.clone(),
        Arc::clone(&backend),
        FlowConfig::default(),
    );
    let error = ready(flow.run(
        &Mooncake::concurrent(),
        request(),
        endpoint("http://p:8000"),
        endpoint("http://d:8000"),
    ))
    .unwrap_err();
    assert!(matches!(error, PdError::Connector(_)), "{error}");
    assert_eq!(error.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    assert!(transport.sent().is_empty());
    assert_eq!(backend.reserved(), 0);
}

fn moriio_prefill_params() -> Value {
    json!({"transfer_id": "tx-req-7", "do_remote_decode": true, "do_remote_prefill": false,
        "remote_host": "10.0.0.2", "remote_port": 8100, "remote_handshake_port": 7001,
        "remote_notify_port": 7002, "remote_dp_size": 1, "remote_tp_size": 2,
        "remote_engine_id": null, "remote_block_ids": null})
}

#[test]
fn moriio_read_is_sequential_and_moves_engine_and_blocks() {
    let prefill = moriio("http://10.0.0.1:8000", 6001, 6002, 4, Some(3));
    let decode = moriio("http://10.0.0.2:8100", 7001, 7002, 1, None);
    let run = run(
        &MoriIo::new(MoriIoMode::Read),
        prefill,
        decode,
        json!({"kv_transfer_params": {"remote_engine_id": "p-eng", "remote_block_ids": [9, 8],
            "ignored": true}}),
    );
    assert_eq!(
        run.transport.sent_body(0),
        expected_prefill_body(moriio_prefill_params())
    );
    assert_eq!(
        run.transport.sent_body(1),
        with_kv(
            client_settings(),
            json!({"transfer_id": "tx-req-7", "do_remote_decode": false, "do_remote_prefill": true,
                "remote_host": "10.0.0.1", "remote_port": 8000, "remote_handshake_port": 6001,
                "remote_notify_port": 6002, "remote_dp_size": 4, "remote_tp_size": 2,
                "remote_dp_rank": 3, "remote_engine_id": "p-eng", "remote_block_ids": [9, 8]})
        )
    );
    let log = run.transport.log.clone();
    assert!(log.at("head prefill 200") < log.at("send decode"));
    assert_eq!(
        header(&run.transport.sent()[0], "x-data-parallel-rank"),
        Some("3")
    );
}

#[test]
fn moriio_write_is_concurrent_with_null_engine_and_blocks() {
    let prefill = moriio("http://10.0.0.1:8000", 6001, 6002, 1, None);
    let decode = moriio("http://10.0.0.2:8100", 7001, 7002, 1, None);
    let run = run(
        &MoriIo::new(MoriIoMode::Write),
        prefill,
        decode,
        json!({"id": "p"}),
    );
    assert_eq!(
        run.transport.sent_body(0),
        expected_prefill_body(moriio_prefill_params())
    );
    assert_eq!(
        run.transport.sent_body(1)["kv_transfer_params"],
        json!({"transfer_id": "tx-req-7", "do_remote_decode": false, "do_remote_prefill": true,
            "remote_host": "10.0.0.1", "remote_port": 8000, "remote_handshake_port": 6001,
            "remote_notify_port": 6002, "remote_dp_size": 1, "remote_tp_size": 2,
            "remote_engine_id": null, "remote_block_ids": null})
    );
    let log = run.transport.log.clone();
    assert!(log.at("send decode") < log.at("head prefill 200"));
    assert_eq!(run.backend.reserved(), 2);
}

#[test]
fn moriio_without_registration_data_is_refused() {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    let backend = TestBackend::new(&log);
    let flow = PdFlow::new(
        transport.clone(),
        Arc::clone(&backend),
        FlowConfig::default(),
    );
    let error = ready(flow.run(
        &MoriIo::new(MoriIoMode::Read),
        request(),
        moriio("http://p:1", 1, 2, 1, None),
        endpoint("http://d:2"),
    ))
    .unwrap_err();
    assert!(matches!(error, PdError::Connector(_)), "{error}");
    assert_eq!(backend.reserved(), 0);
}

#[test]
fn invalid_body_and_request_id_are_refused_before_dispatch() {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    let backend = TestBackend::new(&log);
    let flow = PdFlow::new(
        transport.clone(),
        Arc::clone(&backend),
        FlowConfig::default(),
    );
    let mut bad = request();
    bad.body = json!(["not", "an", "object"]);
    let error =
        ready(flow.run(&Nixl, bad, endpoint("http://p:1"), endpoint("http://d:2"))).unwrap_err();
    assert!(matches!(error, PdError::InvalidBody));
    for id in [
        "line\nbreak",
        "",
        "host:1234",
        "with space",
        &"x".repeat(129),
    ] {
        let mut bad = request();
        bad.request_id = id.into();
        let error = ready(flow.run(&Nixl, bad, endpoint("http://p:1"), endpoint("http://d:2")))
            .unwrap_err();
        assert!(matches!(error, PdError::InvalidRequestId(_)), "{id:?}");
    }
    assert!(transport.sent().is_empty());
    assert_eq!(backend.reserved(), 0);
}
