//! A publisher speaking vLLM's protocol: a PUB socket sending `[topic,
//! seq, payload]` and a ROUTER socket answering replay requests from a
//! bounded buffer, exactly as `ZmqEventPublisher` does (see the
//! [`wire`](crate::wire) module for the facts).
//!
//! It is what a simulated engine publishes through, and what the tests run
//! the subscriber against. Unlike vLLM's, it always binds (an engine's
//! endpoints are stable; routers connect) and publishes from the caller's
//! task instead of a queue and a thread.

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::Mutex as AsyncMutex;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::encode::encode_batch_as;
use crate::replay_buffer::ReplayBuffer;
use crate::wire::{EventBatch, WireFormat};

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
        /// The ZMQ error.
        source: zeromq::ZmqError,
    },
    /// The PUB socket refused the message.
    #[error("cannot send on the PUB socket: {0}")]
    Send(zeromq::ZmqError),
}

/// A running publisher. Dropping it stops the replay server; call
/// [`shutdown`](Self::shutdown) to also wait for the sockets to close.
pub struct Publisher {
    pub_socket: AsyncMutex<zeromq::PubSocket>,
    buffer: Arc<ReplayBuffer<Bytes>>,
    topic: Bytes,
    rank: Option<u32>,
    format: WireFormat,
    endpoint: String,
    replay_endpoint: Option<String>,
    replay_task: Option<JoinHandle<()>>,
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
        let mut pub_socket = zeromq::PubSocket::new();
        let endpoint = pub_socket
            .bind(&config.endpoint)
            .await
            .map_err(|source| PublishError::Bind {
                endpoint: config.endpoint.clone(),
                source,
            })?
            .to_string();
        let buffer = Arc::new(ReplayBuffer::new(config.buffer_steps));
        let (replay_endpoint, replay_task) = match &config.replay_endpoint {
            Some(address) => {
                let mut router = zeromq::RouterSocket::new();
                let bound = router
                    .bind(address)
                    .await
                    .map_err(|source| PublishError::Bind {
                        endpoint: address.clone(),
                        source,
                    })?;
                let task = tokio::spawn(serve_replays(router, Arc::clone(&buffer)));
                (Some(bound.to_string()), Some(task))
            }
            None => (None, None),
        };
        Ok(Self {
            pub_socket: AsyncMutex::new(pub_socket),
            buffer,
            topic: Bytes::from(config.topic.into_bytes()),
            rank: config.data_parallel_rank,
            format: config.format,
            endpoint,
            replay_endpoint,
            replay_task,
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
        let mut socket = self.pub_socket.lock().await;
        let seq = self.buffer.push(payload.clone());
        let message = frames([
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ]);
        socket.send(message).await.map_err(PublishError::Send)?;
        Ok(seq)
    }

    /// Numbers and keeps a batch without sending it live: what a subscriber
    /// sees when the PUB socket drops a message (high-water mark). For
    /// fault injection (a simulated engine's "drop an event" fault) and
    /// tests of gap recovery.
    pub async fn publish_replay_only(&self, batch: &EventBatch) -> u64 {
        let payload = self.payload(batch);
        // Same lock as `publish`, so numbers stay in send order.
        let _socket = self.pub_socket.lock().await;
        self.buffer.push(payload)
    }

    /// Stops the replay server and closes the sockets.
    pub async fn shutdown(mut self) {
        if let Some(task) = self.replay_task.take() {
            task.abort();
            // The task owns the ROUTER socket: once it has ended, the
            // socket is dropped and its port released.
            let _ = task.await;
        }
        let socket = std::mem::replace(
            &mut self.pub_socket,
            AsyncMutex::new(zeromq::PubSocket::new()),
        );
        let _ = socket.into_inner().close().await;
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Some(task) = self.replay_task.take() {
            task.abort();
        }
    }
}

/// Answers replay requests until the task is aborted.
async fn serve_replays(mut router: zeromq::RouterSocket, buffer: Arc<ReplayBuffer<Bytes>>) {
    loop {
        let request = match router.recv().await {
            Ok(request) => request.into_vec(),
            Err(e) => {
                tracing::debug!(error = %e, "replay socket receive failed");
                continue;
            }
        };
        // `[identity, empty delimiter, start]`, as vLLM requires.
        let [identity, delimiter, start] = request.as_slice() else {
            tracing::warn!(
                frames = request.len(),
                "ignoring a replay request that is not 3 frames"
            );
            continue;
        };
        if !delimiter.is_empty() || start.len() > 8 {
            tracing::warn!("ignoring a malformed replay request");
            continue;
        }
        let from = start.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
        let mut replies = buffer
            .since(from)
            .into_iter()
            .map(|(seq, payload)| (Bytes::copy_from_slice(&seq.to_be_bytes()), payload))
            .collect::<Vec<_>>();
        replies.push((Bytes::from_static(&END_OF_REPLAY), Bytes::new()));
        for (seq, payload) in replies {
            let message = frames([identity.clone(), Bytes::new(), seq, payload]);
            if let Err(e) = router.send(message).await {
                // The client went away; its next request starts afresh.
                tracing::debug!(error = %e, "replay answer not delivered");
                break;
            }
        }
    }
}

/// A multipart message of the given frames (`N >= 1`).
pub(crate) fn frames<const N: usize>(frames: [Bytes; N]) -> ZmqMessage {
    let mut frames = frames.into_iter();
    let mut message = ZmqMessage::from(frames.next().unwrap_or_default());
    for frame in frames {
        message.push_back(frame);
    }
    message
}
