//! Inserts under shared access, locking only the nodes they change.

use super::memory::heap_bytes;
use super::node::{NodeGuard, child_entry};
use super::{LABEL_MAX, NODE_BYTES, ROOT, Shard, node_chunk};
use crate::heap::Block;
use crate::symbol::{Probe, Unit};
use crate::sync::Ordering;

/// Outcome of an insert under shared access.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Inserted {
    /// Done. `retries` counts the steps repeated because a node changed
    /// under them; `collect` asks the caller to free retired arrays.
    Done { retries: u32, collect: bool },
    /// The arena has no free slot or the tenant table does not cover the
    /// tenant: call [`Shard::make_room`] under exclusive access and insert
    /// again (what was done so far stays valid).
    NeedRoom { retries: u32 },
}

impl<U: Unit> Shard<U> {
    /// Takes a free slot, or `None` when the arena is full.
    fn alloc(&self) -> Option<u32> {
        let slot = {
            let mut slots = self.slots.lock();
            match slots.free.pop() {
                Some(slot) => slot,
                None => {
                    let next = slots.next;
                    // 2^32 slots would be 512 GiB of nodes: a full arena
                    // only stops growing the tree.
                    slots.next = next.checked_add(1)?;
                    // A new chunk is allocated, never a move of the old
                    // ones: growth needs no exclusive lock.
                    self.nodes.grow_to(next, node_chunk::<U>);
                    next
                }
            }
        };
        self.garbage.grow(NODE_BYTES);
        Some(slot)
    }

    /// Records `tenant`'s hold on the locked `node`, which has `symbols`
    /// symbols.
    fn hold(&self, guard: &NodeGuard<'_, U>, node: u32, tenant: u32, held: u32, now: u64) {
        let symbols = guard.view().symbols;
        let pos =
            self.tenants[tenant as usize].push(node, symbols, tenant, self.index, &self.garbage);
        guard.add_owner(tenant, pos, held, now, &self.garbage);
    }

    /// Adds one to `tenant`'s count of held children on the locked node.
    fn count_child(&self, guard: &NodeGuard<'_, U>, tenant: u32) {
        if let Some(o) = guard.node.owners_owned().owner(tenant) {
            o.add_held(1);
        }
    }

    /// Records that `tenant` uses the text of `probe` at `now`, locking only
    /// the nodes it changes (shared access).
    pub(crate) fn insert<P: Probe<U>>(&self, probe: &P, tenant: u32, now: u64) -> Inserted {
        let mut retries = 0;
        if self.tenants.len() <= tenant as usize {
            return Inserted::NeedRoom { retries };
        }
        let mut node = ROOT;
        let mut pos = 0;
        // The rest of the text as a new leaf, copied before any lock is
        // taken and kept across retries at the same position.
        let mut leaf: Option<(usize, NewLeaf<U>)> = None;
        // A view of `node` from the previous step, unless that step changed it.
        let mut known = None;
        while !probe.at_end(pos) {
            let key = probe.key_at(pos);
            let (found, looked_again) = self.step(node, known.take(), key);
            retries += looked_again;
            let current = self.node(node);
            let Some((child, view)) = found else {
                if leaf.as_ref().is_none_or(|(at, _)| *at != pos) {
                    leaf = Some((pos, NewLeaf::from_rest(probe, pos)));
                }
                let guard = current.lock();
                if guard.view().child(key).is_some() {
                    // Another insert added this edge meanwhile.
                    retries += 1;
                    continue;
                }
                let Some(slot) = self.alloc() else {
                    return Inserted::Done {
                        retries,
                        collect: false,
                    };
                };
                let new = match leaf.take() {
                    Some((_, new)) => new,
                    None => NewLeaf::from_rest(probe, pos),
                };
                let (advance, created) = (new.advance, self.node(slot));
                {
                    // Stores only: the new node's line is cold.
                    let _claimed = created.claim();
                    created.parent.store(node, Ordering::Relaxed);
                    created.symbols.store(new.symbols, Ordering::Relaxed);
                    let len = new.label.len();
                    self.garbage.grow(heap_bytes::<U>(len));
                    let buf = new.label.into_raw();
                    created.set_label(buf, len, 0, len);
                    let pos = self.tenants[tenant as usize].push(
                        slot,
                        new.symbols,
                        tenant,
                        self.index,
                        &self.garbage,
                    );
                    created.set_first_owner(tenant, pos, 0, now);
                }
                guard.add_child(key, slot, &self.garbage);
                if node != ROOT {
                    self.count_child(&guard, tenant);
                }
                drop(guard);
                node = slot;
                pos += advance;
                continue;
            };
            let step = probe.match_label(pos, view.label, view.symbols as usize);
            let c = self.node(child);
            if step.label_units == view.label.len() {
                if let Some(o) = c.owners().owner(tenant) {
                    o.touch(now);
                    known = Some(view);
                } else {
                    // The parent's count of held children changes too;
                    // locks go parent first, as everywhere.
                    let parent = (node != ROOT).then(|| current.lock());
                    let Some(guard) = c.lock_at(view.version) else {
                        retries += 1;
                        continue;
                    };
                    self.hold(&guard, child, tenant, 0, now);
                    if let Some(parent) = &parent {
                        self.count_child(parent, tenant);
                    }
                }
            } else {
                let parent = current.lock();
                let Some(guard) = c.lock_at(view.version) else {
                    retries += 1;
                    continue;
                };
                let Some(mid) = self.alloc() else {
                    return Inserted::Done {
                        retries,
                        collect: false,
                    };
                };
                self.split(
                    &parent,
                    node,
                    &guard,
                    child,
                    mid,
                    step.label_units,
                    step.symbols as u32,
                    tenant,
                    now,
                );
                pos += step.advance;
                node = mid;
                continue;
            }
            node = child;
            pos += step.advance;
        }
        let collect = self.garbage.over_limit();
        Inserted::Done { retries, collect }
    }

    /// Cuts the locked `child` after `units` units (`symbols` symbols) and
    /// puts the new node `mid` above it, below the locked `parent`. Owners
    /// and stamps are copied to `mid`, so sizes are unchanged; `tenant` is
    /// added to `mid` if it did not hold `child`.
    #[allow(clippy::too_many_arguments)]
    fn split(
        &self,
        parent: &NodeGuard<'_, U>,
        parent_index: u32,
        guard: &NodeGuard<'_, U>,
        child: u32,
        mid: u32,
        units: usize,
        symbols: u32,
        tenant: u32,
        now: u64,
    ) {
        let c = guard.node;
        let view = guard.view();
        let key = U::key(view.label);
        let lower_key = U::key(&view.label[units..]);
        let m = self.node(mid);
        let mid_guard = m.claim();
        m.parent.store(parent_index, Ordering::Relaxed);
        m.symbols.store(symbols, Ordering::Relaxed);
        // Copy only the shorter side; the longer keeps the buffer, with its
        // range narrowed. The common case is a new text branching a few
        // characters into an earlier one's suffix: the upper part is short.
        let buf = c.label.load(Ordering::Relaxed);
        let cap = c.label_cap.load(Ordering::Relaxed) as usize;
        let range = c.range.load(Ordering::Relaxed);
        let (start, end) = ((range & 0xffff_ffff) as usize, (range >> 32) as usize);
        let cut = start + units;
        if units <= view.label.len() - units {
            let upper = Block::copied(&view.label[..units]);
            let upper_len = upper.len();
            self.garbage.grow(heap_bytes::<U>(upper_len));
            m.set_label(upper.into_raw(), upper_len, 0, upper_len);
            c.set_label(buf, cap, cut, end);
        } else {
            let lower = Block::copied(&view.label[units..]);
            let lower_len = lower.len();
            self.garbage.grow(heap_bytes::<U>(lower_len));
            m.set_label(buf, cap, start, cut);
            c.set_label(lower.into_raw(), lower_len, 0, lower_len);
        }
        c.symbols.store(view.symbols - symbols, Ordering::Relaxed);
        // Release: a lookup that follows this parent index without a
        // consistent view of `c` (`touch_path`) must also see the chunk the
        // new node lives in, published before.
        c.parent.store(mid, Ordering::Release);
        // A claimed node has no children and no owners yet.
        m.child_slots[0].store(child_entry(lower_key, child), Ordering::Relaxed);
        m.children.meta.store(1, Ordering::Relaxed);
        let mut held_child = false;
        for (i, o) in c.owners_owned().iter().enumerate() {
            let t = o.tenant();
            // The inserting tenant uses the upper part now.
            let stamp = if t == tenant {
                held_child = true;
                o.stamp().max(now)
            } else {
                o.stamp()
            };
            // Copies: the tenant's size does not change.
            let pos = self.tenants[t as usize].push(mid, 0, t, self.index, &self.garbage);
            if i == 0 {
                m.set_first_owner(t, pos, 1, stamp);
            } else {
                mid_guard.add_owner(t, pos, 1, stamp, &self.garbage);
            }
        }
        if !held_child {
            self.hold(&mid_guard, mid, tenant, 0, now);
            if parent_index != ROOT {
                self.count_child(parent, tenant);
            }
        }
        drop(mid_guard);
        parent.replace_child(key, mid);
    }
}

/// A new leaf's label, built before any lock is taken.
#[derive(Debug)]
struct NewLeaf<U> {
    label: Block<U>,
    symbols: u32,
    /// Probe units the label covers (at most [`LABEL_MAX`]; a longer rest
    /// becomes a chain of leaves).
    advance: usize,
}

impl<U: Unit> NewLeaf<U> {
    fn from_rest<P: Probe<U>>(probe: &P, pos: usize) -> Self {
        let mut label = Vec::new();
        let step = probe.take_rest(pos, LABEL_MAX, &mut label);
        Self {
            label: Block::copied(&label),
            symbols: step.symbols as u32,
            advance: step.advance,
        }
    }
}
