//! `kv_transfer_params`: parsing, what a prefill engine produces for each
//! connector, and how a decode engine checks what it received.
//!
//! Engines in one process can share a [`TransferRegistry`]: a prefill engine
//! publishes every transfer it produces (engine id, transfer id, block ids,
//! a hash of the prompt), and a decode engine claims it. A claim is valid
//! only if the named prefill engine really produced exactly that transfer
//! for the same prompt and nobody claimed it before; the prefill engine then
//! frees the blocks it kept. Without a shared registry (engines in different
//! processes) a decode engine accepts any well-formed parameters.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::{Map, Value, json};

use crate::config::{MoriIoMode, TransferFormat};

/// The fields of `kv_transfer_params` that engine-sim reads. Unknown fields
/// are ignored; `null` counts as absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvTransferParams {
    /// Set by the router on the prefill leg.
    pub do_remote_decode: bool,
    /// Set on the decode leg: the prompt's KV comes from a prefill engine.
    pub do_remote_prefill: bool,
    /// The prefill engine's id.
    pub remote_engine_id: Option<String>,
    /// The prefill engine's block ids (NIXL, MoRI-IO READ).
    pub remote_block_ids: Option<Vec<u32>>,
    /// The prefill engine's host.
    pub remote_host: Option<String>,
    /// The prefill engine's side-channel port.
    pub remote_port: Option<u16>,
    /// The transfer id (Mooncake, MoRI-IO).
    pub transfer_id: Option<String>,
    /// The prefill engine's bootstrap address (Mooncake).
    pub remote_bootstrap_addr: Option<String>,
    /// Fields present with the wrong type, by name.
    pub malformed: Vec<&'static str>,
}

impl KvTransferParams {
    /// Reads the parameters from a JSON value; a non-object is recorded as
    /// malformed as a whole.
    pub fn from_json(value: &Value) -> Self {
        let mut params = KvTransferParams::default();
        let Some(map) = value.as_object() else {
            params.malformed.push("kv_transfer_params");
            return params;
        };
        params.do_remote_decode = read_bool(map, "do_remote_decode", &mut params.malformed);
        params.do_remote_prefill = read_bool(map, "do_remote_prefill", &mut params.malformed);
        params.remote_engine_id = read_string(map, "remote_engine_id", &mut params.malformed);
        params.remote_host = read_string(map, "remote_host", &mut params.malformed);
        params.transfer_id = read_string(map, "transfer_id", &mut params.malformed);
        params.remote_bootstrap_addr =
            read_string(map, "remote_bootstrap_addr", &mut params.malformed);
        params.remote_port = match map.get("remote_port") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64().and_then(|p| u16::try_from(p).ok()) {
                Some(port) => Some(port),
                None => {
                    params.malformed.push("remote_port");
                    None
                }
            },
        };
        params.remote_block_ids = match map.get("remote_block_ids") {
            None | Some(Value::Null) => None,
            Some(Value::Array(items)) => {
                let ids: Option<Vec<u32>> = items
                    .iter()
                    .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
                    .collect();
                if ids.is_none() {
                    params.malformed.push("remote_block_ids");
                }
                ids
            }
            Some(_) => {
                params.malformed.push("remote_block_ids");
                None
            }
        };
        params
    }
}

fn read_bool(map: &Map<String, Value>, key: &'static str, bad: &mut Vec<&'static str>) -> bool {
    match map.get(key) {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            bad.push(key);
            false
        }
    }
}

fn read_string(
    map: &Map<String, Value>,
    key: &'static str,
    bad: &mut Vec<&'static str>,
) -> Option<String> {
    match map.get(key) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            bad.push(key);
            None
        }
    }
}

/// Why a decode engine counted a transfer invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidTransfer {
    /// The request carried no `kv_transfer_params` with `do_remote_prefill`.
    #[error("kv_transfer_params with do_remote_prefill missing")]
    Missing,
    /// A field the connector needs is absent or has the wrong type.
    #[error("kv_transfer_params malformed or incomplete for the connector")]
    Malformed,
    /// The named prefill engine is not known to the shared registry.
    #[error("unknown prefill engine")]
    UnknownEngine,
    /// No pending transfer matches (never produced, or already claimed).
    #[error("no such pending transfer")]
    UnknownTransfer,
    /// The transfer exists but another engine produced it.
    #[error("transfer produced by a different engine")]
    EngineMismatch,
    /// The block ids differ from the ones the prefill engine produced.
    #[error("block ids do not match the produced transfer")]
    BlockMismatch,
    /// The transfer was produced for a different prompt.
    #[error("transfer produced for a different prompt")]
    PromptMismatch,
}

impl InvalidTransfer {
    /// The metric label for this reason.
    pub fn label(self) -> &'static str {
        match self {
            InvalidTransfer::Missing => "missing",
            InvalidTransfer::Malformed => "malformed",
            InvalidTransfer::UnknownEngine => "unknown_engine",
            InvalidTransfer::UnknownTransfer => "unknown_transfer",
            InvalidTransfer::EngineMismatch => "engine_mismatch",
            InvalidTransfer::BlockMismatch => "block_mismatch",
            InvalidTransfer::PromptMismatch => "prompt_mismatch",
        }
    }
}

/// A transfer a prefill engine produced and keeps blocks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducedTransfer {
    /// The producing engine.
    pub engine_id: String,
    /// The producing engine's request id (to free its blocks).
    pub request_id: u64,
    /// The transfer id, for connectors that use one.
    pub transfer_id: Option<String>,
    /// The prompt's block ids on the producer.
    pub block_ids: Vec<u32>,
    /// [`crate::tokens::sequence_hash`] of the prompt.
    pub prompt_hash: u64,
}

type Listener = Arc<dyn Fn() + Send + Sync>;

#[derive(Default)]
struct RegistryState {
    engines: HashMap<String, TransferFormat>,
    /// Pending transfers by engine id.
    pending: HashMap<String, Vec<ProducedTransfer>>,
    /// Claimed transfers whose blocks the producer may free, by engine id.
    released: HashMap<String, Vec<u64>>,
}

/// The transfer ledger shared by the engines of one process.
#[derive(Default)]
pub struct TransferRegistry {
    state: Mutex<RegistryState>,
    listeners: Mutex<Vec<Listener>>,
}

impl std::fmt::Debug for TransferRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.lock();
        f.debug_struct("TransferRegistry")
            .field("engines", &state.engines.len())
            .field(
                "pending",
                &state.pending.values().map(Vec::len).sum::<usize>(),
            )
            .finish()
    }
}

/// What a decode engine presents to claim a transfer.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The decode engine's connector.
    pub connector: TransferFormat,
    /// The MoRI-IO mode.
    pub moriio_mode: MoriIoMode,
    /// The parameters received.
    pub params: &'a KvTransferParams,
    /// [`crate::tokens::sequence_hash`] of the decode request's prompt.
    pub prompt_hash: u64,
}

impl TransferRegistry {
    /// A new, empty registry.
    pub fn new() -> Arc<Self> {
        Arc::new(TransferRegistry::default())
    }

    /// Records that a prefill engine with this id exists.
    pub fn register_engine(&self, engine_id: &str, connector: TransferFormat) {
        self.state
            .lock()
            .engines
            .insert(engine_id.to_owned(), connector);
    }

    /// Whether an engine with this id registered.
    pub fn is_registered(&self, engine_id: &str) -> bool {
        self.state.lock().engines.contains_key(engine_id)
    }

    /// Calls `listener` after every publish and claim (the HTTP driver uses
    /// it to wake the engines whose state changed).
    pub fn subscribe(&self, listener: Arc<dyn Fn() + Send + Sync>) {
        self.listeners.lock().push(listener);
    }

    fn notify(&self) {
        let listeners: Vec<Listener> = self.listeners.lock().clone();
        for listener in listeners {
            listener();
        }
    }

    /// Publishes a produced transfer.
    pub fn publish(&self, transfer: ProducedTransfer) {
        self.state
            .lock()
            .pending
            .entry(transfer.engine_id.clone())
            .or_default()
            .push(transfer);
        self.notify();
    }

    /// Whether a pending transfer with this id exists.
    pub fn has_pending_transfer_id(&self, transfer_id: &str) -> bool {
        self.state
            .lock()
            .pending
            .values()
            .flatten()
            .any(|t| t.transfer_id.as_deref() == Some(transfer_id))
    }

    /// Withdraws a transfer whose hold expired on the producer.
    pub fn withdraw(&self, engine_id: &str, request_id: u64) {
        if let Some(list) = self.state.lock().pending.get_mut(engine_id) {
            list.retain(|t| t.request_id != request_id);
        }
    }

    /// Takes the request ids of `engine_id`'s claimed transfers.
    pub fn take_released(&self, engine_id: &str) -> Vec<u64> {
        self.state
            .lock()
            .released
            .remove(engine_id)
            .unwrap_or_default()
    }

    /// Checks a claim and, when valid, consumes the transfer.
    pub fn claim(&self, claim: Claim<'_>) -> Result<ProducedTransfer, InvalidTransfer> {
        well_formed(claim.connector, claim.moriio_mode, claim.params)?;
        let params = claim.params;
        let result = {
            let mut state = self.state.lock();
            let state = &mut *state;
            if let Some(engine) = &params.remote_engine_id
                && !state.engines.contains_key(engine)
            {
                return Err(InvalidTransfer::UnknownEngine);
            }
            let found = match &params.transfer_id {
                Some(tid) => state.pending.iter().find_map(|(engine, list)| {
                    list.iter()
                        .position(|t| t.transfer_id.as_deref() == Some(tid.as_str()))
                        .map(|i| (engine.clone(), i))
                }),
                None => {
                    let engine = params.remote_engine_id.as_deref().unwrap_or_default();
                    let blocks = params.remote_block_ids.as_deref().unwrap_or_default();
                    let list = state.pending.get(engine);
                    match list.and_then(|l| l.iter().position(|t| t.block_ids == blocks)) {
                        Some(i) => Some((engine.to_owned(), i)),
                        None if list.is_some_and(|l| !l.is_empty()) => {
                            return Err(InvalidTransfer::BlockMismatch);
                        }
                        None => None,
                    }
                }
            };
            let Some((engine, index)) = found else {
                return Err(InvalidTransfer::UnknownTransfer);
            };
            let list = state.pending.get_mut(&engine).expect("found above");
            let candidate = &list[index];
            if params
                .remote_engine_id
                .as_deref()
                .is_some_and(|e| e != candidate.engine_id)
            {
                return Err(InvalidTransfer::EngineMismatch);
            }
            if params
                .remote_block_ids
                .as_deref()
                .is_some_and(|b| b != candidate.block_ids)
            {
                return Err(InvalidTransfer::BlockMismatch);
            }
            if candidate.prompt_hash != claim.prompt_hash {
                return Err(InvalidTransfer::PromptMismatch);
            }
            let transfer = list.swap_remove(index);
            state
                .released
                .entry(engine)
                .or_default()
                .push(transfer.request_id);
            transfer
        };
        self.notify();
        Ok(result)
    }
}

/// Checks that `params` carry what the connector needs on the decode leg.
pub fn well_formed(
    connector: TransferFormat,
    moriio_mode: MoriIoMode,
    params: &KvTransferParams,
) -> Result<(), InvalidTransfer> {
    if !params.do_remote_prefill {
        return Err(InvalidTransfer::Missing);
    }
    if !params.malformed.is_empty() {
        return Err(InvalidTransfer::Malformed);
    }
    let pull_fields = params.remote_engine_id.is_some()
        && params.remote_block_ids.is_some()
        && params.remote_host.is_some()
        && params.remote_port.is_some();
    let ok = match (connector, moriio_mode) {
        (TransferFormat::Nixl, _) | (TransferFormat::MoriIo, MoriIoMode::Read) => pull_fields,
        (TransferFormat::Mooncake, _) => {
            params.transfer_id.is_some()
                && (params.remote_bootstrap_addr.is_some()
                    || (params.remote_host.is_some() && params.remote_port.is_some()))
        }
        (TransferFormat::MoriIo, MoriIoMode::Write) => params.transfer_id.is_some(),
    };
    if ok {
        Ok(())
    } else {
        Err(InvalidTransfer::Malformed)
    }
}

/// Where a prefill engine says its KV can be fetched.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProducerAddress {
    /// The engine id.
    pub engine_id: String,
    /// The advertised host.
    pub host: String,
    /// The side-channel (HTTP) port.
    pub port: u16,
    /// The Mooncake bootstrap port, when served.
    pub bootstrap_port: Option<u16>,
}

/// The `kv_transfer_params` a prefill engine returns for the decode leg.
pub fn produced_params(
    connector: TransferFormat,
    moriio_mode: MoriIoMode,
    address: &ProducerAddress,
    transfer_id: Option<&str>,
    block_ids: &[u32],
) -> Value {
    let mut out = json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": address.engine_id,
        "remote_host": address.host,
        "remote_port": address.port,
    });
    let map = out.as_object_mut().expect("object literal");
    match connector {
        TransferFormat::Nixl => {
            map.insert("remote_block_ids".into(), json!(block_ids));
            map.insert("tp_size".into(), json!(1));
        }
        TransferFormat::Mooncake => {
            map.insert("transfer_id".into(), json!(transfer_id));
            let bootstrap = address.bootstrap_port.unwrap_or(address.port);
            map.insert(
                "remote_bootstrap_addr".into(),
                json!(format!("{}:{}", address.host, bootstrap)),
            );
        }
        TransferFormat::MoriIo => {
            map.insert("transfer_id".into(), json!(transfer_id));
            map.insert("remote_block_ids".into(), json!(block_ids));
            let mode = match moriio_mode {
                MoriIoMode::Read => "read",
                MoriIoMode::Write => "write",
            };
            map.insert("moriio_mode".into(), json!(mode));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_leniently_and_flags_bad_types() {
        let p = KvTransferParams::from_json(&json!({
            "do_remote_prefill": true, "remote_engine_id": "p0",
            "remote_block_ids": [1, 2], "remote_host": "h", "remote_port": 9,
            "extra": {"ignored": true}
        }));
        assert!(p.do_remote_prefill && p.malformed.is_empty());
        assert_eq!(p.remote_block_ids, Some(vec![1, 2]));
        let bad =
            KvTransferParams::from_json(&json!({"remote_port": "x", "remote_block_ids": [-1]}));
        assert_eq!(bad.malformed, vec!["remote_port", "remote_block_ids"]);
        assert_eq!(
            KvTransferParams::from_json(&json!([1])).malformed,
            vec!["kv_transfer_params"]
        );
    }
}
