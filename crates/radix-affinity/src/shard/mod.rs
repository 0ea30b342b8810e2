//! One shard: the subtree of every text whose first symbol maps to it.
//!
//! Two kinds of access, chosen by the shard's lock (`tree.rs` lists which
//! operation takes which):
//!
//! - **Shared** (`&Shard`, under the shard lock's read side): lookups, and
//!   inserts, which lock only the nodes they change. Every node field is an
//!   atomic, and a reader takes a consistent [`View`] of a node by reading
//!   its fields between two equal even versions (below). Nothing is freed
//!   under shared access: label buffers live as long as their node, and the
//!   child and owner arrays a writer replaces when they grow are retired to
//!   a garbage list.
//! - **Exclusive** (`&mut Shard`, under the write side): eviction, tenant
//!   removal, growing the tenant table, and freeing retired arrays. These
//!   are the only places memory is freed, so a shared reader never sees
//!   freed memory; the borrow checker enforces it, since a [`View`] borrows
//!   the shard.
//!
//! # Node versions
//!
//! Every node field is an atomic, and each node has a version word: even while
//! nobody changes the node, odd while a writer holds it. A writer takes a node
//! by a compare-and-swap from even to odd, changes its fields, and stores the
//! next even value. A reader loads the version (waiting while it is odd), loads
//! the fields it needs, and loads the version again: if it is unchanged, the
//! fields form a consistent view (a sequence lock). Readers write no node field
//! but a last-use stamp, at most once a millisecond (see `clock.rs`), so a
//! lookup never waits for another lookup and does not make a hot node's cache
//! lines bounce. One step of a walk views the current node, finds the child for
//! the next symbol, checks that the current node's version is still the one it
//! viewed (the child array may be shifting in place under a writer, and a
//! search of a shifting array can miss a child that is there), views the child,
//! and checks that the child's parent is still the current node. If a check
//! fails it looks again from the current node, never from the root.
//!
//! # Why that is enough
//!
//! A node's end depth (the length of the text from the root to the end of its
//! label) never changes while it lives: a split keeps the lower part of the
//! label in the node and puts a new node above it. So the node a walk stands on
//! still ends where the walk thinks, whatever happened above it; an unchanged
//! version means the child entry read is one the node really had; and a child
//! whose parent is still that node holds the label that continues it (a split
//! changes label and parent together, under the child's lock). Nodes are freed
//! only under the exclusive lock, so a node index a walk holds stays that node.
//!
//! # What an insert locks
//!
//! An insert walks like a lookup and locks only where it changes something: the
//! parent of a new leaf (its child array); a node that gains the tenant as an
//! owner, and that node's parent (its count of held children); a node it splits
//! and that node's parent (whose entry moves to the new node). Locks are taken
//! parent first. The child is taken only at the version the walk viewed, by a
//! compare-and-swap that does not wait: if the child changed, the insert looks
//! again. So no thread waits for a node lock while holding another, and there
//! is no deadlock. A new node is claimed with a plain store before it is
//! linked, since nobody can reach it yet. Inside node locks an insert takes
//! three small mutexes of the shard, innermost and each for one push: the
//! free-slot list, the tenant's node list (with its size) and the list of
//! retired arrays. [`LockWaits::retries`](crate::LockWaits::retries) counts the
//! steps inserts repeated.
//!
//! # What a racing lookup can see
//!
//! Every node change is atomic, and an insert becomes visible top-down, one
//! node at a time: a lookup racing an insert may see the tenant already holding
//! a prefix of the new text (its upper nodes) before the whole of it. Lookups
//! never see a tenant holding a node whose parent it does not hold, a label
//! that does not belong under its parent, or a counter that disagrees with the
//! nodes once the inserts have returned.
//!
//! # Reclamation
//!
//! Nothing is freed while the shard is shared. Label bytes are never written
//! after a label is made (a split narrows ranges and copies the shorter
//! side), and a label buffer lives as long as the node that owns it. A child
//! or owner array that has to grow is copied into a new one and the old one
//! is retired to the shard's list, freed under the exclusive lock once the
//! list holds 4 KiB ([`GARBAGE_LIMIT`]; or at the next eviction or growth).
//! The borrow checker enforces the rule: a node view borrows the shard, and
//! freeing needs it mutably. Growing the node arena moves nothing
//! (`seg.rs`), so it needs no exclusive lock.
//!
//! Arrays and the tenants' node lists grow into new buffers from the
//! writer's own allocator arena, never by `realloc`: with glibc's malloc,
//! growing a buffer another thread allocated takes that thread's arena lock.
//!
//! # Eviction
//!
//! Eviction never acts on what it collected without re-validating it under
//! the exclusive lock ([`Shard::evict`]): the slot's generation, that the
//! tenant still holds the node, that it is still the tenant's leaf, and that
//! its stamp has not moved (if it has, the candidate goes back into the
//! heap with the new stamp). Nodes are unlinked by index
//! ([`Shard::unlink`]), never by first character, so a split racing an
//! eviction cannot make it drop the wrong subtree.
//!
//! # Modules
//!
//! - `memory`: what a shard allocates and accounts, retired arrays, and the
//!   growable arrays of a node.
//! - `owner`: a tenant's hold on a node, and a node's list of them.
//! - `node`: the node, its versions and views, and its lock.
//! - `walk`: lookups: the walk, one step of it, touching a path.
//! - `insert`: inserts under node locks, and splits.
//! - `evict`: eviction candidates, and eviction under exclusive access.
//! - `remove`: removal of a tenant's holds.
//! - `check`: the structural invariants, and recounts.

mod check;
mod evict;
mod insert;
mod memory;
mod node;
mod owner;
mod remove;
mod walk;

#[cfg(test)]
mod tests;

use std::sync::Arc;

use crate::budget::Accounts;
use crate::heap::Block;
use crate::seg::Segmented;
use crate::symbol::Unit;
use crate::sync::{AtomicU64, Mutex, Ordering};

pub(crate) use evict::{Candidate, Evicted};
pub(crate) use insert::Inserted;
use memory::{Ledger, heap_bytes};
use node::Node;
#[cfg(doc)]
use node::View;

/// Index of the shard's root (empty label, never freed, owned by nobody).
pub(crate) const ROOT: u32 = 0;

/// Longest label a single new node gets; longer inserts become a chain, which
/// keeps symbol counts within `u32`.
pub(crate) const LABEL_MAX: usize = 1 << 28;

/// Retired arrays are freed once a shard holds this many bytes of them.
const GARBAGE_LIMIT: u64 = 4 << 10;

/// Accounted bytes of a node's slot (two cache lines).
pub(crate) const NODE_BYTES: u64 = std::mem::size_of::<Node<u8>>() as u64;

/// Per-tenant bookkeeping of a shard.
#[derive(Debug)]
pub(crate) struct TenantIndex {
    /// Symbols the tenant holds in this shard.
    size: AtomicU64,
    /// Nodes the tenant holds in this shard; what makes eviction and removal
    /// cost proportional to what the tenant holds.
    nodes: Mutex<Vec<u32>>,
}

impl TenantIndex {
    fn new() -> Self {
        Self {
            size: AtomicU64::new(0),
            nodes: Mutex::new(Vec::new()),
        }
    }

    /// Appends `node`, which adds `symbols` to the tenant's size, returning
    /// its position. `tenant` and `shard` name the list for the tree's
    /// accounts.
    fn push(&self, node: u32, symbols: u32, tenant: u32, shard: u32, ledger: &Ledger) -> u32 {
        let mut nodes = self.nodes.lock();
        // Under the list's lock, so a plain add (no locked instruction).
        let size = self.size.load(Ordering::Relaxed);
        self.size
            .store(size + u64::from(symbols), Ordering::Relaxed);
        ledger.accounts.held(tenant, i64::from(symbols), 1);
        if nodes.is_empty() {
            ledger.accounts.mark(tenant, shard);
        }
        if nodes.len() == nodes.capacity() {
            // Allocate the larger list from this thread's allocator arena
            // instead of `realloc`ing a buffer another thread allocated, which
            // takes that thread's arena lock (a futex wait when contended).
            let mut grown = Vec::with_capacity((nodes.capacity() * 2).max(8));
            grown.extend_from_slice(&nodes);
            if nodes.capacity() > 0 {
                ledger.shrink(heap_bytes::<u32>(nodes.capacity()));
            }
            ledger.grow(heap_bytes::<u32>(grown.capacity()));
            *nodes = grown;
        }
        nodes.push(node);
        (nodes.len() - 1) as u32
    }

    /// Up to `max` of the nodes listed, all of them when there are at most
    /// `max`, else from `max` positions drawn with `rng`.
    fn sample(&self, max: usize, rng: &mut u64, out: &mut Vec<u32>) {
        let nodes = self.nodes.lock();
        if nodes.len() <= max {
            out.extend_from_slice(&nodes);
            return;
        }
        for _ in 0..max {
            out.push(nodes[crate::budget::draw(rng, nodes.len())]);
        }
    }
}

/// Free slots and the first never-used one.
#[derive(Debug)]
struct Slots {
    free: Vec<u32>,
    next: u32,
}

#[derive(Debug)]
pub(crate) struct Shard<U> {
    /// The node arena: chunks that never move, so it grows under shared
    /// access (the slots' lock serializes growth).
    nodes: Segmented<Node<U>>,
    slots: Mutex<Slots>,
    tenants: Vec<TenantIndex>,
    garbage: Ledger,
    /// This shard's position in the tree.
    index: u32,
}

impl<U> Drop for Shard<U> {
    fn drop(&mut self) {
        let used = self.slots.get_mut().next;
        for slot in 0..used {
            if let Some(node) = self.nodes.get_mut(slot) {
                node.free_contents();
            }
        }
        // A dropped tree gives its bytes back to a shared budget.
        let live = self.garbage.live();
        self.garbage.shrink(live);
        let entries: usize = self
            .tenants
            .iter_mut()
            .map(|t| t.nodes.get_mut().len())
            .sum();
        self.garbage.accounts.entries_dropped(entries as u64);
    }
}

/// A chunk of `len` empty nodes.
fn node_chunk<U: Unit>(len: usize) -> Block<Node<U>> {
    // SAFETY: an all-zero node is `Node::empty(0)`: every field is an atomic
    // integer (0) or an atomic pointer (null). A large zeroed block is fresh
    // pages, so slots not used yet cost no resident memory.
    #[cfg(not(loom))]
    return unsafe { Block::zeroed(len) };
    #[cfg(loom)]
    Block::from_fn(len, |_| Node::empty(0))
}

impl<U: Unit> Shard<U> {
    pub(crate) fn new(index: u32, accounts: Arc<Accounts>) -> Self {
        let nodes = Segmented::new();
        nodes.grow_to(ROOT, node_chunk::<U>);
        Self {
            nodes,
            slots: Mutex::new(Slots {
                free: Vec::new(),
                next: ROOT + 1,
            }),
            tenants: Vec::new(),
            garbage: Ledger::new(accounts),
            index,
        }
    }

    #[inline]
    pub(crate) fn node(&self, index: u32) -> &Node<U> {
        self.nodes
            .get(index)
            .expect("node indices come from slots handed out, whose chunks exist")
    }

    /// Slots in use or freed (the arena's high-water mark).
    pub(crate) fn slots_used(&self) -> usize {
        self.slots.lock().next as usize
    }

    #[inline]
    pub(crate) fn size_of(&self, tenant: u32) -> u64 {
        self.tenants
            .get(tenant as usize)
            .map_or(0, |t| t.size.load(Ordering::Relaxed))
    }

    /// Sizes of every tenant this shard knows, indexed by tenant id.
    pub(crate) fn sizes(&self) -> impl Iterator<Item = u64> + '_ {
        self.tenants.iter().map(|t| t.size.load(Ordering::Relaxed))
    }

    /// Makes room for an insert of `tenant` (exclusive access): a tenant
    /// table that covers it. Also frees the retired arrays.
    pub(crate) fn make_room(&mut self, tenant: u32) {
        let need = tenant as usize + 1;
        if self.tenants.len() < need {
            self.tenants.resize_with(need, TenantIndex::new);
        }
        self.collect_garbage();
    }

    /// Frees every retired array (exclusive access: no reader can hold one).
    pub(crate) fn collect_garbage(&mut self) {
        self.garbage.free();
    }
}
