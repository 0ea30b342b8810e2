//! From pods to registrations: the sans-IO core of Kubernetes discovery.
//!
//! [`PodTracker`] holds what each watch stream (one per role's selector)
//! last told about its pods, decides which pods are workers, and applies
//! the difference to the role registries. It does no I/O and reads no
//! clock, so the tests drive it event by event.
//!
//! # What makes a pod a worker
//!
//! It is `Running`, its `Ready` condition is `True`, it has a pod IP, it is
//! not terminating (no `deletionTimestamp`), and it matches a selector. Its
//! role is that of the first selector it matches, in the order prefill,
//! decode, regular. A pod stops being a worker when any of this stops being
//! true, when it is deleted, or when a re-list after a watch outage no
//! longer lists it.
//!
//! # Identity
//!
//! A worker's registration carries the pod's UID as its instance id, so a
//! pod re-created under the same name and IP is a new registration
//! generation — a new worker object with fresh load and breaker — never the
//! old one continued (invariant 3 of docs/architecture.md). Two live pods
//! claiming one endpoint (say, host-network pods on one node) do not fight:
//! the one already registered keeps it until it leaves.
//!
//! # Re-lists
//!
//! kube-runtime's watcher re-lists after it lost its place (410 Gone) and
//! announces the list with `Init`, `InitApply`… and `InitDone`. The tracker
//! buffers the listed pods and replaces the stream's whole set at
//! `InitDone`: a pod deleted while the watch was down is absent from the
//! list and leaves then, and the fleet never looks empty half-way through
//! a list.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use worker_lifecycle::{Endpoint, Registration, RoleKind, ServiceRegistry, WorkerUrl};

use super::Selector;

/// The annotation that carries a prefill pod's KV bootstrap port.
pub const BOOTSTRAP_PORT_ANNOTATION: &str = "vllm.ai/bootstrap-port";

/// Registration label keys set on every pod-discovered worker (shown by
/// hosts that list workers with their labels).
pub mod labels {
    /// Where the worker came from: always [`SOURCE_KUBERNETES`].
    pub const SOURCE: &str = "source";
    /// The value of [`SOURCE`] for pod discovery.
    pub const SOURCE_KUBERNETES: &str = "kubernetes";
    /// The pod's name.
    pub const POD: &str = "pod";
    /// The pod's namespace.
    pub const NAMESPACE: &str = "namespace";
}

/// What discovery needs to know of one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    /// `metadata.uid`: the pod's identity.
    pub uid: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace` (empty when absent).
    pub namespace: String,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `status.podIP`, when it is set and an IP address.
    pub ip: Option<IpAddr>,
    /// `status.phase` is `Running`.
    pub running: bool,
    /// The `Ready` condition is `True`.
    pub ready: bool,
    /// `metadata.deletionTimestamp` is set: the pod is shutting down.
    pub terminating: bool,
    /// The bootstrap port annotation, parsed: `Ok(None)` when absent,
    /// `Err(value)` when it is not a port number.
    pub bootstrap_port: Result<Option<u16>, String>,
}

impl PodInfo {
    /// Reads `pod`, with the bootstrap port from the annotation
    /// `bootstrap_annotation`. `None` for a pod without a UID or name
    /// (never sent by a real API server).
    pub fn from_pod(pod: &Pod, bootstrap_annotation: &str) -> Option<Self> {
        let meta = &pod.metadata;
        let uid = meta.uid.clone().filter(|uid| !uid.is_empty())?;
        let name = meta.name.clone().filter(|name| !name.is_empty())?;
        let status = pod.status.as_ref();
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|conditions| {
                conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            });
        let bootstrap_port = match meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(bootstrap_annotation))
        {
            None => Ok(None),
            Some(value) => match value.trim().parse::<u16>() {
                Ok(port) if port > 0 => Ok(Some(port)),
                _ => Err(value.clone()),
            },
        };
        Some(Self {
            uid,
            name,
            namespace: meta.namespace.clone().unwrap_or_default(),
            labels: meta.labels.clone().unwrap_or_default(),
            ip: status
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse().ok()),
            running: status.and_then(|s| s.phase.as_deref()) == Some("Running"),
            ready,
            terminating: meta.deletion_timestamp.is_some(),
            bootstrap_port,
        })
    }

    /// Why this pod is not a worker, or `None` when it is one (selector
    /// aside).
    pub fn not_a_worker(&self) -> Option<&'static str> {
        if self.terminating {
            Some("terminating")
        } else if !self.running {
            Some("not running")
        } else if !self.ready {
            Some("not ready")
        } else if self.ip.is_none() {
            Some("no pod IP")
        } else {
            None
        }
    }

    /// `namespace/name`, for logs.
    pub fn display_name(&self) -> String {
        if self.namespace.is_empty() {
            self.name.clone()
        } else {
            format!("{}/{}", self.namespace, self.name)
        }
    }
}

/// One event of a watch stream, as the tracker takes it (kube-runtime's
/// `watcher::Event`, with pods already read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// A pod was added or changed.
    Apply(PodInfo),
    /// A pod was deleted (or stopped matching the server-side selector).
    Delete(PodInfo),
    /// A (re-)list starts: the stream's set is replaced at [`InitDone`](Self::InitDone).
    Init,
    /// A pod of the list.
    InitApply(PodInfo),
    /// The list is complete.
    InitDone,
}

/// The registries Kubernetes discovery feeds, one per role. Cheap to
/// clone: clones share the registries.
#[derive(Debug, Clone)]
pub struct KubernetesRegistries {
    /// Regular workers (`--selector`).
    pub regular: Arc<ServiceRegistry>,
    /// Prefill workers (`--prefill-selector`).
    pub prefill: Arc<ServiceRegistry>,
    /// Decode workers (`--decode-selector`).
    pub decode: Arc<ServiceRegistry>,
}

impl KubernetesRegistries {
    /// Empty registries. A pod's registration lasts until discovery
    /// removes it, so entries get a time-to-live far beyond any run
    /// ([`REGISTRATION_TTL`]).
    pub fn new() -> Self {
        let registry = |role| Arc::new(ServiceRegistry::new(role, REGISTRATION_TTL));
        Self {
            regular: registry(RoleKind::Regular),
            prefill: registry(RoleKind::Prefill),
            decode: registry(RoleKind::Decode),
        }
    }

    /// The registry of `role`.
    pub fn of(&self, role: RoleKind) -> &Arc<ServiceRegistry> {
        match role {
            RoleKind::Prefill => &self.prefill,
            RoleKind::Decode => &self.decode,
            _ => &self.regular,
        }
    }
}

impl Default for KubernetesRegistries {
    fn default() -> Self {
        Self::new()
    }
}

/// Time-to-live of a pod's registration: ten years. Pods do not send
/// heartbeats; the watch says when they leave, so entries must not expire.
pub const REGISTRATION_TTL: std::time::Duration =
    std::time::Duration::from_secs(10 * 365 * 24 * 3600);

/// One watch stream: the role its selector picks and what it last said.
#[derive(Debug)]
struct Stream {
    role: RoleKind,
    selector: Selector,
    pods: HashMap<String, PodInfo>,
    listing: Option<HashMap<String, PodInfo>>,
    listed_once: bool,
}

/// A worker as registered.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Wanted {
    role: RoleKind,
    endpoint: Endpoint,
    registration: Registration,
}

#[derive(Debug)]
struct Applied {
    wanted: Wanted,
    generation: u64,
    pod: String,
}

/// What one [`PodTracker::handle`] call changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Workers registered (a new generation each): (role, endpoint, generation).
    pub registered: Vec<(RoleKind, Endpoint, u64)>,
    /// Workers deregistered: (role, endpoint, generation).
    pub deregistered: Vec<(RoleKind, Endpoint, u64)>,
    /// Pods refused for an invalid bootstrap-port annotation in this step
    /// (they are registered without a port).
    pub invalid_annotations: u64,
}

/// Pods of every stream → registrations. See the module docs.
#[derive(Debug)]
pub struct PodTracker {
    port: u16,
    streams: Vec<Stream>,
    registries: KubernetesRegistries,
    applied: HashMap<String, Applied>,
    warned_annotations: HashMap<String, String>,
}

impl PodTracker {
    /// A tracker of `streams` — each a role and its selector, in priority
    /// order (prefill, decode, regular) — registering workers at `port` of
    /// their pod IP in `registries`.
    pub fn new(
        streams: Vec<(RoleKind, Selector)>,
        port: u16,
        registries: KubernetesRegistries,
    ) -> Self {
        Self {
            port,
            streams: streams
                .into_iter()
                .map(|(role, selector)| Stream {
                    role,
                    selector,
                    pods: HashMap::new(),
                    listing: None,
                    listed_once: false,
                })
                .collect(),
            registries,
            applied: HashMap::new(),
            warned_annotations: HashMap::new(),
        }
    }

    /// The registries fed.
    pub fn registries(&self) -> &KubernetesRegistries {
        &self.registries
    }

    /// Whether every stream has completed its first list.
    pub fn synced(&self) -> bool {
        self.streams.iter().all(|s| s.listed_once)
    }

    /// Workers registered now, per role.
    pub fn workers(&self, role: RoleKind) -> usize {
        self.applied
            .values()
            .filter(|a| a.wanted.role == role)
            .count()
    }

    /// Applies `event` of stream `stream` (an index into the list given to
    /// [`new`](Self::new)) and brings the registries in line at `now`.
    /// Events between `Init` and `InitDone` are buffered and change nothing
    /// until the list is complete. An out-of-range stream is ignored.
    pub fn handle(&mut self, stream: usize, event: StreamEvent, now: Instant) -> SyncReport {
        let Some(s) = self.streams.get_mut(stream) else {
            return SyncReport::default();
        };
        match event {
            StreamEvent::Apply(pod) => {
                s.pods.insert(pod.uid.clone(), pod);
            }
            StreamEvent::Delete(pod) => {
                s.pods.remove(&pod.uid);
            }
            StreamEvent::Init => {
                s.listing = Some(HashMap::new());
                return SyncReport::default();
            }
            StreamEvent::InitApply(pod) => {
                s.listing
                    .get_or_insert_with(HashMap::new)
                    .insert(pod.uid.clone(), pod);
                return SyncReport::default();
            }
            StreamEvent::InitDone => {
                s.pods = s.listing.take().unwrap_or_default();
                s.listed_once = true;
            }
        }
        self.sync(now)
    }

    /// The workers every stream's current pods call for, by pod UID.
    fn wanted(&mut self, report: &mut SyncReport) -> HashMap<String, Wanted> {
        let mut claimed: HashMap<&str, ()> = HashMap::new();
        let mut wanted: HashMap<String, Wanted> = HashMap::new();
        let mut invalid: Vec<(String, String, String)> = Vec::new();
        for stream in &self.streams {
            let mut uids: Vec<&String> = stream.pods.keys().collect();
            uids.sort();
            for uid in uids {
                let pod = &stream.pods[uid];
                if claimed.contains_key(uid.as_str()) || !stream.selector.matches(&pod.labels) {
                    continue;
                }
                claimed.insert(uid, ());
                if pod.not_a_worker().is_some() {
                    continue;
                }
                let Some(ip) = pod.ip else { continue };
                let host = match ip {
                    IpAddr::V4(ip) => ip.to_string(),
                    IpAddr::V6(ip) => format!("[{ip}]"),
                };
                let Ok(url) = WorkerUrl::parse_http(&format!("http://{host}:{}", self.port)) else {
                    continue;
                };
                let bootstrap_port = match (&pod.bootstrap_port, stream.role) {
                    (Ok(port), RoleKind::Prefill) => *port,
                    (Err(value), RoleKind::Prefill) => {
                        invalid.push((uid.clone(), pod.display_name(), value.clone()));
                        None
                    }
                    _ => None,
                };
                let mut labels = BTreeMap::new();
                labels.insert(
                    self::labels::SOURCE.to_owned(),
                    self::labels::SOURCE_KUBERNETES.to_owned(),
                );
                labels.insert(self::labels::POD.to_owned(), pod.name.clone());
                if !pod.namespace.is_empty() {
                    labels.insert(self::labels::NAMESPACE.to_owned(), pod.namespace.clone());
                }
                wanted.insert(
                    uid.clone(),
                    Wanted {
                        role: stream.role,
                        endpoint: Endpoint::from_url(url, None),
                        registration: Registration {
                            model_id: None,
                            bootstrap_port,
                            labels,
                            instance_id: Some(uid.clone()),
                        },
                    },
                );
            }
        }
        for (uid, name, value) in invalid {
            // Warn once per pod and value, not at every event.
            if self.warned_annotations.get(&uid) != Some(&value) {
                tracing::warn!(
                    pod = %name,
                    annotation = BOOTSTRAP_PORT_ANNOTATION,
                    %value,
                    "the bootstrap port annotation is not a port number; registering the \
                     prefill pod without one"
                );
                report.invalid_annotations += 1;
                self.warned_annotations.insert(uid, value);
            }
        }
        self.warned_annotations
            .retain(|uid, _| wanted.contains_key(uid));
        // One pod per (role, endpoint): the one registered keeps it, else the
        // lowest UID.
        let mut owner: HashMap<(RoleKind, Endpoint), String> = HashMap::new();
        let mut uids: Vec<String> = wanted.keys().cloned().collect();
        uids.sort();
        for uid in uids {
            let key = (wanted[&uid].role, wanted[&uid].endpoint.clone());
            let incumbent = self
                .applied
                .get(&uid)
                .is_some_and(|a| a.wanted == wanted[&uid]);
            match owner.get(&key) {
                None => {
                    owner.insert(key, uid);
                }
                Some(other) => {
                    tracing::warn!(
                        endpoint = %key.1,
                        pods = %format!("{other}, {uid}"),
                        "two pods claim one endpoint; one is used until it leaves"
                    );
                    if incumbent {
                        let loser = owner.insert(key, uid).unwrap_or_default();
                        wanted.remove(&loser);
                    } else {
                        wanted.remove(&uid);
                    }
                }
            }
        }
        wanted
    }

    fn sync(&mut self, now: Instant) -> SyncReport {
        let mut report = SyncReport::default();
        let mut wanted = self.wanted(&mut report);
        // Leave first, so that an endpoint handed from one pod to another is
        // free when the new owner registers.
        let mut leaving: Vec<String> = self
            .applied
            .iter()
            .filter(|(uid, applied)| wanted.get(*uid) != Some(&applied.wanted))
            .map(|(uid, _)| uid.clone())
            .collect();
        leaving.sort();
        for uid in leaving {
            let Some(applied) = self.applied.remove(&uid) else {
                continue;
            };
            let Wanted { role, endpoint, .. } = applied.wanted;
            self.registries
                .of(role)
                .deregister_generation(&endpoint, applied.generation);
            tracing::info!(
                pod = %applied.pod,
                %role,
                url = %endpoint,
                generation = applied.generation,
                reason = self.reason(&uid),
                "pod left the fleet; in-flight requests finish on it"
            );
            report
                .deregistered
                .push((role, endpoint, applied.generation));
        }
        let mut joining: Vec<String> = wanted
            .keys()
            .filter(|uid| !self.applied.contains_key(*uid))
            .cloned()
            .collect();
        joining.sort();
        for uid in joining {
            let Some(want) = wanted.remove(&uid) else {
                continue;
            };
            let outcome = self.registries.of(want.role).register(
                want.endpoint.clone(),
                want.registration.clone(),
                now,
            );
            let pod = want
                .registration
                .labels
                .get(labels::POD)
                .cloned()
                .unwrap_or_default();
            tracing::info!(
                %pod,
                role = %want.role,
                url = %want.endpoint,
                generation = outcome.generation,
                "pod joined the fleet"
            );
            report
                .registered
                .push((want.role, want.endpoint.clone(), outcome.generation));
            self.applied.insert(
                uid,
                Applied {
                    wanted: want,
                    generation: outcome.generation,
                    pod,
                },
            );
        }
        report
    }

    /// Why the pod `uid` is no longer a worker, for the log line.
    fn reason(&self, uid: &str) -> &'static str {
        let seen = self.streams.iter().find_map(|s| {
            s.pods
                .get(uid)
                .filter(|pod| s.selector.matches(&pod.labels))
        });
        match seen {
            None => "deleted, or its labels no longer match",
            Some(pod) => pod
                .not_a_worker()
                .unwrap_or("its role, address or annotation changed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str, ip: &str, labels: &[(&str, &str)]) -> PodInfo {
        PodInfo {
            uid: uid.to_owned(),
            name: format!("pod-{uid}"),
            namespace: "ns".to_owned(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ip: ip.parse().ok(),
            running: true,
            ready: true,
            terminating: false,
            bootstrap_port: Ok(None),
        }
    }

    fn pd_tracker() -> PodTracker {
        PodTracker::new(
            vec![
                (RoleKind::Prefill, Selector::parse(["role=p"]).unwrap()),
                (RoleKind::Decode, Selector::parse(["role=d"]).unwrap()),
            ],
            8000,
            KubernetesRegistries::new(),
        )
    }

    fn urls(tracker: &PodTracker, role: RoleKind, now: Instant) -> Vec<(String, u64)> {
        tracker
            .registries()
            .of(role)
            .snapshot(now)
            .entries
            .iter()
            .map(|e| (e.endpoint.to_string(), e.generation))
            .collect()
    }

    #[test]
    fn a_ready_running_pod_with_an_ip_is_a_worker_until_it_is_not() {
        let now = Instant::now();
        let mut t = PodTracker::new(
            vec![(RoleKind::Regular, Selector::parse(["app=v"]).unwrap())],
            80,
            KubernetesRegistries::new(),
        );
        let mut p = pod("u1", "10.0.0.1", &[("app", "v")]);
        p.ready = false;
        t.handle(0, StreamEvent::Apply(p.clone()), now);
        assert!(urls(&t, RoleKind::Regular, now).is_empty());
        p.ready = true;
        let report = t.handle(0, StreamEvent::Apply(p.clone()), now);
        assert_eq!(report.registered.len(), 1);
        let entry = &t.registries().regular.snapshot(now).entries[0];
        // Canonical spelling: the default port is implied.
        assert_eq!(entry.endpoint.to_string(), "http://10.0.0.1");
        assert_eq!(entry.registration.instance_id.as_deref(), Some("u1"));
        assert_eq!(entry.registration.labels[labels::POD], "pod-u1");
        assert_eq!(entry.registration.labels[labels::SOURCE], "kubernetes");
        // The same state again changes nothing.
        assert_eq!(
            t.handle(0, StreamEvent::Apply(p.clone()), now),
            SyncReport::default()
        );
        for change in [
            |p: &mut PodInfo| p.ready = false,
            |p: &mut PodInfo| p.running = false,
            |p: &mut PodInfo| p.ip = None,
            |p: &mut PodInfo| p.terminating = true,
            |p: &mut PodInfo| {
                p.labels.insert("app".into(), "other".into());
            },
        ] {
            let mut changed = p.clone();
            change(&mut changed);
            let report = t.handle(0, StreamEvent::Apply(changed), now);
            assert_eq!(report.deregistered.len(), 1);
            assert!(urls(&t, RoleKind::Regular, now).is_empty());
            assert_eq!(
                t.handle(0, StreamEvent::Apply(p.clone()), now)
                    .registered
                    .len(),
                1
            );
        }
        t.handle(0, StreamEvent::Delete(p), now);
        assert!(urls(&t, RoleKind::Regular, now).is_empty());
        assert_eq!(t.workers(RoleKind::Regular), 0);
    }

    #[test]
    fn prefill_wins_over_decode_and_carries_the_bootstrap_port() {
        let now = Instant::now();
        let mut t = pd_tracker();
        let mut both = pod("u1", "10.0.0.1", &[("role", "p")]);
        both.bootstrap_port = Ok(Some(8998));
        // Seen by both streams (labels of each copy match its selector).
        let mut decode_copy = both.clone();
        decode_copy.labels.insert("role".into(), "d".into());
        t.handle(1, StreamEvent::Apply(decode_copy), now);
        assert_eq!(urls(&t, RoleKind::Decode, now).len(), 1);
        t.handle(0, StreamEvent::Apply(both.clone()), now);
        assert_eq!(urls(&t, RoleKind::Decode, now).len(), 0);
        let prefill = t.registries().prefill.snapshot(now);
        assert_eq!(prefill.entries[0].registration.bootstrap_port, Some(8998));
        // A decode pod ignores the annotation; a bad one is counted once.
        let mut d = pod("u2", "10.0.0.2", &[("role", "d")]);
        d.bootstrap_port = Err("x".into());
        let report = t.handle(1, StreamEvent::Apply(d), now);
        assert_eq!(report.invalid_annotations, 0);
        let mut p = pod("u3", "10.0.0.3", &[("role", "p")]);
        p.bootstrap_port = Err("http".into());
        assert_eq!(
            t.handle(0, StreamEvent::Apply(p.clone()), now)
                .invalid_annotations,
            1
        );
        assert_eq!(
            t.handle(0, StreamEvent::Apply(p), now).invalid_annotations,
            0
        );
        assert_eq!(t.workers(RoleKind::Prefill), 2);
    }

    #[test]
    fn a_relist_replaces_the_set_at_init_done_only() {
        let now = Instant::now();
        let mut t = pd_tracker();
        t.handle(0, StreamEvent::Init, now);
        t.handle(
            0,
            StreamEvent::InitApply(pod("a", "10.0.0.1", &[("role", "p")])),
            now,
        );
        assert!(
            urls(&t, RoleKind::Prefill, now).is_empty(),
            "buffered until InitDone"
        );
        t.handle(
            0,
            StreamEvent::InitApply(pod("b", "10.0.0.2", &[("role", "p")])),
            now,
        );
        t.handle(0, StreamEvent::InitDone, now);
        assert!(!t.synced(), "the decode stream has not listed yet");
        t.handle(1, StreamEvent::Init, now);
        t.handle(1, StreamEvent::InitDone, now);
        assert!(t.synced());
        assert_eq!(urls(&t, RoleKind::Prefill, now).len(), 2);
        // `a` was deleted during an outage: the re-list does not list it.
        t.handle(0, StreamEvent::Init, now);
        t.handle(
            0,
            StreamEvent::InitApply(pod("b", "10.0.0.2", &[("role", "p")])),
            now,
        );
        assert_eq!(
            urls(&t, RoleKind::Prefill, now).len(),
            2,
            "nothing leaves mid-list"
        );
        let report = t.handle(0, StreamEvent::InitDone, now);
        assert_eq!(report.deregistered.len(), 1);
        assert_eq!(report.registered.len(), 0, "b keeps its generation");
        assert_eq!(
            urls(&t, RoleKind::Prefill, now)[0].0,
            "http://10.0.0.2:8000"
        );
    }

    #[test]
    fn a_pod_recreated_at_the_same_ip_is_a_new_generation() {
        let now = Instant::now();
        let mut t = pd_tracker();
        let old = pod("old", "10.0.0.1", &[("role", "d")]);
        t.handle(1, StreamEvent::Apply(old.clone()), now);
        let first = urls(&t, RoleKind::Decode, now);
        // The new pod appears before the old one's deletion is seen: the
        // old one keeps the endpoint until it leaves.
        let new = pod("new", "10.0.0.1", &[("role", "d")]);
        t.handle(1, StreamEvent::Apply(new), now);
        assert_eq!(urls(&t, RoleKind::Decode, now), first);
        let report = t.handle(1, StreamEvent::Delete(old), now);
        assert_eq!(report.deregistered.len(), 1);
        assert_eq!(report.registered.len(), 1);
        let second = urls(&t, RoleKind::Decode, now);
        assert_eq!(second[0].0, first[0].0);
        assert!(second[0].1 > first[0].1, "{first:?} -> {second:?}");
        let entry = &t.registries().decode.snapshot(now).entries[0];
        assert_eq!(entry.registration.instance_id.as_deref(), Some("new"));
    }

    #[test]
    fn ipv6_pods_are_bracketed_and_pods_move_between_roles() {
        let now = Instant::now();
        let mut t = pd_tracker();
        let p = pod("u", "fd00::1", &[("role", "p")]);
        t.handle(0, StreamEvent::Apply(p.clone()), now);
        assert_eq!(
            urls(&t, RoleKind::Prefill, now)[0].0,
            "http://[fd00::1]:8000"
        );
        // Relabelled to decode: it leaves the prefill stream, joins decode.
        let mut d = p.clone();
        d.labels.insert("role".into(), "d".into());
        t.handle(0, StreamEvent::Delete(p), now);
        t.handle(1, StreamEvent::Apply(d), now);
        assert!(urls(&t, RoleKind::Prefill, now).is_empty());
        assert_eq!(urls(&t, RoleKind::Decode, now).len(), 1);
        // Events of an unknown stream are ignored.
        assert_eq!(
            t.handle(9, StreamEvent::InitDone, now),
            SyncReport::default()
        );
    }

    #[test]
    fn pods_are_read_from_the_api_objects() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                         "labels": {"app": "v"},
                         "annotations": {BOOTSTRAP_PORT_ANNOTATION: "8998"}},
            "status": {"phase": "Running", "podIP": "10.1.2.3",
                       "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        let info = PodInfo::from_pod(&pod, BOOTSTRAP_PORT_ANNOTATION).unwrap();
        assert_eq!(info.not_a_worker(), None);
        assert_eq!(info.bootstrap_port, Ok(Some(8998)));
        assert_eq!(info.display_name(), "ns/p");
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "uid": "u1",
                         "annotations": {BOOTSTRAP_PORT_ANNOTATION: "0"}},
            "status": {"phase": "Pending", "podIP": "not-an-ip"}
        }))
        .unwrap();
        let info = PodInfo::from_pod(&pod, BOOTSTRAP_PORT_ANNOTATION).unwrap();
        assert_eq!(info.not_a_worker(), Some("not running"));
        assert_eq!(info.ip, None);
        assert_eq!(info.bootstrap_port, Err("0".into()));
        let nameless: Pod = serde_json::from_value(serde_json::json!({"metadata": {}})).unwrap();
        assert!(PodInfo::from_pod(&nameless, BOOTSTRAP_PORT_ANNOTATION).is_none());
    }
}
