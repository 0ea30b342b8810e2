//! Routing on the engine's token ids (feature `tokens`, on by default).
//!
//! An engine caches *token blocks* of the chat template's rendering, not
//! the characters of the message texts: the template adds role markers,
//! dates and tool definitions, and only whole blocks are reused. With a
//! [`PromptTokenizer`] for a model, the router computes the ids the engine
//! will compute (the model's chat template and `tokenizer.json`, through
//! [`prompt_tokens`]) and routes on [`Routing::Tokens`]; cache-aware then
//! counts matches in whole blocks of the engine's block size
//! (`CacheAwareConfig::block_size`).
//!
//! A model without a tokenizer routes on text, as before. A request whose
//! rendering or tokenization fails (a template that raises on the
//! conversation, a batch of completion prompts) routes on text too and is
//! counted: the engine answers such a request with its own error, and a
//! router whose template drifted from the engine's keeps serving.
//!
//! ```
//! use router_http::RouterConfig;
//! use router_http::tokens::Tokenizers;
//! use prompt_tokens::PromptTokenizer;
//! use std::sync::Arc;
//!
//! // engine-sim's synthetic tokenizer for every model; a real deployment
//! // loads the model directory: PromptTokenizer::from_path(dir, None).
//! let tokenizers = Tokenizers::default().with_default(Arc::new(PromptTokenizer::synthetic(4)));
//! let config = RouterConfig { tokenizers, ..RouterConfig::default() };
//! assert!(config.tokenizers.for_model("any-model").is_some());
//! ```

use crate::error::ApiError;
use crate::extract::{RequestInfo, RouteKind, Routing};
use crate::metrics::Counter;
use prom_text::{Exposition, MetricType};
use prompt_tokens::{ChatRequest, CompletionRequest, PromptTokenizer};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The label under which the tokenizer for every other model is reported.
pub const DEFAULT_MODEL_LABEL: &str = "*";

/// A model's tokenizer and what it did.
#[derive(Debug)]
pub struct ModelTokens {
    tokenizer: Arc<PromptTokenizer>,
    routed: Counter,
    failed: Counter,
    /// Nanoseconds spent computing token ids (parse, render, tokenize),
    /// successes and failures alike.
    compute_nanos: AtomicU64,
}

impl ModelTokens {
    fn new(tokenizer: Arc<PromptTokenizer>) -> Arc<Self> {
        Arc::new(Self {
            tokenizer,
            routed: Counter::default(),
            failed: Counter::default(),
            compute_nanos: AtomicU64::new(0),
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<PromptTokenizer> {
        &self.tokenizer
    }

    /// Requests routed on token ids.
    pub fn routed(&self) -> u64 {
        self.routed.get()
    }

    /// Requests that fell back to text because rendering or tokenizing
    /// failed.
    pub fn failed(&self) -> u64 {
        self.failed.get()
    }

    /// The token ids of a chat or text completion body (`None` for other
    /// routes), timed and counted; a failure is logged and counted here.
    fn ids(&self, kind: RouteKind, body: &[u8], model: &str) -> Option<Result<Vec<u32>, ()>> {
        let tokenizer = &self.tokenizer;
        let started = Instant::now();
        let ids = match kind {
            RouteKind::ChatCompletions => {
                ChatRequest::from_json(body).and_then(|request| tokenizer.chat_tokens(&request))
            }
            RouteKind::Completions => CompletionRequest::from_json(body)
                .and_then(|request| tokenizer.completion_tokens(&request)),
            _ => return None,
        };
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.compute_nanos.fetch_add(nanos, Ordering::Relaxed);
        Some(match ids {
            Ok(ids) => {
                self.routed.inc();
                Ok(ids)
            }
            Err(error) => {
                self.failed.inc();
                tracing::debug!(%model, %error, "cannot compute the prompt's token ids; routing on text");
                Err(())
            }
        })
    }

    /// Time spent computing requests' token ids (body parse, template
    /// rendering, tokenization), in seconds: the part of the router's CPU
    /// time that routing on tokens adds (the computation runs on the
    /// request's task without yielding).
    pub fn compute_seconds(&self) -> f64 {
        self.compute_nanos.load(Ordering::Relaxed) as f64 / 1e9
    }
}

/// Which models route on token ids, and with which tokenizer: per model id,
/// and optionally one for every other model. Cheap to clone (shared
/// entries, shared counters).
#[derive(Clone, Default)]
pub struct Tokenizers {
    by_model: BTreeMap<String, Arc<ModelTokens>>,
    default: Option<Arc<ModelTokens>>,
}

impl fmt::Debug for Tokenizers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for (model, entry) in self.entries() {
            map.entry(&model, &entry.tokenizer.describe());
        }
        map.finish()
    }
}

impl Tokenizers {
    /// `tokenizer` for requests naming `model`.
    pub fn with_model(mut self, model: impl Into<String>, tokenizer: Arc<PromptTokenizer>) -> Self {
        self.by_model
            .insert(model.into(), ModelTokens::new(tokenizer));
        self
    }

    /// `tokenizer` for every model without one of its own (also requests
    /// that name no model).
    pub fn with_default(mut self, tokenizer: Arc<PromptTokenizer>) -> Self {
        self.default = Some(ModelTokens::new(tokenizer));
        self
    }

    /// Whether no model routes on tokens.
    pub fn is_empty(&self) -> bool {
        self.by_model.is_empty() && self.default.is_none()
    }

    /// The entry requests for `model` use, if any.
    pub fn for_model(&self, model: &str) -> Option<&Arc<ModelTokens>> {
        self.by_model.get(model).or(self.default.as_ref())
    }

    /// Every entry with its model label ([`DEFAULT_MODEL_LABEL`] for the
    /// default), models in order, the default last.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &Arc<ModelTokens>)> {
        self.by_model
            .iter()
            .map(|(model, entry)| (model.as_str(), entry))
            .chain(
                self.default
                    .iter()
                    .map(|entry| (DEFAULT_MODEL_LABEL, entry)),
            )
    }

    /// How requests for `model` are routed: `"tokens"` or `"text"`.
    pub fn mode(&self, model: &str) -> &'static str {
        if self.for_model(model).is_some() {
            "tokens"
        } else {
            "text"
        }
    }

    /// The routing input of a request: its engine token ids when `model`
    /// has a tokenizer and the route is a chat or text completion, else
    /// `routing` (what [`extract`](crate::extract()) found) unchanged.
    pub fn route(&self, kind: RouteKind, body: &[u8], model: &str, routing: Routing) -> Routing {
        let Some(entry) = self.for_model(model) else {
            return routing;
        };
        // Ids as given are already what the engine sees.
        if kind == RouteKind::Completions && matches!(routing, Routing::Tokens(_)) {
            return routing;
        }
        match entry.ids(kind, body, model) {
            Some(Ok(ids)) => Routing::Tokens(ids),
            Some(Err(())) | None => routing,
        }
    }

    /// [`extract`](crate::extract()) and [`route`](Self::route) in one: a
    /// request's [`RequestInfo`] with the engine's token ids as its routing
    /// input where its model has a tokenizer. The body is checked as
    /// `extract` checks it (the same 400s); a chat request routed on tokens
    /// never has its routing text built (see
    /// [`extract_deferred`](crate::extract_deferred)), one whose ids cannot
    /// be computed gets it.
    pub fn extract(&self, kind: RouteKind, body: &[u8]) -> Result<RequestInfo, ApiError> {
        if kind != RouteKind::ChatCompletions || self.is_empty() {
            let mut info = crate::extract(kind, body)?;
            let text = std::mem::take(&mut info.routing);
            let model = info.model.as_deref().unwrap_or_default();
            info.routing = self.route(kind, body, model, text);
            return Ok(info);
        }
        let extracted = crate::extract_deferred(kind, body)?;
        let model = extracted.model().unwrap_or_default();
        let Some(entry) = self.for_model(model) else {
            return Ok(extracted.into_info());
        };
        Ok(match entry.ids(kind, body, model) {
            Some(Ok(ids)) => RequestInfo {
                routing: Routing::Tokens(ids),
                ..extracted.without_text()
            },
            Some(Err(())) | None => extracted.into_info(),
        })
    }

    /// Writes the `router_tokens_*` families.
    pub(crate) fn render(&self, exposition: &mut Exposition<'_>) {
        if self.is_empty() {
            return;
        }
        type Read = fn(&ModelTokens) -> u64;
        let families: [(&str, MetricType, &str, Read); 7] = [
            (
                "router_tokens_routed_total",
                MetricType::Counter,
                "Requests routed on the engine's token ids, by model (* = every other model).",
                ModelTokens::routed,
            ),
            (
                "router_tokens_fallbacks_total",
                MetricType::Counter,
                "Requests routed on text because rendering or tokenizing failed.",
                ModelTokens::failed,
            ),
            (
                "router_tokens_cache_hits_total",
                MetricType::Counter,
                "Segment cache hits (a segment's ids reused).",
                |m| m.tokenizer.cache_stats().hits,
            ),
            (
                "router_tokens_cache_misses_total",
                MetricType::Counter,
                "Segment cache misses (a segment tokenized).",
                |m| m.tokenizer.cache_stats().misses,
            ),
            (
                "router_tokens_cache_evictions_total",
                MetricType::Counter,
                "Segments evicted to stay within the cache's byte budget.",
                |m| m.tokenizer.cache_stats().evictions,
            ),
            (
                "router_tokens_cache_bytes",
                MetricType::Gauge,
                "Bytes the segment cache holds (text, ids and overhead).",
                |m| m.tokenizer.cache_stats().bytes,
            ),
            (
                "router_tokens_cache_entries",
                MetricType::Gauge,
                "Segments the cache holds.",
                |m| m.tokenizer.cache_stats().entries,
            ),
        ];
        for (name, kind, help, read) in families {
            let mut family = exposition.family(name, kind, help);
            for (model, entry) in self.entries() {
                family.sample(&[("model", &model)], read(entry));
            }
        }
        let mut family = exposition.family(
            "router_tokens_compute_seconds_total",
            MetricType::Counter,
            "Time spent computing token ids (parse, render, tokenize), by model.",
        );
        for (model, entry) in self.entries() {
            family.sample(&[("model", &model)], entry.compute_seconds());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synthetic() -> Tokenizers {
        Tokenizers::default().with_model("m", Arc::new(PromptTokenizer::synthetic(4)))
    }

    const CHAT: &[u8] =
        br#"{"model": "m", "messages": [{"role": "user", "content": "Hello there"}]}"#;

    #[test]
    fn a_model_with_a_tokenizer_routes_on_the_engines_ids() {
        let tokenizers = synthetic();
        let text = Routing::Text("user: Hello there\n".into());
        let routed = tokenizers.route(RouteKind::ChatCompletions, CHAT, "m", text.clone());
        let expected =
            prompt_tokens::synthetic_tokenize("<|user|>\nHello there\n<|assistant|>\n", 4);
        assert_eq!(routed, Routing::Tokens(expected));
        assert_eq!(tokenizers.for_model("m").unwrap().routed(), 1);
        // Another model has none: text, unchanged.
        assert_eq!(
            tokenizers.route(RouteKind::ChatCompletions, CHAT, "other", text.clone()),
            text
        );
        assert_eq!(
            (tokenizers.mode("m"), tokenizers.mode("other")),
            ("tokens", "text")
        );
    }

    #[test]
    fn failures_fall_back_to_text_and_are_counted() {
        let tokenizers = synthetic();
        let text = Routing::Text("x".into());
        // A batch of completion prompts has no single prompt to route on.
        let batch = br#"{"model": "m", "prompt": ["a", "b"]}"#;
        assert_eq!(
            tokenizers.route(RouteKind::Completions, batch, "m", text.clone()),
            text
        );
        let entry = tokenizers.for_model("m").unwrap();
        assert_eq!((entry.routed(), entry.failed()), (0, 1));
        // Token ids given by the client are kept as they are.
        let ids = Routing::Tokens(vec![7, 8, 9]);
        let body = br#"{"model": "m", "prompt": [7, 8, 9]}"#;
        assert_eq!(
            tokenizers.route(RouteKind::Completions, body, "m", ids.clone()),
            ids
        );
        // Other routes are left alone.
        assert_eq!(
            tokenizers.route(RouteKind::Embeddings, CHAT, "m", text.clone()),
            text
        );
    }

    #[test]
    fn extract_routes_chats_on_tokens_and_builds_text_only_when_needed() {
        let tokenizers = synthetic();
        let chat = RouteKind::ChatCompletions;
        let info = tokenizers.extract(chat, CHAT).unwrap();
        assert!(matches!(info.routing, Routing::Tokens(_)), "{info:?}");
        assert_eq!(info.model.as_deref(), Some("m"));
        // Another model, and a chat whose ids cannot be computed: the text
        // `extract` gives, the failure counted.
        let other = br#"{"model": "x", "messages": [{"role": "user", "content": "Hi"}]}"#;
        assert_eq!(
            tokenizers.extract(chat, other).unwrap(),
            crate::extract(chat, other).unwrap()
        );
        let bogus =
            br#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "bogus"}]}]}"#;
        let info = tokenizers.extract(chat, bogus).unwrap();
        assert_eq!(info, crate::extract(chat, bogus).unwrap());
        assert_eq!(info.routing.text(), Some("user: \n"));
        assert_eq!(tokenizers.for_model("m").unwrap().failed(), 1);
        // A malformed body is the same 400 either way.
        let malformed = br#"{"model": "m", "messages": [{"role": "user", "content": [7]}]}"#;
        assert_eq!(
            tokenizers.extract(chat, malformed).unwrap_err().to_string(),
            crate::extract(chat, malformed).unwrap_err().to_string()
        );
        // Completions: ids computed from text, ids as given kept.
        let info = tokenizers
            .extract(
                RouteKind::Completions,
                br#"{"model": "m", "prompt": "abcdefgh"}"#,
            )
            .unwrap();
        assert_eq!(
            info.routing,
            Routing::Tokens(prompt_tokens::synthetic_tokenize("abcdefgh", 4))
        );
    }

    #[test]
    fn the_default_serves_every_other_model_and_is_listed_last() {
        let tokenizers = synthetic().with_default(Arc::new(PromptTokenizer::synthetic(2)));
        assert!(tokenizers.for_model("anything").is_some());
        let labels: Vec<&str> = tokenizers.entries().map(|(model, _)| model).collect();
        assert_eq!(labels, ["m", DEFAULT_MODEL_LABEL]);
        let mut out = String::new();
        tokenizers.render(&mut Exposition::new(&mut out));
        assert!(
            out.contains("router_tokens_routed_total{model=\"*\"} 0"),
            "{out}"
        );
        assert!(
            out.contains("router_tokens_cache_bytes{model=\"m\"} 0"),
            "{out}"
        );
    }
}
