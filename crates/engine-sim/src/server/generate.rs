//! The generation endpoints (`/v1/chat/completions`, `/v1/completions`):
//! injected faults, reading and parsing the body, the decode engine's wait
//! for a pushed transfer, submitting to the model, and the response whose
//! body then follows the request in the engine.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::{HeaderValue, Request, Response, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::body::{AbortGuard, EventSource, InFlight, SimBody};
use super::format::Formatter;
use super::{ServerState, error_response, unix_now};
use crate::api::{self, Endpoint, EngineApiError, Prompt, ResponseMeta};
use crate::config::Role;
use crate::engine::SimRequest;
use crate::fault::{FAULT_HEADER, RequestFaults, parse_fault_header};
use crate::tokens::{mix64, sequence_hash, tokenize};
use crate::transfer::KvTransferParams;

/// The status a request fails with by injection: its header's, the
/// engine's fixed one, or one of the first `fail_first` or a seeded draw
/// of `failure_rate`.
fn injected_status(shared: &ServerState, header: &RequestFaults) -> Option<u16> {
    if header.status.is_some() {
        return header.status;
    }
    let faults = &shared.config.faults;
    if faults.fixed_status.is_some() {
        return faults.fixed_status;
    }
    let n = shared.generation_requests.fetch_add(1, Ordering::Relaxed);
    let fail = faults.fail_status.unwrap_or(500);
    if n < u64::from(faults.fail_first) {
        return Some(fail);
    }
    if faults.failure_rate > 0.0 {
        let draw =
            mix64(shared.config.model.seed ^ 0xFA17_FA17 ^ mix64(n)) as f64 / u64::MAX as f64;
        if draw < faults.failure_rate {
            return Some(fail);
        }
    }
    None
}

/// Answers a generation request: a JSON answer or an SSE stream, or the
/// JSON error vLLM would send.
pub(super) async fn generate(
    shared: &Arc<ServerState>,
    reset: Arc<AtomicBool>,
    endpoint: Endpoint,
    req: Request<Incoming>,
) -> Response<SimBody> {
    let in_flight = InFlight::new(shared);
    let header_faults = match req.headers().get(FAULT_HEADER) {
        None => RequestFaults::default(),
        Some(value) => match value.to_str().map(parse_fault_header) {
            Ok(Ok(faults)) => faults,
            Ok(Err(e)) => return error_response(&EngineApiError::bad_request(e.to_string())),
            Err(_) => {
                return error_response(&EngineApiError::bad_request(
                    "x-sim-fault must be visible ASCII",
                ));
            }
        },
    };
    let faults = &shared.config.faults;
    if let Some(warmup) = faults.slow_start {
        tokio::time::sleep_until(shared.start + warmup).await;
    }
    if let Some(status) = injected_status(shared, &header_faults) {
        shared.faults_injected.fetch_add(1, Ordering::Relaxed);
        return error_response(&EngineApiError::with_status(
            status,
            format!("injected fault: status {status}"),
        ));
    }
    if let Some(stall) = header_faults
        .stall_before_headers
        .or(faults.stall_before_headers)
    {
        shared.faults_injected.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(stall).await;
    }
    let body = match Limited::new(req.into_body(), shared.max_body_bytes)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            let too_large = e
                .downcast_ref::<http_body_util::LengthLimitError>()
                .is_some();
            return if too_large {
                error_response(&EngineApiError::with_status(413, "request body too large"))
            } else {
                error_response(&EngineApiError::bad_request(format!(
                    "could not read the request body: {e}"
                )))
            };
        }
    };
    let parsed = match api::parse_request_with(
        endpoint,
        &body,
        shared.tokenizer.as_deref(),
        Some(&shared.config.model.model_name),
    ) {
        Ok(parsed) => parsed,
        Err(e) => return error_response(&e),
    };
    let prompt = match parsed.prompt {
        Prompt::Text(text) => tokenize(&text, shared.config.model.chars_per_token),
        Prompt::Tokens(tokens) => tokens,
    };
    let prompt_hash = sequence_hash(&prompt);
    let prompt_len = prompt.len();
    let max_tokens = parsed
        .max_tokens
        .unwrap_or(shared.config.model.default_max_tokens);
    let kv_params = parsed
        .kv_transfer_params
        .as_ref()
        .map(KvTransferParams::from_json);
    if shared.config.role == Role::Decode {
        wait_for_push_transfer(shared, kv_params.as_ref()).await;
    }
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let (sink, events) = mpsc::unbounded_channel();
    {
        let mut core = shared.core.lock();
        let now = shared.model_now();
        let request = SimRequest {
            id,
            prompt,
            max_tokens,
            kv_transfer_params: kv_params,
        };
        if let Err(e) = core.engine.submit(now, request) {
            return error_response(&EngineApiError::bad_request(e.to_string()));
        }
        core.sinks.insert(id, sink);
    }
    shared.wake.notify_one();
    let abort = AbortGuard::new(shared.clone(), id);
    let formatter = Formatter {
        meta: ResponseMeta {
            id: format!(
                "{}-{:016x}",
                ResponseMeta::id_prefix(endpoint),
                mix64(id ^ prompt_hash)
            ),
            created: unix_now(),
            model: shared.config.model.model_name.clone(),
            endpoint,
        },
        stream: parsed.stream,
        include_usage: parsed.include_usage,
        continuous_usage: parsed.continuous_usage,
        seed: shared.config.model.seed,
        prompt_hash,
        sent_first: false,
        prompt_tokens: prompt_len,
        cached_tokens: 0,
    };
    let stall_after = header_faults
        .stall_after_headers
        .or(faults.stall_after_headers);
    let reset_mid_body = header_faults.reset_mid_body || faults.reset_mid_body;
    if stall_after.is_some() {
        shared.faults_injected.fetch_add(1, Ordering::Relaxed);
    }
    if reset_mid_body {
        shared.faults_injected.fetch_add(1, Ordering::Relaxed);
    }
    let content_type = if parsed.stream {
        "text/event-stream; charset=utf-8"
    } else {
        "application/json"
    };
    let source = EventSource::new(events, formatter, abort);
    let body = if !parsed.stream && stall_after.is_none() && !reset_mid_body {
        // Plain JSON: wait for the answer, send it with a content-length.
        let Some(full) = source.answer().await else {
            return error_response(&EngineApiError::with_status(503, "engine stopped"));
        };
        SimBody::full(full.into()).holding(in_flight)
    } else {
        SimBody::streaming(
            source,
            stall_after,
            reset_mid_body.then_some(reset),
            in_flight,
        )
    };
    let mut response = Response::new(body);
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// A decode engine with a shared registry waits (bounded) for a push
/// transfer that the named prefill has not produced yet: push connectors
/// may dispatch both legs at once.
async fn wait_for_push_transfer(shared: &ServerState, params: Option<&KvTransferParams>) {
    let (Some(registry), Some(params)) = (&shared.registry, params) else {
        return;
    };
    let Some(transfer_id) = params
        .transfer_id
        .as_deref()
        .filter(|_| params.do_remote_prefill)
    else {
        return;
    };
    let deadline = Instant::now() + shared.config.kv_wait_timeout;
    loop {
        let notified = shared.registry_changed.notified();
        let mut notified = std::pin::pin!(notified);
        notified.as_mut().enable();
        if registry.has_pending_transfer_id(transfer_id) {
            return;
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return;
        }
    }
}
