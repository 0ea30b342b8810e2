//! Load-balancing policies over any backend type.
//!
//! Random, round robin, power of two choices, least loaded, consistent
//! hash, rendezvous hash and cache-aware (prefix affinity with a
//! per-request load gate and fair ties), over any worker type that
//! implements the small [`Backend`] trait: a stable key, in-flight load,
//! processed-request count and availability. The crate pulls in neither
//! hyper nor tokio and spawns no threads.
//!
//! # Example: a custom backend type
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use lb_policies::{Backend, DecisionReason, MembershipEvent, Policy, PolicyConfig,
//!                   PolicyRegistry, RequestContext};
//!
//! /// The proxy's own worker type.
//! struct Upstream {
//!     url: String,
//!     in_flight: AtomicUsize,
//!     healthy: bool,
//! }
//!
//! impl Backend for Upstream {
//!     fn key(&self) -> &str { &self.url }
//!     fn load(&self) -> usize { self.in_flight.load(Ordering::Relaxed) }
//!     fn processed(&self) -> u64 { 0 }
//!     fn is_available(&self) -> bool { self.healthy }
//! }
//!
//! let fleet: Vec<Upstream> = (0..3)
//!     .map(|i| Upstream { url: format!("http://w{i}:8000"), in_flight: AtomicUsize::new(0), healthy: true })
//!     .collect();
//!
//! // One cache-aware policy per model, told about the fleet.
//! let registry = PolicyRegistry::<&Upstream>::new(PolicyConfig::named("cache_aware"))?;
//! for w in &fleet {
//!     registry.on_membership(MembershipEvent::Added { key: &w.url });
//! }
//! let candidates: Vec<&Upstream> = fleet.iter().collect();
//!
//! let prompt = "You are a helpful assistant. Summarise the following report ...";
//! let ctx = RequestContext::new("llama").with_text(prompt);
//! let first = registry.select(&candidates, &ctx)?.expect("a worker is available");
//! assert_eq!(first.reason, DecisionReason::CacheLowMatch); // cold: least loaded
//!
//! // The same prompt again goes where its prefix now lives.
//! let again = registry.select(&candidates, &ctx)?.expect("a worker is available");
//! assert_eq!((again.index, again.reason), (first.index, DecisionReason::CacheHit));
//!
//! // Decisions are counted per reason, for metrics.
//! let counts = registry.policy("llama")?.counts();
//! assert_eq!(counts.get(DecisionReason::CacheHit), 1);
//! # Ok::<(), lb_policies::PolicyError>(())
//! ```
//!
//! # The pieces
//!
//! * [`Backend`]: what a policy reads from a worker. Implemented for `&T`,
//!   `Box<T>` and `Arc<T>`; [`BasicBackend`] is a ready-made one.
//! * [`Policy`]: `select(candidates, ctx) -> Option<Decision>`, and its
//!   backend-independent half [`PolicyState`]: `name`,
//!   [`on_membership`](PolicyState::on_membership) and
//!   [`maintain`](PolicyState::maintain). A [`Decision`] is an index into
//!   the candidate slice and a [`DecisionReason`].
//! * [`RequestContext`]: model, routing text or tokens, hash keys
//!   ([`HashKeys`]: session, then user, then a configured header), request id.
//! * [`PolicyRegistry`]: one instance per model, built by name
//!   ([`BUILTIN_POLICIES`]) or by a registered factory, counted with
//!   [`Counted`].
//!
//! * `KvAware` (feature `kv-block-index`): cache-aware placement scored on the
//!   blocks engines report holding through their KV events (a
//!   `kv_block_index::KvIndex` the host feeds), with the approximate tree as the
//!   fallback for workers without a live event stream (`KvStreams`).
//!   Built by the registry as `kv_aware` once the host sets
//!   `PolicyConfig::with_kv` ([`INDEX_POLICIES`]).
//!
//! `docs/policies.md` in the repository explains each policy, its knobs and
//! when to use which.
//!
//! # Feature flags
//!
//! * `serde`: (de)serialize the configuration structs.
//! * `kv-block-index` (off by default): the `kv_aware` policy, `KvStreams` and
//!   `KvSources`; pulls in the `kv-block-index` crate (pure Rust, no
//!   transport).
//!
//! # Concurrency
//!
//! Every policy takes `&self` and is `Send + Sync`. Counters, rotations and
//! random state are relaxed atomics; the consistent-hash ring is swapped
//! whole on membership change; cache-aware's trees are concurrent
//! (`radix-affinity`) and its member tables are read-locked per decision
//! and write-locked only by membership events. No policy blocks on I/O or
//! runs a timer: periodic work ([`CacheAware::evict`]) is called by the
//! host.
//!
//! # Allocation
//!
//! Random, round robin, power of two, least loaded, consistent hash and
//! rendezvous hash allocate nothing per decision (checked by a counting
//! allocator in `tests/no_alloc.rs`). Cache-aware allocates only inside the
//! tree when it records a new prefix; so does kv-aware, whose block hashes
//! and index lookup use reused thread-local buffers (a repeated exact hit
//! allocates nothing, also checked there).
#![warn(missing_docs)]

mod backend;
mod context;
mod decision;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod hash;
mod membership;
pub mod policies;
mod policy;
mod registry;
mod rng;
mod sync;

pub use backend::{Backend, BasicBackend};
pub use context::{
    HashKeySource, HashKeys, OwnedContext, RequestContext, RoutingInput, RoutingInputBuf,
};
pub use decision::{Decision, DecisionCounters, DecisionCounts, DecisionReason};
pub use error::PolicyError;
pub use membership::MembershipEvent;
pub use policies::cache_aware::{
    CHAT_ROLE_ROOTS, CacheAware, CacheAwareConfig, DEFAULT_MAX_TREE_BYTES, LoadGate, TokenChoice,
};
pub use policies::consistent_hash::{ConsistentHash, ConsistentHashConfig};
pub use policies::cost::{
    CostModel, DEFAULT_EVICTION_WEIGHT, DEFAULT_HOST_PENALTY, DEFAULT_LOAD_WEIGHT,
    DEFAULT_LOWER_PENALTY, DEFAULT_OVERLOAD_ENTER, DEFAULT_OVERLOAD_LEAVE, LowerPrefix,
    PRESSURE_FROM, TierPenalties, pressure,
};
#[cfg(feature = "kv-block-index")]
pub use policies::kv_aware::{KvAware, KvSources, KvStreams};
pub use policies::least_loaded::LeastLoaded;
pub use policies::power_of_two::{LoadSource, PowerOfTwo};
pub use policies::random::RandomPolicy;
pub use policies::rendezvous::RendezvousHash;
pub use policies::round_robin::RoundRobin;
pub use policy::{Counted, Policy, PolicyState, TreeStats};
pub use radix_affinity::MemoryBudget;
pub use registry::{
    BUILTIN_POLICIES, DEFAULT_MAX_MODELS, INDEX_POLICIES, ModelPolicy, PolicyConfig, PolicyFactory,
    PolicyRegistry, build_builtin,
};
