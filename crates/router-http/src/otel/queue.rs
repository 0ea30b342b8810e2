//! The export queue: finished spans handed over a request at a time, and
//! the thread that batches and exports them.
//!
//! A traced request ends half a dozen spans. The SDK's batch processor
//! takes them one at a time: each one a send on its channel, each a
//! ~300-byte slot written on the request's thread and read on the export
//! thread (a cache miss across cores per span). Here a request's spans
//! are kept with its server span until it ends ([`Traced`]) and handed
//! over together: one bound check and one send per request. They are
//! encoded before they go ([`TraceEncoder::encode_spans`], with the
//! request thread's own encoder), so their records and all they hold are
//! freed where they were made and one buffer crosses to the export
//! thread, which only copies the buffers of a batch into its request:
//! records freed on the export thread made every later allocation of
//! the request's thread that reused their memory, and every shared
//! URL's reference count, a miss across cores (docs/benchmarks.md,
//! "Tracing"). An export holds whole hand-overs: a request's spans are
//! never split between two exports. The thread
//! behind the channel does what the SDK's does: it sleeps until a batch's
//! worth ([`ExportConfig::max_export_batch_size`]) is queued (the hand-over
//! that reaches it wakes the thread, no other does), a flush or shutdown
//! asks, or [`ExportConfig::scheduled_delay`] passes since its last export;
//! then it takes what waits and exports it, one export at a time, whole
//! batches on a batch's signal and everything on the others.
//!
//! The bound is the router's own count ([`SpanCounts::queued`]): the
//! spans of a hand-over that do not fit in [`ExportConfig::max_queue_size`]
//! are dropped and counted, the request's server span last (it is the
//! root of what is kept). The channel holds a message per hand-over, so
//! it is never full while the count admits one: a send never blocks a
//! request.

use super::*;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::Instant;

/// Where the export thread sends its batches: an OTLP exporter (behind
/// [`CountingExporter`]), or a test's recorder.
pub(super) trait Export: Send + 'static {
    /// Exports `batch`: hand-overs of spans encoded where they ended
    /// ([`TraceEncoder::encode_spans`]), in order. The export thread
    /// waits for the future (the network exchange itself runs on the
    /// router's runtime, see [`ExportClient`]); the batch is freed after
    /// it ends.
    fn export(
        &self,
        batch: &[EncodedSpans],
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send;

    /// Stops the exporter, after its last export.
    fn shutdown(&self) -> OTelSdkResult {
        Ok(())
    }
}

/// What the export thread is asked to do, besides its scheduled export.
enum Control {
    /// A batch's worth of spans may be waiting: take them.
    BatchReady,
    /// Export everything queued now, then answer.
    Flush(SyncSender<OTelSdkResult>),
    /// Export everything queued, shut the exporter down, answer, stop.
    Shutdown(SyncSender<OTelSdkResult>),
}

/// The sending side of a pipeline's export: the bound, the counters and
/// the channels to its export thread.
#[derive(Debug)]
pub(super) struct SpanQueue {
    /// Hand-overs, one message each (a request's spans, or a single late
    /// one, encoded), admitted in the count. The export thread takes them
    /// when it wakes: a hand-over does not wake it.
    spans: SyncSender<EncodedSpans>,
    /// What wakes the export thread before its scheduled export.
    control: SyncSender<Control>,
    /// Set when a [`Control::BatchReady`] is on its way (one at a time);
    /// cleared by the export thread when it takes the spans.
    batch_signalled: Arc<AtomicBool>,
    counts: Arc<SpanCounts>,
    capacity: usize,
    batch_size: usize,
    stopped: AtomicBool,
    /// How long a flush or a shutdown waits for the export thread.
    wait: Duration,
}

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::BatchReady => "BatchReady",
            Self::Flush(_) => "Flush",
            Self::Shutdown(_) => "Shutdown",
        })
    }
}

impl SpanQueue {
    /// Starts the export thread for `exporter` (already counting, see
    /// [`CountingExporter`]) with `config`'s bound, batch size and delay.
    pub(super) fn start<E: Export>(
        config: &ExportConfig,
        exporter: E,
        counts: &Arc<SpanCounts>,
    ) -> Self {
        let capacity = config.max_queue_size.max(1);
        let batch_size = config.max_export_batch_size.clamp(1, capacity);
        // One message per admitted hand-over, each of at least one span:
        // never full while the count admits.
        let (spans, spans_in) = std::sync::mpsc::sync_channel(capacity);
        // A batch signal, a flush and a shutdown at a time, with room.
        let (control, control_in) = std::sync::mpsc::sync_channel(4);
        let batch_signalled = Arc::new(AtomicBool::new(false));
        let thread = ExportThread {
            exporter,
            spans: spans_in,
            control: control_in,
            batch_signalled: Arc::clone(&batch_signalled),
            counts: Arc::clone(counts),
            batch_size,
            delay: config.scheduled_delay,
            batch: Vec::new(),
            batch_spans: 0,
        };
        let spawned = std::thread::Builder::new()
            .name("otel-batch".into())
            .spawn(move || thread.run());
        if let Err(err) = spawned {
            // Without its thread the channels have no receiver: every
            // hand-over is counted dropped (`shutdown`) at once.
            tracing::error!(error = %err, "cannot start the trace export thread; spans will be dropped");
        }
        Self {
            spans,
            control,
            batch_signalled,
            counts: Arc::clone(counts),
            capacity,
            batch_size,
            stopped: AtomicBool::new(false),
            wait: config.timeout.saturating_add(Duration::from_secs(1)),
        }
    }

    /// Hands `spans` over for export, or drops them, counted: all of them
    /// (`shutdown`) after [`shutdown`](Self::shutdown), and those that do
    /// not fit in the bound (`queue_full`), the first ones (a request's
    /// server span is its last). Never blocks; wakes the export thread
    /// only when a batch's worth is queued.
    pub(super) fn hand_off(&self, mut spans: Vec<SpanRecord>) {
        let n = spans.len();
        if n == 0 {
            return;
        }
        if self.stopped.load(Ordering::Relaxed) {
            self.counts.shutdown.add(n as u64);
            return;
        }
        let (admitted, queued) = self.counts.admit(n, self.capacity);
        if admitted < n {
            self.counts.queue_full.add((n - admitted) as u64);
            if admitted == 0 {
                return;
            }
            // The server span is last: the request's other spans go first.
            spans.drain(..n - admitted);
        }
        // Encoded here, on the thread where the spans ended: their
        // records, and everything they hold (attribute vectors, strings,
        // shared URLs' counts), are freed on the thread that made them,
        // and one buffer crosses to the export thread. Made and freed on
        // another core, they cost the request's thread more than the
        // encoding does (docs/benchmarks.md, "Tracing").
        let encoded = ENCODER
            .try_with(|encoder| encoder.borrow_mut().encode_spans(&spans))
            // A span ending while its thread's locals are torn down.
            .unwrap_or_else(|_| TraceEncoder::new().encode_spans(&spans));
        drop(spans);
        match self.spans.try_send(encoded) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                // Not while the count admits (see `start`); kept exact.
                self.counts.release(admitted);
                self.counts.queue_full.add(admitted as u64);
                return;
            }
            Err(TrySendError::Disconnected(_)) => {
                // No receiver: the thread stopped (or never started).
                self.counts.release(admitted);
                self.counts.shutdown.add(admitted as u64);
                return;
            }
        }
        // `queued` counts every admitted span not yet through an export,
        // so it is at least what waits: a batch may wait when it reaches
        // the batch size (a signal too many only wakes the thread).
        if queued >= self.batch_size && !self.batch_signalled.swap(true, Ordering::AcqRel) {
            let _ = self.control.try_send(Control::BatchReady);
        }
    }

    /// Exports every span handed over so far and waits for the export
    /// (at most the export timeout and a second).
    pub(super) fn force_flush(&self) -> OTelSdkResult {
        self.ask(Control::Flush)
    }

    /// Exports what is queued, shuts the exporter down and stops the
    /// thread; spans handed over later are dropped (`shutdown`). Waits as
    /// a flush does; a second call is an error.
    pub(super) fn shutdown(&self) -> OTelSdkResult {
        if self.stopped.swap(true, Ordering::Relaxed) {
            return Err(OTelSdkError::AlreadyShutdown);
        }
        self.ask(Control::Shutdown)
    }

    fn ask(&self, message: fn(SyncSender<OTelSdkResult>) -> Control) -> OTelSdkResult {
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        self.control
            .send(message(reply))
            .map_err(|_| OTelSdkError::AlreadyShutdown)?;
        match answer.recv_timeout(self.wait) {
            Ok(result) => result,
            Err(RecvTimeoutError::Timeout) => Err(OTelSdkError::Timeout(self.wait)),
            Err(RecvTimeoutError::Disconnected) => Err(OTelSdkError::AlreadyShutdown),
        }
    }
}

thread_local! {
    /// Each request thread's span encoder: its buffer is kept from one
    /// hand-over to the next.
    static ENCODER: std::cell::RefCell<TraceEncoder> = std::cell::RefCell::new(TraceEncoder::new());
}

/// The export thread's side: it sleeps until a batch is signalled, a
/// flush or shutdown is asked, or the scheduled delay passes; then takes
/// what waits and exports it (see the module docs).
struct ExportThread<E> {
    exporter: E,
    spans: Receiver<EncodedSpans>,
    control: Receiver<Control>,
    batch_signalled: Arc<AtomicBool>,
    counts: Arc<SpanCounts>,
    batch_size: usize,
    delay: Duration,
    /// Hand-overs taken and not yet exported (fewer spans than a batch
    /// between wake-ups).
    batch: Vec<EncodedSpans>,
    /// The spans in `batch`.
    batch_spans: usize,
}

impl<E: Export> ExportThread<E> {
    fn run(mut self) {
        let mut due = Instant::now() + self.delay;
        loop {
            match self
                .control
                .recv_timeout(due.saturating_duration_since(Instant::now()))
            {
                Ok(Control::BatchReady) => {
                    self.take();
                    while self.batch_spans >= self.batch_size {
                        let _ = self.export_batch();
                        due = Instant::now() + self.delay;
                    }
                }
                Ok(Control::Flush(reply)) => {
                    self.take();
                    let _ = reply.send(self.export_all());
                }
                Ok(Control::Shutdown(reply)) => {
                    self.take();
                    let result = self.export_all();
                    let stopped = self.exporter.shutdown();
                    let _ = reply.send(result.and(stopped));
                    break;
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.take();
                    let _ = self.export_all();
                    due = Instant::now() + self.delay;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // The pipeline is gone: nothing more can come.
                    self.take();
                    let _ = self.export_all();
                    let _ = self.exporter.shutdown();
                    return;
                }
            }
        }
        // Hand-overs that raced the shutdown (read `stopped` before it was
        // set, sent after): admitted, never to be exported. One that sends
        // between this drain and the receiver's drop, a few instructions
        // later, is lost uncounted; its request had read `stopped` before
        // the whole export above ran.
        while let Ok(spans) = self.spans.try_recv() {
            self.counts.release(spans.len());
            self.counts.shutdown.add(spans.len() as u64);
        }
    }

    /// Takes every hand-over waiting, and allows the next batch signal.
    fn take(&mut self) {
        self.batch_signalled.store(false, Ordering::Release);
        while let Ok(spans) = self.spans.try_recv() {
            self.batch_spans += spans.len();
            self.batch.push(spans);
        }
    }

    /// Exports everything taken, a batch at a time; the first failure is
    /// the result (later batches are still sent).
    fn export_all(&mut self) -> OTelSdkResult {
        let mut result = Ok(());
        while !self.batch.is_empty() {
            let outcome = self.export_batch();
            if result.is_ok() {
                result = outcome;
            }
        }
        result
    }

    /// Exports the first hand-overs taken, as many whole ones as hold at
    /// most a batch's spans (at least one: a hand-over larger than a
    /// batch goes alone), waiting on this thread (the network exchange
    /// runs on the router's runtime, see [`ExportClient`]), then frees
    /// them. A request's spans are never split between two exports. The
    /// rest stay, in a buffer that keeps its size from batch to batch.
    fn export_batch(&mut self) -> OTelSdkResult {
        let mut spans = 0;
        let taken = self
            .batch
            .iter()
            .take_while(|hand_over| {
                let first = spans == 0;
                spans += hand_over.len();
                first || spans <= self.batch_size
            })
            .count();
        let spans: usize = self.batch[..taken].iter().map(EncodedSpans::len).sum();
        let result = futures_executor::block_on(self.exporter.export(&self.batch[..taken]));
        self.batch.drain(..taken);
        self.batch_spans -= spans;
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanKind, Status};

    /// An exporter that keeps each batch's span names, and can be held
    /// inside an export until released.
    #[derive(Debug, Clone, Default)]
    struct Recorder {
        batches: Arc<parking_lot::Mutex<Vec<Vec<String>>>>,
        hold: Arc<parking_lot::Mutex<Option<std::sync::mpsc::Receiver<()>>>>,
    }

    impl Export for Recorder {
        fn export(
            &self,
            batch: &[EncodedSpans],
        ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
            if let Some(hold) = self.hold.lock().take() {
                let _ = hold.recv_timeout(Duration::from_secs(30));
            }
            self.batches.lock().push(
                batch
                    .iter()
                    .flat_map(|spans| &spans.records)
                    .map(|span| span.name.to_string())
                    .collect(),
            );
            std::future::ready(Ok(()))
        }
    }

    fn record(name: &str) -> SpanRecord {
        SpanRecord {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent_span_id: [0; 8],
            trace_flags: 1,
            parent_is_remote: false,
            trace_state: None,
            kind: SpanKind::Internal,
            name: name.to_owned().into(),
            start: std::time::SystemTime::now(),
            end: std::time::SystemTime::now(),
            attributes: Vec::new(),
            dropped_attributes: 0,
            status: Status::Unset,
        }
    }

    fn records(names: &[&str]) -> Vec<SpanRecord> {
        names.iter().map(|name| record(name)).collect()
    }

    fn queue(config: ExportConfig) -> (SpanQueue, Recorder, Arc<SpanCounts>) {
        let recorder = Recorder::default();
        let counts = Arc::new(SpanCounts::default());
        let exporter = CountingExporter {
            inner: recorder.clone(),
            counts: Arc::clone(&counts),
        };
        (
            SpanQueue::start(&config, exporter, &counts),
            recorder,
            counts,
        )
    }

    fn no_delay_config() -> ExportConfig {
        ExportConfig {
            scheduled_delay: Duration::from_secs(3600),
            ..ExportConfig::default()
        }
    }

    /// A batch is as many whole hand-overs as hold at most the batch size
    /// (a request's spans are never split between two exports), and a
    /// hand-over larger than a batch goes alone.
    #[test]
    fn full_batches_go_at_once_and_the_rest_on_a_flush() {
        let (queue, recorder, counts) = queue(ExportConfig {
            max_export_batch_size: 4,
            ..no_delay_config()
        });
        queue.hand_off(records(&["a", "b"]));
        queue.hand_off(records(&["c", "d"]));
        queue.hand_off(records(&["e", "f", "g"]));
        queue.hand_off(records(&["h", "i", "j", "k", "l"]));
        queue.hand_off(records(&["m"]));
        queue.force_flush().unwrap();
        let batches = recorder.batches.lock().clone();
        assert_eq!(
            batches,
            [
                vec!["a", "b", "c", "d"],
                vec!["e", "f", "g"],
                vec!["h", "i", "j", "k", "l"],
                vec!["m"]
            ]
        );
        assert_eq!(counts.exported.get(), 13);
        assert_eq!(counts.queued.load(Ordering::Relaxed), 0);
    }

    /// The hand-over that makes a batch wakes the export thread, long
    /// before the scheduled delay; it sends whole batches only.
    #[test]
    fn a_full_batch_goes_without_waiting_for_the_delay() {
        let (queue, recorder, counts) = queue(ExportConfig {
            max_export_batch_size: 4,
            ..no_delay_config()
        });
        queue.hand_off(records(&["a", "b"]));
        queue.hand_off(records(&["c", "d"]));
        queue.hand_off(records(&["e"]));
        let deadline = Instant::now() + Duration::from_secs(10);
        while counts.exported.get() < 4 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(*recorder.batches.lock(), [vec!["a", "b", "c", "d"]]);
        assert_eq!(counts.queued.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn what_waits_goes_after_the_scheduled_delay() {
        let (queue, recorder, counts) = queue(ExportConfig {
            scheduled_delay: Duration::from_millis(20),
            ..ExportConfig::default()
        });
        queue.hand_off(records(&["a", "b"]));
        let deadline = Instant::now() + Duration::from_secs(10);
        while counts.exported.get() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(recorder.batches.lock().concat(), ["a", "b"]);
    }

    /// What does not fit in the bound is dropped from the front of a
    /// hand-over (a request's server span is last), and counted.
    #[test]
    fn the_bound_drops_a_hand_overs_first_spans_and_counts_them() {
        let (queue, recorder, counts) = queue(ExportConfig {
            max_queue_size: 3,
            ..no_delay_config()
        });
        queue.hand_off(records(&["admission", "route", "attempt", "server"]));
        queue.hand_off(records(&["late"]));
        assert_eq!(counts.queue_full.get(), 2);
        assert_eq!(counts.queued.load(Ordering::Relaxed), 3);
        queue.force_flush().unwrap();
        assert_eq!(
            recorder.batches.lock().concat(),
            ["route", "attempt", "server"]
        );
        queue.hand_off(records(&["next"]));
        queue.force_flush().unwrap();
        assert_eq!(recorder.batches.lock().concat().last().unwrap(), "next");
        assert_eq!(counts.exported.get(), 4);
        assert_eq!(counts.queued.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_shutdown_exports_what_waits_and_counts_what_comes_later() {
        let (queue, recorder, counts) = queue(no_delay_config());
        queue.hand_off(records(&["a", "b"]));
        queue.shutdown().unwrap();
        assert_eq!(recorder.batches.lock().concat(), ["a", "b"]);
        queue.hand_off(records(&["c", "d", "e"]));
        assert_eq!(counts.shutdown.get(), 3);
        assert_eq!(counts.exported.get(), 2);
        assert_eq!(counts.queued.load(Ordering::Relaxed), 0);
        assert!(queue.shutdown().is_err());
        assert!(queue.force_flush().is_err());
    }

    /// An export that does not end holds neither a request (hand-overs
    /// are counted dropped at the bound) nor a flush past its wait.
    #[test]
    fn a_stuck_export_blocks_no_hand_over_and_bounds_a_flush() {
        let (release, hold) = std::sync::mpsc::channel();
        let (queue, recorder, counts) = queue(ExportConfig {
            max_queue_size: 2,
            max_export_batch_size: 1,
            timeout: Duration::from_millis(50),
            ..no_delay_config()
        });
        *recorder.hold.lock() = Some(hold);
        queue.hand_off(records(&["stuck"]));
        queue.hand_off(records(&["waits"]));
        for _ in 0..100 {
            queue.hand_off(records(&["dropped"]));
        }
        assert_eq!(counts.queue_full.get(), 100);
        let flushing = Instant::now();
        assert!(matches!(queue.force_flush(), Err(OTelSdkError::Timeout(_))));
        // The wait is the export timeout and a second; far below the
        // exporter's own 30 s hold.
        assert!(flushing.elapsed() < Duration::from_secs(20));
        release.send(()).unwrap();
        queue.force_flush().unwrap();
        assert_eq!(recorder.batches.lock().concat(), ["stuck", "waits"]);
        assert_eq!(counts.exported.get(), 2);
    }
}
