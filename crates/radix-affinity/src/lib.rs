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
//! - **Arena nodes.** A shard stores its nodes in a `Vec` addressed by `u32`
//!   index with a free list; parents are indices, so there are no reference
//!   cycles and dropping the tree frees everything. A slot's generation is
//!   bumped when it is freed, so a stale reference (an eviction candidate,
//!   an insert's plan) is recognised after reuse.
//! - **Compact edges.** A node's label is one boxed slice of *units*: UTF-8
//!   bytes for text (one byte per ASCII character, never four) and the ids
//!   themselves for tokens. Labels are cut only on symbol boundaries, so a
//!   match never splits a Unicode scalar value even when two characters share
//!   leading bytes. A new leaf stores only the part of the text the tree did
//!   not hold yet; splitting an edge copies only the shorter side (the longer
//!   one keeps its buffer). Children are a sorted vector of `(first symbol, index)`
//!   with two entries inline; there is no per-node hash map. A node is one
//!   64-byte cache line for what the walk reads (label, children, symbol
//!   count, parent) plus one for its owners.
//! - **Owners.** Each node lists its tenants as `(tenant id, last use,
//!   children held by this tenant, position in the tenant's node list)`; one
//!   owner is stored inline. Tenants are interned `u32` ids, never strings.
//! - **Per-tenant index.** Each shard keeps, per tenant, its symbol count and
//!   the list of nodes it holds. Eviction and removal start from that list, so
//!   they cost what the tenant holds, not the size of the tree; the
//!   "children held" count makes "is this the tenant's leaf?" O(1).
//!
//! # Concurrency: what is locked, what is not, and why it is safe
//!
//! Every shard sits behind its own reader-writer lock (`parking_lot`, on its
//! own cache line). There is no global lock.
//!
//! | operation | locks | allocates |
//! |---|---|---|
//! | `prefix_match`, `prefix_match_tenant` | the shard of the first symbol, **read** | no |
//! | `insert` | that shard **read** for the walk; then, only if something changes, **write** for the change alone (no walk) | the new leaf label (outside the lock), split halves |
//! | `evict_*` | each shard **read** to collect candidates, then the candidate's shard **write** for one node at a time | candidate heap |
//! | `remove_tenant` | each shard where the tenant holds something, **write**, once | no |
//! | `tenant_size`, `total_size`, `tenants`, `validate` | each shard **read**, one at a time | the result |
//! | `intern`, `tenant_name`, `tenant_id` | the name table (a separate lock the request path never takes) | on first intern |
//!
//! *Inserts in two phases.* An insert walks its text under the shard's
//! **read** lock, in parallel with lookups and other inserts' walks. On the
//! way it refreshes its tenant's stamps on nodes the tenant already holds
//! and records the path: each fully matched node's index and generation,
//! and where the walk stopped (text ends; no child for the next symbol; or
//! inside a child's label, which must be split). If the tenant already holds
//! the whole text, that is all: no write lock. Otherwise it copies the new
//! leaf's label with no lock held, takes the **write** lock, and *validates*
//! the plan before changing anything: every path node still has the
//! generation it had and the previous path node (the root for the first) as
//! parent, the child to split still has its generation and parent, and the
//! edge for the new leaf is still free. That suffices because a live node's
//! label changes only when the node is split, and a split gives it a new
//! parent; a slot is reused only after its generation was bumped; so an
//! unchanged path has unchanged labels and the read phase's match positions
//! still hold. Owner changes on the path (another tenant added or evicted)
//! do not invalidate a plan: adding the tenant to a node is idempotent and
//! done top-down, so the prefix closure and "children held" counts are
//! computed under the write lock. If validation fails (a racing split,
//! eviction, removal, or insert of the same edge), the insert walks again
//! under the write lock, as a one-phase insert would; [`LockWaits::replans`]
//! counts those. So the write lock is held for the change alone: a few node
//! updates and one arena slot, not a walk over thousands of characters.
//!
//! *Waiting.* An operation that finds its shard lock taken polls it (with a
//! pause between polls) for a few microseconds before blocking, because the
//! critical sections are shorter than a futex wait and wake-up;
//! [`RadixTree::lock_waits`] counts the lookups and writes that found their
//! shard lock taken, so contention is measured, not guessed. The allocator
//! has locks too: with glibc's malloc, growing (`realloc`) or shrinking a
//! buffer another thread allocated takes that thread's arena lock, which
//! sleeps in the kernel when contended. Writers therefore grow a node's
//! owner and child lists by allocating a new buffer (from their own arena)
//! and never shrink a label buffer when splitting it; on the route loop
//! with two threads in one tree, these two changes took the futex calls
//! from about 1,000 to about 130 per 100,000 operations (counted with
//! `strace -f -c`, which slows system calls and so exaggerates contention;
//! the allocator's calls were most of them).
//!
//! *Why it is safe.* All structural state of a shard (nodes, labels,
//! children, owners, counters, per-tenant lists) changes only under that
//! shard's write lock, in the same critical section, so a reader holding the
//! read lock sees a consistent subtree and a recount of a shard always equals
//! its counters ([`RadixTree::validate`] checks exactly that, and the stress
//! test runs it concurrently with writers). The only thing written under a
//! read lock is a last-use stamp, which is an atomic. What an insert learned
//! under the read lock is never trusted under the write lock without the
//! validation above. Eviction never acts on
//! what it collected without re-validating it under the write lock: the slot's
//! generation, that the tenant still holds the node, that it is still the
//! tenant's leaf, and that its stamp has not moved (if it has, the candidate
//! goes back into the heap with the new stamp). Nodes are unlinked by index,
//! never by first character, so a split racing an eviction cannot make it drop
//! the wrong subtree; when racing inserts keep a tenant above the limit, a
//! further pass (at most four) collects fresh candidates. The crate contains
//! no `unsafe` code other than a prefetch hint, a read of the
//! time-stamp counter and a call of an AVX2 build of the UTF-8 count after
//! runtime detection. The locks and atomics go
//! through a small `sync` shim so that `tests/loom_*.rs` model-check racing
//! lookups, splits, evictions and removals under loom, including an insert
//! whose plan is invalidated between its two phases by a split of its path,
//! by an eviction or removal that frees a path node (and a reuse of the
//! slot), and by another insert adding the same edge.
//!
//! *LRU stamps without contended writes.* A lookup must refresh the stamp of
//! every node on its path, and the top nodes of a popular system prompt are
//! on every path. With the default [`Clock::Coarse`], stamps are ticks of about
//! one millisecond of the monotonic clock (each thread re-reads the
//! clock only every ~0.1 ms of time-stamp counter, so a lookup pays a few
//! nanoseconds for it), and a node's stamp is stored (a
//! relaxed store) only when the stored value is older than the current tick;
//! so a hot node's cache line is written at most about once per millisecond
//! per tenant instead of on every lookup, and reads stay reads. Two racing
//! stores may leave the older of two values from neighbouring ticks, which
//! only blurs LRU order within a millisecond. [`Clock::Logical`] gives every
//! operation its own tick (exact order, one shared increment per operation)
//! for tests and simulations.
//!
//! *What the two phases cost and gain.* A single thread pays for the
//! second lock acquisition and the second pass over the path: on the
//! benchmark an insert went from about 0.81 to 0.86 µs on ascii text and
//! from 0.73 to 0.80 µs on unicode text, while the 1-thread route loop
//! (lookup, then insert) stayed at about 0.96-0.98 M operations per second.
//! Two threads sharing one tree went from 1.27 M to 1.52 M route operations
//! per second on ascii text (1.31x to 1.55x one thread) and from 1.09 M to
//! 1.21 M on unicode text (1.14x to 1.28x), where two threads on two
//! unshared trees reach 1.6-1.7x; with a fixed template in front of every
//! text (one shard), from 0.74x to about 1.0x one thread. (Medians of 9
//! and 15 runs of the workload example, alternated between this and the
//! previous one-phase version on a shared 2-core machine;
//! `examples/route_threads.rs` has the diagnostics used.)
//!
//! *What is not fine-grained.* The write phase still takes the whole
//! shard's write lock, not a lock per changed node, so it waits until the
//! lookups and walks in progress in that shard finish (up to about a
//! microsecond each) and holds new ones off meanwhile; and the threads
//! still write the same lock words, hot nodes and per-shard counters. Given
//! texts of disjoint shards, two threads in one tree ran as fast as on two
//! trees (`route_threads --disjoint`, once the threads' allocator arenas had
//! grown), so what remains of the gap is this sharing within a shard. When
//! all traffic starts with the same symbol (a fixed chat template, a BOS
//! token) and every operation writes (the route loop: lookup, then insert
//! of a text that is new), two threads mostly wait for each other's walks:
//! the tree then behaves like one reader-writer lock whose write sections
//! are short but frequent. Node-level locking or lock-free reads would lift
//! that, at the price of atomic read-modify-writes on every node of every
//! lookup or of deferred memory reclamation; neither is done here. Growing
//! a shard's node `Vec` also copies it under the write lock (rarely: the
//! capacity doubles); a chunked arena avoided that, but in alternated runs
//! it made one thread 3-5 % slower and two threads no faster, so it is not
//! used.
//!
//! # Memory
//!
//! Per node: 128 bytes (two cache lines, one owner inline) plus the label. On
//! the benchmark workload (20,000 requests of about 2,600 characters sharing
//! 256 system prompts) the resident-set growth is about 0.3 bytes per
//! inserted character, where the unique text alone is about 0.21.
//!
//! # Features and stability
//!
//! No cargo features. `fuzzing` and [`workload`] are public for the fuzz
//! target, the benches and other implementations that want the same requests;
//! `fuzzing` is hidden from the docs and not covered by semver.

mod clock;
#[doc(hidden)]
pub mod fuzzing;
mod shard;
mod symbol;
mod sync;
mod tenant;
mod tree;
pub mod workload;

pub use clock::Clock;
pub use symbol::Symbol;
pub use tenant::TenantId;
pub use tree::{LockWaits, PrefixMatch, RadixTree, TextTree, TokenTree};

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
