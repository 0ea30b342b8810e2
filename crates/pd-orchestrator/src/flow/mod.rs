//! The two-phase flow; see [`PdFlow`].

mod body;
mod collect;
pub(crate) mod sse;
mod traits;

pub use body::PdBody;
pub use traits::{
    BoxError, LegOutcome, LegRequest, LegResponse, PdBackend, PdWorker, Phase, PhaseGuard, Refused,
    Transport,
};

use std::future::poll_fn;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use serde_json::{Map, Value};

use crate::connector::{
    DecodeHandoff, KV_TRANSFER_PARAMS, KvConnector, LegContext, PhaseOrder, apply_decode_handoff,
    prepare_prefill_body,
};
use crate::error::{PdError, is_retryable_status};
use crate::headers::{ForwardHeaders, leg_headers, p2p_request_id};
use crate::merge::merge_non_streaming;
use body::{BodyPrefill, PrefillDriver};
use collect::{Collector, collect_limited};
pub(crate) use sse::UsageRewriter;
use traits::PhaseLease;

/// Limits and switches of the flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowConfig {
    /// Prefill attempts in sequential mode, including the first. Default 3.
    pub max_prefill_attempts: u32,
    /// Largest prefill response read. Default 16 MiB (block id lists of
    /// long prompts are large).
    pub max_prefill_response_bytes: usize,
    /// Largest non-streaming decode response read for merging. Default
    /// 64 MiB.
    pub max_decode_response_bytes: usize,
    /// Largest error body kept for the client. Default 64 KiB.
    pub max_error_body_bytes: usize,
    /// Merge usage and prompt logprobs of the prefill response into
    /// non-streaming decode responses. Default true.
    pub merge_non_streaming: bool,
    /// Rewrite the usage events of streaming responses whose client asked
    /// for usage (`stream_options.include_usage` or
    /// `continuous_usage_stats`) with the prefill's prompt accounting.
    /// Default true.
    pub rewrite_streaming_usage: bool,
    /// Largest partial SSE event buffered while rewriting usage; a larger
    /// one is passed through unrewritten. Default 1 MiB.
    pub max_sse_event_bytes: usize,
}

impl Default for FlowConfig {
    fn default() -> Self {
        Self {
            max_prefill_attempts: 3,
            max_prefill_response_bytes: 16 << 20,
            max_decode_response_bytes: 64 << 20,
            max_error_body_bytes: 64 << 10,
            merge_non_streaming: true,
            rewrite_streaming_usage: true,
            max_sse_event_bytes: 1 << 20,
        }
    }
}

/// Counters of one flow, for metrics.
#[derive(Debug, Default)]
pub struct FlowStats {
    requests: AtomicU64,
    prefill_retries: AtomicU64,
    missing_prefill_kv_params: AtomicU64,
    merged_responses: AtomicU64,
    prefill_failures_during_decode: AtomicU64,
}

/// A copy of [`FlowStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlowStatsSnapshot {
    /// Requests started.
    pub requests: u64,
    /// Prefill attempts after the first (sequential mode).
    pub prefill_retries: u64,
    /// 2xx prefill responses without `kv_transfer_params`: decode
    /// recomputed the prompt.
    pub missing_prefill_kv_params: u64,
    /// Non-streaming responses whose usage or logprobs were merged.
    pub merged_responses: u64,
    /// Concurrent prefill legs that failed while decode was already
    /// streaming (recorded, stream left to finish).
    pub prefill_failures_during_decode: u64,
}

impl FlowStats {
    /// Current values.
    pub fn snapshot(&self) -> FlowStatsSnapshot {
        FlowStatsSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            prefill_retries: self.prefill_retries.load(Ordering::Relaxed),
            missing_prefill_kv_params: self.missing_prefill_kv_params.load(Ordering::Relaxed),
            merged_responses: self.merged_responses.load(Ordering::Relaxed),
            prefill_failures_during_decode: self
                .prefill_failures_during_decode
                .load(Ordering::Relaxed),
        }
    }
}

/// One client request to run over a (prefill, decode) pair.
#[derive(Debug, Clone)]
pub struct PdRequest {
    /// The client's path, e.g. `/v1/chat/completions`; both legs use it.
    pub path: String,
    /// The client's parsed body (a JSON object), parsed once by the caller.
    pub body: Value,
    /// The per-request id: the `{uuid}` of the request-id convention, and
    /// the root of transfer ids. ASCII letters, digits, `-`, `_` and `.`
    /// only, at most 128 bytes: the engines parse the peer address out of
    /// the wire id, so a `:` here would corrupt it.
    pub request_id: String,
    /// Client headers to forward on both legs.
    pub forward: ForwardHeaders,
}

/// Whether the decode leg received KV parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handoff {
    /// Decode got its `kv_transfer_params`.
    Params,
    /// The prefill returned none; decode recomputed the prompt. Counted in
    /// [`FlowStatsSnapshot::missing_prefill_kv_params`]; the caller should
    /// log it.
    MissingPrefillParams,
}

/// The decode response head plus a body that owns the decode phase.
pub struct PdResponse<B, Bk: PdBackend> {
    /// Decode response status (2xx).
    pub status: StatusCode,
    /// Decode response headers (`content-length` removed when the body was
    /// merged).
    pub headers: HeaderMap,
    /// The body; see [`PdBody`].
    pub body: PdBody<B, Bk>,
    /// Whether decode got KV parameters.
    pub handoff: Handoff,
    /// The prefill worker that served the request (after retries).
    pub prefill: Bk::Worker,
    /// Prefill attempts made (1 without retries).
    pub prefill_attempts: u32,
}

impl<B, Bk: PdBackend> std::fmt::Debug for PdResponse<B, Bk> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PdResponse")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .field("body", &self.body)
            .field("handoff", &self.handoff)
            .field("prefill", &self.prefill.endpoint().base_url())
            .field("prefill_attempts", &self.prefill_attempts)
            .finish()
    }
}

/// Why one prefill leg did not produce a usable response.
#[derive(Debug)]
pub(crate) enum PrefillLegError {
    /// The worker failed; another may succeed.
    Failed(String),
    /// The engine rejected the request itself.
    Rejected { status: StatusCode, body: Bytes },
    /// The caller's transport could not send it (its own failure).
    NotSent(String),
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    prefill: usize,
    error: usize,
}

/// The two-phase flow: prefill leg, hand-off, decode leg, with one load
/// guard per phase.
///
/// # When does each phase count as load?
///
/// Sequential ([`PhaseOrder::Sequential`]):
///
/// ```text
/// prefill guard: reserve at dispatch ─────────── release when the prefill body is read
/// decode guard:                                  reserve at dispatch ───── release at end of decode stream
/// ```
///
/// Concurrent ([`PhaseOrder::Concurrent`]): both reserved at dispatch; each
/// released by its own phase. A prefill that fails before the decode
/// response head arrives aborts the decode leg (the decode engine would wait
/// for KV that never comes); a decode that fails aborts the prefill leg (its
/// KV has no consumer). Once decode is streaming, a prefill failure is
/// recorded but the stream is left to finish.
///
/// # Cancel safety
///
/// Every guard lives in a value owned by the future or the body that does
/// the work ([`PdBody`] for the decode stream). Dropping the flow future at
/// any await point, or the body at any time, releases each reserved phase
/// exactly once and records [`LegOutcome::Cancelled`] for it.
///
/// # Retries
///
/// The prefill status is always checked. In sequential mode a prefill that
/// fails on the worker side is retried with a fresh worker from
/// [`PdBackend::reselect_prefill`] before decode starts. Decode is never
/// retried here: a [`PdError`] returned by [`PdFlow::run`] means no decode
/// byte reached the client, so the caller may retry the whole request when
/// [`PdError::is_retryable`]; once [`PdFlow::run`] returned a body, nothing
/// is retried.
#[derive(Debug)]
pub struct PdFlow<T, Bk> {
    transport: T,
    backend: Arc<Bk>,
    config: FlowConfig,
    stats: Arc<FlowStats>,
}

impl<T, Bk> PdFlow<T, Bk>
where
    T: Transport,
    Bk: PdBackend,
{
    /// A flow sending legs through `transport`, reserving and recording
    /// through `backend`.
    pub fn new(transport: T, backend: Arc<Bk>, config: FlowConfig) -> Self {
        Self {
            transport,
            backend,
            config,
            stats: Arc::default(),
        }
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The counters of this flow.
    pub fn stats(&self) -> &Arc<FlowStats> {
        &self.stats
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<Bk> {
        &self.backend
    }

    /// Runs `request` over the (`prefill`, `decode`) pair with `connector`.
    ///
    /// # Errors
    /// A [`PdError`] when no decode response can be returned; no guard is
    /// left reserved and every reserved leg has recorded its outcome.
    pub async fn run<C>(
        &self,
        connector: &C,
        request: PdRequest,
        prefill: Bk::Worker,
        decode: Bk::Worker,
    ) -> Result<PdResponse<T::Body, Bk>, PdError>
    where
        C: KvConnector + ?Sized,
    {
        self.run_with(connector, request, prefill, Some(decode))
            .await
    }

    /// The flow; `decode` is `None` only for a late decode choice, which
    /// [`run_late_decode`](Self::run_late_decode) allows only for
    /// sequential connectors.
    async fn run_with<C>(
        &self,
        connector: &C,
        request: PdRequest,
        prefill: Bk::Worker,
        decode: Option<Bk::Worker>,
    ) -> Result<PdResponse<T::Body, Bk>, PdError>
    where
        C: KvConnector + ?Sized,
    {
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let PdRequest {
            path,
            body,
            request_id,
            forward,
        } = request;
        if !valid_request_id(&request_id) {
            return Err(PdError::InvalidRequestId(request_id));
        }
        let Value::Object(mut decode_body) = body else {
            return Err(PdError::InvalidBody);
        };
        decode_body.remove(KV_TRANSFER_PARAMS);
        let streaming = decode_body.get("stream").and_then(Value::as_bool) == Some(true);
        let stream_usage = streaming && wants_stream_usage(&decode_body);
        let mut prefill_body = decode_body.clone();
        prepare_prefill_body(&mut prefill_body);
        let legs = Legs {
            path: &path,
            request_id: &request_id,
            forward: &forward,
            streaming,
            stream_usage,
        };
        match connector.phase_order() {
            PhaseOrder::Sequential => {
                self.run_sequential(connector, legs, prefill_body, decode_body, prefill, decode)
                    .await
            }
            PhaseOrder::Concurrent => {
                let decode = decode.ok_or(PdError::DecodeNeededAtStart)?;
                self.run_concurrent(connector, legs, prefill_body, decode_body, prefill, decode)
                    .await
            }
        }
    }

    /// Runs `request` with a sequential connector whose prefill does not
    /// name the decode engine, choosing the decode worker late: the prefill
    /// (with its retries) runs first, then
    /// [`PdBackend::select_decode`] supplies the decode worker and its
    /// guard is reserved right before the decode leg is dispatched.
    ///
    /// Both legs carry the same `X-Request-Id`, fixed when the prefill is
    /// dispatched; its decode address is empty because no decode worker
    /// was chosen yet.
    ///
    /// # Errors
    /// As [`run`](Self::run), plus [`PdError::NoDecodeWorker`] when the
    /// backend has no decode worker once the prefill completed (the prefill
    /// phase already ended and recorded its outcome), and
    /// [`PdError::DecodeNeededAtStart`] for a connector that needs the
    /// decode worker before the prefill (see
    /// [`KvConnector::prefill_names_decode`]).
    pub async fn run_late_decode<C>(
        &self,
        connector: &C,
        request: PdRequest,
        prefill: Bk::Worker,
    ) -> Result<PdResponse<T::Body, Bk>, PdError>
    where
        C: KvConnector + ?Sized,
    {
        if connector.phase_order() != PhaseOrder::Sequential || connector.prefill_names_decode() {
            return Err(PdError::DecodeNeededAtStart);
        }
        self.run_with(connector, request, prefill, None).await
    }

    fn limits(&self) -> Limits {
        Limits {
            prefill: self.config.max_prefill_response_bytes,
            error: self.config.max_error_body_bytes,
        }
    }

    async fn run_sequential<C: KvConnector + ?Sized>(
        &self,
        connector: &C,
        legs: Legs<'_>,
        mut prefill_body: Map<String, Value>,
        mut decode_body: Map<String, Value>,
        mut prefill: Bk::Worker,
        decode: Option<Bk::Worker>,
    ) -> Result<PdResponse<T::Body, Bk>, PdError> {
        let max_attempts = self.config.max_prefill_attempts.max(1);
        let mut attempt = 0;
        let (mut prefill_response, wire_id) = loop {
            // Late decode: the connector's prefill parameters do not read
            // the decode endpoint, and the wire id leaves its address empty.
            let ctx = legs.context(attempt, &prefill, decode.as_ref().unwrap_or(&prefill));
            let decode_addr = decode.as_ref().map(|d| d.endpoint().kv_addr());
            let params = connector.prefill_params(&ctx)?;
            prefill_body.insert(KV_TRANSFER_PARAMS.to_owned(), params);
            let wire_id = p2p_request_id(
                &ctx.prefill.kv_addr(),
                decode_addr.as_deref().unwrap_or(""),
                legs.request_id,
            );
            let leg = legs.leg(Phase::Prefill, ctx.prefill, &wire_id, &prefill_body)?;
            let failure = match PhaseLease::reserve(&*self.backend, &prefill, Phase::Prefill) {
                Err(refused) => format!("not reserved: {refused}"),
                Ok(lease) => {
                    let sent = self.transport.send(leg);
                    match run_prefill_leg(sent, lease, self.limits(), T::is_local_error).await {
                        Ok(response) => break (response, wire_id),
                        Err(PrefillLegError::Rejected { status, body }) => {
                            return Err(PdError::PrefillRejected { status, body });
                        }
                        Err(PrefillLegError::Failed(failure)) => failure,
                        Err(PrefillLegError::NotSent(reason)) => {
                            return Err(PdError::LegNotSent {
                                phase: Phase::Prefill,
                                reason,
                            });
                        }
                    }
                }
            };
            attempt += 1;
            tracing::warn!(
                prefill = prefill.endpoint().base_url(),
                attempt,
                %failure,
                "prefill attempt failed"
            );
            let next = if attempt < max_attempts {
                self.backend.reselect_prefill(&prefill, attempt)
            } else {
                None
            };
            match next {
                Some(next) => {
                    self.stats.prefill_retries.fetch_add(1, Ordering::Relaxed);
                    prefill = next;
                }
                None => {
                    return Err(PdError::PrefillFailed {
                        attempts: attempt,
                        last: failure,
                        worker: prefill.id().to_owned(),
                    });
                }
            }
        };

        let decode = match decode {
            Some(decode) => decode,
            None => self
                .backend
                .select_decode(&prefill)
                .ok_or(PdError::NoDecodeWorker)?,
        };
        let ctx = legs.context(attempt, &prefill, &decode);
        let mut handoff = connector.decode_params(&ctx, Some(&mut prefill_response))?;
        let handoff_kind = self.note_handoff(&handoff, &ctx, connector);
        apply_decode_handoff(&mut decode_body, &mut handoff);
        let leg = legs.leg(Phase::Decode, ctx.decode, &wire_id, &decode_body)?;
        let lease = PhaseLease::reserve(&*self.backend, &decode, Phase::Decode)
            .map_err(|refused| decode_failed(&decode, format!("not reserved: {refused}")))?;
        let sent = self.transport.send(leg);
        let response = match sent.await {
            Ok(response) => response,
            Err(error) => return Err(decode_send_failed::<T, _, _>(lease, &decode, &error)),
        };
        let (status, headers, body) = self
            .finish_decode(
                response,
                lease,
                &decode,
                &legs,
                PrefillState::Done(Some(prefill_response)),
            )
            .await?;
        Ok(PdResponse {
            status,
            headers,
            body,
            handoff: handoff_kind,
            prefill,
            prefill_attempts: attempt + 1,
        })
    }

    async fn run_concurrent<C: KvConnector + ?Sized>(
        &self,
        connector: &C,
        legs: Legs<'_>,
        mut prefill_body: Map<String, Value>,
        mut decode_body: Map<String, Value>,
        prefill: Bk::Worker,
        decode: Bk::Worker,
    ) -> Result<PdResponse<T::Body, Bk>, PdError> {
        // Build both legs before reserving anything: a connector error
        // leaves no load behind.
        let ctx = legs.context(0, &prefill, &decode);
        let params = connector.prefill_params(&ctx)?;
        prefill_body.insert(KV_TRANSFER_PARAMS.to_owned(), params);
        let mut handoff = connector.decode_params(&ctx, None)?;
        let handoff_kind = self.note_handoff(&handoff, &ctx, connector);
        apply_decode_handoff(&mut decode_body, &mut handoff);
        let (prefill_leg, wire_id) =
            legs.build(Phase::Prefill, &ctx, ctx.prefill, &prefill_body)?;
        let decode_leg = legs.leg(Phase::Decode, ctx.decode, &wire_id, &decode_body)?;

        let prefill_lease =
            PhaseLease::reserve(&*self.backend, &prefill, Phase::Prefill).map_err(|refused| {
                PdError::PrefillFailed {
                    attempts: 1,
                    last: format!("not reserved: {refused}"),
                    worker: prefill.id().to_owned(),
                }
            })?;
        let prefill_sent = self.transport.send(prefill_leg);
        let mut driver: Option<PrefillDriver> = Some(Box::pin(run_prefill_leg(
            prefill_sent,
            prefill_lease,
            self.limits(),
            T::is_local_error,
        )));
        let mut prefill_result: Option<PrefillResult> = None;

        // A refusal drops the prefill leg before its first poll, finishing
        // its lease as cancelled.
        let decode_lease = PhaseLease::reserve(&*self.backend, &decode, Phase::Decode)
            .map_err(|refused| decode_failed(&decode, format!("not reserved: {refused}")))?;

        let mut decode_sent = pin!(self.transport.send(decode_leg));
        let head = poll_fn(|cx| {
            if let Some(running) = driver.as_mut()
                && let Poll::Ready(result) = running.as_mut().poll(cx)
            {
                driver = None;
                let failed = result.is_err();
                prefill_result = Some(result);
                if failed {
                    return Poll::Ready(None);
                }
            }
            decode_sent.as_mut().poll(cx).map(Some)
        })
        .await;
        let response = match head {
            None => {
                // Prefill failed before decode answered: abort decode.
                drop(decode_lease);
                return Err(match prefill_result {
                    Some(Err(PrefillLegError::Rejected { status, body })) => {
                        PdError::PrefillRejected { status, body }
                    }
                    Some(Err(PrefillLegError::NotSent(reason))) => PdError::LegNotSent {
                        phase: Phase::Prefill,
                        reason,
                    },
                    Some(Err(PrefillLegError::Failed(last))) => PdError::PrefillFailed {
                        attempts: 1,
                        last,
                        worker: prefill.id().to_owned(),
                    },
                    Some(Ok(_)) | None => PdError::PrefillFailed {
                        attempts: 1,
                        last: "prefill ended without a result".to_owned(),
                        worker: prefill.id().to_owned(),
                    },
                });
            }
            Some(Err(error)) => {
                // `driver` drops with this frame: the prefill leg is aborted.
                return Err(decode_send_failed::<T, _, _>(decode_lease, &decode, &error));
            }
            Some(Ok(response)) => response,
        };
        let prefill_state = match driver {
            Some(driver) => PrefillState::Running(driver),
            None => PrefillState::Done(prefill_result.and_then(Result::ok)),
        };
        let (status, headers, body) = self
            .finish_decode(response, decode_lease, &decode, &legs, prefill_state)
            .await?;
        Ok(PdResponse {
            status,
            headers,
            body,
            handoff: handoff_kind,
            prefill,
            prefill_attempts: 1,
        })
    }

    fn note_handoff<C: KvConnector + ?Sized>(
        &self,
        handoff: &DecodeHandoff,
        ctx: &LegContext<'_>,
        connector: &C,
    ) -> Handoff {
        match handoff {
            DecodeHandoff::Params(_) => Handoff::Params,
            DecodeHandoff::MissingPrefillParams => {
                self.stats
                    .missing_prefill_kv_params
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    connector = connector.kind().as_str(),
                    prefill = ctx.prefill.base_url(),
                    request_id = ctx.request_id,
                    "prefill response carried no kv_transfer_params; decode will recompute the prompt"
                );
                Handoff::MissingPrefillParams
            }
        }
    }

    /// Checks the decode status and builds the client body: streaming (the
    /// lease moves into the body) or collected and merged.
    async fn finish_decode(
        &self,
        response: LegResponse<T::Body>,
        mut lease: PhaseLease<Bk>,
        decode: &Bk::Worker,
        legs: &Legs<'_>,
        prefill: PrefillState,
    ) -> Result<(StatusCode, HeaderMap, PdBody<T::Body, Bk>), PdError> {
        let LegResponse {
            status,
            mut headers,
            mut body,
        } = response;
        lease.saw_status(status);
        if !status.is_success() {
            let error_body = collect_limited(&mut body, self.config.max_error_body_bytes)
                .await
                .unwrap_or_default();
            lease.finish(if is_retryable_status(status) {
                LegOutcome::WorkerFailure
            } else {
                LegOutcome::ClientError
            });
            return Err(PdError::DecodeRejected {
                status,
                body: error_body,
                worker: decode.id().to_owned(),
            });
        }
        if legs.streaming {
            let mut rewriter = (legs.stream_usage && self.config.rewrite_streaming_usage)
                .then(|| UsageRewriter::new(self.config.max_sse_event_bytes));
            let body_prefill = match prefill {
                PrefillState::Running(driver) => Some(BodyPrefill {
                    driver,
                    stats: Arc::clone(&self.stats),
                }),
                PrefillState::Done(response) => {
                    if let (Some(rewriter), Some(response)) = (rewriter.as_mut(), response.as_ref())
                    {
                        rewriter.set_prefill(response);
                    }
                    None
                }
            };
            if rewriter.is_some() {
                headers.remove(http::header::CONTENT_LENGTH);
            }
            return Ok((
                status,
                headers,
                PdBody::streaming(body, lease, body_prefill, rewriter),
            ));
        }

        // Non-streaming: read the decode body while the prefill (if still
        // running) keeps going; the decode phase ends when its body is read,
        // then the merge waits for the prefill's usage.
        let limit = self.config.max_decode_response_bytes;
        let (collected, prefill) = match prefill {
            PrefillState::Done(response) => (
                collect_limited(&mut body, limit).await,
                PrefillState::Done(response),
            ),
            PrefillState::Running(mut driver) => {
                let mut collector = Collector::default();
                let mut finished: Option<PrefillResult> = None;
                let collected = poll_fn(|cx| {
                    if finished.is_none()
                        && let Poll::Ready(result) = driver.as_mut().poll(cx)
                    {
                        finished = Some(result);
                    }
                    collector.poll_collect(cx, &mut body, limit)
                })
                .await;
                let state = match finished {
                    Some(result) => PrefillState::Done(self.prefill_result(result)),
                    None => PrefillState::Running(driver),
                };
                (collected, state)
            }
        };
        drop(body);
        let bytes = match collected {
            Ok(bytes) => {
                lease.finish(LegOutcome::Success);
                bytes
            }
            Err(error) => {
                lease.finish(LegOutcome::WorkerFailure);
                return Err(PdError::DecodeBodyFailed {
                    reason: error.to_string(),
                    worker: decode.id().to_owned(),
                });
            }
        };
        let prefill_response = match prefill {
            PrefillState::Done(response) => response,
            PrefillState::Running(driver) => self.prefill_result(driver.await),
        };
        let bytes = match (&prefill_response, self.config.merge_non_streaming) {
            (Some(prefill_response), true) => self.merged(prefill_response, bytes, &mut headers),
            _ => bytes,
        };
        Ok((status, headers, PdBody::full(bytes)))
    }

    /// The concurrent prefill's response, counting a failure that decode
    /// outlived.
    fn prefill_result(&self, result: PrefillResult) -> Option<Value> {
        match result {
            Ok(response) => Some(response),
            Err(_) => {
                self.stats
                    .prefill_failures_during_decode
                    .fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    fn merged(&self, prefill: &Value, decode: Bytes, headers: &mut HeaderMap) -> Bytes {
        let Ok(mut value) = serde_json::from_slice::<Value>(&decode) else {
            return decode;
        };
        let report = merge_non_streaming(prefill, &mut value);
        if !(report.usage || report.logprobs) {
            return decode;
        }
        match serde_json::to_vec(&value) {
            Ok(merged) => {
                self.stats.merged_responses.fetch_add(1, Ordering::Relaxed);
                headers.remove(http::header::CONTENT_LENGTH);
                Bytes::from(merged)
            }
            Err(_) => decode,
        }
    }
}

/// Per-request facts shared by both legs.
#[derive(Clone, Copy)]
struct Legs<'a> {
    path: &'a str,
    request_id: &'a str,
    forward: &'a ForwardHeaders,
    streaming: bool,
    stream_usage: bool,
}

impl<'a> Legs<'a> {
    fn context<'b, W: PdWorker>(
        &self,
        attempt: u32,
        prefill: &'b W,
        decode: &'b W,
    ) -> LegContext<'b>
    where
        'a: 'b,
    {
        LegContext {
            request_id: self.request_id,
            attempt,
            prefill: prefill.endpoint(),
            decode: decode.endpoint(),
        }
    }

    /// Builds a leg and the wire request id of this (prefill, decode) pair.
    fn build(
        &self,
        phase: Phase,
        ctx: &LegContext<'_>,
        target: &crate::PdEndpoint,
        body: &Map<String, Value>,
    ) -> Result<(LegRequest, String), PdError> {
        let wire_id = p2p_request_id(
            &ctx.prefill.kv_addr(),
            &ctx.decode.kv_addr(),
            self.request_id,
        );
        let leg = self.leg(phase, target, &wire_id, body)?;
        Ok((leg, wire_id))
    }

    fn leg(
        &self,
        phase: Phase,
        target: &crate::PdEndpoint,
        wire_id: &str,
        body: &Map<String, Value>,
    ) -> Result<LegRequest, PdError> {
        let headers = leg_headers(self.forward, wire_id, target)?;
        // Serializing a map of JSON values cannot fail (all keys are strings).
        let body = serde_json::to_vec(body).map_err(|_| PdError::InvalidBody)?;
        Ok(LegRequest {
            phase,
            url: target.url_for(self.path),
            headers,
            body: Bytes::from(body),
        })
    }
}

/// A decode leg that could not be sent or answered, naming its worker.
fn decode_failed<W: PdWorker>(decode: &W, reason: String) -> PdError {
    PdError::DecodeFailed {
        reason,
        worker: decode.id().to_owned(),
    }
}

/// A decode leg whose request could not be sent or answered: the worker's
/// failure, or the caller's own when the transport says so.
fn decode_send_failed<T: Transport, Bk: PdBackend, W: PdWorker>(
    lease: PhaseLease<Bk>,
    decode: &W,
    error: &T::Error,
) -> PdError {
    if T::is_local_error(error) {
        lease.finish(LegOutcome::NotSent);
        return PdError::LegNotSent {
            phase: Phase::Decode,
            reason: error.to_string(),
        };
    }
    lease.finish(LegOutcome::WorkerFailure);
    decode_failed(decode, error.to_string())
}

/// The prefill leg, from dispatch to its body read: checks the status,
/// reads the body, parses it, and ends its lease with the outcome.
async fn run_prefill_leg<F, B, E, Bk>(
    sent: F,
    lease: PhaseLease<Bk>,
    limits: Limits,
    is_local: fn(&E) -> bool,
) -> Result<Value, PrefillLegError>
where
    F: std::future::Future<Output = Result<LegResponse<B>, E>>,
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
    E: std::fmt::Display,
    Bk: PdBackend,
{
    let response = match sent.await {
        Ok(response) => response,
        Err(error) if is_local(&error) => {
            lease.finish(LegOutcome::NotSent);
            return Err(PrefillLegError::NotSent(error.to_string()));
        }
        Err(error) => {
            lease.finish(LegOutcome::WorkerFailure);
            return Err(PrefillLegError::Failed(format!("transport: {error}")));
        }
    };
    let LegResponse {
        status, mut body, ..
    } = response;
    if !status.is_success() {
        let error_body = collect_limited(&mut body, limits.error)
            .await
            .unwrap_or_default();
        if is_retryable_status(status) {
            lease.finish(LegOutcome::WorkerFailure);
            return Err(PrefillLegError::Failed(format!("status {status}")));
        }
        lease.finish(LegOutcome::ClientError);
        return Err(PrefillLegError::Rejected {
            status,
            body: error_body,
        });
    }
    let bytes = match collect_limited(&mut body, limits.prefill).await {
        Ok(bytes) => bytes,
        Err(error) => {
            lease.finish(LegOutcome::WorkerFailure);
            return Err(PrefillLegError::Failed(error.to_string()));
        }
    };
    drop(body);
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(value) if value.is_object() => {
            lease.finish(LegOutcome::Success);
            Ok(value)
        }
        _ => {
            lease.finish(LegOutcome::WorkerFailure);
            Err(PrefillLegError::Failed(
                "prefill response is not a JSON object".to_owned(),
            ))
        }
    }
}

enum PrefillState {
    /// The prefill leg ended; its parsed response when it succeeded.
    Done(Option<Value>),
    /// Still in flight (concurrent mode).
    Running(PrefillDriver),
}

/// What a prefill leg ends with.
pub(crate) type PrefillResult = Result<Value, PrefillLegError>;

fn valid_request_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Whether the client asked for usage inside the stream.
fn wants_stream_usage(body: &Map<String, Value>) -> bool {
    let Some(options) = body.get("stream_options") else {
        return false;
    };
    ["include_usage", "continuous_usage_stats"]
        .iter()
        .any(|key| options.get(key).and_then(Value::as_bool) == Some(true))
}
