//! From a command line (and a `--config` file) to validated settings and a
//! [`RouterConfig`].
//!
//! Parsing happens in three steps, each with one kind of error:
//!
//! 1. clap parses the flags (unknown flags, unparsable numbers, values not
//!    in a list: clap's own message, exit 2);
//! 2. a `--config` file fills every setting the command line did not give
//!    (unknown keys and wrong types name the key, exit 2);
//! 3. [`Settings::from_parsed`] checks ranges, URLs and combinations and
//!    names the flag at fault (exit 2).

use super::args::{Args, BackendName, ContentFormatName, PolicyName, long_flag};
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use pd_orchestrator::PdConnector;
use prompt_tokens::PromptTokenizer;
use router_http::kv_events::{KvEndpoints, KvEventsConfig};
use router_http::tokens::{TokenizeConfig, Tokenizers};
use router_http::{ConcurrencyConfig, RouterConfig};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use worker_lifecycle::{FailureRateWindow, FleetGuard, HealthCheckConfig, RetryPolicy};

/// A command line the router refuses.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliError {
    /// clap refused the flags, or `--help` / `--version` was asked for
    /// (clap renders the message and picks the exit code).
    #[error("{0}")]
    Clap(#[from] clap::Error),
    /// A flag's value or a combination of flags is invalid.
    #[error("{flag}: {message}")]
    Invalid {
        /// The flag at fault, as `--kebab-case`.
        flag: String,
        /// What is wrong with it.
        message: String,
    },
}

impl CliError {
    fn invalid(flag: &str, message: impl Into<String>) -> Self {
        Self::Invalid {
            flag: long_flag(flag),
            message: message.into(),
        }
    }

    /// The process exit code: 0 for `--help` and `--version`, 2 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Clap(err) => err.exit_code(),
            Self::Invalid { .. } => 2,
        }
    }

    /// Prints the error (or the help text) the way clap does.
    pub fn print(&self) {
        match self {
            Self::Clap(err) => {
                let _ = err.print();
            }
            Self::Invalid { .. } => eprintln!("error: {self}"),
        }
    }
}

/// The flags after parsing and after merging the `--config` file, with the
/// set of settings given explicitly (on the command line or in the file).
#[derive(Debug, Clone)]
pub struct Parsed {
    /// The settings.
    pub args: Args,
    /// Ids (field names) of the settings given explicitly.
    pub explicit: BTreeSet<String>,
    /// The config file's `[models."ID"]` tables: a tokenizer per model.
    pub models: BTreeMap<String, ModelTokenizer>,
    /// The config file's `[workers."URL"]` tables: per-worker settings.
    pub workers: BTreeMap<String, WorkerSettings>,
}

/// One `[workers."URL"]` table of a `--config` file: where that worker
/// publishes its KV events, when not at `--kv-events-port` /
/// `--kv-events-replay-port` of its host.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSettings {
    /// The publisher, e.g. `tcp://10.0.0.5:6000`.
    #[serde(alias = "kv-events-endpoint")]
    pub kv_events_endpoint: String,
    /// The replay socket (none: no replay).
    #[serde(default, alias = "kv-events-replay-endpoint")]
    pub kv_events_replay_endpoint: Option<String>,
}

/// One `[models."ID"]` table of a `--config` file: the tokenizer requests
/// naming that model route with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelTokenizer {
    /// As `--tokenizer-path`: a model directory or a tokenizer.json file.
    #[serde(alias = "tokenizer-path")]
    pub tokenizer_path: String,
    /// As `--chat-template`.
    #[serde(default, alias = "chat-template")]
    pub chat_template: Option<String>,
    /// As `--chat-template-content-format`; unset: the command line's.
    #[serde(default, alias = "chat-template-content-format")]
    pub chat_template_content_format: Option<ContentFormatName>,
}

impl Parsed {
    /// Whether the setting `id` was given explicitly.
    pub fn is_explicit(&self, id: &str) -> bool {
        self.explicit.contains(id)
    }
}

/// Parses `argv` (program name first) and merges the `--config` file.
pub fn parse_from<I, T>(argv: I) -> Result<Parsed, CliError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let matches = Args::command().try_get_matches_from(argv)?;
    let args = Args::from_arg_matches(&matches)?;
    let explicit: BTreeSet<String> = matches
        .ids()
        .filter(|id| {
            matches!(
                matches.value_source(id.as_str()),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        })
        .map(|id| id.as_str().to_owned())
        .collect();
    let mut parsed = Parsed {
        args,
        explicit,
        models: BTreeMap::new(),
        workers: BTreeMap::new(),
    };
    if let Some(path) = parsed.args.config.clone() {
        let text = std::fs::read_to_string(&path)
            .map_err(|err| CliError::invalid("config", format!("cannot read {path}: {err}")))?;
        merge_file(&mut parsed, &text)
            .map_err(|message| CliError::invalid("config", format!("{path}: {message}")))?;
    }
    Ok(parsed)
}

/// Fills every setting of `parsed` not given on the command line from the
/// TOML `text`. A file key counts as given explicitly when its value
/// differs from the default.
fn merge_file(parsed: &mut Parsed, text: &str) -> Result<(), String> {
    let file: toml::Table = text
        .parse()
        .map_err(|err: toml::de::Error| err.to_string())?;
    let known = super::args::flag_ids();
    let mut merged = toml::Table::try_from(&parsed.args).map_err(|err| err.to_string())?;
    for (key, value) in file {
        let id = key.replace('-', "_");
        if id == "models" {
            parsed.models = tables_of("models", value)?;
            continue;
        }
        if id == "workers" {
            parsed.workers = tables_of("workers", value)?;
            continue;
        }
        if id == "config" || !known.contains(&id) {
            return Err(format!("unknown setting `{key}`"));
        }
        if parsed.explicit.contains(&id) {
            continue;
        }
        // A key that only restates the default (a dumped configuration
        // does) selects nothing: it neither switches modes nor counts as a
        // P/D or ignored flag.
        if merged.get(&id) != Some(&value) {
            parsed.explicit.insert(id.clone());
        }
        merged.insert(id, value);
    }
    let config = parsed.args.config.take();
    let mut args: Args = match toml::Value::Table(merged.clone()).try_into() {
        Ok(args) => args,
        Err(err) => return Err(name_the_bad_key(&parsed.args, &merged, &err)),
    };
    args.config = config;
    parsed.args = args;
    Ok(())
}

/// Reads a `[section."ID"]` group of tables, each on its own so that an
/// error names the table and, where one key alone is at fault, the key.
fn tables_of<T: serde::de::DeserializeOwned>(
    section: &str,
    value: toml::Value,
) -> Result<BTreeMap<String, T>, String> {
    let toml::Value::Table(tables) = value else {
        return Err(format!("[{section}]: expected tables, one per ID"));
    };
    let mut read = BTreeMap::new();
    for (id, table) in tables {
        match table.clone().try_into::<T>() {
            Ok(entry) => {
                read.insert(id, entry);
            }
            Err(err) => {
                let fault = the_faulty_key::<T>(&table).unwrap_or_else(|| err.message().to_owned());
                return Err(format!("[{section}.{id:?}]: {fault}"));
            }
        }
    }
    Ok(read)
}

/// The first key of `table` whose value alone fails to deserialize as a
/// `T`, with the reason; a missing required key is not such a fault.
fn the_faulty_key<T: serde::de::DeserializeOwned>(table: &toml::Value) -> Option<String> {
    let toml::Value::Table(table) = table else {
        return None;
    };
    table.iter().find_map(|(key, value)| {
        let single = toml::Table::from_iter([(key.clone(), value.clone())]);
        let err = toml::Value::Table(single).try_into::<T>().err()?;
        let message = err.message();
        (!message.starts_with("missing field")).then(|| format!("`{key}`: {message}"))
    })
}

/// Finds which key of a merged table fails to deserialize, for a message
/// that names it.
fn name_the_bad_key(defaults: &Args, merged: &toml::Table, err: &toml::de::Error) -> String {
    let base = toml::Table::try_from(defaults).unwrap_or_default();
    for (key, value) in merged {
        if base.get(key) == Some(value) {
            continue;
        }
        let mut single = base.clone();
        single.insert(key.clone(), value.clone());
        if let Err(err) = toml::Value::Table(single).try_into::<Args>() {
            return format!("setting `{key}`: {}", err.message());
        }
    }
    err.message().to_owned()
}

/// Renders `args` as a `--config` file.
pub fn to_toml(args: &Args) -> String {
    toml::to_string(args).unwrap_or_default()
}

/// Where the workers come from.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Mode {
    /// No arguments at all, or `--sim-workers N`: start this many engine-sim
    /// engines in-process.
    Simulated {
        /// Engines to start (0: none).
        engines: usize,
    },
    /// `--sim-pd P:D`: simulated prefill and decode engines.
    SimulatedPd {
        /// Prefill engines.
        prefill: usize,
        /// Decode engines.
        decode: usize,
    },
    /// `--worker-urls`: real engines. None (an empty fleet, workers added
    /// later through `POST /add_worker`) for `--worker-urls` without a URL
    /// and for any command line without a worker source that does not ask
    /// for simulated engines.
    Workers {
        /// The URLs, validated.
        urls: Vec<String>,
    },
    /// `--vllm-pd-disaggregation`.
    PrefillDecode(PdSettings),
    /// `--service-discovery`: workers are Kubernetes pods.
    Kubernetes(super::kubernetes::KubernetesSettings),
}

/// The P/D settings, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct PdSettings {
    /// Prefill engines with their optional bootstrap port.
    pub prefill: Vec<(String, Option<u16>)>,
    /// Decode engines.
    pub decode: Vec<String>,
    /// Policy of the prefill engines.
    pub prefill_policy: PolicyName,
    /// Policy of the decode engines.
    pub decode_policy: PolicyName,
    /// The KV connector.
    pub kv_connector: PdConnector,
    /// The ZMQ discovery address, if any.
    pub discovery: Option<String>,
}

/// Everything the router starts from, validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The settings as given (after the file merge).
    pub args: Args,
    /// Where the workers come from.
    pub mode: Mode,
    /// The router's configuration.
    pub router: RouterConfig,
    /// Settings given explicitly that have no effect in this router, as flags.
    pub ignored: Vec<String>,
}

const PD_FLAGS: [&str; 7] = [
    "vllm_discovery_ttl_secs",
    "prefill",
    "decode",
    "prefill_policy",
    "decode_policy",
    "kv_connector",
    "vllm_discovery_address",
];

const KUBERNETES_FLAGS: [&str; 5] = [
    "selector",
    "prefill_selector",
    "decode_selector",
    "service_discovery_port",
    "service_discovery_namespace",
];

const IGNORED_FLAGS: [&str; 4] = [
    "cors_allowed_origins",
    "otel_sampling_ratio",
    "otel_excluded_paths",
    "backend",
];

/// vllm-router's flags that ask for something this router does not do, and
/// where accepting them silently would mislead: an operator who passes
/// `--enable-trace` expects spans in their collector.
const REFUSED_FLAGS: [(&str, &str); 2] = [
    (
        "enable_trace",
        "OpenTelemetry trace export is not built into affinity-router; remove the flag. \
         Request ids are forwarded to the worker and returned to the client, and /metrics \
         carries the latency histograms (docs/operations.md, \"Tracing\")",
    ),
    (
        "otlp_traces_endpoint",
        "OpenTelemetry trace export is not built into affinity-router (see --enable-trace); \
         remove the flag",
    ),
];

fn refuse_unsupported(parsed: &Parsed) -> Result<(), CliError> {
    match REFUSED_FLAGS.iter().find(|(id, _)| parsed.is_explicit(id)) {
        Some((id, why)) => Err(CliError::invalid(id, *why)),
        None => Ok(()),
    }
}

impl Settings {
    /// Parses `argv` (program name first), merges `--config`, validates.
    pub fn from_args<I, T>(argv: I) -> Result<Self, CliError>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        Self::from_parsed(parse_from(argv)?)
    }

    /// Validates parsed settings and builds the router configuration.
    pub fn from_parsed(parsed: Parsed) -> Result<Self, CliError> {
        let args = &parsed.args;
        refuse_unsupported(&parsed)?;
        check_ranges(args)?;
        let mode = mode(&parsed)?;
        let mut router = router_config(args)?;
        router.tokenizers = tokenizers(&parsed, &mode)?;
        router.tokenize = tokenize_config(args);
        router.kv_events = kv_events(&parsed)?;
        let mut ignored: Vec<String> = IGNORED_FLAGS
            .iter()
            .filter(|id| parsed.is_explicit(id))
            .map(|id| long_flag(id))
            .collect();
        ignored.extend(
            KUBERNETES_FLAGS
                .iter()
                .filter(|id| !args.service_discovery && parsed.is_explicit(id))
                .map(|id| long_flag(id)),
        );
        Ok(Settings {
            args: parsed.args,
            mode,
            router,
            ignored,
        })
    }

    /// The address the router binds, `host:port`.
    pub fn bind_address(&self) -> String {
        join_host_port(&self.args.host, self.args.port)
    }

    /// The settings as one log line, secrets shown only as `set`.
    pub fn summary(&self) -> String {
        let a = &self.args;
        let secret = |value: &Option<String>| if value.is_some() { "set" } else { "unset" };
        let mode = match &self.mode {
            Mode::Simulated { engines } => format!("simulated ({engines} engine-sim engines)"),
            Mode::SimulatedPd { prefill, decode } => {
                format!("simulated P/D ({prefill} prefill, {decode} decode)")
            }
            Mode::Workers { urls } => format!("workers {urls:?}"),
            Mode::PrefillDecode(pd) => format!(
                "P/D prefill {:?} decode {:?} discovery {:?} connector {}",
                pd.prefill, pd.decode, pd.discovery, pd.kv_connector
            ),
            Mode::Kubernetes(k8s) => super::kubernetes::describe(&k8s.discovery),
        };
        format!(
            "bind={} mode={mode} policy={} cache_threshold={} balance_abs={} balance_rel={} \
             dp_size={} max_payload={} max_concurrent={} queue={}/{}s rate_limit={:?} \
             request_timeout={}s retries={} breaker={} health=GET {} every {}s api_key={} \
             admin_api_key={} prometheus={} grace={}s",
            self.bind_address(),
            a.policy.as_str(),
            a.cache_threshold,
            a.balance_abs_threshold,
            a.balance_rel_threshold,
            a.intra_node_data_parallel_size,
            a.max_payload_size,
            a.max_concurrent_requests,
            a.queue_size,
            a.queue_timeout_secs,
            a.rate_limit_tokens_per_second,
            a.request_timeout_secs,
            if a.disable_retries {
                "off".to_owned()
            } else {
                a.retry_max_retries.to_string()
            },
            if a.disable_circuit_breaker {
                "off"
            } else {
                "on"
            },
            a.health_check_endpoint,
            a.health_check_interval_secs,
            secret(&a.api_key),
            secret(&a.admin_api_key),
            join_host_port(&a.prometheus_host, a.prometheus_port),
            a.shutdown_grace_period_secs,
        )
    }
}

/// Where the engines publish their KV events: `--kv-events-*` and the
/// config file's `[workers."URL"]` tables (checked now: a URL that is not a
/// worker URL, or an endpoint that is not `tcp://HOST:PORT`, stops the
/// start naming it).
fn kv_events(parsed: &Parsed) -> Result<KvEventsConfig, CliError> {
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
        let endpoint = |text: &str| -> Result<String, CliError> {
            let valid = text
                .strip_prefix("tcp://")
                .and_then(|rest| rest.rsplit_once(':'))
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if valid {
                Ok(text.to_owned())
            } else {
                Err(bad(format!("`{text}` is not a tcp://HOST:PORT address")))
            }
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

/// The tokenizers of `--tokenizer-path` / `--chat-template` and the config
/// file's `[models."ID"]` tables, loaded now so that a bad path stops the
/// start with a message naming it. Simulated engines without a
/// `--tokenizer-path` get their own synthetic tokenizer, so the demo routes
/// on the same token ids its engines compute.
fn tokenizers(parsed: &Parsed, mode: &Mode) -> Result<Tokenizers, CliError> {
    let a = &parsed.args;
    let load = |flag: &str, path: &str, template: Option<&str>, format: ContentFormatName| {
        let options = prompt_tokens::TokenizerOptions {
            content_format: format.format(),
            ..prompt_tokens::TokenizerOptions::default()
        };
        PromptTokenizer::from_path_with(Path::new(path), template.map(Path::new), options)
            .map(Arc::new)
            .map_err(|err| {
                // Name the file at fault: the template's problems are
                // --chat-template's.
                let template_at_fault = match (&err, template) {
                    (
                        prompt_tokens::Error::TemplateSyntax(_)
                        | prompt_tokens::Error::TemplateTooLarge { .. },
                        Some(_),
                    ) => true,
                    (
                        prompt_tokens::Error::MissingFile { path }
                        | prompt_tokens::Error::Io { path, .. },
                        Some(template),
                    ) => path == Path::new(template),
                    _ => false,
                };
                let flag = if template_at_fault && flag != "config" {
                    "chat_template"
                } else {
                    flag
                };
                CliError::invalid(flag, err.to_string())
            })
    };
    if a.tokenizer_path.is_none()
        && parsed.models.is_empty()
        && a.chat_template_content_format != ContentFormatName::Auto
    {
        return Err(CliError::invalid(
            "chat_template_content_format",
            "needs --tokenizer-path or [models.\"ID\"] tables (the chat template it applies to)",
        ));
    }
    let mut tokenizers = Tokenizers::default();
    for (model, files) in &parsed.models {
        let tokenizer = load(
            "config",
            &files.tokenizer_path,
            files.chat_template.as_deref(),
            files
                .chat_template_content_format
                .unwrap_or(a.chat_template_content_format),
        )
        .map_err(|err| match err {
            CliError::Invalid { flag, message } => CliError::Invalid {
                flag,
                message: format!("[models.{model:?}]: {message}"),
            },
            other => other,
        })?;
        tokenizers = tokenizers.with_model(model.clone(), tokenizer);
    }
    match (&a.tokenizer_path, &a.chat_template) {
        (Some(path), template) => {
            let tokenizer = load(
                "tokenizer_path",
                path,
                template.as_deref(),
                a.chat_template_content_format,
            )?;
            tokenizers = tokenizers.with_default(tokenizer);
        }
        (None, Some(_)) => {
            return Err(CliError::invalid(
                "chat_template",
                "needs --tokenizer-path (the tokenizer the rendering is tokenized with)",
            ));
        }
        (None, None) if matches!(mode, Mode::Simulated { .. } | Mode::SimulatedPd { .. }) => {
            let chars_per_token = engine_sim::ModelConfig::default().chars_per_token;
            tokenizers =
                tokenizers.with_default(Arc::new(PromptTokenizer::synthetic(chars_per_token)));
        }
        (None, None) => {}
    }
    Ok(tokenizers)
}

/// The tokenizer pool and the budget of one prompt
/// (`--tokenizer-threads`, `--tokenize-*`), checked in `check_ranges`.
fn tokenize_config(a: &Args) -> TokenizeConfig {
    let defaults = TokenizeConfig::default();
    TokenizeConfig {
        threads: a.tokenizer_threads.unwrap_or(defaults.threads),
        max_bytes: a.tokenize_max_bytes,
        max_time: Duration::from_secs_f64(a.tokenize_max_secs),
        inline_bytes: a.tokenize_inline_bytes,
    }
}

/// `host:port`, with brackets around an IPv6 host.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn check_ranges(a: &Args) -> Result<(), CliError> {
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
    fraction("cache_threshold", a.cache_threshold)?;
    factor("balance_rel_threshold", a.balance_rel_threshold)?;
    fraction("retry_jitter_factor", a.retry_jitter_factor)?;
    factor("retry_backoff_multiplier", a.retry_backoff_multiplier)?;
    fraction("otel_sampling_ratio", a.otel_sampling_ratio)?;
    fraction("cb_max_exclusion", a.cb_max_exclusion)?;
    fraction("pool_panic_threshold", a.pool_panic_threshold)?;
    positive("eviction_interval_secs", a.eviction_interval_secs)?;
    positive("max_tree_size", a.max_tree_size as u64)?;
    positive("max_tree_bytes", a.max_tree_bytes)?;
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
fn check_url(id: &str, url: &str) -> Result<String, CliError> {
    worker_lifecycle::WorkerUrl::parse_http(url)
        .map(|url| url.as_str().to_owned())
        .map_err(|err| CliError::invalid(id, err.to_string()))
}

fn check_unique(id: &str, urls: &[String]) -> Result<(), CliError> {
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

fn mode(parsed: &Parsed) -> Result<Mode, CliError> {
    let a = &parsed.args;
    if a.service_discovery {
        return super::kubernetes::mode(parsed);
    }
    if !a.vllm_pd_disaggregation
        && a.sim_pd.is_none()
        && let Some(flag) = PD_FLAGS.iter().find(|id| parsed.is_explicit(id))
    {
        return Err(CliError::invalid(
            flag,
            "is a prefill/decode flag: it needs --vllm-pd-disaggregation",
        ));
    }
    let workers_given = parsed.is_explicit("worker_urls");
    if let Some(spec) = &a.sim_pd {
        let (prefill, decode) = parse_sim_pd(spec)?;
        for id in [
            "worker_urls",
            "prefill",
            "decode",
            "vllm_discovery_address",
            "sim_workers",
        ] {
            if parsed.is_explicit(id) {
                return Err(CliError::invalid(
                    "sim_pd",
                    format!(
                        "starts its own engines and cannot be combined with {}",
                        long_flag(id)
                    ),
                ));
            }
        }
        return Ok(Mode::SimulatedPd { prefill, decode });
    }
    if a.vllm_pd_disaggregation {
        if workers_given {
            return Err(CliError::invalid(
                "worker_urls",
                "cannot be combined with --vllm-pd-disaggregation (use --prefill and --decode)",
            ));
        }
        if parsed.is_explicit("sim_workers") {
            return Err(CliError::invalid(
                "sim_workers",
                "cannot be combined with --vllm-pd-disaggregation (use --sim-pd P:D)",
            ));
        }
        let prefill = prefill_engines(&a.prefill)?;
        let decode = a
            .decode
            .iter()
            .map(|url| check_url("decode", url))
            .collect::<Result<Vec<_>, _>>()?;
        let prefill_urls: Vec<String> = prefill.iter().map(|(url, _)| url.clone()).collect();
        check_unique("prefill", &prefill_urls)?;
        check_unique("decode", &decode)?;
        if let Some(address) = &a.vllm_discovery_address {
            check_host_port("vllm_discovery_address", address)?;
        }
        if a.vllm_discovery_address.is_some()
            && let Some(id) = ["prefill", "decode"]
                .iter()
                .find(|id| parsed.is_explicit(id))
        {
            return Err(CliError::invalid(
                id,
                "cannot be combined with --vllm-discovery-address: each role takes its \
                     workers either from static URLs or from discovery",
            ));
        }
        if a.kv_connector.is_moriio() && !prefill.is_empty() {
            return Err(CliError::invalid(
                "kv_connector",
                "moriio needs each engine's MoRI-IO side-channel ports, which static \
                 --prefill/--decode URLs do not carry; use --vllm-discovery-address",
            ));
        }
        if prefill.is_empty() && decode.is_empty() && a.vllm_discovery_address.is_none() {
            return Err(CliError::invalid(
                "vllm_pd_disaggregation",
                "needs --prefill and --decode engines or --vllm-discovery-address",
            ));
        }
        if a.vllm_discovery_address.is_none() && (prefill.is_empty() || decode.is_empty()) {
            let missing = if prefill.is_empty() {
                "prefill"
            } else {
                "decode"
            };
            return Err(CliError::invalid(
                missing,
                "at least one is needed in P/D mode without --vllm-discovery-address",
            ));
        }
        return Ok(Mode::PrefillDecode(PdSettings {
            prefill,
            decode,
            prefill_policy: a.prefill_policy.unwrap_or(a.policy),
            decode_policy: a.decode_policy.unwrap_or(a.policy),
            kv_connector: a.kv_connector,
            discovery: a.vllm_discovery_address.clone(),
        }));
    }
    if workers_given {
        if parsed.is_explicit("sim_workers") {
            return Err(CliError::invalid(
                "sim_workers",
                "cannot be combined with --worker-urls",
            ));
        }
        let urls = a
            .worker_urls
            .iter()
            .map(|url| check_url("worker_urls", url))
            .collect::<Result<Vec<_>, _>>()?;
        check_unique("worker_urls", &urls)?;
        return Ok(Mode::Workers { urls });
    }
    if starts_simulated_engines(parsed) {
        return Ok(Mode::Simulated {
            engines: a.sim_workers,
        });
    }
    // vllm-router's behaviour: no worker source, no workers until
    // `POST /add_worker`.
    Ok(Mode::Workers { urls: Vec::new() })
}

/// Without a worker source, simulated engines start only for a command line
/// with no arguments at all (nothing given on the command line, in the
/// environment or in a `--config` file) or with `--sim-workers N` given
/// explicitly. Any other command line starts an empty fleet, as
/// vllm-router's does, so that tools driving it through `/add_worker` see
/// no foreign workers.
fn starts_simulated_engines(parsed: &Parsed) -> bool {
    parsed.explicit.is_empty() || parsed.is_explicit("sim_workers")
}

/// Groups `--prefill URL [BOOTSTRAP_PORT|none]` values: a port (or
/// `none`) belongs to the URL before it.
fn prefill_engines(values: &[String]) -> Result<Vec<(String, Option<u16>)>, CliError> {
    let mut engines: Vec<(String, Option<u16>, bool)> = Vec::new();
    for value in values {
        let is_none = value.eq_ignore_ascii_case("none");
        let is_number = !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit());
        if is_none || is_number {
            let Some(last) = engines.last_mut().filter(|(_, _, has_port)| !has_port) else {
                return Err(CliError::invalid(
                    "prefill",
                    format!(
                        "{value:?} must follow a prefill URL (--prefill URL [BOOTSTRAP_PORT|none])"
                    ),
                ));
            };
            last.2 = true;
            if is_number {
                last.1 = Some(value.parse::<u16>().map_err(|_| {
                    CliError::invalid(
                        "prefill",
                        format!("bootstrap port must be 0-65535 or `none`, got {value:?}"),
                    )
                })?);
            }
        } else {
            engines.push((check_url("prefill", value)?, None, false));
        }
    }
    Ok(engines
        .into_iter()
        .map(|(url, port, _)| (url, port))
        .collect())
}

fn parse_sim_pd(spec: &str) -> Result<(usize, usize), CliError> {
    let bad = || {
        CliError::invalid(
            "sim_pd",
            format!("expected PREFILL:DECODE engine counts like 2:2, got {spec:?}"),
        )
    };
    let (p, d) = spec.split_once(':').ok_or_else(bad)?;
    let p: usize = p.trim().parse().map_err(|_| bad())?;
    let d: usize = d.trim().parse().map_err(|_| bad())?;
    if p == 0 || d == 0 || p > 64 || d > 64 {
        return Err(CliError::invalid(
            "sim_pd",
            format!("needs 1 to 64 engines of each role, got {spec:?}"),
        ));
    }
    Ok((p, d))
}

fn router_config(a: &Args) -> Result<RouterConfig, CliError> {
    let mut policy = lb_policies::PolicyConfig::named(a.policy.as_str());
    let cache = &mut policy.cache_aware;
    cache.cache_threshold = a.cache_threshold;
    cache.balance_abs_threshold = a.balance_abs_threshold;
    cache.balance_rel_threshold = a.balance_rel_threshold;
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
