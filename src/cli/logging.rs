//! Logging with tracing: human-readable by default, JSON lines with
//! `--log-json`, to stderr and, with `--log-dir`, also to a file. With
//! `--enable-trace`, the same subscriber carries router-http's OpenTelemetry
//! layer (`router_http::otel`), which sees only the router's trace spans;
//! the log output is what it is without traces.

use super::args::Args;
use router_http::otel::{ExportConfig, Tracing};
use std::path::PathBuf;
use tracing_subscriber::fmt::writer::MakeWriterExt;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _, Registry};

/// The log file's name inside `--log-dir`.
pub const LOG_FILE: &str = "affinity-router.log";

/// What [`init`] set up.
#[derive(Debug, Default)]
pub struct Logging {
    /// The log file's path, when one is written.
    pub file: Option<PathBuf>,
    /// The trace export, with `--enable-trace`: flushed and stopped when
    /// dropped (bounded by the export timeout).
    pub tracing: Option<Tracing>,
}

/// A failure to set up logging or tracing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoggingError {
    /// `--log-dir`: the log file cannot be opened.
    #[error("--log-dir: cannot open the log file: {0}")]
    LogFile(#[from] std::io::Error),
    /// `--enable-trace`: the export pipeline cannot be built.
    #[error("--otlp-traces-endpoint: {0}")]
    Trace(#[from] router_http::otel::TraceError),
}

type BoxedLayer = Box<dyn tracing_subscriber::Layer<Registry> + Send + Sync>;

/// Installs the global subscriber. `RUST_LOG`, when set, takes precedence
/// over `--log-level`. With `trace`, adds the OpenTelemetry layer, whose
/// export requests run on `runtime`.
pub fn init(
    args: &Args,
    trace: Option<&ExportConfig>,
    runtime: &tokio::runtime::Handle,
) -> Result<Logging, LoggingError> {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(args.log_level.as_str()));
    // The trace spans are the OpenTelemetry layer's: the log lines do not
    // carry them (they would with RUST_LOG=info otherwise).
    let mut filter = filter;
    if let Ok(off) = format!("{}=off", router_http::otel::TARGET).parse() {
        filter = filter.add_directive(off);
    }
    let file = match &args.log_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)?;
            let path = PathBuf::from(dir).join(LOG_FILE);
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)?;
            Some((path, std::sync::Arc::new(file)))
        }
        None => None,
    };
    let path = file.as_ref().map(|(path, _)| path.clone());
    let fmt = tracing_subscriber::fmt::layer();
    let log: BoxedLayer = match (file, args.log_json) {
        (Some((_, file)), true) => fmt
            .json()
            .with_writer(std::io::stderr.and(file))
            .with_filter(filter)
            .boxed(),
        (Some((_, file)), false) => fmt
            .with_ansi(false)
            .with_writer(std::io::stderr.and(file))
            .with_filter(filter)
            .boxed(),
        (None, true) => fmt
            .json()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
        (None, false) => {
            let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
            fmt.with_ansi(ansi)
                .with_writer(std::io::stderr)
                .with_filter(filter)
                .boxed()
        }
    };
    let tracing = trace
        .map(|config| Tracing::start(config, runtime.clone()))
        .transpose()?;
    let mut layers: Vec<BoxedLayer> = vec![log];
    layers.extend(tracing.as_ref().map(|t| t.layer().boxed()));
    // The subscriber may already be set (a test or a host did it): keep it.
    let _ = tracing_subscriber::registry().with(layers).try_init();
    Ok(Logging {
        file: path,
        tracing,
    })
}
