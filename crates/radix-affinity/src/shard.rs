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

use std::sync::Arc;

use crate::budget::Accounts;
use crate::heap::Block;
use crate::seg::Segmented;
use crate::symbol::{Probe, Unit};
use crate::sync::Backoff;
use crate::sync::{AtomicPtr, AtomicU32, AtomicU64, Mutex, Ordering, fence};

/// Index of the shard's root (empty label, never freed, owned by nobody).
pub(crate) const ROOT: u32 = 0;

/// Longest label a single new node gets; longer inserts become a chain, which
/// keeps symbol counts within `u32`.
pub(crate) const LABEL_MAX: usize = 1 << 28;

/// Retired arrays are freed once a shard holds this many bytes of them.
const GARBAGE_LIMIT: u64 = 4 << 10;

/// Accounted bytes of a node's slot (two cache lines).
pub(crate) const NODE_BYTES: u64 = std::mem::size_of::<Node<u8>>() as u64;

/// Accounted bytes of a heap block of `len` items of `T`: the size of the
/// block an allocator hands out for it (see [`block_size`]).
#[inline]
pub(crate) fn heap_bytes<T>(len: usize) -> u64 {
    block_size((len * std::mem::size_of::<T>()) as u64)
}

/// The block an allocator takes for a request of `size` bytes, so that
/// accounted bytes follow resident memory: mimalloc and jemalloc round a
/// request above 128 bytes up to one of four size classes per power of two,
/// and below it to 16 bytes. A 1,030-byte label takes a 1,280-byte block;
/// counting 1,030 let a soak of 1 KB prompts hold 30 % more resident memory
/// than its budget. The tree allocates from the system allocator (see
/// `heap`), whose blocks are finer (glibc: the request plus 8 bytes, in
/// 16-byte steps); the difference covers its per-thread arenas and
/// fragmentation, and resident memory stays within about 5 % of the count.
#[inline]
pub(crate) const fn block_size(size: u64) -> u64 {
    if size <= 128 {
        return (size + 15) & !15;
    }
    // 2^p < size <= 2^(p+1): classes of 2^(p-2) bytes.
    let p = 63 - (size - 1).leading_zeros();
    let step = 1u64 << (p - 2);
    (size + step - 1) & !(step - 1)
}

/// A tenant's hold on one node. Every field is atomic so that a lookup can
/// read it while an insert holding the node's lock writes the array.
#[derive(Debug)]
pub(crate) struct Owner {
    tenant: AtomicU32,
    /// Position of this node in the tenant's node list.
    pos: AtomicU32,
    /// Children of this node that the tenant also holds; 0 means the node is
    /// one of the tenant's leaves, i.e. an eviction candidate.
    held: AtomicU32,
    /// Last use of this node by the tenant.
    stamp: AtomicU64,
}

impl Owner {
    #[inline]
    pub(crate) fn tenant(&self) -> u32 {
        self.tenant.load(Ordering::Relaxed)
    }

    #[inline]
    pub(crate) fn stamp(&self) -> u64 {
        self.stamp.load(Ordering::Relaxed)
    }

    #[inline]
    pub(crate) fn held(&self) -> u32 {
        self.held.load(Ordering::Relaxed)
    }

    /// Raises the stamp to `now`, writing only when it is stale so shared hot
    /// nodes are not written on every lookup.
    #[inline]
    pub(crate) fn touch(&self, now: u64) {
        if self.stamp.load(Ordering::Relaxed) < now {
            self.stamp.store(now, Ordering::Relaxed);
        }
    }

    fn set(&self, tenant: u32, pos: u32, held: u32, stamp: u64) {
        self.tenant.store(tenant, Ordering::Relaxed);
        self.pos.store(pos, Ordering::Relaxed);
        self.held.store(held, Ordering::Relaxed);
        self.stamp.store(stamp, Ordering::Relaxed);
    }

    fn add_held(&self, delta: i32) {
        let held = self.held.load(Ordering::Relaxed);
        self.held
            .store(held.saturating_add_signed(delta), Ordering::Relaxed);
    }
}

/// What a node's child or owner array holds.
trait Item: Sized {
    fn blank() -> Self;
    fn copy_from(&self, other: &Self);
    fn retire(array: Block<Self>, garbage: &mut Garbage);
}

impl Item for AtomicU64 {
    fn blank() -> Self {
        AtomicU64::new(0)
    }

    fn copy_from(&self, other: &Self) {
        self.store(other.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn retire(array: Block<Self>, garbage: &mut Garbage) {
        garbage.children.push(array);
    }
}

impl Item for Owner {
    fn blank() -> Self {
        Owner {
            tenant: AtomicU32::new(0),
            pos: AtomicU32::new(0),
            held: AtomicU32::new(0),
            stamp: AtomicU64::new(0),
        }
    }

    fn copy_from(&self, other: &Self) {
        self.set(
            other.tenant(),
            other.pos.load(Ordering::Relaxed),
            other.held(),
            other.stamp(),
        );
    }

    fn retire(array: Block<Self>, garbage: &mut Garbage) {
        garbage.owners.push(array);
    }
}

/// Arrays replaced while readers may still read them; freed under exclusive
/// access.
#[derive(Debug, Default)]
struct Garbage {
    children: Vec<Block<AtomicU64>>,
    owners: Vec<Block<Owner>>,
}

/// What a shard has allocated: the bytes it accounts for (live nodes,
/// labels, arrays, tenant lists) and the arrays it retired but cannot free
/// yet. Every allocation and free of the shard goes through here, which also
/// forwards it to the tree's [`Accounts`] (and so to a shared memory budget).
#[derive(Debug)]
pub(crate) struct Ledger {
    list: Mutex<Garbage>,
    /// Bytes of retired arrays not freed yet (not accounted: freed soon).
    retired: AtomicU64,
    /// Accounted bytes.
    live: AtomicU64,
    accounts: Arc<Accounts>,
}

impl Ledger {
    fn new(accounts: Arc<Accounts>) -> Self {
        Self {
            list: Mutex::new(Garbage::default()),
            retired: AtomicU64::new(0),
            live: AtomicU64::new(0),
            accounts,
        }
    }

    /// Accounts `bytes` more.
    #[inline]
    fn grow(&self, bytes: u64) {
        self.live.fetch_add(bytes, Ordering::Relaxed);
        self.accounts.grow(bytes);
    }

    /// Accounts `bytes` less.
    #[inline]
    fn shrink(&self, bytes: u64) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
        self.accounts.shrink(bytes);
    }

    /// Accounted bytes of the shard.
    pub(crate) fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    /// Retires an array readers may still read (it stops being accounted).
    fn push<T: Item>(&self, array: Block<T>) {
        let bytes = std::mem::size_of_val(&*array) as u64;
        self.shrink(heap_bytes::<T>(array.len()));
        T::retire(array, &mut self.list.lock());
        self.retired.fetch_add(bytes, Ordering::Relaxed);
    }

    fn over_limit(&self) -> bool {
        self.retired.load(Ordering::Relaxed) > GARBAGE_LIMIT
    }

    fn free(&mut self) {
        let list = self.list.get_mut();
        list.children.clear();
        list.owners.clear();
        self.retired.store(0, Ordering::Relaxed);
    }
}

/// A growable array of a node: a pointer to a boxed slice and its capacity
/// and length packed in one word (capacity high, length low).
#[derive(Debug)]
struct Array<T> {
    ptr: AtomicPtr<T>,
    meta: AtomicU64,
}

/// An [`Array`]'s fields as loaded.
struct RawArray<T> {
    ptr: *mut T,
    meta: u64,
}

impl<T> Clone for RawArray<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for RawArray<T> {}

impl<T> RawArray<T> {
    #[inline]
    fn len(self) -> usize {
        (self.meta & 0xffff_ffff) as usize
    }

    #[inline]
    fn cap(self) -> usize {
        (self.meta >> 32) as usize
    }

    /// The live items.
    ///
    /// # Safety
    ///
    /// `self` must be a consistent pair (loaded from an unlocked node between
    /// two equal versions, or with the node's lock held, or under exclusive
    /// access), and the array must stay allocated for `'a`, which holds while
    /// the shard is borrowed: arrays are freed only under exclusive access.
    #[inline]
    unsafe fn items<'a>(self) -> &'a [T] {
        if self.ptr.is_null() {
            return &[];
        }
        // SAFETY: per the contract, `ptr` came from a boxed slice of `cap`
        // items that is still allocated, and a length is never set above its
        // capacity.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len().min(self.cap())) }
    }

    /// The array as the boxed slice it was made from, or `None` for no
    /// array.
    ///
    /// # Safety
    ///
    /// `self` must be an array's consistent fields, and nothing may read
    /// the array through them once the box is dropped.
    unsafe fn into_box(self) -> Option<Block<T>> {
        if self.ptr.is_null() {
            return None;
        }
        // SAFETY: per the contract, `ptr` and `cap` are those of a boxed
        // block that `Block::into_raw` gave up.
        Some(unsafe { Block::from_raw(self.ptr, self.cap()) })
    }
}

impl<T> Array<T> {
    #[inline]
    fn load(&self) -> RawArray<T> {
        RawArray {
            ptr: self.ptr.load(Ordering::Relaxed),
            meta: self.meta.load(Ordering::Relaxed),
        }
    }

    fn set_len(&self, raw: RawArray<T>, len: usize) {
        let meta = (raw.meta & !0xffff_ffff) | len as u64;
        self.meta.store(meta, Ordering::Relaxed);
    }

    /// Frees the array at once (exclusive access only) and empties it.
    fn free(&mut self) {
        let raw = self.load();
        self.ptr.store(std::ptr::null_mut(), Ordering::Relaxed);
        self.meta.store(0, Ordering::Relaxed);
        // SAFETY: exclusive access: nobody else can read the array.
        drop(unsafe { raw.into_box() });
    }
}

impl<T: Item> Array<T> {
    #[cfg(any(loom, test))]
    fn empty() -> Self {
        Self {
            ptr: AtomicPtr::new(std::ptr::null_mut()),
            meta: AtomicU64::new(0),
        }
    }

    /// Makes room for one more item; the caller holds the node's lock (or
    /// exclusive access). A full array is copied into one twice as large and
    /// the old one retired, because readers may still be reading it.
    fn reserve_one(&self, garbage: &Ledger) -> RawArray<T> {
        let raw = self.load();
        if raw.len() < raw.cap() {
            return raw;
        }
        let cap = (raw.cap() * 2).max(2);
        let grown = Block::from_fn(cap, |_| T::blank());
        // SAFETY: the caller holds the lock, so `raw` is consistent.
        for (new, old) in grown.iter().zip(unsafe { raw.items() }) {
            new.copy_from(old);
        }
        garbage.grow(heap_bytes::<T>(cap));
        let ptr = grown.into_raw();
        self.ptr.store(ptr, Ordering::Relaxed);
        let meta = ((cap as u64) << 32) | raw.len() as u64;
        self.meta.store(meta, Ordering::Relaxed);
        // SAFETY: `raw` is now unreachable from the node; it is freed later,
        // under exclusive access, after every reader of it has finished.
        if let Some(old) = unsafe { raw.into_box() } {
            garbage.push(old);
        }
        RawArray { ptr, meta }
    }
}

/// Packs a child entry so that entries sort by key.
#[inline]
fn child_entry(key: u32, node: u32) -> u64 {
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
    version: AtomicU32,
    parent: AtomicU32,
    /// Symbols in the label.
    symbols: AtomicU32,
    /// 1 when `owner` is valid.
    inline_owner: AtomicU32,
    /// The label is `label[start..end]`, start in the low half, end in the
    /// high half.
    range: AtomicU64,
    /// Buffer holding the label (units outside the range are dead, see
    /// `split`); immutable while the node lives.
    label: AtomicPtr<U>,
    /// The children while there are at most two and `children` has no
    /// array.
    child_slots: [AtomicU64; 2],
    /// `(first symbol of the child's label, child index)`, sorted by key:
    /// the length counts every child; the array exists once a third child
    /// was added.
    children: Array<AtomicU64>,
    /// The first owner, inline (most nodes have one); valid when
    /// `inline_owner` is 1.
    owner: Owner,
    /// Owners after the first.
    owners: Array<Owner>,
    /// Bumped whenever the slot is freed, so stale eviction candidates are
    /// recognised after the slot is reused.
    generation: AtomicU32,
    /// Length of the label buffer, to free it.
    label_cap: AtomicU32,
}

/// A consistent snapshot of a node, valid while the shard is borrowed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct View<'a, U> {
    version: u32,
    pub(crate) parent: u32,
    pub(crate) symbols: u32,
    pub(crate) label: &'a [U],
    children: &'a [AtomicU64],
}

/// A node's owners: the inline one, if any, then the array.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Owners<'a> {
    first: Option<&'a Owner>,
    rest: &'a [Owner],
}

impl<'a> Owners<'a> {
    #[inline]
    pub(crate) fn iter(self) -> impl Iterator<Item = &'a Owner> {
        self.first.into_iter().chain(self.rest)
    }

    #[inline]
    pub(crate) fn is_empty(self) -> bool {
        self.first.is_none()
    }

    fn len(self) -> usize {
        usize::from(self.first.is_some()) + self.rest.len()
    }

    #[inline]
    pub(crate) fn owner(self, tenant: u32) -> Option<&'a Owner> {
        self.iter().find(|o| o.tenant() == tenant)
    }

    /// The most recently used tenant of this node (ties: first entry).
    #[inline]
    pub(crate) fn most_recent(self) -> Option<&'a Owner> {
        let mut best: Option<&Owner> = None;
        for o in self.iter() {
            if best.is_none_or(|b| o.stamp() > b.stamp()) {
                best = Some(o);
            }
        }
        best
    }

    fn get(self, i: usize) -> &'a Owner {
        match (i, self.first) {
            (0, Some(first)) => first,
            _ => &self.rest[i - 1],
        }
    }
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
    fn empty(generation: u32) -> Self {
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
    fn owners_owned(&self) -> Owners<'_> {
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
    fn lock(&self) -> NodeGuard<'_, U> {
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
    fn lock_at(&self, version: u32) -> Option<NodeGuard<'_, U>> {
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
    fn claim(&self) -> NodeGuard<'_, U> {
        self.version.store(1, Ordering::Relaxed);
        fence(Ordering::Release);
        NodeGuard {
            node: self,
            version: 1,
        }
    }

    /// Makes a claimed node's first owner `tenant` (the node has none).
    fn set_first_owner(&self, tenant: u32, pos: u32, held: u32, stamp: u64) {
        self.owner.set(tenant, pos, held, stamp);
        self.inline_owner.store(1, Ordering::Relaxed);
    }

    /// The fields, read with the lock held or under exclusive access.
    fn view_owned(&self) -> View<'_, U> {
        // SAFETY: nobody else writes the node (the caller holds its lock or
        // has exclusive access), so the fields are consistent.
        unsafe { self.load_fields().into_view(0) }
    }
}

impl<U> Node<U> {
    fn set_label(&self, buf: *mut U, cap: usize, start: usize, end: usize) {
        self.label.store(buf, Ordering::Relaxed);
        self.label_cap.store(cap as u32, Ordering::Relaxed);
        self.range
            .store((start as u64) | ((end as u64) << 32), Ordering::Relaxed);
    }

    /// Accounted bytes of the label and arrays the node owns.
    fn contents_bytes(&self) -> u64 {
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
    fn free_contents(&mut self) {
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
struct NodeGuard<'a, U> {
    node: &'a Node<U>,
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
    fn view(&self) -> View<'a, U> {
        self.node.view_owned()
    }

    /// Inserts a child entry in key order (the key must be absent).
    fn add_child(&self, key: u32, child: u32, garbage: &Ledger) {
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
    fn replace_child(&self, key: u32, child: u32) {
        for e in self.view().children {
            if (e.load(Ordering::Relaxed) >> 32) as u32 == key {
                e.store(child_entry(key, child), Ordering::Relaxed);
            }
        }
    }

    fn add_owner(&self, tenant: u32, pos: u32, held: u32, stamp: u64, garbage: &Ledger) {
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

/// One hold of a tenant on a node, to remove (see
/// [`Shard::holds_deepest_first`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hold {
    depth: u64,
    node: u32,
    generation: u32,
}

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
    fn step<'a>(
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
    fn unhold(&mut self, node: u32, tenant: u32) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbol::UnitProbe;

    /// Inserts under shared access, making room as the tree does.
    fn insert(shard: &mut Shard<u8>, text: &str, tenant: u32, now: u64) {
        loop {
            match shard.insert(&UnitProbe(text.as_bytes()), tenant, now) {
                Inserted::Done { .. } => return,
                Inserted::NeedRoom { .. } => shard.make_room(tenant),
            }
        }
    }

    fn root_child(shard: &Shard<u8>, key: u8) -> u32 {
        shard.node(ROOT).view().child(u32::from(key)).unwrap()
    }

    #[test]
    fn blocks_are_rounded_to_four_size_classes_per_power_of_two() {
        let cases = [
            (0, 0),
            (1, 16),
            (16, 16),
            (17, 32),
            (128, 128),
            (129, 160),
            (1024, 1024),
            (1025, 1280),
            (1030, 1280),
            (1281, 1536),
            (2048, 2048),
            (3 << 20, 3 << 20),
            ((3 << 20) + 1, (7 << 19)),
        ];
        for (size, block) in cases {
            assert_eq!(block_size(size), block, "block of {size} bytes");
        }
        // Never less than asked, never a quarter more above 128 bytes.
        for size in 129..70_000u64 {
            let block = block_size(size);
            assert!(block >= size && block * 4 <= size * 5, "{size} -> {block}");
        }
    }

    #[test]
    fn a_zeroed_chunk_holds_empty_nodes() {
        let chunk = node_chunk::<u8>(16);
        let empty = Node::<u8>::empty(0);
        let fields = |n: &Node<u8>| {
            let view = n.view_owned();
            (
                n.version.load(Ordering::Relaxed),
                n.generation.load(Ordering::Relaxed),
                n.inline_owner.load(Ordering::Relaxed),
                n.label_cap.load(Ordering::Relaxed),
                view.parent,
                view.symbols,
                view.label.len(),
                view.children.len(),
                n.owners_owned().len(),
                n.contents_bytes(),
            )
        };
        for node in chunk.iter() {
            assert_eq!(fields(node), fields(&empty));
        }
    }

    #[test]
    fn node_is_two_cache_lines_with_the_walk_in_the_first() {
        assert_eq!(std::mem::size_of::<Node<u8>>(), 128);
        assert_eq!(std::mem::size_of::<Node<u32>>(), 128);
        assert_eq!(std::mem::align_of::<Node<u8>>(), 128);
        assert_eq!(std::mem::offset_of!(Node<u8>, owner), 64);
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
        let mut shard: Shard<u8> = Shard::new(0, Arc::new(Accounts::new(None)));
        let texts: Vec<String> = (0..N).map(|i| format!("a{i:05}")).collect();
        for (i, text) in texts.iter().enumerate() {
            insert(&mut shard, text, (i % 3) as u32, 1);
        }
        assert!(shard.slots_used() > N, "{} slots", shard.slots_used());
        shard.check().unwrap();
        let of = |t: usize| prefixes(texts.iter().skip(t).step_by(3));
        assert_eq!(shard.size_of(0), of(0));
        assert_eq!(shard.remove_tenant(1), of(1));
        shard.check().unwrap();
        // Freed slots are reused.
        let slots = shard.slots_used();
        for text in texts.iter().skip(1).step_by(3) {
            insert(&mut shard, text, 3, 2);
        }
        shard.check().unwrap();
        assert_eq!(shard.size_of(3), of(1));
        assert_eq!(shard.slots_used(), slots);
    }

    #[test]
    fn freed_slots_are_reused_with_a_new_generation() {
        let mut shard: Shard<u8> = Shard::new(0, Arc::new(Accounts::new(None)));
        insert(&mut shard, "abc", 0, 1);
        let node = root_child(&shard, b'a');
        let generation = shard.node(node).generation.load(Ordering::Relaxed);
        assert_eq!(shard.remove_tenant(0), 3);
        insert(&mut shard, "xy", 1, 2);
        let reused = root_child(&shard, b'x');
        assert_eq!(reused, node, "the freed slot is reused");
        assert_ne!(
            shard.node(reused).generation.load(Ordering::Relaxed),
            generation
        );
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

    #[test]
    fn split_copies_the_shorter_side_and_keeps_stamps() {
        let mut shard: Shard<u8> = Shard::new(0, Arc::new(Accounts::new(None)));
        insert(&mut shard, "abcdefgh", 0, 1);
        let node = root_child(&shard, b'a');
        let buf = shard.node(node).label.load(Ordering::Relaxed);
        // Upper part shorter: the lower node keeps the buffer.
        insert(&mut shard, "abx", 1, 2);
        let mid = root_child(&shard, b'a');
        assert_ne!(mid, node);
        let lower = shard.node(node).view();
        assert_eq!(lower.label, b"cdefgh");
        assert_eq!(lower.parent, mid);
        assert_eq!(shard.node(node).label.load(Ordering::Relaxed), buf);
        assert_eq!(shard.node(mid).view().label, b"ab");
        let upper = shard.node(mid).owners();
        assert_eq!(upper.owner(0).map(Owner::stamp), Some(1));
        assert_eq!(upper.owner(0).map(Owner::held), Some(1));
        assert_eq!(upper.owner(1).map(Owner::held), Some(1));
        // Lower part shorter: the upper node keeps the buffer.
        insert(&mut shard, "abcdefgz", 2, 3);
        let kept = shard.node(ROOT).view().child(u32::from(b'a')).unwrap();
        let cdefg = shard.node(kept).view().child(u32::from(b'c')).unwrap();
        assert_eq!(shard.node(cdefg).view().label, b"cdefg");
        assert_eq!(shard.node(cdefg).label.load(Ordering::Relaxed), buf);
        assert_eq!(shard.node(node).view().label, b"h");
        shard.check().unwrap();
        assert_eq!(
            (shard.size_of(0), shard.size_of(1), shard.size_of(2)),
            (8, 3, 8)
        );
    }

    #[test]
    fn arena_growth_keeps_every_node() {
        let mut shard: Shard<u8> = Shard::new(0, Arc::new(Accounts::new(None)));
        let texts: Vec<String> = (0..200).map(|i| format!("k{i}-{}", i * 7)).collect();
        for text in &texts {
            insert(&mut shard, text, 0, 1);
        }
        assert!(shard.nodes.capacity() >= 200);
        shard.check().unwrap();
        for text in &texts {
            let end = shard.walk(&UnitProbe(text.as_bytes()), |_| true);
            assert_eq!(end.matched, text.len(), "{text}");
        }
    }
}
