//! `--trace paired`: tracing's cost measured against itself, in one run
//!
//! One `--trace off` run and one `--trace on` run of the same case differ
//! by what else the machine did in between as much as by tracing (on a
//! shared 2-vCPU machine, single runs of one mode spread by ±20 %). Here
//! both routers live in one process, each on its own thread, against the
//! same upstream: one that traces every request (exporting to the
//! in-process collector, as `--trace on`) and one that does not. The load
//! goes to one at a time, in short phases that alternate (off, on; then
//! on, off; and so on), so a slow second of the machine falls on both
//! about equally. Each router's CPU is read from its own thread over its
//! own phases; the export threads' CPU over the whole run is charged to
//! the traced router's requests. With `--pin`, the routers run on CPU 0
//! and every other thread on CPU 1 ([`pin_threads`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use router_http::RouterConfig;

use super::load::{make_bodies, run_load};
use super::threads::{spawn_runtime, thread_cpu_ns};
use super::trace::{collector_cpu_ns, export_cpu_ns};
use super::{Case, round3};

/// A router for `policy` on a thread of its own named `name`, tracing
/// every request when `traced`: its address and thread id.
fn spawn_router(
    name: &str,
    policy: &'static str,
    traced: bool,
    upstream: SocketAddr,
) -> (SocketAddr, u32) {
    let mut config = RouterConfig {
        policy: lb_policies::PolicyConfig::named(policy),
        ..RouterConfig::default()
    };
    config.trace.enabled = traced;
    super::load::spawn_router(name, config, upstream)
}

/// Pins this process's threads to the machine's first two CPUs: the
/// routers' (named `rt-*`) to CPU 0, every other thread (load generator,
/// upstream, export, collector) to CPU 1, and threads started later where
/// their parent is. A router then has a core of its own, and its CPU per
/// request does not depend on how the scheduler shares one with the load.
/// `false` when the machine has fewer than two CPUs or a router's thread
/// could not be pinned.
fn pin_threads() -> bool {
    // The CPUs this process may use, read once: after the first pinning
    // this thread is on one CPU, and would read 1 (the reason the second
    // policy's routers were once measured unpinned).
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cpus = *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(0, usize::from));
    if cpus < 2 {
        return false;
    }
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return false;
    };
    let mut pinned = true;
    for task in tasks.flatten() {
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<i32>().ok())
        else {
            continue;
        };
        let name = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let cpu = usize::from(!name.starts_with("rt-"));
        // SAFETY: `set` is a zeroed `cpu_set_t` (a plain bit array), `cpu`
        // is below its capacity, and `sched_setaffinity` only reads it.
        let result = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
        };
        // A thread that ended since the listing (a blocking-pool thread
        // past its idle time, or a router of the previous policy shutting
        // down: ESRCH) is not a failure; a live router not pinned is.
        let ended =
            result != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        pinned &= result == 0 || cpu == 1 || ended;
    }
    pinned
}

/// What one router did over its phases.
#[derive(Default)]
struct Tally {
    cpu_ns: u64,
    requests: usize,
    /// CPU µs per request of each phase, in order.
    phases: Vec<f64>,
}

impl Tally {
    fn add(&mut self, cpu_ns: u64, requests: usize) {
        self.cpu_ns += cpu_ns;
        self.requests += requests;
        self.phases
            .push(cpu_ns as f64 / 1000.0 / requests.max(1) as f64);
    }

    fn us_per_request(&self) -> f64 {
        self.cpu_ns as f64 / 1000.0 / self.requests.max(1) as f64
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Runs `case` for each policy: `rounds` pairs of phases of `phase`
/// each, alternating which router goes first. The figures as JSON.
pub(super) fn paired(
    case: Case,
    upstream: SocketAddr,
    rounds: usize,
    phase: Duration,
    pin: bool,
) -> serde_json::Value {
    let mut figures = serde_json::Map::new();
    for policy in ["round_robin", "cache_aware"] {
        let short = &policy[..policy.len().min(8)];
        let off = spawn_router(&format!("rt-{short}-off"), policy, false, upstream);
        let on = spawn_router(&format!("rt-{short}-on"), policy, true, upstream);
        let pinned = pin && pin_threads();
        if pin && !pinned {
            eprintln!("--pin: the threads could not be pinned; measuring unpinned");
        }
        let bodies = Arc::new(make_bodies(case, 512));
        let (untraced, traced, export_ns, collector_ns, warm_requests) =
            spawn_runtime("loadgen", move |rt| {
                rt.block_on(async move {
                    let warm = Duration::from_millis(300);
                    let warm_off = run_load(off.0, case, bodies.clone(), warm, false)
                        .await
                        .len();
                    let warm_on = run_load(on.0, case, bodies.clone(), warm, false)
                        .await
                        .len();
                    let (mut untraced, mut traced) = (Tally::default(), Tally::default());
                    let export_before = export_cpu_ns();
                    let collector_before = collector_cpu_ns();
                    for round in 0..rounds {
                        let order = if round % 2 == 0 {
                            [(off, false), (on, true)]
                        } else {
                            [(on, true), (off, false)]
                        };
                        for ((addr, tid), is_traced) in order {
                            let before = thread_cpu_ns(tid);
                            let requests = run_load(addr, case, bodies.clone(), phase, false)
                                .await
                                .len();
                            let cpu = thread_cpu_ns(tid).saturating_sub(before);
                            if is_traced {
                                traced.add(cpu, requests);
                            } else {
                                untraced.add(cpu, requests);
                            }
                        }
                    }
                    // The last batch is exported within the scheduled delay of
                    // the pipeline (5 s): wait for it, so that the export's
                    // CPU covers every traced request.
                    tokio::time::sleep(Duration::from_secs(6)).await;
                    (
                        untraced,
                        traced,
                        export_cpu_ns().saturating_sub(export_before),
                        collector_cpu_ns().saturating_sub(collector_before),
                        (warm_off, warm_on),
                    )
                })
            });
        let off_us = untraced.us_per_request();
        let on_us = traced.us_per_request();
        let export_us = export_ns as f64 / 1000.0 / traced.requests.max(1) as f64;
        let ratio = |x: f64| (x / off_us - 1.0) * 100.0;
        // Each round's traced phase against the untraced phase beside it.
        let paired_whole: Vec<f64> = traced
            .phases
            .iter()
            .zip(&untraced.phases)
            .map(|(on, off)| ((on + export_us) / off - 1.0) * 100.0)
            .collect();
        figures.insert(
            policy.into(),
            serde_json::json!({
                "off_router_cpu_us_per_req": round3(off_us),
                "on_router_cpu_us_per_req": round3(on_us),
                "on_export_cpu_us_per_req": round3(export_us),
                "on_whole_cpu_us_per_req": round3(on_us + export_us),
                "router_thread_over_off_pct": round3(ratio(on_us)),
                "whole_over_off_pct": round3(ratio(on_us + export_us)),
                "paired_whole_over_off_pct_median": round3(median(paired_whole.clone())),
                "paired_whole_over_off_pct_min": round3(
                    paired_whole.iter().copied().fold(f64::INFINITY, f64::min)
                ),
                "paired_whole_over_off_pct_max": round3(
                    paired_whole.iter().copied().fold(f64::NEG_INFINITY, f64::max)
                ),
                "collector_cpu_us_per_req": round3(
                    collector_ns as f64 / 1000.0 / traced.requests.max(1) as f64
                ),
                "requests_off": untraced.requests,
                "requests_on": traced.requests,
                // Every request a router served, its warm-up included: the
                // divisor of a whole-thread count (callgrind's, say).
                "served_off": untraced.requests + warm_requests.0,
                "served_on": traced.requests + warm_requests.1,
                "pinned": pinned,
                "rounds": rounds,
                "phase_ms": phase.as_millis() as u64,
            }),
        );
    }
    serde_json::Value::Object(figures)
}
