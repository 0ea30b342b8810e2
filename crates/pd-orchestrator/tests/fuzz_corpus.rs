//! Runs each fuzz target's seed corpus and a few hundred pseudo-random
//! inputs through `pd_orchestrator::fuzzing`, so `cargo test` exercises the
//! fuzz harnesses (which must never panic).

use std::path::PathBuf;

use pd_orchestrator::fuzzing::{
    pd_bootstrap_query, pd_merge_responses, pd_rewrite_bodies, pd_sse_usage,
};
use worker_lifecycle::{RandomSource, SplitMix64};

type Target = fn(&[u8]);

const TARGETS: [(&str, Target); 4] = [
    ("pd_bootstrap_query", pd_bootstrap_query),
    ("pd_merge_responses", pd_merge_responses),
    ("pd_rewrite_bodies", pd_rewrite_bodies),
    ("pd_sse_usage", pd_sse_usage),
];

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
}

#[test]
fn seed_corpora_run_clean() {
    for (name, target) in TARGETS {
        let mut seeds = 0;
        for entry in std::fs::read_dir(corpus_dir(name)).expect("seed corpus directory exists") {
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
            seeds >= 4,
            "{name}: expected the committed seeds, found {seeds}"
        );
    }
}

/// Pseudo-random inputs: raw bytes, and JSON-ish text built from fragments
/// the parsers care about, so the inputs get past `serde_json` often.
#[test]
fn pseudo_random_inputs_run_clean() {
    // worker-lifecycle's SplitMix64, so the inputs are the same on every run.
    let mut rng = SplitMix64::new(0x9D_5EED);
    let mut next = move || rng.next_u64();
    const FRAGMENTS: [&str; 27] = [
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        "\"choices\"",
        "\"usage\"",
        "\"prompt_tokens\"",
        "\"logprobs\"",
        "\"prompt_logprobs\"",
        "\"text_offset\"",
        "\"tokens\"",
        "\"engine_id\"",
        "\"0\"",
        "\"kv_transfer_params\"",
        "\"index\"",
        "null",
        "1",
        "-1",
        "18446744073709551615",
        "\"é\"",
        "\u{0}",
        "\"min_tokens\"",
        "data: ",
        "\n\n",
        "\r\n",
    ];
    for round in 0..300 {
        let (_, target) = TARGETS[round % TARGETS.len()];
        let raw: Vec<u8> = (0..(next() % 96)).map(|_| next() as u8).collect();
        target(&raw);
        let mut text = String::new();
        for _ in 0..(next() % 40) {
            text.push_str(FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize]);
        }
        target(text.as_bytes());
    }
    for (_, target) in TARGETS {
        target(&[]);
        target(&[0; 64]);
        target(b"{}\0{}");
    }
}
