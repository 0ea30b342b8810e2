//! Discovery pools: one persistent `Arc<Worker>` per (endpoint, generation).
//!
//! A [`DiscoveryPool`] holds the workers of one role. Applying a registry
//! snapshot ([`DiscoveryPool::reconcile`]) keeps the same `Arc<Worker>` for
//! every endpoint whose generation is unchanged, builds a fresh worker for a
//! new endpoint or a new generation, and marks departed workers
//! [`Removed`](crate::Lifecycle::Removed) — reporting each change as a
//! [`MembershipEvent`].
//!
//! # The serialized step
//!
//! [`DiscoveryPool::with_reconciled`] is the one way the request path should
//! use a pool: under the pool's lock it reads the registry, reconciles,
//! hands the caller the current workers and the events of this step, and
//! lets the caller select and reserve — then unlocks. Because reading the
//! snapshot happens *inside* the pool's critical section, a request that
//! read an old snapshot can never install it after a newer one, and a
//! worker handed out by the step is a member of the registry state read in
//! that same step. The closure is synchronous, so no lock is held across an
//! `.await`; it must not block.
//!
//! Prefill and decode are separate pools (and separate registries), so the
//! same URL in both roles is two workers with two loads.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crate::breaker::BreakerConfigError;
use crate::membership::MembershipEvent;
use crate::registry::{RegistrySnapshot, ServiceRegistry, SnapshotEntry};
use crate::sync::Mutex;
use crate::worker::{Endpoint, RoleKind, Worker, WorkerOptions, WorkerRole, WorkerSpec};

/// A refused pool operation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The snapshot or registry belongs to another role.
    #[error("pool for role {pool} cannot apply a {snapshot} snapshot")]
    RoleMismatch {
        /// The pool's role.
        pool: RoleKind,
        /// The snapshot's role.
        snapshot: RoleKind,
    },
    /// The snapshot is older than one already applied.
    #[error("snapshot version {snapshot} is older than applied version {applied}")]
    StaleSnapshot {
        /// The refused snapshot's version.
        snapshot: u64,
        /// The version already applied.
        applied: u64,
    },
    /// The snapshot comes from a different registry than the one the pool
    /// follows.
    #[error("snapshot comes from another registry")]
    ForeignRegistry,
    /// The breaker settings are invalid.
    #[error(transparent)]
    Config(#[from] BreakerConfigError),
}

/// What the closure of [`DiscoveryPool::with_reconciled`] sees.
#[derive(Debug)]
pub struct PoolView<'a> {
    workers: &'a Arc<[Arc<Worker>]>,
    events: &'a [MembershipEvent],
}

impl<'a> PoolView<'a> {
    /// The pool's workers after this step's reconciliation, sorted by
    /// endpoint. Includes unavailable ones; filter with
    /// [`Worker::is_available`].
    pub fn workers(&self) -> &'a [Arc<Worker>] {
        self.workers
    }

    /// The same list as a cheap shared handle.
    pub fn workers_arc(&self) -> Arc<[Arc<Worker>]> {
        self.workers.clone()
    }

    /// Membership changes made by this step (usually none). Forward them to
    /// the policies before selecting.
    pub fn events(&self) -> &'a [MembershipEvent] {
        self.events
    }
}

#[derive(Debug)]
struct Inner {
    by_endpoint: HashMap<Endpoint, Arc<Worker>>,
    list: Arc<[Arc<Worker>]>,
    registry_id: Option<u64>,
    applied: Option<(u64, Instant)>,
    next_expiry: Option<Instant>,
}

/// The workers of one role discovered through a [`ServiceRegistry`].
#[derive(Debug)]
pub struct DiscoveryPool {
    role: RoleKind,
    options: WorkerOptions,
    inner: Mutex<Inner>,
}

impl DiscoveryPool {
    /// An empty pool for `role`; its workers are built with `options`.
    pub fn new(role: RoleKind, options: WorkerOptions) -> Result<Self, PoolError> {
        options.breaker.validate()?;
        Ok(Self {
            role,
            options,
            inner: Mutex::new(Inner {
                by_endpoint: HashMap::new(),
                list: Arc::from(Vec::new()),
                registry_id: None,
                applied: None,
                next_expiry: None,
            }),
        })
    }

    /// The role.
    pub fn role(&self) -> RoleKind {
        self.role
    }

    /// The current workers (as of the last reconciliation), without
    /// reconciling.
    pub fn workers(&self) -> Arc<[Arc<Worker>]> {
        self.inner.lock().list.clone()
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.inner.lock().list.len()
    }

    /// Whether the pool has no workers.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The worker for `endpoint`, if it is a member.
    pub fn get(&self, endpoint: &Endpoint) -> Option<Arc<Worker>> {
        self.inner.lock().by_endpoint.get(endpoint).cloned()
    }

    /// Applies `snapshot` and returns the membership changes. Refuses a
    /// snapshot of another role or registry, or one older than a snapshot
    /// already applied (by version, then time).
    pub fn reconcile(
        &self,
        snapshot: &RegistrySnapshot,
    ) -> Result<Vec<MembershipEvent>, PoolError> {
        let mut inner = self.inner.lock();
        self.apply(&mut inner, snapshot)
    }

    /// The serialized step: lock the pool, read `registry` at `now`,
    /// reconcile, run `select` on the result, unlock. See the module docs.
    /// `select` runs under the pool's lock: keep it short and never block.
    pub fn with_reconciled<R>(
        &self,
        registry: &ServiceRegistry,
        now: Instant,
        select: impl FnOnce(PoolView<'_>) -> R,
    ) -> Result<R, PoolError> {
        if registry.role() != self.role {
            return Err(PoolError::RoleMismatch {
                pool: self.role,
                snapshot: registry.role(),
            });
        }
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        // Callers read their clock before waiting for the lock; a caller that
        // waited behind a later one must not look like a step back in time.
        let now = match inner.applied {
            Some((_, taken_at)) => now.max(taken_at),
            None => now,
        };
        let changed = match (inner.registry_id, inner.applied) {
            (Some(_), Some((version, _))) => {
                registry.snapshot_if_changed(version, inner.next_expiry, now)
            }
            _ => Some(registry.snapshot(now)),
        };
        let events = match changed {
            Some(snapshot) => self.apply(inner, &snapshot)?,
            None => Vec::new(),
        };
        Ok(select(PoolView {
            workers: &inner.list,
            events: &events,
        }))
    }

    fn apply(
        &self,
        inner: &mut Inner,
        snapshot: &RegistrySnapshot,
    ) -> Result<Vec<MembershipEvent>, PoolError> {
        if snapshot.role != self.role {
            return Err(PoolError::RoleMismatch {
                pool: self.role,
                snapshot: snapshot.role,
            });
        }
        match inner.registry_id {
            Some(id) if id != snapshot.registry_id => return Err(PoolError::ForeignRegistry),
            _ => {}
        }
        if let Some((version, taken_at)) = inner.applied
            && (snapshot.version, snapshot.taken_at) < (version, taken_at)
        {
            return Err(PoolError::StaleSnapshot {
                snapshot: snapshot.version,
                applied: version,
            });
        }
        inner.registry_id = Some(snapshot.registry_id);
        inner.applied = Some((snapshot.version, snapshot.taken_at));
        inner.next_expiry = snapshot.next_expiry;

        let mut events = Vec::new();
        let mut next: HashMap<Endpoint, Arc<Worker>> =
            HashMap::with_capacity(snapshot.entries.len());
        for entry in &snapshot.entries {
            let worker = match inner.by_endpoint.remove(&entry.endpoint) {
                Some(existing) if existing.generation() == entry.generation => existing,
                Some(old) => {
                    let new = self.build(entry);
                    old.mark_removed();
                    events.push(MembershipEvent::Replaced {
                        old,
                        new: new.clone(),
                    });
                    new
                }
                None => {
                    let new = self.build(entry);
                    events.push(MembershipEvent::Added(new.clone()));
                    new
                }
            };
            next.insert(entry.endpoint.clone(), worker);
        }
        let mut departed: Vec<Arc<Worker>> = inner.by_endpoint.drain().map(|(_, w)| w).collect();
        departed.sort_by(|a, b| a.endpoint().cmp(b.endpoint()));
        for old in departed {
            old.mark_removed();
            events.push(MembershipEvent::Removed(old));
        }
        inner.by_endpoint = next;
        if !events.is_empty() {
            // Snapshot entries are sorted by endpoint, so the list is too.
            inner.list = snapshot
                .entries
                .iter()
                .filter_map(|e| inner.by_endpoint.get(&e.endpoint).cloned())
                .collect();
        }
        Ok(events)
    }

    fn build(&self, entry: &SnapshotEntry) -> Arc<Worker> {
        let role = match self.role {
            RoleKind::Regular => WorkerRole::Regular,
            RoleKind::Prefill => WorkerRole::Prefill {
                bootstrap_port: entry.registration.bootstrap_port,
            },
            RoleKind::Decode => WorkerRole::Decode,
        };
        let spec = WorkerSpec {
            role,
            endpoint: entry.endpoint.clone(),
            model_id: entry.registration.model_id.clone(),
            labels: entry.registration.labels.clone(),
        };
        Worker::new(spec, entry.generation, &self.options)
    }
}
