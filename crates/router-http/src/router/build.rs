//! Construction: from a [`RouterConfig`] (or a host's own policy registry)
//! to a [`Router`] whose every part was checked, so that a bad setting
//! stops the start rather than the first request.

use super::{DP_RANK_HEADER, Router, Shared};
use crate::client::UpstreamClient;
use crate::config::{ConfigError, RouterConfig};
use crate::headers::RequestIds;
use crate::limits::{ConcurrencyLimiter, RateLimiter};
use crate::metrics::RouterMetrics;
use http::header::HeaderName;
use lb_policies::PolicyRegistry;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use worker_lifecycle::{RandomSource, RetryBudget, RoleKind, RolePool, SplitMix64, Worker};

impl Router {
    /// Builds a router from `config`, with no workers yet.
    ///
    /// When a pool's policy is `kv_aware` (feature `kv-events`), the router
    /// also builds the KV event subscriptions that feed it
    /// ([`Router::kv_events`]); [`Router::spawn_background`] starts them.
    /// With `kv_events.model` set, only that model's requests are scored
    /// on the index: every other model's pool policy is `cache_aware` with
    /// the same knobs.
    pub fn new(mut config: RouterConfig) -> Result<Self, ConfigError> {
        share_tree_budget(&mut config);
        let kv = crate::kv_wiring::attach(&mut config);
        let model_policies = crate::kv_wiring::restrict_to_model(&mut config);
        let policies = PolicyRegistry::new(config.policy.clone())?;
        let router = Self::build(config, policies, kv)?;
        if let Some((model, policies)) = model_policies {
            for (role, policy) in policies {
                let registry = match (role, router.pd()) {
                    (RoleKind::Regular, _) => router.policies(),
                    (role, Some(pd)) => pd.role(role).policies(),
                    (_, None) => continue,
                };
                registry.set_model_config(&model, policy)?;
            }
        }
        Ok(router)
    }

    /// Builds a router that selects with `policies` (for instance a registry
    /// with custom policy factories registered); `config.policy` is ignored,
    /// and no KV event subscriptions are made (a host that builds its own
    /// `kv_aware` policy feeds its index itself).
    pub fn with_policies(
        mut config: RouterConfig,
        policies: PolicyRegistry<Arc<Worker>>,
    ) -> Result<Self, ConfigError> {
        share_tree_budget(&mut config);
        Self::build(config, policies, None)
    }

    fn build(
        #[cfg_attr(
            not(feature = "tokens"),
            allow(unused_mut, reason = "the pool needs tokens")
        )]
        mut config: RouterConfig,
        policies: PolicyRegistry<Arc<Worker>>,
        kv: Option<crate::kv_wiring::KvHub>,
    ) -> Result<Self, ConfigError> {
        #[cfg(feature = "tokens")]
        {
            let tokenize = config.tokenize.clone();
            config
                .tokenizers
                .set_pool(&tokenize)
                .map_err(ConfigError::Tokenize)?;
        }
        let ids = RequestIds::new(&config.request_id_headers)
            .map_err(|err| ConfigError::RequestIdHeader(err.to_string()))?;
        let session_header = HeaderName::from_bytes(config.session_header.as_bytes())
            .map_err(|_| ConfigError::SessionHeader(config.session_header.clone()))?;
        if config.concurrency.max_concurrent == 0 {
            return Err(ConfigError::Concurrency);
        }
        let rate = match config.rate_limit_per_second {
            Some(rate) => {
                Some(RateLimiter::new(rate, rate.max(1.0)).ok_or(ConfigError::RateLimit(rate))?)
            }
            None => None,
        };
        let options = config.worker_options.clone();
        policies.set_max_models(config.max_models);
        let pool = match &config.worker_registry {
            Some(registry) if registry.role() != RoleKind::Regular => {
                return Err(ConfigError::Worker {
                    url: String::new(),
                    reason: format!(
                        "the worker registry is for the {} role; regular workers need a regular \
                         one",
                        registry.role()
                    ),
                });
            }
            Some(registry) => RolePool::discovered(Arc::clone(registry), options, policies),
            None => RolePool::fixed(RoleKind::Regular, options, policies),
        }
        .map_err(|err| ConfigError::Worker {
            url: String::new(),
            reason: err.to_string(),
        })?;
        let retry_budget = RetryBudget::new(config.retry_budget.clone(), std::time::Instant::now());
        let client = UpstreamClient::new(config.client);
        let pd = match &config.pd {
            Some(pd) => Some(crate::pd::PdState::new(pd, &config, &client)?),
            None => None,
        };
        if let Some(pd) = &pd {
            for role in [RoleKind::Prefill, RoleKind::Decode] {
                pd.pools()
                    .role(role)
                    .policies()
                    .set_max_models(config.max_models);
            }
        }
        let shared = Shared {
            client,
            pd,
            limiter: ConcurrencyLimiter::new(config.concurrency),
            pool,
            rate,
            ids,
            session_header,
            dp_rank_header: HeaderName::from_static(DP_RANK_HEADER),
            retry_budget,
            jitter_seed: AtomicU64::new(SplitMix64::from_entropy().next_u64()),
            metrics: RouterMetrics::default(),
            accepting: AtomicBool::new(true),
            startup: crate::startup::StartupGate::new(),
            kv,
            load_poll: crate::load_poll::LoadPolls::new(config.load_poll.clone()),
            peers: crate::peers::PeerSync::new(config.peers.clone())
                .map_err(ConfigError::Peers)?
                .map(Arc::new),
            config,
        };
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// Builds a router from `config` and, in P/D mode, runs its startup
    /// work: the Mooncake bootstrap queries of the static prefill workers
    /// ([`Router::bootstrap_pd`]). What a command line calls.
    pub async fn start(config: RouterConfig) -> Result<Self, ConfigError> {
        let router = Self::new(config)?;
        router.bootstrap_pd().await?;
        Ok(router)
    }

    /// In P/D mode with the Mooncake connector, learns the engine ids of
    /// every static prefill worker from its bootstrap server (retried with
    /// backoff); a no-op otherwise. Prefill workers whose engine ids are
    /// unknown are not selected.
    pub async fn bootstrap_pd(&self) -> Result<(), ConfigError> {
        match &self.shared.pd {
            Some(pd) => pd.bootstrap().await,
            None => Ok(()),
        }
    }
}

/// Makes every cache-aware policy of the router (the regular pool's and the
/// P/D pools', every model's instance) charge one memory budget: the size
/// of `config.policy`'s `max_tree_bytes`, unless the host set a budget of
/// its own. Returns it.
fn share_tree_budget(config: &mut RouterConfig) -> Arc<lb_policies::MemoryBudget> {
    let budget = config
        .policy
        .cache_aware
        .tree_budget
        .get_or_insert_with(|| {
            lb_policies::MemoryBudget::new(config.policy.cache_aware.max_tree_bytes)
        })
        .clone();
    if let Some(pd) = &mut config.pd {
        for policy in [&mut pd.prefill_policy, &mut pd.decode_policy]
            .into_iter()
            .flatten()
        {
            policy.cache_aware.tree_budget = Some(Arc::clone(&budget));
        }
    }
    budget
}
