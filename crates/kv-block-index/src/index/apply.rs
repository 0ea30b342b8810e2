//! Applying a stream's events: the stream-local half of each event
//! (checking its shape, finding its parent, hashing its tokens,
//! translating engine hashes), the calls into the writer it ends in, the
//! cap on a stream's blocks, and [`StreamWriter`], the handle a subscriber
//! keeps per stream.
//!
//! The edge cases each event kind meets are in the [module
//! docs](crate::index#events-and-their-edge-cases); here is where they are
//! decided. Hashing and translation run under the stream's own lock, and
//! only the chain changes take the writer lock, so streams of different
//! workers prepare their events in parallel. Freeing what an event retired
//! waits for readers after the writer lock is released (module `reclaim`),
//! so other streams' events go on meanwhile.

use crate::sync::{Arc, Mutex};

use super::stream::Stream;
use super::write::Writer;
use super::{
    ApplyOutcome, C_CLEARS, C_EVENTS, C_EVICTED, C_MALFORMED, C_REMOVED, C_STORED,
    C_UNKNOWN_PARENT, C_UNKNOWN_REMOVED, Holder, Inner, KvEvent, KvIndexError, Loc,
};

#[cfg(doc)]
use super::KvIndex;

impl Inner {
    /// Applies one event of `stream` (locked by the caller, so its events
    /// apply in order).
    pub(super) fn apply(
        &self,
        stream: &mut Stream,
        event: &KvEvent,
    ) -> Result<ApplyOutcome, KvIndexError> {
        if stream.dead {
            return Err(KvIndexError::UnknownWorker(stream.holder.worker));
        }
        self.count(C_EVENTS, 1);
        let mut outcome = ApplyOutcome::default();
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
            } => {
                let n = block_hashes.len();
                let hasher = self.hasher.with_lora(*lora_id);
                if *block_size != hasher.block_size()
                    || token_ids.len() != n.saturating_mul(*block_size)
                {
                    outcome.malformed = n as u64;
                } else {
                    let parent = match parent_block_hash {
                        None => Some((hasher.root(), None)),
                        Some(engine) => stream.map.get(&engine.0).and_then(|&p| {
                            let loc = Loc::unpack(p);
                            // A held block never moves nor changes its hash,
                            // so the remembered one is still right.
                            match stream.last {
                                Some((place, hash)) if place == p => Some((hash, Some(loc))),
                                _ => self.hash_at(loc).map(|h| (h, Some(loc))),
                            }
                        }),
                    };
                    match parent {
                        None => outcome.unknown_parent = n as u64,
                        Some((parent, parent_loc)) => {
                            let mut ours = std::mem::take(&mut stream.scratch);
                            ours.clear();
                            hasher.chain_into(parent, token_ids, &mut ours);
                            let mut prev = parent_loc;
                            let garbage = {
                                let mut w = self.writer.lock();
                                let w = &mut *w;
                                for (i, (engine, our)) in block_hashes.iter().zip(&ours).enumerate()
                                {
                                    // A block appended in place is held at
                                    // once, so only for an engine hash the
                                    // stream does not map yet (asked only
                                    // then: most blocks never need it).
                                    let map = &stream.map;
                                    let fresh = || !map.contains_key(&engine.0);
                                    let more = n - 1 - i;
                                    let (loc, held) =
                                        self.locate(w, prev, our.0, (stream.slot, &fresh), more);
                                    prev = Some(loc);
                                    if held {
                                        stream.map_insert(engine.0, loc.pack());
                                        outcome.stored += 1;
                                        continue;
                                    }
                                    if let Some(old) = stream.map_insert(engine.0, loc.pack()) {
                                        if old == loc.pack() {
                                            continue;
                                        }
                                        // The engine hash moves to another
                                        // block: let go of the old one.
                                        self.add_pending(w, stream, &mut outcome);
                                        let old = Loc::unpack(old);
                                        if stream.release(old) {
                                            let mut one = vec![old];
                                            outcome.removed +=
                                                self.remove_locs(w, stream.slot, &mut one);
                                        }
                                    }
                                    self.add_later(w, stream, loc, &mut outcome);
                                }
                                self.add_pending(w, stream, &mut outcome);
                                self.evict_over_cap(w, stream, &mut outcome);
                                self.end_event(w);
                                Self::take_garbage(w)
                            };
                            stream.last = prev.zip(ours.last()).map(|(loc, &h)| (loc.pack(), h));
                            stream.scratch = ours;
                            self.reclaim(garbage);
                        }
                    }
                }
            }
            KvEvent::BlockRemoved { block_hashes } => {
                let mut locs = std::mem::take(&mut stream.locs);
                for engine in block_hashes {
                    match stream.map_remove(engine.0) {
                        Some(p) => {
                            let loc = Loc::unpack(p);
                            if stream.release(loc) {
                                locs.push(loc);
                            }
                        }
                        None => outcome.unknown_removed += 1,
                    }
                }
                stream.tidy();
                let garbage = {
                    let mut w = self.writer.lock();
                    let w = &mut *w;
                    outcome.removed = self.remove_locs(w, stream.slot, &mut locs);
                    self.end_event(w);
                    Self::take_garbage(w)
                };
                stream.locs = locs;
                self.reclaim(garbage);
            }
            KvEvent::AllBlocksCleared => {
                self.count(C_CLEARS, 1);
                outcome.removed = self.clear_stream(stream);
            }
        }
        self.count(C_STORED, outcome.stored);
        self.count(C_REMOVED, outcome.removed);
        self.count(C_UNKNOWN_PARENT, outcome.unknown_parent);
        self.count(C_UNKNOWN_REMOVED, outcome.unknown_removed);
        self.count(C_MALFORMED, outcome.malformed);
        Ok(outcome)
    }

    /// Drops the stream's oldest blocks while it holds more than its
    /// worker's cap, through the path a `BlockRemoved` of them takes (so a
    /// dropped parent whose children stay held reads as vLLM evicting that
    /// block: prefixes stop before it). Under the writer lock, at the end
    /// of a stored event.
    fn evict_over_cap(&self, w: &mut Writer, stream: &mut Stream, outcome: &mut ApplyOutcome) {
        let cap = stream.share.cap.load(std::sync::atomic::Ordering::Relaxed);
        if stream.map.len() <= cap {
            return;
        }
        let mut locs = std::mem::take(&mut stream.locs);
        let evicted = stream.evict(cap, &mut locs);
        outcome.evicted += evicted;
        outcome.removed += self.remove_locs(w, stream.slot, &mut locs);
        stream.locs = locs;
        self.count(C_EVICTED, evicted);
    }

    /// Drops a stream's oldest blocks down to its worker's cap (after the
    /// cap was lowered); returns the engine blocks dropped.
    pub(super) fn enforce_cap(&self, stream: &mut Stream) -> u64 {
        let mut outcome = ApplyOutcome::default();
        let garbage = {
            let mut w = self.writer.lock();
            let w = &mut *w;
            self.evict_over_cap(w, stream, &mut outcome);
            self.end_event(w);
            Self::take_garbage(w)
        };
        self.reclaim(garbage);
        self.count(C_REMOVED, outcome.removed);
        outcome.evicted
    }

    /// Drops everything a stream holds; returns the blocks no longer held.
    pub(super) fn clear_stream(&self, stream: &mut Stream) -> u64 {
        stream.extra.clear();
        stream.clear_order();
        let mut locs = std::mem::take(&mut stream.locs);
        locs.extend(stream.map.drain().map(|(_, p)| Loc::unpack(p)));
        let (removed, garbage) = {
            let mut w = self.writer.lock();
            let w = &mut *w;
            let removed = self.remove_locs(w, stream.slot, &mut locs);
            self.end_event(w);
            (removed, Self::take_garbage(w))
        };
        stream.locs = locs;
        self.reclaim(garbage);
        removed
    }
}

/// The write handle of one (worker, rank) event stream; see
/// [`KvIndex::stream`]. One task per stream applies its events in order;
/// handles of different streams apply concurrently.
pub struct StreamWriter {
    pub(super) inner: Arc<Inner>,
    pub(super) stream: Arc<Mutex<Stream>>,
}

impl std::fmt::Debug for StreamWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamWriter")
            .field("holder", &self.holder())
            .finish_non_exhaustive()
    }
}

impl StreamWriter {
    /// The stream's holder.
    pub fn holder(&self) -> Holder {
        self.stream.lock().holder
    }

    /// Applies one event. Fails only after the worker was unregistered.
    pub fn apply(&self, event: &KvEvent) -> Result<ApplyOutcome, KvIndexError> {
        let mut stream = self.stream.lock();
        self.inner.apply(&mut stream, event)
    }

    /// Drops everything this stream holds (as `AllBlocksCleared` would).
    pub fn clear(&self) -> Result<u64, KvIndexError> {
        self.apply(&KvEvent::AllBlocksCleared).map(|o| o.removed)
    }
}
