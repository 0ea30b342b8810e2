//! Logging with tracing: human-readable by default, JSON lines with
//! `--log-json`, to stderr and, with `--log-dir`, also to a file.

use super::args::Args;
use std::path::PathBuf;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::writer::MakeWriterExt;

/// The log file's name inside `--log-dir`.
pub const LOG_FILE: &str = "affinity-router.log";

/// Installs the global subscriber. `RUST_LOG`, when set, takes precedence
/// over `--log-level`. Returns the log file's path when one is written.
pub fn init(args: &Args) -> std::io::Result<Option<PathBuf>> {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(args.log_level.as_str()));
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
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    // The subscriber may already be set (a test or a host did it): keep it.
    let path = file.as_ref().map(|(path, _)| path.clone());
    match (file, args.log_json) {
        (Some((_, file)), true) => {
            let _ = builder
                .json()
                .with_writer(std::io::stderr.and(file))
                .try_init();
        }
        (Some((_, file)), false) => {
            let _ = builder
                .with_ansi(false)
                .with_writer(std::io::stderr.and(file))
                .try_init();
        }
        (None, true) => {
            let _ = builder.json().with_writer(std::io::stderr).try_init();
        }
        (None, false) => {
            let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
            let _ = builder
                .with_ansi(ansi)
                .with_writer(std::io::stderr)
                .try_init();
        }
    }
    Ok(path)
}
