//! The pooled upstream client, with the timeouts a proxy needs.
//!
//! - **connect**: how long establishing a TCP connection to a worker may take;
//! - **response headers**: how long the worker may take to answer with a
//!   status line once the request is sent (prefill of a long prompt happens
//!   here, so the default is generous);
//! - **whole request** and **stream idle** apply to the response body and
//!   live in [`crate::body`], so that a stream that stops or overstays fails
//!   and releases everything it holds.
//!
//! Failures are classified for retries and circuit breakers: a refused or
//! timed-out connection and a connection reset before the response are
//! worker failures; the router's own cancellation is not.

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::time::Duration;

/// Settings of the [`UpstreamClient`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientConfig {
    /// TCP connect timeout (default 10 s).
    pub connect_timeout: Duration,
    /// Time from sending the request to receiving response headers
    /// (default 600 s: a long prompt's prefill happens before the headers).
    pub response_header_timeout: Duration,
    /// Idle pooled connections are closed after this long (default 90 s).
    pub pool_idle_timeout: Duration,
    /// Idle connections kept per worker (default 512).
    pub pool_max_idle_per_host: usize,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            response_header_timeout: Duration::from_secs(600),
            pool_idle_timeout: Duration::from_secs(90),
            pool_max_idle_per_host: 512,
        }
    }
}

/// Why an upstream call failed before a response arrived.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpstreamError {
    /// The connection could not be established (refused, unreachable, connect timeout).
    #[error("cannot connect to the worker: {0}")]
    Connect(String),
    /// No response headers within the response-header timeout.
    #[error("no response headers within {0:?}")]
    HeaderTimeout(Duration),
    /// The connection failed after the request was sent (reset, closed early).
    #[error("the worker connection failed: {0}")]
    Transport(String),
    /// The request could not be built (an invalid worker URL).
    #[error("invalid upstream request: {0}")]
    InvalidRequest(String),
}

impl UpstreamError {
    /// Whether the failure may be retried on another worker. Every variant
    /// but an invalid request happened before the client saw a byte.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, Self::InvalidRequest(_))
    }
}

/// A pooled HTTP/1.1 client to the workers.
#[derive(Debug, Clone)]
pub struct UpstreamClient {
    inner: Client<HttpConnector, Full<Bytes>>,
    config: ClientConfig,
}

impl UpstreamClient {
    /// A client with `config`.
    pub fn new(config: ClientConfig) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        connector.enforce_http(true);
        let inner = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(config.pool_idle_timeout)
            .pool_max_idle_per_host(config.pool_max_idle_per_host)
            .build(connector);
        Self { inner, config }
    }

    /// The client's settings.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// Sends `request` and waits for the response headers.
    pub async fn send(
        &self,
        request: http::Request<Full<Bytes>>,
    ) -> Result<http::Response<Incoming>, UpstreamError> {
        let timeout = self.config.response_header_timeout;
        match tokio::time::timeout(timeout, self.inner.request(request)).await {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(err)) if err.is_connect() => Err(UpstreamError::Connect(error_chain(&err))),
            Ok(Err(err)) => Err(UpstreamError::Transport(error_chain(&err))),
            Err(_elapsed) => Err(UpstreamError::HeaderTimeout(timeout)),
        }
    }
}

impl Default for UpstreamClient {
    fn default() -> Self {
        Self::new(ClientConfig::default())
    }
}

/// The error and its sources on one line: hyper's top-level messages alone
/// ("client error (Connect)") do not say what happened.
fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_refused_connection_is_a_retryable_connect_error() {
        // Bind then drop a listener so the port is (almost certainly) closed.
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let client = UpstreamClient::default();
        let request = http::Request::get(format!("http://127.0.0.1:{port}/health"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let err = client.send(request).await.unwrap_err();
        assert!(matches!(err, UpstreamError::Connect(_)), "{err:?}");
        assert!(err.is_retryable());
        assert!(err.to_string().contains("refused"), "{err}");
    }
}
