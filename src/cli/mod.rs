//! The reference router's command line and start-up.
//!
//! `cargo run --release --example router` is a thin wrapper around
//! [`main`]: parse the flags ([`Settings::from_args`]), set up logging,
//! [`App::start`], print the banner, wait for Ctrl-C or SIGTERM, and
//! [`App::stop`] gracefully. The pieces are public so that tests and hosts
//! can run the same router in-process.
//!
//! - [`args`]: the flags (vllm-router's, with its defaults, plus ours);
//!   [`Args`] is also the shape of the `--config` TOML file.
//! - [`settings`]: the `--config` merge, validation (exit 2 with a message
//!   naming the flag) and the mapping onto router-http's [`RouterConfig`].
//! - [`app`]: simulated engines (regular or prefill/decode), the listeners,
//!   waiting for workers, the P/D router, `POST /register`, graceful
//!   shutdown.
//! - [`discovery`]: the `worker-discovery` crate wired to router-http:
//!   `--worker-networks` as its address check, its registrar as the
//!   `POST /register` hook. Its registries (worker-lifecycle's
//!   [`ServiceRegistry`](worker_lifecycle::ServiceRegistry), one per role)
//!   feed router-http's P/D pools, reconciled on every request.
//! - [`kubernetes`]: `--service-discovery`, worker-discovery's Kubernetes pod
//!   watch, whose per-role registries feed the same pools.
//! - [`logging`]: tracing to stderr (human or JSON) and `--log-dir`.
//!
//! docs/operations.md documents every flag; a test keeps it in step with
//! [`Args`].
//!
//! # Example
//!
//! ```
//! use affinity_router::cli::{Mode, Settings};
//!
//! let settings = Settings::from_args(["router", "--worker-urls", "http://127.0.0.1:8001",
//!                                     "--policy", "round_robin", "--disable-retries"]).unwrap();
//! assert_eq!(settings.mode, Mode::Workers { urls: vec!["http://127.0.0.1:8001".into()] });
//! assert_eq!(settings.router.policy.name, "round_robin");
//! assert_eq!(settings.router.retry.max_retries, 0);
//!
//! let err = Settings::from_args(["router", "--cache-threshold", "1.5"]).unwrap_err();
//! assert_eq!(err.exit_code(), 2);
//! assert!(err.to_string().starts_with("--cache-threshold"));
//! ```
//!
//! [`RouterConfig`]: router_http::RouterConfig

pub mod app;
pub mod args;
pub mod discovery;
pub mod kubernetes;
pub mod logging;
pub mod settings;

pub use app::{App, ShutdownSignals, StartError, StopOutcome};
pub use args::{Args, LogLevel, PolicyName};
pub use discovery::{EngineRegistration, Registries, ZmqDiscovery};
pub use settings::{CliError, Mode, Parsed, PdDeployment, Settings};

use std::io::Write as _;
use std::process::ExitCode;

/// The whole reference router: parse `std::env::args`, start, serve until
/// Ctrl-C or SIGTERM, stop gracefully. Exit codes: 0 after a clean stop
/// (and for `--help` / `--version`), 2 for an invalid command line, 1 when
/// start-up fails.
pub fn main() -> ExitCode {
    let settings = match Settings::from_args(std::env::args_os()) {
        Ok(settings) => settings,
        Err(err) => {
            err.print();
            return ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(2));
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let logging = match logging::init(
        &settings.args,
        settings.trace_export.as_ref(),
        runtime.handle(),
    ) {
        Ok(logging) => logging,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::from(2);
        }
    };
    // The trace export's span counters join the router's /metrics.
    let mut settings = settings;
    if let Some(tracing) = &logging.tracing {
        settings
            .router
            .metrics_sources
            .push(tracing.metrics_source());
    }
    if let Some(path) = &logging.file {
        tracing::info!(path = %path.display(), "writing logs to a file too");
    }
    if let Some(export) = &settings.trace_export {
        tracing::info!(
            endpoint = %export.endpoint,
            protocol = %export.protocol,
            sampling_ratio = settings.router.trace.sampling_ratio,
            "exporting OpenTelemetry traces (OTLP)"
        );
    }
    let code = runtime.block_on(async move {
        // Installed first: a signal during start-up or right after the
        // banner is never missed.
        let mut signals = match ShutdownSignals::install() {
            Ok(signals) => signals,
            Err(err) => {
                eprintln!("error: cannot install the signal handlers: {err}");
                return ExitCode::FAILURE;
            }
        };
        let started = tokio::select! {
            started = App::start(&settings) => started,
            () = signals.recv() => {
                tracing::info!("stopped during start-up");
                return ExitCode::SUCCESS;
            }
        };
        let app = match started {
            Ok(app) => app,
            Err(err) => {
                tracing::error!(error = %err, "start-up failed");
                eprintln!("error: {err}");
                return ExitCode::FAILURE;
            }
        };
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{}", app.banner());
        let _ = stdout.flush();
        drop(stdout);
        signals.recv().await;
        // Drained or not, the operator asked for a stop and got one within
        // the grace period: a clean exit either way.
        let _ = app.stop().await;
        ExitCode::SUCCESS
    });
    // The last spans are exported while the runtime still runs the export
    // requests (bounded by the export timeout).
    drop(logging);
    code
}
