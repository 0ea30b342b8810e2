//! One policy instance per model id, built by name.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::backend::Backend;
use crate::context::{RequestContext, RoutingInput};
use crate::decision::{Decision, DecisionCounts};
use crate::error::PolicyError;
use crate::membership::MembershipEvent;
use crate::policies::cache_aware::{CacheAware, CacheAwareConfig, LoadGate, TokenChoice};
use crate::policies::consistent_hash::{ConsistentHash, ConsistentHashConfig};
use crate::policies::least_loaded::LeastLoaded;
use crate::policies::power_of_two::PowerOfTwo;
use crate::policies::random::RandomPolicy;
use crate::policies::rendezvous::RendezvousHash;
use crate::policies::round_robin::RoundRobin;
use crate::policy::{Counted, Policy, PolicyState, TreeStats};
use crate::sync::{Mutex, RwLock};

/// The built-in policy names, as on the command line.
pub const BUILTIN_POLICIES: [&str; 9] = [
    "random",
    "round_robin",
    "power_of_two",
    "least_loaded",
    "consistent_hash",
    "rendezvous_hash",
    "cache_aware",
    "cache_aware_cost",
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
    /// Knobs of `cache_aware` / `cache_aware_cost` / `cache_aware_fleet_gate`
    /// (the second forces [`TokenChoice::Cost`], the third
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
        "cache_aware" | "cache_aware_cost" | "cache_aware_fleet_gate" => {
            let mut knobs = config.cache_aware.clone();
            match config.name.as_str() {
                "cache_aware_cost" => knobs.token_choice = TokenChoice::Cost,
                "cache_aware_fleet_gate" => knobs.gate = LoadGate::FleetWide,
                _ => {}
            }
            Box::new(match config.seed {
                Some(seed) => CacheAware::with_seed(knobs, seed)?,
                None => CacheAware::new(knobs)?,
            })
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

/// Instances created on first use that a registry keeps at most, by
/// default (see [`PolicyRegistry::set_max_models`]).
pub const DEFAULT_MAX_MODELS: usize = 256;

/// One model's instance with what its eviction needs.
struct Instance<B> {
    policy: Arc<ModelPolicy<B>>,
    /// Milliseconds since the registry's epoch at the last use (stored only
    /// when it changed, so a hot model's line is written once a
    /// millisecond at most).
    last_used: AtomicU64,
    /// Made by [`PolicyRegistry::set_model_config`]: never evicted.
    configured: bool,
}

/// Keeps one policy instance per model id.
///
/// Instances are created on a model's first use from the model's
/// configuration (or the default one), by built-in name or by a factory
/// registered with [`register_factory`](Self::register_factory). The
/// registry also tracks fleet membership: [`on_membership`](Self::on_membership)
/// forwards each event to every instance, and a new instance is first told
/// about every current member, so a policy created late starts in step with
/// the fleet.
///
/// The model id comes from the request, so a client can name as many
/// models as it likes; when the workers do not say which models they serve,
/// nothing else stops it. Instances created on first use are therefore
/// bounded ([`set_max_models`](Self::set_max_models), default
/// [`DEFAULT_MAX_MODELS`]): the one a new model would exceed the bound
/// with replaces the least recently used of them (its learned state, such
/// as a cache tree, is dropped). Models given a configuration of their own
/// are never evicted.
pub struct PolicyRegistry<B> {
    default: PolicyConfig,
    per_model: RwLock<HashMap<Box<str>, PolicyConfig>>,
    factories: RwLock<HashMap<String, PolicyFactory<B>>>,
    instances: RwLock<HashMap<Box<str>, Instance<B>>>,
    /// Lock order: `members`, then `instances`.
    members: Mutex<Vec<Arc<str>>>,
    max_models: AtomicU64,
    evicted: AtomicU64,
    epoch: Instant,
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
            max_models: AtomicU64::new(DEFAULT_MAX_MODELS as u64),
            evicted: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    /// Keeps at most `max` instances created on first use (at least one):
    /// see the type's docs. Lowering it evicts at the next new model.
    pub fn set_max_models(&self, max: usize) {
        self.max_models.store(max.max(1) as u64, Ordering::Relaxed);
    }

    /// Instances evicted to stay within [`set_max_models`](Self::set_max_models).
    pub fn evicted_models(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn instance(&self, policy: Arc<ModelPolicy<B>>, configured: bool) -> Instance<B> {
        Instance {
            policy,
            last_used: AtomicU64::new(self.now_ms()),
            configured,
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
        let instance = self.instance(policy, true);
        self.instances.write().insert(model.into(), instance);
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
        if let Some(policy) = self.used(model) {
            return Ok(policy);
        }
        let members = self.members.lock();
        if let Some(policy) = self.used(model) {
            return Ok(policy);
        }
        let config = self.per_model.read().get(model).cloned();
        let configured = config.is_some();
        let config = config.unwrap_or_else(|| self.default.clone());
        let policy = self.build(&config, &members)?;
        let instance = self.instance(Arc::clone(&policy), configured);
        let mut instances = self.instances.write();
        if !configured {
            self.make_room(&mut instances);
        }
        instances.insert(model.into(), instance);
        Ok(policy)
    }

    /// `model`'s instance, its use recorded.
    fn used(&self, model: &str) -> Option<Arc<ModelPolicy<B>>> {
        let instances = self.instances.read();
        let instance = instances.get(model)?;
        let now = self.now_ms();
        if instance.last_used.load(Ordering::Relaxed) != now {
            instance.last_used.store(now, Ordering::Relaxed);
        }
        Some(Arc::clone(&instance.policy))
    }

    /// Evicts the least recently used instances created on first use until
    /// one more fits within the bound.
    fn make_room(&self, instances: &mut HashMap<Box<str>, Instance<B>>) {
        let max = usize::try_from(self.max_models.load(Ordering::Relaxed)).unwrap_or(usize::MAX);
        loop {
            let mut automatic = instances.iter().filter(|(_, i)| !i.configured);
            if automatic.clone().count() < max {
                return;
            }
            let Some(oldest) = automatic
                .by_ref()
                .min_by_key(|(_, i)| i.last_used.load(Ordering::Relaxed))
                .map(|(model, _)| model.clone())
            else {
                return;
            };
            instances.remove(&oldest);
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Hands a choice another router replica made to `model`'s instance
    /// ([`PolicyState::learn_choice`]), if this registry has one: a peer
    /// never creates an instance. Returns whether it was recorded.
    pub fn learn_choice(&self, model: &str, input: RoutingInput<'_>, worker: &str) -> bool {
        let policy = self
            .instances
            .read()
            .get(model)
            .map(|i| Arc::clone(&i.policy));
        policy.is_some_and(|p| p.learn_choice(model, input, worker))
    }

    /// Drops `model`'s instance (and its learned state, such as a cache
    /// tree). Returns whether there was one. Every distinct model id the
    /// host routes creates an instance, up to the bound the type's docs
    /// describe; hosts that know their models validate model ids, or
    /// remove the ones they stop serving.
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
        for instance in self.instances.read().values() {
            instance.policy.on_membership(event);
        }
    }

    /// Runs every instance's periodic upkeep (cache-aware eviction). Call
    /// it from the host's timer.
    pub fn maintain(&self) {
        let policies: Vec<_> = self
            .instances
            .read()
            .values()
            .map(|i| Arc::clone(&i.policy))
            .collect();
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
            .flat_map(|(model, instance)| {
                instance
                    .policy
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
            .flat_map(|(model, instance)| {
                instance
                    .policy
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
            .map(|(model, i)| {
                let p = &i.policy;
                (model.to_string(), p.name().to_owned(), p.counts())
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

#[cfg(all(test, not(loom)))]
mod bound_tests {
    use super::*;
    use crate::backend::BasicBackend;
    use crate::context::RequestContext;

    /// A request for `model` with a short prompt.
    fn select(registry: &PolicyRegistry<Arc<BasicBackend>>, model: &str) {
        let workers = vec![Arc::new(BasicBackend::new("http://w1"))];
        let ctx = RequestContext::new(model).with_text("hello");
        registry.select(&workers, &ctx).expect("selects");
    }

    fn models(registry: &PolicyRegistry<Arc<BasicBackend>>) -> Vec<String> {
        registry.counts().into_iter().map(|(m, _, _)| m).collect()
    }

    #[test]
    fn models_named_by_clients_are_bounded_and_the_least_recently_used_goes() {
        let registry = PolicyRegistry::new(PolicyConfig::named("cache_aware")).unwrap();
        registry.set_max_models(2);
        select(&registry, "a");
        std::thread::sleep(std::time::Duration::from_millis(3));
        select(&registry, "b");
        std::thread::sleep(std::time::Duration::from_millis(3));
        select(&registry, "a");
        std::thread::sleep(std::time::Duration::from_millis(3));
        select(&registry, "c");
        assert_eq!(models(&registry), ["a", "c"]);
        assert_eq!(registry.evicted_models(), 1);
        // A stream of new names never grows the registry past the bound.
        for i in 0..100 {
            select(&registry, &format!("x{i}"));
        }
        assert_eq!(models(&registry).len(), 2);
        assert_eq!(registry.evicted_models(), 101);
    }

    #[test]
    fn configured_models_are_never_evicted_nor_counted() {
        let registry = PolicyRegistry::new(PolicyConfig::named("round_robin")).unwrap();
        registry.set_max_models(1);
        registry
            .set_model_config("kept", PolicyConfig::named("cache_aware"))
            .unwrap();
        select(&registry, "kept");
        for i in 0..10 {
            select(&registry, &format!("x{i}"));
        }
        assert_eq!(models(&registry), ["kept", "x9"]);
        assert_eq!(registry.evicted_models(), 9);
    }
}
