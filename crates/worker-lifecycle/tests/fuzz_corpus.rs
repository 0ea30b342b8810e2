//! Runs the fuzz targets' seed corpora and a few hundred pseudo-random
//! inputs through `fuzzing::*`, so `cargo test` exercises the fuzz harness.
#![cfg(not(loom))]

use std::path::PathBuf;

use worker_lifecycle::fuzzing::{endpoint_parse, lifecycle_ops};
use worker_lifecycle::{RandomSource, SplitMix64};

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("seed-")
        {
            out.push(std::fs::read(&path).unwrap());
        }
    }
    out
}

fn pseudo_random(count: usize, max_len: u64, mut each: impl FnMut(&[u8])) {
    // worker-lifecycle's SplitMix64, so the inputs are the same on every run.
    let mut rng = SplitMix64::new(0x5EED_0004);
    let mut next = move || rng.next_u64();
    for _ in 0..count {
        let len = (next() % max_len) as usize;
        let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        each(&data);
    }
}

#[test]
fn lifecycle_seed_corpus_runs_clean() {
    let seeds = seeds("worker_lifecycle_ops");
    assert!(
        seeds.len() >= 5,
        "expected the committed seeds, found {}",
        seeds.len()
    );
    for seed in seeds {
        lifecycle_ops(&seed);
    }
}

#[test]
fn lifecycle_pseudo_random_inputs_run_clean() {
    pseudo_random(300, 200, lifecycle_ops);
    lifecycle_ops(&[]);
    lifecycle_ops(&[0xFF; 300]);
    lifecycle_ops(&[0; 300]);
}

#[test]
fn endpoint_seed_corpus_and_random_inputs_run_clean() {
    let seeds = seeds("worker_endpoint_parse");
    assert!(
        seeds.len() >= 5,
        "expected the committed seeds, found {}",
        seeds.len()
    );
    for seed in seeds {
        endpoint_parse(&seed);
    }
    pseudo_random(300, 40, endpoint_parse);
    endpoint_parse("http://x@".as_bytes());
    endpoint_parse("http://\u{0}".as_bytes());
}
