//! Header handling on the proxy path: hop-by-hop removal and request ids.
//!
//! Headers pass through in both directions except the hop-by-hop ones
//! (RFC 9110 §7.6.1), which describe one connection and must not be
//! forwarded: the fixed list plus every header the `Connection` header names.
//!
//! Every request carries a request id. The router looks for the first of the
//! configured headers (by default `x-request-id`, `x-correlation-id`,
//! `x-trace-id`, `request-id`) that the client sent; when none is present it
//! generates one. The id is forwarded upstream under the header it came in
//! (or `x-request-id` when generated) and returned to the client on the
//! response, so a client can always quote it.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use std::sync::atomic::{AtomicU64, Ordering};

/// The request-id headers looked for by default, in order.
pub const DEFAULT_REQUEST_ID_HEADERS: [&str; 4] = [
    "x-request-id",
    "x-correlation-id",
    "x-trace-id",
    "request-id",
];

/// Headers that describe a single connection and are never forwarded.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Removes hop-by-hop headers, including those named by `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Headers named in `Connection` are collected before it is removed.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
}

/// Finds or creates the request id of each request.
#[derive(Debug)]
pub struct RequestIds {
    headers: Vec<HeaderName>,
    prefix: u64,
    counter: AtomicU64,
}

/// A request's id and the header it travels under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId {
    /// The header name (the client's, or `x-request-id` when generated).
    pub header: HeaderName,
    /// The id itself.
    pub value: HeaderValue,
}

impl RequestIds {
    /// Looks for `headers`, in order; invalid header names are an error.
    pub fn new<I, S>(headers: I) -> Result<Self, http::header::InvalidHeaderName>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let headers = headers
            .into_iter()
            .map(|name| HeaderName::from_bytes(name.as_ref().trim().as_bytes()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            headers,
            prefix: process_prefix(),
            counter: AtomicU64::new(0),
        })
    }

    /// The configured header names, in lookup order.
    pub fn header_names(&self) -> &[HeaderName] {
        &self.headers
    }

    /// The id the client sent under the first configured header, or a new
    /// one (`x-request-id`), unique within this process and across restarts.
    pub fn resolve(&self, request_headers: &HeaderMap) -> RequestId {
        for name in &self.headers {
            if let Some(value) = request_headers.get(name).filter(|v| !v.is_empty()) {
                return RequestId {
                    header: name.clone(),
                    value: value.clone(),
                };
            }
        }
        let sequence = self.counter.fetch_add(1, Ordering::Relaxed);
        let generated = format!("req-{:016x}{:016x}", self.prefix, sequence);
        RequestId {
            header: HeaderName::from_static("x-request-id"),
            value: HeaderValue::try_from(generated).expect("hex digits are a valid header value"),
        }
    }
}

impl Default for RequestIds {
    fn default() -> Self {
        Self::new(DEFAULT_REQUEST_ID_HEADERS).expect("the default names are valid")
    }
}

/// A per-process value that keeps generated ids distinct across restarts.
fn process_prefix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    if let Ok(elapsed) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(elapsed.as_nanos());
    }
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_those_named_by_connection_are_removed() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-private"),
        );
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert("x-private", HeaderValue::from_static("1"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        headers.insert("x-worker-id", HeaderValue::from_static("w1"));
        strip_hop_by_hop(&mut headers);
        let left: Vec<_> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["authorization", "x-worker-id"]);
    }

    #[test]
    fn the_first_configured_header_present_wins() {
        let ids = RequestIds::default();
        let mut headers = HeaderMap::new();
        headers.insert("x-trace-id", HeaderValue::from_static("trace-7"));
        headers.insert("request-id", HeaderValue::from_static("other"));
        let id = ids.resolve(&headers);
        assert_eq!(id.header, "x-trace-id");
        assert_eq!(id.value, "trace-7");
    }

    #[test]
    fn generated_ids_are_unique_and_under_x_request_id() {
        let ids = RequestIds::new(["x-my-id"]).unwrap();
        let empty = HeaderMap::new();
        let first = ids.resolve(&empty);
        let second = ids.resolve(&empty);
        assert_eq!(first.header, "x-request-id");
        assert_ne!(first.value, second.value);
        assert!(first.value.to_str().unwrap().starts_with("req-"));
    }

    #[test]
    fn invalid_configured_names_are_refused() {
        assert!(RequestIds::new(["bad header"]).is_err());
    }
}
