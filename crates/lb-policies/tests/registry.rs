//! The registry: one instance per model, by name, with membership replay,
//! custom factories and counters.

mod common;

use std::sync::Arc;

use common::{fleet, key};
use lb_policies::{
    BUILTIN_POLICIES, Backend, BasicBackend, ConsistentHashConfig, Decision, DecisionReason,
    MembershipEvent, Policy, PolicyConfig, PolicyError, PolicyFactory, PolicyRegistry, PolicyState,
    RequestContext,
};

#[test]
fn every_builtin_name_builds_and_reports_its_name() {
    let fleet = fleet(4);
    for name in BUILTIN_POLICIES {
        let registry = PolicyRegistry::<BasicBackend>::new(PolicyConfig::named(name).with_seed(3))
            .expect(name);
        let policy = registry.policy("m").expect("builds");
        assert_eq!(policy.name(), name);
        let ctx = RequestContext::new("m")
            .with_text("hello")
            .with_session("s");
        let d = registry
            .select(&fleet, &ctx)
            .expect("builds")
            .expect("available");
        assert!(d.index < fleet.len());
    }
}

#[test]
fn unknown_names_and_bad_knobs_are_errors() {
    let err = PolicyRegistry::<BasicBackend>::new(PolicyConfig::named("fastest")).unwrap_err();
    assert!(matches!(err, PolicyError::UnknownPolicy { ref name, .. } if name == "fastest"));
    assert!(err.to_string().contains("round_robin"), "{err}");
    let mut bad = PolicyConfig::named("consistent_hash");
    bad.consistent_hash = ConsistentHashConfig::default().with_virtual_nodes(0);
    assert!(matches!(
        PolicyRegistry::<BasicBackend>::new(bad.clone()),
        Err(PolicyError::InvalidConfig {
            field: "virtual_nodes",
            ..
        })
    ));
    let registry = PolicyRegistry::<BasicBackend>::new(PolicyConfig::default()).expect("valid");
    assert!(registry.set_model_config("m", bad).is_err());
    assert_eq!(
        registry.policy("m").expect("default still applies").name(),
        "cache_aware"
    );
}

#[test]
fn one_instance_per_model() {
    let registry =
        PolicyRegistry::<BasicBackend>::new(PolicyConfig::named("round_robin")).expect("valid");
    let a1 = registry.policy("a").expect("builds");
    let a2 = registry.policy("a").expect("builds");
    let b = registry.policy("b").expect("builds");
    assert!(Arc::ptr_eq(&a1, &a2));
    assert!(!Arc::ptr_eq(&a1, &b));
    assert!(registry.remove_model("b"));
    assert!(!registry.remove_model("b"));
    assert!(!Arc::ptr_eq(&b, &registry.policy("b").expect("rebuilt")));
    // Separate round-robin counters per model.
    let fleet = fleet(3);
    let pick = |m| {
        registry
            .select(&fleet, &RequestContext::new(m))
            .expect("ok")
            .expect("up")
            .index
    };
    assert_eq!([pick("a"), pick("a"), pick("b")], [0, 1, 0]);
}

#[test]
fn per_model_config_overrides_the_default() {
    let registry =
        PolicyRegistry::<BasicBackend>::new(PolicyConfig::named("random")).expect("valid");
    registry
        .set_model_config("chat", PolicyConfig::named("least_loaded"))
        .expect("valid");
    assert_eq!(
        registry.policy("chat").expect("builds").name(),
        "least_loaded"
    );
    assert_eq!(registry.policy("embed").expect("builds").name(), "random");
}

#[test]
fn membership_is_forwarded_and_replayed_to_late_instances() {
    let fleet = fleet(3);
    let registry =
        PolicyRegistry::<BasicBackend>::new(PolicyConfig::named("consistent_hash")).expect("valid");
    let early = registry.policy("early").expect("builds");
    for b in &fleet {
        registry.on_membership(MembershipEvent::Added { key: b.key() });
    }
    registry.on_membership(MembershipEvent::Removed { key: &key(2) });
    let late = registry.policy("late").expect("builds");
    let ctx = |m| RequestContext::new(m).with_session("sticky");
    for (model, policy) in [("early", &early), ("late", &late)] {
        let d = policy.select(&fleet[..], &ctx(model)).expect("available");
        assert_eq!(d.reason, DecisionReason::HashOwner, "{model} has a ring");
        assert_ne!(d.index, 2, "{model} still has the removed worker");
    }
    assert_eq!(
        early.select(&fleet[..], &ctx("early")).map(|d| d.index),
        late.select(&fleet[..], &ctx("late")).map(|d| d.index),
    );
}

#[test]
fn cache_aware_instance_knows_the_fleet_from_the_first_request() {
    let fleet = fleet(3);
    let registry =
        PolicyRegistry::<BasicBackend>::new(PolicyConfig::named("cache_aware")).expect("valid");
    for b in &fleet {
        registry.on_membership(MembershipEvent::Added { key: b.key() });
    }
    let text = "a system prompt that will be reused ".repeat(5);
    let ctx = RequestContext::new("llama").with_text(&text);
    let first = registry.select(&fleet, &ctx).expect("ok").expect("up");
    let second = registry.select(&fleet, &ctx).expect("ok").expect("up");
    assert_eq!(
        (second.index, second.reason),
        (first.index, DecisionReason::CacheHit)
    );
    registry.on_membership(MembershipEvent::Removed {
        key: &key(first.index),
    });
    let rest: Vec<BasicBackend> = (0..3)
        .filter(|&i| i != first.index)
        .map(|i| BasicBackend::new(key(i)))
        .collect();
    let third = registry.select(&rest, &ctx).expect("ok").expect("up");
    assert_eq!(third.reason, DecisionReason::CacheLowMatch);
}

/// Chat routing texts all begin with a role, which the default
/// `text_roots` spread over shards of their own: routing is what it is
/// without them (a repeat is a cache hit on the same worker, a text that
/// shares only the role is a low match), and bad roots are a config error.
#[test]
fn chat_texts_under_the_default_roots_route_as_without_them() {
    let fleet = fleet(3);
    let with_roots = PolicyConfig::named("cache_aware");
    assert_eq!(
        with_roots.cache_aware.text_roots,
        lb_policies::CHAT_ROLE_ROOTS.map(String::from)
    );
    let mut without_roots = PolicyConfig::named("cache_aware");
    without_roots.cache_aware.text_roots.clear();
    let conversation = format!(
        "system: {}\nuser: Hi there\n",
        "You answer briefly and politely. ".repeat(8)
    );
    let follow_up = format!("{conversation}assistant: Hello!\nuser: And now?\n");
    let other = "user: something else entirely, and long enough to count\n";
    let mut decisions = Vec::new();
    for config in [with_roots, without_roots] {
        let registry = PolicyRegistry::<BasicBackend>::new(config).expect("valid");
        for b in &fleet {
            registry.on_membership(MembershipEvent::Added { key: b.key() });
        }
        let select = |text: &str| {
            let ctx = RequestContext::new("llama").with_text(text);
            let d = registry.select(&fleet, &ctx).expect("ok").expect("up");
            (d.index, d.reason)
        };
        let first = select(&conversation);
        let again = select(&follow_up);
        assert_eq!(again, (first.0, DecisionReason::CacheHit));
        let unrelated = select(other);
        assert_eq!(unrelated.1, DecisionReason::CacheLowMatch);
        decisions.push((first, again, unrelated));
    }
    assert_eq!(decisions[0], decisions[1], "roots change no decision");

    for roots in [vec!["user: ", "user"], vec![""], vec!["r"; 9]] {
        let mut bad = PolicyConfig::named("cache_aware");
        bad.cache_aware.text_roots = roots.iter().map(|r| r.to_string()).collect();
        assert!(
            matches!(
                PolicyRegistry::<BasicBackend>::new(bad),
                Err(PolicyError::InvalidConfig {
                    field: "text_roots",
                    ..
                })
            ),
            "{roots:?}"
        );
    }
}

/// A custom policy: always the last available candidate.
struct LastAvailable;

impl PolicyState for LastAvailable {
    fn name(&self) -> &str {
        "last_available"
    }
}

impl<B: Backend> Policy<B> for LastAvailable {
    fn select(&self, candidates: &[B], _ctx: &RequestContext<'_>) -> Option<Decision> {
        let i = candidates.iter().rposition(|c| c.is_available())?;
        Some(Decision::new(i, DecisionReason::Custom))
    }
}

#[test]
fn custom_factories_are_built_by_name_and_counted() {
    let factory: PolicyFactory<BasicBackend> = Arc::new(|_config| Ok(Box::new(LastAvailable)));
    let registry =
        PolicyRegistry::<BasicBackend>::new(PolicyConfig::named("random")).expect("valid");
    registry.register_factory("last_available", factory.clone());
    registry
        .set_model_config("m", PolicyConfig::named("last_available"))
        .expect("registered");
    let fleet = fleet(3);
    fleet[2].set_available(false);
    for _ in 0..5 {
        let d = registry
            .select(&fleet, &RequestContext::new("m"))
            .expect("ok")
            .expect("up");
        assert_eq!(d, Decision::new(1, DecisionReason::Custom));
    }
    for b in &fleet {
        b.set_available(false);
    }
    assert_eq!(
        registry
            .select(&fleet, &RequestContext::new("m"))
            .expect("ok"),
        None
    );
    let counts = registry.counts();
    assert_eq!(counts.len(), 1);
    let (model, name, c) = &counts[0];
    assert_eq!((model.as_str(), name.as_str()), ("m", "last_available"));
    assert_eq!(
        (c.get(DecisionReason::Custom), c.no_candidate(), c.total()),
        (5, 1, 5)
    );

    let custom_default = PolicyRegistry::with_factory("last_available", factory).expect("builds");
    assert_eq!(
        custom_default.policy("x").expect("builds").name(),
        "last_available"
    );
}

#[test]
fn counters_track_reasons_per_model() {
    let registry =
        PolicyRegistry::<BasicBackend>::new(PolicyConfig::named("rendezvous_hash")).expect("valid");
    let fleet = fleet(2);
    registry
        .select(&fleet, &RequestContext::new("m").with_user("u"))
        .expect("ok");
    registry
        .select(&fleet, &RequestContext::new("m"))
        .expect("ok");
    registry
        .select(&fleet, &RequestContext::new("m"))
        .expect("ok");
    let c = registry.policy("m").expect("built").counts();
    assert_eq!(c.get(DecisionReason::HashOwner), 1);
    assert_eq!(c.get(DecisionReason::NoHashKey), 2);
    registry.maintain(); // stateless policies: a no-op that must not fail
}

/// `kv_aware` is named in the unknown-policy message, and without the
/// `kv-block-index` feature asking for it says which feature is missing.
#[test]
fn kv_aware_is_known_and_its_feature_is_named() {
    let err = PolicyRegistry::<BasicBackend>::new(PolicyConfig::named("no_such_policy"))
        .expect_err("unknown");
    assert!(err.to_string().contains("kv_aware"), "{err}");
    let kv = PolicyRegistry::<BasicBackend>::new(PolicyConfig::named("kv_aware"));
    let err = kv.expect_err("needs the host's index");
    if cfg!(feature = "kv-block-index") {
        assert!(
            matches!(err, PolicyError::InvalidConfig { field: "kv", .. }),
            "{err}"
        );
    } else {
        assert!(
            matches!(err, PolicyError::InvalidConfig { field: "name", .. }),
            "{err}"
        );
        assert!(err.to_string().contains("kv-block-index"), "{err}");
    }
}

/// A peer replica's choice reaches the instance of its model and is
/// recorded for a member; a model without an instance, or a worker that
/// is not a member, records nothing and creates nothing.
#[test]
fn a_peers_choice_reaches_its_models_instance_only() {
    let registry =
        PolicyRegistry::<BasicBackend>::new(PolicyConfig::named("cache_aware")).expect("valid");
    let fleet = fleet(2);
    for b in &fleet {
        registry.on_membership(MembershipEvent::Added { key: b.key() });
    }
    let text = lb_policies::RoutingInput::Text("user: a prefix a peer routed");
    // No instance for the model yet: nothing, and still no instance.
    assert!(!registry.learn_choice("m", text, &key(1)));
    assert!(registry.counts().is_empty(), "no instance was made");
    let policy = registry.policy("m").expect("builds");
    assert!(!registry.learn_choice("m", text, "http://not-a-member:1"));
    assert!(policy.tree_stats().iter().all(|s| s.bytes == 0));
    assert!(registry.learn_choice("m", text, &key(1)));
    assert!(policy.tree_stats().iter().any(|s| s.bytes > 0));
    // The learned prefix now routes to that worker.
    let ctx = RequestContext::new("m").with_text("user: a prefix a peer routed, and more");
    let decision = registry.select(&fleet, &ctx).expect("ok").expect("up");
    assert_eq!(
        (decision.index, decision.reason),
        (1, DecisionReason::CacheHit)
    );
}
