//! The router: one request, top-down.
//!
//! [`Router::handle`] is the whole request path, in order:
//!
//! 1. route the method and path ([`Route::of`]); check the API keys;
//! 2. answer the router's own routes (health, status, admin, metrics);
//! 3. for a proxied route: refuse when shutting down; take a rate-limit token
//!    and an admission permit (or wait in the bounded queue); from here the
//!    whole-request deadline bounds every wait (504 `request_timeout`);
//! 4. read the body once, up to the payload limit, and extract the model,
//!    the stream flag, the hash keys and the routing text
//!    ([`extract`](crate::extract())), or the engine's token ids for a
//!    model that has a tokenizer (`Tokenizers::extract_bounded`: large
//!    bodies on the bounded tokenizer pool, within the deadline, cancelled
//!    with the request);
//! 5. select a worker with the model's policy among the workers that serve
//!    the model, and reserve it: an owned [`LoadGuard`] (unless the deadline
//!    already passed in the router: then the router's 504, no worker
//!    charged);
//! 6. forward the original bytes through the pooled client;
//! 7. on a connect error or a retryable status, before any byte reached the
//!    client: record the breaker outcome, drop that attempt (its response
//!    and its guard go together), back off, and select again without the
//!    worker that failed, within the retry budget;
//! 8. otherwise hand the worker's response to the client unchanged (minus
//!    hop-by-hop headers, plus the request id), its body wrapped so that the
//!    guard and the permit live exactly as long as the body does.
//!
//! Nothing on this path holds a lock across an `.await`.
//!
//! The code is cut by concern so that each part reads on its own:
//! construction (`build`), the API keys (`auth`), steps 3 to 8 (`proxy`),
//! with steps 5 to 7 as one request's attempts (`attempt`),
//! serving and shutdown (`serve`), workers added at run time (`workers`),
//! health checks, tree upkeep and the engines' load polls (`background`). They are submodules rather
//! than siblings because they share [`Router`]'s state, which nothing else
//! in the crate may touch.
//!
//! [`Route::of`]: crate::routes::Route::of
//! [`LoadGuard`]: worker_lifecycle::LoadGuard

mod attempt;
mod auth;
mod background;
mod build;
mod proxy;
mod serve;
mod workers;

pub use background::BackgroundTasks;

use crate::client::UpstreamClient;
use crate::config::RouterConfig;
use crate::headers::RequestIds;
use crate::limits::{ConcurrencyLimiter, RateLimiter};
use crate::metrics::RouterMetrics;
use http::header::HeaderName;
use lb_policies::PolicyRegistry;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use worker_lifecycle::{RetryBudget, RolePool, Worker};

/// A request's server span, when it is traced: handed to the proxy path
/// as an argument (not in the request's extensions, whose map a traced
/// request would otherwise allocate). Nothing without the `otel` feature.
#[cfg(feature = "otel")]
pub(crate) type RequestTrace = Option<crate::otel::Traced>;
/// A request's server span, when it is traced: nothing without the `otel`
/// feature.
#[cfg(not(feature = "otel"))]
pub(crate) type RequestTrace = NoTrace;

/// What [`RequestTrace`] is without the `otel` feature: nothing.
#[cfg(not(feature = "otel"))]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct NoTrace;

/// The header carrying a worker's data-parallel rank to the engine.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// An OpenAI-compatible router over a set of workers. Cheap to clone: every
/// clone shares the same state.
#[derive(Clone)]
pub struct Router {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("workers", &self.shared.pool.workers().len())
            .field("accepting", &self.is_accepting())
            .finish_non_exhaustive()
    }
}

struct Shared {
    config: RouterConfig,
    client: UpstreamClient,
    /// The regular workers and their policies.
    pool: RolePool,
    limiter: ConcurrencyLimiter,
    rate: Option<RateLimiter>,
    ids: RequestIds,
    session_header: HeaderName,
    dp_rank_header: HeaderName,
    retry_budget: RetryBudget,
    jitter_seed: AtomicU64,
    metrics: RouterMetrics,
    accepting: AtomicBool,
    /// Holds `/health` and `/readiness` until the startup workers joined.
    startup: crate::startup::StartupGate,
    /// Prefill/decode pools and flow, in P/D mode.
    pd: Option<crate::pd::PdState>,
    /// KV event subscriptions, when a pool's policy is `kv_aware`.
    kv: Option<crate::kv_wiring::KvHub>,
    /// The engines' load polls, unless polling is off.
    load_poll: Option<Arc<crate::load_poll::LoadPolls>>,
    /// Choice sharing with the peer replicas, when configured.
    peers: Option<Arc<crate::peers::PeerSync>>,
}

impl Router {
    /// The configuration the router was built with.
    pub fn config(&self) -> &RouterConfig {
        &self.shared.config
    }

    /// The prefill/decode pools, in P/D mode.
    pub fn pd(&self) -> Option<&Arc<crate::pd::PdPools>> {
        self.shared.pd.as_ref().map(crate::pd::PdState::pools)
    }

    /// Every regular worker, as a snapshot.
    pub fn workers(&self) -> Arc<[Arc<Worker>]> {
        self.shared.pool.workers()
    }

    /// The regular workers' pool: their set, their policies and the
    /// forwarding between them.
    pub fn pool(&self) -> &RolePool {
        &self.shared.pool
    }

    /// The regular workers' policies, one per model.
    pub fn policies(&self) -> &PolicyRegistry<Arc<Worker>> {
        self.shared.pool.policies()
    }

    /// The KV event subscriptions and block index, when a pool's policy is
    /// `kv_aware`.
    #[cfg(feature = "kv-events")]
    pub fn kv_events(&self) -> Option<&Arc<crate::kv_events::KvEvents>> {
        self.shared.kv.as_ref()
    }

    /// The engines' load polls (what each engine reported, and the
    /// errors), unless polling is off ([`RouterConfig::load_poll`]).
    pub fn load_polls(&self) -> Option<&Arc<crate::load_poll::LoadPolls>> {
        self.shared.load_poll.as_ref()
    }

    /// Choice sharing with the other router replicas, when configured
    /// ([`RouterConfig::peers`]).
    pub fn peers(&self) -> Option<&Arc<crate::peers::PeerSync>> {
        self.shared.peers.as_ref()
    }

    /// The router's own counters.
    pub fn metrics(&self) -> &RouterMetrics {
        &self.shared.metrics
    }

    /// The pooled client the router forwards (and probes) through.
    pub fn client(&self) -> &UpstreamClient {
        &self.shared.client
    }

    /// Writes the P/D series of `/metrics` (nothing outside P/D mode).
    pub(crate) fn render_pd(&self, exposition: &mut prom_text::Exposition<'_>) {
        if let Some(pd) = &self.shared.pd {
            pd.render(exposition);
        }
    }
}
