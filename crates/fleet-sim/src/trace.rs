//! Request traces: what arrives when, and the JSONL loader for replaying a
//! user's own traffic.
//!
//! # The JSONL format
//!
//! One JSON object per line (blank lines are skipped):
//!
//! ```text
//! {"timestamp": 0.0,  "session": "alice", "prompt": "You are ... Hi!", "output_tokens": 64}
//! {"timestamp": 0.35, "session": "bob",   "prompt_tokens": 1800,        "output_tokens": 128}
//! ```
//!
//! - `timestamp`: arrival in seconds (any origin; the earliest becomes 0).
//!   Lines need not be sorted: requests are replayed in timestamp order,
//!   ties in file order.
//! - `session` (optional, string or integer): the session key consistent
//!   hashing places by.
//! - `prompt` (the routing text) **or** `prompt_tokens` (a count). A count
//!   is turned into a synthetic text of `prompt_tokens × chars_per_token`
//!   characters drawn from a stream seeded by the session, so requests of
//!   one session share their leading text (a growing conversation shares
//!   its prefix) and requests without a session share nothing.
//! - `output_tokens`: tokens to generate, at least 1.
//!
//! Any other field is ignored. A bad line is an error naming its line
//! number.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use engine_sim::ModelConfig;
use engine_sim::prompt_tokens::{ChatRequest, Clock, PromptTokenizer};
use engine_sim::tokens::block_hashes;
use radix_affinity::workload::SplitMix64;
use serde_json::Value;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    /// Arrival time from the start of the trace.
    pub arrival: Duration,
    /// Session key (consistent hashing places by it), if any.
    pub session: Option<Arc<str>>,
    /// The routing text: what cache-aware routing on text matches. Without
    /// [`chat`](Self::chat) it is also the prompt the engine computes.
    pub prompt: Arc<str>,
    /// A chat request's JSON body (`/v1/chat/completions`), when the
    /// engine renders the prompt from messages through its chat template:
    /// the engine's prompt ids are its tokenizer's `chat_tokens` of this
    /// body, and [`prompt`](Self::prompt) is the text a router extracts
    /// from the same messages.
    pub chat: Option<Arc<str>>,
    /// Output tokens to generate (at least 1).
    pub output_tokens: u32,
}

/// A named list of requests in arrival order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    /// The workload's name (`multi_turn`, `radix`, a file name, ...).
    pub name: String,
    /// Requests, sorted by arrival.
    pub requests: Vec<TraceRequest>,
}

impl Trace {
    /// Total prompt characters (Unicode scalar values).
    pub fn prompt_chars(&self) -> usize {
        self.requests.iter().map(|r| r.prompt.chars().count()).sum()
    }

    /// Arrival time of the last request.
    pub fn span(&self) -> Duration {
        self.requests.last().map_or(Duration::ZERO, |r| r.arrival)
    }
}

/// A trace tokenized once for an engine model, shared by every policy run.
#[derive(Debug)]
pub struct PreparedTrace {
    /// The trace.
    pub trace: Trace,
    /// Token ids of each request's prompt, as the engines compute them
    /// (empty for a chat body the engines' tokenizer refuses: the engine
    /// answers 400 and the run counts the request as rejected).
    pub(crate) tokens: Vec<Vec<u32>>,
    /// The prefix-cache block hashes of each prompt (for routing loss).
    pub(crate) hashes: Vec<Vec<u64>>,
}

impl PreparedTrace {
    /// Tokenizes every prompt with the engine model's synthetic rule
    /// (`chars_per_token`): text prompts as they are, chat bodies through
    /// the synthetic chat rendering — what an engine without a model
    /// tokenizer computes.
    pub fn new(trace: &Trace, model: &ModelConfig) -> Self {
        let synthetic = PromptTokenizer::synthetic(model.chars_per_token);
        Self::with_tokenizer(trace, model, &synthetic, None)
    }

    /// Tokenizes every prompt with `tokenizer`, the engines' model
    /// tokenizer: chat bodies through its chat template
    /// ([`PromptTokenizer::chat_tokens`]), text prompts as a completion
    /// without special tokens. With `clock`, the clock is set to each
    /// request's arrival before its prompt is rendered, so a template that
    /// prints today's date (`strftime_now`) prints the date the request
    /// arrives on; build `tokenizer` with the same clock.
    pub fn with_tokenizer(
        trace: &Trace,
        model: &ModelConfig,
        tokenizer: &PromptTokenizer,
        clock: Option<&ArrivalClock>,
    ) -> Self {
        let tokens: Vec<Vec<u32>> = trace
            .requests
            .iter()
            .map(|r| {
                if let Some(clock) = clock {
                    clock.set_arrival(r.arrival);
                }
                let ids = match &r.chat {
                    Some(body) => ChatRequest::from_json(body.as_bytes())
                        .and_then(|request| tokenizer.chat_tokens(&request)),
                    None => tokenizer.text_tokens(&r.prompt, false),
                };
                ids.unwrap_or_default()
            })
            .collect();
        let hashes = tokens
            .iter()
            .map(|t| block_hashes(t, model.block_size))
            .collect();
        PreparedTrace {
            trace: trace.clone(),
            tokens,
            hashes,
        }
    }

    /// The prompt token ids of request `index` (empty if out of range).
    pub fn tokens(&self, index: usize) -> &[u32] {
        self.tokens.get(index).map_or(&[], Vec::as_slice)
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.trace.requests.len()
    }

    /// Whether the trace has no requests.
    pub fn is_empty(&self) -> bool {
        self.trace.requests.is_empty()
    }

    /// Prompt tokens of request `index`.
    pub fn prompt_tokens(&self, index: usize) -> usize {
        self.tokens.get(index).map_or(0, Vec::len)
    }
}

/// A [`Clock`] for chat templates that reads the simulation's model time:
/// `epoch` (Unix seconds at model time 0) plus the arrival of the request
/// being rendered, which [`PreparedTrace::with_tokenizer`] sets before
/// each rendering. Deterministic: no wall clock.
#[derive(Debug)]
pub struct ArrivalClock {
    epoch: i64,
    arrival_ms: AtomicU64,
}

impl ArrivalClock {
    /// A clock reading `epoch` (Unix seconds) at model time 0.
    pub fn new(epoch: i64) -> Self {
        ArrivalClock {
            epoch,
            arrival_ms: AtomicU64::new(0),
        }
    }

    /// Moves the clock to model time `arrival`.
    pub fn set_arrival(&self, arrival: Duration) {
        let ms = u64::try_from(arrival.as_millis()).unwrap_or(u64::MAX);
        self.arrival_ms.store(ms, Ordering::Relaxed);
    }

    /// Unix seconds at model time 0.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }
}

impl Clock for ArrivalClock {
    fn now_unix_seconds(&self) -> i64 {
        let seconds = self.arrival_ms.load(Ordering::Relaxed) / 1000;
        self.epoch
            .saturating_add(i64::try_from(seconds).unwrap_or(i64::MAX))
    }
}

/// Why a trace could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read trace file {path}: {source}")]
    Io {
        /// The path given.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A line is not a valid request.
    #[error("trace line {line}: {reason}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The trace holds no request.
    #[error("the trace holds no request")]
    Empty,
}

/// Largest `prompt_tokens` or `output_tokens` a line may ask for.
const MAX_TOKENS: u64 = 1 << 20;

/// Reads a JSONL trace file (see the [module docs](self)). The trace is
/// named after the file stem.
pub fn load_jsonl(path: &Path, chars_per_token: usize) -> Result<Trace, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let mut trace = parse_jsonl(&text, chars_per_token)?;
    if let Some(stem) = path.file_stem() {
        trace.name = stem.to_string_lossy().into_owned();
    }
    Ok(trace)
}

/// Parses JSONL trace text (see the [module docs](self)). The trace is
/// named `trace`.
pub fn parse_jsonl(text: &str, chars_per_token: usize) -> Result<Trace, TraceError> {
    let mut parsed: Vec<(f64, usize, TraceRequest)> = Vec::new();
    let mut synth = Synthesizer::default();
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| TraceError::Line { line, reason };
        let value: Value =
            serde_json::from_str(raw).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let Some(object) = value.as_object() else {
            return Err(bad("expected a JSON object".to_owned()));
        };
        let timestamp = match object.get("timestamp") {
            Some(Value::Number(n)) => n.as_f64().unwrap_or(f64::NAN),
            Some(_) => return Err(bad("`timestamp` must be a number of seconds".to_owned())),
            None => return Err(bad("missing `timestamp` (seconds)".to_owned())),
        };
        if !(0.0..=1e9).contains(&timestamp) {
            return Err(bad(format!(
                "`timestamp` must be a finite number of seconds in 0..=1e9, got {timestamp}"
            )));
        }
        let session: Option<Arc<str>> = match object.get("session") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if !s.is_empty() => Some(s.as_str().into()),
            Some(Value::Number(n)) => Some(n.to_string().into()),
            Some(_) => {
                return Err(bad(
                    "`session` must be a non-empty string or an integer".to_owned()
                ));
            }
        };
        let output_tokens = match object.get("output_tokens") {
            Some(v) => positive_count(v).ok_or_else(|| {
                bad(format!(
                    "`output_tokens` must be an integer in 1..={MAX_TOKENS}, got {v}"
                ))
            })?,
            None => return Err(bad("missing `output_tokens`".to_owned())),
        };
        let prompt: Arc<str> = match (object.get("prompt"), object.get("prompt_tokens")) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "give either `prompt` or `prompt_tokens`, not both".to_owned()
                ));
            }
            (Some(Value::String(s)), None) if !s.is_empty() => s.as_str().into(),
            (Some(_), None) => return Err(bad("`prompt` must be a non-empty string".to_owned())),
            (None, Some(v)) => {
                let tokens = positive_count(v).ok_or_else(|| {
                    bad(format!(
                        "`prompt_tokens` must be an integer in 1..={MAX_TOKENS}, got {v}"
                    ))
                })?;
                let chars = tokens as usize * chars_per_token.max(1);
                synth.text(session.as_deref(), line, chars).into()
            }
            (None, None) => return Err(bad("missing `prompt` or `prompt_tokens`".to_owned())),
        };
        parsed.push((
            timestamp,
            line,
            TraceRequest {
                arrival: Duration::ZERO,
                session,
                prompt,
                chat: None,
                output_tokens,
            },
        ));
    }
    if parsed.is_empty() {
        return Err(TraceError::Empty);
    }
    // Stable: equal timestamps keep file order.
    parsed.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let origin = parsed[0].0;
    let requests = parsed
        .into_iter()
        .map(|(timestamp, _, mut request)| {
            request.arrival = Duration::from_secs_f64(timestamp - origin);
            request
        })
        .collect();
    Ok(Trace {
        name: "trace".to_owned(),
        requests,
    })
}

fn positive_count(value: &Value) -> Option<u32> {
    value
        .as_u64()
        .filter(|n| (1..=MAX_TOKENS).contains(n))
        .and_then(|n| u32::try_from(n).ok())
}

/// Synthetic prompt text for lines that give only a token count: one
/// character stream per session, so a session's prompts share a prefix.
#[derive(Default)]
struct Synthesizer {
    streams: HashMap<Arc<str>, (SplitMix64, String)>,
}

impl Synthesizer {
    fn text(&mut self, session: Option<&str>, line: usize, chars: usize) -> String {
        match session {
            Some(key) => {
                let entry = self
                    .streams
                    .entry(key.into())
                    .or_insert_with(|| (SplitMix64(seed_of(key.as_bytes())), String::new()));
                let (rng, text) = entry;
                while text.len() < chars {
                    text.push(char_from(rng));
                }
                text[..chars].to_owned()
            }
            None => {
                let mut rng = SplitMix64(seed_of(&line.to_le_bytes()) ^ 0xA5A5_A5A5);
                (0..chars).map(|_| char_from(&mut rng)).collect()
            }
        }
    }
}

/// FNV-1a of `bytes`, a stable per-key seed.
fn seed_of(bytes: &[u8]) -> u64 {
    radix_affinity::workload::fnv1a(radix_affinity::workload::FNV_OFFSET, bytes)
}

/// One character of synthetic text: lower-case letters and spaces (ASCII,
/// so byte length equals character count).
pub(crate) fn char_from(rng: &mut SplitMix64) -> char {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz .,eao";
    ALPHABET[rng.below(ALPHABET.len() as u64) as usize] as char
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_share_synthetic_prefixes() {
        let text = r#"{"timestamp": 1.5, "session": "a", "prompt_tokens": 10, "output_tokens": 4}
{"timestamp": 1.0, "session": "a", "prompt_tokens": 20, "output_tokens": 4}
{"timestamp": 2.0, "prompt_tokens": 10, "output_tokens": 4}"#;
        let trace = parse_jsonl(text, 4).unwrap();
        assert_eq!(trace.requests.len(), 3);
        let [first, second, third] = &trace.requests[..] else {
            panic!("three requests");
        };
        assert_eq!(first.arrival, Duration::ZERO);
        assert_eq!(second.arrival, Duration::from_millis(500));
        assert_eq!(first.prompt.len(), 80);
        assert_eq!(second.prompt.len(), 40);
        assert!(first.prompt.starts_with(&*second.prompt));
        assert!(!third.prompt.starts_with(&second.prompt[..8]));
    }
}
