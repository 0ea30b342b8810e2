//! The spans of the request path, and the body that ends the server span
//! with its last byte.

use super::*;

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
