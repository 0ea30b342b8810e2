//! The per-request facts both legs share, and how a leg request is built.

use bytes::Bytes;
use serde_json::{Map, Value};

use super::{LegRequest, PdWorker, Phase};
use crate::connector::LegContext;
use crate::error::PdError;
use crate::headers::{ForwardHeaders, leg_headers, p2p_request_id};

/// Per-request facts shared by both legs.
#[derive(Clone, Copy)]
pub(super) struct Legs<'a> {
    pub(super) path: &'a str,
    pub(super) request_id: &'a str,
    pub(super) forward: &'a ForwardHeaders,
    pub(super) streaming: bool,
    pub(super) stream_usage: bool,
}

impl<'a> Legs<'a> {
    pub(super) fn context<'b, W: PdWorker>(
        &self,
        attempt: u32,
        prefill: &'b W,
        decode: &'b W,
    ) -> LegContext<'b>
    where
        'a: 'b,
    {
        LegContext {
            request_id: self.request_id,
            attempt,
            prefill: prefill.endpoint(),
            decode: decode.endpoint(),
        }
    }

    /// Builds a leg and the wire request id of this (prefill, decode) pair.
    pub(super) fn build(
        &self,
        phase: Phase,
        ctx: &LegContext<'_>,
        target: &crate::PdEndpoint,
        body: &Map<String, Value>,
    ) -> Result<(LegRequest, String), PdError> {
        let wire_id = p2p_request_id(
            &ctx.prefill.kv_addr(),
            &ctx.decode.kv_addr(),
            self.request_id,
        );
        let leg = self.leg(phase, target, &wire_id, body)?;
        Ok((leg, wire_id))
    }

    pub(super) fn leg(
        &self,
        phase: Phase,
        target: &crate::PdEndpoint,
        wire_id: &str,
        body: &Map<String, Value>,
    ) -> Result<LegRequest, PdError> {
        let headers = leg_headers(self.forward, wire_id, target)?;
        // Serializing a map of JSON values cannot fail (all keys are strings).
        let body = serde_json::to_vec(body).map_err(|_| PdError::InvalidBody)?;
        Ok(LegRequest {
            phase,
            url: target.url_for(self.path),
            headers,
            body: Bytes::from(body),
        })
    }
}
