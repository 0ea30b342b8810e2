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

use crate::body::{BodyEnd, BoxBody, BoxError, Finish, GuardedBody, IdleTimeout};
use crate::client::{UpstreamClient, UpstreamError};
use crate::config::{ConfigError, RouterConfig};
use crate::error::ApiError;
use crate::extract::RouteKind;
use crate::headers::{RequestId, RequestIds, strip_hop_by_hop};
use crate::limits::{AdmissionPermit, ConcurrencyLimiter, RateLimiter};
use crate::metrics::RouterMetrics;
use crate::routes::Route;
use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Response, Uri};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use lb_policies::{OwnedContext, PolicyRegistry};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tokio::time::Instant;
use worker_lifecycle::{
    Endpoint, LoadGuard, MembershipEvent, Outcome, RandomSource, RequestRetries, RetryBudget,
    RoleKind, RolePool, SplitMix64, Worker, WorkerRole, WorkerSpec, WorkerUrl,
};

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
}

impl Router {
    /// Builds a router from `config`, with no workers yet.
    ///
    /// When a pool's policy is `kv_aware` (feature `kv-events`), the router
    /// also builds the KV event subscriptions that feed it
    /// ([`Router::kv_events`]); [`Router::spawn_background`] starts them.
    pub fn new(mut config: RouterConfig) -> Result<Self, ConfigError> {
        share_tree_budget(&mut config);
        let kv = crate::kv_wiring::attach(&mut config);
        let policies = PolicyRegistry::new(config.policy.clone())?;
        Self::build(config, policies, kv)
    }

    /// Builds a router that selects with `policies` (for instance a registry
    /// with custom policy factories registered); `config.policy` is ignored,
    /// and no KV event subscriptions are made (a host that builds its own
    /// `kv_aware` policy feeds its index itself).
    pub fn with_policies(
        mut config: RouterConfig,
        policies: PolicyRegistry<Arc<Worker>>,
    ) -> Result<Self, ConfigError> {
        share_tree_budget(&mut config);
        Self::build(config, policies, None)
    }

    fn build(
        #[cfg_attr(
            not(feature = "tokens"),
            allow(unused_mut, reason = "the pool needs tokens")
        )]
        mut config: RouterConfig,
        policies: PolicyRegistry<Arc<Worker>>,
        kv: Option<crate::kv_wiring::KvHub>,
    ) -> Result<Self, ConfigError> {
        #[cfg(feature = "tokens")]
        {
            let tokenize = config.tokenize.clone();
            config
                .tokenizers
                .set_pool(&tokenize)
                .map_err(ConfigError::Tokenize)?;
        }
        let ids = RequestIds::new(&config.request_id_headers)
            .map_err(|err| ConfigError::RequestIdHeader(err.to_string()))?;
        let session_header = HeaderName::from_bytes(config.session_header.as_bytes())
            .map_err(|_| ConfigError::SessionHeader(config.session_header.clone()))?;
        if config.concurrency.max_concurrent == 0 {
            return Err(ConfigError::Concurrency);
        }
        let rate = match config.rate_limit_per_second {
            Some(rate) => {
                Some(RateLimiter::new(rate, rate.max(1.0)).ok_or(ConfigError::RateLimit(rate))?)
            }
            None => None,
        };
        let options = config.worker_options.clone();
        let pool = match &config.worker_registry {
            Some(registry) if registry.role() != RoleKind::Regular => {
                return Err(ConfigError::Worker {
                    url: String::new(),
                    reason: format!(
                        "the worker registry is for the {} role; regular workers need a regular \
                         one",
                        registry.role()
                    ),
                });
            }
            Some(registry) => RolePool::discovered(Arc::clone(registry), options, policies),
            None => RolePool::fixed(RoleKind::Regular, options, policies),
        }
        .map_err(|err| ConfigError::Worker {
            url: String::new(),
            reason: err.to_string(),
        })?;
        let retry_budget = RetryBudget::new(config.retry_budget.clone(), std::time::Instant::now());
        let client = UpstreamClient::new(config.client);
        let pd = match &config.pd {
            Some(pd) => Some(crate::pd::PdState::new(pd, &config, &client)?),
            None => None,
        };
        let shared = Shared {
            client,
            pd,
            limiter: ConcurrencyLimiter::new(config.concurrency),
            pool,
            rate,
            ids,
            session_header,
            dp_rank_header: HeaderName::from_static(DP_RANK_HEADER),
            retry_budget,
            jitter_seed: AtomicU64::new(SplitMix64::from_entropy().next_u64()),
            metrics: RouterMetrics::default(),
            accepting: AtomicBool::new(true),
            startup: crate::startup::StartupGate::new(),
            kv,
            config,
        };
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// Builds a router from `config` and, in P/D mode, runs its startup
    /// work: the Mooncake bootstrap queries of the static prefill workers
    /// ([`Router::bootstrap_pd`]). What a command line calls.
    pub async fn start(config: RouterConfig) -> Result<Self, ConfigError> {
        let router = Self::new(config)?;
        router.bootstrap_pd().await?;
        Ok(router)
    }

    /// In P/D mode with the Mooncake connector, learns the engine ids of
    /// every static prefill worker from its bootstrap server (retried with
    /// backoff); a no-op otherwise. Prefill workers whose engine ids are
    /// unknown are not selected.
    pub async fn bootstrap_pd(&self) -> Result<(), ConfigError> {
        match &self.shared.pd {
            Some(pd) => pd.bootstrap().await,
            None => Ok(()),
        }
    }

    /// The prefill/decode pools, in P/D mode.
    pub fn pd(&self) -> Option<&Arc<crate::pd::PdPools>> {
        self.shared.pd.as_ref().map(crate::pd::PdState::pools)
    }

    /// Every worker of every role: the regular ones, then (in P/D mode)
    /// the prefill and decode workers as last reconciled.
    pub fn all_workers(&self) -> Vec<Arc<Worker>> {
        let mut all: Vec<Arc<Worker>> = self.workers().iter().cloned().collect();
        if let Some(pd) = self.pd() {
            all.extend(pd.workers());
        }
        all
    }

    /// The configuration the router was built with.
    pub fn config(&self) -> &RouterConfig {
        &self.shared.config
    }

    /// Checks a worker URL given at run time before anything is sent to
    /// it: [`WorkerUrl::parse_http`] (one canonical spelling, plain HTTP),
    /// then the configured [`RouterConfig::worker_networks`] (a host name
    /// is resolved, within the connect timeout, and all its addresses must
    /// be allowed). Hosts that add workers their own way call this first.
    pub async fn check_worker_url(&self, url: &str) -> Result<WorkerUrl, ApiError> {
        let url =
            WorkerUrl::parse_http(url).map_err(|err| ApiError::InvalidRequest(err.to_string()))?;
        let config = &self.shared.config;
        crate::allow::check_worker_address(
            &url,
            &config.worker_networks,
            config.client.connect_timeout,
        )
        .await?;
        Ok(url)
    }

    /// Adds a regular worker at `url` (with an optional data-parallel rank
    /// and model id) without waiting for its health, and tells the policies.
    pub fn add_worker(
        &self,
        url: &str,
        dp_rank: Option<u32>,
        model: Option<&str>,
    ) -> Result<Arc<Worker>, ConfigError> {
        let invalid = |reason: String| ConfigError::Worker {
            url: url.to_owned(),
            reason,
        };
        let parsed = WorkerUrl::parse_http(url).map_err(|err| invalid(err.reason().to_owned()))?;
        self.add_worker_at(Endpoint::from_url(parsed, dp_rank), model)
    }

    /// Adds a regular worker at an endpoint whose URL is already parsed,
    /// without waiting for its health, and tells the policies.
    pub fn add_worker_at(
        &self,
        endpoint: Endpoint,
        model: Option<&str>,
    ) -> Result<Arc<Worker>, ConfigError> {
        let invalid = |reason: String| ConfigError::Worker {
            url: endpoint.url().to_owned(),
            reason,
        };
        let mut spec = WorkerSpec::new(WorkerRole::Regular, endpoint.clone());
        if let Some(model) = model {
            spec = spec.with_model(model);
        }
        self.shared
            .pool
            .add(spec)
            .map_err(|err| invalid(err.to_string()))
    }

    /// Adds a static prefill or decode worker at run time, in P/D mode: a
    /// Mooncake prefill worker's engine ids are learned first (with the
    /// configured bootstrap retries), so it joins its role already
    /// selectable.
    ///
    /// # Errors
    /// [`ConfigError::Pd`] outside P/D mode; [`ConfigError::Worker`] for an
    /// invalid spec, a duplicate or a discovered role;
    /// [`ConfigError::Bootstrap`] when its bootstrap server does not answer.
    pub async fn add_pd_worker(
        &self,
        role: RoleKind,
        spec: &crate::pd::PdWorkerConfig,
    ) -> Result<Arc<Worker>, ConfigError> {
        match &self.shared.pd {
            Some(pd) => pd.add_worker(role, spec).await,
            None => Err(ConfigError::Pd(
                "the router is not in prefill/decode mode".into(),
            )),
        }
    }

    /// Forwards a membership event of the regular workers to the policies:
    /// a replaced worker is a removal of the old lifetime's key and an
    /// addition of the new one's.
    pub fn apply(&self, event: &MembershipEvent) {
        self.shared.pool.apply(event);
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

    /// The router's own counters.
    pub fn metrics(&self) -> &RouterMetrics {
        &self.shared.metrics
    }

    /// Whether new requests are admitted (false once shutdown began).
    pub fn is_accepting(&self) -> bool {
        self.shared.accepting.load(Ordering::Acquire)
    }

    /// Stops admitting new requests: readiness and health turn 503 at once,
    /// proxied routes answer 503; requests in flight continue.
    pub fn begin_shutdown(&self) {
        self.shared.accepting.store(false, Ordering::Release);
    }

    /// The startup gate: until the workers a host declared on it are marked
    /// ready (or its startup wait ends), `/health` and `/readiness` answer
    /// 503 naming them, while `/liveness` answers 200. Open unless a host
    /// declares workers; see [`crate::startup`].
    pub fn startup_gate(&self) -> &crate::startup::StartupGate {
        &self.shared.startup
    }

    /// Requests in flight through the router (admission permits held).
    pub fn in_flight(&self) -> usize {
        self.shared.limiter.in_flight()
    }

    /// Checks the credential `route` needs: the inference key for proxied
    /// routes, the admin key (or the inference key when no admin key is
    /// set) for admin routes and admin reads, nothing for probes and
    /// metrics (`/metrics` checks the admin key in its own handler, unless
    /// [`RouterConfig::metrics_open`]). Hosts that serve a route of their own next to
    /// [`Router::handle`] call this rather than parse keys themselves.
    pub fn authorize(&self, route: Route, headers: &http::HeaderMap) -> Result<(), ApiError> {
        let config = &self.shared.config;
        // Admin reads reveal worker URLs: they need the admin credential
        // exactly like the admin writes.
        let required = if route.is_admin() || route.is_admin_read() {
            config
                .admin_api_key
                .as_deref()
                .or(config.api_key.as_deref())
        } else if route.needs_api_key() {
            config.api_key.as_deref()
        } else {
            None
        };
        match required {
            None => Ok(()),
            Some(key) if bearer(headers).is_some_and(|presented| same_key(presented, key)) => {
                Ok(())
            }
            Some(_) => Err(ApiError::Unauthorized),
        }
    }

    pub(crate) async fn proxy<B>(
        &self,
        kind: RouteKind,
        request: Request<B>,
        started: Instant,
    ) -> Result<Response<BoxBody>, ApiError>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let shared = &self.shared;
        if !self.is_accepting() {
            return Err(ApiError::ShuttingDown);
        }
        if let Some(rate) = &shared.rate {
            rate.try_acquire()?;
        }
        let timeout = shared.config.request_timeout;
        let deadline = started + timeout;
        // The whole-request deadline bounds every phase: the queue, the
        // client's body, connect and the worker's response head (below),
        // and the response body (in the body wrapper).
        let permit = tokio::time::timeout_at(deadline, shared.limiter.admit())
            .await
            .map_err(|_elapsed| ApiError::RequestTimeout {
                phase: "waiting for admission",
                timeout,
            })??;
        let (parts, body) = request.into_parts();
        let body_timeout = shared.config.request_body_timeout.min(timeout);
        let body_deadline = deadline.min(Instant::now() + shared.config.request_body_timeout);
        let bytes = tokio::time::timeout_at(
            body_deadline,
            crate::payload::read_limited(body, &parts.headers, shared.config.max_payload_size),
        )
        .await
        .map_err(|_elapsed| ApiError::RequestBodyTimeout(body_timeout))??;
        // Off the runtime for large bodies, bounded by the deadline and
        // cancelled if this future is dropped (the client went away).
        #[cfg(feature = "tokens")]
        let info = shared
            .config
            .tokenizers
            .extract_bounded(kind, &bytes, deadline, timeout)
            .await?;
        #[cfg(not(feature = "tokens"))]
        let info = crate::extract(kind, &bytes)?;
        let model = info.model.unwrap_or_default();
        let routing = info.routing;
        let request_id = shared.ids.resolve(&parts.headers);

        let session = parts
            .headers
            .get(&shared.session_header)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let request = OwnedContext {
            model,
            routing,
            session,
            user: info.user,
            header: None,
            request_id: request_id.value.to_str().ok().map(str::to_owned),
        };
        let retries = shared.retries(std::time::Instant::now());
        if let Some(pd) = &shared.pd
            && matches!(
                kind,
                RouteKind::ChatCompletions | RouteKind::Completions | RouteKind::Generate
            )
        {
            let arrival = crate::pd::PdArrival {
                parts,
                bytes,
                request,
                client_id: request_id.value.clone(),
                deadline,
            };
            let timeout = shared.config.request_timeout;
            let response = crate::pd::proxy(pd, arrival, retries, &shared.metrics, timeout).await?;
            // The decode guard lives inside the body (pd-orchestrator's
            // `PdBody`); the permit goes with it.
            let in_flight = InFlight::new(None, permit, shared, false);
            return Ok(respond(response, in_flight, request_id));
        }
        // In P/D mode the other routes (models, embeddings...) go to the
        // decode workers, chosen by the decode policy.
        let pool = match self.pd() {
            Some(pd) => pd.decode().pool(),
            None => &shared.pool,
        };
        let all = pool.refresh()?;
        let context = request.context();
        let candidates = pool.eligible(&all, &request.model, |_| true)?;
        let mut retries = retries;
        let mut failed: Vec<Arc<Worker>> = Vec::new();
        loop {
            // A deadline spent in the router (tokenizing, queueing, backing
            // off) is the router's 504: no worker is reserved or charged.
            crate::error::before_dispatch(deadline, timeout)?;
            // Workers that failed this request are left out, unless that
            // would leave none available (then a failed one may be retried).
            let rest = pool.eligible(candidates.workers(), "", |w| {
                !failed.iter().any(|f| Arc::ptr_eq(f, w))
            })?;
            let pick = if rest.any_available() {
                rest
            } else {
                candidates.clone()
            };
            pool.require_available(&pick)?;
            let choice = pool.choose(&pick, &context, true)?;
            if let Some(permille) = choice.match_permille {
                shared
                    .metrics
                    .match_rate
                    .observe(f64::from(permille) / 1000.0);
            }
            let worker = choice.worker;
            let Some(guard) = choice.guard else {
                return Err(no_guard(&worker));
            };
            let upstream = match build_upstream(&parts, &worker, &bytes, &request_id, shared) {
                Ok(upstream) => upstream,
                Err(err) => {
                    // The router's own failure: nothing reached the worker.
                    guard.record_outcome(Outcome::RouterRejected);
                    return Err(err);
                }
            };
            match shared.client.send_before(upstream, Some(deadline)).await {
                Err(UpstreamError::Deadline) => {
                    // The worker had the request and did not answer in time.
                    guard.record_outcome(Outcome::Timeout);
                    shared
                        .metrics
                        .record_upstream_failure(&UpstreamError::Deadline);
                    return Err(ApiError::RequestTimeout {
                        phase: "waiting for the worker's response headers",
                        timeout,
                    });
                }
                Err(UpstreamError::InvalidRequest(reason)) => {
                    // The router could not build or send the request: never
                    // the worker's failure, never retried.
                    guard.record_outcome(Outcome::RouterRejected);
                    return Err(ApiError::InvalidRequest(format!(
                        "the request cannot be forwarded: {reason}"
                    )));
                }
                Err(err) => {
                    guard.record_outcome(outcome_of(&err));
                    drop(guard);
                    shared.metrics.record_upstream_failure(&err);
                    if let Some(backoff) = err
                        .is_retryable()
                        .then(|| self.grant_retry(&mut retries, deadline))
                        .flatten()
                    {
                        failed.push(worker);
                        self.back_off(backoff, deadline).await?;
                        continue;
                    }
                    return Err(match err {
                        UpstreamError::HeaderTimeout(_) => {
                            ApiError::GatewayTimeout(err.to_string())
                        }
                        _ => ApiError::BadGateway(err.to_string()),
                    });
                }
                Ok(response) => {
                    let status = response.status().as_u16();
                    if let Some(backoff) = shared
                        .config
                        .retry
                        .is_retryable_status(status)
                        .then(|| self.grant_retry(&mut retries, deadline))
                        .flatten()
                    {
                        guard.record_outcome(Outcome::from_status(status));
                        // This attempt ends here: its unread body and its
                        // guard are dropped together.
                        drop(response);
                        drop(guard);
                        failed.push(worker);
                        self.back_off(backoff, deadline).await?;
                        continue;
                    }
                    let success = response.status().is_success();
                    if !success {
                        guard.record_outcome(Outcome::from_status(status));
                    }
                    let idle = shared.config.stream_idle_timeout;
                    let response =
                        response.map(|body| IdleTimeout::with_deadline(body, idle, deadline));
                    let in_flight = InFlight::new(Some(guard), permit, shared, success);
                    return Ok(respond(response, in_flight, request_id));
                }
            }
        }
    }

    /// One more retry of this request, if the policy, the shared budget
    /// and `deadline` allow it: the backoff to wait before it.
    fn grant_retry(
        &self,
        retries: &mut RequestRetries<'_>,
        deadline: Instant,
    ) -> Option<std::time::Duration> {
        if Instant::now() >= deadline {
            return None;
        }
        let backoff = retries.next(std::time::Instant::now())?;
        self.shared.metrics.retries.inc();
        Some(backoff)
    }

    /// Sleeps `backoff`, never past `deadline`; a deadline reached while
    /// backing off ends the request.
    async fn back_off(
        &self,
        backoff: std::time::Duration,
        deadline: Instant,
    ) -> Result<(), ApiError> {
        tokio::time::sleep_until((Instant::now() + backoff).min(deadline)).await;
        if Instant::now() >= deadline {
            return Err(ApiError::RequestTimeout {
                phase: "before a retry could be sent",
                timeout: self.shared.config.request_timeout,
            });
        }
        Ok(())
    }
}

impl Shared {
    /// The retries of one request arriving at `now`, counted in the
    /// router's budget (both modes).
    fn retries(&self, now: std::time::Instant) -> RequestRetries<'_> {
        let seed = self.jitter_seed.fetch_add(1, Ordering::Relaxed);
        RequestRetries::start(&self.config.retry, &self.retry_budget, seed, now)
    }
}

/// A choice made with `reserve` always carries its guard.
fn no_guard(worker: &Worker) -> ApiError {
    ApiError::NoAvailableWorker(format!("{} could not be reserved", worker.key()))
}

/// The router's background tasks; dropping this stops them.
#[derive(Debug)]
#[must_use = "the background tasks stop when this is dropped"]
pub struct BackgroundTasks {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for BackgroundTasks {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The response handed to the client in both modes: the worker's status,
/// headers and body, with hop-by-hop headers removed, the request id added,
/// and the body owning what the request holds.
fn respond<B>(
    response: Response<B>,
    in_flight: InFlight,
    request_id: RequestId,
) -> Response<BoxBody>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.insert(request_id.header, request_id.value);
    let body = GuardedBody::new(body, in_flight)
        .map_err(|err| -> BoxError { err.into() })
        .boxed_unsync();
    Response::from_parts(parts, body)
}

/// What one admitted request holds while its response body runs: the
/// admission permit, and the worker's guard when the router proxied to one
/// worker (a P/D response's decode guard lives inside its body).
struct InFlight {
    guard: Option<LoadGuard>,
    _permit: AdmissionPermit,
    shared: Arc<Shared>,
    /// A 2xx response's breaker outcome is known only when its body ends.
    outcome_pending: bool,
}

impl InFlight {
    fn new(
        guard: Option<LoadGuard>,
        permit: AdmissionPermit,
        shared: &Arc<Shared>,
        outcome_pending: bool,
    ) -> Self {
        Self {
            guard,
            _permit: permit,
            shared: Arc::clone(shared),
            outcome_pending,
        }
    }
}

impl Finish for InFlight {
    fn finish(self, end: BodyEnd) {
        let metrics = &self.shared.metrics;
        match end {
            BodyEnd::Complete => metrics.bodies_completed.inc(),
            BodyEnd::Failed => metrics.bodies_failed.inc(),
            BodyEnd::Dropped => metrics.bodies_dropped.inc(),
        }
        let outcome = match end {
            BodyEnd::Complete => Outcome::Success,
            BodyEnd::Failed => Outcome::ConnectionReset,
            BodyEnd::Dropped => Outcome::ClientCancelled,
        };
        if let Some(guard) = &self.guard
            && (self.outcome_pending || end == BodyEnd::Failed)
        {
            guard.record_outcome(outcome);
        }
        // The guard and the permit are released here, by being dropped.
    }
}

fn build_upstream(
    parts: &http::request::Parts,
    worker: &Worker,
    body: &Bytes,
    request_id: &RequestId,
    shared: &Shared,
) -> Result<Request<Full<Bytes>>, ApiError> {
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", http::uri::PathAndQuery::as_str);
    // `Route::of` admits only targets that are paths ("/..."), so the
    // worker's base URL and the path make one absolute URL.
    if !path.starts_with('/') {
        return Err(ApiError::InvalidRequest(format!(
            "the request target {path:?} is not a path"
        )));
    }
    let uri: Uri = worker
        .endpoint()
        .worker_url()
        .url_for(path)
        .parse()
        .map_err(|err| ApiError::InvalidRequest(format!("cannot forward {path:?}: {err}")))?;
    let mut request = Request::new(Full::new(body.clone()));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = uri;
    let headers = request.headers_mut();
    headers.clone_from(&parts.headers);
    strip_hop_by_hop(headers);
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(request_id.header.clone(), request_id.value.clone());
    // The router decides the rank; a client-sent value is overridden.
    headers.remove(&shared.dp_rank_header);
    if let Some(rank) = worker.dp_rank() {
        headers.insert(shared.dp_rank_header.clone(), HeaderValue::from(rank));
    }
    Ok(request)
}

/// The breaker outcome of a failed send. Only failures the worker caused
/// count against it; a request the router could not build is its own.
fn outcome_of(err: &UpstreamError) -> Outcome {
    match err {
        UpstreamError::Connect(_) => Outcome::ConnectError,
        UpstreamError::HeaderTimeout(_) | UpstreamError::Deadline => Outcome::Timeout,
        UpstreamError::InvalidRequest(_) => Outcome::RouterRejected,
        _ => Outcome::ConnectionReset,
    }
}

/// Compares a presented key with the configured one in time that depends
/// only on their lengths, so response timing does not reveal how many
/// leading characters of a guess were right.
fn same_key(presented: &str, key: &str) -> bool {
    let (presented, key) = (presented.as_bytes(), key.as_bytes());
    if presented.len() != key.len() {
        return false;
    }
    let difference = presented
        .iter()
        .zip(key)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    // Keep the optimizer from turning the fold into an early exit.
    std::hint::black_box(difference) == 0
}

fn bearer(headers: &http::HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

impl Router {
    /// Serves on `listener` until `shutdown` resolves; then stops admitting
    /// (readiness, health and proxied routes answer 503 at once, on a
    /// listener that stays open so probes can see it), lets requests in
    /// flight finish for up to the configured grace period, closes the
    /// listener, and returns.
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> crate::ShutdownOutcome {
        let router = self.clone();
        let service = hyper::service::service_fn(move |request| {
            let router = router.clone();
            async move { Ok::<_, std::convert::Infallible>(router.handle(request).await) }
        });
        let stopping = self.clone();
        let grace = self.shared.config.shutdown_grace;
        let drain_started = Arc::new(std::sync::OnceLock::new());
        let started = Arc::clone(&drain_started);
        // Phase one: stop admitting (readiness and proxied routes answer 503
        // at once) but keep the listener open, so probes see the 503, until
        // the requests in flight are done or the grace period ends.
        let shutdown = async move {
            shutdown.await;
            stopping.begin_shutdown();
            let deadline = Instant::now() + grace;
            let _ = started.set(deadline);
            while stopping.in_flight() > 0 && Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        };
        // Phase two: stop accepting and drain connections for what is left
        // of the grace period.
        let remaining = move || {
            drain_started.get().map_or(grace, |deadline: &Instant| {
                deadline.saturating_duration_since(Instant::now())
            })
        };
        crate::server::serve_with(
            listener,
            service,
            shutdown,
            &self.shared.config.server,
            remaining,
        )
        .await
    }

    /// Starts the router's background work: health checks of every worker
    /// (never touching load) and the periodic cache-tree eviction. The tasks
    /// stop when the returned handle is dropped.
    pub fn spawn_background(&self) -> BackgroundTasks {
        let shared = Arc::clone(&self.shared);
        let probe =
            crate::probe::HttpProbe::new(shared.client.clone(), &shared.config.health_endpoint);
        let checker = Arc::new(worker_lifecycle::HealthChecker::new(
            probe,
            shared.config.health.clone(),
        ));
        let router = self.clone();
        let health = checker.spawn(move || Arc::from(router.all_workers()));
        let evictor = Arc::clone(&shared);
        let eviction = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(evictor.config.eviction_interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                // Inserts keep the trees within their limits; this fallback
                // reaches trees nobody inserts into. Bounded work, but off
                // the runtime's threads all the same.
                let shared = Arc::clone(&evictor);
                let upkeep = tokio::task::spawn_blocking(move || {
                    shared.pool.policies().maintain();
                    if let Some(pd) = &shared.pd {
                        pd.pools().prefill().policies().maintain();
                        pd.pools().decode().policies().maintain();
                    }
                });
                if let Err(err) = upkeep.await {
                    tracing::error!(error = %err, "prefix tree upkeep failed");
                }
            }
        });
        let mut tasks = vec![health, eviction];
        // Nothing without the `kv-events` feature (the hub type is then
        // uninhabited).
        if let Some(hub) = &shared.kv {
            let router = self.clone();
            let members = move |roles: &[RoleKind]| router.workers_of(roles);
            tasks.push(crate::kv_wiring::spawn_sync(
                hub,
                self.client().clone(),
                members,
            ));
        }
        BackgroundTasks { tasks }
    }

    /// The current workers of `roles`, each pool reconciled first so that
    /// discovered workers are current; `None` when a pool could not be
    /// refreshed (the caller keeps what it knew).
    #[cfg_attr(
        not(feature = "kv-events"),
        allow(dead_code, reason = "only the KV event hub follows pools")
    )]
    fn workers_of(&self, roles: &[RoleKind]) -> Option<Vec<Arc<Worker>>> {
        let mut workers = Vec::new();
        for &role in roles {
            let pool = match (role, self.pd()) {
                (RoleKind::Regular, _) => self.pool(),
                (_, Some(pd)) => pd.role(role).pool(),
                (_, None) => continue,
            };
            workers.extend(pool.refresh().ok()?.iter().cloned());
        }
        Some(workers)
    }

    /// Status of the whole fleet for readiness: whether the startup gate is
    /// open and every required role has at least one available worker.
    pub fn is_ready(&self) -> bool {
        if !self.is_accepting() || !self.shared.startup.is_open() {
            return false;
        }
        match self.pd() {
            Some(pd) => pd.is_ready(),
            None => self
                .shared
                .pool
                .refresh()
                .is_ok_and(|workers| workers.iter().any(|w| w.is_available())),
        }
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

/// Makes every cache-aware policy of the router (the regular pool's and the
/// P/D pools', every model's instance) charge one memory budget: the size
/// of `config.policy`'s `max_tree_bytes`, unless the host set a budget of
/// its own. Returns it.
fn share_tree_budget(config: &mut RouterConfig) -> Arc<lb_policies::MemoryBudget> {
    let budget = config
        .policy
        .cache_aware
        .tree_budget
        .get_or_insert_with(|| {
            lb_policies::MemoryBudget::new(config.policy.cache_aware.max_tree_bytes)
        })
        .clone();
    if let Some(pd) = &mut config.pd {
        for policy in [&mut pd.prefill_policy, &mut pd.decode_policy]
            .into_iter()
            .flatten()
        {
            policy.cache_aware.tree_budget = Some(Arc::clone(&budget));
        }
    }
    budget
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    #[tokio::test]
    async fn worker_urls_are_validated_before_use() {
        let router = Router::new(RouterConfig::default()).unwrap();
        for good in [
            "http://127.0.0.1:8001",
            "http://engine.local",
            "http://[::1]:8000",
        ] {
            assert!(router.check_worker_url(good).await.is_ok(), "{good}");
        }
        let https = router
            .check_worker_url("https://engine.local")
            .await
            .unwrap_err();
        assert!(
            https
                .to_string()
                .contains("https workers are not supported"),
            "{https}"
        );
        for bad in [
            "127.0.0.1:8001",
            "ftp://host",
            "http://",
            "http://host:99999",
            "http://user:pw@host",
            "http://host/?q=1",
            "http://host:8000/v1",
            "not a url",
        ] {
            let err = router.check_worker_url(bad).await.unwrap_err();
            assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{bad}");
            assert!(err.to_string().contains(bad), "{bad}: {err}");
        }
    }

    #[test]
    fn keys_match_only_when_equal() {
        assert!(same_key("secret-key", "secret-key"));
        assert!(!same_key("secret-kez", "secret-key"));
        assert!(!same_key("secret", "secret-key"));
        assert!(!same_key("", "k"));
    }

    #[test]
    fn bearer_tokens_are_read_case_insensitively() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer  k1"),
        );
        assert_eq!(bearer(&headers), Some("k1"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic k1"));
        assert_eq!(bearer(&headers), None);
    }
}
