//! Regular (non-P/D) workers from a discovery registry: the router's pool is
//! the same `RolePool` the P/D roles use, so a registration is routable at
//! once and a deregistration takes the worker away.

mod common;

use common::{Fixture, call, chat_body, json};
use engine_sim::{EngineConfig, ServeOptions};
use http::StatusCode;
use router_http::{ConfigError, RouterConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};
use worker_lifecycle::{Endpoint, Registration, RoleKind, ServiceRegistry};

#[tokio::test]
async fn registered_workers_serve_and_deregistered_ones_leave() {
    let engine = engine_sim::spawn(EngineConfig::default(), ServeOptions::default())
        .await
        .unwrap();
    let registry = Arc::new(ServiceRegistry::new(
        RoleKind::Regular,
        Duration::from_secs(60),
    ));
    let config = RouterConfig {
        worker_registry: Some(Arc::clone(&registry)),
        ..RouterConfig::default()
    };
    let fixture = Fixture::start_with_urls(config, vec![], &[]).await;
    let chat = || chat_body("Which workers are registered?", false);

    let (status, _, body) = call(fixture.addr, "POST", "/v1/chat/completions", &[], chat()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let message = json(&body)["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("no workers are registered"), "{message}");

    let endpoint = Endpoint::new(&engine.url(), None).unwrap();
    registry.register(endpoint.clone(), Registration::default(), Instant::now());
    let (status, _, body) = call(fixture.addr, "POST", "/v1/chat/completions", &[], chat()).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let workers = fixture.router.workers();
    assert_eq!(workers.len(), 1);
    assert_eq!(workers[0].processed(), 1, "the registered engine served it");
    assert!(fixture.router.is_ready());

    registry.deregister(&endpoint);
    let (status, _, _) = call(fixture.addr, "POST", "/v1/chat/completions", &[], chat()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(fixture.router.workers().is_empty());
    assert!(!fixture.router.is_ready());
    // A discovered pool is not managed by hand.
    assert!(
        fixture
            .router
            .add_worker(&engine.url(), None, None)
            .is_err()
    );
    fixture.shutdown().await;
}

#[test]
fn a_registry_of_another_role_is_refused() {
    let config = RouterConfig {
        worker_registry: Some(Arc::new(ServiceRegistry::new(
            RoleKind::Decode,
            Duration::from_secs(60),
        ))),
        ..RouterConfig::default()
    };
    match router_http::Router::new(config) {
        Err(ConfigError::Worker { reason, .. }) => {
            assert!(reason.contains("decode"), "{reason}")
        }
        other => panic!("unexpected {other:?}"),
    }
}
