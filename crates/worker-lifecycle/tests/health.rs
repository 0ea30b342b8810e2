//! Health checks under paused tokio time: they change health, never load.
#![cfg(not(loom))]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use worker_lifecycle::{
    Endpoint, HealthCheckConfig, HealthChecker, HealthProbe, ProbeError, Worker, WorkerOptions,
    WorkerRole, WorkerSpec,
};

fn workers(n: usize) -> Vec<Arc<Worker>> {
    (0..n)
        .map(|i| {
            let endpoint = Endpoint::new(&format!("http://127.0.0.1:{}", 9000 + i), None).unwrap();
            Worker::new(
                WorkerSpec::new(WorkerRole::Regular, endpoint),
                1,
                &WorkerOptions::default(),
            )
        })
        .collect()
}

/// Healthy or not as the flag says; counts probes and the most probes in
/// flight at once; takes `delay` per probe.
#[derive(Default)]
struct FlagProbe {
    healthy: AtomicBool,
    probes: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    delay: Duration,
}

impl HealthProbe for FlagProbe {
    async fn probe(&self, _worker: &Worker) -> Result<(), ProbeError> {
        self.probes.fetch_add(1, Ordering::SeqCst);
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(self.delay).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        if self.healthy.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(ProbeError::Unhealthy("flag".into()))
        }
    }
}

fn config() -> HealthCheckConfig {
    HealthCheckConfig {
        interval: Duration::from_secs(10),
        timeout: Duration::from_secs(2),
        failure_threshold: 2,
        success_threshold: 2,
        max_concurrency: 4,
    }
}

#[tokio::test(start_paused = true)]
async fn a_thousand_flapping_cycles_leave_in_flight_load_unchanged() {
    let fleet = workers(3);
    let guards: Vec<_> = fleet
        .iter()
        .enumerate()
        .flat_map(|(i, w)| (0..=i + 4).map(|_| w.reserve()).collect::<Vec<_>>())
        .collect();
    let loads: Vec<usize> = fleet.iter().map(|w| w.load()).collect();
    assert_eq!(loads, [5, 6, 7]);

    let probe = Arc::new(FlagProbe::default());
    let checker = Arc::new(HealthChecker::new(probe.clone(), config()));
    let list: Arc<[Arc<Worker>]> = fleet.clone().into();
    let task = checker.clone().spawn(move || list.clone());

    let mut became_unhealthy = 0;
    let mut was_healthy = true;
    for cycle in 0..1_000u32 {
        // Flap: 3 cycles healthy, 3 unhealthy.
        probe.healthy.store((cycle / 3) % 2 == 0, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(10)).await;
        let healthy = fleet[0].is_healthy();
        if was_healthy && !healthy {
            became_unhealthy += 1;
        }
        was_healthy = healthy;
        let now: Vec<usize> = fleet.iter().map(|w| w.load()).collect();
        assert_eq!(now, loads, "cycle {cycle}: health checks never touch load");
    }
    task.abort();
    assert!(probe.probes.load(Ordering::SeqCst) >= 3 * 999);
    assert!(
        became_unhealthy > 100,
        "health really flapped ({became_unhealthy})"
    );
    assert!(fleet.iter().all(|w| w.underflows() == 0));
    drop(guards);
    assert!(fleet.iter().all(|w| w.load() == 0 && w.underflows() == 0));
}

#[tokio::test(start_paused = true)]
async fn thresholds_flip_health_after_consecutive_results() {
    let fleet = workers(1);
    let probe = Arc::new(FlagProbe::default());
    let checker = HealthChecker::new(probe.clone(), config());
    let w = &fleet[0];
    let _in_flight = w.reserve();

    probe.healthy.store(false, Ordering::SeqCst);
    let r = checker.check_once(&fleet).await;
    assert_eq!((r.probed, r.failed), (1, 1));
    assert!(w.is_healthy(), "one failure is below the threshold");
    let r = checker.check_once(&fleet).await;
    assert_eq!(r.became_unhealthy, [w.key().to_owned()]);
    assert!(!w.is_healthy() && !w.is_available());
    assert_eq!(w.load(), 1, "the in-flight guard is still counted");

    probe.healthy.store(true, Ordering::SeqCst);
    checker.check_once(&fleet).await;
    assert!(!w.is_healthy());
    let r = checker.check_once(&fleet).await;
    assert_eq!(r.became_healthy, [w.key().to_owned()]);
    assert!(w.is_healthy() && w.is_available());
    assert_eq!(w.load(), 1, "recovery does not reset load");
}

#[tokio::test(start_paused = true)]
async fn probes_run_concurrently_up_to_the_bound_and_time_out() {
    let fleet = workers(10);
    let probe = Arc::new(FlagProbe {
        healthy: AtomicBool::new(true),
        delay: Duration::from_secs(1),
        ..FlagProbe::default()
    });
    let checker = HealthChecker::new(probe.clone(), config());
    let start = tokio::time::Instant::now();
    let r = checker.check_once(&fleet).await;
    assert_eq!((r.probed, r.failed), (10, 0));
    assert_eq!(
        probe.max_in_flight.load(Ordering::SeqCst),
        4,
        "bounded at max_concurrency"
    );
    // 10 probes of 1 s, 4 at a time: 3 rounds.
    assert_eq!(start.elapsed(), Duration::from_secs(3));

    let slow = Arc::new(FlagProbe {
        healthy: AtomicBool::new(true),
        delay: Duration::from_secs(60),
        ..FlagProbe::default()
    });
    let checker = HealthChecker::new(slow, config());
    let start = tokio::time::Instant::now();
    let r = checker.check_once(&fleet[..4]).await;
    assert_eq!(r.failed, 4, "a probe past its timeout fails");
    assert_eq!(start.elapsed(), Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn removed_workers_are_not_probed() {
    let fleet = workers(3);
    fleet[1].mark_removed();
    let probe = Arc::new(FlagProbe::default());
    let checker = HealthChecker::new(probe.clone(), config());
    let r = checker.check_once(&fleet).await;
    assert_eq!(r.probed, 2);
    assert_eq!(probe.probes.load(Ordering::SeqCst), 2);
}
