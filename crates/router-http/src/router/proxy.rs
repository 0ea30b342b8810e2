//! The proxy path of one request (steps 3 to 8 of the [module
//! docs](super)): admission, the body, selection, forwarding with retries,
//! and the response whose body holds what the request holds.

use super::attempt::Regular;
use super::{Router, Shared};
use crate::body::{BodyEnd, BoxBody, BoxError, Finish, GuardedBody, IdleTimeout};
use crate::client::UpstreamError;
use crate::error::ApiError;
use crate::extract::ApiKind;
use crate::headers::{RequestId, strip_hop_by_hop};
use crate::limits::AdmissionPermit;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, Uri};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use lb_policies::OwnedContext;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::time::Instant;
use worker_lifecycle::{LoadGuard, Outcome, RequestRetries, Worker, run_attempts};

impl Router {
    pub(crate) async fn proxy<B>(
        &self,
        kind: ApiKind,
        request: Request<B>,
        started: Instant,
        // Spans of the decision and the attempts go under the server span
        // (`Router::handle`), only when this request is traced.
        #[cfg_attr(not(feature = "otel"), allow(unused_variables))] traced: super::RequestTrace,
    ) -> Result<Response<BoxBody>, ApiError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let shared = &self.shared;
        if !self.is_accepting() {
            return Err(ApiError::ShuttingDown);
        }
        if let Some(rate) = &shared.rate {
            rate.try_acquire()?;
        }
        let timeout = shared.config.request_timeout;
        let deadline = started + timeout;
        // The whole-request deadline bounds every phase: the queue, the
        // client's body, connect and the worker's response head (below),
        // and the response body (in the body wrapper).
        let admit = tokio::time::timeout_at(deadline, shared.limiter.admit());
        #[cfg(feature = "otel")]
        let admit = crate::otel::phase(traced.as_ref(), "admission", admit);
        let permit = admit.await.map_err(|_elapsed| ApiError::RequestTimeout {
            phase: "waiting for admission",
            timeout,
        })??;
        let (parts, body) = request.into_parts();
        let body_timeout = shared.config.request_body_timeout.min(timeout);
        let body_deadline = deadline.min(Instant::now() + shared.config.request_body_timeout);
        let read = tokio::time::timeout_at(
            body_deadline,
            crate::payload::read_limited(body, &parts.headers, shared.config.max_payload_size),
        );
        #[cfg(feature = "otel")]
        let read = crate::otel::phase(traced.as_ref(), "read body", read);
        let bytes = read
            .await
            .map_err(|_elapsed| ApiError::RequestBodyTimeout(body_timeout))??;
        #[cfg(feature = "otel")]
        let extract_span = traced.as_ref().map(crate::otel::Traced::extract_span);
        // A P/D request's legs are its body rewritten as a JSON value: its
        // one parse is into that value, which routing and tokenizing read
        // too. Any other request's is into borrowed views.
        let two_phase = shared.pd.is_some()
            && matches!(
                kind,
                ApiKind::ChatCompletions | ApiKind::Completions | ApiKind::Generate
            );
        // Off the runtime for large bodies, bounded by the deadline and
        // cancelled if this future is dropped (the client went away).
        #[cfg(feature = "tokens")]
        let (info, parsed) = {
            let tokenizers = &shared.config.tokenizers;
            if two_phase {
                let (info, parsed) = tokenizers
                    .extract_parsed_bounded(kind, &bytes, deadline, timeout)
                    .await?;
                (info, Some(parsed))
            } else {
                let info = tokenizers
                    .extract_bounded(kind, &bytes, deadline, timeout)
                    .await?;
                (info, None)
            }
        };
        #[cfg(not(feature = "tokens"))]
        let (info, parsed) = if two_phase {
            let (info, parsed) = crate::extract_parsed(kind, &bytes)?;
            (info, Some(parsed))
        } else {
            (crate::extract(kind, &bytes)?, None)
        };
        // The extraction's span ends here (it is not entered: the work
        // may run on the tokenizer pool).
        #[cfg(feature = "otel")]
        if let Some(mut span) = extract_span {
            crate::otel::record_routing_input(&mut span, &info);
        }
        let model = info.model.unwrap_or_default();
        if model.len() > crate::MAX_MODEL_BYTES {
            return Err(ApiError::InvalidRequest(format!(
                "`model` is {} bytes long; at most {} are accepted",
                model.len(),
                crate::MAX_MODEL_BYTES
            )));
        }
        let routing = info.routing;
        let request_id = shared.ids.resolve(&parts.headers);
        #[cfg(feature = "otel")]
        if let Some(traced) = &traced {
            traced.record_request(&model, &request_id.value);
        }

        let session = parts
            .headers
            .get(&shared.session_header)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let request = OwnedContext {
            model,
            routing,
            session,
            user: info.user,
            header: None,
            request_id: request_id.value.to_str().ok().map(str::to_owned),
        };
        let retries = shared.retries(std::time::Instant::now());
        if let (Some(pd), Some(parsed)) = (&shared.pd, parsed) {
            let arrival = crate::pd::PdArrival {
                parts,
                bytes,
                parsed,
                request,
                client_id: request_id.value.clone(),
                deadline,
                #[cfg(feature = "otel")]
                traced,
            };
            let timeout = shared.config.request_timeout;
            let answer = crate::pd::proxy(pd, arrival, retries, &shared.metrics, timeout).await?;
            // The decode guard lives inside the body (pd-orchestrator's
            // `PdBody`); the permit and the decode leg's span go with it.
            #[cfg_attr(not(feature = "otel"), allow(unused_mut))]
            let mut in_flight = InFlight::new(None, permit, shared, false);
            #[cfg(feature = "otel")]
            {
                in_flight.span = answer.decode_span;
            }
            return Ok(respond(answer.response, in_flight, request_id));
        }
        // In P/D mode the other routes (models, embeddings...) go to the
        // decode workers, chosen by the decode policy.
        let pool = match self.pd() {
            Some(pd) => pd.decode().pool(),
            None => &shared.pool,
        };
        let all = pool.refresh()?;
        let candidates = pool.eligible(&all, &request.model, |_| true)?;
        let mut attempts = Regular {
            router: self,
            pool,
            candidates: &candidates,
            context: request.context(),
            parts: &parts,
            bytes: &bytes,
            request_id: &request_id,
            deadline,
            retries,
            failed: Vec::new(),
            #[cfg(feature = "otel")]
            traced: traced.as_ref(),
        };
        let answered = run_attempts(&mut attempts, ()).await?;
        let idle = shared.config.stream_idle_timeout;
        let response = answered
            .response
            .map(|body| IdleTimeout::with_deadline(body, idle, deadline));
        #[cfg_attr(not(feature = "otel"), allow(unused_mut))]
        let mut in_flight = InFlight::new(Some(answered.guard), permit, shared, answered.success);
        #[cfg(feature = "otel")]
        {
            in_flight.span = answered.span;
        }
        Ok(respond(response, in_flight, request_id))
    }

    /// One more retry of this request, if the policy, the shared budget
    /// and `deadline` allow it: the backoff to wait before it.
    pub(super) fn grant_retry(
        &self,
        retries: &mut RequestRetries<'_>,
        deadline: Instant,
    ) -> Option<std::time::Duration> {
        if Instant::now() >= deadline {
            return None;
        }
        let backoff = retries.next(std::time::Instant::now())?;
        self.shared.metrics.retries.inc();
        Some(backoff)
    }

    /// Sleeps `backoff`, never past `deadline`; a deadline reached while
    /// backing off ends the request.
    pub(super) async fn back_off(
        &self,
        backoff: std::time::Duration,
        deadline: Instant,
    ) -> Result<(), ApiError> {
        tokio::time::sleep_until((Instant::now() + backoff).min(deadline)).await;
        if Instant::now() >= deadline {
            return Err(ApiError::RequestTimeout {
                phase: "before a retry could be sent",
                timeout: self.shared.config.request_timeout,
            });
        }
        Ok(())
    }
}

impl Shared {
    /// The retries of one request arriving at `now`, counted in the
    /// router's budget (both modes).
    fn retries(&self, now: std::time::Instant) -> RequestRetries<'_> {
        let seed = self.jitter_seed.fetch_add(1, Ordering::Relaxed);
        RequestRetries::start(&self.config.retry, &self.retry_budget, seed, now)
    }
}

/// The response handed to the client in both modes: the worker's status,
/// headers and body, with hop-by-hop headers removed, the request id added,
/// and the body owning what the request holds.
fn respond<B>(
    response: Response<B>,
    in_flight: InFlight,
    request_id: RequestId,
) -> Response<BoxBody>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.insert(request_id.header, request_id.value);
    let body = GuardedBody::new(body, in_flight)
        .map_err(|err| -> BoxError { err.into() })
        .boxed_unsync();
    Response::from_parts(parts, body)
}

/// What one admitted request holds while its response body runs: the
/// admission permit, and the worker's guard when the router proxied to one
/// worker (a P/D response's decode guard lives inside its body).
struct InFlight {
    guard: Option<LoadGuard>,
    _permit: AdmissionPermit,
    shared: Arc<Shared>,
    /// A 2xx response's breaker outcome is known only when its body ends.
    outcome_pending: bool,
    /// The span of the attempt (or decode leg) whose body this is: it ends
    /// with the body, as the load does. `None` when untraced, so tracing
    /// off adds nothing here but the empty field.
    #[cfg(feature = "otel")]
    span: Option<crate::otel::OtelSpan>,
}

impl InFlight {
    fn new(
        guard: Option<LoadGuard>,
        permit: AdmissionPermit,
        shared: &Arc<Shared>,
        outcome_pending: bool,
    ) -> Self {
        Self {
            guard,
            _permit: permit,
            shared: Arc::clone(shared),
            outcome_pending,
            #[cfg(feature = "otel")]
            span: None,
        }
    }
}

impl Finish for InFlight {
    #[cfg_attr(not(feature = "otel"), allow(unused_mut))]
    fn finish(mut self, end: BodyEnd) {
        let metrics = &self.shared.metrics;
        match end {
            BodyEnd::Complete => metrics.bodies_completed.inc(),
            BodyEnd::Failed => metrics.bodies_failed.inc(),
            BodyEnd::Dropped => metrics.bodies_dropped.inc(),
        }
        let outcome = match end {
            BodyEnd::Complete => Outcome::Success,
            BodyEnd::Failed => Outcome::ConnectionReset,
            BodyEnd::Dropped => Outcome::ClientCancelled,
        };
        if let Some(guard) = &self.guard
            && (self.outcome_pending || end == BodyEnd::Failed)
        {
            guard.record_outcome(outcome);
        }
        #[cfg(feature = "otel")]
        if let Some(span) = &mut self.span {
            crate::otel::record_body_end(span, end);
        }
        // The guard, the permit and the span are released here, by being
        // dropped.
    }
}

pub(super) fn build_upstream(
    parts: &http::request::Parts,
    worker: &Worker,
    body: &Bytes,
    request_id: &RequestId,
    shared: &Shared,
) -> Result<Request<Full<Bytes>>, ApiError> {
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", http::uri::PathAndQuery::as_str);
    // `Route::of` admits only targets that are paths ("/..."), so the
    // worker's base URL and the path make one absolute URL.
    if !path.starts_with('/') {
        return Err(ApiError::InvalidRequest(format!(
            "the request target {path:?} is not a path"
        )));
    }
    let uri: Uri = worker
        .endpoint()
        .worker_url()
        .url_for(path)
        .parse()
        .map_err(|err| ApiError::InvalidRequest(format!("cannot forward {path:?}: {err}")))?;
    let mut request = Request::new(Full::new(body.clone()));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = uri;
    let headers = request.headers_mut();
    headers.clone_from(&parts.headers);
    strip_hop_by_hop(headers);
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(request_id.header.clone(), request_id.value.clone());
    // The router decides the rank; a client-sent value is overridden.
    headers.remove(&shared.dp_rank_header);
    if let Some(rank) = worker.dp_rank() {
        headers.insert(shared.dp_rank_header.clone(), HeaderValue::from(rank));
    }
    Ok(request)
}

/// The breaker outcome of a failed send. Only failures the worker caused
/// count against it; a request the router could not build is its own.
pub(super) fn outcome_of(err: &UpstreamError) -> Outcome {
    match err {
        UpstreamError::Connect(_) => Outcome::ConnectError,
        UpstreamError::HeaderTimeout(_) | UpstreamError::Deadline => Outcome::Timeout,
        UpstreamError::InvalidRequest(_) => Outcome::RouterRejected,
        _ => Outcome::ConnectionReset,
    }
}
