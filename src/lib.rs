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
//! | [`sim`] | `engine-sim` | a simulated vLLM-style engine |
//!
//! Two modules live here, on top of all of them:
//!
//! - [`cli`]: the reference router's command line (vllm-router's flags),
//!   startup, discovery and shutdown — `cargo run --release --example router`;
//! - [`simulator`]: the routing-quality simulator, which drives engine-sim
//!   engine models on a virtual clock through the production policy and
//!   worker code — `cargo run --release --example simulate`.
#![warn(missing_docs)]

pub mod cli;
pub mod simulator;

pub use engine_sim as sim;
pub use lb_policies as policies;
pub use pd_orchestrator as pd;
pub use radix_affinity as radix;
pub use router_http as http;
pub use worker_lifecycle as workers;
