//! The whole-request retry loop of a P/D request: [`run`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::Value;
use worker_lifecycle::{Attempted, Attempts, RequestRetries, RoleKind, SelectError, run_attempts};

use super::{PdPools, PdScope, PdTarget};
use crate::PdRequest;
use crate::bootstrap::Sleeper;
use crate::connector::KvConnector;
use crate::error::PdError;
use crate::flow::{PdFlow, PdResponse, Phase, Transport};
use crate::headers::ForwardHeaders;

/// One client request as [`run`] sends it, attempt after attempt.
#[derive(Debug)]
pub struct PdCall {
    /// The client's path (with its query), used by both legs.
    pub path: String,
    /// The client's body as received; a retry parses it again rather than
    /// the first attempt paying for a deep copy it rarely needs.
    pub body: Bytes,
    /// The body already parsed, for the first attempt.
    pub parsed: Option<Value>,
    /// The request's id in the flow ([`flow_request_id`]); attempt `n > 0`
    /// runs as `{id}-a{n}`, so a retried pair never meets an abandoned
    /// attempt's KV state.
    pub request_id: String,
    /// Client headers forwarded to both legs.
    pub forward: ForwardHeaders,
    /// What the request routes by, and the workers that failed it.
    pub scope: Arc<PdScope>,
}

/// Why [`run`] produced no decode response.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RunError {
    /// No pair could be selected for the first attempt.
    #[error(transparent)]
    Select(#[from] SelectError),
    /// The flow failed: the last attempt's error (a retry that found no
    /// fresh pair reports why the attempt before it failed).
    #[error(transparent)]
    Flow(#[from] PdError),
}

/// Runs `call` over pairs from the flow's [`PdPools`]: select (a pair, or
/// the prefill alone when the decode is chosen late), run the flow, and on
/// a retryable failure leave the failed worker out, wait the backoff
/// `retries` grants (through `sleeper`) and run again with a fresh pair.
/// `on_retry` sees each error that is retried, for metrics and logs;
/// [`run_observed`] also sees each attempt's selection.
///
/// The caller bounds the whole of it with its own deadline (dropping the
/// future is safe at any await: every reserved phase is finished as
/// cancelled).
///
/// # Errors
/// [`RunError`]; a [`RunError::Flow`] error's [`PdError::status`] is the
/// answer to give.
pub async fn run<T, C, S>(
    flow: &PdFlow<T, PdPools>,
    connector: &C,
    call: PdCall,
    retries: &mut RequestRetries<'_>,
    sleeper: &S,
    on_retry: impl FnMut(&PdError),
) -> Result<PdResponse<T::Body, PdPools>, RunError>
where
    T: Transport,
    C: KvConnector + ?Sized,
    S: Sleeper + ?Sized,
{
    run_observed(flow, connector, call, retries, sleeper, OnRetry(on_retry)).await
}

/// [`run`], with `observer` told of each attempt's selection as well as of
/// each retried error: what a caller needs to trace the routing decision
/// of every attempt (`router-http` opens a span in
/// [`selecting`](RunObserver::selecting) and records the pair in
/// [`selected`](RunObserver::selected)).
///
/// # Errors
/// As [`run`].
pub async fn run_observed<T, C, S, O>(
    flow: &PdFlow<T, PdPools>,
    connector: &C,
    call: PdCall,
    retries: &mut RequestRetries<'_>,
    sleeper: &S,
    observer: O,
) -> Result<PdResponse<T::Body, PdPools>, RunError>
where
    T: Transport,
    C: KvConnector + ?Sized,
    S: Sleeper + ?Sized,
    O: RunObserver,
{
    let mut attempts = WholeAttempts {
        flow,
        connector,
        call,
        retries,
        sleeper,
        observer,
    };
    run_attempts(&mut attempts, None).await
}

/// What one attempt of [`run_observed`] selected: the prefill worker, and
/// the decode worker unless the pools choose it late
/// ([`PdPools::late_decode`]: the flow chooses it when the prefill has
/// answered, and the decode leg names it).
#[derive(Debug, Clone, Copy)]
pub struct Selected<'a> {
    /// The prefill worker and how its policy chose it.
    pub prefill: &'a PdTarget,
    /// The decode worker and how its policy chose it; `None` for a late
    /// decode.
    pub decode: Option<&'a PdTarget>,
}

/// What [`run_observed`] reports of a request's attempts, in order: for
/// each attempt [`selecting`](Self::selecting) then
/// [`selected`](Self::selected), and [`retrying`](Self::retrying) for a
/// failed attempt that is run again. Called on the request's task, inside
/// its run: keep them cheap.
pub trait RunObserver {
    /// What the observer keeps from just before a selection to its
    /// outcome (a span, a start time).
    type Selection;

    /// Attempt `n` (0 for the first) is about to select its workers.
    fn selecting(&mut self, n: u32) -> Self::Selection;

    /// What attempt's selection gave: the workers, or why none could be
    /// chosen (the request then ends; a retry reports the error that made
    /// it retry instead, see [`RunError::Flow`]).
    fn selected(&mut self, selection: Self::Selection, outcome: Result<Selected<'_>, &SelectError>);

    /// A failed attempt's `error` is retried.
    fn retrying(&mut self, error: &PdError);
}

/// [`run`]'s observer: a closure that sees each retried error.
struct OnRetry<F>(F);

impl<F: FnMut(&PdError)> RunObserver for OnRetry<F> {
    type Selection = ();

    fn selecting(&mut self, _: u32) {}

    fn selected(&mut self, (): (), _: Result<Selected<'_>, &SelectError>) {}

    fn retrying(&mut self, error: &PdError) {
        (self.0)(error);
    }
}

/// A whole P/D request's attempts, run by worker-lifecycle's one attempt
/// loop: each selects a pair (or the prefill alone, for a late decode) and
/// runs the flow; a retryable failure leaves its worker out and, when
/// `retries` grants it, the next attempt runs after the backoff. The
/// failure is carried over, so that a retry which finds no pair reports why
/// the request was retried rather than the selection's error.
struct WholeAttempts<'a, 'r, T, C: ?Sized, S: ?Sized, O> {
    flow: &'a PdFlow<T, PdPools>,
    connector: &'a C,
    call: PdCall,
    retries: &'a mut RequestRetries<'r>,
    sleeper: &'a S,
    observer: O,
}

impl<T, C, S, O> Attempts for WholeAttempts<'_, '_, T, C, S, O>
where
    T: Transport,
    C: KvConnector + ?Sized,
    S: Sleeper + ?Sized,
    O: RunObserver,
{
    type Answer = Result<PdResponse<T::Body, PdPools>, RunError>;
    type Failure = PdError;
    /// The previous attempt's failure.
    type Carry = Option<PdError>;

    async fn attempt(
        &mut self,
        n: u32,
        previous: Option<PdError>,
    ) -> Attempted<Self::Answer, PdError> {
        let call = &mut self.call;
        let pools = self.flow.backend();
        let selection = self.observer.selecting(n);
        let selected = if pools.late_decode() {
            pools
                .select_prefill(&call.scope)
                .map(|prefill| (prefill, None))
        } else {
            pools
                .select_pair(&call.scope)
                .map(|pair| (pair.prefill, Some(pair.decode)))
        };
        self.observer.selected(
            selection,
            selected.as_ref().map(|(prefill, decode)| Selected {
                prefill,
                decode: decode.as_ref(),
            }),
        );
        let (prefill, decode) = match selected {
            Ok(selected) => selected,
            Err(err) => {
                return Attempted::Done(
                    Err(previous.map_or(RunError::Select(err), RunError::Flow)),
                );
            }
        };
        let body = match call.parsed.take() {
            Some(value) => value,
            None => match serde_json::from_slice(&call.body) {
                Ok(value) => value,
                Err(_) => return Attempted::Done(Err(RunError::Flow(PdError::InvalidBody))),
            },
        };
        let request = PdRequest {
            path: call.path.clone(),
            body,
            request_id: match n {
                0 => call.request_id.clone(),
                n => format!("{}-a{n}", call.request_id),
            },
            forward: call.forward.clone(),
        };
        let result = match decode {
            Some(decode) => {
                self.flow
                    .run(self.connector, request, prefill, decode)
                    .await
            }
            None => {
                self.flow
                    .run_late_decode(self.connector, request, prefill)
                    .await
            }
        };
        let error = match result {
            Ok(response) => return Attempted::Done(Ok(response)),
            Err(error) => error,
        };
        if let Some((phase, worker)) = error.failed_worker() {
            let role = match phase {
                Phase::Prefill => RoleKind::Prefill,
                Phase::Decode => RoleKind::Decode,
            };
            call.scope.exclude(role, worker);
        }
        if error.is_retryable() {
            Attempted::Failed(error)
        } else {
            Attempted::Done(Err(RunError::Flow(error)))
        }
    }

    fn retry(
        &mut self,
        _n: u32,
        error: PdError,
    ) -> Result<(Duration, Option<PdError>), Self::Answer> {
        match self.retries.next(Instant::now()) {
            Some(backoff) => {
                self.observer.retrying(&error);
                Ok((backoff, Some(error)))
            }
            None => Err(Err(RunError::Flow(error))),
        }
    }

    async fn wait(&mut self, backoff: Duration) -> Result<(), Self::Answer> {
        self.sleeper.sleep(backoff).await;
        Ok(())
    }
}

/// The flow's request id for a client's request id, unique in this process:
/// transfer ids derive from it, and two requests that share a client id (a
/// client reusing ids, a fixed header) must not rendezvous on each other's
/// KV. It keeps the client's id as a prefix when that fits the P2P
/// convention's alphabet (ASCII letters, digits, `-`, `_`, `.`; at most 80
/// bytes), for correlating engine logs.
///
/// ```
/// use pd_orchestrator::pools::flow_request_id;
///
/// let a = flow_request_id(b"chat-42");
/// let b = flow_request_id(b"chat-42");
/// assert!(a.starts_with("chat-42.") && b.starts_with("chat-42."));
/// assert_ne!(a, b, "one id per request");
/// assert!(flow_request_id(b"a:b").starts_with("pd-"), "':' would corrupt the wire id");
/// ```
pub fn flow_request_id(client_id: &[u8]) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let fits = !client_id.is_empty()
        && client_id.len() <= 80
        && client_id
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    match std::str::from_utf8(client_id) {
        Ok(client) if fits => format!("{client}.{n}"),
        _ => format!("pd-{}-{n}", std::process::id()),
    }
}
