//! vLLM ZMQ registration discovery over a real socket: a test engine
//! connects a DEALER to the listener's ROUTER on 127.0.0.1 and registers.

use std::time::{Duration, Instant};
use worker_discovery::ZmqDiscovery;
use worker_lifecycle::{DiscoveryPool, RoleKind, WorkerOptions};

#[path = "support/vllm_engine.rs"]
mod vllm_engine;
use vllm_engine::{TTL, engine_socket, eventually, registration};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_heartbeat_expiry_and_a_new_generation() {
    let discovery = ZmqDiscovery::bind("127.0.0.1:0", TTL).await.unwrap();
    assert_eq!(discovery.local_addr().ip().to_string(), "127.0.0.1");
    let registries = discovery.registries().clone();
    let mut engine = engine_socket(&discovery).await;

    engine
        .send(registration("P", "127.0.0.1:8100", "127.0.0.1:21001"))
        .await
        .unwrap();
    engine
        .send(registration("D", "127.0.0.1:8200", "127.0.0.1:22001"))
        .await
        .unwrap();
    eventually("both engines are registered", || {
        !registries
            .prefill
            .snapshot(Instant::now())
            .entries
            .is_empty()
            && !registries
                .decode
                .snapshot(Instant::now())
                .entries
                .is_empty()
    })
    .await;
    let prefill = registries.prefill.snapshot(Instant::now());
    assert_eq!(prefill.entries.len(), 1);
    let entry = &prefill.entries[0];
    assert_eq!(entry.endpoint.to_string(), "http://127.0.0.1:8100");
    assert_eq!(
        entry.registration.labels.get("kv_addr").map(String::as_str),
        Some("127.0.0.1:21001")
    );
    let first_generation = entry.generation;
    let decode = registries.decode.snapshot(Instant::now());
    assert_eq!(
        decode.entries[0].endpoint.to_string(),
        "http://127.0.0.1:8200"
    );

    // The pool builds one persistent worker for this lifetime; a request
    // holds load on it.
    let pool = DiscoveryPool::new(RoleKind::Prefill, WorkerOptions::default()).unwrap();
    let guard = pool
        .with_reconciled(&registries.prefill, Instant::now(), |view| {
            view.workers()[0].try_reserve().ok()
        })
        .unwrap()
        .expect("the registered prefill engine is available");
    let first_worker = guard.worker().clone();
    assert_eq!(first_worker.load(), 1);

    // Heartbeats (the same message again) within the TTL, for longer than
    // the TTL: the generation and the worker stay.
    let heartbeat_until = Instant::now() + TTL + TTL / 2;
    while Instant::now() < heartbeat_until {
        engine
            .send(registration("P", "127.0.0.1:8100", "127.0.0.1:21001"))
            .await
            .unwrap();
        tokio::time::sleep(TTL / 5).await;
    }
    let after_heartbeats = registries.prefill.snapshot(Instant::now());
    assert_eq!(
        after_heartbeats.entries.len(),
        1,
        "heartbeats keep it alive"
    );
    assert_eq!(after_heartbeats.entries[0].generation, first_generation);
    let same = pool
        .with_reconciled(&registries.prefill, Instant::now(), |view| {
            view.workers()[0].clone()
        })
        .unwrap();
    assert!(std::sync::Arc::ptr_eq(&same, &first_worker));
    assert_eq!(same.load(), 1);

    // Silence: the prefill engine expires (the decode one already has).
    eventually("the silent engine expires", || {
        registries
            .prefill
            .snapshot(Instant::now())
            .entries
            .is_empty()
    })
    .await;
    assert!(
        registries
            .decode
            .snapshot(Instant::now())
            .entries
            .is_empty()
    );
    let empty = pool
        .with_reconciled(&registries.prefill, Instant::now(), |view| {
            view.workers().len()
        })
        .unwrap();
    assert_eq!(empty, 0, "an expired engine leaves the pool");

    // It registers again at the same URL: a new generation, a fresh worker
    // with load 0, while the old request still holds the old one.
    engine
        .send(registration("P", "127.0.0.1:8100", "127.0.0.1:21001"))
        .await
        .unwrap();
    eventually("the engine is registered again", || {
        !registries
            .prefill
            .snapshot(Instant::now())
            .entries
            .is_empty()
    })
    .await;
    let again = registries.prefill.snapshot(Instant::now());
    assert!(again.entries[0].generation > first_generation);
    let fresh = pool
        .with_reconciled(&registries.prefill, Instant::now(), |view| {
            view.workers()[0].clone()
        })
        .unwrap();
    assert!(!std::sync::Arc::ptr_eq(&fresh, &first_worker));
    assert_eq!(fresh.load(), 0);
    assert_eq!(first_worker.load(), 1);
    drop(guard);
    assert_eq!(first_worker.load(), 0);
    assert_eq!(fresh.load(), 0);
    assert_eq!(discovery.malformed_messages(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_counted_and_discovery_keeps_working() {
    let discovery = ZmqDiscovery::bind("127.0.0.1:0", Duration::from_secs(5))
        .await
        .unwrap();
    let registries = discovery.registries().clone();
    let mut engine = engine_socket(&discovery).await;
    engine.send(vec![b"not msgpack".to_vec()]).await.unwrap();
    let unknown_type = serde_json::json!({"type": "Q", "http_address": "127.0.0.1:1"});
    engine
        .send(vec![rmp_serde::to_vec_named(&unknown_type).unwrap()])
        .await
        .unwrap();
    engine
        .send(registration("D", "127.0.0.1:8300", "127.0.0.1:23001"))
        .await
        .unwrap();
    eventually("the valid registration arrives", || {
        !registries
            .decode
            .snapshot(Instant::now())
            .entries
            .is_empty()
    })
    .await;
    assert_eq!(discovery.malformed_messages(), 2);
    assert!(registries.prefill.is_empty());
}

#[tokio::test]
async fn a_bad_address_is_refused() {
    let err = ZmqDiscovery::bind("no-port", Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no-port"));
}

/// Opens a raw TCP connection to the ROUTER and sends what the
/// hostile-input probe sent: a ZMTP handshake, then a long-frame header
/// claiming `claimed` bytes. The connection is kept open by the caller.
fn hostile_connection(discovery: &ZmqDiscovery, claimed: u64) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(discovery.local_addr()).unwrap();
    // A greeting, a DEALER's READY, then a frame header claiming `claimed`.
    let bytes = kv_events::fuzzing::zmtp::oversized_frame("DEALER", claimed);
    // A closed connection is fine: libzmq may have cut it already.
    let _ = stream.write_all(&bytes);
    stream
}

/// Issue 32: 127 connections each claiming 2^40 bytes aborted the router
/// (the frame's length was reserved up front), and one claiming 2^63-1
/// panicked the receive task for good. Now libzmq refuses both headers
/// against the bound, and a genuine engine still registers and heartbeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frame_headers_neither_crash_nor_stop_discovery() {
    let discovery = ZmqDiscovery::bind("127.0.0.1:0", TTL).await.unwrap();
    let registries = discovery.registries().clone();
    let mut hostile: Vec<_> = (0..127)
        .map(|_| hostile_connection(&discovery, 1 << 40))
        .collect();
    hostile.push(hostile_connection(&discovery, (1 << 63) - 1));
    // Let libzmq read every header before the genuine engine speaks.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut engine = engine_socket(&discovery).await;
    engine
        .send(registration("P", "127.0.0.1:8100", "127.0.0.1:21001"))
        .await
        .unwrap();
    eventually("the genuine engine is registered", || {
        registries.prefill.len() == 1
    })
    .await;
    let generation = registries.prefill.snapshot(Instant::now()).entries[0].generation;
    // Heartbeats are read: the entry outlives its TTL, same generation.
    let until = Instant::now() + TTL + TTL / 2;
    while Instant::now() < until {
        engine
            .send(registration("P", "127.0.0.1:8100", "127.0.0.1:21001"))
            .await
            .unwrap();
        tokio::time::sleep(TTL / 5).await;
    }
    let snapshot = registries.prefill.snapshot(Instant::now());
    assert_eq!(snapshot.entries.len(), 1, "heartbeats kept it alive");
    assert_eq!(snapshot.entries[0].generation, generation);
    // And another engine registers: the loop reads on.
    engine
        .send(registration("D", "127.0.0.1:8200", "127.0.0.1:22001"))
        .await
        .unwrap();
    eventually("the second engine is registered", || {
        registries.decode.len() == 1
    })
    .await;
    assert!(discovery.is_receiving());
    assert_eq!(discovery.receive_restarts(), 0, "nothing had to restart");
    hostile.clear();
}
