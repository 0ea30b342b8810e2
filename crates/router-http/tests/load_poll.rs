//! Engine-reported load: the router polls every engine for its in-flight
//! count, so that the requests another router replica sent count in the
//! estimate its policies compare. Real processes on 127.0.0.1: engine-sim
//! engines, and a small hyper server that answers its load endpoints with
//! whatever a test sets (garbage, 50 MB, silence, bad numbers, 404), while
//! answering completions normally so that routing can be checked too.
//!
//! Real time, not tokio's paused clock: the poller's deadlines race real
//! sockets here, and a paused clock would jump past them whenever the
//! runtime waits for I/O. Every wait is bounded.

mod common;

use bytes::Bytes;
use common::{Fixture, call, chat_body, json};
use engine_sim::{EngineConfig, ModelConfig};
use http::StatusCode;
use http_body::{Body, Frame};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use lb_policies::PolicyConfig;
use parking_lot::Mutex;
use router_http::{LoadPollConfig, PdConfig, PdConnector, PdWorkerConfig, Router, RouterConfig};
use serde_json::Value;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

/// Polls `check` every 20 ms until it holds, for at most 10 s.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The `engine_load` object `/workers` shows for the worker at `url`
/// (`url@rank` for a rank).
async fn engine_load(router: SocketAddr, endpoint: &str) -> Value {
    let (status, _, body) = call(router, "GET", "/workers", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    let workers = json(&body);
    let found = workers
        .as_array()
        .unwrap()
        .iter()
        .find(|w| {
            let shown = match w["dp_rank"].as_u64() {
                Some(rank) => format!("{}@{rank}", w["url"].as_str().unwrap()),
                None => w["url"].as_str().unwrap().to_owned(),
            };
            shown == endpoint
        })
        .unwrap_or_else(|| panic!("no worker {endpoint} in {workers}"));
    found["engine_load"].clone()
}

/// The sum of `router_load_poll_errors_total` for `endpoint` and `reason`
/// in the router's `/metrics`.
async fn errors(router: SocketAddr, endpoint: &str, reason: &str) -> u64 {
    let (status, _, body) = call(router, "GET", "/metrics", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(body.to_vec()).unwrap();
    let url = format!("url=\"{endpoint}\"");
    let reason = format!("reason=\"{reason}\"");
    text.lines()
        .filter(|line| line.starts_with("router_load_poll_errors_total{"))
        .filter(|line| line.contains(&url) && line.contains(&reason))
        .map(|line| line.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

/// A router with `policy` polling every 50 ms (with `timeout` per poll),
/// its background tasks running, over `urls` (`(url, rank)`).
async fn router(
    policy: &str,
    timeout: Duration,
    urls: &[(String, Option<u32>)],
) -> (Fixture, router_http::BackgroundTasks) {
    let config = RouterConfig {
        policy: PolicyConfig::named(policy),
        load_poll: LoadPollConfig {
            interval: Some(Duration::from_millis(50)),
            timeout: Some(timeout),
            // Reports must not go stale because a round waited for a slow
            // engine on a busy test machine.
            stale_after: 40,
            ..LoadPollConfig::default()
        },
        ..RouterConfig::default()
    };
    let fixture = Fixture::start_with_urls(config, Vec::new(), &[]).await;
    for (url, rank) in urls {
        fixture.router.add_worker(url, *rank, None).unwrap();
    }
    let background = fixture.router.spawn_background();
    (fixture, background)
}

// ----- Another router's requests on an engine-sim engine -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_estimate_counts_another_routers_requests_and_least_loaded_avoids_them() {
    // Engine A runs at most 3 sequences: of the other router's 4 requests,
    // 3 run and 1 waits; the engine reports 4.
    let busy = EngineConfig {
        model: ModelConfig {
            max_num_seqs: 3,
            ..ModelConfig::default()
        },
        ..EngineConfig::default()
    };
    let mut engines = Vec::new();
    for config in [busy, EngineConfig::default()] {
        let options = engine_sim::ServeOptions::default();
        engines.push(engine_sim::spawn(config, options).await.unwrap());
    }
    // "Another router": long streams sent to engine A directly, kept open
    // and never read (real time: 10,000 tokens take over a minute).
    let mut others = Vec::new();
    for _ in 0..4 {
        let mut connection = common::Connection::open(engines[0].addr()).await;
        let body =
            serde_json::json!({"prompt": "another router's", "max_tokens": 10_000, "stream": true});
        let response = connection
            .send(
                "POST",
                "/v1/completions",
                &[("content-type", "application/json")],
                body.to_string(),
            )
            .await;
        assert_eq!(response.status(), StatusCode::OK);
        others.push((connection, response));
    }
    let (a, b) = (engines[0].url(), engines[1].url());
    let (fixture, _background) = router(
        "least_loaded",
        Duration::from_secs(1),
        &[(a.clone(), None), (b.clone(), None)],
    )
    .await;
    let addr = fixture.addr;
    eventually("engine A's report of the other router's 4", || async {
        engine_load(addr, &a).await["reported"] == 4
    })
    .await;
    let shown = engine_load(addr, &a).await;
    assert_eq!(shown["polling"], true);
    assert_eq!(shown["source"], "metrics");
    assert_eq!(shown["own_load"], 0);
    assert_eq!(shown["estimated_load"], 4);
    assert!(shown["kv_cache_usage"].as_f64().unwrap() > 0.0, "{shown}");
    // The cost's cache pressure reads the same report.
    let usage = fixture.workers()[0].engine_cache_usage();
    assert!(usage.is_some_and(|u| u > 0.0), "{usage:?}");
    assert_eq!(shown["last_error"], Value::Null);
    // B's report comes from its own poll, not necessarily A's round.
    eventually("engine B's report of 0", || async {
        engine_load(addr, &b).await["reported"] == 0
    })
    .await;
    let (_, _, scrape) = call(addr, "GET", "/metrics", &[], "").await;
    let scrape = String::from_utf8(scrape.to_vec()).unwrap();
    assert!(
        scrape.contains(&format!(
            "router_worker_engine_load{{url=\"{a}\",role=\"regular\",generation=\"1\"}} 4\n"
        )),
        "{scrape}"
    );
    assert!(scrape.contains(&format!(
        "router_worker_estimated_load{{url=\"{a}\",role=\"regular\",generation=\"1\"}} 4\n"
    )));
    // The waiting share of the report, beside it in /metrics and /workers.
    let waiting_series =
        format!("router_worker_engine_waiting{{url=\"{a}\",role=\"regular\",generation=\"1\"}} ");
    let waiting: usize = scrape
        .lines()
        .find_map(|line| line.strip_prefix(&waiting_series))
        .unwrap_or_else(|| panic!("no waiting series for {a}: {scrape}"))
        .parse()
        .unwrap();
    assert!(waiting <= 4, "{waiting} waiting of 4");
    let shown = engine_load(addr, &a).await;
    assert!(shown["waiting"].as_u64().is_some_and(|w| w <= 4), "{shown}");

    // Every request of this router goes to B: A's estimate is 4, B's at
    // most this router's own one in flight.
    for turn in 0..6 {
        let body = chat_body(&format!("turn {turn}"), false);
        let (status, headers, _) = call(
            addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            body,
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            headers["x-worker-id"],
            engines[1].engine_id(),
            "turn {turn}"
        );
    }
    let workers = fixture.workers();
    assert_eq!(workers[0].processed(), 0);
    assert_eq!(workers[1].processed(), 6);

    // The other router's requests end: the next reports say so.
    drop(others);
    eventually("engine A's report back to 0", || async {
        let shown = engine_load(addr, &a).await;
        shown["reported"] == 0 && shown["estimated_load"] == 0
    })
    .await;
    fixture.assert_all_loads_return_to_zero().await;
}

// ----- Hostile load endpoints -----

/// What the hostile server answers on one load path.
#[derive(Debug, Clone)]
enum Answer {
    /// 200 with this body.
    Body(String),
    /// 404.
    NotFound,
    /// 200 with 50 MB (chunked, no length).
    Huge,
    /// 200 headers, then nothing, ever.
    Silent,
}

const HUGE: usize = 50 * 1024 * 1024;

/// A response body the hostile server controls.
enum Reply {
    Full(Option<Bytes>),
    Huge {
        left: usize,
        chunk: Bytes,
        completed: Arc<AtomicUsize>,
    },
    Silent,
}

impl Body for Reply {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Reply::Full(body) => Poll::Ready(body.take().map(|b| Ok(Frame::data(b)))),
            Reply::Huge {
                left,
                chunk,
                completed,
            } => {
                if *left == 0 {
                    completed.fetch_add(1, Ordering::SeqCst);
                    return Poll::Ready(None);
                }
                let n = (*left).min(chunk.len());
                *left -= n;
                Poll::Ready(Some(Ok(Frame::data(chunk.slice(..n)))))
            }
            Reply::Silent => Poll::Pending,
        }
    }
}

/// A worker whose `/metrics` and `/get_load` answer what the test set, and
/// whose completions, `/health` and the rest answer like a plain engine.
struct Hostile {
    addr: SocketAddr,
    answers: Arc<Mutex<(Answer, Answer)>>,
    /// Requests to `/metrics` and to `/get_load`.
    hits: Arc<[AtomicUsize; 2]>,
    /// 50 MB bodies sent to their end (the router must cut every one).
    huge_completed: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Hostile {
    fn drop(&mut self) {
        self.task.abort();
    }
}

const COMPLETION: &str = r#"{"id":"c","object":"chat.completion","model":"sim-model","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;

fn metrics_text(running: &str, waiting: &str) -> String {
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}\n"
    )
}

impl Hostile {
    async fn start(metrics: Answer, get_load: Answer) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let answers = Arc::new(Mutex::new((metrics, get_load)));
        let hits: Arc<[AtomicUsize; 2]> = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
        let huge_completed = Arc::new(AtomicUsize::new(0));
        let chunk = Bytes::from(vec![b'#'; 64 * 1024]);
        let (shared, counts, completed) = (
            Arc::clone(&answers),
            Arc::clone(&hits),
            Arc::clone(&huge_completed),
        );
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (shared, counts, completed, chunk) = (
                    Arc::clone(&shared),
                    Arc::clone(&counts),
                    Arc::clone(&completed),
                    chunk.clone(),
                );
                let service =
                    hyper::service::service_fn(move |request: http::Request<Incoming>| {
                        let answer = match request.uri().path() {
                            "/metrics" => {
                                counts[0].fetch_add(1, Ordering::SeqCst);
                                Some(shared.lock().0.clone())
                            }
                            "/get_load" => {
                                counts[1].fetch_add(1, Ordering::SeqCst);
                                Some(shared.lock().1.clone())
                            }
                            _ => None,
                        };
                        let (status, reply) = match answer {
                            None if request.uri().path().starts_with("/v1/") => (
                                StatusCode::OK,
                                Reply::Full(Some(Bytes::from_static(COMPLETION.as_bytes()))),
                            ),
                            None => (StatusCode::OK, Reply::Full(Some(Bytes::new()))),
                            Some(Answer::Body(text)) => {
                                (StatusCode::OK, Reply::Full(Some(Bytes::from(text))))
                            }
                            Some(Answer::NotFound) => (StatusCode::NOT_FOUND, Reply::Full(None)),
                            Some(Answer::Huge) => (
                                StatusCode::OK,
                                Reply::Huge {
                                    left: HUGE,
                                    chunk: chunk.clone(),
                                    completed: Arc::clone(&completed),
                                },
                            ),
                            Some(Answer::Silent) => (StatusCode::OK, Reply::Silent),
                        };
                        let mut response = http::Response::new(reply);
                        *response.status_mut() = status;
                        async move { Ok::<_, Infallible>(response) }
                    });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        Self {
            addr,
            answers,
            hits,
            huge_completed,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn set(&self, metrics: Answer, get_load: Answer) {
        *self.answers.lock() = (metrics, get_load);
    }

    fn hits(&self) -> (usize, usize) {
        (
            self.hits[0].load(Ordering::SeqCst),
            self.hits[1].load(Ordering::SeqCst),
        )
    }
}

/// The router still routes to the worker: a completion answered 200.
async fn routes(router: SocketAddr) {
    let (status, _, _) = call(
        router,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        chat_body("still routed", false),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}

/// Starts a hostile worker answering good metrics (3 running) and a router
/// over it; returns once the router shows the report.
async fn reported_hostile(timeout: Duration) -> (Hostile, Fixture, router_http::BackgroundTasks) {
    let hostile = Hostile::start(Answer::Body(metrics_text("3", "0")), Answer::NotFound).await;
    let (fixture, background) = router("round_robin", timeout, &[(hostile.url(), None)]).await;
    let (addr, url) = (fixture.addr, hostile.url());
    eventually("the first report", || async {
        engine_load(addr, &url).await["reported"] == 3
    })
    .await;
    (hostile, fixture, background)
}

/// After `answer` replaced good metrics: the report is withdrawn, the
/// reason counted and shown, the router keeps routing, and good metrics
/// are read again afterwards (the poller is alive).
async fn withdrawn_on(answer: Answer, reason: &str, timeout: Duration) {
    let (hostile, fixture, _background) = reported_hostile(timeout).await;
    let (addr, url) = (fixture.addr, hostile.url());
    let before = errors(addr, &url, reason).await;
    hostile.set(answer.clone(), Answer::NotFound);
    eventually(&format!("{answer:?} counted as {reason}"), || async {
        errors(addr, &url, reason).await > before
    })
    .await;
    let shown = engine_load(addr, &url).await;
    assert_eq!(shown["reported"], Value::Null, "{shown}");
    assert_eq!(shown["estimated_load"], 0);
    assert_eq!(shown["last_error"]["reason"], reason, "{shown}");
    assert_eq!(fixture.workers()[0].engine_reported_load(), None);
    assert_eq!(fixture.workers()[0].engine_cache_usage(), None);
    routes(addr).await;
    // The breaker never heard of it.
    assert!(fixture.workers()[0].is_available());
    hostile.set(Answer::Body(metrics_text("2", "1")), Answer::NotFound);
    eventually("a report again", || async {
        engine_load(addr, &url).await["reported"] == 3
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_text_withdraws_the_report() {
    let garbage = "<html><body>Internal Server Error</body></html>\n".to_owned();
    withdrawn_on(Answer::Body(garbage), "garbage", Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_50_mb_body_is_cut_off_at_the_cap() {
    let started = std::time::Instant::now();
    withdrawn_on(Answer::Huge, "too_large", Duration::from_secs(2)).await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "50 MB bodies were not cut short: {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_50_mb_body_is_abandoned_before_its_end() {
    let (hostile, fixture, _background) = reported_hostile(Duration::from_secs(2)).await;
    let (addr, url) = (fixture.addr, hostile.url());
    hostile.set(Answer::Huge, Answer::NotFound);
    eventually("three huge bodies refused", || async {
        errors(addr, &url, "too_large").await >= 3
    })
    .await;
    routes(addr).await;
    assert_eq!(hostile.huge_completed.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_never_ends_times_out() {
    let (hostile, fixture, _background) = reported_hostile(Duration::from_millis(300)).await;
    let (addr, url) = (fixture.addr, hostile.url());
    hostile.set(Answer::Silent, Answer::NotFound);
    eventually("a silent reply counted as a timeout", || async {
        errors(addr, &url, "timeout").await >= 1
    })
    .await;
    assert_eq!(engine_load(addr, &url).await["reported"], Value::Null);
    // Requests are not held up by the hanging polls.
    let started = std::time::Instant::now();
    routes(addr).await;
    assert!(started.elapsed() < Duration::from_secs(2));
    hostile.set(Answer::Body(metrics_text("1", "0")), Answer::NotFound);
    eventually("a report again", || async {
        engine_load(addr, &url).await["reported"] == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_nan_infinite_and_absurd_gauges_are_refused() {
    let (hostile, fixture, _background) = reported_hostile(Duration::from_secs(1)).await;
    let (addr, url) = (fixture.addr, hostile.url());
    for (running, reason) in [
        ("-1", "invalid_value"),
        ("NaN", "invalid_value"),
        ("+Inf", "invalid_value"),
        ("2.5", "invalid_value"),
        ("1e12", "implausible"),
    ] {
        let before = errors(addr, &url, reason).await;
        hostile.set(Answer::Body(metrics_text(running, "0")), Answer::NotFound);
        eventually(&format!("{running} counted as {reason}"), || async {
            errors(addr, &url, reason).await > before
        })
        .await;
        let shown = engine_load(addr, &url).await;
        assert_eq!(shown["reported"], Value::Null, "{running}: {shown}");
        assert_eq!(fixture.workers()[0].estimated_load(), 0);
        routes(addr).await;
        hostile.set(Answer::Body(metrics_text("3", "0")), Answer::NotFound);
        eventually("a report again", || async {
            engine_load(addr, &url).await["reported"] == 3
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_without_load_endpoints_is_left_alone_for_the_backoff() {
    let hostile = Hostile::start(Answer::NotFound, Answer::NotFound).await;
    let (fixture, _background) = router(
        "round_robin",
        Duration::from_secs(1),
        &[(hostile.url(), None)],
    )
    .await;
    let (addr, url) = (fixture.addr, hostile.url());
    eventually("no source counted", || async {
        errors(addr, &url, "no_source").await == 1
    })
    .await;
    let shown = engine_load(addr, &url).await;
    assert_eq!(shown["reported"], Value::Null);
    assert_eq!(shown["last_error"]["reason"], "no_source");
    assert!(shown["backoff_ms"].as_u64().unwrap() > 20_000, "{shown}");
    // Ten intervals later the engine was asked nothing more (each path
    // once, by the one round that found neither).
    let hits = hostile.hits();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(hostile.hits(), hits);
    assert_eq!(hits, (1, 1));
    assert_eq!(errors(addr, &url, "no_source").await, 1);
    routes(addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_load_answers_when_metrics_does_not_and_is_then_asked_alone() {
    let sglang = r#"[{"dp_rank": 0, "num_reqs": 4, "num_waiting_reqs": 1, "num_tokens": 77}]"#;
    let hostile = Hostile::start(Answer::NotFound, Answer::Body(sglang.to_owned())).await;
    let (fixture, _background) = router(
        "round_robin",
        Duration::from_secs(1),
        &[(hostile.url(), None)],
    )
    .await;
    let (addr, url) = (fixture.addr, hostile.url());
    eventually("the get_load report", || async {
        engine_load(addr, &url).await["reported"] == 4
    })
    .await;
    assert_eq!(engine_load(addr, &url).await["source"], "get_load");
    // Remembered: /metrics is not asked again while /get_load answers.
    let (metrics, get_load) = hostile.hits();
    eventually("more get_load polls", || async {
        hostile.hits().1 >= get_load + 5
    })
    .await;
    assert_eq!(hostile.hits().0, metrics);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_the_engine_does_not_report_gets_no_report() {
    // Engines 0 and 1 in the metrics; workers for ranks 1 and 3.
    let text = format!(
        "{}vllm:num_requests_running{{engine=\"1\",model_name=\"m\"}} 5\n\
         vllm:num_requests_waiting{{engine=\"1\",model_name=\"m\"}} 2\n",
        metrics_text("1", "0")
    );
    let hostile = Hostile::start(Answer::Body(text), Answer::NotFound).await;
    let url = hostile.url();
    let (fixture, _background) = router(
        "round_robin",
        Duration::from_secs(1),
        &[(url.clone(), Some(1)), (url.clone(), Some(3))],
    )
    .await;
    let addr = fixture.addr;
    let (one, three) = (format!("{url}@1"), format!("{url}@3"));
    eventually("rank 1's report", || async {
        engine_load(addr, &one).await["reported"] == 7
    })
    .await;
    eventually("rank 3 counted as absent", || async {
        errors(addr, &three, "rank_absent").await >= 1
    })
    .await;
    let shown = engine_load(addr, &three).await;
    assert_eq!(shown["reported"], Value::Null);
    assert_eq!(shown["last_error"]["reason"], "rank_absent");
    assert_eq!(errors(addr, &one, "rank_absent").await, 0);
    // Both ranks are routed to.
    routes(addr).await;
    routes(addr).await;
    let processed: Vec<u64> = fixture.workers().iter().map(|w| w.processed()).collect();
    assert_eq!(processed, vec![1, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_the_background_tasks_withdraws_the_reports() {
    let (hostile, fixture, background) = reported_hostile(Duration::from_secs(1)).await;
    let url = hostile.url();
    assert_eq!(fixture.workers()[0].engine_reported_load(), Some(3));
    drop(background);
    eventually("the report withdrawn", || async {
        fixture.workers()[0].engine_reported_load().is_none()
    })
    .await;
    assert_eq!(
        engine_load(fixture.addr, &url).await["reported"],
        Value::Null
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_and_decode_workers_are_polled_too() {
    let prefill = Hostile::start(Answer::Body(metrics_text("3", "0")), Answer::NotFound).await;
    let decode = Hostile::start(Answer::NotFound, Answer::Body(r#"{"load": 2}"#.to_owned())).await;
    let mut pd = PdConfig::new(PdConnector::Nixl);
    pd.prefill = vec![PdWorkerConfig::new(prefill.url())];
    pd.decode = vec![PdWorkerConfig::new(decode.url())];
    let config = RouterConfig {
        pd: Some(pd),
        load_poll: LoadPollConfig {
            interval: Some(Duration::from_millis(50)),
            timeout: Some(Duration::from_secs(1)),
            ..LoadPollConfig::default()
        },
        ..RouterConfig::default()
    };
    let router = Router::start(config).await.unwrap();
    let _background = router.spawn_background();
    let reported = |role: &str| {
        router
            .all_workers()
            .iter()
            .find(|w| w.role().kind().as_str() == role)
            .and_then(|w| w.engine_reported_load())
    };
    eventually("both roles reported", || async {
        reported("prefill") == Some(3) && reported("decode") == Some(2)
    })
    .await;
    let polls = router.load_polls().unwrap();
    let decode_worker = router
        .all_workers()
        .into_iter()
        .find(|w| w.role().kind().as_str() == "decode")
        .unwrap();
    assert_eq!(polls.status(&decode_worker).source, Some("get_load"));
}

// ----- The poll budget -----

#[test]
fn a_fleet_past_the_budget_is_polled_less_often() {
    let config = LoadPollConfig {
        interval: Some(Duration::from_millis(50)),
        max_polls_per_sec: 2_000,
        ..LoadPollConfig::default()
    };
    // 100 engines fit the budget at 50 ms; 1,000 are polled every 500 ms.
    assert_eq!(config.round_period(100), Duration::from_millis(50));
    assert_eq!(config.round_period(1_000), Duration::from_millis(500));
    // No budget: the interval, whatever the fleet.
    let unlimited = LoadPollConfig {
        max_polls_per_sec: 0,
        ..config.clone()
    };
    assert_eq!(unlimited.round_period(1_000), Duration::from_millis(50));
    assert_eq!(
        LoadPollConfig::default().max_polls_per_sec,
        router_http::load_poll::DEFAULT_MAX_POLLS_PER_SEC
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_poll_budget_spreads_rounds_and_reports_stay_fresh_across_them() {
    // 4 engines, a 10 ms interval and a budget of 8 polls per second: a
    // round every 500 ms instead of every 10 ms.
    let mut engines = Vec::new();
    for _ in 0..4 {
        engines.push(Hostile::start(Answer::Body(metrics_text("2", "1")), Answer::NotFound).await);
    }
    let config = RouterConfig {
        policy: PolicyConfig::named("round_robin"),
        load_poll: LoadPollConfig {
            interval: Some(Duration::from_millis(10)),
            max_polls_per_sec: 8,
            ..LoadPollConfig::default()
        },
        ..RouterConfig::default()
    };
    let fixture = Fixture::start_with_urls(config, Vec::new(), &[]).await;
    for engine in &engines {
        fixture
            .router
            .add_worker(&engine.url(), None, None)
            .unwrap();
    }
    let background = fixture.router.spawn_background();
    let first = engines[0].url();
    eventually("the first report", || async {
        engine_load(fixture.addr, &first).await["reported"] == 3
    })
    .await;
    let before: Vec<usize> = engines.iter().map(|e| e.hits().0).collect();
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    for (engine, before) in engines.iter().zip(&before) {
        let polls = engine.hits().0 - before;
        // At most one round per 500 ms: 4 in 1.6 s (and one more for a
        // round straddling the start). A slow machine polls less, never
        // more; unlimited, it would have been about 160.
        assert!(polls <= 5, "{} polled {polls} times in 1.6 s", engine.url());
    }
    // Reports stay while rounds are 500 ms apart: staleness is counted in
    // the stretched rounds (3 × 500 ms), not in 10 ms intervals.
    for engine in &engines {
        let load = engine_load(fixture.addr, &engine.url()).await;
        assert_eq!(load["reported"], 3, "{}: {load}", engine.url());
        assert_eq!(errors(fixture.addr, &engine.url(), "stale").await, 0);
    }
    let (_, _, body) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(
        text.contains("router_load_poll_period_seconds 0.5"),
        "{text}"
    );
    drop(background);
}
