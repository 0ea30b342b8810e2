//! Request bodies of every route: clean 400s or bounded routing text.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    router_http::fuzzing::request_body(data);
});
