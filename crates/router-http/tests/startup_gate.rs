//! The startup gate seen over HTTP: while a host awaits its configured
//! workers, `/health` and `/readiness` answer 503 naming them and
//! `/liveness` answers 200; the gate opens when the last one is ready or
//! the startup wait ends; shutdown still wins.

mod common;

use common::{call, chat_body, json};
use engine_sim::{EngineConfig, EngineHandle, ServeOptions};
use http::StatusCode;
use router_http::{Router, RouterConfig};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::oneshot;

/// Every test here finishes well within this.
const BOUND: Duration = Duration::from_secs(30);

/// A router served on a free loopback port; the gate is set before it binds.
struct Served {
    router: Router,
    addr: SocketAddr,
    _stop: oneshot::Sender<()>,
}

async fn serve(router: Router) -> Served {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let serving = router.clone();
    tokio::spawn(async move {
        serving
            .serve(listener, async {
                let _ = stopped.await;
            })
            .await
    });
    Served {
        router,
        addr,
        _stop: stop,
    }
}

async fn engine() -> EngineHandle {
    engine_sim::spawn(EngineConfig::instant(), ServeOptions::default())
        .await
        .unwrap()
}

async fn get(addr: SocketAddr, path: &str) -> (StatusCode, serde_json::Value) {
    let (status, _, body) = call(addr, "GET", path, &[], "").await;
    (status, json(&body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_readiness_name_the_awaited_workers_while_liveness_answers() {
    tokio::time::timeout(BOUND, async {
        let (a, b) = (engine().await, engine().await);
        let router = Router::new(RouterConfig::default()).unwrap();
        router
            .startup_gate()
            .await_workers([a.url(), b.url()], Duration::from_secs(600));
        let served = serve(router).await;
        let addr = served.addr;

        let (status, headers, body) = call(addr, "GET", "/health", &[], "").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(headers["retry-after"], "1");
        let body = json(&body);
        assert_eq!(body["error"]["code"], "awaiting_workers");
        let mut both = vec![a.url(), b.url()];
        both.sort();
        assert_eq!(body["error"]["awaited_workers"], serde_json::json!(both));
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&a.url()) && message.contains(&b.url()),
            "{message}"
        );

        let (status, body) = get(addr, "/readiness").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["ready"], false);
        assert_eq!(body["awaited_workers"], serde_json::json!(both));
        assert_eq!(get(addr, "/liveness").await.0, StatusCode::OK);

        // One worker added and ready: only the other is named.
        served.router.add_worker(&a.url(), None, None).unwrap();
        assert!(served.router.startup_gate().worker_ready(&a.url()));
        let (status, body) = get(addr, "/health").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            body["error"]["awaited_workers"],
            serde_json::json!([b.url()])
        );
        // A worker routable already does not make the router ready early.
        assert_eq!(
            get(addr, "/readiness").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );

        served.router.add_worker(&b.url(), None, None).unwrap();
        assert!(served.router.startup_gate().worker_ready(&b.url()));
        let (status, body) = get(addr, "/health").await;
        assert_eq!((status, &body["status"]), (StatusCode::OK, &"ok".into()));
        let (status, body) = get(addr, "/readiness").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["awaited_workers"], serde_json::json!([]));
        let (status, _, text) = call(
            addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            chat_body("hello", false),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{text:?}");
        a.shutdown().await;
        b.shutdown().await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_end_of_the_startup_wait_opens_the_gate() {
    tokio::time::timeout(BOUND, async {
        let never = "http://127.0.0.1:9";
        let router = Router::new(RouterConfig::default()).unwrap();
        router
            .startup_gate()
            .await_workers([never], Duration::from_millis(200));
        let served = serve(router).await;
        let (status, body) = get(served.addr, "/health").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["error"]["awaited_workers"], serde_json::json!([never]));
        // Polled until the wait ends (bounded by BOUND, not by a guess).
        while get(served.addr, "/health").await.0 != StatusCode::OK {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Then the usual rules: healthy with no worker, not ready.
        let (status, body) = get(served.addr, "/readiness").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["awaited_workers"], serde_json::json!([]));
        assert_eq!(body["workers"], 0);
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_declared_worker_means_healthy_at_once_and_shutdown_wins_over_the_gate() {
    tokio::time::timeout(BOUND, async {
        let open = serve(Router::new(RouterConfig::default()).unwrap()).await;
        assert_eq!(get(open.addr, "/health").await.0, StatusCode::OK);

        let router = Router::new(RouterConfig::default()).unwrap();
        router
            .startup_gate()
            .await_workers(["http://127.0.0.1:9"], Duration::from_secs(600));
        let served = serve(router).await;
        served.router.begin_shutdown();
        let (status, body) = get(served.addr, "/health").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["error"]["code"], "shutting_down");
        assert_eq!(get(served.addr, "/liveness").await.0, StatusCode::OK);
    })
    .await
    .expect("bounded");
}
