//! libzmq sockets under tokio: one OS thread per receiving socket.
//!
//! # Why libzmq, and why a thread per socket
//!
//! Every ZMQ port the router opens faces peers it does not authenticate.
//! libzmq (the reference implementation, through the `zmq` crate) checks a
//! frame's declared length against `ZMQ_MAXMSGSIZE` *before* it reserves
//! memory and drops the connection that exceeds it; the pure-Rust stack
//! this crate used before reserved whatever a peer declared (a 2^40-byte
//! header aborted the process, a 2^63-1-byte one panicked the reader).
//! [`harden`] sets that bound, with a receive high-water mark and
//! `ZMQ_LINGER 0`, on every socket.
//!
//! The `zmq` crate is synchronous. Of the two ways to drive it from tokio
//! (a thread doing blocking receives, or registering `ZMQ_FD` with the
//! reactor and re-reading `ZMQ_EVENTS` after every operation, an
//! edge-triggered protocol that is easy to get subtly wrong), the thread is
//! chosen: a router opens a handful of sockets (one ROUTER, one SUB per
//! engine rank and a short-lived DEALER per replay), so a thread each costs
//! little, and the code is plain blocking calls. The thread polls its
//! socket (and the socket's monitor) with a [`POLL_INTERVAL`] timeout and
//! checks a stop flag between polls; it hands messages to the async side
//! over a bounded tokio channel, and waits (re-checking the stop flag)
//! while that channel is full, so a slow consumer stops the reads, libzmq's
//! high-water mark then stops the TCP reads, and nothing grows.
//!
//! Dropping a [`SocketThread`] sets the flag and joins the thread, which
//! closes the socket: the wait is at most one poll interval (20 ms, short
//! so that a drop on a tokio worker holds it up only briefly; an idle
//! thread wakes 50 times a second, which costs nothing measurable), and no
//! thread outlives its owner. (Waking the thread at once through an
//! `inproc` PAIR polled beside the socket was tried: with it, fresh SUB
//! sockets intermittently never reported their handshake in the tests, so
//! the plain timed poll stays.)
//!
//! All sockets share one process-wide libzmq context ([`context`]), so
//! that the monitors' `inproc` endpoints reach their sockets and libzmq's
//! I/O thread is started once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

/// How long the socket thread blocks in one poll before it looks at its
/// stop flag: the longest a drop waits for the thread.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// The default receive high-water mark (messages queued per peer before
/// libzmq stops reading that peer's connection).
pub const DEFAULT_RECEIVE_HWM: i32 = 1000;

static CONTEXT: LazyLock<zmq::Context> = LazyLock::new(zmq::Context::new);

/// The process-wide libzmq context every socket of this crate (and of
/// worker-discovery) is made in.
pub fn context() -> &'static zmq::Context {
    &CONTEXT
}

/// Sets the options every receiving socket gets: `ZMQ_MAXMSGSIZE` (a frame
/// declaring more than `max_message_size` bytes closes its connection
/// before anything is allocated), `ZMQ_RCVHWM`, and `ZMQ_LINGER 0` (a
/// closed socket drops what it had not sent instead of keeping the
/// context's thread busy with a peer that may never read).
///
/// # Errors
///
/// libzmq's, when an option is refused.
pub fn harden(socket: &zmq::Socket, max_message_size: usize, receive_hwm: i32) -> zmq::Result<()> {
    socket.set_maxmsgsize(i64::try_from(max_message_size).unwrap_or(i64::MAX))?;
    socket.set_rcvhwm(receive_hwm)?;
    socket.set_linger(0)?;
    Ok(())
}

/// What a socket thread hands over.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Incoming {
    /// A multipart message.
    Message(Vec<Bytes>),
    /// The monitor saw a ZMTP handshake succeed (a real ZMQ peer).
    Connected,
    /// The monitor saw a connection end (the peer left, or libzmq closed it
    /// for breaking the protocol or the size bound).
    Disconnected,
}

/// A socket owned by its own thread, read into a bounded channel; see the
/// [module docs](self).
#[derive(Debug)]
pub struct SocketThread {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    receiver: mpsc::Receiver<Incoming>,
}

/// A process-unique number for monitor endpoints.
static MONITORS: AtomicU64 = AtomicU64::new(0);

/// Attaches a monitor to `socket` reporting handshakes and disconnections,
/// and returns the PAIR socket that reads it. Call before connecting, so
/// that no event is missed.
///
/// # Errors
///
/// libzmq's.
pub fn monitor(socket: &zmq::Socket) -> zmq::Result<zmq::Socket> {
    let n = MONITORS.fetch_add(1, Ordering::Relaxed);
    let endpoint = format!("inproc://kv-events-monitor-{}-{n}", std::process::id());
    let events = zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32
        | zmq::SocketEvent::DISCONNECTED as i32
        | zmq::SocketEvent::CLOSED as i32;
    socket.monitor(&endpoint, events)?;
    let pair = context().socket(zmq::PAIR)?;
    pair.set_linger(0)?;
    pair.connect(&endpoint)?;
    Ok(pair)
}

/// Stops `socket`'s monitor before its reader is closed.
///
/// libzmq 4.3 sends monitor events with *blocking* sends, from its I/O
/// thread, to the monitor's PAIR socket, and a PAIR whose peer is gone
/// blocks a send for good. So an event that comes after the reader closed
/// (seen: a disconnection, when engines and the subscribers following
/// them were dropped together) stops that thread, and with it every
/// socket of the process-wide context: every later connection of every
/// stream stays `connecting`. Monitoring again on a fresh endpoint with no
/// events closes the old monitor socket under libzmq's monitor lock, so
/// that nothing is sent to it afterwards; the replacement is sent
/// nothing, and goes when the socket does.
fn stop_monitoring(socket: &zmq::Socket) {
    let n = MONITORS.fetch_add(1, Ordering::Relaxed);
    let endpoint = format!("inproc://kv-events-monitor-{}-{n}-off", std::process::id());
    if let Err(e) = socket.monitor(&endpoint, 0) {
        tracing::warn!(error = %e, "ZMQ: stopping a socket's monitor failed");
    }
}

impl SocketThread {
    /// Starts a thread that reads `socket` (and `monitor`, from
    /// [`monitor`]) into a channel of `capacity` items, named `name` (for
    /// debuggers and panics).
    ///
    /// # Errors
    ///
    /// When the OS refuses a thread.
    pub fn spawn(
        name: &str,
        socket: zmq::Socket,
        monitor: Option<zmq::Socket>,
        capacity: usize,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (sender, receiver) = mpsc::channel(capacity.max(1));
        let thread_stop = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                read_loop(&socket, monitor.as_ref(), &sender, &thread_stop);
                if monitor.is_some() {
                    stop_monitoring(&socket);
                }
                // The socket first, then its monitor's reader, which no
                // event can reach any more.
                drop(socket);
                drop(monitor);
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
            receiver,
        })
    }

    /// The next item; `None` once the thread has ended (its socket failed,
    /// or it panicked: the owner restarts it).
    pub async fn recv(&mut self) -> Option<Incoming> {
        self.receiver.recv().await
    }

    /// The next item if one is waiting, without blocking (for callers
    /// outside a runtime).
    pub fn try_recv(&mut self) -> Option<Incoming> {
        self.receiver.try_recv().ok()
    }

    /// Whether the thread has ended.
    #[must_use]
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

impl Drop for SocketThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // The thread sees the flag within one poll interval (or at once,
        // when it waits on the full channel); the wait is bounded.
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Hands `item` over, waiting while the channel is full. False when the
/// owner is gone or asked to stop.
fn deliver(sender: &mpsc::Sender<Incoming>, stop: &AtomicBool, mut item: Incoming) -> bool {
    loop {
        match sender.try_send(item) {
            Ok(()) => return true,
            Err(mpsc::error::TrySendError::Closed(_)) => return false,
            Err(mpsc::error::TrySendError::Full(back)) => {
                if stop.load(Ordering::Acquire) {
                    return false;
                }
                item = back;
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// Messages taken from the socket per wake-up before the stop flag is
/// looked at again.
const BURST: usize = 64;

fn read_loop(
    socket: &zmq::Socket,
    monitor: Option<&zmq::Socket>,
    sender: &mpsc::Sender<Incoming>,
    stop: &AtomicBool,
) {
    let timeout = i64::try_from(POLL_INTERVAL.as_millis()).unwrap_or(20);
    while !stop.load(Ordering::Acquire) {
        let mut items = vec![socket.as_poll_item(zmq::POLLIN)];
        if let Some(monitor) = monitor {
            items.push(monitor.as_poll_item(zmq::POLLIN));
        }
        match zmq::poll(&mut items, timeout) {
            Ok(_) => {}
            Err(zmq::Error::EINTR) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "ZMQ poll failed; the socket thread ends");
                return;
            }
        }
        let socket_ready = items[0].is_readable();
        let monitor_ready = items.get(1).is_some_and(zmq::PollItem::is_readable);
        drop(items);
        if monitor_ready && let Some(monitor) = monitor {
            while let Ok(frames) = monitor.recv_multipart(zmq::DONTWAIT) {
                let Some(event) = frames.first().and_then(|f| f.get(..2)) else {
                    continue;
                };
                let event = u16::from_ne_bytes([event[0], event[1]]);
                let item = match zmq::SocketEvent::from_raw(event) {
                    zmq::SocketEvent::HANDSHAKE_SUCCEEDED => Incoming::Connected,
                    zmq::SocketEvent::DISCONNECTED | zmq::SocketEvent::CLOSED => {
                        Incoming::Disconnected
                    }
                    _ => continue,
                };
                if !deliver(sender, stop, item) {
                    return;
                }
            }
        }
        if socket_ready {
            for _ in 0..BURST {
                match socket.recv_multipart(zmq::DONTWAIT) {
                    Ok(frames) => {
                        let frames = frames.into_iter().map(Bytes::from).collect();
                        if !deliver(sender, stop, Incoming::Message(frames)) {
                            return;
                        }
                    }
                    Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "ZMQ receive failed; the socket thread ends");
                        return;
                    }
                }
            }
        }
    }
}

/// `tcp://host:port` of what `socket` bound last.
///
/// # Errors
///
/// libzmq's, or a description when the endpoint is not UTF-8.
pub fn last_endpoint(socket: &zmq::Socket) -> Result<String, String> {
    socket
        .get_last_endpoint()
        .map_err(|e| e.to_string())?
        .map_err(|_| "the bound endpoint is not UTF-8".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names of this process's threads (Linux), to see one is gone.
    fn thread_names() -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .map(|tasks| {
                tasks
                    .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
                    .map(|name| name.trim().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    #[tokio::test]
    async fn dropping_the_owner_joins_the_thread_and_closes_the_socket() {
        let socket = context().socket(zmq::ROUTER).unwrap();
        harden(&socket, 1024, DEFAULT_RECEIVE_HWM).unwrap();
        socket.bind("tcp://127.0.0.1:0").unwrap();
        let address = last_endpoint(&socket).unwrap();
        let thread = SocketThread::spawn("zmqio-drop", socket, None, 4).unwrap();
        if cfg!(target_os = "linux") {
            // The thread names itself once it runs.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !thread_names().iter().any(|name| name == "zmqio-drop") {
                assert!(std::time::Instant::now() < deadline, "the thread never ran");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let started = std::time::Instant::now();
        drop(thread);
        // At most one poll interval on an idle machine; the bound is loose
        // for a loaded one.
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(!thread_names().iter().any(|name| name == "zmqio-drop"));
        // The socket is closed: its port can be bound again. libzmq closes
        // the descriptor on its own reaper thread after `zmq_close`
        // returns, so the port comes free a moment later, not at once.
        let again = context().socket(zmq::ROUTER).unwrap();
        again.set_linger(0).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while let Err(e) = again.bind(&address) {
            assert!(
                std::time::Instant::now() < deadline,
                "the port was not released: {e}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[tokio::test]
    async fn a_frame_over_the_bound_closes_the_connection_and_a_small_one_passes() {
        let pull = context().socket(zmq::ROUTER).unwrap();
        harden(&pull, 1024, DEFAULT_RECEIVE_HWM).unwrap();
        pull.bind("tcp://127.0.0.1:0").unwrap();
        let endpoint = last_endpoint(&pull).unwrap();
        let mut thread = SocketThread::spawn("test-router", pull, None, 4).unwrap();
        let dealer = context().socket(zmq::DEALER).unwrap();
        dealer.set_linger(0).unwrap();
        dealer.connect(&endpoint).unwrap();
        dealer.send(vec![0u8; 4096], 0).unwrap();
        // The big frame closes the connection; the dealer reconnects, and a
        // small message (sent until one arrives) is delivered.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let frames = loop {
            assert!(
                std::time::Instant::now() < deadline,
                "no small message in 20 s"
            );
            let _ = dealer.send(&b"small"[..], zmq::DONTWAIT);
            match tokio::time::timeout(Duration::from_millis(200), thread.recv()).await {
                Ok(Some(Incoming::Message(frames))) => break frames,
                Ok(other) => panic!("{other:?}"),
                Err(_) => {}
            }
        };
        assert_eq!(frames.last().unwrap().as_ref(), b"small");
        let started = std::time::Instant::now();
        drop(thread);
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "joined promptly"
        );
    }
}
