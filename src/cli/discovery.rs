//! vLLM's ZMQ registration discovery (`--vllm-discovery-address`).
//!
//! vLLM engines running a P2P KV connector announce themselves to the
//! router over ZMQ: each engine connects a DEALER socket to the router's
//! ROUTER socket and sends, every few seconds, one MessagePack map:
//!
//! ```text
//! {"type": "P" | "D", "http_address": "host:port", "zmq_address": "host:port",
//!  "transfer_mode"?: "READ" | "WRITE"}
//! ```
//!
//! MoRI-IO engines send their own form, which is accepted too:
//!
//! ```text
//! {"type": "register" | "HELLO", "role": "P" | "D",
//!  "request_address": "http://host:port/v1/completions",
//!  "handshake_port": u16, "notify_port": u16, "dp_size": u32, "tp_size": u32,
//!  "transfer_mode": "READ" | "WRITE"}
//! ```
//!
//! The ROUTER socket receives it as `[identity, payload]`. Each message
//! registers the engine in the [`ServiceRegistry`] of its role, or — when
//! the same engine sent the same thing within the TTL — refreshes it and
//! keeps its generation. An engine that stays silent for the TTL expires; a
//! later message starts a new generation (a fresh worker with fresh load
//! and breaker). A different `zmq_address` or `transfer_mode` at the same
//! HTTP address is a restart and also starts a new generation. They are
//! kept as the registration labels router-http's P/D pools read:
//! `kv_addr` (the P2P request id's address) and `moriio_mode`.
//!
//! Malformed messages are counted ([`ZmqDiscovery::malformed_messages`]) and
//! logged at `warn`, never fatal: one bad sender cannot stop discovery.
//!
//! Engines that cannot speak ZMQ send the same map as JSON to
//! `POST /register` on the router's port (admin-protected), which feeds the
//! same registries ([`Registries::apply_json`]).
//!
//! The registries are exposed so that the P/D request path (or any host)
//! reconciles them into its worker pools with
//! [`worker_lifecycle::DiscoveryPool::with_reconciled`].

use bytes::Bytes;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use worker_lifecycle::{Endpoint, Registration, RoleKind, ServiceRegistry};
use zeromq::{Socket, SocketRecv};

/// How long a registration lives without a new message (vLLM engines send
/// one every few seconds).
pub const DEFAULT_TTL: Duration = Duration::from_secs(5);

/// The role an engine registers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegisteredRole {
    /// `"P"`: a prefill engine.
    Prefill,
    /// `"D"`: a decode engine.
    Decode,
}

/// One decoded registration message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqRegistration {
    /// The engine's role.
    pub role: RegisteredRole,
    /// Its HTTP address, `host:port` (the worker URL is `http://` + this).
    pub http_address: String,
    /// Its ZMQ address for KV transfers, when it sent one.
    pub zmq_address: Option<String>,
    /// `READ` or `WRITE` (MoRI-IO), when it sent one.
    pub transfer_mode: Option<String>,
    /// MoRI-IO side-channel facts, from the MoRI-IO registration form.
    pub moriio: Option<pd_orchestrator::MoriIoEndpoint>,
}

impl ZmqRegistration {
    /// The worker URL, `http://host:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.http_address)
    }
}

/// Why a registration message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// The payload is not a MessagePack map with the expected fields.
    #[error("not a registration map: {0}")]
    Decode(String),
    /// `type` is neither `P` nor `D`.
    #[error("unknown type {0:?} (expected \"P\" or \"D\")")]
    UnknownType(String),
    /// `http_address` is not `host:port`.
    #[error("invalid http_address {0:?} (expected host:port)")]
    HttpAddress(String),
    /// `transfer_mode` is neither `READ` nor `WRITE`.
    #[error("unknown transfer_mode {0:?} (expected \"READ\" or \"WRITE\")")]
    TransferMode(String),
    /// The multipart message has no payload frame.
    #[error("the message has no payload frame")]
    NoPayload,
}

#[derive(Deserialize)]
struct Wire {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    http_address: Option<String>,
    #[serde(default)]
    zmq_address: Option<String>,
    #[serde(default)]
    transfer_mode: Option<String>,
    // The MoRI-IO form: {"type": "register" | "HELLO", "role": "P" | "D",
    // "request_address": "http://host:port/v1/completions", "handshake_port",
    // "notify_port", "dp_size", "tp_size", "transfer_mode"}.
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    request_address: Option<String>,
    #[serde(default)]
    handshake_port: Option<u16>,
    #[serde(default)]
    notify_port: Option<u16>,
    #[serde(default)]
    dp_size: Option<u32>,
    #[serde(default)]
    tp_size: Option<u32>,
}

/// Decodes one registration payload (a MessagePack map). Never panics.
pub fn decode_registration(payload: &[u8]) -> Result<ZmqRegistration, MessageError> {
    let wire: Wire =
        rmp_serde::from_slice(payload).map_err(|err| MessageError::Decode(err.to_string()))?;
    validate(wire)
}

/// Decodes the same registration sent as a JSON object (`POST /register`).
/// Never panics.
pub fn decode_json_registration(body: &[u8]) -> Result<ZmqRegistration, MessageError> {
    let wire: Wire =
        serde_json::from_slice(body).map_err(|err| MessageError::Decode(err.to_string()))?;
    validate(wire)
}

fn validate(wire: Wire) -> Result<ZmqRegistration, MessageError> {
    // The MoRI-IO form names the role in `role` and the engine by URL.
    let (role, address) = match (&wire.role, &wire.request_address) {
        (Some(role), Some(url)) => (role.as_str(), authority_of(url)?),
        (Some(_), None) => return Err(MessageError::HttpAddress(String::new())),
        (None, _) => {
            let address = wire
                .http_address
                .as_deref()
                .ok_or_else(|| MessageError::Decode("missing field `http_address`".into()))?;
            (wire.kind.as_str(), address.trim().to_owned())
        }
    };
    let role = match role {
        "P" | "p" => RegisteredRole::Prefill,
        "D" | "d" => RegisteredRole::Decode,
        _ => return Err(MessageError::UnknownType(role.to_owned())),
    };
    let valid_address = address.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty() && port.parse::<u16>().is_ok() && !address.contains('/')
    }) && worker_lifecycle::WorkerUrl::parse_http(&format!("http://{address}"))
        .is_ok();
    if !valid_address {
        return Err(MessageError::HttpAddress(address));
    }
    let transfer_mode = match wire.transfer_mode {
        None => None,
        Some(mode) if mode.eq_ignore_ascii_case("read") => Some("READ".to_owned()),
        Some(mode) if mode.eq_ignore_ascii_case("write") => Some("WRITE".to_owned()),
        Some(mode) => return Err(MessageError::TransferMode(mode)),
    };
    let moriio = match (wire.handshake_port, wire.notify_port) {
        (Some(handshake_port), Some(notify_port)) => Some(pd_orchestrator::MoriIoEndpoint {
            handshake_port,
            notify_port,
            dp_size: wire.dp_size.unwrap_or(1).max(1),
            tp_size: wire.tp_size.unwrap_or(1).max(1),
        }),
        _ => None,
    };
    Ok(ZmqRegistration {
        role,
        http_address: address,
        zmq_address: wire.zmq_address,
        transfer_mode,
        moriio,
    })
}

/// Whether a registration's engine address is inside `networks`; a
/// message that does not decode is left to `Registries::apply` to count.
async fn allowed(frames: &[Bytes], networks: &[router_http::CidrBlock]) -> bool {
    let Ok(registration) = payload_of(frames).and_then(decode_registration) else {
        return true;
    };
    let Ok(url) = worker_lifecycle::WorkerUrl::parse(&registration.url()) else {
        return true;
    };
    match router_http::allow::check_worker_address(&url, networks, Duration::from_secs(5)).await {
        Ok(()) => true,
        Err(err) => {
            tracing::warn!(error = %err, "ignoring a ZMQ registration outside the allowed networks");
            false
        }
    }
}

/// `host:port` of a URL like `http://host:port/v1/completions`.
fn authority_of(url: &str) -> Result<String, MessageError> {
    let uri: http::Uri = url
        .trim()
        .parse()
        .map_err(|_| MessageError::HttpAddress(url.to_owned()))?;
    match (uri.scheme_str(), uri.authority()) {
        (Some("http"), Some(authority)) if authority.port_u16().is_some() => {
            Ok(authority.as_str().to_owned())
        }
        _ => Err(MessageError::HttpAddress(url.to_owned())),
    }
}

/// The payload of a multipart ROUTER message: the last non-empty frame
/// after the identity (a REQ-style empty delimiter is skipped).
fn payload_of(frames: &[Bytes]) -> Result<&[u8], MessageError> {
    frames
        .iter()
        .skip(1)
        .rev()
        .find(|frame| !frame.is_empty())
        .map(|frame| &frame[..])
        .ok_or(MessageError::NoPayload)
}

/// The two registries fed by discovery, one per role.
#[derive(Debug, Clone)]
pub struct Registries {
    /// Prefill engines (`type: "P"`).
    pub prefill: Arc<ServiceRegistry>,
    /// Decode engines (`type: "D"`).
    pub decode: Arc<ServiceRegistry>,
    malformed: Arc<AtomicU64>,
}

impl Registries {
    /// Empty registries whose entries live `ttl` after their last message.
    pub fn new(ttl: Duration) -> Self {
        Self {
            prefill: Arc::new(ServiceRegistry::new(RoleKind::Prefill, ttl)),
            decode: Arc::new(ServiceRegistry::new(RoleKind::Decode, ttl)),
            malformed: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Applies one multipart message received at `now`: registers or
    /// refreshes the engine, or counts the message as malformed.
    pub fn apply(&self, frames: &[Bytes], now: Instant) -> Result<u64, MessageError> {
        let result = payload_of(frames).and_then(decode_registration);
        self.register(result, now)
    }

    /// Applies one JSON registration (`POST /register`) received at `now`.
    pub fn apply_json(
        &self,
        body: &[u8],
        now: Instant,
    ) -> Result<(ZmqRegistration, u64), MessageError> {
        let registration = decode_json_registration(body);
        let kept = registration.clone();
        let generation = self.register(registration, now)?;
        // `register` succeeded, so the decode did too.
        kept.map(|registration| (registration, generation))
    }

    fn register(
        &self,
        result: Result<ZmqRegistration, MessageError>,
        now: Instant,
    ) -> Result<u64, MessageError> {
        let registration = match result {
            Ok(registration) => registration,
            Err(err) => {
                self.malformed.fetch_add(1, Ordering::Relaxed);
                return Err(err);
            }
        };
        let endpoint = match Endpoint::new(&registration.url(), None) {
            Ok(endpoint) => endpoint,
            Err(err) => {
                self.malformed.fetch_add(1, Ordering::Relaxed);
                return Err(MessageError::HttpAddress(format!(
                    "{}: {err}",
                    registration.http_address
                )));
            }
        };
        // The label names router-http's P/D pools read.
        let mut labels = BTreeMap::new();
        if let Some(zmq) = &registration.zmq_address {
            labels.insert(worker_lifecycle::labels::KV_ADDR.to_owned(), zmq.clone());
        }
        if let Some(mode) = &registration.transfer_mode {
            labels.insert(
                worker_lifecycle::labels::MORIIO_MODE.to_owned(),
                mode.to_ascii_lowercase(),
            );
        }
        if let Some(moriio) = &registration.moriio {
            use worker_lifecycle::labels;
            for (label, value) in [
                (
                    labels::MORIIO_HANDSHAKE_PORT,
                    moriio.handshake_port.to_string(),
                ),
                (labels::MORIIO_NOTIFY_PORT, moriio.notify_port.to_string()),
                (labels::DP_SIZE, moriio.dp_size.to_string()),
                (labels::TP_SIZE, moriio.tp_size.to_string()),
            ] {
                labels.insert(label.to_owned(), value);
            }
        }
        let details = Registration {
            labels,
            ..Registration::default()
        };
        let registry = match registration.role {
            RegisteredRole::Prefill => &self.prefill,
            RegisteredRole::Decode => &self.decode,
        };
        let outcome = registry.register(endpoint, details, now);
        if outcome.new_lifetime {
            tracing::info!(
                role = ?registration.role,
                url = %registration.url(),
                generation = outcome.generation,
                "engine registered over ZMQ"
            );
        }
        Ok(outcome.generation)
    }

    /// Messages refused so far.
    pub fn malformed_messages(&self) -> u64 {
        self.malformed.load(Ordering::Relaxed)
    }
}

/// Why discovery could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The address is not `HOST:PORT`.
    #[error("invalid discovery address {0:?} (expected HOST:PORT)")]
    Address(String),
    /// The ROUTER socket could not be bound.
    #[error("cannot bind the ZMQ ROUTER socket on {address}: {reason}")]
    Bind {
        /// The address.
        address: String,
        /// The error.
        reason: String,
    },
}

/// A running ZMQ discovery listener. Dropping it stops the listener.
#[derive(Debug)]
pub struct ZmqDiscovery {
    registries: Registries,
    local_addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl ZmqDiscovery {
    /// Binds a ROUTER socket on `address` (`HOST:PORT`; port 0 picks a free
    /// one) and starts receiving registrations with entries living `ttl`.
    pub async fn bind(address: &str, ttl: Duration) -> Result<Self, DiscoveryError> {
        Self::bind_with_networks(address, ttl, Vec::new()).await
    }

    /// [`ZmqDiscovery::bind`], accepting only engines whose HTTP address is
    /// inside `networks` (any when empty); others are logged and ignored.
    pub async fn bind_with_networks(
        address: &str,
        ttl: Duration,
        networks: Vec<router_http::CidrBlock>,
    ) -> Result<Self, DiscoveryError> {
        let (host, port) = address
            .rsplit_once(':')
            .filter(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
            .ok_or_else(|| DiscoveryError::Address(address.to_owned()))?;
        let mut socket = zeromq::RouterSocket::new();
        let bound = socket
            .bind(&format!("tcp://{host}:{port}"))
            .await
            .map_err(|err| DiscoveryError::Bind {
                address: address.to_owned(),
                reason: err.to_string(),
            })?;
        let local_addr = match bound {
            zeromq::Endpoint::Tcp(host, port) => {
                let ip = match host {
                    zeromq::Host::Ipv4(ip) => std::net::IpAddr::V4(ip),
                    zeromq::Host::Ipv6(ip) => std::net::IpAddr::V6(ip),
                    zeromq::Host::Domain(_) => std::net::IpAddr::from([127, 0, 0, 1]),
                };
                SocketAddr::new(ip, port)
            }
            other => {
                return Err(DiscoveryError::Bind {
                    address: address.to_owned(),
                    reason: format!("bound an unexpected endpoint {other}"),
                });
            }
        };
        let registries = Registries::new(ttl);
        let feed = registries.clone();
        let task = tokio::spawn(async move {
            loop {
                match socket.recv().await {
                    Ok(message) => {
                        let frames = message.into_vec();
                        if !networks.is_empty() && !allowed(&frames, &networks).await {
                            continue;
                        }
                        if let Err(err) = feed.apply(&frames, Instant::now()) {
                            tracing::warn!(
                                error = %err,
                                malformed_total = feed.malformed_messages(),
                                "ignoring a malformed ZMQ registration"
                            );
                        }
                    }
                    Err(err) => {
                        // A peer's broken frame: count it and keep serving.
                        feed.malformed.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(error = %err, "ZMQ receive failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        });
        tracing::info!(%local_addr, ttl_secs = ttl.as_secs_f64(), "ZMQ discovery listening");
        Ok(Self {
            registries,
            local_addr,
            task,
        })
    }

    /// The registries this listener feeds.
    pub fn registries(&self) -> &Registries {
        &self.registries
    }

    /// Messages refused so far.
    pub fn malformed_messages(&self) -> u64 {
        self.registries.malformed_messages()
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for ZmqDiscovery {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pack(value: &serde_json::Value) -> Vec<u8> {
        rmp_serde::to_vec_named(value).unwrap()
    }

    #[test]
    fn a_prefill_registration_decodes() {
        let payload = pack(&serde_json::json!({
            "type": "P", "http_address": "10.0.0.1:8100", "zmq_address": "10.0.0.1:21001",
            "transfer_mode": "write"
        }));
        let registration = decode_registration(&payload).unwrap();
        assert_eq!(registration.role, RegisteredRole::Prefill);
        assert_eq!(registration.url(), "http://10.0.0.1:8100");
        assert_eq!(registration.zmq_address.as_deref(), Some("10.0.0.1:21001"));
        assert_eq!(registration.transfer_mode.as_deref(), Some("WRITE"));
    }

    #[test]
    fn the_moriio_form_decodes_with_its_side_channel() {
        let payload = pack(&serde_json::json!({
            "type": "register", "role": "D",
            "request_address": "http://10.0.0.2:8200/v1/completions",
            "handshake_port": 7001, "notify_port": 7002, "dp_size": 2, "tp_size": 4,
            "transfer_mode": "READ"
        }));
        let registration = decode_registration(&payload).unwrap();
        assert_eq!(registration.role, RegisteredRole::Decode);
        assert_eq!(registration.url(), "http://10.0.0.2:8200");
        assert_eq!(registration.transfer_mode.as_deref(), Some("READ"));
        let moriio = registration.moriio.unwrap();
        assert_eq!((moriio.handshake_port, moriio.notify_port), (7001, 7002));
        assert_eq!((moriio.dp_size, moriio.tp_size), (2, 4));
        let bad = pack(&serde_json::json!({
            "type": "register", "role": "P", "request_address": "ftp://h/x"
        }));
        assert!(matches!(
            decode_registration(&bad),
            Err(MessageError::HttpAddress(_))
        ));
    }

    #[test]
    fn bad_messages_are_refused_with_a_reason() {
        let cases = [
            (
                pack(&serde_json::json!({"type": "X", "http_address": "h:1"})),
                "unknown type",
            ),
            (
                pack(&serde_json::json!({"type": "D", "http_address": "nohost"})),
                "http_address",
            ),
            (
                pack(&serde_json::json!({"type": "D", "http_address": "h:99999"})),
                "http_address",
            ),
            (
                pack(&serde_json::json!({"type": "D"})),
                "not a registration",
            ),
            (
                pack(
                    &serde_json::json!({"type": "D", "http_address": "h:1", "transfer_mode": "x"}),
                ),
                "transfer_mode",
            ),
            (b"\xff\x00garbage".to_vec(), "not a registration"),
        ];
        for (payload, expected) in cases {
            let err = decode_registration(&payload).unwrap_err();
            assert!(err.to_string().contains(expected), "{err} vs {expected}");
        }
    }

    #[test]
    fn malformed_messages_are_counted_and_state_is_unchanged() {
        let registries = Registries::new(Duration::from_secs(5));
        let now = Instant::now();
        let identity = Bytes::from_static(b"peer");
        assert!(
            registries
                .apply(std::slice::from_ref(&identity), now)
                .is_err()
        );
        assert!(
            registries
                .apply(&[identity.clone(), Bytes::from_static(b"\x93")], now)
                .is_err()
        );
        assert_eq!(registries.malformed_messages(), 2);
        assert!(registries.prefill.is_empty() && registries.decode.is_empty());
        // A REQ-style empty delimiter before the payload is accepted.
        let payload = pack(&serde_json::json!({"type": "D", "http_address": "127.0.0.1:9"}));
        let generation = registries
            .apply(&[identity, Bytes::new(), Bytes::from(payload)], now)
            .unwrap();
        assert_eq!(
            registries.decode.snapshot(now).entries[0].generation,
            generation
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let registries = Registries::new(Duration::from_secs(5));
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        for round in 0..500 {
            let len = round % 64;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            let _ = decode_registration(&bytes);
            let _ = decode_json_registration(&bytes);
            let _ = registries.apply_json(&bytes, Instant::now());
            let _ = registries.apply(&[Bytes::new(), Bytes::from(bytes)], Instant::now());
        }
    }
}
