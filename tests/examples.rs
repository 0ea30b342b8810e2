//! Runs the embedding examples the way a reader would and checks what they
//! print: the ones that terminate run to completion, the servers run their
//! `--self-test` (start, query themselves once, stop).
//!
//! Examples cannot be imported, so each test starts the example binary that
//! `cargo test` built next to this test (`target/<profile>/examples/NAME`).
//! When only this test target was built (`cargo test --test examples`),
//! the binaries may be missing or stale: build them with
//! `cargo build --examples` first.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Generous: an example does a few dozen requests against in-process
/// engines; this only stops a hung example from hanging the suite.
const TIMEOUT: Duration = Duration::from_secs(120);

fn example_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // target/<profile>/deps/examples-HASH -> target/<profile>/examples/NAME
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test binary lives in target/<profile>/deps");
    let path = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.exists(),
        "example binary {} is missing: `cargo test` builds it, `cargo test --test examples` does not; \
         run `cargo build --examples` first",
        path.display()
    );
    path
}

struct Run {
    success: bool,
    stdout: String,
    stderr: String,
}

/// Runs example `name` with `args` and `env` to completion (killing it
/// after [`TIMEOUT`]).
fn run(name: &str, args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut child = Command::new(example_path(name))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("starting example {name}: {err}"));
    // Read the pipes on their own threads so a chatty example cannot block
    // on a full pipe while we wait for it.
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the example") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let run = Run {
        success: status.is_some_and(|s| s.success()),
        stdout: out.join().expect("stdout reader"),
        stderr: err.join().expect("stderr reader"),
    };
    assert!(
        status.is_some(),
        "example {name} did not finish within {TIMEOUT:?}\nstdout:\n{}\nstderr:\n{}",
        run.stdout,
        run.stderr
    );
    run
}

fn assert_ok(name: &str, run: &Run, expected: &[&str]) {
    assert!(
        run.success,
        "example {name} failed\nstdout:\n{}\nstderr:\n{}",
        run.stdout, run.stderr
    );
    for line in expected {
        assert!(
            run.stdout.contains(line),
            "example {name} did not print {line:?}\nstdout:\n{}",
            run.stdout
        );
    }
}

#[test]
fn gateway_radix_routes_evicts_and_forgets_a_departed_backend() {
    let run = run("gateway_radix", &[], &[]);
    assert_ok(
        "gateway_radix",
        &run,
        &[
            "backend http://10.0.0.3:8000 left after",
            "(left)",
            "eviction rounds on the timer",
            "ok: every check passed",
        ],
    );
}

#[test]
fn custom_policy_decides_every_request_through_the_router() {
    let run = run("custom_policy", &[], &[]);
    assert_ok(
        "custom_policy",
        &run,
        &[
            "policy `top_k_least_loaded` decided 24 of 24 requests",
            "ok: every check passed",
        ],
    );
}

#[test]
fn custom_proxy_self_test_returns_every_load_to_zero() {
    // The environment variable is the switch CI scripts use.
    let run = run("custom_proxy", &[], &[("CUSTOM_PROXY_SELF_TEST", "1")]);
    assert_ok(
        "custom_proxy",
        &run,
        &[
            "loads back to 0; 6 requests processed, 0 underflows",
            "self-test ok",
        ],
    );
}

#[test]
fn embed_router_serves_the_host_route_and_the_router_routes() {
    let run = run("embed_router", &["--self-test"], &[]);
    assert_ok(
        "embed_router",
        &run,
        &[
            "GET /hello -> 200 OK: hello from the host",
            "POST /v1/chat/completions -> 200 OK",
            "self-test ok",
        ],
    );
}
