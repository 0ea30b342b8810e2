//! Arbitrary bytes read as a peer replica's batch of routing choices.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    router_http::fuzzing::peer_batch(data);
});
