//! loom: a lookup racing an insert that splits the edge it is walking.
//!
//! Bound: 2 threads, one operation each, `LOOM_MAX_PREEMPTIONS=2`; runs in
//! well under a second.
#![cfg(loom)]

mod loom_support;

use loom::sync::Arc;
use loom::thread;
use loom_support::model;
use radix_affinity::{Clock, TextTree};

#[test]
fn match_races_edge_split() {
    model(|| {
        let tree = Arc::new(TextTree::with_clock(Clock::Logical));
        let t0 = tree.intern("t0");
        let t1 = tree.intern("t1");
        tree.insert("abc", t0);

        let writer = {
            let tree = Arc::clone(&tree);
            thread::spawn(move || tree.insert("abd", t1))
        };
        // Before the split the deepest node is "abc" (t0 only); after it, "ab"
        // is shared and t1 used it last. Either way 2 chars match.
        let m = tree.prefix_match("abx");
        assert_eq!((m.matched, m.input), (2, 3));
        assert!(m.tenant == Some(t0) || m.tenant == Some(t1));
        let full = tree.prefix_match("abc");
        assert_eq!((full.tenant, full.matched), (Some(t0), 3));
        writer.join().unwrap();

        tree.validate().unwrap();
        assert_eq!(tree.tenant_size(t0), 3);
        assert_eq!(tree.tenant_size(t1), 3);
        assert_eq!(tree.prefix_match_tenant("abd", t1), 3);
        assert_eq!(tree.prefix_match_tenant("abd", t0), 2);
    });
}

#[test]
fn two_inserts_split_the_same_edge() {
    model(|| {
        let tree = Arc::new(TextTree::with_clock(Clock::Logical));
        let t0 = tree.intern("t0");
        let t1 = tree.intern("t1");
        tree.insert("abcd", t0);
        let writer = {
            let tree = Arc::clone(&tree);
            thread::spawn(move || tree.insert("abx", t1))
        };
        tree.insert("aby", t0);
        writer.join().unwrap();
        tree.validate().unwrap();
        assert_eq!(tree.tenant_size(t0), 5, "ab + cd + y");
        assert_eq!(tree.tenant_size(t1), 3);
        assert_eq!(tree.total_size(), 8);
    });
}
