//! The concurrent tree: shards by first symbol (and by root, `roots.rs`),
//! each behind its own lock.
//!
//! # What is locked
//!
//! There is no global lock. Each shard has a reader-writer lock (`parking_lot`,
//! on its own cache line), but it does not protect the nodes: lookups *and
//! inserts* take it shared, and inserts lock individual nodes
//! (`shard/mod.rs` says how, and why lookups can run beside them). Taking it
//! exclusively is how memory is reclaimed, so only the operations that free
//! or move memory do.
//!
//! | operation | shard lock | node locks | allocates |
//! |---|---|---|---|
//! | `prefix_match`, `prefix_match_tenant`, `prefix_match_tenants` | shared | none | no (once the caller's buffer has grown) |
//! | `insert` | shared (under a root: the rest's shard, then the root's, one after the other) | only the nodes it changes (see `shard/mod.rs`) | the new leaf's label, before any lock; a split's shorter half; a grown array |
//! | eviction by the limits (inside `insert`, `enforce_limits`) | shared to sample candidates; exclusive for up to 32 node removals in a row | — | sample buffers |
//! | `evict_tenant_by_size`, `evict_to_total` | shared to collect candidates; exclusive for each node removed | — | candidate heap |
//! | `remove_tenant` | shared to list the tenant's holds; exclusive for each batch of 64 | — | the list |
//! | growing a shard's arena | none (the slots' mutex) | — | one chunk |
//! | growing a shard's tenant table, freeing retired arrays | exclusive, briefly (an insert asks for it) | — | the growth |
//! | `tenant_size`, `total_size`, `tenants` | shared | none | the result |
//! | `validate`, `recount` | exclusive, one shard at a time | — | the result |
//! | `intern`, `tenant_name`, `tenant_id` | the name table (a lock the request path never takes) | — | on first intern |
//!
//! # Eviction and removal
//!
//! Eviction and removal run under the exclusive lock, at most 32 node
//! removals per acquisition for eviction ([`EVICTIONS_PER_INSERT`]) and 64
//! for removal ([`REMOVAL_BATCH`]), so they are the only writers that
//! exclude lookups, each for a bounded time (an insert that crosses a limit
//! evicts a few nodes this way; see "Memory limits" in the crate docs).
//! What eviction collected under the shared lock is re-validated under the
//! exclusive one before anything is removed (`Shard::evict`, in
//! `shard/evict.rs`); when racing inserts keep a tenant above the limit, a
//! further pass (at most four, [`EVICTION_ROUNDS`]) collects fresh
//! candidates.
//!
//! A thread that finds its shard lock taken polls it briefly before blocking
//! ([`SPIN_LIMIT`] says why); [`RadixTree::lock_waits`] counts those waits.

use std::marker::PhantomData;
use std::sync::Arc;

use crate::InvariantViolation;
use crate::budget::{Accounts, MemoryBudget, SHARD_WORDS};
use crate::clock::{Clock, Ticker};
use crate::shard::{Inserted, ROOT, Shard};
use crate::symbol::{Probe, Symbol, SymbolProbe, UnitProbe};
use crate::sync::{AtomicU64, Mutex, Ordering, RwLock, RwLockReadGuard, RwLockWriteGuard};
use crate::tenant::{Interner, TenantId};

mod evict;
mod roots;

pub use roots::{MAX_ROOTS, RootsError};
use roots::{Root, Roots};

/// Shards chosen by a text's first symbol: one per ASCII code point plus
/// 128 hashed buckets.
#[cfg(not(loom))]
pub(crate) const FIRST_SHARDS: usize = 256;
/// Shards for the rests of texts under a root (see `tree/roots.rs`), shared
/// out among the roots.
#[cfg(not(loom))]
pub(crate) const ROOTED_SHARDS: usize = 64;
/// Few shards under loom so that models stay small: four by first symbol,
/// and two for roots (one root with two shards, or two with one each).
#[cfg(loom)]
pub(crate) const FIRST_SHARDS: usize = 4;
#[cfg(loom)]
pub(crate) const ROOTED_SHARDS: usize = 2;
/// Number of shards.
pub(crate) const SHARDS: usize = FIRST_SHARDS + ROOTED_SHARDS;

/// The shard of a text whose first symbol is `key`.
#[inline]
fn shard_index(key: u32) -> usize {
    #[cfg(not(loom))]
    {
        if key < 128 {
            key as usize
        } else {
            128 + (key.wrapping_mul(0x9E37_79B1) >> 25) as usize
        }
    }
    #[cfg(loom)]
    {
        key as usize % FIRST_SHARDS
    }
}

/// One shard behind its own lock.
type ShardLock<U> = Padded<RwLock<Shard<U>>>;

/// Polls of a taken shard lock before blocking on it. The lock is held
/// exclusively for about a microsecond at most (one eviction, or growing an
/// arena), shared holders take about as long (one walk), and a pause is
/// about 25 ns on the 2-core benchmark machine, so this covers a few of
/// them; blocking (parking_lot spins briefly, yields, then parks
/// the thread on a futex) costs system calls and a wake-up that take longer
/// than the wait itself. Under loom, waiting is left to the modelled lock.
#[cfg(not(loom))]
const SPIN_LIMIT: usize = 128;

/// Takes a lock with `try_lock` at once if it is free; otherwise counts the
/// wait in `waits`, polls up to [`SPIN_LIMIT`] times (critical sections are
/// short), and only then blocks with `lock`.
#[inline]
fn acquire<G>(try_lock: impl Fn() -> Option<G>, lock: impl FnOnce() -> G, waits: &AtomicU64) -> G {
    if let Some(guard) = try_lock() {
        return guard;
    }
    waits.fetch_add(1, Ordering::Relaxed);
    #[cfg(not(loom))]
    for _ in 0..SPIN_LIMIT {
        std::hint::spin_loop();
        if let Some(guard) = try_lock() {
            return guard;
        }
    }
    lock()
}

/// Bound on eviction passes when racing inserts keep adding to the tenant.
const EVICTION_ROUNDS: usize = 4;

/// Most entries one insert evicts to bring its tree back within its limits:
/// bounded work per insert, and the most one exclusive hold of a shard
/// removes. An insert adds at most two nodes, and most evictions free a
/// whole node, so a few suffice to get under a limit; evicting on to the
/// low-water mark (see [`LOW_WATER_DIVISOR`]) in one hold is what lets the
/// next inserts pass without taking any shard exclusively.
const EVICTIONS_PER_INSERT: usize = 32;

/// An insert that crosses a limit evicts until the tree is a 64th of the
/// limit below it (or 32 entries, whichever comes first), not just back
/// under it: under sustained distinct traffic that
/// turns one exclusive acquisition per insert into one per few dozen
/// inserts, which is what keeps a shard all traffic shares (every chat
/// routing text begins with its role) from being write-locked at the
/// insert rate. The cost is a 64th of the cache, about 1.6 %, kept free.
pub const LOW_WATER_DIVISOR: u64 = 64;

/// Candidate look-ups (each a validation under an exclusive lock) one
/// insert's eviction makes at most, evicted or not: a bound on the work
/// when racing lookups keep touching the sampled candidates.
const EVICTION_ATTEMPTS: usize = 4 * EVICTIONS_PER_INSERT;

/// Shards one eviction samples at most (all of them when the tenant, or the
/// tree, holds something in at most this many).
const SHARDS_SAMPLED: usize = 8;

/// Holds [`RadixTree::remove_tenant`] removes per exclusive acquisition of a
/// shard: a bound on how long a removal makes lookups wait (about 10 µs).
pub const REMOVAL_BATCH: usize = 64;

/// Default of [`RadixTree::set_eviction_samples`].
pub const DEFAULT_EVICTION_SAMPLES: usize = 16;

/// Keeps each shard's lock word on its own cache line.
#[derive(Debug)]
#[repr(align(128))]
struct Padded<T>(T);

/// Result of a longest-prefix lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Most recently used tenant of the deepest matching node; `None` when
    /// nothing matched.
    pub tenant: Option<TenantId>,
    /// Matched length in symbols (chars for text).
    pub matched: usize,
    /// Input length in symbols.
    pub input: usize,
}

/// Every tenant's own prefix match of one input, filled by
/// [`RadixTree::prefix_match_tenants_symbols`] (or
/// [`prefix_match_tenants`](RadixTree::prefix_match_tenants) for text) in
/// one walk: for each tenant, the symbols matched down to its deepest node
/// on the input's path, which is what
/// [`prefix_match_tenant_symbols`](RadixTree::prefix_match_tenant_symbols)
/// answers for that tenant alone.
///
/// A buffer meant to be reused: once it has grown to the tree's tenants,
/// filling it again does not allocate, and clearing costs one write per
/// tenant the previous input matched, not one per tenant of the tree.
#[derive(Clone, Debug, Default)]
pub struct TenantMatches {
    /// Matched symbols by dense tenant index; 0 for every tenant not in
    /// `holders`.
    matched: Vec<usize>,
    /// Tenants with a nonzero match, in the order the walk met them.
    holders: Vec<TenantId>,
    /// Input length in symbols.
    input: usize,
}

impl TenantMatches {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Symbols of the input that `tenant` holds (0 for a tenant holding
    /// none, or one the tree does not know).
    #[inline]
    pub fn get(&self, tenant: TenantId) -> usize {
        self.matched.get(tenant.0 as usize).copied().unwrap_or(0)
    }

    /// Every tenant holding at least one symbol of the input, with its
    /// matched length, each once, in no particular order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (TenantId, usize)> + '_ {
        self.holders
            .iter()
            .map(|&t| (t, self.matched[t.0 as usize]))
    }

    /// How many tenants hold at least one symbol of the input.
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    /// True when no tenant holds any of the input.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// The input's length in symbols.
    pub fn input(&self) -> usize {
        self.input
    }

    /// The longest match of any tenant (0 when none).
    pub fn longest(&self) -> usize {
        self.iter().map(|(_, m)| m).max().unwrap_or(0)
    }

    /// Forgets the previous input's matches, and makes room for `tenants`
    /// tenants so that filling allocates nothing under the shard lock.
    fn reset(&mut self, tenants: usize) {
        for t in self.holders.drain(..) {
            self.matched[t.0 as usize] = 0;
        }
        if self.matched.len() < tenants {
            self.matched.resize(tenants, 0);
        }
        self.holders.reserve(tenants);
        self.input = 0;
    }

    /// `tenant` holds a node ending `matched` symbols into the input. The
    /// walk goes down, so a later call for the same tenant is deeper.
    #[inline]
    fn record(&mut self, tenant: u32, matched: usize) {
        let i = tenant as usize;
        if i >= self.matched.len() {
            // A tenant interned after `reset` sized the buffer.
            self.matched.resize(i + 1, 0);
        }
        if self.matched[i] == 0 {
            self.holders.push(TenantId(tenant));
        }
        self.matched[i] = matched;
    }
}

/// How often operations found their shard's lock held in a conflicting mode
/// and had to wait, since the tree was created. See [`RadixTree::lock_waits`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockWaits {
    /// Lookups (`prefix_match*`) that waited for a writer.
    pub reads: u64,
    /// Inserts, evictions and removals that waited for their shard lock:
    /// an insert waits only while the shard is held exclusively (eviction,
    /// removal, arena growth), the others for any holder.
    pub writes: u64,
    /// Steps of inserts that looked at a node again because another insert
    /// changed it (or its parent) meanwhile, or took its lock first.
    pub retries: u64,
}

/// One eviction by a tree's limits, as recorded for the model tests.
#[doc(hidden)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvictionRecord {
    /// Whose hold was evicted.
    pub tenant: TenantId,
    /// The symbols from the root to the end of the evicted node.
    pub path: Vec<u32>,
    /// Evicted for the per-tenant limit (else for the budget).
    pub by_tenant_limit: bool,
}

/// Wait counters, written only when a lock is contended.
#[derive(Debug)]
struct Waits {
    reads: AtomicU64,
    writes: AtomicU64,
    retries: AtomicU64,
}

/// A concurrent multi-tenant radix tree over symbols `S` (`char` for text,
/// `u32` for token ids). See the [crate docs](crate) for the structure and the
/// concurrency design.
///
/// `RadixTree` is `Send + Sync` and every method takes `&self`: share it with
/// an `Arc`.
pub struct RadixTree<S: Symbol = char> {
    shards: Box<[ShardLock<S::Unit>]>,
    tenants: Interner,
    clock: Ticker,
    waits: Padded<Waits>,
    accounts: Arc<Accounts>,
    /// Most symbols one tenant may hold (`u64::MAX`: no limit).
    tenant_limit: AtomicU64,
    /// Holds (or node slots) one eviction looks at per shard.
    samples: AtomicU64,
    /// Whether an eviction samples every shard where there is something to
    /// evict, not [`SHARDS_SAMPLED`] of them (for the model tests).
    every_shard: std::sync::atomic::AtomicBool,
    /// Seeds of the eviction samplers.
    seed: AtomicU64,
    /// Evictions by the limits, recorded for the model tests when on.
    eviction_log: Option<Mutex<Vec<EvictionRecord>>>,
    /// Roots whose texts are spread over shards of their own.
    roots: Roots<S::Unit>,
    _symbols: PhantomData<fn() -> S>,
}

/// A tree keyed by text (Unicode scalar values, stored as UTF-8).
pub type TextTree = RadixTree<char>;
/// A tree keyed by token ids.
pub type TokenTree = RadixTree<u32>;

impl<S: Symbol> Default for RadixTree<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Symbol> std::fmt::Debug for RadixTree<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RadixTree")
            .field("tenants", &self.tenants.count())
            .field("total_size", &self.total_size())
            .finish_non_exhaustive()
    }
}

impl<S: Symbol> RadixTree<S> {
    /// An empty tree with the default [`Clock::Coarse`].
    pub fn new() -> Self {
        Self::with_clock(Clock::default())
    }

    /// An empty tree stamping uses with `clock`.
    pub fn with_clock(clock: Clock) -> Self {
        Self::build(clock, None, false)
    }

    /// An empty tree stamping uses with `clock` whose bytes count against
    /// `budget` (shared with other trees or not): an insert that leaves the
    /// budget's `used` above its limit evicts this tree's least recently
    /// used entries before it returns. See [`MemoryBudget`].
    pub fn with_budget(clock: Clock, budget: Arc<MemoryBudget>) -> Self {
        Self::build(clock, Some(budget), false)
    }

    fn build(clock: Clock, budget: Option<Arc<MemoryBudget>>, log: bool) -> Self {
        let accounts = Arc::new(Accounts::new(budget));
        Self {
            shards: (0..SHARDS)
                .map(|i| Padded(RwLock::new(Shard::new(i as u32, Arc::clone(&accounts)))))
                .collect(),
            tenants: Interner::new(),
            clock: Ticker::new(clock),
            waits: Padded(Waits {
                reads: AtomicU64::new(0),
                writes: AtomicU64::new(0),
                retries: AtomicU64::new(0),
            }),
            accounts,
            tenant_limit: AtomicU64::new(u64::MAX),
            samples: AtomicU64::new(DEFAULT_EVICTION_SAMPLES as u64),
            every_shard: std::sync::atomic::AtomicBool::new(false),
            seed: AtomicU64::new(0x5EED),
            eviction_log: log.then(|| Mutex::new(Vec::new())),
            roots: Roots::default(),
            _symbols: PhantomData,
        }
    }

    /// The same empty tree, told its *roots*: common beginnings (such as the
    /// roles that begin every chat routing text, `system: ` or `user: `)
    /// whose texts are spread over shards of their own, chosen by the symbol
    /// after the root, instead of all sharing the shard of their first
    /// symbol. Lookups, sizes and eviction order are what they would be
    /// without roots (`src/tree/roots.rs` says why); what changes is that
    /// traffic under one root no longer shares one shard lock, so an
    /// eviction's exclusive hold stops a fraction of it.
    ///
    /// At most [`MAX_ROOTS`] roots, none empty, none beginning with another;
    /// set on an empty tree, since they decide where texts live.
    ///
    /// ```
    /// use radix_affinity::TextTree;
    ///
    /// let tree = TextTree::new().with_text_roots(&["system: ", "user: "]).unwrap();
    /// let a = tree.intern("http://worker-a:8000");
    /// tree.insert("user: Hello there\n", a);
    /// tree.insert("user: What now?\n", a);
    /// assert_eq!(tree.prefix_match("user: Hello you").matched, 12);
    /// assert_eq!(tree.prefix_match("user: Why").matched, 8);
    /// assert_eq!(tree.prefix_match("user: ").matched, 6);
    /// assert_eq!(tree.tenant_size(a), 6 + 12 + 10); // "user: " is counted once
    /// ```
    pub fn with_roots(mut self, roots: &[impl AsRef<[S]>]) -> Result<Self, RootsError> {
        if self.entries() != 0 {
            return Err(RootsError::NotEmpty);
        }
        self.roots = Roots::new(roots, |key| shard_index(key) as u32)?;
        Ok(self)
    }

    /// Whether `roots` are a valid set for
    /// [`with_roots`](Self::with_roots), without building a tree: at most
    /// [`MAX_ROOTS`], none empty, none beginning with another. (The crate's
    /// loom build has two rooted shards and refuses more than two roots
    /// when a tree is told them.)
    pub fn check_roots(roots: &[impl AsRef<[S]>]) -> Result<(), RootsError> {
        roots::check(roots)
    }

    /// A tree that records what its limits evict, for the model tests.
    #[doc(hidden)]
    pub fn with_eviction_log(clock: Clock, budget: Option<Arc<MemoryBudget>>) -> Self {
        Self::build(clock, budget, true)
    }

    /// What the limits evicted since the last call, when the tree was made by
    /// [`with_eviction_log`](Self::with_eviction_log).
    #[doc(hidden)]
    pub fn take_eviction_log(&self) -> Vec<EvictionRecord> {
        self.eviction_log
            .as_ref()
            .map(|log| std::mem::take(&mut *log.lock()))
            .unwrap_or_default()
    }

    /// Limits every tenant to `max_symbols` symbols (`None`: no limit). An
    /// insert that takes its tenant above the limit evicts that tenant's
    /// least recently used entries before it returns (vllm-router's
    /// `--max-tree-size`, enforced at every insert instead of on a timer).
    pub fn set_tenant_limit(&self, max_symbols: Option<usize>) {
        let limit = max_symbols.map_or(u64::MAX, |m| m as u64);
        self.tenant_limit.store(limit, Ordering::Relaxed);
    }

    /// The per-tenant limit in symbols, if any.
    pub fn tenant_limit(&self) -> Option<usize> {
        let limit = self.tenant_limit.load(Ordering::Relaxed);
        (limit != u64::MAX).then_some(limit as usize)
    }

    /// How many holds (or node slots) an eviction looks at in each shard it
    /// samples before it evicts the least recently used leaf among them
    /// (Redis's `maxmemory-samples`). Default [`DEFAULT_EVICTION_SAMPLES`];
    /// more is closer to exact LRU and costs more per eviction. A shard that
    /// holds at most this many is searched exactly. At least 1.
    pub fn set_eviction_samples(&self, samples: usize) {
        self.samples.store(samples.max(1) as u64, Ordering::Relaxed);
    }

    /// Makes evictions sample every shard where there is something to
    /// evict instead of a few: with
    /// [`set_eviction_samples`](Self::set_eviction_samples) at least the
    /// largest shard's holds, eviction is exact LRU (what the model tests
    /// compare with). Not for production: it costs a pass over the shards.
    #[doc(hidden)]
    pub fn sample_every_shard(&self, every: bool) {
        self.every_shard
            .store(every, std::sync::atomic::Ordering::Relaxed);
    }

    /// The memory budget this tree charges, if any.
    pub fn budget(&self) -> Option<&Arc<MemoryBudget>> {
        self.accounts.budget()
    }

    /// Bytes of prefix state this tree accounts for (what it charges its
    /// budget): nodes, labels, arrays and per-tenant node lists.
    pub fn bytes(&self) -> u64 {
        self.accounts.bytes()
    }

    /// Entries in the tree: one per tenant per node it holds.
    pub fn entries(&self) -> u64 {
        self.accounts.entries()
    }

    /// Entries evicted by the tree's limits (budget and per-tenant limit)
    /// since it was made; explicit `evict_*` calls are not counted.
    pub fn evicted(&self) -> u64 {
        self.accounts.evicted()
    }

    /// The id of tenant `name`, interning it on first use (idempotent).
    pub fn intern(&self, name: &str) -> TenantId {
        let id = self.tenants.intern(name);
        self.accounts.open(id.0);
        id
    }

    /// The id of tenant `name` if it was interned.
    pub fn tenant_id(&self, name: &str) -> Option<TenantId> {
        self.tenants.get(name)
    }

    /// The name of an interned tenant.
    pub fn tenant_name(&self, id: TenantId) -> Option<Arc<str>> {
        self.tenants.name(id)
    }

    /// Tenants that currently hold at least one symbol, in id order.
    ///
    /// Costs one read lock per shard; meant for admin and metrics, not for
    /// the request path.
    pub fn tenants(&self) -> Vec<(TenantId, Arc<str>)> {
        let sizes = self.sizes();
        sizes
            .iter()
            .enumerate()
            .filter(|&(_, &size)| size > 0)
            .filter_map(|(i, _)| {
                let id = TenantId(i as u32);
                self.tenants.name(id).map(|name| (id, name))
            })
            .collect()
    }

    /// Records that `tenant` holds `symbols` (and so every prefix of it).
    ///
    /// Ids not interned by this tree are ignored.
    pub fn insert_symbols(&self, symbols: &[S], tenant: TenantId) {
        match S::as_units(symbols) {
            Some(units) => self.insert_probe(&UnitProbe(units), tenant),
            None => self.insert_probe(&SymbolProbe(symbols), tenant),
        }
    }

    /// Longest stored prefix of `symbols` and its most recently used owner,
    /// whose last-use stamps along the matched path are refreshed.
    pub fn prefix_match_symbols(&self, symbols: &[S]) -> PrefixMatch {
        prefetch(symbols);
        match S::as_units(symbols) {
            Some(units) => self.match_probe(&UnitProbe(units)),
            None => self.match_probe(&SymbolProbe(symbols)),
        }
    }

    /// How many leading symbols of `symbols` `tenant` holds. Does not count as
    /// a use (no stamp changes).
    pub fn prefix_match_tenant_symbols(&self, symbols: &[S], tenant: TenantId) -> usize {
        match S::as_units(symbols) {
            Some(units) => self.match_tenant_probe(&UnitProbe(units), tenant),
            None => self.match_tenant_probe(&SymbolProbe(symbols), tenant),
        }
    }

    /// Every tenant's own match of `symbols` in one walk, into `out` (its
    /// previous contents are replaced): for each tenant, how many leading
    /// symbols it holds, as
    /// [`prefix_match_tenant_symbols`](Self::prefix_match_tenant_symbols)
    /// would answer for it. One shard read lock, as
    /// [`prefix_match_symbols`](Self::prefix_match_symbols) takes; the walk
    /// reads the owners of every node on the input's path. Does not count
    /// as a use (no stamp changes), and allocates only when `out` is
    /// smaller than the tree's tenants.
    ///
    /// Racing inserts become visible top-down (see the crate docs): a
    /// tenant whose insert is under way may be reported with a shorter
    /// match than it will hold, never a longer one than it holds.
    pub fn prefix_match_tenants_symbols(&self, symbols: &[S], out: &mut TenantMatches) {
        prefetch(symbols);
        match S::as_units(symbols) {
            Some(units) => self.match_tenants_probe(&UnitProbe(units), out),
            None => self.match_tenants_probe(&SymbolProbe(symbols), out),
        }
    }

    /// Symbols attributed to `tenant` (a node shared by k tenants counts once
    /// for each).
    pub fn tenant_size(&self, tenant: TenantId) -> usize {
        self.shards
            .iter()
            .map(|s| s.0.read().size_of(tenant.0))
            .sum::<u64>() as usize
    }

    /// Sum of all tenant sizes.
    pub fn total_size(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.0.read().sizes().sum::<u64>())
            .sum::<u64>() as usize
    }

    /// Every interned tenant's size, in id order, in one pass over the shards
    /// (cheaper than calling [`tenant_size`](Self::tenant_size) per tenant).
    pub fn tenant_sizes(&self) -> Vec<(TenantId, usize)> {
        self.sizes()
            .into_iter()
            .enumerate()
            .map(|(i, size)| (TenantId(i as u32), size as usize))
            .collect()
    }

    /// Per-tenant sizes indexed by tenant id.
    fn sizes(&self) -> Vec<u64> {
        let mut sizes = vec![0u64; self.tenants.count() as usize];
        for shard in self.shards.iter() {
            let shard = shard.0.read();
            for (total, size) in sizes.iter_mut().zip(shard.sizes()) {
                *total += size;
            }
        }
        sizes
    }

    /// How many lookups and writes had to wait for a shard lock so far: a
    /// direct measure of lock contention (for metrics and benchmarks). The
    /// counters are only written on the contended path.
    pub fn lock_waits(&self) -> LockWaits {
        LockWaits {
            reads: self.waits.0.reads.load(Ordering::Relaxed),
            writes: self.waits.0.writes.load(Ordering::Relaxed),
            retries: self.waits.0.retries.load(Ordering::Relaxed),
        }
    }

    /// Read-locks `lock`, counting the acquisition if it has to wait.
    #[inline]
    fn read_shard<'a>(
        &self,
        lock: &'a RwLock<Shard<S::Unit>>,
    ) -> RwLockReadGuard<'a, Shard<S::Unit>> {
        acquire(|| lock.try_read(), || lock.read(), &self.waits.0.reads)
    }

    /// Write-locks `lock`, counting the acquisition if it has to wait.
    #[inline]
    fn write_shard<'a>(
        &self,
        lock: &'a RwLock<Shard<S::Unit>>,
    ) -> RwLockWriteGuard<'a, Shard<S::Unit>> {
        acquire(|| lock.try_write(), || lock.write(), &self.waits.0.writes)
    }

    /// Checks the tree's invariants, including that every tenant's counter
    /// equals a recount of the nodes it holds. Takes each shard's lock
    /// exclusively in turn (so each shard is checked in a stable state while
    /// other shards keep working), and frees retired arrays on the way.
    pub fn validate(&self) -> Result<(), InvariantViolation> {
        for (i, shard) in self.shards.iter().enumerate() {
            self.write_shard(&shard.0)
                .check()
                .map_err(|detail| InvariantViolation { shard: i, detail })?;
        }
        self.check_root_holds()
    }

    /// Under each root: a tenant that holds anything in the root's shards
    /// holds the root text in its head shard, and the rooted shards hold
    /// nothing that does not follow the root (their texts are rests).
    /// Meaningful when no insert runs meanwhile.
    fn check_root_holds(&self) -> Result<(), InvariantViolation> {
        for root in self.roots.iter() {
            let head = self.read_shard(&self.shards[root.head as usize].0);
            let end = head.walk(&UnitProbe(&root.units), |_| true);
            let root_node = (end.node != ROOT && end.matched == root.symbols).then_some(end.node);
            for shard in root.shards.clone() {
                let rooted = self.read_shard(&self.shards[shard as usize].0);
                for tenant in 0..self.tenants.count() {
                    if rooted.size_of(tenant) == 0 {
                        continue;
                    }
                    let held = root_node
                        .is_some_and(|node| head.node(node).owners().owner(tenant).is_some());
                    if !held {
                        return Err(InvariantViolation {
                            shard: shard as usize,
                            detail: format!(
                                "tenant {tenant} holds texts under root {:?} but not the root",
                                root.units
                            ),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Recounts every tenant's size from the nodes (not from the counters),
    /// holding each shard's lock exclusively in turn.
    pub fn recount(&self) -> Vec<(TenantId, usize)> {
        let mut sizes = vec![0usize; self.tenants.count() as usize];
        for shard in self.shards.iter() {
            self.write_shard(&shard.0).for_each_owner(|symbols, owner| {
                if let Some(size) = sizes.get_mut(owner.tenant() as usize) {
                    *size += symbols as usize;
                }
            });
        }
        sizes
            .into_iter()
            .enumerate()
            .map(|(i, size)| (TenantId(i as u32), size))
            .collect()
    }

    /// The shard of a text by its first symbol (`None` for an empty one).
    #[inline]
    fn shard_for<P: Probe<S::Unit>>(&self, probe: &P) -> Option<&RwLock<Shard<S::Unit>>> {
        if probe.at_end(0) {
            return None;
        }
        Some(&self.shards[shard_index(probe.key_at(0))].0)
    }

    /// The rooted shard of a root's `rest` (not empty).
    #[inline]
    fn rooted_shard<P: Probe<S::Unit>>(
        &self,
        root: &Root<S::Unit>,
        rest: &P,
    ) -> &RwLock<Shard<S::Unit>> {
        &self.shards[root.shard_for(rest.key_at(0)) as usize].0
    }

    fn insert_probe<P: Probe<S::Unit>>(&self, probe: &P, tenant: TenantId) {
        if !self.tenants.is_valid(tenant) {
            return;
        }
        let Some(shard) = self.shard_for(probe) else {
            return;
        };
        let now = self.clock.now();
        if let Some((root, rest)) = self.roots.split(probe) {
            // The rest first, so that the tenant's bitmap marks the rooted
            // shard before its hold on the root is refreshed (see
            // `tree/roots.rs`, "Racing writers").
            self.insert_into(self.rooted_shard(root, &rest), &rest, tenant, now);
            if !self.refresh_root(shard, root, tenant.0, now) {
                self.insert_into(shard, &UnitProbe(&root.units), tenant, now);
            }
        } else {
            self.insert_into(shard, probe, tenant, now);
        }
        self.enforce_limits_after(tenant.0);
    }

    /// Inserts `probe` into `shard` with stamp `now`.
    fn insert_into<P: Probe<S::Unit>>(
        &self,
        shard: &RwLock<Shard<S::Unit>>,
        probe: &P,
        tenant: TenantId,
        now: u64,
    ) {
        // Inserts share the shard lock with lookups and with each other and
        // lock only the nodes they change; the shard is taken exclusively
        // only to grow its arena or tenant table, or to free retired arrays.
        loop {
            let outcome = self.read_shard(shard).insert(probe, tenant.0, now);
            let (retries, room) = match outcome {
                Inserted::Done { retries, collect } => (retries, collect),
                Inserted::NeedRoom { retries } => (retries, true),
            };
            if retries > 0 {
                self.waits
                    .0
                    .retries
                    .fetch_add(u64::from(retries), Ordering::Relaxed);
            }
            if room {
                self.write_shard(shard).make_room(tenant.0);
            }
            if matches!(outcome, Inserted::Done { .. }) {
                break;
            }
        }
    }

    #[inline]
    fn match_probe<P: Probe<S::Unit>>(&self, probe: &P) -> PrefixMatch {
        let Some(shard) = self.shard_for(probe) else {
            return PrefixMatch {
                tenant: None,
                matched: 0,
                input: 0,
            };
        };
        if let Some((root, rest)) = self.roots.split(probe) {
            // A match past the root is in the rooted shard; anything shorter
            // in the head shard, where the walk below looks.
            let mut now = None;
            let found = self.match_in(self.rooted_shard(root, &rest), &rest, &mut now);
            if let Some(tenant) = found.tenant {
                let now = now.unwrap_or_else(|| self.clock.now());
                if root.touch_due(tenant.0, now) {
                    self.refresh_root(shard, root, tenant.0, now);
                }
                return PrefixMatch {
                    tenant: found.tenant,
                    matched: root.symbols + found.matched,
                    input: root.symbols + found.input,
                };
            }
        }
        self.match_in(shard, probe, &mut None)
    }

    /// The longest match of `probe` in `shard` alone, its most recent owner
    /// refreshed along the path with the stamp in `now` (read from the
    /// clock into it when it is `None` and a stamp is needed).
    #[inline]
    fn match_in<P: Probe<S::Unit>>(
        &self,
        shard: &RwLock<Shard<S::Unit>>,
        probe: &P,
        now: &mut Option<u64>,
    ) -> PrefixMatch {
        let (end, tenant) = {
            let shard = self.read_shard(shard);
            let end = shard.walk(probe, |_| true);
            let tenant = (end.node != ROOT)
                .then(|| shard.node(end.node).owners().most_recent())
                .flatten()
                .map(|o| o.tenant());
            if let Some(t) = tenant {
                let now = *now.get_or_insert_with(|| self.clock.now());
                shard.touch_path(end.node, t, now);
            }
            (end, tenant)
        };
        // Only the unmatched tail is counted, and with the lock released
        // (writers wait for lookups): the matched part's length comes from
        // the per-node symbol counts.
        let input = end.matched + probe.count_rest(end.pos);
        PrefixMatch {
            tenant: tenant.map(TenantId),
            matched: end.matched,
            input,
        }
    }

    /// Refreshes `tenant`'s stamp on the root text in the head shard, if
    /// it holds it: an insert under the root (which then need not insert
    /// the root again), or a lookup routed to the tenant through the root's
    /// rooted shard. Returns whether the tenant held it.
    #[inline]
    fn refresh_root(
        &self,
        head: &RwLock<Shard<S::Unit>>,
        root: &Root<S::Unit>,
        tenant: u32,
        now: u64,
    ) -> bool {
        let shard = self.read_shard(head);
        let end = shard.walk(&UnitProbe(&root.units), |_| true);
        end.matched == root.symbols && shard.touch_held(end.node, tenant, now)
    }

    fn match_tenant_probe<P: Probe<S::Unit>>(&self, probe: &P, tenant: TenantId) -> usize {
        let Some(shard) = self.shard_for(probe) else {
            return 0;
        };
        if let Some((root, rest)) = self.roots.split(probe) {
            let matched = self
                .read_shard(self.rooted_shard(root, &rest))
                .walk(&rest, |n| n.owners().owner(tenant.0).is_some())
                .matched;
            if matched > 0 {
                return root.symbols + matched;
            }
        }
        let shard = self.read_shard(shard);
        shard
            .walk(probe, |n| n.owners().owner(tenant.0).is_some())
            .matched
    }

    fn match_tenants_probe<P: Probe<S::Unit>>(&self, probe: &P, out: &mut TenantMatches) {
        out.reset(self.tenants.count() as usize);
        let Some(shard) = self.shard_for(probe) else {
            return;
        };
        // A tenant holding a node holds its ancestors, so each tenant's last
        // record on the way down is its deepest node on the path. Under a
        // root, the head shard's walk ends at the root at the latest, and the
        // rooted shard's walk goes on from there.
        let end = self.read_shard(shard).walk_visiting(
            probe,
            |_| true,
            |node, matched| {
                for owner in node.owners().iter() {
                    out.record(owner.tenant(), matched);
                }
            },
        );
        out.input = end.matched + probe.count_rest(end.pos);
        if let Some((root, rest)) = self.roots.split(probe) {
            let end = self
                .read_shard(self.rooted_shard(root, &rest))
                .walk_visiting(
                    &rest,
                    |_| true,
                    |node, matched| {
                        for owner in node.owners().iter() {
                            out.record(owner.tenant(), root.symbols + matched);
                        }
                    },
                );
            out.input = root.symbols + end.matched + rest.count_rest(end.pos);
        }
    }
}

impl RadixTree<char> {
    /// [`with_roots`](Self::with_roots) for roots given as text.
    pub fn with_text_roots(self, roots: &[&str]) -> Result<Self, RootsError> {
        let roots: Vec<Vec<char>> = roots.iter().map(|r| r.chars().collect()).collect();
        self.with_roots(&roots)
    }

    /// Records that `tenant` holds `text` (and so every prefix of it).
    ///
    /// Ids not interned by this tree are ignored.
    pub fn insert(&self, text: &str, tenant: TenantId) {
        self.insert_probe(&UnitProbe(text.as_bytes()), tenant);
    }

    /// Longest stored prefix of `text` and its most recently used owner;
    /// lengths are in chars. Refreshes the owner's last-use stamps along the
    /// matched path. Takes one shard read lock and does not allocate.
    pub fn prefix_match(&self, text: &str) -> PrefixMatch {
        prefetch(text.as_bytes());
        self.match_probe(&UnitProbe(text.as_bytes()))
    }

    /// How many leading chars of `text` `tenant` holds (no stamp changes).
    pub fn prefix_match_tenant(&self, text: &str, tenant: TenantId) -> usize {
        self.match_tenant_probe(&UnitProbe(text.as_bytes()), tenant)
    }

    /// Every tenant's own match of `text` in one walk, in chars (see
    /// [`prefix_match_tenants_symbols`](Self::prefix_match_tenants_symbols)).
    pub fn prefix_match_tenants(&self, text: &str, out: &mut TenantMatches) {
        prefetch(text.as_bytes());
        self.match_tenants_probe(&UnitProbe(text.as_bytes()), out);
    }
}

/// Asks for the first few KiB of a lookup's input at once, so its cache misses
/// overlap the tree's pointer chasing instead of following it (about 10 % of a
/// lookup over cold text).
#[inline]
fn prefetch<T>(input: &[T]) {
    const MAX_BYTES: usize = 4096;
    const LINE: usize = 64;
    #[cfg(target_arch = "x86_64")]
    {
        let bytes = std::mem::size_of_val(input).min(MAX_BYTES);
        let base = input.as_ptr().cast::<i8>();
        for offset in (0..bytes).step_by(LINE) {
            // SAFETY: `offset < size_of_val(input)`, so the address is inside
            // the slice; and a prefetch is only a hint that never faults (SSE
            // is part of the x86_64 baseline).
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    base.add(offset),
                );
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (input, MAX_BYTES, LINE);
}

/// Where an eviction that `limit` triggered stops: a 64th below it (see
/// [`LOW_WATER_DIVISOR`]).
#[inline]
fn low_water(limit: u64) -> u64 {
    limit - limit / LOW_WATER_DIVISOR
}

/// Up to [`SHARDS_SAMPLED`] shards whose bit is set in `map`: all of them when
/// there are that few, else drawn with `rng`.
fn pick_shards(map: &[u64; SHARD_WORDS], rng: &mut u64) -> [Option<u32>; SHARDS_SAMPLED] {
    let mut picked = [None; SHARDS_SAMPLED];
    let set: usize = map.iter().map(|w| w.count_ones() as usize).sum();
    let nth = |mut n: usize| -> Option<u32> {
        for (i, &word) in map.iter().enumerate() {
            let ones = word.count_ones() as usize;
            if n < ones {
                let mut bits = word;
                for _ in 0..n {
                    bits &= bits - 1;
                }
                return Some(i as u32 * 64 + bits.trailing_zeros());
            }
            n -= ones;
        }
        None
    };
    if set <= SHARDS_SAMPLED {
        for (slot, n) in picked.iter_mut().zip(0..set) {
            *slot = nth(n);
        }
    } else {
        for slot in &mut picked {
            *slot = nth(crate::budget::draw(rng, set));
        }
    }
    picked
}
