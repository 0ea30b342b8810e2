//! What encoding a batch of finished spans for OTLP costs the export
//! thread, one way at a time: for instruction counts (callgrind) or
//! timings, on a fixed batch of 510 spans shaped like the router's (85
//! regular requests of six spans each: server, admission, read body,
//! extract, route, attempt, with the attributes the router sets).
//!
//! `--path sdk` is what the router's exporters did before their own
//! encoder: the SDK's records of the spans (`SpanData`), converted by
//! opentelemetry-proto's `group_spans_by_resource_and_scope`, then
//! prost's `encode_to_vec`. `--path own` is the router's records
//! ([`router_http::otel::SpanRecord`]) written by
//! [`router_http::otel::TraceEncoder`], reused from batch to batch, and
//! the copy of its bytes into the request body. Each consumes its batch
//! (the exporter owns it), so both include dropping it.
//!
//! ```sh
//! cargo build --release -p router-http --features otel --example otlp_encode_cost
//! valgrind --tool=callgrind --collect-atstart=no \
//!     --toggle-collect='otlp_encode_cost::encode_*' \
//!     target/release/examples/otlp_encode_cost --path own --loop 20
//! ```
//! `Collected` divided by `--loop` × 510 is the instructions per span.
//! Without valgrind it prints the mean time per span.

use std::borrow::Cow;
use std::time::{Duration, Instant, UNIX_EPOCH};

use bytes::Bytes;
use opentelemetry::InstrumentationScope;
use opentelemetry::trace::{SpanKind, Status};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SpanData;
use prost::Message as _;
use router_http::otel::{Attribute, SpanRecord, TraceEncoder};

/// Requests in the batch (six spans each).
const REQUESTS: u64 = 85;

fn span(
    request: u64,
    index: u64,
    parent: u64,
    kind: SpanKind,
    name: &'static str,
    attributes: Vec<Attribute>,
) -> SpanRecord {
    let start = UNIX_EPOCH + Duration::from_nanos(1_780_000_000_000_000_000 + request * 1_000_000);
    SpanRecord {
        trace_id: (0x5eed_0000_0000_0000_0000_0000_0000_0000 | u128::from(request)).to_be_bytes(),
        span_id: ((request << 8) | index).to_be_bytes(),
        parent_span_id: if parent == 0 {
            [0; 8]
        } else {
            ((request << 8) | parent).to_be_bytes()
        },
        trace_flags: 1,
        parent_is_remote: false,
        trace_state: None,
        kind,
        name: Cow::Borrowed(name),
        start: start + Duration::from_micros(index * 40),
        end: start + Duration::from_micros(index * 40 + 900),
        attributes,
        dropped_attributes: 0,
        status: Status::Unset,
    }
}

/// The spans of one regular request, as the router builds them.
fn request_spans(request: u64) -> Vec<SpanRecord> {
    let worker = format!("http://10.0.0.{}:8000", request % 8);
    vec![
        span(request, 2, 1, SpanKind::Internal, "admission", vec![]),
        span(request, 3, 1, SpanKind::Internal, "read body", vec![]),
        span(
            request,
            4,
            1,
            SpanKind::Internal,
            "extract",
            vec![
                Attribute::new("router.routing_input", "text"),
                Attribute::new("router.routing_bytes", 1024_i64),
            ],
        ),
        span(
            request,
            5,
            1,
            SpanKind::Internal,
            "route",
            vec![
                Attribute::new("router.policy", "cache_aware"),
                Attribute::new("router.candidates", 4_i64),
                Attribute::new("router.decision.reason", "cache_hit"),
                Attribute::new("router.decision.match_rate", 0.75),
                Attribute::new("router.decision.matched", 768_i64),
                Attribute::new("router.worker", worker.clone()),
            ],
        ),
        span(
            request,
            6,
            1,
            SpanKind::Client,
            "POST",
            vec![
                Attribute::new("http.request.method", "POST"),
                Attribute::new("url.full", format!("{worker}/v1/chat/completions")),
                Attribute::new("http.request.resend_count", 0_i64),
                Attribute::new("http.response.status_code", 200_i64),
                Attribute::new("router.time_to_first_byte_ms", 3.25),
                Attribute::new("router.body.end", "complete"),
            ],
        ),
        span(
            request,
            1,
            0,
            SpanKind::Server,
            "POST /v1/chat/completions",
            vec![
                Attribute::new("http.request.method", "POST"),
                Attribute::new("http.route", "/v1/chat/completions"),
                Attribute::new("url.path", "/v1/chat/completions"),
                Attribute::new("http.response.status_code", 200_i64),
                Attribute::new("gen_ai.request.model", "llama-3.1-8b-instruct"),
                Attribute::new("request.id", format!("req-{request:016x}")),
            ],
        ),
    ]
}

/// The SDK's conversion and prost's encoding.
#[inline(never)]
fn encode_sdk(batch: Vec<SpanData>, resource: &ResourceAttributesWithSchema) -> usize {
    let request = ExportTraceServiceRequest {
        resource_spans: group_spans_by_resource_and_scope(batch, resource),
    };
    request.encode_to_vec().len()
}

/// The router's encoder and the copy into a request body.
#[inline(never)]
fn encode_own(batch: Vec<SpanRecord>, encoder: &mut TraceEncoder) -> usize {
    let body = Bytes::copy_from_slice(encoder.encode(&batch));
    drop(batch);
    body.len()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut path = String::from("own");
    let mut loops = 20_u32;
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--path", Some(value)) => path = value,
            ("--loop", Some(value)) => loops = value.parse().expect("--loop N"),
            _ => {
                eprintln!("usage: otlp_encode_cost [--path sdk|own] [--loop N]");
                std::process::exit(2);
            }
        }
    }
    let batch: Vec<SpanRecord> = (0..REQUESTS).flat_map(request_spans).collect();
    let spans = batch.len();
    let resource = Resource::builder_empty()
        .with_service_name("affinity-router")
        .build();
    let converted: ResourceAttributesWithSchema = (&resource).into();
    let scope = InstrumentationScope::builder("router-http").build();
    let mut encoder = TraceEncoder::new();
    encoder.set_resource(&resource);
    encoder.set_scope(&scope);
    // The batches are made before the clock starts: the exporter gets its
    // batch owned, and making it is not part of its work. The SDK's path
    // gets the SDK's records of the same spans.
    let sdk_batch: Vec<SpanData> = batch.iter().map(|span| span.to_span_data(&scope)).collect();
    let mut records: Vec<Vec<SpanRecord>> = Vec::new();
    let mut sdk_records: Vec<Vec<SpanData>> = Vec::new();
    for _ in 0..loops {
        match path.as_str() {
            "sdk" => sdk_records.push(sdk_batch.clone()),
            _ => records.push(batch.clone()),
        }
    }
    let started = Instant::now();
    let mut bytes = 0;
    let mut sdk_records = sdk_records.into_iter();
    let mut records = records.into_iter();
    for _ in 0..loops {
        bytes = match path.as_str() {
            "sdk" => encode_sdk(sdk_records.next().expect("a batch"), &converted),
            "own" => encode_own(records.next().expect("a batch"), &mut encoder),
            other => {
                eprintln!("--path {other}: expected sdk or own");
                std::process::exit(2);
            }
        };
    }
    let elapsed = started.elapsed();
    println!(
        "path={path} spans_per_batch={spans} bytes_per_batch={bytes} loops={loops} ns_per_span={:.1}",
        elapsed.as_nanos() as f64 / f64::from(loops) / spans as f64
    );
}
