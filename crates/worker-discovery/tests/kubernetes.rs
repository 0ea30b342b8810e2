//! Kubernetes discovery against a fake API server: the real kube-rs client
//! and watcher talk to a hyper server on 127.0.0.1 that lists and watches
//! pods with resource versions, sends ADDED/MODIFIED/DELETED/BOOKMARK
//! events, drops watch connections, fails during an "outage" and answers
//! 410 Gone for a compacted resource version. The workers are checked
//! where a router sees them: a `DiscoveryPool` reconciling the registry,
//! with load guards held across every change.
//!
//! Every wait is bounded (`eventually`, 20 s) and nothing asserts on
//! elapsed time.
#![cfg(feature = "kubernetes")]

#[path = "support/fake_kube.rs"]
mod fake_kube;

use fake_kube::FakeApi;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use worker_discovery::kubernetes::{
    BOOTSTRAP_PORT_ANNOTATION, BackoffConfig, KubernetesConfig, KubernetesDiscovery,
    KubernetesError, Selector,
};
use worker_lifecycle::{
    BreakerState, DiscoveryPool, Lifecycle, MembershipEvent, ServiceRegistry, Worker,
    WorkerOptions, WorkerRole,
};

// ---------------------------------------------------------------------------
// Pods, the discovery under test, and what a router's pool sees.

const NS: &str = "inference";

fn pod(name: &str, uid: &str, ip: &str, labels: &[(&str, &str)]) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), json!(v)))
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": uid, "labels": labels},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True"}]}
    })
}

fn set_ready(ready: bool) -> impl FnOnce(&mut Value) {
    move |pod| {
        pod["status"]["conditions"] =
            json!([{"type": "Ready", "status": if ready { "True" } else { "False" }}]);
    }
}

fn test_backoff() -> BackoffConfig {
    BackoffConfig {
        initial: Duration::from_millis(5),
        max: Duration::from_millis(40),
    }
}

async fn discover(
    addr: SocketAddr,
    config: KubernetesConfig,
) -> Result<KubernetesDiscovery, KubernetesError> {
    let url = format!("http://{addr}").parse().unwrap();
    let client = kube::Client::try_from(kube::Config::new(url)).unwrap();
    let config = KubernetesConfig {
        port: 8000,
        namespace: Some(NS.to_owned()),
        backoff: test_backoff(),
        ..config
    };
    KubernetesDiscovery::start(client, config).await
}

fn regular() -> KubernetesConfig {
    KubernetesConfig::regular(Selector::parse(["app=vllm"]).unwrap())
}

/// Polls `check` until it holds; fails the test after 20 s (a bound, not a
/// timing assertion).
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A router's view of one role: the pool reconciled with the registry.
struct View {
    pool: DiscoveryPool,
    registry: Arc<ServiceRegistry>,
}

impl View {
    fn new(registry: &Arc<ServiceRegistry>) -> Self {
        Self {
            pool: DiscoveryPool::new(registry.role(), WorkerOptions::default()).unwrap(),
            registry: Arc::clone(registry),
        }
    }

    /// One serialized step: the workers and the membership events.
    fn step(&self) -> (Vec<Arc<Worker>>, Vec<MembershipEvent>) {
        self.pool
            .with_reconciled(&self.registry, Instant::now(), |view| {
                (view.workers().to_vec(), view.events().to_vec())
            })
            .unwrap()
    }

    fn urls(&self) -> Vec<String> {
        self.step().0.iter().map(|w| w.url().to_owned()).collect()
    }

    fn worker(&self, url: &str) -> Option<Arc<Worker>> {
        self.step().0.into_iter().find(|w| w.url() == url)
    }
}

/// The worker left the pool: removed, still holding the load of the
/// requests in flight on it, released exactly once when they finish.
fn assert_drained(old: &Arc<Worker>, in_flight: Vec<worker_lifecycle::LoadGuard>) {
    assert_eq!(old.lifecycle(), Lifecycle::Removed);
    assert_eq!(
        old.load(),
        in_flight.len(),
        "in-flight requests stay counted"
    );
    drop(in_flight);
    assert_eq!(old.load(), 0);
    assert_eq!(old.underflows(), 0);
}

async fn joined(view: &View, url: &str) -> Arc<Worker> {
    eventually(&format!("{url} joins"), || view.worker(url).is_some()).await;
    view.worker(url).unwrap()
}

async fn left(view: &View, url: &str) {
    eventually(&format!("{url} leaves"), || view.worker(url).is_none()).await;
}

const A: &str = "http://10.0.0.1:8000";
const B: &str = "http://10.0.0.2:8000";

// ---------------------------------------------------------------------------
// Scenarios.

#[tokio::test]
async fn add_not_ready_ready_again_and_delete_with_requests_in_flight() {
    let (api, addr) = FakeApi::start().await;
    api.create(pod("a", "uid-a", "10.0.0.1", &[("app", "vllm")]));
    api.create(pod("other", "uid-o", "10.0.0.9", &[("app", "web")]));
    let discovery = discover(addr, regular()).await.unwrap();
    assert!(discovery.wait_synced(Duration::from_secs(20)).await);
    let view = View::new(&discovery.registries().regular);
    assert_eq!(view.urls(), [A], "only the selected pod is a worker");
    let first = view.worker(A).unwrap();
    assert_eq!(first.labels()["source"], "kubernetes");
    assert_eq!(first.labels()["pod"], "a");
    assert_eq!(first.labels()["namespace"], NS);

    // Added while running: the next step sees the same worker object.
    api.create(pod("b", "uid-b", "10.0.0.2", &[("app", "vllm")]));
    joined(&view, B).await;
    assert!(Arc::ptr_eq(&view.worker(A).unwrap(), &first));

    // NotReady: drained, not cut.
    let in_flight = vec![first.reserve(), first.reserve()];
    api.modify("uid-a", set_ready(false));
    left(&view, A).await;
    assert_drained(&first, in_flight);

    // Ready again: a new lifetime with fresh load; the old object is done.
    api.modify("uid-a", set_ready(true));
    let second = joined(&view, A).await;
    assert!(second.generation() > first.generation());
    assert_eq!(second.load(), 0);
    let guard = second.reserve();

    // Deleted: drained the same way.
    api.delete("uid-a");
    left(&view, A).await;
    assert_drained(&second, vec![guard]);
    assert_eq!(view.urls(), [B]);
    let metrics = discovery.metrics();
    assert_eq!(metrics.regular_workers, 1);
    assert_eq!(metrics.registrations, 3);
    assert_eq!(metrics.deregistrations, 2);
}

#[tokio::test]
async fn a_pod_whose_labels_stop_matching_leaves() {
    let (api, addr) = FakeApi::start().await;
    api.create(pod("a", "uid-a", "10.0.0.1", &[("app", "vllm")]));
    let discovery = discover(addr, regular()).await.unwrap();
    let view = View::new(&discovery.registries().regular);
    let worker = joined(&view, A).await;
    let guard = worker.reserve();
    // The server-side selector turns this into a DELETED event.
    api.modify("uid-a", |pod| {
        pod["metadata"]["labels"]["app"] = json!("retired")
    });
    left(&view, A).await;
    assert_drained(&worker, vec![guard]);
    // Matching again is a new lifetime.
    api.modify("uid-a", |pod| {
        pod["metadata"]["labels"]["app"] = json!("vllm")
    });
    let again = joined(&view, A).await;
    assert!(again.generation() > worker.generation());
}

#[tokio::test]
async fn a_dropped_watch_resumes_without_a_relist_and_misses_nothing() {
    let (api, addr) = FakeApi::start().await;
    api.create(pod("a", "uid-a", "10.0.0.1", &[("app", "vllm")]));
    let discovery = discover(addr, regular()).await.unwrap();
    let view = View::new(&discovery.registries().regular);
    let a = joined(&view, A).await;
    eventually("the watch is open", || api.watches() >= 1).await;
    let (lists, watches) = (api.lists(), api.watches());
    api.drop_watches();
    eventually("the watch is opened again", || api.watches() > watches).await;
    // A change after the drop is delivered by the resumed watch.
    api.create(pod("b", "uid-b", "10.0.0.2", &[("app", "vllm")]));
    joined(&view, B).await;
    assert_eq!(
        api.lists(),
        lists,
        "resuming from the resource version needs no list"
    );
    assert!(
        Arc::ptr_eq(&view.worker(A).unwrap(), &a),
        "same worker object"
    );

    // A BOOKMARK moves the watch's resource version past changes its
    // selector hides, so a resume after compaction needs no list either.
    api.create(pod("web", "uid-w", "10.0.0.9", &[("app", "web")]));
    api.bookmark();
    api.compact();
    api.drop_watches();
    api.create(pod("c", "uid-c", "10.0.0.3", &[("app", "vllm")]));
    joined(&view, "http://10.0.0.3:8000").await;
    assert_eq!(api.lists(), lists, "the bookmark spared a re-list");
    assert_eq!(discovery.metrics().watch_errors, 0);
}

#[tokio::test]
async fn a_deletion_during_a_watch_outage_is_found_by_the_relist() {
    let (api, addr) = FakeApi::start().await;
    api.create(pod("a", "uid-a", "10.0.0.1", &[("app", "vllm")]));
    api.create(pod("b", "uid-b", "10.0.0.2", &[("app", "vllm")]));
    let discovery = discover(addr, regular()).await.unwrap();
    let view = View::new(&discovery.registries().regular);
    let a = joined(&view, A).await;
    let b = joined(&view, B).await;
    let in_flight = vec![a.reserve()];
    let b_guard = b.reserve();
    eventually("the watch is open", || api.watches() >= 1).await;
    let before = discovery.metrics();

    // The API server goes away; while it is away `a` is deleted and the
    // history compacted, so the watch cannot resume: 410, then a re-list.
    api.set_outage(true);
    api.drop_watches();
    eventually("failed watches are counted", || {
        discovery.metrics().watch_errors >= before.watch_errors + 2
    })
    .await;
    api.delete("uid-a");
    api.compact();
    assert_eq!(view.urls(), [A, B], "nothing changes while the API is away");
    api.set_outage(false);
    left(&view, A).await;
    assert_drained(&a, in_flight);
    let after = discovery.metrics();
    assert!(after.relists > before.relists, "{before:?} -> {after:?}");
    // The pod that stayed kept its worker object and its load.
    let b_now = view.worker(B).unwrap();
    assert!(Arc::ptr_eq(&b_now, &b));
    assert_eq!(b.load(), 1);
    drop(b_guard);
    assert_eq!(b.load(), 0);
    assert_eq!(b.underflows(), 0);
}

#[tokio::test]
async fn a_pod_recreated_with_the_same_ip_is_a_new_generation() {
    let (api, addr) = FakeApi::start().await;
    api.create(pod("a", "uid-1", "10.0.0.1", &[("app", "vllm")]));
    let discovery = discover(addr, regular()).await.unwrap();
    let view = View::new(&discovery.registries().regular);
    let old = joined(&view, A).await;
    let old_guard = old.reserve();
    // A StatefulSet-style re-creation: same name, same IP, new UID.
    api.delete("uid-1");
    api.create(pod("a", "uid-2", "10.0.0.1", &[("app", "vllm")]));
    eventually("the new pod replaces the old one", || {
        view.worker(A).is_some_and(|w| !Arc::ptr_eq(&w, &old))
    })
    .await;
    let new = view.worker(A).unwrap();
    assert!(new.generation() > old.generation());
    assert_eq!(new.load(), 0, "fresh load");
    assert_eq!(new.breaker().state(), BreakerState::Closed, "fresh breaker");
    let new_guard = new.reserve();
    assert_drained(&old, vec![old_guard]);
    assert_eq!(
        new.load(),
        1,
        "the old lifetime's release did not touch the new one"
    );
    drop(new_guard);
    assert_eq!(new.load(), 0);
}

#[tokio::test]
async fn prefill_and_decode_roles_with_the_bootstrap_annotation() {
    let (api, addr) = FakeApi::start().await;
    let mut prefill = pod(
        "p0",
        "uid-p0",
        "10.0.0.1",
        &[("app", "vllm"), ("role", "prefill")],
    );
    prefill["metadata"]["annotations"] = json!({BOOTSTRAP_PORT_ANNOTATION: "8998"});
    api.create(prefill);
    api.create(pod(
        "d0",
        "uid-d0",
        "10.0.0.2",
        &[("app", "vllm"), ("role", "decode")],
    ));
    let config = KubernetesConfig::prefill_decode(
        Selector::parse(["app=vllm", "role=prefill"]).unwrap(),
        Selector::parse(["app=vllm", "role=decode"]).unwrap(),
    );
    let discovery = discover(addr, config).await.unwrap();
    assert!(discovery.wait_synced(Duration::from_secs(20)).await);
    let prefill = View::new(&discovery.registries().prefill);
    let decode = View::new(&discovery.registries().decode);
    let p = joined(&prefill, A).await;
    assert_eq!(
        p.role(),
        WorkerRole::Prefill {
            bootstrap_port: Some(8998)
        }
    );
    let d = joined(&decode, B).await;
    assert_eq!(d.role(), WorkerRole::Decode);
    assert!(discovery.registries().regular.is_empty());

    // Relabelled from decode to prefill: it leaves decode, joins prefill
    // as a new worker; the decode requests in flight finish on the old one.
    let guard = d.reserve();
    api.modify("uid-d0", |pod| {
        pod["metadata"]["labels"]["role"] = json!("prefill")
    });
    left(&decode, B).await;
    let p1 = joined(&prefill, B).await;
    assert_eq!(p1.load(), 0);
    assert_drained(&d, vec![guard]);
    assert_eq!(
        p1.role(),
        WorkerRole::Prefill {
            bootstrap_port: None
        }
    );
    let metrics = discovery.metrics();
    assert_eq!((metrics.prefill_workers, metrics.decode_workers), (2, 0));
}

#[tokio::test]
async fn a_403_at_startup_names_the_rbac_rule() {
    let (api, addr) = FakeApi::start().await;
    api.set_forbidden(true);
    let err = discover(addr, regular()).await.unwrap_err();
    let message = err.to_string();
    assert!(
        matches!(err, KubernetesError::Forbidden { status: 403, .. }),
        "{message}"
    );
    assert!(message.contains("get, list and watch on pods"), "{message}");
    assert!(message.contains("namespace inference"), "{message}");
    assert!(message.contains("cannot list resource"), "{message}");
}

#[tokio::test]
async fn a_403_while_running_is_counted_and_retried() {
    let (api, addr) = FakeApi::start().await;
    api.create(pod("a", "uid-a", "10.0.0.1", &[("app", "vllm")]));
    let discovery = discover(addr, regular()).await.unwrap();
    let view = View::new(&discovery.registries().regular);
    joined(&view, A).await;
    eventually("the watch is open", || api.watches() >= 1).await;
    api.set_forbidden(true);
    api.drop_watches();
    eventually("refusals are counted", || {
        discovery.metrics().forbidden >= 2
    })
    .await;
    assert_eq!(view.urls(), [A], "a refused watch removes nobody");
    api.set_forbidden(false);
    api.create(pod("b", "uid-b", "10.0.0.2", &[("app", "vllm")]));
    joined(&view, B).await;
}

/// Through a `RolePool` with the cache-aware policy, as router-http uses
/// it: a re-created pod's old lifetime leaves the policy's tree, the
/// request in flight on it is released on the old object, and the new
/// lifetime starts with no affinity of its own.
#[tokio::test]
async fn a_recreated_pod_leaves_no_cache_affinity_behind() {
    use lb_policies::{PolicyConfig, PolicyRegistry, RequestContext};
    use worker_lifecycle::RolePool;

    let (api, addr) = FakeApi::start().await;
    api.create(pod("a", "uid-1", "10.0.0.1", &[("app", "vllm")]));
    api.create(pod("b", "uid-b", "10.0.0.2", &[("app", "vllm")]));
    let discovery = discover(addr, regular()).await.unwrap();
    assert!(discovery.wait_synced(Duration::from_secs(20)).await);
    let policies = PolicyRegistry::new(PolicyConfig::named("cache_aware")).unwrap();
    let pool = RolePool::discovered(
        Arc::clone(&discovery.registries().regular),
        WorkerOptions::default(),
        policies,
    )
    .unwrap();
    let route = |text: &str| {
        let workers = pool.refresh().unwrap();
        let eligible = pool.eligible(&workers, "m", |_| true).unwrap();
        pool.choose_reserved(&eligible, &RequestContext::new("m").with_text(text))
            .unwrap()
    };
    let keys = || -> Vec<String> {
        pool.policies()
            .affinity_sizes()
            .into_iter()
            .map(|(_, key, _)| key.to_string())
            .collect()
    };
    // Route until `a` holds a prefix (the first choice among equals is fair,
    // not fixed); keep that request in flight.
    let mut in_flight = None;
    for i in 0..8 {
        let choice = route(&format!("conversation {i} with a long shared prefix"));
        if choice.guard.worker().url() == A {
            in_flight = Some(choice);
            break;
        }
    }
    let choice = in_flight.expect("a was chosen within 8 requests");
    let old = Arc::clone(choice.guard.worker());
    assert!(keys().contains(&old.key().to_owned()), "{:?}", keys());

    api.delete("uid-1");
    api.create(pod("a", "uid-2", "10.0.0.1", &[("app", "vllm")]));
    eventually("the new lifetime is in the pool", || {
        pool.refresh()
            .unwrap()
            .iter()
            .any(|w| w.url() == A && w.generation() > old.generation())
    })
    .await;
    assert!(!keys().contains(&old.key().to_owned()), "{:?}", keys());
    let new = pool
        .refresh()
        .unwrap()
        .iter()
        .find(|w| w.url() == A)
        .cloned()
        .unwrap();
    assert_eq!(new.load(), 0);
    assert_drained(&old, vec![choice.guard]);
    assert_eq!(
        new.load(),
        0,
        "the old release did not touch the new lifetime"
    );
}
