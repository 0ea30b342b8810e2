//! Loom model: a registry change reconciled on one thread while another
//! selects and reserves through the serialized pool step. The guard handed
//! out is always for a worker of the snapshot read in that same step: never a
//! removed worker passed off as the new generation's, and an old generation's
//! guard never touches the new worker. Bound: 2 threads, LOOM_MAX_PREEMPTIONS=2.
#![cfg(loom)]

use std::time::{Duration, Instant};

use loom::sync::Arc;
use loom::thread;
use worker_lifecycle::{
    DiscoveryPool, Endpoint, Lifecycle, Registration, RoleKind, ServiceRegistry, WorkerOptions,
};

#[test]
fn reconcile_racing_select_and_reserve() {
    loom::model(|| {
        let t = Instant::now();
        let endpoint = Endpoint::new("http://a:1", None).unwrap();
        let registry = Arc::new(ServiceRegistry::new(
            RoleKind::Decode,
            Duration::from_secs(60),
        ));
        let pool =
            Arc::new(DiscoveryPool::new(RoleKind::Decode, WorkerOptions::default()).unwrap());
        let first = registry.register(endpoint.clone(), Registration::default(), t);
        pool.with_reconciled(&registry, t, |_| ()).unwrap();

        // The worker restarts: a new instance at the same URL, a new lifetime.
        let (reg2, pool2, ep2) = (registry.clone(), pool.clone(), endpoint.clone());
        let restarter = thread::spawn(move || {
            let restarted = Registration {
                instance_id: Some("second".into()),
                ..Registration::default()
            };
            let outcome = reg2.register(ep2, restarted, t);
            pool2.with_reconciled(&reg2, t, |_| ()).unwrap();
            outcome.generation
        });

        let guard = pool
            .with_reconciled(&registry, t, |view| {
                let worker = view.workers().first()?;
                // Inside the step, the worker handed out is a live member.
                assert_eq!(worker.lifecycle(), Lifecycle::Ready);
                Some(worker.reserve())
            })
            .unwrap()
            .expect("the endpoint is always registered");

        let second = restarter.join().unwrap();
        assert!(second > first.generation);
        let current = pool.get(&endpoint).unwrap();
        assert_eq!(
            current.generation(),
            second,
            "membership never moved backwards"
        );
        let g = guard.worker().generation();
        assert!(g == first.generation || g == second);
        if g == second {
            assert!(std::sync::Arc::ptr_eq(guard.worker(), &current));
            assert_eq!(current.load(), 1);
        } else {
            assert_eq!(guard.worker().lifecycle(), Lifecycle::Removed);
            assert_eq!(guard.worker().load(), 1);
            assert_eq!(
                current.load(),
                0,
                "an old guard never counts on the new worker"
            );
        }
        drop(guard);
        assert_eq!(current.load(), 0);
        assert_eq!(current.underflows(), 0);
    });
}

#[test]
fn racing_registrations_of_one_endpoint_start_one_lifetime() {
    loom::model(|| {
        let t = Instant::now();
        let endpoint = Endpoint::new("http://a:1", None).unwrap();
        let registry = Arc::new(ServiceRegistry::new(
            RoleKind::Prefill,
            Duration::from_secs(60),
        ));
        // An entry that has expired but was never swept.
        let expired = registry.register(endpoint.clone(), Registration::default(), t);
        let later = t + Duration::from_secs(60);
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let (registry, endpoint) = (registry.clone(), endpoint.clone());
                thread::spawn(move || registry.register(endpoint, Registration::default(), later))
            })
            .collect();
        let outcomes: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(outcomes[0].generation, outcomes[1].generation);
        assert!(outcomes[0].generation > expired.generation);
        assert_eq!(outcomes.iter().filter(|o| o.new_lifetime).count(), 1);
    });
}
