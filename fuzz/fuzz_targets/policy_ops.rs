//! Fleet changes, membership events and selections against every built-in
//! load-balancing policy.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    lb_policies::fuzzing::policy_ops(data);
});
