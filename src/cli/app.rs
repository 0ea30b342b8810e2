//! Start-up, serving and graceful shutdown of the reference router.
//!
//! [`App::start`] does everything up to "serving": it binds the router (so
//! `/liveness` answers at once), binds the extra Prometheus listener,
//! starts simulated engines when asked, waits for every configured worker's
//! first healthy probe and only then adds it (so the first request can use
//! it), and starts the health checks. Until the configured workers were
//! added, router-http's [startup gate](router_http::startup) holds
//! `/health` and `/readiness` at 503 naming them, so a client that sends
//! its first request on the first `/health` 200 is served; with no worker
//! configured (an empty fleet, discovery) `/health` answers 200 at once.
//! In P/D mode the router is built with both roles' pools from the start,
//! empty or fed by discovery; each static worker joins its role once it
//! answered (a Mooncake prefill after its engine ids were learned), so one
//! router answers from the first moment and serves the whole run. With
//! `--vllm-discovery-address` the ZMQ listener (bound first) feeds the
//! pools, and router-http answers `POST /register` through a hook that
//! feeds the same registries over HTTP. [`App::stop`]
//! is the graceful shutdown: readiness and health turn 503 at once, new
//! requests are refused, the listener stays open while requests are in
//! flight so that load balancers can see the 503, and everything is done
//! within the grace period.

use super::discovery::{DiscoveryError, ZmqDiscovery};
use super::kubernetes::{KubernetesDiscovery, KubernetesError};
use super::settings::{Mode, PdDeployment, Settings, join_host_port};
use bytes::Bytes;
use engine_sim::{EngineConfig, EngineHandle, ServeOptions, TransferRegistry};
use hyper::body::Incoming;
use pd_orchestrator::MoriIoEndpoint;
use router_http::{
    ClientConfig, HttpProbe, PdConfig, PdConnector, PdWorkerConfig, Router, RouterConfig,
    UpstreamClient,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use worker_lifecycle::RoleKind;

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The ZMQ discovery listener could not start.
    #[error("--vllm-discovery-address: {0}")]
    Discovery(#[from] DiscoveryError),
    /// Kubernetes discovery could not start (a 403 names the RBAC rule).
    #[error("--service-discovery: {0}")]
    Kubernetes(#[from] KubernetesError),
    /// The router configuration was refused.
    #[error("invalid router configuration: {0}")]
    Config(#[from] router_http::ConfigError),
    /// A listener could not be bound.
    #[error("cannot listen on {address}: {source}")]
    Bind {
        /// The address.
        address: String,
        /// The error.
        source: std::io::Error,
    },
    /// A simulated engine could not start.
    #[error("cannot start a simulated engine: {0}")]
    Engine(std::io::Error),
    /// Configured workers did not become healthy in time.
    #[error(
        "workers not healthy within {timeout_secs} s (GET {endpoint} never answered 2xx): {urls:?}"
    )]
    WorkersNotReady {
        /// The workers that never answered.
        urls: Vec<String>,
        /// The endpoint probed.
        endpoint: String,
        /// The startup timeout.
        timeout_secs: u64,
    },
}

/// A simulated engine started in-process, with its role for the banner.
#[derive(Debug)]
struct SimEngine {
    role: &'static str,
    handle: EngineHandle,
}

/// A running router: the listeners, engines, discovery and background tasks.
#[derive(Debug)]
pub struct App {
    router: Router,
    addr: SocketAddr,
    prometheus_addr: Option<SocketAddr>,
    engines: Vec<SimEngine>,
    worker_urls: Vec<String>,
    discovery: Option<ZmqDiscovery>,
    kubernetes: Option<KubernetesDiscovery>,
    policy: &'static str,
    grace: Duration,
    serve: JoinHandle<router_http::ShutdownOutcome>,
    metrics_server: Option<JoinHandle<()>>,
    stop: watch::Sender<bool>,
    background: Option<router_http::BackgroundTasks>,
}

/// How a stop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopOutcome {
    /// Every request in flight finished within the grace period.
    Drained,
    /// The grace period ran out; what was left was cut.
    DeadlineReached,
}

/// MoRI-IO side-channel ports announced for simulated engines (engine-sim
/// does not open them; the router only passes them on).
const SIM_MORIIO: MoriIoEndpoint = MoriIoEndpoint {
    handshake_port: 7301,
    notify_port: 7302,
    dp_size: 1,
    tp_size: 1,
};

impl App {
    /// Starts everything `settings` asks for and returns once the router is
    /// serving and every configured worker is healthy and routable.
    pub async fn start(settings: &Settings) -> Result<Self, StartError> {
        if !settings.ignored.is_empty() {
            tracing::warn!(
                flags = %settings.ignored.join(", "),
                "these settings have no effect in this router and are ignored"
            );
        }
        tracing::info!(settings = %settings.summary(), "starting affinity-router");
        // Discovery first: `POST /register` feeds its registries from the
        // moment the router answers.
        let discovery = match &settings.mode {
            Mode::PrefillDecode(PdDeployment {
                discovery: Some(address),
                ..
            }) => Some(bind_discovery(settings, address).await?),
            _ => None,
        };
        // Kubernetes discovery next: a 403 stops the start here.
        let kubernetes = match &settings.mode {
            Mode::Kubernetes(k8s) => Some(super::kubernetes::start(k8s).await?),
            _ => None,
        };
        let register_hook = discovery
            .as_ref()
            .map(|discovery| super::discovery::register_hook(discovery.registrar().clone()));
        // The router answers /health from here on; its workers join as they
        // answer their first probe (P/D: both roles' pools exist already,
        // empty until then or fed by discovery).
        let pd = match &settings.mode {
            Mode::SimulatedPd { .. } => Some(pd_pools(settings, settings.args.kv_connector, None)),
            Mode::PrefillDecode(deployment) => Some(pd_pools(
                settings,
                deployment.kv_connector,
                discovery.as_ref(),
            )),
            Mode::Kubernetes(k8s) => k8s.pd.as_ref().zip(kubernetes.as_ref()).map(|(pd, k8s)| {
                let mut config = pd_pools(settings, pd.kv_connector, None);
                let registries = k8s.registries();
                config.prefill_registry = Some(Arc::clone(&registries.prefill));
                config.decode_registry = Some(Arc::clone(&registries.decode));
                config
            }),
            _ => None,
        };
        let worker_registry = match (&settings.mode, &kubernetes) {
            (Mode::Kubernetes(k8s), Some(discovery)) if k8s.pd.is_none() => {
                Some(Arc::clone(&discovery.registries().regular))
            }
            _ => settings.router.worker_registry.clone(),
        };
        let mut metrics_sources = settings.router.metrics_sources.clone();
        if let Some(kubernetes) = &kubernetes {
            metrics_sources.push(super::kubernetes::metrics_source(kubernetes));
        }
        if let Some(discovery) = &discovery {
            metrics_sources.push(super::discovery::metrics_source(discovery));
        }
        let config = RouterConfig {
            register_hook,
            pd,
            worker_registry,
            metrics_sources,
            ..settings.router.clone()
        };
        let router = Router::new(config)?;
        // Until the workers given here joined, /health and /readiness
        // answer 503 naming them; the listener binds next.
        router.startup_gate().await_workers(
            startup_workers(&settings.mode),
            settings.router.worker_startup_timeout,
        );

        let bind = settings.bind_address();
        let listener = TcpListener::bind(&bind)
            .await
            .map_err(|source| StartError::Bind {
                address: bind.clone(),
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| StartError::Bind {
            address: bind,
            source,
        })?;
        let (stop, stopped) = watch::channel(false);
        let serve = {
            let service_router = router.clone();
            let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
                let router = service_router.clone();
                async move { Ok::<_, std::convert::Infallible>(router.handle(request).await) }
            });
            let shutdown = wait_for_stop(
                router.clone(),
                stopped.clone(),
                settings.router.shutdown_grace,
            );
            let grace = settings.router.shutdown_grace;
            let server = settings.router.server.clone();
            tokio::spawn(async move {
                router_http::serve_with(listener, service, shutdown, &server, move || grace).await
            })
        };
        tracing::info!(%addr, "router listening; /liveness answers now");

        let prometheus = join_host_port(
            &settings.args.prometheus_host,
            settings.args.prometheus_port,
        );
        let (prometheus_addr, metrics_server) =
            match serve_metrics(&router, &prometheus, stopped.clone()).await {
                Ok((addr, task)) => (Some(addr), Some(task)),
                Err(err) => {
                    tracing::warn!(
                        address = %prometheus,
                        error = %err,
                        "cannot bind the Prometheus listener; metrics stay available at /metrics \
                         on the main port"
                    );
                    (None, None)
                }
            };

        let mut app = App {
            router,
            addr,
            prometheus_addr,
            engines: Vec::new(),
            worker_urls: Vec::new(),
            discovery,
            kubernetes,
            policy: settings.args.policy.as_str(),
            grace: settings.router.shutdown_grace,
            serve,
            metrics_server,
            stop,
            background: None,
        };
        if let Err(err) = app.start_workers(settings).await {
            app.stop().await;
            return Err(err);
        }
        // Every configured worker joined (simulated engines are awaited by
        // a name, not by URL): /health follows its usual rule from here.
        app.router().startup_gate().open();
        app.background = Some(app.router().spawn_background());
        tracing::info!(workers = app.router().all_workers().len(), "ready");
        Ok(app)
    }

    /// What a simulated engine publishes: KV events on free loopback ports
    /// when a pool's policy is kv_aware, nothing otherwise.
    fn engine_kv_events(&self) -> Option<engine_sim::KvEventsOptions> {
        self.router.kv_events()?;
        let any_port = SocketAddr::from(([127, 0, 0, 1], 0));
        Some(engine_sim::KvEventsOptions::new(any_port).with_replay(any_port))
    }

    /// Tells the router where a simulated engine publishes (its ports are
    /// chosen at bind time), before the engine joins as a worker.
    fn follow_kv_events(&self, engine: &EngineHandle) {
        let (Some(hub), Some(publisher)) = (self.router.kv_events(), engine.kv_events_addr())
        else {
            return;
        };
        hub.set_endpoints(
            engine.url(),
            router_http::kv_events::KvEndpoints::new(format!("tcp://{publisher}")).with_replays(
                engine
                    .kv_events_replay_addr()
                    .map(|replay| format!("tcp://{replay}")),
            ),
        );
    }

    /// Starts simulated engines or waits for the configured ones, per mode.
    async fn start_workers(&mut self, settings: &Settings) -> Result<(), StartError> {
        match &settings.mode {
            Mode::Simulated { engines } => {
                for _ in 0..*engines {
                    let config = EngineConfig {
                        time_scale: settings.args.sim_time_scale,
                        ..EngineConfig::default()
                    };
                    let options = ServeOptions {
                        tokenizer: engine_tokenizer(settings),
                        kv_events: self.engine_kv_events(),
                        ..ServeOptions::default()
                    };
                    let handle = engine_sim::spawn(config, options)
                        .await
                        .map_err(StartError::Engine)?;
                    self.follow_kv_events(&handle);
                    self.engines.push(SimEngine {
                        role: "regular",
                        handle,
                    });
                }
                self.worker_urls = self.engines.iter().map(|e| e.handle.url()).collect();
                self.add_workers(settings).await
            }
            Mode::Workers { urls } => {
                self.worker_urls = urls.clone();
                self.add_workers(settings).await
            }
            Mode::Kubernetes(_) => {
                if let Some(kubernetes) = &self.kubernetes {
                    let wait = settings.router.worker_startup_timeout;
                    super::kubernetes::wait_synced(kubernetes, wait).await;
                }
                Ok(())
            }
            Mode::SimulatedPd { prefill, decode } => {
                let connector = settings.args.kv_connector;
                let (kv, mode) = crate::sim::for_deployment(connector).ok_or_else(|| {
                    StartError::Engine(std::io::Error::other(format!(
                        "engine-sim does not simulate the {connector} connector"
                    )))
                })?;
                // One registry: decode engines check that the named prefill
                // engine really produced each transfer.
                let transfers = TransferRegistry::new();
                let mut workers = Vec::new();
                for (role, count) in [
                    (engine_sim::Role::Prefill, *prefill),
                    (engine_sim::Role::Decode, *decode),
                ] {
                    for _ in 0..count {
                        let config = EngineConfig {
                            role,
                            kv_connector: kv,
                            moriio_mode: mode,
                            time_scale: settings.args.sim_time_scale,
                            ..EngineConfig::default()
                        };
                        let bootstrap = (role == engine_sim::Role::Prefill
                            && kv == engine_sim::TransferFormat::Mooncake)
                            .then(|| SocketAddr::from(([127, 0, 0, 1], 0)));
                        let options = ServeOptions {
                            tokenizer: engine_tokenizer(settings),
                            registry: Some(Arc::clone(&transfers)),
                            bootstrap_addr: bootstrap,
                            kv_events: self.engine_kv_events(),
                            ..ServeOptions::default()
                        };
                        let handle = engine_sim::spawn(config, options)
                            .await
                            .map_err(StartError::Engine)?;
                        self.follow_kv_events(&handle);
                        let mut worker = PdWorkerConfig::new(handle.url());
                        if let Some(bootstrap) = handle.bootstrap_addr() {
                            worker = worker.with_bootstrap_port(bootstrap.port());
                        }
                        if matches!(connector, PdConnector::MoriIo(_)) {
                            worker = worker.with_moriio(SIM_MORIIO);
                        }
                        let (kind, label) = if role == engine_sim::Role::Prefill {
                            (RoleKind::Prefill, "prefill")
                        } else {
                            (RoleKind::Decode, "decode")
                        };
                        workers.push((kind, worker));
                        self.engines.push(SimEngine {
                            role: label,
                            handle,
                        });
                    }
                }
                self.add_pd_workers(&workers).await
            }
            Mode::PrefillDecode(deployment) => {
                let workers = pd_static_workers(settings, deployment);
                let mut urls: Vec<String> = deployment
                    .prefill
                    .iter()
                    .map(|(url, _)| url.clone())
                    .chain(deployment.decode.iter().cloned())
                    .collect();
                urls.dedup();
                self.worker_urls = urls.clone();
                wait_all_healthy(settings, &urls).await?;
                self.add_pd_workers(&workers).await
            }
        }
    }

    /// Adds static prefill and decode workers that answered their first
    /// probe: a Mooncake prefill's engine ids are learned first (with the
    /// bootstrap retry schedule), so each joins its role selectable.
    async fn add_pd_workers(
        &self,
        workers: &[(RoleKind, PdWorkerConfig)],
    ) -> Result<(), StartError> {
        for (i, (role, spec)) in workers.iter().enumerate() {
            self.router.add_pd_worker(*role, spec).await?;
            tracing::info!(url = %spec.url, %role, "worker healthy and added");
            // A URL may serve both roles and several ranks: ready after its last.
            if workers[i + 1..]
                .iter()
                .all(|(_, later)| later.url != spec.url)
            {
                self.router.startup_gate().worker_ready(&spec.url);
            }
        }
        Ok(())
    }

    /// Probes every worker until its first healthy answer, then adds it
    /// (one worker per data-parallel rank).
    async fn add_workers(&self, settings: &Settings) -> Result<(), StartError> {
        let urls = &self.worker_urls;
        wait_all_healthy(settings, urls).await?;
        let router = self.router();
        // Add in the order given, so that indices and logs are stable.
        let dp = settings.args.intra_node_data_parallel_size;
        for url in urls {
            if dp <= 1 {
                router.add_worker(url, None, None)?;
            } else {
                for rank in 0..dp {
                    router.add_worker(url, Some(rank), None)?;
                }
            }
            tracing::info!(%url, dp_ranks = dp, "worker healthy and added");
            router.startup_gate().worker_ready(url);
        }
        Ok(())
    }

    /// The router being served (cheap to clone: shared state).
    pub fn router(&self) -> Router {
        self.router.clone()
    }

    /// The router's bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The extra Prometheus listener's address, if it could be bound.
    pub fn prometheus_addr(&self) -> Option<SocketAddr> {
        self.prometheus_addr
    }

    /// The simulated engines started in-process, with their role
    /// (`regular`, `prefill` or `decode`).
    pub fn engines(&self) -> impl Iterator<Item = (&'static str, &EngineHandle)> + '_ {
        self.engines.iter().map(|e| (e.role, &e.handle))
    }

    /// The ZMQ discovery listener, with `--vllm-discovery-address`.
    pub fn discovery(&self) -> Option<&ZmqDiscovery> {
        self.discovery.as_ref()
    }

    /// Kubernetes pod discovery, with `--service-discovery`.
    pub fn kubernetes(&self) -> Option<&KubernetesDiscovery> {
        self.kubernetes.as_ref()
    }

    /// The start-up banner: where the router listens, its engines, the
    /// policy, and a curl command that works as printed.
    pub fn banner(&self) -> String {
        let host = match self.addr.ip() {
            ip if ip.is_unspecified() => "127.0.0.1".to_owned(),
            ip => join_host_port(&ip.to_string(), 0)
                .trim_end_matches(":0")
                .to_owned(),
        };
        let base = format!("http://{host}:{}", self.addr.port());
        let router = self.router();
        let mode = match router.pd() {
            Some(pd) => format!(", P/D over {}", pd.connector().as_str()),
            None => String::new(),
        };
        let mut out = format!(
            "affinity-router {} serving on {base} (policy {}{mode})\n",
            env!("CARGO_PKG_VERSION"),
            self.policy
        );
        if self.engines.is_empty() {
            if let Some(discovery) = &self.discovery {
                out.push_str(&format!(
                    "  discovery: vLLM engines register over ZMQ at tcp://{}\n",
                    discovery.local_addr()
                ));
            }
            if let Some(kubernetes) = &self.kubernetes {
                out.push_str(&format!(
                    "  discovery: {}\n",
                    super::kubernetes::describe(kubernetes.config())
                ));
            }
            if !self.worker_urls.is_empty() {
                out.push_str(&format!("  workers: {}\n", self.worker_urls.join(" ")));
            } else if self.discovery.is_none() && self.kubernetes.is_none() {
                out.push_str(&empty_fleet_banner(&base, router.config()));
            }
        } else {
            for role in ["regular", "prefill", "decode"] {
                let engines: Vec<String> = self
                    .engines
                    .iter()
                    .filter(|e| e.role == role)
                    .map(|e| format!("{} ({})", e.handle.url(), e.handle.engine_id()))
                    .collect();
                if engines.is_empty() {
                    continue;
                }
                let label = if role == "regular" {
                    "engines: ".to_owned()
                } else {
                    format!("{role}: ")
                };
                out.push_str(&format!(
                    "  {label}{} engine-sim: {}\n",
                    engines.len(),
                    engines.join(", ")
                ));
            }
        }
        match self.prometheus_addr {
            Some(addr) => out.push_str(&format!(
                "  metrics: {base}/metrics and http://{addr}/metrics\n"
            )),
            None => out.push_str(&format!("  metrics: {base}/metrics\n")),
        }
        let model = if self.engines.is_empty() {
            String::new()
        } else {
            "\"model\": \"sim-model\", ".to_owned()
        };
        out.push_str(&format!(
            "  try:     curl -s {base}/v1/chat/completions -H 'content-type: application/json' \
             -d '{{{model}\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 16}}'\n"
        ));
        out.push_str("  stop:    Ctrl-C (graceful)");
        out
    }

    /// Graceful shutdown: readiness 503 at once, in-flight requests finish
    /// (the listener stays open meanwhile), then everything stops, all
    /// within the grace period.
    pub async fn stop(mut self) -> StopOutcome {
        let deadline = tokio::time::Instant::now() + self.grace;
        self.router().begin_shutdown();
        let _ = self.stop.send(true);
        let serve = &mut self.serve;
        let outcome = match tokio::time::timeout_at(deadline, serve).await {
            Ok(Ok(router_http::ShutdownOutcome::Drained)) => StopOutcome::Drained,
            Ok(_) => StopOutcome::DeadlineReached,
            Err(_) => {
                self.serve.abort();
                StopOutcome::DeadlineReached
            }
        };
        if let Some(task) = self.metrics_server.take() {
            let _ = tokio::time::timeout(Duration::from_secs(1), task).await;
        }
        drop(self.background.take());
        drop(self.discovery.take());
        drop(self.kubernetes.take());
        for engine in std::mem::take(&mut self.engines) {
            let _ = tokio::time::timeout(Duration::from_secs(2), engine.handle.shutdown()).await;
        }
        match outcome {
            StopOutcome::Drained => tracing::info!("stopped: every request finished"),
            StopOutcome::DeadlineReached => {
                tracing::warn!(grace = ?self.grace, "stopped: the grace period ran out")
            }
        }
        outcome
    }
}

/// The banner lines of a router started without workers: what that means
/// and the `curl` that adds one (with the admin credential when one is set).
fn empty_fleet_banner(base: &str, config: &RouterConfig) -> String {
    let auth = if config.admin_api_key.is_some() {
        " -H 'authorization: Bearer ADMIN_API_KEY'"
    } else if config.api_key.is_some() {
        " -H 'authorization: Bearer API_KEY'"
    } else {
        ""
    };
    format!(
        "  workers: none, an empty fleet (no worker source given; simulated engines start with \
         no arguments at all, --sim-workers N or --sim-pd P:D)\n  \
         add one: curl -s -X POST{auth} '{base}/add_worker?url=http://HOST:PORT'\n"
    )
}

/// Resolves when a stop is asked for and the requests in flight are done
/// (or the grace period passed): until then the listener keeps accepting,
/// so readiness probes see the 503.
async fn wait_for_stop(router: Router, mut stopped: watch::Receiver<bool>, grace: Duration) {
    if stopped.wait_for(|stop| *stop).await.is_err() {
        return;
    }
    router.begin_shutdown();
    let deadline = tokio::time::Instant::now() + grace;
    while router.in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Binds the ZMQ discovery listener, admitting only engines inside
/// `--worker-networks` (host names resolved within the connect timeout).
async fn bind_discovery(settings: &Settings, address: &str) -> Result<ZmqDiscovery, StartError> {
    let ttl = Duration::from_secs(settings.args.vllm_discovery_ttl_secs);
    let networks = settings.router.worker_networks.clone();
    let resolve_timeout = settings.router.client.connect_timeout;
    let max_message_size = settings.args.zmq_max_message_size;
    Ok(super::discovery::bind(address, ttl, networks, resolve_timeout, max_message_size).await?)
}

/// Waits, in parallel, for every URL's first healthy probe.
async fn wait_all_healthy(settings: &Settings, urls: &[String]) -> Result<(), StartError> {
    let config = &settings.router;
    let probe = Arc::new(HttpProbe::new(
        UpstreamClient::new(ClientConfig::default()),
        &config.health_endpoint,
    ));
    let mut waits = tokio::task::JoinSet::new();
    for url in urls {
        let probe = Arc::clone(&probe);
        let url = url.clone();
        let timeout = config.worker_startup_timeout;
        let interval = config.worker_startup_check_interval;
        let per_probe = config.health.timeout;
        waits.spawn(async move {
            let healthy = wait_healthy(&probe, &url, timeout, interval, per_probe).await;
            (url, healthy)
        });
    }
    let mut not_ready = Vec::new();
    while let Some(joined) = waits.join_next().await {
        match joined {
            Ok((_, true)) => {}
            Ok((url, false)) => not_ready.push(url),
            Err(err) => tracing::error!(error = %err, "a startup probe task failed"),
        }
    }
    if not_ready.is_empty() {
        return Ok(());
    }
    not_ready.sort();
    Err(StartError::WorkersNotReady {
        urls: not_ready,
        endpoint: config.health_endpoint.clone(),
        timeout_secs: config.worker_startup_timeout.as_secs(),
    })
}

/// Polls `GET {url}{endpoint}` until it answers 2xx or `timeout` passes.
async fn wait_healthy(
    probe: &HttpProbe,
    url: &str,
    timeout: Duration,
    interval: Duration,
    per_probe: Duration,
) -> bool {
    let Ok(worker_url) = worker_lifecycle::WorkerUrl::parse_http(url) else {
        return false;
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left.min(per_probe), probe.probe_url(&worker_url)).await {
            Ok(Ok(())) => return true,
            Ok(Err(err)) => {
                tracing::info!(%url, attempt, error = %err, "waiting for the worker to be healthy")
            }
            Err(_) => tracing::info!(%url, attempt, "waiting for the worker: probe timed out"),
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return false;
        }
        tokio::time::sleep(interval.min(deadline - now)).await;
    }
}

/// The tokenizer simulated engines count prompts with: the router's own
/// for their model when `--tokenizer-path` gave one (router and engines
/// then agree on every id), else `None` (engine-sim's synthetic rule, which
/// the router also uses by default for simulated engines).
fn engine_tokenizer(settings: &Settings) -> Option<Arc<prompt_tokens::PromptTokenizer>> {
    let model = engine_sim::ModelConfig::default().model_name;
    let entry = settings.router.tokenizers.for_model(&model)?;
    (!entry.tokenizer().is_synthetic()).then(|| Arc::clone(entry.tokenizer()))
}

/// Serves `GET /metrics` (and nothing else) on `address`.
async fn serve_metrics(
    router: &Router,
    address: &str,
    mut stopped: watch::Receiver<bool>,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(address).await?;
    let addr = listener.local_addr()?;
    let serving = router.clone();
    let service =
        hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
            let router = serving.clone();
            async move {
                if request.method() == http::Method::GET && request.uri().path() == "/metrics" {
                    let (parts, _) = request.into_parts();
                    let request =
                        http::Request::from_parts(parts, http_body_util::Empty::<Bytes>::new());
                    Ok::<_, std::convert::Infallible>(router.handle(request).await)
                } else {
                    let mut response = http::Response::new(router_http::BoxBody::default());
                    *response.status_mut() = http::StatusCode::NOT_FOUND;
                    Ok(response)
                }
            }
        });
    let task = tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        };
        router_http::serve(listener, service, shutdown, Duration::from_secs(1)).await;
    });
    Ok((addr, task))
}

/// Ctrl-C and SIGTERM, registered when installed: a signal sent at any time
/// after [`ShutdownSignals::install`] (say, right after the banner) is seen.
#[derive(Debug)]
pub struct ShutdownSignals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    /// Registers the handlers (inside a tokio runtime).
    pub fn install() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Self {
                interrupt: signal(SignalKind::interrupt())?,
                terminate: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// Resolves at the next Ctrl-C or SIGTERM.
    pub async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.interrupt.recv() => tracing::info!("Ctrl-C: shutting down gracefully"),
            _ = self.terminate.recv() => tracing::info!("SIGTERM: shutting down gracefully"),
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("Ctrl-C: shutting down gracefully");
        }
    }
}

/// What the startup gate awaits: every worker given at startup (in P/D
/// mode the static prefill and decode URLs) and the simulated engines, by
/// one name; nothing for an empty fleet or discovery.
fn startup_workers(mode: &Mode) -> Vec<String> {
    match mode {
        Mode::Simulated { engines: 0 } => Vec::new(),
        Mode::Simulated { engines } => vec![format!("{engines} simulated engines")],
        Mode::SimulatedPd { prefill, decode } => {
            vec![format!(
                "{prefill} simulated prefill and {decode} decode engines"
            )]
        }
        Mode::Workers { urls } => urls.clone(),
        Mode::PrefillDecode(pd) => pd
            .prefill
            .iter()
            .map(|(url, _)| url.clone())
            .chain(pd.decode.iter().cloned())
            .collect(),
        // Discovered pods are not configured workers: nothing to await.
        Mode::Kubernetes(_) => Vec::new(),
    }
}

/// The P/D section of the router, without static workers (they join as
/// they answer their first probe): the connector, each role's policy, and
/// the registries of the discovery listener when there is one.
fn pd_pools(
    settings: &Settings,
    connector: PdConnector,
    discovery: Option<&ZmqDiscovery>,
) -> PdConfig {
    let policy = |name: Option<super::args::PolicyName>| {
        name.map(|name| {
            let mut policy = settings.router.policy.clone();
            policy.name = name.as_str().to_owned();
            policy
        })
    };
    let mut pd = PdConfig::new(connector);
    pd.prefill_policy = policy(settings.args.prefill_policy);
    pd.decode_policy = policy(settings.args.decode_policy);
    if let Some(discovery) = discovery {
        let registries = discovery.registries();
        pd.prefill_registry = Some(Arc::clone(&registries.prefill));
        pd.decode_registry = Some(Arc::clone(&registries.decode));
    }
    pd
}

/// The static prefill and decode workers of real engines, one per
/// data-parallel rank.
fn pd_static_workers(
    settings: &Settings,
    deployment: &PdDeployment,
) -> Vec<(RoleKind, PdWorkerConfig)> {
    let dp = settings.args.intra_node_data_parallel_size;
    let ranks = |url: &str, bootstrap: Option<u16>| -> Vec<PdWorkerConfig> {
        let base = || {
            let worker = PdWorkerConfig::new(url);
            match bootstrap {
                Some(port) => worker.with_bootstrap_port(port),
                None => worker,
            }
        };
        if dp <= 1 {
            vec![base()]
        } else {
            (0..dp).map(|rank| base().with_dp_rank(rank)).collect()
        }
    };
    let prefill = deployment
        .prefill
        .iter()
        .flat_map(|(url, bootstrap)| ranks(url, *bootstrap))
        .map(|spec| (RoleKind::Prefill, spec));
    let decode = deployment
        .decode
        .iter()
        .flat_map(|url| ranks(url, None))
        .map(|spec| (RoleKind::Decode, spec));
    prefill.chain(decode).collect()
}
