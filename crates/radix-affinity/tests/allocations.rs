//! Allocation behaviour, measured with a counting global allocator: lookups
//! never allocate, and dropping a tree returns every byte it allocated (nodes
//! live in per-shard arenas addressed by index and parents are indices, so
//! there are no reference cycles to leak). One test function, so no other
//! test thread allocates while it counts.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static CALLS: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn lookups_do_not_allocate_and_drop_frees_everything() {
    let texts: Vec<String> = (0..300)
        .map(|i| format!("system prompt {} / user {i} 一丁😀", i % 7))
        .collect();
    let before = LIVE.load(Ordering::Relaxed);
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
        let calls = CALLS.load(Ordering::Relaxed);
        let mut matched = 0;
        for t in &texts {
            matched += tree.prefix_match(t).matched;
            matched += tree.prefix_match_tenant(t, ids[2]);
        }
        matched += tree.prefix_match_symbols(&chars).matched;
        matched += tree.prefix_match("no such prefix").matched;
        matched += tokens.prefix_match_symbols(&[1, 2, 9]).matched;
        assert_eq!(CALLS.load(Ordering::Relaxed), calls, "a lookup allocated");
        assert!(matched > 0);
        assert!(LIVE.load(Ordering::Relaxed) > before);
    }
    assert_eq!(
        LIVE.load(Ordering::Relaxed),
        before,
        "bytes still allocated after drop"
    );
}
