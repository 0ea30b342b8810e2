//! A concurrent multi-tenant radix tree for cache-aware routing.
//!
//! For each request text the tree answers "which tenant (worker) holds the
//! longest prefix of this, and how long is that prefix?", records which tenant
//! now holds a text, keeps each tenant within a budget by evicting its least
//! recently used entries, and forgets a tenant entirely.
//!
//! This crate depends on no other workspace crate and on no async runtime.
//! The implementation lands with its own issue; this page says what it will
//! hold.
#![warn(missing_docs)]
