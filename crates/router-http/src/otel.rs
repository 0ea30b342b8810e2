//! OpenTelemetry traces of the request path (feature `otel`).
//!
//! The router writes its spans with `tracing`, as it writes its logs; the
//! [`Tracing`] pipeline turns them into OpenTelemetry spans
//! (`tracing-opentelemetry`) and exports them in batches over OTLP, on
//! HTTP/protobuf or gRPC, cleartext or TLS (see [Transports](#transports)).
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
//! A prefill/decode request has, instead of the decisions and attempts,
//! one client span per leg sent to an engine (each attempt of the whole
//! request adds its pair):
//!
//! ```text
//! POST /v1/chat/completions        server span
//! ├── admission, read body, extract
//! ├── prefill                      the prefill leg (client span)
//! └── decode                       the decode leg (client span)
//! ```
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
//! work beyond a flag check. A host that enables it without installing a
//! layer ([`Tracing::layer`]) gets `tracing` spans that go nowhere (and
//! forwards the client's `traceparent` unchanged, as with tracing off).
//!
//! # Export never slows a request
//!
//! Finished spans go into the SDK's batch processor: a bounded queue
//! ([`ExportConfig::max_queue_size`]) drained by its own thread. When the
//! queue is full, spans are dropped; a slow or absent collector costs the
//! export thread its timeout ([`ExportConfig::timeout`]), never a request.
//!
//! # Transports
//!
//! [`ExportConfig::protocol`] picks OTLP's transport, both on the
//! router's own hyper client (no tonic, no reqwest):
//!
//! - [`Protocol::HttpProtobuf`]: a `POST` of the protobuf
//!   `ExportTraceServiceRequest` to the endpoint's URL over HTTP/1.1,
//!   through opentelemetry-otlp's HTTP exporter;
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
//! The queue's bound is the router's own (a counter in front of the SDK's
//! batch processor, whose queue is never fuller than it): admitting or
//! dropping a span is one atomic update, and a span is counted exported or
//! failed when its batch's export ends. A collector that is down shows as
//! `export_failed`; one that hangs, as `export_failed` at each timeout and
//! then `queue_full` while the queue stays full.

use crate::routes::Route;
use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, Limited};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{HeaderExtractor, HeaderInjector, HttpClient, HttpError};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, SpanData, SpanExporter,
    SpanProcessor,
};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The `tracing` target of every span the router builds for traces. A host
/// filters its other layers on it (e.g. `router_http::otel=off` in a log
/// filter, so that logs look as they do with tracing off).
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

/// Marks a request the router traces (set with its server span): the
/// request path builds its phase, decision and attempt spans only then.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Traced;

/// A uniform draw in `[0, 1)` from a per-thread xorshift generator,
/// seeded once per thread from the standard library's random hasher keys.
fn uniform() -> f64 {
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
        (x >> 11) as f64 / (1u64 << 53) as f64
    })
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
    /// How often a batch is sent (default 5 s, or sooner when a batch of
    /// 512 is ready).
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
    /// The OTLP exporter refused its configuration.
    #[error("cannot build the OTLP exporter: {0}")]
    Exporter(String),
}

/// The export pipeline: a tracer provider with a batch processor feeding
/// an OTLP exporter (HTTP/protobuf or gRPC, see [Transports](self#transports)). Dropping it flushes and shuts the export down
/// (bounded by [`ExportConfig::timeout`]).
#[derive(Debug)]
pub struct Tracing {
    provider: SdkTracerProvider,
    counts: Arc<SpanCounts>,
}

impl Tracing {
    /// Builds the pipeline. Export requests run on `runtime` (the router's
    /// tokio runtime); the batch processor's own thread only waits for them.
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
        let provider = match config.protocol {
            Protocol::HttpProtobuf => {
                let exporter = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_endpoint(config.endpoint.clone())
                    .with_timeout(config.timeout)
                    .with_http_client(client)
                    .build()
                    .map_err(|err| TraceError::Exporter(err.to_string()))?;
                provider(config, exporter, &counts)
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
                    resource: Default::default(),
                };
                provider(config, exporter, &counts)
            }
        };
        Ok(Self { provider, counts })
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

    /// The `tracing` layer that turns the router's spans into OpenTelemetry
    /// spans of this pipeline. Filtered to [`TARGET`], so that other
    /// `tracing` spans of the host (and their log levels) do not matter.
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S> + Send + Sync + 'static
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a> + Send + Sync,
    {
        use tracing_subscriber::Layer as _;
        let tracer = self.provider.tracer("router-http");
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_threads(false)
            .with_level(false)
            .with_target(false)
            .with_filter(
                tracing_subscriber::filter::Targets::new()
                    .with_target(TARGET, tracing::Level::INFO),
            )
    }

    /// Exports every finished span now, waiting for the export (a test, or
    /// before a planned stop). Errors are the exporter's, as text.
    pub fn force_flush(&self) -> Result<(), String> {
        self.provider.force_flush().map_err(|err| err.to_string())
    }

    /// Flushes and stops the export; later spans are dropped.
    pub fn shutdown(&self) -> Result<(), String> {
        self.provider.shutdown().map_err(|err| err.to_string())
    }
}

impl Drop for Tracing {
    fn drop(&mut self) {
        let _ = self.provider.shutdown();
    }
}

/// A tracer provider whose spans go through the router's bounded,
/// counting queue ([`CountingProcessor`]) into the SDK's batch processor
/// and `exporter`.
fn provider<E: SpanExporter + 'static>(
    config: &ExportConfig,
    exporter: E,
    counts: &Arc<SpanCounts>,
) -> SdkTracerProvider {
    let capacity = config.max_queue_size.max(1);
    let exporter = CountingExporter {
        inner: exporter,
        counts: Arc::clone(counts),
    };
    let batch = BatchConfigBuilder::default()
        .with_max_queue_size(capacity)
        .with_max_export_batch_size(512.min(capacity))
        .with_scheduled_delay(config.scheduled_delay)
        .build();
    let processor = CountingProcessor {
        inner: BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch)
            .build(),
        counts: Arc::clone(counts),
        capacity,
        stopped: AtomicBool::new(false),
    };
    // The router samples before it builds a span
    // (`TraceConfig::sampling_ratio`): every span that reaches the
    // pipeline is one to keep.
    let sampler = Sampler::ParentBased(Box::new(Sampler::AlwaysOn));
    let resource = opentelemetry_sdk::Resource::builder_empty()
        .with_service_name(config.service_name.clone())
        .build();
    SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(sampler)
        .with_resource(resource)
        .build()
}

/// The TLS client configuration of an `https://` export: rustls with
/// ring, trusting the PEM certificates of `ca_file`, or else the system's
/// roots.
fn tls_config(ca_file: Option<&std::path::Path>) -> Result<rustls::ClientConfig, TraceError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|err| TraceError::Tls(format!("{}: {err}", path.display())))?;
            if certs.is_empty() {
                return Err(TraceError::Tls(format!(
                    "{}: no PEM certificate in the file",
                    path.display()
                )));
            }
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|err| TraceError::Tls(format!("{}: {err}", path.display())))?;
            }
        }
        None => {
            // Certificates the system store holds but rustls cannot parse
            // are skipped (as browsers do); none usable at all is an error.
            let found = rustls_native_certs::load_native_certs();
            let (added, _ignored) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .first()
                    .map(|err| format!(": {err}"))
                    .unwrap_or_default();
                return Err(TraceError::Tls(format!(
                    "no system root certificate{why} (give the collector's CA file)"
                )));
            }
        }
    }
    client_tls(roots)
}

/// rustls with ring (never the process's default provider), TLS 1.2 and
/// 1.3, trusting `roots`.
fn client_tls(roots: rustls::RootCertStore) -> Result<rustls::ClientConfig, TraceError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| TraceError::Tls(err.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// The path of the OTLP/gRPC trace export call.
const GRPC_EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// The OTLP/gRPC span exporter: each batch is one unary
/// `TraceService/Export` call over HTTP/2 on the router's hyper client
/// ([`ExportClient`], which runs it on the router's runtime within the
/// export timeout). The request body is the SDK's own conversion of the
/// spans (`opentelemetry-proto`) in one gRPC message frame; the call
/// succeeded when the response is HTTP 200 with `grpc-status: 0`, in its
/// trailers or, for an answer without a body, its headers.
#[derive(Debug)]
struct GrpcExporter {
    client: ExportClient,
    /// `http(s)://HOST:PORT` with the call's path.
    uri: http::Uri,
    resource: opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema,
}

impl GrpcExporter {
    /// The export call of `batch`: a gRPC length-prefixed message, not
    /// compressed.
    fn request(&self, batch: Vec<SpanData>) -> Result<http::Request<Bytes>, String> {
        use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
        use prost::Message as _;
        let message = ExportTraceServiceRequest {
            resource_spans:
                opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope(
                    batch,
                    &self.resource,
                ),
        };
        let message = message.encode_to_vec();
        // A gRPC frame's length is 32 bits; a batch (at most 512 spans)
        // is far below it, and one that is not fails as a whole.
        let length = u32::try_from(message.len())
            .map_err(|_| format!("a batch of {} bytes exceeds a gRPC frame", message.len()))?;
        let mut body = Vec::with_capacity(5 + message.len());
        body.push(0); // not compressed
        body.extend_from_slice(&length.to_be_bytes());
        body.extend_from_slice(&message);
        let mut request = http::Request::new(Bytes::from(body));
        *request.method_mut() = http::Method::POST;
        *request.uri_mut() = self.uri.clone();
        let headers = request.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        headers.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
        // The collector gives up when the router would (gRPC's timeout
        // unit `m` is milliseconds; at most 8 digits).
        let millis = self.client.timeout.as_millis().min(99_999_999);
        if let Ok(value) = http::HeaderValue::from_str(&format!("{millis}m")) {
            headers.insert("grpc-timeout", value);
        }
        Ok(request)
    }
}

/// Whether a gRPC answer says the call succeeded: HTTP 200 and
/// `grpc-status` 0 (from the trailers, or the headers of a trailers-only
/// answer). An error names the status and the server's message.
fn grpc_outcome(
    status: http::StatusCode,
    headers: &HeaderMap,
    trailers: Option<&HeaderMap>,
) -> Result<(), String> {
    if status != http::StatusCode::OK {
        return Err(format!(
            "the collector answered HTTP {status}, not a gRPC answer"
        ));
    }
    let source = trailers
        .filter(|trailers| trailers.contains_key("grpc-status"))
        .unwrap_or(headers);
    let Some(code) = source.get("grpc-status") else {
        return Err("the collector's answer has no grpc-status".into());
    };
    if code.as_bytes() == b"0" {
        return Ok(());
    }
    let message = source
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .unwrap_or("");
    Err(format!(
        "grpc-status {}{}{message}",
        String::from_utf8_lossy(code.as_bytes()),
        if message.is_empty() { "" } else { ": " }
    ))
}

impl SpanExporter for GrpcExporter {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let request = self.request(batch);
        let client = self.client.clone();
        async move {
            let request = request.map_err(OTelSdkError::InternalFailure)?;
            let (parts, _body, trailers) = client
                .exchange(request)
                .await
                .map_err(|err| OTelSdkError::InternalFailure(err.to_string()))?;
            grpc_outcome(parts.status, &parts.headers, trailers.as_ref())
                .map_err(OTelSdkError::InternalFailure)
        }
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.resource = resource.into();
    }
}

/// What became of the spans given to a pipeline: shared by its
/// [`CountingProcessor`] (admitted or dropped at once) and its
/// [`CountingExporter`] (exported or failed).
#[derive(Debug, Default)]
struct SpanCounts {
    /// Spans admitted and not yet through an export.
    queued: AtomicUsize,
    exported: crate::metrics::Counter,
    queue_full: crate::metrics::Counter,
    export_failed: crate::metrics::Counter,
    shutdown: crate::metrics::Counter,
}

impl SpanCounts {
    /// Takes one place in the queue, or none when `capacity` are taken.
    fn admit(&self, capacity: usize) -> bool {
        self.queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < capacity).then_some(n + 1)
            })
            .is_ok()
    }

    /// `spans` admitted spans went through an export, accepted or not.
    fn settle(&self, spans: usize, exported: bool) {
        let _ = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(spans))
            });
        let spans = u64::try_from(spans).unwrap_or(u64::MAX);
        if exported {
            self.exported.add(spans);
        } else {
            self.export_failed.add(spans);
        }
    }

    fn render(&self, exposition: &mut crate::metrics::Exposition<'_>) {
        use crate::metrics::MetricType;
        exposition
            .family(
                "router_trace_spans_exported_total",
                MetricType::Counter,
                "Trace spans the OTLP collector accepted.",
            )
            .sample(&[], self.exported.get());
        let mut dropped = exposition.family(
            "router_trace_spans_dropped_total",
            MetricType::Counter,
            "Trace spans that never reached the collector, by reason (queue_full: the export queue was full; export_failed: the collector refused the batch or did not answer in time; shutdown: ended after the export stopped).",
        );
        dropped.sample(&[("reason", &"queue_full")], self.queue_full.get());
        dropped.sample(&[("reason", &"export_failed")], self.export_failed.get());
        dropped.sample(&[("reason", &"shutdown")], self.shutdown.get());
        let queued = u64::try_from(self.queued.load(Ordering::Relaxed)).unwrap_or(u64::MAX);
        exposition
            .family(
                "router_trace_spans_queued",
                MetricType::Gauge,
                "Trace spans waiting for export or in an export under way.",
            )
            .sample(&[], queued);
    }
}

/// The SDK's batch processor behind a bound of its own: a span finding
/// `capacity` spans queued is dropped and counted, so the SDK's queue
/// (as large) never fills and never drops a span uncounted. `on_end` is
/// one atomic update before the SDK's non-blocking send.
#[derive(Debug)]
struct CountingProcessor {
    inner: BatchSpanProcessor,
    counts: Arc<SpanCounts>,
    capacity: usize,
    stopped: AtomicBool,
}

impl SpanProcessor for CountingProcessor {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.stopped.load(Ordering::Relaxed) {
            self.counts.shutdown.inc();
        } else if self.counts.admit(self.capacity) {
            self.inner.on_end(span);
        } else {
            self.counts.queue_full.inc();
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.stopped.store(true, Ordering::Relaxed);
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, counting each batch's spans as exported or failed
/// when its export ends (or is abandoned).
#[derive(Debug)]
struct CountingExporter<E> {
    inner: E,
    counts: Arc<SpanCounts>,
}

/// Settles a batch once: as its export's result, or as failed if the
/// export future is dropped before its end.
struct Settle {
    counts: Arc<SpanCounts>,
    spans: usize,
    exported: bool,
}

impl Drop for Settle {
    fn drop(&mut self) {
        self.counts.settle(self.spans, self.exported);
    }
}

impl<E: SpanExporter> SpanExporter for CountingExporter<E> {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let settle = Settle {
            counts: Arc::clone(&self.counts),
            spans: batch.len(),
            exported: false,
        };
        let export = self.inner.export(batch);
        async move {
            // The whole guard moves in (not only the field written below).
            let mut settle = settle;
            let result = export.await;
            settle.exported = result.is_ok();
            result
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporters' HTTP client: the request runs as a task on the
/// router's runtime (the batch processor's thread has no runtime of its
/// own), bounded by the export timeout, its response body by 4 MiB.
/// HTTP/1.1 for OTLP/HTTP, HTTP/2 only for gRPC (prior knowledge over
/// cleartext, ALPN `h2` over TLS); TLS when the endpoint is `https://`.
#[derive(Debug, Clone)]
struct ExportClient {
    runtime: tokio::runtime::Handle,
    client: hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        Full<Bytes>,
    >,
    timeout: Duration,
}

/// A collector's answer larger than this is an error (its body is a small
/// protobuf message).
const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;

/// A collector's answer: its head, body and trailers (gRPC's status).
type Exchange = (http::response::Parts, Bytes, Option<HeaderMap>);

impl ExportClient {
    /// A client for `protocol`; `tls` for an `https://` endpoint (`None`:
    /// cleartext only).
    fn new(
        runtime: tokio::runtime::Handle,
        timeout: Duration,
        protocol: Protocol,
        tls: Option<rustls::ClientConfig>,
    ) -> Result<Self, TraceError> {
        let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        // https:// URLs pass through to the TLS layer.
        connector.enforce_http(false);
        // A cleartext endpoint never reads a certificate: its connector's
        // TLS configuration (no roots) is never used.
        let https_or_http = tls.is_none();
        let tls = match tls {
            Some(tls) => tls,
            None => client_tls(rustls::RootCertStore::empty())?,
        };
        let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls);
        let builder = if https_or_http {
            builder.https_or_http()
        } else {
            // An https:// endpoint is never sent in cleartext.
            builder.https_only()
        };
        let mut client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new());
        client
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(1);
        let connector = match protocol {
            Protocol::HttpProtobuf => builder.enable_http1().wrap_connector(connector),
            Protocol::Grpc => {
                client.http2_only(true);
                builder.enable_http2().wrap_connector(connector)
            }
        };
        Ok(Self {
            runtime,
            client: client.build(connector),
            timeout,
        })
    }

    /// Sends `request` and reads the whole answer, on the router's
    /// runtime, within the export timeout.
    async fn exchange(&self, request: http::Request<Bytes>) -> Result<Exchange, HttpError> {
        let client = self.client.clone();
        let timeout = self.timeout;
        let task = self.runtime.spawn(async move {
            let exchange = async {
                let response = client.request(request.map(Full::new)).await?;
                let (parts, body) = response.into_parts();
                let collected = Limited::new(body, MAX_RESPONSE_BYTES).collect().await?;
                let trailers = collected.trailers().cloned();
                Ok::<_, HttpError>((parts, collected.to_bytes(), trailers))
            };
            match tokio::time::timeout(timeout, exchange).await {
                Ok(result) => result,
                Err(_elapsed) => {
                    Err(format!("no answer from the collector within {timeout:?}").into())
                }
            }
        });
        task.await?
    }
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, HttpError> {
        let (parts, body, _trailers) = self.exchange(request).await?;
        Ok(http::Response::from_parts(parts, body))
    }
}

/// The server span of a request, or `None` when it is not traced (tracing
/// off, or an excluded path). Continues the request's `traceparent`.
pub(crate) fn server_span<B>(trace: &TraceConfig, request: &http::Request<B>) -> Option<Span> {
    let path = request.uri().path();
    if !trace.traces(path) {
        return None;
    }
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(request.headers()));
    if !head_sampled(&parent, trace.sampling_ratio) {
        return None;
    }
    let method = request.method().as_str();
    // Only paths the router knows name a route: an unknown path is not a
    // low-cardinality span name.
    let route = match Route::of(request.method(), path) {
        Route::NotFound | Route::InvalidTarget | Route::WrongMethod { .. } => None,
        _ => Some(path),
    };
    let name = match route {
        Some(route) => format!("{method} {route}"),
        None => method.to_owned(),
    };
    let span = tracing::info_span!(
        target: TARGET,
        "request",
        otel.name = name.as_str(),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = method,
        http.route = route,
        url.path = path,
        http.response.status_code = tracing::field::Empty,
        gen_ai.request.model = tracing::field::Empty,
        request.id = tracing::field::Empty,
    );
    // A request without (valid) trace context starts a new trace.
    let _ = span.set_parent(parent);
    Some(span)
}

/// Records the response status on the server span (5xx is an error).
pub(crate) fn record_response(span: &Span, status: http::StatusCode) {
    span.record("http.response.status_code", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
}

/// Runs `future` inside an internal span named `name` (a phase of the
/// request before routing: `admission`, `read body`) when `traced`.
pub(crate) async fn phase<F: std::future::Future>(
    traced: bool,
    name: &'static str,
    future: F,
) -> F::Output {
    if traced {
        let span = tracing::info_span!(target: TARGET, "phase", otel.name = name);
        tracing::Instrument::instrument(future, span).await
    } else {
        future.await
    }
}

/// The span of the body's extraction: one parse of the JSON, and for a
/// model with a tokenizer its chat template and tokenization.
pub(crate) fn extract_span() -> Span {
    tracing::info_span!(
        target: TARGET,
        "extract",
        router.routing_input = tracing::field::Empty,
        router.routing_tokens = tracing::field::Empty,
        router.routing_chars = tracing::field::Empty,
    )
}

/// Records what the extraction gave the policies: token ids (how many),
/// text (how long) or nothing.
pub(crate) fn record_routing_input(span: &Span, input: &lb_policies::RoutingInputBuf) {
    use lb_policies::RoutingInputBuf;
    match input {
        RoutingInputBuf::Tokens(ids) => {
            span.record("router.routing_input", "tokens");
            span.record(
                "router.routing_tokens",
                i64::try_from(ids.len()).unwrap_or(i64::MAX),
            );
        }
        RoutingInputBuf::Text(text) => {
            span.record("router.routing_input", "text");
            span.record(
                "router.routing_chars",
                i64::try_from(text.chars().count()).unwrap_or(i64::MAX),
            );
        }
        RoutingInputBuf::None => {
            span.record("router.routing_input", "none");
        }
    }
}

/// Records the request's model and id on the current (server) span.
pub(crate) fn record_request(model: &str, request_id: &http::HeaderValue) {
    let span = Span::current();
    if !model.is_empty() {
        span.record("gen_ai.request.model", model);
    }
    if let Ok(id) = request_id.to_str() {
        span.record("request.id", id);
    }
}

/// The span of one routing decision among `candidates` workers.
pub(crate) fn decision_span(policy: &str, candidates: usize) -> Span {
    tracing::info_span!(
        target: TARGET,
        "route",
        otel.status_code = tracing::field::Empty,
        router.policy = policy,
        router.candidates = i64::try_from(candidates).unwrap_or(i64::MAX),
        router.decision.reason = tracing::field::Empty,
        router.decision.match_rate = tracing::field::Empty,
        router.worker = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
}

/// Records a decision's outcome on its span.
pub(crate) fn record_decision(
    span: &Span,
    reason: &str,
    match_permille: Option<u16>,
    worker: &str,
) {
    span.record("router.decision.reason", reason);
    if let Some(permille) = match_permille {
        span.record("router.decision.match_rate", f64::from(permille) / 1000.0);
    }
    span.record("router.worker", worker);
}

/// Records that no worker could be chosen.
pub(crate) fn record_no_decision(span: &Span, error: &dyn std::fmt::Display) {
    span.record("otel.status_code", "ERROR");
    span.record("error.type", tracing::field::display(error));
}

/// The client span of one upstream attempt (`resend` is 0 for the first,
/// then the retry's number) to `worker`. The answering attempt's span ends
/// with the response body (see [`record_body_end`]).
pub(crate) fn attempt_span(method: &http::Method, worker: &str, resend: u32) -> Span {
    tracing::info_span!(
        target: TARGET,
        "attempt",
        otel.name = %format_args!("{} {}", method.as_str(), worker),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        http.request.method = method.as_str(),
        url.full = worker,
        http.request.resend_count = i64::from(resend),
        http.response.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
        router.retry.cause = tracing::field::Empty,
        router.time_to_first_byte_ms = tracing::field::Empty,
        router.body.end = tracing::field::Empty,
    )
}

/// Records on an attempt or leg span the time from `sent` (just before the
/// request went out) to its response head.
pub(crate) fn record_first_byte(span: &Span, sent: tokio::time::Instant) {
    span.record(
        "router.time_to_first_byte_ms",
        sent.elapsed().as_secs_f64() * 1000.0,
    );
}

/// Records how the response body an attempt or decode leg span carries
/// ended, and makes now the span's end (see [`stamp_end`]). A body that
/// failed (upstream reset, idle or request timeout) makes the span an
/// error; a client that went away does not (the worker did nothing wrong),
/// it is only marked.
pub(crate) fn record_body_end(span: &Span, end: crate::body::BodyEnd) {
    use crate::body::BodyEnd;
    let end = match end {
        BodyEnd::Complete => "complete",
        BodyEnd::Failed => {
            span.record("otel.status_code", "ERROR");
            "failed"
        }
        BodyEnd::Dropped => "client_disconnected",
    };
    span.record("router.body.end", end);
    stamp_end(span);
}

/// Makes now the end of `span` as exported. `tracing-opentelemetry` ends
/// a span at its last exit, not when its last handle drops: a span that
/// outlives its last entry (an attempt's, held by the response body) is
/// entered and left once more where it really ends.
pub(crate) fn stamp_end(span: &Span) {
    span.in_scope(|| {});
}

/// What the leg spans of a traced prefill/decode request name besides
/// the leg itself: set around the request's run (`pd::proxy`), read when
/// the transport sends a leg.
#[derive(Debug)]
pub(crate) struct PdLegs {
    /// The connector's name (`nixl`, `mooncake`, ...).
    pub(crate) connector: &'static str,
    /// The client's path, the tail of every leg's URL after the worker's.
    pub(crate) path: String,
    /// The span of the latest decode leg that got a response head. The
    /// transport parks it here because the decode body outlives the leg's
    /// send: `pd::proxy` hands it to the client's response body, or ends
    /// it when the attempt fails.
    decode: parking_lot::Mutex<Option<Span>>,
}

impl PdLegs {
    /// The legs of a request for `path` through `connector`.
    pub(crate) fn new(connector: &'static str, path: String) -> Self {
        Self {
            connector,
            path,
            decode: parking_lot::Mutex::new(None),
        }
    }

    /// Keeps a decode leg's span alive past its response head. A failed
    /// attempt's was taken when it failed, so nothing is replaced here.
    pub(crate) fn park_decode(&self, span: Span) {
        // Dropped outside the lock: closing a span exports it.
        let previous = self.decode.lock().replace(span);
        drop(previous);
    }

    /// The parked decode leg's span, if any.
    pub(crate) fn take_decode(&self) -> Option<Span> {
        self.decode.lock().take()
    }
}

/// The client span of one prefill/decode leg: `phase` (`prefill` or
/// `decode`) sent to `url` with `body`. Names the worker (the URL without
/// the client's path), the connector and the size of the body's
/// `kv_transfer_params` (compact JSON, as sent; absent when the body has
/// none). Traced requests only: the body is parsed once more here.
pub(crate) fn leg_span(legs: &PdLegs, phase: &'static str, url: &str, body: &[u8]) -> Span {
    #[derive(serde::Deserialize)]
    struct KvParams {
        kv_transfer_params: Option<serde_json::Value>,
    }
    let worker = url.strip_suffix(legs.path.as_str()).unwrap_or(url);
    let uri = url.parse::<http::Uri>().ok();
    let host = uri.as_ref().and_then(|uri| uri.host());
    let port = uri.as_ref().and_then(|uri| uri.port_u16()).map(i64::from);
    let kv_bytes = serde_json::from_slice::<KvParams>(body)
        .ok()
        .and_then(|params| params.kv_transfer_params)
        .and_then(|params| serde_json::to_vec(&params).ok())
        .map(|bytes| i64::try_from(bytes.len()).unwrap_or(i64::MAX));
    tracing::info_span!(
        target: TARGET,
        "leg",
        otel.name = phase,
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        http.request.method = "POST",
        url.full = url,
        server.address = host,
        server.port = port,
        router.worker = worker,
        router.pd.phase = phase,
        router.pd.connector = legs.connector,
        router.pd.kv_transfer_params.bytes = kv_bytes,
        http.response.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
        router.time_to_first_byte_ms = tracing::field::Empty,
        router.body.end = tracing::field::Empty,
    )
}

/// Writes `span`'s context into `headers` as `traceparent` (and
/// `tracestate`), replacing what the client sent. Nothing when the span
/// has no OpenTelemetry context (no layer installed).
pub(crate) fn inject(span: &Span, headers: &mut HeaderMap) {
    let context = span.context();
    use opentelemetry::trace::TraceContextExt as _;
    if context.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&context, &mut HeaderInjector(headers));
    }
}

/// `request` with `span`'s context in its headers (see [`inject`]), when
/// there is a span.
pub(crate) fn with_context<B>(
    span: Option<&Span>,
    mut request: http::Request<B>,
) -> http::Request<B> {
    if let Some(span) = span {
        inject(span, request.headers_mut());
    }
    request
}

/// Records the worker's status on an attempt span (5xx is an error).
/// Integers are recorded as `i64`: `tracing-opentelemetry` exports
/// unsigned ones as strings.
pub(crate) fn record_attempt_status(span: &Span, status: u16) {
    span.record("http.response.status_code", i64::from(status));
    if status >= 500 {
        span.record("otel.status_code", "ERROR");
        span.record("error.type", tracing::field::display(status));
    }
}

/// Records why an attempt failed before a response.
pub(crate) fn record_attempt_error(span: &Span, error: &dyn std::fmt::Display) {
    span.record("otel.status_code", "ERROR");
    span.record("error.type", tracing::field::display(error));
}

/// Records that the request is retried after this attempt, and why.
pub(crate) fn record_retry(span: &Span, cause: &dyn std::fmt::Display) {
    span.record("router.retry.cause", tracing::field::display(cause));
}

pin_project_lite::pin_project! {
    /// A response body that holds the request's server span, so that the
    /// span ends with the last byte (or when the client goes away).
    pub(crate) struct SpanBody<B> {
        // Dropped first: an attempt span the inner body holds ends before
        // the server span below.
        #[pin]
        inner: B,
        span: EndsOnDrop,
    }
}

impl<B> SpanBody<B> {
    pub(crate) fn new(inner: B, span: Span) -> Self {
        Self {
            inner,
            span: EndsOnDrop(span),
        }
    }
}

/// A span whose end is when it is dropped ([`stamp_end`]), not its last
/// poll: a client that goes away while the upstream is stalled ends the
/// server span then.
struct EndsOnDrop(Span);

impl Drop for EndsOnDrop {
    fn drop(&mut self) {
        stamp_end(&self.0);
    }
}

impl<B: Body> Body for SpanBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let _entered = this.span.0.enter();
        this.inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::{Protocol, grpc_outcome};
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
