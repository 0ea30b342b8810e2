//! The configuration of the prefill/decode pools.

use std::sync::Arc;

use lb_policies::{PolicyConfig, PolicyError};
use worker_lifecycle::{RoleKind, ServiceRegistry};

use crate::bootstrap::BootstrapRetry;
use crate::connector::PdConnector;
use crate::endpoint::MoriIoEndpoint;
use crate::flow::FlowConfig;

/// A refused pool configuration or static worker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolsError {
    /// A role's configuration is inconsistent (static URLs and a registry,
    /// a registry of the other role, invalid breaker settings).
    #[error("{role} workers: {reason}")]
    Role {
        /// The role.
        role: RoleKind,
        /// What is wrong.
        reason: String,
    },
    /// A static worker is refused (bad URL, duplicate, missing connector
    /// facts).
    #[error("invalid worker {url}: {reason}")]
    Worker {
        /// The URL as given.
        url: String,
        /// What is wrong, naming the role.
        reason: String,
    },
    /// A role's policy configuration is invalid.
    #[error("invalid policy configuration: {0}")]
    Policy(#[from] PolicyError),
}

/// One statically configured prefill or decode worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdWorkerConfig {
    /// Base URL, e.g. `http://10.0.0.1:8000`.
    pub url: String,
    /// Data-parallel rank addressed through this URL, if any.
    pub dp_rank: Option<u32>,
    /// Mooncake bootstrap port of a prefill engine (default 8998).
    pub bootstrap_port: Option<u16>,
    /// The model it serves, if known.
    pub model: Option<String>,
    /// KV side-channel address for the P2P request-id convention (default:
    /// the HTTP `host:port`).
    pub kv_addr: Option<String>,
    /// MoRI-IO side-channel facts (required with the MoRI-IO connector).
    pub moriio: Option<MoriIoEndpoint>,
}

impl PdWorkerConfig {
    /// A worker at `url` with nothing else set.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            dp_rank: None,
            bootstrap_port: None,
            model: None,
            kv_addr: None,
            moriio: None,
        }
    }

    /// Sets the Mooncake bootstrap port.
    #[must_use]
    pub fn with_bootstrap_port(mut self, port: u16) -> Self {
        self.bootstrap_port = Some(port);
        self
    }

    /// Sets the data-parallel rank.
    #[must_use]
    pub fn with_dp_rank(mut self, rank: u32) -> Self {
        self.dp_rank = Some(rank);
        self
    }

    /// Sets the model id.
    #[must_use]
    pub fn with_model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// Sets the KV side-channel address.
    #[must_use]
    pub fn with_kv_addr(mut self, addr: impl Into<String>) -> Self {
        self.kv_addr = Some(addr.into());
        self
    }

    /// Sets the MoRI-IO facts.
    #[must_use]
    pub fn with_moriio(mut self, moriio: MoriIoEndpoint) -> Self {
        self.moriio = Some(moriio);
        self
    }
}

/// The prefill/decode section of a router's configuration: the connector,
/// each role's policy and workers, and the flow's limits.
///
/// Each role takes its workers from static URLs or from a registry (not
/// both: a role with a registry must have no static URLs).
#[derive(Debug, Clone)]
pub struct PdConfig {
    /// The KV connector of the engines.
    pub connector: PdConnector,
    /// Policy of the prefill role (default: the router's main policy).
    pub prefill_policy: Option<PolicyConfig>,
    /// Policy of the decode role (default: the router's main policy).
    pub decode_policy: Option<PolicyConfig>,
    /// Static prefill workers.
    pub prefill: Vec<PdWorkerConfig>,
    /// Static decode workers.
    pub decode: Vec<PdWorkerConfig>,
    /// Registry of discovered prefill workers (role Prefill).
    pub prefill_registry: Option<Arc<ServiceRegistry>>,
    /// Registry of discovered decode workers (role Decode).
    pub decode_registry: Option<Arc<ServiceRegistry>>,
    /// Limits of the two-phase flow (prefill attempts, body sizes, merging).
    pub flow: FlowConfig,
    /// Retry schedule of the Mooncake bootstrap queries at startup.
    pub bootstrap_retry: BootstrapRetry,
}

impl PdConfig {
    /// A configuration for `connector` with no workers yet and default
    /// policies and limits.
    pub fn new(connector: PdConnector) -> Self {
        Self {
            connector,
            prefill_policy: None,
            decode_policy: None,
            prefill: Vec::new(),
            decode: Vec::new(),
            prefill_registry: None,
            decode_registry: None,
            flow: FlowConfig::default(),
            bootstrap_retry: BootstrapRetry::default(),
        }
    }
}
