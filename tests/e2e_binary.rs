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

#[test]
fn sigterm_with_a_stream_in_flight_drains_and_exits_0() {
    let log_dir = std::env::temp_dir().join(format!("affinity-router-e2e-{}", std::process::id()));
    let mut child = Command::new(router_binary())
        .env_remove("RUST_LOG")
        .arg("--log-dir")
        .arg(&log_dir)
        .args([
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
        ])
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
    let mut child = Running(child);

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
        let kill = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
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
