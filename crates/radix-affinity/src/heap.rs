//! The tree's heap blocks (labels, child and owner arrays, node chunks),
//! taken from the system allocator whatever the program's global allocator
//! is.
//!
//! Why not the global allocator: prefix state is long-lived and churned in
//! least-recently-used order, which a size-class allocator handles badly. A
//! page of one size class stays resident while any block on it lives, and
//! LRU eviction frees blocks scattered over many pages. Under sustained
//! distinct traffic a tree held at a 256 MiB budget kept 1.25x its accounted
//! bytes resident on mimalloc (the reference router's allocator, which it
//! keeps for the request path) and 1.01x on glibc's malloc, which coalesces
//! free neighbours into blocks of any size. Throughput of the same inserts
//! was the same on both. Large zeroed blocks (node chunks) come straight
//! from fresh pages there, so the slots of a chunk not used yet cost no
//! resident memory.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr::NonNull;

/// `len` items of `T` in one block of the system allocator; dropped (items
/// first, then the block) like a `Box<[T]>`.
pub(crate) struct Block<T> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: a `Block` owns its items exactly as a `Box<[T]>` does.
unsafe impl<T: Send> Send for Block<T> {}
// SAFETY: as above; shared access only hands out `&[T]`.
unsafe impl<T: Sync> Sync for Block<T> {}

impl<T> std::fmt::Debug for Block<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block").field("len", &self.len).finish()
    }
}

impl<T> Block<T> {
    fn layout(len: usize) -> Layout {
        Layout::array::<T>(len).unwrap_or_else(|_| capacity_overflow())
    }

    /// Allocates room for `len` items (zeroed when `zeroed`), or a dangling
    /// pointer when that is zero bytes.
    fn allocate(len: usize, zeroed: bool) -> NonNull<T> {
        let layout = Self::layout(len);
        if layout.size() == 0 {
            return NonNull::dangling();
        }
        count(layout.size() as isize, 1);
        let ptr = if layout.align() > MALLOC_ALIGN {
            allocate_over_aligned(layout, zeroed)
        } else {
            // SAFETY: the layout has a non-zero size.
            unsafe {
                if zeroed {
                    System.alloc_zeroed(layout)
                } else {
                    System.alloc(layout)
                }
            }
        };
        NonNull::new(ptr.cast::<T>()).unwrap_or_else(|| std::alloc::handle_alloc_error(layout))
    }

    /// A block of `len` items, item `i` made by `make(i)`.
    pub(crate) fn from_fn(len: usize, mut make: impl FnMut(usize) -> T) -> Self {
        /// Drops the items made so far and frees the block if `make` panics.
        struct Partial<T> {
            ptr: NonNull<T>,
            made: usize,
            len: usize,
        }
        impl<T> Drop for Partial<T> {
            fn drop(&mut self) {
                // SAFETY: the first `made` items are initialized, and the
                // block was allocated for `len` items.
                unsafe {
                    std::ptr::drop_in_place(std::ptr::slice_from_raw_parts_mut(
                        self.ptr.as_ptr(),
                        self.made,
                    ));
                    release(self.ptr, self.len);
                }
            }
        }
        let mut partial = Partial {
            ptr: Self::allocate(len, false),
            made: 0,
            len,
        };
        for i in 0..len {
            // SAFETY: `i < len`, inside the allocation, and slot `i` is not
            // initialized yet.
            unsafe { partial.ptr.as_ptr().add(i).write(make(i)) };
            partial.made = i + 1;
        }
        // Finished: the block now owns the items.
        let partial = std::mem::ManuallyDrop::new(partial);
        Self {
            ptr: partial.ptr,
            len,
        }
    }

    /// A block of `len` all-zero items.
    ///
    /// # Safety
    ///
    /// The all-zero bit pattern must be a valid `T`.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) unsafe fn zeroed(len: usize) -> Self {
        Self {
            ptr: Self::allocate(len, true),
            len,
        }
    }

    /// Gives up the block as a pointer to its first item (dangling when it
    /// holds zero bytes); [`Block::from_raw`] with the same length takes it
    /// back.
    pub(crate) fn into_raw(self) -> *mut T {
        std::mem::ManuallyDrop::new(self).ptr.as_ptr()
    }

    /// Takes back a block that [`Block::into_raw`] gave up.
    ///
    /// # Safety
    ///
    /// `ptr` must come from `into_raw` of a block of exactly `len` items, and
    /// must not be taken back twice.
    pub(crate) unsafe fn from_raw(ptr: *mut T, len: usize) -> Self {
        Self {
            // SAFETY: `into_raw` never gives a null pointer.
            ptr: unsafe { NonNull::new_unchecked(ptr) },
            len,
        }
    }
}

impl<T: Copy> Block<T> {
    /// A block holding a copy of `items`.
    pub(crate) fn copied(items: &[T]) -> Self {
        let ptr = Self::allocate(items.len(), false);
        // SAFETY: the block has room for `items.len()` items, and a fresh
        // allocation cannot overlap `items`.
        unsafe {
            std::ptr::copy_nonoverlapping(items.as_ptr(), ptr.as_ptr(), items.len());
        }
        Self {
            ptr,
            len: items.len(),
        }
    }
}

impl<T> std::ops::Deref for Block<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: the first `len` items are initialized and owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for Block<T> {
    fn drop(&mut self) {
        // SAFETY: the `len` items are initialized and dropped once, here; the
        // block was allocated for `len` items.
        unsafe {
            std::ptr::drop_in_place(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ));
            release(self.ptr, self.len);
        }
    }
}

/// Frees a block allocated for `len` items of `T` (nothing for zero bytes).
///
/// # Safety
///
/// `ptr` must come from [`Block::allocate`] with `len`, and be freed once.
unsafe fn release<T>(ptr: NonNull<T>, len: usize) {
    let layout = Block::<T>::layout(len);
    if layout.size() == 0 {
        return;
    }
    count(-(layout.size() as isize), 0);
    if layout.align() > MALLOC_ALIGN {
        // SAFETY: per the contract, `allocate_over_aligned` made it.
        unsafe { release_over_aligned(ptr.as_ptr().cast(), layout) };
    } else {
        // SAFETY: per the contract, `System` allocated it with this layout.
        unsafe { System.dealloc(ptr.as_ptr().cast(), layout) };
    }
}

/// Alignment every `malloc` and `calloc` block has (at least a pointer's;
/// 16 bytes on the common 64-bit targets, but a pointer's is all that is
/// relied on).
const MALLOC_ALIGN: usize = std::mem::size_of::<usize>();

/// Allocates a block of `layout` whose alignment `malloc` does not give
/// (node chunks are aligned to 128 bytes) from a `malloc`-aligned one a
/// little larger, recording where that one starts in the word before the
/// returned address. Null if the allocation failed.
///
/// Why not `System.alloc_zeroed(layout)`: for an alignment above
/// `malloc`'s, the standard library takes an aligned block and writes
/// zeros over all of it, which makes every page of a node chunk resident at
/// once. A chunk doubles, so the 2^20-slot one is 128 MiB: a soak with 64
/// workers saw the whole router stop for 300 ms while it was zeroed, and
/// its RSS jump by the chunk's size. `calloc` of a large block instead maps
/// fresh pages, which are zero without being touched.
fn allocate_over_aligned(layout: Layout, zeroed: bool) -> *mut u8 {
    // `base` is `MALLOC_ALIGN`-aligned, so the first `layout.align()`
    // boundary after its first word is at most `layout.align()` bytes in.
    let Some(padded) = padded(layout) else {
        return std::ptr::null_mut();
    };
    // SAFETY: the padded layout has a non-zero size; an alignment of one
    // pointer is at most what `malloc` gives, so this is `calloc`/`malloc`.
    let base = unsafe {
        if zeroed {
            System.alloc_zeroed(padded)
        } else {
            System.alloc(padded)
        }
    };
    if base.is_null() {
        return base;
    }
    let offset = (base as usize + MALLOC_ALIGN).next_multiple_of(layout.align()) - base as usize;
    // SAFETY: `MALLOC_ALIGN <= offset <= layout.align()`, so the aligned
    // address and the `layout.size()` bytes after it lie inside the padded
    // block, and so does the word before it, which is pointer-aligned.
    unsafe {
        let aligned = base.add(offset);
        aligned.cast::<usize>().sub(1).write(base as usize);
        aligned
    }
}

/// The `malloc`-aligned layout [`allocate_over_aligned`] takes for
/// `layout`: room for one alignment's worth more.
fn padded(layout: Layout) -> Option<Layout> {
    let size = layout.size().checked_add(layout.align())?;
    Layout::from_size_align(size, MALLOC_ALIGN).ok()
}

/// Frees a block that [`allocate_over_aligned`] made for `layout`.
///
/// # Safety
///
/// `aligned` must come from `allocate_over_aligned(layout, _)`, once.
unsafe fn release_over_aligned(aligned: *mut u8, layout: Layout) {
    let padded = padded(layout).unwrap_or_else(|| capacity_overflow());
    // SAFETY: per the contract, the word before `aligned` holds the address
    // of the padded block, which `System` allocated with `padded`.
    unsafe {
        let base = aligned.cast::<usize>().sub(1).read() as *mut u8;
        System.dealloc(base, padded);
    }
}

#[cfg(not(loom))]
thread_local! {
    /// (bytes allocated and not freed, allocations) by this thread.
    static COUNTS: std::cell::Cell<(isize, usize)> = const { std::cell::Cell::new((0, 0)) };
}

/// Counts an allocation (`calls` 1) or a free (`calls` 0) of `bytes`.
#[inline]
fn count(bytes: isize, calls: usize) {
    #[cfg(not(loom))]
    let _ = COUNTS.try_with(|c| {
        let (live, made) = c.get();
        c.set((live + bytes, made + calls));
    });
    #[cfg(loom)]
    let _ = (bytes, calls);
}

/// Bytes of tree blocks this thread allocated and did not free (negative
/// when it freed others' blocks), and how many blocks it allocated: tree
/// blocks bypass the global allocator, so a test that counts allocations
/// through it adds these.
#[doc(hidden)]
pub fn thread_block_counts() -> (isize, usize) {
    #[cfg(not(loom))]
    return COUNTS.try_with(std::cell::Cell::get).unwrap_or((0, 0));
    #[cfg(loom)]
    (0, 0)
}

#[cold]
fn capacity_overflow() -> ! {
    panic!("a prefix-tree block larger than the address space was asked for")
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn blocks_hold_what_they_were_made_with_and_drop_their_items() {
        static DROPS: AtomicUsize = AtomicUsize::new(0);
        struct Counted(u32);
        impl Drop for Counted {
            fn drop(&mut self) {
                DROPS.fetch_add(1, Ordering::Relaxed);
            }
        }
        let block = Block::from_fn(5, |i| Counted(i as u32 * 3));
        assert_eq!(
            block.iter().map(|c| c.0).collect::<Vec<_>>(),
            [0, 3, 6, 9, 12]
        );
        let raw = block.into_raw();
        // SAFETY: taken back once, with the length it was made with.
        let block = unsafe { Block::from_raw(raw, 5) };
        drop(block);
        assert_eq!(DROPS.load(Ordering::Relaxed), 5);

        let copy = Block::copied(b"user: hello");
        assert_eq!(&*copy, b"user: hello");
        // SAFETY: zero is a valid u64.
        let zeros = unsafe { Block::<u64>::zeroed(1 << 16) };
        assert!(zeros.iter().all(|&z| z == 0));
        assert!(Block::<u8>::copied(&[]).is_empty());
    }

    #[repr(align(128))]
    struct Line([u64; 16]);

    #[test]
    fn over_aligned_blocks_are_aligned_and_zeroed() {
        for len in [1, 3, 100, 5000] {
            // SAFETY: zero is a valid `Line`.
            let block = unsafe { Block::<Line>::zeroed(len) };
            assert_eq!(block.as_ptr() as usize % 128, 0);
            assert!(block.iter().all(|line| line.0 == [0; 16]));
            let made = Block::from_fn(len, |i| Line([i as u64; 16]));
            assert_eq!(made.as_ptr() as usize % 128, 0);
            assert_eq!(made[len - 1].0[15], len as u64 - 1);
        }
    }

    /// Resident memory of this process in bytes, from /proc.
    #[cfg(target_os = "linux")]
    fn resident() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
        let pages: usize = statm
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .expect("resident pages");
        pages * 4096
    }

    /// A large zeroed chunk of nodes (aligned to 128 bytes) must not be
    /// written on allocation: its pages become resident only as slots are
    /// used (the standard library's `alloc_zeroed` writes over-aligned
    /// blocks whole).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_zeroed_chunk_takes_no_resident_memory_until_used() {
        const BYTES: usize = 256 << 20;
        let before = resident();
        // SAFETY: zero is a valid `Line`.
        let block = unsafe { Block::<Line>::zeroed(BYTES / 128) };
        let after = resident();
        assert_eq!(block[BYTES / 128 - 1].0[0], 0);
        // Other tests allocate meanwhile; a written chunk would add 256 MiB.
        assert!(
            after < before + (32 << 20),
            "resident memory grew from {before} to {after} bytes"
        );
    }
}
