//! The cost of one `/metrics` scrape of a loaded router, in process.
//!
//! ```sh
//! cargo run --release -p router-http --example metrics_scrape
//! cargo run --release -p router-http --example metrics_scrape -- --workers 256 --scrapes 500
//! cargo run --release -p router-http --example metrics_scrape -- --print
//! ```
//!
//! The router has `--workers` regular workers (default 64) and three models
//! on the cache-aware policy, each with a few hundred routed prompts, so the
//! scrape holds the per-worker series, the policy decisions and the
//! cache-tree sizes per (model, worker), plus every route's latency
//! histogram. Each scrape goes through `Router::handle` (`GET /metrics`) and
//! reads the whole body. The example reports the median and 90th percentile
//! time per scrape, the heap allocations and allocated bytes per scrape (a
//! counting global allocator) and the size of the text; `--print` writes
//! one scrape to stdout instead.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use lb_policies::RequestContext;
use router_http::{Route, Router, RouterConfig};

/// The system allocator, counting calls and bytes.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static ALLOCATED_BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded to `System` with the caller's arguments;
// the counters are plain atomics and do not allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        ALLOCATED_BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        ALLOCATED_BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const MODELS: [&str; 3] = ["llama-3.1-8b-instruct", "qwen2.5-7b", "mistral-7b-v0.3"];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |flag: &str, default: usize| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map_or(default, |v| v.parse().expect("a number"))
    };
    let workers = number("--workers", 64);
    let scrapes = number("--scrapes", 2000);
    let print = args.iter().any(|a| a == "--print");

    let router = loaded_router(workers);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let scrape = || {
        runtime.block_on(async {
            let request = Request::get("/metrics")
                .body(Empty::<bytes::Bytes>::new())
                .expect("a request");
            let response = router.handle(request).await;
            assert_eq!(response.status(), StatusCode::OK);
            response
                .into_body()
                .collect()
                .await
                .expect("a body")
                .to_bytes()
        })
    };
    if print {
        print!("{}", String::from_utf8_lossy(&scrape()));
        return;
    }

    let bytes = scrape().len();
    for _ in 0..scrapes / 10 {
        scrape();
    }
    let mut times = Vec::with_capacity(scrapes);
    let allocations = ALLOCATIONS.load(Ordering::Relaxed);
    let allocated = ALLOCATED_BYTES.load(Ordering::Relaxed);
    for _ in 0..scrapes {
        let start = Instant::now();
        std::hint::black_box(scrape());
        times.push(start.elapsed());
    }
    // `times` was allocated before the counters were read and never grows.
    let allocations = (ALLOCATIONS.load(Ordering::Relaxed) - allocations) as f64 / scrapes as f64;
    let allocated = (ALLOCATED_BYTES.load(Ordering::Relaxed) - allocated) as f64 / scrapes as f64;
    times.sort();
    let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "workers={workers} models={} scrapes={scrapes} text_bytes={bytes} \
         median_us={:.1} p90_us={:.1} allocations_per_scrape={allocations:.1} \
         allocated_bytes_per_scrape={allocated:.0}",
        MODELS.len(),
        micros(at(0.5)),
        micros(at(0.9)),
    );
}

/// A router with `workers` workers, three cache-aware models with routed
/// prompts, and responses recorded on every route.
fn loaded_router(workers: usize) -> Router {
    let router = Router::new(RouterConfig::default()).expect("a router");
    for i in 0..workers {
        let url = format!("http://10.0.{}.{}:8000", i / 200, 1 + i % 200);
        router.add_worker(&url, None, None).expect("a worker");
    }
    let fleet = router.workers();
    for model in MODELS {
        for request in 0..400 {
            let prompt = format!(
                "system prompt of tenant {} for {model}; user question number {request}",
                request % 37
            );
            let context = RequestContext::new(model).with_text(&prompt);
            let _ = router.policies().select(&fleet, &context);
        }
    }
    for (index, route) in Route::ALL.iter().enumerate() {
        for status in [200, 200, 200, 400, 503] {
            router.metrics().record_response(
                *route,
                StatusCode::from_u16(status).expect("a status"),
                Duration::from_millis(3 + 40 * index as u64),
            );
        }
    }
    router
}
