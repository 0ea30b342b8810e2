//! What the flow takes and returns: the request, the response, and whether
//! decode got KV parameters.

use http::{HeaderMap, StatusCode};
use serde_json::Value;

#[cfg(doc)]
use super::FlowStatsSnapshot;
use super::{PdBackend, PdBody, PdWorker};
use crate::headers::ForwardHeaders;

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
