//! A resilient subscriber: one task per engine stream that connects a SUB
//! socket, decodes batches, asks for replays on a DEALER socket, reconnects
//! with backoff, and hands ordered batches and resets to an [`EventSink`].
//!
//! # How it is put together
//!
//! The decisions live in [`Sequencer`]; this module only
//! moves bytes. The task waits on four things at once: the next live
//! message, the SUB socket's disconnect notice, answers of the replay in
//! flight, and the sequencer's replay deadline. Each replay uses a fresh
//! DEALER connection (gaps are rare; a fresh socket cannot mix answers of an
//! abandoned request into a new one), sending `["", start]` so that vLLM's
//! ROUTER sees the three frames it requires.
//!
//! The SUB socket is dropped and made again on disconnect, with exponential
//! backoff between attempts; the stream's position is kept, so a publisher
//! that comes back with the sequence it had loses nothing, and one that
//! restarted (sequence back at 0) is detected and reset.
//!
//! # Sockets and bounds
//!
//! The sockets are libzmq's, each read by its own thread (see
//! [`zmq_io`](crate::zmq_io) for why). The SUB and the replay DEALER refuse
//! any frame larger than [`DecodeLimits::max_payload_bytes`] before it is
//! allocated: libzmq closes such a connection, which the loop sees as a
//! disconnect (the stream goes to `Connecting`, then reconnects with
//! backoff). A connection counts as made when its ZMTP handshake succeeds
//! (libzmq's own reconnection is off: the loop decides when to retry).
//!
//! # Supervision
//!
//! The loop runs under a supervisor: if it ever ends (a panic in the sink
//! or the loop itself), the stream is marked `Connecting` at once (never
//! `Live` while nothing reads it), [`StreamCounters::restarts`] counts it,
//! the sink gets a [`ResetReason::ReaderRestarted`] reset (what it holds
//! from this stream is no longer vouched for), and after a backoff step a
//! fresh loop reconnects and catches up by replay as a new subscription
//! does.
//!
//! # Cancel safety
//!
//! Dropping a [`Subscriber`] aborts its task (and with it the socket
//! threads, joined within [`POLL_INTERVAL`](crate::zmq_io::POLL_INTERVAL));
//! batches not yet handed to the sink are lost with it (a new subscriber
//! starts cold).
//!
//! # Modules
//!
//! - `config`: [`SubscriberConfig`], [`Backoff`], [`endpoint_for_rank`].
//! - `sink`: [`StreamEvent`] and [`EventSink`].
//! - `status`: [`StreamCounters`] and [`StreamStatus`].
//! - `transport`: the loop's view of the sockets.
//! - `receive`: the receive loop.
//! - `supervisor`: the supervisor that restarts it.
//! - `sockets`: the real sockets; `replay`: one replay.

mod config;
mod receive;
mod replay;
mod sink;
mod sockets;
mod status;
mod supervisor;
mod transport;

#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex, PoisonError};

use tokio::task::JoinHandle;

pub use config::{Backoff, SubscriberConfig, endpoint_for_rank};
pub use sink::{EventSink, StreamEvent};
use sockets::ZmqTransport;
pub use status::{StreamCounters, StreamStatus};
use supervisor::supervise;

use crate::sequencer::StreamState;
#[cfg(doc)]
use crate::sequencer::{ResetReason, Sequencer};
#[cfg(doc)]
use crate::wire::DecodeLimits;

/// A running subscription to one engine's event stream.
#[derive(Debug)]
pub struct Subscriber {
    status: Arc<Mutex<StreamStatus>>,
    task: Option<JoinHandle<()>>,
}

impl Subscriber {
    /// Starts the subscription on the current tokio runtime.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime (as `tokio::spawn`).
    #[must_use]
    pub fn spawn(config: SubscriberConfig, sink: impl EventSink) -> Self {
        let transport = ZmqTransport {
            endpoint: config.endpoint.clone(),
            replay_endpoint: config.replay_endpoint.clone(),
            topic: config.topic.clone(),
            connect_timeout: config.connect_timeout,
            max_message_size: config.limits.max_payload_bytes,
        };
        let status = Arc::new(Mutex::new(StreamStatus {
            state: StreamState::Connecting,
            counters: StreamCounters::default(),
            last_seq: None,
        }));
        let task = tokio::spawn(supervise(config, transport, sink, Arc::clone(&status)));
        Self {
            status,
            task: Some(task),
        }
    }

    /// The stream's current state and counters.
    #[must_use]
    pub fn status(&self) -> StreamStatus {
        self.status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops the subscription and waits for its task to end.
    pub async fn shutdown(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}
