//! The client-facing response body: owns the decode guard until the end of
//! the decode stream, and in concurrent mode keeps driving the prefill leg.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::sse::UsageRewriter;
use super::traits::{BoxError, LegOutcome, PdBackend, PhaseLease};
use super::{FlowStats, PrefillResult};

/// A prefill leg still in flight, owning its own guard and outcome.
pub(crate) type PrefillDriver = Pin<Box<dyn Future<Output = PrefillResult> + Send>>;

/// A concurrent prefill leg handed to the body, with the counters its
/// failure goes to.
pub(crate) struct BodyPrefill {
    pub(crate) driver: PrefillDriver,
    pub(crate) stats: Arc<FlowStats>,
}

/// The decode response body handed to the client.
///
/// - Streaming: frames come from the decode engine. The decode guard is
///   released, and the decode outcome recorded, at end of stream
///   ([`LegOutcome::Success`]), at a body error
///   ([`LegOutcome::WorkerFailure`]) or when this body is dropped before its
///   end ([`LegOutcome::Cancelled`]: the client went away). When the client
///   asked for usage in the stream, `data:` events carrying `usage` get the
///   prefill's prompt accounting (see [`crate::merge`]).
/// - Merged (non-streaming): one frame with the merged JSON; the decode leg
///   already ended when it was built.
///
/// In concurrent mode a prefill leg that has not finished yet is polled
/// with every poll of this body, so it completes (and releases its own
/// guard) independently of the decode stream; when the decode stream ends
/// first, or this body is dropped, the prefill leg is aborted.
///
/// This body is `Unpin` and never holds a lock across a poll.
#[must_use = "dropping the body ends the decode phase"]
pub struct PdBody<B, Bk: PdBackend> {
    upstream: Option<B>,
    upstream_done: bool,
    full: Option<Bytes>,
    lease: Option<PhaseLease<Bk>>,
    prefill: Option<BodyPrefill>,
    rewriter: Option<UsageRewriter>,
}

// No field is structurally pinned: the upstream body is `Unpin` (a
// `Transport` bound), the prefill driver is boxed.
impl<B, Bk: PdBackend> Unpin for PdBody<B, Bk> {}

impl<B, Bk: PdBackend> fmt::Debug for PdBody<B, Bk> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PdBody")
            .field("streaming", &self.upstream.is_some())
            .field("full_len", &self.full.as_ref().map(Bytes::len))
            .field("decode_active", &self.lease.is_some())
            .field("prefill_active", &self.prefill.is_some())
            .field("rewrites_usage", &self.rewriter.is_some())
            .finish()
    }
}

impl<B, Bk: PdBackend> PdBody<B, Bk> {
    pub(crate) fn streaming(
        upstream: B,
        lease: PhaseLease<Bk>,
        prefill: Option<BodyPrefill>,
        rewriter: Option<UsageRewriter>,
    ) -> Self {
        Self {
            upstream: Some(upstream),
            upstream_done: false,
            full: None,
            lease: Some(lease),
            prefill,
            rewriter,
        }
    }

    pub(crate) fn full(bytes: Bytes) -> Self {
        Self {
            upstream: None,
            upstream_done: false,
            full: Some(bytes),
            lease: None,
            prefill: None,
            rewriter: None,
        }
    }

    /// Whether the decode phase is still counted (its guard not released).
    pub fn decode_active(&self) -> bool {
        self.lease.is_some()
    }

    /// Whether a concurrent prefill leg is still in flight inside this body.
    pub fn prefill_active(&self) -> bool {
        self.prefill.is_some()
    }

    /// The merged body of a non-streaming response, if this is one and it
    /// has not been polled yet.
    pub fn merged_bytes(&self) -> Option<&Bytes> {
        self.full.as_ref()
    }

    fn poll_prefill(&mut self, cx: &mut Context<'_>) {
        let Some(prefill) = self.prefill.as_mut() else {
            return;
        };
        let Poll::Ready(result) = prefill.driver.as_mut().poll(cx) else {
            return;
        };
        match result {
            Ok(response) => {
                if let Some(rewriter) = self.rewriter.as_mut() {
                    rewriter.set_prefill(&response);
                }
            }
            Err(_) => {
                prefill
                    .stats
                    .prefill_failures_during_decode
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        self.prefill = None;
    }

    fn end(&mut self, outcome: LegOutcome) {
        self.upstream = None;
        if let Some(lease) = self.lease.take() {
            lease.finish(outcome);
        }
        // The decode stream is over; a prefill leg still running has no
        // consumer left.
        self.prefill = None;
    }
}

impl<B, Bk> Body for PdBody<B, Bk>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
    Bk: PdBackend,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        this.poll_prefill(cx);
        if let Some(bytes) = this.full.take() {
            return Poll::Ready(Some(Ok(Frame::data(bytes))));
        }
        loop {
            if this.upstream_done {
                this.end(LegOutcome::Success);
                return Poll::Ready(None);
            }
            let Some(upstream) = this.upstream.as_mut() else {
                return Poll::Ready(None);
            };
            match Pin::new(upstream).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    let Some(rewriter) = this.rewriter.as_mut() else {
                        return Poll::Ready(Some(Ok(frame)));
                    };
                    match frame.into_data() {
                        Ok(data) => {
                            if let Some(out) = rewriter.push(data) {
                                return Poll::Ready(Some(Ok(Frame::data(out))));
                            }
                            // The chunk only completed part of an event.
                        }
                        Err(frame) => return Poll::Ready(Some(Ok(frame))),
                    }
                }
                Poll::Ready(Some(Err(error))) => {
                    this.end(LegOutcome::WorkerFailure);
                    return Poll::Ready(Some(Err(error.into())));
                }
                Poll::Ready(None) => {
                    if let Some(tail) = this.rewriter.as_mut().and_then(UsageRewriter::finish) {
                        // Hand out the buffered tail; the phase ends at the
                        // next poll, when the client has it.
                        this.upstream_done = true;
                        return Poll::Ready(Some(Ok(Frame::data(tail))));
                    }
                    this.end(LegOutcome::Success);
                    return Poll::Ready(None);
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match (&self.full, &self.upstream) {
            (Some(full), _) => full.is_empty(),
            // Never claim the end early: the guard is released by the poll
            // that observes it, so the outcome is Success, not Cancelled.
            (None, Some(_)) => false,
            (None, None) => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.full, &self.upstream) {
            (Some(full), _) => SizeHint::with_exact(full.len() as u64),
            (None, Some(upstream)) if self.rewriter.is_none() => upstream.size_hint(),
            (None, Some(_)) => SizeHint::default(),
            (None, None) => SizeHint::with_exact(0),
        }
    }
}
