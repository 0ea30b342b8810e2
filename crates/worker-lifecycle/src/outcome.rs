//! What happened to a request, from the worker's point of view.
//!
//! Only failures that say something about the worker's health trip a
//! circuit breaker. A client's bad request, a client hanging up, or the
//! router refusing work because it is itself overloaded say nothing about
//! the worker and are never counted against it.

/// The result of one request to a worker, as the breaker sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The worker answered with a success status (1xx, 2xx or 3xx).
    Success,
    /// The worker answered with a server error status (5xx) or a status
    /// outside the valid range 100..=599.
    ServerError(u16),
    /// The connection to the worker could not be established.
    ConnectError,
    /// The worker did not answer in time.
    Timeout,
    /// The connection was reset or closed mid-request by the worker side.
    ConnectionReset,
    /// The worker answered with a client error status (4xx): the request was
    /// at fault, not the worker.
    ClientError(u16),
    /// The client went away before the request finished.
    ClientCancelled,
    /// The router rejected or dropped the request itself (its own overload,
    /// queue limit or shutdown) without the worker failing.
    RouterRejected,
}

/// How an [`Outcome`] counts for a circuit breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutcomeClass {
    /// Evidence the worker is serving.
    Success,
    /// Evidence the worker is failing.
    WorkerFailure,
    /// No evidence either way: never counted.
    Neutral,
}

impl Outcome {
    /// Classifies an HTTP status code returned by the worker.
    pub fn from_status(status: u16) -> Self {
        match status {
            100..=399 => Self::Success,
            400..=499 => Self::ClientError(status),
            _ => Self::ServerError(status),
        }
    }

    /// How this outcome counts for a breaker.
    pub fn class(self) -> OutcomeClass {
        match self {
            Self::Success => OutcomeClass::Success,
            Self::ServerError(_) | Self::ConnectError | Self::Timeout | Self::ConnectionReset => {
                OutcomeClass::WorkerFailure
            }
            Self::ClientError(_) | Self::ClientCancelled | Self::RouterRejected => {
                OutcomeClass::Neutral
            }
        }
    }

    /// Whether this outcome counts as a failure of the worker.
    pub fn is_worker_failure(self) -> bool {
        self.class() == OutcomeClass::WorkerFailure
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_classify_as_documented() {
        assert_eq!(Outcome::from_status(200).class(), OutcomeClass::Success);
        assert_eq!(Outcome::from_status(302).class(), OutcomeClass::Success);
        for s in [400, 404, 408, 429, 499] {
            assert_eq!(
                Outcome::from_status(s).class(),
                OutcomeClass::Neutral,
                "{s}"
            );
        }
        for s in [500, 502, 503, 504, 599, 0, 99, 600, 1000] {
            assert!(Outcome::from_status(s).is_worker_failure(), "{s}");
        }
        assert!(Outcome::ConnectError.is_worker_failure());
        assert!(Outcome::Timeout.is_worker_failure());
        assert!(Outcome::ConnectionReset.is_worker_failure());
        assert_eq!(Outcome::ClientCancelled.class(), OutcomeClass::Neutral);
        assert_eq!(Outcome::RouterRejected.class(), OutcomeClass::Neutral);
    }
}
