//! A hostile KV event publisher (issue 32): a TCP listener on 127.0.0.1
//! that speaks just enough ZMTP to pass the handshake, then declares an
//! enormous frame. The subscriber survives, never reports the stream live
//! while it is broken, keeps reconnecting, and follows the genuine
//! publisher that takes the endpoint over. A real frame over the bound is
//! refused and never delivered.
// The sockets' tests: feature `sockets`.
#![cfg(all(feature = "sockets", not(loom)))]

use std::io::Write;
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kv_events::fuzzing::zmtp;
use kv_events::{
    BlockHash, BlockStored, DecodeLimits, EventBatch, KvEvent, Publisher, PublisherConfig,
    StreamEvent, StreamState, Subscriber, SubscriberConfig,
};
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(10);

fn batch(n: u64, tokens: usize) -> EventBatch {
    let stored = BlockStored::new(vec![BlockHash::Int(n)], None, vec![7; tokens], 16);
    EventBatch::new(n as f64, vec![KvEvent::BlockStored(stored)])
}

/// Accepts connections until stopped, answering each with `bytes` and
/// keeping it open (as the probe did); returns how many it accepted.
fn hostile_publisher(
    listener: TcpListener,
    bytes: Vec<u8>,
    stop: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        listener.set_nonblocking(true).unwrap();
        let mut open = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    stream.set_nonblocking(false).unwrap();
                    let _ = stream.write_all(&bytes);
                    accepted.fetch_add(1, Ordering::Relaxed);
                    open.push(stream);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        // The listener and every connection close here.
    })
}

async fn until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn hostile_then_genuine(claimed: u64) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let stop = Arc::new(AtomicBool::new(false));
    let accepted = Arc::new(AtomicUsize::new(0));
    let server = hostile_publisher(
        listener,
        zmtp::oversized_frame("PUB", claimed),
        Arc::clone(&stop),
        Arc::clone(&accepted),
    );
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut config = SubscriberConfig::new(format!("tcp://127.0.0.1:{port}"));
    config.backoff.initial = Duration::from_millis(20);
    config.backoff.max = Duration::from_millis(100);
    let subscriber = Subscriber::spawn(config, tx);

    // Every connection is dropped by libzmq at the header, and the
    // subscriber comes back for more: it is alive and reading.
    until("the subscriber reconnected three times", || {
        accepted.load(Ordering::Relaxed) >= 3
    })
    .await;
    // Counted as lost connections, or as failed attempts when libzmq
    // closed the connection before reporting its handshake.
    until("the broken connections are counted", || {
        let counters = subscriber.status().counters;
        counters.disconnects + counters.connect_failures >= 2
    })
    .await;
    assert_ne!(subscriber.status().state, StreamState::Live);
    stop.store(true, Ordering::Relaxed);
    server.join().unwrap();
    // Nobody listens now: the stream is not live, whatever it was.
    until("the stream is down", || {
        subscriber.status().state == StreamState::Connecting
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(subscriber.status().state, StreamState::Connecting);
    assert_eq!(subscriber.status().counters.batches, 0);
    assert!(rx.try_recv().is_err(), "nothing was delivered");

    // A genuine publisher takes the endpoint over: events flow again.
    let publisher = Publisher::bind(PublisherConfig::new(format!("tcp://127.0.0.1:{port}")))
        .await
        .expect("the port is free again");
    let deadline = Instant::now() + WAIT;
    let mut n = 0;
    let event = loop {
        assert!(
            Instant::now() < deadline,
            "no genuine batch within {WAIT:?}"
        );
        publisher.publish(&batch(n, 16)).await.unwrap();
        n += 1;
        if let Ok(Some(event)) = tokio::time::timeout(Duration::from_millis(20), rx.recv()).await {
            break event;
        }
    };
    assert!(matches!(event, StreamEvent::Batch { .. }), "{event:?}");
    until("the stream is live", || {
        subscriber.status().state == StreamState::Live
    })
    .await;
    subscriber.shutdown().await;
    publisher.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_claiming_2_pow_63_bytes_is_survived_and_a_genuine_one_takes_over() {
    hostile_then_genuine((1 << 63) - 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_claiming_2_pow_40_bytes_is_survived_and_a_genuine_one_takes_over() {
    hostile_then_genuine(1 << 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_frame_over_the_bound_is_refused_and_the_stream_goes_on() {
    let publisher = Publisher::bind(PublisherConfig::new("tcp://127.0.0.1:0"))
        .await
        .unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut config = SubscriberConfig::new(publisher.endpoint());
    config.backoff.initial = Duration::from_millis(20);
    config.backoff.max = Duration::from_millis(100);
    let mut limits = DecodeLimits::default();
    limits.max_payload_bytes = 1024;
    config.limits = limits;
    let subscriber = Subscriber::spawn(config, tx);
    // Small batches until one arrives (the slow joiner).
    let deadline = Instant::now() + WAIT;
    let mut n = 0;
    loop {
        assert!(Instant::now() < deadline, "no batch within {WAIT:?}");
        publisher.publish(&batch(n, 16)).await.unwrap();
        n += 1;
        if let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(20), rx.recv()).await {
            break;
        }
    }
    while rx.try_recv().is_ok() {}
    let before = subscriber.status().counters;
    // A real batch whose payload (1000 token ids) is over the 1 KiB bound:
    // libzmq drops the connection at its header.
    publisher.publish(&batch(10_000, 1000)).await.unwrap();
    until("the oversized frame cut the connection", || {
        subscriber.status().counters.disconnects > before.disconnects
    })
    .await;
    // The subscriber reconnects; small batches get through again, and the
    // big one never does.
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(Instant::now() < deadline, "no batch after the reconnection");
        publisher.publish(&batch(n, 16)).await.unwrap();
        n += 1;
        match tokio::time::timeout(Duration::from_millis(20), rx.recv()).await {
            Ok(Some(StreamEvent::Batch { batch, .. })) => {
                let KvEvent::BlockStored(stored) = &batch.events[0] else {
                    panic!("{batch:?}")
                };
                assert_eq!(
                    stored.token_ids.len(),
                    16,
                    "the oversized batch got through"
                );
                break;
            }
            Ok(Some(_)) | Err(_) => {}
            Ok(None) => panic!("the subscriber stopped"),
        }
    }
    assert_eq!(subscriber.status().counters.decode_errors, 0);
    subscriber.shutdown().await;
    publisher.shutdown().await;
}
