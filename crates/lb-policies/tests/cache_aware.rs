//! Cache-aware: affinity, the per-request gate, fair ties, membership, and
//! the regressions of the upstream router's cache-aware bugs.

mod common;

use common::{announce, fleet, key};
use lb_policies::{
    Backend, BasicBackend, CacheAware, CacheAwareConfig, DecisionReason, LoadGate, MembershipEvent,
    Policy, PolicyState, RequestContext, TokenChoice,
};
use proptest::prelude::*;
use radix_affinity::Clock;

const MODEL: &str = "m";

fn policy(gate: LoadGate) -> CacheAware {
    let mut config = CacheAwareConfig::default();
    config.gate = gate;
    CacheAware::new(config).expect("default knobs are valid")
}

fn select(p: &CacheAware, fleet: &[BasicBackend], text: &str) -> (usize, DecisionReason) {
    let d = p
        .select(fleet, &RequestContext::new(MODEL).with_text(text))
        .expect("an available worker");
    assert!(fleet[d.index].is_available(), "chose an unavailable worker");
    (d.index, d.reason)
}

/// A prompt long enough that a repeat matches far above the threshold.
fn prompt(i: usize) -> String {
    format!("system prompt #{i}: you are a careful assistant; answer briefly. ").repeat(4)
}

/// Routes `text` once so that some worker owns it; returns that worker.
fn establish(p: &CacheAware, fleet: &[BasicBackend], text: &str) -> usize {
    let (owner, reason) = select(p, fleet, text);
    assert_eq!(reason, DecisionReason::CacheLowMatch);
    assert_eq!(select(p, fleet, text), (owner, DecisionReason::CacheHit));
    owner
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Loads within the thresholds never break affinity.
    #[test]
    fn balanced_load_keeps_same_text_on_same_worker(
        n in 2usize..12,
        loads in prop::collection::vec(0usize..60, 12),
        texts in prop::collection::vec("[a-z ]{40,120}", 1..6),
    ) {
        let fleet = fleet(n);
        let p = policy(LoadGate::PerRequest);
        announce(&p, &fleet);
        for text in &texts {
            let (owner, _) = select(&p, &fleet, text);
            for (b, load) in fleet.iter().zip(&loads) {
                b.set_load(*load); // spread < 64: no worker counts as overloaded
            }
            for _ in 0..3 {
                let (again, reason) = select(&p, &fleet, text);
                prop_assert_eq!(again, owner);
                prop_assert_eq!(reason, DecisionReason::CacheHit);
            }
            for b in &fleet {
                b.set_load(0);
            }
        }
    }

    /// The owner yields exactly when it is over both margins against the
    /// least loaded available candidate.
    #[test]
    fn overloaded_preferred_worker_yields(n in 2usize..10, min_load in 0usize..200, extra in 0usize..300) {
        let fleet = fleet(n);
        let p = policy(LoadGate::PerRequest);
        announce(&p, &fleet);
        let text = prompt(n);
        let owner = establish(&p, &fleet, &text);
        for b in &fleet {
            b.set_load(min_load + 10);
        }
        fleet[(owner + 1) % n].set_load(min_load);
        let owner_load = min_load + extra;
        fleet[owner].set_load(owner_load);
        let yields = owner_load > min_load + 64 && owner_load as f64 > min_load as f64 * 1.5;
        prop_assert_eq!(p.config().preferred_yields(owner_load, min_load), yields);
        let (chosen, reason) = select(&p, &fleet, &text);
        if yields {
            prop_assert_eq!(reason, DecisionReason::CacheOverloaded);
            prop_assert_eq!(chosen, (owner + 1) % n);
        } else {
            prop_assert_eq!((chosen, reason), (owner, DecisionReason::CacheHit));
        }
    }

    /// An idle unhealthy worker is not "the least loaded": it must not make
    /// a moderately loaded owner yield (the per-request gate uses available
    /// candidates only). The fleet-wide gate is fooled, as upstream was.
    #[test]
    fn unhealthy_idle_worker_does_not_flip_the_gate(n in 3usize..10, base in 65usize..200) {
        let fleet = fleet(n);
        for gate in [LoadGate::PerRequest, LoadGate::FleetWide] {
            let p = policy(gate);
            announce(&p, &fleet);
            let text = prompt(base);
            for b in &fleet {
                b.set_load(0);
                b.set_available(true);
            }
            let owner = establish(&p, &fleet, &text);
            for b in &fleet {
                b.set_load(base);
            }
            let down = (owner + 1) % n;
            fleet[down].set_load(0);
            fleet[down].set_available(false);
            let (chosen, reason) = select(&p, &fleet, &text);
            match gate {
                LoadGate::PerRequest => {
                    prop_assert_eq!((chosen, reason), (owner, DecisionReason::CacheHit));
                }
                _ => prop_assert_eq!(reason, DecisionReason::CacheFleetImbalance),
            }
        }
    }
}

/// One hot worker turns affinity off for everyone under the fleet-wide
/// gate, but only for its own requests under the per-request gate.
#[test]
fn one_hot_worker_does_not_disable_affinity_for_others() {
    let fleet = fleet(4);
    let p = policy(LoadGate::PerRequest);
    let old = policy(LoadGate::FleetWide);
    announce(&p, &fleet);
    announce(&old, &fleet);
    // Give every worker a prompt of its own.
    let texts: Vec<String> = (0..4).map(prompt).collect();
    let owners: Vec<usize> = texts.iter().map(|t| establish(&p, &fleet, t)).collect();
    let old_owners: Vec<usize> = texts.iter().map(|t| establish(&old, &fleet, t)).collect();
    let mut sorted = owners.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        [0, 1, 2, 3],
        "cold prompts spread over idle workers"
    );
    let hot = owners[0];
    fleet[hot].set_load(500);
    for (t, &owner) in texts.iter().zip(&owners).skip(1) {
        assert_eq!(select(&p, &fleet, t), (owner, DecisionReason::CacheHit));
    }
    for t in texts.iter().skip(1) {
        let (_, reason) = select(&old, &fleet, t);
        assert_eq!(reason, DecisionReason::CacheFleetImbalance);
    }
    assert_eq!(
        select(&p, &fleet, &texts[0]).1,
        DecisionReason::CacheOverloaded
    );
    assert_ne!(old_owners.len(), 0);
}

/// Equal-load cold traffic spreads evenly (measured: max − min share).
#[test]
fn equal_load_cold_traffic_spreads_evenly() {
    for n in [2usize, 3, 8, 13] {
        let fleet = fleet(n);
        let p = policy(LoadGate::PerRequest);
        announce(&p, &fleet);
        let per_worker = 50;
        let mut counts = vec![0usize; n];
        for i in 0..n * per_worker {
            // Distinct leading characters: no request matches an earlier one.
            let text = format!("{i:08}-{}", "cold request body ".repeat(3));
            let (chosen, reason) = select(&p, &fleet, &text);
            assert_eq!(reason, DecisionReason::CacheLowMatch);
            counts[chosen] += 1;
        }
        let spread = counts.iter().max().unwrap_or(&0) - counts.iter().min().unwrap_or(&0);
        eprintln!("n={n}: counts {counts:?}, spread {spread}");
        assert!(spread <= 1, "uneven cold spread {counts:?}");
    }
}

/// Cold traffic with live load: requests start on the chosen worker and
/// finish after a pseudo-random number of later arrivals. Shares stay within
/// a few percent of fair (measured and printed).
#[test]
fn cold_traffic_with_live_load_spreads_evenly() {
    let n = 8;
    let fleet = fleet(n);
    let p = policy(LoadGate::PerRequest);
    announce(&p, &fleet);
    let mut in_flight: Vec<(usize, usize)> = Vec::new(); // (worker, finishes at)
    let mut counts = vec![0usize; n];
    let mut rng = 0x9e37_79b9_u64;
    let total = 4000;
    for step in 0..total {
        in_flight.retain(|&(w, until)| {
            let keep = until > step;
            if !keep {
                fleet[w].end_request();
            }
            keep
        });
        let text = format!("{step:06} {}", "unrelated request ".repeat(2));
        let (chosen, _) = select(&p, &fleet, &text);
        fleet[chosen].begin_request();
        counts[chosen] += 1;
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        in_flight.push((chosen, step + 1 + (rng % 40) as usize));
    }
    let fair = total / n;
    let worst = counts.iter().map(|&c| c.abs_diff(fair)).max().unwrap_or(0);
    eprintln!("live-load cold spread: counts {counts:?}, worst deviation {worst} of {fair}");
    assert!(
        worst * 100 <= fair * 3,
        "share off by more than 3%: {counts:?}"
    );
}

/// With processed counts advancing (the host's real behaviour), ties still
/// go to the worker that has had the least work.
#[test]
fn ties_prefer_fewer_processed_requests() {
    let fleet = fleet(3);
    let p = policy(LoadGate::PerRequest);
    fleet[0].set_processed(10);
    fleet[1].set_processed(3);
    fleet[2].set_processed(7);
    let (chosen, _) = select(&p, &fleet, "a cold prompt");
    assert_eq!(chosen, 1);
}

// ---- Regressions from the upstream write-up (PR #299 / #238) ----

/// Tree initialised on first membership: no missing-tree fallback; the
/// second identical request already hits.
#[test]
fn regression_fresh_fleet_routes_cache_aware_from_the_first_request() {
    let fleet = fleet(3);
    let p = policy(LoadGate::PerRequest);
    announce(&p, &fleet);
    assert!(!p.has_model(MODEL));
    let text = prompt(1);
    let (owner, reason) = select(&p, &fleet, &text);
    assert_eq!(reason, DecisionReason::CacheLowMatch);
    assert!(p.has_model(MODEL));
    assert!(p.affinity_size(MODEL, &key(owner)) >= text.chars().count());
    assert_eq!(select(&p, &fleet, &text), (owner, DecisionReason::CacheHit));
}

/// A model first seen after the fleet was announced gets every member.
#[test]
fn regression_late_model_is_seeded_with_the_fleet() {
    let fleet = fleet(2);
    let p = policy(LoadGate::PerRequest);
    announce(&p, &fleet);
    p.on_membership(MembershipEvent::Removed { key: &key(1) });
    // Worker 1 was removed before the model existed: a stale slice that
    // still lists it cannot give it affinity.
    fleet[0].set_load(5);
    let (chosen, _) = select(&p, &fleet, &prompt(7));
    assert_eq!(chosen, 1, "least loaded of the (stale) slice");
    assert_eq!(
        p.affinity_size(MODEL, &key(1)),
        0,
        "removed worker gained affinity"
    );
}

/// Stale affinity removed on removal.
#[test]
fn regression_removal_drops_affinity() {
    let fleet = fleet(3);
    let p = policy(LoadGate::PerRequest);
    announce(&p, &fleet);
    let text = prompt(2);
    let owner = establish(&p, &fleet, &text);
    p.on_membership(MembershipEvent::Removed { key: &key(owner) });
    assert_eq!(p.affinity_size(MODEL, &key(owner)), 0);
    let survivors: Vec<BasicBackend> = (0..3)
        .filter(|&i| i != owner)
        .map(|i| BasicBackend::new(key(i)))
        .collect();
    let (_, reason) = select(&p, &survivors, &text);
    assert_eq!(reason, DecisionReason::CacheLowMatch);
    // A stale slice still listing the removed worker: no hit for it, and
    // routing there does not resurrect its affinity.
    let (_, reason) = select(&p, &fleet, &prompt(3));
    assert_ne!(reason, DecisionReason::CacheHit);
    assert_eq!(p.affinity_size(MODEL, &key(owner)), 0);
    // Added again: it takes part again.
    p.on_membership(MembershipEvent::Added { key: &key(owner) });
    for b in &fleet {
        b.set_load(1);
    }
    let fresh = prompt(4);
    assert_eq!(select(&p, &fleet, &fresh).0, owner);
    assert_eq!(
        select(&p, &fleet, &fresh),
        (owner, DecisionReason::CacheHit)
    );
}

/// Stale affinity removed on replacement (same URL, new lifetime); the
/// worker stays a member.
#[test]
fn regression_replacement_drops_affinity_but_keeps_membership() {
    let fleet = fleet(3);
    let p = policy(LoadGate::PerRequest);
    announce(&p, &fleet);
    let text = prompt(5);
    let owner = establish(&p, &fleet, &text);
    p.on_membership(MembershipEvent::Replaced { key: &key(owner) });
    assert_eq!(p.affinity_size(MODEL, &key(owner)), 0);
    let (again, reason) = select(&p, &fleet, &text);
    assert_eq!(reason, DecisionReason::CacheLowMatch);
    assert!(
        p.affinity_size(MODEL, &key(again)) > 0,
        "the new lifetime learns again"
    );
}

/// Overloaded owner yields (live load, as persistent workers report it).
#[test]
fn regression_overloaded_owner_yields() {
    let fleet = fleet(2);
    let p = policy(LoadGate::PerRequest);
    announce(&p, &fleet);
    let text = prompt(6);
    let owner = establish(&p, &fleet, &text);
    for _ in 0..100 {
        fleet[owner].begin_request();
    }
    let (chosen, reason) = select(&p, &fleet, &text);
    assert_eq!(
        (chosen, reason),
        (1 - owner, DecisionReason::CacheOverloaded)
    );
}

/// Equal-load fairness: not "index 0 every time".
#[test]
fn regression_equal_load_is_not_first_in_list() {
    let fleet = fleet(4);
    let p = policy(LoadGate::PerRequest);
    let firsts: Vec<usize> = (0..8)
        .map(|i| select(&p, &fleet, &format!("{i} cold")).0)
        .collect();
    assert_eq!(firsts.iter().filter(|&&i| i == 0).count(), 2, "{firsts:?}");
}

#[test]
fn owner_that_is_down_hands_over_and_says_so() {
    let fleet = fleet(3);
    let p = policy(LoadGate::PerRequest);
    let text = prompt(8);
    let owner = establish(&p, &fleet, &text);
    fleet[owner].set_available(false);
    let (chosen, reason) = select(&p, &fleet, &text);
    assert_ne!(chosen, owner);
    assert_eq!(reason, DecisionReason::CacheOwnerUnavailable);
}

#[test]
fn token_ids_route_like_text() {
    let fleet = fleet(3);
    let p = policy(LoadGate::PerRequest);
    let tokens: Vec<u32> = (0..200).collect();
    let ctx = RequestContext::new(MODEL).with_tokens(&tokens);
    let first = p.select(&fleet[..], &ctx).expect("available");
    let again = p.select(&fleet[..], &ctx).expect("available");
    assert_eq!(
        (again.index, again.reason),
        (first.index, DecisionReason::CacheHit)
    );
    let no_input = p
        .select(&fleet[..], &RequestContext::new(MODEL))
        .expect("available");
    assert_eq!(no_input.reason, DecisionReason::CacheLowMatch);
}

/// An engine reuses whole KV blocks only: a token match shorter than one
/// block is no match, and the threshold applies to the tokens of whole
/// blocks.
#[test]
fn token_matches_count_in_whole_blocks() {
    let fleet = fleet(2);
    let mut config = CacheAwareConfig::default();
    config.block_size = 16;
    config.cache_threshold = 0.5;
    // The threshold is the gate's (the default); the cost has none.
    config.token_choice = TokenChoice::Gate;
    let p = CacheAware::new(config).unwrap();
    let select_tokens = |tokens: &[u32]| {
        p.select(&fleet[..], &RequestContext::new(MODEL).with_tokens(tokens))
            .expect("available")
    };
    // Worker A holds 0..40 (two whole blocks and 8 tokens of a third).
    let held: Vec<u32> = (0..40).collect();
    let owner = select_tokens(&held).index;

    // Shares 15 tokens of 20: 75 % in symbols, but not one whole block.
    let mut short: Vec<u32> = (0..15).collect();
    short.extend(1000..1005);
    let d = select_tokens(&short);
    assert_eq!(d.reason, DecisionReason::CacheLowMatch, "{d:?}");

    // Shares 40 tokens of 48: 83 % in symbols, 32 cached tokens = 67 %.
    let mut long: Vec<u32> = (0..40).collect();
    long.extend(2000..2008);
    let d = select_tokens(&long);
    assert_eq!((d.index, d.reason), (owner, DecisionReason::CacheHit));
    assert_eq!(d.match_permille, Some(667), "32 of 48 tokens: {d:?}");
    assert_eq!(d.matched, Some(32), "32 of 48 tokens: {d:?}");

    // Shares 40 tokens of 70: 57 % in symbols, 32 cached = 46 %, below 0.5.
    let mut diluted: Vec<u32> = (0..40).collect();
    diluted.extend(3000..3030);
    let d = select_tokens(&diluted);
    assert_eq!(d.reason, DecisionReason::CacheLowMatch, "{d:?}");

    // A block size of 0 is refused.
    let mut zero = CacheAwareConfig::default();
    zero.block_size = 0;
    assert!(CacheAware::new(zero).is_err());
}

#[test]
fn models_have_separate_trees() {
    let fleet = fleet(2);
    let p = policy(LoadGate::PerRequest);
    let text = prompt(9);
    let owner = establish(&p, &fleet, &text);
    let other = p
        .select(
            &fleet[..],
            &RequestContext::new("other-model").with_text(&text),
        )
        .expect("available");
    assert_eq!(other.reason, DecisionReason::CacheLowMatch);
    assert!(p.affinity_size(MODEL, &key(owner)) > 0);
    assert!(p.remove_model(MODEL));
    assert!(!p.has_model(MODEL));
    assert_eq!(select(&p, &fleet, &text).1, DecisionReason::CacheLowMatch);
}

#[test]
fn every_insert_keeps_each_worker_within_max_tree_size() {
    let mut config = CacheAwareConfig::default();
    config.max_tree_size = 1000;
    // Exact use order: all 50 inserts fall in one tick of the default
    // coarse clock, and uses within a tick are unordered.
    config.tree_clock = radix_affinity::Clock::Logical;
    let p = CacheAware::new(config).expect("valid");
    let fleet = fleet(1);
    for i in 0..50 {
        select(&p, &fleet, &format!("{i:04} {}", "x".repeat(200)));
        // No timer: the insert itself evicted.
        assert!(p.affinity_size(MODEL, &key(0)) <= 1000, "after insert {i}");
    }
    assert!(
        p.affinity_size(MODEL, &key(0)) > 600,
        "the newest texts stay"
    );
    // The most recent text is still routed on.
    let last = format!("{:04} {}", 49, "x".repeat(200));
    assert_eq!(select(&p, &fleet, &last).1, DecisionReason::CacheHit);
}

#[test]
fn policies_sharing_a_budget_stay_within_it_together() {
    let budget = lb_policies::MemoryBudget::new(64 * 1024);
    let policy = |budget: &std::sync::Arc<lb_policies::MemoryBudget>| {
        let mut config = CacheAwareConfig::default();
        config.tree_budget = Some(std::sync::Arc::clone(budget));
        CacheAware::new(config).expect("valid")
    };
    let (a, b) = (policy(&budget), policy(&budget));
    let fleet = fleet(2);
    let text = |i: usize| format!("{i:05} {}", "y".repeat(1000));
    for i in 0..400 {
        select(&a, &fleet, &text(i));
        select(&b, &fleet, &text(100_000 + i));
        // At most one insert's worth over (about 1.2 KB for 1 KB of text).
        assert!(
            budget.used() <= 64 * 1024 + 2048,
            "{} after {i}",
            budget.used()
        );
    }
    assert!(budget.evicted() > 0);
    assert!(a.budget().used() == budget.used());
    // Lowering the budget is applied by the upkeep to trees nobody
    // inserts into any more.
    budget.set_limit(16 * 1024);
    for _ in 0..64 {
        a.maintain();
        b.maintain();
    }
    assert!(budget.used() <= 16 * 1024, "{}", budget.used());
}

#[test]
fn invalid_knobs_are_rejected() {
    let cases: [fn(&mut CacheAwareConfig); 6] = [
        |c| c.cache_threshold = 1.5,
        |c| c.cache_threshold = f64::NAN,
        |c| c.balance_rel_threshold = 0.5,
        |c| c.max_tree_size = 0,
        |c| c.max_tree_bytes = 0,
        |c| c.eviction_interval = std::time::Duration::ZERO,
    ];
    for set in cases {
        let mut config = CacheAwareConfig::default();
        set(&mut config);
        assert!(CacheAware::new(config).is_err());
    }
}

#[test]
fn no_available_candidate_gives_none() {
    let fleet = fleet(2);
    for b in &fleet {
        b.set_available(false);
    }
    let p = policy(LoadGate::PerRequest);
    assert_eq!(
        p.select(&fleet[..], &RequestContext::new(MODEL).with_text("x")),
        None
    );
}

#[test]
fn decisions_carry_the_prefix_match_rate() {
    let fleet = fleet(3);
    let p = policy(LoadGate::PerRequest);
    announce(&p, &fleet);
    let text = prompt(7);
    let ctx = RequestContext::new(MODEL).with_text(&text);
    let cold = p.select(&fleet[..], &ctx).expect("a worker");
    assert_eq!(cold.reason, DecisionReason::CacheLowMatch);
    assert!(cold.match_permille.is_none_or(|m| m <= 300), "{cold:?}");
    let warm = p.select(&fleet[..], &ctx).expect("a worker");
    assert_eq!(warm.reason, DecisionReason::CacheHit);
    assert_eq!(warm.match_permille, Some(1000));
    // Half of a longer text is known: the rate says so.
    let longer = format!("{text}{}", "x".repeat(text.chars().count()));
    let half = p
        .select(&fleet[..], &RequestContext::new(MODEL).with_text(&longer))
        .expect("a worker");
    assert_eq!(half.match_permille, Some(500));
}

#[test]
fn affinity_sizes_follow_inserts_and_removals() {
    let fleet = fleet(2);
    let p = policy(LoadGate::PerRequest);
    announce(&p, &fleet);
    assert!(p.affinity_sizes().iter().all(|(_, size)| *size == 0));
    let text = prompt(3);
    let owner = establish(&p, &fleet, &text);
    let sizes = p.affinity_sizes();
    let owned = sizes
        .iter()
        .find(|(k, _)| **k == *fleet[owner].key())
        .map(|(_, size)| *size);
    assert_eq!(owned, Some(text.chars().count()));
    p.on_membership(MembershipEvent::Removed {
        key: fleet[owner].key(),
    });
    assert!(
        p.affinity_sizes()
            .iter()
            .all(|(k, _)| **k != *fleet[owner].key()),
        "a removed worker is no longer listed"
    );
}

/// Token input under the cost (`cache_aware_cost`) and under the gate.
fn token_policy(choice: TokenChoice) -> CacheAware {
    let mut config = CacheAwareConfig::default();
    config.token_choice = choice;
    config.tree_clock = Clock::Logical;
    CacheAware::with_seed(config, 7).expect("default knobs are valid")
}

/// A template header of `blocks` blocks of 16 tokens, then a request's
/// own `own` tokens starting at `tag`.
fn templated(blocks: u32, tag: u32, own: u32) -> Vec<u32> {
    let mut tokens: Vec<u32> = (0..blocks * 16).collect();
    tokens.extend(tag..tag + own);
    tokens
}

/// The case that sank a cost credited to the tree's best owner alone:
/// every worker holds a template header, the latest holder is busy, and a
/// new conversation on the same template arrives. Each worker is credited
/// its own match, so the header draws nobody's queue longer and an idle
/// worker takes it; the gate (header above the threshold) sends it to the
/// busy latest holder.
#[test]
fn a_template_header_every_worker_holds_does_not_pile_requests_on_its_latest_holder() {
    for (choice, want_latest) in [(TokenChoice::Cost, false), (TokenChoice::Gate, true)] {
        let fleet = fleet(3);
        let p = token_policy(choice);
        announce(&p, &fleet);
        // Each worker gets a conversation on the template (a one-worker
        // slice decides the placement), worker 2 last.
        for w in 0..3 {
            let tokens = templated(4, 10_000 * (w as u32 + 1), 40);
            let d = p
                .select(
                    &fleet[w..=w],
                    &RequestContext::new(MODEL).with_tokens(&tokens),
                )
                .expect("available");
            assert_eq!(d.index, 0);
        }
        let latest = 2;
        fleet[latest].set_load(3);
        let fresh = templated(4, 90_000, 16);
        let d = p
            .select(&fleet[..], &RequestContext::new(MODEL).with_tokens(&fresh))
            .expect("available");
        assert_eq!(
            d.index == latest,
            want_latest,
            "{choice:?}: chose {} (latest holder {latest}), {d:?}",
            d.index
        );
        if choice == TokenChoice::Cost {
            assert_eq!(
                d.reason,
                DecisionReason::CacheHit,
                "it holds the header too"
            );
            assert_eq!(d.match_permille, Some(800), "4 of 5 blocks: {d:?}");
        }
    }
}

/// The cost keeps a conversation on the worker holding its history while
/// the queue there is worth less than the blocks it saves (load weight 2
/// blocks per request), and moves it once the queue outweighs them.
#[test]
fn a_conversation_stays_with_its_history_until_the_queue_outweighs_it() {
    let fleet = fleet(2);
    let p = token_policy(TokenChoice::Cost);
    announce(&p, &fleet);
    // 20 blocks of history on one worker.
    let history: Vec<u32> = (0..320).collect();
    let owner = p
        .select(
            &fleet[..],
            &RequestContext::new(MODEL).with_tokens(&history),
        )
        .expect("available")
        .index;
    // Each next turn: the history and 2 blocks of its own, 22 blocks; the
    // owner costs 2 + 2 × load, the other worker 22.
    for (turn, (load, stays)) in [(9, true), (11, false)].into_iter().enumerate() {
        let mut next_turn = history.clone();
        next_turn.extend((0..32).map(|t| 5_000 + 100 * turn as u32 + t));
        fleet[owner].set_load(load);
        let d = p
            .select(
                &fleet[..],
                &RequestContext::new(MODEL).with_tokens(&next_turn),
            )
            .expect("available");
        assert_eq!(d.index == owner, stays, "owner at load {load}: {d:?}");
        let want = if stays {
            DecisionReason::CacheHit
        } else {
            DecisionReason::CacheOverloaded
        };
        assert_eq!(d.reason, want, "owner at load {load}");
    }
}

/// Text input keeps the threshold gate whatever the token choice: a long
/// match stays on its owner although another worker is idle.
#[test]
fn text_input_keeps_the_gate_under_the_cost() {
    let fleet = fleet(2);
    let p = token_policy(TokenChoice::Cost);
    let text = prompt(3);
    let owner = establish(&p, &fleet, &text);
    fleet[owner].set_load(20);
    assert_eq!(select(&p, &fleet, &text), (owner, DecisionReason::CacheHit));
}

/// The names: `cache_aware` places tokens by the gate (the default),
/// `cache_aware_cost` by the cost, each reporting its own name.
#[test]
fn the_cost_is_reachable_by_name() {
    use lb_policies::{PolicyConfig, build_builtin};
    for (name, gate) in [("cache_aware", true), ("cache_aware_cost", false)] {
        let p: Box<dyn Policy<BasicBackend>> =
            build_builtin(&PolicyConfig::named(name)).expect("builds");
        assert_eq!(p.name(), name);
        let fleet = fleet(2);
        let tokens = templated(4, 10_000, 40);
        let ctx = RequestContext::new(MODEL).with_tokens(&tokens);
        let owner = p.select(&fleet[..], &ctx).expect("available").index;
        fleet[owner].set_load(11);
        let d = p.select(&fleet[..], &ctx).expect("available");
        // All 6 blocks held: the gate stays (11 is far below its margin of
        // 64), the cost moves (6 blocks to compute < 2 × 11 of queue).
        assert_eq!(d.index == owner, gate, "{name}: {d:?}");
    }
}
