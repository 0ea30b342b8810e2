//! Error kinds of the crate. The HTTP edge maps them to a status and a JSON
//! body once, through [`PdError::status`].

use bytes::Bytes;
use http::StatusCode;

/// The selected pair lacks what the connector needs to address it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectorError {
    /// A Mooncake prefill endpoint whose bootstrap server was never queried.
    #[error("prefill {url} has no Mooncake bootstrap data (query its bootstrap server at startup)")]
    MissingMooncakeBootstrap {
        /// Base URL of the prefill endpoint.
        url: String,
    },
    /// The bootstrap server reported no engine id for the prefill DP rank.
    #[error("prefill {url} reported no Mooncake engine id for DP rank {rank}")]
    MissingMooncakeEngineId {
        /// Base URL of the prefill endpoint.
        url: String,
        /// The DP rank looked up (0 when the endpoint has none).
        rank: u32,
    },
    /// A MoRI-IO endpoint registered without its side-channel facts.
    #[error("{role} {url} has no MoRI-IO registration data")]
    MissingMoriIo {
        /// Base URL of the endpoint.
        url: String,
        /// `"prefill"` or `"decode"`.
        role: &'static str,
    },
}

/// Why a two-phase request did not produce a decode response.
///
/// Every variant is decided before any decode byte reached the client, so a
/// caller may retry the whole request when [`PdError::is_retryable`] says so.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PdError {
    /// The client body is not a JSON object.
    #[error("request body must be a JSON object")]
    InvalidBody,
    /// The request id is empty, too long or has characters other than ASCII
    /// letters, digits, `-`, `_`, `.` (a `:` would corrupt the peer address
    /// engines parse out of the wire id), or an endpoint's KV address cannot
    /// be sent as the `X-Request-Id` header.
    #[error("request id {0:?} cannot be used in the P2P request-id convention")]
    InvalidRequestId(String),
    /// The connector cannot address the selected pair.
    #[error(transparent)]
    Connector(#[from] ConnectorError),
    /// The prefill worker answered with a status that is not the worker's
    /// fault (non-2xx other than 5xx, 408 and 429); its status and body are
    /// passed through to the client.
    #[error("prefill rejected the request with {status}")]
    PrefillRejected {
        /// Status of the prefill response.
        status: StatusCode,
        /// Its body (bounded), for the client.
        body: Bytes,
    },
    /// Every prefill attempt failed on the worker side (transport error,
    /// 5xx, 408/429, unreadable or oversized body).
    #[error("prefill failed after {attempts} attempt(s), last on {worker}: {last}")]
    PrefillFailed {
        /// How many prefill attempts were made.
        attempts: u32,
        /// The last failure, for logs.
        last: String,
        /// The worker of the last attempt ([`PdWorker::id`](crate::PdWorker::id)).
        worker: String,
    },
    /// The decode request could not be sent (its worker refused the
    /// reservation, or the transport failed) or its response head not read.
    #[error("decode on {worker} failed: {reason}")]
    DecodeFailed {
        /// The error, for logs.
        reason: String,
        /// The decode worker ([`PdWorker::id`](crate::PdWorker::id)).
        worker: String,
    },
    /// The decode worker answered with a non-2xx status.
    #[error("decode on {worker} answered {status}")]
    DecodeRejected {
        /// Status of the decode response.
        status: StatusCode,
        /// Its body (bounded), for the client.
        body: Bytes,
        /// The decode worker ([`PdWorker::id`](crate::PdWorker::id)).
        worker: String,
    },
    /// A non-streaming decode body could not be read to the end.
    #[error("decode body from {worker} failed: {reason}")]
    DecodeBodyFailed {
        /// The body error, for logs.
        reason: String,
        /// The decode worker ([`PdWorker::id`](crate::PdWorker::id)).
        worker: String,
    },
    /// The prefill finished but [`PdBackend::select_decode`](crate::PdBackend::select_decode)
    /// found no available decode worker (the pool emptied during the
    /// prefill). The prefill's phase has already ended normally.
    #[error("no decode worker is available for the decode leg")]
    NoDecodeWorker,
    /// [`PdFlow::run_late_decode`](crate::PdFlow::run_late_decode) was given
    /// a connector that dispatches both legs together or whose prefill
    /// parameters name the decode engine: the decode worker must be chosen
    /// before the prefill. Nothing was sent.
    #[error("the connector needs the decode worker before the prefill is dispatched")]
    DecodeNeededAtStart,
    /// The caller's transport could not build or send a leg
    /// ([`Transport::is_local_error`](crate::Transport::is_local_error)):
    /// the router's own failure, no worker saw it, nothing is retried.
    #[error("the {phase} leg could not be sent: {reason}")]
    LegNotSent {
        /// The leg's phase.
        phase: crate::Phase,
        /// The transport's error, for logs.
        reason: String,
    },
}

impl PdError {
    /// The HTTP status the edge should answer with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidBody => StatusCode::BAD_REQUEST,
            Self::InvalidRequestId(_) | Self::DecodeNeededAtStart | Self::LegNotSent { .. } => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Self::NoDecodeWorker => StatusCode::SERVICE_UNAVAILABLE,
            Self::Connector(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::PrefillRejected { status, .. } | Self::DecodeRejected { status, .. } => *status,
            Self::PrefillFailed { .. }
            | Self::DecodeFailed { .. }
            | Self::DecodeBodyFailed { .. } => StatusCode::BAD_GATEWAY,
        }
    }

    /// The worker whose failure ended the flow, and its phase: a caller
    /// retrying the whole request leaves it out of the next selection.
    /// `None` when no worker failed (a bad request, a rejection that is
    /// not the worker's fault, an empty pool).
    pub fn failed_worker(&self) -> Option<(crate::Phase, &str)> {
        match self {
            Self::PrefillFailed { worker, .. } => Some((crate::Phase::Prefill, worker)),
            Self::DecodeFailed { worker, .. }
            | Self::DecodeBodyFailed { worker, .. }
            | Self::DecodeRejected { worker, .. } => Some((crate::Phase::Decode, worker)),
            _ => None,
        }
    }

    /// Whether retrying the whole request (a fresh pair) may succeed: the
    /// failure was the workers', and no decode byte reached the client.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::InvalidBody
            | Self::InvalidRequestId(_)
            | Self::Connector(_)
            | Self::PrefillRejected { .. }
            | Self::NoDecodeWorker
            | Self::DecodeNeededAtStart
            | Self::LegNotSent { .. } => false,
            Self::PrefillFailed { .. }
            | Self::DecodeFailed { .. }
            | Self::DecodeBodyFailed { .. } => true,
            Self::DecodeRejected { status, .. } => is_retryable_status(*status),
        }
    }
}

/// Statuses that mean "this worker, now" rather than "this request": retried
/// with a fresh worker.
pub(crate) fn is_retryable_status(status: StatusCode) -> bool {
    status.is_server_error() || matches!(status.as_u16(), 408 | 429)
}
