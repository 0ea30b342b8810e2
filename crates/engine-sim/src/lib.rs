//! A simulated vLLM-style inference engine.
//!
//! engine-sim stands in for a vLLM server where no GPU exists: the same
//! OpenAI endpoints and SSE format, a block-level prefix KV cache with LRU
//! eviction, a latency model, vLLM's metric names, prefill/decode roles with
//! NIXL, Mooncake and MoRI-IO `kv_transfer_params`, and fault injection. It
//! has two layers:
//!
//! - [`Engine`], a deterministic sans-IO model on a virtual clock: submit a
//!   request at model time `t`, advance the clock, drain events (tokens,
//!   finished requests with TTFT and cached tokens). The routing-quality
//!   simulator drives many of these in one discrete-event loop.
//! - [`spawn`], an HTTP/1.1 server (hyper 1.x) around one engine, driven in
//!   tokio time; many can run in one process, each on its own port.
//!
//! # The model
//!
//! With `C` = `chars_per_token` (default 4) and `B` = `block_size`
//! (default 16):
//!
//! - **Tokens.** By default the synthetic tokenizer of
//!   [`prompt_tokens::synthetic`] (the one implementation the router
//!   shares): `prompt_tokens = ceil(chars / C)`, where `chars` counts
//!   Unicode scalar values of the prompt text; chat messages are first
//!   rendered as `<|role|>\ncontent\n` each, followed by `<|assistant|>\n`.
//!   A completions prompt may also be a list of token ids, used as given.
//!   An HTTP engine given a model's tokenizer
//!   ([`ServeOptions::tokenizer`], the binary's `--tokenizer-path` and
//!   `--chat-template`) renders chats with the model's chat template and
//!   tokenizes with its `tokenizer.json` instead, as vLLM does; everything
//!   below then counts those ids.
//! - **Blocks.** Block `i` holds tokens `i*B .. (i+1)*B`; each full block is
//!   named by the hash chain `h_i = H(h_{i-1}, tokens of block i)`, so
//!   prompts share a block exactly when they share all tokens up to its end.
//! - **Cache hits.** `cached_tokens = B * min(leading cached blocks,
//!   floor((prompt_tokens - 1) / B))`: the last prompt token is always
//!   computed, as in vLLM. `prefix_cache_queries += prompt_tokens` and
//!   `prefix_cache_hits += cached_tokens` at admission.
//! - **Capacity.** `num_blocks` blocks. An admitted request holds
//!   `ceil((prompt_tokens + max_tokens) / B)` blocks (its full prompt blocks
//!   shared through the cache, the rest private). When it ends, its prompt
//!   blocks stay cached but unreferenced; when blocks are needed, the least
//!   recently released unreferenced block is evicted (a prompt's tail goes
//!   before its head). `kv_cache_usage = referenced blocks / num_blocks`.
//! - **Scheduling.** At most `max_num_seqs` requests run; the rest wait in
//!   FIFO order (the head also waits while its blocks do not fit). The
//!   engine runs in steps: a step admits waiting requests, then every
//!   running request produces one token when the step ends.
//! - **Step time.** With `uncached = prompt_tokens - cached_tokens` of
//!   each request admitted in the step, `transferred` the prompt tokens a
//!   decode engine received over a KV connector, and `decoding` the number
//!   of requests already running:
//!
//!   ```text
//!   step = (admitted > 0) * (prefill_base + prefill_per_token * sum(uncached)
//!                            + kv_transfer_per_token * sum(transferred))
//!        + (decoding > 0) * (decode_base + decode_per_seq * decoding)
//!   ```
//! - **Latency.** `TTFT = queue wait + the step that admits the request`, so
//!   it grows with the uncached tokens of everything admitted together and
//!   with the requests ahead in the queue; each further token costs one
//!   decode step, which grows with the running batch.
//! - **Output.** Exactly `max_tokens` tokens (default 16), finish reason
//!   `length`; token `i` is a word chosen by a hash of (seed, prompt, i), so
//!   the same prompt always gets the same text.
//! - **Time scale.** The server maps model time to tokio time as
//!   `wall = model * time_scale`; 0 means no simulated latency (steps finish
//!   at once, for overhead benchmarks; see [`EngineConfig::instant`]). Under
//!   scale 0 model time runs ahead of real time by the modelled work, so
//!   `kv_hold_timeout` may expire sooner in real time.
//!
//! # Prefill/decode
//!
//! A [`Role::Prefill`] engine given `kv_transfer_params` with
//! `do_remote_decode: true` computes the prompt, returns one token and the
//! parameters for the decode leg in its connector's format (see
//! [`transfer::produced_params`]), and keeps the prompt's blocks until a
//! decode engine claims them or `kv_hold_timeout` passes. A
//! [`Role::Decode`] engine checks `do_remote_prefill: true` parameters: with
//! a shared [`TransferRegistry`] the named engine must have produced exactly
//! that transfer for the same prompt; otherwise well-formed parameters are
//! accepted. Results are counted in `engine_sim:kv_transfers_valid_total`
//! and `engine_sim:kv_transfers_invalid_total`. A decode request without
//! parameters counts as invalid (`missing`) and is recomputed locally.
//!
//! # Example: the model on a virtual clock
//!
//! ```
//! use std::time::Duration;
//! use engine_sim::{Engine, EventKind, ModelConfig, SimRequest, tokens::tokenize};
//!
//! let config = ModelConfig::default();
//! let mut engine = Engine::new(config.clone());
//! let prompt = tokenize(&"You are a helpful assistant. ".repeat(40), config.chars_per_token);
//!
//! // The same prompt twice: the second one finds its prefix cached.
//! engine.submit(Duration::ZERO, SimRequest::new(1, prompt.clone(), 4)).unwrap();
//! engine.advance_to(Duration::from_secs(1));
//! engine.submit(Duration::from_secs(1), SimRequest::new(2, prompt.clone(), 4)).unwrap();
//! engine.advance_to(Duration::from_secs(2));
//!
//! let finished: Vec<_> = engine
//!     .drain_events()
//!     .filter_map(|e| match e.kind {
//!         EventKind::Finished(summary) => Some(summary),
//!         _ => None,
//!     })
//!     .collect();
//! assert_eq!(finished[0].cached_tokens, 0);
//! assert_eq!(finished[1].cached_tokens, (prompt.len() - 1) / 16 * 16);
//! // Less to prefill, so a shorter time to first token.
//! assert!(finished[1].ttft() < finished[0].ttft());
//! ```
//!
//! # Example: an HTTP engine
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use engine_sim::{EngineConfig, ServeOptions, spawn};
//!
//! let engine = spawn(EngineConfig::default(), ServeOptions::default()).await?;
//! println!("serving {} as {}", engine.url(), engine.engine_id());
//! engine.shutdown().await;
//! # Ok(())
//! # }
//! ```
//!
//! # KV-cache events
//!
//! vLLM started with `--kv-events-config` publishes every scheduler step's
//! changes to its prefix cache (`BlockStored`, `BlockRemoved`) on a ZMQ PUB
//! socket, with a replay socket, so that a router can keep an exact index of
//! which engine holds which blocks. engine-sim does the same in two layers:
//!
//! - the model records them sans-IO, in vLLM's own event types (the
//!   `kv-events` crate's wire format, re-exported as [`kv_events`]): with
//!   [`Engine::set_kv_events`] on, every step that stored or evicted blocks
//!   leaves one [`KvBatch`] (see [`kv`]) to drain, whose `BlockStored`
//!   runs carry their blocks' hashes (the [`tokens::block_hashes`] chain,
//!   as integers), the parent hash, the token ids and the block size;
//! - the server (feature `kv-events`, on by default) publishes each batch,
//!   as it was recorded, through the `kv-events` crate's publisher when
//!   `ServeOptions::kv_events` is set (the binary's `--kv-events-port`
//!   and `--kv-events-replay-port`), rank 0.
//!
//! ```
//! use std::time::Duration;
//! use engine_sim::kv_events::{BlockHash, KvEvent};
//! use engine_sim::{Engine, ModelConfig, SimRequest, tokens::block_hashes};
//!
//! let mut engine = Engine::new(ModelConfig::default());
//! engine.set_kv_events(true);
//! let prompt: Vec<u32> = (0..40).collect(); // two full blocks of 16, and 8 more
//! engine.submit(Duration::ZERO, SimRequest::new(1, prompt.clone(), 4)).unwrap();
//!
//! let batches: Vec<_> = engine.drain_kv_batches().collect();
//! assert_eq!(batches.len(), 1, "the admitting step stored the full blocks");
//! let [KvEvent::BlockStored(stored)] = batches[0].events.as_slice() else {
//!     panic!("one BlockStored: {:?}", batches[0].events);
//! };
//! let hashes: Vec<BlockHash> = block_hashes(&prompt, 16).into_iter().map(BlockHash::Int).collect();
//! assert_eq!(stored.block_hashes, hashes);
//! assert_eq!(stored.parent_block_hash, None);
//! assert_eq!(stored.token_ids, prompt[..32]);
//! assert_eq!((stored.block_size, stored.medium.as_deref()), (16, Some("GPU")));
//! ```
//!
//! # Feature flags
//!
//! - `cli` (default): the `engine-sim` binary's command line (clap).
//! - `kv-events` (default): publishing KV-cache events over ZMQ
//!   (`ServeOptions::kv_events`, turns on the `kv-events` crate's sockets
//!   and with them libzmq, built from source through the `zmq` crate: a
//!   C++ compiler, no system package). The PUB socket accepts at most 4 KiB frames from
//!   subscribers and the replay ROUTER 1 KiB (`ZMQ_MAXMSGSIZE`, checked by
//!   libzmq before it allocates). On by default because the demo and the router's
//!   exact block index follow engines through it; an embedder of the
//!   sans-IO model alone can turn it off. [`Engine::drain_kv_batches`]
//!   needs no feature: the event types are the `kv-events` crate's wire
//!   format, which needs neither libzmq nor tokio.
//!
//! # Faults
//!
//! See [`fault`]: per engine through [`FaultConfig`], per request through
//! the `x-sim-fault` header.
//!
//! # Concurrency
//!
//! Each HTTP engine keeps its model behind one mutex, held only for
//! in-memory work (never across I/O). Engines sharing a registry only touch
//! it briefly under its own lock.
#![warn(missing_docs)]

pub mod api;
pub mod cache;
pub mod config;
pub mod engine;
pub mod fault;
pub mod kv;
pub mod metrics;
#[cfg(not(loom))]
pub mod server;
pub mod text;
pub mod tokens;
pub mod transfer;

#[doc(hidden)]
pub mod fuzzing;

/// The crate engine-sim builds prompts with, re-exported so a host (the
/// routing simulator, a test) uses the very same version: its
/// `PromptTokenizer` is what [`ServeOptions::tokenizer`] takes.
pub use prompt_tokens;

/// The crate whose event types a [`KvBatch`] holds (its wire format, and
/// with feature `kv-events` its publisher), re-exported so a host reads the
/// batches with the very same version.
pub use kv_events;

pub use config::{EngineConfig, FaultConfig, ModelConfig, MoriIoMode, Role, TransferFormat};
pub use engine::{
    Engine, EngineEvent, EngineStats, EventKind, PdSettings, RequestId, RequestSummary, SimRequest,
    SubmitError, TransferOutcome,
};
pub use kv::KvBatch;
#[cfg(all(feature = "kv-events", not(loom)))]
pub use server::KvEventsOptions;
#[cfg(not(loom))]
pub use server::{EngineHandle, ServeOptions, TRACEPARENTS_KEPT, WORKER_ID_HEADER, spawn};
pub use transfer::{KvTransferParams, TransferRegistry};
