//! engine-sim, the simulated vLLM-style engine, plus the one mapping from
//! the router's connector configuration to the engines' settings.
//!
//! Everything of the `engine-sim` crate is re-exported here as it is, with
//! [`for_deployment`] from the simulator crate (`fleet-sim`), the one crate
//! that knows both the engines and the router's P/D crate. The reference
//! router's simulated engines (`cli`) and the facade's tests that start
//! engines for a P/D router use it.

pub use engine_sim::*;
pub use fleet_sim::for_deployment;
