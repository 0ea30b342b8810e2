//! One replay over a fresh DEALER socket.

use bytes::Bytes;
use tokio::sync::mpsc;

use super::transport::ReplayMsg;
use crate::sequencer::ReplayId;
use crate::zmq_io::{Incoming, SocketThread, context, harden};

/// Answers a replay socket's thread may hold for the replay task.
const REPLAY_THREAD_QUEUE: usize = 8;

/// One replay over a fresh DEALER: the request, then answers until the
/// end marker. Aborting the task drops the socket thread (and the socket).
pub(super) async fn replay_once(
    endpoint: &str,
    max_message_size: usize,
    id: ReplayId,
    from: u64,
    answers: &mpsc::Sender<ReplayMsg>,
) -> Result<(), String> {
    let dealer = context().socket(zmq::DEALER).map_err(|e| e.to_string())?;
    harden(
        &dealer,
        max_message_size,
        crate::zmq_io::DEFAULT_RECEIVE_HWM,
    )
    .map_err(|e| e.to_string())?;
    dealer.connect(endpoint).map_err(|e| e.to_string())?;
    // Queued until the connection is made (the sequencer's replay timeout
    // bounds the wait).
    dealer
        .send_multipart([&[][..], &from.to_be_bytes()[..]], zmq::DONTWAIT)
        .map_err(|e| e.to_string())?;
    let mut thread = SocketThread::spawn("kv-events-replay", dealer, None, REPLAY_THREAD_QUEUE)
        .map_err(|e| e.to_string())?;
    loop {
        let mut frames = match thread.recv().await {
            Some(Incoming::Message(frames)) => frames,
            Some(_) => continue,
            None => return Err("the replay socket's thread ended".to_owned()),
        };
        // A DEALER sees the ROUTER's empty delimiter; a REQ-style peer
        // would have stripped it.
        if frames.first().is_some_and(Bytes::is_empty) && frames.len() == 3 {
            frames.remove(0);
        }
        let [seq, payload] = <[Bytes; 2]>::try_from(frames)
            .map_err(|f| format!("replay answer with {} frames", f.len()))?;
        if payload.is_empty() || seq.as_ref() == crate::publisher::END_OF_REPLAY {
            let _ = answers.send(ReplayMsg::End(id)).await;
            return Ok(());
        }
        // Waits while the loop has REPLAY_ANSWER_QUEUE answers to apply.
        if answers
            .send(ReplayMsg::Item(id, seq, payload))
            .await
            .is_err()
        {
            return Ok(());
        }
    }
}
