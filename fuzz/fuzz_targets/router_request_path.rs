//! The router's whole request path against an in-process worker: method,
//! request target form, headers and body; no breaker moves and every load
//! returns to 0.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    router_http::fuzzing::request_path(data);
});
