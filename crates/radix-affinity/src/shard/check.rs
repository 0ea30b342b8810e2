//! The structural invariants of a shard, and recounts of its counters.

use super::memory::heap_bytes;
use super::owner::Owner;
use super::{NODE_BYTES, ROOT, Shard};
use crate::symbol::Unit;
use crate::sync::Ordering;

impl<U: Unit> Shard<U> {
    /// Every live node's owners, for recounts (any access).
    pub(crate) fn for_each_owner(&self, mut f: impl FnMut(u32, &Owner)) {
        for node in 1..self.slots_used() as u32 {
            let n = self.node(node);
            let symbols = n.view().symbols;
            for o in n.owners().iter() {
                f(symbols, o);
            }
        }
    }

    /// Checks every structural invariant and that the counters equal a
    /// recount (exclusive access, for a stable answer).
    pub(crate) fn check(&mut self) -> Result<(), String> {
        self.collect_garbage();
        let tenants = self.tenants.len();
        let mut recount = vec![0u64; tenants];
        let mut listed = vec![0usize; tenants];
        let mut reachable = 0usize;
        let mut bytes = 0u64;
        let mut stack = vec![ROOT];
        while let Some(idx) = stack.pop() {
            bytes += self.node(idx).contents_bytes();
            if idx != ROOT {
                bytes += NODE_BYTES;
            }
            let n = self.node(idx).view_owned();
            let owners = self.node(idx).owners_owned();
            let mut last_key = None;
            for (key, child) in n.child_nodes() {
                if child as usize >= self.slots_used() {
                    return Err(format!("node {idx}: child {child} out of the arena"));
                }
                let c = self.node(child).view_owned();
                if c.parent != idx {
                    return Err(format!(
                        "node {child}: parent {} but listed under {idx}",
                        c.parent
                    ));
                }
                if c.label.is_empty() || U::key(c.label) != key {
                    return Err(format!("node {child}: key {key} does not match its label"));
                }
                if last_key.is_some_and(|k| k >= key) {
                    return Err(format!("node {idx}: children not sorted"));
                }
                last_key = Some(key);
                stack.push(child);
            }
            if idx == ROOT {
                if !owners.is_empty() {
                    return Err("root has tenants".into());
                }
                continue;
            }
            reachable += 1;
            if owners.is_empty() {
                return Err(format!("node {idx} is held by nobody"));
            }
            if U::count_symbols(n.label) != n.symbols as usize {
                return Err(format!("node {idx}: symbol count"));
            }
            for o in owners.iter() {
                let t = o.tenant() as usize;
                if t >= tenants {
                    return Err(format!("node {idx}: tenant {t} has no counter"));
                }
                recount[t] += u64::from(n.symbols);
                listed[t] += 1;
                let pos = o.pos.load(Ordering::Relaxed) as usize;
                if self.tenants[t].nodes.lock().get(pos) != Some(&idx) {
                    return Err(format!("node {idx}: tenant {t} list position"));
                }
                let held = n
                    .child_nodes()
                    .filter(|&(_, c)| self.node(c).owners_owned().owner(o.tenant()).is_some())
                    .count();
                if held != o.held() as usize {
                    return Err(format!(
                        "node {idx}: tenant {t} held_children {} != {held}",
                        o.held()
                    ));
                }
                if n.parent != ROOT
                    && self
                        .node(n.parent)
                        .owners_owned()
                        .owner(o.tenant())
                        .is_none()
                {
                    return Err(format!(
                        "node {idx}: tenant {t} holds it but not its parent"
                    ));
                }
            }
        }
        let free = self.slots.lock().free.len();
        if reachable + 1 + free != self.slots_used() {
            return Err(format!(
                "{} slots, {reachable} reachable nodes, {free} free",
                self.slots_used()
            ));
        }
        for (t, index) in self.tenants.iter().enumerate() {
            let size = index.size.load(Ordering::Relaxed);
            if recount[t] != size {
                return Err(format!(
                    "tenant {t}: counter {size}, recount {}",
                    recount[t]
                ));
            }
            let list = index.nodes.lock();
            if listed[t] != list.len() {
                return Err(format!("tenant {t}: node list length"));
            }
            if list.capacity() > 0 {
                bytes += heap_bytes::<u32>(list.capacity());
            }
        }
        if bytes != self.garbage.live() {
            return Err(format!(
                "accounted {} bytes, recount {bytes}",
                self.garbage.live()
            ));
        }
        Ok(())
    }
}
