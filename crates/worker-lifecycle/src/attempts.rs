//! The one attempt loop of a request: [`run_attempts`] drives any
//! [`Attempts`] (the router's regular requests, a whole P/D request, a P/D
//! request's prefill re-selection) through attempt, retry decision, wait,
//! next attempt.
//!
//! # Why one loop
//!
//! Every retry the router makes answers the same questions in the same
//! order: did this attempt answer the request; if not, may another attempt
//! follow, and after how long; what does the failed attempt still hold that
//! must be released before the wait; what does the next attempt need from
//! the last one. Written three times, the answers drifted (one loop released
//! the failed worker's guard after the backoff, one reported the last
//! selection error instead of the failure that caused the retry). Here the
//! loop is written once and each caller supplies only the answers, as the
//! four methods of [`Attempts`]:
//!
//! - [`Attempts::attempt`] runs attempt `n` and says whether it answered the
//!   request ([`Attempted::Done`]) or failed in a way another attempt may fix
//!   ([`Attempted::Failed`]);
//! - [`Attempts::retry`] takes the failure by value and either grants the
//!   next attempt (the wait before it, and what it carries over) or turns the
//!   failure into the request's answer. Whatever the failure held (a worker's
//!   load guard, an unread response body, a trace span) is released here,
//!   before the wait, unless it becomes the answer;
//! - [`Attempts::wait`] sleeps; a wait can end the request (a deadline
//!   reached while backing off);
//! - the carry-over ([`Attempts::Carry`]) is what one attempt hands the next:
//!   the prefill worker chosen to replace a failed one, the failure a retry
//!   should report if it finds no worker at all.
//!
//! How many retries a request gets is not decided here: callers grant them
//! through a [`RequestRetries`](crate::RequestRetries) (the router's policy
//! and its shared retry budget) or a fixed count.

use std::future::Future;
use std::time::Duration;

/// How one attempt of a request ended.
#[derive(Debug)]
pub enum Attempted<A, F> {
    /// The request has its answer (which may be an error no other attempt
    /// would change).
    Done(A),
    /// The attempt failed in a way another attempt may fix; [`Attempts::retry`]
    /// decides.
    Failed(F),
}

/// One request's attempts, as [`run_attempts`] drives them: the loop is
/// written once, and an implementation supplies only the attempt, the retry
/// decision (which also releases what a failed attempt holds, before the
/// wait) and the wait. The router's regular requests, its whole P/D
/// requests and the P/D prefill re-selection are three implementations.
pub trait Attempts {
    /// The request's answer.
    type Answer;
    /// A failure another attempt may fix, with what the failed attempt still
    /// holds.
    type Failure;
    /// What an attempt hands the next one.
    type Carry;

    /// Runs attempt `n` (0 for the first) with what the previous attempt
    /// carried over (the first gets [`run_attempts`]'s `first`).
    fn attempt(
        &mut self,
        n: u32,
        carry: Self::Carry,
    ) -> impl Future<Output = Attempted<Self::Answer, Self::Failure>>;

    /// After attempt `n` failed with `failure`: `Ok((wait, carry))` grants
    /// attempt `n + 1` after `wait`; `Err(answer)` ends the request.
    ///
    /// # Errors
    /// The request's answer when no further attempt is granted.
    fn retry(
        &mut self,
        n: u32,
        failure: Self::Failure,
    ) -> Result<(Duration, Self::Carry), Self::Answer>;

    /// Waits `wait` before the next attempt; `Err(answer)` ends the request
    /// instead (a zero wait should return at once).
    fn wait(&mut self, wait: Duration) -> impl Future<Output = Result<(), Self::Answer>>;
}

/// Runs `attempts` until one answers the request, a failure is not granted
/// a retry, or a wait ends the request; returns that answer.
///
/// ```
/// use std::time::Duration;
/// use worker_lifecycle::{Attempted, Attempts, run_attempts};
///
/// // Try workers "a", "b", "c" in turn; a worker fails when it is "a".
/// struct Failover { tried: Vec<&'static str> }
///
/// impl Attempts for Failover {
///     type Answer = Result<&'static str, String>;
///     type Failure = String;
///     type Carry = &'static str;
///
///     async fn attempt(&mut self, _n: u32, worker: &'static str) -> Attempted<Self::Answer, String> {
///         self.tried.push(worker);
///         if worker == "a" {
///             Attempted::Failed(format!("{worker} refused"))
///         } else {
///             Attempted::Done(Ok(worker))
///         }
///     }
///
///     fn retry(&mut self, n: u32, failure: String) -> Result<(Duration, &'static str), Self::Answer> {
///         match ["b", "c"].get(n as usize) {
///             Some(next) => Ok((Duration::ZERO, *next)),
///             None => Err(Err(failure)),
///         }
///     }
///
///     async fn wait(&mut self, _wait: Duration) -> Result<(), Self::Answer> {
///         Ok(())
///     }
/// }
///
/// let mut failover = Failover { tried: Vec::new() };
/// let answer = block_on(run_attempts(&mut failover, "a"));
/// assert_eq!(answer, Ok("b"));
/// assert_eq!(failover.tried, ["a", "b"]);
/// # fn block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
/// # }
/// ```
pub async fn run_attempts<A: Attempts>(attempts: &mut A, first: A::Carry) -> A::Answer {
    let mut carry = first;
    let mut n = 0u32;
    loop {
        let failure = match attempts.attempt(n, carry).await {
            Attempted::Done(answer) => return answer,
            Attempted::Failed(failure) => failure,
        };
        let (wait, next) = match attempts.retry(n, failure) {
            Ok(granted) => granted,
            Err(answer) => return answer,
        };
        if let Err(answer) = attempts.wait(wait).await {
            return answer;
        }
        carry = next;
        n = n.saturating_add(1);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A scripted request: attempt `n` fails while `n < fail_first`; retries
    /// are granted while `grants` lasts; a wait fails once `wait_fails`.
    #[derive(Default)]
    struct Script {
        fail_first: u32,
        grants: u32,
        wait_fails: bool,
        log: Vec<String>,
    }

    impl Attempts for Script {
        type Answer = Result<u32, String>;
        type Failure = u32;
        type Carry = u32;

        async fn attempt(&mut self, n: u32, carry: u32) -> Attempted<Self::Answer, u32> {
            self.log.push(format!("attempt {n} carrying {carry}"));
            if n < self.fail_first {
                Attempted::Failed(n)
            } else {
                Attempted::Done(Ok(n))
            }
        }

        fn retry(&mut self, n: u32, failure: u32) -> Result<(Duration, u32), Self::Answer> {
            self.log.push(format!("retry after {n}"));
            if self.grants == 0 {
                return Err(Err(format!("gave up after attempt {failure}")));
            }
            self.grants -= 1;
            Ok((Duration::from_millis(u64::from(n) + 1), failure * 10 + 7))
        }

        async fn wait(&mut self, wait: Duration) -> Result<(), Self::Answer> {
            self.log.push(format!("wait {}ms", wait.as_millis()));
            if self.wait_fails {
                Err(Err("deadline".to_owned()))
            } else {
                Ok(())
            }
        }
    }

    fn run(script: &mut Script) -> Result<u32, String> {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(run_attempts(script, 1))
    }

    #[test]
    fn a_first_answer_ends_the_request_without_a_retry_decision() {
        let mut script = Script::default();
        assert_eq!(run(&mut script), Ok(0));
        assert_eq!(script.log, ["attempt 0 carrying 1"]);
    }

    #[test]
    fn each_retry_waits_then_hands_its_carry_to_the_next_attempt() {
        let mut script = Script {
            fail_first: 2,
            grants: 5,
            ..Script::default()
        };
        assert_eq!(run(&mut script), Ok(2));
        assert_eq!(
            script.log,
            [
                "attempt 0 carrying 1",
                "retry after 0",
                "wait 1ms",
                "attempt 1 carrying 7",
                "retry after 1",
                "wait 2ms",
                "attempt 2 carrying 17",
            ]
        );
    }

    #[test]
    fn a_refused_retry_answers_with_what_retry_made_of_the_failure() {
        let mut script = Script {
            fail_first: 9,
            grants: 1,
            ..Script::default()
        };
        assert_eq!(run(&mut script), Err("gave up after attempt 1".to_owned()));
        assert_eq!(script.log.len(), 5, "{:?}", script.log);
    }

    #[test]
    fn a_wait_that_ends_the_request_is_its_answer() {
        let mut script = Script {
            fail_first: 9,
            grants: 9,
            wait_fails: true,
            ..Script::default()
        };
        assert_eq!(run(&mut script), Err("deadline".to_owned()));
        assert_eq!(
            script.log,
            ["attempt 0 carrying 1", "retry after 0", "wait 1ms"]
        );
    }
}
