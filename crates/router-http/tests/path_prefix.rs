//! A worker behind an ingress that routes by path prefix: every request,
//! the health probe included, goes below the prefix, once.

mod common;

use bytes::Bytes;
use common::{call, chat_body, json};
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use router_http::{Router, RouterConfig};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// A stand-in ingress: answers 200 below `/engine-a` and 404 elsewhere,
/// and records every path it was asked for.
async fn ingress() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let record = Arc::clone(&record);
            let service =
                hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let path = request.uri().path().to_owned();
                    record.lock().unwrap().push(path.clone());
                    async move {
                        let _ = request.into_body().collect().await;
                        let (status, body) = if path.starts_with("/engine-a/") {
                            (
                                StatusCode::OK,
                                r#"{"object":"chat.completion","choices":[]}"#,
                            )
                        } else {
                            (StatusCode::NOT_FOUND, r#"{"detail":"Not Found"}"#)
                        };
                        let mut response =
                            http::Response::new(Full::new(Bytes::from_static(body.as_bytes())));
                        *response.status_mut() = status;
                        Ok::<_, std::convert::Infallible>(response)
                    }
                });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, seen)
}

#[tokio::test]
async fn requests_and_probes_go_below_the_workers_path_prefix() {
    let (upstream, seen) = ingress().await;
    let router = Router::new(RouterConfig::default()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = router.clone();
    tokio::spawn(async move { serving.serve(listener, std::future::pending()).await });

    // Added at run time: the startup probe must find /engine-a/health.
    let url = format!("http://127.0.0.1:{}/engine-a/", upstream.port());
    let (status, _, body) = call(addr, "POST", &format!("/add_worker?url={url}"), &[], "").await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        json(&body)["worker"]["url"],
        format!("http://127.0.0.1:{}/engine-a", upstream.port())
    );

    let (status, _, body) = call(
        addr,
        "POST",
        "/v1/chat/completions?trace=1",
        &[("content-type", "application/json")],
        chat_body("behind an ingress", false),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, ["/engine-a/health", "/engine-a/v1/chat/completions"]);
    assert_eq!(router.workers()[0].load(), 0);

    // The OpenAI-client habit of a base URL ending in /v1 is refused with
    // the reason, before anything is sent.
    let v1 = format!("http://127.0.0.1:{}/v1", upstream.port());
    let (status, _, body) = call(addr, "POST", &format!("/add_worker?url={v1}"), &[], "").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let message = json(&body)["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("without /v1"), "{message}");
    assert_eq!(router.workers().len(), 1);
}
