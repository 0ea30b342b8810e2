//! The workers at run time: adding them (their URLs checked first), and
//! forwarding membership changes to the policies.

use super::Router;
use crate::config::ConfigError;
use crate::error::ApiError;
use std::sync::Arc;
use worker_lifecycle::{
    Endpoint, MembershipEvent, RoleKind, Worker, WorkerRole, WorkerSpec, WorkerUrl,
};

impl Router {
    /// Every worker of every role: the regular ones, then (in P/D mode)
    /// the prefill and decode workers as last reconciled.
    pub fn all_workers(&self) -> Vec<Arc<Worker>> {
        let mut all: Vec<Arc<Worker>> = self.workers().iter().cloned().collect();
        if let Some(pd) = self.pd() {
            all.extend(pd.workers());
        }
        all
    }

    /// Checks a worker URL given at run time before anything is sent to
    /// it: [`WorkerUrl::parse_http`] (one canonical spelling, plain HTTP),
    /// then the configured [`RouterConfig::worker_networks`] (a host name
    /// is resolved, within the connect timeout, and all its addresses must
    /// be allowed). Hosts that add workers their own way call this first.
    ///
    /// [`RouterConfig::worker_networks`]: crate::RouterConfig::worker_networks
    pub async fn check_worker_url(&self, url: &str) -> Result<WorkerUrl, ApiError> {
        let url =
            WorkerUrl::parse_http(url).map_err(|err| ApiError::InvalidRequest(err.to_string()))?;
        let config = &self.shared.config;
        crate::allow::check_worker_address(
            &url,
            &config.worker_networks,
            config.client.connect_timeout,
        )
        .await?;
        Ok(url)
    }

    /// Adds a regular worker at `url` (with an optional data-parallel rank
    /// and model id) without waiting for its health, and tells the policies.
    pub fn add_worker(
        &self,
        url: &str,
        dp_rank: Option<u32>,
        model: Option<&str>,
    ) -> Result<Arc<Worker>, ConfigError> {
        let invalid = |reason: String| ConfigError::Worker {
            url: url.to_owned(),
            reason,
        };
        let parsed = WorkerUrl::parse_http(url).map_err(|err| invalid(err.reason().to_owned()))?;
        self.add_worker_at(Endpoint::from_url(parsed, dp_rank), model)
    }

    /// Adds a regular worker at an endpoint whose URL is already parsed,
    /// without waiting for its health, and tells the policies.
    pub fn add_worker_at(
        &self,
        endpoint: Endpoint,
        model: Option<&str>,
    ) -> Result<Arc<Worker>, ConfigError> {
        let invalid = |reason: String| ConfigError::Worker {
            url: endpoint.url().to_owned(),
            reason,
        };
        let mut spec = WorkerSpec::new(WorkerRole::Regular, endpoint.clone());
        if let Some(model) = model {
            spec = spec.with_model(model);
        }
        self.shared
            .pool
            .add(spec)
            .map_err(|err| invalid(err.to_string()))
    }

    /// Adds a static prefill or decode worker at run time, in P/D mode: a
    /// Mooncake prefill worker's engine ids are learned first (with the
    /// configured bootstrap retries), so it joins its role already
    /// selectable.
    ///
    /// # Errors
    /// [`ConfigError::Pd`] outside P/D mode; [`ConfigError::Worker`] for an
    /// invalid spec, a duplicate or a discovered role;
    /// [`ConfigError::Bootstrap`] when its bootstrap server does not answer.
    pub async fn add_pd_worker(
        &self,
        role: RoleKind,
        spec: &crate::pd::PdWorkerConfig,
    ) -> Result<Arc<Worker>, ConfigError> {
        match &self.shared.pd {
            Some(pd) => pd.add_worker(role, spec).await,
            None => Err(ConfigError::Pd(
                "the router is not in prefill/decode mode".into(),
            )),
        }
    }

    /// Forwards a membership event of the regular workers to the policies:
    /// a replaced worker is a removal of the old lifetime's key and an
    /// addition of the new one's.
    pub fn apply(&self, event: &MembershipEvent) {
        self.shared.pool.apply(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RouterConfig;
    use http::StatusCode;

    #[tokio::test]
    async fn worker_urls_are_validated_before_use() {
        let router = Router::new(RouterConfig::default()).unwrap();
        for good in [
            "http://127.0.0.1:8001",
            "http://engine.local",
            "http://[::1]:8000",
        ] {
            assert!(router.check_worker_url(good).await.is_ok(), "{good}");
        }
        let https = router
            .check_worker_url("https://engine.local")
            .await
            .unwrap_err();
        assert!(
            https
                .to_string()
                .contains("https workers are not supported"),
            "{https}"
        );
        for bad in [
            "127.0.0.1:8001",
            "ftp://host",
            "http://",
            "http://host:99999",
            "http://user:pw@host",
            "http://host/?q=1",
            "http://host:8000/v1",
            "not a url",
        ] {
            let err = router.check_worker_url(bad).await.unwrap_err();
            assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{bad}");
            assert!(err.to_string().contains(bad), "{bad}: {err}");
        }
    }
}
