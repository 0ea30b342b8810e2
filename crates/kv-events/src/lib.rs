//! vLLM's KV-cache event stream: what an engine publishes about the blocks
//! in its prefix cache, so that a router can route on exact cache state.
//!
//! vLLM started with `--kv-events-config '{"enable_kv_cache_events": true,
//! "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint":
//! "tcp://*:5558"}'` publishes every scheduler step's `BlockStored`,
//! `BlockRemoved` and `AllBlocksCleared` events on a ZMQ PUB socket and
//! answers replay requests on a ROUTER socket. This crate speaks that
//! protocol:
//!
//! - [`wire`]: the event types, with the facts of the format as read in
//!   vLLM's source; [`decode_batch`] and [`encode_batch`] for the
//!   MessagePack payload (both the positional and the by-name shapes vLLM
//!   has used), bounded by [`DecodeLimits`], with typed [`DecodeError`]s.
//! - [`Sequencer`]: the sans-IO state machine of one stream: in-order
//!   delivery, gap detection, replay, duplicate skipping, restart detection
//!   and resets.
//! - [`Subscriber`]: one task per engine that runs the sockets around a
//!   `Sequencer`, reconnects with backoff and delivers [`StreamEvent`]s to
//!   your [`EventSink`], with [`StreamStatus`] for metrics.
//! - [`Publisher`]: the engine side (PUB + ROUTER with a [`ReplayBuffer`]),
//!   wire-compatible with vLLM's `ZmqEventPublisher`.
//! - [`zmq_io`]: the sockets are libzmq's (the `zmq` crate), each read by
//!   its own thread, every one with `ZMQ_MAXMSGSIZE` set so that no peer
//!   can make it allocate more than the largest legitimate message.
//! - [`ZmqEndpoint`]: `tcp://HOST:PORT`, the one parser of the addresses a
//!   router's ZMQ sockets connect to, strict because engines announce them
//!   ([`endpoint`]).
//!
//! # Example
//!
//! Encoding a batch as vLLM does and reading it back:
//!
//! ```
//! use kv_events::{BlockHash, BlockStored, EventBatch, KvEvent, decode_batch, encode_batch};
//!
//! let mut stored = BlockStored::new(
//!     vec![BlockHash::Int(0xABCD), BlockHash::Int(0xBEEF)],
//!     None,
//!     (0..32).collect(),
//!     16,
//! );
//! stored.medium = Some("GPU".to_owned());
//! let batch = EventBatch::new(1_700_000_000.5, vec![KvEvent::BlockStored(stored)]);
//!
//! let payload = encode_batch(&batch);
//! let decoded = decode_batch(&payload)?;
//! assert_eq!(decoded.batch, batch);
//! assert_eq!(decoded.unknown_events, 0);
//! # Ok::<(), kv_events::DecodeError>(())
//! ```
//!
//! Following an engine (feature `sockets`; the consumer, say a block index,
//! applies batches per worker and clears the worker on a reset):
//!
//! ```no_run
//! # #[cfg(feature = "sockets")]
//! # mod demo {
//! use kv_events::{StreamEvent, Subscriber, SubscriberConfig};
//!
//! # async fn demo() {
//! let config = SubscriberConfig::new("tcp://10.0.0.5:5557")
//!     .with_replay("tcp://10.0.0.5:5558")
//!     .with_topic("kv-events");
//! let subscriber = Subscriber::spawn(config, |event: StreamEvent| match event {
//!     StreamEvent::Batch { batch, .. } => { /* index.apply(worker, &batch) */ }
//!     StreamEvent::Reset { reason } => { /* index.clear(worker) */ }
//!     _ => {}
//! });
//! println!("{:?}", subscriber.status().state);
//! # }
//! # }
//! ```
//!
//! # Integration
//!
//! The router's block index builds one [`Subscriber`] per worker (endpoint
//! from the worker's registration; one per data-parallel rank, at
//! [`endpoint_for_rank`]) with a sink that calls the index; on
//! [`StreamEvent::Reset`] it drops the worker's blocks. `/workers` and the
//! metrics read [`Subscriber::status`]. The simulated engine owns a
//! [`Publisher`] and calls [`Publisher::publish`] after every step that
//! changed its cache; [`Publisher::publish_replay_only`] injects a dropped
//! message.
//!
//! # Feature flags
//!
//! - `sockets` (default): [`Subscriber`], [`Publisher`] and [`zmq_io`],
//!   with libzmq (built from source by `zmq-sys`) and tokio. Without it
//!   the crate is the wire format, the codec, the [`Sequencer`], the
//!   [`ReplayBuffer`] and [`ZmqEndpoint`], and depends on `thiserror`
//!   alone: what a crate needs that only reads or writes events (a
//!   simulated engine's model, a converter to a block index).
//!
//! # Concurrency
//!
//! A [`Subscriber`] is one task; its sink is called from that task only, in
//! stream order. [`Publisher::publish`] may be called from many tasks:
//! numbers are assigned and sent in one order (checked by a loom model of
//! the [`ReplayBuffer`]).
//!
//! # Stability
//!
//! Event structs and error enums are `non_exhaustive`: vLLM adds fields
//! and this crate will follow.

#![cfg_attr(docsrs, feature(doc_auto_cfg))]
// The crate docs describe the sockets too; built without them (feature
// `sockets` off), their links have nothing to point at.
#![cfg_attr(
    not(all(feature = "sockets", not(loom))),
    allow(rustdoc::broken_intra_doc_links)
)]

mod decode;
mod encode;
pub mod endpoint;
pub mod log_throttle;
pub mod replay_buffer;
pub mod sequencer;
mod sync;
mod value;
pub mod wire;

// The sockets: feature `sockets`, and never under loom (tokio does not
// build there).
#[cfg(all(feature = "sockets", not(loom)))]
pub mod publisher;
#[cfg(all(feature = "sockets", not(loom)))]
pub mod subscriber;
#[cfg(all(feature = "sockets", not(loom)))]
pub mod zmq_io;

#[doc(hidden)]
pub mod fuzzing;

pub use decode::{DecodeError, DecodedBatch, decode_batch, decode_batch_with};
pub use encode::{encode_batch, encode_batch_as};
pub use endpoint::{ZmqEndpoint, ZmqEndpointError};
pub use log_throttle::{DEFAULT_LOG_PERIOD, LogThrottle};
pub use replay_buffer::ReplayBuffer;
pub use sequencer::{
    Action, ReplayId, ResetReason, Sequencer, SequencerConfig, SequencerCounters, Source,
    StreamState,
};
pub use value::Value;
pub use wire::{
    BlockHash, BlockRemoved, BlockStored, DecodeLimits, EventBatch, KvEvent, WireFormat,
};

#[cfg(all(feature = "sockets", not(loom)))]
pub use publisher::{PublishError, Publisher, PublisherConfig};
#[cfg(all(feature = "sockets", not(loom)))]
pub use subscriber::{
    Backoff, EventSink, StreamCounters, StreamEvent, StreamStatus, Subscriber, SubscriberConfig,
    endpoint_for_rank,
};
