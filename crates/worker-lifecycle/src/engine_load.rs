//! What the engine behind a worker last said about its load, and the
//! estimate of the engine's load that the policies read.
//!
//! A router replica counts its own in-flight requests exactly (the
//! [`LoadGuard`](crate::LoadGuard)s), but behind R replicas that is about
//! 1/R of what the engine runs. The engine knows the whole of it (vLLM's
//! `vllm:num_requests_running` plus `vllm:num_requests_waiting`), but only
//! as of the last time somebody asked. The estimate joins the two:
//!
//! ```text
//! estimate = own in-flight now + (engine's report − own in-flight when polled)
//! ```
//!
//! The bracket is the other replicas' load as of the poll (never below
//! zero). The own part moves with every reservation and release, so a
//! burst this replica sends is visible to it at once, and the others'
//! part changes with the next report. Without a report the estimate is the
//! own count, exactly what it was before engines reported anything.
//!
//! Guards never read the estimate: it changes what policies compare, not
//! how load is counted or released.

use crate::sync::{AtomicUsize, Ordering};

/// No report, or the last one was withdrawn.
const NONE: usize = usize::MAX;

/// Reports above this are clamped: no engine runs four billion requests,
/// and the clamp keeps `own + others` far from overflow and from the
/// `NONE` marker.
const MAX_REPORTED: usize = u32::MAX as usize;

/// The engine-reported part of a worker's load. Two independent atomics:
/// a reader may see a new `others` with an old `reported`, which only the
/// admin view shows and which the next read corrects.
#[derive(Debug)]
pub(crate) struct EngineLoad {
    /// The other replicas' in-flight requests as of the last report.
    others: AtomicUsize,
    /// The engine's in-flight requests in the last report.
    reported: AtomicUsize,
    /// The engine's KV-cache usage in the last report, in millionths.
    cache_usage: AtomicUsize,
    /// The engine's waiting (queued, not yet scheduled) requests in the
    /// last report.
    waiting: AtomicUsize,
}

impl EngineLoad {
    pub(crate) fn new() -> Self {
        EngineLoad {
            others: AtomicUsize::new(NONE),
            reported: AtomicUsize::new(NONE),
            cache_usage: AtomicUsize::new(NONE),
            waiting: AtomicUsize::new(NONE),
        }
    }

    /// A report: the engine had `engine_in_flight` requests (running plus
    /// waiting) when it answered a poll sent while this replica had
    /// `own_at_poll` in flight.
    pub(crate) fn record(&self, engine_in_flight: usize, own_at_poll: usize) {
        let reported = engine_in_flight.min(MAX_REPORTED);
        self.reported.store(reported, Ordering::Relaxed);
        self.others
            .store(reported.saturating_sub(own_at_poll), Ordering::Relaxed);
    }

    /// Back to own counts only (the engine stopped answering, or answered
    /// garbage).
    pub(crate) fn clear(&self) {
        self.others.store(NONE, Ordering::Relaxed);
        self.reported.store(NONE, Ordering::Relaxed);
        self.cache_usage.store(NONE, Ordering::Relaxed);
        self.waiting.store(NONE, Ordering::Relaxed);
    }

    /// A report of the engine's waiting requests (clamped as the load
    /// is); `None` withdraws it.
    pub(crate) fn record_waiting(&self, waiting: Option<usize>) {
        let stored = waiting.map_or(NONE, |w| w.min(MAX_REPORTED));
        self.waiting.store(stored, Ordering::Relaxed);
    }

    /// The last waiting report, if one stands.
    pub(crate) fn waiting(&self) -> Option<usize> {
        match self.waiting.load(Ordering::Relaxed) {
            NONE => None,
            waiting => Some(waiting),
        }
    }

    /// A report of the engine's KV-cache usage, a fraction (clamped to
    /// `[0, 1]`; not a number clears it).
    pub(crate) fn record_cache_usage(&self, usage: f64) {
        let stored = if usage.is_nan() {
            NONE
        } else {
            (usage.clamp(0.0, 1.0) * 1e6).round() as usize
        };
        self.cache_usage.store(stored, Ordering::Relaxed);
    }

    /// The last KV-cache usage report, if one stands.
    pub(crate) fn cache_usage(&self) -> Option<f64> {
        match self.cache_usage.load(Ordering::Relaxed) {
            NONE => None,
            millionths => Some(millionths as f64 / 1e6),
        }
    }

    /// The other replicas' part of the estimate: 0 without a report.
    pub(crate) fn others(&self) -> usize {
        match self.others.load(Ordering::Relaxed) {
            NONE => 0,
            others => others,
        }
    }

    /// The last report, if one stands.
    pub(crate) fn reported(&self) -> Option<usize> {
        match self.reported.load(Ordering::Relaxed) {
            NONE => None,
            reported => Some(reported),
        }
    }
}
