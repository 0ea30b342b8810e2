//! vllm-router 0.1.17's `kv_aware` flags, run as command lines:
//! `--kv-event-source`, `--kv-event-replay-source`, `--pd-kv-events`,
//! `--kv-event-block-size` and `--kv-event-model`. Each starts a router
//! (in-process, from the same `Settings::from_args` the binary uses) over
//! engine-sim engines publishing KV events at ports of their own, and
//! checks what the flag changes: the endpoints followed, the replay, the
//! index's block size, the model scored on the index. Bad values stop the
//! binary with exit code 2 and a message naming the flag.

use affinity_router::cli::{App, Settings, StopOutcome};
use affinity_router::sim::{EngineConfig, EngineHandle, KvEventsOptions, ServeOptions};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::net::SocketAddr;
use std::time::Duration;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

fn settings(args: &[&str]) -> Result<Settings, affinity_router::cli::CliError> {
    Settings::from_args(std::iter::once("router").chain(args.iter().copied()))
}

/// The router and its metrics listener on free ports, engines without
/// simulated latency.
fn quick(args: &[&str]) -> Settings {
    let mut all = vec![
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--sim-time-scale",
        "0",
    ];
    all.extend_from_slice(args);
    settings(&all).unwrap()
}

async fn request(
    client: &HttpClient,
    method: &str,
    url: String,
    body: &str,
) -> (StatusCode, String) {
    let mut builder = Request::builder().method(method).uri(url);
    if !body.is_empty() {
        builder = builder.header("content-type", "application/json");
    }
    let request = builder
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), async {
        let response = client.request(request).await.expect("answered");
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    })
    .await
    .expect("answered within 20 s")
}

async fn get(client: &HttpClient, addr: SocketAddr, path: &str) -> String {
    let (status, body) = request(client, "GET", format!("http://{addr}{path}"), "").await;
    assert_eq!(status, StatusCode::OK, "{path}: {body}");
    body
}

/// A conversation with a long system prompt (many full blocks) after
/// `turns` earlier turns.
fn chat(model: &str, turns: usize) -> String {
    let mut messages = vec![serde_json::json!({
        "role": "system",
        "content": "You keep the lighthouse's log of passing ships. ".repeat(16),
    })];
    for t in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": format!("Ship {t}?")}));
        messages.push(serde_json::json!({"role": "assistant", "content": "Logged."}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "Any more?"}));
    serde_json::json!({"model": model, "messages": messages, "max_tokens": 2}).to_string()
}

/// Sends a chat straight to an engine (not through the router), so that
/// it stores blocks and publishes them.
async fn prime(client: &HttpClient, engine: &EngineHandle) {
    let url = format!("{}/v1/chat/completions", engine.url());
    let (status, body) = request(client, "POST", url, &chat("sim-model", 0)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

/// An engine-sim engine publishing its KV events on free loopback ports
/// (never vLLM's default 5557), as data-parallel rank `rank`, with a
/// replay socket if asked.
async fn engine(config: EngineConfig, rank: u32, replay: bool) -> EngineHandle {
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let mut kv = KvEventsOptions::new(any);
    kv.data_parallel_rank = rank;
    if replay {
        kv = kv.with_replay(any);
    }
    let options = ServeOptions {
        kv_events: Some(kv),
        ..ServeOptions::default()
    };
    affinity_router::sim::spawn(config, options).await.unwrap()
}

fn publisher(engine: &EngineHandle) -> String {
    format!("tcp://{}", engine.kv_events_addr().unwrap())
}

fn replayer(engine: &EngineHandle) -> String {
    format!("tcp://{}", engine.kv_events_replay_addr().unwrap())
}

/// The `/workers` entries, as JSON.
async fn workers(client: &HttpClient, addr: SocketAddr) -> Vec<serde_json::Value> {
    let body = get(client, addr, "/workers").await;
    serde_json::from_str::<serde_json::Value>(&body)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

/// Waits (bounded) until `done` holds for the `/workers` list.
async fn wait_for_workers(
    client: &HttpClient,
    addr: SocketAddr,
    what: &str,
    done: impl Fn(&[serde_json::Value]) -> bool,
) -> Vec<serde_json::Value> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let list = workers(client, addr).await;
        if done(&list) {
            return list;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: {}",
            serde_json::Value::Array(list)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of the sample `name` (its full text with labels) in a
/// Prometheus exposition, 0 when absent.
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits until every followed stream is connected: a ZMQ subscriber sees
/// only what is published after it joined (replay covers the rest).
async fn wait_connected(client: &HttpClient, addr: SocketAddr, followed: usize) {
    wait_for_workers(client, addr, "streams connected", |list| {
        let streams: Vec<&serde_json::Value> = list
            .iter()
            .filter_map(|w| w["kv_events"]["streams"].as_array())
            .flatten()
            .collect();
        streams.len() == followed && streams.iter().all(|s| s["state"] == "live")
    })
    .await;
}

/// `--kv-event-source`: each data-parallel rank of a worker follows the
/// endpoint listed for it, on hosts and ports of their own (here two
/// engines' publishers, neither at the worker's port + rank), and
/// `--kv-event-replay-source` lists each rank's replay socket likewise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_event_source_follows_each_rank_at_its_listed_endpoint() {
    let rank0 = engine(EngineConfig::instant(), 0, true).await;
    let rank1 = engine(EngineConfig::instant(), 1, true).await;
    let url = rank0.url();
    let source = format!("{url}={},{}", publisher(&rank0), publisher(&rank1));
    let replay = format!("{url}={},{}", replayer(&rank0), replayer(&rank1));
    let app = App::start(&quick(&[
        "--worker-urls",
        &url,
        "--policy",
        "kv_aware",
        "--intra-node-data-parallel-size",
        "2",
        "--kv-event-source",
        &source,
        "--kv-event-replay-source",
        &replay,
    ]))
    .await
    .unwrap();
    let client = client();
    let addr = app.addr();
    wait_connected(&client, addr, 2).await;
    // Both ranks' engines store blocks; each rank's stream delivers only
    // its own engine's batches (they carry their rank).
    prime(&client, &rank0).await;
    prime(&client, &rank1).await;
    let list = wait_for_workers(&client, addr, "both ranks live", |list| {
        list.len() == 2
            && list.iter().all(|w| {
                w["kv_events"]["state"] == "live" && w["kv_events"]["blocks"].as_u64() > Some(0)
            })
    })
    .await;
    for w in &list {
        let rank = w["dp_rank"].as_u64().unwrap();
        let engine = if rank == 0 { &rank0 } else { &rank1 };
        let stream = &w["kv_events"]["streams"][0];
        assert_eq!(stream["rank"], rank, "{w}");
        assert_eq!(stream["endpoint"], publisher(engine).as_str(), "{w}");
        assert_eq!(stream["replay_endpoint"], replayer(engine).as_str(), "{w}");
    }
    assert_eq!(app.stop().await, StopOutcome::Drained);
    rank0.shutdown().await;
    rank1.shutdown().await;
}

/// `--kv-event-replay-source`: on connecting the router asks the replay
/// socket for what the engine still buffers, so it learns blocks stored
/// before it started; without the flag (a worker given
/// `--kv-event-source` alone has no replay) it does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_event_replay_source_recovers_blocks_stored_before_the_router_started() {
    let engine = engine(EngineConfig::instant(), 0, true).await;
    let client = client();
    prime(&client, &engine).await;
    let url = engine.url();
    let source = format!("{url}={}", publisher(&engine));
    let replay = format!("{url}={}", replayer(&engine));
    let args = [
        "--worker-urls",
        &url,
        "--policy",
        "kv_aware",
        "--kv-event-source",
        &source,
    ];

    let without = App::start(&quick(&args)).await.unwrap();
    let list = wait_for_workers(&client, without.addr(), "followed", |list| {
        list[0]["kv_events"]["streams"][0]["endpoint"] == publisher(&engine).as_str()
    })
    .await;
    assert!(
        list[0]["kv_events"]["streams"][0]
            .get("replay_endpoint")
            .is_none()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let hub = without.router().kv_events().unwrap().clone();
    assert_eq!(hub.index().stats().pairs, 0, "nothing new was published");
    assert_eq!(without.stop().await, StopOutcome::Drained);

    let mut with_replay = args.to_vec();
    with_replay.extend(["--kv-event-replay-source", &replay]);
    let app = App::start(&quick(&with_replay)).await.unwrap();
    let addr = app.addr();
    let list = wait_for_workers(&client, addr, "replayed", |list| {
        list[0]["kv_events"]["blocks"].as_u64() > Some(0)
    })
    .await;
    let stream = &list[0]["kv_events"]["streams"][0];
    assert_eq!(stream["endpoint"], publisher(&engine).as_str());
    assert_eq!(stream["replay_endpoint"], replayer(&engine).as_str());
    let metrics = get(&client, addr, "/metrics").await;
    assert!(
        sample(&metrics, "router_kv_replays_total") >= 1.0,
        "{metrics}"
    );
    assert_eq!(app.stop().await, StopOutcome::Drained);
    engine.shutdown().await;
}

/// `--pd-kv-events`: a static prefill worker's events are followed at the
/// endpoint given, and a P/D request's prefill blocks reach the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_kv_events_follows_a_prefill_worker_at_its_given_endpoint() {
    use affinity_router::sim::{Role, TransferRegistry};
    let (kv_connector, moriio_mode) =
        affinity_router::sim::for_deployment("nixl".parse().unwrap()).unwrap();
    let transfers = TransferRegistry::new();
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let prefill = affinity_router::sim::spawn(
        EngineConfig {
            role: Role::Prefill,
            kv_connector,
            moriio_mode,
            ..EngineConfig::instant()
        },
        ServeOptions {
            registry: Some(transfers.clone()),
            kv_events: Some(KvEventsOptions::new(any).with_replay(any)),
            ..ServeOptions::default()
        },
    )
    .await
    .unwrap();
    let decode = affinity_router::sim::spawn(
        EngineConfig {
            role: Role::Decode,
            kv_connector,
            moriio_mode,
            ..EngineConfig::instant()
        },
        ServeOptions {
            registry: Some(transfers),
            ..ServeOptions::default()
        },
    )
    .await
    .unwrap();
    let (prefill_url, decode_url) = (prefill.url(), decode.url());
    let source = format!("{prefill_url}={}", publisher(&prefill));
    // P/D has no replay flag of its own: --kv-event-replay-source takes a
    // P/D worker of a kv_aware pool too.
    let replay = format!("{prefill_url}={}", replayer(&prefill));
    let app = App::start(&quick(&[
        "--vllm-pd-disaggregation",
        "--prefill",
        &prefill_url,
        "--decode",
        &decode_url,
        "--prefill-policy",
        "kv_aware",
        "--decode-policy",
        "round_robin",
        "--pd-kv-events",
        &source,
        "--kv-event-replay-source",
        &replay,
    ]))
    .await
    .unwrap();
    let client = client();
    let addr = app.addr();
    wait_connected(&client, addr, 1).await;
    let (status, body) = request(
        &client,
        "POST",
        format!("http://{addr}/v1/chat/completions"),
        &chat("sim-model", 0),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let list = wait_for_workers(&client, addr, "the prefill worker live", |list| {
        list.iter()
            .any(|w| w["url"] == prefill_url.as_str() && w["kv_events"]["state"] == "live")
    })
    .await;
    let followed: Vec<&serde_json::Value> = list
        .iter()
        .filter(|w| w.get("kv_events").is_some())
        .collect();
    assert_eq!(
        followed.len(),
        1,
        "only the kv_aware prefill pool is followed"
    );
    let stream = &followed[0]["kv_events"]["streams"][0];
    assert_eq!(stream["endpoint"], publisher(&prefill).as_str());
    assert_eq!(stream["replay_endpoint"], replayer(&prefill).as_str());
    assert_eq!(app.stop().await, StopOutcome::Drained);
    prefill.shutdown().await;
    decode.shutdown().await;
}

/// `--kv-event-block-size`: the index hashes the engines' blocks at this
/// size. An engine with 32-token blocks is followed block for block with
/// `--kv-event-block-size 32`; at the default 16 every block it reports is
/// malformed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_event_block_size_is_the_size_the_index_hashes_at() {
    let mut config = EngineConfig::instant();
    config.model.block_size = 32;
    let engine = engine(config, 0, true).await;
    let url = engine.url();
    let source = format!("{url}={}", publisher(&engine));
    let replay = format!("{url}={}", replayer(&engine));
    let client = client();
    for (size, stored) in [(Some("32"), true), (None, false)] {
        let mut args = vec![
            "--worker-urls",
            &url,
            "--policy",
            "kv_aware",
            "--kv-event-source",
            &source,
            "--kv-event-replay-source",
            &replay,
        ];
        if let Some(size) = size {
            args.extend(["--kv-event-block-size", size]);
        }
        let settings = quick(&args);
        let expected = if stored { 32 } else { 16 };
        assert_eq!(settings.router.policy.cache_aware.block_size, expected);
        let app = App::start(&settings).await.unwrap();
        let addr = app.addr();
        prime(&client, &engine).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let metrics = loop {
            let metrics = get(&client, addr, "/metrics").await;
            let applied = sample(&metrics, "router_kv_index_blocks_total{outcome=\"stored\"}")
                + sample(
                    &metrics,
                    "router_kv_index_blocks_total{outcome=\"malformed\"}",
                );
            if applied > 0.0 {
                break metrics;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no block applied\n{metrics}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let stored_blocks = sample(&metrics, "router_kv_index_blocks_total{outcome=\"stored\"}");
        let malformed = sample(
            &metrics,
            "router_kv_index_blocks_total{outcome=\"malformed\"}",
        );
        if stored {
            assert!(stored_blocks > 0.0 && malformed == 0.0, "{metrics}");
        } else {
            assert!(stored_blocks == 0.0 && malformed > 0.0, "{metrics}");
        }
        assert_eq!(app.stop().await, StopOutcome::Drained);
    }
    engine.shutdown().await;
}

/// `--kv-event-model`: only that model's requests are scored on the index
/// (a conversation's next turn is a `kv_hit`); naming another model
/// leaves these requests to cache_aware.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_event_model_scores_only_that_models_requests_on_the_index() {
    let client = client();
    for (model, policy) in [("sim-model", "kv_aware"), ("another-model", "cache_aware")] {
        let app = App::start(&quick(&[
            "--sim-workers",
            "2",
            "--policy",
            "kv_aware",
            "--kv-event-model",
            model,
        ]))
        .await
        .unwrap();
        let addr = app.addr();
        let hub = app.router().kv_events().unwrap().clone();
        let url = format!("http://{addr}/v1/chat/completions");
        let (status, body) = request(&client, "POST", url.clone(), &chat("sim-model", 0)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while hub.index().stats().pairs == 0 {
            assert!(tokio::time::Instant::now() < deadline, "no events arrived");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (status, body) = request(&client, "POST", url, &chat("sim-model", 1)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let metrics = get(&client, addr, "/metrics").await;
        let decisions: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with("router_policy_decisions_total{model=\"sim-model\""))
            .filter(|l| !l.ends_with(" 0"))
            .collect();
        assert!(
            !decisions.is_empty()
                && decisions
                    .iter()
                    .all(|l| l.contains(&format!("policy=\"{policy}\""))),
            "--kv-event-model {model}: sim-model's decisions are {policy}'s: {decisions:#?}"
        );
        assert_eq!(
            decisions.iter().any(|l| l.contains("reason=\"kv_hit\"")),
            policy == "kv_aware",
            "{decisions:#?}"
        );
        assert_eq!(app.stop().await, StopOutcome::Drained);
    }
}

/// What a flag refuses, through the binary: exit code 2 and a message that
/// starts with the flag.
#[test]
fn bad_values_stop_the_binary_with_exit_code_2_naming_the_flag() {
    const W: &str = "http://127.0.0.1:9";
    let source = |value: &str| vec!["--kv-event-source".to_owned(), value.to_owned()];
    let kv = ["--worker-urls", W, "--policy", "kv_aware"];
    let pd = [
        "--vllm-pd-disaggregation",
        "--prefill",
        "http://127.0.0.1:7",
        "--decode",
        "http://127.0.0.1:8",
        "--prefill-policy",
        "kv_aware",
        "--decode-policy",
        "round_robin",
    ];
    let with = |base: &[&str], more: Vec<String>| -> Vec<String> {
        base.iter().map(|s| (*s).to_owned()).chain(more).collect()
    };
    let cases: Vec<(Vec<String>, &str, &str)> = vec![
        // Not URL=ENDPOINT.
        (
            with(&kv, source("tcp://127.0.0.1:6000")),
            "--kv-event-source",
            "is not URL=ENDPOINT",
        ),
        // Not tcp://HOST:PORT.
        (
            with(&kv, source(&format!("{W}=127.0.0.1:6000"))),
            "--kv-event-source",
            "is not a tcp://HOST:PORT address",
        ),
        // Not a configured worker.
        (
            with(&kv, source("http://127.0.0.1:10=tcp://127.0.0.1:6000")),
            "--kv-event-source",
            "is not a --worker-urls worker",
        ),
        // The same worker twice.
        (
            with(
                &kv,
                [
                    source(&format!("{W}=tcp://127.0.0.1:6000")),
                    source(&format!("{W}/=tcp://127.0.0.1:6001")),
                ]
                .concat(),
            ),
            "--kv-event-source",
            "is given twice",
        ),
        // Without a kv_aware policy.
        (
            with(
                &["--worker-urls", W],
                source(&format!("{W}=tcp://127.0.0.1:6000")),
            ),
            "--kv-event-source",
            "needs a kv_aware policy",
        ),
        // A list that does not match the known data-parallel size.
        (
            with(
                &kv,
                [
                    vec!["--intra-node-data-parallel-size".to_owned(), "2".to_owned()],
                    source(&format!("{W}=tcp://a:1,tcp://a:2,tcp://a:3")),
                ]
                .concat(),
            ),
            "--kv-event-source",
            "3 publisher endpoints for its 2 data-parallel ranks",
        ),
        (
            with(
                &kv,
                vec![
                    "--kv-event-replay-source".to_owned(),
                    format!("{W}=tcp://127.0.0.1:6000,oops"),
                ],
            ),
            "--kv-event-replay-source",
            "`oops` is not a tcp://HOST:PORT address",
        ),
        // --pd-kv-events: a P/D worker of a kv_aware pool only.
        (
            with(
                &pd,
                vec![
                    "--pd-kv-events".to_owned(),
                    "http://127.0.0.1:8=tcp://a:1".to_owned(),
                ],
            ),
            "--pd-kv-events",
            "is a decode worker whose pool does not follow KV events",
        ),
        (
            with(
                &pd,
                vec![
                    "--kv-event-source".to_owned(),
                    "http://127.0.0.1:7=tcp://a:1".to_owned(),
                ],
            ),
            "--kv-event-source",
            "is a P/D worker",
        ),
        (
            with(
                &kv,
                vec!["--pd-kv-events".to_owned(), format!("{W}=tcp://a:1")],
            ),
            "--pd-kv-events",
            "needs --vllm-pd-disaggregation",
        ),
        // --kv-event-block-size: 0, a contradiction, no kv_aware.
        (
            with(
                &kv,
                vec!["--kv-event-block-size".to_owned(), "0".to_owned()],
            ),
            "--kv-event-block-size",
            "must be at least 1",
        ),
        (
            with(
                &kv,
                ["--kv-event-block-size", "32", "--block-size", "16"]
                    .map(str::to_owned)
                    .to_vec(),
            ),
            "--kv-event-block-size",
            "32 contradicts --block-size 16",
        ),
        (
            with(
                &["--worker-urls", W],
                vec!["--kv-event-block-size".to_owned(), "32".to_owned()],
            ),
            "--kv-event-block-size",
            "needs a kv_aware policy",
        ),
        // --kv-event-model: a model without a tokenizer, no kv_aware.
        (
            with(&kv, vec!["--kv-event-model".to_owned(), "m".to_owned()]),
            "--kv-event-model",
            "no tokenizer is configured for model \"m\"",
        ),
        (
            with(
                &["--sim-workers", "1"],
                vec!["--kv-event-model".to_owned(), "sim-model".to_owned()],
            ),
            "--kv-event-model",
            "needs a kv_aware policy",
        ),
    ];
    let binary = env!("CARGO_BIN_EXE_affinity-router");
    for (args, flag, expected) in cases {
        let out = std::process::Command::new(binary)
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with(&format!("error: {flag}: ")) && stderr.contains(expected),
            "{args:?}: expected {flag} ... {expected:?}, got {stderr}"
        );
    }
}

/// Good values, as `Settings`: where each flag's endpoints land, the
/// command line over the `[workers."URL"]` table, the block size and model.
#[test]
fn the_flags_land_in_the_router_config_and_win_over_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kv.toml");
    std::fs::write(
        &file,
        "[workers.\"http://10.0.0.5:8000\"]\n\
         kv_events_endpoint = \"tcp://10.0.0.9:7000\"\n\
         kv_events_replay_endpoint = [\"tcp://10.0.0.9:7100\", \"tcp://10.0.0.9:7101\"]\n\
         [workers.\"http://10.0.0.7:8000\"]\n\
         kv_events_endpoint = [\"tcp://10.0.0.7:5557\", \"tcp://10.0.0.8:5557\"]\n",
    )
    .unwrap();
    let s = settings(&[
        "--worker-urls",
        "http://10.0.0.5:8000",
        "http://10.0.0.6:8000",
        "--policy",
        "kv_aware",
        "--intra-node-data-parallel-size",
        "2",
        "--config",
        file.to_str().unwrap(),
        "--kv-event-source",
        "http://10.0.0.5:8000=tcp://e:1,tcp://f:2",
        "--kv-event-replay-source",
        "http://10.0.0.6:8000=tcp://g:3",
        "--kv-event-block-size",
        "32",
        "--tokenizer-path",
        &tokenizer_dir(dir.path()),
        "--kv-event-model",
        "m",
    ])
    .unwrap();
    let kv = &s.router.kv_events;
    // The flag replaced the table's publisher, and kept its replay list.
    let five = &kv.endpoints["http://10.0.0.5:8000"];
    assert_eq!(five.publishers, ["tcp://e:1", "tcp://f:2"]);
    assert_eq!(five.replays, ["tcp://10.0.0.9:7100", "tcp://10.0.0.9:7101"]);
    // A replay source alone: the publisher at --kv-events-port of its host.
    let six = &kv.endpoints["http://10.0.0.6:8000"];
    assert_eq!(six.publishers, ["tcp://10.0.0.6:5557"]);
    assert_eq!(six.replays, ["tcp://g:3"]);
    // A table for a worker joining at run time, as it was.
    let seven = &kv.endpoints["http://10.0.0.7:8000"];
    assert_eq!(
        seven.publishers,
        ["tcp://10.0.0.7:5557", "tcp://10.0.0.8:5557"]
    );
    assert!(seven.replays.is_empty());
    assert_eq!(s.router.policy.cache_aware.block_size, 32);
    assert_eq!(s.args.block_size, 32);
    assert_eq!(kv.model.as_deref(), Some("m"));

    // The same key in a config file works as the flag does.
    let keys = dir.path().join("keys.toml");
    std::fs::write(
        &keys,
        "policy = \"kv_aware\"\nworker_urls = [\"http://10.0.0.5:8000\"]\n\
         kv_event_source = [\"http://10.0.0.5:8000=tcp://h:4\"]\nkv_event_block_size = 16\n",
    )
    .unwrap();
    let s = settings(&["--config", keys.to_str().unwrap()]).unwrap();
    assert_eq!(
        s.router.kv_events.endpoints["http://10.0.0.5:8000"].publishers,
        ["tcp://h:4"]
    );
    // A table's per-rank list is held to the known data-parallel size too.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[workers.\"http://10.0.0.5:8000\"]\n\
         kv_events_endpoint = [\"tcp://a:1\", \"tcp://a:2\", \"tcp://a:3\"]\n",
    )
    .unwrap();
    let err = settings(&[
        "--worker-urls",
        "http://10.0.0.5:8000",
        "--policy",
        "kv_aware",
        "--intra-node-data-parallel-size",
        "2",
        "--config",
        bad.to_str().unwrap(),
    ])
    .unwrap_err();
    assert_eq!(err.exit_code(), 2);
    assert!(
        err.to_string().starts_with(
            "--config: [workers.\"http://10.0.0.5:8000\"] kv_events_endpoint: 3 publisher \
             endpoints for its 2 data-parallel ranks"
        ),
        "{err}"
    );
    // The same value for both block-size flags is no contradiction.
    settings(&[
        "--worker-urls",
        "http://10.0.0.5:8000",
        "--policy",
        "kv_aware_gate",
        "--block-size",
        "32",
        "--kv-event-block-size",
        "32",
    ])
    .unwrap();
}

/// A model directory with a tokenizer, for `--tokenizer-path`.
fn tokenizer_dir(parent: &std::path::Path) -> String {
    use prompt_tokens::TemplateFamily;
    use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
    let dir = parent.join("model");
    std::fs::create_dir_all(&dir).unwrap();
    write_model_dir(
        &dir,
        TemplateFamily::ChatMl,
        TestTokenizerKind::ByteLevelRegex,
    )
    .unwrap();
    dir.to_str().unwrap().to_owned()
}
