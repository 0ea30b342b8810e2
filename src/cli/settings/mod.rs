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
//!
//! Each step, and each part of step 3 that reads on its own, has a module:
//! `parse` (steps 1 and 2), `checks` (single values), `mode` (where the
//! workers come from), `tokenizers`, `kv_events`, and `router_config` (the
//! mapping onto router-http). This module holds what they produce: the
//! validated [`Settings`] and the [`CliError`] every step reports with.

mod checks;
mod kv_events;
mod mode;
mod parse;
mod router_config;
mod tokenizers;
mod trace;

pub use checks::{check_host_port, join_host_port};
pub use mode::{Mode, PdDeployment};

pub use parse::{ModelTokenizer, Parsed, WorkerSettings, parse_from, to_toml};

use super::args::{Args, long_flag};
use router_http::RouterConfig;
use std::ffi::OsString;

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
    /// Where and how traces are exported, with `--enable-trace`.
    pub trace_export: Option<router_http::otel::ExportConfig>,
}

const KUBERNETES_FLAGS: [&str; 5] = [
    "selector",
    "prefill_selector",
    "decode_selector",
    "service_discovery_port",
    "service_discovery_namespace",
];

const IGNORED_FLAGS: [&str; 2] = ["cors_allowed_origins", "backend"];

/// The trace settings, which do nothing without `--enable-trace` (as in
/// vllm-router): reported as ignored then.
const TRACE_FLAGS: [&str; 5] = [
    "otlp_traces_endpoint",
    "otlp_traces_protocol",
    "otlp_traces_ca_file",
    "otel_sampling_ratio",
    "otel_excluded_paths",
];

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
    pub fn from_parsed(mut parsed: Parsed) -> Result<Self, CliError> {
        checks::check_ranges(&parsed.args)?;
        let mode = mode::mode(&parsed)?;
        kv_events::needs_index(&parsed)?;
        kv_events::block_size(&mut parsed)?;
        let args = &parsed.args;
        let mut router = router_config::router_config(args)?;
        let trace = trace::trace(args)?;
        router.trace = trace.routing;
        router.tokenizers = tokenizers::tokenizers(&parsed, &mode)?;
        router.tokenize = tokenizers::tokenize_config(args);
        router.kv_events = kv_events::kv_events(&parsed, &mode, &router.tokenizers)?;
        let mut ignored: Vec<String> = IGNORED_FLAGS
            .iter()
            .filter(|id| parsed.is_explicit(id))
            .map(|id| long_flag(id))
            .collect();
        ignored.extend(
            TRACE_FLAGS
                .iter()
                .filter(|id| !args.enable_trace && parsed.is_explicit(id))
                .map(|id| long_flag(id)),
        );
        ignored.extend(
            KUBERNETES_FLAGS
                .iter()
                .filter(|id| !args.service_discovery && parsed.is_explicit(id))
                .map(|id| long_flag(id)),
        );
        ignored.sort();
        Ok(Settings {
            args: parsed.args,
            mode,
            router,
            ignored,
            trace_export: trace.export,
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
             request_timeout={}s retries={} breaker={} health=GET {} every {}s load_poll={} \
             api_key={} admin_api_key={} prometheus={} grace={}s",
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
            match a.load_poll_interval_ms {
                0 => "off".to_owned(),
                ms => format!("{ms}ms"),
            },
            secret(&a.api_key),
            secret(&a.admin_api_key),
            join_host_port(&a.prometheus_host, a.prometheus_port),
            a.shutdown_grace_period_secs,
        )
    }
}
