//! Arbitrary header sets: hop-by-hop stripping and request ids.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    router_http::fuzzing::headers(data);
});
