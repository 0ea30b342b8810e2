//! Issue 32 end to end: `POST /register` through the reference router's
//! wiring (router-http's route and admin check, the discovery register
//! hook, `--worker-networks` as the address check) refuses a KV event
//! endpoint outside the networks, and the router's KV event hub never
//! dials it, while it does dial an allowed one; a poisoned `zmq_address`
//! and the probe's other hostile values are 400 with a JSON body naming
//! the field.
#![cfg(feature = "cli")]

use affinity_router::cli::discovery::{self, NetworkCheck, Registrar, Registries};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use pd_orchestrator::pools::PdConfig;
use router_http::{Router, RouterConfig};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Engines on 127.0.0.2 only: 127.0.0.1 is "outside".
fn registrar() -> Registrar {
    let networks = vec!["127.0.0.2/32".parse().unwrap()];
    let check = NetworkCheck::new(networks, Duration::from_secs(2)).expect("networks are set");
    Registrar::new(Registries::new(Duration::from_secs(60)))
        .with_check(Arc::new(check), Duration::from_secs(2))
        .checking_peer_addresses(true)
}

/// A P/D router fed by `registrar`'s registries, routing `kv_aware` (so it
/// follows the engines' KV events), with `/register` behind an admin key.
fn router(registrar: &Registrar) -> Router {
    let mut pd = PdConfig::new(pd_orchestrator::PdConnector::Nixl);
    pd.prefill_registry = Some(Arc::clone(&registrar.registries().prefill));
    pd.decode_registry = Some(Arc::clone(&registrar.registries().decode));
    let config = RouterConfig {
        policy: lb_policies::PolicyConfig::named("kv_aware"),
        pd: Some(pd),
        admin_api_key: Some("admin".into()),
        register_hook: Some(discovery::register_hook(registrar.clone())),
        ..RouterConfig::default()
    };
    Router::new(config).unwrap()
}

async fn register(router: &Router, body: &serde_json::Value) -> (StatusCode, serde_json::Value) {
    let request = Request::post("/register")
        .header("authorization", "Bearer admin")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let response = router.handle(request).await;
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_endpoint_outside_the_networks_is_refused_and_never_dialled() {
    let outside = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let inside = TcpListener::bind("127.0.0.2:0").await.unwrap();
    let registrar = registrar();
    let router = router(&registrar);
    let _background = router.spawn_background();

    let (status, body) = register(
        &router,
        &serde_json::json!({
            "type": "D", "http_address": "127.0.0.2:8200",
            "kv_events_endpoint": format!("tcp://{}", outside.local_addr().unwrap()),
        }),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("kv_events_endpoint"), "{message}");
    assert!(registrar.registries().decode.is_empty(), "nothing changed");

    // The control: an allowed endpoint is dialled, so the hub is running
    // and would have dialled the refused one by now.
    let (status, body) = register(
        &router,
        &serde_json::json!({
            "type": "D", "http_address": "127.0.0.2:8201",
            "kv_events_endpoint": format!("tcp://{}", inside.local_addr().unwrap()),
        }),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    tokio::time::timeout(Duration::from_secs(20), inside.accept())
        .await
        .expect("the allowed KV endpoint is dialled")
        .unwrap();
    // A few more sync rounds (200 ms each): still no connection outside.
    let dialled = tokio::time::timeout(Duration::from_secs(1), outside.accept()).await;
    assert!(dialled.is_err(), "the refused KV endpoint was dialled");
}

#[tokio::test]
async fn hostile_registrations_are_400_naming_the_field() {
    let registrar = registrar();
    let router = router(&registrar);
    let long = format!("{}:1", "a".repeat(60 * 1024));
    let cases: [(&str, serde_json::Value); 6] = [
        ("zmq_address", "127.0.0.2:21001\r\nx-evil: 1".into()),
        ("zmq_address", long.into()),
        ("http_address", "127.0.0.2:0".into()),
        ("dp_size", 4_294_967_295_u64.into()),
        ("tp_size", 4_294_967_295_u64.into()),
        ("kv_events_endpoint", "tcp://a:b@[::1]%x/y:5557".into()),
    ];
    for (field, value) in cases {
        let mut body = serde_json::json!({
            "type": "P", "http_address": "127.0.0.2:8100", "zmq_address": "127.0.0.2:21001"
        });
        body[field] = value;
        let (status, answer) = register(&router, &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{field}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{field}: {message}");
        assert!(message.len() < 400, "{message}");
    }
    // A ZMQ address outside the networks is a 403 naming it.
    let (status, answer) = register(
        &router,
        &serde_json::json!({
            "type": "P", "http_address": "127.0.0.2:8100", "zmq_address": "127.0.0.1:21001"
        }),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("zmq_address"),
        "{answer}"
    );
    assert!(registrar.registries().prefill.is_empty(), "nothing changed");
    assert_eq!(registrar.registries().malformed_messages(), 6);
    assert_eq!(registrar.registries().refused_addresses(), 1);
}
