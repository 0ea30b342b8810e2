//! Serving, and the state that graceful shutdown and readiness read:
//! whether requests are admitted, how many are in flight, and the startup
//! gate.

use super::Router;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::time::Instant;

impl Router {
    /// Serves on `listener` until `shutdown` resolves; then stops admitting
    /// (readiness, health and proxied routes answer 503 at once, on a
    /// listener that stays open so probes can see it), lets requests in
    /// flight finish for up to the configured grace period, closes the
    /// listener, and returns.
    pub async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> crate::ShutdownOutcome {
        let router = self.clone();
        let service = hyper::service::service_fn(move |request| {
            let router = router.clone();
            async move { Ok::<_, std::convert::Infallible>(router.handle(request).await) }
        });
        let stopping = self.clone();
        let grace = self.shared.config.shutdown_grace;
        let drain_started = Arc::new(std::sync::OnceLock::new());
        let started = Arc::clone(&drain_started);
        // Phase one: stop admitting (readiness and proxied routes answer 503
        // at once) but keep the listener open, so probes see the 503, until
        // the requests in flight are done or the grace period ends.
        let shutdown = async move {
            shutdown.await;
            stopping.begin_shutdown();
            let deadline = Instant::now() + grace;
            let _ = started.set(deadline);
            while stopping.in_flight() > 0 && Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        };
        // Phase two: stop accepting and drain connections for what is left
        // of the grace period.
        let remaining = move || {
            drain_started.get().map_or(grace, |deadline: &Instant| {
                deadline.saturating_duration_since(Instant::now())
            })
        };
        crate::server::serve_with(
            listener,
            service,
            shutdown,
            &self.shared.config.server,
            remaining,
        )
        .await
    }

    /// Whether new requests are admitted (false once shutdown began).
    pub fn is_accepting(&self) -> bool {
        self.shared.accepting.load(Ordering::Acquire)
    }

    /// Stops admitting new requests: readiness and health turn 503 at once,
    /// proxied routes answer 503; requests in flight continue.
    pub fn begin_shutdown(&self) {
        self.shared.accepting.store(false, Ordering::Release);
    }

    /// The startup gate: until the workers a host declared on it are marked
    /// ready (or its startup wait ends), `/health` and `/readiness` answer
    /// 503 naming them, while `/liveness` answers 200. Open unless a host
    /// declares workers; see [`crate::startup`].
    pub fn startup_gate(&self) -> &crate::startup::StartupGate {
        &self.shared.startup
    }

    /// Requests in flight through the router (admission permits held).
    pub fn in_flight(&self) -> usize {
        self.shared.limiter.in_flight()
    }

    /// Status of the whole fleet for readiness: whether the startup gate is
    /// open and every required role has at least one available worker.
    pub fn is_ready(&self) -> bool {
        if !self.is_accepting() || !self.shared.startup.is_open() {
            return false;
        }
        match self.pd() {
            Some(pd) => pd.is_ready(),
            None => self
                .shared
                .pool
                .refresh()
                .is_ok_and(|workers| workers.iter().any(|w| w.is_available())),
        }
    }
}
