//! vLLM registration discovery (`--vllm-discovery-address`), wired to the
//! router.
//!
//! The protocol lives in the `worker-discovery` crate: the ZMQ listener,
//! both wire forms, the registries and the label contract. This module only
//! plugs it into router-http, which it does not know:
//!
//! - [`NetworkCheck`]: `--worker-networks` as worker-discovery's
//!   [`AddressCheck`], through router-http's own check of run-time worker
//!   addresses, so a discovered engine passes the same test as one added
//!   with `POST /add_worker`;
//! - [`register_hook`]: worker-discovery's [`Registrar`] as router-http's
//!   [`RegisterHook`], so `POST /register` feeds the listener's registries
//!   after router-http checked the admin key;
//! - [`metrics_source`]: the listener's counters as `router_discovery_*`
//!   families on the router's `/metrics`.

use router_http::metrics::{Exposition, MetricType, MetricsSource};
use router_http::{ApiError, CidrBlock, RegisterHook};
use std::sync::Arc;
use std::time::Duration;
use worker_discovery::{AddressCheck, AddressRefused, CheckFuture, RegisterError};
use worker_lifecycle::WorkerUrl;

pub use worker_discovery::{
    DiscoveryConfig, DiscoveryError, EngineRegistration, Registrar, Registries, ZmqDiscovery,
};

/// Engines must be inside these networks (a host name is resolved, and all
/// its addresses must be inside).
#[derive(Debug, Clone)]
pub struct NetworkCheck {
    networks: Vec<CidrBlock>,
    resolve_timeout: Duration,
}

impl NetworkCheck {
    /// Admits engines inside `networks`, resolving host names within
    /// `resolve_timeout`. With no networks there is nothing to check:
    /// `None`.
    pub fn new(networks: Vec<CidrBlock>, resolve_timeout: Duration) -> Option<Self> {
        (!networks.is_empty()).then_some(Self {
            networks,
            resolve_timeout,
        })
    }
}

impl AddressCheck for NetworkCheck {
    fn check<'a>(&'a self, url: &'a WorkerUrl) -> CheckFuture<'a> {
        Box::pin(async move {
            let checked =
                router_http::allow::check_worker_address(url, &self.networks, self.resolve_timeout)
                    .await;
            checked.map_err(|err| match err {
                ApiError::WorkerAddressNotAllowed(reason) => AddressRefused::new(reason),
                other => AddressRefused::new(other.to_string()),
            })
        })
    }

    // --worker-networks bounds every address an engine announces, the
    // ZMQ address it gives its peers included.
    fn checks_peer_addresses(&self) -> bool {
        true
    }
}

/// The ZMQ listener's counters on the router's `/metrics`, read at each
/// scrape: whether its receive loop runs, how often it was restarted, and
/// the messages it refused (malformed, or outside `--worker-networks`).
pub fn metrics_source(discovery: &ZmqDiscovery) -> Arc<dyn MetricsSource> {
    let counters = discovery.counters();
    Arc::new(move |exposition: &mut Exposition<'_>| {
        exposition
            .family(
                "router_discovery_receiving",
                MetricType::Gauge,
                "1 while the ZMQ discovery receive loop runs, 0 between a failure and its restart.",
            )
            .sample(&[], u64::from(counters.is_receiving()));
        exposition
            .family(
                "router_discovery_receive_restarts_total",
                MetricType::Counter,
                "Times the ZMQ discovery receive loop ended and was restarted.",
            )
            .sample(&[], counters.receive_restarts());
        let mut refused = exposition.family(
            "router_discovery_refused_total",
            MetricType::Counter,
            "Registrations refused, by reason (malformed message, address outside --worker-networks).",
        );
        refused.sample(&[("reason", &"malformed")], counters.malformed_messages());
        refused.sample(&[("reason", &"address")], counters.refused_addresses());
    })
}

/// Binds the ZMQ listener on `address`, admitting only engines inside
/// `networks` (any when empty); a host name is resolved within
/// `resolve_timeout`, beside the receive loop.
pub async fn bind(
    address: &str,
    ttl: Duration,
    networks: Vec<CidrBlock>,
    resolve_timeout: Duration,
    max_message_size: usize,
) -> Result<ZmqDiscovery, DiscoveryError> {
    let config = DiscoveryConfig {
        ttl,
        check_timeout: resolve_timeout,
        max_message_size,
        ..DiscoveryConfig::default()
    };
    let check = NetworkCheck::new(networks, resolve_timeout)
        .map(|check| Arc::new(check) as Arc<dyn AddressCheck>);
    ZmqDiscovery::bind_with(address, &config, check).await
}

/// `POST /register` answered by `registrar`: the body is the registration
/// map as JSON; the answer is
/// `{"status": "registered", "role", "url", "generation"}`, a malformed map
/// is 400 and an engine outside the allowed networks 403.
pub fn register_hook(registrar: Registrar) -> Arc<dyn RegisterHook> {
    Arc::new(move |body: bytes::Bytes| {
        let registrar = registrar.clone();
        async move {
            match registrar.register_json(&body).await {
                Ok(registered) => Ok(registered.to_json()),
                Err(err) => {
                    tracing::warn!(error = %err, "refused an HTTP registration");
                    Err(api_error(err))
                }
            }
        }
    })
}

/// The one mapping of a refused registration to HTTP.
fn api_error(err: RegisterError) -> ApiError {
    match err {
        RegisterError::AddressRefused(refused) => {
            ApiError::WorkerAddressNotAllowed(refused.reason().to_owned())
        }
        other => ApiError::InvalidRequest(other.to_string()),
    }
}
