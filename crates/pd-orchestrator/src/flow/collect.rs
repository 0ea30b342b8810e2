//! Reading a response body to the end, with a size limit, as a poll step so
//! it can be driven next to another future without a runtime.

use std::future::poll_fn;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::Body;

use super::traits::BoxError;

/// Why a body could not be collected.
#[derive(Debug)]
pub(crate) enum CollectError {
    TooLarge(usize),
    Body(String),
}

impl std::fmt::Display for CollectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TooLarge(limit) => write!(f, "body larger than {limit} bytes"),
            Self::Body(error) => write!(f, "body error: {error}"),
        }
    }
}

/// Accumulates data frames; a single-frame body is returned without a copy.
#[derive(Debug, Default)]
pub(crate) struct Collector {
    first: Option<Bytes>,
    rest: Option<BytesMut>,
    len: usize,
}

impl Collector {
    pub(crate) fn poll_collect<B>(
        &mut self,
        cx: &mut Context<'_>,
        body: &mut B,
        limit: usize,
    ) -> Poll<Result<Bytes, CollectError>>
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        loop {
            match Pin::new(&mut *body).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => return Poll::Ready(Ok(self.take())),
                Poll::Ready(Some(Err(error))) => {
                    return Poll::Ready(Err(CollectError::Body(error.into().to_string())));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers carry nothing we merge
                    };
                    self.len = self.len.saturating_add(data.len());
                    if self.len > limit {
                        return Poll::Ready(Err(CollectError::TooLarge(limit)));
                    }
                    self.push(data);
                }
            }
        }
    }

    fn push(&mut self, data: Bytes) {
        if let Some(rest) = &mut self.rest {
            rest.extend_from_slice(&data);
        } else if let Some(first) = self.first.take() {
            let mut rest = BytesMut::with_capacity(first.len() + data.len());
            rest.extend_from_slice(&first);
            rest.extend_from_slice(&data);
            self.rest = Some(rest);
        } else {
            self.first = Some(data);
        }
    }

    fn take(&mut self) -> Bytes {
        match (self.rest.take(), self.first.take()) {
            (Some(rest), _) => rest.freeze(),
            (None, Some(first)) => first,
            (None, None) => Bytes::new(),
        }
    }
}

/// Reads `body` to the end, failing past `limit` bytes.
pub(crate) async fn collect_limited<B>(body: &mut B, limit: usize) -> Result<Bytes, CollectError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut collector = Collector::default();
    poll_fn(|cx| collector.poll_collect(cx, body, limit)).await
}
