//! The event types and what vLLM puts on the wire.
//!
//! # What vLLM sends (read in its source)
//!
//! Facts below were read in `vllm-project/vllm`, file
//! `vllm/distributed/kv_events.py` at two commits (`b4e69e0a`, an early
//! version, and `0181ea31`, a recent `main`), in
//! `examples/online_serving/kv_events_subscriber.py` (`0ef0f426`), and in
//! the discussion of vLLM pull request #42892 and of the consumers that
//! followed it (llm-d-kv-cache #661, sglang #40684, kthena #1535).
//!
//! **Framing.** `ZmqEventPublisher` owns a PUB socket (default
//! `tcp://*:5557`; it binds when the address holds `*`, `::`, `ipc://` or
//! `inproc://`, otherwise it connects) and, when `replay_endpoint` is set, a
//! ROUTER socket that it binds. Every batch is one three-frame message
//! `[topic, seq, payload]`: `topic` is the configured topic as UTF-8
//! (default empty), `seq` is `seq.to_bytes(8, "big")` from a counter that
//! starts at 0 for each publisher (so a restarted engine starts again at 0),
//! `payload` is `msgspec.msgpack.Encoder().encode(batch)`. With data
//! parallelism each rank runs its own publisher and adds its rank to both
//! ports (`offset_endpoint_port`).
//!
//! **Replay.** The publisher keeps the last `buffer_steps` (default 10 000)
//! `(seq, payload)` pairs. A client sends the first sequence number it wants
//! as 8 bytes big-endian; the ROUTER sees `[identity, b"", start]` and
//! ignores requests that are not exactly three frames (so a DEALER must
//! send the empty delimiter itself; a REQ socket adds it). For every buffered
//! batch with `seq >= start` it answers `[identity, b"", seq, payload]`, then
//! the end marker `[identity, b"", (-1).to_bytes(8, "big", signed=True),
//! b""]`: eight `0xFF` bytes and an empty payload. Nothing says that the
//! requested sequence was still in the buffer; a client sees that from the
//! first sequence number it gets back.
//!
//! **Payload.** msgspec structs with `omit_defaults=True`:
//!
//! - `EventBatch`: `ts: float` (msgspec writes every Python float as a
//!   MessagePack float 64), `events: list`, `data_parallel_rank: int | None
//!   = None` (the publisher fills in its rank when unset). Early versions
//!   declared it `array_like=True`, so it travels as `[ts, events]` or `[ts,
//!   events, rank]`; the `0181ea31` declaration no longer says
//!   `array_like`, which makes it a map `{"ts": .., "events": ..,
//!   "data_parallel_rank": ..}`. Captures from vLLM 0.26 releases (kthena
//!   #1535) still show the array. Both are accepted here.
//! - Events derive from `KVCacheEvent(tag=True)`: msgspec's tag is the class
//!   name (`"BlockStored"`, `"BlockRemoved"`, `"AllBlocksCleared"`). Before
//!   pull request #42892 the events were `array_like=True` too, and the tag
//!   is then the first array element: `["BlockStored", block_hashes,
//!   parent_block_hash, token_ids, block_size, lora_id, medium, ...]`.
//!   Since #42892 an event is a map whose first key is `"type"` holding the
//!   tag, followed by the fields by name.
//! - `BlockStored` fields, in order: `block_hashes: list[ExternalBlockHash]`,
//!   `parent_block_hash: ExternalBlockHash | None`, `token_ids: list[int]`,
//!   `block_size: int`, `lora_id: int | None` (deprecated, kept), `medium:
//!   str | None` (`"GPU"` for the GPU cache), `lora_name: str | None`, then
//!   fields with defaults (left out when default): `extra_keys:
//!   list[tuple | None] | None = None` (per block: multimodal identifiers,
//!   LoRA name, cache salt, ...), `group_idx: int | None = None`,
//!   `kv_cache_spec_kind: str | None = None`,
//!   `kv_cache_spec_sliding_window: int | None = None`. The early version
//!   stopped after `lora_id`; `medium` and `lora_name` came later, so older
//!   engines send shorter arrays.
//! - `BlockRemoved`: `block_hashes`, `medium: str | None`, `group_idx: int |
//!   None = None`. `AllBlocksCleared` has no field.
//! - `ExternalBlockHash = bytes | int` (from `vllm/v1/core/kv_cache_utils`):
//!   MessagePack `bin` or an integer. Integers from Python's built-in hash
//!   can be negative; 64-bit hashes above `i64::MAX` come as `uint 64`.
//!
//! The example subscriber uses a REQ socket for replay, sends
//! `last_seq + 1` when a received sequence skips ahead, and stops reading
//! replies at an empty payload.
//!
//! # What this crate makes of it
//!
//! Decoding accepts either shape for the batch and for each event, reads
//! map fields by name in any order, ignores array elements past the ones it
//! knows and map keys it does not know, and skips (and counts) events whose
//! tag it does not know. Missing trailing optional fields read as `None`.
//! Encoding writes one of the shapes of [`WireFormat`]; the default is what
//! released vLLM engines were seen to send after #42892 (batch as an array,
//! events as maps).

use crate::value::Value;

/// A block hash as vLLM sends it: `ExternalBlockHash = bytes | int`.
///
/// Integers are kept as their 64-bit two's-complement pattern: a negative
/// hash from Python's built-in `hash` (older vLLM) and the `uint 64` with the
/// same bits are the same block. The encoder writes values above
/// `i64::MAX` as `uint 64`, which round-trips.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlockHash {
    /// An integer hash.
    Int(u64),
    /// A byte-string hash (for example a SHA-256 digest).
    Bytes(Box<[u8]>),
}

impl From<u64> for BlockHash {
    fn from(value: u64) -> Self {
        Self::Int(value)
    }
}

impl From<&[u8]> for BlockHash {
    fn from(value: &[u8]) -> Self {
        Self::Bytes(value.into())
    }
}

/// One batch of events, as one ZMQ message carries it.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// The engine's wall-clock time of the batch, seconds since the epoch.
    pub ts: f64,
    /// The events, in the order the engine applied them.
    pub events: Vec<KvEvent>,
    /// The engine's data-parallel rank, when it sent one.
    pub data_parallel_rank: Option<u32>,
}

impl EventBatch {
    /// A batch of `events` at time `ts` without a rank.
    #[must_use]
    pub fn new(ts: f64, events: Vec<KvEvent>) -> Self {
        Self {
            ts,
            events,
            data_parallel_rank: None,
        }
    }
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks were filled and are now cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole cache was cleared (for example on a reset of the prefix
    /// cache).
    AllBlocksCleared,
}

impl KvEvent {
    /// The msgspec tag of this event (its vLLM class name).
    #[must_use]
    pub fn tag(&self) -> &'static str {
        match self {
            Self::BlockStored(_) => TAG_BLOCK_STORED,
            Self::BlockRemoved(_) => TAG_BLOCK_REMOVED,
            Self::AllBlocksCleared => TAG_ALL_BLOCKS_CLEARED,
        }
    }
}

pub(crate) const TAG_BLOCK_STORED: &str = "BlockStored";
pub(crate) const TAG_BLOCK_REMOVED: &str = "BlockRemoved";
pub(crate) const TAG_ALL_BLOCKS_CLEARED: &str = "AllBlocksCleared";

/// `BlockStored`: a run of consecutive full blocks of one sequence.
///
/// `block_hashes[i]` covers `token_ids[i * block_size .. (i + 1) *
/// block_size]`; the first block's parent is `parent_block_hash` (`None` at
/// the start of a prompt). Fields after `block_size` are optional on the
/// wire. Build one with [`BlockStored::new`] and set the optional fields;
/// the struct is `non_exhaustive` so that vLLM's next field is not a
/// breaking change here.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct BlockStored {
    /// The hashes of the stored blocks, parent first.
    pub block_hashes: Vec<BlockHash>,
    /// The hash of the block before the first one, if any.
    pub parent_block_hash: Option<BlockHash>,
    /// The tokens of all stored blocks, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The LoRA adapter's integer id (deprecated in vLLM, kept).
    pub lora_id: Option<u64>,
    /// Where the blocks live (`"GPU"`, or a connector's medium).
    pub medium: Option<String>,
    /// The LoRA adapter's name (what vLLM hashes).
    pub lora_name: Option<String>,
    /// Per-block extra hash inputs (multimodal identifiers, cache salt, ...),
    /// kept as generic values.
    pub extra_keys: Option<Vec<Option<Value>>>,
    /// The KV-cache group (hybrid models).
    pub group_idx: Option<u32>,
    /// The kind of the group's cache spec (`"full_attention"`, ...).
    pub kv_cache_spec_kind: Option<String>,
    /// The sliding window of the group's cache spec.
    pub kv_cache_spec_sliding_window: Option<u64>,
}

impl BlockStored {
    /// A `BlockStored` with the required fields and no optional one.
    #[must_use]
    pub fn new(
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> Self {
        Self {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        }
    }
}

/// `BlockRemoved`: blocks evicted from the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BlockRemoved {
    /// The hashes of the evicted blocks.
    pub block_hashes: Vec<BlockHash>,
    /// Where the blocks lived.
    pub medium: Option<String>,
    /// The KV-cache group (hybrid models).
    pub group_idx: Option<u32>,
}

impl BlockRemoved {
    /// A `BlockRemoved` of `block_hashes` with no optional field.
    #[must_use]
    pub fn new(block_hashes: Vec<BlockHash>) -> Self {
        Self {
            block_hashes,
            medium: None,
            group_idx: None,
        }
    }
}

/// The MessagePack shape of a batch and of its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WireFormat {
    /// The batch as a map (`ts`, `events`, `data_parallel_rank` by name)
    /// rather than a `[ts, events, rank]` array.
    pub batch_as_map: bool,
    /// Each event as a map with a `"type"` key rather than a tagged array.
    pub events_as_maps: bool,
}

impl WireFormat {
    /// Everything positional, as vLLM before pull request #42892:
    /// `[ts, [["BlockStored", ...], ...], rank]`.
    pub const POSITIONAL: Self = Self {
        batch_as_map: false,
        events_as_maps: false,
    };
    /// Batch positional, events as tagged maps: what released engines were
    /// seen to send after #42892. The default.
    pub const NAMED_EVENTS: Self = Self {
        batch_as_map: false,
        events_as_maps: true,
    };
    /// Everything by name, as the latest `EventBatch` declaration (without
    /// `array_like`) reads.
    pub const NAMED: Self = Self {
        batch_as_map: true,
        events_as_maps: true,
    };
}

impl Default for WireFormat {
    fn default() -> Self {
        Self::NAMED_EVENTS
    }
}

/// Upper bounds the decoder enforces, so that a hostile or broken stream
/// cannot make it allocate without bound. Every limit is checked before the
/// memory is reserved.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DecodeLimits {
    /// Largest payload accepted, in bytes (default 16 MiB).
    pub max_payload_bytes: usize,
    /// Most events in one batch, unknown ones included (default 65 536).
    pub max_events: usize,
    /// Most block hashes in one event (default 65 536).
    pub max_block_hashes: usize,
    /// Most token ids in one event (default 1 048 576).
    pub max_token_ids: usize,
    /// Most hashes, token ids and extra-key values in one batch together
    /// (default 4 194 304), which bounds the decoded size of a batch.
    pub max_batch_items: usize,
    /// Longest byte-string hash (default 256 bytes).
    pub max_hash_bytes: usize,
    /// Longest string field (default 4 096 bytes).
    pub max_string_bytes: usize,
    /// Deepest nesting inside an extra key (default 16).
    pub max_value_depth: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        Self {
            max_payload_bytes: 16 << 20,
            max_events: 1 << 16,
            max_block_hashes: 1 << 16,
            max_token_ids: 1 << 20,
            max_batch_items: 1 << 22,
            max_hash_bytes: 256,
            max_string_bytes: 4096,
            max_value_depth: 16,
        }
    }
}
