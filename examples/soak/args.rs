//! The command line

use std::path::PathBuf;

use clap::Parser;

/// Soak the reference router with unique ~1 KB chat prompts and report its
/// memory and latency over time.
///
/// Router flags after `--` are passed to every run's router, e.g.
/// `soak --policies round_robin,cache_aware -- --max-tree-size 16777216`.
#[derive(Debug, Parser)]
#[command(name = "soak")]
pub(super) struct Args {
    /// Seconds of load per run (the run then stops by itself).
    #[arg(long, default_value_t = 60)]
    pub(super) duration: u64,
    /// engine-sim worker processes per run.
    #[arg(long, default_value_t = 2)]
    pub(super) workers: usize,
    /// Keep-alive connections sending requests back to back.
    #[arg(long, default_value_t = 32)]
    pub(super) connections: usize,
    /// Threads of the load generator's runtime (the probe has its own).
    #[arg(long, default_value_t = 1)]
    pub(super) threads: usize,
    /// Policies to compare, comma-separated: one run each, with the flags
    /// after `--`. Default: cache_aware (the router's default).
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
    /// A run given as "POLICY [ROUTER FLAGS]", e.g.
    /// "cache_aware --max-tree-size 16777216"; repeatable, after the
    /// --policies runs. The flags after `--` are added to it.
    #[arg(long = "run", value_name = "SPEC")]
    runs: Vec<String>,
    /// Bytes of text after the random number in each user message.
    #[arg(long, default_value_t = 1024)]
    pub(super) prompt_bytes: usize,
    /// Bytes of a fixed system message sent before each user message (0:
    /// no system message).
    #[arg(long, default_value_t = 0)]
    pub(super) system_prompt_bytes: usize,
    /// max_tokens of every request.
    #[arg(long, default_value_t = 8)]
    pub(super) max_tokens: u32,
    /// Milliseconds between two probes.
    #[arg(long, default_value_t = 50)]
    pub(super) probe_interval_ms: u64,
    /// A probe slower than this many milliseconds is counted as slow.
    #[arg(long, default_value_t = 100)]
    pub(super) probe_slow_ms: u64,
    /// The model name sent in requests (engine-sim serves sim-model).
    #[arg(long, default_value = "sim-model")]
    pub(super) model: String,
    /// Seed of the prompts' random numbers.
    #[arg(long, default_value_t = 1)]
    pub(super) seed: u64,
    /// Write the per-second series of every run to this CSV file.
    #[arg(long, value_name = "FILE")]
    pub(super) series: Option<PathBuf>,
    /// Print each run's summary as one JSON line on stdout (everything
    /// else goes to stderr).
    #[arg(long)]
    pub(super) json: bool,
    /// Seconds between progress lines on stderr (0: none).
    #[arg(long, default_value_t = 10)]
    pub(super) progress_secs: u64,
    /// The reference router's binary (default: `examples/router` next to
    /// this example, in the same target profile).
    #[arg(long, value_name = "PATH")]
    pub(super) router_bin: Option<PathBuf>,
    /// The engine-sim binary (default: `engine-sim` in this example's
    /// target profile directory).
    #[arg(long, value_name = "PATH")]
    pub(super) engine_bin: Option<PathBuf>,
    /// Extra engine-sim flags, whitespace-separated (e.g. "--num-blocks
    /// 8192"); --host, --port and --time-scale are set by the soak.
    #[arg(
        long,
        value_name = "FLAGS",
        default_value = "",
        allow_hyphen_values = true
    )]
    pub(super) engine_flags: String,
    /// Keep the children's output in this directory (default: a temporary
    /// directory, removed at the end unless a run failed).
    #[arg(long, value_name = "DIR")]
    pub(super) log_dir: Option<PathBuf>,
    /// Router flags added to every run.
    #[arg(last = true, value_name = "ROUTER FLAGS")]
    router_flags: Vec<String>,
}

/// Flags the soak sets itself: the router and the engines bind 127.0.0.1 on
/// free ports, the workers are the soak's, the policy is the run's.
const RESERVED_ROUTER_FLAGS: &[&str] = &[
    "--host",
    "--port",
    "--worker-urls",
    "--policy",
    "--prometheus-host",
];
const RESERVED_ENGINE_FLAGS: &[&str] = &["--host", "--port", "--time-scale"];

/// One router configuration to measure.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct RunSpec {
    pub(super) policy: String,
    pub(super) flags: Vec<String>,
}

impl RunSpec {
    /// The row label: the policy and its flags.
    pub(super) fn label(&self) -> String {
        if self.flags.is_empty() {
            self.policy.clone()
        } else {
            format!("{} {}", self.policy, self.flags.join(" "))
        }
    }
}

/// Checks that `flags` set none of `reserved` (as `--flag` or `--flag=v`).
fn refuse_reserved(flags: &[String], reserved: &[&str], whose: &str) -> Result<(), String> {
    for flag in flags {
        let name = flag.split_once('=').map_or(flag.as_str(), |(n, _)| n);
        if reserved.contains(&name) {
            return Err(format!(
                "{whose} flag {name} is set by the soak itself (everything binds 127.0.0.1 on free ports)"
            ));
        }
    }
    Ok(())
}

fn check_policy(policy: &str) -> Result<(), String> {
    let ok = !policy.is_empty()
        && !policy.starts_with('-')
        && policy
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{policy:?} is not a policy name (round_robin, cache_aware, ...)"
        ))
    }
}

/// The runs of a command line: `--policies` first, then `--run`, each with
/// the flags after `--`; cache_aware alone when neither is given.
pub(super) fn run_specs(args: &Args) -> Result<Vec<RunSpec>, String> {
    refuse_reserved(&args.router_flags, RESERVED_ROUTER_FLAGS, "router")?;
    let mut specs = Vec::new();
    for policy in &args.policies {
        let policy = policy.trim();
        check_policy(policy)?;
        specs.push(RunSpec {
            policy: policy.to_owned(),
            flags: args.router_flags.clone(),
        });
    }
    for run in &args.runs {
        let mut words = run.split_whitespace().map(str::to_owned);
        let policy = words
            .next()
            .ok_or_else(|| "--run needs a policy name, e.g. --run cache_aware".to_owned())?;
        check_policy(&policy)?;
        let mut flags: Vec<String> = words.collect();
        refuse_reserved(&flags, RESERVED_ROUTER_FLAGS, "router")?;
        flags.extend(args.router_flags.iter().cloned());
        specs.push(RunSpec { policy, flags });
    }
    if specs.is_empty() {
        specs.push(RunSpec {
            policy: "cache_aware".to_owned(),
            flags: args.router_flags.clone(),
        });
    }
    Ok(specs)
}

pub(super) fn check_args(args: &Args) -> Result<(), String> {
    if !(1..=86_400).contains(&args.duration) {
        return Err("--duration must be 1 to 86400 seconds".into());
    }
    if !(1..=1024).contains(&args.workers) {
        return Err("--workers must be 1 to 1024".into());
    }
    if !(1..=4096).contains(&args.connections) {
        return Err("--connections must be 1 to 4096".into());
    }
    if !(1..=64).contains(&args.threads) {
        return Err("--threads must be 1 to 64".into());
    }
    if args.prompt_bytes > 1 << 20 || args.system_prompt_bytes > 1 << 20 {
        return Err("--prompt-bytes and --system-prompt-bytes must be at most 1 MiB".into());
    }
    if !(1..=60_000).contains(&args.probe_interval_ms) {
        return Err("--probe-interval-ms must be 1 to 60000".into());
    }
    if args.max_tokens == 0 {
        return Err("--max-tokens must be at least 1".into());
    }
    if args.model.is_empty()
        || args.model.contains(['"', '\\'])
        || args.model.chars().any(char::is_control)
    {
        return Err("--model must be a plain, non-empty name".into());
    }
    let engine_flags: Vec<String> = args
        .engine_flags
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    refuse_reserved(&engine_flags, RESERVED_ENGINE_FLAGS, "engine-sim")?;
    Ok(())
}
