//! Measures the HTTP overhead of one engine with no simulated latency
//! (`time_scale = 0`): keep-alive clients send small non-streaming
//! completions as fast as they can.
//!
//! `cargo run -p engine-sim --release --example engine_overhead -- [CLIENTS] [REQUESTS]`

use std::time::Instant;

use bytes::Bytes;
use engine_sim::{EngineConfig, ServeOptions, spawn};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let clients: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(4);
    let requests: usize = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(20_000);
    let config = EngineConfig {
        time_scale: 0.0,
        ..EngineConfig::default()
    };
    let engine = spawn(config, ServeOptions::default()).await?;
    let addr = engine.addr();
    let body = r#"{"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 4}"#;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let per_client = requests / clients;
        tasks.push(tokio::spawn(async move {
            let stream = TcpStream::connect(addr).await?;
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            tokio::spawn(conn);
            for _ in 0..per_client {
                let request = Request::post("/v1/completions")
                    .header("host", "engine")
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from_static(body.as_bytes())))?;
                let response = sender.send_request(request).await?;
                assert!(response.status().is_success());
                response.into_body().collect().await?;
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(per_client)
        }));
    }
    let mut done = 0;
    for task in tasks {
        done += task.await?.map_err(|e| e.to_string())?;
    }
    let elapsed = start.elapsed();
    println!(
        "{done} requests over {clients} connections in {:.2} s: {:.0} requests/s, {:.1} µs/request",
        elapsed.as_secs_f64(),
        done as f64 / elapsed.as_secs_f64(),
        elapsed.as_micros() as f64 / done as f64
    );
    engine.shutdown().await;
    Ok(())
}
