//! The routing-quality simulator: what each policy does to TTFT, throughput
//! and prefix-cache hits, before any GPU is spent.
//!
//! A deterministic discrete-event simulation drives N [`engine_sim::Engine`]
//! models on one virtual clock with a request [`Trace`], and routes every
//! request through the same code the router runs:
//!
//! - in regular mode the workers are [`worker_lifecycle::Worker`]s of a
//!   [`worker_lifecycle::RolePool`], the router's own pool type: a static
//!   set whose membership events reach an [`lb_policies::PolicyRegistry`]
//!   built by policy name (`round_robin`, `cache_aware`,
//!   `cache_aware_fleet_gate`, ...); each request is placed by the pool's
//!   `eligible` / `require_available` / `choose` with the request's routing
//!   text and session key, reserved through the worker's breaker, and the
//!   [`LoadGuard`](worker_lifecycle::LoadGuard) lives until the simulated
//!   request finishes, so the load every policy reads is the real
//!   in-flight count;
//! - in prefill/decode mode the pairs come from pd-orchestrator's
//!   [`PdPools`](pd_orchestrator::pools::PdPools), the router's pair
//!   selection: the prefill worker is chosen at arrival by the policy under
//!   test and the decode worker by the decode policy when the prefill
//!   completes (`PdBackend::select_decode`), as the router does for NIXL
//!   and sequential Mooncake (or both at arrival with `select_pair`, as for
//!   MoRI-IO READ, with [`SimConfig::late_decode_choice`] off); each phase
//!   is reserved as a `PdLease` when its leg is sent, the prefill's from
//!   dispatch to prefill completion (queued and running requests count),
//!   and the decode leg receives the prefill engine's
//!   `kv_transfer_params`, validated against a shared
//!   [`TransferRegistry`](engine_sim::TransferRegistry) and charged the
//!   engine model's KV-transfer cost.
//!
//! The simulator reads no wall clock and no unseeded random source: for
//! `round_robin`, `random`, `least_loaded`, `power_of_two`,
//! `consistent_hash` and `kv_aware` the same trace and [`SimConfig`] give
//! the same [`RunReport`], bit for bit. The cache-aware policies are not yet
//! bit-exact: their radix trees stamp last use with radix-affinity's
//! default coarse clock (about 1 ms of wall time), which decides which of
//! several owners of a shared prefix a lookup returns, and lb-policies has
//! no knob for the logical clock. Their figures vary slightly between runs
//! (hit rate by about 0.1 point, median TTFT by a few percent, more for the
//! fleet-wide gate near saturation).
//!
//! # Engine KV events and router replicas
//!
//! `kv_aware` (lb-policies' policy of that name, routing on the engines'
//! token ids) scores workers on the blocks the engines really hold. The
//! simulator turns on every main-pool engine's KV-event recording
//! ([`engine_sim::Engine::set_kv_events`]), converts the vLLM wire events of
//! each step's [`KvBatch`](engine_sim::KvBatch) to `kv_block_index::KvEvent`s
//! with the router's own converter (`kv_block_index::wire::to_index_event`;
//! engine-sim's chain hashes as the engine's opaque hashes) and applies
//! them, in virtual-time order, to a `kv_block_index::KvIndex` the policy
//! reads. Every
//! stream is live from the start (the engines publish from t = 0).
//!
//! **When events become visible**: at the end of the scheduler step that
//! produced them plus [`SimConfig::kv_event_delay`] (default
//! [`DEFAULT_KV_EVENT_DELAY`], 5 ms). vLLM allocates and evicts blocks when
//! it schedules a step but publishes the step's events after the step's
//! forward pass; the ZMQ hop and the router's subscriber add a few
//! milliseconds on one network. A routing decision at time `t` sees every
//! batch visible at or before `t`, and none after. Until then the policy
//! does not know the new blocks (nor that evicted ones are gone).
//!
//! **Replicas** ([`SimConfig::replicas`], regular mode only): R routers
//! behind a plain load balancer that deals requests to them round robin,
//! so consecutive turns of a session land on different replicas. Each
//! replica is a [`RolePool`](worker_lifecycle::RolePool) with its own
//! [`PolicyRegistry`](lb_policies::PolicyRegistry) (its own radix tree)
//! and its own [`Worker`](worker_lifecycle::Worker) objects for the same
//! engines: a replica's load counters count only the requests it sent, as
//! a real replica knows only its own in-flight requests (the load
//! timeline and `final_loads` report the engines' true load, the sum). For
//! `kv_aware` each replica has its own block index, fed the same events
//! at the same times, as independent subscribers would be. Besides the
//! engines the replicas share only their routing choices
//! ([`SimConfig::replica_sync`], default [`DEFAULT_REPLICA_SYNC`]: each
//! choice reaches the other replicas' trees 10 ms later, as router
//! replicas started with `--router-peers` tell each other); `None`
//! shares nothing.
//!
//! **Engine-reported load** ([`SimConfig::load_polling`], default
//! [`DEFAULT_LOAD_POLLING`]: every 50 ms, as the router polls): each
//! replica polls every engine's running plus waiting count, its polls
//! spread over the interval, and applies the answers a delay later to its
//! workers ([`Worker::record_engine_load`](worker_lifecycle::Worker::record_engine_load)).
//! The load every policy then reads is the estimate of the engine's whole
//! load: the replica's own in-flight requests now plus the others' as of
//! the last answer. The same answer carries the engine's cache usage and,
//! apart, its waiting count
//! ([`Worker::record_engine_waiting`](worker_lifecycle::Worker::record_engine_waiting),
//! a policy's `Backend::waiting`). [`LoadPolling::Off`] leaves each replica with its own
//! counts, about 1/R of each engine's load (cache-aware's absolute margin of
//! 64 then fires R times later), and [`LoadPolling::Oracle`] shows every
//! decision the engines' loads as they are.
//!
//! # Workloads
//!
//! - [`workload::multi_turn`]: chat sessions sharing a handful of long
//!   system prompts; each turn extends its session's history with the
//!   previous answer and a new user message; Poisson arrivals.
//! - [`workload::radix`]: the requests of the radix-affinity benchmark
//!   workload (`radix_affinity::workload`, set W) as independent requests
//!   with Poisson arrivals.
//! - [`workload::templated`]: chat sessions whose prompts the engines
//!   render through a chat template (prompt-tokens' Llama 3, with tools in
//!   the system header and a date that changes during the run) and
//!   tokenize with a trained BPE tokenizer; [`PreparedTrace::with_tokenizer`]
//!   computes the engines' ids.
//! - [`trace::parse_jsonl`] / [`trace::load_jsonl`]: a user's own traffic.
//!
//! # Routing on text or on tokens
//!
//! A policy label may end in `:tokens` (see [`split_policy`]; `kv_aware`
//! routes on tokens without the suffix):
//! `cache_aware:tokens` matches the engines' prompt token ids, as a router
//! that tokenizes with the engines' tokenizer does, with
//! `CacheAwareConfig::block_size` set to the engines' block size; plain
//! `cache_aware` matches the request's routing text
//! ([`TraceRequest::prompt`]), as router-http extracts it.
//!
//! # Example
//!
//! ```
//! use fleet_sim::{simulate, workload, PreparedTrace, SimConfig};
//!
//! let trace = workload::multi_turn(&workload::MultiTurnConfig {
//!     requests: 120,
//!     ..workload::MultiTurnConfig::default()
//! });
//! let config = SimConfig { workers: 4, ..SimConfig::default() };
//! let prepared = PreparedTrace::new(&trace, &config.model);
//! let report = simulate(&prepared, "cache_aware", &config, &|_| {})?;
//! assert_eq!(report.metrics.completed, 120);
//! assert!(report.final_loads.iter().all(|&load| load == 0));
//! println!("hit rate {:.2}", report.metrics.hit_rate);
//! # Ok::<(), fleet_sim::SimError>(())
//! ```
//!
//! The command-line front end is `cargo run --release --example simulate`;
//! `docs/benchmarks.md` holds its tables and charts.

mod config;
mod deployment;
mod kv;
mod metrics;
mod polls;
mod pool;
pub mod report;
mod run;
pub mod trace;
pub mod workload;

pub use config::{
    DEFAULT_KV_EVENT_DELAY, DEFAULT_LOAD_POLLING, DEFAULT_REPLICA_SYNC, LoadPolling, PdSplit,
    RoutingSource, RunReport, SimConfig, SimError, split_policy,
};
pub use deployment::for_deployment;
pub use metrics::{LoadTimeline, PolicyMetrics, percentile};
pub use run::simulate;
pub use trace::{ArrivalClock, PreparedTrace, Trace, TraceError, TraceRequest};

/// The policies the simulator compares by default, named as on the
/// router's command line.
pub const DEFAULT_POLICIES: [&str; 7] = [
    "round_robin",
    "random",
    "least_loaded",
    "power_of_two",
    "consistent_hash",
    "cache_aware",
    "cache_aware_fleet_gate",
];
