//! pd-orchestrator: see `pd_orchestrator::fuzzing::pd_bootstrap_query`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    pd_orchestrator::fuzzing::pd_bootstrap_query(data);
});
