//! Steps 5 to 7 of the [module docs](super) for one regular request: its
//! attempts, as worker-lifecycle's one attempt loop
//! ([`run_attempts`](worker_lifecycle::run_attempts)) drives them. Each
//! attempt selects and reserves a worker and forwards the body; a connect
//! error or a retryable status becomes a [`Failure`] that
//! [`Regular::retry`](worker_lifecycle::Attempts::retry) either retries
//! (releasing the failed attempt's guard and body first) or turns into the
//! client's answer.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use lb_policies::RequestContext;
use tokio::time::Instant;
use worker_lifecycle::{
    Attempted, Attempts, Eligible, LoadGuard, Outcome, RequestRetries, RolePool, Worker,
};

use super::Router;
use super::proxy::{build_upstream, outcome_of};
use crate::client::{UpstreamBody, UpstreamError};
use crate::error::ApiError;
use crate::headers::RequestId;

/// A worker's response the client gets, with the guard that holds the
/// worker's load until the body ends.
pub(super) struct Answered {
    pub(super) response: Response<UpstreamBody>,
    pub(super) guard: LoadGuard,
    /// A 2xx: its breaker outcome is known only when the body ends.
    pub(super) success: bool,
    /// The attempt's span, which ends with the response body.
    #[cfg(feature = "otel")]
    pub(super) span: Option<crate::otel::OtelSpan>,
}

/// An attempt that failed in a way another worker may fix.
pub(super) struct Failure {
    worker: Arc<Worker>,
    cause: Cause,
    /// The attempt's span, which records the retry cause if one follows.
    #[cfg(feature = "otel")]
    span: Option<crate::otel::OtelSpan>,
}

enum Cause {
    /// Nothing usable came back (the guard already recorded it and went).
    Send(UpstreamError),
    /// A retryable status: the client gets this response if no retry is
    /// granted.
    Status {
        response: Box<Response<UpstreamBody>>,
        guard: LoadGuard,
    },
}

/// One regular request's attempts.
pub(super) struct Regular<'a> {
    pub(super) router: &'a Router,
    pub(super) pool: &'a RolePool,
    /// The workers that serve the request's model.
    pub(super) candidates: &'a Eligible<'a>,
    pub(super) context: RequestContext<'a>,
    pub(super) parts: &'a http::request::Parts,
    pub(super) bytes: &'a Bytes,
    pub(super) request_id: &'a RequestId,
    pub(super) deadline: Instant,
    pub(super) retries: RequestRetries<'a>,
    /// Workers that failed this request, left out of later attempts.
    pub(super) failed: Vec<Arc<Worker>>,
    /// The request's trace, when it is traced.
    #[cfg(feature = "otel")]
    pub(super) traced: Option<&'a crate::otel::Traced>,
}

impl Regular<'_> {
    fn timeout(&self) -> Duration {
        self.router.shared.config.request_timeout
    }

    /// Step 5: a worker for attempt `n`, reserved.
    fn reserve(&self) -> Result<LoadGuard, ApiError> {
        // A deadline spent in the router (tokenizing, queueing, backing
        // off) is the router's 504: no worker is reserved or charged.
        crate::error::before_dispatch(self.deadline, self.timeout())?;
        let pool = self.pool;
        // Workers that failed this request are left out, unless that would
        // leave none available (then a failed one may be retried).
        let rest = pool.eligible(self.candidates.workers(), "", |w| {
            !self.failed.iter().any(|f| Arc::ptr_eq(f, w))
        })?;
        let pick = if rest.any_available() {
            rest
        } else {
            self.candidates.clone()
        };
        pool.require_available(&pick)?;
        #[cfg(feature = "otel")]
        let mut decision = self.traced.map(|traced| {
            let policy = pool.policies().policy(self.context.model).ok();
            let name = policy.as_deref().map_or("", lb_policies::PolicyState::name);
            traced.decision_span(name, pick.workers().len())
        });
        let reserved = pool.choose_reserved(&pick, &self.context);
        #[cfg(feature = "otel")]
        if let Some(span) = &mut decision {
            match &reserved {
                Ok(reserved) => crate::otel::record_decision(
                    span,
                    reserved.reason.as_str(),
                    (reserved.match_permille, reserved.matched),
                    reserved.guard.worker().endpoint().worker_url().as_shared(),
                ),
                Err(err) => crate::otel::record_no_decision(span, err),
            }
        }
        let reserved = reserved?;
        if let Some(peers) = &self.router.shared.peers {
            peers.share(
                self.context.model,
                reserved.guard.worker(),
                self.context.routing,
            );
        }
        if let Some(permille) = reserved.match_permille {
            self.router
                .shared
                .metrics
                .match_rate
                .observe(f64::from(permille) / 1000.0);
        }
        Ok(reserved.guard)
    }
}

impl Attempts for Regular<'_> {
    type Answer = Result<Answered, ApiError>;
    type Failure = Failure;
    type Carry = ();

    /// Steps 5 and 6: select, reserve and forward.
    async fn attempt(&mut self, n: u32, (): ()) -> Attempted<Self::Answer, Failure> {
        let shared = &self.router.shared;
        let guard = match self.reserve() {
            Ok(guard) => guard,
            Err(err) => return Attempted::Done(Err(err)),
        };
        let worker = Arc::clone(guard.worker());
        #[cfg(feature = "otel")]
        let mut span = self.traced.map(|traced| {
            traced.attempt_span(
                &self.parts.method,
                worker.endpoint().worker_url().as_shared(),
                n,
            )
        });
        #[cfg(not(feature = "otel"))]
        let _ = n;
        let upstream =
            match build_upstream(self.parts, &worker, self.bytes, self.request_id, shared) {
                Ok(upstream) => upstream,
                Err(err) => {
                    // The router's own failure: nothing reached the worker.
                    guard.record_outcome(Outcome::RouterRejected);
                    return Attempted::Done(Err(err));
                }
            };
        // The worker continues the attempt's trace.
        #[cfg(feature = "otel")]
        let upstream = crate::otel::with_context(span.as_ref(), upstream);
        let sent = shared.client.send_before(upstream, Some(self.deadline));
        #[cfg(feature = "otel")]
        let sent = match &mut span {
            Some(span) => {
                let started = Instant::now();
                let sent = sent.await;
                crate::otel::record_first_byte(span, started);
                sent
            }
            None => sent.await,
        };
        #[cfg(not(feature = "otel"))]
        let sent = sent.await;
        #[cfg(feature = "otel")]
        if let Some(span) = &mut span {
            match &sent {
                Ok(response) => {
                    crate::otel::record_attempt_status(span, response.status().as_u16())
                }
                Err(err) => crate::otel::record_attempt_error(span, err),
            }
        }
        let cause = match sent {
            Err(UpstreamError::Deadline) => {
                // The worker had the request and did not answer in time.
                guard.record_outcome(Outcome::Timeout);
                shared
                    .metrics
                    .record_upstream_failure(&UpstreamError::Deadline);
                return Attempted::Done(Err(ApiError::RequestTimeout {
                    phase: "waiting for the worker's response headers",
                    timeout: self.timeout(),
                }));
            }
            Err(UpstreamError::InvalidRequest(reason)) => {
                // The router could not build or send the request: never the
                // worker's failure, never retried.
                guard.record_outcome(Outcome::RouterRejected);
                return Attempted::Done(Err(ApiError::InvalidRequest(format!(
                    "the request cannot be forwarded: {reason}"
                ))));
            }
            Err(err) => {
                guard.record_outcome(outcome_of(&err));
                drop(guard);
                shared.metrics.record_upstream_failure(&err);
                if !err.is_retryable() {
                    return Attempted::Done(Err(answer_of(err)));
                }
                Cause::Send(err)
            }
            Ok(response) => {
                let status = response.status().as_u16();
                if !shared.config.retry.is_retryable_status(status) {
                    #[cfg_attr(not(feature = "otel"), allow(unused_mut))]
                    let mut answer = answered(response, guard);
                    #[cfg(feature = "otel")]
                    {
                        answer.span = span;
                    }
                    return Attempted::Done(Ok(answer));
                }
                Cause::Status {
                    response: Box::new(response),
                    guard,
                }
            }
        };
        Attempted::Failed(Failure {
            worker,
            cause,
            #[cfg(feature = "otel")]
            span,
        })
    }

    /// Step 7: retry within the policy, the budget and the deadline, or
    /// answer with the failure.
    fn retry(&mut self, _n: u32, failure: Failure) -> Result<(Duration, ()), Self::Answer> {
        let Some(backoff) = self.router.grant_retry(&mut self.retries, self.deadline) else {
            return Err(match failure.cause {
                Cause::Send(err) => Err(answer_of(err)),
                Cause::Status { response, guard } => {
                    #[cfg_attr(not(feature = "otel"), allow(unused_mut))]
                    let mut answer = answered(*response, guard);
                    #[cfg(feature = "otel")]
                    {
                        answer.span = failure.span;
                    }
                    Ok(answer)
                }
            });
        };
        let Failure {
            worker,
            cause,
            #[cfg(feature = "otel")]
            mut span,
        } = failure;
        #[cfg(feature = "otel")]
        if let Some(span) = &mut span {
            match &cause {
                Cause::Send(err) => crate::otel::record_retry(span, err),
                Cause::Status { response, .. } => crate::otel::record_retry(
                    span,
                    &format_args!("status {}", response.status().as_u16()),
                ),
            }
        }
        if let Cause::Status { response, guard } = cause {
            guard.record_outcome(Outcome::from_status(response.status().as_u16()));
            // This attempt ends here: its unread body and its guard are
            // dropped together, before the backoff.
            drop(response);
            drop(guard);
        }
        self.failed.push(worker);
        Ok((backoff, ()))
    }

    async fn wait(&mut self, backoff: Duration) -> Result<(), Self::Answer> {
        self.router
            .back_off(backoff, self.deadline)
            .await
            .map_err(Err)
    }
}

/// The client's answer to a send that failed for good.
fn answer_of(err: UpstreamError) -> ApiError {
    match err {
        UpstreamError::HeaderTimeout(_) => ApiError::GatewayTimeout(err.to_string()),
        _ => ApiError::BadGateway(err.to_string()),
    }
}

/// A worker's response handed to the client; a non-2xx records its breaker
/// outcome now (a 2xx's is known when its body ends).
fn answered(response: Response<UpstreamBody>, guard: LoadGuard) -> Answered {
    let success = response.status().is_success();
    if !success {
        guard.record_outcome(Outcome::from_status(response.status().as_u16()));
    }
    Answered {
        response,
        guard,
        success,
        // Set by the attempt that answers, when it is traced.
        #[cfg(feature = "otel")]
        span: None,
    }
}
