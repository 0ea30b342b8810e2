//! Every address a registration announces is validated and checked against
//! the host's allow-list (issue 32, items 5 and 6): a KV event endpoint
//! outside the networks never reaches the registries (the only place the
//! router learns what to dial), a poisoned `zmq_address` is refused by
//! name, and a refused registration changes nothing.
//!
//! Both transports go through the calls exercised here: the HTTP
//! `POST /register` handler is [`Registrar::register_json`]; the ZMQ
//! listener decodes with [`decode_registration`], checks with
//! [`Registrar::admit`] and applies with [`Registries::register`].

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use worker_discovery::{
    AddressCheck, AddressRefused, CheckFuture, RegisterError, Registrar, Registries,
    decode_registration,
};
use worker_lifecycle::{WorkerUrl, labels};

/// An allow-list of single addresses, judged after resolution like the
/// router's `--worker-networks`: every address a name resolves to must be
/// listed. Counts its calls.
struct AllowList {
    allowed: Vec<IpAddr>,
    calls: AtomicUsize,
}

impl AddressCheck for AllowList {
    fn check<'a>(&'a self, url: &'a WorkerUrl) -> CheckFuture<'a> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            let resolved: Vec<IpAddr> = tokio::net::lookup_host((url.host(), url.port()))
                .await
                .map_err(|err| AddressRefused::new(format!("cannot resolve {url}: {err}")))?
                .map(|socket| socket.ip())
                .collect();
            match resolved.iter().find(|ip| !self.allowed.contains(ip)) {
                Some(outside) => Err(AddressRefused::new(format!(
                    "{url}: {outside} is outside the allowed networks"
                ))),
                None if resolved.is_empty() => Err(AddressRefused::new("no address")),
                None => Ok(()),
            }
        })
    }
}

/// Engines on 127.0.0.2 only: 127.0.0.1 stands for "outside".
fn registrar() -> (Registrar, Arc<AllowList>) {
    let check = Arc::new(AllowList {
        allowed: vec!["127.0.0.2".parse().unwrap()],
        calls: AtomicUsize::new(0),
    });
    let registrar = Registrar::new(Registries::new(Duration::from_secs(60)))
        .with_check(check.clone(), Duration::from_secs(5));
    (registrar, check)
}

fn labels_of(registries: &Registries) -> Vec<Vec<(String, String)>> {
    let now = Instant::now();
    [&registries.prefill, &registries.decode]
        .iter()
        .flat_map(|registry| registry.snapshot(now).entries.clone())
        .map(|entry| entry.registration.labels.clone().into_iter().collect())
        .collect()
}

fn all_empty(registries: &Registries) -> bool {
    registries.prefill.is_empty() && registries.decode.is_empty()
}

#[tokio::test]
async fn an_http_registration_with_a_kv_endpoint_outside_the_networks_is_refused() {
    let (registrar, _) = registrar();
    for (field, endpoint) in [
        ("kv_events_endpoint", "tcp://127.0.0.1:5557"),
        ("kv_events_replay_endpoint", "tcp://127.0.0.1:5558"),
        // After resolution: a name that does not resolve is refused too.
        ("kv_events_endpoint", "tcp://no-such-host.invalid:5557"),
    ] {
        let mut body = serde_json::json!({"type": "P", "http_address": "127.0.0.2:8100"});
        body[field] = endpoint.into();
        let err = registrar
            .register_json(body.to_string().as_bytes())
            .await
            .unwrap_err();
        assert!(matches!(err, RegisterError::AddressRefused(_)), "{err}");
        assert_eq!(err.field(), Some(field), "{err}");
        assert!(err.to_string().contains(field), "{err}");
    }
    // Nothing was registered, so nothing will be dialled.
    assert!(all_empty(registrar.registries()));
    assert_eq!(registrar.registries().refused_addresses(), 3);
    assert_eq!(registrar.registries().malformed_messages(), 0);
}

#[tokio::test]
async fn a_zmq_registration_with_a_kv_endpoint_outside_the_networks_is_refused() {
    let (registrar, _) = registrar();
    let payload = rmp_serde::to_vec_named(&serde_json::json!({
        "type": "D", "http_address": "127.0.0.2:8200",
        "kv_events_endpoint": "tcp://127.0.0.1:5557"
    }))
    .unwrap();
    // The listener's steps: decode, check, apply only when admitted.
    let registration = decode_registration(&payload).unwrap();
    let refused = registrar.admit(&registration).await.unwrap_err();
    assert_eq!(refused.field(), Some("kv_events_endpoint"));
    assert!(
        refused.reason().contains("127.0.0.1 is outside"),
        "{refused}"
    );
    assert_eq!(registrar.registries().refused_addresses(), 1);
    assert!(all_empty(registrar.registries()));
}

/// A registration built by hand (not decoded) whose KV endpoint is not in
/// canonical spelling is refused by name: the check never judges one
/// spelling while the router would dial another.
#[tokio::test]
async fn a_hand_built_kv_endpoint_in_another_spelling_is_refused_by_name() {
    let (registrar, check) = registrar();
    let payload = rmp_serde::to_vec_named(&serde_json::json!({
        "type": "D", "http_address": "127.0.0.2:8200"
    }))
    .unwrap();
    let mut registration = decode_registration(&payload).unwrap();
    registration.kv_events_replay_endpoint = Some("tcp://0x7f.0.0.2:5558".parse().unwrap());
    let refused = registrar.admit(&registration).await.unwrap_err();
    assert_eq!(refused.field(), Some("kv_events_replay_endpoint"));
    assert!(refused.reason().contains("canonical spelling"), "{refused}");
    assert_eq!(check.calls.load(Ordering::SeqCst), 0, "nothing was checked");
    assert_eq!(registrar.registries().refused_addresses(), 1);
}

#[tokio::test]
async fn kv_endpoints_inside_the_networks_are_registered_canonically() {
    let (registrar, check) = registrar();
    let body = serde_json::json!({
        "type": "P", "http_address": "127.0.0.2:8100",
        "kv_events_endpoint": "tcp://127.0.0.2:5557",
        "kv_events_replay_endpoint": "tcp://0x7f.0.0.2:5558",
    });
    registrar
        .register_json(body.to_string().as_bytes())
        .await
        .unwrap();
    // One host, checked once.
    assert_eq!(check.calls.load(Ordering::SeqCst), 1);
    let labels = labels_of(registrar.registries());
    assert_eq!(
        labels,
        [vec![
            (
                labels::KV_EVENTS_ENDPOINT.to_owned(),
                "tcp://127.0.0.2:5557".to_owned()
            ),
            (
                labels::KV_EVENTS_REPLAY_ENDPOINT.to_owned(),
                "tcp://127.0.0.2:5558".to_owned()
            ),
        ]]
    );
}

#[tokio::test]
async fn a_zmq_address_outside_the_networks_is_refused_when_peer_addresses_are_checked() {
    let (registrar, _) = registrar();
    let body = serde_json::json!({
        "type": "P", "http_address": "127.0.0.2:8100", "zmq_address": "127.0.0.1:21001"
    });
    // By default only the addresses the router dials are checked.
    registrar
        .register_json(body.to_string().as_bytes())
        .await
        .unwrap();
    let strict = registrar.clone().checking_peer_addresses(true);
    let mut restarted = body.clone();
    restarted["zmq_address"] = "127.0.0.1:21002".into();
    let err = strict
        .register_json(restarted.to_string().as_bytes())
        .await
        .unwrap_err();
    assert_eq!(err.field(), Some("zmq_address"), "{err}");
    // The refused restart left the earlier registration as it was.
    assert_eq!(
        labels_of(registrar.registries()),
        [vec![(
            labels::KV_ADDR.to_owned(),
            "127.0.0.1:21001".to_owned()
        )]]
    );
}

/// A check that judges peer addresses says so itself: both transports'
/// registrars then check the ZMQ address, however they were built.
#[tokio::test]
async fn a_check_that_judges_peer_addresses_refuses_a_zmq_address_outside() {
    struct Strict(AllowList);
    impl AddressCheck for Strict {
        fn check<'a>(&'a self, url: &'a WorkerUrl) -> CheckFuture<'a> {
            self.0.check(url)
        }
        fn checks_peer_addresses(&self) -> bool {
            true
        }
    }
    let check = Strict(AllowList {
        allowed: vec!["127.0.0.2".parse().unwrap()],
        calls: AtomicUsize::new(0),
    });
    let registrar = Registrar::new(Registries::new(Duration::from_secs(60)))
        .with_check(Arc::new(check), Duration::from_secs(5));
    let payload = rmp_serde::to_vec_named(&serde_json::json!({
        "type": "P", "http_address": "127.0.0.2:8100", "zmq_address": "127.0.0.1:21001"
    }))
    .unwrap();
    let refused = registrar
        .admit(&decode_registration(&payload).unwrap())
        .await
        .unwrap_err();
    assert_eq!(refused.field(), Some("zmq_address"));
    assert!(refused.reason().starts_with("zmq_address: "), "{refused}");
    assert_eq!(registrar.registries().refused_addresses(), 1);
}

/// The probe's hostile registrations: each refused naming its field, and
/// an engine already registered keeps its labels and generation.
#[tokio::test]
async fn hostile_registrations_are_refused_by_field_and_change_nothing() {
    let (registrar, _) = registrar();
    let good = serde_json::json!({
        "type": "P", "http_address": "127.0.0.2:8100", "zmq_address": "127.0.0.2:21001"
    });
    let first = registrar
        .register_json(good.to_string().as_bytes())
        .await
        .unwrap();
    let before = labels_of(registrar.registries());
    let long = format!("{}:1", "a".repeat(60 * 1024));
    let cases: [(&str, serde_json::Value); 7] = [
        ("zmq_address", "127.0.0.2:21001\r\nx-evil: 1".into()),
        ("zmq_address", long.into()),
        ("zmq_address", "127.0.0.2:0".into()),
        ("http_address", "127.0.0.2:0".into()),
        ("dp_size", 4_294_967_295_u64.into()),
        ("tp_size", 4_294_967_295_u64.into()),
        ("kv_events_endpoint", "tcp://a:b@[::1]%x/y:5557".into()),
    ];
    for (field, value) in cases {
        let mut body = good.clone();
        body[field] = value;
        let err = registrar
            .register_json(body.to_string().as_bytes())
            .await
            .unwrap_err();
        assert!(matches!(err, RegisterError::Invalid(_)), "{err}");
        assert_eq!(err.field(), Some(field), "{err}");
        assert!(err.to_string().len() < 400, "a short answer: {err}");
    }
    assert_eq!(registrar.registries().malformed_messages(), 7);
    assert_eq!(labels_of(registrar.registries()), before);
    let snapshot = registrar.registries().prefill.snapshot(Instant::now());
    assert_eq!(snapshot.entries.len(), 1);
    assert_eq!(snapshot.entries[0].generation, first.generation);
}

/// Decision (issue 32): one engine announcing the same address as prefill
/// and as decode (vLLM's `kv_both`) is accepted, as two separate entries,
/// one per role, each with its own generation.
#[tokio::test]
async fn the_same_engine_in_both_roles_is_two_separate_entries() {
    let (registrar, _) = registrar();
    let mut generations = Vec::new();
    for kind in ["P", "D"] {
        let body = serde_json::json!({
            "type": kind, "http_address": "127.0.0.2:8000", "zmq_address": "127.0.0.2:21001",
            "kv_events_endpoint": "tcp://127.0.0.2:5557"
        });
        let registered = registrar
            .register_json(body.to_string().as_bytes())
            .await
            .unwrap();
        generations.push(registered.generation);
    }
    let registries = registrar.registries();
    assert_eq!((registries.prefill.len(), registries.decode.len()), (1, 1));
    let now = Instant::now();
    assert_eq!(
        registries.prefill.snapshot(now).entries[0].generation,
        generations[0]
    );
    assert_eq!(
        registries.decode.snapshot(now).entries[0].generation,
        generations[1]
    );
}
