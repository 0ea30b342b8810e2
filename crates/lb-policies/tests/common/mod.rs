//! Shared fleets and strategies for the integration tests.
#![allow(dead_code)] // each test crate uses a different subset

use lb_policies::{BasicBackend, MembershipEvent, Policy};
use proptest::prelude::*;

/// Worker keys as discovery would produce them.
pub(crate) fn key(i: usize) -> String {
    format!("http://worker-{i}:8000")
}

/// `n` available, idle workers.
pub(crate) fn fleet(n: usize) -> Vec<BasicBackend> {
    (0..n).map(|i| BasicBackend::new(key(i))).collect()
}

/// Announces every worker of `fleet` to `policy`.
pub(crate) fn announce(policy: &dyn Policy<BasicBackend>, fleet: &[BasicBackend]) {
    use lb_policies::Backend;
    for b in fleet {
        policy.on_membership(MembershipEvent::Added { key: b.key() });
    }
}

/// A fleet of 1..=max workers with random loads and availability.
pub(crate) fn arb_fleet(max: usize) -> impl Strategy<Value = Vec<BasicBackend>> {
    prop::collection::vec((0usize..200, any::<bool>(), 0u64..50), 1..=max).prop_map(|spec| {
        spec.into_iter()
            .enumerate()
            .map(|(i, (load, up, processed))| {
                let b = BasicBackend::new(key(i)).with_load(load).with_available(up);
                b.set_processed(processed);
                b
            })
            .collect()
    })
}

/// Session-like keys.
pub(crate) fn session(i: usize) -> String {
    format!("session-{i}")
}
