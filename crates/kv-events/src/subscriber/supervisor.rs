//! The supervisor that restarts the receive loop whenever it ends.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::time::Instant;

use super::receive::run;
use super::transport::Transport;
use super::{EventSink, StreamEvent, StreamStatus, SubscriberConfig};
use crate::sequencer::{ResetReason, StreamState};

/// Runs the loop and restarts it whenever it ends; see the module docs.
pub(super) async fn supervise<T: Transport, S: EventSink>(
    config: SubscriberConfig,
    mut transport: T,
    mut sink: S,
    status: Arc<Mutex<StreamStatus>>,
) {
    let mut in_a_row = 0u32;
    loop {
        let started = Instant::now();
        let outcome = futures_util::FutureExt::catch_unwind(AssertUnwindSafe(run(
            config.clone(),
            &mut transport,
            &mut sink,
            Arc::clone(&status),
        )))
        .await;
        let why = match outcome {
            Ok(()) => "ended".to_owned(),
            Err(panic) => panic_message(&*panic),
        };
        {
            // Cold at once: nothing reads the stream now.
            let mut status = status.lock().unwrap_or_else(PoisonError::into_inner);
            status.state = StreamState::Connecting;
            status.counters.restarts += 1;
        }
        // A loop that ran a while is a new failure, not one in a row.
        if started.elapsed() > config.backoff.max.saturating_mul(2) {
            in_a_row = 0;
        }
        in_a_row = in_a_row.saturating_add(1);
        let delay = config.backoff.delay(in_a_row);
        tracing::error!(endpoint = %config.endpoint, reason = %why, ?delay, "KV event receive loop stopped; restarting it");
        let reset = StreamEvent::Reset {
            reason: ResetReason::ReaderRestarted,
        };
        // The sink may be what panicked: it must not take the supervisor.
        if std::panic::catch_unwind(AssertUnwindSafe(|| sink.on_event(reset))).is_ok() {
            let mut status = status.lock().unwrap_or_else(PoisonError::into_inner);
            status.counters.resets += 1;
        }
        tokio::time::sleep(delay).await;
    }
}

/// What a panic said, for the log.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        format!("panicked: {text}")
    } else if let Some(text) = panic.downcast_ref::<String>() {
        format!("panicked: {text}")
    } else {
        "panicked".to_owned()
    }
}
