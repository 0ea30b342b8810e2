//! The binary: starts, serves, and refuses bad flags with a message.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_engine-sim");

/// Kills the child even when an assertion fails.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn binary_serves_on_the_printed_address() {
    let mut child = Child(
        Command::new(BIN)
            .args([
                "--port",
                "0",
                "--time-scale",
                "0",
                "--role",
                "prefill",
                "--engine-id",
                "p-cli",
            ])
            .args(["--bootstrap-port", "0", "--kv-connector", "mooncake"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn engine-sim"),
    );
    let mut lines = BufReader::new(child.0.stdout.take().expect("stdout")).lines();
    let banner = lines.next().expect("banner").expect("utf-8");
    assert!(
        banner.contains("p-cli") && banner.contains("prefill"),
        "{banner}"
    );
    let url = banner.rsplit(' ').next().expect("url");
    let addr = url.trim_start_matches("http://");
    let bootstrap = lines.next().expect("bootstrap line").expect("utf-8");
    let bootstrap_addr = bootstrap
        .rsplit("http://")
        .next()
        .expect("bootstrap address")
        .to_owned();

    let get = |addr: &str, path: &str| {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        )
        .expect("write");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("read");
        response
    };
    let health = get(addr, "/health");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(health.to_ascii_lowercase().contains("x-worker-id: p-cli"));
    let query = get(&bootstrap_addr, "/query");
    assert!(query.contains(r#""engine_id":"p-cli""#), "{query}");
}

#[test]
fn bad_flags_exit_non_zero_with_a_message() {
    for args in [
        vec!["--fault-failure-rate", "1.5"],
        vec!["--role", "teacher"],
        vec!["--prefill-base", "soon"],
        vec!["--time-scale", "-1"],
    ] {
        let output = Command::new(BIN)
            .args(&args)
            .args(["--port", "0"])
            .output()
            .expect("run engine-sim");
        assert!(!output.status.success(), "{args:?} accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.trim().is_empty(), "{args:?}: no message");
    }
}

#[test]
fn a_tokenizer_that_does_not_load_is_refused_naming_the_path() {
    let output = Command::new(BIN)
        .args(["--port", "0", "--tokenizer-path", "/nonexistent"])
        .output()
        .expect("run engine-sim");
    assert!(!output.status.success(), "a missing tokenizer was accepted");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent"), "{stderr}");

    // A good model with a chat template that is not there.
    let dir = tempfile::tempdir().expect("temp dir");
    prompt_tokens::testing::write_model_dir(
        dir.path(),
        prompt_tokens::TemplateFamily::ChatMl,
        prompt_tokens::testing::TestTokenizerKind::ByteLevelRegex,
    )
    .expect("model dir");
    let model = dir.path().to_str().expect("utf-8 path");
    let output = Command::new(BIN)
        .args(["--port", "0", "--tokenizer-path", model])
        .args(["--chat-template", "/nonexistent/chat.jinja"])
        .output()
        .expect("run engine-sim");
    assert!(!output.status.success(), "a missing template was accepted");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent/chat.jinja"), "{stderr}");

    // A template without a tokenizer has nothing to apply to.
    let output = Command::new(BIN)
        .args(["--port", "0", "--chat-template", "/tmp/t.jinja"])
        .output()
        .expect("run engine-sim");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--tokenizer-path"), "{stderr}");

    // So does a content format, and a format vLLM does not name is refused.
    for (args, words) in [
        (
            &["--chat-template-content-format", "openai"][..],
            "--tokenizer-path",
        ),
        (
            &[
                "--tokenizer-path",
                model,
                "--chat-template-content-format",
                "json",
            ],
            "json",
        ),
    ] {
        let output = Command::new(BIN)
            .args(["--port", "0"])
            .args(args)
            .output()
            .expect("run engine-sim");
        assert!(!output.status.success(), "{args:?} was accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(words), "{args:?}: {stderr}");
    }
}

#[test]
fn binary_counts_prompt_tokens_with_the_given_tokenizer() {
    let dir = tempfile::tempdir().expect("temp dir");
    prompt_tokens::testing::write_model_dir(
        dir.path(),
        prompt_tokens::TemplateFamily::ChatMl,
        prompt_tokens::testing::TestTokenizerKind::ByteLevelRegex,
    )
    .expect("model dir");
    let model = dir.path().to_str().expect("utf-8 path");
    let mut child = Child(
        Command::new(BIN)
            .args([
                "--port",
                "0",
                "--time-scale",
                "0",
                "--tokenizer-path",
                model,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn engine-sim"),
    );
    let mut lines = BufReader::new(child.0.stdout.take().expect("stdout")).lines();
    let banner = lines.next().expect("banner").expect("utf-8");
    let addr = banner
        .rsplit(' ')
        .next()
        .expect("url")
        .trim_start_matches("http://")
        .to_owned();
    let described = lines.next().expect("tokenizer line").expect("utf-8");
    assert!(
        described.starts_with("tokenizer: tokens (tokenizer.json"),
        "{described}"
    );

    let body = r#"{"messages": [{"role": "user", "content": "What is the weather like in Paris today?"}], "max_tokens": 1}"#;
    let reference = prompt_tokens::PromptTokenizer::from_path(dir.path(), None).expect("load");
    let ids = reference
        .chat_tokens(&prompt_tokens::ChatRequest::from_json(body.as_bytes()).expect("chat"))
        .expect("render");
    let mut stream = TcpStream::connect(&addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(
        response.contains(&format!("\"prompt_tokens\":{},", ids.len())),
        "expected {} prompt tokens: {response}",
        ids.len()
    );
}

#[cfg(feature = "kv-events")]
#[test]
fn kv_events_flags_bind_and_print_both_sockets() {
    let mut child = Child(
        Command::new(BIN)
            .args(["--port", "0", "--time-scale", "0"])
            .args(["--kv-events-port", "0", "--kv-events-replay-port", "0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn engine-sim"),
    );
    let mut lines = BufReader::new(child.0.stdout.take().expect("stdout")).lines();
    let _banner = lines.next().expect("banner").expect("utf-8");
    let kv = lines.next().expect("kv events line").expect("utf-8");
    assert!(kv.starts_with("kv events: PUB on tcp://"), "{kv}");
    let addrs: Vec<&str> = kv
        .split("tcp://")
        .skip(1)
        .map(|s| s.split(',').next().expect("address").trim())
        .collect();
    assert_eq!(addrs.len(), 2, "PUB and replay: {kv}");
    for addr in addrs {
        let port: u16 = addr.rsplit(':').next().unwrap().parse().expect("port");
        assert_ne!(port, 0, "the bound port is printed: {kv}");
        // Something listens there (the ZMQ sockets speak ZMTP over TCP).
        TcpStream::connect(addr).expect("the KV-events socket accepts");
    }
}

#[cfg(feature = "kv-events")]
#[test]
fn a_replay_port_without_an_events_port_is_refused() {
    let output = Command::new(BIN)
        .args(["--port", "0", "--kv-events-replay-port", "0"])
        .output()
        .expect("run engine-sim");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--kv-events-port"), "{stderr}");
}
