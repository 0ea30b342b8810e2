//! A publisher speaking vLLM's protocol: a PUB socket sending `[topic,
//! seq, payload]` and a ROUTER socket answering replay requests from a
//! bounded buffer, exactly as `ZmqEventPublisher` does (see the
//! [`wire`](crate::wire) module for the facts).
//!
//! It is what a simulated engine publishes through, and what the tests run
//! the subscriber against. Unlike vLLM's, it always binds (an engine's
//! endpoints are stable; routers connect) and publishes from the caller's
//! task instead of a queue and a thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use bytes::Bytes;

use crate::encode::encode_batch_as;
use crate::log_throttle::LogThrottle;
use crate::replay_buffer::ReplayBuffer;
use crate::wire::{EventBatch, WireFormat};
use crate::zmq_io::{DEFAULT_RECEIVE_HWM, POLL_INTERVAL, context, harden, last_endpoint};

/// The largest frame the PUB socket accepts from a subscriber: it only
/// receives subscriptions (a flag byte and a topic prefix; vLLM's topics are
/// a few bytes), so 4 KiB leaves room for any sane topic.
pub const PUB_MAX_MESSAGE_SIZE: usize = 4 << 10;

/// The largest frame the replay ROUTER accepts: a request is an empty
/// delimiter and an 8-byte start, so 1 KiB is generous.
pub const REPLAY_MAX_MESSAGE_SIZE: usize = 1 << 10;

/// How long the replay server waits for a slow client to take an answer
/// before it gives that request up (the client's sequencer times out and
/// asks again).
const REPLAY_SEND_TIMEOUT_MS: i32 = 1000;

/// The end-of-replay marker's sequence frame: `-1` as 8 signed big-endian
/// bytes.
pub const END_OF_REPLAY: [u8; 8] = [0xff; 8];

/// How a [`Publisher`] binds and what it sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherConfig {
    /// The PUB address, e.g. `tcp://0.0.0.0:5557` (port 0 picks a free
    /// one; see [`Publisher::endpoint`]).
    pub endpoint: String,
    /// The ROUTER address for replays, e.g. `tcp://0.0.0.0:5558`; `None`
    /// serves none.
    pub replay_endpoint: Option<String>,
    /// The topic frame (vLLM's default is empty).
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`, default 10 000).
    pub buffer_steps: usize,
    /// Written into batches that carry no rank, as vLLM's publisher does.
    pub data_parallel_rank: Option<u32>,
    /// The payload shape (default [`WireFormat::NAMED_EVENTS`]).
    pub format: WireFormat,
}

impl PublisherConfig {
    /// A configuration for `endpoint` with vLLM's defaults and no replay.
    #[must_use]
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            data_parallel_rank: None,
            format: WireFormat::default(),
        }
    }
}

/// Why publishing failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// A socket could not be bound.
    #[error("cannot bind {endpoint}: {source}")]
    Bind {
        /// The address.
        endpoint: String,
        /// The ZMQ error (or why the bound address could not be read).
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The PUB socket refused the message.
    #[error("cannot send on the PUB socket: {0}")]
    Send(zmq::Error),
}

/// A running publisher. Dropping it stops the replay server; call
/// [`shutdown`](Self::shutdown) to also wait for the sockets to close.
pub struct Publisher {
    /// libzmq's PUB socket never blocks a send (it drops at the
    /// high-water mark), so a plain mutex held for one send is enough.
    pub_socket: Mutex<Option<zmq::Socket>>,
    buffer: Arc<ReplayBuffer<Bytes>>,
    topic: Bytes,
    rank: Option<u32>,
    format: WireFormat,
    endpoint: String,
    replay_endpoint: Option<String>,
    replay_server: Option<ReplayServer>,
}

/// The replay ROUTER's thread and its stop flag.
struct ReplayServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for ReplayServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .field("next_seq", &self.buffer.next_seq())
            .finish_non_exhaustive()
    }
}

impl Publisher {
    /// Binds the sockets and starts the replay server (on the current
    /// tokio runtime).
    ///
    /// # Errors
    ///
    /// [`PublishError::Bind`] when an address cannot be bound.
    pub async fn bind(config: PublisherConfig) -> Result<Self, PublishError> {
        let bind_error =
            |endpoint: &str, source: Box<dyn std::error::Error + Send + Sync>| PublishError::Bind {
                endpoint: endpoint.to_owned(),
                source,
            };
        let bind = |kind: zmq::SocketType, address: &str, max: usize| {
            let socket = context()
                .socket(kind)
                .map_err(|e| bind_error(address, e.into()))?;
            harden(&socket, max, DEFAULT_RECEIVE_HWM).map_err(|e| bind_error(address, e.into()))?;
            socket
                .bind(address)
                .map_err(|e| bind_error(address, e.into()))?;
            let bound = last_endpoint(&socket).map_err(|e| bind_error(address, e.into()))?;
            Ok::<_, PublishError>((socket, bound))
        };
        let (pub_socket, endpoint) = bind(zmq::PUB, &config.endpoint, PUB_MAX_MESSAGE_SIZE)?;
        let buffer = Arc::new(ReplayBuffer::new(config.buffer_steps));
        let (replay_endpoint, replay_server) = match &config.replay_endpoint {
            Some(address) => {
                let (router, bound) = bind(zmq::ROUTER, address, REPLAY_MAX_MESSAGE_SIZE)?;
                // An answer to a client that is gone fails at once instead
                // of being dropped silently; one that is slow blocks the
                // send for at most the timeout.
                router
                    .set_router_mandatory(true)
                    .and_then(|()| router.set_sndtimeo(REPLAY_SEND_TIMEOUT_MS))
                    .map_err(|e| bind_error(address, e.into()))?;
                let stop = Arc::new(AtomicBool::new(false));
                let thread_stop = Arc::clone(&stop);
                let thread_buffer = Arc::clone(&buffer);
                let thread = std::thread::Builder::new()
                    .name("kv-events-replay-server".to_owned())
                    .spawn(move || serve_replays(&router, &thread_buffer, &thread_stop))
                    .map_err(|e| bind_error(address, e.into()))?;
                let server = ReplayServer {
                    stop,
                    thread: Some(thread),
                };
                (Some(bound), Some(server))
            }
            None => (None, None),
        };
        Ok(Self {
            pub_socket: Mutex::new(Some(pub_socket)),
            buffer,
            topic: Bytes::from(config.topic.into_bytes()),
            rank: config.data_parallel_rank,
            format: config.format,
            endpoint,
            replay_endpoint,
            replay_server,
        })
    }

    /// The PUB address as bound (with the port chosen for port 0).
    #[must_use]
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The ROUTER address as bound, when replays are served.
    #[must_use]
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The sequence number the next batch will get.
    #[must_use]
    pub fn next_seq(&self) -> u64 {
        self.buffer.next_seq()
    }

    fn payload(&self, batch: &EventBatch) -> Bytes {
        if batch.data_parallel_rank.is_none() && self.rank.is_some() {
            let mut batch = batch.clone();
            batch.data_parallel_rank = self.rank;
            Bytes::from(encode_batch_as(&batch, self.format))
        } else {
            Bytes::from(encode_batch_as(batch, self.format))
        }
    }

    /// Publishes a batch: gives it the next sequence number, keeps it for
    /// replay and sends it live. Returns its number. Concurrent calls are
    /// sent in number order.
    ///
    /// # Errors
    ///
    /// [`PublishError::Send`] when the PUB socket fails. The batch is still
    /// numbered and kept, so subscribers recover it by replay, as with a
    /// message vLLM's PUB socket dropped.
    pub async fn publish(&self, batch: &EventBatch) -> Result<u64, PublishError> {
        let payload = self.payload(batch);
        let socket = self
            .pub_socket
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let seq = self.buffer.push(payload.clone());
        if let Some(socket) = socket.as_ref() {
            // Reading ZMQ_EVENTS makes libzmq apply the subscriptions that
            // reached the socket (a send does so only every millisecond or
            // so): a subscriber whose handshake is done, and which may be
            // catching up by replay already, is not skipped by this batch.
            let _ = socket.get_events();
            let message = [&self.topic[..], &seq.to_be_bytes()[..], &payload[..]];
            socket
                .send_multipart(message, zmq::DONTWAIT)
                .map_err(PublishError::Send)?;
        }
        Ok(seq)
    }

    /// Numbers and keeps a batch without sending it live: what a subscriber
    /// sees when the PUB socket drops a message (high-water mark). For
    /// fault injection (a simulated engine's "drop an event" fault) and
    /// tests of gap recovery.
    pub async fn publish_replay_only(&self, batch: &EventBatch) -> u64 {
        let payload = self.payload(batch);
        // Same lock as `publish`, so numbers stay in send order.
        let _socket = self
            .pub_socket
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.buffer.push(payload)
    }

    /// Stops the replay server and closes the sockets.
    pub async fn shutdown(mut self) {
        // Joins the replay thread, which closes the ROUTER socket and
        // releases its port.
        drop(self.replay_server.take());
        drop(
            self.pub_socket
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
    }
}

/// Answers replay requests until `stop` is set.
fn serve_replays(router: &zmq::Socket, buffer: &ReplayBuffer<Bytes>, stop: &AtomicBool) {
    let timeout = i64::try_from(POLL_INTERVAL.as_millis()).unwrap_or(20);
    // Anyone who reaches the replay port can send malformed requests: one
    // warning per period, not one per request.
    let malformed_log = LogThrottle::default();
    while !stop.load(Ordering::Acquire) {
        match router.poll(zmq::POLLIN, timeout) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(zmq::Error::EINTR) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "replay socket poll failed; replays stop");
                return;
            }
        }
        let request = match router.recv_multipart(zmq::DONTWAIT) {
            Ok(request) => request,
            Err(e) => {
                tracing::debug!(error = %e, "replay socket receive failed");
                continue;
            }
        };
        // `[identity, empty delimiter, start]`, as vLLM requires.
        let [identity, delimiter, start] = request.as_slice() else {
            if let Some(suppressed) = malformed_log.admit() {
                tracing::warn!(
                    frames = request.len(),
                    suppressed,
                    "ignoring a replay request that is not 3 frames (suppressed: malformed requests not logged before it)"
                );
            }
            continue;
        };
        if !delimiter.is_empty() || start.len() > 8 {
            if let Some(suppressed) = malformed_log.admit() {
                tracing::warn!(
                    suppressed,
                    "ignoring a malformed replay request (suppressed: malformed requests not logged before it)"
                );
            }
            continue;
        }
        let from = start.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
        let replies = buffer
            .since(from)
            .into_iter()
            .map(|(seq, payload)| (seq.to_be_bytes(), payload))
            .chain(std::iter::once((END_OF_REPLAY, Bytes::new())));
        for (seq, payload) in replies {
            if stop.load(Ordering::Acquire) {
                return;
            }
            let message = [&identity[..], &[][..], &seq[..], &payload[..]];
            if let Err(e) = router.send_multipart(message, 0) {
                // The client went away or stopped reading; its next request
                // starts afresh.
                tracing::debug!(error = %e, "replay answer not delivered");
                break;
            }
        }
    }
}
