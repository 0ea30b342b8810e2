//! The real sockets: a SUB socket per connection, and replays on request.

use std::future::Future;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::replay::replay_once;
use super::transport::{LiveMsg, LiveStream, ReplayMsg, Transport};
use crate::sequencer::ReplayId;
use crate::zmq_io::{Incoming, SocketThread, context, harden};

/// The real sockets.
pub(super) struct ZmqTransport {
    pub(super) endpoint: String,
    pub(super) replay_endpoint: Option<String>,
    pub(super) topic: String,
    pub(super) connect_timeout: Duration,
    pub(super) max_message_size: usize,
}

/// Live messages a SUB socket's thread may hold for the loop; beyond them
/// the thread stops reading and libzmq's high-water mark takes over (a PUB
/// socket drops what a slow subscriber cannot take, as vLLM expects).
const LIVE_QUEUE: usize = 64;

pub(super) struct ZmqLive {
    thread: SocketThread,
}

/// A SUB socket connected to `endpoint`, with its monitor; libzmq's own
/// reconnection is off (the loop reconnects with its backoff).
fn sub_socket(
    endpoint: &str,
    topic: &str,
    max_message_size: usize,
) -> zmq::Result<(zmq::Socket, zmq::Socket)> {
    let socket = context().socket(zmq::SUB)?;
    harden(
        &socket,
        max_message_size,
        crate::zmq_io::DEFAULT_RECEIVE_HWM,
    )?;
    socket.set_reconnect_ivl(-1)?;
    socket.set_subscribe(topic.as_bytes())?;
    let monitor = crate::zmq_io::monitor(&socket)?;
    socket.connect(endpoint)?;
    Ok((socket, monitor))
}

impl Transport for ZmqTransport {
    type Live = ZmqLive;

    fn connect(&mut self) -> impl Future<Output = Result<ZmqLive, String>> + Send {
        let endpoint = self.endpoint.clone();
        let topic = self.topic.clone();
        let timeout = self.connect_timeout;
        let max = self.max_message_size;
        async move {
            let (socket, monitor) =
                sub_socket(&endpoint, &topic, max).map_err(|e| e.to_string())?;
            let mut thread =
                SocketThread::spawn("kv-events-sub", socket, Some(monitor), LIVE_QUEUE)
                    .map_err(|e| e.to_string())?;
            // Connected once the ZMTP handshake succeeded: a listener that
            // is not a ZMQ publisher never makes the stream live.
            match tokio::time::timeout(timeout, thread.recv()).await {
                Ok(Some(Incoming::Connected)) => Ok(ZmqLive { thread }),
                Ok(Some(_) | None) => Err("the connection closed during the handshake".to_owned()),
                Err(_) => Err("connect timed out".to_owned()),
            }
        }
    }

    fn has_replay(&self) -> bool {
        self.replay_endpoint.is_some()
    }

    fn replay(&self, id: ReplayId, from: u64, answers: mpsc::Sender<ReplayMsg>) -> JoinHandle<()> {
        let endpoint = self.replay_endpoint.clone().unwrap_or_default();
        let max = self.max_message_size;
        tokio::spawn(async move {
            let outcome = replay_once(&endpoint, max, id, from, &answers).await;
            if let Err(e) = outcome {
                tracing::debug!(%endpoint, error = %e, "KV event replay failed");
                let _ = answers.send(ReplayMsg::Failed(id)).await;
            }
        })
    }
}

impl LiveStream for ZmqLive {
    async fn next(&mut self) -> LiveMsg {
        loop {
            match self.thread.recv().await {
                Some(Incoming::Message(frames)) => return LiveMsg::Frames(frames),
                Some(Incoming::Connected) => {}
                // libzmq closed the connection (the peer left, or broke the
                // protocol or the size bound), or the thread ended.
                Some(Incoming::Disconnected) | None => return LiveMsg::Closed,
            }
        }
    }
}
