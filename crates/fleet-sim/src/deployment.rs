//! The one mapping from the router's connector configuration to the
//! simulated engines' settings.
//!
//! It lives here because the simulator is the one crate that runs both
//! sides: engine-sim stands in for vLLM and knows no router crate, and
//! pd-orchestrator knows no engine. The reference router's simulated
//! engines, the simulator's prefill/decode mode and the tests that start
//! engines for a P/D router all use it.

use engine_sim::{MoriIoMode, TransferFormat};
use pd_orchestrator::{MoriIoMode as PdMoriIoMode, PdConnector};

/// The `kv_transfer_params` format and MoRI-IO mode that the engines of a
/// deployment running `connector` need (the values of
/// [`engine_sim::EngineConfig::kv_connector`] and
/// [`engine_sim::EngineConfig::moriio_mode`]). The
/// mode is engine-sim's default, READ, for connectors other than MoRI-IO.
/// Whether Mooncake legs run concurrently or one after the other is the
/// router's choice alone; its engines speak the same format either way.
///
/// `None` for a connector engine-sim does not simulate; every connector of
/// [`PdConnector::NAMES`] is simulated today.
///
/// ```
/// use pd_orchestrator::PdConnector;
/// use engine_sim::{MoriIoMode, TransferFormat};
///
/// let write: PdConnector = "moriio-write".parse().unwrap();
/// assert_eq!(
///     fleet_sim::for_deployment(write),
///     Some((TransferFormat::MoriIo, MoriIoMode::Write))
/// );
/// ```
pub fn for_deployment(connector: PdConnector) -> Option<(TransferFormat, MoriIoMode)> {
    Some(match connector {
        PdConnector::Nixl => (TransferFormat::Nixl, MoriIoMode::Read),
        PdConnector::Mooncake { .. } => (TransferFormat::Mooncake, MoriIoMode::Read),
        PdConnector::MoriIo(PdMoriIoMode::Read) => (TransferFormat::MoriIo, MoriIoMode::Read),
        PdConnector::MoriIo(PdMoriIoMode::Write) => (TransferFormat::MoriIo, MoriIoMode::Write),
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
            ("nixl", TransferFormat::Nixl, MoriIoMode::Read),
            ("mooncake", TransferFormat::Mooncake, MoriIoMode::Read),
            (
                "mooncake-sequential",
                TransferFormat::Mooncake,
                MoriIoMode::Read,
            ),
            ("moriio-read", TransferFormat::MoriIo, MoriIoMode::Read),
            ("moriio-write", TransferFormat::MoriIo, MoriIoMode::Write),
        ];
        assert_eq!(
            expected.map(|(name, ..)| name),
            PdConnector::NAMES,
            "a name without an expected engine connector"
        );
        for (name, format, mode) in expected {
            let connector: PdConnector = name.parse().unwrap();
            assert_eq!(for_deployment(connector), Some((format, mode)), "{name}");
            // The names agree: the router's is the engine's plus, where the
            // router has a choice the engine does not see, a suffix.
            assert!(
                name.starts_with(format.as_str()),
                "{name} vs {}",
                format.as_str()
            );
            // What the engines get follows from what the strategy does:
            // MoRI-IO WRITE is the concurrent MoRI-IO.
            let concurrent =
                connector.build().phase_order() == pd_orchestrator::PhaseOrder::Concurrent;
            assert_eq!(
                mode == MoriIoMode::Write,
                connector.is_moriio() && concurrent,
                "{name}"
            );
        }
    }
}
