//! Load-balancing policies over any backend type.
//!
//! Random, round robin, power of two choices, least loaded, consistent hash,
//! rendezvous hash and cache-aware (prefix affinity with a per-request load
//! gate and fair ties), working on any backend that exposes a stable key, its
//! in-flight load, its processed-request count and its availability. The crate
//! pulls in neither hyper nor tokio. The implementation lands with its own
//! issue; this page says what it will hold.
#![warn(missing_docs)]
