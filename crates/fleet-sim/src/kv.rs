//! The engines' KV-cache events on their way to the router replicas' block
//! indexes (the `kv_aware` policy).
//!
//! Every main-pool engine records its prefix cache's changes per scheduler
//! step ([`engine_sim::Engine::drain_kv_batches`]). A batch becomes
//! visible to the routers at the **end of the step that produced it plus
//! [`SimConfig::kv_event_delay`](crate::SimConfig::kv_event_delay)**: vLLM
//! allocates (and evicts) blocks when it schedules a step, but publishes
//! the step's events only after the step's forward pass, and the ZMQ hop
//! and the router's subscriber add a little more. Until then a router does
//! not know the blocks exist (nor that evicted ones are gone). Each router
//! replica has its own index, fed the same events at the same virtual
//! times, as independent subscribers to the same engines would be; the
//! replicas share nothing.
//!
//! The engines record vLLM's wire events (`kv_events::KvEvent`, exactly
//! what engine-sim publishes over ZMQ), and each is converted to the
//! index's form with the converter a router applies to the events its
//! subscribers receive (kv-block-index's `wire::to_index_event`), so the
//! simulated routers see the engines' caches as real ones would.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use engine_sim::Engine;
use kv_block_index::wire::to_index_event;
use kv_block_index::{IndexConfig, KvEvent, KvIndex, StreamWriter};
use lb_policies::{KvSources, KvStreams};

use crate::config::SimError;

/// The block indexes of the router replicas and the events in transit to
/// them.
pub(crate) struct KvFeed {
    /// Per replica: the index and liveness handle its policy reads.
    sources: Vec<KvSources>,
    /// Per replica, per engine (main-pool order): the engine's stream.
    writers: Vec<Vec<StreamWriter>>,
    /// Events in transit, by (visible at, arrival order): the engine and
    /// its converted events.
    pending: BTreeMap<(Duration, u64), (usize, Vec<KvEvent>)>,
    sequence: u64,
    delay: Duration,
}

impl KvFeed {
    /// One empty index per replica, hashing blocks of `block_size` tokens.
    pub(crate) fn new(replicas: usize, block_size: usize, delay: Duration) -> Self {
        let sources = (0..replicas)
            .map(|_| {
                let index: KvIndex = KvIndex::new(IndexConfig {
                    block_size,
                    ..IndexConfig::default()
                });
                KvSources::new(Arc::new(index), Arc::new(KvStreams::new()))
            })
            .collect();
        KvFeed {
            sources,
            writers: (0..replicas).map(|_| Vec::new()).collect(),
            pending: BTreeMap::new(),
            sequence: 0,
            delay,
        }
    }

    /// The sources replica `replica`'s policy is built with.
    pub(crate) fn sources(&self, replica: usize) -> Option<KvSources> {
        self.sources.get(replica).cloned()
    }

    /// Registers replica `replica`'s workers (engine `i` behind `keys[i]`)
    /// with its index and marks every stream live: the simulated engines
    /// publish from the start.
    pub(crate) fn attach<'k>(
        &mut self,
        replica: usize,
        keys: impl IntoIterator<Item = &'k str>,
    ) -> Result<(), SimError> {
        let (Some(sources), Some(writers)) =
            (self.sources.get(replica), self.writers.get_mut(replica))
        else {
            return Err(SimError::Worker(format!(
                "no KV index for replica {replica}"
            )));
        };
        for key in keys {
            let id = sources.index.register_worker(key.to_owned());
            let writer = sources
                .index
                .stream(id, 0)
                .map_err(|e| SimError::Worker(e.to_string()))?;
            writers.push(writer);
            sources.streams.set_live(id, true);
        }
        Ok(())
    }

    /// Takes the batches engine `engine` recorded during the operation
    /// that just ran on it and schedules them: visible when the step that
    /// produced each ends, plus the delay. The simulator advances an
    /// engine across at most one step boundary per operation, so a batch
    /// belongs to the step the engine is running now (if it still runs
    /// one whose end lies after the batch's start; otherwise its step is
    /// over and the engine's clock is the bound).
    pub(crate) fn collect(&mut self, engine: usize, from: &mut Engine) {
        let now = from.now();
        let step_end = from.next_step_end();
        let batches: Vec<_> = from.drain_kv_batches().collect();
        for batch in batches {
            let end = step_end.filter(|&end| end > batch.at).unwrap_or(now);
            // An event the router would skip (another medium or KV-cache
            // group, which engine-sim never sends) is skipped here too.
            let events = batch
                .events
                .into_iter()
                .filter_map(|event| to_index_event(event).ok())
                .collect::<Vec<_>>();
            if events.is_empty() {
                continue;
            }
            self.sequence += 1;
            self.pending.insert(
                (end.max(batch.at) + self.delay, self.sequence),
                (engine, events),
            );
        }
    }

    /// Applies, in order, every event visible by `now` to every replica's
    /// index.
    pub(crate) fn deliver(&mut self, now: Duration) {
        while let Some(entry) = self.pending.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let (engine, events) = entry.remove();
            for writers in &self.writers {
                let Some(writer) = writers.get(engine) else {
                    continue;
                };
                for event in &events {
                    // Fails only for an unregistered worker; the simulator
                    // never unregisters one.
                    let _ = writer.apply(event);
                }
            }
        }
    }
}
