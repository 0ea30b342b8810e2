//! The acceptance bench of `kv-block-index`: ingest rate, lookup latency, request
//! hashing cost and memory per (block, worker) pair on a realistic index.
//!
//! ```text
//! cargo run --release -p kv-block-index --example kv_index_bench            # a table
//! cargo run --release -p kv-block-index --example kv_index_bench -- --json  # one JSON line
//! cargo run --release -p kv-block-index --example kv_index_bench -- --ingest-only  # to profile
//! ```
//!
//! The fleet: `WORKERS` workers (one rank each) with block size 16. There
//! are `FAMILIES` families of system prompts; the prompts of a family share
//! their first half. Every worker holds two system prompts (a random prefix
//! of each, as eviction leaves them: at least half), one long conversation
//! after its first system prompt (up to a 1,000-block prompt in all, and
//! copied onto one or two other workers for a third of the workers, as when
//! a conversation moved) and `SHORT` short private conversations. All
//! measurements are single-threaded.
//!
//! - `ingest_blocks_per_s`: applying every `BlockStored` event (hashing the
//!   tokens, translating engine hashes, updating the index).
//! - `lookup_p99_us`: `lookup_into` of `LOOKUPS` 1,000-block requests (a
//!   worker's system prompt plus its long conversation), given their block
//!   hashes.
//! - `hash_us_per_1000_blocks`: hashing the 16,000 token ids of a request.
//! - `bytes_per_entry`: index plus translation maps per (block, worker) pair.
//!
//! Two more figures, beyond the acceptance targets, for workloads the
//! 64-block events above flatter:
//!
//! - `ingest_decode_blocks_per_s`: the same blocks into a fresh index, the
//!   conversations one block per event (as decode steps fill blocks one at
//!   a time), the system prompts in 64-block events.
//! - `ingest_single_block_events_blocks_per_s`: every block in its own
//!   event, shared system prompts included (a worst case).
//! - `evict_blocks_per_s`: after the lookups, every worker evicts its long
//!   conversation from the tail, 16 blocks per event.

use std::collections::HashSet;
use std::time::Instant;

use kv_block_index::{BlockHash, EngineHash, IndexConfig, KvEvent, KvIndex, StreamWriter};

const WORKERS: usize = 1000;
const BLOCK: usize = 16;
const REQUEST_BLOCKS: usize = 1000;
const FAMILIES: usize = 4;
const PROMPTS_PER_FAMILY: usize = 5;
const SYSTEM_BLOCKS: usize = 256;
const SHORT: usize = 20;
const SHORT_BLOCKS: usize = 12;
const LOOKUPS: usize = 5000;
const EVENT_BLOCKS: usize = 64;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Token ids of one block of a text identified by `text`.
fn block_tokens(text: u64, block: usize, out: &mut Vec<u32>) {
    let base = (text.wrapping_mul(0x9e37_79b9) as u32) ^ ((block as u32) << 8);
    out.extend((0..BLOCK as u32).map(|t| (base.wrapping_add(t * 7919)) % 150_000));
}

/// The tokens of system prompt `p` (family members share the first half).
fn system_tokens(p: usize) -> Vec<u32> {
    let family = p / PROMPTS_PER_FAMILY;
    let mut out = Vec::with_capacity(SYSTEM_BLOCKS * BLOCK);
    for b in 0..SYSTEM_BLOCKS {
        let text = if b < SYSTEM_BLOCKS / 2 {
            1_000 + family as u64
        } else {
            2_000 + p as u64
        };
        block_tokens(text, b, &mut out);
    }
    out
}

fn conversation_tokens(id: u64, blocks: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(blocks * BLOCK);
    for b in 0..blocks {
        block_tokens(1_000_000 + id, b, &mut out);
    }
    out
}

/// Events storing `tokens` (whole blocks) after `parent`, engine hashes
/// from `next_hash`, in events of at most `EVENT_BLOCKS` blocks.
fn store_events(
    tokens: &[u32],
    mut parent: Option<EngineHash>,
    next_hash: &mut i64,
    out: &mut Vec<KvEvent>,
) -> Option<EngineHash> {
    for chunk in tokens.chunks(EVENT_BLOCKS * BLOCK) {
        let n = chunk.len() / BLOCK;
        let hashes: Vec<EngineHash> = (0..n)
            .map(|_| {
                *next_hash += 1;
                EngineHash::from_int(*next_hash)
            })
            .collect();
        out.push(KvEvent::BlockStored {
            block_hashes: hashes.clone(),
            parent_block_hash: parent,
            token_ids: chunk[..n * BLOCK].to_vec(),
            block_size: BLOCK,
            lora_id: None,
        });
        parent = hashes.last().copied().or(parent);
    }
    parent
}

/// The first engine hash of a stored event.
fn first_hash(event: &KvEvent) -> Option<EngineHash> {
    match event {
        KvEvent::BlockStored { block_hashes, .. } => block_hashes.first().copied(),
        _ => None,
    }
}

/// One event per block of a stored event (each the parent of the next).
fn split_event(event: &KvEvent) -> Vec<KvEvent> {
    let KvEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        lora_id,
    } = event
    else {
        return vec![event.clone()];
    };
    let mut parent = *parent_block_hash;
    block_hashes
        .iter()
        .zip(token_ids.chunks(*block_size))
        .map(|(&hash, tokens)| {
            let one = KvEvent::BlockStored {
                block_hashes: vec![hash],
                parent_block_hash: parent,
                token_ids: tokens.to_vec(),
                block_size: *block_size,
                lora_id: *lora_id,
            };
            parent = Some(hash);
            one
        })
        .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    // For profiling the main ingest alone.
    let ingest_only = std::env::args().any(|a| a == "--ingest-only");
    let mut rng = Rng(0x6b76_1d3e);
    let index: KvIndex<usize> = KvIndex::new(IndexConfig {
        block_size: BLOCK,
        ..IndexConfig::default()
    });
    let prompts: Vec<Vec<u32>> = (0..FAMILIES * PROMPTS_PER_FAMILY)
        .map(system_tokens)
        .collect();
    let long_blocks = REQUEST_BLOCKS - SYSTEM_BLOCKS;

    // Build every worker's events first, so that only applying is timed.
    let mut streams: Vec<(StreamWriter, Vec<KvEvent>)> = Vec::with_capacity(WORKERS);
    let mut requests: Vec<Vec<u32>> = Vec::new();
    let mut engine_hash = 0i64;
    let mut conversations: Vec<(usize, u64)> = Vec::new();
    let mut conversation_hashes: Vec<Vec<EngineHash>> = Vec::new();
    // Events of system prompts (by their first engine hash).
    let mut prompt_events: HashSet<EngineHash> = HashSet::new();
    for w in 0..WORKERS {
        let id = index.register_worker(w);
        let mut events = Vec::new();
        let first = rng.below(prompts.len());
        let second = rng.below(prompts.len());
        let mut first_last = None;
        for (k, &p) in [first, second].iter().enumerate() {
            // A prefix of at least half of the prompt; the first one whole.
            let blocks = if k == 0 {
                SYSTEM_BLOCKS
            } else {
                SYSTEM_BLOCKS / 2 + rng.below(SYSTEM_BLOCKS / 2 + 1)
            };
            let before = events.len();
            let last = store_events(
                &prompts[p][..blocks * BLOCK],
                None,
                &mut engine_hash,
                &mut events,
            );
            prompt_events.extend(events[before..].iter().filter_map(first_hash));
            if k == 0 {
                first_last = last;
            }
        }
        let conversation = w as u64;
        let before = events.len();
        store_events(
            &conversation_tokens(conversation, long_blocks),
            first_last,
            &mut engine_hash,
            &mut events,
        );
        conversation_hashes.push(
            events[before..]
                .iter()
                .flat_map(|e| match e {
                    KvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
                    _ => Vec::new(),
                })
                .collect::<Vec<_>>(),
        );
        conversations.push((first, conversation));
        for s in 0..SHORT {
            let id = 10_000_000 + (w * SHORT + s) as u64;
            store_events(
                &conversation_tokens(id, SHORT_BLOCKS),
                first_last,
                &mut engine_hash,
                &mut events,
            );
        }
        streams.push((index.stream(id, 0).expect("a slot per worker"), events));
    }
    // A third of the long conversations also live on one or two other
    // workers that hold the same system prompt.
    for &(p, conversation) in &conversations[..WORKERS / 3] {
        for _ in 0..1 + rng.below(2) {
            let other = rng.below(WORKERS);
            let mut events = Vec::new();
            let last = store_events(&prompts[p], None, &mut engine_hash, &mut events);
            prompt_events.extend(events.iter().filter_map(first_hash));
            store_events(
                &conversation_tokens(conversation, long_blocks),
                last,
                &mut engine_hash,
                &mut events,
            );
            streams[other].1.extend(events);
        }
    }
    for _ in 0..LOOKUPS {
        let (p, conversation) = conversations[rng.below(WORKERS)];
        let mut tokens = prompts[p].clone();
        tokens.extend(conversation_tokens(conversation, long_blocks));
        requests.push(tokens);
        if requests.len() == 200 {
            break;
        }
    }

    let total_blocks: usize = streams
        .iter()
        .flat_map(|(_, e)| e.iter())
        .map(|e| match e {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes.len(),
            _ => 0,
        })
        .sum();
    let start = Instant::now();
    for (writer, events) in &streams {
        for event in events {
            writer.apply(event).expect("registered");
        }
    }
    let ingest_s = start.elapsed().as_secs_f64();
    let ingest_blocks_per_s = total_blocks as f64 / ingest_s;

    if ingest_only {
        println!("ingest {ingest_blocks_per_s:.0} blocks/s");
        return;
    }

    // The same blocks with smaller events, into fresh indexes (only
    // applying is timed): conversations one block per event, as decode
    // steps fill blocks, system prompts as before; then every event one
    // block (the worst case: even shared prompts arrive block by block).
    let mut rates = [0.0; 2];
    for (all, rate) in [false, true].into_iter().zip(&mut rates) {
        let fresh: KvIndex<usize> = KvIndex::new(IndexConfig {
            block_size: BLOCK,
            ..IndexConfig::default()
        });
        let mut seconds = 0.0;
        for (w, (_, events)) in streams.iter().enumerate() {
            let id = fresh.register_worker(w);
            let writer = fresh.stream(id, 0).expect("a slot per worker");
            let split: Vec<KvEvent> = events
                .iter()
                .flat_map(|e| {
                    let prompt = first_hash(e).is_some_and(|h| prompt_events.contains(&h));
                    if all || !prompt {
                        split_event(e)
                    } else {
                        vec![e.clone()]
                    }
                })
                .collect();
            let start = Instant::now();
            for event in &split {
                writer.apply(event).expect("registered");
            }
            seconds += start.elapsed().as_secs_f64();
        }
        *rate = total_blocks as f64 / seconds;
    }
    let [decode_rate, single_rate] = rates;
    drop(streams);

    // Request hashing: 16,000 token ids -> 1,000 block hashes.
    let hasher = index.hasher();
    let mut hashes: Vec<BlockHash> = Vec::new();
    let rounds = 2000;
    let start = Instant::now();
    for i in 0..rounds {
        hasher.hash_blocks_into(&requests[i % requests.len()], &mut hashes);
        std::hint::black_box(&hashes);
    }
    let hash_us = start.elapsed().as_secs_f64() * 1e6 / rounds as f64;

    let request_hashes: Vec<Vec<BlockHash>> =
        requests.iter().map(|t| hasher.hash_blocks(t)).collect();
    assert!(request_hashes.iter().all(|h| h.len() == REQUEST_BLOCKS));
    let mut found = index.lookup(&request_hashes[0]);
    let mut times = Vec::with_capacity(LOOKUPS);
    let mut matched = 0usize;
    let mut holders = 0usize;
    for i in 0..LOOKUPS {
        let request = &request_hashes[(i * 7) % request_hashes.len()];
        let start = Instant::now();
        index.lookup_into(request, &mut found);
        times.push(start.elapsed().as_secs_f64() * 1e6);
        matched += found.best().map_or(0, |m| m.blocks);
        holders += found.matches().len();
    }
    times.sort_by(f64::total_cmp);
    let (p50, p99, max) = (
        percentile(&times, 0.5),
        percentile(&times, 0.99),
        percentile(&times, 1.0),
    );
    let stats = index.stats();

    // Eviction: every worker drops its long conversation from the tail, 16
    // blocks per event (chains lose holders, get cut back and freed).
    let evicted: usize = conversation_hashes.iter().map(Vec::len).sum();
    let start = Instant::now();
    for (w, hashes) in conversation_hashes.iter().enumerate() {
        let id = index.worker_id(&w).expect("registered");
        for chunk in hashes.rchunks(16) {
            index
                .apply(
                    id,
                    0,
                    &KvEvent::BlockRemoved {
                        block_hashes: chunk.iter().rev().copied().collect(),
                    },
                )
                .expect("registered");
        }
    }
    let evict_blocks_per_s = evicted as f64 / start.elapsed().as_secs_f64();
    let mean_best = matched as f64 / LOOKUPS as f64;
    let mean_holders = holders as f64 / LOOKUPS as f64;

    if json {
        println!(
            "{{\"ingest_blocks_per_s\":{:.0},\"ingest_decode_blocks_per_s\":{:.0},\"ingest_single_block_events_blocks_per_s\":{:.0},\"evict_blocks_per_s\":{:.0},\"lookup_p50_us\":{:.3},\"lookup_p99_us\":{:.3},\"lookup_max_us\":{:.3},\"hash_us_per_1000_blocks\":{:.3},\"bytes_per_entry\":{:.1},\"workers\":{},\"block_size\":{},\"request_blocks\":{},\"ingested_blocks\":{},\"pairs\":{},\"distinct_blocks\":{},\"index_bytes\":{},\"translation_bytes\":{},\"lookups\":{},\"mean_best_prefix_blocks\":{:.1},\"mean_holders_per_lookup\":{:.1},\"threads\":1}}",
            ingest_blocks_per_s,
            decode_rate,
            single_rate,
            evict_blocks_per_s,
            p50,
            p99,
            max,
            hash_us,
            stats.bytes_per_pair(),
            WORKERS,
            BLOCK,
            REQUEST_BLOCKS,
            total_blocks,
            stats.pairs,
            stats.blocks,
            stats.index_bytes,
            stats.translation_bytes,
            LOOKUPS,
            mean_best,
            mean_holders,
        );
    } else {
        println!("kv-block-index bench (single thread)");
        println!("  workers                      {WORKERS} (block size {BLOCK})");
        println!("  ingested blocks              {total_blocks}");
        println!("  (block, worker) pairs        {}", stats.pairs);
        println!("  distinct blocks              {}", stats.blocks);
        println!(
            "  ingest                       {:.2} M blocks/s",
            ingest_blocks_per_s / 1e6
        );
        println!(
            "  ingest, decode-sized events  {:.2} M blocks/s",
            decode_rate / 1e6
        );
        println!(
            "  ingest, one block per event  {:.2} M blocks/s",
            single_rate / 1e6
        );
        println!(
            "  evict conversations (16/ev.) {:.2} M blocks/s",
            evict_blocks_per_s / 1e6
        );
        println!(
            "  lookup ({REQUEST_BLOCKS} blocks)          p50 {p50:.2} µs, p99 {p99:.2} µs, max {max:.2} µs"
        );
        println!(
            "  mean best prefix             {mean_best:.1} blocks, {mean_holders:.1} holders per lookup"
        );
        println!("  hash 16,000 tokens           {hash_us:.2} µs");
        println!(
            "  memory                       {:.1} bytes per pair (index {} MB, translation {} MB)",
            stats.bytes_per_pair(),
            stats.index_bytes >> 20,
            stats.translation_bytes >> 20
        );
    }
}
