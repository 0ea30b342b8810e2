//! Arbitrary bytes read as an engine's load reply (Prometheus text or
//! `/get_load` JSON).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    router_http::fuzzing::load_report(data);
});
