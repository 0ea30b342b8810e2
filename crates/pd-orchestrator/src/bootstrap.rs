//! Mooncake bootstrap: learning each prefill engine's KV engine id per
//! data-parallel rank at startup.
//!
//! A Mooncake prefill engine runs a small HTTP bootstrap server (port
//! `VLLM_MOONCAKE_BOOTSTRAP_PORT`, default 8998). `GET /query` answers a JSON
//! object keyed by DP rank: `{"0": {"engine_id": "...", ...}, "1": {...}}`.
//! The decode leg needs the engine id of the prefill's rank, so the router
//! asks once per prefill registration, retrying with exponential backoff
//! while the engine is still loading its model, and fails with a clear error
//! when the server never answers or answers nonsense.
//!
//! HTTP and time come in through [`BootstrapQuery`] and [`Sleeper`], so the
//! retry schedule is tested without sockets or a runtime.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use serde_json::Value;

use crate::endpoint::{MooncakeEndpoint, PdEndpoint};

/// One `GET` of a bootstrap `/query` URL.
pub trait BootstrapQuery: Send + Sync {
    /// Fetches `url` and returns the body of a 2xx response.
    ///
    /// # Errors
    /// A description of the transport failure or non-2xx status; every
    /// error is retried.
    fn get(&self, url: &str) -> impl Future<Output = Result<Vec<u8>, String>> + Send;
}

/// Waits between attempts (a runtime timer in production, a recorder in
/// tests).
pub trait Sleeper: Send + Sync {
    /// Completes after `duration`.
    fn sleep(&self, duration: Duration) -> impl Future<Output = ()> + Send;
}

/// Retry schedule of the bootstrap query: exponential backoff, capped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootstrapRetry {
    /// Attempts in total, at least 1. Default 60.
    pub max_attempts: u32,
    /// Wait after the first failure. Default 500 ms.
    pub initial_backoff: Duration,
    /// Upper bound of one wait. Default 5 s (so the default schedule covers
    /// about 4.5 minutes of model loading).
    pub max_backoff: Duration,
}

impl Default for BootstrapRetry {
    fn default() -> Self {
        Self {
            max_attempts: 60,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(5),
        }
    }
}

impl BootstrapRetry {
    /// The wait after failed attempt number `attempt` (0-based).
    pub fn backoff(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.initial_backoff
            .checked_mul(factor)
            .unwrap_or(self.max_backoff)
            .min(self.max_backoff)
    }
}

/// Why the engine ids of a prefill engine could not be learned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// The prefill endpoint's URL cannot be addressed.
    #[error(transparent)]
    Endpoint(#[from] worker_lifecycle::WorkerUrlError),
    /// Every attempt failed to get a 2xx answer.
    #[error("Mooncake bootstrap server {url} did not answer after {attempts} attempt(s): {last}")]
    Unreachable {
        /// The `/query` URL.
        url: String,
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        last: String,
    },
    /// The server answered, but not with `{rank: {"engine_id": ...}}`.
    #[error("Mooncake bootstrap server {url} answered an invalid /query response: {reason}")]
    InvalidResponse {
        /// The `/query` URL.
        url: String,
        /// What is wrong with the answer.
        reason: String,
    },
}

/// Parses a `/query` response body into engine id per DP rank.
///
/// # Errors
/// A description when the body is not a non-empty JSON object whose keys
/// are ranks and whose values carry a non-empty string `engine_id`.
pub fn parse_query_response(body: &[u8]) -> Result<BTreeMap<u32, String>, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let Value::Object(ranks) = value else {
        return Err("not a JSON object".to_owned());
    };
    if ranks.is_empty() {
        return Err("no DP ranks reported".to_owned());
    }
    let mut engine_ids = BTreeMap::new();
    for (rank, entry) in ranks {
        let rank_number: u32 = rank
            .parse()
            .map_err(|_| format!("key {rank:?} is not a DP rank"))?;
        let engine_id = entry
            .get("engine_id")
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty())
            .ok_or_else(|| format!("rank {rank} has no engine_id string"))?;
        engine_ids.insert(rank_number, engine_id.to_owned());
    }
    Ok(engine_ids)
}

/// Queries `prefill`'s bootstrap server (`http://{host}:{bootstrap_port or
/// 8998}/query`) until it answers, and returns what the decode legs need.
///
/// # Errors
/// [`BootstrapError::Unreachable`] after `retry.max_attempts` failed
/// attempts; [`BootstrapError::InvalidResponse`] at once when the server
/// answers something unparseable (retrying would not change it).
pub async fn learn_engine_ids<Q, S>(
    query: &Q,
    sleeper: &S,
    prefill: &PdEndpoint,
    bootstrap_port: Option<u16>,
    retry: &BootstrapRetry,
) -> Result<MooncakeEndpoint, BootstrapError>
where
    Q: BootstrapQuery + ?Sized,
    S: Sleeper + ?Sized,
{
    let bootstrap_addr = prefill.mooncake_bootstrap_addr(bootstrap_port);
    let url = format!("{bootstrap_addr}/query");
    let attempts = retry.max_attempts.max(1);
    let mut last = String::new();
    for attempt in 0..attempts {
        if attempt > 0 {
            sleeper.sleep(retry.backoff(attempt - 1)).await;
        }
        match query.get(&url).await {
            Ok(body) => {
                let engine_ids = parse_query_response(&body).map_err(|reason| {
                    BootstrapError::InvalidResponse {
                        url: url.clone(),
                        reason,
                    }
                })?;
                return Ok(MooncakeEndpoint {
                    bootstrap_addr,
                    engine_ids,
                });
            }
            Err(error) => {
                tracing::debug!(%url, attempt, %error, "Mooncake bootstrap query failed");
                last = error;
            }
        }
    }
    Err(BootstrapError::Unreachable {
        url,
        attempts,
        last,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ranks() {
        let ids = parse_query_response(
            br#"{"1": {"engine_id": "e1", "x": 2}, "0": {"engine_id": "e0"}}"#,
        )
        .unwrap();
        assert_eq!(
            ids.into_iter().collect::<Vec<_>>(),
            vec![(0, "e0".to_owned()), (1, "e1".to_owned())]
        );
    }

    #[test]
    fn rejects_bad_answers() {
        for bad in [
            &b""[..],
            b"[]",
            b"{}",
            br#"{"a": {"engine_id": "e"}}"#,
            br#"{"0": {"engine_id": 5}}"#,
            br#"{"0": {"engine_id": ""}}"#,
            br#"{"0": "e"}"#,
            br#"{"-1": {"engine_id": "e"}}"#,
        ] {
            assert!(
                parse_query_response(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let retry = BootstrapRetry::default();
        let waits: Vec<_> = (0..6).map(|a| retry.backoff(a).as_millis()).collect();
        assert_eq!(waits, vec![500, 1000, 2000, 4000, 5000, 5000]);
        assert_eq!(retry.backoff(u32::MAX), Duration::from_secs(5));
    }
}
