//! Router overhead: the same closed-loop load sent directly to a minimal
//! upstream and through the router, with round_robin, cache_aware, and
//! cache_aware on token ids (`tokenized`: the Llama 3 chat template and a
//! BPE tokenizer.json, the path `--tokenizer-path` takes).
//!
//! ```sh
//! cargo run --release -p router-http --example overhead -- --json
//! cargo run --release -p router-http --example overhead -- --quick
//! cargo run --release -p router-http --example overhead -- --sustain 600
//! cargo run --release -p router-http --example overhead -- --only 1KB_stream16_32c
//! cargo run --release -p router-http --example overhead -- --json --upstream engine-sim
//! ```
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
//! most reliable figure on a shared machine. Throughput depends on the
//! machine's cores being shared by all three.

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use router_http::{Router, RouterConfig};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};

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
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
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
        let mut entry = serde_json::Map::new();
        entry.insert("direct_rps".into(), round(direct.rps).into());
        entry.insert("direct_p50_ms".into(), round3(direct.p50_ms).into());
        entry.insert("direct_p99_ms".into(), round3(direct.p99_ms).into());
        let figures = |routed: Measured| {
            serde_json::json!({
                "router_rps": round(routed.rps),
                "p50_ms": round3(routed.p50_ms),
                "p99_ms": round3(routed.p99_ms),
                "router_cpu_us_per_req": routed.router_cpu_us_per_req.map(round3),
                "ratio_to_direct": round3(routed.rps / direct.rps),
            })
        };
        for policy in ["round_robin", "cache_aware"] {
            let routed = measure(case, upstream, Some((policy, Tokens::Off)), duration);
            entry.insert(policy.into(), figures(routed));
        }
        // The same with tokenization on: warm (the segment cache holds the
        // shared system prompt) for both policies, and cold (no cache: the
        // whole rendering tokenized on every request) for cache_aware.
        let mut tokenized = serde_json::Map::new();
        for (key, policy, tokens) in [
            ("round_robin", "round_robin", Tokens::Warm),
            ("cache_aware", "cache_aware", Tokens::Warm),
            ("cache_aware_cold", "cache_aware", Tokens::Cold),
        ] {
            let routed = measure(case, upstream, Some((policy, tokens)), duration);
            tokenized.insert(key.into(), figures(routed));
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
                served += run_load(addr, case, bodies, window).await.len();
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
fn spawn_runtime<T: Send + 'static>(
    name: &str,
    f: impl FnOnce(&tokio::runtime::Runtime) -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            let value = f(&runtime);
            tx.send(value).expect("main thread waits");
            runtime.block_on(std::future::pending::<()>());
        })
        .expect("thread");
    rx.recv().expect("runtime started")
}

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
/// computing each request's token ids, the chat rendered with the Llama 3
/// template and tokenized with a BPE `tokenizer.json` (trained at startup:
/// no model download). The bodies share their system prompt, so with the
/// segment cache this is the warm path (the system prompt's ids cached,
/// each request's new question tokenized); `cache_aware_cold` has no cache,
/// so every request tokenizes its whole rendering.
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

fn tokenizers(tokens: Tokens) -> router_http::tokens::Tokenizers {
    use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
    let dir = std::env::temp_dir().join(format!("overhead-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    write_model_dir(
        &dir,
        prompt_tokens::TemplateFamily::Llama3,
        TestTokenizerKind::ByteLevelRegex,
    )
    .expect("model dir");
    let options = prompt_tokens::TokenizerOptions {
        cache_bytes: if tokens == Tokens::Cold {
            0
        } else {
            prompt_tokens::TokenizerOptions::default().cache_bytes
        },
        ..prompt_tokens::TokenizerOptions::default()
    };
    let tokenizer =
        prompt_tokens::PromptTokenizer::from_path_with(&dir, None, options).expect("tokenizer");
    let _ = std::fs::remove_dir_all(&dir);
    router_http::tokens::Tokenizers::default().with_default(Arc::new(tokenizer))
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
    // A router of its own per measurement, on its own thread.
    let router_thread = policy.map(|(policy, tokens)| {
        let name = format!("router-{policy}");
        spawn_runtime(&name, move |rt| {
            rt.block_on(async move {
                let mut config = RouterConfig {
                    policy: lb_policies::PolicyConfig::named(policy),
                    ..RouterConfig::default()
                };
                if tokens != Tokens::Off {
                    config.tokenizers = tokenizers(tokens);
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

    let bodies = Arc::new(make_bodies(case, 512));
    let (latencies, requests, elapsed, cpu_ns) = spawn_runtime("loadgen", move |rt| {
        rt.block_on(async move {
            // Warm-up: connections open, pools filled.
            run_load(target, case, bodies.clone(), Duration::from_millis(200)).await;
            let cpu_before = router_tid.map(thread_cpu_ns);
            let started = Instant::now();
            let latencies = run_load(target, case, bodies, duration).await;
            let elapsed = started.elapsed();
            let cpu = router_tid
                .map(thread_cpu_ns)
                .zip(cpu_before)
                .map(|(a, b)| a - b);
            let requests = latencies.len();
            (latencies, requests, elapsed, cpu)
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

async fn run_load(
    target: SocketAddr,
    case: Case,
    bodies: Arc<Vec<Bytes>>,
    duration: Duration,
) -> Vec<Duration> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::with_capacity(case.connections);
    for connection in 0..case.connections {
        let (stop, bodies) = (stop.clone(), bodies.clone());
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
                let body = bodies[i % bodies.len()].clone();
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

/// This thread's kernel id.
fn thread_id() -> u32 {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|path| path.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// On-CPU nanoseconds of thread `tid` of this process.
fn thread_cpu_ns(tid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
