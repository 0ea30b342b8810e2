//! The registration message: its two wire forms and their validation.
//!
//! A message is decoded and validated completely before anything else looks
//! at it, so the rest of the crate handles only well-formed registrations
//! and every refusal carries the reason a log line or an HTTP answer shows.

use bytes::Bytes;
use serde::Deserialize;
use worker_lifecycle::WorkerUrl;

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

/// MoRI-IO side-channel facts an engine announces in the MoRI-IO form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoriIoPorts {
    /// The handshake port.
    pub handshake_port: u16,
    /// The notify port.
    pub notify_port: u16,
    /// Data-parallel size (at least 1).
    pub dp_size: u32,
    /// Tensor-parallel size (at least 1).
    pub tp_size: u32,
}

/// One validated registration message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineRegistration {
    /// The engine's role.
    pub role: RegisteredRole,
    /// Its HTTP address as announced, `host:port`.
    pub http_address: String,
    /// Its base URL, `http://` + the address in canonical spelling.
    pub worker_url: WorkerUrl,
    /// Its ZMQ address for KV transfers, when it sent one.
    pub zmq_address: Option<String>,
    /// `READ` or `WRITE` (MoRI-IO), upper case, when it sent one.
    pub transfer_mode: Option<String>,
    /// MoRI-IO side-channel facts, from the MoRI-IO registration form.
    pub moriio: Option<MoriIoPorts>,
    /// Where it publishes its KV-cache events (`tcp://host:port`), when it
    /// sent `kv_events_endpoint` (an addition of ours to vLLM's form).
    pub kv_events_endpoint: Option<String>,
    /// Its KV event replay socket, when it sent
    /// `kv_events_replay_endpoint`.
    pub kv_events_replay_endpoint: Option<String>,
}

impl EngineRegistration {
    /// The worker URL, `http://host:port` (canonical).
    pub fn url(&self) -> String {
        self.worker_url.to_string()
    }
}

/// Why a registration message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// The payload is not a map with the expected fields.
    #[error("not a registration map: {0}")]
    Decode(String),
    /// `type` (or `role` in the MoRI-IO form) is neither `P` nor `D`.
    #[error("unknown type {0:?} (expected \"P\" or \"D\")")]
    UnknownType(String),
    /// `http_address` is not `host:port`, or `request_address` is not an
    /// `http://host:port/...` URL.
    #[error("invalid http_address {0:?} (expected host:port)")]
    HttpAddress(String),
    /// A KV events address is not `tcp://HOST:PORT`.
    #[error("{field} {value:?} is not a tcp://HOST:PORT address")]
    KvEventsEndpoint {
        /// The field.
        field: &'static str,
        /// What was sent.
        value: String,
    },
    /// `transfer_mode` is neither `READ` nor `WRITE`.
    #[error("unknown transfer_mode {0:?} (expected \"READ\" or \"WRITE\")")]
    TransferMode(String),
    /// The multipart message has no payload frame.
    #[error("the message has no payload frame")]
    NoPayload,
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
    handshake_port: Option<u16>,
    #[serde(default)]
    notify_port: Option<u16>,
    #[serde(default)]
    dp_size: Option<u32>,
    #[serde(default)]
    tp_size: Option<u32>,
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
    let wire: Wire =
        rmp_serde::from_slice(payload).map_err(|err| MessageError::Decode(err.to_string()))?;
    validate(wire)
}

/// Decodes the same registration sent as a JSON object (`POST /register`).
/// Never panics.
pub fn decode_json_registration(body: &[u8]) -> Result<EngineRegistration, MessageError> {
    let wire: Wire =
        serde_json::from_slice(body).map_err(|err| MessageError::Decode(err.to_string()))?;
    validate(wire)
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
        other => return Err(MessageError::UnknownType(other.to_owned())),
    };
    let worker_url = host_port_url(&address).ok_or(MessageError::HttpAddress(address.clone()))?;
    let transfer_mode = match wire.transfer_mode {
        None => None,
        Some(mode) if mode.eq_ignore_ascii_case("read") => Some("READ".to_owned()),
        Some(mode) if mode.eq_ignore_ascii_case("write") => Some("WRITE".to_owned()),
        Some(mode) => return Err(MessageError::TransferMode(mode)),
    };
    let moriio = match (wire.handshake_port, wire.notify_port) {
        (Some(handshake_port), Some(notify_port)) => Some(MoriIoPorts {
            handshake_port,
            notify_port,
            dp_size: wire.dp_size.unwrap_or(1).max(1),
            tp_size: wire.tp_size.unwrap_or(1).max(1),
        }),
        _ => None,
    };
    let kv_events = |field: &'static str, value: Option<String>| match value {
        Some(text) if !is_tcp_endpoint(&text) => {
            Err(MessageError::KvEventsEndpoint { field, value: text })
        }
        other => Ok(other),
    };
    Ok(EngineRegistration {
        role,
        http_address: address,
        worker_url,
        zmq_address: wire.zmq_address,
        transfer_mode,
        moriio,
        kv_events_endpoint: kv_events("kv_events_endpoint", wire.kv_events_endpoint)?,
        kv_events_replay_endpoint: kv_events(
            "kv_events_replay_endpoint",
            wire.kv_events_replay_endpoint,
        )?,
    })
}

/// `tcp://HOST:PORT` with a non-empty host and a numeric port.
fn is_tcp_endpoint(text: &str) -> bool {
    text.strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
}

/// The plain-HTTP URL of a `host:port` address: a host, an explicit port,
/// no path.
fn host_port_url(address: &str) -> Option<WorkerUrl> {
    let (host, port) = address.rsplit_once(':')?;
    if host.is_empty() || port.parse::<u16>().is_err() || address.contains('/') {
        return None;
    }
    WorkerUrl::parse_http(&format!("http://{address}")).ok()
}

/// `host:port` of a URL like `http://host:port/v1/completions`.
fn authority_of(url: &str) -> Result<String, MessageError> {
    let refused = || MessageError::HttpAddress(url.to_owned());
    let uri: http::Uri = url.trim().parse().map_err(|_| refused())?;
    match (uri.scheme_str(), uri.authority()) {
        (Some("http"), Some(authority)) if authority.port_u16().is_some() => {
            Ok(authority.as_str().to_owned())
        }
        _ => Err(refused()),
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
    fn kv_event_addresses_are_read_and_checked() {
        let payload = pack(&serde_json::json!({
            "type": "P", "http_address": "10.0.0.1:8100",
            "kv_events_endpoint": "tcp://10.0.0.1:5557",
            "kv_events_replay_endpoint": "tcp://10.0.0.1:5558"
        }));
        let registration = decode_registration(&payload).unwrap();
        assert_eq!(
            registration.kv_events_endpoint.as_deref(),
            Some("tcp://10.0.0.1:5557")
        );
        assert_eq!(
            registration.kv_events_replay_endpoint.as_deref(),
            Some("tcp://10.0.0.1:5558")
        );
        for (field, value) in [
            ("kv_events_endpoint", "10.0.0.1:5557"),
            ("kv_events_replay_endpoint", "tcp://10.0.0.1:port"),
        ] {
            let mut body = serde_json::json!({"type": "D", "http_address": "h:1"});
            body[field] = value.into();
            let err = decode_json_registration(body.to_string().as_bytes()).unwrap_err();
            assert!(
                matches!(&err, MessageError::KvEventsEndpoint { field: f, .. } if *f == field),
                "{err}"
            );
            assert!(err.to_string().contains(value), "{err}");
        }
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
    fn the_json_form_is_the_same_map() {
        let registration =
            decode_json_registration(br#"{"type": "d", "http_address": " localhost:8300 "}"#)
                .unwrap();
        assert_eq!(registration.role, RegisteredRole::Decode);
        assert_eq!(registration.url(), "http://127.0.0.1:8300");
        let err = decode_json_registration(br#"{"type": "D", "http_address": "h:1/x"}"#);
        assert!(matches!(err, Err(MessageError::HttpAddress(_))));
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
