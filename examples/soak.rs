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

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read as _, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde_json::json;

/// Soak the reference router with unique ~1 KB chat prompts and report its
/// memory and latency over time.
///
/// Router flags after `--` are passed to every run's router, e.g.
/// `soak --policies round_robin,cache_aware -- --max-tree-size 16777216`.
#[derive(Debug, Parser)]
#[command(name = "soak")]
struct Args {
    /// Seconds of load per run (the run then stops by itself).
    #[arg(long, default_value_t = 60)]
    duration: u64,
    /// engine-sim worker processes per run.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Keep-alive connections sending requests back to back.
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// Threads of the load generator's runtime (the probe has its own).
    #[arg(long, default_value_t = 1)]
    threads: usize,
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
    prompt_bytes: usize,
    /// Bytes of a fixed system message sent before each user message (0:
    /// no system message).
    #[arg(long, default_value_t = 0)]
    system_prompt_bytes: usize,
    /// max_tokens of every request.
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    /// Milliseconds between two probes.
    #[arg(long, default_value_t = 50)]
    probe_interval_ms: u64,
    /// A probe slower than this many milliseconds is counted as slow.
    #[arg(long, default_value_t = 100)]
    probe_slow_ms: u64,
    /// The model name sent in requests (engine-sim serves sim-model).
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Seed of the prompts' random numbers.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the per-second series of every run to this CSV file.
    #[arg(long, value_name = "FILE")]
    series: Option<PathBuf>,
    /// Print each run's summary as one JSON line on stdout (everything
    /// else goes to stderr).
    #[arg(long)]
    json: bool,
    /// Seconds between progress lines on stderr (0: none).
    #[arg(long, default_value_t = 10)]
    progress_secs: u64,
    /// The reference router's binary (default: `examples/router` next to
    /// this example, in the same target profile).
    #[arg(long, value_name = "PATH")]
    router_bin: Option<PathBuf>,
    /// The engine-sim binary (default: `engine-sim` in this example's
    /// target profile directory).
    #[arg(long, value_name = "PATH")]
    engine_bin: Option<PathBuf>,
    /// Extra engine-sim flags, whitespace-separated (e.g. "--num-blocks
    /// 8192"); --host, --port and --time-scale are set by the soak.
    #[arg(
        long,
        value_name = "FLAGS",
        default_value = "",
        allow_hyphen_values = true
    )]
    engine_flags: String,
    /// Keep the children's output in this directory (default: a temporary
    /// directory, removed at the end unless a run failed).
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
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
struct RunSpec {
    policy: String,
    flags: Vec<String>,
}

impl RunSpec {
    /// The row label: the policy and its flags.
    fn label(&self) -> String {
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
fn run_specs(args: &Args) -> Result<Vec<RunSpec>, String> {
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

fn check_args(args: &Args) -> Result<(), String> {
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

// ---------------------------------------------------------------------------
// Random numbers and request bodies
// ---------------------------------------------------------------------------

/// SplitMix64 (Steele, Lea and Flood): one add and three multiply-xorshift
/// steps per number, plenty for making prompts distinct.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Plain English-like filler, ASCII without quotes or backslashes, so it is
/// valid inside a JSON string as it is.
const FILLER_WORDS: &[&str] = &[
    "the",
    "router",
    "keeps",
    "each",
    "prompt",
    "prefix",
    "where",
    "its",
    "cache",
    "lives",
    "and",
    "a",
    "busy",
    "fleet",
    "sees",
    "many",
    "distinct",
    "users",
    "asking",
    "about",
    "memory",
    "budgets",
    "latency",
    "tails",
    "eviction",
    "of",
    "old",
    "entries",
    "under",
    "load",
    "while",
    "new",
    "requests",
    "arrive",
    "every",
    "millisecond",
    "from",
    "agents",
    "with",
    "long",
];

/// `len` bytes of filler text, deterministic.
fn filler(len: usize, seed: u64) -> String {
    let mut rng = SplitMix64(seed);
    let mut text = String::with_capacity(len + 16);
    while text.len() < len {
        let word = FILLER_WORDS[(rng.next() % FILLER_WORDS.len() as u64) as usize];
        text.push_str(word);
        text.push(' ');
    }
    text.truncate(len);
    text
}

/// A chat completion body with a hole for the number that makes it unique:
/// `head` + decimal number + `tail`.
struct BodyTemplate {
    head: Vec<u8>,
    tail: Vec<u8>,
}

impl BodyTemplate {
    fn new(model: &str, max_tokens: u32, system_bytes: usize, prompt_bytes: usize) -> Self {
        let mut head = format!(r#"{{"model":"{model}","max_tokens":{max_tokens},"messages":["#);
        if system_bytes > 0 {
            let system = filler(system_bytes, 0x5157);
            let _ = write!(head, r#"{{"role":"system","content":"{system}"}},"#);
        }
        head.push_str(r#"{"role":"user","content":""#);
        let text = filler(prompt_bytes, 0x7e57);
        let tail = format!(r#" {text}"}}]}}"#);
        Self {
            head: head.into_bytes(),
            tail: tail.into_bytes(),
        }
    }

    /// The body for `number`, in one allocation.
    fn body(&self, number: u64) -> Bytes {
        let mut out = Vec::with_capacity(self.head.len() + 20 + self.tail.len());
        out.extend_from_slice(&self.head);
        let _ = write!(out, "{number}");
        out.extend_from_slice(&self.tail);
        Bytes::from(out)
    }
}

// ---------------------------------------------------------------------------
// Latency histogram
// ---------------------------------------------------------------------------

/// Sub-buckets per power of two: 64, so a bucket is at most 1/64 (1.6 %)
/// of its values wide.
const SUB_BITS: u32 = 6;
const SUB: usize = 1 << SUB_BITS;
/// Values are microseconds, capped at 2^40 µs (about 12 days).
const MAX_EXP: u32 = 40;
const BUCKETS: usize = (MAX_EXP - SUB_BITS) as usize * SUB + SUB;

/// Log-linear histogram of microseconds on atomic counters: recording is
/// one `fetch_add`, and a reader subtracts two snapshots to get any window.
struct Histogram {
    counts: Box<[AtomicU64]>,
}

fn bucket_of(micros: u64) -> usize {
    let v = micros.min((1 << MAX_EXP) - 1);
    if v < (2 * SUB) as u64 {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros();
    let shift = exp - SUB_BITS;
    (shift as usize + 1) * SUB + ((v >> shift) as usize - SUB)
}

/// The middle of bucket `index`, in microseconds.
fn bucket_value(index: usize) -> u64 {
    if index < 2 * SUB {
        return index as u64;
    }
    let shift = (index / SUB - 1) as u32;
    let low = ((index % SUB + SUB) as u64) << shift;
    low + ((1u64 << shift) >> 1)
}

impl Histogram {
    fn new() -> Self {
        Self {
            counts: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn record(&self, micros: u64) {
        self.counts[bucket_of(micros)].fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

/// Counts of a window: `now - before`, bucket by bucket.
fn window(now: &[u64], before: &[u64]) -> Vec<u64> {
    now.iter()
        .zip(before)
        .map(|(n, b)| n.saturating_sub(*b))
        .collect()
}

/// The `q` quantile (0..=1) of bucket counts, in microseconds (None when
/// empty): the value of the bucket holding the ceil(q * n)-th smallest.
fn quantile(counts: &[u64], q: f64) -> Option<u64> {
    let n: u64 = counts.iter().sum();
    if n == 0 {
        return None;
    }
    let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
    let mut seen = 0;
    for (i, c) in counts.iter().enumerate() {
        seen += c;
        if seen >= rank {
            return Some(bucket_value(i));
        }
    }
    None
}

// ---------------------------------------------------------------------------
// Recording what the clients see
// ---------------------------------------------------------------------------

/// What one kind of client (load or probe) has seen so far.
struct Recorder {
    /// Latencies of 2xx answers, body included.
    latency: Histogram,
    /// Largest latency since the sampler last took it (µs).
    window_max: AtomicU64,
    /// Largest latency of the run (µs).
    max: AtomicU64,
    /// Answers slower than the slow threshold.
    slow: AtomicU64,
    slow_micros: u64,
    /// Non-2xx answers.
    http_errors: AtomicU64,
    /// Connections that could not be opened, broke, or bodies cut short.
    connection_errors: AtomicU64,
    /// The first few errors, as text, for the report.
    samples: Mutex<Vec<String>>,
}

const ERROR_SAMPLES: usize = 5;

impl Recorder {
    fn new(slow_micros: u64) -> Self {
        Self {
            latency: Histogram::new(),
            window_max: AtomicU64::new(0),
            max: AtomicU64::new(0),
            slow: AtomicU64::new(0),
            slow_micros,
            http_errors: AtomicU64::new(0),
            connection_errors: AtomicU64::new(0),
            samples: Mutex::new(Vec::new()),
        }
    }

    fn ok(&self, elapsed: Duration) {
        let micros = elapsed.as_micros().min(u128::from(u64::MAX)) as u64;
        self.latency.record(micros);
        self.window_max.fetch_max(micros, Ordering::Relaxed);
        self.max.fetch_max(micros, Ordering::Relaxed);
        if micros > self.slow_micros {
            self.slow.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn error(&self, connection: bool, what: impl FnOnce() -> String) {
        let counter = if connection {
            &self.connection_errors
        } else {
            &self.http_errors
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        if samples.len() < ERROR_SAMPLES {
            samples.push(what());
        }
    }

    fn errors(&self) -> u64 {
        self.http_errors.load(Ordering::Relaxed) + self.connection_errors.load(Ordering::Relaxed)
    }
}

/// A keep-alive HTTP/1 connection to the router.
async fn connect(addr: SocketAddr) -> Result<SendRequest<Full<Bytes>>, String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP handshake with {addr}: {e}"))?;
    tokio::spawn(async move {
        // The connection's errors also fail its requests, which count them.
        let _ = connection.await;
    });
    Ok(sender)
}

fn chat_request(addr: SocketAddr, body: Bytes) -> http::Request<Full<Bytes>> {
    let mut request = http::Request::new(Full::new(body));
    *request.method_mut() = http::Method::POST;
    *request.uri_mut() = http::Uri::from_static("/v1/chat/completions");
    let headers = request.headers_mut();
    if let Ok(host) = http::HeaderValue::try_from(addr.to_string()) {
        headers.insert(http::header::HOST, host);
    }
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    request
}

/// Largest response body read: a chat completion of a few tokens is well
/// under 1 KiB; more than this is an error, not memory.
const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// Sends one request on `sender` and records it. `Err` when the connection
/// is no longer usable (already counted).
async fn exchange(
    sender: &mut SendRequest<Full<Bytes>>,
    request: http::Request<Full<Bytes>>,
    recorder: &Recorder,
) -> Result<(), ()> {
    if let Err(e) = sender.ready().await {
        recorder.error(true, || format!("connection closed: {e}"));
        return Err(());
    }
    let started = Instant::now();
    let response = match sender.send_request(request).await {
        Ok(response) => response,
        Err(e) => {
            recorder.error(true, || format!("request failed: {e}"));
            return Err(());
        }
    };
    let status = response.status();
    match Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
        .collect()
        .await
    {
        Ok(_) if status.is_success() => {
            recorder.ok(started.elapsed());
            Ok(())
        }
        Ok(body) => {
            recorder.error(false, || {
                let body = body.to_bytes();
                let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
                format!("status {status}: {text}")
            });
            Ok(())
        }
        Err(e) => {
            recorder.error(true, || {
                format!("body cut short or too long (status {status}): {e}")
            });
            Err(())
        }
    }
}

/// One load connection: unique prompts back to back; reconnects (after a
/// short pause, so a dead router is not hammered) when the connection fails.
async fn load_connection(
    addr: SocketAddr,
    template: Arc<BodyTemplate>,
    recorder: Arc<Recorder>,
    seed: u64,
) {
    let mut rng = SplitMix64(seed);
    loop {
        let mut sender = match connect(addr).await {
            Ok(sender) => sender,
            Err(e) => {
                recorder.error(true, || e);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        loop {
            let request = chat_request(addr, template.body(rng.next()));
            if exchange(&mut sender, request, &recorder).await.is_err() {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The probe: one small request every `interval` on its own connection (a
/// late tick waits for the previous probe, as a single user would).
async fn probe_loop(
    addr: SocketAddr,
    model: String,
    max_tokens: u32,
    interval: Duration,
    recorder: Arc<Recorder>,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sender = None;
    let mut n: u64 = 0;
    loop {
        ticks.tick().await;
        n += 1;
        if sender.is_none() {
            match connect(addr).await {
                Ok(s) => sender = Some(s),
                Err(e) => {
                    recorder.error(true, || e);
                    continue;
                }
            }
        }
        let body = json!({
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": format!("probe {n}: how long does one user wait?")}],
        });
        let request = chat_request(addr, Bytes::from(body.to_string()));
        if let Some(s) = sender.as_mut()
            && exchange(s, request, &recorder).await.is_err()
        {
            sender = None;
        }
    }
}

// ---------------------------------------------------------------------------
// Child processes
// ---------------------------------------------------------------------------

/// A child process this soak started; killed by its pid when dropped.
struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Still running? `Err` says how it ended.
    fn check_alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!(
                "{} (pid {}) exited ({status}); its output: {}\n{}",
                self.name,
                self.pid(),
                self.log.display(),
                log_tail(&self.log, 15)
            )),
            Err(e) => Err(format!("cannot check {}: {e}", self.name)),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGKILL to exactly this pid (std's Child::kill), then reap it so
        // no zombie outlives the run. An already exited child is only reaped.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// The last `lines` lines of a log file, indented.
fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Longest stdout line of a child that is looked at for its banner.
const MAX_LINE: u64 = 64 * 1024;

/// Starts `program` with `args`; its stdout and stderr go to `log`, and the
/// first stdout line for which `find` returns `Some` is sent back (then the
/// thread keeps copying, so the child never blocks on a full pipe).
fn spawn_child(
    name: &str,
    program: &Path,
    args: &[String],
    log: PathBuf,
    find: fn(&str) -> Option<String>,
) -> Result<(Proc, std::sync::mpsc::Receiver<String>), String> {
    let err_file = std::fs::File::create(&log)
        .map_err(|e| format!("cannot create the log file {}: {e}", log.display()))?;
    let mut command = Command::new(program);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(err_file));
    die_with_parent(&mut command);
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot start {} ({}): {e}", name, program.display()))?;
    let stdout = child.stdout.take();
    let (found_tx, found_rx) = std::sync::mpsc::channel();
    let log_path = log.clone();
    if let Some(stdout) = stdout {
        std::thread::spawn(move || {
            let mut sink: Box<dyn std::io::Write> =
                match std::fs::OpenOptions::new().append(true).open(&log_path) {
                    Ok(file) => Box::new(file),
                    Err(_) => Box::new(std::io::sink()),
                };
            let mut reader = BufReader::new(stdout);
            let mut line = Vec::new();
            loop {
                line.clear();
                // A line is bounded: a child printing without end cannot
                // make this thread grow.
                match (&mut reader).take(MAX_LINE).read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                let _ = sink.write_all(&line);
                if let Some(found) = find(String::from_utf8_lossy(&line).trim_end()) {
                    let _ = found_tx.send(found);
                    break;
                }
            }
            // Found: the rest goes to the log byte for byte.
            let _ = std::io::copy(&mut reader, &mut sink);
        });
    }
    Ok((
        Proc {
            name: name.to_owned(),
            child,
            log,
        },
        found_rx,
    ))
}

/// On Linux the child gets SIGKILL when the thread that started it (the
/// soak's main thread) dies, even by SIGKILL: nothing survives the soak.
#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: the closure runs in the forked child before exec and calls
    // only prctl, which is async-signal-safe; it touches no memory of the
    // parent and allocates nothing.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut Command) {}

/// `http://127.0.0.1:PORT` from engine-sim's banner
/// ("engine-sim ID (regular) serving MODEL on http://127.0.0.1:PORT").
fn engine_url(line: &str) -> Option<String> {
    let (_, url) = line.rsplit_once(" on ")?;
    (line.starts_with("engine-sim ") && url.starts_with("http://")).then(|| url.trim().to_owned())
}

/// `http://127.0.0.1:PORT` from the router's banner
/// ("affinity-router 0.1.0 serving on http://127.0.0.1:PORT (policy ...)").
fn router_url(line: &str) -> Option<String> {
    let rest = line.split_once(" serving on ")?.1;
    let url = rest.split_whitespace().next()?;
    (line.starts_with("affinity-router ") && url.starts_with("http://")).then(|| url.to_owned())
}

/// Waits for the line `rx` reports, watching the child and the clock.
async fn wait_for_line(
    interrupt: &Interrupt,
    proc: &mut Proc,
    rx: &std::sync::mpsc::Receiver<String>,
    timeout: Duration,
    what: &str,
) -> Result<String, Stop> {
    let deadline = Instant::now() + timeout;
    loop {
        if interrupt.is_set() {
            return Err(Stop::Interrupted);
        }
        if let Ok(line) = rx.try_recv() {
            return Ok(line);
        }
        proc.check_alive()?;
        if Instant::now() > deadline {
            return Err(Stop::Failed(format!(
                "{} (pid {}) did not print {what} within {} s; its output:\n{}",
                proc.name,
                proc.pid(),
                timeout.as_secs(),
                log_tail(&proc.log, 15)
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// GET `path` on a fresh connection; the status code.
async fn get_status(addr: SocketAddr, path: &'static str) -> Result<u16, String> {
    let mut sender = connect(addr).await?;
    let mut request = http::Request::new(Full::new(Bytes::new()));
    *request.uri_mut() = http::Uri::from_static(path);
    if let Ok(host) = http::HeaderValue::try_from(addr.to_string()) {
        request.headers_mut().insert(http::header::HOST, host);
    }
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("GET {path}: {e}"))?;
    let status = response.status().as_u16();
    let _ = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
        .collect()
        .await;
    Ok(status)
}

fn socket_addr(url: &str) -> Result<SocketAddr, String> {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .map_err(|e| format!("cannot read an address from {url:?}: {e}"))
}

// ---------------------------------------------------------------------------
// /proc
// ---------------------------------------------------------------------------

/// A `kB` field of `/proc/PID/status` (VmRSS, VmHWM), in bytes.
fn status_field(status: &str, field: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kb: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
        Some(kb * 1024)
    })
}

fn read_status(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status")).ok()
}

/// CPU time (user + system) of a process, in clock ticks, from
/// `/proc/PID/stat` (fields 14 and 15; the command name may hold spaces,
/// so fields are counted after its closing parenthesis).
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat)
}

fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(unix)]
fn ticks_per_second() -> f64 {
    // SAFETY: sysconf takes a constant and only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as f64 } else { 100.0 }
}

#[cfg(not(unix))]
fn ticks_per_second() -> f64 {
    100.0
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

const MIB: f64 = 1024.0 * 1024.0;

// ---------------------------------------------------------------------------
// One run
// ---------------------------------------------------------------------------

/// The per-second row of the series.
struct Second {
    t: u64,
    requests: u64,
    errors: u64,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    max_ms: f64,
    probes: u64,
    probe_max_ms: f64,
    rss_mib: f64,
}

/// The summary of one run.
struct Summary {
    spec: RunSpec,
    workers: usize,
    connections: usize,
    duration_s: f64,
    requests: u64,
    latency_ms: [Option<f64>; 2],
    max_ms: f64,
    probes: u64,
    probe_ms: [Option<f64>; 2],
    probe_max_ms: f64,
    probes_slow: u64,
    probe_slow_ms: u64,
    http_errors: u64,
    connection_errors: u64,
    probe_errors: u64,
    error_samples: Vec<String>,
    rss_start_mib: f64,
    rss_peak_mib: f64,
    rss_steady_mib: f64,
    vm_hwm_mib: f64,
    rss_samples: usize,
    cpu_router: f64,
    cpu_engines: f64,
    cpu_soak: f64,
    loadavg_start: String,
    loadavg_end: String,
}

impl Summary {
    fn req_per_s(&self) -> f64 {
        self.requests as f64 / self.duration_s.max(1e-9)
    }

    fn errors(&self) -> u64 {
        self.http_errors + self.connection_errors + self.probe_errors
    }

    fn to_json(&self) -> serde_json::Value {
        json!({
            "policy": self.spec.policy,
            "flags": self.spec.flags.join(" "),
            "workers": self.workers,
            "connections": self.connections,
            "duration_s": round(self.duration_s, 2),
            "requests": self.requests,
            "req_per_s": round(self.req_per_s(), 1),
            "latency_ms": {
                "p50": self.latency_ms[0].map(|v| round(v, 3)),
                "p99": self.latency_ms[1].map(|v| round(v, 3)),
                "max": round(self.max_ms, 3),
            },
            "probe_ms": {
                "count": self.probes,
                "p50": self.probe_ms[0].map(|v| round(v, 3)),
                "p99": self.probe_ms[1].map(|v| round(v, 3)),
                "max": round(self.probe_max_ms, 3),
                "over_threshold": self.probes_slow,
                "threshold_ms": self.probe_slow_ms,
            },
            "rss_mib": {
                "start": round(self.rss_start_mib, 1),
                "peak": round(self.rss_peak_mib, 1),
                "steady": round(self.rss_steady_mib, 1),
                "hwm": round(self.vm_hwm_mib, 1),
                "samples": self.rss_samples,
            },
            "errors": self.errors(),
            "http_errors": self.http_errors,
            "connection_errors": self.connection_errors,
            "probe_errors": self.probe_errors,
            "error_samples": self.error_samples,
            "cpu_cores": {
                "router": round(self.cpu_router, 2),
                "engines": round(self.cpu_engines, 2),
                "soak": round(self.cpu_soak, 2),
            },
            "loadavg": {"start": self.loadavg_start, "end": self.loadavg_end},
        })
    }

    fn to_text(&self) -> String {
        let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}"));
        let mut out = format!(
            "soak: {} | {} workers, {} connections, {:.1} s, load average {} -> {}\n",
            self.spec.label(),
            self.workers,
            self.connections,
            self.duration_s,
            self.loadavg_start,
            self.loadavg_end
        );
        let _ = writeln!(
            out,
            "  load:   {} requests, {:.0} req/s; latency ms p50 {} p99 {} max {:.2}",
            self.requests,
            self.req_per_s(),
            ms(self.latency_ms[0]),
            ms(self.latency_ms[1]),
            self.max_ms
        );
        let _ = writeln!(
            out,
            "  probe:  {} probes; latency ms p50 {} p99 {} max {:.2}; {} over {} ms",
            self.probes,
            ms(self.probe_ms[0]),
            ms(self.probe_ms[1]),
            self.probe_max_ms,
            self.probes_slow,
            self.probe_slow_ms
        );
        let _ = writeln!(
            out,
            "  router RSS MiB: start {:.1}, peak {:.1}, steady {:.1} (median of the last 30 % of {} samples), VmHWM {:.1}",
            self.rss_start_mib,
            self.rss_peak_mib,
            self.rss_steady_mib,
            self.rss_samples,
            self.vm_hwm_mib
        );
        let _ = writeln!(
            out,
            "  CPU (cores): router {:.2}, engines {:.2}, soak {:.2}",
            self.cpu_router, self.cpu_engines, self.cpu_soak
        );
        let _ = write!(
            out,
            "  errors: {} (http {}, connection {}, probe {})",
            self.errors(),
            self.http_errors,
            self.connection_errors,
            self.probe_errors
        );
        for sample in &self.error_samples {
            let _ = write!(out, "\n    e.g. {sample}");
        }
        out
    }
}

fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

/// The median of the last 30 % of `samples` (at least one sample).
fn steady(samples: &[f64]) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let take = ((samples.len() as f64 * 0.3).ceil() as usize).max(1);
    let mut tail = samples[samples.len() - take..].to_vec();
    tail.sort_by(f64::total_cmp);
    let mid = tail.len() / 2;
    if tail.len() % 2 == 1 {
        tail[mid]
    } else {
        (tail[mid - 1] + tail[mid]) / 2.0
    }
}

fn to_ms(micros: Option<u64>) -> Option<f64> {
    micros.map(|v| v as f64 / 1000.0)
}

/// A quantile in ms, never above the exact maximum `max_micros` (a
/// bucket's middle can be above the largest value it holds).
fn quantile_ms(counts: &[u64], q: f64, max_micros: u64) -> Option<f64> {
    to_ms(quantile(counts, q).map(|v| v.min(max_micros)))
}

/// Everything a run needs that does not change between runs.
struct Setup {
    router_bin: PathBuf,
    engine_bin: PathBuf,
    engine_flags: Vec<String>,
    log_dir: PathBuf,
    template: Arc<BodyTemplate>,
}

/// Why a run ended early.
enum Stop {
    Failed(String),
    Interrupted,
}

impl From<String> for Stop {
    fn from(message: String) -> Self {
        Stop::Failed(message)
    }
}

/// Set once the soak is asked to stop (Ctrl-C or SIGTERM): every wait of a
/// run watches it, so the run ends, and its children die, at once.
#[derive(Clone)]
struct Interrupt(tokio::sync::watch::Receiver<bool>);

impl Interrupt {
    /// Listens for the signals on the current (control) runtime.
    fn install() -> Self {
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            stop_signal().await;
            let _ = tx.send(true);
        });
        Self(rx)
    }

    fn is_set(&self) -> bool {
        *self.0.borrow()
    }

    async fn wait(&mut self) {
        let _ = self.0.wait_for(|set| *set).await;
    }
}

/// Resolves when the soak is asked to stop (Ctrl-C or SIGTERM).
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn runtime(threads: usize, name: &str) -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the {name} runtime: {e}"))
}

/// One run: fresh engines and router, `--duration` seconds of load, the
/// summary. The children are killed when this returns, whatever happened.
async fn run_one(
    interrupt: &Interrupt,
    args: &Args,
    setup: &Setup,
    index: usize,
    spec: &RunSpec,
    series: &mut Option<std::fs::File>,
) -> Result<Summary, Stop> {
    let loadavg_start = loadavg();
    // Declared before the router: on an early return the router is killed
    // before its engines.
    let mut engines: Vec<Proc> = Vec::with_capacity(args.workers);
    let mut receivers = Vec::with_capacity(args.workers);
    for i in 0..args.workers {
        let mut engine_args: Vec<String> = [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--time-scale",
            "0",
            "--seed",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        engine_args.push(i.to_string());
        engine_args.extend(setup.engine_flags.iter().cloned());
        let log = setup
            .log_dir
            .join(format!("run{}-engine{i}.log", index + 1));
        let (proc, rx) = spawn_child(
            &format!("engine-sim #{i}"),
            &setup.engine_bin,
            &engine_args,
            log,
            engine_url,
        )?;
        engines.push(proc);
        receivers.push(rx);
    }
    let mut urls = Vec::with_capacity(args.workers);
    for (proc, rx) in engines.iter_mut().zip(&receivers) {
        urls.push(wait_for_line(interrupt, proc, rx, Duration::from_secs(30), "its URL").await?);
    }

    let mut router_args: Vec<String> = ["--host", "127.0.0.1", "--port", "0"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    if !spec
        .flags
        .iter()
        .any(|f| f == "--prometheus-port" || f.starts_with("--prometheus-port="))
    {
        router_args.extend(["--prometheus-port".to_owned(), "0".to_owned()]);
    }
    router_args.push("--policy".to_owned());
    router_args.push(spec.policy.clone());
    router_args.extend(spec.flags.iter().cloned());
    // Last: --worker-urls takes every value up to the next flag.
    router_args.push("--worker-urls".to_owned());
    router_args.extend(urls.iter().cloned());
    let log = setup.log_dir.join(format!("run{}-router.log", index + 1));
    let (mut router, rx) = spawn_child("router", &setup.router_bin, &router_args, log, router_url)?;
    let url = wait_for_line(
        interrupt,
        &mut router,
        &rx,
        Duration::from_secs(120),
        "its banner",
    )
    .await?;
    let addr = socket_addr(&url)?;
    let ready_deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if interrupt.is_set() {
            return Err(Stop::Interrupted);
        }
        router.check_alive()?;
        if get_status(addr, "/readiness").await == Ok(200) {
            break;
        }
        if Instant::now() > ready_deadline {
            return Err(Stop::Failed(format!(
                "the router at {url} did not answer /readiness 200 within 60 s; its output:\n{}",
                log_tail(&router.log, 15)
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let router_pid = router.pid();
    let engine_pids: Vec<u32> = engines.iter().map(Proc::pid).collect();
    let rss_of = |pid| read_status(pid).and_then(|s| status_field(&s, "VmRSS"));
    let rss_start = rss_of(router_pid)
        .ok_or_else(|| format!("cannot read /proc/{router_pid}/status (VmRSS)"))?;
    if !args.json {
        eprintln!(
            "run {}: {} on {url} (pid {router_pid}), {} engines; {} s of load",
            index + 1,
            spec.label(),
            args.workers,
            args.duration
        );
    }

    let load = Arc::new(Recorder::new(u64::MAX));
    let probe = Arc::new(Recorder::new(args.probe_slow_ms * 1000));
    let load_rt = runtime(args.threads, "soak-load")?;
    let probe_rt = match runtime(1, "soak-probe") {
        Ok(rt) => rt,
        Err(e) => {
            // Not dropped in place: dropping a runtime blocks, which an
            // async context refuses.
            load_rt.shutdown_background();
            return Err(Stop::Failed(e));
        }
    };
    let ticks = ticks_per_second();
    let cpu = |pids: &[u32]| -> u64 { pids.iter().filter_map(|p| cpu_ticks(*p)).sum() };
    let self_pid = std::process::id();
    let cpu_start = [cpu(&[router_pid]), cpu(&engine_pids), cpu(&[self_pid])];
    let started = Instant::now();
    for c in 0..args.connections {
        let seed = args
            .seed
            .wrapping_mul(0x1000_0000_01b3)
            .wrapping_add(((index as u64) << 32) | c as u64);
        load_rt.spawn(load_connection(
            addr,
            setup.template.clone(),
            load.clone(),
            SplitMix64(seed).next(),
        ));
    }
    probe_rt.spawn(probe_loop(
        addr,
        args.model.clone(),
        args.max_tokens,
        Duration::from_millis(args.probe_interval_ms),
        probe.clone(),
    ));

    let mut rss = vec![rss_start as f64 / MIB];
    let mut previous = (load.latency.snapshot(), probe.latency.snapshot(), 0u64);
    let mut outcome: Result<(), Stop> = Ok(());
    let mut interrupted = interrupt.clone();
    for t in 1..=args.duration {
        let at = started + Duration::from_secs(t);
        tokio::select! {
            () = tokio::time::sleep_until(at.into()) => {}
            () = interrupted.wait() => {
                outcome = Err(Stop::Interrupted);
                break;
            }
        }
        if let Err(e) = router.check_alive() {
            outcome = Err(Stop::Failed(format!("the router died during the run: {e}")));
            break;
        }
        let now = (
            load.latency.snapshot(),
            probe.latency.snapshot(),
            load.errors(),
        );
        let load_w = window(&now.0, &previous.0);
        let probe_w = window(&now.1, &previous.1);
        let rss_mib = rss_of(router_pid).map_or(f64::NAN, |b| b as f64 / MIB);
        if rss_mib.is_finite() {
            rss.push(rss_mib);
        }
        let window_max = load.window_max.swap(0, Ordering::Relaxed);
        let second = Second {
            t,
            requests: load_w.iter().sum(),
            errors: now.2 - previous.2,
            p50_ms: quantile_ms(&load_w, 0.5, window_max),
            p99_ms: quantile_ms(&load_w, 0.99, window_max),
            max_ms: window_max as f64 / 1000.0,
            probes: probe_w.iter().sum(),
            probe_max_ms: probe.window_max.swap(0, Ordering::Relaxed) as f64 / 1000.0,
            rss_mib,
        };
        if let Some(file) = series.as_mut() {
            let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.3}"));
            let _ = writeln!(
                file,
                "{},{},\"{}\",{},{},{},{},{},{:.3},{},{:.3},{:.1}",
                index + 1,
                spec.policy,
                spec.flags.join(" "),
                second.t,
                second.requests,
                second.errors,
                opt(second.p50_ms),
                opt(second.p99_ms),
                second.max_ms,
                second.probes,
                second.probe_max_ms,
                second.rss_mib
            );
        }
        if !args.json && args.progress_secs > 0 && t % args.progress_secs == 0 {
            eprintln!(
                "  t={:>4}s {:>7} req/s, p99 {} ms, max {:.1} ms, probe max {:.1} ms, RSS {:.1} MiB, errors {}",
                t,
                second.requests,
                second.p99_ms.map_or("-".into(), |v| format!("{v:.2}")),
                second.max_ms,
                second.probe_max_ms,
                second.rss_mib,
                now.2 + probe.errors()
            );
        }
        previous = now;
    }
    // The window ends here: what is in flight now is neither counted nor
    // an error.
    let elapsed = started.elapsed().as_secs_f64();
    let load_counts = load.latency.snapshot();
    let probe_counts = probe.latency.snapshot();
    let http_errors = load.http_errors.load(Ordering::Relaxed);
    let connection_errors = load.connection_errors.load(Ordering::Relaxed);
    let probe_errors = probe.errors();
    let cpu_end = [cpu(&[router_pid]), cpu(&engine_pids), cpu(&[self_pid])];
    let hwm = read_status(router_pid).and_then(|s| status_field(&s, "VmHWM"));
    load_rt.shutdown_background();
    probe_rt.shutdown_background();
    let loadavg_end = loadavg();
    drop(router);
    drop(engines);
    outcome?;

    let mut error_samples = load
        .samples
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    error_samples.extend(
        probe
            .samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|s| format!("probe: {s}")),
    );
    let cores = |i: usize| (cpu_end[i].saturating_sub(cpu_start[i])) as f64 / ticks / elapsed;
    let load_max = load.max.load(Ordering::Relaxed);
    let probe_max = probe.max.load(Ordering::Relaxed);
    Ok(Summary {
        spec: spec.clone(),
        workers: args.workers,
        connections: args.connections,
        duration_s: elapsed,
        requests: load_counts.iter().sum(),
        latency_ms: [
            quantile_ms(&load_counts, 0.5, load_max),
            quantile_ms(&load_counts, 0.99, load_max),
        ],
        max_ms: load_max as f64 / 1000.0,
        probes: probe_counts.iter().sum(),
        probe_ms: [
            quantile_ms(&probe_counts, 0.5, probe_max),
            quantile_ms(&probe_counts, 0.99, probe_max),
        ],
        probe_max_ms: probe_max as f64 / 1000.0,
        probes_slow: probe.slow.load(Ordering::Relaxed),
        probe_slow_ms: args.probe_slow_ms,
        http_errors,
        connection_errors,
        probe_errors,
        error_samples,
        rss_start_mib: rss[0],
        rss_peak_mib: rss.iter().copied().fold(0.0, f64::max),
        rss_steady_mib: steady(&rss[1..]),
        vm_hwm_mib: hwm.map_or(f64::NAN, |b| b as f64 / MIB),
        rss_samples: rss.len(),
        cpu_router: cores(0),
        cpu_engines: cores(1),
        cpu_soak: cores(2),
        loadavg_start,
        loadavg_end,
    })
}

/// The markdown table of all runs; the p99 ratio is against the first
/// round_robin row (the issue's "at most 3x round_robin's in the same run").
fn table(summaries: &[Summary]) -> String {
    let rr_p99 = summaries
        .iter()
        .find(|s| s.spec.policy == "round_robin")
        .and_then(|s| s.latency_ms[1]);
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}"));
    let mut out = String::from(
        "| policy | flags | workers | s | req/s | p50 ms | p99 ms | max ms | p99 / rr | probe p50 | probe p99 | probe max | probes > slow | RSS start MiB | RSS peak MiB | RSS steady MiB | VmHWM MiB | errors |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for s in summaries {
        let ratio = match (rr_p99, s.latency_ms[1]) {
            (Some(rr), Some(p99)) if rr > 0.0 => format!("{:.1}x", p99 / rr),
            _ => "-".to_owned(),
        };
        let flags = if s.spec.flags.is_empty() {
            "(defaults)".to_owned()
        } else {
            format!("`{}`", s.spec.flags.join(" "))
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.0} | {:.0} | {} | {} | {:.1} | {} | {} | {} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
            s.spec.policy,
            flags,
            s.workers,
            s.duration_s,
            s.req_per_s(),
            ms(s.latency_ms[0]),
            ms(s.latency_ms[1]),
            s.max_ms,
            ratio,
            ms(s.probe_ms[0]),
            ms(s.probe_ms[1]),
            s.probe_max_ms,
            s.probes_slow,
            s.rss_start_mib,
            s.rss_peak_mib,
            s.rss_steady_mib,
            s.vm_hwm_mib,
            s.errors()
        );
    }
    out
}

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
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_within_1_6_percent() {
        let mut last = 0;
        for v in 0..1_000_000u64 {
            let b = bucket_of(v);
            assert!(
                b == last || b == last + 1,
                "bucket of {v} jumps from {last} to {b}"
            );
            last = b;
            let mid = bucket_value(b) as f64;
            assert!(
                (mid - v as f64).abs() <= (v as f64 / 64.0).max(0.5),
                "{v} is read back as {mid}"
            );
        }
        assert!(bucket_of(u64::MAX) < BUCKETS);
    }

    #[test]
    fn quantiles_of_a_known_distribution() {
        let h = Histogram::new();
        for v in 1..=1000u64 {
            h.record(v * 1000); // 1 ms .. 1 s
        }
        let counts = h.snapshot();
        let p50 = quantile(&counts, 0.5).unwrap() as f64;
        let p99 = quantile(&counts, 0.99).unwrap() as f64;
        assert!((p50 - 500_000.0).abs() / 500_000.0 < 0.016, "p50 {p50}");
        assert!((p99 - 990_000.0).abs() / 990_000.0 < 0.016, "p99 {p99}");
        assert_eq!(quantile(&[0; 4], 0.5), None);
        // Never above the exact maximum.
        assert_eq!(quantile_ms(&counts, 1.0, 999_000), Some(999.0));
        // A window is the difference of two snapshots.
        h.record(7);
        let w = window(&h.snapshot(), &counts);
        assert_eq!(w.iter().sum::<u64>(), 1);
        assert_eq!(quantile(&w, 0.99), Some(7));
    }

    #[test]
    fn bodies_are_valid_unique_chat_requests_of_the_asked_size() {
        let t = BodyTemplate::new("sim-model", 8, 300, 1024);
        let a = t.body(42);
        let b = t.body(43);
        assert_ne!(a, b);
        let v: serde_json::Value = serde_json::from_slice(&a).unwrap();
        assert_eq!(v["model"], "sim-model");
        assert_eq!(v["max_tokens"], 8);
        let messages = v["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[0]["role"], "system");
        assert_eq!(messages[0]["content"].as_str().unwrap().len(), 300);
        let user = messages[1]["content"].as_str().unwrap();
        assert!(user.starts_with("42 "), "{user:.20}");
        assert_eq!(user.len(), "42 ".len() + 1024);
        let plain = BodyTemplate::new("m", 1, 0, 10).body(7);
        let v: serde_json::Value = serde_json::from_slice(&plain).unwrap();
        assert_eq!(v["messages"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn run_specs_from_the_command_line() {
        let args = Args::parse_from([
            "soak",
            "--policies",
            "round_robin,cache_aware",
            "--run",
            "cache_aware --eviction-interval-secs 30",
            "--",
            "--max-tree-size",
            "16777216",
        ]);
        let specs = run_specs(&args).unwrap();
        let labels: Vec<String> = specs.iter().map(RunSpec::label).collect();
        assert_eq!(
            labels,
            [
                "round_robin --max-tree-size 16777216",
                "cache_aware --max-tree-size 16777216",
                "cache_aware --eviction-interval-secs 30 --max-tree-size 16777216",
            ]
        );
        let default = run_specs(&Args::parse_from(["soak"])).unwrap();
        assert_eq!(default[0].label(), "cache_aware");
        for bad in [
            vec!["soak", "--", "--port", "1"],
            vec!["soak", "--run", "cache_aware --host=0.0.0.0"],
            vec!["soak", "--policies", "round robin"],
            vec!["soak", "--run", "  "],
        ] {
            let args = Args::parse_from(bad.clone());
            assert!(run_specs(&args).is_err(), "{bad:?} accepted");
        }
        let engine = Args::parse_from(["soak", "--engine-flags", "--time-scale 1"]);
        assert!(check_args(&engine).unwrap_err().contains("--time-scale"));
        let zero = Args::parse_from(["soak", "--duration", "0"]);
        assert!(check_args(&zero).is_err());
    }

    #[test]
    fn banners_and_proc_files() {
        assert_eq!(
            engine_url("engine-sim engine-0 (regular) serving sim-model on http://127.0.0.1:4567"),
            Some("http://127.0.0.1:4567".into())
        );
        assert_eq!(engine_url("kv events: PUB on tcp://x"), None);
        assert_eq!(
            router_url(
                "affinity-router 0.1.0 serving on http://127.0.0.1:39999 (policy cache_aware)"
            ),
            Some("http://127.0.0.1:39999".into())
        );
        assert_eq!(router_url("  metrics: http://127.0.0.1:1/metrics"), None);
        let status = "Name:\trouter\nVmHWM:\t  204800 kB\nVmRSS:\t   20480 kB\n";
        assert_eq!(status_field(status, "VmRSS"), Some(20480 * 1024));
        assert_eq!(status_field(status, "VmHWM"), Some(204_800 * 1024));
        assert_eq!(status_field(status, "VmSwap"), None);
        let stat = "123 (my (odd) name) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0";
        assert_eq!(parse_cpu_ticks(stat), Some(300));
        // This process can read its own files (the soak reads /proc: Linux).
        #[cfg(target_os = "linux")]
        assert!(
            read_status(std::process::id()).is_some_and(|s| status_field(&s, "VmRSS").is_some())
        );
    }

    #[test]
    fn steady_is_the_median_of_the_last_30_percent() {
        let samples: Vec<f64> = (1..=10).map(f64::from).collect();
        // Last 3 samples: 8, 9, 10.
        assert_eq!(steady(&samples), 9.0);
        assert_eq!(steady(&[5.0]), 5.0);
        assert_eq!(steady(&[]), 0.0);
    }
}
