//! Static worker sets: workers from flags or admin calls.
//!
//! They use the same [`Worker`] type and the same [`MembershipEvent`]s as
//! discovery pools, so every policy sees one kind of worker. Each add of an
//! endpoint is a new lifetime with its own generation.

use std::sync::Arc;

use crate::breaker::BreakerConfigError;
use crate::membership::MembershipEvent;
use crate::sync::Mutex;
use crate::worker::{Endpoint, RoleKind, Worker, WorkerOptions, WorkerSpec};

/// A refused static-set operation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StaticSetError {
    /// The worker's role does not match the set's role.
    #[error("a {set} worker set cannot hold a {worker} worker")]
    RoleMismatch {
        /// The set's role.
        set: RoleKind,
        /// The worker's role.
        worker: RoleKind,
    },
    /// The endpoint is already in the set (use `replace`).
    #[error("endpoint {0} is already in the set")]
    Duplicate(String),
    /// The endpoint is not in the set.
    #[error("endpoint {0} is not in the set")]
    NotFound(String),
    /// The breaker settings are invalid.
    #[error(transparent)]
    Config(#[from] BreakerConfigError),
}

#[derive(Debug)]
struct Inner {
    list: Arc<[Arc<Worker>]>,
    next_generation: u64,
}

/// A role's workers managed by hand.
#[derive(Debug)]
pub struct StaticWorkerSet {
    role: RoleKind,
    options: WorkerOptions,
    inner: Mutex<Inner>,
}

impl StaticWorkerSet {
    /// An empty set for `role`.
    pub fn new(role: RoleKind, options: WorkerOptions) -> Result<Self, StaticSetError> {
        options.breaker.validate()?;
        Ok(Self {
            role,
            options,
            inner: Mutex::new(Inner {
                list: Arc::from(Vec::new()),
                next_generation: 1,
            }),
        })
    }

    /// The role.
    pub fn role(&self) -> RoleKind {
        self.role
    }

    /// The workers, in insertion order. A cheap shared handle.
    pub fn workers(&self) -> Arc<[Arc<Worker>]> {
        self.inner.lock().list.clone()
    }

    /// The worker at `endpoint`, if any.
    pub fn get(&self, endpoint: &Endpoint) -> Option<Arc<Worker>> {
        self.inner
            .lock()
            .list
            .iter()
            .find(|w| w.endpoint() == endpoint)
            .cloned()
    }

    fn check_role(&self, spec: &WorkerSpec) -> Result<(), StaticSetError> {
        if spec.role.kind() != self.role {
            return Err(StaticSetError::RoleMismatch {
                set: self.role,
                worker: spec.role.kind(),
            });
        }
        Ok(())
    }

    /// Adds a worker (a new lifetime with a new generation).
    pub fn add(&self, spec: WorkerSpec) -> Result<MembershipEvent, StaticSetError> {
        self.check_role(&spec)?;
        let mut inner = self.inner.lock();
        if inner.list.iter().any(|w| w.endpoint() == &spec.endpoint) {
            return Err(StaticSetError::Duplicate(spec.endpoint.to_string()));
        }
        let generation = inner.next_generation;
        inner.next_generation += 1;
        let worker = Worker::new(spec, generation, &self.options);
        let mut list = inner.list.to_vec();
        list.push(worker.clone());
        inner.list = list.into();
        Ok(MembershipEvent::Added(worker))
    }

    /// Replaces the worker at the spec's endpoint with a fresh lifetime
    /// (new generation, fresh state). The old worker is marked removed; its
    /// in-flight guards finish on it.
    pub fn replace(&self, spec: WorkerSpec) -> Result<MembershipEvent, StaticSetError> {
        self.check_role(&spec)?;
        let mut inner = self.inner.lock();
        let Some(index) = inner
            .list
            .iter()
            .position(|w| w.endpoint() == &spec.endpoint)
        else {
            return Err(StaticSetError::NotFound(spec.endpoint.to_string()));
        };
        let generation = inner.next_generation;
        inner.next_generation += 1;
        let new = Worker::new(spec, generation, &self.options);
        let mut list = inner.list.to_vec();
        let old = std::mem::replace(&mut list[index], new.clone());
        inner.list = list.into();
        drop(inner);
        old.mark_removed();
        Ok(MembershipEvent::Replaced { old, new })
    }

    /// Removes the worker at `endpoint` now (in-flight guards stay valid).
    pub fn remove(&self, endpoint: &Endpoint) -> Result<MembershipEvent, StaticSetError> {
        let mut inner = self.inner.lock();
        let Some(index) = inner.list.iter().position(|w| w.endpoint() == endpoint) else {
            return Err(StaticSetError::NotFound(endpoint.to_string()));
        };
        let mut list = inner.list.to_vec();
        let old = list.remove(index);
        inner.list = list.into();
        drop(inner);
        old.mark_removed();
        Ok(MembershipEvent::Removed(old))
    }

    /// Removes exactly this worker object if it is still a member (a drain
    /// finishing must not remove a replacement that took its place).
    pub fn remove_worker(&self, worker: &Arc<Worker>) -> Option<MembershipEvent> {
        let mut inner = self.inner.lock();
        let index = inner.list.iter().position(|w| Arc::ptr_eq(w, worker))?;
        let mut list = inner.list.to_vec();
        let old = list.remove(index);
        inner.list = list.into();
        drop(inner);
        old.mark_removed();
        Some(MembershipEvent::Removed(old))
    }
}
