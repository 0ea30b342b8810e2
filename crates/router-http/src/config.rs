//! The router's configuration: plain structs with documented defaults.
//!
//! Defaults follow vllm-router's command line where it has the setting, so a
//! deployment that switches routers keeps its behaviour.

use crate::allow::CidrBlock;
use crate::client::ClientConfig;
use crate::headers::DEFAULT_REQUEST_ID_HEADERS;
use crate::limits::ConcurrencyConfig;
use crate::load_poll::LoadPollConfig;
use crate::server::ServerConfig;
use lb_policies::PolicyConfig;
use pd_orchestrator::pools::{PdConfig, PoolsError};
use std::time::Duration;
use worker_lifecycle::{HealthCheckConfig, RetryBudgetConfig, RetryPolicy, WorkerOptions};

/// Everything a [`Router`](crate::Router) is built from.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// The load-balancing policy of every model (default `cache_aware` with
    /// threshold 0.3, abs 64, rel 1.5).
    pub policy: PolicyConfig,
    /// Largest request body accepted, in bytes (default 512 MiB); larger is 413.
    pub max_payload_size: usize,
    /// Concurrency limit and queue (defaults 32768 in flight, queue 100, 60 s).
    pub concurrency: ConcurrencyConfig,
    /// Optional token-bucket rate limit: requests per second (burst = one second's worth).
    pub rate_limit_per_second: Option<f64>,
    /// Inference API key: when set, proxied routes need `Authorization: Bearer KEY` (401 otherwise).
    pub api_key: Option<String>,
    /// Admin API key: when set, admin routes need `Authorization: Bearer KEY`
    /// and fail closed; when unset, admin routes accept the inference key if
    /// one is set, and are open otherwise.
    pub admin_api_key: Option<String>,
    /// Request-id headers looked for, in order (default `x-request-id`,
    /// `x-correlation-id`, `x-trace-id`, `request-id`).
    pub request_id_headers: Vec<String>,
    /// Header whose value is a session key for hash-based policies
    /// (default `x-session-id`).
    pub session_header: String,
    /// Upstream client timeouts and pool.
    pub client: ClientConfig,
    /// Whole-request deadline (default 1800 s): it bounds every phase, the
    /// wait in the admission queue, reading the client's body, computing
    /// the prompt's token ids, connecting, the worker's response head and
    /// the response body. Past it before the response head the client gets
    /// 504 `request_timeout` naming the phase; only a worker that had the
    /// request is charged a timeout (a deadline spent in the router, before
    /// dispatch, is the router's own); past it mid-stream the stream is cut.
    pub request_timeout: Duration,
    /// How long a client may take to send its whole request body (default
    /// 60 s, and never past [`request_timeout`](Self::request_timeout));
    /// past it, 408 `request_body_timeout`.
    pub request_body_timeout: Duration,
    /// A streamed response that sends nothing for this long fails and
    /// releases everything it holds (default 300 s).
    pub stream_idle_timeout: Duration,
    /// Retries before the first byte reaches the client (worker-lifecycle's
    /// default: 2 retries on 408/429/500/502/503/504, exponential backoff).
    pub retry: RetryPolicy,
    /// Retry budget: retries as a fraction of recent requests, plus a floor.
    pub retry_budget: RetryBudgetConfig,
    /// Options of every worker built by the router (circuit breaker settings).
    pub worker_options: WorkerOptions,
    /// Health checks of the workers.
    pub health: HealthCheckConfig,
    /// Path probed for worker health (default `/health`).
    pub health_endpoint: String,
    /// How long `POST /add_worker` waits for the new worker's first healthy
    /// probe (default 600 s, as `--worker-startup-timeout-secs`).
    pub worker_startup_timeout: Duration,
    /// Time between probes while waiting for a new worker (default 1 s).
    pub worker_startup_check_interval: Duration,
    /// How long `POST /remove_worker` waits for the worker's load to reach 0
    /// before removing it anyway (default 60 s).
    pub drain_timeout: Duration,
    /// Interval of the cache-aware trees' eviction to their budget (default 120 s).
    pub eviction_interval: Duration,
    /// Models each pool keeps a policy instance (and its prefix trees and
    /// metric series) for, beyond those configured one by one; a request
    /// naming a new model past it replaces the least recently used
    /// (default [`lb_policies::DEFAULT_MAX_MODELS`]). The model id comes
    /// from the client, so this is what bounds the state a stream of
    /// made-up model names creates when workers do not declare theirs.
    pub max_models: usize,
    /// Polling the engines for their own in-flight counts, so that the
    /// policies see the requests other router replicas sent (default:
    /// every 50 ms; [`LoadPollConfig::off`] turns it off). See
    /// [`crate::load_poll`].
    pub load_poll: LoadPollConfig,
    /// Sharing routing choices with the other router replicas (default:
    /// none). See [`crate::peers`].
    pub peers: crate::peers::PeerConfig,
    /// After a shutdown signal, how long in-flight requests may take to
    /// finish before their connections are dropped (default 30 s).
    pub shutdown_grace: Duration,
    /// Prefill/decode disaggregation (default `None`: every worker serves
    /// whole requests). See [`crate::pd`].
    pub pd: Option<PdConfig>,
    /// Where the regular workers come from when they are discovered: a
    /// [`ServiceRegistry`](worker_lifecycle::ServiceRegistry) of the
    /// `regular` role that a discovery listener feeds (default `None`:
    /// workers are added by hand, [`crate::Router::add_worker`]). Each
    /// request reconciles the pool with it first, so a registration is
    /// routable at once and an expired one is gone (invariants 3 and 4 of
    /// docs/architecture.md).
    pub worker_registry: Option<std::sync::Arc<worker_lifecycle::ServiceRegistry>>,
    /// Networks that workers added at run time (`POST /add_worker`,
    /// registration through [`crate::Router::check_worker_url`]) must be
    /// in; empty (the default) allows any address. See [`crate::allow`].
    pub worker_networks: Vec<CidrBlock>,
    /// Paths, besides the named routes, that are proxied to a worker with
    /// any method (default none: other paths get 404 from the router). An
    /// entry is an exact path (`/version`) or a prefix ending in `/*`
    /// (`/v1/audio/*`). See [`crate::routes`].
    pub passthrough_paths: Vec<String>,
    /// The accept loop's limits: header-read timeout and connection cap.
    pub server: ServerConfig,
    /// What answers an authenticated `POST /register` (default `None`: the
    /// route answers 400, registration not enabled). See [`crate::register`].
    pub register_hook: Option<std::sync::Arc<dyn crate::register::RegisterHook>>,
    /// Series rendered on `/metrics` after the router's own, at scrape time
    /// (default none). See [`crate::metrics::MetricsSource`].
    pub metrics_sources: Vec<std::sync::Arc<dyn crate::metrics::MetricsSource>>,
    /// Whether `/metrics` stays open when an admin key is set (default
    /// `false`: the scrape lists every worker URL, so with
    /// [`admin_api_key`](Self::admin_api_key) set it needs that key, like
    /// `/workers`). Turn on for a Prometheus scraper without credentials,
    /// on a network only it can reach. Without an admin key `/metrics` is
    /// open either way.
    pub metrics_open: bool,
    /// Models whose requests route on the engine's token ids (default
    /// none: every model routes on text). See [`crate::tokens`].
    #[cfg(feature = "tokens")]
    pub tokenizers: crate::tokens::Tokenizers,
    /// The tokenizer pool and the budget of one computation (defaults: a
    /// thread per core, 2 MiB, 2 s, inline up to 4 KiB). See
    /// [`crate::tokens`].
    #[cfg(feature = "tokens")]
    pub tokenize: crate::tokens::TokenizeConfig,
    /// Where the engines publish their KV-cache events, followed when a
    /// pool's policy is `kv_aware` (default: vLLM's example ports on each
    /// worker's host). See [`crate::kv_events`].
    #[cfg(feature = "kv-events")]
    pub kv_events: crate::kv_events::KvEventsConfig,
    /// Which requests get OpenTelemetry spans (default: none). See
    /// [`crate::otel`].
    #[cfg(feature = "otel")]
    pub trace: crate::otel::TraceConfig,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            policy: PolicyConfig::named("cache_aware"),
            max_payload_size: 512 * 1024 * 1024,
            concurrency: ConcurrencyConfig::default(),
            rate_limit_per_second: None,
            api_key: None,
            admin_api_key: None,
            request_id_headers: DEFAULT_REQUEST_ID_HEADERS.map(String::from).to_vec(),
            session_header: "x-session-id".into(),
            client: ClientConfig::default(),
            request_timeout: Duration::from_secs(1800),
            request_body_timeout: Duration::from_secs(60),
            stream_idle_timeout: Duration::from_secs(300),
            retry: RetryPolicy::default(),
            retry_budget: RetryBudgetConfig::default(),
            worker_options: WorkerOptions::default(),
            health: HealthCheckConfig::default(),
            health_endpoint: "/health".into(),
            worker_startup_timeout: Duration::from_secs(600),
            worker_startup_check_interval: Duration::from_secs(1),
            drain_timeout: Duration::from_secs(60),
            eviction_interval: Duration::from_secs(120),
            max_models: lb_policies::DEFAULT_MAX_MODELS,
            load_poll: LoadPollConfig::default(),
            peers: crate::peers::PeerConfig::default(),
            shutdown_grace: Duration::from_secs(30),
            pd: None,
            worker_registry: None,
            worker_networks: Vec::new(),
            passthrough_paths: Vec::new(),
            server: ServerConfig::default(),
            register_hook: None,
            metrics_sources: Vec::new(),
            metrics_open: false,
            #[cfg(feature = "tokens")]
            tokenizers: crate::tokens::Tokenizers::default(),
            #[cfg(feature = "tokens")]
            tokenize: crate::tokens::TokenizeConfig::default(),
            #[cfg(feature = "kv-events")]
            kv_events: crate::kv_events::KvEventsConfig::default(),
            #[cfg(feature = "otel")]
            trace: crate::otel::TraceConfig::default(),
        }
    }
}

/// A configuration the router refuses to start with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The policy name or its knobs are invalid.
    #[error("invalid policy configuration: {0}")]
    Policy(#[from] lb_policies::PolicyError),
    /// A request-id header name is not a valid header name.
    #[error("invalid request-id header name: {0}")]
    RequestIdHeader(String),
    /// The session header name is not a valid header name.
    #[error("invalid session header name: {0:?}")]
    SessionHeader(String),
    /// The rate limit is not a positive number.
    #[error("the rate limit must be a positive number of requests per second, got {0}")]
    RateLimit(f64),
    /// The concurrency limit is zero.
    #[error("max concurrent requests must be at least 1")]
    Concurrency,
    /// The tokenizer pool's settings are invalid (no thread).
    #[error("invalid tokenizer settings: {0}")]
    Tokenize(String),
    /// A worker could not be added.
    #[error("invalid worker {url}: {reason}")]
    Worker {
        /// The worker URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The prefill/decode section is inconsistent (a role with no source,
    /// a connector missing the facts it needs).
    #[error("invalid prefill/decode configuration: {0}")]
    Pd(String),
    /// The peer replicas' settings are invalid.
    #[error("invalid router peers: {0}")]
    Peers(String),
    /// A Mooncake prefill engine's bootstrap server could not be queried at
    /// startup.
    #[error("prefill/decode startup failed: {0}")]
    Bootstrap(#[from] pd_orchestrator::bootstrap::BootstrapError),
}

impl From<PoolsError> for ConfigError {
    fn from(error: PoolsError) -> Self {
        match error {
            PoolsError::Worker { url, reason } => Self::Worker { url, reason },
            PoolsError::Policy(error) => Self::Policy(error),
            other => Self::Pd(other.to_string()),
        }
    }
}
