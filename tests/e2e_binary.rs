//! The built example, run as a user runs it: `target/debug/examples/router`.
//!
//! `cargo test` builds the examples before it runs tests; when only this
//! test target was built and a source is newer than the example, the test
//! runs `cargo build --example router` first, so it never runs a stale
//! binary.

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `target/<profile>/examples/router`, next to this test's own binary
/// (`target/<profile>/deps/e2e_binary-<hash>`), rebuilt first when a source
/// is newer than it.
fn router_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let binary = profile_dir
        .join("examples")
        .join(format!("router{}", std::env::consts::EXE_SUFFIX));
    let built = std::fs::metadata(&binary).and_then(|m| m.modified()).ok();
    if built.is_none_or(|built| newest_source() > built) {
        // `cargo test` builds the examples itself, so this runs only when
        // the test target alone was rebuilt (`cargo test --test e2e_binary`).
        let status = Command::new(env!("CARGO"))
            .args([
                "build",
                "--quiet",
                "-p",
                "affinity-router",
                "--example",
                "router",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building the example failed");
    }
    assert!(binary.exists(), "{} is missing", binary.display());
    binary
}

/// The newest modification time among the sources the example is built from.
fn newest_source() -> std::time::SystemTime {
    fn walk(path: &std::path::Path, newest: &mut std::time::SystemTime) {
        let Ok(meta) = std::fs::metadata(path) else {
            return;
        };
        if meta.is_dir() {
            for entry in std::fs::read_dir(path).into_iter().flatten().flatten() {
                walk(&entry.path(), newest);
            }
        } else if let Ok(modified) = meta.modified() {
            *newest = (*newest).max(modified);
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut newest = std::time::SystemTime::UNIX_EPOCH;
    for path in ["src", "examples/router.rs", "Cargo.toml", "Cargo.lock"] {
        walk(&root.join(path), &mut newest);
    }
    for entry in std::fs::read_dir(root.join("crates"))
        .into_iter()
        .flatten()
        .flatten()
    {
        walk(&entry.path().join("src"), &mut newest);
        walk(&entry.path().join("Cargo.toml"), &mut newest);
    }
    newest
}

/// Kills the child if a test fails half-way.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Waits for the child to exit, at most `limit`.
fn wait_exit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn version_bad_flags_and_a_failed_start() {
    let binary = router_binary();
    let version = Command::new(&binary).arg("--version").output().unwrap();
    assert_eq!(version.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&version.stdout).contains(env!("CARGO_PKG_VERSION")));

    let bad = Command::new(&binary)
        .args(["--cache-threshold", "7"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("--cache-threshold"), "{stderr}");
    assert_eq!(
        stderr.trim().lines().count(),
        1,
        "one clear message: {stderr}"
    );

    let pd = Command::new(&binary)
        .args([
            "--vllm-pd-disaggregation",
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2",
            "--worker-startup-timeout-secs",
            "1",
            "--worker-startup-check-interval",
            "1",
            "--port",
            "0",
            "--prometheus-port",
            "0",
            "--log-json",
        ])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert_eq!(pd.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&pd.stderr);
    assert!(
        stderr.contains("http://127.0.0.1:1"),
        "names the worker: {stderr}"
    );
    // --log-json: the log lines are JSON objects.
    let json_lines: Vec<serde_json::Value> = stderr
        .lines()
        .filter(|line| line.starts_with('{'))
        .map(|line| serde_json::from_str(line).expect("a JSON log line"))
        .collect();
    assert!(
        json_lines
            .iter()
            .any(|l| l["fields"]["message"] == "start-up failed"),
        "{stderr}"
    );
}

/// A router process started from the built example, with its address and
/// its logs (collected until it exits).
struct Started {
    child: Running,
    pid: u32,
    base: String,
    logs: std::thread::JoinHandle<String>,
}

/// Starts the example with `args` and waits for its banner.
fn start_router(args: &[&std::ffi::OsStr]) -> Started {
    let mut child = Command::new(router_binary())
        .env_remove("RUST_LOG")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let logs = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let pid = child.id();
    let child = Running(child);
    // The banner's first line says where it serves.
    let (banner_tx, banner_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        if let Some(Ok(line)) = lines.next() {
            let _ = banner_tx.send(line);
        }
        for _ in lines {}
    });
    let first = banner_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the banner is printed");
    let base = first
        .split_whitespace()
        .find(|word| word.starts_with("http://127.0.0.1:"))
        .unwrap_or_else(|| panic!("no address in {first:?}"))
        .to_owned();
    Started {
        child,
        pid,
        base,
        logs,
    }
}

fn os(args: &[&str]) -> Vec<std::ffi::OsString> {
    args.iter().map(std::ffi::OsString::from).collect()
}

fn sigterm(pid: u32) {
    let kill = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
}

#[test]
fn sigterm_with_a_stream_in_flight_drains_and_exits_0() {
    let log_dir = std::env::temp_dir().join(format!("affinity-router-e2e-{}", std::process::id()));
    let mut args = os(&[
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--sim-workers",
        "1",
        "--sim-time-scale",
        "0",
        "--shutdown-grace-period-secs",
        "20",
        "--api-key",
        "very-secret-key",
        "--log-dir",
    ]);
    args.push(log_dir.clone().into_os_string());
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let Started {
        mut child,
        pid,
        base,
        logs,
    } = start_router(&args);

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let get = |path: &str| {
            let request = Request::get(format!("{base}{path}"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            let client = client.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(10), client.request(request))
                    .await
                    .expect("answered")
                    .expect("no transport error")
                    .status()
            }
        };
        assert_eq!(get("/readiness").await, StatusCode::OK);
        let chat = Request::post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("authorization", "Bearer very-secret-key")
            .body(Full::new(Bytes::from_static(
                br#"{"model": "sim-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}"#,
            )))
            .unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), client.request(chat))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
        let answer = answer.into_body().collect().await.unwrap().to_bytes();
        let answer: serde_json::Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(answer["object"], "chat.completion");
        let stream = Request::post(format!("{base}/v1/completions"))
            .header("content-type", "application/json")
            .header("authorization", "Bearer very-secret-key")
            .header("x-sim-fault", "stall-after-headers=1s")
            .body(Full::new(Bytes::from_static(
                br#"{"model": "sim-model", "prompt": "Once upon a time", "max_tokens": 4, "stream": true}"#,
            )))
            .unwrap();
        let response = tokio::time::timeout(Duration::from_secs(10), client.request(stream))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);

        let signalled = Instant::now();
        sigterm(pid);
        // Readiness turns 503 at once, while the stream is still running.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if get("/readiness").await == StatusCode::SERVICE_UNAVAILABLE {
                break;
            }
            assert!(Instant::now() < deadline, "readiness did not turn 503");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let body = tokio::time::timeout(Duration::from_secs(10), response.into_body().collect())
            .await
            .expect("the stream finishes")
            .expect("without an error")
            .to_bytes();
        let text = String::from_utf8_lossy(&body);
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        let status = wait_exit(&mut child.0, Duration::from_secs(15)).expect("the router exits");
        assert_eq!(status.code(), Some(0));
        assert!(
            signalled.elapsed() < Duration::from_secs(20),
            "exited before the grace period ended"
        );
    });
    let logs = logs.join().unwrap();
    assert!(logs.contains("api_key=set"), "{logs}");
    assert!(
        !logs.contains("very-secret-key"),
        "a secret was logged: {logs}"
    );
    assert!(logs.contains("SIGTERM"), "{logs}");
    let file = std::fs::read_to_string(log_dir.join("affinity-router.log")).unwrap();
    assert!(
        file.contains("api_key=set") && file.contains("SIGTERM"),
        "{file}"
    );
    assert!(!file.contains("very-secret-key"));
    let _ = std::fs::remove_dir_all(log_dir);
}

#[test]
fn worker_urls_front_separately_started_engines() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let engines: Vec<_> = runtime.block_on(async {
        let mut engines = Vec::new();
        for _ in 0..2 {
            let config = affinity_router::sim::EngineConfig::instant();
            let options = affinity_router::sim::ServeOptions::default();
            engines.push(affinity_router::sim::spawn(config, options).await.unwrap());
        }
        engines
    });
    let urls: Vec<String> = engines.iter().map(|e| e.url()).collect();
    let mut args = os(&[
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--policy",
        "round_robin",
    ]);
    args.push("--worker-urls".into());
    args.extend(urls.iter().map(std::ffi::OsString::from));
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let Started {
        mut child,
        pid,
        base,
        logs,
    } = start_router(&args);
    runtime.block_on(async {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let mut served_by = std::collections::BTreeSet::new();
        for _ in 0..2 {
            let request = Request::post(format!("{base}/v1/completions"))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(
                    br#"{"model": "sim-model", "prompt": "Hello", "max_tokens": 2}"#,
                )))
                .unwrap();
            let response = tokio::time::timeout(Duration::from_secs(10), client.request(request))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            served_by.insert(
                response.headers()["x-worker-id"]
                    .to_str()
                    .unwrap()
                    .to_owned(),
            );
        }
        let ids: std::collections::BTreeSet<String> =
            engines.iter().map(|e| e.engine_id().to_owned()).collect();
        assert_eq!(served_by, ids, "round robin over both engines");
    });
    sigterm(pid);
    let status = wait_exit(&mut child.0, Duration::from_secs(15)).expect("the router exits");
    assert_eq!(status.code(), Some(0));
    let logs = logs.join().unwrap();
    for url in &urls {
        assert!(logs.contains(url.as_str()), "{logs}");
    }
    runtime.block_on(async {
        for engine in engines {
            engine.shutdown().await;
        }
    });
}

/// Two router processes over the same two engines, as two replicas behind
/// a plain load balancer: each session's turns alternate between them (the
/// second replica takes the sessions in reverse order, so that its fair
/// tie-breaking cannot line up with the first one's by chance). Returns
/// the engine id of every turn, per session.
fn replicas_alternate(policy: &str, sessions: usize, turns: usize) -> Vec<Vec<String>> {
    use affinity_router::sim::{EngineConfig, KvEventsOptions, ServeOptions};
    use affinity_router::tokens::testing::{TestTokenizerKind, write_model_dir};
    use affinity_router::tokens::{PromptTokenizer, TemplateFamily};

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The engines and the routers tokenize with the same model directory.
    let model = tempfile::tempdir().unwrap();
    write_model_dir(
        model.path(),
        TemplateFamily::ChatMl,
        TestTokenizerKind::ByteLevelRegex,
    )
    .unwrap();
    let tokenizer = std::sync::Arc::new(PromptTokenizer::from_path(model.path(), None).unwrap());
    let engines: Vec<_> = runtime.block_on(async {
        let mut engines = Vec::new();
        for _ in 0..2 {
            let any = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
            let options = ServeOptions {
                tokenizer: Some(std::sync::Arc::clone(&tokenizer)),
                kv_events: Some(KvEventsOptions::new(any).with_replay(any)),
                ..ServeOptions::default()
            };
            engines.push(
                affinity_router::sim::spawn(EngineConfig::instant(), options)
                    .await
                    .unwrap(),
            );
        }
        engines
    });
    // Each engine's publisher, in the config file's [workers."URL"] tables.
    let mut config = String::new();
    for engine in &engines {
        config.push_str(&format!(
            "[workers.\"{}\"]\nkv_events_endpoint = \"tcp://{}\"\nkv_events_replay_endpoint = \"tcp://{}\"\n",
            engine.url(),
            engine.kv_events_addr().unwrap(),
            engine.kv_events_replay_addr().unwrap(),
        ));
    }
    let config_path = model.path().join("router.toml");
    std::fs::write(&config_path, config).unwrap();
    let mut args = os(&["--port", "0", "--prometheus-port", "0", "--policy", policy]);
    args.extend(os(&["--tokenizer-path", model.path().to_str().unwrap()]));
    args.extend(os(&["--config", config_path.to_str().unwrap()]));
    args.push("--worker-urls".into());
    args.extend(engines.iter().map(|e| std::ffi::OsString::from(e.url())));
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let replicas = [start_router(&args), start_router(&args)];

    let placed = runtime.block_on(async {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let get = |url: String| {
            let client = client.clone();
            async move {
                let request = Request::get(url).body(Full::new(Bytes::new())).unwrap();
                let response = client.request(request).await.unwrap();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                serde_json::from_slice::<serde_json::Value>(&body).unwrap()
            }
        };
        let mut placed = vec![Vec::new(); sessions];
        for t in 0..turns {
            if policy == "kv_aware" {
                // Events are asynchronous: wait (bounded) until both
                // replicas' views match what each engine holds.
                let deadline = Instant::now() + Duration::from_secs(20);
                loop {
                    let mut in_sync = true;
                    for replica in &replicas {
                        let workers = get(format!("{}/workers", replica.base)).await;
                        for (engine, worker) in engines.iter().zip(workers.as_array().unwrap()) {
                            let held = engine.cached_block_hashes().len() as u64;
                            in_sync &= worker["kv_events"]["blocks"].as_u64() == Some(held);
                        }
                    }
                    if in_sync {
                        break;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "the replicas' views never matched the engines'"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            let (replica, order): (&Started, Vec<usize>) = if t % 2 == 0 {
                (&replicas[0], (0..sessions).collect())
            } else {
                (&replicas[1], (0..sessions).rev().collect())
            };
            for s in order {
                let mut messages = vec![serde_json::json!({
                    "role": "system",
                    "content": format!("Session {s} keeps the logbook of ship {s}. ").repeat(10),
                })];
                for earlier in 0..t {
                    messages.push(
                        serde_json::json!({"role": "user", "content": format!("Entry {earlier}?")}),
                    );
                    messages.push(serde_json::json!({"role": "assistant", "content": "Logged."}));
                }
                messages.push(serde_json::json!({"role": "user", "content": "Next entry?"}));
                let body = serde_json::json!({"model": "sim-model", "messages": messages, "max_tokens": 2});
                let request = Request::post(format!("{}/v1/chat/completions", replica.base))
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body.to_string())))
                    .unwrap();
                let response =
                    tokio::time::timeout(Duration::from_secs(10), client.request(request))
                        .await
                        .unwrap()
                        .unwrap();
                assert_eq!(response.status(), StatusCode::OK);
                let engine = response.headers()["x-worker-id"]
                    .to_str()
                    .unwrap()
                    .to_owned();
                let _ = response.into_body().collect().await;
                placed[s].push(engine);
            }
        }
        placed
    });
    for replica in replicas {
        sigterm(replica.pid);
        let mut child = replica.child;
        let status = wait_exit(&mut child.0, Duration::from_secs(15)).expect("the router exits");
        assert_eq!(status.code(), Some(0));
    }
    runtime.block_on(async {
        for engine in engines {
            engine.shutdown().await;
        }
    });
    placed
}

#[test]
fn two_router_processes_on_kv_events_keep_every_session_on_its_engine() {
    let placed = replicas_alternate("kv_aware", 6, 4);
    for (s, engines) in placed.iter().enumerate() {
        assert!(
            engines.iter().all(|e| e == &engines[0]),
            "kv_aware: session {s} moved between engines: {engines:?}"
        );
    }
    let first: std::collections::BTreeSet<&String> = placed.iter().map(|e| &e[0]).collect();
    assert_eq!(first.len(), 2, "both engines took sessions: {placed:?}");
}

#[test]
fn two_router_processes_on_cache_aware_alone_lose_sessions() {
    let placed = replicas_alternate("cache_aware", 6, 2);
    let moved = placed.iter().filter(|e| e[1] != e[0]).count();
    assert!(
        moved > 0,
        "the replicas' trees are private, so some second turns leave their engine: {placed:?}"
    );
}

/// The spans of every OTLP export a receiver on 127.0.0.1 got, decoded
/// with the OpenTelemetry protocol's messages.
type ReceivedSpans =
    std::sync::Arc<std::sync::Mutex<Vec<opentelemetry_proto::tonic::trace::v1::Span>>>;

/// Starts an OTLP/gRPC receiver (h2c, as vllm-router's default collector)
/// on `runtime`: each `TraceService/Export` call's length-prefixed message
/// is decoded, and answered with an empty response and `grpc-status: 0`
/// in the trailers. Returns its address and what it got.
fn otlp_receiver(runtime: &tokio::runtime::Runtime) -> (std::net::SocketAddr, ReceivedSpans) {
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    };
    use prost::Message as _;
    type Frames = http_body_util::StreamBody<
        futures_util::stream::Iter<
            std::vec::IntoIter<Result<hyper::body::Frame<Bytes>, hyper::Error>>,
        >,
    >;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let received = ReceivedSpans::default();
    let store = received.clone();
    runtime.spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let store = store.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                        let store = store.clone();
                        async move {
                            assert_eq!(
                                request.uri().path(),
                                "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
                            );
                            let body = request.into_body().collect().await?.to_bytes();
                            // One length-prefixed message, not compressed.
                            assert!(body.len() >= 5 && body[0] == 0, "not a gRPC message");
                            let export = ExportTraceServiceRequest::decode(body.slice(5..))
                                .expect("an ExportTraceServiceRequest");
                            let spans = export
                                .resource_spans
                                .into_iter()
                                .flat_map(|r| r.scope_spans)
                                .flat_map(|s| s.spans);
                            store.lock().unwrap().extend(spans);
                            let answer = ExportTraceServiceResponse::default().encode_to_vec();
                            let mut framed = vec![0];
                            framed.extend_from_slice(&(answer.len() as u32).to_be_bytes());
                            framed.extend_from_slice(&answer);
                            let mut trailers = http::HeaderMap::new();
                            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
                            let frames: Vec<Result<hyper::body::Frame<Bytes>, hyper::Error>> = vec![
                                Ok(hyper::body::Frame::data(Bytes::from(framed))),
                                Ok(hyper::body::Frame::trailers(trailers)),
                            ];
                            let body: Frames =
                                http_body_util::StreamBody::new(futures_util::stream::iter(frames));
                            Ok::<_, hyper::Error>(
                                http::Response::builder()
                                    .header("content-type", "application/grpc")
                                    .body(body)
                                    .unwrap(),
                            )
                        }
                    });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, received)
}

#[test]
fn vllm_routers_trace_flags_start_and_export_the_requests_spans() {
    let binary = router_binary();
    let bad = Command::new(&binary)
        .args(["--enable-trace", "--otel-sampling-ratio", "1.5"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("--otel-sampling-ratio"), "{stderr}");
    let json = Command::new(&binary)
        .args(["--enable-trace", "--otlp-traces-protocol", "http/json"])
        .output()
        .unwrap();
    assert_eq!(json.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&json.stderr);
    assert!(stderr.contains("--otlp-traces-protocol"), "{stderr}");

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (collector, received) = otlp_receiver(&runtime);
    // vllm-router's form: HOST:PORT, OTLP/gRPC in cleartext.
    let endpoint = collector.to_string();
    let args = os(&[
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--sim-workers",
        "1",
        "--sim-time-scale",
        "0",
        "--enable-trace",
        "--otlp-traces-endpoint",
        &endpoint,
        "--otel-sampling-ratio",
        "1.0",
        "--otel-excluded-paths",
        "/health,/metrics",
    ]);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let Started {
        mut child,
        pid,
        base,
        logs,
    } = start_router(&args);
    let trace_id = "5b8efff798038103d269b633813fc60c";
    runtime.block_on(async {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let health = Request::get(format!("{base}/health"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let health = tokio::time::timeout(Duration::from_secs(10), client.request(health))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(health.status(), StatusCode::OK);
        let chat = Request::post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("traceparent", format!("00-{trace_id}-eee19b7ec3c1b174-01"))
            .body(Full::new(Bytes::from_static(
                br#"{"model": "sim-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}"#,
            )))
            .unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), client.request(chat))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
        let _ = answer.into_body().collect().await.unwrap();
        // The trace export's span counters are on /metrics.
        let metrics = Request::get(format!("{base}/metrics"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let metrics = tokio::time::timeout(Duration::from_secs(10), client.request(metrics))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(metrics.status(), StatusCode::OK);
        let text = metrics.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&text);
        for series in [
            "router_trace_spans_exported_total ",
            "router_trace_spans_dropped_total{reason=\"queue_full\"} 0",
            "router_trace_spans_dropped_total{reason=\"export_failed\"} 0",
            "router_trace_spans_queued ",
        ] {
            assert!(text.contains(series), "no {series:?} in /metrics:\n{text}");
        }
    });
    // A clean stop exports what is left in the batch.
    sigterm(pid);
    let status = wait_exit(&mut child.0, Duration::from_secs(20)).expect("the router exits");
    assert_eq!(status.code(), Some(0));
    let logs = logs.join().unwrap();
    assert!(logs.contains("exporting OpenTelemetry traces"), "{logs}");
    assert!(
        !logs.contains("--enable-trace"),
        "no flag reported ignored: {logs}"
    );
    let spans = received.lock().unwrap().clone();
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let server = spans
        .iter()
        .find(|s| s.name == "POST /v1/chat/completions")
        .unwrap_or_else(|| panic!("no server span in {names:?}"));
    let hex: String = server.trace_id.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, trace_id);
    assert!(
        spans
            .iter()
            .any(|s| s.name == "route" && s.parent_span_id == server.span_id),
        "{names:?}"
    );
    assert!(!names.iter().any(|n| n.contains("/health")), "{names:?}");
}
