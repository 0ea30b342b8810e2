//! The router's own routes: health, readiness, status, worker admin and
//! metrics.
//!
//! Health (`/health`) answers 200 while the router is up and accepting
//! requests, even with no workers, as vllm-router's does; readiness
//! (`/readiness`) answers 200 only when a worker is available to serve;
//! liveness (`/liveness`) always answers 200. While the
//! [startup gate](crate::startup) is closed, health and readiness answer
//! 503 naming the workers still awaited. `/workers` shows each worker's
//! live state as the router's own accounting sees it. `/metrics`, which
//! lists every worker URL too, needs the admin key when one is set, unless
//! the host opted out with `RouterConfig::metrics_open`.

use crate::body::{BoxBody, BoxError};
use crate::error::ApiError;
use crate::load_poll::EngineLoadStatus;
use crate::payload::json;
use crate::probe::HttpProbe;
use crate::router::Router;
use crate::routes::{Route, query_param};
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use prom_text::{Exposition, Label, MetricType, Value};
use std::sync::Arc;
use worker_lifecycle::{Endpoint, Lifecycle, RoleKind, RolePool, Worker, WorkerRole, WorkerSpec};

/// Answers one of the router's own routes.
pub(crate) async fn handle<B>(
    router: &Router,
    route: Route,
    request: Request<B>,
) -> Result<Response<BoxBody>, ApiError>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let query = request.uri().query().map(str::to_owned);
    match route {
        Route::Health if !router.is_accepting() => Err(ApiError::ShuttingDown),
        Route::Health => match router.startup_gate().awaited() {
            awaited if awaited.is_empty() => {
                Ok(json(StatusCode::OK, &serde_json::json!({"status": "ok"})))
            }
            awaited => Err(ApiError::AwaitingWorkers(awaited)),
        },
        Route::Liveness => Ok(json(
            StatusCode::OK,
            &serde_json::json!({"status": "alive"}),
        )),
        Route::Readiness => Ok(readiness(router)),
        Route::Metrics => {
            authorize_metrics(router, request.headers())?;
            Ok(metrics(router))
        }
        Route::ListWorkers => {
            let urls = |workers: &[Arc<Worker>]| -> Vec<String> {
                workers.iter().map(|w| w.endpoint().to_string()).collect()
            };
            // Reconcile discovered workers so the view is current.
            router.pool().refresh()?;
            let mut body = serde_json::json!({ "urls": urls(&router.all_workers()) });
            if let Some(pd) = router.pd() {
                body["prefill"] = urls(&pd.prefill().pool().refresh()?).into();
                body["decode"] = urls(&pd.decode().pool().refresh()?).into();
            }
            Ok(json(StatusCode::OK, &body))
        }
        Route::Workers => {
            router.pool().refresh()?;
            if let Some(pd) = router.pd() {
                // Reconcile discovered roles so the view is current.
                pd.prefill().pool().refresh()?;
                pd.decode().pool().refresh()?;
            }
            #[cfg(feature = "kv-events")]
            let mut kv = router
                .kv_events()
                .map(|hub| hub.statuses())
                .unwrap_or_default();
            let trees = tree_shares(router);
            let workers: Vec<_> = router
                .all_workers()
                .iter()
                .map(|w| {
                    let mut json = worker_json(w);
                    // Its part of its pool's prefix trees (all models).
                    let (symbols, share) = trees.get(w.key()).copied().unwrap_or((0, 0.0));
                    json["prefix_tree"] = serde_json::json!({
                        "symbols": symbols,
                        "share": share,
                    });
                    // What cache-aware matches for the worker's model:
                    // the engine's token ids, or the messages' text.
                    json["routing"] = routing_mode(router, w.model_id().unwrap_or("")).into();
                    // Its own count, the engine's report and the estimate
                    // the policies compare.
                    let engine_load = match router.load_polls() {
                        Some(polls) => polls.status(w),
                        None => EngineLoadStatus::unpolled(w),
                    };
                    json["engine_load"] = serde_json::to_value(engine_load).unwrap_or_default();
                    // Where kv_aware's view of the worker's cache comes
                    // from: its event streams, live or cold.
                    #[cfg(feature = "kv-events")]
                    if let Some(status) = kv.remove(w.key()) {
                        json["kv_events"] = serde_json::to_value(status).unwrap_or_default();
                    }
                    json
                })
                .collect();
            Ok(json(StatusCode::OK, &serde_json::Value::Array(workers)))
        }
        Route::AddWorker => add_worker(router, query.as_deref()).await,
        Route::RemoveWorker => remove_worker(router, query.as_deref()).await,
        Route::Register => {
            let config = router.config();
            let timeout = config.request_body_timeout.min(config.request_timeout);
            crate::register::handle(config.register_hook.as_ref(), timeout, request).await
        }
        Route::PeerChoices => peer_choices(router, request).await,
        Route::ServerOptions => {
            let mut response = Response::new(full(Bytes::new()));
            response.headers_mut().insert(
                header::ALLOW,
                HeaderValue::from_static(crate::routes::SERVER_METHODS),
            );
            Ok(response)
        }
        Route::WrongMethod { allow } => Err(ApiError::MethodNotAllowed { allow }),
        Route::NotFound => Err(ApiError::NotFound(shortened(request.uri().path()))),
        Route::InvalidTarget => Err(ApiError::InvalidRequest(format!(
            "the request target {:?} is not forwarded: it must be a path without `.` or `..` \
             segments (`*` only with OPTIONS)",
            shortened(&request.uri().to_string())
        ))),
        // Proxied routes never reach this function; answer as an unknown
        // route rather than panic if a caller passes one.
        Route::Proxy(_) | Route::Models => Err(ApiError::NotFound(shortened(request.uri().path()))),
    }
}

/// At most 200 characters of client-sent text, for error messages.
fn shortened(text: &str) -> String {
    match text.char_indices().nth(200) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

/// `POST /peer_choices`: a peer replica's batch of routing choices,
/// recorded whole or not at all (see [`crate::peers`]).
async fn peer_choices<B>(
    router: &Router,
    request: Request<B>,
) -> Result<Response<BoxBody>, ApiError>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let Some(peers) = router.peers().filter(|p| p.accepts()) else {
        return Err(ApiError::NotFound(crate::peers::PEER_CHOICES_PATH.into()));
    };
    if !peers.authorized(crate::bearer::bearer(request.headers())) {
        return Err(ApiError::Unauthorized);
    }
    let config = router.config();
    let timeout = config.request_body_timeout.min(config.request_timeout);
    let (parts, body) = request.into_parts();
    let read =
        crate::payload::read_limited(body, &parts.headers, crate::peers::MAX_PEER_BODY_BYTES);
    let body = match tokio::time::timeout(timeout, read).await {
        Ok(Ok(body)) => body,
        Ok(Err(err)) => {
            if matches!(err, ApiError::PayloadTooLarge { .. }) {
                peers.refused_too_large();
            }
            return Err(err);
        }
        Err(_elapsed) => return Err(ApiError::RequestBodyTimeout(timeout)),
    };
    let received = peers.receive(router.policies(), router.workers(), &body)?;
    Ok(json(
        StatusCode::OK,
        &serde_json::json!({"recorded": received.recorded, "ignored": received.ignored}),
    ))
}

fn readiness(router: &Router) -> Response<BoxBody> {
    // One read of the gate for both fields, so the body never says ready
    // while it names awaited workers.
    let awaited = router.startup_gate().awaited();
    let ready = awaited.is_empty() && router.is_ready();
    let workers = router.all_workers();
    let available = workers.iter().filter(|w| w.is_available()).count();
    let mut body = serde_json::json!({
        "ready": ready,
        "accepting": router.is_accepting(),
        "awaited_workers": awaited,
        "workers": workers.len(),
        "available_workers": available,
    });
    if let Some(pd) = router.pd() {
        for role in [pd.prefill(), pd.decode()] {
            let workers = role.workers();
            let available = workers.iter().filter(|w| w.is_available()).count();
            body[format!("{}_workers", role.role())] = workers.len().into();
            body[format!("available_{}_workers", role.role())] = available.into();
        }
    }
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json(status, &body)
}

/// `"tokens"` when requests for `model` route on the engine's token ids,
/// else `"text"`.
fn routing_mode(router: &Router, model: &str) -> &'static str {
    #[cfg(feature = "tokens")]
    return router.config().tokenizers.mode(model);
    #[cfg(not(feature = "tokens"))]
    {
        let _ = (router, model);
        "text"
    }
}

/// Each worker's symbols in its pool's prefix trees (all models, text and
/// tokens) and their share of the pool's total, by worker key.
fn tree_shares(router: &Router) -> std::collections::HashMap<Arc<str>, (usize, f64)> {
    let mut pools = vec![router.policies().affinity_sizes()];
    if let Some(pd) = router.pd() {
        pools.push(pd.prefill().policies().affinity_sizes());
        pools.push(pd.decode().policies().affinity_sizes());
    }
    let mut shares = std::collections::HashMap::new();
    for sizes in pools {
        let total: usize = sizes.iter().map(|(_, _, size)| size).sum();
        let mut by_key: std::collections::HashMap<Arc<str>, usize> =
            std::collections::HashMap::new();
        for (_, key, size) in sizes {
            *by_key.entry(key).or_default() += size;
        }
        for (key, size) in by_key {
            let share = if total == 0 {
                0.0
            } else {
                size as f64 / total as f64
            };
            shares.insert(key, (size, share));
        }
    }
    shares
}

/// The prefix trees' memory: the budget every cache-aware policy charges,
/// and each pool's trees by model and kind.
fn render_trees(router: &Router, exposition: &mut Exposition<'_>) {
    if let Some(budget) = &router.config().policy.cache_aware.tree_budget {
        exposition
            .family(
                "router_tree_memory_budget_bytes",
                MetricType::Gauge,
                "Memory budget of all prefix trees (--max-tree-bytes).",
            )
            .sample(&[], budget.limit());
        exposition
            .family(
                "router_tree_memory_bytes",
                MetricType::Gauge,
                "Bytes of prefix state all trees account for against the budget.",
            )
            .sample(&[], budget.used());
        exposition
            .family(
                "router_tree_evictions_total",
                MetricType::Counter,
                "Tree entries (a worker's hold on a prefix) evicted to keep within the \
                 budget and the per-worker limit.",
            )
            .sample(&[], budget.evicted());
    }
    let mut pools = vec![("regular", router.policies().tree_stats())];
    if let Some(pd) = router.pd() {
        pools.push(("prefill", pd.prefill().policies().tree_stats()));
        pools.push(("decode", pd.decode().policies().tree_stats()));
    }
    type Field = fn(&lb_policies::TreeStats) -> u64;
    let families: [(&str, MetricType, &str, Field); 3] = [
        (
            "router_tree_bytes",
            MetricType::Gauge,
            "Bytes a pool's prefix trees of one kind account for, by model.",
            |s| s.bytes,
        ),
        (
            "router_tree_entries",
            MetricType::Gauge,
            "Entries (a worker's hold on a prefix) in a pool's trees of one kind, by model.",
            |s| s.entries,
        ),
        (
            "router_tree_evicted_entries_total",
            MetricType::Counter,
            "Entries a pool's trees of one kind evicted to keep within their limits, by model.",
            |s| s.evicted,
        ),
    ];
    for (name, kind, help, field) in families {
        let mut family = exposition.family(name, kind, help);
        for (pool, stats) in &pools {
            for (model, stats) in stats {
                family.sample(
                    &[("pool", pool), ("model", model), ("tree", &stats.kind)],
                    field(stats),
                );
            }
        }
    }
}

/// One worker as `/workers` shows it.
pub(crate) fn worker_json(worker: &Worker) -> serde_json::Value {
    serde_json::json!({
        "url": worker.url(),
        "dp_rank": worker.dp_rank(),
        "role": worker.role().kind().as_str(),
        "model": worker.model_id(),
        "generation": worker.generation(),
        "load": worker.load(),
        "processed": worker.processed(),
        "healthy": worker.is_healthy(),
        "available": worker.is_available(),
        "breaker": worker.breaker().state().as_str(),
        "lifecycle": lifecycle_str(worker.lifecycle()),
        "underflows": worker.underflows(),
        // Where it came from: discovery's registration labels (Kubernetes:
        // `source`, `pod`, `namespace`; vLLM registration: `kv_addr`, ...).
        "labels": worker.labels(),
    })
}

fn lifecycle_str(lifecycle: Lifecycle) -> &'static str {
    match lifecycle {
        Lifecycle::Pending => "pending",
        Lifecycle::Ready => "ready",
        Lifecycle::Draining => "draining",
        _ => "removed",
    }
}

async fn add_worker(router: &Router, query: Option<&str>) -> Result<Response<BoxBody>, ApiError> {
    let url = query_param(query, "url")
        .ok_or_else(|| ApiError::InvalidRequest("missing query parameter `url`".into()))?;
    // Every parameter is read before anything is resolved or probed: bad
    // input is refused at once and changes nothing.
    let bootstrap_port = match query_param(query, "bootstrap_port") {
        None => None,
        Some(port) => match port.parse::<u16>() {
            Ok(port) if port > 0 => Some(port),
            _ => {
                return Err(ApiError::InvalidRequest(format!(
                    "bootstrap_port {:?} is not a port from 1 to 65535",
                    port.chars().take(16).collect::<String>()
                )));
            }
        },
    };
    let worker_url = router.check_worker_url(&url).await?;
    if worker_url.port() == 0 {
        return Err(ApiError::InvalidRequest(format!(
            "url {worker_url}: port 0 is not a port a worker listens on (1-65535)"
        )));
    }
    let endpoint = Endpoint::from_url(worker_url.clone(), None);
    // In P/D mode the worker joins a role's pool: `role=prefill|decode`.
    let (pool, pd_role) = role_pool(router, query)?;
    let existing = pool
        .workers()
        .iter()
        .find(|w| *w.endpoint() == endpoint)
        .cloned();
    if let Some(existing) = existing {
        return Err(ApiError::WorkerExists(match existing.lifecycle() {
            Lifecycle::Draining => format!(
                "{} (draining: it leaves when its load of {} reaches 0 or the drain timeout \
                 passes)",
                existing.url(),
                existing.load()
            ),
            _ => existing.url().to_owned(),
        }));
    }
    let config = router.config();
    let probe = HttpProbe::new(router.client().clone(), &config.health_endpoint);
    let deadline = tokio::time::Instant::now() + config.worker_startup_timeout;
    // Nothing is routable until the first healthy probe.
    loop {
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        let attempt = tokio::time::timeout(
            remaining.min(config.health.timeout),
            probe.probe_url(&worker_url),
        )
        .await;
        if matches!(attempt, Ok(Ok(()))) {
            break;
        }
        if tokio::time::Instant::now() + config.worker_startup_check_interval >= deadline {
            return Err(ApiError::WorkerNotReady(format!(
                "{url} did not answer {} with 200 within {:?}",
                config.health_endpoint, config.worker_startup_timeout
            )));
        }
        tokio::time::sleep(config.worker_startup_check_interval).await;
    }
    if let Some(role) = pd_role {
        let mut spec = crate::pd::PdWorkerConfig::new(url.as_str());
        if let Some(port) = bootstrap_port {
            spec = spec.with_bootstrap_port(port);
        }
        let worker = router
            .add_pd_worker(role, &spec)
            .await
            .map_err(|err| match err {
                crate::ConfigError::Bootstrap(err) => ApiError::WorkerNotReady(err.to_string()),
                other => ApiError::InvalidRequest(other.to_string()),
            })?;
        return Ok(json(
            StatusCode::OK,
            &serde_json::json!({"status": "added", "worker": worker_json(&worker)}),
        ));
    }
    let worker = pool
        .add(WorkerSpec::new(WorkerRole::Regular, endpoint))
        .map_err(|err| ApiError::WorkerExists(err.to_string()))?;
    Ok(json(
        StatusCode::OK,
        &serde_json::json!({"status": "added", "worker": worker_json(&worker)}),
    ))
}

/// `POST /remove_worker?url=[&role=][&wait=false]`: marks the worker
/// draining (no new requests) and hands the drain to a task the router
/// owns: it waits until the worker's load is 0, or the drain timeout passes,
/// and removes it. The drain finishes whether or not the caller stays. By
/// default the call waits for it and answers 200 with `drained` (whether
/// the load reached 0); with `wait=false` it answers 202 at once with the
/// worker's load, and `/workers` shows it `draining` until it leaves.
async fn remove_worker(
    router: &Router,
    query: Option<&str>,
) -> Result<Response<BoxBody>, ApiError> {
    let url = query_param(query, "url")
        .ok_or_else(|| ApiError::InvalidRequest("missing query parameter `url`".into()))?;
    let endpoint =
        Endpoint::new(&url, None).map_err(|err| ApiError::InvalidRequest(err.to_string()))?;
    let wait = match query_param(query, "wait").as_deref() {
        None | Some("true" | "1" | "") => true,
        Some("false" | "0") => false,
        Some(other) => {
            return Err(ApiError::InvalidRequest(format!(
                "wait must be true or false, got {other:?}"
            )));
        }
    };
    let drain_timeout = router.config().drain_timeout;
    let deadline = tokio::time::Instant::now() + drain_timeout;
    let (pool, role) = role_pool(router, query)?;
    // Refused before anything is answered, `wait=false` included: a
    // discovered worker leaves by deregistering.
    pool.static_set()
        .map_err(|err| ApiError::InvalidRequest(err.to_string()))?;
    let worker = pool
        .workers()
        .iter()
        .find(|w| *w.endpoint() == endpoint)
        .cloned()
        .ok_or_else(|| {
            ApiError::WorkerNotFound(match role {
                Some(role) => format!("{role} worker {url}"),
                None => url.clone(),
            })
        })?;
    worker.start_drain();
    let (owner, draining) = (router.clone(), Arc::clone(&worker));
    // The router owns the drain: it finishes whether or not the caller
    // stays, and removes exactly this lifetime (a replacement that took
    // its place meanwhile stays).
    let drain = tokio::spawn(async move {
        let (pool, _) = role_pool_of(&owner, role);
        pool.drain_and_remove(&draining, deadline)
            .await
            .map_err(|err| ApiError::InvalidRequest(err.to_string()))
    });
    if !wait {
        return Ok(json(
            StatusCode::ACCEPTED,
            &serde_json::json!({
                "status": "draining",
                "url": worker.url(),
                "load": worker.load(),
                "drain_timeout_secs": drain_timeout.as_secs_f64(),
            }),
        ));
    }
    let drained = match drain.await {
        Ok(result) => result?,
        Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
        Err(_cancelled) => return Err(ApiError::ShuttingDown),
    };
    Ok(json(
        StatusCode::OK,
        &serde_json::json!({"status": "removed", "url": worker.url(), "drained": drained}),
    ))
}

/// The pool an admin call acts on: the regular workers, or in P/D mode the
/// role it names with `role` (or `worker_type`).
fn role_pool<'a>(
    router: &'a Router,
    query: Option<&str>,
) -> Result<(&'a RolePool, Option<RoleKind>), ApiError> {
    if router.pd().is_none() {
        return Ok(role_pool_of(router, None));
    }
    let role = query_param(query, "role").or_else(|| query_param(query, "worker_type"));
    match role.as_deref() {
        Some("prefill") => Ok(role_pool_of(router, Some(RoleKind::Prefill))),
        Some("decode") => Ok(role_pool_of(router, Some(RoleKind::Decode))),
        _ => Err(ApiError::InvalidRequest(
            "in prefill/decode mode, add_worker and remove_worker need role=prefill or \
             role=decode"
                .into(),
        )),
    }
}

/// The regular pool (`None`), or the P/D role's pool.
fn role_pool_of(router: &Router, role: Option<RoleKind>) -> (&RolePool, Option<RoleKind>) {
    match (role, router.pd()) {
        (Some(role), Some(pd)) => (pd.role(role).pool(), Some(role)),
        _ => (router.pool(), None),
    }
}

/// `/metrics` names every worker (its `url` label), which `/workers`
/// guards with the admin key: with an admin key set the scrape needs it
/// too, unless [`RouterConfig::metrics_open`](crate::RouterConfig::metrics_open)
/// opts out for a scraper without credentials. Checked here rather than in
/// [`Router::authorize`], which answers by route alone and keeps `/metrics`
/// open for probes of hosts that never set an admin key.
fn authorize_metrics(router: &Router, headers: &http::HeaderMap) -> Result<(), ApiError> {
    let config = router.config();
    if config.metrics_open || config.admin_api_key.is_none() {
        return Ok(());
    }
    // The admin-read rule: the admin key, and only it.
    router.authorize(Route::Workers, headers)
}

fn metrics(router: &Router) -> Response<BoxBody> {
    let mut out = String::with_capacity(96 * 1024);
    let mut exposition = Exposition::new(&mut out);
    router.metrics().render(&mut exposition);
    let all = router.all_workers();
    render_workers(&all, &mut exposition);
    render_engine_loads(&all, &mut exposition);
    if let Some(peers) = router.peers() {
        peers.render(&mut exposition);
    }
    if let Some(polls) = router.load_polls() {
        polls.render(&mut exposition);
    }
    router.render_pd(&mut exposition);
    let mut family = exposition.family(
        "router_policy_decisions_total",
        MetricType::Counter,
        "Policy decisions by model, policy and reason.",
    );
    for (model, policy, counts) in router.policies().counts() {
        for (reason, value) in counts.iter() {
            family.sample(
                &[("model", &model), ("policy", &policy), ("reason", &reason)],
                value,
            );
        }
    }
    let mut family = exposition.family(
        "router_policy_models_evicted_total",
        MetricType::Counter,
        "Models whose policy instance (prefix trees, counters) was dropped to keep the pool \
         within --max-routed-models; a stream of made-up model names shows here.",
    );
    family.sample(&[("pool", &"regular")], router.policies().evicted_models());
    if let Some(pd) = router.pd() {
        for role in [RoleKind::Prefill, RoleKind::Decode] {
            family.sample(
                &[("pool", &role.as_str())],
                pd.role(role).policies().evicted_models(),
            );
        }
    }
    let mut family = exposition.family(
        "router_cache_tree_size",
        MetricType::Gauge,
        "Symbols (chars or tokens) each worker holds in the model's cache-aware tree.",
    );
    let workers = router.workers();
    for (model, key, size) in router.policies().affinity_sizes() {
        let worker = workers.iter().find(|w| w.key() == &*key);
        let worker: &dyn std::fmt::Display = match worker {
            Some(worker) => worker.endpoint(),
            None => &key,
        };
        family.sample(&[("model", &model), ("worker", worker)], size);
    }
    render_trees(router, &mut exposition);
    exposition
        .family(
            "router_in_flight_requests",
            MetricType::Gauge,
            "Requests holding an admission permit.",
        )
        .sample(&[], router.in_flight());
    render_server(&router.config().server.stats, &mut exposition);
    render_fleet_guard(router, &mut exposition);
    #[cfg(feature = "tokens")]
    router.config().tokenizers.render(&mut exposition);
    #[cfg(feature = "kv-events")]
    if let Some(hub) = router.kv_events() {
        hub.render(&mut exposition);
    }
    for source in &router.config().metrics_sources {
        source.render(&mut exposition);
    }
    let mut response = Response::new(full(Bytes::from(out)));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(prom_text::CONTENT_TYPE),
    );
    response
}

/// How often each pool's fleet guard acted (`worker_lifecycle::FleetGuard`).
fn render_fleet_guard(router: &Router, exposition: &mut Exposition<'_>) {
    let mut pools = vec![router.pool()];
    if let Some(pd) = router.pd() {
        pools.extend([pd.prefill().pool(), pd.decode().pool()]);
    }
    let counts: Vec<_> = pools.iter().map(|p| (p.role(), p.fleet_counts())).collect();
    let mut family = exposition.family(
        "router_pool_panic_steps_total",
        MetricType::Counter,
        "Selections that found the pool below its panic threshold (every live worker seen).",
    );
    for (role, fleet) in &counts {
        family.sample(&[("role", role)], fleet.panic_steps);
    }
    let mut family = exposition.family(
        "router_pool_breaker_cap_steps_total",
        MetricType::Counter,
        "Selections in which the cap on breaker exclusions let refused workers through.",
    );
    for (role, fleet) in &counts {
        family.sample(&[("role", role)], fleet.capped_steps);
    }
}

/// The accept loop's counters (see [`crate::server`]).
fn render_server(stats: &crate::ServerStats, exposition: &mut Exposition<'_>) {
    let series: [(&str, MetricType, &str, u64); 5] = [
        (
            "router_connections_open",
            MetricType::Gauge,
            "Client connections being served.",
            stats.open_connections(),
        ),
        (
            "router_connections_accepted_total",
            MetricType::Counter,
            "Client connections accepted.",
            stats.accepted(),
        ),
        (
            "router_accept_errors_total",
            MetricType::Counter,
            "Failed accept calls (out of file descriptors and the like).",
            stats.accept_errors(),
        ),
        (
            "router_connections_at_limit_total",
            MetricType::Counter,
            "Times the accept loop waited because the connection cap was reached.",
            stats.at_limit(),
        ),
        (
            "router_header_read_timeouts_total",
            MetricType::Counter,
            "Connections closed because request headers did not arrive in time.",
            stats.header_timeouts(),
        ),
    ];
    for (name, kind, help, value) in series {
        exposition.family(name, kind, help).sample(&[], value);
    }
}

/// The engines' reports and the estimates the policies compare, per
/// worker (`router_worker_engine_load` and `router_worker_engine_waiting`
/// only for workers with a report).
fn render_engine_loads(workers: &[Arc<Worker>], exposition: &mut Exposition<'_>) {
    type Read = fn(&Worker) -> Option<usize>;
    let series: [(&str, &str, Read); 3] = [
        (
            "router_worker_estimated_load",
            "The load policies compare: own in-flight now plus the other routers' from the \
             engine's last report.",
            |w| Some(w.estimated_load()),
        ),
        (
            "router_worker_engine_load",
            "The engine's in-flight requests (running plus waiting) in the report that stands.",
            |w| w.engine_reported_load(),
        ),
        (
            "router_worker_engine_waiting",
            "The engine's waiting requests (queued, not yet scheduled; part of its load) in \
             the report that stands.",
            |w| w.engine_waiting(),
        ),
    ];
    for (name, help, read) in series {
        let mut family = exposition.family(name, MetricType::Gauge, help);
        for worker in workers {
            if let Some(value) = read(worker) {
                let labels: [Label<'_>; 3] = [
                    ("url", worker.endpoint()),
                    ("role", &worker.role().kind().as_str()),
                    ("generation", &worker.generation()),
                ];
                family.sample(&labels, value);
            }
        }
    }
}

/// A per-worker metric family: name, type, help, and how to read it.
type WorkerSeries = (&'static str, MetricType, &'static str, fn(&Worker) -> Value);

/// Per-worker series, read from the workers at scrape time.
pub(crate) fn render_workers(workers: &[Arc<Worker>], exposition: &mut Exposition<'_>) {
    let series: [WorkerSeries; 5] = [
        (
            "router_worker_load",
            MetricType::Gauge,
            "In-flight requests counted by the router.",
            |w| w.load().into(),
        ),
        (
            "router_worker_processed_total",
            MetricType::Counter,
            "Requests completed on the worker.",
            |w| w.processed().into(),
        ),
        (
            "router_worker_healthy",
            MetricType::Gauge,
            "1 when the last health checks passed.",
            |w| w.is_healthy().into(),
        ),
        (
            "router_worker_breaker_open",
            MetricType::Gauge,
            "1 when the circuit breaker is not closed.",
            |w| (w.breaker().state() != worker_lifecycle::BreakerState::Closed).into(),
        ),
        (
            "router_worker_load_underflows_total",
            MetricType::Counter,
            "Decrements clamped at zero (should stay 0).",
            |w| w.underflows().into(),
        ),
    ];
    for (name, kind, help, value) in series {
        let mut family = exposition.family(name, kind, help);
        for worker in workers {
            let labels: [Label<'_>; 3] = [
                ("url", worker.endpoint()),
                ("role", &worker.role().kind().as_str()),
                ("generation", &worker.generation()),
            ];
            family.sample(&labels, value(worker));
        }
    }
}

fn full(bytes: Bytes) -> BoxBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Empty;
    use lb_policies::RequestContext;

    /// A model id comes from the client, so it can hold anything: the writer
    /// escapes it in every series that carries it.
    #[tokio::test]
    async fn a_hostile_model_name_is_escaped_in_the_scrape() {
        let router = Router::new(crate::RouterConfig::default()).unwrap();
        router.add_worker("http://127.0.0.1:9", None, None).unwrap();
        let model = "evil\"} 1\nrouter_fake 1\\";
        let context = RequestContext::new(model).with_text("hello there");
        let decision = router.policies().select(&router.workers(), &context);
        assert!(decision.unwrap().is_some());

        let request = Request::get("/metrics")
            .body(Empty::<Bytes>::new())
            .unwrap();
        let response = router.handle(request).await;
        assert_eq!(response.status(), StatusCode::OK);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8(body.to_vec()).unwrap();

        let escaped = "model=\"evil\\\"} 1\\nrouter_fake 1\\\\\"";
        assert!(
            text.contains(&format!("router_cache_tree_size{{{escaped},worker=\"")),
            "{text}"
        );
        assert!(
            text.contains(&format!("router_policy_decisions_total{{{escaped},policy=")),
            "{text}"
        );
        assert!(
            !text.lines().any(|line| line.starts_with("router_fake")),
            "{text}"
        );
    }
}
