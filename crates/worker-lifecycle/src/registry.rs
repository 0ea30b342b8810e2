//! The service registry: who is registered, in which lifetime.
//!
//! Workers register themselves (or are registered by an operator) per role.
//! Every registration lifetime has a **generation**, unique within the
//! registry: a heartbeat or repeated registration from a live entry keeps
//! its generation; a registration after the entry expired — including an
//! entry that has expired but has not been swept yet — starts a new one.
//! Generation allocation and insertion happen in one critical section under
//! the registry's lock, so two racing registrations of one endpoint cannot
//! both start lifetimes.
//!
//! The registry does no I/O and reads no clock: every call takes `now`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64 as StdAtomicU64, Ordering as StdOrdering};
use std::time::{Duration, Instant};

use crate::sync::Mutex;
use crate::worker::{Endpoint, RoleKind};

/// What a worker says about itself when it registers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registration {
    /// The model it serves.
    pub model_id: Option<String>,
    /// KV bootstrap port (prefill workers).
    pub bootstrap_port: Option<u16>,
    /// Free-form labels.
    pub labels: BTreeMap<String, String>,
    /// An id of the worker process, if it has one. A registration whose
    /// instance id differs from the live entry's is a restart at the same
    /// address and starts a new generation even before the old entry expires.
    pub instance_id: Option<String>,
}

/// What [`ServiceRegistry::register`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterOutcome {
    /// The registration generation now live for the endpoint.
    pub generation: u64,
    /// Whether this call started a new lifetime (false: refreshed a live one).
    pub new_lifetime: bool,
}

/// A refused registry call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// No entry for this endpoint.
    #[error("endpoint {0} is not registered")]
    Unknown(String),
    /// The entry expired; the worker must register again (and will get a new
    /// generation).
    #[error("registration of {0} expired")]
    Expired(String),
    /// The heartbeat names a generation that is not the live one.
    #[error("endpoint {endpoint} is at generation {live}, not {claimed}")]
    StaleGeneration {
        /// The endpoint.
        endpoint: String,
        /// The generation the heartbeat claimed.
        claimed: u64,
        /// The live generation.
        live: u64,
    },
}

/// One live entry of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotEntry {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// Its registration generation.
    pub generation: u64,
    /// What it registered with.
    pub registration: Arc<Registration>,
}

/// The live entries of one role's registry at one moment, sorted by
/// endpoint, with the registry's identity and version so that a pool can
/// refuse to apply an older snapshot after a newer one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistrySnapshot {
    /// The role.
    pub role: RoleKind,
    /// Identity of the registry that produced it.
    pub registry_id: u64,
    /// Registry version (bumped by every change) when it was taken.
    pub version: u64,
    /// The `now` it was taken at; entries expired at that time are excluded.
    pub taken_at: Instant,
    /// The earliest time at which one of the entries expires (as known
    /// when the snapshot was taken; heartbeats only move it later).
    pub next_expiry: Option<Instant>,
    /// The live entries, sorted by endpoint.
    pub entries: Vec<SnapshotEntry>,
}

#[derive(Debug)]
struct Entry {
    generation: u64,
    expires_at: Instant,
    registration: Arc<Registration>,
}

#[derive(Debug)]
struct Inner {
    entries: HashMap<Endpoint, Entry>,
    next_generation: u64,
    version: u64,
}

/// One role's registry.
#[derive(Debug)]
pub struct ServiceRegistry {
    role: RoleKind,
    ttl: Duration,
    id: u64,
    inner: Mutex<Inner>,
}

static NEXT_REGISTRY_ID: StdAtomicU64 = StdAtomicU64::new(1);

impl ServiceRegistry {
    /// An empty registry for `role` whose entries live `ttl` after their
    /// last registration or heartbeat.
    pub fn new(role: RoleKind, ttl: Duration) -> Self {
        Self {
            role,
            ttl,
            id: NEXT_REGISTRY_ID.fetch_add(1, StdOrdering::Relaxed),
            inner: Mutex::new(Inner {
                entries: HashMap::new(),
                next_generation: 1,
                version: 0,
            }),
        }
    }

    /// The role.
    pub fn role(&self) -> RoleKind {
        self.role
    }

    /// The time-to-live of an entry.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Registers `endpoint` at `now`. A live entry (not expired at `now`)
    /// registered with the same [`Registration`] is refreshed and keeps its
    /// generation. An absent or expired entry starts a new generation, and
    /// so does a different registration (another instance id, model, port
    /// or labels): the worker's identity changed, so it is a new lifetime
    /// with fresh state.
    pub fn register(
        &self,
        endpoint: Endpoint,
        registration: Registration,
        now: Instant,
    ) -> RegisterOutcome {
        let expires_at = now + self.ttl;
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        if let Some(entry) = inner.entries.get_mut(&endpoint) {
            let live = now < entry.expires_at;
            if live && *entry.registration == registration {
                entry.expires_at = expires_at;
                return RegisterOutcome {
                    generation: entry.generation,
                    new_lifetime: false,
                };
            }
        }
        inner.version += 1;
        let generation = inner.next_generation;
        inner.next_generation += 1;
        inner.entries.insert(
            endpoint,
            Entry {
                generation,
                expires_at,
                registration: Arc::new(registration),
            },
        );
        RegisterOutcome {
            generation,
            new_lifetime: true,
        }
    }

    /// Keeps a live registration alive. `generation`, when given, must be the
    /// live one (a heartbeat from a previous lifetime is refused). An expired
    /// entry is refused even if not yet swept: the worker must register again.
    pub fn heartbeat(
        &self,
        endpoint: &Endpoint,
        generation: Option<u64>,
        now: Instant,
    ) -> Result<u64, RegistryError> {
        let mut inner = self.inner.lock();
        let ttl = self.ttl;
        let entry = inner
            .entries
            .get_mut(endpoint)
            .ok_or_else(|| RegistryError::Unknown(endpoint.to_string()))?;
        if now >= entry.expires_at {
            return Err(RegistryError::Expired(endpoint.to_string()));
        }
        if let Some(claimed) = generation
            && claimed != entry.generation
        {
            return Err(RegistryError::StaleGeneration {
                endpoint: endpoint.to_string(),
                claimed,
                live: entry.generation,
            });
        }
        // Extending a lifetime changes no membership, so the version stays.
        entry.expires_at = now + ttl;
        Ok(entry.generation)
    }

    /// Removes `endpoint` now (a clean shutdown). Returns the generation
    /// removed, if there was an entry.
    pub fn deregister(&self, endpoint: &Endpoint) -> Option<u64> {
        let mut inner = self.inner.lock();
        let removed = inner.entries.remove(endpoint).map(|e| e.generation);
        if removed.is_some() {
            inner.version += 1;
        }
        removed
    }

    /// Removes `endpoint` only if its live generation is `generation`, so a
    /// late deregistration cannot remove the next lifetime. Returns whether
    /// it removed something.
    pub fn deregister_generation(&self, endpoint: &Endpoint, generation: u64) -> bool {
        let mut inner = self.inner.lock();
        if inner.entries.get(endpoint).map(|e| e.generation) != Some(generation) {
            return false;
        }
        inner.entries.remove(endpoint);
        inner.version += 1;
        true
    }

    /// Drops every entry expired at `now`; returns them with their
    /// generations, sorted by endpoint.
    pub fn sweep(&self, now: Instant) -> Vec<(Endpoint, u64)> {
        let mut inner = self.inner.lock();
        let mut removed = Vec::new();
        inner.entries.retain(|endpoint, entry| {
            let live = now < entry.expires_at;
            if !live {
                removed.push((endpoint.clone(), entry.generation));
            }
            live
        });
        if !removed.is_empty() {
            inner.version += 1;
        }
        removed.sort();
        removed
    }

    /// The entries live at `now`, sorted by endpoint.
    pub fn snapshot(&self, now: Instant) -> RegistrySnapshot {
        let inner = self.inner.lock();
        self.snapshot_locked(&inner, now)
    }

    /// A snapshot at `now` unless nothing can have changed since a snapshot
    /// of `version` whose earliest expiry was `next_expiry`: the version is
    /// the same and no entry has expired since. Lets a pool skip the copy on
    /// the request path when membership is steady.
    pub fn snapshot_if_changed(
        &self,
        version: u64,
        next_expiry: Option<Instant>,
        now: Instant,
    ) -> Option<RegistrySnapshot> {
        let inner = self.inner.lock();
        let expired_since = next_expiry.is_some_and(|at| now >= at);
        if inner.version == version && !expired_since {
            return None;
        }
        Some(self.snapshot_locked(&inner, now))
    }

    fn snapshot_locked(&self, inner: &Inner, now: Instant) -> RegistrySnapshot {
        let mut entries: Vec<SnapshotEntry> = inner
            .entries
            .iter()
            .filter(|(_, e)| now < e.expires_at)
            .map(|(endpoint, e)| SnapshotEntry {
                endpoint: endpoint.clone(),
                generation: e.generation,
                registration: e.registration.clone(),
            })
            .collect();
        let version = inner.version;
        let next_expiry = inner
            .entries
            .values()
            .map(|e| e.expires_at)
            .filter(|&at| now < at)
            .min();
        entries.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
        RegistrySnapshot {
            role: self.role,
            registry_id: self.id,
            version,
            taken_at: now,
            next_expiry,
            entries,
        }
    }

    /// Entries held, including expired ones not yet swept.
    pub fn len(&self) -> usize {
        self.inner.lock().entries.len()
    }

    /// Whether no entries are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
