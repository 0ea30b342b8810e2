//! Runs the `policy_ops` fuzz target's seed corpus and a few hundred
//! pseudo-random inputs through `fuzzing::policy_ops`, so `cargo test`
//! exercises the fuzz harness.

use std::path::PathBuf;

use lb_policies::fuzzing::policy_ops;
use radix_affinity::workload::SplitMix64;

#[test]
fn seed_corpus_runs_clean() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/policy_ops");
    let mut seeds = 0;
    for entry in std::fs::read_dir(&dir).expect("fuzz/corpus/policy_ops exists") {
        let path = entry.expect("readable directory").path();
        let is_seed = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("seed-"));
        if is_seed {
            policy_ops(&std::fs::read(&path).expect("readable seed"));
            seeds += 1;
        }
    }
    assert!(seeds >= 5, "expected the committed seeds, found {seeds}");
}

#[test]
fn pseudo_random_inputs_run_clean() {
    // The workspace's SplitMix64 (radix-affinity's, the lowest crate that has
    // one), so the inputs are the same on every run.
    let mut rng = SplitMix64(0x1b_9011_c1e5);
    let mut next = move || rng.next_u64();
    for _ in 0..300 {
        let len = (next() % 200) as usize;
        let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        policy_ops(&data);
    }
    policy_ops(&[]);
}
