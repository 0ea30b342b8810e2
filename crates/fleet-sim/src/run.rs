//! The discrete-event loop: engines on one virtual clock, requests placed
//! by the production policies and load-guarded by production workers.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use engine_sim::{
    Engine, EventKind, KvTransferParams, PdSettings, RequestSummary, Role, SimRequest,
    TransferRegistry, transfer::ProducerAddress,
};
use lb_policies::{
    Backend, INDEX_POLICIES, OwnedContext, PolicyConfig, PolicyRegistry, RequestContext,
    RoutingInput, RoutingInputBuf,
};
use pd_orchestrator::pools::{PdConfig, PdLease, PdPools, PdScope, PdTarget, PdWorkerConfig};
use pd_orchestrator::{LegOutcome, PdBackend, PdConnector, Phase, PhaseGuard};
use worker_lifecycle::{Endpoint, LoadGuard, RoleKind, RolePool, Worker, WorkerRole, WorkerSpec};

use crate::config::{LoadPolling, RoutingSource, RunReport, SimConfig, SimError, split_policy};
use crate::kv::KvFeed;
use crate::metrics::{Completion, LoadTimeline, Tally};
use crate::polls::Polls;
use crate::pool::{Pool, worker_options, worker_url};
use crate::trace::PreparedTrace;

/// The model id every simulated request names.
const MODEL: &str = "sim-model";

/// The connector of a P/D run: NIXL, the sequential pull path whose
/// decode worker may be chosen when the prefill completes.
const CONNECTOR: PdConnector = PdConnector::Nixl;

/// How requests are placed: the router's own selection code, a role pool
/// in regular mode and pd-orchestrator's pair selection under P/D.
enum Placement {
    /// One pool per router replica.
    Regular(Vec<RolePool>),
    Pd(Box<PdPools>),
}

/// What a leg holds while it runs: the worker's load.
enum Held {
    Guard(LoadGuard),
    Lease(PdLease),
}

impl Held {
    /// The leg ended normally: its load comes down (a P/D lease records
    /// its success first, as the flow does).
    fn finish(self) {
        match self {
            Self::Guard(guard) => drop(guard),
            Self::Lease(lease) => lease.finish(LegOutcome::Success, None),
        }
    }
}

fn policy_config(policy: &str, config: &SimConfig) -> PolicyConfig {
    let mut policy_config = PolicyConfig::named(policy).with_seed(config.seed);
    policy_config.cache_aware = config.cache_aware.clone();
    // Token matches count whole engine blocks only (text is not rounded).
    policy_config.cache_aware.block_size = config.model.block_size.max(1);
    policy_config
}

/// [`policy_config`] of one replica, with its block index for `kv_aware`.
fn replica_config(
    policy: &str,
    config: &SimConfig,
    feed: Option<&KvFeed>,
    replica: usize,
) -> PolicyConfig {
    let policy_config = policy_config(policy, config);
    match feed.and_then(|f| f.sources(replica)) {
        Some(sources) if INDEX_POLICIES.contains(&policy) => policy_config.with_kv(sources),
        _ => policy_config,
    }
}

/// A request in flight on one leg.
struct Flight {
    trace_index: usize,
    /// Held until the leg finishes: the worker's load while in flight.
    held: Held,
    /// P/D prefill legs: the prefill target (whose request scope a late
    /// decode choice reads) and the decode worker chosen with it at arrival.
    pd: Option<(PdTarget, Option<PdTarget>)>,
}

/// Which pool an engine event came from.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Which {
    Main,
    Decode,
}

struct Sim<'a> {
    trace: &'a PreparedTrace,
    /// Regular engines, or the prefill pool under P/D.
    main: Pool,
    decode: Option<Pool>,
    placement: Placement,
    main_flights: HashMap<u64, Flight>,
    decode_flights: HashMap<u64, Flight>,
    tally: Tally,
    timeline: LoadTimeline,
    sample_every: Duration,
    next_sample: Duration,
    config_drained: usize,
    late_decode_choice: bool,
    routing: RoutingSource,
    /// `kv_aware`: the main pool's KV events on their way to the replicas'
    /// block indexes.
    kv: Option<KvFeed>,
    replicas: usize,
    /// Periodic engine load polls, if [`LoadPolling::Every`].
    polls: Option<Polls>,
    /// [`LoadPolling::Oracle`]: every decision reads the engines' loads.
    oracle_load: bool,
    /// Requests placed on each main-pool engine.
    placed: Vec<usize>,
    /// [`SimConfig::replica_sync`]: the delay, and the choices on their
    /// way to the other replicas (due time, replica that made it, trace
    /// index, worker key), in due order.
    sync: Option<(Duration, VecDeque<SharedChoice>)>,
}

/// A routing choice on its way to the other replicas: when it is due, the
/// replica that made it, the request's trace index and the worker's key.
type SharedChoice = (Duration, usize, usize, Arc<str>);

/// Replays `trace` with `policy` placing every request (the prefill leg
/// under P/D) and returns what it measured. `policy` is a policy name as on
/// the router's command line, optionally with a routing-input suffix
/// (`cache_aware:tokens`, see [`split_policy`]). `progress` is called with
/// the number of requests dispatched so far, every 64 requests and at the
/// end.
pub fn simulate(
    trace: &PreparedTrace,
    label: &str,
    config: &SimConfig,
    progress: &dyn Fn(usize),
) -> Result<RunReport, SimError> {
    if trace.is_empty() {
        return Err(SimError::EmptyTrace);
    }
    let (policy, routing) = split_policy(label)?;
    if config.replicas == 0 || (config.replicas > 1 && config.pd.is_some()) {
        return Err(SimError::Replicas);
    }
    if !(config.slow_factor.is_finite() && config.slow_factor >= 1.0) {
        return Err(SimError::SlowFactor);
    }
    let mut kv = INDEX_POLICIES.contains(&policy).then(|| {
        KvFeed::new(
            config.replicas,
            config.model.block_size.max(1),
            config.kv_event_delay,
        )
    });
    let (mut main, decode, placement) = match config.pd {
        None => {
            let mut pools = Vec::with_capacity(config.replicas);
            for replica in 0..config.replicas {
                let registry = PolicyRegistry::<Arc<Worker>>::new(replica_config(
                    policy,
                    config,
                    kv.as_ref(),
                    replica,
                ))?;
                // Instantiate the model's policy first so it sees every Added event.
                registry.policy(MODEL)?;
                let pool = RolePool::fixed(RoleKind::Regular, worker_options(), registry)
                    .map_err(|e| SimError::Worker(e.to_string()))?;
                for i in 0..config.workers {
                    let endpoint = Endpoint::new(&worker_url(RoleKind::Regular, i), None)
                        .map_err(|e| SimError::Worker(e.to_string()))?;
                    pool.add(WorkerSpec::new(WorkerRole::Regular, endpoint).with_model(MODEL))
                        .map_err(|e| SimError::Worker(e.to_string()))?;
                }
                if let Some(feed) = kv.as_mut() {
                    feed.attach(replica, pool.workers().iter().map(|w| w.key()))?;
                }
                pools.push(pool);
            }
            let others: Vec<Arc<[Arc<Worker>]>> =
                pools.iter().skip(1).map(RolePool::workers).collect();
            let main = Pool::new(
                pools[0].workers(),
                &others,
                config.drained,
                config.slow_engines,
                config,
                |_| PdSettings::default(),
            )?;
            (main, None, Placement::Regular(pools))
        }
        Some(split) => {
            let mut pd = PdConfig::new(CONNECTOR);
            pd.prefill_policy = Some(replica_config(policy, config, kv.as_ref(), 0));
            pd.decode_policy = Some(policy_config(&config.decode_policy, config));
            let statics = |role, n| -> Vec<PdWorkerConfig> {
                (0..n)
                    .map(|i| PdWorkerConfig::new(worker_url(role, i)).with_model(MODEL))
                    .collect()
            };
            pd.prefill = statics(RoleKind::Prefill, split.prefill);
            pd.decode = statics(RoleKind::Decode, split.decode);
            let pools = PdPools::new(
                &pd,
                &replica_config(policy, config, kv.as_ref(), 0),
                &worker_options(),
            )
            .map_err(|e| match e {
                pd_orchestrator::pools::PoolsError::Policy(e) => SimError::Policy(e),
                other => SimError::Worker(other.to_string()),
            })?;
            let (connector, moriio_mode) =
                crate::for_deployment(CONNECTOR).expect("engine-sim simulates NIXL");
            let transfers = TransferRegistry::new();
            let prefill_settings = |i: usize| PdSettings {
                role: Role::Prefill,
                connector,
                moriio_mode,
                address: ProducerAddress {
                    engine_id: format!("prefill-{i}"),
                    host: format!("prefill-{i}"),
                    port: 8000,
                    bootstrap_port: None,
                },
                registry: Some(Arc::clone(&transfers)),
            };
            let decode_settings = |_| PdSettings {
                role: Role::Decode,
                connector,
                moriio_mode,
                registry: Some(Arc::clone(&transfers)),
                ..PdSettings::default()
            };
            if let Some(feed) = kv.as_mut() {
                feed.attach(0, pools.prefill().workers().iter().map(|w| w.key()))?;
            }
            let main = Pool::new(
                pools.prefill().workers(),
                &[],
                config.drained,
                config.slow_engines,
                config,
                prefill_settings,
            )?;
            let decode = Pool::new(pools.decode().workers(), &[], 0, 0, config, decode_settings)?;
            (main, Some(decode), Placement::Pd(Box::new(pools)))
        }
    };
    if kv.is_some() {
        for engine in &mut main.engines {
            engine.set_kv_events(true);
        }
    }
    let span = trace.trace.span();
    // `load_samples` samples over 1.25 × the arrival span; sampling goes
    // on through the drain after the last arrival, however long it is.
    let sample_every =
        (span.mul_f64(1.25) / config.load_samples.max(1) as u32).max(Duration::from_millis(1));
    let workers = main
        .candidates
        .iter()
        .map(|c| {
            c.url()
                .trim_start_matches("http://")
                .trim_end_matches(":8000")
                .to_owned()
        })
        .collect::<Vec<_>>();
    let main_engines = main.engines.len();
    let mut sim = Sim {
        trace,
        timeline: LoadTimeline {
            loads: vec![Vec::new(); workers.len()],
            workers,
            times: Vec::new(),
        },
        main,
        decode,
        placement,
        main_flights: HashMap::new(),
        decode_flights: HashMap::new(),
        tally: Tally::default(),
        sample_every,
        next_sample: Duration::ZERO,
        config_drained: config.drained,
        late_decode_choice: config.late_decode_choice,
        routing,
        kv,
        replicas: config.replicas,
        polls: match config.load_polling {
            LoadPolling::Every { interval, delay } if config.pd.is_none() => {
                Some(Polls::new(config.replicas, interval, delay))
            }
            _ => None,
        },
        oracle_load: config.load_polling == LoadPolling::Oracle && config.pd.is_none(),
        placed: vec![0; main_engines],
        sync: config
            .replica_sync
            .filter(|_| config.replicas > 1 && config.pd.is_none())
            .map(|delay| (delay, VecDeque::new())),
    };
    for (index, request) in trace.trace.requests.iter().enumerate() {
        sim.run_until(request.arrival);
        sim.dispatch(index);
        if index % 64 == 63 {
            progress(index + 1);
        }
    }
    sim.run_until(Duration::MAX);
    progress(trace.len());
    Ok(sim.finish(label))
}

impl Sim<'_> {
    /// Processes every engine event up to and including `until`, in time
    /// order (ties: main pool first, then by engine index), taking load
    /// samples on the way.
    fn run_until(&mut self, until: Duration) {
        loop {
            let main = self.main.next_event().map(|(t, i)| (t, Which::Main, i));
            let decode = self
                .decode
                .as_ref()
                .and_then(Pool::next_event)
                .map(|(t, i)| (t, Which::Decode, i));
            let next = match (main, decode) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let Some((at, which, engine)) = next.filter(|(t, _, _)| *t <= until) else {
                if until != Duration::MAX {
                    self.poll_until(until, true);
                }
                break;
            };
            // Polls sent before this event see the engines as they are
            // now; a poll at the same instant sees the event's effects.
            self.poll_until(at, false);
            if self.main_flights.is_empty()
                && self.decode_flights.is_empty()
                && until == Duration::MAX
            {
                // Only unclaimed KV holds are left; nothing to measure.
                break;
            }
            self.sample_until(at);
            self.step(which, engine, at);
        }
        if until != Duration::MAX {
            self.sample_until(until);
        }
    }

    /// Sends the polls and applies the answers due before `at` (or at
    /// it, if `inclusive`), in time order.
    fn poll_until(&mut self, at: Duration, inclusive: bool) {
        let Some(polls) = self.polls.as_mut() else {
            return;
        };
        while let Some(due) = polls
            .next_due()
            .filter(|&t| t < at || (inclusive && t == at))
        {
            let answer_due = polls
                .answers
                .first_key_value()
                .is_some_and(|(k, _)| k.0 == due);
            if answer_due {
                let Some((_, (replica, loads))) = polls.answers.pop_first() else {
                    break;
                };
                for (i, (engine_load, own, usage, waiting)) in loads.into_iter().enumerate() {
                    let worker = self.main.worker(replica, i);
                    worker.record_engine_load(engine_load, own);
                    worker.record_engine_cache_usage(usage);
                    worker.record_engine_waiting(Some(waiting));
                }
                continue;
            }
            let Some(replica) = polls.next.iter().position(|&t| t == due) else {
                break;
            };
            let loads = (0..self.main.engines.len())
                .map(|i| {
                    (
                        self.main.engines[i].in_flight(),
                        Worker::load(self.main.worker(replica, i)),
                        self.main.engines[i].cache().usage(),
                        self.main.engines[i].waiting(),
                    )
                })
                .collect();
            polls.sequence += 1;
            polls
                .answers
                .insert((due + polls.delay, polls.sequence), (replica, loads));
            polls.next[replica] = due + polls.interval;
        }
    }

    fn sample_until(&mut self, at: Duration) {
        while self.next_sample <= at && self.timeline.times.len() < 100_000 {
            self.timeline.times.push(self.next_sample.as_secs_f64());
            for (w, series) in self.timeline.loads.iter_mut().enumerate() {
                series.push(self.main.load(w));
            }
            self.next_sample += self.sample_every;
        }
    }

    /// Advances one engine to `at` and handles what finished.
    fn step(&mut self, which: Which, engine: usize, at: Duration) {
        let pool = match which {
            Which::Main => &mut self.main,
            Which::Decode => match self.decode.as_mut() {
                Some(pool) => pool,
                None => return,
            },
        };
        pool.engines[engine].advance_to(at);
        pool.observe(engine, at);
        if which == Which::Main
            && let Some(feed) = self.kv.as_mut()
        {
            feed.collect(engine, &mut pool.engines[engine]);
        }
        let finished: Vec<(u64, Box<RequestSummary>)> = pool.engines[engine]
            .drain_events()
            .filter_map(|e| match e.kind {
                EventKind::Finished(summary) => Some((e.id, summary)),
                _ => None,
            })
            .collect();
        for (id, summary) in finished {
            match which {
                Which::Main => self.main_finished(id, summary, at),
                Which::Decode => self.decode_finished(id, &summary),
            }
        }
    }

    /// The routing context of request `index`: its text (or the engines'
    /// token ids) and session key.
    fn context(&self, index: usize) -> RequestContext<'_> {
        let request = &self.trace.trace.requests[index];
        let ctx = RequestContext::new(MODEL);
        let ctx = match self.routing {
            RoutingSource::Text => ctx.with_text(&request.prompt),
            RoutingSource::Tokens => ctx.with_tokens(self.trace.tokens(index)),
        };
        match &request.session {
            Some(session) => ctx.with_session(session),
            None => ctx,
        }
    }

    /// The owned form of [`context`](Self::context), for the P/D pools'
    /// request scope.
    fn owned_context(&self, index: usize) -> OwnedContext {
        let request = &self.trace.trace.requests[index];
        OwnedContext {
            model: MODEL.to_owned(),
            routing: match self.routing {
                RoutingSource::Text => RoutingInputBuf::Text(request.prompt.to_string()),
                RoutingSource::Tokens => RoutingInputBuf::Tokens(self.trace.tokens(index).to_vec()),
            },
            session: request.session.as_deref().map(str::to_owned),
            ..OwnedContext::default()
        }
    }

    /// Places request `index` on the main pool: the engine, what its leg
    /// holds, and (P/D) its targets. `None`: refused.
    fn place(&self, index: usize) -> Option<(usize, Flight)> {
        match &self.placement {
            Placement::Regular(pools) => {
                // The load balancer in front of the replicas: round robin
                // over requests.
                let replica = index % pools.len();
                let pool = &pools[replica];
                if self.oracle_load {
                    for i in 0..self.main.engines.len() {
                        let worker = self.main.worker(replica, i);
                        worker.record_engine_load(
                            self.main.engines[i].in_flight(),
                            Worker::load(worker),
                        );
                        worker.record_engine_cache_usage(self.main.engines[i].cache().usage());
                        worker.record_engine_waiting(Some(self.main.engines[i].waiting()));
                    }
                }
                let context = self.context(index);
                let workers = pool.workers();
                let eligible = pool.eligible(&workers, MODEL, |_| true).ok()?;
                pool.require_available(&eligible).ok()?;
                let reserved = pool.choose_reserved(&eligible, &context).ok()?;
                let engine = self.main.engine_of(reserved.guard.worker())?;
                let flight = Flight {
                    trace_index: index,
                    held: Held::Guard(reserved.guard),
                    pd: None,
                };
                Some((engine, flight))
            }
            Placement::Pd(pools) => {
                let scope = Arc::new(PdScope::new(self.owned_context(index)));
                // Under P/D with the arrival choice both workers are taken
                // up front (the router's MoRI-IO READ path); by default the
                // decode worker is chosen when the prefill completes. Either
                // way the decode is reserved only when its leg is sent
                // (invariant 9 of docs/architecture.md).
                let (prefill, decode) = if self.late_decode_choice {
                    (pools.select_prefill(&scope).ok()?, None)
                } else {
                    let pair = pools.select_pair(&scope).ok()?;
                    (pair.prefill, Some(pair.decode))
                };
                let lease = pools.reserve(&prefill, Phase::Prefill).ok()?;
                let engine = self.main.engine_of(prefill.worker())?;
                let flight = Flight {
                    trace_index: index,
                    held: Held::Lease(lease),
                    pd: Some((prefill, decode)),
                };
                Some((engine, flight))
            }
        }
    }

    /// Hands every shared choice due by `at` to the replicas that did not
    /// make it ([`SimConfig::replica_sync`]). Choices matter only to
    /// decisions, so delivering them just before each decision is the
    /// same as delivering them on time.
    fn deliver_choices(&mut self, at: Duration) {
        let (Some((_, queue)), Placement::Regular(pools)) = (self.sync.as_mut(), &self.placement)
        else {
            return;
        };
        while let Some((_, origin, index, key)) = queue.front().filter(|c| c.0 <= at).cloned() {
            queue.pop_front();
            let request = &self.trace.trace.requests[index];
            let input = match self.routing {
                RoutingSource::Text => RoutingInput::Text(&request.prompt),
                RoutingSource::Tokens => RoutingInput::Tokens(self.trace.tokens(index)),
            };
            for (replica, pool) in pools.iter().enumerate() {
                if replica != origin {
                    pool.policies().learn_choice(MODEL, input, &key);
                }
            }
        }
    }

    fn dispatch(&mut self, index: usize) {
        let at = self.trace.trace.requests[index].arrival;
        if let Some(feed) = self.kv.as_mut() {
            feed.deliver(at);
        }
        self.deliver_choices(at);
        let Some((worker, flight)) = self.place(index) else {
            self.tally.rejected += 1;
            return;
        };
        if let Some((delay, queue)) = self.sync.as_mut() {
            let key: Arc<str> = self.main.worker(0, worker).key().into();
            queue.push_back((at + *delay, index % self.replicas, index, key));
        }
        // Routing loss: what the chosen cache held against the best one,
        // read before the engine admits the request.
        let hashes = &self.trace.hashes[index];
        let max_hit = self.trace.prompt_tokens(index).saturating_sub(1) / self.main_block();
        let cached = |e: &Engine| e.cache().prefix_hits(hashes).min(max_hit) as u64;
        let best = self
            .main
            .engines
            .iter()
            .zip(self.main.candidates.iter())
            .filter(|(_, c)| c.is_available())
            .map(|(e, _)| cached(e))
            .max()
            .unwrap_or(0);
        let chosen = cached(&self.main.engines[worker]);
        let block = self.main_block() as u64;
        self.tally.best_cached += best * block;
        self.tally.chosen_cached += chosen * block;
        self.tally.decisions += 1;

        let request = &self.trace.trace.requests[index];
        let mut sim_request = SimRequest::new(
            index as u64,
            self.trace.tokens[index].clone(),
            request.output_tokens,
        );
        if self.decode.is_some() {
            sim_request.kv_transfer_params = Some(KvTransferParams {
                do_remote_decode: true,
                ..KvTransferParams::default()
            });
        }
        match self.main.engines[worker].submit(at, sim_request) {
            Ok(()) => {
                self.placed[worker] += 1;
                self.main.observe(worker, at);
                if let Some(feed) = self.kv.as_mut() {
                    feed.collect(worker, &mut self.main.engines[worker]);
                }
                self.main_flights.insert(index as u64, flight);
            }
            Err(_) => {
                self.tally.rejected += 1;
                drop(flight);
            }
        }
    }

    fn main_block(&self) -> usize {
        self.main.engines[0].config().block_size.max(1)
    }

    fn main_finished(&mut self, id: u64, summary: Box<RequestSummary>, at: Duration) {
        let Some(flight) = self.main_flights.remove(&id) else {
            return;
        };
        self.tally.prompt_tokens += summary.prompt_tokens as u64;
        self.tally.cached_tokens += summary.cached_tokens as u64;
        // Prefill load ends with the prefill (invariant 9).
        flight.held.finish();
        let (Some((prefill, decode)), Placement::Pd(pools)) = (flight.pd, &self.placement) else {
            self.tally.completions.push(Completion {
                ttft: summary.ttft(),
                e2e: summary.e2e(),
                finished_at: summary.finished_at,
                output_tokens: summary.completion_tokens,
            });
            return;
        };
        match decode.or_else(|| pools.select_decode(&prefill)) {
            Some(decode) => self.dispatch_decode(flight.trace_index, &decode, &summary, at),
            None => self.tally.rejected += 1,
        }
    }

    fn dispatch_decode(
        &mut self,
        index: usize,
        target: &PdTarget,
        prefill: &RequestSummary,
        at: Duration,
    ) {
        let Some(worker) = self
            .decode
            .as_ref()
            .and_then(|p| p.engine_of(target.worker()))
        else {
            self.tally.rejected += 1;
            return;
        };
        // A decode step ending at this very instant is handled first, so
        // the requests it finishes release their guards before this one
        // is counted (the submit below would otherwise run it silently).
        let due = self.decode.as_ref().is_some_and(|pool| {
            pool.engines[worker]
                .next_event_time()
                .is_some_and(|t| t <= at)
        });
        if due {
            self.step(Which::Decode, worker, at);
        }
        let Placement::Pd(pools) = &self.placement else {
            return;
        };
        let Ok(lease) = pools.reserve(target, Phase::Decode) else {
            self.tally.rejected += 1;
            return;
        };
        let Some(pool) = self.decode.as_mut() else {
            return;
        };
        let request = &self.trace.trace.requests[index];
        let mut sim_request = SimRequest::new(
            index as u64,
            self.trace.tokens[index].clone(),
            request.output_tokens,
        );
        sim_request.kv_transfer_params = prefill
            .kv_transfer_params
            .as_ref()
            .map(KvTransferParams::from_json);
        match pool.engines[worker].submit(at, sim_request) {
            Ok(()) => {
                pool.observe(worker, at);
                self.decode_flights.insert(
                    index as u64,
                    Flight {
                        trace_index: index,
                        held: Held::Lease(lease),
                        pd: None,
                    },
                );
            }
            Err(_) => {
                self.tally.rejected += 1;
                drop(lease);
            }
        }
    }

    fn decode_finished(&mut self, id: u64, summary: &RequestSummary) {
        let Some(flight) = self.decode_flights.remove(&id) else {
            return;
        };
        flight.held.finish();
        let arrival = self.trace.trace.requests[flight.trace_index].arrival;
        self.tally.completions.push(Completion {
            ttft: summary.first_token_at.saturating_sub(arrival),
            e2e: summary.finished_at.saturating_sub(arrival),
            finished_at: summary.finished_at,
            output_tokens: summary.completion_tokens,
        });
    }

    fn finish(self, policy: &str) -> RunReport {
        let first = self.trace.trace.requests[0].arrival;
        let available = self.main.busy.len() - self.config_drained;
        let metrics = self
            .tally
            .metrics(self.trace.len(), first, &self.main.busy[..available]);
        let final_loads = std::iter::once(&self.main)
            .chain(self.decode.as_ref())
            .flat_map(|p| (0..p.engines.len()).map(|i| p.load(i)))
            .collect();
        let registries: Vec<&PolicyRegistry<Arc<Worker>>> = match &self.placement {
            Placement::Regular(pools) => pools.iter().map(RolePool::policies).collect(),
            Placement::Pd(pools) => vec![pools.prefill().policies()],
        };
        // Summed over the replicas, by reason.
        let mut by_reason: BTreeMap<String, u64> = BTreeMap::new();
        for registry in registries {
            for (_, _, counts) in registry.counts() {
                for (reason, n) in counts.iter().filter(|(_, n)| *n > 0) {
                    *by_reason.entry(reason.to_string()).or_default() += n;
                }
            }
        }
        let decisions: Vec<(String, u64)> = by_reason.into_iter().collect();
        let kv_transfers = self.decode.as_ref().map_or((0, 0), |pool| {
            pool.engines.iter().fold((0, 0), |(valid, invalid), e| {
                let stats = e.stats();
                (
                    valid + stats.kv_transfers_valid,
                    invalid + stats.kv_transfers_invalid_total(),
                )
            })
        });
        RunReport {
            workload: self.trace.trace.name.clone(),
            policy: policy.to_owned(),
            metrics,
            load_timeline: self.timeline,
            final_loads,
            decisions,
            kv_transfers,
            replicas: self.replicas,
            placed: self.placed,
        }
    }
}
