//! Kv-aware routing: cache-aware placement scored on the blocks the engines
//! really hold, by their own KV-cache events (feature `kv-block-index`).
//!
//! # Why
//!
//! Cache-aware's radix tree records where the router *sent* prompts. The
//! engines evict, restart and fill their caches from other routers behind
//! its back, so the tree can name a worker that no longer holds the prefix
//! and miss one that does. vLLM publishes what each worker holds
//! (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`); a host that
//! subscribes to those events keeps a [`KvIndex`] and hands it to this
//! policy, which scores workers on exact cached blocks. The name is
//! vllm-router's.
//!
//! # The decision (token input)
//!
//! 1. Hash the request's full blocks with the index's hasher and look them
//!    up: every (worker, rank) with its longest held prefix in blocks.
//! 2. Score every available candidate in blocks:
//!    * a worker whose event stream is **live** ([`KvStreams`]) scores its
//!      exact prefix from the index — the longest over its data-parallel
//!      ranks, because the [`Backend`] trait names a worker, not a rank;
//!    * any other worker (**cold**: no stream, stream lost, or not yet
//!      known to the index) scores from the approximate token tree of an
//!      embedded [`CacheAware`]: its matched tokens rounded down to whole
//!      blocks. Both scores count blocks the engine would reuse, so they
//!      compare directly; on equal blocks an exact score beats an
//!      approximate one.
//! 3. The worker of least expected cost takes the request
//!    ([`cost`]): `(blocks − held) + load_weight × load`, the
//!    prefill it would do plus the queue in front of it, with the load
//!    each [`Backend`] reports (a router's workers report the engine's
//!    whole load as best known, not only this router's share). Among equal
//!    costs the longer prefix, then the fair order; with a softmax
//!    temperature, a draw weighted by cost.
//! 4. The tokens are recorded in the embedded tree for the chosen worker,
//!    so the fallback stays warm for the moment a stream is lost.
//!
//! **Under overload** step 3 changes. When the mean of the polled waiting
//! counts of the available candidates (at most 64 read, evenly spaced)
//! reaches [`CostModel::overload_enter`] (default
//! [`DEFAULT_OVERLOAD_ENTER`](crate::DEFAULT_OVERLOAD_ENTER)), the policy
//! enters an overload state it leaves only when that mean falls to
//! [`CostModel::overload_leave`]
//! ([`DEFAULT_OVERLOAD_LEAVE`](crate::DEFAULT_OVERLOAD_LEAVE));
//! [`KvAware::is_overloaded`] reads it.
//! In that state the decision is `kv_aware_gate`'s (below), and the worker
//! the fallback tree names for the request's longest prefix is credited
//! with that prefix wherever the index says it holds less. Outside it,
//! the least cost decides. Why: when every engine has a queue, a
//! session's next turn often arrives while its history is still queued
//! (or already evicted), so no engine's events name it and the cost would
//! place it by load alone, scattering sessions; the tree (this router's
//! choices and those peer replicas shared) sends it where its history
//! went (docs/policies.md has the measurements).
//!
//! Reasons: [`DecisionReason::KvHit`] when the winner holds the longest
//! prefix (exact score), [`DecisionReason::CacheHit`] (scored from the
//! tree), [`DecisionReason::CacheOverloaded`] when a longer prefix lost to
//! its load, [`DecisionReason::CacheLowMatch`] when the winner holds
//! nothing. Every decision carries the match rate.
//!
//! **`kv_aware_gate`** ([`KvAware::gated`]) places the same scores as
//! cache-aware does instead: the best score's worker is *preferred* when
//! `blocks × block_size / input_tokens > cache_threshold` and takes the
//! request unless the per-request load gate (invariant 11) says it yields
//! ([`CacheAwareConfig::preferred_yields`]); otherwise the fair
//! least-loaded candidate.
//!
//! **Text input** (no tokenizer for the model) and requests without
//! routing input are decided by the embedded [`CacheAware`], exactly as
//! the `cache_aware` policy decides them.
//!
//! # Liveness: [`KvStreams`]
//!
//! The host marks a worker live when its subscriber receives events for
//! all of the worker's ranks, and not live when a stream is lost. The
//! handle is a fixed-capacity bitset of atomics indexed by [`WorkerId`]:
//! reading it is one relaxed atomic load, no lock. A counter bumped on every
//! change tells the policy when to re-resolve its map from worker keys to
//! index ids (one atomic load per request; the re-resolution, under a write
//! lock, happens only after a change).
//!
//! # Who does what on membership changes
//!
//! * The **host** owns the index: it registers a worker
//!   ([`KvIndex::register_worker`], keyed by the worker's
//!   [`Backend::key`]) before announcing it, clears or unregisters it when
//!   the worker leaves or a new lifetime replaces it (the subscriber does
//!   this when it sees a new generation), and updates [`KvStreams`].
//! * The **policy** forwards every event to its embedded [`CacheAware`]
//!   (which forgets a removed or replaced worker's tree affinity), forgets
//!   a removed worker's index id, and re-resolves a replaced one's. A
//!   removed worker is never chosen for token input — neither preferred
//!   (even if the index still lists its blocks) nor picked by the
//!   least-loaded fallback, should a stale candidate slice still hold it.
//!   A replaced worker starts cold: no tree affinity, and its exact score
//!   is whatever the host's index holds for its new lifetime.
//!
//! Only announced workers (membership events, which the registry replays
//! to every new instance) are scored exactly; a worker never announced is
//! scored from the tree.
//!
//! # Disaggregated serving
//!
//! Under prefill/decode disaggregation the prefix cache that matters is the
//! prefill worker's: the host uses `kv_aware` for the prefill pool (and any
//! policy for the decode pool).
//!
//! # Cost and allocation
//!
//! Per decision: hashing the full blocks (about 1 µs per 100 blocks), one
//! index lookup (lock-free), a walk of its matches, and one walk of the
//! fallback tree for its best match. A cold worker can only matter if the
//! tree's best match beats every exact score; if the tree's best owner is
//! itself cold, it is the best cold score (among equally deep owners the
//! tree's most recently used one, as in cache-aware). Only when the tree's
//! best owner has a live stream (its tree score is not used) and some
//! announced worker is cold does the policy walk the tree once per cold
//! member — the expensive case of a mixed fleet at large scale (see the
//! crate README's figures). Ties among exact scores are broken fairly.
//!
//! The hash vector and lookup result are thread-local buffers reused
//! across decisions, so a repeated decision allocates only inside the tree
//! when it records a new prefix (`tests/no_alloc.rs`). The LoRA adapter is
//! not part of [`RequestContext`], so requests hash as the base model.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use kv_block_index::{BlockHash, KvIndex, PrefixMatches, Tier, WorkerId};

use super::cache_aware::{CacheAware, CacheAwareConfig, LoadGate, ModelState};
use super::cost::{self, CostModel, LowerPrefix, Scored};
use super::session::SessionTable;
use super::{find_candidate, min_available_load};
use crate::backend::Backend;
use crate::context::{RequestContext, RoutingInput};
use crate::decision::{Decision, DecisionReason};
use crate::error::PolicyError;
use crate::membership::MembershipEvent;
use crate::policy::{Policy, PolicyState};
use crate::rng::SharedRng;
use crate::sync::{AtomicBool, AtomicU64, AtomicUsize, Ordering, RwLock};

use std::sync::atomic::AtomicUsize as HintCell;
use std::time::Instant;

/// Which workers have a live KV event stream: a bitset by [`WorkerId`] the
/// host updates and [`KvAware`] reads on every decision without a lock.
///
/// The capacity is fixed at construction. The index never reuses worker
/// ids, so a host with heavy churn sizes it for every registration it
/// expects over the process's life; a worker whose id is beyond the
/// capacity cannot be marked live ([`set_live`](Self::set_live) returns
/// `false`) and is scored from the approximate tree, as if its stream were
/// down.
///
/// ```
/// use kv_block_index::{IndexConfig, KvIndex};
/// use lb_policies::KvStreams;
///
/// let index: KvIndex = KvIndex::new(IndexConfig::default());
/// let streams = KvStreams::new();
/// let w = index.register_worker("http://engine-a:8000".to_owned());
/// assert!(!streams.is_live(w));
/// assert!(streams.set_live(w, true)); // the subscriber connected
/// assert!(streams.is_live(w));
/// ```
#[derive(Debug)]
pub struct KvStreams {
    words: Box<[AtomicU64]>,
    changes: AtomicU64,
}

impl Default for KvStreams {
    fn default() -> Self {
        Self::new()
    }
}

impl KvStreams {
    /// Worker ids a [`KvStreams::new`] handle covers: 65,536 (8 KiB).
    pub const DEFAULT_CAPACITY: usize = 1 << 16;

    /// A handle for [`DEFAULT_CAPACITY`](Self::DEFAULT_CAPACITY) worker
    /// ids, none live.
    pub fn new() -> Self {
        Self::with_capacity(Self::DEFAULT_CAPACITY)
    }

    /// A handle for worker ids `0..workers` (rounded up to a multiple of
    /// 64), none live.
    pub fn with_capacity(workers: usize) -> Self {
        let words = workers.div_ceil(64);
        KvStreams {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            changes: AtomicU64::new(0),
        }
    }

    /// How many worker ids the handle covers.
    pub fn capacity(&self) -> usize {
        self.words.len() * 64
    }

    fn position(&self, worker: WorkerId) -> Option<(&AtomicU64, u64)> {
        let id = worker.get() as usize;
        self.words
            .get(id / 64)
            .map(|word| (word, 1u64 << (id % 64)))
    }

    /// Marks `worker`'s event stream live (its events reach the index) or
    /// not. Returns `false`, changing nothing, when the id is beyond the
    /// [`capacity`](Self::capacity).
    pub fn set_live(&self, worker: WorkerId, live: bool) -> bool {
        let Some((word, bit)) = self.position(worker) else {
            return false;
        };
        if live {
            word.fetch_or(bit, Ordering::Release);
        } else {
            word.fetch_and(!bit, Ordering::Release);
        }
        // After the bit: a reader that sees the new count also sees the bit.
        self.changes.fetch_add(1, Ordering::Release);
        true
    }

    /// Whether `worker`'s stream is live (`false` beyond the capacity).
    pub fn is_live(&self, worker: WorkerId) -> bool {
        self.position(worker)
            .is_some_and(|(word, bit)| word.load(Ordering::Acquire) & bit != 0)
    }

    /// How many times [`set_live`](Self::set_live) changed anything (or
    /// was called in range): the policy re-resolves worker keys when this
    /// moves.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }
}

/// What a [`KvAware`] policy reads from the host: the shared block index
/// (fed by the host's event subscribers) and the stream liveness handle.
///
/// Set it on a [`PolicyConfig`](crate::PolicyConfig) with
/// [`with_kv`](crate::PolicyConfig::with_kv); clones share the same index
/// and handle. Two sources are equal when they share both.
#[derive(Clone, Debug)]
pub struct KvSources {
    /// The block index, keyed by the workers' [`Backend::key`].
    pub index: Arc<KvIndex>,
    /// Which workers' event streams are live.
    pub streams: Arc<KvStreams>,
}

impl KvSources {
    /// Sources from a shared index and liveness handle.
    pub fn new(index: Arc<KvIndex>, streams: Arc<KvStreams>) -> Self {
        KvSources { index, streams }
    }
}

impl PartialEq for KvSources {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.index, &other.index) && Arc::ptr_eq(&self.streams, &other.streams)
    }
}

/// The policy's map between announced worker keys and index ids.
#[derive(Debug, Default)]
struct Resolved {
    /// Announced (not removed) keys, in arrival order.
    known: Vec<Arc<str>>,
    by_key: HashMap<Arc<str>, WorkerId>,
    /// Key and candidate-position hint of each resolved id, by its dense
    /// [`WorkerId::get`].
    by_worker: Vec<Option<(Arc<str>, HintCell)>>,
    /// [`KvStreams::changes`] when the map was last rebuilt.
    seen_changes: Option<u64>,
    /// Announced workers without a live stream (unresolved or not live)
    /// as of the last rebuild or membership event: when zero, no tree walk
    /// per cold member is needed.
    cold_members: usize,
}

impl Resolved {
    fn forget(&mut self, key: &str) {
        if let Some(id) = self.by_key.remove(key)
            && let Some(entry) = self.by_worker.get_mut(id.get() as usize)
        {
            *entry = None;
        }
    }

    fn resolve(&mut self, index: &KvIndex, key: &Arc<str>) {
        self.forget(key);
        let Some(id) = index.worker_id(&key.to_string()) else {
            return;
        };
        let slot = id.get() as usize;
        if self.by_worker.len() <= slot {
            self.by_worker.resize_with(slot + 1, || None);
        }
        self.by_worker[slot] = Some((Arc::clone(key), HintCell::new(0)));
        self.by_key.insert(Arc::clone(key), id);
    }

    fn rebuild(&mut self, index: &KvIndex, streams: &KvStreams, changes: u64) {
        self.by_key.clear();
        self.by_worker.clear();
        for key in self.known.clone() {
            self.resolve(index, &key);
        }
        self.seen_changes = Some(changes);
        self.recount(streams);
    }

    fn recount(&mut self, streams: &KvStreams) {
        let live = self
            .by_key
            .values()
            .filter(|&&id| streams.is_live(id))
            .count();
        self.cold_members = self.known.len() - live;
    }
}

/// A candidate's score: its index, the blocks its device cache holds,
/// whether the block index scored it, and what its caches save.
type Score = Scored;

/// Per-thread buffers reused across decisions.
#[derive(Default)]
struct Scratch {
    hashes: Vec<BlockHash>,
    matches: PrefixMatches,
    scores: Vec<Score>,
    /// Each exact score's lower-tier prefixes, by position in `scores`.
    lower: Vec<LowerPrefix>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The kv-aware policy. See the [module docs](self) for the decision, the
/// fallback and who keeps what in step.
pub struct KvAware {
    fallback: CacheAware,
    sources: KvSources,
    block_size: usize,
    resolved: RwLock<Resolved>,
    /// Start of the fair scan among equally scored candidates.
    tie_rotation: AtomicUsize,
    /// How token input is placed once scored.
    choice: Choice,
    /// Soft session affinity, when its TTL is set.
    sessions: Option<SessionTable>,
    /// The overload state of the cost mode ([`CostModel::overload_enter`]).
    overloaded: AtomicBool,
}

/// How [`KvAware`] places token input once every candidate is scored.
#[derive(Debug)]
enum Choice {
    /// The least expected cost ([`CostModel`]); the draws of a softmax
    /// temperature come from the generator.
    LeastCost(CostModel, SharedRng),
    /// The threshold and per-request load gate (`kv_aware_gate`).
    Gate,
}

impl std::fmt::Debug for KvAware {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvAware")
            .field("config", self.fallback.config())
            .field("index", &self.sources.index)
            .finish_non_exhaustive()
    }
}

impl KvAware {
    /// A kv-aware policy over the host's index and liveness handle, with
    /// cache-aware's knobs for the threshold, the load gate and the
    /// fallback tree. The gate is always per request
    /// ([`LoadGate::PerRequest`]), whatever `config.gate` says.
    ///
    /// Fails if a knob is out of range, or if `config.block_size` differs
    /// from the index's block size (scores would be counted in different
    /// blocks).
    pub fn new(config: CacheAwareConfig, sources: KvSources) -> Result<Self, PolicyError> {
        Self::build(config, sources, true, crate::rng::random_seed())
    }

    /// [`new`](Self::new) with the softmax draws of a non-zero
    /// [`CostModel::temperature`] seeded (reproducible runs).
    pub fn with_seed(
        config: CacheAwareConfig,
        sources: KvSources,
        seed: u64,
    ) -> Result<Self, PolicyError> {
        Self::build(config, sources, true, seed)
    }

    /// The `kv_aware_gate` policy: the same scores, placed by the
    /// threshold and per-request load gate of cache-aware
    /// (`cache_threshold`, `balance_abs_threshold`, `balance_rel_threshold`)
    /// instead of the least expected cost. For comparison.
    pub fn gated(config: CacheAwareConfig, sources: KvSources) -> Result<Self, PolicyError> {
        Self::build(config, sources, false, 0)
    }

    fn build(
        config: CacheAwareConfig,
        sources: KvSources,
        least_cost: bool,
        seed: u64,
    ) -> Result<Self, PolicyError> {
        let block_size = sources.index.hasher().block_size();
        if config.block_size != block_size {
            return Err(PolicyError::InvalidConfig {
                field: "cache_aware.block_size",
                reason: format!(
                    "is {} but the KV index hashes blocks of {block_size} tokens; they must match",
                    config.block_size
                ),
            });
        }
        let mut config = config;
        config.gate = LoadGate::PerRequest;
        let session_ttl = config.session_affinity_ttl;
        let choice = if least_cost {
            Choice::LeastCost(config.cost, SharedRng::new(seed))
        } else {
            Choice::Gate
        };
        Ok(KvAware {
            fallback: CacheAware::new(config)?,
            sources,
            block_size,
            resolved: RwLock::new(Resolved::default()),
            tie_rotation: AtomicUsize::new(0),
            choice,
            sessions: (!session_ttl.is_zero()).then(|| SessionTable::new(session_ttl)),
            overloaded: AtomicBool::new(false),
        })
    }

    /// With soft session affinity on (`session_affinity_ttl`): the
    /// sessions bound now, and the new sessions refused because the table
    /// was full ([`session::MAX_SESSIONS`](super::session::MAX_SESSIONS)).
    pub fn session_stats(&self) -> Option<(usize, u64)> {
        self.sessions.as_ref().map(|t| (t.len(), t.refused()))
    }

    /// The embedded cache-aware policy that decides text input and scores
    /// cold workers.
    pub fn fallback(&self) -> &CacheAware {
        &self.fallback
    }

    /// The index and liveness handle in use.
    pub fn sources(&self) -> &KvSources {
        &self.sources
    }

    /// Rebuilds the key-to-id map if the liveness handle changed since.
    fn refresh(&self) {
        let changes = self.sources.streams.changes();
        if self.resolved.read().seen_changes == Some(changes) {
            return;
        }
        let mut resolved = self.resolved.write();
        if resolved.seen_changes != Some(changes) {
            resolved.rebuild(&self.sources.index, &self.sources.streams, changes);
        }
    }

    fn is_live_key(&self, resolved: &Resolved, key: &str) -> bool {
        resolved
            .by_key
            .get(key)
            .is_some_and(|&id| self.sources.streams.is_live(id))
    }

    /// Every available candidate's score, into `scores`.
    fn score<B: Backend>(
        &self,
        state: &ModelState,
        candidates: &[B],
        tokens: &[u32],
        matches: &PrefixMatches,
        scores: &mut Vec<Score>,
        lower: &mut Vec<LowerPrefix>,
    ) {
        scores.clear();
        lower.clear();
        let resolved = self.resolved.read();
        // Exact: live workers, longest prefix over their ranks, per cache
        // tier (a lower tier's blocks are holders of their own).
        for m in matches.matches() {
            let worker = m.holder.worker;
            if !self.sources.streams.is_live(worker) {
                continue;
            }
            let Some(Some((key, hint))) = resolved.by_worker.get(worker.get() as usize) else {
                continue;
            };
            let Some(i) = find_candidate(key, hint, candidates) else {
                continue;
            };
            if !candidates[i].is_available() {
                continue;
            }
            let at = match scores.iter().position(|s| s.index == i) {
                Some(at) => at,
                None => {
                    scores.push(Scored::new(i, 0, true));
                    lower.push(LowerPrefix::default());
                    scores.len() - 1
                }
            };
            match m.holder.tier() {
                Tier::Device => scores[at].blocks = scores[at].blocks.max(m.blocks),
                tier => {
                    let reach = &mut lower[at].0[tier as usize - 1];
                    *reach = (*reach).max(m.blocks.min(u32::MAX as usize) as u32);
                }
            }
        }
        // What each exact score saves: its device blocks, and the lower
        // tiers' at their penalties (the cost mode only; the gate counts
        // device blocks).
        if let Choice::LeastCost(model, _) = &self.choice {
            for (s, lower) in scores.iter_mut().zip(lower.iter()) {
                s.credit = model.penalties.credit(s.blocks, lower);
            }
        } else {
            for s in scores.iter_mut() {
                s.credit = s.blocks as f64;
            }
        }
        // A worker only a lower tier scored holds no device block: the
        // gate does not count it, and the cold-worker bound below is in
        // device blocks.
        // Approximate: cold workers, from the tree, in whole blocks. Only
        // a cold score above the best exact one can matter (on equal blocks
        // exact wins), and the tree's best match bounds every cold score.
        let block_size = self.block_size;
        let best_exact = scores.iter().map(|s| s.blocks).max().unwrap_or(0);
        let settled = state.best_token_match(tokens, |owner, matched| {
            if matched / block_size <= best_exact {
                return true; // no cold worker can beat the exact scores
            }
            match owner {
                // The best owner is cold: it holds the best cold score.
                Some((key, hint)) if !self.is_live_key(&resolved, key) => {
                    if let Some(i) = find_candidate(key, hint, candidates)
                        && candidates[i].is_available()
                    {
                        scores.push(Scored::new(i, matched / block_size, false));
                        return true;
                    }
                    // Not a place this request can go: look at the others.
                    resolved.cold_members == 0
                }
                // A live-stream worker (scored exactly) or no member owns
                // the best match: the best cold score is elsewhere, if any
                // announced worker is cold.
                _ => resolved.cold_members == 0,
            }
        });
        if settled {
            return;
        }
        state.for_each_token_match(
            tokens,
            block_size,
            |key| !self.is_live_key(&resolved, key),
            |key, hint, matched| {
                if let Some(i) = find_candidate(key, hint, candidates)
                    && candidates[i].is_available()
                    && !scores.iter().any(|s| s.index == i)
                {
                    scores.push(Scored::new(i, matched / block_size, false));
                }
            },
        );
    }

    /// The preferred candidate among the best scores: most blocks, exact
    /// before approximate, then fair (load, processed, rotating start).
    fn best<B: Backend>(&self, candidates: &[B], scores: &[Score]) -> Option<Score> {
        let top = scores.iter().map(|s| (s.blocks, s.exact)).max()?;
        let is_top = |s: &&Score| (s.blocks, s.exact) == top;
        if scores.iter().filter(is_top).count() == 1 {
            return scores.iter().find(is_top).copied();
        }
        let n = candidates.len();
        let start = self.tie_rotation.fetch_add(1, Ordering::Relaxed) % n;
        scores
            .iter()
            .filter(is_top)
            .min_by_key(|s| {
                let c = &candidates[s.index];
                (c.load(), c.processed(), (s.index + n - start) % n)
            })
            .copied()
    }

    /// The fair least-loaded candidate, never a removed worker.
    fn least_loaded<B: Backend>(
        &self,
        state: &ModelState,
        candidates: &[B],
        reason: DecisionReason,
        (matched, input): (usize, usize),
    ) -> Option<Decision> {
        let mut decision = self.fallback.least_loaded(candidates, reason)?;
        if state.is_removed(candidates[decision.index].key()) {
            // A stale slice still lists a removed worker: choose again
            // without any removed one.
            decision = self.fallback.least_loaded_where(candidates, reason, |i| {
                !state.is_removed(candidates[i].key())
            })?;
        }
        Some(decision.with_match(matched, input))
    }

    /// The least-cost candidate (see [`cost`]), never a
    /// removed worker. Reasons: a hit (`kv_hit`, or `cache_hit` when
    /// scored from the tree) when the winner holds a prefix and no
    /// candidate holds a longer one; `cache_overloaded` when one does
    /// but costs more (load outweighed it); `cache_low_match` when the
    /// winner holds nothing.
    fn least_cost<B: Backend>(
        &self,
        state: &ModelState,
        candidates: &[B],
        tokens: &[u32],
        scores: &[Score],
        model: &CostModel,
        rng: &SharedRng,
    ) -> Option<Decision> {
        let blocks = tokens.len() / self.block_size;
        let eligible = |i: usize| !state.is_removed(candidates[i].key());
        let (chosen, reason) = cost::choose(
            model,
            candidates,
            blocks,
            scores,
            rng,
            &self.tie_rotation,
            eligible,
        )?;
        // The match rate is the device cache's (what the engine reuses
        // without loading).
        Some(
            Decision::new(chosen.index, reason)
                .with_match(chosen.blocks * self.block_size, tokens.len()),
        )
    }

    /// Whether the fleet is in the overload state now
    /// ([`CostModel::overload_enter`]), updating it from the mean of the
    /// candidates' reported waiting counts (the available ones among at
    /// most [`cost::PRESSURE_SAMPLE`] evenly spaced).
    fn overload_state<B: Backend>(&self, model: &CostModel, candidates: &[B]) -> bool {
        if model.overload_enter <= 0.0 || candidates.is_empty() {
            return false;
        }
        let Some(mean) = cost::fleet_mean(candidates, |c| c.waiting() as f64) else {
            return self.overloaded.load(Ordering::Relaxed);
        };
        let was = self.overloaded.load(Ordering::Relaxed);
        let now = if was {
            mean > model.overload_leave
        } else {
            mean >= model.overload_enter
        };
        if now != was {
            self.overloaded.store(now, Ordering::Relaxed);
        }
        now
    }

    /// Credits the worker the fallback tree names for the request's
    /// longest prefix (where this router, or a peer replica that shared
    /// its choices, last sent it) with that prefix, where it is longer
    /// than what the block index says the worker holds. Under overload a
    /// session's history is often evicted or still queued, so the index
    /// names no holder and the decision would fall to load alone,
    /// scattering sessions over a fleet where every engine has a queue.
    fn credit_tree<B: Backend>(
        &self,
        state: &ModelState,
        candidates: &[B],
        tokens: &[u32],
        scores: &mut Vec<Score>,
    ) {
        let block_size = self.block_size;
        state.best_token_match(tokens, |owner, matched| {
            let blocks = matched / block_size;
            let Some((key, hint)) = owner.filter(|_| blocks > 0) else {
                return;
            };
            let Some(i) = find_candidate(key, hint, candidates) else {
                return;
            };
            if !candidates[i].is_available() || state.is_removed(key) {
                return;
            }
            match scores.iter_mut().find(|s| s.index == i) {
                Some(s) if s.blocks >= blocks => {}
                Some(s) => *s = Scored::new(i, blocks, false),
                None => scores.push(Scored::new(i, blocks, false)),
            }
        });
    }

    /// Whether the cost mode's overload state is on (always false for
    /// `kv_aware_gate` and with [`CostModel::overload_enter`] 0).
    pub fn is_overloaded(&self) -> bool {
        self.overloaded.load(Ordering::Relaxed)
    }

    fn decide_tokens<B: Backend>(
        &self,
        state: &ModelState,
        candidates: &[B],
        tokens: &[u32],
        scratch: &mut Scratch,
    ) -> Option<Decision> {
        let hasher = self.sources.index.hasher();
        hasher.hash_blocks_into(tokens, &mut scratch.hashes);
        self.sources
            .index
            .lookup_into(&scratch.hashes, &mut scratch.matches);
        self.score(
            state,
            candidates,
            tokens,
            &scratch.matches,
            &mut scratch.scores,
            &mut scratch.lower,
        );
        if let Choice::LeastCost(model, rng) = &self.choice {
            if !self.overload_state(model, candidates) {
                return self.least_cost(state, candidates, tokens, &scratch.scores, model, rng);
            }
            // Overloaded: the gate's decision, with the tree's memory of
            // where this prefix went.
            self.credit_tree(state, candidates, tokens, &mut scratch.scores);
        }
        let best = self.best(candidates, &scratch.scores);
        let blocks = best.map_or(0, |s| s.blocks);
        let matched = (blocks * self.block_size, tokens.len());
        let rate = matched.0 as f64 / tokens.len() as f64;
        let config = self.fallback.config();
        let Some(Scored {
            index: preferred,
            exact,
            ..
        }) = best.filter(|_| blocks > 0 && rate > config.cache_threshold)
        else {
            return self.least_loaded(state, candidates, DecisionReason::CacheLowMatch, matched);
        };
        if config.preferred_yields(candidates[preferred].load(), min_available_load(candidates)) {
            return self.least_loaded(state, candidates, DecisionReason::CacheOverloaded, matched);
        }
        let reason = if exact {
            DecisionReason::KvHit
        } else {
            DecisionReason::CacheHit
        };
        Some(Decision::new(preferred, reason).with_match(matched.0, matched.1))
    }
}

impl KvAware {
    /// The session's worker, when the request has a session key bound
    /// within the TTL and that worker is an available, not removed
    /// candidate that the load gate (`balance_abs_threshold` and
    /// `balance_rel_threshold` over the least loaded) does not make yield.
    fn session_worker<B: Backend>(
        &self,
        table: &SessionTable,
        session: &str,
        candidates: &[B],
        ctx: &RequestContext<'_>,
        now: Instant,
    ) -> Option<usize> {
        let worker = table.worker(session, now)?;
        let i = candidates.iter().position(|c| c.key() == &*worker)?;
        if !candidates[i].is_available() || self.fallback.model(ctx.model).is_removed(&worker) {
            return None;
        }
        let config = self.fallback.config();
        (!config.preferred_yields(candidates[i].load(), min_available_load(candidates)))
            .then_some(i)
    }

    /// The decision without session affinity.
    fn select_by_cache<B: Backend>(
        &self,
        candidates: &[B],
        ctx: &RequestContext<'_>,
    ) -> Option<Decision> {
        let tokens = match ctx.routing {
            RoutingInput::Tokens(tokens) if !tokens.is_empty() => tokens,
            _ => return self.fallback.select(candidates, ctx),
        };
        if candidates.is_empty() {
            return None;
        }
        self.refresh();
        let state = self.fallback.model(ctx.model);
        let decision = SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => self.decide_tokens(&state, candidates, tokens, &mut scratch),
            // Re-entered on this thread (a host's backend calling back):
            // fresh buffers rather than a panic.
            Err(_) => self.decide_tokens(&state, candidates, tokens, &mut Scratch::default()),
        })?;
        state.record_choice(ctx.routing, candidates[decision.index].key());
        Some(decision)
    }
}

impl<B: Backend> Policy<B> for KvAware {
    fn select(&self, candidates: &[B], ctx: &RequestContext<'_>) -> Option<Decision> {
        let session = self
            .sessions
            .as_ref()
            .zip(ctx.keys.first().map(|(_, key)| key));
        let Some((table, session)) = session else {
            return self.select_by_cache(candidates, ctx);
        };
        let now = Instant::now();
        if let Some(i) = self.session_worker(table, session, candidates, ctx, now) {
            table.bind(session, candidates[i].key(), now);
            // The tree learns the choice as for any other (the fallback
            // stays warm for this session's prefix).
            self.fallback
                .model(ctx.model)
                .record_choice(ctx.routing, candidates[i].key());
            return Some(Decision::new(i, DecisionReason::SessionAffinity));
        }
        let decision = self.select_by_cache(candidates, ctx)?;
        table.bind(session, candidates[decision.index].key(), now);
        Some(decision)
    }
}

impl PolicyState for KvAware {
    fn name(&self) -> &str {
        match self.choice {
            Choice::LeastCost(..) => "kv_aware",
            Choice::Gate => "kv_aware_gate",
        }
    }

    fn on_membership(&self, event: MembershipEvent<'_>) {
        self.fallback.on_membership(event);
        let mut resolved = self.resolved.write();
        let key = event.key();
        match event {
            MembershipEvent::Removed { .. } => {
                resolved.forget(key);
                resolved.known.retain(|k| &**k != key);
            }
            MembershipEvent::Added { .. } | MembershipEvent::Replaced { .. } => {
                let key: Arc<str> = match resolved.known.iter().find(|k| &***k == key) {
                    Some(k) => Arc::clone(k),
                    None => {
                        let k: Arc<str> = key.into();
                        resolved.known.push(Arc::clone(&k));
                        k
                    }
                };
                resolved.resolve(&self.sources.index, &key);
            }
        }
        resolved.recount(&self.sources.streams);
    }

    fn learn_choice(&self, model: &str, input: RoutingInput<'_>, worker: &str) -> bool {
        self.fallback.learn_choice(model, input, worker)
    }

    fn maintain(&self) {
        self.fallback.maintain();
        if let Some(table) = &self.sessions {
            table.prune(Instant::now());
        }
    }

    fn affinity_sizes(&self) -> Vec<(Arc<str>, usize)> {
        self.fallback.affinity_sizes()
    }

    fn tree_stats(&self) -> Vec<crate::policy::TreeStats> {
        self.fallback.tree_stats()
    }

    fn tree_budget(&self) -> Option<Arc<radix_affinity::MemoryBudget>> {
        self.fallback.tree_budget()
    }
}
