//! The accept loop: HTTP/1.1 and cleartext HTTP/2 on one port, with graceful
//! shutdown.
//!
//! Each connection is served by hyper on its own task. On shutdown the loop
//! stops accepting at once, tells every connection to finish (HTTP/1 closes
//! after the response in flight, HTTP/2 sends GOAWAY), and waits for them up
//! to a deadline; whatever is still running then is dropped, which releases
//! its guards like any client disconnect.

use hyper::body::Incoming;
use hyper::service::Service;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use std::future::Future;
use std::time::Duration;
use tokio::net::TcpListener;

/// How the accept loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShutdownOutcome {
    /// Every connection finished within the grace period.
    Drained,
    /// The grace period ran out; the remaining connections were dropped.
    DeadlineReached,
}

/// Serves `service` on `listener` until `shutdown` resolves, then drains
/// connections for at most `grace`.
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
    serve_with_grace(listener, service, shutdown, move || grace).await
}

/// [`serve`], with the drain period computed when `shutdown` resolves (so a
/// caller whose shutdown future already spent part of its grace period can
/// pass on only the rest).
pub async fn serve_with_grace<S, B>(
    listener: TcpListener,
    service: S,
    shutdown: impl Future<Output = ()>,
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
    builder.http1().writev(false);
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        // Out of file descriptors and the like: back off
                        // briefly instead of spinning, keep serving.
                        tracing::warn!(error = %err, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let connection = builder
                    .serve_connection_with_upgrades(TokioIo::new(stream), service.clone())
                    .into_owned();
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    if let Err(err) = connection.await {
                        tracing::debug!(error = %err, "connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    match tokio::time::timeout(grace(), graceful.shutdown()).await {
        Ok(()) => ShutdownOutcome::Drained,
        Err(_) => ShutdownOutcome::DeadlineReached,
    }
}
