//! Admission control: a concurrency limit with a bounded, timed queue, and an
//! optional token-bucket rate limit.
//!
//! A request is admitted by taking a permit. The permit travels with the
//! request's response body (inside the same [`GuardedBody`](crate::GuardedBody)
//! as the load guard), so it bounds in-flight work up to the last streamed
//! byte, not just the time until response headers.
//!
//! When every permit is taken the request may wait in a queue of bounded
//! length. A full queue (or a queue of length 0) answers 429 at once with
//! `Retry-After`; a request that waited longer than the queue timeout answers
//! 408 and is never served later (its wait is cancelled, not merely ignored).

use crate::error::ApiError;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Settings of the [`ConcurrencyLimiter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConcurrencyConfig {
    /// Requests in flight at once (vllm-router's `--max-concurrent-requests`, 32768).
    pub max_concurrent: usize,
    /// Requests allowed to wait for a permit (`--queue-size`, 100); 0 refuses at once.
    pub queue_size: usize,
    /// How long a queued request waits before it is answered 408 (`--queue-timeout-secs`, 60 s).
    pub queue_timeout: Duration,
}

impl Default for ConcurrencyConfig {
    fn default() -> Self {
        Self {
            max_concurrent: 32_768,
            queue_size: 100,
            queue_timeout: Duration::from_secs(60),
        }
    }
}

/// Bounds in-flight requests, with a bounded queue in front.
#[derive(Debug)]
pub struct ConcurrencyLimiter {
    permits: Arc<Semaphore>,
    waiting: AtomicUsize,
    config: ConcurrencyConfig,
}

/// Held while a request is in flight; dropping it frees the slot.
#[derive(Debug)]
#[must_use = "the slot is freed as soon as the permit is dropped"]
pub struct AdmissionPermit {
    _permit: OwnedSemaphorePermit,
}

/// Decrements the waiting count however the wait ends (admitted, timed out,
/// or the request future dropped because the client left).
struct WaitingSlot<'a>(&'a AtomicUsize);

impl Drop for WaitingSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ConcurrencyLimiter {
    /// A limiter with `config`.
    pub fn new(config: ConcurrencyConfig) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(
                config.max_concurrent.min(Semaphore::MAX_PERMITS),
            )),
            waiting: AtomicUsize::new(0),
            config,
        }
    }

    /// Admits a request: at once when a permit is free, after waiting in the
    /// queue otherwise. Cancel-safe: dropping the future leaves the queue.
    pub async fn admit(&self) -> Result<AdmissionPermit, ApiError> {
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return Ok(AdmissionPermit { _permit: permit });
        }
        let queued = self.waiting.fetch_add(1, Ordering::AcqRel);
        let _slot = WaitingSlot(&self.waiting);
        if queued >= self.config.queue_size {
            return Err(ApiError::TooManyRequests {
                retry_after: Duration::from_secs(1),
            });
        }
        match tokio::time::timeout(
            self.config.queue_timeout,
            self.permits.clone().acquire_owned(),
        )
        .await
        {
            Ok(Ok(permit)) => Ok(AdmissionPermit { _permit: permit }),
            // The semaphore is never closed; treat it like a full queue if it were.
            Ok(Err(_closed)) => Err(ApiError::ShuttingDown),
            Err(_elapsed) => Err(ApiError::QueueTimeout(self.config.queue_timeout)),
        }
    }

    /// Requests currently in flight (permits taken).
    pub fn in_flight(&self) -> usize {
        self.config.max_concurrent.min(Semaphore::MAX_PERMITS) - self.permits.available_permits()
    }

    /// Requests currently waiting in the queue.
    pub fn queued(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }
}

/// A token bucket: `rate` tokens a second, bursts up to `burst`.
#[derive(Debug)]
pub struct RateLimiter {
    rate: f64,
    burst: f64,
    state: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    refilled_at: Instant,
}

impl RateLimiter {
    /// `rate` requests a second on average, at most `burst` at once.
    /// A non-positive or non-finite rate is refused.
    pub fn new(rate: f64, burst: f64) -> Option<Self> {
        if !(rate.is_finite() && rate > 0.0 && burst.is_finite() && burst >= 1.0) {
            return None;
        }
        Some(Self {
            rate,
            burst,
            state: Mutex::new(Bucket {
                tokens: burst,
                refilled_at: Instant::now(),
            }),
        })
    }

    /// Takes one token, or says how long until one is available.
    pub fn try_acquire(&self) -> Result<(), ApiError> {
        let now = Instant::now();
        // The critical section is a few float operations; a poisoned lock
        // only means another thread panicked mid-update, so keep its state.
        let mut bucket = self
            .state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let elapsed = now
            .saturating_duration_since(bucket.refilled_at)
            .as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * self.rate).min(self.burst);
        bucket.refilled_at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            let wait = (1.0 - bucket.tokens) / self.rate;
            Err(ApiError::TooManyRequests {
                retry_after: Duration::from_secs_f64(wait.max(0.001)),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    fn limiter(max: usize, queue: usize, timeout_ms: u64) -> Arc<ConcurrencyLimiter> {
        Arc::new(ConcurrencyLimiter::new(ConcurrencyConfig {
            max_concurrent: max,
            queue_size: queue,
            queue_timeout: Duration::from_millis(timeout_ms),
        }))
    }

    #[tokio::test(start_paused = true)]
    async fn queue_of_zero_answers_429_at_once() {
        let limiter = limiter(1, 0, 1_000);
        let _held = limiter.admit().await.unwrap();
        let started = Instant::now();
        let refused = limiter.admit().await.unwrap_err();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(limiter.queued(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_queued_request_is_admitted_when_a_permit_frees() {
        let limiter = limiter(1, 1, 60_000);
        let held = limiter.admit().await.unwrap();
        let waiter = tokio::spawn({
            let limiter = limiter.clone();
            async move { limiter.admit().await.map(|_permit| Instant::now()) }
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(limiter.queued(), 1);
        let released_at = Instant::now();
        drop(held);
        let admitted_at = waiter.await.unwrap().unwrap();
        assert_eq!(admitted_at, released_at);
        assert_eq!(limiter.queued(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_and_a_timed_out_wait_answers_408_and_leaves() {
        let limiter = limiter(1, 1, 500);
        let held = limiter.admit().await.unwrap();
        let queued = tokio::spawn({
            let limiter = limiter.clone();
            async move { limiter.admit().await.map(drop) }
        });
        tokio::task::yield_now().await;
        assert_eq!(limiter.queued(), 1);
        let refused = limiter.admit().await.unwrap_err();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);

        let timed_out = queued.await.unwrap().unwrap_err();
        assert_eq!(timed_out.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(limiter.queued(), 0);
        // The timed-out request is never served later: the freed permit goes
        // to the next admission, and in-flight stays at the one held permit.
        assert_eq!(limiter.in_flight(), 1);
        drop(held);
        assert_eq!(limiter.in_flight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_leaves_the_queue_frees_its_place() {
        let limiter = limiter(1, 1, 60_000);
        let _held = limiter.admit().await.unwrap();
        let waiter = tokio::spawn({
            let limiter = limiter.clone();
            async move { limiter.admit().await.map(drop) }
        });
        tokio::task::yield_now().await;
        assert_eq!(limiter.queued(), 1);
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(limiter.queued(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_token_bucket_refills_at_its_rate() {
        let bucket = RateLimiter::new(10.0, 2.0).unwrap();
        assert!(bucket.try_acquire().is_ok());
        assert!(bucket.try_acquire().is_ok());
        let refused = bucket.try_acquire().unwrap_err();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(bucket.try_acquire().is_ok());
        assert!(RateLimiter::new(0.0, 1.0).is_none());
        assert!(RateLimiter::new(f64::NAN, 1.0).is_none());
    }
}
