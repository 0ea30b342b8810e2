//! Fuzzing entry points (the cargo-fuzz targets `kv_events_decode`,
//! `kv_events_endpoint` and `zmtp_sockets`, and the crate's seed-corpus
//! tests, call them), and the raw ZMTP bytes the hostile-peer tests send.

use crate::{
    DecodeLimits, WireFormat, ZmqEndpoint, decode_batch, decode_batch_with, encode_batch_as,
};

/// Decodes arbitrary bytes as a payload; whatever decodes must encode, in
/// every [`WireFormat`], to bytes that decode again to a batch that
/// encodes to the same bytes (compared as bytes, so a NaN time is fine).
///
/// # Panics
///
/// When that property fails: this is what the fuzzer looks for.
pub fn decode_roundtrip(data: &[u8]) {
    let Ok(decoded) = decode_batch(data) else {
        return;
    };
    // The re-encoding may be longer than the input (float 32 times become
    // float 64), so only the payload size limit is lifted.
    let limits = DecodeLimits {
        max_payload_bytes: usize::MAX,
        ..DecodeLimits::default()
    };
    for format in [
        WireFormat::POSITIONAL,
        WireFormat::NAMED_EVENTS,
        WireFormat::NAMED,
    ] {
        let bytes = encode_batch_as(&decoded.batch, format);
        let again = match decode_batch_with(&bytes, &limits) {
            Ok(again) => again,
            Err(e) => panic!("re-encoded batch does not decode ({format:?}): {e}"),
        };
        assert_eq!(
            again.unknown_events, 0,
            "re-encoding wrote an unknown event"
        );
        assert_eq!(
            again.batch.events.len(),
            decoded.batch.events.len(),
            "event count changed"
        );
        assert_eq!(
            encode_batch_as(&again.batch, format),
            bytes,
            "encoding is not stable ({format:?})"
        );
    }
}

/// Parses arbitrary bytes (read as UTF-8, invalid sequences replaced) as a
/// [`ZmqEndpoint`] and as a bare address. Whatever parses must display
/// within [`ZmqEndpoint::MAX_LEN`] as text that parses back to the same
/// endpoint and displays the same, and be rebuilt alike from its host and
/// port ([`ZmqEndpoint::new`]) and from its `HOST:PORT`; what is refused is
/// refused with a short message.
///
/// # Panics
///
/// When that property fails: this is what the fuzzer looks for.
pub fn endpoint_parse(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    for parsed in [ZmqEndpoint::parse(&text), ZmqEndpoint::parse_address(&text)] {
        let endpoint = match parsed {
            Ok(endpoint) => endpoint,
            Err(error) => {
                // The reason quotes at most 64 characters of the input.
                let message = error.to_string();
                assert!(message.len() < 200, "a long message: {message}");
                continue;
            }
        };
        let shown = endpoint.to_string();
        assert!(shown.len() <= ZmqEndpoint::MAX_LEN, "{shown} is too long");
        let again = match ZmqEndpoint::parse(&shown) {
            Ok(again) => again,
            Err(e) => panic!("{shown:?} (from {text:?}) does not parse: {e}"),
        };
        assert_eq!(again, endpoint, "{text:?} does not round-trip");
        assert_eq!(again.to_string(), shown, "display is not stable");
        assert_eq!(
            ZmqEndpoint::new(endpoint.host(), endpoint.port()).as_ref(),
            Ok(&endpoint),
            "rebuilt from host and port"
        );
        assert_eq!(
            ZmqEndpoint::parse_address(&endpoint.host_port()).as_ref(),
            Ok(&endpoint),
            "parsed from HOST:PORT"
        );
        if let Some(address) = endpoint.socket_addr() {
            assert_eq!(address.port(), endpoint.port());
        }
    }
}

/// Raw ZMTP 3.0 bytes, for hostile-peer tests and the `zmtp_sockets` fuzz
/// target: just enough of the protocol (RFC 23) to get past a libzmq
/// socket's handshake with the NULL mechanism.
pub mod zmtp {
    /// The 64-byte greeting: signature, version 3.0, mechanism `NULL`, not
    /// as-server, zero filler.
    #[must_use]
    pub fn greeting() -> [u8; 64] {
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3;
        greeting[12..16].copy_from_slice(b"NULL");
        greeting
    }

    /// The NULL mechanism's `READY` command announcing `socket_type`
    /// (`PUB`, `DEALER`, `ROUTER`, ...).
    #[must_use]
    pub fn ready(socket_type: &str) -> Vec<u8> {
        let mut body = Vec::new();
        body.push(5);
        body.extend_from_slice(b"READY");
        body.push(11);
        body.extend_from_slice(b"Socket-Type");
        let len = u32::try_from(socket_type.len()).unwrap_or(u32::MAX);
        body.extend_from_slice(&len.to_be_bytes());
        body.extend_from_slice(socket_type.as_bytes());
        let mut command = vec![0x04, u8::try_from(body.len()).unwrap_or(u8::MAX)];
        command.extend_from_slice(&body);
        command
    }

    /// A long message frame's header (flags `0x02`, no more frames)
    /// declaring `len` bytes, with none of them following.
    #[must_use]
    pub fn long_frame_header(len: u64) -> [u8; 9] {
        let mut header = [0u8; 9];
        header[0] = 0x02;
        header[1..].copy_from_slice(&len.to_be_bytes());
        header
    }

    /// Greeting, `READY` as `socket_type`, then a long-frame header
    /// claiming `len` bytes: what the hostile-input probe sent.
    #[must_use]
    pub fn oversized_frame(socket_type: &str, len: u64) -> Vec<u8> {
        let mut bytes = greeting().to_vec();
        bytes.extend_from_slice(&ready(socket_type));
        bytes.extend_from_slice(&long_frame_header(len));
        bytes
    }
}

#[cfg(all(feature = "sockets", not(loom)))]
pub use sockets::zmtp_sockets;

#[cfg(all(feature = "sockets", not(loom)))]
mod sockets {
    use std::io::Write;
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::{LazyLock, Mutex, PoisonError};
    use std::time::{Duration, Instant};

    use crate::zmq_io::{Incoming, SocketThread, context, harden, last_endpoint};

    /// The bound the fuzzed sockets get: small, so that the fuzzer reaches
    /// it with short inputs.
    const MAX: usize = 4096;
    /// How long a genuine peer may take to get through.
    const PATIENCE: Duration = Duration::from_secs(10);

    /// Waits (blocking) for the next message on `thread`.
    fn next_message(thread: &mut SocketThread) -> Vec<bytes::Bytes> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            assert!(
                Instant::now() < deadline,
                "no genuine message within {PATIENCE:?}"
            );
            match thread.try_recv() {
                Some(Incoming::Message(frames)) => return frames,
                Some(_) => {}
                None => {
                    assert!(!thread.is_finished(), "the socket thread ended");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    /// Writes `data` on a fresh TCP connection to `address`, a socket's
    /// bound endpoint, and closes it (a peer that is gone or refuses is
    /// fine: it is the input's doing).
    fn hostile_client(address: &str, data: &[u8]) {
        let address = address
            .parse::<crate::ZmqEndpoint>()
            .ok()
            .and_then(|endpoint| endpoint.socket_addr())
            .expect("libzmq reports a bound endpoint as tcp://IP:PORT");
        if let Ok(mut stream) = TcpStream::connect(address) {
            let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = stream.write_all(data);
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// A TCP listener that answers its first connection with `data` and
    /// closes it: a hostile publisher or replay server.
    fn hostile_server(data: Vec<u8>) -> (String, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let address = format!("tcp://{}", listener.local_addr().expect("bound"));
        let thread = std::thread::spawn(move || {
            listener.set_nonblocking(true).expect("non-blocking");
            let deadline = Instant::now() + PATIENCE;
            while Instant::now() < deadline {
                if let Ok((mut stream, _)) = listener.accept() {
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                    let _ = stream.write_all(&data);
                    let _ = stream.shutdown(Shutdown::Both);
                    return;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        (address, thread)
    }

    /// The ROUTER side (a bound socket, as worker-discovery's and a
    /// publisher's replay socket), kept across inputs with a genuine DEALER.
    struct RouterFixture {
        endpoint: String,
        thread: SocketThread,
        genuine: zmq::Socket,
    }

    static ROUTER: LazyLock<Mutex<RouterFixture>> = LazyLock::new(|| {
        let router = context().socket(zmq::ROUTER).expect("ROUTER");
        harden(&router, MAX, 1000).expect("options");
        router.bind("tcp://127.0.0.1:0").expect("bind");
        let endpoint = last_endpoint(&router).expect("endpoint");
        let thread = SocketThread::spawn("fuzz-router", router, None, 64).expect("thread");
        let genuine = context().socket(zmq::DEALER).expect("DEALER");
        genuine.set_linger(0).expect("linger");
        genuine.connect(&endpoint).expect("connect");
        Mutex::new(RouterFixture {
            endpoint,
            thread,
            genuine,
        })
    });

    /// A genuine publisher and replay server the connecting sockets also
    /// reach, kept across inputs.
    struct PeerFixture {
        publisher: zmq::Socket,
        pub_endpoint: String,
        replay_endpoint: String,
    }

    static PEERS: LazyLock<Mutex<PeerFixture>> = LazyLock::new(|| {
        let publisher = context().socket(zmq::PUB).expect("PUB");
        publisher.set_linger(0).expect("linger");
        publisher.bind("tcp://127.0.0.1:0").expect("bind");
        let pub_endpoint = last_endpoint(&publisher).expect("endpoint");
        // An echo ROUTER: answers every request with its own frames.
        let replay = context().socket(zmq::ROUTER).expect("ROUTER");
        replay.set_linger(0).expect("linger");
        replay.bind("tcp://127.0.0.1:0").expect("bind");
        let replay_endpoint = last_endpoint(&replay).expect("endpoint");
        std::thread::Builder::new()
            .name("fuzz-echo".to_owned())
            .spawn(move || {
                while let Ok(frames) = replay.recv_multipart(0) {
                    let _ = replay.send_multipart(frames, zmq::DONTWAIT);
                }
            })
            .expect("thread");
        Mutex::new(PeerFixture {
            publisher,
            pub_endpoint,
            replay_endpoint,
        })
    });

    /// Feeds `data` as a raw ZMTP stream to one of the socket types the
    /// router opens (the first byte picks it: 0 the ROUTER of discovery and
    /// replay serving, 1 the SUB of a KV event stream, 2 the DEALER of a
    /// replay), each hardened as in production (`ZMQ_MAXMSGSIZE` 4 KiB
    /// here), then checks that the socket still serves a genuine peer.
    ///
    /// # Panics
    ///
    /// When a genuine message does not get through in 10 s, or a socket
    /// thread ended: what the fuzzer looks for (besides crashes and
    /// allocation failures).
    pub fn zmtp_sockets(data: &[u8]) {
        let Some((&kind, stream)) = data.split_first() else {
            return;
        };
        match kind % 3 {
            0 => router(stream),
            1 => sub(stream),
            _ => dealer(stream),
        }
    }

    fn router(stream: &[u8]) {
        let mut fixture = ROUTER.lock().unwrap_or_else(PoisonError::into_inner);
        hostile_client(&fixture.endpoint, stream);
        let token = Instant::now().elapsed().as_nanos().to_be_bytes();
        fixture
            .genuine
            .send(&token[..], zmq::DONTWAIT)
            .expect("the genuine DEALER queues");
        // The hostile peer may have got a message through (a well-formed
        // input); the genuine one's arrives too.
        loop {
            let frames = next_message(&mut fixture.thread);
            assert!(
                frames.iter().all(|f| f.len() <= MAX),
                "a frame over the bound"
            );
            if frames.last().is_some_and(|f| f.as_ref() == token) {
                return;
            }
        }
    }

    fn sub(stream: &[u8]) {
        let peers = PEERS.lock().unwrap_or_else(PoisonError::into_inner);
        let (hostile, server) = hostile_server(stream.to_vec());
        let socket = context().socket(zmq::SUB).expect("SUB");
        harden(&socket, MAX, 1000).expect("options");
        socket.set_subscribe(b"").expect("subscribe");
        socket.connect(&hostile).expect("connect");
        socket.connect(&peers.pub_endpoint).expect("connect");
        let mut thread = SocketThread::spawn("fuzz-sub", socket, None, 64).expect("thread");
        let _ = server.join();
        // The genuine publisher's messages arrive once the subscription has
        // reached it (ZMQ's slow joiner): publish until one does.
        let deadline = Instant::now() + PATIENCE;
        loop {
            assert!(
                Instant::now() < deadline,
                "no genuine message within {PATIENCE:?}"
            );
            peers
                .publisher
                .send_multipart([&b"genuine"[..], &[0u8; 8][..]], zmq::DONTWAIT)
                .expect("PUB never blocks");
            std::thread::sleep(Duration::from_millis(1));
            match thread.try_recv() {
                Some(Incoming::Message(frames)) => {
                    assert!(
                        frames.iter().all(|f| f.len() <= MAX),
                        "a frame over the bound"
                    );
                    if frames.first().is_some_and(|f| f.as_ref() == b"genuine") {
                        return;
                    }
                }
                Some(_) => {}
                None => assert!(!thread.is_finished(), "the socket thread ended"),
            }
        }
    }

    fn dealer(stream: &[u8]) {
        let peers = PEERS.lock().unwrap_or_else(PoisonError::into_inner);
        let (hostile, server) = hostile_server(stream.to_vec());
        let socket = context().socket(zmq::DEALER).expect("DEALER");
        harden(&socket, MAX, 1000).expect("options");
        socket.connect(&hostile).expect("connect");
        socket.connect(&peers.replay_endpoint).expect("connect");
        // One request per pipe (round robin): one reaches the echo server.
        for _ in 0..2 {
            socket
                .send_multipart([&b""[..], &b"genuine"[..]], zmq::DONTWAIT)
                .expect("the DEALER queues");
        }
        let mut thread = SocketThread::spawn("fuzz-dealer", socket, None, 64).expect("thread");
        let _ = server.join();
        loop {
            let frames = next_message(&mut thread);
            assert!(
                frames.iter().all(|f| f.len() <= MAX),
                "a frame over the bound"
            );
            if frames.last().is_some_and(|f| f.as_ref() == b"genuine") {
                return;
            }
        }
    }
}
