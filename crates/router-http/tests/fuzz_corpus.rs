//! Runs each router fuzz target over its committed seed corpus and a few
//! hundred pseudo-random inputs, so `cargo test` exercises the harnesses.

use router_http::fuzzing;
use std::path::PathBuf;
use worker_lifecycle::{RandomSource, SplitMix64};

type Target = fn(&[u8]);

const TARGETS: [(&str, Target); 6] = [
    ("router_request_body", fuzzing::request_body),
    ("router_headers", fuzzing::headers),
    ("router_sse_passthrough", fuzzing::sse_passthrough),
    ("router_request_path", fuzzing::request_path),
    ("router_load_report", fuzzing::load_report),
    ("router_peer_batch", fuzzing::peer_batch),
];

#[test]
fn seed_corpora_run_clean() {
    for (name, target) in TARGETS {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fuzz/corpus")
            .join(name);
        let mut seeds = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("seed-")
            {
                target(&std::fs::read(&path).unwrap());
                seeds += 1;
            }
        }
        assert!(
            seeds >= 2,
            "{name}: expected committed seeds, found {seeds}"
        );
    }
}

#[test]
fn pseudo_random_inputs_run_clean() {
    // worker-lifecycle's SplitMix64, so the inputs are the same on every run.
    let mut rng = SplitMix64::new(0xF0_2217);
    let mut next = move || rng.next_u64();
    // Raw bytes, and JSON-ish bytes that reach deeper into the parsers.
    let alphabet = br#"{}[]":,0123456789 abcmnoprstuvxyz\-"#;
    for (name, target) in TARGETS {
        for round in 0..300 {
            let len = (next() % 200) as usize;
            let data: Vec<u8> = if round % 2 == 0 {
                (0..len).map(|_| next() as u8).collect()
            } else {
                (0..len)
                    .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                    .collect()
            };
            let outcome = std::panic::catch_unwind(|| target(&data));
            assert!(outcome.is_ok(), "{name} panicked on {data:?}");
        }
    }
}
