//! The decode leg's end: its status, the streaming or merged body, and its
//! failures.

use std::future::poll_fn;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use serde_json::Value;

use super::body::BodyPrefill;
use super::collect::{Collector, collect_limited};
use super::legs::Legs;
use super::prefill::{PrefillResult, PrefillState};
use super::traits::PhaseLease;
use super::{
    LegOutcome, LegResponse, PdBackend, PdBody, PdFlow, PdWorker, Phase, Transport, UsageRewriter,
};
use crate::error::{PdError, is_retryable_status};
use crate::merge::merge_non_streaming;

impl<T, Bk> PdFlow<T, Bk>
where
    T: Transport,
    Bk: PdBackend,
{
    /// Checks the decode status and builds the client body: streaming (the
    /// lease moves into the body) or collected and merged.
    pub(super) async fn finish_decode(
        &self,
        response: LegResponse<T::Body>,
        mut lease: PhaseLease<Bk>,
        decode: &Bk::Worker,
        legs: &Legs<'_>,
        prefill: PrefillState,
    ) -> Result<(StatusCode, HeaderMap, PdBody<T::Body, Bk>), PdError> {
        let LegResponse {
            status,
            mut headers,
            mut body,
        } = response;
        lease.saw_status(status);
        if !status.is_success() {
            let error_body = collect_limited(&mut body, self.config.max_error_body_bytes)
                .await
                .unwrap_or_default();
            lease.finish(if is_retryable_status(status) {
                LegOutcome::WorkerFailure
            } else {
                LegOutcome::ClientError
            });
            return Err(PdError::DecodeRejected {
                status,
                body: error_body,
                worker: decode.id().to_owned(),
            });
        }
        if legs.streaming {
            let mut rewriter = (legs.stream_usage && self.config.rewrite_streaming_usage)
                .then(|| UsageRewriter::new(self.config.max_sse_event_bytes));
            let body_prefill = match prefill {
                PrefillState::Running(driver) => Some(BodyPrefill {
                    driver,
                    stats: Arc::clone(&self.stats),
                }),
                PrefillState::Done(response) => {
                    if let (Some(rewriter), Some(response)) = (rewriter.as_mut(), response.as_ref())
                    {
                        rewriter.set_prefill(response);
                    }
                    None
                }
            };
            if rewriter.is_some() {
                headers.remove(http::header::CONTENT_LENGTH);
            }
            return Ok((
                status,
                headers,
                PdBody::streaming(body, lease, body_prefill, rewriter),
            ));
        }

        // Non-streaming: read the decode body while the prefill (if still
        // running) keeps going; the decode phase ends when its body is read,
        // then the merge waits for the prefill's usage.
        let limit = self.config.max_decode_response_bytes;
        let (collected, prefill) = match prefill {
            PrefillState::Done(response) => (
                collect_limited(&mut body, limit).await,
                PrefillState::Done(response),
            ),
            PrefillState::Running(mut driver) => {
                let mut collector = Collector::default();
                let mut finished: Option<PrefillResult> = None;
                let collected = poll_fn(|cx| {
                    if finished.is_none()
                        && let Poll::Ready(result) = driver.as_mut().poll(cx)
                    {
                        finished = Some(result);
                    }
                    collector.poll_collect(cx, &mut body, limit)
                })
                .await;
                let state = match finished {
                    Some(result) => PrefillState::Done(self.prefill_result(result)),
                    None => PrefillState::Running(driver),
                };
                (collected, state)
            }
        };
        drop(body);
        let bytes = match collected {
            Ok(bytes) => {
                lease.finish(LegOutcome::Success);
                bytes
            }
            Err(error) => {
                lease.finish(LegOutcome::WorkerFailure);
                return Err(PdError::DecodeBodyFailed {
                    reason: error.to_string(),
                    worker: decode.id().to_owned(),
                });
            }
        };
        let prefill_response = match prefill {
            PrefillState::Done(response) => response,
            PrefillState::Running(driver) => self.prefill_result(driver.await),
        };
        let bytes = match (&prefill_response, self.config.merge_non_streaming) {
            (Some(prefill_response), true) => self.merged(prefill_response, bytes, &mut headers),
            _ => bytes,
        };
        Ok((status, headers, PdBody::full(bytes)))
    }

    /// The concurrent prefill's response, counting a failure that decode
    /// outlived.
    fn prefill_result(&self, result: PrefillResult) -> Option<Value> {
        match result {
            Ok(response) => Some(response),
            Err(_) => {
                self.stats
                    .prefill_failures_during_decode
                    .fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    fn merged(&self, prefill: &Value, decode: Bytes, headers: &mut HeaderMap) -> Bytes {
        let Ok(mut value) = serde_json::from_slice::<Value>(&decode) else {
            return decode;
        };
        let report = merge_non_streaming(prefill, &mut value);
        if !(report.usage || report.logprobs) {
            return decode;
        }
        match serde_json::to_vec(&value) {
            Ok(merged) => {
                self.stats.merged_responses.fetch_add(1, Ordering::Relaxed);
                headers.remove(http::header::CONTENT_LENGTH);
                Bytes::from(merged)
            }
            Err(_) => decode,
        }
    }
}

/// A decode leg that could not be sent or answered, naming its worker.
pub(super) fn decode_failed<W: PdWorker>(decode: &W, reason: String) -> PdError {
    PdError::DecodeFailed {
        reason,
        worker: decode.id().to_owned(),
    }
}

/// A decode leg whose request could not be sent or answered: the worker's
/// failure, or the caller's own when the transport says so.
pub(super) fn decode_send_failed<T: Transport, Bk: PdBackend, W: PdWorker>(
    lease: PhaseLease<Bk>,
    decode: &W,
    error: &T::Error,
) -> PdError {
    if T::is_local_error(error) {
        lease.finish(LegOutcome::NotSent);
        return PdError::LegNotSent {
            phase: Phase::Decode,
            reason: error.to_string(),
        };
    }
    lease.finish(LegOutcome::WorkerFailure);
    decode_failed(decode, error.to_string())
}
