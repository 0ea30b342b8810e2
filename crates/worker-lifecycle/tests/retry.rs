//! Retry policy and budget.
#![cfg(not(loom))]

use std::time::{Duration, Instant};

use worker_lifecycle::{RetryBudget, RetryBudgetConfig, RetryPolicy, SplitMix64};

#[test]
fn max_retries_counts_retries_not_attempts() {
    let p = RetryPolicy {
        max_retries: 2,
        ..RetryPolicy::default()
    };
    assert!(!p.allows_retry(0));
    assert!(p.allows_retry(1) && p.allows_retry(2));
    assert!(!p.allows_retry(3), "2 retries = 3 attempts in all");
    assert!(!RetryPolicy::no_retries().allows_retry(1));
}

#[test]
fn default_retryable_statuses() {
    let p = RetryPolicy::default();
    for s in [408, 429, 500, 502, 503, 504] {
        assert!(p.is_retryable_status(s), "{s}");
    }
    for s in [200, 400, 401, 404, 501, 505] {
        assert!(!p.is_retryable_status(s), "{s}");
    }
}

#[test]
fn backoff_grows_exponentially_to_the_cap_with_bounded_jitter() {
    let p = RetryPolicy {
        max_retries: 10,
        initial_backoff: Duration::from_millis(100),
        multiplier: 2.0,
        max_backoff: Duration::from_millis(1000),
        jitter: 0.0,
        ..RetryPolicy::default()
    };
    let mut rng = SplitMix64::new(1);
    let exact: Vec<u64> = (1..=6)
        .map(|r| p.backoff(r, &mut rng).as_millis() as u64)
        .collect();
    assert_eq!(exact, [100, 200, 400, 800, 1000, 1000]);

    let jittered = RetryPolicy { jitter: 0.5, ..p };
    let mut a = SplitMix64::new(9);
    let mut b = SplitMix64::new(9);
    for r in 1..=6 {
        let base = jittered.backoff_before_jitter(r);
        let d = jittered.backoff(r, &mut a);
        assert!(d <= base && d >= base / 2, "{r}: {d:?}");
        assert_eq!(d, jittered.backoff(r, &mut b), "same seed, same delay");
    }
    // An injected source that always returns the top of the range takes the
    // whole jitter off.
    let mut top = || u64::MAX;
    let d = jittered.backoff(1, &mut top);
    assert!(d >= Duration::from_millis(50) && d < Duration::from_millis(51));
}

#[test]
fn nonsense_settings_do_not_panic() {
    let p = RetryPolicy {
        multiplier: f64::NAN,
        jitter: f64::INFINITY,
        initial_backoff: Duration::from_secs(5),
        max_backoff: Duration::ZERO,
        ..RetryPolicy::default()
    };
    let mut rng = SplitMix64::new(3);
    for r in [0, 1, 2, 100, u32::MAX] {
        assert!(p.backoff(r, &mut rng) <= Duration::from_secs(5));
    }
}

#[test]
fn budget_floor_allows_retries_without_traffic() {
    let t = Instant::now();
    let budget = RetryBudget::new(
        RetryBudgetConfig {
            ratio: 0.2,
            min_per_second: 1,
            window: Duration::from_secs(10),
        },
        t,
    );
    let allowed = (0..100).filter(|_| budget.try_withdraw(t)).count();
    assert_eq!(allowed, 10, "1 per second over a 10 s window");
}

#[test]
fn budget_is_a_fraction_of_recent_requests() {
    let t = Instant::now();
    let budget = RetryBudget::new(
        RetryBudgetConfig {
            ratio: 0.2,
            min_per_second: 0,
            window: Duration::from_secs(10),
        },
        t,
    );
    for _ in 0..100 {
        budget.record_request(t);
    }
    assert_eq!(budget.allowance(t), 20);
    let allowed = (0..100).filter(|_| budget.try_withdraw(t)).count();
    assert_eq!(allowed, 20, "an outage cannot multiply load beyond 1.2x");
    // After the window slides past, the old requests and retries are gone.
    let later = t + Duration::from_secs(11);
    assert_eq!(budget.allowance(later), 0);
    assert!(!budget.try_withdraw(later));
    for _ in 0..10 {
        budget.record_request(later);
    }
    assert_eq!((0..10).filter(|_| budget.try_withdraw(later)).count(), 2);
}

#[test]
fn decide_checks_retryability_then_count_then_budget() {
    use worker_lifecycle::{Outcome, RetryDecision};
    let p = RetryPolicy {
        max_retries: 2,
        jitter: 0.0,
        initial_backoff: Duration::from_millis(10),
        ..RetryPolicy::default()
    };
    let t = Instant::now();
    let mut rng = SplitMix64::new(0);
    let budget = RetryBudget::new(
        RetryBudgetConfig {
            ratio: 0.0,
            min_per_second: 1,
            window: Duration::from_secs(1),
        },
        t,
    );
    for outcome in [
        Outcome::Success,
        Outcome::ClientError(400),
        Outcome::ServerError(501),
        Outcome::ClientCancelled,
        Outcome::RouterRejected,
    ] {
        assert_eq!(
            p.decide(outcome, 0, None, t, &mut rng),
            RetryDecision::NotRetryable,
            "{outcome:?}"
        );
    }
    for outcome in [
        Outcome::ServerError(503),
        Outcome::ClientError(429),
        Outcome::ConnectError,
        Outcome::ConnectionReset,
        Outcome::Timeout,
    ] {
        assert!(p.is_retryable(outcome), "{outcome:?}");
    }
    assert_eq!(
        p.decide(Outcome::ServerError(502), 0, None, t, &mut rng),
        RetryDecision::RetryAfter(Duration::from_millis(10))
    );
    assert_eq!(
        p.decide(Outcome::ServerError(502), 1, None, t, &mut rng),
        RetryDecision::RetryAfter(Duration::from_millis(20))
    );
    assert_eq!(
        p.decide(Outcome::ServerError(502), 2, None, t, &mut rng),
        RetryDecision::RetriesExhausted
    );
    // The budget (1 retry per second, no traffic) allows one retry, then no more.
    assert!(matches!(
        p.decide(Outcome::ConnectError, 0, Some(&budget), t, &mut rng),
        RetryDecision::RetryAfter(_)
    ));
    assert_eq!(
        p.decide(Outcome::ConnectError, 0, Some(&budget), t, &mut rng),
        RetryDecision::BudgetExhausted
    );
}
