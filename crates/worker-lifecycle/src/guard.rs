//! Load counted by ownership.
//!
//! [`Worker::reserve`](crate::Worker::reserve) adds one to the worker's load
//! and returns a [`LoadGuard`]. The load comes down exactly once, when the
//! reservation ends:
//!
//! - [`LoadGuard::release`] ends it explicitly ("the work is finished"); it
//!   is idempotent, and after it every handle of the reservation is inert;
//! - otherwise it ends when the **last** handle is dropped — the request
//!   future was cancelled, the task aborted, the response body dropped
//!   half-way, an error returned early.
//!
//! [`LoadGuard::share`] makes a second handle to the same reservation (for
//! example one in the response body, one in a task that forwards it): the
//! load stays counted while either holds it and comes down once.
//!
//! The guard is `'static` and `Send`, so it moves into spawned tasks and
//! streaming bodies. Ending a reservation also counts one processed request
//! on the worker, whatever the outcome.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use crate::breaker::Admission;
use crate::outcome::Outcome;
use crate::sync::{Arc as SyncArc, AtomicBool, AtomicU64, Ordering};

/// `probe_epoch` value meaning "no probe slot held".
const NO_PROBE: u64 = u64::MAX;
use crate::worker::Worker;

struct Reservation {
    worker: Arc<Worker>,
    released: AtomicBool,
    // The epoch of the breaker's half-open probe slot this reservation holds,
    // or NO_PROBE; taken once by the first outcome, or handed back when the
    // reservation ends. An atomic, not a lock: the common case is NO_PROBE.
    probe_epoch: AtomicU64,
}

impl Reservation {
    fn release(&self) -> bool {
        if self
            .released
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        self.worker.release_one();
        true
    }
}

impl Reservation {
    fn take_probe(&self) -> Admission {
        if self.probe_epoch.load(Ordering::Acquire) == NO_PROBE {
            return Admission::unprobed();
        }
        Admission::from_probe_epoch(self.probe_epoch.swap(NO_PROBE, Ordering::AcqRel))
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.release();
        let admission = self.take_probe();
        if admission.is_probe() {
            self.worker.breaker().abandon(admission);
        }
    }
}

/// One reserved request on a worker. Dropping the last handle, or calling
/// [`release`](Self::release) on any handle, ends the reservation (load − 1,
/// processed + 1) exactly once.
#[must_use = "dropping a LoadGuard releases the reservation at once"]
pub struct LoadGuard {
    reservation: SyncArc<Reservation>,
}

impl fmt::Debug for LoadGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadGuard")
            .field("worker", &self.reservation.worker.key())
            .field("released", &self.is_released())
            .finish()
    }
}

impl LoadGuard {
    pub(crate) fn new(worker: Arc<Worker>, admission: Admission) -> Self {
        let probe_epoch = admission.into_probe_epoch().unwrap_or(NO_PROBE);
        Self {
            reservation: SyncArc::new(Reservation {
                worker,
                released: AtomicBool::new(false),
                probe_epoch: AtomicU64::new(probe_epoch),
            }),
        }
    }

    /// The worker this reservation is on.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.reservation.worker
    }

    /// A second handle to the same reservation. The load stays counted until
    /// every handle is dropped or one of them calls [`release`](Self::release);
    /// it comes down once either way.
    pub fn share(&self) -> LoadGuard {
        LoadGuard {
            reservation: self.reservation.clone(),
        }
    }

    /// Ends the reservation now. Returns true if this call ended it, false
    /// if it had already ended (through any handle). Idempotent.
    pub fn release(&self) -> bool {
        self.reservation.release()
    }

    /// An identity of the reservation shared by all its handles.
    #[doc(hidden)]
    pub fn reservation_id(&self) -> *const () {
        SyncArc::as_ptr(&self.reservation).cast()
    }

    /// Whether the reservation has ended.
    pub fn is_released(&self) -> bool {
        self.reservation.released.load(Ordering::Acquire)
    }

    /// Whether this reservation holds one of the breaker's half-open probe
    /// slots that has not been recorded yet.
    pub fn is_probe(&self) -> bool {
        self.reservation.probe_epoch.load(Ordering::Acquire) != NO_PROBE
    }

    /// Tells the worker's circuit breaker how the request went, at the
    /// worker's clock's now. Only the first outcome of a reservation for a
    /// probe counts as the probe's result; outcomes of ordinary requests are
    /// all counted. Does not end the reservation (a streamed body may still
    /// be running).
    pub fn record_outcome(&self, outcome: Outcome) {
        self.record_outcome_at(outcome, self.reservation.worker.clock().now());
    }

    /// [`record_outcome`](Self::record_outcome) at an explicit time.
    pub fn record_outcome_at(&self, outcome: Outcome, now: Instant) {
        let admission = self.reservation.take_probe();
        self.reservation
            .worker
            .breaker()
            .record(admission, outcome, now);
    }
}
