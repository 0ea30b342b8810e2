//! "No heap allocation per decision" for the counter and hash policies,
//! checked with a counting global allocator (per thread, so the test
//! harness's own threads do not disturb the count).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use lb_policies::{
    BasicBackend, CacheAware, CacheAwareConfig, ConsistentHash, ConsistentHashConfig, LeastLoaded,
    MembershipEvent, Policy, PolicyState, PowerOfTwo, RandomPolicy, RendezvousHash, RequestContext,
    RoundRobin,
};

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

struct CountingAllocator;

fn count_one() {
    // `try_with`: the slot may already be gone while a thread shuts down.
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees carry over; counting has no effect
// on the memory handed out.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_one();
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count_one();
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_one();
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

fn allocations_during(f: impl FnOnce()) -> u64 {
    let before = ALLOCATIONS.with(Cell::get);
    f();
    ALLOCATIONS.with(Cell::get) - before
}

#[test]
fn counter_and_hash_policies_do_not_allocate_per_decision() {
    let fleet: Vec<BasicBackend> = (0..64)
        .map(|i| BasicBackend::new(format!("http://worker-{i}:8000")).with_load(i % 7))
        .collect();
    fleet[5].set_available(false);
    let sessions: Vec<String> = (0..256).map(|i| format!("session-{i}")).collect();

    let bounded = ConsistentHash::new(ConsistentHashConfig::default().with_bounded_load(1.25))
        .expect("valid");
    let ring = ConsistentHash::new(ConsistentHashConfig::default()).expect("valid");
    for b in &fleet {
        use lb_policies::Backend;
        ring.on_membership(MembershipEvent::Added { key: b.key() });
        bounded.on_membership(MembershipEvent::Added { key: b.key() });
    }
    let policies: Vec<Box<dyn Policy<BasicBackend>>> = vec![
        Box::new(RandomPolicy::with_seed(1)),
        Box::new(RoundRobin::new()),
        Box::new(PowerOfTwo::with_seed(1)),
        Box::new(LeastLoaded::new()),
        Box::new(ring),
        Box::new(bounded),
        Box::new(RendezvousHash::new()),
    ];
    for policy in &policies {
        let run = |rounds: usize| {
            for i in 0..rounds {
                let s = &sessions[i % sessions.len()];
                // Keyed and keyless requests alternate (keyless take the
                // load-aware fallback).
                let ctx = if i % 3 == 0 {
                    RequestContext::new("m")
                } else {
                    RequestContext::new("m").with_session(s)
                };
                assert!(policy.select(&fleet, &ctx).is_some());
            }
        };
        run(512); // warm-up (nothing lazy is expected, but be fair)
        let n = allocations_during(|| run(10_000));
        assert_eq!(
            n,
            0,
            "{} allocated {n} times in 10,000 decisions",
            policy.name()
        );
    }

    // Cache-aware is not in the promise (the tree allocates when it learns
    // a new prefix), but a repeated hit should not allocate in the policy.
    let cache = CacheAware::new(CacheAwareConfig::default()).expect("valid");
    let text = "a long shared system prompt ".repeat(20);
    let ctx = RequestContext::new("m").with_text(&text);
    for _ in 0..16 {
        cache.select(&fleet[..], &ctx);
    }
    let n = allocations_during(|| {
        for _ in 0..1000 {
            cache.select(&fleet[..], &ctx);
        }
    });
    eprintln!("cache_aware: {n} allocations in 1000 repeated-hit decisions");
}

/// Kv-aware reuses thread-local buffers for the block hashes and the index
/// lookup, so a repeated exact hit (all streams live, the prefix already in
/// the fallback tree) allocates nothing in the policy.
#[cfg(feature = "kv-block-index")]
#[test]
fn kv_aware_repeated_hits_do_not_allocate() {
    use std::sync::Arc;

    use kv_block_index::{EngineHash, IndexConfig, KvEvent, KvIndex};
    use lb_policies::{Backend, DecisionReason, KvAware, KvSources, KvStreams};

    let fleet: Vec<BasicBackend> = (0..64)
        .map(|i| BasicBackend::new(format!("http://worker-{i}:8000")).with_load(i % 7))
        .collect();
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let streams = Arc::new(KvStreams::new());
    let policy = KvAware::new(
        CacheAwareConfig::default(),
        KvSources::new(Arc::clone(&index), Arc::clone(&streams)),
    )
    .expect("valid");
    let prompt: Vec<u32> = (0..2_000).collect();
    for (i, b) in fleet.iter().enumerate() {
        let id = index.register_worker(b.key().to_owned());
        streams.set_live(id, true);
        policy.on_membership(MembershipEvent::Added { key: b.key() });
        if i % 8 == 3 {
            let blocks = 60 + i;
            index
                .apply(
                    id,
                    0,
                    &KvEvent::BlockStored {
                        block_hashes: (0..blocks as i64).map(EngineHash::from_int).collect(),
                        parent_block_hash: None,
                        token_ids: prompt[..blocks * 16].to_vec(),
                        block_size: 16,
                        lora_id: None,
                    },
                )
                .expect("registered");
        }
    }
    let ctx = RequestContext::new("m").with_tokens(&prompt);
    for _ in 0..16 {
        policy.select(&fleet[..], &ctx);
    }
    let n = allocations_during(|| {
        for _ in 0..1000 {
            let d = policy.select(&fleet[..], &ctx).expect("available");
            assert_eq!(d.reason, DecisionReason::KvHit);
        }
    });
    assert_eq!(n, 0, "kv_aware allocated {n} times in 1000 repeated hits");
}
