use super::args::{Args, RunSpec, check_args, run_specs};
use super::body::BodyTemplate;
use super::children::{engine_url, router_url};
use super::histogram::{BUCKETS, Histogram, bucket_of, bucket_value, quantile, window};
use super::procfs::{parse_cpu_ticks, read_status, status_field};
use super::summary::{quantile_ms, steady};
use super::*;

#[test]
fn buckets_are_contiguous_and_within_1_6_percent() {
    let mut last = 0;
    for v in 0..1_000_000u64 {
        let b = bucket_of(v);
        assert!(
            b == last || b == last + 1,
            "bucket of {v} jumps from {last} to {b}"
        );
        last = b;
        let mid = bucket_value(b) as f64;
        assert!(
            (mid - v as f64).abs() <= (v as f64 / 64.0).max(0.5),
            "{v} is read back as {mid}"
        );
    }
    assert!(bucket_of(u64::MAX) < BUCKETS);
}

#[test]
fn quantiles_of_a_known_distribution() {
    let h = Histogram::new();
    for v in 1..=1000u64 {
        h.record(v * 1000); // 1 ms .. 1 s
    }
    let counts = h.snapshot();
    let p50 = quantile(&counts, 0.5).unwrap() as f64;
    let p99 = quantile(&counts, 0.99).unwrap() as f64;
    assert!((p50 - 500_000.0).abs() / 500_000.0 < 0.016, "p50 {p50}");
    assert!((p99 - 990_000.0).abs() / 990_000.0 < 0.016, "p99 {p99}");
    assert_eq!(quantile(&[0; 4], 0.5), None);
    // Never above the exact maximum.
    assert_eq!(quantile_ms(&counts, 1.0, 999_000), Some(999.0));
    // A window is the difference of two snapshots.
    h.record(7);
    let w = window(&h.snapshot(), &counts);
    assert_eq!(w.iter().sum::<u64>(), 1);
    assert_eq!(quantile(&w, 0.99), Some(7));
}

#[test]
fn bodies_are_valid_unique_chat_requests_of_the_asked_size() {
    let t = BodyTemplate::new("sim-model", 8, 300, 1024);
    let a = t.body(42);
    let b = t.body(43);
    assert_ne!(a, b);
    let v: serde_json::Value = serde_json::from_slice(&a).unwrap();
    assert_eq!(v["model"], "sim-model");
    assert_eq!(v["max_tokens"], 8);
    let messages = v["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0]["role"], "system");
    assert_eq!(messages[0]["content"].as_str().unwrap().len(), 300);
    let user = messages[1]["content"].as_str().unwrap();
    assert!(user.starts_with("42 "), "{user:.20}");
    assert_eq!(user.len(), "42 ".len() + 1024);
    let plain = BodyTemplate::new("m", 1, 0, 10).body(7);
    let v: serde_json::Value = serde_json::from_slice(&plain).unwrap();
    assert_eq!(v["messages"].as_array().unwrap().len(), 1);
}

#[test]
fn run_specs_from_the_command_line() {
    let args = Args::parse_from([
        "soak",
        "--policies",
        "round_robin,cache_aware",
        "--run",
        "cache_aware --eviction-interval-secs 30",
        "--",
        "--max-tree-size",
        "16777216",
    ]);
    let specs = run_specs(&args).unwrap();
    let labels: Vec<String> = specs.iter().map(RunSpec::label).collect();
    assert_eq!(
        labels,
        [
            "round_robin --max-tree-size 16777216",
            "cache_aware --max-tree-size 16777216",
            "cache_aware --eviction-interval-secs 30 --max-tree-size 16777216",
        ]
    );
    let default = run_specs(&Args::parse_from(["soak"])).unwrap();
    assert_eq!(default[0].label(), "cache_aware");
    for bad in [
        vec!["soak", "--", "--port", "1"],
        vec!["soak", "--run", "cache_aware --host=0.0.0.0"],
        vec!["soak", "--policies", "round robin"],
        vec!["soak", "--run", "  "],
    ] {
        let args = Args::parse_from(bad.clone());
        assert!(run_specs(&args).is_err(), "{bad:?} accepted");
    }
    let engine = Args::parse_from(["soak", "--engine-flags", "--time-scale 1"]);
    assert!(check_args(&engine).unwrap_err().contains("--time-scale"));
    let zero = Args::parse_from(["soak", "--duration", "0"]);
    assert!(check_args(&zero).is_err());
}

#[test]
fn banners_and_proc_files() {
    assert_eq!(
        engine_url("engine-sim engine-0 (regular) serving sim-model on http://127.0.0.1:4567"),
        Some("http://127.0.0.1:4567".into())
    );
    assert_eq!(engine_url("kv events: PUB on tcp://x"), None);
    assert_eq!(
        router_url("affinity-router 0.1.0 serving on http://127.0.0.1:39999 (policy cache_aware)"),
        Some("http://127.0.0.1:39999".into())
    );
    assert_eq!(router_url("  metrics: http://127.0.0.1:1/metrics"), None);
    let status = "Name:\trouter\nVmHWM:\t  204800 kB\nVmRSS:\t   20480 kB\n";
    assert_eq!(status_field(status, "VmRSS"), Some(20480 * 1024));
    assert_eq!(status_field(status, "VmHWM"), Some(204_800 * 1024));
    assert_eq!(status_field(status, "VmSwap"), None);
    let stat = "123 (my (odd) name) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0";
    assert_eq!(parse_cpu_ticks(stat), Some(300));
    // This process can read its own files (the soak reads /proc: Linux).
    #[cfg(target_os = "linux")]
    assert!(read_status(std::process::id()).is_some_and(|s| status_field(&s, "VmRSS").is_some()));
}

#[test]
fn steady_is_the_median_of_the_last_30_percent() {
    let samples: Vec<f64> = (1..=10).map(f64::from).collect();
    // Last 3 samples: 8, 9, 10.
    assert_eq!(steady(&samples), 9.0);
    assert_eq!(steady(&[5.0]), 5.0);
    assert_eq!(steady(&[]), 0.0);
}
