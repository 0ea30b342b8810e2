//! The spans of the request path, and the body that ends the server span
//! with its last byte.
//!
//! Each span is the router's finished-span record ([`SpanRecord`]) filled
//! in place: started with an explicit parent (the server span's context,
//! carried in [`Traced`]) and typed attributes, and ended once, where its
//! work ends. A request's spans wait with its server span and are handed
//! to the pipeline's queue together when the server span ends (one
//! hand-over per request, see `queue.rs`). Nothing is entered or
//! left on a poll, no attribute value is formatted unless it is an
//! error's text, and no `tracing` span exists for a trace (see the module
//! docs for why).
//!
//! # Why not the SDK's tracer
//!
//! The SDK's `Tracer` builds each span through its sampler, id generator
//! and a shared `Span` wrapper, and converts it to a `SpanData` when it
//! ends. The router has already sampled (before it builds anything) and
//! knows every span's parent, so it writes the record directly, when the
//! span ends: a quarter fewer instructions for a request's spans
//! (`examples/span_cost.rs`; docs/benchmarks.md, "Tracing"). The record
//! is the router's own, not the SDK's `SpanData` (see `record.rs` for
//! why).

use super::record::{Attribute, AttributeValue, SpanRecord};
use super::*;
use opentelemetry::trace::TraceContextExt as _;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use std::time::SystemTime;

/// Most attributes one span keeps (the SDK's default limit); more are
/// counted as dropped.
const MAX_ATTRIBUTES: usize = 128;

/// Where a pipeline's spans go: its queue.
#[derive(Debug)]
pub(crate) struct SpanSink {
    pub(super) queue: SpanQueue,
}

/// Where an ended span's record goes.
#[derive(Debug)]
enum Destination {
    /// Straight to the pipeline's queue, alone.
    Sink(Arc<SpanSink>),
    /// To its request's server span, which hands it over with the
    /// request's other spans (alone when the server span already ended).
    Request(Arc<ServerSpan>),
}

/// One span of the request path, handed to its pipeline when it is ended
/// or dropped. Its fields are the record's; the record itself
/// ([`SpanRecord`]) is made once, when the span ends (no allocation for
/// the span itself).
#[derive(Debug)]
pub(crate) struct OtelSpan {
    context: SpanContext,
    /// The context's trace state as its header's text (`None` when
    /// empty), shared with the request's other spans.
    trace_state: Option<Arc<str>>,
    parent_span_id: SpanId,
    parent_is_remote: bool,
    kind: SpanKind,
    name: std::borrow::Cow<'static, str>,
    start: SystemTime,
    attributes: Vec<Attribute>,
    dropped_attributes: u32,
    status: Status,
    /// `None` once ended.
    to: Option<Destination>,
}

impl OtelSpan {
    /// A span started now under `parent` (`parent_is_remote` when it is
    /// the client's), in `parent`'s trace when that is valid, else in a
    /// new one. `trace_state` is `parent`'s, as its header's text.
    fn start(
        to: Destination,
        parent: &SpanContext,
        trace_state: Option<Arc<str>>,
        parent_is_remote: bool,
        name: std::borrow::Cow<'static, str>,
        kind: SpanKind,
        attributes: Vec<Attribute>,
    ) -> OtelSpan {
        // Every span the router builds is sampled: it decided before
        // building any (`head_sampled`). A parent's other flags carry on.
        let (trace_id, parent_span_id, flags, state, trace_state) = if parent.is_valid() {
            (
                parent.trace_id(),
                parent.span_id(),
                parent.trace_flags().with_sampled(true),
                parent.trace_state().clone(),
                trace_state,
            )
        } else {
            let id = (u128::from(random_u64()) << 64) | u128::from(random_u64());
            (
                TraceId::from(id),
                SpanId::INVALID,
                TraceFlags::SAMPLED,
                TraceState::default(),
                None,
            )
        };
        OtelSpan {
            context: SpanContext::new(trace_id, SpanId::from(random_u64()), flags, false, state),
            trace_state,
            parent_span_id,
            parent_is_remote: parent_is_remote && parent.is_valid(),
            kind,
            name,
            start: SystemTime::now(),
            attributes,
            dropped_attributes: 0,
            status: Status::Unset,
            to: Some(to),
        }
    }

    /// Adds an attribute (dropped, and counted so, past
    /// [`MAX_ATTRIBUTES`]; none once the span ended).
    pub(crate) fn set_attribute(&mut self, attribute: Attribute) {
        if self.to.is_none() {
            return;
        }
        if self.attributes.len() < MAX_ATTRIBUTES {
            self.attributes.push(attribute);
        } else {
            self.dropped_attributes = self.dropped_attributes.saturating_add(1);
        }
    }

    /// Sets the status when it ranks above the current one (Ok above
    /// Error above Unset, as the SDK's spans do).
    pub(crate) fn set_status(&mut self, status: Status) {
        if self.to.is_some() && status > self.status {
            self.status = status;
        }
    }

    /// The span's context (its trace, its id), for a `traceparent`.
    pub(crate) fn span_context(&self) -> &SpanContext {
        &self.context
    }

    /// Ends the span now and hands its record on (to its request's server
    /// span, or to the pipeline); later calls do nothing. The record is
    /// made where it goes (into the request's buffer under its lock), not
    /// made and then moved there.
    pub(crate) fn end(&mut self) {
        match self.to.take() {
            None => {}
            Some(Destination::Sink(sink)) => {
                let record = self.record();
                sink.queue.hand_off(vec![record]);
            }
            Some(Destination::Request(server)) => {
                let mut state = server.state.lock();
                if state.span.to.is_some() {
                    let record = self.record();
                    state.ended_children.push(record);
                } else {
                    // The server span ended first: this one goes alone.
                    drop(state);
                    let record = self.record();
                    server.sink.queue.hand_off(vec![record]);
                }
            }
        }
    }

    /// The span's record, ended now (its name, attributes and status are
    /// moved out: called once, when `to` was taken).
    #[inline(always)]
    fn record(&mut self) -> SpanRecord {
        SpanRecord {
            trace_id: self.context.trace_id().to_bytes(),
            span_id: self.context.span_id().to_bytes(),
            parent_span_id: self.parent_span_id.to_bytes(),
            trace_flags: self.context.trace_flags().to_u8(),
            parent_is_remote: self.parent_is_remote,
            trace_state: self.trace_state.take(),
            kind: self.kind.clone(),
            name: std::mem::take(&mut self.name),
            start: self.start,
            end: SystemTime::now(),
            attributes: std::mem::take(&mut self.attributes),
            dropped_attributes: self.dropped_attributes,
            status: std::mem::replace(&mut self.status, Status::Unset),
        }
    }
}

impl Drop for OtelSpan {
    fn drop(&mut self) {
        self.end();
    }
}

/// A random id word from the per-thread generator (never 0).
fn random_u64() -> u64 {
    super::random_u64()
}

/// A request the router traces: the pipeline it exports to and the
/// request's server span, which every other span of the request has as
/// its parent. Made by `Router::handle` and handed to the proxy path; the
/// request path builds its phase, decision and attempt spans only with
/// it.
#[derive(Debug, Clone)]
pub(crate) struct Traced {
    server: Arc<ServerSpan>,
}

/// A request's server span, shared by the clones of its [`Traced`] and
/// by its other spans: its context (read without a lock), the span
/// itself, ended once by the body that carries the response, and the
/// request's spans that ended before it.
#[derive(Debug)]
struct ServerSpan {
    context: SpanContext,
    /// The context's trace state as its header's text, for every span of
    /// the request.
    trace_state: Option<Arc<str>>,
    /// The pipeline, for the request's other spans.
    sink: Arc<SpanSink>,
    state: parking_lot::Mutex<ServerState>,
}

#[derive(Debug)]
struct ServerState {
    span: OtelSpan,
    /// The request's spans that ended before the server span, handed
    /// over with it.
    ended_children: Vec<SpanRecord>,
}

/// Room for a request's usual spans (admission, read body, extract, a
/// decision and an attempt) and its server span, which joins them when
/// it ends: 960 bytes, within the allocator's small sizes (a retry's pair
/// of spans regrows it).
const CHILDREN: usize = 6;

impl ServerSpan {
    /// Ends the server span now and hands it over with the children that
    /// ended before it; later calls do nothing.
    fn end(&self) {
        let mut state = self.state.lock();
        if state.span.to.take().is_none() {
            return;
        }
        let record = state.span.record();
        let mut spans = std::mem::take(&mut state.ended_children);
        drop(state);
        spans.push(record);
        self.sink.queue.hand_off(spans);
    }
}

impl Drop for ServerSpan {
    /// A request whose body was never made (it failed before a response)
    /// still hands its spans over.
    fn drop(&mut self) {
        self.end();
    }
}

/// The sink of the pipeline whose [`Tracing::layer`] is in the current
/// `tracing` dispatcher, if any: how a host connects the router to a
/// pipeline (the same subscriber that carries its logs).
fn current_sink() -> Option<Arc<SpanSink>> {
    tracing::dispatcher::get_default(|dispatch| {
        dispatch
            .downcast_ref::<TraceLayer>()
            .map(|layer| Arc::clone(&layer.sink))
    })
}

/// The server span of a request, or `None` when it is not traced (tracing
/// off, an excluded path, not sampled, or no pipeline's layer in the
/// current subscriber). Continues the request's `traceparent`. `route`
/// is the request's ([`Route::of`], or a passthrough path's).
pub(crate) fn server_span<B>(
    trace: &TraceConfig,
    request: &http::Request<B>,
    route: Route,
) -> Option<Traced> {
    let path = request.uri().path();
    if !trace.traces(path) {
        return None;
    }
    // The propagator answers the current context for a request without
    // a `traceparent` (as it does for one it cannot read): most requests,
    // spared its header lookups and parse.
    let parent = if request.headers().contains_key(TRACEPARENT) {
        TraceContextPropagator::new().extract(&HeaderExtractor(request.headers()))
    } else {
        opentelemetry::Context::current()
    };
    if !head_sampled(&parent, trace.sampling_ratio) {
        return None;
    }
    let sink = current_sink()?;
    // Only paths the router knows name a route: an unknown path is not a
    // low-cardinality span name. A known path's route and span name are
    // static strings (no allocation on the request path).
    let known = match route {
        Route::NotFound | Route::InvalidTarget | Route::WrongMethod { .. } => None,
        _ => Route::known_path(path),
    };
    // Sized for every attribute the span gets (these three, then the
    // status, the model and the request id): no regrowth on the request
    // path.
    let mut attributes = Vec::with_capacity(6);
    attributes.push(Attribute::new(
        "http.request.method",
        method_value(request.method()),
    ));
    let name = match known {
        Some((index, route)) => {
            attributes.push(Attribute::new("http.route", route));
            server_span_name(request.method(), index, route)
        }
        None => method_value_name(request.method()),
    };
    let url_path = match known {
        Some((_, route)) if route == path => AttributeValue::from(route),
        _ => AttributeValue::from(path.to_owned()),
    };
    attributes.push(Attribute::new("url.path", url_path));
    // A request without (valid) trace context starts a new trace.
    let remote = parent.span();
    let remote_context = remote.span_context();
    // The client's trace state, as text once for all the request's spans
    // (none for most requests: no allocation then).
    let header = remote_context.trace_state().header();
    let trace_state = (!header.is_empty()).then(|| Arc::<str>::from(header));
    let span = OtelSpan::start(
        Destination::Sink(Arc::clone(&sink)),
        remote_context,
        trace_state.clone(),
        true,
        name,
        SpanKind::Server,
        attributes,
    );
    Some(Traced {
        server: Arc::new(ServerSpan {
            context: span.span_context().clone(),
            trace_state: span.trace_state.clone(),
            sink,
            state: parking_lot::Mutex::new(ServerState {
                span,
                ended_children: Vec::with_capacity(CHILDREN),
            }),
        }),
    })
}

/// `"{method} {route}"`, the server span's name for a known route (the
/// one at `index` of [`known_paths`](crate::routes::known_paths)): a
/// static string for the methods routes take, made once per process.
fn server_span_name(
    method: &http::Method,
    index: usize,
    route: &'static str,
) -> std::borrow::Cow<'static, str> {
    use std::sync::OnceLock;
    const METHODS: [&str; 3] = ["GET", "POST", "DELETE"];
    static NAMES: OnceLock<Vec<[&'static str; 3]>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        crate::routes::known_paths()
            .map(|path| {
                METHODS.map(|method| {
                    // A few dozen short strings, leaked once: they name
                    // spans for the life of the process.
                    &*Box::leak(format!("{method} {path}").into_boxed_str())
                })
            })
            .collect()
    });
    match METHODS.iter().position(|m| *m == method.as_str()) {
        Some(m) => std::borrow::Cow::Borrowed(names[index][m]),
        None => std::borrow::Cow::Owned(format!("{method} {route}")),
    }
}

/// A method as an attribute value: the common ones without allocating.
fn method_value(method: &http::Method) -> AttributeValue {
    AttributeValue::String(method_value_name(method))
}

fn method_value_name(method: &http::Method) -> std::borrow::Cow<'static, str> {
    // Compared as text: a `Method` constant in an array is built and
    // dropped on every call.
    const NAMES: [&str; 7] = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"];
    let name = method.as_str();
    match NAMES.iter().find(|known| **known == name) {
        Some(known) => std::borrow::Cow::Borrowed(known),
        None => std::borrow::Cow::Owned(name.to_owned()),
    }
}

/// An `i64` attribute from a count (saturated).
fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Traced {
    /// A span of this request, child of its server span, started now.
    fn child(
        &self,
        name: impl Into<std::borrow::Cow<'static, str>>,
        kind: SpanKind,
        attributes: Vec<Attribute>,
    ) -> OtelSpan {
        OtelSpan::start(
            Destination::Request(Arc::clone(&self.server)),
            &self.server.context,
            self.server.trace_state.clone(),
            false,
            name.into(),
            kind,
            attributes,
        )
    }

    /// The server span's context (for the trace context of P/D legs).
    pub(crate) fn server_context(&self) -> SpanContext {
        self.server.context.clone()
    }

    /// Records the response status on the server span (5xx is an error).
    pub(crate) fn record_response(&self, status: http::StatusCode) {
        let span = &mut self.server.state.lock().span;
        span.set_attribute(Attribute::new(
            "http.response.status_code",
            i64::from(status.as_u16()),
        ));
        if status.is_server_error() {
            span.set_status(Status::error(""));
        }
    }

    /// Records the request's model and id on the server span.
    pub(crate) fn record_request(&self, model: &str, request_id: &http::HeaderValue) {
        let span = &mut self.server.state.lock().span;
        if !model.is_empty() {
            span.set_attribute(Attribute::new("gen_ai.request.model", model.to_owned()));
        }
        if let Ok(id) = request_id.to_str() {
            span.set_attribute(Attribute::new("request.id", id.to_owned()));
        }
    }

    /// Ends the server span now (the response body ended or was dropped).
    fn end(&self) {
        self.server.end();
    }

    /// The span of the body's extraction: one parse of the JSON, and for
    /// a model with a tokenizer its chat template and tokenization.
    pub(crate) fn extract_span(&self) -> OtelSpan {
        // At most four attributes (`record_routing_input`).
        self.child("extract", SpanKind::Internal, Vec::with_capacity(4))
    }

    /// The span of one routing decision among `candidates` workers.
    pub(crate) fn decision_span(&self, policy: &str, candidates: usize) -> OtelSpan {
        // These two, then the decision's four (`record_decision`) or its
        // error.
        let mut attributes = Vec::with_capacity(6);
        attributes.push(Attribute::new("router.policy", policy_value(policy)));
        attributes.push(Attribute::new("router.candidates", count(candidates)));
        self.child("route", SpanKind::Internal, attributes)
    }

    /// The span of one prefill/decode pair decision, the policies of the
    /// two roles named; [`record_pair`] records what they chose.
    pub(crate) fn pair_decision_span(&self, prefill_policy: &str, decode_policy: &str) -> OtelSpan {
        // These two, then up to six a role (`record_pair`).
        let mut attributes = Vec::with_capacity(14);
        attributes.push(Attribute::new(
            PREFILL_KEYS.policy,
            policy_value(prefill_policy),
        ));
        attributes.push(Attribute::new(
            DECODE_KEYS.policy,
            policy_value(decode_policy),
        ));
        self.child("route", SpanKind::Internal, attributes)
    }

    /// The client span of one upstream attempt (`resend` is 0 for the
    /// first, then the retry's number) to `worker`. The answering
    /// attempt's span ends with the response body (see
    /// [`record_body_end`]).
    pub(crate) fn attempt_span(
        &self,
        method: &http::Method,
        worker: &Arc<str>,
        resend: u32,
    ) -> OtelSpan {
        // HTTP client spans are named by their method alone (OpenTelemetry's
        // semantic conventions: the URL is not a low-cardinality name); the
        // worker is `url.full`.
        let mut attributes = Vec::with_capacity(8);
        attributes.push(Attribute::new("http.request.method", method_value(method)));
        attributes.push(Attribute::new("url.full", Arc::clone(worker)));
        attributes.push(Attribute::new(
            "http.request.resend_count",
            i64::from(resend),
        ));
        self.child(method_value_name(method), SpanKind::Client, attributes)
    }
}

/// Runs `future` inside an internal span named `name` (a phase of the
/// request before routing: `admission`, `read body`) when traced: the
/// span starts before the first poll and ends after the output (or when
/// the future is dropped), and is not entered in between.
pub(crate) async fn phase<F: std::future::Future>(
    traced: Option<&Traced>,
    name: &'static str,
    future: F,
) -> F::Output {
    match traced {
        Some(traced) => {
            let span = traced.child(name, SpanKind::Internal, Vec::new());
            let output = future.await;
            drop(span);
            output
        }
        None => future.await,
    }
}

/// Records what the extraction gave the policies: token ids (how many, and
/// for a chat how the segment cache served them), text (how long) or
/// nothing.
pub(crate) fn record_routing_input(span: &mut OtelSpan, info: &crate::RequestInfo) {
    use lb_policies::RoutingInputBuf;
    if let Some(uses) = info.segment_cache {
        span.set_attribute(Attribute::new(
            "router.tokens.segment_cache_hits",
            i64::from(uses.hits),
        ));
        span.set_attribute(Attribute::new(
            "router.tokens.segment_cache_misses",
            i64::from(uses.misses),
        ));
    }
    match &info.routing {
        RoutingInputBuf::Tokens(ids) => {
            span.set_attribute(Attribute::new("router.routing_input", "tokens"));
            span.set_attribute(Attribute::new("router.routing_tokens", count(ids.len())));
        }
        RoutingInputBuf::Text(text) => {
            span.set_attribute(Attribute::new("router.routing_input", "text"));
            // Bytes, not characters: counting characters read the whole
            // text again (about 700 instructions for 1 KB).
            span.set_attribute(Attribute::new("router.routing_bytes", count(text.len())));
        }
        RoutingInputBuf::None => {
            span.set_attribute(Attribute::new("router.routing_input", "none"));
        }
    }
}

/// Records a decision's outcome on its span: the reason, the best prefix
/// match (its rate in thousandths, and its length in the routing input's
/// units) for a prefix-matching policy, and the worker.
pub(crate) fn record_decision(
    span: &mut OtelSpan,
    reason: &'static str,
    (match_permille, matched): (Option<u16>, Option<usize>),
    worker: &Arc<str>,
) {
    span.set_attribute(Attribute::new("router.decision.reason", reason));
    if let Some(permille) = match_permille {
        span.set_attribute(Attribute::new(
            "router.decision.match_rate",
            f64::from(permille) / 1000.0,
        ));
    }
    if let Some(matched) = matched {
        span.set_attribute(Attribute::new("router.decision.matched", count(matched)));
    }
    span.set_attribute(Attribute::new("router.worker", Arc::clone(worker)));
}

/// The attribute keys of one role's choice in a pair decision.
struct RoleKeys {
    policy: &'static str,
    worker: &'static str,
    reason: &'static str,
    match_rate: &'static str,
    matched: &'static str,
    candidates: &'static str,
}

const PREFILL_KEYS: RoleKeys = RoleKeys {
    policy: "router.pd.prefill.policy",
    worker: "router.pd.prefill.worker",
    reason: "router.pd.prefill.reason",
    match_rate: "router.pd.prefill.match_rate",
    matched: "router.pd.prefill.matched",
    candidates: "router.pd.prefill.candidates",
};

const DECODE_KEYS: RoleKeys = RoleKeys {
    policy: "router.pd.decode.policy",
    worker: "router.pd.decode.worker",
    reason: "router.pd.decode.reason",
    match_rate: "router.pd.decode.match_rate",
    matched: "router.pd.decode.matched",
    candidates: "router.pd.decode.candidates",
};

/// Gives `add` a role's decision (reason, best prefix match as rate and
/// length for a prefix-matching policy, candidates) under `keys`.
fn add_decision(
    mut add: impl FnMut(Attribute),
    keys: &RoleKeys,
    decision: &pd_orchestrator::pools::PdDecision,
) {
    add(Attribute::new(keys.reason, decision.reason.as_str()));
    if let Some(permille) = decision.match_permille {
        add(Attribute::new(
            keys.match_rate,
            f64::from(permille) / 1000.0,
        ));
    }
    if let Some(matched) = decision.matched {
        add(Attribute::new(keys.matched, count(matched)));
    }
    add(Attribute::new(keys.candidates, count(decision.candidates)));
}

/// Records a prefill/decode pair decision on its span: for each role
/// chosen, the worker, the reason, the best prefix match (rate and
/// length, for a prefix-matching policy) and how many workers the policy
/// chose among. A decode worker chosen late (NIXL, sequential Mooncake:
/// after the prefill answers) is marked `router.pd.decode.late`, and its
/// decision is on the decode leg's span under the same keys. No pair: the
/// span fails with the selection's error.
pub(crate) fn record_pair(
    span: &mut OtelSpan,
    outcome: Result<pd_orchestrator::pools::Selected<'_>, &worker_lifecycle::SelectError>,
) {
    let selected = match outcome {
        Ok(selected) => selected,
        Err(err) => return record_error(span, err),
    };
    let mut record = |target: &pd_orchestrator::pools::PdTarget, keys: &RoleKeys| {
        span.set_attribute(Attribute::new(
            keys.worker,
            Arc::clone(target.worker().endpoint().worker_url().as_shared()),
        ));
        add_decision(
            |attribute| span.set_attribute(attribute),
            keys,
            target.decision(),
        );
    };
    record(selected.prefill, &PREFILL_KEYS);
    match selected.decode {
        Some(decode) => record(decode, &DECODE_KEYS),
        None => span.set_attribute(Attribute::new("router.pd.decode.late", true)),
    }
}

/// A policy's name as an attribute value: a built-in policy's is a static
/// string (no allocation).
fn policy_value(policy: &str) -> AttributeValue {
    lb_policies::BUILTIN_POLICIES
        .iter()
        .chain(lb_policies::INDEX_POLICIES.iter())
        .find(|name| **name == policy)
        .map_or_else(
            || AttributeValue::from(policy.to_owned()),
            |name| AttributeValue::from(*name),
        )
}

/// Records that no worker could be chosen.
pub(crate) fn record_no_decision(span: &mut OtelSpan, error: &dyn std::fmt::Display) {
    record_error(span, error);
}

/// Marks `span` failed, `error.type` the error's text.
fn record_error(span: &mut OtelSpan, error: &dyn std::fmt::Display) {
    span.set_status(Status::error(""));
    span.set_attribute(Attribute::new("error.type", error.to_string()));
}

/// Records on an attempt or leg span the time from `sent` (just before the
/// request went out) to its response head.
pub(crate) fn record_first_byte(span: &mut OtelSpan, sent: tokio::time::Instant) {
    span.set_attribute(Attribute::new(
        "router.time_to_first_byte_ms",
        sent.elapsed().as_secs_f64() * 1000.0,
    ));
}

/// Records how the response body an attempt or decode leg span carries
/// ended, and ends the span now. A body that failed (upstream reset, idle
/// or request timeout) makes the span an error; a client that went away
/// does not (the worker did nothing wrong), it is only marked.
pub(crate) fn record_body_end(span: &mut OtelSpan, end: crate::body::BodyEnd) {
    use crate::body::BodyEnd;
    let end = match end {
        BodyEnd::Complete => "complete",
        BodyEnd::Failed => {
            span.set_status(Status::error(""));
            "failed"
        }
        BodyEnd::Dropped => "client_disconnected",
    };
    span.set_attribute(Attribute::new("router.body.end", end));
    span.end();
}

/// What the leg spans of a traced prefill/decode request name besides
/// the leg itself: set around the request's run (`pd::proxy`), read when
/// the transport sends a leg.
#[derive(Debug)]
pub(crate) struct PdLegs {
    /// The request's trace: every leg span is a child of its server span.
    pub(crate) traced: Traced,
    /// The connector's name (`nixl`, `mooncake`, ...).
    pub(crate) connector: &'static str,
    /// The client's path, the tail of every leg's URL after the worker's.
    pub(crate) path: String,
    /// The names of the prefill and the decode role's policies for the
    /// request's model.
    pub(crate) policies: (String, String),
    /// What the request routes by: it says how a decode worker chosen late
    /// was chosen (recorded on that decode leg's span).
    pub(crate) scope: Arc<pd_orchestrator::pools::PdScope>,
    /// The span of the latest decode leg that got a response head. The
    /// transport parks it here because the decode body outlives the leg's
    /// send: `pd::proxy` hands it to the client's response body, or ends
    /// it when the attempt fails.
    decode: parking_lot::Mutex<Option<OtelSpan>>,
}

impl PdLegs {
    /// The legs of the request `traced` for `path` through `connector`,
    /// routed by `scope` with the roles' `policies` (their names: prefill,
    /// decode).
    pub(crate) fn new(
        traced: Traced,
        connector: &'static str,
        path: String,
        policies: (String, String),
        scope: Arc<pd_orchestrator::pools::PdScope>,
    ) -> Self {
        Self {
            traced,
            connector,
            path,
            policies,
            scope,
            decode: parking_lot::Mutex::new(None),
        }
    }

    /// The span of one attempt's pair decision (see [`record_pair`]).
    pub(crate) fn pair_decision_span(&self) -> OtelSpan {
        let (prefill, decode) = &self.policies;
        self.traced.pair_decision_span(prefill, decode)
    }

    /// Keeps a decode leg's span alive past its response head. A failed
    /// attempt's was taken when it failed, so nothing is replaced here.
    pub(crate) fn park_decode(&self, span: OtelSpan) {
        // Dropped outside the lock: ending a span hands it to the export.
        let previous = self.decode.lock().replace(span);
        drop(previous);
    }

    /// The parked decode leg's span, if any.
    pub(crate) fn take_decode(&self) -> Option<OtelSpan> {
        self.decode.lock().take()
    }
}

/// The client span of one prefill/decode leg: `phase` (`prefill` or
/// `decode`) sent to `url` with `body`. Names the worker (the URL without
/// the client's path), the connector and the size of the body's
/// `kv_transfer_params` (compact JSON, as sent; absent when the body has
/// none). Traced requests only: the body is parsed once more here.
pub(crate) fn leg_span(legs: &PdLegs, phase: &'static str, url: &str, body: &[u8]) -> OtelSpan {
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
        .map(|bytes| count(bytes.len()));
    let mut attributes = Vec::with_capacity(12);
    attributes.push(Attribute::new("http.request.method", "POST"));
    attributes.push(Attribute::new("url.full", url.to_owned()));
    if let Some(host) = host {
        attributes.push(Attribute::new("server.address", host.to_owned()));
    }
    if let Some(port) = port {
        attributes.push(Attribute::new("server.port", port));
    }
    attributes.push(Attribute::new("router.worker", worker.to_owned()));
    attributes.push(Attribute::new("router.pd.phase", phase));
    attributes.push(Attribute::new("router.pd.connector", legs.connector));
    if let Some(bytes) = kv_bytes {
        attributes.push(Attribute::new("router.pd.kv_transfer_params.bytes", bytes));
    }
    // A decode worker chosen late was chosen just now, for this leg: its
    // decision is told here, under the keys the pair's `route` span would
    // have had.
    if phase == "decode"
        && let Some(decision) = legs.scope.late_decode()
    {
        attributes.push(Attribute::new(
            DECODE_KEYS.policy,
            policy_value(&legs.policies.1),
        ));
        add_decision(
            |attribute| attributes.push(attribute),
            &DECODE_KEYS,
            &decision,
        );
    }
    legs.traced.child(phase, SpanKind::Client, attributes)
}

/// Writes `context` into `headers` as `traceparent` (and `tracestate`
/// when it has one), replacing what the client sent. The header is
/// written byte by byte: it is fixed-size hex.
pub(crate) fn inject_context(context: &SpanContext, headers: &mut HeaderMap) {
    if !context.is_valid() {
        return;
    }
    const HEX: &[u8; 16] = b"0123456789abcdef";
    // "00-" 32 hex "-" 16 hex "-" 2 hex.
    let mut out = [0u8; 55];
    out[..3].copy_from_slice(b"00-");
    let mut at = 3;
    let mut put = |bytes: &[u8], at: &mut usize| {
        for byte in bytes {
            out[*at] = HEX[usize::from(byte >> 4)];
            out[*at + 1] = HEX[usize::from(byte & 0x0f)];
            *at += 2;
        }
    };
    put(&context.trace_id().to_bytes(), &mut at);
    let trace_end = at;
    at += 1;
    put(&context.span_id().to_bytes(), &mut at);
    let span_end = at;
    at += 1;
    put(&[context.trace_flags().to_u8()], &mut at);
    out[trace_end] = b'-';
    out[span_end] = b'-';
    if let Ok(value) = http::HeaderValue::from_bytes(&out) {
        headers.insert(TRACEPARENT, value);
    }
    let state = context.trace_state().header();
    match http::HeaderValue::from_str(&state) {
        Ok(value) if !state.is_empty() => {
            headers.insert(TRACESTATE, value);
        }
        _ => {
            headers.remove(TRACESTATE);
        }
    }
}

const TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");
const TRACESTATE: http::HeaderName = http::HeaderName::from_static("tracestate");

/// `request` with `span`'s context in its headers (see
/// [`inject_context`]), when there is a span.
pub(crate) fn with_context<B>(
    span: Option<&OtelSpan>,
    mut request: http::Request<B>,
) -> http::Request<B> {
    if let Some(span) = span {
        inject_context(span.span_context(), request.headers_mut());
    }
    request
}

/// Records the worker's status on an attempt span (5xx is an error).
pub(crate) fn record_attempt_status(span: &mut OtelSpan, status: u16) {
    span.set_attribute(Attribute::new(
        "http.response.status_code",
        i64::from(status),
    ));
    if status >= 500 {
        span.set_status(Status::error(""));
        span.set_attribute(Attribute::new("error.type", status.to_string()));
    }
}

/// Records why an attempt failed before a response.
pub(crate) fn record_attempt_error(span: &mut OtelSpan, error: &dyn std::fmt::Display) {
    record_error(span, error);
}

/// Records that the request is retried after this attempt, and why.
pub(crate) fn record_retry(span: &mut OtelSpan, cause: &dyn std::fmt::Display) {
    span.set_attribute(Attribute::new("router.retry.cause", cause.to_string()));
}

pin_project_lite::pin_project! {
    /// A response body that holds the request's server span, so that the
    /// span ends with the last byte (or when the client goes away). It
    /// only forwards frames: the span ends once, when the body is dropped.
    pub(crate) struct SpanBody<B> {
        // Dropped first: an attempt span the inner body holds ends before
        // the server span below.
        #[pin]
        inner: B,
        span: EndsOnDrop,
    }
}

impl<B> SpanBody<B> {
    pub(crate) fn new(inner: B, traced: Traced) -> Self {
        Self {
            inner,
            span: EndsOnDrop(traced),
        }
    }
}

/// A server span whose end is when it is dropped, not its last poll: a
/// client that goes away while the upstream is stalled ends the server
/// span then.
struct EndsOnDrop(Traced);

impl Drop for EndsOnDrop {
    fn drop(&mut self) {
        self.0.end();
    }
}

impl<B: Body> Body for SpanBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The layer of [`Tracing::layer`]: it only carries the pipeline's
/// span sink, which the router finds in the current dispatcher
/// ([`tracing::Dispatch::downcast_ref`]) when it starts a traced request.
/// `Tracing::layer` wraps it in a per-layer filter that passes nothing:
/// it sees no span or event of the host, and it has no say in which
/// ones the host's other layers see. (A plain layer that answered
/// `Interest::never()` or `enabled: false` would switch every callsite
/// off for the whole subscriber, logs included.)
pub(crate) struct TraceLayer {
    pub(crate) sink: Arc<SpanSink>,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for TraceLayer {}

/// Builds, records and ends the spans of one regular chat request as the
/// request path does (server span, admission, read body, extract, one
/// decision, one attempt whose answer ends with its body), under the
/// pipeline whose layer is in the current subscriber; `false` when there
/// is none. For `examples/span_cost.rs` (the instructions the request
/// path spends on spans), not part of the crate's API.
#[doc(hidden)]
pub fn trace_one_request_for_bench(config: &TraceConfig) -> bool {
    use std::future::Future as _;
    let request = http::Request::post("/v1/chat/completions")
        .header("x-request-id", "bench-request-1")
        .body(())
        .expect("a valid request");
    let route = Route::of(request.method(), request.uri().path());
    let Some(traced) = server_span(config, &request, route) else {
        return false;
    };
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    for name in ["admission", "read body"] {
        let phase = std::pin::pin!(phase(Some(&traced), name, std::future::ready(())));
        let _ = phase.poll(&mut cx);
    }
    let mut extract = traced.extract_span();
    let info = crate::RequestInfo {
        model: Some("bench-model".into()),
        stream: false,
        user: None,
        routing: lb_policies::RoutingInputBuf::Text("user: hello".into()),
        segment_cache: None,
    };
    record_routing_input(&mut extract, &info);
    drop(extract);
    traced.record_request(
        "bench-model",
        request.headers().get("x-request-id").expect("set"),
    );
    // A worker's URL is shared text, made once with the worker.
    static WORKER: std::sync::LazyLock<Arc<str>> =
        std::sync::LazyLock::new(|| Arc::from("http://127.0.0.1:8001"));
    let worker = &*WORKER;
    let mut decision = traced.decision_span("cache_aware", 2);
    record_decision(&mut decision, "cache_hit", (Some(640), Some(512)), worker);
    drop(decision);
    let mut attempt = traced.attempt_span(request.method(), worker, 0);
    let mut headers = HeaderMap::new();
    inject_context(attempt.span_context(), &mut headers);
    record_first_byte(&mut attempt, tokio::time::Instant::now());
    record_attempt_status(&mut attempt, 200);
    record_body_end(&mut attempt, crate::body::BodyEnd::Complete);
    traced.record_response(http::StatusCode::OK);
    drop(SpanBody::new(http_body_util::Empty::<Bytes>::new(), traced));
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanId, TraceFlags, TraceId, TraceState};

    /// The CLI's subscriber: a filtered log layer and the pipeline's
    /// layer, boxed in a list. The router finds the sink through it,
    /// and finds none under a subscriber without the pipeline's layer.
    #[test]
    fn the_router_finds_the_pipeline_through_a_hosts_layer_list() {
        use tracing_subscriber::Layer as _;
        use tracing_subscriber::layer::SubscriberExt as _;
        type Boxed = Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let tracing = Tracing::start(&ExportConfig::default(), runtime.handle().clone()).unwrap();
        let log = || -> Boxed {
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::sink)
                .with_filter(tracing_subscriber::filter::LevelFilter::INFO)
                .boxed()
        };
        {
            let logs_only = tracing_subscriber::registry().with(vec![log()]);
            let _default = tracing::subscriber::set_default(logs_only);
            assert!(current_sink().is_none());
        }
        let layers: Vec<Boxed> = vec![log(), tracing.layer().boxed()];
        let with_pipeline = tracing_subscriber::registry().with(layers);
        let _default = tracing::subscriber::set_default(with_pipeline);
        assert!(current_sink().is_some());
    }

    /// Counts the events a layer is given.
    struct CountEvents(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountEvents {
        fn on_event(&self, _: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A host that stacks the pipeline's layer on its log layer, above it
    /// or below it, keeps every log event, and the router finds the
    /// sink through the stack.
    #[test]
    fn the_pipelines_layer_leaves_a_hosts_logs_as_they_were() {
        use tracing_subscriber::layer::SubscriberExt as _;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let tracing = Tracing::start(&ExportConfig::default(), runtime.handle().clone()).unwrap();
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let events = || seen.load(std::sync::atomic::Ordering::Relaxed);
        {
            let above = tracing_subscriber::registry()
                .with(CountEvents(std::sync::Arc::clone(&seen)))
                .with(tracing.layer());
            let _default = tracing::subscriber::set_default(above);
            tracing::info!("a host's log line");
            tracing::debug!("and a debug one");
            assert!(current_sink().is_some());
        }
        assert_eq!(events(), 2, "the pipeline's layer above the log layer");
        {
            let below = tracing_subscriber::registry()
                .with(tracing.layer())
                .with(CountEvents(std::sync::Arc::clone(&seen)));
            let _default = tracing::subscriber::set_default(below);
            tracing::warn!("a host's log line");
            assert!(current_sink().is_some());
        }
        assert_eq!(events(), 3, "the pipeline's layer below the log layer");
    }

    /// An exporter that keeps what it is given.
    #[derive(Debug, Clone, Default)]
    struct Kept(Arc<parking_lot::Mutex<Vec<SpanRecord>>>);

    impl super::super::Export for Kept {
        fn export(
            &self,
            batch: &[super::super::EncodedSpans],
        ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
            let mut kept = self.0.lock();
            for spans in batch {
                kept.extend_from_slice(&spans.records);
            }
            std::future::ready(Ok(()))
        }
    }

    fn kept_sink() -> (Arc<SpanSink>, Kept) {
        let (sink, kept, _counts) = kept_sink_with(&ExportConfig::default());
        (sink, kept)
    }

    fn kept_sink_with(config: &ExportConfig) -> (Arc<SpanSink>, Kept, Arc<SpanCounts>) {
        let kept = Kept::default();
        let counts = Arc::new(SpanCounts::default());
        let sink = super::super::span_sink(config, kept.clone(), &counts);
        (Arc::new(sink), kept, counts)
    }

    /// A request's server span on `sink`, in a new trace.
    fn traced(sink: &Arc<SpanSink>) -> Traced {
        let span = OtelSpan::start(
            Destination::Sink(Arc::clone(sink)),
            &SpanContext::empty_context(),
            None,
            true,
            "POST /v1/chat/completions".into(),
            SpanKind::Server,
            Vec::new(),
        );
        Traced {
            server: Arc::new(ServerSpan {
                context: span.span_context().clone(),
                trace_state: None,
                sink: Arc::clone(sink),
                state: parking_lot::Mutex::new(ServerState {
                    span,
                    ended_children: Vec::new(),
                }),
            }),
        }
    }

    fn names(kept: &Kept) -> Vec<String> {
        kept.0
            .lock()
            .iter()
            .map(|span| span.name.to_string())
            .collect()
    }

    /// A request's spans that end before its server span go to the export
    /// with it, in one hand-over: a bound of three keeps the last three
    /// of the five (per-span hand-overs would keep the first three). A
    /// span that ends after the server span goes alone, still exported.
    #[test]
    fn a_requests_spans_go_to_the_export_with_its_server_span() {
        let (sink, kept, counts) = kept_sink_with(&ExportConfig {
            max_queue_size: 3,
            scheduled_delay: Duration::from_secs(3600),
            ..ExportConfig::default()
        });
        let traced = traced(&sink);
        for name in ["admission", "read body", "extract", "route"] {
            drop(traced.child(name, SpanKind::Internal, Vec::new()));
        }
        let mut body = traced.child("POST", SpanKind::Client, Vec::new());
        sink.queue.force_flush().unwrap();
        assert!(
            kept.0.lock().is_empty(),
            "nothing handed over before the server span ends"
        );
        traced.end();
        traced.end();
        sink.queue.force_flush().unwrap();
        assert_eq!(
            names(&kept),
            ["extract", "route", "POST /v1/chat/completions"]
        );
        assert_eq!(counts.queue_full.get(), 2);
        body.end();
        sink.queue.force_flush().unwrap();
        assert_eq!(names(&kept).last().unwrap(), "POST");
        let spans = kept.0.lock();
        let server = &spans[2];
        assert_eq!(server.kind, SpanKind::Server);
        for child in [&spans[0], &spans[1], &spans[3]] {
            assert_eq!(child.parent_span_id, server.span_id);
            assert_eq!(child.trace_id, server.trace_id);
        }
    }

    /// A request that never made a response body (its server span never
    /// ended by one) hands its spans over when its last holder drops.
    #[test]
    fn a_server_span_never_ended_hands_its_spans_over_when_dropped() {
        let (sink, kept, _counts) = kept_sink_with(&ExportConfig {
            scheduled_delay: Duration::from_secs(3600),
            ..ExportConfig::default()
        });
        let traced = traced(&sink);
        let extract = traced.child("extract", SpanKind::Internal, Vec::new());
        drop(traced);
        sink.queue.force_flush().unwrap();
        assert!(kept.0.lock().is_empty(), "a child still holds the request");
        drop(extract);
        sink.queue.force_flush().unwrap();
        assert_eq!(names(&kept), ["extract", "POST /v1/chat/completions"]);
    }

    /// The records the router writes are what the SDK's spans were: ids
    /// in the parent's trace (or a new one), the parent's id and
    /// remoteness, the client's trace state, times in order, the status
    /// ranked, the attributes bounded, and one hand-over per span.
    #[test]
    fn spans_are_recorded_as_the_sdk_records_them() {
        let (sink, kept) = kept_sink();
        let trace_id = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
        let client = SpanContext::new(
            trace_id,
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::new(0x03),
            true,
            "vendor=abc".parse().unwrap(),
        );
        let mut server = OtelSpan::start(
            Destination::Sink(Arc::clone(&sink)),
            &client,
            Some("vendor=abc".into()),
            true,
            "POST /v1/chat/completions".into(),
            SpanKind::Server,
            vec![Attribute::new("a", 1_i64)],
        );
        let server_context = server.span_context().clone();
        let mut child = OtelSpan::start(
            Destination::Sink(Arc::clone(&sink)),
            &server_context,
            server.trace_state.clone(),
            false,
            "route".into(),
            SpanKind::Internal,
            Vec::new(),
        );
        for n in 0..MAX_ATTRIBUTES + 3 {
            child.set_attribute(Attribute::new("n", n as i64));
        }
        child.set_status(Status::error("first"));
        child.set_status(Status::Unset);
        child.end();
        child.end();
        drop(child);
        let root = OtelSpan::start(
            Destination::Sink(Arc::clone(&sink)),
            &SpanContext::empty_context(),
            Some("ignored=1".into()),
            true,
            "GET".into(),
            SpanKind::Server,
            Vec::new(),
        );
        let root_context = root.span_context().clone();
        drop(root);
        server.set_status(Status::Ok);
        server.set_status(Status::error("after ok"));
        drop(server);
        sink.queue.force_flush().unwrap();

        let spans = kept.0.lock();
        assert_eq!(spans.len(), 3, "each span handed over once");
        let (child, root, server) = (&spans[0], &spans[1], &spans[2]);
        assert_eq!(server.trace_id, trace_id.to_bytes());
        assert_eq!(server.parent_span_id, client.span_id().to_bytes());
        assert_eq!(server.span_id, server_context.span_id().to_bytes());
        assert!(server.parent_is_remote);
        assert_eq!(server.trace_flags, 0x03);
        assert_eq!(server.trace_state.as_deref(), Some("vendor=abc"));
        assert_eq!(server.status, Status::Ok);
        assert_eq!(server.kind, SpanKind::Server);
        assert_eq!(server.attributes, [Attribute::new("a", 1_i64)]);
        assert!(server.start <= server.end);

        assert_eq!(child.trace_id, trace_id.to_bytes());
        assert_eq!(child.parent_span_id, server.span_id);
        assert!(!child.parent_is_remote);
        assert_ne!(child.span_id, server.span_id);
        assert_eq!(child.trace_state.as_deref(), Some("vendor=abc"));
        assert_eq!(child.attributes.len(), MAX_ATTRIBUTES);
        assert_eq!(child.dropped_attributes, 3);
        assert_eq!(child.status, Status::error("first"));
        assert!(child.end <= server.end);

        // A new trace has no parent, and no trace state of one.
        assert!(root_context.is_valid() && root_context.is_sampled());
        assert_ne!(root.trace_id, trace_id.to_bytes());
        assert_eq!(root.parent_span_id, [0; 8]);
        assert_eq!(root.trace_state, None);
        assert!(!root.parent_is_remote);
    }

    /// Ids come from each thread's generator: distinct, never zero.
    #[test]
    fn span_and_trace_ids_are_distinct_and_valid() {
        let (sink, _kept) = kept_sink();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            let span = OtelSpan::start(
                Destination::Sink(Arc::clone(&sink)),
                &SpanContext::empty_context(),
                None,
                false,
                "x".into(),
                SpanKind::Internal,
                Vec::new(),
            );
            let context = span.span_context();
            assert!(context.is_valid());
            assert!(seen.insert(context.span_id()), "a span id came twice");
        }
    }

    #[test]
    fn traceparent_is_w3c_hex_and_tracestate_follows_the_context() {
        let trace_id = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
        let span_id = SpanId::from_hex("00f067aa0ba902b7").unwrap();
        let state: TraceState = "vendor=abc".parse().unwrap();
        let context = SpanContext::new(trace_id, span_id, TraceFlags::SAMPLED, false, state);
        let mut headers = HeaderMap::new();
        headers.insert("tracestate", http::HeaderValue::from_static("client=1"));
        inject_context(&context, &mut headers);
        assert_eq!(
            headers["traceparent"],
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        assert_eq!(headers["tracestate"], "vendor=abc");
        // The propagator reads back what was written.
        let read = TraceContextPropagator::new().extract(&HeaderExtractor(&headers));
        assert_eq!(read.span().span_context().trace_id(), trace_id);
        assert_eq!(read.span().span_context().span_id(), span_id);

        // No state: a client's tracestate does not go on under our span.
        let bare = SpanContext::new(
            trace_id,
            span_id,
            TraceFlags::default(),
            false,
            TraceState::default(),
        );
        inject_context(&bare, &mut headers);
        assert_eq!(
            headers["traceparent"],
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
        );
        assert!(headers.get("tracestate").is_none());
    }
}
