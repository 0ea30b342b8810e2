//! Hostile and careless clients: request forms that must never reach a
//! worker, deadlines that must bound every phase, and an admin drain that
//! must finish when its caller goes away. Each test reproduces a defect an
//! attack on the reference router found; they failed before the fixes.

mod common;

use common::{Connection, Fixture, call, chat_body, json};
use engine_sim::EngineConfig;
use http::StatusCode;
use router_http::RouterConfig;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use worker_lifecycle::BreakerState;

/// Sends `raw` on a fresh connection and reads until the server closes it;
/// returns the status code and the whole response text.
async fn raw_exchange(addr: SocketAddr, raw: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(raw.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut response))
        .await
        .expect("the router did not answer and close within 30 s")
        .unwrap();
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    (status, text)
}

fn header<'a>(response: &'a str, name: &str) -> Option<&'a str> {
    response.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        key.eq_ignore_ascii_case(name).then(|| value.trim())
    })
}

#[tokio::test]
async fn asterisk_and_authority_form_targets_never_reach_a_worker_or_move_its_breaker() {
    // The default breaker and retries: the attack needed two requests.
    let fixture = Fixture::start(RouterConfig::default(), vec![EngineConfig::instant()]).await;
    for _ in 0..4 {
        let (status, response) = raw_exchange(
            fixture.addr,
            "OPTIONS * HTTP/1.1\r\nhost: router\r\nconnection: close\r\n\r\n",
        )
        .await;
        assert_eq!(status, 200, "{response}");
        let allow = header(&response, "allow").expect("OPTIONS * names the methods");
        assert!(allow.contains("POST") && allow.contains("GET"), "{allow}");
    }
    let (status, response) = raw_exchange(
        fixture.addr,
        "CONNECT 127.0.0.1:1 HTTP/1.1\r\nhost: 127.0.0.1:1\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 405, "{response}");
    assert!(response.contains("method_not_allowed"), "{response}");

    let worker = &fixture.workers()[0];
    assert_eq!(worker.breaker().state(), BreakerState::Closed);
    assert_eq!(worker.breaker().counters().opened, 0);
    assert_eq!(worker.processed(), 0, "nothing was sent to the worker");
    assert_eq!(fixture.router.metrics().retries.get(), 0);

    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        chat_body("still served", false),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    fixture.assert_all_loads_return_to_zero().await;
}

#[tokio::test]
async fn the_request_deadline_covers_the_wait_for_response_headers() {
    let mut config = RouterConfig {
        request_timeout: Duration::from_secs(1),
        retry: worker_lifecycle::RetryPolicy::no_retries(),
        ..RouterConfig::default()
    };
    config.worker_options.breaker.failure_threshold = 1;
    let fixture = Fixture::start(config, vec![EngineConfig::instant()]).await;
    // The worker accepts the request and never answers (the header timeout
    // is 600 s): only the 1 s deadline can end the wait.
    let answer = tokio::time::timeout(
        Duration::from_secs(60),
        call(
            fixture.addr,
            "POST",
            "/v1/chat/completions",
            &[
                ("content-type", "application/json"),
                ("x-sim-fault", "stall-before-headers=600s"),
            ],
            chat_body("never answered", false),
        ),
    )
    .await
    .expect("the client waited past the request deadline");
    let (status, headers, body) = answer;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(headers["content-type"], "application/json");
    let error = json(&body);
    assert_eq!(error["error"]["code"], "request_timeout", "{error}");
    fixture.assert_all_loads_return_to_zero().await;
    // The worker did not answer in time: a timeout counts against it.
    let worker = &fixture.workers()[0];
    assert_eq!(worker.breaker().counters().opened, 1);
}

#[tokio::test]
async fn a_drain_completes_after_the_admin_caller_disconnects() {
    let fixture = Fixture::start(RouterConfig::default(), vec![EngineConfig::instant()]).await;
    let url = fixture.engines[0].url();
    let worker = std::sync::Arc::clone(&fixture.workers()[0]);

    // A stream stalled after its headers keeps the worker loaded.
    let mut streaming = Connection::open(fixture.addr).await;
    let stalled = streaming
        .send(
            "POST",
            "/v1/chat/completions",
            &[
                ("content-type", "application/json"),
                ("x-sim-fault", "stall-after-headers=600s"),
            ],
            chat_body("a long stream", true),
        )
        .await;
    assert_eq!(stalled.status(), StatusCode::OK);
    assert_eq!(worker.load(), 1);

    // The operator asks for the removal and goes away while it drains.
    let remove = format!("/remove_worker?url={url}");
    let admin = tokio::spawn(async move {
        let mut connection = Connection::open(fixture.addr).await;
        connection.send("POST", &remove, &[], "").await
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while worker.lifecycle() != worker_lifecycle::Lifecycle::Draining {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the drain never began"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    admin.abort();
    let _ = admin.await;

    // The stream ends (its client leaves): the load reaches 0 and the
    // worker must leave on its own.
    drop(stalled);
    drop(streaming);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !fixture.workers().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the worker stayed {:?} with load {}",
            worker.lifecycle(),
            worker.load()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(worker.load(), 0);
    assert_eq!(worker.underflows(), 0);

    // The same URL can join again, as a new lifetime.
    let (status, _, body) = call(
        fixture.addr,
        "POST",
        &format!("/add_worker?url={url}"),
        &[],
        "",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    assert_eq!(fixture.workers().len(), 1);
    assert!(fixture.workers()[0].generation() > worker.generation());
}
