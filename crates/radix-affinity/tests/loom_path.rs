//! loom: an insert racing writers that change the path it walks. An insert
//! walks its text like a lookup (no locks) and locks only the nodes it
//! changes, at the version it viewed; these models race it against a split
//! of a node on its path, an eviction or removal that frees a path node
//! (whose slot is then reused for another text), and another insert adding
//! the same edge.
//!
//! Bound: 2 threads, one or two operations each, `LOOM_MAX_PREEMPTIONS=2`.
//! Under loom there are 4 shards chosen by first symbol modulo 4, so texts
//! starting with 'a' (97) and 'e' (101) share a shard.
#![cfg(loom)]

mod loom_support;

use loom::sync::Arc;
use loom::thread;
use loom_support::model;
use radix_affinity::{Clock, TextTree};

#[test]
fn insert_races_split_of_its_path() {
    model(|| {
        let tree = Arc::new(TextTree::with_clock(Clock::Logical));
        let t0 = tree.intern("t0");
        let t1 = tree.intern("t1");
        let t2 = tree.intern("t2");
        tree.insert("abcdef", t0);

        // Walks "abcdef", then adds the leaf "gh" below it.
        let writer = {
            let tree = Arc::clone(&tree);
            thread::spawn(move || tree.insert("abcdefgh", t1))
        };
        // Cuts "abcdef" into "abc" + "def", possibly while the writer walks
        // it: the node the writer saw below the root moves down.
        tree.insert("abcz", t2);
        writer.join().unwrap();

        tree.validate().unwrap();
        assert_eq!(tree.tenant_size(t0), 6);
        assert_eq!(tree.tenant_size(t1), 8);
        assert_eq!(tree.tenant_size(t2), 4);
        assert_eq!(tree.prefix_match_tenant("abcdefgh", t1), 8);
        assert_eq!(tree.prefix_match_tenant("abcdefgh", t2), 3);
        let m = tree.prefix_match("abcdefghi");
        assert_eq!((m.tenant, m.matched), (Some(t1), 8));
    });
}

#[test]
fn insert_races_removal_that_frees_and_reuses_its_path() {
    model(|| {
        let tree = Arc::new(TextTree::with_clock(Clock::Logical));
        let t0 = tree.intern("t0");
        let t1 = tree.intern("t1");
        let t2 = tree.intern("t2");
        tree.insert("abc", t0);

        // Walks "abc", then adds the leaf "d".
        let writer = {
            let tree = Arc::clone(&tree);
            thread::spawn(move || tree.insert("abcd", t1))
        };
        // If the removal comes first it frees "abc", and the next insert in
        // the same shard reuses the slot (same index, same parent, new
        // generation) for another label: the writer must not have kept it.
        tree.remove_tenant(t0);
        tree.insert("exy", t2);
        writer.join().unwrap();

        tree.validate().unwrap();
        assert_eq!(tree.tenant_size(t0), 0);
        assert_eq!(tree.tenant_size(t1), 4);
        assert_eq!(tree.tenant_size(t2), 3);
        assert_eq!(tree.prefix_match_tenant("abcd", t1), 4);
        assert_eq!(tree.prefix_match_tenant("exy", t2), 3);
        assert_eq!(tree.prefix_match_tenant("exy", t1), 0);
        assert_eq!(tree.total_size(), 7);
    });
}

#[test]
fn insert_races_eviction_of_its_path() {
    model(|| {
        let tree = Arc::new(TextTree::with_clock(Clock::Logical));
        let t0 = tree.intern("t0");
        let t1 = tree.intern("t1");
        tree.insert("ab", t0);
        // Another shard ('b' = 98): makes t0 exceed the limit, used later.
        tree.insert("bcdef", t0);

        // Walks "ab" (adding t1 to it), then adds the leaf "c"; t1 ends at 3
        // symbols, within the limit, so eviction never takes from t1.
        let writer = {
            let tree = Arc::clone(&tree);
            thread::spawn(move || tree.insert("abc", t1))
        };
        // t0 holds 7 > 3: its least recently used leaf "ab" goes first,
        // which frees the node the writer walks through if t1 does not hold
        // it yet. Then "bcdef" goes too (5 > 3).
        tree.evict_tenant_by_size(3);
        writer.join().unwrap();

        tree.validate().unwrap();
        assert_eq!(tree.tenant_size(t0), 0);
        assert_eq!(tree.tenant_size(t1), 3);
        assert_eq!(tree.prefix_match_tenant("abc", t1), 3);
        assert_eq!(tree.total_size(), 3);
    });
}

#[test]
fn two_inserts_add_the_same_edge() {
    model(|| {
        let tree = Arc::new(TextTree::with_clock(Clock::Logical));
        let t0 = tree.intern("t0");
        let t1 = tree.intern("t1");
        let t2 = tree.intern("t2");
        tree.insert("ab", t0);

        // Both add a leaf below "ab" whose key is 'c': the second to lock
        // "ab" must see the edge taken and walk on (splitting "cd").
        let writer = {
            let tree = Arc::clone(&tree);
            thread::spawn(move || tree.insert("abcd", t1))
        };
        tree.insert("abce", t2);
        writer.join().unwrap();

        tree.validate().unwrap();
        assert_eq!(tree.tenant_size(t0), 2);
        assert_eq!(tree.tenant_size(t1), 4);
        assert_eq!(tree.tenant_size(t2), 4);
        assert_eq!(tree.total_size(), 10);
        assert_eq!(tree.prefix_match_tenant("abcd", t2), 3);
        assert_eq!(tree.prefix_match_tenant("abce", t1), 3);
    });
}
