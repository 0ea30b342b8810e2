//! The simulator's built-in workloads, generated deterministically from a
//! seed.
//!
//! All are open-loop: arrival times are fixed by the trace (a Poisson
//! process at `rate` requests per second), not by how fast earlier answers
//! come back, so a policy that serves faster shows a higher throughput once
//! the rate exceeds what a weaker policy can serve.

use std::sync::Arc;
use std::time::Duration;

use radix_affinity::workload::{SplitMix64, Variant, Workload};

use super::trace::{Trace, TraceRequest, char_from};

mod templated;

pub use templated::{
    TEMPLATED_NUM_BLOCKS, TemplatedConfig, TemplatedWorkload, templated, templated_tokenizer,
};

/// Knobs of [`multi_turn`]. Token counts assume the engine model's default
/// 4 characters per token.
#[derive(Clone, Debug, PartialEq)]
pub struct MultiTurnConfig {
    /// Requests (turns) in the trace. Default 8,000.
    pub requests: usize,
    /// Mean arrival rate, requests per second (Poisson). Default 240, just
    /// above what 8 default engine models sustain under round robin.
    pub rate: f64,
    /// Distinct system prompts shared by the sessions. Default 8.
    pub system_prompts: usize,
    /// Length of each system prompt in tokens. Default 1,024.
    pub system_prompt_tokens: usize,
    /// Sessions open at any time; a finished session is replaced by a new
    /// one. Default 96.
    pub active_sessions: usize,
    /// Turns per session, drawn uniformly from this inclusive range.
    /// Default 3..=10.
    pub turns: (u32, u32),
    /// User message length in tokens, uniform in this inclusive range.
    /// Default 40..=200.
    pub user_tokens: (u32, u32),
    /// Answer length in tokens (`max_tokens`), uniform in this inclusive
    /// range. The next turn's history contains an answer of this length.
    /// Default 32..=160.
    pub output_tokens: (u32, u32),
    /// Seed of every draw. Default 1.
    pub seed: u64,
}

impl Default for MultiTurnConfig {
    fn default() -> Self {
        MultiTurnConfig {
            requests: 8_000,
            rate: 240.0,
            system_prompts: 8,
            system_prompt_tokens: 1_024,
            active_sessions: 96,
            turns: (3, 10),
            user_tokens: (40, 200),
            output_tokens: (32, 160),
            seed: 1,
        }
    }
}

/// Characters per token the generators assume (the engine model's default).
const CHARS_PER_TOKEN: usize = 4;

struct Session {
    id: u64,
    history: String,
    turns_left: u32,
    /// Answer length of the previous turn, appended before the next user
    /// message (0 before the first turn).
    pending_answer: u32,
    last_turn: Duration,
}

/// A multi-turn chat trace: `active_sessions` sessions, each opened with
/// one of `system_prompts` long system prompts (uniformly), each turn's
/// prompt being the whole history so far (system prompt, every earlier user
/// message and answer) plus a new user message.
///
/// Each arrival goes to the less recently served of two sessions drawn at
/// random, so a session's turns are spread out (as a person reading the
/// answer would space them) without any periodic pattern a round-robin
/// router could lock onto. Session keys are `session-<id>`.
pub fn multi_turn(config: &MultiTurnConfig) -> Trace {
    let mut rng = SplitMix64(config.seed ^ 0x6D75_6C74_695F_7475);
    let system_prompts: Vec<String> = (0..config.system_prompts.max(1))
        .map(|i| {
            let mut text = format!("<|system|> You are assistant number {i}. ");
            let chars = config.system_prompt_tokens * CHARS_PER_TOKEN;
            while text.len() < chars {
                text.push(char_from(&mut rng));
            }
            text
        })
        .collect();
    let mut next_id = 0u64;
    let mut new_session = |rng: &mut SplitMix64, now: Duration| {
        let prompt = &system_prompts[rng.below(system_prompts.len() as u64) as usize];
        next_id += 1;
        Session {
            id: next_id,
            history: prompt.clone(),
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
            session.history.push_str("\n<|assistant|> ");
            push_text(&mut rng, &mut session.history, session.pending_answer);
        }
        session.history.push_str("\n<|user|> ");
        let user = uniform(&mut rng, config.user_tokens);
        push_text(&mut rng, &mut session.history, user);
        let output_tokens = uniform(&mut rng, config.output_tokens).max(1);
        requests.push(TraceRequest {
            arrival: now,
            session: Some(format!("session-{}", session.id).into()),
            prompt: Arc::from(session.history.as_str()),
            chat: None,
            output_tokens,
        });
        session.pending_answer = output_tokens;
        session.last_turn = now;
        session.turns_left -= 1;
        if session.turns_left == 0 {
            sessions[slot] = new_session(&mut rng, now);
        }
    }
    Trace {
        name: "multi_turn".to_owned(),
        requests,
    }
}

/// Knobs of [`radix`].
#[derive(Clone, Debug, PartialEq)]
pub struct RadixConfig {
    /// Requests: the first this many of set W (at most 20,000). Default
    /// 8,000.
    pub requests: usize,
    /// Mean arrival rate, requests per second (Poisson). Default 380, just
    /// above what 8 default engine models sustain under round robin.
    pub rate: f64,
    /// Answer length in tokens, uniform in this inclusive range. Default
    /// 16..=128.
    pub output_tokens: (u32, u32),
    /// Seed of the arrival times and answer lengths (the texts are fixed by
    /// the workload specification). Default 1.
    pub seed: u64,
}

impl Default for RadixConfig {
    fn default() -> Self {
        RadixConfig {
            requests: 8_000,
            rate: 380.0,
            output_tokens: (16, 128),
            seed: 1,
        }
    }
}

/// The radix-affinity benchmark workload (`shared/workloads/radix-affinity.md`,
/// ASCII variant) as independent requests: the first `requests` texts of its
/// warm set W — 256 system prompts of 2,000 characters drawn by Zipf(1.1),
/// each with a 50-1,000 character suffix, ~10% extending an earlier
/// request — with no session key. Generating W takes a moment (20,000
/// texts, ~52 MB), whatever `requests` is.
pub fn radix(config: &RadixConfig) -> Trace {
    let workload = Workload::new(Variant::Ascii);
    let mut rng = SplitMix64(config.seed ^ 0x7261_6469_785F_7769);
    let mut now = Duration::ZERO;
    let requests = workload
        .warm
        .iter()
        .take(config.requests)
        .map(|r| {
            now += exponential(&mut rng, config.rate);
            TraceRequest {
                arrival: now,
                session: None,
                prompt: Arc::from(r.text.as_str()),
                chat: None,
                output_tokens: uniform(&mut rng, config.output_tokens).max(1),
            }
        })
        .collect();
    Trace {
        name: "radix".to_owned(),
        requests,
    }
}

/// Uniform in the inclusive range (a reversed range counts as its low end).
/// The session that takes the next turn: of two drawn at random, the one
/// whose last turn is older (so no session waits for long, and turns still
/// arrive in no fixed order).
fn older_of_two<S>(
    rng: &mut SplitMix64,
    sessions: &[S],
    last_turn: impl Fn(&S) -> Duration,
) -> usize {
    let active = sessions.len() as u64;
    let a = rng.below(active) as usize;
    let b = rng.below(active) as usize;
    if last_turn(&sessions[b]) < last_turn(&sessions[a]) {
        b
    } else {
        a
    }
}

fn uniform(rng: &mut SplitMix64, (low, high): (u32, u32)) -> u32 {
    if high <= low {
        return low;
    }
    low + rng.below(u64::from(high - low) + 1) as u32
}

/// An exponential inter-arrival gap with mean `1 / rate` seconds.
fn exponential(rng: &mut SplitMix64, rate: f64) -> Duration {
    if !(rate.is_finite() && rate > 0.0) {
        return Duration::ZERO;
    }
    // 53 random bits in (0, 1]: never ln(0).
    let u = ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
    Duration::from_secs_f64(-u.ln() / rate)
}

fn push_text(rng: &mut SplitMix64, out: &mut String, tokens: u32) {
    let chars = tokens as usize * CHARS_PER_TOKEN;
    out.reserve(chars);
    for _ in 0..chars {
        out.push(char_from(rng));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_extend_their_session_history() {
        let trace = multi_turn(&MultiTurnConfig {
            requests: 400,
            rate: 30.0,
            active_sessions: 8,
            ..MultiTurnConfig::default()
        });
        assert_eq!(trace.requests.len(), 400);
        assert!(
            trace
                .requests
                .windows(2)
                .all(|w| w[0].arrival <= w[1].arrival)
        );
        let mut last: std::collections::HashMap<&str, &str> = Default::default();
        let mut continued = 0;
        for r in &trace.requests {
            let key = r.session.as_deref().unwrap();
            if let Some(previous) = last.insert(key, &r.prompt) {
                assert!(r.prompt.starts_with(previous), "a turn extends its history");
                assert!(r.prompt.len() > previous.len());
                continued += 1;
            }
        }
        assert!(
            continued > 300,
            "most requests continue a session: {continued}"
        );
        // Mean rate close to the configured one.
        let rate = 400.0 / trace.span().as_secs_f64();
        assert!((20.0..45.0).contains(&rate), "rate {rate}");
    }

    #[test]
    fn same_seed_same_trace_other_seed_other_trace() {
        let config = MultiTurnConfig {
            requests: 50,
            ..MultiTurnConfig::default()
        };
        assert_eq!(multi_turn(&config), multi_turn(&config));
        let other = MultiTurnConfig { seed: 2, ..config };
        assert_ne!(multi_turn(&other), multi_turn(&config));
    }
}
