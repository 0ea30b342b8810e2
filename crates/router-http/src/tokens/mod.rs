//! Routing on the engine's token ids (feature `tokens`, on by default).
//!
//! An engine caches *token blocks* of the chat template's rendering, not
//! the characters of the message texts: the template adds role markers,
//! dates and tool definitions, and only whole blocks are reused. With a
//! [`PromptTokenizer`] for a model, the router computes the ids the engine
//! will compute (the model's chat template and `tokenizer.json`, through
//! [`prompt_tokens`]) and routes on [`RoutingInputBuf::Tokens`]; cache-aware then
//! counts matches in whole blocks of the engine's block size
//! (`CacheAwareConfig::block_size`).
//!
//! A model without a tokenizer routes on text, as before. A request whose
//! rendering or tokenization fails (a template that raises on the
//! conversation, a batch of completion prompts) routes on text too and is
//! counted: the engine answers such a request with its own error, and a
//! router whose template drifted from the engine's keeps serving.
//!
//! # Off the runtime
//!
//! Rendering and tokenizing are CPU work without an `.await`: a 10 MiB
//! chat costs seconds of CPU with a real tokenizer. Run on the request's
//! task, two of them stall every other request of a 2-core router,
//! probes included (issue 32). So the router
//! ([`Tokenizers::extract_bounded`]) does this:
//!
//! * **small bodies inline**: a body of at most
//!   [`TokenizeConfig::inline_bytes`] (default 4 KiB) is computed on the
//!   request's task. Handing work to a blocking thread costs a semaphore
//!   permit, a thread wake-up and a task wake-up back: measured at about
//!   35 µs a round trip (release build, tokio 1.54, the 2-core development
//!   machine under load), while the warm 1 KB chat costs about 12 µs of
//!   tokenizing (43 µs of router CPU in all): the hand-off would cost
//!   more than the work, and more than doubles the warm path's latency.
//!   A 4 KiB cold prompt costs at most a few milliseconds with a slow BPE
//!   tokenizer (about 0.6 µs a byte, issue 32's figure), tens of µs with
//!   the o200k direct encoder: a stall bounded by the threshold.
//! * **a budget per request**: a body over [`TokenizeConfig::max_bytes`]
//!   (default 2 MiB) is not tokenized at all (it routes on text, counted
//!   in `router_tokens_over_budget_total`), and the same bound applies to
//!   the rendered prompt before tokenizing starts: it bounds the memory and
//!   the CPU of one computation. [`TokenizeConfig::max_time`] (default
//!   2 s) bounds the work time, checked between segments.
//! * **a bounded pool**: the rest waits for one of
//!   [`TokenizeConfig::threads`] slots (default: one per core), within
//!   the request's deadline (504 `request_timeout` "waiting for a
//!   tokenizer thread"), and runs on tokio's blocking threads. A slot is
//!   held by the work, not by the waiter: cancelled work keeps its slot
//!   until it actually stops, so the pool really bounds the CPU spent.
//! * **cancellation**: the computation carries a
//!   [`prompt_tokens::Interrupt`], cancelled when the request's future is
//!   dropped (the client went away) or its deadline passes; the work
//!   checks it between phases and before each segment it tokenizes (the
//!   text between two of the tokenizer's added tokens, about one message),
//!   and stops there (`router_tokens_cancelled_total`). One segment is the
//!   unit of work that cannot be cut short; the size budget bounds it.
//!   The check is a relaxed atomic load (and a clock read) per segment
//!   tokenized, and the inline path passes no interrupt at all: the warm
//!   path is unchanged.
//!
//! Time spent here is the router's: a deadline that passes while the
//! request waits for a slot or is being tokenized is the router's 504,
//! and no worker is reserved or charged (the proxy checks the deadline
//! again before it selects a worker).
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

pub(crate) mod once;

use crate::error::ApiError;
use crate::extract::{
    ApiKind, Extracted, ParsedBody, RequestInfo, RoutingInputBuf, SegmentCacheUse,
};
use crate::metrics::Counter;
use bytes::Bytes;
use once::{ChatOnce, CompletionOnce};
use prom_text::{Exposition, MetricType};
use prompt_tokens::{
    ChatRequest, CompletionRequest, Error, Interrupt, MessageMemo, PromptTokenizer,
};
use serde_json::Value;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// The label under which the tokenizer for every other model is reported.
pub const DEFAULT_MODEL_LABEL: &str = "*";

/// A model's tokenizer and what it did.
#[derive(Debug)]
pub struct ModelTokens {
    tokenizer: Arc<PromptTokenizer>,
    routed: Counter,
    failed: Counter,
    over_budget: Counter,
    cancelled: Counter,
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
            over_budget: Counter::default(),
            cancelled: Counter::default(),
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

    /// Requests routed on text because their prompt was over the
    /// tokenizing budget (body or rendering larger than
    /// [`TokenizeConfig::max_bytes`], or work past
    /// [`TokenizeConfig::max_time`]).
    pub fn over_budget(&self) -> u64 {
        self.over_budget.get()
    }

    /// Computations stopped because nobody waited for them any more (the
    /// client went away or the request's deadline passed).
    pub fn cancelled(&self) -> u64 {
        self.cancelled.get()
    }

    /// The token ids of a chat or text completion body (`None` for other
    /// routes), timed and counted; a failure is logged and counted here.
    fn ids(
        &self,
        kind: ApiKind,
        body: Source<'_>,
        model: &str,
        interrupt: Option<&Interrupt>,
    ) -> Option<Result<Ids, NoIds>> {
        let tokenizer = &self.tokenizer;
        let started = Instant::now();
        let no_segments = |ids| (ids, None);
        let ids = match (kind, interrupt) {
            (ApiKind::ChatCompletions, _) => body.chat().and_then(|request| {
                let (ids, uses) = tokenizer.chat_tokens_with_use(&request, interrupt)?;
                let uses = SegmentCacheUse {
                    hits: uses.cache_hits,
                    misses: uses.cache_misses,
                };
                Ok((ids, Some(uses)))
            }),
            (ApiKind::Completions, None) => body
                .completion()
                .and_then(|request| tokenizer.completion_tokens(&request))
                .map(no_segments),
            (ApiKind::Completions, Some(interrupt)) => body
                .completion()
                .and_then(|request| tokenizer.completion_tokens_until(&request, interrupt))
                .map(no_segments),
            _ => return None,
        };
        self.add_compute(started);
        Some(match ids {
            Ok(ids) => {
                self.routed.inc();
                Ok(ids)
            }
            Err(Error::Cancelled) => {
                self.cancelled.inc();
                Err(NoIds::Cancelled)
            }
            Err(Error::OverBudget(reason)) => {
                self.over_budget.inc();
                tracing::debug!(%model, %reason, "prompt over the tokenizing budget; routing on text");
                Err(NoIds::Text)
            }
            Err(error) => {
                self.failed.inc();
                tracing::debug!(%model, %error, "cannot compute the prompt's token ids; routing on text");
                Err(NoIds::Text)
            }
        })
    }

    /// Counts the time since `started` in [`compute_seconds`](Self::compute_seconds).
    fn add_compute(&self, started: Instant) {
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.compute_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Time spent computing requests' token ids (body parse, template
    /// rendering, tokenization), in seconds: the part of the router's CPU
    /// time that routing on tokens adds (on the request's task for small
    /// bodies, on the tokenizer pool for the others).
    pub fn compute_seconds(&self) -> f64 {
        self.compute_nanos.load(Ordering::Relaxed) as f64 / 1e9
    }
}

/// A request's token ids, and for a chat how the segment cache served them.
type Ids = (Vec<u32>, Option<SegmentCacheUse>);

/// What a request's token ids are computed from.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// The body's text, parsed for the prompt after `extract` read it: a
    /// body [`ChatOnce`] or [`CompletionOnce`] leaves to the two parses.
    Text(&'a [u8]),
    /// The value the body was parsed into ([`ParsedBody`]), and the body's
    /// length.
    Value(&'a Value, usize),
    /// A chat request already read ([`ChatOnce`]).
    Request(&'a ChatRequest),
    /// A completion already read ([`CompletionOnce`]).
    Completion(&'a CompletionRequest),
}

impl<'a> Source<'a> {
    fn chat(self) -> Result<Cow<'a, ChatRequest>, Error> {
        match self {
            Self::Text(body) => ChatRequest::from_json(body).map(Cow::Owned),
            // The value keeps the client's key order (the workspace's
            // serde_json has `preserve_order`): the same request as the
            // text's.
            Self::Value(value, len) => {
                ChatRequest::from_value(value).map(|request| Cow::Owned(request.with_body_len(len)))
            }
            Self::Request(request) => Ok(Cow::Borrowed(request)),
            Self::Completion(_) => Err(Error::InvalidRequest(
                "a completion is not a chat request".into(),
            )),
        }
    }

    fn completion(self) -> Result<Cow<'a, CompletionRequest>, Error> {
        match self {
            Self::Text(body) => CompletionRequest::from_json(body).map(Cow::Owned),
            Self::Value(value, _) => CompletionRequest::from_value(value).map(Cow::Owned),
            Self::Completion(request) => Ok(Cow::Borrowed(request)),
            Self::Request(_) => Err(Error::InvalidRequest(
                "a chat request is not a completion".into(),
            )),
        }
    }
}

/// Which models route on token ids, and with which tokenizer: per model id,
/// and optionally one for every other model. Cheap to clone (shared
/// entries, shared counters).
#[derive(Clone, Default)]
pub struct Tokenizers {
    by_model: BTreeMap<String, Arc<ModelTokens>>,
    default: Option<Arc<ModelTokens>>,
    /// The router's tokenizer pool; without one (a `Tokenizers` used as a
    /// library, outside a router) everything is computed inline.
    pool: Option<Arc<TokenPool>>,
    /// Chat messages' template values by their JSON text, shared by every
    /// model: a conversation's next request parses only its new messages.
    messages: Arc<MessageMemo>,
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

    /// `memo` for the chat messages of every model, in place of the
    /// default one ([`prompt_tokens::DEFAULT_MESSAGE_MEMO_BYTES`]): a chat
    /// body of 2 KB or more takes each message an earlier body had byte
    /// for byte from it, and parses only the others. `MessageMemo::new(0)`
    /// parses every message.
    pub fn with_message_memo(mut self, memo: MessageMemo) -> Self {
        self.messages = Arc::new(memo);
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
    pub fn route(
        &self,
        kind: ApiKind,
        body: &[u8],
        model: &str,
        routing: RoutingInputBuf,
    ) -> RoutingInputBuf {
        self.route_until(kind, body, model, routing, None)
    }

    fn route_until(
        &self,
        kind: ApiKind,
        body: &[u8],
        model: &str,
        routing: RoutingInputBuf,
        interrupt: Option<&Interrupt>,
    ) -> RoutingInputBuf {
        let Some(entry) = self.for_model(model) else {
            return routing;
        };
        // Ids as given are already what the engine sees.
        if kind == ApiKind::Completions && matches!(routing, RoutingInputBuf::Tokens(_)) {
            return routing;
        }
        match entry.ids(kind, Source::Text(body), model, interrupt) {
            Some(Ok((ids, _))) => RoutingInputBuf::Tokens(ids),
            Some(Err(_)) | None => routing,
        }
    }

    /// [`extract`](crate::extract()) and [`route`](Self::route) in one: a
    /// request's [`RequestInfo`] with the engine's token ids as its routing
    /// input where its model has a tokenizer. The body is checked as
    /// `extract` checks it (the same 400s); a chat request routed on tokens
    /// never has its routing text built (see
    /// [`extract_deferred`](crate::extract_deferred)), one whose ids cannot
    /// be computed gets it.
    ///
    /// Synchronous and unbounded: the router calls
    /// [`extract_bounded`](Self::extract_bounded), which runs this on its
    /// tokenizer pool under the budget.
    pub fn extract(&self, kind: ApiKind, body: &[u8]) -> Result<RequestInfo, ApiError> {
        self.extract_until(kind, body, None)
    }

    fn extract_until(
        &self,
        kind: ApiKind,
        body: &[u8],
        interrupt: Option<&Interrupt>,
    ) -> Result<RequestInfo, ApiError> {
        if kind == ApiKind::Completions && !self.is_empty() {
            let started = Instant::now();
            if let Some(once) = CompletionOnce::read(body) {
                return Ok(self.with_completion_ids(once, started, interrupt));
            }
        }
        if kind != ApiKind::ChatCompletions || self.is_empty() {
            let mut info = crate::extract(kind, body)?;
            let text = std::mem::take(&mut info.routing);
            let model = info.model.as_deref().unwrap_or_default();
            info.routing = self.route_until(kind, body, model, text, interrupt);
            return Ok(info);
        }
        let started = Instant::now();
        if let Some(once) = ChatOnce::read(body, &self.messages) {
            return Ok(self.with_chat_ids(once, started, interrupt));
        }
        let extracted = crate::extract_deferred(kind, body)?;
        Ok(self.with_ids(kind, extracted, Source::Text(body), interrupt))
    }

    /// A completion read once ([`CompletionOnce`]) with the engine's token
    /// ids as its routing input where its model has a tokenizer and the
    /// prompt is a text; its ids as given, or its text, otherwise.
    fn with_completion_ids(
        &self,
        once: CompletionOnce,
        started: Instant,
        interrupt: Option<&Interrupt>,
    ) -> RequestInfo {
        let model = once.info.model.as_deref().unwrap_or_default();
        let (Some(entry), Some(request)) = (self.for_model(model), &once.request) else {
            return once.info;
        };
        entry.add_compute(started);
        let source = Source::Completion(request);
        match entry.ids(ApiKind::Completions, source, model, interrupt) {
            Some(Ok((ids, segment_cache))) => RequestInfo {
                routing: RoutingInputBuf::Tokens(ids),
                segment_cache,
                ..once.info
            },
            Some(Err(_)) | None => once.info,
        }
    }

    /// A chat request read once ([`ChatOnce`]) with the engine's token ids
    /// as its routing input where its model has a tokenizer, its routing
    /// text where it has none or the ids cannot be computed. The parse,
    /// begun at `started`, counts in the model's compute time: for a model
    /// that routes on tokens it is the tokenizing path's parse.
    fn with_chat_ids(
        &self,
        once: ChatOnce,
        started: Instant,
        interrupt: Option<&Interrupt>,
    ) -> RequestInfo {
        let model = once.info.model.as_deref().unwrap_or_default();
        let Some(entry) = self.for_model(model) else {
            return once.into_text_info();
        };
        entry.add_compute(started);
        let source = Source::Request(&once.request);
        match entry.ids(ApiKind::ChatCompletions, source, model, interrupt) {
            Some(Ok((ids, segment_cache))) => RequestInfo {
                routing: RoutingInputBuf::Tokens(ids),
                segment_cache,
                ..once.info
            },
            // Nobody reads a cancelled request's info: skip its text.
            Some(Err(NoIds::Cancelled)) => once.info,
            Some(Err(NoIds::Text)) | None => once.into_text_info(),
        }
    }

    /// `extracted`'s info with the engine's token ids (computed from
    /// `body`) as its routing input where its model has a tokenizer; its
    /// text (a chat request's built only now) where it has none, where
    /// the ids cannot be computed, and for a completion's ids as given.
    fn with_ids(
        &self,
        kind: ApiKind,
        extracted: Extracted<'_>,
        body: Source<'_>,
        interrupt: Option<&Interrupt>,
    ) -> RequestInfo {
        let model = extracted.model().unwrap_or_default();
        let Some(entry) = self.for_model(model) else {
            return extracted.into_info();
        };
        // Ids as given are already what the engine sees.
        if kind == ApiKind::Completions && matches!(extracted.routing(), RoutingInputBuf::Tokens(_))
        {
            return extracted.into_info();
        }
        match entry.ids(kind, body, model, interrupt) {
            Some(Ok((ids, segment_cache))) => RequestInfo {
                routing: RoutingInputBuf::Tokens(ids),
                segment_cache,
                ..extracted.without_text()
            },
            // Nobody reads a cancelled request's info: skip its text.
            Some(Err(NoIds::Cancelled)) => extracted.without_text(),
            Some(Err(NoIds::Text)) | None => extracted.into_info(),
        }
    }

    /// [`extract`](Self::extract) of a body that is needed as a JSON value
    /// downstream (a P/D request): one parse, into the value
    /// ([`ParsedBody`]), from which the [`RequestInfo`] is read and the
    /// token ids computed (`ChatRequest::from_value`,
    /// `CompletionRequest::from_value`). The same answer as `extract`, the
    /// same 400s; the value goes on with the request.
    ///
    /// Synchronous and unbounded: the router calls
    /// [`extract_parsed_bounded`](Self::extract_parsed_bounded).
    pub fn extract_parsed(
        &self,
        kind: ApiKind,
        body: &[u8],
    ) -> Result<(RequestInfo, ParsedBody), ApiError> {
        Self::parsed_until(Some(self), kind, body, None)
    }

    /// One parse of `body` into a [`ParsedBody`] and its info: with token
    /// ids from `tokenizers` (which may stop at `interrupt`), or on text
    /// without any (a body over the budget).
    fn parsed_until(
        tokenizers: Option<&Self>,
        kind: ApiKind,
        body: &[u8],
        interrupt: Option<&Interrupt>,
    ) -> Result<(RequestInfo, ParsedBody), ApiError> {
        let parsed = ParsedBody::parse(body);
        let extracted = parsed.extract(kind, body)?;
        let info = match tokenizers {
            Some(tokenizers) => {
                // A body the value does not stand for (see
                // `ParsedBody::value`) is tokenized from its text.
                let source = parsed
                    .value()
                    .map_or(Source::Text(body), |value| Source::Value(value, body.len()));
                tokenizers.with_ids(kind, extracted, source, interrupt)
            }
            None => extracted.into_info(),
        };
        Ok((info, parsed))
    }

    /// The text path's computation for [`bounded`](Self::bounded).
    fn text_until(
        tokenizers: Option<&Self>,
        kind: ApiKind,
        body: &[u8],
        interrupt: Option<&Interrupt>,
    ) -> Result<(RequestInfo, ()), ApiError> {
        let info = match tokenizers {
            Some(tokenizers) => tokenizers.extract_until(kind, body, interrupt)?,
            None => crate::extract(kind, body)?,
        };
        Ok((info, ()))
    }

    /// The router's [`extract`](Self::extract): the same answer, computed
    /// where it does not hold up the async runtime and within the budget
    /// of [`TokenizeConfig`] (see the module docs, "Off the runtime").
    ///
    /// Without a pool (a `Tokenizers` not given to a router) it is
    /// `extract`. With one: a body that routes on text anyway, or one no
    /// larger than [`TokenizeConfig::inline_bytes`], is computed inline; a
    /// body larger than [`TokenizeConfig::max_bytes`] routes on text
    /// without being tokenized (counted in `router_tokens_over_budget_total`);
    /// any other waits for a pool slot and is computed on a blocking
    /// thread. `deadline` bounds the wait and the computation: past it,
    /// 504 `request_timeout` naming the phase (`timeout` is the configured
    /// deadline, for the message). Dropping the future (the client went
    /// away) or reaching the deadline cancels the computation: it stops at
    /// its next checkpoint, and its slot is free again.
    pub async fn extract_bounded(
        &self,
        kind: ApiKind,
        body: &Bytes,
        deadline: tokio::time::Instant,
        timeout: Duration,
    ) -> Result<RequestInfo, ApiError> {
        let (info, ()) = self
            .bounded(kind, body, deadline, timeout, Self::text_until)
            .await?;
        Ok(info)
    }

    /// The router's [`extract_parsed`](Self::extract_parsed), for a P/D
    /// request: computed as [`extract_bounded`](Self::extract_bounded)
    /// computes its answer (inline, on the pool, or on text past the
    /// budget), the one parse included.
    pub async fn extract_parsed_bounded(
        &self,
        kind: ApiKind,
        body: &Bytes,
        deadline: tokio::time::Instant,
        timeout: Duration,
    ) -> Result<(RequestInfo, ParsedBody), ApiError> {
        self.bounded(kind, body, deadline, timeout, Self::parsed_until)
            .await
    }

    /// The bounded computation behind [`extract_bounded`](Self::extract_bounded)
    /// and [`extract_parsed_bounded`](Self::extract_parsed_bounded):
    /// `compute` gives the info and what goes with it, with token ids from
    /// the tokenizers it is given, or on text without any.
    async fn bounded<T: Send + 'static>(
        &self,
        kind: ApiKind,
        body: &Bytes,
        deadline: tokio::time::Instant,
        timeout: Duration,
        compute: Compute<T>,
    ) -> Result<(RequestInfo, T), ApiError> {
        let Some(pool) = &self.pool else {
            return compute(Some(self), kind, body, None);
        };
        let tokenizes = matches!(kind, ApiKind::ChatCompletions | ApiKind::Completions);
        if !tokenizes || self.is_empty() || body.len() <= pool.config.inline_bytes {
            return compute(Some(self), kind, body, None);
        }
        if body.len() > pool.config.max_bytes {
            // Bound before you allocate: a body past the budget is not
            // parsed for tokens at all.
            let (info, extra) = compute(None, kind, body, None)?;
            if let Some(entry) = self.for_model(info.model.as_deref().unwrap_or_default()) {
                entry.over_budget.inc();
            }
            return Ok((info, extra));
        }
        let timed_out = |phase| ApiError::RequestTimeout { phase, timeout };
        let Ok(acquired) =
            tokio::time::timeout_at(deadline, Arc::clone(&pool.slots).acquire_owned()).await
        else {
            return Err(timed_out("waiting for a tokenizer thread"));
        };
        let Ok(slot) = acquired else {
            // The semaphore is never closed; were it, compute inline.
            return compute(Some(self), kind, body, None);
        };
        let interrupt = Interrupt::new()
            .with_time_limit(pool.config.max_time)
            .with_max_text_bytes(pool.config.max_bytes);
        // Cancels the computation when this future ends for any reason:
        // the deadline below, or the client's disconnect dropping it.
        let _cancel = CancelOnDrop(interrupt.clone());
        let this = self.clone();
        let job_body = body.clone();
        let job = tokio::task::spawn_blocking(move || {
            // The slot is held for as long as the work runs, not as long
            // as someone waits: cancelled work still counts until it stops.
            let _slot = slot;
            compute(Some(&this), kind, &job_body, Some(&interrupt))
        });
        match tokio::time::timeout_at(deadline, job).await {
            Err(_elapsed) => Err(timed_out("while tokenizing the prompt")),
            Ok(Ok(result)) => result,
            Ok(Err(join)) => {
                // Input never panics the tokenizer; if it did, the request
                // still routes, on text.
                tracing::error!(error = %join, "the tokenizer thread failed; routing on text");
                compute(None, kind, body, None)
            }
        }
    }

    /// Gives these tokenizers the router's pool, built from `config`.
    pub(crate) fn set_pool(&mut self, config: &TokenizeConfig) -> Result<(), String> {
        if config.threads == 0 {
            return Err("the tokenizer pool needs at least 1 thread".into());
        }
        self.pool = Some(Arc::new(TokenPool {
            config: config.clone(),
            slots: Arc::new(Semaphore::new(config.threads)),
        }));
        Ok(())
    }

    /// Pool slots in use: computations running (a cancelled one until it
    /// reaches its next checkpoint). 0 without a pool.
    pub fn busy_threads(&self) -> usize {
        self.pool.as_ref().map_or(0, |pool| {
            pool.config
                .threads
                .saturating_sub(pool.slots.available_permits())
        })
    }

    /// Writes the `router_tokens_*` families.
    pub(crate) fn render(&self, exposition: &mut Exposition<'_>) {
        if self.is_empty() {
            return;
        }
        type Read = fn(&ModelTokens) -> u64;
        let families: [(&str, MetricType, &str, Read); 12] = [
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
                "router_tokens_over_budget_total",
                MetricType::Counter,
                "Requests routed on text because their prompt was over the tokenizing budget (size or time).",
                ModelTokens::over_budget,
            ),
            (
                "router_tokens_cancelled_total",
                MetricType::Counter,
                "Token computations stopped because the client went away or the deadline passed.",
                ModelTokens::cancelled,
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
            (
                "router_tokens_prefix_reused_total",
                MetricType::Counter,
                "Chat renderings (1 KB or more) that took the ids of the text they share with an earlier rendering from the prefix memo.",
                |m| m.tokenizer.prefix_memo_stats().reused,
            ),
            (
                "router_tokens_prefix_reused_bytes_total",
                MetricType::Counter,
                "Bytes of rendered text whose ids came from the prefix memo.",
                |m| m.tokenizer.prefix_memo_stats().reused_bytes,
            ),
            (
                "router_tokens_prefix_bytes",
                MetricType::Gauge,
                "Bytes the prefix memo holds (renderings, their ids and cuts).",
                |m| m.tokenizer.prefix_memo_stats().bytes,
            ),
        ];
        for (name, kind, help, read) in families {
            let mut family = exposition.family(name, kind, help);
            for (model, entry) in self.entries() {
                family.sample(&[("model", &model)], read(entry));
            }
        }
        let memo = self.messages.stats();
        exposition
            .family(
                "router_tokens_message_memo_lookups_total",
                MetricType::Counter,
                "Chat messages (of bodies of 2 KB or more) looked up in the message memo by their JSON text.",
            )
            .sample(&[], memo.lookups);
        exposition
            .family(
                "router_tokens_message_memo_hits_total",
                MetricType::Counter,
                "Chat messages whose template value came from the message memo (not parsed again).",
            )
            .sample(&[], memo.hits);
        let mut family = exposition.family(
            "router_tokens_compute_seconds_total",
            MetricType::Counter,
            "Time spent computing token ids (parse, render, tokenize), by model.",
        );
        for (model, entry) in self.entries() {
            family.sample(&[("model", &model)], entry.compute_seconds());
        }
        if let Some(pool) = &self.pool {
            exposition
                .family(
                    "router_tokenizer_threads",
                    MetricType::Gauge,
                    "Size of the tokenizer pool (computations that may run at once).",
                )
                .sample(&[], pool.config.threads);
            exposition
                .family(
                    "router_tokenizer_threads_busy",
                    MetricType::Gauge,
                    "Tokenizer pool slots in use.",
                )
                .sample(&[], self.busy_threads());
        }
    }
}

/// A computation of [`Tokenizers::bounded`]: the info of `kind`'s `body`
/// and what goes with it, with token ids from the tokenizers given (which
/// may stop at the interrupt), on text without any.
type Compute<T> = fn(
    Option<&Tokenizers>,
    ApiKind,
    &[u8],
    Option<&Interrupt>,
) -> Result<(RequestInfo, T), ApiError>;

/// Why a request got no token ids.
enum NoIds {
    /// Rendering or tokenizing failed, or the prompt was over budget:
    /// route on text.
    Text,
    /// Cancelled: nobody waits for the answer.
    Cancelled,
}

/// The tokenizer pool's settings: how many computations may run at once
/// off the async runtime, and the budget of each
/// ([`RouterConfig::tokenize`](crate::RouterConfig::tokenize)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizeConfig {
    /// Computations that may run at once on blocking threads (default: the
    /// number of cores). Requests past it wait, within their deadline.
    pub threads: usize,
    /// Largest body (and rendered prompt) tokenized, in bytes (default
    /// 2 MiB, about half a million tokens and about a second of CPU);
    /// a larger one routes on text, counted in
    /// `router_tokens_over_budget_total`. It bounds the memory and the
    /// CPU time of one computation.
    pub max_bytes: usize,
    /// Work time of one computation (default 2 s), checked between
    /// segments: past it, the request routes on text (counted as over
    /// budget).
    pub max_time: Duration,
    /// Bodies up to this size are computed inline on the request's task
    /// (default 4 KiB): handing them to a thread costs more than the
    /// work (see the module docs, "Off the runtime").
    pub inline_bytes: usize,
}

impl Default for TokenizeConfig {
    fn default() -> Self {
        Self {
            threads: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            max_bytes: 2 * 1024 * 1024,
            max_time: Duration::from_secs(2),
            inline_bytes: 4 * 1024,
        }
    }
}

/// The router's tokenizer pool: a semaphore over tokio's blocking threads.
#[derive(Debug)]
struct TokenPool {
    config: TokenizeConfig,
    slots: Arc<Semaphore>,
}

/// Cancels its interrupt when dropped.
struct CancelOnDrop(Interrupt);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
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
        let text = RoutingInputBuf::Text("user: Hello there\n".into());
        let routed = tokenizers.route(ApiKind::ChatCompletions, CHAT, "m", text.clone());
        let expected =
            prompt_tokens::synthetic_tokenize("<|user|>\nHello there\n<|assistant|>\n", 4);
        assert_eq!(routed, RoutingInputBuf::Tokens(expected));
        assert_eq!(tokenizers.for_model("m").unwrap().routed(), 1);
        // Another model has none: text, unchanged.
        assert_eq!(
            tokenizers.route(ApiKind::ChatCompletions, CHAT, "other", text.clone()),
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
        let text = RoutingInputBuf::Text("x".into());
        // A batch of completion prompts has no single prompt to route on.
        let batch = br#"{"model": "m", "prompt": ["a", "b"]}"#;
        assert_eq!(
            tokenizers.route(ApiKind::Completions, batch, "m", text.clone()),
            text
        );
        let entry = tokenizers.for_model("m").unwrap();
        assert_eq!((entry.routed(), entry.failed()), (0, 1));
        // Token ids given by the client are kept as they are.
        let ids = RoutingInputBuf::Tokens(vec![7, 8, 9]);
        let body = br#"{"model": "m", "prompt": [7, 8, 9]}"#;
        assert_eq!(
            tokenizers.route(ApiKind::Completions, body, "m", ids.clone()),
            ids
        );
        // Other routes are left alone.
        assert_eq!(
            tokenizers.route(ApiKind::Embeddings, CHAT, "m", text.clone()),
            text
        );
    }

    #[test]
    fn extract_routes_chats_on_tokens_and_builds_text_only_when_needed() {
        let tokenizers = synthetic();
        let chat = ApiKind::ChatCompletions;
        let info = tokenizers.extract(chat, CHAT).unwrap();
        assert!(
            matches!(info.routing, RoutingInputBuf::Tokens(_)),
            "{info:?}"
        );
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
                ApiKind::Completions,
                br#"{"model": "m", "prompt": "abcdefgh"}"#,
            )
            .unwrap();
        assert_eq!(
            info.routing,
            RoutingInputBuf::Tokens(prompt_tokens::synthetic_tokenize("abcdefgh", 4))
        );
    }

    /// Counters of a model's entry: routed, failed, over budget, cancelled.
    fn counts(tokenizers: &Tokenizers) -> (u64, u64, u64, u64) {
        let entry = tokenizers.for_model("m").unwrap();
        (
            entry.routed(),
            entry.failed(),
            entry.over_budget(),
            entry.cancelled(),
        )
    }

    /// Bodies the text path and the parsed path must answer alike.
    const SAME: &[(ApiKind, &[u8])] = &[
        (ApiKind::ChatCompletions, CHAT),
        (
            ApiKind::ChatCompletions,
            br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, "there"]},
                {"role": "assistant", "content": "ok"}], "model": "m", "add_generation_prompt": false}"#,
        ),
        (ApiKind::ChatCompletions, br#"{"model": "x", "messages": [{"role": "user", "content": "Hi"}]}"#),
        (
            ApiKind::ChatCompletions,
            br#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "bogus"}]}]}"#,
        ),
        // A repeated field the prompt's view refuses (a fallback to text
        // either way), and a key repeated inside a message: the value kept
        // the last of each, so both are read from the text.
        (
            ApiKind::ChatCompletions,
            br#"{"model": "m", "messages": [{"role": "user", "content": "a"}], "add_generation_prompt": true, "add_generation_prompt": false}"#,
        ),
        (
            ApiKind::ChatCompletions,
            br#"{"model": "m", "messages": [{"role": "user", "content": "a", "name": "x", "name": "y"}]}"#,
        ),
        (ApiKind::ChatCompletions, br#"{"model": "m", "messages": [{"role": "user", "content": [7]}]}"#),
        (ApiKind::ChatCompletions, br#"{"model": 7, "messages": []}"#),
        (ApiKind::Completions, br#"{"model": "m", "prompt": "abcdefgh"}"#),
        (ApiKind::Completions, br#"{"model": "m", "prompt": [7, 8, 9]}"#),
        (ApiKind::Completions, br#"{"model": "m", "prompt": ["a", "b"]}"#),
        (ApiKind::Completions, br#"{"model": "m"}"#),
        (ApiKind::Generate, br#"{"model": "m", "text": "t"}"#),
    ];

    #[test]
    fn one_parse_into_a_value_routes_as_the_text_does() {
        for &(kind, body) in SAME {
            let (by_text, by_value) = (synthetic(), synthetic());
            let text = tokenizers_answer(by_text.extract(kind, body));
            let value =
                tokenizers_answer(by_value.extract_parsed(kind, body).map(|(info, _)| info));
            let shown = String::from_utf8_lossy(body);
            assert_eq!(value, text, "{kind:?} {shown}");
            assert_eq!(counts(&by_value), counts(&by_text), "{kind:?} {shown}");
        }
        // The value goes on to the legs as parsed.
        let (info, parsed) = synthetic()
            .extract_parsed(ApiKind::ChatCompletions, CHAT)
            .unwrap();
        assert!(
            matches!(info.routing, RoutingInputBuf::Tokens(_)),
            "{info:?}"
        );
        assert_eq!(
            parsed.into_value().unwrap(),
            serde_json::from_slice::<Value>(CHAT).unwrap()
        );
    }

    #[tokio::test]
    async fn one_parse_into_a_value_routes_as_the_text_does_on_the_pool() {
        let config = TokenizeConfig {
            threads: 1,
            max_bytes: 256,
            max_time: Duration::from_secs(60),
            inline_bytes: 64,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let timeout = Duration::from_secs(60);
        let chat = |len| {
            format!(
                r#"{{"model": "m", "messages": [{{"role": "user", "content": "{}"}}]}}"#,
                "x".repeat(len)
            )
        };
        let malformed = format!(
            r#"{{"model": "m", "messages": [{{"role": "user", "content": [7]}}], "pad": "{}"}}"#,
            "z".repeat(100)
        );
        // Inline, on the pool, over the budget, refused.
        for body in [chat(1), chat(100), chat(300), malformed] {
            let body = Bytes::from(body);
            let (mut by_text, mut by_value) = (synthetic(), synthetic());
            by_text.set_pool(&config).unwrap();
            by_value.set_pool(&config).unwrap();
            let kind = ApiKind::ChatCompletions;
            let text = by_text
                .extract_bounded(kind, &body, deadline, timeout)
                .await;
            let value = by_value
                .extract_parsed_bounded(kind, &body, deadline, timeout)
                .await;
            if let Ok((_, parsed)) = &value {
                assert!(parsed.value().is_some(), "one parse, kept");
            }
            assert_eq!(
                tokenizers_answer(value.map(|(info, _)| info)),
                tokenizers_answer(text),
                "{} bytes",
                body.len()
            );
            assert_eq!(counts(&by_value), counts(&by_text), "{} bytes", body.len());
        }
    }

    /// An answer as a comparable string: the info, or the error.
    fn tokenizers_answer(result: Result<RequestInfo, ApiError>) -> String {
        match result {
            Ok(info) => format!("{info:?}"),
            Err(error) => format!("{} {error}", error.status()),
        }
    }

    #[tokio::test]
    async fn the_router_path_keeps_small_bodies_inline_and_routes_over_budget_ones_on_text() {
        let mut tokenizers = synthetic();
        tokenizers
            .set_pool(&TokenizeConfig {
                threads: 1,
                max_bytes: 256,
                max_time: Duration::from_secs(60),
                inline_bytes: 64,
            })
            .unwrap();
        let chat = ApiKind::ChatCompletions;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let timeout = Duration::from_secs(60);
        let entry = Arc::clone(tokenizers.for_model("m").unwrap());
        // Small (inline) and mid-sized (on the pool): token ids alike.
        let mid = format!(
            r#"{{"model": "m", "messages": [{{"role": "user", "content": "{}"}}]}}"#,
            "x".repeat(100)
        );
        for body in [Bytes::from_static(CHAT), Bytes::from(mid)] {
            let info = tokenizers
                .extract_bounded(chat, &body, deadline, timeout)
                .await
                .unwrap();
            assert!(
                matches!(info.routing, RoutingInputBuf::Tokens(_)),
                "{info:?}"
            );
        }
        assert_eq!(tokenizers.busy_threads(), 0, "the slot is back");
        // Over the size budget: text, as `extract` gives it, counted.
        let big = Bytes::from(format!(
            r#"{{"model": "m", "messages": [{{"role": "user", "content": "{}"}}]}}"#,
            "y".repeat(300)
        ));
        let info = tokenizers
            .extract_bounded(chat, &big, deadline, timeout)
            .await
            .unwrap();
        assert_eq!(info, crate::extract(chat, &big).unwrap());
        assert_eq!((entry.routed(), entry.over_budget()), (2, 1));
        // A malformed body is the same 400 on the pool.
        let malformed = Bytes::from(format!(
            r#"{{"model": "m", "messages": [{{"role": "user", "content": [7]}}], "pad": "{}"}}"#,
            "z".repeat(100)
        ));
        assert_eq!(
            tokenizers
                .extract_bounded(chat, &malformed, deadline, timeout)
                .await
                .unwrap_err()
                .to_string(),
            crate::extract(chat, &malformed).unwrap_err().to_string()
        );
        let mut out = String::new();
        tokenizers.render(&mut Exposition::new(&mut out));
        for line in [
            "router_tokens_over_budget_total{model=\"m\"} 1",
            "router_tokens_cancelled_total{model=\"m\"} 0",
            "router_tokenizer_threads 1",
            "router_tokenizer_threads_busy 0",
        ] {
            assert!(out.contains(line), "{line}: {out}");
        }
    }

    #[tokio::test]
    async fn work_past_the_time_budget_routes_on_text() {
        let mut tokenizers = synthetic();
        tokenizers
            .set_pool(&TokenizeConfig {
                max_time: Duration::ZERO,
                inline_bytes: 0,
                ..TokenizeConfig::default()
            })
            .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let body = Bytes::from_static(CHAT);
        let info = tokenizers
            .extract_bounded(
                ApiKind::ChatCompletions,
                &body,
                deadline,
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        assert_eq!(
            info,
            crate::extract(ApiKind::ChatCompletions, CHAT).unwrap()
        );
        let entry = tokenizers.for_model("m").unwrap();
        assert_eq!((entry.routed(), entry.over_budget()), (0, 1));
        // A pool needs a thread.
        let mut none = synthetic();
        let zero = TokenizeConfig {
            threads: 0,
            ..TokenizeConfig::default()
        };
        assert!(none.set_pool(&zero).is_err());
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
