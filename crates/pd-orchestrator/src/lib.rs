//! Prefill/decode disaggregation, generic over the transport.
//!
//! Pair selection over role-separated pools, KV connector strategies (NIXL,
//! Mooncake, MoRI-IO) that describe how the two request bodies are rewritten
//! and what passes between the phases, and the two-phase flow with one load
//! guard per phase. No HTTP: the flow runs over a transport trait so every
//! ordering, failure and cancellation is testable without sockets. The
//! implementation lands with its own issue; this page says what it will hold.
#![warn(missing_docs)]
