//! Prefill/decode disaggregation, generic over the transport.
//!
//! A disaggregated request runs in two legs: a **prefill** engine processes
//! the prompt and produces its KV cache, a **decode** engine receives that
//! cache over a KV connector and generates the tokens. This crate holds
//! everything between "a (prefill, decode) pair was chosen" and "the client
//! has a streaming body":
//!
//! - [`connector`]: the KV connector strategies behind [`KvConnector`] —
//!   [`Nixl`] (pull, sequential), [`Mooncake`] (push, concurrent by default),
//!   [`MoriIo`] (READ sequential, WRITE concurrent, with
//!   [`MoriIoModeGate`] refusing registrations of the other mode). Each says
//!   how the two bodies are rewritten and what passes from the prefill
//!   response to the decode request.
//! - [`bootstrap`]: learning a Mooncake prefill engine's id per DP rank from
//!   its bootstrap server, with retry and backoff, behind small traits.
//! - [`headers`]: the P2P request-id convention
//!   (`___prefill_addr_{P}___decode_addr_{D}_{uuid}`), the
//!   `X-data-parallel-rank` header, explicit forwarding of client auth.
//! - [`merge`]: usage and prompt-logprob merging for non-streaming
//!   responses (and usage events of streams that ask for them).
//! - [`PdFlow`]: the two-phase flow over a [`Transport`], with one load
//!   guard per phase from a [`PdBackend`] and outcomes recorded per leg.
//!
//! - [`pools`] (feature `pools`, on by default): pair selection over
//!   worker-lifecycle's role pools and lb-policies' policies, the flow's
//!   backend over real workers and breakers, and the whole-request retry
//!   loop — the one pairing code of the workspace.
//!
//! There is no HTTP client and no async runtime here: the router supplies
//! the transport (hyper), so every ordering, failure and cancellation is
//! tested without sockets.
//!
//! # Example
//!
//! A NIXL request over an in-memory transport: the prefill answers with its
//! `kv_transfer_params`, which the decode leg receives verbatim.
//!
//! ```
//! use std::future::{Ready, ready};
//! use std::sync::{Arc, Mutex};
//! use bytes::Bytes;
//! use http::{HeaderMap, StatusCode};
//! use http_body::Body as _;
//! use pd_orchestrator::{
//!     PdEndpoint, FlowConfig, ForwardHeaders, LegOutcome, LegRequest, LegResponse, Nixl,
//!     PdBackend, PdFlow, PdRequest, Phase, PhaseGuard, Refused, Transport,
//! };
//! use http_body_util::Full;
//! use serde_json::{Value, json};
//!
//! /// Answers prefill with KV params and decode with a completion; keeps
//! /// every leg it sent.
//! #[derive(Default)]
//! struct Memory(Mutex<Vec<LegRequest>>);
//! impl Transport for Memory {
//!     type Body = Full<Bytes>;
//!     type Error = std::convert::Infallible;
//!     type Future = Ready<Result<LegResponse<Full<Bytes>>, Self::Error>>;
//!     fn send(&self, leg: LegRequest) -> Self::Future {
//!         let answer = match leg.phase {
//!             Phase::Prefill => json!({"kv_transfer_params": {"remote_engine_id": "p0",
//!                                      "remote_block_ids": [1, 2]}}),
//!             Phase::Decode => json!({"choices": [{"text": "Paris"}]}),
//!         };
//!         self.0.lock().unwrap().push(leg);
//!         let body = Full::new(Bytes::from(serde_json::to_vec(&answer).unwrap()));
//!         ready(Ok(LegResponse { status: StatusCode::OK, headers: HeaderMap::new(), body }))
//!     }
//! }
//!
//! /// Keeps each leg's outcome; a real router plugs in its worker pools
//! /// here (its guard records to the worker's breaker, then releases).
//! #[derive(Default)]
//! struct Loads(Arc<Mutex<Vec<(Phase, LegOutcome)>>>);
//! struct Lease(Arc<Mutex<Vec<(Phase, LegOutcome)>>>, Phase);
//! impl PhaseGuard for Lease {
//!     fn finish(self, outcome: LegOutcome, _: Option<StatusCode>) {
//!         self.0.lock().unwrap().push((self.1, outcome));
//!     }
//! }
//! impl PdBackend for Loads {
//!     type Worker = Arc<PdEndpoint>;
//!     type Guard = Lease;
//!     fn reserve(&self, _: &Arc<PdEndpoint>, phase: Phase) -> Result<Lease, Refused> {
//!         Ok(Lease(Arc::clone(&self.0), phase))
//!     }
//!     fn reselect_prefill(&self, _: &Arc<PdEndpoint>, _: u32) -> Option<Arc<PdEndpoint>> { None }
//! }
//!
//! // Every future here is ready at once, so polling once drives it.
//! fn now<F: std::future::Future>(f: F) -> F::Output {
//!     let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
//!     match std::pin::pin!(f).poll(&mut cx) {
//!         std::task::Poll::Ready(out) => out,
//!         std::task::Poll::Pending => unreachable!("in-memory futures are ready"),
//!     }
//! }
//!
//! let prefill = Arc::new(PdEndpoint::new("http://10.0.0.1:8000")?);
//! let decode = Arc::new(PdEndpoint::new("http://10.0.0.2:8000")?);
//! let flow = PdFlow::new(Memory::default(), Arc::new(Loads::default()), FlowConfig::default());
//! let request = PdRequest {
//!     path: "/v1/completions".into(),
//!     body: json!({"model": "m", "prompt": "The capital of France is", "max_tokens": 8}),
//!     request_id: "42".into(),
//!     forward: ForwardHeaders::new(),
//! };
//! let mut response = now(flow.run(&Nixl, request, prefill, decode))?;
//! assert_eq!(response.status, StatusCode::OK);
//! let frame = now(std::future::poll_fn(|cx| std::pin::Pin::new(&mut response.body).poll_frame(cx)));
//! let text: Value = serde_json::from_slice(frame.unwrap()?.data_ref().unwrap())?;
//! assert_eq!(text["choices"][0]["text"], "Paris");
//!
//! let legs = flow.transport().0.lock().unwrap();
//! let prefill_body: Value = serde_json::from_slice(&legs[0].body)?;
//! assert_eq!(prefill_body["max_tokens"], 1);
//! assert_eq!(prefill_body["kv_transfer_params"]["do_remote_decode"], true);
//! let decode_body: Value = serde_json::from_slice(&legs[1].body)?;
//! assert_eq!(decode_body["max_tokens"], 8);
//! assert_eq!(decode_body["kv_transfer_params"]["remote_block_ids"], json!([1, 2]));
//! assert_eq!(
//!     legs[1].headers["x-request-id"],
//!     "___prefill_addr_10.0.0.1:8000___decode_addr_10.0.0.2:8000_42"
//! );
//! assert_eq!(
//!     *flow.backend().0.lock().unwrap(),
//!     [(Phase::Prefill, LegOutcome::Success), (Phase::Decode, LegOutcome::Success)]
//! );
//! # Ok::<(), pd_orchestrator::BoxError>(())
//! ```
//!
//! # Cancel safety
//!
//! [`PdFlow::run`] may be dropped at any await point and [`PdBody`] at any
//! time: each reserved phase guard is released exactly once and its outcome
//! recorded as [`LegOutcome::Cancelled`]. See [`PdFlow`] for the
//! guard timelines.
//!
//! # Stability
//!
//! Pre-1.0. Error and outcome enums are `#[non_exhaustive]`.
#![warn(missing_docs)]

pub mod bootstrap;
pub mod connector;
mod endpoint;
mod error;
mod flow;
#[doc(hidden)]
pub mod fuzzing;
pub mod headers;
pub mod merge;
#[cfg(feature = "pools")]
pub mod pools;

pub use connector::{
    DecodeHandoff, KvConnector, LegContext, ModeMismatch, Mooncake, MoriIo, MoriIoMode,
    MoriIoModeGate, Nixl, PdConnector, PhaseOrder, UnknownConnector,
};
pub use endpoint::{DEFAULT_MOONCAKE_BOOTSTRAP_PORT, MooncakeEndpoint, MoriIoEndpoint, PdEndpoint};
pub use error::{ConnectorError, PdError};
pub use flow::{
    BoxError, FlowConfig, FlowStats, FlowStatsSnapshot, Handoff, LegOutcome, LegRequest,
    LegResponse, PdBackend, PdBody, PdFlow, PdRequest, PdResponse, PdWorker, Phase, PhaseGuard,
    Refused, Transport,
};
pub use headers::ForwardHeaders;
pub use worker_lifecycle::{WorkerUrl, WorkerUrlError};
