//! A small typed writer of the Prometheus text exposition format.
//!
//! Every crate of affinity-router that serves `/metrics` writes it through
//! this crate: the router (`router-http`) and the simulated engine
//! (`engine-sim`). The two must not depend on each other, so the writer
//! lives here, in a crate with no dependencies at all.
//!
//! # Why a writer of our own
//!
//! The workspace keeps its state where it already lives (atomics on the
//! request path, each worker's load and health on the worker) and renders
//! it at scrape time; it has no use for a registry of metric objects. What
//! it needs is the part of a client library that is easy to get wrong by
//! hand: escaping, name rules, number formatting and histogram shape. That
//! is what this crate does, in a few hundred lines with no dependencies;
//! `docs/benchmarks.md` ("Prometheus text") compares it with the
//! `prometheus-client` crate's encoder on the router's own scrape.
//!
//! # What the writer guarantees
//!
//! - **Label values are escaped** (`\` → `\\`, `"` → `\"`, newline → `\n`)
//!   and **help text is escaped** (`\` and newline). Callers pass raw
//!   values, including anything that implements [`Display`], and never
//!   escape by hand.
//! - **Names are checked.** A metric name must match
//!   `[a-zA-Z_:][a-zA-Z0-9_:]*` and a label name `[a-zA-Z_][a-zA-Z0-9_]*`;
//!   any other character is written as `_` (a leading digit gets a `_` in
//!   front), so a bad name can never break the exposition. The names in this
//!   workspace are literals: [`is_valid_metric_name`] lets a test check them.
//! - **Numbers** are written the way Prometheus parses them: integers as
//!   integers, floats in their shortest round-trip form, and `+Inf`, `-Inf`,
//!   `NaN` for the non-finite ones.
//! - **Samples stay under their family.** [`Exposition::family`] borrows the
//!   exposition mutably, so the samples of one family are written together,
//!   right after its `# HELP` and `# TYPE` lines.
//! - **Histograms are whole**: cumulative `_bucket` series ending with a
//!   `+Inf` bucket, then `_sum` and `_count`, with `_count` equal to the
//!   `+Inf` bucket.
//!
//! What it does not check: that a family name is used once per exposition,
//! and that a histogram's labels do not include `le`.
//!
//! # Example
//!
//! ```
//! use prom_text::{Exposition, MetricType};
//!
//! let mut out = String::new();
//! let mut exposition = Exposition::new(&mut out);
//! let mut load = exposition.family("worker_load", MetricType::Gauge, "In-flight requests.");
//! for (url, load_now) in [("http://a:8000", 2u64), ("http://b:8000", 0)] {
//!     load.sample(&[("url", &url), ("generation", &1)], load_now);
//! }
//! let mut latency = exposition.histograms("latency_seconds", "Time to headers.");
//! latency.histogram(&[], [(0.1, 3), (1.0, 1), (f64::INFINITY, 0)], 0.75);
//! let expected = [
//!     "# HELP worker_load In-flight requests.",
//!     "# TYPE worker_load gauge",
//!     "worker_load{url=\"http://a:8000\",generation=\"1\"} 2",
//!     "worker_load{url=\"http://b:8000\",generation=\"1\"} 0",
//!     "# HELP latency_seconds Time to headers.",
//!     "# TYPE latency_seconds histogram",
//!     "latency_seconds_bucket{le=\"0.1\"} 3",
//!     "latency_seconds_bucket{le=\"1\"} 4",
//!     "latency_seconds_bucket{le=\"+Inf\"} 4",
//!     "latency_seconds_sum 0.75",
//!     "latency_seconds_count 4",
//! ];
//! assert_eq!(out.lines().collect::<Vec<_>>(), expected);
//! ```
//!
//! # Stability
//!
//! The output format is fixed by Prometheus (text format 0.0.4); the API is
//! young and may change before 1.0.

#![warn(missing_docs)]

use std::borrow::Cow;
use std::fmt::{self, Display, Write as _};

/// The `Content-Type` of the text format this crate writes.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// One label: its name and its value. The value is anything that
/// implements [`Display`] (a `&str`, a number, a URL type) and is escaped
/// as it is written.
pub type Label<'a> = (&'a str, &'a dyn Display);

/// The type of a family of plain samples, written on its `# TYPE` line.
/// Histograms have their own family type, [`Histograms`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MetricType {
    /// A value that only goes up (until the process restarts).
    Counter,
    /// A value that goes up and down.
    Gauge,
    /// A value with no declared type.
    Untyped,
}

impl MetricType {
    /// The type as the `# TYPE` line spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Untyped => "untyped",
        }
    }
}

/// A sample value: an integer or a float. Build it with `From`
/// (`3u64.into()`, `0.5.into()`, `true.into()`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    /// An unsigned integer, written as is.
    Unsigned(u64),
    /// A signed integer, written as is.
    Signed(i64),
    /// A float: shortest round-trip digits, or `+Inf`, `-Inf`, `NaN`.
    Float(f64),
}

macro_rules! value_from {
    ($variant:ident as $target:ty: $($source:ty),*) => {
        $(impl From<$source> for Value {
            fn from(value: $source) -> Self {
                Self::$variant(<$target>::from(value))
            }
        })*
    };
}

value_from!(Unsigned as u64: u64, u32, u16, u8);
value_from!(Signed as i64: i64, i32, i16, i8);
value_from!(Float as f64: f64, f32);

impl From<usize> for Value {
    fn from(value: usize) -> Self {
        // usize is at most 64 bits on every platform Rust supports.
        Self::Unsigned(value as u64)
    }
}

impl From<bool> for Value {
    /// `1` for true, `0` for false: the usual encoding of a flag.
    fn from(value: bool) -> Self {
        Self::Unsigned(u64::from(value))
    }
}

impl Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Unsigned(value) => write!(f, "{value}"),
            Self::Signed(value) => write!(f, "{value}"),
            Self::Float(value) => write_float(f, value),
        }
    }
}

/// Writes a float as Prometheus parses it.
fn write_float(out: &mut impl fmt::Write, value: f64) -> fmt::Result {
    if value.is_nan() {
        out.write_str("NaN")
    } else if value == f64::INFINITY {
        out.write_str("+Inf")
    } else if value == f64::NEG_INFINITY {
        out.write_str("-Inf")
    } else {
        write!(out, "{value}")
    }
}

/// Whether `name` is a valid metric name: `[a-zA-Z_:][a-zA-Z0-9_:]*`.
pub fn is_valid_metric_name(name: &str) -> bool {
    is_valid_name(name, true)
}

/// Whether `name` is a valid label name: `[a-zA-Z_][a-zA-Z0-9_]*`.
pub fn is_valid_label_name(name: &str) -> bool {
    is_valid_name(name, false)
}

/// Byte classes for the name rules: a letter or `_` may start a name, a
/// digit may follow, a colon is allowed in metric names only.
const START: u8 = 1;
const DIGIT: u8 = 2;
const COLON: u8 = 4;
const NAME_BYTES: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut byte = 0;
    while byte < 256 {
        let c = byte as u8;
        table[byte] = if c.is_ascii_alphabetic() || c == b'_' {
            START
        } else if c.is_ascii_digit() {
            DIGIT
        } else if c == b':' {
            COLON
        } else {
            0
        };
        byte += 1;
    }
    table
};

fn is_valid_name(name: &str, colons: bool) -> bool {
    let start = if colons { START | COLON } else { START };
    let rest = start | DIGIT;
    match name.as_bytes() {
        [first, tail @ ..] => {
            NAME_BYTES[usize::from(*first)] & start != 0
                && tail.iter().all(|b| NAME_BYTES[usize::from(*b)] & rest != 0)
        }
        [] => false,
    }
}

/// `name` as written: itself when valid, else with what the name rules do
/// not allow replaced by `_` (and a `_` in front of a leading digit).
fn checked_name(name: &str, colons: bool) -> Cow<'_, str> {
    if is_valid_name(name, colons) {
        return Cow::Borrowed(name);
    }
    let mut checked = String::with_capacity(name.len() + 1);
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        checked.push('_');
    }
    for c in name.chars() {
        let allowed = c.is_ascii_alphanumeric() || c == '_' || (colons && c == ':');
        checked.push(if allowed { c } else { '_' });
    }
    Cow::Owned(checked)
}

/// A `fmt::Write` that escapes what it is given before appending it.
struct Escaping<'a> {
    out: &'a mut String,
    /// Label values escape `"` too; help text does not.
    quotes: bool,
}

impl fmt::Write for Escaping<'_> {
    fn write_str(&mut self, mut text: &str) -> fmt::Result {
        let quotes = self.quotes;
        // The three bytes are ASCII, so they never occur inside a multi-byte
        // character and `at` is always a character boundary.
        let special = |b: &u8| matches!(b, b'\\' | b'\n') || (quotes && *b == b'"');
        while let Some(at) = text.as_bytes().iter().position(special) {
            self.out.push_str(&text[..at]);
            self.out.push_str(match text.as_bytes()[at] {
                b'\\' => "\\\\",
                b'\n' => "\\n",
                _ => "\\\"",
            });
            text = &text[at + 1..];
        }
        self.out.push_str(text);
        Ok(())
    }
}

/// A text exposition being written into a `String`.
///
/// Start a family with [`family`](Self::family) (counters, gauges) or
/// [`histograms`](Self::histograms), write its samples, then start the
/// next. Writing to a `String` cannot fail, so nothing here returns an
/// error.
#[derive(Debug)]
pub struct Exposition<'a> {
    out: &'a mut String,
}

impl<'a> Exposition<'a> {
    /// An exposition appended to `out` (which may already hold families).
    pub fn new(out: &'a mut String) -> Self {
        Self { out }
    }

    /// Writes the `# HELP` and `# TYPE` lines of a family and returns it,
    /// to write its samples.
    pub fn family<'s>(&'s mut self, name: &'s str, kind: MetricType, help: &str) -> Family<'s> {
        let name = checked_name(name, true);
        self.header(&name, kind.as_str(), help);
        Family {
            out: self.out,
            name,
        }
    }

    /// Writes the `# HELP` and `# TYPE` lines of a histogram family and
    /// returns it, to write its histograms (one per label set).
    pub fn histograms<'s>(&'s mut self, name: &'s str, help: &str) -> Histograms<'s> {
        let name = checked_name(name, true);
        self.header(&name, "histogram", help);
        Histograms {
            out: self.out,
            name,
        }
    }

    /// The `# HELP` and `# TYPE` lines of `name`, already checked.
    fn header(&mut self, name: &str, kind: &str, help: &str) {
        for line in ["# HELP ", "# TYPE "] {
            self.out.push_str(line);
            self.out.push_str(name);
            self.out.push(' ');
            if line == "# HELP " {
                let _ = Escaping {
                    out: self.out,
                    quotes: false,
                }
                .write_str(help);
            } else {
                self.out.push_str(kind);
            }
            self.out.push('\n');
        }
    }
}

/// A family of counters, gauges or untyped samples, open for its samples.
#[derive(Debug)]
pub struct Family<'a> {
    out: &'a mut String,
    /// Checked when the family was opened.
    name: Cow<'a, str>,
}

impl Family<'_> {
    /// Writes one sample: `name{labels} value`.
    pub fn sample(&mut self, labels: &[Label<'_>], value: impl Into<Value>) {
        series(self.out, &self.name, "", labels, None);
        finish(self.out, value.into());
    }
}

/// A histogram family, open for its histograms.
#[derive(Debug)]
pub struct Histograms<'a> {
    out: &'a mut String,
    /// Checked when the family was opened.
    name: Cow<'a, str>,
}

impl Histograms<'_> {
    /// Writes one histogram with these labels: a cumulative `_bucket`
    /// series per bound, then `_sum` and `_count`.
    ///
    /// `buckets` are `(upper bound, observations in that bucket alone)` in
    /// ascending order of bound; the writer accumulates them. Pass the
    /// overflow bucket with an infinite bound (or leave it out): the writer
    /// writes exactly one `+Inf` bucket, holding every count. `_count` is
    /// that same total, so the two agree even when the counts were read
    /// while they changed.
    pub fn histogram<I>(&mut self, labels: &[Label<'_>], buckets: I, sum: f64)
    where
        I: IntoIterator<Item = (f64, u64)>,
    {
        let mut cumulative = 0u64;
        for (bound, count) in buckets {
            cumulative = cumulative.saturating_add(count);
            // An infinite (or NaN) bound has no line of its own: its count
            // is in the one `+Inf` bucket written below.
            if bound.is_finite() {
                series(self.out, &self.name, "_bucket", labels, Some(bound));
                finish(self.out, Value::Unsigned(cumulative));
            }
        }
        series(self.out, &self.name, "_bucket", labels, Some(f64::INFINITY));
        finish(self.out, Value::Unsigned(cumulative));
        series(self.out, &self.name, "_sum", labels, None);
        finish(self.out, Value::Float(sum));
        series(self.out, &self.name, "_count", labels, None);
        finish(self.out, Value::Unsigned(cumulative));
    }
}

/// Writes `name{labels}` (with an `le` label last for a bucket); `name` is
/// already checked, label names are checked here.
fn series(out: &mut String, name: &str, suffix: &str, labels: &[Label<'_>], le: Option<f64>) {
    out.push_str(name);
    out.push_str(suffix);
    if labels.is_empty() && le.is_none() {
        return;
    }
    out.push('{');
    for (index, (label, value)) in labels.iter().enumerate() {
        if index > 0 {
            out.push(',');
        }
        out.push_str(&checked_name(label, false));
        out.push_str("=\"");
        let _ = write!(Escaping { out, quotes: true }, "{value}");
        out.push('"');
    }
    if let Some(bound) = le {
        if !labels.is_empty() {
            out.push(',');
        }
        out.push_str("le=\"");
        let _ = write_float(out, bound);
        out.push('"');
    }
    out.push('}');
}

fn finish(out: &mut String, value: Value) {
    let _ = writeln!(out, " {value}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_sample(name: &str, labels: &[Label<'_>], value: impl Into<Value>) -> String {
        let mut out = String::new();
        Exposition::new(&mut out)
            .family(name, MetricType::Gauge, "h")
            .sample(labels, value);
        out.lines().nth(2).unwrap().to_owned()
    }

    #[test]
    fn label_values_with_quote_backslash_and_newline_are_escaped() {
        let line = one_sample("m", &[("v", &"a\"b\\c\nd")], 1u64);
        assert_eq!(line, "m{v=\"a\\\"b\\\\c\\nd\"} 1");
    }

    #[test]
    fn display_label_values_are_escaped_too() {
        struct Hostile;
        impl Display for Hostile {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("x\"}\n")?;
                f.write_str("evil 1")
            }
        }
        let line = one_sample("m", &[("v", &Hostile), ("n", &7)], 1u64);
        assert_eq!(line, "m{v=\"x\\\"}\\nevil 1\",n=\"7\"} 1");
    }

    #[test]
    fn help_escapes_backslash_and_newline_but_not_quotes() {
        let mut out = String::new();
        Exposition::new(&mut out).family("m", MetricType::Counter, "a \"b\" \\ c\nd");
        assert_eq!(out, "# HELP m a \"b\" \\\\ c\\nd\n# TYPE m counter\n");
    }

    #[test]
    fn an_invalid_metric_name_is_sanitized() {
        assert!(!is_valid_metric_name("bad name-1"));
        assert_eq!(one_sample("bad name-1", &[], 1u64), "bad_name_1 1");
        assert_eq!(one_sample("9lives", &[], 1u64), "_9lives 1");
        assert_eq!(one_sample("", &[], 1u64), "_ 1");
        assert_eq!(one_sample("ünï", &[], 1u64), "_n_ 1");
        let mut out = String::new();
        Exposition::new(&mut out).family("a{b}", MetricType::Counter, "h");
        assert_eq!(out, "# HELP a_b_ h\n# TYPE a_b_ counter\n");
    }

    #[test]
    fn valid_names_are_kept_with_colons_only_in_metric_names() {
        assert!(is_valid_metric_name("vllm:num_requests_running"));
        assert!(is_valid_metric_name("_x9"));
        assert!(!is_valid_label_name("a:b"));
        assert_eq!(
            one_sample("vllm:x", &[("a:b", &"v"), ("0k", &"w")], 1u64),
            "vllm:x{a_b=\"v\",_0k=\"w\"} 1"
        );
    }

    #[test]
    fn values_are_written_as_prometheus_reads_them() {
        assert_eq!(one_sample("m", &[], 7u64), "m 7");
        assert_eq!(one_sample("m", &[], -3i64), "m -3");
        assert_eq!(one_sample("m", &[], 1.0), "m 1");
        assert_eq!(one_sample("m", &[], 0.25), "m 0.25");
        assert_eq!(one_sample("m", &[], f64::INFINITY), "m +Inf");
        assert_eq!(one_sample("m", &[], f64::NEG_INFINITY), "m -Inf");
        assert_eq!(one_sample("m", &[], f64::NAN), "m NaN");
        assert_eq!(one_sample("m", &[], true), "m 1");
        assert_eq!(one_sample("m", &[], 5usize), "m 5");
    }

    #[test]
    fn histogram_accumulates_adds_inf_and_counts_the_total() {
        let mut out = String::new();
        Exposition::new(&mut out)
            .histograms("x_seconds", "h")
            .histogram(&[("route", &"chat")], [(0.1, 1), (1.0, 2)], 8.05);
        assert_eq!(
            out,
            "# HELP x_seconds h\n\
             # TYPE x_seconds histogram\n\
             x_seconds_bucket{route=\"chat\",le=\"0.1\"} 1\n\
             x_seconds_bucket{route=\"chat\",le=\"1\"} 3\n\
             x_seconds_bucket{route=\"chat\",le=\"+Inf\"} 3\n\
             x_seconds_sum{route=\"chat\"} 8.05\n\
             x_seconds_count{route=\"chat\"} 3\n"
        );
    }

    #[test]
    fn histogram_writes_one_inf_bucket_holding_every_count() {
        let mut out = String::new();
        Exposition::new(&mut out).histograms("h", "h").histogram(
            &[],
            [
                (f64::NAN, 1),
                (1.0, 1),
                (f64::INFINITY, 2),
                (f64::INFINITY, 5),
            ],
            0.0,
        );
        let samples: Vec<_> = out.lines().skip(2).collect();
        assert_eq!(
            samples,
            [
                "h_bucket{le=\"1\"} 2",
                "h_bucket{le=\"+Inf\"} 9",
                "h_sum 0",
                "h_count 9",
            ]
        );
    }
}
