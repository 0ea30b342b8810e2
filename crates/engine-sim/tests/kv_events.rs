//! An engine's KV-cache events seen by a subscriber over 127.0.0.1: the
//! stored blocks of a request are its prompt's full blocks, evictions under
//! cache pressure are published and the events rebuild the engine's cached
//! block set exactly, and a subscriber that missed batches gets them by
//! replay. Every wait is bounded; the tests wait for the subscriber's own
//! events, never for a fixed time.
#![cfg(all(feature = "kv-events", not(loom)))]

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use common::post;
use engine_sim::tokens::block_hashes;
use engine_sim::{EngineConfig, EngineHandle, KvEventsOptions, ModelConfig, ServeOptions, spawn};
use kv_events::{
    BlockHash, BlockStored, KvEvent, Source, StreamEvent, Subscriber, SubscriberConfig,
};
use serde_json::json;
use tokio::sync::mpsc;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);
const BLOCK: usize = 16;

fn local() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

async fn engine(num_blocks: usize) -> EngineHandle {
    engine_with(num_blocks, None).await
}

async fn engine_with(num_blocks: usize, drop_live_every: Option<u64>) -> EngineHandle {
    let config = EngineConfig {
        time_scale: 0.0,
        model: ModelConfig {
            num_blocks,
            block_size: BLOCK,
            ..ModelConfig::default()
        },
        ..EngineConfig::default()
    };
    let mut kv = KvEventsOptions::new(local()).with_replay(local());
    kv.topic = "kv-events".to_owned();
    kv.drop_live_every = drop_live_every.and_then(std::num::NonZeroU64::new);
    let options = ServeOptions {
        kv_events: Some(kv),
        ..ServeOptions::default()
    };
    spawn(config, options).await.expect("spawn on 127.0.0.1")
}

/// A completion on token ids; returns the prompt's cached tokens.
async fn complete(engine: &EngineHandle, prompt: &[u32]) -> u64 {
    let reply = post(
        engine.addr(),
        "/v1/completions",
        &json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

/// `blocks` full blocks plus 3 tokens, every id derived from `seed` so
/// prompts of different seeds share no block.
fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK + 3) as u32)
        .map(|i| seed * 10_000 + i)
        .collect()
}

fn int(hash: &BlockHash) -> u64 {
    match hash {
        BlockHash::Int(h) => *h,
        BlockHash::Bytes(b) => panic!("engine-sim sends integer hashes, got bytes {b:?}"),
    }
}

/// A subscriber and what it has learned: the held block set, as a router's
/// index would keep it, and every event in order.
struct Follower {
    sub: Subscriber,
    rx: mpsc::UnboundedReceiver<StreamEvent>,
    held: HashSet<u64>,
    stored: Vec<BlockStored>,
    removed: Vec<u64>,
    sources: Vec<Source>,
    seqs: Vec<u64>,
}

impl Follower {
    fn new(engine: &EngineHandle) -> Self {
        let pub_addr = engine.kv_events_addr().expect("publishing");
        let replay = engine.kv_events_replay_addr().expect("replaying");
        let mut config = SubscriberConfig::new(format!("tcp://{pub_addr}"))
            .with_replay(format!("tcp://{replay}"))
            .with_topic("kv-events");
        config.backoff.initial = Duration::from_millis(20);
        config.backoff.max = Duration::from_millis(200);
        let (tx, rx) = mpsc::unbounded_channel();
        Follower {
            sub: Subscriber::spawn(config, tx),
            rx,
            held: HashSet::new(),
            stored: Vec::new(),
            removed: Vec::new(),
            sources: Vec::new(),
            seqs: Vec::new(),
        }
    }

    fn apply(&mut self, event: StreamEvent) {
        let StreamEvent::Batch {
            seq, batch, source, ..
        } = event
        else {
            panic!("no reset expected: {event:?}");
        };
        assert_eq!(batch.data_parallel_rank, Some(0), "one engine is rank 0");
        self.seqs.push(seq);
        self.sources.push(source);
        for event in batch.events {
            match event {
                KvEvent::BlockStored(stored) => {
                    for hash in &stored.block_hashes {
                        assert!(self.held.insert(int(hash)), "stored twice: {hash:?}");
                    }
                    self.stored.push(stored);
                }
                KvEvent::BlockRemoved(removed) => {
                    for hash in &removed.block_hashes {
                        assert!(self.held.remove(&int(hash)), "removed unheld {hash:?}");
                        self.removed.push(int(hash));
                    }
                }
                KvEvent::AllBlocksCleared => self.held.clear(),
            }
        }
    }

    /// Applies events until one stores `hash`: batches arrive in order, so
    /// everything published before it has been applied too.
    async fn until_stored(&mut self, hash: u64) {
        timeout(WAIT, async {
            while !self.held.contains(&hash) {
                let event = self.rx.recv().await.expect("subscriber running");
                self.apply(event);
            }
        })
        .await
        .expect("the block's event arrives in time");
    }

    /// ZMQ's PUB drops what it sends before a subscription has reached it
    /// (slow joiner): send fresh one-block prompts until the first batch
    /// arrives. The subscriber then replays everything it missed from 0,
    /// so nothing is lost. Returns the probes' seeds used.
    async fn warm_up(&mut self, engine: &EngineHandle, first_seed: u32) -> u32 {
        let mut seed = first_seed;
        timeout(WAIT, async {
            loop {
                complete(engine, &prompt(seed, 1)).await;
                seed += 1;
                tokio::select! {
                    event = self.rx.recv() => {
                        self.apply(event.expect("subscriber running"));
                        return;
                    }
                    // Not a synchronisation: the next probe is the retry.
                    () = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
            }
        })
        .await
        .expect("the subscription reaches the engine");
        let last_probe = block_hashes(&prompt(seed - 1, 1), BLOCK)[0];
        self.until_stored(last_probe).await;
        seed
    }

    /// Sends fresh one-block prompts until the subscriber has applied the
    /// last batch the engine published (`published` counts them; every
    /// probe is one). A probe that is not delivered (the subscription not
    /// yet there, or a batch dropped live) is followed by another, whose
    /// arrival makes the subscriber replay what it missed.
    async fn settle(&mut self, engine: &EngineHandle, seed: &mut u32, published: &mut u64) {
        timeout(WAIT, async {
            loop {
                complete(engine, &prompt(*seed, 1)).await;
                *seed += 1;
                *published += 1;
                let target = *published - 1;
                // Not a synchronisation: the next probe is the retry.
                let retry = tokio::time::Instant::now() + Duration::from_millis(100);
                while self.seqs.last() != Some(&target) {
                    match tokio::time::timeout_at(retry, self.rx.recv()).await {
                        Ok(event) => self.apply(event.expect("subscriber running")),
                        Err(_) => break,
                    }
                }
                if self.seqs.last() == Some(&target) {
                    return;
                }
            }
        })
        .await
        .expect("the subscriber catches up with the engine");
    }

    fn assert_matches(&self, engine: &EngineHandle) {
        let actual: HashSet<u64> = engine.cached_block_hashes().into_iter().collect();
        assert_eq!(self.held, actual, "the events rebuild the engine's cache");
        assert_eq!(self.held.len(), engine.stats().cached_blocks);
        // Numbered from 0 with no gap and no duplicate.
        let expected: Vec<u64> = (0..self.seqs.len() as u64).collect();
        assert_eq!(self.seqs, expected);
    }
}

#[tokio::test]
async fn a_request_stores_exactly_its_prompts_full_blocks() {
    let engine = engine(1024).await;
    let mut follower = Follower::new(&engine);
    follower.warm_up(&engine, 1).await;
    let before = follower.stored.len();

    let ids = prompt(500, 6);
    let hashes = block_hashes(&ids, BLOCK);
    assert_eq!(hashes.len(), 6);
    assert_eq!(complete(&engine, &ids).await, 0);
    follower.until_stored(hashes[5]).await;

    let new = &follower.stored[before..];
    assert_eq!(new.len(), 1, "one BlockStored for the request: {new:?}");
    let stored = &new[0];
    let got: Vec<u64> = stored.block_hashes.iter().map(int).collect();
    assert_eq!(got, hashes);
    assert_eq!(stored.parent_block_hash, None, "the prompt's first block");
    assert_eq!(stored.block_size, BLOCK as u32);
    // The tokens are the full blocks only, chained as the hashes are.
    assert_eq!(stored.token_ids, ids[..6 * BLOCK]);
    assert_eq!(block_hashes(&stored.token_ids, BLOCK), hashes);
    assert_eq!(stored.medium.as_deref(), Some("GPU"));

    // The same prompt again is a cache hit: nothing new stored. A longer
    // prompt sharing it stores only its new blocks, parented on the last
    // shared one.
    assert_eq!(complete(&engine, &ids).await, 6 * BLOCK as u64);
    let mut longer = ids[..6 * BLOCK].to_vec();
    longer.extend((0..2 * BLOCK as u32 + 1).map(|i| 900_000 + i));
    let longer_hashes = block_hashes(&longer, BLOCK);
    complete(&engine, &longer).await;
    follower.until_stored(longer_hashes[7]).await;
    let new = &follower.stored[before + 1..];
    assert_eq!(new.len(), 1, "{new:?}");
    let got: Vec<u64> = new[0].block_hashes.iter().map(int).collect();
    assert_eq!(got, longer_hashes[6..]);
    assert_eq!(new[0].parent_block_hash, Some(BlockHash::Int(hashes[5])));
    assert_eq!(new[0].token_ids, longer[6 * BLOCK..8 * BLOCK]);
    assert!(follower.removed.is_empty(), "a large cache evicts nothing");
    follower.assert_matches(&engine);

    follower.sub.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn evictions_under_pressure_are_published_and_rebuild_the_cache() {
    // 20 blocks; a request of 4 full blocks and 1 output token holds 5.
    let engine = engine(20).await;
    let mut follower = Follower::new(&engine);
    let mut seed = follower.warm_up(&engine, 1).await;
    for round in 0..12 {
        // New prompts push old ones out; every third one repeats an
        // earlier prompt, which may still be (partly) cached.
        let ids = if round % 3 == 2 {
            prompt(seed - 2, 4)
        } else {
            seed += 1;
            prompt(seed - 1, 4)
        };
        complete(&engine, &ids).await;
    }
    // A marker: once its block arrives, every earlier batch has.
    let marker = prompt(seed, 1);
    complete(&engine, &marker).await;
    follower.until_stored(block_hashes(&marker, BLOCK)[0]).await;

    assert!(
        !follower.removed.is_empty(),
        "20 blocks cannot hold every prompt: evictions are published"
    );
    assert!(follower.held.len() <= 20);
    follower.assert_matches(&engine);
    follower.sub.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn a_late_subscriber_gets_missed_batches_by_replay() {
    let engine = engine(1024).await;
    // Published before anyone listens: only the replay buffer has them.
    let early: Vec<Vec<u32>> = (0..3).map(|s| prompt(700 + s, 2)).collect();
    for ids in &early {
        complete(&engine, ids).await;
    }
    let mut follower = Follower::new(&engine);
    follower.warm_up(&engine, 1).await;
    for ids in &early {
        let hashes = block_hashes(ids, BLOCK);
        assert!(hashes.iter().all(|h| follower.held.contains(h)));
    }
    // The first three batches, one per early request, came from a replay.
    assert_eq!(&follower.seqs[..3], &[0, 1, 2]);
    assert!(follower.sources[..3].iter().all(|s| *s == Source::Replay));
    let status = follower.sub.status();
    assert!(status.counters.replays >= 1, "{status:?}");
    assert_eq!(status.counters.resets, 0);
    follower.assert_matches(&engine);
    follower.sub.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn batches_dropped_live_are_recovered_by_replay() {
    // Every third batch is not sent live: the subscriber sees a gap each
    // time one is followed by a live batch and fills it from the replay
    // socket. Every request below is a fresh prompt, so each one is
    // exactly one batch and `published` counts them.
    let engine = engine_with(1024, Some(3)).await;
    let mut follower = Follower::new(&engine);
    let mut seed = 1;
    let mut published = 0;
    follower.settle(&engine, &mut seed, &mut published).await;
    let before = follower.seqs.len();
    let prompts: Vec<Vec<u32>> = (0..9).map(|i| prompt(1_000 + i, 2)).collect();
    for ids in &prompts {
        complete(&engine, ids).await;
        published += 1;
    }
    follower.settle(&engine, &mut seed, &mut published).await;
    for ids in &prompts {
        let hashes = block_hashes(ids, BLOCK);
        assert!(hashes.iter().all(|h| follower.held.contains(h)));
    }
    let replayed = follower.sources[before..]
        .iter()
        .filter(|s| **s == Source::Replay)
        .count();
    assert!(replayed >= 3, "the dropped batches came by replay");
    let status = follower.sub.status();
    // At least one gap; not necessarily three: a drop that happens while
    // the previous gap's replay is still running (a replay takes a fresh
    // connection, about a millisecond; three simulated requests can be
    // faster) is filled by that replay and never seen as a gap of its own.
    assert!(status.counters.gaps >= 1, "{status:?}");
    assert_eq!(status.counters.resets, 0);
    follower.assert_matches(&engine);
    follower.sub.shutdown().await;
    engine.shutdown().await;
}
