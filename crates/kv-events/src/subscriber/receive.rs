//! The receive loop: live messages, replay answers and the sequencer's
//! deadline in, batches and resets out to the sink.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::transport::{LiveMsg, LiveStream, REPLAY_ANSWER_QUEUE, ReplayMsg, Transport};
use super::{EventSink, StreamCounters, StreamEvent, StreamStatus, SubscriberConfig};
use crate::decode::decode_batch_with;
use crate::log_throttle::LogThrottle;
use crate::sequencer::{Action, Sequencer};
use crate::wire::EventBatch;

struct Loop<'a, S> {
    config: SubscriberConfig,
    machine: Sequencer<(EventBatch, usize)>,
    counters: StreamCounters,
    /// The counters of the loops before this one (restarts), which the
    /// sequencer's own counters are added to.
    base: StreamCounters,
    sink: &'a mut S,
    status: Arc<Mutex<StreamStatus>>,
    replay_task: Option<JoinHandle<()>>,
    /// Undecodable batches are counted each; their warning is rate-limited
    /// (the publisher is whatever a registration named).
    undecodable_log: LogThrottle,
    /// Resets are counted each ([`StreamCounters::resets`]); a publisher
    /// that sends its sequence numbers backwards or out of order can cause
    /// one per message, so their log line is rate-limited too.
    reset_log: LogThrottle,
}

pub(super) async fn run<T: Transport, S: EventSink>(
    mut config: SubscriberConfig,
    transport: &mut T,
    sink: &mut S,
    status: Arc<Mutex<StreamStatus>>,
) {
    if !transport.has_replay() {
        config.sequencer.replay = false;
    }
    let base = status
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .counters;
    let mut lp = Loop {
        machine: Sequencer::new(config.sequencer.clone()),
        config,
        counters: base,
        base,
        sink,
        status,
        replay_task: None,
        undecodable_log: LogThrottle::default(),
        reset_log: LogThrottle::default(),
    };
    let (answers_tx, mut answers) = mpsc::channel(REPLAY_ANSWER_QUEUE);
    let mut failures = 0u32;
    loop {
        lp.publish_status();
        let mut live = match transport.connect().await {
            Ok(live) => live,
            Err(e) => {
                failures = failures.saturating_add(1);
                lp.counters.connect_failures += 1;
                let delay = lp.config.backoff.delay(failures);
                tracing::debug!(endpoint = %lp.config.endpoint, error = %e, ?delay, "KV event stream: connect failed");
                lp.publish_status();
                tokio::time::sleep(delay).await;
                continue;
            }
        };
        lp.counters.connects += 1;
        lp.machine.on_connected();
        // Learn what the engine already holds, even if it is idle now.
        lp.machine.catch_up_now(Instant::now().into_std());
        lp.apply(&*transport, &answers_tx);
        loop {
            let deadline = lp.machine.poll_timeout().map(Instant::from_std);
            tokio::select! {
                // Replay answers first: a replay's end marker that is
                // already here is applied before a live batch that came
                // after it, so the replay is judged on everything it sent.
                biased;
                Some(answer) = answers.recv() => lp.on_answer(answer),
                msg = live.next() => match msg {
                    LiveMsg::Frames(frames) => lp.on_live(frames),
                    LiveMsg::Closed => break,
                },
                () = sleep_until(deadline) => lp.machine.on_timeout(Instant::now().into_std()),
            }
            lp.apply(&*transport, &answers_tx);
        }
        lp.counters.disconnects += 1;
        lp.machine.on_disconnected();
        // Ending the replay may deliver what was buffered (after a reset).
        lp.apply(&*transport, &answers_tx);
        if let Some(task) = lp.replay_task.take() {
            task.abort();
        }
        failures = 1;
        tokio::time::sleep(lp.config.backoff.delay(failures)).await;
    }
}

/// A payload's fingerprint, to recognise the same batch (a duplicate, or
/// the replay's anchor). Payloads carry the engine's timestamp, so two
/// different batches practically never share bytes.
fn fingerprint(payload: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    payload.hash(&mut hasher);
    hasher.finish()
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

impl<S> Drop for Loop<'_, S> {
    fn drop(&mut self) {
        // A loop that ends (or unwinds) takes its replay with it.
        if let Some(task) = self.replay_task.take() {
            task.abort();
        }
    }
}

impl<S: EventSink> Loop<'_, S> {
    fn on_live(&mut self, frames: Vec<Bytes>) {
        self.counters.messages += 1;
        let [_topic, seq, payload] = frames.as_slice() else {
            self.counters.decode_errors += 1;
            return;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
            self.counters.decode_errors += 1;
            return;
        };
        match decode_batch_with(payload, &self.config.limits) {
            Ok(decoded) => {
                self.machine.on_live(
                    seq,
                    fingerprint(payload),
                    (decoded.batch, decoded.unknown_events),
                    Instant::now().into_std(),
                );
            }
            Err(e) => {
                // Not fed to the sequencer: the batch is lost, which the
                // next one shows as a gap (and a replay may recover it).
                self.counters.decode_errors += 1;
                if let Some(suppressed) = self.undecodable_log.admit() {
                    tracing::warn!(
                        endpoint = %self.config.endpoint,
                        seq,
                        error = %e,
                        suppressed,
                        "undecodable KV event batch (suppressed: earlier ones not logged)"
                    );
                }
            }
        }
    }

    fn on_answer(&mut self, answer: ReplayMsg) {
        match answer {
            ReplayMsg::Item(id, seq, payload) => {
                let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
                    self.counters.decode_errors += 1;
                    return;
                };
                match decode_batch_with(&payload, &self.config.limits) {
                    Ok(decoded) => self.machine.on_replay(
                        id,
                        seq,
                        fingerprint(&payload),
                        (decoded.batch, decoded.unknown_events),
                        Instant::now().into_std(),
                    ),
                    Err(_) => self.counters.decode_errors += 1,
                }
            }
            ReplayMsg::End(id) => self.machine.on_replay_end(id),
            ReplayMsg::Failed(id) => self.machine.on_replay_failed(id),
        }
    }

    fn apply<T: Transport>(&mut self, transport: &T, answers: &mpsc::Sender<ReplayMsg>) {
        while let Some(action) = self.machine.poll_action() {
            match action {
                Action::Deliver { seq, item, source } => {
                    let (batch, unknown_events) = item;
                    self.counters.batches += 1;
                    self.counters.events += batch.events.len() as u64;
                    self.counters.unknown_events += unknown_events as u64;
                    self.sink.on_event(StreamEvent::Batch {
                        seq,
                        batch,
                        unknown_events,
                        source,
                    });
                }
                Action::Reset(reason) => {
                    if let Some(suppressed) = self.reset_log.admit() {
                        tracing::info!(
                            endpoint = %self.config.endpoint,
                            %reason,
                            suppressed,
                            "KV event stream reset (suppressed: earlier resets not logged)"
                        );
                    }
                    self.sink.on_event(StreamEvent::Reset { reason });
                }
                Action::RequestReplay { id, from } => {
                    if let Some(task) = self.replay_task.take() {
                        task.abort();
                    }
                    self.replay_task = Some(transport.replay(id, from, answers.clone()));
                }
            }
        }
        // A finished or abandoned replay needs its connection no more.
        if self.machine.poll_timeout().is_none()
            && let Some(task) = self.replay_task.take()
        {
            task.abort();
        }
        self.publish_status();
    }

    fn publish_status(&self) {
        let m = self.machine.counters();
        let mut counters = self.counters;
        counters.duplicates = self.base.duplicates + m.duplicates;
        counters.gaps = self.base.gaps + m.gaps;
        counters.replays = self.base.replays + m.replays;
        counters.replay_timeouts = self.base.replay_timeouts + m.replay_timeouts;
        counters.resets = self.base.resets + m.resets;
        let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        status.state = self.machine.state();
        status.counters = counters;
        status.last_seq = self.machine.last_delivered();
    }
}
