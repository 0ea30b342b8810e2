//! Payloads on the router's own side: reading a request body within a
//! size limit, and writing a JSON answer. Used by the proxied routes, the
//! admin routes and `/register` alike.

use crate::body::{BoxBody, BoxError};
use crate::error::ApiError;
use bytes::Bytes;
use http::header;
use http::{HeaderValue, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full, Limited};

/// A JSON response.
pub(crate) fn json(status: StatusCode, value: &serde_json::Value) -> Response<BoxBody> {
    let mut response = Response::new(
        Full::new(Bytes::from(value.to_string()))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Reads the whole request body, refusing more than `limit` bytes with 413
/// (at once when `content-length` already says so).
pub(crate) async fn read_limited<B>(
    body: B,
    headers: &http::HeaderMap,
    limit: usize,
) -> Result<Bytes, ApiError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err)
            if err
                .downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ApiError::PayloadTooLarge { limit })
        }
        Err(err) => Err(ApiError::InvalidRequest(format!(
            "could not read the request body: {err}"
        ))),
    }
}
