//! Several router replicas over the same engines (docs/operations.md,
//! "Several router replicas"): 3 `kv_aware` replicas following the KV
//! events of 4 engine-sim engines, with sessions' turns dealt to the
//! replicas in turn, as a plain load balancer deals them.
//!
//! The workload is the one where a replica that sees only its own requests
//! goes wrong: every session shares one system prompt and starts on the one
//! engine holding it, so each session's history (a long document of its
//! own) is cached on that engine alone. Then all sessions talk at once.
//! `kv_aware` moves a session off its engine only when that engine's load
//! outweighs the prefill the move costs. With engine-reported load every
//! replica weighs the engine's whole load and the sessions spread; without
//! it each replica weighs its own third, and they stay piled on the first
//! engine.
//!
//! The measure is the load spread: every engine's in-flight requests
//! (running + waiting, the counts the replicas poll) sampled every 5 ms
//! and averaged over the time the sessions talk, the busiest engine's
//! average over the mean engine's. 1 is an even spread; 4 (the number of
//! engines) means one engine had every request. The bound is
//! docs/operations.md's.
//!
//! Real time, real sockets (engine-sim's latency model at time scale 1),
//! one process. Every wait is bounded.
#![cfg(all(feature = "kv-events", feature = "tokens"))]

mod common;

use common::{Fixture, call};
use engine_sim::{EngineConfig, EngineHandle, ModelConfig};
use http::StatusCode;
use lb_policies::PolicyConfig;
use prompt_tokens::PromptTokenizer;
use router_http::tokens::Tokenizers;
use router_http::{BackgroundTasks, LoadPollConfig, RouterConfig};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Router replicas.
const REPLICAS: usize = 3;
/// Engines behind them.
const ENGINES: usize = 4;
/// Sessions, all talking at once in the measured part.
const SESSIONS: usize = 36;
/// Turns of each session in the measured part (after its first).
const TURNS: usize = 15;
/// Output tokens of a measured turn: 8 decode steps of about 20 ms.
const MAX_TOKENS: usize = 8;
/// Session `s` starts `s` times this after the first: the sessions come in
/// over about one turn's time rather than in one burst.
const STAGGER: Duration = Duration::from_millis(5);
/// The bound docs/operations.md states ("Several router replicas"): with
/// engine-reported load the busiest engine's time-averaged in-flight count
/// stays within this multiple of the mean engine's; without it, it does
/// not.
const SPREAD_BOUND: f64 = 2.0;

/// The engines' model: real time, each decode step long enough that a
/// turn stays in flight for about 200 ms.
fn engine_config() -> EngineConfig {
    EngineConfig {
        model: ModelConfig {
            decode_base: Duration::from_millis(20),
            ..ModelConfig::default()
        },
        ..EngineConfig::default()
    }
}

/// A replica's configuration: `kv_aware` on engine-sim's synthetic token
/// ids, following every engine's KV events, polling the engines' load every
/// 50 ms (the default) or not at all.
fn config(engines: &[EngineHandle], poll: bool) -> RouterConfig {
    let chars_per_token = ModelConfig::default().chars_per_token;
    RouterConfig {
        policy: PolicyConfig::named("kv_aware"),
        tokenizers: Tokenizers::default()
            .with_default(Arc::new(PromptTokenizer::synthetic(chars_per_token))),
        kv_events: common::kv_events_config(engines),
        load_poll: if poll {
            LoadPollConfig::default()
        } else {
            LoadPollConfig::off()
        },
        ..RouterConfig::default()
    }
}

/// The body of session `session`'s turn `turn`: the shared system prompt
/// (8 full KV blocks of engine-sim's synthetic tokens, rendered), the
/// session's document (11 or 12 blocks of its own), its earlier turns (a
/// block more every second turn), a new question.
fn turn_body(session: usize, turn: usize, max_tokens: usize) -> String {
    let system = "You answer questions about the fleet's logbooks. ".repeat(10);
    let document =
        format!("Logbook {session}: ship {session} sailed on day {session}. ").repeat(20);
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": system}),
        serde_json::json!({"role": "user", "content": document}),
        serde_json::json!({"role": "assistant", "content": "Read."}),
    ];
    for t in 0..turn {
        messages.push(serde_json::json!({"role": "user", "content": format!("Entry {t}?")}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Logged {t}.")}));
    }
    messages.push(serde_json::json!({"role": "user", "content": format!("Entry {turn}?")}));
    serde_json::json!({"model": "sim-model", "messages": messages, "max_tokens": max_tokens})
        .to_string()
}

/// Sends one turn through `replica`; returns the engine id that served it.
async fn send(replica: &Fixture, body: String) -> String {
    let (status, headers, bytes) =
        call(replica.addr, "POST", "/v1/chat/completions", &[], body).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    headers["x-worker-id"].to_str().unwrap().to_owned()
}

/// Waits (bounded) until every replica's block index holds every block the
/// engines hold: the engines' events are asynchronous.
async fn wait_for_events(replicas: &[(Fixture, BackgroundTasks)], engines: &[EngineHandle]) {
    let held: u64 = engines
        .iter()
        .map(|e| e.cached_block_hashes().len() as u64)
        .sum();
    let deadline = Instant::now() + Duration::from_secs(20);
    for (replica, _) in replicas {
        let hub = replica.router.kv_events().expect("kv_aware has a hub");
        while hub.index().counters().stored_blocks < held {
            assert!(
                Instant::now() < deadline,
                "a replica applied {} of {held} blocks",
                hub.index().counters().stored_blocks
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// The engines' in-flight requests (running + waiting, what vLLM reports
/// and the replicas poll), integrated over time, and their prefix cache
/// hit rate, over the part where every session talks.
struct Spread {
    /// Per engine: the integral of its in-flight count, in request-seconds.
    area: Vec<f64>,
    /// The largest in-flight count any engine had at a sample.
    peak: usize,
    samples: usize,
    seconds: f64,
    /// Prompt tokens found in the engines' prefix caches over prompt
    /// tokens looked up.
    hit_rate: f64,
}

impl Spread {
    /// The busiest engine's time-averaged in-flight count over the mean
    /// engine's: 1 when the fleet's load was spread evenly, 4 (the number
    /// of engines) when one engine had all of it.
    fn ratio(&self) -> f64 {
        let mean = self.area.iter().sum::<f64>() / self.area.len() as f64;
        self.area.iter().copied().fold(0.0, f64::max) / mean
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let averages: Vec<String> = self
            .area
            .iter()
            .map(|a| format!("{:.2}", a / self.seconds))
            .collect();
        write!(
            f,
            "max/mean {:.2}: time-averaged in-flight per engine [{}], peak {}, {} samples over {:.2} s, prefix cache hit rate {:.3}",
            self.ratio(),
            averages.join(", "),
            self.peak,
            self.samples,
            self.seconds,
            self.hit_rate,
        )
    }
}

/// Runs the workload over fresh engines and replicas, with the replicas
/// polling the engines' load or not; returns the engines' load spread while
/// every session talked at once.
async fn run(poll: bool) -> Spread {
    let engines = Arc::new(common::kv_engines(engine_config(), ENGINES).await);
    let urls: Vec<String> = engines.iter().map(EngineHandle::url).collect();
    let mut replicas = Vec::new();
    for _ in 0..REPLICAS {
        let fixture = Fixture::start_with_urls(config(&engines, poll), Vec::new(), &urls).await;
        let background = fixture.router.spawn_background();
        replicas.push((fixture, background));
    }

    // A quiet start: each session's first turn alone (one token, so it is
    // short), dealt to the replicas in turn. The first one leaves the
    // system prompt on one engine; every other first turn shares it, so
    // every session's document is cached there, and only there.
    let first = send(&replicas[0].0, turn_body(0, 0, 1)).await;
    wait_for_events(&replicas, &engines).await;
    for session in 1..SESSIONS {
        let served = send(&replicas[session % REPLICAS].0, turn_body(session, 0, 1)).await;
        assert_eq!(
            served, first,
            "session {session}'s first turn left the engine holding the system prompt"
        );
    }
    wait_for_events(&replicas, &engines).await;

    let (hits_before, queries_before) = cache_counters(&engines);

    // Every session at once, turn after turn, each request to the next
    // replica; the engines' in-flight counts sampled meanwhile.
    let replicas = Arc::new(replicas);
    let dealt = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (engines, done) = (Arc::clone(&engines), Arc::clone(&done));
        tokio::spawn(async move {
            let mut spread = Spread {
                area: vec![0.0; engines.len()],
                peak: 0,
                samples: 0,
                seconds: 0.0,
                hit_rate: 0.0,
            };
            let mut last = Instant::now();
            while !done.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(5)).await;
                let now = Instant::now();
                let dt = now.duration_since(last).as_secs_f64();
                last = now;
                for (i, engine) in engines.iter().enumerate() {
                    let stats = engine.stats();
                    let in_flight = stats.running + stats.waiting;
                    spread.area[i] += in_flight as f64 * dt;
                    spread.peak = spread.peak.max(in_flight);
                }
                spread.samples += 1;
                spread.seconds += dt;
            }
            spread
        })
    };
    let mut talks = Vec::new();
    for session in 0..SESSIONS {
        let (replicas, dealt) = (Arc::clone(&replicas), Arc::clone(&dealt));
        talks.push(tokio::spawn(async move {
            tokio::time::sleep(STAGGER * session as u32).await;
            for turn in 1..=TURNS {
                let replica = dealt.fetch_add(1, Ordering::Relaxed) % REPLICAS;
                send(&replicas[replica].0, turn_body(session, turn, MAX_TOKENS)).await;
            }
        }));
    }
    let deadline = Duration::from_secs(60);
    for talk in talks {
        tokio::time::timeout(deadline, talk)
            .await
            .expect("a session took over 60 s")
            .unwrap();
    }
    done.store(true, Ordering::Relaxed);
    let mut spread = sampler.await.unwrap();
    let (hits, queries) = cache_counters(&engines);
    spread.hit_rate = (hits - hits_before) as f64 / (queries - queries_before) as f64;
    spread
}

/// The engines' prefix cache hits and queries (prompt tokens), summed.
fn cache_counters(engines: &[EngineHandle]) -> (u64, u64) {
    engines.iter().fold((0, 0), |(hits, queries), engine| {
        let stats = engine.stats();
        (
            hits + stats.prefix_cache_hits,
            queries + stats.prefix_cache_queries,
        )
    })
}

/// What a user of several replicas checks: behind a plain balancer, with
/// the default load polling, no engine carries far more than its share of
/// the fleet's requests; with polling off (`--load-poll-interval-ms 0`)
/// the engine that held every session's cache keeps most of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_reported_load_keeps_three_replicas_from_piling_sessions_onto_one_engine() {
    let started = Instant::now();
    let bounded = Duration::from_secs(90);
    let polled = tokio::time::timeout(bounded, run(true))
        .await
        .expect("the run with polling took over 90 s");
    let unpolled = tokio::time::timeout(bounded, run(false))
        .await
        .expect("the run without polling took over 90 s");
    eprintln!(
        "load spread (busiest engine's time-averaged in-flight / mean), in {:.1} s: \
         polling on {polled}; polling off {unpolled}",
        started.elapsed().as_secs_f64()
    );
    assert!(
        polled.ratio() <= SPREAD_BOUND,
        "with engine-reported load the spread exceeds the bound of docs/operations.md \
         (\"Several router replicas\": at most {SPREAD_BOUND}): {polled}"
    );
    assert!(
        unpolled.ratio() > SPREAD_BOUND,
        "without engine-reported load the spread stays within the bound of \
         docs/operations.md (\"Several router replicas\": {SPREAD_BOUND}), which says it \
         does not: {unpolled}"
    );
}
