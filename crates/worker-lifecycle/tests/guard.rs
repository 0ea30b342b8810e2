//! The load-guard matrix: every way a reservation can end brings the load
//! back to exactly 0 and never underflows.
#![cfg(not(loom))]

use std::sync::Arc;
use std::task::Poll;

use futures_util::{Stream, StreamExt};
use worker_lifecycle::{Endpoint, LoadGuard, Worker, WorkerOptions, WorkerRole, WorkerSpec};

fn worker() -> Arc<Worker> {
    let endpoint = Endpoint::new("http://127.0.0.1:9000", None).unwrap();
    Worker::new(
        WorkerSpec::new(WorkerRole::Decode, endpoint),
        1,
        &WorkerOptions::default(),
    )
}

fn assert_settled(worker: &Worker, processed: u64) {
    assert_eq!(worker.load(), 0, "load");
    assert_eq!(worker.underflows(), 0, "underflows");
    assert_eq!(worker.processed(), processed, "processed");
}

#[test]
fn drop_releases() {
    let w = worker();
    let guard = w.reserve();
    assert_eq!(w.load(), 1);
    assert!(!guard.is_released());
    drop(guard);
    assert_settled(&w, 1);
}

#[test]
fn release_then_drop_releases_once() {
    let w = worker();
    let guard = w.reserve();
    assert!(guard.release());
    assert!(guard.is_released());
    assert_settled(&w, 1);
    drop(guard);
    assert_settled(&w, 1);
}

#[test]
fn double_release_is_idempotent() {
    let w = worker();
    let guard = w.reserve();
    assert!(guard.release());
    assert!(!guard.release());
    assert!(!guard.release());
    drop(guard);
    assert_settled(&w, 1);
}

#[test]
fn shared_handles_release_once_when_both_dropped() {
    let w = worker();
    let first = w.reserve();
    let second = first.share();
    assert_eq!(w.load(), 1, "sharing does not reserve again");
    drop(first);
    assert_eq!(w.load(), 1, "the other handle still holds the reservation");
    assert!(!second.is_released());
    drop(second);
    assert_settled(&w, 1);
}

#[test]
fn release_through_one_shared_handle_ends_it_for_all() {
    let w = worker();
    let first = w.reserve();
    let second = first.share();
    let third = second.share();
    assert!(second.release());
    assert!(first.is_released() && third.is_released());
    assert!(!first.release());
    assert_settled(&w, 1);
    drop((first, second, third));
    assert_settled(&w, 1);
}

#[test]
fn many_guards_on_many_threads_settle_at_zero() {
    let w = worker();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let w = w.clone();
            std::thread::spawn(move || {
                for i in 0..2_000 {
                    let g = w.reserve();
                    match (i + t) % 4 {
                        0 => drop(g),
                        1 => {
                            g.release();
                            g.release();
                        }
                        2 => {
                            let s = g.share();
                            std::thread::yield_now();
                            drop(g);
                            drop(s);
                        }
                        _ => {
                            let s = g.share();
                            s.release();
                            drop(g);
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_settled(&w, 8_000);
}

#[tokio::test]
async fn guard_moved_into_an_aborted_task_is_released() {
    let w = worker();
    let guard = w.reserve();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let _guard = guard;
        started_tx.send(()).unwrap();
        std::future::pending::<()>().await;
    });
    started_rx.await.unwrap();
    assert_eq!(w.load(), 1, "held while the task runs");
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    assert_settled(&w, 1);
}

#[tokio::test]
async fn guard_in_a_cancelled_request_future_is_released() {
    let w = worker();
    let request = {
        let w = w.clone();
        async move {
            let _guard = w.reserve();
            tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
        }
    };
    tokio::time::pause();
    // The client gives up after one second: the request future is dropped.
    let result = tokio::time::timeout(std::time::Duration::from_secs(1), request).await;
    assert!(result.is_err());
    assert_settled(&w, 1);
}

/// A response body that owns its guard: yields `chunks` chunks, then ends
/// (and releases at end of stream).
fn body(guard: LoadGuard, chunks: usize) -> impl futures_util::Stream<Item = usize> {
    futures_util::stream::unfold((guard, 0), move |(guard, sent)| async move {
        if sent == chunks {
            guard.release();
            None
        } else {
            Some((sent, (guard, sent + 1)))
        }
    })
}

#[tokio::test]
async fn guard_in_a_stream_dropped_half_way_is_released() {
    let w = worker();
    let mut stream = Box::pin(body(w.reserve(), 10));
    for expected in 0..5 {
        assert_eq!(stream.next().await, Some(expected));
        assert_eq!(w.load(), 1, "load counted while the body streams");
    }
    drop(stream); // the client went away half-way
    assert_settled(&w, 1);
}

#[tokio::test]
async fn guard_in_a_stream_read_to_the_end_is_released_at_eof() {
    let w = worker();
    let mut stream = Box::pin(body(w.reserve(), 3));
    let mut seen = 0;
    while let Some(_chunk) = stream.next().await {
        seen += 1;
        assert_eq!(w.load(), 1);
    }
    assert_eq!(seen, 3);
    assert_settled(&w, 1);
    drop(stream);
    assert_settled(&w, 1);
}

#[tokio::test]
async fn a_stalled_stream_dropped_by_the_client_releases_without_another_poll() {
    let w = worker();
    let guard = w.reserve();
    let stalled = futures_util::stream::poll_fn(move |_| {
        let _hold = &guard;
        Poll::<Option<u8>>::Pending
    });
    let mut stalled = Box::pin(stalled);
    let poll = std::future::poll_fn(|cx| Poll::Ready(stalled.as_mut().poll_next(cx))).await;
    assert!(poll.is_pending());
    assert_eq!(w.load(), 1);
    drop(stalled);
    assert_settled(&w, 1);
}

#[test]
fn guards_on_two_workers_are_independent() {
    let a = worker();
    let b = worker();
    let ga = a.reserve();
    let gb1 = b.reserve();
    let gb2 = b.reserve();
    assert_eq!((a.load(), b.load()), (1, 2));
    drop(gb1);
    assert_eq!((a.load(), b.load()), (1, 1));
    drop((ga, gb2));
    assert_settled(&a, 1);
    assert_settled(&b, 2);
}

#[test]
fn guard_is_send_sync_and_static() {
    fn assert_traits<T: Send + Sync + 'static>() {}
    assert_traits::<LoadGuard>();
    assert_traits::<Arc<Worker>>();
}

#[tokio::test]
async fn guard_in_a_stream_that_fails_mid_body_is_released_at_the_error() {
    let w = worker();
    let guard = w.reserve();
    // Two chunks, then an upstream reset: the body ends with an error and
    // takes the guard with it.
    let items: Vec<Result<u8, &str>> = vec![Ok(1), Ok(2), Err("connection reset")];
    let mut stream = Box::pin(futures_util::stream::iter(items).map(move |item| {
        if item.is_err() {
            guard.release();
        }
        item
    }));
    assert_eq!(stream.next().await, Some(Ok(1)));
    assert_eq!(stream.next().await, Some(Ok(2)));
    assert_eq!(w.load(), 1);
    assert_eq!(stream.next().await, Some(Err("connection reset")));
    assert_settled(&w, 1);
    drop(stream);
    assert_settled(&w, 1);
}
