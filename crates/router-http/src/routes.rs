//! The route table: which handler a method and path go to.
//!
//! The OpenAI routes are proxied with their body read for routing; the
//! router's own routes (health, status, admin, metrics) are answered by the
//! router; every other method and path is proxied transparently, with the
//! same load accounting as the named routes.

use crate::extract::RouteKind;
use http::Method;

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Route {
    /// Proxied to a selected worker, its body read as this kind.
    Proxy(RouteKind),
    /// `GET /v1/models`: the models the workers serve.
    Models,
    /// `GET /health`: 200 while the router is up and accepting requests.
    Health,
    /// `GET /liveness`: always 200.
    Liveness,
    /// `GET /readiness`: 200 only when every required role has an available worker.
    Readiness,
    /// `GET /metrics`: Prometheus text.
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
}

impl Route {
    /// Every route, in the order of [`Route::index`].
    pub const ALL: [Route; 17] = [
        Self::Proxy(RouteKind::ChatCompletions),
        Self::Proxy(RouteKind::Completions),
        Self::Proxy(RouteKind::Embeddings),
        Self::Proxy(RouteKind::Rerank),
        Self::Proxy(RouteKind::Responses),
        Self::Proxy(RouteKind::Generate),
        Self::Proxy(RouteKind::Other),
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
    ];

    /// This route's position in [`Route::ALL`], for per-route counters
    /// kept in fixed arrays.
    pub const fn index(self) -> usize {
        match self {
            Self::Proxy(RouteKind::ChatCompletions) => 0,
            Self::Proxy(RouteKind::Completions) => 1,
            Self::Proxy(RouteKind::Embeddings) => 2,
            Self::Proxy(RouteKind::Rerank) => 3,
            Self::Proxy(RouteKind::Responses) => 4,
            Self::Proxy(RouteKind::Generate) => 5,
            Self::Proxy(RouteKind::Other) => 6,
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
        }
    }

    /// Routes `method` and `path` (without the query).
    pub fn of(method: &Method, path: &str) -> Self {
        let path = path
            .strip_suffix('/')
            .filter(|p| !p.is_empty())
            .unwrap_or(path);
        match (method, path) {
            (&Method::POST, "/v1/chat/completions") => Self::Proxy(RouteKind::ChatCompletions),
            (&Method::POST, "/v1/completions") => Self::Proxy(RouteKind::Completions),
            (&Method::POST, "/v1/embeddings") => Self::Proxy(RouteKind::Embeddings),
            (&Method::POST, "/v1/rerank" | "/rerank") => Self::Proxy(RouteKind::Rerank),
            (&Method::POST, "/v1/responses") => Self::Proxy(RouteKind::Responses),
            (&Method::POST, "/generate") => Self::Proxy(RouteKind::Generate),
            (&Method::GET, "/v1/models") => Self::Models,
            (&Method::GET, "/health") => Self::Health,
            (&Method::GET, "/liveness") => Self::Liveness,
            (&Method::GET, "/readiness") => Self::Readiness,
            (&Method::GET, "/metrics") => Self::Metrics,
            (&Method::POST, "/add_worker") => Self::AddWorker,
            (&Method::POST | &Method::DELETE, "/remove_worker") => Self::RemoveWorker,
            (&Method::GET, "/list_workers") => Self::ListWorkers,
            (&Method::GET, "/workers") => Self::Workers,
            (&Method::POST, "/register") => Self::Register,
            _ => Self::Proxy(RouteKind::Other),
        }
    }

    /// Whether this is an admin route (guarded by the admin key).
    pub fn is_admin(self) -> bool {
        matches!(self, Self::AddWorker | Self::RemoveWorker | Self::Register)
    }

    /// Whether this route needs the inference API key when one is set.
    /// Probes and metrics stay open so orchestrators can reach them.
    pub fn needs_api_key(self) -> bool {
        matches!(self, Self::Proxy(_) | Self::Models)
    }

    /// A short, fixed label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Self::Proxy(RouteKind::ChatCompletions) => "chat_completions",
            Self::Proxy(RouteKind::Completions) => "completions",
            Self::Proxy(RouteKind::Embeddings) => "embeddings",
            Self::Proxy(RouteKind::Rerank) => "rerank",
            Self::Proxy(RouteKind::Responses) => "responses",
            Self::Proxy(RouteKind::Generate) => "generate",
            Self::Proxy(RouteKind::Other) => "other",
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
        }
    }
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
            Route::Proxy(RouteKind::ChatCompletions)
        );
        assert_eq!(
            Route::of(&Method::POST, "/rerank"),
            Route::Proxy(RouteKind::Rerank)
        );
        assert_eq!(
            Route::of(&Method::POST, "/v1/completions/"),
            Route::Proxy(RouteKind::Completions)
        );
    }

    #[test]
    fn unknown_paths_and_methods_are_proxied_transparently() {
        assert_eq!(
            Route::of(&Method::POST, "/tokenize"),
            Route::Proxy(RouteKind::Other)
        );
        assert_eq!(
            Route::of(&Method::GET, "/v1/chat/completions"),
            Route::Proxy(RouteKind::Other)
        );
    }

    #[test]
    fn admin_routes_are_marked() {
        assert!(Route::of(&Method::POST, "/add_worker").is_admin());
        assert!(!Route::of(&Method::GET, "/workers").is_admin());
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
