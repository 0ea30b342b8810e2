//! Loom model: the half-open state admits exactly the configured number of
//! probes under racing callers. Bound: 3 threads, LOOM_MAX_PREEMPTIONS=2.
#![cfg(loom)]

use std::time::{Duration, Instant};

use loom::sync::Arc;
use loom::thread;
use worker_lifecycle::{BreakerState, CircuitBreaker, CircuitBreakerConfig, Outcome};

fn open_breaker(probes: u32, t0: Instant) -> CircuitBreaker {
    let b = CircuitBreaker::new(CircuitBreakerConfig {
        failure_threshold: 1,
        open_timeout: Duration::from_secs(1),
        max_open_timeout: Duration::from_secs(1),
        jitter: 0.0,
        jitter_seed: Some(0),
        half_open_probes: probes,
        success_threshold: 1,
        ..CircuitBreakerConfig::default()
    });
    b.record_unadmitted(Outcome::ConnectError, t0);
    assert_eq!(b.state(), BreakerState::Open);
    b
}

fn race(probes: u32, callers: usize) {
    loom::model(move || {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(1);
        let b = Arc::new(open_breaker(probes, t0));
        let handles: Vec<_> = (0..callers)
            .map(|_| {
                let b = b.clone();
                thread::spawn(move || b.try_acquire(later).ok())
            })
            .collect();
        // Slots are held until every caller has been counted.
        let admissions: Vec<_> = handles
            .into_iter()
            .filter_map(|h| h.join().unwrap())
            .collect();
        assert!(admissions.iter().all(|a| a.is_probe()));
        let admitted = admissions.len() as u32;
        assert_eq!(admitted, probes.min(callers as u32));
        assert_eq!(b.probes_in_flight(), admitted);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert_eq!(
            b.counters().half_opened,
            1,
            "one transition, whoever made it"
        );
        for a in admissions {
            b.abandon(a);
        }
        assert_eq!(b.probes_in_flight(), 0);
    });
}

#[test]
fn one_probe_slot_three_racing_callers() {
    race(1, 3);
}

#[test]
fn two_probe_slots_three_racing_callers() {
    race(2, 3);
}

#[test]
fn a_probe_success_racing_a_new_caller_never_admits_two_probes() {
    loom::model(|| {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(1);
        let b = Arc::new(open_breaker(1, t0));
        let probe = b.try_acquire(later).unwrap();
        let b2 = b.clone();
        let other = thread::spawn(move || b2.try_acquire(later).map(|a| a.is_probe()));
        b.record(probe, Outcome::Success, later);
        match other.join().unwrap() {
            // Before the success closed the breaker: refused.
            Err(_) => {}
            // After: admitted as an ordinary request, never as a second probe.
            Ok(is_probe) => assert!(!is_probe),
        }
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.probes_in_flight(), 0);
    });
}
