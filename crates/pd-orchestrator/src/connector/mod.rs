//! KV connector strategies: how each leg's body is rewritten, what passes
//! from the prefill response to the decode request, and in which order the
//! two phases run.
//!
//! | connector | order | prefill gets | decode gets |
//! |---|---|---|---|
//! | [`Nixl`] (pull) | sequential | `do_remote_decode: true`, remote fields null | the prefill response's `kv_transfer_params`, verbatim |
//! | [`Mooncake`] (push) | concurrent (default) or sequential | `do_remote_decode: true`, `transfer_id` | `do_remote_prefill: true`, `transfer_id`, `remote_bootstrap_addr`, `remote_engine_id` |
//! | [`MoriIo`] READ | sequential | transfer id, decode's ports and layout | prefill's ports and layout + `remote_engine_id`/`remote_block_ids` from the prefill response |
//! | [`MoriIo`] WRITE | concurrent | same as READ | same as READ with engine id and block ids null |
//!
//! Both bodies start from the client's parsed body and are edited in place
//! as [`serde_json::Value`]s: the prefill body by [`prepare_prefill_body`]
//! (one generated token, no streaming) plus the connector's
//! `kv_transfer_params`; the decode body keeps every client setting and only
//! gains (or loses) `kv_transfer_params`. A client-sent `kv_transfer_params`
//! never reaches an engine.

mod choice;
mod mooncake;
mod moriio;
mod nixl;

pub use choice::{PdConnector, UnknownConnector};
pub use mooncake::Mooncake;
pub use moriio::{ModeMismatch, MoriIo, MoriIoMode, MoriIoModeGate, ParseModeError};
pub use nixl::Nixl;

use serde_json::{Map, Value};

use crate::endpoint::PdEndpoint;
use crate::error::ConnectorError;

/// The key both legs' KV instructions live under.
pub const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// Whether the decode leg waits for the prefill response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PhaseOrder {
    /// Prefill runs to completion, then decode is dispatched with data from
    /// the prefill response. Prefill may be retried on another worker.
    Sequential,
    /// Both legs are dispatched together; the engines rendezvous on a
    /// transfer id. Prefill cannot be retried elsewhere, because the decode
    /// request already names the prefill engine.
    Concurrent,
}

/// The facts a connector may use to build one pair's KV parameters.
#[derive(Debug, Clone, Copy)]
pub struct LegContext<'a> {
    /// The caller's per-request id (the `{uuid}` of the request-id
    /// convention); transfer ids derive from it.
    pub request_id: &'a str,
    /// Prefill attempt number, 0 for the first. Sequential connectors make
    /// retried transfer ids distinct so a failed attempt's state on an
    /// engine can never be confused with the retry's.
    pub attempt: u32,
    /// The prefill endpoint of this attempt.
    pub prefill: &'a PdEndpoint,
    /// The decode endpoint.
    pub decode: &'a PdEndpoint,
}

/// What a connector put into the decode request.
#[derive(Debug, Clone, PartialEq)]
pub enum DecodeHandoff {
    /// `kv_transfer_params` for the decode body.
    Params(Value),
    /// The prefill answered 2xx without `kv_transfer_params`: the decode
    /// body goes out without them and the decode engine recomputes the
    /// prompt. The flow counts this and logs it; it is never silent.
    MissingPrefillParams,
}

/// A KV connector strategy.
///
/// Implementations are cheap, immutable values; one instance serves every
/// request of a deployment.
pub trait KvConnector: Send + Sync {
    /// The configuration this strategy implements, exactly (Mooncake
    /// concurrent or sequential, MoRI-IO READ or WRITE), for metrics and
    /// logs: `kind().as_str()` is the name the deployment was configured
    /// with, and `kind().build()` an equivalent strategy.
    fn kind(&self) -> PdConnector;

    /// Whether decode waits for the prefill response.
    fn phase_order(&self) -> PhaseOrder;

    /// Whether the prefill leg's parameters name the decode engine, so the
    /// decode worker must be known before the prefill is dispatched. When
    /// `false` (and the order is [`PhaseOrder::Sequential`]) the decode
    /// worker may be chosen after the prefill finished
    /// ([`PdFlow::run_late_decode`](crate::PdFlow::run_late_decode)), and
    /// [`prefill_params`](Self::prefill_params) must not read
    /// [`LegContext::decode`]. Defaults to `true`, the safe answer.
    fn prefill_names_decode(&self) -> bool {
        true
    }

    /// The `kv_transfer_params` object of the prefill body.
    ///
    /// # Errors
    /// [`ConnectorError`] when the pair lacks connector metadata.
    fn prefill_params(&self, ctx: &LegContext<'_>) -> Result<Value, ConnectorError>;

    /// The decode side of the hand-off.
    ///
    /// `prefill_response` is the parsed prefill response in
    /// [`PhaseOrder::Sequential`] mode and `None` in concurrent mode. A
    /// connector may move fields out of it (NIXL moves its
    /// `kv_transfer_params`) instead of cloning them.
    ///
    /// # Errors
    /// [`ConnectorError`] when the pair lacks connector metadata.
    fn decode_params(
        &self,
        ctx: &LegContext<'_>,
        prefill_response: Option<&mut Value>,
    ) -> Result<DecodeHandoff, ConnectorError>;
}

impl<C: KvConnector + ?Sized> KvConnector for &C {
    fn kind(&self) -> PdConnector {
        (**self).kind()
    }
    fn phase_order(&self) -> PhaseOrder {
        (**self).phase_order()
    }
    fn prefill_names_decode(&self) -> bool {
        (**self).prefill_names_decode()
    }
    fn prefill_params(&self, ctx: &LegContext<'_>) -> Result<Value, ConnectorError> {
        (**self).prefill_params(ctx)
    }
    fn decode_params(
        &self,
        ctx: &LegContext<'_>,
        prefill_response: Option<&mut Value>,
    ) -> Result<DecodeHandoff, ConnectorError> {
        (**self).decode_params(ctx, prefill_response)
    }
}

impl<C: KvConnector + ?Sized> KvConnector for std::sync::Arc<C> {
    fn kind(&self) -> PdConnector {
        (**self).kind()
    }
    fn phase_order(&self) -> PhaseOrder {
        (**self).phase_order()
    }
    fn prefill_names_decode(&self) -> bool {
        (**self).prefill_names_decode()
    }
    fn prefill_params(&self, ctx: &LegContext<'_>) -> Result<Value, ConnectorError> {
        (**self).prefill_params(ctx)
    }
    fn decode_params(
        &self,
        ctx: &LegContext<'_>,
        prefill_response: Option<&mut Value>,
    ) -> Result<DecodeHandoff, ConnectorError> {
        (**self).decode_params(ctx, prefill_response)
    }
}

/// Rewrites a copy of the client body into a prefill-only request, in place:
/// `max_tokens` set to 1; `max_completion_tokens` and `min_tokens` clamped
/// to at most 1 when present; `stream: false`; `stream_options` removed
/// (vLLM rejects it without streaming); any client `kv_transfer_params`
/// removed (the connector sets its own).
pub fn prepare_prefill_body(body: &mut Map<String, Value>) {
    body.insert("max_tokens".to_owned(), Value::from(1));
    for key in ["max_completion_tokens", "min_tokens"] {
        if let Some(value) = body.get_mut(key)
            && value.as_u64().is_none_or(|v| v > 1)
            && !value.is_null()
        {
            *value = Value::from(1);
        }
    }
    body.insert("stream".to_owned(), Value::Bool(false));
    body.remove("stream_options");
    body.remove(KV_TRANSFER_PARAMS);
}

/// Applies a connector's decode hand-off to the decode body in place.
pub(crate) fn apply_decode_handoff(body: &mut Map<String, Value>, handoff: &mut DecodeHandoff) {
    match handoff {
        DecodeHandoff::Params(params) => {
            body.insert(KV_TRANSFER_PARAMS.to_owned(), std::mem::take(params));
        }
        DecodeHandoff::MissingPrefillParams => {
            body.remove(KV_TRANSFER_PARAMS);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn prefill(v: Value) -> Value {
        let mut v = v;
        prepare_prefill_body(v.as_object_mut().unwrap());
        v
    }

    #[test]
    fn prefill_body_forces_one_token_and_no_stream() {
        let out = prefill(json!({
            "model": "m", "prompt": "p", "max_tokens": 300, "max_completion_tokens": 64,
            "min_tokens": 5, "stream": true, "stream_options": {"include_usage": true},
            "temperature": 0.5, "kv_transfer_params": {"evil": true}
        }));
        assert_eq!(
            out,
            json!({"model": "m", "prompt": "p", "max_tokens": 1, "max_completion_tokens": 1,
                   "min_tokens": 1, "stream": false, "temperature": 0.5})
        );
    }

    #[test]
    fn prefill_body_only_clamps_present_fields_and_keeps_small_values() {
        let out = prefill(json!({"messages": [], "min_tokens": 0}));
        assert_eq!(
            out,
            json!({"messages": [], "min_tokens": 0, "max_tokens": 1, "stream": false})
        );
        let out = prefill(json!({"max_completion_tokens": 1, "min_tokens": null}));
        assert_eq!(
            out,
            json!({"max_completion_tokens": 1, "min_tokens": null, "max_tokens": 1, "stream": false})
        );
        // Nonsense types are clamped rather than forwarded.
        let out = prefill(json!({"max_completion_tokens": "9", "min_tokens": -3}));
        assert_eq!(out["max_completion_tokens"], 1);
        assert_eq!(out["min_tokens"], 1);
    }
}
