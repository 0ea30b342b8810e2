//! Where each engine publishes its KV events, checked at start so that a
//! typo in a `[workers."URL"]` table stops the router rather than leaving a
//! `kv_aware` policy without events.

use super::CliError;
use super::parse::Parsed;
use router_http::kv_events::{KvEndpoints, KvEventsConfig};

/// Where the engines publish their KV events: `--kv-events-*` and the
/// config file's `[workers."URL"]` tables (checked now: a URL that is not a
/// worker URL, or an endpoint that is not `tcp://HOST:PORT`, stops the
/// start naming it).
pub(super) fn kv_events(parsed: &Parsed) -> Result<KvEventsConfig, CliError> {
    let a = &parsed.args;
    let mut config = KvEventsConfig::default();
    config.port = a.kv_events_port;
    config.replay_port = (a.kv_events_replay_port != 0).then_some(a.kv_events_replay_port);
    config.topic = a.kv_events_topic.clone();
    config.max_message_size = a.kv_events_max_message_size;
    config.max_blocks_per_worker = std::num::NonZeroUsize::new(a.kv_index_max_blocks_per_worker)
        .ok_or_else(|| CliError::invalid("kv_index_max_blocks_per_worker", "must be at least 1"))?;
    for (url, worker) in &parsed.workers {
        let bad = |message: String| {
            CliError::invalid("config", format!("[workers.\"{url}\"]: {message}"))
        };
        let canonical =
            worker_lifecycle::WorkerUrl::parse_http(url).map_err(|err| bad(err.to_string()))?;
        // The one tcp://HOST:PORT check of the workspace (kv-events').
        let endpoint = |text: &str| -> Result<String, CliError> {
            text.parse::<kv_events::ZmqEndpoint>()
                .map(|endpoint| endpoint.to_string())
                .map_err(|err| bad(format!("`{text}` is not a tcp://HOST:PORT address: {err}")))
        };
        let endpoints = KvEndpoints {
            endpoint: endpoint(&worker.kv_events_endpoint)?,
            replay_endpoint: worker
                .kv_events_replay_endpoint
                .as_deref()
                .map(endpoint)
                .transpose()?,
        };
        config = config.with_endpoints(canonical.as_str(), endpoints);
    }
    Ok(config)
}
