//! Runs the fuzz target's seed corpus and a few hundred pseudo-random inputs
//! through `fuzzing::radix_ops`, so `cargo test` exercises the fuzz harness.

use std::path::PathBuf;

use radix_affinity::fuzzing::{decode_ops, radix_ops};

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/radix_ops")
}

#[test]
fn seed_corpus_runs_clean() {
    let mut seeds = 0;
    for entry in std::fs::read_dir(corpus_dir()).expect("fuzz/corpus/radix_ops exists") {
        let path = entry.unwrap().path();
        if path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("seed-")
        {
            let data = std::fs::read(&path).unwrap();
            assert!(
                !decode_ops(&data).is_empty(),
                "{} decodes to no ops",
                path.display()
            );
            radix_ops(&data);
            seeds += 1;
        }
    }
    assert!(seeds >= 5, "expected the committed seeds, found {seeds}");
}

#[test]
fn pseudo_random_inputs_run_clean() {
    // SplitMix64, so the inputs are the same on every run.
    let mut state = 0x5EED_F022_u64;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    for _ in 0..300 {
        let len = (next() % 160) as usize;
        let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        radix_ops(&data);
    }
    // Degenerate inputs.
    radix_ops(&[]);
    radix_ops(&[0xFF; 300]);
    radix_ops(&[0; 300]);
}
