//! The command line, flag for flag: vllm-router's flags with its defaults,
//! plus this router's own (`--admin-api-key`, `--shutdown-grace-period-secs`,
//! `--config`, the simulator flags, `--log-json` and the trace export's
//! `--otlp-traces-protocol` and `--otlp-traces-ca-file`).
//!
//! [`Args`] is also the shape of the `--config` TOML file: every field is a
//! key (snake_case, or the flag's kebab-case spelling), so a file and a
//! command line say the same things.

use std::ffi::OsStr;

use clap::builder::{PossibleValue, StringValueParser, TypedValueParser};
use clap::{Parser, ValueEnum};
use pd_orchestrator::PdConnector;
use serde::{Deserialize, Serialize};

/// Load-balancing policies accepted by `--policy`, `--prefill-policy` and
/// `--decode-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum PolicyName {
    /// Uniformly random.
    Random,
    /// Each worker in turn.
    RoundRobin,
    /// Prefix affinity through a radix tree, yielding to load per request.
    CacheAware,
    /// The less loaded of two random workers.
    PowerOfTwo,
    /// A hash ring over a session, user or header key.
    ConsistentHash,
    /// Highest-random-weight hashing over the same keys.
    RendezvousHash,
    /// The least loaded worker, fair among ties.
    LeastLoaded,
    /// Prefix affinity scored on the blocks the engines hold, from their
    /// KV-cache events (--kv-events-port); workers without a live event
    /// stream are scored from the radix tree. Places each request where
    /// its uncached blocks plus the load already there cost least.
    KvAware,
    /// kv_aware's scores placed by cache_aware's threshold and load gate
    /// instead of the least cost (for comparison).
    KvAwareGate,
    /// cache_aware with token input placed by kv_aware's least cost, each
    /// worker credited its own match in the radix tree; text input keeps
    /// the gate (for comparison: the simulator keeps the gate as
    /// cache_aware's default, see docs/policies.md).
    CacheAwareCost,
}

impl PolicyName {
    /// The name as on the command line and in lb-policies.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::RoundRobin => "round_robin",
            Self::CacheAware => "cache_aware",
            Self::PowerOfTwo => "power_of_two",
            Self::ConsistentHash => "consistent_hash",
            Self::RendezvousHash => "rendezvous_hash",
            Self::LeastLoaded => "least_loaded",
            Self::KvAware => "kv_aware",
            Self::KvAwareGate => "kv_aware_gate",
            Self::CacheAwareCost => "cache_aware_cost",
        }
    }
}

/// Log levels accepted by `--log-level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[value(rename_all = "lowercase")]
pub enum LogLevel {
    /// Everything, including per-connection details.
    Trace,
    /// Debugging detail.
    Debug,
    /// Start-up, membership and shutdown (the default).
    Info,
    /// Problems the router works around.
    Warn,
    /// Failures only.
    Error,
}

impl LogLevel {
    /// The level as a tracing filter directive.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Trace => "trace",
            Self::Debug => "debug",
            Self::Info => "info",
            Self::Warn => "warn",
            Self::Error => "error",
        }
    }
}

/// Backends accepted by `--backend` (vllm-router's flag; only vLLM-style
/// OpenAI engines are supported here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[value(rename_all = "lowercase")]
pub enum BackendName {
    /// vLLM or any engine with vLLM's OpenAI endpoints (the default).
    Vllm,
    /// TensorRT-LLM (refused: not supported).
    Trtllm,
    /// An OpenAI-compatible upstream API (refused: not supported).
    Openai,
    /// Anthropic's API (refused: not supported).
    Anthropic,
}

/// How the chat template expects message content: vLLM's
/// `--chat-template-content-format` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[value(rename_all = "lowercase")]
pub enum ContentFormatName {
    /// Detected from the template, as vLLM does (the default).
    #[default]
    Auto,
    /// Content is one string, text parts joined with newlines.
    String,
    /// Content is a list of typed parts.
    Openai,
}

impl ContentFormatName {
    /// The format to force, `None` for `auto`.
    pub fn format(self) -> Option<prompt_tokens::ContentFormat> {
        match self {
            Self::Auto => None,
            Self::String => Some(prompt_tokens::ContentFormat::String),
            Self::Openai => Some(prompt_tokens::ContentFormat::OpenAi),
        }
    }
}

/// The reference router's command line. Defaults are vllm-router's.
#[derive(Debug, Clone, PartialEq, Parser, Serialize, Deserialize)]
#[command(
    name = "router",
    version,
    allow_negative_numbers = true,
    about = "affinity-router: a cache-aware, load-exact router for vLLM-style engines",
    long_about = "affinity-router: a cache-aware, load-exact router for vLLM-style engines.\n\n\
        With no arguments at all it starts four simulated engines in-process (engine-sim) and \
        routes to them, so it works out of the box; --sim-workers N or --sim-pd P:D start \
        simulated engines explicitly. With vllm-router's flags it fronts real engines: existing \
        command lines work unchanged. Like vllm-router, any other command line without a \
        worker source (--worker-urls, --prefill/--decode, discovery) starts an empty fleet: \
        add workers with POST /add_worker?url=URL."
)]
#[serde(deny_unknown_fields, default)]
pub struct Args {
    // ----- Serving -----
    /// Address to bind the router to.
    #[arg(long, default_value = "127.0.0.1", help_heading = "Serving")]
    pub host: String,
    /// Port to bind the router to (0 picks a free port and prints it).
    #[arg(long, default_value_t = 30000, help_heading = "Serving")]
    pub port: u16,
    /// Largest request body accepted, in bytes; larger is answered 413.
    #[arg(long, default_value_t = 536_870_912, help_heading = "Serving")]
    pub max_payload_size: usize,
    /// Whole-request deadline in seconds, response body included.
    #[arg(long, default_value_t = 1800, help_heading = "Serving")]
    pub request_timeout_secs: u64,
    /// Headers read for a request id, in order (default x-request-id,
    /// x-correlation-id, x-trace-id, request-id).
    #[arg(long, num_args = 0.., value_name = "HEADER", help_heading = "Serving")]
    pub request_id_headers: Vec<String>,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32768, help_heading = "Serving")]
    pub max_concurrent_requests: usize,
    /// Requests allowed to wait for a slot (0 refuses at once with 429).
    #[arg(long, default_value_t = 100, help_heading = "Serving")]
    pub queue_size: usize,
    /// How long a queued request waits, in seconds, before a 408.
    #[arg(long, default_value_t = 60, help_heading = "Serving")]
    pub queue_timeout_secs: u64,
    /// Token-bucket rate limit in requests per second (off when unset).
    #[arg(long, value_name = "RATE", help_heading = "Serving")]
    pub rate_limit_tokens_per_second: Option<f64>,
    /// Inference API key: proxied routes need `Authorization: Bearer KEY`.
    #[arg(long, value_name = "KEY", help_heading = "Serving")]
    pub api_key: Option<String>,
    /// Admin API key for /add_worker, /remove_worker and /register (falls
    /// back to --api-key when unset).
    #[arg(long, value_name = "KEY", help_heading = "Serving")]
    pub admin_api_key: Option<String>,
    /// Serve /metrics (and the Prometheus port) without the admin key even
    /// when --admin-api-key is set, for a scraper without credentials on a
    /// network only it can reach.
    #[arg(long, help_heading = "Serving")]
    pub metrics_open: bool,
    /// After SIGTERM or Ctrl-C, how long in-flight requests may take to
    /// finish, in seconds.
    #[arg(long, default_value_t = 30, help_heading = "Serving")]
    pub shutdown_grace_period_secs: u64,
    /// How long a client may take to send its request body, in seconds
    /// (never past --request-timeout-secs); past it, 408.
    #[arg(long, default_value_t = 60, help_heading = "Serving")]
    pub request_body_timeout_secs: u64,
    /// How long a new connection may take to send its first bytes, and an
    /// HTTP/1 client a request's headers, in seconds; the connection is
    /// closed past it (also an idle keep-alive connection). 0 turns it off.
    #[arg(long, default_value_t = 30, help_heading = "Serving")]
    pub header_read_timeout_secs: u64,
    /// Client connections served at once; at the cap new ones wait in the
    /// listen backlog until one closes.
    #[arg(long, default_value_t = 16384, help_heading = "Serving")]
    pub max_connections: usize,
    /// Paths proxied to a worker besides the named routes, with any method:
    /// an exact path (/version) or a prefix ending in /* (/v1/audio/*).
    /// Other paths are answered 404 by the router.
    #[arg(long, num_args = 0.., value_name = "PATH", help_heading = "Serving")]
    pub passthrough_paths: Vec<String>,
    /// Accepted for compatibility; this router sets no CORS headers.
    #[arg(long, num_args = 0.., value_name = "ORIGIN", help_heading = "Serving")]
    pub cors_allowed_origins: Vec<String>,

    // ----- Workers -----
    /// Worker URLs (http://host:port). Given with no URL, the router starts
    /// with no workers (add them with POST /add_worker).
    #[arg(long, num_args = 0.., value_name = "URL", help_heading = "Workers")]
    pub worker_urls: Vec<String>,
    /// Networks (CIDR, e.g. 10.0.0.0/8) that workers added at run time
    /// (POST /add_worker, /register) must be in; a host name is resolved and
    /// all its addresses must be. Unset: any address.
    #[arg(long, num_args = 0.., value_name = "CIDR", help_heading = "Workers")]
    pub worker_networks: Vec<String>,
    /// Data-parallel ranks per worker URL: each URL becomes `url@rank`
    /// workers and requests carry `X-data-parallel-rank`.
    #[arg(long, default_value_t = 1, help_heading = "Workers")]
    pub intra_node_data_parallel_size: u32,
    /// Longest wait, in seconds, for a configured worker's first healthy probe.
    #[arg(long, default_value_t = 600, help_heading = "Workers")]
    pub worker_startup_timeout_secs: u64,
    /// Seconds between probes while waiting for a worker to start.
    #[arg(long, default_value_t = 30, help_heading = "Workers")]
    pub worker_startup_check_interval: u64,
    /// Only `vllm` (vLLM-style OpenAI engines) is supported.
    #[arg(long, value_enum, default_value_t = BackendName::Vllm, alias = "runtime", help_heading = "Workers")]
    pub backend: BackendName,

    // ----- Policy -----
    /// Load-balancing policy.
    #[arg(long, value_enum, default_value_t = PolicyName::CacheAware, help_heading = "Policy")]
    pub policy: PolicyName,
    /// cache_aware: minimum prefix match rate (0.0-1.0) to follow affinity.
    #[arg(long, default_value_t = 0.3, help_heading = "Policy")]
    pub cache_threshold: f64,
    /// cache_aware: the affine worker yields when its load exceeds the least
    /// loaded one's by more than this...
    #[arg(long, default_value_t = 64, help_heading = "Policy")]
    pub balance_abs_threshold: usize,
    /// ...and is more than this factor (>= 1.0) times it.
    #[arg(long, default_value_t = 1.5, help_heading = "Policy")]
    pub balance_rel_threshold: f64,
    /// kv_aware: KV blocks of prefill one in-flight request is worth in the
    /// expected cost `(blocks not cached) + weight x load` it minimises; 0
    /// ignores load.
    #[arg(long, default_value_t = lb_policies::DEFAULT_LOAD_WEIGHT, help_heading = "Policy")]
    pub kv_aware_load_weight: f64,
    /// kv_aware: how much less load counts when the engines' KV caches are
    /// nearly full (their polled vllm:kv_cache_usage_perc past 0.8): the
    /// load weight is divided by 1 + this x the fleet's mean pressure, so
    /// a saturated fleet moves sessions off their cached engines less; 0
    /// ignores cache usage.
    #[arg(long, default_value_t = lb_policies::DEFAULT_EVICTION_WEIGHT, help_heading = "Policy")]
    pub kv_aware_eviction_weight: f64,
    /// kv_aware: the mean number of requests waiting per engine (their
    /// polled vllm:num_requests_waiting) at which the fleet counts as
    /// overloaded; then a request goes to the worker holding (or last sent)
    /// its longest prefix unless the load gate (--balance-abs-threshold,
    /// --balance-rel-threshold) says it yields, instead of the least cost.
    /// 0 never.
    #[arg(long, default_value_t = lb_policies::DEFAULT_OVERLOAD_ENTER, value_name = "REQUESTS", help_heading = "Policy")]
    pub kv_aware_overload_enter: f64,
    /// kv_aware: the mean waiting count at which the overload ends (at most
    /// --kv-aware-overload-enter).
    #[arg(long, default_value_t = lb_policies::DEFAULT_OVERLOAD_LEAVE, value_name = "REQUESTS", help_heading = "Policy")]
    pub kv_aware_overload_leave: f64,
    /// kv_aware: softmax temperature over the workers' costs, in units of
    /// one whole prefill of the request; 0 always takes the least cost
    /// (vllm-router's and Dynamo's flag).
    #[arg(long, default_value_t = 0.0, help_heading = "Policy")]
    pub router_temperature: f64,
    /// kv_aware: what loading a block back from an engine's host memory
    /// (KV events of medium CPU) costs, as a fraction of computing it: a
    /// prefix held there saves 1 - this per block (0: as good as a GPU
    /// hit, 1: no credit).
    #[arg(long, default_value_t = lb_policies::DEFAULT_HOST_PENALTY, value_name = "FRACTION", help_heading = "Policy")]
    pub kv_penalty_host: f64,
    /// kv_aware: the same for an engine's local disk (medium DISK).
    #[arg(long, default_value_t = lb_policies::DEFAULT_LOWER_PENALTY, value_name = "FRACTION", help_heading = "Policy")]
    pub kv_penalty_disk: f64,
    /// kv_aware: the same for a store outside the engine (any other
    /// medium: a connector's remote or shared store).
    #[arg(long, default_value_t = lb_policies::DEFAULT_LOWER_PENALTY, value_name = "FRACTION", help_heading = "Policy")]
    pub kv_penalty_external: f64,
    /// kv_aware: soft session affinity. A request whose session key
    /// (its x-session-id header, else the body's `user` field) was placed
    /// within this many seconds goes to the same worker unless
    /// it is down or the load gate (--balance-abs-threshold and
    /// --balance-rel-threshold) makes it yield; each request refreshes
    /// it. 0 (the default) turns it off.
    #[arg(
        long,
        default_value_t = 0,
        value_name = "SECS",
        help_heading = "Policy"
    )]
    pub kv_aware_session_affinity_ttl_secs: u64,
    /// cache_aware: seconds between upkeep passes over the prefix trees (a
    /// fallback: every insert keeps its tree within --max-tree-size and
    /// --max-tree-bytes).
    #[arg(
        long,
        alias = "eviction-interval",
        default_value_t = 120,
        help_heading = "Policy"
    )]
    pub eviction_interval_secs: u64,
    /// cache_aware: per-worker prefix-tree limit, in characters (tokens on
    /// token ids); an insert past it evicts the worker's least recently used
    /// entries first.
    #[arg(long, default_value_t = 67_108_864, help_heading = "Policy")]
    pub max_tree_size: usize,
    /// cache_aware and kv_aware: memory budget of all prefix trees (every
    /// model, pool and kind), in bytes; an insert past it evicts least
    /// recently used entries first.
    #[arg(
        long,
        default_value_t = lb_policies::DEFAULT_MAX_TREE_BYTES,
        value_name = "BYTES",
        help_heading = "Policy"
    )]
    pub max_tree_bytes: u64,
    /// Models each pool keeps routing state for (a policy instance with its
    /// prefix trees and metric series), besides --kv-event-model's; a
    /// request naming another model replaces the least recently used. Model names come from clients: this bounds what made-up names
    /// cost when the workers do not declare their models.
    #[arg(
        long,
        default_value_t = lb_policies::DEFAULT_MAX_MODELS,
        value_name = "N",
        help_heading = "Policy"
    )]
    pub max_routed_models: usize,
    /// cache_aware on token ids: the engines' KV block size (vLLM's
    /// --block-size). A token match counts in whole blocks, and
    /// --cache-threshold applies to those cached tokens. kv_aware's KV
    /// index hashes blocks of this size too (--kv-event-block-size is the
    /// same setting).
    #[arg(
        long,
        default_value_t = 16,
        value_name = "TOKENS",
        help_heading = "Policy"
    )]
    pub block_size: usize,

    // ----- Engine-reported load -----
    /// Milliseconds between polls of every engine's own in-flight count
    /// (vLLM's /metrics, else /get_load), so that the policies also count
    /// the requests other router replicas sent; 0 turns polling off.
    #[arg(
        long,
        default_value_t = 50,
        value_name = "MS",
        help_heading = "Engine-reported load"
    )]
    pub load_poll_interval_ms: u64,
    /// Most engine polls per second over the whole fleet (about 23 µs of
    /// router CPU each): a fleet larger than interval x this is polled less
    /// often, each round lasting engines / this. 0 removes the limit.
    #[arg(
        long,
        default_value_t = router_http::load_poll::DEFAULT_MAX_POLLS_PER_SEC,
        value_name = "POLLS",
        help_heading = "Engine-reported load"
    )]
    pub load_poll_budget: u32,

    // ----- Router replicas -----
    /// The other router replicas behind the same load balancer
    /// (http://host:port): this replica posts each of its routing choices
    /// to them every --router-peer-batch-ms, so every replica's prefix tree
    /// learns where the fleet sent each prefix, as one router's would.
    /// Needs --router-peer-token.
    #[arg(long, num_args = 1.., value_name = "URL", help_heading = "Router replicas")]
    pub router_peers: Vec<String>,
    /// The replicas' shared secret (or the ROUTER_PEER_TOKEN environment
    /// variable): peers present it to POST /peer_choices, which exists
    /// only when it is set.
    #[arg(
        long,
        env = "ROUTER_PEER_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN",
        help_heading = "Router replicas"
    )]
    pub router_peer_token: Option<String>,
    /// Milliseconds between two batches of choices to the peers.
    #[arg(
        long,
        default_value_t = 5,
        value_name = "MS",
        help_heading = "Router replicas"
    )]
    pub router_peer_batch_ms: u64,

    // ----- Prefill/decode -----
    /// Route prefill and decode to separate engines (vLLM P/D disaggregation).
    #[arg(long, help_heading = "Prefill/decode")]
    pub vllm_pd_disaggregation: bool,
    /// A prefill engine and, optionally, its bootstrap port (or `none`);
    /// repeatable. In a config file: a flat list, each URL optionally
    /// followed by its port.
    #[arg(long, num_args = 1..=2, action = clap::ArgAction::Append, value_names = ["URL", "BOOTSTRAP_PORT"], help_heading = "Prefill/decode")]
    pub prefill: Vec<String>,
    /// A decode engine; repeatable.
    #[arg(long, value_name = "URL", help_heading = "Prefill/decode")]
    pub decode: Vec<String>,
    /// Policy of the prefill engines (default: --policy).
    #[arg(long, value_enum, help_heading = "Prefill/decode")]
    pub prefill_policy: Option<PolicyName>,
    /// Policy of the decode engines (default: --policy).
    #[arg(long, value_enum, help_heading = "Prefill/decode")]
    pub decode_policy: Option<PolicyName>,
    /// KV connector between prefill and decode engines (`moriio` alone
    /// means `moriio-read`).
    #[arg(long, value_parser = ConnectorParser, default_value_t = PdConnector::Nixl, help_heading = "Prefill/decode")]
    #[serde(with = "connector_name")]
    pub kv_connector: PdConnector,
    /// Bind a ZMQ ROUTER socket here (HOST:PORT) for vLLM engines to
    /// register themselves (P/D mode).
    #[arg(long, value_name = "HOST:PORT", help_heading = "Prefill/decode")]
    pub vllm_discovery_address: Option<String>,
    /// Seconds a discovered engine stays registered after its last message.
    #[arg(long, default_value_t = 5, help_heading = "Prefill/decode")]
    pub vllm_discovery_ttl_secs: u64,
    /// Largest ZMQ frame the discovery socket accepts, in bytes; libzmq
    /// refuses a larger one before buffering it and closes that
    /// connection (a registration is a few hundred bytes).
    #[arg(
        long,
        default_value_t = worker_discovery::DEFAULT_MAX_MESSAGE_SIZE,
        value_name = "BYTES",
        help_heading = "Prefill/decode"
    )]
    pub zmq_max_message_size: usize,

    // ----- Retries and circuit breaker -----
    /// Retries after the first attempt, before any byte reached the client.
    #[arg(
        long,
        default_value_t = 5,
        help_heading = "Retries and circuit breaker"
    )]
    pub retry_max_retries: u32,
    /// Backoff before the first retry, in milliseconds.
    #[arg(
        long,
        default_value_t = 50,
        help_heading = "Retries and circuit breaker"
    )]
    pub retry_initial_backoff_ms: u64,
    /// Largest backoff, in milliseconds.
    #[arg(
        long,
        default_value_t = 30000,
        help_heading = "Retries and circuit breaker"
    )]
    pub retry_max_backoff_ms: u64,
    /// Backoff growth per retry (>= 1.0).
    #[arg(
        long,
        default_value_t = 1.5,
        help_heading = "Retries and circuit breaker"
    )]
    pub retry_backoff_multiplier: f64,
    /// Fraction (0.0-1.0) of each backoff that jitter may take off.
    #[arg(
        long,
        default_value_t = 0.2,
        help_heading = "Retries and circuit breaker"
    )]
    pub retry_jitter_factor: f64,
    /// Never retry.
    #[arg(long, help_heading = "Retries and circuit breaker")]
    pub disable_retries: bool,
    /// Consecutive failures that open a worker's circuit breaker.
    #[arg(
        long,
        default_value_t = 10,
        help_heading = "Retries and circuit breaker"
    )]
    pub cb_failure_threshold: u32,
    /// Successful half-open probes that close it again.
    #[arg(
        long,
        default_value_t = 3,
        help_heading = "Retries and circuit breaker"
    )]
    pub cb_success_threshold: u32,
    /// Seconds an open breaker waits before letting a probe request through.
    #[arg(
        long,
        default_value_t = 60,
        help_heading = "Retries and circuit breaker"
    )]
    pub cb_timeout_duration_secs: u64,
    /// When set, also open on a 50 % failure rate over this many seconds
    /// (at least 20 requests in the window).
    #[arg(
        long,
        default_value_t = 120,
        help_heading = "Retries and circuit breaker"
    )]
    pub cb_window_duration_secs: u64,
    /// Turn the circuit breakers off.
    #[arg(long, help_heading = "Retries and circuit breaker")]
    pub disable_circuit_breaker: bool,
    /// Largest share (0.0-1.0) of a pool's live workers that open breakers
    /// may exclude; beyond it the excess is let through (Envoy's
    /// max_ejection_percent). 1.0: no cap.
    #[arg(
        long,
        default_value_t = 0.8,
        value_name = "FRACTION",
        help_heading = "Retries and circuit breaker"
    )]
    pub cb_max_exclusion: f64,
    /// Below this share (0.0-1.0) of available live workers a pool is in
    /// panic: the policy sees every live worker again and clients get the
    /// workers' own answers (Envoy's panic threshold). 0.0: never.
    #[arg(
        long,
        default_value_t = 0.2,
        value_name = "FRACTION",
        help_heading = "Retries and circuit breaker"
    )]
    pub pool_panic_threshold: f64,
    /// The smallest number of live workers at which a pool applies
    /// --cb-max-exclusion and --pool-panic-threshold; a smaller pool trusts
    /// every open breaker, so a single failing worker gets a fast 503 as
    /// with vllm-router.
    #[arg(
        long,
        default_value_t = worker_lifecycle::DEFAULT_FLEET_GUARD_MIN_WORKERS,
        value_name = "N",
        help_heading = "Retries and circuit breaker"
    )]
    pub pool_guard_min_workers: usize,

    // ----- Health checks -----
    /// Consecutive failed probes that mark a worker unhealthy.
    #[arg(long, default_value_t = 3, help_heading = "Health checks")]
    pub health_failure_threshold: u32,
    /// Consecutive successful probes that mark it healthy again.
    #[arg(long, default_value_t = 2, help_heading = "Health checks")]
    pub health_success_threshold: u32,
    /// Per-probe timeout, in seconds.
    #[arg(long, default_value_t = 5, help_heading = "Health checks")]
    pub health_check_timeout_secs: u64,
    /// Seconds between health-check rounds.
    #[arg(long, default_value_t = 60, help_heading = "Health checks")]
    pub health_check_interval_secs: u64,
    /// Path probed with GET on every worker.
    #[arg(long, default_value = "/health", help_heading = "Health checks")]
    pub health_check_endpoint: String,

    // ----- Token routing -----
    /// Route on the engine's token ids: a model directory (tokenizer.json
    /// and tokenizer_config.json with its chat template) or a tokenizer.json
    /// file, for every model. Per model: [models."ID"] tables in the
    /// --config file. Unset: routing on the messages' text (simulated
    /// engines: their synthetic tokenizer).
    #[arg(long, value_name = "DIR|FILE", help_heading = "Token routing")]
    pub tokenizer_path: Option<String>,
    /// A Jinja chat template file that replaces the model's own (needs
    /// --tokenizer-path).
    #[arg(long, value_name = "FILE", help_heading = "Token routing")]
    pub chat_template: Option<String>,
    /// How the chat template expects message content, as the engine's own
    /// flag of this name says: auto (detected from the template, as vLLM
    /// does), string or openai. Must match the engines' setting, or the
    /// router's token ids differ from theirs.
    #[arg(
        long,
        value_enum,
        default_value_t = ContentFormatName::Auto,
        help_heading = "Token routing"
    )]
    pub chat_template_content_format: ContentFormatName,
    /// Prompts larger than --tokenize-inline-bytes are tokenized on a pool
    /// of this many threads, off the threads that serve requests; more
    /// wait, within --request-timeout-secs. Default: the number of cores.
    #[arg(long, value_name = "N", help_heading = "Token routing")]
    pub tokenizer_threads: Option<usize>,
    /// A body (or rendered prompt) larger than this is not tokenized: it
    /// routes on text, counted in router_tokens_over_budget_total.
    #[arg(
        long,
        default_value_t = 2 * 1024 * 1024,
        value_name = "BYTES",
        help_heading = "Token routing"
    )]
    pub tokenize_max_bytes: usize,
    /// Work time of one prompt's tokenization, in seconds, checked between
    /// segments; past it the request routes on text (counted as over
    /// budget).
    #[arg(
        long,
        default_value_t = 2.0,
        value_name = "SECS",
        help_heading = "Token routing"
    )]
    pub tokenize_max_secs: f64,
    /// Bodies up to this size are tokenized inline (handing them to a
    /// thread costs more than the work).
    #[arg(
        long,
        default_value_t = 4096,
        value_name = "BYTES",
        help_heading = "Token routing"
    )]
    pub tokenize_inline_bytes: usize,

    // ----- KV events -----
    /// kv_aware: the port of each engine's KV event publisher, on the
    /// worker's host (vLLM's --kv-events-config endpoint; data-parallel
    /// rank r at this port + r). Per worker: --kv-event-source, or
    /// [workers."URL"] tables in the --config file.
    #[arg(
        long,
        default_value_t = 5557,
        value_name = "PORT",
        help_heading = "KV events"
    )]
    pub kv_events_port: u16,
    /// kv_aware: the port of each engine's replay socket (vLLM's
    /// replay_endpoint); 0 turns replay off (a gap then resets the
    /// worker's view until events flow again).
    #[arg(
        long,
        default_value_t = 5558,
        value_name = "PORT",
        help_heading = "KV events"
    )]
    pub kv_events_replay_port: u16,
    /// kv_aware: the topic the engines publish under (vLLM's `topic`;
    /// empty takes every topic).
    #[arg(
        long,
        default_value = "",
        value_name = "TOPIC",
        help_heading = "KV events"
    )]
    pub kv_events_topic: String,
    /// kv_aware: where a --worker-urls worker's engine publishes its KV
    /// events, instead of --kv-events-port on its host: one endpoint
    /// (data-parallel rank r at its port + r) or one per rank, in rank
    /// order. Repeatable, one worker each; wins over the worker's
    /// [workers."URL"] table. Without --kv-event-replay-source (or the
    /// table's replay key) the worker has no replay.
    #[arg(
        long,
        value_name = "WORKER_URL=ENDPOINT[,ENDPOINT...]",
        help_heading = "KV events"
    )]
    pub kv_event_source: Vec<String>,
    /// kv_aware: where a worker's engine serves replays (vLLM's
    /// replay_endpoint), instead of --kv-events-replay-port on its host;
    /// same shape as --kv-event-source. Names a --worker-urls worker or a
    /// P/D one. Repeatable.
    #[arg(
        long,
        value_name = "WORKER_URL=ENDPOINT[,ENDPOINT...]",
        help_heading = "KV events"
    )]
    pub kv_event_replay_source: Vec<String>,
    /// kv_aware in P/D: where a --prefill or --decode worker's engine
    /// publishes its KV events (as --kv-event-source); its role's policy
    /// must be kv_aware. Repeatable.
    #[arg(
        long,
        value_name = "URL=ENDPOINT[,ENDPOINT...]",
        help_heading = "KV events"
    )]
    pub pd_kv_events: Vec<String>,
    /// kv_aware: the engines' KV block size, which the KV index hashes
    /// with: the same setting as --block-size (kv_aware scores cold
    /// workers in the same blocks), so this sets it; both given must agree.
    #[arg(long, value_name = "TOKENS", help_heading = "KV events")]
    pub kv_event_block_size: Option<usize>,
    /// kv_aware: the one served model whose requests are scored on the KV
    /// index (its tokenizer's ids are what the engines hash); every other
    /// model's requests are placed by cache_aware with the same knobs.
    /// Needs a tokenizer for the model (--tokenizer-path or its
    /// [models."ID"] table). Unset: every model's.
    #[arg(long, value_name = "MODEL", help_heading = "KV events")]
    pub kv_event_model: Option<String>,
    /// Largest KV event payload (one ZMQ frame) accepted from an engine's
    /// publisher, in bytes; a larger frame closes the connection, which is
    /// reopened.
    #[arg(
        long,
        default_value_t = 16 * 1024 * 1024,
        value_name = "BYTES",
        help_heading = "KV events"
    )]
    pub kv_events_max_message_size: usize,
    /// Most KV-cache blocks the KV index keeps for each data-parallel rank
    /// of a worker; a rank that reports more loses its oldest blocks from
    /// the index (counted as evicted over cap).
    #[arg(
        long,
        default_value_t = kv_block_index::DEFAULT_MAX_BLOCKS_PER_HOLDER.get(),
        value_name = "N",
        help_heading = "KV events"
    )]
    pub kv_index_max_blocks_per_worker: usize,

    // ----- Observability -----
    /// Address of the extra Prometheus listener (metrics are also at
    /// /metrics on the main port).
    #[arg(long, default_value = "127.0.0.1", help_heading = "Observability")]
    pub prometheus_host: String,
    /// Port of the extra Prometheus listener (0 picks a free port).
    #[arg(long, default_value_t = 29000, help_heading = "Observability")]
    pub prometheus_port: u16,
    /// Log level (RUST_LOG, when set, takes precedence).
    #[arg(long, value_enum, default_value_t = LogLevel::Info, help_heading = "Observability")]
    pub log_level: LogLevel,
    /// Also write logs to `DIR/affinity-router.log`.
    #[arg(long, value_name = "DIR", help_heading = "Observability")]
    pub log_dir: Option<String>,
    /// Log as JSON lines instead of human-readable text.
    #[arg(long, help_heading = "Observability")]
    pub log_json: bool,
    /// Export OpenTelemetry traces of every request (its routing decision
    /// and upstream attempts) over OTLP (gRPC unless
    /// --otlp-traces-protocol says otherwise), and send each attempt's W3C
    /// `traceparent` to the worker.
    #[arg(long, help_heading = "Observability")]
    pub enable_trace: bool,
    /// The OTLP collector (default `localhost:4317`, as vllm-router). For
    /// gRPC: `HOST:PORT`, `http://HOST:PORT` or `grpc://HOST:PORT`
    /// (cleartext), `https://HOST:PORT` (TLS). For http/protobuf: the
    /// traces URL (`HOST:PORT` or a URL without a path means
    /// `/v1/traces`; default `http://localhost:4318/v1/traces`). Needs
    /// --enable-trace.
    #[arg(long, value_name = "URL", help_heading = "Observability")]
    pub otlp_traces_endpoint: Option<String>,
    /// The OTLP transport: `grpc` (default, as vllm-router) or
    /// `http/protobuf` (OpenTelemetry's
    /// OTEL_EXPORTER_OTLP_TRACES_PROTOCOL values). Needs --enable-trace.
    #[arg(long, value_name = "PROTOCOL", help_heading = "Observability")]
    pub otlp_traces_protocol: Option<String>,
    /// PEM certificates to trust for an https:// --otlp-traces-endpoint
    /// instead of the system's roots (a private CA or a self-signed
    /// collector). Unset: the system's roots (SSL_CERT_FILE and
    /// SSL_CERT_DIR are honoured). Needs --enable-trace.
    #[arg(long, value_name = "FILE", help_heading = "Observability")]
    pub otlp_traces_ca_file: Option<String>,
    /// The fraction (0.0 to 1.0) of new traces sampled; a request that
    /// arrives with a `traceparent` follows its parent's decision. Needs
    /// --enable-trace.
    #[arg(long, default_value_t = 1.0, help_heading = "Observability")]
    pub otel_sampling_ratio: f64,
    /// Paths that get no span (comma-separated or repeated), e.g.
    /// `/health,/metrics`. Needs --enable-trace.
    #[arg(
        long,
        num_args = 0..,
        value_delimiter = ',',
        value_name = "PATH",
        help_heading = "Observability"
    )]
    pub otel_excluded_paths: Vec<String>,

    // ----- Kubernetes discovery -----
    /// Discover workers from Kubernetes pods: Running, Ready pods with an
    /// IP that match --selector (or, with --vllm-pd-disaggregation,
    /// --prefill-selector / --decode-selector). Needs get, list and watch on
    /// pods.
    #[arg(long, help_heading = "Kubernetes discovery")]
    pub service_discovery: bool,
    /// Label selector of regular worker pods, `key=value` ... (all must match).
    #[arg(long, num_args = 0.., value_name = "KEY=VALUE", help_heading = "Kubernetes discovery")]
    pub selector: Vec<String>,
    /// Label selector of prefill pods (P/D); a prefill pod's KV bootstrap
    /// port comes from its annotation `vllm.ai/bootstrap-port`.
    #[arg(long, num_args = 0.., value_name = "KEY=VALUE", help_heading = "Kubernetes discovery")]
    pub prefill_selector: Vec<String>,
    /// Label selector of decode pods.
    #[arg(long, num_args = 0.., value_name = "KEY=VALUE", help_heading = "Kubernetes discovery")]
    pub decode_selector: Vec<String>,
    /// Port the workers serve on, at each pod's IP.
    #[arg(long, default_value_t = 80, help_heading = "Kubernetes discovery")]
    pub service_discovery_port: u16,
    /// The one namespace watched (default: all namespaces, which needs a
    /// ClusterRole).
    #[arg(long, value_name = "NAMESPACE", help_heading = "Kubernetes discovery")]
    pub service_discovery_namespace: Option<String>,

    // ----- Simulated engines (this router's demo mode) -----
    /// Start N engine-sim engines in-process and route to them (4 when the
    /// command line is empty; without this flag, other flags and no worker
    /// source start an empty fleet).
    #[arg(long, default_value_t = 4, help_heading = "Simulated engines")]
    pub sim_workers: usize,
    /// Start PREFILL:DECODE simulated engines for a P/D demo (e.g. 2:2).
    #[arg(long, value_name = "P:D", help_heading = "Simulated engines")]
    pub sim_pd: Option<String>,
    /// Speed of the simulated engines' latency model: 1.0 real time, 0.01
    /// a hundred times faster, 0 no simulated latency.
    #[arg(long, default_value_t = 1.0, help_heading = "Simulated engines")]
    pub sim_time_scale: f64,

    // ----- Configuration file -----
    /// Read settings from this TOML file (keys are the flag names; flags
    /// given on the command line win).
    #[arg(long, value_name = "FILE", help_heading = "Configuration file")]
    #[serde(skip)]
    pub config: Option<String>,
}

impl Default for Args {
    fn default() -> Self {
        Args::parse_from(["router"])
    }
}

/// `--kv-connector`: parsed by [`PdConnector`]'s own
/// [`FromStr`](std::str::FromStr), which
/// names the accepted connectors when it refuses one; its
/// [`NAMES`](PdConnector::NAMES) are the possible values `--help` shows.
#[derive(Debug, Clone, Copy)]
struct ConnectorParser;

impl TypedValueParser for ConnectorParser {
    type Value = PdConnector;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<PdConnector, clap::Error> {
        StringValueParser::new()
            .try_map(|name| name.parse::<PdConnector>())
            .parse_ref(cmd, arg, value)
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(
            PdConnector::NAMES.into_iter().map(PossibleValue::new),
        ))
    }
}

/// `kv_connector` in the `--config` file: the command line's names, read
/// and written by [`PdConnector`] itself.
mod connector_name {
    use pd_orchestrator::PdConnector;
    use serde::{Deserialize, Deserializer, Serializer, de};

    pub(super) fn serialize<S: Serializer>(
        connector: &PdConnector,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(connector.as_str())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<PdConnector, D::Error> {
        String::deserialize(deserializer)?
            .parse()
            .map_err(de::Error::custom)
    }
}

/// Every flag's id (the field name, as in the TOML file), in declaration order.
pub fn flag_ids() -> Vec<String> {
    use clap::CommandFactory;
    Args::command()
        .get_arguments()
        .filter(|arg| arg.get_long().is_some())
        .map(|arg| arg.get_id().to_string())
        .collect()
}

/// The `--long-name` of a field, as clap knows it.
pub fn long_flag(id: &str) -> String {
    format!("--{}", id.replace('_', "-"))
}
