//! The registration-label contract between discovery listeners and worker
//! pools: the keys a listener sets on a [`Registration`](crate::Registration)
//! from what an engine announced, and that a prefill/decode pool reads to
//! address the engine (its KV side channel, MoRI-IO ports, Mooncake engine
//! ids). One list, so a writer and a reader cannot drift apart.

/// KV side-channel address (`host:port`) for the P2P request id.
pub const KV_ADDR: &str = "kv_addr";
/// MoRI-IO handshake port.
pub const MORIIO_HANDSHAKE_PORT: &str = "moriio_handshake_port";
/// MoRI-IO notify port.
pub const MORIIO_NOTIFY_PORT: &str = "moriio_notify_port";
/// MoRI-IO mode the engine runs (`read` or `write`): a worker whose
/// mode differs from the router's connector is refused.
pub const MORIIO_MODE: &str = "moriio_mode";
/// Data-parallel size of the engine.
pub const DP_SIZE: &str = "dp_size";
/// Tensor-parallel size of the engine.
pub const TP_SIZE: &str = "tp_size";
/// Mooncake engine id of DP rank 0 (`mooncake_engine_id`) or of rank N
/// (`mooncake_engine_id.N`), when the listener already knows them.
pub const MOONCAKE_ENGINE_ID: &str = "mooncake_engine_id";
/// Where the engine publishes its KV-cache events (`tcp://host:port`, rank
/// 0's socket with data parallelism), when it announced it.
pub const KV_EVENTS_ENDPOINT: &str = "kv_events_endpoint";
/// The engine's KV event replay socket (`tcp://host:port`), when it
/// announced it.
pub const KV_EVENTS_REPLAY_ENDPOINT: &str = "kv_events_replay_endpoint";
