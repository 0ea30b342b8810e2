//! Entry points for fuzzing: plain functions that must never panic, on any
//! input. `cargo test` runs them on a seed corpus and pseudo-random inputs
//! (`tests/fuzz_corpus.rs`).

use serde_json::Value;

use crate::connector::{
    KvConnector, LegContext, Mooncake, MoriIo, MoriIoMode, Nixl, prepare_prefill_body,
};
use crate::endpoint::{MooncakeEndpoint, MoriIoEndpoint, PdEndpoint};

/// Parses a Mooncake bootstrap `/query` answer.
pub fn pd_bootstrap_query(data: &[u8]) {
    if let Ok(ranks) = crate::bootstrap::parse_query_response(data) {
        assert!(!ranks.is_empty());
    }
}

/// Splits `data` at the first NUL into a prefill and a decode response and
/// merges them.
pub fn pd_merge_responses(data: &[u8]) {
    let (prefill, decode) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &b"{}"[..]),
    };
    let (Ok(prefill), Ok(mut decode)) = (
        serde_json::from_slice::<Value>(prefill),
        serde_json::from_slice::<Value>(decode),
    ) else {
        return;
    };
    crate::merge::merge_non_streaming(&prefill, &mut decode);
    serde_json::to_vec(&decode).expect("a merged JSON value serializes");
}

/// Treats `data` as a client body (and, after a NUL, a prefill response) and
/// builds both legs' bodies for every connector.
pub fn pd_rewrite_bodies(data: &[u8]) {
    let (client, prefill_response) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], Some(&data[at + 1..])),
        None => (data, None),
    };
    let Ok(Value::Object(client)) = serde_json::from_slice::<Value>(client) else {
        return;
    };
    let response = prefill_response.and_then(|r| serde_json::from_slice::<Value>(r).ok());
    let moriio = MoriIoEndpoint {
        handshake_port: 1,
        notify_port: 2,
        dp_size: 2,
        tp_size: 1,
    };
    let prefill = PdEndpoint::new("http://p:1")
        .expect("static URL")
        .with_dp_rank(1)
        .with_moriio(moriio)
        .with_mooncake(MooncakeEndpoint {
            bootstrap_addr: "http://p:8998".to_owned(),
            engine_ids: [(1, "e".to_owned())].into_iter().collect(),
        });
    let decode = PdEndpoint::new("http://d:2")
        .expect("static URL")
        .with_moriio(moriio);
    let ctx = LegContext {
        request_id: "r",
        attempt: 0,
        prefill: &prefill,
        decode: &decode,
    };
    let connectors: [&dyn KvConnector; 4] = [
        &Nixl,
        &Mooncake::concurrent(),
        &MoriIo::new(MoriIoMode::Read),
        &MoriIo::new(MoriIoMode::Write),
    ];
    for connector in connectors {
        let mut prefill_body = client.clone();
        prepare_prefill_body(&mut prefill_body);
        assert_eq!(prefill_body.get("max_tokens"), Some(&Value::from(1)));
        let _ = connector.prefill_params(&ctx);
        let mut response = response.clone();
        let _ = connector.decode_params(&ctx, response.as_mut());
    }
}

/// Splits `data` at NUL bytes into the chunks of a decode SSE stream and
/// rewrites its usage events; a stream that never mentions `"usage"` must
/// come out byte for byte.
pub fn pd_sse_usage(data: &[u8]) {
    let mut rewriter = crate::flow::UsageRewriter::new(256);
    rewriter.set_prefill(&serde_json::json!({"usage": {"prompt_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 1}}}));
    let mut out = Vec::with_capacity(data.len());
    for chunk in data.split(|&b| b == 0) {
        if let Some(bytes) = rewriter.push(bytes::Bytes::copy_from_slice(chunk)) {
            out.extend_from_slice(&bytes);
        }
    }
    if let Some(bytes) = rewriter.finish() {
        out.extend_from_slice(&bytes);
    }
    let input: Vec<u8> = data.iter().copied().filter(|&b| b != 0).collect();
    if !input.windows(7).any(|w| w == b"\"usage\"") {
        assert_eq!(out, input, "a stream without usage events changed");
    }
}
