//! Router replicas that share their routing choices (`RouterConfig::peers`,
//! docs/operations.md "Several router replicas"): two cache_aware replicas
//! over the same two engine-sim engines, each the other's peer, on
//! loopback. A conversation started through one replica and continued
//! through the other finds its prefix in the second replica's tree, on
//! the worker the first chose; without sharing it is a miss. And the
//! endpoint that takes a peer's choices refuses whatever is not a
//! well-formed batch from a peer holding the token, changing nothing.

mod common;

use bytes::Bytes;
use common::{call, chat_body, json};
use engine_sim::{EngineConfig, EngineHandle, ServeOptions};
use lb_policies::{DecisionReason, PolicyConfig, PolicyState};
use router_http::peers::{MAX_PEER_BODY_BYTES, PEER_CHOICES_PATH};
use router_http::{BackgroundTasks, PeerConfig, Router, RouterConfig};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpListener;

const TOKEN: &str = "peer-secret";
const MODEL: &str = "sim-model";

/// A replica serving on its own loopback port.
struct Replica {
    router: Router,
    addr: SocketAddr,
    _background: BackgroundTasks,
    _server: tokio::task::JoinHandle<router_http::ShutdownOutcome>,
}

/// The engines' URLs (each engine's handle kept in `handles`).
fn urls(handles: &[EngineHandle]) -> Vec<String> {
    handles.iter().map(EngineHandle::url).collect()
}

async fn engines(n: usize) -> Vec<EngineHandle> {
    let mut handles = Vec::new();
    for _ in 0..n {
        let engine = engine_sim::spawn(EngineConfig::default(), ServeOptions::default());
        handles.push(engine.await.unwrap());
    }
    handles
}

/// A cache_aware replica on `listener` over `engines`, sharing with
/// `peers` when given, accepting choices when `token` is set.
fn replica(
    listener: TcpListener,
    engines: &[String],
    peers: Vec<String>,
    token: Option<&str>,
) -> Replica {
    let mut config = RouterConfig {
        policy: PolicyConfig::named("cache_aware"),
        ..RouterConfig::default()
    };
    // Polling the engines is not what this test is about.
    config.load_poll.interval = None;
    config.peers = PeerConfig {
        urls: peers,
        token: token.map(str::to_owned),
        ..PeerConfig::default()
    };
    let router = Router::new(config).unwrap();
    for url in engines {
        router.add_worker(url, None, None).unwrap();
    }
    let addr = listener.local_addr().unwrap();
    let background = router.spawn_background();
    let serving = router.clone();
    let server = tokio::spawn(async move { serving.serve(listener, std::future::pending()).await });
    Replica {
        router,
        addr,
        _background: background,
        _server: server,
    }
}

async fn listener() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.unwrap()
}

/// The first message of conversation `i`: long enough that its text is
/// most of the routing text of its continuation.
fn opening(i: usize) -> String {
    format!(
        "conversation {i}: {}",
        "the quick brown fox jumps over the lazy dog; ".repeat(30)
    )
}

/// A chat of conversation `i`'s opening and, if `more`, a second turn.
fn turn(i: usize, more: bool) -> String {
    let mut messages = vec![serde_json::json!({"role": "user", "content": opening(i)})];
    if more {
        messages.push(serde_json::json!({"role": "assistant", "content": "noted"}));
        messages.push(serde_json::json!({"role": "user", "content": "and then?"}));
    }
    serde_json::json!({"model": MODEL, "messages": messages, "max_tokens": 4}).to_string()
}

/// Which of `router`'s workers served the request `send` makes (by the
/// change in their processed counts).
async fn served_by(router: &Router, send: impl std::future::Future<Output = ()>) -> String {
    let before: Vec<u64> = router.workers().iter().map(|w| w.processed()).collect();
    send.await;
    let workers = router.workers();
    let changed: Vec<_> = workers
        .iter()
        .zip(before)
        .filter(|(w, b)| w.processed() != *b)
        .map(|(w, _)| w.url().to_string())
        .collect();
    assert_eq!(changed.len(), 1, "{changed:?}");
    changed.into_iter().next().unwrap()
}

async fn chat(addr: SocketAddr, body: String) {
    let (status, _, bytes) = call(addr, "POST", "/v1/chat/completions", &[], body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
}

fn decisions(router: &Router, reason: DecisionReason) -> u64 {
    router
        .policies()
        .policy(MODEL)
        .unwrap()
        .counts()
        .get(reason)
}

fn tree_bytes(router: &Router) -> u64 {
    let policy = router.policies().policy(MODEL).unwrap();
    policy.tree_stats().iter().map(|s| s.bytes).sum()
}

/// The replica's `/metrics` text.
async fn metrics(addr: SocketAddr) -> String {
    let (status, _, body) = call(addr, "GET", "/metrics", &[], "").await;
    assert_eq!(status, 200);
    String::from_utf8(body.to_vec()).unwrap()
}

/// Waits (bounded) until the replica at `addr` has recorded `n` peer
/// choices.
async fn recorded(addr: SocketAddr, n: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics(addr).await;
        let line = text
            .lines()
            .find(|l| l.starts_with("router_peer_choices_received_total{result=\"recorded\"}"))
            .unwrap_or_default()
            .to_owned();
        let got: u64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if got >= n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{got} of {n} choices recorded: {line:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Conversations started on `first` and continued on `second`: where
/// each went on both, and the second's hits.
async fn continue_elsewhere(first: &Replica, second: &Replica, sync: bool) -> (usize, u64) {
    const CONVERSATIONS: usize = 8;
    // A request for the model on the second replica first: a replica
    // records peers' choices only for models it routes.
    chat(second.addr, chat_body("hello", false)).await;
    let mut chosen = Vec::new();
    for i in 0..CONVERSATIONS {
        chosen.push(served_by(&first.router, chat(first.addr, turn(i, false))).await);
    }
    if sync {
        recorded(second.addr, CONVERSATIONS as u64).await;
    }
    let hits_before = decisions(&second.router, DecisionReason::CacheHit);
    let mut same = 0;
    for (i, worker) in chosen.iter().enumerate() {
        let again = served_by(&second.router, chat(second.addr, turn(i, true))).await;
        same += usize::from(&again == worker);
    }
    (
        same,
        decisions(&second.router, DecisionReason::CacheHit) - hits_before,
    )
}

#[tokio::test]
async fn a_conversation_continued_through_another_replica_finds_its_prefix() {
    let engines = engines(2).await;
    let (la, lb) = (listener().await, listener().await);
    let (url_a, url_b) = (
        format!("http://{}", la.local_addr().unwrap()),
        format!("http://{}", lb.local_addr().unwrap()),
    );
    let urls = urls(&engines);
    let a = replica(la, &urls, vec![url_b], Some(TOKEN));
    // The other replica learned the workers in the other order: its keys
    // for them differ (a key carries the worker's generation), its
    // endpoints do not.
    let reversed: Vec<String> = urls.iter().rev().cloned().collect();
    let b = replica(lb, &reversed, vec![url_a], Some(TOKEN));
    assert_ne!(a.router.workers()[0].key(), b.router.workers()[1].key());
    let (same, hits) = continue_elsewhere(&a, &b, true).await;
    assert_eq!(
        same, 8,
        "continuations on the worker the first replica chose"
    );
    assert_eq!(
        hits, 8,
        "every continuation a cache hit on the second replica"
    );

    // The same through two replicas that share nothing: the second's tree
    // has never seen the openings.
    let (lc, ld) = (listener().await, listener().await);
    let c = replica(lc, &urls, Vec::new(), None);
    let d = replica(ld, &reversed, Vec::new(), None);
    let (_, hits) = continue_elsewhere(&c, &d, false).await;
    assert_eq!(hits, 0, "without sharing every continuation misses");
}

#[tokio::test]
async fn a_peer_batch_needs_the_token_and_a_valid_shape_and_changes_nothing_otherwise() {
    let engines = engines(2).await;
    let b = replica(listener().await, &urls(&engines), Vec::new(), Some(TOKEN));
    chat(b.addr, chat_body("hello", false)).await;
    let worker = engines[0].url();
    let bytes_before = tree_bytes(&b.router);
    let auth = format!("Bearer {TOKEN}");
    let valid = serde_json::json!({"choices": [
        {"model": MODEL, "worker": worker, "text": "user: a prefix a peer routed"},
    ]})
    .to_string();
    let post = |headers: Vec<(&'static str, String)>, body: Bytes| {
        let addr = b.addr;
        async move {
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            call(addr, "POST", PEER_CHOICES_PATH, &headers, body).await
        }
    };
    // No token, a wrong one, another scheme: 401.
    for headers in [
        vec![],
        vec![("authorization", "Bearer peer-secreT".to_owned())],
        vec![("authorization", format!("Basic {TOKEN}"))],
    ] {
        let (status, _, body) = post(headers, Bytes::from(valid.clone())).await;
        assert_eq!(status, 401, "{}", String::from_utf8_lossy(&body));
    }
    // Not a batch, or a batch with one bad choice: 400 naming it.
    let half_bad = serde_json::json!({"choices": [
        {"model": MODEL, "worker": worker, "text": "user: fine"},
        {"model": MODEL, "worker": worker, "text": "user: both", "tokens": [1]},
    ]})
    .to_string();
    for (body, names) in [
        (
            Bytes::from_static(b"\x00\xff garbage"),
            "invalid peer batch",
        ),
        (
            Bytes::from_static(b"{\"choices\": 3}"),
            "invalid peer batch",
        ),
        (Bytes::from(half_bad), "choice 1"),
    ] {
        let (status, _, answer) = post(vec![("authorization", auth.clone())], body).await;
        assert_eq!(status, 400);
        let answer = json(&answer);
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(names), "{answer}");
    }
    // Larger than the limit: 413 before reading it.
    let (status, _, _) = post(
        vec![
            ("authorization", auth.clone()),
            ("content-length", (MAX_PEER_BODY_BYTES + 1).to_string()),
        ],
        Bytes::new(),
    )
    .await;
    assert_eq!(status, 413);
    assert_eq!(
        tree_bytes(&b.router),
        bytes_before,
        "a refused batch changed the tree"
    );

    // A worker or a model this replica does not know: ignored, counted.
    let strangers = serde_json::json!({"choices": [
        {"model": MODEL, "worker": "http://10.9.9.9:8000", "text": "user: elsewhere"},
        {"model": "never-routed", "worker": worker, "tokens": [1, 2, 3]},
    ]})
    .to_string();
    let (status, _, answer) = post(vec![("authorization", auth.clone())], strangers.into()).await;
    assert_eq!(status, 200);
    assert_eq!(
        json(&answer),
        serde_json::json!({"recorded": 0, "ignored": 2})
    );
    assert_eq!(tree_bytes(&b.router), bytes_before);
    assert_eq!(b.router.workers().len(), 2, "a peer never adds a worker");

    // The valid batch: recorded.
    let (status, _, answer) = post(vec![("authorization", auth)], valid.into()).await;
    assert_eq!(status, 200);
    assert_eq!(
        json(&answer),
        serde_json::json!({"recorded": 1, "ignored": 0})
    );
    assert!(tree_bytes(&b.router) > bytes_before);
    let metrics = metrics(b.addr).await;
    for line in [
        "router_peer_batches_refused_total{reason=\"unauthorized\"} 3",
        "router_peer_batches_refused_total{reason=\"invalid\"} 3",
        "router_peer_batches_refused_total{reason=\"too_large\"} 1",
        "router_peer_choices_received_total{result=\"recorded\"} 1",
        "router_peer_choices_received_total{result=\"ignored\"} 2",
    ] {
        assert!(metrics.contains(line), "{line} missing:\n{metrics}");
    }

    // A replica without a token has no such endpoint.
    let closed = replica(listener().await, &urls(&engines), Vec::new(), None);
    let (status, _, _) = call(
        closed.addr,
        "POST",
        PEER_CHOICES_PATH,
        &[("authorization", &format!("Bearer {TOKEN}"))],
        "{\"choices\": []}",
    )
    .await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn a_peer_that_is_down_costs_the_requests_nothing() {
    let engines = engines(2).await;
    // A port nothing listens on any more.
    let dead = listener().await;
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let a = replica(
        listener().await,
        &urls(&engines),
        vec![dead_url],
        Some(TOKEN),
    );
    for i in 0..20 {
        chat(a.addr, turn(i, false)).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = metrics(a.addr).await;
        let failed = metrics
            .lines()
            .find(|l| l.starts_with("router_peer_batches_total{") && l.contains("result=\"error\""))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        if failed > 0 {
            assert!(
                metrics.contains("router_peer_choices_shared_total 20"),
                "{metrics}"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no failed batch counted:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
