//! Latency histogram

use std::sync::atomic::{AtomicU64, Ordering};

/// Sub-buckets per power of two: 64, so a bucket is at most 1/64 (1.6 %)
/// of its values wide.
const SUB_BITS: u32 = 6;
const SUB: usize = 1 << SUB_BITS;
/// Values are microseconds, capped at 2^40 µs (about 12 days).
const MAX_EXP: u32 = 40;
pub(super) const BUCKETS: usize = (MAX_EXP - SUB_BITS) as usize * SUB + SUB;

/// Log-linear histogram of microseconds on atomic counters: recording is
/// one `fetch_add`, and a reader subtracts two snapshots to get any window.
pub(super) struct Histogram {
    counts: Box<[AtomicU64]>,
}

pub(super) fn bucket_of(micros: u64) -> usize {
    let v = micros.min((1 << MAX_EXP) - 1);
    if v < (2 * SUB) as u64 {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros();
    let shift = exp - SUB_BITS;
    (shift as usize + 1) * SUB + ((v >> shift) as usize - SUB)
}

/// The middle of bucket `index`, in microseconds.
pub(super) fn bucket_value(index: usize) -> u64 {
    if index < 2 * SUB {
        return index as u64;
    }
    let shift = (index / SUB - 1) as u32;
    let low = ((index % SUB + SUB) as u64) << shift;
    low + ((1u64 << shift) >> 1)
}

impl Histogram {
    pub(super) fn new() -> Self {
        Self {
            counts: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub(super) fn record(&self, micros: u64) {
        self.counts[bucket_of(micros)].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn snapshot(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

/// Counts of a window: `now - before`, bucket by bucket.
pub(super) fn window(now: &[u64], before: &[u64]) -> Vec<u64> {
    now.iter()
        .zip(before)
        .map(|(n, b)| n.saturating_sub(*b))
        .collect()
}

/// The `q` quantile (0..=1) of bucket counts, in microseconds (None when
/// empty): the value of the bucket holding the ceil(q * n)-th smallest.
pub(super) fn quantile(counts: &[u64], q: f64) -> Option<u64> {
    let n: u64 = counts.iter().sum();
    if n == 0 {
        return None;
    }
    let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
    let mut seen = 0;
    for (i, c) in counts.iter().enumerate() {
        seen += c;
        if seen >= rank {
            return Some(bucket_value(i));
        }
    }
    None
}
