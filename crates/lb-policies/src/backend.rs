//! The backend trait: what a policy needs to know about one worker.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// A worker a policy can choose, as seen by the policy.
///
/// The host implements this for its own worker type (or an adapter around
/// it). Every method is a cheap read of live state: policies call them on
/// every decision, on every candidate, so they should be plain atomic loads.
///
/// The trait is object safe, and it is implemented for `&T`, `Box<T>` and
/// `Arc<T>` whenever `T: Backend` (including `T = dyn Backend`), so a
/// candidate slice can be `&[Arc<MyWorker>]`, `&[&MyWorker]` or
/// `&[Arc<dyn Backend + Send + Sync>]` without copying anything.
pub trait Backend {
    /// A key that identifies this worker for as long as it is a member of the
    /// fleet (typically its URL). Hash policies place keys by it and
    /// membership events name workers by it.
    fn key(&self) -> &str;

    /// Requests currently in flight on this worker: the load policies
    /// compare. A host that knows more than its own count (several router
    /// replicas, each polling the engines' own figures) returns its best
    /// estimate of the engine's whole load here; worker-lifecycle's
    /// `Worker` returns `Worker::estimated_load`.
    fn load(&self) -> usize;

    /// Requests this worker has been given so far (a tie-breaker among
    /// equally loaded workers: the one that has had less work goes first).
    fn processed(&self) -> u64;

    /// Whether the worker may take new work now (healthy, not draining,
    /// circuit closed). Policies never choose an unavailable candidate and
    /// never let one influence load statistics.
    fn is_available(&self) -> bool;

    /// How full the engine's KV cache is with the blocks of the requests it
    /// runs, from 0 to 1 (vLLM's `vllm:kv_cache_usage_perc`, which counts
    /// cached but unreferenced blocks as free), as last reported; 0 when
    /// unknown. The expected-cost choice charges blocks placed on a nearly
    /// full cache extra, since they evict other requests' prefixes.
    fn cache_usage(&self) -> f64 {
        0.0
    }

    /// How many of the requests in [`load`](Self::load) the engine holds
    /// queued, admitted but not yet scheduled (vLLM's
    /// `vllm:num_requests_waiting`), as last reported; 0 when unknown. A
    /// queued request is latency a new one waits behind, where a running
    /// one shares the batch.
    fn waiting(&self) -> usize {
        0
    }
}

/// Pointers to a backend are backends: a host can pass `&[&W]`, `&[Box<W>]`
/// or `&[Arc<W>]` as candidates.
macro_rules! forward_backend {
    ($($pointer:ty),*) => {$(
        impl<T: Backend + ?Sized> Backend for $pointer {
            fn key(&self) -> &str {
                (**self).key()
            }
            fn load(&self) -> usize {
                (**self).load()
            }
            fn processed(&self) -> u64 {
                (**self).processed()
            }
            fn is_available(&self) -> bool {
                (**self).is_available()
            }
            fn cache_usage(&self) -> f64 {
                (**self).cache_usage()
            }
            fn waiting(&self) -> usize {
                (**self).waiting()
            }
        }
    )*};
}

forward_backend!(&T, Box<T>, Arc<T>);

/// A ready-made [`Backend`]: a key plus atomics the host updates.
///
/// Useful for tests, simulations, benches and small proxies that have no
/// worker type of their own. All setters take `&self`.
#[derive(Debug)]
pub struct BasicBackend {
    key: Box<str>,
    load: AtomicUsize,
    processed: AtomicU64,
    available: AtomicBool,
    /// The bits of an `f64`.
    cache_usage: AtomicU64,
    waiting: AtomicUsize,
}

impl BasicBackend {
    /// An available backend with no load and nothing processed.
    pub fn new(key: impl Into<Box<str>>) -> Self {
        BasicBackend {
            key: key.into(),
            load: AtomicUsize::new(0),
            cache_usage: AtomicU64::new(0f64.to_bits()),
            waiting: AtomicUsize::new(0),
            processed: AtomicU64::new(0),
            available: AtomicBool::new(true),
        }
    }

    /// Builder form of [`set_load`](Self::set_load).
    #[must_use]
    pub fn with_load(self, load: usize) -> Self {
        self.set_load(load);
        self
    }

    /// Builder form of [`set_available`](Self::set_available).
    #[must_use]
    pub fn with_available(self, available: bool) -> Self {
        self.set_available(available);
        self
    }

    /// Sets the in-flight load.
    pub fn set_load(&self, load: usize) {
        self.load.store(load, Ordering::Relaxed);
    }

    /// Sets the engine's KV-cache usage, a fraction ([`Backend::cache_usage`]).
    pub fn set_cache_usage(&self, usage: f64) {
        self.cache_usage.store(usage.to_bits(), Ordering::Relaxed);
    }

    /// Sets the engine's waiting-request count ([`Backend::waiting`]).
    pub fn set_waiting(&self, waiting: usize) {
        self.waiting.store(waiting, Ordering::Relaxed);
    }

    /// Sets the processed-request count.
    pub fn set_processed(&self, processed: u64) {
        self.processed.store(processed, Ordering::Relaxed);
    }

    /// Marks the backend available or not.
    pub fn set_available(&self, available: bool) {
        self.available.store(available, Ordering::Relaxed);
    }

    /// Records the start of a request: load + 1, processed + 1.
    pub fn begin_request(&self) {
        self.load.fetch_add(1, Ordering::Relaxed);
        self.processed.fetch_add(1, Ordering::Relaxed);
    }

    /// Records the end of a request: load − 1, never below zero.
    pub fn end_request(&self) {
        // A failed update means the load was already zero: nothing to undo.
        let _ = self
            .load
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| l.checked_sub(1));
    }
}

impl Backend for BasicBackend {
    fn key(&self) -> &str {
        &self.key
    }
    fn load(&self) -> usize {
        self.load.load(Ordering::Relaxed)
    }
    fn processed(&self) -> u64 {
        self.processed.load(Ordering::Relaxed)
    }
    fn is_available(&self) -> bool {
        self.available.load(Ordering::Relaxed)
    }
    fn cache_usage(&self) -> f64 {
        f64::from_bits(self.cache_usage.load(Ordering::Relaxed))
    }
    fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrappers_forward_every_method() {
        let b = Arc::new(BasicBackend::new("w0").with_load(3));
        b.set_processed(9);
        b.set_cache_usage(0.5);
        b.set_waiting(2);
        let dynamic: Arc<dyn Backend + Send + Sync> = b.clone();
        let by_ref: &BasicBackend = &b;
        let boxed: Box<&BasicBackend> = Box::new(by_ref);
        for view in [&dynamic as &dyn Backend, &by_ref, &boxed, &b] {
            assert_eq!(view.key(), "w0");
            assert_eq!(view.load(), 3);
            assert_eq!(view.processed(), 9);
            assert!(view.is_available());
            assert_eq!(view.cache_usage(), 0.5);
            assert_eq!(view.waiting(), 2);
        }
    }

    #[test]
    fn end_request_never_goes_below_zero() {
        let b = BasicBackend::new("w");
        b.begin_request();
        b.end_request();
        b.end_request();
        assert_eq!(b.load(), 0);
        assert_eq!(b.processed(), 1);
    }
}
