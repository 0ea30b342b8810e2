//! One policy instance per model id, built by name.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use crate::backend::Backend;
use crate::context::RequestContext;
use crate::decision::{Decision, DecisionCounts};
use crate::error::PolicyError;
use crate::membership::MembershipEvent;
use crate::policies::cache_aware::{CacheAware, CacheAwareConfig, LoadGate};
use crate::policies::consistent_hash::{ConsistentHash, ConsistentHashConfig};
use crate::policies::least_loaded::LeastLoaded;
use crate::policies::power_of_two::PowerOfTwo;
use crate::policies::random::RandomPolicy;
use crate::policies::rendezvous::RendezvousHash;
use crate::policies::round_robin::RoundRobin;
use crate::policy::{Counted, Policy, PolicyState, TreeStats};
use crate::sync::{Mutex, RwLock};

/// The built-in policy names, as on the command line.
pub const BUILTIN_POLICIES: [&str; 8] = [
    "random",
    "round_robin",
    "power_of_two",
    "least_loaded",
    "consistent_hash",
    "rendezvous_hash",
    "cache_aware",
    "cache_aware_fleet_gate",
];

/// Built-in policies that read state only the host can provide, so that
/// `PolicyConfig::named(name)` alone does not build them (unlike
/// [`BUILTIN_POLICIES`]): `kv_aware` needs the KV block index and stream
/// liveness handle (`PolicyConfig::with_kv`, feature `kv-block-index`). Without
/// the feature, asking for it is a configuration error that says so.
pub const INDEX_POLICIES: [&str; 2] = ["kv_aware", "kv_aware_gate"];

/// Which policy to build and its knobs.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(default)
)]
#[non_exhaustive]
pub struct PolicyConfig {
    /// Policy name: one of [`BUILTIN_POLICIES`] or a registered factory's
    /// name. Default `"cache_aware"`.
    pub name: String,
    /// Seed for the random policies (`random`, `power_of_two`); `None`
    /// (default) seeds differently in every process.
    pub seed: Option<u64>,
    /// Knobs of `cache_aware` / `cache_aware_fleet_gate` (the latter forces
    /// [`LoadGate::FleetWide`]).
    pub cache_aware: CacheAwareConfig,
    /// Knobs of `consistent_hash`.
    pub consistent_hash: ConsistentHashConfig,
    /// What `kv_aware` reads from the host: the shared KV block index and
    /// the stream liveness handle (its threshold, load gate and fallback
    /// tree use [`cache_aware`](Self::cache_aware)'s knobs). `None` by
    /// default; building `kv_aware` without it is an
    /// [`InvalidConfig`](PolicyError::InvalidConfig) error naming `kv`. Not
    /// serialized: the host sets it after reading the rest.
    #[cfg(feature = "kv-block-index")]
    #[cfg_attr(feature = "serde", serde(skip))]
    pub kv: Option<crate::policies::kv_aware::KvSources>,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig::named("cache_aware")
    }
}

impl PolicyConfig {
    /// The named policy with default knobs.
    pub fn named(name: impl Into<String>) -> Self {
        PolicyConfig {
            name: name.into(),
            seed: None,
            cache_aware: CacheAwareConfig::default(),
            consistent_hash: ConsistentHashConfig::default(),
            #[cfg(feature = "kv-block-index")]
            kv: None,
        }
    }

    /// Sets the KV block index and liveness handle `kv_aware` reads.
    #[cfg(feature = "kv-block-index")]
    #[must_use]
    pub fn with_kv(mut self, sources: crate::policies::kv_aware::KvSources) -> Self {
        self.kv = Some(sources);
        self
    }

    /// Sets the seed of the random policies.
    #[must_use]
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }
}

/// Builds one of the [`BUILTIN_POLICIES`] from `config`.
pub fn build_builtin<B: Backend>(config: &PolicyConfig) -> Result<Box<dyn Policy<B>>, PolicyError> {
    let seeded = |f: fn(u64) -> Box<dyn Policy<B>>, g: fn() -> Box<dyn Policy<B>>| match config.seed
    {
        Some(seed) => f(seed),
        None => g(),
    };
    Ok(match config.name.as_str() {
        "random" => seeded(
            |s| Box::new(RandomPolicy::with_seed(s)),
            || Box::new(RandomPolicy::new()),
        ),
        "power_of_two" => seeded(
            |s| Box::new(PowerOfTwo::with_seed(s)),
            || Box::new(PowerOfTwo::new()),
        ),
        "round_robin" => Box::new(RoundRobin::new()),
        "least_loaded" => Box::new(LeastLoaded::new()),
        "consistent_hash" => Box::new(ConsistentHash::new(config.consistent_hash.clone())?),
        "rendezvous_hash" => Box::new(RendezvousHash::new()),
        "cache_aware" => Box::new(CacheAware::new(config.cache_aware.clone())?),
        "cache_aware_fleet_gate" => {
            let mut knobs = config.cache_aware.clone();
            knobs.gate = LoadGate::FleetWide;
            Box::new(CacheAware::new(knobs)?)
        }
        "kv_aware" | "kv_aware_gate" => build_kv_aware(config)?,
        other => {
            return Err(PolicyError::UnknownPolicy {
                name: other.to_owned(),
                known: known_names(),
            });
        }
    })
}

/// Every built-in name, for error messages.
fn known_names() -> String {
    let mut names: Vec<&str> = BUILTIN_POLICIES.to_vec();
    names.extend(INDEX_POLICIES);
    names.join(", ")
}

#[cfg(feature = "kv-block-index")]
fn build_kv_aware<B: Backend>(config: &PolicyConfig) -> Result<Box<dyn Policy<B>>, PolicyError> {
    let sources = config
        .kv
        .clone()
        .ok_or_else(|| PolicyError::InvalidConfig {
            field: "kv",
            reason: "is missing: `kv_aware` needs the shared KV block index and stream liveness \
                 handle (PolicyConfig::with_kv)"
                .to_owned(),
        })?;
    use crate::policies::kv_aware::KvAware;
    let knobs = config.cache_aware.clone();
    Ok(Box::new(match (config.name.as_str(), config.seed) {
        ("kv_aware_gate", _) => KvAware::gated(knobs, sources)?,
        (_, Some(seed)) => KvAware::with_seed(knobs, sources, seed)?,
        (_, None) => KvAware::new(knobs, sources)?,
    }))
}

#[cfg(not(feature = "kv-block-index"))]
fn build_kv_aware<B: Backend>(_: &PolicyConfig) -> Result<Box<dyn Policy<B>>, PolicyError> {
    Err(PolicyError::InvalidConfig {
        field: "name",
        reason: "is `kv_aware` or `kv_aware_gate`, which need lb-policies' `kv-block-index` \
                 feature"
            .to_owned(),
    })
}

/// Builds a policy from a configuration (a custom factory).
pub type PolicyFactory<B> =
    Arc<dyn Fn(&PolicyConfig) -> Result<Box<dyn Policy<B>>, PolicyError> + Send + Sync>;

/// A model's policy instance as the registry hands it out: the policy
/// wrapped in decision counters.
pub type ModelPolicy<B> = Counted<Box<dyn Policy<B>>>;

/// Keeps one policy instance per model id.
///
/// Instances are created on a model's first use from the model's
/// configuration (or the default one), by built-in name or by a factory
/// registered with [`register_factory`](Self::register_factory). The
/// registry also tracks fleet membership: [`on_membership`](Self::on_membership)
/// forwards each event to every instance, and a new instance is first told
/// about every current member, so a policy created late starts in step with
/// the fleet.
pub struct PolicyRegistry<B> {
    default: PolicyConfig,
    per_model: RwLock<HashMap<Box<str>, PolicyConfig>>,
    factories: RwLock<HashMap<String, PolicyFactory<B>>>,
    instances: RwLock<HashMap<Box<str>, Arc<ModelPolicy<B>>>>,
    /// Lock order: `members`, then `instances`.
    members: Mutex<Vec<Arc<str>>>,
}

impl<B> fmt::Debug for PolicyRegistry<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyRegistry")
            .field("default", &self.default)
            .field("models", &self.instances.read().len())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> PolicyRegistry<B> {
    /// A registry whose models use `default` unless configured otherwise.
    /// Fails if `default` names no built-in policy or has invalid knobs
    /// (register custom factories first and use
    /// [`with_factory`](Self::with_factory) to default to one).
    pub fn new(default: PolicyConfig) -> Result<Self, PolicyError> {
        build_builtin::<B>(&default)?;
        Ok(Self::unchecked(default))
    }

    /// A registry defaulting to a custom policy built by `factory` under
    /// `name`.
    pub fn with_factory(name: &str, factory: PolicyFactory<B>) -> Result<Self, PolicyError> {
        let default = PolicyConfig::named(name);
        factory(&default)?;
        let registry = Self::unchecked(default);
        registry.factories.write().insert(name.to_owned(), factory);
        Ok(registry)
    }

    fn unchecked(default: PolicyConfig) -> Self {
        PolicyRegistry {
            default,
            per_model: RwLock::new(HashMap::new()),
            factories: RwLock::new(HashMap::new()),
            instances: RwLock::new(HashMap::new()),
            members: Mutex::new(Vec::new()),
        }
    }

    /// Registers (or replaces) a custom policy factory under `name`; a
    /// custom name shadows a built-in one.
    pub fn register_factory(&self, name: impl Into<String>, factory: PolicyFactory<B>) {
        self.factories.write().insert(name.into(), factory);
    }

    /// Uses `config` for `model` from now on. The configuration is checked
    /// by building it once; an existing instance for the model is replaced
    /// (its learned state, such as a cache tree, starts over).
    pub fn set_model_config(&self, model: &str, config: PolicyConfig) -> Result<(), PolicyError> {
        let members = self.members.lock();
        let policy = self.build(&config, &members)?;
        self.per_model.write().insert(model.into(), config);
        self.instances.write().insert(model.into(), policy);
        Ok(())
    }

    fn build(
        &self,
        config: &PolicyConfig,
        members: &[Arc<str>],
    ) -> Result<Arc<ModelPolicy<B>>, PolicyError> {
        let factory = self.factories.read().get(&config.name).cloned();
        let policy = match factory {
            Some(factory) => factory(config)?,
            None => build_builtin::<B>(config)?,
        };
        for key in members {
            policy.on_membership(MembershipEvent::Added { key });
        }
        Ok(Arc::new(Counted::new(policy)))
    }

    /// The policy instance for `model`, created on first use.
    pub fn policy(&self, model: &str) -> Result<Arc<ModelPolicy<B>>, PolicyError> {
        if let Some(policy) = self.instances.read().get(model) {
            return Ok(Arc::clone(policy));
        }
        let members = self.members.lock();
        if let Some(policy) = self.instances.read().get(model) {
            return Ok(Arc::clone(policy));
        }
        let config = self
            .per_model
            .read()
            .get(model)
            .cloned()
            .unwrap_or_else(|| self.default.clone());
        let policy = self.build(&config, &members)?;
        self.instances
            .write()
            .insert(model.into(), Arc::clone(&policy));
        Ok(policy)
    }

    /// Drops `model`'s instance (and its learned state, such as a cache
    /// tree). Returns whether there was one. Every distinct model id the
    /// host routes creates an instance, so hosts validate model ids (or
    /// remove the ones they stop serving).
    pub fn remove_model(&self, model: &str) -> bool {
        self.instances.write().remove(model).is_some()
    }

    /// Selects with the policy of `ctx.model`.
    pub fn select(
        &self,
        candidates: &[B],
        ctx: &RequestContext<'_>,
    ) -> Result<Option<Decision>, PolicyError> {
        Ok(self.policy(ctx.model)?.select(candidates, ctx))
    }

    /// Records a membership change and forwards it to every instance.
    pub fn on_membership(&self, event: MembershipEvent<'_>) {
        let mut members = self.members.lock();
        let key = event.key();
        let position = members.iter().position(|k| &**k == key);
        match (event, position) {
            (MembershipEvent::Added { .. }, None) => members.push(key.into()),
            (MembershipEvent::Removed { .. }, Some(i)) => {
                members.remove(i);
            }
            _ => {}
        }
        for policy in self.instances.read().values() {
            policy.on_membership(event);
        }
    }

    /// Runs every instance's periodic upkeep (cache-aware eviction). Call
    /// it from the host's timer.
    pub fn maintain(&self) {
        let policies: Vec<_> = self.instances.read().values().cloned().collect();
        for policy in policies {
            policy.maintain();
        }
    }

    /// `(model, worker key, symbols held)` for every instance that keeps
    /// prefix affinity (cache-aware), sorted: the host's tree-size metric.
    pub fn affinity_sizes(&self) -> Vec<(String, Arc<str>, usize)> {
        let mut out: Vec<_> = self
            .instances
            .read()
            .iter()
            .flat_map(|(model, policy)| {
                policy
                    .affinity_sizes()
                    .into_iter()
                    .map(move |(key, size)| (model.to_string(), key, size))
            })
            .collect();
        out.sort();
        out
    }

    /// `(model, stats)` of every instance's prefix trees, sorted by model
    /// and kind of tree: the host's tree memory metrics.
    pub fn tree_stats(&self) -> Vec<(String, TreeStats)> {
        let mut out: Vec<_> = self
            .instances
            .read()
            .iter()
            .flat_map(|(model, policy)| {
                policy
                    .tree_stats()
                    .into_iter()
                    .map(move |stats| (model.to_string(), stats))
            })
            .collect();
        out.sort_by(|a, b| (&a.0, a.1.kind).cmp(&(&b.0, b.1.kind)));
        out
    }

    /// `(model, policy name, counts)` for every instance, sorted by model:
    /// what the host exports as metrics.
    pub fn counts(&self) -> Vec<(String, String, DecisionCounts)> {
        let mut out: Vec<_> = self
            .instances
            .read()
            .iter()
            .map(|(model, p)| (model.to_string(), p.name().to_owned(), p.counts()))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}
