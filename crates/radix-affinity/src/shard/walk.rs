//! Lookups under shared access: the walk and one step of it.

use super::node::{Node, View};
use super::{ROOT, Shard};
use crate::symbol::{Probe, Unit};
use crate::sync::Ordering;

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

impl<U: Unit> Shard<U> {
    /// Follows `probe` down from the root while `follow` accepts the node.
    #[inline]
    pub(crate) fn walk<P: Probe<U>>(
        &self,
        probe: &P,
        follow: impl Fn(&Node<U>) -> bool,
    ) -> WalkEnd {
        self.walk_visiting(probe, follow, |_, _| {})
    }

    /// [`walk`](Self::walk), calling `visit(node, matched)` for every node
    /// it enters, with the symbols matched up to and including that node's
    /// part of the probe (a partly matched last node counts its matched
    /// part), shallowest first.
    #[inline]
    pub(crate) fn walk_visiting<P: Probe<U>>(
        &self,
        probe: &P,
        follow: impl Fn(&Node<U>) -> bool,
        mut visit: impl FnMut(&Node<U>, usize),
    ) -> WalkEnd {
        let mut node = ROOT;
        let mut pos = 0;
        let mut matched = 0;
        let mut known = None;
        while !probe.at_end(pos) {
            let Some((child, view)) = self.step(node, known, probe.key_at(pos)).0 else {
                break;
            };
            known = Some(view);
            if !follow(self.node(child)) {
                break;
            }
            let step = probe.match_label(pos, view.label, view.symbols as usize);
            matched += step.symbols;
            visit(self.node(child), matched);
            node = child;
            pos += step.advance;
            if step.label_units < view.label.len() {
                break;
            }
        }
        WalkEnd { node, matched, pos }
    }

    /// The child of `node` for `key` and a view of it in which `node` is its
    /// parent, i.e. whose label follows `node`'s; plus how many times a
    /// change under the reader made it look again. `known` is a view of
    /// `node` already taken (the previous step's child), if any.
    ///
    /// Why this is enough: a node's end depth never changes (a split keeps
    /// the lower part of the label in the node and puts a new node above it),
    /// so `node` still ends where the walk stands; its child array is trusted
    /// only when its version did not change while it was read; and a child
    /// whose parent is still `node` has not been split since.
    #[inline(always)]
    pub(super) fn step<'a>(
        &'a self,
        node: u32,
        mut known: Option<View<'a, U>>,
        key: u32,
    ) -> (Option<(u32, View<'a, U>)>, u32) {
        let current = self.node(node);
        let mut retries = 0;
        loop {
            let view = known.take().unwrap_or_else(|| current.view());
            let child = view.child(key);
            if !current.unchanged_since(&view) {
                retries += 1;
                continue;
            }
            let Some(child) = child else {
                return (None, retries);
            };
            let child_view = self.node(child).view();
            if child_view.parent != node {
                retries += 1;
                continue;
            }
            return (Some((child, child_view)), retries);
        }
    }

    /// Refreshes `tenant`'s stamp on `node` and all its ancestors.
    #[inline]
    pub(crate) fn touch_path(&self, mut node: u32, tenant: u32, now: u64) {
        while node != ROOT {
            let n = self.node(node);
            if let Some(o) = n.owners().owner(tenant) {
                o.touch(now);
            }
            // A parent index alone is always some ancestor (a split puts the
            // new node between), so it needs no consistent view; Acquire
            // pairs with the split's store, so the new node's chunk is seen.
            node = n.parent.load(Ordering::Acquire);
        }
    }

    /// Refreshes `tenant`'s stamp on `node` and all its ancestors if it
    /// holds `node` (one search of `node`'s owners); returns whether it
    /// does.
    #[inline]
    pub(crate) fn touch_held(&self, node: u32, tenant: u32, now: u64) -> bool {
        if node == ROOT {
            return false;
        }
        let n = self.node(node);
        let Some(o) = n.owners().owner(tenant) else {
            return false;
        };
        o.touch(now);
        self.touch_path(n.parent.load(Ordering::Acquire), tenant, now);
        true
    }

    /// The units from the root to the end of `node`'s label (exclusive
    /// access; for the model tests' eviction log).
    pub(crate) fn path(&self, mut node: u32) -> Vec<U> {
        let mut labels = Vec::new();
        while node != ROOT {
            let view = self.node(node).view_owned();
            labels.push(view.label);
            node = view.parent;
        }
        labels.into_iter().rev().flatten().copied().collect()
    }
}
