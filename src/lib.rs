//! affinity-router: cache-aware, load-exact routing for LLM inference fleets.
//!
//! This facade re-exports the workspace crates under one name. Each of them is
//! also published on its own, for hosts that need only one piece:
//!
//! | module | crate | what it holds |
//! |---|---|---|
//! | [`radix`] | `radix-affinity` | concurrent multi-tenant radix tree (prefix → owners) |
//! | [`policies`] | `lb-policies` | load-balancing policies over any backend type |
//! | [`workers`] | `worker-lifecycle` | workers, load guards, breakers, health, discovery |
//! | [`pd`] | `pd-orchestrator` | prefill/decode pairing and KV connectors |
//! | [`http`] | `router-http` | the hyper 1.x proxy path, admin and metrics |
//! | [`tokens`] | `prompt-tokens` | a request's prompt token ids: chat templates, tokenizers |
//! | [`sim`] | `engine-sim` | a simulated vLLM-style engine, and [`sim::for_deployment`] (the engines' settings for a router's connector) |
//! | [`simulator`] | `fleet-sim` | the routing-quality simulator: engine models on a virtual clock, routed by the production policy, worker and P/D code |
//! | [`blocks`] | `kv-block-index` | the block index built from engines' KV-cache events |
//! | [`prom`] | `prom-text` | the one writer of the Prometheus text format |
//! | `discovery` | `worker-discovery` | vLLM registration discovery (feature `discovery`) |
//! | `kv_events` | `kv-events` | vLLM's KV-cache event stream over ZMQ (feature `kv-events`) |
//! | `kv_bridge` | `kv-event-bridge` | following the engines' KV event streams into the block index (feature `kv-events`) |
//!
//! One module lives here, on top of all of them: `cli`, the reference
//! router's command line (vllm-router's flags), startup, discovery and
//! shutdown — `cargo run --release --example router` (feature `cli`). The
//! simulator's command line is `cargo run --release --example simulate`.
//!
//! # Features
//!
//! - `cli` (default): the `cli` module and what only it needs (clap, toml,
//!   tracing-subscriber, the ZMQ stack through `discovery`). A host that
//!   depends on this crate for its re-exports turns it off with
//!   `default-features = false`.
//! - `discovery` (on with `cli`): re-exports `worker-discovery` as
//!   `affinity_router::discovery`.
//! - `kv-events` (on with `cli`): re-exports `kv-events` as
//!   `affinity_router::kv_events` and `kv-event-bridge` as
//!   `affinity_router::kv_bridge`, and turns on router-http's KV event
//!   subscriptions and engine-sim's publisher.
//! - `kubernetes` (on with `cli`): `discovery` with its Kubernetes pod
//!   discovery (`affinity_router::discovery::kubernetes`, kube-rs; needs
//!   Rust 1.88), behind the router's `--service-discovery`.
//! - `otel` (on with `cli`): router-http's OpenTelemetry traces
//!   (`affinity_router::http::otel`), behind the router's `--enable-trace`.
#![warn(missing_docs)]

#[cfg(feature = "cli")]
pub mod cli;
pub mod sim;

#[cfg(feature = "kv-events")]
pub use kv_event_bridge as kv_bridge;
#[cfg(feature = "kv-events")]
pub use kv_events;
#[cfg(feature = "discovery")]
pub use worker_discovery as discovery;

pub use fleet_sim as simulator;
pub use kv_block_index as blocks;
pub use lb_policies as policies;
pub use pd_orchestrator as pd;
pub use prom_text as prom;
pub use prompt_tokens as tokens;
pub use radix_affinity as radix;
pub use router_http as http;
pub use worker_lifecycle as workers;
