//! Registry + discovery pool: the lifecycle regressions of the persistent
//! P/D discovery work (identity, roles, generations, reconciliation order).
#![cfg(not(loom))]

use std::sync::Arc;
use std::time::{Duration, Instant};

use worker_lifecycle::{
    DiscoveryPool, Endpoint, Lifecycle, MembershipEvent, PoolError, Registration, RegistryError,
    RoleKind, ServiceRegistry, StaticSetError, StaticWorkerSet, Worker, WorkerOptions, WorkerRole,
    WorkerSpec,
};

const TTL: Duration = Duration::from_secs(30);

fn ep(url: &str) -> Endpoint {
    Endpoint::new(url, None).unwrap()
}

fn pool(role: RoleKind) -> DiscoveryPool {
    DiscoveryPool::new(role, WorkerOptions::default()).unwrap()
}

fn step(pool: &DiscoveryPool, reg: &ServiceRegistry, now: Instant) -> Vec<MembershipEvent> {
    pool.with_reconciled(reg, now, |view| view.events().to_vec())
        .unwrap()
}

fn urls(workers: &[Arc<Worker>]) -> Vec<String> {
    workers.iter().map(|w| w.url().to_owned()).collect()
}

#[test]
fn persistent_identity_across_selections() {
    let reg = ServiceRegistry::new(RoleKind::Regular, TTL);
    let p = pool(RoleKind::Regular);
    let t = Instant::now();
    reg.register(ep("http://a:8000"), Registration::default(), t);
    let first = p
        .with_reconciled(&reg, t, |v| v.workers()[0].reserve())
        .unwrap();
    for i in 1..50 {
        let now = t + Duration::from_millis(i);
        let (same, load) = p
            .with_reconciled(&reg, now, |v| {
                (
                    Arc::ptr_eq(&v.workers()[0], first.worker()),
                    v.workers()[0].load(),
                )
            })
            .unwrap();
        assert!(
            same,
            "one Arc<Worker> for a continuously registered endpoint"
        );
        assert_eq!(load, 1, "the next selection sees the outstanding load");
    }
    drop(first);
    assert_eq!(p.workers()[0].load(), 0);
    assert_eq!(p.workers()[0].processed(), 1);
}

#[test]
fn prefill_and_decode_at_the_same_url_are_separate_workers() {
    let prefill_reg = ServiceRegistry::new(RoleKind::Prefill, TTL);
    let decode_reg = ServiceRegistry::new(RoleKind::Decode, TTL);
    let prefill = pool(RoleKind::Prefill);
    let decode = pool(RoleKind::Decode);
    let t = Instant::now();
    let reg = Registration {
        bootstrap_port: Some(8998),
        ..Registration::default()
    };
    prefill_reg.register(ep("http://same:8000"), reg.clone(), t);
    decode_reg.register(ep("http://same:8000"), Registration::default(), t);
    let pg = prefill
        .with_reconciled(&prefill_reg, t, |v| v.workers()[0].reserve())
        .unwrap();
    let dw = decode
        .with_reconciled(&decode_reg, t, |v| v.workers()[0].clone())
        .unwrap();
    assert_eq!(
        pg.worker().role(),
        WorkerRole::Prefill {
            bootstrap_port: Some(8998)
        }
    );
    assert_eq!(dw.role(), WorkerRole::Decode);
    assert_eq!(pg.worker().load(), 1);
    assert_eq!(
        dw.load(),
        0,
        "prefill load does not show on the decode worker"
    );
    assert_ne!(pg.worker().key(), dw.key());
    // A pool refuses the other role's registry.
    assert!(matches!(
        decode.with_reconciled(&prefill_reg, t, |_| ()),
        Err(PoolError::RoleMismatch { .. })
    ));
}

#[test]
fn empty_snapshot_removes_everyone() {
    let reg = ServiceRegistry::new(RoleKind::Decode, TTL);
    let p = pool(RoleKind::Decode);
    let t = Instant::now();
    reg.register(ep("http://a:1"), Registration::default(), t);
    reg.register(ep("http://b:1"), Registration::default(), t);
    assert_eq!(step(&p, &reg, t).len(), 2);
    let workers = p.workers();
    let later = t + TTL; // both expired, not swept
    let events = step(&p, &reg, later);
    assert_eq!(events.len(), 2);
    assert!(
        events
            .iter()
            .all(|e| matches!(e, MembershipEvent::Removed(_)))
    );
    assert!(p.is_empty());
    assert!(
        workers
            .iter()
            .all(|w| w.lifecycle() == Lifecycle::Removed && !w.is_available())
    );
    // Nothing left behind for a selection to find.
    let picked = p
        .with_reconciled(&reg, later, |v| v.workers().first().cloned())
        .unwrap();
    assert!(picked.is_none());
}

#[test]
fn heartbeat_keeps_the_generation_and_the_worker() {
    let reg = ServiceRegistry::new(RoleKind::Regular, TTL);
    let p = pool(RoleKind::Regular);
    let t = Instant::now();
    let a = ep("http://a:1");
    let g = reg.register(a.clone(), Registration::default(), t);
    assert!(g.new_lifetime);
    step(&p, &reg, t);
    let w = p.get(&a).unwrap();
    let mut now = t;
    for _ in 0..10 {
        now += TTL / 2;
        assert_eq!(reg.heartbeat(&a, Some(g.generation), now), Ok(g.generation));
        // Re-registering with the same registration while live is a heartbeat too.
        let again = reg.register(a.clone(), Registration::default(), now);
        assert_eq!(again.generation, g.generation);
        assert!(!again.new_lifetime);
        assert!(step(&p, &reg, now).is_empty());
        assert!(Arc::ptr_eq(&p.get(&a).unwrap(), &w));
    }
    assert!(matches!(
        reg.heartbeat(&a, Some(g.generation + 1), now),
        Err(RegistryError::StaleGeneration { .. })
    ));
    assert!(matches!(
        reg.heartbeat(&ep("http://nobody:1"), None, now),
        Err(RegistryError::Unknown(_))
    ));
}

#[test]
fn expired_but_not_swept_entry_starts_a_new_generation() {
    let reg = ServiceRegistry::new(RoleKind::Regular, TTL);
    let t = Instant::now();
    let a = ep("http://a:1");
    let first = reg.register(a.clone(), Registration::default(), t);
    let expired_at = t + TTL;
    assert_eq!(reg.len(), 1, "not swept yet");
    assert!(matches!(
        reg.heartbeat(&a, None, expired_at),
        Err(RegistryError::Expired(_))
    ));
    let second = reg.register(a.clone(), Registration::default(), expired_at);
    assert!(second.new_lifetime);
    assert!(second.generation > first.generation);
    assert_eq!(
        reg.sweep(expired_at),
        vec![],
        "the live re-registration is not swept"
    );
}

#[test]
fn expiry_then_same_url_registration_gets_fresh_state() {
    let reg = ServiceRegistry::new(RoleKind::Decode, TTL);
    let p = pool(RoleKind::Decode);
    let t = Instant::now();
    let a = ep("http://a:1");
    reg.register(a.clone(), Registration::default(), t);
    let old_guard = p
        .with_reconciled(&reg, t, |v| v.workers()[0].reserve())
        .unwrap();
    let old = old_guard.worker().clone();
    for _ in 0..3 {
        old.breaker()
            .record_unadmitted(worker_lifecycle::Outcome::ConnectError, t);
    }
    // Expire, sweep, snapshot (empty), then the same URL comes back.
    let t1 = t + TTL;
    assert_eq!(reg.sweep(t1).len(), 1);
    assert!(matches!(
        step(&p, &reg, t1)[..],
        [MembershipEvent::Removed(_)]
    ));
    let t2 = t1 + Duration::from_secs(1);
    reg.register(a.clone(), Registration::default(), t2);
    let events = step(&p, &reg, t2);
    let [MembershipEvent::Added(new)] = &events[..] else {
        panic!("expected one Added, got {events:?}");
    };
    assert!(!Arc::ptr_eq(new, &old));
    assert!(new.generation() > old.generation());
    assert_eq!(new.load(), 0, "fresh load");
    assert_eq!(new.processed(), 0, "fresh processed count");
    assert_eq!(
        new.breaker().state(),
        worker_lifecycle::BreakerState::Closed,
        "fresh breaker"
    );
    assert!(new.is_available());
    // The old request finishes against the old object only.
    drop(old_guard);
    assert_eq!((old.load(), new.load()), (0, 0));
    assert_eq!((old.processed(), new.processed()), (1, 0));
    assert_eq!(old.underflows() + new.underflows(), 0);
}

#[test]
fn replacement_without_an_intermediate_empty_snapshot() {
    let reg = ServiceRegistry::new(RoleKind::Prefill, TTL);
    let p = pool(RoleKind::Prefill);
    let t = Instant::now();
    let a = ep("http://a:1");
    reg.register(a.clone(), Registration::default(), t);
    let old_guard = p
        .with_reconciled(&reg, t, |v| v.workers()[0].reserve())
        .unwrap();
    // Expired and re-registered before the pool looked again.
    let t1 = t + TTL + Duration::from_secs(1);
    reg.register(a.clone(), Registration::default(), t1);
    let (events, new_guard) = p
        .with_reconciled(&reg, t1, |v| {
            (v.events().to_vec(), v.workers()[0].reserve())
        })
        .unwrap();
    let [MembershipEvent::Replaced { old, new }] = &events[..] else {
        panic!("expected Replaced, got {events:?}");
    };
    assert!(Arc::ptr_eq(old, old_guard.worker()));
    assert!(Arc::ptr_eq(new, new_guard.worker()));
    assert_eq!(old.lifecycle(), Lifecycle::Removed);
    assert_eq!((old.load(), new.load()), (1, 1));
    drop(old_guard);
    assert_eq!(
        (old.load(), new.load()),
        (0, 1),
        "old guard never touches the new worker"
    );
    drop(new_guard);
    assert_eq!(new.load(), 0);
}

#[test]
fn a_restart_with_a_new_instance_id_is_a_new_lifetime_before_expiry() {
    let reg = ServiceRegistry::new(RoleKind::Regular, TTL);
    let t = Instant::now();
    let a = ep("http://a:1");
    let with_id = |id: &str| Registration {
        instance_id: Some(id.to_owned()),
        ..Registration::default()
    };
    let first = reg.register(a.clone(), with_id("pid-1"), t);
    let same = reg.register(a.clone(), with_id("pid-1"), t + Duration::from_secs(1));
    let restarted = reg.register(a.clone(), with_id("pid-2"), t + Duration::from_secs(2));
    assert_eq!(same.generation, first.generation);
    assert!(restarted.new_lifetime && restarted.generation > first.generation);
}

#[test]
fn changed_snapshot_order_keeps_endpoint_worker_pairing() {
    let reg = ServiceRegistry::new(RoleKind::Regular, TTL);
    let p = pool(RoleKind::Regular);
    let t = Instant::now();
    for u in ["http://c:1", "http://a:1"] {
        reg.register(ep(u), Registration::default(), t);
    }
    step(&p, &reg, t);
    let before: Vec<_> = p.workers().to_vec();
    reg.register(ep("http://b:1"), Registration::default(), t);
    step(&p, &reg, t);
    let after = p.workers();
    assert_eq!(urls(&after), ["http://a:1", "http://b:1", "http://c:1"]);
    for w in &before {
        let same = after.iter().find(|x| x.endpoint() == w.endpoint()).unwrap();
        assert!(Arc::ptr_eq(same, w), "{} kept its worker", w.url());
    }
}

#[test]
fn a_stale_snapshot_is_refused() {
    let reg = ServiceRegistry::new(RoleKind::Regular, TTL);
    let p = pool(RoleKind::Regular);
    let t = Instant::now();
    reg.register(ep("http://a:1"), Registration::default(), t);
    let old = reg.snapshot(t);
    reg.deregister(&ep("http://a:1"));
    reg.register(ep("http://b:1"), Registration::default(), t);
    let new = reg.snapshot(t);
    p.reconcile(&new).unwrap();
    assert!(matches!(
        p.reconcile(&old),
        Err(PoolError::StaleSnapshot { .. })
    ));
    assert_eq!(
        urls(&p.workers()),
        ["http://b:1"],
        "the departed worker was not resurrected"
    );
    let other = ServiceRegistry::new(RoleKind::Regular, TTL);
    assert_eq!(
        p.reconcile(&other.snapshot(t)).unwrap_err(),
        PoolError::ForeignRegistry
    );
}

#[test]
fn a_caller_with_an_older_clock_reading_does_not_fail_the_step() {
    let reg = ServiceRegistry::new(RoleKind::Regular, TTL);
    let p = pool(RoleKind::Regular);
    let t = Instant::now();
    reg.register(ep("http://a:1"), Registration::default(), t);
    step(&p, &reg, t + Duration::from_secs(5));
    reg.register(ep("http://b:1"), Registration::default(), t);
    let n = p.with_reconciled(&reg, t, |v| v.workers().len()).unwrap();
    assert_eq!(n, 2);
}

#[test]
fn concurrent_steps_never_move_membership_backwards() {
    let reg = Arc::new(ServiceRegistry::new(RoleKind::Decode, TTL));
    let p = Arc::new(pool(RoleKind::Decode));
    let t = Instant::now();
    let a = ep("http://a:1");
    reg.register(a.clone(), Registration::default(), t);
    step(&p, &reg, t);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (reg, p, stop) = (reg.clone(), p.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut last_gen = 0;
                let mut steps = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || steps < 100 {
                    steps += 1;
                    let guard = p
                        .with_reconciled(&reg, Instant::now().max(t), |v| {
                            v.workers().first().map(|w| w.reserve())
                        })
                        .unwrap();
                    if let Some(g) = guard {
                        assert!(
                            g.worker().generation() >= last_gen,
                            "generation went backwards"
                        );
                        last_gen = g.worker().generation();
                    }
                    if steps > 100_000 {
                        break;
                    }
                }
            })
        })
        .collect();
    // Re-register at the same URL with new lifetimes (expired each time).
    let mut now = t;
    for _ in 0..200 {
        now += TTL;
        reg.register(a.clone(), Registration::default(), now);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    let final_gen = reg.snapshot(now).entries.first().map(|e| e.generation);
    let w = p
        .with_reconciled(&reg, now, |v| v.workers()[0].clone())
        .unwrap();
    assert_eq!(Some(w.generation()), final_gen);
    assert_eq!(w.load(), 0);
}

#[test]
fn static_set_uses_the_same_worker_and_events() {
    let set = StaticWorkerSet::new(RoleKind::Decode, WorkerOptions::default()).unwrap();
    let spec = |u: &str| WorkerSpec::new(WorkerRole::Decode, ep(u)).with_model("m");
    let MembershipEvent::Added(a) = set.add(spec("http://a:1")).unwrap() else {
        panic!("expected Added");
    };
    assert_eq!(a.model_id(), Some("m"));
    assert!(matches!(
        set.add(spec("http://a:1")),
        Err(StaticSetError::Duplicate(_))
    ));
    assert!(matches!(
        set.add(WorkerSpec::new(WorkerRole::Regular, ep("http://x:1"))),
        Err(StaticSetError::RoleMismatch { .. })
    ));
    let g = a.reserve();
    let MembershipEvent::Replaced { old, new } = set.replace(spec("http://a:1")).unwrap() else {
        panic!("expected Replaced");
    };
    assert!(Arc::ptr_eq(&old, &a));
    assert!(new.generation() > old.generation());
    assert_eq!(new.load(), 0);
    drop(g);
    assert_eq!((old.load(), new.load()), (0, 0));
    let MembershipEvent::Removed(gone) = set.remove(&ep("http://a:1")).unwrap() else {
        panic!("expected Removed");
    };
    assert!(Arc::ptr_eq(&gone, &new));
    assert!(set.workers().is_empty());
    assert!(matches!(
        set.remove(&ep("http://a:1")),
        Err(StaticSetError::NotFound(_))
    ));
}

#[test]
fn endpoints_are_validated_and_normalized() {
    assert!(Endpoint::new("", None).is_err());
    assert!(Endpoint::new("ftp://a", None).is_err());
    assert!(Endpoint::new("http://", None).is_err());
    assert!(Endpoint::new("http:///path", None).is_err());
    assert!(Endpoint::new("http://a b", None).is_err());
    assert_eq!(
        Endpoint::new("http://a:1/", None).unwrap(),
        ep("http://a:1")
    );
    let ranked = Endpoint::new("http://a:1", Some(3)).unwrap();
    assert_ne!(ranked, ep("http://a:1"));
    assert_eq!(ranked.to_string(), "http://a:1@3");
}

#[test]
fn worker_key_names_role_endpoint_rank_and_generation() {
    let spec = WorkerSpec::new(
        WorkerRole::Prefill {
            bootstrap_port: None,
        },
        Endpoint::new("http://10.0.0.1:8000", Some(1)).unwrap(),
    );
    let w = Worker::new(spec, 7, &WorkerOptions::default());
    assert_eq!(w.key(), "prefill:http://10.0.0.1:8000@1#7");
}
