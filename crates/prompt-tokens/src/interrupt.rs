//! [`Interrupt`]: a cooperative stop for one request's rendering and
//! tokenization.
//!
//! A host that computes token ids off its async runtime (a blocking pool)
//! needs two things the plain methods cannot give: to stop the work when
//! nobody waits for it any more (the client went away, its deadline
//! passed), and to bound how much work one request may cost. Both are
//! checked at *checkpoints*, never preemptively: after the request's
//! messages are prepared, after the direct renderer (before minijinja
//! renders a rendering it declined), after the rendering (its size
//! against [`Interrupt::with_max_text_bytes`]), and before each segment
//! the segment cache misses (a segment it hits costs a lookup, not work).
//!
//! The unit of work between two checkpoints is one segment (the text
//! between two added tokens) or one whole-text tokenizer call; a host
//! bounds it with the text-size budget, which is checked before any
//! tokenizing starts.
//!
//! A checkpoint costs one relaxed atomic load, plus a clock read when a
//! time limit is set, so the warm path (a handful of misses) does not
//! notice it; the plain methods ([`PromptTokenizer::chat_tokens`](crate::PromptTokenizer::chat_tokens))
//! pass no interrupt and check nothing.
//!
//! ```
//! use prompt_tokens::{ChatRequest, Error, Interrupt, PromptTokenizer};
//!
//! let tokenizer = PromptTokenizer::synthetic(4);
//! let request = ChatRequest::from_json(
//!     br#"{"messages": [{"role": "user", "content": "Hello there"}]}"#,
//! )?;
//! let interrupt = Interrupt::new().with_max_text_bytes(8);
//! // The rendering is longer than 8 bytes: nothing is tokenized.
//! assert!(matches!(
//!     tokenizer.chat_tokens_until(&request, &interrupt),
//!     Err(Error::OverBudget(_))
//! ));
//! // Cancelled (from another thread, typically): the next checkpoint stops.
//! let interrupt = Interrupt::new();
//! interrupt.cancel();
//! assert!(matches!(
//!     tokenizer.chat_tokens_until(&request, &interrupt),
//!     Err(Error::Cancelled)
//! ));
//! # Ok::<(), Error>(())
//! ```

use crate::error::{Error, Result};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A cooperative stop and a work budget for one computation: a shared
/// cancellation flag, an optional time limit and an optional bound on the
/// rendered prompt's size. Clones share the flag: cancel one, every clone
/// sees it at its next checkpoint.
#[derive(Debug, Clone, Default)]
pub struct Interrupt {
    cancelled: Arc<AtomicBool>,
    time_limit: Option<(Instant, Duration)>,
    max_text_bytes: Option<usize>,
}

impl Interrupt {
    /// No limit, not cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stops at the first checkpoint reached `limit` after now
    /// ([`Error::OverBudget`]): a bound on the request's work time.
    #[must_use]
    pub fn with_time_limit(mut self, limit: Duration) -> Self {
        self.time_limit = Some((Instant::now() + limit, limit));
        self
    }

    /// Refuses to tokenize a rendered prompt (or a completion's text) of
    /// more than `max` bytes ([`Error::OverBudget`]); the rendering itself
    /// is bounded by [`RenderLimits::max_output_bytes`](crate::RenderLimits).
    #[must_use]
    pub fn with_max_text_bytes(mut self, max: usize) -> Self {
        self.max_text_bytes = Some(max);
        self
    }

    /// Asks the computation to stop at its next checkpoint
    /// ([`Error::Cancelled`]). Callable from any thread, any number of times.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    /// Whether [`cancel`](Self::cancel) was called on this or a clone.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// A checkpoint: `Err` when cancelled or past the time limit.
    pub fn check(&self) -> Result<()> {
        if self.is_cancelled() {
            return Err(Error::Cancelled);
        }
        if let Some((until, limit)) = self.time_limit
            && Instant::now() >= until
        {
            return Err(Error::OverBudget(format!(
                "computing the token ids took longer than {limit:?}"
            )));
        }
        Ok(())
    }

    /// The checkpoint before tokenizing `len` bytes of text: the size
    /// budget, then [`check`](Self::check).
    pub fn check_text(&self, len: usize) -> Result<()> {
        if let Some(max) = self.max_text_bytes
            && len > max
        {
            return Err(Error::OverBudget(format!(
                "the prompt is {len} bytes, more than the tokenizing budget of {max}"
            )));
        }
        self.check()
    }
}

/// The checkpoint of an optional interrupt: nothing to check without one.
pub(crate) fn check(interrupt: Option<&Interrupt>) -> Result<()> {
    interrupt.map_or(Ok(()), Interrupt::check)
}

/// [`Interrupt::check_text`] of an optional interrupt.
pub(crate) fn check_text(interrupt: Option<&Interrupt>, len: usize) -> Result<()> {
    interrupt.map_or(Ok(()), |interrupt| interrupt.check_text(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_the_flag_and_limits_stop_checkpoints() {
        let interrupt = Interrupt::new();
        let clone = interrupt.clone();
        assert!(interrupt.check().is_ok());
        clone.cancel();
        assert!(interrupt.is_cancelled());
        assert!(matches!(interrupt.check(), Err(Error::Cancelled)));

        let sized = Interrupt::new().with_max_text_bytes(10);
        assert!(sized.check_text(10).is_ok());
        assert!(matches!(sized.check_text(11), Err(Error::OverBudget(_))));

        let timed = Interrupt::new().with_time_limit(Duration::ZERO);
        let err = timed.check().unwrap_err();
        assert!(matches!(err, Error::OverBudget(_)), "{err}");
        assert!(err.to_string().contains("took longer than"), "{err}");
        // No interrupt: nothing to check.
        assert!(check(None).is_ok() && check_text(None, usize::MAX).is_ok());
    }
}
