//! Router overhead: the same closed-loop load sent directly to a minimal
//! upstream and through the router, with round_robin, cache_aware, and
//! both on token ids (`tokenized`: gpt-oss's harmony chat template and the
//! real `o200k_base` vocabulary, as `--tokenizer-path o200k_base.tiktoken`
//! loads it; `--vocab o200k-tokenizers`: the same vocabulary as a
//! `tokenizer.json` through the `tokenizers` crate's pipeline; `--vocab
//! trained`: a small BPE tokenizer.json trained at startup and the Llama 3
//! template).
//!
//! ```sh
//! cargo run --release -p router-http --example overhead -- --json
//! cargo run --release -p router-http --example overhead -- --quick
//! cargo run --release -p router-http --example overhead -- --sustain 600
//! cargo run --release -p router-http --example overhead -- --only 1KB_stream16_32c
//! cargo run --release -p router-http --example overhead -- --json --upstream engine-sim
//! cargo run --release -p router-http --example overhead -- --only 1KB_nonstream_1c --vocab trained
//! ```
//!
//! `--trace on|ratio0|down|hanging` (needs the `otel` feature, which the
//! workspace build turns on) measures every routed case with OpenTelemetry
//! tracing: `on` samples every request and exports to an OTLP sink that
//! answers at once, `ratio0` samples none (spans are built, not recorded),
//! `down` exports to a closed port and `hanging` to a collector that
//! accepts and never answers. `export_cpu_us_per_req` is then the CPU of
//! the export threads (the SDK's batch processor and the export runtime)
//! per request, beside the router thread's own.
//!
//! `--sustain SECS` instead runs cache_aware at 32 connections with a unique
//! 1 KB prompt per request for SECS seconds, evicting the tree every 10 s to
//! a 2^20-character budget per worker, and prints the process RSS every
//! 30 s: it should stay flat once the tree reaches its budget.
//!
//! The upstream is a minimal hyper responder (a fixed chat completion, or 16
//! SSE chunks and `[DONE]`), so what is measured is the router, not an
//! engine. Cases: 1 KB and 8 KB chat bodies, non-streaming and 16-chunk
//! streaming, 32 and 256 connections, plus 1 connection for added latency.
//! Every request carries a different prompt (a shared prefix and a unique
//! suffix), so cache_aware does real tree work.
//!
//! Threads: the upstream, the router and the load generator each run on
//! their own single-threaded runtime, so the router's own CPU time per
//! request can be read from its thread's `/proc/self/task/*/schedstat` — the
//! most reliable figure on a shared machine. `router_user_share` is the part
//! of it spent in user space (the router's own code), from the thread's
//! clock ticks; the rest is the kernel's, which on loopback includes the
//! receive side of every packet the router sends and waking the load
//! generator's and the upstream's threads — a cost that grows when the
//! router is the bottleneck and those threads sleep. Throughput depends on
//! the machine's cores being shared by all three.

/// The reference router's allocator (its default feature `mimalloc`), so
/// the router measured here allocates as the shipped one does.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use router_http::{Router, RouterConfig};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};

#[path = "support/threads.rs"]
mod threads;
use threads::{spawn_runtime, thread_cpu_ns, thread_id, thread_user_system_ticks};

const COMPLETION: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there, how can I help you today?"},"finish_reason":"stop"}],"usage":{"prompt_tokens":250,"completion_tokens":10,"total_tokens":260}}"#;
const CHUNK: &str = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"token \"},\"finish_reason\":null}]}\n\n";

#[derive(Clone, Copy)]
struct Case {
    body_bytes: usize,
    stream: bool,
    connections: usize,
}

struct Measured {
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    router_cpu_us_per_req: Option<f64>,
    /// The share of the router thread's CPU time spent in user space (the
    /// rest is the kernel's), from its clock ticks.
    router_user_share: Option<f64>,
    /// With tokenization on: the segment cache's hits over its lookups
    /// during the measurement.
    segment_hit_rate: Option<f64>,
    /// With tokenization on: the router's time computing token ids
    /// (`router_tokens_compute_seconds_total`) per request, part of
    /// `router_cpu_us_per_req`.
    tokenize_us_per_req: Option<f64>,
    /// With `--trace`: the export threads' CPU time per request.
    export_cpu_us_per_req: Option<f64>,
}

/// `--trace`: how the routers trace.
#[derive(Clone, Copy, PartialEq, Debug)]
enum TraceMode {
    /// No tracing (the default).
    Off,
    /// Every request sampled, exported to a sink that answers at once.
    On,
    /// Sampling ratio 0: spans built, none recorded or exported.
    Ratio0,
    /// Every request sampled, the collector's port closed.
    Down,
    /// Every request sampled, the collector accepts and never answers.
    Hanging,
}

static TRACE: std::sync::OnceLock<TraceMode> = std::sync::OnceLock::new();

fn trace_mode() -> TraceMode {
    *TRACE.get().unwrap_or(&TraceMode::Off)
}

/// Starts the export pipeline for `mode` and installs its layer as the
/// process's subscriber.
#[cfg(feature = "otel")]
fn start_tracing(mode: TraceMode) {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let (endpoint, handle) = spawn_runtime("otel-export", move |rt| {
        let handle = rt.handle().clone();
        let endpoint = rt.block_on(async move {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            match mode {
                TraceMode::Down => drop(listener),
                TraceMode::Hanging => {
                    tokio::spawn(async move {
                        let mut held = Vec::new();
                        while let Ok((stream, _)) = listener.accept().await {
                            held.push(stream);
                        }
                    });
                }
                _ => {
                    tokio::spawn(async move {
                        while let Ok((stream, _)) = listener.accept().await {
                            tokio::spawn(async move {
                                let service = hyper::service::service_fn(
                                    |request: Request<hyper::body::Incoming>| async move {
                                        let _ = request.into_body().collect().await;
                                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                                    },
                                );
                                let _ = hyper::server::conn::http1::Builder::new()
                                    .serve_connection(TokioIo::new(stream), service)
                                    .await;
                            });
                        }
                    });
                }
            }
            format!("http://{addr}/v1/traces")
        });
        (endpoint, handle)
    });
    let config = router_http::otel::ExportConfig {
        endpoint,
        ..router_http::otel::ExportConfig::default()
    };
    let tracing = router_http::otel::Tracing::start(&config, handle).expect("tracing");
    tracing_subscriber::registry().with(tracing.layer()).init();
    // Exports until the process ends.
    static PIPELINE: std::sync::OnceLock<router_http::otel::Tracing> = std::sync::OnceLock::new();
    let _ = PIPELINE.set(tracing);
}

#[cfg(not(feature = "otel"))]
fn start_tracing(_: TraceMode) {
    eprintln!("--trace needs router-http's feature otel (cargo run --features otel ...)");
    std::process::exit(2);
}

/// On-CPU nanoseconds of the export threads (the SDK's batch processor
/// and the `otel-export` runtime).
fn export_cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| {
            let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
            let name = comm.trim();
            (name.starts_with("otel") || name.starts_with("OpenTelemetry"))
                .then(|| task.file_name().to_str()?.parse::<u32>().ok())
                .flatten()
        })
        .map(thread_cpu_ns)
        .sum()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let trace = match args
        .iter()
        .position(|a| a == "--trace")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
    {
        None | Some("off") => TraceMode::Off,
        Some("on") => TraceMode::On,
        Some("ratio0") => TraceMode::Ratio0,
        Some("down") => TraceMode::Down,
        Some("hanging") => TraceMode::Hanging,
        Some(other) => {
            eprintln!("--trace {other}: expected off, on, ratio0, down or hanging");
            std::process::exit(2);
        }
    };
    let _ = TRACE.set(trace);
    if trace != TraceMode::Off {
        start_tracing(trace);
    }
    let vocab = match args
        .iter()
        .position(|a| a == "--vocab")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
    {
        None | Some("o200k") => Vocab::O200k,
        Some("o200k-tokenizers") => Vocab::O200kTokenizers,
        Some("trained") => Vocab::Trained,
        Some("model") => {
            let value = |flag: &str| {
                args.iter()
                    .position(|a| a == flag)
                    .and_then(|i| args.get(i + 1))
                    .map(std::path::PathBuf::from)
            };
            let Some(dir) = value("--model-dir") else {
                eprintln!("--vocab model needs --model-dir DIR");
                std::process::exit(2);
            };
            let _ = MODEL.set((dir, value("--chat-template")));
            Vocab::Model
        }
        Some(other) => {
            eprintln!("--vocab {other}: expected o200k, o200k-tokenizers, trained or model");
            std::process::exit(2);
        }
    };
    let quick = args.iter().any(|a| a == "--quick");
    let duration = if quick {
        Duration::from_millis(400)
    } else {
        Duration::from_secs(3)
    };

    // `--upstream engine-sim`: an engine-sim engine with zero simulated
    // latency instead of the minimal responder (it parses the request and
    // streams one chunk per generated token, as an engine does).
    let engine_sim = args
        .iter()
        .position(|a| a == "--upstream")
        .and_then(|i| args.get(i + 1))
        .is_some_and(|name| name == "engine-sim");
    let upstream = if engine_sim {
        spawn_runtime("upstream", |rt| {
            rt.block_on(async {
                let config = engine_sim::EngineConfig {
                    model: engine_sim::ModelConfig {
                        model_name: "m".to_owned(),
                        ..Default::default()
                    },
                    ..engine_sim::EngineConfig::instant()
                };
                let engine = engine_sim::spawn(config, Default::default())
                    .await
                    .expect("engine-sim starts");
                // The engine stops when its handle drops; it lives as long
                // as the program.
                Box::leak(Box::new(engine)).addr()
            })
        })
    } else {
        spawn_runtime("upstream", |rt| rt.block_on(start_upstream()))
    };
    if let Some(seconds) = args
        .iter()
        .position(|a| a == "--sustain")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse::<u64>().ok())
    {
        sustain(upstream, Duration::from_secs(seconds));
        return;
    }
    let mut results = serde_json::Map::new();
    let mut cases = Vec::new();
    for body_bytes in [1024, 8 * 1024] {
        for stream in [false, true] {
            for connections in [1, 32, 256] {
                cases.push(Case {
                    body_bytes,
                    stream,
                    connections,
                });
            }
        }
    }
    if quick {
        cases.retain(|c| c.body_bytes == 1024 && c.connections != 256);
    }
    // `--only 1KB_nonstream_32c` runs one case (for profiling).
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    for case in cases {
        let name = format!(
            "{}KB_{}_{}c",
            case.body_bytes / 1024,
            if case.stream { "stream16" } else { "nonstream" },
            case.connections
        );
        if only.as_ref().is_some_and(|only| *only != name) {
            continue;
        }
        let direct = measure(case, upstream, None, duration);
        let chat_direct = measure_with(case, upstream, None, duration, vocab);
        let mut entry = serde_json::Map::new();
        entry.insert("direct_rps".into(), round(direct.rps).into());
        entry.insert("direct_p50_ms".into(), round3(direct.p50_ms).into());
        entry.insert("direct_p99_ms".into(), round3(direct.p99_ms).into());
        let figures = |routed: Measured, direct: &Measured| {
            let mut figures = serde_json::json!({
                "router_rps": round(routed.rps),
                "p50_ms": round3(routed.p50_ms),
                "p99_ms": round3(routed.p99_ms),
                "router_cpu_us_per_req": routed.router_cpu_us_per_req.map(round3),
                "router_user_share": routed.router_user_share.map(round3),
                "ratio_to_direct": round3(routed.rps / direct.rps),
            });
            if let Some(rate) = routed.segment_hit_rate {
                figures["segment_cache_hit_rate"] = round3(rate).into();
            }
            if let Some(us) = routed.tokenize_us_per_req {
                figures["tokenize_us_per_req"] = round3(us).into();
            }
            if let Some(us) = routed.export_cpu_us_per_req {
                figures["export_cpu_us_per_req"] = round3(us).into();
            }
            figures
        };
        for policy in ["round_robin", "cache_aware"] {
            let routed = measure(case, upstream, Some((policy, Tokens::Off)), duration);
            entry.insert(policy.into(), figures(routed, &direct));
        }
        // The same with tokenization on, on multi-turn chats (see
        // `make_chat_bodies`: every request ends in a message never seen
        // before): warm (the segment cache holds the earlier messages) for
        // both policies, and cold (no cache: the whole rendering tokenized
        // on every request) for cache_aware; `*_text` route these bodies on
        // text, the baseline of what tokenizing adds. `direct_rps` is these
        // bodies sent straight to the upstream.
        let mut tokenized = serde_json::Map::new();
        let described = match (vocab, MODEL.get()) {
            (Vocab::Model, Some((dir, template))) => format!(
                "model {} with {}",
                dir.display(),
                template
                    .as_ref()
                    .map_or("its own template".to_owned(), |t| t.display().to_string())
            ),
            _ => match chat_template_arg() {
                Some(template) => {
                    format!("{} replaced by {}", vocab.describe(), template.display())
                }
                None => vocab.describe().to_owned(),
            },
        };
        tokenized.insert("vocab".into(), described.into());
        let sample = make_chat_bodies(case, 1);
        let sample: serde_json::Value = serde_json::from_slice(&sample[0]).expect("body");
        tokenized.insert("body_bytes".into(), sample.to_string().len().into());
        tokenized.insert(
            "messages".into(),
            sample["messages"].as_array().map_or(0, Vec::len).into(),
        );
        tokenized.insert("direct_rps".into(), round(chat_direct.rps).into());
        for (key, policy, tokens) in [
            ("round_robin_text", "round_robin", Tokens::Off),
            ("cache_aware_text", "cache_aware", Tokens::Off),
            ("round_robin", "round_robin", Tokens::Warm),
            ("cache_aware", "cache_aware", Tokens::Warm),
            ("cache_aware_cold", "cache_aware", Tokens::Cold),
        ] {
            let routed = measure_with(case, upstream, Some((policy, tokens)), duration, vocab);
            tokenized.insert(key.into(), figures(routed, &chat_direct));
        }
        entry.insert(TOKENIZED.into(), serde_json::Value::Object(tokenized));
        if !json {
            eprintln!("{name}: {}", serde_json::Value::Object(entry.clone()));
        }
        results.insert(name, serde_json::Value::Object(entry));
    }
    println!("{}", serde_json::Value::Object(results));
}

/// Sustained load with unique prompts; prints RSS over time as JSON lines.
fn sustain(upstream: SocketAddr, duration: Duration) {
    let (addr, _) = spawn_runtime("router-sustain", move |rt| {
        rt.block_on(async move {
            let mut config = RouterConfig {
                policy: lb_policies::PolicyConfig::named("cache_aware"),
                eviction_interval: Duration::from_secs(10),
                ..RouterConfig::default()
            };
            config.policy.cache_aware.max_tree_size = 1 << 20;
            config.client.pool_max_idle_per_host = 1024;
            let router = Router::new(config).expect("config");
            // Two workers (two data-parallel ranks of the same upstream), so
            // the tree holds two tenants and eviction works per tenant.
            for rank in [0, 1] {
                router
                    .add_worker(
                        &format!("http://127.0.0.1:{}", upstream.port()),
                        Some(rank),
                        None,
                    )
                    .expect("worker");
            }
            let background = router.spawn_background();
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            tokio::spawn(async move {
                let _background = background; // as long as the server runs
                router.serve(listener, std::future::pending()).await;
            });
            (addr, thread_id())
        })
    });
    let case = Case {
        body_bytes: 1024,
        stream: false,
        connections: 32,
    };
    // One load-generator thread for the whole run: the figure is the
    // process's RSS, and a thread (and malloc arena) per round would grow it
    // on its own.
    spawn_runtime("loadgen-sustain", move |rt| {
        rt.block_on(async move {
            let started = Instant::now();
            let mut served = 0usize;
            let mut round = 0usize;
            while started.elapsed() < duration {
                // Fresh prompts every round: the tree keeps growing until evicted.
                let bodies = Arc::new(make_unique_bodies(case, 4096, round));
                round += 1;
                let window =
                    Duration::from_secs(30).min(duration.saturating_sub(started.elapsed()));
                served += run_load(addr, case, bodies, window, false).await.len();
                println!(
                    "{}",
                    serde_json::json!({
                        "elapsed_s": started.elapsed().as_secs(),
                        "requests": served,
                        "rss_mb": round3(rss_bytes() as f64 / 1e6),
                    })
                );
            }
        });
    });
}

fn make_unique_bodies(case: Case, count: usize, round: usize) -> Vec<Bytes> {
    make_bodies(case, count)
        .into_iter()
        .enumerate()
        .map(|(i, body)| {
            let text =
                String::from_utf8_lossy(&body).replacen("question ", &format!("r{round} q{i} "), 1);
            Bytes::from(text)
        })
        .collect()
}

/// Resident set size of this process.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|statm| statm.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn round(x: f64) -> f64 {
    x.round()
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Runs `f` on a new single-threaded runtime on a named thread; returns what
/// `f` hands back through the channel once started. The thread lives for the
/// rest of the program.
async fn start_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                continue;
            };
            let _ = socket.set_nodelay(true);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    |request: Request<hyper::body::Incoming>| async move {
                        let body = request
                            .into_body()
                            .collect()
                            .await
                            .map(|b| b.to_bytes())
                            .unwrap_or_default();
                        let stream = memchr_stream(&body);
                        let response = if stream {
                            let chunks = (0..16)
                                .map(|_| {
                                    Ok::<_, Infallible>(Frame::data(Bytes::from_static(
                                        CHUNK.as_bytes(),
                                    )))
                                })
                                .chain(std::iter::once(Ok(Frame::data(Bytes::from_static(
                                    b"data: [DONE]\n\n",
                                )))));
                            let body =
                                StreamBody::new(futures_util::stream::iter(chunks)).boxed_unsync();
                            Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(body)
                        } else {
                            let body = Full::new(Bytes::from_static(COMPLETION.as_bytes()))
                                .map_err(|never| match never {})
                                .boxed_unsync();
                            Response::builder()
                                .header("content-type", "application/json")
                                .body(body)
                        };
                        Ok::<_, Infallible>(response.expect("valid response"))
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            });
        }
    });
    addr
}

/// The `tokenized` group: round_robin and cache_aware with the router
/// computing each request's token ids. By default the chat is rendered with
/// gpt-oss's harmony template and tokenized with the real `o200k_base`
/// vocabulary (the ranks the `tiktoken-rs` crate embeds: no download);
/// `--vocab trained` uses the Llama 3 template and a BPE `tokenizer.json`
/// trained at startup. The bodies are multi-turn chats
/// ([`make_chat_bodies`]) whose last message is new on every request, so
/// with the segment cache this is the warm path (the earlier messages'
/// ids cached, the new message tokenized); `cache_aware_cold` has no
/// cache, so every request tokenizes its whole rendering.
const TOKENIZED: &str = "tokenized";

/// Whether and how the router tokenizes.
#[derive(Clone, Copy, PartialEq)]
enum Tokens {
    /// Routing on text.
    Off,
    /// On token ids, with the segment cache.
    Warm,
    /// On token ids, without a segment cache: every request tokenizes its
    /// whole rendering.
    Cold,
}

/// The `tokenized` group's vocabulary and chat template.
#[derive(Clone, Copy, PartialEq)]
enum Vocab {
    /// `o200k_base` and the harmony template.
    O200k,
    /// The same vocabulary as a `tokenizer.json`, encoded by the
    /// `tokenizers` crate's pipeline (how prompt-tokens encoded `.tiktoken`
    /// files before its direct encoder).
    O200kTokenizers,
    /// A small BPE trained at startup and the Llama 3 template.
    Trained,
    /// A real model directory ([`MODEL`]).
    Model,
}

/// `--chat-template FILE`, for `--vocab o200k` and `--vocab model`.
fn chat_template_arg() -> Option<std::path::PathBuf> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--chat-template")
        .and_then(|i| args.get(i + 1))
        .map(std::path::PathBuf::from)
}

/// `--model-dir` and `--chat-template` of `--vocab model`.
static MODEL: std::sync::OnceLock<(std::path::PathBuf, Option<std::path::PathBuf>)> =
    std::sync::OnceLock::new();

impl Vocab {
    fn describe(self) -> &'static str {
        match self {
            Vocab::O200k => "o200k_base (tiktoken-rs assets), harmony template",
            Vocab::O200kTokenizers => {
                "o200k_base as tokenizer.json (tokenizers pipeline), harmony template"
            }
            Vocab::Trained => "trained 600-token byte-level BPE, Llama 3 template",
            Vocab::Model => "a model directory (--model-dir, --chat-template)",
        }
    }
}

/// `o200k_base` in the tiktoken format, built once from the ranks
/// `tiktoken-rs` embeds.
fn o200k_text() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        let bpe = tiktoken_rs::o200k_base().expect("tiktoken-rs o200k_base");
        prompt_tokens::tiktoken::format_ranks(
            (0..prompt_tokens::tiktoken::O200K_FIRST_SPECIAL_ID)
                .map(|rank| (bpe.decode_bytes(&[rank]).expect("rank"), rank)),
        )
    })
}

fn tokenizer(tokens: Tokens, vocab: Vocab) -> Arc<prompt_tokens::PromptTokenizer> {
    use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
    let options = prompt_tokens::TokenizerOptions {
        cache_bytes: if tokens == Tokens::Cold {
            0
        } else {
            prompt_tokens::TokenizerOptions::default().cache_bytes
        },
        ..prompt_tokens::TokenizerOptions::default()
    };
    let tokenizer = match vocab {
        Vocab::O200k => {
            // `--chat-template FILE` replaces the harmony template written
            // for prompt-tokens (gpt-oss's own, for instance).
            let template = chat_template_arg().map_or_else(
                || prompt_tokens::templates::HARMONY.to_owned(),
                |path| std::fs::read_to_string(path).expect("--chat-template"),
            );
            let config = prompt_tokens::TokenizerConfig {
                chat_template: Some(template),
                ..prompt_tokens::TokenizerConfig::default()
            };
            prompt_tokens::PromptTokenizer::from_tiktoken(o200k_text(), config, options)
                .expect("o200k tokenizer")
        }
        Vocab::O200kTokenizers => {
            static JSON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
            let json = JSON.get_or_init(|| {
                prompt_tokens::tiktoken::tokenizer_json(o200k_text()).expect("tokenizer.json")
            });
            let config = prompt_tokens::TokenizerConfig {
                chat_template: Some(prompt_tokens::templates::HARMONY.to_owned()),
                ..prompt_tokens::TokenizerConfig::default()
            };
            prompt_tokens::PromptTokenizer::from_parts(json.as_bytes(), config, options)
                .expect("o200k tokenizer.json")
        }
        Vocab::Trained => {
            let dir = std::env::temp_dir().join(format!("overhead-model-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("temp dir");
            write_model_dir(
                &dir,
                prompt_tokens::TemplateFamily::Llama3,
                TestTokenizerKind::ByteLevelRegex,
            )
            .expect("model dir");
            let tokenizer = prompt_tokens::PromptTokenizer::from_path_with(&dir, None, options)
                .expect("tokenizer");
            let _ = std::fs::remove_dir_all(&dir);
            tokenizer
        }
        Vocab::Model => {
            let (dir, template) = MODEL.get().expect("--model-dir");
            prompt_tokens::PromptTokenizer::from_path_with(dir, template.as_deref(), options)
                .expect("the model directory")
        }
    };
    Arc::new(tokenizer)
}

/// Where the request number goes in a [`make_chat_bodies`] body: the load
/// generator writes each request's own number over it, so that the last
/// message is new every time.
const SERIAL: &[u8] = b"#000000000";

/// Multi-turn chats of `case.body_bytes` bytes: a system prompt, earlier
/// turns (the same in every body, as a conversation's history is from one
/// request to the next), and a new user message of about 200 bytes whose
/// [`SERIAL`] the load generator replaces with the request's number.
fn make_chat_bodies(case: Case, count: usize) -> Vec<Bytes> {
    let body_of = |system: &str, history: &[serde_json::Value], question: &str| {
        let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
        messages.extend(history.iter().cloned());
        messages.push(serde_json::json!({"role": "user", "content": question}));
        serde_json::json!({
            "model": "m",
            "messages": messages,
            "max_tokens": 16,
            "stream": case.stream,
        })
        .to_string()
    };
    let question = |i: usize| {
        format!(
            "Question {} from pool {}: which engine served the request with the longest \
             shared prefix, how many tokens matched, and would the answer change under \
             twice the load?",
            String::from_utf8_lossy(SERIAL),
            i % 10
        )
    };
    // Earlier turns while a whole one (about 250 bytes) still fits, then
    // the system prompt padded to the exact size.
    let mut system = "You are a helpful assistant for an operations team. You answer \
                      questions about request routing, caches and engines."
        .to_owned();
    let mut history = Vec::new();
    let mut turn = 0;
    while body_of(&system, &history, &question(0)).len() + 300 < case.body_bytes {
        history.push(serde_json::json!({"role": "user", "content": format!(
            "Turn {turn}: the p99 latency of engine {} rose to {} ms after the deploy; \
             is its cache cold?", turn % 4, 180 + turn * 7)}));
        history.push(serde_json::json!({"role": "assistant", "content": format!(
            "Probably: engine {} restarted at 10:{:02} and has served few repeated \
             prefixes since.", turn % 4, turn % 60)}));
        turn += 1;
    }
    let pad = " Be terse and precise.";
    loop {
        let len = body_of(&system, &history, &question(0)).len();
        let Some(need) = case.body_bytes.checked_sub(len).filter(|n| *n > 0) else {
            break;
        };
        system.push_str(&pad[..need.min(pad.len())]);
    }
    (0..count)
        .map(|i| Bytes::from(body_of(&system, &history, &question(i))))
        .collect()
}

/// Request numbers for [`SERIAL`], unique in the whole run.
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(0);

/// `body` with its [`SERIAL`] (at `at`) replaced by the next request number.
fn with_serial(body: &Bytes, at: usize) -> Bytes {
    let serial = format!(
        "#{:09}",
        NEXT_SERIAL.fetch_add(1, Ordering::Relaxed) % 1_000_000_000
    );
    let mut bytes = body.to_vec();
    bytes[at..at + SERIAL.len()].copy_from_slice(serial.as_bytes());
    Bytes::from(bytes)
}

/// Whether a request body asks for a stream (a cheap scan, no JSON parse:
/// the upstream must cost as little as possible).
fn memchr_stream(body: &[u8]) -> bool {
    body.windows(14).any(|w| w == b"\"stream\":true}")
}

fn measure(
    case: Case,
    upstream: SocketAddr,
    policy: Option<(&'static str, Tokens)>,
    duration: Duration,
) -> Measured {
    measure_bodies(case, upstream, policy, duration, None)
}

/// [`measure`] with the `tokenized` group's multi-turn bodies, and its
/// tokenizer when `policy` turns tokens on.
fn measure_with(
    case: Case,
    upstream: SocketAddr,
    policy: Option<(&'static str, Tokens)>,
    duration: Duration,
    vocab: Vocab,
) -> Measured {
    measure_bodies(case, upstream, policy, duration, Some(vocab))
}

fn measure_bodies(
    case: Case,
    upstream: SocketAddr,
    policy: Option<(&'static str, Tokens)>,
    duration: Duration,
    chats: Option<Vocab>,
) -> Measured {
    let bodies = Arc::new(match chats {
        Some(_) => make_chat_bodies(case, 512),
        None => make_bodies(case, 512),
    });
    let tokenizer = match (policy, chats) {
        (Some((_, tokens)), Some(vocab)) if tokens != Tokens::Off => {
            let tokenizer = tokenizer(tokens, vocab);
            // A body that failed to tokenize would be routed on text: make
            // sure this one is not.
            let request = prompt_tokens::ChatRequest::from_json(&bodies[0]).expect("request");
            tokenizer
                .chat_tokens(&request)
                .expect("the bodies tokenize");
            Some(tokenizer)
        }
        _ => None,
    };
    // A router of its own per measurement, on its own thread. The
    // tokenizers are shared with it, so their compute time can be read.
    let tokenizers = tokenizer
        .clone()
        .map(|t| router_http::tokens::Tokenizers::default().with_default(t));
    let router_tokenizers = tokenizers.clone();
    let router_thread = policy.map(|(policy, tokens)| {
        // Distinct names (at most 15 bytes, the kernel's limit) so that a
        // profile of a whole run tells the measurements apart.
        let mode = match tokens {
            Tokens::Off => "text",
            Tokens::Warm => "warm",
            Tokens::Cold => "cold",
        };
        let name = format!("rt-{}-{mode}", &policy[..policy.len().min(8)]);
        spawn_runtime(&name, move |rt| {
            rt.block_on(async move {
                let mut config = RouterConfig {
                    policy: lb_policies::PolicyConfig::named(policy),
                    ..RouterConfig::default()
                };
                if let Some(tokenizers) = router_tokenizers {
                    config.tokenizers = tokenizers;
                }
                #[cfg(feature = "otel")]
                {
                    config.trace.enabled = trace_mode() != TraceMode::Off;
                    if trace_mode() == TraceMode::Ratio0 {
                        config.trace.sampling_ratio = 0.0;
                    }
                }
                config.client.pool_max_idle_per_host = 1024;
                let router = Router::new(config).expect("config");
                router
                    .add_worker(&format!("http://{upstream}"), None, None)
                    .expect("worker");
                let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
                let addr = listener.local_addr().expect("addr");
                tokio::spawn(async move {
                    router.serve(listener, std::future::pending()).await;
                });
                (addr, thread_id())
            })
        })
    });
    let target = router_thread.map_or(upstream, |(addr, _)| addr);
    let router_tid = router_thread.map(|(_, tid)| tid);

    let unique = chats.is_some();
    let stats_tokenizer = tokenizer.clone();
    let compute_seconds = move || {
        tokenizers
            .as_ref()
            .and_then(|t| t.for_model("m"))
            .map(|entry| entry.compute_seconds())
    };
    let (latencies, requests, elapsed, (cpu_ns, ticks), lookups, (compute, export_ns)) =
        spawn_runtime("loadgen", move |rt| {
            rt.block_on(async move {
                // Warm-up: connections open, pools filled, the segment cache
                // holding the bodies' shared messages.
                run_load(
                    target,
                    case,
                    bodies.clone(),
                    Duration::from_millis(200),
                    unique,
                )
                .await;
                let stats = || stats_tokenizer.as_ref().map(|t| t.cache_stats());
                let stats_before = stats();
                let cpu_before = router_tid.map(thread_cpu_ns);
                let ticks_before = router_tid.map(thread_user_system_ticks);
                let compute_before = compute_seconds();
                let export_before = export_cpu_ns();
                let started = Instant::now();
                let latencies = run_load(target, case, bodies, duration, unique).await;
                let elapsed = started.elapsed();
                let cpu = router_tid
                    .map(thread_cpu_ns)
                    .zip(cpu_before)
                    .map(|(a, b)| a - b);
                let ticks = router_tid
                    .map(thread_user_system_ticks)
                    .zip(ticks_before)
                    .map(|((user, system), (user0, system0))| (user - user0, system - system0));
                let lookups = stats().zip(stats_before).map(|(after, before)| {
                    (after.hits - before.hits, after.misses - before.misses)
                });
                let compute = compute_seconds()
                    .zip(compute_before)
                    .map(|(after, before)| after - before);
                let requests = latencies.len();
                let export = (trace_mode() != TraceMode::Off && router_tid.is_some())
                    .then(|| export_cpu_ns().saturating_sub(export_before));
                (
                    latencies,
                    requests,
                    elapsed,
                    (cpu, ticks),
                    lookups,
                    (compute, export),
                )
            })
        });
    let mut sorted = latencies;
    sorted.sort_unstable();
    let pick = |q: f64| {
        sorted
            .get(((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1)))
            .map_or(0.0, |d: &Duration| d.as_secs_f64() * 1000.0)
    };
    Measured {
        rps: requests as f64 / elapsed.as_secs_f64(),
        p50_ms: pick(0.50),
        p99_ms: pick(0.99),
        router_cpu_us_per_req: cpu_ns.map(|ns| ns as f64 / 1000.0 / requests.max(1) as f64),
        router_user_share: ticks
            .filter(|(user, system)| user + system > 0)
            .map(|(user, system)| user as f64 / (user + system) as f64),
        segment_hit_rate: lookups
            .filter(|(hits, misses)| hits + misses > 0)
            .map(|(hits, misses)| hits as f64 / (hits + misses) as f64),
        tokenize_us_per_req: compute.map(|s| s * 1e6 / requests.max(1) as f64),
        export_cpu_us_per_req: export_ns.map(|ns| ns as f64 / 1000.0 / requests.max(1) as f64),
    }
}

fn make_bodies(case: Case, count: usize) -> Vec<Bytes> {
    let system = "You are a helpful assistant that answers questions about routing. ".repeat(64);
    (0..count)
        .map(|i| {
            let mut content = format!("question {i}: ");
            let skeleton = serde_json::json!({
                "model": "m",
                "messages": [
                    {"role": "system", "content": ""},
                    {"role": "user", "content": ""}
                ],
                "max_tokens": 16,
                "stream": case.stream,
            })
            .to_string();
            let room = case
                .body_bytes
                .saturating_sub(skeleton.len() + content.len());
            let system_part = &system[..room.min(system.len()) * 3 / 4];
            while content.len() < room - system_part.len() {
                content.push_str("abc ");
            }
            content.truncate(room - system_part.len());
            Bytes::from(
                serde_json::json!({
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": system_part},
                        {"role": "user", "content": content}
                    ],
                    "max_tokens": 16,
                    "stream": case.stream,
                })
                .to_string(),
            )
        })
        .collect()
}

/// `unique`: each request's body gets its own number over its [`SERIAL`].
async fn run_load(
    target: SocketAddr,
    case: Case,
    bodies: Arc<Vec<Bytes>>,
    duration: Duration,
    unique: bool,
) -> Vec<Duration> {
    let serial_at: Arc<Vec<Option<usize>>> = Arc::new(
        bodies
            .iter()
            .map(|body| {
                body.windows(SERIAL.len())
                    .position(|w| w == SERIAL)
                    .filter(|_| unique)
            })
            .collect(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::with_capacity(case.connections);
    for connection in 0..case.connections {
        let (stop, bodies, serial_at) = (stop.clone(), bodies.clone(), serial_at.clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let Ok(stream) = TcpStream::connect(target).await else {
                return latencies;
            };
            let _ = stream.set_nodelay(true);
            let Ok((mut sender, conn)) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
            else {
                return latencies;
            };
            tokio::spawn(conn);
            let mut i = connection;
            while !stop.load(Ordering::Relaxed) {
                let body = match serial_at[i % bodies.len()] {
                    Some(at) => with_serial(&bodies[i % bodies.len()], at),
                    None => bodies[i % bodies.len()].clone(),
                };
                i += case.connections;
                let request = Request::post("/v1/chat/completions")
                    .header("host", "bench")
                    .header("content-type", "application/json")
                    .body(Full::new(body))
                    .expect("request");
                let started = Instant::now();
                let Ok(response) = sender.send_request(request).await else {
                    break;
                };
                if !response.status().is_success() {
                    // A benchmark of error answers measures nothing.
                    eprintln!("the upstream answered {}: stopping", response.status());
                    std::process::exit(1);
                }
                if response.into_body().collect().await.is_err() {
                    break;
                }
                latencies.push(started.elapsed());
            }
            latencies
        }));
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap_or_default());
    }
    all
}
