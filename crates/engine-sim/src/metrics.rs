//! Prometheus text exposition with vLLM's metric names.
//!
//! Gauges: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc` (and its older name
//! `vllm:gpu_cache_usage_perc`). Counters: `vllm:prefix_cache_queries_total`,
//! `vllm:prefix_cache_hits_total` (in tokens, as vLLM v1),
//! `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
//! `vllm:request_success_total`. engine-sim's own:
//! `engine_sim:kv_transfers_valid_total`, `engine_sim:kv_transfers_invalid_total`
//! (with a `reason` breakdown in `engine_sim:kv_transfers_invalid_by_reason_total`),
//! `engine_sim:kv_transfers_produced_total`, `engine_sim:kv_transfers_held`,
//! `engine_sim:faults_injected_total`, `engine_sim:server_load`.

use std::fmt::Write;

use crate::engine::EngineStats;

/// Server-side numbers that the engine model does not know.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerCounters {
    /// In-flight generation requests (vLLM's `server_load`).
    pub server_load: u64,
    /// Faults injected so far.
    pub faults_injected: u64,
}

/// Renders the metrics for one engine.
pub fn render(model: &str, engine_id: &str, stats: &EngineStats, server: ServerCounters) -> String {
    let labels = format!("engine=\"0\",model_name=\"{}\"", escape(model));
    let mut out = String::with_capacity(2048);
    let mut metric = |name: &str, kind: &str, help: &str, value: String| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let _ = writeln!(out, "{name}{{{labels}}} {value}");
    };
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        stats.running.to_string(),
    );
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        stats.waiting.to_string(),
    );
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        format!("{}", stats.kv_cache_usage),
    );
    metric(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "GPU KV-cache usage (older name of vllm:kv_cache_usage_perc).",
        format!("{}", stats.kv_cache_usage),
    );
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        stats.prefix_cache_queries.to_string(),
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        stats.prefix_cache_hits.to_string(),
    );
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        stats.prompt_tokens.to_string(),
    );
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        stats.generation_tokens.to_string(),
    );
    metric(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        stats.requests_finished.to_string(),
    );
    metric(
        "engine_sim:kv_transfers_produced_total",
        "counter",
        "KV transfers this prefill engine produced.",
        stats.kv_transfers_produced.to_string(),
    );
    metric(
        "engine_sim:kv_transfers_held",
        "gauge",
        "KV transfers this prefill engine still keeps blocks for.",
        stats.kv_transfers_held.to_string(),
    );
    metric(
        "engine_sim:kv_transfers_valid_total",
        "counter",
        "Decode requests whose kv_transfer_params matched a produced transfer.",
        stats.kv_transfers_valid.to_string(),
    );
    metric(
        "engine_sim:kv_transfers_invalid_total",
        "counter",
        "Decode requests whose kv_transfer_params were missing, malformed or forged.",
        stats.kv_transfers_invalid_total().to_string(),
    );
    metric(
        "engine_sim:faults_injected_total",
        "counter",
        "Faults this engine injected.",
        server.faults_injected.to_string(),
    );
    metric(
        "engine_sim:server_load",
        "gauge",
        "In-flight generation requests (what /load reports).",
        server.server_load.to_string(),
    );
    let _ = writeln!(
        out,
        "# HELP engine_sim:kv_transfers_invalid_by_reason_total Invalid KV transfers by reason."
    );
    let _ = writeln!(
        out,
        "# TYPE engine_sim:kv_transfers_invalid_by_reason_total counter"
    );
    for (reason, count) in &stats.kv_transfers_invalid {
        let _ = writeln!(
            out,
            "engine_sim:kv_transfers_invalid_by_reason_total{{{labels},reason=\"{reason}\"}} {count}"
        );
    }
    let _ = writeln!(out, "# HELP engine_sim:info Engine identity.");
    let _ = writeln!(out, "# TYPE engine_sim:info gauge");
    let _ = writeln!(
        out,
        "engine_sim:info{{{labels},engine_id=\"{}\"}} 1",
        escape(engine_id)
    );
    out
}

fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Reads one sample (`name{...} value`, first match) from exposition text;
/// handy in tests and for scraping engine-sim from a router.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
}
