//! The router follows the engines' KV-cache events (feature `kv-events`):
//! engine-sim publishes vLLM's wire format on ZMQ, each router subscribes
//! per worker, and `kv_aware` scores on the blocks the engines hold. Two
//! router replicas that share nothing route a session's turns to the same
//! engine; `cache_aware`'s private trees do not.
#![cfg(all(feature = "kv-events", feature = "tokens"))]

mod common;

use common::{Fixture, call, json};
use engine_sim::{EngineConfig, EngineHandle, KvEventsOptions, ServeOptions};
use http::StatusCode;
use lb_policies::PolicyConfig;
use prompt_tokens::PromptTokenizer;
use router_http::kv_events::{KvEndpoints, KvEventsConfig};
use router_http::tokens::Tokenizers;
use router_http::{BackgroundTasks, RouterConfig};
use std::sync::Arc;
use std::time::Duration;

const LOOPBACK: &str = "127.0.0.1:0";

/// Engines that publish their KV events (PUB + replay on free ports).
async fn engines(n: usize) -> Vec<EngineHandle> {
    common::kv_engines(EngineConfig::default(), n).await
}

/// A router configuration routing on engine-sim's synthetic token ids with
/// `policy`.
fn config(policy: &str, engines: &[EngineHandle]) -> RouterConfig {
    let chars_per_token = engine_sim::ModelConfig::default().chars_per_token;
    RouterConfig {
        policy: PolicyConfig::named(policy),
        tokenizers: Tokenizers::default()
            .with_default(Arc::new(PromptTokenizer::synthetic(chars_per_token))),
        kv_events: common::kv_events_config(engines),
        ..RouterConfig::default()
    }
}

/// A router replica over the engines, with its background tasks running.
async fn replica(policy: &str, engines: &[EngineHandle]) -> (Fixture, BackgroundTasks) {
    let urls: Vec<String> = engines.iter().map(EngineHandle::url).collect();
    let fixture = Fixture::start_with_urls(config(policy, engines), Vec::new(), &urls).await;
    let background = fixture.router.spawn_background();
    (fixture, background)
}

/// Session `s`'s request after `turns` earlier turns: a long system prompt
/// of its own, its history, a new question.
fn turn(session: usize, turns: usize) -> String {
    let mut messages = vec![serde_json::json!({
        "role": "system",
        "content": format!("Session {session}: you keep the logbook of ship number {session}. ").repeat(12),
    })];
    for t in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": format!("Entry {t}?")}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Logged {t}.")}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "Next entry?"}));
    serde_json::json!({"model": "sim-model", "messages": messages, "max_tokens": 2}).to_string()
}

fn finished(engines: &[EngineHandle]) -> Vec<u64> {
    engines
        .iter()
        .map(|e| e.stats().requests_finished)
        .collect()
}

/// Sends one turn through `fixture` and returns the index of the engine
/// that served it.
async fn send(fixture: &Fixture, engines: &[EngineHandle], body: String) -> usize {
    let before = finished(engines);
    let (status, _, bytes) = call(fixture.addr, "POST", "/v1/chat/completions", &[], body).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    let after = finished(engines);
    let served: Vec<usize> = (0..engines.len())
        .filter(|&i| after[i] > before[i])
        .collect();
    assert_eq!(
        served.len(),
        1,
        "one engine served the turn: {before:?} -> {after:?}"
    );
    served[0]
}

/// Sends a chat completion through `fixture`; its status.
async fn chat(fixture: &Fixture, body: String) -> StatusCode {
    call(fixture.addr, "POST", "/v1/chat/completions", &[], body)
        .await
        .0
}

/// Blocks stored by all engines so far (what each replica must have seen).
fn engine_blocks(engines: &[EngineHandle]) -> u64 {
    engines
        .iter()
        .map(|e| e.cached_block_hashes().len() as u64)
        .sum()
}

/// Runs `sessions` sessions of `turns` turns, turn `t` through replica
/// `t % 2`, the second replica taking the sessions in reverse order (so its
/// fair tie-breaking cannot line up with the first one's by chance).
/// Returns, per session, the engine of each turn.
async fn alternate(policy: &str, sessions: usize, turns: usize) -> Vec<Vec<usize>> {
    let engines = engines(2).await;
    let (a, _bg_a) = replica(policy, &engines).await;
    let (b, _bg_b) = replica(policy, &engines).await;
    let mut placed = vec![Vec::new(); sessions];
    for t in 0..turns {
        let (replica, order): (&Fixture, Vec<usize>) = if t % 2 == 0 {
            (&a, (0..sessions).collect())
        } else {
            (&b, (0..sessions).rev().collect())
        };
        if policy == "kv_aware" {
            // Both replicas have seen every block the engines stored.
            let held = engine_blocks(&engines);
            common::wait_for_blocks(&a, held).await;
            common::wait_for_blocks(&b, held).await;
        }
        for s in order {
            let engine = send(replica, &engines, turn(s, t)).await;
            placed[s].push(engine);
        }
    }
    placed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_send_every_later_turn_to_the_engine_holding_the_session() {
    let placed = alternate("kv_aware", 6, 4).await;
    for (s, engines) in placed.iter().enumerate() {
        assert!(
            engines.iter().all(|&e| e == engines[0]),
            "kv_aware: session {s} moved between engines: {engines:?}"
        );
    }
    // Both engines took sessions: affinity did not collapse onto one.
    assert!(
        placed.iter().any(|e| e[0] == 0) && placed.iter().any(|e| e[0] == 1),
        "{placed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_cache_aware_the_second_replica_does_not_know_the_session() {
    let placed = alternate("cache_aware", 6, 2).await;
    let moved = placed.iter().filter(|e| e[1] != e[0]).count();
    assert!(
        moved > 0,
        "cache_aware replicas share no state, so some second turns leave their engine: {placed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_and_metrics_show_each_streams_state() {
    let engines = engines(1).await;
    // A second worker whose publisher does not exist stays cold.
    let mut config = config("kv_aware", &engines);
    config.kv_events = config
        .kv_events
        .with_endpoints("http://127.0.0.1:9", KvEndpoints::new("tcp://127.0.0.1:9"));
    let urls = vec![engines[0].url(), "http://127.0.0.1:9".to_owned()];
    let fixture = Fixture::start_with_urls(config, Vec::new(), &urls).await;
    let _background = fixture.router.spawn_background();

    let status = chat(&fixture, turn(0, 0)).await;
    assert_eq!(status, StatusCode::OK);
    common::wait_for_blocks(&fixture, engine_blocks(&engines)).await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let workers = loop {
        let (_, _, bytes) = call(fixture.addr, "GET", "/workers", &[], "").await;
        let workers = json(&bytes);
        // The stream leaves `replaying` a moment after the worker's first
        // blocks arrive (the replay's answer and the live batch race).
        let live = workers[0]["kv_events"]["state"] == "live"
            && workers[0]["kv_events"]["streams"][0]["state"] == "live";
        if live || tokio::time::Instant::now() > deadline {
            break workers;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let live = &workers[0]["kv_events"];
    assert_eq!(live["state"], "live", "{workers}");
    assert!(live["blocks"].as_u64().unwrap() > 0, "{workers}");
    assert_eq!(live["streams"][0]["state"], "live", "{workers}");
    assert!(
        live["streams"][0]["batches"].as_u64().unwrap() > 0,
        "{workers}"
    );
    let cold = &workers[1]["kv_events"];
    assert_eq!(cold["state"], "cold", "{workers}");
    assert_eq!(
        cold["streams"][0]["endpoint"], "tcp://127.0.0.1:9",
        "{workers}"
    );

    let (_, _, bytes) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8(bytes.to_vec()).unwrap();
    for line in [
        "router_kv_workers{state=\"live\"} 1",
        "router_kv_workers{state=\"cold\"} 1",
        "router_kv_index_blocks_total{outcome=\"malformed\"} 0",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
    assert!(
        !metrics.contains("router_kv_batches_total 0\n"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_worker_leaves_the_index() {
    let engines = engines(1).await;
    let (fixture, _background) = replica("kv_aware", &engines).await;
    let status = chat(&fixture, turn(1, 0)).await;
    assert_eq!(status, StatusCode::OK);
    common::wait_for_blocks(&fixture, engine_blocks(&engines)).await;
    let hub = fixture.router.kv_events().unwrap().clone();
    assert!(hub.index().stats().pairs > 0);
    let key = fixture.workers()[0].key().to_owned();
    assert!(hub.worker_status(&key).is_some());

    let path = format!("/remove_worker?url={}", engines[0].url());
    let (status, _, body) = call(fixture.addr, "POST", &path, &[], "").await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while hub.index().stats().pairs > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the removed worker's blocks stayed in the index"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(hub.worker_status(&key).is_none());
}

#[test]
fn endpoints_default_to_the_workers_host_and_vllms_ports() {
    use worker_lifecycle::{Endpoint, WorkerOptions, WorkerRole, WorkerSpec};
    let config = KvEventsConfig::default();
    let worker = |url: &str, rank: Option<u32>| {
        let spec = WorkerSpec::new(WorkerRole::Regular, Endpoint::new(url, rank).unwrap());
        worker_lifecycle::Worker::new(spec, 1, &WorkerOptions::default())
    };
    assert_eq!(
        config.streams_of(&worker("http://10.0.0.5:8000", None)),
        vec![(
            0,
            "tcp://10.0.0.5:5557".to_owned(),
            Some("tcp://10.0.0.5:5558".to_owned())
        )]
    );
    // A data-parallel rank publishes at the port plus its rank.
    assert_eq!(
        config.streams_of(&worker("http://10.0.0.5:8000", Some(2))),
        vec![(
            2,
            "tcp://10.0.0.5:5559".to_owned(),
            Some("tcp://10.0.0.5:5560".to_owned())
        )]
    );
    // A registration that announced its addresses (worker-discovery sets
    // these labels): they come before the default ports, and the config's
    // per-URL endpoints before them.
    let spec = WorkerSpec::new(
        WorkerRole::Regular,
        Endpoint::new("http://10.0.0.6:8000", None).unwrap(),
    )
    .with_label(
        worker_lifecycle::labels::KV_EVENTS_ENDPOINT,
        "tcp://10.0.0.6:6000",
    );
    let announced = worker_lifecycle::Worker::new(spec, 1, &WorkerOptions::default());
    assert_eq!(
        config.streams_of(&announced),
        vec![(0, "tcp://10.0.0.6:6000".to_owned(), None)]
    );
    let overridden = config.clone().with_endpoints(
        "http://10.0.0.6:8000",
        KvEndpoints::new("tcp://10.0.0.7:7000"),
    );
    assert_eq!(
        overridden.streams_of(&announced),
        vec![(0, "tcp://10.0.0.7:7000".to_owned(), None)]
    );
    // Ranks behind one API server: one stream each.
    let mut dp = KvEventsConfig::default();
    dp.data_parallel_size = 2;
    dp.replay_port = None;
    assert_eq!(
        dp.streams_of(&worker("http://[::1]:8000", None)),
        vec![
            (0, "tcp://[::1]:5557".to_owned(), None),
            (1, "tcp://[::1]:5558".to_owned(), None)
        ]
    );
}

/// A router following one worker whose events come from `endpoint`.
async fn follower(endpoint: String, replay: Option<String>) -> (Fixture, BackgroundTasks) {
    let mut config = config("kv_aware", &[]);
    config.kv_events = config.kv_events.with_endpoints(
        "http://127.0.0.1:9",
        KvEndpoints::new(endpoint).with_replays(replay),
    );
    let fixture =
        Fixture::start_with_urls(config, Vec::new(), &["http://127.0.0.1:9".to_owned()]).await;
    let background = fixture.router.spawn_background();
    (fixture, background)
}

/// Waits (bounded) until `check` holds for the followed worker's status.
async fn wait_status(
    fixture: &Fixture,
    what: &str,
    check: impl Fn(&router_http::kv_events::WorkerKvStatus) -> bool,
) -> router_http::kv_events::WorkerKvStatus {
    let hub = fixture.router.kv_events().unwrap().clone();
    let key = fixture.workers()[0].key().to_owned();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = hub.worker_status(&key)
            && check(&status)
        {
            return status;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never {what}: {:?}",
            hub.worker_status(&key)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_publisher_is_counted_and_never_corrupts_the_index() {
    use bytes::Bytes;
    use kv_events::{BlockHash, BlockStored, EventBatch, KvEvent, encode_batch};

    /// A raw PUB socket (libzmq) sending whatever frames it is given.
    struct RawPub(zmq::Socket);
    impl RawPub {
        async fn send(&mut self, frames: Vec<Bytes>) -> Result<(), zmq::Error> {
            let frames: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
            self.0.send_multipart(frames, zmq::DONTWAIT)
        }
    }
    let raw = zmq::Context::new().socket(zmq::PUB).unwrap();
    raw.set_linger(0).unwrap();
    raw.bind("tcp://127.0.0.1:0").unwrap();
    let bound = raw.get_last_endpoint().unwrap().unwrap();
    let mut socket = RawPub(raw);
    let (fixture, _background) = follower(bound, None).await;
    let hub = fixture.router.kv_events().unwrap().clone();
    let message = |frames: Vec<Bytes>| frames;
    let seq = |n: u64| Bytes::copy_from_slice(&n.to_be_bytes());
    let tokens = |first: u32, n: u32| (first..first + n).collect::<Vec<u32>>();
    let stored = |hash: u64, parent: Option<u64>, ids: Vec<u32>| {
        let mut event = BlockStored::new(
            vec![BlockHash::Int(hash)],
            parent.map(BlockHash::Int),
            ids,
            16,
        );
        event.medium = Some("GPU".into());
        KvEvent::BlockStored(event)
    };
    let batch = |events: Vec<KvEvent>| Bytes::from(encode_batch(&EventBatch::new(1.0, events)));

    // Batch 0 (one good block), sent until the subscription is in place
    // (a PUB socket drops what it sends before a subscriber joined; the
    // repeats are duplicates of one batch).
    let key = fixture.workers()[0].key().to_owned();
    let first = batch(vec![stored(1, None, tokens(0, 16))]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let batches = |hub: &router_http::kv_events::KvEvents| {
        hub.worker_status(&key)
            .and_then(|s| s.streams.first().map(|r| r.batches))
            .unwrap_or(0)
    };
    while batches(&hub) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the subscriber never joined"
        );
        socket
            .send(message(vec![Bytes::new(), seq(0), first.clone()]))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Messages that are not batches: the wrong frame count, a sequence
    // number that is not 8 bytes, a payload that is not msgpack.
    socket
        .send(message(vec![Bytes::new(), seq(1)]))
        .await
        .unwrap();
    socket
        .send(message(vec![
            Bytes::new(),
            Bytes::from_static(b"1"),
            first.clone(),
        ]))
        .await
        .unwrap();
    // Batch 1 decodes: an event of a type vLLM may add later, a block with
    // too few tokens, a child of a parent never stored, a removal of an
    // unknown block, an event for the CPU tier, and one good child block.
    let unknown_tag: &[u8] = &[
        0x93, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, // [1.0,
        0x91, 0x92, 0xa6, b'F', b'u', b't', b'u', b'r', b'e', 0x07, // [["Future", 7]],
        0x00, // 0]
    ];
    socket
        .send(message(vec![
            Bytes::new(),
            seq(1),
            Bytes::from_static(unknown_tag),
        ]))
        .await
        .unwrap();
    let mut cpu = BlockStored::new(vec![BlockHash::Int(50)], None, tokens(500, 16), 16);
    cpu.medium = Some("CPU".into());
    let mixed = batch(vec![
        stored(9, None, tokens(0, 10)),
        stored(10, Some(777), tokens(100, 16)),
        KvEvent::BlockRemoved(kv_events::BlockRemoved::new(vec![BlockHash::Int(888)])),
        KvEvent::BlockStored(cpu),
        stored(2, Some(1), tokens(16, 16)),
    ]);
    socket
        .send(message(vec![Bytes::new(), seq(2), mixed]))
        .await
        .unwrap();
    let status = wait_status(&fixture, "past batch 2", |s| {
        s.streams[0].last_seq == Some(2)
    })
    .await;
    assert_eq!(status.blocks, 2, "only the two good GPU blocks: {status:?}");
    assert_eq!(status.lower_tier_blocks, 1, "the CPU block: {status:?}");
    assert_eq!(status.state, "live");

    let (_, _, bytes) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8(bytes.to_vec()).unwrap();
    for line in [
        // Two frames; a 1-byte number; "Future" decodes as an unknown event
        // of an otherwise valid batch 1.
        "router_kv_decode_errors_total 2",
        "router_kv_unknown_events_total 1",
        "router_kv_index_blocks_total{outcome=\"malformed\"} 1",
        "router_kv_index_blocks_total{outcome=\"unknown_parent\"} 1",
        "router_kv_index_blocks_total{outcome=\"unknown_removed\"} 1",
        // The CPU tier's block is kept apart, in the rank's host stream.
        "router_kv_lower_tier_events_total{tier=\"host\"} 1",
        "router_kv_index_entries 3",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }

    // Batch 3 names data-parallel rank 5: not this rank-0 stream's cache,
    // so none of it is applied.
    let mut other_rank = EventBatch::new(1.0, vec![stored(4, Some(2), tokens(32, 16))]);
    other_rank.data_parallel_rank = Some(5);
    socket
        .send(message(vec![
            Bytes::new(),
            seq(3),
            Bytes::from(encode_batch(&other_rank)),
        ]))
        .await
        .unwrap();
    let status = wait_status(&fixture, "past batch 3", |s| {
        s.streams[0].last_seq == Some(3)
    })
    .await;
    assert_eq!(
        status.blocks, 2,
        "rank 5's block is not rank 0's: {status:?}"
    );
    let (_, _, bytes) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let metrics = String::from_utf8(bytes.to_vec()).unwrap();
    let line = "router_kv_skipped_events_total{reason=\"other_rank\"} 1";
    assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");

    // A payload that does not decode at number 4 is a lost batch: with no
    // replay, number 5 shows the gap and the worker's blocks are dropped
    // (its state is unknown), then filled again from what follows.
    socket
        .send(message(vec![
            Bytes::new(),
            seq(4),
            Bytes::from_static(b"\xc1 not msgpack"),
        ]))
        .await
        .unwrap();
    socket
        .send(message(vec![
            Bytes::new(),
            seq(5),
            batch(vec![stored(3, None, tokens(1000, 16))]),
        ]))
        .await
        .unwrap();
    let status = wait_status(&fixture, "past batch 5", |s| {
        s.streams[0].last_seq == Some(5)
    })
    .await;
    assert_eq!(status.streams[0].resets, 1, "{status:?}");
    assert_eq!(
        status.blocks, 1,
        "the reset dropped the blocks before the gap: {status:?}"
    );
    assert_eq!(
        status.lower_tier_blocks, 0,
        "and the host tier's: {status:?}"
    );
    assert_eq!(hub.index().stats().pairs, 1);

    // A host-tier block, then the engine resets its prefix cache
    // (AllBlocksCleared): every tier of the rank is dropped.
    let mut cpu = BlockStored::new(vec![BlockHash::Int(60)], None, tokens(600, 16), 16);
    cpu.medium = Some("CPU".into());
    socket
        .send(message(vec![
            Bytes::new(),
            seq(6),
            batch(vec![KvEvent::BlockStored(cpu)]),
        ]))
        .await
        .unwrap();
    let status = wait_status(&fixture, "past batch 6", |s| {
        s.streams[0].last_seq == Some(6)
    })
    .await;
    assert_eq!(
        (status.blocks, status.lower_tier_blocks),
        (1, 1),
        "{status:?}"
    );
    socket
        .send(message(vec![
            Bytes::new(),
            seq(7),
            batch(vec![KvEvent::AllBlocksCleared]),
        ]))
        .await
        .unwrap();
    let status = wait_status(&fixture, "past batch 7", |s| {
        s.streams[0].last_seq == Some(7)
    })
    .await;
    assert_eq!(
        (status.blocks, status.lower_tier_blocks),
        (0, 0),
        "{status:?}"
    );
    // The router still routes (the worker itself is down: a clear 503).
    let status = chat(&fixture, turn(0, 0)).await;
    assert!(status.is_server_error(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_live_messages_are_replayed_and_the_index_matches_the_engine() {
    // Every third batch is kept for replay but never sent live, as a PUB
    // socket drops messages for a subscriber that is behind.
    let any = LOOPBACK.parse().unwrap();
    let mut events = KvEventsOptions::new(any).with_replay(any);
    events.drop_live_every = std::num::NonZeroU64::new(3);
    let options = ServeOptions {
        kv_events: Some(events),
        ..ServeOptions::default()
    };
    let mut model = EngineConfig::default();
    model.model.num_blocks = 64; // small: sessions evict each other
    let engine = engine_sim::spawn(model, options).await.unwrap();
    let engines = vec![engine];
    let (fixture, _background) = replica("kv_aware", &engines).await;
    for s in 0..12 {
        let status = chat(&fixture, turn(s, 0)).await;
        assert_eq!(status, StatusCode::OK);
    }
    let hub = fixture.router.kv_events().unwrap().clone();
    let key = fixture.workers()[0].key().to_owned();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let held = engines[0].cached_block_hashes().len();
        let status = hub.worker_status(&key).unwrap();
        if status.blocks == held && status.streams[0].state == "live" {
            assert!(status.streams[0].gaps > 0, "{status:?}");
            assert_eq!(
                status.streams[0].resets, 0,
                "every gap was replayed: {status:?}"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the index ({} blocks) never matched the engine ({held}): {status:?}",
            status.blocks
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let counters = hub.index().counters();
    assert!(
        counters.removed_blocks > 0,
        "the small cache evicted: {counters:?}"
    );
}

/// Issue 32: a publisher endpoint that answers the handshake and then
/// declares a 2^63-1-byte frame panicked the old SUB reader, and the
/// worker stayed "live" on a frozen index. Now libzmq refuses the header,
/// the subscriber reconnects (and is refused again), the worker is cold
/// meanwhile, and a genuine publisher that takes the endpoint over makes it
/// live again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_frame_header_leaves_the_worker_cold_until_a_genuine_publisher_takes_over() {
    use kv_events::fuzzing::zmtp;
    use kv_events::{BlockHash, BlockStored, EventBatch, KvEvent, Publisher, PublisherConfig};
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let stop = Arc::new(AtomicBool::new(false));
    let accepted = Arc::new(AtomicUsize::new(0));
    let hostile = {
        let (stop, accepted) = (Arc::clone(&stop), Arc::clone(&accepted));
        std::thread::spawn(move || {
            listener.set_nonblocking(true).unwrap();
            let mut open = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if let Ok((mut stream, _)) = listener.accept() {
                    stream.set_nonblocking(false).unwrap();
                    let _ = stream.write_all(&zmtp::oversized_frame("PUB", (1 << 63) - 1));
                    accepted.fetch_add(1, Ordering::Relaxed);
                    open.push(stream);
                } else {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        })
    };
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let (fixture, _background) = follower(endpoint.clone(), None).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while accepted.load(Ordering::Relaxed) < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the subscriber stopped reconnecting"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = wait_status(&fixture, "cold with its connections counted", |s| {
        s.streams[0].state != "live" && s.state == "cold"
    })
    .await;
    assert_eq!(status.streams[0].batches, 0);
    stop.store(true, Ordering::Relaxed);
    hostile.join().unwrap();

    let publisher = Publisher::bind(PublisherConfig::new(endpoint))
        .await
        .expect("the endpoint is free again");
    let mut stored = BlockStored::new(vec![BlockHash::Int(1)], None, (0..16).collect(), 16);
    stored.medium = Some("GPU".into());
    let batch = EventBatch::new(1.0, vec![KvEvent::BlockStored(stored)]);
    let hub = fixture.router.kv_events().unwrap().clone();
    let key = fixture.workers()[0].key().to_owned();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while hub.worker_status(&key).map(|s| s.state) != Some("live") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never live: {:?}",
            hub.worker_status(&key)
        );
        publisher.publish(&batch).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = hub.worker_status(&key).unwrap();
    assert_eq!(status.streams[0].state, "live");
    assert!(status.streams[0].batches >= 1);
    assert_eq!(status.streams[0].restarts, 0, "nothing had to restart");
    publisher.shutdown().await;
}

/// A followed worker's block cap comes down to its engine's own cache size
/// (`num_gpu_blocks` on its `/metrics`), never above the configured cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_workers_block_cap_is_its_engines_cache_size() {
    let engines = engines(2).await;
    let (fixture, background) = replica("kv_aware", &engines).await;
    let hub = fixture
        .router
        .kv_events()
        .expect("kv_aware follows KV events");
    let sizes = EngineConfig::default().model.num_blocks;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    for engine in &engines {
        let key = fixture
            .workers()
            .iter()
            .find(|w| w.endpoint().worker_url().to_string() == engine.url())
            .map(|w| w.key().to_owned())
            .expect("the engine is a worker");
        loop {
            let capacity = hub
                .index()
                .worker_id(&key)
                .and_then(|id| hub.index().worker_capacity(id));
            if capacity == Some(sizes) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{key}: capacity {capacity:?}, engine holds {sizes} blocks"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert!(sizes < kv_block_index::DEFAULT_MAX_BLOCKS_PER_HOLDER.get());
    // An engine cannot raise its cap above the configured one.
    let id = hub
        .index()
        .worker_id(&fixture.workers()[0].key().to_owned())
        .unwrap();
    let text = "vllm:cache_config_info{num_gpu_blocks=\"999999999\"} 1\n";
    assert_eq!(
        hub.bound_by_engine(id, text).map(|n| n.get()),
        Some(kv_block_index::DEFAULT_MAX_BLOCKS_PER_HOLDER.get())
    );
    drop(background);
    fixture.shutdown().await;
    for engine in engines {
        engine.shutdown().await;
    }
}

/// `KvEventsConfig::model`: the pools that read the index give their
/// index policy to that model alone; every other model gets cache_aware
/// with the same knobs. In P/D a role that inherits the main policy gets
/// its own copy, and a role that does not read the index is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_model_alone_is_scored_on_the_index() {
    use lb_policies::PolicyState;
    use router_http::{PdConfig, PdConnector, Router};
    let name = |registry: &lb_policies::PolicyRegistry<Arc<worker_lifecycle::Worker>>,
                model: &str| { registry.policy(model).unwrap().name().to_owned() };

    let mut regular = config("kv_aware", &[]);
    regular.kv_events.model = Some("m".to_owned());
    let router = Router::new(regular).unwrap();
    assert!(router.kv_events().is_some());
    assert_eq!(name(router.policies(), "m"), "kv_aware");
    assert_eq!(name(router.policies(), "other"), "cache_aware");

    let mut pd = config("kv_aware_gate", &[]);
    let mut pools = PdConfig::new(PdConnector::Nixl);
    pools.decode_policy = Some(PolicyConfig::named("round_robin"));
    pd.pd = Some(pools);
    pd.kv_events.model = Some("m".to_owned());
    let router = Router::new(pd).unwrap();
    let pools = router.pd().unwrap();
    assert_eq!(name(pools.prefill().policies(), "m"), "kv_aware_gate");
    assert_eq!(name(pools.prefill().policies(), "other"), "cache_aware");
    assert_eq!(name(pools.decode().policies(), "m"), "round_robin");
    assert_eq!(name(pools.decode().policies(), "other"), "round_robin");

    // Without a model every model's requests are scored on the index.
    let router = Router::new(config("kv_aware", &[])).unwrap();
    assert_eq!(name(router.policies(), "other"), "kv_aware");
}
