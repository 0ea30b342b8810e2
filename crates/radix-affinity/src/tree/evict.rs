//! Eviction and removal: what frees a tree's entries, by tenant limit,
//! by budget and by tenant (see the parent module's "Eviction and removal"
//! for the locking, and the crate docs' "Memory limits" for the policy).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{
    EVICTION_ATTEMPTS, EVICTION_ROUNDS, EVICTIONS_PER_INSERT, EvictionRecord, REMOVAL_BATCH,
    RadixTree, Root, low_water, pick_shards,
};
use crate::shard::{Candidate, Evicted, ROOT, Shard};
use crate::symbol::{Symbol, Unit, UnitProbe};
use crate::sync::Ordering;
use crate::tenant::TenantId;

impl<S: Symbol> RadixTree<S> {
    /// Evicts each tenant's least recently used entries until it holds at most
    /// `max_per_tenant` symbols (whole nodes are evicted, so a tenant may end
    /// a little below the limit).
    ///
    /// Costs what the over-budget tenants hold (log-linear), never a scan of
    /// the whole tree; lookups and inserts proceed meanwhile, and each shard is
    /// write-locked only for one node removal at a time. Inserts racing with
    /// the call may leave a tenant above the limit when it returns.
    pub fn evict_tenant_by_size(&self, max_per_tenant: usize) {
        let limit = max_per_tenant as u64;
        for (tenant, size) in self.sizes().into_iter().enumerate() {
            if size > limit {
                self.evict_rounds(Some(tenant as u32), limit);
            }
        }
    }

    /// Evicts the least recently used (tenant, entry) pairs across all tenants
    /// until [`total_size`](Self::total_size) is at most `budget`.
    ///
    /// Collects the leaves of the whole tree once (this is a tree-wide
    /// policy), then removes them oldest first, one shard write lock per
    /// removal.
    pub fn evict_to_total(&self, budget: usize) {
        self.evict_rounds(None, budget as u64);
    }

    /// Collects candidates and evicts them; repeats (a few times at most) when
    /// racing inserts kept the real size above `limit`.
    fn evict_rounds(&self, tenant: Option<u32>, limit: u64) {
        for _ in 0..EVICTION_ROUNDS {
            let size = match tenant {
                Some(t) => self.tenant_size(TenantId(t)) as u64,
                None => self.total_size() as u64,
            };
            if size <= limit {
                return;
            }
            let mut candidates = Vec::new();
            for (i, shard) in self.shards.iter().enumerate() {
                shard
                    .0
                    .read()
                    .collect_leaves(i as u32, tenant, &mut candidates);
            }
            self.evict_lru(candidates, size, limit);
        }
    }

    /// Pops candidates oldest first, re-validating each under its shard's write
    /// lock, until `size` is at most `limit`.
    fn evict_lru(&self, candidates: Vec<Candidate>, mut size: u64, limit: u64) {
        // Candidates used again while we work are re-queued with their new
        // stamp; bound that so constant use cannot keep one pass spinning (the
        // caller's next pass collects afresh).
        let mut requeues_left = candidates.len() + 1024;
        let mut heap: BinaryHeap<Reverse<Candidate>> =
            candidates.into_iter().map(Reverse).collect();
        while size > limit {
            let Some(Reverse(candidate)) = heap.pop() else {
                break;
            };
            let outcome = {
                let mut shard = self.write_shard(&self.shards[candidate.shard as usize].0);
                if self.pinned(&shard, candidate) {
                    Evicted::Stale
                } else {
                    shard.evict(candidate)
                }
            };
            match outcome {
                Evicted::Removed { symbols, next } => {
                    size = size.saturating_sub(symbols);
                    if let Some(next) = next.or_else(|| self.released_root(candidate)) {
                        heap.push(Reverse(next));
                    }
                }
                Evicted::Touched(candidate) => {
                    if requeues_left == 0 {
                        break;
                    }
                    requeues_left -= 1;
                    heap.push(Reverse(candidate));
                }
                Evicted::Stale => {}
            }
        }
    }

    /// Forgets everything `tenant` holds; afterwards no lookup returns it
    /// until it is inserted again. The id and name stay interned.
    ///
    /// Costs what the tenant holds. Holds are removed deepest first, in
    /// batches of [`REMOVAL_BATCH`] per exclusive acquisition of a shard, so
    /// lookups and inserts wait at most one batch even when the tenant held
    /// millions of nodes. Inserts for the tenant racing the call may leave
    /// some of it behind.
    pub fn remove_tenant(&self, tenant: TenantId) {
        for shard in self.shards.iter() {
            // Rounds: a split racing the removal copies the tenant's hold to
            // a new node, which the next round takes.
            for _ in 0..EVICTION_ROUNDS {
                let holds = {
                    let shard = self.read_shard(&shard.0);
                    // Skip shards where it holds nothing without taking the
                    // write lock.
                    if shard.size_of(tenant.0) == 0 {
                        break;
                    }
                    shard.holds_deepest_first(tenant.0)
                };
                let mut removed = 0;
                for batch in holds.chunks(REMOVAL_BATCH) {
                    removed += self.write_shard(&shard.0).remove_holds(tenant.0, batch);
                }
                if removed == 0 {
                    break;
                }
            }
        }
    }

    /// Brings the tree within its per-tenant limit and its budget, evicting
    /// a bounded number of entries per tenant over its limit and for the
    /// budget (inserts do this for their own tenant as they go). For a
    /// host's timer: trees nobody inserts into after a shared budget filled
    /// up, or after a limit was lowered, come back within it over a few
    /// calls.
    pub fn enforce_limits(&self) {
        for tenant in 0..self.tenants.count() {
            self.enforce_limits_after(tenant);
        }
    }

    /// Brings the tree back within its per-tenant limit (for `tenant`, which
    /// just inserted) and its budget, in bounded work.
    pub(super) fn enforce_limits_after(&self, tenant: u32) {
        let limit = self.tenant_limit.load(Ordering::Relaxed);
        if self.accounts.symbols(tenant) > limit {
            let low = low_water(limit);
            self.evict_sampled(Some(tenant), || self.accounts.symbols(tenant) > low);
        }
        if let Some(budget) = self.accounts.budget()
            && budget.over()
        {
            self.evict_sampled(None, || budget.used() > low_water(budget.limit()));
        }
    }

    /// Evicts sampled least recently used leaves of `tenant` (or of anyone)
    /// while `above` says the tree is above its low-water mark, at most
    /// [`EVICTIONS_PER_INSERT`] of them.
    ///
    /// Reads a sample of each of a few shards under their shared locks into
    /// a pool, then evicts the pool's oldest candidate under its shard's
    /// exclusive lock, and goes on under the same hold while the next oldest
    /// (the parents that became leaves join the pool) lives in the same
    /// shard: no hold removes more than [`EVICTIONS_PER_INSERT`] nodes, and
    /// nothing walks the whole tree. The pool is sampled again when it runs
    /// dry.
    fn evict_sampled(&self, tenant: Option<u32>, above: impl Fn() -> bool) {
        let samples = self.samples.load(Ordering::Relaxed) as usize;
        let mut rng = self
            .seed
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        let mut scratch = Vec::new();
        let mut sampled = Vec::new();
        let mut pool: BinaryHeap<Reverse<Candidate>> = BinaryHeap::new();
        let (mut evicted, mut attempts) = (0, 0);
        while evicted < EVICTIONS_PER_INSERT && attempts < EVICTION_ATTEMPTS && above() {
            if pool.is_empty() {
                sampled.clear();
                let map = self.accounts.shards(tenant, self.tenants.count());
                if self.every_shard.load(std::sync::atomic::Ordering::Relaxed) {
                    for shard in every_set_bit(&map) {
                        self.read_shard(&self.shards[shard as usize].0)
                            .sample_leaves(tenant, samples, &mut rng, &mut scratch, &mut sampled);
                    }
                } else {
                    for shard in pick_shards(&map, &mut rng).iter().flatten() {
                        self.read_shard(&self.shards[*shard as usize].0)
                            .sample_leaves(tenant, samples, &mut rng, &mut scratch, &mut sampled);
                    }
                }
                if sampled.is_empty() {
                    return;
                }
                pool.extend(sampled.drain(..).map(Reverse));
            }
            let Some(Reverse(first)) = pool.pop() else {
                return;
            };
            let index = first.shard;
            let mut shard = self.write_shard(&self.shards[index as usize].0);
            let mut candidate = first;
            // A rooted shard's eviction that made a hold on a root a leaf:
            // it joins the pool once this shard is released.
            let mut released = None;
            loop {
                attempts += 1;
                let path = self.eviction_log.as_ref().map(|_| {
                    let mut units = self
                        .roots
                        .owning(index)
                        .map(|root| root.units.to_vec())
                        .unwrap_or_default();
                    units.extend(shard.path(candidate.node));
                    <S::Unit as Unit>::symbols(&units)
                });
                let outcome = if self.pinned(&shard, candidate) {
                    Evicted::Stale
                } else {
                    shard.evict(candidate)
                };
                match outcome {
                    Evicted::Removed { next, .. } => {
                        evicted += 1;
                        self.accounts.count_evicted();
                        if let (Some(log), Some(path)) = (&self.eviction_log, path) {
                            log.lock().push(EvictionRecord {
                                tenant: TenantId(candidate.tenant),
                                path,
                                by_tenant_limit: tenant.is_some(),
                            });
                        }
                        if let Some(next) = next {
                            pool.push(Reverse(next));
                        } else if self.root_left(candidate).is_some() {
                            released = Some(candidate);
                            break;
                        }
                    }
                    // Used since it was sampled: it goes back with its new
                    // stamp, behind older candidates.
                    Evicted::Touched(fresh) => pool.push(Reverse(fresh)),
                    Evicted::Stale => {}
                }
                if evicted >= EVICTIONS_PER_INSERT || attempts >= EVICTION_ATTEMPTS || !above() {
                    return;
                }
                match pool.peek() {
                    Some(Reverse(next)) if next.shard == index => {
                        candidate = *next;
                        pool.pop();
                    }
                    _ => break,
                }
            }
            drop(shard);
            if let Some(root) = released.and_then(|c| self.released_root(c)) {
                pool.push(Reverse(root));
            }
        }
    }

    /// Whether `candidate` is a tenant's hold on a root text while the
    /// tenant holds something under the root: not a leaf of the tenant,
    /// though nothing below it is in its shard (`shard` is the candidate's,
    /// held exclusively; see `tree/roots.rs`).
    fn pinned(&self, shard: &Shard<S::Unit>, candidate: Candidate) -> bool {
        if self.roots.is_empty() {
            return false;
        }
        self.roots.iter().any(|root| {
            root.head == candidate.shard
                && root.marked(&self.accounts.shards(Some(candidate.tenant), 0))
                && shard.is_path(candidate.node, &root.units)
        })
    }

    /// The root whose rooted shard held `evicted`, when its tenant holds
    /// nothing in the root's shards any more (its shard bitmap says so).
    fn root_left(&self, evicted: Candidate) -> Option<&Root<S::Unit>> {
        self.roots
            .owning(evicted.shard)
            .filter(|root| !root.marked(&self.accounts.shards(Some(evicted.tenant), 0)))
    }

    /// After `evicted`, a hold in a rooted shard, was removed: the tenant's
    /// hold on the root, when that was the tenant's last hold under the
    /// root (so the root text became its leaf). Takes the head shard's lock
    /// shared; call it with no shard lock held.
    fn released_root(&self, evicted: Candidate) -> Option<Candidate> {
        let root = self.root_left(evicted)?;
        let head = self.read_shard(&self.shards[root.head as usize].0);
        let end = head.walk(&UnitProbe(&root.units), |_| true);
        if end.node == ROOT || end.matched != root.symbols {
            return None;
        }
        head.candidate(end.node, evicted.tenant)
    }
}

/// The shards whose bit is set in `map`, in order.
fn every_set_bit(map: &[u64; crate::budget::SHARD_WORDS]) -> Vec<u32> {
    let mut shards = Vec::new();
    for (word, &bits) in map.iter().enumerate() {
        let mut bits = bits;
        while bits != 0 {
            shards.push(word as u32 * 64 + bits.trailing_zeros());
            bits &= bits - 1;
        }
    }
    shards
}
