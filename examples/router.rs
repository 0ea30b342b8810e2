//! The reference router: `cargo run --release --example router`.
//!
//! With no arguments at all (or with `--sim-workers N` / `--sim-pd P:D`) it
//! starts simulated engines in-process and routes to them; with
//! vllm-router's flags it fronts real engines, and like vllm-router it
//! starts an empty fleet when no worker source is given. Every
//! flag is in `--help` and in docs/operations.md; the code is in
//! `affinity_router::cli`.

/// mimalloc (feature `mimalloc`, on by default): the request path
/// allocates often, and glibc's malloc costs a router thread measurably more
/// (docs/benchmarks.md).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    affinity_router::cli::main()
}
