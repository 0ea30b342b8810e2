//! loom models of cache-aware's own synchronization: a selection (prefix
//! match, then insert for the chosen worker) racing membership events.
//! The tree's internals are modelled by radix-affinity's own loom tests;
//! here they only have to be consistent under loom's scheduler.
//!
//! Bound: LOOM_MAX_PREEMPTIONS=2, two threads, one operation each.
#![cfg(loom)]

use std::sync::Arc;

use lb_policies::{
    Backend, BasicBackend, CacheAware, CacheAwareConfig, MembershipEvent, Policy, PolicyState,
    RequestContext,
};
use loom::thread;

/// Runs `f` under loom with room for the tree's accounting: a first insert
/// touches a few dozen atomics (node, shard ledger, tree and budget
/// counters, the tenant's shard bitmap), past loom's default of 1,000
/// branches per execution.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.max_branches = 20_000;
    builder.check(f);
}

const TEXT: &str = "abcd";

fn setup() -> (Arc<CacheAware>, Arc<Vec<BasicBackend>>) {
    let policy = Arc::new(CacheAware::new(CacheAwareConfig::default()).expect("valid"));
    let fleet = Arc::new(vec![BasicBackend::new("w0")]);
    policy.on_membership(MembershipEvent::Added {
        key: fleet[0].key(),
    });
    (policy, fleet)
}

fn route(policy: &CacheAware, fleet: &[BasicBackend]) -> usize {
    policy
        .select(fleet, &RequestContext::new("m").with_text(TEXT))
        .expect("w0 is available")
        .index
}

/// A request routed to w0 (from a slice taken before w0 left) racing w0's
/// removal: whichever wins, no affinity for w0 survives.
#[test]
fn removal_racing_selection_leaves_no_stale_affinity() {
    model(|| {
        let (policy, fleet) = setup();
        let t = {
            let (policy, fleet) = (Arc::clone(&policy), Arc::clone(&fleet));
            thread::spawn(move || route(&policy, &fleet))
        };
        policy.on_membership(MembershipEvent::Removed { key: "w0" });
        assert_eq!(t.join().expect("no panic"), 0);
        assert_eq!(policy.affinity_size("m", "w0"), 0);
    });
}

/// Replacement (same key, new lifetime) racing a selection: the old
/// lifetime's affinity is gone or, if the insert came after the
/// replacement, it belongs to the new lifetime; either way the tree and the
/// member table agree (the worker is still a member and can hit).
#[test]
fn replacement_racing_selection_keeps_membership() {
    model(|| {
        let (policy, fleet) = setup();
        // The model's tree exists before the race (its first request).
        route(&policy, &fleet);
        let t = {
            let (policy, fleet) = (Arc::clone(&policy), Arc::clone(&fleet));
            thread::spawn(move || route(&policy, &fleet))
        };
        policy.on_membership(MembershipEvent::Replaced { key: "w0" });
        t.join().expect("no panic");
        let size = policy.affinity_size("m", "w0");
        assert!(size == 0 || size == TEXT.len(), "size {size}");
        // Still a member: routing learns again.
        route(&policy, &fleet);
        assert_eq!(policy.affinity_size("m", "w0"), TEXT.len());
    });
}

/// Two first requests for a new model race to create its tree: exactly one
/// tree results and both see the member.
#[test]
fn concurrent_first_requests_create_one_tree() {
    model(|| {
        let (policy, fleet) = setup();
        let t = {
            let (policy, fleet) = (Arc::clone(&policy), Arc::clone(&fleet));
            thread::spawn(move || route(&policy, &fleet))
        };
        route(&policy, &fleet);
        t.join().expect("no panic");
        assert_eq!(policy.affinity_size("m", "w0"), TEXT.len());
    });
}
