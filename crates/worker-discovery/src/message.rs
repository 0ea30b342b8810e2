//! The registration message: its two wire forms and their validation.
//!
//! A message is decoded and validated completely before anything else looks
//! at it, so the rest of the crate handles only well-formed registrations
//! and every refusal carries the reason a log line or an HTTP answer shows.
//!
//! # Every announced address is typed
//!
//! A registration announces more than its HTTP address: a ZMQ address for
//! KV transfers (which ends up in a P2P request-id header), KV event
//! endpoints (which the router dials), MoRI-IO side-channel ports. Each is
//! parsed with the one set of rules of the workspace's ZMQ endpoint parser,
//! [`kv_events::ZmqEndpoint`]: bounded length ([`MAX_ADDRESS_LEN`]), only
//! the characters a host name, an IP literal and a port are made of (so no
//! whitespace, control characters, user info, zone ids or paths), a port
//! from 1 to 65535. Here the host is then put in the canonical spelling of
//! [`WorkerUrl`]: a `host:port` becomes a [`HostPort`], a `tcp://host:port`
//! a [`ZmqEndpoint`] with that host. What is stored and later dialled is
//! that canonical text, the very string the address check
//! ([`crate::AddressCheck`]) was shown, so a parser differential between
//! the check and the dialler cannot let an address through. Sizes are
//! bounded too ([`MAX_PARALLEL_SIZE`]).
//!
//! # The same address in both roles
//!
//! An engine may register as prefill and as decode at the same HTTP address
//! (and so the same ZMQ or KV address): vLLM runs both roles on one engine
//! with a `kv_both` connector. Prefill and decode are separate resources
//! even at the same URL, so such an engine is two entries, one per role's
//! registry, each with its own generation, load and breaker; nothing is
//! refused for it.

use bytes::Bytes;
use kv_events::ZmqEndpoint;
use serde::Deserialize;
use std::fmt;
use worker_lifecycle::WorkerUrl;

/// The longest address accepted in any field, in bytes: a DNS name (at most
/// 253) in brackets, a colon and a port, with the `tcp://` or `http://`
/// scheme and a short path for `request_address`. The endpoint parser's
/// bound ([`ZmqEndpoint::MAX_LEN`]), so one length holds for every field.
pub const MAX_ADDRESS_LEN: usize = ZmqEndpoint::MAX_LEN;

/// The largest `dp_size` or `tp_size` accepted (the smallest is 1). Real
/// deployments stay far below; the bound keeps products of the two (ranks
/// to enumerate, ports to derive) small.
pub const MAX_PARALLEL_SIZE: u32 = 1024;

/// How much of a refused value an error message quotes.
const QUOTED_CHARS: usize = 64;

/// The role an engine registers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegisteredRole {
    /// `"P"`: a prefill engine.
    Prefill,
    /// `"D"`: a decode engine.
    Decode,
}

impl RegisteredRole {
    /// `"prefill"` or `"decode"`, as answers and logs spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// A validated `host:port` an engine announced: the rules of
/// [`ZmqEndpoint::parse_address`], then the host canonical (see
/// [`WorkerUrl`]), the port from 1 to 65535.
///
/// ```
/// use worker_discovery::HostPort;
///
/// let address = HostPort::parse("LocalHost:21001").unwrap();
/// assert_eq!(address.to_string(), "127.0.0.1:21001");
/// assert_eq!(address.port(), 21001);
/// for bad in ["10.0.0.1:0", "10.0.0.1:1\r\nx: y", "u:p@10.0.0.1:1", "[::1%eth0]:1", "h"] {
///     assert!(HostPort::parse(bad).is_err(), "{bad}");
/// }
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostPort {
    /// `http://host:port`: the form an [`crate::AddressCheck`] is given.
    url: WorkerUrl,
}

impl HostPort {
    /// Parses `text`, `host:port` (IPv6 in brackets). The error is the
    /// reason, for a message that names the field.
    pub fn parse(text: &str) -> Result<Self, String> {
        let address = ZmqEndpoint::parse_address(text).map_err(|err| err.to_string())?;
        Self::canonical(&address)
    }

    /// The canonical spelling of a parsed address's host and port.
    fn canonical(address: &ZmqEndpoint) -> Result<Self, String> {
        let url = WorkerUrl::parse_http(&format!("http://{}", address.host_port()))
            .map_err(|err| err.reason().to_owned())?;
        Ok(Self { url })
    }

    /// The address of `endpoint`, which must already be in canonical
    /// spelling: the address check is shown exactly what will be dialled.
    fn of_endpoint(endpoint: &ZmqEndpoint) -> Result<Self, String> {
        let address = Self::canonical(endpoint)?;
        if address.to_string() != endpoint.host_port() {
            return Err(format!(
                "not in canonical spelling (the address check would see {address})"
            ));
        }
        Ok(address)
    }

    /// This address as a `tcp://` endpoint.
    fn to_endpoint(&self) -> Result<ZmqEndpoint, String> {
        ZmqEndpoint::new(self.host(), self.port()).map_err(|err| err.to_string())
    }

    /// The host, canonical, without IPv6 brackets.
    pub fn host(&self) -> &str {
        self.url.host()
    }

    /// The port (never 0).
    pub fn port(&self) -> u16 {
        self.url.port()
    }

    /// `http://host:port`, what an [`crate::AddressCheck`] checks (the
    /// scheme is only a carrier: the check looks at the host and port).
    pub fn as_url(&self) -> &WorkerUrl {
        &self.url
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.url.host_port())
    }
}

impl fmt::Debug for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostPort({self})")
    }
}

/// A KV event endpoint an engine announced, `tcp://host:port`: parsed by
/// [`ZmqEndpoint`], then with its host in canonical spelling.
fn canonical_endpoint(text: &str) -> Result<ZmqEndpoint, String> {
    let parsed = ZmqEndpoint::parse(text).map_err(|err| err.to_string())?;
    HostPort::canonical(&parsed)?.to_endpoint()
}

/// At most [`QUOTED_CHARS`] characters of `text`, for an error message.
fn quoted(text: &str) -> String {
    match text.char_indices().nth(QUOTED_CHARS) {
        Some((end, _)) => format!("{}... ({} bytes)", &text[..end], text.len()),
        None => text.to_owned(),
    }
}

/// MoRI-IO side-channel facts an engine announces in the MoRI-IO form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoriIoPorts {
    /// The handshake port (1-65535).
    pub handshake_port: u16,
    /// The notify port (1-65535).
    pub notify_port: u16,
    /// Data-parallel size, 1 to [`MAX_PARALLEL_SIZE`].
    pub dp_size: u32,
    /// Tensor-parallel size, 1 to [`MAX_PARALLEL_SIZE`].
    pub tp_size: u32,
}

/// One validated registration message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineRegistration {
    /// The engine's role.
    pub role: RegisteredRole,
    /// Its HTTP address, `host:port` in canonical spelling.
    pub http_address: HostPort,
    /// Its base URL, `http://` + the address in canonical spelling.
    pub worker_url: WorkerUrl,
    /// Its ZMQ address for KV transfers, when it sent one.
    pub zmq_address: Option<HostPort>,
    /// `READ` or `WRITE` (MoRI-IO), upper case, when it sent one.
    pub transfer_mode: Option<String>,
    /// MoRI-IO side-channel facts, from the MoRI-IO registration form.
    pub moriio: Option<MoriIoPorts>,
    /// Where it publishes its KV-cache events, when it sent
    /// `kv_events_endpoint` (an addition of ours to vLLM's form).
    pub kv_events_endpoint: Option<ZmqEndpoint>,
    /// Its KV event replay socket, when it sent
    /// `kv_events_replay_endpoint`.
    pub kv_events_replay_endpoint: Option<ZmqEndpoint>,
}

impl EngineRegistration {
    /// The worker URL, `http://host:port` (canonical).
    pub fn url(&self) -> String {
        self.worker_url.to_string()
    }

    /// Every address the registration announces, with the field that
    /// announced it: the worker's own first, then the KV event endpoints
    /// (which the router dials), then the ZMQ address (which peer engines
    /// dial when the router names it in a request). The MoRI-IO ports are
    /// on the worker's host.
    ///
    /// # Errors
    ///
    /// As [`dialled_addresses`](Self::dialled_addresses).
    pub fn announced_addresses(&self) -> Result<Vec<(&'static str, HostPort)>, MessageError> {
        let mut addresses = self.dialled_addresses()?;
        if let Some(zmq) = &self.zmq_address {
            addresses.push(("zmq_address", zmq.clone()));
        }
        Ok(addresses)
    }

    /// The addresses the router itself connects to: the worker's HTTP
    /// address and its KV event endpoints.
    ///
    /// # Errors
    ///
    /// A KV event endpoint whose host is not in canonical spelling, which
    /// only a registration built by hand rather than decoded can hold: the
    /// address checked must be the text dialled, so such an endpoint is
    /// refused, naming its field, rather than checked under another
    /// spelling.
    pub fn dialled_addresses(&self) -> Result<Vec<(&'static str, HostPort)>, MessageError> {
        let mut addresses = vec![("http_address", self.http_address.clone())];
        for (field, endpoint) in [
            ("kv_events_endpoint", &self.kv_events_endpoint),
            ("kv_events_replay_endpoint", &self.kv_events_replay_endpoint),
        ] {
            if let Some(endpoint) = endpoint {
                let address = HostPort::of_endpoint(endpoint)
                    .map_err(|reason| MessageError::field_error(field, endpoint, reason))?;
                addresses.push((field, address));
            }
        }
        Ok(addresses)
    }
}

/// Why a registration message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// The payload is not a map with the expected fields.
    #[error("not a registration map: {0}")]
    Decode(String),
    /// A field has a value that is refused; the message names the field,
    /// quotes (the start of) the value and says why.
    #[error("{field} {value:?}: {reason}")]
    Field {
        /// The field, as the wire form spells it (`zmq_address`).
        field: &'static str,
        /// What was sent, cut to its first 64 characters.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The multipart message has no payload frame.
    #[error("the message has no payload frame")]
    NoPayload,
}

impl MessageError {
    /// The field the refusal is about, when it is about one.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            Self::Field { field, .. } => Some(field),
            _ => None,
        }
    }

    fn field_error(field: &'static str, value: impl fmt::Display, reason: String) -> Self {
        Self::Field {
            field,
            value: quoted(&value.to_string()),
            reason,
        }
    }
}

/// An integer field read wide, so that an out-of-range value is refused
/// with a message naming its field rather than a bare decode error.
#[derive(Debug, Clone, Copy)]
struct WireInt(i128);

impl<'de> Deserialize<'de> for WireInt {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = WireInt;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E: serde::de::Error>(self, value: i64) -> Result<WireInt, E> {
                Ok(WireInt(value.into()))
            }
            fn visit_u64<E: serde::de::Error>(self, value: u64) -> Result<WireInt, E> {
                Ok(WireInt(value.into()))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// Both wire forms in one shape; `validate` tells them apart.
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
    // The MoRI-IO form names the role in `role` and the engine by URL.
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    request_address: Option<String>,
    #[serde(default)]
    handshake_port: Option<WireInt>,
    #[serde(default)]
    notify_port: Option<WireInt>,
    #[serde(default)]
    dp_size: Option<WireInt>,
    #[serde(default)]
    tp_size: Option<WireInt>,
    #[serde(default)]
    kv_events_endpoint: Option<String>,
    #[serde(default)]
    kv_events_replay_endpoint: Option<String>,
}

/// Decodes one registration payload (a MessagePack map). Never panics.
///
/// ```
/// use worker_discovery::{RegisteredRole, decode_registration};
///
/// // {"type": "D", "http_address": "10.0.0.7:8200"} in MessagePack.
/// let mut payload = vec![0x82, 0xa4];
/// payload.extend(b"type");
/// payload.extend([0xa1, b'D', 0xac]);
/// payload.extend(b"http_address");
/// payload.push(0xad);
/// payload.extend(b"10.0.0.7:8200");
/// let registration = decode_registration(&payload).unwrap();
/// assert_eq!(registration.role, RegisteredRole::Decode);
/// assert_eq!(registration.url(), "http://10.0.0.7:8200");
/// ```
pub fn decode_registration(payload: &[u8]) -> Result<EngineRegistration, MessageError> {
    let wire: Wire = rmp_serde::from_slice(payload).map_err(decode_error)?;
    validate(wire)
}

/// Decodes the same registration sent as a JSON object (`POST /register`).
/// Never panics.
pub fn decode_json_registration(body: &[u8]) -> Result<EngineRegistration, MessageError> {
    let wire: Wire = serde_json::from_slice(body).map_err(decode_error)?;
    validate(wire)
}

/// A decoder's error, cut short: serde quotes the offending value, which
/// may be as large as the body.
fn decode_error(err: impl fmt::Display) -> MessageError {
    let text = err.to_string();
    MessageError::Decode(match text.char_indices().nth(4 * QUOTED_CHARS) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text,
    })
}

/// The payload of a multipart ROUTER message `[identity, ..., payload]`: the
/// last non-empty frame after the identity (a REQ-style empty delimiter is
/// skipped).
pub fn payload_of(frames: &[Bytes]) -> Result<&[u8], MessageError> {
    frames
        .iter()
        .skip(1)
        .rev()
        .find(|frame| !frame.is_empty())
        .map(|frame| &frame[..])
        .ok_or(MessageError::NoPayload)
}

fn validate(wire: Wire) -> Result<EngineRegistration, MessageError> {
    let (role_field, role, http_address) = match (&wire.role, &wire.request_address) {
        (Some(role), Some(url)) => {
            let address = authority_of(url)
                .map_err(|reason| MessageError::field_error("request_address", url, reason))?;
            ("role", role.as_str(), address)
        }
        (Some(_), None) => {
            return Err(MessageError::Decode(
                "missing field `request_address` (the MoRI-IO form names the engine by URL)".into(),
            ));
        }
        (None, _) => {
            let address = wire
                .http_address
                .as_deref()
                .ok_or_else(|| MessageError::Decode("missing field `http_address`".into()))?;
            // Surrounding spaces are forgiven (some senders pad); any
            // other whitespace is refused with the rest.
            let address = HostPort::parse(address.trim_matches(' '))
                .map_err(|reason| MessageError::field_error("http_address", address, reason))?;
            ("type", wire.kind.as_str(), address)
        }
    };
    let role = match role {
        "P" | "p" => RegisteredRole::Prefill,
        "D" | "d" => RegisteredRole::Decode,
        other => {
            return Err(MessageError::field_error(
                role_field,
                other,
                "unknown role (expected \"P\" or \"D\")".into(),
            ));
        }
    };
    let worker_url = http_address.as_url().clone();
    let transfer_mode = match wire.transfer_mode {
        None => None,
        Some(mode) if mode.eq_ignore_ascii_case("read") => Some("READ".to_owned()),
        Some(mode) if mode.eq_ignore_ascii_case("write") => Some("WRITE".to_owned()),
        Some(mode) => {
            return Err(MessageError::field_error(
                "transfer_mode",
                mode,
                "unknown transfer mode (expected \"READ\" or \"WRITE\")".into(),
            ));
        }
    };
    let port = |field: &'static str, value: WireInt| match u16::try_from(value.0) {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(MessageError::field_error(
            field,
            value.0,
            "not a port from 1 to 65535".into(),
        )),
    };
    let size = |field: &'static str, value: Option<WireInt>| match value {
        None => Ok(1),
        Some(WireInt(size)) => u32::try_from(size)
            .ok()
            .filter(|size| (1..=MAX_PARALLEL_SIZE).contains(size))
            .ok_or_else(|| {
                MessageError::field_error(
                    field,
                    size,
                    format!("not a size from 1 to {MAX_PARALLEL_SIZE}"),
                )
            }),
    };
    // Sizes are checked whether or not the ports came: a refused value is
    // refused in every form.
    let (dp_size, tp_size) = (
        size("dp_size", wire.dp_size)?,
        size("tp_size", wire.tp_size)?,
    );
    let moriio = match (wire.handshake_port, wire.notify_port) {
        (Some(handshake), Some(notify)) => Some(MoriIoPorts {
            handshake_port: port("handshake_port", handshake)?,
            notify_port: port("notify_port", notify)?,
            dp_size,
            tp_size,
        }),
        (Some(_), None) | (None, Some(_)) => {
            let (field, value) = match wire.handshake_port {
                Some(value) => ("handshake_port", value),
                None => ("notify_port", wire.notify_port.unwrap_or(WireInt(0))),
            };
            return Err(MessageError::field_error(
                field,
                value.0,
                "handshake_port and notify_port come together".into(),
            ));
        }
        (None, None) => None,
    };
    let zmq_address = wire
        .zmq_address
        .map(|text| {
            HostPort::parse(&text)
                .map_err(|reason| MessageError::field_error("zmq_address", &text, reason))
        })
        .transpose()?;
    let kv_events = |field: &'static str, value: Option<String>| {
        value
            .map(|text| {
                canonical_endpoint(&text)
                    .map_err(|reason| MessageError::field_error(field, &text, reason))
            })
            .transpose()
    };
    Ok(EngineRegistration {
        role,
        http_address,
        worker_url,
        zmq_address,
        transfer_mode,
        moriio,
        kv_events_endpoint: kv_events("kv_events_endpoint", wire.kv_events_endpoint)?,
        kv_events_replay_endpoint: kv_events(
            "kv_events_replay_endpoint",
            wire.kv_events_replay_endpoint,
        )?,
    })
}

/// `host:port` of a URL like `http://host:port/v1/completions`: plain HTTP,
/// an explicit port, the same character rules as every address.
fn authority_of(url: &str) -> Result<HostPort, String> {
    let url = url.trim_matches(' ');
    // The path is not kept, but held to an address's characters all the
    // same: no CR/LF or user info anywhere in what an engine sends.
    kv_events::endpoint::check_address_text(url).map_err(|err| err.to_string())?;
    let rest = url
        .strip_prefix("http://")
        .ok_or("it must be an http://HOST:PORT/... URL")?;
    let authority = rest.split('/').next().unwrap_or(rest);
    HostPort::parse(authority)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pack(value: &serde_json::Value) -> Vec<u8> {
        rmp_serde::to_vec_named(value).unwrap()
    }

    fn refused(body: &serde_json::Value) -> MessageError {
        let err = decode_json_registration(body.to_string().as_bytes()).unwrap_err();
        let packed = decode_registration(&pack(body)).unwrap_err();
        assert_eq!(err, packed, "both wire forms refuse alike");
        err
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
        assert_eq!(
            registration.zmq_address.map(|a| a.to_string()).as_deref(),
            Some("10.0.0.1:21001")
        );
        assert_eq!(registration.transfer_mode.as_deref(), Some("WRITE"));
    }

    #[test]
    fn kv_event_addresses_are_read_and_checked() {
        let payload = pack(&serde_json::json!({
            "type": "P", "http_address": "10.0.0.1:8100",
            "kv_events_endpoint": "tcp://10.0.0.1:5557",
            "kv_events_replay_endpoint": "tcp://10.0.0.1:5558"
        }));
        let registration = decode_registration(&payload).unwrap();
        let text = |e: &Option<ZmqEndpoint>| e.as_ref().map(ToString::to_string);
        assert_eq!(
            text(&registration.kv_events_endpoint).as_deref(),
            Some("tcp://10.0.0.1:5557")
        );
        assert_eq!(
            text(&registration.kv_events_replay_endpoint).as_deref(),
            Some("tcp://10.0.0.1:5558")
        );
        for (field, value) in [
            ("kv_events_endpoint", "10.0.0.1:5557"),
            ("kv_events_replay_endpoint", "tcp://10.0.0.1:port"),
            ("kv_events_endpoint", "tcp://a:b@[::1]%x/y:5557"),
            ("kv_events_endpoint", "tcp://10.0.0.1:0"),
            ("kv_events_endpoint", "tcp://10.0.0.1:5557/x"),
            ("kv_events_replay_endpoint", "ipc:///tmp/kv"),
        ] {
            let mut body = serde_json::json!({"type": "D", "http_address": "h:1"});
            body[field] = value.into();
            let err = refused(&body);
            assert_eq!(err.field(), Some(field), "{err}");
            assert!(err.to_string().starts_with(field), "{err}");
        }
    }

    /// The probe's cases: each refused, naming its field, and the message
    /// never echoes more than a short quote of what was sent.
    #[test]
    fn hostile_fields_are_refused_by_name() {
        let long = "a".repeat(60 * 1024);
        let cases: Vec<(&str, serde_json::Value)> = vec![
            ("zmq_address", "10.0.0.1:21001\r\nx-injected: 1".into()),
            ("zmq_address", "10.0.0.1:21001\n".into()),
            ("zmq_address", format!("{long}:1").into()),
            ("zmq_address", "10.0.0.1:0".into()),
            ("zmq_address", "10.0.0.1".into()),
            ("zmq_address", "user:pw@10.0.0.1:1".into()),
            ("zmq_address", "[fe80::1%eth0]:1".into()),
            ("zmq_address", "::1:5555".into()),
            ("http_address", "10.0.0.1:0".into()),
            ("http_address", "10.0.0.1:8000\t".into()),
            ("http_address", "h\u{0}:1".into()),
            ("transfer_mode", "x".into()),
            ("type", "X".into()),
        ];
        for (field, value) in cases {
            let mut body = serde_json::json!({"type": "D", "http_address": "10.0.0.1:8000"});
            body[field] = value.clone();
            let err = refused(&body);
            assert_eq!(err.field(), Some(field), "{value}: {err}");
            assert!(err.to_string().len() < 300, "a short message: {err}");
            assert!(!err.to_string().contains('\n'), "{err}");
        }
    }

    #[test]
    fn a_huge_value_of_the_wrong_type_is_not_echoed() {
        let huge = "9".repeat(60 * 1024);
        let body = serde_json::json!({"type": "D", "http_address": "10.0.0.1:1", "dp_size": huge});
        for err in [
            decode_json_registration(body.to_string().as_bytes()).unwrap_err(),
            decode_registration(&pack(&body)).unwrap_err(),
        ] {
            assert!(matches!(err, MessageError::Decode(_)), "{err}");
            assert!(
                err.to_string().len() < 400,
                "{} bytes",
                err.to_string().len()
            );
        }
    }

    #[test]
    fn moriio_ports_and_sizes_are_bounded() {
        let base = serde_json::json!({
            "type": "register", "role": "D",
            "request_address": "http://10.0.0.2:8200/v1/completions",
            "handshake_port": 7001, "notify_port": 7002,
        });
        for (field, value) in [
            ("dp_size", serde_json::json!(4_294_967_295_u64)),
            ("tp_size", serde_json::json!(4_294_967_295_u64)),
            ("dp_size", serde_json::json!(0)),
            ("tp_size", serde_json::json!(1025)),
            ("dp_size", serde_json::json!(-1)),
            ("handshake_port", serde_json::json!(0)),
            ("notify_port", serde_json::json!(65536)),
        ] {
            let mut body = base.clone();
            body[field] = value.clone();
            let err = refused(&body);
            assert_eq!(err.field(), Some(field), "{value}: {err}");
        }
        let mut body = base.clone();
        body["dp_size"] = MAX_PARALLEL_SIZE.into();
        body["tp_size"] = 1.into();
        let moriio = decode_json_registration(body.to_string().as_bytes())
            .unwrap()
            .moriio
            .unwrap();
        assert_eq!((moriio.dp_size, moriio.tp_size), (MAX_PARALLEL_SIZE, 1));
        // Sizes are refused in the P2P form too, where they are not used.
        let err = refused(&serde_json::json!({
            "type": "P", "http_address": "10.0.0.1:1", "dp_size": 4_294_967_295_u64
        }));
        assert_eq!(err.field(), Some("dp_size"));
        // One port without the other.
        let err = refused(&serde_json::json!({
            "type": "register", "role": "P", "request_address": "http://h:1/v1",
            "handshake_port": 7001
        }));
        assert_eq!(err.field(), Some("handshake_port"));
    }

    #[test]
    fn addresses_are_stored_in_canonical_spelling() {
        let registration = decode_json_registration(
            serde_json::json!({
                "type": "P", "http_address": "LOCALHOST:8100", "zmq_address": "0x7f.1:21001",
                "kv_events_endpoint": "tcp://[::ffff:10.0.0.1]:5557"
            })
            .to_string()
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(registration.http_address.to_string(), "127.0.0.1:8100");
        assert_eq!(
            registration.zmq_address.unwrap().to_string(),
            "127.0.0.1:21001"
        );
        assert_eq!(
            registration.kv_events_endpoint.unwrap().to_string(),
            "tcp://10.0.0.1:5557"
        );
        let v6 = HostPort::parse("[::1]:5555").unwrap();
        assert_eq!((v6.host(), v6.port()), ("::1", 5555));
        assert_eq!(v6.to_string(), "[::1]:5555");
    }

    /// A KV event endpoint is parsed by `kv_events::ZmqEndpoint` and then
    /// spelled canonically; the refusals of either are the field's.
    #[test]
    fn kv_event_endpoints_are_zmq_endpoints_in_canonical_spelling() {
        let registration = decode_json_registration(
            serde_json::json!({
                "type": "P", "http_address": "10.0.0.1:8100",
                "kv_events_endpoint": "tcp://Engine-A.:05557",
                "kv_events_replay_endpoint": "tcp://[2001:DB8:0::1]:5558"
            })
            .to_string()
            .as_bytes(),
        )
        .unwrap();
        let endpoint = registration.kv_events_endpoint.clone().unwrap();
        assert_eq!((endpoint.host(), endpoint.port()), ("engine-a", 5557));
        assert_eq!(
            registration
                .kv_events_replay_endpoint
                .as_ref()
                .map(ToString::to_string)
                .as_deref(),
            Some("tcp://[2001:db8::1]:5558")
        );
        let dialled = registration.dialled_addresses().unwrap();
        let shown: Vec<(&str, String)> = dialled
            .iter()
            .map(|(field, address)| (*field, address.to_string()))
            .collect();
        assert_eq!(
            shown,
            [
                ("http_address", "10.0.0.1:8100".to_owned()),
                ("kv_events_endpoint", "engine-a:5557".to_owned()),
                ("kv_events_replay_endpoint", "[2001:db8::1]:5558".to_owned()),
            ]
        );
        for (value, reason) in [
            ("tcp://*:5557", "'*'"),
            ("tcp://a[b]:5557", "only enclose an IPv6 address"),
            ("tcp://[zz]:5557", "not a valid IPv6 address"),
            ("tcp://1.2.3.999:5557", "not a valid one"),
            ("tcp://..:5557", "no host"),
        ] {
            let err = refused(&serde_json::json!({
                "type": "D", "http_address": "h:1", "kv_events_endpoint": value
            }));
            assert_eq!(err.field(), Some("kv_events_endpoint"), "{err}");
            assert!(err.to_string().contains(reason), "{value}: {err}");
        }
    }

    /// A registration built by hand may hold an endpoint in another
    /// spelling than the one its address would be checked under: it is
    /// refused, not checked as something else.
    #[test]
    fn a_kv_endpoint_not_in_canonical_spelling_is_not_checked_as_another() {
        let mut registration =
            decode_json_registration(br#"{"type": "D", "http_address": "10.0.0.1:8000"}"#).unwrap();
        registration.kv_events_endpoint = Some("tcp://LOCALHOST:5557".parse().unwrap());
        let err = registration.dialled_addresses().unwrap_err();
        assert_eq!(err.field(), Some("kv_events_endpoint"), "{err}");
        assert!(err.to_string().contains("canonical spelling"), "{err}");
        assert!(registration.announced_addresses().is_err());
        registration.kv_events_endpoint = Some("tcp://127.0.0.1:5557".parse().unwrap());
        assert_eq!(registration.dialled_addresses().unwrap().len(), 2);
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
        for bad in [
            "ftp://h/x",
            "http://h/v1",
            "http://u:p@h:1/v1",
            "http://h:1/v1\r\n",
        ] {
            let err = refused(&serde_json::json!({
                "type": "register", "role": "P", "request_address": bad
            }));
            assert_eq!(err.field(), Some("request_address"), "{bad}: {err}");
        }
    }

    #[test]
    fn bad_messages_are_refused_with_a_reason() {
        let cases = [
            (
                pack(&serde_json::json!({"type": "X", "http_address": "h:1"})),
                "unknown role",
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
    fn the_json_form_is_the_same_map() {
        let registration =
            decode_json_registration(br#"{"type": "d", "http_address": " localhost:8300 "}"#)
                .unwrap();
        assert_eq!(registration.role, RegisteredRole::Decode);
        assert_eq!(registration.url(), "http://127.0.0.1:8300");
        let err = decode_json_registration(br#"{"type": "D", "http_address": "h:1/x"}"#);
        assert_eq!(err.unwrap_err().field(), Some("http_address"));
    }

    #[test]
    fn the_payload_is_the_last_non_empty_frame_after_the_identity() {
        let identity = Bytes::from_static(b"peer");
        assert_eq!(
            payload_of(std::slice::from_ref(&identity)),
            Err(MessageError::NoPayload)
        );
        let frames = [identity, Bytes::new(), Bytes::from_static(b"map")];
        assert_eq!(payload_of(&frames), Ok(&b"map"[..]));
    }
}
