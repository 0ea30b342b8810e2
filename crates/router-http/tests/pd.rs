//! Prefill/decode mode over HTTP: engine-sim prefill and decode engines
//! sharing one transfer registry, so every decode leg's KV hand-off is
//! checked by the decode engine itself.

mod common;

use common::{Connection, call, chat_body, json};
use engine_sim::{
    EngineConfig, EngineHandle, FaultConfig, MoriIoMode, Role, ServeOptions, TransferFormat,
    TransferRegistry,
};
use http::StatusCode;
use http_body_util::BodyExt;
use pd_orchestrator::{MoriIoEndpoint, MoriIoMode as PdMoriIoMode, Phase};
use router_http::{PdConfig, PdConnector, PdWorkerConfig, Router, RouterConfig};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use worker_lifecycle::{Endpoint, Registration, RoleKind, ServiceRegistry, Worker};

/// A P/D router serving on a loopback port, with its engines.
struct PdFixture {
    router: Router,
    addr: SocketAddr,
    prefill: Vec<EngineHandle>,
    decode: Vec<EngineHandle>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<router_http::ShutdownOutcome>>,
}

impl PdFixture {
    async fn serve(router: Router, prefill: Vec<EngineHandle>, decode: Vec<EngineHandle>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let serving = router.clone();
        let server = tokio::spawn(async move {
            serving
                .serve(listener, async {
                    let _ = stopped.await;
                })
                .await
        });
        Self {
            router,
            addr,
            prefill,
            decode,
            stop: Some(stop),
            server: Some(server),
        }
    }

    fn pd(&self) -> &Arc<router_http::PdPools> {
        self.router.pd().expect("P/D mode")
    }

    fn prefill_workers(&self) -> Arc<[Arc<Worker>]> {
        self.pd().prefill().workers()
    }

    fn decode_workers(&self) -> Arc<[Arc<Worker>]> {
        self.pd().decode().workers()
    }

    /// Waits (bounded) until every worker of both roles is at load 0, and
    /// checks no decrement was ever clamped and no permit leaked.
    async fn assert_loads_return_to_zero(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let loads: Vec<usize> = self.router.all_workers().iter().map(|w| w.load()).collect();
            if loads.iter().all(|&l| l == 0) && self.router.in_flight() == 0 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "loads did not return to 0: {loads:?}, in flight {}",
                self.router.in_flight()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for worker in self.router.all_workers() {
            assert_eq!(worker.underflows(), 0, "underflow on {}", worker.key());
        }
    }

    async fn shutdown(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.server.take().unwrap().await.unwrap();
    }
}

fn engine(role: Role, connector: TransferFormat, mode: MoriIoMode, id: &str) -> EngineConfig {
    EngineConfig {
        role,
        kv_connector: connector,
        moriio_mode: mode,
        engine_id: Some(id.to_owned()),
        ..EngineConfig::instant()
    }
}

async fn spawn(config: EngineConfig, registry: &Arc<TransferRegistry>) -> EngineHandle {
    let bootstrap = (config.role == Role::Prefill
        && config.kv_connector == TransferFormat::Mooncake)
        .then(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let options = ServeOptions {
        registry: Some(registry.clone()),
        bootstrap_addr: bootstrap,
        ..ServeOptions::default()
    };
    engine_sim::spawn(config, options).await.unwrap()
}

const MORIIO_PORTS: MoriIoEndpoint = MoriIoEndpoint {
    handshake_port: 7301,
    notify_port: 7302,
    dp_size: 1,
    tp_size: 1,
};

/// The static worker entry of `handle`, with what the connector needs.
fn worker_config(handle: &EngineHandle, connector: PdConnector) -> PdWorkerConfig {
    let mut config = PdWorkerConfig::new(handle.url());
    if let Some(bootstrap) = handle.bootstrap_addr() {
        config = config.with_bootstrap_port(bootstrap.port());
    }
    if matches!(connector, PdConnector::MoriIo(_)) {
        config = config.with_moriio(MORIIO_PORTS);
    }
    config
}

fn router_config(pd: PdConfig, policy: &str) -> RouterConfig {
    RouterConfig {
        policy: lb_policies::PolicyConfig::named(policy),
        pd: Some(pd),
        ..RouterConfig::default()
    }
}

/// `prefill` prefill engines (with the given faults, in order) and one
/// decode engine, all speaking `connector` and sharing one registry.
async fn start(
    connector: PdConnector,
    prefill_faults: &[FaultConfig],
    decode: EngineConfig,
    policy: &str,
) -> PdFixture {
    start_with(connector, prefill_faults, decode, policy, |_| {}).await
}

/// [`start`] with the router's configuration changed by `configure`.
async fn start_with(
    connector: PdConnector,
    prefill_faults: &[FaultConfig],
    decode: EngineConfig,
    policy: &str,
    configure: impl FnOnce(&mut RouterConfig),
) -> PdFixture {
    let registry = TransferRegistry::new();
    // The one mapping of a connector to its engines' settings (fleet-sim's,
    // which the router's command line uses too).
    let (kv, mode) = fleet_sim::for_deployment(connector)
        .unwrap_or_else(|| panic!("engine-sim has no format for the {connector} connector"));
    let mut prefill = Vec::new();
    for (i, faults) in prefill_faults.iter().enumerate() {
        let mut config = engine(Role::Prefill, kv, mode, &format!("prefill-{i}"));
        config.faults = faults.clone();
        prefill.push(spawn(config, &registry).await);
    }
    let decode_config = EngineConfig {
        role: Role::Decode,
        kv_connector: kv,
        moriio_mode: mode,
        engine_id: Some("decode-0".into()),
        ..decode
    };
    let decode = vec![spawn(decode_config, &registry).await];
    let mut pd = PdConfig::new(connector);
    pd.prefill = prefill
        .iter()
        .map(|h| worker_config(h, connector))
        .collect();
    pd.decode = decode.iter().map(|h| worker_config(h, connector)).collect();
    let mut config = router_config(pd, policy);
    configure(&mut config);
    let router = Router::start(config).await.unwrap();
    PdFixture::serve(router, prefill, decode).await
}

fn completion_body(prompt: &str, stream: bool) -> String {
    serde_json::json!({
        "model": "sim-model",
        "prompt": prompt,
        "max_tokens": 6,
        "stream": stream,
        "stream_options": if stream { serde_json::json!({"include_usage": true}) } else { serde_json::Value::Null },
    })
    .to_string()
}

fn invalid_transfers(handle: &EngineHandle) -> u64 {
    handle.stats().kv_transfers_invalid.values().sum()
}

/// Every connector: chat and completions, streamed and not, all succeed,
/// and the decode engine counts every hand-off valid.
#[tokio::test]
async fn every_connector_hands_off_valid_transfers() {
    for connector in [
        PdConnector::Nixl,
        PdConnector::Mooncake { concurrent: true },
        PdConnector::Mooncake { concurrent: false },
        PdConnector::MoriIo(PdMoriIoMode::Read),
        PdConnector::MoriIo(PdMoriIoMode::Write),
    ] {
        let fixture = start(
            connector,
            &[FaultConfig::default()],
            EngineConfig::instant(),
            "round_robin",
        )
        .await;
        let prompt = "Explain how a radix tree stores shared prefixes. ".repeat(4);
        // (path, body, completion tokens asked for)
        let requests = [
            ("/v1/chat/completions", chat_body(&prompt, false), 8),
            ("/v1/chat/completions", chat_body(&prompt, true), 8),
            ("/v1/completions", completion_body(&prompt, false), 6),
            ("/v1/completions", completion_body(&prompt, true), 6),
        ];
        for (path, body, tokens) in &requests {
            let (status, headers, bytes) = call(
                fixture.addr,
                "POST",
                path,
                &[
                    ("content-type", "application/json"),
                    ("x-request-id", "req-7"),
                ],
                body.clone(),
            )
            .await;
            let text = String::from_utf8_lossy(&bytes);
            assert_eq!(status, StatusCode::OK, "{connector:?} {path}: {text}");
            assert_eq!(headers["x-request-id"], "req-7");
            if text.starts_with("data:") {
                assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
            } else {
                let value = json(&bytes);
                assert_eq!(
                    value["usage"]["completion_tokens"], *tokens,
                    "{connector:?} {value}"
                );
                // The prompt was processed by the prefill engine: reported
                // once, and not as a full cache hit from the transfer.
                assert!(value["usage"]["prompt_tokens"].as_u64().unwrap() > 10);
            }
        }
        let decode = &fixture.decode[0];
        assert_eq!(
            decode.stats().kv_transfers_valid,
            requests.len() as u64,
            "{connector:?}: {:?}",
            decode.stats().kv_transfers_invalid
        );
        assert_eq!(invalid_transfers(decode), 0, "{connector:?}");
        assert_eq!(
            fixture.pd().metrics().outcomes(Phase::Decode, "success"),
            requests.len() as u64
        );
        assert_eq!(
            fixture.pd().metrics().outcomes(Phase::Prefill, "success"),
            requests.len() as u64
        );
        let (_, _, text) = call(fixture.addr, "GET", "/metrics", &[], "").await;
        let text = String::from_utf8_lossy(&text);
        for phase in ["prefill", "decode"] {
            let series = format!(
                "router_pd_leg_outcomes_total{{phase=\"{phase}\",outcome=\"success\"}} {}",
                requests.len()
            );
            assert!(text.contains(&series), "{series} missing:\n{text}");
        }
        assert!(text.contains("router_pd_missing_prefill_kv_params_total 0"));
        fixture.assert_loads_return_to_zero().await;
        assert_eq!(
            fixture.prefill_workers()[0].processed(),
            requests.len() as u64
        );
        assert_eq!(
            fixture.decode_workers()[0].processed(),
            requests.len() as u64
        );
        fixture.shutdown().await;
    }
}

/// A P/D request is parsed once, into the value its legs are written from;
/// routing and its token ids are read from that value. Chat and completion
/// requests route on ids and run; a body routing reads but serde_json
/// cannot build as a value, and one with a field of the wrong type, are the
/// same 400s, with the same messages, as before the parse was shared.
#[cfg(feature = "tokens")]
#[tokio::test]
async fn a_tokenized_request_is_routed_and_run_from_one_parse() {
    use prompt_tokens::PromptTokenizer;
    use router_http::ApiKind;
    use router_http::tokens::Tokenizers;

    let fixture = start_with(
        PdConnector::Nixl,
        &[FaultConfig::default()],
        EngineConfig::instant(),
        "cache_aware",
        |config| {
            config.tokenizers =
                Tokenizers::default().with_default(Arc::new(PromptTokenizer::synthetic(4)));
        },
    )
    .await;
    let prompt = "Explain how a radix tree stores shared prefixes. ".repeat(4);
    for (path, body) in [
        ("/v1/chat/completions", chat_body(&prompt, false)),
        ("/v1/completions", completion_body(&prompt, false)),
    ] {
        let (status, _, bytes) = call(
            fixture.addr,
            "POST",
            path,
            &[("content-type", "application/json")],
            body,
        )
        .await;
        assert_eq!(
            status,
            StatusCode::OK,
            "{path}: {}",
            String::from_utf8_lossy(&bytes)
        );
    }
    let (_, _, text) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let text = String::from_utf8_lossy(&text);
    for series in [
        "router_tokens_routed_total{model=\"*\"} 2",
        "router_tokens_fallbacks_total{model=\"*\"} 0",
    ] {
        assert!(text.contains(series), "{series} missing:\n{text}");
    }
    assert_eq!(fixture.decode[0].stats().kv_transfers_valid, 2);

    // Nesting past serde_json's limit in a field routing skips: routing
    // reads the body, the legs' value cannot be built.
    let mut deep =
        String::from(r#"{"model":"sim-model","messages":[{"role":"user","content":"x"}],"extra":"#);
    deep.extend(std::iter::repeat_n('[', 200));
    deep.extend(std::iter::repeat_n(']', 200));
    deep.push('}');
    let typed =
        r#"{"model":"sim-model","messages":[{"role":"user","content":"x"}],"stream":"yes"}"#;
    let expected = [
        (
            deep.clone(),
            "invalid_json",
            format!(
                "request body is not valid JSON: {}",
                serde_json::from_str::<serde_json::Value>(&deep).unwrap_err()
            ),
        ),
        (
            typed.to_owned(),
            "invalid_request",
            router_http::extract(ApiKind::ChatCompletions, typed.as_bytes())
                .unwrap_err()
                .to_string(),
        ),
    ];
    for (body, code, message) in expected {
        let (status, _, bytes) = call(
            fixture.addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            body,
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let error = json(&bytes);
        assert_eq!(error["error"]["code"], code, "{error}");
        assert_eq!(error["error"]["message"], message, "{error}");
    }
    fixture.assert_loads_return_to_zero().await;
    fixture.shutdown().await;
}

/// A slowly decoding engine: the decode load stays 1 while the client
/// reads the stream (the prefill's is already 0 with a sequential
/// connector), and returns to 0 once the stream is read to its end.
#[tokio::test]
async fn streaming_decode_load_lasts_until_the_last_chunk() {
    let slow = EngineConfig {
        time_scale: 1.0,
        ..EngineConfig::default()
    };
    let fixture = start(
        PdConnector::Nixl,
        &[FaultConfig::default()],
        slow,
        "round_robin",
    )
    .await;
    let body = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Count slowly."}],
        "max_tokens": 12,
        "stream": true,
    })
    .to_string();
    let mut connection = Connection::open(fixture.addr).await;
    let response = connection
        .send("POST", "/v1/chat/completions", &[], body)
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.data_ref().is_some_and(|d| !d.is_empty()));
    assert_eq!(fixture.decode_workers()[0].load(), 1, "decode is streaming");
    assert_eq!(
        fixture.prefill_workers()[0].load(),
        0,
        "prefill ended before decode"
    );
    let mut text = String::from_utf8_lossy(first.data_ref().unwrap()).into_owned();
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame.unwrap().data_ref() {
            text.push_str(&String::from_utf8_lossy(data));
        }
        // Until the last of the 12 tokens arrived the engine still has a
        // token to produce, so the decode stream cannot have ended yet.
        if text.matches("\"delta\":{\"content\"").count() < 12 {
            assert_eq!(fixture.decode_workers()[0].load(), 1, "mid-stream");
        }
    }
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    fixture.assert_loads_return_to_zero().await;
    assert_eq!(fixture.decode[0].stats().kv_transfers_valid, 1);
    fixture.shutdown().await;
}

/// A decode engine that sends its headers and then nothing: the client
/// going away releases the decode load (and the permit) while the upstream
/// is still stalled.
#[tokio::test]
async fn client_dropping_a_stalled_stream_releases_the_decode_load() {
    let stalled = EngineConfig {
        faults: FaultConfig {
            stall_after_headers: Some(Duration::MAX),
            ..FaultConfig::default()
        },
        ..EngineConfig::instant()
    };
    let fixture = start(
        PdConnector::Nixl,
        &[FaultConfig::default()],
        stalled,
        "round_robin",
    )
    .await;
    let mut connection = Connection::open(fixture.addr).await;
    let response = connection
        .send(
            "POST",
            "/v1/chat/completions",
            &[],
            chat_body("Never finishes.", true),
        )
        .await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(fixture.decode_workers()[0].load(), 1);
    assert_eq!(fixture.router.in_flight(), 1);
    drop(response);
    drop(connection);
    fixture.assert_loads_return_to_zero().await;
    assert_eq!(
        fixture.pd().metrics().outcomes(Phase::Decode, "cancelled"),
        1,
        "the dropped decode leg is recorded as cancelled"
    );
    fixture.shutdown().await;
}

/// A prefill engine that answers 503: every request is retried on the
/// other prefill worker before decode starts, and succeeds.
#[tokio::test]
async fn failed_prefill_is_retried_on_another_prefill_worker() {
    let broken = FaultConfig {
        fixed_status: Some(503),
        ..FaultConfig::default()
    };
    let fixture = start(
        PdConnector::Nixl,
        &[broken, FaultConfig::default()],
        EngineConfig::instant(),
        "round_robin",
    )
    .await;
    for i in 0..4 {
        let (status, _, bytes) = call(
            fixture.addr,
            "POST",
            "/v1/completions",
            &[],
            completion_body(&format!("Request number {i} about prefill retries."), false),
        )
        .await;
        assert_eq!(
            status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&bytes)
        );
    }
    let metrics = fixture.pd().metrics();
    assert_eq!(metrics.outcomes(Phase::Decode, "success"), 4);
    assert_eq!(metrics.outcomes(Phase::Prefill, "success"), 4);
    let failures = metrics.outcomes(Phase::Prefill, "worker_failure");
    assert!(
        failures >= 1,
        "round robin sent some requests to the broken prefill"
    );
    assert_eq!(fixture.decode[0].stats().kv_transfers_valid, 4);
    assert_eq!(invalid_transfers(&fixture.decode[0]), 0);
    let (_, _, text) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let text = String::from_utf8_lossy(&text);
    assert!(
        text.contains(&format!("router_pd_prefill_retries_total {failures}")),
        "{text}"
    );
    fixture.assert_loads_return_to_zero().await;
    fixture.shutdown().await;
}

/// No decode worker: 503 naming the decode role, and nothing left behind —
/// no load, no reservation ever made, no policy decision (so no cache-tree
/// insertion) in either role.
#[tokio::test]
async fn empty_decode_pool_is_a_clean_503() {
    let registry = TransferRegistry::new();
    let prefill = spawn(
        engine(Role::Prefill, TransferFormat::Nixl, MoriIoMode::Read, "p0"),
        &registry,
    )
    .await;
    let mut pd = PdConfig::new(PdConnector::Nixl);
    pd.prefill = vec![PdWorkerConfig::new(prefill.url())];
    let router = Router::start(router_config(pd, "cache_aware"))
        .await
        .unwrap();
    let fixture = PdFixture::serve(router, vec![prefill], Vec::new()).await;
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let body = if path == "/v1/completions" {
            completion_body("No decode worker anywhere.", false)
        } else {
            chat_body("No decode worker anywhere.", false)
        };
        let (status, _, bytes) = call(fixture.addr, "POST", path, &[], body).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        let error = json(&bytes);
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("decode"), "{message}");
        assert_eq!(error["error"]["code"], "no_available_worker");
    }
    let prefill = &fixture.prefill_workers()[0];
    assert_eq!(prefill.load(), 0);
    assert_eq!(prefill.processed(), 0, "no reservation was ever made");
    for role in [fixture.pd().prefill(), fixture.pd().decode()] {
        let decisions: u64 = role
            .policies()
            .counts()
            .iter()
            .map(|(_, _, counts)| counts.total() + counts.no_candidate())
            .sum();
        assert_eq!(decisions, 0, "{} policy was asked", role.role());
    }
    assert_eq!(fixture.pd().decode().unavailable_count(), 2);
    assert_eq!(fixture.prefill[0].stats().requests_finished, 0);
    let (status, _, bytes) = call(fixture.addr, "GET", "/readiness", &[], "").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(json(&bytes)["decode_workers"], 0);

    // An operator adds a decode worker: requests flow; removing it again
    // brings the clean 503 back.
    let decode = spawn(
        engine(Role::Decode, TransferFormat::Nixl, MoriIoMode::Read, "d0"),
        &registry,
    )
    .await;
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        &format!("/add_worker?url={}", decode.url()),
        &[],
        "",
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "P/D mode needs a role");
    let (status, _, bytes) = call(
        fixture.addr,
        "POST",
        &format!("/add_worker?url={}&role=decode", decode.url()),
        &[],
        "",
    )
    .await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    assert_eq!(json(&bytes)["worker"]["role"], "decode");
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/completions",
        &[],
        completion_body("Now there is a decode worker.", false),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(decode.stats().kv_transfers_valid, 1);
    let (status, _, _) = call(fixture.addr, "GET", "/readiness", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, bytes) = call(
        fixture.addr,
        "POST",
        &format!("/remove_worker?url={}&role=decode", decode.url()),
        &[],
        "",
    )
    .await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    assert_eq!(json(&bytes)["drained"], true);
    assert!(fixture.decode_workers().is_empty());
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/completions",
        &[],
        completion_body("Gone again.", false),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    fixture.assert_loads_return_to_zero().await;
    fixture.shutdown().await;
}

/// One engine listed as both prefill and decode: two workers with their own
/// keys, loads and processed counts. A regular engine returns no KV
/// parameters, so decode recomputes the prompt — counted, never silent.
#[tokio::test]
async fn same_url_in_both_roles_is_two_workers() {
    let shared_engine = engine_sim::spawn(EngineConfig::instant(), ServeOptions::default())
        .await
        .unwrap();
    let mut pd = PdConfig::new(PdConnector::Nixl);
    pd.prefill = vec![PdWorkerConfig::new(shared_engine.url())];
    pd.decode = vec![PdWorkerConfig::new(shared_engine.url())];
    let router = Router::start(router_config(pd, "round_robin"))
        .await
        .unwrap();
    let fixture = PdFixture::serve(router, Vec::new(), vec![shared_engine]).await;
    let (status, _, bytes) = call(fixture.addr, "GET", "/workers", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    let workers = json(&bytes);
    let workers = workers.as_array().unwrap();
    assert_eq!(workers.len(), 2, "{workers:?}");
    let roles: Vec<&str> = workers
        .iter()
        .map(|w| w["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["prefill", "decode"]);
    assert_eq!(workers[0]["url"], workers[1]["url"]);

    let (status, _, bytes) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        chat_body("Same engine, two roles.", false),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    fixture.assert_loads_return_to_zero().await;
    let (prefill, decode) = (&fixture.prefill_workers()[0], &fixture.decode_workers()[0]);
    assert_ne!(prefill.key(), decode.key());
    assert_eq!((prefill.processed(), decode.processed()), (1, 1));

    let (_, _, text) = call(fixture.addr, "GET", "/metrics", &[], "").await;
    let text = String::from_utf8_lossy(&text);
    assert!(
        text.contains("router_pd_missing_prefill_kv_params_total 1"),
        "{text}"
    );
    assert!(
        text.contains("role=\"prefill\""),
        "per-worker series carry the role"
    );
    assert!(text.contains("router_worker_load{url=\""), "{text}");
    // Routes other than the two-phase ones go to a decode worker.
    let (status, _, bytes) = call(fixture.addr, "GET", "/v1/models", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(json(&bytes)["data"][0]["id"], "sim-model");
    fixture.assert_loads_return_to_zero().await;
    assert_eq!(fixture.decode_workers()[0].processed(), 2);
    assert_eq!(fixture.prefill_workers()[0].processed(), 1);
    let (status, _, bytes) = call(fixture.addr, "GET", "/list_workers", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    let list = json(&bytes);
    assert_eq!(list["prefill"].as_array().unwrap().len(), 1);
    assert_eq!(list["decode"].as_array().unwrap().len(), 1);
    fixture.shutdown().await;
}

/// Discovery: workers come from the registries; requests flow; when both
/// registrations expire the router answers 503; a new registration is a
/// fresh worker with load 0.
#[tokio::test]
async fn discovered_workers_route_expire_and_come_back_fresh() {
    let ttl = Duration::from_millis(1500);
    let transfers = TransferRegistry::new();
    let prefill = spawn(
        engine(Role::Prefill, TransferFormat::Nixl, MoriIoMode::Read, "p0"),
        &transfers,
    )
    .await;
    let decode = spawn(
        engine(Role::Decode, TransferFormat::Nixl, MoriIoMode::Read, "d0"),
        &transfers,
    )
    .await;
    let prefill_registry = Arc::new(ServiceRegistry::new(RoleKind::Prefill, ttl));
    let decode_registry = Arc::new(ServiceRegistry::new(RoleKind::Decode, ttl));
    let mut pd = PdConfig::new(PdConnector::Nixl);
    pd.prefill_registry = Some(prefill_registry.clone());
    pd.decode_registry = Some(decode_registry.clone());
    let router = Router::start(router_config(pd, "cache_aware"))
        .await
        .unwrap();
    let fixture = PdFixture::serve(router, vec![prefill], vec![decode]).await;
    let prefill_endpoint = Endpoint::new(&fixture.prefill[0].url(), None).unwrap();
    let decode_endpoint = Endpoint::new(&fixture.decode[0].url(), None).unwrap();
    let register = || {
        let now = Instant::now();
        prefill_registry.register(prefill_endpoint.clone(), Registration::default(), now);
        decode_registry.register(decode_endpoint.clone(), Registration::default(), now);
    };

    // Nothing registered yet: 503, the prefill role named first.
    let (status, _, bytes) = call(
        fixture.addr,
        "POST",
        "/v1/completions",
        &[],
        completion_body("Anyone there?", false),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(String::from_utf8_lossy(&bytes).contains("prefill"));

    register();
    for i in 0..3 {
        let (status, _, bytes) = call(
            fixture.addr,
            "POST",
            "/v1/completions",
            &[],
            completion_body(&format!("Discovered request {i}."), i == 1),
        )
        .await;
        assert_eq!(
            status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&bytes)
        );
    }
    assert_eq!(fixture.decode[0].stats().kv_transfers_valid, 3);
    fixture.assert_loads_return_to_zero().await;
    let old_prefill = fixture.prefill_workers()[0].clone();
    let old_decode = fixture.decode_workers()[0].clone();
    assert_eq!((old_prefill.processed(), old_decode.processed()), (3, 3));

    // Both registrations expire: 503, and the old workers leave their pools.
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    let (status, _, _) = call(
        fixture.addr,
        "POST",
        "/v1/completions",
        &[],
        completion_body("After expiry.", false),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(fixture.prefill_workers().is_empty());
    assert!(fixture.decode_workers().is_empty());
    assert_eq!(
        old_prefill.lifecycle(),
        worker_lifecycle::Lifecycle::Removed
    );

    // Registering again starts new lifetimes: fresh workers, fresh counts.
    register();
    let (status, _, bytes) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        chat_body("Back again.", false),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    fixture.assert_loads_return_to_zero().await;
    let new_prefill = fixture.prefill_workers()[0].clone();
    let new_decode = fixture.decode_workers()[0].clone();
    assert!(!Arc::ptr_eq(&new_prefill, &old_prefill));
    assert_ne!(new_prefill.generation(), old_prefill.generation());
    assert_ne!(new_decode.key(), old_decode.key());
    assert_eq!((new_prefill.processed(), new_decode.processed()), (1, 1));
    assert_eq!((old_prefill.processed(), old_decode.processed()), (3, 3));
    assert_eq!(fixture.decode[0].stats().kv_transfers_valid, 4);
    assert_eq!(invalid_transfers(&fixture.decode[0]), 0);
    fixture.shutdown().await;
}

/// A discovered Mooncake prefill worker learns its engine ids from its
/// bootstrap server in the background, then takes requests.
#[tokio::test]
async fn discovered_mooncake_prefill_is_bootstrapped_in_the_background() {
    let transfers = TransferRegistry::new();
    let prefill = spawn(
        engine(
            Role::Prefill,
            TransferFormat::Mooncake,
            MoriIoMode::Read,
            "mp0",
        ),
        &transfers,
    )
    .await;
    let decode = spawn(
        engine(
            Role::Decode,
            TransferFormat::Mooncake,
            MoriIoMode::Read,
            "md0",
        ),
        &transfers,
    )
    .await;
    let prefill_registry = Arc::new(ServiceRegistry::new(
        RoleKind::Prefill,
        Duration::from_secs(60),
    ));
    let decode_registry = Arc::new(ServiceRegistry::new(
        RoleKind::Decode,
        Duration::from_secs(60),
    ));
    let mut pd = PdConfig::new(PdConnector::Mooncake { concurrent: true });
    pd.prefill_registry = Some(prefill_registry.clone());
    pd.decode_registry = Some(decode_registry.clone());
    pd.bootstrap_retry.initial_backoff = Duration::from_millis(20);
    let router = Router::start(router_config(pd, "round_robin"))
        .await
        .unwrap();
    let now = Instant::now();
    let registration = Registration {
        bootstrap_port: prefill.bootstrap_addr().map(|a| a.port()),
        ..Registration::default()
    };
    prefill_registry.register(
        Endpoint::new(&prefill.url(), None).unwrap(),
        registration,
        now,
    );
    decode_registry.register(
        Endpoint::new(&decode.url(), None).unwrap(),
        Registration::default(),
        now,
    );
    let fixture = PdFixture::serve(router, vec![prefill], vec![decode]).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut refused = 0;
    loop {
        let (status, _, bytes) = call(
            fixture.addr,
            "POST",
            "/v1/completions",
            &[],
            completion_body("Pushed over Mooncake.", false),
        )
        .await;
        if status == StatusCode::OK {
            break;
        }
        // Until the engine ids are known the prefill worker is not eligible.
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(String::from_utf8_lossy(&bytes).contains("prefill"));
        refused += 1;
        assert!(tokio::time::Instant::now() < deadline, "never bootstrapped");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(fixture.pd().prefill().unavailable_count(), refused);
    assert_eq!(fixture.decode[0].stats().kv_transfers_valid, 1);
    assert_eq!(invalid_transfers(&fixture.decode[0]), 0);
    fixture.assert_loads_return_to_zero().await;
    fixture.shutdown().await;
}

/// A decode engine that answers 503: the whole request is retried on a
/// fresh pair without that decode worker, before any byte reached the
/// client, and every transfer the healthy decode engine saw is valid.
#[tokio::test]
async fn failed_decode_is_retried_on_a_fresh_pair() {
    let registry = TransferRegistry::new();
    let prefill = spawn(
        engine(Role::Prefill, TransferFormat::Nixl, MoriIoMode::Read, "p0"),
        &registry,
    )
    .await;
    let mut broken = engine(
        Role::Decode,
        TransferFormat::Nixl,
        MoriIoMode::Read,
        "d-broken",
    );
    broken.faults.fixed_status = Some(503);
    let broken = spawn(broken, &registry).await;
    let healthy = spawn(
        engine(
            Role::Decode,
            TransferFormat::Nixl,
            MoriIoMode::Read,
            "d-healthy",
        ),
        &registry,
    )
    .await;
    let mut pd = PdConfig::new(PdConnector::Nixl);
    pd.prefill = vec![PdWorkerConfig::new(prefill.url())];
    pd.decode = vec![
        PdWorkerConfig::new(broken.url()),
        PdWorkerConfig::new(healthy.url()),
    ];
    let router = Router::start(router_config(pd, "round_robin"))
        .await
        .unwrap();
    let fixture = PdFixture::serve(router, vec![prefill], vec![broken, healthy]).await;
    for i in 0..4 {
        let (status, _, bytes) = call(
            fixture.addr,
            "POST",
            "/v1/chat/completions",
            &[("x-request-id", "same-id-every-time")],
            chat_body(&format!("Decode retry {i}."), i % 2 == 0),
        )
        .await;
        assert_eq!(
            status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&bytes)
        );
    }
    let metrics = fixture.pd().metrics();
    assert_eq!(metrics.outcomes(Phase::Decode, "success"), 4);
    let failed = metrics.outcomes(Phase::Decode, "worker_failure");
    assert!(failed >= 1, "round robin tried the broken decode worker");
    assert_eq!(fixture.router.metrics().retries.get(), failed);
    assert_eq!(fixture.decode[1].stats().kv_transfers_valid, 4);
    assert_eq!(invalid_transfers(&fixture.decode[1]), 0);
    fixture.assert_loads_return_to_zero().await;
    fixture.shutdown().await;
}

/// Mooncake, concurrent legs: a prefill engine that answers 503 aborts its
/// decode leg (the decode engine would wait for KV that never comes); the
/// whole request is retried on a fresh pair without that prefill worker.
#[tokio::test]
async fn concurrent_prefill_failure_retries_the_whole_request() {
    let broken = FaultConfig {
        fixed_status: Some(503),
        ..FaultConfig::default()
    };
    let fixture = start(
        PdConnector::Mooncake { concurrent: true },
        &[broken, FaultConfig::default()],
        EngineConfig::instant(),
        "round_robin",
    )
    .await;
    for i in 0..4 {
        let (status, _, bytes) = call(
            fixture.addr,
            "POST",
            "/v1/completions",
            &[],
            completion_body(&format!("Concurrent legs, request {i}."), i % 2 == 1),
        )
        .await;
        assert_eq!(
            status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&bytes)
        );
    }
    let metrics = fixture.pd().metrics();
    assert_eq!(metrics.outcomes(Phase::Decode, "success"), 4);
    assert_eq!(metrics.outcomes(Phase::Prefill, "success"), 4);
    let failed = metrics.outcomes(Phase::Prefill, "worker_failure");
    assert!(failed >= 1);
    // Each failed prefill took its decode leg down with it, unfinished.
    assert_eq!(metrics.outcomes(Phase::Decode, "cancelled"), failed);
    assert_eq!(fixture.decode[0].stats().kv_transfers_valid, 4);
    fixture.assert_loads_return_to_zero().await;
    fixture.shutdown().await;
}

/// Many requests at once, half of them abandoned by their clients after
/// the first chunk: every load (both roles, concurrent legs) returns to 0.
#[tokio::test]
async fn concurrent_clients_some_leaving_early_leave_no_load() {
    let slow = EngineConfig {
        time_scale: 0.2,
        ..EngineConfig::default()
    };
    let fixture = start(
        PdConnector::MoriIo(PdMoriIoMode::Write),
        &[FaultConfig::default(), FaultConfig::default()],
        slow,
        "least_loaded",
    )
    .await;
    let mut tasks = Vec::new();
    for i in 0..16 {
        let addr = fixture.addr;
        tasks.push(tokio::spawn(async move {
            let mut connection = Connection::open(addr).await;
            let body = serde_json::json!({
                "model": "sim-model",
                "prompt": format!("Client {i} asks for a long answer."),
                "max_tokens": 24,
                "stream": true,
            })
            .to_string();
            let response = connection.send("POST", "/v1/completions", &[], body).await;
            assert_eq!(response.status(), StatusCode::OK);
            let mut body = response.into_body();
            if i % 2 == 0 {
                // Leave after the first chunk: the connection goes with it.
                assert!(body.frame().await.is_some());
                return false;
            }
            let mut text = String::new();
            while let Some(frame) = body.frame().await {
                if let Some(data) = frame.unwrap().data_ref() {
                    text.push_str(&String::from_utf8_lossy(data));
                }
            }
            text.trim_end().ends_with("data: [DONE]")
        }));
    }
    let mut completed = 0;
    for task in tasks {
        completed += usize::from(task.await.unwrap());
    }
    assert_eq!(completed, 8);
    fixture.assert_loads_return_to_zero().await;
    let metrics = fixture.pd().metrics();
    // A client that left may still have been sent the whole stream first.
    assert!(metrics.outcomes(Phase::Decode, "success") >= 8);
    assert_eq!(
        metrics.outcomes(Phase::Decode, "success") + metrics.outcomes(Phase::Decode, "cancelled"),
        16
    );
    assert_eq!(invalid_transfers(&fixture.decode[0]), 0);
    fixture.shutdown().await;
}

/// When every decode attempt fails, the client gets the decode engine's
/// own error (status and body), not a "no worker left" from the retry.
#[tokio::test]
async fn a_decode_error_reaches_the_client_when_retries_run_out() {
    let failing = EngineConfig {
        faults: FaultConfig {
            fixed_status: Some(503),
            ..FaultConfig::default()
        },
        ..EngineConfig::instant()
    };
    let fixture = start(
        PdConnector::Nixl,
        &[FaultConfig::default()],
        failing,
        "round_robin",
    )
    .await;
    let (status, _, bytes) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[("x-request-id", "fails-1")],
        chat_body("Decode is down.", false),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let text = String::from_utf8_lossy(&bytes);
    assert!(!text.contains("no_available_worker"), "{text}");
    assert_eq!(
        fixture
            .pd()
            .metrics()
            .outcomes(Phase::Decode, "worker_failure"),
        1,
        "the only decode worker is not retried for the same request"
    );
    fixture.assert_loads_return_to_zero().await;
    fixture.shutdown().await;
}

/// Startup refuses what cannot work, with errors that say why: a Mooncake
/// prefill whose bootstrap server never answers, a MoRI-IO worker without
/// its ports, a role given both static URLs and a registry.
#[tokio::test]
async fn startup_errors_name_the_problem() {
    let dead_port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let mut pd = PdConfig::new(PdConnector::Mooncake { concurrent: true });
    pd.prefill = vec![PdWorkerConfig::new("http://127.0.0.1:8000").with_bootstrap_port(dead_port)];
    pd.bootstrap_retry.max_attempts = 2;
    pd.bootstrap_retry.initial_backoff = Duration::from_millis(1);
    let err = Router::start(router_config(pd, "round_robin"))
        .await
        .unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains(&format!("127.0.0.1:{dead_port}/query")) && message.contains("2 attempt"),
        "{message}"
    );

    let mut pd = PdConfig::new(PdConnector::MoriIo(PdMoriIoMode::Read));
    pd.decode = vec![PdWorkerConfig::new("http://127.0.0.1:8001")];
    let message = Router::new(router_config(pd, "round_robin"))
        .unwrap_err()
        .to_string();
    assert!(message.contains("handshake and notify ports"), "{message}");

    let mut pd = PdConfig::new(PdConnector::Nixl);
    pd.decode = vec![PdWorkerConfig::new("http://127.0.0.1:8001")];
    pd.decode_registry = Some(Arc::new(ServiceRegistry::new(
        RoleKind::Decode,
        Duration::from_secs(5),
    )));
    let message = Router::new(router_config(pd, "round_robin"))
        .unwrap_err()
        .to_string();
    assert!(message.contains("not both"), "{message}");

    let mut pd = PdConfig::new(PdConnector::Nixl);
    pd.prefill_registry = Some(Arc::new(ServiceRegistry::new(
        RoleKind::Decode,
        Duration::from_secs(5),
    )));
    let message = Router::new(router_config(pd, "round_robin"))
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("registry given is for the decode role"),
        "{message}"
    );
}

/// A burst of streamed NIXL requests whose prefills are slow, with a
/// least-loaded decode policy: the decode worker is chosen when each
/// prefill completes, seeing the decode legs already dispatched, so the
/// burst spreads over both decode engines. (Chosen at arrival, every
/// request of the burst would see both decode loads at 0 and the same tie
/// break, the engine that served the warm-up request having processed
/// more, and all would land on the other engine.)
#[tokio::test]
async fn late_decode_choice_spreads_a_burst_of_slow_prefills_over_both_decode_engines() {
    let registry = TransferRegistry::new();
    let mut prefill_config = engine(
        Role::Prefill,
        TransferFormat::Nixl,
        MoriIoMode::Read,
        "prefill-0",
    );
    prefill_config.faults.stall_before_headers = Some(Duration::from_millis(300));
    let prefill = vec![spawn(prefill_config, &registry).await];
    let mut decode = Vec::new();
    for i in 0..2 {
        let mut config = engine(
            Role::Decode,
            TransferFormat::Nixl,
            MoriIoMode::Read,
            &format!("decode-{i}"),
        );
        // Every decode leg stays in flight well past the last prefill.
        config.faults.stall_after_headers = Some(Duration::from_secs(1));
        decode.push(spawn(config, &registry).await);
    }
    let mut pd = PdConfig::new(PdConnector::Nixl);
    pd.prefill = prefill
        .iter()
        .map(|h| worker_config(h, PdConnector::Nixl))
        .collect();
    pd.decode = decode
        .iter()
        .map(|h| worker_config(h, PdConnector::Nixl))
        .collect();
    pd.decode_policy = Some(lb_policies::PolicyConfig::named("least_loaded"));
    let router = Router::start(router_config(pd, "round_robin"))
        .await
        .unwrap();
    let fixture = PdFixture::serve(router, prefill, decode).await;
    assert!(fixture.pd().late_decode());

    let request = |i: usize| {
        let addr = fixture.addr;
        async move {
            let (status, _, bytes) = call(
                addr,
                "POST",
                "/v1/completions",
                &[("content-type", "application/json")],
                completion_body(&format!("Burst request {i} wants a story."), true),
            )
            .await;
            let text = String::from_utf8_lossy(&bytes).into_owned();
            assert_eq!(status, StatusCode::OK, "{text}");
            assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        }
    };
    // One request alone first: its decode engine has processed one more.
    request(0).await;
    let served = |fixture: &PdFixture| -> Vec<u64> {
        fixture
            .decode
            .iter()
            .map(|h| h.stats().kv_transfers_valid)
            .collect()
    };
    let before = served(&fixture);
    assert_eq!(before.iter().sum::<u64>(), 1);

    const BURST: usize = 6;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 1..=BURST {
        tasks.spawn(request(i));
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let after = served(&fixture);
    let burst: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(burst.iter().sum::<u64>(), BURST as u64, "{burst:?}");
    assert!(
        burst.iter().all(|&n| n >= 2),
        "the burst's decode legs did not spread over both engines: {burst:?}"
    );
    for handle in &fixture.decode {
        assert_eq!(invalid_transfers(handle), 0);
    }
    assert_eq!(fixture.pd().decode().unavailable_count(), 0);
    fixture.assert_loads_return_to_zero().await;
    fixture.shutdown().await;
}

/// The decode pool empties while a NIXL prefill runs: the late decode
/// choice finds nobody, the client gets a 503 naming the decode role, and
/// the prefill's load was released normally.
#[tokio::test]
async fn decode_pool_emptied_during_the_prefill_is_a_503_naming_decode() {
    let registry = TransferRegistry::new();
    let mut prefill_config = engine(
        Role::Prefill,
        TransferFormat::Nixl,
        MoriIoMode::Read,
        "prefill-0",
    );
    prefill_config.faults.stall_before_headers = Some(Duration::from_millis(300));
    let prefill = vec![spawn(prefill_config, &registry).await];
    let decode = vec![
        spawn(
            engine(
                Role::Decode,
                TransferFormat::Nixl,
                MoriIoMode::Read,
                "decode-0",
            ),
            &registry,
        )
        .await,
    ];
    let mut pd = PdConfig::new(PdConnector::Nixl);
    pd.prefill = vec![worker_config(&prefill[0], PdConnector::Nixl)];
    pd.decode = vec![worker_config(&decode[0], PdConnector::Nixl)];
    let router = Router::start(router_config(pd, "round_robin"))
        .await
        .unwrap();
    let fixture = PdFixture::serve(router, prefill, decode).await;
    let addr = fixture.addr;
    let request = tokio::spawn(async move {
        call(
            addr,
            "POST",
            "/v1/completions",
            &[("content-type", "application/json")],
            completion_body("Nobody will decode this.", false),
        )
        .await
    });
    // Wait (bounded) until the prefill is in flight, then drain the decode.
    let deadline = Instant::now() + Duration::from_secs(5);
    while fixture.prefill_workers()[0].load() == 0 {
        assert!(Instant::now() < deadline, "the prefill never started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let decode_endpoint = Endpoint::new(&fixture.decode[0].url(), None).unwrap();
    let decode_role = fixture.pd().decode();
    let decode_worker = decode_role
        .workers()
        .iter()
        .find(|w| *w.endpoint() == decode_endpoint)
        .cloned()
        .unwrap();
    let drained = decode_role
        .pool()
        .drain_and_remove(&decode_worker, tokio::time::Instant::now())
        .await
        .unwrap();
    assert!(drained, "no decode load while the prefill runs");
    let (status, _, bytes) = request.await.unwrap();
    let text = String::from_utf8_lossy(&bytes);
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    let error = json(&bytes);
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("decode"), "{message}");
    assert_eq!(error["error"]["code"], "no_available_worker");
    assert_eq!(
        fixture.pd().metrics().outcomes(Phase::Prefill, "success"),
        1
    );
    assert_eq!(fixture.pd().metrics().outcomes(Phase::Decode, "success"), 0);
    assert_eq!(fixture.pd().decode().unavailable_count(), 1);
    fixture.assert_loads_return_to_zero().await;
    fixture.shutdown().await;
}
