//! Recording what the clients see

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde_json::json;

use super::body::{BodyTemplate, SplitMix64};
use super::histogram::Histogram;

/// What one kind of client (load or probe) has seen so far.
pub(super) struct Recorder {
    /// Latencies of 2xx answers, body included.
    pub(super) latency: Histogram,
    /// Largest latency since the sampler last took it (µs).
    pub(super) window_max: AtomicU64,
    /// Largest latency of the run (µs).
    pub(super) max: AtomicU64,
    /// Answers slower than the slow threshold.
    pub(super) slow: AtomicU64,
    slow_micros: u64,
    /// Non-2xx answers.
    pub(super) http_errors: AtomicU64,
    /// Connections that could not be opened, broke, or bodies cut short.
    pub(super) connection_errors: AtomicU64,
    /// The first few errors, as text, for the report.
    pub(super) samples: Mutex<Vec<String>>,
}

const ERROR_SAMPLES: usize = 5;

impl Recorder {
    pub(super) fn new(slow_micros: u64) -> Self {
        Self {
            latency: Histogram::new(),
            window_max: AtomicU64::new(0),
            max: AtomicU64::new(0),
            slow: AtomicU64::new(0),
            slow_micros,
            http_errors: AtomicU64::new(0),
            connection_errors: AtomicU64::new(0),
            samples: Mutex::new(Vec::new()),
        }
    }

    fn ok(&self, elapsed: Duration) {
        let micros = elapsed.as_micros().min(u128::from(u64::MAX)) as u64;
        self.latency.record(micros);
        self.window_max.fetch_max(micros, Ordering::Relaxed);
        self.max.fetch_max(micros, Ordering::Relaxed);
        if micros > self.slow_micros {
            self.slow.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn error(&self, connection: bool, what: impl FnOnce() -> String) {
        let counter = if connection {
            &self.connection_errors
        } else {
            &self.http_errors
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        if samples.len() < ERROR_SAMPLES {
            samples.push(what());
        }
    }

    pub(super) fn errors(&self) -> u64 {
        self.http_errors.load(Ordering::Relaxed) + self.connection_errors.load(Ordering::Relaxed)
    }
}

/// A keep-alive HTTP/1 connection to the router.
pub(super) async fn connect(addr: SocketAddr) -> Result<SendRequest<Full<Bytes>>, String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP handshake with {addr}: {e}"))?;
    tokio::spawn(async move {
        // The connection's errors also fail its requests, which count them.
        let _ = connection.await;
    });
    Ok(sender)
}

fn chat_request(addr: SocketAddr, body: Bytes) -> http::Request<Full<Bytes>> {
    let mut request = http::Request::new(Full::new(body));
    *request.method_mut() = http::Method::POST;
    *request.uri_mut() = http::Uri::from_static("/v1/chat/completions");
    let headers = request.headers_mut();
    if let Ok(host) = http::HeaderValue::try_from(addr.to_string()) {
        headers.insert(http::header::HOST, host);
    }
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    request
}

/// Largest response body read: a chat completion of a few tokens is well
/// under 1 KiB; more than this is an error, not memory.
pub(super) const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// Sends one request on `sender` and records it. `Err` when the connection
/// is no longer usable (already counted).
async fn exchange(
    sender: &mut SendRequest<Full<Bytes>>,
    request: http::Request<Full<Bytes>>,
    recorder: &Recorder,
) -> Result<(), ()> {
    if let Err(e) = sender.ready().await {
        recorder.error(true, || format!("connection closed: {e}"));
        return Err(());
    }
    let started = Instant::now();
    let response = match sender.send_request(request).await {
        Ok(response) => response,
        Err(e) => {
            recorder.error(true, || format!("request failed: {e}"));
            return Err(());
        }
    };
    let status = response.status();
    match Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
        .collect()
        .await
    {
        Ok(_) if status.is_success() => {
            recorder.ok(started.elapsed());
            Ok(())
        }
        Ok(body) => {
            recorder.error(false, || {
                let body = body.to_bytes();
                let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
                format!("status {status}: {text}")
            });
            Ok(())
        }
        Err(e) => {
            recorder.error(true, || {
                format!("body cut short or too long (status {status}): {e}")
            });
            Err(())
        }
    }
}

/// One load connection: unique prompts back to back; reconnects (after a
/// short pause, so a dead router is not hammered) when the connection fails.
pub(super) async fn load_connection(
    addr: SocketAddr,
    template: Arc<BodyTemplate>,
    recorder: Arc<Recorder>,
    seed: u64,
) {
    let mut rng = SplitMix64(seed);
    loop {
        let mut sender = match connect(addr).await {
            Ok(sender) => sender,
            Err(e) => {
                recorder.error(true, || e);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        loop {
            let request = chat_request(addr, template.body(rng.next_u64()));
            if exchange(&mut sender, request, &recorder).await.is_err() {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The probe: one small request every `interval` on its own connection (a
/// late tick waits for the previous probe, as a single user would).
pub(super) async fn probe_loop(
    addr: SocketAddr,
    model: String,
    max_tokens: u32,
    interval: Duration,
    recorder: Arc<Recorder>,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sender = None;
    let mut n: u64 = 0;
    loop {
        ticks.tick().await;
        n += 1;
        if sender.is_none() {
            match connect(addr).await {
                Ok(s) => sender = Some(s),
                Err(e) => {
                    recorder.error(true, || e);
                    continue;
                }
            }
        }
        let body = json!({
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": format!("probe {n}: how long does one user wait?")}],
        });
        let request = chat_request(addr, Bytes::from(body.to_string()));
        if let Some(s) = sender.as_mut()
            && exchange(s, request, &recorder).await.is_err()
        {
            sender = None;
        }
    }
}
