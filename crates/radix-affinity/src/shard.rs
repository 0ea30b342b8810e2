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
    /// Buffer holding the edge label from the parent after `label_start`
    /// dead units; empty for the root and for free slots.
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
    /// Dead units at the front of `label_buf` (see `split_label`).
    label_start: u32,
    /// Tenants holding this node; empty only for the root and free slots.
    pub(crate) tenants: SmallVec<[Entry; 1]>,
}

/// Splits the label held in `buf` (first `start` units dead) after `at`
/// units into (upper, lower) `(buffer, start)` pairs, copying only the shorter
/// side.
///
/// When the upper part is the shorter one (the common case: a new request
/// branching a few characters into an earlier request's suffix), the lower
/// node keeps the buffer and only moves `start` past the cut, so the split
/// copies a few bytes instead of the suffix. Dead units are bounded by what
/// the buffer held when it was allocated.
#[allow(clippy::type_complexity)] // two (buffer, start) pairs; a type would hide nothing
fn split_label<U: Unit>(
    buf: Box<[U]>,
    start: u32,
    at: usize,
) -> ((Box<[U]>, u32), (Box<[U]>, u32)) {
    let live = &buf[start as usize..];
    if at <= live.len() - at {
        let upper: Box<[U]> = live[..at].into();
        ((upper, 0), (buf, start + at as u32))
    } else {
        let lower: Box<[U]> = live[at..].into();
        let mut upper = buf.into_vec();
        upper.truncate(start as usize + at);
        ((upper.into_boxed_slice(), start), (lower, 0))
    }
}

impl<U> Node<U> {
    /// The edge label from the parent.
    #[inline]
    pub(crate) fn label(&self) -> &[U] {
        &self.label_buf[self.label_start as usize..]
    }

    fn empty(parent: u32, generation: u32) -> Self {
        Self {
            label_buf: Box::new([]),
            label_start: 0,
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
        let mut pos = 0;
        let mut matched = 0;
        while !probe.at_end(pos) {
            let Some(child) = self.nodes[node as usize].child(probe.key_at(pos)) else {
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

    /// Records that `tenant` uses the text of `probe` at `now`.
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
                    self.nodes[node as usize].children.insert(slot, (key, leaf));
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
        let ((upper, upper_start), (lower, lower_start)) = split_label(buf, c.label_start, units);
        let lower_key = U::key(&lower[lower_start as usize..]);
        let mid = self.alloc(upper, parent, symbols);
        self.nodes[mid as usize].label_start = upper_start;
        {
            let c = &mut self.nodes[child as usize];
            c.label_buf = lower;
            c.label_start = lower_start;
            c.symbols -= symbols;
            c.parent = mid;
        }
        self.nodes[parent as usize].children[index].1 = mid;
        let mut entries = SmallVec::new();
        for e in &self.nodes[child as usize].tenants {
            let list = &mut self.tenant_nodes[e.tenant as usize];
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

#[cfg(test)]
mod label_tests {
    use super::*;

    #[test]
    fn split_label_copies_the_shorter_side() {
        let buf: Box<[u8]> = b"xxabcdefgh".as_slice().into();
        // Upper shorter: the lower keeps the buffer.
        let ((upper, us), (lower, ls)) = split_label(buf, 2, 2);
        assert_eq!(&upper[us as usize..], b"ab");
        assert_eq!(&lower[ls as usize..], b"cdefgh");
        assert_eq!((ls, lower.len()), (4, 10), "same buffer, start moved");
        // Lower shorter: the upper keeps the (truncated) buffer.
        let ((upper, us), (lower, ls)) = split_label(lower, ls, 5);
        assert_eq!(&upper[us as usize..], b"cdefg");
        assert_eq!(&lower[ls as usize..], b"h");
        assert_eq!(upper.len(), 9, "truncated after the cut, dead prefix kept");
    }
}
