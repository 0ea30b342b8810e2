//! The route table: which handler a method and request target go to.
//!
//! Only named routes exist. The OpenAI routes (and a few other inference
//! endpoints of vLLM's server) are proxied to a worker; the router's own
//! routes (health, status, admin, metrics) are answered by the router. A
//! known path with another method is 405 with `Allow`; any other path is 404
//! from the router and never reaches a worker, unless the operator lists it
//! for pass-through ([`RouterConfig::passthrough_paths`]).
//!
//! Request targets that are not a path are answered by the router too:
//! `OPTIONS *` (asterisk form) gets 200 with the methods the router serves,
//! `CONNECT` (authority form) gets 405, and a path with `.` or `..` segments
//! gets 400. Forwarding them would make a worker pay for the router's
//! parsing: `OPTIONS *` once turned into the upstream URL
//! `http://host:port*`, whose connection failures opened every breaker.
//!
//! [`RouterConfig::passthrough_paths`]: crate::RouterConfig::passthrough_paths

use crate::extract::ApiKind;
use http::Method;

/// The methods the router serves on some path, for `OPTIONS *` and the
/// `Allow` header of a `CONNECT`.
pub const SERVER_METHODS: &str = "GET, POST, DELETE, OPTIONS";

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Route {
    /// Proxied to a selected worker, its body read as this kind.
    Proxy(ApiKind),
    /// `GET /v1/models`: the models the workers serve.
    Models,
    /// `GET /health`: 200 while the router is up and accepting requests
    /// (503 while the startup gate awaits workers).
    Health,
    /// `GET /liveness`: always 200.
    Liveness,
    /// `GET /readiness`: 200 only when the startup gate is open and every
    /// required role has an available worker.
    Readiness,
    /// `GET /metrics`: Prometheus text. It lists every worker URL: with an
    /// admin key set it needs that key (checked by its handler, see
    /// [`RouterConfig::metrics_open`](crate::RouterConfig::metrics_open)).
    Metrics,
    /// `POST /add_worker?url=`.
    AddWorker,
    /// `POST /remove_worker?url=`.
    RemoveWorker,
    /// `GET /list_workers`: `{"urls": [...]}`.
    ListWorkers,
    /// `GET /workers`: one object per worker with its live state.
    Workers,
    /// `POST /register`: discovery registration over HTTP.
    Register,
    /// `POST /peer_choices`: routing choices from a peer replica (see
    /// `crate::peers`); needs the peer token, 404 without one configured.
    PeerChoices,
    /// A known path with a method it does not take: 405 with `Allow`.
    WrongMethod {
        /// The methods the path takes, as an `Allow` header value.
        allow: &'static str,
    },
    /// No such route: 404 from the router.
    NotFound,
    /// `OPTIONS *`: 200 with [`SERVER_METHODS`].
    ServerOptions,
    /// A request target the router never forwards: `*` with a method other
    /// than `OPTIONS`, a target that is not a path, or a path with `.` or
    /// `..` segments. 400.
    InvalidTarget,
}

impl Route {
    /// Every route, in the order of [`Route::index`] (a
    /// [`Route::WrongMethod`] of any `allow` stands for all of them).
    pub const ALL: [Route; 22] = [
        Self::Proxy(ApiKind::ChatCompletions),
        Self::Proxy(ApiKind::Completions),
        Self::Proxy(ApiKind::Embeddings),
        Self::Proxy(ApiKind::Rerank),
        Self::Proxy(ApiKind::Responses),
        Self::Proxy(ApiKind::Generate),
        Self::Proxy(ApiKind::Other),
        Self::Models,
        Self::Health,
        Self::Liveness,
        Self::Readiness,
        Self::Metrics,
        Self::AddWorker,
        Self::RemoveWorker,
        Self::ListWorkers,
        Self::Workers,
        Self::Register,
        Self::PeerChoices,
        Self::WrongMethod { allow: "" },
        Self::NotFound,
        Self::ServerOptions,
        Self::InvalidTarget,
    ];

    /// This route's position in [`Route::ALL`], for per-route counters
    /// kept in fixed arrays.
    pub const fn index(self) -> usize {
        match self {
            Self::Proxy(ApiKind::ChatCompletions) => 0,
            Self::Proxy(ApiKind::Completions) => 1,
            Self::Proxy(ApiKind::Embeddings) => 2,
            Self::Proxy(ApiKind::Rerank) => 3,
            Self::Proxy(ApiKind::Responses) => 4,
            Self::Proxy(ApiKind::Generate) => 5,
            Self::Proxy(ApiKind::Other) => 6,
            Self::Models => 7,
            Self::Health => 8,
            Self::Liveness => 9,
            Self::Readiness => 10,
            Self::Metrics => 11,
            Self::AddWorker => 12,
            Self::RemoveWorker => 13,
            Self::ListWorkers => 14,
            Self::Workers => 15,
            Self::Register => 16,
            Self::PeerChoices => 17,
            Self::WrongMethod { .. } => 18,
            Self::NotFound => 19,
            Self::ServerOptions => 20,
            Self::InvalidTarget => 21,
        }
    }

    /// Routes `method` and a request's target: `path` is the URI's path
    /// (without the query), as hyper parsed it from the request line.
    pub fn of(method: &Method, path: &str) -> Self {
        if method == Method::CONNECT {
            return Self::WrongMethod {
                allow: SERVER_METHODS,
            };
        }
        if path == "*" {
            return match *method {
                Method::OPTIONS => Self::ServerOptions,
                _ => Self::InvalidTarget,
            };
        }
        if !path.starts_with('/') || has_dot_segment(path) {
            return Self::InvalidTarget;
        }
        let path = path
            .strip_suffix('/')
            .filter(|p| !p.is_empty())
            .unwrap_or(path);
        let Some((allow, route)) = Self::of_path(method, path) else {
            return Self::NotFound;
        };
        route.unwrap_or(Self::WrongMethod { allow })
    }

    /// The methods `path` takes and, when `method` is one of them, its
    /// route; `None` for an unknown path.
    fn of_path(method: &Method, path: &str) -> Option<(&'static str, Option<Self>)> {
        let post = |route: Self| Some(("POST", (method == Method::POST).then_some(route)));
        let get = |route: Self| Some(("GET", (method == Method::GET).then_some(route)));
        match path {
            "/v1/chat/completions" => post(Self::Proxy(ApiKind::ChatCompletions)),
            "/v1/completions" => post(Self::Proxy(ApiKind::Completions)),
            "/v1/embeddings" => post(Self::Proxy(ApiKind::Embeddings)),
            "/v1/rerank" | "/rerank" => post(Self::Proxy(ApiKind::Rerank)),
            "/v1/responses" => post(Self::Proxy(ApiKind::Responses)),
            "/generate" => post(Self::Proxy(ApiKind::Generate)),
            path if ENGINE_POST_PATHS.contains(&path) => post(Self::Proxy(ApiKind::Other)),
            "/v1/models" => get(Self::Models),
            "/health" => get(Self::Health),
            "/liveness" => get(Self::Liveness),
            "/readiness" => get(Self::Readiness),
            "/metrics" => get(Self::Metrics),
            "/list_workers" => get(Self::ListWorkers),
            "/workers" => get(Self::Workers),
            "/add_worker" => post(Self::AddWorker),
            "/register" => post(Self::Register),
            "/peer_choices" => post(Self::PeerChoices),
            "/remove_worker" => Some((
                "POST, DELETE",
                matches!(*method, Method::POST | Method::DELETE).then_some(Self::RemoveWorker),
            )),
            _ => None,
        }
    }

    /// Whether this is an admin route that changes the fleet (guarded by
    /// the admin key).
    pub fn is_admin(self) -> bool {
        matches!(self, Self::AddWorker | Self::RemoveWorker | Self::Register)
    }

    /// Whether this route reads the fleet's membership (worker URLs): with
    /// an admin key set it needs that key, like the admin writes.
    pub fn is_admin_read(self) -> bool {
        matches!(self, Self::ListWorkers | Self::Workers)
    }

    /// Whether this route needs the inference API key when one is set.
    /// Probes and metrics never need the inference key, so orchestrators
    /// can reach them (`/metrics` needs the admin key when one is set,
    /// checked by its handler).
    pub fn needs_api_key(self) -> bool {
        matches!(self, Self::Proxy(_) | Self::Models)
    }

    /// A short, fixed label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Self::Proxy(ApiKind::ChatCompletions) => "chat_completions",
            Self::Proxy(ApiKind::Completions) => "completions",
            Self::Proxy(ApiKind::Embeddings) => "embeddings",
            Self::Proxy(ApiKind::Rerank) => "rerank",
            Self::Proxy(ApiKind::Responses) => "responses",
            Self::Proxy(ApiKind::Generate) => "generate",
            Self::Proxy(ApiKind::Other) => "other",
            Self::Models => "models",
            Self::Health => "health",
            Self::Liveness => "liveness",
            Self::Readiness => "readiness",
            Self::Metrics => "metrics",
            Self::AddWorker => "add_worker",
            Self::RemoveWorker => "remove_worker",
            Self::ListWorkers => "list_workers",
            Self::Workers => "workers",
            Self::Register => "register",
            Self::PeerChoices => "peer_choices",
            Self::WrongMethod { .. } => "method_not_allowed",
            Self::NotFound => "not_found",
            Self::ServerOptions => "server_options",
            Self::InvalidTarget => "invalid_target",
        }
    }
}

/// Inference endpoints of vLLM's OpenAI-compatible server, besides the
/// OpenAI routes above, that are proxied (`POST`, load counted like any
/// proxied request, no routing text).
pub const ENGINE_POST_PATHS: [&str; 10] = [
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/v2/rerank",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/invocations",
];

/// The paths [`Route::of`] routes besides [`ENGINE_POST_PATHS`], so that a
/// known path can be named by a `&'static str` ([`Route::known_path`]).
#[cfg(feature = "otel")]
const ROUTER_PATHS: [&str; 18] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/rerank",
    "/rerank",
    "/v1/responses",
    "/generate",
    "/v1/models",
    "/health",
    "/liveness",
    "/readiness",
    "/metrics",
    "/list_workers",
    "/workers",
    "/add_worker",
    "/register",
    "/remove_worker",
    "/peer_choices",
];

/// Every path [`Route::known_path`] knows, in the order of its indices.
#[cfg(feature = "otel")]
pub(crate) fn known_paths() -> impl Iterator<Item = &'static str> {
    ROUTER_PATHS.iter().chain(ENGINE_POST_PATHS.iter()).copied()
}

#[cfg(feature = "otel")]
impl Route {
    /// A path the router routes, spelled as its route (without a
    /// trailing `/`), and its position in [`known_paths`]; `None` for any
    /// other path. A trace names a request's route with it without
    /// allocating: it runs on every traced request.
    pub(crate) fn known_path(path: &str) -> Option<(usize, &'static str)> {
        let path = path
            .strip_suffix('/')
            .filter(|p| !p.is_empty())
            .unwrap_or(path);
        known_paths().enumerate().find(|(_, known)| *known == path)
    }
}

/// Whether `path` has a `.` or `..` segment, also percent-encoded: such a
/// path names another path once normalized, and is never forwarded.
fn has_dot_segment(path: &str) -> bool {
    path.split('/').any(is_dot_segment)
}

/// `.` or `..`, each dot possibly written `%2e` or `%2E` (no allocation:
/// this runs on every request).
fn is_dot_segment(segment: &str) -> bool {
    let bytes = segment.as_bytes();
    let (mut index, mut dots) = (0, 0);
    while index < bytes.len() {
        match bytes[index..] {
            [b'.', ..] => index += 1,
            [b'%', b'2', e, ..] if e.eq_ignore_ascii_case(&b'e') => index += 3,
            _ => return false,
        }
        dots += 1;
        if dots > 2 {
            return false;
        }
    }
    dots > 0
}

/// Whether `path` is covered by a pass-through entry: an exact path, or a
/// prefix when the entry ends in `/*` (`/v1/audio/*`). A trailing `/` on
/// either side is ignored.
pub fn passthrough_matches(entries: &[String], path: &str) -> bool {
    if !path.starts_with('/') || has_dot_segment(path) {
        return false;
    }
    let path = path
        .strip_suffix('/')
        .filter(|p| !p.is_empty())
        .unwrap_or(path);
    entries.iter().any(|entry| match entry.strip_suffix("/*") {
        Some(prefix) => path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/')),
        None => entry.strip_suffix('/').unwrap_or(entry) == path,
    })
}

/// The value of `name` in a query string, percent-decoded.
pub fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    query?
        .split('&')
        .filter_map(|pair| pair.split_once('=').or(Some((pair, ""))))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| percent_decode(value))
}

fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        match bytes[index] {
            b'%' if index + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[index + 1..index + 3]).ok();
                match hex.and_then(|hex| u8::from_str_radix(hex, 16).ok()) {
                    Some(byte) => {
                        decoded.push(byte);
                        index += 3;
                    }
                    None => {
                        decoded.push(b'%');
                        index += 1;
                    }
                }
            }
            b'+' => {
                decoded.push(b' ');
                index += 1;
            }
            byte => {
                decoded.push(byte);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_routes_are_proxied_with_their_kind() {
        assert_eq!(
            Route::of(&Method::POST, "/v1/chat/completions"),
            Route::Proxy(ApiKind::ChatCompletions)
        );
        assert_eq!(
            Route::of(&Method::POST, "/rerank"),
            Route::Proxy(ApiKind::Rerank)
        );
        assert_eq!(
            Route::of(&Method::POST, "/v1/completions/"),
            Route::Proxy(ApiKind::Completions)
        );
    }

    #[test]
    fn unknown_paths_are_not_found_and_known_paths_refuse_other_methods() {
        for path in [
            "/",
            "/v1/unknown",
            "/etc/passwd",
            "/add_worker/x",
            "/v1/chat",
        ] {
            assert_eq!(Route::of(&Method::POST, path), Route::NotFound, "{path}");
        }
        assert_eq!(
            Route::of(&Method::GET, "/v1/chat/completions"),
            Route::WrongMethod { allow: "POST" }
        );
        assert_eq!(
            Route::of(&Method::GET, "/add_worker"),
            Route::WrongMethod { allow: "POST" }
        );
        assert_eq!(
            Route::of(&Method::PUT, "/remove_worker"),
            Route::WrongMethod {
                allow: "POST, DELETE"
            }
        );
        assert_eq!(
            Route::of(&Method::POST, "/tokenize"),
            Route::Proxy(ApiKind::Other)
        );
    }

    #[test]
    fn request_targets_that_are_not_plain_paths_are_answered_by_the_router() {
        assert_eq!(Route::of(&Method::OPTIONS, "*"), Route::ServerOptions);
        assert_eq!(Route::of(&Method::GET, "*"), Route::InvalidTarget);
        assert_eq!(
            Route::of(&Method::CONNECT, ""),
            Route::WrongMethod {
                allow: SERVER_METHODS
            }
        );
        for path in [
            "",
            "v1/models",
            "/../../etc/passwd",
            "/v1/./models",
            "/v1/%2e%2E/x",
            "/v1/..",
        ] {
            assert_eq!(
                Route::of(&Method::GET, path),
                Route::InvalidTarget,
                "{path}"
            );
        }
    }

    #[test]
    #[cfg(feature = "otel")]
    fn every_known_path_is_routed_and_named_by_itself() {
        for (index, path) in known_paths().enumerate() {
            let routed = [Method::GET, Method::POST]
                .iter()
                .any(|method| !matches!(Route::of(method, path), Route::NotFound));
            assert!(routed, "{path} is not routed");
            assert_eq!(Route::known_path(path), Some((index, path)));
            let slashed = format!("{path}/");
            assert_eq!(Route::known_path(&slashed), Some((index, path)));
        }
        assert_eq!(Route::known_path("/v1/chat"), None);
        assert_eq!(Route::known_path("/"), None);
        assert_eq!(Route::known_path(""), None);
    }

    #[test]
    fn passthrough_entries_match_exact_paths_and_prefixes() {
        let entries = vec!["/version".to_owned(), "/v1/audio/*".to_owned()];
        assert!(passthrough_matches(&entries, "/version"));
        assert!(passthrough_matches(&entries, "/version/"));
        assert!(passthrough_matches(&entries, "/v1/audio/speech"));
        assert!(!passthrough_matches(&entries, "/v1/audio"));
        assert!(!passthrough_matches(&entries, "/v1/audiox/y"));
        assert!(!passthrough_matches(&entries, "/v1/audio/../../admin"));
        assert!(!passthrough_matches(&entries, "/versions"));
    }

    #[test]
    fn admin_routes_are_marked() {
        assert!(Route::of(&Method::POST, "/add_worker").is_admin());
        assert!(!Route::of(&Method::GET, "/workers").is_admin());
        assert!(Route::of(&Method::GET, "/workers").is_admin_read());
        assert!(Route::of(&Method::GET, "/list_workers").is_admin_read());
        assert!(!Route::of(&Method::GET, "/health").needs_api_key());
        assert!(Route::of(&Method::POST, "/v1/completions").needs_api_key());
    }

    #[test]
    fn every_route_has_its_own_index_and_label() {
        for (position, route) in Route::ALL.iter().enumerate() {
            assert_eq!(route.index(), position, "{route:?}");
        }
        let mut labels: Vec<_> = Route::ALL.iter().map(|r| r.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Route::ALL.len());
    }

    #[test]
    fn query_parameters_are_decoded() {
        let query = Some("x=1&url=http%3A%2F%2F127.0.0.1%3A8001&flag");
        assert_eq!(
            query_param(query, "url").as_deref(),
            Some("http://127.0.0.1:8001")
        );
        assert_eq!(query_param(query, "flag").as_deref(), Some(""));
        assert_eq!(query_param(query, "missing"), None);
        assert_eq!(query_param(Some("a=%zz%4"), "a").as_deref(), Some("%zz%4"));
    }
}
