//! The two registries discovery feeds, and how a registration lands there.
//!
//! Applying a registration is synchronous and cheap: one
//! [`ServiceRegistry::register`] call. Whatever may be slow (an address
//! check that resolves a host name) happens before, in
//! [`Registrar`](crate::Registrar), never while a registry is touched.

use crate::message::{
    EngineRegistration, MessageError, RegisteredRole, decode_json_registration,
    decode_registration, payload_of,
};
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use worker_lifecycle::{Endpoint, Registration, RoleKind, ServiceRegistry, labels};

/// The two registries fed by discovery, one per role, and the counters of
/// what was refused. Cheap to clone: clones share the registries.
#[derive(Debug, Clone)]
pub struct Registries {
    /// Prefill engines (`type: "P"`).
    pub prefill: Arc<ServiceRegistry>,
    /// Decode engines (`type: "D"`).
    pub decode: Arc<ServiceRegistry>,
    counters: Arc<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    malformed: AtomicU64,
    refused: AtomicU64,
}

impl Registries {
    /// Empty registries whose entries live `ttl` after their last message.
    pub fn new(ttl: Duration) -> Self {
        Self {
            prefill: Arc::new(ServiceRegistry::new(RoleKind::Prefill, ttl)),
            decode: Arc::new(ServiceRegistry::new(RoleKind::Decode, ttl)),
            counters: Arc::default(),
        }
    }

    /// The registry of `role`.
    pub fn of(&self, role: RegisteredRole) -> &Arc<ServiceRegistry> {
        match role {
            RegisteredRole::Prefill => &self.prefill,
            RegisteredRole::Decode => &self.decode,
        }
    }

    /// Applies one multipart ZMQ message received at `now`, with no address
    /// check: registers or refreshes the engine and returns its generation,
    /// or counts the message as malformed.
    pub fn apply(&self, frames: &[Bytes], now: Instant) -> Result<u64, MessageError> {
        let registration = self.decoded(payload_of(frames).and_then(decode_registration))?;
        Ok(self.register(&registration, now))
    }

    /// Applies one JSON registration (`POST /register`) received at `now`,
    /// with no address check.
    pub fn apply_json(
        &self,
        body: &[u8],
        now: Instant,
    ) -> Result<(EngineRegistration, u64), MessageError> {
        let registration = self.decoded(decode_json_registration(body))?;
        let generation = self.register(&registration, now);
        Ok((registration, generation))
    }

    /// Passes a decoded registration through, counting a refusal.
    pub(crate) fn decoded(
        &self,
        result: Result<EngineRegistration, MessageError>,
    ) -> Result<EngineRegistration, MessageError> {
        if result.is_err() {
            self.counters.malformed.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    /// Counts a registration refused by the address check.
    pub(crate) fn count_refused(&self) {
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a message the socket could not even deliver.
    pub(crate) fn count_malformed(&self) {
        self.counters.malformed.fetch_add(1, Ordering::Relaxed);
    }

    /// Registers (or refreshes) a validated registration at `now` and
    /// returns its generation. The labels are worker-lifecycle's
    /// [`labels`] contract, which the prefill/decode pools read.
    pub fn register(&self, registration: &EngineRegistration, now: Instant) -> u64 {
        let endpoint = Endpoint::from_url(registration.worker_url.clone(), None);
        let mut entries = BTreeMap::new();
        // Labels hold the canonical spelling validated in `message`: the
        // text the address check was shown is the text later dialled.
        if let Some(zmq) = &registration.zmq_address {
            entries.insert(labels::KV_ADDR.to_owned(), zmq.to_string());
        }
        for (label, value) in [
            (labels::KV_EVENTS_ENDPOINT, &registration.kv_events_endpoint),
            (
                labels::KV_EVENTS_REPLAY_ENDPOINT,
                &registration.kv_events_replay_endpoint,
            ),
        ] {
            if let Some(value) = value {
                entries.insert(label.to_owned(), value.to_string());
            }
        }
        if let Some(mode) = &registration.transfer_mode {
            entries.insert(labels::MORIIO_MODE.to_owned(), mode.to_ascii_lowercase());
        }
        if let Some(moriio) = &registration.moriio {
            for (label, value) in [
                (
                    labels::MORIIO_HANDSHAKE_PORT,
                    moriio.handshake_port.to_string(),
                ),
                (labels::MORIIO_NOTIFY_PORT, moriio.notify_port.to_string()),
                (labels::DP_SIZE, moriio.dp_size.to_string()),
                (labels::TP_SIZE, moriio.tp_size.to_string()),
            ] {
                entries.insert(label.to_owned(), value);
            }
        }
        let details = Registration {
            labels: entries,
            ..Registration::default()
        };
        let outcome = self.of(registration.role).register(endpoint, details, now);
        if outcome.new_lifetime {
            tracing::info!(
                role = registration.role.as_str(),
                url = %registration.worker_url,
                generation = outcome.generation,
                "engine registered"
            );
        }
        outcome.generation
    }

    /// Messages refused as malformed so far (both transports).
    pub fn malformed_messages(&self) -> u64 {
        self.counters.malformed.load(Ordering::Relaxed)
    }

    /// Well-formed registrations refused by the address check so far
    /// (outside the allowed networks, unresolvable, or not checked in time).
    pub fn refused_addresses(&self) -> u64 {
        self.counters.refused.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pack(value: &serde_json::Value) -> Vec<u8> {
        rmp_serde::to_vec_named(value).unwrap()
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
    fn registrations_carry_the_label_contract() {
        let registries = Registries::new(Duration::from_secs(5));
        let now = Instant::now();
        let body = serde_json::json!({
            "type": "register", "role": "P",
            "request_address": "http://10.0.0.3:8100/v1/completions",
            "handshake_port": 7001, "notify_port": 7002, "dp_size": 2,
            "transfer_mode": "WRITE", "kv_events_endpoint": "tcp://10.0.0.3:5557"
        });
        let (registration, generation) = registries
            .apply_json(body.to_string().as_bytes(), now)
            .unwrap();
        assert_eq!(registration.role, RegisteredRole::Prefill);
        let snapshot = registries.prefill.snapshot(now);
        let entry = &snapshot.entries[0];
        assert_eq!(entry.generation, generation);
        assert_eq!(entry.endpoint.to_string(), "http://10.0.0.3:8100");
        let got: Vec<(&str, &str)> = entry
            .registration
            .labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                (labels::DP_SIZE, "2"),
                (labels::KV_EVENTS_ENDPOINT, "tcp://10.0.0.3:5557"),
                (labels::MORIIO_HANDSHAKE_PORT, "7001"),
                (labels::MORIIO_MODE, "write"),
                (labels::MORIIO_NOTIFY_PORT, "7002"),
                (labels::TP_SIZE, "1"),
            ]
        );
        assert!(registries.decode.is_empty());
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
