//! `POST /register`: registration over HTTP, answered by a hook the host
//! plugs in.
//!
//! How an engine registers is discovery's business, not this crate's: the
//! body format, the registries it feeds and the checks it runs belong to
//! the discovery library the host uses. This crate owns only the HTTP side
//! of the route, the same for every host: the admin credential (checked by
//! [`Router::authorize`](crate::Router::authorize) before anything else),
//! reading the body within a size limit and the body timeout, and turning
//! the hook's answer into a response — a JSON body with 200, or an
//! [`ApiError`] through the one error mapping.
//!
//! With no hook in [`RouterConfig::register_hook`](crate::RouterConfig::register_hook)
//! the route answers 400, "HTTP registration is not enabled on this router".
//!
//! ```
//! use bytes::Bytes;
//! use router_http::{ApiError, RouterConfig};
//! use std::sync::Arc;
//!
//! let mut config = RouterConfig::default();
//! config.register_hook = Some(Arc::new(|body: Bytes| async move {
//!     if body.is_empty() {
//!         return Err(ApiError::InvalidRequest("empty registration".into()));
//!     }
//!     Ok(serde_json::json!({"status": "registered"}))
//! }));
//! ```

use crate::body::{BoxBody, BoxError};
use crate::error::ApiError;
use crate::router::Router;
use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use std::fmt;
use std::future::Future;
use std::pin::Pin;

/// The largest registration body read, in bytes (a registration is a small
/// JSON map); larger is 413.
pub const MAX_REGISTRATION_BYTES: usize = 64 * 1024;

/// What a [`RegisterHook`] returns: the JSON answered with 200, or the
/// error answered instead.
pub type RegisterFuture =
    Pin<Box<dyn Future<Output = Result<serde_json::Value, ApiError>> + Send + 'static>>;

/// Handles the body of an authenticated `POST /register`. Any
/// `Fn(Bytes) -> impl Future<Output = Result<serde_json::Value, ApiError>>`
/// closure is one.
///
/// The hook is called only after the request passed the admin check, with
/// the whole body (at most [`MAX_REGISTRATION_BYTES`]). Bad input should be
/// an [`ApiError`] naming the problem (400 [`ApiError::InvalidRequest`],
/// 403 [`ApiError::WorkerAddressNotAllowed`]) and change no state.
pub trait RegisterHook: Send + Sync + 'static {
    /// Registers what `body` describes.
    fn register(&self, body: Bytes) -> RegisterFuture;
}

impl<F, Fut> RegisterHook for F
where
    F: Fn(Bytes) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<serde_json::Value, ApiError>> + Send + 'static,
{
    fn register(&self, body: Bytes) -> RegisterFuture {
        Box::pin(self(body))
    }
}

impl fmt::Debug for dyn RegisterHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RegisterHook")
    }
}

/// Answers an authenticated `POST /register`.
pub(crate) async fn handle<B>(
    router: &Router,
    request: Request<B>,
) -> Result<Response<BoxBody>, ApiError>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let config = router.config();
    let Some(hook) = config.register_hook.clone() else {
        return Err(ApiError::InvalidRequest(
            "HTTP registration is not enabled on this router".into(),
        ));
    };
    let timeout = config.request_body_timeout.min(config.request_timeout);
    let body = match tokio::time::timeout(timeout, read(request)).await {
        Ok(body) => body?,
        Err(_elapsed) => return Err(ApiError::RequestBodyTimeout(timeout)),
    };
    let answer = hook.register(body).await?;
    Ok(crate::admin::json(StatusCode::OK, &answer))
}

/// The whole body, refusing more than [`MAX_REGISTRATION_BYTES`] with 413
/// (at once when `content-length` already says so).
async fn read<B>(request: Request<B>) -> Result<Bytes, ApiError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = ApiError::PayloadTooLarge {
        limit: MAX_REGISTRATION_BYTES,
    };
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > MAX_REGISTRATION_BYTES as u64) {
        return Err(too_large);
    }
    match Limited::new(request.into_body(), MAX_REGISTRATION_BYTES)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.is::<http_body_util::LengthLimitError>() => Err(too_large),
        Err(err) => Err(ApiError::InvalidRequest(format!(
            "cannot read the registration: {err}"
        ))),
    }
}
