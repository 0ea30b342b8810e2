//! The simulator's `kv_aware` policy (scored on the engines' own KV events)
//! and its router replicas: each replica has its own policy state, so
//! approximate cache-aware trees diverge while block indexes fed by the
//! same engine events agree.

use std::time::Duration;

use fleet_sim::{
    LoadPolling, PdSplit, PreparedTrace, RoutingSource, RunReport, SimConfig, SimError, report,
    simulate, split_policy, workload,
};

/// 4 engines of 1,024 KV blocks (16 tokens each) under 48 chat sessions:
/// the sessions' histories do not all fit, so engines evict.
fn pressured(replicas: usize) -> SimConfig {
    let mut config = SimConfig {
        workers: 4,
        replicas,
        ..SimConfig::default()
    };
    config.model.num_blocks = 1_024;
    // A replica sees about 1/R of each engine's in-flight requests: the
    // absolute load margin scaled to its share (see docs/benchmarks.md).
    config.cache_aware.balance_abs_threshold = 64 / replicas.max(1);
    config
}

fn trace(config: &SimConfig) -> PreparedTrace {
    let trace = workload::multi_turn(&workload::MultiTurnConfig {
        requests: 1_000,
        rate: 60.0,
        active_sessions: 48,
        ..workload::MultiTurnConfig::default()
    });
    PreparedTrace::new(&trace, &config.model)
}

fn run(policy: &str, config: &SimConfig) -> RunReport {
    let report = simulate(&trace(config), policy, config, &|_| {}).unwrap();
    assert_eq!(report.policy, policy);
    assert_eq!(report.replicas, config.replicas);
    let m = &report.metrics;
    assert_eq!((m.completed, m.rejected), (1_000, 0), "{policy}");
    assert!(
        report.final_loads.iter().all(|&l| l == 0),
        "{policy}: loads {:?} after the run",
        report.final_loads
    );
    let decided: u64 = report.decisions.iter().map(|(_, n)| n).sum();
    assert_eq!(decided, 1_000, "{policy}: {:?}", report.decisions);
    report
}

fn count(report: &RunReport, reason: &str) -> u64 {
    report
        .decisions
        .iter()
        .find(|(r, _)| r == reason)
        .map_or(0, |(_, n)| *n)
}

#[test]
fn kv_aware_routes_on_tokens_from_the_engines_events() {
    assert_eq!(
        split_policy("kv_aware").unwrap(),
        ("kv_aware", RoutingSource::Tokens)
    );
    let config = pressured(1);
    let kv = run("kv_aware", &config);
    // Exact scores from the index, not the fallback tree: every worker's
    // stream is live from the start.
    assert!(count(&kv, "kv_hit") > 900, "{:?}", kv.decisions);
    assert_eq!(count(&kv, "cache_hit"), 0, "{:?}", kv.decisions);
    let round_robin = run("round_robin", &config);
    assert!(
        kv.metrics.hit_rate > round_robin.metrics.hit_rate + 0.2,
        "kv_aware {:.3} vs round_robin {:.3}",
        kv.metrics.hit_rate,
        round_robin.metrics.hit_rate
    );
    // Events that arrive only after the run are no help: every decision
    // is then a low match, placed by load alone (the overload state off:
    // under it the fallback tree's memory would place sessions, as
    // cache_aware's does).
    let mut blind_config = SimConfig {
        kv_event_delay: Duration::from_secs(3_600),
        ..config.clone()
    };
    blind_config.cache_aware.cost.overload_enter = 0.0;
    let blind = run("kv_aware", &blind_config);
    assert_eq!(count(&blind, "kv_hit"), 0, "{:?}", blind.decisions);
    assert!(
        blind.metrics.hit_rate < kv.metrics.hit_rate - 0.2,
        "blind {:.3} vs fed {:.3}",
        blind.metrics.hit_rate,
        kv.metrics.hit_rate
    );
    // Runs are deterministic: the policy's decisions depend only on the
    // simulated state.
    assert_eq!(run("kv_aware", &config), kv);
}

#[test]
fn with_four_replicas_kv_aware_keeps_its_hits_and_cache_aware_loses_them() {
    let one = pressured(1);
    // Replicas that do not share their routing choices.
    let four = SimConfig {
        replica_sync: None,
        ..pressured(4)
    };
    let cache_1 = run("cache_aware:tokens", &one).metrics;
    let cache_4 = run("cache_aware:tokens", &four).metrics;
    let kv_1 = run("kv_aware", &one).metrics;
    let kv_4 = run("kv_aware", &four).metrics;
    eprintln!("cache_aware:tokens R=1 {cache_1:?}\nR=4 {cache_4:?}");
    eprintln!("kv_aware R=1 {kv_1:?}\nR=4 {kv_4:?}");
    let cache_drop = cache_1.hit_rate - cache_4.hit_rate;
    let kv_drop = kv_1.hit_rate - kv_4.hit_rate;
    // Four replicas' trees each saw a quarter of every session's turns ...
    assert!(
        cache_drop > 0.1,
        "cache_aware:tokens {:.3} -> {:.3}",
        cache_1.hit_rate,
        cache_4.hit_rate
    );
    assert!(cache_4.routing_loss > 0.1, "{cache_4:?}");
    // ... while every replica's index holds what the engines hold.
    assert!(
        kv_drop < 0.5 * cache_drop,
        "kv_aware {:.3} -> {:.3}, cache_aware:tokens {:.3} -> {:.3}",
        kv_1.hit_rate,
        kv_4.hit_rate,
        cache_1.hit_rate,
        cache_4.hit_rate
    );
    assert!(kv_4.routing_loss < 0.03, "{kv_4:?}");
}

#[test]
fn replicas_that_share_their_choices_keep_cache_awares_hits() {
    let one = pressured(1);
    let alone = SimConfig {
        replica_sync: None,
        ..pressured(4)
    };
    // The default: every choice reaches the other replicas 10 ms later.
    let shared = pressured(4);
    assert_eq!(shared.replica_sync, Some(Duration::from_millis(10)));
    let cache_1 = run("cache_aware:tokens", &one).metrics;
    let cache_alone = run("cache_aware:tokens", &alone).metrics;
    let cache_shared = run("cache_aware:tokens", &shared).metrics;
    eprintln!("R=1 {cache_1:?}\nR=4 alone {cache_alone:?}\nR=4 shared {cache_shared:?}");
    // Each tree learns every replica's choices, so the four trees are one
    // memory again: the hit rate of one replica, not of four strangers.
    assert!(
        cache_shared.hit_rate > cache_alone.hit_rate + 0.05,
        "shared {:.3} vs alone {:.3}",
        cache_shared.hit_rate,
        cache_alone.hit_rate
    );
    assert!(
        (cache_shared.hit_rate - cache_1.hit_rate).abs() < 0.03,
        "shared {:.3} vs one replica {:.3}",
        cache_shared.hit_rate,
        cache_1.hit_rate
    );
    assert!(
        cache_shared.routing_loss < cache_alone.routing_loss,
        "{cache_shared:?} vs {cache_alone:?}"
    );
}

/// 4 engines of the default model near their capacity: where a replica
/// that sees only its own quarter of each engine's load lets one engine's
/// queue grow.
fn loaded(replicas: usize, load_polling: LoadPolling) -> (SimConfig, PreparedTrace) {
    let config = SimConfig {
        workers: 4,
        replicas,
        load_polling,
        ..SimConfig::default()
    };
    let trace = workload::multi_turn(&workload::MultiTurnConfig {
        requests: 2_000,
        rate: 120.0,
        active_sessions: 48,
        ..workload::MultiTurnConfig::default()
    });
    let prepared = PreparedTrace::new(&trace, &config.model);
    (config, prepared)
}

#[test]
fn engine_reported_load_gives_four_replicas_the_tail_of_one() {
    let ttft_p99 = |policy: &str, replicas, polling| {
        let (config, trace) = loaded(replicas, polling);
        let report = simulate(&trace, policy, &config, &|_| {}).unwrap();
        assert_eq!(report.metrics.completed, 2_000, "R={replicas} {polling:?}");
        assert!(
            report.final_loads.iter().all(|&l| l == 0),
            "R={replicas} {polling:?}: {:?} {:?}",
            report.final_loads,
            report.metrics
        );
        report.metrics.ttft_p99_ms
    };
    let polled = LoadPolling::Every {
        interval: Duration::from_millis(50),
        delay: Duration::from_millis(1),
    };
    for policy in ["kv_aware_gate", "kv_aware"] {
        let one = ttft_p99(policy, 1, polled);
        let blind = ttft_p99(policy, 4, LoadPolling::Off);
        let four = ttft_p99(policy, 4, polled);
        let oracle = ttft_p99(policy, 4, LoadPolling::Oracle);
        eprintln!(
            "{policy} TTFT p99: R=1 {one:.0} ms; R=4 blind {blind:.0}, polled {four:.0}, oracle {oracle:.0}"
        );
        // Each replica blind to the others' load lets queues grow.
        assert!(
            blind > 1.4 * one,
            "{policy}: R=4 blind {blind:.0} ms vs R=1 {one:.0} ms"
        );
        // With the engines' reports the replicas see what one router sees.
        // (The least-cost tail is tens of milliseconds, where a handful of
        // requests move p99: its bound is relative to the blind run too.)
        if policy == "kv_aware_gate" {
            assert!(
                four < 1.25 * one,
                "{policy}: R=4 {four:.0} ms vs R=1 {one:.0} ms"
            );
            assert!(
                oracle < 1.25 * one,
                "{policy}: oracle {oracle:.0} ms vs R=1 {one:.0} ms"
            );
        } else {
            assert!(
                four < 2.0 * one && four < 0.2 * blind,
                "{policy}: R=4 {four:.0} ms"
            );
            assert!(
                oracle < 2.0 * one && oracle < 0.2 * blind,
                "{policy}: oracle {oracle:.0} ms"
            );
        }
    }
}

#[test]
fn replicas_share_the_engines_and_report_their_count() {
    // Every policy works behind several replicas: the engines' true load
    // is the sum of the replicas' own counts, all released at the end.
    let config = SimConfig {
        workers: 3,
        replicas: 2,
        ..SimConfig::default()
    };
    let trace = workload::multi_turn(&workload::MultiTurnConfig {
        requests: 200,
        rate: 60.0,
        active_sessions: 24,
        ..workload::MultiTurnConfig::default()
    });
    let prepared = PreparedTrace::new(&trace, &config.model);
    let mut reports = Vec::new();
    for policy in ["round_robin", "least_loaded", "cache_aware", "kv_aware"] {
        let report = simulate(&prepared, policy, &config, &|_| {}).unwrap();
        assert_eq!(report.metrics.completed, 200, "{policy}");
        assert_eq!(report.final_loads, [0, 0, 0], "{policy}");
        let decided: u64 = report.decisions.iter().map(|(_, n)| n).sum();
        assert_eq!(decided, 200, "{policy}");
        // The timeline shows the engines' load, both replicas' requests.
        let peak = report.load_timeline.loads.iter().flatten().max().copied();
        assert!(peak.unwrap_or(0) > 0, "{policy}");
        reports.push(report);
    }
    let json = report::json_summary(&reports);
    for policy in ["round_robin", "least_loaded", "cache_aware", "kv_aware"] {
        assert_eq!(json["multi_turn"][policy]["replicas"], 2, "{json}");
        assert!(json["multi_turn"][policy]["hit_rate"].is_f64(), "{json}");
    }
}

#[test]
fn bad_replica_counts_are_refused() {
    let trace = workload::multi_turn(&workload::MultiTurnConfig {
        requests: 20,
        ..workload::MultiTurnConfig::default()
    });
    let none = SimConfig {
        replicas: 0,
        ..SimConfig::default()
    };
    let prepared = PreparedTrace::new(&trace, &none.model);
    let error = simulate(&prepared, "kv_aware", &none, &|_| {}).unwrap_err();
    assert!(matches!(error, SimError::Replicas), "{error}");
    let pd = SimConfig {
        replicas: 2,
        pd: Some(PdSplit {
            prefill: 1,
            decode: 1,
        }),
        ..SimConfig::default()
    };
    let error = simulate(&prepared, "round_robin", &pd, &|_| {}).unwrap_err();
    assert!(matches!(error, SimError::Replicas), "{error}");
    assert!(error.to_string().contains("prefill/decode"), "{error}");
}

#[test]
fn kv_aware_places_prefill_legs_under_pd() {
    // Under P/D the prefill engines' events feed the index; decode legs
    // follow the decode policy.
    let config = SimConfig {
        pd: Some(PdSplit {
            prefill: 2,
            decode: 2,
        }),
        ..SimConfig::default()
    };
    let trace = workload::multi_turn(&workload::MultiTurnConfig {
        requests: 200,
        rate: 40.0,
        active_sessions: 16,
        ..workload::MultiTurnConfig::default()
    });
    let prepared = PreparedTrace::new(&trace, &config.model);
    let report = simulate(&prepared, "kv_aware", &config, &|_| {}).unwrap();
    assert_eq!(report.metrics.completed, 200);
    assert_eq!(report.kv_transfers, (200, 0));
    assert_eq!(report.final_loads, [0, 0, 0, 0]);
    assert!(count(&report, "kv_hit") > 150, "{:?}", report.decisions);
}

#[test]
fn a_slow_engine_gets_less_work_and_the_cost_keeps_the_tail_short() {
    // 4 engines near capacity, the first at half speed.
    let (mut config, trace) = loaded(1, fleet_sim::DEFAULT_LOAD_POLLING);
    config.slow_engines = 1;
    let run = |policy: &str| {
        let report = simulate(&trace, policy, &config, &|_| {}).unwrap();
        assert_eq!(report.metrics.completed, 2_000, "{policy}");
        assert_eq!(report.placed.iter().sum::<usize>(), 2_000, "{policy}");
        report
    };
    let cost = run("kv_aware");
    let gate = run("kv_aware_gate");
    eprintln!(
        "placed: kv_aware {:?}, gate {:?}; TTFT p99 {:.0} against {:.0} ms",
        cost.placed, gate.placed, cost.metrics.ttft_p99_ms, gate.metrics.ttft_p99_ms
    );
    let fast_mean = cost.placed[1..].iter().sum::<usize>() as f64 / 3.0;
    assert!(
        (cost.placed[0] as f64) < 0.75 * fast_mean,
        "the slow engine took {} of {:?}",
        cost.placed[0],
        cost.placed
    );
    assert!(
        cost.metrics.ttft_p99_ms < gate.metrics.ttft_p99_ms,
        "kv_aware {:.0} ms against the gate's {:.0}",
        cost.metrics.ttft_p99_ms,
        gate.metrics.ttft_p99_ms
    );
    // A factor below 1 is refused.
    config.slow_factor = 0.5;
    assert!(matches!(
        simulate(&trace, "kv_aware", &config, &|_| {}),
        Err(SimError::SlowFactor)
    ));
}
