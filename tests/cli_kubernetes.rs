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
use worker_lifecycle::RoleKind;

fn settings(args: &[&str]) -> Result<Settings, affinity_router::cli::CliError> {
    Settings::from_args(std::iter::once("router").chain(args.iter().copied()))
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

    let mut settings = settings(&[
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--service-discovery",
        "--selector",
        "app=vllm",
        "--service-discovery-namespace",
        "inference",
        "--service-discovery-port",
        &engine_port,
    ])
    .unwrap();
    if let Mode::Kubernetes(k8s) = &mut settings.mode {
        k8s.api_server = Some(format!("http://{api_addr}"));
    }
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
    app.stop().await;
    let _ = engine.shutdown().await;
}

#[tokio::test]
async fn a_403_at_startup_stops_with_the_rbac_rule() {
    let (api, api_addr) = FakeApi::start().await;
    api.set_forbidden(true);
    let mut settings = settings(&[
        "--port",
        "0",
        "--prometheus-port",
        "0",
        "--service-discovery",
        "--selector",
        "app=vllm",
    ])
    .unwrap();
    if let Mode::Kubernetes(k8s) = &mut settings.mode {
        k8s.api_server = Some(format!("http://{api_addr}"));
    }
    let err = App::start(&settings).await.unwrap_err().to_string();
    assert!(err.starts_with("--service-discovery: "), "{err}");
    assert!(err.contains("get, list and watch on pods"), "{err}");
    assert!(
        err.contains("ClusterRole"),
        "all namespaces need a ClusterRole: {err}"
    );
}
