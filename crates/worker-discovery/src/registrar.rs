//! Check, then register: the one path every registration takes.
//!
//! A host may restrict which engines can join (say, only addresses inside
//! the cluster's networks). That check can be slow — a host name is
//! resolved — so it is an [`AddressCheck`] the host plugs in, always run
//! under a timeout and never while a registry is touched. The ZMQ listener
//! runs it off its receive loop ([`crate::zmq`]); an HTTP handler awaits it
//! in its own request ([`Registrar::register_json`]).
//!
//! # Every announced address is checked
//!
//! A registration names more than the worker's HTTP address: a ZMQ
//! address a peer engine will connect to, KV event endpoints the router
//! itself dials (and redials while the engine stays registered). An
//! allow-list that checked only the worker URL would let an engine inside
//! the networks point the router anywhere else. So [`Registrar::admit`]
//! runs the check on every address the router dials
//! ([`EngineRegistration::dialled_addresses`]: the worker URL and the KV
//! event endpoints), and with [`Registrar::checking_peer_addresses`] on
//! the ZMQ address too (which peer engines dial; also when the check's
//! [`AddressCheck::checks_peer_addresses`] says so), each host once, all
//! within the one timeout; a refusal names the field whose address failed.
//!
//! The ZMQ address is opt-in because it changes how many times a check
//! runs per message (hosts whose checks are metered or rate-limited see
//! one more call when an engine announces its ZMQ address on another
//! host); a host that enforces an allow-list should turn it on.

use crate::message::{EngineRegistration, MessageError, decode_json_registration};
use crate::registries::Registries;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_events::LogThrottle;
use worker_lifecycle::WorkerUrl;

/// How long an address check may take by default before the registration
/// is refused.
pub const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// The future an [`AddressCheck`] returns.
pub type CheckFuture<'a> = Pin<Box<dyn Future<Output = Result<(), AddressRefused>> + Send + 'a>>;

/// Decides whether an engine at `url` may register. Implemented by the
/// host: an allow-list of networks, a DNS lookup, a lookup in an inventory.
///
/// The [`Registrar`] calls it for every address a registration announces
/// (the worker's HTTP address, its ZMQ address, its KV event endpoints),
/// each given as `http://host:port`: the scheme is only a carrier, a check
/// judges the host and port.
///
/// The check may take as long as it likes; the caller bounds it with a
/// timeout and drops the future when that passes, so it must be cancel
/// safe (most async code is).
///
/// ```
/// use worker_discovery::{AddressCheck, AddressRefused, CheckFuture};
/// use worker_lifecycle::WorkerUrl;
///
/// /// Only engines on loopback.
/// struct LoopbackOnly;
///
/// impl AddressCheck for LoopbackOnly {
///     fn check<'a>(&'a self, url: &'a WorkerUrl) -> CheckFuture<'a> {
///         Box::pin(async move {
///             match url.host() {
///                 "127.0.0.1" | "::1" => Ok(()),
///                 other => Err(AddressRefused::new(format!("{other} is not loopback"))),
///             }
///         })
///     }
/// }
/// ```
pub trait AddressCheck: Send + Sync + 'static {
    /// Resolves to `Ok(())` when the engine at `url` may register.
    fn check<'a>(&'a self, url: &'a WorkerUrl) -> CheckFuture<'a>;

    /// Whether this check also judges the `zmq_address` a registration
    /// announces (the address peer engines connect to), besides the
    /// addresses the router dials, which are always checked. Default
    /// `false`, so a check that counts or meters its calls sees one per
    /// distinct host the router dials; an allow-list of networks should
    /// answer `true` (or the [`Registrar`] be built with
    /// [`Registrar::checking_peer_addresses`]).
    fn checks_peer_addresses(&self) -> bool {
        false
    }
}

/// Why an [`AddressCheck`] refused an engine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct AddressRefused {
    reason: String,
    field: Option<&'static str>,
}

impl AddressRefused {
    /// A refusal with a reason naming the address and what is wrong with it.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            field: None,
        }
    }

    /// The reason.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The registration field whose address was refused (`http_address`,
    /// `zmq_address`, `kv_events_endpoint`, ...), when the [`Registrar`]
    /// knows it.
    pub fn field(&self) -> Option<&'static str> {
        self.field
    }

    /// The refusal of the address announced in `field`: the reason is
    /// prefixed with the field, unless it is the worker's own address
    /// (whose reason already names the worker URL).
    fn in_field(self, field: &'static str) -> Self {
        let reason = match field {
            "http_address" => self.reason,
            _ => format!("{field}: {}", self.reason),
        };
        Self {
            reason,
            field: Some(field),
        }
    }
}

/// Why a registration was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// The message is malformed (counted in
    /// [`Registries::malformed_messages`]).
    #[error("invalid registration: {0}")]
    Invalid(#[from] MessageError),
    /// The address check refused the engine or did not finish in time
    /// (counted in [`Registries::refused_addresses`]).
    #[error("registration refused: {0}")]
    AddressRefused(#[from] AddressRefused),
}

impl RegisterError {
    /// The registration field the refusal is about, when it is about one:
    /// what an HTTP answer names.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            Self::Invalid(err) => err.field(),
            Self::AddressRefused(refused) => refused.field(),
        }
    }
}

/// A registration that was applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// What the engine announced.
    pub registration: EngineRegistration,
    /// Its registration generation: the same while it keeps registering
    /// within the TTL, a new one after it expired or restarted.
    pub generation: u64,
}

impl Registered {
    /// The answer an HTTP handler sends:
    /// `{"status": "registered", "role", "url", "generation"}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "status": "registered",
            "role": self.registration.role.as_str(),
            "url": self.registration.url(),
            "generation": self.generation,
        })
    }
}

/// Runs the host's address check (if any) and then applies a registration
/// to the [`Registries`]. Cheap to clone.
#[derive(Clone)]
pub struct Registrar {
    registries: Registries,
    check: Option<Arc<dyn AddressCheck>>,
    check_timeout: Duration,
    check_peer_addresses: bool,
    /// Refusals are counted each; their warning is rate-limited, since a
    /// peer can send refused registrations as fast as it likes.
    refused_log: Arc<LogThrottle>,
}

impl fmt::Debug for Registrar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registrar")
            .field("registries", &self.registries)
            .field("has_check", &self.check.is_some())
            .field("check_timeout", &self.check_timeout)
            .field("check_peer_addresses", &self.check_peer_addresses)
            .finish()
    }
}

impl Registrar {
    /// A registrar that admits every well-formed registration.
    pub fn new(registries: Registries) -> Self {
        Self {
            registries,
            check: None,
            check_timeout: DEFAULT_CHECK_TIMEOUT,
            check_peer_addresses: false,
            refused_log: Arc::new(LogThrottle::default()),
        }
    }

    /// Whether the check also runs on the `zmq_address` a registration
    /// announces (default off): the address peer engines connect to when
    /// the router names it in a P/D request. The worker URL and the KV
    /// event endpoints, which the router dials, are always checked.
    pub fn checking_peer_addresses(mut self, on: bool) -> Self {
        self.check_peer_addresses = on;
        self
    }

    /// Runs `check` (bounded by `timeout`) before every registration.
    pub fn with_check(mut self, check: Arc<dyn AddressCheck>, timeout: Duration) -> Self {
        self.check = Some(check);
        self.check_timeout = timeout;
        self
    }

    /// The registries this registrar feeds.
    pub fn registries(&self) -> &Registries {
        &self.registries
    }

    /// Whether registrations wait for an address check.
    pub fn has_check(&self) -> bool {
        self.check.is_some()
    }

    /// Runs the address check on every address of `registration` the
    /// router dials ([`EngineRegistration::dialled_addresses`]), and on
    /// its ZMQ address when [`checking_peer_addresses`](Self::checking_peer_addresses)
    /// is on or the check [judges peer addresses](AddressCheck::checks_peer_addresses);
    /// each host once, the worker's own first, all within the one
    /// timeout. A refusal names the field whose address failed, and is
    /// counted and logged at `warn`.
    pub async fn admit(&self, registration: &EngineRegistration) -> Result<(), AddressRefused> {
        let Some(check) = &self.check else {
            return Ok(());
        };
        let url = &registration.worker_url;
        let check_all = async {
            let mut checked_hosts: Vec<&str> = Vec::new();
            let addresses = if self.check_peer_addresses || check.checks_peer_addresses() {
                registration.announced_addresses()
            } else {
                registration.dialled_addresses()
            };
            // An address that cannot be checked as it will be dialled is
            // refused, naming its field.
            let addresses = addresses.map_err(|err| match err {
                MessageError::Field {
                    field,
                    value,
                    reason,
                } => AddressRefused::new(format!("{value:?}: {reason}")).in_field(field),
                other => AddressRefused::new(other.to_string()),
            })?;
            for &(field, ref address) in &addresses {
                // The allow-list judges hosts; one host announced in two
                // fields is resolved once.
                if checked_hosts.contains(&address.host()) {
                    continue;
                }
                checked_hosts.push(address.host());
                check
                    .check(address.as_url())
                    .await
                    .map_err(|refused| refused.in_field(field))?;
            }
            Ok(())
        };
        let verdict = match tokio::time::timeout(self.check_timeout, check_all).await {
            Ok(verdict) => verdict,
            Err(_elapsed) => Err(AddressRefused::new(format!(
                "{url}: the address check did not finish within {:?}",
                self.check_timeout
            ))),
        };
        if let Err(refused) = &verdict {
            self.registries.count_refused();
            if let Some(suppressed) = self.refused_log.admit() {
                tracing::warn!(
                    role = registration.role.as_str(),
                    %url,
                    field = refused.field().unwrap_or("-"),
                    reason = %refused,
                    refused_total = self.registries.refused_addresses(),
                    suppressed,
                    "ignoring a registration the address check refused (suppressed: refusals not logged before it)"
                );
            }
        }
        verdict
    }

    /// Checks and applies a decoded registration.
    pub async fn register(
        &self,
        registration: EngineRegistration,
    ) -> Result<Registered, RegisterError> {
        self.admit(&registration).await?;
        let generation = self.registries.register(&registration, Instant::now());
        Ok(Registered {
            registration,
            generation,
        })
    }

    /// Decodes, checks and applies a JSON registration: the body of an
    /// HTTP `POST /register`. Bad input changes no state.
    pub async fn register_json(&self, body: &[u8]) -> Result<Registered, RegisterError> {
        let registration = self.registries.decoded(decode_json_registration(body))?;
        self.register(registration).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Refuses one host; never finishes for another.
    struct Picky;

    impl AddressCheck for Picky {
        fn check<'a>(&'a self, url: &'a WorkerUrl) -> CheckFuture<'a> {
            Box::pin(async move {
                match url.host() {
                    "10.9.9.9" => Err(AddressRefused::new(format!("{url}: outside"))),
                    "stuck.example" => std::future::pending().await,
                    _ => Ok(()),
                }
            })
        }
    }

    fn registrar() -> Registrar {
        Registrar::new(Registries::new(Duration::from_secs(5)))
            .with_check(Arc::new(Picky), Duration::from_secs(2))
    }

    #[tokio::test(start_paused = true)]
    async fn http_registrations_are_checked_then_applied() {
        let registrar = registrar();
        let registered = registrar
            .register_json(br#"{"type": "P", "http_address": "10.0.0.1:8100"}"#)
            .await
            .unwrap();
        assert_eq!(
            registered.to_json(),
            serde_json::json!({
                "status": "registered", "role": "prefill",
                "url": "http://10.0.0.1:8100", "generation": registered.generation,
            })
        );
        assert_eq!(registrar.registries().prefill.len(), 1);

        let refused = registrar
            .register_json(br#"{"type": "P", "http_address": "10.9.9.9:8100"}"#)
            .await
            .unwrap_err();
        assert!(
            refused.to_string().contains("10.9.9.9:8100: outside"),
            "{refused}"
        );
        let invalid = registrar
            .register_json(br#"{"type": "X", "http_address": "10.0.0.2:1"}"#)
            .await
            .unwrap_err();
        assert!(matches!(invalid, RegisterError::Invalid(_)), "{invalid}");
        assert_eq!(registrar.registries().prefill.len(), 1);
        assert_eq!(registrar.registries().malformed_messages(), 1);
        assert_eq!(registrar.registries().refused_addresses(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_that_never_finishes_is_refused_at_the_timeout() {
        let registrar = registrar();
        let refused = registrar
            .register_json(br#"{"type": "D", "http_address": "stuck.example:8200"}"#)
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("within 2s"), "{refused}");
        assert!(registrar.registries().decode.is_empty());
        assert_eq!(registrar.registries().refused_addresses(), 1);
    }
}
