//! engine-sim: see `engine_sim::fuzzing::parse_request_body`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    engine_sim::fuzzing::parse_request_body(data);
});
