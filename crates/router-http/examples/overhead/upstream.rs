//! The minimal upstream the routers forward to

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

const COMPLETION: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there, how can I help you today?"},"finish_reason":"stop"}],"usage":{"prompt_tokens":250,"completion_tokens":10,"total_tokens":260}}"#;
const CHUNK: &str = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"token \"},\"finish_reason\":null}]}\n\n";

/// Runs `f` on a new single-threaded runtime on a named thread; returns what
/// `f` hands back through the channel once started. The thread lives for the
/// rest of the program.
pub(super) async fn start_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                continue;
            };
            let _ = socket.set_nodelay(true);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    |request: Request<hyper::body::Incoming>| async move {
                        let body = request
                            .into_body()
                            .collect()
                            .await
                            .map(|b| b.to_bytes())
                            .unwrap_or_default();
                        let stream = memchr_stream(&body);
                        let response = if stream {
                            let chunks = (0..16)
                                .map(|_| {
                                    Ok::<_, Infallible>(Frame::data(Bytes::from_static(
                                        CHUNK.as_bytes(),
                                    )))
                                })
                                .chain(std::iter::once(Ok(Frame::data(Bytes::from_static(
                                    b"data: [DONE]\n\n",
                                )))));
                            let body =
                                StreamBody::new(futures_util::stream::iter(chunks)).boxed_unsync();
                            Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(body)
                        } else {
                            let body = Full::new(Bytes::from_static(COMPLETION.as_bytes()))
                                .map_err(|never| match never {})
                                .boxed_unsync();
                            Response::builder()
                                .header("content-type", "application/json")
                                .body(body)
                        };
                        Ok::<_, Infallible>(response.expect("valid response"))
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            });
        }
    });
    addr
}

/// Whether a request body asks for a stream (a cheap scan, no JSON parse:
/// the upstream must cost as little as possible).
fn memchr_stream(body: &[u8]) -> bool {
    body.windows(14).any(|w| w == b"\"stream\":true}")
}
