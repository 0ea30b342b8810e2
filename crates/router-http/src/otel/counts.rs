//! What became of every span: admitted, dropped, exported or failed.

use super::*;

/// What became of the spans given to a pipeline: shared by its
/// [`SpanQueue`] (admitted or dropped at once) and its
/// [`CountingExporter`] (exported or failed).
#[derive(Debug, Default)]
pub(super) struct SpanCounts {
    /// Spans admitted and not yet through an export.
    pub(super) queued: AtomicUsize,
    pub(super) exported: crate::metrics::Counter,
    pub(super) queue_full: crate::metrics::Counter,
    pub(super) export_failed: crate::metrics::Counter,
    pub(super) shutdown: crate::metrics::Counter,
}

impl SpanCounts {
    /// Takes up to `spans` places in the queue, as many as are free of
    /// `capacity`: how many it took, and how many are taken after it.
    pub(super) fn admit(&self, spans: usize, capacity: usize) -> (usize, usize) {
        match self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < capacity).then(|| n + spans.min(capacity - n))
            }) {
            Ok(before) => {
                let admitted = spans.min(capacity - before);
                (admitted, before + admitted)
            }
            Err(before) => (0, before),
        }
    }

    /// Gives back `spans` places taken by [`admit`](Self::admit) for spans
    /// that never reached an export.
    pub(super) fn release(&self, spans: usize) {
        let _ = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(spans))
            });
    }

    /// `spans` admitted spans went through an export, accepted or not.
    fn settle(&self, spans: usize, exported: bool) {
        self.release(spans);
        let spans = u64::try_from(spans).unwrap_or(u64::MAX);
        if exported {
            self.exported.add(spans);
        } else {
            self.export_failed.add(spans);
        }
    }

    pub(super) fn render(&self, exposition: &mut crate::metrics::Exposition<'_>) {
        use crate::metrics::MetricType;
        exposition
            .family(
                "router_trace_spans_exported_total",
                MetricType::Counter,
                "Trace spans the OTLP collector accepted.",
            )
            .sample(&[], self.exported.get());
        let mut dropped = exposition.family(
            "router_trace_spans_dropped_total",
            MetricType::Counter,
            "Trace spans that never reached the collector, by reason (queue_full: the export queue was full; export_failed: the collector refused the batch or did not answer in time; shutdown: ended after the export stopped).",
        );
        dropped.sample(&[("reason", &"queue_full")], self.queue_full.get());
        dropped.sample(&[("reason", &"export_failed")], self.export_failed.get());
        dropped.sample(&[("reason", &"shutdown")], self.shutdown.get());
        let queued = u64::try_from(self.queued.load(Ordering::Relaxed)).unwrap_or(u64::MAX);
        exposition
            .family(
                "router_trace_spans_queued",
                MetricType::Gauge,
                "Trace spans waiting for export or in an export under way.",
            )
            .sample(&[], queued);
    }
}

/// The OTLP exporter, counting each batch's spans as exported or failed
/// when its export ends (or is abandoned).
#[derive(Debug)]
pub(super) struct CountingExporter<E> {
    pub(super) inner: E,
    pub(super) counts: Arc<SpanCounts>,
}

/// Settles a batch once: as its export's result, or as failed if the
/// export future is dropped before its end.
pub(super) struct Settle {
    pub(super) counts: Arc<SpanCounts>,
    pub(super) spans: usize,
    pub(super) exported: bool,
}

impl Drop for Settle {
    fn drop(&mut self) {
        self.counts.settle(self.spans, self.exported);
    }
}

impl<E: Export> Export for CountingExporter<E> {
    fn export(
        &self,
        batch: &[EncodedSpans],
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let settle = Settle {
            counts: Arc::clone(&self.counts),
            spans: batch.iter().map(EncodedSpans::len).sum(),
            exported: false,
        };
        let export = self.inner.export(batch);
        async move {
            // The whole guard moves in (not only the field written below).
            let mut settle = settle;
            let result = export.await;
            settle.exported = result.is_ok();
            result
        }
    }

    fn shutdown(&self) -> OTelSdkResult {
        self.inner.shutdown()
    }
}
