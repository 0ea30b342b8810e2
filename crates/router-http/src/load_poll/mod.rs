//! Engine-reported load: every engine is asked for its in-flight count,
//! so that a router replica sees the requests the other replicas sent.
//!
//! A replica counts its own requests exactly (the workers' load guards),
//! but behind R replicas that is about 1/R of what an engine runs. Every
//! [`LoadPollConfig::interval`] (default 50 ms) the poller asks each
//! engine behind the router's workers (regular, prefill and decode; the
//! data-parallel ranks of one URL share one request) for its load and
//! records it on each worker ([`Worker::record_engine_load`]), with the
//! worker's own in-flight count read just before the request was sent.
//! The policies then compare [`Worker::estimated_load`]:
//!
//! ```text
//! estimated = own in-flight now + max(0, engine's running + waiting − own in-flight at the poll)
//! ```
//!
//! Guards never read the estimate; the load counted and released is the
//! router's own, as before. The waiting part of a vLLM engine's count is
//! also recorded apart ([`Worker::record_engine_waiting`]: a queued
//! request is latency a new one waits behind, where a running one shares
//! the batch); `/get_load` replies leave it unknown.
//!
//! # Sources
//!
//! Tried in this order, per engine, until one answers with a usable load,
//! which is then remembered and asked alone while it keeps answering:
//!
//! 1. `GET /metrics`: vLLM's `vllm:num_requests_running` plus
//!    `vllm:num_requests_waiting`, the series whose `engine` label is the
//!    worker's data-parallel rank (every engine's summed for a worker
//!    without one);
//! 2. `GET /get_load`: SGLang's per-rank list or vllm-router's
//!    `{"load": N}`.
//!
//! The [`parse`](parse_metrics) functions say exactly what is accepted. A
//! source is passed over when its path answers 404, 405, 410 or 501, or
//! when its reply has no load fields at all; it is tried after the other
//! when it fails otherwise (an error status, garbage), and only a refused
//! connection ends the poll at once.
//!
//! # Failures
//!
//! Each engine's poll is bounded: one deadline for every source tried
//! ([`LoadPollConfig::poll_timeout`], by default the interval, at most
//! 1 s), a body cap ([`LoadPollConfig::max_body_bytes`], 4 MiB, past which
//! reading stops and the connection closes), and
//! [`LoadPollConfig::max_concurrent`] engines polled at once. A poll that
//! gives no usable load for a worker withdraws the worker's report
//! ([`Worker::clear_engine_load`]: its estimate is the router's own count
//! again), counts the reason ([`PollError`]) in
//! `router_load_poll_errors_total` and shows it in `/workers`. So does a
//! report older than [`LoadPollConfig::stale_after`] intervals. An engine
//! that carries load on neither path is not asked again for
//! [`LoadPollConfig::no_source_backoff`] (30 s). Polls take no admission
//! permit, no load guard and no breaker outcome: an engine that does not
//! answer its load polls is only not estimated, never excluded; the
//! health checks and the requests themselves judge it. Nothing here runs
//! on the request path, which only reads the workers' atomics.
//!
//! When the task stops (the router's [`BackgroundTasks`] dropped), every
//! report it made is withdrawn.
//!
//! [`Worker::record_engine_load`]: worker_lifecycle::Worker::record_engine_load
//! [`Worker::record_engine_waiting`]: worker_lifecycle::Worker::record_engine_waiting
//! [`Worker::estimated_load`]: worker_lifecycle::Worker::estimated_load
//! [`Worker::clear_engine_load`]: worker_lifecycle::Worker::clear_engine_load
//! [`BackgroundTasks`]: crate::BackgroundTasks

mod parse;

pub use parse::{
    EngineLoads, LoadSource, MAX_PLAUSIBLE_LOAD, MAX_RANKS, PollError, RankLoad, Unusable,
    parse_get_load, parse_metrics,
};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use parking_lot::Mutex;
use prom_text::{Exposition, Label, MetricType};
use serde::Serialize;
use tokio::task::JoinSet;
use tokio::time::Instant;
use worker_lifecycle::{Worker, WorkerUrl};

use crate::client::{UpstreamClient, UpstreamError};
use crate::metrics::{Histogram, LATENCY_BOUNDS};

/// How the engines are polled for their load (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadPollConfig {
    /// Time between polling rounds (default 50 ms); `None` or zero turns
    /// polling off, and every estimate is the router's own count.
    pub interval: Option<Duration>,
    /// Deadline of one engine's poll, every source tried included
    /// (default `None`: the interval, at most 1 s).
    pub timeout: Option<Duration>,
    /// Largest reply read (default 4 MiB); a larger one is cut off and
    /// counted as [`PollError::TooLarge`].
    pub max_body_bytes: usize,
    /// Engines polled at once (default 32; at least 1).
    pub max_concurrent: usize,
    /// How long an engine with load on neither path is left alone
    /// (default 30 s).
    pub no_source_backoff: Duration,
    /// A report older than this many intervals is withdrawn (default 3;
    /// at least 1).
    pub stale_after: u32,
    /// Most engine polls per second, every round included (default
    /// [`DEFAULT_MAX_POLLS_PER_SEC`]; 0: no limit). A fleet larger than
    /// `interval × max_polls_per_sec` engines is polled less often: each
    /// round lasts at least `engines / max_polls_per_sec`, and reports
    /// go stale after `stale_after` such rounds. It bounds the poller's
    /// CPU (about 23 µs of the router's thread per poll of a 3.4 KB
    /// `/metrics`; docs/benchmarks.md, "What polling costs").
    pub max_polls_per_sec: u32,
}

/// Default [`LoadPollConfig::max_polls_per_sec`]: 2,000, every 50 ms for
/// up to 100 engines, about 5 % of one core.
pub const DEFAULT_MAX_POLLS_PER_SEC: u32 = 2_000;

impl Default for LoadPollConfig {
    fn default() -> Self {
        Self {
            interval: Some(Duration::from_millis(50)),
            timeout: None,
            max_body_bytes: 4 * 1024 * 1024,
            max_concurrent: 32,
            no_source_backoff: Duration::from_secs(30),
            stale_after: 3,
            max_polls_per_sec: DEFAULT_MAX_POLLS_PER_SEC,
        }
    }
}

impl LoadPollConfig {
    /// Polling off.
    pub fn off() -> Self {
        Self {
            interval: None,
            ..Self::default()
        }
    }

    /// The interval, when polling is on (set and not zero).
    pub fn active_interval(&self) -> Option<Duration> {
        self.interval.filter(|interval| !interval.is_zero())
    }

    /// The deadline of one engine's poll: [`timeout`](Self::timeout), or
    /// the interval capped at 1 s.
    pub fn poll_timeout(&self) -> Duration {
        self.timeout.unwrap_or_else(|| {
            self.active_interval()
                .unwrap_or(Duration::ZERO)
                .min(Duration::from_secs(1))
        })
    }

    /// The age past which a report is withdrawn, at the configured
    /// interval (a fleet polled less often for
    /// [`max_polls_per_sec`](Self::max_polls_per_sec) stretches it with its
    /// rounds).
    pub fn stale_age(&self) -> Duration {
        self.stale_age_at(self.active_interval().unwrap_or(Duration::ZERO))
    }

    fn stale_age_at(&self, round: Duration) -> Duration {
        round.saturating_mul(self.stale_after.max(1))
    }

    /// How long a round polling `engines` engines lasts at least: the
    /// interval, or longer when the poll budget asks for it.
    pub fn round_period(&self, engines: usize) -> Duration {
        let interval = self.active_interval().unwrap_or(Duration::ZERO);
        if self.max_polls_per_sec == 0 {
            return interval;
        }
        interval.max(Duration::from_secs_f64(
            engines as f64 / f64::from(self.max_polls_per_sec),
        ))
    }
}

/// The poller's state: what each engine answered last and each worker's
/// report and errors. Shared by the polling task and the router's admin
/// routes; the request path never touches it.
pub struct LoadPolls {
    config: LoadPollConfig,
    /// The current round period in nanoseconds: the interval, or longer
    /// under the poll budget.
    period_nanos: AtomicU64,
    state: Mutex<State>,
    /// Engine polls that gave a load, by source.
    reports: [AtomicU64; LoadSource::ALL.len()],
    /// Polling rounds' durations.
    rounds: Histogram,
}

impl std::fmt::Debug for LoadPolls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadPolls")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    /// By base URL: one poll serves every rank of an engine.
    engines: HashMap<Arc<str>, EngineState>,
    /// By worker key (one lifetime of one worker).
    workers: HashMap<Box<str>, WorkerState>,
}

#[derive(Default)]
struct EngineState {
    /// The source that answered last.
    source: Option<LoadSource>,
    /// Not polled before this (no source).
    backoff_until: Option<Instant>,
}

struct WorkerState {
    worker: Weak<Worker>,
    /// `url[@rank]`, role and generation, for metric labels.
    label: String,
    role: &'static str,
    generation: u64,
    /// The report that stands: when it was made and from where.
    reported: Option<(Instant, LoadSource)>,
    kv_cache_usage: Option<f64>,
    last_error: Option<LastError>,
    errors: [u64; PollError::ALL.len()],
}

struct LastError {
    reason: PollError,
    detail: String,
    at: Instant,
}

impl WorkerState {
    fn new(worker: &Arc<Worker>) -> Self {
        Self {
            worker: Arc::downgrade(worker),
            label: worker.endpoint().to_string(),
            role: worker.role().kind().as_str(),
            generation: worker.generation(),
            reported: None,
            kv_cache_usage: None,
            last_error: None,
            errors: [0; PollError::ALL.len()],
        }
    }

    /// Withdraws the worker's report and records why.
    fn fail(&mut self, worker: &Worker, reason: PollError, detail: String, now: Instant) {
        worker.clear_engine_load();
        self.reported = None;
        self.kv_cache_usage = None;
        self.errors[reason.index()] += 1;
        self.last_error = Some(LastError {
            reason,
            detail,
            at: now,
        });
    }
}

/// One engine to poll in a round: its URL, the source it answered with
/// last, and the workers (ranks) it serves.
struct EnginePoll {
    key: Arc<str>,
    url: WorkerUrl,
    source: Option<LoadSource>,
    workers: Vec<Arc<Worker>>,
}

/// Why one engine's poll gave nothing, with a line for `/workers`.
struct Failure {
    reason: PollError,
    detail: String,
}

impl Failure {
    fn new(reason: PollError, source: LoadSource, what: impl std::fmt::Display) -> Self {
        Self {
            reason,
            detail: format!("GET {}: {what}", source.path()),
        }
    }
}

/// What one engine's poll produced: the source that answered, the loads
/// it named, and each worker's own count read just before that request.
type Answer = Result<(LoadSource, EngineLoads, Vec<usize>), Failure>;

impl LoadPolls {
    /// The poller's state for `config`; `None` when polling is off.
    pub fn new(config: LoadPollConfig) -> Option<Arc<Self>> {
        let interval = config.active_interval()?;
        Some(Arc::new(Self {
            config,
            period_nanos: AtomicU64::new(interval.as_nanos() as u64),
            state: Mutex::new(State::default()),
            reports: std::array::from_fn(|_| AtomicU64::new(0)),
            rounds: Histogram::new(LATENCY_BOUNDS),
        }))
    }

    /// The configuration.
    pub fn config(&self) -> &LoadPollConfig {
        &self.config
    }

    /// The time between two polls of one engine now: the interval, or
    /// longer when the fleet is larger than the poll budget covers at it.
    pub fn period(&self) -> Duration {
        Duration::from_nanos(self.period_nanos.load(Ordering::Relaxed))
    }

    /// Errors counted for `worker` with `reason` (this lifetime of it).
    pub fn errors(&self, worker: &Worker, reason: PollError) -> u64 {
        self.state
            .lock()
            .workers
            .get(worker.key())
            .map_or(0, |state| state.errors[reason.index()])
    }

    /// Engine polls that gave a load through `source`, since the start.
    pub fn reports(&self, source: LoadSource) -> u64 {
        self.reports[source.index()].load(Ordering::Relaxed)
    }

    /// What `/workers` shows of `worker`'s engine-reported load.
    pub fn status(&self, worker: &Worker) -> EngineLoadStatus {
        let now = Instant::now();
        let mut status = EngineLoadStatus::unpolled(worker);
        status.polling = true;
        let state = self.state.lock();
        if let Some(ours) = state.workers.get(worker.key()) {
            if let Some((at, source)) = ours.reported {
                status.source = Some(source.as_str());
                status.report_age_ms = Some(millis(now.saturating_duration_since(at)));
            }
            status.kv_cache_usage = ours.kv_cache_usage;
            status.last_error = ours.last_error.as_ref().map(|error| LastErrorStatus {
                reason: error.reason.as_str(),
                detail: error.detail.clone(),
                age_ms: millis(now.saturating_duration_since(error.at)),
            });
        }
        if let Some(until) = state
            .engines
            .get(worker.url())
            .and_then(|engine| engine.backoff_until)
        {
            status.backoff_ms = Some(millis(until.saturating_duration_since(now)));
        }
        status
    }

    /// Writes the poller's series: reports by source, errors by worker
    /// and reason, KV-cache usage by worker, and the rounds' durations.
    pub fn render(&self, exposition: &mut Exposition<'_>) {
        let mut family = exposition.family(
            "router_load_poll_reports_total",
            MetricType::Counter,
            "Engine load polls that gave a load, by source.",
        );
        for source in LoadSource::ALL {
            family.sample(&[("source", &source.as_str())], self.reports(source));
        }
        let state = self.state.lock();
        let mut workers: Vec<&WorkerState> = state.workers.values().collect();
        workers.sort_by(|a, b| (&a.label, a.role).cmp(&(&b.label, b.role)));
        let mut family = exposition.family(
            "router_load_poll_errors_total",
            MetricType::Counter,
            "Load polls that left a worker without an engine report, by reason.",
        );
        for worker in &workers {
            for reason in PollError::ALL {
                let count = worker.errors[reason.index()];
                if count > 0 {
                    let labels: [Label<'_>; 4] = [
                        ("url", &worker.label),
                        ("role", &worker.role),
                        ("generation", &worker.generation),
                        ("reason", &reason.as_str()),
                    ];
                    family.sample(&labels, count);
                }
            }
        }
        let mut family = exposition.family(
            "router_worker_engine_kv_cache_usage",
            MetricType::Gauge,
            "KV-cache usage (0-1) the engine reported with its load.",
        );
        for worker in &workers {
            if let Some(usage) = worker.kv_cache_usage {
                let labels: [Label<'_>; 3] = [
                    ("url", &worker.label),
                    ("role", &worker.role),
                    ("generation", &worker.generation),
                ];
                family.sample(&labels, usage);
            }
        }
        drop(state);
        exposition
            .family(
                "router_load_poll_period_seconds",
                MetricType::Gauge,
                "Time between two polls of one engine: the interval, or longer when the fleet exceeds the poll budget.",
            )
            .sample(&[], self.period().as_secs_f64());
        let mut family = exposition.histograms(
            "router_load_poll_round_seconds",
            "Duration of a load polling round (every engine due, at most max_concurrent at once).",
        );
        self.rounds.render(&mut family, &[]);
    }

    /// A round's start: forgets workers and engines that left, withdraws
    /// stale reports, and returns the engines to poll now (not backing
    /// off), each with its workers.
    fn plan(&self, workers: &[Arc<Worker>], now: Instant) -> Vec<EnginePoll> {
        let stale_age = self.config.stale_age_at(self.period());
        let mut state = self.state.lock();
        let State {
            engines,
            workers: known,
        } = &mut *state;
        let mut current: HashMap<&str, &Arc<Worker>> = HashMap::with_capacity(workers.len());
        for worker in workers {
            current.insert(worker.key(), worker);
        }
        known.retain(|key, ours| match current.get(&**key) {
            Some(_) => true,
            None => {
                if let Some(gone) = ours.worker.upgrade() {
                    gone.clear_engine_load();
                }
                false
            }
        });
        let mut polls: Vec<EnginePoll> = Vec::new();
        let mut by_url: HashMap<&str, usize> = HashMap::new();
        for worker in workers {
            let ours = worker_state(known, worker);
            if let Some((at, source)) = ours.reported
                && now.saturating_duration_since(at) > stale_age
            {
                let detail = format!(
                    "GET {}: the last report is {} ms old",
                    source.path(),
                    millis(now.saturating_duration_since(at))
                );
                ours.fail(worker, PollError::Stale, detail, now);
            }
            let url = worker.url();
            if let Some(&at) = by_url.get(url) {
                polls[at].workers.push(Arc::clone(worker));
                continue;
            }
            let key = match engines.get_key_value(url) {
                Some((key, _)) => Arc::clone(key),
                None => {
                    let key: Arc<str> = Arc::from(url);
                    engines.insert(Arc::clone(&key), EngineState::default());
                    key
                }
            };
            let Some(engine) = engines.get_mut(url) else {
                continue;
            };
            if engine.backoff_until.is_some_and(|until| now < until) {
                continue;
            }
            engine.backoff_until = None;
            by_url.insert(url, polls.len());
            polls.push(EnginePoll {
                key,
                url: worker.endpoint().worker_url().clone(),
                source: engine.source,
                workers: vec![Arc::clone(worker)],
            });
        }
        let urls: std::collections::HashSet<&str> = workers.iter().map(|w| w.url()).collect();
        engines.retain(|url, _| urls.contains(&**url));
        polls
    }

    /// Applies one engine's answer to its workers.
    fn finish(&self, poll: &EnginePoll, answer: Answer, now: Instant) {
        let mut state = self.state.lock();
        let State { engines, workers } = &mut *state;
        let engine = engines.entry(Arc::clone(&poll.key)).or_default();
        match answer {
            Ok((source, loads, own)) => {
                engine.source = Some(source);
                self.reports[source.index()].fetch_add(1, Ordering::Relaxed);
                for (worker, own) in poll.workers.iter().zip(own) {
                    let ours = worker_state(workers, worker);
                    match loads.for_rank(worker.dp_rank()) {
                        Ok(report) => {
                            let in_flight = usize::try_from(report.in_flight).unwrap_or(usize::MAX);
                            worker.record_engine_load(in_flight, own);
                            // The queued part of it, apart (vLLM's
                            // metrics); a reply without it withdraws it.
                            worker.record_engine_waiting(
                                report
                                    .waiting
                                    .map(|w| usize::try_from(w).unwrap_or(usize::MAX)),
                            );
                            // What the cost reads as the engine's cache
                            // pressure; a reply without it withdraws it.
                            worker.record_engine_cache_usage(
                                report.kv_cache_usage.unwrap_or(f64::NAN),
                            );
                            ours.reported = Some((now, source));
                            ours.kv_cache_usage = report.kv_cache_usage;
                            ours.last_error = None;
                        }
                        Err(reason) => {
                            let detail = Failure::new(
                                reason,
                                source,
                                match worker.dp_rank() {
                                    Some(rank) => format!("no load for data-parallel rank {rank}"),
                                    None => "no load in the reply".to_owned(),
                                },
                            )
                            .detail;
                            ours.fail(worker, reason, detail, now);
                        }
                    }
                }
            }
            Err(failure) => {
                if failure.reason == PollError::NoSource {
                    engine.source = None;
                    engine.backoff_until = Some(now + self.config.no_source_backoff);
                }
                for worker in &poll.workers {
                    let ours = worker_state(workers, worker);
                    ours.fail(worker, failure.reason, failure.detail.clone(), now);
                }
            }
        }
    }

    /// Withdraws every report this poller made (it stops).
    fn withdraw_all(&self) {
        let mut state = self.state.lock();
        for ours in state.workers.values_mut() {
            if let Some(worker) = ours.worker.upgrade() {
                worker.clear_engine_load();
            }
            ours.reported = None;
            ours.kv_cache_usage = None;
        }
    }
}

/// `worker`'s entry in `known`, made when it has none (its key is only
/// copied then, not on every round).
fn worker_state<'a>(
    known: &'a mut HashMap<Box<str>, WorkerState>,
    worker: &Arc<Worker>,
) -> &'a mut WorkerState {
    if !known.contains_key(worker.key()) {
        known.insert(worker.key().into(), WorkerState::new(worker));
    }
    match known.get_mut(worker.key()) {
        Some(state) => state,
        None => unreachable!("inserted above"),
    }
}

/// A worker's engine-reported load as `/workers` shows it (its
/// `engine_load` object).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineLoadStatus {
    /// Whether the router polls engines for their load.
    pub polling: bool,
    /// This router's own requests in flight on the worker.
    pub own_load: usize,
    /// What the policies compare: own now plus the other routers' as of
    /// the last report.
    pub estimated_load: usize,
    /// The engine's in-flight count in the report that stands.
    pub reported: Option<usize>,
    /// How many of those are waiting (queued, not yet scheduled), when
    /// the report says (vLLM's `vllm:num_requests_waiting`).
    pub waiting: Option<usize>,
    /// Where that report came from (`metrics` or `get_load`).
    pub source: Option<&'static str>,
    /// How old the report is, in milliseconds.
    pub report_age_ms: Option<u64>,
    /// The KV-cache usage (0-1) that came with the report, if any.
    pub kv_cache_usage: Option<f64>,
    /// The last poll that left the worker without a report, unless a
    /// report came since.
    pub last_error: Option<LastErrorStatus>,
    /// While the engine is left alone (no source), how much longer.
    pub backoff_ms: Option<u64>,
}

/// Why the worker's last poll gave no report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LastErrorStatus {
    /// The reason, as in `router_load_poll_errors_total`.
    pub reason: &'static str,
    /// What happened, on one line.
    pub detail: String,
    /// How long ago, in milliseconds.
    pub age_ms: u64,
}

impl EngineLoadStatus {
    /// The status of a worker whose engine is not polled: the counts
    /// alone.
    pub fn unpolled(worker: &Worker) -> Self {
        Self {
            polling: false,
            own_load: Worker::load(worker),
            estimated_load: worker.estimated_load(),
            reported: worker.engine_reported_load(),
            waiting: worker.engine_waiting(),
            source: None,
            report_age_ms: None,
            kv_cache_usage: None,
            last_error: None,
            backoff_ms: None,
        }
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Withdraws the poller's reports when its task ends (aborted included).
struct WithdrawOnDrop(Arc<LoadPolls>);

impl Drop for WithdrawOnDrop {
    fn drop(&mut self) {
        self.0.withdraw_all();
    }
}

/// The polling task: a round every interval over the workers `members`
/// gives, each due engine polled through `client`, at most
/// `max_concurrent` at once; the next round starts when this one is done.
pub(crate) fn spawn(
    polls: Arc<LoadPolls>,
    client: UpstreamClient,
    members: impl Fn() -> Vec<Arc<Worker>> + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let _withdraw = WithdrawOnDrop(Arc::clone(&polls));
        let cap = polls.config.max_concurrent.max(1);
        let timeout = polls.config.poll_timeout();
        let limit = polls.config.max_body_bytes;
        loop {
            let started = Instant::now();
            let members = members();
            // The budget is spread over the round: every engine behind the
            // members counts, due now or backing off.
            let period = polls.config.round_period(distinct_urls(&members));
            polls
                .period_nanos
                .store(period.as_nanos() as u64, Ordering::Relaxed);
            let due = polls.plan(&members, started);
            let mut running: JoinSet<(EnginePoll, Answer)> = JoinSet::new();
            for poll in due {
                while running.len() >= cap {
                    finish_one(&polls, &mut running).await;
                }
                running.spawn(poll_engine(client.clone(), poll, timeout, limit));
            }
            while finish_one(&polls, &mut running).await {}
            polls.rounds.observe_duration(started.elapsed());
            // The next round starts a period after this one started, or at
            // once when this one took longer.
            tokio::time::sleep_until(started + period).await;
        }
    })
}

/// Engines behind `workers`: one per base URL (a URL's data-parallel
/// ranks share one poll).
fn distinct_urls(workers: &[Arc<Worker>]) -> usize {
    let mut urls: Vec<&str> = workers.iter().map(|w| w.url()).collect();
    urls.sort_unstable();
    urls.dedup();
    urls.len()
}

/// Waits for one poll of `running` and applies it; `false` when none was
/// left.
async fn finish_one(polls: &LoadPolls, running: &mut JoinSet<(EnginePoll, Answer)>) -> bool {
    match running.join_next().await {
        Some(Ok((poll, answer))) => {
            polls.finish(&poll, answer, Instant::now());
            true
        }
        Some(Err(error)) => {
            tracing::error!(error = %error, "load poll task failed");
            true
        }
        None => false,
    }
}

/// Polls one engine: its remembered source first, then the others in
/// order, all within `timeout`.
async fn poll_engine(
    client: UpstreamClient,
    poll: EnginePoll,
    timeout: Duration,
    limit: usize,
) -> (EnginePoll, Answer) {
    let mut order: Vec<LoadSource> = poll.source.into_iter().collect();
    order.extend(
        LoadSource::ALL
            .into_iter()
            .filter(|s| Some(*s) != poll.source),
    );
    // The source being asked, for the message when the deadline passes.
    let asking = std::sync::atomic::AtomicUsize::new(order[0].index());
    let attempt = async {
        let mut first_failure: Option<Failure> = None;
        for source in order {
            asking.store(source.index(), Ordering::Relaxed);
            // The own counts the report is measured against: read just
            // before the request leaves.
            let own: Vec<usize> = poll.workers.iter().map(|w| Worker::load(w)).collect();
            let failure = match fetch(&client, &poll.url, source, limit).await {
                Ok(None) => continue,
                Ok(Some(body)) => match source.parse(&body) {
                    Ok(loads) => return Ok((source, loads, own)),
                    Err(Unusable::Absent) => continue,
                    Err(Unusable::Failed(reason)) => Failure::new(reason, source, describe(reason)),
                },
                Err(failure) if failure.reason == PollError::Connect => return Err(failure),
                Err(failure) => failure,
            };
            first_failure.get_or_insert(failure);
        }
        Err(first_failure.unwrap_or(Failure {
            reason: PollError::NoSource,
            detail: "neither GET /metrics nor GET /get_load carries load".to_owned(),
        }))
    };
    let answer = match tokio::time::timeout(timeout, attempt).await {
        Ok(answer) => answer,
        Err(_elapsed) => Err(Failure::new(
            PollError::Timeout,
            LoadSource::ALL[asking.load(Ordering::Relaxed)],
            format_args!("no complete answer within {timeout:?}"),
        )),
    };
    (poll, answer)
}

/// What a parse failure means, for `/workers`.
fn describe(reason: PollError) -> &'static str {
    match reason {
        PollError::InvalidValue => "a count that is negative, fractional, infinite or NaN",
        PollError::Implausible => "a count above the plausible maximum",
        _ => "not the format of this source",
    }
}

/// `GET path` on the engine: the body of a 2xx reply (at most `limit`
/// bytes), `None` when the path does not exist there.
async fn fetch(
    client: &UpstreamClient,
    url: &WorkerUrl,
    source: LoadSource,
    limit: usize,
) -> Result<Option<Bytes>, Failure> {
    let request = Request::get(url.url_for(source.path()))
        .body(Full::new(Bytes::new()))
        .map_err(|err| Failure::new(PollError::Connect, source, err))?;
    let response = client.send(request).await.map_err(|err| {
        let reason = match err {
            UpstreamError::HeaderTimeout(_) | UpstreamError::Deadline => PollError::Timeout,
            _ => PollError::Connect,
        };
        Failure::new(reason, source, err)
    })?;
    let status = response.status();
    if matches!(
        status,
        StatusCode::NOT_FOUND
            | StatusCode::METHOD_NOT_ALLOWED
            | StatusCode::GONE
            | StatusCode::NOT_IMPLEMENTED
    ) {
        return Ok(None);
    }
    if !status.is_success() {
        return Err(Failure::new(
            PollError::Status,
            source,
            format_args!("status {}", status.as_u16()),
        ));
    }
    match Limited::new(response.into_body(), limit).collect().await {
        Ok(body) => Ok(Some(body.to_bytes())),
        Err(err) if err.downcast_ref::<LengthLimitError>().is_some() => Err(Failure::new(
            PollError::TooLarge,
            source,
            format_args!("body over {limit} bytes"),
        )),
        Err(err) => Err(Failure::new(PollError::Connect, source, err)),
    }
}

#[cfg(test)]
mod tests;
