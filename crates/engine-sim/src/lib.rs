//! A simulated vLLM-style inference engine.
//!
//! The OpenAI-compatible HTTP surface of a vLLM server, a block-level prefix
//! KV cache with LRU eviction, a latency model on a virtual clock, prefill and
//! decode roles for disaggregated serving, and fault injection. It backs the
//! reference router's default demo, every integration test and the
//! routing-quality simulator. The implementation lands with its own issue;
//! this page says what it will hold.
#![warn(missing_docs)]
