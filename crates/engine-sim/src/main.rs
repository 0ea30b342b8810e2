//! `engine-sim`: one simulated vLLM engine on a port.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use engine_sim::fault::parse_duration;
use engine_sim::{EngineConfig, MoriIoMode, Role, ServeOptions, TransferFormat};
use prompt_tokens::PromptTokenizer;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum RoleArg {
    Regular,
    Prefill,
    Decode,
}

/// A simulated vLLM-style engine: OpenAI API, prefix KV cache, latency
/// model, P/D roles and fault injection. Durations accept `20us`, `250ms`,
/// `2s` or a bare number of milliseconds.
#[derive(Debug, Parser)]
#[command(name = "engine-sim", version)]
struct Args {
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// P/D role.
    #[arg(long, value_enum, default_value_t = RoleArg::Regular)]
    role: RoleArg,
    /// KV connector format for P/D.
    #[arg(long, value_enum, default_value_t = TransferFormat::Nixl)]
    kv_connector: TransferFormat,
    /// MoRI-IO mode.
    #[arg(long, value_enum, default_value_t = MoriIoMode::Read)]
    moriio_mode: MoriIoMode,
    /// Mooncake bootstrap port serving GET /query (prefill role).
    #[arg(long)]
    bootstrap_port: Option<u16>,
    /// Publish the prefix cache's changes as vLLM's KV-cache events on a
    /// ZMQ PUB socket on this port of --host (vLLM's example uses 5557).
    /// Off unless given.
    #[cfg(feature = "kv-events")]
    #[arg(long, value_name = "PORT")]
    kv_events_port: Option<u16>,
    /// Answer KV-event replay requests on a ZMQ ROUTER socket on this port
    /// (vLLM's example uses 5558). Needs --kv-events-port.
    #[cfg(feature = "kv-events")]
    #[arg(long, value_name = "PORT", requires = "kv_events_port")]
    kv_events_replay_port: Option<u16>,
    /// Fault injection: every N-th KV-event batch is kept for replay but
    /// not sent live (a dropped PUB message); subscribers recover it by
    /// replay. Needs --kv-events-port.
    #[cfg(feature = "kv-events")]
    #[arg(long, value_name = "N", requires = "kv_events_port")]
    kv_events_drop_every: Option<std::num::NonZeroU64>,
    /// Engine id (default engine-PORT).
    #[arg(long)]
    engine_id: Option<String>,
    /// Host advertised in kv_transfer_params.
    #[arg(long, default_value = "127.0.0.1")]
    advertise_host: String,
    /// Served model name.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Characters per token of the synthetic tokenizer (without
    /// --tokenizer-path).
    #[arg(long, default_value_t = 4)]
    chars_per_token: usize,
    /// The model's tokenizer: a directory holding tokenizer.json (and
    /// tokenizer_config.json with the chat template, or chat_template.jinja),
    /// or a tokenizer.json file. Prompts, the prefix cache and usage then
    /// count that tokenizer's ids. Default: the synthetic tokenizer.
    #[arg(long, value_name = "DIR|FILE")]
    tokenizer_path: Option<PathBuf>,
    /// A Jinja chat template replacing the model's (needs --tokenizer-path).
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// How the chat template expects message content, as vLLM's flag of
    /// this name: auto (detected from the template), string or openai.
    #[arg(long, default_value = "auto", value_parser = ["auto", "string", "openai"])]
    chat_template_content_format: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV capacity in blocks.
    #[arg(long, default_value_t = 4096)]
    num_blocks: usize,
    /// Maximum running sequences.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Maximum prompt plus output tokens.
    #[arg(long, default_value_t = 32768)]
    max_model_len: usize,
    /// max_tokens when a request gives none.
    #[arg(long, default_value_t = 16)]
    default_max_tokens: u32,
    /// Fixed cost of a prefill step.
    #[arg(long, default_value = "2ms", value_parser = duration)]
    prefill_base: Duration,
    /// Cost per uncached prompt token.
    #[arg(long, default_value = "20us", value_parser = duration)]
    prefill_per_token: Duration,
    /// Fixed cost of a decode step.
    #[arg(long, default_value = "8ms", value_parser = duration)]
    decode_base: Duration,
    /// Extra decode cost per running sequence.
    #[arg(long, default_value = "100us", value_parser = duration)]
    decode_per_seq: Duration,
    /// Cost per prompt token received from a prefill engine.
    #[arg(long, default_value = "1us", value_parser = duration)]
    kv_transfer_per_token: Duration,
    /// How long a prefill engine keeps blocks for an unclaimed transfer.
    #[arg(long, default_value = "60s", value_parser = duration)]
    kv_hold_timeout: Duration,
    /// How long a decode engine waits for a push transfer to appear.
    #[arg(long, default_value = "10s", value_parser = duration)]
    kv_wait_timeout: Duration,
    /// Model time per real time (0 = no simulated latency).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Seed for generated text and fault draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Answer every generation request with this status.
    #[arg(long)]
    fault_status: Option<u16>,
    /// Fail the first N generation requests.
    #[arg(long, default_value_t = 0)]
    fault_fail_first: u32,
    /// Fail this fraction of generation requests.
    #[arg(long, default_value_t = 0.0)]
    fault_failure_rate: f64,
    /// Status for --fault-fail-first and --fault-failure-rate.
    #[arg(long)]
    fault_fail_status: Option<u16>,
    /// Stall this long after sending headers.
    #[arg(long, value_parser = duration)]
    fault_stall_after_headers: Option<Duration>,
    /// Stall this long before sending headers.
    #[arg(long, value_parser = duration)]
    fault_stall_before_headers: Option<Duration>,
    /// Reset the connection in the middle of every body.
    #[arg(long)]
    fault_reset_mid_body: bool,
    /// Warm up this long: /health is 503, requests wait.
    #[arg(long, value_parser = duration)]
    fault_slow_start: Option<Duration>,
    /// After this long, /health answers 503.
    #[arg(long, value_parser = duration)]
    fault_refuse_health_after: Option<Duration>,
}

fn duration(text: &str) -> Result<Duration, String> {
    parse_duration(text)
        .ok_or_else(|| format!("not a duration: {text:?} (use 20us, 250ms, 2s or 250)"))
}

impl Args {
    fn config(&self) -> EngineConfig {
        let mut config = EngineConfig {
            role: match self.role {
                RoleArg::Regular => Role::Regular,
                RoleArg::Prefill => Role::Prefill,
                RoleArg::Decode => Role::Decode,
            },
            kv_connector: self.kv_connector,
            moriio_mode: self.moriio_mode,
            engine_id: self.engine_id.clone(),
            advertise_host: self.advertise_host.clone(),
            time_scale: self.time_scale,
            kv_wait_timeout: self.kv_wait_timeout,
            ..EngineConfig::default()
        };
        let model = &mut config.model;
        model.model_name = self.model.clone();
        model.chars_per_token = self.chars_per_token;
        model.block_size = self.block_size;
        model.num_blocks = self.num_blocks;
        model.max_num_seqs = self.max_num_seqs;
        model.max_model_len = self.max_model_len;
        model.default_max_tokens = self.default_max_tokens;
        model.prefill_base = self.prefill_base;
        model.prefill_per_token = self.prefill_per_token;
        model.decode_base = self.decode_base;
        model.decode_per_seq = self.decode_per_seq;
        model.kv_transfer_per_token = self.kv_transfer_per_token;
        model.kv_hold_timeout = self.kv_hold_timeout;
        model.seed = self.seed;
        let faults = &mut config.faults;
        faults.fixed_status = self.fault_status;
        faults.fail_first = self.fault_fail_first;
        faults.failure_rate = self.fault_failure_rate;
        faults.fail_status = self.fault_fail_status;
        faults.stall_after_headers = self.fault_stall_after_headers;
        faults.stall_before_headers = self.fault_stall_before_headers;
        faults.reset_mid_body = self.fault_reset_mid_body;
        faults.slow_start = self.fault_slow_start;
        faults.refuse_health_after = self.fault_refuse_health_after;
        config
    }

    fn check(&self) -> Result<(), String> {
        if self.block_size == 0 || self.chars_per_token == 0 {
            return Err("--block-size and --chars-per-token must be at least 1".into());
        }
        if self.num_blocks == 0 || self.max_num_seqs == 0 {
            return Err("--num-blocks and --max-num-seqs must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.fault_failure_rate) {
            return Err("--fault-failure-rate must be within 0..=1".into());
        }
        if !(self.time_scale.is_finite() && self.time_scale >= 0.0) {
            return Err("--time-scale must be a finite number >= 0".into());
        }
        if self.chat_template.is_some() && self.tokenizer_path.is_none() {
            return Err(
                "--chat-template needs --tokenizer-path (the synthetic tokenizer has its own rendering)"
                    .into(),
            );
        }
        if self.chat_template_content_format != "auto" && self.tokenizer_path.is_none() {
            return Err(
                "--chat-template-content-format needs --tokenizer-path (the synthetic tokenizer has its own rendering)"
                    .into(),
            );
        }
        Ok(())
    }

    /// The tokenizer of --tokenizer-path / --chat-template, if given.
    fn tokenizer(&self) -> Result<Option<Arc<PromptTokenizer>>, String> {
        let Some(path) = &self.tokenizer_path else {
            return Ok(None);
        };
        let options = prompt_tokens::TokenizerOptions {
            // "auto" is None: detected from the template.
            content_format: prompt_tokens::ContentFormat::parse(&self.chat_template_content_format),
            ..prompt_tokens::TokenizerOptions::default()
        };
        PromptTokenizer::from_path_with(path, self.chat_template.as_deref(), options)
            .map(|t| Some(Arc::new(t)))
            .map_err(|e| {
                let template = self
                    .chat_template
                    .as_ref()
                    .map(|t| format!(" with chat template {}", t.display()))
                    .unwrap_or_default();
                format!(
                    "cannot load the tokenizer from {}{template}: {e}",
                    path.display()
                )
            })
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(message) = args.check() {
        eprintln!("engine-sim: {message}");
        return ExitCode::from(2);
    }
    let tokenizer = match args.tokenizer() {
        Ok(tokenizer) => tokenizer,
        Err(message) => {
            eprintln!("engine-sim: {message}");
            return ExitCode::from(2);
        }
    };
    let tokenizer_line = tokenizer.as_ref().map(|t| t.describe());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("engine-sim: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let options = ServeOptions {
            addr: SocketAddr::new(args.host, args.port),
            bootstrap_addr: args.bootstrap_port.map(|p| SocketAddr::new(args.host, p)),
            tokenizer,
            #[cfg(feature = "kv-events")]
            kv_events: args.kv_events_port.map(|port| {
                let mut kv = engine_sim::KvEventsOptions::new(SocketAddr::new(args.host, port));
                kv.replay = args
                    .kv_events_replay_port
                    .map(|p| SocketAddr::new(args.host, p));
                kv.drop_live_every = args.kv_events_drop_every;
                kv
            }),
            ..ServeOptions::default()
        };
        let engine = match engine_sim::spawn(args.config(), options).await {
            Ok(engine) => engine,
            Err(e) => {
                eprintln!(
                    "engine-sim: cannot listen on {}:{}: {e}",
                    args.host, args.port
                );
                return ExitCode::FAILURE;
            }
        };
        println!(
            "engine-sim {} ({}) serving {} on {}",
            engine.engine_id(),
            match args.role {
                RoleArg::Regular => "regular",
                RoleArg::Prefill => "prefill",
                RoleArg::Decode => "decode",
            },
            args.model,
            engine.url()
        );
        if let Some(bootstrap) = engine.bootstrap_addr() {
            println!("bootstrap GET /query on http://{bootstrap}");
        }
        #[cfg(feature = "kv-events")]
        if let Some(kv) = engine.kv_events_addr() {
            match engine.kv_events_replay_addr() {
                Some(replay) => {
                    println!("kv events: PUB on tcp://{kv}, replay on tcp://{replay}")
                }
                None => println!("kv events: PUB on tcp://{kv}"),
            }
        }
        if let Some(line) = &tokenizer_line {
            println!("tokenizer: {line}");
        }
        let _ = tokio::signal::ctrl_c().await;
        engine.shutdown().await;
        ExitCode::SUCCESS
    })
}
