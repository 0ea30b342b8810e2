//! A raw hyper client and SSE helpers for the engine tests.
#![allow(dead_code, unreachable_pub)] // each test file uses a different subset

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;

/// A fully read response.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends one request on a fresh connection and returns the response head.
pub async fn open(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> hyper::Result<Response<Incoming>> {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string());
    if body.is_some() {
        builder = builder.header("content-type", "application/json");
    }
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let request = builder
        .body(Full::new(Bytes::from(body.unwrap_or_default().to_owned())))
        .expect("request");
    sender.send_request(request).await
}

/// Sends one request and reads the whole body.
pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> Reply {
    let response = open(addr, method, path, body, headers)
        .await
        .expect("response");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    send(addr, "POST", path, Some(&body.to_string()), &[]).await
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    send(addr, "GET", path, None, &[]).await
}

/// Splits an SSE body into its `data:` payloads, checking the framing.
pub fn sse_data(body: &str) -> Vec<String> {
    assert!(
        body.ends_with("\n\n"),
        "SSE body must end with a blank line"
    );
    body.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| {
            let data = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("event without data: {event:?}"));
            assert!(!data.contains('\n'), "one line per event");
            data.to_owned()
        })
        .collect()
}

/// A metric sample from `/metrics`.
pub async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let text = get(addr, "/metrics").await.text();
    engine_sim::metrics::sample(&text, name).unwrap_or_else(|| panic!("{name} missing:\n{text}"))
}
