//! The sequential flow: prefill (with retries), then decode.

use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{Map, Value};
use worker_lifecycle::{Attempted, Attempts, run_attempts};

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
        prefill: Bk::Worker,
        decode: Option<Bk::Worker>,
    ) -> Result<PdResponse<T::Body, Bk>, PdError> {
        let mut attempts = PrefillAttempts {
            flow: self,
            connector,
            legs,
            body: &mut prefill_body,
            decode: decode.as_ref(),
            max_attempts: self.config.max_prefill_attempts.max(1),
        };
        let prefilled = run_attempts(&mut attempts, prefill).await?;
        let Prefilled {
            response: mut prefill_response,
            wire_id,
            worker: prefill,
            attempt,
        } = prefilled;

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

/// A prefill that completed: its response, the pair's wire request id, the
/// worker that ran it, and its attempt number (0 for the first).
struct Prefilled<W> {
    response: Value,
    wire_id: String,
    worker: W,
    attempt: u32,
}

/// The prefill leg's attempts, run by worker-lifecycle's one attempt loop:
/// attempt `n` sends the prefill to the worker carried over (the one the
/// request was given, then each re-selection), the decode staying as
/// chosen. A failed prefill is re-selected at once (no backoff: another
/// worker, not the same one later), at most `max_attempts` in all.
struct PrefillAttempts<'a, T, Bk, C>
where
    T: Transport,
    Bk: PdBackend,
    C: KvConnector + ?Sized,
{
    flow: &'a PdFlow<T, Bk>,
    connector: &'a C,
    legs: Legs<'a>,
    body: &'a mut Map<String, Value>,
    decode: Option<&'a Bk::Worker>,
    max_attempts: u32,
}

impl<T, Bk, C> Attempts for PrefillAttempts<'_, T, Bk, C>
where
    T: Transport,
    Bk: PdBackend,
    C: KvConnector + ?Sized,
{
    type Answer = Result<Prefilled<Bk::Worker>, PdError>;
    /// Why the prefill failed, and on which worker.
    type Failure = (String, Bk::Worker);
    type Carry = Bk::Worker;

    async fn attempt(
        &mut self,
        attempt: u32,
        prefill: Bk::Worker,
    ) -> Attempted<Self::Answer, Self::Failure> {
        let legs = &self.legs;
        // Late decode: the connector's prefill parameters do not read the
        // decode endpoint, and the wire id leaves its address empty.
        let ctx = legs.context(attempt, &prefill, self.decode.unwrap_or(&prefill));
        let decode_addr = self.decode.map(|d| d.endpoint().kv_addr());
        let params = match self.connector.prefill_params(&ctx) {
            Ok(params) => params,
            Err(err) => return Attempted::Done(Err(err.into())),
        };
        self.body.insert(KV_TRANSFER_PARAMS.to_owned(), params);
        let wire_id = p2p_request_id(
            &ctx.prefill.kv_addr(),
            decode_addr.as_deref().unwrap_or(""),
            legs.request_id,
        );
        let leg = match legs.leg(Phase::Prefill, ctx.prefill, &wire_id, self.body) {
            Ok(leg) => leg,
            Err(err) => return Attempted::Done(Err(err)),
        };
        let flow = self.flow;
        let failure = match PhaseLease::reserve(&*flow.backend, &prefill, Phase::Prefill) {
            Err(refused) => format!("not reserved: {refused}"),
            Ok(lease) => {
                let sent = flow.transport.send(leg);
                match run_prefill_leg(sent, lease, flow.limits(), T::is_local_error).await {
                    Ok(response) => {
                        return Attempted::Done(Ok(Prefilled {
                            response,
                            wire_id,
                            worker: prefill,
                            attempt,
                        }));
                    }
                    Err(PrefillLegError::Rejected { status, body }) => {
                        return Attempted::Done(Err(PdError::PrefillRejected { status, body }));
                    }
                    Err(PrefillLegError::Failed(failure)) => failure,
                    Err(PrefillLegError::NotSent(reason)) => {
                        return Attempted::Done(Err(PdError::LegNotSent {
                            phase: Phase::Prefill,
                            reason,
                        }));
                    }
                }
            }
        };
        Attempted::Failed((failure, prefill))
    }

    fn retry(
        &mut self,
        attempt: u32,
        (failure, prefill): Self::Failure,
    ) -> Result<(Duration, Bk::Worker), Self::Answer> {
        let attempts = attempt + 1;
        tracing::warn!(
            prefill = prefill.endpoint().base_url(),
            attempt = attempts,
            %failure,
            "prefill attempt failed"
        );
        let next = if attempts < self.max_attempts {
            self.flow.backend.reselect_prefill(&prefill, attempts)
        } else {
            None
        };
        match next {
            Some(next) => {
                self.flow
                    .stats
                    .prefill_retries
                    .fetch_add(1, Ordering::Relaxed);
                Ok((Duration::ZERO, next))
            }
            None => Err(Err(PdError::PrefillFailed {
                attempts,
                last: failure,
                worker: prefill.id().to_owned(),
            })),
        }
    }

    async fn wait(&mut self, _wait: Duration) -> Result<(), Self::Answer> {
        Ok(())
    }
}
