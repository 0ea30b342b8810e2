//! Invariants of the engine model under random submissions, aborts and
//! clock advances: every request finishes exactly once (or was aborted),
//! tokens arrive in order, time never goes backwards, the batch limit holds,
//! and an idle engine holds no blocks.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use engine_sim::{Engine, EventKind, ModelConfig, SimRequest};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Submit {
        symbols: Vec<u8>,
        tail: u8,
        max_tokens: u32,
        after_ms: u64,
    },
    Abort {
        pick: usize,
    },
    Advance {
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (prop::collection::vec(0u8..3, 0..5), 0u8..20, 1u32..6, 0u64..20).prop_map(
            |(symbols, tail, max_tokens, after_ms)| Op::Submit { symbols, tail, max_tokens, after_ms }
        ),
        1 => (0usize..64).prop_map(|pick| Op::Abort { pick }),
        2 => (0u64..50).prop_map(|ms| Op::Advance { ms }),
    ]
}

fn prompt(symbols: &[u8], tail: u8) -> Vec<u32> {
    let mut tokens: Vec<u32> = symbols
        .iter()
        .flat_map(|&s| std::iter::repeat_n(u32::from(s), 16))
        .collect();
    tokens.extend((0..=u32::from(tail)).map(|i| 1000 + i));
    tokens
}

#[derive(Default)]
struct Tracker {
    live: Vec<u64>,
    expected_tokens: HashMap<u64, u32>,
    tokens_seen: HashMap<u64, u32>,
    finished: HashSet<u64>,
    aborted: HashSet<u64>,
    last_event: Duration,
}

impl Tracker {
    fn check(&mut self, engine: &mut Engine) -> Result<(), TestCaseError> {
        for event in engine.drain_events() {
            prop_assert!(event.at >= self.last_event, "time went backwards");
            self.last_event = event.at;
            prop_assert!(!self.aborted.contains(&event.id), "event after abort");
            match event.kind {
                EventKind::Token { index } => {
                    let seen = self.tokens_seen.entry(event.id).or_default();
                    prop_assert_eq!(index, *seen, "tokens in order");
                    *seen += 1;
                }
                EventKind::Finished(summary) => {
                    prop_assert!(self.finished.insert(event.id), "finished twice");
                    prop_assert_eq!(summary.completion_tokens, self.expected_tokens[&event.id]);
                    prop_assert_eq!(
                        self.tokens_seen.get(&event.id).copied(),
                        Some(summary.completion_tokens)
                    );
                    prop_assert!(summary.first_token_at >= summary.arrival);
                    prop_assert!(summary.finished_at >= summary.first_token_at);
                    prop_assert!(summary.cached_tokens < summary.prompt_tokens);
                    prop_assert_eq!(summary.cached_tokens % 16, 0);
                    self.live.retain(|&id| id != event.id);
                }
                other => prop_assert!(false, "unexpected event {:?}", other),
            }
        }
        let stats = engine.stats();
        prop_assert!(stats.running <= 3);
        prop_assert_eq!(stats.running + stats.waiting, self.live.len());
        // The simulator's polls read these two instead of a whole snapshot.
        prop_assert_eq!(engine.waiting(), stats.waiting);
        prop_assert_eq!(engine.in_flight(), self.live.len());
        prop_assert!(stats.prefix_cache_hits <= stats.prefix_cache_queries);
        prop_assert!(engine.cache().referenced_blocks() <= 24);
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn engine_keeps_its_invariants(ops in prop::collection::vec(op(), 1..60)) {
        let config = ModelConfig { num_blocks: 24, max_num_seqs: 3, ..ModelConfig::default() };
        let mut engine = Engine::new(config);
        let mut now = Duration::ZERO;
        let mut next_id = 0u64;
        let mut t = Tracker::default();
        for op in ops {
            match op {
                Op::Submit { symbols, tail, max_tokens, after_ms } => {
                    now += Duration::from_millis(after_ms);
                    let id = next_id;
                    next_id += 1;
                    let request = SimRequest::new(id, prompt(&symbols, tail), max_tokens);
                    if engine.submit(now, request).is_ok() {
                        t.live.push(id);
                        t.expected_tokens.insert(id, max_tokens);
                    }
                }
                Op::Abort { pick } => {
                    if !t.live.is_empty() {
                        let id = t.live.remove(pick % t.live.len());
                        prop_assert!(engine.abort(id));
                        t.aborted.insert(id);
                    }
                }
                Op::Advance { ms } => {
                    now += Duration::from_millis(ms);
                    engine.advance_to(now);
                }
            }
            t.check(&mut engine)?;
        }
        engine.advance_to(now + Duration::from_secs(3600));
        t.check(&mut engine)?;
        prop_assert!(t.live.is_empty(), "requests left: {:?}", t.live);
        prop_assert_eq!(engine.next_event_time(), None);
        prop_assert_eq!(engine.cache().referenced_blocks(), 0);
        prop_assert_eq!(t.finished.len() + t.aborted.len(), t.expected_tokens.len());
    }
}
