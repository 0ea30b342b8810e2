//! Arbitrarily split streams through a guarded body: bytes unchanged, guard once.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    router_http::fuzzing::sse_passthrough(data);
});
