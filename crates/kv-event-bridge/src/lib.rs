//! Exact cache state from the engines: one KV event subscription per
//! worker and data-parallel rank, feeding the block index that the
//! `kv_aware` policy scores on, and the liveness that says when it may.
//!
//! A router's radix tree records where it *sent* prompts; vLLM publishes
//! what each engine *holds* (`--kv-events-config` with the zmq publisher).
//! This crate is the bridge between the two: a [`KvEvents`] hub follows a
//! set of workers (the host hands it the current membership with
//! [`KvEvents::sync`]), keeps one [`kv_events::Subscriber`] per (worker,
//! rank), converts each batch's events to the index's form
//! ([`to_index_event`]) and applies them to a shared [`KvIndex`], and marks
//! each worker live or cold in [`KvStreams`]. Both halves are the
//! [`KvSources`] that lb-policies' `kv_aware` reads. Several router replicas
//! subscribed to the same engines hold the same view without sharing
//! anything. It knows no HTTP: router-http builds a hub when a pool's
//! policy is `kv_aware`, runs its sync on a timer, asks each new worker's
//! engine for its cache size ([`KvEvents::bound_by_engine`]) and renders
//! its metrics ([`KvEvents::render`]) and status ([`KvEvents::statuses`]).
//!
//! # Endpoints
//!
//! A worker's publisher is at `tcp://{worker host}:{port}` with the replay
//! socket at `{replay_port}` (vLLM's example ports 5557 and 5558), unless
//! [`KvEventsConfig::endpoints`] names the worker's URL. Data-parallel
//! ranks publish at `port + rank` (vLLM's `offset_endpoint_port`): a worker
//! registered with a rank follows that rank's socket; a worker without one
//! follows [`KvEventsConfig::data_parallel_size`] sockets, one per rank.
//! A worker's own [`KvEndpoints`] may instead list one socket per rank,
//! in rank order: a worker registered with a rank beyond the list is not
//! followed (it stays cold), logged and counted in
//! `router_kv_unplaced_ranks_total`.
//!
//! # When a worker is scored exactly
//!
//! A worker is *live* (its exact cached blocks count, see
//! `lb_policies::KvStreams`) when every one of its streams is connected and
//! has delivered a batch since its last reset. A stream that loses its
//! connection makes the worker cold until events flow again; a reset (the
//! engine restarted: sequence numbers went back; a gap no replay could
//! fill) clears the stream's blocks first. A worker that leaves, or is
//! replaced by a new registration generation (a new key), is unregistered:
//! its blocks go with it and the new lifetime starts cold. Cold workers are
//! scored from the policy's approximate tree.
//!
//! # What is applied
//!
//! Events of KV-cache group 0 (or none): a hybrid model's other groups
//! describe other caches and are skipped and counted; so is a batch that
//! names another data-parallel rank than its stream's. Events for the GPU
//! cache (medium `"GPU"` or none) go to the rank's stream; an offloading
//! connector's events for a lower tier (host memory, disk, an external
//! store: [`kv_block_index::Tier::of_medium`]) go to a stream of their
//! own for that rank and tier ([`kv_block_index::Holder::tiered`]), so
//! that `kv_aware` can credit a prefix the engine can load back instead
//! of computing it (at `--kv-penalty-host` and its siblings). An
//! `AllBlocksCleared` (the engine's prefix cache was reset) and a stream
//! reset clear every tier of the rank. Engine block hashes are opaque: the
//! index re-hashes each block's token ids with its own chained hash.
//!
//! # Floods and bad input
//!
//! The sockets are libzmq's: a frame larger than the subscriber's
//! [`kv_events::DecodeLimits::max_payload_bytes`] is refused before it is
//! buffered and its connection closed (the stream goes `connecting`, the
//! worker cold, and it reconnects). A subscriber's receive loop that ends
//! for any reason is restarted by its supervisor (counted in
//! `router_kv_restarts_total` and each stream's `restarts`); it resets the
//! stream first, so a worker is never scored on a frozen index.
//!
//! A stream holds at most [`KvEventsConfig::max_blocks_per_worker`] blocks
//! in the index, lowered to the engine's own cache size when the engine
//! says it (vLLM's `num_gpu_blocks` label of `vllm:cache_config_info`,
//! asked once from the worker's `/metrics` when it is first followed,
//! [`num_gpu_blocks`]): an engine never holds more, so a stream that
//! reports more loses its oldest blocks from the index. An engine can only
//! lower its cap this way, never raise it past the configured one.
//!
//! Each subscriber applies a batch to the index as it arrives (millions of
//! blocks per second): a publisher faster than that fills its socket
//! buffers, ZMQ's PUB socket drops what a slow subscriber cannot take, the
//! next message shows the gap, and the stream replays or resets. Payloads
//! are decoded within [`kv_events::DecodeLimits`]; undecodable messages,
//! unknown event tags, blocks whose size or token count is wrong and
//! parents the stream never stored are counted and skipped, never applied.
//!
//! ```
//! use std::sync::Arc;
//! use kv_block_index::{IndexConfig, KvIndex};
//! use kv_event_bridge::{KvEvents, KvEventsConfig};
//! use lb_policies::{KvSources, KvStreams};
//! use worker_lifecycle::RoleKind;
//!
//! let index = Arc::new(KvIndex::new(IndexConfig::default()));
//! let sources = KvSources::new(index, Arc::new(KvStreams::new()));
//! // Give `sources` to the kv_aware policy (PolicyConfig::with_kv), then
//! // follow the regular pool's workers:
//! let hub = KvEvents::new(KvEventsConfig::default(), sources, vec![RoleKind::Regular]);
//! assert_eq!(hub.config().port, 5557);
//! // Inside a tokio runtime, call hub.sync(&workers) whenever membership
//! // may have changed (router-http does every 200 ms).
//! assert!(hub.statuses().is_empty());
//! ```

mod config;
mod engine_size;

pub use config::{DEFAULT_PORT, DEFAULT_REPLAY_PORT, KvEndpoints, KvEventsConfig};
pub use engine_size::num_gpu_blocks;
/// The one conversion from vLLM's events to the index's, with why an event
/// is not converted: kv-block-index's (feature `wire`), which the routing
/// simulator uses too, re-exported where the router's code finds it.
pub use kv_block_index::wire::{Skipped, to_index_event, to_tiered_event};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use kv_block_index::{Holder, KvEvent, KvIndex, StreamWriter, Tier, WorkerId};
use kv_events::{KvEvent as WireEvent, StreamEvent, StreamState, Subscriber, SubscriberConfig};
use lb_policies::{KvSources, KvStreams};
use parking_lot::Mutex;
use prom_text::{Exposition, MetricType};
use worker_lifecycle::{RoleKind, Worker};

/// Events the hub did not apply to the index.
#[derive(Debug, Default)]
struct HubCounters {
    /// Events for a lower cache tier applied to its tier stream, by tier
    /// (host, disk, external).
    lower_tier: [AtomicU64; 3],
    /// Events for a lower tier that found no index slot for its stream.
    no_tier_slot: AtomicU64,
    /// Events of another KV-cache group (hybrid models).
    other_group: AtomicU64,
    /// Events of a batch that names another data-parallel rank than the
    /// stream's (a publisher port shared or misconfigured).
    other_rank: AtomicU64,
    /// Events that arrived after their worker left the index.
    late: AtomicU64,
    /// Ranks of followed workers for which no socket could be formed (a
    /// rank beyond its worker's per-rank endpoint list).
    unplaced_ranks: AtomicU64,
}

/// One (worker, rank) stream's state shared with its subscriber's sink.
#[derive(Debug)]
struct RankStream {
    rank: u32,
    endpoint: String,
    replay_endpoint: Option<String>,
    /// A batch was delivered since the last reset.
    warm: AtomicBool,
}

/// One tracked worker.
#[derive(Debug)]
struct Tracked {
    worker: Arc<Worker>,
    id: WorkerId,
    streams: Vec<(Arc<RankStream>, Subscriber)>,
    /// Whether the worker is marked live in [`KvStreams`]; changed under
    /// this lock so the sink and the sync task agree.
    live: Arc<Mutex<bool>>,
}

/// The router's KV event subscriptions and the index they feed; see the
/// [module docs](self).
#[derive(Debug)]
pub struct KvEvents {
    config: KvEventsConfig,
    sources: KvSources,
    roles: Vec<RoleKind>,
    tracked: Mutex<HashMap<Arc<str>, Tracked>>,
    /// Endpoints set after construction ([`KvEvents::set_endpoints`]),
    /// before the configuration's own.
    endpoints: Mutex<HashMap<String, KvEndpoints>>,
    counters: Arc<HubCounters>,
    /// Stream counters of workers no longer tracked, so totals only grow.
    retired: Mutex<kv_events::subscriber::StreamCounters>,
}

/// One worker's event state, as `/workers` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct WorkerKvStatus {
    /// `"live"` (scored on exact blocks) or `"cold"` (scored from the
    /// approximate tree).
    pub state: &'static str,
    /// Engine blocks the worker's GPU caches (every rank) hold in the
    /// index.
    pub blocks: usize,
    /// Engine blocks its lower cache tiers (host memory, disk, external
    /// stores) hold in the index.
    pub lower_tier_blocks: usize,
    /// Each rank's stream.
    pub streams: Vec<RankKvStatus>,
}

/// One rank's stream, as `/workers` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RankKvStatus {
    /// The data-parallel rank.
    pub rank: u32,
    /// The publisher's address.
    pub endpoint: String,
    /// The replay socket's address, if the stream has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay_endpoint: Option<String>,
    /// `connecting`, `live`, `replaying` or `cold`.
    pub state: &'static str,
    /// Why the stream was last reset, while it is cold.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reset_reason: Option<String>,
    /// The last delivered sequence number.
    pub last_seq: Option<u64>,
    /// Batches delivered.
    pub batches: u64,
    /// Gaps seen.
    pub gaps: u64,
    /// Resets (the stream's blocks dropped).
    pub resets: u64,
    /// Times the stream's receive loop ended (an error, a panic) and was
    /// restarted by its supervisor; the stream is `connecting` (and the
    /// worker cold) until it has read again.
    pub restarts: u64,
}

fn state_name(state: &StreamState) -> &'static str {
    match state {
        StreamState::Connecting => "connecting",
        StreamState::Live => "live",
        StreamState::Replaying { .. } => "replaying",
        StreamState::Cold { .. } => "cold",
    }
}

impl KvEvents {
    /// A hub over `sources` (the index and liveness handle the `kv_aware`
    /// policies read), following the workers of `roles`.
    pub fn new(config: KvEventsConfig, sources: KvSources, roles: Vec<RoleKind>) -> Self {
        Self {
            config,
            sources,
            roles,
            tracked: Mutex::new(HashMap::new()),
            endpoints: Mutex::new(HashMap::new()),
            counters: Arc::default(),
            retired: Mutex::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &KvEventsConfig {
        &self.config
    }

    /// The index and liveness handle.
    pub fn sources(&self) -> &KvSources {
        &self.sources
    }

    /// The index.
    pub fn index(&self) -> &Arc<KvIndex> {
        &self.sources.index
    }

    /// Sets where the worker at `worker_url` publishes, for workers that
    /// join from now on (a worker already followed keeps its streams until
    /// it leaves). For hosts that learn endpoints at run time: a
    /// registration that names them, engines started in-process.
    pub fn set_endpoints(&self, worker_url: impl Into<String>, endpoints: KvEndpoints) {
        self.endpoints.lock().insert(worker_url.into(), endpoints);
    }

    /// The (rank, publisher, replay) sockets the hub follows for `worker`:
    /// [`KvEvents::set_endpoints`] first, then the configuration's
    /// ([`KvEventsConfig::streams_of`]).
    pub fn streams_of(&self, worker: &Worker) -> Vec<(u32, String, Option<String>)> {
        match self.endpoints.lock().get(worker.endpoint().url()) {
            Some(own) => self.config.streams_with(worker, Some(own)),
            None => self.config.streams_of(worker),
        }
    }

    /// As [`streams_of`](Self::streams_of), with the ranks that could not
    /// be placed.
    fn plan_of(&self, worker: &Worker) -> config::StreamPlan {
        let own = self.endpoints.lock().get(worker.endpoint().url()).cloned();
        let own = own.or_else(|| self.config.endpoints.get(worker.endpoint().url()).cloned());
        self.config.plan(worker, own.as_ref())
    }

    /// The roles whose workers are followed.
    pub fn roles(&self) -> &[RoleKind] {
        &self.roles
    }

    /// Follows exactly the workers of `workers` whose role is followed:
    /// new ones are registered in the index and subscribed, departed ones
    /// unsubscribed and unregistered; then every worker's liveness is
    /// re-read from its streams. Needs a tokio runtime (subscribers are
    /// tasks). The router's background task calls this periodically.
    ///
    /// Returns the workers followed for the first time in this pass, with
    /// their index ids: the router asks each one's engine for its cache
    /// size ([`KvEvents::bound_by_engine`]).
    pub fn sync(&self, workers: &[Arc<Worker>]) -> Vec<(WorkerId, Arc<Worker>)> {
        let wanted: Vec<&Arc<Worker>> = workers
            .iter()
            .filter(|w| self.roles.contains(&w.role().kind()))
            .collect();
        let wanted_keys: std::collections::HashSet<&str> = wanted.iter().map(|w| w.key()).collect();
        let mut tracked = self.tracked.lock();
        let gone: Vec<Arc<str>> = tracked
            .keys()
            .filter(|key| !wanted_keys.contains(&***key))
            .cloned()
            .collect();
        for key in gone {
            if let Some(old) = tracked.remove(&key) {
                self.retire(old);
            }
        }
        let mut followed = Vec::new();
        for worker in wanted {
            if !tracked.contains_key(worker.key()) {
                let entry = self.follow(worker);
                followed.push((entry.id, Arc::clone(worker)));
                tracked.insert(Arc::from(worker.key()), entry);
            }
        }
        for entry in tracked.values() {
            self.refresh_liveness(entry);
        }
        followed
    }

    /// Lowers worker `id`'s block cap to the cache size its engine reports
    /// in `metrics` (its `/metrics` text), never above
    /// [`KvEventsConfig::max_blocks_per_worker`]. Returns the cap set, or
    /// `None` when the text names no size (or the worker left meanwhile).
    pub fn bound_by_engine(&self, id: WorkerId, metrics: &str) -> Option<std::num::NonZeroUsize> {
        let cap = num_gpu_blocks(metrics)?.min(self.config.max_blocks_per_worker);
        let evicted = self.sources.index.set_worker_capacity(id, cap).ok()?;
        tracing::debug!(
            cap,
            evicted,
            "KV events: block cap from the engine's cache size"
        );
        Some(cap)
    }

    /// Stops every subscription and forgets every worker.
    pub fn clear(&self) {
        let drained: Vec<Tracked> = self.tracked.lock().drain().map(|(_, t)| t).collect();
        for old in drained {
            self.retire(old);
        }
    }

    fn retire(&self, old: Tracked) {
        {
            let mut retired = self.retired.lock();
            for (_, subscriber) in &old.streams {
                add_counters(&mut retired, &subscriber.status().counters);
            }
        }
        // Dropping the subscribers aborts their tasks.
        drop(old.streams);
        self.sources.streams.set_live(old.id, false);
        self.sources.index.unregister_worker(old.id);
        tracing::debug!(worker = %old.worker.key(), "KV events: worker no longer followed");
    }

    fn follow(&self, worker: &Arc<Worker>) -> Tracked {
        let index = &self.sources.index;
        let id = index.register_worker(worker.key().to_owned());
        // A change the kv_aware policies notice: they resolve the new id.
        self.sources.streams.set_live(id, false);
        let live = Arc::new(Mutex::new(false));
        let mut streams = Vec::new();
        let plan = self.plan_of(worker);
        let sockets = if plan.unplaced.is_empty() {
            plan.streams
        } else {
            // A worker is live only when every rank is: without a socket
            // for one, none is followed.
            self.counters
                .unplaced_ranks
                .fetch_add(plan.unplaced.len() as u64, Ordering::Relaxed);
            tracing::warn!(
                worker = %worker.key(),
                ranks = ?plan.unplaced,
                "KV events: no event endpoint for these data-parallel ranks (beyond the worker's \
                 per-rank endpoint list, or a port past 65535); the worker is not followed and \
                 stays cold"
            );
            Vec::new()
        };
        if sockets.is_empty() && plan.unplaced.is_empty() {
            tracing::warn!(worker = %worker.key(), "KV events: no event endpoint can be formed; the worker stays cold");
        }
        let ranks: Vec<Arc<RankStream>> = sockets
            .iter()
            .map(|(rank, endpoint, replay)| {
                Arc::new(RankStream {
                    rank: *rank,
                    endpoint: endpoint.clone(),
                    replay_endpoint: replay.clone(),
                    warm: AtomicBool::new(false),
                })
            })
            .collect();
        for ((rank, endpoint, replay), state) in sockets.into_iter().zip(&ranks) {
            let writer = match index.stream(id, rank) {
                Ok(writer) => writer,
                Err(err) => {
                    tracing::warn!(worker = %worker.key(), rank, error = %err, "KV events: no index slot; the worker stays cold");
                    continue;
                }
            };
            let mut config = SubscriberConfig::new(endpoint).with_topic(self.config.topic.clone());
            config.limits.max_payload_bytes = self.config.max_message_size;
            if let Some(replay) = replay {
                config = config.with_replay(replay);
            }
            let sink = Sink {
                writer,
                index: Arc::clone(index),
                tiers: Mutex::new([None, None, None]),
                id,
                rank: Arc::clone(state),
                all_ranks: ranks.clone(),
                live: Arc::clone(&live),
                streams: Arc::clone(&self.sources.streams),
                counters: Arc::clone(&self.counters),
            };
            let subscriber = Subscriber::spawn(config, move |event| sink.on_event(event));
            streams.push((Arc::clone(state), subscriber));
        }
        tracing::debug!(worker = %worker.key(), streams = streams.len(), "KV events: following worker");
        Tracked {
            worker: Arc::clone(worker),
            id,
            streams,
            live,
        }
    }

    /// Live iff every rank is connected and warm; marks the change.
    fn refresh_liveness(&self, entry: &Tracked) {
        // Decided under the lock: a sink's reset in between cannot be
        // overwritten by a verdict read before it.
        let mut live = entry.live.lock();
        let now_live = !entry.streams.is_empty()
            && entry.streams.iter().all(|(rank, subscriber)| {
                rank.warm.load(Ordering::Acquire)
                    && matches!(
                        subscriber.status().state,
                        StreamState::Live | StreamState::Replaying { .. }
                    )
            });
        if *live != now_live {
            *live = now_live;
            self.sources.streams.set_live(entry.id, now_live);
        }
    }

    /// The event state of the worker with policy key `key`, if followed.
    pub fn worker_status(&self, key: &str) -> Option<WorkerKvStatus> {
        self.statuses().remove(key)
    }

    /// The event state of every followed worker, by policy key (one walk
    /// of the index's statistics for all of them).
    pub fn statuses(&self) -> HashMap<String, WorkerKvStatus> {
        let stats = self.sources.index.stats();
        // (device, lower tiers) per worker.
        let mut blocks: HashMap<WorkerId, (usize, usize)> = HashMap::new();
        for holder in &stats.holders {
            let held = blocks.entry(holder.holder.worker).or_default();
            if holder.holder.tier() == Tier::Device {
                held.0 += holder.blocks;
            } else {
                held.1 += holder.blocks;
            }
        }
        self.tracked
            .lock()
            .iter()
            .map(|(key, entry)| {
                let held = blocks.get(&entry.id).copied().unwrap_or_default();
                (key.to_string(), Self::status_of(entry, held))
            })
            .collect()
    }

    fn status_of(entry: &Tracked, (blocks, lower_tier_blocks): (usize, usize)) -> WorkerKvStatus {
        let streams = entry
            .streams
            .iter()
            .map(|(rank, subscriber)| {
                let status = subscriber.status();
                RankKvStatus {
                    rank: rank.rank,
                    endpoint: rank.endpoint.clone(),
                    replay_endpoint: rank.replay_endpoint.clone(),
                    state: state_name(&status.state),
                    reset_reason: match &status.state {
                        StreamState::Cold { reason } => Some(reason.to_string()),
                        _ => None,
                    },
                    last_seq: status.last_seq,
                    batches: status.counters.batches,
                    gaps: status.counters.gaps,
                    resets: status.counters.resets,
                    restarts: status.counters.restarts,
                }
            })
            .collect();
        WorkerKvStatus {
            state: if *entry.live.lock() { "live" } else { "cold" },
            blocks,
            lower_tier_blocks,
            streams,
        }
    }

    /// Writes the `router_kv_*` families.
    pub fn render(&self, exposition: &mut Exposition<'_>) {
        let mut totals = *self.retired.lock();
        let mut by_state: [(&str, u64); 4] = [
            ("connecting", 0),
            ("live", 0),
            ("replaying", 0),
            ("cold", 0),
        ];
        let mut workers = [("live", 0u64), ("cold", 0u64)];
        {
            let tracked = self.tracked.lock();
            for entry in tracked.values() {
                let live = *entry.live.lock();
                workers[usize::from(!live)].1 += 1;
                for (_, subscriber) in &entry.streams {
                    let status = subscriber.status();
                    add_counters(&mut totals, &status.counters);
                    let name = state_name(&status.state);
                    if let Some(slot) = by_state.iter_mut().find(|(s, _)| *s == name) {
                        slot.1 += 1;
                    }
                }
            }
        }
        let mut family = exposition.family(
            "router_kv_workers",
            MetricType::Gauge,
            "Workers followed through KV events, by whether they are scored on exact blocks (live) or from the approximate tree (cold).",
        );
        for (state, n) in workers {
            family.sample(&[("state", &state)], n);
        }
        let mut family = exposition.family(
            "router_kv_streams",
            MetricType::Gauge,
            "KV event streams (one per worker and data-parallel rank), by state.",
        );
        for (state, n) in by_state {
            family.sample(&[("state", &state)], n);
        }
        let stream_counters: [(&str, &str, u64); 9] = [
            (
                "router_kv_batches_total",
                "Event batches delivered in order.",
                totals.batches,
            ),
            (
                "router_kv_events_total",
                "Events in the delivered batches.",
                totals.events,
            ),
            (
                "router_kv_unknown_events_total",
                "Events of an unknown type, skipped.",
                totals.unknown_events,
            ),
            (
                "router_kv_gaps_total",
                "Sequence gaps seen in live streams.",
                totals.gaps,
            ),
            (
                "router_kv_replays_total",
                "Replays requested from the engines.",
                totals.replays,
            ),
            (
                "router_kv_resets_total",
                "Stream resets: the stream's blocks were dropped (engine restart, unrecoverable gap).",
                totals.resets,
            ),
            (
                "router_kv_decode_errors_total",
                "Messages that could not be decoded.",
                totals.decode_errors,
            ),
            (
                "router_kv_disconnects_total",
                "Connections to publishers lost.",
                totals.disconnects,
            ),
            (
                "router_kv_restarts_total",
                "Subscriber receive loops that ended (an error, a panic) and were restarted; the stream was cold until it read again.",
                totals.restarts,
            ),
        ];
        for (name, help, value) in stream_counters {
            exposition
                .family(name, MetricType::Counter, help)
                .sample(&[], value);
        }
        exposition
            .family(
                "router_kv_unplaced_ranks_total",
                MetricType::Counter,
                "Data-parallel ranks of followed workers with no KV event endpoint (a rank beyond its worker's per-rank endpoint list): the worker is not followed and stays cold.",
            )
            .sample(&[], self.counters.unplaced_ranks.load(Ordering::Relaxed));
        let index = self.sources.index.counters();
        let mut family = exposition.family(
            "router_kv_skipped_events_total",
            MetricType::Counter,
            "Events not applied to the index, by reason.",
        );
        let c = &self.counters;
        family.sample(
            &[("reason", &"no_tier_slot")],
            c.no_tier_slot.load(Ordering::Relaxed),
        );
        family.sample(
            &[("reason", &"other_group")],
            c.other_group.load(Ordering::Relaxed),
        );
        family.sample(
            &[("reason", &"other_rank")],
            c.other_rank.load(Ordering::Relaxed),
        );
        family.sample(
            &[("reason", &"worker_gone")],
            c.late.load(Ordering::Relaxed),
        );
        let mut family = exposition.family(
            "router_kv_lower_tier_events_total",
            MetricType::Counter,
            "Events for a lower cache tier (vLLM's medium other than GPU) applied to the index, by tier.",
        );
        for (tier, count) in ["host", "disk", "external"].iter().zip(&c.lower_tier) {
            family.sample(&[("tier", tier)], count.load(Ordering::Relaxed));
        }
        let mut family = exposition.family(
            "router_kv_index_blocks_total",
            MetricType::Counter,
            "Blocks the index applied, by outcome.",
        );
        family.sample(&[("outcome", &"stored")], index.stored_blocks);
        family.sample(&[("outcome", &"removed")], index.removed_blocks);
        family.sample(
            &[("outcome", &"unknown_parent")],
            index.unknown_parent_blocks,
        );
        family.sample(
            &[("outcome", &"unknown_removed")],
            index.unknown_removed_blocks,
        );
        family.sample(&[("outcome", &"malformed")], index.malformed_blocks);
        family.sample(&[("outcome", &"evicted_over_cap")], index.evicted_blocks);
        let stats = self.sources.index.stats();
        exposition
            .family(
                "router_kv_index_entries",
                MetricType::Gauge,
                "(block, worker rank) pairs the index holds.",
            )
            .sample(&[], stats.pairs as u64);
        exposition
            .family(
                "router_kv_index_bytes",
                MetricType::Gauge,
                "Bytes of the block index and its per-stream hash maps.",
            )
            .sample(&[], stats.total_bytes() as u64);
    }
}

fn add_counters(
    into: &mut kv_events::subscriber::StreamCounters,
    from: &kv_events::subscriber::StreamCounters,
) {
    into.batches += from.batches;
    into.events += from.events;
    into.unknown_events += from.unknown_events;
    into.gaps += from.gaps;
    into.replays += from.replays;
    into.resets += from.resets;
    into.decode_errors += from.decode_errors;
    into.disconnects += from.disconnects;
    into.restarts += from.restarts;
}

/// A subscriber's sink: applies batches to the index in stream order.
struct Sink {
    writer: StreamWriter,
    /// The index, to open the rank's lower-tier streams on first use.
    index: Arc<KvIndex>,
    /// The rank's lower-tier streams (host, disk, external), opened when
    /// the engine first reports a block there. Only this sink's subscriber
    /// task takes the lock.
    tiers: Mutex<[Option<StreamWriter>; 3]>,
    id: WorkerId,
    rank: Arc<RankStream>,
    all_ranks: Vec<Arc<RankStream>>,
    live: Arc<Mutex<bool>>,
    streams: Arc<KvStreams>,
    counters: Arc<HubCounters>,
}

impl Sink {
    fn on_event(&self, event: StreamEvent) {
        match event {
            StreamEvent::Batch { batch, .. } => {
                // Another rank's cache is not this stream's: applying it
                // would credit this rank with blocks it does not hold.
                if batch
                    .data_parallel_rank
                    .is_some_and(|rank| rank != self.rank.rank)
                {
                    self.counters
                        .other_rank
                        .fetch_add(batch.events.len() as u64, Ordering::Relaxed);
                    return;
                }
                for event in batch.events {
                    let Some((tier, event)) = self.convert(event) else {
                        continue;
                    };
                    let applied = match tier {
                        Tier::Device => {
                            let applied = self.writer.apply(&event).is_ok();
                            if applied && matches!(event, KvEvent::AllBlocksCleared) {
                                // The engine reset its prefix cache: its
                                // lower tiers are not credited on faith.
                                self.clear_tiers();
                            }
                            applied
                        }
                        tier => self.apply_lower(tier, &event),
                    };
                    if !applied {
                        // Unregistered while the batch was on its way.
                        self.counters.late.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
                if !self.rank.warm.swap(true, Ordering::AcqRel) {
                    self.set_live(
                        self.all_ranks
                            .iter()
                            .all(|r| r.warm.load(Ordering::Acquire)),
                    );
                }
            }
            StreamEvent::Reset { .. } => {
                self.rank.warm.store(false, Ordering::Release);
                self.set_live(false);
                let _ = self.writer.clear();
                self.clear_tiers();
            }
            _ => {}
        }
    }

    /// Applies a lower tier's event to the rank's stream for that tier,
    /// opening it on first use. False only when the worker left the index
    /// (the caller stops the batch); a tier stream that finds no index
    /// slot skips the event, counted, and the device stream goes on.
    fn apply_lower(&self, tier: Tier, event: &KvEvent) -> bool {
        let slot = tier as usize - 1;
        let mut tiers = self.tiers.lock();
        if tiers[slot].is_none() {
            let rank = Holder::tiered_rank(self.rank.rank, tier);
            match self.index.stream(self.id, rank) {
                Ok(writer) => tiers[slot] = Some(writer),
                Err(kv_block_index::KvIndexError::UnknownWorker(_)) => return false,
                Err(_) => {
                    self.counters.no_tier_slot.fetch_add(1, Ordering::Relaxed);
                    return true;
                }
            }
        }
        let Some(writer) = &tiers[slot] else {
            return true;
        };
        if writer.apply(event).is_err() {
            return false;
        }
        self.counters.lower_tier[slot].fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Drops every block of the rank's lower-tier streams.
    fn clear_tiers(&self) {
        for writer in self.tiers.lock().iter().flatten() {
            let _ = writer.clear();
        }
    }

    fn set_live(&self, now_live: bool) {
        let mut live = self.live.lock();
        if *live != now_live {
            *live = now_live;
            self.streams.set_live(self.id, now_live);
        }
    }

    /// The index's form of a wire event and its cache tier, or `None`
    /// (counted) for events about another cache.
    fn convert(&self, event: WireEvent) -> Option<(Tier, KvEvent)> {
        match to_tiered_event(event) {
            Ok(converted) => Some(converted),
            Err(Skipped::OtherGroup) => {
                self.counters.other_group.fetch_add(1, Ordering::Relaxed);
                None
            }
            // `Skipped` is kv-block-index's and may grow; a reason this
            // bridge has no counter for yet is still a skip.
            Err(_) => None,
        }
    }
}
