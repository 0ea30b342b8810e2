//! Graceful drain: stop sending new work, let in-flight work finish, leave.
//!
//! Draining marks a worker [`Draining`](crate::Lifecycle::Draining) (so
//! [`Worker::is_available`] is false and [`Worker::try_reserve`] refuses),
//! waits until its load reaches 0 or a deadline passes, then removes it from
//! its set or pool, which emits the [`MembershipEvent`]. The wait holds no
//! lock.

use std::sync::Arc;

use tokio::time::Instant as TokioInstant;

use crate::membership::MembershipEvent;
use crate::pool::{DiscoveryPool, PoolError};
use crate::registry::ServiceRegistry;
use crate::static_set::{StaticSetError, StaticWorkerSet};
use crate::worker::{Endpoint, Worker};

/// How a drain ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DrainOutcome {
    /// The worker's load reached 0.
    Idle,
    /// The deadline passed with work still in flight; those guards stay
    /// valid and finish on the removed worker.
    DeadlineReached {
        /// Load left at the deadline.
        remaining_load: usize,
    },
}

/// The result of draining and removing a worker.
#[derive(Debug, Clone)]
pub struct DrainReport {
    /// How the wait ended.
    pub outcome: DrainOutcome,
    /// The membership changes the removal caused (forward them to policies).
    pub events: Vec<MembershipEvent>,
}

/// Marks `worker` draining and waits until it is idle or `deadline` passes.
/// Does not remove it from anything.
pub async fn drain_worker(worker: &Worker, deadline: TokioInstant) -> DrainOutcome {
    worker.start_drain();
    match worker.wait_idle(deadline).await {
        0 => DrainOutcome::Idle,
        remaining_load => DrainOutcome::DeadlineReached { remaining_load },
    }
}

impl StaticWorkerSet {
    /// Drains the worker at `endpoint` and removes it. A replacement that
    /// took its place during the wait is left alone.
    pub async fn drain(
        &self,
        endpoint: &Endpoint,
        deadline: TokioInstant,
    ) -> Result<DrainReport, StaticSetError> {
        let worker = self
            .get(endpoint)
            .ok_or_else(|| StaticSetError::NotFound(endpoint.to_string()))?;
        Ok(self.drain_lifetime(&worker, deadline).await)
    }

    /// Drains exactly this worker lifetime and removes it if it is still a
    /// member: for a caller that already holds the worker, so a
    /// replacement registered at the same endpoint meanwhile is left alone.
    pub async fn drain_lifetime(
        &self,
        worker: &Arc<Worker>,
        deadline: TokioInstant,
    ) -> DrainReport {
        let outcome = drain_worker(worker, deadline).await;
        let events = self.remove_worker(worker).into_iter().collect();
        DrainReport { outcome, events }
    }
}

impl DiscoveryPool {
    /// Drains the discovered worker at `endpoint`, then deregisters exactly
    /// its generation from `registry` and reconciles, which removes it from
    /// the pool. Returns `None` if the endpoint is not a member.
    pub async fn drain(
        &self,
        registry: &ServiceRegistry,
        endpoint: &Endpoint,
        deadline: TokioInstant,
    ) -> Result<Option<DrainReport>, PoolError> {
        let Some(worker) = self.get(endpoint) else {
            return Ok(None);
        };
        let outcome = drain_worker(&worker, deadline).await;
        registry.deregister_generation(endpoint, worker.generation());
        let now = worker.clock().now();
        let events = self.with_reconciled(registry, now, |view| view.events().to_vec())?;
        Ok(Some(DrainReport { outcome, events }))
    }
}
