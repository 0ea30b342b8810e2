//! Prometheus metrics: lock-free primitives and the text exposition format.
//!
//! The request path only increments atomics: counters and histogram buckets
//! live in fixed arrays indexed by small enums, so recording a request
//! neither hashes label sets nor takes a lock. State that already lives
//! elsewhere (each worker's load, processed count, health and breaker state;
//! the policies' decision counts; the cache-aware tree sizes) is not copied
//! into metrics at all: it is read at scrape time and rendered then, so the
//! two can never disagree.
//!
//! Every series is written through [`prom_text`], the workspace's one
//! writer of the text format: it escapes label values and help, checks
//! names and keeps histograms whole, so nothing here escapes by hand.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prom_text::{Histograms, Label};

/// The writer a [`MetricsSource`] renders into (re-exported from
/// [`prom_text`] so that hosts need not name that crate).
pub use prom_text::Exposition;
/// The type of a family a [`MetricsSource`] opens (re-exported from
/// [`prom_text`] likewise).
pub use prom_text::MetricType;

/// Series a host adds to the router's `/metrics`: discovery, a cache, a
/// subsystem the router does not own. Rendered at scrape time, after the
/// router's own families, from state the source already keeps (nothing is
/// copied into the router).
///
/// A closure `Fn(&mut Exposition<'_>)` is a source:
///
/// ```
/// use router_http::RouterConfig;
/// use router_http::metrics::MetricsSource;
/// use prom_text::{Exposition, MetricType};
/// use std::sync::Arc;
///
/// let source = |exposition: &mut Exposition<'_>| {
///     exposition
///         .family("my_gateway_sessions", MetricType::Gauge, "Open sessions.")
///         .sample(&[], 3u64);
/// };
/// let config = RouterConfig {
///     metrics_sources: vec![Arc::new(source) as Arc<dyn MetricsSource>],
///     ..RouterConfig::default()
/// };
/// # let _ = config;
/// ```
pub trait MetricsSource: Send + Sync + 'static {
    /// Writes this source's families. Family names must not repeat the
    /// router's own (`router_*` families other than the source's own).
    fn render(&self, exposition: &mut Exposition<'_>);
}

impl<F> MetricsSource for F
where
    F: Fn(&mut Exposition<'_>) + Send + Sync + 'static,
{
    fn render(&self, exposition: &mut Exposition<'_>) {
        self(exposition)
    }
}

impl std::fmt::Debug for dyn MetricsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MetricsSource")
    }
}

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

    /// Writes this histogram's series (`_bucket`, `_sum`, `_count`) with
    /// `labels` into its family.
    pub fn render(&self, family: &mut Histograms<'_>, labels: &[Label<'_>]) {
        let bounds = self.bounds.iter().copied().chain([f64::INFINITY]);
        let counts = self.buckets.iter().map(|b| b.load(Ordering::Relaxed));
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        family.histogram(labels, bounds.zip(counts), sum);
    }
}

/// The router's own counters and histograms, recorded on the request path.
#[derive(Debug)]
pub struct RouterMetrics {
    /// Responses by route and status class: `[route][class]`, class 1xx..5xx.
    responses: [[Counter; 5]; crate::Route::ALL.len()],
    /// Request durations to response headers, by route.
    header_latency: [Histogram; crate::Route::ALL.len()],
    /// Errors the router answered itself, by code.
    errors: [Counter; ERROR_CODES.len()],
    /// Upstream failures before a response, by kind.
    upstream_failures: [Counter; 3],
    /// Retried attempts.
    pub retries: Counter,
    /// Response bodies that reached their end.
    pub bodies_completed: Counter,
    /// Response bodies that failed (upstream error, idle or request timeout).
    pub bodies_failed: Counter,
    /// Response bodies dropped before their end (client went away).
    pub bodies_dropped: Counter,
    /// Prefix match rate (matched / input) of cache-aware decisions.
    pub match_rate: Histogram,
}

const ERROR_CODES: [&str; 21] = [
    "invalid_json",
    "invalid_request",
    "model_not_found",
    "payload_too_large",
    "too_many_requests",
    "queue_timeout",
    "invalid_api_key",
    "no_available_worker",
    "upstream_error",
    "upstream_timeout",
    "worker_not_found",
    "shutting_down",
    "method_not_allowed",
    "worker_exists",
    "worker_not_ready",
    "not_found",
    "request_timeout",
    "request_body_timeout",
    "worker_address_not_allowed",
    "internal_error",
    "other",
];

const UPSTREAM_FAILURES: [&str; 3] = ["connect", "timeout", "transport"];

impl Default for RouterMetrics {
    fn default() -> Self {
        Self {
            responses: std::array::from_fn(|_| std::array::from_fn(|_| Counter::default())),
            header_latency: std::array::from_fn(|_| Histogram::new(LATENCY_BOUNDS)),
            errors: std::array::from_fn(|_| Counter::default()),
            upstream_failures: std::array::from_fn(|_| Counter::default()),
            retries: Counter::default(),
            bodies_completed: Counter::default(),
            bodies_failed: Counter::default(),
            bodies_dropped: Counter::default(),
            match_rate: Histogram::new(RATIO_BOUNDS),
        }
    }
}

impl RouterMetrics {
    /// Records a response's status and its time to headers.
    pub fn record_response(
        &self,
        route: crate::Route,
        status: http::StatusCode,
        elapsed: Duration,
    ) {
        let route = route.index();
        let class = (status.as_u16() / 100).clamp(1, 5) as usize - 1;
        self.responses[route][class].inc();
        self.header_latency[route].observe_duration(elapsed);
    }

    /// Records an error the router answered itself.
    pub fn record_error(&self, error: &crate::ApiError) {
        let code = error.code();
        let index = ERROR_CODES
            .iter()
            .position(|c| *c == code)
            .unwrap_or(ERROR_CODES.len() - 1);
        self.errors[index].inc();
    }

    /// Records an upstream failure before any response.
    pub fn record_upstream_failure(&self, error: &crate::UpstreamError) {
        let index = match error {
            crate::UpstreamError::Connect(_) => 0,
            crate::UpstreamError::HeaderTimeout(_) | crate::UpstreamError::Deadline => 1,
            _ => 2,
        };
        self.upstream_failures[index].inc();
    }

    /// Responses recorded for `route` with a status in `class` (1 to 5).
    pub fn responses(&self, route: crate::Route, class: u16) -> u64 {
        let class = class.clamp(1, 5) as usize - 1;
        self.responses[route.index()][class].get()
    }

    /// Writes every series in the text format.
    pub fn render(&self, exposition: &mut Exposition<'_>) {
        let routes = || crate::Route::ALL.iter().map(|r| r.label());
        let mut family = exposition.family(
            "router_requests_total",
            MetricType::Counter,
            "Responses by route and status class.",
        );
        for (route, classes) in routes().zip(&self.responses) {
            for (class, counter) in (1u8..).zip(classes) {
                let value = counter.get();
                if value > 0 {
                    let status = format_args!("{class}xx");
                    family.sample(&[("route", &route), ("status", &status)], value);
                }
            }
        }
        let mut family = exposition.histograms(
            "router_request_header_seconds",
            "Time from request arrival to response headers, by route.",
        );
        for (route, histogram) in routes().zip(&self.header_latency) {
            if histogram.count() > 0 {
                histogram.render(&mut family, &[("route", &route)]);
            }
        }
        let mut family = exposition.family(
            "router_errors_total",
            MetricType::Counter,
            "Errors answered by the router, by code.",
        );
        for (code, counter) in ERROR_CODES.iter().zip(&self.errors) {
            family.sample(&[("code", code)], counter.get());
        }
        let mut family = exposition.family(
            "router_upstream_failures_total",
            MetricType::Counter,
            "Attempts that failed before a worker response, by kind.",
        );
        for (kind, counter) in UPSTREAM_FAILURES.iter().zip(&self.upstream_failures) {
            family.sample(&[("kind", kind)], counter.get());
        }
        exposition
            .family(
                "router_retries_total",
                MetricType::Counter,
                "Retried attempts.",
            )
            .sample(&[], self.retries.get());
        let mut family = exposition.family(
            "router_response_bodies_total",
            MetricType::Counter,
            "Response bodies by how they ended.",
        );
        for (end, counter) in [
            ("complete", &self.bodies_completed),
            ("failed", &self.bodies_failed),
            ("client_dropped", &self.bodies_dropped),
        ] {
            family.sample(&[("end", &end)], counter.get());
        }
        let mut family = exposition.histograms(
            "router_cache_match_rate",
            "Prefix match rate (matched / input) of cache-aware decisions.",
        );
        self.match_rate.render(&mut family, &[]);
    }
}

/// One unlabelled counter family per `(name, help, value)`.
pub(crate) fn render_counters(exposition: &mut Exposition<'_>, series: &[(&str, &str, u64)]) {
    for &(name, help, value) in series {
        exposition
            .family(name, MetricType::Counter, help)
            .sample(&[], value);
    }
}

/// Writes the P/D series: leg outcomes per phase, refusals per role, the
/// flow's counters and both roles' policy decisions.
pub(crate) fn render_pd(
    pools: &pd_orchestrator::pools::PdPools,
    flow: pd_orchestrator::FlowStatsSnapshot,
    exposition: &mut Exposition<'_>,
) {
    let mut family = exposition.family(
        "router_pd_leg_outcomes_total",
        MetricType::Counter,
        "Prefill and decode legs by how they ended.",
    );
    for phase in [
        pd_orchestrator::Phase::Prefill,
        pd_orchestrator::Phase::Decode,
    ] {
        for outcome in pd_orchestrator::pools::LEG_OUTCOMES {
            let value = pools.metrics().outcomes(phase, outcome);
            family.sample(&[("phase", &phase), ("outcome", &outcome)], value);
        }
    }
    let roles = [pools.prefill(), pools.decode()];
    let mut family = exposition.family(
        "router_pd_unavailable_total",
        MetricType::Counter,
        "Requests refused with 503 because a role had no available worker.",
    );
    for role in roles {
        family.sample(&[("role", &role.role())], role.unavailable_count());
    }
    let flow_series: [(&str, &str, u64); 5] = [
        (
            "router_pd_requests_total",
            "Two-phase requests started.",
            flow.requests,
        ),
        (
            "router_pd_prefill_retries_total",
            "Prefill attempts after the first, on a fresh prefill worker.",
            flow.prefill_retries,
        ),
        (
            "router_pd_missing_prefill_kv_params_total",
            "2xx prefill responses without kv_transfer_params (decode recomputed the prompt).",
            flow.missing_prefill_kv_params,
        ),
        (
            "router_pd_merged_responses_total",
            "Non-streaming responses whose usage or prompt logprobs were merged.",
            flow.merged_responses,
        ),
        (
            "router_pd_prefill_failures_during_decode_total",
            "Concurrent prefill legs that failed while decode was already streaming.",
            flow.prefill_failures_during_decode,
        ),
    ];
    render_counters(exposition, &flow_series);
    let mut family = exposition.family(
        "router_pd_policy_decisions_total",
        MetricType::Counter,
        "Policy decisions of each P/D role by model, policy and reason.",
    );
    for role in roles {
        let kind = role.role();
        for (model, policy, counts) in role.policies().counts() {
            for (reason, value) in counts.iter() {
                let labels: [(&str, &dyn std::fmt::Display); 4] = [
                    ("role", &kind),
                    ("model", &model),
                    ("policy", &policy),
                    ("reason", &reason),
                ];
                family.sample(&labels, value);
            }
        }
    }
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
        let mut exposition = Exposition::new(&mut out);
        let mut family = exposition.histograms("x_seconds", "h");
        histogram.render(&mut family, &[("route", &"chat")]);
        let samples = out.split_once("histogram\n").unwrap().1;
        assert_eq!(
            samples,
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
        histogram.render(&mut Exposition::new(&mut out).histograms("h", "h"), &[]);
        let samples = out.split_once("histogram\n").unwrap().1;
        assert!(samples.starts_with("h_bucket{le=\"1\"} 1\n"), "{out}");
    }
}
