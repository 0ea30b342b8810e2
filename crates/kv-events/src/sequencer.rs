//! The sequence state machine of one event stream, without sockets.
//!
//! # Why a separate machine
//!
//! Everything that can go wrong with a stream shows up in its sequence
//! numbers: a dropped message is a gap, a restarted engine counts from 0
//! again, a replay answers with what its buffer still holds. Deciding what
//! to deliver, what to ask again and when the consumer's view can no longer
//! be trusted is pure logic; [`Sequencer`] does it with time passed in, so
//! tests drive it through millions of orderings (proptest against a
//! reference consumer) and the subscriber's socket loop stays thin.
//!
//! # The rules
//!
//! - The consumer receives batches in sequence order, each once. Between
//!   two delivered batches without an [`Action::Reset`] in between, the
//!   second's sequence number is the first's plus one: **the consumer never
//!   sees a silent discontinuity**.
//! - A live batch ahead of the next expected one is a **gap**: the machine
//!   asks for a replay and buffers the live batches that arrive meanwhile
//!   (up to [`SequencerConfig::max_buffered`]). Replayed batches are
//!   delivered in order, duplicates skipped, then the buffer drains.
//! - The replay starts one batch early, at the last delivered one (the
//!   **anchor**): its fingerprint (a hash of the payload) must match what
//!   was delivered. That is how a publisher that restarted and already
//!   counted past our position is told apart from the same publisher: vLLM's
//!   messages carry no epoch, only numbers from 0. A mismatch resets the
//!   stream and catches up on the new publisher from 0; an anchor the buffer
//!   no longer holds resets it too (the lineage cannot be checked).
//! - After a reconnect the first live batch is checked the same way, even
//!   when its number is the expected one: a restarted engine also breaks
//!   the connection. A replay running when the connection drops is ended
//!   there (with a reset if batches are still missing), so batches from
//!   before and after the break are never joined unchecked.
//! - If the replay does not bring the missing range (the publisher's buffer
//!   no longer holds it), times out, or the buffer overflows, the machine
//!   emits [`Action::Reset`] and continues from the oldest batch it has:
//!   the consumer clears what it knew about this stream and starts over.
//! - A live sequence number at or below the last live one (other than the
//!   same message twice, recognised by its fingerprint) means the publisher
//!   restarted: [`Action::Reset`], then the new stream is taken from its
//!   start, by replay from 0 when [`SequencerConfig::catch_up`] is on.
//! - The first batch of a stream (and the first after a reset) is taken as
//!   it comes; with `catch_up` the machine first asks for a replay from 0,
//!   so an engine that was running before we subscribed still has its
//!   buffered history applied.
//!
//! What the checks cannot see: without replay, a restart whose first
//! received number is above the last one seen (and whose connection break
//! went unnoticed) continues the old stream. With `replay` off the machine
//! therefore resets on every gap and every reconnect.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// Where a delivered batch came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// The live PUB stream.
    Live,
    /// A replay answer.
    Replay,
}

/// Identifies one replay request, so that answers to an abandoned one are
/// ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplayId(pub u64);

/// Why the consumer must forget what it learned from a stream.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ResetReason {
    /// A live sequence number went backwards: the publisher restarted.
    SequenceWentBack {
        /// The last live number before.
        last: u64,
        /// The number received.
        got: u64,
    },
    /// The replay ended without the missing batches (no longer buffered).
    ReplayIncomplete {
        /// The first missing number.
        missing_from: u64,
        /// Where the stream continues.
        resumed_at: u64,
    },
    /// The replay did not finish in time.
    ReplayTimedOut {
        /// The first missing number.
        missing_from: u64,
    },
    /// More live batches arrived during a replay than may be buffered.
    ReplayOverflow {
        /// The first missing number.
        missing_from: u64,
    },
    /// The replay's anchor batch differs from the one delivered: the
    /// publisher was replaced (restarted) without the numbers showing it.
    PublisherReplaced {
        /// The anchor's number.
        anchor: u64,
    },
    /// The connection broke while batches were missing.
    Interrupted {
        /// The first missing number.
        missing_from: u64,
    },
    /// The connection broke and replay is off, so the stream's lineage
    /// cannot be checked.
    Reconnected,
    /// The subscriber's receive task ended (an error, a panic) and was
    /// restarted: what it had delivered cannot be vouched for.
    ReaderRestarted,
    /// A gap, and replay is off.
    Gap {
        /// The number expected.
        expected: u64,
        /// The number received.
        got: u64,
    },
}

impl std::fmt::Display for ResetReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::SequenceWentBack { last, got } => {
                write!(
                    f,
                    "sequence went back from {last} to {got} (publisher restarted)"
                )
            }
            Self::ReplayIncomplete {
                missing_from,
                resumed_at,
            } => write!(
                f,
                "replay lacked batches {missing_from}..{resumed_at} (no longer buffered)"
            ),
            Self::ReplayTimedOut { missing_from } => {
                write!(f, "replay from {missing_from} timed out")
            }
            Self::ReplayOverflow { missing_from } => {
                write!(
                    f,
                    "too many live batches buffered during the replay from {missing_from}"
                )
            }
            Self::PublisherReplaced { anchor } => {
                write!(
                    f,
                    "replayed batch {anchor} differs from the one delivered (publisher replaced)"
                )
            }
            Self::Interrupted { missing_from } => {
                write!(
                    f,
                    "connection lost while batches from {missing_from} were missing"
                )
            }
            Self::Reconnected => write!(f, "reconnected without replay to check the stream"),
            Self::ReaderRestarted => write!(f, "the receive task was restarted"),
            Self::Gap { expected, got } => {
                write!(f, "gap: expected {expected}, got {got}, and replay is off")
            }
        }
    }
}

/// What the machine asks its driver to do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action<T> {
    /// Hand this batch to the consumer.
    Deliver {
        /// Its sequence number.
        seq: u64,
        /// The batch.
        item: T,
        /// Live or replayed.
        source: Source,
    },
    /// The consumer must clear everything it learned from this stream.
    Reset(ResetReason),
    /// Ask the publisher for every batch from `from` on.
    RequestReplay {
        /// The request's identity, to pass back with its answers.
        id: ReplayId,
        /// The first sequence number wanted.
        from: u64,
    },
}

/// The state of a stream, for status pages and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamState {
    /// Not connected to the publisher (yet, or any more).
    Connecting,
    /// Connected and in sync as far as the sequence numbers show.
    Live,
    /// Waiting for a replay from `from`.
    Replaying {
        /// The first missing sequence number.
        from: u64,
    },
    /// The consumer was told to reset and nothing was delivered since.
    Cold {
        /// Why.
        reason: ResetReason,
    },
}

/// How a [`Sequencer`] behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequencerConfig {
    /// Ask for replays at all (default true; off when the publisher has no
    /// replay endpoint).
    pub replay: bool,
    /// Replay from 0 before the first batch of a stream (default true).
    pub catch_up: bool,
    /// How long a replay may take before the gap is given up (default 2 s).
    pub replay_timeout: Duration,
    /// Most live batches held while a replay runs (default 4 096).
    pub max_buffered: usize,
}

impl Default for SequencerConfig {
    fn default() -> Self {
        Self {
            replay: true,
            catch_up: true,
            replay_timeout: Duration::from_secs(2),
            max_buffered: 4096,
        }
    }
}

/// What happened on a stream so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SequencerCounters {
    /// Live batches received (duplicates included).
    pub live: u64,
    /// Replayed batches received for a current request.
    pub replayed: u64,
    /// Batches delivered to the consumer.
    pub delivered: u64,
    /// Batches skipped as already delivered.
    pub duplicates: u64,
    /// Gaps seen in the live stream.
    pub gaps: u64,
    /// Replays requested.
    pub replays: u64,
    /// Replays that timed out.
    pub replay_timeouts: u64,
    /// Resets told to the consumer.
    pub resets: u64,
}

#[derive(Debug)]
struct Run<T> {
    id: ReplayId,
    from: u64,
    deadline: Instant,
    /// The last delivered number and fingerprint, until the replay has
    /// shown the same batch.
    anchor: Option<(u64, u64)>,
    /// Live batches (with fingerprints) received while the replay runs.
    pending: BTreeMap<u64, (u64, T)>,
    /// The newest live number seen when the replay was asked for: the
    /// publisher's answer is a snapshot of its buffer at about that time.
    seen: Option<u64>,
}

/// Why a replay run ended.
#[derive(Clone, Copy)]
enum Finish {
    Ended,
    TimedOut,
    Overflow,
    Interrupted,
}

/// The sequence state machine of one stream. `T` is the batch type (the
/// subscriber uses decoded batches; tests use anything).
#[derive(Debug)]
pub struct Sequencer<T> {
    config: SequencerConfig,
    /// The next number to deliver; `None` when cold (nothing to continue).
    next: Option<u64>,
    /// The last live number and its fingerprint.
    last_live: Option<(u64, u64)>,
    /// The fingerprint of the last delivered batch.
    last_fp: u64,
    /// The connection broke since the last delivery: check the lineage.
    verify: bool,
    run: Option<Run<T>>,
    next_id: u64,
    connected: bool,
    cold: Option<ResetReason>,
    counters: SequencerCounters,
    actions: VecDeque<Action<T>>,
}

impl<T> Sequencer<T> {
    /// A machine for a new stream: not connected, nothing delivered.
    #[must_use]
    pub fn new(config: SequencerConfig) -> Self {
        Self {
            config,
            next: None,
            last_live: None,
            last_fp: 0,
            verify: false,
            run: None,
            next_id: 0,
            connected: false,
            cold: None,
            counters: SequencerCounters::default(),
            actions: VecDeque::new(),
        }
    }

    /// The stream's state.
    #[must_use]
    pub fn state(&self) -> StreamState {
        if !self.connected {
            StreamState::Connecting
        } else if let Some(run) = &self.run {
            StreamState::Replaying { from: run.from }
        } else if let Some(reason) = &self.cold {
            StreamState::Cold {
                reason: reason.clone(),
            }
        } else {
            StreamState::Live
        }
    }

    /// The counters so far.
    #[must_use]
    pub fn counters(&self) -> SequencerCounters {
        self.counters
    }

    /// The last delivered sequence number, if the stream is warm.
    #[must_use]
    pub fn last_delivered(&self) -> Option<u64> {
        self.next.and_then(|n| n.checked_sub(1))
    }

    /// When [`on_timeout`](Self::on_timeout) must be called next.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.run.as_ref().map(|r| r.deadline)
    }

    /// The next action to carry out, oldest first.
    pub fn poll_action(&mut self) -> Option<Action<T>> {
        self.actions.pop_front()
    }

    /// The connection to the publisher is up.
    pub fn on_connected(&mut self) {
        self.connected = true;
    }

    /// Starts the catch-up replay from 0 at once, without waiting for a
    /// live batch: a subscriber that joins an idle engine still learns what
    /// it holds (and one whose first live batches were lost to the PUB
    /// socket's slow-joiner window gets them back). Does nothing unless
    /// connected, replay and catch-up are on, nothing was delivered since
    /// the start or the last reset, and no replay runs. Live batches that
    /// arrive meanwhile wait for the replay, as in any run.
    pub fn catch_up_now(&mut self, now: Instant) {
        if self.connected
            && self.config.replay
            && self.config.catch_up
            && self.next.is_none()
            && self.run.is_none()
        {
            self.start_run_with(0, None, BTreeMap::new(), now + self.config.replay_timeout);
        }
    }

    /// The connection to the publisher is down. The stream's position is
    /// kept: a reconnect that continues the sequence loses nothing.
    pub fn on_disconnected(&mut self) {
        self.connected = false;
        if self.run.is_some() {
            self.finish(Finish::Interrupted);
        }
        self.verify = self.next.is_some();
    }

    /// A live batch. `fingerprint` identifies its content (a hash of the
    /// payload), so the same message twice is not mistaken for a restart.
    pub fn on_live(&mut self, seq: u64, fingerprint: u64, item: T, now: Instant) {
        self.counters.live += 1;
        if let Some((last, last_fp)) = self.last_live {
            if seq == last && fingerprint == last_fp {
                self.counters.duplicates += 1;
                return;
            }
            if seq <= last {
                self.run = None;
                self.reset(ResetReason::SequenceWentBack { last, got: seq });
            }
        }
        self.last_live = Some((seq, fingerprint));
        if let Some(run) = &mut self.run {
            run.pending.insert(seq, (fingerprint, item));
            if run.pending.len() > self.config.max_buffered {
                self.finish(Finish::Overflow);
            }
            return;
        }
        let verify = std::mem::take(&mut self.verify);
        match self.next {
            None if seq == 0 || !self.config.replay || !self.config.catch_up => {
                self.deliver(seq, fingerprint, item, Source::Live);
            }
            None => self.start_run(0, None, seq, fingerprint, item, now),
            Some(n) if seq < n && !verify => self.counters.duplicates += 1,
            Some(n) if seq == n && !verify => self.deliver(seq, fingerprint, item, Source::Live),
            Some(n) => {
                if seq > n {
                    self.counters.gaps += 1;
                }
                if self.config.replay {
                    let anchor = (n.saturating_sub(1), self.last_fp);
                    self.start_run(anchor.0, Some(anchor), seq, fingerprint, item, now);
                } else {
                    self.reset(if seq > n {
                        ResetReason::Gap {
                            expected: n,
                            got: seq,
                        }
                    } else {
                        ResetReason::Reconnected
                    });
                    self.deliver(seq, fingerprint, item, Source::Live);
                }
            }
        }
    }

    /// A batch answered to replay request `id`.
    pub fn on_replay(&mut self, id: ReplayId, seq: u64, fingerprint: u64, item: T, now: Instant) {
        let Some(run) = self.run.as_mut().filter(|r| r.id == id) else {
            return;
        };
        self.counters.replayed += 1;
        if let Some((anchor, anchor_fp)) = run.anchor {
            if seq < anchor {
                return;
            }
            run.anchor = None;
            if seq == anchor {
                if fingerprint == anchor_fp {
                    // Same publisher: the anchor itself was delivered.
                    self.counters.duplicates += 1;
                } else {
                    self.replaced(anchor, now);
                }
                return;
            }
            // The anchor is gone from the buffer: nothing can be checked.
            let missing_from = anchor + 1;
            self.reset(ResetReason::ReplayIncomplete {
                missing_from,
                resumed_at: seq,
            });
        }
        self.accept(seq, fingerprint, item, Source::Replay, Finish::Ended);
        self.drain_pending(false, Finish::Ended);
    }

    /// Replay request `id` sent its end marker.
    pub fn on_replay_end(&mut self, id: ReplayId) {
        if self.run.as_ref().is_some_and(|r| r.id == id) {
            self.finish(Finish::Ended);
        }
    }

    /// Replay request `id` failed (the socket broke): handled as a timeout.
    pub fn on_replay_failed(&mut self, id: ReplayId) {
        if self.run.as_ref().is_some_and(|r| r.id == id) {
            self.counters.replay_timeouts += 1;
            self.finish(Finish::TimedOut);
        }
    }

    /// Time passed; gives up a replay whose deadline is reached.
    pub fn on_timeout(&mut self, now: Instant) {
        if self.run.as_ref().is_some_and(|r| now >= r.deadline) {
            self.counters.replay_timeouts += 1;
            self.finish(Finish::TimedOut);
        }
    }

    fn start_run(
        &mut self,
        from: u64,
        anchor: Option<(u64, u64)>,
        seq: u64,
        fingerprint: u64,
        item: T,
        now: Instant,
    ) {
        let mut pending = BTreeMap::new();
        pending.insert(seq, (fingerprint, item));
        self.start_run_with(from, anchor, pending, now + self.config.replay_timeout);
    }

    fn start_run_with(
        &mut self,
        from: u64,
        anchor: Option<(u64, u64)>,
        pending: BTreeMap<u64, (u64, T)>,
        deadline: Instant,
    ) {
        let id = ReplayId(self.next_id);
        self.next_id += 1;
        self.counters.replays += 1;
        self.run = Some(Run {
            id,
            from,
            deadline,
            anchor,
            pending,
            seen: self.last_live.map(|(seq, _)| seq),
        });
        self.actions.push_back(Action::RequestReplay { id, from });
    }

    /// The anchor differs: reset and catch up on the new publisher from 0,
    /// keeping the live batches received meanwhile.
    fn replaced(&mut self, anchor: u64, now: Instant) {
        let pending = self.run.take().map(|r| r.pending).unwrap_or_default();
        self.reset(ResetReason::PublisherReplaced { anchor });
        self.start_run_with(0, None, pending, now + self.config.replay_timeout);
    }

    fn reset(&mut self, reason: ResetReason) {
        self.counters.resets += 1;
        self.next = None;
        self.verify = false;
        self.cold = Some(reason.clone());
        self.actions.push_back(Action::Reset(reason));
    }

    fn deliver(&mut self, seq: u64, fingerprint: u64, item: T, source: Source) {
        self.counters.delivered += 1;
        self.next = Some(seq.saturating_add(1));
        self.last_fp = fingerprint;
        self.cold = None;
        self.actions
            .push_back(Action::Deliver { seq, item, source });
    }

    fn reason(why: Finish, missing_from: u64, resumed_at: u64) -> ResetReason {
        match why {
            Finish::Ended => ResetReason::ReplayIncomplete {
                missing_from,
                resumed_at,
            },
            Finish::TimedOut => ResetReason::ReplayTimedOut { missing_from },
            Finish::Overflow => ResetReason::ReplayOverflow { missing_from },
            Finish::Interrupted => ResetReason::Interrupted { missing_from },
        }
    }

    /// Delivers `seq` if it is next, skips it if already delivered, and
    /// resets first if batches before it are missing for good.
    fn accept(&mut self, seq: u64, fingerprint: u64, item: T, source: Source, why: Finish) {
        match self.next {
            None => self.deliver(seq, fingerprint, item, source),
            Some(n) if seq < n => self.counters.duplicates += 1,
            Some(n) if seq == n => self.deliver(seq, fingerprint, item, source),
            Some(n) => {
                self.reset(Self::reason(why, n, seq));
                self.deliver(seq, fingerprint, item, source);
            }
        }
    }

    /// Delivers buffered live batches: those that are next (while the
    /// replay runs), or all of them (when it is over).
    fn drain_pending(&mut self, all: bool, why: Finish) {
        loop {
            let Some(run) = &mut self.run else { return };
            let Some(entry) = run.pending.first_entry() else {
                return;
            };
            let seq = *entry.key();
            let ready = all || self.next.is_some_and(|n| seq <= n);
            if !ready {
                return;
            }
            let (fingerprint, item) = entry.remove();
            self.accept(seq, fingerprint, item, Source::Live, why);
        }
    }

    /// A replay that ended normally answered from a snapshot of the
    /// publisher's buffer taken when it was asked. A batch published after
    /// that snapshot and dropped live (the PUB socket's high-water mark, a
    /// second loss while the first was being repaired) leaves a gap before
    /// the live batches held meanwhile; it is still in the buffer, so it is
    /// asked for again (from the last delivered batch, as the anchor)
    /// instead of resetting. Only when live batches newer than the snapshot
    /// were seen: a batch older than it that the answer lacked is gone for
    /// good. The new request has the old one's deadline plus one timeout.
    fn ask_again_for_a_newer_gap(&mut self) -> bool {
        let Some(run) = &self.run else { return false };
        let (Some(next), None) = (self.next, run.anchor) else {
            return false;
        };
        let first_pending = run.pending.keys().next().copied();
        let newer_live = self
            .last_live
            .is_some_and(|(seq, _)| run.seen.is_none_or(|seen| seq > seen));
        if !(first_pending.is_some_and(|p| p > next) && newer_live) {
            return false;
        }
        let Some(run) = self.run.take() else {
            return false;
        };
        self.counters.gaps += 1;
        let anchor = next.saturating_sub(1);
        self.start_run_with(
            anchor,
            Some((anchor, self.last_fp)),
            run.pending,
            run.deadline + self.config.replay_timeout,
        );
        true
    }

    fn finish(&mut self, why: Finish) {
        if matches!(why, Finish::Ended) && self.ask_again_for_a_newer_gap() {
            return;
        }
        // An anchor never checked: what follows cannot be joined to what
        // was delivered.
        if let Some((anchor, _)) = self.run.as_ref().and_then(|r| r.anchor)
            && self.next.is_some()
        {
            let resumed_at = self
                .run
                .as_ref()
                .and_then(|r| r.pending.keys().next().copied())
                .unwrap_or(anchor + 1);
            self.reset(Self::reason(why, anchor + 1, resumed_at));
        }
        self.drain_pending(true, why);
        self.run = None;
    }
}
