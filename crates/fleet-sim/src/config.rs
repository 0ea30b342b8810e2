//! What a run is given and what it reports.

use std::time::Duration;

use engine_sim::ModelConfig;
use lb_policies::{CacheAwareConfig, INDEX_POLICIES, PolicyError};

use crate::metrics::{LoadTimeline, PolicyMetrics};

/// Sizes of the two pools of a prefill/decode simulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PdSplit {
    /// Prefill engines (placed by the policy under test).
    pub prefill: usize,
    /// Decode engines (placed by [`SimConfig::decode_policy`]).
    pub decode: usize,
}

/// How a run is set up.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// The engine model of every engine. Default: engine-sim's defaults
    /// (4,096 blocks of 16 tokens, at most 64 running sequences, 20 µs per
    /// uncached prompt token, 8 ms + 0.1 ms per sequence per decode step,
    /// 1 µs per transferred KV token).
    pub model: ModelConfig,
    /// Engines (regular mode). Default 8.
    pub workers: usize,
    /// `Some` runs prefill/decode disaggregation instead of regular
    /// engines. Default `None`.
    pub pd: Option<PdSplit>,
    /// The policy placing decode legs in P/D mode. Default `least_loaded`.
    pub decode_policy: String,
    /// P/D: choose the decode worker when the prefill completes — what the
    /// router does for NIXL and sequential Mooncake
    /// (`PdFlow::run_late_decode`). Default `true`. `false` chooses the pair
    /// at arrival, as the router does for MoRI-IO READ and the concurrent
    /// connectors, while the decode guard is reserved only when the decode
    /// leg is sent, so requests waiting for their prefill are not yet
    /// decode load.
    pub late_decode_choice: bool,
    /// Seed of the random policies (`random`, `power_of_two`). Default 1.
    pub seed: u64,
    /// Load-timeline samples over the run. Default 200.
    pub load_samples: usize,
    /// Workers of the policy's pool (the last ones) drained before the
    /// run: still members the policies see, with their load of 0, but not
    /// available, as a worker being drained or failing its health checks
    /// is. They take no request and are left out of `imbalance`. Default 0.
    pub drained: usize,
    /// Engines of the policy's pool (the first ones) that run slower: a
    /// heterogeneous fleet. Default 0.
    pub slow_engines: usize,
    /// How much slower the [`slow_engines`](Self::slow_engines) are: every
    /// cost of their latency model (prefill, decode, KV transfer) times
    /// this. At least 1. Default 2 (half speed).
    pub slow_factor: f64,
    /// Knobs of `cache_aware` and `cache_aware_fleet_gate` (the latter
    /// forces the fleet-wide gate), and of `kv_aware` (threshold, load
    /// margins, fallback tree). Default: lb-policies' defaults, as the
    /// router uses them (threshold 0.3, load margins 64 and 1.5×).
    pub cache_aware: CacheAwareConfig,
    /// Router replicas (regular mode only). Default 1. Requests are dealt
    /// to them round robin, as a plain load balancer in front of the
    /// routers would (consecutive turns of a session land on different
    /// replicas). Each replica has its own policy state (its own
    /// [`PolicyRegistry`](lb_policies::PolicyRegistry), radix tree and, for `kv_aware`, its own block
    /// index fed by the same engine events) and its own
    /// [`Worker`](worker_lifecycle::Worker) objects for the same engines,
    /// so it knows only its own in-flight count per engine, as a real
    /// replica does. What they share is [`replica_sync`](Self::replica_sync).
    pub replicas: usize,
    /// Whether the replicas share their routing choices, as router
    /// replicas started with `--router-peers` do: `Some(delay)`, each
    /// choice reaches every other replica's policy
    /// ([`PolicyRegistry::learn_choice`](lb_policies::PolicyRegistry::learn_choice))
    /// `delay` after it was made; `None`, they share nothing. Default
    /// [`DEFAULT_REPLICA_SYNC`].
    pub replica_sync: Option<Duration>,
    /// `kv_aware`: how long after the end of the scheduler step that
    /// changed an engine's cache the routers see the change. Default 5 ms
    /// (see the [module docs](super#engine-kv-events-and-router-replicas)).
    pub kv_event_delay: Duration,
    /// How each router replica learns the engines' own load (regular mode):
    /// see [`LoadPolling`]. Default [`DEFAULT_LOAD_POLLING`], the router's
    /// default poll interval.
    pub load_polling: LoadPolling,
}

/// The default [`SimConfig::replica_sync`]: 10 ms, the router's peer
/// batch interval (5 ms) plus a hop on one network and the peer's
/// handling, rounded up.
pub const DEFAULT_REPLICA_SYNC: Option<Duration> = Some(Duration::from_millis(10));

/// The default [`SimConfig::load_polling`]: every 50 ms, as the router
/// polls by default, with answers applied 1 ms after the poll (a scrape
/// on one network).
pub const DEFAULT_LOAD_POLLING: LoadPolling = LoadPolling::Every {
    interval: Duration::from_millis(50),
    delay: Duration::from_millis(1),
};

/// How the router replicas of a simulation learn each engine's whole
/// in-flight load (running plus waiting, vLLM's gauges), which they join
/// with their own counts into
/// [`Worker::estimated_load`](worker_lifecycle::Worker::estimated_load), the load every
/// policy compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LoadPolling {
    /// No engine reports: each replica sees only its own in-flight
    /// requests, about 1/R of each engine's load behind R replicas.
    Off,
    /// Every decision sees every engine's load as it is at that instant:
    /// the bound no polling reaches.
    Oracle,
    /// Each replica polls every engine once per `interval` (the replicas'
    /// polls spread evenly over the interval, as independent processes'
    /// would be), and applies the answers `delay` after sending the poll.
    Every {
        /// Time between two polls of one replica.
        interval: Duration,
        /// From sending a poll to applying its answers: the engine's
        /// scrape handler and the network.
        delay: Duration,
    },
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            model: ModelConfig::default(),
            workers: 8,
            pd: None,
            decode_policy: "least_loaded".to_owned(),
            late_decode_choice: true,
            seed: 1,
            load_samples: 200,
            drained: 0,
            slow_engines: 0,
            slow_factor: 2.0,
            cache_aware: CacheAwareConfig::default(),
            replicas: 1,
            kv_event_delay: DEFAULT_KV_EVENT_DELAY,
            load_polling: DEFAULT_LOAD_POLLING,
            replica_sync: DEFAULT_REPLICA_SYNC,
        }
    }
}

/// The default [`SimConfig::kv_event_delay`]: a few milliseconds, what
/// an engine's ZMQ publisher, the network and a router's subscriber add
/// after vLLM publishes a step's events in a deployment on one network.
pub const DEFAULT_KV_EVENT_DELAY: Duration = Duration::from_millis(5);

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// The policy name or its knobs were refused by lb-policies.
    #[error("policy: {0}")]
    Policy(#[from] PolicyError),
    /// [`SimConfig::slow_factor`] is below 1 or not finite.
    #[error("slow_factor must be a finite number >= 1")]
    SlowFactor,
    /// A pool would have no available engine.
    #[error(
        "every pool needs at least one available engine (workers, prefill and decode counts, minus drained)"
    )]
    NoWorkers,
    /// The trace holds no request.
    #[error("the trace holds no request")]
    EmptyTrace,
    /// Building a worker failed (a bug in the simulator's worker names).
    #[error("building a worker failed: {0}")]
    Worker(String),
    /// A policy label's routing-input suffix is neither `:text` nor
    /// `:tokens`.
    #[error("policy {0:?}: the routing input after `:` must be `text` or `tokens`")]
    RoutingInput(String),
    /// [`SimConfig::replicas`] is 0, or above 1 in prefill/decode mode
    /// (several replicas are simulated for regular engines only).
    #[error("replicas must be at least 1, and 1 under prefill/decode disaggregation")]
    Replicas,
}

/// What the cache-aware policies match a request by, chosen per run by a
/// suffix of the policy label: `cache_aware` or `cache_aware:text` route
/// on the routing text ([`TraceRequest::prompt`](crate::TraceRequest::prompt),
/// what router-http extracts from the body), `cache_aware:tokens` on the
/// engines' prompt token ids, as a router that tokenizes with the engines'
/// tokenizer does. Policies that ignore the prefix accept either.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RoutingSource {
    /// The routing text (the default).
    #[default]
    Text,
    /// The engines' prompt token ids; the cache-aware policy's
    /// `block_size` is the engines' block size, so only whole blocks count.
    Tokens,
}

/// Splits a policy label into the lb-policies name and the routing
/// input: `"cache_aware:tokens"` is `("cache_aware", Tokens)`, a label
/// without a suffix routes on text, except `kv_aware`, which routes on the
/// engines' tokens (its block index is keyed by token blocks; on text it
/// is cache-aware, so `kv_aware:text` is only that fallback).
pub fn split_policy(label: &str) -> Result<(&str, RoutingSource), SimError> {
    match label.split_once(':') {
        None if INDEX_POLICIES.contains(&label) => Ok((label, RoutingSource::Tokens)),
        None => Ok((label, RoutingSource::Text)),
        Some((name, "text")) => Ok((name, RoutingSource::Text)),
        Some((name, "tokens")) => Ok((name, RoutingSource::Tokens)),
        Some(_) => Err(SimError::RoutingInput(label.to_owned())),
    }
}

/// Everything one policy run produced.
#[derive(Clone, Debug, PartialEq)]
pub struct RunReport {
    /// The trace's name.
    pub workload: String,
    /// The policy label, as named on the command line (with its
    /// `:tokens` suffix, if any; see [`split_policy`]).
    pub policy: String,
    /// The figures.
    pub metrics: PolicyMetrics,
    /// In-flight load of the policy's pool over time.
    pub load_timeline: LoadTimeline,
    /// Every worker's load after the run (all pools): zero when every
    /// guard was released.
    pub final_loads: Vec<usize>,
    /// Decisions of the policy under test by reason, sorted by reason.
    pub decisions: Vec<(String, u64)>,
    /// P/D only: KV transfers the decode engines accepted (checked against
    /// the producing prefill engine through the shared registry) and
    /// refused. Both 0 in regular mode.
    pub kv_transfers: (u64, u64),
    /// Router replicas the requests were dealt to
    /// ([`SimConfig::replicas`]).
    pub replicas: usize,
    /// Requests placed on each engine of the policy's pool (the prefill
    /// pool under P/D), in engine order.
    pub placed: Vec<usize>,
}
