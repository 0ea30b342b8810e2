//! One run

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::args::{Args, RunSpec};
use super::body::{BodyTemplate, SplitMix64};
use super::children::{
    Proc, engine_url, get_status, log_tail, router_url, socket_addr, spawn_child, wait_for_line,
};
use super::clients::{Recorder, load_connection, probe_loop};
use super::histogram::window;
use super::procfs::{MIB, cpu_ticks, loadavg, read_status, status_field, ticks_per_second};
use super::summary::{Second, Summary, quantile_ms, steady};

/// Everything a run needs that does not change between runs.
pub(super) struct Setup {
    pub(super) router_bin: PathBuf,
    pub(super) engine_bin: PathBuf,
    pub(super) engine_flags: Vec<String>,
    pub(super) log_dir: PathBuf,
    pub(super) template: Arc<BodyTemplate>,
}

/// Why a run ended early.
pub(super) enum Stop {
    Failed(String),
    Interrupted,
}

impl From<String> for Stop {
    fn from(message: String) -> Self {
        Stop::Failed(message)
    }
}

/// Set once the soak is asked to stop (Ctrl-C or SIGTERM): every wait of a
/// run watches it, so the run ends, and its children die, at once.
#[derive(Clone)]
pub(super) struct Interrupt(tokio::sync::watch::Receiver<bool>);

impl Interrupt {
    /// Listens for the signals on the current (control) runtime.
    pub(super) fn install() -> Self {
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            stop_signal().await;
            let _ = tx.send(true);
        });
        Self(rx)
    }

    pub(super) fn is_set(&self) -> bool {
        *self.0.borrow()
    }

    async fn wait(&mut self) {
        let _ = self.0.wait_for(|set| *set).await;
    }
}

/// Resolves when the soak is asked to stop (Ctrl-C or SIGTERM).
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn runtime(threads: usize, name: &str) -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the {name} runtime: {e}"))
}

/// One run: fresh engines and router, `--duration` seconds of load, the
/// summary. The children are killed when this returns, whatever happened.
pub(super) async fn run_one(
    interrupt: &Interrupt,
    args: &Args,
    setup: &Setup,
    index: usize,
    spec: &RunSpec,
    series: &mut Option<std::fs::File>,
) -> Result<Summary, Stop> {
    let loadavg_start = loadavg();
    // Declared before the router: on an early return the router is killed
    // before its engines.
    let mut engines: Vec<Proc> = Vec::with_capacity(args.workers);
    let mut receivers = Vec::with_capacity(args.workers);
    for i in 0..args.workers {
        let mut engine_args: Vec<String> = [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--time-scale",
            "0",
            "--seed",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        engine_args.push(i.to_string());
        engine_args.extend(setup.engine_flags.iter().cloned());
        let log = setup
            .log_dir
            .join(format!("run{}-engine{i}.log", index + 1));
        let (proc, rx) = spawn_child(
            &format!("engine-sim #{i}"),
            &setup.engine_bin,
            &engine_args,
            log,
            engine_url,
        )?;
        engines.push(proc);
        receivers.push(rx);
    }
    let mut urls = Vec::with_capacity(args.workers);
    for (proc, rx) in engines.iter_mut().zip(&receivers) {
        urls.push(wait_for_line(interrupt, proc, rx, Duration::from_secs(30), "its URL").await?);
    }

    let mut router_args: Vec<String> = ["--host", "127.0.0.1", "--port", "0"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    if !spec
        .flags
        .iter()
        .any(|f| f == "--prometheus-port" || f.starts_with("--prometheus-port="))
    {
        router_args.extend(["--prometheus-port".to_owned(), "0".to_owned()]);
    }
    router_args.push("--policy".to_owned());
    router_args.push(spec.policy.clone());
    router_args.extend(spec.flags.iter().cloned());
    // Last: --worker-urls takes every value up to the next flag.
    router_args.push("--worker-urls".to_owned());
    router_args.extend(urls.iter().cloned());
    let log = setup.log_dir.join(format!("run{}-router.log", index + 1));
    let (mut router, rx) = spawn_child("router", &setup.router_bin, &router_args, log, router_url)?;
    let url = wait_for_line(
        interrupt,
        &mut router,
        &rx,
        Duration::from_secs(120),
        "its banner",
    )
    .await?;
    let addr = socket_addr(&url)?;
    let ready_deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if interrupt.is_set() {
            return Err(Stop::Interrupted);
        }
        router.check_alive()?;
        if get_status(addr, "/readiness").await == Ok(200) {
            break;
        }
        if Instant::now() > ready_deadline {
            return Err(Stop::Failed(format!(
                "the router at {url} did not answer /readiness 200 within 60 s; its output:\n{}",
                log_tail(&router.log, 15)
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let router_pid = router.pid();
    let engine_pids: Vec<u32> = engines.iter().map(Proc::pid).collect();
    let rss_of = |pid| read_status(pid).and_then(|s| status_field(&s, "VmRSS"));
    let rss_start = rss_of(router_pid)
        .ok_or_else(|| format!("cannot read /proc/{router_pid}/status (VmRSS)"))?;
    if !args.json {
        eprintln!(
            "run {}: {} on {url} (pid {router_pid}), {} engines; {} s of load",
            index + 1,
            spec.label(),
            args.workers,
            args.duration
        );
    }

    let load = Arc::new(Recorder::new(u64::MAX));
    let probe = Arc::new(Recorder::new(args.probe_slow_ms * 1000));
    let load_rt = runtime(args.threads, "soak-load")?;
    let probe_rt = match runtime(1, "soak-probe") {
        Ok(rt) => rt,
        Err(e) => {
            // Not dropped in place: dropping a runtime blocks, which an
            // async context refuses.
            load_rt.shutdown_background();
            return Err(Stop::Failed(e));
        }
    };
    let ticks = ticks_per_second();
    let cpu = |pids: &[u32]| -> u64 { pids.iter().filter_map(|p| cpu_ticks(*p)).sum() };
    let self_pid = std::process::id();
    let cpu_start = [cpu(&[router_pid]), cpu(&engine_pids), cpu(&[self_pid])];
    let started = Instant::now();
    for c in 0..args.connections {
        let seed = args
            .seed
            .wrapping_mul(0x1000_0000_01b3)
            .wrapping_add(((index as u64) << 32) | c as u64);
        load_rt.spawn(load_connection(
            addr,
            setup.template.clone(),
            load.clone(),
            SplitMix64(seed).next_u64(),
        ));
    }
    probe_rt.spawn(probe_loop(
        addr,
        args.model.clone(),
        args.max_tokens,
        Duration::from_millis(args.probe_interval_ms),
        probe.clone(),
    ));

    let mut rss = vec![rss_start as f64 / MIB];
    let mut previous = (load.latency.snapshot(), probe.latency.snapshot(), 0u64);
    let mut outcome: Result<(), Stop> = Ok(());
    let mut interrupted = interrupt.clone();
    for t in 1..=args.duration {
        let at = started + Duration::from_secs(t);
        tokio::select! {
            () = tokio::time::sleep_until(at.into()) => {}
            () = interrupted.wait() => {
                outcome = Err(Stop::Interrupted);
                break;
            }
        }
        if let Err(e) = router.check_alive() {
            outcome = Err(Stop::Failed(format!("the router died during the run: {e}")));
            break;
        }
        let now = (
            load.latency.snapshot(),
            probe.latency.snapshot(),
            load.errors(),
        );
        let load_w = window(&now.0, &previous.0);
        let probe_w = window(&now.1, &previous.1);
        let rss_mib = rss_of(router_pid).map_or(f64::NAN, |b| b as f64 / MIB);
        if rss_mib.is_finite() {
            rss.push(rss_mib);
        }
        let window_max = load.window_max.swap(0, Ordering::Relaxed);
        let second = Second {
            t,
            requests: load_w.iter().sum(),
            errors: now.2 - previous.2,
            p50_ms: quantile_ms(&load_w, 0.5, window_max),
            p99_ms: quantile_ms(&load_w, 0.99, window_max),
            max_ms: window_max as f64 / 1000.0,
            probes: probe_w.iter().sum(),
            probe_max_ms: probe.window_max.swap(0, Ordering::Relaxed) as f64 / 1000.0,
            rss_mib,
        };
        if let Some(file) = series.as_mut() {
            let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.3}"));
            let _ = writeln!(
                file,
                "{},{},\"{}\",{},{},{},{},{},{:.3},{},{:.3},{:.1}",
                index + 1,
                spec.policy,
                spec.flags.join(" "),
                second.t,
                second.requests,
                second.errors,
                opt(second.p50_ms),
                opt(second.p99_ms),
                second.max_ms,
                second.probes,
                second.probe_max_ms,
                second.rss_mib
            );
        }
        if !args.json && args.progress_secs > 0 && t % args.progress_secs == 0 {
            eprintln!(
                "  t={:>4}s {:>7} req/s, p99 {} ms, max {:.1} ms, probe max {:.1} ms, RSS {:.1} MiB, errors {}",
                t,
                second.requests,
                second.p99_ms.map_or("-".into(), |v| format!("{v:.2}")),
                second.max_ms,
                second.probe_max_ms,
                second.rss_mib,
                now.2 + probe.errors()
            );
        }
        previous = now;
    }
    // The window ends here: what is in flight now is neither counted nor
    // an error.
    let elapsed = started.elapsed().as_secs_f64();
    let load_counts = load.latency.snapshot();
    let probe_counts = probe.latency.snapshot();
    let http_errors = load.http_errors.load(Ordering::Relaxed);
    let connection_errors = load.connection_errors.load(Ordering::Relaxed);
    let probe_errors = probe.errors();
    let cpu_end = [cpu(&[router_pid]), cpu(&engine_pids), cpu(&[self_pid])];
    let hwm = read_status(router_pid).and_then(|s| status_field(&s, "VmHWM"));
    load_rt.shutdown_background();
    probe_rt.shutdown_background();
    let loadavg_end = loadavg();
    drop(router);
    drop(engines);
    outcome?;

    let mut error_samples = load
        .samples
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    error_samples.extend(
        probe
            .samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|s| format!("probe: {s}")),
    );
    let cores = |i: usize| (cpu_end[i].saturating_sub(cpu_start[i])) as f64 / ticks / elapsed;
    let load_max = load.max.load(Ordering::Relaxed);
    let probe_max = probe.max.load(Ordering::Relaxed);
    Ok(Summary {
        spec: spec.clone(),
        workers: args.workers,
        connections: args.connections,
        duration_s: elapsed,
        requests: load_counts.iter().sum(),
        latency_ms: [
            quantile_ms(&load_counts, 0.5, load_max),
            quantile_ms(&load_counts, 0.99, load_max),
        ],
        max_ms: load_max as f64 / 1000.0,
        probes: probe_counts.iter().sum(),
        probe_ms: [
            quantile_ms(&probe_counts, 0.5, probe_max),
            quantile_ms(&probe_counts, 0.99, probe_max),
        ],
        probe_max_ms: probe_max as f64 / 1000.0,
        probes_slow: probe.slow.load(Ordering::Relaxed),
        probe_slow_ms: args.probe_slow_ms,
        http_errors,
        connection_errors,
        probe_errors,
        error_samples,
        rss_start_mib: rss[0],
        rss_peak_mib: rss.iter().copied().fold(0.0, f64::max),
        rss_steady_mib: steady(&rss[1..]),
        vm_hwm_mib: hwm.map_or(f64::NAN, |b| b as f64 / MIB),
        rss_samples: rss.len(),
        cpu_router: cores(0),
        cpu_engines: cores(1),
        cpu_soak: cores(2),
        loadavg_start,
        loadavg_end,
    })
}
