//! The simulator's `multi_turn` workload sent to a live endpoint: what the
//! users of a router (or of router replicas behind a load balancer) see.
//!
//! ```text
//! cargo run --release --example multi_turn_load -- \
//!     --url http://127.0.0.1:8080 --engines http://127.0.0.1:8001,http://127.0.0.1:8002
//! ```
//!
//! `scripts/replicas-nginx` runs it through nginx in front of 1 and 3
//! router replicas (docs/operations.md, "Several router replicas").
//!
//! The requests are the trace of `affinity_router::simulator::workload::
//! multi_turn` (examples/simulate.rs `--workload multi_turn`): sessions that
//! each open with one of a few long system prompts, every turn's prompt the
//! whole history so far plus a new user message, arrivals a Poisson process
//! fixed in advance (open loop: a slow endpoint makes requests overlap more,
//! not arrive later). Each goes out at its arrival time as a streaming
//! `/v1/completions` whose prompt is given as token ids, engine-sim's
//! synthetic ids of the trace's text (4 characters a token): the router
//! then routes on the ids the engines hash into KV blocks with no tokenizer
//! of its own, as `kv_aware` needs.
//!
//! It prints, for the run:
//!
//! - TTFT p50 / p99: from sending a request to the first body chunk of its
//!   stream (nearest rank, the simulator's percentiles), and the same for
//!   the whole response (e2e);
//! - the hit rate: the engines' prefix cache hits over lookups (vLLM's
//!   `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, in
//!   prompt tokens) between the run's start and end, summed over
//!   `--engines`;
//! - the requests that failed (a status other than 200, a broken or
//!   unfinished stream, `--timeout-secs` passed), with the first few
//!   reasons on stderr. Any failure makes the exit status 1.

use std::time::{Duration, Instant};

use affinity_router::sim::metrics::sample;
use affinity_router::sim::tokens::tokenize;
use affinity_router::simulator::percentile;
use affinity_router::simulator::workload::{MultiTurnConfig, multi_turn};
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Send the simulator's multi_turn workload to a live endpoint; print TTFT
/// p50/p99 and the engines' prefix cache hit rate.
#[derive(Debug, Parser)]
#[command(name = "multi_turn_load")]
struct Args {
    /// Where to send the requests (a router, or a load balancer in front
    /// of router replicas), e.g. http://127.0.0.1:8080.
    #[arg(long)]
    url: String,
    /// The engines' base URLs, comma-separated: their /metrics give the
    /// hit rate (none: no hit rate).
    #[arg(long, value_delimiter = ',')]
    engines: Vec<String>,
    /// Requests (turns) to send.
    #[arg(long, default_value_t = 2_000)]
    requests: usize,
    /// Mean arrival rate, requests per second.
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    /// Sessions open at any time (a finished one is replaced).
    #[arg(long, default_value_t = 48)]
    sessions: usize,
    /// Distinct system prompts the sessions share.
    #[arg(long, default_value_t = 4)]
    system_prompts: usize,
    /// Tokens of each system prompt.
    #[arg(long, default_value_t = 1_024)]
    system_prompt_tokens: usize,
    /// Seed of the workload.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The model name sent (engine-sim serves sim-model).
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// A request still unanswered after this many seconds fails.
    #[arg(long, default_value_t = 60)]
    timeout_secs: u64,
    /// A name printed before the results (e.g. "R=3").
    #[arg(long, default_value = "run")]
    label: String,
    /// Print the results as one JSON line instead.
    #[arg(long)]
    json: bool,
}

/// What one request gave.
enum Outcome {
    /// Time to the first body chunk, and to the end of the stream.
    Done { ttft: Duration, e2e: Duration },
    /// Why it failed.
    Failed(String),
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Sends one streaming completion and times it.
async fn one(client: HttpClient, uri: http::Uri, body: Bytes, timeout: Duration) -> Outcome {
    let started = Instant::now();
    let request = http::Request::post(uri)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .expect("a valid request");
    let exchange = async {
        let response = client
            .request(request)
            .await
            .map_err(|e| format!("request failed: {e}"))?;
        let status = response.status();
        let mut body = response.into_body();
        if status != http::StatusCode::OK {
            let text = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            return Err(format!(
                "status {status}: {}",
                String::from_utf8_lossy(&text[..text.len().min(200)])
            ));
        }
        let mut ttft = None;
        let mut text = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("stream broken: {e}"))?;
            if let Some(data) = frame.data_ref().filter(|d| !d.is_empty()) {
                ttft.get_or_insert_with(|| started.elapsed());
                // Only the end matters: keep the tail.
                text.extend_from_slice(data);
                if text.len() > 64 {
                    text.drain(..text.len() - 64);
                }
            }
        }
        if !String::from_utf8_lossy(&text).contains("[DONE]") {
            return Err("the stream ended without [DONE]".to_owned());
        }
        Ok(ttft.unwrap_or_else(|| started.elapsed()))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(ttft)) => Outcome::Done {
            ttft,
            e2e: started.elapsed(),
        },
        Ok(Err(reason)) => Outcome::Failed(reason),
        Err(_) => Outcome::Failed(format!("no complete answer in {timeout:?}")),
    }
}

/// The engines' summed prefix cache (hits, queries), in prompt tokens.
async fn cache_counters(client: &HttpClient, engines: &[String]) -> Result<(f64, f64), String> {
    let mut totals = (0.0, 0.0);
    for engine in engines {
        let uri: http::Uri = format!("{}/metrics", engine.trim_end_matches('/'))
            .parse()
            .map_err(|e| format!("--engines {engine}: {e}"))?;
        let request = http::Request::get(uri)
            .body(Full::new(Bytes::new()))
            .expect("a valid request");
        let response = tokio::time::timeout(Duration::from_secs(10), client.request(request))
            .await
            .map_err(|_| format!("{engine}/metrics did not answer in 10 s"))?
            .map_err(|e| format!("{engine}/metrics: {e}"))?;
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{engine}/metrics: {e}"))?
            .to_bytes();
        let text = String::from_utf8_lossy(&body);
        let read = |name: &str| {
            sample(&text, name).ok_or_else(|| format!("{engine}/metrics has no {name}"))
        };
        totals.0 += read("vllm:prefix_cache_hits_total")?;
        totals.1 += read("vllm:prefix_cache_queries_total")?;
    }
    Ok(totals)
}

fn milliseconds(values: &mut [f64], q: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    percentile(values, q) * 1e3
}

async fn run(args: Args) -> Result<bool, String> {
    let trace = multi_turn(&MultiTurnConfig {
        requests: args.requests,
        rate: args.rate,
        system_prompts: args.system_prompts,
        system_prompt_tokens: args.system_prompt_tokens,
        active_sessions: args.sessions,
        seed: args.seed,
        ..MultiTurnConfig::default()
    });
    let uri: http::Uri = format!("{}/v1/completions", args.url.trim_end_matches('/'))
        .parse()
        .map_err(|e| format!("--url {}: {e}", args.url))?;
    let chars_per_token = affinity_router::sim::ModelConfig::default().chars_per_token;
    // Bodies built before the clock starts, so that building them does not
    // delay arrivals.
    let bodies: Vec<Bytes> = trace
        .requests
        .iter()
        .map(|r| {
            let body = serde_json::json!({
                "model": args.model,
                "prompt": tokenize(&r.prompt, chars_per_token),
                "max_tokens": r.output_tokens,
                "stream": true,
            });
            Bytes::from(body.to_string())
        })
        .collect();
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let before = cache_counters(&client, &args.engines).await?;
    let timeout = Duration::from_secs(args.timeout_secs);
    let started = tokio::time::Instant::now();
    let mut sent = Vec::with_capacity(bodies.len());
    for (request, body) in trace.requests.iter().zip(bodies) {
        tokio::time::sleep_until(started + request.arrival).await;
        sent.push(tokio::spawn(one(
            client.clone(),
            uri.clone(),
            body,
            timeout,
        )));
    }
    let (mut ttft, mut e2e, mut failures) = (Vec::new(), Vec::new(), Vec::new());
    for task in sent {
        match task
            .await
            .map_err(|e| format!("a request task failed: {e}"))?
        {
            Outcome::Done { ttft: t, e2e: e } => {
                ttft.push(t.as_secs_f64());
                e2e.push(e.as_secs_f64());
            }
            Outcome::Failed(reason) => failures.push(reason),
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let after = cache_counters(&client, &args.engines).await?;
    let queries = after.1 - before.1;
    let hit_rate = (queries > 0.0).then(|| (after.0 - before.0) / queries);
    let (ttft_p50, ttft_p99) = (milliseconds(&mut ttft, 0.50), milliseconds(&mut ttft, 0.99));
    let (e2e_p50, e2e_p99) = (milliseconds(&mut e2e, 0.50), milliseconds(&mut e2e, 0.99));
    for reason in failures.iter().take(5) {
        eprintln!(
            "multi_turn_load: {}: a request failed: {reason}",
            args.label
        );
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "label": args.label,
                "requests": trace.requests.len(),
                "failed": failures.len(),
                "seconds": seconds,
                "ttft_p50_ms": ttft_p50,
                "ttft_p99_ms": ttft_p99,
                "e2e_p50_ms": e2e_p50,
                "e2e_p99_ms": e2e_p99,
                "hit_rate": hit_rate,
            })
        );
    } else {
        let hits = hit_rate.map_or_else(|| "n/a".to_owned(), |h| format!("{:.1} %", h * 100.0));
        println!(
            "{}: {} requests ({} failed) in {seconds:.1} s: TTFT p50 {ttft_p50:.1} ms, p99 {ttft_p99:.1} ms; \
             e2e p50 {e2e_p50:.1} ms, p99 {e2e_p99:.1} ms; prefix cache hit rate {hits}",
            args.label,
            trace.requests.len(),
            failures.len()
        );
    }
    Ok(failures.is_empty())
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("multi_turn_load: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("multi_turn_load: {e}");
            std::process::ExitCode::from(2)
        }
    }
}
