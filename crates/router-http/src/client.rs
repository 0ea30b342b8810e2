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
//! # Connections are driven by whoever holds the response
//!
//! A general-purpose client spawns a task per connection: every chunk the
//! worker sends is decoded on that task, handed over a channel and woken up
//! on the task that forwards it to the client, and written to the client's
//! socket on its own — one hand-over and one `write` system call per chunk
//! of a stream. Here the HTTP/1.1 connection is not spawned: the future that
//! waits for the response headers polls it, and then the response body
//! ([`UpstreamBody`]) owns it and polls it from inside `poll_frame`. The
//! server task that writes the response to the client therefore reads,
//! decodes and forwards the worker's bytes in one go: the chunks that arrived
//! together leave together, in one write, and no other task is woken.
//!
//! The same ownership makes cleanup exact: dropping the body (the client went
//! away, a timeout fired) drops the connection and closes the socket, so the
//! worker sees the cancellation at once. A connection returns to the idle
//! pool only when its response ended cleanly; an idle connection is checked
//! on checkout (a worker that closed it is noticed then, and the request
//! moves to a fresh connection if it was never written).
//!
//! Failures are classified for retries and circuit breakers: a refused or
//! timed-out connection and a connection reset before the response are
//! worker failures; the router's own cancellation is not.

use bytes::Bytes;
use http::header::{HOST, HeaderValue};
use http::uri::Authority;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

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
    /// The caller's deadline ([`UpstreamClient::send_before`]) passed
    /// before the response headers arrived.
    #[error("the request deadline passed before the response headers")]
    Deadline,
}

impl UpstreamError {
    /// Whether the failure may be retried on another worker: it happened
    /// before the client saw a byte, and neither the router's own request
    /// nor its deadline is at fault.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, Self::InvalidRequest(_) | Self::Deadline)
    }
}

type Connection = http1::Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// One HTTP/1.1 connection to a worker: the request half, the connection
/// state machine (boxed once per connection so it can move between the
/// pool, the request future and the body without being re-pinned), and the
/// pool key it returns under.
struct Conn {
    sender: http1::SendRequest<Full<Bytes>>,
    driver: Pin<Box<Connection>>,
    key: Arc<str>,
    /// The `Host` header of requests on this connection (built once).
    host: HeaderValue,
    reused: bool,
    /// The connection future completed (closed or failed); it must not be
    /// polled again.
    closed: bool,
}

struct IdleConn {
    conn: Conn,
    since: Instant,
}

/// Idle connections per worker authority (`host:port`).
struct Pool {
    idle: Mutex<Idle>,
    config: ClientConfig,
}

struct Idle {
    queues: HashMap<Arc<str>, VecDeque<IdleConn>>,
    /// When `put` next sweeps every worker's queue for expired connections:
    /// a worker that left the fleet is never asked for again, and its idle
    /// sockets would otherwise stay open.
    next_sweep: Instant,
}

impl Pool {
    fn new(config: ClientConfig) -> Self {
        Self {
            idle: Mutex::new(Idle {
                queues: HashMap::new(),
                next_sweep: Instant::now() + config.pool_idle_timeout / 2,
            }),
            config,
        }
    }

    fn expired(&self, entry: &IdleConn, now: Instant) -> bool {
        now.saturating_duration_since(entry.since) >= self.config.pool_idle_timeout
    }

    /// The most recently returned idle connection to `key` that is still
    /// fresh; expired ones found on the way are dropped (closed).
    fn take(&self, key: &str) -> Option<Conn> {
        let now = Instant::now();
        let mut idle = self.idle.lock();
        let queue = idle.queues.get_mut(key)?;
        while let Some(entry) = queue.pop_back() {
            if !self.expired(&entry, now) && !entry.conn.sender.is_closed() {
                return Some(entry.conn);
            }
        }
        None
    }

    /// Returns `conn` to the pool, closing the oldest idle connection of the
    /// same worker when the pool is full or it expired, and every expired
    /// connection of every worker once per half idle timeout.
    fn put(&self, mut conn: Conn) {
        if self.config.pool_max_idle_per_host == 0 || conn.sender.is_closed() {
            return;
        }
        conn.reused = true;
        let now = Instant::now();
        let mut dropped = Vec::new();
        {
            let mut idle = self.idle.lock();
            if now >= idle.next_sweep {
                idle.next_sweep = now + self.config.pool_idle_timeout / 2;
                for queue in idle.queues.values_mut() {
                    while queue.front().is_some_and(|entry| self.expired(entry, now)) {
                        dropped.extend(queue.pop_front());
                    }
                }
                idle.queues.retain(|_, queue| !queue.is_empty());
            }
            let queue = match idle.queues.get_mut(&conn.key) {
                Some(queue) => queue,
                None => idle.queues.entry(Arc::clone(&conn.key)).or_default(),
            };
            while let Some(oldest) = queue.front() {
                if !self.expired(oldest, now) && queue.len() < self.config.pool_max_idle_per_host {
                    break;
                }
                dropped.extend(queue.pop_front());
            }
            queue.push_back(IdleConn { conn, since: now });
        }
        // Closing sockets happens outside the lock.
        drop(dropped);
    }

    fn idle_count(&self) -> usize {
        self.idle.lock().queues.values().map(VecDeque::len).sum()
    }
}

/// A pooled HTTP/1.1 client to the workers.
#[derive(Clone)]
pub struct UpstreamClient {
    pool: Arc<Pool>,
}

impl std::fmt::Debug for UpstreamClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamClient")
            .field("config", &self.pool.config)
            .field("idle_connections", &self.pool.idle_count())
            .finish()
    }
}

impl UpstreamClient {
    /// A client with `config`.
    pub fn new(config: ClientConfig) -> Self {
        Self {
            pool: Arc::new(Pool::new(config)),
        }
    }

    /// The client's settings.
    pub fn config(&self) -> &ClientConfig {
        &self.pool.config
    }

    /// Idle connections currently pooled, over all workers.
    pub fn idle_connections(&self) -> usize {
        self.pool.idle_count()
    }

    /// Sends `request` (an absolute `http://host:port/path` URI) and waits
    /// for the response headers. The response body keeps driving the
    /// connection; see the [module docs](self).
    pub async fn send(
        &self,
        request: http::Request<Full<Bytes>>,
    ) -> Result<http::Response<UpstreamBody>, UpstreamError> {
        self.send_before(request, None).await
    }

    /// [`send`](Self::send), given up at `deadline` as well (the caller's
    /// whole-request deadline) with [`UpstreamError::Deadline`]: one timer
    /// covers both limits.
    pub async fn send_before(
        &self,
        request: http::Request<Full<Bytes>>,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<http::Response<UpstreamBody>, UpstreamError> {
        let timeout = self.pool.config.response_header_timeout;
        let header_deadline = tokio::time::Instant::now() + timeout;
        let (until, caller_first) = match deadline {
            Some(deadline) if deadline < header_deadline => (deadline, true),
            _ => (header_deadline, false),
        };
        match tokio::time::timeout_at(until, self.send_inner(request)).await {
            Ok(result) => result,
            Err(_elapsed) if caller_first => Err(UpstreamError::Deadline),
            Err(_elapsed) => Err(UpstreamError::HeaderTimeout(timeout)),
        }
    }

    async fn send_inner(
        &self,
        request: http::Request<Full<Bytes>>,
    ) -> Result<http::Response<UpstreamBody>, UpstreamError> {
        let (mut request, authority) = origin_form(request)?;
        loop {
            let mut conn = match self.pool.take(authority.as_str()) {
                Some(conn) => conn,
                None => self.connect(&authority).await?,
            };
            // An idle connection is only known to be usable once it was
            // polled: a worker that closed it is noticed here.
            if std::future::poll_fn(|cx| conn.poll_ready(cx))
                .await
                .is_err()
            {
                if conn.reused {
                    continue;
                }
                return Err(UpstreamError::Transport(
                    "the new connection closed before the request was sent".into(),
                ));
            }
            request
                .headers_mut()
                .entry(HOST)
                .or_insert_with(|| conn.host.clone());
            let reused = conn.reused;
            let sent = conn.sender.try_send_request(request);
            match drive(sent, &mut conn).await {
                Ok(response) => {
                    let pool = Arc::clone(&self.pool);
                    return Ok(response.map(|incoming| UpstreamBody::new(incoming, conn, pool)));
                }
                Err(mut failed) => match failed.take_message() {
                    // Never written: a reused connection closed under us, so
                    // the request moves to another one.
                    Some(unsent) if reused => request = unsent,
                    _ => return Err(UpstreamError::Transport(error_chain(failed.error()))),
                },
            }
        }
    }

    async fn connect(&self, authority: &Authority) -> Result<Conn, UpstreamError> {
        let timeout = self.pool.config.connect_timeout;
        let stream =
            match tokio::time::timeout(timeout, TcpStream::connect(host_port(authority))).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(err)) => return Err(UpstreamError::Connect(format!("{authority}: {err}"))),
                Err(_elapsed) => {
                    return Err(UpstreamError::Connect(format!(
                        "{authority}: no connection within {timeout:?}"
                    )));
                }
            };
        // Small SSE chunks must not wait for Nagle's algorithm.
        let _ = stream.set_nodelay(true);
        let (sender, driver) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|err| UpstreamError::Connect(error_chain(&err)))?;
        Ok(Conn {
            sender,
            driver: Box::pin(driver),
            key: Arc::from(authority.as_str()),
            host: HeaderValue::from_str(authority.as_str())
                .map_err(|err| UpstreamError::InvalidRequest(err.to_string()))?,
            reused: false,
            closed: false,
        })
    }
}

impl Default for UpstreamClient {
    fn default() -> Self {
        Self::new(ClientConfig::default())
    }
}

impl Conn {
    /// Lets hyper read, decode and write what it can. `Ready` once the
    /// connection is over (with its error, if it failed); polling stops then.
    fn poll_driver(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), hyper::Error>> {
        if self.closed {
            return Poll::Ready(Ok(()));
        }
        let result = std::task::ready!(self.driver.as_mut().poll(cx));
        self.closed = true;
        Poll::Ready(result)
    }

    /// Drives the connection until it can take a request; an error when it
    /// closed instead.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ()>> {
        if self.poll_driver(cx).is_ready() {
            return Poll::Ready(Err(()));
        }
        self.sender.poll_ready(cx).map_err(drop)
    }
}

/// Polls `sent` (the response-headers future) and the connection together,
/// in the caller's task.
async fn drive<F, T>(sent: F, conn: &mut Conn) -> T
where
    F: Future<Output = T>,
{
    let mut sent = std::pin::pin!(sent);
    std::future::poll_fn(|cx| {
        // When the connection ends first, hyper has already completed the
        // response future (with the response or the error), so its result
        // is not needed here.
        let _ = conn.poll_driver(cx);
        sent.as_mut().poll(cx)
    })
    .await
}

/// The host (IPv6 without its brackets) and port (80 by default) of an
/// `http://` authority, as a socket address to connect to or resolve.
pub(crate) fn host_port(authority: &Authority) -> (&str, u16) {
    let host = authority.host();
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    (host, authority.port_u16().unwrap_or(80))
}

/// Splits an absolute `http://` URI into the worker's authority
/// (`host:port`, the pool key) and an origin-form request (HTTP/1.1 sends
/// the path only; the `Host` header comes from the connection).
fn origin_form(
    mut request: http::Request<Full<Bytes>>,
) -> Result<(http::Request<Full<Bytes>>, Authority), UpstreamError> {
    let uri = request.uri();
    if uri.scheme_str() != Some("http") {
        return Err(UpstreamError::InvalidRequest(format!(
            "only http:// worker URLs are supported, got `{uri}`"
        )));
    }
    let Some(authority) = uri.authority().cloned() else {
        return Err(UpstreamError::InvalidRequest(format!(
            "the worker URL `{uri}` has no host"
        )));
    };
    let path = uri
        .path_and_query()
        .map_or_else(|| http::uri::PathAndQuery::from_static("/"), Clone::clone);
    *request.uri_mut() = http::Uri::from(path);
    Ok((request, authority))
}

/// A worker's response body. It owns the connection it arrives on and
/// drives it from [`Body::poll_frame`]; when the body ends cleanly the
/// connection returns to the pool, when it is dropped early the connection
/// closes.
pub struct UpstreamBody {
    incoming: Incoming,
    conn: Option<Conn>,
    driver_error: Option<hyper::Error>,
    pool: Arc<Pool>,
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("incoming", &self.incoming)
            .field("driving", &self.conn.as_ref().is_some_and(|c| !c.closed))
            .finish()
    }
}

impl UpstreamBody {
    fn new(incoming: Incoming, conn: Conn, pool: Arc<Pool>) -> Self {
        Self {
            incoming,
            conn: Some(conn),
            driver_error: None,
            pool,
        }
    }

    /// The end of a clean response: a connection that can take another
    /// request goes back to the pool.
    fn release(&mut self, cx: &mut Context<'_>) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        // Let hyper see the end of the message so the connection turns idle;
        // a connection that ends here (`Connection: close`) is not reused.
        if conn.poll_driver(cx).is_pending() {
            self.pool.put(conn);
        }
    }
}

impl Drop for UpstreamBody {
    /// A body dropped after its last byte (hyper does not poll a body that
    /// reports its end, such as an empty one) still returns its connection;
    /// one dropped earlier closes it.
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take()
            && self.incoming.is_end_stream()
            && !conn.closed
            && self.driver_error.is_none()
        {
            self.pool.put(conn);
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(conn) = this.conn.as_mut()
            && !conn.closed
            && let Poll::Ready(Err(err)) = conn.poll_driver(cx)
        {
            this.driver_error = Some(err);
        }
        match Pin::new(&mut this.incoming).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                // hyper's server stops polling a body that reports its end
                // after the last frame, so the connection is released here.
                if this.incoming.is_end_stream() {
                    this.release(cx);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => match this.driver_error.take() {
                // The connection failed and the body merely stopped: the
                // worker's response is incomplete.
                Some(err) => Poll::Ready(Some(Err(err))),
                None => {
                    this.release(cx);
                    Poll::Ready(None)
                }
            },
            Poll::Ready(Some(Err(err))) => {
                this.conn = None;
                Poll::Ready(Some(Err(err)))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.incoming.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.incoming.size_hint()
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
    use http_body_util::BodyExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn get(url: String) -> http::Request<Full<Bytes>> {
        http::Request::get(url)
            .body(Full::new(Bytes::new()))
            .unwrap()
    }

    /// A worker that answers every request on a connection with `answer`,
    /// counting accepted connections; after `per_connection` answers it
    /// closes the connection.
    async fn raw_worker(
        answer: &'static str,
        per_connection: usize,
    ) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    for _ in 0..per_connection {
                        let mut seen = Vec::new();
                        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                            match socket.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => seen.extend_from_slice(&buf[..n]),
                            }
                        }
                        if socket.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    const OK: &str = "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";

    #[tokio::test]
    async fn a_refused_connection_is_a_retryable_connect_error() {
        // Bind then drop a listener so the port is (almost certainly) closed.
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let client = UpstreamClient::default();
        let err = client
            .send(get(format!("http://127.0.0.1:{port}/health")))
            .await
            .unwrap_err();
        assert!(matches!(err, UpstreamError::Connect(_)), "{err:?}");
        assert!(err.is_retryable());
        assert!(err.to_string().contains("refused"), "{err}");
    }

    #[tokio::test]
    async fn a_connection_is_reused_after_a_complete_response() {
        let (addr, accepted) = raw_worker(OK, usize::MAX).await;
        let client = UpstreamClient::default();
        for _ in 0..5 {
            let response = client.send(get(format!("http://{addr}/x"))).await.unwrap();
            assert_eq!(response.status(), 200);
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"hello");
            assert_eq!(client.idle_connections(), 1);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_empty_body_returns_its_connection_even_unpolled() {
        let empty = "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        let (addr, accepted) = raw_worker(empty, usize::MAX).await;
        let client = UpstreamClient::default();
        for _ in 0..3 {
            let response = client.send(get(format!("http://{addr}/x"))).await.unwrap();
            assert!(response.body().is_end_stream());
            drop(response);
            assert_eq!(client.idle_connections(), 1);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_body_dropped_early_closes_its_connection_instead_of_pooling_it() {
        let chunked = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n";
        let (addr, accepted) = raw_worker(chunked, usize::MAX).await;
        let client = UpstreamClient::default();
        for expected in 1..=2 {
            let response = client.send(get(format!("http://{addr}/s"))).await.unwrap();
            let mut body = response.into_body();
            let first = body.frame().await.unwrap().unwrap();
            assert_eq!(first.into_data().unwrap(), "hello");
            drop(body);
            assert_eq!(client.idle_connections(), 0);
            // The next request cannot use the abandoned connection.
            let _ = client.send(get(format!("http://{addr}/s"))).await.unwrap();
            assert_eq!(accepted.load(Ordering::SeqCst), 2 * expected);
        }
    }

    #[tokio::test]
    async fn a_pooled_connection_the_worker_closed_is_replaced_transparently() {
        // The worker answers once per connection, then closes it.
        let (addr, accepted) = raw_worker(OK, 1).await;
        let client = UpstreamClient::default();
        for round in 1..=3 {
            let response = client.send(get(format!("http://{addr}/x"))).await.unwrap();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"hello");
            // Give the close time to arrive, as it would between requests.
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert_eq!(accepted.load(Ordering::SeqCst), round);
        }
    }

    #[tokio::test]
    async fn a_connection_close_response_is_not_pooled() {
        let close = "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok";
        let (addr, accepted) = raw_worker(close, 1).await;
        let client = UpstreamClient::default();
        for _ in 0..2 {
            let response = client.send(get(format!("http://{addr}/x"))).await.unwrap();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"ok");
            assert_eq!(client.idle_connections(), 0);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_body_cut_short_by_the_worker_is_an_error() {
        let short = "HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this";
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = socket.read(&mut buf).await;
            socket.write_all(short.as_bytes()).await.unwrap();
            // Dropping the socket resets the connection mid-body.
        });
        let client = UpstreamClient::default();
        let response = client.send(get(format!("http://{addr}/x"))).await.unwrap();
        let result = response.into_body().collect().await;
        assert!(result.is_err(), "a truncated body must not end cleanly");
        assert_eq!(client.idle_connections(), 0);
    }

    #[tokio::test]
    async fn pool_bounds_and_expiry_close_idle_connections() {
        let (addr, accepted) = raw_worker(OK, usize::MAX).await;
        let client = UpstreamClient::new(ClientConfig {
            pool_max_idle_per_host: 2,
            ..ClientConfig::default()
        });
        // Four concurrent requests need four connections; two stay idle.
        let url = format!("http://{addr}/x");
        let responses =
            futures_util::future::join_all((0..4).map(|_| client.send(get(url.clone())))).await;
        for response in responses {
            let body = response.unwrap().into_body().collect().await.unwrap();
            assert_eq!(&body.to_bytes()[..], b"hello");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 4);
        assert_eq!(client.idle_connections(), 2);

        let expiring = UpstreamClient::new(ClientConfig {
            pool_idle_timeout: Duration::ZERO,
            ..ClientConfig::default()
        });
        let response = expiring.send(get(url.clone())).await.unwrap();
        let _ = response.into_body().collect().await.unwrap();
        let response = expiring.send(get(url)).await.unwrap();
        let _ = response.into_body().collect().await.unwrap();
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            6,
            "an expired connection is not reused"
        );
    }

    #[tokio::test]
    async fn requests_go_out_in_origin_form_with_the_worker_as_host() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let head = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut seen = Vec::new();
            let mut buf = [0u8; 1024];
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut buf).await.unwrap();
                seen.extend_from_slice(&buf[..n]);
            }
            socket.write_all(OK.as_bytes()).await.unwrap();
            String::from_utf8(seen).unwrap()
        });
        let client = UpstreamClient::default();
        let response = client
            .send(get(format!("http://{addr}/v1/models?x=1")))
            .await
            .unwrap();
        let _ = response.into_body().collect().await.unwrap();
        let head = head.await.unwrap().to_ascii_lowercase();
        assert!(
            head.starts_with("get /v1/models?x=1 http/1.1\r\n"),
            "{head}"
        );
        assert!(head.contains(&format!("\r\nhost: {addr}\r\n")), "{head}");
    }

    #[tokio::test]
    async fn idle_connections_of_a_worker_no_longer_used_are_closed_by_a_sweep() {
        // Two workers; the first is never asked for again (it left the
        // fleet). Its idle connection must still close once it expired.
        let closed = Arc::new(AtomicUsize::new(0));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gone = listener.local_addr().unwrap();
        let counter = Arc::clone(&closed);
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = socket.read(&mut buf).await;
            socket.write_all(OK.as_bytes()).await.unwrap();
            // The router closing its idle connection reads as end of file.
            while let Ok(n) = socket.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
            counter.fetch_add(1, Ordering::SeqCst);
        });
        let (staying, _) = raw_worker(OK, usize::MAX).await;
        let client = UpstreamClient::new(ClientConfig {
            pool_idle_timeout: Duration::from_millis(100),
            ..ClientConfig::default()
        });
        let response = client.send(get(format!("http://{gone}/x"))).await.unwrap();
        let _ = response.into_body().collect().await.unwrap();
        assert_eq!(client.idle_connections(), 1);
        // Past the idle timeout, traffic to the other worker sweeps it.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let response = client
            .send(get(format!("http://{staying}/x")))
            .await
            .unwrap();
        let _ = response.into_body().collect().await.unwrap();
        assert_eq!(
            client.idle_connections(),
            1,
            "only the live worker's connection"
        );
        for _ in 0..500 {
            if closed.load(Ordering::SeqCst) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            closed.load(Ordering::SeqCst),
            1,
            "the expired socket was closed"
        );
    }

    #[tokio::test]
    async fn a_non_http_url_is_rejected_before_connecting() {
        let client = UpstreamClient::default();
        let err = client
            .send(get("https://127.0.0.1:1/x".into()))
            .await
            .unwrap_err();
        assert!(matches!(err, UpstreamError::InvalidRequest(_)), "{err:?}");
        assert!(!err.is_retryable());
    }
}
