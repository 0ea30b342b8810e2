//! The prefill leg: from dispatch to its parsed response.

use bytes::Bytes;
use http::StatusCode;
use serde_json::Value;

use super::body::PrefillDriver;
use super::collect::collect_limited;
use super::traits::PhaseLease;
use super::{BoxError, LegOutcome, LegResponse, PdBackend};
use crate::error::is_retryable_status;

/// Why one prefill leg did not produce a usable response.
#[derive(Debug)]
pub(crate) enum PrefillLegError {
    /// The worker failed; another may succeed.
    Failed(String),
    /// The engine rejected the request itself.
    Rejected { status: StatusCode, body: Bytes },
    /// The caller's transport could not send it (its own failure).
    NotSent(String),
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) prefill: usize,
    pub(super) error: usize,
}

/// The prefill leg, from dispatch to its body read: checks the status,
/// reads the body, parses it, and ends its lease with the outcome.
pub(super) async fn run_prefill_leg<F, B, E, Bk>(
    sent: F,
    lease: PhaseLease<Bk>,
    limits: Limits,
    is_local: fn(&E) -> bool,
) -> Result<Value, PrefillLegError>
where
    F: std::future::Future<Output = Result<LegResponse<B>, E>>,
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
    E: std::fmt::Display,
    Bk: PdBackend,
{
    let response = match sent.await {
        Ok(response) => response,
        Err(error) if is_local(&error) => {
            lease.finish(LegOutcome::NotSent);
            return Err(PrefillLegError::NotSent(error.to_string()));
        }
        Err(error) => {
            lease.finish(LegOutcome::WorkerFailure);
            return Err(PrefillLegError::Failed(format!("transport: {error}")));
        }
    };
    let LegResponse {
        status, mut body, ..
    } = response;
    if !status.is_success() {
        let error_body = collect_limited(&mut body, limits.error)
            .await
            .unwrap_or_default();
        if is_retryable_status(status) {
            lease.finish(LegOutcome::WorkerFailure);
            return Err(PrefillLegError::Failed(format!("status {status}")));
        }
        lease.finish(LegOutcome::ClientError);
        return Err(PrefillLegError::Rejected {
            status,
            body: error_body,
        });
    }
    let bytes = match collect_limited(&mut body, limits.prefill).await {
        Ok(bytes) => bytes,
        Err(error) => {
            lease.finish(LegOutcome::WorkerFailure);
            return Err(PrefillLegError::Failed(error.to_string()));
        }
    };
    drop(body);
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(value) if value.is_object() => {
            lease.finish(LegOutcome::Success);
            Ok(value)
        }
        _ => {
            lease.finish(LegOutcome::WorkerFailure);
            Err(PrefillLegError::Failed(
                "prefill response is not a JSON object".to_owned(),
            ))
        }
    }
}

pub(super) enum PrefillState {
    /// The prefill leg ended; its parsed response when it succeeded.
    Done(Option<Value>),
    /// Still in flight (concurrent mode).
    Running(PrefillDriver),
}

/// What a prefill leg ends with.
pub(crate) type PrefillResult = Result<Value, PrefillLegError>;
