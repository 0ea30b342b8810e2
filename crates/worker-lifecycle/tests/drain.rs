//! Drain: draining workers are never selected, the wait ends at load 0 or
//! the deadline, and removal emits the membership event.
#![cfg(not(loom))]

use std::sync::Arc;
use std::time::Duration;

use worker_lifecycle::{
    DiscoveryPool, DrainOutcome, Endpoint, Lifecycle, MembershipEvent, Registration, RoleKind,
    ServiceRegistry, StaticWorkerSet, TokioClock, Unavailable, Worker, WorkerOptions, WorkerRole,
    WorkerSpec, drain_worker,
};

fn ep(url: &str) -> Endpoint {
    Endpoint::new(url, None).unwrap()
}

fn options() -> WorkerOptions {
    WorkerOptions {
        clock: Arc::new(TokioClock),
        ..WorkerOptions::default()
    }
}

fn lone_worker() -> Arc<Worker> {
    Worker::new(
        WorkerSpec::new(WorkerRole::Regular, ep("http://a:1")),
        1,
        &options(),
    )
}

#[tokio::test(start_paused = true)]
async fn drain_resolves_when_the_last_guard_is_released() {
    let w = lone_worker();
    let g1 = w.reserve();
    let g2 = w.reserve();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let drained = tokio::spawn({
        let w = w.clone();
        async move { drain_worker(&w, deadline).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(w.lifecycle(), Lifecycle::Draining);
    assert!(!w.is_available(), "a draining worker is never selected");
    assert_eq!(
        w.try_reserve().unwrap_err(),
        Unavailable::NotReady(Lifecycle::Draining)
    );
    drop(g1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!drained.is_finished(), "one request still in flight");
    let released_at = tokio::time::Instant::now();
    drop(g2);
    assert_eq!(drained.await.unwrap(), DrainOutcome::Idle);
    assert_eq!(
        tokio::time::Instant::now(),
        released_at,
        "resolved at once, not at the deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn drain_gives_up_at_the_deadline_and_guards_stay_valid() {
    let w = lone_worker();
    let g = w.reserve();
    let start = tokio::time::Instant::now();
    let outcome = drain_worker(&w, start + Duration::from_secs(30)).await;
    assert_eq!(outcome, DrainOutcome::DeadlineReached { remaining_load: 1 });
    assert_eq!(start.elapsed(), Duration::from_secs(30));
    drop(g);
    assert_eq!((w.load(), w.underflows()), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn an_idle_worker_drains_immediately() {
    let w = lone_worker();
    let outcome = drain_worker(&w, tokio::time::Instant::now() + Duration::from_secs(5)).await;
    assert_eq!(outcome, DrainOutcome::Idle);
}

#[tokio::test(start_paused = true)]
async fn static_set_drain_removes_and_emits_the_event() {
    let set = StaticWorkerSet::new(RoleKind::Regular, options()).unwrap();
    set.add(WorkerSpec::new(WorkerRole::Regular, ep("http://a:1")))
        .unwrap();
    set.add(WorkerSpec::new(WorkerRole::Regular, ep("http://b:1")))
        .unwrap();
    let a = set.get(&ep("http://a:1")).unwrap();
    let g = a.reserve();
    let releaser = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        drop(g);
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let report = set.drain(&ep("http://a:1"), deadline).await.unwrap();
    releaser.await.unwrap();
    assert_eq!(report.outcome, DrainOutcome::Idle);
    assert!(matches!(&report.events[..], [MembershipEvent::Removed(w)] if Arc::ptr_eq(w, &a)));
    assert_eq!(a.lifecycle(), Lifecycle::Removed);
    let left: Vec<_> = set.workers().iter().map(|w| w.url().to_owned()).collect();
    assert_eq!(left, ["http://b:1"]);
}

#[tokio::test(start_paused = true)]
async fn pool_drain_deregisters_exactly_that_generation() {
    let reg = ServiceRegistry::new(RoleKind::Decode, Duration::from_secs(3600));
    let pool = DiscoveryPool::new(RoleKind::Decode, options()).unwrap();
    let now = tokio::time::Instant::now().into_std();
    reg.register(ep("http://a:1"), Registration::default(), now);
    reg.register(ep("http://b:1"), Registration::default(), now);
    pool.with_reconciled(&reg, now, |_| ()).unwrap();
    let a = pool.get(&ep("http://a:1")).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    let report = pool
        .drain(&reg, &ep("http://a:1"), deadline)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.outcome, DrainOutcome::Idle);
    assert!(matches!(&report.events[..], [MembershipEvent::Removed(w)] if Arc::ptr_eq(w, &a)));
    assert!(pool.get(&ep("http://a:1")).is_none());
    assert!(pool.get(&ep("http://b:1")).is_some());
    assert!(
        pool.drain(&reg, &ep("http://zz:1"), deadline)
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test(start_paused = true)]
async fn pending_workers_become_ready_explicitly() {
    let opts = WorkerOptions {
        initial_lifecycle: Lifecycle::Pending,
        ..options()
    };
    let w = Worker::new(
        WorkerSpec::new(WorkerRole::Regular, ep("http://a:1")),
        1,
        &opts,
    );
    assert!(!w.is_available());
    assert!(w.mark_ready());
    assert!(!w.mark_ready());
    assert!(w.is_available());
    assert!(w.start_drain());
    assert!(!w.start_drain());
    assert!(w.mark_removed());
    assert!(!w.mark_removed());
}
