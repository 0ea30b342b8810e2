//! MoRI-IO: READ mode (sequential) and WRITE mode (concurrent).

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU8, Ordering};

use serde_json::{Map, Value};

use super::{DecodeHandoff, KV_TRANSFER_PARAMS, KvConnector, LegContext, PdConnector, PhaseOrder};
use crate::endpoint::{MoriIoEndpoint, PdEndpoint};
use crate::error::ConnectorError;

/// The KV transfer direction of a MoRI-IO cluster. Every engine of a
/// cluster must register with the same mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MoriIoMode {
    /// The decode engine reads the blocks the prefill engine computed;
    /// decode needs `remote_engine_id` and `remote_block_ids` from the
    /// prefill response, so the phases are sequential.
    Read,
    /// The prefill engine writes blocks into the decode engine's allocation
    /// as it computes them; decode waits for the engine-side notification,
    /// so the phases are concurrent.
    Write,
}

impl MoriIoMode {
    /// `"READ"` or `"WRITE"`, as engines register it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Read => "READ",
            Self::Write => "WRITE",
        }
    }

    fn to_tag(self) -> u8 {
        match self {
            Self::Read => 1,
            Self::Write => 2,
        }
    }

    fn from_tag(tag: u8) -> Option<Self> {
        match tag {
            1 => Some(Self::Read),
            2 => Some(Self::Write),
            _ => None,
        }
    }
}

impl fmt::Display for MoriIoMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A registration's `transfer_mode` is neither READ nor WRITE.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown MoRI-IO transfer mode {0:?}; expected READ or WRITE")]
pub struct ParseModeError(pub String);

impl FromStr for MoriIoMode {
    type Err = ParseModeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.eq_ignore_ascii_case("read") {
            Ok(Self::Read)
        } else if s.eq_ignore_ascii_case("write") {
            Ok(Self::Write)
        } else {
            Err(ParseModeError(s.to_owned()))
        }
    }
}

/// A registration whose mode differs from the cluster's; it is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("MoRI-IO registration in {registered} mode refused: the cluster runs in {cluster} mode")]
pub struct ModeMismatch {
    /// The mode the cluster already runs in.
    pub cluster: MoriIoMode,
    /// The mode the refused registration asked for.
    pub registered: MoriIoMode,
}

impl MoriIoMode {
    /// Validates one registration against the cluster mode: the first
    /// registration (no cluster mode yet) decides it; later ones must match.
    /// Returns the cluster mode after the registration.
    ///
    /// # Errors
    /// [`ModeMismatch`] when the cluster already runs in the other mode.
    pub fn validate_registration(
        cluster: Option<MoriIoMode>,
        registered: MoriIoMode,
    ) -> Result<MoriIoMode, ModeMismatch> {
        match cluster {
            None => Ok(registered),
            Some(cluster) if cluster == registered => Ok(cluster),
            Some(cluster) => Err(ModeMismatch {
                cluster,
                registered,
            }),
        }
    }
}

/// The cluster's MoRI-IO mode, decided by the first registration, shared
/// lock-free by the registration path and the request path.
#[derive(Debug, Default)]
pub struct MoriIoModeGate {
    tag: AtomicU8,
}

impl MoriIoModeGate {
    /// A gate with no mode decided.
    pub fn new() -> Self {
        Self::default()
    }

    /// The decided mode, if any engine registered.
    pub fn current(&self) -> Option<MoriIoMode> {
        MoriIoMode::from_tag(self.tag.load(Ordering::Acquire))
    }

    /// Admits a registration: decides the mode if none is set, accepts a
    /// matching one, refuses a mismatching one (the gate is unchanged).
    ///
    /// # Errors
    /// [`ModeMismatch`] when the registration's mode differs.
    pub fn admit(&self, registered: MoriIoMode) -> Result<MoriIoMode, ModeMismatch> {
        match self
            .tag
            .compare_exchange(0, registered.to_tag(), Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Ok(registered),
            Err(tag) => {
                let cluster = MoriIoMode::from_tag(tag).unwrap_or(registered);
                MoriIoMode::validate_registration(Some(cluster), registered)
            }
        }
    }

    /// Forgets the mode; call when the last MoRI-IO engine of both roles has
    /// left, so a redeployed cluster may pick the other mode.
    pub fn reset(&self) {
        self.tag.store(0, Ordering::Release);
    }

    /// The connector for the decided mode, if any.
    pub fn connector(&self) -> Option<MoriIo> {
        self.current().map(MoriIo::new)
    }
}

/// vLLM's MoRI-IO connector (AMD).
///
/// - Both legs carry `transfer_id: "tx-{id}"` (`"tx-{id}-r{attempt}"` for a
///   retried READ prefill).
/// - Prefill `kv_transfer_params`: `do_remote_decode: true`,
///   `do_remote_prefill: false`, the decode engine's `remote_host`,
///   `remote_port`, `remote_handshake_port`, `remote_notify_port`,
///   `remote_dp_size`, `remote_tp_size`, and null `remote_engine_id` /
///   `remote_block_ids`.
/// - Decode `kv_transfer_params`: `do_remote_decode: false`,
///   `do_remote_prefill: true`, the prefill engine's host, ports,
///   `remote_dp_size`, `remote_tp_size`, `remote_dp_rank` (only when the
///   prefill engine has more than one DP rank), and `remote_engine_id` /
///   `remote_block_ids`: in READ mode moved from the prefill response's
///   `kv_transfer_params`, in WRITE mode null (the engines rendezvous on the
///   transfer id).
/// - READ is [`PhaseOrder::Sequential`], WRITE [`PhaseOrder::Concurrent`].
/// - A READ prefill response without `kv_transfer_params` yields
///   [`DecodeHandoff::MissingPrefillParams`], as with NIXL.
#[derive(Debug, Clone, Copy)]
pub struct MoriIo {
    mode: MoriIoMode,
}

impl MoriIo {
    /// The connector for `mode`.
    pub fn new(mode: MoriIoMode) -> Self {
        Self { mode }
    }

    /// Its mode.
    pub fn mode(&self) -> MoriIoMode {
        self.mode
    }

    /// The transfer id both legs carry.
    pub fn transfer_id(ctx: &LegContext<'_>) -> String {
        if ctx.attempt == 0 {
            format!("tx-{}", ctx.request_id)
        } else {
            format!("tx-{}-r{}", ctx.request_id, ctx.attempt)
        }
    }
}

fn moriio_of<'a>(
    endpoint: &'a PdEndpoint,
    role: &'static str,
) -> Result<&'a MoriIoEndpoint, ConnectorError> {
    endpoint
        .moriio()
        .ok_or_else(|| ConnectorError::MissingMoriIo {
            url: endpoint.base_url().to_owned(),
            role,
        })
}

/// The fields both legs share, describing the *remote* engine.
fn remote_fields(
    ctx: &LegContext<'_>,
    remote: &PdEndpoint,
    info: &MoriIoEndpoint,
    prefill_side: bool,
) -> Map<String, Value> {
    let mut params = Map::with_capacity(12);
    params.insert(
        "transfer_id".to_owned(),
        Value::String(MoriIo::transfer_id(ctx)),
    );
    params.insert("do_remote_decode".to_owned(), Value::Bool(prefill_side));
    params.insert("do_remote_prefill".to_owned(), Value::Bool(!prefill_side));
    params.insert(
        "remote_host".to_owned(),
        Value::String(remote.host().to_owned()),
    );
    params.insert("remote_port".to_owned(), Value::from(remote.port()));
    params.insert(
        "remote_handshake_port".to_owned(),
        Value::from(info.handshake_port),
    );
    params.insert(
        "remote_notify_port".to_owned(),
        Value::from(info.notify_port),
    );
    params.insert("remote_dp_size".to_owned(), Value::from(info.dp_size));
    params.insert("remote_tp_size".to_owned(), Value::from(info.tp_size));
    params.insert("remote_engine_id".to_owned(), Value::Null);
    params.insert("remote_block_ids".to_owned(), Value::Null);
    params
}

impl KvConnector for MoriIo {
    fn kind(&self) -> PdConnector {
        PdConnector::MoriIo(self.mode)
    }

    fn phase_order(&self) -> PhaseOrder {
        match self.mode {
            MoriIoMode::Read => PhaseOrder::Sequential,
            MoriIoMode::Write => PhaseOrder::Concurrent,
        }
    }

    fn prefill_params(&self, ctx: &LegContext<'_>) -> Result<Value, ConnectorError> {
        let decode = moriio_of(ctx.decode, "decode")?;
        moriio_of(ctx.prefill, "prefill")?;
        Ok(Value::Object(remote_fields(ctx, ctx.decode, decode, true)))
    }

    fn decode_params(
        &self,
        ctx: &LegContext<'_>,
        prefill_response: Option<&mut Value>,
    ) -> Result<DecodeHandoff, ConnectorError> {
        let prefill = moriio_of(ctx.prefill, "prefill")?;
        let mut params = remote_fields(ctx, ctx.prefill, prefill, false);
        if prefill.dp_size > 1 {
            params.insert(
                "remote_dp_rank".to_owned(),
                Value::from(ctx.prefill.dp_rank().unwrap_or(0)),
            );
        }
        if self.mode == MoriIoMode::Read {
            let Some(mut returned) = prefill_response
                .and_then(Value::as_object_mut)
                .and_then(|response| response.remove(KV_TRANSFER_PARAMS))
                .filter(Value::is_object)
            else {
                return Ok(DecodeHandoff::MissingPrefillParams);
            };
            for key in ["remote_engine_id", "remote_block_ids"] {
                if let Some(value) = returned.get_mut(key) {
                    params.insert(key.to_owned(), value.take());
                }
            }
        }
        Ok(DecodeHandoff::Params(Value::Object(params)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_parsing_and_display() {
        assert_eq!("READ".parse::<MoriIoMode>(), Ok(MoriIoMode::Read));
        assert_eq!("write".parse::<MoriIoMode>(), Ok(MoriIoMode::Write));
        assert!("both".parse::<MoriIoMode>().is_err());
        assert_eq!(MoriIoMode::Write.to_string(), "WRITE");
    }

    #[test]
    fn first_registration_decides_and_mismatch_is_refused() {
        assert_eq!(
            MoriIoMode::validate_registration(None, MoriIoMode::Write),
            Ok(MoriIoMode::Write)
        );
        assert_eq!(
            MoriIoMode::validate_registration(Some(MoriIoMode::Read), MoriIoMode::Read),
            Ok(MoriIoMode::Read)
        );
        assert_eq!(
            MoriIoMode::validate_registration(Some(MoriIoMode::Read), MoriIoMode::Write),
            Err(ModeMismatch {
                cluster: MoriIoMode::Read,
                registered: MoriIoMode::Write
            })
        );
        let gate = MoriIoModeGate::new();
        assert_eq!(gate.current(), None);
        assert!(gate.connector().is_none());
        assert_eq!(gate.admit(MoriIoMode::Read), Ok(MoriIoMode::Read));
        assert_eq!(gate.admit(MoriIoMode::Read), Ok(MoriIoMode::Read));
        assert!(gate.admit(MoriIoMode::Write).is_err());
        assert_eq!(gate.current(), Some(MoriIoMode::Read));
        assert_eq!(
            gate.connector().map(|c| c.phase_order()),
            Some(PhaseOrder::Sequential)
        );
        gate.reset();
        assert_eq!(gate.admit(MoriIoMode::Write), Ok(MoriIoMode::Write));
        assert_eq!(
            gate.connector().map(|c| c.phase_order()),
            Some(PhaseOrder::Concurrent)
        );
    }

    #[test]
    fn racing_first_registrations_agree_on_one_mode() {
        for _ in 0..50 {
            let gate = std::sync::Arc::new(MoriIoModeGate::new());
            let admitted: Vec<Vec<MoriIoMode>> = std::thread::scope(|scope| {
                let handles: Vec<_> = (0..4)
                    .map(|t| {
                        let gate = std::sync::Arc::clone(&gate);
                        scope.spawn(move || {
                            let mode = if t % 2 == 0 {
                                MoriIoMode::Read
                            } else {
                                MoriIoMode::Write
                            };
                            (0..20)
                                .filter_map(|_| gate.admit(mode).ok())
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let decided = gate.current().unwrap();
            let admitted: Vec<_> = admitted.into_iter().flatten().collect();
            assert_eq!(
                admitted.len(),
                40,
                "exactly the two threads of the winning mode got in"
            );
            assert!(admitted.iter().all(|&m| m == decided));
        }
    }
}
