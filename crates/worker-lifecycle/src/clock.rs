//! Time as an input.
//!
//! Every decision in this crate that depends on time (breaker timeouts,
//! registration expiry, retry budgets) takes an [`Instant`] argument. Where a
//! convenience method needs "now" by itself (for example
//! [`Worker::is_available`](crate::Worker::is_available)), it asks the
//! [`Clock`] the worker was built with, so tests can use paused tokio time
//! ([`TokioClock`]) or a hand-driven [`ManualClock`].

use std::fmt;
use std::time::{Duration, Instant};

use crate::sync::Mutex;

/// A source of the current time.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// The operating system's monotonic clock ([`Instant::now`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// tokio's clock: follows paused and advanced time in tests
/// (`tokio::time::pause`), and the system clock otherwise.
#[cfg(not(loom))]
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioClock;

#[cfg(not(loom))]
impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }
}

/// A clock that moves only when told to; for deterministic tests and
/// simulations.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<Instant>,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: Instant) -> Self {
        Self {
            now: Mutex::new(start),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let mut now = self.now.lock();
        *now += by;
    }

    /// Sets the clock to `to` (which may be earlier: callers that test
    /// time going backwards can).
    pub fn set(&self, to: Instant) {
        *self.now.lock() = to;
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new(Instant::now())
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        *self.now.lock()
    }
}
