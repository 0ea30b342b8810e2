//! The reference router's command line: defaults, errors, the config file,
//! and docs/operations.md against what clap knows.

use affinity_router::cli::args::{Args, BackendName, LogLevel, PolicyName};
use affinity_router::cli::settings::{self, CliError};
use affinity_router::cli::{Mode, Settings};
use affinity_router::http::otel::Protocol;
use affinity_router::pd::PdConnector;
use clap::CommandFactory;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

fn settings(args: &[&str]) -> Result<Settings, CliError> {
    Settings::from_args(std::iter::once("router").chain(args.iter().copied()))
}

fn temp_file(name: &str, contents: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "affinity-router-cli-{}-{}-{name}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn every_flag_has_vllm_routers_default() {
    let a = Args::default();
    assert_eq!(a.host, "127.0.0.1");
    assert_eq!(a.port, 30000);
    assert!(a.worker_urls.is_empty());
    assert_eq!(a.policy, PolicyName::CacheAware);
    assert_eq!(a.prefill_policy, None);
    assert_eq!(a.decode_policy, None);
    assert!(!a.vllm_pd_disaggregation);
    assert!(a.prefill.is_empty());
    assert!(a.decode.is_empty());
    assert_eq!(a.kv_connector, PdConnector::Nixl);
    assert_eq!(a.vllm_discovery_address, None);
    assert_eq!(a.cache_threshold, 0.3);
    assert_eq!(a.balance_abs_threshold, 64);
    assert_eq!(a.balance_rel_threshold, 1.5);
    assert_eq!(a.eviction_interval_secs, 120);
    assert_eq!(a.max_tree_size, 1 << 26);
    assert_eq!(a.max_tree_bytes, 1 << 30);
    assert_eq!(a.block_size, 16, "vLLM's default block size");
    assert_eq!(a.load_poll_interval_ms, 50);
    assert_eq!(a.max_payload_size, 512 * 1024 * 1024);
    assert_eq!(a.intra_node_data_parallel_size, 1);
    assert_eq!(a.api_key, None);
    assert_eq!(a.worker_startup_timeout_secs, 600);
    assert_eq!(a.worker_startup_check_interval, 30);
    assert_eq!(a.request_timeout_secs, 1800);
    assert!(a.request_id_headers.is_empty());
    assert_eq!(a.max_concurrent_requests, 32768);
    assert_eq!(a.queue_size, 100);
    assert_eq!(a.queue_timeout_secs, 60);
    assert_eq!(a.rate_limit_tokens_per_second, None);
    assert_eq!(a.retry_max_retries, 5);
    assert_eq!(a.retry_initial_backoff_ms, 50);
    assert_eq!(a.retry_max_backoff_ms, 30000);
    assert_eq!(a.retry_backoff_multiplier, 1.5);
    assert_eq!(a.retry_jitter_factor, 0.2);
    assert!(!a.disable_retries);
    assert_eq!(a.cb_failure_threshold, 10);
    assert_eq!(a.cb_success_threshold, 3);
    assert_eq!(a.cb_timeout_duration_secs, 60);
    assert_eq!(a.cb_window_duration_secs, 120);
    assert!(!a.disable_circuit_breaker);
    assert_eq!(a.health_failure_threshold, 3);
    assert_eq!(a.health_success_threshold, 2);
    assert_eq!(a.health_check_timeout_secs, 5);
    assert_eq!(a.health_check_interval_secs, 60);
    assert_eq!(a.health_check_endpoint, "/health");
    assert_eq!(a.prometheus_host, "127.0.0.1");
    assert_eq!(a.prometheus_port, 29000);
    assert_eq!(a.log_level, LogLevel::Info);
    assert_eq!(a.log_dir, None);
    assert!(!a.log_json);
    assert!(a.cors_allowed_origins.is_empty());
    assert!(!a.service_discovery);
    assert!(a.selector.is_empty() && a.prefill_selector.is_empty() && a.decode_selector.is_empty());
    assert_eq!(a.service_discovery_port, 80);
    assert_eq!(a.service_discovery_namespace, None);
    assert_eq!(a.admin_api_key, None);
    assert_eq!(a.shutdown_grace_period_secs, 30);
    assert_eq!(a.config, None);
    assert_eq!(a.sim_workers, 4);
    assert_eq!(a.sim_pd, None);
    assert_eq!(a.sim_time_scale, 1.0);
    assert_eq!(a.backend, BackendName::Vllm);
}

#[test]
fn no_arguments_at_all_means_four_simulated_engines() {
    let s = settings(&[]).unwrap();
    assert_eq!(s.mode, Mode::Simulated { engines: 4 });
    assert_eq!(s.bind_address(), "127.0.0.1:30000");
    assert!(s.ignored.is_empty());
}

#[test]
fn explicit_simulator_flags_start_simulated_engines() {
    let s = settings(&["--sim-workers", "2"]).unwrap();
    assert_eq!(s.mode, Mode::Simulated { engines: 2 });
    // The default count, given explicitly, still asks for engines.
    let s = settings(&["--port", "8000", "--sim-workers", "4"]).unwrap();
    assert_eq!(s.mode, Mode::Simulated { engines: 4 });
    let s = settings(&["--policy", "round_robin", "--sim-pd", "1:2"]).unwrap();
    assert_eq!(
        s.mode,
        Mode::SimulatedPd {
            prefill: 1,
            decode: 2
        }
    );
    let path = temp_file("sim.toml", "sim-workers = 3\nport = 8000\n");
    let s = settings(&["--config", path.to_str().unwrap()]).unwrap();
    assert_eq!(s.mode, Mode::Simulated { engines: 3 });
    std::fs::remove_file(path).unwrap();
}

#[test]
fn flags_without_a_worker_source_start_an_empty_fleet_as_vllm_routers_do() {
    let empty = Mode::Workers { urls: vec![] };
    for args in [
        // vllm-router's own harness command line.
        &[
            "--host",
            "127.0.0.1",
            "--port",
            "8000",
            "--policy",
            "round_robin",
            "--prometheus-port",
            "29001",
        ][..],
        &["--port", "8000"],
        &["--log-level", "debug"],
        // A simulator setting alone does not ask for engines.
        &["--sim-time-scale", "0"],
        // `--worker-urls` with no URL.
        &["--worker-urls"],
    ] {
        let s = settings(args).unwrap();
        assert_eq!(s.mode, empty, "{args:?}");
    }
    let path = temp_file("port.toml", "port = 8000\npolicy = \"random\"\n");
    let s = settings(&["--config", path.to_str().unwrap()]).unwrap();
    assert_eq!(s.mode, empty, "a config file without a worker source");
    std::fs::remove_file(path).unwrap();
}

#[test]
fn help_says_when_simulated_engines_start_and_when_the_fleet_is_empty() {
    let Err(CliError::Clap(help)) = settings(&["--help"]) else {
        panic!("--help prints the help")
    };
    // As printed, with the line wrapping undone.
    let help = help
        .to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    for needle in [
        "With no arguments at all it starts four simulated engines",
        "--sim-workers N or --sim-pd P:D",
        "starts an empty fleet",
        "POST /add_worker",
    ] {
        assert!(
            help.contains(needle),
            "{needle:?} missing from --help:\n{help}"
        );
    }
}

#[test]
fn defaults_map_onto_the_router_config() {
    let s = settings(&[]).unwrap();
    let c = &s.router;
    assert_eq!(c.policy.name, "cache_aware");
    assert_eq!(c.policy.cache_aware.cache_threshold, 0.3);
    assert_eq!(c.policy.cache_aware.max_tree_size, 1 << 26);
    assert_eq!(c.policy.cache_aware.max_tree_bytes, 1 << 30);
    assert_eq!(c.max_payload_size, 512 << 20);
    assert_eq!(c.concurrency.max_concurrent, 32768);
    assert_eq!(c.concurrency.queue_size, 100);
    assert_eq!(c.concurrency.queue_timeout, Duration::from_secs(60));
    assert_eq!(c.request_timeout, Duration::from_secs(1800));
    assert_eq!(c.retry.max_retries, 5);
    assert_eq!(c.retry.initial_backoff, Duration::from_millis(50));
    assert_eq!(c.retry.max_backoff, Duration::from_secs(30));
    assert!(c.worker_options.breaker.enabled);
    assert_eq!(c.worker_options.breaker.failure_threshold, 10);
    assert_eq!(c.worker_options.breaker.success_threshold, 3);
    assert_eq!(
        c.worker_options.breaker.open_timeout,
        Duration::from_secs(60)
    );
    assert_eq!(c.worker_options.breaker.failure_rate, None);
    assert_eq!(c.health.interval, Duration::from_secs(60));
    assert_eq!(c.health.timeout, Duration::from_secs(5));
    assert_eq!(c.health_endpoint, "/health");
    assert_eq!(c.worker_startup_timeout, Duration::from_secs(600));
    assert_eq!(c.worker_startup_check_interval, Duration::from_secs(30));
    assert_eq!(c.shutdown_grace, Duration::from_secs(30));
    assert_eq!(c.api_key, None);
    assert_eq!(c.load_poll.interval, Some(Duration::from_millis(50)));
}

#[test]
fn the_load_poll_budget_bounds_the_polls_per_second_and_zero_lifts_it() {
    let s = settings(&[]).unwrap();
    assert_eq!(
        s.router.load_poll.max_polls_per_sec,
        router_http::load_poll::DEFAULT_MAX_POLLS_PER_SEC
    );
    // 1,000 engines at the default budget: a round every 500 ms.
    assert_eq!(
        s.router.load_poll.round_period(1_000),
        Duration::from_millis(500)
    );
    let s = settings(&["--load-poll-budget", "10000"]).unwrap();
    assert_eq!(s.router.load_poll.max_polls_per_sec, 10_000);
    assert_eq!(
        s.router.load_poll.round_period(1_000),
        Duration::from_millis(100)
    );
    let s = settings(&["--load-poll-budget", "0"]).unwrap();
    assert_eq!(
        s.router.load_poll.round_period(1_000),
        Duration::from_millis(50)
    );
    let err = settings(&["--load-poll-budget", "-5"]).unwrap_err();
    assert!(err.to_string().contains("--load-poll-budget"), "{err}");
    assert_eq!(err.exit_code(), 2);
}

#[test]
fn the_load_poll_interval_comes_from_its_flag_or_file_and_zero_turns_it_off() {
    let s = settings(&["--load-poll-interval-ms", "250"]).unwrap();
    assert_eq!(
        s.router.load_poll.interval,
        Some(Duration::from_millis(250))
    );
    assert!(s.summary().contains("load_poll=250ms"), "{}", s.summary());
    let s = settings(&["--load-poll-interval-ms", "0"]).unwrap();
    assert_eq!(s.router.load_poll.interval, None);
    assert!(s.summary().contains("load_poll=off"), "{}", s.summary());
    let path = temp_file("load_poll.toml", "load_poll_interval_ms = 0\n");
    let s = settings(&["--config", path.to_str().unwrap()]).unwrap();
    assert_eq!(s.router.load_poll.interval, None);
    // The command line wins over the file.
    let s = settings(&[
        "--config",
        path.to_str().unwrap(),
        "--load-poll-interval-ms",
        "100",
    ])
    .unwrap();
    assert_eq!(
        s.router.load_poll.interval,
        Some(Duration::from_millis(100))
    );
    std::fs::remove_file(path).unwrap();
    let err = settings(&["--load-poll-interval-ms", "-5"]).unwrap_err();
    assert_eq!(err.exit_code(), 2);
}

#[test]
fn flags_map_onto_the_router_config() {
    let s = settings(&[
        "--worker-urls",
        "http://127.0.0.1:8001",
        "http://127.0.0.1:8002/",
        "--policy",
        "power_of_two",
        "--cache-threshold",
        "0.5",
        "--balance-abs-threshold",
        "8",
        "--balance-rel-threshold",
        "2",
        "--eviction-interval",
        "30",
        "--max-tree-size",
        "1000",
        "--max-tree-bytes",
        "65536",
        "--max-payload-size",
        "1024",
        "--max-concurrent-requests",
        "7",
        "--queue-size",
        "0",
        "--queue-timeout-secs",
        "3",
        "--rate-limit-tokens-per-second",
        "12.5",
        "--api-key",
        "inference-secret",
        "--admin-api-key",
        "admin-secret",
        "--request-id-headers",
        "X-My-Id",
        "x-other",
        "--request-timeout-secs",
        "9",
        "--retry-max-retries",
        "1",
        "--retry-initial-backoff-ms",
        "10",
        "--retry-max-backoff-ms",
        "100",
        "--retry-backoff-multiplier",
        "3",
        "--retry-jitter-factor",
        "0",
        "--cb-failure-threshold",
        "2",
        "--cb-success-threshold",
        "1",
        "--cb-timeout-duration-secs",
        "7",
        "--cb-window-duration-secs",
        "30",
        "--health-failure-threshold",
        "4",
        "--health-success-threshold",
        "5",
        "--health-check-timeout-secs",
        "6",
        "--health-check-interval-secs",
        "8",
        "--health-check-endpoint",
        "/ping",
        "--worker-startup-timeout-secs",
        "11",
        "--worker-startup-check-interval",
        "2",
        "--shutdown-grace-period-secs",
        "4",
        "--intra-node-data-parallel-size",
        "2",
    ])
    .unwrap();
    assert_eq!(
        s.mode,
        Mode::Workers {
            urls: vec![
                "http://127.0.0.1:8001".into(),
                "http://127.0.0.1:8002".into()
            ]
        }
    );
    let c = &s.router;
    assert_eq!(c.policy.name, "power_of_two");
    assert_eq!(c.policy.cache_aware.cache_threshold, 0.5);
    assert_eq!(c.policy.cache_aware.balance_abs_threshold, 8);
    assert_eq!(c.policy.cache_aware.balance_rel_threshold, 2.0);
    assert_eq!(
        c.policy.cache_aware.eviction_interval,
        Duration::from_secs(30)
    );
    assert_eq!(c.eviction_interval, Duration::from_secs(30));
    assert_eq!(c.policy.cache_aware.max_tree_size, 1000);
    assert_eq!(c.policy.cache_aware.max_tree_bytes, 65536);
    assert_eq!(c.max_payload_size, 1024);
    assert_eq!(c.concurrency.max_concurrent, 7);
    assert_eq!(c.concurrency.queue_size, 0);
    assert_eq!(c.concurrency.queue_timeout, Duration::from_secs(3));
    assert_eq!(c.rate_limit_per_second, Some(12.5));
    assert_eq!(c.api_key.as_deref(), Some("inference-secret"));
    assert_eq!(c.admin_api_key.as_deref(), Some("admin-secret"));
    assert_eq!(c.request_id_headers, vec!["x-my-id", "x-other"]);
    assert_eq!(c.request_timeout, Duration::from_secs(9));
    assert_eq!(c.retry.max_retries, 1);
    assert_eq!(c.retry.initial_backoff, Duration::from_millis(10));
    assert_eq!(c.retry.max_backoff, Duration::from_millis(100));
    assert_eq!(c.retry.multiplier, 3.0);
    assert_eq!(c.retry.jitter, 0.0);
    let breaker = &c.worker_options.breaker;
    assert_eq!(breaker.failure_threshold, 2);
    assert_eq!(breaker.success_threshold, 1);
    assert_eq!(breaker.open_timeout, Duration::from_secs(7));
    assert_eq!(
        breaker.failure_rate.as_ref().unwrap().window,
        Duration::from_secs(30)
    );
    assert_eq!(c.health.failure_threshold, 4);
    assert_eq!(c.health.success_threshold, 5);
    assert_eq!(c.health.timeout, Duration::from_secs(6));
    assert_eq!(c.health.interval, Duration::from_secs(8));
    assert_eq!(c.health_endpoint, "/ping");
    assert_eq!(c.worker_startup_timeout, Duration::from_secs(11));
    assert_eq!(c.worker_startup_check_interval, Duration::from_secs(2));
    assert_eq!(c.shutdown_grace, Duration::from_secs(4));
    assert_eq!(s.args.intra_node_data_parallel_size, 2);
    // The start-up line shows that keys are set, never the keys.
    let summary = s.summary();
    assert!(summary.contains("api_key=set") && summary.contains("admin_api_key=set"));
    assert!(!summary.contains("secret"), "{summary}");
}

#[test]
fn disable_flags_turn_retries_and_breakers_off() {
    let s = settings(&["--disable-retries", "--disable-circuit-breaker"]).unwrap();
    assert_eq!(s.router.retry.max_retries, 0);
    assert!(!s.router.worker_options.breaker.enabled);
}

#[test]
fn every_policy_name_is_accepted() {
    for name in [
        "random",
        "round_robin",
        "cache_aware",
        "power_of_two",
        "consistent_hash",
        "rendezvous_hash",
        "least_loaded",
    ] {
        let s = settings(&["--policy", name]).unwrap();
        assert_eq!(s.router.policy.name, name);
        affinity_router::http::Router::new(s.router.clone()).unwrap();
    }
}

#[test]
fn prefill_decode_flags_parse_fully() {
    let s = settings(&[
        "--vllm-pd-disaggregation",
        "--prefill",
        "http://p0:8000",
        "9000",
        "--prefill",
        "http://p1:8000",
        "none",
        "--prefill",
        "http://p2:8000",
        "--decode",
        "http://d0:8000",
        "--decode",
        "http://d1:8000",
        "--prefill-policy",
        "power_of_two",
        "--kv-connector",
        "mooncake",
    ])
    .unwrap();
    let Mode::PrefillDecode(pd) = s.mode else {
        panic!("not P/D: {:?}", s.mode)
    };
    assert_eq!(
        pd.prefill,
        vec![
            ("http://p0:8000".to_owned(), Some(9000)),
            ("http://p1:8000".to_owned(), None),
            ("http://p2:8000".to_owned(), None),
        ]
    );
    assert_eq!(pd.decode, vec!["http://d0:8000", "http://d1:8000"]);
    assert_eq!(pd.prefill_policy, PolicyName::PowerOfTwo);
    assert_eq!(pd.decode_policy, PolicyName::CacheAware);
    assert_eq!(pd.kv_connector, PdConnector::Mooncake { concurrent: true });

    let s = settings(&[
        "--vllm-pd-disaggregation",
        "--vllm-discovery-address",
        "0.0.0.0:30001",
    ])
    .unwrap();
    let Mode::PrefillDecode(pd) = s.mode else {
        panic!()
    };
    assert_eq!(pd.discovery.as_deref(), Some("0.0.0.0:30001"));

    let s = settings(&["--sim-pd", "2:3", "--kv-connector", "moriio"]).unwrap();
    assert_eq!(
        s.mode,
        Mode::SimulatedPd {
            prefill: 2,
            decode: 3
        }
    );
}

/// Each bad command line exits 2 and its message names the flag.
#[test]
fn bad_values_exit_2_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["--cache-threshold", "1.5"], "--cache-threshold"),
        (&["--cache-threshold", "-0.1"], "--cache-threshold"),
        (
            &["--balance-rel-threshold", "0.5"],
            "--balance-rel-threshold",
        ),
        (&["--retry-jitter-factor", "2"], "--retry-jitter-factor"),
        (
            &["--retry-backoff-multiplier", "0.5"],
            "--retry-backoff-multiplier",
        ),
        (
            &["--rate-limit-tokens-per-second", "0"],
            "--rate-limit-tokens-per-second",
        ),
        (
            &["--max-concurrent-requests", "0"],
            "--max-concurrent-requests",
        ),
        (
            &["--intra-node-data-parallel-size", "0"],
            "--intra-node-data-parallel-size",
        ),
        (&["--cb-failure-threshold", "0"], "--cb-failure-threshold"),
        (
            &["--health-success-threshold", "0"],
            "--health-success-threshold",
        ),
        (
            &["--health-check-endpoint", "health"],
            "--health-check-endpoint",
        ),
        (
            &["--eviction-interval-secs", "0"],
            "--eviction-interval-secs",
        ),
        (
            &["--request-id-headers", "bad header"],
            "--request-id-headers",
        ),
        (&["--worker-urls", "127.0.0.1:8000"], "--worker-urls"),
        (&["--worker-urls", "ftp://host:1"], "--worker-urls"),
        (&["--worker-urls", "http://h:99999"], "--worker-urls"),
        (
            &["--worker-urls", "http://a:1", "http://a:1"],
            "--worker-urls",
        ),
        (&["--prefill", "http://p:1"], "--prefill"),
        (&["--decode", "http://d:1"], "--decode"),
        (&["--kv-connector", "mooncake"], "--kv-connector"),
        (&["--prefill-policy", "random"], "--prefill-policy"),
        (
            &["--vllm-discovery-address", "0.0.0.0:30001"],
            "--vllm-discovery-address",
        ),
        (&["--vllm-pd-disaggregation"], "--vllm-pd-disaggregation"),
        (
            &["--vllm-pd-disaggregation", "--prefill", "http://p:1"],
            "--decode",
        ),
        (
            &[
                "--vllm-pd-disaggregation",
                "--prefill",
                "http://p:1",
                "70000",
                "--decode",
                "http://d:1",
            ],
            "--prefill",
        ),
        (
            &[
                "--vllm-pd-disaggregation",
                "--vllm-discovery-address",
                "nohost",
            ],
            "--vllm-discovery-address",
        ),
        (
            &[
                "--vllm-pd-disaggregation",
                "--worker-urls",
                "http://a:1",
                "--decode",
                "http://d:1",
            ],
            "--worker-urls",
        ),
        (
            &["--vllm-discovery-ttl-secs", "3"],
            "--vllm-discovery-ttl-secs",
        ),
        (
            &[
                "--vllm-pd-disaggregation",
                "--vllm-discovery-address",
                "127.0.0.1:1",
                "--decode",
                "http://d:1",
            ],
            "--decode",
        ),
        (
            &[
                "--vllm-pd-disaggregation",
                "--prefill",
                "http://p:1",
                "--decode",
                "http://d:1",
                "--kv-connector",
                "moriio",
            ],
            "--kv-connector",
        ),
        (
            &[
                "--vllm-pd-disaggregation",
                "--prefill",
                "9000",
                "--decode",
                "http://d:1",
            ],
            "--prefill",
        ),
        (&["--sim-pd", "2"], "--sim-pd"),
        (&["--sim-pd", "0:1"], "--sim-pd"),
        (
            &["--sim-pd", "1:1", "--worker-urls", "http://a:1"],
            "--sim-pd",
        ),
        (
            &["--sim-workers", "2", "--worker-urls", "http://a:1"],
            "--sim-workers",
        ),
        (&["--sim-time-scale", "-1"], "--sim-time-scale"),
        (&["--service-discovery"], "--service-discovery"),
        (&["--backend", "openai"], "--backend"),
        (&["--host", ""], "--host"),
    ];
    for (argv, flag) in cases {
        let err = settings(argv).expect_err(&format!("{argv:?} should be refused"));
        assert_eq!(err.exit_code(), 2, "{argv:?}: {err}");
        assert!(
            err.to_string().contains(flag),
            "{argv:?}: the message {err:?} should name {flag}"
        );
    }
}

/// Values clap itself refuses: the same exit code, clap's message.
#[test]
fn unparsable_values_exit_2_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["--port", "http"], "--port"),
        (&["--port", "70000"], "--port"),
        (&["--policy", "sticky_least_loaded"], "--policy"),
        (&["--kv-connector", "rdma"], "--kv-connector"),
        (&["--log-level", "loud"], "--log-level"),
        (&["--cache-threshold", "high"], "--cache-threshold"),
        (&["--no-such-flag"], "--no-such-flag"),
    ];
    for (argv, flag) in cases {
        let err = settings(argv).expect_err(&format!("{argv:?} should be refused"));
        assert_eq!(err.exit_code(), 2, "{argv:?}");
        let CliError::Clap(clap_error) = &err else {
            panic!("{argv:?}: {err:?}")
        };
        let rendered = clap_error.render().to_string();
        assert!(rendered.contains(flag), "{argv:?}: {rendered}");
    }
}

/// `--kv-connector` is read by `PdConnector`'s own parser: every name it
/// knows (and `moriio`, short for `moriio-read`) on the command line and in
/// a config file; an unknown one refused with the accepted names.
#[test]
fn kv_connector_names_are_pd_connectors_own() {
    for name in PdConnector::NAMES.into_iter().chain(["moriio"]) {
        let expected: PdConnector = name.parse().unwrap();
        let s = settings(&["--sim-pd", "1:1", "--kv-connector", name]).unwrap();
        assert_eq!(s.args.kv_connector, expected, "{name}");
        let path = temp_file("connector.toml", &format!("kv_connector = {name:?}\n"));
        let s = settings(&["--sim-pd", "1:1", "--config", path.to_str().unwrap()]).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(s.args.kv_connector, expected, "{name} in a config file");
        // A dumped configuration names it canonically.
        assert!(
            settings::to_toml(&s.args)
                .contains(&format!("kv_connector = \"{}\"", expected.as_str())),
            "{name}"
        );
    }

    let Err(CliError::Clap(err)) = settings(&["--kv-connector", "rdma"]) else {
        panic!("rdma accepted")
    };
    assert_eq!(err.exit_code(), 2);
    let rendered = err.render().to_string();
    assert!(rendered.contains("'rdma'"), "{rendered}");
    for name in PdConnector::NAMES {
        assert!(rendered.contains(name), "{name} missing from {rendered}");
    }
    let path = temp_file("bad-connector.toml", "kv_connector = \"rdma\"\n");
    let err = settings(&["--config", path.to_str().unwrap()]).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(err.exit_code(), 2);
    let message = err.to_string();
    assert!(message.contains("kv_connector"), "{message}");
    assert!(message.contains("moriio-write"), "{message}");

    let help = Args::command().render_long_help().to_string();
    let possible = format!("[possible values: {}]", PdConnector::NAMES.join(", "));
    assert!(help.contains(&possible), "{help}");
}

#[test]
fn help_and_version_exit_0() {
    for flag in ["--help", "--version"] {
        let err = settings(&[flag]).unwrap_err();
        assert_eq!(err.exit_code(), 0);
    }
    let CliError::Clap(version) = settings(&["--version"]).unwrap_err() else {
        panic!()
    };
    assert!(
        version
            .render()
            .to_string()
            .contains(env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn flags_with_no_effect_are_reported_not_refused() {
    let s = settings(&[
        "--cors-allowed-origins",
        "https://a.example",
        "--selector",
        "app=vllm",
        "--service-discovery-port",
        "8000",
        "--otel-sampling-ratio",
        "0.5",
    ])
    .unwrap();
    assert_eq!(
        s.ignored,
        vec![
            "--cors-allowed-origins",
            "--otel-sampling-ratio",
            "--selector",
            "--service-discovery-port"
        ]
    );
}

#[test]
fn vllm_routers_trace_flags_turn_tracing_on() {
    let off = settings(&[]).unwrap();
    assert!(!off.router.trace.enabled);
    assert!(off.trace_export.is_none());

    let s = settings(&[
        "--enable-trace",
        "--otlp-traces-endpoint",
        "collector:4317",
        "--otel-sampling-ratio",
        "0.25",
        "--otel-excluded-paths",
        "/health,/metrics",
        "--otel-excluded-paths",
        "/liveness",
    ])
    .unwrap();
    assert!(s.ignored.is_empty(), "{:?}", s.ignored);
    assert!(s.router.trace.enabled);
    assert_eq!(
        s.router.trace.excluded_paths,
        ["/health", "/metrics", "/liveness"]
    );
    assert_eq!(s.router.trace.sampling_ratio, 0.25);
    // As in vllm-router: OTLP/gRPC, a bare HOST:PORT in cleartext.
    let export = s.trace_export.unwrap();
    assert_eq!(export.protocol, Protocol::Grpc);
    assert_eq!(export.endpoint, "http://collector:4317");
    assert_eq!(export.ca_file, None);

    // vllm-router's default endpoint, over gRPC.
    let default = settings(&["--enable-trace"]).unwrap().trace_export.unwrap();
    assert_eq!(
        (default.protocol, default.endpoint.as_str()),
        (Protocol::Grpc, "http://localhost:4317")
    );

    // The endpoint's scheme says TLS or not; --otlp-traces-protocol says
    // gRPC or HTTP/protobuf.
    for (args, protocol, endpoint) in [
        (
            &["https://collector:4317"][..],
            Protocol::Grpc,
            "https://collector:4317",
        ),
        (
            &["grpc://collector:4317"],
            Protocol::Grpc,
            "http://collector:4317",
        ),
        (
            &["http://collector:4317", "--otlp-traces-protocol", "grpc"],
            Protocol::Grpc,
            "http://collector:4317",
        ),
        (
            &["collector:4318", "--otlp-traces-protocol", "http/protobuf"],
            Protocol::HttpProtobuf,
            "http://collector:4318/v1/traces",
        ),
        (
            &[
                "https://collector/otlp/v1/traces",
                "--otlp-traces-protocol",
                "http/protobuf",
            ],
            Protocol::HttpProtobuf,
            "https://collector/otlp/v1/traces",
        ),
    ] {
        let mut argv = vec!["--enable-trace", "--otlp-traces-endpoint"];
        argv.extend_from_slice(args);
        let export = settings(&argv).unwrap().trace_export.unwrap();
        assert_eq!(
            (export.protocol, export.endpoint.as_str()),
            (protocol, endpoint),
            "{args:?}"
        );
    }
    let http_default = settings(&["--enable-trace", "--otlp-traces-protocol", "http/protobuf"])
        .unwrap()
        .trace_export
        .unwrap();
    assert_eq!(http_default.endpoint, "http://localhost:4318/v1/traces");

    // A CA file to trust for an https:// collector.
    let ca = temp_file("otlp-ca.pem", "-----BEGIN CERTIFICATE-----\n");
    let ca_path = ca.to_str().unwrap();
    let tls = settings(&[
        "--enable-trace",
        "--otlp-traces-endpoint",
        "https://collector:4317",
        "--otlp-traces-ca-file",
        ca_path,
    ])
    .unwrap()
    .trace_export
    .unwrap();
    assert_eq!(tls.ca_file.as_deref(), Some(ca.as_path()));

    // The config file has the same keys as the flags.
    let file = temp_file(
        "trace.toml",
        "enable_trace = true\notlp_traces_endpoint = \"http://c:4318/v1/traces\"\n\
         otlp_traces_protocol = \"http/protobuf\"\n\
         otel_sampling_ratio = 0.5\notel_excluded_paths = [\"/metrics\"]\n",
    );
    let from_file = settings(&["--config", file.to_str().unwrap()]).unwrap();
    assert!(from_file.router.trace.enabled);
    assert_eq!(from_file.router.trace.excluded_paths, ["/metrics"]);
    assert_eq!(from_file.router.trace.sampling_ratio, 0.5);
    let export = from_file.trace_export.unwrap();
    assert_eq!(export.protocol, Protocol::HttpProtobuf);
    assert_eq!(export.endpoint, "http://c:4318/v1/traces");
    let _ = std::fs::remove_file(file);

    // Without --enable-trace the new flags are reported as ignored.
    let ignored = settings(&["--otlp-traces-protocol", "grpc"]).unwrap();
    assert!(ignored.trace_export.is_none());
    assert_eq!(ignored.ignored, ["--otlp-traces-protocol"]);

    let missing = std::env::temp_dir().join("affinity-router-no-such-ca.pem");
    let missing = missing.to_str().unwrap();
    for (args, flag) in [
        (
            &["--enable-trace", "--otel-sampling-ratio", "1.5"][..],
            "--otel-sampling-ratio: ",
        ),
        (
            &["--enable-trace", "--otel-sampling-ratio", "-0.1"],
            "--otel-sampling-ratio: ",
        ),
        (
            // A path is OTLP/HTTP's: over gRPC (the default) it is refused.
            &[
                "--enable-trace",
                "--otlp-traces-endpoint",
                "http://c:4318/v1/traces",
            ],
            "--otlp-traces-endpoint: ",
        ),
        (
            &["--enable-trace", "--otlp-traces-endpoint", "ftp://c:4317"],
            "--otlp-traces-endpoint: ",
        ),
        (
            &[
                "--enable-trace",
                "--otlp-traces-endpoint",
                "grpc://c:4317",
                "--otlp-traces-protocol",
                "http/protobuf",
            ],
            "--otlp-traces-endpoint: ",
        ),
        (
            &["--enable-trace", "--otlp-traces-protocol", "http/json"],
            "--otlp-traces-protocol: ",
        ),
        (
            &["--enable-trace", "--otlp-traces-protocol", "thrift"],
            "--otlp-traces-protocol: ",
        ),
        (
            // A CA file for a cleartext endpoint would secure nothing.
            &["--enable-trace", "--otlp-traces-ca-file", ca_path],
            "--otlp-traces-ca-file: ",
        ),
        (
            &[
                "--enable-trace",
                "--otlp-traces-endpoint",
                "https://c:4317",
                "--otlp-traces-ca-file",
                missing,
            ],
            "--otlp-traces-ca-file: ",
        ),
        (
            &["--enable-trace", "--otel-excluded-paths", "health"],
            "--otel-excluded-paths: ",
        ),
    ] {
        let err = settings(args).unwrap_err();
        let message = err.to_string();
        assert!(message.starts_with(flag), "{args:?}: {message}");
        assert_eq!(err.exit_code(), 2);
    }
    let _ = std::fs::remove_file(ca);
}

#[test]
fn fleet_guard_shares_come_from_their_flags() {
    let defaults = settings(&["--worker-urls", "http://127.0.0.1:9"]).unwrap();
    assert_eq!(
        defaults.router.worker_options.fleet,
        worker_lifecycle::FleetGuard::default()
    );
    let set = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--cb-max-exclusion",
        "1.0",
        "--pool-panic-threshold",
        "0",
    ])
    .unwrap();
    assert_eq!(
        set.router.worker_options.fleet,
        worker_lifecycle::FleetGuard::off()
    );
    let every_pool = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--pool-guard-min-workers",
        "1",
    ])
    .unwrap();
    assert_eq!(every_pool.router.worker_options.fleet.min_workers, 1);
    assert_eq!(defaults.router.worker_options.fleet.min_workers, 3);
    for (flag, value) in [
        ("--cb-max-exclusion", "1.5"),
        ("--pool-panic-threshold", "-0.1"),
    ] {
        let message = settings(&["--worker-urls", "http://127.0.0.1:9", flag, value])
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with(&format!("{flag}: must be between 0.0 and 1.0")),
            "{message}"
        );
    }
}

#[test]
fn a_config_file_round_trips() {
    let args = Args {
        host: "0.0.0.0".into(),
        port: 31000,
        worker_urls: vec![
            "http://127.0.0.1:9001".into(),
            "http://127.0.0.1:9002".into(),
        ],
        policy: PolicyName::ConsistentHash,
        cache_threshold: 0.75,
        balance_rel_threshold: 3.0,
        api_key: Some("k".into()),
        rate_limit_tokens_per_second: Some(99.5),
        request_id_headers: vec!["x-id".into()],
        disable_retries: true,
        cb_window_duration_secs: 45,
        health_check_endpoint: "/healthz".into(),
        log_level: LogLevel::Debug,
        log_json: true,
        cors_allowed_origins: vec!["*".into()],
        sim_workers: 1,
        ..Args::default()
    };
    let text = settings::to_toml(&args);
    let path = temp_file("roundtrip.toml", &text);
    let parsed = settings::parse_from(["router", "--config", path.to_str().unwrap()]).unwrap();
    let mut back = parsed.args;
    assert_eq!(back.config.as_deref(), path.to_str());
    back.config = None;
    assert_eq!(back, args, "file:\n{text}");
    // And once more: what the file produced renders to the same file.
    assert_eq!(settings::to_toml(&back), text);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_dump_of_the_defaults_selects_nothing() {
    let path = temp_file("defaults.toml", &settings::to_toml(&Args::default()));
    // Only `--config` is given: no worker source, so an empty fleet.
    let s = settings(&["--config", path.to_str().unwrap()]).unwrap();
    assert_eq!(s.mode, Mode::Workers { urls: vec![] });
    assert!(s.ignored.is_empty(), "{:?}", s.ignored);
    // ... and flags still combine with it as without a file.
    let s = settings(&[
        "--config",
        path.to_str().unwrap(),
        "--worker-urls",
        "http://127.0.0.1:9001",
    ])
    .unwrap();
    assert_eq!(
        s.mode,
        Mode::Workers {
            urls: vec!["http://127.0.0.1:9001".into()]
        }
    );
    std::fs::remove_file(path).unwrap();
}

#[test]
fn flags_on_the_command_line_win_over_the_file() {
    let path = temp_file(
        "override.toml",
        "port = 1234\nworker-urls = [\"http://127.0.0.1:9001\"]\npolicy = \"random\"\n\
         api_key = \"from-file\"\n",
    );
    let s = settings(&[
        "--config",
        path.to_str().unwrap(),
        "--port",
        "4321",
        "--policy",
        "round_robin",
    ])
    .unwrap();
    assert_eq!(s.args.port, 4321);
    assert_eq!(s.router.policy.name, "round_robin");
    assert_eq!(
        s.mode,
        Mode::Workers {
            urls: vec!["http://127.0.0.1:9001".into()]
        }
    );
    assert_eq!(s.router.api_key.as_deref(), Some("from-file"));
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_bad_config_file_exits_2_naming_the_setting() {
    let cases = [
        ("no_such_setting = 1\n", "no_such_setting"),
        ("port = \"high\"\n", "port"),
        ("cache_threshold = 2.0\n", "--cache-threshold"),
        ("prefill = [\"http://p:1\"]\n", "--prefill"),
        ("this is not toml", "--config"),
    ];
    for (text, expected) in cases {
        let path = temp_file("bad.toml", text);
        let err = settings(&["--config", path.to_str().unwrap()]).unwrap_err();
        assert_eq!(err.exit_code(), 2, "{text}");
        assert!(err.to_string().contains(expected), "{text}: {err}");
        std::fs::remove_file(path).unwrap();
    }
    let err = settings(&["--config", "/nonexistent/affinity-router.toml"]).unwrap_err();
    assert!(err.to_string().starts_with("--config"), "{err}");
}

/// docs/operations.md lists every flag clap knows, and no flag it does not.
#[test]
fn the_operations_guide_documents_every_flag() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let command = Args::command();
    let mut known = Vec::new();
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let flag = format!("--{long}");
        assert!(
            doc.contains(&format!("`{flag}")),
            "docs/operations.md does not document {flag}"
        );
        known.push(flag);
        for alias in arg.get_all_aliases().unwrap_or_default() {
            assert!(
                doc.contains(&format!("--{alias}")),
                "alias --{alias} is undocumented"
            );
            known.push(format!("--{alias}"));
        }
    }
    known.extend(["--help".to_owned(), "--version".to_owned()]);
    // Every flag in a table row of the reference is one clap knows.
    for line in doc.lines().filter(|l| l.starts_with("| `--")) {
        let flag = line[3..]
            .split('`')
            .next()
            .unwrap()
            .split(' ')
            .next()
            .unwrap();
        assert!(
            known.iter().any(|k| k == flag),
            "docs/operations.md documents unknown {flag}"
        );
    }
}

#[test]
fn worker_networks_are_parsed_or_refused_with_the_flag_named() {
    let s = settings(&["--worker-networks", "10.0.0.0/8", "fd00::/8"]).unwrap();
    let printed: Vec<String> = s
        .router
        .worker_networks
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(printed, ["10.0.0.0/8", "fd00::/8"]);
    assert!(settings(&[]).unwrap().router.worker_networks.is_empty());
    let err = settings(&["--worker-networks", "10.0.0.0/40"]).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("--worker-networks"), "{message}");
    assert!(message.contains("10.0.0.0/40"), "{message}");
    assert_ne!(err.exit_code(), 0);
}

#[test]
fn hardening_flags_map_onto_the_router_and_server_config() {
    let defaults = settings(&[]).unwrap().router;
    assert_eq!(defaults.request_body_timeout, Duration::from_secs(60));
    assert_eq!(
        defaults.server.header_read_timeout,
        Some(Duration::from_secs(30))
    );
    assert_eq!(defaults.server.max_connections, 16384);
    assert!(defaults.passthrough_paths.is_empty());

    let s = settings(&[
        "--request-body-timeout-secs",
        "5",
        "--header-read-timeout-secs",
        "0",
        "--max-connections",
        "64",
        "--passthrough-paths",
        "/version",
        "/v1/audio/*",
    ])
    .unwrap();
    assert_eq!(s.router.request_body_timeout, Duration::from_secs(5));
    assert_eq!(s.router.server.header_read_timeout, None, "0 turns it off");
    assert_eq!(s.router.server.max_connections, 64);
    assert_eq!(s.router.passthrough_paths, ["/version", "/v1/audio/*"]);

    for (args, flag) in [
        (
            &["--passthrough-paths", "version"][..],
            "--passthrough-paths",
        ),
        (
            &["--passthrough-paths", "/v1/../admin"][..],
            "--passthrough-paths",
        ),
        (&["--max-connections", "0"][..], "--max-connections"),
        (
            &["--request-body-timeout-secs", "0"][..],
            "--request-body-timeout-secs",
        ),
    ] {
        let err = settings(args).unwrap_err();
        assert!(err.to_string().contains(flag), "{args:?}: {err}");
        assert_eq!(err.exit_code(), 2, "{args:?}");
    }
}

#[test]
fn block_size_reaches_cache_aware_and_zero_is_refused() {
    let s = settings(&["--worker-urls", "http://127.0.0.1:9", "--block-size", "32"]).unwrap();
    assert_eq!(s.router.policy.cache_aware.block_size, 32);
    let message = settings(&["--block-size", "0"]).unwrap_err().to_string();
    assert!(
        message.starts_with("--block-size: must be at least 1"),
        "{message}"
    );
}

#[test]
fn kv_events_flags_and_worker_tables_say_where_engines_publish() {
    // Defaults: vLLM's example ports on each worker's host, replay on.
    let s = settings(&[
        "--worker-urls",
        "http://10.0.0.5:8000",
        "--policy",
        "kv_aware",
    ])
    .unwrap();
    assert_eq!(s.router.policy.name, "kv_aware");
    assert_eq!(s.router.kv_events.port, 5557);
    assert_eq!(s.router.kv_events.replay_port, Some(5558));
    assert!(s.router.kv_events.endpoints.is_empty());

    let path = temp_file(
        "kv.toml",
        "kv-events-port = 6000\nkv_events_replay_port = 0\nkv_events_topic = \"kv\"\n\
         [workers.\"http://10.0.0.5:8000\"]\nkv_events_endpoint = \"tcp://10.0.0.9:7000\"\n\
         kv-events-replay-endpoint = \"tcp://10.0.0.9:7001\"\n",
    );
    let s = settings(&[
        "--worker-urls",
        "http://10.0.0.5:8000",
        "--config",
        path.to_str().unwrap(),
    ]);
    std::fs::remove_file(&path).unwrap();
    let kv = s.unwrap().router.kv_events;
    assert_eq!(
        (kv.port, kv.replay_port, kv.topic.as_str()),
        (6000, None, "kv")
    );
    let own = &kv.endpoints["http://10.0.0.5:8000"];
    assert_eq!(own.publishers, ["tcp://10.0.0.9:7000"]);
    assert_eq!(own.replays, ["tcp://10.0.0.9:7001"]);

    // A bad table stops the start naming it.
    for (table, expected) in [
        (
            "[workers.\"ftp://x\"]\nkv_events_endpoint = \"tcp://a:1\"\n",
            "ftp://x",
        ),
        (
            "[workers.\"http://a:1\"]\nkv_events_endpoint = \"a:1\"\n",
            "`a:1` is not a tcp://HOST:PORT",
        ),
        (
            "[workers.\"http://a:1\"]\nkv_events_endpoint = \"tcp://a:1\"\nweight = 2\n",
            "unknown field `weight`",
        ),
    ] {
        let path = temp_file("bad-kv.toml", table);
        let err = settings(&["--config", path.to_str().unwrap()]).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        let message = err.to_string();
        assert!(message.contains(expected), "{message}");
        assert!(message.contains("workers"), "{message}");
    }
}

#[test]
fn the_tokenizer_pool_and_budget_come_from_their_flags() {
    let defaults = settings(&["--worker-urls", "http://127.0.0.1:9"]).unwrap();
    assert_eq!(
        defaults.router.tokenize,
        router_http::tokens::TokenizeConfig::default()
    );
    let set = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--tokenizer-threads",
        "3",
        "--tokenize-max-bytes",
        "65536",
        "--tokenize-max-secs",
        "0.5",
        "--tokenize-inline-bytes",
        "1024",
    ])
    .unwrap();
    let tokenize = &set.router.tokenize;
    assert_eq!(tokenize.threads, 3);
    assert_eq!(tokenize.max_bytes, 65536);
    assert_eq!(tokenize.max_time, std::time::Duration::from_millis(500));
    assert_eq!(tokenize.inline_bytes, 1024);
    for (flag, value) in [
        ("--tokenizer-threads", "0"),
        ("--tokenize-max-bytes", "0"),
        ("--tokenize-max-secs", "0"),
        ("--tokenize-max-secs", "NaN"),
        ("--tokenize-max-secs", "-1"),
    ] {
        let err = settings(&["--worker-urls", "http://127.0.0.1:9", flag, value]).unwrap_err();
        assert!(err.to_string().starts_with(&format!("{flag}: ")), "{err}");
        assert_eq!(err.exit_code(), 2);
    }
}

#[test]
fn zmq_and_kv_index_bounds_come_from_their_flags() {
    let defaults = settings(&["--worker-urls", "http://127.0.0.1:9"]).unwrap();
    assert_eq!(defaults.args.zmq_max_message_size, 64 * 1024);
    assert_eq!(defaults.router.kv_events.max_message_size, 16 << 20);
    assert_eq!(
        defaults.router.kv_events.max_blocks_per_worker,
        kv_block_index::DEFAULT_MAX_BLOCKS_PER_HOLDER
    );
    let set = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--kv-events-max-message-size",
        "4096",
        "--kv-index-max-blocks-per-worker",
        "28000",
    ])
    .unwrap();
    assert_eq!(set.router.kv_events.max_message_size, 4096);
    assert_eq!(set.router.kv_events.max_blocks_per_worker.get(), 28_000);
    for flag in [
        "--zmq-max-message-size",
        "--kv-events-max-message-size",
        "--kv-index-max-blocks-per-worker",
    ] {
        let err = settings(&["--worker-urls", "http://127.0.0.1:9", flag, "0"]).unwrap_err();
        assert!(err.to_string().starts_with(&format!("{flag}: ")), "{err}");
        assert_eq!(err.exit_code(), 2);
    }
}

#[test]
fn kv_aware_cost_flags_reach_the_policy_and_bad_values_are_refused() {
    // Defaults: lb-policies' load weight, no softmax.
    let s = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--policy",
        "kv_aware",
    ])
    .unwrap();
    let cost = s.router.policy.cache_aware.cost;
    assert_eq!(cost.load_weight, lb_policies::DEFAULT_LOAD_WEIGHT);
    assert_eq!(cost.eviction_weight, lb_policies::DEFAULT_EVICTION_WEIGHT);
    assert_eq!(cost.temperature, 0.0);
    // vllm-router 0.1.17's --router-temperature, and the load weight.
    let s = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--policy",
        "kv_aware",
        "--router-temperature",
        "0.25",
        "--kv-aware-load-weight",
        "4",
        "--kv-aware-eviction-weight",
        "1.5",
    ])
    .unwrap();
    let cost = s.router.policy.cache_aware.cost;
    assert_eq!((cost.load_weight, cost.temperature), (4.0, 0.25));
    assert_eq!(cost.eviction_weight, 1.5);
    // The gate by name, for comparison.
    let s = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--policy",
        "kv_aware_gate",
    ])
    .unwrap();
    assert_eq!(s.router.policy.name, "kv_aware_gate");
    // cache_aware's cost mode by name, with the same knobs as kv_aware's.
    let s = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--policy",
        "cache_aware_cost",
        "--kv-aware-load-weight",
        "8",
    ])
    .unwrap();
    assert_eq!(s.router.policy.name, "cache_aware_cost");
    assert_eq!(s.router.policy.cache_aware.cost.load_weight, 8.0);
    for (flag, value) in [
        ("--router-temperature", "-1"),
        ("--router-temperature", "inf"),
        ("--kv-aware-load-weight", "NaN"),
        ("--kv-aware-load-weight", "-0.5"),
        ("--kv-aware-eviction-weight", "-1"),
        ("--kv-aware-eviction-weight", "NaN"),
    ] {
        let message = settings(&["--worker-urls", "http://127.0.0.1:9", flag, value])
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with(&format!("{flag}: must be a finite number >= 0")),
            "{flag} {value}: {message}"
        );
    }
}

#[test]
fn kv_penalty_flags_set_what_a_lower_tier_block_is_worth_and_bad_values_are_refused() {
    // Defaults: lb-policies' (host 0.25, disk and external 0.5).
    let s = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--policy",
        "kv_aware",
    ])
    .unwrap();
    let penalties = s.router.policy.cache_aware.cost.penalties;
    assert_eq!(penalties, lb_policies::TierPenalties::default());
    assert_eq!(penalties.host, lb_policies::DEFAULT_HOST_PENALTY);
    // vllm-router 0.1.17's three flags, each to its tier.
    let s = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--policy",
        "kv_aware",
        "--kv-penalty-host",
        "0.1",
        "--kv-penalty-disk",
        "0.7",
        "--kv-penalty-external",
        "1",
    ])
    .unwrap();
    let penalties = s.router.policy.cache_aware.cost.penalties;
    assert_eq!(
        (penalties.host, penalties.disk, penalties.external),
        (0.1, 0.7, 1.0)
    );
    // What they mean: past the GPU prefix, a block held in host memory
    // saves 1 - 0.1 of its prefill; external at 1 saves nothing.
    let lower = lb_policies::LowerPrefix([6, 0, 10]);
    assert!((penalties.credit(2, &lower) - (2.0 + 4.0 * 0.9)).abs() < 1e-9);
    for flag in [
        "--kv-penalty-host",
        "--kv-penalty-disk",
        "--kv-penalty-external",
    ] {
        for value in ["1.5", "-0.1", "NaN"] {
            let err = settings(&["--worker-urls", "http://127.0.0.1:9", flag, value]).unwrap_err();
            assert!(
                err.to_string()
                    .starts_with(&format!("{flag}: must be between 0.0 and 1.0")),
                "{flag} {value}: {err}"
            );
            assert_eq!(err.exit_code(), 2);
        }
    }
}

#[test]
fn kv_aware_session_affinity_ttl_sets_how_long_an_idle_session_sticks() {
    // Off by default.
    let s = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--policy",
        "kv_aware",
    ])
    .unwrap();
    assert!(s.router.policy.cache_aware.session_affinity_ttl.is_zero());
    // vllm-router 0.1.17's flag: seconds of idle time.
    let s = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--policy",
        "kv_aware",
        "--kv-aware-session-affinity-ttl-secs",
        "300",
    ])
    .unwrap();
    assert_eq!(
        s.router.policy.cache_aware.session_affinity_ttl,
        std::time::Duration::from_secs(300)
    );
    for value in ["-1", "ten", "1.5"] {
        let err = settings(&[
            "--worker-urls",
            "http://127.0.0.1:9",
            "--kv-aware-session-affinity-ttl-secs",
            value,
        ])
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("--kv-aware-session-affinity-ttl-secs"),
            "{value}: {err}"
        );
        assert_eq!(err.exit_code(), 2, "{value}");
    }
}

#[test]
fn router_peers_share_choices_with_a_token_and_refuse_without_one() {
    // Off by default: no peers, no token, no endpoint.
    let s = settings(&["--worker-urls", "http://127.0.0.1:9"]).unwrap();
    assert!(s.router.peers.urls.is_empty());
    assert_eq!(s.router.peers.token, None);
    let s = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--router-peers",
        "http://10.0.0.2:30000",
        "http://10.0.0.3:30000",
        "--router-peer-token",
        "s3cret",
        "--router-peer-batch-ms",
        "20",
    ])
    .unwrap();
    let peers = &s.router.peers;
    assert_eq!(
        peers.urls,
        ["http://10.0.0.2:30000", "http://10.0.0.3:30000"]
    );
    assert_eq!(peers.token.as_deref(), Some("s3cret"));
    assert_eq!(peers.batch_interval, std::time::Duration::from_millis(20));
    // Peers without a token, a peer that is not an http:// URL, a zero
    // interval: refused, naming the setting.
    for args in [
        &["--router-peers", "http://10.0.0.2:30000"][..],
        &[
            "--router-peers",
            "ftp://10.0.0.2",
            "--router-peer-token",
            "t",
        ],
        &[
            "--router-peers",
            "http://10.0.0.2:30000",
            "--router-peer-token",
            "t",
            "--router-peer-batch-ms",
            "0",
        ],
    ] {
        let mut all = vec!["--worker-urls", "http://127.0.0.1:9"];
        all.extend_from_slice(args);
        let message = settings(&all).unwrap_err().to_string();
        assert!(
            message.starts_with("--router-peers:"),
            "{args:?}: {message}"
        );
    }
}

#[test]
fn kv_aware_overload_flags_set_the_state_and_bad_values_are_refused() {
    let s = settings(&["--worker-urls", "http://127.0.0.1:9"]).unwrap();
    let cost = s.router.policy.cache_aware.cost;
    assert_eq!(
        (cost.overload_enter, cost.overload_leave),
        (
            lb_policies::DEFAULT_OVERLOAD_ENTER,
            lb_policies::DEFAULT_OVERLOAD_LEAVE
        )
    );
    let s = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--policy",
        "kv_aware",
        "--kv-aware-overload-enter",
        "24",
        "--kv-aware-overload-leave",
        "8",
    ])
    .unwrap();
    let cost = s.router.policy.cache_aware.cost;
    assert_eq!((cost.overload_enter, cost.overload_leave), (24.0, 8.0));
    let message = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--kv-aware-overload-enter",
        "-1",
    ])
    .unwrap_err()
    .to_string();
    assert!(message.starts_with("--kv-aware-overload-enter: must be a finite number >= 0"));
    // Leaving above entering is no hysteresis.
    let message = settings(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "--kv-aware-overload-enter",
        "4",
        "--kv-aware-overload-leave",
        "8",
    ])
    .unwrap_err()
    .to_string();
    assert!(message.contains("overload_leave"), "{message}");
}
