//! Decode and encode cost of a typical batch, printed as JSON.
//!
//! A batch of 64 events like a busy engine's step: 48 `BlockStored` of four
//! 16-token blocks each (64-bit hashes, medium "GPU") and 16 `BlockRemoved`
//! of four blocks. Run with `cargo run --release -p kv-events --example
//! codec_throughput`. Timings are wall clock on whatever machine runs it.

use std::hint::black_box;
use std::time::Instant;

use kv_events::{
    BlockHash, BlockRemoved, BlockStored, EventBatch, KvEvent, WireFormat, decode_batch,
    encode_batch_as,
};

fn batch() -> EventBatch {
    let mut events = Vec::new();
    let mut h = 0x9E37_79B9_7F4A_7C15_u64;
    let mut next = || {
        h = h.rotate_left(17).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h
    };
    for _ in 0..48 {
        let hashes = (0..4).map(|_| BlockHash::Int(next())).collect();
        let tokens = (0..64).map(|_| (next() % 150_000) as u32).collect();
        let mut ev = BlockStored::new(hashes, Some(BlockHash::Int(next())), tokens, 16);
        ev.medium = Some("GPU".into());
        events.push(KvEvent::BlockStored(ev));
    }
    for _ in 0..16 {
        let mut ev = BlockRemoved::new((0..4).map(|_| BlockHash::Int(next())).collect());
        ev.medium = Some("GPU".into());
        events.push(KvEvent::BlockRemoved(ev));
    }
    EventBatch {
        ts: 1_700_000_000.25,
        events,
        data_parallel_rank: Some(0),
    }
}

fn main() {
    let batch = batch();
    let mut rows = Vec::new();
    for (name, format) in [
        ("positional", WireFormat::POSITIONAL),
        ("named_events", WireFormat::NAMED_EVENTS),
    ] {
        let payload = encode_batch_as(&batch, format);
        let rounds = 2000;
        let start = Instant::now();
        for _ in 0..rounds {
            black_box(decode_batch(black_box(&payload)).unwrap());
        }
        let decode = start.elapsed().as_nanos() as f64 / f64::from(rounds);
        let start = Instant::now();
        for _ in 0..rounds {
            black_box(encode_batch_as(black_box(&batch), format));
        }
        let encode = start.elapsed().as_nanos() as f64 / f64::from(rounds);
        rows.push(format!(
            "{{\"format\":\"{name}\",\"payload_bytes\":{},\"events\":{},\"decode_us\":{:.1},\"encode_us\":{:.1},\"decode_mb_per_s\":{:.0}}}",
            payload.len(),
            batch.events.len(),
            decode / 1e3,
            encode / 1e3,
            payload.len() as f64 / decode * 1e3,
        ));
    }
    println!("[{}]", rows.join(","));
}
