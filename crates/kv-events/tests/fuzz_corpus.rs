//! Runs the fuzz targets' seed corpora and pseudo-random inputs through
//! `fuzzing::decode_roundtrip`, `fuzzing::endpoint_parse` and (feature
//! `sockets`) `fuzzing::zmtp_sockets`, so `cargo test` exercises the fuzz
//! harnesses.
#![cfg(not(loom))]

use std::path::PathBuf;

use kv_events::{decode_batch, fuzzing::decode_roundtrip, fuzzing::endpoint_parse};

/// SplitMix64 from `seed`, so the inputs are the same on every run. A copy
/// of worker-lifecycle's `SplitMix64`: kv-events is a leaf of the crate
/// graph and takes no dependency for a test's generator.
fn splitmix64(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/kv_events_decode")
}

#[test]
fn seed_corpus_runs_clean() {
    let mut seeds = 0;
    let mut decoded = 0;
    for entry in std::fs::read_dir(corpus_dir()).expect("fuzz/corpus/kv_events_decode exists") {
        let path = entry.unwrap().path();
        if path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("seed-")
        {
            let data = std::fs::read(&path).unwrap();
            match decode_batch(&data) {
                Ok(_) => decoded += 1,
                Err(e) => eprintln!("{}: {e}", path.display()),
            }
            decode_roundtrip(&data);
            seeds += 1;
        }
    }
    assert!(seeds >= 5, "expected the committed seeds, found {seeds}");
    assert_eq!(decoded, seeds, "every seed is a valid payload");
}

#[test]
fn pseudo_random_inputs_run_clean() {
    let mut next = splitmix64(0x4B56_E7E5);
    // Mutations of the seeds (byte flips, truncations) reach deeper than
    // plain random bytes.
    let seeds: Vec<Vec<u8>> = std::fs::read_dir(corpus_dir())
        .unwrap()
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    for _ in 0..2000 {
        let mut data = seeds[(next() % seeds.len() as u64) as usize].clone();
        for _ in 0..(next() % 4) {
            if !data.is_empty() {
                let at = (next() % data.len() as u64) as usize;
                data[at] = next() as u8;
            }
        }
        if next().is_multiple_of(3) && !data.is_empty() {
            data.truncate((next() % data.len() as u64) as usize);
        }
        decode_roundtrip(&data);
    }
    for _ in 0..300 {
        let len = (next() % 200) as usize;
        let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        decode_roundtrip(&data);
    }
    decode_roundtrip(&[]);
    decode_roundtrip(&[0x91; 10_000]);
    decode_roundtrip(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
}

fn endpoint_corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/kv_events_endpoint")
}

/// The `kv_events_endpoint` target's seeds (valid endpoints of each host
/// kind, the registration probe's hostile values) and mutations of them.
#[test]
fn endpoint_seed_corpus_and_mutations_run_clean() {
    let seeds: Vec<Vec<u8>> = std::fs::read_dir(endpoint_corpus_dir())
        .expect("fuzz/corpus/kv_events_endpoint exists")
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    assert!(seeds.len() >= 5, "expected the committed seeds");
    let parsed = seeds
        .iter()
        .filter(|seed| kv_events::ZmqEndpoint::parse(&String::from_utf8_lossy(seed)).is_ok())
        .count();
    assert!(parsed >= 3, "the valid seeds parse ({parsed})");
    let mut next = splitmix64(0x454E_4450);
    // Bytes the parser treats specially, so mutations reach its branches.
    let special = b":[]/.@%*0123456789abcdef\r\n \xff";
    for seed in &seeds {
        endpoint_parse(seed);
    }
    for _ in 0..5000 {
        let mut data = seeds[(next() % seeds.len() as u64) as usize].clone();
        for _ in 0..(1 + next() % 3) {
            let byte = special[(next() % special.len() as u64) as usize];
            let at = (next() % (data.len() as u64 + 1)) as usize;
            match next() % 3 {
                0 if at < data.len() => data[at] = byte,
                1 if at < data.len() => {
                    data.remove(at);
                }
                _ => data.insert(at, byte),
            }
        }
        endpoint_parse(&data);
    }
    endpoint_parse(&[]);
    endpoint_parse(format!("tcp://{}:1", "a".repeat(10_000)).as_bytes());
}

#[cfg(feature = "sockets")]
fn zmtp_corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/zmtp_sockets")
}

/// The `zmtp_sockets` target's seeds (the hostile-input probe's headers
/// against every socket type, genuine messages, garbage) and mutations of
/// them: each ends with a genuine peer getting through.
#[cfg(feature = "sockets")]
#[test]
fn zmtp_seed_corpus_and_mutations_run_clean() {
    let seeds: Vec<Vec<u8>> = std::fs::read_dir(zmtp_corpus_dir())
        .expect("fuzz/corpus/zmtp_sockets exists")
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    assert!(seeds.len() >= 9, "expected the committed seeds");
    for seed in &seeds {
        kv_events::fuzzing::zmtp_sockets(seed);
    }
    let mut next = splitmix64(0x5A4D_5450);
    for _ in 0..30 {
        let mut data = seeds[(next() % seeds.len() as u64) as usize].clone();
        for _ in 0..(1 + next() % 3) {
            let at = 1 + (next() % (data.len() as u64 - 1)) as usize;
            data[at] = next() as u8;
        }
        kv_events::fuzzing::zmtp_sockets(&data);
    }
}
