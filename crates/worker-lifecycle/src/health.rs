//! Active health checks that change health and nothing else.
//!
//! A [`HealthChecker`] probes workers through a [`HealthProbe`] (an HTTP
//! `GET /health` in the router, anything in tests), all of them
//! concurrently up to a bound, each under its own timeout. Consecutive
//! failures and successes flip a worker's health
//! ([`Worker::record_probe`]). It never reads or writes load: a failed probe
//! does not cancel in-flight work, so the load a worker carries when it
//! recovers is real and must not be reset.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::task::JoinHandle;

use crate::worker::{HealthChange, Worker};

/// Why a probe failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// The probe did not finish within the per-probe timeout.
    #[error("health probe timed out")]
    Timeout,
    /// The worker answered that it is not healthy.
    #[error("worker reported unhealthy: {0}")]
    Unhealthy(String),
    /// The probe could not reach the worker.
    #[error("health probe failed: {0}")]
    Unreachable(String),
}

/// Checks one worker's health. Implementations do the I/O.
pub trait HealthProbe: Send + Sync + 'static {
    /// Probes `worker` once. The checker applies the timeout; the probe need
    /// not.
    fn probe(&self, worker: &Worker) -> impl Future<Output = Result<(), ProbeError>> + Send;
}

/// A shared probe is a probe (so a test or a router can keep a handle).
impl<P: HealthProbe> HealthProbe for Arc<P> {
    fn probe(&self, worker: &Worker) -> impl Future<Output = Result<(), ProbeError>> + Send {
        (**self).probe(worker)
    }
}

/// Health-check settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheckConfig {
    /// Time between the starts of two check cycles.
    pub interval: Duration,
    /// Per-probe timeout.
    pub timeout: Duration,
    /// Consecutive failed probes that make a healthy worker unhealthy.
    pub failure_threshold: u32,
    /// Consecutive successful probes that make an unhealthy worker healthy.
    pub success_threshold: u32,
    /// Probes in flight at once, at most.
    pub max_concurrency: usize,
}

impl Default for HealthCheckConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
            failure_threshold: 3,
            success_threshold: 2,
            max_concurrency: 32,
        }
    }
}

/// What one cycle did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HealthReport {
    /// Workers probed.
    pub probed: usize,
    /// Probes that failed (including timeouts).
    pub failed: usize,
    /// Keys of workers that became unhealthy.
    pub became_unhealthy: Vec<String>,
    /// Keys of workers that became healthy.
    pub became_healthy: Vec<String>,
}

/// Periodic, concurrent health checks.
#[derive(Debug)]
pub struct HealthChecker<P> {
    probe: P,
    config: HealthCheckConfig,
}

impl<P: HealthProbe> HealthChecker<P> {
    /// A checker using `probe`. Zero thresholds or concurrency are treated
    /// as 1.
    pub fn new(probe: P, mut config: HealthCheckConfig) -> Self {
        config.failure_threshold = config.failure_threshold.max(1);
        config.success_threshold = config.success_threshold.max(1);
        config.max_concurrency = config.max_concurrency.max(1);
        Self { probe, config }
    }

    /// The settings in force.
    pub fn config(&self) -> &HealthCheckConfig {
        &self.config
    }

    /// Probes every worker once (concurrently, bounded) and applies the
    /// results. Removed workers are skipped.
    pub async fn check_once(&self, workers: &[Arc<Worker>]) -> HealthReport {
        // The futures are built eagerly so that the stream's type holds no
        // closure (keeps the spawned loop `Send` for every lifetime).
        let probes: Vec<_> = workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.lifecycle() != crate::Lifecycle::Removed)
            .map(|(index, worker)| self.probe_one(index, worker))
            .collect();
        let results: Vec<(usize, bool)> = futures_util::stream::iter(probes)
            .buffer_unordered(self.config.max_concurrency)
            .collect()
            .await;

        let mut report = HealthReport {
            probed: results.len(),
            ..HealthReport::default()
        };
        for (index, ok) in results {
            let worker = &workers[index];
            if !ok {
                report.failed += 1;
            }
            match worker.record_probe(
                ok,
                self.config.failure_threshold,
                self.config.success_threshold,
            ) {
                Some(HealthChange::BecameUnhealthy) => {
                    tracing::info!(worker = worker.key(), "worker became unhealthy");
                    report.became_unhealthy.push(worker.key().to_owned());
                }
                Some(HealthChange::BecameHealthy) => {
                    tracing::info!(worker = worker.key(), "worker became healthy");
                    report.became_healthy.push(worker.key().to_owned());
                }
                None => {}
            }
        }
        report
    }

    async fn probe_one(&self, index: usize, worker: &Worker) -> (usize, bool) {
        let ok = matches!(
            tokio::time::timeout(self.config.timeout, self.probe.probe(worker)).await,
            Ok(Ok(()))
        );
        (index, ok)
    }

    /// Runs [`check_once`](Self::check_once) every `interval` on the workers
    /// `workers()` returns at each tick, until the returned task is aborted.
    /// A slow cycle delays the next one instead of overlapping it.
    pub fn spawn<F>(self: Arc<Self>, workers: F) -> JoinHandle<()>
    where
        F: Fn() -> Arc<[Arc<Worker>]> + Send + Sync + 'static,
    {
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(self.config.interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let current = workers();
                self.check_once(&current).await;
            }
        })
    }
}
