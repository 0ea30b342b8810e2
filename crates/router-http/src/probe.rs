//! [`HttpProbe`]: worker-lifecycle's health probe over the router's pooled
//! HTTP client.

use crate::client::UpstreamClient;
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use worker_lifecycle::{HealthProbe, ProbeError, Worker, WorkerUrl};

/// Probes a worker with `GET {url}{endpoint}`: healthy on a 2xx answer.
#[derive(Debug, Clone)]
pub struct HttpProbe {
    client: UpstreamClient,
    endpoint: String,
}

impl HttpProbe {
    /// A probe of `endpoint` (e.g. `/health`) through `client`.
    pub fn new(client: UpstreamClient, endpoint: &str) -> Self {
        Self {
            client,
            endpoint: endpoint.to_owned(),
        }
    }
}

impl HttpProbe {
    /// Probes the worker at base `url` once (no timeout of its own): for a
    /// worker that is not (yet) a `Worker`, such as one being added. The
    /// health path goes below the URL's path prefix, if any.
    pub async fn probe_url(&self, url: &WorkerUrl) -> Result<(), ProbeError> {
        let uri = url.url_for(&self.endpoint);
        let request = Request::get(uri)
            .body(Full::new(Bytes::new()))
            .map_err(|err| ProbeError::Unreachable(err.to_string()))?;
        let response = self
            .client
            .send(request)
            .await
            .map_err(|err| ProbeError::Unreachable(err.to_string()))?;
        let status = response.status();
        // Reading the (small) body to its end lets the connection go back
        // to the pool instead of a new one per probe; a large or broken
        // body only costs the connection.
        let _ = http_body_util::Limited::new(response.into_body(), 64 * 1024)
            .collect()
            .await;
        if status.is_success() {
            Ok(())
        } else {
            Err(ProbeError::Unhealthy(format!("status {status}")))
        }
    }
}

impl HealthProbe for HttpProbe {
    async fn probe(&self, worker: &Worker) -> Result<(), ProbeError> {
        self.probe_url(worker.endpoint().worker_url()).await
    }
}
