//! Per-decision cost of every policy at 8, 64 and 1,000 workers.
//!
//! ```text
//! cargo run --release -p lb-policies --example decision_bench -- --json
//! ```
//!
//! prints one JSON line `{"8": {"<policy>": {"median_ns": x, "p99_ns": y},
//! ...}, "64": {...}, "1000": {...}}`. Without `--json` it prints a table.
//!
//! Cache-aware (and its fleet-gate variant) route the request texts of set
//! R of `shared/workloads/radix-affinity.md` against a tree warmed with set
//! W (tenant `owner(sp)` mapped onto the fleet as `owner % workers`); the
//! generator is checked against the spec's checksums before timing. The
//! other policies route 100,000 requests keyed by one of 10,000 user ids
//! (so the hash policies measure their hash path, not the keyless
//! fallback). Loads are live: each decision starts a request
//! on the chosen worker and the oldest of `4 × workers` in-flight requests
//! finishes, outside the timed region.
//!
//! Timing: cache-aware decisions are timed one by one. Decisions of the
//! other policies take tens of nanoseconds, close to the cost of reading
//! the clock, so they are timed in batches of 32 and each batch's mean is
//! one sample; their p99 is therefore the p99 of batch means.
//!
//! Options: `--workers 8,64,1000`, `--requests N` (first N of R, default
//! 100000; checksums are verified only for the full set), `--variant
//! ascii|unicode`, `--json`.

mod workload;

use std::collections::VecDeque;
use std::process::ExitCode;
use std::time::Instant;

use lb_policies::{
    Backend, BasicBackend, MembershipEvent, Policy, PolicyConfig, PolicyRegistry, RequestContext,
};
use workload::{Request, Variant, Workload};

const POLICIES: [&str; 8] = [
    "random",
    "round_robin",
    "power_of_two",
    "least_loaded",
    "consistent_hash",
    "rendezvous_hash",
    "cache_aware",
    "cache_aware_fleet_gate",
];
const BATCH: usize = 32;

/// A policy's `(name, (median ns, p99 ns))`.
type Row = (&'static str, (f64, f64));

struct Options {
    json: bool,
    workers: Vec<usize>,
    requests: usize,
    variant: Variant,
}

fn parse_args() -> Result<Options, String> {
    let mut o = Options {
        json: false,
        workers: vec![8, 64, 1000],
        requests: 100_000,
        variant: Variant::Ascii,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--json" => o.json = true,
            "--workers" => {
                o.workers = value("--workers")?
                    .split(',')
                    .map(|w| {
                        w.trim()
                            .parse::<usize>()
                            .map_err(|e| format!("--workers: {e}"))
                    })
                    .collect::<Result<_, _>>()?;
                if o.workers.contains(&0) {
                    return Err("--workers: counts must be positive".into());
                }
            }
            "--requests" => {
                o.requests = value("--requests")?
                    .parse()
                    .map_err(|e| format!("--requests: {e}"))?;
                if o.requests == 0 || o.requests > 100_000 {
                    return Err("--requests must be in 1..=100000".into());
                }
            }
            "--variant" => {
                o.variant = match value("--variant")?.as_str() {
                    "ascii" => Variant::Ascii,
                    "unicode" => Variant::Unicode,
                    other => return Err(format!("--variant: unknown `{other}` (ascii|unicode)")),
                }
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(o)
}

/// Live load: every decision starts a request, the oldest of a bounded
/// window finishes.
struct InFlight {
    window: VecDeque<usize>,
    capacity: usize,
}

impl InFlight {
    fn new(workers: usize) -> Self {
        InFlight {
            window: VecDeque::new(),
            capacity: 4 * workers,
        }
    }

    fn start(&mut self, fleet: &[BasicBackend], index: usize) {
        fleet[index].begin_request();
        self.window.push_back(index);
        if self.window.len() > self.capacity {
            if let Some(done) = self.window.pop_front() {
                fleet[done].end_request();
            }
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[rank]
}

fn summarize(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

fn fresh_fleet(n: usize) -> Vec<BasicBackend> {
    (0..n)
        .map(|i| BasicBackend::new(format!("http://worker-{i}:8000")))
        .collect()
}

fn registry_for(name: &str, fleet: &[BasicBackend]) -> PolicyRegistry<BasicBackend> {
    let registry = PolicyRegistry::new(PolicyConfig::named(name).with_seed(0x5eed))
        .expect("built-in policy names are valid");
    for b in fleet {
        registry.on_membership(MembershipEvent::Added { key: b.key() });
    }
    registry
}

fn bench_cache_aware(
    name: &str,
    workers: usize,
    warm: &[Request],
    route: &[Request],
) -> (f64, f64) {
    let fleet = fresh_fleet(workers);
    let registry = registry_for(name, &fleet);
    let policy = registry.policy("bench").expect("built");
    // Warm the tree with W through the policy's own membership: insert via
    // decisions would move W; instead route each W text once to its owner
    // by offering only that worker (not timed).
    for r in warm {
        let owner = workload::owner(r.sp) % workers;
        let ctx = RequestContext::new("bench").with_text(&r.text);
        policy.select(&fleet[owner..=owner], &ctx);
    }
    let mut in_flight = InFlight::new(workers);
    let mut samples = Vec::with_capacity(route.len());
    for r in route {
        let ctx = RequestContext::new("bench").with_text(&r.text);
        let t0 = Instant::now();
        let decision = policy.select(&fleet, &ctx);
        let ns = t0.elapsed().as_nanos() as f64;
        samples.push(ns);
        if let Some(d) = decision {
            in_flight.start(&fleet, d.index);
        }
    }
    let counts = policy.counts();
    eprintln!(
        "{name} @ {workers}: {}",
        counts
            .iter()
            .filter(|(_, c)| *c > 0)
            .map(|(r, c)| format!("{r}={c}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    summarize(samples)
}

fn bench_simple(name: &str, workers: usize, requests: usize, users: &[String]) -> (f64, f64) {
    let fleet = fresh_fleet(workers);
    let registry = registry_for(name, &fleet);
    let policy = registry.policy("bench").expect("built");
    let mut in_flight = InFlight::new(workers);
    let mut chosen = [0usize; BATCH];
    let mut samples = Vec::with_capacity(requests / BATCH + 1);
    let mut i = 0;
    while i < requests {
        let t0 = Instant::now();
        for (k, slot) in chosen.iter_mut().enumerate() {
            let ctx = RequestContext::new("bench").with_user(&users[(i + k) % users.len()]);
            *slot = policy.select(&fleet, &ctx).map_or(usize::MAX, |d| d.index);
        }
        samples.push(t0.elapsed().as_nanos() as f64 / BATCH as f64);
        for &c in &chosen {
            if c != usize::MAX {
                in_flight.start(&fleet, c);
            }
        }
        i += BATCH;
    }
    summarize(samples)
}

fn main() -> ExitCode {
    let options = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("decision_bench: {e}");
            return ExitCode::from(2);
        }
    };
    let generated = Instant::now();
    let workload = Workload::new(options.variant);
    let warm = workload.warm();
    let route = workload.route(&warm, options.requests);
    let (want_w, want_r) = workload::expected_checksums(options.variant);
    let got_w = workload::checksum(&warm);
    if got_w != want_w {
        eprintln!("decision_bench: W checksum {got_w:016x} != spec {want_w:016x}");
        return ExitCode::FAILURE;
    }
    if route.len() == 100_000 {
        let got_r = workload::checksum(&route);
        if got_r != want_r {
            eprintln!("decision_bench: R checksum {got_r:016x} != spec {want_r:016x}");
            return ExitCode::FAILURE;
        }
        eprintln!(
            "workload verified: W {got_w:016x}, R {got_r:016x} ({:.1} s)",
            generated.elapsed().as_secs_f64()
        );
    } else {
        eprintln!(
            "workload: W verified {got_w:016x}; R truncated to {} items (not checksummed)",
            route.len()
        );
    }
    let users: Vec<String> = (0..10_000).map(|i| format!("user-{i}")).collect();

    let mut results: Vec<(usize, Vec<Row>)> = Vec::new();
    for &workers in &options.workers {
        let mut row = Vec::new();
        for name in POLICIES {
            let figures = if name.starts_with("cache_aware") {
                bench_cache_aware(name, workers, &warm, &route)
            } else {
                bench_simple(name, workers, 100_000, &users)
            };
            row.push((name, figures));
        }
        results.push((workers, row));
    }

    if options.json {
        let body: Vec<String> = results
            .iter()
            .map(|(workers, row)| {
                let cells: Vec<String> = row
                    .iter()
                    .map(|(name, (median, p99))| {
                        format!("\"{name}\": {{\"median_ns\": {median:.1}, \"p99_ns\": {p99:.1}}}")
                    })
                    .collect();
                format!("\"{workers}\": {{{}}}", cells.join(", "))
            })
            .collect();
        println!("{{{}}}", body.join(", "));
    } else {
        println!(
            "{:<24} {:>8} {:>12} {:>12}",
            "policy", "workers", "median ns", "p99 ns"
        );
        for (workers, row) in &results {
            for (name, (median, p99)) in row {
                println!("{name:<24} {workers:>8} {median:>12.1} {p99:>12.1}");
            }
        }
    }
    ExitCode::SUCCESS
}
