//! hyper 1.x glue for an OpenAI-compatible LLM router.
//!
//! A host builds a [`Router`] from a [`RouterConfig`], adds workers, and
//! serves it; or calls [`Router::handle`] from its own hyper service, next to
//! routes of its own. The crate owns no routing algorithm: it maps HTTP onto
//! `lb-policies` (which worker), `worker-lifecycle` (workers, load guards,
//! breakers, health, retries) and `pd-orchestrator` (prefill/decode).
//!
//! ```no_run
//! use router_http::{Router, RouterConfig};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let router = Router::new(RouterConfig::default())?; // cache_aware by default
//! router.add_worker("http://127.0.0.1:8001", None, None)?;
//! router.add_worker("http://127.0.0.1:8002", None, None)?;
//! let _background = router.spawn_background(); // health checks, tree eviction
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:30000").await?;
//! router.serve(listener, async { let _ = tokio::signal::ctrl_c().await; }).await;
//! # Ok(())
//! # }
//! ```
//!
//! # The request path
//!
//! [`router`] reads top-down: route and authenticate, admit (rate limit,
//! concurrency permit or bounded queue), read the body once and extract the
//! routing text ([`extract()`]), select and reserve a worker, forward the
//! original bytes, retry before the first byte on connect errors and
//! retryable statuses, and hand the worker's response back with its body
//! wrapped in a [`GuardedBody`].
//!
//! # Load is counted until the last byte
//!
//! The worker's load guard and the admission permit move into the response
//! body. They are released when the body ends, when it fails (upstream reset,
//! idle timeout, whole-request deadline), or when hyper drops it because the
//! client went away — also while the upstream is stalled and sends nothing:
//! hyper's server connection notices the closed socket on its read side and
//! drops the response it was writing. There is no forwarding task that could
//! outlive the client. A retried attempt keeps its own guard until its
//! response is dropped, so busy workers are never under-counted.
//!
//! # Errors
//!
//! Everything the router answers itself is an [`ApiError`], mapped once to a
//! status and an OpenAI-shaped JSON body. A worker's own responses, 4xx
//! included, reach the client unchanged; 4xx never count against a worker.
//!
//! # Cancel safety
//!
//! Dropping the future of [`Router::handle`] at any point (the client left
//! before headers) drops whatever it holds: the queue place, the permit, the
//! attempt's guard and its upstream request.
#![warn(missing_docs)]

pub mod admin;
pub mod allow;
mod bearer;
pub mod body;
pub mod client;
pub mod config;
pub mod error;
pub mod extract;
#[doc(hidden)]
pub mod fuzzing;
pub mod headers;
/// The KV event bridge (crate `kv-event-bridge`), under the name this
/// crate has always given it.
#[cfg(feature = "kv-events")]
pub use kv_event_bridge as kv_events;
mod kv_wiring;
pub mod limits;
pub mod load_poll;
pub mod metrics;
#[cfg(feature = "otel")]
pub mod otel;
mod payload;
pub mod pd;
pub mod peers;
mod probe;
pub mod register;
pub mod router;
pub mod routes;
pub mod server;
mod service;
pub mod startup;
#[cfg(feature = "tokens")]
pub mod tokens;

pub use allow::{CidrBlock, CidrError};
pub use body::{BodyEnd, BoxBody, BoxError, Finish, GuardedBody, IdleTimeout, IdleTimeoutError};
pub use client::{ClientConfig, UpstreamBody, UpstreamClient, UpstreamError};
pub use config::{ConfigError, RouterConfig};
pub use error::ApiError;
pub use extract::{
    ApiKind, Extracted, MAX_MODEL_BYTES, ParsedBody, RequestInfo, RoutingInputBuf, SegmentCacheUse,
    extract, extract_deferred, extract_parsed,
};
pub use headers::{RequestId, RequestIds};
pub use limits::{AdmissionPermit, ConcurrencyConfig, ConcurrencyLimiter, RateLimiter};
pub use load_poll::{LoadPollConfig, LoadPolls};
pub use pd::{PdConfig, PdConnector, PdPools, PdWorkerConfig};
pub use peers::{PeerConfig, PeerSync};
pub use probe::HttpProbe;
pub use register::{RegisterFuture, RegisterHook};
pub use router::{BackgroundTasks, Router};
pub use routes::Route;
pub use server::{ServerConfig, ServerStats, ShutdownOutcome, serve, serve_with};
pub use startup::StartupGate;
