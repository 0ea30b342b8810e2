//! What a stream reports: its counters and a status snapshot.

use crate::sequencer::StreamState;

/// Counters of one stream, for metrics and status pages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamCounters {
    /// Batches delivered to the sink.
    pub batches: u64,
    /// Events in the delivered batches.
    pub events: u64,
    /// Events of unknown type skipped.
    pub unknown_events: u64,
    /// Live messages received (valid or not).
    pub messages: u64,
    /// Batches skipped as already delivered.
    pub duplicates: u64,
    /// Gaps seen in the live stream.
    pub gaps: u64,
    /// Replays requested.
    pub replays: u64,
    /// Replays that timed out or failed.
    pub replay_timeouts: u64,
    /// Resets sent to the sink.
    pub resets: u64,
    /// Messages or payloads that could not be decoded.
    pub decode_errors: u64,
    /// Successful connections.
    pub connects: u64,
    /// Failed connection attempts.
    pub connect_failures: u64,
    /// Connections lost.
    pub disconnects: u64,
    /// Times the receive loop ended (an error, a panic) and was restarted
    /// by its supervisor.
    pub restarts: u64,
}

/// A snapshot of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStatus {
    /// Where the stream is.
    pub state: StreamState,
    /// What happened so far.
    pub counters: StreamCounters,
    /// The last delivered sequence number, when warm.
    pub last_seq: Option<u64>,
}
