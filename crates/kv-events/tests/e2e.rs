//! Subscriber against publisher over TCP on 127.0.0.1: live events, a gap
//! recovered by replay, a restarted publisher detected and reset, and a
//! publisher that goes away and comes back. Every wait is bounded; nothing
//! sleeps to synchronise (the tests wait for the subscriber's own events).
// The sockets' tests: feature `sockets`.
#![cfg(all(feature = "sockets", not(loom)))]

use std::time::Duration;

use kv_events::{
    BlockHash, BlockStored, EventBatch, KvEvent, Publisher, PublisherConfig, ResetReason, Source,
    StreamEvent, StreamState, Subscriber, SubscriberConfig,
};
use tokio::sync::mpsc;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(10);

fn batch(n: u64) -> EventBatch {
    let stored = BlockStored::new(vec![BlockHash::Int(n)], None, vec![n as u32; 4], 4);
    EventBatch::new(n as f64, vec![KvEvent::BlockStored(stored)])
}

fn hash_of(event: &StreamEvent) -> Option<u64> {
    match event {
        StreamEvent::Batch { batch, .. } => match &batch.events[0] {
            KvEvent::BlockStored(s) => match s.block_hashes[0] {
                BlockHash::Int(h) => Some(h),
                BlockHash::Bytes(_) => None,
            },
            _ => None,
        },
        _ => None,
    }
}

async fn publisher(topic: &str, port: u16, replay_port: u16) -> Publisher {
    let mut config = PublisherConfig::new(format!("tcp://127.0.0.1:{port}"));
    config.replay_endpoint = Some(format!("tcp://127.0.0.1:{replay_port}"));
    config.topic = topic.to_owned();
    config.data_parallel_rank = Some(0);
    Publisher::bind(config).await.expect("bind on 127.0.0.1")
}

fn subscriber(
    publisher: &Publisher,
    topic: &str,
) -> (Subscriber, mpsc::UnboundedReceiver<StreamEvent>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut config = SubscriberConfig::new(publisher.endpoint())
        .with_replay(publisher.replay_endpoint().unwrap())
        .with_topic(topic);
    config.backoff.initial = Duration::from_millis(20);
    config.backoff.max = Duration::from_millis(200);
    (Subscriber::spawn(config, tx), rx)
}

async fn next(rx: &mut mpsc::UnboundedReceiver<StreamEvent>) -> StreamEvent {
    timeout(WAIT, rx.recv())
        .await
        .expect("an event in time")
        .expect("the subscriber is running")
}

/// PUB drops messages until the subscription has reached it (ZMQ's slow
/// joiner): publish probes until one arrives *live* (the catch-up replay
/// from 0 may deliver the first ones before the PUB socket has taken the
/// subscription in). Every probe arrives, in order: 0, 1, 2, ...
async fn warm_up(publisher: &Publisher, rx: &mut mpsc::UnboundedReceiver<StreamEvent>) -> u64 {
    let mut published = 0;
    let mut seen = 0;
    timeout(WAIT, async {
        loop {
            publisher.publish(&batch(published)).await.unwrap();
            published += 1;
            let pause = tokio::time::sleep(Duration::from_millis(20));
            tokio::pin!(pause);
            let mut live = false;
            loop {
                tokio::select! {
                    event = rx.recv() => {
                        let event = event.expect("running");
                        assert_eq!(hash_of(&event), Some(seen), "in order from 0: {event:?}");
                        seen += 1;
                        live |= matches!(event, StreamEvent::Batch { source: Source::Live, .. });
                    }
                    () = &mut pause => break,
                }
            }
            if live {
                return;
            }
        }
    })
    .await
    .expect("the subscription reaches the publisher");
    for expect in seen..published {
        assert_eq!(hash_of(&next(rx).await), Some(expect));
    }
    published
}

#[tokio::test]
async fn live_batches_arrive_in_order_with_their_content() {
    let publisher = publisher("kv-events", 0, 0).await;
    let (sub, mut rx) = subscriber(&publisher, "kv-events");
    let mut n = warm_up(&publisher, &mut rx).await;
    for _ in 0..20 {
        assert_eq!(publisher.publish(&batch(n)).await.unwrap(), n);
        n += 1;
    }
    for expect in n - 20..n {
        let event = next(&mut rx).await;
        let StreamEvent::Batch {
            seq,
            batch: got,
            source,
            ..
        } = &event
        else {
            panic!("expected a batch, got {event:?}");
        };
        assert_eq!(*seq, expect);
        assert_eq!(*source, Source::Live);
        // The publisher filled in its rank.
        assert_eq!(got.data_parallel_rank, Some(0));
        assert_eq!(hash_of(&event), Some(expect));
    }
    let status = sub.status();
    assert_eq!(status.state, StreamState::Live);
    assert_eq!(status.last_seq, Some(n - 1));
    assert_eq!(status.counters.batches, n);
    assert_eq!(status.counters.events, n);
    assert_eq!(status.counters.resets, 0);
    sub.shutdown().await;
    publisher.shutdown().await;
}

#[tokio::test]
async fn a_gap_is_recovered_by_replay() {
    let publisher = publisher("", 0, 0).await;
    let (sub, mut rx) = subscriber(&publisher, "");
    let n = warm_up(&publisher, &mut rx).await;
    // Three batches the PUB socket "drops", then one sent live.
    for i in 0..3 {
        publisher.publish_replay_only(&batch(n + i)).await;
    }
    publisher.publish(&batch(n + 3)).await.unwrap();
    for i in 0..4 {
        let event = next(&mut rx).await;
        assert_eq!(hash_of(&event), Some(n + i), "{event:?}");
        let StreamEvent::Batch { source, .. } = event else {
            unreachable!()
        };
        // The missing ones come from the replay; the live one may too.
        if i < 3 {
            assert_eq!(source, Source::Replay);
        }
    }
    let status = sub.status();
    assert_eq!(status.counters.gaps, 1);
    assert_eq!(status.counters.resets, 0);
    assert!(status.counters.replays >= 2, "catch-up and gap replays");
    assert_eq!(status.last_seq, Some(n + 3));
    sub.shutdown().await;
    publisher.shutdown().await;
}

#[tokio::test]
async fn a_gap_beyond_the_replay_buffer_resets() {
    let mut config = PublisherConfig::new("tcp://127.0.0.1:0");
    config.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    config.buffer_steps = 2;
    let publisher = Publisher::bind(config).await.unwrap();
    let (sub, mut rx) = subscriber(&publisher, "");
    // Warm up by hand: with a 2-batch buffer the catch-up may lose early
    // probes, so wait for any first batch and drain until quiet.
    let mut n = 0;
    let first = timeout(WAIT, async {
        loop {
            publisher.publish(&batch(n)).await.unwrap();
            n += 1;
            tokio::select! {
                event = rx.recv() => return event.unwrap(),
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    })
    .await
    .unwrap();
    let mut last = hash_of(&first);
    while last != Some(n - 1) {
        let event = next(&mut rx).await;
        if let Some(h) = hash_of(&event) {
            last = Some(h);
        }
    }
    let resets_before = sub.status().counters.resets;
    for i in 0..5 {
        publisher.publish_replay_only(&batch(n + i)).await;
    }
    publisher.publish(&batch(n + 5)).await.unwrap();
    let event = next(&mut rx).await;
    assert!(
        matches!(
            event,
            StreamEvent::Reset {
                reason: ResetReason::ReplayIncomplete { .. }
            }
        ),
        "{event:?}"
    );
    // After the reset the stream goes on from what the buffer still had.
    let event = next(&mut rx).await;
    assert_eq!(hash_of(&event), Some(n + 4));
    assert_eq!(hash_of(&next(&mut rx).await), Some(n + 5));
    assert_eq!(sub.status().counters.resets, resets_before + 1);
    sub.shutdown().await;
    publisher.shutdown().await;
}

#[tokio::test]
async fn a_restarted_publisher_is_detected_and_the_stream_reset() {
    let first = publisher("", 0, 0).await;
    let port = port_of(first.endpoint());
    let replay_port = port_of(first.replay_endpoint().unwrap());
    let (sub, mut rx) = subscriber(&first, "");
    let n = warm_up(&first, &mut rx).await;
    assert!(n >= 1);
    first.shutdown().await;

    // The engine comes back on the same ports, counting from 0 again.
    let second = rebind(port, replay_port).await;
    let event = timeout(WAIT, async {
        let mut i = 0;
        loop {
            second.publish(&batch(1000 + i)).await.unwrap();
            i += 1;
            tokio::select! {
                event = rx.recv() => return event.unwrap(),
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    })
    .await
    .expect("the subscriber reconnects");
    let StreamEvent::Reset { reason } = &event else {
        panic!("expected a reset first, got {event:?}");
    };
    assert!(
        matches!(
            reason,
            ResetReason::SequenceWentBack { .. } | ResetReason::PublisherReplaced { .. }
        ),
        "{reason:?}"
    );
    // Then the new lifetime from its start (caught up by replay).
    assert_eq!(hash_of(&next(&mut rx).await), Some(1000));
    let status = sub.status();
    assert!(status.counters.disconnects >= 1);
    assert!(status.counters.connects >= 2);
    assert_eq!(status.counters.resets, 1);
    sub.shutdown().await;
    second.shutdown().await;
}

#[tokio::test]
async fn a_publisher_that_comes_back_with_its_stream_loses_nothing() {
    // A stand-in for a network break: the same publisher state, new
    // sockets. Modelled by a publisher whose numbering continues: batches
    // published before the break are replayed by the new one.
    let first = publisher("", 0, 0).await;
    let port = port_of(first.endpoint());
    let replay_port = port_of(first.replay_endpoint().unwrap());
    let (sub, mut rx) = subscriber(&first, "");
    let n = warm_up(&first, &mut rx).await;
    first.shutdown().await;
    // Wait until the subscriber has noticed.
    timeout(WAIT, async {
        while sub.status().state != StreamState::Connecting {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the break is noticed");

    let second = rebind(port, replay_port).await;
    // Re-publish the same history (same bytes, same numbers), then more.
    for i in 0..n {
        second.publish_replay_only(&batch(i)).await;
    }
    let event = timeout(WAIT, async {
        let mut i = n;
        loop {
            second.publish(&batch(i)).await.unwrap();
            i += 1;
            tokio::select! {
                event = rx.recv() => return event.unwrap(),
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    })
    .await
    .expect("the subscriber reconnects");
    // The anchor (batch n - 1) matches: no reset, the stream continues.
    assert_eq!(hash_of(&event), Some(n), "{event:?}");
    let status = sub.status();
    assert_eq!(status.counters.resets, 0);
    assert!(status.counters.connects >= 2);
    sub.shutdown().await;
    second.shutdown().await;
}

fn port_of(endpoint: &str) -> u16 {
    endpoint.rsplit(':').next().unwrap().parse().unwrap()
}

/// Binds again on ports just released (retrying while the OS frees them).
async fn rebind(port: u16, replay_port: u16) -> Publisher {
    timeout(WAIT, async {
        loop {
            let mut config = PublisherConfig::new(format!("tcp://127.0.0.1:{port}"));
            config.replay_endpoint = Some(format!("tcp://127.0.0.1:{replay_port}"));
            config.data_parallel_rank = Some(0);
            match Publisher::bind(config).await {
                Ok(p) => return p,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await
    .expect("the ports are free again")
}
