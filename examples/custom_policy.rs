//! A new load-balancing policy, registered by name and used by the
//! reference router through the library API.
//!
//! The policy, **least loaded among the top-k prefix owners**, asks its own
//! `radix-affinity` tree how much of the prompt each candidate holds, keeps
//! the `k` candidates holding the most (workers holding nothing fill the
//! remaining places, least loaded first), and sends the request to the
//! least loaded of them — at equal load, the one holding more. Where
//! built-in `cache_aware` honours one owner unless it is overloaded by a
//! margin, this spreads a hot prefix over `k` warm workers as soon as its
//! owner is busier than the runner-up. Without routing text it is plain
//! least loaded.
//!
//! The steps a policy author takes:
//!
//! 1. implement `lb_policies::PolicyState` (name, membership, upkeep) and
//!    `lb_policies::Policy<B>` for every `B: Backend`;
//! 2. `PolicyRegistry::register_factory("top_k_least_loaded", ...)` and
//!    choose it for a model with `set_model_config`;
//! 3. hand the registry to `router_http::Router::with_policies`.
//!
//! It then starts four `engine-sim` engines (no simulated latency), sends
//! multi-turn conversations through `Router::handle` in-process, prints
//! where they went and the engines' prefix-cache hit rates, checks them,
//! and exits (status 0 when every check passed).
//!
//! Run: `cargo run --release --example custom_policy`
use std::error::Error;
use std::sync::Arc;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use lb_policies::{
    Backend, Decision, DecisionReason, MembershipEvent, Policy, PolicyConfig, PolicyError,
    PolicyRegistry, PolicyState, RequestContext, RoutingInput,
};
use radix_affinity::TextTree;
use router_http::{Router, RouterConfig};
use worker_lifecycle::Worker;

type BoxError = Box<dyn Error + Send + Sync>;

const POLICY_NAME: &str = "top_k_least_loaded";
const MODEL: &str = "sim-model";

/// Least loaded among the `k` candidates holding the longest prefix of the
/// request. One instance serves one model (the registry creates one per
/// model), so one tree is enough.
struct TopKLeastLoaded {
    k: usize,
    /// Cached characters each worker may keep in the tree after upkeep.
    budget_per_worker: usize,
    tree: TextTree,
}

impl TopKLeastLoaded {
    fn new(k: usize, budget_per_worker: usize) -> Result<Self, PolicyError> {
        if k == 0 {
            return Err(PolicyError::InvalidConfig {
                field: "k",
                reason: "must be at least 1".into(),
            });
        }
        Ok(TopKLeastLoaded {
            k,
            budget_per_worker,
            tree: TextTree::new(),
        })
    }
}

impl PolicyState for TopKLeastLoaded {
    fn name(&self) -> &str {
        POLICY_NAME
    }

    fn on_membership(&self, event: MembershipEvent<'_>) {
        match event {
            MembershipEvent::Added { key } => {
                self.tree.intern(key);
            }
            // A departed worker's cache is gone: forget its affinity.
            MembershipEvent::Removed { key } => {
                if let Some(tenant) = self.tree.tenant_id(key) {
                    self.tree.remove_tenant(tenant);
                }
            }
            // MembershipEvent is non-exhaustive: ignore what we do not know.
            _ => {}
        }
    }

    fn maintain(&self) {
        self.tree.evict_tenant_by_size(self.budget_per_worker);
    }
}

impl<B: Backend> Policy<B> for TopKLeastLoaded {
    fn select(&self, candidates: &[B], ctx: &RequestContext<'_>) -> Option<Decision> {
        let text = match ctx.routing {
            RoutingInput::Text(text) => Some(text),
            _ => None,
        };
        // Rank the available candidates by how much of the prompt they hold
        // (ties: less loaded first), keep the best k, take the least loaded
        // of those. Workers holding nothing fill the remaining places, so a
        // hot prefix spills onto a second worker when its owner is busy.
        // One small vector per decision: the walk per candidate (one shard
        // read lock each) costs more; a production policy over hundreds of
        // workers would keep the top k in a fixed array.
        let mut ranked: Vec<(usize, usize)> = candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_available())
            .map(|(i, c)| {
                let held = match (text, self.tree.tenant_id(c.key())) {
                    (Some(text), Some(tenant)) => self.tree.prefix_match_tenant(text, tenant),
                    _ => 0,
                };
                (held, i)
            })
            .collect();
        ranked.sort_unstable_by_key(|&(held, i)| {
            (
                std::cmp::Reverse(held),
                candidates[i].load(),
                candidates[i].processed(),
            )
        });
        ranked.truncate(self.k);
        let &(_, index) = ranked
            .iter()
            .min_by_key(|&&(held, i)| (candidates[i].load(), std::cmp::Reverse(held)))?;
        if let Some(text) = text {
            // The chosen worker's cache now holds this prompt.
            self.tree
                .insert(text, self.tree.intern(candidates[index].key()));
        }
        Some(Decision::new(index, DecisionReason::Custom))
    }
}

fn chat(system: &str, turns: &[String]) -> Request<Full<Bytes>> {
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    for turn in turns {
        messages.push(serde_json::json!({"role": "user", "content": turn}));
    }
    let body = serde_json::json!({"model": MODEL, "messages": messages, "max_tokens": 4});
    Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("a valid request")
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // 1-2. Register the policy by name and choose it for the model; other
    //      models keep the registry's default (cache_aware).
    let policies = PolicyRegistry::<Arc<Worker>>::new(PolicyConfig::named("cache_aware"))?;
    policies.register_factory(
        POLICY_NAME,
        Arc::new(|_config: &PolicyConfig| {
            Ok(Box::new(TopKLeastLoaded::new(2, 1 << 20)?) as Box<dyn Policy<Arc<Worker>>>)
        }),
    );
    policies.set_model_config(MODEL, PolicyConfig::named(POLICY_NAME))?;

    // 3. The reference router, selecting with that registry.
    let router = Router::with_policies(RouterConfig::default(), policies)?;
    let mut engines = Vec::new();
    for _ in 0..4 {
        let engine = engine_sim::spawn(
            engine_sim::EngineConfig::instant(),
            engine_sim::ServeOptions::default(),
        )
        .await?;
        router.add_worker(&engine.url(), None, Some(MODEL))?;
        engines.push(engine);
    }

    // Six conversations over two long system prompts, four turns each.
    let systems = [
        "You are a meticulous code reviewer. Point out bugs first. ".repeat(12),
        "You are a travel agent. Suggest trains before flights. ".repeat(12),
    ];
    let conversations = 6;
    let turns = 4;
    let mut served_by: Vec<Vec<String>> = vec![Vec::new(); conversations];
    let mut requests = 0u64;
    for turn in 0..turns {
        // The conversations' turns arrive together, so loads overlap and the
        // policy has a reason to spill a busy owner's prefix onto another.
        let mut in_flight = Vec::new();
        for c in 0..conversations {
            let history: Vec<String> = (0..=turn)
                .map(|t| format!("Conversation {c}, question {t}: what next?"))
                .collect();
            let request = chat(&systems[c % systems.len()], &history);
            let router = router.clone();
            in_flight.push(tokio::spawn(async move {
                let response = router.handle(request).await;
                let status = response.status();
                let engine = response
                    .headers()
                    .get("x-worker-id")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("?")
                    .to_owned();
                let body = response.into_body().collect().await?.to_bytes();
                if !status.is_success() {
                    return Err(
                        format!("status {status}: {}", String::from_utf8_lossy(&body)).into(),
                    );
                }
                Ok::<_, BoxError>(engine)
            }));
        }
        for (served, task) in served_by.iter_mut().zip(in_flight) {
            served.push(task.await??);
            requests += 1;
        }
    }
    router.policies().maintain();

    for (c, engines) in served_by.iter().enumerate() {
        println!("conversation {c}: {}", engines.join(" -> "));
    }
    let mut hits = 0u64;
    let mut queries = 0u64;
    for engine in &engines {
        let stats = engine.stats();
        hits += stats.prefix_cache_hits;
        queries += stats.prefix_cache_queries;
        println!(
            "{}: {} requests, prefix cache hit rate {:.0}%",
            engine.engine_id(),
            stats.requests_finished,
            100.0 * stats.prefix_cache_hits as f64 / stats.prefix_cache_queries.max(1) as f64
        );
    }
    let counts = router.policies().policy(MODEL)?.counts();
    println!(
        "policy `{POLICY_NAME}` decided {} of {requests} requests; overall prefix cache hit rate {:.0}%",
        counts.get(DecisionReason::Custom),
        100.0 * hits as f64 / queries.max(1) as f64
    );

    // What the output claims, checked.
    if counts.get(DecisionReason::Custom) != requests {
        return Err("the custom policy did not decide every request".into());
    }
    let busy = engines
        .iter()
        .filter(|e| e.stats().requests_finished > 0)
        .count();
    if busy < 2 {
        return Err("the policy should spread the conversations over several engines".into());
    }
    if hits * 2 < queries {
        return Err("most prompt tokens should come from the engines' prefix caches".into());
    }
    let leftover: usize = router.workers().iter().map(|w| w.load()).sum();
    if leftover != 0 {
        return Err(format!("{leftover} requests still counted as in flight").into());
    }
    for engine in engines {
        engine.shutdown().await;
    }
    println!("ok: every check passed");
    Ok(())
}
