//! Test doubles: a scripted transport whose every await point can be held
//! back, and a backend with counting guards. No sockets, no runtime: tests
//! poll by hand with a no-op waker.
#![allow(dead_code, unreachable_pub)] // each test binary uses a different subset

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use http_body::{Body, Frame};
use pd_orchestrator::{
    LegOutcome, LegRequest, LegResponse, MooncakeEndpoint, MoriIoEndpoint, PdBackend, PdBody,
    PdEndpoint, Phase, PhaseGuard, Refused, Transport,
};
use serde_json::Value;

/// A shared, ordered event log.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    pub fn push(&self, event: impl Into<String>) {
        self.0.lock().unwrap().push(event.into());
    }
    pub fn events(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    /// Position of the first event equal to `event`.
    pub fn at(&self, event: &str) -> usize {
        let events = self.events();
        events
            .iter()
            .position(|e| e == event)
            .unwrap_or_else(|| panic!("no event {event:?} in {events:#?}"))
    }
}

/// A pool of permits: a gated await point completes only by taking one.
/// `None` gates never wait.
#[derive(Default)]
pub struct Permits(AtomicUsize);

impl Permits {
    pub fn new(n: usize) -> Arc<Self> {
        Arc::new(Self(AtomicUsize::new(n)))
    }
    pub fn add(&self, n: usize) {
        self.0.fetch_add(n, Ordering::SeqCst);
    }
    pub fn left(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
    fn take(&self) -> bool {
        self.0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

fn pass(gate: &Option<Arc<Permits>>) -> bool {
    gate.as_ref().is_none_or(|g| g.take())
}

/// What one leg answers.
#[derive(Clone)]
pub struct Step {
    pub outcome: Result<(StatusCode, Vec<Result<Bytes, String>>), String>,
    pub gate: Option<Arc<Permits>>,
}

impl Step {
    pub fn json(value: Value) -> Self {
        Self::status(StatusCode::OK, &value.to_string())
    }
    pub fn status(status: StatusCode, body: &str) -> Self {
        Self {
            outcome: Ok((status, vec![Ok(Bytes::from(body.to_owned()))])),
            gate: None,
        }
    }
    pub fn chunks(chunks: &[&str]) -> Self {
        Self {
            outcome: Ok((
                StatusCode::OK,
                chunks
                    .iter()
                    .map(|c| Ok(Bytes::from((*c).to_owned())))
                    .collect(),
            )),
            gate: None,
        }
    }
    pub fn body_error_after(chunks: &[&str]) -> Self {
        let mut step = Self::chunks(chunks);
        if let Ok((_, body)) = &mut step.outcome {
            body.push(Err("connection reset".to_owned()));
        }
        step
    }
    pub fn transport_error(reason: &str) -> Self {
        Self {
            outcome: Err(reason.to_owned()),
            gate: None,
        }
    }
    /// A leg the transport itself could not send (its caller's failure).
    pub fn local_error(reason: &str) -> Self {
        Self::transport_error(&format!("{LOCAL}{reason}"))
    }
    pub fn gated(mut self, gate: &Arc<Permits>) -> Self {
        self.gate = Some(Arc::clone(gate));
        self
    }
}

#[derive(Default)]
struct Script {
    steps: HashMap<Phase, VecDeque<Step>>,
    sent: Vec<LegRequest>,
}

/// Answers each leg with the next scripted [`Step`] of its phase.
#[derive(Clone, Default)]
pub struct ScriptedTransport {
    script: Arc<Mutex<Script>>,
    pub log: Log,
}

impl ScriptedTransport {
    pub fn new(log: &Log) -> Self {
        Self {
            script: Arc::default(),
            log: log.clone(),
        }
    }
    pub fn push(&self, phase: Phase, step: Step) -> &Self {
        self.script
            .lock()
            .unwrap()
            .steps
            .entry(phase)
            .or_default()
            .push_back(step);
        self
    }
    pub fn sent(&self) -> Vec<LegRequest> {
        self.script.lock().unwrap().sent.clone()
    }
    pub fn sent_body(&self, index: usize) -> Value {
        serde_json::from_slice(&self.sent()[index].body).unwrap()
    }
}

/// The prefix marking a scripted error as the transport's own.
const LOCAL: &str = "local: ";

#[derive(Debug)]
pub struct ScriptError(pub String);

impl std::error::Error for ScriptError {}

impl std::fmt::Display for ScriptError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Transport for ScriptedTransport {
    type Body = ScriptBody;
    type Error = ScriptError;
    type Future = ScriptedSend;

    fn is_local_error(error: &ScriptError) -> bool {
        error.0.starts_with(LOCAL)
    }

    fn send(&self, leg: LegRequest) -> ScriptedSend {
        let phase = leg.phase;
        self.log.push(format!("send {phase}"));
        let mut script = self.script.lock().unwrap();
        script.sent.push(leg);
        let step = script
            .steps
            .get_mut(&phase)
            .and_then(VecDeque::pop_front)
            .unwrap_or_else(|| panic!("no scripted {phase} step left"));
        ScriptedSend {
            phase,
            gate: step.gate.clone(),
            step: Some(step),
            log: self.log.clone(),
        }
    }
}

pub struct ScriptedSend {
    phase: Phase,
    step: Option<Step>,
    gate: Option<Arc<Permits>>,
    log: Log,
}

impl Future for ScriptedSend {
    type Output = Result<LegResponse<ScriptBody>, ScriptError>;

    fn poll(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if this.step.is_none() {
            panic!("ScriptedSend polled after completion");
        }
        if !pass(&this.gate) {
            return Poll::Pending;
        }
        let step = this.step.take().unwrap();
        let phase = this.phase;
        Poll::Ready(match step.outcome {
            Err(reason) => {
                this.log.push(format!("error {phase}"));
                Err(ScriptError(reason))
            }
            Ok((status, chunks)) => {
                this.log.push(format!("head {phase} {}", status.as_u16()));
                Ok(LegResponse {
                    status,
                    headers: HeaderMap::new(),
                    body: ScriptBody {
                        phase,
                        chunks: chunks.into(),
                        gate: step.gate,
                        log: this.log.clone(),
                        done: false,
                    },
                })
            }
        })
    }
}

impl Drop for ScriptedSend {
    fn drop(&mut self) {
        if self.step.is_some() {
            self.log.push(format!("abort {}", self.phase));
        }
    }
}

/// A scripted body; each chunk and the end of stream pass its gate.
pub struct ScriptBody {
    phase: Phase,
    chunks: VecDeque<Result<Bytes, String>>,
    gate: Option<Arc<Permits>>,
    log: Log,
    done: bool,
}

impl Body for ScriptBody {
    type Data = Bytes;
    type Error = ScriptError;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ScriptError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if !pass(&this.gate) {
            return Poll::Pending;
        }
        match this.chunks.pop_front() {
            Some(Ok(chunk)) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
            Some(Err(reason)) => {
                this.done = true;
                this.log.push(format!("body-error {}", this.phase));
                Poll::Ready(Some(Err(ScriptError(reason))))
            }
            None => {
                this.done = true;
                this.log.push(format!("eof {}", this.phase));
                Poll::Ready(None)
            }
        }
    }
}

impl Drop for ScriptBody {
    fn drop(&mut self) {
        if !self.done {
            self.log.push(format!("body-drop {}", self.phase));
        }
    }
}

#[derive(Default)]
struct Counters {
    live: Mutex<HashMap<(String, Phase), i64>>,
    reserved: AtomicUsize,
    released: AtomicUsize,
    negative: AtomicI64,
}

/// Counting guards, outcome records and a queue of spare prefill workers.
/// What the guards recorded when they finished.
#[derive(Default)]
pub struct Recorded {
    outcomes: Mutex<Vec<(String, Phase, LegOutcome)>>,
    statuses: Mutex<Vec<(Phase, Option<u16>)>>,
}

#[derive(Default)]
pub struct TestBackend {
    counters: Arc<Counters>,
    recorded: Arc<Recorded>,
    spare_prefills: Mutex<VecDeque<Arc<PdEndpoint>>>,
    late_decodes: Mutex<VecDeque<Arc<PdEndpoint>>>,
    pub log: Log,
}

pub struct TestGuard {
    key: (String, Phase),
    counters: Arc<Counters>,
    log: Log,
    recorded: Arc<Recorded>,
}

impl PhaseGuard for TestGuard {
    /// Logs the release, then the outcome: the order the router's breaker
    /// bookkeeping cannot observe, kept so the logs read as before.
    fn finish(self, outcome: LegOutcome, status: Option<StatusCode>) {
        let (worker, phase) = self.key.clone();
        let (log, recorded) = (self.log.clone(), Arc::clone(&self.recorded));
        drop(self);
        log.push(format!("outcome {phase} {outcome:?}"));
        recorded
            .outcomes
            .lock()
            .unwrap()
            .push((worker, phase, outcome));
        recorded
            .statuses
            .lock()
            .unwrap()
            .push((phase, status.map(|s| s.as_u16())));
    }
}

impl Drop for TestGuard {
    fn drop(&mut self) {
        let mut live = self.counters.live.lock().unwrap();
        let count = live
            .get_mut(&self.key)
            .expect("released a guard never reserved");
        *count -= 1;
        if *count < 0 {
            self.counters.negative.fetch_add(1, Ordering::SeqCst);
        }
        self.counters.released.fetch_add(1, Ordering::SeqCst);
        self.log
            .push(format!("release {} {}", self.key.1, self.key.0));
    }
}

impl TestBackend {
    pub fn new(log: &Log) -> Arc<Self> {
        Arc::new(Self {
            log: log.clone(),
            ..Self::default()
        })
    }
    pub fn with_spares(log: &Log, spares: Vec<Arc<PdEndpoint>>) -> Arc<Self> {
        Arc::new(Self {
            log: log.clone(),
            spare_prefills: Mutex::new(spares.into()),
            ..Self::default()
        })
    }
    /// Queues decode workers that `select_decode` hands out, in order
    /// (none queued: no decode worker is available).
    pub fn offer_decodes(&self, decodes: Vec<Arc<PdEndpoint>>) {
        self.late_decodes.lock().unwrap().extend(decodes);
    }
    pub fn live(&self, worker: &PdEndpoint, phase: Phase) -> i64 {
        let key = (worker.base_url().to_owned(), phase);
        *self.counters.live.lock().unwrap().get(&key).unwrap_or(&0)
    }
    pub fn reserved(&self) -> usize {
        self.counters.reserved.load(Ordering::SeqCst)
    }
    pub fn outcomes(&self) -> Vec<(String, Phase, LegOutcome)> {
        self.recorded.outcomes.lock().unwrap().clone()
    }
    /// The response status each recorded leg saw, in record order.
    pub fn statuses(&self) -> Vec<(Phase, Option<u16>)> {
        self.recorded.statuses.lock().unwrap().clone()
    }
    pub fn outcome_kinds(&self) -> Vec<(Phase, LegOutcome)> {
        self.outcomes()
            .into_iter()
            .map(|(_, p, o)| (p, o))
            .collect()
    }
    /// Every reserved guard was released exactly once, no count went below
    /// zero, and exactly one outcome was recorded per reservation.
    pub fn assert_balanced(&self) {
        let reserved = self.reserved();
        assert_eq!(
            reserved,
            self.counters.released.load(Ordering::SeqCst),
            "reserve/release mismatch"
        );
        assert_eq!(
            self.counters.negative.load(Ordering::SeqCst),
            0,
            "a count went below zero"
        );
        assert!(
            self.counters.live.lock().unwrap().values().all(|&n| n == 0),
            "load left behind"
        );
        assert_eq!(
            self.outcomes().len(),
            reserved,
            "one outcome per reserved leg"
        );
    }
}

impl PdBackend for TestBackend {
    type Worker = Arc<PdEndpoint>;
    type Guard = TestGuard;

    fn reserve(&self, worker: &Arc<PdEndpoint>, phase: Phase) -> Result<TestGuard, Refused> {
        let key = (worker.base_url().to_owned(), phase);
        *self
            .counters
            .live
            .lock()
            .unwrap()
            .entry(key.clone())
            .or_default() += 1;
        self.counters.reserved.fetch_add(1, Ordering::SeqCst);
        self.log.push(format!("reserve {phase} {}", key.0));
        Ok(TestGuard {
            key,
            counters: Arc::clone(&self.counters),
            log: self.log.clone(),
            recorded: Arc::clone(&self.recorded),
        })
    }

    fn reselect_prefill(
        &self,
        _failed: &Arc<PdEndpoint>,
        _attempt: u32,
    ) -> Option<Arc<PdEndpoint>> {
        self.spare_prefills.lock().unwrap().pop_front()
    }

    fn select_decode(&self, _prefill: &Arc<PdEndpoint>) -> Option<Arc<PdEndpoint>> {
        let chosen = self.late_decodes.lock().unwrap().pop_front();
        match &chosen {
            Some(decode) => self
                .log
                .push(format!("select decode {}", decode.base_url())),
            None => self.log.push("select decode none"),
        }
        chosen
    }
}

/// Polls `future` up to `polls` times with a no-op waker.
pub fn poll_n<F: Future>(future: Pin<&mut F>, polls: usize) -> Poll<F::Output> {
    let mut future = future;
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..polls {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return Poll::Ready(out);
        }
    }
    Poll::Pending
}

/// Runs a future that must complete without waiting on any gate.
pub fn ready<F: Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    match poll_n(future.as_mut(), 64) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("future did not complete"),
    }
}

/// What one poll of a body yields.
pub type FramePoll<B> = Poll<Option<Result<Frame<<B as Body>::Data>, <B as Body>::Error>>>;

/// One frame poll of a body.
pub fn poll_frame<B: Body + Unpin>(body: &mut B) -> FramePoll<B> {
    let mut cx = Context::from_waker(Waker::noop());
    Pin::new(body).poll_frame(&mut cx)
}

/// Reads a body to its end (every gate open), returning the data.
pub fn read_all(body: &mut PdBody<ScriptBody, TestBackend>) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    for _ in 0..1000 {
        match poll_frame(body) {
            Poll::Ready(Some(Ok(frame))) => {
                out.extend_from_slice(&frame.into_data().unwrap_or_default())
            }
            Poll::Ready(Some(Err(error))) => return Err(error.to_string()),
            Poll::Ready(None) => return Ok(out),
            Poll::Pending => {}
        }
    }
    panic!("body did not end")
}

pub fn endpoint(url: &str) -> Arc<PdEndpoint> {
    Arc::new(PdEndpoint::new(url).unwrap())
}

pub fn mooncake_prefill(url: &str, rank: Option<u32>) -> Arc<PdEndpoint> {
    let mut endpoint = PdEndpoint::new(url).unwrap();
    let bootstrap_addr = endpoint.mooncake_bootstrap_addr(None);
    endpoint = endpoint.with_mooncake(MooncakeEndpoint {
        bootstrap_addr,
        engine_ids: [(0, "engine-p-0".to_owned()), (1, "engine-p-1".to_owned())]
            .into_iter()
            .collect(),
    });
    if let Some(rank) = rank {
        endpoint = endpoint.with_dp_rank(rank);
    }
    Arc::new(endpoint)
}

pub fn moriio(
    url: &str,
    handshake: u16,
    notify: u16,
    dp_size: u32,
    rank: Option<u32>,
) -> Arc<PdEndpoint> {
    let mut endpoint = PdEndpoint::new(url).unwrap().with_moriio(MoriIoEndpoint {
        handshake_port: handshake,
        notify_port: notify,
        dp_size,
        tp_size: 2,
    });
    if let Some(rank) = rank {
        endpoint = endpoint.with_dp_rank(rank);
    }
    Arc::new(endpoint)
}
