//! A test engine's side of vLLM's ZMQ registration: the messages it sends
//! and its DEALER socket. Shared by this crate's tests and the reference
//! router's (included by path).

use std::time::{Duration, Instant};
use worker_discovery::ZmqDiscovery;
use zeromq::{Socket, ZmqMessage};

/// Short enough to watch an expiry, long enough for a loaded CI machine
/// to deliver a heartbeat in time.
pub(crate) const TTL: Duration = Duration::from_millis(1500);

/// A registration (`P` prefill, `D` decode) as vLLM's proxy sends it.
pub(crate) fn registration(kind: &str, http: &str, zmq: &str) -> ZmqMessage {
    let map = serde_json::json!({"type": kind, "http_address": http, "zmq_address": zmq});
    ZmqMessage::from(rmp_serde::to_vec_named(&map).unwrap())
}

/// A DEALER connected to `discovery`'s ROUTER.
pub(crate) async fn engine_socket(discovery: &ZmqDiscovery) -> zeromq::DealerSocket {
    let mut socket = zeromq::DealerSocket::new();
    let endpoint = format!("tcp://{}", discovery.local_addr());
    tokio::time::timeout(Duration::from_secs(5), socket.connect(&endpoint))
        .await
        .expect("connect in time")
        .expect("connect");
    socket
}

/// Polls `condition` every 20 ms for at most 5 s.
pub(crate) async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
