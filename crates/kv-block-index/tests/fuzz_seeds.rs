//! Runs the fuzz target `kv_index_ops` on hand-written seeds and a few
//! hundred pseudo-random inputs, so `cargo test` exercises the harness.
#![cfg(not(loom))]

use kv_block_index::fuzzing::{Op, check_ops, decode_ops, kv_index_ops};

/// Seeds: register, store a chain in pieces, share prefixes across workers
/// and ranks, remove, clear, unregister and re-register, go over caps.
const SEEDS: &[&[u8]] = &[
    // register 0, store prompt 0 blocks 0..3 on (0, 0), then 3..6.
    &[0, 0, 2, 0x00, 3 << 3, 2, 0x00, 3 | (3 << 3)],
    // register 0 and 1, both store prompt 0 and prompt 2 (shared prefix).
    &[
        0,
        0,
        0,
        1,
        2,
        0x00,
        6 << 3,
        2,
        0x01,
        6 << 3,
        2,
        0x40,
        6 << 3,
        2,
        0x41,
        4 << 3,
    ],
    // a stored event with an unknown parent (salt differs), a bad size,
    // an unknown removal.
    &[
        0,
        0,
        2,
        0x00,
        2 << 3,
        0x12,
        0x00,
        2 | (2 << 3),
        0xc2,
        0x00,
        2 << 3,
        5,
        0x00,
        5 | (1 << 3),
    ],
    // store, remove the middle, clear a stream, clear the worker.
    &[
        0,
        0,
        2,
        0x10,
        6 << 3,
        5,
        0x10,
        2 | (2 << 3),
        7,
        0x10,
        2,
        0x00,
        4 << 3,
        7,
        0x80,
    ],
    // unregister with data, then ops on the stale id, then re-register.
    &[
        0,
        2,
        2,
        0x02,
        6 << 3,
        1,
        2,
        2,
        0x02,
        6 << 3,
        7,
        0x82,
        0,
        2,
        2,
        0x02,
        1 << 3,
    ],
    // lora blocks next to base blocks; prompt 1 shares two blocks.
    &[
        0,
        0,
        0x22,
        0x00,
        6 << 3,
        2,
        0x20,
        6 << 3,
        0,
        1,
        2,
        0x21,
        6 << 3,
    ],
    // past the harness's cap (18 blocks on one stream), a cap of 3, a
    // removal among what is left, a store, a cap above everything.
    &[
        0,
        0,
        2,
        0x00,
        6 << 3,
        2,
        0x20,
        6 << 3,
        0x12,
        0x40,
        6 << 3,
        0x47,
        0x00,
        3,
        0x15,
        0x40,
        3 | (3 << 3),
        2,
        0x00,
        6 << 3,
        0x47,
        0x00,
        40,
    ],
];

#[test]
fn seeds_run_clean() {
    for seed in SEEDS {
        let ops = decode_ops(seed);
        assert!(ops.len() >= 3, "{seed:?} decodes to {ops:?}");
        kv_index_ops(seed);
    }
}

#[test]
fn seeds_cover_the_event_kinds() {
    let ops: Vec<Op> = SEEDS.iter().flat_map(|s| decode_ops(s)).collect();
    assert!(ops.iter().any(|o| matches!(o, Op::Stored { salt: 1, .. })));
    assert!(
        ops.iter()
            .any(|o| matches!(o, Op::Stored { lora: true, .. }))
    );
    assert!(
        ops.iter()
            .any(|o| matches!(o, Op::Stored { bad_size: true, .. }))
    );
    assert!(ops.iter().any(|o| matches!(o, Op::Removed { .. })));
    assert!(ops.iter().any(|o| matches!(o, Op::Cleared { .. })));
    assert!(ops.iter().any(|o| matches!(o, Op::ClearWorker(_))));
    assert!(ops.iter().any(|o| matches!(o, Op::Unregister(_))));
    assert!(
        ops.iter()
            .any(|o| matches!(o, Op::SetCapacity { blocks: 3, .. }))
    );
}

#[test]
fn pseudo_random_inputs_run_clean() {
    // SplitMix64, so the inputs are the same on every run.
    let mut state = 0x4b56_1d3e_u64;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for _ in 0..300 {
        let len = (next() % 120) as usize;
        // Register early so most events reach a live stream.
        let mut data = vec![0, 0, 0, 1, 0, 2];
        data.extend((0..len).map(|_| next() as u8));
        kv_index_ops(&data);
    }
    kv_index_ops(&[]);
    kv_index_ops(&[0xff; 200]);
    kv_index_ops(&[0; 200]);
    check_ops(&[Op::ClearWorker(0), Op::Unregister(1)]);
}
