//! Retries: how many, how long to wait, for which statuses, and a budget.
//!
//! [`RetryPolicy::max_retries`] counts *retries*: a request may be sent
//! `1 + max_retries` times. Backoff before retry `n` (1-based) is
//! `initial_backoff × multiplier^(n−1)`, capped at `max_backoff`, with up to
//! `jitter` of it taken off at random (randomness injected, see
//! [`RandomSource`]).
//!
//! A [`RetryBudget`] bounds retries across all requests, Linkerd/Envoy
//! style: retries within the sliding window may not exceed
//! `ratio × requests in the window + min_per_second × window seconds`. A
//! fleet-wide outage then costs at most `1 + ratio` times the normal load
//! instead of `1 + max_retries` times.

use std::time::{Duration, Instant};

use crate::outcome::Outcome;
use crate::rng::RandomSource;
use crate::sync::{AtomicU64, Ordering};

/// Statuses retried by default: 408, 429, 500, 502, 503, 504.
pub const DEFAULT_RETRYABLE_STATUSES: [u16; 6] = [408, 429, 500, 502, 503, 504];

/// Per-request retry settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Retries after the first attempt (0 = never retry).
    pub max_retries: u32,
    /// Backoff before the first retry.
    pub initial_backoff: Duration,
    /// Growth factor per retry (at least 1.0).
    pub multiplier: f64,
    /// Largest backoff (before jitter).
    pub max_backoff: Duration,
    /// Fraction in `[0, 1]` of the backoff that jitter may take off.
    pub jitter: f64,
    /// Response statuses that may be retried.
    pub retryable_statuses: Vec<u16>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 2,
            initial_backoff: Duration::from_millis(50),
            multiplier: 2.0,
            max_backoff: Duration::from_secs(2),
            jitter: 0.5,
            retryable_statuses: DEFAULT_RETRYABLE_STATUSES.to_vec(),
        }
    }
}

impl RetryPolicy {
    /// A policy that never retries.
    pub fn no_retries() -> Self {
        Self {
            max_retries: 0,
            ..Self::default()
        }
    }

    /// Whether a response with `status` may be retried.
    pub fn is_retryable_status(&self, status: u16) -> bool {
        self.retryable_statuses.contains(&status)
    }

    /// Whether retry number `retry` (1-based) is within `max_retries`.
    pub fn allows_retry(&self, retry: u32) -> bool {
        retry >= 1 && retry <= self.max_retries
    }

    /// The backoff before retry number `retry` (1-based) without jitter.
    pub fn backoff_before_jitter(&self, retry: u32) -> Duration {
        let multiplier = if self.multiplier.is_finite() && self.multiplier >= 1.0 {
            self.multiplier
        } else {
            1.0
        };
        let exponent = retry.saturating_sub(1).min(64) as i32;
        let secs = self.initial_backoff.as_secs_f64() * multiplier.powi(exponent);
        let cap = self.max_backoff.max(self.initial_backoff);
        if secs.is_finite() && secs < cap.as_secs_f64() {
            Duration::from_secs_f64(secs)
        } else {
            cap
        }
    }

    /// The backoff before retry number `retry` (1-based), with jitter from
    /// `rng`: in `[b × (1 − jitter), b]` where `b` is
    /// [`backoff_before_jitter`](Self::backoff_before_jitter).
    pub fn backoff(&self, retry: u32, rng: &mut impl RandomSource) -> Duration {
        let base = self.backoff_before_jitter(retry);
        let jitter = if self.jitter.is_nan() {
            0.0
        } else {
            self.jitter.clamp(0.0, 1.0)
        };
        base.mul_f64(1.0 - jitter * rng.next_unit())
    }
}

/// What [`RetryPolicy::decide`] says about a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Retry after waiting this long.
    RetryAfter(Duration),
    /// The outcome is not one that a retry can fix (success, a client error
    /// outside the retryable list, the client went away, the router refused).
    NotRetryable,
    /// `max_retries` retries have been made already.
    RetriesExhausted,
    /// The shared retry budget has no room: retrying would multiply load.
    BudgetExhausted,
}

impl RetryPolicy {
    /// Whether an attempt that ended with `outcome` may be retried at all:
    /// a status in [`retryable_statuses`](Self::retryable_statuses), a
    /// connection that could not be made or was reset, or a timeout when 504
    /// (gateway timeout) is in the list.
    pub fn is_retryable(&self, outcome: Outcome) -> bool {
        match outcome {
            Outcome::ServerError(status) | Outcome::ClientError(status) => {
                self.is_retryable_status(status)
            }
            Outcome::ConnectError | Outcome::ConnectionReset => true,
            Outcome::Timeout => self.is_retryable_status(504),
            Outcome::Success | Outcome::ClientCancelled | Outcome::RouterRejected => false,
        }
    }

    /// Decides about retry number `retries_done + 1` after an attempt ended
    /// with `outcome` at `now`: checks retryability, `max_retries`, then
    /// withdraws from `budget` (if any) and picks the backoff.
    pub fn decide(
        &self,
        outcome: Outcome,
        retries_done: u32,
        budget: Option<&RetryBudget>,
        now: Instant,
        rng: &mut impl RandomSource,
    ) -> RetryDecision {
        if !self.is_retryable(outcome) {
            return RetryDecision::NotRetryable;
        }
        let retry = retries_done.saturating_add(1);
        if !self.allows_retry(retry) {
            return RetryDecision::RetriesExhausted;
        }
        if let Some(budget) = budget
            && !budget.try_withdraw(now)
        {
            return RetryDecision::BudgetExhausted;
        }
        RetryDecision::RetryAfter(self.backoff(retry, rng))
    }
}

/// Retry-budget settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryBudgetConfig {
    /// Retries allowed per request in the window (0.2 = 20 %).
    pub ratio: f64,
    /// Retries allowed per second regardless of traffic, so that a quiet
    /// service can still retry.
    pub min_per_second: u32,
    /// Length of the sliding window.
    pub window: Duration,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        Self {
            ratio: 0.2,
            min_per_second: 10,
            window: Duration::from_secs(10),
        }
    }
}

const BUDGET_BUCKETS: usize = 10;

struct Bucket {
    index: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
}

/// A shared retry budget. Lock-free: a sliding window of atomic buckets.
/// Counts near a bucket boundary are approximate under contention (a budget
/// does not need more).
pub struct RetryBudget {
    config: RetryBudgetConfig,
    origin: Instant,
    bucket_nanos: u64,
    buckets: [Bucket; BUDGET_BUCKETS],
}

impl std::fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryBudget")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RetryBudget {
    /// An empty budget whose window starts at `now`.
    pub fn new(config: RetryBudgetConfig, now: Instant) -> Self {
        let window = config
            .window
            .max(Duration::from_millis(BUDGET_BUCKETS as u64));
        let bucket_nanos =
            u64::try_from(window.as_nanos() / BUDGET_BUCKETS as u128).unwrap_or(u64::MAX);
        Self {
            config: RetryBudgetConfig { window, ..config },
            origin: now,
            bucket_nanos: bucket_nanos.max(1),
            buckets: std::array::from_fn(|_| Bucket {
                index: AtomicU64::new(u64::MAX),
                requests: AtomicU64::new(0),
                retries: AtomicU64::new(0),
            }),
        }
    }

    fn index_at(&self, now: Instant) -> u64 {
        let nanos = now.saturating_duration_since(self.origin).as_nanos();
        u64::try_from(nanos / u128::from(self.bucket_nanos)).unwrap_or(u64::MAX - 1)
    }

    fn bucket(&self, now: Instant) -> &Bucket {
        let index = self.index_at(now);
        let bucket = &self.buckets[(index % BUDGET_BUCKETS as u64) as usize];
        let seen = bucket.index.load(Ordering::Acquire);
        if seen != index
            && (seen == u64::MAX || seen < index)
            && bucket
                .index
                .compare_exchange(seen, index, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            bucket.requests.store(0, Ordering::Release);
            bucket.retries.store(0, Ordering::Release);
        }
        bucket
    }

    fn totals(&self, now: Instant) -> (u64, u64) {
        let index = self.index_at(now);
        let (mut requests, mut retries) = (0, 0);
        for bucket in &self.buckets {
            let seen = bucket.index.load(Ordering::Acquire);
            if seen != u64::MAX && seen <= index && index - seen < BUDGET_BUCKETS as u64 {
                requests += bucket.requests.load(Ordering::Acquire);
                retries += bucket.retries.load(Ordering::Acquire);
            }
        }
        (requests, retries)
    }

    /// Counts one original request (not a retry) at `now`.
    pub fn record_request(&self, now: Instant) {
        self.bucket(now).requests.fetch_add(1, Ordering::AcqRel);
    }

    /// Retries the budget would allow in the window at `now`.
    pub fn allowance(&self, now: Instant) -> u64 {
        let (requests, _) = self.totals(now);
        let ratio = if self.config.ratio.is_finite() {
            self.config.ratio.max(0.0)
        } else {
            0.0
        };
        let floor = f64::from(self.config.min_per_second) * self.config.window.as_secs_f64();
        (ratio * requests as f64 + floor) as u64
    }

    /// Takes one retry from the budget at `now` if there is room; returns
    /// whether the retry may go ahead.
    pub fn try_withdraw(&self, now: Instant) -> bool {
        let (_, retries) = self.totals(now);
        if retries >= self.allowance(now) {
            return false;
        }
        self.bucket(now).retries.fetch_add(1, Ordering::AcqRel);
        true
    }
}

/// One request's retries: the policy's limit, the shared budget and the
/// jitter, in the order every retry loop checks them. The caller decides
/// whether an attempt's failure is retryable at all, and sleeps the backoff
/// with its own timer (bounded by its own deadline).
///
/// ```
/// use std::time::{Duration, Instant};
/// use worker_lifecycle::{RequestRetries, RetryBudget, RetryBudgetConfig, RetryPolicy};
///
/// let policy = RetryPolicy { max_retries: 1, ..RetryPolicy::default() };
/// let budget = RetryBudget::new(RetryBudgetConfig::default(), Instant::now());
/// let mut retries = RequestRetries::start(&policy, &budget, 7, Instant::now());
/// let backoff = retries.next(Instant::now()).expect("one retry allowed");
/// assert!(backoff <= Duration::from_millis(50));
/// assert_eq!(retries.count(), 1);
/// assert_eq!(retries.next(Instant::now()), None, "max_retries reached");
/// ```
#[derive(Debug)]
pub struct RequestRetries<'a> {
    policy: &'a RetryPolicy,
    budget: &'a RetryBudget,
    jitter: crate::rng::SplitMix64,
    done: u32,
}

impl<'a> RequestRetries<'a> {
    /// The retries of a request arriving at `now`, which is counted in
    /// `budget`; `seed` seeds the jitter (a per-request counter will do).
    pub fn start(
        policy: &'a RetryPolicy,
        budget: &'a RetryBudget,
        seed: u64,
        now: Instant,
    ) -> Self {
        budget.record_request(now);
        Self {
            policy,
            budget,
            jitter: crate::rng::SplitMix64::new(seed),
            done: 0,
        }
    }

    /// Retries granted so far.
    pub fn count(&self) -> u32 {
        self.done
    }

    /// Grants one more retry when the policy's `max_retries` and then the
    /// shared budget (withdrawn here) allow it, and returns the backoff to
    /// wait before it; `None` when the request must give up.
    pub fn next(&mut self, now: Instant) -> Option<Duration> {
        let retry = self.done.saturating_add(1);
        if !self.policy.allows_retry(retry) || !self.budget.try_withdraw(now) {
            return None;
        }
        self.done = retry;
        Some(self.policy.backoff(retry, &mut self.jitter))
    }
}
