//! Arbitrary bytes as a raw ZMTP stream into each socket type the router
//! opens (ROUTER, SUB, DEALER; libzmq, hardened as in production): no
//! crash, no allocation beyond the bound, and a genuine peer still gets
//! through afterwards.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kv_events::fuzzing::zmtp_sockets(data);
});
