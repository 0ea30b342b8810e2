//! Where each engine publishes its KV events, and what the KV index is for,
//! checked at start so that a typo in a flag or a `[workers."URL"]` table
//! stops the router rather than leaving a `kv_aware` policy without events.
//!
//! vllm-router's `kv_aware` flags (`--kv-event-source`,
//! `--kv-event-replay-source`, `--pd-kv-events`, `--kv-event-block-size`,
//! `--kv-event-model`) need a pool whose policy reads the index; each
//! `URL=ENDPOINT[,ENDPOINT...]` names a configured worker of the flag's
//! kind, once. A flag's endpoints replace the worker's table key they
//! correspond to (the command line's word is the last). With
//! `--intra-node-data-parallel-size D` above 1 a worker's list is one
//! endpoint (rank r at its port + r) or exactly D, one per rank: a rank
//! beyond the list would have no socket, so a list of another length is
//! refused here rather than leaving ranks cold at run time.

use super::CliError;
use super::checks::check_url;
use super::mode::Mode;
use super::parse::Parsed;
use crate::cli::args::{Args, PolicyName};
use router_http::kv_events::{KvEndpoints, KvEventsConfig};
use router_http::tokens::Tokenizers;
use std::collections::BTreeMap;

/// vllm-router's `kv_aware` flags: each needs a pool whose policy reads
/// the KV index.
const INDEX_FLAGS: [&str; 5] = [
    "kv_event_source",
    "kv_event_replay_source",
    "pd_kv_events",
    "kv_event_block_size",
    "kv_event_model",
];

/// Whether `policy` scores on the KV index (`kv_aware`, `kv_aware_gate`).
fn reads_index(policy: PolicyName) -> bool {
    lb_policies::INDEX_POLICIES.contains(&policy.as_str())
}

/// Which pools follow KV events: their policy reads the index.
#[derive(Clone, Copy, Debug)]
struct IndexPools {
    regular: bool,
    prefill: bool,
    decode: bool,
}

impl IndexPools {
    fn of(a: &Args) -> Self {
        if a.vllm_pd_disaggregation || a.sim_pd.is_some() {
            IndexPools {
                regular: false,
                prefill: reads_index(a.prefill_policy.unwrap_or(a.policy)),
                decode: reads_index(a.decode_policy.unwrap_or(a.policy)),
            }
        } else {
            IndexPools {
                regular: reads_index(a.policy),
                prefill: false,
                decode: false,
            }
        }
    }

    fn any(self) -> bool {
        self.regular || self.prefill || self.decode
    }
}

/// Refuses a `kv_aware` flag given while no pool reads the KV index.
pub(super) fn needs_index(parsed: &Parsed) -> Result<(), CliError> {
    if IndexPools::of(&parsed.args).any() {
        return Ok(());
    }
    match INDEX_FLAGS.iter().find(|id| parsed.is_explicit(id)) {
        Some(id) => Err(CliError::invalid(
            id,
            "needs a kv_aware policy (--policy kv_aware or kv_aware_gate; in P/D mode \
             --prefill-policy or --decode-policy): only kv_aware follows the engines' KV events",
        )),
        None => Ok(()),
    }
}

/// `--kv-event-block-size`: the same setting as `--block-size` (kv_aware
/// requires its tree's blocks and the index's to be one size), so it sets
/// it; both given with different values are refused naming both.
pub(super) fn block_size(parsed: &mut Parsed) -> Result<(), CliError> {
    let Some(size) = parsed.args.kv_event_block_size else {
        return Ok(());
    };
    if size == 0 {
        return Err(CliError::invalid(
            "kv_event_block_size",
            "must be at least 1",
        ));
    }
    let block_size = parsed.args.block_size;
    if parsed.is_explicit("block_size") && block_size != size {
        return Err(CliError::invalid(
            "kv_event_block_size",
            format!(
                "{size} contradicts --block-size {block_size}: both are the engines' KV block \
                 size (the KV index and kv_aware's tree count in the same blocks); give one, or \
                 the same value"
            ),
        ));
    }
    parsed.args.block_size = size;
    Ok(())
}

/// The workers configured on the command line (or in the file), by kind.
struct Fleet<'a> {
    regular: &'a [String],
    prefill: Vec<&'a str>,
    decode: &'a [String],
}

impl<'a> Fleet<'a> {
    fn of(mode: &'a Mode) -> Self {
        match mode {
            Mode::Workers { urls } => Fleet {
                regular: urls,
                prefill: Vec::new(),
                decode: &[],
            },
            Mode::PrefillDecode(pd) => Fleet {
                regular: &[],
                prefill: pd.prefill.iter().map(|(url, _)| url.as_str()).collect(),
                decode: &pd.decode,
            },
            _ => Fleet {
                regular: &[],
                prefill: Vec::new(),
                decode: &[],
            },
        }
    }

    fn is_regular(&self, url: &str) -> bool {
        self.regular.iter().any(|u| u == url)
    }

    fn is_prefill(&self, url: &str) -> bool {
        self.prefill.contains(&url)
    }

    fn is_decode(&self, url: &str) -> bool {
        self.decode.iter().any(|u| u == url)
    }

    fn is_pd(&self, url: &str) -> bool {
        self.is_prefill(url) || self.is_decode(url)
    }

    fn is_configured(&self, url: &str) -> bool {
        self.is_regular(url) || self.is_pd(url)
    }
}

/// Where a worker's list of endpoints came from, for an error that names it.
#[derive(Clone, Copy, Debug)]
enum Origin {
    /// Its `[workers."URL"]` table's key.
    Table(&'static str),
    /// A flag (its id).
    Flag(&'static str),
    /// The default port on the worker's host.
    Default,
}

impl Origin {
    fn error(self, url: &str, message: String) -> CliError {
        match self {
            Origin::Table(key) => {
                CliError::invalid("config", format!("[workers.\"{url}\"] {key}: {message}"))
            }
            Origin::Flag(id) => CliError::invalid(id, format!("{url}: {message}")),
            Origin::Default => CliError::invalid("kv_events_port", format!("{url}: {message}")),
        }
    }
}

/// One worker's endpoints as they are being merged.
struct Entry {
    publishers: Vec<String>,
    publishers_from: Origin,
    replays: Vec<String>,
    replays_from: Origin,
}

/// `text` as the workspace's one `tcp://HOST:PORT` parser (kv-events')
/// spells it.
fn endpoint(text: &str) -> Result<String, String> {
    text.parse::<kv_events::ZmqEndpoint>()
        .map(|endpoint| endpoint.to_string())
        .map_err(|err| format!("`{text}` is not a tcp://HOST:PORT address: {err}"))
}

/// A list of endpoints, each checked, none twice.
fn endpoint_list<'a>(texts: impl IntoIterator<Item = &'a str>) -> Result<Vec<String>, String> {
    let mut list: Vec<String> = Vec::new();
    for text in texts {
        let endpoint = endpoint(text)?;
        if list.contains(&endpoint) {
            return Err(format!(
                "{endpoint} is given twice (each data-parallel rank publishes on its own socket)"
            ));
        }
        list.push(endpoint);
    }
    if list.is_empty() {
        return Err("names no endpoint".to_owned());
    }
    Ok(list)
}

/// The values of the `URL=ENDPOINT[,ENDPOINT...]` flag `id`: each URL in its
/// canonical spelling, once, with its checked endpoints.
fn sources(parsed: &Parsed, id: &'static str) -> Result<BTreeMap<String, Vec<String>>, CliError> {
    let values = match id {
        "kv_event_source" => &parsed.args.kv_event_source,
        "kv_event_replay_source" => &parsed.args.kv_event_replay_source,
        _ => &parsed.args.pd_kv_events,
    };
    let mut sources = BTreeMap::new();
    for value in values {
        let Some((url, list)) = value.split_once('=') else {
            return Err(CliError::invalid(
                id,
                format!(
                    "`{value}` is not URL=ENDPOINT[,ENDPOINT...] (for instance \
                     http://10.0.0.5:8000=tcp://10.0.0.5:5557)"
                ),
            ));
        };
        let url = check_url(id, url).map_err(|err| match err {
            CliError::Invalid { flag, message } => CliError::Invalid {
                flag,
                message: format!("`{value}`: {message}"),
            },
            other => other,
        })?;
        let list = endpoint_list(list.split(','))
            .map_err(|message| CliError::invalid(id, format!("{url}: {message}")))?;
        if sources.insert(url.clone(), list).is_some() {
            return Err(CliError::invalid(id, format!("{url} is given twice")));
        }
    }
    Ok(sources)
}

/// Checks that `url` is a worker flag `id` may name: a configured worker
/// of its kind, in a pool that follows KV events.
fn check_kind(
    id: &'static str,
    url: &str,
    fleet: &Fleet<'_>,
    pools: IndexPools,
) -> Result<(), CliError> {
    let refuse = |message: String| Err(CliError::invalid(id, format!("{url} {message}")));
    let pd_roles_read =
        || (fleet.is_prefill(url) && pools.prefill) || (fleet.is_decode(url) && pools.decode);
    let pd_policy_hint = || {
        let role = if fleet.is_prefill(url) {
            "prefill"
        } else {
            "decode"
        };
        format!(
            "is a {role} worker whose pool does not follow KV events: its policy is not \
             kv_aware (set --{role}-policy kv_aware, or drop the flag)"
        )
    };
    match id {
        "kv_event_source" if fleet.is_regular(url) => Ok(()),
        "kv_event_source" if fleet.is_pd(url) => refuse(
            "is a P/D worker (--prefill / --decode): name its KV event endpoints with \
             --pd-kv-events"
                .to_owned(),
        ),
        "kv_event_source" => refuse(
            "is not a --worker-urls worker (workers added at run time take their endpoints \
             from [workers.\"URL\"] tables in the --config file)"
                .to_owned(),
        ),
        "pd_kv_events" if fleet.is_pd(url) && pd_roles_read() => Ok(()),
        "pd_kv_events" if fleet.is_pd(url) => refuse(pd_policy_hint()),
        "pd_kv_events" if fleet.is_regular(url) => refuse(
            "is a --worker-urls worker: name its KV event endpoints with --kv-event-source"
                .to_owned(),
        ),
        "pd_kv_events" => refuse(
            "is not a --prefill or --decode worker (workers discovered at run time take their \
             endpoints from their registration or from [workers.\"URL\"] tables in the \
             --config file)"
                .to_owned(),
        ),
        _ if fleet.is_regular(url) => Ok(()),
        _ if fleet.is_pd(url) && pd_roles_read() => Ok(()),
        _ if fleet.is_pd(url) => refuse(pd_policy_hint()),
        _ => refuse(
            "is not a configured worker (--worker-urls, --prefill or --decode; workers added \
             at run time take their endpoints from [workers.\"URL\"] tables in the --config \
             file)"
                .to_owned(),
        ),
    }
}

/// Where the engines publish their KV events: `--kv-events-*`, the config
/// file's `[workers."URL"]` tables and the `kv_aware` flags, and the model
/// the index is for (`--kv-event-model`, which needs a tokenizer in
/// `tokenizers`). Checked now: see the module docs.
pub(super) fn kv_events(
    parsed: &Parsed,
    mode: &Mode,
    tokenizers: &Tokenizers,
) -> Result<KvEventsConfig, CliError> {
    let a = &parsed.args;
    let mut config = KvEventsConfig::default();
    config.port = a.kv_events_port;
    config.replay_port = (a.kv_events_replay_port != 0).then_some(a.kv_events_replay_port);
    config.topic = a.kv_events_topic.clone();
    config.max_message_size = a.kv_events_max_message_size;
    config.max_blocks_per_worker = std::num::NonZeroUsize::new(a.kv_index_max_blocks_per_worker)
        .ok_or_else(|| CliError::invalid("kv_index_max_blocks_per_worker", "must be at least 1"))?;

    let mut entries: BTreeMap<String, Entry> = BTreeMap::new();
    for (url, worker) in &parsed.workers {
        let bad = |message: String| {
            CliError::invalid("config", format!("[workers.\"{url}\"]: {message}"))
        };
        let canonical =
            worker_lifecycle::WorkerUrl::parse_http(url).map_err(|err| bad(err.to_string()))?;
        let publishers =
            endpoint_list(worker.kv_events_endpoint.iter().map(String::as_str)).map_err(bad)?;
        let replays = if worker.kv_events_replay_endpoint.is_empty() {
            Vec::new()
        } else {
            endpoint_list(worker.kv_events_replay_endpoint.iter().map(String::as_str))
                .map_err(bad)?
        };
        entries.insert(
            canonical.as_str().to_owned(),
            Entry {
                publishers,
                publishers_from: Origin::Table("kv_events_endpoint"),
                replays,
                replays_from: Origin::Table("kv_events_replay_endpoint"),
            },
        );
    }

    let fleet = Fleet::of(mode);
    let pools = IndexPools::of(a);
    for id in ["kv_event_source", "pd_kv_events", "kv_event_replay_source"] {
        for (url, list) in sources(parsed, id)? {
            check_kind(id, &url, &fleet, pools)?;
            let replay = id == "kv_event_replay_source";
            let entry = entries.entry(url.clone()).or_insert_with(|| {
                // A replay source alone: the publisher stays at the
                // default port of the worker's host.
                let host = worker_lifecycle::WorkerUrl::parse_http(&url)
                    .map(|u| u.with_port(a.kv_events_port).host_port())
                    .unwrap_or_default();
                Entry {
                    publishers: vec![format!("tcp://{host}")],
                    publishers_from: Origin::Default,
                    replays: Vec::new(),
                    replays_from: Origin::Default,
                }
            });
            if replay {
                entry.replays = list;
                entry.replays_from = Origin::Flag(id);
            } else {
                entry.publishers = list;
                entry.publishers_from = Origin::Flag(id);
            }
        }
    }

    let ranks = a.intra_node_data_parallel_size as usize;
    for (url, entry) in entries {
        let (p, r) = (entry.publishers.len(), entry.replays.len());
        if fleet.is_configured(&url) && ranks > 1 {
            for (n, from, what) in [
                (p, entry.publishers_from, "publisher endpoints"),
                (r, entry.replays_from, "replay endpoints"),
            ] {
                if n > 1 && n != ranks {
                    return Err(from.error(
                        &url,
                        format!(
                            "{n} {what} for its {ranks} data-parallel ranks \
                             (--intra-node-data-parallel-size): give one (rank r at its port + r) \
                             or one per rank"
                        ),
                    ));
                }
            }
        }
        if p > 1 && r > 1 && p != r {
            return Err(entry.replays_from.error(
                &url,
                format!(
                    "{r} replay endpoints but {p} publishers: give one (rank r at its port + r), \
                     or one per rank for both"
                ),
            ));
        }
        config = config.with_endpoints(
            url,
            KvEndpoints::per_rank(entry.publishers).with_replays(entry.replays),
        );
    }

    if let Some(model) = &a.kv_event_model {
        if model.is_empty() {
            return Err(CliError::invalid("kv_event_model", "must name a model"));
        }
        if tokenizers.for_model(model).is_none() {
            return Err(CliError::invalid(
                "kv_event_model",
                format!(
                    "no tokenizer is configured for model {model:?}: kv_aware scores a request \
                     on the KV index by its token ids; give --tokenizer-path, or a \
                     [models.{model:?}] table in the --config file"
                ),
            ));
        }
        config.model = Some(model.clone());
    }
    Ok(config)
}
