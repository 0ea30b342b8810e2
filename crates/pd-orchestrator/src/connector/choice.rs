//! [`PdConnector`]: which connector a deployment runs, as configured.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use super::{KvConnector, Mooncake, MoriIo, MoriIoMode, Nixl};

/// Which KV connector the engines use, and so how the two legs are built:
/// the one definition of the workspace (the router's config, its command
/// line and the simulator all parse and print it through [`FromStr`] and
/// [`as_str`](Self::as_str), and [`KvConnector::kind`] names a running
/// strategy with it).
///
/// ```
/// use pd_orchestrator::{MoriIoMode, PdConnector};
///
/// let connector: PdConnector = "moriio-write".parse().unwrap();
/// assert_eq!(connector, PdConnector::MoriIo(MoriIoMode::Write));
/// assert_eq!(connector.as_str(), "moriio-write");
/// assert!("rdma".parse::<PdConnector>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PdConnector {
    /// NIXL: the decode engine pulls; sequential legs.
    Nixl,
    /// Mooncake: the prefill engine pushes; both legs at once unless
    /// `concurrent` is false.
    Mooncake {
        /// Dispatch both legs together (the default) or one after the other.
        concurrent: bool,
    },
    /// MoRI-IO in READ (sequential) or WRITE (both legs at once) mode.
    MoriIo(MoriIoMode),
}

impl PdConnector {
    /// Every configurable name, for messages and help texts.
    pub const NAMES: [&'static str; 5] = [
        "nixl",
        "mooncake",
        "mooncake-sequential",
        "moriio-read",
        "moriio-write",
    ];

    /// The name [`FromStr`] reads back: `nixl`, `mooncake`,
    /// `mooncake-sequential`, `moriio-read` or `moriio-write`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Nixl => "nixl",
            Self::Mooncake { concurrent: true } => "mooncake",
            Self::Mooncake { concurrent: false } => "mooncake-sequential",
            Self::MoriIo(MoriIoMode::Read) => "moriio-read",
            Self::MoriIo(MoriIoMode::Write) => "moriio-write",
        }
    }

    /// The connector strategy.
    pub fn build(self) -> Arc<dyn KvConnector> {
        match self {
            Self::Nixl => Arc::new(Nixl),
            Self::Mooncake { concurrent: true } => Arc::new(Mooncake::concurrent()),
            Self::Mooncake { concurrent: false } => Arc::new(Mooncake::sequential()),
            Self::MoriIo(mode) => Arc::new(MoriIo::new(mode)),
        }
    }

    /// Whether this is Mooncake (a prefill needs its engine ids).
    pub fn is_mooncake(self) -> bool {
        matches!(self, Self::Mooncake { .. })
    }

    /// Whether this is MoRI-IO (every worker needs its side-channel ports).
    pub fn is_moriio(self) -> bool {
        matches!(self, Self::MoriIo(_))
    }
}

impl fmt::Display for PdConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A connector name that is not one of [`PdConnector::NAMES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown KV connector {0:?} (expected nixl, mooncake, mooncake-sequential, moriio-read or moriio-write)"
)]
pub struct UnknownConnector(pub String);

impl FromStr for PdConnector {
    type Err = UnknownConnector;

    /// Case-insensitive; `moriio` alone means READ mode.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Ok(match name.trim().to_ascii_lowercase().as_str() {
            "nixl" => Self::Nixl,
            "mooncake" => Self::Mooncake { concurrent: true },
            "mooncake-sequential" => Self::Mooncake { concurrent: false },
            "moriio" | "moriio-read" => Self::MoriIo(MoriIoMode::Read),
            "moriio-write" => Self::MoriIo(MoriIoMode::Write),
            _ => return Err(UnknownConnector(name.to_owned())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips() {
        for name in PdConnector::NAMES {
            let connector: PdConnector = name.parse().unwrap();
            assert_eq!(connector.as_str(), name);
            assert_eq!(connector.to_string(), name);
        }
        assert_eq!(
            " MoRIIO ".parse::<PdConnector>(),
            Ok(PdConnector::MoriIo(MoriIoMode::Read))
        );
        let err = "rdma".parse::<PdConnector>().unwrap_err();
        assert!(err.to_string().contains("\"rdma\""), "{err}");
    }

    #[test]
    fn every_strategy_reports_the_configuration_it_was_built_from() {
        for name in PdConnector::NAMES {
            let connector: PdConnector = name.parse().unwrap();
            let strategy = connector.build();
            assert_eq!(strategy.kind(), connector, "{name}");
            assert_eq!(strategy.kind().as_str(), name);
        }
    }
}
