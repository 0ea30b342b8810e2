//! Cache-aware routing: prefix affinity from a radix tree, a per-request
//! load gate, and fair ties.
//!
//! # `cache_aware_cost`: token ids by the least expected cost
//!
//! With [`TokenChoice::Cost`] (policy name `cache_aware_cost`), token input
//! is placed as `kv_aware` places it ([`cost`]): one walk of the model's
//! token tree gives every worker its own match
//! ([`TokenTree::prefix_match_tenants_symbols`]), counted in whole KV
//! blocks; the worker of least `(blocks − held) + load_weight × load`
//! takes the request (the load weight lowered under the fleet's cache
//! pressure, a softmax draw with a temperature), then the tokens are
//! inserted for it. Every worker is credited its own match, so a template
//! header that all workers hold counts for all of them. Text input keeps
//! the gate below. Not the default: on the simulator it lost to the gate
//! on the `templated` workload and at 1,536 blocks (docs/benchmarks.md,
//! "cache_aware on tokens by the cost").
//!
//! # The decision (the default, text and tokens)
//!
//! 1. Match the request's routing text (or token ids) against the model's
//!    tree: `(tenant, matched, input)`.
//! 2. If `matched / input > cache_threshold`, the matched tenant is the
//!    *preferred* worker. It takes the request unless it is overloaded
//!    compared with the least loaded **available** candidate:
//!    `load(preferred) > min_load + balance_abs_threshold` **and**
//!    `load(preferred) > min_load × balance_rel_threshold`.
//! 3. Otherwise (low match, owner overloaded or not an available candidate)
//!    the least loaded available candidate takes it, ties broken by
//!    processed count and then a rotating start.
//! 4. The routing text is inserted into the tree for the chosen worker.
//!
//! Why per request (invariant 11 of docs/architecture.md): the older *fleet-wide* gate turned
//! affinity off for every request whenever any two workers were far apart
//! in load — one hot worker, or one idle unhealthy one, disabled prefix
//! routing for the whole fleet. It is kept as [`LoadGate::FleetWide`]
//! (policy name `cache_aware_fleet_gate`) so simulations can compare.
//!
//! # State and synchronization
//!
//! One tree pair (text and tokens) per model id, created with the model's
//! first request and seeded with every current member, so a freshly
//! discovered fleet routes cache-aware from the first request. Membership
//! events intern (added), forget (removed) or reset (replaced) a worker's
//! affinity in every model's tree; nothing scans the tree on the request
//! path. A per-model member table maps tree tenants to candidates with a
//! position hint (no allocation per decision on a known fleet). Inserts
//! for a chosen worker happen under that table's read lock after checking
//! the worker is still a member, and removal takes its write lock, so a
//! request racing with a removal cannot leave the removed worker's
//! affinity behind.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize as HintCell;
use std::time::Duration;

use radix_affinity::{
    Clock, MemoryBudget, PrefixMatch, TenantId, TenantMatches, TextTree, TokenTree,
};

use super::cost::{self, CostModel, Scored};
use super::{fair_least_loaded, find_candidate, min_available_load};
use crate::backend::Backend;
use crate::context::{RequestContext, RoutingInput};
use crate::decision::{Decision, DecisionReason};
use crate::error::PolicyError;
use crate::membership::MembershipEvent;
use crate::policy::{Policy, PolicyState, TreeStats};
use crate::rng::SharedRng;
use crate::sync::{AtomicUsize, Mutex, Ordering, RwLock};

/// How cache-aware decides that affinity must yield to load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum LoadGate {
    /// Compare the preferred worker with the least loaded available
    /// candidate, per request (the default; invariant 11).
    #[default]
    PerRequest,
    /// The old gate: if the whole fleet's max − min load exceeds the
    /// thresholds, ignore affinity for every request. For comparison in
    /// simulations; not recommended.
    FleetWide,
}

/// How cache-aware places token input (text input always goes through the
/// threshold and [`LoadGate`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum TokenChoice {
    /// The threshold and load gate, as for text (the default).
    #[default]
    Gate,
    /// The worker of least expected cost ([`CostModel`]), each credited
    /// with its own match in whole blocks, as `kv_aware` chooses (policy
    /// name `cache_aware_cost`; see the [module docs](self)).
    Cost,
}

/// Default of [`CacheAwareConfig::max_tree_bytes`]: 1 GiB. A 1 KB chat
/// prompt costs about 1.2 KB of tree (its label, a node, a split), so this
/// holds the last ~850,000 distinct prompts, far more than any simulated
/// workload reuses (docs/benchmarks.md, "Soak"), and fits the reference
/// Kubernetes manifests' 4 GiB limit with room for the rest of the router.
pub const DEFAULT_MAX_TREE_BYTES: u64 = 1 << 30;

/// Default of [`CacheAwareConfig::text_roots`]: the beginnings of a chat
/// request's routing text, `role: ` with each role OpenAI's API names. The
/// routing text of a chat request is `role: content\n` per message (as
/// `router-http` builds it), so every chat text begins with one of these,
/// and without roots all of them would share the text tree's one or two
/// shards of `s` and `u`.
pub const CHAT_ROLE_ROOTS: [&str; 5] =
    ["system: ", "developer: ", "user: ", "assistant: ", "tool: "];

/// Knobs of [`CacheAware`].
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(default)
)]
#[non_exhaustive]
pub struct CacheAwareConfig {
    /// Minimum match rate (`matched / input`, in symbols) above which the
    /// matched worker is preferred. In `0.0..=1.0`. Default 0.3. For token
    /// input, `matched` counts only the tokens of whole blocks (see
    /// [`block_size`](Self::block_size)): the tokens the engine would
    /// really find cached.
    pub cache_threshold: f64,
    /// The engine's KV block size in tokens (vLLM's `--block-size`,
    /// default 16). An engine reuses whole blocks only, so a token match
    /// counts as `matched - matched % block_size`: a 15-token match is worth
    /// nothing. Text input is not rounded (characters are not blocks).
    /// At least 1 (1: no rounding).
    pub block_size: usize,
    /// Absolute load margin: the preferred worker yields only if its load
    /// exceeds the least loaded available candidate's by more than this.
    /// Default 64.
    pub balance_abs_threshold: usize,
    /// Relative load margin: ...and only if its load is more than this
    /// factor times the least loaded candidate's. At least 1.0. Default 1.5.
    pub balance_rel_threshold: f64,
    /// How often the host should call [`CacheAware::evict`], the fallback
    /// that applies a lowered limit to trees no request inserts into (every
    /// insert already keeps its tree within the limits below; the policy
    /// runs no timer of its own). Default 120 s.
    pub eviction_interval: Duration,
    /// Per-worker tree limit in symbols (chars or tokens): an insert that
    /// takes its worker above it evicts that worker's least recently used
    /// entries first. vllm-router's `--max-tree-size`. Default 2^26
    /// (67,108,864).
    pub max_tree_size: usize,
    /// Memory budget in bytes of all the policy's prefix trees (text and
    /// token trees of every model): an insert that takes the budget's use
    /// above it evicts least recently used entries first, so the trees never
    /// hold more than this plus what the inserts in flight add. Ignored when
    /// [`tree_budget`](Self::tree_budget) is set. Default 1 GiB.
    pub max_tree_bytes: u64,
    /// A budget shared with other policies (a host's P/D pools and
    /// per-model instances all charge one budget of its own size, and the
    /// host reports it). `None` (default): the policy makes its own of
    /// [`max_tree_bytes`](Self::max_tree_bytes). Not serialized.
    #[cfg_attr(feature = "serde", serde(skip))]
    pub tree_budget: Option<Arc<MemoryBudget>>,
    /// Which load gate to apply. Default [`LoadGate::PerRequest`].
    pub gate: LoadGate,
    /// How the trees stamp uses, which decides the owner a match returns
    /// when several workers hold the same prefix (the most recently used).
    /// Default [`Clock::Coarse`], about one millisecond: uses within one
    /// tick are unordered, so two policies fed the same requests can pick
    /// different holders. [`Clock::Logical`] orders every use exactly, for
    /// reproducible simulations and reference comparisons, at one shared
    /// atomic increment per tree operation. Not part of the serialized
    /// configuration.
    #[cfg_attr(feature = "serde", serde(skip))]
    pub tree_clock: Clock,
    /// The expected-cost choice of `kv_aware` and of `cache_aware_cost` on
    /// token input (its load weight, cache pressure and softmax temperature);
    /// the gated policies ignore it. Default [`CostModel::default`].
    pub cost: CostModel,
    /// How cache-aware places token input: by the threshold gate (the
    /// default) or by the cost. `cache_aware_cost` forces
    /// [`TokenChoice::Cost`]; `cache_aware_fleet_gate` always gates;
    /// `kv_aware` decides tokens itself and ignores it.
    pub token_choice: TokenChoice,
    /// `kv_aware`'s soft session affinity: a request whose session key
    /// ([`HashKeys::first`](crate::HashKeys::first)) was placed
    /// within this long goes to the same worker, unless it is unavailable
    /// or the load gate makes it yield (see `policies::session`). Zero,
    /// the default, turns it off. vllm-router's
    /// `--kv-aware-session-affinity-ttl-secs`.
    pub session_affinity_ttl: Duration,
    /// Roots of the text trees ([`radix_affinity::RadixTree::with_roots`]):
    /// beginnings that many routing texts share, whose texts are spread
    /// over shards of their own by the symbol that follows. Matches, sizes
    /// and eviction are unchanged; what changes is that traffic under one
    /// root does not share one shard lock. Default [`CHAT_ROLE_ROOTS`]; at
    /// most [`radix_affinity::MAX_ROOTS`], none empty, none beginning with
    /// another.
    pub text_roots: Vec<String>,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        CacheAwareConfig {
            cache_threshold: 0.3,
            block_size: 16,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval: Duration::from_secs(120),
            max_tree_size: 1 << 26,
            max_tree_bytes: DEFAULT_MAX_TREE_BYTES,
            tree_budget: None,
            gate: LoadGate::PerRequest,
            tree_clock: Clock::Coarse,
            cost: CostModel::default(),
            token_choice: TokenChoice::default(),
            session_affinity_ttl: Duration::ZERO,
            text_roots: CHAT_ROLE_ROOTS.iter().map(|&r| r.to_owned()).collect(),
        }
    }
}

impl CacheAwareConfig {
    /// Checks every knob's range.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return Err(PolicyError::InvalidConfig {
                field: "cache_threshold",
                reason: format!("must be in 0.0..=1.0, got {}", self.cache_threshold),
            });
        }
        if !(self.balance_rel_threshold.is_finite() && self.balance_rel_threshold >= 1.0) {
            return Err(PolicyError::InvalidConfig {
                field: "balance_rel_threshold",
                reason: format!(
                    "must be a finite factor >= 1.0, got {}",
                    self.balance_rel_threshold
                ),
            });
        }
        if self.block_size == 0 {
            return Err(PolicyError::InvalidConfig {
                field: "block_size",
                reason: "must be at least 1 token".to_owned(),
            });
        }
        if self.eviction_interval.is_zero() {
            return Err(PolicyError::InvalidConfig {
                field: "eviction_interval",
                reason: "must be greater than zero".to_owned(),
            });
        }
        if self.max_tree_size == 0 {
            return Err(PolicyError::InvalidConfig {
                field: "max_tree_size",
                reason: "must be greater than zero".to_owned(),
            });
        }
        if self.max_tree_bytes == 0 {
            return Err(PolicyError::InvalidConfig {
                field: "max_tree_bytes",
                reason: "must be greater than zero".to_owned(),
            });
        }
        let roots: Vec<Vec<char>> = self
            .text_roots
            .iter()
            .map(|r| r.chars().collect())
            .collect();
        if let Err(e) = TextTree::check_roots(&roots) {
            return Err(PolicyError::InvalidConfig {
                field: "text_roots",
                reason: e.to_string(),
            });
        }
        self.cost.validate()
    }

    /// [`text_roots`](Self::text_roots) as string slices.
    fn root_strs(&self) -> Vec<&str> {
        self.text_roots.iter().map(String::as_str).collect()
    }

    /// Whether a preferred worker at `preferred` load yields to a least
    /// loaded available candidate at `min_load` (the per-request gate).
    pub fn preferred_yields(&self, preferred: usize, min_load: usize) -> bool {
        preferred > min_load.saturating_add(self.balance_abs_threshold)
            && preferred as f64 > min_load as f64 * self.balance_rel_threshold
    }
}

/// Whether `input` carries nothing to record (no text, no tokens).
fn is_empty(input: RoutingInput<'_>) -> bool {
    match input {
        RoutingInput::None => true,
        RoutingInput::Text(text) => text.is_empty(),
        RoutingInput::Tokens(tokens) => tokens.is_empty(),
    }
}

/// What a model's member table knows about one worker key.
#[derive(Debug)]
struct Slot {
    key: Arc<str>,
    /// False once removed (a tombstone: inserts for it are refused until it
    /// is added again).
    live: bool,
    text: TenantId,
    tokens: TenantId,
    hint: HintCell,
}

#[derive(Debug, Default)]
struct Members {
    slots: Vec<Slot>,
    by_key: HashMap<Arc<str>, usize>,
    /// Slot of each text-tree tenant, indexed by its dense
    /// [`TenantId::index`].
    by_text_tenant: Vec<Option<usize>>,
    /// Slot of each token-tree tenant, likewise.
    by_token_tenant: Vec<Option<usize>>,
}

/// Records `slot` at `tenant`'s dense index.
fn set_tenant_slot(table: &mut Vec<Option<usize>>, tenant: TenantId, slot: usize) {
    let i = tenant.index() as usize;
    if table.len() <= i {
        table.resize(i + 1, None);
    }
    table[i] = Some(slot);
}

/// One model's trees and member table.
pub(crate) struct ModelState {
    text: TextTree,
    tokens: TokenTree,
    members: RwLock<Members>,
}

impl ModelState {
    fn new<'k>(
        config: &CacheAwareConfig,
        budget: &Arc<MemoryBudget>,
        members: impl IntoIterator<Item = &'k (Arc<str>, bool)>,
    ) -> Self {
        let clock = config.tree_clock;
        // The roots were checked by `CacheAwareConfig::validate`; a tree
        // without them answers the same, only less spread (and the tree
        // crate's loom build has shards for two roots, not five).
        let text = TextTree::with_budget(clock, Arc::clone(budget))
            .with_text_roots(&config.root_strs())
            .unwrap_or_else(|_| TextTree::with_budget(clock, Arc::clone(budget)));
        let state = ModelState {
            text,
            tokens: TokenTree::with_budget(clock, Arc::clone(budget)),
            members: RwLock::new(Members::default()),
        };
        state.text.set_tenant_limit(Some(config.max_tree_size));
        state.tokens.set_tenant_limit(Some(config.max_tree_size));
        {
            let mut table = state.members.write();
            for (key, live) in members {
                let slot = state.admit(&mut table, key);
                table.slots[slot].live = *live;
            }
        }
        state
    }

    /// Makes `key` a live member, interning it in both trees. Returns its
    /// slot.
    fn admit(&self, table: &mut Members, key: &str) -> usize {
        if let Some(&slot) = table.by_key.get(key) {
            table.slots[slot].live = true;
            return slot;
        }
        let key: Arc<str> = key.into();
        let (text, tokens) = (self.text.intern(&key), self.tokens.intern(&key));
        let slot = table.slots.len();
        table.slots.push(Slot {
            key: Arc::clone(&key),
            live: true,
            text,
            tokens,
            hint: HintCell::new(0),
        });
        table.by_key.insert(key, slot);
        set_tenant_slot(&mut table.by_text_tenant, text, slot);
        set_tenant_slot(&mut table.by_token_tenant, tokens, slot);
        slot
    }

    fn apply(&self, event: MembershipEvent<'_>) {
        let mut table = self.members.write();
        match event {
            MembershipEvent::Added { key } => {
                self.admit(&mut table, key);
            }
            MembershipEvent::Removed { key } | MembershipEvent::Replaced { key } => {
                // An unknown key gets a slot too: a removed one as a
                // tombstone, so a stale candidate slice cannot admit it.
                let slot = self.admit(&mut table, key);
                let s = &mut table.slots[slot];
                if matches!(event, MembershipEvent::Removed { .. }) {
                    s.live = false;
                }
                // Under the write lock: no request can be between its
                // liveness check and its insert for this worker.
                self.text.remove_tenant(s.text);
                self.tokens.remove_tenant(s.tokens);
            }
        }
    }

    #[cfg(feature = "kv-block-index")]
    /// Whether a membership event removed `key` (and no later one added it
    /// back). A key no event named is not removed.
    pub(crate) fn is_removed(&self, key: &str) -> bool {
        let table = self.members.read();
        table
            .by_key
            .get(key)
            .is_some_and(|&slot| !table.slots[slot].live)
    }

    #[cfg(feature = "kv-block-index")]
    /// The token tree's best match of `tokens`: `f(owner, matched)` where
    /// `owner` is the matched tenant's key and position hint if it is a
    /// live member (cache-aware's choice among equally deep owners: the
    /// most recently used).
    pub(crate) fn best_token_match<R>(
        &self,
        tokens: &[u32],
        f: impl FnOnce(Option<(&str, &HintCell)>, usize) -> R,
    ) -> R {
        let found = self.tokens.prefix_match_symbols(tokens);
        let table = self.members.read();
        let owner = found
            .tenant
            .and_then(|t| {
                table
                    .by_token_tenant
                    .get(t.index() as usize)
                    .copied()
                    .flatten()
            })
            .map(|slot| &table.slots[slot])
            .filter(|slot| slot.live)
            .map(|slot| (&*slot.key, &slot.hint));
        f(owner, found.matched)
    }

    #[cfg(feature = "kv-block-index")]
    /// For every live member `wanted(key)` accepts, how many leading
    /// `tokens` the token tree attributes to it; `each(key, hint, matched)`
    /// is called for those with at least `min` matched, in no particular
    /// order. One tree walk for all members (a walk per member cost tens of
    /// microseconds at 1,000 workers).
    pub(crate) fn for_each_token_match(
        &self,
        tokens: &[u32],
        min: usize,
        mut wanted: impl FnMut(&str) -> bool,
        mut each: impl FnMut(&str, &HintCell, usize),
    ) {
        let min = min.max(1);
        let mut visit = |matches: &mut TenantMatches| {
            // Walked under the member table's read lock, as before: a
            // removal or replacement (write lock) cannot fall between the
            // walk and the liveness check.
            let table = self.members.read();
            self.tokens.prefix_match_tenants_symbols(tokens, matches);
            for (tenant, matched) in matches.iter() {
                if matched < min {
                    continue;
                }
                let Some(slot) = table
                    .by_token_tenant
                    .get(tenant.index() as usize)
                    .copied()
                    .flatten()
                    .map(|slot| &table.slots[slot])
                else {
                    continue;
                };
                if slot.live && wanted(&slot.key) {
                    each(&slot.key, &slot.hint, matched);
                }
            }
        };
        MATCHES.with(|cell| match cell.try_borrow_mut() {
            Ok(mut matches) => visit(&mut matches),
            // Re-entered on this thread: a fresh buffer rather than a panic.
            Err(_) => visit(&mut TenantMatches::new()),
        });
    }

    fn prefix_match(&self, input: RoutingInput<'_>) -> Option<(PrefixMatch, bool)> {
        match input {
            RoutingInput::None => None,
            RoutingInput::Text(text) => Some((self.text.prefix_match(text), false)),
            RoutingInput::Tokens(tokens) => Some((self.tokens.prefix_match_symbols(tokens), true)),
        }
    }

    fn insert(&self, input: RoutingInput<'_>, slot: &Slot) {
        match input {
            RoutingInput::None => {}
            RoutingInput::Text(text) => self.text.insert(text, slot.text),
            RoutingInput::Tokens(tokens) => self.tokens.insert_symbols(tokens, slot.tokens),
        }
    }

    /// Inserts the routing input another replica sent to `key`, if `key`
    /// is a live member (never admitting one). Returns whether it did.
    pub(crate) fn record_peer_choice(&self, input: RoutingInput<'_>, key: &str) -> bool {
        if is_empty(input) {
            return false;
        }
        let table = self.members.read();
        match table.by_key.get(key).map(|&slot| &table.slots[slot]) {
            Some(slot) if slot.live => {
                self.insert(input, slot);
                true
            }
            _ => false,
        }
    }

    /// Inserts the routing input for the chosen worker if it is a member
    /// (admitting a worker never announced by an event, refusing a removed
    /// one).
    pub(crate) fn record_choice(&self, input: RoutingInput<'_>, key: &str) {
        if is_empty(input) {
            return;
        }
        {
            let table = self.members.read();
            if let Some(&slot) = table.by_key.get(key) {
                let slot = &table.slots[slot];
                if slot.live {
                    self.insert(input, slot);
                }
                return;
            }
        }
        // A worker no event announced (the host routes before or without
        // membership events): admit it now so affinity still builds up.
        let mut table = self.members.write();
        let slot = match table.by_key.get(key) {
            Some(&slot) if !table.slots[slot].live => return,
            Some(&slot) => slot,
            None => self.admit(&mut table, key),
        };
        self.insert(input, &table.slots[slot]);
    }
}

/// The cache-aware policy. See the [module docs](self) for the decision
/// and its synchronization.
pub struct CacheAware {
    config: CacheAwareConfig,
    /// What every tree of the policy charges.
    budget: Arc<MemoryBudget>,
    models: RwLock<HashMap<Box<str>, Arc<ModelState>>>,
    /// Every key membership events named, and whether it is still a
    /// member, to seed the trees of models seen later. Lock order: `fleet`,
    /// then `models`.
    fleet: Mutex<Vec<(Arc<str>, bool)>>,
    rotation: AtomicUsize,
    /// The draws of a softmax temperature (token input by cost).
    rng: SharedRng,
}

/// Per-thread buffers of the cost choice, reused across decisions.
#[derive(Default)]
struct Scratch {
    matches: TenantMatches,
    scores: Vec<Scored>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    /// Every member's match for kv-aware's cold workers
    /// (`ModelState::for_each_token_match`).
    #[cfg(feature = "kv-block-index")]
    static MATCHES: RefCell<TenantMatches> = RefCell::new(TenantMatches::new());
}

impl std::fmt::Debug for CacheAware {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheAware")
            .field("config", &self.config)
            .field("models", &self.models.read().len())
            .finish_non_exhaustive()
    }
}

impl CacheAware {
    /// A policy with no trees yet (each model's tree is created with its
    /// first request).
    pub fn new(config: CacheAwareConfig) -> Result<Self, PolicyError> {
        Self::with_seed(config, crate::rng::random_seed())
    }

    /// [`new`](Self::new) with the softmax draws of a non-zero
    /// [`CostModel::temperature`] seeded (reproducible runs).
    pub fn with_seed(config: CacheAwareConfig, seed: u64) -> Result<Self, PolicyError> {
        config.validate()?;
        let budget = config
            .tree_budget
            .clone()
            .unwrap_or_else(|| MemoryBudget::new(config.max_tree_bytes));
        Ok(CacheAware {
            config,
            budget,
            models: RwLock::new(HashMap::new()),
            fleet: Mutex::new(Vec::new()),
            rotation: AtomicUsize::new(0),
            rng: SharedRng::new(seed),
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &CacheAwareConfig {
        &self.config
    }

    /// Brings every model's trees within the limits (`max_tree_size` per
    /// worker, the byte budget) in bounded work per tree. Inserts already do
    /// this as they go; this fallback, which the host calls from its own
    /// timer every `eviction_interval`, reaches trees nobody inserts into
    /// after a budget they share was lowered or filled by other trees.
    pub fn evict(&self) {
        let models: Vec<Arc<ModelState>> = self.models.read().values().cloned().collect();
        for state in models {
            state.text.enforce_limits();
            state.tokens.enforce_limits();
        }
    }

    /// The byte budget the policy's trees charge.
    pub fn budget(&self) -> &Arc<MemoryBudget> {
        &self.budget
    }

    /// Symbols of `model`'s text tree attributed to worker `key` (0 when the
    /// model or worker is unknown). For metrics and tests.
    pub fn affinity_size(&self, model: &str, key: &str) -> usize {
        let Some(state) = self.models.read().get(model).cloned() else {
            return 0;
        };
        let table = state.members.read();
        table
            .by_key
            .get(key)
            .map_or(0, |&slot| state.text.tenant_size(table.slots[slot].text))
    }

    /// Forgets `model`'s trees (for a model the host no longer serves).
    /// Returns whether it had any. Its next request starts a fresh tree.
    pub fn remove_model(&self, model: &str) -> bool {
        self.models.write().remove(model).is_some()
    }

    /// Whether `model` has a tree yet.
    pub fn has_model(&self, model: &str) -> bool {
        self.models.read().contains_key(model)
    }

    pub(crate) fn model(&self, model: &str) -> Arc<ModelState> {
        if let Some(state) = self.models.read().get(model) {
            return Arc::clone(state);
        }
        let fleet = self.fleet.lock();
        let mut models = self.models.write();
        let state = models
            .entry(model.into())
            .or_insert_with(|| Arc::new(ModelState::new(&self.config, &self.budget, fleet.iter())));
        Arc::clone(state)
    }

    /// Fleet-wide spread over all candidates, available or not, as the old
    /// gate computed it.
    fn fleet_imbalanced<B: Backend>(&self, candidates: &[B]) -> bool {
        let (mut min, mut max) = (usize::MAX, 0usize);
        for c in candidates {
            let load = c.load();
            min = min.min(load);
            max = max.max(load);
        }
        max.saturating_sub(min) > self.config.balance_abs_threshold
            && max as f64 > min as f64 * self.config.balance_rel_threshold
    }

    /// The fair least-loaded fallback. The rotation advances only here, so
    /// cold traffic interleaved with affinity hits still rotates evenly.
    pub(crate) fn least_loaded<B: Backend>(
        &self,
        candidates: &[B],
        reason: DecisionReason,
    ) -> Option<Decision> {
        let start = self.rotation.fetch_add(1, Ordering::Relaxed);
        fair_least_loaded(candidates, start).map(|(i, _)| Decision::new(i, reason))
    }

    #[cfg(feature = "kv-block-index")]
    /// [`least_loaded`](Self::least_loaded) over the candidates
    /// `eligible(index)` accepts, on the same rotation.
    pub(crate) fn least_loaded_where<B: Backend>(
        &self,
        candidates: &[B],
        reason: DecisionReason,
        eligible: impl Fn(usize) -> bool,
    ) -> Option<Decision> {
        let start = self.rotation.fetch_add(1, Ordering::Relaxed);
        super::fair_least_loaded_where(candidates, start, eligible)
            .map(|(i, _)| Decision::new(i, reason))
    }

    /// Whether token input is placed by the cost (else by the gate).
    fn tokens_by_cost(&self) -> bool {
        self.config.gate == LoadGate::PerRequest && self.config.token_choice == TokenChoice::Cost
    }

    /// The least-cost candidate for `tokens` (see the [module docs](self)).
    /// Reasons: `cache_hit` when the winner holds a prefix and no
    /// available candidate holds a longer one, `cache_overloaded` when one
    /// does but its load outweighed it, `cache_low_match` when the winner
    /// holds nothing.
    fn decide_by_cost<B: Backend>(
        &self,
        state: &ModelState,
        candidates: &[B],
        tokens: &[u32],
        scratch: &mut Scratch,
    ) -> Option<Decision> {
        let block_size = self.config.block_size;
        let Scratch { matches, scores } = scratch;
        state.tokens.prefix_match_tenants_symbols(tokens, matches);
        scores.clear();
        {
            let table = state.members.read();
            for (tenant, matched) in matches.iter() {
                // Only whole blocks are reused by the engine.
                let held = matched / block_size;
                if held == 0 {
                    continue;
                }
                let slot = table
                    .by_token_tenant
                    .get(tenant.index() as usize)
                    .copied()
                    .flatten()
                    .map(|slot| &table.slots[slot])
                    // Removed after its holds were read: no owner.
                    .filter(|slot| slot.live);
                if let Some(slot) = slot
                    && let Some(i) = find_candidate(&slot.key, &slot.hint, candidates)
                {
                    scores.push(Scored::new(i, held, false));
                }
            }
        }
        let blocks = tokens.len() / block_size;
        // Every scored candidate is a live member, and an unscored one is
        // any candidate the host offers, as the gate's fallback takes.
        let (chosen, reason) = cost::choose(
            &self.config.cost,
            candidates,
            blocks,
            scores,
            &self.rng,
            &self.rotation,
            |_| true,
        )?;
        Some(
            Decision::new(chosen.index, reason)
                .with_match(chosen.blocks * block_size, tokens.len()),
        )
    }

    fn decide<B: Backend>(
        &self,
        state: &ModelState,
        candidates: &[B],
        ctx: &RequestContext<'_>,
    ) -> Option<Decision> {
        if let RoutingInput::Tokens(tokens) = ctx.routing
            && !tokens.is_empty()
            && self.tokens_by_cost()
        {
            return SCRATCH.with(|cell| match cell.try_borrow_mut() {
                Ok(mut scratch) => self.decide_by_cost(state, candidates, tokens, &mut scratch),
                // Re-entered on this thread (a host's backend calling
                // back): fresh buffers rather than a panic.
                Err(_) => self.decide_by_cost(state, candidates, tokens, &mut Scratch::default()),
            });
        }
        if self.config.gate == LoadGate::FleetWide && self.fleet_imbalanced(candidates) {
            return self.least_loaded(candidates, DecisionReason::CacheFleetImbalance);
        }
        let Some((found, tokens)) = state.prefix_match(ctx.routing) else {
            return self.least_loaded(candidates, DecisionReason::CacheLowMatch);
        };
        // Tokens: only whole blocks are reused by the engine.
        let matched = if tokens {
            found.matched - found.matched % self.config.block_size
        } else {
            found.matched
        };
        let rate = if found.input == 0 {
            0.0
        } else {
            matched as f64 / found.input as f64
        };
        let tenant = match found.tenant {
            Some(t) if matched > 0 && rate > self.config.cache_threshold => t,
            _ => {
                return self
                    .least_loaded(candidates, DecisionReason::CacheLowMatch)
                    .map(|d| d.with_match(matched, found.input));
            }
        };
        let preferred = {
            let table = state.members.read();
            let by_tenant = if tokens {
                &table.by_token_tenant
            } else {
                &table.by_text_tenant
            };
            by_tenant
                .get(tenant.index() as usize)
                .copied()
                .flatten()
                .map(|slot| &table.slots[slot])
                // A worker removed after the match was taken is no owner,
                // even if the host's candidate slice still lists it.
                .filter(|slot| slot.live)
                .and_then(|slot| find_candidate(&slot.key, &slot.hint, candidates))
        };
        let Some(preferred) = preferred.filter(|&i| candidates[i].is_available()) else {
            return self
                .least_loaded(candidates, DecisionReason::CacheOwnerUnavailable)
                .map(|d| d.with_match(matched, found.input));
        };
        if self.config.gate == LoadGate::PerRequest {
            let min_load = min_available_load(candidates);
            if self
                .config
                .preferred_yields(candidates[preferred].load(), min_load)
            {
                return self
                    .least_loaded(candidates, DecisionReason::CacheOverloaded)
                    .map(|d| d.with_match(matched, found.input));
            }
        }
        Some(Decision::new(preferred, DecisionReason::CacheHit).with_match(matched, found.input))
    }
}

impl<B: Backend> Policy<B> for CacheAware {
    fn select(&self, candidates: &[B], ctx: &RequestContext<'_>) -> Option<Decision> {
        let state = self.model(ctx.model);
        let decision = self.decide(&state, candidates, ctx)?;
        state.record_choice(ctx.routing, candidates[decision.index].key());
        Some(decision)
    }
}

impl PolicyState for CacheAware {
    fn name(&self) -> &str {
        match (self.config.gate, self.config.token_choice) {
            (LoadGate::FleetWide, _) => "cache_aware_fleet_gate",
            (LoadGate::PerRequest, TokenChoice::Gate) => "cache_aware",
            (LoadGate::PerRequest, TokenChoice::Cost) => "cache_aware_cost",
        }
    }
    fn learn_choice(&self, model: &str, input: RoutingInput<'_>, worker: &str) -> bool {
        // The model's state as a request for it would make it: the
        // registry hands a choice only to the instance of a model it
        // routes.
        self.model(model).record_peer_choice(input, worker)
    }

    fn on_membership(&self, event: MembershipEvent<'_>) {
        let mut fleet = self.fleet.lock();
        let key = event.key();
        let live = !matches!(event, MembershipEvent::Removed { .. });
        match fleet.iter_mut().find(|(k, _)| &**k == key) {
            Some(entry) => entry.1 = live,
            None => fleet.push((key.into(), live)),
        }
        let models: Vec<Arc<ModelState>> = self.models.read().values().cloned().collect();
        for state in models {
            state.apply(event);
        }
    }

    fn maintain(&self) {
        self.evict();
    }

    fn tree_stats(&self) -> Vec<TreeStats> {
        let models: Vec<Arc<ModelState>> = self.models.read().values().cloned().collect();
        let mut text = TreeStats::new("text");
        let mut tokens = TreeStats::new("tokens");
        for state in models {
            text.add(&state.text);
            tokens.add(&state.tokens);
        }
        vec![text, tokens]
    }

    fn tree_budget(&self) -> Option<Arc<MemoryBudget>> {
        Some(Arc::clone(&self.budget))
    }

    fn affinity_sizes(&self) -> Vec<(Arc<str>, usize)> {
        let models: Vec<Arc<ModelState>> = self.models.read().values().cloned().collect();
        let mut sizes: Vec<(Arc<str>, usize)> = Vec::new();
        for state in models {
            let table = state.members.read();
            for slot in table.slots.iter().filter(|slot| slot.live) {
                let size =
                    state.text.tenant_size(slot.text) + state.tokens.tenant_size(slot.tokens);
                match sizes.iter_mut().find(|(key, _)| *key == slot.key) {
                    Some(entry) => entry.1 += size,
                    None => sizes.push((Arc::clone(&slot.key), size)),
                }
            }
        }
        sizes
    }
}
