//! The seams of the two-phase flow: the transport that sends one leg, and
//! the backend that owns workers, load guards and breaker outcomes.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

use crate::endpoint::PdEndpoint;

/// The boxed error type of [`crate::PdBody`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Which half of a disaggregated request a leg, a guard or an outcome
/// belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Prompt processing; produces the KV cache.
    Prefill,
    /// Token generation from the transferred KV cache.
    Decode,
}

impl Phase {
    /// `"prefill"` or `"decode"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One leg as the transport sends it: `POST {url}` with these headers and
/// this JSON body.
#[derive(Debug, Clone)]
pub struct LegRequest {
    /// Which phase this leg runs.
    pub phase: Phase,
    /// Full URL: the endpoint's base URL plus the client's path.
    pub url: String,
    /// Headers to send (content type, request id, DP rank, forwarded auth).
    pub headers: HeaderMap,
    /// The serialized JSON body.
    pub body: Bytes,
}

/// The head of an engine's response and its body, still streaming.
#[derive(Debug)]
pub struct LegResponse<B> {
    /// Response status.
    pub status: StatusCode,
    /// Response headers.
    pub headers: HeaderMap,
    /// Response body.
    pub body: B,
}

/// Sends one leg to an engine.
///
/// The returned future is `'static`: a concurrent flow keeps the prefill
/// leg running inside the decode response body after the flow returned.
/// Dropping the future (or the body) must abort the HTTP exchange.
pub trait Transport: Send + Sync {
    /// The response body type.
    type Body: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static;
    /// Why a leg could not be sent or its response head not read.
    type Error: fmt::Display + Send + 'static;
    /// The in-flight leg.
    type Future: Future<Output = Result<LegResponse<Self::Body>, Self::Error>> + Send + 'static;

    /// Starts sending `leg`.
    fn send(&self, leg: LegRequest) -> Self::Future;

    /// Whether `error` is the caller's own: the leg could not even be
    /// built or handed to the network (an invalid URL or header), so no
    /// worker saw it. Such a leg finishes as [`LegOutcome::NotSent`] (no
    /// breaker counts it) and the request fails at once with
    /// [`PdError::LegNotSent`](crate::PdError::LegNotSent) rather than
    /// trying another worker. Default: every error is the worker's.
    fn is_local_error(error: &Self::Error) -> bool {
        let _ = error;
        false
    }
}

/// A worker as the flow sees it: something with an [`PdEndpoint`].
pub trait PdWorker {
    /// How to address this worker.
    fn endpoint(&self) -> &PdEndpoint;

    /// The name errors give this worker, so a caller can leave it out of
    /// its next selection: a pool's worker key (unique per registration
    /// lifetime) when it has one; the endpoint's base URL by default.
    fn id(&self) -> &str {
        self.endpoint().base_url()
    }
}

impl<W: PdWorker + ?Sized> PdWorker for Arc<W> {
    fn endpoint(&self) -> &PdEndpoint {
        (**self).endpoint()
    }

    fn id(&self) -> &str {
        (**self).id()
    }
}

impl PdWorker for PdEndpoint {
    fn endpoint(&self) -> &PdEndpoint {
        self
    }
}

/// How one leg ended, for circuit breakers and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LegOutcome {
    /// The leg completed with a 2xx and its body was read to the end.
    Success,
    /// The worker failed: transport error, 5xx, 408/429, body error,
    /// unusable prefill response. Counts against its breaker.
    WorkerFailure,
    /// The engine rejected the request itself (4xx): not the worker's fault.
    ClientError,
    /// The leg was abandoned before it ended: the client went away, or the
    /// other phase failed and this one was aborted. Not the worker's fault.
    Cancelled,
    /// The leg was never sent: the caller could not build or send it
    /// ([`Transport::is_local_error`]). Not the worker's fault.
    NotSent,
}

/// A reservation of one phase's load on one worker, that records how the
/// leg ended and then releases the load.
///
/// [`finish`](Self::finish) is called exactly once per reservation the flow
/// made: with the leg's outcome when it ended, or [`LegOutcome::Cancelled`]
/// when the flow future or the body holding it was dropped. Recording
/// before releasing lets a half-open circuit breaker see its probe's result
/// while the probe still holds its slot.
pub trait PhaseGuard: Send + 'static {
    /// Records `outcome` (with the response `status` when a response head
    /// arrived: `None` means the leg failed or was abandoned before that, so
    /// a breaker can tell a connect failure from a 5xx, or a body cut
    /// mid-stream — `WorkerFailure` with a 2xx status), then releases.
    fn finish(self, outcome: LegOutcome, status: Option<StatusCode>);
}

/// A backend that counts nothing.
impl PhaseGuard for () {
    fn finish(self, _outcome: LegOutcome, _status: Option<StatusCode>) {}
}

/// Why [`PdBackend::reserve`] refused: the worker cannot take the leg now
/// (its breaker refuses, it is draining or gone). Nothing was counted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// The caller's side of the flow: reservations per phase, a fresh prefill
/// worker for a retry, and the decode worker of a late choice.
///
/// This is the seam where a router plugs in its worker pools: `Guard` is
/// its load reservation, which records each leg's outcome (circuit
/// breakers, metrics) and releases; `reselect_prefill` asks the prefill
/// policy again.
pub trait PdBackend: Send + Sync + 'static {
    /// A selected worker (usually an `Arc` of the pool's worker object).
    type Worker: PdWorker + Clone + Send + Sync + 'static;
    /// A reservation of one phase on one worker; see [`PhaseGuard`].
    type Guard: PhaseGuard;

    /// Counts `phase` load on `worker` until the returned guard finishes,
    /// when the worker's breaker admits it. Called right before the leg is
    /// dispatched.
    ///
    /// # Errors
    /// [`Refused`] when the worker cannot take the leg: the leg is not
    /// sent, nothing is counted, and the flow treats it as that worker
    /// failing (a prefill is retried on another worker; a decode ends the
    /// flow with [`PdError::DecodeFailed`](crate::PdError::DecodeFailed)
    /// naming it).
    fn reserve(&self, worker: &Self::Worker, phase: Phase) -> Result<Self::Guard, Refused>;

    /// A different prefill worker for retry number `attempt` (1-based) after
    /// `failed` failed, or `None` to give up. The backend should leave
    /// `failed` out of this request's later choices.
    fn reselect_prefill(&self, failed: &Self::Worker, attempt: u32) -> Option<Self::Worker>;

    /// The decode worker of a flow started with
    /// [`PdFlow::run_late_decode`](crate::PdFlow::run_late_decode), chosen
    /// when the prefill on `prefill` has completed, right before the decode
    /// leg is dispatched; [`reserve`](Self::reserve) for
    /// [`Phase::Decode`] follows at once. `None`: no decode worker is
    /// available, and the flow fails with
    /// [`PdError::NoDecodeWorker`](crate::PdError::NoDecodeWorker).
    ///
    /// Choosing here rather than at arrival lets a load-aware decode policy
    /// see every decode leg already dispatched, not a choice made while
    /// other requests were still in their prefill. The default has no
    /// decode worker to offer: a backend used only with
    /// [`PdFlow::run`](crate::PdFlow::run) need not implement it.
    fn select_decode(&self, prefill: &Self::Worker) -> Option<Self::Worker> {
        let _ = prefill;
        None
    }
}

/// A reserved phase: the guard plus the duty to finish it once.
/// Dropping it unfinished finishes it with [`LegOutcome::Cancelled`].
pub(crate) struct PhaseLease<Bk: PdBackend> {
    guard: Option<Bk::Guard>,
    status: Option<StatusCode>,
}

impl<Bk: PdBackend> PhaseLease<Bk> {
    /// Reserves `phase` on `worker` through `backend`.
    pub(crate) fn reserve(
        backend: &Bk,
        worker: &Bk::Worker,
        phase: Phase,
    ) -> Result<Self, Refused> {
        Ok(Self {
            guard: Some(backend.reserve(worker, phase)?),
            status: None,
        })
    }

    /// Notes the status of the leg's response head.
    pub(crate) fn saw_status(&mut self, status: StatusCode) {
        self.status = Some(status);
    }

    pub(crate) fn finish(mut self, outcome: LegOutcome) {
        self.end(outcome);
    }

    fn end(&mut self, outcome: LegOutcome) {
        if let Some(guard) = self.guard.take() {
            guard.finish(outcome, self.status);
        }
    }
}

impl<Bk: PdBackend> Drop for PhaseLease<Bk> {
    fn drop(&mut self) {
        self.end(LegOutcome::Cancelled);
    }
}
