//! Operation sequences against the radix tree and its reference model.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    radix_affinity::fuzzing::radix_ops(data);
});
