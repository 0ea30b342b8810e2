//! The accept loop: HTTP/1.1 and cleartext HTTP/2 on one port, with graceful
//! shutdown.
//!
//! Each connection is served by hyper on its own task. On shutdown the loop
//! stops accepting at once, tells every connection to finish (HTTP/1 closes
//! after the response in flight, HTTP/2 sends GOAWAY), and waits for them up
//! to a deadline; whatever is still running then is dropped, which releases
//! its guards like any client disconnect.
//!
//! Against clients that hold connections without using them, the loop caps
//! the connections it serves at once ([`ServerConfig::max_connections`]),
//! closes a connection whose first bytes, or an HTTP/1 connection whose
//! request headers, do not arrive in time
//! ([`ServerConfig::header_read_timeout`]), and pauses with a growing
//! backoff when `accept` itself fails (out of file descriptors), logging
//! that at most once per five seconds.

use hyper::body::Incoming;
use hyper::service::Service;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use std::future::Future;
use std::io::ErrorKind;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// How the accept loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShutdownOutcome {
    /// Every connection finished within the grace period.
    Drained,
    /// The grace period ran out; the remaining connections were dropped.
    DeadlineReached,
}

/// Limits of the accept loop against clients that hold connections open.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// How long a new connection may take to send the first bytes that
    /// choose HTTP/1 or HTTP/2, and an HTTP/1 client a request's headers,
    /// counted from when the connection waits for them (so it also closes a
    /// keep-alive connection idle for this long). Default 30 s, hyper's own
    /// default once a timer is set; `None` turns it off.
    pub header_read_timeout: Option<Duration>,
    /// Connections served at once (default 16384). At the cap the loop stops
    /// accepting until one closes: new clients wait in the kernel's listen
    /// backlog rather than being accepted and starved, and the process never
    /// spends its last file descriptors on them.
    pub max_connections: usize,
    /// Where the loop counts connections and accept errors. Clones of a
    /// config share it; [`Default`] makes a fresh one.
    pub stats: Arc<ServerStats>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Some(Duration::from_secs(30)),
            max_connections: 16384,
            stats: Arc::default(),
        }
    }
}

/// The accept loop's counters.
#[derive(Debug, Default)]
pub struct ServerStats {
    open: AtomicU64,
    accepted: AtomicU64,
    accept_errors: AtomicU64,
    at_limit: AtomicU64,
    header_timeouts: AtomicU64,
}

impl ServerStats {
    /// Connections being served now.
    pub fn open_connections(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections accepted since start.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// `accept` calls that failed (out of file descriptors and the like).
    pub fn accept_errors(&self) -> u64 {
        self.accept_errors.load(Ordering::Relaxed)
    }

    /// Times the loop stopped accepting because the connection cap was reached.
    pub fn at_limit(&self) -> u64 {
        self.at_limit.load(Ordering::Relaxed)
    }

    /// Connections closed because a request's headers (or, before any
    /// request, the first bytes) did not arrive within the header-read timeout.
    pub fn header_timeouts(&self) -> u64 {
        self.header_timeouts.load(Ordering::Relaxed)
    }
}

/// Serves `service` on `listener` with the default [`ServerConfig`] until
/// `shutdown` resolves, then drains connections for at most `grace`.
pub async fn serve<S, B>(
    listener: TcpListener,
    service: S,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) -> ShutdownOutcome
where
    S: Service<http::Request<Incoming>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve_with(
        listener,
        service,
        shutdown,
        &ServerConfig::default(),
        move || grace,
    )
    .await
}

/// [`serve`] with `config`, and the drain period computed when `shutdown`
/// resolves (so a caller whose shutdown future already spent part of its
/// grace period can pass on only the rest).
pub async fn serve_with<S, B>(
    listener: TcpListener,
    service: S,
    shutdown: impl Future<Output = ()>,
    config: &ServerConfig,
    grace: impl FnOnce() -> Duration,
) -> ShutdownOutcome
where
    S: Service<http::Request<Incoming>, Response = http::Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // One contiguous write per batch of frames instead of vectored writes:
    // a vectored write queue holds only 16 buffers (five SSE chunks with
    // their chunked-encoding framing), so a stream whose chunks arrived
    // together would otherwise leave in several system calls.
    builder
        .http1()
        .writev(false)
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout);
    let builder = Arc::new(builder);
    let slots = Arc::new(Semaphore::new(config.max_connections.max(1)));
    let stats = Arc::clone(&config.stats);
    let mut errors = AcceptErrors::default();
    let graceful = GracefulShutdown::new();
    // Tells connections still waiting for their first bytes that the loop
    // stopped: they hold a graceful-shutdown watcher, and must not make the
    // drain wait for their timeout.
    let (stopping, _) = tokio::sync::watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // A free connection slot first: at the cap, clients wait in the
        // listen backlog instead of taking descriptors the process needs.
        let slot = match Arc::clone(&slots).try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                stats.at_limit.fetch_add(1, Ordering::Relaxed);
                tokio::select! {
                    slot = Arc::clone(&slots).acquire_owned() => match slot {
                        Ok(slot) => slot,
                        Err(_closed) => break,
                    },
                    () = &mut shutdown => break,
                }
            }
        };
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _peer)) => {
                        errors.succeeded();
                        stream
                    }
                    Err(err) => {
                        stats.accept_errors.fetch_add(1, Ordering::Relaxed);
                        let pause = errors.failed(&err, std::time::Instant::now());
                        drop(slot);
                        tokio::select! {
                            () = tokio::time::sleep(pause) => continue,
                            () = &mut shutdown => break,
                        }
                    }
                };
                stats.accepted.fetch_add(1, Ordering::Relaxed);
                stats.open.fetch_add(1, Ordering::Relaxed);
                let _ = stream.set_nodelay(true);
                let builder = Arc::clone(&builder);
                let service = service.clone();
                let watcher = graceful.watcher();
                let stats = Arc::clone(&stats);
                let first_bytes_timeout = config.header_read_timeout;
                let mut stopping = stopping.subscribe();
                tokio::spawn(async move {
                    // Until the first bytes choose HTTP/1 or HTTP/2 no
                    // protocol timer runs: bound that wait too. A shutdown
                    // ends it at once: nothing was asked on this connection.
                    let first_bytes = async {
                        match first_bytes_timeout {
                            Some(limit) => tokio::time::timeout(limit, protocol_chosen(&stream))
                                .await
                                .unwrap_or(Err(ErrorKind::TimedOut.into())),
                            None => protocol_chosen(&stream).await,
                        }
                    };
                    let chosen = tokio::select! {
                        chosen = first_bytes => chosen,
                        _ = stopping.wait_for(|stop| *stop) => {
                            Err(ErrorKind::ConnectionAborted.into())
                        }
                    };
                    match chosen {
                        Ok(()) => {
                            let connection = builder
                                .serve_connection_with_upgrades(TokioIo::new(stream), service);
                            if let Err(err) = watcher.watch(connection).await {
                                if is_header_timeout(&*err) {
                                    stats.header_timeouts.fetch_add(1, Ordering::Relaxed);
                                }
                                tracing::debug!(error = %err, "connection ended with an error");
                            }
                        }
                        Err(err) => {
                            if err.kind() == ErrorKind::TimedOut {
                                stats.header_timeouts.fetch_add(1, Ordering::Relaxed);
                            }
                            tracing::debug!(error = %err, "connection closed before a request");
                        }
                    }
                    stats.open.fetch_sub(1, Ordering::Relaxed);
                    drop(slot);
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    stopping.send_replace(true);
    match tokio::time::timeout(grace(), graceful.shutdown()).await {
        Ok(()) => ShutdownOutcome::Drained,
        Err(_) => ShutdownOutcome::DeadlineReached,
    }
}

/// The client preface of HTTP/2 over cleartext.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Waits until the client's first bytes tell HTTP/1 from HTTP/2 (a byte
/// that leaves the HTTP/2 preface, or the whole preface), without
/// consuming them; an error when the client closes first.
async fn protocol_chosen(stream: &tokio::net::TcpStream) -> std::io::Result<()> {
    let mut buffer = [0u8; H2_PREFACE.len()];
    loop {
        let read = stream.peek(&mut buffer).await?;
        if read == 0 {
            return Err(ErrorKind::UnexpectedEof.into());
        }
        if read == H2_PREFACE.len() || buffer[..read] != H2_PREFACE[..read] {
            return Ok(());
        }
        // Part of a preface: `peek` would return the same bytes at once, so
        // wait a little for the rest (it comes in the same flight in practice).
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether a connection ended because hyper's header-read timeout fired.
fn is_header_timeout(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(error) = source {
        if error
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_timeout)
        {
            return true;
        }
        source = error.source();
    }
    false
}

/// Backoff and rate-limited logging of failed `accept` calls. Out of file
/// descriptors, `accept` fails at once every time it is called: without a
/// growing pause the loop spins a core, and without a log limit it writes
/// thousands of lines a second.
#[derive(Debug, Default)]
struct AcceptErrors {
    /// Failures in a row.
    streak: u32,
    /// When a failure was last logged, and how many were not logged since.
    last_logged: Option<std::time::Instant>,
    unlogged: u64,
}

/// The first pause after a failed `accept`; it doubles per failure in a row.
const ACCEPT_PAUSE_MIN: Duration = Duration::from_millis(5);
/// The longest pause between `accept` attempts.
const ACCEPT_PAUSE_MAX: Duration = Duration::from_secs(1);
/// At most one accept-error log line per this period.
const ACCEPT_LOG_PERIOD: Duration = Duration::from_secs(5);

impl AcceptErrors {
    /// Records a failure at `now`: logs it unless one was logged within
    /// the last period, and returns how long to pause before accepting again.
    fn failed(&mut self, error: &std::io::Error, now: std::time::Instant) -> Duration {
        let pause = ACCEPT_PAUSE_MIN
            .saturating_mul(1 << self.streak.min(16))
            .min(ACCEPT_PAUSE_MAX);
        self.streak = self.streak.saturating_add(1);
        let due = self
            .last_logged
            .is_none_or(|last| now.saturating_duration_since(last) >= ACCEPT_LOG_PERIOD);
        if due {
            tracing::warn!(
                %error,
                suppressed = self.unlogged,
                pause_ms = pause.as_millis() as u64,
                "accept failed; pausing before accepting again"
            );
            self.last_logged = Some(now);
            self.unlogged = 0;
        } else {
            self.unlogged += 1;
        }
        pause
    }

    /// A connection was accepted: the next failure starts from the shortest pause.
    fn succeeded(&mut self) {
        self.streak = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_failures_back_off_to_a_ceiling_and_log_at_a_bounded_rate() {
        let mut errors = AcceptErrors::default();
        let error = std::io::Error::from_raw_os_error(24); // EMFILE
        let start = std::time::Instant::now();
        let pauses: Vec<Duration> = (0..12).map(|_| errors.failed(&error, start)).collect();
        assert_eq!(pauses[0], ACCEPT_PAUSE_MIN);
        assert_eq!(pauses[1], ACCEPT_PAUSE_MIN * 2);
        assert!(pauses.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(*pauses.last().unwrap(), ACCEPT_PAUSE_MAX);
        // Twelve failures within one period: one line, eleven counted.
        assert_eq!(errors.unlogged, 11);
        errors.failed(&error, start + ACCEPT_LOG_PERIOD);
        assert_eq!(errors.unlogged, 0, "a new period logs again");
        errors.succeeded();
        assert_eq!(errors.failed(&error, start), ACCEPT_PAUSE_MIN);
    }
}
