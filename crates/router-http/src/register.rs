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
use crate::payload::{json, read_limited};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

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

/// Answers an authenticated `POST /register` with `hook`, reading the body
/// within [`MAX_REGISTRATION_BYTES`] and `body_timeout`.
pub(crate) async fn handle<B>(
    hook: Option<&Arc<dyn RegisterHook>>,
    body_timeout: Duration,
    request: Request<B>,
) -> Result<Response<BoxBody>, ApiError>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let Some(hook) = hook else {
        return Err(ApiError::InvalidRequest(
            "HTTP registration is not enabled on this router".into(),
        ));
    };
    let (parts, body) = request.into_parts();
    let read = read_limited(body, &parts.headers, MAX_REGISTRATION_BYTES);
    let body = match tokio::time::timeout(body_timeout, read).await {
        Ok(body) => body?,
        Err(_elapsed) => return Err(ApiError::RequestBodyTimeout(body_timeout)),
    };
    let answer = hook.register(body).await?;
    Ok(json(StatusCode::OK, &answer))
}
