//! OpenTelemetry traces end to end: a router on 127.0.0.1 in front of an
//! engine-sim engine, its spans exported over OTLP to a receiver in this
//! test that decodes them with the OpenTelemetry protocol's own message
//! definitions (`opentelemetry-proto`): over HTTP/protobuf (hyper's
//! HTTP/1.1 server) and over gRPC (hyper's HTTP/2 server, the gRPC frame
//! and trailers read and written here), each in cleartext and over TLS
//! (rustls, with the test CA of `tests/data/otlp-tls`).
//!
//! Most tests share one global subscriber and one export pipeline; each
//! sends its own trace id and looks only at the spans of that trace.
//! Tests with a pipeline of their own run on a single-threaded runtime
//! with a thread-local subscriber.

mod common;

use bytes::Bytes;
use common::{Fixture, call, chat_body};
use engine_sim::{EngineConfig, FaultConfig};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message as _;
use router_http::RouterConfig;
use router_http::otel::{ExportConfig, Protocol, TraceConfig, Tracing};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::net::TcpListener;
use tracing_subscriber::layer::SubscriberExt as _;

/// What the receiver got: every span of every export request, with the
/// service name of its resource.
type Received = Arc<Mutex<Vec<(String, Span)>>>;

/// The path of the OTLP/gRPC trace export call.
const GRPC_EXPORT: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// How a test collector speaks.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Wire {
    /// OTLP/HTTP: `POST /v1/traces`, protobuf bodies.
    Http,
    /// OTLP/gRPC: `TraceService/Export` over HTTP/2, answered with
    /// `grpc-status: 0` in the trailers.
    Grpc,
    /// OTLP/gRPC, every call refused with a trailers-only answer
    /// (`grpc-status: 14`, unavailable).
    GrpcRefusing,
    /// OTLP/HTTP, every export decoded and answered with this status.
    HttpStatus(u16),
}

/// The TLS files of the test collectors (see `tests/data/otlp-tls/gen.sh`).
fn tls_file(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/otlp-tls")
        .join(name)
}

/// A TLS acceptor with the collector's certificate for 127.0.0.1,
/// offering h2 and http/1.1 by ALPN.
fn tls_acceptor() -> tokio_rustls::TlsAcceptor {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(tls_file("collector.pem"))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(tls_file("collector.key")).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

/// Adds the spans of one decoded export to `store`.
fn store_export(store: &Received, export: ExportTraceServiceRequest) {
    let mut store = store.lock().unwrap();
    for resource in export.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| kv.value.as_ref())
            .and_then(|v| match &v.value {
                Some(Value::StringValue(s)) => Some(s.clone()),
                _ => None,
            })
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                store.push((service.clone(), span));
            }
        }
    }
}

/// A response body of gRPC: data frames, then trailers.
type GrpcBody = http_body_util::StreamBody<
    futures_util::stream::Iter<std::vec::IntoIter<Result<hyper::body::Frame<Bytes>, hyper::Error>>>,
>;

/// Answers one request the way `wire` says.
async fn answer(
    wire: Wire,
    store: Received,
    request: http::Request<Incoming>,
) -> Result<http::Response<GrpcBody>, hyper::Error> {
    use hyper::body::Frame;
    let frames = |frames: Vec<Frame<Bytes>>| {
        http_body_util::StreamBody::new(futures_util::stream::iter(
            frames.into_iter().map(Ok).collect::<Vec<_>>(),
        ))
    };
    if let Wire::Http | Wire::HttpStatus(_) = wire {
        assert_eq!(request.method(), http::Method::POST);
        assert_eq!(request.uri().path(), "/v1/traces");
        assert_eq!(request.headers()["content-type"], "application/x-protobuf");
        assert!(
            request.headers()["user-agent"]
                .to_str()
                .unwrap()
                .starts_with("affinity-router-otlp/")
        );
        let body = request.into_body().collect().await?.to_bytes();
        store_export(&store, ExportTraceServiceRequest::decode(body).unwrap());
        let answer = ExportTraceServiceResponse::default().encode_to_vec();
        let status = match wire {
            Wire::HttpStatus(status) => status,
            _ => 200,
        };
        return Ok(http::Response::builder()
            .status(status)
            .header("content-type", "application/x-protobuf")
            .body(frames(vec![Frame::data(Bytes::from(answer))]))
            .unwrap());
    }
    // gRPC over HTTP/2: the call's path, content type and `te`.
    assert_eq!(request.version(), http::Version::HTTP_2);
    assert_eq!(request.method(), http::Method::POST);
    assert_eq!(request.uri().path(), GRPC_EXPORT);
    assert_eq!(request.headers()["content-type"], "application/grpc");
    assert_eq!(request.headers()["te"], "trailers");
    assert!(
        request.headers()["user-agent"]
            .to_str()
            .unwrap()
            .starts_with("affinity-router-otlp/")
    );
    let body = request.into_body().collect().await?.to_bytes();
    if wire == Wire::GrpcRefusing {
        // Trailers-only: the status in the response headers, no body.
        return Ok(http::Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", "14")
            .header("grpc-message", "collector overloaded")
            .body(frames(Vec::new()))
            .unwrap());
    }
    // One length-prefixed message, not compressed.
    assert_eq!(body[0], 0, "compressed flag");
    let length = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
    assert_eq!(body.len(), 5 + length);
    store_export(
        &store,
        ExportTraceServiceRequest::decode(body.slice(5..)).unwrap(),
    );
    let message = ExportTraceServiceResponse::default().encode_to_vec();
    let mut framed = vec![0];
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(&message);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    Ok(http::Response::builder()
        .header("content-type", "application/grpc")
        .body(frames(vec![
            Frame::data(Bytes::from(framed)),
            Frame::trailers(trailers),
        ]))
        .unwrap())
}

/// An OTLP/HTTP traces receiver on 127.0.0.1: decodes each POST to
/// `/v1/traces` as an `ExportTraceServiceRequest` and answers 200 with an
/// empty `ExportTraceServiceResponse`.
async fn receiver() -> (SocketAddr, Received) {
    collector(Wire::Http, false).await
}

/// A trace collector on 127.0.0.1 speaking `wire`, over TLS when `tls`
/// (HTTP/1.1 and HTTP/2 both served, h2c by prior knowledge).
async fn collector(wire: Wire, tls: bool) -> (SocketAddr, Received) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let received: Received = Arc::default();
    let store = Arc::clone(&received);
    let acceptor = tls.then(tls_acceptor);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let store = Arc::clone(&store);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |request: http::Request<Incoming>| {
                        answer(wire, Arc::clone(&store), request)
                    });
                let server = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                );
                match acceptor {
                    Some(acceptor) => {
                        let Ok(stream) = acceptor.accept(stream).await else {
                            return;
                        };
                        let _ = server.serve_connection(TokioIo::new(stream), service).await;
                    }
                    None => {
                        let _ = server.serve_connection(TokioIo::new(stream), service).await;
                    }
                }
            });
        }
    });
    (addr, received)
}

/// The export pipeline shared by this file's tests, and what its
/// receiver got. Set up once: the subscriber is process-wide.
struct Pipeline {
    tracing: Tracing,
    received: Received,
    /// Runs the receiver and the export requests for the process's
    /// lifetime (tests end with the process).
    _runtime: tokio::runtime::Runtime,
}

static PIPELINE: OnceLock<Pipeline> = OnceLock::new();

/// The receiver and the exporter run on a runtime of their own, so that
/// they outlive each test's runtime.
fn pipeline() -> &'static Pipeline {
    // Built on a thread of its own: the tests call this from inside their
    // runtime, where blocking on another one is refused.
    PIPELINE.get_or_init(|| std::thread::spawn(start_pipeline).join().unwrap())
}

fn start_pipeline() -> Pipeline {
    {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (addr, received) = runtime.block_on(receiver());
        let config = ExportConfig {
            endpoint: format!("http://{addr}/v1/traces"),
            service_name: "router-under-test".into(),
            ..ExportConfig::default()
        };
        let tracing = Tracing::start(&config, runtime.handle().clone()).unwrap();
        let subscriber = tracing_subscriber::registry().with(tracing.layer());
        tracing::subscriber::set_global_default(subscriber).unwrap();
        Pipeline {
            tracing,
            received,
            _runtime: runtime,
        }
    }
}

/// Flushes the export, then waits (bounded) until `count` spans of
/// `trace_id` arrived; returns them.
async fn spans_of(trace_id: &[u8], count: usize) -> Vec<Span> {
    spans_within(trace_id, count, Duration::from_secs(20)).await
}

/// [`spans_of`], asserting that the trace has exactly `count` spans.
async fn exactly_spans_of(trace_id: &str, count: usize) -> Vec<Span> {
    let spans = spans_of(&unhex(trace_id), count).await;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(spans.len(), count, "{names:?}");
    spans
}

/// A chat to the router at `addr` in the client's trace `trace_id` (its
/// `traceparent` names [`PARENT_SPAN`]), answered 200; its body.
async fn traced_chat(addr: SocketAddr, trace_id: &str, content: &str, stream: bool) -> Bytes {
    let traceparent = format!("00-{trace_id}-{PARENT_SPAN}-01");
    let (status, _, body) = call(
        addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("traceparent", &traceparent),
        ],
        chat_body(content, stream),
    )
    .await;
    assert_eq!(status, 200, "{body:?}");
    body
}

/// [`spans_of`], waiting at most `wait`.
async fn spans_within(trace_id: &[u8], count: usize, wait: Duration) -> Vec<Span> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        tokio::task::spawn_blocking(|| pipeline().tracing.force_flush())
            .await
            .unwrap()
            .unwrap();
        let spans: Vec<Span> = pipeline()
            .received
            .lock()
            .unwrap()
            .iter()
            .filter(|(service, span)| {
                assert_eq!(service, "router-under-test");
                span.trace_id == trace_id
            })
            .map(|(_, span)| span.clone())
            .collect();
        if spans.len() >= count || tokio::time::Instant::now() >= deadline {
            return spans;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

fn str_attr<'a>(span: &'a Span, key: &str) -> &'a str {
    match attr(span, key) {
        Some(Value::StringValue(s)) => s,
        other => panic!("{}: {key} is {other:?}", span.name),
    }
}

fn int_attr(span: &Span, key: &str) -> i64 {
    match attr(span, key) {
        Some(Value::IntValue(i)) => *i,
        other => panic!("{}: {key} is {other:?}", span.name),
    }
}

fn bool_attr(span: &Span, key: &str) -> bool {
    match attr(span, key) {
        Some(Value::BoolValue(b)) => *b,
        other => panic!("{}: {key} is {other:?}", span.name),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

fn traced_config() -> RouterConfig {
    let mut config = RouterConfig {
        trace: TraceConfig {
            enabled: true,
            excluded_paths: vec!["/health".into()],
            ..TraceConfig::default()
        },
        ..RouterConfig::default()
    };
    config.retry.initial_backoff = Duration::from_millis(5);
    config
}

/// [`traced_config`], `/metrics` excluded too: a test that scrapes the
/// span counters while it waits adds no span of its own to them.
fn unscraped_config() -> RouterConfig {
    let mut config = traced_config();
    config.trace.excluded_paths.push("/metrics".into());
    config
}

const PARENT_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_chat_with_one_retry_is_one_trace_continued_into_the_engine() {
    pipeline();
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let fixture = streamed_chat_with_retry(traced_config(), trace_id).await;
    let spans = spans_of(&unhex(trace_id), 8).await;
    check_retry_trace(&spans, &fixture, trace_id);
}

/// Starts a router (`config`) in front of one engine that fails its first
/// request with a retryable 503, and sends it a streamed chat in the trace
/// `trace_id`: the router retries (the only worker, so the same one) and
/// the second attempt streams the answer.
async fn streamed_chat_with_retry(config: RouterConfig, trace_id: &str) -> Fixture {
    let engine = EngineConfig {
        faults: FaultConfig {
            fail_first: 1,
            fail_status: Some(503),
            ..FaultConfig::default()
        },
        ..EngineConfig::default()
    };
    let fixture = Fixture::start(config, vec![engine]).await;
    let traceparent = format!("00-{trace_id}-{PARENT_SPAN}-01");
    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("traceparent", &traceparent),
            ("tracestate", "vendor=abc"),
            ("x-request-id", "trace-test-1"),
        ],
        chat_body("hello traces", true),
    )
    .await;
    assert_eq!(status, 200, "{body:?}");
    assert!(String::from_utf8_lossy(&body).contains("[DONE]"));
    fixture
}

/// A pipeline of a test's own, exporting to `endpoint` over `protocol`,
/// its layer the subscriber of this thread while the guard lives.
fn local_pipeline(config: ExportConfig) -> (Arc<Tracing>, tracing::subscriber::DefaultGuard) {
    let tracing = Arc::new(Tracing::start(&config, tokio::runtime::Handle::current()).unwrap());
    let subscriber = tracing_subscriber::registry().with(tracing.layer());
    let guard = tracing::subscriber::set_default(subscriber);
    (tracing, guard)
}

/// Flushes `tracing` until `received` holds `count` spans of `trace_id`
/// (at most 20 s), and returns them.
async fn spans_received(
    tracing: &Arc<Tracing>,
    received: &Received,
    trace_id: &[u8],
    count: usize,
) -> Vec<Span> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let flushing = Arc::clone(tracing);
        // A failed flush is a failed export: what the caller asserts on.
        let _ = tokio::task::spawn_blocking(move || flushing.force_flush())
            .await
            .unwrap();
        let spans: Vec<Span> = received
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, span)| span.trace_id == trace_id)
            .map(|(_, span)| span.clone())
            .collect();
        if spans.len() >= count || tokio::time::Instant::now() >= deadline {
            return spans;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The same request as over OTLP/HTTP, exported over OTLP/gRPC (h2c): the
/// collector decodes the same span tree.
#[tokio::test(flavor = "current_thread")]
async fn over_grpc_a_streamed_chat_with_one_retry_is_the_same_trace() {
    let (addr, received) = collector(Wire::Grpc, false).await;
    let (tracing, _default) = local_pipeline(ExportConfig {
        endpoint: format!("http://{addr}"),
        protocol: Protocol::Grpc,
        service_name: "router-under-test".into(),
        scheduled_delay: Duration::from_millis(20),
        ..ExportConfig::default()
    });
    let router_config = RouterConfig {
        metrics_sources: vec![tracing.metrics_source()],
        ..unscraped_config()
    };
    let trace_id = "5cf92f3577b34da6a3ce929d0e0e4737";
    let fixture = streamed_chat_with_retry(router_config, trace_id).await;
    let spans = spans_received(&tracing, &received, &unhex(trace_id), 8).await;
    check_retry_trace(&spans, &fixture, trace_id);
    assert!(
        received
            .lock()
            .unwrap()
            .iter()
            .all(|(service, _)| service == "router-under-test")
    );
    // Counted as exported, none dropped.
    let counts = trace_counts(fixture.addr).await;
    assert_eq!(counts.exported, 8, "{counts:?}");
    assert_eq!(counts.accounted(), 8, "{counts:?}");
    drop(fixture);
    tokio::task::spawn_blocking(move || drop(tracing))
        .await
        .unwrap();
}

/// A collector over TLS, with the router trusting the test CA
/// ([`ExportConfig::ca_file`]): over HTTPS (HTTP/protobuf) and gRPC over
/// TLS, a traced request's six spans arrive; trusting another CA instead,
/// the same export fails the certificate check and is counted as failed.
#[tokio::test(flavor = "current_thread")]
async fn over_tls_the_collector_gets_the_spans_only_from_a_router_that_trusts_it() {
    for (protocol, wire) in [
        (Protocol::HttpProtobuf, Wire::Http),
        (Protocol::Grpc, Wire::Grpc),
    ] {
        for (ca, trusted) in [("ca.pem", true), ("other-ca.pem", false)] {
            let (addr, received) = collector(wire, true).await;
            let endpoint = match protocol {
                Protocol::Grpc => format!("https://127.0.0.1:{}", addr.port()),
                _ => format!("https://127.0.0.1:{}/v1/traces", addr.port()),
            };
            let (tracing, default) = local_pipeline(ExportConfig {
                endpoint,
                protocol,
                ca_file: Some(tls_file(ca)),
                scheduled_delay: Duration::from_millis(20),
                timeout: Duration::from_secs(5),
                ..ExportConfig::default()
            });
            let router_config = RouterConfig {
                metrics_sources: vec![tracing.metrics_source()],
                ..unscraped_config()
            };
            let fixture = Fixture::start(router_config, vec![EngineConfig::default()]).await;
            let trace_id = "6df92f3577b34da6a3ce929d0e0e4738";
            let traceparent = format!("00-{trace_id}-{PARENT_SPAN}-01");
            let (status, _, _) = call(
                fixture.addr,
                "POST",
                "/v1/chat/completions",
                &[
                    ("content-type", "application/json"),
                    ("traceparent", &traceparent),
                ],
                chat_body("over tls", false),
            )
            .await;
            assert_eq!(status, 200);
            let case = format!("{protocol} trusting {ca}");
            if trusted {
                let spans = spans_received(&tracing, &received, &unhex(trace_id), 6).await;
                assert_eq!(spans.len(), 6, "{case}");
                assert!(
                    spans.iter().any(|s| s.name == "POST /v1/chat/completions"),
                    "{case}"
                );
                let counts = trace_counts(fixture.addr).await;
                assert_eq!(
                    (counts.exported, counts.export_failed),
                    (6, 0),
                    "{case}: {counts:?}"
                );
            } else {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
                let counts = loop {
                    let flushing = Arc::clone(&tracing);
                    let _ = tokio::task::spawn_blocking(move || flushing.force_flush())
                        .await
                        .unwrap();
                    let counts = trace_counts(fixture.addr).await;
                    if counts.export_failed >= 6 || tokio::time::Instant::now() >= deadline {
                        break counts;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                assert_eq!(
                    (counts.exported, counts.export_failed),
                    (0, 6),
                    "{case}: {counts:?}"
                );
                assert!(received.lock().unwrap().is_empty(), "{case}");
            }
            drop(fixture);
            drop(default);
            tokio::task::spawn_blocking(move || drop(tracing))
                .await
                .unwrap();
        }
    }
}

/// How an OTLP/gRPC collector fails a test.
#[derive(Debug, Clone, Copy)]
enum Failing {
    /// Nothing listens on the port: connections are refused.
    Down,
    /// Connections are accepted and never answered.
    Hanging,
    /// Every call is answered with a non-zero `grpc-status`.
    Refusing,
}

/// Over gRPC, a collector that is down, hangs or refuses every call costs
/// requests nothing, and every span is counted dropped: none exported,
/// failed exports as `export_failed`.
#[tokio::test(flavor = "current_thread")]
async fn over_grpc_a_failing_collector_costs_requests_nothing_and_drops_are_counted() {
    for failing in [Failing::Down, Failing::Hanging, Failing::Refusing] {
        let addr = match failing {
            Failing::Down => {
                let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
                listener.local_addr().unwrap()
                // Dropped here: nothing listens on the port any more.
            }
            Failing::Hanging => {
                let hanging = TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = hanging.local_addr().unwrap();
                tokio::spawn(async move {
                    let mut held = Vec::new();
                    while let Ok((stream, _)) = hanging.accept().await {
                        held.push(stream);
                    }
                });
                addr
            }
            Failing::Refusing => collector(Wire::GrpcRefusing, false).await.0,
        };
        // The export's timeout (1 s) is long next to a request: 20
        // requests that waited for the export even once each would take
        // 20 s.
        let (tracing, default) = local_pipeline(ExportConfig {
            endpoint: format!("http://{addr}"),
            protocol: Protocol::Grpc,
            max_queue_size: 4,
            scheduled_delay: Duration::from_millis(10),
            timeout: Duration::from_secs(1),
            ..ExportConfig::default()
        });
        let router_config = RouterConfig {
            metrics_sources: vec![tracing.metrics_source()],
            ..unscraped_config()
        };
        let fixture = Fixture::start(router_config, vec![EngineConfig::default()]).await;
        let started = std::time::Instant::now();
        for _ in 0..20 {
            let (status, _, _) = call(
                fixture.addr,
                "POST",
                "/v1/chat/completions",
                &[("content-type", "application/json")],
                chat_body("collector fails", false),
            )
            .await;
            assert_eq!(status, 200, "{failing:?}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{failing:?}: {:?}",
            started.elapsed()
        );
        // Every one of the 20 requests' 6 spans accounted for, none
        // exported, failed exports counted.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let counts = loop {
            let counts = trace_counts(fixture.addr).await;
            if counts.export_failed > 0 && counts.accounted() == 120 && counts.queued == 0
                || tokio::time::Instant::now() >= deadline
            {
                break counts;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(counts.export_failed > 0, "{failing:?}: {counts:?}");
        assert_eq!(counts.exported, 0, "{failing:?}: {counts:?}");
        assert_eq!(counts.accounted(), 120, "{failing:?}: {counts:?}");
        drop(fixture);
        drop(default);
        tokio::task::spawn_blocking(move || drop(tracing))
            .await
            .unwrap();
    }
}

/// `max_export_batch_size` spans waiting are sent at once, long before the
/// scheduled delay: one chat's six spans, with a batch of six and a delay
/// of an hour, reach the collector without a flush.
#[tokio::test(flavor = "current_thread")]
async fn a_full_batch_is_sent_without_waiting_for_the_delay() {
    let (addr, received) = collector(Wire::Http, false).await;
    let (tracing, _default) = local_pipeline(ExportConfig {
        endpoint: format!("http://{addr}/v1/traces"),
        max_queue_size: 64,
        max_export_batch_size: 6,
        scheduled_delay: Duration::from_secs(3600),
        ..ExportConfig::default()
    });
    let router_config = RouterConfig {
        metrics_sources: vec![tracing.metrics_source()],
        ..unscraped_config()
    };
    let fixture = Fixture::start(router_config, vec![EngineConfig::default()]).await;
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        chat_body("one batch", false),
    )
    .await;
    assert_eq!(status, 200);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while received.lock().unwrap().len() < 6 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let names: Vec<String> = received
        .lock()
        .unwrap()
        .iter()
        .map(|(_, span)| span.name.clone())
        .collect();
    assert_eq!(names.len(), 6, "{names:?}");
    assert!(
        names.iter().any(|name| name == "POST /v1/chat/completions"),
        "{names:?}"
    );
    drop(fixture);
    tokio::task::spawn_blocking(move || drop(tracing))
        .await
        .unwrap();
}

/// The trace of a streamed chat with one retry (the engine's first answer
/// a 503), as the collector decoded it: a server span continuing the
/// client's context, the phases, two decisions and two attempts, each
/// attempt's context received by the engine.
fn check_retry_trace(spans: &[Span], fixture: &Fixture, trace_id: &str) {
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(spans.len(), 8, "{names:?}");

    // The server span continues the client's trace under its span.
    let server: Vec<&Span> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Server as i32)
        .collect();
    assert_eq!(server.len(), 1, "{names:?}");
    let server = server[0];
    assert_eq!(server.name, "POST /v1/chat/completions");
    assert_eq!(hex(&server.parent_span_id), PARENT_SPAN);
    assert_eq!(str_attr(server, "http.request.method"), "POST");
    assert_eq!(str_attr(server, "http.route"), "/v1/chat/completions");
    assert_eq!(int_attr(server, "http.response.status_code"), 200);
    assert_eq!(str_attr(server, "gen_ai.request.model"), "sim-model");
    assert_eq!(str_attr(server, "request.id"), "trace-test-1");
    assert_eq!(server.trace_state, "vendor=abc");

    // The phases before routing, children of the server span, in order.
    let phase = |name: &str| -> &Span {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} span in {names:?}"))
    };
    let (admission, read, extract) = (phase("admission"), phase("read body"), phase("extract"));
    for span in [admission, read, extract] {
        assert_eq!(span.parent_span_id, server.span_id, "{}", span.name);
        assert_eq!(span.kind, SpanKind::Internal as i32);
    }
    assert!(admission.end_time_unix_nano <= read.start_time_unix_nano);
    assert!(read.end_time_unix_nano <= extract.start_time_unix_nano);
    assert_eq!(str_attr(extract, "router.routing_input"), "text");
    // The routing text of the chat: "user: hello traces\n".
    assert_eq!(int_attr(extract, "router.routing_bytes"), 19);

    // Two decisions and two attempts, all children of the server span.
    let children = |keep: &dyn Fn(&Span) -> bool| -> Vec<&Span> {
        let mut out: Vec<&Span> = spans.iter().filter(|s| keep(s)).collect();
        out.sort_by_key(|s| s.start_time_unix_nano);
        out
    };
    let decisions = children(&|s| s.name == "route");
    let attempts = children(&|s| s.kind == SpanKind::Client as i32);
    assert_eq!((decisions.len(), attempts.len()), (2, 2), "{names:?}");
    let worker = fixture.engines[0].url();
    for decision in &decisions {
        assert_eq!(decision.parent_span_id, server.span_id);
        assert_eq!(str_attr(decision, "router.policy"), "cache_aware");
        assert_eq!(int_attr(decision, "router.candidates"), 1);
        assert!(!str_attr(decision, "router.decision.reason").is_empty());
        assert_eq!(str_attr(decision, "router.worker"), worker);
        assert!(attr(decision, "router.decision.match_rate").is_some());
    }
    for (n, attempt) in attempts.iter().enumerate() {
        assert_eq!(attempt.parent_span_id, server.span_id);
        // Named by the method alone (OpenTelemetry's HTTP client spans).
        assert_eq!(attempt.name, "POST");
        assert_eq!(str_attr(attempt, "url.full"), worker);
        assert_eq!(int_attr(attempt, "http.request.resend_count"), n as i64);
    }
    assert_eq!(int_attr(attempts[0], "http.response.status_code"), 503);
    assert_eq!(str_attr(attempts[0], "router.retry.cause"), "status 503");
    assert_eq!(int_attr(attempts[1], "http.response.status_code"), 200);
    assert!(attr(attempts[1], "router.retry.cause").is_none());
    // The first decision's span ended before its attempt started.
    assert!(decisions[0].end_time_unix_nano <= attempts[0].start_time_unix_nano);
    // The server span lasts until the streamed body ended.
    assert!(server.end_time_unix_nano >= attempts[1].end_time_unix_nano);

    // The engine got each attempt's own context, in the client's trace.
    let received = fixture.engines[0].traceparents();
    let expected: Vec<String> = attempts
        .iter()
        .map(|a| format!("00-{trace_id}-{}-01", hex(&a.span_id)))
        .collect();
    assert_eq!(received, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn excluded_paths_and_a_router_with_tracing_off_make_no_span() {
    pipeline();
    // Tracing on, but /health excluded.
    let fixture = Fixture::start(traced_config(), vec![EngineConfig::default()]).await;
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let traceparent = format!("00-{trace_id}-{PARENT_SPAN}-01");
    let (status, _, _) = call(
        fixture.addr,
        "GET",
        "/health",
        &[("traceparent", &traceparent)],
        "",
    )
    .await;
    assert_eq!(status, 200);

    // Tracing off: the client's traceparent goes to the engine unchanged.
    let off = Fixture::start(RouterConfig::default(), vec![EngineConfig::default()]).await;
    let (status, _, _) = call(
        off.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("traceparent", &traceparent),
        ],
        chat_body("no traces", false),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(off.engines[0].traceparents(), vec![traceparent.clone()]);

    // A traced request after both, in the same trace: its spans arrive,
    // and they are the only ones of the trace.
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("traceparent", &traceparent),
        ],
        chat_body("traced", false),
    )
    .await;
    assert_eq!(status, 200);
    let spans = spans_of(&unhex(trace_id), 6).await;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names.len(), 6, "{names:?}");
    assert!(names.contains(&"POST /v1/chat/completions"), "{names:?}");
    // Nothing else comes later either.
    let later = spans_within(&unhex(trace_id), 7, Duration::from_millis(500)).await;
    assert_eq!(later.len(), 6);

    // A known route spelled with a trailing slash: the span names the
    // route as the router knows it, and `url.path` keeps what was sent.
    let liveness_trace = "0af7651916cd43dd8448eb211c80319d";
    let liveness_parent = format!("00-{liveness_trace}-{PARENT_SPAN}-01");
    let (status, _, _) = call(
        fixture.addr,
        "GET",
        "/liveness/",
        &[("traceparent", &liveness_parent)],
        "",
    )
    .await;
    assert_eq!(status, 200);
    let spans = spans_of(&unhex(liveness_trace), 1).await;
    let server = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("a server span");
    assert_eq!(server.name, "GET /liveness");
    assert_eq!(str_attr(server, "http.route"), "/liveness");
    assert_eq!(str_attr(server, "url.path"), "/liveness/");
}

/// A test runtime on this thread only, so that a thread-local subscriber
/// sees every span of the router.
#[tokio::test(flavor = "current_thread")]
async fn a_hanging_collector_does_not_slow_requests() {
    // A pipeline of its own, exporting to a collector that accepts
    // connections and never answers, with a tiny queue: spans are
    // dropped, requests answer as usual.
    let hanging = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = hanging.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = hanging.accept().await {
            held.push(stream);
        }
    });
    let config = ExportConfig {
        endpoint: format!("http://{addr}/v1/traces"),
        max_queue_size: 4,
        scheduled_delay: Duration::from_millis(10),
        timeout: Duration::from_millis(300),
        ..ExportConfig::default()
    };
    let tracing = Tracing::start(&config, tokio::runtime::Handle::current()).unwrap();
    let subscriber = tracing_subscriber::registry().with(tracing.layer());
    let _default = tracing::subscriber::set_default(subscriber);
    let router_config = RouterConfig {
        metrics_sources: vec![tracing.metrics_source()],
        ..traced_config()
    };
    let fixture = Fixture::start(router_config, vec![EngineConfig::default()]).await;
    let started = std::time::Instant::now();
    for _ in 0..20 {
        let (status, _, _) = call(
            fixture.addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            chat_body("collector hangs", false),
        )
        .await;
        assert_eq!(status, 200);
    }
    // 20 requests, each far faster than one export's timeout.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // The operator sees it on /metrics: spans dropped because the queue
    // stayed full, then the hung batch failing at its timeout; none
    // exported, and every one of the 20 requests' 6 spans accounted for.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let counts = loop {
        let counts = trace_counts(fixture.addr).await;
        if counts.export_failed > 0 && counts.accounted() == 120
            || tokio::time::Instant::now() >= deadline
        {
            break counts;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(counts.queue_full > 0, "{counts:?}");
    assert!(counts.export_failed > 0, "{counts:?}");
    assert_eq!(counts.exported, 0, "{counts:?}");
    assert!(counts.queued <= 4, "{counts:?}");
    assert_eq!(counts.accounted(), 120, "{counts:?}");
    // Stopping the pipeline is bounded by the export timeout too.
    let stopping = std::time::Instant::now();
    tokio::task::spawn_blocking(move || drop(tracing))
        .await
        .unwrap();
    assert!(
        stopping.elapsed() < Duration::from_secs(10),
        "{:?}",
        stopping.elapsed()
    );
}

/// The trace pipeline's series of a router's `/metrics`.
#[derive(Debug, Default)]
struct TraceCounts {
    exported: u64,
    queue_full: u64,
    export_failed: u64,
    shutdown: u64,
    queued: u64,
}

impl TraceCounts {
    /// Spans exported, dropped or still queued: every span built.
    fn accounted(&self) -> u64 {
        self.exported + self.queue_full + self.export_failed + self.shutdown + self.queued
    }
}

/// Scrapes `/metrics` and reads the `router_trace_*` series (each must be
/// there).
async fn trace_counts(addr: SocketAddr) -> TraceCounts {
    let (status, _, body) = call(addr, "GET", "/metrics", &[], "").await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body.to_vec()).unwrap();
    let value = |series: &str| -> u64 {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series} in /metrics:\n{text}"))
            .trim()
            .parse()
            .unwrap_or_else(|err| panic!("{series}: {err}"))
    };
    TraceCounts {
        exported: value("router_trace_spans_exported_total"),
        queue_full: value("router_trace_spans_dropped_total{reason=\"queue_full\"}"),
        export_failed: value("router_trace_spans_dropped_total{reason=\"export_failed\"}"),
        shutdown: value("router_trace_spans_dropped_total{reason=\"shutdown\"}"),
        queued: value("router_trace_spans_queued"),
    }
}

/// With a working collector, `/metrics` counts as exported exactly the
/// spans the collector decoded, and drops none. A pipeline and receiver of
/// its own, on this test's thread (a thread-local subscriber).
#[tokio::test(flavor = "current_thread")]
async fn exported_spans_are_counted_as_the_collector_decoded_them() {
    let (addr, received) = receiver().await;
    let config = ExportConfig {
        endpoint: format!("http://{addr}/v1/traces"),
        scheduled_delay: Duration::from_millis(20),
        ..ExportConfig::default()
    };
    let tracing = Arc::new(Tracing::start(&config, tokio::runtime::Handle::current()).unwrap());
    let subscriber = tracing_subscriber::registry().with(tracing.layer());
    let _default = tracing::subscriber::set_default(subscriber);
    let router_config = RouterConfig {
        metrics_sources: vec![tracing.metrics_source()],
        ..traced_config()
    };
    let fixture = Fixture::start(router_config, vec![EngineConfig::default()]).await;
    for stream in [false, true, false] {
        let (status, _, _) = call(
            fixture.addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            chat_body("counted", stream),
        )
        .await;
        assert_eq!(status, 200);
    }
    // Three requests of six spans each.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let (decoded, counts) = loop {
        let flushing = Arc::clone(&tracing);
        tokio::task::spawn_blocking(move || flushing.force_flush())
            .await
            .unwrap()
            .unwrap();
        let decoded = received.lock().unwrap().len() as u64;
        let counts = trace_counts(fixture.addr).await;
        if decoded >= 18 && counts.exported >= 18 || tokio::time::Instant::now() >= deadline {
            break (decoded, counts);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(decoded, 18);
    assert_eq!(counts.exported, decoded, "{counts:?}");
    assert_eq!(
        (
            counts.queue_full,
            counts.export_failed,
            counts.shutdown,
            counts.queued
        ),
        (0, 0, 0, 0),
        "{counts:?}"
    );
    drop(fixture);
    tokio::task::spawn_blocking(move || drop(tracing))
        .await
        .unwrap();
}

/// Over OTLP/HTTP, any 2xx answer is an export (the spans counted
/// exported) and any other status a failed one (counted `export_failed`),
/// the collector having received and decoded the same spans either way.
#[tokio::test(flavor = "current_thread")]
async fn over_http_a_2xx_answer_is_an_export_and_any_other_a_failed_one() {
    for status in [202_u16, 500, 404] {
        let (addr, received) = collector(Wire::HttpStatus(status), false).await;
        let (tracing, default) = local_pipeline(ExportConfig {
            endpoint: format!("http://{addr}/v1/traces"),
            scheduled_delay: Duration::from_millis(10),
            timeout: Duration::from_secs(2),
            ..ExportConfig::default()
        });
        let router_config = RouterConfig {
            metrics_sources: vec![tracing.metrics_source()],
            ..unscraped_config()
        };
        let fixture = Fixture::start(router_config, vec![EngineConfig::default()]).await;
        for _ in 0..5 {
            let (answered, _, _) = call(
                fixture.addr,
                "POST",
                "/v1/chat/completions",
                &[("content-type", "application/json")],
                chat_body("http status", false),
            )
            .await;
            assert_eq!(answered, 200, "collector answering {status}");
        }
        // Five requests of six spans each, all sent, none left queued.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let counts = loop {
            let counts = trace_counts(fixture.addr).await;
            if counts.accounted() == 30 && counts.queued == 0
                || tokio::time::Instant::now() >= deadline
            {
                break counts;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(
            received.lock().unwrap().len(),
            30,
            "collector answering {status}"
        );
        let expected = if status < 300 { (30, 0) } else { (0, 30) };
        assert_eq!(
            (counts.exported, counts.export_failed),
            expected,
            "collector answering {status}: {counts:?}"
        );
        drop(fixture);
        drop(default);
        tokio::task::spawn_blocking(move || drop(tracing))
            .await
            .unwrap();
    }
}

/// A P/D router on 127.0.0.1 (NIXL) in front of a prefill and a decode
/// engine-sim engine.
struct PdRouter {
    addr: SocketAddr,
    engines: Vec<engine_sim::EngineHandle>,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<router_http::ShutdownOutcome>,
}

impl PdRouter {
    /// `config` with a NIXL P/D deployment of one engine per role.
    async fn start(config: RouterConfig) -> Self {
        Self::start_with(config, FaultConfig::default()).await
    }

    /// [`start`](Self::start), the decode engine injecting `decode_faults`.
    async fn start_with(config: RouterConfig, decode_faults: FaultConfig) -> Self {
        Self::start_full(config, decode_faults, None).await
    }

    /// [`start_with`](Self::start_with), the decode role choosing by
    /// `decode_policy` (default: the router's policy).
    async fn start_full(
        config: RouterConfig,
        decode_faults: FaultConfig,
        decode_policy: Option<lb_policies::PolicyConfig>,
    ) -> Self {
        Self::start_on(
            router_http::PdConnector::Nixl,
            config,
            &[decode_faults],
            decode_policy,
        )
        .await
    }

    /// [`start_full`](Self::start_full) through `connector` (NIXL or
    /// MoRI-IO: neither needs a bootstrap server), with a decode engine
    /// for each of `decode_faults` (`engines[1..]`).
    async fn start_on(
        connector: router_http::PdConnector,
        config: RouterConfig,
        decode_faults: &[FaultConfig],
        decode_policy: Option<lb_policies::PolicyConfig>,
    ) -> Self {
        use engine_sim::{Role, TransferRegistry};
        use router_http::{PdConfig, PdConnector, PdWorkerConfig, Router};
        let (kv, mode) = fleet_sim::for_deployment(connector).unwrap();
        let registry = TransferRegistry::new();
        let mut engines = Vec::new();
        let roles = std::iter::once((Role::Prefill, FaultConfig::default()))
            .chain(decode_faults.iter().map(|f| (Role::Decode, f.clone())));
        for (role, faults) in roles {
            let config = EngineConfig {
                role,
                kv_connector: kv,
                moriio_mode: mode,
                faults,
                ..EngineConfig::instant()
            };
            let options = engine_sim::ServeOptions {
                registry: Some(registry.clone()),
                ..engine_sim::ServeOptions::default()
            };
            engines.push(engine_sim::spawn(config, options).await.unwrap());
        }
        let worker = |engine: &engine_sim::EngineHandle| {
            let worker = PdWorkerConfig::new(engine.url());
            match connector {
                PdConnector::MoriIo(_) => worker.with_moriio(pd_orchestrator::MoriIoEndpoint {
                    handshake_port: 7301,
                    notify_port: 7302,
                    dp_size: 1,
                    tp_size: 1,
                }),
                _ => worker,
            }
        };
        let mut pd = PdConfig::new(connector);
        pd.prefill = vec![worker(&engines[0])];
        pd.decode = engines[1..].iter().map(worker).collect();
        pd.decode_policy = decode_policy;
        let config = RouterConfig {
            pd: Some(pd),
            ..config
        };
        let router = Router::start(config).await.unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            router
                .serve(listener, async {
                    let _ = stopped.await;
                })
                .await
        });
        Self {
            addr,
            engines,
            stop,
            server,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.server.await;
    }
}

/// A prefill/decode request: one client span per leg under the server
/// span, each naming its worker, phase, connector and the size of its
/// `kv_transfer_params`, and each engine receives its own leg's context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_leg_of_a_prefill_decode_request_is_a_span_continued_into_its_engine() {
    pipeline();
    let config = RouterConfig {
        policy: lb_policies::PolicyConfig::named("cache_aware"),
        ..traced_config()
    };
    let round_robin = lb_policies::PolicyConfig::named("round_robin");
    let pd = PdRouter::start_full(config, FaultConfig::default(), Some(round_robin)).await;
    let (addr, engines) = (pd.addr, &pd.engines);

    let trace_id = "d4cda95b652f4a1592b449d5929fda1b";
    traced_chat(addr, trace_id, "prefill then decode", false).await;
    // Server, admission, read body, extract, route, prefill, decode.
    let spans = exactly_spans_of(trace_id, 7).await;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let server_span = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("the server span");
    assert_eq!(hex(&server_span.parent_span_id), PARENT_SPAN);
    // The pair decision: both roles' policies, and the prefill worker
    // with why and among how many. NIXL chooses the decode worker late
    // (when the prefill has answered): the route span says so, and the
    // decode leg's span tells that choice.
    let route = spans
        .iter()
        .find(|s| s.name == "route")
        .unwrap_or_else(|| panic!("no route span in {names:?}"));
    assert_eq!(route.parent_span_id, server_span.span_id);
    assert_eq!(str_attr(route, "router.pd.prefill.policy"), "cache_aware");
    assert_eq!(str_attr(route, "router.pd.decode.policy"), "round_robin");
    assert_eq!(
        str_attr(route, "router.pd.prefill.worker"),
        engines[0].url()
    );
    assert_eq!(int_attr(route, "router.pd.prefill.candidates"), 1);
    // A first request matches nothing cached: a low match, rate 0.
    assert_eq!(
        str_attr(route, "router.pd.prefill.reason"),
        "cache_low_match"
    );
    assert_eq!(float_attr(route, "router.pd.prefill.match_rate"), 0.0);
    assert!(bool_attr(route, "router.pd.decode.late"));
    assert!(attr(route, "router.pd.decode.worker").is_none());
    let decode_leg = spans
        .iter()
        .find(|s| s.name == "decode")
        .unwrap_or_else(|| panic!("no decode span in {names:?}"));
    assert_eq!(
        str_attr(decode_leg, "router.pd.decode.policy"),
        "round_robin"
    );
    assert_eq!(
        str_attr(decode_leg, "router.pd.decode.reason"),
        "round_robin"
    );
    assert_eq!(int_attr(decode_leg, "router.pd.decode.candidates"), 1);
    assert!(attr(decode_leg, "router.pd.decode.match_rate").is_none());
    let legs_start = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Client as i32)
        .map(|s| s.start_time_unix_nano)
        .min()
        .expect("the legs");
    assert!(
        route.end_time_unix_nano <= legs_start,
        "decided before the legs"
    );
    let legs: Vec<&Span> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Client as i32)
        .collect();
    assert_eq!(legs.len(), 2, "{names:?}");
    for (phase, engine) in [("prefill", &engines[0]), ("decode", &engines[1])] {
        let leg: Vec<&&Span> = legs.iter().filter(|s| s.name == phase).collect();
        assert_eq!(leg.len(), 1, "one {phase} span in {names:?}");
        let leg = leg[0];
        assert_eq!(leg.parent_span_id, server_span.span_id, "{phase}");
        let worker = engine.url();
        assert_eq!(str_attr(leg, "router.worker"), worker, "{phase}");
        assert_eq!(str_attr(leg, "router.pd.phase"), phase);
        assert_eq!(str_attr(leg, "router.pd.connector"), "nixl");
        assert_eq!(str_attr(leg, "http.request.method"), "POST");
        assert_eq!(
            str_attr(leg, "url.full"),
            format!("{worker}/v1/chat/completions")
        );
        assert_eq!(str_attr(leg, "server.address"), "127.0.0.1");
        assert_eq!(int_attr(leg, "http.response.status_code"), 200);
        // NIXL: the prefill leg asks for a remote decode, the decode leg
        // carries what the prefill engine answered.
        assert!(
            int_attr(leg, "router.pd.kv_transfer_params.bytes") > 0,
            "{phase}"
        );
        // The engine continues its leg's span, in the client's trace.
        let expected = format!("00-{trace_id}-{}-01", hex(&leg.span_id));
        assert_eq!(engine.traceparents(), vec![expected], "{phase}");
    }
    // Prefill first (NIXL is sequential), both within the server span.
    let (prefill, decode) = if legs[0].name == "prefill" {
        (legs[0], legs[1])
    } else {
        (legs[1], legs[0])
    };
    assert!(prefill.start_time_unix_nano <= decode.start_time_unix_nano);
    assert!(server_span.end_time_unix_nano >= decode.end_time_unix_nano);
    pd.stop().await;
}

/// A prefill/decode request whose connector chooses both workers at
/// arrival (MoRI-IO WRITE, both legs at once), retried: each attempt has
/// its own `route` span naming the pair, and its own two legs. Of two
/// decode engines one always fails; round_robin sends one of two requests
/// (at least) to it first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_attempt_of_a_prefill_decode_request_has_its_pair_decision_span() {
    use pd_orchestrator::MoriIoMode as PdMoriIoMode;
    use router_http::PdConnector;
    pipeline();
    let failing = FaultConfig {
        fixed_status: Some(503),
        ..FaultConfig::default()
    };
    let pd = PdRouter::start_on(
        PdConnector::MoriIo(PdMoriIoMode::Write),
        traced_config(),
        &[failing, FaultConfig::default()],
        Some(lb_policies::PolicyConfig::named("round_robin")),
    )
    .await;
    let (addr, engines) = (pd.addr, &pd.engines);
    let (failing, healthy) = (engines[1].url(), engines[2].url());
    let mut retried = None;
    for trace_id in [
        "5e0b8f3a0c1d4e2f8a9b0c1d2e3f4a5b",
        "6f1c904b1d2e5f309bac1d2e3f405b6c",
    ] {
        traced_chat(addr, trace_id, "two legs at once", false).await;
        // Server, admission, read body, extract, then per attempt a route,
        // a prefill and a decode (a request's spans arrive together).
        let spans = spans_of(&unhex(trace_id), 7).await;
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        let routes = spans.iter().filter(|s| s.name == "route").count();
        assert_eq!(spans.len(), 4 + 3 * routes, "{names:?}");
        if routes == 2 {
            retried = Some(spans);
            break;
        }
        assert_eq!(routes, 1, "{names:?}");
    }
    let spans = retried.expect("one of the two requests went to the failing engine first");
    let server = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("the server span");
    let sorted = |name: &str| {
        let mut named: Vec<&Span> = spans.iter().filter(|s| s.name == name).collect();
        named.sort_by_key(|s| s.start_time_unix_nano);
        named
    };
    let (routes, decodes) = (sorted("route"), sorted("decode"));
    assert_eq!(decodes.len(), 2);
    for (route, decode_worker) in routes.iter().zip([&failing, &healthy]) {
        assert_eq!(route.parent_span_id, server.span_id);
        assert_eq!(
            str_attr(route, "router.pd.prefill.worker"),
            engines[0].url()
        );
        assert_eq!(int_attr(route, "router.pd.prefill.candidates"), 1);
        assert_eq!(str_attr(route, "router.pd.decode.worker"), *decode_worker);
        assert_eq!(str_attr(route, "router.pd.decode.policy"), "round_robin");
        assert!(!str_attr(route, "router.pd.prefill.reason").is_empty());
        assert!(attr(route, "router.pd.decode.late").is_none());
    }
    // Both engines were candidates the first time; the retry left the
    // failed one out.
    assert_eq!(int_attr(routes[0], "router.pd.decode.candidates"), 2);
    assert_eq!(int_attr(routes[1], "router.pd.decode.candidates"), 1);
    assert_eq!(str_attr(decodes[0], "router.worker"), failing);
    assert!(is_error(decodes[0]), "the first decode leg failed");
    assert!(!is_error(decodes[1]));
    // The retry is decided after the failed attempt, before its own legs.
    assert!(routes[1].start_time_unix_nano >= decodes[0].end_time_unix_nano);
    assert!(routes[1].end_time_unix_nano <= decodes[1].start_time_unix_nano);
    pd.stop().await;
}

/// A conversation's next turn routed by `kv_aware` on token ids: the
/// extract span says the router routed on tokens and how many (the ids the
/// engine computes), the decision span names kv_aware, the exact-score
/// reason and the engine that holds the conversation's blocks, and that
/// engine continues the attempt's span.
#[cfg(all(feature = "tokens", feature = "kv-events"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenized_kv_aware_turn_is_traced_from_its_tokens_to_the_engine_holding_them() {
    use lb_policies::PolicyConfig;
    use prompt_tokens::PromptTokenizer;
    use router_http::tokens::Tokenizers;

    pipeline();
    let engines = common::kv_engines(EngineConfig::default(), 2).await;
    let chars_per_token = engine_sim::ModelConfig::default().chars_per_token;
    let config = RouterConfig {
        policy: PolicyConfig::named("kv_aware"),
        tokenizers: Tokenizers::default()
            .with_default(Arc::new(PromptTokenizer::synthetic(chars_per_token))),
        kv_events: common::kv_events_config(&engines),
        ..unscraped_config()
    };
    let urls: Vec<String> = engines.iter().map(|e| e.url()).collect();
    let fixture = Fixture::start_with_urls(config, Vec::new(), &urls).await;
    let _background = fixture.router.spawn_background();

    let conversation = |turns: usize| {
        let mut messages = vec![serde_json::json!({
            "role": "system",
            "content": "You keep the logbook of the lighthouse at Skagen. ".repeat(16),
        })];
        for t in 0..turns {
            messages.push(serde_json::json!({"role": "user", "content": format!("Entry {t}?")}));
            messages
                .push(serde_json::json!({"role": "assistant", "content": format!("Logged {t}.")}));
        }
        messages.push(serde_json::json!({"role": "user", "content": "Next entry?"}));
        serde_json::json!({"model": "sim-model", "messages": messages, "max_tokens": 4})
    };

    // The first turn lands somewhere; wait until the router's index holds
    // every block the engines stored, so the next turn is scored exactly.
    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        conversation(0).to_string(),
    )
    .await;
    assert_eq!(status, 200, "{body:?}");
    let owner = engines
        .iter()
        .position(|e| e.stats().requests_finished == 1)
        .expect("one engine served the first turn");
    let held = engines[owner].cached_block_hashes().len() as u64;
    assert!(held > 0);
    common::wait_for_blocks(&fixture, held).await;

    let trace_id = "6e0c63257de34c926f9efcd03927272e";
    let traceparent = format!("00-{trace_id}-{PARENT_SPAN}-01");
    let next = conversation(1);
    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("traceparent", &traceparent),
        ],
        next.to_string(),
    )
    .await;
    assert_eq!(status, 200, "{body:?}");

    // Server, admission, read body, extract, route, one attempt.
    let spans = spans_of(&unhex(trace_id), 6).await;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(spans.len(), 6, "{names:?}");
    let server = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("the server span");
    assert_eq!(hex(&server.parent_span_id), PARENT_SPAN);
    let one = |name: &str| -> &Span {
        let found: Vec<&Span> = spans.iter().filter(|s| s.name == name).collect();
        assert_eq!(found.len(), 1, "one {name} span in {names:?}");
        found[0]
    };

    // The ids the router routed on are the ones the engine computes.
    let extract = one("extract");
    assert_eq!(extract.parent_span_id, server.span_id);
    assert_eq!(str_attr(extract, "router.routing_input"), "tokens");
    let request = prompt_tokens::ChatRequest::from_value(&next).unwrap();
    let ids = PromptTokenizer::synthetic(chars_per_token)
        .chat_tokens(&request)
        .unwrap();
    assert_eq!(int_attr(extract, "router.routing_tokens"), ids.len() as i64);

    // kv_aware chose the engine holding the first turn's blocks, on their
    // exact score, among both engines.
    let owner_url = engines[owner].url();
    let route = one("route");
    assert_eq!(route.parent_span_id, server.span_id);
    assert_eq!(str_attr(route, "router.policy"), "kv_aware");
    assert_eq!(int_attr(route, "router.candidates"), 2);
    assert_eq!(str_attr(route, "router.decision.reason"), "kv_hit");
    assert_eq!(str_attr(route, "router.worker"), owner_url);
    assert!(float_attr(route, "router.decision.match_rate") > 0.0);
    // The match's length is in the routing input's units: token ids, of
    // which the rate is the share.
    let matched = int_attr(route, "router.decision.matched");
    assert!(
        matched > 0 && matched < ids.len() as i64,
        "{matched} of {}",
        ids.len()
    );
    let rate = matched as f64 / ids.len() as f64;
    assert!((float_attr(route, "router.decision.match_rate") - rate).abs() <= 0.0005);
    assert!(extract.end_time_unix_nano <= route.start_time_unix_nano);

    let attempt = one("POST");
    assert_eq!(str_attr(attempt, "url.full"), owner_url);
    assert_eq!(attempt.parent_span_id, server.span_id);
    assert_eq!(attempt.kind, SpanKind::Client as i32);
    assert_eq!(int_attr(attempt, "http.response.status_code"), 200);
    assert!(route.end_time_unix_nano <= attempt.start_time_unix_nano);
    // The owner served both turns, and continued this one's attempt span.
    assert_eq!(engines[owner].stats().requests_finished, 2);
    let expected = format!("00-{trace_id}-{}-01", hex(&attempt.span_id));
    assert_eq!(
        engines[owner].traceparents().last(),
        Some(&expected),
        "{:?}",
        engines[owner].traceparents()
    );
}

/// The extraction span says how the tokenizer's segment cache served a
/// turn: a conversation's next turn finds its earlier messages cached and
/// tokenizes its new one. A trained byte-level BPE with the Llama 3
/// template (the synthetic tokenizer has no segments).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extract_span_counts_the_segments_the_cache_served() {
    use prompt_tokens::PromptTokenizer;
    use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
    use router_http::tokens::Tokenizers;

    pipeline();
    let dir = std::env::temp_dir().join(format!("otel-segments-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_model_dir(
        &dir,
        prompt_tokens::TemplateFamily::Llama3,
        TestTokenizerKind::ByteLevelRegex,
    )
    .unwrap();
    let tokenizer = PromptTokenizer::from_path(&dir, None).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let config = RouterConfig {
        tokenizers: Tokenizers::default().with_default(Arc::new(tokenizer)),
        ..unscraped_config()
    };
    let fixture = Fixture::start(config, vec![EngineConfig::default()]).await;
    let turn = |question: &str| {
        serde_json::json!({"model": "sim-model", "messages": [
            {"role": "system", "content": "You answer questions about lighthouses."},
            {"role": "user", "content": "Where is Skagen?"},
            {"role": "assistant", "content": "At the northern tip of Denmark."},
            {"role": "user", "content": question},
        ]})
        .to_string()
    };
    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        turn("How tall is its lighthouse?"),
    )
    .await;
    assert_eq!(status, 200, "{body:?}");

    let trace_id = "0c1b0c1b0c1b0c1b0c1b0c1b0c1b0c1b";
    let traceparent = format!("00-{trace_id}-{PARENT_SPAN}-01");
    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("traceparent", &traceparent),
        ],
        turn("When was it built?"),
    )
    .await;
    assert_eq!(status, 200, "{body:?}");
    let spans = spans_of(&unhex(trace_id), 6).await;
    let extract = spans
        .iter()
        .find(|s| s.name == "extract")
        .expect("the extract span");
    assert_eq!(str_attr(extract, "router.routing_input"), "tokens");
    // The system message and the first exchange were tokenized by the
    // first turn; only the new question (and what follows it) is not.
    let hits = int_attr(extract, "router.tokens.segment_cache_hits");
    let misses = int_attr(extract, "router.tokens.segment_cache_misses");
    assert!(hits >= 3, "{hits} segments from the cache");
    assert!((1..=2).contains(&misses), "{misses} segments tokenized");
}

/// A pipeline of a test's own exporting to a receiver of its own, its
/// layer this thread's subscriber: every span a router on this thread
/// builds reaches the receiver.
struct SpanSink {
    tracing: Arc<Tracing>,
    received: Received,
    _default: tracing::subscriber::DefaultGuard,
}

impl SpanSink {
    async fn start() -> Self {
        let (addr, received) = receiver().await;
        let (tracing, default) = local_pipeline(ExportConfig {
            endpoint: format!("http://{addr}/v1/traces"),
            scheduled_delay: Duration::from_millis(20),
            ..ExportConfig::default()
        });
        Self {
            tracing,
            received,
            _default: default,
        }
    }

    /// The spans received, once at least `expected` arrived (flushing
    /// until then, at most 20 s).
    async fn count_when(&self, expected: usize) -> usize {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let flushing = Arc::clone(&self.tracing);
            tokio::task::spawn_blocking(move || flushing.force_flush())
                .await
                .unwrap()
                .unwrap();
            let count = self.received.lock().unwrap().len();
            if count >= expected || tokio::time::Instant::now() >= deadline {
                return count;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The spans received, after a pause that lets a late span arrive.
    async fn count_settled(&self) -> usize {
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.count_when(0).await
    }

    /// Spans received of the trace `trace_id` (hex).
    fn of_trace(&self, trace_id: &str) -> usize {
        let id = unhex(trace_id);
        self.received
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, span)| span.trace_id == id)
            .count()
    }
}

/// Off means free: a router with tracing off (or an excluded path) builds
/// no span at all, even with a pipeline connected that would take every
/// span. A test runtime on this thread, so that the thread-local
/// subscriber (the pipeline's layer) is the router's.
#[tokio::test(flavor = "current_thread")]
async fn with_tracing_off_the_request_path_builds_no_span() {
    let sink = SpanSink::start().await;
    let traceparent = format!("00-0123456789abcdef0123456789abcdef-{PARENT_SPAN}-01");
    let headers = [
        ("content-type", "application/json"),
        ("traceparent", traceparent.as_str()),
    ];

    let off = Fixture::start(RouterConfig::default(), vec![EngineConfig::default()]).await;
    for stream in [false, true] {
        let (status, _, _) = call(
            off.addr,
            "POST",
            "/v1/chat/completions",
            &headers,
            chat_body("off", stream),
        )
        .await;
        assert_eq!(status, 200);
    }
    assert_eq!(sink.count_settled().await, 0);

    // A P/D router with tracing off: no leg span either, and both legs
    // forward the client's traceparent.
    let pd = PdRouter::start(RouterConfig::default()).await;
    let (status, _, _) = call(
        pd.addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        chat_body("off, prefill then decode", false),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(sink.count_settled().await, 0, "P/D");
    for engine in &pd.engines {
        assert_eq!(engine.traceparents(), vec![traceparent.clone()]);
    }
    pd.stop().await;

    let on = Fixture::start(traced_config(), vec![EngineConfig::default()]).await;
    let (status, _, _) = call(on.addr, "GET", "/health", &headers, "").await;
    assert_eq!(status, 200);
    assert_eq!(sink.count_settled().await, 0, "an excluded path");
    // The control: the same pipeline gets a traced request's spans.
    let (status, _, _) = call(
        on.addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        chat_body("on", false),
    )
    .await;
    assert_eq!(status, 200);
    sink.count_when(6).await;
    assert_eq!(
        sink.count_settled().await,
        6,
        "server, admission, read body, extract, decision, attempt"
    );
}

/// Head sampling: at ratio 0 a request that starts a trace builds no span,
/// one whose `traceparent` is sampled builds its whole tree, and at ratio
/// 1 one whose `traceparent` is not sampled builds none (parent-based).
#[tokio::test(flavor = "current_thread")]
async fn the_router_samples_before_it_builds_a_span() {
    let sink = SpanSink::start().await;
    let sampled_trace = "0123456789abcdef0123456789abcdef";
    let unsampled_trace = "fedcba9876543210fedcba9876543210";
    let sampled = format!("00-{sampled_trace}-{PARENT_SPAN}-01");
    let unsampled = format!("00-{unsampled_trace}-{PARENT_SPAN}-00");

    let mut never = traced_config();
    never.trace.sampling_ratio = 0.0;
    let never = Fixture::start(never, vec![EngineConfig::default()]).await;
    let chat = |addr, traceparent: Option<String>| async move {
        let mut headers = vec![("content-type", "application/json".to_owned())];
        headers.extend(traceparent.map(|t| ("traceparent", t)));
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (status, _, _) = call(
            addr,
            "POST",
            "/v1/chat/completions",
            &headers,
            chat_body("sampling", false),
        )
        .await;
        assert_eq!(status, 200);
    };
    for _ in 0..20 {
        chat(never.addr, None).await;
    }
    assert_eq!(sink.count_settled().await, 0, "ratio 0, no parent: no span");
    chat(never.addr, Some(sampled.clone())).await;
    sink.count_when(6).await;
    assert_eq!(
        sink.count_settled().await,
        6,
        "ratio 0, a sampled parent: the whole tree"
    );
    assert_eq!(sink.of_trace(sampled_trace), 6);

    let always = Fixture::start(traced_config(), vec![EngineConfig::default()]).await;
    chat(always.addr, Some(unsampled)).await;
    chat(always.addr, None).await;
    sink.count_when(12).await;
    assert_eq!(
        sink.count_settled().await,
        12,
        "ratio 1: no span for an unsampled parent, the whole tree without one"
    );
    assert_eq!(sink.of_trace(unsampled_trace), 0, "an unsampled parent");
}

/// How long the engines below stall after the response head: the body's
/// time, which the span that carries the body must cover.
const STALL: Duration = Duration::from_millis(400);

/// Less than [`STALL`]: the bound the tests assert, with room for clock
/// reads on a loaded machine (the stall itself is never shorter).
const STALL_BOUND_NANOS: u64 = 300_000_000;

fn float_attr(span: &Span, key: &str) -> f64 {
    match attr(span, key) {
        Some(Value::DoubleValue(f)) => *f,
        other => panic!("{}: {key} is {other:?}", span.name),
    }
}

/// Nanoseconds from the span's response head (its start plus its
/// `router.time_to_first_byte_ms`) to its end.
fn after_head_nanos(span: &Span) -> u64 {
    let ttfb = float_attr(span, "router.time_to_first_byte_ms");
    assert!(ttfb >= 0.0, "{}: time to first byte {ttfb}", span.name);
    let head = span.start_time_unix_nano + (ttfb * 1e6) as u64;
    span.end_time_unix_nano.saturating_sub(head)
}

/// The OTLP status code of an error span.
const STATUS_ERROR: i32 = 2;

fn is_error(span: &Span) -> bool {
    span.status.as_ref().is_some_and(|s| s.code == STATUS_ERROR)
}

/// Sends a streamed chat with `headers` on a connection of its own and
/// returns once the response head arrived, dropping the connection (the
/// client goes away mid-stream).
async fn disconnect_after_head(addr: SocketAddr, headers: &[(&str, &str)]) {
    let mut connection = common::Connection::open(addr).await;
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    let response = connection
        .send(
            "POST",
            "/v1/chat/completions",
            &all,
            chat_body("going away", true),
        )
        .await;
    assert_eq!(response.status(), 200);
    drop(response);
    drop(connection);
}

/// The answering attempt's span carries the streamed body: it ends at the
/// last byte, well after the response head, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_ends_its_attempt_span_at_the_last_byte() {
    pipeline();
    let fixture = Fixture::start(traced_config(), vec![EngineConfig::default()]).await;
    let trace_id = "6e0c63257de34c926f9efcd03899a1b2";
    let traceparent = format!("00-{trace_id}-{PARENT_SPAN}-01");
    let stall = format!("stall-after-headers={}ms", STALL.as_millis());
    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("traceparent", &traceparent),
            ("x-sim-fault", &stall),
        ],
        chat_body("slow stream", true),
    )
    .await;
    assert_eq!(status, 200, "{body:?}");
    assert!(String::from_utf8_lossy(&body).contains("[DONE]"));
    // Server, admission, read body, extract, route, attempt.
    let spans = spans_of(&unhex(trace_id), 6).await;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(spans.len(), 6, "{names:?}");
    let attempt = spans
        .iter()
        .find(|s| s.kind == SpanKind::Client as i32)
        .expect("the attempt span");
    let server = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("the server span");
    assert_eq!(int_attr(attempt, "http.response.status_code"), 200);
    assert_eq!(str_attr(attempt, "router.body.end"), "complete");
    assert!(!is_error(attempt));
    // The head came at once, the last chunk after the stall.
    let after_head = after_head_nanos(attempt);
    assert!(
        after_head >= STALL_BOUND_NANOS,
        "the attempt span ended {after_head} ns after the response head"
    );
    assert!(server.end_time_unix_nano >= attempt.end_time_unix_nano);
}

/// A client that goes away mid-stream ends the attempt span then, marked,
/// and not as an error of the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_stream_ends_the_attempt_span_with_a_marker() {
    pipeline();
    let fixture = Fixture::start(traced_config(), vec![EngineConfig::default()]).await;
    let trace_id = "5f1e2d3c4b5a69788796a5b4c3d2e1f0";
    let traceparent = format!("00-{trace_id}-{PARENT_SPAN}-01");
    // The engine sends the head, then nothing until the client is gone.
    disconnect_after_head(
        fixture.addr,
        &[
            ("traceparent", &traceparent),
            ("x-sim-fault", "stall-after-headers"),
        ],
    )
    .await;
    let spans = spans_of(&unhex(trace_id), 6).await;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let attempt = spans
        .iter()
        .find(|s| s.kind == SpanKind::Client as i32)
        .unwrap_or_else(|| panic!("no attempt span in {names:?}"));
    assert_eq!(int_attr(attempt, "http.response.status_code"), 200);
    assert_eq!(str_attr(attempt, "router.body.end"), "client_disconnected");
    assert!(!is_error(attempt));
    // The server span ends then too, after its child (not at its last
    // poll, the response head).
    let server = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .unwrap_or_else(|| panic!("no server span in {names:?}"));
    assert!(server.end_time_unix_nano >= attempt.end_time_unix_nano);
}

/// In P/D mode the decode leg carries the client's stream: its span ends
/// at the last byte (the prefill leg's at its head), or, marked, when the
/// client goes away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_leg_span_ends_with_the_client_stream() {
    pipeline();
    let stalled = FaultConfig {
        stall_after_headers: Some(STALL),
        ..FaultConfig::default()
    };
    let pd = PdRouter::start_with(traced_config(), stalled).await;
    let trace_id = "b7ad6b7169203331b7ad6b7169203331";
    let body = traced_chat(pd.addr, trace_id, "slow decode", true).await;
    assert!(String::from_utf8_lossy(&body).contains("[DONE]"));
    // Server, admission, read body, extract, route, prefill, decode.
    let spans = exactly_spans_of(trace_id, 7).await;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let leg = |name: &str| -> &Span {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} span in {names:?}"))
    };
    let (prefill, decode) = (leg("prefill"), leg("decode"));
    assert_eq!(str_attr(decode, "router.body.end"), "complete");
    let after_head = after_head_nanos(decode);
    assert!(
        after_head >= STALL_BOUND_NANOS,
        "the decode span ended {after_head} ns after its head"
    );
    // The prefill leg still ends at its head (its body is read inside the
    // flow, before the decode leg is sent).
    assert!(attr(prefill, "router.body.end").is_none());
    assert!(prefill.end_time_unix_nano <= decode.start_time_unix_nano);
    let server = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("the server span");
    assert!(server.end_time_unix_nano >= decode.end_time_unix_nano);
    pd.stop().await;

    // The decode engine stalls until the client is gone.
    let forever = FaultConfig {
        stall_after_headers: Some(Duration::MAX),
        ..FaultConfig::default()
    };
    let pd = PdRouter::start_with(traced_config(), forever).await;
    let trace_id = "c8be7c827a314442c8be7c827a314442";
    let traceparent = format!("00-{trace_id}-{PARENT_SPAN}-01");
    disconnect_after_head(pd.addr, &[("traceparent", &traceparent)]).await;
    let spans = spans_of(&unhex(trace_id), 7).await;
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let decode = spans
        .iter()
        .find(|s| s.name == "decode")
        .unwrap_or_else(|| panic!("no decode span in {names:?}"));
    assert_eq!(str_attr(decode, "router.body.end"), "client_disconnected");
    assert!(!is_error(decode));
    let server = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .unwrap_or_else(|| panic!("no server span in {names:?}"));
    assert!(server.end_time_unix_nano >= decode.end_time_unix_nano);
    pd.stop().await;
}
