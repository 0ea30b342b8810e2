//! Memory accounting: a byte budget shared by trees, and each tree's
//! per-tenant totals.

use std::sync::Arc;

use crate::heap::Block;
use crate::seg::Segmented;
use crate::sync::{AtomicU64, Mutex, Ordering};

/// A memory limit in bytes shared by any number of trees (`Arc` it into
/// [`RadixTree::with_budget`](crate::RadixTree::with_budget)).
///
/// Every tree attached to it adds the bytes it allocates for prefix state
/// (nodes, labels, child and owner arrays, per-tenant node lists) to
/// [`used`](Self::used) and subtracts them when it frees them or is dropped;
/// each heap block counts at the size an allocator with four size classes
/// per power of two (mimalloc, jemalloc) rounds it to. The trees take their
/// blocks from the system allocator, whatever the global allocator is (see
/// the crate docs, "Memory"), which keeps resident memory close to `used`
/// under eviction churn.
/// An insert that leaves `used` above [`limit`](Self::limit) evicts, before
/// it returns, least recently used entries of the tree it inserted into
/// (sampled, see [`RadixTree::set_eviction_samples`](crate::RadixTree::set_eviction_samples)),
/// until `used` is a 64th below the limit or a bounded number are gone. So `used` stays within the limit plus what
/// the inserts in flight add (about one text each), and the budget holds at
/// every moment, whatever the insert rate, without a timer.
///
/// What is *not* accounted: free node slots (a shard's arena keeps the slots
/// of evicted nodes for reuse: at most the peak number of live nodes, 128
/// bytes each), retired arrays awaiting their free (at most 4 KiB per
/// shard), and allocator fragmentation. `docs/benchmarks.md` compares
/// accounted bytes with resident memory under a soak.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: AtomicU64,
    used: AtomicU64,
    evicted: AtomicU64,
}

/// Two budgets are equal when they are the same budget (trees that charge
/// one share it); their figures change with every insert.
impl PartialEq for MemoryBudget {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for MemoryBudget {}

impl MemoryBudget {
    /// A budget of `limit_bytes`.
    pub fn new(limit_bytes: u64) -> Arc<Self> {
        Arc::new(Self {
            limit: AtomicU64::new(limit_bytes),
            used: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        })
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Changes the limit; the next inserts evict down to it.
    pub fn set_limit(&self, limit_bytes: u64) {
        self.limit.store(limit_bytes, Ordering::Relaxed);
    }

    /// Bytes accounted by every tree attached.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Entries (one tenant's hold on one node) evicted to keep within the
    /// limit, since the budget was made.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    /// Whether `used` is above the limit.
    #[inline]
    pub(crate) fn over(&self) -> bool {
        self.used() > self.limit()
    }

    pub(crate) fn count_evicted(&self, entries: u64) {
        self.evicted.fetch_add(entries, Ordering::Relaxed);
    }
}

/// One tenant's totals over the whole tree.
#[derive(Debug)]
pub(crate) struct TenantAccount {
    /// Symbols held.
    symbols: AtomicU64,
    /// Shards where the tenant holds something (bit per shard; a bit may
    /// stay set briefly after the shard emptied, never the reverse).
    shards: [AtomicU64; SHARD_WORDS],
}

/// Words of a shard bitmap.
pub(crate) const SHARD_WORDS: usize = crate::tree::SHARDS.div_ceil(64);

impl TenantAccount {
    fn new() -> Self {
        Self {
            symbols: AtomicU64::new(0),
            shards: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// A tree's accounts, shared by its shards: the budget it charges, entries
/// held, and per-tenant totals (so that a per-tenant limit is checked with
/// one load instead of a pass over the shards).
#[derive(Debug)]
pub(crate) struct Accounts {
    budget: Option<Arc<MemoryBudget>>,
    bytes: AtomicU64,
    entries: AtomicU64,
    evicted: AtomicU64,
    tenants: Segmented<TenantAccount>,
    /// Serializes growth of `tenants`.
    growing: Mutex<()>,
}

impl Accounts {
    pub(crate) fn new(budget: Option<Arc<MemoryBudget>>) -> Self {
        Self {
            budget,
            bytes: AtomicU64::new(0),
            entries: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            tenants: Segmented::new(),
            growing: Mutex::new(()),
        }
    }

    pub(crate) fn budget(&self) -> Option<&Arc<MemoryBudget>> {
        self.budget.as_ref()
    }

    #[inline]
    pub(crate) fn grow(&self, bytes: u64) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        if let Some(budget) = &self.budget {
            budget.used.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    #[inline]
    pub(crate) fn shrink(&self, bytes: u64) {
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
        if let Some(budget) = &self.budget {
            budget.used.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// Accounted bytes of the tree.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Entries (tenant holds on nodes) in the tree.
    pub(crate) fn entries(&self) -> u64 {
        self.entries.load(Ordering::Relaxed)
    }

    /// Entries evicted from the tree by its limits.
    pub(crate) fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    pub(crate) fn count_evicted(&self) {
        self.evicted.fetch_add(1, Ordering::Relaxed);
        if let Some(budget) = &self.budget {
            budget.count_evicted(1);
        }
    }

    /// Entries of a dropped shard.
    pub(crate) fn entries_dropped(&self, entries: u64) {
        self.entries.fetch_sub(entries, Ordering::Relaxed);
    }

    /// Makes sure `tenant` has an account (called when it is interned).
    pub(crate) fn open(&self, tenant: u32) {
        if self.tenants.get(tenant).is_some() {
            return;
        }
        let _growing = self.growing.lock();
        self.tenants
            .grow_to(tenant, |len| Block::from_fn(len, |_| TenantAccount::new()));
    }

    /// `tenant` holds `symbols` more symbols in `entries` more entries
    /// (negative: fewer).
    #[inline]
    pub(crate) fn held(&self, tenant: u32, symbols: i64, entries: i64) {
        self.entries.fetch_add(entries as u64, Ordering::Relaxed);
        if let Some(account) = self.tenants.get(tenant) {
            account.symbols.fetch_add(symbols as u64, Ordering::Relaxed);
        }
    }

    /// Symbols `tenant` holds.
    #[inline]
    pub(crate) fn symbols(&self, tenant: u32) -> u64 {
        self.tenants
            .get(tenant)
            .map_or(0, |a| a.symbols.load(Ordering::Relaxed))
    }

    /// `tenant` now holds something in `shard`.
    pub(crate) fn mark(&self, tenant: u32, shard: u32) {
        if let Some(account) = self.tenants.get(tenant) {
            let (word, bit) = (shard as usize / 64, shard % 64);
            account.shards[word].fetch_or(1 << bit, Ordering::Relaxed);
        }
    }

    /// `tenant` holds nothing in `shard` any more (the shard is held
    /// exclusively, so no `mark` of it races this).
    pub(crate) fn unmark(&self, tenant: u32, shard: u32) {
        if let Some(account) = self.tenants.get(tenant) {
            let (word, bit) = (shard as usize / 64, shard % 64);
            account.shards[word].fetch_and(!(1 << bit), Ordering::Relaxed);
        }
    }

    /// Shards where `tenant` (or, for `None`, any of the first `tenants`
    /// tenants) holds something, as a bitmap.
    pub(crate) fn shards(&self, tenant: Option<u32>, tenants: u32) -> [u64; SHARD_WORDS] {
        let mut map = [0u64; SHARD_WORDS];
        let mut add = |t: u32| {
            if let Some(account) = self.tenants.get(t) {
                for (word, bits) in map.iter_mut().zip(&account.shards) {
                    *word |= bits.load(Ordering::Relaxed);
                }
            }
        };
        match tenant {
            Some(t) => add(t),
            None => (0..tenants).for_each(add),
        }
        map
    }
}

/// A uniform draw below `n` (> 0) from the SplitMix64 sequence in `state`.
#[inline]
pub(crate) fn draw(state: &mut u64, n: usize) -> usize {
    let mut rng = crate::workload::SplitMix64(*state);
    let value = rng.below(n as u64) as usize;
    *state = rng.0;
    value
}
