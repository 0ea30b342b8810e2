//! Publishing the prefix cache's changes as vLLM's KV-cache events
//! (feature `kv-events`): the options, binding the publisher's sockets, the
//! task that sends batches in step order, and handing each step's batches
//! from the model to that task.
//!
//! Batches are queued under the engine's lock (so they are numbered in
//! step order) and sent by their own task (so no socket I/O happens under
//! that lock).

use std::io;
use std::net::SocketAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;

use super::Core;

/// Where an engine publishes its KV-cache events (feature `kv-events`):
/// vLLM's `--kv-events-config` with the ZMQ publisher.
///
/// Every scheduler step that stores or evicts prefix-cache blocks is one
/// batch on the PUB socket at `endpoint` (`[topic, seq, msgpack]`); with
/// `replay` set, a ROUTER socket there answers replay requests from the last
/// `buffer` batches. Block hashes are engine-sim's 64-bit chain hashes as
/// integers (see [`crate::kv`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsOptions {
    /// The PUB socket's address (vLLM's example uses port 5557); port 0
    /// picks a free port, see
    /// [`EngineHandle::kv_events_addr`](super::EngineHandle::kv_events_addr).
    pub endpoint: SocketAddr,
    /// The replay (ROUTER) socket's address (vLLM's example: 5558); `None`
    /// serves no replays.
    pub replay: Option<SocketAddr>,
    /// The topic frame. Default empty, as vLLM's.
    pub topic: String,
    /// Batches kept for replay. Default 10 000 (vLLM's `buffer_steps`).
    pub buffer: usize,
    /// The data-parallel rank written into every batch. Default 0: one
    /// engine-sim is one rank.
    pub data_parallel_rank: u32,
    /// Fault injection: every `n`-th batch (the `n`-th, `2n`-th, ...) is
    /// numbered and kept for replay but not sent live, as when vLLM's PUB
    /// socket drops a message at its high-water mark; subscribers must
    /// recover it by replay. Default `None` (every batch is sent).
    pub drop_live_every: Option<std::num::NonZeroU64>,
}

impl KvEventsOptions {
    /// Publishing on `endpoint`, no replay, vLLM's defaults otherwise.
    pub fn new(endpoint: SocketAddr) -> Self {
        KvEventsOptions {
            endpoint,
            replay: None,
            topic: String::new(),
            buffer: 10_000,
            data_parallel_rank: 0,
            drop_live_every: None,
        }
    }

    /// Also serving replays on `replay`.
    #[must_use]
    pub fn with_replay(mut self, replay: SocketAddr) -> Self {
        self.replay = Some(replay);
        self
    }
}

/// A bound publisher: its queue, its task and the addresses it bound.
pub(super) struct KvEventsRunning {
    pub(super) queue: mpsc::UnboundedSender<kv_events::EventBatch>,
    pub(super) task: tokio::task::JoinHandle<()>,
    pub(super) addr: SocketAddr,
    pub(super) replay_addr: Option<SocketAddr>,
}

/// Binds the publisher's sockets and starts the task that sends batches.
pub(super) async fn bind_kv_events(options: &KvEventsOptions) -> io::Result<KvEventsRunning> {
    let mut config = kv_events::PublisherConfig::new(format!("tcp://{}", options.endpoint));
    config.replay_endpoint = options.replay.map(|a| format!("tcp://{a}"));
    config.topic = options.topic.clone();
    config.buffer_steps = options.buffer.max(1);
    config.data_parallel_rank = Some(options.data_parallel_rank);
    let publisher = kv_events::Publisher::bind(config)
        .await
        .map_err(|e| io::Error::new(io::ErrorKind::AddrNotAvailable, e.to_string()))?;
    let addr = zmq_socket_addr(publisher.endpoint())?;
    let replay_addr = publisher
        .replay_endpoint()
        .map(zmq_socket_addr)
        .transpose()?;
    let (queue, batches) = mpsc::unbounded_channel();
    let task = tokio::spawn(publish_kv_events(
        publisher,
        batches,
        options.drop_live_every,
    ));
    Ok(KvEventsRunning {
        queue,
        task,
        addr,
        replay_addr,
    })
}

/// `tcp://ip:port` as libzmq reports a bound endpoint: a
/// [`kv_events::ZmqEndpoint`] whose host is an IP address.
fn zmq_socket_addr(endpoint: &str) -> io::Result<SocketAddr> {
    let address = match endpoint.parse::<kv_events::ZmqEndpoint>() {
        Ok(parsed) => parsed
            .socket_addr()
            .ok_or_else(|| "its host is not an IP address".to_owned()),
        Err(error) => Err(error.to_string()),
    };
    address.map_err(|reason| {
        io::Error::other(format!(
            "the KV-events publisher bound an unexpected endpoint {endpoint}: {reason}"
        ))
    })
}

/// Publishes queued batches in order until the queue closes (the server
/// stopped), then closes the sockets. With `drop_live_every`, every n-th
/// batch only goes to the replay buffer.
async fn publish_kv_events(
    publisher: kv_events::Publisher,
    mut batches: mpsc::UnboundedReceiver<kv_events::EventBatch>,
    drop_live_every: Option<std::num::NonZeroU64>,
) {
    let mut count = 0u64;
    while let Some(batch) = batches.recv().await {
        count += 1;
        if drop_live_every.is_some_and(|n| count.is_multiple_of(n.get())) {
            publisher.publish_replay_only(&batch).await;
            continue;
        }
        if let Err(error) = publisher.publish(&batch).await {
            // Numbered and kept all the same: subscribers recover it by
            // replay, as from a message vLLM's PUB socket dropped.
            tracing::warn!(%error, "KV-events batch not sent live");
        }
    }
    publisher.shutdown().await;
}

/// Hands the engine's per-step batches of events to the publisher, in
/// order.
pub(super) fn queue_kv_events(core: &mut Core) {
    let Some(queue) = &core.kv_events else {
        return;
    };
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    for batch in core.engine.drain_kv_batches() {
        let _ = queue.send(batch.into_event_batch(ts));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bound_endpoints_are_read_as_socket_addresses() {
        assert_eq!(
            zmq_socket_addr("tcp://127.0.0.1:40123").unwrap(),
            "127.0.0.1:40123".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(
            zmq_socket_addr("tcp://[::1]:40123").unwrap(),
            "[::1]:40123".parse::<SocketAddr>().unwrap()
        );
        for unexpected in [
            "tcp://engine:1",
            "ipc:///tmp/kv",
            "tcp://127.0.0.1",
            "127.0.0.1:1",
        ] {
            let error = zmq_socket_addr(unexpected).unwrap_err().to_string();
            assert!(
                error.starts_with("the KV-events publisher bound an unexpected endpoint"),
                "{error}"
            );
            assert!(error.contains(unexpected), "{error}");
        }
    }
}
