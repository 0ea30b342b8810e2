//! Circuit-breaker timelines, asserted to the nanosecond with time passed in.
#![cfg(not(loom))]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use worker_lifecycle::{
    BreakerState, BreakerTransition, CircuitBreaker, CircuitBreakerConfig, Endpoint,
    FailureRateWindow, ManualClock, Outcome, Rejected, TransitionHook, Unavailable, Worker,
    WorkerOptions, WorkerRole, WorkerSpec,
};

const S: Duration = Duration::from_secs(1);

fn exact() -> CircuitBreakerConfig {
    CircuitBreakerConfig {
        failure_threshold: 3,
        open_timeout: 2 * S,
        backoff_multiplier: 2.0,
        max_open_timeout: 10 * S,
        jitter: 0.0,
        jitter_seed: Some(1),
        half_open_probes: 1,
        success_threshold: 2,
        ..CircuitBreakerConfig::default()
    }
}

fn fail(b: &CircuitBreaker, now: Instant) {
    let a = b.try_acquire(now).expect("admitted");
    b.record(a, Outcome::ServerError(503), now);
}

fn succeed(b: &CircuitBreaker, now: Instant) {
    let a = b.try_acquire(now).expect("admitted");
    b.record(a, Outcome::Success, now);
}

/// Opens the breaker with `failure_threshold` failures at `t`.
fn trip(b: &CircuitBreaker, t: Instant) {
    for _ in 0..b.config().failure_threshold {
        fail(b, t);
    }
    assert_eq!(b.state(), BreakerState::Open);
}

#[test]
fn opens_after_exactly_n_consecutive_failures() {
    let b = CircuitBreaker::new(exact());
    let t0 = Instant::now();
    fail(&b, t0);
    fail(&b, t0);
    assert_eq!(b.state(), BreakerState::Closed);
    succeed(&b, t0); // a success resets the streak
    fail(&b, t0);
    fail(&b, t0);
    assert_eq!(b.state(), BreakerState::Closed);
    fail(&b, t0);
    assert_eq!(b.state(), BreakerState::Open);
    assert_eq!(b.try_acquire(t0), Err(Rejected::Open));
    assert_eq!(b.counters().opened, 1);
    assert_eq!(b.counters().rejected, 1);
}

#[test]
fn open_timeout_is_exact_and_grows_exponentially_up_to_the_cap() {
    let b = CircuitBreaker::new(exact());
    let mut t = Instant::now();
    // Reopen from half-open repeatedly: 2 s, 4 s, 8 s, then capped at 10 s.
    trip(&b, t);
    for expected in [2 * S, 4 * S, 8 * S, 10 * S, 10 * S] {
        let just_before = t + expected - Duration::from_nanos(1);
        assert_eq!(
            b.try_acquire(just_before),
            Err(Rejected::Open),
            "{expected:?}"
        );
        t += expected;
        let probe = b.try_acquire(t).expect("half-open at exactly the timeout");
        assert!(probe.is_probe());
        assert_eq!(b.state(), BreakerState::HalfOpen);
        b.record(probe, Outcome::Timeout, t);
        assert_eq!(b.state(), BreakerState::Open);
    }
    assert_eq!(b.counters().opened, 6);
    assert_eq!(b.counters().half_opened, 5);
}

#[test]
fn closing_resets_the_backoff() {
    let b = CircuitBreaker::new(exact());
    let mut t = Instant::now();
    trip(&b, t);
    t += 2 * S;
    let p = b.try_acquire(t).unwrap();
    b.record(p, Outcome::ConnectError, t); // reopen: 4 s
    t += 4 * S;
    for _ in 0..2 {
        let p = b.try_acquire(t).unwrap();
        b.record(p, Outcome::Success, t);
    }
    assert_eq!(b.state(), BreakerState::Closed);
    trip(&b, t);
    assert_eq!(
        b.try_acquire(t + 2 * S - Duration::from_nanos(1)),
        Err(Rejected::Open)
    );
    assert!(b.try_acquire(t + 2 * S).is_ok(), "back to the base timeout");
}

#[test]
fn half_open_admits_exactly_one_probe_and_needs_m_successes() {
    let b = CircuitBreaker::new(exact());
    let t0 = Instant::now();
    trip(&b, t0);
    let t = t0 + 2 * S;
    let probe = b.try_acquire(t).unwrap();
    assert_eq!(b.try_acquire(t), Err(Rejected::ProbesBusy));
    assert_eq!(b.try_acquire(t + S), Err(Rejected::ProbesBusy));
    assert_eq!(b.probes_in_flight(), 1);
    b.record(probe, Outcome::Success, t + S);
    assert_eq!(
        b.state(),
        BreakerState::HalfOpen,
        "one success is not enough"
    );
    let probe = b.try_acquire(t + S).unwrap();
    b.record(probe, Outcome::Success, t + S);
    assert_eq!(b.state(), BreakerState::Closed);
    assert_eq!(b.counters().closed, 1);
    // Closed: everyone is admitted, nothing is a probe.
    for _ in 0..5 {
        assert!(!b.try_acquire(t + S).unwrap().is_probe());
    }
}

#[test]
fn half_open_admits_the_configured_number_of_probes() {
    let b = CircuitBreaker::new(CircuitBreakerConfig {
        half_open_probes: 3,
        ..exact()
    });
    let t = Instant::now();
    trip(&b, t);
    let t = t + 2 * S;
    let probes: Vec<_> = (0..3).map(|_| b.try_acquire(t).unwrap()).collect();
    assert_eq!(b.try_acquire(t), Err(Rejected::ProbesBusy));
    let mut probes = probes.into_iter();
    b.abandon(probes.next().unwrap());
    let again = b.try_acquire(t).expect("an abandoned probe frees its slot");
    assert_eq!(b.try_acquire(t), Err(Rejected::ProbesBusy));
    b.record(again, Outcome::ClientError(404), t);
    let again = b.try_acquire(t).expect("a neutral outcome frees its slot");
    b.record(again, Outcome::ClientCancelled, t);
    assert_eq!(
        b.state(),
        BreakerState::HalfOpen,
        "neutral outcomes count for nothing"
    );
    for p in probes {
        b.record(p, Outcome::Success, t);
    }
    assert_eq!(b.state(), BreakerState::Closed);
}

#[test]
fn neutral_outcomes_never_open_the_breaker() {
    let b = CircuitBreaker::new(exact());
    let t = Instant::now();
    for outcome in [
        Outcome::ClientError(400),
        Outcome::ClientError(429),
        Outcome::from_status(404),
        Outcome::ClientCancelled,
        Outcome::RouterRejected,
    ] {
        for _ in 0..10 {
            let a = b.try_acquire(t).unwrap();
            b.record(a, outcome, t);
        }
    }
    assert_eq!(b.state(), BreakerState::Closed);
    // And they do not break a failure streak either way: 2 failures, 10
    // neutral, 1 failure opens.
    fail(&b, t);
    fail(&b, t);
    for _ in 0..10 {
        b.record_unadmitted(Outcome::ClientCancelled, t);
    }
    fail(&b, t);
    assert_eq!(b.state(), BreakerState::Open);
}

#[test]
fn every_worker_failure_kind_counts() {
    for outcome in [
        Outcome::ServerError(500),
        Outcome::ConnectError,
        Outcome::Timeout,
        Outcome::ConnectionReset,
    ] {
        let b = CircuitBreaker::new(exact());
        let t = Instant::now();
        for _ in 0..3 {
            b.record_unadmitted(outcome, t);
        }
        assert_eq!(b.state(), BreakerState::Open, "{outcome:?}");
    }
}

#[test]
fn failure_rate_window_is_used() {
    let window = FailureRateWindow {
        window: 10 * S,
        buckets: 10,
        min_requests: 10,
        failure_rate: 0.5,
    };
    let b = CircuitBreaker::new(CircuitBreakerConfig {
        failure_threshold: 1_000,
        failure_rate: Some(window),
        ..exact()
    });
    let t0 = Instant::now();
    // Alternate success/failure: never 2 consecutive failures, but 50 %.
    for i in 0..9 {
        let outcome = if i % 2 == 0 {
            Outcome::Success
        } else {
            Outcome::ServerError(500)
        };
        b.record_unadmitted(outcome, t0);
    }
    assert_eq!(b.state(), BreakerState::Closed, "9 < min_requests");
    b.record_unadmitted(Outcome::ServerError(500), t0);
    assert_eq!(b.state(), BreakerState::Open, "5 of 10 failed");
}

#[test]
fn failure_rate_window_slides() {
    let window = FailureRateWindow {
        window: 10 * S,
        buckets: 10,
        min_requests: 4,
        failure_rate: 0.5,
    };
    let b = CircuitBreaker::new(CircuitBreakerConfig {
        failure_threshold: 1_000,
        failure_rate: Some(window),
        ..exact()
    });
    let t0 = Instant::now();
    for _ in 0..3 {
        b.record_unadmitted(Outcome::ServerError(500), t0);
    }
    // Eleven seconds later those failures have left the window.
    let t1 = t0 + 11 * S;
    for _ in 0..3 {
        b.record_unadmitted(Outcome::Success, t1);
    }
    b.record_unadmitted(Outcome::ServerError(500), t1);
    assert_eq!(b.state(), BreakerState::Closed, "1 of 4 in the window");
    b.record_unadmitted(Outcome::ServerError(500), t1 + S);
    assert_eq!(b.state(), BreakerState::Closed, "2 of 5 is below 50 %");
    b.record_unadmitted(Outcome::ServerError(500), t1 + S);
    assert_eq!(b.state(), BreakerState::Open, "3 of 6 reaches 50 %");
}

#[test]
fn jitter_stays_within_bounds_and_is_reproducible_by_seed() {
    let config = CircuitBreakerConfig {
        jitter: 0.5,
        jitter_seed: Some(42),
        ..exact()
    };
    let durations = |config: &CircuitBreakerConfig| {
        let hook_seen = Arc::new(Mutex::new(Vec::new()));
        let seen = hook_seen.clone();
        let hook: TransitionHook = Arc::new(move |_, t: &BreakerTransition| {
            if let Some(d) = t.open_for {
                seen.lock().unwrap().push(d);
            }
        });
        let b = CircuitBreaker::with_hook("w", config.clone(), Some(hook));
        let mut t = Instant::now();
        trip(&b, t);
        for _ in 0..5 {
            t += 20 * S;
            let p = b.try_acquire(t).unwrap();
            b.record(p, Outcome::Timeout, t);
        }
        hook_seen.lock().unwrap().clone()
    };
    let first = durations(&config);
    assert_eq!(first, durations(&config), "same seed, same timeline");
    assert_eq!(first.len(), 6);
    for (i, d) in first.iter().enumerate() {
        let base = config.backoff_before_jitter(i as u32 + 1);
        assert!(
            *d <= base && *d > base.mul_f64(0.5),
            "{i}: {d:?} vs {base:?}"
        );
    }
    let other = durations(&CircuitBreakerConfig {
        jitter_seed: Some(43),
        ..config.clone()
    });
    assert_ne!(first, other);
}

#[test]
fn hook_and_counters_see_every_transition() {
    let log: Arc<Mutex<Vec<(String, BreakerState, BreakerState)>>> = Arc::default();
    let sink = log.clone();
    let hook: TransitionHook = Arc::new(move |name, t| {
        sink.lock().unwrap().push((name.to_owned(), t.from, t.to));
    });
    let b = CircuitBreaker::with_hook("decode:http://a#1", exact(), Some(hook));
    let t = Instant::now();
    trip(&b, t);
    let p = b.try_acquire(t + 2 * S).unwrap();
    b.record(p, Outcome::Success, t + 2 * S);
    let p = b.try_acquire(t + 2 * S).unwrap();
    b.record(p, Outcome::Success, t + 2 * S);
    use BreakerState::*;
    let log = log.lock().unwrap();
    let states: Vec<_> = log.iter().map(|(_, f, to)| (*f, *to)).collect();
    assert_eq!(
        states,
        [(Closed, Open), (Open, HalfOpen), (HalfOpen, Closed)]
    );
    assert!(log.iter().all(|(name, _, _)| name == "decode:http://a#1"));
    let c = b.counters();
    assert_eq!((c.opened, c.half_opened, c.closed), (1, 1, 1));
}

#[test]
fn stale_outcomes_from_before_opening_are_ignored() {
    let b = CircuitBreaker::new(exact());
    let t = Instant::now();
    let early = b.try_acquire(t).unwrap(); // admitted while closed
    trip(&b, t);
    let later = t + 2 * S;
    let probe = b.try_acquire(later).unwrap();
    // The early request's success must not count as a probe success.
    b.record(early, Outcome::Success, later);
    b.record_unadmitted(Outcome::Success, later);
    assert_eq!(b.state(), BreakerState::HalfOpen);
    assert_eq!(b.probes_in_flight(), 1);
    b.record(probe, Outcome::ServerError(502), later);
    assert_eq!(b.state(), BreakerState::Open);
}

#[test]
fn disabled_breaker_admits_everything() {
    let b = CircuitBreaker::new(CircuitBreakerConfig::disabled());
    let t = Instant::now();
    for _ in 0..100 {
        b.record_unadmitted(Outcome::ServerError(500), t);
    }
    assert_eq!(b.state(), BreakerState::Closed);
    assert!(b.try_acquire(t).is_ok());
}

#[test]
fn config_validation_rejects_nonsense_and_new_clamps_it() {
    let bad = [
        CircuitBreakerConfig {
            failure_threshold: 0,
            ..exact()
        },
        CircuitBreakerConfig {
            half_open_probes: 0,
            ..exact()
        },
        CircuitBreakerConfig {
            success_threshold: 0,
            ..exact()
        },
        CircuitBreakerConfig {
            backoff_multiplier: 0.5,
            ..exact()
        },
        CircuitBreakerConfig {
            backoff_multiplier: f64::NAN,
            ..exact()
        },
        CircuitBreakerConfig {
            jitter: 1.5,
            ..exact()
        },
        CircuitBreakerConfig {
            jitter: f64::NAN,
            ..exact()
        },
        CircuitBreakerConfig {
            max_open_timeout: S,
            ..exact()
        },
        CircuitBreakerConfig {
            failure_rate: Some(FailureRateWindow {
                buckets: 0,
                ..FailureRateWindow::default()
            }),
            ..exact()
        },
        CircuitBreakerConfig {
            failure_rate: Some(FailureRateWindow {
                failure_rate: 0.0,
                ..FailureRateWindow::default()
            }),
            ..exact()
        },
    ];
    for config in bad {
        assert!(config.validate().is_err(), "{config:?}");
        // Constructing anyway never panics, and the breaker works.
        let b = CircuitBreaker::new(config);
        let t = Instant::now();
        for _ in 0..5 {
            b.record_unadmitted(Outcome::ServerError(500), t);
        }
        assert!(b.try_acquire(t + Duration::from_secs(3600)).is_ok());
    }
    assert!(CircuitBreakerConfig::default().validate().is_ok());
}

fn worker_with(clock: Arc<ManualClock>) -> Arc<Worker> {
    let options = WorkerOptions {
        breaker: exact(),
        clock,
        ..WorkerOptions::default()
    };
    let endpoint = Endpoint::new("http://127.0.0.1:7000", None).unwrap();
    Worker::new(WorkerSpec::new(WorkerRole::Regular, endpoint), 1, &options)
}

#[test]
fn worker_probe_slot_is_returned_when_the_guard_is_dropped_without_an_outcome() {
    let clock = Arc::new(ManualClock::default());
    let w = worker_with(clock.clone());
    for _ in 0..3 {
        w.try_reserve()
            .unwrap()
            .record_outcome(Outcome::ConnectError);
    }
    assert!(!w.is_available());
    assert!(matches!(
        w.try_reserve(),
        Err(Unavailable::Breaker(Rejected::Open))
    ));
    clock.advance(2 * S);
    assert!(
        w.is_available(),
        "open timeout passed: a probe would be admitted"
    );
    let probe = w.try_reserve().unwrap();
    assert!(probe.is_probe());
    assert!(!w.is_available(), "the only probe slot is taken");
    assert!(matches!(
        w.try_reserve(),
        Err(Unavailable::Breaker(Rejected::ProbesBusy))
    ));
    drop(probe); // cancelled before any outcome
    assert_eq!(w.breaker().probes_in_flight(), 0);
    assert!(w.is_available());
    let probe = w.try_reserve().unwrap();
    let shared = probe.share();
    shared.record_outcome(Outcome::Success);
    assert!(!probe.is_probe(), "the probe outcome was taken once");
    drop((probe, shared));
    let probe = w.try_reserve().unwrap();
    probe.record_outcome(Outcome::Success);
    drop(probe);
    assert_eq!(w.breaker().state(), BreakerState::Closed);
    assert_eq!(w.load(), 0);
    assert_eq!(w.underflows(), 0);
}

#[tokio::test(start_paused = true)]
async fn worker_breaker_timeline_under_paused_tokio_time() {
    use worker_lifecycle::TokioClock;
    let options = WorkerOptions {
        breaker: exact(),
        clock: Arc::new(TokioClock),
        ..WorkerOptions::default()
    };
    let endpoint = Endpoint::new("http://127.0.0.1:7001", None).unwrap();
    let w = Worker::new(WorkerSpec::new(WorkerRole::Decode, endpoint), 1, &options);
    let ms = Duration::from_millis(1);
    for _ in 0..3 {
        w.try_reserve()
            .unwrap()
            .record_outcome(Outcome::ServerError(500));
    }
    // First opening: exactly 2 s.
    tokio::time::sleep(2 * S - ms).await;
    assert!(!w.is_available());
    tokio::time::sleep(ms).await;
    assert!(w.is_available());
    let probe = w.try_reserve().unwrap();
    assert!(probe.is_probe());
    assert!(w.try_reserve().is_err(), "a single probe at a time");
    probe.record_outcome(Outcome::Timeout);
    drop(probe);
    // Second opening: exactly 4 s.
    tokio::time::sleep(4 * S - ms).await;
    assert!(!w.is_available());
    tokio::time::sleep(ms).await;
    for _ in 0..2 {
        let probe = w.try_reserve().unwrap();
        assert!(probe.is_probe());
        probe.record_outcome(Outcome::Success);
    }
    assert_eq!(w.breaker().state(), BreakerState::Closed);
    assert!(w.is_available());
    assert_eq!((w.load(), w.underflows(), w.processed()), (0, 0, 6));
}
