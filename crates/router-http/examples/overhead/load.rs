//! Measuring a case: the load generator and its bodies

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use router_http::{Router, RouterConfig};
use tokio::net::{TcpListener, TcpStream};

use super::threads::{spawn_runtime, thread_cpu_ns, thread_id, thread_user_system_ticks};
use super::tokenized::{SERIAL, Tokens, Vocab, make_chat_bodies, tokenizer, with_serial};
use super::trace::{TraceMode, collector_cpu_ns, export_cpu_ns, pool_cpu_ns, trace_mode};
use super::{Case, Measured};

pub(super) fn measure(
    case: Case,
    upstream: SocketAddr,
    policy: Option<(&'static str, Tokens)>,
    duration: Duration,
) -> Measured {
    measure_bodies(case, upstream, policy, duration, None)
}

/// [`measure`] with the `tokenized` group's multi-turn bodies, and its
/// tokenizer when `policy` turns tokens on.
pub(super) fn measure_with(
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
    let message_memo_bytes = match policy {
        Some((_, Tokens::Cold)) => 0,
        _ => super::tokenized::PREFIX_MEMO_BYTES
            .get()
            .copied()
            .unwrap_or(prompt_tokens::DEFAULT_MESSAGE_MEMO_BYTES),
    };
    let tokenizers = tokenizer.clone().map(|t| {
        router_http::tokens::Tokenizers::default()
            .with_default(t)
            .with_message_memo(prompt_tokens::MessageMemo::new(message_memo_bytes))
    });
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
        spawn_router(&name, config, upstream)
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
    let (
        latencies,
        requests,
        elapsed,
        (cpu_ns, ticks),
        lookups,
        (compute, export_ns, collector_ns, pool_ns),
    ) = spawn_runtime("loadgen", move |rt| {
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
            let collector_before = collector_cpu_ns();
            let pool_before = pool_cpu_ns();
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
            let lookups = stats()
                .zip(stats_before)
                .map(|(after, before)| (after.hits - before.hits, after.misses - before.misses));
            let compute = compute_seconds()
                .zip(compute_before)
                .map(|(after, before)| after - before);
            let requests = latencies.len();
            let pool =
                (router_tid.is_some() && unique).then(|| pool_cpu_ns().saturating_sub(pool_before));
            let export = (trace_mode() != TraceMode::Off && router_tid.is_some())
                .then(|| export_cpu_ns().saturating_sub(export_before));
            let collector = export
                .is_some()
                .then(|| collector_cpu_ns().saturating_sub(collector_before));
            (
                latencies,
                requests,
                elapsed,
                (cpu, ticks),
                lookups,
                (compute, export, collector, pool),
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
        pool_cpu_us_per_req: pool_ns.map(|ns| ns as f64 / 1000.0 / requests.max(1) as f64),
        export_cpu_us_per_req: export_ns.map(|ns| ns as f64 / 1000.0 / requests.max(1) as f64),
        collector_cpu_us_per_req: collector_ns
            .map(|ns| ns as f64 / 1000.0 / requests.max(1) as f64),
    }
}

/// A router with `config` (and a connection pool large enough for every
/// connection of a case) routing to `upstream`, served on a thread of its
/// own named `name`: its address and thread id.
pub(super) fn spawn_router(
    name: &str,
    mut config: RouterConfig,
    upstream: SocketAddr,
) -> (SocketAddr, u32) {
    config.client.pool_max_idle_per_host = 1024;
    spawn_runtime(name, move |rt| {
        rt.block_on(async move {
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
}

pub(super) fn make_bodies(case: Case, count: usize) -> Vec<Bytes> {
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
pub(super) async fn run_load(
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
