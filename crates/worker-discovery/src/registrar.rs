//! Check, then register: the one path every registration takes.
//!
//! A host may restrict which engines can join (say, only addresses inside
//! the cluster's networks). That check can be slow — a host name is
//! resolved — so it is an [`AddressCheck`] the host plugs in, always run
//! under a timeout and never while a registry is touched. The ZMQ listener
//! runs it off its receive loop ([`crate::zmq`]); an HTTP handler awaits it
//! in its own request ([`Registrar::register_json`]).

use crate::message::{EngineRegistration, MessageError, decode_json_registration};
use crate::registries::Registries;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use worker_lifecycle::WorkerUrl;

/// How long an address check may take by default before the registration
/// is refused.
pub const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// The future an [`AddressCheck`] returns.
pub type CheckFuture<'a> = Pin<Box<dyn Future<Output = Result<(), AddressRefused>> + Send + 'a>>;

/// Decides whether an engine at `url` may register. Implemented by the
/// host: an allow-list of networks, a DNS lookup, a lookup in an inventory.
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
}

/// Why an [`AddressCheck`] refused an engine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct AddressRefused {
    reason: String,
}

impl AddressRefused {
    /// A refusal with a reason naming the address and what is wrong with it.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
        }
    }

    /// The reason.
    pub fn reason(&self) -> &str {
        &self.reason
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
}

impl fmt::Debug for Registrar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registrar")
            .field("registries", &self.registries)
            .field("has_check", &self.check.is_some())
            .field("check_timeout", &self.check_timeout)
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
        }
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

    /// Runs the address check on `registration`, within the timeout. A
    /// refusal is counted and logged at `warn`.
    pub async fn admit(&self, registration: &EngineRegistration) -> Result<(), AddressRefused> {
        let Some(check) = &self.check else {
            return Ok(());
        };
        let url = &registration.worker_url;
        let verdict = match tokio::time::timeout(self.check_timeout, check.check(url)).await {
            Ok(verdict) => verdict,
            Err(_elapsed) => Err(AddressRefused::new(format!(
                "{url}: the address check did not finish within {:?}",
                self.check_timeout
            ))),
        };
        if let Err(refused) = &verdict {
            self.registries.count_refused();
            tracing::warn!(
                role = registration.role.as_str(),
                %url,
                reason = %refused,
                "ignoring a registration the address check refused"
            );
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
