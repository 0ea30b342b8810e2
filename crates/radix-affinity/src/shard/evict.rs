//! Eviction: candidates collected under shared access, and re-validated
//! and removed under exclusive access.

use super::memory::{Item, heap_bytes};
use super::owner::Owner;
use super::{NODE_BYTES, ROOT, Shard};
use crate::symbol::Unit;
use crate::sync::Ordering;

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

impl<U: Unit> Shard<U> {
    /// Pushes every leaf of `tenant` (or of every tenant) in this shard.
    /// Runs under shared access: candidates are re-validated by `evict`.
    pub(crate) fn collect_leaves(&self, shard: u32, tenant: Option<u32>, out: &mut Vec<Candidate>) {
        let mut push = |node: u32, o: &Owner| {
            if o.held() == 0 {
                out.push(Candidate {
                    stamp: o.stamp(),
                    tenant: o.tenant(),
                    shard,
                    node,
                    generation: self.node(node).generation.load(Ordering::Relaxed),
                });
            }
        };
        match tenant {
            Some(t) => {
                let Some(index) = self.tenants.get(t as usize) else {
                    return;
                };
                let nodes = index.nodes.lock().clone();
                for node in nodes {
                    if let Some(o) = self.node(node).owners().owner(t) {
                        push(node, o);
                    }
                }
            }
            None => {
                let used = self.slots_used();
                for node in 1..used as u32 {
                    for o in self.node(node).owners().iter() {
                        push(node, o);
                    }
                }
            }
        }
    }

    /// Eviction candidates from a sample of this shard (shared access;
    /// `evict` re-validates them): the leaves among up to `max` of
    /// `tenant`'s holds, or among up to `max` node slots for any tenant.
    /// Every hold or slot is looked at when there are at most `max`, so a
    /// small shard is searched exactly.
    pub(crate) fn sample_leaves(
        &self,
        tenant: Option<u32>,
        max: usize,
        rng: &mut u64,
        scratch: &mut Vec<u32>,
        out: &mut Vec<Candidate>,
    ) {
        scratch.clear();
        match tenant {
            Some(t) => {
                if let Some(index) = self.tenants.get(t as usize) {
                    index.sample(max, rng, scratch);
                }
            }
            None => {
                let used = self.slots_used();
                if used <= 1 {
                    return;
                }
                if used - 1 <= max {
                    scratch.extend(1..used as u32);
                } else {
                    for _ in 0..max {
                        scratch.push(1 + crate::budget::draw(rng, used - 1) as u32);
                    }
                }
            }
        }
        for &node in scratch.iter() {
            let n = self.node(node);
            let generation = n.generation.load(Ordering::Relaxed);
            for o in n.owners().iter() {
                if tenant.is_some_and(|t| t != o.tenant()) || o.held() != 0 {
                    continue;
                }
                out.push(Candidate {
                    stamp: o.stamp(),
                    tenant: o.tenant(),
                    shard: self.index,
                    node,
                    generation,
                });
            }
        }
    }

    /// `tenant`'s hold on `node` as an eviction candidate, if it is one of
    /// the tenant's leaves (shared access; `evict` re-validates it).
    pub(crate) fn candidate(&self, node: u32, tenant: u32) -> Option<Candidate> {
        let n = self.node(node);
        let generation = n.generation.load(Ordering::Relaxed);
        n.owners()
            .owner(tenant)
            .filter(|o| o.held() == 0)
            .map(|o| Candidate {
                stamp: o.stamp(),
                tenant,
                shard: self.index,
                node,
                generation,
            })
    }

    /// Whether the units from the root to the end of `node` are `units`
    /// (exclusive access).
    pub(crate) fn is_path(&self, mut node: u32, units: &[U]) -> bool {
        if node == ROOT || node as usize >= self.slots_used() {
            return false;
        }
        let mut rest = units;
        while node != ROOT {
            let view = self.node(node).view_owned();
            let Some(upper) = rest.strip_suffix(view.label) else {
                return false;
            };
            rest = upper;
            node = view.parent;
        }
        rest.is_empty()
    }

    /// Removes the candidate's hold if it is still the tenant's leaf with the
    /// collected stamp (exclusive access).
    pub(crate) fn evict(&mut self, c: Candidate) -> Evicted {
        if c.node == ROOT || c.node as usize >= self.slots_used() {
            return Evicted::Stale;
        }
        let n = self.node(c.node);
        if n.generation.load(Ordering::Relaxed) != c.generation {
            return Evicted::Stale;
        }
        let view = n.view_owned();
        let Some(o) = n.owners_owned().owner(c.tenant) else {
            return Evicted::Stale;
        };
        if o.held() != 0 {
            return Evicted::Stale;
        }
        let stamp = o.stamp();
        if stamp != c.stamp {
            return Evicted::Touched(Candidate { stamp, ..c });
        }
        let parent = view.parent;
        let symbols = u64::from(view.symbols);
        self.unhold(c.node, c.tenant);
        let next = (parent != ROOT)
            .then(|| {
                let p = self.node(parent);
                p.owners_owned()
                    .owner(c.tenant)
                    .filter(|o| o.held() == 0)
                    .map(|o| Candidate {
                        stamp: o.stamp(),
                        tenant: c.tenant,
                        shard: c.shard,
                        node: parent,
                        generation: p.generation.load(Ordering::Relaxed),
                    })
            })
            .flatten();
        Evicted::Removed { symbols, next }
    }

    /// Removes `tenant`'s entry from `node`'s owners, returning whether the
    /// node is now held by nobody (exclusive access).
    fn drop_owner(&mut self, node: u32, tenant: u32) -> Option<(u32, bool)> {
        let n = self.node(node);
        let owners = n.owners_owned();
        let i = owners.iter().position(|o| o.tenant() == tenant)?;
        let pos = owners.get(i).pos.load(Ordering::Relaxed);
        let last = owners.len() - 1;
        if i != last {
            owners.get(i).copy_from(owners.get(last));
        }
        if last == 0 {
            n.inline_owner.store(0, Ordering::Relaxed);
        } else {
            n.owners.set_len(n.owners.load(), last - 1);
        }
        Some((pos, last == 0))
    }

    /// Removes `tenant` from one of its leaves, freeing the node when nobody
    /// holds it any more (exclusive access).
    pub(super) fn unhold(&mut self, node: u32, tenant: u32) {
        let Some((pos, now_empty)) = self.drop_owner(node, tenant) else {
            return;
        };
        let view = self.node(node).view_owned();
        let (symbols, parent) = (u64::from(view.symbols), view.parent);
        let index = &mut self.tenants[tenant as usize];
        let list = index.nodes.get_mut();
        let pos = pos as usize;
        list.swap_remove(pos);
        let moved = list.get(pos).copied();
        let size = index.size.load(Ordering::Relaxed);
        index.size.store(size - symbols, Ordering::Relaxed);
        let emptied_list = list.is_empty();
        if emptied_list && list.capacity() > 0 {
            // An emptied list gives its memory back: a tenant that held
            // something in many shards once costs nothing there after.
            self.garbage.shrink(heap_bytes::<u32>(list.capacity()));
            *list = Vec::new();
        }
        self.garbage.accounts.held(tenant, -(symbols as i64), -1);
        if emptied_list {
            self.garbage.accounts.unmark(tenant, self.index);
        }
        if let Some(moved) = moved
            && let Some(o) = self.node(moved).owners_owned().owner(tenant)
        {
            o.pos.store(pos as u32, Ordering::Relaxed);
        }
        if parent != ROOT
            && let Some(o) = self.node(parent).owners_owned().owner(tenant)
        {
            o.add_held(-1);
        }
        if now_empty {
            // Nobody holds it, so (prefix closure) nobody holds a child: it is
            // a leaf of the tree. Unlink by identity, not by key.
            self.unlink(parent, node);
            self.release(node);
        }
    }

    /// Removes `node` from `parent`'s children (exclusive access).
    fn unlink(&mut self, parent: u32, node: u32) {
        let children = &self.node(parent).children;
        let raw = children.load();
        let items = self.node(parent).view_owned().children;
        let Some(i) = items
            .iter()
            .position(|e| e.load(Ordering::Relaxed) as u32 == node)
        else {
            return;
        };
        for j in i..items.len() - 1 {
            items[j].copy_from(&items[j + 1]);
        }
        children.set_len(raw, items.len() - 1);
    }

    /// Frees a slot for reuse (exclusive access).
    fn release(&mut self, slot: u32) {
        let Some(node) = self.nodes.get_mut(slot) else {
            return;
        };
        let bytes = NODE_BYTES + node.contents_bytes();
        node.free_contents();
        let generation = node.generation.load(Ordering::Relaxed).wrapping_add(1);
        node.generation.store(generation, Ordering::Relaxed);
        // Nobody can reach the slot, and no view of it outlives this
        // exclusive section, so its version restarts (see `Node::claim`).
        node.version.store(0, Ordering::Relaxed);
        self.slots.get_mut().free.push(slot);
        self.garbage.shrink(bytes);
    }
}
