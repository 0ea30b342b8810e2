//! Arbitrary bytes as a KV-event payload: decoding never panics, and what
//! decodes re-encodes stably in every wire shape.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kv_events::fuzzing::decode_roundtrip(data);
});
