//! Arbitrary bytes as a ZMQ endpoint (`tcp://HOST:PORT`, the addresses
//! engines announce to the router): parsing never panics, and what parses
//! displays as text that parses back to the same endpoint.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kv_events::fuzzing::endpoint_parse(data);
});
