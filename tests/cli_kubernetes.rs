//! `--service-discovery`: the flags, and the reference router serving the
//! pods of a fake Kubernetes API server (worker-discovery's test fake,
//! included by path) that point at a simulated engine.

#[path = "../crates/worker-discovery/tests/support/fake_kube.rs"]
mod fake_kube;

use affinity_router::cli::kubernetes::KubernetesSettings;
use affinity_router::cli::{App, Mode, Settings};
use bytes::Bytes;
use fake_kube::FakeApi;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use std::time::Duration;
use worker_lifecycle::{RoleKind, WorkerRole};

fn settings(args: &[&str]) -> Result<Settings, affinity_router::cli::CliError> {
    Settings::from_args(std::iter::once("router").chain(args.iter().copied()))
}

/// Settings for `args` (after `--port 0 --prometheus-port 0
/// --service-discovery`) talking to the fake API server at `api`.
fn against(api: std::net::SocketAddr, args: &[&str]) -> Settings {
    let argv = [
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--service-discovery",
    ];
    let argv: Vec<&str> = argv.iter().chain(args).copied().collect();
    let mut settings = settings(&argv).unwrap();
    if let Mode::Kubernetes(k8s) = &mut settings.mode {
        k8s.api_server = Some(format!("http://{api}"));
    }
    settings
}

fn kubernetes(settings: &Settings) -> &KubernetesSettings {
    match &settings.mode {
        Mode::Kubernetes(k8s) => k8s,
        other => panic!("not Kubernetes mode: {other:?}"),
    }
}

#[test]
fn regular_and_prefill_decode_flags() {
    let s = settings(&[
        "--service-discovery",
        "--selector",
        "app=vllm",
        "tier=gpu",
        "--service-discovery-port",
        "8000",
        "--service-discovery-namespace",
        "inference",
    ])
    .unwrap();
    let k8s = kubernetes(&s);
    let config = &k8s.discovery;
    assert_eq!(
        config.regular.as_ref().unwrap().to_string(),
        "app=vllm,tier=gpu"
    );
    assert_eq!(
        (config.port, config.namespace.as_deref()),
        (8000, Some("inference"))
    );
    assert!(k8s.pd.is_none());
    assert!(
        s.ignored.is_empty(),
        "the selector flags take effect: {:?}",
        s.ignored
    );

    let s = settings(&[
        "--service-discovery",
        "--vllm-pd-disaggregation",
        "--prefill-selector",
        "role=prefill",
        "--decode-selector",
        "role=decode",
        "--prefill-policy",
        "round_robin",
    ])
    .unwrap();
    let k8s = kubernetes(&s);
    assert_eq!(k8s.discovery.port, 80, "vllm-router's default port");
    assert_eq!(k8s.discovery.namespace, None, "all namespaces");
    assert!(k8s.discovery.regular.is_none());
    let pd = k8s.pd.as_ref().unwrap();
    assert_eq!(pd.prefill_policy.as_str(), "round_robin");
    assert!(
        s.summary()
            .contains("prefill role=prefill; decode role=decode")
    );
}

/// The discovery flags under their config-file keys (either spelling), and
/// the command line winning over the file.
#[test]
fn kubernetes_settings_from_a_config_file() {
    let path =
        std::env::temp_dir().join(format!("affinity-router-k8s-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "service-discovery = true\n\
         vllm_pd_disaggregation = true\n\
         prefill-selector = [\"app=vllm\", \"role=prefill\"]\n\
         decode_selector = [\"app=vllm\", \"role=decode\"]\n\
         service-discovery-port = 8000\n\
         service_discovery_namespace = \"inference\"\n\
         kv_connector = \"mooncake\"\n",
    )
    .unwrap();
    let config = path.to_str().unwrap();
    let from_file = settings(&["--config", config]);
    let overridden = settings(&["--config", config, "--service-discovery-port", "9000"]);
    std::fs::remove_file(&path).unwrap();

    let from_file = from_file.unwrap();
    let k8s = kubernetes(&from_file);
    assert_eq!(k8s.discovery.port, 8000);
    assert_eq!(k8s.discovery.namespace.as_deref(), Some("inference"));
    assert_eq!(
        k8s.discovery.prefill.as_ref().unwrap().to_string(),
        "app=vllm,role=prefill"
    );
    assert_eq!(
        k8s.discovery.decode.as_ref().unwrap().to_string(),
        "app=vllm,role=decode"
    );
    assert!(k8s.discovery.regular.is_none());
    let pd = k8s.pd.as_ref().expect("P/D from the file");
    assert_eq!(pd.kv_connector.as_str(), "mooncake");
    assert!(from_file.ignored.is_empty(), "{:?}", from_file.ignored);
    assert_eq!(kubernetes(&overridden.unwrap()).discovery.port, 9000);
}

#[test]
fn bad_kubernetes_command_lines_name_the_flag() {
    let cases: &[(&[&str], &str, &str)] = &[
        (
            &["--service-discovery"],
            "--service-discovery",
            "needs --selector",
        ),
        (
            &["--service-discovery", "--selector", "app"],
            "--selector",
            "KEY=VALUE",
        ),
        (
            &["--service-discovery", "--selector", "app=a b"],
            "--selector",
            "may hold only",
        ),
        (
            &[
                "--service-discovery",
                "--selector",
                "a=1",
                "--worker-urls",
                "http://a:1",
            ],
            "--service-discovery",
            "--worker-urls",
        ),
        (
            &[
                "--service-discovery",
                "--selector",
                "a=1",
                "--prefill-selector",
                "r=p",
            ],
            "--prefill-selector",
            "--vllm-pd-disaggregation",
        ),
        (
            &[
                "--service-discovery",
                "--vllm-pd-disaggregation",
                "--prefill-selector",
                "r=p",
            ],
            "--decode-selector",
            "required",
        ),
        (
            &[
                "--service-discovery",
                "--vllm-pd-disaggregation",
                "--selector",
                "a=1",
                "--prefill-selector",
                "r=p",
                "--decode-selector",
                "r=d",
            ],
            "--selector",
            "--prefill-selector",
        ),
        (
            &[
                "--service-discovery",
                "--selector",
                "a=1",
                "--service-discovery-namespace",
                "Bad_NS",
            ],
            "--service-discovery-namespace",
            "not a namespace",
        ),
        (
            &[
                "--service-discovery",
                "--selector",
                "a=1",
                "--service-discovery-port",
                "0",
            ],
            "--service-discovery-port",
            "1-65535",
        ),
        (
            &[
                "--service-discovery",
                "--selector",
                "a=1",
                "--intra-node-data-parallel-size",
                "2",
            ],
            "--intra-node-data-parallel-size",
            "one worker",
        ),
    ];
    for (argv, flag, words) in cases {
        let err = settings(argv).expect_err(&format!("{argv:?} should be refused"));
        assert_eq!(err.exit_code(), 2, "{argv:?}: {err}");
        let message = err.to_string();
        assert!(message.starts_with(flag), "{argv:?}: {message}");
        assert!(message.contains(words), "{argv:?}: {message}");
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn send(client: &HttpClient, method: &str, url: String, body: &str) -> (StatusCode, String) {
    let request = Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
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

fn pod(uid: &str, port_host: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "vllm-0", "namespace": "inference", "uid": uid,
                     "labels": {"app": "vllm"}},
        "status": {"phase": "Running", "podIP": port_host,
                   "conditions": [{"type": "Ready", "status": "True"}]}
    })
}

const CHAT: &str = r#"{"model": "sim-model", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4}"#;

/// Polls until `status` is what a chat completion answers; bounded.
async fn until_chat(client: &HttpClient, url: &str, status: StatusCode) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (got, body) = send(client, "POST", format!("{url}/v1/chat/completions"), CHAT).await;
        if got == status {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still {got}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn the_router_serves_the_ready_pods_of_its_selector() {
    let engine = engine_sim::spawn(
        engine_sim::EngineConfig {
            time_scale: 0.0,
            ..engine_sim::EngineConfig::default()
        },
        engine_sim::ServeOptions::default(),
    )
    .await
    .unwrap();
    let engine_port = engine.addr().port().to_string();
    let (api, api_addr) = FakeApi::start().await;
    api.create(pod("uid-1", "127.0.0.1"));

    let settings = against(
        api_addr,
        &[
            "--selector",
            "app=vllm",
            "--service-discovery-namespace",
            "inference",
            "--service-discovery-port",
            &engine_port,
        ],
    );
    let app = App::start(&settings).await.unwrap();
    assert!(
        app.kubernetes().unwrap().is_synced(),
        "start waits for the first list"
    );
    assert!(
        app.banner()
            .contains("Kubernetes pods in namespace inference"),
        "{}",
        app.banner()
    );
    let url = format!("http://{}", app.addr());
    let client = Client::builder(TokioExecutor::new()).build_http();

    until_chat(&client, &url, StatusCode::OK).await;
    let workers = app.router().all_workers();
    assert_eq!(workers.len(), 1);
    assert_eq!(workers[0].role().kind(), RoleKind::Regular);
    assert_eq!(workers[0].labels()["pod"], "vllm-0");
    let first = workers[0].generation();
    let (status, body) = send(&client, "GET", format!("{url}/workers"), "").await;
    assert_eq!(status, StatusCode::OK);
    let listed: Value = serde_json::from_str(&body).unwrap();
    let labels = &listed[0]["labels"];
    assert_eq!(
        (&labels["source"], &labels["pod"], &labels["namespace"]),
        (&json!("kubernetes"), &json!("vllm-0"), &json!("inference")),
        "{listed}"
    );

    // NotReady: the pod leaves, and with no other worker the router
    // answers 503.
    api.modify("uid-1", |pod| {
        pod["status"]["conditions"] = json!([{"type": "Ready", "status": "False"}]);
    });
    until_chat(&client, &url, StatusCode::SERVICE_UNAVAILABLE).await;

    // Re-created under the same name and IP: a new generation serves.
    api.delete("uid-1");
    api.create(pod("uid-2", "127.0.0.1"));
    until_chat(&client, &url, StatusCode::OK).await;
    let workers = app.router().all_workers();
    assert_eq!(workers.len(), 1);
    assert!(workers[0].generation() > first);
    assert_eq!(
        workers[0].load(),
        0,
        "every request finished and was released"
    );
    let metrics = app.kubernetes().unwrap().metrics();
    assert_eq!((metrics.registrations, metrics.deregistrations), (2, 1));
    // The same counters on the router's /metrics.
    let (status, scrape) = send(&client, "GET", format!("{url}/metrics"), "").await;
    assert_eq!(status, StatusCode::OK);
    for line in [
        "router_discovery_registrations_total 2",
        "router_discovery_deregistrations_total 1",
        "router_discovery_workers{role=\"regular\"} 1",
        "router_discovery_watch_errors_total 0",
    ] {
        assert!(scrape.lines().any(|l| l == line), "{line}:\n{scrape}");
    }
    let relists = scrape
        .lines()
        .find_map(|l| l.strip_prefix("router_discovery_relists_total "))
        .and_then(|v| v.parse::<u64>().ok());
    assert!(relists.is_some_and(|n| n >= 1), "{scrape}");
    app.stop().await;
    let _ = engine.shutdown().await;
}

#[tokio::test]
async fn a_403_at_startup_stops_with_the_rbac_rule() {
    let (api, api_addr) = FakeApi::start().await;
    api.set_forbidden(true);
    let settings = against(api_addr, &["--selector", "app=vllm"]);
    let err = App::start(&settings).await.unwrap_err().to_string();
    assert!(err.starts_with("--service-discovery: "), "{err}");
    assert!(err.contains("get, list and watch on pods"), "{err}");
    assert!(
        err.contains("ClusterRole"),
        "all namespaces need a ClusterRole: {err}"
    );
}

/// One loopback port in front of a prefill and a decode engine, sending
/// each request to the engine its `kv_transfer_params` name: a pod is
/// reached at `podIP:--service-discovery-port`, so two pods on 127.0.0.1
/// share one port, and this stands in for the two pods' network
/// namespaces.
async fn pod_network(prefill: String, decode: String) -> std::net::SocketAddr {
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (client, prefill, decode) = (client.clone(), prefill.clone(), decode.clone());
            let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                let (client, prefill, decode) = (client.clone(), prefill.clone(), decode.clone());
                async move {
                    let (mut parts, body) = request.into_parts();
                    let body = body.collect().await?.to_bytes();
                    let params = serde_json::from_slice::<Value>(&body)
                        .ok()
                        .map(|json| json["kv_transfer_params"].clone())
                        .unwrap_or(Value::Null);
                    let engine = if params["do_remote_decode"] == json!(true) {
                        prefill
                    } else {
                        decode
                    };
                    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                    parts.uri = format!("{engine}{path}").parse().unwrap();
                    let response = client
                        .request(Request::from_parts(parts, Full::new(body)))
                        .await
                        .expect("the engine answers");
                    let (parts, body) = response.into_parts();
                    let body = body.collect().await?.to_bytes();
                    Ok::<_, hyper::Error>(http::Response::from_parts(parts, Full::new(body)))
                }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

fn role_pod(name: &str, uid: &str, role: &str, bootstrap: Option<u16>) -> Value {
    let mut pod = pod(uid, "127.0.0.1");
    pod["metadata"]["name"] = json!(name);
    pod["metadata"]["labels"]["role"] = json!(role);
    if let Some(port) = bootstrap {
        pod["metadata"]["annotations"] = json!({"vllm.ai/bootstrap-port": port.to_string()});
    }
    pod
}

/// `--vllm-pd-disaggregation` with Kubernetes discovery, end to end: the
/// prefill pod's Mooncake bootstrap port comes from its annotation, the
/// router learns the engine id from it, and the decode engine accepts the
/// transfer only from the prefill engine that really produced it.
#[tokio::test]
async fn prefill_and_decode_pods_serve_through_the_mooncake_bootstrap() {
    use engine_sim::{EngineConfig, Role, ServeOptions, TransferFormat, TransferRegistry};
    let transfers = TransferRegistry::new();
    let engine = |role: Role| EngineConfig {
        role,
        kv_connector: TransferFormat::Mooncake,
        time_scale: 0.0,
        ..EngineConfig::default()
    };
    let prefill = engine_sim::spawn(
        engine(Role::Prefill),
        ServeOptions {
            registry: Some(std::sync::Arc::clone(&transfers)),
            bootstrap_addr: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
            ..ServeOptions::default()
        },
    )
    .await
    .unwrap();
    let decode = engine_sim::spawn(
        engine(Role::Decode),
        ServeOptions {
            registry: Some(std::sync::Arc::clone(&transfers)),
            ..ServeOptions::default()
        },
    )
    .await
    .unwrap();
    let bootstrap_port = prefill.bootstrap_addr().unwrap().port();
    let network = pod_network(prefill.url(), decode.url()).await;

    let (api, api_addr) = FakeApi::start().await;
    api.create(role_pod(
        "prefill-0",
        "uid-p",
        "prefill",
        Some(bootstrap_port),
    ));
    api.create(role_pod("decode-0", "uid-d", "decode", None));
    let port = network.port().to_string();
    let settings = against(
        api_addr,
        &[
            "--vllm-pd-disaggregation",
            "--prefill-selector",
            "app=vllm",
            "role=prefill",
            "--decode-selector",
            "app=vllm",
            "role=decode",
            "--kv-connector",
            "mooncake",
            "--service-discovery-port",
            &port,
        ],
    );
    let app = App::start(&settings).await.unwrap();
    let url = format!("http://{}", app.addr());
    let client = Client::builder(TokioExecutor::new()).build_http();
    until_chat(&client, &url, StatusCode::OK).await;

    let workers = app.router().all_workers();
    let role_of = |name: &str| {
        workers
            .iter()
            .find(|w| w.labels().get("pod").map(String::as_str) == Some(name))
            .map(|w| w.role())
    };
    assert_eq!(
        role_of("prefill-0"),
        Some(WorkerRole::Prefill {
            bootstrap_port: Some(bootstrap_port)
        })
    );
    assert_eq!(role_of("decode-0"), Some(WorkerRole::Decode));

    // Several requests at once: every one crosses both engines, and the
    // transfers the decode engine accepted are the ones prefill produced.
    let requests =
        (0..8).map(|_| send(&client, "POST", format!("{url}/v1/chat/completions"), CHAT));
    for (status, body) in futures_util::future::join_all(requests).await {
        assert_eq!(status, StatusCode::OK, "{body}");
        let json: Value = serde_json::from_str(&body).unwrap();
        assert!(
            json["choices"][0]["message"]["content"].is_string(),
            "{json}"
        );
    }
    let produced = prefill.stats().kv_transfers_produced;
    let decode_stats = decode.stats();
    assert!(produced >= 9, "{produced}");
    assert_eq!(
        decode_stats.kv_transfers_invalid_total(),
        0,
        "{decode_stats:?}"
    );
    assert_eq!(
        decode_stats.kv_transfers_valid, produced,
        "{decode_stats:?}"
    );
    for worker in app.router().all_workers() {
        assert_eq!(
            worker.load(),
            0,
            "{} released every guard",
            worker.endpoint()
        );
    }

    // The prefill pod turns NotReady: no prefill worker, a clear 503.
    api.modify("uid-p", |pod| {
        pod["status"]["conditions"] = json!([{"type": "Ready", "status": "False"}]);
    });
    until_chat(&client, &url, StatusCode::SERVICE_UNAVAILABLE).await;
    app.stop().await;
    let _ = prefill.shutdown().await;
    let _ = decode.shutdown().await;
}
