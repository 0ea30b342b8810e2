//! NIXL: pull-based, sequential.

use serde_json::{Map, Value};

use super::{DecodeHandoff, KV_TRANSFER_PARAMS, KvConnector, LegContext, PdConnector, PhaseOrder};
use crate::error::ConnectorError;

/// vLLM's `NixlConnector`: the prefill engine computes the prompt's KV and
/// keeps the blocks; its response says where they are
/// (`remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`,
/// ...); the decode engine pulls them.
///
/// - Prefill `kv_transfer_params`, exactly: `{"do_remote_decode": true,
///   "do_remote_prefill": false, "remote_engine_id": null,
///   "remote_block_ids": null, "remote_host": null, "remote_port": null}`.
/// - Decode `kv_transfer_params`: the prefill response's
///   `kv_transfer_params`, verbatim (moved, not re-built).
/// - A 2xx prefill response without them yields
///   [`DecodeHandoff::MissingPrefillParams`]: decode proceeds without
///   parameters and recomputes the prompt, as vLLM's own proxy does.
/// - Order: [`PhaseOrder::Sequential`]; decode needs the prefill response.
#[derive(Debug, Clone, Copy, Default)]
pub struct Nixl;

impl KvConnector for Nixl {
    fn kind(&self) -> PdConnector {
        PdConnector::Nixl
    }

    fn phase_order(&self) -> PhaseOrder {
        PhaseOrder::Sequential
    }

    fn prefill_names_decode(&self) -> bool {
        false
    }

    fn prefill_params(&self, _ctx: &LegContext<'_>) -> Result<Value, ConnectorError> {
        let mut params = Map::with_capacity(6);
        params.insert("do_remote_decode".to_owned(), Value::Bool(true));
        params.insert("do_remote_prefill".to_owned(), Value::Bool(false));
        for key in [
            "remote_engine_id",
            "remote_block_ids",
            "remote_host",
            "remote_port",
        ] {
            params.insert(key.to_owned(), Value::Null);
        }
        Ok(Value::Object(params))
    }

    fn decode_params(
        &self,
        _ctx: &LegContext<'_>,
        prefill_response: Option<&mut Value>,
    ) -> Result<DecodeHandoff, ConnectorError> {
        let params = prefill_response
            .and_then(Value::as_object_mut)
            .and_then(|response| response.remove(KV_TRANSFER_PARAMS))
            .filter(|params| !params.is_null());
        Ok(match params {
            Some(params) => DecodeHandoff::Params(params),
            None => DecodeHandoff::MissingPrefillParams,
        })
    }
}
