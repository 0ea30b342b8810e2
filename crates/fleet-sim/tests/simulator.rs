//! The simulator's own guarantees: determinism, load guards all released,
//! every request accounted for, and the trace loader's errors.

use std::time::Duration;

use fleet_sim::{
    DEFAULT_POLICIES, PdSplit, PreparedTrace, RunReport, SimConfig, TraceError, report, simulate,
    trace, workload,
};

fn small_multi_turn(seed: u64) -> workload::MultiTurnConfig {
    workload::MultiTurnConfig {
        requests: 300,
        rate: 60.0,
        active_sessions: 24,
        seed,
        ..workload::MultiTurnConfig::default()
    }
}

fn run_all(config: &SimConfig, seed: u64) -> Vec<RunReport> {
    let trace = workload::multi_turn(&small_multi_turn(seed));
    let prepared = PreparedTrace::new(&trace, &config.model);
    DEFAULT_POLICIES
        .iter()
        .map(|policy| simulate(&prepared, policy, config, &|_| {}).unwrap())
        .collect()
}

/// The policies whose decisions depend on nothing but the seed and the
/// simulated state. cache-aware's radix trees stamp last use with
/// radix-affinity's default coarse wall clock (lb-policies has no knob for
/// its logical clock yet), so which of several owners of a shared prefix a
/// lookup returns can vary between runs; its figures are compared with a
/// tolerance instead.
const EXACT: [&str; 5] = [
    "round_robin",
    "random",
    "least_loaded",
    "power_of_two",
    "consistent_hash",
];

#[test]
fn same_seed_gives_the_same_json() {
    let config = SimConfig {
        workers: 3,
        seed: 7,
        ..SimConfig::default()
    };
    let first_runs = run_all(&config, 7);
    let second_runs = run_all(&config, 7);
    let exact = |runs: &[RunReport]| -> Vec<RunReport> {
        runs.iter()
            .filter(|r| EXACT.contains(&r.policy.as_str()))
            .cloned()
            .collect()
    };
    let first = report::json_summary(&exact(&first_runs)).to_string();
    let second = report::json_summary(&exact(&second_runs)).to_string();
    assert_eq!(first, second);
    for (a, b) in first_runs.iter().zip(&second_runs) {
        assert_eq!(a.policy, b.policy);
        assert_eq!(a.metrics.completed, b.metrics.completed);
        assert!(
            (a.metrics.hit_rate - b.metrics.hit_rate).abs() < 0.02,
            "{}: {} vs {}",
            a.policy,
            a.metrics.hit_rate,
            b.metrics.hit_rate
        );
    }
    // Every policy is there under the workload's name.
    let all = report::json_summary(&first_runs).to_string();
    let value: serde_json::Value = serde_json::from_str(&all).unwrap();
    for policy in DEFAULT_POLICIES {
        let entry = &value["multi_turn"][policy];
        for key in [
            "throughput_rps",
            "output_tps",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "e2e_p99_ms",
            "hit_rate",
            "imbalance",
            "routing_loss",
        ] {
            assert!(entry[key].is_f64(), "{policy}.{key} in {all}");
        }
    }
    // Another seed is another experiment.
    let other = report::json_summary(&exact(&run_all(&config, 8))).to_string();
    assert_ne!(first, other);
}

#[test]
fn every_guard_is_released_and_every_request_finishes() {
    let regular = SimConfig {
        workers: 3,
        ..SimConfig::default()
    };
    let pd = SimConfig {
        pd: Some(PdSplit {
            prefill: 2,
            decode: 2,
        }),
        ..SimConfig::default()
    };
    for config in [&regular, &pd] {
        for report in run_all(config, 3) {
            let m = &report.metrics;
            assert_eq!(
                report.final_loads.len(),
                if config.pd.is_some() { 4 } else { 3 }
            );
            assert!(
                report.final_loads.iter().all(|&load| load == 0),
                "{}: loads {:?} after the run",
                report.policy,
                report.final_loads
            );
            assert_eq!((m.completed, m.rejected), (300, 0), "{}", report.policy);
            assert!(m.ttft_p50_ms > 0.0 && m.ttft_p50_ms <= m.ttft_p99_ms);
            assert!(m.ttft_p99_ms <= m.e2e_p99_ms);
            assert!((0.0..=1.0).contains(&m.hit_rate));
            assert!((0.0..=1.0).contains(&m.routing_loss));
            assert!(m.imbalance >= 1.0);
            // The load timeline saw work in flight at some point.
            let timeline = &report.load_timeline;
            assert_eq!(timeline.loads.len(), timeline.workers.len());
            assert!(timeline.loads.iter().flatten().any(|&l| l > 0));
            // Decisions are counted by the registry, one per request.
            let decided: u64 = report.decisions.iter().map(|(_, n)| n).sum();
            assert_eq!(decided, 300, "{}: {:?}", report.policy, report.decisions);
        }
    }
}

#[test]
fn under_pd_the_prefill_leg_is_charged_and_decode_follows() {
    let config = SimConfig {
        pd: Some(PdSplit {
            prefill: 1,
            decode: 1,
        }),
        ..SimConfig::default()
    };
    let trace = workload::multi_turn(&small_multi_turn(5));
    let prepared = PreparedTrace::new(&trace, &config.model);
    let pd = simulate(&prepared, "round_robin", &config, &|_| {}).unwrap();
    let regular = simulate(
        &prepared,
        "round_robin",
        &SimConfig {
            workers: 1,
            ..SimConfig::default()
        },
        &|_| {},
    )
    .unwrap();
    assert_eq!(pd.metrics.completed, 300);
    assert_eq!(regular.metrics.completed, 300);
    // Every decode leg received the prefill engine's KV, checked by the
    // decode engine against the transfer the prefill engine published.
    assert_eq!(pd.kv_transfers, (300, 0));
    // Choosing the decode worker at arrival instead of when the prefill
    // completes changes where decode legs go, not what is accounted.
    assert!(config.late_decode_choice, "the router's way is the default");
    let arrival = simulate(
        &prepared,
        "round_robin",
        &SimConfig {
            late_decode_choice: false,
            ..config.clone()
        },
        &|_| {},
    )
    .unwrap();
    assert_eq!(arrival.kv_transfers, (300, 0));
    assert_eq!(arrival.final_loads, [0, 0]);
    assert_eq!(arrival.metrics.completed, 300);
    assert_eq!(regular.kv_transfers, (0, 0));
    // The first token now needs a prefill step and then a decode step
    // (2 ms + 8 ms at least in the default model).
    assert!(pd.metrics.ttft_p50_ms >= 10.0, "{:?}", pd.metrics);
    // The prefill engine computes the same prompts a regular engine does,
    // so with one engine each the prefix-cache hit rates agree closely.
    assert!((pd.metrics.hit_rate - regular.metrics.hit_rate).abs() < 0.05);
}

#[test]
fn drained_workers_are_seen_but_never_chosen() {
    let config = SimConfig {
        workers: 3,
        drained: 1,
        ..SimConfig::default()
    };
    for report in run_all(&config, 4) {
        assert_eq!(report.metrics.completed, 300, "{}", report.policy);
        assert_eq!(report.final_loads, [0, 0, 0]);
        let drained = &report.load_timeline.loads[2];
        assert!(drained.iter().all(|&l| l == 0), "{}", report.policy);
        assert!(report.load_timeline.loads[0].iter().any(|&l| l > 0));
    }
    let all_drained = SimConfig {
        workers: 2,
        drained: 2,
        ..SimConfig::default()
    };
    let trace = workload::multi_turn(&small_multi_turn(1));
    let prepared = PreparedTrace::new(&trace, &all_drained.model);
    assert!(simulate(&prepared, "round_robin", &all_drained, &|_| {}).is_err());
}

#[test]
fn a_routing_input_suffix_picks_text_or_tokens() {
    use fleet_sim::{RoutingSource, SimError, split_policy};
    assert_eq!(
        split_policy("cache_aware:tokens").unwrap(),
        ("cache_aware", RoutingSource::Tokens)
    );
    assert_eq!(
        split_policy("cache_aware:text").unwrap(),
        ("cache_aware", RoutingSource::Text)
    );
    assert_eq!(
        split_policy("round_robin").unwrap(),
        ("round_robin", RoutingSource::Text)
    );
    let config = SimConfig {
        workers: 2,
        ..SimConfig::default()
    };
    let trace = workload::multi_turn(&workload::MultiTurnConfig {
        requests: 60,
        ..small_multi_turn(3)
    });
    let prepared = PreparedTrace::new(&trace, &config.model);
    let error = simulate(&prepared, "cache_aware:bytes", &config, &|_| {}).unwrap_err();
    assert!(matches!(error, SimError::RoutingInput(_)), "{error}");
    assert!(error.to_string().contains("cache_aware:bytes"), "{error}");
    // On synthetic prompts the engine's ids follow the text, so both
    // inputs route every request and release every guard.
    for policy in ["cache_aware", "cache_aware:tokens"] {
        let report = simulate(&prepared, policy, &config, &|_| {}).unwrap();
        assert_eq!(report.policy, policy);
        assert_eq!(report.metrics.completed, 60);
        assert!(report.final_loads.iter().all(|&l| l == 0));
        assert!(
            report.metrics.hit_rate > 0.3,
            "{policy}: {:?}",
            report.metrics
        );
    }
}

#[test]
fn unknown_policy_is_a_clear_error() {
    let trace = workload::multi_turn(&small_multi_turn(1));
    let config = SimConfig::default();
    let prepared = PreparedTrace::new(&trace, &config.model);
    let error = simulate(&prepared, "fastest", &config, &|_| {}).unwrap_err();
    assert!(error.to_string().contains("fastest"), "{error}");
    let no_workers = SimConfig {
        workers: 0,
        ..SimConfig::default()
    };
    assert!(simulate(&prepared, "round_robin", &no_workers, &|_| {}).is_err());
}

#[test]
fn trace_file_loads_and_replays() {
    let dir = std::env::temp_dir().join(format!("sim-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("my-traffic.jsonl");
    std::fs::write(
        &path,
        concat!(
            r#"{"timestamp": 100.0, "session": "a", "prompt": "You are terse. Hello there, how are you?", "output_tokens": 8}"#,
            "\n\n",
            r#"{"timestamp": 100.25, "session": 42, "prompt_tokens": 300, "output_tokens": 4, "extra": true}"#,
            "\n",
            r#"{"timestamp": 100.5, "session": 42, "prompt_tokens": 420, "output_tokens": 4}"#,
            "\n",
            r#"{"timestamp": 100.1, "prompt_tokens": 64, "output_tokens": 2}"#,
            "\n",
        ),
    )
    .unwrap();
    let loaded = trace::load_jsonl(&path, 4).unwrap();
    assert_eq!(loaded.name, "my-traffic");
    assert_eq!(loaded.requests.len(), 4);
    let arrivals: Vec<Duration> = loaded.requests.iter().map(|r| r.arrival).collect();
    assert_eq!(
        arrivals,
        [0, 100, 250, 500].map(Duration::from_millis).to_vec()
    );
    assert_eq!(loaded.requests[2].session.as_deref(), Some("42"));
    assert_eq!(loaded.requests[2].prompt.chars().count(), 1200);
    assert!(
        loaded.requests[3]
            .prompt
            .starts_with(&*loaded.requests[2].prompt)
    );
    assert_eq!(loaded.requests[1].session, None);

    let config = SimConfig {
        workers: 2,
        ..SimConfig::default()
    };
    let prepared = PreparedTrace::new(&loaded, &config.model);
    let report = simulate(&prepared, "consistent_hash", &config, &|_| {}).unwrap();
    assert_eq!(report.workload, "my-traffic");
    assert_eq!(report.metrics.completed, 4);
    // The second turn of session 42 finds the first one's prefix cached.
    assert!(report.metrics.hit_rate > 0.3, "{:?}", report.metrics);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_trace_lines_are_named() {
    let good = r#"{"timestamp": 0, "prompt": "hi", "output_tokens": 1}"#;
    let cases = [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (
            r#"{"prompt": "x", "output_tokens": 1}"#,
            "missing `timestamp`",
        ),
        (
            r#"{"timestamp": -1, "prompt": "x", "output_tokens": 1}"#,
            "`timestamp`",
        ),
        (
            r#"{"timestamp": "soon", "prompt": "x", "output_tokens": 1}"#,
            "`timestamp`",
        ),
        (
            r#"{"timestamp": 1, "output_tokens": 1}"#,
            "missing `prompt` or `prompt_tokens`",
        ),
        (
            r#"{"timestamp": 1, "prompt": "x", "prompt_tokens": 3, "output_tokens": 1}"#,
            "not both",
        ),
        (
            r#"{"timestamp": 1, "prompt": "", "output_tokens": 1}"#,
            "`prompt`",
        ),
        (
            r#"{"timestamp": 1, "prompt_tokens": 0, "output_tokens": 1}"#,
            "`prompt_tokens`",
        ),
        (
            r#"{"timestamp": 1, "prompt": "x"}"#,
            "missing `output_tokens`",
        ),
        (
            r#"{"timestamp": 1, "prompt": "x", "output_tokens": 0}"#,
            "`output_tokens`",
        ),
        (
            r#"{"timestamp": 1, "prompt": "x", "output_tokens": 2.5}"#,
            "`output_tokens`",
        ),
        (
            r#"{"timestamp": 1, "session": [1], "prompt": "x", "output_tokens": 1}"#,
            "`session`",
        ),
    ];
    for (bad, expected) in cases {
        let text = format!("{good}\n\n{bad}\n{good}\n");
        let error = trace::parse_jsonl(&text, 4).unwrap_err();
        let message = error.to_string();
        assert!(
            matches!(error, TraceError::Line { line: 3, .. }),
            "{bad}: {message}"
        );
        assert!(message.starts_with("trace line 3: "), "{message}");
        assert!(message.contains(expected), "{bad}: {message}");
    }
    assert!(matches!(
        trace::parse_jsonl("\n \n", 4),
        Err(TraceError::Empty)
    ));
    let missing = trace::load_jsonl(std::path::Path::new("/nonexistent/trace.jsonl"), 4);
    assert!(matches!(missing, Err(TraceError::Io { .. })));
}

#[test]
fn the_trace_parser_never_panics_on_garbage() {
    // Pseudo-random lines assembled from JSON fragments, field names and
    // odd values (a fixed SplitMix64 stream, so failures reproduce).
    let fragments = [
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        "\"",
        "\"timestamp\"",
        "\"session\"",
        "\"prompt\"",
        "\"prompt_tokens\"",
        "\"output_tokens\"",
        "1",
        "-1",
        "0",
        "1e400",
        "1.5",
        "null",
        "true",
        "\"x\"",
        "\"\u{1F600}\"",
        "18446744073709551616",
        "\n",
        " ",
        "\\u0000",
    ];
    let mut rng = radix_affinity::workload::SplitMix64(42);
    for _ in 0..400 {
        let mut text = String::new();
        for _ in 0..rng.below(40) {
            text.push_str(fragments[rng.below(fragments.len() as u64) as usize]);
        }
        match trace::parse_jsonl(&text, 4) {
            Ok(parsed) => assert!(!parsed.requests.is_empty()),
            Err(error) => assert!(!error.to_string().is_empty()),
        }
    }
    // Well-formed lines with extreme but valid values load.
    let extreme =
        r#"{"timestamp": 1e9, "session": 0, "prompt_tokens": 1048576, "output_tokens": 1048576}"#;
    let parsed = trace::parse_jsonl(extreme, 1).unwrap();
    assert_eq!(parsed.requests[0].prompt.len(), 1 << 20);
}

#[test]
fn requests_an_engine_refuses_are_counted_and_release_their_guard() {
    // 40,000 prompt tokens exceed the default 32,768-token context.
    let text = concat!(
        r#"{"timestamp": 0, "prompt_tokens": 40000, "output_tokens": 4}"#,
        "\n",
        r#"{"timestamp": 0.1, "prompt_tokens": 100, "output_tokens": 4}"#,
    );
    let trace = trace::parse_jsonl(text, 4).unwrap();
    let config = SimConfig {
        workers: 2,
        ..SimConfig::default()
    };
    let prepared = PreparedTrace::new(&trace, &config.model);
    for policy in DEFAULT_POLICIES {
        let report = simulate(&prepared, policy, &config, &|_| {}).unwrap();
        assert_eq!((report.metrics.completed, report.metrics.rejected), (1, 1));
        assert_eq!(report.final_loads, [0, 0], "{policy}");
    }
}
