//! Endpoint URL parsing: never panics, and what parses round-trips.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    worker_lifecycle::fuzzing::endpoint_parse(data);
});
