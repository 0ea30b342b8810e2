//! What one policy run measured.

use std::time::Duration;

/// The per-policy figures of one run. Latencies are model time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyMetrics {
    /// Requests in the trace.
    pub requests: usize,
    /// Requests that finished.
    pub completed: usize,
    /// Requests no worker took (no candidate, refused reservation or a
    /// request the engine model rejects, such as one longer than its
    /// context).
    pub rejected: usize,
    /// Completed requests per second, from the first arrival to the last
    /// completion.
    pub throughput_rps: f64,
    /// Output tokens per second over the same span.
    pub output_tps: f64,
    /// Time to first token, median (ms).
    pub ttft_p50_ms: f64,
    /// Time to first token, 90th percentile (ms).
    pub ttft_p90_ms: f64,
    /// Time to first token, 99th percentile (ms).
    pub ttft_p99_ms: f64,
    /// End-to-end latency, median (ms).
    pub e2e_p50_ms: f64,
    /// End-to-end latency, 99th percentile (ms).
    pub e2e_p99_ms: f64,
    /// Prompt tokens served from the prefix cache / prompt tokens, over
    /// the workers the policy places on (the prefill pool under P/D).
    pub hit_rate: f64,
    /// Busy time (time with at least one request in flight) of the busiest
    /// worker over the mean busy time of the policy's pool; 1.0 is perfect
    /// balance.
    pub imbalance: f64,
    /// Share of the cached prefix tokens available at decision time that
    /// the policy gave up: `1 − Σ chosen / Σ best`, where per request
    /// `chosen` is the prefix the chosen worker's cache held and `best`
    /// the largest any available worker held. 0 means it always picked a
    /// best-cached worker.
    pub routing_loss: f64,
    /// Mean cached prefix tokens given up per request (`best − chosen`).
    pub lost_tokens_per_request: f64,
    /// From the first arrival to the last completion (s).
    pub makespan_s: f64,
}

/// Per-worker in-flight load sampled at fixed model-time intervals.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadTimeline {
    /// Worker names, one per series.
    pub workers: Vec<String>,
    /// Sample times (s).
    pub times: Vec<f64>,
    /// `loads[w][i]`: in-flight load of worker `w` at `times[i]`.
    pub loads: Vec<Vec<usize>>,
}

/// The `q`-quantile (0..=1) of sorted `values` by the nearest-rank method;
/// 0 for no values.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One finished request, as the metrics need it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Completion {
    pub(crate) ttft: Duration,
    pub(crate) e2e: Duration,
    pub(crate) finished_at: Duration,
    pub(crate) output_tokens: u32,
}

/// Running sums of what the run observed.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub(crate) completions: Vec<Completion>,
    pub(crate) rejected: usize,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
    pub(crate) best_cached: u64,
    pub(crate) chosen_cached: u64,
    pub(crate) decisions: u64,
}

impl Tally {
    pub(crate) fn metrics(
        &self,
        requests: usize,
        first_arrival: Duration,
        busy: &[Duration],
    ) -> PolicyMetrics {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut ttft: Vec<f64> = self.completions.iter().map(|c| ms(c.ttft)).collect();
        let mut e2e: Vec<f64> = self.completions.iter().map(|c| ms(c.e2e)).collect();
        ttft.sort_by(f64::total_cmp);
        e2e.sort_by(f64::total_cmp);
        let last = self
            .completions
            .iter()
            .map(|c| c.finished_at)
            .max()
            .unwrap_or(first_arrival);
        let makespan = last.saturating_sub(first_arrival).as_secs_f64();
        let per_second = |n: f64| if makespan > 0.0 { n / makespan } else { 0.0 };
        let output: u64 = self
            .completions
            .iter()
            .map(|c| u64::from(c.output_tokens))
            .sum();
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let busy_s: Vec<f64> = busy.iter().map(Duration::as_secs_f64).collect();
        let mean_busy = busy_s.iter().sum::<f64>() / busy_s.len().max(1) as f64;
        let max_busy = busy_s.iter().copied().fold(0.0, f64::max);
        PolicyMetrics {
            requests,
            completed: self.completions.len(),
            rejected: self.rejected,
            throughput_rps: per_second(self.completions.len() as f64),
            output_tps: per_second(output as f64),
            ttft_p50_ms: percentile(&ttft, 0.50),
            ttft_p90_ms: percentile(&ttft, 0.90),
            ttft_p99_ms: percentile(&ttft, 0.99),
            e2e_p50_ms: percentile(&e2e, 0.50),
            e2e_p99_ms: percentile(&e2e, 0.99),
            hit_rate: ratio(self.cached_tokens, self.prompt_tokens),
            imbalance: if mean_busy > 0.0 {
                max_busy / mean_busy
            } else {
                1.0
            },
            routing_loss: if self.best_cached == 0 {
                0.0
            } else {
                1.0 - ratio(self.chosen_cached, self.best_cached)
            },
            lost_tokens_per_request: if self.decisions == 0 {
                0.0
            } else {
                (self.best_cached - self.chosen_cached) as f64 / self.decisions as f64
            },
            makespan_s: makespan,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(percentile(&[7.0], 0.9), 7.0);
    }
}
