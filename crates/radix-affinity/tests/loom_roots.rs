//! loom: writers racing under a root (`src/tree/roots.rs`). A text under a
//! root is stored as its rest in a rooted shard and the root in the head
//! shard; a tenant that holds a rest must hold the root, or lookups up to
//! the root's length would miss it. These models race an insert under the
//! root against the eviction that may take the root (its pin is the
//! tenant's shard bitmap, read under the head shard's exclusive lock) and
//! against the tenant's removal (head shards before rooted ones), and check
//! that afterwards `validate` finds every rest's root held.
//!
//! Bound: 2 threads, one operation each, `LOOM_MAX_PREEMPTIONS=2`.
#![cfg(loom)]

mod loom_support;

use loom::sync::Arc;
use loom::thread;
use loom_support::model;
use radix_affinity::{Clock, TenantId, TextTree};

/// A tree with the root "r" in which `t0` holds "ra", and `op` run on it
/// while another thread inserts "rb" for `t0`; returns the tree once both
/// are done.
fn race_insert_rb(op: impl FnOnce(&TextTree, TenantId)) -> (Arc<TextTree>, TenantId) {
    let tree = Arc::new(
        TextTree::with_clock(Clock::Logical)
            .with_text_roots(&["r"])
            .unwrap(),
    );
    let t0 = tree.intern("t0");
    tree.insert("ra", t0);
    let writer = {
        let tree = Arc::clone(&tree);
        // Marks a rooted shard, then refreshes (or puts back) the root.
        thread::spawn(move || tree.insert("rb", t0))
    };
    op(&tree, t0);
    writer.join().unwrap();
    (tree, t0)
}

#[test]
fn an_insert_under_a_root_races_the_roots_eviction() {
    model(|| {
        // Evicts the rest "a" and then the root, once nothing under it is
        // held: the pin must hold while "b" is being inserted.
        let (tree, t0) = race_insert_rb(|tree, _| tree.evict_tenant_by_size(0));

        tree.validate().unwrap();
        let size = tree.tenant_size(t0);
        // 0: eviction ran after the insert. 2: the insert came after the
        // root was gone and put "r" back beside "b". 1: eviction took "b"
        // and then the root between the insert's two steps, and the
        // second put the root back: the tenant holds a prefix of what it
        // inserted, and an insert racing an eviction may leave it above
        // the limit. Never a rest without its root (`validate`).
        assert!(size <= 2, "t0 holds {size}");
        assert_eq!(tree.prefix_match_tenant("rb", t0), size);
        assert_eq!(tree.prefix_match_tenant("rz", t0), size.min(1));
        assert_eq!(tree.prefix_match("rb").matched, size);
    });
}

#[test]
fn an_insert_under_a_root_races_an_eviction_that_keeps_one_symbol() {
    model(|| {
        // "r" and "a" share a stamp, and the root's shard sorts first: only
        // the pin keeps the root while "a" (or "b") is held.
        let (tree, t0) = race_insert_rb(|tree, _| tree.evict_tenant_by_size(1));

        tree.validate().unwrap();
        let size = tree.tenant_size(t0);
        assert!(size <= 3, "t0 holds {size}");
        assert_eq!(
            tree.prefix_match_tenant("ra", t0) + tree.prefix_match_tenant("rb", t0),
            size + usize::from(size > 0),
            "the root counts in both matches, once in the size"
        );
    });
}

#[test]
fn an_insert_under_a_root_races_the_tenants_removal() {
    model(|| {
        let (tree, t0) = race_insert_rb(|tree, t0| tree.remove_tenant(t0));

        // The removal may leave the root without a rest (it went over the
        // head shard first), never a rest without the root.
        tree.validate().unwrap();
        let size = tree.tenant_size(t0);
        assert!(size <= 2, "t0 holds {size}");
        assert!(tree.prefix_match_tenant("ra", t0) <= 1, "\"a\" was removed");
        assert_eq!(tree.prefix_match_tenant("rb", t0), size);
    });
}
