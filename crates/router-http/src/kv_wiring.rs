//! Wiring of the KV event bridge (crate `kv-event-bridge`, feature
//! `kv-events`) into the router: building the hub when a pool's policy is
//! `kv_aware`, following the pools' membership on a timer, and asking each
//! newly followed engine for its cache size over HTTP. The bridge itself
//! (subscriptions, conversion, liveness, metrics) knows no HTTP and no
//! router; this is the part that does.
//!
//! Without the feature the hub type is uninhabited, so the router carries
//! an `Option` of it that is always `None` and needs no `cfg` of its own.

#[cfg(feature = "kv-events")]
pub(crate) use enabled::{KvHub, attach, restrict_to_model, spawn_sync};

#[cfg(not(feature = "kv-events"))]
pub(crate) use disabled::{KvHub, attach, restrict_to_model, spawn_sync};

/// The index-reading policy of each pool for the one model
/// `KvEventsConfig::model` names: the host sets it as that model's
/// configuration in the pool's registry once the pools exist.
pub(crate) type ModelPolicies = (
    String,
    Vec<(worker_lifecycle::RoleKind, lb_policies::PolicyConfig)>,
);

#[cfg(not(feature = "kv-events"))]
mod disabled {
    use crate::client::UpstreamClient;
    use crate::config::RouterConfig;
    use worker_lifecycle::{RoleKind, Worker};

    /// No hub exists without the feature.
    pub(crate) type KvHub = std::convert::Infallible;

    /// Never builds a hub.
    pub(crate) fn attach(_config: &mut RouterConfig) -> Option<KvHub> {
        None
    }

    /// No model is scored on an index without the feature.
    pub(crate) fn restrict_to_model(_config: &mut RouterConfig) -> Option<super::ModelPolicies> {
        None
    }

    /// Cannot be called: there is no hub to follow.
    pub(crate) fn spawn_sync(
        hub: &KvHub,
        _client: UpstreamClient,
        _members: impl Fn(&[RoleKind]) -> Option<Vec<std::sync::Arc<Worker>>>,
    ) -> tokio::task::JoinHandle<()> {
        match *hub {}
    }
}

#[cfg(feature = "kv-events")]
mod enabled {
    use std::sync::Arc;

    use bytes::Bytes;
    use http::Request;
    use http_body_util::{BodyExt, Full};
    use kv_block_index::{IndexConfig, KvIndex, WorkerId};
    use kv_event_bridge::KvEvents;
    use lb_policies::{KvSources, KvStreams, PolicyConfig};
    use tokio::time::Instant;
    use worker_lifecycle::{RoleKind, Worker};

    use crate::client::UpstreamClient;
    use crate::config::RouterConfig;

    /// The router's hub.
    pub(crate) type KvHub = Arc<KvEvents>;

    /// Whether a pool's policy scores on the block index: `kv_aware` or
    /// `kv_aware_gate` (lb-policies' index policies).
    fn reads_index(policy: &PolicyConfig) -> bool {
        lb_policies::INDEX_POLICIES.contains(&policy.name.as_str())
    }

    /// Builds the hub when a pool's policy is `kv_aware`: every `kv_aware`
    /// policy configuration of `config` gets the same [`KvSources`] (the
    /// host's, if one already carries them; else a new index with the
    /// policy's block size).
    pub(crate) fn attach(config: &mut RouterConfig) -> Option<KvHub> {
        let mut roles = Vec::new();
        let mut found: Option<(Option<KvSources>, usize)> = None;
        let mut note = |policy: &PolicyConfig| {
            if found.is_none() {
                found = Some((policy.kv.clone(), policy.cache_aware.block_size));
            }
        };
        match &config.pd {
            Some(pd) => {
                let prefill = pd.prefill_policy.as_ref().unwrap_or(&config.policy);
                let decode = pd.decode_policy.as_ref().unwrap_or(&config.policy);
                for (role, policy) in [(RoleKind::Prefill, prefill), (RoleKind::Decode, decode)] {
                    if reads_index(policy) {
                        roles.push(role);
                        note(policy);
                    }
                }
            }
            None if reads_index(&config.policy) => {
                roles.push(RoleKind::Regular);
                note(&config.policy);
            }
            None => {}
        }
        let (sources, block_size) = found?;
        let sources = sources.unwrap_or_else(|| {
            let index = KvIndex::new(IndexConfig {
                block_size: block_size.max(1),
                max_blocks_per_holder: config.kv_events.max_blocks_per_worker,
                ..IndexConfig::default()
            });
            KvSources::new(Arc::new(index), Arc::new(KvStreams::new()))
        });
        let give = |policy: &mut PolicyConfig| {
            if reads_index(policy) && policy.kv.is_none() {
                policy.kv = Some(sources.clone());
            }
        };
        give(&mut config.policy);
        if let Some(pd) = &mut config.pd {
            for policy in [&mut pd.prefill_policy, &mut pd.decode_policy]
                .into_iter()
                .flatten()
            {
                give(policy);
            }
        }
        Some(Arc::new(KvEvents::new(
            config.kv_events.clone(),
            sources,
            roles,
        )))
    }

    /// With [`KvEventsConfig::model`](kv_event_bridge::KvEventsConfig::model)
    /// set (after [`attach`]): every pool policy that reads the index
    /// becomes `cache_aware` with the same knobs, the default of every
    /// model, and its index-reading configuration is returned, to be that
    /// one model's in the pool's registry. A P/D role that inherits the
    /// main policy gets its own copy first, so the two roles stay apart.
    pub(crate) fn restrict_to_model(config: &mut RouterConfig) -> Option<super::ModelPolicies> {
        let model = config.kv_events.model.clone()?;
        let fallback = |policy: &PolicyConfig| {
            let mut fallback = policy.clone();
            fallback.name = "cache_aware".to_owned();
            fallback.kv = None;
            fallback
        };
        let mut policies = Vec::new();
        if let Some(pd) = &mut config.pd {
            for (role, slot) in [
                (RoleKind::Prefill, &mut pd.prefill_policy),
                (RoleKind::Decode, &mut pd.decode_policy),
            ] {
                let policy = slot.get_or_insert_with(|| config.policy.clone());
                if reads_index(policy) {
                    policies.push((role, policy.clone()));
                    *policy = fallback(policy);
                }
            }
        } else if reads_index(&config.policy) {
            policies.push((RoleKind::Regular, config.policy.clone()));
        }
        if reads_index(&config.policy) {
            config.policy = fallback(&config.policy);
        }
        Some((model, policies))
    }

    /// The task that keeps the hub following the router's pools: one
    /// membership pass per `sync_interval` over the workers `members`
    /// gives for the hub's roles (`None`: a pool could not be refreshed,
    /// so the last known set is kept), and a cache-size request through
    /// `client` to each worker followed for the first time.
    pub(crate) fn spawn_sync(
        hub: &KvHub,
        client: UpstreamClient,
        members: impl Fn(&[RoleKind]) -> Option<Vec<Arc<Worker>>> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let hub = Arc::clone(hub);
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(hub.config().sync_interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let Some(workers) = members(hub.roles()) else {
                    continue;
                };
                for (id, worker) in hub.sync(&workers) {
                    let client = client.clone();
                    tokio::spawn(bound_by_engine(client, Arc::clone(&hub), id, worker));
                }
            }
        })
    }

    /// Asks a newly followed worker's engine for its KV-cache size (its
    /// `/metrics`, once, within 5 s and 1 MiB) and lowers the worker's
    /// block cap in the index to it. An engine that does not answer, or
    /// names no size, keeps the configured cap.
    async fn bound_by_engine(
        client: UpstreamClient,
        hub: KvHub,
        id: WorkerId,
        worker: Arc<Worker>,
    ) {
        const LIMIT: usize = 1024 * 1024;
        let uri = worker.endpoint().worker_url().url_for("/metrics");
        let Ok(request) = Request::get(uri).body(Full::new(Bytes::new())) else {
            return;
        };
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        let fetched = tokio::time::timeout_at(deadline, async {
            let response = client.send(request).await.ok()?;
            if !response.status().is_success() {
                return None;
            }
            let body = http_body_util::Limited::new(response.into_body(), LIMIT)
                .collect()
                .await
                .ok()?;
            Some(body.to_bytes())
        })
        .await;
        let Ok(Some(body)) = fetched else {
            tracing::debug!(worker = %worker.key(), "KV events: the engine's cache size is not known; the configured cap holds");
            return;
        };
        if let Some(cap) = hub.bound_by_engine(id, &String::from_utf8_lossy(&body)) {
            tracing::info!(worker = %worker.key(), cap, "KV events: block cap from the engine's num_gpu_blocks");
        }
    }
}
