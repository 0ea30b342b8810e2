//! How engine events become response bytes: for a stream, vLLM's SSE
//! chunks (a chat's role chunk first, one chunk per token, the finish
//! chunk, the usage chunk when asked for, `[DONE]`); otherwise the one JSON
//! answer, written when the request finishes.

use std::collections::VecDeque;

use bytes::Bytes;

use crate::api::{self, Endpoint, ResponseMeta, SSE_DONE, Usage};
use crate::engine::{EngineEvent, EventKind, RequestSummary};
use crate::text::{output_text, output_token};

/// Turns engine events into response bytes.
pub(super) struct Formatter {
    pub(super) meta: ResponseMeta,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) continuous_usage: bool,
    pub(super) seed: u64,
    pub(super) prompt_hash: u64,
    /// Whether the stream has begun: a chat's first token is preceded by
    /// the role chunk.
    pub(super) sent_first: bool,
    pub(super) prompt_tokens: usize,
    pub(super) cached_tokens: usize,
}

impl Formatter {
    /// Appends the frames for `event`; returns true at the end.
    pub(super) fn on_event(&mut self, event: EngineEvent, out: &mut VecDeque<Bytes>) -> bool {
        match event.kind {
            EventKind::Token { index } => {
                if self.stream {
                    let text = output_token(self.seed, self.prompt_hash, index);
                    let usage = self.continuous_usage.then_some(Usage {
                        prompt_tokens: self.prompt_tokens,
                        completion_tokens: index + 1,
                        cached_tokens: self.cached_tokens,
                    });
                    if !self.sent_first && self.meta.endpoint == Endpoint::Chat {
                        out.push_back(api::sse_event(&api::stream_chunk(
                            &self.meta, "", true, None, None,
                        )));
                    }
                    self.sent_first = true;
                    out.push_back(api::sse_event(&api::stream_chunk(
                        &self.meta, text, false, None, usage,
                    )));
                }
                false
            }
            EventKind::Finished(summary) => {
                self.finish(&summary, out);
                true
            }
        }
    }

    fn finish(&mut self, summary: &RequestSummary, out: &mut VecDeque<Bytes>) {
        let usage = Usage {
            prompt_tokens: summary.prompt_tokens,
            completion_tokens: summary.completion_tokens,
            cached_tokens: summary.cached_tokens,
        };
        if self.stream {
            let continuous = self.continuous_usage.then_some(usage);
            out.push_back(api::sse_event(&api::stream_chunk(
                &self.meta,
                "",
                false,
                Some("length"),
                continuous,
            )));
            if self.include_usage {
                out.push_back(api::sse_event(&api::usage_chunk(&self.meta, usage)));
            }
            out.push_back(Bytes::from_static(SSE_DONE));
        } else {
            let text = output_text(self.seed, self.prompt_hash, summary.completion_tokens);
            let body = api::full_response(
                &self.meta,
                &text,
                "length",
                usage,
                summary.kv_transfer_params.as_ref(),
            );
            out.push_back(body.to_string().into());
        }
    }
}
