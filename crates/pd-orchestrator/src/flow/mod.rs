//! The two-phase flow; see [`PdFlow`].
//!
//! - `config`, `stats`, `request`: [`FlowConfig`], [`FlowStats`], and what
//!   a flow takes and returns ([`PdRequest`], [`PdResponse`], [`Handoff`]).
//! - `legs`: building the leg requests; `prefill`: the prefill leg.
//! - `sequential`, `concurrent`: the flow in each [`PhaseOrder`].
//! - `decode`: the decode leg's end, streamed or collected and merged.
//! - `body`, `collect`, `sse`, `traits`: the client body, bounded reads,
//!   streamed usage rewriting, and what the caller supplies.

mod body;
mod collect;
mod concurrent;
mod config;
mod decode;
mod legs;
mod prefill;
mod request;
mod sequential;
pub(crate) mod sse;
mod stats;
mod traits;

pub use body::PdBody;
pub use config::FlowConfig;
pub use request::{Handoff, PdRequest, PdResponse};
pub use stats::{FlowStats, FlowStatsSnapshot};
pub use traits::{
    BoxError, LegOutcome, LegRequest, LegResponse, PdBackend, PdWorker, Phase, PhaseGuard, Refused,
    Transport,
};

use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde_json::{Map, Value};

use crate::connector::{
    DecodeHandoff, KV_TRANSFER_PARAMS, KvConnector, LegContext, PhaseOrder, prepare_prefill_body,
};
use crate::error::PdError;
use legs::Legs;
use prefill::{Limits, PrefillResult};
pub(crate) use sse::UsageRewriter;

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
}

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
