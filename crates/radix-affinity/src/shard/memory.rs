//! What a shard allocates: the bytes it accounts, the arrays it retired
//! but cannot free yet, and the growable arrays of a node.

use std::sync::Arc;

use super::GARBAGE_LIMIT;
use super::owner::Owner;
use crate::budget::Accounts;
use crate::heap::Block;
use crate::sync::{AtomicPtr, AtomicU32, AtomicU64, Mutex, Ordering};

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

/// What a node's child or owner array holds.
pub(super) trait Item: Sized {
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
pub(super) struct Garbage {
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
    pub(super) accounts: Arc<Accounts>,
}

impl Ledger {
    pub(super) fn new(accounts: Arc<Accounts>) -> Self {
        Self {
            list: Mutex::new(Garbage::default()),
            retired: AtomicU64::new(0),
            live: AtomicU64::new(0),
            accounts,
        }
    }

    /// Accounts `bytes` more.
    #[inline]
    pub(super) fn grow(&self, bytes: u64) {
        self.live.fetch_add(bytes, Ordering::Relaxed);
        self.accounts.grow(bytes);
    }

    /// Accounts `bytes` less.
    #[inline]
    pub(super) fn shrink(&self, bytes: u64) {
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

    pub(super) fn over_limit(&self) -> bool {
        self.retired.load(Ordering::Relaxed) > GARBAGE_LIMIT
    }

    pub(super) fn free(&mut self) {
        let list = self.list.get_mut();
        list.children.clear();
        list.owners.clear();
        self.retired.store(0, Ordering::Relaxed);
    }
}

/// A growable array of a node: a pointer to a boxed slice and its capacity
/// and length packed in one word (capacity high, length low).
#[derive(Debug)]
pub(super) struct Array<T> {
    pub(super) ptr: AtomicPtr<T>,
    pub(super) meta: AtomicU64,
}

/// An [`Array`]'s fields as loaded.
pub(super) struct RawArray<T> {
    pub(super) ptr: *mut T,
    pub(super) meta: u64,
}

impl<T> Clone for RawArray<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for RawArray<T> {}

impl<T> RawArray<T> {
    #[inline]
    pub(super) fn len(self) -> usize {
        (self.meta & 0xffff_ffff) as usize
    }

    #[inline]
    pub(super) fn cap(self) -> usize {
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
    pub(super) unsafe fn items<'a>(self) -> &'a [T] {
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
    pub(super) fn load(&self) -> RawArray<T> {
        RawArray {
            ptr: self.ptr.load(Ordering::Relaxed),
            meta: self.meta.load(Ordering::Relaxed),
        }
    }

    pub(super) fn set_len(&self, raw: RawArray<T>, len: usize) {
        let meta = (raw.meta & !0xffff_ffff) | len as u64;
        self.meta.store(meta, Ordering::Relaxed);
    }

    /// Frees the array at once (exclusive access only) and empties it.
    pub(super) fn free(&mut self) {
        let raw = self.load();
        self.ptr.store(std::ptr::null_mut(), Ordering::Relaxed);
        self.meta.store(0, Ordering::Relaxed);
        // SAFETY: exclusive access: nobody else can read the array.
        drop(unsafe { raw.into_box() });
    }
}

impl<T: Item> Array<T> {
    #[cfg(any(loom, test))]
    pub(super) fn empty() -> Self {
        Self {
            ptr: AtomicPtr::new(std::ptr::null_mut()),
            meta: AtomicU64::new(0),
        }
    }

    /// Makes room for one more item; the caller holds the node's lock (or
    /// exclusive access). A full array is copied into one twice as large and
    /// the old one retired, because readers may still be reading it.
    pub(super) fn reserve_one(&self, garbage: &Ledger) -> RawArray<T> {
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
