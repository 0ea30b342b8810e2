//! What the orchestrator adds per request, with the network taken out: a
//! whole two-phase flow over an in-memory transport (body copy and rewrite,
//! two serializations, headers, guards, outcome records, prefill response
//! parse), the non-streaming merge, and the per-chunk cost of a streaming
//! body with usage rewriting on.

use std::future::{Ready, ready};
use std::hint::black_box;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http::{HeaderMap, StatusCode};
use http_body::Body;
use pd_orchestrator::{
    FlowConfig, ForwardHeaders, KvConnector, LegOutcome, LegRequest, LegResponse, Mooncake,
    MooncakeEndpoint, Nixl, PdBackend, PdEndpoint, PdFlow, PdRequest, Phase, PhaseGuard, Refused,
    Transport,
};
use serde_json::{Value, json};

struct Memory {
    prefill: Bytes,
    decode: Bytes,
}

impl Transport for Memory {
    type Body = http_body_util::Full<Bytes>;
    type Error = std::convert::Infallible;
    type Future = Ready<Result<LegResponse<http_body_util::Full<Bytes>>, Self::Error>>;

    fn send(&self, leg: LegRequest) -> Self::Future {
        let body = match leg.phase {
            Phase::Prefill => self.prefill.clone(),
            Phase::Decode => self.decode.clone(),
        };
        black_box(&leg.body);
        ready(Ok(LegResponse {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: http_body_util::Full::new(body),
        }))
    }
}

/// Counts live phases the way a router's load guards would.
#[derive(Default)]
struct Counting(Arc<AtomicU64>);

struct Guard(Arc<AtomicU64>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl PhaseGuard for Guard {
    fn finish(self, outcome: LegOutcome, _: Option<StatusCode>) {
        black_box(outcome);
    }
}

impl PdBackend for Counting {
    type Worker = Arc<PdEndpoint>;
    type Guard = Guard;

    fn reserve(&self, _: &Arc<PdEndpoint>, _: Phase) -> Result<Guard, Refused> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(Guard(Arc::clone(&self.0)))
    }
    fn reselect_prefill(&self, _: &Arc<PdEndpoint>, _: u32) -> Option<Arc<PdEndpoint>> {
        None
    }
}

fn now<F: std::future::Future>(future: F) -> F::Output {
    let mut cx = Context::from_waker(Waker::noop());
    match std::pin::pin!(future).poll(&mut cx) {
        Poll::Ready(out) => out,
        Poll::Pending => unreachable!("in-memory futures are ready"),
    }
}

fn drain<B: Body + Unpin>(body: &mut B) -> usize {
    let mut cx = Context::from_waker(Waker::noop());
    let mut n = 0;
    while let Poll::Ready(Some(Ok(frame))) = Pin::new(&mut *body).poll_frame(&mut cx) {
        n += frame.data_ref().map_or(0, |_| 1);
    }
    n
}

/// A 3-turn chat of about 4 KB, the common shape.
fn chat_body(stream: bool) -> Value {
    let turn = "Summarize the trade-offs of disaggregated prefill in two paragraphs. ".repeat(20);
    json!({
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": turn},
            {"role": "assistant", "content": turn},
            {"role": "user", "content": "And the risks?"}
        ],
        "max_tokens": 256, "temperature": 0.7, "stream": stream,
        "stream_options": {"include_usage": true}
    })
}

fn flows(c: &mut Criterion) {
    let prefill_answer = json!({
        "id": "cmpl-p", "choices": [{"index": 0, "message": {"role": "assistant", "content": "A"}}],
        "usage": {"prompt_tokens": 1100, "completion_tokens": 1, "total_tokens": 1101,
                  "prompt_tokens_details": {"cached_tokens": 512}},
        "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "0f5c6c8e-engine", "remote_block_ids": (0..70).collect::<Vec<u32>>(),
            "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1}
    });
    let decode_answer = json!({
        "id": "cmpl-d", "choices": [{"index": 0, "message": {"role": "assistant", "content": "B ".repeat(200)}}],
        "usage": {"prompt_tokens": 1100, "completion_tokens": 256, "total_tokens": 1356,
                  "prompt_tokens_details": {"cached_tokens": 1100}}
    });
    let transport = Memory {
        prefill: Bytes::from(prefill_answer.to_string()),
        decode: Bytes::from(decode_answer.to_string()),
    };
    let flow = PdFlow::new(
        transport,
        Arc::new(Counting::default()),
        FlowConfig::default(),
    );
    let prefill = Arc::new(
        PdEndpoint::new("http://10.0.0.1:8000")
            .unwrap()
            .with_mooncake(MooncakeEndpoint {
                bootstrap_addr: "http://10.0.0.1:8998".into(),
                engine_ids: [(0, "engine-0".to_owned())].into_iter().collect(),
            }),
    );
    let decode = Arc::new(PdEndpoint::new("http://10.0.0.2:8000").unwrap());

    let mut group = c.benchmark_group("flow");
    group.throughput(Throughput::Elements(1));
    let cases: [(&str, &dyn KvConnector, bool); 3] = [
        ("nixl_streaming", &Nixl, true),
        ("nixl_non_streaming_merged", &Nixl, false),
        (
            "mooncake_concurrent_streaming",
            &Mooncake::concurrent(),
            true,
        ),
    ];
    for (name, connector, stream) in cases {
        let body = chat_body(stream);
        group.bench_function(name, |b| {
            b.iter(|| {
                let request = PdRequest {
                    path: "/v1/chat/completions".into(),
                    body: body.clone(),
                    request_id: "0123456789abcdef".into(),
                    forward: ForwardHeaders::new(),
                };
                let mut response =
                    now(flow.run(connector, request, prefill.clone(), decode.clone())).unwrap();
                black_box(drain(&mut response.body))
            })
        });
    }
    group.finish();
    assert_eq!(
        flow.backend().0.load(Ordering::Relaxed),
        0,
        "every guard released"
    );
}

fn merge(c: &mut Criterion) {
    let prefill = json!({"usage": {"prompt_tokens": 1100, "prompt_tokens_details": {"cached_tokens": 512}},
        "choices": [{"index": 0, "prompt_logprobs": (0..200).map(|_| json!({"1": {"logprob": -1.0}})).collect::<Vec<_>>()}]});
    let decode = json!({"usage": {"prompt_tokens": 1100, "completion_tokens": 256},
        "choices": [{"index": 0, "text": "x".repeat(1000)}]});
    c.bench_function("merge/non_streaming_200_prompt_logprobs", |b| {
        b.iter(|| {
            let mut decode = decode.clone();
            black_box(pd_orchestrator::merge::merge_non_streaming(
                &prefill,
                &mut decode,
            ))
        })
    });
}

criterion_group!(benches, flows, merge);
criterion_main!(benches);
