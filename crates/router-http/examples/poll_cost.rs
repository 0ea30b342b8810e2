//! What polling the engines' load costs the router: the router's thread
//! CPU with N workers polled (engine-reported load, see the `load_poll`
//! module) against the same router with polling off, first with no
//! request traffic (the difference is the poller alone), then under a
//! closed-loop load of 1 KB chat requests (`--connections C`, default 32;
//! 0 skips it), as CPU per request.
//!
//! ```sh
//! cargo run --release -p router-http --example poll_cost -- --workers 1000
//! cargo run --release -p router-http --example poll_cost -- --workers 1000 --source get_load
//! ```
//!
//! Each worker is a listener of its own on 127.0.0.1 (one thread serves
//! all of them) answering `GET /metrics` with the body an engine-sim
//! engine serves (vLLM's gauge names; `--source metrics`, the default) or
//! `GET /get_load` with `{"load": 3}` (`--source get_load`: /metrics
//! answers 404, so the poller settles on the small body), and any POST
//! with a fixed chat completion. The router (round_robin over all the
//! workers) runs
//! on a current-thread runtime of its own, as in the `overhead` example,
//! so its CPU time is read from its thread's schedstat. Options:
//! `--workers N` (default 1,000), `--seconds S` (per phase, default 5),
//! `--interval-ms MS` (the poll interval, default the router's), `--json`.
//!
//! Divide the result by the router's CPU per request from `overhead` (at
//! the request rate of interest) to get the share polling adds per request;
//! at saturation a poller taking a fraction f of the thread adds f / (1 -
//! f) to every request's CPU.

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use router_http::load_poll::LoadPollConfig;
use router_http::{Router, RouterConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[allow(dead_code)] // not every example uses every helper
#[path = "support/threads.rs"]
mod threads;
use threads::{spawn_runtime, thread_cpu_ns, thread_id};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let number = |name: &str, default: u64| match value(name) {
        None => default,
        Some(text) => text.parse().unwrap_or_else(|_| {
            eprintln!("{name} {text}: expected a whole number");
            std::process::exit(2);
        }),
    };
    let workers = number("--workers", 1000) as usize;
    let seconds = number("--seconds", 5);
    let interval = value("--interval-ms")
        .map(|_| Duration::from_millis(number("--interval-ms", 50)))
        .or(LoadPollConfig::default().interval);
    let get_load = match value("--source").as_deref() {
        None | Some("metrics") => false,
        Some("get_load") => true,
        Some(other) => {
            eprintln!("--source {other}: expected metrics or get_load");
            std::process::exit(2);
        }
    };
    let json = args.iter().any(|a| a == "--json");
    let connections = number("--connections", 32) as usize;

    let metrics = if get_load {
        Bytes::new()
    } else {
        spawn_runtime("engine", |rt| rt.block_on(engine_metrics()))
    };
    let body_bytes = if get_load {
        GET_LOAD.len()
    } else {
        metrics.len()
    };
    let upstream = metrics.clone();
    let addrs = spawn_runtime("upstreams", move |rt| {
        rt.block_on(start_upstreams(workers, upstream, get_load))
    });

    let mut phases = serde_json::Map::new();
    for (name, poll) in [
        ("off", LoadPollConfig::off()),
        (
            "on",
            LoadPollConfig {
                interval,
                ..LoadPollConfig::default()
            },
        ),
    ] {
        let phase = measure(&addrs, poll, Duration::from_secs(seconds), connections);
        let mut entry = serde_json::json!({
            "router_cpu_ms_per_s": round3(phase.idle_cpu_ms_per_s),
            "engine_polls_per_s": round3(phase.polls_per_s),
        });
        if let Some((rps, cpu_us)) = phase.loaded {
            entry["loaded_rps"] = round3(rps).into();
            entry["loaded_router_cpu_us_per_req"] = round3(cpu_us).into();
        }
        if !json {
            eprintln!("polling {name}: {entry}");
        }
        phases.insert(name.into(), entry);
    }
    let per_s = |phase: &str, key: &str| phases[phase][key].as_f64().unwrap_or(0.0);
    let extra = per_s("on", "router_cpu_ms_per_s") - per_s("off", "router_cpu_ms_per_s");
    let polls = per_s("on", "engine_polls_per_s");
    let report = serde_json::json!({
        "workers": workers,
        "interval_ms": interval.map(|i| i.as_millis() as u64),
        "source": if get_load { "get_load" } else { "metrics" },
        "body_bytes": body_bytes,
        "phases": phases,
        "polling_cpu_share_of_a_core": round3(extra / 1000.0),
        "cpu_us_per_engine_poll": (polls > 0.0).then(|| round3(extra * 1000.0 / polls)),
        "loaded_cpu_per_req_on_over_off": (connections > 0).then(|| {
            round3(
                per_s("on", "loaded_router_cpu_us_per_req")
                    / per_s("off", "loaded_router_cpu_us_per_req"),
            )
        }),
    });
    println!("{report}");
}

/// What one phase measured.
struct Phase {
    /// The router thread's CPU, ms per second, without requests.
    idle_cpu_ms_per_s: f64,
    /// Engine polls per second.
    polls_per_s: f64,
    /// Under load: requests per second and the router thread's CPU per
    /// request, in µs.
    loaded: Option<(f64, f64)>,
}

/// One phase: a router with `poll` as its load polling and `addrs` as its
/// workers, measured idle over `window`, then under `connections`
/// closed-loop connections over `window`.
fn measure(
    addrs: &[SocketAddr],
    poll: LoadPollConfig,
    window: Duration,
    connections: usize,
) -> Phase {
    let urls: Vec<String> = addrs.iter().map(|a| format!("http://{a}")).collect();
    let (tid, polls, router_addr) = spawn_runtime("router", move |rt| {
        rt.block_on(async move {
            let mut config = RouterConfig {
                load_poll: poll,
                policy: lb_policies::PolicyConfig::named("round_robin"),
                ..RouterConfig::default()
            };
            // Connections to every engine kept between rounds.
            config.client.pool_max_idle_per_host = 4;
            let router = Router::new(config).expect("config");
            for url in &urls {
                router.add_worker(url, None, None).expect("worker");
            }
            let background = router.spawn_background();
            let polls = router.load_polls().cloned();
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            tokio::spawn(async move {
                let _background = background; // polls as long as the server runs
                router.serve(listener, std::future::pending()).await;
            });
            (thread_id(), polls, addr)
        })
    });
    let count = || {
        polls.as_ref().map_or(0, |p| {
            router_http::load_poll::LoadSource::ALL
                .into_iter()
                .map(|source| p.reports(source))
                .sum::<u64>()
        })
    };
    // A warm-up round: connections opened, sources settled.
    std::thread::sleep(Duration::from_secs(1));
    let (cpu0, polls0, started) = (thread_cpu_ns(tid), count(), Instant::now());
    std::thread::sleep(window);
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_ms = (thread_cpu_ns(tid) - cpu0) as f64 / 1e6;
    let polled = (count() - polls0) as f64;
    let loaded = (connections > 0).then(|| {
        let cpu0 = thread_cpu_ns(tid);
        let started = Instant::now();
        let requests = spawn_runtime("loadgen", move |rt| {
            rt.block_on(closed_loop(router_addr, connections, window))
        });
        let elapsed = started.elapsed().as_secs_f64();
        let cpu_us = (thread_cpu_ns(tid) - cpu0) as f64 / 1e3;
        (requests as f64 / elapsed, cpu_us / requests.max(1) as f64)
    });
    Phase {
        idle_cpu_ms_per_s: cpu_ms / elapsed,
        polls_per_s: polled / elapsed,
        loaded,
    }
}

/// `connections` keep-alive connections sending 1 KB chat requests to
/// `target` back to back for `window`; returns the requests answered.
async fn closed_loop(target: SocketAddr, connections: usize, window: Duration) -> usize {
    let body = Bytes::from(format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "lorem ipsum ".repeat(84)
    ));
    let deadline = Instant::now() + window;
    let mut tasks = Vec::with_capacity(connections);
    for _ in 0..connections {
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let mut answered = 0usize;
            let Ok(stream) = TcpStream::connect(target).await else {
                return answered;
            };
            let _ = stream.set_nodelay(true);
            let Ok((mut sender, conn)) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
            else {
                return answered;
            };
            tokio::spawn(conn);
            while Instant::now() < deadline {
                let request = Request::post("/v1/chat/completions")
                    .header("host", "bench")
                    .header("content-type", "application/json")
                    .body(Full::new(body.clone()))
                    .expect("request");
                let Ok(response) = sender.send_request(request).await else {
                    break;
                };
                assert!(response.status().is_success(), "{}", response.status());
                if response.into_body().collect().await.is_err() {
                    break;
                }
                answered += 1;
            }
            answered
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap_or(0);
    }
    total
}

const GET_LOAD: &str = r#"{"load": 3}"#;
const COMPLETION: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there."},"finish_reason":"stop"}],"usage":{"prompt_tokens":250,"completion_tokens":3,"total_tokens":253}}"#;

/// The `/metrics` body an engine-sim engine serves, read once.
async fn engine_metrics() -> Bytes {
    let engine = engine_sim::spawn(engine_sim::EngineConfig::instant(), Default::default())
        .await
        .expect("engine-sim starts");
    let mut stream = TcpStream::connect(engine.addr()).await.expect("connect");
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: engine\r\n\r\n")
        .await
        .expect("request");
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).await.expect("reply");
    let at = reply
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    Bytes::copy_from_slice(&reply[at + 4..])
}

/// `workers` listeners on 127.0.0.1, each answering the load source.
async fn start_upstreams(workers: usize, metrics: Bytes, get_load: bool) -> Vec<SocketAddr> {
    let mut addrs = Vec::with_capacity(workers);
    for _ in 0..workers {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        addrs.push(listener.local_addr().expect("addr"));
        let metrics = metrics.clone();
        tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    continue;
                };
                let metrics = metrics.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request: Request<_>| {
                        let metrics = metrics.clone();
                        async move {
                            let _: &Request<hyper::body::Incoming> = &request;
                            let (status, body) = match request.uri().path() {
                                "/metrics" if !get_load => (StatusCode::OK, metrics),
                                "/get_load" if get_load => {
                                    (StatusCode::OK, Bytes::from_static(GET_LOAD.as_bytes()))
                                }
                                "/health" => (StatusCode::OK, Bytes::new()),
                                _ if request.method() == http::Method::POST => {
                                    (StatusCode::OK, Bytes::from_static(COMPLETION.as_bytes()))
                                }
                                _ => (StatusCode::NOT_FOUND, Bytes::new()),
                            };
                            let mut response = Response::new(Full::new(body));
                            *response.status_mut() = status;
                            Ok::<_, Infallible>(response)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(socket), service)
                        .await;
                });
            }
        });
    }
    addrs
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
