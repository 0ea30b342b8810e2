//! One shard: the subtree of every text whose first symbol maps to it, stored
//! in an index arena and mutated only under the shard's write lock.
//!
//! All functions here are single-threaded logic over `&Shard` / `&mut Shard`;
//! the only interior mutability is the per-(node, tenant) stamp, an atomic so
//! that lookups holding a *read* lock can refresh it.

use smallvec::SmallVec;

use crate::symbol::{Probe, Unit};
use crate::sync::{AtomicU64, Ordering};

/// Index of the shard's root (empty label, never freed, owned by nobody).
pub(crate) const ROOT: u32 = 0;

/// Longest label a single new node gets; longer inserts become a chain, which
/// keeps symbol counts within `u32`.
pub(crate) const LABEL_MAX: usize = 1 << 28;

/// A tenant's hold on one node.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) tenant: u32,
    /// Position of this node in `Shard::tenant_nodes[tenant]`.
    pos: u32,
    /// Children of this node that `tenant` also holds; 0 means the node is one
    /// of the tenant's leaves, i.e. an eviction candidate.
    pub(crate) held_children: u32,
    /// Last use of this node by `tenant`.
    pub(crate) stamp: AtomicU64,
}

impl Entry {
    #[inline]
    pub(crate) fn stamp(&self) -> u64 {
        self.stamp.load(Ordering::Relaxed)
    }

    /// Raises the stamp to `now`, writing only when it is stale so shared hot
    /// nodes are not written on every lookup.
    #[inline]
    pub(crate) fn touch(&self, now: u64) {
        if self.stamp.load(Ordering::Relaxed) < now {
            self.stamp.store(now, Ordering::Relaxed);
        }
    }
}

/// A node. `repr(C)` with 64-byte alignment keeps what the walk reads (label,
/// children, symbol count, parent) in one cache line; the owners follow.
#[derive(Debug)]
#[repr(C, align(64))]
pub(crate) struct Node<U> {
    /// Buffer holding the edge label from the parent in
    /// `label_start..label_end` (the units around it are dead, see
    /// `split_label`); empty for the root and for free slots.
    label_buf: Box<[U]>,
    /// `(first symbol of the child's label, child index)`, sorted by key.
    /// Up to two inline (most nodes), so the walk does not chase a pointer.
    pub(crate) children: SmallVec<[(u32, u32); 2]>,
    /// Symbols in `label`.
    pub(crate) symbols: u32,
    pub(crate) parent: u32,
    /// Bumped whenever the slot is freed, so stale eviction candidates are
    /// recognised after the slot is reused.
    pub(crate) generation: u32,
    /// Start of the label in `label_buf`.
    label_start: u32,
    /// End of the label in `label_buf`.
    label_end: u32,
    /// Tenants holding this node; empty only for the root and free slots.
    pub(crate) tenants: SmallVec<[Entry; 1]>,
}

/// A label: a buffer and the range of it that is live.
type Label<U> = (Box<[U]>, u32, u32);

/// Splits the label `buf[start..end]` after `at` units into (upper, lower)
/// labels, copying only the shorter side; the longer side keeps the buffer
/// with its range narrowed.
///
/// When the upper part is the shorter one (the common case: a new request
/// branching a few characters into an earlier request's suffix), the lower
/// node keeps the buffer and only moves `start` past the cut, so the split
/// copies a few bytes instead of the suffix. Otherwise the upper node keeps
/// it and moves `end`: the buffer is not shrunk, because a `realloc` of a
/// buffer another thread allocated takes that thread's allocator lock (see
/// [`reserve_one`]). Dead units are bounded by what the buffer held when it
/// was allocated.
fn split_label<U: Unit>(buf: Box<[U]>, start: u32, end: u32, at: usize) -> (Label<U>, Label<U>) {
    let cut = start + at as u32;
    let live = &buf[start as usize..end as usize];
    if at <= live.len() - at {
        let upper: Box<[U]> = live[..at].into();
        ((upper, 0, at as u32), (buf, cut, end))
    } else {
        let lower: Box<[U]> = live[at..].into();
        let lower_len = lower.len() as u32;
        ((buf, start, cut), (lower, 0, lower_len))
    }
}

/// Makes room for one more element in `v` without `realloc`.
///
/// Threads share nodes, so a node's spilled buffer was often allocated by
/// another thread. glibc's `realloc` of such a buffer takes the lock of the
/// arena it came from, which its owner holds for its own allocations, and a
/// contended arena lock sleeps in the kernel at once; with two threads
/// inserting into one shard that was a futex wait every few hundred
/// operations. Allocating the larger buffer here (from this thread's arena)
/// and freeing the old one (into this thread's cache when small) avoids it.
#[inline]
fn reserve_one<A: smallvec::Array>(v: &mut SmallVec<A>) {
    if v.len() < v.capacity() {
        return;
    }
    let mut grown = SmallVec::with_capacity((v.capacity() * 2).max(4));
    grown.extend(v.drain(..));
    *v = grown;
}

/// [`reserve_one`] for a per-tenant node list.
#[inline]
fn reserve_one_vec(v: &mut Vec<u32>) {
    if v.len() < v.capacity() {
        return;
    }
    let mut grown = Vec::with_capacity((v.capacity() * 2).max(8));
    grown.extend_from_slice(v);
    *v = grown;
}

impl<U> Node<U> {
    /// The edge label from the parent.
    #[inline]
    pub(crate) fn label(&self) -> &[U] {
        &self.label_buf[self.label_start as usize..self.label_end as usize]
    }

    fn empty(parent: u32, generation: u32) -> Self {
        Self {
            label_buf: Box::new([]),
            label_start: 0,
            label_end: 0,
            children: SmallVec::new(),
            tenants: SmallVec::new(),
            parent,
            symbols: 0,
            generation,
        }
    }

    #[inline]
    pub(crate) fn entry(&self, tenant: u32) -> Option<&Entry> {
        self.tenants.iter().find(|e| e.tenant == tenant)
    }

    #[inline]
    fn entry_index(&self, tenant: u32) -> Option<usize> {
        self.tenants.iter().position(|e| e.tenant == tenant)
    }

    #[inline]
    pub(crate) fn child(&self, key: u32) -> Option<u32> {
        // Most nodes have a handful of children; the few wide ones (a system
        // prompt followed by many user suffixes) are still a binary search.
        self.children
            .binary_search_by_key(&key, |&(k, _)| k)
            .ok()
            .map(|i| self.children[i].1)
    }

    /// The most recently used tenant of this node (ties: first entry).
    #[inline]
    pub(crate) fn most_recent(&self) -> Option<&Entry> {
        let mut best: Option<&Entry> = None;
        for e in &self.tenants {
            if best.is_none_or(|b| e.stamp() > b.stamp()) {
                best = Some(e);
            }
        }
        best
    }
}

/// A candidate for eviction: one tenant's hold on one of its leaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Candidate {
    pub(crate) stamp: u64,
    pub(crate) tenant: u32,
    pub(crate) shard: u32,
    pub(crate) node: u32,
    pub(crate) generation: u32,
}

/// What `Shard::evict` did with a candidate.
#[derive(Debug)]
pub(crate) enum Evicted {
    /// Removed `symbols` from the tenant; `next` is the parent when it became
    /// the tenant's leaf.
    Removed {
        symbols: u64,
        next: Option<Candidate>,
    },
    /// Used again since it was collected: retry with the new stamp.
    Touched(Candidate),
    /// Gone, no longer held, or no longer a leaf of the tenant.
    Stale,
}

/// A node an insert's read phase walked through completely, as it saw it;
/// its parent is the previous node of the path (the root for the first).
#[derive(Clone, Copy, Debug)]
struct Seen {
    node: u32,
    generation: u32,
}

/// Where an insert's read phase stopped below its fully matched path.
#[derive(Clone, Copy, Debug)]
enum PlanEnd {
    /// The text ends exactly at the end of the path.
    AtNode,
    /// The path's last node has no child for the next symbol: the rest of
    /// the text becomes a new leaf.
    NewLeaf,
    /// The text ends or diverges `units` units (`symbols` symbols) into the
    /// label of `child`, a child of the path's last node: split it there,
    /// then, if the text goes on, add a new leaf below the upper half.
    Split {
        child: u32,
        generation: u32,
        units: u32,
        symbols: u32,
    },
}

/// What an insert's write phase must do, found by its read phase.
#[derive(Debug)]
pub(crate) struct InsertPlan {
    /// Fully matched nodes, from the top.
    path: SmallVec<[Seen; 12]>,
    end: PlanEnd,
    /// Probe position of the text's unmatched rest, which becomes a new
    /// leaf; `None` when the text ends on the path or inside `end`'s child.
    pub(crate) leaf_at: Option<usize>,
}

/// Outcome of an insert's read phase.
#[derive(Debug)]
pub(crate) enum Planned {
    /// The tenant already held the whole text; its stamps were refreshed.
    Nothing,
    /// Something must change under the write lock.
    Apply(InsertPlan),
}

/// A new leaf's label, built outside the lock.
#[derive(Debug)]
pub(crate) struct NewLeaf<U> {
    pub(crate) label: Box<[U]>,
    pub(crate) symbols: u32,
    pub(crate) key: u32,
}

impl<U: Unit> NewLeaf<U> {
    /// The rest of `probe` from `pos`, or `None` when it is too long for one
    /// label (the caller then inserts in one locked walk, which chains).
    pub(crate) fn from_rest<P: Probe<U>>(probe: &P, pos: usize) -> Option<Self> {
        let key = probe.key_at(pos);
        let mut label = Vec::new();
        let step = probe.take_rest(pos, LABEL_MAX, &mut label);
        if !probe.at_end(pos + step.advance) {
            return None;
        }
        Some(Self {
            label: label.into_boxed_slice(),
            symbols: step.symbols as u32,
            key,
        })
    }
}

/// End of a read-only walk.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WalkEnd {
    /// Deepest node reached (`ROOT` when nothing matched).
    pub(crate) node: u32,
    /// Symbols matched.
    pub(crate) matched: usize,
    /// Probe position after the match.
    pub(crate) pos: usize,
}

#[derive(Debug)]
pub(crate) struct Shard<U> {
    pub(crate) nodes: Vec<Node<U>>,
    free: Vec<u32>,
    /// Symbols held per tenant in this shard (indexed by tenant id).
    pub(crate) sizes: Vec<u64>,
    /// Nodes held per tenant in this shard (indexed by tenant id); what makes
    /// eviction and removal cost proportional to what the tenant holds.
    pub(crate) tenant_nodes: Vec<Vec<u32>>,
}

impl<U: Unit> Shard<U> {
    pub(crate) fn new() -> Self {
        Self {
            nodes: vec![Node::empty(ROOT, 0)],
            free: Vec::new(),
            sizes: Vec::new(),
            tenant_nodes: Vec::new(),
        }
    }

    #[inline]
    pub(crate) fn size_of(&self, tenant: u32) -> u64 {
        self.sizes.get(tenant as usize).copied().unwrap_or(0)
    }

    /// Follows `probe` down from the root while `follow` accepts the node.
    #[inline]
    pub(crate) fn walk<P: Probe<U>>(
        &self,
        probe: &P,
        follow: impl Fn(&Node<U>) -> bool,
    ) -> WalkEnd {
        let mut node = ROOT;
        // The current node, kept so each level indexes the arena once.
        let mut current = &self.nodes[ROOT as usize];
        let mut pos = 0;
        let mut matched = 0;
        while !probe.at_end(pos) {
            let Some(child) = current.child(probe.key_at(pos)) else {
                break;
            };
            let child_node = &self.nodes[child as usize];
            if !follow(child_node) {
                break;
            }
            let label = child_node.label();
            let step = probe.match_label(pos, label, child_node.symbols as usize);
            matched += step.symbols;
            node = child;
            current = child_node;
            pos += step.advance;
            if step.label_units < label.len() {
                break;
            }
        }
        WalkEnd { node, matched, pos }
    }

    /// Refreshes `tenant`'s stamp on `node` and all its ancestors.
    #[inline]
    pub(crate) fn touch_path(&self, mut node: u32, tenant: u32, now: u64) {
        while node != ROOT {
            let n = &self.nodes[node as usize];
            if let Some(e) = n.entry(tenant) {
                e.touch(now);
            }
            node = n.parent;
        }
    }

    fn ensure_tenant(&mut self, tenant: u32) {
        let need = tenant as usize + 1;
        if self.sizes.len() < need {
            self.sizes.resize(need, 0);
            self.tenant_nodes.resize_with(need, Vec::new);
        }
    }

    fn alloc(&mut self, label: Box<[U]>, parent: u32, symbols: u32) -> u32 {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.nodes.push(Node::empty(ROOT, 0));
                (self.nodes.len() - 1) as u32
            }
        };
        let node = &mut self.nodes[slot as usize];
        // Labels are at most `LABEL_MAX` units, so the length fits.
        node.label_end = label.len() as u32;
        node.label_buf = label;
        node.label_start = 0;
        node.parent = parent;
        node.symbols = symbols;
        slot
    }

    fn release(&mut self, slot: u32) {
        let node = &mut self.nodes[slot as usize];
        let generation = node.generation.wrapping_add(1);
        *node = Node::empty(ROOT, generation);
        self.free.push(slot);
    }

    /// First phase of an insert, under the read lock: walks `probe` down,
    /// refreshes `tenant`'s stamps on the nodes it already holds, and says
    /// what the write phase must change, if anything.
    pub(crate) fn plan_insert<P: Probe<U>>(&self, probe: &P, tenant: u32, now: u64) -> Planned {
        let mut path = SmallVec::new();
        let mut all_held = true;
        let mut current = &self.nodes[ROOT as usize];
        let mut pos = 0;
        let end = loop {
            if probe.at_end(pos) {
                break PlanEnd::AtNode;
            }
            let Some(child) = current.child(probe.key_at(pos)) else {
                break PlanEnd::NewLeaf;
            };
            let c = &self.nodes[child as usize];
            let label = c.label();
            let step = probe.match_label(pos, label, c.symbols as usize);
            pos += step.advance;
            if step.label_units < label.len() {
                break PlanEnd::Split {
                    child,
                    generation: c.generation,
                    units: step.label_units as u32,
                    symbols: step.symbols as u32,
                };
            }
            match c.entry(tenant) {
                Some(e) => e.touch(now),
                None => all_held = false,
            }
            path.push(Seen {
                node: child,
                generation: c.generation,
            });
            current = c;
        };
        if all_held && matches!(end, PlanEnd::AtNode) {
            return Planned::Nothing;
        }
        Planned::Apply(InsertPlan {
            path,
            end,
            leaf_at: (!probe.at_end(pos)).then_some(pos),
        })
    }

    /// Second phase of an insert, under the write lock: checks that the
    /// planned path is still what the read phase saw and applies the plan.
    /// Returns `false`, having changed nothing, when the shard changed under
    /// the plan; the caller then inserts with [`insert`](Self::insert).
    ///
    /// `leaf` is the new leaf for the rest of the text at `plan.leaf_at`,
    /// built outside the lock; it is taken only when the plan is applied.
    pub(crate) fn apply_insert(
        &mut self,
        plan: &InsertPlan,
        leaf: &mut Option<NewLeaf<U>>,
        tenant: u32,
        now: u64,
    ) -> bool {
        // Validate everything before changing anything. A live node's label
        // only changes when it is split, which gives it a new parent, and a
        // slot is only reused after its generation was bumped; so unchanged
        // (generation, parent) along the path mean unchanged labels, hence
        // the read phase's match positions still hold.
        let mut parent = ROOT;
        for seen in &plan.path {
            let n = &self.nodes[seen.node as usize];
            if n.generation != seen.generation || n.parent != parent {
                return false;
            }
            parent = seen.node;
        }
        let last = parent;
        if plan.leaf_at.is_some() != leaf.is_some() {
            return false;
        }
        let split_at = match plan.end {
            PlanEnd::AtNode => None,
            PlanEnd::NewLeaf => {
                let Some(new) = leaf.as_ref() else {
                    return false;
                };
                if self.nodes[last as usize].child(new.key).is_some() {
                    // Another insert added that edge meanwhile.
                    return false;
                }
                None
            }
            PlanEnd::Split {
                child,
                generation,
                units,
                symbols,
            } => {
                let c = &self.nodes[child as usize];
                if c.generation != generation || c.parent != last {
                    return false;
                }
                let key = U::key(c.label());
                let children = &self.nodes[last as usize].children;
                let Ok(index) = children.binary_search_by_key(&key, |&(k, _)| k) else {
                    return false;
                };
                if children[index].1 != child {
                    return false;
                }
                // The walk stopped on a symbol boundary before a differing
                // symbol, so the leaf's key differs from the lower half's;
                // checked anyway, as nothing may change before validation.
                let lower = &c.label()[units as usize..];
                if lower.is_empty() || leaf.as_ref().is_some_and(|new| new.key == U::key(lower)) {
                    return false;
                }
                Some((child, index, units, symbols))
            }
        };
        self.ensure_tenant(tenant);
        for seen in &plan.path {
            self.hold(seen.node, tenant, now);
        }
        let mut below = last;
        if let Some((child, index, units, symbols)) = split_at {
            below = self.split(child, index, units as usize, symbols);
            self.hold(below, tenant, now);
        }
        if let Some(new) = leaf.take() {
            // The key is free below `below` (checked above), so this is the
            // insertion position.
            let (Ok(slot) | Err(slot)) = self.nodes[below as usize]
                .children
                .binary_search_by_key(&new.key, |&(k, _)| k);
            let node = self.alloc(new.label, below, new.symbols);
            let children = &mut self.nodes[below as usize].children;
            reserve_one(children);
            children.insert(slot, (new.key, node));
            self.hold(node, tenant, now);
        }
        true
    }

    /// Records that `tenant` uses the text of `probe` at `now`, in one walk
    /// (the caller holds the write lock throughout).
    pub(crate) fn insert<P: Probe<U>>(&mut self, probe: &P, tenant: u32, now: u64) {
        self.ensure_tenant(tenant);
        let mut node = ROOT;
        let mut pos = 0;
        while !probe.at_end(pos) {
            let key = probe.key_at(pos);
            let children = &self.nodes[node as usize].children;
            let (target, advance) = match children.binary_search_by_key(&key, |&(k, _)| k) {
                Err(slot) => {
                    let mut label = Vec::new();
                    let step = probe.take_rest(pos, LABEL_MAX, &mut label);
                    let leaf = self.alloc(label.into_boxed_slice(), node, step.symbols as u32);
                    let children = &mut self.nodes[node as usize].children;
                    reserve_one(children);
                    children.insert(slot, (key, leaf));
                    (leaf, step.advance)
                }
                Ok(i) => {
                    let child = children[i].1;
                    let c = &self.nodes[child as usize];
                    let step = probe.match_label(pos, c.label(), c.symbols as usize);
                    let target = if step.label_units < c.label().len() {
                        self.split(child, i, step.label_units, step.symbols as u32)
                    } else {
                        child
                    };
                    (target, step.advance)
                }
            };
            self.hold(target, tenant, now);
            node = target;
            pos += advance;
        }
    }

    /// Cuts `child` (the `index`-th child of its parent) after `units` units,
    /// returning the new upper node. Owners and stamps are copied to it, so
    /// sizes are unchanged.
    fn split(&mut self, child: u32, index: usize, units: usize, symbols: u32) -> u32 {
        let parent = self.nodes[child as usize].parent;
        let c = &mut self.nodes[child as usize];
        let buf = std::mem::take(&mut c.label_buf);
        let ((upper, upper_start, upper_end), (lower, lower_start, lower_end)) =
            split_label(buf, c.label_start, c.label_end, units);
        let lower_key = U::key(&lower[lower_start as usize..lower_end as usize]);
        let mid = self.alloc(upper, parent, symbols);
        let m = &mut self.nodes[mid as usize];
        (m.label_start, m.label_end) = (upper_start, upper_end);
        {
            let c = &mut self.nodes[child as usize];
            c.label_buf = lower;
            (c.label_start, c.label_end) = (lower_start, lower_end);
            c.symbols -= symbols;
            c.parent = mid;
        }
        self.nodes[parent as usize].children[index].1 = mid;
        let mut entries = SmallVec::new();
        for e in &self.nodes[child as usize].tenants {
            let list = &mut self.tenant_nodes[e.tenant as usize];
            reserve_one_vec(list);
            entries.push(Entry {
                tenant: e.tenant,
                pos: list.len() as u32,
                held_children: 1,
                stamp: AtomicU64::new(e.stamp()),
            });
            list.push(mid);
        }
        let m = &mut self.nodes[mid as usize];
        m.tenants = entries;
        m.children.push((lower_key, child));
        mid
    }

    /// Adds `tenant` to `node` (whose parent it already holds) or refreshes it.
    fn hold(&mut self, node: u32, tenant: u32, now: u64) {
        let n = &mut self.nodes[node as usize];
        if let Some(e) = n.entry(tenant) {
            e.touch(now);
            return;
        }
        let list = &mut self.tenant_nodes[tenant as usize];
        reserve_one(&mut n.tenants);
        reserve_one_vec(list);
        n.tenants.push(Entry {
            tenant,
            pos: list.len() as u32,
            held_children: 0,
            stamp: AtomicU64::new(now),
        });
        list.push(node);
        self.sizes[tenant as usize] += u64::from(n.symbols);
        let parent = n.parent;
        if parent != ROOT {
            if let Some(i) = self.nodes[parent as usize].entry_index(tenant) {
                self.nodes[parent as usize].tenants[i].held_children += 1;
            }
        }
    }

    /// Pushes every leaf of `tenant` (or of every tenant) in this shard.
    pub(crate) fn collect_leaves(&self, shard: u32, tenant: Option<u32>, out: &mut Vec<Candidate>) {
        let mut push = |node: u32, e: &Entry| {
            if e.held_children == 0 {
                out.push(Candidate {
                    stamp: e.stamp(),
                    tenant: e.tenant,
                    shard,
                    node,
                    generation: self.nodes[node as usize].generation,
                });
            }
        };
        match tenant {
            Some(t) => {
                for &node in self.tenant_nodes.get(t as usize).map_or(&[][..], |v| v) {
                    if let Some(e) = self.nodes[node as usize].entry(t) {
                        push(node, e);
                    }
                }
            }
            None => {
                for (i, n) in self.nodes.iter().enumerate() {
                    for e in &n.tenants {
                        push(i as u32, e);
                    }
                }
            }
        }
    }

    /// Removes the candidate's hold if it is still the tenant's leaf with the
    /// collected stamp.
    pub(crate) fn evict(&mut self, c: Candidate) -> Evicted {
        let Some(n) = self.nodes.get(c.node as usize) else {
            return Evicted::Stale;
        };
        if c.node == ROOT || n.generation != c.generation {
            return Evicted::Stale;
        }
        let Some(e) = n.entry(c.tenant) else {
            return Evicted::Stale;
        };
        if e.held_children != 0 {
            return Evicted::Stale;
        }
        let stamp = e.stamp();
        if stamp != c.stamp {
            return Evicted::Touched(Candidate { stamp, ..c });
        }
        let parent = n.parent;
        let symbols = u64::from(n.symbols);
        self.unhold(c.node, c.tenant);
        let next = (parent != ROOT)
            .then(|| {
                let p = &self.nodes[parent as usize];
                p.entry(c.tenant)
                    .filter(|e| e.held_children == 0)
                    .map(|e| Candidate {
                        stamp: e.stamp(),
                        tenant: c.tenant,
                        shard: c.shard,
                        node: parent,
                        generation: p.generation,
                    })
            })
            .flatten();
        Evicted::Removed { symbols, next }
    }

    /// Removes `tenant` from one of its leaves, freeing the node when nobody
    /// holds it any more.
    fn unhold(&mut self, node: u32, tenant: u32) {
        let n = &mut self.nodes[node as usize];
        let Some(i) = n.entry_index(tenant) else {
            return;
        };
        let entry = n.tenants.swap_remove(i);
        let symbols = u64::from(n.symbols);
        let parent = n.parent;
        let now_empty = n.tenants.is_empty();
        let list = &mut self.tenant_nodes[tenant as usize];
        let pos = entry.pos as usize;
        list.swap_remove(pos);
        if let Some(&moved) = list.get(pos) {
            if let Some(j) = self.nodes[moved as usize].entry_index(tenant) {
                self.nodes[moved as usize].tenants[j].pos = pos as u32;
            }
        }
        self.sizes[tenant as usize] -= symbols;
        if parent != ROOT {
            if let Some(j) = self.nodes[parent as usize].entry_index(tenant) {
                let held = &mut self.nodes[parent as usize].tenants[j].held_children;
                *held = held.saturating_sub(1);
            }
        }
        if now_empty {
            // Nobody holds it, so (prefix closure) nobody holds a child: it is
            // a leaf of the tree. Unlink by identity, not by key.
            self.unlink(parent, node);
            self.release(node);
        }
    }

    fn unlink(&mut self, parent: u32, node: u32) {
        let children = &mut self.nodes[parent as usize].children;
        if let Some(i) = children.iter().position(|&(_, c)| c == node) {
            children.remove(i);
        }
    }

    /// Forgets everything `tenant` holds here; returns the symbols removed.
    pub(crate) fn remove_tenant(&mut self, tenant: u32) -> u64 {
        let Some(list) = self.tenant_nodes.get_mut(tenant as usize) else {
            return 0;
        };
        let list = std::mem::take(list);
        let removed = std::mem::take(&mut self.sizes[tenant as usize]);
        let mut emptied = Vec::new();
        for &node in &list {
            let n = &mut self.nodes[node as usize];
            if let Some(i) = n.entry_index(tenant) {
                n.tenants.swap_remove(i);
            }
            if n.tenants.is_empty() {
                emptied.push(node);
            }
        }
        // An emptied node's parent is either kept (unlink from it) or emptied
        // too (freed with it); decide before freeing anything.
        for &node in &emptied {
            let parent = self.nodes[node as usize].parent;
            if parent == ROOT || !self.nodes[parent as usize].tenants.is_empty() {
                self.unlink(parent, node);
            }
        }
        for &node in &emptied {
            self.release(node);
        }
        removed
    }

    /// Checks every structural invariant and that the counters equal a recount.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut recount = vec![0u64; self.sizes.len()];
        let mut listed = vec![0usize; self.sizes.len()];
        let mut reachable = 0usize;
        let mut stack = vec![ROOT];
        while let Some(idx) = stack.pop() {
            let n = &self.nodes[idx as usize];
            let mut last_key = None;
            for &(key, child) in &n.children {
                let c = &self.nodes[child as usize];
                if c.parent != idx {
                    return Err(format!(
                        "node {child}: parent {} but listed under {idx}",
                        c.parent
                    ));
                }
                if c.label().is_empty() || U::key(c.label()) != key {
                    return Err(format!("node {child}: key {key} does not match its label"));
                }
                if last_key.is_some_and(|k| k >= key) {
                    return Err(format!("node {idx}: children not sorted"));
                }
                last_key = Some(key);
                stack.push(child);
            }
            if idx == ROOT {
                if !n.tenants.is_empty() {
                    return Err("root has tenants".into());
                }
                continue;
            }
            reachable += 1;
            if n.tenants.is_empty() {
                return Err(format!("node {idx} is held by nobody"));
            }
            if U::count_symbols(n.label()) != n.symbols as usize {
                return Err(format!("node {idx}: symbol count"));
            }
            for e in &n.tenants {
                let t = e.tenant as usize;
                if t >= recount.len() {
                    return Err(format!("node {idx}: tenant {t} has no counter"));
                }
                recount[t] += u64::from(n.symbols);
                listed[t] += 1;
                if self.tenant_nodes[t].get(e.pos as usize) != Some(&idx) {
                    return Err(format!("node {idx}: tenant {t} list position"));
                }
                let held = n
                    .children
                    .iter()
                    .filter(|&&(_, c)| self.nodes[c as usize].entry(e.tenant).is_some())
                    .count();
                if held != e.held_children as usize {
                    return Err(format!(
                        "node {idx}: tenant {t} held_children {} != {held}",
                        e.held_children
                    ));
                }
                if n.parent != ROOT && self.nodes[n.parent as usize].entry(e.tenant).is_none() {
                    return Err(format!(
                        "node {idx}: tenant {t} holds it but not its parent"
                    ));
                }
            }
        }
        if reachable + 1 + self.free.len() != self.nodes.len() {
            return Err(format!(
                "{} slots, {reachable} reachable nodes, {} free",
                self.nodes.len(),
                self.free.len()
            ));
        }
        for (t, (&count, &size)) in recount.iter().zip(&self.sizes).enumerate() {
            if count != size {
                return Err(format!("tenant {t}: counter {size}, recount {count}"));
            }
            if listed[t] != self.tenant_nodes[t].len() {
                return Err(format!("tenant {t}: node list length"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The crate docs promise two cache lines per node (walk fields, then
    /// owners) with one owner inline.
    #[test]
    fn node_layout_is_two_cache_lines() {
        assert_eq!(std::mem::size_of::<Node<u8>>(), 128);
        assert_eq!(std::mem::size_of::<Node<u32>>(), 128);
        assert_eq!(std::mem::align_of::<Node<u8>>(), 64);
        assert!(std::mem::offset_of!(Node<u8>, generation) < 64);
    }

    #[test]
    fn many_nodes_with_slot_reuse() {
        const N: usize = 1536;
        // A tenant's size is the number of distinct prefixes of its texts.
        fn prefixes<'a>(texts: impl Iterator<Item = &'a String>) -> u64 {
            let mut set = std::collections::HashSet::new();
            for text in texts {
                for end in 1..=text.len() {
                    set.insert(&text[..end]);
                }
            }
            set.len() as u64
        }
        let mut shard: Shard<u8> = Shard::new();
        let texts: Vec<String> = (0..N).map(|i| format!("a{i:05}")).collect();
        for (i, text) in texts.iter().enumerate() {
            shard.insert(
                &crate::symbol::UnitProbe(text.as_bytes()),
                (i % 3) as u32,
                1,
            );
        }
        assert!(shard.nodes.len() > N, "{} slots", shard.nodes.len());
        shard.check().unwrap();
        let of = |t: usize| prefixes(texts.iter().skip(t).step_by(3));
        assert_eq!(shard.size_of(0), of(0));
        assert_eq!(shard.remove_tenant(1), of(1));
        shard.check().unwrap();
        // Freed slots are reused.
        let slots = shard.nodes.len();
        for text in texts.iter().skip(1).step_by(3) {
            shard.insert(&crate::symbol::UnitProbe(text.as_bytes()), 3, 2);
        }
        shard.check().unwrap();
        assert_eq!(shard.size_of(3), of(1));
        assert_eq!(shard.nodes.len(), slots);
    }

    #[test]
    fn freed_slots_are_reused_with_a_new_generation() {
        let mut shard: Shard<u8> = Shard::new();
        let probe = crate::symbol::UnitProbe("abc".as_bytes());
        shard.insert(&probe, 0, 1);
        let node = shard.nodes[ROOT as usize].children[0].1;
        let generation = shard.nodes[node as usize].generation;
        assert_eq!(shard.remove_tenant(0), 3);
        shard.insert(&crate::symbol::UnitProbe("xy".as_bytes()), 1, 2);
        let reused = shard.nodes[ROOT as usize].children[0].1;
        assert_eq!(reused, node, "the freed slot is reused");
        assert_ne!(shard.nodes[reused as usize].generation, generation);
        // A candidate collected before the reuse is recognised as stale.
        let stale = Candidate {
            stamp: 1,
            tenant: 0,
            shard: 0,
            node,
            generation,
        };
        assert!(matches!(shard.evict(stale), Evicted::Stale));
        assert_eq!(shard.size_of(1), 2);
        shard.check().unwrap();
    }
}

/// The two-phase insert: a plan made under the read lock must be rejected,
/// with nothing changed, whenever a writer changed what it relied on between
/// the two phases; a current plan must do exactly what a one-walk insert does.
#[cfg(test)]
mod plan_tests {
    use super::*;
    use crate::symbol::UnitProbe;

    fn plan(shard: &Shard<u8>, text: &str, tenant: u32) -> (InsertPlan, Option<NewLeaf<u8>>) {
        let probe = UnitProbe(text.as_bytes());
        match shard.plan_insert(&probe, tenant, 5) {
            Planned::Apply(plan) => {
                let leaf = plan.leaf_at.and_then(|pos| NewLeaf::from_rest(&probe, pos));
                (plan, leaf)
            }
            Planned::Nothing => panic!("{text:?} needs no change"),
        }
    }

    fn insert(shard: &mut Shard<u8>, text: &str, tenant: u32) {
        shard.insert(&UnitProbe(text.as_bytes()), tenant, 3);
    }

    /// `shard` after the plan for (`text`, `tenant`) was refused: unchanged,
    /// and a one-walk insert then gives the right sizes.
    fn refused_then_locked(
        mut shard: Shard<u8>,
        (plan, mut leaf): (InsertPlan, Option<NewLeaf<u8>>),
        text: &str,
        tenant: u32,
    ) -> Shard<u8> {
        let sizes = shard.sizes.clone();
        let slots = shard.nodes.len();
        assert!(!shard.apply_insert(&plan, &mut leaf, tenant, 6));
        assert_eq!(shard.sizes, sizes, "a refused plan changes nothing");
        assert_eq!(shard.nodes.len(), slots);
        assert!(
            leaf.is_some() == plan.leaf_at.is_some(),
            "the leaf is not used"
        );
        shard.check().unwrap();
        insert(&mut shard, text, tenant);
        shard.check().unwrap();
        shard
    }

    #[test]
    fn current_plans_equal_one_walk_inserts() {
        let texts = [
            ("abcdef", 0),
            ("abcxyz", 1),
            ("abc", 2),
            ("abcdef", 1),
            ("ab", 0),
            ("abcdefgh", 2),
            ("一丁x", 0),
            ("一丁y", 1),
            ("一", 2),
            ("abcdef", 0),
        ];
        let mut planned: Shard<u8> = Shard::new();
        let mut walked: Shard<u8> = Shard::new();
        for (text, tenant) in texts {
            let probe = UnitProbe(text.as_bytes());
            match planned.plan_insert(&probe, tenant, 7) {
                Planned::Nothing => {}
                Planned::Apply(plan) => {
                    let mut leaf = plan.leaf_at.and_then(|pos| NewLeaf::from_rest(&probe, pos));
                    assert!(planned.apply_insert(&plan, &mut leaf, tenant, 7));
                    assert!(leaf.is_none(), "the leaf was used");
                }
            }
            walked.insert(&probe, tenant, 7);
            planned.check().unwrap();
            assert_eq!(planned.sizes, walked.sizes, "after {text:?}");
            assert_eq!(planned.nodes.len(), walked.nodes.len());
        }
        // t0: abcdef, 一丁x; t1: abcxyz + def, 一丁y; t2: abcdefgh, 一.
        assert_eq!(planned.sizes, vec![6 + 3, 6 + 3 + 3, 8 + 1]);
    }

    #[test]
    fn plan_refused_after_a_path_node_was_split() {
        let mut shard: Shard<u8> = Shard::new();
        insert(&mut shard, "abcdef", 0);
        insert(&mut shard, "abcdefgh", 0);
        // Path: "abcdef" (then "gh"); the plan adds tenant 1 to both and a
        // leaf "xy" below "gh".
        let p = plan(&shard, "abcdefghxy", 1);
        // Another writer cuts "abcdef" into "abc" + "def": the node the plan
        // saw under the root now hangs below a new node.
        insert(&mut shard, "abcz", 2);
        let shard = refused_then_locked(shard, p, "abcdefghxy", 1);
        assert_eq!(shard.size_of(1), 10);
        assert_eq!(shard.size_of(2), 4);
    }

    #[test]
    fn plan_refused_after_its_split_child_was_split() {
        let mut shard: Shard<u8> = Shard::new();
        insert(&mut shard, "abcdef", 0);
        // The plan splits "abcdef" after "abcd" and adds "x".
        let p = plan(&shard, "abcdx", 1);
        insert(&mut shard, "abq", 2);
        let shard = refused_then_locked(shard, p, "abcdx", 1);
        assert_eq!(shard.size_of(0), 6);
        assert_eq!(shard.size_of(1), 5);
    }

    #[test]
    fn plan_refused_when_its_new_edge_appeared() {
        let mut shard: Shard<u8> = Shard::new();
        insert(&mut shard, "ab", 0);
        // The plan adds a leaf "cd" below "ab" for tenant 1 ...
        let p = plan(&shard, "abcd", 1);
        // ... but another writer adds an edge starting with 'c' first.
        insert(&mut shard, "abce", 1);
        let shard = refused_then_locked(shard, p, "abcd", 1);
        assert_eq!(shard.size_of(1), 5, "ab + c + d + e");
    }

    #[test]
    fn plan_refused_after_a_path_node_was_freed_and_reused() {
        let mut shard: Shard<u8> = Shard::new();
        insert(&mut shard, "abc", 0);
        let node = shard.nodes[ROOT as usize].children[0].1;
        let p = plan(&shard, "abcd", 1);
        // The path node is freed and its slot reused for another text under
        // the root: same index, same parent, new generation.
        shard.remove_tenant(0);
        insert(&mut shard, "xyz", 2);
        assert_eq!(shard.nodes[ROOT as usize].children[0].1, node);
        let shard = refused_then_locked(shard, p, "abcd", 1);
        assert_eq!(shard.size_of(1), 4);
        assert_eq!(shard.size_of(2), 3);
    }

    #[test]
    fn plan_still_valid_when_others_only_changed_owners() {
        let mut shard: Shard<u8> = Shard::new();
        insert(&mut shard, "abc", 0);
        insert(&mut shard, "abd", 1);
        let (p, mut leaf) = plan(&shard, "abce", 2);
        // Owners change on the path (no structural change): still applies,
        // and holding is idempotent when the same tenant got there first.
        insert(&mut shard, "ab", 2);
        shard.remove_tenant(1);
        assert!(shard.apply_insert(&p, &mut leaf, 2, 6));
        shard.check().unwrap();
        assert_eq!(shard.size_of(2), 4);
        assert_eq!(shard.size_of(1), 0);
    }

    #[test]
    fn holder_of_the_whole_text_needs_no_write() {
        let mut shard: Shard<u8> = Shard::new();
        insert(&mut shard, "abcdef", 0);
        insert(&mut shard, "abcxyz", 1);
        let probe = UnitProbe("abcdef".as_bytes());
        assert!(matches!(shard.plan_insert(&probe, 0, 9), Planned::Nothing));
        // The read phase refreshed tenant 0's stamps on the whole path.
        let abc = shard.nodes[ROOT as usize].children[0].1;
        assert_eq!(
            shard.nodes[abc as usize].entry(0).map(Entry::stamp),
            Some(9)
        );
        assert_eq!(
            shard.nodes[abc as usize].entry(1).map(Entry::stamp),
            Some(3)
        );
        // A prefix ending inside a label still needs a split.
        let probe = UnitProbe("abcd".as_bytes());
        assert!(matches!(shard.plan_insert(&probe, 0, 9), Planned::Apply(_)));
    }
}

#[cfg(test)]
mod label_tests {
    use super::*;

    #[test]
    fn split_label_copies_the_shorter_side() {
        let buf: Box<[u8]> = b"xxabcdefgh".as_slice().into();
        let live = |(buf, start, end): &Label<u8>| buf[*start as usize..*end as usize].to_vec();
        // Upper shorter: the lower keeps the buffer.
        let (upper, lower) = split_label(buf, 2, 10, 2);
        assert_eq!(live(&upper), b"ab");
        assert_eq!(live(&lower), b"cdefgh");
        assert_eq!(
            (lower.1, lower.0.len()),
            (4, 10),
            "same buffer, start moved"
        );
        // Lower shorter: the upper keeps the buffer, not even shrunk.
        let (upper, lower) = split_label(lower.0, lower.1, lower.2, 5);
        assert_eq!(live(&upper), b"cdefg");
        assert_eq!(live(&lower), b"h");
        assert_eq!(
            (upper.1, upper.2, upper.0.len()),
            (4, 9, 10),
            "same buffer, end moved"
        );
        assert_eq!(lower.0.len(), 1, "only the shorter side is copied");
    }
}
