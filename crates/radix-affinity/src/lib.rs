//! A concurrent multi-tenant radix tree for cache-aware routing.
//!
//! For each request text the tree answers "which tenant (worker) holds the
//! longest prefix of this, and how long is it?", records which tenant now holds
//! a text, keeps each tenant within a budget by evicting its least recently
//! used entries, and forgets a tenant entirely.
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
//!
//! tree.remove_tenant(a);
//! assert_eq!(tree.prefix_match("You are a helpful assistant. Hello").tenant, Some(b));
//! ```
//!
//! This crate depends on no other workspace crate and on no async runtime.

mod clock;
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
pub use tree::{PrefixMatch, RadixTree, TextTree, TokenTree};

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
