//! Runs the request-body fuzz target's seed corpus and a few hundred
//! pseudo-random inputs through `engine_sim::fuzzing`, so `cargo test`
//! exercises the harness (which must never panic).

use std::path::PathBuf;

use engine_sim::fuzzing::parse_request_body;

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/engine_sim_request_body")
}

#[test]
fn seed_corpus_runs_clean() {
    let mut seeds = 0;
    for entry in std::fs::read_dir(corpus_dir()).expect("seed corpus directory exists") {
        let path = entry.expect("entry").path();
        if path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("seed-"))
        {
            parse_request_body(&std::fs::read(&path).expect("read seed"));
            seeds += 1;
        }
    }
    assert!(seeds >= 5, "expected the committed seeds, found {seeds}");
}

#[test]
fn pseudo_random_inputs_run_clean() {
    let mut state = 0xE5_5EED_u64;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    const FRAGMENTS: [&str; 28] = [
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        "\"",
        "null",
        "true",
        "-1",
        "70000",
        "1e400",
        "\"messages\"",
        "\"prompt\"",
        "\"role\"",
        "\"content\"",
        "\"text\"",
        "\"max_tokens\"",
        "\"stream\"",
        "\"stream_options\"",
        "\"include_usage\"",
        "\"kv_transfer_params\"",
        "\"remote_block_ids\"",
        "\"remote_port\"",
        "\"do_remote_prefill\"",
        "status=",
        "stall-after-headers=",
        "\u{1F600}",
    ];
    for round in 0..400 {
        let len = (next() % 48) as usize;
        let input: Vec<u8> = if round % 4 == 0 {
            (0..len).map(|_| next() as u8).collect()
        } else {
            (0..len)
                .map(|_| FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize])
                .collect::<String>()
                .into_bytes()
        };
        parse_request_body(&input);
    }
    // Structured inputs that reach the deeper parsers.
    for value in [
        r#"{"messages":[{"role":"user","content":null}],"kv_transfer_params":[]}"#,
        r#"{"prompt":[[1,2]],"kv_transfer_params":{"remote_block_ids":[4294967296]}}"#,
        r#"{"prompt":"","stream_options":{"include_usage":"yes"}}"#,
    ] {
        parse_request_body(value.as_bytes());
    }
}
