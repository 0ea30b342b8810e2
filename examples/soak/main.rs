//! The soak benchmark: memory and tail latency of the reference router under
//! a sustained stream of distinct chat prompts (issue 38).
//!
//! ```text
//! scripts/soak --duration 90 --workers 2 --policies round_robin,cache_aware -- --max-tree-size 16777216
//! cargo run --release --example soak -- --help
//! ```
//!
//! It reproduces what an operator does with `wrk` and `top`, with nothing but
//! the Rust toolchain: it starts N `engine-sim --time-scale 0` processes and
//! ONE reference router process (`examples/router.rs`) on 127.0.0.1, then
//! drives the router from this process for `--duration` seconds:
//!
//! - `--connections` keep-alive connections (default 32, as `wrk -t1 -c32`),
//!   each sending one chat completion after another, as fast as the router
//!   answers. Every prompt is unique: one user message whose content begins
//!   with a random number, followed by about 1 KB of text; optionally after
//!   a fixed system message.
//! - one *probe* every 50 ms on a connection and a runtime of its own, timed
//!   apart: what a single user sees while the router is busy.
//! - the router's RSS (`/proc/PID/status`, `VmRSS`) once a second, and its
//!   `VmHWM` at the end.
//!
//! Several runs (`--policies a,b` or `--run "POLICY FLAGS"`) each get fresh
//! engines and a fresh router, one after the other, and end with one
//! markdown table. `--json` prints each run's summary as one JSON line.
//!
//! # Why it is built this way
//!
//! - **Separate processes**, because RSS is a property of a process: the
//!   router must be measured alone, started the way an operator starts it.
//! - **A cheap load generator**: the machine the issue measures on has two
//!   cores shared by the router, the engines and the generator. The
//!   generator therefore runs on one thread by default (`--threads`), builds
//!   each body by copying a precomputed template around a number from a
//!   SplitMix64 generator, never parses a response (it reads the status and
//!   drains the body), and records latencies into a fixed array of atomic
//!   log-linear buckets (about 1.6 % resolution, no allocation per request).
//! - **The probe on its own runtime**, so its latency is the router's answer
//!   time, not the time the busy load thread took to notice the answer.
//! - **Every error counted.** A non-2xx answer, a connection that cannot be
//!   opened or breaks, a body that ends early: each is counted, reported,
//!   and makes the summary's `errors` non-zero. The first few are shown.
//! - **Nothing left behind.** The children are killed by their pid when a run
//!   ends, fails, or is interrupted (Ctrl-C, SIGTERM); on Linux they also get
//!   `PR_SET_PDEATHSIG` so that they die with this process even if it is
//!   killed with SIGKILL.
#![cfg_attr(
    not(target_os = "linux"),
    allow(dead_code, reason = "the benchmark reads /proc and runs on Linux only")
)]

mod args;
mod body;
mod children;
mod clients;
mod histogram;
mod procfs;
mod run;
mod summary;

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;

use args::{Args, check_args, run_specs};
use body::BodyTemplate;
use run::{Interrupt, Setup, Stop, run_one};
use summary::table;

/// `NAME` in this executable's target profile: `target/PROFILE/examples/soak`
/// -> `target/PROFILE/examples/NAME` or `target/PROFILE/NAME`.
fn sibling(name: &str, in_examples: bool) -> Result<PathBuf, String> {
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find this program's path: {e}"))?;
    let examples = exe.parent().ok_or("this program's path has no directory")?;
    let dir = if in_examples {
        examples
    } else {
        examples
            .parent()
            .ok_or("this program's path has no profile directory")?
    };
    Ok(dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX)))
}

fn binary(
    given: &Option<PathBuf>,
    name: &str,
    in_examples: bool,
    build: &str,
) -> Result<PathBuf, String> {
    let path = match given {
        Some(path) => path.clone(),
        None => sibling(name, in_examples)?,
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} does not exist: build it first ({build}) or use scripts/soak, which does",
            path.display()
        ))
    }
}

async fn soak(args: Args) -> Result<ExitCode, String> {
    if !cfg!(target_os = "linux") {
        return Err("the soak reads /proc: it runs on Linux only".into());
    }
    check_args(&args)?;
    let specs = run_specs(&args)?;
    let router_bin = binary(
        &args.router_bin,
        "router",
        true,
        "cargo build --release --example router",
    )?;
    let engine_bin = binary(
        &args.engine_bin,
        "engine-sim",
        false,
        "cargo build --release -p engine-sim --bin engine-sim",
    )?;
    let (log_dir, temporary) = match &args.log_dir {
        Some(dir) => (dir.clone(), false),
        None => (
            std::env::temp_dir().join(format!("soak-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&log_dir)
        .map_err(|e| format!("cannot create {}: {e}", log_dir.display()))?;
    let mut series = match &args.series {
        Some(path) => {
            let mut file = std::fs::File::create(path)
                .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
            writeln!(
                file,
                "run,policy,flags,t_s,requests,errors,p50_ms,p99_ms,max_ms,probes,probe_max_ms,rss_mib"
            )
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            Some(file)
        }
        None => None,
    };
    let setup = Setup {
        router_bin,
        engine_bin,
        engine_flags: args
            .engine_flags
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
        log_dir: log_dir.clone(),
        template: Arc::new(BodyTemplate::new(
            &args.model,
            args.max_tokens,
            args.system_prompt_bytes,
            args.prompt_bytes,
        )),
    };
    let interrupt = Interrupt::install();
    let mut summaries = Vec::new();
    let mut failed = false;
    for (index, spec) in specs.iter().enumerate() {
        match run_one(&interrupt, &args, &setup, index, spec, &mut series).await {
            Ok(summary) => {
                if args.json {
                    println!("{}", summary.to_json());
                } else {
                    println!("{}\n", summary.to_text());
                }
                if summary.errors() > 0 {
                    failed = true;
                }
                summaries.push(summary);
            }
            Err(Stop::Interrupted) => {
                if temporary {
                    let _ = std::fs::remove_dir_all(&log_dir);
                }
                eprintln!("soak: interrupted; every process it started is stopped");
                return Ok(ExitCode::from(130));
            }
            Err(Stop::Failed(message)) => {
                eprintln!(
                    "soak: run {} ({}) failed: {message}\n  the children's output: {}",
                    index + 1,
                    spec.label(),
                    log_dir.display()
                );
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    let report = table(&summaries);
    if args.json {
        eprint!("{report}");
    } else {
        print!("{report}");
    }
    if temporary {
        let _ = std::fs::remove_dir_all(&log_dir);
    }
    if failed {
        eprintln!("soak: some requests failed (see errors above)");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let args = Args::parse();
    // The control runtime runs on this (main) thread: the children are
    // started here, so PR_SET_PDEATHSIG ties them to a thread that lives
    // as long as the soak. The clients run on runtimes of their own.
    let control = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("soak: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match control.block_on(soak(args)) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("soak: {message}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests;
