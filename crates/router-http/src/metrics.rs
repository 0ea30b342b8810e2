//! Prometheus metrics: lock-free primitives and the text exposition format.
//!
//! The request path only increments atomics: counters and histogram buckets
//! live in fixed arrays indexed by small enums, so recording a request
//! neither hashes label sets nor takes a lock. State that already lives
//! elsewhere (each worker's load, processed count, health and breaker state;
//! the policies' decision counts; the cache-aware tree sizes) is not copied
//! into metrics at all: it is read at scrape time and rendered then, so the
//! two can never disagree.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A monotonically increasing counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The current value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A histogram with fixed upper bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Box<[AtomicU64]>,
    // The sum is kept in millionths so it can be an atomic integer.
    sum_micros: AtomicU64,
    count: AtomicU64,
}

/// Latency bounds in seconds, from 1 ms to 10 min.
pub const LATENCY_BOUNDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0,
];

/// Ratio bounds for values in `[0, 1]` (cache-aware match rates).
pub const RATIO_BOUNDS: &[f64] = &[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0];

impl Histogram {
    /// A histogram with the given upper bounds (ascending; `+Inf` is implied).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, value: f64) {
        let index = self.bounds.partition_point(|&bound| bound < value);
        self.buckets[index].fetch_add(1, Ordering::Relaxed);
        // Negative and non-finite values count, but add nothing to the sum.
        let micros = if value.is_finite() && value > 0.0 {
            (value * 1e6) as u64
        } else {
            0
        };
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a duration in seconds.
    pub fn observe_duration(&self, duration: Duration) {
        self.observe(duration.as_secs_f64());
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Writes the histogram's series (`_bucket`, `_sum`, `_count`) with the
    /// given extra labels (`key="value",...` without braces, may be empty).
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let separator = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (index, bound) in self.bounds.iter().enumerate() {
            cumulative += self.buckets[index].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{separator}le=\"{bound}\"}} {cumulative}"
            );
        }
        cumulative += self.buckets[self.bounds.len()].load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{separator}le=\"+Inf\"}} {cumulative}"
        );
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let braces = |labels: &str| {
            if labels.is_empty() {
                String::new()
            } else {
                format!("{{{labels}}}")
            }
        };
        let _ = writeln!(out, "{name}_sum{} {sum}", braces(labels));
        let _ = writeln!(out, "{name}_count{} {cumulative}", braces(labels));
    }
}

/// Writes the `# HELP` and `# TYPE` lines of a metric family.
pub fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Writes one sample line: `name{labels} value`.
pub fn sample(out: &mut String, name: &str, labels: &str, value: impl std::fmt::Display) {
    if labels.is_empty() {
        let _ = writeln!(out, "{name} {value}");
    } else {
        let _ = writeln!(out, "{name}{{{labels}}} {value}");
    }
}

/// Escapes a label value for the text format (backslash, quote, newline).
pub fn escape_label(value: &str) -> std::borrow::Cow<'_, str> {
    if !value.contains(['\\', '"', '\n']) {
        return std::borrow::Cow::Borrowed(value);
    }
    let mut escaped = String::with_capacity(value.len() + 8);
    for c in value.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    std::borrow::Cow::Owned(escaped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_renders_cumulative_buckets_sum_and_count() {
        let histogram = Histogram::new(&[0.1, 1.0]);
        histogram.observe(0.05);
        histogram.observe(0.5);
        histogram.observe(0.5);
        histogram.observe(7.0);
        let mut out = String::new();
        histogram.render(&mut out, "x_seconds", "route=\"chat\"");
        assert_eq!(
            out,
            "x_seconds_bucket{route=\"chat\",le=\"0.1\"} 1\n\
             x_seconds_bucket{route=\"chat\",le=\"1\"} 3\n\
             x_seconds_bucket{route=\"chat\",le=\"+Inf\"} 4\n\
             x_seconds_sum{route=\"chat\"} 8.05\n\
             x_seconds_count{route=\"chat\"} 4\n"
        );
    }

    #[test]
    fn a_value_on_a_bound_falls_in_that_bucket() {
        let histogram = Histogram::new(&[1.0, 2.0]);
        histogram.observe(1.0);
        let mut out = String::new();
        histogram.render(&mut out, "h", "");
        assert!(out.starts_with("h_bucket{le=\"1\"} 1\n"), "{out}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label("plain"), "plain");
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
