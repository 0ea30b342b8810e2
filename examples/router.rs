//! The reference router: `cargo run --release --example router`.
//!
//! With no worker flags it starts four simulated engines in-process and
//! routes to them; with vllm-router's flags it fronts real engines. Every
//! flag is in `--help` and in docs/operations.md; the code is in
//! `affinity_router::cli`.

fn main() -> std::process::ExitCode {
    affinity_router::cli::main()
}
