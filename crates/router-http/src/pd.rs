//! Prefill/decode disaggregation: role-separated pools, pair selection, and
//! the hyper side of `pd-orchestrator`'s two-phase flow.
//!
//! In P/D mode ([`RouterConfig::pd`](crate::RouterConfig::pd)) the router
//! keeps two pools of workers, one per role, each with its own policy
//! registry. A prefill worker and a decode worker at the same URL are two
//! workers with two loads (invariant 2 of docs/architecture.md). Workers come from static URLs
//! ([`PdConfig::prefill`], [`PdConfig::decode`]) or from a
//! [`ServiceRegistry`] per role that a discovery listener feeds.
//!
//! # Pair selection
//!
//! [`PdPools::select_pair`] runs both roles' serialized steps nested
//! (prefill pool, then decode pool — always that order, so two requests
//! cannot deadlock): each step reads its registry, reconciles, and forwards
//! the membership events to that role's policies. Only when both roles are
//! reconciled does it decide: if either role has no available candidate the
//! answer is a 503 naming the role, decided *before* either policy is asked
//! (a cache-aware policy inserts the prompt into its tree when it selects),
//! so a refused request leaves no tree entry and no load behind
//! (invariant 13). Then the prefill policy chooses and the prefill worker is
//! reserved.
//!
//! When the connector dispatches both legs at once (Mooncake, MoRI-IO
//! WRITE), the decode policy chooses in the same step and the decode worker
//! is reserved too. With NIXL and sequential Mooncake
//! ([`PdPools::late_decode`]) the request starts with
//! [`PdPools::select_prefill`]: the decode worker is chosen only when the
//! prefill has completed, by the decode policy inside the decode pool's
//! serialized step, and reserved in that same step right before the decode
//! leg is dispatched. A load-aware decode policy then sees every decode leg
//! already running, and decode load is not counted during a long prefill
//! (invariant 9). If the decode pool emptied meanwhile, the client gets a
//! 503 naming the decode role after the prefill was released normally.
//! MoRI-IO READ is sequential too, but its prefill leg names the decode
//! engine, so its decode worker is still chosen at arrival (and reserved at
//! dispatch).
//!
//! # The flow
//!
//! [`PdPools`] is the [`PdBackend`] of `pd-orchestrator`'s [`PdFlow`]:
//! reservations are worker-lifecycle [`LoadGuard`]s, a failed prefill is
//! replaced by a fresh prefill selection that excludes every prefill worker
//! that already failed this request, and each leg's outcome goes to its
//! worker's circuit breaker and to the per-phase counters.
//! [`HyperTransport`] sends the legs through the router's pooled
//! [`UpstreamClient`]. The decode response body owns the decode guard
//! (inside `pd-orchestrator`'s `PdBody`) and the router's admission permit
//! (the surrounding [`GuardedBody`]); both are released at end of stream, at
//! a body error, or when the client goes away.
//!
//! # Mooncake
//!
//! A Mooncake decode leg names the prefill engine's KV engine id, learned
//! from the prefill's bootstrap server. [`Router::start`](crate::Router::start)
//! (or [`Router::bootstrap_pd`](crate::Router::bootstrap_pd)) queries every
//! static prefill worker once at startup, with retries; a prefill worker
//! whose engine ids are not known is not selected. A discovered prefill
//! worker is queried in the background when it joins its pool.
//!
//! # Example
//!
//! ```
//! use router_http::{PdConfig, PdConnector, PdWorkerConfig, Router, RouterConfig};
//!
//! let mut pd = PdConfig::new(PdConnector::Nixl);
//! pd.prefill = vec![PdWorkerConfig::new("http://10.0.0.1:8000")];
//! // The same URL as a decode worker is a second, separate worker.
//! pd.decode = vec![
//!     PdWorkerConfig::new("http://10.0.0.1:8000"),
//!     PdWorkerConfig::new("http://10.0.0.2:8000"),
//! ];
//! let config = RouterConfig { pd: Some(pd), ..RouterConfig::default() };
//! // `Router::start(config).await` also runs the Mooncake bootstrap.
//! let router = Router::new(config)?;
//! let pools = router.pd().expect("P/D mode");
//! assert_eq!(pools.prefill().workers().len(), 1);
//! assert_eq!(pools.decode().workers().len(), 2);
//! assert_eq!(router.all_workers().len(), 3);
//! assert!(router.is_ready(), "an available worker in each role");
//! # Ok::<(), router_http::ConfigError>(())
//! ```

use crate::body::{BodyEnd, BoxBody, BoxError, Finish, GuardedBody, IdleTimeout};
use crate::client::{UpstreamClient, UpstreamError};
use crate::config::{ConfigError, RouterConfig};
use crate::error::ApiError;
use crate::extract::{RequestInfo, RoutingInput};
use crate::headers::{RequestId, strip_hop_by_hop};
use crate::limits::AdmissionPermit;
use crate::metrics::{Counter, escape_label, family, sample};
use crate::router::Shared;
use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use lb_policies::{PolicyConfig, PolicyRegistry, RequestContext};
use parking_lot::Mutex;
use pd_orchestrator::bootstrap::{BootstrapQuery, BootstrapRetry, Sleeper, learn_engine_ids};
use pd_orchestrator::{
    FlowConfig, FlowStatsSnapshot, ForwardHeaders, KvConnector, LegOutcome, LegRequest,
    LegResponse, Mooncake, MoriIo, MoriIoEndpoint, MoriIoMode, Nixl, PdBackend, PdEndpoint,
    PdError, PdFlow, PdRequest, PdWorker, Phase, PhaseOrder, Transport,
};
use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use worker_lifecycle::{
    Endpoint, LoadGuard, MembershipEvent, Outcome, PoolError, RoleKind, ServiceRegistry,
    StaticWorkerSet, Worker, WorkerOptions, WorkerRole, WorkerSpec, WorkerUrl,
};

/// Which KV connector the engines use, and so how the two legs are built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PdConnector {
    /// NIXL: the decode engine pulls; sequential legs.
    Nixl,
    /// Mooncake: the prefill engine pushes. `concurrent` dispatches both
    /// legs at once (the default: decode parameters do not depend on the
    /// prefill response); sequential lets a failed prefill be retried on
    /// another worker before decode starts.
    Mooncake {
        /// Dispatch decode together with prefill.
        concurrent: bool,
    },
    /// MoRI-IO in READ (sequential) or WRITE (concurrent) mode.
    MoriIo(MoriIoMode),
}

impl PdConnector {
    /// The name used on the command line: `nixl`, `mooncake`,
    /// `mooncake-sequential`, `moriio-read` or `moriio-write`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Nixl => "nixl",
            Self::Mooncake { concurrent: true } => "mooncake",
            Self::Mooncake { concurrent: false } => "mooncake-sequential",
            Self::MoriIo(MoriIoMode::Read) => "moriio-read",
            Self::MoriIo(_) => "moriio-write",
        }
    }

    fn build(self) -> Arc<dyn KvConnector> {
        match self {
            Self::Nixl => Arc::new(Nixl),
            Self::Mooncake { concurrent: true } => Arc::new(Mooncake::concurrent()),
            Self::Mooncake { concurrent: false } => Arc::new(Mooncake::sequential()),
            Self::MoriIo(mode) => Arc::new(MoriIo::new(mode)),
        }
    }

    fn is_mooncake(self) -> bool {
        matches!(self, Self::Mooncake { .. })
    }

    fn is_moriio(self) -> bool {
        matches!(self, Self::MoriIo(_))
    }
}

impl std::str::FromStr for PdConnector {
    type Err = ConfigError;

    /// Parses [`PdConnector::as_str`] names; `moriio` alone means READ.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Ok(match name.trim().to_ascii_lowercase().as_str() {
            "nixl" => Self::Nixl,
            "mooncake" => Self::Mooncake { concurrent: true },
            "mooncake-sequential" => Self::Mooncake { concurrent: false },
            "moriio" | "moriio-read" => Self::MoriIo(MoriIoMode::Read),
            "moriio-write" => Self::MoriIo(MoriIoMode::Write),
            other => {
                return Err(ConfigError::Pd(format!(
                    "unknown KV connector {other:?} (expected nixl, mooncake, \
                     mooncake-sequential, moriio-read or moriio-write)"
                )));
            }
        })
    }
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

/// Registration labels read from discovered workers (the contract lives in
/// worker-lifecycle, where discovery listeners and pools both see it).
pub use worker_lifecycle::labels;

/// The prefill/decode section of the router configuration.
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

enum Source {
    Static(StaticWorkerSet),
    Discovery {
        pool: worker_lifecycle::DiscoveryPool,
        registry: Arc<ServiceRegistry>,
    },
}

/// The workers of one role, its policies, and each worker's flow endpoint.
pub struct PdRole {
    role: RoleKind,
    connector: PdConnector,
    source: Source,
    policies: PolicyRegistry<Arc<Worker>>,
    /// The flow's view of each worker, by worker key (one per lifetime).
    endpoints: Arc<Mutex<HashMap<Box<str>, Arc<PdEndpoint>>>>,
    unavailable: Counter,
    /// How discovered Mooncake prefill workers learn their engine ids.
    bootstrap: std::sync::OnceLock<Bootstrapper>,
}

/// The client and schedule of background Mooncake bootstrap queries.
#[derive(Debug, Clone)]
struct Bootstrapper {
    client: UpstreamClient,
    retry: BootstrapRetry,
}

impl std::fmt::Debug for PdRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PdRole")
            .field("role", &self.role)
            .field("workers", &self.workers().len())
            .field("discovery", &self.registry().is_some())
            .finish_non_exhaustive()
    }
}

impl PdRole {
    fn new(
        role: RoleKind,
        connector: PdConnector,
        statics: &[PdWorkerConfig],
        registry: Option<Arc<ServiceRegistry>>,
        policy: PolicyConfig,
        options: &WorkerOptions,
    ) -> Result<Self, ConfigError> {
        let invalid = |reason: String| ConfigError::Pd(format!("{role} workers: {reason}"));
        let source = match registry {
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
                let pool = worker_lifecycle::DiscoveryPool::new(role, options.clone())
                    .map_err(|err| invalid(err.to_string()))?;
                Source::Discovery { pool, registry }
            }
            None => Source::Static(
                StaticWorkerSet::new(role, options.clone())
                    .map_err(|err| invalid(err.to_string()))?,
            ),
        };
        let this = Self {
            role,
            connector,
            source,
            policies: PolicyRegistry::new(policy)?,
            endpoints: Arc::new(Mutex::new(HashMap::new())),
            unavailable: Counter::default(),
            bootstrap: std::sync::OnceLock::new(),
        };
        for spec in statics {
            this.add_static(spec)?;
        }
        Ok(this)
    }

    fn add_static(&self, spec: &PdWorkerConfig) -> Result<Arc<Worker>, ConfigError> {
        let (worker_spec, endpoint) = self.build_static(spec)?;
        self.insert_static(worker_spec, endpoint, &spec.url)
    }

    /// Adds a static worker at run time (the admin route): a Mooncake
    /// prefill worker's engine ids are learned first, so it joins the pool
    /// already selectable.
    ///
    /// # Errors
    /// [`ConfigError::Worker`] for an invalid spec, a duplicate or a
    /// discovered role; [`ConfigError::Bootstrap`] when its bootstrap
    /// server does not answer.
    pub async fn add_worker(&self, spec: &PdWorkerConfig) -> Result<Arc<Worker>, ConfigError> {
        let (worker_spec, mut endpoint) = self.build_static(spec)?;
        if self.connector.is_mooncake() && self.role == RoleKind::Prefill {
            if let Some(bootstrapper) = self.bootstrap.get() {
                let query = HyperBootstrap(bootstrapper.client.clone());
                let learned = learn_engine_ids(
                    &query,
                    &TokioSleeper,
                    &endpoint,
                    spec.bootstrap_port,
                    &bootstrapper.retry,
                )
                .await?;
                endpoint = endpoint.with_mooncake(learned);
            }
        }
        self.insert_static(worker_spec, endpoint, &spec.url)
    }

    /// Drains the static worker at `endpoint` (no new work; waits until its
    /// load is 0 or `deadline`) and removes it. Returns whether it drained.
    ///
    /// # Errors
    /// [`ApiError::WorkerNotFound`] when no such worker is in this role;
    /// [`ApiError::InvalidRequest`] for a discovered role (its workers leave
    /// by deregistering).
    pub async fn remove_worker(
        &self,
        endpoint: &Endpoint,
        deadline: tokio::time::Instant,
    ) -> Result<bool, ApiError> {
        let set = self.static_set()?;
        let worker = set
            .get(endpoint)
            .ok_or_else(|| ApiError::WorkerNotFound(format!("{} worker {endpoint}", self.role)))?;
        self.drain_and_remove(&worker, deadline).await
    }

    /// The hand-managed worker set of a static role; a discovered role's
    /// workers leave by deregistering, not by an admin call.
    pub(crate) fn static_set(&self) -> Result<&StaticWorkerSet, ApiError> {
        match &self.source {
            Source::Static(set) => Ok(set),
            _ => Err(ApiError::InvalidRequest(format!(
                "{} workers are discovered; they leave by deregistering",
                self.role
            ))),
        }
    }

    /// [`remove_worker`](Self::remove_worker) for a worker already looked
    /// up: drains exactly this lifetime, removes it if it is still a member
    /// and tells the policies. Returns whether its load reached 0.
    pub async fn drain_and_remove(
        &self,
        worker: &Arc<Worker>,
        deadline: tokio::time::Instant,
    ) -> Result<bool, ApiError> {
        let set = self.static_set()?;
        let report = set.drain_lifetime(worker, deadline).await;
        for event in &report.events {
            self.apply(event);
        }
        Ok(matches!(
            report.outcome,
            worker_lifecycle::DrainOutcome::Idle
        ))
    }

    fn build_static(&self, spec: &PdWorkerConfig) -> Result<(WorkerSpec, PdEndpoint), ConfigError> {
        let invalid = |reason: String| ConfigError::Worker {
            url: spec.url.clone(),
            reason: format!("{} worker: {reason}", self.role),
        };
        if !matches!(self.source, Source::Static(_)) {
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
        let role = match self.role {
            RoleKind::Prefill => WorkerRole::Prefill {
                bootstrap_port: spec.bootstrap_port,
            },
            _ => WorkerRole::Decode,
        };
        let lifecycle_endpoint = Endpoint::from_url(url, spec.dp_rank);
        let mut worker_spec = WorkerSpec::new(role, lifecycle_endpoint);
        if let Some(model) = &spec.model {
            worker_spec = worker_spec.with_model(model.clone());
        }
        Ok((worker_spec, endpoint))
    }

    fn insert_static(
        &self,
        spec: WorkerSpec,
        endpoint: PdEndpoint,
        url: &str,
    ) -> Result<Arc<Worker>, ConfigError> {
        let invalid = |reason: String| ConfigError::Worker {
            url: url.to_owned(),
            reason: format!("{} worker: {reason}", self.role),
        };
        let Source::Static(set) = &self.source else {
            return Err(invalid("this role is discovered".into()));
        };
        let event = set.add(spec).map_err(|err| invalid(err.to_string()))?;
        let worker = event
            .added()
            .cloned()
            .ok_or_else(|| invalid("the worker set did not add it".into()))?;
        self.endpoints
            .lock()
            .insert(worker.key().into(), Arc::new(endpoint));
        self.apply(&event);
        Ok(worker)
    }

    /// The role.
    pub fn role(&self) -> RoleKind {
        self.role
    }

    /// The workers as of the last reconciliation (static: all of them).
    pub fn workers(&self) -> Arc<[Arc<Worker>]> {
        match &self.source {
            Source::Static(set) => set.workers(),
            Source::Discovery { pool, .. } => pool.workers(),
        }
    }

    /// Reconciles with the registry now (static: nothing to do) and returns
    /// the workers.
    pub fn refresh(&self) -> Result<Arc<[Arc<Worker>]>, ApiError> {
        self.step(Instant::now(), Arc::clone)
    }

    /// The role's policies, one per model.
    pub fn policies(&self) -> &PolicyRegistry<Arc<Worker>> {
        &self.policies
    }

    /// The registry of a discovered role.
    pub fn registry(&self) -> Option<&Arc<ServiceRegistry>> {
        match &self.source {
            Source::Static(_) => None,
            Source::Discovery { registry, .. } => Some(registry),
        }
    }

    /// The serialized step of this role: reconcile (discovery), forward the
    /// membership events to the policies, then run `f` on the workers, all
    /// under the pool's lock.
    fn step<R>(
        &self,
        now: Instant,
        f: impl FnOnce(&Arc<[Arc<Worker>]>) -> R,
    ) -> Result<R, ApiError> {
        match &self.source {
            Source::Static(set) => Ok(f(&set.workers())),
            Source::Discovery { pool, registry } => pool
                .with_reconciled(registry, now, |view| {
                    for event in view.events() {
                        self.apply(event);
                    }
                    f(&view.workers_arc())
                })
                .map_err(|err: PoolError| {
                    ApiError::NoAvailableWorker(format!("{} pool: {err}", self.role))
                }),
        }
    }

    fn apply(&self, event: &MembershipEvent) {
        for change in event.for_policies() {
            self.policies.on_membership(change);
        }
        if let Some(old) = event.removed() {
            self.endpoints.lock().remove(old.key());
        }
        if let Some(new) = event.added() {
            let discovered = matches!(self.source, Source::Discovery { .. });
            if discovered && self.connector.is_mooncake() && self.role == RoleKind::Prefill {
                if let Some(endpoint) = self.endpoint(new).filter(|e| e.mooncake().is_none()) {
                    self.learn_in_background(new, endpoint);
                }
            }
        }
    }

    /// Queries a newly discovered Mooncake prefill worker's bootstrap
    /// server off the request path; the worker becomes selectable once its
    /// engine ids are known. Spawning does not block, so this may run under
    /// the pool's lock.
    fn learn_in_background(&self, worker: &Arc<Worker>, endpoint: Arc<PdEndpoint>) {
        let (Some(bootstrapper), Ok(runtime)) = (
            self.bootstrap.get().cloned(),
            tokio::runtime::Handle::try_current(),
        ) else {
            tracing::warn!(
                prefill = worker.key(),
                "no runtime to query the Mooncake bootstrap server of a discovered prefill worker"
            );
            return;
        };
        let endpoints = Arc::clone(&self.endpoints);
        let worker = Arc::clone(worker);
        runtime.spawn(async move {
            let query = HyperBootstrap(bootstrapper.client);
            let port = match worker.role() {
                WorkerRole::Prefill { bootstrap_port } => bootstrap_port,
                _ => None,
            };
            match learn_engine_ids(&query, &TokioSleeper, &endpoint, port, &bootstrapper.retry)
                .await
            {
                Ok(learned) => {
                    let mut endpoints = endpoints.lock();
                    // A worker that left meanwhile stays gone.
                    if let Some(slot) = endpoints.get_mut(worker.key()) {
                        *slot = Arc::new((*endpoint).clone().with_mooncake(learned));
                    }
                }
                Err(err) => tracing::error!(
                    prefill = worker.key(),
                    %err,
                    "discovered Mooncake prefill worker stays unselectable"
                ),
            }
        });
    }

    /// The flow endpoint of `worker`: built once per worker lifetime (from
    /// its registration labels when discovered).
    fn endpoint(&self, worker: &Arc<Worker>) -> Option<Arc<PdEndpoint>> {
        let mut endpoints = self.endpoints.lock();
        if let Some(endpoint) = endpoints.get(worker.key()) {
            return Some(Arc::clone(endpoint));
        }
        let endpoint = Arc::new(discovered_endpoint(worker, self.connector)?);
        endpoints.insert(worker.key().into(), Arc::clone(&endpoint));
        Some(endpoint)
    }

    /// Whether the flow can address `worker` with the connector: a Mooncake
    /// prefill needs its engine ids, a MoRI-IO worker its ports.
    fn can_address(&self, endpoint: &PdEndpoint) -> bool {
        match self.connector {
            PdConnector::Mooncake { .. } if self.role == RoleKind::Prefill => {
                endpoint.mooncake().is_some()
            }
            PdConnector::MoriIo(_) => endpoint.moriio().is_some(),
            _ => true,
        }
    }

    /// The candidates of a request: the workers that serve its model, that
    /// have not failed it already, and (for connectors that need facts
    /// learned at registration) that the connector can address. Borrows the
    /// pool's list when nothing is filtered out, the common case.
    fn candidates<'a>(
        &self,
        workers: &'a [Arc<Worker>],
        scope: &PdScope,
    ) -> Result<Cow<'a, [Arc<Worker>]>, ApiError> {
        let excluded = scope.excluded(self.role).lock();
        let model = scope.model.as_str();
        let needs_facts = match self.connector {
            PdConnector::Mooncake { .. } => self.role == RoleKind::Prefill,
            PdConnector::MoriIo(_) => true,
            _ => false,
        };
        let keep = |worker: &Arc<Worker>| {
            let serves = model.is_empty() || worker.model_id().is_none_or(|m| m == model);
            serves
                && !excluded.iter().any(|failed| Arc::ptr_eq(failed, worker))
                && (!needs_facts || self.endpoint(worker).is_some_and(|e| self.can_address(&e)))
        };
        if workers.iter().all(keep) {
            return Ok(Cow::Borrowed(workers));
        }
        let kept: Vec<Arc<Worker>> = workers.iter().filter(|w| keep(w)).cloned().collect();
        let serving_any = workers
            .iter()
            .any(|w| model.is_empty() || w.model_id().is_none_or(|m| m == model));
        if !serving_any {
            return Err(ApiError::UnknownModel(model.to_owned()));
        }
        Ok(Cow::Owned(kept))
    }

    /// Selections refused because this role had no available worker.
    pub fn unavailable_count(&self) -> u64 {
        self.unavailable.get()
    }

    fn unavailable(&self, registered: usize, candidates: usize) -> ApiError {
        self.unavailable.inc();
        let role = self.role;
        if registered == 0 {
            ApiError::NoAvailableWorker(format!("no {role} workers are registered"))
        } else {
            ApiError::NoAvailableWorker(format!(
                "no {role} worker is available ({registered} registered, {candidates} \
                 eligible for this request, none ready, healthy and admitted by its breaker)"
            ))
        }
    }

    /// Asks the policy among `candidates` (at least one available) and
    /// reserves the choice when `reserve`; a worker that refuses the
    /// reservation (it lost a race for its breaker's probe slot) is left out
    /// and the policy asked again.
    fn choose(
        &self,
        candidates: &[Arc<Worker>],
        scope: &Arc<PdScope>,
        reserve: bool,
        registered: usize,
    ) -> Result<PdTarget, ApiError> {
        let context = scope.context();
        let mut pool: Cow<'_, [Arc<Worker>]> = Cow::Borrowed(candidates);
        for _ in 0..=candidates.len() {
            let decision = self
                .policies
                .select(&pool, &context)
                .map_err(|err| ApiError::InvalidRequest(err.to_string()))?
                .ok_or_else(|| self.unavailable(registered, candidates.len()))?;
            let worker = Arc::clone(&pool[decision.index]);
            let Some(endpoint) = self.endpoint(&worker) else {
                // Its URL cannot be addressed by the flow (logged once when
                // its endpoint was built): choose again without it.
                pool.to_mut().remove(decision.index);
                continue;
            };
            let reserved = if reserve {
                match worker.try_reserve() {
                    Ok(guard) => Some(guard),
                    Err(_) => {
                        // Lost a race for its breaker's probe slot, or it
                        // just became unavailable: choose again without it.
                        pool.to_mut().remove(decision.index);
                        continue;
                    }
                }
            } else {
                None
            };
            return Ok(PdTarget(Arc::new(TargetInner {
                worker,
                endpoint,
                scope: Arc::clone(scope),
                reserved: Mutex::new(reserved),
                recorder: Mutex::new(None),
            })));
        }
        Err(self.unavailable(registered, candidates.len()))
    }
}

/// The flow endpoint of a discovered worker, from its registration labels.
fn discovered_endpoint(worker: &Worker, connector: PdConnector) -> Option<PdEndpoint> {
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
    if connector.is_mooncake() {
        if let WorkerRole::Prefill { bootstrap_port } = worker.role() {
            let engine_ids: std::collections::BTreeMap<u32, String> = labels
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
                endpoint = endpoint.with_mooncake(pd_orchestrator::MooncakeEndpoint {
                    bootstrap_addr,
                    engine_ids,
                });
            }
        }
    }
    Some(endpoint)
}

/// What one request routes by, shared by its selections (the first pair,
/// a prefill retry, a retry of the whole request).
#[derive(Debug)]
pub struct PdScope {
    model: String,
    routing: RoutingInput,
    session: Option<String>,
    user: Option<String>,
    request_id: String,
    failed_prefill: Mutex<Vec<Arc<Worker>>>,
    failed_decode: Mutex<Vec<Arc<Worker>>>,
    /// The decode worker chosen at decode dispatch by the current attempt
    /// (late decode choice), so a decode failure can exclude it.
    late_decode: Mutex<Option<Arc<Worker>>>,
}

impl PdScope {
    /// A request for `model` (empty: any) routed by `routing`.
    pub fn new(model: impl Into<String>, routing: RoutingInput) -> Self {
        Self {
            model: model.into(),
            routing,
            session: None,
            user: None,
            request_id: String::new(),
            failed_prefill: Mutex::new(Vec::new()),
            failed_decode: Mutex::new(Vec::new()),
            late_decode: Mutex::new(None),
        }
    }

    /// Sets the session and user hash keys and the request id.
    #[must_use]
    pub fn with_keys(
        mut self,
        session: Option<String>,
        user: Option<String>,
        request_id: String,
    ) -> Self {
        self.session = session;
        self.user = user;
        self.request_id = request_id;
        self
    }

    /// Leaves `worker` out of this request's later selections of its role.
    pub fn exclude(&self, worker: &Arc<Worker>) {
        let mut failed = self.excluded(worker.role().kind()).lock();
        if !failed.iter().any(|w| Arc::ptr_eq(w, worker)) {
            failed.push(Arc::clone(worker));
        }
    }

    /// The decode worker chosen at decode dispatch since the last call,
    /// if any (late decode choice; see [`PdPools::select_prefill`]).
    pub fn take_late_decode(&self) -> Option<Arc<Worker>> {
        self.late_decode.lock().take()
    }

    fn excluded(&self, role: RoleKind) -> &Mutex<Vec<Arc<Worker>>> {
        match role {
            RoleKind::Prefill => &self.failed_prefill,
            _ => &self.failed_decode,
        }
    }

    fn context(&self) -> RequestContext<'_> {
        let mut context = RequestContext::new(&self.model);
        context = match &self.routing {
            RoutingInput::Text(text) => context.with_text(text),
            RoutingInput::Tokens(tokens) => context.with_tokens(tokens),
            RoutingInput::None => context,
        };
        if let Some(session) = self.session.as_deref() {
            context = context.with_session(session);
        }
        if let Some(user) = self.user.as_deref() {
            context = context.with_user(user);
        }
        if !self.request_id.is_empty() {
            context = context.with_request_id(&self.request_id);
        }
        context
    }
}

struct TargetInner {
    worker: Arc<Worker>,
    endpoint: Arc<PdEndpoint>,
    scope: Arc<PdScope>,
    /// Reserved at selection, not yet handed to the flow.
    reserved: Mutex<Option<LoadGuard>>,
    /// A second handle of the dispatched reservation, kept until the leg's
    /// outcome is recorded so a half-open breaker's probe gets its result.
    recorder: Mutex<Option<LoadGuard>>,
}

/// A selected worker of one role, as the flow addresses it. Cheap to clone.
///
/// A target reserved at selection holds that reservation until the flow
/// dispatches its leg (or the target is dropped unused, which releases it).
#[derive(Clone)]
pub struct PdTarget(Arc<TargetInner>);

impl std::fmt::Debug for PdTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PdTarget")
            .field("worker", &self.0.worker.key())
            .field("reserved", &self.0.reserved.lock().is_some())
            .finish()
    }
}

impl PdTarget {
    /// The worker.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.0.worker
    }

    /// Whether a reservation taken at selection is still waiting for its leg.
    pub fn is_reserved(&self) -> bool {
        self.0.reserved.lock().is_some()
    }
}

impl PdWorker for PdTarget {
    fn endpoint(&self) -> &PdEndpoint {
        &self.0.endpoint
    }
}

/// A chosen (prefill, decode) pair.
#[derive(Debug, Clone)]
pub struct PdPair {
    /// The prefill worker, reserved.
    pub prefill: PdTarget,
    /// The decode worker: reserved when the connector runs both legs at
    /// once, otherwise reserved when its leg is dispatched.
    pub decode: PdTarget,
}

const OUTCOMES: [&str; 4] = ["success", "worker_failure", "client_error", "cancelled"];

/// Per-phase counters of the P/D path.
#[derive(Debug, Default)]
pub struct PdMetrics {
    /// Leg outcomes: `[phase][outcome]`, phase 0 prefill, 1 decode.
    outcomes: [[Counter; 4]; 2],
}

impl PdMetrics {
    fn record(&self, phase: Phase, outcome: LegOutcome) {
        let slot = match outcome {
            LegOutcome::Success => 0,
            LegOutcome::WorkerFailure => 1,
            LegOutcome::ClientError => 2,
            _ => 3,
        };
        self.outcomes[phase_index(phase)][slot].inc();
    }

    /// Legs of `phase` that ended with `outcome` (`success`,
    /// `worker_failure`, `client_error` or `cancelled`).
    pub fn outcomes(&self, phase: Phase, outcome: &str) -> u64 {
        OUTCOMES
            .iter()
            .position(|o| *o == outcome)
            .map_or(0, |slot| self.outcomes[phase_index(phase)][slot].get())
    }
}

fn phase_index(phase: Phase) -> usize {
    match phase {
        Phase::Prefill => 0,
        Phase::Decode => 1,
    }
}

/// One role's candidates for a request, borrowed from the pool's list when
/// nothing was filtered out.
type Candidates<'a> = Cow<'a, [Arc<Worker>]>;

/// Both roles' pools and policies: pair selection, and the flow's backend.
#[derive(Debug)]
pub struct PdPools {
    prefill: PdRole,
    decode: PdRole,
    connector: PdConnector,
    concurrent: bool,
    /// Sequential connector whose prefill does not name the decode engine:
    /// the decode worker is chosen at decode dispatch.
    late_decode: bool,
    metrics: PdMetrics,
}

impl PdPools {
    /// Builds both roles from `config`: static workers are added at once,
    /// discovered ones appear at the first step that reconciles them. The
    /// role policies default to `default_policy`.
    pub fn new(
        config: &PdConfig,
        default_policy: &PolicyConfig,
        options: &WorkerOptions,
    ) -> Result<Self, ConfigError> {
        let connector = config.connector;
        let prefill = PdRole::new(
            RoleKind::Prefill,
            connector,
            &config.prefill,
            config.prefill_registry.clone(),
            config
                .prefill_policy
                .clone()
                .unwrap_or_else(|| default_policy.clone()),
            options,
        )?;
        let decode = PdRole::new(
            RoleKind::Decode,
            connector,
            &config.decode,
            config.decode_registry.clone(),
            config
                .decode_policy
                .clone()
                .unwrap_or_else(|| default_policy.clone()),
            options,
        )?;
        let kv = connector.build();
        let concurrent = kv.phase_order() == PhaseOrder::Concurrent;
        let late_decode = !concurrent && !kv.prefill_names_decode();
        Ok(Self {
            prefill,
            decode,
            connector,
            concurrent,
            late_decode,
            metrics: PdMetrics::default(),
        })
    }

    /// The prefill role.
    pub fn prefill(&self) -> &PdRole {
        &self.prefill
    }

    /// The decode role.
    pub fn decode(&self) -> &PdRole {
        &self.decode
    }

    /// The connector.
    pub fn connector(&self) -> PdConnector {
        self.connector
    }

    /// The per-phase counters.
    pub fn metrics(&self) -> &PdMetrics {
        &self.metrics
    }

    /// Whether the decode worker is chosen late, at decode dispatch (NIXL
    /// and sequential Mooncake): requests then start with
    /// [`select_prefill`](Self::select_prefill) and the flow's
    /// `run_late_decode`.
    pub fn late_decode(&self) -> bool {
        self.late_decode
    }

    /// Chooses a (prefill, decode) pair for `scope`; see the module docs.
    ///
    /// # Errors
    /// [`ApiError::NoAvailableWorker`] (503, naming the role) when a role
    /// has no available candidate — decided after both roles were
    /// reconciled and before either policy was asked, so nothing is left
    /// behind; [`ApiError::UnknownModel`] when no worker of a role serves
    /// the model.
    pub fn select_pair(&self, scope: &Arc<PdScope>) -> Result<PdPair, ApiError> {
        self.select_pair_at(scope, Instant::now())
    }

    /// [`select_pair`](Self::select_pair) with the registries read at `now`
    /// (entries whose time-to-live ended by then are expired).
    ///
    /// # Errors
    /// As [`select_pair`](Self::select_pair).
    pub fn select_pair_at(&self, scope: &Arc<PdScope>, now: Instant) -> Result<PdPair, ApiError> {
        self.prefill
            .step(now, |prefill_workers| {
                self.decode.step(now, |decode_workers| {
                    self.choose_pair(scope, prefill_workers, decode_workers)
                })
            })
            .and_then(|inner| inner)
            .and_then(|inner| inner)
    }

    /// Chooses and reserves only the prefill worker of a request whose
    /// decode worker is chosen late, at decode dispatch
    /// ([`late_decode`](Self::late_decode)). Both roles are still
    /// reconciled and checked exactly as in
    /// [`select_pair`](Self::select_pair), so a request that could not get
    /// a decode worker now is refused before any state is left behind.
    ///
    /// # Errors
    /// As [`select_pair`](Self::select_pair).
    pub fn select_prefill(&self, scope: &Arc<PdScope>) -> Result<PdTarget, ApiError> {
        self.select_prefill_at(scope, Instant::now())
    }

    /// [`select_prefill`](Self::select_prefill) with the registries read at
    /// `now`.
    ///
    /// # Errors
    /// As [`select_pair`](Self::select_pair).
    pub fn select_prefill_at(
        &self,
        scope: &Arc<PdScope>,
        now: Instant,
    ) -> Result<PdTarget, ApiError> {
        self.prefill
            .step(now, |prefill_workers| {
                self.decode.step(now, |decode_workers| {
                    self.choose_prefill(scope, prefill_workers, decode_workers)
                })
            })
            .and_then(|inner| inner)
            .and_then(|inner| inner)
    }

    /// The decode worker of a late decode choice, chosen by the decode
    /// policy inside the decode pool's serialized step and reserved in that
    /// same step, so the loads the policy sees are exact.
    fn select_decode_at(&self, scope: &Arc<PdScope>, now: Instant) -> Result<PdTarget, ApiError> {
        self.decode
            .step(now, |workers| {
                let candidates = self.decode.candidates(workers, scope)?;
                if !candidates.iter().any(|w| w.is_available()) {
                    return Err(self.decode.unavailable(workers.len(), candidates.len()));
                }
                self.decode.choose(&candidates, scope, true, workers.len())
            })
            .and_then(|inner| inner)
    }

    fn choose_pair(
        &self,
        scope: &Arc<PdScope>,
        prefill_workers: &[Arc<Worker>],
        decode_workers: &[Arc<Worker>],
    ) -> Result<PdPair, ApiError> {
        let (prefill, decode) =
            self.available_candidates(scope, prefill_workers, decode_workers)?;
        let prefill = self
            .prefill
            .choose(&prefill, scope, true, prefill_workers.len())?;
        // A decode failure here drops the prefill target, releasing it.
        let decode = self
            .decode
            .choose(&decode, scope, self.concurrent, decode_workers.len())?;
        Ok(PdPair { prefill, decode })
    }

    /// The prefill half of [`choose_pair`](Self::choose_pair) when the
    /// decode is chosen late: both roles are checked all the same.
    fn choose_prefill(
        &self,
        scope: &Arc<PdScope>,
        prefill_workers: &[Arc<Worker>],
        decode_workers: &[Arc<Worker>],
    ) -> Result<PdTarget, ApiError> {
        let (prefill, _) = self.available_candidates(scope, prefill_workers, decode_workers)?;
        self.prefill
            .choose(&prefill, scope, true, prefill_workers.len())
    }

    /// Both roles' candidates, or the 503 (or unknown model) of the first
    /// role without an available one. Both roles are checked before either
    /// policy runs: a cache-aware policy inserts the prompt into its tree
    /// when it selects.
    fn available_candidates<'a>(
        &self,
        scope: &PdScope,
        prefill_workers: &'a [Arc<Worker>],
        decode_workers: &'a [Arc<Worker>],
    ) -> Result<(Candidates<'a>, Candidates<'a>), ApiError> {
        let prefill = self.prefill.candidates(prefill_workers, scope)?;
        let decode = self.decode.candidates(decode_workers, scope)?;
        if !prefill.iter().any(|w| w.is_available()) {
            return Err(self
                .prefill
                .unavailable(prefill_workers.len(), prefill.len()));
        }
        if !decode.iter().any(|w| w.is_available()) {
            return Err(self.decode.unavailable(decode_workers.len(), decode.len()));
        }
        Ok((prefill, decode))
    }

    /// Every worker of both roles (prefill first), as last reconciled.
    pub fn workers(&self) -> Vec<Arc<Worker>> {
        let mut all: Vec<Arc<Worker>> = self.prefill.workers().iter().cloned().collect();
        all.extend(self.decode.workers().iter().cloned());
        all
    }

    /// Whether each role has an available worker (after reconciling).
    pub fn is_ready(&self) -> bool {
        let available = |role: &PdRole| {
            role.refresh()
                .is_ok_and(|workers| workers.iter().any(|w| w.is_available()))
        };
        available(&self.prefill) && available(&self.decode)
    }

    /// Learns the Mooncake engine ids of every static prefill worker that
    /// does not have them yet (a no-op for other connectors).
    ///
    /// # Errors
    /// [`ConfigError::Bootstrap`] naming the bootstrap URL when a server
    /// never answers within `retry`, or answers something unusable.
    pub async fn bootstrap(
        &self,
        client: &UpstreamClient,
        retry: &BootstrapRetry,
    ) -> Result<(), ConfigError> {
        if !self.connector.is_mooncake() {
            return Ok(());
        }
        let query = HyperBootstrap(client.clone());
        for worker in self.prefill.workers().iter() {
            let Some(endpoint) = self.prefill.endpoint(worker) else {
                continue;
            };
            if endpoint.mooncake().is_some() {
                continue;
            }
            let bootstrap_port = match worker.role() {
                WorkerRole::Prefill { bootstrap_port } => bootstrap_port,
                _ => None,
            };
            let learned =
                learn_engine_ids(&query, &TokioSleeper, &endpoint, bootstrap_port, retry).await?;
            tracing::info!(
                prefill = worker.url(),
                bootstrap = learned.bootstrap_addr,
                ranks = learned.engine_ids.len(),
                "learned Mooncake engine ids"
            );
            let updated = Arc::new((*endpoint).clone().with_mooncake(learned));
            self.prefill
                .endpoints
                .lock()
                .insert(worker.key().into(), updated);
        }
        Ok(())
    }

    /// Writes the P/D series: leg outcomes per phase, refusals per role,
    /// the flow's counters and both roles' policy decisions.
    pub(crate) fn render(&self, flow: FlowStatsSnapshot, out: &mut String) {
        family(
            out,
            "router_pd_leg_outcomes_total",
            "counter",
            "Prefill and decode legs by how they ended.",
        );
        for phase in [Phase::Prefill, Phase::Decode] {
            for outcome in OUTCOMES {
                let labels = format!("phase=\"{phase}\",outcome=\"{outcome}\"");
                sample(
                    out,
                    "router_pd_leg_outcomes_total",
                    &labels,
                    self.metrics.outcomes(phase, outcome),
                );
            }
        }
        family(
            out,
            "router_pd_unavailable_total",
            "counter",
            "Requests refused with 503 because a role had no available worker.",
        );
        for role in [&self.prefill, &self.decode] {
            sample(
                out,
                "router_pd_unavailable_total",
                &format!("role=\"{}\"", role.role),
                role.unavailable_count(),
            );
        }
        let flow_series: [(&str, &str, u64); 5] = [
            (
                "router_pd_requests_total",
                "Two-phase requests started.",
                flow.requests,
            ),
            (
                "router_pd_prefill_retries_total",
                "Prefill attempts after the first, on a fresh prefill worker.",
                flow.prefill_retries,
            ),
            (
                "router_pd_missing_prefill_kv_params_total",
                "2xx prefill responses without kv_transfer_params (decode recomputed the prompt).",
                flow.missing_prefill_kv_params,
            ),
            (
                "router_pd_merged_responses_total",
                "Non-streaming responses whose usage or prompt logprobs were merged.",
                flow.merged_responses,
            ),
            (
                "router_pd_prefill_failures_during_decode_total",
                "Concurrent prefill legs that failed while decode was already streaming.",
                flow.prefill_failures_during_decode,
            ),
        ];
        for (name, help, value) in flow_series {
            family(out, name, "counter", help);
            sample(out, name, "", value);
        }
        family(
            out,
            "router_pd_policy_decisions_total",
            "counter",
            "Policy decisions of each P/D role by model, policy and reason.",
        );
        for role in [&self.prefill, &self.decode] {
            for (model, policy, counts) in role.policies.counts() {
                let model = escape_label(&model);
                for (reason, value) in counts.iter() {
                    let labels = format!(
                        "role=\"{}\",model=\"{model}\",policy=\"{policy}\",reason=\"{reason}\"",
                        role.role
                    );
                    sample(out, "router_pd_policy_decisions_total", &labels, value);
                }
            }
        }
    }
}

/// The breaker outcome of a leg (docs/pd.md, "Wiring it into a router").
fn breaker_outcome(outcome: LegOutcome, status: Option<StatusCode>) -> Outcome {
    match (outcome, status) {
        (LegOutcome::Success, _) => Outcome::Success,
        (LegOutcome::WorkerFailure, Some(status)) if status.is_success() => {
            Outcome::ConnectionReset
        }
        (LegOutcome::WorkerFailure, Some(status)) => Outcome::from_status(status.as_u16()),
        (LegOutcome::WorkerFailure, None) => Outcome::ConnectError,
        (LegOutcome::ClientError, Some(status)) => Outcome::ClientError(status.as_u16()),
        (LegOutcome::ClientError, None) => Outcome::ClientError(400),
        _ => Outcome::ClientCancelled,
    }
}

impl PdBackend for PdPools {
    type Worker = PdTarget;
    type Guard = LoadGuard;

    fn reserve(&self, target: &PdTarget, _phase: Phase) -> LoadGuard {
        let reserved = target.0.reserved.lock().take();
        let guard = reserved.unwrap_or_else(|| {
            // A sequential decode leg, dispatched now. Its breaker admitted it
            // at selection; if it refuses now (a probe slot taken meanwhile)
            // the leg still goes out and its load is still counted.
            target
                .0
                .worker
                .try_reserve()
                .unwrap_or_else(|_| target.0.worker.reserve())
        });
        *target.0.recorder.lock() = Some(guard.share());
        guard
    }

    fn reselect_prefill(&self, failed: &PdTarget, _attempt: u32) -> Option<PdTarget> {
        let scope = Arc::clone(&failed.0.scope);
        scope.exclude(&failed.0.worker);
        self.prefill
            .step(Instant::now(), |workers| {
                let candidates = self.prefill.candidates(workers, &scope).ok()?;
                if !candidates.iter().any(|w| w.is_available()) {
                    return None;
                }
                self.prefill
                    .choose(&candidates, &scope, true, workers.len())
                    .ok()
            })
            .ok()
            .flatten()
    }

    fn select_decode(&self, prefill: &PdTarget) -> Option<PdTarget> {
        let scope = &prefill.0.scope;
        match self.select_decode_at(scope, Instant::now()) {
            Ok(decode) => {
                *scope.late_decode.lock() = Some(Arc::clone(&decode.0.worker));
                Some(decode)
            }
            Err(err) => {
                tracing::warn!(request_id = scope.request_id, %err, "no decode worker at decode dispatch");
                None
            }
        }
    }

    fn record(
        &self,
        target: &PdTarget,
        phase: Phase,
        outcome: LegOutcome,
        status: Option<StatusCode>,
    ) {
        self.metrics.record(phase, outcome);
        if let Some(handle) = target.0.recorder.lock().take() {
            handle.record_outcome(breaker_outcome(outcome, status));
            // The last handle of the reservation: the load comes down here.
            drop(handle);
        }
    }
}

/// Sends P/D legs through the router's pooled [`UpstreamClient`]; each
/// response body fails when it sends nothing for the idle timeout.
#[derive(Debug, Clone)]
pub struct HyperTransport {
    client: UpstreamClient,
    idle: Duration,
}

impl HyperTransport {
    /// A transport over `client` whose bodies time out after `idle`
    /// without a frame.
    pub fn new(client: UpstreamClient, idle: Duration) -> Self {
        Self { client, idle }
    }
}

/// A leg's response body: hyper's, with the idle timeout.
pub type LegBody = Pin<Box<IdleTimeout<crate::client::UpstreamBody>>>;

impl Transport for HyperTransport {
    type Body = LegBody;
    type Error = UpstreamError;
    type Future = Pin<Box<dyn Future<Output = Result<LegResponse<LegBody>, UpstreamError>> + Send>>;

    fn send(&self, leg: LegRequest) -> Self::Future {
        let client = self.client.clone();
        let idle = self.idle;
        Box::pin(async move {
            let mut request = Request::post(leg.url.as_str())
                .body(Full::new(leg.body))
                .map_err(|err| UpstreamError::InvalidRequest(err.to_string()))?;
            *request.headers_mut() = leg.headers;
            let response = client.send(request).await?;
            let (parts, body) = response.into_parts();
            Ok(LegResponse {
                status: parts.status,
                headers: parts.headers,
                body: Box::pin(IdleTimeout::new(body, idle)),
            })
        })
    }
}

/// `GET` of a Mooncake bootstrap `/query` through the pooled client.
struct HyperBootstrap(UpstreamClient);

/// Largest bootstrap answer read.
const MAX_BOOTSTRAP_BODY: usize = 1 << 20;

impl BootstrapQuery for HyperBootstrap {
    fn get(&self, url: &str) -> impl Future<Output = Result<Vec<u8>, String>> + Send {
        let client = self.0.clone();
        let request = Request::get(url)
            .body(Full::new(Bytes::new()))
            .map_err(|err| err.to_string());
        async move {
            let response = client.send(request?).await.map_err(|err| err.to_string())?;
            let status = response.status();
            if !status.is_success() {
                return Err(format!("status {status}"));
            }
            let body = Limited::new(response.into_body(), MAX_BOOTSTRAP_BODY)
                .collect()
                .await
                .map_err(|err| err.to_string())?;
            Ok(body.to_bytes().to_vec())
        }
    }
}

struct TokioSleeper;

impl Sleeper for TokioSleeper {
    fn sleep(&self, duration: Duration) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(duration)
    }
}

/// The P/D state of a router: the pools and the flow.
pub(crate) struct PdState {
    pub(crate) flow: PdFlow<HyperTransport, PdPools>,
    connector: Arc<dyn KvConnector>,
    bootstrap_retry: BootstrapRetry,
}

impl PdState {
    pub(crate) fn new(
        pd: &PdConfig,
        config: &RouterConfig,
        client: &UpstreamClient,
    ) -> Result<Self, ConfigError> {
        let pools = PdPools::new(pd, &config.policy, &config.worker_options)?;
        let _ = pools.prefill.bootstrap.set(Bootstrapper {
            client: client.clone(),
            retry: pd.bootstrap_retry,
        });
        let transport = HyperTransport::new(client.clone(), config.stream_idle_timeout);
        Ok(Self {
            flow: PdFlow::new(transport, Arc::new(pools), pd.flow),
            connector: pd.connector.build(),
            bootstrap_retry: pd.bootstrap_retry,
        })
    }

    pub(crate) fn pools(&self) -> &Arc<PdPools> {
        self.flow.backend()
    }

    pub(crate) async fn bootstrap(&self, client: &UpstreamClient) -> Result<(), ConfigError> {
        self.pools().bootstrap(client, &self.bootstrap_retry).await
    }

    pub(crate) fn render(&self, out: &mut String) {
        self.pools().render(self.flow.stats().snapshot(), out);
    }
}

/// Headers forwarded to both legs besides the ones the flow sets.
const FORWARDED: [&str; 3] = ["traceparent", "tracestate", "baggage"];

/// Everything one two-phase request needs from the router's path.
pub(crate) struct PdCall {
    pub(crate) parts: http::request::Parts,
    pub(crate) bytes: Bytes,
    pub(crate) info: RequestInfo,
    pub(crate) request_id: RequestId,
    pub(crate) session: Option<String>,
    pub(crate) permit: AdmissionPermit,
    pub(crate) deadline: tokio::time::Instant,
}

/// Runs one two-phase request: select a pair, run the flow, and hand the
/// decode response to the client with a body owning what the request holds.
pub(crate) async fn proxy(
    router: &crate::Router,
    shared: &Arc<Shared>,
    pd: &PdState,
    call: PdCall,
) -> Result<Response<BoxBody>, ApiError> {
    let PdCall {
        parts,
        bytes,
        info,
        request_id,
        session,
        permit,
        deadline,
    } = call;
    let parse = |bytes: &[u8]| {
        serde_json::from_slice::<serde_json::Value>(bytes)
            .map_err(|err| ApiError::InvalidJson(err.to_string()))
    };
    // Parsed once per attempt: a retry re-parses the bytes rather than the
    // first attempt paying for a deep copy it rarely needs.
    let mut body = Some(parse(&bytes)?);
    let flow_id = flow_request_id(&request_id);
    let scope = Arc::new(
        PdScope::new(info.model.unwrap_or_default(), info.routing).with_keys(
            session,
            info.user,
            flow_id.clone(),
        ),
    );
    let mut forward = ForwardHeaders::new();
    if let Some(auth) = parts.headers.get(header::AUTHORIZATION) {
        forward = forward.with_authorization(auth.clone());
    }
    for name in FORWARDED {
        if let Some(value) = parts.headers.get(name) {
            forward = forward.with_header(HeaderName::from_static(name), value.clone());
        }
    }
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());

    shared
        .retry_budget
        .record_request(std::time::Instant::now());
    let mut jitter = worker_lifecycle::SplitMix64::new(
        shared
            .jitter_seed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
    );
    let mut retries = 0u32;
    let mut last_error: Option<PdError> = None;
    let late_decode = pd.pools().late_decode();
    loop {
        // A sequential connector whose prefill does not name the decode
        // engine gets its decode worker chosen at decode dispatch, when the
        // decode policy sees every decode leg already running.
        let selected = if late_decode {
            pd.pools()
                .select_prefill(&scope)
                .map(|prefill| (prefill, None))
        } else {
            pd.pools()
                .select_pair(&scope)
                .map(|pair| (pair.prefill, Some(pair.decode)))
        };
        let (prefill, decode) = match selected {
            Ok(selected) => selected,
            // On a retry with no fresh pair left, the client hears why the
            // last attempt failed rather than that nothing is left.
            Err(err) => {
                return match last_error {
                    Some(error) => pd_error(error, &request_id),
                    None => Err(err),
                };
            }
        };
        let prefill_worker = Arc::clone(prefill.worker());
        let mut decode_worker = decode.as_ref().map(|d| Arc::clone(d.worker()));
        let attempt_body = match body.take() {
            Some(body) => body,
            None => parse(&bytes)?,
        };
        // Each attempt gets its own id: transfer ids derive from it, and a
        // retried pair must never meet an abandoned attempt's KV state.
        let attempt_id = match retries {
            0 => flow_id.clone(),
            n => format!("{flow_id}-a{n}"),
        };
        let request = PdRequest {
            path: path.clone(),
            body: attempt_body,
            request_id: attempt_id,
            forward: forward.clone(),
        };
        let run = async {
            match decode {
                Some(decode) => pd.flow.run(&pd.connector, request, prefill, decode).await,
                None => {
                    pd.flow
                        .run_late_decode(&pd.connector, request, prefill)
                        .await
                }
            }
        };
        let outcome = tokio::time::timeout_at(deadline, run).await;
        if late_decode {
            decode_worker = scope.take_late_decode();
        }
        let error = match outcome {
            Err(_elapsed) => {
                return Err(ApiError::RequestTimeout {
                    phase: "before the decode response headers (prefill/decode)",
                    timeout: shared.config.request_timeout,
                });
            }
            Ok(Ok(response)) => {
                let (mut headers, status) = (response.headers, response.status);
                strip_hop_by_hop(&mut headers);
                headers.insert(request_id.header.clone(), request_id.value.clone());
                // The flow's body errors are boxed; the timeout wrapper
                // wants a concrete error type.
                let decode_body = response.body.map_err(std::io::Error::other);
                let body = decode_stream(decode_body, deadline);
                let in_flight = PdInFlight {
                    _permit: permit,
                    shared: Arc::clone(shared),
                };
                let body = GuardedBody::new(body, in_flight)
                    .map_err(|err| -> BoxError { Box::new(err) })
                    .boxed_unsync();
                let mut out = Response::new(body);
                *out.status_mut() = status;
                *out.headers_mut() = headers;
                return Ok(out);
            }
            Ok(Err(error)) => error,
        };
        tracing::warn!(request_id = flow_id, %error, "prefill/decode request failed");
        match &error {
            PdError::DecodeFailed { .. }
            | PdError::DecodeRejected { .. }
            | PdError::DecodeBodyFailed { .. } => {
                if let Some(decode_worker) = &decode_worker {
                    scope.exclude(decode_worker);
                }
            }
            PdError::PrefillFailed { .. } => scope.exclude(&prefill_worker),
            _ => {}
        }
        if error.is_retryable() && router.may_retry(retries, deadline) {
            retries += 1;
            shared.metrics.retries.inc();
            last_error = Some(error);
            router.back_off(retries, &mut jitter, deadline).await?;
            continue;
        }
        return pd_error(error, &request_id);
    }
}

/// The decode stream as the client receives it: the whole-request deadline
/// only, because the decode leg's body already fails after the idle timeout
/// (`HyperTransport`), and a second idle timer would race the first.
fn decode_stream<B>(body: B, deadline: tokio::time::Instant) -> IdleTimeout<B> {
    IdleTimeout::deadline_only(body, deadline)
}

/// The flow's request id, unique in this process: transfer ids derive from
/// it, and two requests that share a client id (a client reusing ids, a
/// fixed header) must not rendezvous on each other's KV. It keeps the
/// client's id as a prefix when that fits the P2P convention's alphabet, for
/// correlating engine logs; the client's id itself stays on the response.
fn flow_request_id(request_id: &RequestId) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let value = request_id.value.as_bytes();
    let fits = !value.is_empty()
        && value.len() <= 80
        && value
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    match std::str::from_utf8(value) {
        Ok(client) if fits => format!("{client}.{n}"),
        _ => format!("pd-{}-{n}", std::process::id()),
    }
}

/// A flow error as the client sees it: an engine's own rejection passes
/// through with its status and body; everything else is the router's error.
fn pd_error(error: PdError, request_id: &RequestId) -> Result<Response<BoxBody>, ApiError> {
    match error {
        PdError::PrefillRejected { status, body } | PdError::DecodeRejected { status, body } => {
            let mut response = Response::new(
                Full::new(body)
                    .map_err(|never| match never {})
                    .boxed_unsync(),
            );
            *response.status_mut() = status;
            let headers = response.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            headers.insert(request_id.header.clone(), request_id.value.clone());
            Ok(response)
        }
        // Everything else through the one mapping, `PdError::status`.
        other => Err(ApiError::PrefillDecode {
            status: other.status(),
            message: match other {
                PdError::NoDecodeWorker => "no decode worker is available (the decode pool \
                                            emptied while the prefill ran)"
                    .to_owned(),
                other => other.to_string(),
            },
        }),
    }
}

/// What a two-phase response body holds besides the decode guard (which
/// lives inside the flow's body): the admission permit.
struct PdInFlight {
    _permit: AdmissionPermit,
    shared: Arc<Shared>,
}

impl Finish for PdInFlight {
    fn finish(self, end: BodyEnd) {
        let metrics = &self.shared.metrics;
        match end {
            BodyEnd::Complete => metrics.bodies_completed.inc(),
            BodyEnd::Failed => metrics.bodies_failed.inc(),
            BodyEnd::Dropped => metrics.bodies_dropped.inc(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connector_names_round_trip() {
        for connector in [
            PdConnector::Nixl,
            PdConnector::Mooncake { concurrent: true },
            PdConnector::Mooncake { concurrent: false },
            PdConnector::MoriIo(MoriIoMode::Read),
            PdConnector::MoriIo(MoriIoMode::Write),
        ] {
            assert_eq!(
                connector.as_str().parse::<PdConnector>().unwrap(),
                connector
            );
        }
        assert!("nccl".parse::<PdConnector>().is_err());
    }

    #[test]
    fn flow_errors_answer_with_the_status_pd_orchestrator_gives_them() {
        let id = RequestId {
            header: HeaderName::from_static("x-request-id"),
            value: HeaderValue::from_static("r1"),
        };
        let errors = [
            PdError::InvalidBody,
            PdError::InvalidRequestId("bad id".into()),
            PdError::DecodeNeededAtStart,
            PdError::NoDecodeWorker,
            PdError::PrefillFailed {
                attempts: 2,
                last: "reset".into(),
            },
            PdError::DecodeFailed {
                reason: "refused".into(),
            },
            PdError::DecodeBodyFailed {
                reason: "cut".into(),
            },
            PdError::Connector(pd_orchestrator::ConnectorError::MissingMooncakeBootstrap {
                url: "http://p".into(),
            }),
            PdError::DecodeRejected {
                status: StatusCode::TOO_MANY_REQUESTS,
                body: Bytes::from_static(b"{}"),
            },
        ];
        for error in errors {
            let expected = error.status();
            let answered = match pd_error(error.clone(), &id) {
                Ok(response) => response.status(),
                Err(api) => api.status(),
            };
            assert_eq!(answered, expected, "{error:?}");
        }
        // The request-id error is the router's own bug: 500, not 502.
        let api = pd_error(PdError::InvalidRequestId("x".into()), &id).unwrap_err();
        assert_eq!(api.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(api.code(), "internal_error");
    }

    #[tokio::test]
    async fn a_decode_stream_gets_one_idle_timer_from_its_leg_only() {
        let transport = HyperTransport::new(UpstreamClient::default(), Duration::from_secs(7));
        assert_eq!(
            transport.idle,
            Duration::from_secs(7),
            "the leg's idle limit"
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let stream = decode_stream(Full::new(Bytes::new()), deadline);
        assert_eq!(
            stream.idle_limit(),
            None,
            "no second idle timer around the leg"
        );
    }

    #[test]
    fn leg_outcomes_map_to_breaker_outcomes() {
        let ok = Some(StatusCode::OK);
        assert_eq!(breaker_outcome(LegOutcome::Success, ok), Outcome::Success);
        assert!(breaker_outcome(LegOutcome::WorkerFailure, ok).is_worker_failure());
        assert!(breaker_outcome(LegOutcome::WorkerFailure, None).is_worker_failure());
        assert_eq!(
            breaker_outcome(LegOutcome::WorkerFailure, Some(StatusCode::BAD_GATEWAY)),
            Outcome::ServerError(502)
        );
        assert!(!breaker_outcome(LegOutcome::ClientError, None).is_worker_failure());
        assert!(!breaker_outcome(LegOutcome::Cancelled, None).is_worker_failure());
    }

    fn labelled(role: WorkerRole, pairs: &[(&str, &str)]) -> Arc<Worker> {
        let mut spec = WorkerSpec::new(role, Endpoint::new("http://10.0.0.9:8000", None).unwrap());
        for (key, value) in pairs {
            spec = spec.with_label(*key, *value);
        }
        Worker::new(spec, 1, &WorkerOptions::default())
    }

    #[test]
    fn discovered_endpoints_come_from_registration_labels() {
        let ports = [
            (labels::MORIIO_HANDSHAKE_PORT, "7001"),
            (labels::MORIIO_NOTIFY_PORT, "7002"),
            (labels::DP_SIZE, "2"),
            (labels::KV_ADDR, "10.0.0.9:5555"),
        ];
        let read = PdConnector::MoriIo(MoriIoMode::Read);
        let worker = labelled(WorkerRole::Decode, &ports);
        let endpoint = discovered_endpoint(&worker, read).unwrap();
        let moriio = endpoint.moriio().unwrap();
        assert_eq!((moriio.handshake_port, moriio.notify_port), (7001, 7002));
        assert_eq!((moriio.dp_size, moriio.tp_size), (2, 1));
        assert_eq!(endpoint.kv_addr(), "10.0.0.9:5555");

        // A registration in the other MoRI-IO mode is refused.
        let mut write = ports.to_vec();
        write.push((labels::MORIIO_MODE, "write"));
        assert!(discovered_endpoint(&labelled(WorkerRole::Decode, &write), read).is_none());
        let mut same = ports.to_vec();
        same.push((labels::MORIIO_MODE, "read"));
        assert!(discovered_endpoint(&labelled(WorkerRole::Decode, &same), read).is_some());

        // Mooncake engine ids announced by the listener.
        let prefill = labelled(
            WorkerRole::Prefill {
                bootstrap_port: Some(9000),
            },
            &[
                (labels::MOONCAKE_ENGINE_ID, "e0"),
                ("mooncake_engine_id.1", "e1"),
            ],
        );
        let endpoint =
            discovered_endpoint(&prefill, PdConnector::Mooncake { concurrent: true }).unwrap();
        let mooncake = endpoint.mooncake().unwrap();
        assert_eq!(mooncake.bootstrap_addr, "http://10.0.0.9:9000");
        assert_eq!(mooncake.engine_id(Some(1)), Some("e1"));
        assert_eq!(mooncake.engine_id(None), Some("e0"));
    }

    #[test]
    fn client_ids_outside_the_p2p_alphabet_are_replaced() {
        let id = |value: &'static str| RequestId {
            header: HeaderName::from_static("x-request-id"),
            value: HeaderValue::from_static(value),
        };
        let first = flow_request_id(&id("abc-1.2_x"));
        let second = flow_request_id(&id("abc-1.2_x"));
        assert!(first.starts_with("abc-1.2_x."), "{first}");
        assert_ne!(
            first, second,
            "a reused client id still gives unique transfer ids"
        );
        let replaced = flow_request_id(&id("a:b"));
        assert!(replaced.starts_with("pd-"), "{replaced}");
    }
}
