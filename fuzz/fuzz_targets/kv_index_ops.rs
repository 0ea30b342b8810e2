//! Event sequences against the KV block index and its reference model.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kv_index::fuzzing::kv_index_ops(data);
});
