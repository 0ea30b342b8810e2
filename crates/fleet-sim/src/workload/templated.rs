//! The `templated` workload: chat sessions whose engine prompt is a chat
//! template's rendering, where routing on characters and routing on tokens
//! see different prefixes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use engine_sim::ModelConfig;
use engine_sim::prompt_tokens::testing::{self, TestTokenizerKind};
use engine_sim::prompt_tokens::{
    Clock, Error as PromptError, PromptTokenizer, TemplateFamily, TokenizerConfig, TokenizerOptions,
};
use radix_affinity::workload::SplitMix64;
use serde_json::{Value, json};

use super::{exponential, older_of_two, uniform};
use crate::trace::{ArrivalClock, PreparedTrace, Trace, TraceRequest};

/// Knobs of [`templated`].
#[derive(Clone, Debug, PartialEq)]
pub struct TemplatedConfig {
    /// Requests (turns) in the trace. Default 4,000.
    pub requests: usize,
    /// Mean arrival rate, requests per second (Poisson). Default 120,
    /// above what 8 engines of [`TEMPLATED_NUM_BLOCKS`] blocks sustain
    /// under round robin (about 70) and within what cache-aware routing
    /// sustains.
    pub rate: f64,
    /// Distinct system prompts. Default 8.
    pub system_prompts: usize,
    /// Words per system prompt (about 1.3 tokens each with the test
    /// tokenizer). Default 300.
    pub system_prompt_words: usize,
    /// Distinct tool sets (2-3 functions each) a session is given; 0: no
    /// tools. The template renders them into the system header; the
    /// message text a router extracts does not contain them. Default 8.
    pub tool_sets: usize,
    /// Sessions open at any time; a finished session is replaced by a new
    /// one. Default 96.
    pub active_sessions: usize,
    /// Turns per session, drawn uniformly from this inclusive range.
    /// Default 2..=6.
    pub turns: (u32, u32),
    /// A user message is exactly `k × block_size − 1` tokens long (one
    /// short of a block boundary), `k` uniform in this inclusive range.
    /// Default 1..=6.
    pub user_blocks: (u32, u32),
    /// The engines' KV block size in tokens. Default 16.
    pub block_size: usize,
    /// Answer length in tokens (`max_tokens`), uniform in this inclusive
    /// range; the next turn's history holds an answer of about this many
    /// tokens. Default 32..=128.
    pub output_tokens: (u32, u32),
    /// Model time at which the date changes (midnight UTC): requests from
    /// then on render the next day's date in the system header. `None`:
    /// half the expected span (`requests / rate / 2`).
    pub day_change_at: Option<Duration>,
    /// Seed of every draw. Default 1.
    pub seed: u64,
}

impl Default for TemplatedConfig {
    fn default() -> Self {
        TemplatedConfig {
            requests: 4_000,
            rate: 120.0,
            system_prompts: 8,
            system_prompt_words: 300,
            tool_sets: 8,
            active_sessions: 96,
            turns: (2, 6),
            user_blocks: (1, 6),
            block_size: 16,
            output_tokens: (32, 128),
            day_change_at: None,
            seed: 1,
        }
    }
}

impl TemplatedConfig {
    /// When the date changes, in model time.
    pub fn day_change(&self) -> Duration {
        self.day_change_at.unwrap_or_else(|| {
            if self.rate.is_finite() && self.rate > 0.0 {
                Duration::from_secs_f64(self.requests as f64 / self.rate / 2.0)
            } else {
                Duration::ZERO
            }
        })
    }
}

/// A `templated` trace with the model its engines serve.
#[derive(Debug)]
pub struct TemplatedWorkload {
    /// The requests: [`TraceRequest::chat`] holds each body,
    /// [`TraceRequest::prompt`] the router's `role: text` rendering.
    pub trace: Trace,
    /// The engines' tokenizer: prompt-tokens' Llama 3 template over a BPE
    /// tokenizer trained at start-up on a fixed corpus.
    pub tokenizer: Arc<PromptTokenizer>,
    /// The clock behind the template's `strftime_now`.
    pub clock: Arc<ArrivalClock>,
}

impl TemplatedWorkload {
    /// The trace tokenized as the engines do (each request rendered on its
    /// arrival date).
    pub fn prepare(&self, model: &ModelConfig) -> PreparedTrace {
        PreparedTrace::with_tokenizer(&self.trace, model, &self.tokenizer, Some(&self.clock))
    }
}

/// The KV capacity (blocks of 16 tokens) of the engines the `templated`
/// scenario runs on: 16,384 tokens, about seven of its prompts (2,300
/// tokens on average), so no engine holds every (tools, system prompt)
/// pair and where a session goes decides what it finds cached.
pub const TEMPLATED_NUM_BLOCKS: usize = 1_024;

/// Midnight UTC of 14 March 2025: the day the trace changes to.
const MIDNIGHT: i64 = 1_741_910_400;

/// The engines' model: prompt-tokens' Llama 3 chat template (its system
/// header prints "Today Date:" from `clock`) over a Llama 3-style
/// byte-level BPE tokenizer trained on prompt-tokens' fixed test corpus,
/// so every run builds the same vocabulary.
pub fn templated_tokenizer(clock: Arc<dyn Clock>) -> Result<PromptTokenizer, PromptError> {
    let family = TemplateFamily::Llama3;
    let json = testing::train_tokenizer_json(
        TestTokenizerKind::ByteLevelRegex,
        family.special_tokens(),
        family.bos_token(),
    )?;
    let mut config = TokenizerConfig {
        chat_template: Some(family.template().to_owned()),
        ..TokenizerConfig::default()
    };
    config.special.bos = family.bos_token().map(str::to_owned);
    config.special.eos = Some(family.eos_token().to_owned());
    let options = TokenizerOptions {
        clock,
        ..TokenizerOptions::default()
    };
    PromptTokenizer::from_parts(json.as_bytes(), config, options)
}

/// Words of prompt-tokens' training corpus (letters only), with their
/// token counts at the start of a message and after a space: the
/// tokenizer's regex splits text at spaces before letters, so a message's
/// token count is the sum of its words' counts.
struct Words {
    words: Vec<(&'static str, usize, usize)>,
}

impl Words {
    fn new(tokenizer: &PromptTokenizer) -> Result<Self, PromptError> {
        let mut seen = HashMap::new();
        for word in testing::CORPUS.split_whitespace() {
            if word.chars().all(|c| c.is_ascii_alphabetic()) && !seen.contains_key(word) {
                let first = tokenizer.text_tokens(word, false)?.len();
                let spaced = tokenizer.text_tokens(&format!(" {word}"), false)?.len();
                seen.insert(word, (first, spaced));
            }
        }
        let mut words: Vec<_> = seen.into_iter().map(|(w, (a, b))| (w, a, b)).collect();
        words.sort_unstable();
        Ok(Words { words })
    }

    /// Appends words to `out` until it holds exactly `tokens` tokens (or,
    /// if no word fits the last gap, just past it).
    fn fill(&self, rng: &mut SplitMix64, out: &mut String, tokens: usize) {
        let mut have = 0;
        while have < tokens {
            let gap = tokens - have;
            let cost = |&(_, first, spaced): &(&str, usize, usize)| {
                if out.is_empty() { first } else { spaced }
            };
            let fitting: Vec<_> = self.words.iter().filter(|w| cost(w) <= gap).collect();
            let pick = if fitting.is_empty() {
                &self.words[rng.below(self.words.len() as u64) as usize]
            } else {
                fitting[rng.below(fitting.len() as u64) as usize]
            };
            have += cost(pick);
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(pick.0);
        }
    }

    fn text(&self, rng: &mut SplitMix64, tokens: usize) -> String {
        let mut out = String::new();
        self.fill(rng, &mut out, tokens);
        out
    }
}

struct Session {
    id: u64,
    messages: Vec<Value>,
    tools: Option<usize>,
    turns_left: u32,
    /// Answer length of the previous turn (0 before the first).
    pending_answer: u32,
    last_turn: Duration,
}

/// The text router-http extracts from a chat for cache-aware routing on
/// characters: `role: text\n` per message.
fn routing_text(messages: &[Value]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str(m["role"].as_str().unwrap_or(""));
        out.push_str(": ");
        out.push_str(m["content"].as_str().unwrap_or(""));
        out.push('\n');
    }
    out
}

/// A multi-turn chat trace whose prompts the engines render through the
/// Llama 3 chat template, built so that character routing and token
/// routing see different prefixes:
///
/// - each session has one of `system_prompts` system prompts **and** one
///   of `tool_sets` tool sets; the template renders the tools (as indented
///   JSON) into the system header *before* the system prompt, so sessions
///   with the same system prompt and other tools share that prefix in the
///   router's text but only the header in the engine's tokens;
/// - the header prints "Today Date:", and the date changes at
///   [`TemplatedConfig::day_change`]: afterwards no engine holds any
///   prompt past the date, whatever the text says;
/// - user messages are one token short of a block boundary, so the last
///   block of a turn is often partial: engines reuse whole blocks only.
///
/// Arrivals and session scheduling are those of
/// [`multi_turn`](super::multi_turn). Session keys are `session-<id>`.
pub fn templated(config: &TemplatedConfig) -> Result<TemplatedWorkload, PromptError> {
    let day_change = Duration::from_secs(config.day_change().as_secs());
    let epoch = MIDNIGHT - i64::try_from(day_change.as_secs()).unwrap_or(0);
    let clock = Arc::new(ArrivalClock::new(epoch));
    let tokenizer = Arc::new(templated_tokenizer(clock.clone())?);
    let words = Words::new(&tokenizer)?;
    let mut rng = SplitMix64(config.seed ^ 0x7465_6D70_6C61_7465);
    let block = config.block_size.max(1);
    let systems: Vec<String> = (0..config.system_prompts.max(1))
        .map(|i| {
            let mut text = format!("You are assistant number {i}.");
            for _ in 0..config.system_prompt_words {
                text.push(' ');
                text.push_str(words.words[rng.below(words.words.len() as u64) as usize].0);
            }
            text
        })
        .collect();
    let tool_sets: Vec<Value> = (0..config.tool_sets)
        .map(|set| {
            let functions = 2 + rng.below(2) as usize;
            Value::Array(
                (0..functions)
                    .map(|f| {
                        json!({"type": "function", "function": {
                            "name": format!("tool_{set}_{f}"),
                            "description": words.text(&mut rng, 12),
                            "parameters": {"type": "object", "properties": {
                                "query": {"type": "string", "description": words.text(&mut rng, 8)},
                                "limit": {"type": "integer"}
                            }, "required": ["query"]}
                        }})
                    })
                    .collect(),
            )
        })
        .collect();
    let mut next_id = 0u64;
    let mut new_session = |rng: &mut SplitMix64, now: Duration| {
        let system = &systems[rng.below(systems.len() as u64) as usize];
        let tools = (!tool_sets.is_empty()).then(|| rng.below(tool_sets.len() as u64) as usize);
        next_id += 1;
        Session {
            id: next_id,
            messages: vec![json!({"role": "system", "content": system})],
            tools,
            turns_left: uniform(rng, config.turns).max(1),
            pending_answer: 0,
            last_turn: now,
        }
    };
    let active = config.active_sessions.max(1);
    let mut sessions: Vec<Session> = (0..active)
        .map(|_| new_session(&mut rng, Duration::ZERO))
        .collect();
    let mut now = Duration::ZERO;
    let mut requests = Vec::with_capacity(config.requests);
    for _ in 0..config.requests {
        now += exponential(&mut rng, config.rate);
        let slot = older_of_two(&mut rng, &sessions, |s| s.last_turn);
        let session = &mut sessions[slot];
        if session.pending_answer > 0 {
            let answer = words.text(&mut rng, session.pending_answer as usize);
            session
                .messages
                .push(json!({"role": "assistant", "content": answer}));
        }
        let user_tokens = uniform(&mut rng, config.user_blocks).max(1) as usize * block - 1;
        let user = words.text(&mut rng, user_tokens.max(1));
        session
            .messages
            .push(json!({"role": "user", "content": user}));
        let output_tokens = uniform(&mut rng, config.output_tokens).max(1);
        let mut body = json!({
            "model": "sim-model",
            "messages": session.messages,
            "max_tokens": output_tokens,
        });
        if let Some(set) = session.tools {
            body["tools"] = tool_sets[set].clone();
        }
        requests.push(TraceRequest {
            arrival: now,
            session: Some(format!("session-{}", session.id).into()),
            prompt: routing_text(&session.messages).into(),
            chat: Some(body.to_string().into()),
            output_tokens,
        });
        session.pending_answer = output_tokens;
        session.last_turn = now;
        session.turns_left -= 1;
        if session.turns_left == 0 {
            sessions[slot] = new_session(&mut rng, now);
        }
    }
    Ok(TemplatedWorkload {
        trace: Trace {
            name: "templated".to_owned(),
            requests,
        },
        tokenizer,
        clock,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine_sim::prompt_tokens::ChatRequest;

    fn small() -> TemplatedConfig {
        TemplatedConfig {
            requests: 120,
            rate: 20.0,
            active_sessions: 8,
            ..TemplatedConfig::default()
        }
    }

    #[test]
    fn user_messages_end_one_token_short_of_a_block() {
        let workload = templated(&small()).unwrap();
        let tokenizer = &workload.tokenizer;
        for request in &workload.trace.requests {
            let body: Value = serde_json::from_str(request.chat.as_deref().unwrap()).unwrap();
            let messages = body["messages"].as_array().unwrap();
            let last = messages.last().unwrap();
            assert_eq!(last["role"], "user");
            let text = last["content"].as_str().unwrap();
            let tokens = tokenizer.text_tokens(text, false).unwrap().len();
            assert_eq!(tokens % 16, 15, "{tokens} tokens: {text}");
            // The router's text holds every message but not the tools.
            assert_eq!(*request.prompt, routing_text(messages));
            assert!(!request.prompt.contains("tool_"));
        }
    }

    #[test]
    fn the_date_in_the_prompt_changes_at_the_day_boundary() {
        let config = small();
        let workload = templated(&config).unwrap();
        let change = config.day_change();
        let prepared = workload.prepare(&ModelConfig::default());
        let (mut before, mut after) = (0, 0);
        for (i, request) in workload.trace.requests.iter().enumerate() {
            workload.clock.set_arrival(request.arrival);
            let chat = ChatRequest::from_json(request.chat.as_deref().unwrap().as_bytes()).unwrap();
            let text = workload.tokenizer.chat_text(&chat).unwrap();
            let date = if request.arrival < change {
                before += 1;
                "Today Date: 13 Mar 2025"
            } else {
                after += 1;
                "Today Date: 14 Mar 2025"
            };
            assert!(text.contains(date), "request {i} at {:?}", request.arrival);
            // The prepared ids are the engine's: this rendering tokenized.
            assert_eq!(
                prepared.tokens(i),
                workload.tokenizer.chat_tokens(&chat).unwrap()
            );
            assert_eq!(request.chat.as_deref().unwrap().contains("tool_"), {
                text.contains("tool_")
            });
        }
        assert!(before > 20 && after > 20, "{before} before, {after} after");
    }

    #[test]
    fn same_seed_same_trace_and_ids() {
        let a = templated(&small()).unwrap();
        let b = templated(&small()).unwrap();
        assert_eq!(a.trace, b.trace);
        let model = ModelConfig::default();
        assert_eq!(a.prepare(&model).tokens, b.prepare(&model).tokens);
        let other = templated(&TemplatedConfig { seed: 2, ..small() }).unwrap();
        assert_ne!(other.trace, a.trace);
    }
}
