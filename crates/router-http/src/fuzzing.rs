//! Fuzz entry points: plain functions that must never panic, whatever the
//! bytes. The cargo-fuzz targets in `fuzz/` call them, and
//! `tests/fuzz_corpus.rs` runs them over the seed corpus and pseudo-random
//! inputs so `cargo test` exercises them too.

use crate::body::{BodyEnd, Finish, GuardedBody};
use crate::extract::{RouteKind, extract};
use crate::headers::{RequestIds, strip_hop_by_hop};
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http_body::{Body, Frame};
use std::cell::Cell;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

const ROUTES: [RouteKind; 7] = [
    RouteKind::ChatCompletions,
    RouteKind::Completions,
    RouteKind::Embeddings,
    RouteKind::Rerank,
    RouteKind::Responses,
    RouteKind::Generate,
    RouteKind::Other,
];

/// Parses `data[1..]` as a body of the route chosen by `data[0]`: either a
/// clean 400-class error or an extraction whose routing text is made only of
/// what the body contained (never longer than a bounded multiple of it).
pub fn request_body(data: &[u8]) {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let route = ROUTES[usize::from(selector) % ROUTES.len()];
    match extract(route, body) {
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
