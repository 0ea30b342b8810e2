//! Router overhead: the same closed-loop load sent directly to a minimal
//! upstream and through the router, with round_robin, cache_aware, and
//! both on token ids (`tokenized`: gpt-oss's harmony chat template and the
//! real `o200k_base` vocabulary, as `--tokenizer-path o200k_base.tiktoken`
//! loads it; `--vocab o200k-tokenizers`: the same vocabulary as a
//! `tokenizer.json` through the `tokenizers` crate's pipeline; `--vocab
//! trained`: a small BPE tokenizer.json trained at startup and the Llama 3
//! template). The `tokenizer.json` vocabularies are encoded by
//! prompt-tokens' direct byte-level BPE encoder; `--tokenizers-encoder`
//! keeps them on the `tokenizers` pipeline instead, for comparison.
//! `--prefix-memo-bytes N` bounds the warm tokenizers' prefix memo and
//! the router's message memo (0 turns both off, for comparison; the cold
//! measurements never have them).
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
//! With tokenization, `tokenize_us_per_req` is the router's time computing
//! token ids per request (`router_tokens_compute_seconds_total`: wall
//! time, inline on the router thread for a 1 KB body, on the tokenizer
//! pool for an 8 KB one) and `pool_cpu_us_per_req` the pool threads' own
//! CPU time per request (they are the runtimes' blocking threads, named
//! `blocking-pool`): the router's cost beside its thread's.
//!
//! `--trace on|ratio0|down|hanging` (needs the `otel` feature, which the
//! workspace build turns on) measures every routed case with OpenTelemetry
//! tracing: `on` samples every request and exports to an OTLP sink that
//! answers at once, `ratio0` samples none (spans are built, not recorded),
//! `down` exports to a closed port and `hanging` to a collector that
//! accepts and never answers. `export_cpu_us_per_req` is then the CPU of
//! the export threads (the pipeline's batching thread and the export runtime)
//! per request, beside the router thread's own; `collector_cpu_us_per_req`
//! is the in-process collector's, on a thread of its own and not part of
//! the router's cost (until 2026-12-06 it ran on the export runtime and
//! was counted in `export_cpu_us_per_req`). `--trace-batch N` and
//! `--trace-queue N` set the export's batch and queue sizes
//! (`ExportConfig::max_export_batch_size` and `max_queue_size`).
//!
//! `--trace paired` measures tracing against itself in one run, for the
//! `--only` cases (default `1KB_nonstream_32c`), round_robin and
//! cache_aware: an untraced and a traced router side by side, the load
//! sent to one at a time in `--rounds N` pairs (default 10) of
//! `--phase-ms MS` phases (default 1500), alternating which goes first
//! (`paired.rs`). It prints each router's CPU per request over all its
//! phases, the export threads' per traced request, the whole traced cost
//! over the untraced one, and the median and range of the per-round
//! ratios. `--pin` runs the routers on CPU 0 and every other thread on
//! CPU 1. The other routed groups are not run.
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

mod load;
#[cfg(feature = "otel")]
mod paired;
mod sustain;
mod tokenized;
mod trace;
mod upstream;

use std::time::Duration;

use load::{measure, measure_with};
use sustain::sustain;
use tokenized::{MODEL, TOKENIZED, Tokens, Vocab, chat_template_arg, make_chat_bodies};
use trace::{TRACE, TraceMode, start_tracing};
use upstream::start_upstream;

#[path = "../support/threads.rs"]
mod threads;
use threads::spawn_runtime;

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
    /// (`router_tokens_compute_seconds_total`, wall time) per request,
    /// part of `router_cpu_us_per_req` where a body is tokenized inline and
    /// on the tokenizer pool's threads where it is not.
    tokenize_us_per_req: Option<f64>,
    /// With tokenization on: the tokenizer pool's threads' own CPU time per
    /// request (the router's cost beside its thread's; unlike
    /// `tokenize_us_per_req`, not counting time a pool thread waited for a
    /// core).
    pool_cpu_us_per_req: Option<f64>,
    /// With `--trace`: the export threads' CPU time per request.
    export_cpu_us_per_req: Option<f64>,
    /// With `--trace`: the in-process collector's CPU time per request
    /// (not the router's: a real collector is another process).
    collector_cpu_us_per_req: Option<f64>,
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
        Some("paired") => TraceMode::Paired,
        Some(other) => {
            eprintln!("--trace {other}: expected off, on, ratio0, down, hanging or paired");
            std::process::exit(2);
        }
    };
    let _ = TRACE.set(trace);
    if trace != TraceMode::Off {
        let number = |flag: &str| {
            let value = args
                .iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1))?;
            match value.parse::<usize>() {
                Ok(n) if n > 0 => Some(n),
                _ => {
                    eprintln!("{flag} {value}: expected a positive number");
                    std::process::exit(2);
                }
            }
        };
        start_tracing(
            if trace == TraceMode::Paired {
                TraceMode::On
            } else {
                trace
            },
            number("--trace-batch"),
            number("--trace-queue"),
        );
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
    if args.iter().any(|a| a == "--tokenizers-encoder") {
        let _ = tokenized::TOKENIZERS_ENCODER.set(());
    }
    if let Some(bytes) = args
        .iter()
        .position(|a| a == "--prefix-memo-bytes")
        .and_then(|i| args.get(i + 1))
    {
        let Ok(bytes) = bytes.parse::<usize>() else {
            eprintln!("--prefix-memo-bytes {bytes}: expected a number of bytes");
            std::process::exit(2);
        };
        let _ = tokenized::PREFIX_MEMO_BYTES.set(bytes);
    }
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
    #[cfg(feature = "otel")]
    if trace == TraceMode::Paired {
        let number = |flag: &str, default: u64| {
            args.iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1))
                .map_or(default, |value| {
                    value.parse().unwrap_or_else(|_| {
                        eprintln!("{flag} {value}: expected a number");
                        std::process::exit(2);
                    })
                })
        };
        let rounds = number("--rounds", 10) as usize;
        let phase = Duration::from_millis(number("--phase-ms", 1500));
        let only = args
            .iter()
            .position(|a| a == "--only")
            .and_then(|i| args.get(i + 1))
            .map_or("1KB_nonstream_32c", String::as_str);
        for name in only.split(',') {
            let Some(case) = parse_case(name) else {
                eprintln!("--only {name}: expected a case such as 1KB_stream16_32c");
                std::process::exit(2);
            };
            let pin = args.iter().any(|a| a == "--pin");
            let figures = paired::paired(case, upstream, rounds, phase, pin);
            if !json {
                eprintln!("{name}: {figures}");
            }
            results.insert(name.to_owned(), figures);
        }
        println!("{}", serde_json::Value::Object(results));
        return;
    }
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
    // `--only 1KB_nonstream_32c` runs one case (for profiling);
    // `--only 1KB_nonstream_32c,8KB_nonstream_32c` those two, in one run.
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
        if only
            .as_ref()
            .is_some_and(|only| !only.split(',').any(|one| one == name))
        {
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
            if let Some(us) = routed.pool_cpu_us_per_req {
                figures["pool_cpu_us_per_req"] = round3(us).into();
            }
            if let Some(us) = routed.export_cpu_us_per_req {
                figures["export_cpu_us_per_req"] = round3(us).into();
            }
            if let Some(us) = routed.collector_cpu_us_per_req {
                figures["collector_cpu_us_per_req"] = round3(us).into();
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

/// A case's name as the results spell it (`1KB_stream16_32c`).
#[cfg(feature = "otel")]
fn parse_case(name: &str) -> Option<Case> {
    let mut parts = name.split('_');
    let body_bytes = parts.next()?.strip_suffix("KB")?.parse::<usize>().ok()? * 1024;
    let stream = match parts.next()? {
        "stream16" => true,
        "nonstream" => false,
        _ => return None,
    };
    let connections = parts.next()?.strip_suffix('c')?.parse().ok()?;
    parts.next().is_none().then_some(Case {
        body_bytes,
        stream,
        connections,
    })
}

fn round(x: f64) -> f64 {
    x.round()
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
