//! The startup gate: `/health` and `/readiness` say "not yet" until the
//! workers a host configured at startup are routable.
//!
//! # Why
//!
//! A host that adds its configured workers only once they answered their
//! first health probe (so that the first request can use them) has a window
//! after its listener binds in which the router answers but has nothing to
//! route to. Clients and deployment scripts that poll `GET /health` and send
//! their first request on the first 200 (vllm-router's own test harness
//! does; vllm-router does not even listen until its workers are healthy)
//! would see that request fail with `503 no_available_worker`.
//!
//! The gate closes that window without giving up an early listener:
//! `/liveness` answers 200 from the moment the listener binds (the process
//! is up), while `/health` and `/readiness` answer 503 with a JSON body
//! naming the workers still awaited, until every awaited worker was marked
//! ready or the startup wait ended. Then both follow their usual rules.
//! A router nobody declared workers for is open from the start: an empty
//! fleet or a discovered one answers `/health` 200 at once.
//!
//! # Use
//!
//! Declare the workers before the listener binds, mark each one ready once
//! it was added (after its first healthy probe):
//!
//! ```
//! use router_http::{Router, RouterConfig};
//! use std::time::Duration;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let router = Router::new(RouterConfig::default())?;
//! let urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"];
//! let gate = router.startup_gate();
//! gate.await_workers(urls, Duration::from_secs(600));
//! // ... bind and serve: /health answers 503 naming both workers ...
//! assert_eq!(gate.awaited(), urls);
//!
//! // Each worker answered its first probe: add it, then let the gate know.
//! for url in urls {
//!     router.add_worker(url, None, None)?;
//!     gate.worker_ready(url);
//! }
//! assert!(gate.is_open()); // /health now follows its usual rule
//! # Ok(())
//! # }
//! ```
//!
//! Names are compared after [`WorkerUrl::parse_http`] when they parse (so
//! `http://host:8001/` and `http://host:8001` are one worker); any other
//! name (say, "4 simulated engines") is kept as given and shown as is.
//!
//! # Concurrency
//!
//! Reads on the probe path take one atomic load while the gate is open; a
//! small mutex guards the awaited set while it is closed. Nothing is held
//! across an `.await`.

use parking_lot::Mutex;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use worker_lifecycle::WorkerUrl;

/// Holds `/health` and `/readiness` at 503 until the workers configured at
/// startup are routable or the startup wait ends. Open (nothing awaited)
/// when created. See the [module docs](self).
#[derive(Debug, Default)]
pub struct StartupGate {
    /// Fast path: true while nothing is awaited.
    open: AtomicBool,
    waiting: Mutex<Waiting>,
}

#[derive(Debug, Default)]
struct Waiting {
    /// Canonical names of the workers still awaited.
    awaited: BTreeSet<String>,
    /// When the gate opens whatever is still awaited.
    deadline: Option<Instant>,
}

impl StartupGate {
    /// An open gate: nothing awaited.
    pub fn new() -> Self {
        Self {
            open: AtomicBool::new(true),
            waiting: Mutex::default(),
        }
    }

    /// Closes the gate until every worker in `workers` was marked ready
    /// ([`StartupGate::worker_ready`]) or `wait` has passed (the host's
    /// startup wait, e.g. `--worker-startup-timeout-secs`). Calling it again
    /// adds workers and moves the deadline to the later of the two. An
    /// empty list changes nothing.
    pub fn await_workers<I, S>(&self, workers: I, wait: Duration)
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.await_workers_at(workers, Instant::now().checked_add(wait))
    }

    fn await_workers_at<I, S>(&self, workers: I, deadline: Option<Instant>)
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut waiting = self.waiting.lock();
        let was_waiting = !waiting.awaited.is_empty();
        waiting
            .awaited
            .extend(workers.into_iter().map(|name| canonical(name.as_ref())));
        if waiting.awaited.is_empty() {
            return;
        }
        // `None` is a wait too long to represent: no deadline at all, which
        // is later than any other.
        waiting.deadline = match (was_waiting, waiting.deadline, deadline) {
            (false, _, new) => new,
            (true, Some(old), Some(new)) => Some(old.max(new)),
            (true, _, _) => None,
        };
        self.open.store(false, Ordering::Release);
    }

    /// Marks one awaited worker routable (added to the router); the gate
    /// opens when it was the last one. Returns whether `worker` was awaited
    /// (a name never declared, or given twice, is a no-op).
    pub fn worker_ready(&self, worker: &str) -> bool {
        if self.open.load(Ordering::Acquire) {
            return false;
        }
        let mut waiting = self.waiting.lock();
        let removed = waiting.awaited.remove(&canonical(worker));
        if removed && waiting.awaited.is_empty() {
            tracing::info!("every worker configured at startup is routable");
            self.open_locked(&mut waiting);
        }
        removed
    }

    /// Stops waiting: the gate opens whatever is still awaited (a host
    /// that gave up on its startup wait, or knows better).
    pub fn open(&self) {
        let mut waiting = self.waiting.lock();
        self.open_locked(&mut waiting);
    }

    /// Whether the gate is open: nothing awaited, or the wait ended.
    pub fn is_open(&self) -> bool {
        self.awaited().is_empty()
    }

    /// The workers still awaited, sorted; empty once the gate is open
    /// (including when the startup wait ended, which this call notices).
    pub fn awaited(&self) -> Vec<String> {
        self.awaited_at(Instant::now())
    }

    fn awaited_at(&self, now: Instant) -> Vec<String> {
        if self.open.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut waiting = self.waiting.lock();
        if waiting.deadline.is_some_and(|deadline| now >= deadline) {
            tracing::warn!(
                still_awaited = ?waiting.awaited,
                "startup wait ended: /health and /readiness follow their usual rules"
            );
            self.open_locked(&mut waiting);
        }
        waiting.awaited.iter().cloned().collect()
    }

    fn open_locked(&self, waiting: &mut Waiting) {
        waiting.awaited.clear();
        waiting.deadline = None;
        self.open.store(true, Ordering::Release);
    }
}

/// One spelling per worker: a URL in its canonical form, any other name
/// as given.
fn canonical(name: &str) -> String {
    match WorkerUrl::parse_http(name) {
        Ok(url) => url.to_string(),
        Err(_) => name.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "http://127.0.0.1:8001";
    const B: &str = "http://127.0.0.1:8002";

    #[test]
    fn a_new_gate_is_open_and_an_empty_list_keeps_it_open() {
        let gate = StartupGate::new();
        assert!(gate.is_open());
        gate.await_workers(Vec::<String>::new(), Duration::from_secs(60));
        assert!(gate.is_open());
        assert!(gate.awaited().is_empty());
    }

    #[test]
    fn opens_when_the_last_awaited_worker_is_ready() {
        let gate = StartupGate::new();
        gate.await_workers([B, A], Duration::from_secs(60));
        assert!(!gate.is_open());
        assert_eq!(gate.awaited(), [A, B], "sorted");
        assert!(!gate.worker_ready("http://127.0.0.1:9999"), "never awaited");
        // Another spelling of the same URL is the same worker.
        assert!(gate.worker_ready("http://127.0.0.1:8002/"));
        assert!(!gate.worker_ready(B), "already ready");
        assert_eq!(gate.awaited(), [A]);
        assert!(!gate.is_open());
        assert!(gate.worker_ready(A));
        assert!(gate.is_open());
        assert!(gate.awaited().is_empty());
    }

    #[test]
    fn the_end_of_the_startup_wait_opens_the_gate() {
        let gate = StartupGate::new();
        let start = Instant::now();
        gate.await_workers_at([A], Some(start + Duration::from_secs(10)));
        assert_eq!(gate.awaited_at(start + Duration::from_secs(9)), [A]);
        assert!(gate.awaited_at(start + Duration::from_secs(10)).is_empty());
        assert!(gate.is_open());
        assert!(!gate.worker_ready(A), "nothing awaited any more");
    }

    #[test]
    fn a_second_declaration_adds_workers_and_keeps_the_later_deadline() {
        let gate = StartupGate::new();
        let start = Instant::now();
        gate.await_workers_at([A], Some(start + Duration::from_secs(30)));
        gate.await_workers_at(
            ["4 simulated engines"],
            Some(start + Duration::from_secs(10)),
        );
        assert_eq!(
            gate.awaited_at(start + Duration::from_secs(20)),
            ["4 simulated engines", A]
        );
        assert!(gate.awaited_at(start + Duration::from_secs(30)).is_empty());
    }

    #[test]
    fn an_unrepresentable_wait_never_ends_and_open_stops_waiting() {
        let gate = StartupGate::new();
        gate.await_workers([A], Duration::MAX);
        assert_eq!(gate.awaited(), [A]);
        gate.open();
        assert!(gate.is_open());
        assert!(gate.awaited().is_empty());
    }
}
