//! Embedding lb-policies in a custom proxy: the proxy's own worker type, a
//! built-in cache-aware policy, and a custom policy registered by name.
//!
//! ```text
//! cargo run -p lb-policies --example policy_plugin
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use lb_policies::{
    Backend, Decision, DecisionReason, MembershipEvent, Policy, PolicyConfig, PolicyError,
    PolicyRegistry, PolicyState, RequestContext,
};

/// The proxy's worker: whatever it already tracks, plus the four reads the
/// policies need.
struct Upstream {
    url: String,
    zone: &'static str,
    in_flight: AtomicUsize,
    served: AtomicU64,
    healthy: AtomicBool,
}

impl Backend for Upstream {
    fn key(&self) -> &str {
        &self.url
    }
    fn load(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }
    fn processed(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }
    fn is_available(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
}

/// A custom policy: least loaded within a preferred zone, any zone if the
/// preferred one has nothing available.
struct ZoneFirst {
    zone: &'static str,
}

impl PolicyState for ZoneFirst {
    fn name(&self) -> &str {
        "zone_first"
    }
}

impl Policy<Arc<Upstream>> for ZoneFirst {
    fn select(&self, candidates: &[Arc<Upstream>], _ctx: &RequestContext<'_>) -> Option<Decision> {
        let best = |in_zone: bool| {
            candidates
                .iter()
                .enumerate()
                .filter(|(_, u)| u.is_available() && (!in_zone || u.zone == self.zone))
                .min_by_key(|(_, u)| (u.load(), u.processed()))
                .map(|(i, _)| i)
        };
        best(true)
            .or_else(|| best(false))
            .map(|i| Decision::new(i, DecisionReason::Custom))
    }
}

fn main() -> Result<(), PolicyError> {
    let fleet: Vec<Arc<Upstream>> = [
        ("http://a:8000", "eu"),
        ("http://b:8000", "us"),
        ("http://c:8000", "eu"),
    ]
    .into_iter()
    .map(|(url, zone)| {
        Arc::new(Upstream {
            url: url.to_owned(),
            zone,
            in_flight: AtomicUsize::new(0),
            served: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
        })
    })
    .collect();

    let registry = PolicyRegistry::<Arc<Upstream>>::new(PolicyConfig::named("cache_aware"))?;
    registry.register_factory(
        "zone_first",
        Arc::new(|_config| Ok(Box::new(ZoneFirst { zone: "eu" }))),
    );
    registry.set_model_config("embeddings", PolicyConfig::named("zone_first"))?;
    for u in &fleet {
        registry.on_membership(MembershipEvent::Added { key: u.key() });
    }

    let prompt = "You are a travel assistant. Plan a weekend in Lisbon.";
    for (model, text) in [
        ("chat", prompt),
        ("chat", prompt),
        ("embeddings", "hello"),
        ("embeddings", "world"),
    ] {
        let ctx = RequestContext::new(model).with_text(text);
        let Some(d) = registry.select(&fleet, &ctx)? else {
            println!("{model}: no worker available");
            continue;
        };
        let chosen = &fleet[d.index];
        // The proxy's own accounting (a real proxy releases on completion).
        chosen.in_flight.fetch_add(1, Ordering::Relaxed);
        chosen.served.fetch_add(1, Ordering::Relaxed);
        println!("{model:<10} -> {} ({})", chosen.url, d.reason);
    }
    for (model, policy, counts) in registry.counts() {
        let nonzero: Vec<String> = counts
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(r, n)| format!("{r}={n}"))
            .collect();
        println!("{model}: {policy} {}", nonzero.join(" "));
    }
    Ok(())
}
