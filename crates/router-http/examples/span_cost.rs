//! What building a traced request's spans costs the thread that serves
//! it: the spans of one regular chat request (server, admission, read
//! body, extract, route, attempt, with the attributes the router sets),
//! built, recorded and ended as the request path does, `--loop N` times,
//! for instruction counts (callgrind) or timings.
//!
//! ```sh
//! cargo build --release -p router-http --features otel --example span_cost
//! valgrind --tool=callgrind --collect-atstart=no \
//!     --toggle-collect='router_http::otel::spans::trace_one_request_for_bench' \
//!     target/release/examples/span_cost --loop 300
//! ```
//! The difference between two `--loop` values' `Collected`, divided by
//! the difference of the values, is the instructions per request,
//! encoding the request's spans for the export included (it runs on the
//! request's thread when its server span ends; the pipeline's export
//! thread, which only puts encoded spans into requests when a batch is
//! full, is not counted). Without valgrind it prints the mean time per
//! request.
//!
//! The pipeline exports to a closed local port (every batch fails, which
//! costs only the export thread), and its queue holds every span of the
//! run, so none is dropped before it is built.

/// The reference router's allocator (its default feature `mimalloc`), so
/// the spans allocate as in the shipped router.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::{Duration, Instant};

use router_http::otel::{ExportConfig, TraceConfig, Tracing};
use tracing_subscriber::layer::SubscriberExt as _;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let loops: usize = args
        .iter()
        .position(|a| a == "--loop")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(2000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let export = ExportConfig {
        endpoint: "http://127.0.0.1:9".into(),
        max_queue_size: loops * 8 + 64,
        scheduled_delay: Duration::from_secs(3600),
        ..ExportConfig::default()
    };
    let tracing = Tracing::start(&export, runtime.handle().clone()).expect("a pipeline");
    let subscriber = tracing_subscriber::registry().with(tracing.layer());
    let _default = tracing::subscriber::set_default(subscriber);
    let config = TraceConfig {
        enabled: true,
        ..TraceConfig::default()
    };
    let started = Instant::now();
    for _ in 0..loops {
        assert!(router_http::otel::trace_one_request_for_bench(&config));
    }
    let elapsed = started.elapsed();
    println!(
        "{:.0} ns per traced request ({loops} requests)",
        elapsed.as_nanos() as f64 / loops as f64
    );
    drop(_default);
    drop(tracing);
}
