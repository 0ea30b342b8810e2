//! Non-streaming responses: the prefill's prompt logprobs and prompt
//! accounting merged into the decode response, through the whole flow.

mod support;

use std::sync::Arc;
use std::task::Poll;

use pd_orchestrator::{FlowConfig, ForwardHeaders, Mooncake, Nixl, PdFlow, PdRequest, Phase};
use serde_json::{Value, json};
use support::*;

const P: &str = "http://10.0.0.1:8000";
const D: &str = "http://10.0.0.2:8000";

fn request(path: &str, body: Value) -> PdRequest {
    PdRequest {
        path: path.into(),
        body,
        request_id: "m1".into(),
        forward: ForwardHeaders::new(),
    }
}

fn completions_prefill() -> Value {
    json!({
        "id": "cmpl-p", "object": "text_completion",
        "choices": [{"index": 0, "text": "Hi there!", "finish_reason": "length",
            "prompt_logprobs": [null, {"1234": {"logprob": -2.5, "rank": 3, "decoded_token": " there"}}],
            "logprobs": {"tokens": ["Hi", " there", "!"], "token_logprobs": [null, -2.5, -0.3],
                         "top_logprobs": [null, {" there": -2.5}, {"!": -0.3}], "text_offset": [0, 2, 8]}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3,
                  "prompt_tokens_details": {"cached_tokens": 0}},
        "kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [1]}
    })
}

fn completions_decode() -> Value {
    json!({
        "id": "cmpl-d", "object": "text_completion",
        "choices": [{"index": 0, "text": "! Bye", "finish_reason": "stop", "prompt_logprobs": null,
            "logprobs": {"tokens": ["!", " Bye"], "token_logprobs": [-0.3, -1.0],
                         "top_logprobs": [{"!": -0.3}, {" Bye": -1.0}], "text_offset": [0, 1]}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                  "prompt_tokens_details": {"cached_tokens": 2}}
    })
}

#[test]
fn completions_logprobs_and_usage_are_merged_once() {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    transport.push(Phase::Prefill, Step::json(completions_prefill()));
    transport.push(Phase::Decode, Step::json(completions_decode()));
    let backend = TestBackend::new(&log);
    let flow = PdFlow::new(
        transport.clone(),
        Arc::clone(&backend),
        FlowConfig::default(),
    );
    let body = json!({"model": "m", "prompt": "Hi there", "max_tokens": 2, "echo": true, "logprobs": 1,
                      "prompt_logprobs": 1});
    let mut response = ready(flow.run(
        &Nixl,
        request("/v1/completions", body),
        endpoint(P),
        endpoint(D),
    ))
    .unwrap();
    let merged: Value = serde_json::from_slice(&read_all(&mut response.body).unwrap()).unwrap();
    assert_eq!(
        merged,
        json!({
            "id": "cmpl-d", "object": "text_completion",
            "choices": [{"index": 0, "text": "! Bye", "finish_reason": "stop",
                "prompt_logprobs": [null, {"1234": {"logprob": -2.5, "rank": 3, "decoded_token": " there"}}],
                "logprobs": {"tokens": ["Hi", " there", "!", " Bye"],
                             "token_logprobs": [null, -2.5, -0.3, -1.0],
                             "top_logprobs": [null, {" there": -2.5}, {"!": -0.3}, {" Bye": -1.0}],
                             "text_offset": [0, 2, 8, 9]}}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                      "prompt_tokens_details": {"cached_tokens": 0}}
        })
    );
    assert_eq!(flow.stats().snapshot().merged_responses, 1);
    drop(response);
    backend.assert_balanced();
}

#[test]
fn chat_prompt_logprobs_are_merged_at_top_level() {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    transport.push(
        Phase::Prefill,
        Step::json(json!({"prompt_logprobs": [null, {"7": {"logprob": -1.5}}],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "A"}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
            "kv_transfer_params": {"remote_engine_id": "e"}})),
    );
    transport.push(
        Phase::Decode,
        Step::json(json!({"prompt_logprobs": null,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "A B"}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14,
                      "prompt_tokens_details": {"cached_tokens": 12}}})),
    );
    let backend = TestBackend::new(&log);
    let flow = PdFlow::new(transport, Arc::clone(&backend), FlowConfig::default());
    let body =
        json!({"model": "m", "messages": [{"role": "user", "content": "q"}], "prompt_logprobs": 1});
    let mut response = ready(flow.run(
        &Nixl,
        request("/v1/chat/completions", body),
        endpoint(P),
        endpoint(D),
    ))
    .unwrap();
    let merged: Value = serde_json::from_slice(&read_all(&mut response.body).unwrap()).unwrap();
    assert_eq!(
        merged["prompt_logprobs"],
        json!([null, {"7": {"logprob": -1.5}}])
    );
    // The decode engine's claim that all 12 prompt tokens were cached is the
    // KV transfer, not a prefix-cache hit; the prefill reported none.
    assert_eq!(
        merged["usage"],
        json!({"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14, "prompt_tokens_details": {}})
    );
    drop(response);
    backend.assert_balanced();
}

#[test]
fn concurrent_non_streaming_waits_for_prefill_usage_but_releases_decode_first() {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    let prefill_gate = Permits::new(0);
    transport.push(
        Phase::Prefill,
        Step::json(
            json!({"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}}),
        )
        .gated(&prefill_gate),
    );
    transport.push(
        Phase::Decode,
        Step::json(json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 5}}})),
    );
    let backend = TestBackend::new(&log);
    let flow = PdFlow::new(transport, Arc::clone(&backend), FlowConfig::default());
    let (prefill, decode) = (mooncake_prefill(P, None), endpoint(D));
    let connector = Mooncake::concurrent();
    let run = flow.run(
        &connector,
        request("/v1/completions", json!({"prompt": "x"})),
        prefill.clone(),
        decode.clone(),
    );
    let mut run = std::pin::pin!(run);
    assert!(poll_n(run.as_mut(), 8).is_pending());
    assert_eq!(
        backend.live(&decode, Phase::Decode),
        0,
        "decode body read: decode is over"
    );
    assert_eq!(backend.live(&prefill, Phase::Prefill), 1);
    prefill_gate.add(3);
    let Poll::Ready(Ok(mut response)) = poll_n(run.as_mut(), 8) else {
        panic!("flow did not finish")
    };
    let merged: Value = serde_json::from_slice(&read_all(&mut response.body).unwrap()).unwrap();
    assert_eq!(
        merged["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
               "prompt_tokens_details": {"cached_tokens": 4}})
    );
    drop(response);
    backend.assert_balanced();
}

#[test]
fn streaming_bodies_and_disabled_merging_pass_decode_bytes_through() {
    for (stream, merge) in [(true, true), (false, false)] {
        let log = Log::default();
        let transport = ScriptedTransport::new(&log);
        transport.push(Phase::Prefill, Step::json(completions_prefill()));
        let decode_bytes = completions_decode().to_string();
        transport.push(Phase::Decode, Step::chunks(&[&decode_bytes]));
        let backend = TestBackend::new(&log);
        let config = FlowConfig {
            merge_non_streaming: merge,
            ..FlowConfig::default()
        };
        let flow = PdFlow::new(transport, Arc::clone(&backend), config);
        let body = json!({"prompt": "Hi there", "stream": stream});
        let mut response = ready(flow.run(
            &Nixl,
            request("/v1/completions", body),
            endpoint(P),
            endpoint(D),
        ))
        .unwrap();
        assert_eq!(
            read_all(&mut response.body).unwrap(),
            decode_bytes.as_bytes()
        );
        assert_eq!(flow.stats().snapshot().merged_responses, 0);
        drop(response);
        backend.assert_balanced();
    }
}

const TOKEN_EVENT: &str = "data: {\"choices\":[{\"index\":0,\"text\":\" hi\"}],\"usage\":null}\n\n";
const USAGE_EVENT: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":4,\"total_tokens\":13,\"prompt_tokens_details\":{\"cached_tokens\":9}}}\n\n";

fn streamed_usage(out: &[u8]) -> Value {
    let text = String::from_utf8(out.to_vec()).unwrap();
    let line = text
        .split("\n\n")
        .find(|event| event.contains("\"choices\":[]"))
        .unwrap_or_else(|| panic!("no usage event in {text}"));
    serde_json::from_str::<Value>(line.strip_prefix("data: ").unwrap()).unwrap()["usage"].clone()
}

#[test]
fn streaming_usage_event_gets_the_prefill_prompt_accounting() {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    transport.push(
        Phase::Prefill,
        Step::json(json!({"usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 2}}, "kv_transfer_params": {"remote_engine_id": "e"}})),
    );
    // The usage event arrives split across two chunks.
    let (head, tail) = USAGE_EVENT.split_at(40);
    transport.push(
        Phase::Decode,
        Step::chunks(&[TOKEN_EVENT, head, tail, "data: [DONE]\n\n"]),
    );
    let backend = TestBackend::new(&log);
    let flow = PdFlow::new(transport, Arc::clone(&backend), FlowConfig::default());
    let body = json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": true}});
    let decode = endpoint(D);
    let mut response = ready(flow.run(
        &Nixl,
        request("/v1/completions", body),
        endpoint(P),
        decode.clone(),
    ))
    .unwrap();

    let Poll::Ready(Some(Ok(first))) = poll_frame(&mut response.body) else {
        panic!("no first frame")
    };
    assert_eq!(
        first.into_data().unwrap(),
        TOKEN_EVENT.as_bytes(),
        "token events pass unchanged"
    );
    let rest = read_all(&mut response.body).unwrap();
    assert_eq!(
        streamed_usage(&rest),
        json!({"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
               "prompt_tokens_details": {"cached_tokens": 2}})
    );
    assert!(
        String::from_utf8(rest)
            .unwrap()
            .ends_with("data: [DONE]\n\n")
    );
    assert_eq!(backend.live(&decode, Phase::Decode), 0);
    drop(response);
    backend.assert_balanced();
}

#[test]
fn concurrent_streaming_usage_uses_the_prefill_once_it_finished() {
    for prefill_done_before_usage in [true, false] {
        let log = Log::default();
        let transport = ScriptedTransport::new(&log);
        let prefill_gate = Permits::new(0);
        let decode_gate = Permits::new(2); // head + token event
        transport.push(
            Phase::Prefill,
            Step::json(json!({"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}}))
                .gated(&prefill_gate),
        );
        transport.push(
            Phase::Decode,
            Step::chunks(&[TOKEN_EVENT, USAGE_EVENT, "data: [DONE]\n\n"]).gated(&decode_gate),
        );
        let backend = TestBackend::new(&log);
        let flow = PdFlow::new(transport, Arc::clone(&backend), FlowConfig::default());
        let body =
            json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": true}});
        let connector = Mooncake::concurrent();
        let mut response = ready(flow.run(
            &connector,
            request("/v1/completions", body),
            mooncake_prefill(P, None),
            endpoint(D),
        ))
        .unwrap();
        assert!(matches!(
            poll_frame(&mut response.body),
            Poll::Ready(Some(Ok(_)))
        ));
        if prefill_done_before_usage {
            prefill_gate.add(3);
        }
        decode_gate.add(10);
        let rest = read_all(&mut response.body).unwrap();
        let cached = streamed_usage(&rest)["prompt_tokens_details"]["cached_tokens"].clone();
        // Before the prefill answered, the stream is passed on as it is.
        assert_eq!(
            cached,
            if prefill_done_before_usage {
                json!(0)
            } else {
                json!(9)
            }
        );
        drop(response);
        backend.assert_balanced();
    }
}

#[test]
fn streams_without_requested_usage_are_not_touched() {
    let log = Log::default();
    let transport = ScriptedTransport::new(&log);
    transport.push(
        Phase::Prefill,
        Step::json(
            json!({"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}}),
        ),
    );
    transport.push(Phase::Decode, Step::chunks(&[TOKEN_EVENT, USAGE_EVENT]));
    let backend = TestBackend::new(&log);
    let flow = PdFlow::new(transport, Arc::clone(&backend), FlowConfig::default());
    let body = json!({"prompt": "x", "stream": true});
    let mut response = ready(flow.run(
        &Nixl,
        request("/v1/completions", body),
        endpoint(P),
        endpoint(D),
    ))
    .unwrap();
    assert_eq!(
        read_all(&mut response.body).unwrap(),
        format!("{TOKEN_EVENT}{USAGE_EVENT}").as_bytes()
    );
    drop(response);
    backend.assert_balanced();
}
