//! Prometheus text exposition with vLLM's metric names.
//!
//! Gauges: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc` (and its older name
//! `vllm:gpu_cache_usage_perc`). Counters: `vllm:prefix_cache_queries_total`,
//! `vllm:prefix_cache_hits_total` (in tokens, as vLLM v1),
//! `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
//! `vllm:request_success_total`. Info: `vllm:cache_config_info` (its
//! `block_size` and `num_gpu_blocks` labels). engine-sim's own:
//! `engine_sim:kv_transfers_valid_total`, `engine_sim:kv_transfers_invalid_total`
//! (with a `reason` breakdown in `engine_sim:kv_transfers_invalid_by_reason_total`),
//! `engine_sim:kv_transfers_produced_total`, `engine_sim:kv_transfers_held`,
//! `engine_sim:faults_injected_total`, `engine_sim:server_load`.
//!
//! The two request gauges are the scheduler's running batch and waiting
//! queue at the instant of the scrape: the server advances the engine to
//! the present and reads its [`EngineStats`] under the engine's lock, so
//! a router polling `/metrics` for an engine's load (running plus
//! waiting) reads what the scheduler holds then (tests/load_gauges.rs).
//!
//! The text is written with [`prom_text`], the workspace's one writer of
//! the format (a leaf crate with no dependencies, so engine-sim still
//! depends on no router crate): it escapes the model name and engine id.

use prom_text::{Exposition, Label, MetricType, Value};

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
    use MetricType::{Counter, Gauge};
    let series: [(&str, MetricType, &str, Value); 15] = [
        (
            "vllm:num_requests_running",
            Gauge,
            "Number of requests in model execution batches.",
            stats.running.into(),
        ),
        (
            "vllm:num_requests_waiting",
            Gauge,
            "Number of requests waiting to be processed.",
            stats.waiting.into(),
        ),
        (
            "vllm:kv_cache_usage_perc",
            Gauge,
            "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_cache_usage.into(),
        ),
        (
            "vllm:gpu_cache_usage_perc",
            Gauge,
            "GPU KV-cache usage (older name of vllm:kv_cache_usage_perc).",
            stats.kv_cache_usage.into(),
        ),
        (
            "vllm:prefix_cache_queries_total",
            Counter,
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries.into(),
        ),
        (
            "vllm:prefix_cache_hits_total",
            Counter,
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits.into(),
        ),
        (
            "vllm:prompt_tokens_total",
            Counter,
            "Number of prefill tokens processed.",
            stats.prompt_tokens.into(),
        ),
        (
            "vllm:generation_tokens_total",
            Counter,
            "Number of generation tokens processed.",
            stats.generation_tokens.into(),
        ),
        (
            "vllm:request_success_total",
            Counter,
            "Count of successfully processed requests.",
            stats.requests_finished.into(),
        ),
        (
            "engine_sim:kv_transfers_produced_total",
            Counter,
            "KV transfers this prefill engine produced.",
            stats.kv_transfers_produced.into(),
        ),
        (
            "engine_sim:kv_transfers_held",
            Gauge,
            "KV transfers this prefill engine still keeps blocks for.",
            stats.kv_transfers_held.into(),
        ),
        (
            "engine_sim:kv_transfers_valid_total",
            Counter,
            "Decode requests whose kv_transfer_params matched a produced transfer.",
            stats.kv_transfers_valid.into(),
        ),
        (
            "engine_sim:kv_transfers_invalid_total",
            Counter,
            "Decode requests whose kv_transfer_params were missing, malformed or forged.",
            stats.kv_transfers_invalid_total().into(),
        ),
        (
            "engine_sim:faults_injected_total",
            Counter,
            "Faults this engine injected.",
            server.faults_injected.into(),
        ),
        (
            "engine_sim:server_load",
            Gauge,
            "In-flight generation requests (what /load reports).",
            server.server_load.into(),
        ),
    ];
    let mut out = String::with_capacity(4096);
    let mut exposition = Exposition::new(&mut out);
    let engine: Label<'_> = ("engine", &"0");
    let model: Label<'_> = ("model_name", &model);
    for (name, kind, help, value) in series {
        exposition
            .family(name, kind, help)
            .sample(&[engine, model], value);
    }
    let mut family = exposition.family(
        "engine_sim:kv_transfers_invalid_by_reason_total",
        Counter,
        "Invalid KV transfers by reason.",
    );
    for (reason, count) in &stats.kv_transfers_invalid {
        family.sample(&[engine, model, ("reason", reason)], *count);
    }
    // vLLM's info gauge of its cache configuration: the labels carry the
    // values (a router reads `num_gpu_blocks` to bound its block index).
    exposition
        .family(
            "vllm:cache_config_info",
            Gauge,
            "Information of the LLMEngine CacheConfig.",
        )
        .sample(
            &[
                ("block_size", &stats.block_size),
                ("num_gpu_blocks", &stats.num_gpu_blocks),
                engine,
            ],
            1u64,
        );
    exposition
        .family("engine_sim:info", Gauge, "Engine identity.")
        .sample(&[engine, model, ("engine_id", &engine_id)], 1u64);
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_name_and_engine_id_are_escaped_by_the_writer() {
        let stats = EngineStats {
            running: 2,
            ..EngineStats::default()
        };
        let text = render(
            "org/\"odd\"\\model\nx",
            "id\n1",
            &stats,
            ServerCounters::default(),
        );
        let labels = "engine=\"0\",model_name=\"org/\\\"odd\\\"\\\\model\\nx\"";
        assert!(
            text.contains(&format!("vllm:num_requests_running{{{labels}}} 2\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "engine_sim:info{{{labels},engine_id=\"id\\n1\"}} 1\n"
            )),
            "{text}"
        );
        // Every line is a comment or one sample: nothing broke out of a label.
        assert!(
            text.lines()
                .all(|l| l.starts_with('#') || l.ends_with(['0', '1', '2']))
        );
        assert_eq!(sample(&text, "vllm:num_requests_running"), Some(2.0));
        // The cache configuration, with its values in labels as vLLM has it.
        assert!(
            text.contains(
                "vllm:cache_config_info{block_size=\"0\",num_gpu_blocks=\"0\",engine=\"0\"} 1\n"
            ),
            "{text}"
        );
    }
}
