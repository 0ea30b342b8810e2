//! Event sequences against the KV block index and its reference model:
//! stores, removals, clears, registrations, and per-worker caps (a small
//! default and `SetCapacity` ops) with the evictions they force; see
//! `kv_block_index::fuzzing` for the byte format.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kv_block_index::fuzzing::kv_index_ops(data);
});
