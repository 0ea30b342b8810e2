//! The loop's view of the sockets: a trait, so that the loop's timers are
//! tested with paused time and no network.

use std::future::Future;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::sequencer::ReplayId;

/// One live message's frames, or the end of the connection.
pub(crate) enum LiveMsg {
    Frames(Vec<Bytes>),
    Closed,
}

/// An answer on the replay channel.
pub(crate) enum ReplayMsg {
    Item(ReplayId, Bytes, Bytes),
    End(ReplayId),
    Failed(ReplayId),
}

/// The sockets, behind a trait so that the loop's timers are tested with
/// paused time and no network.
pub(crate) trait Transport: Send + 'static {
    type Live: LiveStream;
    fn connect(&mut self) -> impl Future<Output = Result<Self::Live, String>> + Send;
    fn has_replay(&self) -> bool;
    fn replay(&self, id: ReplayId, from: u64, answers: mpsc::Sender<ReplayMsg>) -> JoinHandle<()>;
}

/// Replay answers that may wait for the stream's loop. The replay task
/// stops reading its socket while this many wait, so a replay server that
/// sends more than it was asked for, or faster than the loop applies
/// batches, fills its own socket's buffers rather than the router's
/// memory; and a replay lasts at most the sequencer's `replay_timeout`.
pub(super) const REPLAY_ANSWER_QUEUE: usize = 64;

pub(crate) trait LiveStream: Send {
    fn next(&mut self) -> impl Future<Output = LiveMsg> + Send;
}
