//! Kubernetes pod discovery (feature `kubernetes`): pods that match a label
//! selector become workers, in `worker-lifecycle`'s per-role registries.
//!
//! [`KubernetesDiscovery`] runs one kube-runtime `watcher` per selector,
//! with the selector sent to the API server so only matching pods travel:
//! `--selector` for regular workers, or `--prefill-selector` and
//! `--decode-selector` for prefill/decode. Each stream's events go through
//! a [`PodTracker`], which registers a pod while it is a worker and
//! deregisters it when it stops being one (see [`pods`] for the rules). The
//! registries are the same kind the ZMQ listener feeds, so a host
//! reconciles them into pools the same way — `DiscoveryPool::with_reconciled`
//! or `RolePool::discovered` — and a pod that leaves is **drained**: the
//! pool's next step removes it, it takes no new request, and requests in
//! flight finish on the old worker object, their load counted to the last
//! byte.
//!
//! # Outages
//!
//! A watch that fails (API server down, connection cut, 403 after an RBAC
//! change) is retried with exponential backoff ([`KubernetesConfig::backoff`]),
//! and every failure is counted ([`DiscoveryMetrics`]). A watch resumes from
//! the last resource version it saw; when the server no longer has it
//! (410 Gone), the watcher lists the pods again, and the list replaces the
//! whole set at once: a pod deleted during the outage is missing from the
//! list and leaves then. The list asks for the most recent state (not the
//! API server's cache), so it cannot bring back a pod already gone.
//!
//! Until the first list of every selector completes, the registries hold
//! what was listed so far; [`KubernetesDiscovery::wait_synced`] waits for it.
//!
//! # Permissions
//!
//! The router's service account needs `get`, `list` and `watch` on `pods`
//! (a Role in the namespace watched, or a ClusterRole with
//! `--service-discovery-namespace` unset). [`KubernetesDiscovery::start`]
//! lists once before watching, and a 401 or 403 there is
//! [`KubernetesError::Forbidden`], whose message names that rule.
//!
//! # Example
//!
//! Against an API server at `http://127.0.0.1:PORT` (the tests run a fake
//! one; in a cluster, [`KubernetesDiscovery::connect`] reads the service
//! account):
//!
//! ```no_run
//! use std::time::{Duration, Instant};
//! use worker_discovery::kubernetes::{KubernetesConfig, KubernetesDiscovery, Selector};
//! use worker_lifecycle::{DiscoveryPool, RoleKind, WorkerOptions};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let config = KubernetesConfig {
//!     port: 8000,
//!     namespace: Some("inference".into()),
//!     ..KubernetesConfig::regular(Selector::parse(["app=vllm"])?)
//! };
//! let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:8001".parse()?))?;
//! let discovery = KubernetesDiscovery::start(client, config).await?;
//! discovery.wait_synced(Duration::from_secs(10)).await;
//!
//! let pool = DiscoveryPool::new(RoleKind::Regular, WorkerOptions::default())?;
//! let urls = pool.with_reconciled(&discovery.registries().regular, Instant::now(), |view| {
//!     view.workers().iter().map(|w| w.url().to_owned()).collect::<Vec<_>>()
//! })?;
//! println!("workers: {urls:?}");
//! # Ok(())
//! # }
//! ```
//!
//! # Cancel safety
//!
//! Dropping the [`KubernetesDiscovery`] stops its watch task; the
//! registries keep their last state.

pub mod pods;
pub mod selector;

/// The kube-rs client this module is built on (its `Client` and `Config`
/// build the client that [`KubernetesDiscovery::start`] takes).
pub use kube;

pub use pods::{
    BOOTSTRAP_PORT_ANNOTATION, KubernetesRegistries, PodInfo, PodTracker, REGISTRATION_TTL,
    StreamEvent, SyncReport,
};
pub use selector::{Selector, SelectorError};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher;
use kube::runtime::{WatchStreamExt as _, watcher::Event};
use tokio::sync::watch as signal;
use tokio::task::JoinHandle;
use worker_lifecycle::RoleKind;

/// What to watch and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesConfig {
    /// Pods of regular workers (`--selector`).
    pub regular: Option<Selector>,
    /// Pods of prefill workers (`--prefill-selector`).
    pub prefill: Option<Selector>,
    /// Pods of decode workers (`--decode-selector`).
    pub decode: Option<Selector>,
    /// The port workers serve on, at their pod IP
    /// (`--service-discovery-port`, default 80).
    pub port: u16,
    /// The namespace watched (`--service-discovery-namespace`); `None`
    /// watches every namespace the router may see.
    pub namespace: Option<String>,
    /// The annotation of a prefill pod's KV bootstrap port (default
    /// [`BOOTSTRAP_PORT_ANNOTATION`]).
    pub bootstrap_annotation: String,
    /// Retry delays after a watch failure.
    pub backoff: BackoffConfig,
}

impl Default for KubernetesConfig {
    /// No selector (nothing watched), port 80, all namespaces.
    fn default() -> Self {
        Self {
            regular: None,
            prefill: None,
            decode: None,
            port: 80,
            namespace: None,
            bootstrap_annotation: BOOTSTRAP_PORT_ANNOTATION.to_owned(),
            backoff: BackoffConfig::default(),
        }
    }
}

impl KubernetesConfig {
    /// Regular workers: the pods `selector` matches.
    pub fn regular(selector: Selector) -> Self {
        Self {
            regular: Some(selector),
            ..Self::default()
        }
    }

    /// Prefill/decode workers: a pod matching `prefill` is a prefill
    /// worker, else one matching `decode` a decode worker.
    pub fn prefill_decode(prefill: Selector, decode: Selector) -> Self {
        Self {
            prefill: Some(prefill),
            decode: Some(decode),
            ..Self::default()
        }
    }

    /// The streams watched, in priority order.
    fn streams(&self) -> Vec<(RoleKind, Selector)> {
        [
            (RoleKind::Prefill, &self.prefill),
            (RoleKind::Decode, &self.decode),
            (RoleKind::Regular, &self.regular),
        ]
        .into_iter()
        .filter_map(|(role, selector)| selector.clone().map(|s| (role, s)))
        .collect()
    }

    /// Refuses a configuration that would watch nothing, or every pod.
    pub fn validate(&self) -> Result<(), KubernetesError> {
        let streams = self.streams();
        if streams.is_empty() {
            return Err(KubernetesError::Config(
                "no selector: give the regular workers' selector, or the prefill and decode \
                 selectors"
                    .to_owned(),
            ));
        }
        if let Some((role, _)) = streams.iter().find(|(_, s)| s.is_empty()) {
            return Err(KubernetesError::Config(format!(
                "the {role} selector is empty: it would take every pod for a worker"
            )));
        }
        if self.port == 0 {
            return Err(KubernetesError::Config(
                "port 0 is not a worker port".to_owned(),
            ));
        }
        self.backoff.validate()
    }
}

/// Exponential backoff of a failed watch: `initial`, doubling up to `max`,
/// each delay shortened by up to a fifth at random so that routers do not
/// retry in step. A success resets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffConfig {
    /// The first delay (default 800 ms, as client-go).
    pub initial: Duration,
    /// The longest delay (default 30 s).
    pub max: Duration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(800),
            max: Duration::from_secs(30),
        }
    }
}

impl BackoffConfig {
    fn validate(&self) -> Result<(), KubernetesError> {
        if self.initial.is_zero() || self.max < self.initial {
            return Err(KubernetesError::Config(format!(
                "backoff: need 0 < initial <= max, got {:?} and {:?}",
                self.initial, self.max
            )));
        }
        Ok(())
    }
}

/// kube-runtime's [`Backoff`] from a [`BackoffConfig`].
struct WatchBackoff {
    config: BackoffConfig,
    next: Duration,
    seed: u64,
}

impl WatchBackoff {
    fn new(config: BackoffConfig, seed: u64) -> Self {
        Self {
            config,
            next: config.initial,
            seed: seed | 1,
        }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.next;
        self.next = (self.next * 2).min(self.config.max);
        // xorshift: jitter needs no quality, only spread.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let cut = delay.mul_f64((self.seed % 1000) as f64 / 5000.0);
        Some(delay - cut)
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = self.config.initial;
    }
}

/// Why Kubernetes discovery could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KubernetesError {
    /// The configuration is invalid.
    #[error("invalid Kubernetes discovery settings: {0}")]
    Config(String),
    /// No client could be built (no kubeconfig, not in a cluster).
    #[error("cannot reach the Kubernetes API: {0}")]
    Client(#[source] kube::Error),
    /// The API server refused to list pods: the RBAC rule is missing.
    #[error(
        "the Kubernetes API refused to list pods {scope} ({status}): the router's service \
         account needs get, list and watch on pods ({rule}) — {message}"
    )]
    Forbidden {
        /// `in namespace NS` or `in all namespaces`.
        scope: String,
        /// The HTTP status (401 or 403).
        status: u16,
        /// The RBAC object that grants it.
        rule: &'static str,
        /// The API server's message.
        message: String,
    },
}

/// Counters and gauges of Kubernetes discovery, as read at one moment.
/// Hosts render them as `router_discovery_*` metrics (names in the field
/// docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DiscoveryMetrics {
    /// `router_discovery_watch_errors_total`: failed lists and watches
    /// (each one backed off).
    pub watch_errors: u64,
    /// `router_discovery_forbidden_total`: of those, refused with 401/403.
    pub forbidden: u64,
    /// `router_discovery_relists_total`: completed lists (the first one
    /// and every re-list after a lost watch).
    pub relists: u64,
    /// `router_discovery_events_total`: pod events received.
    pub events: u64,
    /// `router_discovery_registrations_total`: workers registered (each a
    /// new generation).
    pub registrations: u64,
    /// `router_discovery_deregistrations_total`: workers deregistered.
    pub deregistrations: u64,
    /// `router_discovery_invalid_annotations_total`: prefill pods whose
    /// bootstrap-port annotation is not a port.
    pub invalid_annotations: u64,
    /// `router_discovery_workers{role="regular"}`: registered now.
    pub regular_workers: u64,
    /// `router_discovery_workers{role="prefill"}`: registered now.
    pub prefill_workers: u64,
    /// `router_discovery_workers{role="decode"}`: registered now.
    pub decode_workers: u64,
}

impl DiscoveryMetrics {
    /// Writes the `router_discovery_*` families (names in the field docs).
    pub fn render(&self, exposition: &mut prom_text::Exposition<'_>) {
        use prom_text::MetricType::{Counter, Gauge};
        for (name, help, value) in [
            (
                "router_discovery_watch_errors_total",
                "Failed pod lists and watches, each one backed off.",
                self.watch_errors,
            ),
            (
                "router_discovery_forbidden_total",
                "Pod lists and watches refused with 401 or 403 (RBAC).",
                self.forbidden,
            ),
            (
                "router_discovery_relists_total",
                "Completed pod lists: the first and every re-list after a lost watch.",
                self.relists,
            ),
            (
                "router_discovery_events_total",
                "Pod events received.",
                self.events,
            ),
            (
                "router_discovery_registrations_total",
                "Pods registered as workers (each a new generation).",
                self.registrations,
            ),
            (
                "router_discovery_deregistrations_total",
                "Pods deregistered (their workers drained).",
                self.deregistrations,
            ),
            (
                "router_discovery_invalid_annotations_total",
                "Prefill pods whose vllm.ai/bootstrap-port annotation is not a port.",
                self.invalid_annotations,
            ),
        ] {
            exposition.family(name, Counter, help).sample(&[], value);
        }
        let mut workers = exposition.family(
            "router_discovery_workers",
            Gauge,
            "Pods registered as workers now, by role.",
        );
        for (role, value) in [
            ("regular", self.regular_workers),
            ("prefill", self.prefill_workers),
            ("decode", self.decode_workers),
        ] {
            workers.sample(&[("role", &role)], value);
        }
    }
}

/// Reads [`DiscoveryMetrics`] of a running [`KubernetesDiscovery`] from
/// anywhere (a metrics endpoint), without holding the discovery itself.
#[derive(Debug, Clone)]
pub struct DiscoveryMetricsReader(Arc<Counters>);

impl DiscoveryMetricsReader {
    /// The counters now.
    pub fn snapshot(&self) -> DiscoveryMetrics {
        self.0.snapshot()
    }
}

#[derive(Debug, Default)]
struct Counters {
    watch_errors: AtomicU64,
    forbidden: AtomicU64,
    relists: AtomicU64,
    events: AtomicU64,
    registrations: AtomicU64,
    deregistrations: AtomicU64,
    invalid_annotations: AtomicU64,
    regular_workers: AtomicU64,
    prefill_workers: AtomicU64,
    decode_workers: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> DiscoveryMetrics {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DiscoveryMetrics {
            watch_errors: get(&self.watch_errors),
            forbidden: get(&self.forbidden),
            relists: get(&self.relists),
            events: get(&self.events),
            registrations: get(&self.registrations),
            deregistrations: get(&self.deregistrations),
            invalid_annotations: get(&self.invalid_annotations),
            regular_workers: get(&self.regular_workers),
            prefill_workers: get(&self.prefill_workers),
            decode_workers: get(&self.decode_workers),
        }
    }
}

/// Running Kubernetes pod discovery. See the module docs.
#[derive(Debug)]
pub struct KubernetesDiscovery {
    registries: KubernetesRegistries,
    counters: Arc<Counters>,
    synced: signal::Receiver<bool>,
    task: JoinHandle<()>,
    config: KubernetesConfig,
}

impl Drop for KubernetesDiscovery {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl KubernetesDiscovery {
    /// Builds a client from the environment (in-cluster service account,
    /// else `KUBECONFIG` / `~/.kube/config`) and [`start`](Self::start)s.
    pub async fn connect(config: KubernetesConfig) -> Result<Self, KubernetesError> {
        config.validate()?;
        let client = kube::Client::try_default()
            .await
            .map_err(KubernetesError::Client)?;
        Self::start(client, config).await
    }

    /// Checks that pods may be listed (a 401/403 is
    /// [`KubernetesError::Forbidden`]), then starts watching in a task of
    /// its own. Other failures of that first list are logged and retried by
    /// the watch, with backoff.
    pub async fn start(
        client: kube::Client,
        config: KubernetesConfig,
    ) -> Result<Self, KubernetesError> {
        Self::start_with(client, config, KubernetesRegistries::new()).await
    }

    /// As [`start`](Self::start), feeding the given registries.
    pub async fn start_with(
        client: kube::Client,
        config: KubernetesConfig,
        registries: KubernetesRegistries,
    ) -> Result<Self, KubernetesError> {
        config.validate()?;
        let api: Api<Pod> = match &config.namespace {
            Some(namespace) => Api::namespaced(client, namespace),
            None => Api::all(client),
        };
        let streams = config.streams();
        for (_, selector) in &streams {
            let params = ListParams::default().labels(&selector.to_string()).limit(1);
            match api.list_metadata(&params).await {
                Ok(_) => {}
                Err(err) => {
                    if let Some(status) = forbidden_status(&err) {
                        return Err(forbidden(&config, status, &err));
                    }
                    tracing::warn!(
                        error = %err,
                        "cannot list pods yet; the watch retries with backoff"
                    );
                }
            }
        }
        let counters = Arc::new(Counters::default());
        let (synced_tx, synced) = signal::channel(false);
        let tracker = PodTracker::new(streams.clone(), config.port, registries.clone());
        let task = tokio::spawn(run(
            api,
            config.clone(),
            streams,
            tracker,
            Arc::clone(&counters),
            synced_tx,
        ));
        Ok(Self {
            registries,
            counters,
            synced,
            task,
            config,
        })
    }

    /// The registries fed, one per role.
    pub fn registries(&self) -> &KubernetesRegistries {
        &self.registries
    }

    /// The configuration.
    pub fn config(&self) -> &KubernetesConfig {
        &self.config
    }

    /// The counters now.
    pub fn metrics(&self) -> DiscoveryMetrics {
        self.counters.snapshot()
    }

    /// A handle that reads the counters for as long as it lives (a
    /// metrics endpoint keeps one).
    pub fn metrics_reader(&self) -> DiscoveryMetricsReader {
        DiscoveryMetricsReader(Arc::clone(&self.counters))
    }

    /// Whether every selector's first list has completed.
    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Waits until every selector's first list has completed, at most
    /// `timeout`; returns whether it has.
    pub async fn wait_synced(&self, timeout: Duration) -> bool {
        let mut synced = self.synced.clone();
        matches!(
            tokio::time::timeout(timeout, synced.wait_for(|s| *s)).await,
            Ok(Ok(_))
        )
    }
}

/// The HTTP status of a 401/403 refusal.
fn forbidden_status(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(status) if status.code == 401 || status.code == 403 => Some(status.code),
        _ => None,
    }
}

fn forbidden(config: &KubernetesConfig, status: u16, err: &kube::Error) -> KubernetesError {
    let (scope, rule) = match &config.namespace {
        Some(ns) => (
            format!("in namespace {ns}"),
            "a Role in that namespace and a RoleBinding",
        ),
        None => (
            "in all namespaces".to_owned(),
            "a ClusterRole and a ClusterRoleBinding, or set the namespace",
        ),
    };
    let message = match err {
        kube::Error::Api(status) => status.message.clone(),
        other => other.to_string(),
    };
    KubernetesError::Forbidden {
        scope,
        status,
        rule,
        message,
    }
}

/// The watch task: every stream merged, each event through the tracker.
async fn run(
    api: Api<Pod>,
    config: KubernetesConfig,
    streams: Vec<(RoleKind, Selector)>,
    mut tracker: PodTracker,
    counters: Arc<Counters>,
    synced: signal::Sender<bool>,
) {
    let merged = futures_util::stream::select_all(streams.iter().enumerate().map(
        |(index, (_, selector))| {
            let watch_config = watcher::Config::default()
                .labels(&selector.to_string())
                .list_semantic(watcher::ListSemantic::MostRecent);
            watcher(api.clone(), watch_config)
                .backoff(WatchBackoff::new(
                    config.backoff,
                    index as u64 + 0x9e37_79b9,
                ))
                .map(move |item| (index, item))
                .boxed()
        },
    ));
    let mut merged = merged;
    while let Some((index, item)) = merged.next().await {
        let role = streams[index].0;
        let event = match item {
            Ok(event) => event,
            Err(err) => {
                counters.watch_errors.fetch_add(1, Ordering::Relaxed);
                log_watch_error(&config, role, &err, &counters);
                continue;
            }
        };
        let annotation = config.bootstrap_annotation.as_str();
        let read = |pod: &Pod| PodInfo::from_pod(pod, annotation);
        let event = match event {
            Event::Apply(pod) => read(&pod).map(StreamEvent::Apply),
            Event::Delete(pod) => read(&pod).map(StreamEvent::Delete),
            Event::Init => Some(StreamEvent::Init),
            Event::InitApply(pod) => read(&pod).map(StreamEvent::InitApply),
            Event::InitDone => {
                counters.relists.fetch_add(1, Ordering::Relaxed);
                Some(StreamEvent::InitDone)
            }
        };
        let Some(event) = event else {
            tracing::warn!(%role, "ignoring a pod without a UID or name");
            continue;
        };
        if matches!(event, StreamEvent::Apply(_) | StreamEvent::Delete(_)) {
            counters.events.fetch_add(1, Ordering::Relaxed);
        }
        let report = tracker.handle(index, event, Instant::now());
        counters
            .registrations
            .fetch_add(report.registered.len() as u64, Ordering::Relaxed);
        counters
            .deregistrations
            .fetch_add(report.deregistered.len() as u64, Ordering::Relaxed);
        counters
            .invalid_annotations
            .fetch_add(report.invalid_annotations, Ordering::Relaxed);
        for (gauge, role) in [
            (&counters.regular_workers, RoleKind::Regular),
            (&counters.prefill_workers, RoleKind::Prefill),
            (&counters.decode_workers, RoleKind::Decode),
        ] {
            gauge.store(tracker.workers(role) as u64, Ordering::Relaxed);
        }
        if !*synced.borrow() && tracker.synced() {
            let _ = synced.send(true);
        }
    }
}

fn log_watch_error(
    config: &KubernetesConfig,
    role: RoleKind,
    err: &watcher::Error,
    counters: &Counters,
) {
    let status = match err {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => match e {
            kube::Error::Api(status) => Some(status.code),
            _ => None,
        },
        watcher::Error::WatchError(status) => Some(status.code),
        _ => None,
    };
    match status {
        Some(401 | 403) => {
            counters.forbidden.fetch_add(1, Ordering::Relaxed);
            let rule = if config.namespace.is_some() {
                "Role"
            } else {
                "ClusterRole"
            };
            tracing::error!(
                %role,
                error = %err,
                "the Kubernetes API refuses to list or watch pods: the router's service account \
                 needs get, list and watch on pods (a {rule}); retrying with backoff"
            );
        }
        Some(410) => tracing::info!(
            %role,
            "the watch's resource version is gone (410); listing the pods again"
        ),
        _ => tracing::warn!(%role, error = %err, "pod watch failed; retrying with backoff"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap_with_bounded_jitter_and_resets() {
        let config = BackoffConfig {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(400),
        };
        let mut backoff = WatchBackoff::new(config, 7);
        let delays: Vec<Duration> = (&mut backoff).take(5).collect();
        for (delay, nominal) in delays.iter().zip([100, 200, 400, 400, 400]) {
            let nominal = Duration::from_millis(nominal);
            assert!(
                *delay <= nominal && *delay >= nominal.mul_f64(0.8),
                "{delays:?}"
            );
        }
        backoff.reset();
        assert!(backoff.next().unwrap() <= Duration::from_millis(100));
    }

    #[test]
    fn configurations_that_watch_nothing_or_everything_are_refused() {
        assert!(KubernetesConfig::default().validate().is_err());
        let empty = KubernetesConfig::regular(Selector::default());
        assert!(
            empty
                .validate()
                .unwrap_err()
                .to_string()
                .contains("every pod")
        );
        let selector = Selector::parse(["app=vllm"]).unwrap();
        let port0 = KubernetesConfig {
            port: 0,
            ..KubernetesConfig::regular(selector.clone())
        };
        assert!(port0.validate().is_err());
        let bad_backoff = KubernetesConfig {
            backoff: BackoffConfig {
                initial: Duration::from_secs(2),
                max: Duration::from_secs(1),
            },
            ..KubernetesConfig::regular(selector.clone())
        };
        assert!(bad_backoff.validate().is_err());
        assert!(
            KubernetesConfig::prefill_decode(selector.clone(), selector)
                .validate()
                .is_ok()
        );
    }
}
