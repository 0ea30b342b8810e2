//! What one request routes by, and the workers chosen for it.

use std::sync::Arc;

use lb_policies::OwnedContext;
use parking_lot::{Mutex, MutexGuard};
use worker_lifecycle::{RoleKind, Worker};

use crate::endpoint::PdEndpoint;
use crate::flow::PdWorker;

/// What one request routes by, shared by its selections (the first pair,
/// a prefill retry, a late decode choice, a retry of the whole request),
/// and the workers that already failed it, which those selections leave
/// out.
#[derive(Debug)]
pub struct PdScope {
    request: OwnedContext,
    failed_prefill: Mutex<Vec<Box<str>>>,
    failed_decode: Mutex<Vec<Box<str>>>,
    late_decode: Mutex<Option<PdDecision>>,
}

impl PdScope {
    /// The scope of `request`.
    pub fn new(request: OwnedContext) -> Self {
        Self {
            request,
            failed_prefill: Mutex::default(),
            failed_decode: Mutex::default(),
            late_decode: Mutex::default(),
        }
    }

    /// How the decode policy chose the latest decode worker chosen late
    /// for this request ([`PdPools::late_decode`](super::PdPools::late_decode)):
    /// set right before that worker's decode leg is dispatched, so a
    /// caller that sees the leg (a trace's leg span) can say why it went
    /// there. `None` before any such choice, and always when the pools
    /// choose the pair at once ([`PdTarget::decision`] has it then).
    pub fn late_decode(&self) -> Option<PdDecision> {
        *self.late_decode.lock()
    }

    pub(super) fn set_late_decode(&self, decision: PdDecision) {
        *self.late_decode.lock() = Some(decision);
    }

    /// What the policies see.
    pub fn request(&self) -> &OwnedContext {
        &self.request
    }

    /// Leaves the worker with key `worker` (see [`PdWorker::id`]) out of
    /// this request's later selections of `role`.
    pub fn exclude(&self, role: RoleKind, worker: &str) {
        let mut failed = self.failed(role).lock();
        if !failed.iter().any(|key| &**key == worker) {
            failed.push(worker.into());
        }
    }

    /// Whether the worker with key `worker` failed this request in `role`.
    pub fn is_excluded(&self, role: RoleKind, worker: &str) -> bool {
        self.failed(role).lock().iter().any(|key| &**key == worker)
    }

    /// The keys of the workers that failed this request in `role`, locked
    /// once for a pass over a whole pool.
    pub(super) fn failed_keys(&self, role: RoleKind) -> MutexGuard<'_, Vec<Box<str>>> {
        self.failed(role).lock()
    }

    fn failed(&self, role: RoleKind) -> &Mutex<Vec<Box<str>>> {
        match role {
            RoleKind::Prefill => &self.failed_prefill,
            _ => &self.failed_decode,
        }
    }
}

/// A selected worker of one role, as the flow addresses it. Cheap to clone;
/// holds no load: the flow reserves it when it dispatches the leg
/// ([`PdBackend::reserve`](crate::PdBackend::reserve)).
#[derive(Clone)]
pub struct PdTarget {
    worker: Arc<Worker>,
    endpoint: Arc<PdEndpoint>,
    scope: Arc<PdScope>,
    decision: PdDecision,
}

/// How a role's policy chose a [`PdTarget`]: what a caller reports of the
/// choice (a trace's decision span, a log line) without asking again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PdDecision {
    /// Why the policy chose this worker.
    pub reason: lb_policies::DecisionReason,
    /// For prefix-matching policies, the request's best prefix match in
    /// thousandths of its input.
    pub match_permille: Option<u16>,
    /// For prefix-matching policies, that match's length in the request's
    /// units (token ids or characters).
    pub matched: Option<usize>,
    /// How many workers of the role the policy chose among: the role's
    /// eligible workers (those that failed the request left out, unless
    /// that left none).
    pub candidates: usize,
}

impl std::fmt::Debug for PdTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PdTarget")
            .field("worker", &self.worker.key())
            .finish_non_exhaustive()
    }
}

impl PdTarget {
    pub(super) fn new(
        worker: Arc<Worker>,
        endpoint: Arc<PdEndpoint>,
        scope: &Arc<PdScope>,
        decision: PdDecision,
    ) -> Self {
        Self {
            worker,
            endpoint,
            scope: Arc::clone(scope),
            decision,
        }
    }

    /// How the role's policy chose this worker.
    pub fn decision(&self) -> &PdDecision {
        &self.decision
    }

    /// The worker.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }

    /// The request it was chosen for.
    pub fn scope(&self) -> &Arc<PdScope> {
        &self.scope
    }
}

impl PdWorker for PdTarget {
    fn endpoint(&self) -> &PdEndpoint {
        &self.endpoint
    }

    /// The worker key: unique per registration lifetime.
    fn id(&self) -> &str {
        self.worker.key()
    }
}

/// A chosen (prefill, decode) pair.
#[derive(Debug, Clone)]
pub struct PdPair {
    /// The prefill worker.
    pub prefill: PdTarget,
    /// The decode worker.
    pub decode: PdTarget,
}
