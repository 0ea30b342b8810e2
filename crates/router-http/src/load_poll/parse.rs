//! Reading an engine's load from what it answered: vLLM's Prometheus text
//! (`GET /metrics`) or the `GET /get_load` JSON of SGLang and vllm-router.
//!
//! Both readers are strict and bounded. The bytes come from a network
//! peer, so every line of a Prometheus text is checked against the format
//! (one malformed line makes the whole reply garbage, rather than a reply
//! whose meaning was guessed), counts must be whole, finite, non-negative
//! and below [`MAX_PLAUSIBLE_LOAD`], a reply may name at most
//! [`MAX_RANKS`] engines, and neither reader allocates in proportion to
//! the reply: they fold it as they go.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{Deserializer, SeqAccess, Visitor};

/// The largest in-flight count believed of one engine: a report above it
/// is [`PollError::Implausible`] (no engine runs a million requests at
/// once; a number that large is a broken or hostile reply).
pub const MAX_PLAUSIBLE_LOAD: u64 = 1 << 20;

/// The most engines (data-parallel ranks) one reply may name; a reply
/// naming more is garbage.
pub const MAX_RANKS: usize = 1024;

/// Where an engine's load was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoadSource {
    /// vLLM's Prometheus metrics, `GET /metrics`.
    Metrics,
    /// The JSON of `GET /get_load` (SGLang, vllm-router).
    GetLoad,
}

impl LoadSource {
    /// Every source, in the order they are tried.
    pub const ALL: [LoadSource; 2] = [LoadSource::Metrics, LoadSource::GetLoad];

    /// The path polled.
    pub fn path(self) -> &'static str {
        match self {
            LoadSource::Metrics => "/metrics",
            LoadSource::GetLoad => "/get_load",
        }
    }

    /// The name in `/workers` and in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            LoadSource::Metrics => "metrics",
            LoadSource::GetLoad => "get_load",
        }
    }

    /// Reads a reply of this source.
    pub fn parse(self, body: &[u8]) -> Result<EngineLoads, Unusable> {
        match self {
            LoadSource::Metrics => parse_metrics(body),
            LoadSource::GetLoad => parse_get_load(body),
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for LoadSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a poll left a worker without a report: the `reason` label of
/// `router_load_poll_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum PollError {
    /// The engine could not be reached (refused, reset, unreachable).
    Connect,
    /// No complete answer within the poll timeout (a reply that never
    /// ends included).
    Timeout,
    /// An error status (other than the "no such endpoint" ones).
    Status,
    /// The body was larger than the cap; reading stopped there.
    TooLarge,
    /// Not the format the source has: not UTF-8, a malformed line, JSON of
    /// another shape, too many engines.
    Garbage,
    /// A count that is negative, fractional, infinite or NaN.
    InvalidValue,
    /// A count above [`MAX_PLAUSIBLE_LOAD`].
    Implausible,
    /// The reply names no engine for the worker's data-parallel rank (or
    /// none at all).
    RankAbsent,
    /// Neither `/metrics` nor `/get_load` carries load (both 404, or
    /// neither reply has the fields): the engine is left alone for a
    /// backoff.
    NoSource,
    /// The last report is older than the staleness limit.
    Stale,
}

impl PollError {
    /// Every reason, in label order.
    pub const ALL: [PollError; 10] = [
        PollError::Connect,
        PollError::Timeout,
        PollError::Status,
        PollError::TooLarge,
        PollError::Garbage,
        PollError::InvalidValue,
        PollError::Implausible,
        PollError::RankAbsent,
        PollError::NoSource,
        PollError::Stale,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            PollError::Connect => "connect",
            PollError::Timeout => "timeout",
            PollError::Status => "status",
            PollError::TooLarge => "too_large",
            PollError::Garbage => "garbage",
            PollError::InvalidValue => "invalid_value",
            PollError::Implausible => "implausible",
            PollError::RankAbsent => "rank_absent",
            PollError::NoSource => "no_source",
            PollError::Stale => "stale",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for PollError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a reply gave no load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unusable {
    /// The reply is not this source's kind (no load fields in it): the
    /// next source may have them.
    Absent,
    /// The reply is this source's kind, but broken.
    Failed(PollError),
}

impl From<PollError> for Unusable {
    fn from(error: PollError) -> Self {
        Unusable::Failed(error)
    }
}

/// One engine's load in a reply.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankLoad {
    /// Requests in flight on the engine: running plus waiting.
    pub in_flight: u64,
    /// How many of them wait to be scheduled, when the reply says
    /// (vLLM's `vllm:num_requests_waiting`).
    pub waiting: Option<u64>,
    /// KV-cache usage from 0.0 to 1.0, when the reply has it (vLLM's
    /// metrics).
    pub kv_cache_usage: Option<f64>,
}

/// The load a reply reports, per engine: the series (or list entries) of
/// each data-parallel rank, and those that name none.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineLoads {
    /// By rank; `None` for series without a (numeric) rank.
    ranks: BTreeMap<Option<u32>, RankLoad>,
}

impl EngineLoads {
    /// The load of the worker with data-parallel rank `rank`: its rank's
    /// entry, or without a rank the sum over every entry (the largest KV
    /// usage among them). [`PollError::RankAbsent`] when the reply has no
    /// entry for the rank, or none at all.
    pub fn for_rank(&self, rank: Option<u32>) -> Result<RankLoad, PollError> {
        match rank {
            Some(rank) => self.ranks.get(&Some(rank)).copied(),
            None => self.ranks.values().copied().reduce(|a, b| RankLoad {
                in_flight: a.in_flight.saturating_add(b.in_flight),
                waiting: match (a.waiting, b.waiting) {
                    (Some(x), Some(y)) => Some(x.saturating_add(y)),
                    (x, y) => x.or(y),
                },
                kv_cache_usage: match (a.kv_cache_usage, b.kv_cache_usage) {
                    (Some(x), Some(y)) => Some(x.max(y)),
                    (x, y) => x.or(y),
                },
            }),
        }
        .ok_or(PollError::RankAbsent)
    }

    /// Engines (ranks) in the reply.
    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    /// Whether the reply named no engine.
    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    /// Adds `in_flight` to the entry of `rank`.
    fn add(&mut self, rank: Option<u32>, in_flight: u64) -> Result<(), PollError> {
        if !self.ranks.contains_key(&rank) && self.ranks.len() >= MAX_RANKS {
            return Err(PollError::Garbage);
        }
        let entry = self.ranks.entry(rank).or_insert(RankLoad {
            in_flight: 0,
            waiting: None,
            kv_cache_usage: None,
        });
        entry.in_flight = entry.in_flight.saturating_add(in_flight);
        if entry.in_flight > MAX_PLAUSIBLE_LOAD {
            return Err(PollError::Implausible);
        }
        Ok(())
    }
}

/// A count as a gauge gives it: whole, finite, non-negative, plausible.
fn count(value: f64) -> Result<u64, PollError> {
    if !value.is_finite() || value < 0.0 || value.fract() != 0.0 {
        return Err(PollError::InvalidValue);
    }
    if value > MAX_PLAUSIBLE_LOAD as f64 {
        return Err(PollError::Implausible);
    }
    Ok(value as u64)
}

// ----- Prometheus text -----

const RUNNING: &str = "vllm:num_requests_running";
const WAITING: &str = "vllm:num_requests_waiting";
const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
const GPU_KV_USAGE: &str = "vllm:gpu_cache_usage_perc";

/// What one engine's series gave so far.
#[derive(Debug, Default, Clone, Copy)]
struct Gauges {
    running: Option<u64>,
    waiting: Option<u64>,
    kv_usage: Option<f64>,
    gpu_kv_usage: Option<f64>,
}

/// Reads vLLM's Prometheus text, the reply of `GET /metrics`.
///
/// An engine's in-flight count is `vllm:num_requests_running` plus
/// `vllm:num_requests_waiting`. vLLM labels each engine's series with
/// `engine="N"` (its data-parallel rank when one server fronts several
/// ranks); samples of one family and engine (one per `model_name`, say)
/// are added, and the series of each engine become that rank's entry
/// (series without a numeric `engine` label, one entry of no rank).
/// `vllm:kv_cache_usage_perc`, or its older name
/// `vllm:gpu_cache_usage_perc`, is kept for display when it lies in
/// `[0, 1]` and ignored otherwise. The waiting count is also kept apart
/// ([`RankLoad::waiting`]).
///
/// A text without either load family is not vLLM's ([`Unusable::Absent`]:
/// the next source is tried). Every line must be a comment, blank, or a
/// well-formed sample (`name[{label="value",...}] value [timestamp]`, the
/// label values with no escape but `\\`, `\"` and `\n`), or the whole
/// text is [`PollError::Garbage`]; so is an engine that has one of the two
/// load families and not the other, and a text naming more than
/// [`MAX_RANKS`] engines. The load gauges must be whole, finite and
/// non-negative ([`PollError::InvalidValue`]) and at most
/// [`MAX_PLAUSIBLE_LOAD`] ([`PollError::Implausible`]).
pub fn parse_metrics(body: &[u8]) -> Result<EngineLoads, Unusable> {
    let text = std::str::from_utf8(body).map_err(|_| PollError::Garbage)?;
    let mut engines: BTreeMap<Option<u32>, Gauges> = BTreeMap::new();
    for line in text.split('\n') {
        let Some(sample) = sample(line).map_err(|()| PollError::Garbage)? else {
            continue;
        };
        let family = match sample.name {
            RUNNING | WAITING | KV_USAGE | GPU_KV_USAGE => sample.name,
            _ => continue,
        };
        let rank = sample.engine.and_then(rank_label);
        if !engines.contains_key(&rank) && engines.len() >= MAX_RANKS {
            return Err(PollError::Garbage.into());
        }
        let gauges = engines.entry(rank).or_default();
        let add = |slot: &mut Option<u64>| -> Result<(), PollError> {
            let sum = slot.unwrap_or(0).saturating_add(count(sample.value)?);
            if sum > MAX_PLAUSIBLE_LOAD {
                return Err(PollError::Implausible);
            }
            *slot = Some(sum);
            Ok(())
        };
        // A usage outside [0, 1] is only not shown: it never fails a report.
        let usage = (0.0..=1.0).contains(&sample.value).then_some(sample.value);
        match family {
            RUNNING => add(&mut gauges.running)?,
            WAITING => add(&mut gauges.waiting)?,
            KV_USAGE => gauges.kv_usage = max(gauges.kv_usage, usage),
            _ => gauges.gpu_kv_usage = max(gauges.gpu_kv_usage, usage),
        }
    }
    let mut loads = EngineLoads::default();
    for (rank, gauges) in engines {
        let (running, waiting) = match (gauges.running, gauges.waiting) {
            (Some(running), Some(waiting)) => (running, waiting),
            (None, None) => continue,
            _ => return Err(PollError::Garbage.into()),
        };
        loads.add(rank, running + waiting)?;
        if let Some(entry) = loads.ranks.get_mut(&rank) {
            entry.kv_cache_usage = gauges.kv_usage.or(gauges.gpu_kv_usage);
            entry.waiting = Some(waiting);
        }
    }
    if loads.is_empty() {
        return Err(Unusable::Absent);
    }
    Ok(loads)
}

fn max(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// The rank an `engine` label names: its value when that is a decimal
/// number (vLLM writes the engine index, `"0"`, `"1"`, ...).
fn rank_label(value: &str) -> Option<u32> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    value.parse().ok()
}

/// One sample line, its parts borrowed from the text.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample<'a> {
    name: &'a str,
    /// The raw value of its `engine` label, if it has one.
    engine: Option<&'a str>,
    value: f64,
}

fn is_blank(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// One line of the text format: `Ok(None)` for a blank line or a comment
/// (`# HELP`, `# TYPE` and others), `Err` for anything that is not
/// `name[{labels}] value [timestamp]`.
fn sample(line: &str) -> Result<Option<Sample<'_>>, ()> {
    let line = line.trim_start_matches(is_blank);
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let name_len = identifier_len(line, |c| c == b':')?;
    let name = &line[..name_len];
    let mut rest = &line[name_len..];
    let mut engine = None;
    if let Some(labels) = rest.trim_start_matches(is_blank).strip_prefix('{') {
        let (found, after) = label_set(labels)?;
        engine = found;
        rest = after;
    }
    let trimmed = rest.trim_start_matches(is_blank);
    if trimmed.len() == rest.len() {
        return Err(());
    }
    let (value, rest) = trimmed.split_at(trimmed.find(is_blank).unwrap_or(trimmed.len()));
    let value: f64 = value.parse().map_err(drop)?;
    let rest = rest.trim_start_matches(is_blank);
    if !rest.is_empty() {
        let (timestamp, tail) = rest.split_at(rest.find(is_blank).unwrap_or(rest.len()));
        timestamp.parse::<i64>().map_err(drop)?;
        if !tail.trim_start_matches(is_blank).is_empty() {
            return Err(());
        }
    }
    Ok(Some(Sample {
        name,
        engine,
        value,
    }))
}

/// The length of the identifier `text` starts with: an ASCII letter or
/// `_` (or a byte `extra` allows), then those and digits. `Err` when it
/// starts with none.
fn identifier_len(text: &str, extra: impl Fn(u8) -> bool) -> Result<usize, ()> {
    let word = |b: u8| b.is_ascii_alphabetic() || b == b'_' || extra(b);
    let bytes = text.as_bytes();
    match bytes.first() {
        Some(&b) if word(b) => {}
        _ => return Err(()),
    }
    Ok(bytes
        .iter()
        .position(|&b| !(word(b) || b.is_ascii_digit()))
        .unwrap_or(bytes.len()))
}

/// A label set after its `{`: the raw `engine` value if there is one, and
/// the text after the closing `}`. Label values may hold the escapes
/// `\\`, `\"` and `\n` and nothing else after a backslash; a trailing
/// comma is allowed; a repeated `engine` label is not.
fn label_set(mut text: &str) -> Result<(Option<&str>, &str), ()> {
    let mut engine = None;
    loop {
        text = text.trim_start_matches(is_blank);
        if let Some(after) = text.strip_prefix('}') {
            return Ok((engine, after));
        }
        let name_len = identifier_len(text, |_| false)?;
        let name = &text[..name_len];
        text = text[name_len..].trim_start_matches(is_blank);
        text = text.strip_prefix('=').ok_or(())?;
        text = text.trim_start_matches(is_blank);
        text = text.strip_prefix('"').ok_or(())?;
        let end = quoted_len(text)?;
        if name == "engine" {
            if engine.is_some() {
                return Err(());
            }
            engine = Some(&text[..end]);
        }
        text = text[end + 1..].trim_start_matches(is_blank);
        if let Some(after) = text.strip_prefix(',') {
            text = after;
        } else if !text.starts_with('}') {
            return Err(());
        }
    }
}

/// The length of a label value up to (not including) its closing quote.
fn quoted_len(text: &str) -> Result<usize, ()> {
    let bytes = text.as_bytes();
    let mut at = 0;
    loop {
        match bytes.get(at) {
            Some(b'"') => return Ok(at),
            Some(b'\\') => match bytes.get(at + 1) {
                Some(b'\\' | b'"' | b'n') => at += 2,
                _ => return Err(()),
            },
            Some(_) => at += 1,
            None => return Err(()),
        }
    }
}

// ----- /get_load JSON -----

/// One object of a `/get_load` reply; other fields are skipped unread.
#[derive(Debug, serde::Deserialize)]
struct LoadEntry {
    #[serde(default)]
    dp_rank: Option<i64>,
    #[serde(default)]
    num_reqs: Option<serde_json::Number>,
    #[serde(default)]
    load: Option<serde_json::Number>,
}

impl LoadEntry {
    /// The entry's rank and in-flight count; `Ok(None)` for an object
    /// that names no load.
    fn read(&self) -> Result<Option<(Option<u32>, u64)>, PollError> {
        let Some(number) = self.num_reqs.as_ref().or(self.load.as_ref()) else {
            return Ok(None);
        };
        let rank = match self.dp_rank {
            None => None,
            Some(rank) => Some(u32::try_from(rank).map_err(|_| PollError::Garbage)?),
        };
        let in_flight = match (number.as_u64(), number.as_i64()) {
            (Some(n), _) if n > MAX_PLAUSIBLE_LOAD => return Err(PollError::Implausible),
            (Some(n), _) => n,
            (None, Some(_negative)) => return Err(PollError::InvalidValue),
            (None, None) => count(number.as_f64().ok_or(PollError::Garbage)?)?,
        };
        Ok(Some((rank, in_flight)))
    }
}

/// A list of entries, folded as it is read: at most one entry is held at
/// a time, whatever the list's length. The first error is kept and the
/// rest of the list only read through, so that the JSON still parses and
/// the error keeps its kind.
struct Folded(Result<EngineLoads, PollError>);

impl<'de> serde::Deserialize<'de> for Folded {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = Folded;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of load entries")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Folded, A::Error> {
                let mut loads = Ok(EngineLoads::default());
                while let Some(entry) = seq.next_element::<LoadEntry>()? {
                    if let Ok(folded) = &mut loads {
                        let added = match entry.read() {
                            Ok(Some((rank, in_flight))) => folded.add(rank, in_flight),
                            Ok(None) => Err(PollError::Garbage),
                            Err(error) => Err(error),
                        };
                        if let Err(error) = added {
                            loads = Err(error);
                        }
                    }
                }
                Ok(Folded(loads))
            }
        }
        deserializer.deserialize_seq(Entries)
    }
}

/// Reads the reply of `GET /get_load`. Accepted shapes:
///
/// - a list of per-rank objects, SGLang's
///   (`[{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, ...}]`):
///   `num_reqs` is the rank's in-flight count (SGLang counts running plus
///   waiting in it; `num_waiting_reqs` is a part of it, not added again);
///   `dp_rank` may be absent or `null` (an entry of no rank);
/// - one such object;
/// - an object with an integer `load`, the shape vllm-router reads
///   (`{"load": 5}`), for the engine as a whole.
///
/// Other fields are ignored. An object with neither `num_reqs` nor `load`
/// is not a load reply ([`Unusable::Absent`]); anything else that is not
/// one of these shapes (a list entry without a count included) is
/// [`PollError::Garbage`]. Counts are checked as [`parse_metrics`] checks
/// the gauges. The list is folded as it is read, one entry at a time.
pub fn parse_get_load(body: &[u8]) -> Result<EngineLoads, Unusable> {
    let first = body.iter().find(|b| !b" \t\r\n".contains(b));
    match first {
        Some(b'[') => {
            let Folded(loads) =
                serde_json::from_slice::<Folded>(body).map_err(|_| PollError::Garbage)?;
            Ok(loads?)
        }
        Some(b'{') => {
            let entry =
                serde_json::from_slice::<LoadEntry>(body).map_err(|_| PollError::Garbage)?;
            let Some((rank, in_flight)) = entry.read()? else {
                return Err(Unusable::Absent);
            };
            let mut loads = EngineLoads::default();
            loads.add(rank, in_flight)?;
            Ok(loads)
        }
        _ => Err(PollError::Garbage.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const VLLM: &str = "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
        # TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 3.0\n\
        # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
        # TYPE vllm:num_requests_waiting gauge\n\
        vllm:num_requests_waiting{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 2.0\n\
        # HELP vllm:kv_cache_usage_perc KV-Cache usage. 1 means 100 percent usage.\n\
        # TYPE vllm:kv_cache_usage_perc gauge\n\
        vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 0.25\n\
        # HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.\n\
        # TYPE vllm:e2e_request_latency_seconds histogram\n\
        vllm:e2e_request_latency_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"Qwen/Qwen3-8B\"} 7.0\n\
        vllm:e2e_request_latency_seconds_sum{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 1.2e-05\n\
        vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"m\"} NaN\n\
        python_gc_objects_collected_total{generation=\"0\"} 2019.0 1700000000000\n\
        \n";

    fn load(result: Result<EngineLoads, Unusable>, rank: Option<u32>) -> RankLoad {
        result.unwrap().for_rank(rank).unwrap()
    }

    #[test]
    fn vllm_metrics_give_running_plus_waiting_and_the_cache_usage() {
        let report = load(parse_metrics(VLLM.as_bytes()), None);
        assert_eq!(report.in_flight, 5);
        assert_eq!(report.waiting, Some(2));
        assert_eq!(report.kv_cache_usage, Some(0.25));
        assert_eq!(load(parse_metrics(VLLM.as_bytes()), Some(0)).in_flight, 5);
        assert_eq!(
            parse_metrics(VLLM.as_bytes()).unwrap().for_rank(Some(1)),
            Err(PollError::RankAbsent)
        );
        // The older name of the usage gauge, when the newer is absent.
        let older = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n\
            vllm:gpu_cache_usage_perc 0.5\n";
        let report = load(parse_metrics(older.as_bytes()), None);
        assert_eq!((report.in_flight, report.kv_cache_usage), (1, Some(0.5)));
        // A usage outside [0, 1] is not shown, and fails nothing.
        let odd = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n\
            vllm:kv_cache_usage_perc 7\n";
        assert_eq!(
            load(parse_metrics(odd.as_bytes()), None).kv_cache_usage,
            None
        );
    }

    #[test]
    fn data_parallel_engines_are_read_per_rank_and_summed_without_one() {
        let text = "vllm:num_requests_running{engine=\"0\"} 1\n\
            vllm:num_requests_waiting{engine=\"0\"} 1\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"a\"} 4\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"b\"} 1\n\
            vllm:num_requests_waiting{engine=\"1\"} 0\n\
            vllm:kv_cache_usage_perc{engine=\"0\"} 0.1\n\
            vllm:kv_cache_usage_perc{engine=\"1\"} 0.7\n";
        let loads = parse_metrics(text.as_bytes()).unwrap();
        assert_eq!(loads.len(), 2);
        assert_eq!(loads.for_rank(Some(0)).unwrap().in_flight, 2);
        assert_eq!(loads.for_rank(Some(1)).unwrap().in_flight, 5);
        assert_eq!(loads.for_rank(Some(0)).unwrap().waiting, Some(1));
        assert_eq!(loads.for_rank(Some(1)).unwrap().waiting, Some(0));
        let all = loads.for_rank(None).unwrap();
        assert_eq!((all.in_flight, all.kv_cache_usage), (7, Some(0.7)));
        assert_eq!(all.waiting, Some(1));
        assert_eq!(loads.for_rank(Some(2)), Err(PollError::RankAbsent));
        // A non-numeric engine label counts in the sum but is no rank.
        let named = "vllm:num_requests_running{engine=\"e-1\"} 2\n\
            vllm:num_requests_waiting{engine=\"e-1\"} 1\n";
        let loads = parse_metrics(named.as_bytes()).unwrap();
        assert_eq!(loads.for_rank(None).unwrap().in_flight, 3);
        assert_eq!(loads.for_rank(Some(0)), Err(PollError::RankAbsent));
    }

    #[test]
    fn the_text_format_is_read_strictly() {
        let good = [
            "vllm:num_requests_running 1",
            "vllm:num_requests_running{} 1",
            "vllm:num_requests_running{engine=\"0\",} 1",
            "  vllm:num_requests_running {engine = \"0\" , model_name=\"x\\\"y\\\\z\\n\"}\t1 123",
            "vllm:num_requests_running{model_name=\"é ü {} = , #\"} 1e0",
            "vllm:num_requests_running 1 -5",
        ];
        for line in good {
            // The waiting gauge of the same engine.
            let engine = if line.contains("engine") {
                "{engine=\"0\"}"
            } else {
                ""
            };
            let text = format!("{line}\nvllm:num_requests_waiting{engine} 0\n");
            assert_eq!(
                parse_metrics(text.as_bytes()).map(|l| l.for_rank(None).unwrap().in_flight),
                Ok(1),
                "{line:?}"
            );
        }
        let bad = [
            "vllm:num_requests_running",
            "vllm:num_requests_running{engine=\"0\"}1",
            "vllm:num_requests_running{engine=\"0\" 1",
            "vllm:num_requests_running{engine=0} 1",
            "vllm:num_requests_running{engine=\"0\"\"} 1",
            "vllm:num_requests_running{engine=\"\\x\"} 1",
            "vllm:num_requests_running{engine=\"0\",engine=\"1\"} 1",
            "vllm:num_requests_running{,} 1",
            "vllm:num_requests_running{0a=\"1\"} 1",
            "vllm:num_requests_running{a=\"1\" b=\"2\"} 1",
            "vllm:num_requests_running one",
            "vllm:num_requests_running 1 2 3",
            "vllm:num_requests_running 1 1.5",
            "vllm:num_requests_running 1\r",
            "9vllm 1",
            "{engine=\"0\"} 1",
            "<html>",
            "some other_metric 1",
        ];
        for line in bad {
            let text = format!("vllm:num_requests_waiting 0\n{line}\n");
            assert_eq!(
                parse_metrics(text.as_bytes()),
                Err(Unusable::Failed(PollError::Garbage)),
                "{line:?}"
            );
        }
        // A malformed line of any family spoils the whole text.
        let text = format!("{VLLM}python_info{{version=\"3.12\" 1\n");
        assert_eq!(
            parse_metrics(text.as_bytes()),
            Err(Unusable::Failed(PollError::Garbage))
        );
        assert_eq!(
            parse_metrics(b"\xff\xfe"),
            Err(Unusable::Failed(PollError::Garbage))
        );
    }

    #[test]
    fn gauges_must_be_whole_finite_non_negative_and_plausible() {
        let cases = [
            ("-1", PollError::InvalidValue),
            ("-0.5", PollError::InvalidValue),
            ("1.5", PollError::InvalidValue),
            ("NaN", PollError::InvalidValue),
            ("+Inf", PollError::InvalidValue),
            ("-Inf", PollError::InvalidValue),
            ("1e12", PollError::Implausible),
            ("1048577", PollError::Implausible),
        ];
        for (value, expected) in cases {
            let text = format!("vllm:num_requests_running {value}\nvllm:num_requests_waiting 0\n");
            assert_eq!(
                parse_metrics(text.as_bytes()),
                Err(Unusable::Failed(expected)),
                "{value}"
            );
        }
        // Plausible parts that add up to an implausible whole.
        let text = "vllm:num_requests_running 1048576\nvllm:num_requests_waiting 1\n";
        assert_eq!(
            parse_metrics(text.as_bytes()),
            Err(Unusable::Failed(PollError::Implausible))
        );
        let text = "vllm:num_requests_running 1048576\nvllm:num_requests_waiting 0\n";
        assert_eq!(
            load(parse_metrics(text.as_bytes()), None).in_flight,
            1 << 20
        );
    }

    #[test]
    fn texts_without_vllms_gauges_are_another_source_and_half_of_them_is_garbage() {
        for text in ["", "\n\n", "# nothing\n", "process_cpu_seconds_total 5\n"] {
            assert_eq!(
                parse_metrics(text.as_bytes()),
                Err(Unusable::Absent),
                "{text:?}"
            );
        }
        let half = "vllm:num_requests_running{engine=\"0\"} 1\n";
        assert_eq!(
            parse_metrics(half.as_bytes()),
            Err(Unusable::Failed(PollError::Garbage))
        );
        // Usage alone names no load.
        assert_eq!(
            parse_metrics(b"vllm:kv_cache_usage_perc 0.5\n"),
            Err(Unusable::Absent)
        );
    }

    #[test]
    fn too_many_engines_are_garbage() {
        let mut text = String::new();
        for engine in 0..=MAX_RANKS {
            text.push_str(&format!(
                "vllm:num_requests_running{{engine=\"{engine}\"}} 0\n"
            ));
        }
        assert_eq!(
            parse_metrics(text.as_bytes()),
            Err(Unusable::Failed(PollError::Garbage))
        );
        let entries: Vec<String> = (0..=MAX_RANKS)
            .map(|rank| format!("{{\"dp_rank\":{rank},\"num_reqs\":0}}"))
            .collect();
        let json = format!("[{}]", entries.join(","));
        assert_eq!(
            parse_get_load(json.as_bytes()),
            Err(Unusable::Failed(PollError::Garbage))
        );
    }

    #[test]
    fn get_load_shapes_of_sglang_and_vllm_router_are_read() {
        let sglang = br#"[{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 900,
            "num_pending_tokens": 10, "ts_tic": 12.5},
            {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 10}]"#;
        let loads = parse_get_load(sglang).unwrap();
        assert_eq!(loads.for_rank(Some(0)).unwrap().in_flight, 5);
        assert_eq!(loads.for_rank(Some(1)).unwrap().in_flight, 1);
        assert_eq!(loads.for_rank(None).unwrap().in_flight, 6);
        assert_eq!(loads.for_rank(Some(2)), Err(PollError::RankAbsent));
        assert_eq!(loads.for_rank(None).unwrap().kv_cache_usage, None);
        // Only vLLM's metrics give the queued part apart.
        assert_eq!(loads.for_rank(Some(0)).unwrap().waiting, None);
        let unranked = br#"[{"dp_rank": null, "num_reqs": 3, "num_waiting_reqs": 1}]"#;
        assert_eq!(load(parse_get_load(unranked), None).in_flight, 3);
        let one = br#" {"dp_rank": 2, "num_reqs": 4.0} "#;
        assert_eq!(load(parse_get_load(one), Some(2)).in_flight, 4);
        assert_eq!(load(parse_get_load(br#"{"load": 7}"#), None).in_flight, 7);
        // An empty list names no engine.
        assert_eq!(
            parse_get_load(b"[]").unwrap().for_rank(None),
            Err(PollError::RankAbsent)
        );
        // An object without load fields is not a load reply.
        assert_eq!(
            parse_get_load(br#"{"status": "ok"}"#),
            Err(Unusable::Absent)
        );
    }

    #[test]
    fn get_load_values_are_checked() {
        let cases: [(&[u8], Unusable); 12] = [
            (br#"{"load": -1}"#, PollError::InvalidValue.into()),
            (br#"{"load": 1.5}"#, PollError::InvalidValue.into()),
            (br#"{"load": 1e300}"#, PollError::Implausible.into()),
            (br#"{"load": 99999999999}"#, PollError::Implausible.into()),
            (
                br#"[{"num_reqs": 1}, {"num_reqs": -2}]"#,
                PollError::InvalidValue.into(),
            ),
            (
                br#"[{"num_reqs": 1}, {"other": 2}]"#,
                PollError::Garbage.into(),
            ),
            (br#"[{"num_reqs": "1"}]"#, PollError::Garbage.into()),
            (
                br#"[{"num_reqs": 1, "dp_rank": -1}]"#,
                PollError::Garbage.into(),
            ),
            (br#"[1, 2]"#, PollError::Garbage.into()),
            (br#"{"load": NaN}"#, PollError::Garbage.into()),
            (b"<html>not found</html>", PollError::Garbage.into()),
            (br#"[{"num_reqs": 1}"#, PollError::Garbage.into()),
        ];
        for (body, expected) in cases {
            assert_eq!(
                parse_get_load(body),
                Err(expected),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // The first error keeps its kind although the list goes on.
        let body = br#"[{"num_reqs": -1}, {"num_reqs": 1e400}]"#;
        assert_eq!(parse_get_load(body), Err(PollError::Garbage.into()));
        let body = br#"[{"num_reqs": -1}, {"num_reqs": 2}]"#;
        assert_eq!(parse_get_load(body), Err(PollError::InvalidValue.into()));
    }

    proptest! {
        /// Arbitrary bytes never panic either reader, and whatever they
        /// accept is within the bounds.
        #[test]
        fn arbitrary_input_never_panics(body in proptest::collection::vec(any::<u8>(), 0..512),
                                        rank in proptest::option::of(0u32..4)) {
            for source in LoadSource::ALL {
                if let Ok(loads) = source.parse(&body) {
                    prop_assert!(loads.len() <= MAX_RANKS);
                    if let Ok(report) = loads.for_rank(rank) {
                        prop_assert!(report.in_flight <= MAX_PLAUSIBLE_LOAD * MAX_RANKS as u64);
                    }
                }
            }
        }

        /// Texts made of the format's own pieces reach deep into the
        /// scanner: same property.
        #[test]
        fn format_like_input_never_panics(pieces in proptest::collection::vec(
            prop_oneof![
                Just("vllm:num_requests_running"), Just("vllm:num_requests_waiting"),
                Just("vllm:kv_cache_usage_perc"), Just("{"), Just("}"), Just("engine"),
                Just("="), Just("\""), Just("\\"), Just(","), Just(" "), Just("\n"),
                Just("#"), Just("1"), Just("-"), Just("."), Just("e9"), Just("NaN"),
                Just("Inf"), Just("["), Just("]"), Just(":"), Just("num_reqs"),
                Just("dp_rank"), Just("load"),
            ],
            0..64,
        ), rank in proptest::option::of(0u32..2)) {
            let text = pieces.concat();
            for source in LoadSource::ALL {
                if let Ok(loads) = source.parse(text.as_bytes())
                    && let Ok(report) = loads.for_rank(rank)
                {
                    prop_assert!(report.in_flight <= MAX_PLAUSIBLE_LOAD * MAX_RANKS as u64);
                }
            }
        }
    }
}
