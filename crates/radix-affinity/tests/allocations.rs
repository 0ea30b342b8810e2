//! Allocation behaviour, measured with a counting global allocator: lookups
//! never allocate, and dropping a tree returns every byte it allocated (nodes
//! live in per-shard arenas addressed by index and parents are indices, so
//! there are no reference cycles to leak). The counts are the test
//! thread's own.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

// Per thread: the test harness's own thread allocates now and then while
// the test runs (seen as a flake under load), and the tree allocates only
// on the thread that calls it.
thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static CALLS: Cell<isize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LIVE.try_with(|live| live.set(live.get() + layout.size() as isize));
        let _ = CALLS.try_with(|calls| calls.set(calls.get() + 1));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = LIVE.try_with(|live| live.set(live.get() - layout.size() as isize));
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Bytes this thread holds and allocations it made: through the global
/// allocator, plus the tree's own blocks, which it takes from the system
/// allocator directly.
fn counts() -> (isize, isize) {
    let (block_bytes, block_calls) = radix_affinity::thread_block_counts();
    (LIVE.get() + block_bytes, CALLS.get() + block_calls as isize)
}

#[test]
fn lookups_do_not_allocate_and_drop_frees_everything() {
    let texts: Vec<String> = (0..300)
        .map(|i| format!("system prompt {} / user {i} 一丁😀", i % 7))
        .collect();
    let (before, _) = counts();
    let (_, blocks_before) = radix_affinity::thread_block_counts();
    {
        let tree = radix_affinity::TextTree::new();
        let ids: Vec<_> = (0..5).map(|i| tree.intern(&format!("w{i}"))).collect();
        for (i, t) in texts.iter().enumerate() {
            tree.insert(t, ids[i % 5]);
        }
        tree.evict_tenant_by_size(200);
        tree.remove_tenant(ids[1]);
        for t in &texts[..50] {
            tree.insert(t, ids[1]);
        }
        assert!(tree.total_size() > 0);

        let chars: Vec<char> = texts[3].chars().collect();
        let tokens = radix_affinity::TokenTree::new();
        let w = tokens.intern("w");
        tokens.insert_symbols(&[1, 2, 3, 4], w);
        let (_, calls) = counts();
        let mut matched = 0;
        for t in &texts {
            matched += tree.prefix_match(t).matched;
            matched += tree.prefix_match_tenant(t, ids[2]);
        }
        matched += tree.prefix_match_symbols(&chars).matched;
        matched += tree.prefix_match("no such prefix").matched;
        matched += tokens.prefix_match_symbols(&[1, 2, 9]).matched;
        assert_eq!(counts().1, calls, "a lookup allocated");
        assert!(matched > 0);
        assert!(counts().0 > before);
        assert!(
            radix_affinity::thread_block_counts().1 > blocks_before,
            "labels and arrays come from the tree's own blocks"
        );
    }
    assert_eq!(counts().0, before, "bytes still allocated after drop");
}
