//! The one conversion from a router's connector configuration
//! ([`PdConnector`]) to the connector settings of an engine (feature
//! `pd-orchestrator`).
//!
//! engine-sim keeps its own description of a connector — the
//! `kv_transfer_params` format an engine speaks ([`TransferFormat`]) and, for
//! MoRI-IO, the transfer direction ([`MoriIoMode`](crate::MoriIoMode)) — so it runs without
//! any router crate. Whether Mooncake legs run concurrently or one after
//! the other is the router's choice alone; its engines speak the same
//! format either way. The reference router's simulated engines, the
//! routing-quality simulator and every test that starts engines for a
//! router use this function.

use crate::config::{MoriIoMode as EngineMoriIoMode, TransferFormat};
use pd_orchestrator::{MoriIoMode, PdConnector};

/// The engine-sim connector and MoRI-IO mode that the engines of a
/// deployment running `connector` need (the values of
/// [`EngineConfig::kv_connector`](crate::EngineConfig::kv_connector)
/// and [`EngineConfig::moriio_mode`](crate::EngineConfig::moriio_mode)).
/// The mode is engine-sim's default, READ, for connectors other than
/// MoRI-IO.
///
/// `None` for a connector engine-sim does not simulate; every connector of
/// [`PdConnector::NAMES`] is simulated today.
///
/// ```
/// use engine_sim::{MoriIoMode, TransferFormat};
/// use pd_orchestrator::PdConnector;
///
/// let write: PdConnector = "moriio-write".parse().unwrap();
/// assert_eq!(
///     engine_sim::for_deployment(write),
///     Some((TransferFormat::MoriIo, MoriIoMode::Write))
/// );
/// ```
pub fn for_deployment(connector: PdConnector) -> Option<(TransferFormat, EngineMoriIoMode)> {
    Some(match connector {
        PdConnector::Nixl => (TransferFormat::Nixl, EngineMoriIoMode::Read),
        PdConnector::Mooncake { .. } => (TransferFormat::Mooncake, EngineMoriIoMode::Read),
        PdConnector::MoriIo(MoriIoMode::Read) => (TransferFormat::MoriIo, EngineMoriIoMode::Read),
        PdConnector::MoriIo(MoriIoMode::Write) => (TransferFormat::MoriIo, EngineMoriIoMode::Write),
        // `PdConnector` is non-exhaustive: a connector added to the router
        // has no engine-sim format until engine-sim learns it.
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_configurable_connector_maps_to_the_engines_it_needs() {
        let expected = [
            ("nixl", TransferFormat::Nixl, EngineMoriIoMode::Read),
            ("mooncake", TransferFormat::Mooncake, EngineMoriIoMode::Read),
            (
                "mooncake-sequential",
                TransferFormat::Mooncake,
                EngineMoriIoMode::Read,
            ),
            (
                "moriio-read",
                TransferFormat::MoriIo,
                EngineMoriIoMode::Read,
            ),
            (
                "moriio-write",
                TransferFormat::MoriIo,
                EngineMoriIoMode::Write,
            ),
        ];
        assert_eq!(
            expected.map(|(name, ..)| name),
            PdConnector::NAMES,
            "a name without an expected engine connector"
        );
        for (name, kv, mode) in expected {
            let connector: PdConnector = name.parse().unwrap();
            assert_eq!(for_deployment(connector), Some((kv, mode)), "{name}");
            // The names agree: the router's is the engine's plus, where the
            // router has a choice the engine does not see, a suffix.
            assert!(name.starts_with(kv.as_str()), "{name} vs {}", kv.as_str());
            // What the engines get follows from what the strategy does:
            // MoRI-IO WRITE is the concurrent MoRI-IO.
            let concurrent =
                connector.build().phase_order() == pd_orchestrator::PhaseOrder::Concurrent;
            assert_eq!(
                mode == EngineMoriIoMode::Write,
                connector.is_moriio() && concurrent,
                "{name}"
            );
        }
    }
}
