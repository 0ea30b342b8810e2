//! Whole routing decisions as a host sees them.
//!
//! One iteration is everything a gateway does between "the request body is
//! in memory" and "the upstream request can be sent", and the release at
//! the end:
//!
//! 1. parse the OpenAI chat body and render its routing text
//!    (`router_http::extract`),
//! 2. select a worker with `cache_aware` (lb-policies) among 8, 64 or 1,000
//!    `worker_lifecycle::Worker`s whose tree was warmed with representative
//!    conversations first,
//! 3. reserve the worker's load guard and release it.
//!
//! Groups (`routing_*`):
//!
//! - `decision`: the three steps above.
//! - `pd_select`: a prefill/decode pair chosen by pd-orchestrator's
//!   `PdPools::select_pair`, the one pair selection of the workspace (both
//!   roles' serialized steps, candidates by model, a `cache_aware` choice
//!   among N prefill workers and a `power_of_two` choice among N decode
//!   workers), then each phase reserved through its breaker and finished
//!   (outcome recorded, load released), as the two-phase flow does.
//! - `extract`: step 1 alone, so the rest can be read as the difference.
//!
//! Bodies are 1 KB, 8 KB and 64 KB chat requests: a system prompt shared by
//! many conversations (one of 16), then user and assistant turns. The
//! warm-up routes each conversation once (placed by load: the system prompt
//! alone is below the match threshold, so conversations spread over the
//! fleet — 4,000 of them for 1 KB bodies, 1,000 for 8 KB, 256 for
//! 64 KB). The measured requests cycle through 256 bodies that continue
//! those conversations by one user turn, so each is a cache hit on the
//! conversation's worker and, after the first pass, the tree already holds
//! the new turn: the steady state of a warm fleet (the cost of recording
//! brand-new text is in lb-policies' and radix-affinity's own benches).
//!
//! Times are the CPU time of the benchmarking thread per iteration (see
//! [`ThreadCpuTime`]): on an idle machine the same as wall time, and
//! unaffected by other processes competing for the cores.
//!
//! Run: `cargo bench --bench routing` (results in `target/criterion`);
//! `ROUTING_BENCH_CLOCK=wall cargo bench --bench routing` for wall time.
#![allow(missing_docs, reason = "criterion_group! generates undocumented items")]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::measurement::{Measurement, ValueFormatter, WallTime};
use criterion::{
    BenchmarkGroup, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main,
};
use lb_policies::{
    DecisionReason, MembershipEvent, OwnedContext, PolicyConfig, PolicyRegistry, RequestContext,
};
use pd_orchestrator::pools::{PdConfig, PdPools, PdScope, PdWorkerConfig};
use pd_orchestrator::{LegOutcome, PdBackend, PdConnector, Phase, PhaseGuard};
use router_http::{ApiKind, extract};
use serde_json::json;
use worker_lifecycle::{
    Endpoint, RandomSource, SplitMix64, Worker, WorkerOptions, WorkerRole, WorkerSpec,
};

const MODEL: &str = "llama-3.1-8b-instruct";
const BODY_SIZES: [usize; 3] = [1 << 10, 8 << 10, 64 << 10];
const FLEET_SIZES: [usize; 3] = [8, 64, 1_000];
const SYSTEM_PROMPTS: usize = 16;
const MEASURED_BODIES: usize = 256;

/// A deterministic generator (worker-lifecycle's SplitMix64), so every run
/// routes the same bodies.
struct Rng(SplitMix64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }

    fn below(&mut self, n: usize) -> usize {
        (self.0.next_u64() % n as u64) as usize
    }
}

const WORDS: [&str; 32] = [
    "the",
    "model",
    "cache",
    "request",
    "worker",
    "prefix",
    "routing",
    "token",
    "latency",
    "decode",
    "prefill",
    "summarise",
    "report",
    "quarterly",
    "revenue",
    "customer",
    "support",
    "assistant",
    "answer",
    "question",
    "policy",
    "engine",
    "context",
    "window",
    "careful",
    "concise",
    "explain",
    "because",
    "therefore",
    "example",
    "document",
    "section",
];

/// Appends words to `out` until it holds at least `len` bytes.
fn words(rng: &mut Rng, len: usize, out: &mut String) {
    while out.len() < len {
        out.push_str(WORDS[rng.below(WORDS.len())]);
        out.push(' ');
    }
}

/// The shared system prompts, each an eighth of the body size: well below
/// cache_aware's default match threshold (0.3 of the routing text), so a
/// conversation's first request is placed by load and its later turns
/// follow it by affinity, as in a fleet where conversations, not system
/// prompts, carry the affinity.
fn system_prompts(body_size: usize) -> Vec<String> {
    (0..SYSTEM_PROMPTS)
        .map(|i| {
            let mut rng = Rng::new(0x5EED_0000 + i as u64);
            let mut text = format!("You are assistant #{i}. ");
            words(&mut rng, body_size / 8, &mut text);
            text
        })
        .collect()
}

/// Conversation `id`: a system prompt and alternating user/assistant turns
/// of about 256 bytes each (1 KB bodies: 64) until the JSON body reaches
/// `body_size` bytes; `extra_turns` more user turns continue it.
fn chat_body(systems: &[String], body_size: usize, id: u64, extra_turns: usize) -> Vec<u8> {
    let mut rng = Rng::new(id);
    let system = &systems[rng.below(systems.len())];
    let turn = (body_size / 16).clamp(64, 256);
    let mut messages = vec![json!({"role": "system", "content": system})];
    let mut size = system.len() + 128;
    let mut k = 0usize;
    while size < body_size {
        let mut text = String::new();
        let role = if k.is_multiple_of(2) {
            "user"
        } else {
            "assistant"
        };
        words(&mut rng, turn.min(body_size - size).max(8), &mut text);
        size += text.len() + 40;
        messages.push(json!({"role": role, "content": text}));
        k += 1;
    }
    for _ in 0..extra_turns {
        let mut text = String::from("And now: ");
        words(&mut rng, 48, &mut text);
        messages.push(json!({"role": "user", "content": text}));
    }
    let body = json!({
        "model": MODEL,
        "messages": messages,
        "max_tokens": 128,
        "temperature": 0.7,
        "stream": true,
    });
    serde_json::to_vec(&body).expect("a JSON value serializes")
}

fn workers(role: WorkerRole, n: usize) -> Vec<Arc<Worker>> {
    let options = WorkerOptions::default();
    (0..n)
        .map(|i| {
            let url = format!("http://10.{}.{}.{}:8000", i >> 16, (i >> 8) & 255, i & 255);
            let endpoint = Endpoint::new(&url, None).expect("a valid worker URL");
            Worker::new(WorkerSpec::new(role, endpoint), 0, &options)
        })
        .collect()
}

fn registry(policy: &str, fleet: &[Arc<Worker>]) -> PolicyRegistry<Arc<Worker>> {
    let registry =
        PolicyRegistry::new(PolicyConfig::named(policy).with_seed(7)).expect("a built-in policy");
    for worker in fleet {
        registry.on_membership(MembershipEvent::Added { key: worker.key() });
    }
    registry
}

/// Routes `body` once, the way a host does, and returns the chosen worker's
/// index (0 when nothing was available, which never happens here).
fn route_once(body: &[u8], registry: &PolicyRegistry<Arc<Worker>>, fleet: &[Arc<Worker>]) -> usize {
    let info = extract(ApiKind::ChatCompletions, body).expect("a valid chat body");
    let ctx = RequestContext::new(info.model.as_deref().unwrap_or(""));
    let ctx = match info.routing.text() {
        Some(text) => ctx.with_text(text),
        None => ctx,
    };
    let Ok(Some(decision)) = registry.select(fleet, &ctx) else {
        return 0;
    };
    let guard = fleet[decision.index]
        .try_reserve()
        .expect("an idle worker admits");
    guard.release();
    decision.index
}

/// pd-orchestrator's P/D pools over `n` static prefill and `n` static decode
/// workers (NIXL: sequential phases), `cache_aware` for prefill and
/// `power_of_two` for decode, as [`route_pair`] chooses them by hand.
fn pd_pools(n: usize) -> PdPools {
    let mut config = PdConfig::new(PdConnector::Nixl);
    config.prefill_policy = Some(PolicyConfig::named("cache_aware"));
    config.decode_policy = Some(PolicyConfig::named("power_of_two").with_seed(7));
    for i in 0..n {
        let host = format!("{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
        config
            .prefill
            .push(PdWorkerConfig::new(format!("http://10.{host}:8000")));
        config
            .decode
            .push(PdWorkerConfig::new(format!("http://10.{host}:9000")));
    }
    PdPools::new(
        &config,
        &PolicyConfig::named("cache_aware"),
        &WorkerOptions::default(),
    )
    .expect("a valid P/D configuration")
}

/// A P/D request the way the reference router's P/D path chooses its
/// pair: one parse, `PdPools::select_pair` (both roles' serialized steps,
/// both policies), then each phase reserved and finished as the two-phase
/// flow does. Returns whether a pair was found.
fn select_pd(body: &[u8], pools: &PdPools) -> bool {
    let info = extract(ApiKind::ChatCompletions, body).expect("a valid chat body");
    let scope = Arc::new(PdScope::new(OwnedContext {
        model: info.model.unwrap_or_default(),
        routing: info.routing,
        ..OwnedContext::default()
    }));
    let Ok(pair) = pools.select_pair(&scope) else {
        return false;
    };
    for (target, phase) in [
        (&pair.prefill, Phase::Prefill),
        (&pair.decode, Phase::Decode),
    ] {
        let Ok(lease) = pools.reserve(target, phase) else {
            return false;
        };
        lease.finish(LegOutcome::Success, None);
    }
    true
}

/// Warm-up conversations per case: enough to give every worker of the
/// largest fleet some affinity for 1 KB bodies, bounded to about 8 MB of
/// body text for the larger ones, and at least every measured conversation.
fn warm_requests(body_size: usize) -> usize {
    ((8 << 20) / body_size).clamp(MEASURED_BODIES, 4_000)
}

struct Case {
    measured: Vec<Vec<u8>>,
    warm: Vec<Vec<u8>>,
}

fn case(body_size: usize) -> Case {
    let systems = system_prompts(body_size);
    let warm: Vec<Vec<u8>> = (0..warm_requests(body_size) as u64)
        .map(|id| chat_body(&systems, body_size, id, 0))
        .collect();
    // The measured bodies continue the first warm conversations by one turn.
    let measured = (0..MEASURED_BODIES as u64)
        .map(|id| chat_body(&systems, body_size, id, 1))
        .collect();
    Case { measured, warm }
}

/// Prints (to stderr, next to criterion's output) how the warm-up spread
/// over the fleet and what share of one pass over the measured bodies was
/// a cache hit, so the setup described above can be checked on every run.
fn report_warm_state(
    body_size: usize,
    registry: &PolicyRegistry<Arc<Worker>>,
    fleet: &[Arc<Worker>],
    mut route: impl FnMut(&[u8]),
    measured: &[Vec<u8>],
) {
    let used = fleet.iter().filter(|w| w.processed() > 0).count();
    let hits_before = hits(registry);
    for body in measured {
        route(body);
    }
    let hits = hits(registry) - hits_before;
    let mean_len = measured.iter().map(Vec::len).sum::<usize>() / measured.len().max(1);
    eprintln!(
        "{} KB bodies (mean {mean_len} bytes), {} workers: warm-up reached {used} workers; \
         {hits} of {} measured bodies are cache hits",
        body_size >> 10,
        fleet.len(),
        measured.len()
    );
}

fn hits(registry: &PolicyRegistry<Arc<Worker>>) -> u64 {
    registry
        .policy(MODEL)
        .map_or(0, |p| p.counts().get(DecisionReason::CacheHit))
}

fn configure<'c>(
    c: &'c mut Criterion<ThreadCpuTime>,
    name: &str,
) -> BenchmarkGroup<'c, ThreadCpuTime> {
    let mut group = c.benchmark_group(name);
    group
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(50);
    group
}

fn benches(c: &mut Criterion<ThreadCpuTime>) {
    let cases: Vec<(usize, Case)> = BODY_SIZES.iter().map(|&s| (s, case(s))).collect();

    let mut group = configure(c, "routing_extract");
    for (size, case) in &cases {
        group.throughput(Throughput::Bytes(*size as u64));
        let mut i = 0usize;
        group.bench_function(
            BenchmarkId::from_parameter(format!("{}KB", size >> 10)),
            |b| {
                b.iter(|| {
                    i = (i + 1) % case.measured.len();
                    black_box(extract(ApiKind::ChatCompletions, &case.measured[i]).expect("valid"))
                })
            },
        );
    }
    group.finish();

    let mut group = configure(c, "routing_decision");
    for (size, case) in &cases {
        for &n in &FLEET_SIZES {
            let fleet = workers(WorkerRole::Regular, n);
            let registry = registry("cache_aware", &fleet);
            for body in &case.warm {
                route_once(body, &registry, &fleet);
            }
            report_warm_state(
                *size,
                &registry,
                &fleet,
                |body| {
                    route_once(body, &registry, &fleet);
                },
                &case.measured,
            );
            let mut i = 0usize;
            let id = BenchmarkId::new(format!("{}KB", size >> 10), format!("{n}_workers"));
            group.bench_function(id, |b| {
                b.iter(|| {
                    i = (i + 1) % case.measured.len();
                    black_box(route_once(&case.measured[i], &registry, &fleet))
                })
            });
        }
    }
    group.finish();

    let mut group = configure(c, "routing_pd_select");
    for (size, case) in &cases {
        for &n in &FLEET_SIZES {
            let pools = pd_pools(n);
            for body in &case.warm {
                select_pd(body, &pools);
            }
            report_warm_state(
                *size,
                pools.prefill().policies(),
                &pools.prefill().workers(),
                |body| {
                    select_pd(body, &pools);
                },
                &case.measured,
            );
            let mut i = 0usize;
            let id = BenchmarkId::new(format!("{}KB", size >> 10), format!("{n}+{n}_workers"));
            group.bench_function(id, |b| {
                b.iter(|| {
                    i = (i + 1) % case.measured.len();
                    black_box(select_pd(&case.measured[i], &pools))
                })
            });
        }
    }
    group.finish();
}

/// Criterion measurement: CPU time of the benchmarking thread
/// (`CLOCK_THREAD_CPUTIME_ID`) instead of wall time, unless
/// `ROUTING_BENCH_CLOCK=wall` asks for wall time.
///
/// Each iteration is single-threaded, allocation-light work with no I/O,
/// so on an idle machine its CPU time and its wall time are the same; on a
/// shared machine (other builds running on the same cores) CPU time leaves
/// out the time the thread spent waiting for a core, which wall time
/// counts and which made repeated wall-time runs here differ by tens of
/// percent. Cache interference from the other processes is still included.
struct ThreadCpuTime {
    /// Whether to read the wall clock instead (`ROUTING_BENCH_CLOCK=wall`).
    use_wall_clock: bool,
    /// The wall clock's epoch, and its formatter (nanoseconds either way).
    epoch: std::time::Instant,
    wall: WallTime,
}

impl ThreadCpuTime {
    fn from_env() -> Self {
        let clock = std::env::var("ROUTING_BENCH_CLOCK").unwrap_or_default();
        let use_wall_clock = clock == "wall";
        eprintln!(
            "routing bench clock: {}",
            if use_wall_clock {
                "wall time"
            } else {
                "thread CPU time"
            }
        );
        ThreadCpuTime {
            use_wall_clock,
            epoch: std::time::Instant::now(),
            wall: WallTime,
        }
    }

    fn now_ns(&self) -> u64 {
        if self.use_wall_clock {
            self.epoch.elapsed().as_nanos() as u64
        } else {
            thread_cpu_ns()
        }
    }
}

impl Measurement for ThreadCpuTime {
    type Intermediate = u64;
    type Value = Duration;

    fn start(&self) -> u64 {
        self.now_ns()
    }
    fn end(&self, started: u64) -> Duration {
        Duration::from_nanos(self.now_ns().saturating_sub(started))
    }
    fn add(&self, a: &Duration, b: &Duration) -> Duration {
        *a + *b
    }
    fn zero(&self) -> Duration {
        Duration::ZERO
    }
    fn to_f64(&self, value: &Duration) -> f64 {
        value.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        self.wall.formatter()
    }
}

/// Nanoseconds of CPU time this thread has used.
#[cfg(unix)]
fn thread_cpu_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec for the duration of the
    // call, and CLOCK_THREAD_CPUTIME_ID is a clock every unix we build on has.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// Elsewhere: wall time since the first call (no per-thread clock in std).
#[cfg(not(unix))]
fn thread_cpu_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_nanos() as u64
}

criterion_group! {
    name = routing;
    config = Criterion::default().with_measurement(ThreadCpuTime::from_env());
    targets = benches
}
criterion_main!(routing);
