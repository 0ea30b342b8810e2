//! The router replicas' periodic engine load polls, on the virtual clock.

use std::collections::BTreeMap;
use std::time::Duration;

/// One engine's answer to a load poll: (its in-flight requests, the
/// polling replica's own in-flight requests on it when it sent the poll,
/// its KV-cache usage, how many of its in-flight requests wait to be
/// scheduled).
pub(crate) type PollAnswer = (usize, usize, f64, usize);

/// The replicas' periodic load polls and the answers in transit.
pub(crate) struct Polls {
    pub(crate) interval: Duration,
    pub(crate) delay: Duration,
    /// Per replica: when it sends its next poll.
    pub(crate) next: Vec<Duration>,
    /// Answers in transit, by (applied at, order): the replica and, per
    /// engine, (engine in-flight, replica's own in-flight at the poll).
    pub(crate) answers: BTreeMap<(Duration, u64), (usize, Vec<PollAnswer>)>,
    pub(crate) sequence: u64,
}

impl Polls {
    pub(crate) fn new(replicas: usize, interval: Duration, delay: Duration) -> Self {
        let interval = interval.max(Duration::from_micros(1));
        Polls {
            interval,
            delay,
            next: (0..replicas)
                .map(|r| interval.mul_f64(r as f64 / replicas as f64))
                .collect(),
            answers: BTreeMap::new(),
            sequence: 0,
        }
    }

    /// When the next poll or answer is due.
    pub(crate) fn next_due(&self) -> Option<Duration> {
        let poll = self.next.iter().min().copied();
        let answer = self.answers.first_key_value().map(|(k, _)| k.0);
        match (poll, answer) {
            (Some(p), Some(a)) => Some(p.min(a)),
            (p, a) => p.or(a),
        }
    }
}
