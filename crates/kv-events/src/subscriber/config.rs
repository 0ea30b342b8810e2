//! How a subscriber connects: its configuration, its backoff, and the
//! addresses of data-parallel ranks.

use std::time::Duration;

#[cfg(doc)]
use super::Subscriber;
use crate::endpoint::ZmqEndpoint;
use crate::sequencer::SequencerConfig;
use crate::wire::DecodeLimits;

/// Exponential backoff between connection attempts (no jitter: one
/// subscriber per engine, nothing to de-synchronise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    /// The first delay (default 100 ms).
    pub initial: Duration,
    /// The longest delay (default 5 s).
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(5),
        }
    }
}

impl Backoff {
    /// The delay before attempt `failures + 1`, after `failures`
    /// consecutive failures (`failures >= 1`): `initial * 2^(failures-1)`,
    /// capped at `max`.
    #[must_use]
    pub fn delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(30);
        self.initial.saturating_mul(1 << doublings).min(self.max)
    }
}

/// How a [`Subscriber`] connects and behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SubscriberConfig {
    /// The engine's PUB address, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The engine's replay (ROUTER) address, e.g. `tcp://10.0.0.5:5558`;
    /// `None` turns replay off (gaps then reset the stream).
    pub replay_endpoint: Option<String>,
    /// The topic prefix to subscribe to (vLLM's `topic`; empty takes all).
    pub topic: String,
    /// The sequencing rules (replay timeout, catch-up, buffering).
    pub sequencer: SequencerConfig,
    /// How long one connection attempt may take (default 1 s).
    pub connect_timeout: Duration,
    /// Delays between failed connection attempts.
    pub backoff: Backoff,
    /// Bounds on decoded payloads. Its `max_payload_bytes` is also the
    /// sockets' `ZMQ_MAXMSGSIZE`: no frame larger than the largest payload
    /// accepted is ever buffered.
    pub limits: DecodeLimits,
}

impl SubscriberConfig {
    /// A configuration for the engine at `endpoint` with the defaults and
    /// no replay endpoint.
    #[must_use]
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            sequencer: SequencerConfig::default(),
            connect_timeout: Duration::from_secs(1),
            backoff: Backoff::default(),
            limits: DecodeLimits::default(),
        }
    }

    /// Sets the replay address.
    #[must_use]
    pub fn with_replay(mut self, replay_endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(replay_endpoint.into());
        self
    }

    /// Sets the topic prefix.
    #[must_use]
    pub fn with_topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }
}

/// The address of data-parallel rank `rank`'s socket, given the address
/// vLLM was configured with: vLLM's `offset_endpoint_port` adds the rank to
/// a TCP port and appends `_dp{rank}` to an `inproc` name; rank 0 keeps the
/// address. `None` when a TCP address is not a valid [`ZmqEndpoint`] (no
/// numeric port, a wildcard host, ...) or its port would overflow, or the
/// transport is neither (vLLM refuses those too).
#[must_use]
pub fn endpoint_for_rank(endpoint: &str, rank: u16) -> Option<String> {
    if rank == 0 {
        return Some(endpoint.to_owned());
    }
    if endpoint.contains("inproc") {
        return Some(format!("{endpoint}_dp{rank}"));
    }
    if !endpoint.contains("tcp") {
        return None;
    }
    let base = ZmqEndpoint::parse(endpoint).ok()?;
    let port = base.port().checked_add(rank)?;
    ZmqEndpoint::new(base.host(), port)
        .ok()
        .map(|at| at.to_string())
}
