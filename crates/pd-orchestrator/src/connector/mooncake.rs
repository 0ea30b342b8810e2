//! Mooncake: push-based; concurrent by default.

use serde_json::{Map, Value};

use super::{DecodeHandoff, KvConnector, LegContext, PdConnector, PhaseOrder};
use crate::error::ConnectorError;

/// vLLM's `MooncakeConnector`: both legs carry the same per-request
/// `transfer_id`; the decode engine asks the prefill engine's bootstrap
/// server (`remote_bootstrap_addr` + `/query`) for the sender and the prefill
/// engine pushes the KV blocks to the decode engine's allocation.
///
/// - Prefill `kv_transfer_params`: `{"do_remote_decode": true,
///   "do_remote_prefill": false, "transfer_id": "xfer-{id}"}`.
/// - Decode `kv_transfer_params`: `{"do_remote_decode": false,
///   "do_remote_prefill": true, "transfer_id": "xfer-{id}",
///   "remote_bootstrap_addr": "http://{prefill host}:{bootstrap port}",
///   "remote_engine_id": <engine id of the prefill DP rank>}`; the engine id
///   was learned at startup ([`crate::bootstrap`]).
/// - Nothing flows from the prefill response to the decode request.
///
/// # Why concurrent by default
/// The decode parameters do not depend on the prefill response, and the
/// engines rendezvous on the transfer id, so waiting for the prefill
/// response before dispatching decode only adds one prefill round trip to
/// time-to-first-token while the decode engine could already be allocating
/// blocks. vLLM's own Mooncake proxy dispatches both at once for the same
/// reason. [`Mooncake::sequential`] trades that latency for a prefill that
/// can be retried on another worker before decode starts.
///
/// Retried sequential attempts use `xfer-{id}-r{attempt}` so a failed
/// attempt's transfer state never matches the retry's.
#[derive(Debug, Clone, Copy)]
pub struct Mooncake {
    order: PhaseOrder,
}

impl Default for Mooncake {
    fn default() -> Self {
        Self::concurrent()
    }
}

impl Mooncake {
    /// Prefill and decode dispatched together (the default).
    pub fn concurrent() -> Self {
        Self {
            order: PhaseOrder::Concurrent,
        }
    }

    /// Decode dispatched after a successful prefill response.
    pub fn sequential() -> Self {
        Self {
            order: PhaseOrder::Sequential,
        }
    }

    /// The transfer id both legs carry.
    pub fn transfer_id(ctx: &LegContext<'_>) -> String {
        if ctx.attempt == 0 {
            format!("xfer-{}", ctx.request_id)
        } else {
            format!("xfer-{}-r{}", ctx.request_id, ctx.attempt)
        }
    }
}

impl KvConnector for Mooncake {
    fn kind(&self) -> PdConnector {
        PdConnector::Mooncake {
            concurrent: self.order == PhaseOrder::Concurrent,
        }
    }

    fn phase_order(&self) -> PhaseOrder {
        self.order
    }

    fn prefill_names_decode(&self) -> bool {
        false
    }

    fn prefill_params(&self, ctx: &LegContext<'_>) -> Result<Value, ConnectorError> {
        let mut params = Map::with_capacity(3);
        params.insert("do_remote_decode".to_owned(), Value::Bool(true));
        params.insert("do_remote_prefill".to_owned(), Value::Bool(false));
        params.insert(
            "transfer_id".to_owned(),
            Value::String(Self::transfer_id(ctx)),
        );
        Ok(Value::Object(params))
    }

    fn decode_params(
        &self,
        ctx: &LegContext<'_>,
        _prefill_response: Option<&mut Value>,
    ) -> Result<DecodeHandoff, ConnectorError> {
        let prefill = ctx.prefill;
        let bootstrap =
            prefill
                .mooncake()
                .ok_or_else(|| ConnectorError::MissingMooncakeBootstrap {
                    url: prefill.base_url().to_owned(),
                })?;
        let engine_id = bootstrap.engine_id(prefill.dp_rank()).ok_or_else(|| {
            ConnectorError::MissingMooncakeEngineId {
                url: prefill.base_url().to_owned(),
                rank: prefill.dp_rank().unwrap_or(0),
            }
        })?;
        let mut params = Map::with_capacity(5);
        params.insert("do_remote_decode".to_owned(), Value::Bool(false));
        params.insert("do_remote_prefill".to_owned(), Value::Bool(true));
        params.insert(
            "transfer_id".to_owned(),
            Value::String(Self::transfer_id(ctx)),
        );
        params.insert(
            "remote_bootstrap_addr".to_owned(),
            Value::String(bootstrap.bootstrap_addr.clone()),
        );
        params.insert(
            "remote_engine_id".to_owned(),
            Value::String(engine_id.to_owned()),
        );
        Ok(DecodeHandoff::Params(Value::Object(params)))
    }
}
