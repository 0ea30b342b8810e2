//! A test engine's side of vLLM's ZMQ registration: the messages it sends
//! and its DEALER socket (libzmq). Shared by this crate's tests and the
//! reference router's (included by path).

use std::time::{Duration, Instant};
use worker_discovery::ZmqDiscovery;

/// Short enough to watch an expiry, long enough for a loaded CI machine
/// to deliver a heartbeat in time.
pub(crate) const TTL: Duration = Duration::from_millis(1500);

/// A registration (`P` prefill, `D` decode) as vLLM's proxy sends it: one
/// MessagePack frame.
pub(crate) fn registration(kind: &str, http: &str, zmq: &str) -> Vec<Vec<u8>> {
    let map = serde_json::json!({"type": kind, "http_address": http, "zmq_address": zmq});
    vec![rmp_serde::to_vec_named(&map).unwrap()]
}

/// An engine's DEALER socket.
pub(crate) struct Engine {
    socket: zmq::Socket,
}

impl Engine {
    /// Sends a multipart message. libzmq queues it until the connection is
    /// made (as vLLM's engines rely on), so this never waits on the network.
    pub(crate) async fn send(&mut self, frames: Vec<Vec<u8>>) -> Result<(), zmq::Error> {
        self.socket.send_multipart(frames, zmq::DONTWAIT)
    }
}

/// A DEALER connected to `discovery`'s ROUTER.
pub(crate) async fn engine_socket(discovery: &ZmqDiscovery) -> Engine {
    engine_socket_at(discovery.local_addr()).await
}

/// A DEALER connected to a ROUTER at `address`.
pub(crate) async fn engine_socket_at(address: std::net::SocketAddr) -> Engine {
    let socket = zmq::Context::new().socket(zmq::DEALER).expect("a DEALER");
    socket.set_linger(0).unwrap();
    socket
        .connect(&format!("tcp://{address}"))
        .expect("connect");
    Engine { socket }
}

/// Polls `condition` every 20 ms for at most 5 s.
pub(crate) async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
