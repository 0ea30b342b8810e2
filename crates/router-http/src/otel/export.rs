//! The transports: OTLP/HTTP and OTLP/gRPC on the router's own hyper
//! client, in cleartext or over rustls.

use super::*;

/// The TLS client configuration of an `https://` export: rustls with
/// ring, trusting the PEM certificates of `ca_file`, or else the system's
/// roots.
pub(super) fn tls_config(
    ca_file: Option<&std::path::Path>,
) -> Result<rustls::ClientConfig, TraceError> {
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
pub(super) fn client_tls(roots: rustls::RootCertStore) -> Result<rustls::ClientConfig, TraceError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| TraceError::Tls(err.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// The path of the OTLP/gRPC trace export call.
pub(super) const GRPC_EXPORT_PATH: &str =
    "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// The `User-Agent` of the exports (OTLP asks exporters to name
/// themselves, so a collector's logs say who sent a batch).
const USER_AGENT: &str = concat!("affinity-router-otlp/", env!("CARGO_PKG_VERSION"));

/// The OTLP/gRPC span exporter: each batch is one unary
/// `TraceService/Export` call over HTTP/2 on the router's hyper client
/// ([`ExportClient`], which runs it on the router's runtime within the
/// export timeout). The request body is the batch's
/// `ExportTraceServiceRequest` ([`TraceEncoder`]) in one gRPC message
/// frame; the call succeeded when the response is HTTP 200 with
/// `grpc-status: 0`, in its trailers or, for an answer without a body,
/// its headers.
#[derive(Debug)]
pub(super) struct GrpcExporter {
    pub(super) client: ExportClient,
    /// `http(s)://HOST:PORT` with the call's path.
    pub(super) uri: http::Uri,
    /// Reused from batch to batch (the export thread exports one at a
    /// time, so the lock is never contended).
    pub(super) encoder: parking_lot::Mutex<TraceEncoder>,
}

impl GrpcExporter {
    /// The export call of `batch`: a gRPC length-prefixed message, not
    /// compressed.
    fn request(&self, batch: &[EncodedSpans]) -> Result<http::Request<Bytes>, String> {
        let body = {
            let mut encoder = self.encoder.lock();
            // A gRPC frame's length is 32 bits; a batch (at most 512
            // spans) is far below it, and one that is not fails as a whole.
            let frame = encoder.encode_grpc_frame_encoded(batch).ok_or_else(|| {
                let spans: usize = batch.iter().map(EncodedSpans::len).sum();
                format!("a batch of {spans} spans exceeds a gRPC frame")
            })?;
            Bytes::copy_from_slice(frame)
        };
        let mut request = http::Request::new(body);
        *request.method_mut() = http::Method::POST;
        *request.uri_mut() = self.uri.clone();
        let headers = request.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        headers.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
        headers.insert(
            http::header::USER_AGENT,
            http::HeaderValue::from_static(USER_AGENT),
        );
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
pub(super) fn grpc_outcome(
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

impl Export for GrpcExporter {
    fn export(
        &self,
        batch: &[EncodedSpans],
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        // The request put together now, on the export thread; the
        // exchange is the future.
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
}

/// The OTLP/HTTP span exporter: each batch is a `POST` of its protobuf
/// `ExportTraceServiceRequest` ([`TraceEncoder`]) to the endpoint's URL as
/// configured, on the router's hyper client over HTTP/1.1. The export
/// succeeded when the collector answers 2xx; any other status, or no
/// answer within the timeout, is a failed export (not retried: the
/// batch's spans are counted `export_failed`, as over gRPC). The
/// collector's partial-success details are not read.
#[derive(Debug)]
pub(super) struct HttpExporter {
    pub(super) client: ExportClient,
    /// The endpoint, path included, used as given.
    pub(super) uri: http::Uri,
    /// Reused from batch to batch, as [`GrpcExporter`]'s.
    pub(super) encoder: parking_lot::Mutex<TraceEncoder>,
}

impl HttpExporter {
    /// The `POST` of `batch`.
    fn request(&self, batch: &[EncodedSpans]) -> http::Request<Bytes> {
        let body = Bytes::copy_from_slice(self.encoder.lock().encode_encoded(batch));
        let mut request = http::Request::new(body);
        *request.method_mut() = http::Method::POST;
        *request.uri_mut() = self.uri.clone();
        let headers = request.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/x-protobuf"),
        );
        headers.insert(
            http::header::USER_AGENT,
            http::HeaderValue::from_static(USER_AGENT),
        );
        request
    }
}

impl Export for HttpExporter {
    fn export(
        &self,
        batch: &[EncodedSpans],
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        // The request put together now, on the export thread; the
        // exchange is the future.
        let request = self.request(batch);
        let client = self.client.clone();
        async move {
            let (parts, _body, _trailers) = client
                .exchange(request)
                .await
                .map_err(|err| OTelSdkError::InternalFailure(err.to_string()))?;
            if parts.status.is_success() {
                Ok(())
            } else {
                Err(OTelSdkError::InternalFailure(format!(
                    "the collector answered HTTP {}",
                    parts.status
                )))
            }
        }
    }
}

/// The OTLP exporters' HTTP client: the request runs as a task on the
/// router's runtime (the pipeline's export thread has no runtime of its
/// own), bounded by the export timeout, its response body by 4 MiB.
/// HTTP/1.1 for OTLP/HTTP, HTTP/2 only for gRPC (prior knowledge over
/// cleartext, ALPN `h2` over TLS); TLS when the endpoint is `https://`.
#[derive(Debug, Clone)]
pub(super) struct ExportClient {
    pub(super) runtime: tokio::runtime::Handle,
    pub(super) client: hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        Full<Bytes>,
    >,
    pub(super) timeout: Duration,
}

/// A collector's answer larger than this is an error (its body is a small
/// protobuf message).
pub(super) const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;

/// A collector's answer: its head, body and trailers (gRPC's status).
pub(super) type Exchange = (http::response::Parts, Bytes, Option<HeaderMap>);

impl ExportClient {
    /// A client for `protocol`; `tls` for an `https://` endpoint (`None`:
    /// cleartext only).
    pub(super) fn new(
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
