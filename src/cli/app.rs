//! Start-up, serving and graceful shutdown of the reference router.
//!
//! [`App::start`] does everything up to "serving": it starts simulated
//! engines when asked, binds the router (so `/health` answers at once, even
//! with no workers), binds the extra Prometheus listener, waits for every
//! configured worker's first healthy probe and only then adds it (so the
//! first request can use it), and starts the health checks. [`App::stop`]
//! is the graceful shutdown: readiness and health turn 503 at once, new
//! requests are refused, the listener stays open while requests are in
//! flight so that load balancers can see the 503, and everything is done
//! within the grace period.

use super::settings::{Mode, Settings, join_host_port};
use bytes::Bytes;
use engine_sim::{EngineConfig, EngineHandle, ServeOptions};
use router_http::{ClientConfig, HttpProbe, Router, UpstreamClient};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use worker_lifecycle::{Endpoint, HealthProbe, Worker, WorkerOptions, WorkerRole, WorkerSpec};

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// P/D routing is parsed and validated but not served by this build.
    #[error(
        "P/D routing is not wired into this build yet: the flags are valid, but the prefill/decode \
         request path lands with the P/D work; run without --vllm-pd-disaggregation / --sim-pd"
    )]
    PdNotWired,
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

/// A running router: the listener, engines and background tasks.
#[derive(Debug)]
pub struct App {
    router: Router,
    addr: SocketAddr,
    prometheus_addr: Option<SocketAddr>,
    engines: Vec<EngineHandle>,
    worker_urls: Vec<String>,
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

impl App {
    /// Starts everything `settings` asks for and returns once the router is
    /// serving and every configured worker is healthy and routable.
    pub async fn start(settings: &Settings) -> Result<Self, StartError> {
        if matches!(
            settings.mode,
            Mode::PrefillDecode(_) | Mode::SimulatedPd { .. }
        ) {
            return Err(StartError::PdNotWired);
        }
        if !settings.ignored.is_empty() {
            tracing::warn!(
                flags = %settings.ignored.join(", "),
                "these settings have no effect in this router and are ignored"
            );
        }
        tracing::info!(settings = %settings.summary(), "starting affinity-router");
        let router = Router::new(settings.router.clone())?;

        let mut engines = Vec::new();
        let urls = match &settings.mode {
            Mode::Simulated { engines: count } => {
                for _ in 0..*count {
                    let config = EngineConfig {
                        time_scale: settings.args.sim_time_scale,
                        ..EngineConfig::default()
                    };
                    let engine = engine_sim::spawn(config, ServeOptions::default())
                        .await
                        .map_err(StartError::Engine)?;
                    engines.push(engine);
                }
                engines.iter().map(EngineHandle::url).collect()
            }
            Mode::Workers { urls } => urls.clone(),
            Mode::SimulatedPd { .. } | Mode::PrefillDecode(_) => Vec::new(),
        };

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
            let router = router.clone();
            let shutdown = wait_for_stop(
                router.clone(),
                stopped.clone(),
                settings.router.shutdown_grace,
            );
            tokio::spawn(async move { router.serve(listener, shutdown).await })
        };
        tracing::info!(%addr, "router listening; /health answers now");

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
            engines,
            worker_urls: urls.clone(),
            policy: settings.args.policy.as_str(),
            grace: settings.router.shutdown_grace,
            serve,
            metrics_server,
            stop,
            background: None,
        };
        if let Err(err) = app.add_workers(settings, &urls).await {
            app.stop().await;
            return Err(err);
        }
        app.background = Some(app.router.spawn_background());
        tracing::info!(workers = app.router.workers().len(), "ready");
        Ok(app)
    }

    /// Probes every worker until its first healthy answer, then adds it
    /// (one worker per data-parallel rank).
    async fn add_workers(&self, settings: &Settings, urls: &[String]) -> Result<(), StartError> {
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
        let mut ready = Vec::new();
        while let Some(joined) = waits.join_next().await {
            match joined {
                Ok((url, true)) => ready.push(url),
                Ok((url, false)) => not_ready.push(url),
                Err(err) => tracing::error!(error = %err, "a startup probe task failed"),
            }
        }
        if !not_ready.is_empty() {
            not_ready.sort();
            return Err(StartError::WorkersNotReady {
                urls: not_ready,
                endpoint: config.health_endpoint.clone(),
                timeout_secs: config.worker_startup_timeout.as_secs(),
            });
        }
        // Add in the order given, so that indices and logs are stable.
        let dp = settings.args.intra_node_data_parallel_size;
        for url in urls.iter().filter(|url| ready.contains(url)) {
            if dp <= 1 {
                self.router.add_worker(url, None, None)?;
            } else {
                for rank in 0..dp {
                    self.router.add_worker(url, Some(rank), None)?;
                }
            }
            tracing::info!(%url, dp_ranks = dp, "worker healthy and added");
        }
        Ok(())
    }

    /// The router.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// The router's bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The extra Prometheus listener's address, if it could be bound.
    pub fn prometheus_addr(&self) -> Option<SocketAddr> {
        self.prometheus_addr
    }

    /// The simulated engines started in-process.
    pub fn engines(&self) -> &[EngineHandle] {
        &self.engines
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
        let mut out = format!(
            "affinity-router {} serving on {base} (policy {})\n",
            env!("CARGO_PKG_VERSION"),
            self.policy
        );
        if self.engines.is_empty() {
            if self.worker_urls.is_empty() {
                out.push_str("  workers: none yet (POST /add_worker?url=...)\n");
            } else {
                out.push_str(&format!("  workers: {}\n", self.worker_urls.join(" ")));
            }
        } else {
            let engines: Vec<String> = self
                .engines
                .iter()
                .map(|e| format!("{} ({})", e.url(), e.engine_id()))
                .collect();
            out.push_str(&format!(
                "  engines: {} engine-sim: {}\n",
                engines.len(),
                engines.join(", ")
            ));
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
        self.router.begin_shutdown();
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
        for engine in std::mem::take(&mut self.engines) {
            let _ = tokio::time::timeout(Duration::from_secs(2), engine.shutdown()).await;
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

/// Polls `GET {url}{endpoint}` until it answers 2xx or `timeout` passes.
async fn wait_healthy(
    probe: &HttpProbe,
    url: &str,
    timeout: Duration,
    interval: Duration,
    per_probe: Duration,
) -> bool {
    let Ok(endpoint) = Endpoint::new(url, None) else {
        return false;
    };
    let candidate = Worker::new(
        WorkerSpec::new(WorkerRole::Regular, endpoint),
        0,
        &WorkerOptions::default(),
    );
    let deadline = tokio::time::Instant::now() + timeout;
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left.min(per_probe), probe.probe(&candidate)).await {
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

/// Serves `GET /metrics` (and nothing else) on `address`.
async fn serve_metrics(
    router: &Router,
    address: &str,
    mut stopped: watch::Receiver<bool>,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(address).await?;
    let addr = listener.local_addr()?;
    let router = router.clone();
    let service =
        hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
            let router = router.clone();
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

/// Resolves at the first Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("Ctrl-C: shutting down gracefully"),
        () = term => tracing::info!("SIGTERM: shutting down gracefully"),
    }
}
