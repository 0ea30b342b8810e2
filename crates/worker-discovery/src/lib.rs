//! vLLM registration discovery: engines announce themselves, and land in
//! `worker-lifecycle`'s per-role [`ServiceRegistry`]s. With the feature
//! `kubernetes`, Kubernetes pods do too.
//!
//! vLLM engines running a P2P KV connector register with the router over
//! ZMQ: each connects a DEALER socket to the router's ROUTER socket and
//! sends, every few seconds, one MessagePack map:
//!
//! ```text
//! {"type": "P" | "D", "http_address": "host:port", "zmq_address": "host:port",
//!  "transfer_mode"?: "READ" | "WRITE"}
//! ```
//!
//! MoRI-IO engines send their own form, accepted too:
//!
//! ```text
//! {"type": "register" | "HELLO", "role": "P" | "D",
//!  "request_address": "http://host:port/v1/completions",
//!  "handshake_port": u16, "notify_port": u16, "dp_size": u32, "tp_size": u32,
//!  "transfer_mode": "READ" | "WRITE"}
//! ```
//!
//! Engines that cannot speak ZMQ send the same map as JSON over HTTP; this
//! crate has no HTTP server, only the handler a host calls with the body
//! ([`Registrar::register_json`]), whatever serves the route.
//!
//! # What a registration does
//!
//! Each message registers the engine in the registry of its role, or —
//! when the same engine sent the same thing within the TTL — refreshes it
//! and keeps its generation. An engine silent for the TTL expires; its next
//! message starts a new generation, which a `DiscoveryPool` turns into a
//! fresh worker with fresh load and breaker. A different `zmq_address` or
//! `transfer_mode` at the same address is a restart and starts a new
//! generation too. What the engine announced is kept as registration labels
//! under the names of [`worker_lifecycle::labels`], which prefill/decode
//! pools read.
//!
//! Malformed messages are counted ([`Registries::malformed_messages`]) and
//! logged at `warn`, never fatal: one bad sender cannot stop discovery.
//!
//! # Address checks, off the receive loop
//!
//! A host can refuse engines outside its networks with an [`AddressCheck`]
//! (typically resolving the host name). It runs under a timeout, in a
//! bounded set of tasks beside the receive loop, one at a time per engine,
//! so one slow lookup never delays another engine's registration; see
//! [`zmq`] for the reasoning.
//!
//! # What a peer can make it allocate
//!
//! The ROUTER port is reachable before any check. Its socket is libzmq's,
//! with `ZMQ_MAXMSGSIZE` at [`DiscoveryConfig::max_message_size`] (64 KiB
//! by default): a frame that declares more is refused before it is
//! buffered. The receive loop is supervised and restarted if it ever ends
//! ([`ZmqDiscovery::receive_restarts`]).
//!
//! # Example
//!
//! ```
//! use std::time::{Duration, Instant};
//! use worker_discovery::ZmqDiscovery;
//! use worker_lifecycle::{DiscoveryPool, RoleKind, WorkerOptions};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // Engines connect a DEALER socket to this address.
//! let discovery = ZmqDiscovery::bind("127.0.0.1:0", Duration::from_secs(5))
//!     .await
//!     .unwrap();
//! assert!(discovery.local_addr().port() > 0);
//!
//! // An engine that cannot speak ZMQ registers with the same map as JSON.
//! let registered = discovery
//!     .registrar()
//!     .register_json(br#"{"type": "D", "http_address": "127.0.0.1:8200"}"#)
//!     .await
//!     .unwrap();
//! assert_eq!(registered.to_json()["role"], "decode");
//!
//! // A pool reconciles the registry into persistent workers.
//! let pool = DiscoveryPool::new(RoleKind::Decode, WorkerOptions::default()).unwrap();
//! let decode = &discovery.registries().decode;
//! let urls = pool
//!     .with_reconciled(decode, Instant::now(), |view| {
//!         view.workers().iter().map(|w| w.url().to_owned()).collect::<Vec<_>>()
//!     })
//!     .unwrap();
//! assert_eq!(urls, ["http://127.0.0.1:8200"]);
//!
//! // Bad input is refused with a reason and changes nothing.
//! let refused = discovery.registrar().register_json(br#"{"type": "X"}"#).await;
//! assert!(refused.unwrap_err().to_string().starts_with("invalid registration"));
//! assert_eq!(discovery.malformed_messages(), 1);
//! # }
//! ```
//!
//! # Feature flags
//!
//! - `kubernetes` (off by default): [`kubernetes`], pods matching a label
//!   selector become workers in the same kind of per-role registries,
//!   through kube-rs's watcher. It pulls the Kubernetes client (kube,
//!   k8s-openapi, rustls); ZMQ-only hosts leave it off.
//!
//! # Concurrency and cancel safety
//!
//! The listener's state belongs to its own task; the registries are
//! worker-lifecycle's, safe to read from any thread while discovery writes.
//! Dropping a [`ZmqDiscovery`] stops the listener and the checks it runs.
//! Dropping the future of [`Registrar::register_json`] before it finishes
//! leaves the registries untouched: the registration is applied in one
//! synchronous step after the check.
//!
//! # Stability
//!
//! Pre-1.0: the API may change between minor versions. The wire forms follow
//! vLLM's and are kept as long as vLLM sends them.
//!
//! [`ServiceRegistry`]: worker_lifecycle::ServiceRegistry
#![warn(missing_docs)]

#[cfg(feature = "kubernetes")]
pub mod kubernetes;
pub mod message;
pub mod registrar;
pub mod registries;
pub mod zmq;

/// The type of the KV event endpoints a registration announces
/// ([`EngineRegistration::kv_events_endpoint`]).
pub use kv_events::ZmqEndpoint;
pub use message::{
    EngineRegistration, HostPort, MAX_ADDRESS_LEN, MAX_PARALLEL_SIZE, MessageError, MoriIoPorts,
    RegisteredRole, decode_json_registration, decode_registration, payload_of,
};
pub use registrar::{
    AddressCheck, AddressRefused, CheckFuture, DEFAULT_CHECK_TIMEOUT, RegisterError, Registered,
    Registrar,
};
pub use registries::Registries;
pub use zmq::{
    DEFAULT_MAX_MESSAGE_SIZE, DEFAULT_TTL, DiscoveryConfig, DiscoveryCounters, DiscoveryError,
    ZmqDiscovery,
};

/// The README's example runs as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
