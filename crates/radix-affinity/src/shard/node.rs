//! A node: its fields, its version word, consistent views of it, and its
//! lock.

use super::ROOT;
use super::memory::{Array, Item, Ledger, RawArray, heap_bytes};
use super::owner::{Owner, Owners};
use crate::heap::Block;
use crate::symbol::Unit;
use crate::sync::Backoff;
use crate::sync::{AtomicPtr, AtomicU32, AtomicU64, Ordering, fence};

/// Packs a child entry so that entries sort by key.
#[inline]
pub(super) fn child_entry(key: u32, node: u32) -> u64 {
    (u64::from(key) << 32) | u64::from(node)
}

/// A node. Every field is atomic; see the module docs for the protocol.
///
/// Two cache lines: the first holds everything a walk reads (version,
/// parent, symbol count, label, up to two children inline), the second the
/// owners.
#[derive(Debug)]
#[repr(C, align(128))]
pub(crate) struct Node<U> {
    /// Even: nobody changes the node; odd: a writer holds its lock.
    pub(super) version: AtomicU32,
    pub(super) parent: AtomicU32,
    /// Symbols in the label.
    pub(super) symbols: AtomicU32,
    /// 1 when `owner` is valid.
    pub(super) inline_owner: AtomicU32,
    /// The label is `label[start..end]`, start in the low half, end in the
    /// high half.
    pub(super) range: AtomicU64,
    /// Buffer holding the label (units outside the range are dead, see
    /// `split`); immutable while the node lives.
    pub(super) label: AtomicPtr<U>,
    /// The children while there are at most two and `children` has no
    /// array.
    pub(super) child_slots: [AtomicU64; 2],
    /// `(first symbol of the child's label, child index)`, sorted by key:
    /// the length counts every child; the array exists once a third child
    /// was added.
    pub(super) children: Array<AtomicU64>,
    /// The first owner, inline (most nodes have one); valid when
    /// `inline_owner` is 1.
    pub(super) owner: Owner,
    /// Owners after the first.
    pub(super) owners: Array<Owner>,
    /// Bumped whenever the slot is freed, so stale eviction candidates are
    /// recognised after the slot is reused.
    pub(super) generation: AtomicU32,
    /// Length of the label buffer, to free it.
    pub(super) label_cap: AtomicU32,
}

/// A consistent snapshot of a node, valid while the shard is borrowed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct View<'a, U> {
    pub(super) version: u32,
    pub(crate) parent: u32,
    pub(crate) symbols: u32,
    pub(crate) label: &'a [U],
    pub(super) children: &'a [AtomicU64],
}

impl<'a, U> View<'a, U> {
    /// The child whose label starts with `key`. Entries may be changing
    /// under a reader: the caller must check that the node's version is
    /// still this view's before trusting the answer.
    #[inline]
    pub(crate) fn child(&self, key: u32) -> Option<u32> {
        let (mut lo, mut hi) = (0, self.children.len());
        // Most nodes have a handful of children; the few wide ones (a system
        // prompt followed by many user suffixes) are still a binary search.
        while lo < hi {
            let mid = (lo + hi) / 2;
            let entry = self.children[mid].load(Ordering::Relaxed);
            match ((entry >> 32) as u32).cmp(&key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(entry as u32),
            }
        }
        None
    }

    /// Child indices, in key order.
    pub(crate) fn child_nodes(&self) -> impl Iterator<Item = (u32, u32)> + 'a {
        self.children.iter().map(|e| {
            let entry = e.load(Ordering::Relaxed);
            ((entry >> 32) as u32, entry as u32)
        })
    }
}

impl<U: Unit> Node<U> {
    /// An empty node (what a zeroed chunk holds; see `node_chunk`).
    #[cfg(any(loom, test))]
    pub(super) fn empty(generation: u32) -> Self {
        Self {
            version: AtomicU32::new(0),
            parent: AtomicU32::new(ROOT),
            symbols: AtomicU32::new(0),
            generation: AtomicU32::new(generation),
            range: AtomicU64::new(0),
            label: AtomicPtr::new(std::ptr::null_mut()),
            child_slots: [AtomicU64::new(0), AtomicU64::new(0)],
            children: Array::empty(),
            owner: Owner::blank(),
            owners: Array::empty(),
            label_cap: AtomicU32::new(0),
            inline_owner: AtomicU32::new(0),
        }
    }

    /// A consistent snapshot, waiting out a writer that is changing the node.
    #[inline]
    pub(crate) fn view(&self) -> View<'_, U> {
        let mut backoff = Backoff::default();
        loop {
            let version = self.version.load(Ordering::Acquire);
            if version & 1 == 1 {
                backoff.snooze();
                continue;
            }
            let fields = self.load_fields();
            fence(Ordering::Acquire);
            if self.version.load(Ordering::Relaxed) == version {
                // SAFETY: read between two equal even versions, so no writer
                // changed the node meanwhile and the fields are consistent.
                return unsafe { fields.into_view(version) };
            }
        }
    }

    /// Whether the node is unchanged since `view` was taken.
    #[inline]
    pub(crate) fn unchanged_since(&self, view: &View<'_, U>) -> bool {
        fence(Ordering::Acquire);
        self.version.load(Ordering::Relaxed) == view.version
    }

    #[inline]
    fn load_fields(&self) -> Fields<'_, U> {
        Fields {
            parent: self.parent.load(Ordering::Relaxed),
            symbols: self.symbols.load(Ordering::Relaxed),
            range: self.range.load(Ordering::Relaxed),
            label: self.label.load(Ordering::Relaxed),
            children: self.children.load(),
            child_slots: &self.child_slots,
        }
    }

    /// A consistent snapshot of the owners (a reader's second look at the
    /// node, on its second cache line, taken only when owners matter).
    #[inline]
    pub(crate) fn owners(&self) -> Owners<'_> {
        let mut backoff = Backoff::default();
        loop {
            let version = self.version.load(Ordering::Acquire);
            if version & 1 == 1 {
                backoff.snooze();
                continue;
            }
            let inline = self.inline_owner.load(Ordering::Relaxed) == 1;
            let rest = self.owners.load();
            fence(Ordering::Acquire);
            if self.version.load(Ordering::Relaxed) == version {
                // SAFETY: read between two equal even versions.
                return unsafe { self.owners_from(inline, rest) };
            }
        }
    }

    /// The owners, with the lock held or under exclusive access.
    pub(super) fn owners_owned(&self) -> Owners<'_> {
        let inline = self.inline_owner.load(Ordering::Relaxed) == 1;
        // SAFETY: nobody else writes the node, so the fields are consistent.
        unsafe { self.owners_from(inline, self.owners.load()) }
    }

    /// # Safety
    ///
    /// `rest` must be consistent with the node (see [`RawArray::items`]).
    #[inline]
    unsafe fn owners_from(&self, inline: bool, rest: RawArray<Owner>) -> Owners<'_> {
        Owners {
            first: inline.then_some(&self.owner),
            // An array without an inline owner before it is empty.
            rest: if inline {
                // SAFETY: forwarded from this function's contract; arrays
                // are freed only under exclusive access, which the borrow of
                // the node (and so of the shard) excludes.
                unsafe { rest.items() }
            } else {
                &[]
            },
        }
    }

    /// Waits for and takes the node's lock.
    pub(super) fn lock(&self) -> NodeGuard<'_, U> {
        let mut backoff = Backoff::default();
        loop {
            let version = self.version.load(Ordering::Relaxed);
            if let Some(guard) = self.lock_at(version) {
                return guard;
            }
            backoff.snooze();
        }
    }

    /// Takes the node's lock if its version is still `version` (even).
    pub(super) fn lock_at(&self, version: u32) -> Option<NodeGuard<'_, U>> {
        if version & 1 == 1 {
            return None;
        }
        self.version
            .compare_exchange(version, version + 1, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        // Orders the odd version before the field stores that follow, so a
        // reader that sees any of them also sees the version change.
        fence(Ordering::Release);
        Some(NodeGuard {
            node: self,
            version: version + 1,
        })
    }

    /// Locks a node that was just taken from the free slots, which nobody
    /// else can reach (its version is 0: see `Shard::release`), with a store
    /// instead of a compare-and-swap: a new node's cache line is usually
    /// cold, and a locked instruction would wait for it.
    pub(super) fn claim(&self) -> NodeGuard<'_, U> {
        self.version.store(1, Ordering::Relaxed);
        fence(Ordering::Release);
        NodeGuard {
            node: self,
            version: 1,
        }
    }

    /// Makes a claimed node's first owner `tenant` (the node has none).
    pub(super) fn set_first_owner(&self, tenant: u32, pos: u32, held: u32, stamp: u64) {
        self.owner.set(tenant, pos, held, stamp);
        self.inline_owner.store(1, Ordering::Relaxed);
    }

    /// The fields, read with the lock held or under exclusive access.
    pub(super) fn view_owned(&self) -> View<'_, U> {
        // SAFETY: nobody else writes the node (the caller holds its lock or
        // has exclusive access), so the fields are consistent.
        unsafe { self.load_fields().into_view(0) }
    }
}

impl<U> Node<U> {
    pub(super) fn set_label(&self, buf: *mut U, cap: usize, start: usize, end: usize) {
        self.label.store(buf, Ordering::Relaxed);
        self.label_cap.store(cap as u32, Ordering::Relaxed);
        self.range
            .store((start as u64) | ((end as u64) << 32), Ordering::Relaxed);
    }

    /// Accounted bytes of the label and arrays the node owns.
    pub(super) fn contents_bytes(&self) -> u64 {
        let mut bytes = 0;
        if !self.label.load(Ordering::Relaxed).is_null() {
            bytes += heap_bytes::<U>(self.label_cap.load(Ordering::Relaxed) as usize);
        }
        let children = self.children.load();
        if !children.ptr.is_null() {
            bytes += heap_bytes::<AtomicU64>(children.cap());
        }
        let owners = self.owners.load();
        if !owners.ptr.is_null() {
            bytes += heap_bytes::<Owner>(owners.cap());
        }
        bytes
    }

    /// Frees the label and arrays and resets the node (exclusive access).
    pub(super) fn free_contents(&mut self) {
        let buf = self.label.load(Ordering::Relaxed);
        let cap = self.label_cap.load(Ordering::Relaxed) as usize;
        if !buf.is_null() {
            // SAFETY: exclusive access; the buffer is this node's boxed slice
            // of `cap` units and no other node refers to it.
            drop(unsafe { Block::from_raw(buf, cap) });
        }
        self.set_label(std::ptr::null_mut(), 0, 0, 0);
        self.children.free();
        self.owners.free();
        self.inline_owner.store(0, Ordering::Relaxed);
        self.symbols.store(0, Ordering::Relaxed);
        self.parent.store(ROOT, Ordering::Relaxed);
    }
}

/// A node's fields as loaded, before they are known to be consistent.
struct Fields<'n, U> {
    parent: u32,
    symbols: u32,
    range: u64,
    label: *mut U,
    children: RawArray<AtomicU64>,
    child_slots: &'n [AtomicU64; 2],
}

impl<'n, U> Fields<'n, U> {
    /// # Safety
    ///
    /// The fields must be consistent (see [`RawArray::items`]), and the
    /// buffers they point to must stay allocated for `'a`.
    #[inline]
    unsafe fn into_view<'a>(self, version: u32) -> View<'a, U>
    where
        'n: 'a,
    {
        let start = (self.range & 0xffff_ffff) as usize;
        let end = (self.range >> 32) as usize;
        let label = if self.label.is_null() {
            &[][..]
        } else {
            // SAFETY: a consistent range lies inside the node's label buffer,
            // whose units are never written after it was created.
            unsafe { std::slice::from_raw_parts(self.label.add(start), end - start) }
        };
        View {
            version,
            parent: self.parent,
            symbols: self.symbols,
            label,
            children: if self.children.ptr.is_null() {
                &self.child_slots[..self.children.len().min(2)]
            } else {
                // SAFETY: forwarded from this function's contract.
                unsafe { self.children.items() }
            },
        }
    }
}

/// A node's lock; dropping it publishes the changes (even version again).
pub(super) struct NodeGuard<'a, U> {
    pub(super) node: &'a Node<U>,
    /// The odd version the lock holder set.
    version: u32,
}

impl<U> Drop for NodeGuard<'_, U> {
    fn drop(&mut self) {
        // Only the holder writes the version while it is odd, so a plain
        // store releases the lock.
        self.node
            .version
            .store(self.version.wrapping_add(1), Ordering::Release);
    }
}

impl<'a, U: Unit> NodeGuard<'a, U> {
    pub(super) fn view(&self) -> View<'a, U> {
        self.node.view_owned()
    }

    /// Inserts a child entry in key order (the key must be absent).
    pub(super) fn add_child(&self, key: u32, child: u32, garbage: &Ledger) {
        let node = self.node;
        let mut raw = node.children.load();
        if raw.ptr.is_null() && raw.len() == 2 {
            // A third child: move the two inline ones to an array.
            let array = Block::from_fn(4, |_| AtomicU64::new(0));
            garbage.grow(heap_bytes::<AtomicU64>(array.len()));
            for (to, from) in array.iter().zip(&node.child_slots) {
                to.copy_from(from);
            }
            node.children.ptr.store(array.into_raw(), Ordering::Relaxed);
            node.children.meta.store((4 << 32) | 2, Ordering::Relaxed);
        }
        if !node.children.load().ptr.is_null() {
            raw = node.children.reserve_one(garbage);
        }
        let items = if raw.ptr.is_null() {
            &node.child_slots[..=raw.len()]
        } else {
            // SAFETY: the lock is held, so `raw` is consistent, and it has
            // room for one more.
            unsafe {
                RawArray {
                    meta: raw.meta + 1,
                    ..raw
                }
                .items()
            }
        };
        let entry = child_entry(key, child);
        let mut i = raw.len();
        while i > 0 && items[i - 1].load(Ordering::Relaxed) > entry {
            items[i].copy_from(&items[i - 1]);
            i -= 1;
        }
        items[i].store(entry, Ordering::Relaxed);
        self.node.children.set_len(raw, raw.len() + 1);
    }

    /// Points the child entry of `key` at `child` instead.
    pub(super) fn replace_child(&self, key: u32, child: u32) {
        for e in self.view().children {
            if (e.load(Ordering::Relaxed) >> 32) as u32 == key {
                e.store(child_entry(key, child), Ordering::Relaxed);
            }
        }
    }

    pub(super) fn add_owner(&self, tenant: u32, pos: u32, held: u32, stamp: u64, garbage: &Ledger) {
        if self.node.inline_owner.load(Ordering::Relaxed) == 0 {
            self.node.owner.set(tenant, pos, held, stamp);
            self.node.inline_owner.store(1, Ordering::Relaxed);
            return;
        }
        let raw = self.node.owners.reserve_one(garbage);
        // SAFETY: the lock is held, so `raw` is consistent.
        let items = unsafe {
            RawArray {
                meta: raw.meta + 1,
                ..raw
            }
            .items()
        };
        items[raw.len()].set(tenant, pos, held, stamp);
        self.node.owners.set_len(raw, raw.len() + 1);
    }
}
