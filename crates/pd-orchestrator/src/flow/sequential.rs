//! The sequential flow: prefill (with retries), then decode.

use std::sync::atomic::Ordering;

use serde_json::{Map, Value};

use super::decode::{decode_failed, decode_send_failed};
use super::legs::Legs;
use super::prefill::{PrefillLegError, PrefillState, run_prefill_leg};
use super::traits::PhaseLease;
use super::{PdBackend, PdFlow, PdResponse, PdWorker, Phase, Transport};
use crate::connector::{KV_TRANSFER_PARAMS, KvConnector, apply_decode_handoff};
use crate::error::PdError;
use crate::headers::p2p_request_id;

impl<T, Bk> PdFlow<T, Bk>
where
    T: Transport,
    Bk: PdBackend,
{
    pub(super) async fn run_sequential<C: KvConnector + ?Sized>(
        &self,
        connector: &C,
        legs: Legs<'_>,
        mut prefill_body: Map<String, Value>,
        mut decode_body: Map<String, Value>,
        mut prefill: Bk::Worker,
        decode: Option<Bk::Worker>,
    ) -> Result<PdResponse<T::Body, Bk>, PdError> {
        let max_attempts = self.config.max_prefill_attempts.max(1);
        let mut attempt = 0;
        let (mut prefill_response, wire_id) = loop {
            // Late decode: the connector's prefill parameters do not read
            // the decode endpoint, and the wire id leaves its address empty.
            let ctx = legs.context(attempt, &prefill, decode.as_ref().unwrap_or(&prefill));
            let decode_addr = decode.as_ref().map(|d| d.endpoint().kv_addr());
            let params = connector.prefill_params(&ctx)?;
            prefill_body.insert(KV_TRANSFER_PARAMS.to_owned(), params);
            let wire_id = p2p_request_id(
                &ctx.prefill.kv_addr(),
                decode_addr.as_deref().unwrap_or(""),
                legs.request_id,
            );
            let leg = legs.leg(Phase::Prefill, ctx.prefill, &wire_id, &prefill_body)?;
            let failure = match PhaseLease::reserve(&*self.backend, &prefill, Phase::Prefill) {
                Err(refused) => format!("not reserved: {refused}"),
                Ok(lease) => {
                    let sent = self.transport.send(leg);
                    match run_prefill_leg(sent, lease, self.limits(), T::is_local_error).await {
                        Ok(response) => break (response, wire_id),
                        Err(PrefillLegError::Rejected { status, body }) => {
                            return Err(PdError::PrefillRejected { status, body });
                        }
                        Err(PrefillLegError::Failed(failure)) => failure,
                        Err(PrefillLegError::NotSent(reason)) => {
                            return Err(PdError::LegNotSent {
                                phase: Phase::Prefill,
                                reason,
                            });
                        }
                    }
                }
            };
            attempt += 1;
            tracing::warn!(
                prefill = prefill.endpoint().base_url(),
                attempt,
                %failure,
                "prefill attempt failed"
            );
            let next = if attempt < max_attempts {
                self.backend.reselect_prefill(&prefill, attempt)
            } else {
                None
            };
            match next {
                Some(next) => {
                    self.stats.prefill_retries.fetch_add(1, Ordering::Relaxed);
                    prefill = next;
                }
                None => {
                    return Err(PdError::PrefillFailed {
                        attempts: attempt,
                        last: failure,
                        worker: prefill.id().to_owned(),
                    });
                }
            }
        };

        let decode = match decode {
            Some(decode) => decode,
            None => self
                .backend
                .select_decode(&prefill)
                .ok_or(PdError::NoDecodeWorker)?,
        };
        let ctx = legs.context(attempt, &prefill, &decode);
        let mut handoff = connector.decode_params(&ctx, Some(&mut prefill_response))?;
        let handoff_kind = self.note_handoff(&handoff, &ctx, connector);
        apply_decode_handoff(&mut decode_body, &mut handoff);
        let leg = legs.leg(Phase::Decode, ctx.decode, &wire_id, &decode_body)?;
        let lease = PhaseLease::reserve(&*self.backend, &decode, Phase::Decode)
            .map_err(|refused| decode_failed(&decode, format!("not reserved: {refused}")))?;
        let sent = self.transport.send(leg);
        let response = match sent.await {
            Ok(response) => response,
            Err(error) => return Err(decode_send_failed::<T, _, _>(lease, &decode, &error)),
        };
        let (status, headers, body) = self
            .finish_decode(
                response,
                lease,
                &decode,
                &legs,
                PrefillState::Done(Some(prefill_response)),
            )
            .await?;
        Ok(PdResponse {
            status,
            headers,
            body,
            handoff: handoff_kind,
            prefill,
            prefill_attempts: attempt + 1,
        })
    }
}
