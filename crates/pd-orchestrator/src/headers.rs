//! Per-leg headers: the P2P request-id convention, the data-parallel rank,
//! and the client headers the caller chose to forward.
//!
//! Nothing here reads the environment: client auth reaches the engines only
//! when the caller passes it in [`ForwardHeaders`].

use http::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, HOST};
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::endpoint::PdEndpoint;
use crate::error::PdError;

/// `X-Request-Id`: carries the P2P request-id convention on both legs.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// `X-data-parallel-rank`: selects the DP rank inside a DP engine.
pub const DATA_PARALLEL_RANK: HeaderName = HeaderName::from_static("x-data-parallel-rank");

/// The request id vLLM's P2P/NCCL connector parses to find its peer:
/// `___prefill_addr_{P}___decode_addr_{D}_{id}`.
///
/// Both legs carry the same id. `P` and `D` are the endpoints' KV addresses
/// ([`PdEndpoint::kv_addr`]).
pub fn p2p_request_id(prefill_addr: &str, decode_addr: &str, id: &str) -> String {
    let mut out = String::with_capacity(
        "___prefill_addr_".len()
            + prefill_addr.len()
            + "___decode_addr_".len()
            + decode_addr.len()
            + 1
            + id.len(),
    );
    out.push_str("___prefill_addr_");
    out.push_str(prefill_addr);
    out.push_str("___decode_addr_");
    out.push_str(decode_addr);
    out.push('_');
    out.push_str(id);
    out
}

/// Client headers forwarded on both legs, chosen explicitly by the caller.
///
/// The flow owns `content-type`, `content-length`, `host`, `x-request-id`
/// and `x-data-parallel-rank`; extra headers with those names are ignored.
#[derive(Debug, Clone, Default)]
pub struct ForwardHeaders {
    authorization: Option<HeaderValue>,
    extra: HeaderMap,
}

impl ForwardHeaders {
    /// Forwards nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forwards this `Authorization` value (e.g. the client's bearer token,
    /// or the router's own engine key) on both legs.
    #[must_use]
    pub fn with_authorization(mut self, value: HeaderValue) -> Self {
        self.authorization = Some(value);
        self
    }

    /// Forwards one more header (tracing context, tenant id, ...). Names the
    /// flow owns are ignored.
    #[must_use]
    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        if !is_flow_owned(&name) {
            self.extra.append(name, value);
        }
        self
    }

    /// The forwarded `Authorization` value, if any.
    pub fn authorization(&self) -> Option<&HeaderValue> {
        self.authorization.as_ref()
    }
}

fn is_flow_owned(name: &HeaderName) -> bool {
    name == CONTENT_TYPE
        || name == CONTENT_LENGTH
        || name == HOST
        || name == AUTHORIZATION
        || name == REQUEST_ID
        || name == DATA_PARALLEL_RANK
}

/// Builds the headers of one leg sent to `endpoint`.
pub(crate) fn leg_headers(
    forward: &ForwardHeaders,
    request_id: &str,
    endpoint: &PdEndpoint,
) -> Result<HeaderMap, PdError> {
    let mut headers = forward.extra.clone();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let id = HeaderValue::from_str(request_id)
        .map_err(|_| PdError::InvalidRequestId(request_id.to_owned()))?;
    headers.insert(REQUEST_ID, id);
    if let Some(rank) = endpoint.dp_rank() {
        headers.insert(DATA_PARALLEL_RANK, HeaderValue::from(rank));
    }
    if let Some(auth) = &forward.authorization {
        headers.insert(AUTHORIZATION, auth.clone());
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_id_convention() {
        assert_eq!(
            p2p_request_id("10.0.0.1:21001", "10.0.0.2:22001", "abc"),
            "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_abc"
        );
    }

    #[test]
    fn leg_headers_carry_rank_auth_and_id_and_ignore_owned_extras() {
        let forward = ForwardHeaders::new()
            .with_authorization(HeaderValue::from_static("Bearer k"))
            .with_header(
                HeaderName::from_static("traceparent"),
                HeaderValue::from_static("00-1"),
            )
            .with_header(REQUEST_ID, HeaderValue::from_static("spoofed"))
            .with_header(AUTHORIZATION, HeaderValue::from_static("Bearer spoofed"));
        let ep = PdEndpoint::new("http://d:1").unwrap().with_dp_rank(3);
        let h = leg_headers(&forward, "rid", &ep).unwrap();
        assert_eq!(h[REQUEST_ID], "rid");
        assert_eq!(h[DATA_PARALLEL_RANK], "3");
        assert_eq!(h[AUTHORIZATION], "Bearer k");
        assert_eq!(h["traceparent"], "00-1");
        assert_eq!(h[CONTENT_TYPE], "application/json");
        assert_eq!(h.len(), 5);
        let plain = leg_headers(
            &ForwardHeaders::new(),
            "rid",
            &PdEndpoint::new("http://d:1").unwrap(),
        )
        .unwrap();
        assert!(plain.get(DATA_PARALLEL_RANK).is_none());
        assert!(plain.get(AUTHORIZATION).is_none());
        assert!(leg_headers(&ForwardHeaders::new(), "bad\nid", &ep).is_err());
    }
}
