//! The latency model on the virtual clock, and the HTTP server's timing
//! under tokio's paused clock.

mod common;

use std::time::Duration;

use common::post;
use engine_sim::{
    Engine, EngineConfig, EventKind, ModelConfig, RequestSummary, ServeOptions, SimRequest, spawn,
};
use serde_json::json;

fn config(max_num_seqs: usize) -> ModelConfig {
    ModelConfig {
        max_num_seqs,
        ..ModelConfig::default()
    }
}

/// A prompt of `blocks` full blocks whose tokens are all `seed`.
fn prompt(seed: u32, tokens: usize) -> Vec<u32> {
    (0..tokens as u32).map(|i| seed * 1_000_000 + i).collect()
}

fn run(engine: &mut Engine, until: Duration) -> Vec<RequestSummary> {
    engine.advance_to(until);
    let mut done: Vec<_> = engine
        .drain_events()
        .filter_map(|e| match e.kind {
            EventKind::Finished(summary) => Some((e.id, *summary)),
            _ => None,
        })
        .collect();
    done.sort_by_key(|(id, _)| *id);
    done.into_iter().map(|(_, s)| s).collect()
}

fn prefill(c: &ModelConfig, uncached: u32) -> Duration {
    c.prefill_base + c.prefill_per_token * uncached
}

fn decode(c: &ModelConfig, batch: u32) -> Duration {
    c.decode_base + c.decode_per_seq * batch
}

#[test]
fn ttft_grows_with_queue_length_as_documented() {
    let c = config(1);
    let mut engine = Engine::new(c.clone());
    for id in 0..4u64 {
        let request = SimRequest::new(id, prompt(id as u32 + 1, 200), 5);
        engine.submit(Duration::ZERO, request).expect("submit");
    }
    assert_eq!(engine.stats().running, 1);
    assert_eq!(engine.stats().waiting, 3);
    let done = run(&mut engine, Duration::from_secs(10));
    // One at a time: each waits for everything ahead of it.
    let service = prefill(&c, 200) + decode(&c, 1) * 4;
    for (k, summary) in done.iter().enumerate() {
        assert_eq!(
            summary.ttft(),
            service * k as u32 + prefill(&c, 200),
            "request {k}"
        );
        assert_eq!(summary.e2e(), service * (k as u32 + 1));
    }
    assert!(done.windows(2).all(|w| w[0].ttft() < w[1].ttft()));
}

#[test]
fn ttft_grows_with_uncached_tokens_as_documented() {
    let c = config(8);
    for tokens in [16usize, 160, 1600] {
        let mut engine = Engine::new(c.clone());
        engine
            .submit(Duration::ZERO, SimRequest::new(1, prompt(7, tokens), 1))
            .expect("submit");
        let done = run(&mut engine, Duration::from_secs(1));
        assert_eq!(done[0].ttft(), prefill(&c, tokens as u32));
    }
    // A cached prefix is not recomputed: only the uncached tail costs.
    let mut engine = Engine::new(c.clone());
    let long = prompt(3, 1600);
    engine
        .submit(Duration::ZERO, SimRequest::new(1, long.clone(), 1))
        .expect("submit");
    run(&mut engine, Duration::from_secs(1));
    let mut extended = long.clone();
    extended.extend(prompt(4, 40));
    engine
        .submit(Duration::from_secs(1), SimRequest::new(2, extended, 1))
        .expect("submit");
    let done = run(&mut engine, Duration::from_secs(2));
    assert_eq!(done[0].cached_tokens, 1600);
    assert_eq!(done[0].ttft(), prefill(&c, 40));
}

#[test]
fn requests_admitted_together_share_a_step_and_decode_slows_with_batch() {
    let c = config(16);
    let mut engine = Engine::new(c.clone());
    for id in 0..3u64 {
        engine
            .submit(
                Duration::ZERO,
                SimRequest::new(id, prompt(id as u32 + 10, 100), 4),
            )
            .expect("submit");
    }
    let done = run(&mut engine, Duration::from_secs(1));
    // Request 0 found the engine idle and started a step alone; 1 and 2
    // are admitted together in the next step, which also decodes 0.
    let t1 = prefill(&c, 100);
    assert_eq!(done[0].ttft(), t1);
    let second_step = prefill(&c, 200) + decode(&c, 1);
    assert_eq!(done[1].ttft(), t1 + second_step);
    assert_eq!(done[2].ttft(), t1 + second_step);
    // Then two steps with a batch of 3 (0 finishes) and one with 2.
    assert_eq!(done[0].e2e(), t1 + second_step + decode(&c, 3) * 2);
    assert_eq!(
        done[1].e2e(),
        t1 + second_step + decode(&c, 3) * 2 + decode(&c, 2)
    );
    assert!(decode(&c, 3) > decode(&c, 1));
}

#[test]
fn the_model_is_deterministic() {
    let run_once = || {
        let mut engine = Engine::new(config(2));
        for id in 0..6u64 {
            let at = Duration::from_millis(id * 3);
            engine
                .submit(
                    at,
                    SimRequest::new(id, prompt((id % 2) as u32, 64 + id as usize * 10), 3),
                )
                .expect("submit");
        }
        engine.advance_to(Duration::from_secs(5));
        engine.drain_events().collect::<Vec<_>>()
    };
    assert_eq!(run_once(), run_once());
}

#[tokio::test(start_paused = true)]
async fn http_latency_follows_the_model_in_tokio_time() {
    for scale in [1.0, 0.5] {
        let config = EngineConfig {
            time_scale: scale,
            ..EngineConfig::default()
        };
        let model = config.model.clone();
        let engine = spawn(config, ServeOptions::default()).await.expect("spawn");
        let text = "x".repeat(4 * 400); // 400 tokens
        let start = tokio::time::Instant::now();
        let reply = post(
            engine.addr(),
            "/v1/completions",
            &json!({"prompt": text, "max_tokens": 10}),
        )
        .await;
        let elapsed = start.elapsed();
        assert_eq!(reply.status, 200);
        let modelled = (prefill(&model, 400) + decode(&model, 1) * 9).mul_f64(scale);
        assert!(elapsed >= modelled, "{elapsed:?} < {modelled:?}");
        // Timers fire on millisecond ticks: at most one tick per step late.
        assert!(
            elapsed <= modelled + Duration::from_millis(11),
            "{elapsed:?} vs {modelled:?}"
        );
        engine.shutdown().await;
    }
}
