//! The sequencer against random streams: drops, duplicates, reorders,
//! publisher restarts, replays that answer fully, partially or never, and
//! timeouts. A reference consumer checks what a user of the stream relies
//! on; the publisher model is vLLM's (numbers from 0 per lifetime, a
//! bounded replay buffer answering `seq >= from`).
#![cfg(not(loom))]

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kv_events::{Action, ReplayId, Sequencer, SequencerConfig, StreamState};
use proptest::prelude::*;

/// What a published batch is: its publisher lifetime and number.
type Item = (u32, u64);

#[derive(Debug, Clone)]
enum Op {
    /// Publish the next batch; what the live stream does with it.
    Publish(Fate),
    /// The engine restarts: numbers start again at 0, buffer emptied; the
    /// connection breaks and comes back.
    Restart,
    /// The connection breaks and comes back; the engine keeps running.
    Blip,
    /// Time passes (ms).
    Tick(u16),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Deliver,
    Drop,
    Duplicate,
    /// Held back and delivered after the next published batch.
    Delay,
}

#[derive(Debug, Clone, Copy)]
enum ReplayMode {
    /// Every request is answered at once from the buffer.
    Answer,
    /// No request is ever answered (the deadline decides).
    Never,
    /// Requests are answered or not, by a per-request coin.
    Flaky,
}

struct Harness {
    machine: Sequencer<Item>,
    now: Instant,
    epoch: u32,
    next_seq: u64,
    buffer: Vec<(u64, Item)>,
    capacity: usize,
    mode: ReplayMode,
    coin: u64,
    delayed: Option<(u64, Item)>,
    // The reference consumer.
    last: Option<Item>,
    delivered: Vec<Item>,
    resets: usize,
    /// Live numbers the machine received, per lifetime.
    received_live: BTreeSet<Item>,
    /// Batches the machine was offered in replay answers.
    received_replayed: BTreeSet<Item>,
}

impl Harness {
    fn new(config: SequencerConfig, capacity: usize, mode: ReplayMode) -> Self {
        let mut machine = Sequencer::new(config);
        machine.on_connected();
        let mut harness = Self {
            machine,
            now: Instant::now(),
            epoch: 0,
            next_seq: 0,
            buffer: Vec::new(),
            capacity,
            mode,
            coin: 0x9E37_79B9_7F4A_7C15,
            delayed: None,
            last: None,
            delivered: Vec::new(),
            resets: 0,
            received_live: BTreeSet::new(),
            received_replayed: BTreeSet::new(),
        };
        harness.connected();
        harness
    }

    /// What the subscriber does on every connection: catch up at once.
    fn connected(&mut self) {
        self.machine.catch_up_now(self.now);
        self.drain();
    }

    fn fingerprint(item: Item) -> u64 {
        (u64::from(item.0) << 40) ^ item.1
    }

    fn live(&mut self, seq: u64, item: Item) {
        self.received_live.insert(item);
        self.machine
            .on_live(seq, Self::fingerprint(item), item, self.now);
        self.drain();
    }

    fn flip(&mut self) -> bool {
        self.coin ^= self.coin << 13;
        self.coin ^= self.coin >> 7;
        self.coin ^= self.coin << 17;
        self.coin & 1 == 0
    }

    fn answer(&mut self, id: ReplayId, from: u64) {
        let answer = match self.mode {
            ReplayMode::Answer => true,
            ReplayMode::Never => false,
            ReplayMode::Flaky => self.flip(),
        };
        if !answer {
            return;
        }
        let items: Vec<_> = self
            .buffer
            .iter()
            .filter(|(s, _)| *s >= from)
            .copied()
            .collect();
        for (seq, item) in items {
            self.received_replayed.insert(item);
            self.machine
                .on_replay(id, seq, Self::fingerprint(item), item, self.now);
        }
        self.machine.on_replay_end(id);
    }

    /// Carries out the machine's actions and checks each delivery against
    /// the reference consumer.
    fn drain(&mut self) {
        while let Some(action) = self.machine.poll_action() {
            match action {
                Action::Deliver { seq, item, .. } => {
                    assert_eq!(item.1, seq, "delivered under another number");
                    if let Some(last) = self.last {
                        assert!(
                            item.0 == last.0 && item.1 == last.1 + 1,
                            "silent discontinuity: {last:?} then {item:?}"
                        );
                    }
                    self.last = Some(item);
                    self.delivered.push(item);
                }
                Action::Reset(_) => {
                    self.resets += 1;
                    self.last = None;
                }
                Action::RequestReplay { id, from } => self.answer(id, from),
            }
        }
    }

    fn reconnect(&mut self) {
        self.machine.on_disconnected();
        self.drain();
        self.machine.on_connected();
        self.connected();
    }

    fn run(&mut self, ops: &[Op]) {
        for op in ops {
            match op {
                Op::Publish(fate) => {
                    let seq = self.next_seq;
                    self.next_seq += 1;
                    let item = (self.epoch, seq);
                    self.buffer.push((seq, item));
                    if self.buffer.len() > self.capacity {
                        self.buffer.remove(0);
                    }
                    let delayed = self.delayed.take();
                    match fate {
                        Fate::Deliver => self.live(seq, item),
                        Fate::Drop => {}
                        Fate::Duplicate => {
                            self.live(seq, item);
                            self.live(seq, item);
                        }
                        Fate::Delay => self.delayed = Some((seq, item)),
                    }
                    if let Some((s, i)) = delayed {
                        self.live(s, i);
                    }
                }
                Op::Restart => {
                    if let Some((s, i)) = self.delayed.take() {
                        self.live(s, i);
                    }
                    self.epoch += 1;
                    self.next_seq = 0;
                    self.buffer.clear();
                    self.reconnect();
                }
                Op::Blip => {
                    if let Some((s, i)) = self.delayed.take() {
                        self.live(s, i);
                    }
                    self.reconnect();
                }
                Op::Tick(ms) => {
                    self.now += Duration::from_millis(u64::from(*ms));
                    self.machine.on_timeout(self.now);
                    self.drain();
                }
            }
        }
        // Let any replay in flight time out, so everything buffered is out.
        self.now += Duration::from_secs(3600);
        self.machine.on_timeout(self.now);
        self.drain();
        assert!(self.machine.poll_timeout().is_none());
    }
}

fn fate(drops: bool, dups: bool, delays: bool) -> impl Strategy<Value = Fate> {
    prop_oneof![
        8 => Just(Fate::Deliver),
        (if drops { 2 } else { 0 }) => Just(Fate::Drop),
        (if dups { 1 } else { 0 }) => Just(Fate::Duplicate),
        (if delays { 1 } else { 0 }) => Just(Fate::Delay),
    ]
}

fn ops(drops: bool, dups: bool, delays: bool, restarts: bool) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            20 => fate(drops, dups, delays).prop_map(Op::Publish),
            (if restarts { 1 } else { 0 }) => Just(Op::Restart),
            1 => Just(Op::Blip),
            2 => (0u16..3000).prop_map(Op::Tick),
        ],
        0..120,
    )
}

fn config(catch_up: bool) -> SequencerConfig {
    SequencerConfig {
        catch_up,
        max_buffered: 16,
        ..SequencerConfig::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever happens, the consumer never sees a silent discontinuity or
    /// the same batch twice without a reset between (checked in `drain`).
    #[test]
    fn never_a_silent_discontinuity(
        ops in ops(true, true, true, true),
        capacity in 0usize..12,
        mode in prop_oneof![Just(ReplayMode::Answer), Just(ReplayMode::Never), Just(ReplayMode::Flaky)],
        catch_up in any::<bool>(),
        replay in any::<bool>(),
    ) {
        let mut cfg = config(catch_up);
        cfg.replay = replay;
        let mut h = Harness::new(cfg, capacity, mode);
        h.run(&ops);
        let counters = h.machine.counters();
        prop_assert_eq!(counters.delivered as usize, h.delivered.len());
        prop_assert_eq!(counters.resets as usize, h.resets);
    }

    /// With drops and duplicates but a replay buffer that holds everything
    /// and always answers, nothing is lost and nothing reset: every batch up
    /// to the newest one the machine received is delivered, in order. The
    /// newest may have come only in a replay: a reconnect before anything
    /// was delivered catches up from 0, bringing batches the live stream
    /// dropped.
    #[test]
    fn perfect_replay_recovers_every_gap(ops in ops(true, true, false, false)) {
        let mut h = Harness::new(config(true), usize::MAX, ReplayMode::Answer);
        h.run(&ops);
        prop_assert_eq!(h.resets, 0);
        let newest = h.received_live.union(&h.received_replayed).map(|i| i.1).max();
        let expected: Vec<Item> = match newest {
            Some(n) => (0..=n).map(|s| (0, s)).collect(),
            None => Vec::new(),
        };
        prop_assert_eq!(&h.delivered, &expected);
        prop_assert_eq!(h.machine.state(), StreamState::Live);
    }

    /// Restarts without losses: each is one reset, and every batch of
    /// every lifetime is delivered.
    #[test]
    fn restarts_reset_once_and_lose_nothing(ops in ops(false, false, false, true)) {
        let mut h = Harness::new(config(true), usize::MAX, ReplayMode::Answer);
        h.run(&ops);
        let lifetimes_seen: BTreeSet<u32> = h.received_live.iter().map(|i| i.0).collect();
        prop_assert_eq!(h.resets, lifetimes_seen.len().saturating_sub(1));
        let all: Vec<Item> = h.received_live.iter().copied().collect();
        prop_assert_eq!(&h.delivered, &all);
    }
}

#[test]
fn a_replay_that_never_answers_times_out_into_a_reset() {
    let mut h = Harness::new(config(true), 100, ReplayMode::Never);
    h.run(&[Op::Publish(Fate::Deliver), Op::Publish(Fate::Drop)]);
    // Seq 2 shows the gap; the replay is never answered.
    h.run(&[Op::Publish(Fate::Deliver)]);
    assert_eq!(h.resets, 1);
    assert_eq!(h.delivered, vec![(0, 0), (0, 2)]);
    let c = h.machine.counters();
    // Two unanswered replays: the connection's catch-up, then the gap's.
    assert_eq!((c.gaps, c.replays, c.replay_timeouts), (1, 2, 2));
}

#[test]
fn the_replay_deadline_is_exact() {
    let mut m: Sequencer<u64> = Sequencer::new(SequencerConfig {
        replay_timeout: Duration::from_millis(500),
        ..SequencerConfig::default()
    });
    m.on_connected();
    let t0 = Instant::now();
    m.on_live(0, 0, 0, t0);
    m.on_live(3, 3, 3, t0);
    assert_eq!(m.state(), StreamState::Replaying { from: 0 });
    assert_eq!(m.poll_timeout(), Some(t0 + Duration::from_millis(500)));
    m.on_timeout(t0 + Duration::from_millis(499));
    assert_eq!(m.state(), StreamState::Replaying { from: 0 });
    m.on_timeout(t0 + Duration::from_millis(500));
    assert_eq!(m.state(), StreamState::Live);
    let actions: Vec<_> = std::iter::from_fn(|| m.poll_action()).collect();
    assert!(
        matches!(
            actions.as_slice(),
            [
                Action::Deliver { seq: 0, .. },
                // From the anchor: the last delivered batch.
                Action::RequestReplay { from: 0, .. },
                Action::Reset(kv_events::ResetReason::ReplayTimedOut { missing_from: 1 }),
                Action::Deliver { seq: 3, .. },
            ]
        ),
        "{actions:?}"
    );
}

/// A second batch lost while the first gap's replay runs: the answer is a
/// snapshot taken before it was published, so the machine asks again
/// rather than reset (found by engine-sim's dropped-batch test under load).
#[test]
fn a_batch_lost_after_the_replay_was_asked_is_asked_for_again() {
    let mut m: Sequencer<u64> = Sequencer::new(SequencerConfig {
        catch_up: false,
        ..SequencerConfig::default()
    });
    m.on_connected();
    let t0 = Instant::now();
    for seq in 0..=3 {
        m.on_live(seq, seq, seq, t0);
    }
    // 4 dropped: 5 shows the gap, a replay from 3 is asked for.
    m.on_live(5, 5, 5, t0);
    // 6 dropped too, after the publisher answered from its buffer; 7 live.
    m.on_live(7, 7, 7, t0);
    let first = std::iter::from_fn(|| m.poll_action())
        .find_map(|action| match action {
            Action::RequestReplay { id, from } => Some((id, from)),
            _ => None,
        })
        .unwrap();
    assert_eq!(first.1, 3);
    for seq in 3..=5 {
        m.on_replay(first.0, seq, seq, seq, t0);
    }
    m.on_replay_end(first.0);
    let actions: Vec<_> = std::iter::from_fn(|| m.poll_action()).collect();
    let again = actions.iter().find_map(|action| match action {
        Action::RequestReplay { id, from } => Some((*id, *from)),
        _ => None,
    });
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Reset(_))),
        "{actions:?}"
    );
    let (id, from) = again.expect("asked again");
    assert_eq!(from, 5, "from the last delivered batch");
    for seq in 5..=7 {
        m.on_replay(id, seq, seq, seq, t0);
    }
    m.on_replay_end(id);
    let delivered: Vec<u64> = actions
        .into_iter()
        .chain(std::iter::from_fn(|| m.poll_action()))
        .filter_map(|action| match action {
            Action::Deliver { seq, .. } => Some(seq),
            Action::Reset(reason) => panic!("reset: {reason:?}"),
            _ => None,
        })
        .collect();
    assert_eq!(delivered, [4, 5, 6, 7]);
    assert_eq!(m.state(), StreamState::Live);
    assert_eq!(m.counters().resets, 0);
}
