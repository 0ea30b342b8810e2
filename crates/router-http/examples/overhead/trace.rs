//! `--trace`: how the routers trace, and what the export costs

use super::threads::thread_cpu_ns;

/// `--trace`: how the routers trace.
#[derive(Clone, Copy, PartialEq, Debug)]
pub(super) enum TraceMode {
    /// No tracing (the default).
    Off,
    /// Every request sampled, exported to a sink that answers at once.
    On,
    /// Sampling ratio 0: spans built, none recorded or exported.
    Ratio0,
    /// Every request sampled, the collector's port closed.
    Down,
    /// Every request sampled, the collector accepts and never answers.
    Hanging,
    /// A traced and an untraced router side by side, their load in
    /// alternating phases (`paired.rs`).
    Paired,
}

pub(super) static TRACE: std::sync::OnceLock<TraceMode> = std::sync::OnceLock::new();

pub(super) fn trace_mode() -> TraceMode {
    *TRACE.get().unwrap_or(&TraceMode::Off)
}

/// Starts the export pipeline for `mode` and installs its layer as the
/// process's subscriber.
#[cfg(feature = "otel")]
pub(super) fn start_tracing(mode: TraceMode, batch: Option<usize>, queue: Option<usize>) {
    // Here rather than at the top: a build without `otel` uses none of it.
    use super::threads::spawn_runtime;
    use bytes::Bytes;
    use http::{Request, Response};
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::TokioIo;
    use std::convert::Infallible;
    use tokio::net::TcpListener;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    // The collector runs on a runtime of its own, named so that
    // `export_cpu_ns` does not count it: a real collector is another
    // process, and its reading of the batches is not the router's cost.
    let endpoint = spawn_runtime("collector", move |rt| {
        rt.block_on(async move {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            match mode {
                TraceMode::Down => drop(listener),
                TraceMode::Hanging => {
                    tokio::spawn(async move {
                        let mut held = Vec::new();
                        while let Ok((stream, _)) = listener.accept().await {
                            held.push(stream);
                        }
                    });
                }
                _ => {
                    tokio::spawn(async move {
                        while let Ok((stream, _)) = listener.accept().await {
                            tokio::spawn(async move {
                                let service = hyper::service::service_fn(
                                    |request: Request<hyper::body::Incoming>| async move {
                                        let _ = request.into_body().collect().await;
                                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                                    },
                                );
                                let _ = hyper::server::conn::http1::Builder::new()
                                    .serve_connection(TokioIo::new(stream), service)
                                    .await;
                            });
                        }
                    });
                }
            }
            format!("http://{addr}/v1/traces")
        })
    });
    // The exporter's HTTP client runs here (router-http's export runtime).
    let handle = spawn_runtime("otel-export", |rt| rt.handle().clone());
    let defaults = router_http::otel::ExportConfig::default();
    let config = router_http::otel::ExportConfig {
        endpoint,
        max_export_batch_size: batch.unwrap_or(defaults.max_export_batch_size),
        max_queue_size: queue.unwrap_or(defaults.max_queue_size),
        ..defaults
    };
    let tracing = router_http::otel::Tracing::start(&config, handle).expect("tracing");
    tracing_subscriber::registry().with(tracing.layer()).init();
    // Exports until the process ends.
    static PIPELINE: std::sync::OnceLock<router_http::otel::Tracing> = std::sync::OnceLock::new();
    let _ = PIPELINE.set(tracing);
}

#[cfg(not(feature = "otel"))]
pub(super) fn start_tracing(_: TraceMode, _: Option<usize>, _: Option<usize>) {
    eprintln!("--trace needs router-http's feature otel (cargo run --features otel ...)");
    std::process::exit(2);
}

/// On-CPU nanoseconds of the export threads (the pipeline's `otel-batch`
/// thread and the `otel-export` runtime; not the in-process collector's).
pub(super) fn export_cpu_ns() -> u64 {
    named_threads_cpu_ns(|name| name.starts_with("otel") || name.starts_with("OpenTelemetry"))
}

/// On-CPU nanoseconds of the in-process collector that `--trace on`
/// exports to: reported apart, since a real collector is another process.
pub(super) fn collector_cpu_ns() -> u64 {
    named_threads_cpu_ns(|name| name == "collector")
}

/// On-CPU nanoseconds of the runtimes' blocking threads: the router's
/// tokenizer pool, where a body too long to tokenize inline is tokenized.
pub(super) fn pool_cpu_ns() -> u64 {
    named_threads_cpu_ns(|name| name == super::threads::BLOCKING_THREAD_NAME)
}

fn named_threads_cpu_ns(wanted: impl Fn(&str) -> bool) -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| {
            let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
            wanted(comm.trim())
                .then(|| task.file_name().to_str()?.parse::<u32>().ok())
                .flatten()
        })
        .map(thread_cpu_ns)
        .sum()
}
