//! loom: node-level locking. Inserts share the shard with lookups and with
//! each other and lock only the nodes they change; a lookup reads a node
//! between two equal versions and retries when a writer changed it. These
//! models race writers on one node (two new children, a new owner against a
//! split, a third child moving the children to an array, which under loom
//! also grows the two-slot node arena under the exclusive lock) against each
//! other and against lookups, which must only ever see states that some
//! order of the operations produces.
//!
//! Bound: 2 threads, one or two operations each, `LOOM_MAX_PREEMPTIONS=2`.
//! Under loom there are 4 shards chosen by first symbol modulo 4, so texts
//! starting with 'a' (97), 'e' (101) and 'i' (105) share a shard.
#![cfg(loom)]

mod loom_support;

use loom::sync::Arc;
use loom::thread;
use loom_support::model;
use radix_affinity::{Clock, TextTree};

#[test]
fn two_new_children_of_one_node_race_a_lookup() {
    model(|| {
        let tree = Arc::new(TextTree::with_clock(Clock::Logical));
        let t0 = tree.intern("t0");
        let t1 = tree.intern("t1");
        let t2 = tree.intern("t2");
        tree.insert("ab", t0);

        let writer = {
            let tree = Arc::clone(&tree);
            thread::spawn(move || tree.insert("abc", t1))
        };
        tree.insert("abd", t2);
        // The writer's leaf is there or not yet. An insert becomes visible
        // top-down, one node at a time, so t1 may already hold "ab" while
        // its leaf "c" is not linked yet: then "ab" is the match and t1, as
        // its most recent user, may be the answer.
        let m = tree.prefix_match("abc");
        match m.matched {
            3 => assert_eq!(m.tenant, Some(t1)),
            2 => assert!(m.tenant.is_some(), "{m:?}"),
            _ => panic!("{m:?}"),
        }
        writer.join().unwrap();

        tree.validate().unwrap();
        assert_eq!(tree.tenant_size(t0), 2);
        assert_eq!(tree.tenant_size(t1), 3);
        assert_eq!(tree.tenant_size(t2), 3);
        assert_eq!(tree.prefix_match("abc").matched, 3);
        assert_eq!(tree.prefix_match_tenant("abd", t2), 3);
        assert_eq!(tree.prefix_match_tenant("abc", t2), 2);
    });
}

#[test]
fn lookups_of_a_held_text_race_its_split() {
    model(|| {
        let tree = Arc::new(TextTree::with_clock(Clock::Logical));
        let t0 = tree.intern("t0");
        let t1 = tree.intern("t1");
        tree.insert("abcdef", t0);

        // Cuts "abcdef" into "ab" + "cdef" and adds the leaf "x".
        let writer = {
            let tree = Arc::clone(&tree);
            thread::spawn(move || tree.insert("abx", t1))
        };
        // t0 holds the whole text before, during and after the split.
        assert_eq!(tree.prefix_match_tenant("abcdef", t0), 6);
        let m = tree.prefix_match("abcdefg");
        assert_eq!((m.tenant, m.matched, m.input), (Some(t0), 6, 7));
        writer.join().unwrap();

        tree.validate().unwrap();
        assert_eq!(tree.tenant_size(t0), 6);
        assert_eq!(tree.tenant_size(t1), 3);
        assert_eq!(tree.prefix_match_tenant("abcdef", t1), 2);
    });
}

#[test]
fn new_owner_races_split_of_the_same_node() {
    model(|| {
        let tree = Arc::new(TextTree::with_clock(Clock::Logical));
        let t0 = tree.intern("t0");
        let t1 = tree.intern("t1");
        let t2 = tree.intern("t2");
        tree.insert("abcdef", t0);

        // Adds t1 as an owner of the node "abcdef" ...
        let writer = {
            let tree = Arc::clone(&tree);
            thread::spawn(move || tree.insert("abcdef", t1))
        };
        // ... which this insert cuts after "ab": whichever goes first, the
        // new upper node must end up held by t1 too.
        tree.insert("abz", t2);
        writer.join().unwrap();

        tree.validate().unwrap();
        assert_eq!(tree.tenant_size(t0), 6);
        assert_eq!(tree.tenant_size(t1), 6);
        assert_eq!(tree.tenant_size(t2), 3);
        assert_eq!(tree.prefix_match_tenant("abcdef", t1), 6);
        assert_eq!(tree.prefix_match_tenant("abzz", t1), 2);
        assert_eq!(tree.recount(), tree.tenant_sizes());
    });
}

#[test]
fn third_child_and_arena_growth_race_a_lookup() {
    model(|| {
        let tree = Arc::new(TextTree::with_clock(Clock::Logical));
        let t0 = tree.intern("t0");
        let t1 = tree.intern("t1");
        tree.insert("ab", t0);
        tree.insert("eb", t0);

        // A third child of the shard's root: its children move from the
        // node's two inline slots to an array, and the node arena grows.
        let writer = {
            let tree = Arc::clone(&tree);
            thread::spawn(move || tree.insert("ib", t1))
        };
        let m = tree.prefix_match("ebb");
        assert_eq!((m.tenant, m.matched), (Some(t0), 2));
        assert_eq!(tree.prefix_match_tenant("ab", t0), 2);
        writer.join().unwrap();

        tree.validate().unwrap();
        assert_eq!(tree.tenant_size(t0), 4);
        assert_eq!(tree.tenant_size(t1), 2);
        let m = tree.prefix_match("ibis");
        assert_eq!((m.tenant, m.matched), (Some(t1), 2));
    });
}

#[test]
fn child_inserted_in_place_races_a_lookup_of_a_later_key() {
    model(|| {
        let tree = Arc::new(TextTree::with_clock(Clock::Logical));
        let t0 = tree.intern("t0");
        let t1 = tree.intern("t1");
        // Three children of the shard's root, in an array with room for a
        // fourth.
        tree.insert("ab", t0);
        tree.insert("eb", t0);
        tree.insert("mb", t0);

        // 'i' sorts between 'e' and 'm': the writer moves the entry of "mb"
        // one place up, in place, while the lookup may be searching for it.
        let writer = {
            let tree = Arc::clone(&tree);
            thread::spawn(move || tree.insert("ib", t1))
        };
        let m = tree.prefix_match("mbx");
        assert_eq!((m.tenant, m.matched), (Some(t0), 2));
        writer.join().unwrap();

        tree.validate().unwrap();
        assert_eq!(tree.prefix_match("ib").tenant, Some(t1));
        assert_eq!(tree.tenant_size(t0), 6);
    });
}
