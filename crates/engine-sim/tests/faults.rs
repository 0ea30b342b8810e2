//! Every fault mode, observed from a client under tokio's paused clock.

mod common;

use std::time::Duration;

use common::{get, open, send};
use engine_sim::{EngineConfig, EngineHandle, FaultConfig, ServeOptions, spawn};
use http_body_util::BodyExt;

const CHAT: &str = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}"#;
const STREAM: &str =
    r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}"#;

async fn engine(faults: FaultConfig) -> EngineHandle {
    let config = EngineConfig {
        time_scale: 0.0,
        faults,
        ..EngineConfig::default()
    };
    spawn(config, ServeOptions::default()).await.expect("spawn")
}

async fn chat_status(engine: &EngineHandle, headers: &[(&str, &str)]) -> u16 {
    send(
        engine.addr(),
        "POST",
        "/v1/chat/completions",
        Some(CHAT),
        headers,
    )
    .await
    .status
    .as_u16()
}

#[tokio::test(start_paused = true)]
async fn header_status_fault_returns_a_json_error() {
    let engine = engine(FaultConfig::default()).await;
    let reply = send(
        engine.addr(),
        "POST",
        "/v1/chat/completions",
        Some(CHAT),
        &[("x-sim-fault", "status=503")],
    )
    .await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.headers["x-worker-id"], engine.engine_id());
    assert_eq!(reply.json()["error"]["code"], 503);
    assert_eq!(chat_status(&engine, &[]).await, 200);
    let bad = send(
        engine.addr(),
        "POST",
        "/v1/chat/completions",
        Some(CHAT),
        &[("x-sim-fault", "stall-forever")],
    )
    .await;
    assert_eq!(bad.status, 400, "a typo in the fault header is an error");
    assert_eq!(engine.faults_injected(), 1);
}

#[tokio::test(start_paused = true)]
async fn fixed_status_fail_first_and_failure_rate() {
    let fixed = engine(FaultConfig {
        fixed_status: Some(429),
        ..FaultConfig::default()
    })
    .await;
    assert_eq!(chat_status(&fixed, &[]).await, 429);
    assert_eq!(chat_status(&fixed, &[]).await, 429);
    // Health and metadata are unaffected.
    assert_eq!(get(fixed.addr(), "/health").await.status, 200);

    let first_two = engine(FaultConfig {
        fail_first: 2,
        fail_status: Some(502),
        ..FaultConfig::default()
    })
    .await;
    let statuses = [
        chat_status(&first_two, &[]).await,
        chat_status(&first_two, &[]).await,
        chat_status(&first_two, &[]).await,
    ];
    assert_eq!(statuses, [502, 502, 200]);

    let always = engine(FaultConfig {
        failure_rate: 1.0,
        ..FaultConfig::default()
    })
    .await;
    assert_eq!(chat_status(&always, &[]).await, 500);

    let half = engine(FaultConfig {
        failure_rate: 0.5,
        ..FaultConfig::default()
    })
    .await;
    let mut failures = 0;
    for _ in 0..40 {
        if chat_status(&half, &[]).await == 500 {
            failures += 1;
        }
    }
    assert!((5..35).contains(&failures), "{failures} of 40 failed");
    assert_eq!(half.faults_injected(), failures);
}

#[tokio::test(start_paused = true)]
async fn stall_before_headers_delays_or_withholds_the_head() {
    let engine = engine(FaultConfig::default()).await;
    let pending = tokio::time::timeout(
        Duration::from_secs(60),
        open(
            engine.addr(),
            "POST",
            "/v1/chat/completions",
            Some(CHAT),
            &[("x-sim-fault", "stall-before-headers")],
        ),
    )
    .await;
    assert!(pending.is_err(), "no headers within 60 s");

    let start = tokio::time::Instant::now();
    let reply = send(
        engine.addr(),
        "POST",
        "/v1/chat/completions",
        Some(CHAT),
        &[("x-sim-fault", "stall-before-headers=2s")],
    )
    .await;
    assert_eq!(reply.status, 200);
    assert!(start.elapsed() >= Duration::from_secs(2));

    let configured = self::engine(FaultConfig {
        stall_before_headers: Some(Duration::from_secs(3)),
        ..FaultConfig::default()
    })
    .await;
    let start = tokio::time::Instant::now();
    assert_eq!(chat_status(&configured, &[]).await, 200);
    assert!(start.elapsed() >= Duration::from_secs(3));
}

#[tokio::test(start_paused = true)]
async fn stall_after_headers_sends_the_head_then_nothing() {
    let engine = engine(FaultConfig::default()).await;
    for body in [CHAT, STREAM] {
        let response = tokio::time::timeout(
            Duration::from_secs(5),
            open(
                engine.addr(),
                "POST",
                "/v1/chat/completions",
                Some(body),
                &[("x-sim-fault", "stall-after-headers")],
            ),
        )
        .await
        .expect("headers arrive")
        .expect("response");
        assert_eq!(response.status(), 200);
        let mut body = response.into_body();
        let frame = tokio::time::timeout(Duration::from_secs(60), body.frame()).await;
        assert!(frame.is_err(), "no body within 60 s");
    }
    // A bounded stall delivers the whole body afterwards.
    let response = open(
        engine.addr(),
        "POST",
        "/v1/chat/completions",
        Some(CHAT),
        &[("x-sim-fault", "stall-after-headers=1500ms")],
    )
    .await
    .expect("response");
    let start = tokio::time::Instant::now();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    assert!(start.elapsed() >= Duration::from_millis(1500));
    let value: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(value["usage"]["completion_tokens"], 3);
}

#[tokio::test(start_paused = true)]
async fn reset_mid_body_cuts_the_connection_after_the_first_bytes() {
    let engine = engine(FaultConfig::default()).await;
    for body in [STREAM, CHAT] {
        let response = open(
            engine.addr(),
            "POST",
            "/v1/chat/completions",
            Some(body),
            &[("x-sim-fault", "reset-mid-body")],
        )
        .await
        .expect("headers arrive");
        assert_eq!(response.status(), 200);
        let mut body = response.into_body();
        let first = body
            .frame()
            .await
            .expect("a frame")
            .expect("first bytes arrive");
        assert!(first.data_ref().is_some_and(|d| !d.is_empty()));
        let mut errored = false;
        while let Some(frame) = body.frame().await {
            if frame.is_err() {
                errored = true;
                break;
            }
        }
        assert!(errored, "the body must end in an error, not cleanly");
    }
    let configured = self::engine(FaultConfig {
        reset_mid_body: true,
        ..FaultConfig::default()
    })
    .await;
    let response = open(
        configured.addr(),
        "POST",
        "/v1/chat/completions",
        Some(STREAM),
        &[],
    )
    .await
    .expect("headers");
    assert!(response.into_body().collect().await.is_err());
}

#[tokio::test(start_paused = true)]
async fn slow_start_holds_health_and_requests_until_ready() {
    let engine = engine(FaultConfig {
        slow_start: Some(Duration::from_secs(5)),
        ..FaultConfig::default()
    })
    .await;
    let start = tokio::time::Instant::now();
    assert_eq!(get(engine.addr(), "/health").await.status, 503);
    assert_eq!(chat_status(&engine, &[]).await, 200);
    assert!(start.elapsed() >= Duration::from_secs(5));
    assert_eq!(get(engine.addr(), "/health").await.status, 200);
}

#[tokio::test(start_paused = true)]
async fn health_is_refused_after_a_delay_while_generation_works() {
    let engine = engine(FaultConfig {
        refuse_health_after: Some(Duration::from_secs(3)),
        ..FaultConfig::default()
    })
    .await;
    assert_eq!(get(engine.addr(), "/health").await.status, 200);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let refused = get(engine.addr(), "/health").await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.headers["x-worker-id"], engine.engine_id());
    assert_eq!(chat_status(&engine, &[]).await, 200);
}

#[tokio::test(start_paused = true)]
async fn reset_mid_body_is_a_tcp_reset() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let engine = engine(FaultConfig::default()).await;
    let mut stream = tokio::net::TcpStream::connect(engine.addr())
        .await
        .expect("connect");
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-sim-fault: reset-mid-body\r\ncontent-length: {}\r\n\r\n{STREAM}",
        STREAM.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut received = Vec::new();
    let mut buf = [0u8; 1024];
    let error = loop {
        match stream.read(&mut buf).await {
            Ok(0) => panic!("clean EOF instead of a reset after {received:?}"),
            Ok(n) => received.extend_from_slice(&buf[..n]),
            Err(e) => break e,
        }
    };
    assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset);
    let text = String::from_utf8_lossy(&received);
    assert!(text.starts_with("HTTP/1.1 200"));
    assert!(text.contains("data: "), "some body arrived first: {text}");
    assert!(!text.contains("[DONE]"));
}
