//! One role's engines behind the router replicas' workers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine_sim::{Engine, ModelConfig, PdSettings};
use worker_lifecycle::{ManualClock, RoleKind, Worker, WorkerOptions};

use crate::config::{SimConfig, SimError};

/// One role's engines, in the order of its workers.
pub(crate) struct Pool {
    pub(crate) engines: Vec<Engine>,
    /// The role's workers (of the first router replica), engine `i`
    /// behind worker `i`.
    pub(crate) candidates: Arc<[Arc<Worker>]>,
    /// The other replicas' workers for the same engines, in engine order.
    pub(crate) others: Vec<Vec<Arc<Worker>>>,
    /// Worker key to engine index.
    pub(crate) index: HashMap<Box<str>, usize>,
    /// The scheduler step each engine is running: (start, end).
    pub(crate) steps: Vec<Option<(Duration, Duration)>>,
    /// Time each engine spent running steps.
    pub(crate) busy: Vec<Duration>,
}

/// The simulator's worker options: breakers never see a failure here, but
/// a manual clock keeps even their reads of "now" out of the results.
pub(crate) fn worker_options() -> WorkerOptions {
    WorkerOptions {
        clock: Arc::new(ManualClock::new(Instant::now())),
        ..WorkerOptions::default()
    }
}

pub(crate) fn worker_url(role: RoleKind, i: usize) -> String {
    format!("http://{}-{i}:8000", role.as_str())
}

/// `model` with every cost of its latency model multiplied by `factor`
/// (an older or smaller accelerator).
fn slowed(model: &ModelConfig, factor: f64) -> ModelConfig {
    let mut slow = model.clone();
    for cost in [
        &mut slow.prefill_base,
        &mut slow.prefill_per_token,
        &mut slow.decode_base,
        &mut slow.decode_per_seq,
        &mut slow.kv_transfer_per_token,
    ] {
        *cost = cost.mul_f64(factor);
    }
    slow
}

impl Pool {
    /// Engines behind `workers` (in their order), the last `drained` of
    /// them drained before the run and the first `slow` of them running
    /// [`SimConfig::slow_factor`] times slower.
    /// `replicas` holds the other router replicas' workers for the same
    /// engines (the same keys, in any order).
    pub(crate) fn new(
        workers: Arc<[Arc<Worker>]>,
        replicas: &[Arc<[Arc<Worker>]>],
        drained: usize,
        slow: usize,
        config: &SimConfig,
        pd: impl Fn(usize) -> PdSettings,
    ) -> Result<Self, SimError> {
        let count = workers.len();
        if count <= drained {
            return Err(SimError::NoWorkers);
        }
        let mut engines = Vec::with_capacity(count);
        let mut index = HashMap::with_capacity(count);
        for (i, worker) in workers.iter().enumerate() {
            let model = if i < slow {
                slowed(&config.model, config.slow_factor)
            } else {
                config.model.clone()
            };
            let mut engine = Engine::with_pd(model, pd(i));
            engine.set_token_events(false);
            engines.push(engine);
            index.insert(worker.key().into(), i);
        }
        let mut others = Vec::with_capacity(replicas.len());
        for replica in replicas {
            let mut by_engine: Vec<Option<Arc<Worker>>> = vec![None; count];
            for worker in replica.iter() {
                let i = index.get(worker.key()).copied().ok_or_else(|| {
                    SimError::Worker(format!("replica worker {} has no engine", worker.key()))
                })?;
                by_engine[i] = Some(Arc::clone(worker));
            }
            let by_engine = by_engine
                .into_iter()
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    SimError::Worker("a replica lacks a worker for some engine".to_owned())
                })?;
            others.push(by_engine);
        }
        for i in count - drained..count {
            workers[i].start_drain();
            for replica in &others {
                replica[i].start_drain();
            }
        }
        Ok(Pool {
            engines,
            candidates: workers,
            others,
            index,
            steps: vec![None; count],
            busy: vec![Duration::ZERO; count],
        })
    }

    /// Replica `replica`'s worker for engine `i`.
    pub(crate) fn worker(&self, replica: usize, i: usize) -> &Arc<Worker> {
        match replica {
            0 => &self.candidates[i],
            r => &self.others[r - 1][i],
        }
    }

    /// The engine behind `worker`.
    pub(crate) fn engine_of(&self, worker: &Worker) -> Option<usize> {
        self.index.get(worker.key()).copied()
    }

    /// Engine `i`'s true in-flight load: the sum over the router
    /// replicas' workers (each replica counts only its own requests).
    pub(crate) fn load(&self, i: usize) -> usize {
        // `Worker::load`, the guards' count: through `Arc`, `.load()` would
        // be lb-policies' `Backend::load`, the replica's estimate.
        Worker::load(&self.candidates[i])
            + self
                .others
                .iter()
                .map(|r| Worker::load(&r[i]))
                .sum::<usize>()
    }

    /// Accounts engine `i`'s busy time after an operation at `now`: a step
    /// that ended is added, a step that started is remembered. Steps start
    /// only at an operation (a submit to an idle engine, or the end of the
    /// previous step), so this sees every one.
    pub(crate) fn observe(&mut self, i: usize, now: Duration) {
        let current = self.engines[i].next_step_end();
        match self.steps[i] {
            Some((start, end)) if current != Some(end) => {
                self.busy[i] += end.saturating_sub(start);
                self.steps[i] = current.map(|end| (now, end));
            }
            None => self.steps[i] = current.map(|end| (now, end)),
            Some(_) => {}
        }
    }

    pub(crate) fn next_event(&self) -> Option<(Duration, usize)> {
        self.engines
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.next_event_time().map(|t| (t, i)))
            .min()
    }
}
