//! Kv-aware: exact block scores from the KV index for workers with a live
//! event stream, the approximate tree for the others, the per-request load
//! gate, fair ties, membership, and text input decided as cache-aware.
#![cfg(feature = "kv-block-index")]

mod common;

use std::sync::Arc;

use common::{announce, fleet, key};
use kv_block_index::{EngineHash, Holder, IndexConfig, KvEvent, KvIndex, Tier, WorkerId};
use lb_policies::{
    Backend, BasicBackend, CacheAware, CacheAwareConfig, DecisionReason, KvAware, KvSources,
    KvStreams, MembershipEvent, Policy, PolicyConfig, PolicyError, PolicyRegistry, PolicyState,
    RequestContext,
};
use proptest::prelude::*;

const MODEL: &str = "m";
/// Small blocks keep the prompts short.
const BLOCK: usize = 4;

/// A fleet, the host's index with every worker registered, the liveness
/// handle, and the policy told about the fleet.
struct Setup {
    fleet: Vec<BasicBackend>,
    index: Arc<KvIndex>,
    streams: Arc<KvStreams>,
    ids: Vec<WorkerId>,
    policy: KvAware,
}

fn knobs() -> CacheAwareConfig {
    let mut config = CacheAwareConfig::default();
    config.block_size = BLOCK;
    // Exact use order: the policy under test and its reference keep
    // separate trees, and the same holder must win in both.
    config.tree_clock = radix_affinity::Clock::Logical;
    config
}

/// The default `kv_aware`: the least expected cost.
fn setup(n: usize) -> Setup {
    setup_with(n, KvAware::new)
}

/// `kv_aware_gate`: the threshold and per-request load gate.
fn setup_gated(n: usize) -> Setup {
    setup_with(n, KvAware::gated)
}

fn setup_with(
    n: usize,
    build: fn(CacheAwareConfig, KvSources) -> Result<KvAware, PolicyError>,
) -> Setup {
    setup_config(n, knobs(), build)
}

/// [`setup_with`] with the policy built from `config`.
fn setup_config(
    n: usize,
    config: CacheAwareConfig,
    build: fn(CacheAwareConfig, KvSources) -> Result<KvAware, PolicyError>,
) -> Setup {
    let fleet = fleet(n);
    let index = Arc::new(KvIndex::new(IndexConfig {
        block_size: BLOCK,
        ..IndexConfig::default()
    }));
    let streams = Arc::new(KvStreams::new());
    let ids = fleet
        .iter()
        .map(|b| index.register_worker(b.key().to_owned()))
        .collect();
    let policy = build(
        config,
        KvSources::new(Arc::clone(&index), Arc::clone(&streams)),
    )
    .expect("valid");
    announce(&policy, &fleet);
    Setup {
        fleet,
        index,
        streams,
        ids,
        policy,
    }
}

impl Setup {
    fn live(&self, worker: usize, live: bool) {
        assert!(self.streams.set_live(self.ids[worker], live));
    }

    /// Engine `worker`'s `rank` stores the first `blocks` blocks of
    /// `prompt` (engine hashes unique per worker, rank and block).
    fn store(&self, worker: usize, rank: u32, prompt: &[u32], blocks: usize) {
        let base = (worker as i64 * 100 + i64::from(rank)) * 10_000;
        let outcome = self
            .index
            .apply(
                self.ids[worker],
                rank,
                &KvEvent::BlockStored {
                    block_hashes: (0..blocks as i64)
                        .map(|b| EngineHash::from_int(base + b))
                        .collect(),
                    parent_block_hash: None,
                    token_ids: prompt[..blocks * BLOCK].to_vec(),
                    block_size: BLOCK,
                    lora_id: None,
                },
            )
            .expect("registered");
        assert_eq!(outcome.stored, blocks as u64);
    }

    fn select(&self, tokens: &[u32]) -> (usize, DecisionReason) {
        select_in(&self.policy, &self.fleet, tokens).expect("an available worker")
    }
}

fn select_in(
    policy: &KvAware,
    fleet: &[BasicBackend],
    tokens: &[u32],
) -> Option<(usize, DecisionReason)> {
    let d = policy.select(fleet, &RequestContext::new(MODEL).with_tokens(tokens))?;
    assert!(fleet[d.index].is_available(), "chose an unavailable worker");
    assert!(
        d.match_permille.is_some(),
        "token decisions carry a match rate"
    );
    Some((d.index, d.reason))
}

/// A prompt of `blocks` full blocks, distinct per `seed`.
fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK) as u32)
        .map(|t| seed * 100_000 + t)
        .collect()
}

#[test]
fn exact_scores_beat_the_tree_when_an_engine_evicted() {
    let s = setup(4);
    for w in 0..4 {
        s.live(w, true);
    }
    let p = prompt(1, 8);
    // First request: nothing cached anywhere; the tree records the choice.
    let (a, reason) = s.select(&p);
    assert_eq!(reason, DecisionReason::CacheLowMatch);
    // Cache-aware alone would now send the prompt back to `a`...
    let tree_only = CacheAware::new(knobs()).expect("valid");
    announce(&tree_only, &s.fleet);
    let ctx = RequestContext::new(MODEL).with_tokens(&p);
    let first = tree_only.select(&s.fleet, &ctx).expect("available");
    let again = tree_only.select(&s.fleet, &ctx).expect("available");
    assert_eq!(
        (again.index, again.reason),
        (first.index, DecisionReason::CacheHit)
    );
    // ...but engine `a` evicted it (it never reported it stored), and
    // engine `b` holds the whole prompt.
    let b = (a + 1) % 4;
    s.store(b, 0, &p, 8);
    assert_eq!(s.select(&p), (b, DecisionReason::KvHit));
    // An engine with a longer held prefix wins over a shorter one.
    let c = (a + 2) % 4;
    s.index
        .apply(
            s.ids[b],
            0,
            &KvEvent::BlockRemoved {
                block_hashes: (3..8)
                    .map(|i| EngineHash::from_int(b as i64 * 1_000_000 + i))
                    .collect(),
            },
        )
        .expect("registered");
    s.store(c, 0, &p, 6);
    assert_eq!(s.select(&p), (c, DecisionReason::KvHit));
}

#[test]
fn a_data_parallel_worker_scores_its_best_rank() {
    let s = setup(3);
    for w in 0..3 {
        s.live(w, true);
    }
    let p = prompt(2, 10);
    s.store(0, 0, &p, 6);
    s.store(1, 0, &p, 2);
    s.store(1, 3, &p, 9); // worker 1's rank 3 holds the most
    assert_eq!(s.select(&p), (1, DecisionReason::KvHit));
}

#[test]
fn the_load_gate_is_per_request_at_the_exact_thresholds() {
    let s = setup_gated(4);
    for w in 0..4 {
        s.live(w, true);
    }
    let p = prompt(3, 8);
    s.store(2, 0, &p, 8);
    // One hot worker elsewhere does not turn affinity off (invariant 11).
    s.fleet[0].set_load(1_000);
    assert_eq!(s.select(&p), (2, DecisionReason::KvHit));
    // min load among available candidates is 10 (workers 1 and 3).
    s.fleet[1].set_load(10);
    s.fleet[3].set_load(10);
    // 74 = 10 + 64: not more than the absolute margin.
    s.fleet[2].set_load(74);
    assert_eq!(s.select(&p), (2, DecisionReason::KvHit));
    // 75 > 10 + 64 and 75 > 10 × 1.5: yields to the least loaded.
    s.fleet[2].set_load(75);
    let (i, reason) = s.select(&p);
    assert_eq!(reason, DecisionReason::CacheOverloaded);
    assert!(i == 1 || i == 3, "least loaded, got {i}");
    // An idle but unavailable worker does not lower the minimum.
    s.fleet[1].set_load(70);
    s.fleet[3].set_load(70);
    let idle_down = &s.fleet[0];
    idle_down.set_load(0);
    idle_down.set_available(false);
    assert_eq!(s.select(&p), (2, DecisionReason::KvHit));
}

#[test]
fn equally_scored_holders_share_the_traffic_fairly() {
    let s = setup(4);
    for w in 0..4 {
        s.live(w, true);
    }
    let p = prompt(4, 8);
    for w in 0..4 {
        s.store(w, 0, &p, 8); // a system prompt every engine holds
    }
    let mut counts = [0usize; 4];
    for _ in 0..400 {
        let (i, reason) = s.select(&p);
        assert_eq!(reason, DecisionReason::KvHit);
        counts[i] += 1;
    }
    let (min, max) = (counts.iter().min(), counts.iter().max());
    assert!(
        max.zip(min).is_some_and(|(max, min)| max - min <= 1),
        "{counts:?}"
    );
    // Among equal scores the less loaded holder goes first.
    for (w, load) in [(0, 5), (1, 3), (2, 1), (3, 4)] {
        s.fleet[w].set_load(load);
    }
    for _ in 0..8 {
        assert_eq!(s.select(&p), (2, DecisionReason::KvHit));
    }
}

#[test]
fn cold_workers_fall_back_to_the_tree() {
    let s = setup(3);
    let p = prompt(5, 8);
    let (a, reason) = s.select(&p);
    assert_eq!(reason, DecisionReason::CacheLowMatch);
    assert_eq!(s.select(&p), (a, DecisionReason::CacheHit));
    // Another engine holds it, but its stream is not live: ignored.
    let b = (a + 1) % 3;
    s.store(b, 0, &p, 8);
    assert_eq!(s.select(&p), (a, DecisionReason::CacheHit));
    // Its stream comes up: equal blocks, and an exact score beats an
    // approximate one.
    s.live(b, true);
    assert_eq!(s.select(&p), (b, DecisionReason::KvHit));
    // A live stream for `a` that shows it holds only half: `b` still wins,
    // now on more blocks.
    s.store(a, 0, &p, 4);
    s.live(a, true);
    assert_eq!(s.select(&p), (b, DecisionReason::KvHit));
    // `b`'s stream is lost: `a`'s exact 4 blocks against `b`'s tree
    // affinity (it was chosen above, so the tree knows it holds all 8).
    s.live(b, false);
    assert_eq!(s.select(&p), (b, DecisionReason::CacheHit));
}

#[test]
fn an_unavailable_tree_owner_leaves_the_next_cold_worker() {
    let s = setup(3);
    let p = prompt(12, 8);
    let (a, _) = s.select(&p);
    assert_eq!(s.select(&p), (a, DecisionReason::CacheHit));
    // Worker b learns the first half of the prompt (offered alone).
    let b = (a + 1) % 3;
    let half = &p[..4 * BLOCK];
    assert_eq!(
        select_in(&s.policy, &s.fleet[b..=b], half).map(|(i, _)| i),
        Some(0)
    );
    // The tree's best owner goes down: b's half (0.5 > 0.3) wins.
    s.fleet[a].set_available(false);
    assert_eq!(s.select(&p), (b, DecisionReason::CacheHit));
    // ...and with b's stream live but empty, b has no score at all.
    s.live(b, true);
    assert_eq!(s.select(&p).1, DecisionReason::CacheLowMatch);
}

#[test]
fn a_removed_worker_is_never_chosen() {
    let s = setup(3);
    for w in 0..3 {
        s.live(w, true);
    }
    let p = prompt(6, 8);
    s.store(1, 0, &p, 8);
    assert_eq!(s.select(&p), (1, DecisionReason::KvHit));
    // Removed; the host has not cleared its blocks yet and passes a stale
    // slice that still lists it, as the least loaded worker.
    s.policy
        .on_membership(MembershipEvent::Removed { key: &key(1) });
    s.fleet[0].set_load(3);
    s.fleet[2].set_load(3);
    for _ in 0..20 {
        let (i, reason) = s.select(&p);
        assert_ne!(i, 1, "chose the removed worker ({reason})");
        assert_eq!(reason, DecisionReason::CacheLowMatch);
    }
    // A slice of the removed worker alone yields nothing.
    assert_eq!(select_in(&s.policy, &s.fleet[1..2], &p), None);
    // Added back: it is a member again and holds the blocks.
    s.policy
        .on_membership(MembershipEvent::Added { key: &key(1) });
    assert_eq!(s.select(&p), (1, DecisionReason::KvHit));
}

#[test]
fn a_replaced_worker_starts_cold() {
    let s = setup(2);
    let p = prompt(7, 8);
    let (a, _) = s.select(&p);
    assert_eq!(s.select(&p), (a, DecisionReason::CacheHit));
    // A new lifetime: the host clears the old one's blocks; the policy
    // drops its tree affinity.
    s.index.clear_worker(s.ids[a]).expect("registered");
    s.policy
        .on_membership(MembershipEvent::Replaced { key: &key(a) });
    assert_eq!(s.policy.fallback().affinity_size(MODEL, &key(a)), 0);
    assert_eq!(s.select(&p).1, DecisionReason::CacheLowMatch);
}

#[test]
fn a_worker_the_index_learns_later_is_scored_once_live() {
    let fleet = fleet(2);
    let index = Arc::new(KvIndex::new(IndexConfig {
        block_size: BLOCK,
        ..IndexConfig::default()
    }));
    let streams = Arc::new(KvStreams::new());
    let policy = KvAware::new(
        knobs(),
        KvSources::new(Arc::clone(&index), Arc::clone(&streams)),
    )
    .expect("valid");
    // Announced before the host registered it in the index.
    announce(&policy, &fleet);
    let w1 = index.register_worker(key(1));
    let p = prompt(8, 6);
    index
        .apply(
            w1,
            0,
            &KvEvent::BlockStored {
                block_hashes: (0..6).map(EngineHash::from_int).collect(),
                parent_block_hash: None,
                token_ids: p.clone(),
                block_size: BLOCK,
                lora_id: None,
            },
        )
        .expect("registered");
    assert!(streams.set_live(w1, true));
    assert_eq!(
        select_in(&policy, &fleet, &p),
        Some((1, DecisionReason::KvHit))
    );
}

#[test]
fn short_or_unmatched_prompts_go_least_loaded() {
    let s = setup_gated(3);
    for w in 0..3 {
        s.live(w, true);
    }
    s.fleet[0].set_load(2);
    s.fleet[1].set_load(1);
    s.fleet[2].set_load(2);
    // Shorter than a block: nothing can be cached.
    assert_eq!(s.select(&[1, 2, 3]), (1, DecisionReason::CacheLowMatch));
    // One block of ten held: 4 / 40 = 0.1 is not above 0.3.
    let p = prompt(9, 10);
    s.store(0, 0, &p, 1);
    let d = s
        .policy
        .select(&s.fleet, &RequestContext::new(MODEL).with_tokens(&p))
        .expect("available");
    assert_eq!((d.index, d.reason), (1, DecisionReason::CacheLowMatch));
    assert_eq!(d.match_permille, Some(100));
    assert_eq!(d.matched, Some(4), "one block of four tokens");
    // No candidates at all.
    assert_eq!(select_in(&s.policy, &[], &p), None);
}

#[test]
fn the_registry_builds_kv_aware_only_with_its_sources() {
    let err =
        PolicyRegistry::<BasicBackend>::new(PolicyConfig::named("kv_aware")).expect_err("no index");
    assert!(
        matches!(&err, PolicyError::InvalidConfig { field: "kv", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("with_kv"), "{err}");

    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let streams = Arc::new(KvStreams::new());
    let sources = KvSources::new(Arc::clone(&index), Arc::clone(&streams));
    let registry = PolicyRegistry::<BasicBackend>::new(
        PolicyConfig::named("kv_aware").with_kv(sources.clone()),
    )
    .expect("builds");
    let fleet = fleet(2);
    for b in &fleet {
        let id = index.register_worker(b.key().to_owned());
        streams.set_live(id, true);
        registry.on_membership(MembershipEvent::Added { key: b.key() });
    }
    assert_eq!(registry.policy(MODEL).expect("builds").name(), "kv_aware");
    let tokens: Vec<u32> = (0..64).collect();
    let d = registry
        .select(&fleet, &RequestContext::new(MODEL).with_tokens(&tokens))
        .expect("builds")
        .expect("available");
    assert_eq!(d.reason, DecisionReason::CacheLowMatch);

    // Block sizes must agree.
    let mut config = PolicyConfig::named("kv_aware").with_kv(sources);
    config.cache_aware.block_size = 32;
    let err = PolicyRegistry::<BasicBackend>::new(config).expect_err("mismatch");
    assert!(
        matches!(
            &err,
            PolicyError::InvalidConfig {
                field: "cache_aware.block_size",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn liveness_beyond_capacity_is_refused() {
    let streams = KvStreams::with_capacity(100);
    assert_eq!(streams.capacity(), 128);
    let index: KvIndex = KvIndex::default();
    let ids: Vec<WorkerId> = (0..130).map(|i| index.register_worker(key(i))).collect();
    assert!(streams.set_live(ids[127], true));
    assert!(streams.is_live(ids[127]));
    let before = streams.changes();
    assert!(!streams.set_live(ids[128], true));
    assert!(!streams.is_live(ids[128]));
    assert_eq!(streams.changes(), before);
    assert!(streams.set_live(ids[127], false));
    assert!(!streams.is_live(ids[127]));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Text input is decided exactly as cache-aware decides it.
    #[test]
    fn text_input_is_decided_as_cache_aware(
        n in 1usize..6,
        steps in prop::collection::vec(
            (prop::sample::select(vec![
                "you are a helpful assistant. summarise this report please",
                "you are a helpful assistant. translate this into french",
                "a completely different prompt about the weather today",
                "",
            ]), prop::collection::vec(0usize..150, 6), any::<bool>()),
            1..24,
        ),
    ) {
        let s = setup(n);
        for w in 0..n {
            s.live(w, true);
        }
        let reference = CacheAware::new(knobs()).expect("valid");
        announce(&reference, &s.fleet);
        for (text, loads, down) in steps {
            for (b, load) in s.fleet.iter().zip(&loads) {
                b.set_load(*load);
            }
            s.fleet[0].set_available(!down);
            let ctx = RequestContext::new(MODEL).with_text(text);
            prop_assert_eq!(s.policy.select(&s.fleet, &ctx), reference.select(&s.fleet, &ctx));
        }
    }

    /// `kv_aware_gate`: one decision against a reference model: live
    /// workers score their held blocks (the best rank), cold ones nothing
    /// (a fresh tree); the choice is the best scorer if above the
    /// threshold and not overloaded, else a least-loaded available worker.
    #[test]
    fn a_decision_matches_the_reference_model(
        spec in prop::collection::vec(
            (any::<bool>(), any::<bool>(), 0usize..120, 0usize..=10, 0usize..=10),
            1..7,
        ),
        request_blocks in 1usize..=10,
        extra_tokens in 0usize..BLOCK,
    ) {
        let s = setup_gated(spec.len());
        let mut p = prompt(11, 10);
        p.truncate(request_blocks * BLOCK + extra_tokens);
        let full = prompt(11, 10);
        let mut expected = vec![0usize; spec.len()];
        for (w, &(live, up, load, rank0, rank1)) in spec.iter().enumerate() {
            s.live(w, live);
            s.fleet[w].set_available(up);
            s.fleet[w].set_load(load);
            if rank0 > 0 {
                s.store(w, 0, &full, rank0);
            }
            if rank1 > 0 {
                s.store(w, 1, &full, rank1);
            }
            if live && up {
                expected[w] = rank0.max(rank1).min(request_blocks);
            }
        }
        let decision = s
            .policy
            .select(&s.fleet, &RequestContext::new(MODEL).with_tokens(&p));
        let available: Vec<usize> = (0..spec.len()).filter(|&w| spec[w].1).collect();
        let Some(d) = decision else {
            prop_assert!(available.is_empty());
            return Ok(());
        };
        prop_assert!(spec[d.index].1, "unavailable worker chosen");
        let best = expected.iter().copied().max().unwrap_or(0);
        let rate = (best * BLOCK) as f64 / p.len() as f64;
        let min_load = available.iter().map(|&w| spec[w].2).min().unwrap_or(0);
        let least = |i: usize| spec[i].2 == min_load;
        if best == 0 || rate <= 0.3 {
            prop_assert_eq!(d.reason, DecisionReason::CacheLowMatch);
            prop_assert!(least(d.index));
        } else if d.reason == DecisionReason::KvHit {
            prop_assert_eq!(expected[d.index], best);
            prop_assert!(!knobs().preferred_yields(spec[d.index].2, min_load));
        } else {
            prop_assert_eq!(d.reason, DecisionReason::CacheOverloaded);
            prop_assert!(least(d.index));
            // Every best scorer would have been over the gate.
            for w in (0..spec.len()).filter(|&w| expected[w] == best) {
                prop_assert!(knobs().preferred_yields(spec[w].2, min_load));
            }
        }
        prop_assert_eq!(d.match_permille, Some(((rate.min(1.0)) * 1000.0).round() as u16));
    }

    /// `kv_aware`: one decision against the cost model: the chosen worker
    /// is available and of least `(blocks − saved) + load_weight × load`,
    /// where a worker saves its device prefix and, past it, `1 − penalty`
    /// per block its host tier holds; among equal costs it saves the most;
    /// the reason says whether a larger saving lost to load.
    #[test]
    fn a_least_cost_decision_matches_the_reference_model(
        spec in prop::collection::vec(
            (any::<bool>(), any::<bool>(), 0usize..40, 0usize..=10, 0usize..=10, 0usize..=10),
            1..7,
        ),
        request_blocks in 1usize..=10,
        extra_tokens in 0usize..BLOCK,
    ) {
        let s = setup(spec.len());
        let mut p = prompt(12, 10);
        p.truncate(request_blocks * BLOCK + extra_tokens);
        let full = prompt(12, 10);
        let model = knobs().cost;
        let host_penalty = model.penalties.host;
        let mut held = vec![0.0f64; spec.len()];
        for (w, &(live, up, load, rank0, rank1, host)) in spec.iter().enumerate() {
            s.live(w, live);
            s.fleet[w].set_available(up);
            s.fleet[w].set_load(load);
            if rank0 > 0 {
                s.store(w, 0, &full, rank0);
            }
            if rank1 > 0 {
                s.store(w, 1, &full, rank1);
            }
            if host > 0 {
                s.store(w, Holder::tiered_rank(0, Tier::Host), &full, host);
            }
            if live && up {
                let device = rank0.max(rank1).min(request_blocks);
                let host = host.min(request_blocks);
                held[w] = device as f64
                    + if host > device {
                        (1.0 - host_penalty) * (host - device) as f64
                    } else {
                        0.0
                    };
            }
        }
        let cost = |w: usize| model.cost_with_credit(request_blocks, held[w], spec[w].2);
        let decision = s
            .policy
            .select(&s.fleet, &RequestContext::new(MODEL).with_tokens(&p));
        let available: Vec<usize> = (0..spec.len()).filter(|&w| spec[w].1).collect();
        let Some(d) = decision else {
            prop_assert!(available.is_empty());
            return Ok(());
        };
        prop_assert!(spec[d.index].1, "unavailable worker chosen");
        let least = available.iter().map(|&w| cost(w)).fold(f64::INFINITY, f64::min);
        prop_assert_eq!(cost(d.index), least);
        let most_held_at_least = available
            .iter()
            .filter(|&&w| cost(w) == least)
            .map(|&w| held[w])
            .fold(0.0, f64::max);
        prop_assert_eq!(held[d.index], most_held_at_least);
        let longest = available.iter().map(|&w| held[w]).fold(0.0, f64::max);
        let expected_reason = if held[d.index] < longest {
            DecisionReason::CacheOverloaded
        } else if held[d.index] == 0.0 {
            DecisionReason::CacheLowMatch
        } else {
            DecisionReason::KvHit
        };
        prop_assert_eq!(d.reason, expected_reason);
    }
}

#[test]
fn a_prefix_is_worth_its_blocks_against_the_load_in_front_of_it() {
    let s = setup(3);
    for w in 0..3 {
        s.live(w, true);
    }
    // 10 blocks; worker 0 holds 8, worker 1 holds 2, worker 2 nothing.
    let p = prompt(21, 10);
    s.store(0, 0, &p, 8);
    s.store(1, 0, &p, 2);
    let weight = knobs().cost.load_weight;
    assert_eq!(weight, lb_policies::DEFAULT_LOAD_WEIGHT);
    // Idle fleet: the longest prefix.
    assert_eq!(s.select(&p), (0, DecisionReason::KvHit));
    // Worker 0 carries 2 more requests (4 blocks at weight 2) than the
    // others: 2 + 4 = 6 still beats worker 1's 8 and worker 2's 10.
    s.fleet[0].set_load(2);
    assert_eq!(s.select(&p), (0, DecisionReason::KvHit));
    // 4 more (8 blocks of queue): 2 + 8 = 10 > 8, worker 1 wins on cost
    // although worker 0 holds more.
    s.fleet[0].set_load(4);
    assert_eq!(s.select(&p), (1, DecisionReason::CacheOverloaded));
    // On equal costs the longer prefix: worker 1 at load 2 costs 8 + 4,
    // worker 0 and the empty worker 2 both 10; worker 0 holds more.
    s.fleet[1].set_load(2);
    assert_eq!(s.select(&p), (0, DecisionReason::KvHit));
    // One more on worker 0 (2 + 10): the empty worker 2 (10 + 0).
    s.fleet[0].set_load(5);
    assert_eq!(s.select(&p), (2, DecisionReason::CacheOverloaded));
    // No prefix anywhere: least loaded, a low match.
    let fresh = prompt(22, 10);
    assert_eq!(s.select(&fresh), (2, DecisionReason::CacheLowMatch));
}

#[test]
fn blocks_held_in_a_lower_tier_are_worth_their_penalty() {
    let s = setup(3);
    for w in 0..3 {
        s.live(w, true);
    }
    // 10 blocks. Worker 0 holds 8 of them in host memory only (vLLM's
    // medium "CPU"), worker 1 holds 4 on its GPU, worker 2 nothing.
    let p = prompt(31, 10);
    s.store(0, Holder::tiered_rank(0, Tier::Host), &p, 8);
    s.store(1, 0, &p, 4);
    let penalty = knobs().cost.penalties.host;
    assert_eq!(penalty, lb_policies::DEFAULT_HOST_PENALTY);
    // Worker 0 saves 8 × 0.75 = 6 blocks, worker 1 4: worker 0, a hit.
    assert_eq!(s.select(&p), (0, DecisionReason::KvHit));
    // One more request on worker 0 (2 blocks of queue): 4 + 2 = 6 ties
    // with worker 1's 6; the larger saving stays.
    s.fleet[0].set_load(1);
    assert_eq!(s.select(&p), (0, DecisionReason::KvHit));
    // Two more: 4 + 4 = 8 > 6: worker 1 wins although worker 0 saves more.
    s.fleet[0].set_load(2);
    assert_eq!(s.select(&p), (1, DecisionReason::CacheOverloaded));
    // A device copy of the first 6 on worker 0 as well: it saves
    // 6 + 2 × 0.75 = 7.5 and costs 2.5 + 4 = 6.5, still more than worker
    // 1's 6; idle again, it costs 2.5 and wins.
    s.store(0, 0, &p, 6);
    assert_eq!(s.select(&p), (1, DecisionReason::CacheOverloaded));
    s.fleet[0].set_load(0);
    assert_eq!(s.select(&p), (0, DecisionReason::KvHit));

    // With no credit for the host tier (penalty 1), host blocks count for
    // nothing: a fresh setup where only a host copy exists goes to the
    // least loaded as a low match.
    let mut config = knobs();
    config.cost.penalties = lb_policies::TierPenalties::none();
    let none = setup_config(2, config, KvAware::new);
    none.live(0, true);
    none.live(1, true);
    none.store(0, Holder::tiered_rank(0, Tier::Host), &p, 8);
    none.fleet[1].set_load(0);
    none.fleet[0].set_load(1);
    assert_eq!(
        select_in(&none.policy, &none.fleet, &p),
        Some((1, DecisionReason::CacheLowMatch))
    );

    // The gate counts device blocks only: a host copy is no hit there.
    let g = setup_gated(2);
    g.live(0, true);
    g.live(1, true);
    g.store(0, Holder::tiered_rank(0, Tier::Host), &p, 10);
    assert_eq!(g.select(&p).1, DecisionReason::CacheLowMatch);
}

#[test]
fn the_gate_and_the_cost_are_built_by_name() {
    let sources = KvSources::new(
        Arc::new(KvIndex::new(IndexConfig {
            block_size: 16,
            ..IndexConfig::default()
        })),
        Arc::new(KvStreams::new()),
    );
    for (name, shown) in [("kv_aware", "kv_aware"), ("kv_aware_gate", "kv_aware_gate")] {
        let registry =
            PolicyRegistry::<BasicBackend>::new(PolicyConfig::named(name).with_kv(sources.clone()))
                .expect("builds");
        assert_eq!(registry.policy(MODEL).expect("policy").name(), shown);
    }
    // A knob out of range is refused by name.
    let mut config = PolicyConfig::named("kv_aware").with_kv(sources);
    config.cache_aware.cost.load_weight = -1.0;
    let err = PolicyRegistry::<BasicBackend>::new(config).expect_err("refused");
    assert!(
        matches!(
            &err,
            PolicyError::InvalidConfig {
                field: "cost.load_weight",
                ..
            }
        ),
        "{err}"
    );
}

/// A `kv_aware` setup whose sessions stick for `ttl` after their last use.
fn setup_sessions(n: usize, ttl: std::time::Duration) -> Setup {
    let mut config = knobs();
    config.session_affinity_ttl = ttl;
    setup_config(n, config, KvAware::new)
}

fn select_session(s: &Setup, tokens: &[u32], session: &str) -> (usize, DecisionReason) {
    let d = s
        .policy
        .select(
            &s.fleet,
            &RequestContext::new(MODEL)
                .with_tokens(tokens)
                .with_session(session),
        )
        .expect("an available worker");
    (d.index, d.reason)
}

#[test]
fn a_session_follows_its_last_worker_while_it_is_available_and_not_overloaded() {
    let s = setup_sessions(3, std::time::Duration::from_secs(3600));
    for w in 0..3 {
        s.live(w, true);
    }
    let a = prompt(41, 10);
    let b = prompt(42, 10);
    s.store(0, 0, &a, 10);
    s.store(1, 0, &b, 10);
    // First turn: by cost, worker 0 holds it; the session is bound there.
    assert_eq!(select_session(&s, &a, "chat-1"), (0, DecisionReason::KvHit));
    // A prompt worker 1 holds: the session stays on worker 0...
    assert_eq!(
        select_session(&s, &b, "chat-1"),
        (0, DecisionReason::SessionAffinity)
    );
    // ... where a request without a session, or of another session, goes
    // by cost.
    assert_eq!(s.select(&b), (1, DecisionReason::KvHit));
    assert_eq!(select_session(&s, &b, "chat-2"), (1, DecisionReason::KvHit));
    // The `user` field is a session key too (the hash keys' precedence).
    let d = s
        .policy
        .select(
            &s.fleet,
            &RequestContext::new(MODEL)
                .with_tokens(&b)
                .with_user("chat-1"),
        )
        .unwrap();
    assert_eq!((d.index, d.reason), (0, DecisionReason::SessionAffinity));
    // Overloaded by the gate (more than 64 above the least loaded and 1.5
    // times it): the request goes by cost, and the session moves with it.
    s.fleet[0].set_load(100);
    assert_eq!(select_session(&s, &b, "chat-1"), (1, DecisionReason::KvHit));
    s.fleet[0].set_load(0);
    assert_eq!(
        select_session(&s, &a, "chat-1"),
        (1, DecisionReason::SessionAffinity)
    );
    // Unavailable: by cost again, and rebound.
    s.fleet[1].set_available(false);
    assert_eq!(select_session(&s, &a, "chat-1"), (0, DecisionReason::KvHit));
    s.fleet[1].set_available(true);
    assert_eq!(
        select_session(&s, &b, "chat-1"),
        (0, DecisionReason::SessionAffinity)
    );
    let (bound, refused) = s.policy.session_stats().expect("on");
    assert_eq!((bound, refused), (2, 0));
}

#[test]
fn a_session_idle_past_the_ttl_is_placed_by_cost_again() {
    let s = setup_sessions(2, std::time::Duration::from_millis(1));
    s.live(0, true);
    s.live(1, true);
    let a = prompt(43, 10);
    let b = prompt(44, 10);
    s.store(0, 0, &a, 10);
    s.store(1, 0, &b, 10);
    assert_eq!(select_session(&s, &a, "chat-9"), (0, DecisionReason::KvHit));
    // Idle for far longer than the TTL (a lower bound on the wait, so this
    // cannot pass early): the binding is gone.
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(select_session(&s, &b, "chat-9"), (1, DecisionReason::KvHit));
    // Off by default: no session is ever followed.
    let plain = setup(2);
    plain.live(0, true);
    plain.live(1, true);
    plain.store(0, 0, &a, 10);
    plain.store(1, 0, &b, 10);
    assert_eq!(
        select_session(&plain, &a, "chat-9"),
        (0, DecisionReason::KvHit)
    );
    assert_eq!(
        select_session(&plain, &b, "chat-9"),
        (1, DecisionReason::KvHit)
    );
    assert!(plain.policy.session_stats().is_none());
}

/// Under overload (the engines' mean waiting count at the entry level) a
/// session whose history no engine's events name goes back to the worker
/// this policy last sent it to, as long as the gate lets it; outside
/// overload the least cost places it by load. A choice learned from a
/// peer replica counts as one's own; one for an unknown worker is
/// ignored.
#[test]
fn under_overload_the_tree_sends_a_session_back_where_it_went() {
    let s = setup(3);
    for w in 0..3 {
        s.live(w, true);
    }
    let history = prompt(7, 6);
    // First turn: nothing cached, nobody loaded: some worker.
    let (first, _) = s.select(&history);
    // The next turn, longer, while that worker is busier than the others
    // and nothing is cached anywhere (the history was evicted, or is
    // still queued).
    let mut next = history.clone();
    next.extend(prompt(8, 2));
    s.fleet[first].set_load(8);
    let (moved, reason) = s.select(&next);
    assert_ne!(moved, first, "outside overload the least cost moves it");
    assert_eq!(reason, DecisionReason::CacheLowMatch);
    assert!(!s.policy.is_overloaded());
    // Every engine with a queue: the overload state.
    for b in &s.fleet {
        b.set_waiting(lb_policies::DEFAULT_OVERLOAD_ENTER as usize);
    }
    // The tree names the worker last sent this prefix (now `moved`).
    let (back, reason) = s.select(&next);
    assert!(s.policy.is_overloaded());
    assert_eq!(back, moved, "under overload the session goes where it went");
    assert_eq!(reason, DecisionReason::CacheHit);
    // Below the entry level but above the exit level it stays on.
    for b in &s.fleet {
        b.set_waiting(lb_policies::DEFAULT_OVERLOAD_LEAVE as usize + 1);
    }
    s.select(&next);
    assert!(s.policy.is_overloaded());
    for b in &s.fleet {
        b.set_waiting(lb_policies::DEFAULT_OVERLOAD_LEAVE as usize);
    }
    s.select(&next);
    assert!(!s.policy.is_overloaded(), "left at the exit level");

    // A second replica that learned the choice from its peer does the same.
    let peer = setup(3);
    for w in 0..3 {
        peer.live(w, true);
    }
    let worker = key(moved);
    assert!(!peer.policy.learn_choice(
        MODEL,
        lb_policies::RoutingInput::Tokens(&next),
        "regular:http://10.0.0.99:8000#1"
    ));
    assert!(
        peer.policy
            .learn_choice(MODEL, lb_policies::RoutingInput::Tokens(&next), &worker)
    );
    for b in &peer.fleet {
        b.set_waiting(lb_policies::DEFAULT_OVERLOAD_ENTER as usize);
    }
    peer.fleet[moved].set_load(4);
    let (chosen, reason) = peer.select(&next);
    assert_eq!((chosen, reason), (moved, DecisionReason::CacheHit));
}
