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
//! The reference router is `cargo run --release --example router`.
#![warn(missing_docs)]

pub mod cli;

pub use engine_sim as sim;
pub mod simulator;
pub use lb_policies as policies;
pub use pd_orchestrator as pd;
pub use radix_affinity as radix;
pub use router_http as http;
pub use worker_lifecycle as workers;
