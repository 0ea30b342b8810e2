//! What a subscriber hands on, and to what.

use tokio::sync::mpsc;

use crate::sequencer::{ResetReason, Source};
use crate::wire::EventBatch;

/// What the subscriber hands to its sink.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum StreamEvent {
    /// The next batch of the stream, in order.
    Batch {
        /// Its sequence number.
        seq: u64,
        /// The decoded batch.
        batch: EventBatch,
        /// Events of unknown type that were skipped in it.
        unknown_events: usize,
        /// Live or replayed.
        source: Source,
    },
    /// Forget everything learned from this stream (the engine's blocks):
    /// what follows starts from scratch.
    Reset {
        /// Why.
        reason: ResetReason,
    },
}

/// Where a subscriber delivers. Called from the subscriber's task, in
/// stream order; it should be quick (an index update), or hand the event
/// on. Closures and tokio's unbounded senders are sinks.
pub trait EventSink: Send + 'static {
    /// One event of the stream.
    fn on_event(&mut self, event: StreamEvent);
}

impl<F: FnMut(StreamEvent) + Send + 'static> EventSink for F {
    fn on_event(&mut self, event: StreamEvent) {
        self(event);
    }
}

impl EventSink for mpsc::UnboundedSender<StreamEvent> {
    fn on_event(&mut self, event: StreamEvent) {
        // A receiver that is gone wants nothing more.
        let _ = self.send(event);
    }
}
