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
}

pub(super) static TRACE: std::sync::OnceLock<TraceMode> = std::sync::OnceLock::new();

pub(super) fn trace_mode() -> TraceMode {
    *TRACE.get().unwrap_or(&TraceMode::Off)
}

/// Starts the export pipeline for `mode` and installs its layer as the
/// process's subscriber.
#[cfg(feature = "otel")]
pub(super) fn start_tracing(mode: TraceMode) {
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
    let (endpoint, handle) = spawn_runtime("otel-export", move |rt| {
        let handle = rt.handle().clone();
        let endpoint = rt.block_on(async move {
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
        });
        (endpoint, handle)
    });
    let config = router_http::otel::ExportConfig {
        endpoint,
        ..router_http::otel::ExportConfig::default()
    };
    let tracing = router_http::otel::Tracing::start(&config, handle).expect("tracing");
    tracing_subscriber::registry().with(tracing.layer()).init();
    // Exports until the process ends.
    static PIPELINE: std::sync::OnceLock<router_http::otel::Tracing> = std::sync::OnceLock::new();
    let _ = PIPELINE.set(tracing);
}

#[cfg(not(feature = "otel"))]
pub(super) fn start_tracing(_: TraceMode) {
    eprintln!("--trace needs router-http's feature otel (cargo run --features otel ...)");
    std::process::exit(2);
}

/// On-CPU nanoseconds of the export threads (the SDK's batch processor
/// and the `otel-export` runtime).
pub(super) fn export_cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| {
            let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
            let name = comm.trim();
            (name.starts_with("otel") || name.starts_with("OpenTelemetry"))
                .then(|| task.file_name().to_str()?.parse::<u32>().ok())
                .flatten()
        })
        .map(thread_cpu_ns)
        .sum()
}
