//! The `affinity-router` command: the reference router as an installed
//! program (`cargo install --path .`, or the Python wheel built from
//! `pyproject.toml`).
//!
//! It runs exactly what `cargo run --example router` runs: everything lives
//! in `affinity_router::cli`, and both targets only call its `main`.

fn main() -> std::process::ExitCode {
    affinity_router::cli::main()
}
