//! The concurrent flow: prefill and decode dispatched together.

use std::future::poll_fn;
use std::pin::pin;
use std::task::Poll;

use serde_json::{Map, Value};

use super::body::PrefillDriver;
use super::decode::{decode_failed, decode_send_failed};
use super::legs::Legs;
use super::prefill::{PrefillLegError, PrefillResult, PrefillState, run_prefill_leg};
use super::traits::PhaseLease;
use super::{PdBackend, PdFlow, PdResponse, PdWorker, Phase, Transport};
use crate::connector::{KV_TRANSFER_PARAMS, KvConnector, apply_decode_handoff};
use crate::error::PdError;

impl<T, Bk> PdFlow<T, Bk>
where
    T: Transport,
    Bk: PdBackend,
{
    pub(super) async fn run_concurrent<C: KvConnector + ?Sized>(
        &self,
        connector: &C,
        legs: Legs<'_>,
        mut prefill_body: Map<String, Value>,
        mut decode_body: Map<String, Value>,
        prefill: Bk::Worker,
        decode: Bk::Worker,
    ) -> Result<PdResponse<T::Body, Bk>, PdError> {
        // Build both legs before reserving anything: a connector error
        // leaves no load behind.
        let ctx = legs.context(0, &prefill, &decode);
        let params = connector.prefill_params(&ctx)?;
        prefill_body.insert(KV_TRANSFER_PARAMS.to_owned(), params);
        let mut handoff = connector.decode_params(&ctx, None)?;
        let handoff_kind = self.note_handoff(&handoff, &ctx, connector);
        apply_decode_handoff(&mut decode_body, &mut handoff);
        let (prefill_leg, wire_id) =
            legs.build(Phase::Prefill, &ctx, ctx.prefill, &prefill_body)?;
        let decode_leg = legs.leg(Phase::Decode, ctx.decode, &wire_id, &decode_body)?;

        let prefill_lease =
            PhaseLease::reserve(&*self.backend, &prefill, Phase::Prefill).map_err(|refused| {
                PdError::PrefillFailed {
                    attempts: 1,
                    last: format!("not reserved: {refused}"),
                    worker: prefill.id().to_owned(),
                }
            })?;
        let prefill_sent = self.transport.send(prefill_leg);
        let mut driver: Option<PrefillDriver> = Some(Box::pin(run_prefill_leg(
            prefill_sent,
            prefill_lease,
            self.limits(),
            T::is_local_error,
        )));
        let mut prefill_result: Option<PrefillResult> = None;

        // A refusal drops the prefill leg before its first poll, finishing
        // its lease as cancelled.
        let decode_lease = PhaseLease::reserve(&*self.backend, &decode, Phase::Decode)
            .map_err(|refused| decode_failed(&decode, format!("not reserved: {refused}")))?;

        let mut decode_sent = pin!(self.transport.send(decode_leg));
        let head = poll_fn(|cx| {
            if let Some(running) = driver.as_mut()
                && let Poll::Ready(result) = running.as_mut().poll(cx)
            {
                driver = None;
                let failed = result.is_err();
                prefill_result = Some(result);
                if failed {
                    return Poll::Ready(None);
                }
            }
            decode_sent.as_mut().poll(cx).map(Some)
        })
        .await;
        let response = match head {
            None => {
                // Prefill failed before decode answered: abort decode.
                drop(decode_lease);
                return Err(match prefill_result {
                    Some(Err(PrefillLegError::Rejected { status, body })) => {
                        PdError::PrefillRejected { status, body }
                    }
                    Some(Err(PrefillLegError::NotSent(reason))) => PdError::LegNotSent {
                        phase: Phase::Prefill,
                        reason,
                    },
                    Some(Err(PrefillLegError::Failed(last))) => PdError::PrefillFailed {
                        attempts: 1,
                        last,
                        worker: prefill.id().to_owned(),
                    },
                    Some(Ok(_)) | None => PdError::PrefillFailed {
                        attempts: 1,
                        last: "prefill ended without a result".to_owned(),
                        worker: prefill.id().to_owned(),
                    },
                });
            }
            Some(Err(error)) => {
                // `driver` drops with this frame: the prefill leg is aborted.
                return Err(decode_send_failed::<T, _, _>(decode_lease, &decode, &error));
            }
            Some(Ok(response)) => response,
        };
        let prefill_state = match driver {
            Some(driver) => PrefillState::Running(driver),
            None => PrefillState::Done(prefill_result.and_then(Result::ok)),
        };
        let (status, headers, body) = self
            .finish_decode(response, decode_lease, &decode, &legs, prefill_state)
            .await?;
        Ok(PdResponse {
            status,
            headers,
            body,
            handoff: handoff_kind,
            prefill,
            prefill_attempts: 1,
        })
    }
}
