//! Fuzz entry points: plain functions that must never panic, whatever the
//! bytes. The cargo-fuzz targets in `fuzz/` call them, and
//! `tests/fuzz_corpus.rs` runs them over the seed corpus and pseudo-random
//! inputs so `cargo test` exercises them too.

use crate::body::{BodyEnd, Finish, GuardedBody};
use crate::extract::{ApiKind, extract, extract_parsed};
use crate::headers::{RequestIds, strip_hop_by_hop};
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http_body::{Body, Frame};
use std::cell::Cell;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// Every kind of route a body can arrive on.
pub(crate) const ROUTES: [ApiKind; 7] = [
    ApiKind::ChatCompletions,
    ApiKind::Completions,
    ApiKind::Embeddings,
    ApiKind::Rerank,
    ApiKind::Responses,
    ApiKind::Generate,
    ApiKind::Other,
];

/// Parses `data[1..]` as a body of the route chosen by `data[0]`: either a
/// clean 400-class error or an extraction whose routing text is made only of
/// what the body contained (never longer than a bounded multiple of it).
/// The one parse into a JSON value (a P/D request's) reads the same: the
/// same info, or the same error and message.
pub fn request_body(data: &[u8]) {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let route = ROUTES[usize::from(selector) % ROUTES.len()];
    let extracted = extract(route, body);
    match (&extracted, extract_parsed(route, body)) {
        (Ok(text), Ok((value, _))) => assert_eq!(text, &value, "read from the value"),
        (Err(text), Err(value)) => assert_eq!(
            (text.status(), text.to_string()),
            (value.status(), value.to_string()),
            "refused from the value"
        ),
        (text, value) => panic!("the text reads {text:?}, the value {value:?}"),
    }
    // A chat routed on tokens is read in one parse where that reads as
    // `extract` and the prompt's own parse do.
    #[cfg(feature = "tokens")]
    match route {
        ApiKind::ChatCompletions => {
            crate::tokens::once::check_against_two_parses(body);
        }
        ApiKind::Completions => {
            crate::tokens::once::check_completion_against_two_parses(body);
        }
        _ => {}
    }
    match extracted {
        Ok(info) => {
            // Rendering adds "role: " and "\n" per message: at most a few
            // bytes per input byte, never unbounded.
            let text_len = info.routing.text().map_or(0, str::len);
            assert!(
                text_len <= body.len() * 4 + 16,
                "routing text grew unboundedly"
            );
            let tokens = info.routing.tokens().map_or(0, <[u32]>::len);
            assert!(tokens <= body.len(), "more tokens than input bytes");
        }
        Err(error) => assert!(error.status().is_client_error(), "{error:?}"),
    }
}

/// Builds a header map from `data` (name/value pairs separated by NUL
/// bytes), strips hop-by-hop headers and resolves the request id: no panic,
/// no hop-by-hop header left, and an id that is a valid header value.
pub fn headers(data: &[u8]) {
    let mut headers = HeaderMap::new();
    let mut parts = data.split(|&b| b == 0);
    while let (Some(name), Some(value)) = (parts.next(), parts.next()) {
        let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value))
        else {
            continue;
        };
        headers.append(name, value);
    }
    strip_hop_by_hop(&mut headers);
    for name in [
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
    ] {
        assert!(!headers.contains_key(name), "{name} survived");
    }
    let id = RequestIds::default().resolve(&headers);
    assert!(!id.value.is_empty());
}

/// Reads `data[1..]` as an engine's load reply: the low bit of `data[0]`
/// picks the source (`/metrics` or `/get_load`), the rest the
/// data-parallel rank asked for (none, or 0 to 3). Never a panic; the same
/// bytes read the same twice; what is accepted names at most
/// [`MAX_RANKS`] engines, a rank's count is at most
/// [`MAX_PLAUSIBLE_LOAD`], and a KV-cache usage lies in `[0, 1]`.
///
/// [`MAX_RANKS`]: crate::load_poll::MAX_RANKS
/// [`MAX_PLAUSIBLE_LOAD`]: crate::load_poll::MAX_PLAUSIBLE_LOAD
pub fn load_report(data: &[u8]) {
    use crate::load_poll::{LoadSource, MAX_PLAUSIBLE_LOAD, MAX_RANKS};
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let source = LoadSource::ALL[usize::from(selector & 1)];
    let rank = match (selector >> 1) % 5 {
        0 => None,
        r => Some(u32::from(r) - 1),
    };
    let parsed = source.parse(body);
    assert_eq!(parsed, source.parse(body), "not deterministic");
    let Ok(loads) = parsed else {
        return;
    };
    assert!(loads.len() <= MAX_RANKS);
    if let Ok(report) = loads.for_rank(rank) {
        let bound = match rank {
            Some(_) => MAX_PLAUSIBLE_LOAD,
            None => MAX_PLAUSIBLE_LOAD * MAX_RANKS as u64,
        };
        assert!(report.in_flight <= bound, "{report:?}");
        if let Some(usage) = report.kv_cache_usage {
            assert!((0.0..=1.0).contains(&usage), "{report:?}");
        }
    }
}

/// Splits `data` into chunks at the cut points its first bytes choose and
/// passes them through a [`GuardedBody`], as an SSE stream is passed: the
/// bytes out equal the bytes in, in order, and the guard finishes exactly
/// once, as `Complete`.
pub fn sse_passthrough(data: &[u8]) {
    let Some((&cuts, stream)) = data.split_first() else {
        return;
    };
    let mut chunks = Vec::new();
    let mut rest = stream;
    let mut step = usize::from(cuts % 17) + 1;
    while !rest.is_empty() {
        let take = step.min(rest.len());
        chunks.push(Bytes::copy_from_slice(&rest[..take]));
        rest = &rest[take..];
        step = step * 7 % 23 + 1;
    }
    let finished = Rc::new(Cell::new(0u32));
    let guard = CountingFinish(Rc::clone(&finished));
    let mut body = GuardedBody::new(Chunks(chunks.into()), guard);
    let mut out = Vec::with_capacity(stream.len());
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        match Pin::new(&mut body).poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    out.extend_from_slice(&data);
                }
            }
            Poll::Ready(Some(Err(never))) => match never {},
            Poll::Ready(None) => break,
            Poll::Pending => unreachable!("an in-memory body is always ready"),
        }
    }
    assert_eq!(out, stream, "pass-through changed the bytes");
    drop(body);
    assert_eq!(finished.get(), 1, "the guard must finish exactly once");
}

struct CountingFinish(Rc<Cell<u32>>);

impl Finish for CountingFinish {
    fn finish(self, end: BodyEnd) {
        assert_eq!(end, BodyEnd::Complete);
        self.0.set(self.0.get() + 1);
    }
}

/// An in-memory body yielding pre-split chunks.
struct Chunks(std::collections::VecDeque<Bytes>);

impl Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|chunk| Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }
}

/// The whole request path, in process: `data` chooses a method, a request
/// target form (origin, asterisk, authority, absolute, raw), headers and a
/// body, and whether the client reads the response to its end or leaves
/// after the head. The request goes through [`crate::Router::handle`] to a
/// worker that answers every request it gets with 200. After each case:
/// the worker's load and the router's permits are back to 0 with no clamped
/// decrement, the worker's breaker never moved (the worker never failed, so
/// nothing may count against it), and a request the router answers itself
/// never reached the worker.
pub fn request_path(data: &[u8]) {
    HARNESS.with(|harness| harness.run(data));
}

thread_local! {
    static HARNESS: PathHarness = PathHarness::new();
}

/// A router with one well-behaved worker, on a runtime of this thread.
struct PathHarness {
    runtime: tokio::runtime::Runtime,
    router: crate::Router,
    worker_requests: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

const METHODS: [&str; 10] = [
    "GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "CONNECT", "PATCH", "TRACE", "PURGE",
];

const PATHS: [&str; 12] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/generate",
    "/tokenize",
    "/health",
    "/workers",
    "/add_worker",
    "/remove_worker",
    "/passthrough",
    "/",
];

impl PathHarness {
    fn new() -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a current-thread runtime");
        let worker_requests = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = std::sync::Arc::clone(&worker_requests);
        let worker_url = runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind the in-process worker");
            let addr = listener.local_addr().expect("its address");
            tokio::spawn(serve_worker(listener, counter));
            format!("http://{addr}")
        });
        let mut config = crate::RouterConfig {
            passthrough_paths: vec!["/passthrough/*".into()],
            request_timeout: std::time::Duration::from_secs(20),
            ..crate::RouterConfig::default()
        };
        // Any worker failure recorded would open the breaker at once.
        config.worker_options.breaker.failure_threshold = 1;
        let router = crate::Router::new(config).expect("the fuzz router's config");
        router
            .add_worker(&worker_url, None, None)
            .expect("the in-process worker");
        Self {
            runtime,
            router,
            worker_requests,
        }
    }

    fn run(&self, data: &[u8]) {
        let Some(request) = fuzz_request(data) else {
            return;
        };
        let read_to_end = data.get(2).is_none_or(|b| b & 1 == 0);
        let forwarded = {
            let path = request.uri().path();
            let route = crate::Route::of(request.method(), path);
            matches!(route, crate::Route::Proxy(_) | crate::Route::Models)
                || (route == crate::Route::NotFound
                    && crate::routes::passthrough_matches(
                        &self.router.config().passthrough_paths,
                        path,
                    ))
        };
        let before = self
            .worker_requests
            .load(std::sync::atomic::Ordering::SeqCst);
        self.runtime.block_on(async {
            let response = self.router.handle(request).await;
            let mut body = response.into_body();
            if read_to_end {
                while let Some(frame) = http_body_util::BodyExt::frame(&mut body).await {
                    if frame.is_err() {
                        break;
                    }
                }
            } else {
                let _ = http_body_util::BodyExt::frame(&mut body).await;
            }
        });
        let worker = &self.router.workers()[0];
        assert_eq!(worker.load(), 0, "the worker's load did not return to 0");
        assert_eq!(worker.underflows(), 0, "a load decrement was clamped");
        assert_eq!(self.router.in_flight(), 0, "an admission permit leaked");
        assert_eq!(
            worker.breaker().state(),
            worker_lifecycle::BreakerState::Closed,
            "a worker that never failed has a breaker that moved"
        );
        assert_eq!(worker.breaker().counters().opened, 0);
        if !forwarded {
            assert_eq!(
                self.worker_requests
                    .load(std::sync::atomic::Ordering::SeqCst),
                before,
                "a request the router answers itself reached the worker"
            );
        }
    }
}

/// Decodes `data` into a request: `[method, target form, flags, rest...]`
/// where `rest` is `target bytes \0 header lines \0 body`.
fn fuzz_request(data: &[u8]) -> Option<http::Request<http_body_util::Full<Bytes>>> {
    let (&method, rest) = data.split_first()?;
    let (&form, rest) = rest.split_first()?;
    let rest = rest.split_first().map_or(&[][..], |(_, rest)| rest);
    let mut sections = rest.splitn(3, |&b| b == 0);
    let target = sections.next().unwrap_or_default();
    let header_lines = sections.next().unwrap_or_default();
    let body = sections.next().unwrap_or_default();
    let suffix = String::from_utf8_lossy(target);
    let path = PATHS[usize::from(form >> 3) % PATHS.len()];
    let uri = match form % 5 {
        0 => format!("{path}{suffix}"),
        1 => "*".to_owned(),
        2 => format!("127.0.0.1:{}", u16::from(form)),
        3 => format!("http://evil.example{path}{suffix}"),
        _ => suffix.into_owned(),
    };
    let method =
        http::Method::from_bytes(METHODS[usize::from(method) % METHODS.len()].as_bytes()).ok()?;
    let mut builder = http::Request::builder().method(method).uri(uri);
    for line in header_lines.split(|&b| b == b'\n') {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name),
            HeaderValue::from_bytes(value.trim_ascii()),
        ) {
            builder = builder.header(name, value);
        }
    }
    builder
        .body(http_body_util::Full::new(Bytes::copy_from_slice(body)))
        .ok()
}

/// The in-process worker: answers every request with 200 and a small JSON
/// body, after reading the request body.
async fn serve_worker(
    listener: tokio::net::TcpListener,
    requests: std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    while let Ok((stream, _)) = listener.accept().await {
        let requests = std::sync::Arc::clone(&requests);
        let service =
            hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                requests.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async move {
                    let _ = http_body_util::BodyExt::collect(request.into_body()).await;
                    let mut response = http::Response::new(http_body_util::Full::new(
                        Bytes::from_static(br#"{"object":"ok"}"#),
                    ));
                    response.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        HeaderValue::from_static("application/json"),
                    );
                    Ok::<_, std::convert::Infallible>(response)
                }
            });
        tokio::spawn(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Reads `data` as a peer replica's batch of routing choices
/// ([`crate::peers`]) into a cache_aware pool of two workers serving model
/// `m` (whose endpoints are `http://127.0.0.1:1` and `http://127.0.0.1:2`).
/// Never a panic; a refused batch changes no tree; an accepted one
/// accounts for every choice it carried (recorded or ignored); the same
/// bytes are accepted or refused the same way twice.
pub fn peer_batch(data: &[u8]) {
    use lb_policies::{PolicyConfig, PolicyRegistry, PolicyState};
    use worker_lifecycle::{Endpoint, RoleKind, RolePool, WorkerOptions, WorkerRole, WorkerSpec};
    let Ok(registry) = PolicyRegistry::new(PolicyConfig::named("cache_aware")) else {
        return;
    };
    let Ok(pool) = RolePool::fixed(RoleKind::Regular, WorkerOptions::default(), registry) else {
        return;
    };
    for url in ["http://127.0.0.1:1", "http://127.0.0.1:2"] {
        let Ok(endpoint) = Endpoint::new(url, None) else {
            return;
        };
        if pool
            .add(WorkerSpec::new(WorkerRole::Regular, endpoint).with_model("m"))
            .is_err()
        {
            return;
        }
    }
    let Ok(policy) = pool.policies().policy("m") else {
        return;
    };
    let config = crate::peers::PeerConfig {
        token: Some("t".into()),
        ..crate::peers::PeerConfig::default()
    };
    let Ok(Some(sync)) = crate::peers::PeerSync::new(config) else {
        return;
    };
    let bytes = || -> u64 { policy.tree_stats().iter().map(|s| s.bytes).sum() };
    let before = bytes();
    let first = sync.receive(pool.policies(), pool.workers(), data);
    match &first {
        Ok(received) => {
            let choices = serde_json::from_slice::<serde_json::Value>(data)
                .ok()
                .and_then(|v| v["choices"].as_array().map(Vec::len));
            assert_eq!(
                Some(received.recorded + received.ignored),
                choices.map(|n| n as u64),
                "every choice accounted for"
            );
        }
        Err(_) => assert_eq!(bytes(), before, "a refused batch changed the tree"),
    }
    let second = sync.receive(pool.policies(), pool.workers(), data);
    assert_eq!(first.is_ok(), second.is_ok(), "not deterministic");
}
