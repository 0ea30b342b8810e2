//! Response bodies that own what a request holds.
//!
//! A streamed completion is load on its worker until its last byte, so the
//! load guard cannot be released when the handler returns the response head:
//! it moves into the body. [`GuardedBody`] wraps any body and a guard (any
//! [`Finish`] value: a load guard, a concurrency permit, a tuple of them) and
//! lets the guard go, telling it how the body ended, at the first of:
//!
//! - the inner body reports its end (`poll_frame` returns `None`, or
//!   `is_end_stream` turns true after a frame);
//! - the inner body fails (upstream reset, idle timeout);
//! - the body is dropped — which is what hyper does when the client goes
//!   away, also while the upstream is stalled and sends nothing, because the
//!   server connection notices the closed socket on its own read side and
//!   drops the response it was writing. No task sits waiting on the upstream,
//!   so nothing keeps the guard alive after the client has gone.
//!
//! [`IdleTimeout`] turns an upstream that goes quiet for too long into a body
//! error, which a surrounding [`GuardedBody`] then treats like any other.

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::time::{Instant, Sleep};

/// How a guarded body ended, as told to its guard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyEnd {
    /// The inner body reached its end: every byte was produced.
    Complete,
    /// The inner body failed (upstream reset, idle or request timeout).
    Failed,
    /// The body was dropped before its end: the client went away, or the
    /// server gave up on the connection.
    Dropped,
}

/// What a [`GuardedBody`] holds: told once how the body ended, then gone.
pub trait Finish {
    /// Called exactly once, when the body ends, fails or is dropped.
    fn finish(self, end: BodyEnd);
}

impl Finish for () {
    fn finish(self, _end: BodyEnd) {}
}

impl<A: Finish, B: Finish> Finish for (A, B) {
    fn finish(self, end: BodyEnd) {
        self.0.finish(end);
        self.1.finish(end);
    }
}

pin_project! {
    /// A body that holds a guard until the body ends, fails or is dropped,
    /// and tells the guard which of the three happened.
    pub struct GuardedBody<B, G>
    where
        G: Finish,
    {
        #[pin]
        inner: B,
        guard: Option<G>,
    }

    impl<B, G> PinnedDrop for GuardedBody<B, G>
    where
        G: Finish,
    {
        fn drop(this: Pin<&mut Self>) {
            if let Some(guard) = this.project().guard.take() {
                guard.finish(BodyEnd::Dropped);
            }
        }
    }
}

impl<B, G: Finish> GuardedBody<B, G> {
    /// Wraps `inner`, holding `guard` until the body is finished.
    pub fn new(inner: B, guard: G) -> Self {
        Self {
            inner,
            guard: Some(guard),
        }
    }

    /// Whether the guard is still held.
    pub fn is_holding(&self) -> bool {
        self.guard.is_some()
    }

    /// The wrapped body.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// The wrapped body, mutably.
    pub fn get_mut(&mut self) -> &mut B {
        &mut self.inner
    }
}

impl<B, G> Body for GuardedBody<B, G>
where
    B: Body,
    G: Finish,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_frame(cx);
        let end = match &polled {
            Poll::Ready(None) => Some(BodyEnd::Complete),
            Poll::Ready(Some(Err(_))) => Some(BodyEnd::Failed),
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => Some(BodyEnd::Complete),
            Poll::Ready(Some(Ok(_))) | Poll::Pending => None,
        };
        if let Some(end) = end
            && let Some(guard) = this.guard.take()
        {
            guard.finish(end);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project! {
    /// A body that fails when the inner body yields nothing for longer than
    /// the idle timeout, or is still running at an absolute deadline (the
    /// whole-request timeout).
    pub struct IdleTimeout<B> {
        #[pin]
        inner: B,
        idle: Duration,
        deadline: Instant,
        // Frames only record when they arrived; the one timer (for the
        // earlier of the idle limit and the deadline) is armed only while
        // the inner body is pending and moved lazily when it fires early,
        // so a body whose frames are ready never touches the timer wheel.
        last_frame: Instant,
        #[pin]
        timer: Sleep,
        timed_out: bool,
    }
}

/// The error of a body stopped by [`IdleTimeout`], or of its inner body.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdleTimeoutError<E> {
    /// No frame arrived within the idle timeout.
    #[error("the upstream body sent nothing for {0:?}")]
    Idle(Duration),
    /// The whole-request deadline passed while the body was still running.
    #[error("the request exceeded its deadline")]
    Deadline,
    /// The inner body failed.
    #[error(transparent)]
    Inner(E),
}

/// Far enough in the future to mean "no deadline", near enough not to
/// overflow the timer.
const NO_DEADLINE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

impl<B> IdleTimeout<B> {
    /// Wraps `inner`; each frame restarts the `idle` countdown.
    pub fn new(inner: B, idle: Duration) -> Self {
        Self::with_deadline(inner, idle, Instant::now() + NO_DEADLINE)
    }

    /// Wraps `inner` with only an absolute `deadline`, for a body whose
    /// idle limit is already enforced inside it (a P/D decode leg carries
    /// its own): one idle timer per stream, not two.
    pub fn deadline_only(inner: B, deadline: Instant) -> Self {
        Self::with_deadline(inner, NO_DEADLINE, deadline)
    }

    /// The idle limit, or `None` for [`deadline_only`](Self::deadline_only).
    pub fn idle_limit(&self) -> Option<Duration> {
        (self.idle != NO_DEADLINE).then_some(self.idle)
    }

    /// Wraps `inner` with an idle timeout and an absolute `deadline`.
    pub fn with_deadline(inner: B, idle: Duration, deadline: Instant) -> Self {
        let now = Instant::now();
        Self {
            inner,
            idle,
            deadline,
            last_frame: now,
            timer: tokio::time::sleep_until((now + idle).min(deadline)),
            timed_out: false,
        }
    }
}

impl<B: Body> Body for IdleTimeout<B> {
    type Data = B::Data;
    type Error = IdleTimeoutError<B::Error>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        if *this.timed_out {
            return Poll::Ready(None);
        }
        let now = Instant::now();
        if now >= *this.deadline {
            *this.timed_out = true;
            return Poll::Ready(Some(Err(IdleTimeoutError::Deadline)));
        }
        match this.inner.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                *this.last_frame = now;
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => Poll::Ready(Some(Err(IdleTimeoutError::Inner(err)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => loop {
                ready!(this.timer.as_mut().poll(cx));
                let now = Instant::now();
                if now >= *this.deadline {
                    *this.timed_out = true;
                    return Poll::Ready(Some(Err(IdleTimeoutError::Deadline)));
                }
                let idle_until = *this.last_frame + *this.idle;
                if now >= idle_until {
                    *this.timed_out = true;
                    return Poll::Ready(Some(Err(IdleTimeoutError::Idle(*this.idle))));
                }
                // A frame arrived since the timer was set: move it.
                this.timer.as_mut().reset(idle_until.min(*this.deadline));
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.timed_out || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A boxed body type the router answers with: bytes, errors boxed.
pub type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// The boxed error of a [`BoxBody`]: pd-orchestrator's, so bodies and
/// errors pass between the two crates without conversion.
pub use pd_orchestrator::BoxError;

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full, StreamBody};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts its releases: `finish` adds one, and remembers how it ended.
    struct CountingGuard(Arc<AtomicUsize>);
    impl Finish for CountingGuard {
        fn finish(self, end: BodyEnd) {
            let code = match end {
                BodyEnd::Complete => 1,
                BodyEnd::Failed => 1 << 8,
                BodyEnd::Dropped => 1 << 16,
            };
            self.0.fetch_add(code, Ordering::SeqCst);
        }
    }

    const COMPLETE: usize = 1;
    const FAILED: usize = 1 << 8;
    const DROPPED: usize = 1 << 16;

    fn counter() -> (Arc<AtomicUsize>, CountingGuard) {
        let released = Arc::new(AtomicUsize::new(0));
        (released.clone(), CountingGuard(released))
    }

    type Chunk = Result<Frame<Bytes>, std::io::Error>;

    #[tokio::test]
    async fn releases_at_end_of_stream_before_the_body_is_dropped() {
        let (released, guard) = counter();
        let frames: Vec<Chunk> = vec![
            Ok(Frame::data(Bytes::from_static(b"a"))),
            Ok(Frame::data(Bytes::from_static(b"b"))),
        ];
        let mut body = GuardedBody::new(StreamBody::new(futures_stream(frames)), guard);
        assert!(body.frame().await.is_some());
        assert_eq!(
            released.load(Ordering::SeqCst),
            0,
            "mid-stream is still load"
        );
        assert!(body.frame().await.is_some());
        assert!(body.frame().await.is_none());
        assert_eq!(released.load(Ordering::SeqCst), COMPLETE);
        assert!(!body.is_holding());
        drop(body);
        assert_eq!(
            released.load(Ordering::SeqCst),
            COMPLETE,
            "released exactly once"
        );
    }

    #[tokio::test]
    async fn a_full_body_releases_with_its_only_frame() {
        let (released, guard) = counter();
        let mut body = GuardedBody::new(Full::new(Bytes::from_static(b"done")), guard);
        assert!(body.frame().await.is_some());
        assert_eq!(released.load(Ordering::SeqCst), COMPLETE);
    }

    #[tokio::test]
    async fn releases_on_upstream_error() {
        let (released, guard) = counter();
        let frames: Vec<Chunk> = vec![
            Ok(Frame::data(Bytes::from_static(b"a"))),
            Err(std::io::Error::other("reset")),
        ];
        let mut body = GuardedBody::new(StreamBody::new(futures_stream(frames)), guard);
        assert!(body.frame().await.unwrap().is_ok());
        assert!(body.frame().await.unwrap().is_err());
        assert_eq!(released.load(Ordering::SeqCst), FAILED);
        drop(body);
        assert_eq!(released.load(Ordering::SeqCst), FAILED);
    }

    #[tokio::test]
    async fn releases_when_dropped_half_way() {
        let (released, guard) = counter();
        let frames: Vec<Chunk> = vec![
            Ok(Frame::data(Bytes::from_static(b"a"))),
            Ok(Frame::data(Bytes::from_static(b"b"))),
        ];
        let mut body = GuardedBody::new(StreamBody::new(futures_stream(frames)), guard);
        assert!(body.frame().await.is_some());
        assert_eq!(released.load(Ordering::SeqCst), 0);
        drop(body);
        assert_eq!(released.load(Ordering::SeqCst), DROPPED);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_timeout_fails_a_quiet_body_and_releases_its_guard() {
        let (released, guard) = counter();
        let quiet = StreamBody::new(futures_util::stream::pending::<Chunk>());
        let mut body = Box::pin(GuardedBody::new(
            IdleTimeout::new(quiet, Duration::from_secs(5)),
            guard,
        ));
        let started = Instant::now();
        let frame = body.frame().await.unwrap();
        assert!(matches!(frame, Err(IdleTimeoutError::Idle(_))));
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert_eq!(released.load(Ordering::SeqCst), FAILED);
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_stops_a_body_that_keeps_talking() {
        let (released, guard) = counter();
        // A frame every second, forever: never idle, but past the deadline.
        let chatty = futures_util::stream::unfold((), |()| async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Some((
                Ok::<_, std::io::Error>(Frame::data(Bytes::from_static(b"x"))),
                (),
            ))
        });
        let started = Instant::now();
        let deadline = started + Duration::from_millis(3_500);
        let mut body = Box::pin(GuardedBody::new(
            IdleTimeout::with_deadline(StreamBody::new(chatty), Duration::from_secs(5), deadline),
            guard,
        ));
        let mut frames = 0;
        loop {
            match body.frame().await {
                Some(Ok(_)) => frames += 1,
                Some(Err(IdleTimeoutError::Deadline)) => break,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(frames, 3);
        assert_eq!(started.elapsed(), Duration::from_millis(3_500));
        assert_eq!(released.load(Ordering::SeqCst), FAILED);
    }

    #[tokio::test(start_paused = true)]
    async fn frames_closer_than_the_idle_limit_keep_a_slow_stream_alive() {
        let (released, guard) = counter();
        // Four frames 3 s apart with a 5 s idle limit: 12 s in all, never idle.
        let slow = futures_util::stream::unfold(0, |sent| async move {
            if sent == 4 {
                return None;
            }
            tokio::time::sleep(Duration::from_secs(3)).await;
            Some((
                Ok::<_, std::io::Error>(Frame::data(Bytes::from_static(b"x"))),
                sent + 1,
            ))
        });
        let started = Instant::now();
        let mut body = Box::pin(GuardedBody::new(
            IdleTimeout::new(StreamBody::new(slow), Duration::from_secs(5)),
            guard,
        ));
        let mut frames = 0;
        while let Some(frame) = body.frame().await {
            frame.unwrap();
            frames += 1;
        }
        assert_eq!(frames, 4);
        assert_eq!(started.elapsed(), Duration::from_secs(12));
        assert_eq!(released.load(Ordering::SeqCst), COMPLETE);
    }

    fn futures_stream(frames: Vec<Chunk>) -> impl futures_util::Stream<Item = Chunk> {
        futures_util::stream::iter(frames)
    }
}
