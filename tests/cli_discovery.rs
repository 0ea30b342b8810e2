//! The reference router's wiring of worker-discovery: `--worker-networks`
//! as the address check (over a real socket: a test engine connects a
//! DEALER to the listener's ROUTER on 127.0.0.1 and registers) and the
//! `POST /register` hook's mapping of refusals to HTTP. The protocol's own
//! tests (heartbeats, expiry, malformed messages) live in
//! crates/worker-discovery.

use affinity_router::cli::discovery::{self, NetworkCheck, Registrar, Registries};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "../crates/worker-discovery/tests/support/vllm_engine.rs"]
mod vllm_engine;
use vllm_engine::{TTL, engine_socket, eventually, registration};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_outside_the_allowed_networks_are_ignored() {
    let networks = vec!["127.0.0.0/8".parse().unwrap()];
    let discovery = discovery::bind(
        "127.0.0.1:0",
        TTL,
        networks,
        Duration::from_secs(5),
        worker_discovery::DEFAULT_MAX_MESSAGE_SIZE,
    )
    .await
    .unwrap();
    let registries = discovery.registries().clone();
    let mut engine = engine_socket(&discovery).await;
    // Outside first, then inside: once the second is registered, the first
    // has certainly been processed (one socket, in order).
    engine
        .send(registration("P", "10.1.2.3:8100", "10.1.2.3:21001"))
        .await
        .unwrap();
    engine
        .send(registration("P", "127.0.0.1:8101", "127.0.0.1:21002"))
        .await
        .unwrap();
    eventually("the allowed engine is registered", || {
        !registries
            .prefill
            .snapshot(Instant::now())
            .entries
            .is_empty()
    })
    .await;
    let prefill = registries.prefill.snapshot(Instant::now());
    let urls: Vec<String> = prefill
        .entries
        .iter()
        .map(|entry| entry.endpoint.to_string())
        .collect();
    assert_eq!(urls, ["http://127.0.0.1:8101"]);
    assert_eq!(discovery.refused_addresses(), 1);
}

#[tokio::test]
async fn the_register_hook_answers_400_for_bad_maps_and_403_outside_the_networks() {
    let networks = vec!["10.0.0.0/8".parse().unwrap()];
    let check = NetworkCheck::new(networks, Duration::from_secs(1)).expect("networks are set");
    let registrar = Registrar::new(Registries::new(Duration::from_secs(5)))
        .with_check(Arc::new(check), Duration::from_secs(1));
    let hook = discovery::register_hook(registrar.clone());

    let outside = hook
        .register(r#"{"type": "P", "http_address": "192.168.1.1:8000"}"#.into())
        .await
        .unwrap_err();
    assert_eq!(outside.status(), http::StatusCode::FORBIDDEN);
    let message = outside.to_string();
    assert!(
        message.contains("192.168.1.1") && message.contains("10.0.0.0/8"),
        "{message}"
    );
    let invalid = hook.register(r#"{"type": "X"}"#.into()).await.unwrap_err();
    assert_eq!(invalid.status(), http::StatusCode::BAD_REQUEST);
    assert!(
        invalid.to_string().starts_with("invalid registration"),
        "{invalid}"
    );
    assert!(registrar.registries().prefill.is_empty(), "nothing changed");

    let inside = hook
        .register(r#"{"type": "P", "http_address": "10.1.2.3:8000"}"#.into())
        .await
        .unwrap();
    assert_eq!(inside["status"], "registered");
    assert_eq!(inside["url"], "http://10.1.2.3:8000");
    assert_eq!(registrar.registries().prefill.len(), 1);
    assert!(NetworkCheck::new(Vec::new(), Duration::from_secs(1)).is_none());
}
