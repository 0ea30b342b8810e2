//! The routing-quality simulator's command line.
//!
//! ```text
//! cargo run --release --example simulate -- [--workload NAME] [--policies a,b]
//!     [--workers N] [--pd P:D] [--out DIR] [--json] [--quick] [--seed S] [--rate R]
//!     [--replicas R] [--kv-blocks N] [--kv-event-delay-ms MS]
//!     [--load-poll-ms off|oracle|MS] [--load-poll-delay-ms MS]
//! ```
//!
//! Runs every (workload, policy) pair on the simulator of
//! `affinity_router::simulator`, prints a table per workload and, with
//! `--out`, writes `simulation.md` and SVG charts there. `--json` ends the
//! output with one JSON line of the headline figures.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use affinity_router::simulator::{
    DEFAULT_POLICIES, LoadPolling, PdSplit, PreparedTrace, RunReport, SimConfig, Trace, report,
    simulate, split_policy, trace, workload,
};
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use plotters::prelude::*;

/// Compare load-balancing policies on simulated engines.
#[derive(Parser, Debug)]
#[command(name = "simulate")]
struct Args {
    /// Workloads to run: multi_turn, radix, multi_turn_pd, templated
    /// (comma-separated), all (the first three), or none (with --trace).
    #[arg(long, default_value = "all")]
    workload: String,
    /// Replay a JSONL trace file as well (see the simulator's trace module
    /// docs for the format).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Policies, comma-separated, named as on the router's command line;
    /// `:tokens` routes a cache-aware policy on the engines' token ids
    /// instead of the request text (`cache_aware:tokens`). `kv_aware`
    /// routes on tokens and scores the blocks the engines hold, from their
    /// KV events. Default: the seven built-in comparisons; for templated,
    /// round_robin, cache_aware and cache_aware:tokens.
    #[arg(long, value_delimiter = ',')]
    policies: Option<Vec<String>>,
    /// Engines in the regular workloads.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Prefill:decode engines of multi_turn_pd.
    #[arg(long, default_value = "2:6", value_parser = parse_split)]
    pd: PdSplit,
    /// The policy placing decode legs in multi_turn_pd.
    #[arg(long, default_value = "least_loaded")]
    decode_policy: String,
    /// Write simulation.md and SVG charts to this directory.
    #[arg(long)]
    out: Option<PathBuf>,
    /// End with one JSON line of the headline figures.
    #[arg(long)]
    json: bool,
    /// A smaller version of every scenario (a few seconds).
    #[arg(long)]
    quick: bool,
    /// Seed of the workloads and the random policies.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Arrival rate (requests/s) of every generated workload, overriding
    /// the scenario defaults.
    #[arg(long)]
    rate: Option<f64>,
    /// Requests per generated workload, overriding the scenario defaults.
    #[arg(long)]
    requests: Option<usize>,
    /// P/D: choose the decode worker at arrival with the prefill worker (as
    /// the router does for MoRI-IO READ and the concurrent connectors)
    /// instead of when the prefill completes (the default: the router's way
    /// for NIXL and sequential Mooncake).
    #[arg(long)]
    arrival_decode_choice: bool,
    /// Drain this many workers of the policy's pool (the prefill pool under
    /// P/D) before the run: members every policy sees, with load 0, that
    /// may not take requests (a worker draining or failing health checks).
    #[arg(long, default_value_t = 0)]
    drain: usize,
    /// Sessions open at a time in the multi-turn workloads (default 96).
    #[arg(long)]
    sessions: Option<usize>,
    /// System-prompt length in tokens in the multi-turn workloads (default
    /// 1,024).
    #[arg(long)]
    system_prompt_tokens: Option<usize>,
    /// Cache-aware's absolute load margin (`balance_abs_threshold`);
    /// default: the router's (64).
    #[arg(long)]
    balance_abs: Option<usize>,
    /// Cache-aware's relative load margin (`balance_rel_threshold`);
    /// default: the router's (1.5).
    #[arg(long)]
    balance_rel: Option<f64>,
    /// Router replicas (regular workloads only): requests are dealt to them
    /// round robin; each has its own policy state (and, for kv_aware, its
    /// own block index fed by the same engine events) and knows only its
    /// own in-flight counts.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// KV-cache blocks (of 16 tokens) per engine, overriding the model's
    /// 4,096 (and templated's own size): a smaller cache evicts more.
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// kv_aware: milliseconds after the end of the scheduler step that
    /// changed an engine's cache before the routers see the change.
    #[arg(long, default_value_t = 5.0)]
    kv_event_delay_ms: f64,
    /// How each router replica learns the engines' own load (running plus
    /// waiting requests), which it adds to its own counts: `off` (its own
    /// counts only), `oracle` (every decision sees every engine's load as
    /// it is), or a poll interval in milliseconds (the router's default,
    /// 50).
    #[arg(long, default_value = "50", value_parser = parse_polling)]
    load_poll_ms: PollSpec,
    /// A heterogeneous fleet: the first N engines of the policy's pool run
    /// --slow-factor times slower.
    #[arg(long, default_value_t = 0)]
    slow_engines: usize,
    /// How much slower the --slow-engines are (every latency cost times
    /// this; at least 1).
    #[arg(long, default_value_t = 2.0)]
    slow_factor: f64,
    /// kv_aware's expected cost: KV blocks of prefill work one in-flight
    /// request is worth (default: lb-policies' `DEFAULT_LOAD_WEIGHT`).
    #[arg(long)]
    load_weight: Option<f64>,
    /// kv_aware's expected cost: how much more a block costs on an engine
    /// whose KV cache is nearly full (default: lb-policies'
    /// `DEFAULT_EVICTION_WEIGHT`; 0 ignores cache usage).
    #[arg(long)]
    eviction_weight: Option<f64>,
    /// kv_aware's softmax temperature over costs, in units of one whole
    /// prefill of the request; 0 (default) takes the least cost.
    #[arg(long)]
    router_temperature: Option<f64>,
    /// kv_aware's overload state: the mean of the engines' waiting counts
    /// at which it enters (0: never; default: lb-policies'
    /// `DEFAULT_OVERLOAD_ENTER`).
    #[arg(long)]
    overload_enter: Option<f64>,
    /// kv_aware's overload state: the mean waiting count at which it
    /// leaves (default: lb-policies' `DEFAULT_OVERLOAD_LEAVE`).
    #[arg(long)]
    overload_leave: Option<f64>,
    /// Whether the router replicas share their routing choices, as
    /// replicas started with `--router-peers` do: `off`, or the
    /// milliseconds from a choice to its arrival at the other replicas
    /// (default 10: the router's 5 ms batches plus a network hop).
    #[arg(long, default_value = "10", value_parser = parse_sync)]
    replica_sync_ms: SyncSpec,
    /// Milliseconds from sending a load poll to applying its answers.
    #[arg(long, default_value_t = 1.0)]
    load_poll_delay_ms: f64,
    /// Simulations run in parallel (each run is single-threaded; results
    /// do not depend on this). Default: available cores.
    #[arg(long)]
    threads: Option<usize>,
}

/// `--load-poll-ms`: off, oracle, or an interval in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
enum PollSpec {
    Off,
    Oracle,
    Every(f64),
}

/// `--replica-sync-ms`: off, or a delay in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
enum SyncSpec {
    Off,
    After(f64),
}

fn parse_sync(s: &str) -> Result<SyncSpec, String> {
    match s {
        "off" => Ok(SyncSpec::Off),
        ms => match ms.parse::<f64>() {
            Ok(ms) if ms.is_finite() && ms >= 0.0 => Ok(SyncSpec::After(ms)),
            _ => Err(format!(
                "expected off or a number of milliseconds >= 0, got {s:?}"
            )),
        },
    }
}

fn parse_polling(s: &str) -> Result<PollSpec, String> {
    match s {
        "off" => Ok(PollSpec::Off),
        "oracle" | "0" => Ok(PollSpec::Oracle),
        ms => match ms.parse::<f64>() {
            Ok(ms) if ms.is_finite() && ms > 0.0 => Ok(PollSpec::Every(ms)),
            _ => Err(format!(
                "expected off, oracle or a positive number of milliseconds, got {s:?}"
            )),
        },
    }
}

fn parse_split(s: &str) -> Result<PdSplit, String> {
    let (p, d) = s
        .split_once(':')
        .ok_or_else(|| format!("expected PREFILL:DECODE such as 4:4, got {s:?}"))?;
    let count = |x: &str| {
        x.trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("expected a positive engine count, got {x:?} in {s:?}"))
    };
    Ok(PdSplit {
        prefill: count(p)?,
        decode: count(d)?,
    })
}

/// One workload with the engine setup it runs on.
struct Scenario {
    name: String,
    description: String,
    trace: PreparedTrace,
    config: SimConfig,
    /// Its own default policies (when --policies is not given).
    policies: Option<Vec<String>>,
}

/// The comparison the templated workload exists for.
const TEMPLATED_POLICIES: [&str; 3] = ["round_robin", "cache_aware", "cache_aware:tokens"];

/// Requests per workload under `--quick`.
const QUICK_REQUESTS: usize = 1_500;
/// Default arrival rate of multi_turn_pd: just above what 2 prefill + 6
/// decode engines sustain under round robin.
const PD_RATE: f64 = 230.0;

const KNOWN_WORKLOADS: [&str; 4] = ["multi_turn", "radix", "multi_turn_pd", "templated"];
/// What `--workload all` runs.
const ALL_WORKLOADS: [&str; 3] = ["multi_turn", "radix", "multi_turn_pd"];

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("simulate: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    let policies: Vec<String> = match &args.policies {
        Some(list) => list.iter().map(|p| p.trim().to_owned()).collect(),
        None => DEFAULT_POLICIES.iter().map(|p| (*p).to_owned()).collect(),
    };
    for policy in policies.iter().chain([&args.decode_policy]) {
        if !lb_policies_known(policy) {
            return Err(format!(
                "unknown policy {policy:?}; known: {}, {}",
                affinity_router::policies::BUILTIN_POLICIES.join(", "),
                affinity_router::policies::INDEX_POLICIES.join(", ")
            ));
        }
    }
    if args.workers == 0 {
        return Err("--workers must be at least 1".to_owned());
    }
    if args.replicas == 0 {
        return Err("--replicas must be at least 1".to_owned());
    }
    if args.kv_blocks == Some(0) {
        return Err("--kv-blocks must be at least 1".to_owned());
    }
    if !(args.kv_event_delay_ms.is_finite() && args.kv_event_delay_ms >= 0.0) {
        return Err(format!(
            "--kv-event-delay-ms must be a non-negative number, got {}",
            args.kv_event_delay_ms
        ));
    }
    if !(args.load_poll_delay_ms.is_finite() && args.load_poll_delay_ms >= 0.0) {
        return Err(format!(
            "--load-poll-delay-ms must be a non-negative number, got {}",
            args.load_poll_delay_ms
        ));
    }
    if let Some(rate) = args.rate
        && !(rate.is_finite() && rate > 0.0)
    {
        return Err(format!("--rate must be a positive number, got {rate}"));
    }
    let selected: Vec<&str> = if args.workload == "all" {
        ALL_WORKLOADS.to_vec()
    } else if args.workload == "none" {
        Vec::new()
    } else {
        let list: Vec<&str> = args.workload.split(',').map(str::trim).collect();
        if let Some(bad) = list.iter().find(|w| !KNOWN_WORKLOADS.contains(w)) {
            return Err(format!(
                "unknown workload {bad:?}; known: {}, all",
                KNOWN_WORKLOADS.join(", ")
            ));
        }
        list
    };

    let scenarios = build_scenarios(args, &selected)?;
    if scenarios.is_empty() {
        return Err("nothing to run: give a workload or --trace".to_owned());
    }
    let reports = run_all(args, &scenarios, &policies)?;

    let mut markdown = String::new();
    for scenario in &scenarios {
        let rows: Vec<&RunReport> = reports
            .iter()
            .filter(|r| r.workload == scenario.name)
            .collect();
        let table = report::markdown_table(&rows);
        println!("\n{} — {}\n\n{table}", scenario.name, scenario.description);
        let headline = headlines(&scenario.name, &rows);
        if !headline.is_empty() {
            println!("{headline}");
        }
        markdown.push_str(&format!(
            "### {}\n\n{}\n\n{table}\n{headline}\n",
            scenario.name, scenario.description
        ));
    }
    if let Some(dir) = &args.out {
        write_outputs(dir, &scenarios, &reports, &markdown)?;
        println!("wrote {}", dir.display());
    }
    if args.json {
        println!("{}", report::json_summary(&reports));
    }
    Ok(())
}

fn lb_policies_known(label: &str) -> bool {
    use affinity_router::policies::{BUILTIN_POLICIES, INDEX_POLICIES};
    split_policy(label)
        .is_ok_and(|(name, _)| BUILTIN_POLICIES.contains(&name) || INDEX_POLICIES.contains(&name))
}

fn build_scenarios(args: &Args, selected: &[&str]) -> Result<Vec<Scenario>, String> {
    let mut base = SimConfig {
        workers: args.workers,
        decode_policy: args.decode_policy.clone(),
        seed: args.seed,
        drained: args.drain,
        late_decode_choice: !args.arrival_decode_choice,
        replicas: args.replicas,
        kv_event_delay: std::time::Duration::from_secs_f64(args.kv_event_delay_ms / 1e3),
        load_polling: match args.load_poll_ms {
            PollSpec::Off => LoadPolling::Off,
            PollSpec::Oracle => LoadPolling::Oracle,
            PollSpec::Every(ms) => LoadPolling::Every {
                interval: std::time::Duration::from_secs_f64(ms / 1e3),
                delay: std::time::Duration::from_secs_f64(args.load_poll_delay_ms / 1e3),
            },
        },
        ..SimConfig::default()
    };
    if let Some(blocks) = args.kv_blocks {
        base.model.num_blocks = blocks;
    }
    if !(args.slow_factor.is_finite() && args.slow_factor >= 1.0) {
        return Err(format!(
            "--slow-factor must be a number >= 1, got {}",
            args.slow_factor
        ));
    }
    base.slow_engines = args.slow_engines;
    base.slow_factor = args.slow_factor;
    if let Some(weight) = args.eviction_weight {
        base.cache_aware.cost.eviction_weight = weight;
    }
    if let Some(weight) = args.load_weight {
        base.cache_aware.cost.load_weight = weight;
    }
    if let Some(temperature) = args.router_temperature {
        base.cache_aware.cost.temperature = temperature;
    }
    if let Some(enter) = args.overload_enter {
        base.cache_aware.cost.overload_enter = enter;
    }
    if let Some(leave) = args.overload_leave {
        base.cache_aware.cost.overload_leave = leave;
    }
    base.replica_sync = match args.replica_sync_ms {
        SyncSpec::Off => None,
        SyncSpec::After(ms) => Some(std::time::Duration::from_secs_f64(ms / 1e3)),
    };
    base.cache_aware
        .cost
        .validate()
        .map_err(|e| e.to_string())?;
    if let Some(abs) = args.balance_abs {
        base.cache_aware.balance_abs_threshold = abs;
    }
    if let Some(rel) = args.balance_rel {
        base.cache_aware.balance_rel_threshold = rel;
    }
    base.cache_aware.validate().map_err(|e| e.to_string())?;
    let mut scenarios = Vec::new();
    for &name in selected {
        let scenario = match name {
            "multi_turn" | "multi_turn_pd" => {
                let pd = name == "multi_turn_pd";
                let defaults = workload::MultiTurnConfig::default();
                let config = workload::MultiTurnConfig {
                    requests: args.requests.unwrap_or(if args.quick {
                        QUICK_REQUESTS
                    } else {
                        defaults.requests
                    }),
                    rate: args
                        .rate
                        .unwrap_or(if pd { PD_RATE } else { defaults.rate }),
                    seed: args.seed,
                    active_sessions: args.sessions.unwrap_or(defaults.active_sessions),
                    system_prompt_tokens: args
                        .system_prompt_tokens
                        .unwrap_or(defaults.system_prompt_tokens),
                    ..defaults
                };
                let mut trace = workload::multi_turn(&config);
                let sim = SimConfig {
                    pd: pd.then_some(args.pd),
                    ..base.clone()
                };
                let engines = match sim.pd {
                    Some(split) => format!(
                        "{} prefill + {} decode engines (decode policy `{}`, decode worker chosen {})",
                        split.prefill,
                        split.decode,
                        sim.decode_policy,
                        if sim.late_decode_choice {
                            "when the prefill completes"
                        } else {
                            "at arrival with the prefill worker"
                        }
                    ),
                    None => format!("{} engines", sim.workers),
                };
                trace.name = name.to_owned();
                Scenario {
                    name: name.to_owned(),
                    description: format!(
                        "{} requests at {} req/s (Poisson), {} sessions open at a time over {} system prompts of {} tokens, {}-{} turns, {}-{} output tokens; {engines}; seed {}.",
                        config.requests,
                        config.rate,
                        config.active_sessions,
                        config.system_prompts,
                        config.system_prompt_tokens,
                        config.turns.0,
                        config.turns.1,
                        config.output_tokens.0,
                        config.output_tokens.1,
                        args.seed
                    ),
                    trace: PreparedTrace::new(&trace, &sim.model),
                    config: sim,
                    policies: None,
                }
            }
            "templated" => {
                let defaults = workload::TemplatedConfig::default();
                let config = workload::TemplatedConfig {
                    requests: args.requests.unwrap_or(if args.quick {
                        QUICK_REQUESTS
                    } else {
                        defaults.requests
                    }),
                    rate: args.rate.unwrap_or(defaults.rate),
                    seed: args.seed,
                    active_sessions: args.sessions.unwrap_or(defaults.active_sessions),
                    block_size: base.model.block_size,
                    ..defaults
                };
                let generated = workload::templated(&config)
                    .map_err(|e| format!("templated: building the test model: {e}"))?;
                let mut sim = base.clone();
                sim.model.num_blocks = args.kv_blocks.unwrap_or(workload::TEMPLATED_NUM_BLOCKS);
                Scenario {
                    name: name.to_owned(),
                    description: format!(
                        "{} chat requests at {} req/s (Poisson), {} sessions open at a time, {}-{} turns; each session has one of {} system prompts of {} words and one of {} tool sets; the engines render the Llama 3 chat template (tools in the system header, \"Today Date\" changing at {:.1} s) and tokenize with a byte-level BPE trained on a fixed corpus; user messages are k×{}−1 tokens (k {}-{}), {}-{} output tokens; {} engines of {} KV blocks; seed {}.",
                        config.requests,
                        config.rate,
                        config.active_sessions,
                        config.turns.0,
                        config.turns.1,
                        config.system_prompts,
                        config.system_prompt_words,
                        config.tool_sets,
                        config.day_change().as_secs_f64(),
                        config.block_size,
                        config.user_blocks.0,
                        config.user_blocks.1,
                        config.output_tokens.0,
                        config.output_tokens.1,
                        sim.workers,
                        sim.model.num_blocks,
                        args.seed
                    ),
                    trace: generated.prepare(&sim.model),
                    config: sim,
                    policies: Some(TEMPLATED_POLICIES.iter().map(|p| (*p).to_owned()).collect()),
                }
            }
            "radix" => {
                let defaults = workload::RadixConfig::default();
                let config = workload::RadixConfig {
                    requests: args
                        .requests
                        .unwrap_or(if args.quick {
                            QUICK_REQUESTS
                        } else {
                            defaults.requests
                        })
                        .min(radix_affinity_warm()),
                    rate: args.rate.unwrap_or(defaults.rate),
                    seed: args.seed,
                    ..defaults
                };
                let trace = workload::radix(&config);
                Scenario {
                    name: name.to_owned(),
                    description: format!(
                        "the first {} requests of the radix-affinity workload's set W (256 system prompts of 2,000 chars, Zipf 1.1), no session key, at {} req/s (Poisson), {}-{} output tokens; {} engines; seed {}.",
                        config.requests,
                        config.rate,
                        config.output_tokens.0,
                        config.output_tokens.1,
                        base.workers,
                        args.seed
                    ),
                    trace: PreparedTrace::new(&trace, &base.model),
                    config: base.clone(),
                    policies: None,
                }
            }
            _ => unreachable!("workload names are checked"),
        };
        scenarios.push(scenario);
    }
    if args.drain > 0 {
        for scenario in &mut scenarios {
            scenario.description.push_str(&format!(
                " {} of the policy's engines drained before the run (members with load 0 that take no request).",
                args.drain
            ));
        }
    }
    let kv_aware = args
        .policies
        .iter()
        .flatten()
        .any(|p| split_policy(p.trim()).is_ok_and(|(name, _)| name.starts_with("kv_aware")));
    for scenario in &mut scenarios {
        if args.replicas > 1 {
            scenario.description.push_str(&format!(
                " Requests dealt round robin to {} router replicas, each with its own policy state and in-flight counts.",
                args.replicas
            ));
        }
        match args.load_poll_ms {
            PollSpec::Off => {}
            PollSpec::Oracle => scenario.description.push_str(
                " Every decision sees every engine's own load count (running plus waiting) as it is.",
            ),
            PollSpec::Every(ms) => scenario.description.push_str(&format!(
                " Each replica polls every engine's load every {ms} ms (answers applied {} ms after the poll).",
                args.load_poll_delay_ms
            )),
        }
        if let Some(blocks) = args.kv_blocks {
            scenario.description.push_str(&format!(
                " {blocks} KV blocks of {} tokens per engine.",
                base.model.block_size
            ));
        }
        if kv_aware {
            scenario.description.push_str(&format!(
                " kv_aware sees an engine's KV events {} ms after the scheduler step that produced them ends.",
                args.kv_event_delay_ms
            ));
        }
    }
    if let Some(path) = &args.trace {
        let trace: Trace =
            trace::load_jsonl(path, base.model.chars_per_token).map_err(|e| e.to_string())?;
        scenarios.push(Scenario {
            name: trace.name.clone(),
            description: format!(
                "{} requests replayed from {}; {} engines.",
                trace.requests.len(),
                path.display(),
                base.workers
            ),
            trace: PreparedTrace::new(&trace, &base.model),
            config: base.clone(),
            policies: None,
        });
    }
    Ok(scenarios)
}

fn radix_affinity_warm() -> usize {
    affinity_router::radix::workload::WARM_REQUESTS
}

/// Runs every (scenario, policy) pair on `--threads` threads behind one
/// progress bar; results come back in (scenario, policy) order.
fn run_all(
    args: &Args,
    scenarios: &[Scenario],
    policies: &[String],
) -> Result<Vec<RunReport>, String> {
    let jobs: Vec<(usize, &str)> = scenarios
        .iter()
        .enumerate()
        .flat_map(|(s, scenario)| {
            let own = match (&args.policies, &scenario.policies) {
                (None, Some(own)) => own.as_slice(),
                _ => policies,
            };
            own.iter().map(move |p| (s, p.as_str()))
        })
        .collect();
    let total: usize = jobs.iter().map(|&(s, _)| scenarios[s].trace.len()).sum();
    let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
        .clamp(1, jobs.len().max(1));
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<RunReport, String>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(s, policy)) = jobs.get(j) else {
                        break;
                    };
                    let scenario = &scenarios[s];
                    let reported = AtomicUsize::new(0);
                    let progress = |done: usize| {
                        let before = reported.swap(done, Ordering::Relaxed);
                        bar.inc(done.saturating_sub(before) as u64);
                    };
                    bar.set_message(format!("{} / {policy}", scenario.name));
                    let outcome = simulate(&scenario.trace, policy, &scenario.config, &progress)
                        .map_err(|e| format!("{} / {policy}: {e}", scenario.name));
                    if let Ok(mut slots) = results.lock() {
                        slots[j] = Some(outcome);
                    }
                }
            });
        }
    });
    bar.finish_and_clear();
    let slots = results.into_inner().unwrap_or_default();
    let mut reports = Vec::with_capacity(slots.len());
    let mut failures = Vec::new();
    for slot in slots {
        match slot {
            Some(Ok(report)) => reports.push(report),
            Some(Err(message)) => failures.push(message),
            None => failures.push("a run did not finish".to_owned()),
        }
    }
    if failures.is_empty() {
        Ok(reports)
    } else {
        Err(failures.join("; "))
    }
}

/// The ratios the docs quote, for the policies present.
fn headlines(workload: &str, rows: &[&RunReport]) -> String {
    let mut out = String::new();
    for row in rows
        .iter()
        .filter(|r| r.policy.starts_with("cache_aware") || r.policy.starts_with("kv_aware"))
    {
        let reasons: Vec<String> = row
            .decisions
            .iter()
            .map(|(reason, n)| format!("{reason} {n}"))
            .collect();
        out.push_str(&format!(
            "- {workload}: `{}` decisions: {}\n",
            row.policy,
            reasons.join(", ")
        ));
    }
    let pairs: &[(&str, &str)] = &[
        ("cache_aware", "round_robin"),
        ("cache_aware", "least_loaded"),
        ("cache_aware", "power_of_two"),
        ("cache_aware", "consistent_hash"),
        ("cache_aware", "cache_aware_fleet_gate"),
        ("cache_aware:tokens", "round_robin"),
        ("cache_aware:tokens", "cache_aware"),
        ("kv_aware", "round_robin"),
        ("kv_aware", "cache_aware:tokens"),
    ];
    for &(policy, baseline) in pairs {
        if let Some(r) = report::ratios(rows, policy, baseline) {
            out.push_str(&format!(
                "- {workload}: `{policy}` vs `{baseline}`: hit rate ×{:.2}, throughput ×{:.2}, TTFT p50 {:.2}× faster, TTFT p99 {:.2}× faster\n",
                r.hit_rate, r.throughput, r.ttft_p50_speedup, r.ttft_p99_speedup
            ));
        }
    }
    out
}

fn write_outputs(
    dir: &Path,
    scenarios: &[Scenario],
    reports: &[RunReport],
    markdown: &str,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let md = dir.join("simulation.md");
    std::fs::write(&md, markdown).map_err(|e| format!("cannot write {}: {e}", md.display()))?;
    for scenario in scenarios {
        let rows: Vec<&RunReport> = reports
            .iter()
            .filter(|r| r.workload == scenario.name)
            .collect();
        if rows.is_empty() {
            continue;
        }
        let name = &scenario.name;
        bar_chart(
            &dir.join(format!("{name}-hit-rate.svg")),
            &format!("{name}: prefix-cache hit rate (% of prompt tokens)"),
            &rows,
            &[("hit rate", |r| r.metrics.hit_rate * 100.0)],
        )?;
        bar_chart(
            &dir.join(format!("{name}-ttft.svg")),
            &format!("{name}: time to first token (ms)"),
            &rows,
            &[
                ("p50", |r| r.metrics.ttft_p50_ms),
                ("p90", |r| r.metrics.ttft_p90_ms),
                ("p99", |r| r.metrics.ttft_p99_ms),
            ],
        )?;
        load_chart(
            &dir.join(format!("{name}-load.svg")),
            &format!("{name}: in-flight requests per worker over time"),
            &rows,
        )?;
    }
    Ok(())
}

type Metric = fn(&RunReport) -> f64;

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Grouped bars: one group per policy, one bar per metric.
fn bar_chart(
    path: &Path,
    title: &str,
    rows: &[&RunReport],
    metrics: &[(&str, Metric)],
) -> Result<(), String> {
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (960, 420)).into_drawing_area();
        root.fill(&WHITE)?;
        let top = rows
            .iter()
            .flat_map(|r| metrics.iter().map(move |(_, m)| m(r)))
            .fold(0.0f64, f64::max)
            .max(1e-9)
            * 1.1;
        let n = rows.len();
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..n as f64, 0.0..top)?;
        let labels: Vec<String> = rows.iter().map(|r| r.policy.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_label_formatter(&|v| format!("{v:.0}"))
            .x_labels(n * 2 + 1)
            .x_label_formatter(&|x| {
                let i = x.floor() as usize;
                if (x - x.floor() - 0.5).abs() < 1e-6 {
                    labels.get(i).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .draw()?;
        let width = 0.8 / metrics.len() as f64;
        for (k, (label, metric)) in metrics.iter().enumerate() {
            let color = PALETTE[k % PALETTE.len()];
            chart
                .draw_series(rows.iter().enumerate().map(|(i, r)| {
                    let x0 = i as f64 + 0.1 + k as f64 * width;
                    Rectangle::new([(x0, 0.0), (x0 + width * 0.9, metric(r))], color.filled())
                }))?
                .label(*label)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
                });
        }
        if metrics.len() > 1 {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()?;
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| format!("cannot draw {}: {e}", path.display()))
}

/// One panel per policy: each worker's in-flight load over time.
fn load_chart(path: &Path, title: &str, rows: &[&RunReport]) -> Result<(), String> {
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let cols = 2usize;
        let panels = rows.len().div_ceil(cols);
        let root = SVGBackend::new(path, (960, 40 + 240 * panels as u32)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 20))?;
        let areas = root.split_evenly((panels, cols));
        let t_max = rows
            .iter()
            .filter_map(|r| r.load_timeline.times.last().copied())
            .fold(0.0f64, f64::max)
            .max(1e-3);
        let l_max = rows
            .iter()
            .flat_map(|r| r.load_timeline.loads.iter().flatten().copied())
            .max()
            .unwrap_or(1)
            .max(1) as f64
            * 1.05;
        for (area, report) in areas.iter().zip(rows) {
            let mut chart = ChartBuilder::on(area)
                .caption(&report.policy, ("sans-serif", 15))
                .margin(8)
                .x_label_area_size(36)
                .y_label_area_size(48)
                .build_cartesian_2d(0.0..t_max, 0.0..l_max)?;
            chart
                .configure_mesh()
                .x_desc("model time (s)")
                .y_desc("in flight")
                .x_label_formatter(&|v| format!("{v:.0}"))
                .y_label_formatter(&|v| format!("{v:.0}"))
                .light_line_style(WHITE)
                .draw()?;
            let timeline = &report.load_timeline;
            for (w, series) in timeline.loads.iter().enumerate() {
                let color = PALETTE[w % PALETTE.len()];
                chart.draw_series(LineSeries::new(
                    timeline
                        .times
                        .iter()
                        .zip(series)
                        .map(|(&t, &l)| (t, l as f64)),
                    color.stroke_width(1),
                ))?;
            }
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| format!("cannot draw {}: {e}", path.display()))
}
