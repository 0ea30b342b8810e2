//! Step 3's checks of single values: ranges, URLs, host names, header
//! names. Each names the flag at fault, so that an operator is told which
//! flag to fix rather than what failed further in.

use super::CliError;
use crate::cli::args::{Args, BackendName};
use std::collections::BTreeSet;

/// `host:port`, with brackets around an IPv6 host.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

pub(super) fn check_ranges(a: &Args) -> Result<(), CliError> {
    let fraction = |id: &str, value: f64| {
        if (0.0..=1.0).contains(&value) {
            Ok(())
        } else {
            Err(CliError::invalid(
                id,
                format!("must be between 0.0 and 1.0, got {value}"),
            ))
        }
    };
    let factor = |id: &str, value: f64| {
        if value.is_finite() && value >= 1.0 {
            Ok(())
        } else {
            Err(CliError::invalid(
                id,
                format!("must be a number >= 1.0, got {value}"),
            ))
        }
    };
    let positive = |id: &str, value: u64| {
        if value >= 1 {
            Ok(())
        } else {
            Err(CliError::invalid(id, "must be at least 1"))
        }
    };
    let non_negative = |id: &str, value: f64| {
        if value.is_finite() && value >= 0.0 {
            Ok(())
        } else {
            Err(CliError::invalid(
                id,
                format!("must be a finite number >= 0, got {value}"),
            ))
        }
    };
    non_negative("kv_aware_load_weight", a.kv_aware_load_weight)?;
    non_negative("kv_aware_eviction_weight", a.kv_aware_eviction_weight)?;
    non_negative("kv_aware_overload_enter", a.kv_aware_overload_enter)?;
    non_negative("kv_aware_overload_leave", a.kv_aware_overload_leave)?;
    non_negative("router_temperature", a.router_temperature)?;
    fraction("cache_threshold", a.cache_threshold)?;
    fraction("kv_penalty_host", a.kv_penalty_host)?;
    fraction("kv_penalty_disk", a.kv_penalty_disk)?;
    fraction("kv_penalty_external", a.kv_penalty_external)?;
    factor("balance_rel_threshold", a.balance_rel_threshold)?;
    fraction("retry_jitter_factor", a.retry_jitter_factor)?;
    factor("retry_backoff_multiplier", a.retry_backoff_multiplier)?;
    fraction("otel_sampling_ratio", a.otel_sampling_ratio)?;
    fraction("cb_max_exclusion", a.cb_max_exclusion)?;
    fraction("pool_panic_threshold", a.pool_panic_threshold)?;
    positive("eviction_interval_secs", a.eviction_interval_secs)?;
    positive("max_tree_size", a.max_tree_size as u64)?;
    positive("max_tree_bytes", a.max_tree_bytes)?;
    positive("max_routed_models", a.max_routed_models as u64)?;
    positive("block_size", a.block_size as u64)?;
    positive("max_payload_size", a.max_payload_size as u64)?;
    positive("request_timeout_secs", a.request_timeout_secs)?;
    positive("max_concurrent_requests", a.max_concurrent_requests as u64)?;
    positive("queue_timeout_secs", a.queue_timeout_secs)?;
    positive("request_body_timeout_secs", a.request_body_timeout_secs)?;
    positive("max_connections", a.max_connections as u64)?;
    positive("zmq_max_message_size", a.zmq_max_message_size as u64)?;
    positive(
        "kv_events_max_message_size",
        a.kv_events_max_message_size as u64,
    )?;
    if let Some(threads) = a.tokenizer_threads {
        positive("tokenizer_threads", threads as u64)?;
    }
    positive("tokenize_max_bytes", a.tokenize_max_bytes as u64)?;
    if !(a.tokenize_max_secs.is_finite()
        && a.tokenize_max_secs > 0.0
        && a.tokenize_max_secs <= 3600.0)
    {
        return Err(CliError::invalid(
            "tokenize_max_secs",
            format!(
                "must be a number of seconds above 0 and at most 3600, got {}",
                a.tokenize_max_secs
            ),
        ));
    }
    if let Some(path) = a
        .passthrough_paths
        .iter()
        .find(|path| !path.starts_with('/') || path.split('/').any(|s| s == "." || s == ".."))
    {
        return Err(CliError::invalid(
            "passthrough_paths",
            format!("`{path}`: a path starts with / and has no . or .. segments"),
        ));
    }
    positive("worker_startup_timeout_secs", a.worker_startup_timeout_secs)?;
    positive(
        "worker_startup_check_interval",
        a.worker_startup_check_interval,
    )?;
    positive("cb_failure_threshold", a.cb_failure_threshold.into())?;
    positive("cb_success_threshold", a.cb_success_threshold.into())?;
    positive("cb_timeout_duration_secs", a.cb_timeout_duration_secs)?;
    positive("cb_window_duration_secs", a.cb_window_duration_secs)?;
    positive(
        "health_failure_threshold",
        a.health_failure_threshold.into(),
    )?;
    positive(
        "health_success_threshold",
        a.health_success_threshold.into(),
    )?;
    positive("health_check_timeout_secs", a.health_check_timeout_secs)?;
    positive("health_check_interval_secs", a.health_check_interval_secs)?;
    positive("vllm_discovery_ttl_secs", a.vllm_discovery_ttl_secs)?;
    if !(1..=1024).contains(&a.intra_node_data_parallel_size) {
        return Err(CliError::invalid(
            "intra_node_data_parallel_size",
            format!(
                "must be between 1 and 1024, got {}",
                a.intra_node_data_parallel_size
            ),
        ));
    }
    if let Some(rate) = a.rate_limit_tokens_per_second
        && !(rate.is_finite() && rate > 0.0)
    {
        return Err(CliError::invalid(
            "rate_limit_tokens_per_second",
            format!("must be a positive number of requests per second, got {rate}"),
        ));
    }
    if !(a.sim_time_scale.is_finite() && a.sim_time_scale >= 0.0) {
        return Err(CliError::invalid(
            "sim_time_scale",
            format!("must be a number >= 0, got {}", a.sim_time_scale),
        ));
    }
    if a.sim_workers > 256 {
        return Err(CliError::invalid(
            "sim_workers",
            format!("at most 256 engines, got {}", a.sim_workers),
        ));
    }
    let endpoint = &a.health_check_endpoint;
    if !endpoint.starts_with('/') || endpoint.parse::<http::uri::PathAndQuery>().is_err() {
        return Err(CliError::invalid(
            "health_check_endpoint",
            format!("must be a path starting with `/`, got {endpoint:?}"),
        ));
    }
    for header in &a.request_id_headers {
        if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
            return Err(CliError::invalid(
                "request_id_headers",
                format!("{header:?} is not a valid header name"),
            ));
        }
    }
    for (id, host) in [("host", &a.host), ("prometheus_host", &a.prometheus_host)] {
        if host.is_empty() || host.contains('/') || host.contains(' ') {
            return Err(CliError::invalid(
                id,
                format!("{host:?} is not a host name or IP address"),
            ));
        }
    }
    if let Some(dir) = &a.log_dir
        && dir.is_empty()
    {
        return Err(CliError::invalid("log_dir", "must not be empty"));
    }
    match a.backend {
        BackendName::Vllm => {}
        other => {
            return Err(CliError::invalid(
                "backend",
                format!(
                    "{other:?} is not supported: this router fronts vLLM-style engines only (`vllm`)"
                ),
            ));
        }
    }
    Ok(())
}

/// A worker URL of flag `id` in its canonical spelling, or the flag's error
/// naming what is wrong with the URL.
pub(super) fn check_url(id: &str, url: &str) -> Result<String, CliError> {
    worker_lifecycle::WorkerUrl::parse_http(url)
        .map(|url| url.as_str().to_owned())
        .map_err(|err| CliError::invalid(id, err.to_string()))
}

pub(super) fn check_unique(id: &str, urls: &[String]) -> Result<(), CliError> {
    let mut seen = BTreeSet::new();
    for url in urls {
        if !seen.insert(url) {
            return Err(CliError::invalid(id, format!("{url} is given twice")));
        }
    }
    Ok(())
}

/// `HOST:PORT` with a non-empty host and a port number.
pub fn check_host_port(id: &str, value: &str) -> Result<(), CliError> {
    let bad = || CliError::invalid(id, format!("expected HOST:PORT, got {value:?}"));
    let (host, port) = value.rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host.contains('/') || port.parse::<u16>().is_err() {
        return Err(bad());
    }
    Ok(())
}
