//! OpenTelemetry traces of the request path (feature `otel`).
//!
//! The router writes its spans as records of its own ([`SpanRecord`]:
//! explicit parents, typed attributes with static keys, each span ended
//! once where its work ends; not through the SDK's tracer, see
//! `spans.rs`, nor as the SDK's `SpanData`, see `record.rs`), and the
//! [`Tracing`] pipeline exports them in batches over OTLP, on
//! HTTP/protobuf or gRPC, cleartext or TLS (see [Transports](#transports)).
//! `tracing` stays the router's logging front end: a host connects a
//! pipeline by adding [`Tracing::layer`] to its subscriber, a layer that
//! takes no log span or event and only carries the pipeline (its span sink) to
//! the router (see [Why not `tracing` spans](#why-not-tracing-spans)).
//! A traced request makes this tree:
//!
//! ```text
//! POST /v1/chat/completions        server span (ends with the response body)
//! ├── admission                    the concurrency queue
//! ├── read body                    the client's body
//! ├── extract                      the body's parse and tokenization
//! ├── route                        the routing decision (one per attempt)
//! ├── POST http://worker           one upstream attempt (client span)
//! ├── route                        after a retryable failure, again...
//! └── POST http://worker           ...with its own traceparent to the worker
//! ```
//!
//! A prefill/decode request has, instead of the attempts, one client span
//! per leg sent to an engine, after its pair decision (each attempt of
//! the whole request adds a decision and its two legs):
//!
//! ```text
//! POST /v1/chat/completions        server span
//! ├── admission, read body, extract
//! ├── route                        the pair decision (both roles' policies)
//! ├── prefill                      the prefill leg (client span)
//! └── decode                       the decode leg (client span)
//! ```
//!
//! A pair decision names each role's policy (`router.pd.prefill.policy`,
//! `router.pd.decode.policy`) and, for each role chosen, its worker,
//! reason, match and candidates (`router.pd.prefill.worker`, `.reason`,
//! `.match_rate`, `.matched`, `.candidates`; the same under
//! `router.pd.decode.`). A decode worker chosen late (NIXL, sequential
//! Mooncake: when the prefill has answered) is marked
//! `router.pd.decode.late`, and its choice is on its decode leg's span.
//!
//! A leg span has `http.request.method`, `url.full`, `server.address`,
//! `server.port`, `http.response.status_code` (or `error.type`), and
//! `router.worker` (the worker's URL), `router.pd.phase` (`prefill` or
//! `decode`), `router.pd.connector` and `router.pd.kv_transfer_params.bytes`
//! (the size of the leg body's `kv_transfer_params`, when it has one).
//!
//! # What each span covers
//!
//! A streamed answer's time is in its body, so the span that carries the
//! body the client reads lasts until that body ends:
//!
//! - the answering attempt (regular path) and the decode leg of the
//!   answering pair (P/D) end with the client's response body: at its last
//!   byte, at an upstream error or timeout mid-stream, or when the client
//!   goes away. `router.body.end` says which (`complete`, `failed`, an
//!   error status too, or `client_disconnected`). They ride on the body
//!   wrapper that already holds the request's load guard and permit
//!   ([`GuardedBody`](crate::body::GuardedBody)): no second wrapper;
//! - an attempt that is retried or fails before an answer, and a decode
//!   leg of an attempt that failed, end when the router gives up on them;
//! - a prefill leg ends at its engine's response head (its short JSON body
//!   is read inside the flow);
//! - the server span ends after the response body, whatever ended it.
//!
//! Attempt and leg spans also carry `router.time_to_first_byte_ms`: from
//! sending the request to the engine's response head (connect included).
//!
//! # Context in and out
//!
//! An incoming W3C `traceparent` (and `tracestate`) becomes the server
//! span's parent; each attempt's request to a worker carries a
//! `traceparent` naming that attempt's span, so an engine that traces
//! (vLLM with `--otlp-traces-endpoint`) joins the same trace. Each leg of
//! a prefill/decode request carries its own leg span's context.
//!
//! # Off means free
//!
//! Spans are built only when [`TraceConfig::enabled`] is set and the path
//! is not excluded: otherwise the request path creates no span and does no
//! work beyond a flag check. A host that enables it without adding a
//! pipeline's layer ([`Tracing::layer`]) to the current subscriber builds
//! no span either (and forwards the client's `traceparent` unchanged, as
//! with tracing off).
//!
//! # Why not `tracing` spans
//!
//! The first version wrote these spans with `tracing` and bridged them to
//! OpenTelemetry (`tracing-opentelemetry`). A sampled request then cost
//! about two thirds more router CPU than an untraced one
//! (docs/benchmarks.md, "Tracing"): each span's data was built field by
//! field through the bridge, its values formatted, the OpenTelemetry
//! context carried into each child, and the server span was entered and
//! left on every poll of the request and every frame of its body. Here a
//! span is one record with typed attributes, filled in place when it
//! ends and handed to the export with its request's other spans; the
//! parent is the server
//! span's context, carried explicitly with the request; nothing happens
//! per poll or per frame. The SDK's own tracer is not used either: it
//! samples, draws ids and wraps each span in a shared object that the
//! router does not need (it samples before building anything and knows
//! every parent); writing the record directly takes a quarter fewer
//! instructions per request (docs/benchmarks.md, "Tracing").
//!
//! # Export never slows a request
//!
//! A request's finished spans wait with its server span and go to the
//! export together when it ends: encoded there, on the request's thread
//! ([`TraceEncoder::encode_spans`]), and sent as one buffer on a bounded
//! queue ([`ExportConfig::max_queue_size`] spans) drained by the
//! pipeline's own thread, which batches and exports them as the SDK's
//! batch processor would (one hand-over per request instead of one per
//! span, whole hand-overs per export: see `queue.rs`). When the queue is
//! full, the request's spans are dropped; a slow or absent collector
//! costs the export thread its timeout ([`ExportConfig::timeout`]), never
//! a request.
//!
//! # Transports
//!
//! [`ExportConfig::protocol`] picks OTLP's transport, both on the
//! router's own hyper client (no tonic, no reqwest), both sending the
//! batch's protobuf `ExportTraceServiceRequest` as [`TraceEncoder`]
//! writes it (straight from the router's span records, with no
//! intermediate messages):
//!
//! - [`Protocol::HttpProtobuf`]: a `POST` of the message to the
//!   endpoint's URL, as configured, over HTTP/1.1 (`content-type:
//!   application/x-protobuf`); any 2xx answer is a successful export,
//!   anything else a failed one (`export_failed` below), not retried;
//! - [`Protocol::Grpc`]: the unary call
//!   `/opentelemetry.proto.collector.trace.v1.TraceService/Export` over
//!   HTTP/2 (prior knowledge in cleartext, ALPN `h2` over TLS), the same
//!   message in one gRPC length-prefixed frame. An export succeeded when
//!   the answer is HTTP 200 with `grpc-status: 0`, in its trailers or in
//!   the headers of a trailers-only answer; any other status is a failed
//!   export (`export_failed` below). The collector's partial-success
//!   details (spans it rejected inside an accepted batch) are not read.
//!
//! An `https://` endpoint is TLS: rustls with ring, verifying the
//! collector against [`ExportConfig::ca_file`] or else the system's roots
//! (`rustls-native-certs`, which honours `SSL_CERT_FILE`). An `http://`
//! endpoint is cleartext and reads no certificate.
//!
//! # Dropped spans are counted
//!
//! Every span the pipeline is given ends in one of these counters, which
//! [`Tracing::metrics_source`] adds to the router's `/metrics`:
//!
//! | Series | Meaning |
//! |---|---|
//! | `router_trace_spans_exported_total` | spans the collector accepted |
//! | `router_trace_spans_dropped_total{reason="queue_full"}` | dropped at once: [`ExportConfig::max_queue_size`] spans were already waiting or being exported |
//! | `router_trace_spans_dropped_total{reason="export_failed"}` | in a batch the collector refused, or did not answer within [`ExportConfig::timeout`] |
//! | `router_trace_spans_dropped_total{reason="shutdown"}` | ended after the pipeline stopped |
//! | `router_trace_spans_queued` | spans waiting for export or in an export under way (gauge) |
//!
//! The queue's bound is a count of spans: admitting or dropping a
//! request's spans is one atomic update, and a span is counted exported or
//! failed when its batch's export ends. A collector that is down shows as
//! `export_failed`; one that hangs, as `export_failed` at each timeout and
//! then `queue_full` while the queue stays full.

use crate::routes::Route;
use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, Limited};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry_http::{HeaderExtractor, HttpError};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

/// The `tracing` target the router's trace spans had when they were
/// `tracing` spans. The router builds none with it now (its spans are the
/// SDK's); a host's log filter that names it (`router_http::otel=off`)
/// still parses and changes nothing.
pub const TARGET: &str = "router_http::otel";

/// Which requests get spans ([`RouterConfig::trace`](crate::RouterConfig::trace)).
#[derive(Debug, Clone)]
pub struct TraceConfig {
    /// Build spans on the request path (default `false`: no span work at
    /// all). Spans reach a collector only through a [`Tracing`] layer.
    pub enabled: bool,
    /// Paths that get no span, matched exactly (e.g. `/health`,
    /// `/metrics`).
    pub excluded_paths: Vec<String>,
    /// The fraction of new traces sampled, `0.0..=1.0` (default 1.0;
    /// vllm-router's `--otel-sampling-ratio`). The router decides before
    /// it builds any span (head sampling, parent-based): a request with a
    /// valid `traceparent` follows its sampled flag, one without is
    /// sampled with this probability. An unsampled request builds no span
    /// and forwards the client's `traceparent` unchanged, so it costs what
    /// a request with tracing off costs.
    pub sampling_ratio: f64,
}

impl Default for TraceConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            excluded_paths: Vec::new(),
            sampling_ratio: 1.0,
        }
    }
}

/// A draw from a per-thread xorshift generator, seeded once per thread
/// from the standard library's random hasher keys: span and trace ids,
/// and the sampling draw. Never 0 (a xorshift state never is).
fn random_u64() -> u64 {
    use std::cell::Cell;
    use std::hash::{BuildHasher, Hasher};
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u64(0x5EED);
            hasher.finish() | 1
        });
    }
    STATE.with(|state| {
        let mut x = state.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        state.set(x);
        x
    })
}

/// A uniform draw in `[0, 1)` (see [`random_u64`]).
fn uniform() -> f64 {
    (random_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// Whether a request with this parent context is sampled: the parent's
/// flag when it has a valid one, else a draw against `ratio`.
fn head_sampled(parent: &opentelemetry::Context, ratio: f64) -> bool {
    use opentelemetry::trace::TraceContextExt as _;
    let span = parent.span();
    let context = span.span_context();
    if context.is_valid() {
        return context.is_sampled();
    }
    ratio >= 1.0 || uniform() < ratio
}

impl TraceConfig {
    /// Whether a request for `path` is traced.
    pub fn traces(&self, path: &str) -> bool {
        self.enabled && !self.excluded_paths.iter().any(|p| p == path)
    }
}

/// The OTLP transport of an export (the OpenTelemetry exporter setting
/// `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, values `http/protobuf` and
/// `grpc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Protocol {
    /// OTLP/HTTP: a `POST` of a protobuf `ExportTraceServiceRequest` to the
    /// endpoint's URL (usually `/v1/traces`, port 4318). The default.
    #[default]
    HttpProtobuf,
    /// OTLP/gRPC: the `TraceService/Export` call over HTTP/2 (usually port
    /// 4317), cleartext (h2c, prior knowledge) or TLS (ALPN `h2`).
    Grpc,
}

impl Protocol {
    /// The protocol's name in the OpenTelemetry exporter settings
    /// (`http/protobuf`, `grpc`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HttpProtobuf => "http/protobuf",
            Self::Grpc => "grpc",
        }
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Protocol {
    type Err = String;

    /// Parses an OpenTelemetry protocol name (`grpc`, `http/protobuf`).
    /// `http/json` is named as unsupported rather than unknown.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "grpc" => Ok(Self::Grpc),
            "http/protobuf" => Ok(Self::HttpProtobuf),
            "http/json" => Err("`http/json` is not supported (use grpc or http/protobuf)".into()),
            other => Err(format!(
                "`{other}` is not an OTLP protocol (expected grpc or http/protobuf)"
            )),
        }
    }
}

/// Where and how spans are exported ([`Tracing::start`]).
#[derive(Debug, Clone)]
pub struct ExportConfig {
    /// The collector. For [`Protocol::HttpProtobuf`], the traces URL, path
    /// included (e.g. `http://collector:4318/v1/traces`); for
    /// [`Protocol::Grpc`], `http://HOST:PORT` or `https://HOST:PORT`
    /// without a path (the call's path is gRPC's). `https://` is TLS
    /// (rustls), verified against [`ca_file`](Self::ca_file) or else the
    /// system's roots.
    pub endpoint: String,
    /// The OTLP transport (default [`Protocol::HttpProtobuf`]).
    pub protocol: Protocol,
    /// PEM certificates to trust for an `https://` endpoint instead of the
    /// system's roots (OpenTelemetry's `OTEL_EXPORTER_OTLP_CERTIFICATE`):
    /// a private CA, or a collector's self-signed certificate. Unset
    /// (default): the system's roots, as `rustls-native-certs` finds them
    /// (which honours `SSL_CERT_FILE` and `SSL_CERT_DIR`). Not read for an
    /// `http://` endpoint.
    pub ca_file: Option<std::path::PathBuf>,
    /// `service.name` of the exported resource (default `affinity-router`).
    pub service_name: String,
    /// Spans waiting for export at most (default 2048); more are dropped
    /// (and counted, see [`Tracing::metrics_source`]).
    pub max_queue_size: usize,
    /// Spans in one export request at most (default 512; at most
    /// [`max_queue_size`](Self::max_queue_size)). A batch is sent as soon as
    /// this many spans wait; it holds whole requests' spans (a request
    /// with more spans than this goes alone, above it).
    pub max_export_batch_size: usize,
    /// How often a batch is sent (default 5 s, or sooner when a full batch
    /// is ready).
    pub scheduled_delay: Duration,
    /// One export request's time limit, connect (and TLS handshake) to
    /// last byte (default 5 s).
    pub timeout: Duration,
}

impl Default for ExportConfig {
    fn default() -> Self {
        Self {
            endpoint: "http://127.0.0.1:4318/v1/traces".into(),
            protocol: Protocol::HttpProtobuf,
            ca_file: None,
            service_name: "affinity-router".into(),
            max_queue_size: 2048,
            max_export_batch_size: 512,
            scheduled_delay: Duration::from_secs(5),
            timeout: Duration::from_secs(5),
        }
    }
}

/// A trace pipeline could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The endpoint is not an `http://` or `https://` URL with a host (and,
    /// for gRPC, without a path).
    #[error("invalid OTLP traces endpoint {endpoint:?}: {reason}")]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The certificates to trust for an `https://` endpoint could not be
    /// loaded: an unreadable or empty [`ExportConfig::ca_file`], or no
    /// usable system root.
    #[error("cannot set up TLS for the OTLP export: {0}")]
    Tls(String),
}

/// The export pipeline: a bounded, counting queue and the thread that
/// batches its spans for an OTLP exporter (HTTP/protobuf or gRPC, see
/// [Transports](self#transports)). Dropping it flushes and shuts the
/// export down (waiting at most [`ExportConfig::timeout`] and a second).
#[derive(Debug)]
pub struct Tracing {
    sink: Arc<SpanSink>,
    counts: Arc<SpanCounts>,
}

impl Tracing {
    /// Builds the pipeline. Export requests run on `runtime` (the router's
    /// tokio runtime); the pipeline's export thread only waits for them.
    /// Fails on an endpoint that is not an `http://` or `https://` URL
    /// with a host (or, for gRPC, has a path), and for an `https://` one
    /// when no certificate to trust can be loaded; nothing is started then.
    pub fn start(
        config: &ExportConfig,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self, TraceError> {
        let bad = |reason: String| TraceError::Endpoint {
            endpoint: config.endpoint.clone(),
            reason,
        };
        let uri: http::Uri = config
            .endpoint
            .parse()
            .map_err(|err: http::uri::InvalidUri| bad(err.to_string()))?;
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => {
                return Err(bad(format!(
                    "expected an http:// or https:// URL for OTLP over {}",
                    config.protocol
                )));
            }
        };
        let Some(authority) = uri.authority().filter(|_| uri.host().is_some()) else {
            return Err(bad("the URL has no host".into()));
        };
        let tls = if tls {
            Some(tls_config(config.ca_file.as_deref())?)
        } else {
            None
        };
        let client = ExportClient::new(runtime, config.timeout, config.protocol, tls)?;
        let counts = Arc::new(SpanCounts::default());
        let sink = match config.protocol {
            Protocol::HttpProtobuf => {
                // The URL as configured, path included (a host's default
                // of `/v1/traces` is applied before it gets here).
                let exporter = HttpExporter {
                    client,
                    uri,
                    encoder: pipeline_encoder(config),
                };
                span_sink(config, exporter, &counts)
            }
            Protocol::Grpc => {
                if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
                    return Err(bad(
                        "an OTLP/gRPC endpoint is http(s)://HOST:PORT, without a path \
                         (a path such as /v1/traces is OTLP over HTTP/protobuf)"
                            .into(),
                    ));
                }
                let scheme = uri.scheme().cloned().unwrap_or(http::uri::Scheme::HTTP);
                let export_uri = http::Uri::builder()
                    .scheme(scheme)
                    .authority(authority.clone())
                    .path_and_query(GRPC_EXPORT_PATH)
                    .build()
                    .map_err(|err| bad(err.to_string()))?;
                let exporter = GrpcExporter {
                    client,
                    uri: export_uri,
                    encoder: pipeline_encoder(config),
                };
                span_sink(config, exporter, &counts)
            }
        };
        Ok(Self {
            sink: Arc::new(sink),
            counts,
        })
    }

    /// The pipeline's span counters as `/metrics` series (see the module
    /// docs): add it to
    /// [`RouterConfig::metrics_sources`](crate::RouterConfig::metrics_sources).
    /// Rendered at scrape time from the counters the pipeline keeps.
    pub fn metrics_source(&self) -> Arc<dyn crate::metrics::MetricsSource> {
        let counts = Arc::clone(&self.counts);
        Arc::new(move |exposition: &mut crate::metrics::Exposition<'_>| {
            counts.render(exposition);
        })
    }

    /// The `tracing` layer that connects the router to this pipeline: a
    /// router whose requests run under a subscriber with this layer
    /// (global, or the thread's default) exports its spans here. The
    /// layer takes no `tracing` span or event of the host (its logs are
    /// what they are without it); it only carries the pipeline's span sink,
    /// which the router looks up when a traced request starts.
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S> + Send + Sync + 'static
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a> + Send + Sync,
    {
        use tracing_subscriber::Layer as _;
        TraceLayer {
            sink: Arc::clone(&self.sink),
        }
        .with_filter(tracing_subscriber::filter::LevelFilter::OFF)
    }

    /// Exports every finished span now, waiting for the export (a test, or
    /// before a planned stop). Errors are the exporter's, as text.
    pub fn force_flush(&self) -> Result<(), String> {
        self.sink.queue.force_flush().map_err(|err| err.to_string())
    }

    /// Flushes and stops the export; later spans are dropped.
    pub fn shutdown(&self) -> Result<(), String> {
        self.sink.queue.shutdown().map_err(|err| err.to_string())
    }
}

impl Drop for Tracing {
    fn drop(&mut self) {
        let _ = self.sink.queue.shutdown();
    }
}

/// The sink of a pipeline: the router's bounded, counting queue and its
/// export thread ([`SpanQueue`]) in front of `exporter`.
fn span_sink<E: Export>(config: &ExportConfig, exporter: E, counts: &Arc<SpanCounts>) -> SpanSink {
    let exporter = CountingExporter {
        inner: exporter,
        counts: Arc::clone(counts),
    };
    SpanSink {
        queue: SpanQueue::start(config, exporter, counts),
    }
}

/// The instrumentation scope of the router's spans.
pub const SCOPE_NAME: &str = "router-http";

/// An exporter's encoder: the pipeline's resource (its service name) and
/// the router's scope ([`SCOPE_NAME`]).
fn pipeline_encoder(config: &ExportConfig) -> parking_lot::Mutex<TraceEncoder> {
    let mut encoder = TraceEncoder::new();
    encoder.set_resource(
        &opentelemetry_sdk::Resource::builder_empty()
            .with_service_name(config.service_name.clone())
            .build(),
    );
    encoder.set_scope(&opentelemetry::InstrumentationScope::builder(SCOPE_NAME).build());
    parking_lot::Mutex::new(encoder)
}

mod counts;
mod encode;
mod export;
mod queue;
mod record;
mod spans;

pub use encode::{EncodedSpans, TraceEncoder};
pub use record::{Attribute, AttributeValue, SpanRecord};

use counts::{CountingExporter, SpanCounts};
use export::{ExportClient, GRPC_EXPORT_PATH, GrpcExporter, HttpExporter, tls_config};
use queue::{Export, SpanQueue};
#[doc(hidden)]
pub use spans::trace_one_request_for_bench;
pub(crate) use spans::*;

#[cfg(test)]
mod tests {
    use super::Protocol;
    use super::export::grpc_outcome;
    use http::{HeaderMap, HeaderValue, StatusCode};

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn a_grpc_export_succeeds_only_with_status_zero() {
        let head = headers(&[("content-type", "application/grpc")]);
        let ok = headers(&[("grpc-status", "0")]);
        assert_eq!(grpc_outcome(StatusCode::OK, &head, Some(&ok)), Ok(()));
        // Trailers-only: the status in the headers.
        let only = headers(&[("grpc-status", "0")]);
        assert_eq!(grpc_outcome(StatusCode::OK, &only, None), Ok(()));
        let refused = headers(&[("grpc-status", "14"), ("grpc-message", "overloaded")]);
        assert_eq!(
            grpc_outcome(StatusCode::OK, &refused, None),
            Err("grpc-status 14: overloaded".into())
        );
        let in_trailers = headers(&[("grpc-status", "8")]);
        assert_eq!(
            grpc_outcome(StatusCode::OK, &head, Some(&in_trailers)),
            Err("grpc-status 8".into())
        );
        // No status at all, or not a gRPC answer.
        assert!(grpc_outcome(StatusCode::OK, &head, Some(&HeaderMap::new())).is_err());
        assert!(grpc_outcome(StatusCode::NOT_FOUND, &only, None).is_err());
    }

    #[test]
    fn protocols_are_named_as_opentelemetry_names_them() {
        for protocol in [Protocol::Grpc, Protocol::HttpProtobuf] {
            assert_eq!(protocol.as_str().parse::<Protocol>(), Ok(protocol));
        }
        assert!(
            "http/json"
                .parse::<Protocol>()
                .unwrap_err()
                .contains("not supported")
        );
        assert!("GRPC".parse::<Protocol>().is_err());
    }
}
