//! Removal of a tenant's holds, deepest first.

use super::{ROOT, Shard};
use crate::symbol::Unit;
use crate::sync::Ordering;

/// One hold of a tenant on a node, to remove (see
/// [`Shard::holds_deepest_first`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hold {
    depth: u64,
    node: u32,
    generation: u32,
}

impl<U: Unit> Shard<U> {
    /// Forgets everything `tenant` holds here; returns the symbols removed
    /// (exclusive access, in one go: the tree removes in bounded batches
    /// with [`Shard::holds_deepest_first`] and [`Shard::remove_holds`]).
    #[cfg(test)]
    pub(crate) fn remove_tenant(&mut self, tenant: u32) -> u64 {
        let before = self.size_of(tenant);
        loop {
            let holds = self.holds_deepest_first(tenant);
            if holds.is_empty() || self.remove_holds(tenant, &holds) == 0 {
                return before - self.size_of(tenant);
            }
        }
    }

    /// `tenant`'s holds here as (end depth, node, generation), deepest
    /// first: removed in this order, each is the tenant's leaf when its turn
    /// comes (shared access).
    pub(crate) fn holds_deepest_first(&self, tenant: u32) -> Vec<Hold> {
        let Some(index) = self.tenants.get(tenant as usize) else {
            return Vec::new();
        };
        let nodes = index.nodes.lock().clone();
        let mut holds: Vec<Hold> = nodes
            .into_iter()
            .map(|node| {
                let mut depth = 0u64;
                let mut at = node;
                while at != ROOT {
                    let view = self.node(at).view();
                    depth += u64::from(view.symbols);
                    at = view.parent;
                }
                let generation = self.node(node).generation.load(Ordering::Relaxed);
                Hold {
                    depth,
                    node,
                    generation,
                }
            })
            .collect();
        holds.sort_unstable_by_key(|hold| std::cmp::Reverse(hold.depth));
        holds
    }

    /// Removes `tenant`'s hold on each node of `holds` that is still its
    /// leaf (exclusive access); skips the ones that changed meanwhile.
    /// Returns how many it removed.
    pub(crate) fn remove_holds(&mut self, tenant: u32, holds: &[Hold]) -> usize {
        let mut removed = 0;
        for hold in holds {
            if hold.node == ROOT || hold.node as usize >= self.slots_used() {
                continue;
            }
            let n = self.node(hold.node);
            if n.generation.load(Ordering::Relaxed) != hold.generation {
                continue;
            }
            if n.owners_owned()
                .owner(tenant)
                .is_some_and(|o| o.held() == 0)
            {
                self.unhold(hold.node, tenant);
                removed += 1;
            }
        }
        removed
    }
}
