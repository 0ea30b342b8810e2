//! A concurrent multi-tenant radix tree for cache-aware routing.
//!
//! For each request text the tree answers "which tenant (worker) holds the
//! longest prefix of this, and how long is it?", records which tenant now holds
//! a text, keeps each tenant within a budget by evicting its least recently
//! used entries, and forgets a tenant entirely. It depends on no other
//! workspace crate and on no async runtime.
//!
//! ```
//! use radix_affinity::TextTree;
//!
//! let tree = TextTree::new();
//! let a = tree.intern("http://worker-a:8000");
//! let b = tree.intern("http://worker-b:8000");
//! tree.insert("You are a helpful assistant. Hello", a);
//! tree.insert("You are a helpful assistant. Bye", b);
//!
//! let m = tree.prefix_match("You are a helpful assistant. Hello again");
//! assert_eq!(m.tenant, Some(a));
//! assert_eq!((m.matched, m.input), (34, 40));
//! assert_eq!(tree.prefix_match_tenant("You are a helpful assistant. Hello", b), 29);
//! assert_eq!(tree.tenant_size(a), 34);
//! assert_eq!(tree.total_size(), 34 + 32); // the shared prefix counts for both
//!
//! tree.remove_tenant(a);
//! assert_eq!(tree.prefix_match("You are a helpful assistant. Hello").tenant, Some(b));
//!
//! // Token ids: the same tree over u32.
//! let tokens = radix_affinity::TokenTree::new();
//! let w = tokens.intern("http://worker-a:8000");
//! tokens.insert_symbols(&[101, 7, 7, 42], w);
//! assert_eq!(tokens.prefix_match_symbols(&[101, 7, 9]).matched, 2);
//! ```
//!
//! # Semantics
//!
//! A tenant *holds* every prefix of every text inserted for it (until evicted
//! or removed). [`RadixTree::prefix_match`] returns the longest prefix of the
//! input that anybody holds and, among the tenants holding the deepest node
//! reached, the one that used it most recently; that tenant's last-use stamps
//! on the whole matched path are refreshed (the lookup counts as a use, since
//! the caller is about to route there). A tenant's *size* is the number of
//! symbols it holds; a node shared by k tenants counts once for each, and
//! [`RadixTree::total_size`] is the sum. Eviction removes a tenant's least
//! recently used *leaves* (nodes it holds without holding any child), whole
//! nodes at a time, until the budget is met.
//!
//! # Structure
//!
//! - **Shards by first symbol.** The tree is 256 independent subtrees: one per
//!   ASCII first character and 128 hashed buckets for the rest. A text lives
//!   entirely in the shard of its first symbol, so a lookup or an insert
//!   touches exactly one shard.
//! - **Roots.** Texts that all begin alike (every chat routing text begins
//!   with a role) would share one shard. A tree told such beginnings
//!   ([`RadixTree::with_roots`]) keeps 64 more shards for them: a text that
//!   begins with a root and goes on past it is stored as the root, in the
//!   shard of its first symbol, and the rest, in one of the root's shards
//!   chosen by the symbol after the root. A lookup walks the rest's shard
//!   and, only when nothing matches past the root there, the root's; an
//!   insert writes both. Matches, sizes and eviction order are those of the
//!   tree without roots (`src/tree/roots.rs` says why).
//! - **Arena nodes.** A shard stores its nodes in an arena addressed by `u32`
//!   index, with a free list; parents are indices, so there are no reference
//!   cycles and dropping the tree frees everything. The arena is chunks of
//!   doubling size that are never moved or copied: growing a shard allocates
//!   one chunk (zeroed, so its pages cost nothing until used) and takes no
//!   exclusive lock. A slot's generation is bumped when it is freed, so a
//!   stale eviction candidate is recognised after the slot is reused.
//! - **Compact edges.** A node's label lives in a buffer of *units*: UTF-8
//!   bytes for text (one byte per ASCII character, never four) and the ids
//!   themselves for tokens. Labels are cut only on symbol boundaries, so a
//!   match never splits a Unicode scalar value even when two characters share
//!   leading bytes. A new leaf stores only the part of the text the tree did
//!   not hold yet; splitting an edge copies only the shorter side (the longer
//!   one keeps the buffer, with its range narrowed). Children are `(first
//!   symbol, index)` pairs packed in one 64-bit word each, sorted, two inline
//!   in the node and in an array from the third on; there is no per-node hash
//!   map.
//! - **Two cache lines per node.** The first holds everything a walk reads:
//!   version, parent, symbol count, label and the two inline children. The
//!   second holds the owners: one inline (most nodes have one), then an array.
//!   An owner is `(tenant id, last use, children held by this tenant,
//!   position in the tenant's node list)`; tenants are interned `u32` ids,
//!   never strings.
//! - **Per-tenant index.** Each shard keeps, per tenant, its symbol count and
//!   the list of nodes it holds. Eviction and removal start from that list, so
//!   they cost what the tenant holds, not the size of the tree; the "children
//!   held" count makes "is this the tenant's leaf?" O(1).
//!
//! # Concurrency
//!
//! There is no global lock. Each shard has a reader-writer lock, but it does
//! not protect the nodes: lookups *and inserts* take it shared. A lookup
//! locks no node and writes no node field but a last-use stamp (at most once
//! a millisecond per node and tenant with [`Clock::Coarse`]): it reads each
//! node between two equal versions of it, a sequence lock. An insert locks
//! only the nodes it changes, never waiting for one node while holding
//! another. Taking a shard exclusively is how memory is reclaimed, so it is
//! taken only to free or move memory (eviction and removal, in bounded
//! batches of 32 evictions or [`REMOVAL_BATCH`] removals per hold; growing
//! a shard's tenant table; freeing retired arrays) and for the consistent
//! views of [`RadixTree::validate`] and [`RadixTree::recount`]. Growing a
//! shard's node arena moves nothing and takes no exclusive lock.
//! [`RadixTree::lock_waits`] counts the waits for a shard lock, and
//! [`LockWaits::retries`] the walk steps inserts repeated.
//!
//! Why this is safe is written beside the code that relies on it, so that a
//! change to the code meets the argument:
//!
//! - `src/tree.rs`: which operation takes which lock, polling a taken
//!   shard lock; `src/tree/evict.rs`: eviction and removal in bounded
//!   holds; `src/tree/roots.rs`: texts under a root in two shards, and why
//!   a tenant never holds a rest without its root;
//! - `src/shard/mod.rs`: node versions and the walk, why that is enough, what
//!   an insert locks, what a racing lookup can see, reclamation, and
//!   eviction's re-validation under the exclusive lock;
//! - `src/seg.rs`: the node arena, grown without moving anything;
//! - `src/clock.rs`: last-use stamps without contended writes;
//! - `src/sync.rs`: waiting for a node, and the shim through which the loom
//!   models in `tests/loom_*.rs` run the same code.
//!
//! The crate's `unsafe` code builds slices from a node's label and array
//! pointers (consistent by the version protocol, alive by the reclamation
//! rule) and frees them under exclusive access (`src/shard/`,
//! `src/heap.rs`, `src/seg.rs`); besides that there is only a prefetch hint
//! (`src/tree.rs`), a read of the time-stamp counter (`src/clock.rs`) and a
//! call of an AVX2 build of the UTF-8 count after runtime detection
//! (`src/symbol.rs`).
//!
//! # Memory limits
//!
//! Every shard accounts the bytes it allocates (nodes, labels, arrays, the
//! per-tenant node lists), and a tree made with [`RadixTree::with_budget`]
//! charges them to a [`MemoryBudget`] that any number of trees may share.
//! Two limits are enforced by the insert that crosses them, before it
//! returns: the budget, and a per-tenant limit in symbols
//! ([`RadixTree::set_tenant_limit`]). The insert evicts sampled least
//! recently used leaves (Redis's `maxmemory` policy): it looks at
//! [`DEFAULT_EVICTION_SAMPLES`] holds in each of up to eight shards where
//! there is something to evict, and evicts the oldest of that pool under
//! its shard's exclusive lock, going on under the same hold while the next
//! oldest (parents that became leaves join the pool) is in the same shard.
//! It stops a 64th below the limit ([`LOW_WATER_DIVISOR`]) or after 32
//! evictions: under sustained distinct traffic one insert in a few dozen
//! takes a shard exclusively, not every one, which matters because all chat
//! routing texts begin with a role and so share a shard. A tree holds at
//! most its limits plus what the inserts in flight add, at any insert rate,
//! and no timer or pass over the tree is involved.
//! `tests/model.rs` checks it against the model: with every candidate
//! sampled, the evictions are exactly the model's least recently used
//! leaves, and the limits hold after every operation.
//!
//! # Memory
//!
//! Labels, child and owner arrays and node chunks come from
//! [`std::alloc::System`], not from the program's global allocator. Prefix
//! state is long-lived and freed in least-recently-used order, scattered
//! over the pages it was allocated in; a size-class allocator such as
//! mimalloc keeps a page resident while one block on it lives, and held
//! 1.25x the accounted bytes under sustained distinct traffic where glibc's
//! malloc, which reuses freed space for blocks of any size, held 1.05x
//! (a 256 MiB budget, 1 KB chat texts, 64 tenants). A large zeroed chunk
//! from the system allocator is fresh pages, so node slots not used yet
//! take no resident memory. The tree's own small vectors (per-tenant node
//! lists, the tenant table) stay on the global allocator.
//!
//! # How it scales
//!
//! A lookup costs time proportional to the part of the text it matches, an
//! insert to the length of its text (one walk in one shard, plus a copy of
//! what the tree did not hold yet); neither depends on how many texts or
//! tenants the tree holds. Eviction and tenant removal cost what the tenant
//! holds, not the size of the tree. Lookups take their shard's lock shared
//! and lock no node, so they scale with threads. Inserts lock only the
//! nodes they change, so threads sharing a tree almost never wait for each
//! other; what keeps threads that insert below the same popular prefixes
//! from scaling fully is the transfer of freshly written cache lines
//! between cores, and on a virtual machine how much that costs varies from
//! run to run.
//!
//! Memory: 128 bytes per node (two cache lines, one owner and two children
//! inline) plus its label, one byte per ASCII character or one `u32` per
//! token; a text's prefix the tree already holds is not stored again.
//!
//! Figures (per-operation costs, the two-thread ratio with its spread over
//! runs, resident memory per character) and the history of their
//! measurements are in `docs/benchmarks.md` in the repository;
//! `cargo run --release -p radix-affinity --example workload` measures
//! them.
//!
//! # Features and stability
//!
//! No cargo features. [`workload`] is public on purpose: it regenerates the
//! benchmark's requests bit for bit, so another tree implementation can be
//! measured on exactly the same requests as this one. `fuzzing` is public
//! only for the fuzz target and the crate's own tests; it is hidden from the
//! docs and not covered by semver.

mod budget;
mod clock;
#[doc(hidden)]
pub mod fuzzing;
mod heap;
#[doc(hidden)]
pub use heap::thread_block_counts;
mod seg;
mod shard;
mod symbol;
mod sync;
mod tenant;
mod tree;
pub mod workload;

pub use budget::MemoryBudget;
pub use clock::Clock;
pub use symbol::Symbol;
pub use tenant::TenantId;
#[doc(hidden)]
pub use tree::EvictionRecord;
pub use tree::{
    DEFAULT_EVICTION_SAMPLES, LOW_WATER_DIVISOR, LockWaits, MAX_ROOTS, PrefixMatch, REMOVAL_BATCH,
    RadixTree, RootsError, TenantMatches, TextTree, TokenTree,
};

/// A broken internal invariant found by [`RadixTree::validate`]; always a bug
/// in this crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("radix tree invariant violated in shard {shard}: {detail}")]
#[non_exhaustive]
pub struct InvariantViolation {
    /// Shard in which the violation was found.
    pub shard: usize,
    /// What is wrong.
    pub detail: String,
}

/// The README's code blocks are compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
