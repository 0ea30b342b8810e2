//! Turning run reports into tables and the `--json` line.

use std::fmt::Write as _;

use serde_json::{Map, Value, json};

use crate::config::RunReport;

/// The `--json` summary: `{"<workload>": {"<policy>": {"throughput_rps",
/// "output_tps", "ttft_p50_ms", "ttft_p99_ms", "e2e_p99_ms", "hit_rate",
/// "imbalance", "routing_loss", "replicas", "placed"}}}` (`replicas`: the
/// router replicas of the run, an integer; `placed`: requests placed on
/// each engine of the policy's pool, in engine order). Keys are sorted, numbers rounded to
/// six significant decimals, so equal runs print equal lines.
pub fn json_summary(reports: &[RunReport]) -> Value {
    let mut workloads = Map::new();
    for report in reports {
        let m = &report.metrics;
        let entry = workloads
            .entry(report.workload.clone())
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(policies) = entry {
            policies.insert(
                report.policy.clone(),
                json!({
                    "throughput_rps": round(m.throughput_rps),
                    "output_tps": round(m.output_tps),
                    "ttft_p50_ms": round(m.ttft_p50_ms),
                    "ttft_p99_ms": round(m.ttft_p99_ms),
                    "e2e_p99_ms": round(m.e2e_p99_ms),
                    "hit_rate": round(m.hit_rate),
                    "imbalance": round(m.imbalance),
                    "routing_loss": round(m.routing_loss),
                    "replicas": report.replicas,
                    "placed": report.placed,
                }),
            );
        }
    }
    Value::Object(workloads)
}

fn round(x: f64) -> f64 {
    if x.is_finite() {
        (x * 1e6).round() / 1e6
    } else {
        0.0
    }
}

/// Column headers of [`markdown_table`].
const HEADERS: [&str; 12] = [
    "policy",
    "req/s",
    "out tok/s",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TTFT p99 ms",
    "e2e p50 ms",
    "e2e p99 ms",
    "hit rate",
    "imbalance",
    "routing loss",
    "done/rejected",
];

fn row(report: &RunReport) -> [String; 12] {
    let m = &report.metrics;
    [
        format!("`{}`", report.policy),
        format!("{:.1}", m.throughput_rps),
        format!("{:.0}", m.output_tps),
        format!("{:.0}", m.ttft_p50_ms),
        format!("{:.0}", m.ttft_p90_ms),
        format!("{:.0}", m.ttft_p99_ms),
        format!("{:.0}", m.e2e_p50_ms),
        format!("{:.0}", m.e2e_p99_ms),
        format!("{:.1}%", m.hit_rate * 100.0),
        format!("{:.2}", m.imbalance),
        format!("{:.1}%", m.routing_loss * 100.0),
        format!("{}/{}", m.completed, m.rejected),
    ]
}

/// A markdown table of one workload's reports (one row per policy, in the
/// order given), columns padded so it also reads well in a terminal.
pub fn markdown_table(reports: &[&RunReport]) -> String {
    let rows: Vec<[String; 12]> = reports.iter().map(|r| row(r)).collect();
    let mut widths = HEADERS.map(str::len);
    for r in &rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &[&str]| {
        out.push('|');
        for (i, cell) in cells.iter().enumerate() {
            // Text left, numbers right.
            if i == 0 {
                let _ = write!(out, " {:<w$} |", cell, w = widths[i]);
            } else {
                let _ = write!(out, " {:>w$} |", cell, w = widths[i]);
            }
        }
        out.push('\n');
    };
    line(&mut out, &HEADERS);
    out.push('|');
    for (i, w) in widths.iter().enumerate() {
        if i == 0 {
            let _ = write!(out, "{}|", "-".repeat(w + 2));
        } else {
            let _ = write!(out, "{}:|", "-".repeat(w + 1));
        }
    }
    out.push('\n');
    for r in &rows {
        let cells: Vec<&str> = r.iter().map(String::as_str).collect();
        line(&mut out, &cells);
    }
    out
}

/// Headline ratios of `policy` against `baseline` in one workload:
/// hit rate, throughput and TTFT p50 (baseline over policy, so above 1
/// means better), or `None` if either is missing.
pub fn ratios(reports: &[&RunReport], policy: &str, baseline: &str) -> Option<Ratios> {
    let find = |name: &str| reports.iter().find(|r| r.policy == name);
    let (p, b) = (&find(policy)?.metrics, &find(baseline)?.metrics);
    let div = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::INFINITY };
    Some(Ratios {
        hit_rate: div(p.hit_rate, b.hit_rate),
        throughput: div(p.throughput_rps, b.throughput_rps),
        ttft_p50_speedup: div(b.ttft_p50_ms, p.ttft_p50_ms),
        ttft_p99_speedup: div(b.ttft_p99_ms, p.ttft_p99_ms),
    })
}

/// One policy against another, as multiples (above 1: the first is
/// better).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ratios {
    /// Hit rate over the baseline's.
    pub hit_rate: f64,
    /// Requests per second over the baseline's.
    pub throughput: f64,
    /// Baseline TTFT p50 over this policy's.
    pub ttft_p50_speedup: f64,
    /// Baseline TTFT p99 over this policy's.
    pub ttft_p99_speedup: f64,
}
