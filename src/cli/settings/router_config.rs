//! The mapping of the validated flags onto router-http's [`RouterConfig`]:
//! kept apart from the checks so that each setting's translation (units,
//! vllm-router's quirks) reads in one place.

use super::CliError;
use crate::cli::args::Args;
use router_http::{ConcurrencyConfig, RouterConfig};
use std::time::Duration;
use worker_lifecycle::{FailureRateWindow, FleetGuard, HealthCheckConfig, RetryPolicy};

pub(super) fn router_config(a: &Args) -> Result<RouterConfig, CliError> {
    let mut policy = lb_policies::PolicyConfig::named(a.policy.as_str());
    let cache = &mut policy.cache_aware;
    cache.cache_threshold = a.cache_threshold;
    cache.balance_abs_threshold = a.balance_abs_threshold;
    cache.balance_rel_threshold = a.balance_rel_threshold;
    cache.cost.load_weight = a.kv_aware_load_weight;
    cache.cost.eviction_weight = a.kv_aware_eviction_weight;
    cache.cost.overload_enter = a.kv_aware_overload_enter;
    cache.cost.overload_leave = a.kv_aware_overload_leave;
    cache.cost.temperature = a.router_temperature;
    cache.session_affinity_ttl =
        std::time::Duration::from_secs(a.kv_aware_session_affinity_ttl_secs);
    cache.cost.penalties = lb_policies::TierPenalties::new(
        a.kv_penalty_host,
        a.kv_penalty_disk,
        a.kv_penalty_external,
    );
    cache.eviction_interval = Duration::from_secs(a.eviction_interval_secs);
    cache.max_tree_size = a.max_tree_size;
    cache.max_tree_bytes = a.max_tree_bytes;
    cache.block_size = a.block_size;
    cache
        .validate()
        .map_err(|err| CliError::invalid("policy", err.to_string()))?;
    let mut config = RouterConfig {
        policy,
        ..RouterConfig::default()
    };
    config.eviction_interval = Duration::from_secs(a.eviction_interval_secs);
    config.max_models = a.max_routed_models;
    config.load_poll.interval =
        (a.load_poll_interval_ms > 0).then(|| Duration::from_millis(a.load_poll_interval_ms));
    config.load_poll.max_polls_per_sec = a.load_poll_budget;
    config.peers = router_http::PeerConfig {
        urls: a.router_peers.clone(),
        token: a.router_peer_token.clone(),
        batch_interval: Duration::from_millis(a.router_peer_batch_ms),
        ..router_http::PeerConfig::default()
    };
    config
        .peers
        .validate()
        .map_err(|err| CliError::invalid("router_peers", err))?;
    config.max_payload_size = a.max_payload_size;
    config.concurrency = ConcurrencyConfig {
        max_concurrent: a.max_concurrent_requests,
        queue_size: a.queue_size,
        queue_timeout: Duration::from_secs(a.queue_timeout_secs),
    };
    config.rate_limit_per_second = a.rate_limit_tokens_per_second;
    config.api_key = a.api_key.clone();
    config.admin_api_key = a.admin_api_key.clone();
    config.metrics_open = a.metrics_open;
    config.worker_networks = a
        .worker_networks
        .iter()
        .map(|block| {
            block
                .parse::<router_http::CidrBlock>()
                .map_err(|err| CliError::invalid("worker_networks", format!("`{block}`: {err}")))
        })
        .collect::<Result<_, _>>()?;
    if !a.request_id_headers.is_empty() {
        config.request_id_headers = a
            .request_id_headers
            .iter()
            .map(|h| h.to_ascii_lowercase())
            .collect();
    }
    config.request_timeout = Duration::from_secs(a.request_timeout_secs);
    config.request_body_timeout = Duration::from_secs(a.request_body_timeout_secs);
    config.passthrough_paths = a.passthrough_paths.clone();
    config.server.header_read_timeout =
        (a.header_read_timeout_secs > 0).then(|| Duration::from_secs(a.header_read_timeout_secs));
    config.server.max_connections = a.max_connections;
    config.retry = if a.disable_retries {
        RetryPolicy::no_retries()
    } else {
        RetryPolicy {
            max_retries: a.retry_max_retries,
            initial_backoff: Duration::from_millis(a.retry_initial_backoff_ms),
            multiplier: a.retry_backoff_multiplier,
            max_backoff: Duration::from_millis(a.retry_max_backoff_ms),
            jitter: a.retry_jitter_factor,
            ..RetryPolicy::default()
        }
    };
    let breaker = &mut config.worker_options.breaker;
    breaker.enabled = !a.disable_circuit_breaker;
    breaker.failure_threshold = a.cb_failure_threshold;
    breaker.success_threshold = a.cb_success_threshold;
    breaker.open_timeout = Duration::from_secs(a.cb_timeout_duration_secs);
    breaker.max_open_timeout = breaker.max_open_timeout.max(breaker.open_timeout);
    // vllm-router stores the window but never reads it; here a window that
    // differs from that default turns the failure-rate trigger on.
    breaker.failure_rate = (a.cb_window_duration_secs != Args::default().cb_window_duration_secs)
        .then(|| FailureRateWindow {
            window: Duration::from_secs(a.cb_window_duration_secs),
            ..FailureRateWindow::default()
        });
    config.worker_options.fleet = FleetGuard {
        max_breaker_exclusion: a.cb_max_exclusion,
        panic_threshold: a.pool_panic_threshold,
        min_workers: a.pool_guard_min_workers,
    };
    config.health = HealthCheckConfig {
        interval: Duration::from_secs(a.health_check_interval_secs),
        timeout: Duration::from_secs(a.health_check_timeout_secs),
        failure_threshold: a.health_failure_threshold,
        success_threshold: a.health_success_threshold,
        ..HealthCheckConfig::default()
    };
    config.health_endpoint = a.health_check_endpoint.clone();
    config.worker_startup_timeout = Duration::from_secs(a.worker_startup_timeout_secs);
    config.worker_startup_check_interval = Duration::from_secs(a.worker_startup_check_interval);
    config.shutdown_grace = Duration::from_secs(a.shutdown_grace_period_secs);
    Ok(config)
}
