//! [`SimBody`], the response body of every route, and the two guards a
//! generation's body owns: `InFlight` keeps the request counted in
//! `/load` and `AbortGuard` aborts it in the engine (freeing its blocks)
//! unless it finished. Both go when the body ends, fails or is dropped, so
//! a client that goes away releases them at once.
//!
//! The body also plays the faults that act after the headers: a stall
//! before the first frame and a reset after the first one.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::mpsc;
use tokio::time::Sleep;

use super::ServerState;
use super::format::Formatter;
use crate::engine::{EngineEvent, RequestId};

/// How long a reset waits after the first body bytes, so they reach the
/// client before the connection dies.
const RESET_DELAY: Duration = Duration::from_millis(50);

/// One generation request counted in `/load`'s `server_load` while this
/// lives: from the request's arrival until its body ends or is dropped.
///
/// The engine's own in-flight count, as vLLM reports it; not the router's
/// per-worker load (worker-lifecycle's `LoadGuard`), which counts what one
/// router sent.
pub(super) struct InFlight(Arc<ServerState>);

impl InFlight {
    pub(super) fn new(shared: &Arc<ServerState>) -> Self {
        shared.load.fetch_add(1, Ordering::Relaxed);
        InFlight(shared.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.load.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Aborts the request in the engine unless it finished.
pub(super) struct AbortGuard {
    shared: Arc<ServerState>,
    id: RequestId,
    armed: bool,
}

impl AbortGuard {
    /// Armed: dropping it now aborts request `id`.
    pub(super) fn new(shared: Arc<ServerState>, id: RequestId) -> Self {
        AbortGuard {
            shared,
            id,
            armed: true,
        }
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            {
                let mut core = self.shared.core.lock();
                core.sinks.remove(&self.id);
                core.engine.abort(self.id);
            }
            self.shared.wake.notify_one();
        }
    }
}

/// A request's events from the engine, the formatter that turns them into
/// bytes, and the guard that aborts the request if they stop being read.
pub(super) struct EventSource {
    events: mpsc::UnboundedReceiver<EngineEvent>,
    formatter: Formatter,
    abort: AbortGuard,
}

impl EventSource {
    pub(super) fn new(
        events: mpsc::UnboundedReceiver<EngineEvent>,
        formatter: Formatter,
        abort: AbortGuard,
    ) -> Self {
        EventSource {
            events,
            formatter,
            abort,
        }
    }

    /// Waits for the request to finish and returns the whole answer; `None`
    /// when the engine stopped first (the request is then aborted).
    pub(super) async fn answer(mut self) -> Option<Vec<u8>> {
        let mut frames = VecDeque::new();
        loop {
            let event = self.events.recv().await?;
            if self.formatter.on_event(event, &mut frames) {
                self.abort.armed = false;
                return Some(frames.into_iter().flatten().collect());
            }
        }
    }
}

/// Why a response body ended early.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BodyError {
    /// The `reset-mid-body` fault fired.
    #[error("connection reset (injected fault)")]
    Reset,
    /// The engine stopped before the response was complete.
    #[error("engine stopped")]
    EngineStopped,
}

/// The response body of every route.
pub struct SimBody {
    pending: VecDeque<Bytes>,
    source: Option<EventSource>,
    stall: Option<Pin<Box<Sleep>>>,
    reset: Option<Arc<AtomicBool>>,
    reset_timer: Option<Pin<Box<Sleep>>>,
    frames_sent: usize,
    exact_len: Option<u64>,
    in_flight: Option<InFlight>,
}

impl std::fmt::Debug for SimBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBody")
            .field("pending", &self.pending.len())
            .field("streaming", &self.source.is_some())
            .finish()
    }
}

impl SimBody {
    /// A body of known bytes, sent with a content-length.
    pub(super) fn full(bytes: Bytes) -> Self {
        let exact_len = Some(bytes.len() as u64);
        let mut pending = VecDeque::new();
        if !bytes.is_empty() {
            pending.push_back(bytes);
        }
        SimBody {
            pending,
            source: None,
            stall: None,
            reset: None,
            reset_timer: None,
            frames_sent: 0,
            exact_len,
            in_flight: None,
        }
    }

    /// A generation's body: counted in `/load` until it ends or is dropped.
    pub(super) fn holding(mut self, in_flight: InFlight) -> Self {
        self.in_flight = Some(in_flight);
        self
    }

    /// A generation's body that follows the request in the engine, frame by
    /// frame as its events arrive: first sleeping `stall` (after the
    /// headers) and, with `reset`, resetting the connection after the first
    /// frame.
    pub(super) fn streaming(
        source: EventSource,
        stall: Option<Duration>,
        reset: Option<Arc<AtomicBool>>,
        in_flight: InFlight,
    ) -> Self {
        SimBody {
            pending: VecDeque::new(),
            source: Some(source),
            stall: stall.map(|d| Box::pin(tokio::time::sleep(d))),
            reset,
            reset_timer: None,
            frames_sent: 0,
            exact_len: None,
            in_flight: Some(in_flight),
        }
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if let Some(stall) = this.stall.as_mut() {
            ready!(stall.as_mut().poll(cx));
            this.stall = None;
        }
        loop {
            if let Some(flag) = &this.reset
                && this.frames_sent >= 1
            {
                let timer = this
                    .reset_timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(RESET_DELAY)));
                ready!(timer.as_mut().poll(cx));
                flag.store(true, Ordering::SeqCst);
                this.source = None;
                this.pending.clear();
                this.reset = None;
                this.in_flight = None;
                return Poll::Ready(Some(Err(BodyError::Reset)));
            }
            if let Some(bytes) = this.pending.pop_front() {
                this.frames_sent += 1;
                if this.pending.is_empty() && this.source.is_none() {
                    this.in_flight = None;
                }
                return Poll::Ready(Some(Ok(Frame::data(bytes))));
            }
            let Some(source) = this.source.as_mut() else {
                this.in_flight = None;
                return Poll::Ready(None);
            };
            match ready!(source.events.poll_recv(cx)) {
                Some(event) => {
                    if source.formatter.on_event(event, &mut this.pending) {
                        source.abort.armed = false;
                        this.source = None;
                        if this.reset.is_some() {
                            split_single_frame(&mut this.pending);
                        }
                    }
                }
                None => {
                    this.source = None;
                    this.in_flight = None;
                    return Poll::Ready(Some(Err(BodyError::EngineStopped)));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.stall.is_none()
            && self.pending.is_empty()
            && self.source.is_none()
            && self.reset.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.exact_len {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

/// A non-streamed answer is one frame; a reset should cut it in the middle.
fn split_single_frame(pending: &mut VecDeque<Bytes>) {
    if pending.len() == 1 && pending[0].len() > 1 {
        let mut whole = pending.pop_front().expect("one frame");
        let tail = whole.split_off(whole.len() / 2);
        pending.push_back(whole);
        pending.push_back(tail);
    }
}
