//! Operation sequences on registries, discovery pools, load guards and
//! breaker outcomes, with the load invariants checked after every step.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    worker_lifecycle::fuzzing::lifecycle_ops(data);
});
