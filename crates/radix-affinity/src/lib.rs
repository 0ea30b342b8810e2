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
//! # Concurrency: what is locked, what is not, and why it is safe
//!
//! There is no global lock. Each shard has a reader-writer lock (`parking_lot`,
//! on its own cache line), but it does not protect the nodes: lookups *and
//! inserts* take it shared, and inserts lock individual nodes. Taking it
//! exclusively is how memory is reclaimed, so only the operations that free
//! or move memory do.
//!
//! | operation | shard lock | node locks | allocates |
//! |---|---|---|---|
//! | `prefix_match`, `prefix_match_tenant` | shared | none | no |
//! | `insert` | shared | only the nodes it changes (below) | the new leaf's label, before any lock; a split's shorter half; a grown array |
//! | eviction by the limits (inside `insert`, `enforce_limits`) | shared to sample candidates; exclusive for up to 32 node removals in a row | — | sample buffers |
//! | `evict_tenant_by_size`, `evict_to_total` | shared to collect candidates; exclusive for each node removed | — | candidate heap |
//! | `remove_tenant` | shared to list the tenant's holds; exclusive for each batch of 64 | — | the list |
//! | growing a shard's arena | none (the slots' mutex) | — | one chunk |
//! | growing a shard's tenant table, freeing retired arrays | exclusive, briefly (an insert asks for it) | — | the growth |
//! | `tenant_size`, `total_size`, `tenants` | shared | none | the result |
//! | `validate`, `recount` | exclusive, one shard at a time | — | the result |
//! | `intern`, `tenant_name`, `tenant_id` | the name table (a lock the request path never takes) | — | on first intern |
//!
//! *Node versions.* Every node field is an atomic, and each node has a
//! version word: even while nobody changes the node, odd while a writer holds
//! it. A writer takes a node by a compare-and-swap from even to odd, changes
//! its fields, and stores the next even value. A reader loads the version
//! (waiting while it is odd), loads the fields it needs, and loads the
//! version again: if it is unchanged, the fields form a consistent view (a
//! sequence lock). Readers write no node field but a last-use stamp, at
//! most once a millisecond (see below), so a lookup never waits for another
//! lookup and does not make a hot node's cache lines bounce. One step
//! of a walk views the current node, finds the child for the next symbol,
//! checks that the current node's version is still the one it viewed (the
//! child array may be shifting in place under a writer, and a search of a
//! shifting array can miss a child that is there), views the child, and
//! checks that the child's parent is still the current node. If a check
//! fails it looks again from the current node, never from the root.
//!
//! *Why that is enough.* A node's end depth (the length of the text from the
//! root to the end of its label) never changes while it lives: a split keeps
//! the lower part of the label in the node and puts a new node above it. So
//! the node a walk stands on still ends where the walk thinks, whatever
//! happened above it; an unchanged version means the child entry read is one
//! the node really had; and a child whose parent is still that node holds the
//! label that continues it (a split changes label and parent together, under
//! the child's lock). Nodes are freed only under the exclusive lock, so a
//! node index a walk holds stays that node.
//!
//! *What an insert locks.* It walks like a lookup and locks only where it
//! changes something: the parent of a new leaf (its child array); a node
//! that gains the tenant as an owner, and that node's parent (its count of
//! held children); a node it splits and that node's parent (whose entry
//! moves to the new node). Locks are taken parent first. The child is taken
//! only at the version the walk viewed, by a compare-and-swap that does not
//! wait: if the child changed, the insert looks again. So no thread waits
//! for a node lock while holding another, and there is no deadlock. A new
//! node is claimed with a plain store before it is linked, since nobody can
//! reach it yet. Inside node locks an insert takes three small mutexes of the
//! shard, innermost and each for one push: the free-slot list, the tenant's
//! node list (with its size) and the list of retired arrays.
//! [`LockWaits::retries`] counts the steps inserts repeated.
//!
//! *What a racing lookup can see.* Every node change is atomic, and an insert
//! becomes visible top-down, one node at a time: a lookup racing an insert
//! may see the tenant already holding a prefix of the new text (its upper
//! nodes) before the whole of it. Lookups never see a tenant holding a node
//! whose parent it does not hold, a label that does not belong under its
//! parent, or a counter that disagrees with the nodes once the inserts have
//! returned.
//!
//! *Reclamation.* Nothing is freed while the shard is shared. Label bytes are
//! never written after a label is made (a split narrows ranges and copies the
//! shorter side), and a label buffer lives as long as the node that owns it.
//! A child or owner array that has to grow is copied into a new one and the
//! old one is retired to the shard's list, freed under the exclusive lock
//! once the list holds 4 KiB (or at the next eviction or growth). The borrow
//! checker enforces the rule: a node view borrows the shard, and freeing
//! needs it mutably. Growing the node arena moves nothing (a new chunk is
//! published with a release store before any slot in it is handed out), so
//! it needs no exclusive lock.
//!
//! *Eviction and removal* run under the exclusive lock, at most 32 node
//! removals per acquisition for eviction and 64 for removal, so they are the only writers
//! that exclude lookups, each for a bounded time (an insert that crosses a
//! limit evicts a few nodes this way; see "Memory limits"). Eviction never acts on
//! what it collected without re-validating it under the exclusive lock: the
//! slot's generation, that the tenant still holds the node, that it is still
//! the tenant's leaf, and that its stamp has not moved (if it has, the
//! candidate goes back into the heap with the new stamp). Nodes are unlinked
//! by index, never by first character, so a split racing an eviction cannot
//! make it drop the wrong subtree; when racing inserts keep a tenant above
//! the limit, a further pass (at most four) collects fresh candidates.
//!
//! *Waiting.* A thread that finds a node locked spins for a few dozen pauses
//! (a writer holds a node for tens of nanoseconds) and then yields, so that
//! it does not burn a time slice when the holder was descheduled. A thread
//! that finds its shard lock held exclusively polls it for a few microseconds
//! before blocking; [`RadixTree::lock_waits`] counts those waits. The
//! allocator has locks too: with glibc's malloc, growing (`realloc`) a buffer
//! another thread allocated takes that thread's arena lock, so arrays and
//! node lists grow into new buffers from the writer's own arena.
//!
//! *Proofs.* `tests/loom_*.rs` model-check, under loom, with the same code
//! (the locks and atomics go through a small `sync` shim): two new children
//! of one node racing a lookup; a new owner racing a split of the same node;
//! lookups of a text racing its split; a child inserted in place while a
//! lookup searches for a later key (this model fails if the version check
//! of a walk step is removed, and two others fail without the parent check);
//! a third child moving the children to an array while the node arena grows;
//! inserts racing splits of their path, removals that free and reuse its
//! slots, and evictions; eviction and removal racing inserts. The stress test
//! runs writers, lookups and evictions on threads and checks the counters
//! against a recount. The crate's `unsafe` code builds slices from a node's
//! label and array pointers (consistent by the version protocol, alive by
//! the reclamation rule) and frees them under exclusive access; besides that
//! there is only a prefetch hint, a read of the time-stamp counter and a call
//! of an AVX2 build of the UTF-8 count after runtime detection.
//!
//! *LRU stamps without contended writes.* A lookup must refresh the stamp of
//! every node on its path, and the top nodes of a popular system prompt are
//! on every path. With the default [`Clock::Coarse`], stamps are ticks of about
//! one millisecond of the monotonic clock (each thread re-reads the clock
//! only every ~0.1 ms of time-stamp counter, so a lookup pays a few
//! nanoseconds for it), and a node's stamp is stored (a relaxed store) only
//! when the stored value is older than the current tick; so a hot node's
//! owner line is written at most about once per millisecond per tenant
//! instead of on every lookup, and reads stay reads. Two racing stores may
//! leave the older of two values from neighbouring ticks, and a stamp stored
//! into an owner array just as a writer copies it to a larger one is lost;
//! both only blur LRU order within a millisecond. [`Clock::Logical`] gives
//! every operation its own tick (exact order, one shared increment per
//! operation) for tests and simulations.
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
    DEFAULT_EVICTION_SAMPLES, LOW_WATER_DIVISOR, LockWaits, PrefixMatch, REMOVAL_BATCH, RadixTree,
    TextTree, TokenTree,
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
