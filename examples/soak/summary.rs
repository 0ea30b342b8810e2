//! One run: its summary, and the table of all runs

use std::fmt::Write as _;

use serde_json::json;

use super::args::RunSpec;
use super::histogram::quantile;

/// The per-second row of the series.
pub(super) struct Second {
    pub(super) t: u64,
    pub(super) requests: u64,
    pub(super) errors: u64,
    pub(super) p50_ms: Option<f64>,
    pub(super) p99_ms: Option<f64>,
    pub(super) max_ms: f64,
    pub(super) probes: u64,
    pub(super) probe_max_ms: f64,
    pub(super) rss_mib: f64,
}

/// The summary of one run.
pub(super) struct Summary {
    pub(super) spec: RunSpec,
    pub(super) workers: usize,
    pub(super) connections: usize,
    pub(super) duration_s: f64,
    pub(super) requests: u64,
    pub(super) latency_ms: [Option<f64>; 2],
    pub(super) max_ms: f64,
    pub(super) probes: u64,
    pub(super) probe_ms: [Option<f64>; 2],
    pub(super) probe_max_ms: f64,
    pub(super) probes_slow: u64,
    pub(super) probe_slow_ms: u64,
    pub(super) http_errors: u64,
    pub(super) connection_errors: u64,
    pub(super) probe_errors: u64,
    pub(super) error_samples: Vec<String>,
    pub(super) rss_start_mib: f64,
    pub(super) rss_peak_mib: f64,
    pub(super) rss_steady_mib: f64,
    pub(super) vm_hwm_mib: f64,
    pub(super) rss_samples: usize,
    pub(super) cpu_router: f64,
    pub(super) cpu_engines: f64,
    pub(super) cpu_soak: f64,
    pub(super) loadavg_start: String,
    pub(super) loadavg_end: String,
}

impl Summary {
    fn req_per_s(&self) -> f64 {
        self.requests as f64 / self.duration_s.max(1e-9)
    }

    pub(super) fn errors(&self) -> u64 {
        self.http_errors + self.connection_errors + self.probe_errors
    }

    pub(super) fn to_json(&self) -> serde_json::Value {
        json!({
            "policy": self.spec.policy,
            "flags": self.spec.flags.join(" "),
            "workers": self.workers,
            "connections": self.connections,
            "duration_s": round(self.duration_s, 2),
            "requests": self.requests,
            "req_per_s": round(self.req_per_s(), 1),
            "latency_ms": {
                "p50": self.latency_ms[0].map(|v| round(v, 3)),
                "p99": self.latency_ms[1].map(|v| round(v, 3)),
                "max": round(self.max_ms, 3),
            },
            "probe_ms": {
                "count": self.probes,
                "p50": self.probe_ms[0].map(|v| round(v, 3)),
                "p99": self.probe_ms[1].map(|v| round(v, 3)),
                "max": round(self.probe_max_ms, 3),
                "over_threshold": self.probes_slow,
                "threshold_ms": self.probe_slow_ms,
            },
            "rss_mib": {
                "start": round(self.rss_start_mib, 1),
                "peak": round(self.rss_peak_mib, 1),
                "steady": round(self.rss_steady_mib, 1),
                "hwm": round(self.vm_hwm_mib, 1),
                "samples": self.rss_samples,
            },
            "errors": self.errors(),
            "http_errors": self.http_errors,
            "connection_errors": self.connection_errors,
            "probe_errors": self.probe_errors,
            "error_samples": self.error_samples,
            "cpu_cores": {
                "router": round(self.cpu_router, 2),
                "engines": round(self.cpu_engines, 2),
                "soak": round(self.cpu_soak, 2),
            },
            "loadavg": {"start": self.loadavg_start, "end": self.loadavg_end},
        })
    }

    pub(super) fn to_text(&self) -> String {
        let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}"));
        let mut out = format!(
            "soak: {} | {} workers, {} connections, {:.1} s, load average {} -> {}\n",
            self.spec.label(),
            self.workers,
            self.connections,
            self.duration_s,
            self.loadavg_start,
            self.loadavg_end
        );
        let _ = writeln!(
            out,
            "  load:   {} requests, {:.0} req/s; latency ms p50 {} p99 {} max {:.2}",
            self.requests,
            self.req_per_s(),
            ms(self.latency_ms[0]),
            ms(self.latency_ms[1]),
            self.max_ms
        );
        let _ = writeln!(
            out,
            "  probe:  {} probes; latency ms p50 {} p99 {} max {:.2}; {} over {} ms",
            self.probes,
            ms(self.probe_ms[0]),
            ms(self.probe_ms[1]),
            self.probe_max_ms,
            self.probes_slow,
            self.probe_slow_ms
        );
        let _ = writeln!(
            out,
            "  router RSS MiB: start {:.1}, peak {:.1}, steady {:.1} (median of the last 30 % of {} samples), VmHWM {:.1}",
            self.rss_start_mib,
            self.rss_peak_mib,
            self.rss_steady_mib,
            self.rss_samples,
            self.vm_hwm_mib
        );
        let _ = writeln!(
            out,
            "  CPU (cores): router {:.2}, engines {:.2}, soak {:.2}",
            self.cpu_router, self.cpu_engines, self.cpu_soak
        );
        let _ = write!(
            out,
            "  errors: {} (http {}, connection {}, probe {})",
            self.errors(),
            self.http_errors,
            self.connection_errors,
            self.probe_errors
        );
        for sample in &self.error_samples {
            let _ = write!(out, "\n    e.g. {sample}");
        }
        out
    }
}

fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

/// The median of the last 30 % of `samples` (at least one sample).
pub(super) fn steady(samples: &[f64]) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let take = ((samples.len() as f64 * 0.3).ceil() as usize).max(1);
    let mut tail = samples[samples.len() - take..].to_vec();
    tail.sort_by(f64::total_cmp);
    let mid = tail.len() / 2;
    if tail.len() % 2 == 1 {
        tail[mid]
    } else {
        (tail[mid - 1] + tail[mid]) / 2.0
    }
}

fn to_ms(micros: Option<u64>) -> Option<f64> {
    micros.map(|v| v as f64 / 1000.0)
}

/// A quantile in ms, never above the exact maximum `max_micros` (a
/// bucket's middle can be above the largest value it holds).
pub(super) fn quantile_ms(counts: &[u64], q: f64, max_micros: u64) -> Option<f64> {
    to_ms(quantile(counts, q).map(|v| v.min(max_micros)))
}

/// The markdown table of all runs; the p99 ratio is against the first
/// round_robin row (the "at most 3x round_robin's in the same run").
pub(super) fn table(summaries: &[Summary]) -> String {
    let rr_p99 = summaries
        .iter()
        .find(|s| s.spec.policy == "round_robin")
        .and_then(|s| s.latency_ms[1]);
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}"));
    let mut out = String::from(
        "| policy | flags | workers | s | req/s | p50 ms | p99 ms | max ms | p99 / rr | probe p50 | probe p99 | probe max | probes > slow | RSS start MiB | RSS peak MiB | RSS steady MiB | VmHWM MiB | errors |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for s in summaries {
        let ratio = match (rr_p99, s.latency_ms[1]) {
            (Some(rr), Some(p99)) if rr > 0.0 => format!("{:.1}x", p99 / rr),
            _ => "-".to_owned(),
        };
        let flags = if s.spec.flags.is_empty() {
            "(defaults)".to_owned()
        } else {
            format!("`{}`", s.spec.flags.join(" "))
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.0} | {:.0} | {} | {} | {:.1} | {} | {} | {} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
            s.spec.policy,
            flags,
            s.workers,
            s.duration_s,
            s.req_per_s(),
            ms(s.latency_ms[0]),
            ms(s.latency_ms[1]),
            s.max_ms,
            ratio,
            ms(s.probe_ms[0]),
            ms(s.probe_ms[1]),
            s.probe_max_ms,
            s.probes_slow,
            s.rss_start_mib,
            s.rss_peak_mib,
            s.rss_steady_mib,
            s.vm_hwm_mib,
            s.errors()
        );
    }
    out
}
