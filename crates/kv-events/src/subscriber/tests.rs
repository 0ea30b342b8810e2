//! The loop's timers (reconnect backoff, replay deadline) with paused
//! time and an in-memory transport: exact virtual durations, no network.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::replay::replay_once;
use super::transport::{LiveMsg, LiveStream, REPLAY_ANSWER_QUEUE, ReplayMsg, Transport};
use super::*;
use crate::encode::encode_batch;
use crate::sequencer::{ReplayId, ResetReason, Source};
use crate::wire::EventBatch;
use crate::zmq_io::context;

struct FakeTransport {
    attempts: Arc<Mutex<Vec<Instant>>>,
    fail_first: usize,
    /// The connections it makes, in order.
    lives: std::collections::VecDeque<mpsc::UnboundedReceiver<LiveMsg>>,
    replays: mpsc::UnboundedSender<(ReplayId, u64)>,
}

struct FakeLive(mpsc::UnboundedReceiver<LiveMsg>);

impl LiveStream for FakeLive {
    async fn next(&mut self) -> LiveMsg {
        match self.0.recv().await {
            // The test's way to make the loop crash.
            Some(LiveMsg::Frames(frames)) if frames.first().is_some_and(|f| f == "panic") => {
                panic!("the reader broke")
            }
            Some(msg) => msg,
            None => LiveMsg::Closed,
        }
    }
}

impl Transport for FakeTransport {
    type Live = FakeLive;

    fn connect(&mut self) -> impl Future<Output = Result<FakeLive, String>> + Send {
        let mut attempts = self.attempts.lock().unwrap();
        attempts.push(Instant::now());
        let result = if attempts.len() <= self.fail_first {
            Err("refused".to_owned())
        } else {
            self.lives
                .pop_front()
                .map(FakeLive)
                .ok_or_else(|| "gone".to_owned())
        };
        std::future::ready(result)
    }

    fn has_replay(&self) -> bool {
        true
    }

    fn replay(&self, id: ReplayId, from: u64, _answers: mpsc::Sender<ReplayMsg>) -> JoinHandle<()> {
        // Recorded, never answered.
        let _ = self.replays.send((id, from));
        tokio::spawn(async {})
    }
}

fn frames(seq: u64) -> LiveMsg {
    let payload = encode_batch(&EventBatch::new(seq as f64, Vec::new()));
    LiveMsg::Frames(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ])
}

/// A replay server that answers one request with far more batches
/// than were asked for and never ends: the replay task stops reading
/// once REPLAY_ANSWER_QUEUE answers wait, and reads on as they are
/// taken.
#[tokio::test]
async fn a_replay_flood_waits_for_the_loop_instead_of_queueing() {
    let router = context().socket(zmq::ROUTER).unwrap();
    router.set_linger(0).unwrap();
    router.set_sndtimeo(100).unwrap();
    router.bind("tcp://127.0.0.1:0").unwrap();
    let endpoint = crate::zmq_io::last_endpoint(&router).unwrap();
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let server_sent = Arc::clone(&sent);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let server_stop = Arc::clone(&stop);
    let server = std::thread::spawn(move || {
        router.set_rcvtimeo(10_000).unwrap();
        let request = router.recv_multipart(0).unwrap();
        let identity = request[0].clone();
        let mut seq = 0u64;
        while !server_stop.load(std::sync::atomic::Ordering::Relaxed) {
            let payload = encode_batch(&EventBatch::new(seq as f64, Vec::new()));
            let message = [
                identity.clone(),
                Vec::new(),
                seq.to_be_bytes().to_vec(),
                payload,
            ];
            // Blocks (up to the send timeout) while the client's
            // buffers are full.
            if router.send_multipart(message, 0).is_ok() {
                server_sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                seq += 1;
            }
        }
    });
    let (answers_tx, mut answers) = mpsc::channel(REPLAY_ANSWER_QUEUE);
    let replay =
        tokio::spawn(
            async move { replay_once(&endpoint, 1 << 20, ReplayId(1), 0, &answers_tx).await },
        );
    // Nobody takes answers: the queue fills and stays full.
    let deadline = Instant::now() + Duration::from_secs(10);
    while answers.len() < REPLAY_ANSWER_QUEUE && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(answers.len(), REPLAY_ANSWER_QUEUE);
    assert!(
        !replay.is_finished(),
        "the replay task waits, it does not end"
    );
    // Taking answers lets more in, in order.
    for expected in 0..(2 * REPLAY_ANSWER_QUEUE as u64) {
        match tokio::time::timeout(Duration::from_secs(10), answers.recv()).await {
            Ok(Some(ReplayMsg::Item(ReplayId(1), seq, _))) => {
                assert_eq!(seq.as_ref(), expected.to_be_bytes());
            }
            _ => panic!("answer {expected} missing"),
        }
    }
    assert!(answers.len() <= REPLAY_ANSWER_QUEUE);
    assert!(sent.load(std::sync::atomic::Ordering::Relaxed) >= 2 * REPLAY_ANSWER_QUEUE);
    replay.abort();
    let _ = replay.await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    server.join().unwrap();
}

struct Rig {
    attempts: Arc<Mutex<Vec<Instant>>>,
    live: mpsc::UnboundedSender<LiveMsg>,
    replays: mpsc::UnboundedReceiver<(ReplayId, u64)>,
    events: mpsc::UnboundedReceiver<StreamEvent>,
    status: Arc<Mutex<StreamStatus>>,
    task: JoinHandle<()>,
}

fn rig(fail_first: usize, config: SubscriberConfig) -> Rig {
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let (live_tx, live_rx) = mpsc::unbounded_channel();
    let (replays_tx, replays) = mpsc::unbounded_channel();
    let (events_tx, events) = mpsc::unbounded_channel();
    let transport = FakeTransport {
        attempts: Arc::clone(&attempts),
        fail_first,
        lives: [live_rx].into(),
        replays: replays_tx,
    };
    let status = Arc::new(Mutex::new(StreamStatus {
        state: StreamState::Connecting,
        counters: StreamCounters::default(),
        last_seq: None,
    }));
    let task = tokio::spawn(supervise(config, transport, events_tx, Arc::clone(&status)));
    Rig {
        attempts,
        live: live_tx,
        replays,
        events,
        status,
        task,
    }
}

#[tokio::test(start_paused = true)]
async fn reconnect_attempts_back_off_exponentially_up_to_the_cap() {
    let mut config = SubscriberConfig::new("tcp://fake:1").with_replay("tcp://fake:2");
    config.backoff = Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_millis(250),
    };
    let mut rig = rig(4, config);
    // The fifth attempt connects; a live batch then comes through.
    rig.live.send(frames(0)).unwrap();
    let event = rig.events.recv().await.unwrap();
    assert!(
        matches!(event, StreamEvent::Batch { seq: 0, .. }),
        "{event:?}"
    );
    let attempts = rig.attempts.lock().unwrap().clone();
    let gaps: Vec<_> = attempts.windows(2).map(|w| w[1] - w[0]).collect();
    let ms = Duration::from_millis;
    assert_eq!(gaps, vec![ms(100), ms(200), ms(250), ms(250)]);
    let status = rig.status.lock().unwrap().clone();
    assert_eq!(status.counters.connect_failures, 4);
    assert_eq!(status.counters.connects, 1);
    assert_eq!(status.state, StreamState::Live);
    rig.task.abort();
}

#[tokio::test(start_paused = true)]
async fn a_connection_catches_up_at_once_without_waiting_for_a_live_batch() {
    let config = SubscriberConfig::new("tcp://fake:1").with_replay("tcp://fake:2");
    let mut rig = rig(0, config);
    let t0 = Instant::now();
    let (_, from) = rig.replays.recv().await.unwrap();
    assert_eq!(from, 0, "the whole buffer is asked for");
    assert_eq!(Instant::now(), t0, "at connection time, before any batch");
    let status = rig.status.lock().unwrap().clone();
    assert_eq!(status.state, StreamState::Replaying { from: 0 });
    assert_eq!(status.counters.replays, 1);
    rig.task.abort();
}

#[tokio::test(start_paused = true)]
async fn an_unanswered_replay_resets_exactly_at_its_deadline() {
    let mut config = SubscriberConfig::new("tcp://fake:1").with_replay("tcp://fake:2");
    config.sequencer.replay_timeout = Duration::from_millis(750);
    // Only the gap's replay is under test, not the catch-up on connect.
    config.sequencer.catch_up = false;
    let mut rig = rig(0, config);
    rig.live.send(frames(0)).unwrap();
    assert!(matches!(
        rig.events.recv().await.unwrap(),
        StreamEvent::Batch { seq: 0, .. }
    ));
    let t0 = Instant::now();
    rig.live.send(frames(2)).unwrap();
    let (_, from) = rig.replays.recv().await.unwrap();
    assert_eq!(
        from, 0,
        "the replay starts at the anchor, the last delivered batch"
    );
    let event = rig.events.recv().await.unwrap();
    assert_eq!(Instant::now() - t0, Duration::from_millis(750));
    assert!(
        matches!(
            event,
            StreamEvent::Reset {
                reason: ResetReason::ReplayTimedOut { missing_from: 1 }
            }
        ),
        "{event:?}"
    );
    assert!(matches!(
        rig.events.recv().await.unwrap(),
        StreamEvent::Batch {
            seq: 2,
            source: Source::Live,
            ..
        }
    ));
    let counters = rig.status.lock().unwrap().counters;
    assert_eq!(
        (counters.gaps, counters.replay_timeouts, counters.resets),
        (1, 1, 1)
    );
    rig.task.abort();
}

#[tokio::test(start_paused = true)]
async fn a_lost_connection_is_retried_after_the_first_backoff_step() {
    let mut config = SubscriberConfig::new("tcp://fake:1");
    config.backoff.initial = Duration::from_millis(300);
    let mut rig = rig(0, config);
    rig.live.send(frames(0)).unwrap();
    assert!(rig.events.recv().await.is_some());
    rig.live.send(LiveMsg::Closed).unwrap();
    // The fake has one connection only: the next attempt fails, and the
    // one after is another backoff step later.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let attempts = rig.attempts.lock().unwrap().clone();
    assert_eq!(attempts.len(), 3, "{attempts:?}");
    assert_eq!(attempts[2] - attempts[1], Duration::from_millis(600));
    let status = rig.status.lock().unwrap().clone();
    assert_eq!(status.state, StreamState::Connecting);
    assert_eq!(status.counters.disconnects, 1);
    rig.task.abort();
}

#[tokio::test(start_paused = true)]
async fn a_crashed_reader_is_restarted_counted_and_cold_until_it_reads_again() {
    let mut config = SubscriberConfig::new("tcp://fake:1");
    config.backoff.initial = Duration::from_millis(200);
    let (first_tx, first_rx) = mpsc::unbounded_channel();
    let (second_tx, second_rx) = mpsc::unbounded_channel();
    let (replays_tx, _replays) = mpsc::unbounded_channel();
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let transport = FakeTransport {
        attempts: Arc::new(Mutex::new(Vec::new())),
        fail_first: 0,
        lives: [first_rx, second_rx].into(),
        replays: replays_tx,
    };
    let status = Arc::new(Mutex::new(StreamStatus {
        state: StreamState::Connecting,
        counters: StreamCounters::default(),
        last_seq: None,
    }));
    let task = tokio::spawn(supervise(config, transport, events_tx, Arc::clone(&status)));
    let snapshot = || status.lock().unwrap().clone();
    first_tx.send(frames(0)).unwrap();
    assert!(matches!(
        events.recv().await.unwrap(),
        StreamEvent::Batch { seq: 0, .. }
    ));
    assert_eq!(snapshot().state, StreamState::Live);
    // The reader crashes: the stream is cold at once, the restart is
    // counted, and the sink is told to forget the stream.
    first_tx
        .send(LiveMsg::Frames(vec![Bytes::from_static(b"panic")]))
        .unwrap();
    let event = events.recv().await.unwrap();
    assert_eq!(
        event,
        StreamEvent::Reset {
            reason: ResetReason::ReaderRestarted
        }
    );
    let down = snapshot();
    assert_eq!(down.state, StreamState::Connecting);
    assert_eq!(down.counters.restarts, 1);
    assert_eq!(down.counters.batches, 1, "counters survive the restart");
    // After the backoff step a fresh loop connects and reads again.
    tokio::time::sleep(Duration::from_millis(250)).await;
    second_tx.send(frames(1)).unwrap();
    assert!(matches!(
        events.recv().await.unwrap(),
        StreamEvent::Batch { seq: 1, .. }
    ));
    let up = snapshot();
    assert_eq!(up.state, StreamState::Live);
    assert_eq!(up.counters.restarts, 1);
    assert_eq!(up.counters.batches, 2);
    assert_eq!(up.counters.connects, 2);
    task.abort();
}

#[test]
fn rank_endpoints_follow_vllm() {
    assert_eq!(
        endpoint_for_rank("tcp://*:5557", 0).unwrap(),
        "tcp://*:5557"
    );
    assert_eq!(
        endpoint_for_rank("tcp://10.0.0.5:5557", 3).unwrap(),
        "tcp://10.0.0.5:5560"
    );
    assert_eq!(
        endpoint_for_rank("inproc://cache", 2).unwrap(),
        "inproc://cache_dp2"
    );
    assert_eq!(endpoint_for_rank("tcp://host:65535", 1), None);
    assert_eq!(endpoint_for_rank("ipc:///tmp/x", 1), None);
    // The TCP address is a `ZmqEndpoint`, or there is no rank's.
    assert_eq!(
        endpoint_for_rank("tcp://[::1]:5557", 2).unwrap(),
        "tcp://[::1]:5559"
    );
    assert_eq!(endpoint_for_rank("tcp://*:5557", 1), None);
    assert_eq!(endpoint_for_rank("tcp://host", 1), None);
    assert_eq!(endpoint_for_rank("tcp://h:1\r\nx:2", 1), None);
}

#[test]
fn backoff_doubles_and_caps() {
    let b = Backoff::default();
    assert_eq!(b.delay(1), Duration::from_millis(100));
    assert_eq!(b.delay(3), Duration::from_millis(400));
    assert_eq!(b.delay(10), Duration::from_secs(5));
    assert_eq!(b.delay(u32::MAX), Duration::from_secs(5));
}

/// What a `tracing` subscriber writes, kept for the test to read.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A publisher whose sequence numbers go back on every message resets the
/// stream each time: every reset is counted and reaches the sink, but the
/// log gets one line per period, not one per message.
#[tokio::test(start_paused = true)]
async fn a_flood_of_resets_is_counted_each_and_logged_at_a_bounded_rate() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    let started = std::time::Instant::now();
    let mut config = SubscriberConfig::new("tcp://fake:1");
    // Without replay each step back is one reset, and nothing waits.
    config.sequencer.replay = false;
    let mut rig = rig(0, config);
    const FLOOD: u64 = 1_000;
    for seq in (1..=FLOOD).rev() {
        // Each message goes back from the one before.
        rig.live.send(frames(seq)).unwrap();
    }
    let mut resets = 0u64;
    while resets < FLOOD - 1 {
        match rig.events.recv().await.unwrap() {
            StreamEvent::Reset { .. } => resets += 1,
            StreamEvent::Batch { .. } => {}
        }
    }
    let elapsed = started.elapsed();
    assert_eq!(rig.status.lock().unwrap().counters.resets, FLOOD - 1);
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let lines = text
        .lines()
        .filter(|line| line.contains("KV event stream reset"))
        .count() as u64;
    let periods = elapsed.as_secs() / crate::DEFAULT_LOG_PERIOD.as_secs() + 1;
    assert!(lines >= 1, "the first reset is logged:\n{text}");
    assert!(
        lines <= periods,
        "{lines} lines for {FLOOD} resets in {elapsed:?}:\n{text}"
    );
    rig.task.abort();
}
