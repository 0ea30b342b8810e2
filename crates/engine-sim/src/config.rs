//! Engine configuration: the model (tokens, cache, timing), the P/D role and
//! connector, and the faults to inject. Plain structs with documented
//! defaults; the binary maps its flags onto them.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What part of disaggregated serving an engine plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Role {
    /// A normal engine: prefill and decode in one place; `kv_transfer_params`
    /// are ignored, as vLLM without a KV connector does.
    #[default]
    Regular,
    /// A prefill engine (`kv_producer`): requests with
    /// `kv_transfer_params.do_remote_decode: true` compute the prompt, return
    /// one token and the parameters the decode engine needs.
    Prefill,
    /// A decode engine (`kv_consumer`): requests with
    /// `kv_transfer_params.do_remote_prefill: true` are validated against the
    /// producing prefill engine and then decoded.
    Decode,
}

impl Role {
    /// The lower-case name used on the command line and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Regular => "regular",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// The `kv_transfer_params` format an engine speaks: which KV connector's
/// fields a prefill engine produces and a decode engine checks.
///
/// Only the format: whether a router runs the two legs one after the other
/// or at once is the router's choice, which the engines do not see. Named
/// `TransferFormat` rather than after the connector because a router's
/// connector (pd-orchestrator's `KvConnector` strategies, `PdConnector`)
/// is more than its format. The names on the command line and in serde
/// are [`TransferFormat::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[non_exhaustive]
pub enum TransferFormat {
    /// NIXL (pull): the prefill response names its engine, block ids, host and
    /// port; the decode engine reads the blocks.
    #[default]
    Nixl,
    /// Mooncake (push): the router gives both legs a `transfer_id`; the
    /// prefill engine pushes the KV to the decode engine.
    Mooncake,
    /// MoRI-IO: READ mode pulls like NIXL (block ids from the prefill
    /// response), WRITE mode pushes like Mooncake (matched by `transfer_id`).
    /// Spelled `moriio` on the command line, as vLLM's connector is.
    #[cfg_attr(feature = "cli", value(name = "moriio"))]
    MoriIo,
}

impl TransferFormat {
    /// The lower-case name used on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferFormat::Nixl => "nixl",
            TransferFormat::Mooncake => "mooncake",
            TransferFormat::MoriIo => "moriio",
        }
    }
}

/// MoRI-IO transfer direction (the same two modes as pd-orchestrator's
/// `MoriIoMode`, which engine-sim does not depend on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[non_exhaustive]
pub enum MoriIoMode {
    /// The decode engine reads the prefill engine's blocks (sequential).
    #[default]
    Read,
    /// The prefill engine writes into the decode engine (concurrent legs).
    Write,
}

/// The engine model: tokenizer rule, KV cache geometry, scheduler limits and
/// the latency model. All durations are model time (see [`crate`] docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelConfig {
    /// The served model name (`/v1/models`, `model` in responses). Default
    /// `"sim-model"`.
    pub model_name: String,
    /// Unicode scalar values per token. Default 4.
    pub chars_per_token: usize,
    /// Tokens per KV block. Default 16 (vLLM's default block size).
    pub block_size: usize,
    /// KV capacity in blocks. Default 4096 (65,536 tokens).
    pub num_blocks: usize,
    /// Maximum running sequences; the rest wait in FIFO order. Default 64.
    pub max_num_seqs: usize,
    /// Maximum prompt plus output tokens of one request. Default 32,768.
    pub max_model_len: usize,
    /// `max_tokens` when the request gives none. Default 16.
    pub default_max_tokens: u32,
    /// Fixed cost of a scheduler step that prefills. Default 2 ms.
    pub prefill_base: Duration,
    /// Cost per uncached prompt token. Default 20 µs (50k tokens/s).
    pub prefill_per_token: Duration,
    /// Fixed cost of a step that decodes. Default 8 ms.
    pub decode_base: Duration,
    /// Extra decode cost per running sequence in the step. Default 100 µs.
    pub decode_per_seq: Duration,
    /// Cost per prompt token received from a prefill engine. Default 1 µs.
    pub kv_transfer_per_token: Duration,
    /// How long a prefill engine keeps blocks for a transfer nobody
    /// claimed. Default 60 s.
    pub kv_hold_timeout: Duration,
    /// Seed for generated text and fault draws. Default 0.
    pub seed: u64,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            model_name: "sim-model".to_owned(),
            chars_per_token: 4,
            block_size: 16,
            num_blocks: 4096,
            max_num_seqs: 64,
            max_model_len: 32_768,
            default_max_tokens: 16,
            prefill_base: Duration::from_millis(2),
            prefill_per_token: Duration::from_micros(20),
            decode_base: Duration::from_millis(8),
            decode_per_seq: Duration::from_micros(100),
            kv_transfer_per_token: Duration::from_micros(1),
            kv_hold_timeout: Duration::from_secs(60),
            seed: 0,
        }
    }
}

/// Faults injected by an engine on its own (per-request faults come from
/// the `x-sim-fault` header, see [`crate::fault`]).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct FaultConfig {
    /// Answer every generation request with this status and a JSON error.
    pub fixed_status: Option<u16>,
    /// Fail the first N generation requests with `fail_status`.
    pub fail_first: u32,
    /// Fail this fraction (0..=1) of generation requests with
    /// `fail_status`, drawn from the seeded generator.
    pub failure_rate: f64,
    /// The status used by `fail_first` and `failure_rate`; 500 when unset.
    pub fail_status: Option<u16>,
    /// Send the response headers, then send nothing for this long (real
    /// time; `Duration::MAX` means forever).
    pub stall_after_headers: Option<Duration>,
    /// Wait this long (real time) before sending response headers.
    pub stall_before_headers: Option<Duration>,
    /// Send the headers and the first body chunk, then reset the connection.
    pub reset_mid_body: bool,
    /// The engine warms up for this long after start (real time): `/health`
    /// answers 503 and generation requests wait until it is ready.
    pub slow_start: Option<Duration>,
    /// After this long (real time) `/health` answers 503 for good, while
    /// generation keeps working (a failing probe, not a failing engine).
    pub refuse_health_after: Option<Duration>,
}

/// Everything one HTTP engine needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineConfig {
    /// The engine model.
    pub model: ModelConfig,
    /// The P/D role. Default [`Role::Regular`].
    pub role: Role,
    /// The `kv_transfer_params` format. Default [`TransferFormat::Nixl`].
    pub kv_connector: TransferFormat,
    /// The MoRI-IO mode when `kv_connector` is MoRI-IO. Default READ.
    pub moriio_mode: MoriIoMode,
    /// The engine id reported in `kv_transfer_params`, `x-worker-id` and the
    /// Mooncake bootstrap answer. Default: `"engine-<port>"` once bound.
    pub engine_id: Option<String>,
    /// The host named in produced `kv_transfer_params`. Default
    /// `"127.0.0.1"`.
    pub advertise_host: String,
    /// Model time per real time: 1.0 sleeps the modelled latency, 0.01 runs
    /// a hundred times faster, 0.0 answers as fast as possible.
    pub time_scale: f64,
    /// How long (real time) a decode engine waits for a push transfer
    /// (Mooncake, MoRI-IO WRITE) that the named prefill has not produced
    /// yet. Default 10 s.
    pub kv_wait_timeout: Duration,
    /// Faults this engine injects.
    pub faults: FaultConfig,
}

impl EngineConfig {
    /// The default engine with no simulated latency (`time_scale` 0): the
    /// usual backend of integration tests and overhead benchmarks.
    pub fn instant() -> Self {
        EngineConfig {
            time_scale: 0.0,
            ..EngineConfig::default()
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            model: ModelConfig::default(),
            role: Role::Regular,
            kv_connector: TransferFormat::Nixl,
            moriio_mode: MoriIoMode::Read,
            engine_id: None,
            advertise_host: "127.0.0.1".to_owned(),
            time_scale: 1.0,
            kv_wait_timeout: Duration::from_secs(10),
            faults: FaultConfig::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The renamed types kept their names on the wire: serde (engine
    /// configurations) and, with `cli`, the binary's flag values.
    #[test]
    fn format_and_mode_names_are_the_wire_names() {
        let formats = [
            TransferFormat::Nixl,
            TransferFormat::Mooncake,
            TransferFormat::MoriIo,
        ];
        let names = formats.map(TransferFormat::as_str);
        assert_eq!(names, ["nixl", "mooncake", "moriio"]);
        for (format, name) in formats.into_iter().zip(names) {
            assert_eq!(serde_json::to_value(format).unwrap(), name);
            let back: TransferFormat = serde_json::from_value(name.into()).unwrap();
            assert_eq!(back, format);
            #[cfg(feature = "cli")]
            {
                use clap::ValueEnum;
                let value = format.to_possible_value().unwrap();
                assert_eq!(value.get_name(), name);
            }
        }
        for (mode, name) in [(MoriIoMode::Read, "read"), (MoriIoMode::Write, "write")] {
            assert_eq!(serde_json::to_value(mode).unwrap(), name);
            #[cfg(feature = "cli")]
            {
                use clap::ValueEnum;
                assert_eq!(mode.to_possible_value().unwrap().get_name(), name);
            }
        }
    }
}
