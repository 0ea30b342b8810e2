//! Prefill/decode disaggregation over HTTP: the hyper side of
//! `pd-orchestrator`.
//!
//! In P/D mode ([`RouterConfig::pd`](crate::RouterConfig::pd)) the router
//! keeps two pools of workers, one per role. The pools, pair selection, the
//! flow's backend and the whole-request retry loop all live in
//! [`pd_orchestrator::pools`]; this module only plugs HTTP into them:
//!
//! - [`HyperTransport`] sends the legs through the router's pooled
//!   [`UpstreamClient`], each response body failing after the stream idle
//!   timeout;
//! - the Mooncake bootstrap: [`Router::start`](crate::Router::start) (or
//!   [`Router::bootstrap_pd`](crate::Router::bootstrap_pd)) queries every
//!   static prefill worker once, with retries; a discovered prefill worker
//!   is queried in the background when it joins (a prefill worker whose
//!   engine ids are not known is not selected);
//! - the request: the client's body, headers and path become a
//!   `PdCall`, the body's JSON value the one parse the router's extraction
//!   made ([`ParsedBody`]); the decode response body
//!   owns the decode guard (inside `pd-orchestrator`'s `PdBody`) and the
//!   router's admission permit, both released at end of stream, at a body
//!   error, or when the client goes away;
//! - errors, answered once through [`PdError::status`];
//! - the `router_pd_*` series of `/metrics`.
//!
//! # Example
//!
//! ```
//! use router_http::{PdConfig, PdConnector, PdWorkerConfig, Router, RouterConfig};
//!
//! let mut pd = PdConfig::new(PdConnector::Nixl);
//! pd.prefill = vec![PdWorkerConfig::new("http://10.0.0.1:8000")];
//! // The same URL as a decode worker is a second, separate worker.
//! pd.decode = vec![
//!     PdWorkerConfig::new("http://10.0.0.1:8000"),
//!     PdWorkerConfig::new("http://10.0.0.2:8000"),
//! ];
//! let config = RouterConfig { pd: Some(pd), ..RouterConfig::default() };
//! // `Router::start(config).await` also runs the Mooncake bootstrap.
//! let router = Router::new(config)?;
//! let pools = router.pd().expect("P/D mode");
//! assert_eq!(pools.prefill().workers().len(), 1);
//! assert_eq!(pools.decode().workers().len(), 2);
//! assert_eq!(router.all_workers().len(), 3);
//! assert!(router.is_ready(), "an available worker in each role");
//! # Ok::<(), router_http::ConfigError>(())
//! ```

pub use pd_orchestrator::PdConnector;
pub use pd_orchestrator::pools::{
    PdConfig, PdPair, PdPools, PdRolePool, PdScope, PdTarget, PdWorkerConfig,
};
/// Registration labels read from discovered workers (the contract lives in
/// worker-lifecycle, where discovery listeners and pools both see it).
pub use worker_lifecycle::labels;

use crate::body::{BoxError, IdleTimeout};
use crate::client::{UpstreamClient, UpstreamError};
use crate::config::{ConfigError, RouterConfig};
use crate::error::ApiError;
use crate::extract::ParsedBody;
use crate::metrics::RouterMetrics;
use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Response};
use http_body_util::combinators::MapErr;
use http_body_util::{BodyExt, Either, Full, Limited};
use lb_policies::OwnedContext;
use pd_orchestrator::bootstrap::{BootstrapQuery, BootstrapRetry, Sleeper, learn_engine_ids};
use pd_orchestrator::pools::{PdCall, RunError, flow_request_id};
use pd_orchestrator::{
    ForwardHeaders, KvConnector, LegRequest, LegResponse, PdEndpoint, PdError, PdFlow, Transport,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use worker_lifecycle::{RequestRetries, RoleKind, Worker, WorkerRole};

/// Sends P/D legs through the router's pooled [`UpstreamClient`]; each
/// response body fails when it sends nothing for the idle timeout.
#[derive(Debug, Clone)]
pub struct HyperTransport {
    client: UpstreamClient,
    idle: Duration,
    /// Whether the router traces requests: only then does a leg look for
    /// its request's [`TRACED_LEGS`] and build a span.
    #[cfg(feature = "otel")]
    traces: bool,
}

impl HyperTransport {
    /// A transport over `client` whose bodies time out after `idle`
    /// without a frame.
    pub fn new(client: UpstreamClient, idle: Duration) -> Self {
        Self {
            client,
            idle,
            #[cfg(feature = "otel")]
            traces: false,
        }
    }
}

#[cfg(feature = "otel")]
tokio::task_local! {
    /// Set around a traced request's run ([`proxy`]): each of its legs
    /// gets a client span and sends that span's context; a decode leg's
    /// span is parked in it for the response body.
    static TRACED_LEGS: Arc<crate::otel::PdLegs>;
}

/// A leg's response body: hyper's, with the idle timeout.
pub type LegBody = Pin<Box<IdleTimeout<crate::client::UpstreamBody>>>;

impl Transport for HyperTransport {
    type Body = LegBody;
    type Error = UpstreamError;
    type Future = Pin<Box<dyn Future<Output = Result<LegResponse<LegBody>, UpstreamError>> + Send>>;

    fn send(&self, leg: LegRequest) -> Self::Future {
        let client = self.client.clone();
        let idle = self.idle;
        // The leg's span, built here: a child of the request's server
        // span (the request's legs carry its trace while the flow runs,
        // `TRACED_LEGS`). A decode leg also keeps the
        // request's legs, to park its span there at the response head
        // (a concurrent prefill may be polled outside the scope later).
        #[cfg(feature = "otel")]
        let (mut span, park) = if self.traces {
            TRACED_LEGS
                .try_with(|legs| {
                    let span = crate::otel::leg_span(legs, leg.phase.as_str(), &leg.url, &leg.body);
                    let park =
                        (leg.phase == pd_orchestrator::Phase::Decode).then(|| Arc::clone(legs));
                    (Some(span), park)
                })
                .unwrap_or((None, None))
        } else {
            (None, None)
        };
        Box::pin(async move {
            let mut request = Request::post(leg.url.as_str())
                .body(Full::new(leg.body))
                .map_err(|err| UpstreamError::InvalidRequest(err.to_string()))?;
            *request.headers_mut() = leg.headers;
            // The engine continues the leg's trace.
            #[cfg(feature = "otel")]
            let request = crate::otel::with_context(span.as_ref(), request);
            let sent = client.send(request);
            #[cfg(feature = "otel")]
            let sent = match span.take() {
                Some(mut span) => {
                    let started = tokio::time::Instant::now();
                    let sent = sent.await;
                    crate::otel::record_first_byte(&mut span, started);
                    match &sent {
                        Ok(response) => {
                            crate::otel::record_attempt_status(
                                &mut span,
                                response.status().as_u16(),
                            );
                            // The decode body is the client's stream: its
                            // span lasts as long (`proxy` takes it). A
                            // prefill leg's ends here, at its head.
                            if let Some(legs) = &park {
                                legs.park_decode(span);
                            }
                        }
                        Err(err) => crate::otel::record_attempt_error(&mut span, err),
                    }
                    sent
                }
                None => sent.await,
            };
            #[cfg(not(feature = "otel"))]
            let sent = sent.await;
            let response = sent?;
            let (parts, body) = response.into_parts();
            Ok(LegResponse {
                status: parts.status,
                headers: parts.headers,
                body: Box::pin(IdleTimeout::new(body, idle)),
            })
        })
    }

    /// A leg the client could not even build is the router's failure.
    fn is_local_error(error: &UpstreamError) -> bool {
        matches!(error, UpstreamError::InvalidRequest(_))
    }
}

/// `GET` of a Mooncake bootstrap `/query` through the pooled client.
struct HyperBootstrap(UpstreamClient);

/// Largest bootstrap answer read.
const MAX_BOOTSTRAP_BODY: usize = 1 << 20;

impl BootstrapQuery for HyperBootstrap {
    fn get(&self, url: &str) -> impl Future<Output = Result<Vec<u8>, String>> + Send {
        let client = self.0.clone();
        let request = Request::get(url)
            .body(Full::new(Bytes::new()))
            .map_err(|err| err.to_string());
        async move {
            let response = client.send(request?).await.map_err(|err| err.to_string())?;
            let status = response.status();
            if !status.is_success() {
                return Err(format!("status {status}"));
            }
            let body = Limited::new(response.into_body(), MAX_BOOTSTRAP_BODY)
                .collect()
                .await
                .map_err(|err| err.to_string())?;
            Ok(body.to_bytes().to_vec())
        }
    }
}

/// The runtime's timer, for bootstrap and request retries.
struct TokioSleeper;

impl Sleeper for TokioSleeper {
    fn sleep(&self, duration: Duration) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(duration)
    }
}

/// The P/D state of a router: the pools (inside the flow) and the
/// connector.
pub(crate) struct PdState {
    pub(crate) flow: PdFlow<HyperTransport, PdPools>,
    connector: Arc<dyn KvConnector>,
    client: UpstreamClient,
    bootstrap_retry: BootstrapRetry,
}

impl PdState {
    pub(crate) fn new(
        pd: &PdConfig,
        config: &RouterConfig,
        client: &UpstreamClient,
    ) -> Result<Self, ConfigError> {
        let pools = Arc::new(PdPools::new(pd, &config.policy, &config.worker_options)?);
        if pd.connector.is_mooncake() {
            let learner = (Arc::downgrade(&pools), client.clone(), pd.bootstrap_retry);
            pools
                .prefill()
                .on_unlearned(Box::new(move |worker, endpoint| {
                    learn_in_background(&learner, worker, endpoint);
                }));
        }
        #[cfg_attr(not(feature = "otel"), allow(unused_mut))]
        let mut transport = HyperTransport::new(client.clone(), config.stream_idle_timeout);
        #[cfg(feature = "otel")]
        {
            transport.traces = config.trace.enabled;
        }
        Ok(Self {
            flow: PdFlow::new(transport, pools, pd.flow),
            connector: pd.connector.build(),
            client: client.clone(),
            bootstrap_retry: pd.bootstrap_retry,
        })
    }

    pub(crate) fn pools(&self) -> &Arc<PdPools> {
        self.flow.backend()
    }

    /// Learns the Mooncake engine ids of every static prefill worker that
    /// does not have them yet (a no-op for other connectors).
    pub(crate) async fn bootstrap(&self) -> Result<(), ConfigError> {
        let pools = self.pools();
        if !pools.connector().is_mooncake() {
            return Ok(());
        }
        let query = HyperBootstrap(self.client.clone());
        for worker in pools.prefill().workers().iter() {
            let Some(endpoint) = pools.prefill().endpoint(worker) else {
                continue;
            };
            if endpoint.mooncake().is_some() {
                continue;
            }
            let port = bootstrap_port(worker);
            let retry = &self.bootstrap_retry;
            let learned = learn_engine_ids(&query, &TokioSleeper, &endpoint, port, retry).await?;
            tracing::info!(
                prefill = worker.url(),
                bootstrap = learned.bootstrap_addr,
                ranks = learned.engine_ids.len(),
                "learned Mooncake engine ids"
            );
            pools.prefill().set_learned(worker, learned);
        }
        Ok(())
    }

    /// Adds a static worker at run time (the admin route): a Mooncake
    /// prefill worker's engine ids are learned first, so it joins its role
    /// already selectable.
    pub(crate) async fn add_worker(
        &self,
        role: RoleKind,
        spec: &PdWorkerConfig,
    ) -> Result<Arc<Worker>, ConfigError> {
        let role = self.pools().role(role);
        let mut worker = role.build_static(spec)?;
        if self.pools().connector().is_mooncake() && role.role() == RoleKind::Prefill {
            let query = HyperBootstrap(self.client.clone());
            let (endpoint, port) = (worker.endpoint(), worker.bootstrap_port());
            let retry = &self.bootstrap_retry;
            let learned = learn_engine_ids(&query, &TokioSleeper, endpoint, port, retry).await?;
            worker = worker.with_mooncake(learned);
        }
        Ok(role.add_static(worker)?)
    }

    pub(crate) fn render(&self, exposition: &mut prom_text::Exposition<'_>) {
        crate::metrics::render_pd(self.pools(), self.flow.stats().snapshot(), exposition);
    }
}

fn bootstrap_port(worker: &Worker) -> Option<u16> {
    match worker.role() {
        WorkerRole::Prefill { bootstrap_port } => bootstrap_port,
        _ => None,
    }
}

/// Queries a newly discovered Mooncake prefill worker's bootstrap server
/// off the request path; the worker becomes selectable once its engine ids
/// are known. Spawning does not block, so this may run under the pool's
/// lock.
fn learn_in_background(
    (pools, client, retry): &(std::sync::Weak<PdPools>, UpstreamClient, BootstrapRetry),
    worker: &Arc<Worker>,
    endpoint: &Arc<PdEndpoint>,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::warn!(
            prefill = worker.key(),
            "no runtime to query the Mooncake bootstrap server of a discovered prefill worker"
        );
        return;
    };
    let (pools, query, retry) = (pools.clone(), HyperBootstrap(client.clone()), *retry);
    let (worker, endpoint) = (Arc::clone(worker), Arc::clone(endpoint));
    runtime.spawn(async move {
        let port = bootstrap_port(&worker);
        match learn_engine_ids(&query, &TokioSleeper, &endpoint, port, &retry).await {
            Ok(learned) => {
                if let Some(pools) = pools.upgrade() {
                    pools.prefill().set_learned(&worker, learned);
                }
            }
            Err(err) => tracing::error!(
                prefill = worker.key(),
                %err,
                "discovered Mooncake prefill worker stays unselectable"
            ),
        }
    });
}

/// Headers forwarded to both legs besides the ones the flow sets.
const FORWARDED: [&str; 3] = ["traceparent", "tracestate", "baggage"];

/// Everything one two-phase request brings from the router's path.
pub(crate) struct PdArrival {
    pub(crate) parts: http::request::Parts,
    pub(crate) bytes: Bytes,
    /// The body's one parse, which routing and tokenizing read; its value
    /// becomes the legs.
    pub(crate) parsed: ParsedBody,
    pub(crate) request: OwnedContext,
    /// The client's request id, the prefix of the flow's id.
    pub(crate) client_id: HeaderValue,
    pub(crate) deadline: tokio::time::Instant,
    /// The request's trace, when it is traced: then each leg gets a span
    /// of its own and carries its context instead of the client's.
    #[cfg(feature = "otel")]
    pub(crate) traced: Option<crate::otel::Traced>,
}

/// A two-phase answer's body: the decode stream, or an engine's own
/// rejection passed through.
pub(crate) type PdReply = Either<IdleTimeout<DecodeBody>, Full<Bytes>>;

/// What [`proxy`] answers: the response, and the span of the decode leg
/// that produced it, which the response body ends.
pub(crate) struct PdAnswer {
    pub(crate) response: Response<PdReply>,
    /// The answering decode leg's span (traced requests with a decode
    /// answer only).
    #[cfg(feature = "otel")]
    pub(crate) decode_span: Option<crate::otel::OtelSpan>,
}

impl PdAnswer {
    /// An answer without a decode span to hand on.
    fn new(response: Response<PdReply>) -> Self {
        Self {
            response,
            #[cfg(feature = "otel")]
            decode_span: None,
        }
    }
}

/// The decode body with its boxed errors made concrete for the timeout
/// wrapper.
type DecodeBody = MapErr<pd_orchestrator::PdBody<LegBody, PdPools>, fn(BoxError) -> std::io::Error>;

/// Runs one two-phase request through `pd-orchestrator`'s retry loop
/// within its deadline (`timeout` names it in the error), counting retries
/// in `metrics`. The caller adds the request id and makes the body own the
/// admission permit.
pub(crate) async fn proxy(
    pd: &PdState,
    arrival: PdArrival,
    mut retries: RequestRetries<'_>,
    metrics: &RouterMetrics,
    timeout: Duration,
) -> Result<PdAnswer, ApiError> {
    let PdArrival {
        parts,
        bytes,
        parsed,
        mut request,
        client_id,
        deadline,
        #[cfg(feature = "otel")]
        traced,
    } = arrival;
    // Answered here, as before the parse was shared: a body that is not
    // a JSON value (nesting past serde_json's limit in a field routing
    // skips) got through extraction and is refused now.
    let parsed = parsed.into_value()?;
    // A deadline spent in the router (tokenizing, parsing, queueing) is
    // the router's: no prefill or decode worker is selected or charged.
    crate::error::before_dispatch(deadline, timeout)?;
    let flow_id = flow_request_id(client_id.as_bytes());
    request.request_id = Some(flow_id.clone());
    let mut forward = ForwardHeaders::new();
    if let Some(auth) = parts.headers.get(header::AUTHORIZATION) {
        forward = forward.with_authorization(auth.clone());
    }
    // The server span's context; each leg replaces it with its own
    // span's (`HyperTransport::send`).
    #[cfg(feature = "otel")]
    let context = traced
        .as_ref()
        .map(|traced| {
            let mut context = http::HeaderMap::new();
            crate::otel::inject_context(&traced.server_context(), &mut context);
            context
        })
        .filter(|context| !context.is_empty());
    #[cfg(feature = "otel")]
    for (name, value) in context.iter().flatten() {
        forward = forward.with_header(name.clone(), value.clone());
    }
    for name in FORWARDED {
        #[cfg(feature = "otel")]
        if context.as_ref().is_some_and(|c| c.contains_key(name)) {
            continue;
        }
        if let Some(value) = parts.headers.get(name) {
            forward = forward.with_header(HeaderName::from_static(name), value.clone());
        }
    }
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());
    let scope = Arc::new(PdScope::new(request));
    #[cfg(feature = "otel")]
    let legs = traced.map(|traced| {
        // The roles' policies for the model, named on decision spans.
        let model = scope.request().model.as_str();
        let name = |role: &pd_orchestrator::pools::PdRolePool| {
            let policy = role.policies().policy(model).ok();
            policy
                .as_deref()
                .map_or("", lb_policies::PolicyState::name)
                .to_owned()
        };
        Arc::new(crate::otel::PdLegs::new(
            traced,
            pd.pools().connector().as_str(),
            path.clone(),
            (name(pd.pools().prefill()), name(pd.pools().decode())),
            Arc::clone(&scope),
        ))
    });
    let call = PdCall {
        path,
        body: bytes,
        parsed: Some(parsed),
        request_id: flow_id.clone(),
        forward,
        scope,
    };
    let observer = PdObserver {
        flow_id: &flow_id,
        metrics,
        #[cfg(feature = "otel")]
        traced: legs.as_deref(),
    };
    let run = pd_orchestrator::pools::run_observed(
        &pd.flow,
        &*pd.connector,
        call,
        &mut retries,
        &TokioSleeper,
        observer,
    );
    #[cfg(feature = "otel")]
    let outcome = match &legs {
        Some(traced) => {
            let run = TRACED_LEGS.scope(Arc::clone(traced), run);
            tokio::time::timeout_at(deadline, run).await
        }
        None => tokio::time::timeout_at(deadline, run).await,
    };
    #[cfg(not(feature = "otel"))]
    let outcome = tokio::time::timeout_at(deadline, run).await;
    // One branch when untraced.
    #[cfg(feature = "otel")]
    let decode_span = match &legs {
        Some(legs) => settle_decode(legs, &outcome),
        None => None,
    };
    let response = match outcome {
        Err(_elapsed) => {
            return Err(ApiError::RequestTimeout {
                phase: "before the decode response headers (prefill/decode)",
                timeout,
            });
        }
        Ok(Err(RunError::Select(err))) => return Err(err.into()),
        Ok(Err(RunError::Flow(error))) => {
            tracing::warn!(request_id = flow_id, %error, "prefill/decode request failed");
            return pd_error(error).map(|rejected| PdAnswer::new(rejected.map(Either::Right)));
        }
        Ok(Ok(response)) => response,
    };
    let to_io: fn(BoxError) -> std::io::Error = std::io::Error::other;
    let body = decode_stream(response.body.map_err(to_io), deadline);
    let mut out = Response::new(Either::Left(body));
    *out.status_mut() = response.status;
    *out.headers_mut() = response.headers;
    #[cfg_attr(not(feature = "otel"), allow(unused_mut))]
    let mut answer = PdAnswer::new(out);
    #[cfg(feature = "otel")]
    {
        answer.decode_span = decode_span;
    }
    Ok(answer)
}

/// What [`proxy`] does as a request's attempts run: each retried error is
/// logged and counted (and a traced attempt's answered decode leg ends);
/// a traced request's selections each get a `route` span, which names the
/// pair the role policies chose.
struct PdObserver<'a> {
    flow_id: &'a str,
    metrics: &'a RouterMetrics,
    /// A traced request's legs.
    #[cfg(feature = "otel")]
    traced: Option<&'a crate::otel::PdLegs>,
}

impl pd_orchestrator::pools::RunObserver for PdObserver<'_> {
    #[cfg(feature = "otel")]
    type Selection = Option<crate::otel::OtelSpan>;
    #[cfg(not(feature = "otel"))]
    type Selection = ();

    fn selecting(&mut self, _: u32) -> Self::Selection {
        #[cfg(feature = "otel")]
        return self.traced.map(crate::otel::PdLegs::pair_decision_span);
    }

    fn selected(
        &mut self,
        selection: Self::Selection,
        outcome: Result<pd_orchestrator::pools::Selected<'_>, &worker_lifecycle::SelectError>,
    ) {
        #[cfg(feature = "otel")]
        if let Some(mut span) = selection {
            crate::otel::record_pair(&mut span, outcome);
        }
        #[cfg(not(feature = "otel"))]
        let ((), _) = (selection, outcome);
    }

    fn retrying(&mut self, error: &PdError) {
        tracing::warn!(request_id = self.flow_id, %error, "prefill/decode attempt failed; retrying");
        self.metrics.retries.inc();
        // The failed attempt's decode leg, if it answered, ends now.
        #[cfg(feature = "otel")]
        if let Some(legs) = self.traced {
            end_decode(legs, matches!(error, PdError::DecodeBodyFailed { .. }));
        }
    }
}

/// The answering decode leg's span, for the response body to end; when
/// the run failed, the span its last attempt parked ends now instead
/// (marked failed when the deadline or a broken body cut the decode body
/// it was reading).
#[cfg(feature = "otel")]
fn settle_decode<T>(
    legs: &crate::otel::PdLegs,
    outcome: &Result<Result<T, RunError>, tokio::time::error::Elapsed>,
) -> Option<crate::otel::OtelSpan> {
    match outcome {
        Ok(Ok(_)) => return legs.take_decode(),
        Err(_elapsed) => end_decode(legs, true),
        Ok(Err(error)) => end_decode(
            legs,
            matches!(error, RunError::Flow(PdError::DecodeBodyFailed { .. })),
        ),
    }
    None
}

/// Ends now the decode leg span that `legs` parked for an attempt that
/// failed, marking it when its body failed after the head (`body_failed`).
#[cfg(feature = "otel")]
fn end_decode(legs: &crate::otel::PdLegs, body_failed: bool) {
    let Some(mut span) = legs.take_decode() else {
        return;
    };
    if body_failed {
        crate::otel::record_body_end(&mut span, crate::body::BodyEnd::Failed);
    }
    // Otherwise it ends here, dropped.
}

/// The decode stream as the client receives it: the whole-request deadline
/// only, because the decode leg's body already fails after the idle timeout
/// (`HyperTransport`), and a second idle timer would race the first.
fn decode_stream<B>(body: B, deadline: tokio::time::Instant) -> IdleTimeout<B> {
    IdleTimeout::deadline_only(body, deadline)
}

/// A flow error as the client sees it: an engine's own rejection passes
/// through with its status and body; everything else is the router's error
/// with the status of the one mapping, [`PdError::status`].
fn pd_error(error: PdError) -> Result<Response<Full<Bytes>>, ApiError> {
    match error {
        PdError::PrefillRejected { status, body }
        | PdError::DecodeRejected { status, body, .. } => {
            let mut response = Response::new(Full::new(body));
            *response.status_mut() = status;
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            Ok(response)
        }
        other => Err(ApiError::PrefillDecode {
            status: other.status(),
            message: match other {
                PdError::NoDecodeWorker => "no decode worker is available (the decode pool \
                                            emptied while the prefill ran)"
                    .to_owned(),
                other => other.to_string(),
            },
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    #[test]
    fn flow_errors_answer_with_the_status_pd_orchestrator_gives_them() {
        let worker = || "decode http://d:8000 #1".to_owned();
        let errors = [
            PdError::InvalidBody,
            PdError::InvalidRequestId("bad id".into()),
            PdError::DecodeNeededAtStart,
            PdError::NoDecodeWorker,
            PdError::PrefillFailed {
                attempts: 2,
                last: "reset".into(),
                worker: worker(),
            },
            PdError::DecodeFailed {
                reason: "refused".into(),
                worker: worker(),
            },
            PdError::DecodeBodyFailed {
                reason: "cut".into(),
                worker: worker(),
            },
            PdError::Connector(pd_orchestrator::ConnectorError::MissingMooncakeBootstrap {
                url: "http://p".into(),
            }),
            PdError::DecodeRejected {
                status: StatusCode::TOO_MANY_REQUESTS,
                body: Bytes::from_static(b"{}"),
                worker: worker(),
            },
        ];
        for error in errors {
            let expected = error.status();
            let answered = match pd_error(error.clone()) {
                Ok(response) => response.status(),
                Err(api) => api.status(),
            };
            assert_eq!(answered, expected, "{error:?}");
        }
        // The request-id error is the router's own bug: 500, not 502.
        let api = pd_error(PdError::InvalidRequestId("x".into())).unwrap_err();
        assert_eq!(api.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(api.code(), "internal_error");
    }

    #[tokio::test]
    async fn a_decode_stream_gets_one_idle_timer_from_its_leg_only() {
        let transport = HyperTransport::new(UpstreamClient::default(), Duration::from_secs(7));
        assert_eq!(
            transport.idle,
            Duration::from_secs(7),
            "the leg's idle limit"
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let stream = decode_stream(Full::new(Bytes::new()), deadline);
        assert_eq!(
            stream.idle_limit(),
            None,
            "no second idle timer around the leg"
        );
    }
}
