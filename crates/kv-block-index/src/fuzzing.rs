//! Fuzzing and model-testing entry points.
//!
//! [`Model`] is the reference: per (worker, rank) stream an ordered map of
//! engine hash -> our hash and the list of its engine hashes in the order
//! the stream began to hold them (a stream over its worker's cap drops the
//! front of the list, found naively), from which the holders of every block
//! (`BTreeMap<our hash, BTreeSet<(worker, rank)>>`) and every prefix length
//! are recomputed naively. [`check_ops`] applies an operation sequence to a
//! [`KvIndex`] and the model and panics at the first disagreement (holders
//! of every block of a small universe of prompts, lookups of every prompt,
//! pair and block counts, event counters). [`kv_index_ops`] decodes
//! arbitrary bytes into such a sequence; the cargo-fuzz target
//! `kv_index_ops` and the crate's tests call it.
//!
//! The universe: [`WORKERS`] workers with two ranks each, [`PROMPTS`]
//! prompts of [`PROMPT_BLOCKS`] blocks of [`BLOCK_SIZE`] tokens that share
//! leading blocks (prompt 1 shares two blocks with prompt 0, prompt 2
//! shares four), engine hashes that depend on the prompt (so two engine
//! hashes can name one block of ours) and a salt (so a parent can be
//! unknown). Streams hold at most [`HARNESS_CAP`] blocks unless an
//! [`Op::SetCapacity`] sets their worker's cap, so caps are hit often.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroUsize;

use crate::hash::{BlockHash, BlockHasher, EngineHash};
use crate::index::{Holder, IndexConfig, KvEvent, KvIndex, KvIndexError, WorkerId};

/// Tokens per block in the harness.
pub const BLOCK_SIZE: usize = 4;
/// Workers the harness may register.
pub const WORKERS: u8 = 3;
/// Prompts of the universe.
pub const PROMPTS: u8 = 3;
/// Blocks per prompt.
pub const PROMPT_BLOCKS: u8 = 6;
/// The harness's default cap per (worker, rank) stream: below the 36
/// engine hashes a stream can hold (3 prompts x 6 blocks x 2 salts), above
/// one prompt.
pub const HARNESS_CAP: usize = 10;
/// The largest cap [`Op::SetCapacity`] sets.
pub const MAX_SET_CAP: u8 = 40;

/// One operation of a model test.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `register_worker(worker)`.
    Register(u8),
    /// `unregister_worker(worker)`.
    Unregister(u8),
    /// A `BlockStored` of blocks `start..start + len` of `prompt`.
    Stored {
        /// Worker index.
        worker: u8,
        /// Data-parallel rank (0 or 1).
        rank: u8,
        /// Prompt index.
        prompt: u8,
        /// First block.
        start: u8,
        /// Number of blocks.
        len: u8,
        /// Salt of the engine hashes (0 or 1): a parent stored under
        /// another salt is unknown.
        salt: u8,
        /// Under LoRA adapter 1 instead of the base model.
        lora: bool,
        /// Report a wrong block size (a malformed event).
        bad_size: bool,
    },
    /// A `BlockRemoved` of blocks `start..start + len` of `prompt`.
    Removed {
        /// Worker index.
        worker: u8,
        /// Data-parallel rank.
        rank: u8,
        /// Prompt index.
        prompt: u8,
        /// First block.
        start: u8,
        /// Number of blocks.
        len: u8,
        /// Salt of the engine hashes.
        salt: u8,
    },
    /// `AllBlocksCleared` on one stream.
    Cleared {
        /// Worker index.
        worker: u8,
        /// Data-parallel rank.
        rank: u8,
    },
    /// `clear_worker(worker)`.
    ClearWorker(u8),
    /// `set_worker_capacity(worker, blocks)` (0 is raised to 1).
    SetCapacity {
        /// Worker index.
        worker: u8,
        /// The cap.
        blocks: u8,
    },
}

impl Op {
    /// The cap a [`Op::SetCapacity`] of `blocks` sets.
    pub fn cap_of(blocks: u8) -> NonZeroUsize {
        NonZeroUsize::new(usize::from(blocks).max(1)).unwrap_or(NonZeroUsize::MIN)
    }
}

/// The token ids of block `block` of `prompt`.
pub fn prompt_block_tokens(prompt: u8, block: u8) -> [u32; BLOCK_SIZE] {
    // Prompt 1 shares blocks 0..2 with prompt 0, prompt 2 shares 0..4.
    let shared = match prompt {
        0 => PROMPT_BLOCKS,
        1 => 2,
        _ => 4,
    };
    let owner = if block < shared { 0 } else { prompt };
    let base = u32::from(owner) * 1000 + u32::from(block) * 10;
    [base, base + 1, base + 2, base + 3]
}

/// The token ids of a whole prompt.
pub fn prompt_tokens(prompt: u8) -> Vec<u32> {
    (0..PROMPT_BLOCKS)
        .flat_map(|b| prompt_block_tokens(prompt, b))
        .collect()
}

/// The engine hash the harness's engines give block `block` of `prompt`.
pub fn engine_hash(prompt: u8, block: u8, salt: u8) -> EngineHash {
    EngineHash::from_int(i64::from(prompt) * 100 + i64::from(block) + i64::from(salt) * 10_000)
}

/// The harness's index configuration.
pub fn config() -> IndexConfig {
    IndexConfig {
        block_size: BLOCK_SIZE,
        max_holders: 64,
        max_blocks_per_holder: NonZeroUsize::new(HARNESS_CAP).unwrap_or(NonZeroUsize::MIN),
    }
}

/// Builds the event of a `Stored` or `Removed` op (other ops: `None`).
pub fn event_of(op: &Op) -> Option<KvEvent> {
    match *op {
        Op::Stored {
            prompt,
            start,
            len,
            salt,
            lora,
            bad_size,
            ..
        } => {
            let end = start.saturating_add(len).min(PROMPT_BLOCKS);
            let blocks = start.min(end)..end;
            Some(KvEvent::BlockStored {
                block_hashes: blocks
                    .clone()
                    .map(|b| engine_hash(prompt, b, salt))
                    .collect(),
                parent_block_hash: start.checked_sub(1).map(|p| engine_hash(prompt, p, salt)),
                token_ids: blocks
                    .flat_map(|b| prompt_block_tokens(prompt, b))
                    .collect(),
                block_size: if bad_size { BLOCK_SIZE + 1 } else { BLOCK_SIZE },
                lora_id: lora.then_some(1),
            })
        }
        Op::Removed {
            prompt,
            start,
            len,
            salt,
            ..
        } => {
            let end = start.saturating_add(len).min(PROMPT_BLOCKS);
            Some(KvEvent::BlockRemoved {
                block_hashes: (start.min(end)..end)
                    .map(|b| engine_hash(prompt, b, salt))
                    .collect(),
            })
        }
        _ => None,
    }
}

/// The reference model: plain ordered maps, recomputed on every question.
#[derive(Clone, Debug)]
pub struct Model {
    /// Registered worker ids.
    pub registered: BTreeSet<u32>,
    /// Per (worker id, rank): engine hash -> our hash.
    pub streams: BTreeMap<(u32, u32), BTreeMap<u64, u64>>,
    /// Per (worker id, rank): its engine hashes, in the order it began to
    /// hold them (oldest first).
    pub orders: BTreeMap<(u32, u32), Vec<u64>>,
    /// The cap of a worker without its own.
    pub default_cap: usize,
    /// Per worker id: its own cap.
    pub caps: BTreeMap<u32, usize>,
    /// Per worker id: engine blocks dropped over the cap.
    pub evicted: BTreeMap<u32, u64>,
    /// Expected counters: engine blocks dropped over caps (all workers
    /// ever).
    pub evicted_total: u64,
    /// Expected counters: unknown-parent blocks.
    pub unknown_parent: u64,
    /// Expected counters: unknown removed hashes.
    pub unknown_removed: u64,
    /// Expected counters: malformed blocks.
    pub malformed: u64,
}

impl Default for Model {
    /// A model with [`IndexConfig::default`]'s cap (not the harness's).
    fn default() -> Self {
        Self::with_cap(crate::index::DEFAULT_MAX_BLOCKS_PER_HOLDER.get())
    }
}

impl Model {
    /// An empty model whose workers hold at most `default_cap` blocks per
    /// stream.
    pub fn with_cap(default_cap: usize) -> Self {
        Self {
            registered: BTreeSet::new(),
            streams: BTreeMap::new(),
            orders: BTreeMap::new(),
            default_cap,
            caps: BTreeMap::new(),
            evicted: BTreeMap::new(),
            evicted_total: 0,
            unknown_parent: 0,
            unknown_removed: 0,
            malformed: 0,
        }
    }

    /// The cap of `worker`'s streams.
    pub fn cap(&self, worker: u32) -> usize {
        self.caps.get(&worker).copied().unwrap_or(self.default_cap)
    }

    /// Drops the oldest blocks of stream `key` while it holds more than its
    /// worker's cap.
    fn evict(&mut self, key: (u32, u32)) {
        let cap = self.cap(key.0);
        let (Some(map), Some(order)) = (self.streams.get_mut(&key), self.orders.get_mut(&key))
        else {
            return;
        };
        while map.len() > cap && !order.is_empty() {
            let oldest = order.remove(0);
            map.remove(&oldest);
            *self.evicted.entry(key.0).or_default() += 1;
            self.evicted_total += 1;
        }
    }

    /// `set_worker_capacity`: `false` if the worker is not registered.
    pub fn set_capacity(&mut self, worker: u32, cap: usize) -> bool {
        if !self.registered.contains(&worker) {
            return false;
        }
        self.caps.insert(worker, cap);
        let keys: Vec<(u32, u32)> = self
            .streams
            .keys()
            .filter(|(w, _)| *w == worker)
            .copied()
            .collect();
        for key in keys {
            self.evict(key);
        }
        true
    }

    /// Applies an event; `false` if the worker is not registered.
    pub fn apply(&mut self, worker: u32, rank: u32, event: &KvEvent) -> bool {
        if !self.registered.contains(&worker) {
            return false;
        }
        let order = self.orders.entry((worker, rank)).or_default();
        let map = self.streams.entry((worker, rank)).or_default();
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
            } => {
                let hasher = BlockHasher::new(BLOCK_SIZE).with_lora(*lora_id);
                if *block_size != BLOCK_SIZE || token_ids.len() != block_hashes.len() * BLOCK_SIZE {
                    self.malformed += block_hashes.len() as u64;
                    return true;
                }
                let mut parent = match parent_block_hash {
                    None => hasher.root(),
                    Some(e) => match map.get(&e.0) {
                        Some(&h) => BlockHash(h),
                        None => {
                            self.unknown_parent += block_hashes.len() as u64;
                            return true;
                        }
                    },
                };
                for (e, tokens) in block_hashes.iter().zip(token_ids.chunks(BLOCK_SIZE)) {
                    parent = hasher.next(parent, tokens);
                    if map.insert(e.0, parent.0).is_none() {
                        order.push(e.0);
                    }
                }
                self.evict((worker, rank));
            }
            KvEvent::BlockRemoved { block_hashes } => {
                for e in block_hashes {
                    if map.remove(&e.0).is_none() {
                        self.unknown_removed += 1;
                    } else {
                        order.retain(|&x| x != e.0);
                    }
                }
            }
            KvEvent::AllBlocksCleared => {
                map.clear();
                order.clear();
            }
        }
        true
    }

    /// Drops every stream of a worker; `false` if not registered.
    pub fn clear_worker(&mut self, worker: u32) -> bool {
        if !self.registered.contains(&worker) {
            return false;
        }
        for ((w, _), map) in self.streams.iter_mut() {
            if *w == worker {
                map.clear();
            }
        }
        for ((w, _), order) in self.orders.iter_mut() {
            if *w == worker {
                order.clear();
            }
        }
        true
    }

    /// Forgets a worker.
    pub fn unregister(&mut self, worker: u32) -> bool {
        self.streams.retain(|(w, _), _| *w != worker);
        self.orders.retain(|(w, _), _| *w != worker);
        self.caps.remove(&worker);
        self.evicted.remove(&worker);
        self.registered.remove(&worker)
    }

    /// Our hash -> holders, recomputed from the streams.
    pub fn holders(&self) -> BTreeMap<u64, BTreeSet<(u32, u32)>> {
        let mut out: BTreeMap<u64, BTreeSet<(u32, u32)>> = BTreeMap::new();
        for (&stream, map) in &self.streams {
            for &ours in map.values() {
                out.entry(ours).or_default().insert(stream);
            }
        }
        out
    }

    /// Every holder's longest held prefix of `hashes` (holders of at least
    /// the first block).
    pub fn prefixes(&self, hashes: &[BlockHash]) -> BTreeMap<(u32, u32), usize> {
        let holders = self.holders();
        let mut out = BTreeMap::new();
        let empty = BTreeSet::new();
        let Some(first) = hashes.first() else {
            return out;
        };
        for &stream in holders.get(&first.0).unwrap_or(&empty) {
            let len = hashes
                .iter()
                .take_while(|h| holders.get(&h.0).is_some_and(|s| s.contains(&stream)))
                .count();
            out.insert(stream, len);
        }
        out
    }
}

/// An index and its model, driven by [`Op`]s.
#[derive(Debug)]
pub struct Harness {
    /// The index under test.
    pub index: KvIndex<u8>,
    /// The reference.
    pub model: Model,
    /// The current id of each worker index.
    pub ids: [Option<WorkerId>; WORKERS as usize],
    /// Ids that were unregistered (for ops on a stale id).
    pub retired: Vec<WorkerId>,
}

impl Default for Harness {
    fn default() -> Self {
        Self::new()
    }
}

impl Harness {
    /// An empty index and model.
    pub fn new() -> Self {
        Self {
            index: KvIndex::new(config()),
            model: Model::with_cap(HARNESS_CAP),
            ids: [None; WORKERS as usize],
            retired: Vec::new(),
        }
    }

    /// The id an op on worker `w` uses: the registered one, else the last
    /// retired one (which both sides must refuse); `None` before any
    /// registration.
    fn id(&self, w: u8) -> Option<WorkerId> {
        self.ids[(w % WORKERS) as usize].or_else(|| self.retired.last().copied())
    }

    /// Applies one op to both sides and checks that they agree.
    pub fn step(&mut self, op: &Op) {
        match *op {
            Op::Register(w) => {
                let w = w % WORKERS;
                let id = self.index.register_worker(w);
                if let Some(old) = self.ids[w as usize] {
                    assert_eq!(old, id, "a registered key keeps its id");
                }
                self.ids[w as usize] = Some(id);
                self.model.registered.insert(id.get());
                assert_eq!(self.index.worker_id(&w), Some(id));
            }
            Op::Unregister(w) => {
                let Some(id) = self.id(w) else { return };
                let was = self.model.unregister(id.get());
                assert_eq!(self.index.unregister_worker(id), was);
                if was {
                    self.ids[(w % WORKERS) as usize] = None;
                    self.retired.push(id);
                    assert_eq!(self.index.worker_id(&(w % WORKERS)), None);
                }
            }
            Op::Stored { worker, rank, .. } | Op::Removed { worker, rank, .. } => {
                let Some(id) = self.id(worker) else { return };
                let rank = u32::from(rank % 2);
                let event = event_of(op).unwrap_or(KvEvent::AllBlocksCleared);
                let ok = self.model.apply(id.get(), rank, &event);
                let got = self.index.apply(id, rank, &event);
                match got {
                    Ok(_) => assert!(ok, "index accepted an event of {id:?}"),
                    Err(KvIndexError::UnknownWorker(w)) => {
                        assert!(!ok, "index refused {id:?}");
                        assert_eq!(w, id);
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Op::Cleared { worker, rank } => {
                let Some(id) = self.id(worker) else { return };
                let rank = u32::from(rank % 2);
                let ok = self.model.apply(id.get(), rank, &KvEvent::AllBlocksCleared);
                let got = self.index.stream(id, rank).and_then(|s| s.clear());
                assert_eq!(got.is_ok(), ok);
            }
            Op::ClearWorker(w) => {
                let Some(id) = self.id(w) else { return };
                let ok = self.model.clear_worker(id.get());
                assert_eq!(self.index.clear_worker(id).is_ok(), ok);
            }
            Op::SetCapacity { worker, blocks } => {
                let Some(id) = self.id(worker) else { return };
                let before = self.model.evicted_total;
                let cap = Op::cap_of(blocks);
                let ok = self.model.set_capacity(id.get(), cap.get());
                match self.index.set_worker_capacity(id, cap) {
                    Ok(dropped) => {
                        assert!(ok, "index accepted a cap for {id:?}");
                        assert_eq!(dropped, self.model.evicted_total - before);
                    }
                    Err(e) => {
                        assert!(!ok, "index refused a cap for {id:?}: {e}");
                        assert_eq!(e, KvIndexError::UnknownWorker(id));
                    }
                }
            }
        }
    }

    /// Checks every observable against the model.
    pub fn check(&self) {
        check_index(&self.index, &self.model);
    }
}

/// Checks every observable of `index` against `model`: the holders of every
/// block of the universe (base model and LoRA 1), lookups of every prompt
/// and of its prefixes, pair, block and entry counts, and the counters of
/// skipped events. Panics at the first disagreement.
pub fn check_index<K: std::hash::Hash + Eq + Clone>(index: &KvIndex<K>, model: &Model) {
    let expected = model.holders();
    let holder = |(w, r): (u32, u32)| (w, r);
    let mut universe: BTreeSet<u64> = BTreeSet::new();
    let mut prompts = Vec::new();
    for lora in [None, Some(1)] {
        let hasher = BlockHasher::new(BLOCK_SIZE).with_lora(lora);
        for p in 0..PROMPTS {
            let hashes = hasher.hash_blocks(&prompt_tokens(p));
            universe.extend(hashes.iter().map(|h| h.0));
            prompts.push(hashes);
        }
    }
    assert!(
        expected.keys().all(|k| universe.contains(k)),
        "the model holds a block outside the universe"
    );
    for &h in &universe {
        let got: BTreeSet<(u32, u32)> = index
            .holders_of(BlockHash(h))
            .into_iter()
            .map(|Holder { worker, rank }| (worker.get(), rank))
            .collect();
        let want: BTreeSet<(u32, u32)> = expected
            .get(&h)
            .map(|s| s.iter().copied().map(holder).collect())
            .unwrap_or_default();
        assert_eq!(got, want, "holders of block {h:#x}");
    }
    for hashes in &prompts {
        for end in [1, 3, hashes.len()] {
            let hashes = &hashes[..end];
            let want = model.prefixes(hashes);
            let found = index.lookup(hashes);
            let got: BTreeMap<(u32, u32), usize> = found
                .matches()
                .iter()
                .map(|m| ((m.holder.worker.get(), m.holder.rank), m.blocks))
                .collect();
            assert_eq!(got.len(), found.matches().len(), "a holder twice");
            assert_eq!(got, want, "prefixes of {hashes:?}");
            assert!(
                found
                    .matches()
                    .windows(2)
                    .all(|w| w[0].blocks >= w[1].blocks),
                "longest first"
            );
        }
    }
    let stats = index.stats();
    assert_eq!(
        stats.pairs,
        expected.values().map(BTreeSet::len).sum::<usize>()
    );
    assert_eq!(stats.blocks, expected.len());
    let entries: usize = model.streams.values().map(BTreeMap::len).sum();
    assert_eq!(
        stats.holders.iter().map(|h| h.blocks).sum::<usize>(),
        entries
    );
    for h in &stats.holders {
        let (w, r) = (h.holder.worker.get(), h.holder.rank);
        let cap = model.cap(w);
        assert_eq!(h.capacity, cap, "cap of {w}/{r}");
        assert!(
            h.blocks <= cap,
            "{w}/{r} holds {} over its cap {cap}",
            h.blocks
        );
        let want = model.streams.get(&(w, r)).map_or(0, BTreeMap::len);
        assert_eq!(h.blocks, want, "blocks of {w}/{r}");
    }
    for &w in &model.registered {
        let id = stats
            .holders
            .iter()
            .map(|h| h.holder.worker)
            .find(|id| id.get() == w);
        if let Some(id) = id {
            assert_eq!(
                index.evicted_over_cap(id),
                Some(model.evicted.get(&w).copied().unwrap_or(0)),
                "evicted over cap of worker {w}"
            );
            assert_eq!(index.worker_capacity(id), Some(model.cap(w)));
        }
    }
    let c = stats.counters;
    assert_eq!(c.unknown_parent_blocks, model.unknown_parent);
    assert_eq!(c.unknown_removed_blocks, model.unknown_removed);
    assert_eq!(c.malformed_blocks, model.malformed);
    assert_eq!(c.evicted_blocks, model.evicted_total);
}
/// Runs `ops` against the index and the model, checking after every step;
/// panics at the first disagreement.
pub fn check_ops(ops: &[Op]) {
    let mut harness = Harness::new();
    for op in ops {
        harness.step(op);
        harness.check();
    }
}

/// Decodes bytes into ops: a tag byte, then the op's fields. By `tag % 8`:
/// 0 register, 1 unregister, 2-4 stored, 5-6 removed, 7 a stream or worker
/// clear, or (with tag bit `0x40`) a cap of `0..=MAX_SET_CAP` blocks.
pub fn decode_ops(data: &[u8]) -> Vec<Op> {
    let mut ops = Vec::new();
    let mut bytes = data.iter().copied();
    while let Some(tag) = bytes.next() {
        let mut next = || bytes.next().unwrap_or(0);
        let op = match tag % 8 {
            0 => Op::Register(next()),
            1 => Op::Unregister(next()),
            2..=4 => {
                let a = next();
                let b = next();
                Op::Stored {
                    worker: a % WORKERS,
                    rank: (a >> 4) % 2,
                    prompt: (a >> 5) % PROMPTS,
                    start: b % PROMPT_BLOCKS,
                    len: (b >> 3) % (PROMPT_BLOCKS + 1),
                    salt: u8::from(tag & 0x10 != 0),
                    lora: tag & 0x20 != 0,
                    bad_size: tag & 0xc0 == 0xc0,
                }
            }
            5 | 6 => {
                let a = next();
                let b = next();
                Op::Removed {
                    worker: a % WORKERS,
                    rank: (a >> 4) % 2,
                    prompt: (a >> 5) % PROMPTS,
                    start: b % PROMPT_BLOCKS,
                    len: (b >> 3) % (PROMPT_BLOCKS + 1),
                    salt: u8::from(tag & 0x10 != 0),
                }
            }
            _ if tag & 0x40 != 0 => {
                let a = next();
                let b = next();
                Op::SetCapacity {
                    worker: a % WORKERS,
                    blocks: b % (MAX_SET_CAP + 1),
                }
            }
            _ => {
                let a = next();
                if a & 0x80 != 0 {
                    Op::ClearWorker(a % WORKERS)
                } else {
                    Op::Cleared {
                        worker: a % WORKERS,
                        rank: (a >> 4) % 2,
                    }
                }
            }
        };
        ops.push(op);
    }
    ops
}

/// The fuzz target: decode `data` and check the ops.
pub fn kv_index_ops(data: &[u8]) {
    check_ops(&decode_ops(data));
}
