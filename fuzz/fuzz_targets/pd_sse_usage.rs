//! pd-orchestrator: see `pd_orchestrator::fuzzing::pd_sse_usage`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    pd_orchestrator::fuzzing::pd_sse_usage(data);
});
