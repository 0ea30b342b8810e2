//! The router's background work: health checks, the prefix trees' upkeep,
//! the engines' load polls and (feature `kv-events`) the KV event
//! subscriptions following the pools.

use super::Router;
use std::sync::Arc;
use worker_lifecycle::{RoleKind, Worker};

/// The router's background tasks; dropping this stops them.
#[derive(Debug)]
#[must_use = "the background tasks stop when this is dropped"]
pub struct BackgroundTasks {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for BackgroundTasks {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Router {
    /// Starts the router's background work: health checks of every worker
    /// (never touching load), the periodic cache-tree eviction and, unless
    /// it is off, the polling of every engine for its load
    /// ([`crate::load_poll`]). The tasks stop when the returned handle is
    /// dropped (and the engines' reports are withdrawn then).
    pub fn spawn_background(&self) -> BackgroundTasks {
        let shared = Arc::clone(&self.shared);
        let probe =
            crate::probe::HttpProbe::new(shared.client.clone(), &shared.config.health_endpoint);
        let checker = Arc::new(worker_lifecycle::HealthChecker::new(
            probe,
            shared.config.health.clone(),
        ));
        let router = self.clone();
        let health = checker.spawn(move || Arc::from(router.all_workers()));
        let evictor = Arc::clone(&shared);
        let eviction = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(evictor.config.eviction_interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                // Inserts keep the trees within their limits; this fallback
                // reaches trees nobody inserts into. Bounded work, but off
                // the runtime's threads all the same.
                let shared = Arc::clone(&evictor);
                let upkeep = tokio::task::spawn_blocking(move || {
                    shared.pool.policies().maintain();
                    if let Some(pd) = &shared.pd {
                        pd.pools().prefill().policies().maintain();
                        pd.pools().decode().policies().maintain();
                    }
                });
                if let Err(err) = upkeep.await {
                    tracing::error!(error = %err, "prefix tree upkeep failed");
                }
            }
        });
        let mut tasks = vec![health, eviction];
        if let Some(polls) = &shared.load_poll {
            let router = self.clone();
            let members = move || {
                router
                    .workers_of(&[RoleKind::Regular, RoleKind::Prefill, RoleKind::Decode])
                    .unwrap_or_else(|| router.all_workers())
            };
            tasks.push(crate::load_poll::spawn(
                Arc::clone(polls),
                self.client().clone(),
                members,
            ));
        }
        if let Some(peers) = shared
            .peers
            .as_ref()
            .filter(|p| !p.config().urls.is_empty())
        {
            tasks.push(crate::peers::spawn(
                Arc::clone(peers),
                self.client().clone(),
            ));
        }
        // Nothing without the `kv-events` feature (the hub type is then
        // uninhabited).
        if let Some(hub) = &shared.kv {
            let router = self.clone();
            let members = move |roles: &[RoleKind]| router.workers_of(roles);
            tasks.push(crate::kv_wiring::spawn_sync(
                hub,
                self.client().clone(),
                members,
            ));
        }
        BackgroundTasks { tasks }
    }

    /// The current workers of `roles`, each pool reconciled first so that
    /// discovered workers are current; `None` when a pool could not be
    /// refreshed (the caller keeps what it knew).
    fn workers_of(&self, roles: &[RoleKind]) -> Option<Vec<Arc<Worker>>> {
        let mut workers = Vec::new();
        for &role in roles {
            let pool = match (role, self.pd()) {
                (RoleKind::Regular, _) => self.pool(),
                (_, Some(pd)) => pd.role(role).pool(),
                (_, None) => continue,
            };
            workers.extend(pool.refresh().ok()?.iter().cloned());
        }
        Some(workers)
    }
}
