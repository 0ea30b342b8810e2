//! Log lines a network peer can cause, at a bounded rate.
//!
//! A ZMQ port faces peers it does not authenticate: anyone who reaches the
//! discovery socket can send it malformed registrations, and a registration
//! can point the router at a publisher of its choosing that sends
//! undecodable batches. Each such message is counted in a metric; logging
//! each one too would let a peer write log lines (disk, CPU, the
//! operator's attention) as fast as it can send bytes. A [`LogThrottle`]
//! lets one line through per period and counts the rest, so the line that
//! does get through says how many it stands for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The period the sockets of this crate and of worker-discovery use for
/// the warnings their peers can trigger: one line per kind of event per
/// five seconds.
pub const DEFAULT_LOG_PERIOD: Duration = Duration::from_secs(5);

/// At most one log line per period for one kind of peer-caused event,
/// shareable between threads (`&self`, two atomics).
///
/// ```
/// use std::time::{Duration, Instant};
/// use kv_events::LogThrottle;
///
/// let throttle = LogThrottle::new(Duration::from_secs(5));
/// let start = Instant::now();
/// // The first event is logged, with nothing suppressed before it.
/// assert_eq!(throttle.admit_at(start), Some(0));
/// // Within the period the next ones are only counted...
/// assert_eq!(throttle.admit_at(start + Duration::from_secs(1)), None);
/// assert_eq!(throttle.admit_at(start + Duration::from_secs(2)), None);
/// // ...and the first one after it says how many were not logged.
/// assert_eq!(throttle.admit_at(start + Duration::from_secs(5)), Some(2));
/// ```
#[derive(Debug)]
pub struct LogThrottle {
    period_nanos: u64,
    origin: Instant,
    /// Nanoseconds after `origin` from which the next line may be logged.
    next_due: AtomicU64,
    /// Events not logged since the last line.
    suppressed: AtomicU64,
}

impl LogThrottle {
    /// A throttle letting one line through per `period` (at most about
    /// 584 years; longer is taken as that).
    pub fn new(period: Duration) -> Self {
        Self {
            period_nanos: u64::try_from(period.as_nanos()).unwrap_or(u64::MAX),
            origin: Instant::now(),
            next_due: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// [`admit_at`](Self::admit_at) now.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    /// Whether an event at `now` is to be logged: `Some(n)` when it is,
    /// `n` being the events not logged since the previous line (to put in
    /// the line); `None` when a line was let through within the period, in
    /// which case this event is counted for the next line. Of threads
    /// racing at the end of a period exactly one gets `Some`.
    pub fn admit_at(&self, now: Instant) -> Option<u64> {
        let elapsed = u64::try_from(now.saturating_duration_since(self.origin).as_nanos())
            .unwrap_or(u64::MAX);
        let due = self.next_due.load(Ordering::Relaxed);
        if elapsed >= due
            && self
                .next_due
                .compare_exchange(
                    due,
                    elapsed.saturating_add(self.period_nanos),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

impl Default for LogThrottle {
    /// One line per [`DEFAULT_LOG_PERIOD`].
    fn default() -> Self {
        Self::new(DEFAULT_LOG_PERIOD)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_period_and_every_event_accounted_for() {
        let throttle = LogThrottle::new(Duration::from_millis(100));
        let start = Instant::now();
        let mut logged = 0;
        let mut reported_suppressed = 0;
        // 1,000 events over 1 s, one per millisecond: ten periods.
        for ms in 0..1_000 {
            if let Some(suppressed) = throttle.admit_at(start + Duration::from_millis(ms)) {
                logged += 1;
                reported_suppressed += suppressed;
            }
        }
        assert_eq!(logged, 10);
        // What the lines report plus what is still pending is every event
        // that was not logged.
        let pending = throttle.suppressed.load(Ordering::Relaxed);
        assert_eq!(reported_suppressed + pending, 1_000 - logged);
    }

    #[test]
    fn a_clock_reading_from_before_the_throttle_is_not_a_panic() {
        let earlier = Instant::now();
        let throttle = LogThrottle::new(Duration::MAX);
        assert_eq!(throttle.admit_at(earlier), Some(0));
        assert_eq!(throttle.admit_at(Instant::now()), None);
    }

    #[test]
    fn racing_threads_let_exactly_one_line_through_per_period() {
        let throttle = std::sync::Arc::new(LogThrottle::new(Duration::from_secs(3600)));
        let at = Instant::now();
        let admitted: u64 = (0..4)
            .map(|_| {
                let throttle = std::sync::Arc::clone(&throttle);
                std::thread::spawn(move || {
                    (0..10_000)
                        .filter(|_| throttle.admit_at(at).is_some())
                        .count() as u64
                })
            })
            .map(|thread| thread.join().expect("the thread ran"))
            .sum();
        assert_eq!(admitted, 1);
        assert_eq!(throttle.suppressed.load(Ordering::Relaxed), 40_000 - 1);
    }
}
