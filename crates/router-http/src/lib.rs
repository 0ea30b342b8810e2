//! hyper 1.x glue for an OpenAI-compatible LLM router.
//!
//! The server and pooled upstream client, the OpenAI routes proxied with
//! streaming bodies that own their load guards, retries, circuit-breaker
//! outcomes, admin and status routes, Prometheus metrics, limits and clear
//! JSON errors. This crate owns no routing algorithm: it maps HTTP onto the
//! crates below. The implementation lands with its own issue; this page says
//! what it will hold.
#![warn(missing_docs)]

pub mod admin;
pub mod body;
pub mod client;
pub mod config;
pub mod error;
pub mod extract;
#[doc(hidden)]
pub mod fuzzing;
pub mod headers;
pub mod limits;
pub mod metrics;
pub mod pd;
pub mod router;
pub mod routes;
pub mod server;

pub use admin::HttpProbe;
pub use body::{BodyEnd, BoxBody, BoxError, Finish, GuardedBody, IdleTimeout, IdleTimeoutError};
pub use client::{ClientConfig, UpstreamClient, UpstreamError};
pub use config::{ConfigError, RouterConfig};
pub use error::ApiError;
pub use extract::{RequestInfo, RouteKind, RoutingInput, extract};
pub use headers::{RequestId, RequestIds};
pub use limits::{AdmissionPermit, ConcurrencyConfig, ConcurrencyLimiter, RateLimiter};
pub use pd::{PdConfig, PdConnector, PdPools, PdWorkerConfig};
pub use router::{BackgroundTasks, Router};
pub use routes::Route;
pub use server::{ShutdownOutcome, serve};
