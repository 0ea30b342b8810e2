//! Properties of the counter, random and hash policies.

mod common;

use common::{announce, arb_fleet, fleet, key, session};
use lb_policies::{
    Backend, BasicBackend, ConsistentHash, ConsistentHashConfig, DecisionReason, MembershipEvent,
    Policy, PolicyState, PowerOfTwo, RandomPolicy, RendezvousHash, RequestContext, RoundRobin,
};
use proptest::prelude::*;

fn placements(
    policy: &dyn Policy<BasicBackend>,
    fleet: &[BasicBackend],
    keys: usize,
) -> Vec<String> {
    (0..keys)
        .map(|k| {
            let s = session(k);
            let ctx = RequestContext::new("m").with_session(&s);
            let d = policy.select(fleet, &ctx).expect("an available worker");
            assert!(matches!(d.reason, DecisionReason::HashOwner));
            fleet[d.index].key().to_owned()
        })
        .collect()
}

fn ring(fleet: &[BasicBackend]) -> ConsistentHash {
    let p = ConsistentHash::new(ConsistentHashConfig::default()).expect("valid config");
    announce(&p, fleet);
    p
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn round_robin_visits_every_candidate_once_per_cycle(n in 1usize..40, start in 0usize..1000, cycles in 1usize..4) {
        let fleet = fleet(n);
        let rr = RoundRobin::starting_at(start);
        let ctx = RequestContext::new("m");
        for _ in 0..cycles {
            let mut seen = vec![0u32; n];
            for _ in 0..n {
                let d = rr.select(&fleet[..], &ctx).expect("all available");
                prop_assert_eq!(d.reason, DecisionReason::RoundRobin);
                seen[d.index] += 1;
            }
            prop_assert!(seen.iter().all(|&c| c == 1), "{:?}", seen);
        }
    }

    #[test]
    fn round_robin_skips_unavailable_without_double_shares(fleet in arb_fleet(24), start in 0usize..100) {
        let rr = RoundRobin::starting_at(start);
        let ctx = RequestContext::new("m");
        let up: Vec<usize> = (0..fleet.len()).filter(|&i| fleet[i].is_available()).collect();
        if up.is_empty() {
            prop_assert_eq!(rr.select(&fleet[..], &ctx), None);
            return Ok(());
        }
        let mut seen = vec![0u32; fleet.len()];
        for _ in 0..up.len() * 3 {
            let d = rr.select(&fleet[..], &ctx).expect("some available");
            seen[d.index] += 1;
        }
        for (i, &c) in seen.iter().enumerate() {
            prop_assert_eq!(c, if up.contains(&i) { 3 } else { 0 }, "{:?}", seen);
        }
    }

    #[test]
    fn random_and_p2c_pick_only_available(fleet in arb_fleet(32), seed in any::<u64>()) {
        let policies: [Box<dyn Policy<BasicBackend>>; 2] =
            [Box::new(RandomPolicy::with_seed(seed)), Box::new(PowerOfTwo::with_seed(seed))];
        let any_up = fleet.iter().any(|b| b.is_available());
        let ctx = RequestContext::new("m");
        for p in &policies {
            for _ in 0..64 {
                match p.select(&fleet, &ctx) {
                    Some(d) => prop_assert!(fleet[d.index].is_available()),
                    None => prop_assert!(!any_up),
                }
            }
        }
    }

    #[test]
    fn p2c_with_two_available_always_takes_the_less_loaded(a in 0usize..100, b in 0usize..100, seed in any::<u64>()) {
        prop_assume!(a != b);
        let fleet = [
            BasicBackend::new("a").with_load(a),
            BasicBackend::new("down").with_available(false),
            BasicBackend::new("b").with_load(b),
        ];
        let p = PowerOfTwo::with_seed(seed);
        let want = if a < b { 0 } else { 2 };
        for _ in 0..16 {
            prop_assert_eq!(p.select(&fleet[..], &RequestContext::new("m")).map(|d| d.index), Some(want));
        }
    }

    #[test]
    fn consistent_hash_add_moves_about_one_nth_to_the_new_worker(n in 3usize..16) {
        let keys = 2000;
        let before_fleet = fleet(n);
        let p = ring(&before_fleet);
        let before = placements(&p, &before_fleet, keys);
        let after_fleet = fleet(n + 1);
        p.on_membership(MembershipEvent::Added { key: &key(n) });
        let after = placements(&p, &after_fleet, keys);
        let moved: Vec<usize> = (0..keys).filter(|&k| before[k] != after[k]).collect();
        for &k in &moved {
            prop_assert_eq!(&after[k], &key(n), "a key moved between old workers");
        }
        let expected = keys as f64 / (n + 1) as f64;
        // 160 virtual nodes keep a worker's share within ~±35% of fair.
        prop_assert!((moved.len() as f64) < expected * 1.6 && (moved.len() as f64) > expected * 0.4,
            "moved {} of {}, expected ~{:.0}", moved.len(), keys, expected);
    }

    #[test]
    fn consistent_hash_removal_keeps_survivors_keys(n in 3usize..16, gone in 0usize..16) {
        let gone = gone % n;
        let keys = 1000;
        let full = fleet(n);
        let p = ring(&full);
        let before = placements(&p, &full, keys);
        p.on_membership(MembershipEvent::Removed { key: &key(gone) });
        let survivors: Vec<BasicBackend> = (0..n).filter(|&i| i != gone).map(|i| BasicBackend::new(key(i))).collect();
        let after = placements(&p, &survivors, keys);
        for k in 0..keys {
            if before[k] != key(gone) {
                prop_assert_eq!(&before[k], &after[k]);
            } else {
                prop_assert_ne!(&after[k], &key(gone));
            }
        }
    }

    #[test]
    fn consistent_hash_fails_over_and_comes_back(n in 2usize..12, down in 0usize..12) {
        let down = down % n;
        let full = fleet(n);
        let p = ring(&full);
        let before = placements(&p, &full, 300);
        full[down].set_available(false);
        for (k, owner) in before.iter().enumerate() {
            let s = session(k);
            let d = p.select(&full, &RequestContext::new("m").with_session(&s)).expect("others up");
            prop_assert_ne!(d.index, down);
            if *owner == key(down) {
                prop_assert_eq!(d.reason, DecisionReason::HashFailover);
            } else {
                prop_assert_eq!(full[d.index].key(), owner.as_str());
            }
        }
        full[down].set_available(true);
        prop_assert_eq!(placements(&p, &full, 300), before);
    }

    #[test]
    fn rendezvous_add_and_remove_move_only_what_they_must(n in 3usize..16, gone in 0usize..16) {
        let gone = gone % n;
        let keys = 2000;
        let p = RendezvousHash::new();
        let base = fleet(n);
        let before = placements(&p, &base, keys);
        let grown = fleet(n + 1);
        let after = placements(&p, &grown, keys);
        let moved = (0..keys).filter(|&k| before[k] != after[k]).count();
        for k in 0..keys {
            if before[k] != after[k] {
                prop_assert_eq!(&after[k], &key(n));
            }
        }
        let expected = keys as f64 / (n + 1) as f64;
        prop_assert!((moved as f64) < expected * 1.4 && (moved as f64) > expected * 0.6,
            "moved {}, expected ~{:.0}", moved, expected);
        let shrunk: Vec<BasicBackend> = (0..n).filter(|&i| i != gone).map(|i| BasicBackend::new(key(i))).collect();
        let after_removal = placements(&p, &shrunk, keys);
        for k in 0..keys {
            if before[k] != key(gone) {
                prop_assert_eq!(&before[k], &after_removal[k]);
            }
        }
    }

    /// The ring is maintained incrementally (merge on add, filter on
    /// remove); after any sequence of events it places keys exactly like a
    /// ring built from scratch for the surviving members.
    #[test]
    fn incremental_ring_equals_a_fresh_ring(ops in prop::collection::vec((any::<bool>(), 0usize..10), 1..40)) {
        let all = fleet(10);
        let p = ConsistentHash::new(ConsistentHashConfig::default().with_virtual_nodes(32)).expect("valid");
        let mut members = std::collections::BTreeSet::new();
        for (add, i) in ops {
            if add {
                p.on_membership(MembershipEvent::Added { key: &key(i) });
                members.insert(i);
            } else {
                p.on_membership(MembershipEvent::Removed { key: &key(i) });
                members.remove(&i);
            }
        }
        prop_assert_eq!(p.member_count(), members.len());
        let fresh = ConsistentHash::new(ConsistentHashConfig::default().with_virtual_nodes(32)).expect("valid");
        for &i in members.iter().rev() {
            fresh.on_membership(MembershipEvent::Added { key: &key(i) });
        }
        for k in 0..200 {
            let s = session(k);
            let ctx = RequestContext::new("m").with_session(&s);
            let (a, b) = (p.select(&all[..], &ctx), fresh.select(&all[..], &ctx));
            prop_assert_eq!(a, b);
            if let Some(d) = a {
                prop_assert!(members.contains(&d.index) || d.reason == DecisionReason::HashUnmapped);
            }
        }
    }

    #[test]
    fn bounded_load_never_exceeds_its_bound(fleet in arb_fleet(16), c in 1.0f64..2.0, hot_keys in 1usize..4) {
        let config = ConsistentHashConfig::default().with_bounded_load(c);
        let p = ConsistentHash::new(config).expect("valid");
        announce(&p, &fleet);
        let up = fleet.iter().filter(|b| b.is_available()).count();
        // Place a stream of requests for a few hot keys, each staying in
        // flight: the bound must hold at every step.
        for step in 0..200 {
            let s = session(step % hot_keys);
            let ctx = RequestContext::new("m").with_session(&s);
            let Some(d) = p.select(&fleet, &ctx) else {
                prop_assert_eq!(up, 0);
                return Ok(());
            };
            let total: usize = fleet.iter().filter(|b| b.is_available()).map(|b| b.load()).sum();
            let bound = (c * (total as f64 + 1.0) / up as f64).ceil() as usize;
            let chosen = &fleet[d.index];
            prop_assert!(chosen.is_available());
            prop_assert!(chosen.load() < bound, "load {} + 1 > bound {}", chosen.load(), bound);
            chosen.begin_request();
        }
    }
}

#[test]
fn keyless_requests_spread_by_load_and_say_so() {
    let fleet = fleet(4);
    let ch = ring(&fleet);
    let rv = RendezvousHash::new();
    for p in [&ch as &dyn Policy<BasicBackend>, &rv] {
        let mut seen = [0u32; 4];
        for _ in 0..40 {
            let d = p
                .select(&fleet, &RequestContext::new("m"))
                .expect("available");
            assert_eq!(d.reason, DecisionReason::NoHashKey);
            seen[d.index] += 1;
        }
        assert_eq!(seen, [10; 4], "{}", p.name());
    }
}

#[test]
fn consistent_hash_without_members_falls_back_and_says_so() {
    let fleet = fleet(3);
    let p = ConsistentHash::new(ConsistentHashConfig::default()).expect("valid");
    let d = p
        .select(&fleet[..], &RequestContext::new("m").with_user("alice"))
        .expect("available");
    assert_eq!(d.reason, DecisionReason::HashUnmapped);
    p.on_membership(MembershipEvent::Added { key: &key(1) });
    p.on_membership(MembershipEvent::Added { key: &key(1) });
    assert_eq!(p.member_count(), 1);
    let d = p
        .select(&fleet[..], &RequestContext::new("m").with_user("alice"))
        .expect("available");
    assert_eq!((d.index, d.reason), (1, DecisionReason::HashOwner));
}

#[test]
fn hash_policies_follow_key_precedence() {
    let fleet = fleet(8);
    let p = ring(&fleet);
    let by = |ctx: RequestContext<'_>| p.select(&fleet, &ctx).map(|d| d.index);
    let session_only = by(RequestContext::new("m").with_session("s-1"));
    assert_eq!(
        by(RequestContext::new("m")
            .with_session("s-1")
            .with_user("u-9")
            .with_header_key("h")),
        session_only
    );
    let user_only = by(RequestContext::new("m").with_user("u-9"));
    assert_eq!(
        by(RequestContext::new("m")
            .with_user("u-9")
            .with_header_key("h")),
        user_only
    );
}

#[test]
fn invalid_configs_are_rejected() {
    for bad in [
        ConsistentHashConfig::default().with_virtual_nodes(0),
        ConsistentHashConfig::default().with_bounded_load(0.5),
        ConsistentHashConfig::default().with_bounded_load(f64::NAN),
    ] {
        assert!(ConsistentHash::new(bad).is_err());
    }
}

#[test]
fn empty_candidate_slices_give_none() {
    let empty: Vec<BasicBackend> = Vec::new();
    let ctx = RequestContext::new("m").with_session("s");
    let policies: Vec<Box<dyn Policy<BasicBackend>>> = vec![
        Box::new(RandomPolicy::with_seed(1)),
        Box::new(RoundRobin::new()),
        Box::new(PowerOfTwo::with_seed(1)),
        Box::new(lb_policies::LeastLoaded::new()),
        Box::new(ring(&fleet(3))),
        Box::new(RendezvousHash::new()),
    ];
    for p in &policies {
        assert_eq!(p.select(&empty, &ctx), None, "{}", p.name());
    }
}

#[test]
fn random_is_uniform_over_available_candidates() {
    let fleet = fleet(8);
    fleet[2].set_available(false);
    fleet[6].set_available(false);
    let p = RandomPolicy::with_seed(42);
    let mut seen = [0u32; 8];
    for _ in 0..6000 {
        seen[p
            .select(&fleet[..], &RequestContext::new("m"))
            .expect("up")
            .index] += 1;
    }
    for (i, &c) in seen.iter().enumerate() {
        if i == 2 || i == 6 {
            assert_eq!(c, 0);
        } else {
            // Expect 1000 each; ±15% is over 5 standard deviations.
            assert!((850..=1150).contains(&c), "{seen:?}");
        }
    }
}

/// Engine-reported load overrides in-flight counts where the source knows
/// the worker.
#[test]
fn power_of_two_uses_the_load_source() {
    struct Reported;
    impl lb_policies::LoadSource for Reported {
        fn load(&self, key: &str) -> Option<usize> {
            match key {
                "a" => Some(50), // busy engine, idle in our counts
                "b" => Some(1),
                _ => None,
            }
        }
    }
    let fleet = [
        BasicBackend::new("a").with_load(0),
        BasicBackend::new("b").with_load(9),
    ];
    let plain = PowerOfTwo::with_seed(5);
    let informed = PowerOfTwo::with_seed(5).with_load_source(std::sync::Arc::new(Reported));
    for _ in 0..16 {
        let ctx = RequestContext::new("m");
        assert_eq!(plain.select(&fleet[..], &ctx).map(|d| d.index), Some(0));
        assert_eq!(informed.select(&fleet[..], &ctx).map(|d| d.index), Some(1));
    }
    // Unknown to the source: falls back to in-flight load.
    let fleet = [
        BasicBackend::new("x").with_load(3),
        BasicBackend::new("y").with_load(1),
    ];
    assert_eq!(
        informed
            .select(&fleet[..], &RequestContext::new("m"))
            .map(|d| d.index),
        Some(1)
    );
}

/// Two real threads hammering one round robin: the atomic counter hands
/// out distinct turns, so the totals are exact.
#[test]
fn round_robin_is_exact_under_concurrency() {
    let fleet = std::sync::Arc::new(fleet(5));
    let rr = std::sync::Arc::new(RoundRobin::new());
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (fleet, rr) = (fleet.clone(), rr.clone());
            std::thread::spawn(move || {
                let mut seen = [0u32; 5];
                for _ in 0..10_000 {
                    seen[rr
                        .select(&fleet[..], &RequestContext::new("m"))
                        .expect("up")
                        .index] += 1;
                }
                seen
            })
        })
        .collect();
    let mut total = [0u32; 5];
    for t in threads {
        for (sum, n) in total.iter_mut().zip(t.join().expect("no panic")) {
            *sum += n;
        }
    }
    assert_eq!(total, [4000; 5]);
}
