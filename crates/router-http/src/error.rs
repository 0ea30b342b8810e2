//! Every error the router answers itself, mapped to HTTP in one place.
//!
//! Errors are OpenAI-shaped so that clients written against the OpenAI API
//! show them as they would show the API's own:
//!
//! ```json
//! {"error": {"message": "...", "type": "invalid_request_error", "code": "invalid_json"}}
//! ```
//!
//! Responses that come from a worker (its 4xx and 5xx included) are never
//! rewritten: they reach the client as the worker sent them. Only what the
//! router decides on its own goes through [`ApiError`].

use crate::body::BoxBody;
use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use std::time::Duration;

/// An error the router answers on its own, with the HTTP status it maps to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// The request body is not valid JSON (or is nested too deeply).
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(String),
    /// The JSON is well formed but a field is missing or has the wrong type.
    #[error("{0}")]
    InvalidRequest(String),
    /// The request names a model that no worker serves.
    #[error("the model `{0}` does not exist")]
    UnknownModel(String),
    /// The request body is larger than the configured limit.
    #[error("request body exceeds the limit of {limit} bytes")]
    PayloadTooLarge {
        /// The configured limit in bytes.
        limit: usize,
    },
    /// The concurrency queue is full (or disabled) and the request is refused at once.
    #[error("too many concurrent requests; retry later")]
    TooManyRequests {
        /// Seconds the client should wait before retrying.
        retry_after: Duration,
    },
    /// The request waited in the queue longer than the queue timeout.
    #[error("request waited {0:?} in the queue without being admitted")]
    QueueTimeout(Duration),
    /// A missing or wrong API key.
    #[error("missing or invalid API key")]
    Unauthorized,
    /// No worker of the required role is available (empty pool, all unhealthy,
    /// all circuit breakers open, all draining).
    #[error("no available worker: {0}")]
    NoAvailableWorker(String),
    /// An upstream worker could not be reached or failed before answering.
    #[error("upstream worker failed: {0}")]
    BadGateway(String),
    /// An upstream worker did not answer within the configured timeout.
    #[error("upstream worker timed out: {0}")]
    GatewayTimeout(String),
    /// An admin route named a worker that does not exist.
    #[error("worker not found: {0}")]
    WorkerNotFound(String),
    /// An admin route tried to add a worker that is already registered.
    #[error("worker already exists: {0}")]
    WorkerExists(String),
    /// A worker being added did not become healthy in time.
    #[error("worker did not become healthy: {0}")]
    WorkerNotReady(String),
    /// `/health` or `/readiness` while the startup gate is closed: these
    /// workers, configured at startup, are not routable yet (see
    /// [`crate::startup`]). The body lists them as `awaited_workers` too.
    #[error(
        "waiting for the workers configured at startup to become routable: {}",
        .0.join(", ")
    )]
    AwaitingWorkers(Vec<String>),
    /// The router is shutting down and admits no new requests.
    #[error("the router is shutting down")]
    ShuttingDown,
    /// The route exists but not with this method.
    #[error("method not allowed; this path takes {allow}")]
    MethodNotAllowed {
        /// The methods the path takes (the `Allow` header).
        allow: &'static str,
    },
    /// No route has this path (the router forwards only its named routes).
    #[error("no route for {0}")]
    NotFound(String),
    /// The whole-request deadline passed before the worker's response
    /// headers arrived.
    #[error("the request exceeded its deadline of {timeout:?} {phase}")]
    RequestTimeout {
        /// What the request was waiting for when the deadline passed.
        phase: &'static str,
        /// The configured deadline.
        timeout: Duration,
    },
    /// A prefill/decode request failed in a way the router answers itself;
    /// the status is `pd_orchestrator::PdError::status`, the one mapping of
    /// flow errors to HTTP.
    #[error("{message}")]
    PrefillDecode {
        /// The status the flow error maps to.
        status: StatusCode,
        /// What failed.
        message: String,
    },
    /// The client did not send its whole request body in time.
    #[error("the request body did not arrive within {0:?}")]
    RequestBodyTimeout(Duration),
    /// A worker URL given at run time lies outside the configured networks
    /// (see [`crate::allow`]).
    #[error("worker address not allowed: {0}")]
    WorkerAddressNotAllowed(String),
}

impl From<worker_lifecycle::SelectError> for ApiError {
    /// The one mapping of a refused selection, in both modes: no worker
    /// serves the model (404), none is available (503, naming the role),
    /// the policy refused the request (400).
    fn from(error: worker_lifecycle::SelectError) -> Self {
        use worker_lifecycle::SelectError;
        match error {
            SelectError::UnknownModel(model) => Self::UnknownModel(model),
            SelectError::Policy(reason) => Self::InvalidRequest(reason),
            other => Self::NoAvailableWorker(other.to_string()),
        }
    }
}

impl ApiError {
    /// The HTTP status this error answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidJson(_) | Self::InvalidRequest(_) => StatusCode::BAD_REQUEST,
            Self::UnknownModel(_) | Self::WorkerNotFound(_) => StatusCode::NOT_FOUND,
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::TooManyRequests { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::QueueTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::NoAvailableWorker(_) | Self::ShuttingDown | Self::AwaitingWorkers(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::BadGateway(_) => StatusCode::BAD_GATEWAY,
            Self::GatewayTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::RequestTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            Self::RequestBodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::PrefillDecode { status, .. } => *status,
            Self::WorkerExists(_) => StatusCode::CONFLICT,
            Self::WorkerNotReady(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::WorkerAddressNotAllowed(_) => StatusCode::FORBIDDEN,
        }
    }

    /// The OpenAI error `type` field.
    pub fn error_type(&self) -> &'static str {
        match self {
            Self::InvalidJson(_)
            | Self::InvalidRequest(_)
            | Self::UnknownModel(_)
            | Self::PayloadTooLarge { .. }
            | Self::WorkerNotFound(_)
            | Self::WorkerExists(_)
            | Self::WorkerAddressNotAllowed(_)
            | Self::MethodNotAllowed { .. }
            | Self::NotFound(_)
            | Self::RequestBodyTimeout(_) => "invalid_request_error",
            Self::Unauthorized => "authentication_error",
            Self::TooManyRequests { .. } | Self::QueueTimeout(_) => "rate_limit_error",
            Self::NoAvailableWorker(_)
            | Self::ShuttingDown
            | Self::AwaitingWorkers(_)
            | Self::BadGateway(_)
            | Self::WorkerNotReady(_)
            | Self::GatewayTimeout(_)
            | Self::RequestTimeout { .. } => "service_unavailable_error",
            Self::PrefillDecode { status, .. } if status.is_client_error() => {
                "invalid_request_error"
            }
            Self::PrefillDecode { status, .. } if *status == StatusCode::INTERNAL_SERVER_ERROR => {
                "server_error"
            }
            Self::PrefillDecode { .. } => "service_unavailable_error",
        }
    }

    /// A stable, machine-readable code for the error (the OpenAI `code` field).
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidJson(_) => "invalid_json",
            Self::InvalidRequest(_) => "invalid_request",
            Self::UnknownModel(_) => "model_not_found",
            Self::PayloadTooLarge { .. } => "payload_too_large",
            Self::TooManyRequests { .. } => "too_many_requests",
            Self::QueueTimeout(_) => "queue_timeout",
            Self::Unauthorized => "invalid_api_key",
            Self::NoAvailableWorker(_) => "no_available_worker",
            Self::BadGateway(_) => "upstream_error",
            Self::GatewayTimeout(_) => "upstream_timeout",
            Self::WorkerNotFound(_) => "worker_not_found",
            Self::ShuttingDown => "shutting_down",
            Self::AwaitingWorkers(_) => "awaiting_workers",
            Self::MethodNotAllowed { .. } => "method_not_allowed",
            Self::NotFound(_) => "not_found",
            Self::RequestTimeout { .. } => "request_timeout",
            Self::RequestBodyTimeout(_) => "request_body_timeout",
            Self::PrefillDecode { status, .. } => match status.as_u16() {
                400..=499 => "invalid_request",
                503 => "no_available_worker",
                502 | 504 => "upstream_error",
                _ => "internal_error",
            },
            Self::WorkerExists(_) => "worker_exists",
            Self::WorkerNotReady(_) => "worker_not_ready",
            Self::WorkerAddressNotAllowed(_) => "worker_address_not_allowed",
        }
    }

    /// The JSON body: `{"error": {"message", "type", "code"}}`, plus
    /// `awaited_workers` for [`ApiError::AwaitingWorkers`].
    pub fn json_body(&self) -> Bytes {
        let mut body = serde_json::json!({
            "error": {
                "message": self.to_string(),
                "type": self.error_type(),
                "code": self.code(),
            }
        });
        if let Self::AwaitingWorkers(workers) = self {
            body["error"]["awaited_workers"] = workers.clone().into();
        }
        Bytes::from(body.to_string())
    }

    /// The complete HTTP response, with `Retry-After` where the error has one.
    pub fn into_response(self) -> Response<BoxBody> {
        let body = Full::new(self.json_body())
            .map_err(|never| match never {})
            .boxed_unsync();
        let mut response = Response::new(body);
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        match self {
            Self::TooManyRequests { retry_after } => {
                let seconds = retry_after.as_secs().max(1);
                headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
            }
            Self::MethodNotAllowed { allow } => {
                headers.insert(header::ALLOW, HeaderValue::from_static(allow));
            }
            Self::AwaitingWorkers(_) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(1));
            }
            _ => {}
        }
        response
    }
}

/// The router's 504 when `deadline` passed before a worker got the request:
/// the time went to the router's own work, so no worker is charged.
pub(crate) fn before_dispatch(
    deadline: tokio::time::Instant,
    timeout: std::time::Duration,
) -> Result<(), ApiError> {
    if tokio::time::Instant::now() >= deadline {
        return Err(ApiError::RequestTimeout {
            phase: "in the router, before the request was sent to a worker",
            timeout,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_openai_shaped_json_naming_the_problem() {
        let error = ApiError::UnknownModel("llama-9".into());
        let value: serde_json::Value = serde_json::from_slice(&error.json_body()).unwrap();
        assert_eq!(
            value["error"]["message"],
            "the model `llama-9` does not exist"
        );
        assert_eq!(value["error"]["type"], "invalid_request_error");
        assert_eq!(value["error"]["code"], "model_not_found");
        assert_eq!(error.status(), StatusCode::NOT_FOUND);
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_passed_before_dispatch_is_the_routers_504() {
        let timeout = Duration::from_secs(1);
        let deadline = tokio::time::Instant::now() + timeout;
        assert!(before_dispatch(deadline, timeout).is_ok());
        tokio::time::advance(timeout).await;
        let error = before_dispatch(deadline, timeout).unwrap_err();
        assert_eq!(error.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(error.code(), "request_timeout");
        assert_eq!(
            error.to_string(),
            "the request exceeded its deadline of 1s in the router, before the request was sent \
             to a worker"
        );
    }

    #[tokio::test]
    async fn too_many_requests_carries_retry_after() {
        let error = ApiError::TooManyRequests {
            retry_after: Duration::from_millis(200),
        };
        let response = error.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert!(body.starts_with(b"{\"error\""));
    }
}
