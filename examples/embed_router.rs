//! A host program embedding the `router-http` router next to routes of its
//! own.
//!
//! The host builds a `RouterConfig` in code (no command line, no file),
//! creates the `Router`, registers its workers, starts the router's
//! background work (health checks, cache-tree eviction), and serves one
//! hyper service in which its own `GET /hello` is answered by the host and
//! every other request goes to `router.handle(request)` — the OpenAI
//! routes, `/health`, `/metrics` and the admin routes included. Shutdown is
//! the router's: on Ctrl-C, new requests are refused and those in flight
//! get the configured grace period.
//!
//! For the demo the host starts two `engine-sim` engines (no simulated
//! latency) on 127.0.0.1 as its workers, and serves on 127.0.0.1:8080
//! (`--port N` to change) until Ctrl-C.
//!
//! Run:
//!
//! ```text
//! cargo run --release --example embed_router
//! curl -s localhost:8080/hello
//! curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \
//!   -d '{"model":"sim-model","messages":[{"role":"user","content":"Hello"}]}'
//! ```
//!
//! With `--self-test` (or `EMBED_ROUTER_SELF_TEST=1`) it binds a free port,
//! queries `/hello` and one chat completion through itself, checks both,
//! shuts down and exits (status 0 on success).
use std::convert::Infallible;
use std::error::Error;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use lb_policies::PolicyConfig;
use router_http::{BoxBody, Router, RouterConfig};
use tokio::net::TcpListener;

type BoxError = Box<dyn Error + Send + Sync>;

/// The router's configuration, in code: every field has a documented
/// default; the host changes what it cares about.
fn config() -> RouterConfig {
    let mut policy = PolicyConfig::named("cache_aware");
    policy.cache_aware.cache_threshold = 0.5;
    RouterConfig {
        policy,
        max_payload_size: 16 << 20,
        request_timeout: Duration::from_secs(120),
        eviction_interval: Duration::from_secs(60),
        shutdown_grace: Duration::from_secs(5),
        ..RouterConfig::default()
    }
}

/// The host's own route, answered without the router.
fn hello(router: &Router) -> Response<BoxBody> {
    let text = format!(
        "hello from the host; the router has {} workers and {} requests in flight\n",
        router.workers().len(),
        router.in_flight()
    );
    Response::new(
        Full::new(Bytes::from(text))
            .map_err(|never| match never {})
            .boxed_unsync(),
    )
}

/// One service for the whole port: the host's routes first, the router
/// for everything else.
async fn route(
    router: Router,
    request: Request<Incoming>,
) -> Result<Response<BoxBody>, Infallible> {
    if request.method() == Method::GET && request.uri().path() == "/hello" {
        return Ok(hello(&router));
    }
    Ok(router.handle(request).await)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let self_test = args.iter().any(|a| a == "--self-test")
        || std::env::var_os("EMBED_ROUTER_SELF_TEST").is_some_and(|v| v == "1");
    let port: u16 = match args.iter().position(|a| a == "--port") {
        Some(i) => args.get(i + 1).ok_or("--port needs a value")?.parse()?,
        None if self_test => 0,
        None => 8080,
    };

    let router = Router::new(config())?;
    let mut engines = Vec::new();
    for _ in 0..2 {
        let engine = engine_sim::spawn(
            engine_sim::EngineConfig::instant(),
            engine_sim::ServeOptions::default(),
        )
        .await?;
        router.add_worker(&engine.url(), None, None)?;
        engines.push(engine);
    }
    let background = router.spawn_background();

    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await?;
    let addr = listener.local_addr()?;
    println!("embed_router on http://{addr} (GET /hello is the host's, the rest the router's)");

    let service = {
        let router = router.clone();
        service_fn(move |request| route(router.clone(), request))
    };
    let grace = router.config().shutdown_grace;
    let result = if self_test {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stopping = router.clone();
        let server = tokio::spawn(router_http::serve(
            listener,
            service,
            async move {
                let _ = stopped.await;
                stopping.begin_shutdown();
            },
            grace,
        ));
        let result = query_once(addr).await;
        let _ = stop.send(());
        let outcome = server.await?;
        println!("server stopped: {outcome:?}");
        result
    } else {
        let stopping = router.clone();
        let outcome = router_http::serve(
            listener,
            service,
            async move {
                let _ = tokio::signal::ctrl_c().await;
                stopping.begin_shutdown();
            },
            grace,
        )
        .await;
        println!("stopped: {outcome:?}");
        Ok(())
    };
    drop(background);
    for engine in engines {
        engine.shutdown().await;
    }
    result
}

/// Queries the host's route and the router's once each.
async fn query_once(addr: SocketAddr) -> Result<(), BoxError> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();

    let response = client.get(format!("http://{addr}/hello").parse()?).await?;
    let status = response.status();
    let text = response.into_body().collect().await?.to_bytes();
    let text = String::from_utf8_lossy(&text);
    print!("GET /hello -> {status}: {text}");
    if status != StatusCode::OK || !text.contains("2 workers") {
        return Err("the host's route did not answer as expected".into());
    }

    let body = serde_json::json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
    });
    let request = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let response = client.request(request).await?;
    let status = response.status();
    let answer: serde_json::Value =
        serde_json::from_slice(&response.into_body().collect().await?.to_bytes())?;
    println!(
        "POST /v1/chat/completions -> {status}: {}",
        answer["choices"][0]["message"]["content"]
    );
    if status != StatusCode::OK
        || answer["choices"][0]["message"]["content"]
            .as_str()
            .is_none()
    {
        return Err("the router's route did not answer as expected".into());
    }
    println!("self-test ok");
    Ok(())
}
