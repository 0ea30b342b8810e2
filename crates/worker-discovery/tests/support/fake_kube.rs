//! A fake Kubernetes API server for tests: pods only, in memory, served by
//! hyper on 127.0.0.1 so that the real kube-rs client and watcher talk to
//! it over plain HTTP. It lists and watches pods with resource versions and
//! label selectors, sends ADDED/MODIFIED/DELETED/BOOKMARK events (a change
//! that makes a pod stop or start matching a watch's selector is sent as
//! DELETED or ADDED, as the API server's watch cache does), ends watch
//! connections on demand, fails during an "outage" (503), refuses with 403,
//! and answers a watch from a compacted resource version with 410 Gone.
//!
//! Shared by worker-discovery's tests/kubernetes.rs and the facade's
//! tests/cli_kubernetes.rs (included by path).
#![allow(dead_code, reason = "each test binary uses part of the fake")]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Added,
    Modified,
    Deleted,
    Bookmark,
}

#[derive(Debug)]
struct LogEntry {
    rv: u64,
    kind: Kind,
    /// Labels before a modification (to turn it into ADDED or DELETED for
    /// a selector, as the API server's watch cache does).
    before: Option<BTreeMap<String, String>>,
    object: Value,
}

#[derive(Debug, Default)]
struct State {
    rv: u64,
    pods: BTreeMap<String, Value>,
    log: Vec<LogEntry>,
    /// Watches from a resource version below this get 410 Gone.
    floor: u64,
    outage: bool,
    forbidden: bool,
    lists: u64,
    watches: u64,
}

#[derive(Debug)]
pub(crate) struct FakeApi {
    state: Mutex<State>,
    /// Ticks at every change; a new epoch ends the open watches.
    tick: watch::Sender<(u64, u64)>,
}

type Body = BoxBody<Bytes, Infallible>;

fn labels_of(object: &Value) -> BTreeMap<String, String> {
    object["metadata"]["labels"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

fn uid_of(object: &Value) -> String {
    object["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

impl FakeApi {
    pub(crate) async fn start() -> (Arc<Self>, SocketAddr) {
        let api = Arc::new(Self {
            state: Mutex::new(State::default()),
            tick: watch::channel((0, 0)).0,
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = Arc::clone(&api);
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let api = Arc::clone(&server);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let api = Arc::clone(&api);
                        async move { Ok::<_, Infallible>(api.handle(req)) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        (api, addr)
    }

    fn bump(&self, state: &State) {
        self.tick.send_modify(|t| t.0 = state.rv);
    }

    fn record(
        &self,
        state: &mut State,
        kind: Kind,
        before: Option<BTreeMap<String, String>>,
        mut object: Value,
    ) {
        state.rv += 1;
        object["metadata"]["resourceVersion"] = json!(state.rv.to_string());
        let uid = uid_of(&object);
        if kind == Kind::Deleted {
            state.pods.remove(&uid);
        } else {
            state.pods.insert(uid, object.clone());
        }
        let rv = state.rv;
        state.log.push(LogEntry {
            rv,
            kind,
            before,
            object,
        });
        self.bump(state);
    }

    pub(crate) fn create(&self, pod: Value) {
        let mut state = self.state.lock().unwrap();
        self.record(&mut state, Kind::Added, None, pod);
    }

    pub(crate) fn modify(&self, uid: &str, change: impl FnOnce(&mut Value)) {
        let mut state = self.state.lock().unwrap();
        let mut pod = state.pods[uid].clone();
        let before = labels_of(&pod);
        change(&mut pod);
        self.record(&mut state, Kind::Modified, Some(before), pod);
    }

    pub(crate) fn delete(&self, uid: &str) {
        let mut state = self.state.lock().unwrap();
        let pod = state.pods[uid].clone();
        self.record(&mut state, Kind::Deleted, None, pod);
    }

    /// A BOOKMARK at the current resource version, to every watch.
    pub(crate) fn bookmark(&self) {
        let mut state = self.state.lock().unwrap();
        let rv = state.rv;
        state.log.push(LogEntry {
            rv,
            kind: Kind::Bookmark,
            before: None,
            object: json!({"kind": "Pod", "apiVersion": "v1",
                           "metadata": {"resourceVersion": rv.to_string()}}),
        });
        self.bump(&state);
    }

    /// Ends every open watch connection (cleanly, as a server restart or
    /// a load balancer's idle timeout does).
    pub(crate) fn drop_watches(&self) {
        self.tick.send_modify(|t| t.1 += 1);
    }

    /// Forgets the history: a watch resuming from before now gets 410.
    pub(crate) fn compact(&self) {
        let mut state = self.state.lock().unwrap();
        state.floor = state.rv;
    }

    pub(crate) fn set_outage(&self, outage: bool) {
        self.state.lock().unwrap().outage = outage;
    }

    pub(crate) fn set_forbidden(&self, forbidden: bool) {
        self.state.lock().unwrap().forbidden = forbidden;
    }

    /// The current resource version.
    pub(crate) fn resource_version(&self) -> u64 {
        self.state.lock().unwrap().rv
    }

    /// Lists served so far.
    pub(crate) fn lists(&self) -> u64 {
        self.state.lock().unwrap().lists
    }

    /// Watches opened so far.
    pub(crate) fn watches(&self) -> u64 {
        self.state.lock().unwrap().watches
    }

    fn handle(
        self: &Arc<Self>,
        req: hyper::Request<hyper::body::Incoming>,
    ) -> hyper::Response<Body> {
        let path = req.uri().path().to_owned();
        let query = parse_query(req.uri().query().unwrap_or_default());
        let namespace = match path.split('/').collect::<Vec<_>>().as_slice() {
            ["", "api", "v1", "pods"] => None,
            ["", "api", "v1", "namespaces", ns, "pods"] => Some((*ns).to_owned()),
            _ => return status(404, "NotFound", "no such path"),
        };
        let selector: BTreeMap<String, String> = query
            .get("labelSelector")
            .map(|s| {
                s.split(',')
                    .filter_map(|term| term.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let visible = move |object: &Value, labels: &BTreeMap<String, String>| {
            namespace
                .as_deref()
                .is_none_or(|ns| object["metadata"]["namespace"] == ns)
                && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
        };
        let mut state = self.state.lock().unwrap();
        if state.forbidden {
            return status(
                403,
                "Forbidden",
                "pods is forbidden: User \"system:serviceaccount:default:router\" cannot list \
                 resource \"pods\"",
            );
        }
        if state.outage {
            return status(503, "ServiceUnavailable", "the API server is restarting");
        }
        let watching = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
        if !watching {
            state.lists += 1;
            let items: Vec<Value> = state
                .pods
                .values()
                .filter(|pod| visible(pod, &labels_of(pod)))
                .cloned()
                .collect();
            let list = json!({"kind": "PodList", "apiVersion": "v1",
                              "metadata": {"resourceVersion": state.rv.to_string()},
                              "items": items});
            return respond(200, Full::new(Bytes::from(list.to_string())).boxed());
        }
        state.watches += 1;
        let from: u64 = query
            .get("resourceVersion")
            .and_then(|rv| rv.parse().ok())
            .unwrap_or(state.rv);
        if from < state.floor {
            let gone = json!({"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("too old resource version: {from} ({})", state.floor),
                "reason": "Expired", "code": 410}});
            return respond(200, Full::new(Bytes::from(format!("{gone}\n"))).boxed());
        }
        let mut next = state.log.partition_point(|e| e.rv <= from);
        drop(state);
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        let mut ticks = self.tick.subscribe();
        let epoch = ticks.borrow().1;
        let shared = Arc::clone(self);
        let visible = visible.clone();
        tokio::spawn(async move {
            loop {
                let lines: Vec<String> = {
                    let state = shared.state.lock().unwrap();
                    let entries = &state.log[next..];
                    next = state.log.len();
                    entries
                        .iter()
                        .filter_map(|e| {
                            let kind = match e.kind {
                                Kind::Bookmark => "BOOKMARK",
                                kind => {
                                    let now = visible(&e.object, &labels_of(&e.object));
                                    let was =
                                        e.before.as_ref().is_some_and(|b| visible(&e.object, b));
                                    match (kind, was, now) {
                                        (Kind::Added, _, true) => "ADDED",
                                        (Kind::Deleted, _, true) => "DELETED",
                                        (Kind::Modified, true, true) => "MODIFIED",
                                        (Kind::Modified, false, true) => "ADDED",
                                        (Kind::Modified, true, false) => "DELETED",
                                        _ => return None,
                                    }
                                }
                            };
                            Some(format!("{}\n", json!({"type": kind, "object": e.object})))
                        })
                        .collect()
                };
                for line in lines {
                    if tx.send(Bytes::from(line)).await.is_err() {
                        return;
                    }
                }
                if ticks.borrow_and_update().1 != epoch {
                    return;
                }
                // Woken by a change: the loop sends what is new first, then
                // ends the stream if the watches were dropped meanwhile.
                tokio::select! {
                    changed = ticks.changed() => if changed.is_err() { return },
                    () = tx.closed() => return,
                }
            }
        });
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|bytes| (Ok::<_, Infallible>(Frame::data(bytes)), rx))
        });
        respond(200, StreamBody::new(stream).boxed())
    }
}

fn respond(code: u16, body: Body) -> hyper::Response<Body> {
    hyper::Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(body)
        .unwrap()
}

fn status(code: u16, reason: &str, message: &str) -> hyper::Response<Body> {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": message, "reason": reason, "code": code});
    respond(code, Full::new(Bytes::from(body.to_string())).boxed())
}

fn parse_query(query: &str) -> BTreeMap<String, String> {
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (decode(k), decode(v)))
        .collect()
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                out.push(u8::from_str_radix(hex, 16).unwrap_or(b'?'));
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
