//! The sans-IO engine model on a virtual clock.
//!
//! [`Engine`] knows nothing about sockets or wall time: the caller submits
//! requests at a model time, advances the clock, and drains events. The
//! HTTP server drives one per port in real time; the routing-quality
//! simulator drives many in one discrete-event loop.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::cache::KvCache;
use crate::config::{ModelConfig, MoriIoMode, Role, TransferFormat};
use crate::kv::{KvBatch, group_admission};
use crate::tokens::{block_hashes, sequence_hash};
use crate::transfer::{
    Claim, InvalidTransfer, KvTransferParams, ProducedTransfer, ProducerAddress, TransferRegistry,
    produced_params, well_formed,
};

/// A caller-chosen request id, unique among the engine's live requests.
pub type RequestId = u64;

/// A request as the engine model sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRequest {
    /// Unique among live requests.
    pub id: RequestId,
    /// The prompt's token ids (see [`crate::tokens`]).
    pub prompt: Vec<u32>,
    /// Output tokens to generate (at least 1).
    pub max_tokens: u32,
    /// The request's `kv_transfer_params`, if any.
    pub kv_transfer_params: Option<KvTransferParams>,
}

impl SimRequest {
    /// A plain request with no transfer parameters.
    pub fn new(id: RequestId, prompt: Vec<u32>, max_tokens: u32) -> Self {
        SimRequest {
            id,
            prompt,
            max_tokens,
            kv_transfer_params: None,
        }
    }
}

/// The outcome of a decode engine's check of received transfer parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransferOutcome {
    /// The transfer matched; this many prompt tokens came from the prefill
    /// engine instead of being computed.
    Valid {
        /// Prompt tokens received.
        transferred_tokens: usize,
    },
    /// The parameters were missing or did not match; the prompt is
    /// recomputed locally, as vLLM does when a transfer fails.
    Invalid(InvalidTransfer),
}

/// What a finished request reports.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSummary {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache or a KV transfer.
    pub cached_tokens: usize,
    /// Output tokens generated.
    pub completion_tokens: u32,
    /// [`sequence_hash`] of the prompt (seeds the output text).
    pub prompt_hash: u64,
    /// Model time of submission.
    pub arrival: Duration,
    /// Model time of the first output token.
    pub first_token_at: Duration,
    /// Model time of the last output token.
    pub finished_at: Duration,
    /// `kv_transfer_params` for the decode leg (prefill role only).
    pub kv_transfer_params: Option<Value>,
    /// The transfer check (decode role only).
    pub transfer: Option<TransferOutcome>,
}

impl RequestSummary {
    /// Time to first token.
    pub fn ttft(&self) -> Duration {
        self.first_token_at.saturating_sub(self.arrival)
    }

    /// End-to-end latency.
    pub fn e2e(&self) -> Duration {
        self.finished_at.saturating_sub(self.arrival)
    }
}

/// What happened to a request.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum EventKind {
    /// Output token `index` (0 is the first token) was produced.
    Token {
        /// 0-based output position.
        index: u32,
    },
    /// The request produced its last token.
    Finished(Box<RequestSummary>),
}

/// One event, stamped with the model time it happened.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineEvent {
    /// The request.
    pub id: RequestId,
    /// Model time.
    pub at: Duration,
    /// What happened.
    pub kind: EventKind,
}

/// Why a request was refused at submission.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` was 0.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// Prompt plus output exceed the model's context length.
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested {requested} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion."
    )]
    ContextTooLong {
        /// The model's limit.
        max_model_len: usize,
        /// Prompt plus output.
        requested: usize,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Output tokens.
        max_tokens: u32,
    },
    /// The request needs more KV blocks than the engine has.
    #[error("the request needs {needed} KV blocks but the engine has {capacity}")]
    ExceedsKvCapacity {
        /// Blocks needed.
        needed: usize,
        /// Blocks in the engine.
        capacity: usize,
    },
    /// A live request already has this id.
    #[error("request id {0} is already in use")]
    DuplicateId(RequestId),
}

/// Counters and gauges, as `/metrics` reports them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    /// Requests in the running batch.
    pub running: usize,
    /// Requests in the FIFO waiting queue.
    pub waiting: usize,
    /// Fraction of KV blocks referenced (0..=1).
    pub kv_cache_usage: f64,
    /// Tokens per KV block (the configured block size).
    pub block_size: usize,
    /// The KV capacity in blocks (vLLM's `num_gpu_blocks`).
    pub num_gpu_blocks: usize,
    /// KV blocks holding a prefix hash.
    pub cached_blocks: usize,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: u64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_cache_hits: u64,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Output tokens generated.
    pub generation_tokens: u64,
    /// Requests finished.
    pub requests_finished: u64,
    /// Requests aborted by the caller.
    pub requests_aborted: u64,
    /// Transfers a prefill engine produced.
    pub kv_transfers_produced: u64,
    /// Transfers a prefill engine still keeps blocks for.
    pub kv_transfers_held: usize,
    /// Valid transfers a decode engine received.
    pub kv_transfers_valid: u64,
    /// Invalid transfers a decode engine received, by reason.
    pub kv_transfers_invalid: BTreeMap<&'static str, u64>,
}

impl EngineStats {
    /// All invalid transfers, whatever the reason.
    pub fn kv_transfers_invalid_total(&self) -> u64 {
        self.kv_transfers_invalid.values().sum()
    }
}

/// The P/D identity of an engine model.
#[derive(Debug, Clone, Default)]
pub struct PdSettings {
    /// The role.
    pub role: Role,
    /// The connector format.
    pub connector: TransferFormat,
    /// The MoRI-IO mode.
    pub moriio_mode: MoriIoMode,
    /// Where this engine says its KV lives (prefill role).
    pub address: ProducerAddress,
    /// The shared registry, for engines in one process; `None` accepts any
    /// well-formed parameters.
    pub registry: Option<Arc<TransferRegistry>>,
}

#[derive(Debug)]
struct Seq {
    id: RequestId,
    prompt_len: usize,
    prompt_hash: u64,
    hashes: Vec<u64>,
    /// The prompt's ids, kept until admission only while KV events are
    /// recorded (a `BlockStored` carries its blocks' tokens).
    prompt: Vec<u32>,
    max_tokens: u32,
    arrival: Duration,
    generated: u32,
    blocks: Vec<u32>,
    cached_tokens: usize,
    first_token_at: Duration,
    /// Prefill role: the transfer id the router gave (Some(None) = no id).
    remote_decode: Option<Option<String>>,
    transfer: Option<TransferOutcome>,
}

#[derive(Debug)]
struct Held {
    request_id: RequestId,
    blocks: Vec<u32>,
    expires_at: Duration,
}

/// One engine: prefix cache, scheduler and latency model.
#[derive(Debug)]
pub struct Engine {
    config: ModelConfig,
    pd: PdSettings,
    now: Duration,
    cache: KvCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    step_ends_at: Option<Duration>,
    held: Vec<Held>,
    events: VecDeque<EngineEvent>,
    token_events: bool,
    kv_batches: VecDeque<KvBatch>,
    stats: EngineStats,
}

impl Engine {
    /// A regular engine (no P/D role).
    pub fn new(config: ModelConfig) -> Self {
        Engine::with_pd(config, PdSettings::default())
    }

    /// An engine with a P/D role. A prefill engine registers itself with
    /// the shared registry, if any.
    pub fn with_pd(config: ModelConfig, pd: PdSettings) -> Self {
        if let (Role::Prefill, Some(registry)) = (pd.role, &pd.registry) {
            registry.register_engine(&pd.address.engine_id, pd.connector);
        }
        Engine {
            cache: KvCache::new(config.num_blocks),
            config,
            pd,
            now: Duration::ZERO,
            waiting: VecDeque::new(),
            running: Vec::new(),
            step_ends_at: None,
            held: Vec::new(),
            events: VecDeque::new(),
            token_events: true,
            kv_batches: VecDeque::new(),
            stats: EngineStats::default(),
        }
    }

    /// The model configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The P/D settings.
    pub fn pd(&self) -> &PdSettings {
        &self.pd
    }

    /// Turns per-token events on (the default) or off; a simulator that
    /// only needs TTFT and completion saves the allocations.
    /// [`EventKind::Token`] with index 0 is still emitted when off.
    pub fn set_token_events(&mut self, on: bool) {
        self.token_events = on;
    }

    /// Turns the recording of the prefix cache's changes on or off (off by
    /// default). On, every scheduler step that stores or evicts cached
    /// blocks leaves one [`KvBatch`] for [`drain_kv_batches`](Self::drain_kv_batches):
    /// what vLLM publishes as one batch of KV-cache events. Turning it off
    /// drops undrained batches.
    pub fn set_kv_events(&mut self, on: bool) {
        self.cache.set_event_recording(on);
        if !on {
            self.kv_batches.clear();
        }
    }

    /// Takes the recorded per-step batches of KV-cache events, oldest
    /// first.
    pub fn drain_kv_batches(&mut self) -> std::collections::vec_deque::Drain<'_, KvBatch> {
        self.kv_batches.drain(..)
    }

    /// The current model time.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// The prefix cache (read-only).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Prompt tokens of `prompt` that the prefix cache would serve now.
    pub fn cached_prefix_tokens(&self, prompt: &[u32]) -> usize {
        let hashes = block_hashes(prompt, self.config.block_size);
        let max_hit = prompt.len().saturating_sub(1) / self.config.block_size.max(1);
        self.cache.prefix_hits(&hashes).min(max_hit) * self.config.block_size.max(1)
    }

    /// Live requests (waiting plus running).
    pub fn in_flight(&self) -> usize {
        self.waiting.len() + self.running.len()
    }

    /// Requests admitted but not yet scheduled (vLLM's
    /// `vllm:num_requests_waiting`): a part of [`in_flight`](Self::in_flight).
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// A snapshot of the counters and gauges.
    pub fn stats(&self) -> EngineStats {
        let mut stats = self.stats.clone();
        stats.running = self.running.len();
        stats.waiting = self.waiting.len();
        stats.kv_cache_usage = self.cache.usage();
        stats.block_size = self.config.block_size;
        stats.num_gpu_blocks = self.config.num_blocks;
        stats.cached_blocks = self.cache.cached_blocks();
        stats.kv_transfers_held = self.held.len();
        stats
    }

    /// When the current scheduler step ends, if one is running.
    pub fn next_step_end(&self) -> Option<Duration> {
        self.step_ends_at
    }

    /// When the next thing happens by itself (a step ends or a held
    /// transfer expires), or `None` when idle.
    pub fn next_event_time(&self) -> Option<Duration> {
        let hold = self.held.iter().map(|h| h.expires_at).min();
        match (self.step_ends_at, hold) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Takes the events produced so far, oldest first.
    pub fn drain_events(&mut self) -> std::collections::vec_deque::Drain<'_, EngineEvent> {
        self.events.drain(..)
    }

    /// Submits a request at model time `now` (clamped to be no earlier than
    /// the engine's clock). The engine first advances to `now`.
    pub fn submit(&mut self, now: Duration, request: SimRequest) -> Result<(), SubmitError> {
        self.advance_to(now);
        let prompt_len = request.prompt.len();
        if prompt_len == 0 {
            return Err(SubmitError::EmptyPrompt);
        }
        let remote_decode = self.pd.role == Role::Prefill
            && request
                .kv_transfer_params
                .as_ref()
                .is_some_and(|p| p.do_remote_decode);
        // A prefill leg returns exactly one token, whatever was asked.
        let max_tokens = if remote_decode { 1 } else { request.max_tokens };
        if max_tokens == 0 {
            return Err(SubmitError::ZeroMaxTokens);
        }
        let requested = prompt_len + max_tokens as usize;
        if requested > self.config.max_model_len {
            return Err(SubmitError::ContextTooLong {
                max_model_len: self.config.max_model_len,
                requested,
                prompt_tokens: prompt_len,
                max_tokens,
            });
        }
        let needed = requested.div_ceil(self.config.block_size.max(1));
        if needed > self.cache.capacity() {
            return Err(SubmitError::ExceedsKvCapacity {
                needed,
                capacity: self.cache.capacity(),
            });
        }
        if self
            .waiting
            .iter()
            .chain(&self.running)
            .any(|s| s.id == request.id)
            || self.held.iter().any(|h| h.request_id == request.id)
        {
            return Err(SubmitError::DuplicateId(request.id));
        }
        let prompt_hash = sequence_hash(&request.prompt);
        let hashes = block_hashes(&request.prompt, self.config.block_size);
        let prompt = if self.cache.records_events() {
            request.prompt
        } else {
            Vec::new()
        };
        let transfer = (self.pd.role == Role::Decode)
            .then(|| self.check_transfer(request.kv_transfer_params.as_ref(), prompt_hash));
        match transfer {
            Some(TransferOutcome::Valid { .. }) => self.stats.kv_transfers_valid += 1,
            Some(TransferOutcome::Invalid(reason)) => {
                *self
                    .stats
                    .kv_transfers_invalid
                    .entry(reason.label())
                    .or_default() += 1;
            }
            None => {}
        }
        let remote_decode = remote_decode.then(|| {
            request
                .kv_transfer_params
                .as_ref()
                .and_then(|p| p.transfer_id.clone())
        });
        self.waiting.push_back(Seq {
            id: request.id,
            prompt_len,
            prompt_hash,
            hashes,
            prompt,
            max_tokens,
            arrival: self.now,
            generated: 0,
            blocks: Vec::new(),
            cached_tokens: 0,
            first_token_at: Duration::ZERO,
            remote_decode,
            transfer,
        });
        if self.step_ends_at.is_none() {
            self.start_step();
        }
        Ok(())
    }

    fn check_transfer(
        &self,
        params: Option<&KvTransferParams>,
        prompt_hash: u64,
    ) -> TransferOutcome {
        let Some(params) = params else {
            return TransferOutcome::Invalid(InvalidTransfer::Missing);
        };
        let checked = match &self.pd.registry {
            Some(registry) => registry
                .claim(Claim {
                    connector: self.pd.connector,
                    moriio_mode: self.pd.moriio_mode,
                    params,
                    prompt_hash,
                })
                .map(|_| ()),
            None => well_formed(self.pd.connector, self.pd.moriio_mode, params),
        };
        match checked {
            // Every prompt token but the one a step must compute arrives
            // over the connector; the count is settled at admission.
            Ok(()) => TransferOutcome::Valid {
                transferred_tokens: 0,
            },
            Err(reason) => TransferOutcome::Invalid(reason),
        }
    }

    /// Cancels a live request and frees its blocks. Returns whether it was
    /// live. No event is emitted.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let seq = if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i)
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            Some(self.running.remove(i))
        } else {
            None
        };
        match seq {
            Some(seq) => {
                self.cache.release(&seq.blocks);
                self.stats.requests_aborted += 1;
                if self.running.is_empty() && self.step_ends_at.is_some() {
                    // Nothing left in the batch: the step's work is moot.
                    self.step_ends_at = None;
                    self.start_step();
                }
                true
            }
            None => false,
        }
    }

    /// Advances the model clock to `t`, completing every step that ends by
    /// then. Time never goes backwards: an earlier `t` only processes
    /// pending releases.
    pub fn advance_to(&mut self, t: Duration) {
        self.collect_released();
        while let Some(end) = self.step_ends_at.filter(|&end| end <= t) {
            self.now = self.now.max(end);
            self.expire_holds();
            self.finish_step();
            self.start_step();
        }
        self.now = self.now.max(t);
        self.expire_holds();
        if self.step_ends_at.is_none() {
            self.start_step();
        }
    }

    fn collect_released(&mut self) {
        let Some(registry) = &self.pd.registry else {
            return;
        };
        if self.held.is_empty() {
            return;
        }
        let released = registry.take_released(&self.pd.address.engine_id);
        if released.is_empty() {
            return;
        }
        let mut freed = false;
        self.held.retain(|h| {
            let claimed = released.contains(&h.request_id);
            if claimed {
                self.cache.release(&h.blocks);
                freed = true;
            }
            !claimed
        });
        if freed && self.step_ends_at.is_none() {
            self.start_step();
        }
    }

    fn expire_holds(&mut self) {
        let now = self.now;
        let registry = self.pd.registry.clone();
        let engine_id = &self.pd.address.engine_id;
        let cache = &mut self.cache;
        self.held.retain(|h| {
            let expired = h.expires_at <= now;
            if expired {
                cache.release(&h.blocks);
                if let Some(registry) = &registry {
                    registry.withdraw(engine_id, h.request_id);
                }
            }
            !expired
        });
    }

    /// Admits waiting requests (FIFO, while `max_num_seqs` and the KV cache
    /// allow) and starts a step if there is any work.
    fn start_step(&mut self) {
        debug_assert!(self.step_ends_at.is_none());
        let block = self.config.block_size.max(1);
        let decoding = self.running.len();
        let mut admitted = 0usize;
        let mut uncached_tokens = 0usize;
        let mut transferred_tokens = 0usize;
        let mut kv_events_of_step = Vec::new();
        while self.running.len() < self.config.max_num_seqs.max(1) {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            let total_blocks = (seq.prompt_len + seq.max_tokens as usize).div_ceil(block);
            let extra = total_blocks - seq.hashes.len();
            // vLLM always computes the last prompt token, so a fully cached
            // prompt still misses its last block.
            let max_hit = (seq.prompt_len - 1) / block;
            let Some(allocation) = self.cache.allocate(&seq.hashes, max_hit, extra) else {
                break;
            };
            let mut seq = self.waiting.pop_front().expect("front exists");
            if self.cache.records_events() {
                group_admission(
                    self.cache.drain_events(),
                    &seq.prompt,
                    block,
                    &mut kv_events_of_step,
                );
            }
            seq.prompt = Vec::new();
            let hit_tokens = allocation.hit_blocks * block;
            seq.blocks = allocation.block_ids;
            self.stats.prefix_cache_queries += seq.prompt_len as u64;
            self.stats.prefix_cache_hits += hit_tokens as u64;
            self.stats.prompt_tokens += seq.prompt_len as u64;
            match &mut seq.transfer {
                Some(TransferOutcome::Valid {
                    transferred_tokens: t,
                }) => {
                    *t = seq.prompt_len - hit_tokens;
                    transferred_tokens += *t;
                    seq.cached_tokens = seq.prompt_len;
                }
                _ => {
                    uncached_tokens += seq.prompt_len - hit_tokens;
                    seq.cached_tokens = hit_tokens;
                }
            }
            admitted += 1;
            self.running.push(seq);
        }
        if !kv_events_of_step.is_empty() {
            self.kv_batches.push_back(KvBatch {
                at: self.now,
                events: kv_events_of_step,
            });
        }
        let mut duration = Duration::ZERO;
        if admitted > 0 {
            duration += self.config.prefill_base
                + mul(self.config.prefill_per_token, uncached_tokens)
                + mul(self.config.kv_transfer_per_token, transferred_tokens);
        }
        if decoding > 0 {
            duration += self.config.decode_base + mul(self.config.decode_per_seq, decoding);
        }
        self.step_ends_at = (admitted > 0 || decoding > 0).then_some(self.now + duration);
    }

    /// Every running sequence gets one token; finished ones leave.
    fn finish_step(&mut self) {
        self.step_ends_at = None;
        let now = self.now;
        let mut i = 0;
        while i < self.running.len() {
            let seq = &mut self.running[i];
            let index = seq.generated;
            seq.generated += 1;
            if index == 0 {
                seq.first_token_at = now;
            }
            self.stats.generation_tokens += 1;
            if self.token_events || index == 0 {
                self.events.push_back(EngineEvent {
                    id: seq.id,
                    at: now,
                    kind: EventKind::Token { index },
                });
            }
            if seq.generated >= seq.max_tokens {
                let seq = self.running.swap_remove(i);
                self.finish(seq);
            } else {
                i += 1;
            }
        }
    }

    fn finish(&mut self, seq: Seq) {
        let now = self.now;
        let block = self.config.block_size.max(1);
        let mut kv_transfer_params = None;
        match &seq.remote_decode {
            Some(transfer_id) => {
                let prompt_blocks = seq.prompt_len.div_ceil(block).min(seq.blocks.len());
                let (kept, rest) = seq.blocks.split_at(prompt_blocks);
                self.cache.release(rest);
                let transfer_id = transfer_id
                    .clone()
                    .unwrap_or_else(|| format!("{}-{}", self.pd.address.engine_id, seq.id));
                kv_transfer_params = Some(produced_params(
                    self.pd.connector,
                    self.pd.moriio_mode,
                    &self.pd.address,
                    Some(&transfer_id),
                    kept,
                ));
                if let Some(registry) = &self.pd.registry {
                    registry.publish(ProducedTransfer {
                        engine_id: self.pd.address.engine_id.clone(),
                        request_id: seq.id,
                        transfer_id: (self.pd.connector != TransferFormat::Nixl)
                            .then_some(transfer_id),
                        block_ids: kept.to_vec(),
                        prompt_hash: seq.prompt_hash,
                    });
                }
                self.held.push(Held {
                    request_id: seq.id,
                    blocks: kept.to_vec(),
                    expires_at: now + self.config.kv_hold_timeout,
                });
                self.stats.kv_transfers_produced += 1;
            }
            None => self.cache.release(&seq.blocks),
        }
        self.stats.requests_finished += 1;
        self.events.push_back(EngineEvent {
            id: seq.id,
            at: now,
            kind: EventKind::Finished(Box::new(RequestSummary {
                prompt_tokens: seq.prompt_len,
                cached_tokens: seq.cached_tokens,
                completion_tokens: seq.generated,
                prompt_hash: seq.prompt_hash,
                arrival: seq.arrival,
                first_token_at: seq.first_token_at,
                finished_at: now,
                kv_transfer_params,
                transfer: seq.transfer,
            })),
        });
    }
}

fn mul(d: Duration, n: usize) -> Duration {
    d.saturating_mul(u32::try_from(n).unwrap_or(u32::MAX))
}
