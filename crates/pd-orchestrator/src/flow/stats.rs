//! The flow's counters.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one flow, for metrics.
#[derive(Debug, Default)]
pub struct FlowStats {
    pub(super) requests: AtomicU64,
    pub(super) prefill_retries: AtomicU64,
    pub(super) missing_prefill_kv_params: AtomicU64,
    pub(super) merged_responses: AtomicU64,
    pub(super) prefill_failures_during_decode: AtomicU64,
}

/// A copy of [`FlowStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlowStatsSnapshot {
    /// Requests started.
    pub requests: u64,
    /// Prefill attempts after the first (sequential mode).
    pub prefill_retries: u64,
    /// 2xx prefill responses without `kv_transfer_params`: decode
    /// recomputed the prompt.
    pub missing_prefill_kv_params: u64,
    /// Non-streaming responses whose usage or logprobs were merged.
    pub merged_responses: u64,
    /// Concurrent prefill legs that failed while decode was already
    /// streaming (recorded, stream left to finish).
    pub prefill_failures_during_decode: u64,
}

impl FlowStats {
    /// Current values.
    pub fn snapshot(&self) -> FlowStatsSnapshot {
        FlowStatsSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            prefill_retries: self.prefill_retries.load(Ordering::Relaxed),
            missing_prefill_kv_params: self.missing_prefill_kv_params.load(Ordering::Relaxed),
            merged_responses: self.merged_responses.load(Ordering::Relaxed),
            prefill_failures_during_decode: self
                .prefill_failures_during_decode
                .load(Ordering::Relaxed),
        }
    }
}
