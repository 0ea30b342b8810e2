//! One role of a prefill/decode fleet: [`PdRolePool`].

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, OnceLock};

use lb_policies::{PolicyConfig, PolicyRegistry};
use parking_lot::Mutex;
use worker_lifecycle::{
    Eligible, Endpoint, MembershipEvent, RoleKind, RolePool, SelectError, ServiceRegistry, Worker,
    WorkerOptions, WorkerRole, WorkerSpec, WorkerUrl, labels,
};

use super::config::{PdWorkerConfig, PoolsError};
use super::scope::PdScope;
use crate::connector::{MoriIoMode, PdConnector};
use crate::endpoint::{MooncakeEndpoint, MoriIoEndpoint, PdEndpoint};

/// The flow's view of each worker, by worker key (one per lifetime).
type Endpoints = Arc<Mutex<HashMap<Box<str>, Arc<PdEndpoint>>>>;

/// Called when a discovered Mooncake prefill worker joins without its
/// engine ids: the host queries its bootstrap server (off the request path)
/// and hands the answer to [`PdRolePool::set_learned`]. Runs inside the pool's
/// serialized step: spawn, never block.
pub type LearnHook = Box<dyn Fn(&Arc<Worker>, &Arc<PdEndpoint>) + Send + Sync>;

/// The workers of one role, its policies, and each worker's flow endpoint.
pub struct PdRolePool {
    pool: RolePool,
    connector: PdConnector,
    endpoints: Endpoints,
    learn: Arc<OnceLock<LearnHook>>,
}

impl std::fmt::Debug for PdRolePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PdRolePool")
            .field("pool", &self.pool)
            .field("connector", &self.connector)
            .finish_non_exhaustive()
    }
}

impl PdRolePool {
    pub(super) fn new(
        role: RoleKind,
        connector: PdConnector,
        statics: &[PdWorkerConfig],
        registry: Option<Arc<ServiceRegistry>>,
        policy: PolicyConfig,
        options: &WorkerOptions,
    ) -> Result<Self, PoolsError> {
        let invalid = |reason: String| PoolsError::Role { role, reason };
        let policies = PolicyRegistry::new(policy)?;
        let discovered = registry.is_some();
        let pool = match registry {
            Some(registry) => {
                if !statics.is_empty() {
                    return Err(invalid(
                        "a role takes its workers from static URLs or from a registry, not both"
                            .into(),
                    ));
                }
                if registry.role() != role {
                    return Err(invalid(format!(
                        "the registry given is for the {} role",
                        registry.role()
                    )));
                }
                RolePool::discovered(registry, options.clone(), policies)
            }
            None => RolePool::fixed(role, options.clone(), policies),
        }
        .map_err(|err| invalid(err.to_string()))?;
        let endpoints = Endpoints::default();
        let learn: Arc<OnceLock<LearnHook>> = Arc::default();
        let listener = {
            let (endpoints, learn) = (Arc::clone(&endpoints), Arc::clone(&learn));
            let learns = discovered && connector.is_mooncake() && role == RoleKind::Prefill;
            move |event: &MembershipEvent| {
                if let Some(old) = event.removed() {
                    endpoints.lock().remove(old.key());
                }
                let Some(new) = event.added().filter(|_| learns) else {
                    return;
                };
                if let Some(endpoint) = endpoint_of(&endpoints, new, connector)
                    && endpoint.mooncake().is_none()
                {
                    match learn.get() {
                        Some(hook) => hook(new, &endpoint),
                        None => tracing::warn!(
                            prefill = new.key(),
                            "no way to query the Mooncake bootstrap server of a discovered \
                                 prefill worker; it stays unselectable"
                        ),
                    }
                }
            }
        };
        let this = Self {
            pool: pool.with_listener(Box::new(listener)),
            connector,
            endpoints,
            learn,
        };
        for spec in statics {
            let endpoint = this.build_static(spec)?;
            this.add_static(endpoint)?;
        }
        Ok(this)
    }

    /// The role's worker source, policies and membership forwarding.
    pub fn pool(&self) -> &RolePool {
        &self.pool
    }

    /// The role.
    pub fn role(&self) -> RoleKind {
        self.pool.role()
    }

    /// The workers as of the last reconciliation (static: all of them).
    pub fn workers(&self) -> Arc<[Arc<Worker>]> {
        self.pool.workers()
    }

    /// The role's policies, one per model.
    pub fn policies(&self) -> &PolicyRegistry<Arc<Worker>> {
        self.pool.policies()
    }

    /// Selections refused because this role had no available worker.
    pub fn unavailable_count(&self) -> u64 {
        self.pool.unavailable_count()
    }

    /// Sets how discovered Mooncake prefill workers learn their engine ids
    /// (once; later calls are ignored).
    pub fn on_unlearned(&self, hook: LearnHook) {
        let _ = self.learn.set(hook);
    }

    /// Checks a static worker's spec against this role and the connector
    /// and builds what adding it takes; nothing changes yet.
    ///
    /// # Errors
    /// [`PoolsError::Worker`] naming the URL: not plain `http://`, a
    /// discovered role, or MoRI-IO facts missing.
    pub fn build_static(&self, spec: &PdWorkerConfig) -> Result<StaticWorker, PoolsError> {
        let role = self.role();
        let invalid = |reason: String| PoolsError::Worker {
            url: spec.url.clone(),
            reason: format!("{role} worker: {reason}"),
        };
        if self.pool.registry().is_some() {
            return Err(invalid("this role is discovered".into()));
        }
        // Parsed once; both the worker and its P/D endpoint use it.
        let url = WorkerUrl::parse_http(&spec.url).map_err(|err| invalid(err.to_string()))?;
        let mut endpoint = PdEndpoint::from_url(url.clone());
        if let Some(rank) = spec.dp_rank {
            endpoint = endpoint.with_dp_rank(rank);
        }
        if let Some(addr) = &spec.kv_addr {
            endpoint = endpoint.with_kv_addr(addr.clone());
        }
        match spec.moriio {
            Some(moriio) => endpoint = endpoint.with_moriio(moriio),
            None if self.connector.is_moriio() => {
                return Err(invalid(
                    "the MoRI-IO connector needs the worker's handshake and notify ports".into(),
                ));
            }
            None => {}
        }
        let worker_role = match role {
            RoleKind::Prefill => WorkerRole::Prefill {
                bootstrap_port: spec.bootstrap_port,
            },
            _ => WorkerRole::Decode,
        };
        let mut worker = WorkerSpec::new(worker_role, Endpoint::from_url(url, spec.dp_rank));
        if let Some(model) = &spec.model {
            worker = worker.with_model(model.clone());
        }
        Ok(StaticWorker {
            url: spec.url.clone(),
            bootstrap_port: spec.bootstrap_port,
            spec: worker,
            endpoint,
        })
    }

    /// Adds a worker built by [`build_static`](Self::build_static): its
    /// endpoint is known before any policy learns of it.
    ///
    /// # Errors
    /// [`PoolsError::Worker`] for a duplicate or a discovered role.
    pub fn add_static(&self, worker: StaticWorker) -> Result<Arc<Worker>, PoolsError> {
        let invalid = |reason: String| PoolsError::Worker {
            url: worker.url.clone(),
            reason: format!("{} worker: {reason}", self.role()),
        };
        let set = self
            .pool
            .static_set()
            .map_err(|err| invalid(err.to_string()))?;
        let event = set
            .add(worker.spec)
            .map_err(|err| invalid(err.to_string()))?;
        let added = event
            .added()
            .cloned()
            .ok_or_else(|| invalid("the worker set did not add it".into()))?;
        self.endpoints
            .lock()
            .insert(added.key().into(), Arc::new(worker.endpoint));
        self.pool.apply(&event);
        Ok(added)
    }

    /// The flow endpoint of `worker`: built once per worker lifetime (from
    /// its registration labels when discovered).
    pub fn endpoint(&self, worker: &Arc<Worker>) -> Option<Arc<PdEndpoint>> {
        endpoint_of(&self.endpoints, worker, self.connector)
    }

    /// Stores the Mooncake engine ids learned for `worker`; `false` when it
    /// left the role meanwhile (it stays gone).
    pub fn set_learned(&self, worker: &Arc<Worker>, mooncake: MooncakeEndpoint) -> bool {
        let mut endpoints = self.endpoints.lock();
        match endpoints.get_mut(worker.key()) {
            Some(slot) => {
                *slot = Arc::new((**slot).clone().with_mooncake(mooncake));
                true
            }
            None => false,
        }
    }

    /// Whether the connector needs facts learned at registration to address
    /// a worker of this role.
    fn needs_facts(&self) -> bool {
        match self.connector {
            PdConnector::Mooncake { .. } => self.role() == RoleKind::Prefill,
            PdConnector::MoriIo(_) => true,
            _ => false,
        }
    }

    /// Whether the flow can address `endpoint` with the connector: a
    /// Mooncake prefill needs its engine ids, a MoRI-IO worker its ports.
    fn can_address(&self, endpoint: &PdEndpoint) -> bool {
        match self.connector {
            PdConnector::Mooncake { .. } => {
                self.role() != RoleKind::Prefill || endpoint.mooncake().is_some()
            }
            PdConnector::MoriIo(_) => endpoint.moriio().is_some(),
            _ => true,
        }
    }

    /// The candidates of a request in this role: the workers that serve its
    /// model, that have not failed it already, and (for connectors that
    /// need facts learned at registration) that the connector can address.
    pub(super) fn eligible<'a>(
        &self,
        workers: &'a [Arc<Worker>],
        scope: &PdScope,
    ) -> Result<Eligible<'a>, SelectError> {
        let needs_facts = self.needs_facts();
        let failed = scope.failed_keys(self.role());
        self.pool
            .eligible(workers, &scope.request().model, |worker| {
                !failed.iter().any(|key| **key == *worker.key())
                    && (!needs_facts || self.endpoint(worker).is_some_and(|e| self.can_address(&e)))
            })
    }
}

/// A static worker checked by [`PdRolePool::build_static`], ready to add.
#[derive(Debug, Clone)]
pub struct StaticWorker {
    url: String,
    bootstrap_port: Option<u16>,
    spec: WorkerSpec,
    endpoint: PdEndpoint,
}

impl StaticWorker {
    /// Its flow endpoint.
    pub fn endpoint(&self) -> &PdEndpoint {
        &self.endpoint
    }

    /// Its Mooncake bootstrap port, if configured.
    pub fn bootstrap_port(&self) -> Option<u16> {
        self.bootstrap_port
    }

    /// Sets the Mooncake engine ids learned before adding it.
    #[must_use]
    pub fn with_mooncake(mut self, mooncake: MooncakeEndpoint) -> Self {
        self.endpoint = self.endpoint.with_mooncake(mooncake);
        self
    }
}

fn endpoint_of(
    endpoints: &Endpoints,
    worker: &Arc<Worker>,
    connector: PdConnector,
) -> Option<Arc<PdEndpoint>> {
    let mut endpoints = endpoints.lock();
    if let Some(endpoint) = endpoints.get(worker.key()) {
        return Some(Arc::clone(endpoint));
    }
    let endpoint = Arc::new(discovered_endpoint(worker, connector)?);
    endpoints.insert(worker.key().into(), Arc::clone(&endpoint));
    Some(endpoint)
}

/// The flow endpoint of a discovered worker, from its registration labels
/// (the contract in [`worker_lifecycle::labels`]). `None` for a MoRI-IO
/// worker registered in the other mode, which is refused.
pub(super) fn discovered_endpoint(worker: &Worker, connector: PdConnector) -> Option<PdEndpoint> {
    let mut endpoint = PdEndpoint::from_url(worker.endpoint().worker_url().clone());
    if let Some(rank) = worker.dp_rank() {
        endpoint = endpoint.with_dp_rank(rank);
    }
    let labels = worker.labels();
    if let Some(addr) = labels.get(labels::KV_ADDR) {
        endpoint = endpoint.with_kv_addr(addr.clone());
    }
    let number = |key: &str| labels.get(key).and_then(|v| v.trim().parse::<u32>().ok());
    if let PdConnector::MoriIo(mode) = connector {
        if let Some(label) = labels.get(labels::MORIIO_MODE) {
            let refused = match label.parse::<MoriIoMode>() {
                Ok(registered) => MoriIoMode::validate_registration(Some(mode), registered)
                    .err()
                    .map(|mismatch| mismatch.to_string()),
                Err(err) => Some(err.to_string()),
            };
            if let Some(reason) = refused {
                tracing::warn!(worker = worker.key(), %reason, "MoRI-IO worker refused");
                return None;
            }
        }
        let port = |key: &str| labels.get(key).and_then(|v| v.trim().parse::<u16>().ok());
        if let (Some(handshake_port), Some(notify_port)) = (
            port(labels::MORIIO_HANDSHAKE_PORT),
            port(labels::MORIIO_NOTIFY_PORT),
        ) {
            endpoint = endpoint.with_moriio(MoriIoEndpoint {
                handshake_port,
                notify_port,
                dp_size: number(labels::DP_SIZE).unwrap_or(1),
                tp_size: number(labels::TP_SIZE).unwrap_or(1),
            });
        }
    }
    if connector.is_mooncake()
        && let WorkerRole::Prefill { bootstrap_port } = worker.role()
    {
        let engine_ids: BTreeMap<u32, String> = labels
            .iter()
            .filter_map(|(key, value)| {
                let rank = match key.strip_prefix(labels::MOONCAKE_ENGINE_ID)? {
                    "" => 0,
                    rest => rest.strip_prefix('.')?.parse().ok()?,
                };
                Some((rank, value.clone()))
            })
            .collect();
        if !engine_ids.is_empty() {
            let bootstrap_addr = endpoint.mooncake_bootstrap_addr(bootstrap_port);
            endpoint = endpoint.with_mooncake(MooncakeEndpoint {
                bootstrap_addr,
                engine_ids,
            });
        }
    }
    Some(endpoint)
}
