//! The `affinity-router` command: the reference router as an installed
//! program (`cargo install --path .`, or the Python wheel built from
//! `pyproject.toml`).
//!
//! It runs exactly what `cargo run --example router` runs: everything lives
//! in `affinity_router::cli`, and both targets only call its `main`.

/// mimalloc (feature `mimalloc`, on by default): the request path
/// allocates often, and glibc's malloc costs a router thread measurably more
/// (docs/benchmarks.md).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    affinity_router::cli::main()
}
