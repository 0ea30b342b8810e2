//! Soft session affinity with an idle TTL: which worker each session's
//! last request went to, so the next one can follow it
//! (`kv_aware`'s `session_affinity_ttl`, vllm-router's
//! `--kv-aware-session-affinity-ttl-secs`).
//!
//! A session is the request's hash key ([`HashKeys::first`]: the session
//! header, else the OpenAI `user` field, else the operator's header). A
//! binding lives while the session keeps sending: each request refreshes
//! it, and one idle for longer than the TTL is forgotten (dropped on its
//! next look-up, or by the host's upkeep timer through
//! [`PolicyState::maintain`]).
//!
//! The table is bounded: at most [`MAX_SESSIONS`] bindings, in 16 shards
//! behind their own mutexes (a look-up or a bind holds one for a hash-map
//! operation). A new session that finds its shard full is not bound (its
//! requests are placed by cost alone), counted (`KvAware::session_stats`),
//! rather than evicting a live one: affinity is a preference, so losing
//! it for new sessions is the cheap failure, and upkeep frees room as
//! sessions go idle. Keys are hashed with a per-process random SipHash
//! key, so a client cannot aim many sessions at one shard.
//!
//! [`HashKeys::first`]: crate::HashKeys::first
//! [`PolicyState::maintain`]: crate::PolicyState::maintain

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::sync::{AtomicU64, Mutex, Ordering};

/// Most sessions one table binds at once: 262,144, some 20 MiB at most.
pub const MAX_SESSIONS: usize = 1 << 18;

const SHARDS: usize = 16;

/// Where a session's last request went, and when.
#[derive(Debug)]
struct Binding {
    worker: Arc<str>,
    last_used: Instant,
}

/// The session table (see the [module docs](self)).
#[derive(Debug)]
pub(crate) struct SessionTable {
    ttl: Duration,
    hasher: RandomState,
    shards: Box<[Mutex<HashMap<u64, Binding>>]>,
    per_shard: usize,
    refused: AtomicU64,
}

impl SessionTable {
    /// An empty table whose bindings live `ttl` past their last use.
    pub(crate) fn new(ttl: Duration) -> Self {
        SessionTable::with_capacity(ttl, MAX_SESSIONS)
    }

    /// An empty table of at most about `sessions` bindings.
    pub(crate) fn with_capacity(ttl: Duration, sessions: usize) -> Self {
        SessionTable {
            ttl,
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: sessions.div_ceil(SHARDS).max(1),
            refused: AtomicU64::new(0),
        }
    }

    fn shard(&self, session: &str) -> (u64, &Mutex<HashMap<u64, Binding>>) {
        let hash = self.hasher.hash_one(session);
        (hash, &self.shards[(hash % SHARDS as u64) as usize])
    }

    /// The worker `session` is bound to, if its binding is not idle past
    /// the TTL at `now` (an expired one is dropped).
    pub(crate) fn worker(&self, session: &str, now: Instant) -> Option<Arc<str>> {
        let (hash, shard) = self.shard(session);
        let mut shard = shard.lock();
        let binding = shard.get(&hash)?;
        if now.saturating_duration_since(binding.last_used) > self.ttl {
            shard.remove(&hash);
            return None;
        }
        Some(Arc::clone(&binding.worker))
    }

    /// Binds `session` to `worker` as of `now` (refreshing the binding;
    /// allocates only when the worker changes). A new session whose shard
    /// is full is refused and counted.
    pub(crate) fn bind(&self, session: &str, worker: &str, now: Instant) {
        let (hash, shard) = self.shard(session);
        let mut shard = shard.lock();
        if let Some(binding) = shard.get_mut(&hash) {
            if &*binding.worker != worker {
                binding.worker = Arc::from(worker);
            }
            binding.last_used = now;
            return;
        }
        if shard.len() >= self.per_shard {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        shard.insert(
            hash,
            Binding {
                worker: Arc::from(worker),
                last_used: now,
            },
        );
    }

    /// Drops every binding idle past the TTL at `now`, one shard at a time.
    pub(crate) fn prune(&self, now: Instant) {
        for shard in self.shards.iter() {
            shard
                .lock()
                .retain(|_, b| now.saturating_duration_since(b.last_used) <= self.ttl);
        }
    }

    /// Sessions bound now (expired ones not yet pruned included).
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// New sessions not bound because the table was full.
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_binding_follows_the_last_worker_and_expires_when_idle_past_the_ttl() {
        let table = SessionTable::new(Duration::from_secs(60));
        let t0 = Instant::now();
        assert_eq!(table.worker("alice", t0), None);
        table.bind("alice", "http://w1", t0);
        assert_eq!(table.worker("alice", t0).as_deref(), Some("http://w1"));
        // Used again at 50 s: alive until 110 s.
        table.bind("alice", "http://w2", t0 + Duration::from_secs(50));
        let at = |s| t0 + Duration::from_secs(s);
        assert_eq!(table.worker("alice", at(100)).as_deref(), Some("http://w2"));
        assert_eq!(table.worker("bob", at(100)), None);
        // Idle 61 s: gone, and dropped from the table.
        assert_eq!(table.worker("alice", at(111)), None);
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn upkeep_drops_idle_bindings_and_a_full_table_refuses_new_sessions() {
        let table = SessionTable::with_capacity(Duration::from_secs(10), SHARDS);
        let t0 = Instant::now();
        // One binding per shard at most: bind until some are refused.
        for i in 0..200 {
            table.bind(&format!("s{i}"), "http://w", t0);
        }
        assert_eq!(table.len(), SHARDS);
        assert_eq!(table.refused(), 200 - SHARDS as u64);
        // A bound session is still refreshed when the table is full.
        let bound = (0..200)
            .map(|i| format!("s{i}"))
            .find(|s| table.worker(s, t0).is_some())
            .expect("one bound");
        table.bind(&bound, "http://v", t0 + Duration::from_secs(8));
        table.prune(t0 + Duration::from_secs(15));
        assert_eq!(table.len(), 1);
        assert_eq!(
            table
                .worker(&bound, t0 + Duration::from_secs(15))
                .as_deref(),
            Some("http://v")
        );
    }
}
