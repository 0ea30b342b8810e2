//! loom: every tenant's match in one walk (`prefix_match_tenants`) racing an
//! insert that splits a node on the walked path. The walk reads each node's
//! owners on the way down under the shard's shared lock, as a lookup does;
//! a split puts a new node above the one the walk may stand on and copies
//! the owners to it, so a tenant's deepest node must still end where the
//! walk counts it, and the new tenant is reported with all it holds or with
//! nothing (never part of its label, never a length it does not hold).
//!
//! Bound: 2 threads, one operation each, `LOOM_MAX_PREEMPTIONS=2`.
#![cfg(loom)]

mod loom_support;

use loom::sync::Arc;
use loom::thread;
use loom_support::model;
use radix_affinity::{Clock, TenantMatches, TextTree};

#[test]
fn every_tenant_walk_races_a_split_of_its_path() {
    model(|| {
        let tree = Arc::new(TextTree::with_clock(Clock::Logical));
        let t0 = tree.intern("t0");
        let t1 = tree.intern("t1");
        tree.insert("abcdef", t0);

        let reader = {
            let tree = Arc::clone(&tree);
            thread::spawn(move || {
                let mut found = TenantMatches::new();
                tree.prefix_match_tenants("abcdefgh", &mut found);
                (found.get(t0), found.get(t1), found.len(), found.input())
            })
        };
        // Cuts "abcdef" into "abc" + "def" and gives t1 "abc" + "z".
        tree.insert("abcz", t1);
        let (m0, m1, holders, input) = reader.join().unwrap();

        assert_eq!(m0, 6, "t0 holds all of abcdef before and after the split");
        assert!(m1 == 0 || m1 == 3, "t1 holds abc or nothing yet: {m1}");
        assert_eq!(holders, 1 + usize::from(m1 > 0));
        assert_eq!(input, 8);
        tree.validate().unwrap();
    });
}
