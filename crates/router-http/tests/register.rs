//! `POST /register` through the host's hook: called with the body after
//! the admin check, its answer or error sent back; without a hook the
//! route keeps answering "not enabled".

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use parking_lot::Mutex;
use router_http::{ApiError, Router, RouterConfig};
use std::sync::Arc;

/// Every body the hook was called with.
type Calls = Arc<Mutex<Vec<Bytes>>>;

/// A router whose hook records each body and registers `{"name": ...}`
/// bodies, refusing anything else with 400.
fn router_with_hook(api_key: Option<&str>, admin_key: Option<&str>) -> (Router, Calls) {
    let calls: Calls = Arc::default();
    let seen = Arc::clone(&calls);
    let hook = move |body: Bytes| {
        seen.lock().push(body.clone());
        async move {
            let map: serde_json::Value = serde_json::from_slice(&body)
                .map_err(|err| ApiError::InvalidRequest(format!("invalid registration: {err}")))?;
            match map["name"].as_str() {
                Some(name) => Ok(serde_json::json!({"status": "registered", "name": name})),
                None => Err(ApiError::InvalidRequest(
                    "invalid registration: missing `name`".into(),
                )),
            }
        }
    };
    let config = RouterConfig {
        api_key: api_key.map(str::to_owned),
        admin_api_key: admin_key.map(str::to_owned),
        register_hook: Some(Arc::new(hook)),
        ..RouterConfig::default()
    };
    (Router::new(config).unwrap(), calls)
}

async fn post_register(
    router: &Router,
    key: Option<&str>,
    body: impl Into<Bytes>,
) -> (StatusCode, Option<String>, serde_json::Value) {
    let mut request = Request::post("/register").header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("authorization", format!("Bearer {key}"));
    }
    let response = router
        .handle(request.body(Full::new(body.into())).unwrap())
        .await;
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&bytes)
        .unwrap_or_else(|err| panic!("not JSON ({err}): {}", String::from_utf8_lossy(&bytes)));
    (status, content_type, json)
}

#[tokio::test]
async fn the_hook_is_called_with_the_body_and_its_answer_is_sent() {
    let (router, calls) = router_with_hook(None, Some("admin-key"));
    let body = r#"{"name": "engine-1"}"#;
    let (status, content_type, answer) = post_register(&router, Some("admin-key"), body).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(content_type.as_deref(), Some("application/json"));
    assert_eq!(
        answer,
        serde_json::json!({"status": "registered", "name": "engine-1"})
    );
    assert_eq!(*calls.lock(), [Bytes::from_static(body.as_bytes())]);

    // The hook's error goes through the one error mapping.
    let (status, _, answer) = post_register(&router, Some("admin-key"), "{}").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        answer["error"]["message"],
        "invalid registration: missing `name`"
    );
    assert_eq!(calls.lock().len(), 2);
}

#[tokio::test]
async fn an_unauthenticated_request_never_reaches_the_hook() {
    let (router, calls) = router_with_hook(None, Some("admin-key"));
    for key in [None, Some("wrong"), Some("")] {
        let (status, _, answer) = post_register(&router, key, r#"{"name": "x"}"#).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{key:?}: {answer}");
    }
    assert!(calls.lock().is_empty());

    // The inference key is not the admin key.
    let (router, calls) = router_with_hook(Some("inference-key"), Some("admin-key"));
    let (status, _, _) = post_register(&router, Some("inference-key"), "{}").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(calls.lock().is_empty());
}

#[tokio::test]
async fn an_oversize_body_is_413_and_never_reaches_the_hook() {
    let (router, calls) = router_with_hook(None, None);
    let limit = router_http::register::MAX_REGISTRATION_BYTES;
    let body = format!(r#"{{"name": "{}"}}"#, "x".repeat(limit));
    let (status, _, answer) = post_register(&router, None, body).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&limit.to_string()),
        "{answer}"
    );
    assert!(calls.lock().is_empty());
}

#[tokio::test]
async fn without_a_hook_the_route_answers_not_enabled() {
    let router = Router::new(RouterConfig::default()).unwrap();
    let (status, _, answer) = post_register(&router, None, r#"{"name": "x"}"#).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        answer["error"]["message"],
        "HTTP registration is not enabled on this router"
    );
    // Other methods on the path are still 405.
    let response = router
        .handle(
            Request::get("/register")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
    assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
}
