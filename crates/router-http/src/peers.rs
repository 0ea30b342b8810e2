//! Router replicas that share their routing choices.
//!
//! Behind a plain load balancer a session's turns land on different router
//! replicas. Each replica's prefix tree then holds only the turns it routed
//! itself, a quarter of each session behind four replicas, and under
//! overload, when the engines' KV events no longer name a holder for a
//! session's history (evicted, or still queued and not yet computed), the
//! tree is what sends the session back to the engine it was on
//! (`kv_aware`'s overload state, docs/policies.md). Replicas started with
//! each other as peers ([`PeerConfig::urls`]) tell each other every choice
//! they make: each replica's tree learns the fleet's choices, as one
//! router's would, `batch_interval` plus a network hop later.
//!
//! # What travels
//!
//! Every [`PeerConfig::batch_interval`] (default 5 ms) a replica posts the
//! choices of its regular pool made since the last batch to every peer's
//! `POST /peer_choices`, as JSON:
//!
//! ```json
//! {"choices": [{"model": "m", "worker": "http://10.0.0.7:8000", "tokens": [1, 2, 3]},
//!              {"model": "m", "worker": "http://10.0.0.8:8000", "text": "user: hi"}]}
//! ```
//!
//! `worker` is the worker's endpoint (its URL, with `@rank` for a
//! data-parallel rank), which every replica spells alike; the receiver
//! maps it to its own worker of that endpoint in the regular pool (worker
//! keys carry a generation that differs between replicas). It records
//! each choice in its policy's tree
//! ([`PolicyRegistry::learn_choice`](lb_policies::PolicyRegistry::learn_choice))
//! as if it had made it, for a worker it knows and a model it has routed;
//! anything else is ignored and counted, never added. A batch is one
//! request; it is not retried (the next choices matter more than old
//! ones).
//!
//! # Trust and bounds
//!
//! A peer's choices steer routing, so the endpoint needs the shared
//! secret [`PeerConfig::token`] (`Authorization: Bearer`, compared in
//! constant time); without a token configured it does not exist (404).
//! A batch is read within [`MAX_PEER_BODY_BYTES`] and the request-body
//! timeout and checked whole before any choice is recorded: a batch that
//! is not valid JSON of this shape is 400 and changes nothing. Sending
//! never blocks a request: the request path appends to a bounded queue
//! ([`PeerConfig::max_pending`]) and drops (counted) when it is full; a
//! peer whose previous batch is still in flight misses this one (counted);
//! each post has [`PeerConfig::timeout`].
//!
//! Choices made by the P/D pools are not shared (their prefill trees stay
//! per replica).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, header};
use http_body_util::Full;
use lb_policies::{PolicyRegistry, RoutingInput, RoutingInputBuf};
use parking_lot::Mutex;
use prom_text::{Exposition, MetricType};
use serde::{Deserialize, Serialize};
use worker_lifecycle::{Worker, WorkerUrl};

use crate::client::UpstreamClient;
use crate::error::ApiError;

/// The path peers post their choices to.
pub const PEER_CHOICES_PATH: &str = "/peer_choices";

/// Largest batch a replica reads from a peer. A sender cuts its batches
/// well below it ([`MAX_BATCH_BYTES`]).
pub const MAX_PEER_BODY_BYTES: usize = 16 << 20;

/// The size a sender aims its batches at: choices past it wait for the
/// next batch.
pub const MAX_BATCH_BYTES: usize = 4 << 20;

/// Most choices one batch may carry.
pub const MAX_CHOICES_PER_BATCH: usize = 65_536;

/// How replicas share their routing choices (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerConfig {
    /// The other replicas' base URLs (`http://host:port`); empty (the
    /// default) sends nothing.
    pub urls: Vec<String>,
    /// The shared secret peers present (`Authorization: Bearer`) and
    /// this replica presents to them. Required when [`urls`](Self::urls)
    /// is not empty; when set, this replica accepts choices at
    /// [`PEER_CHOICES_PATH`].
    pub token: Option<String>,
    /// Time between two batches (default 5 ms; at least 1 ms).
    pub batch_interval: Duration,
    /// Choices queued for the next batch at most (default 16,384); past
    /// it new choices are dropped and counted.
    pub max_pending: usize,
    /// Deadline of one post to a peer, response head included (default
    /// 1 s).
    pub timeout: Duration,
}

impl Default for PeerConfig {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            token: None,
            batch_interval: Duration::from_millis(5),
            max_pending: 16_384,
            timeout: Duration::from_secs(1),
        }
    }
}

impl PeerConfig {
    /// Checks the settings: peers need a token, a token is not empty or
    /// blank, every URL is an `http://` URL, the interval is at least 1 ms.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(token) = &self.token
            && (token.trim().is_empty() || token.chars().any(|c| c.is_control()))
        {
            return Err("the peer token must be non-empty visible text".into());
        }
        if !self.urls.is_empty() && self.token.is_none() {
            return Err(
                "router peers need a shared token (--router-peer-token): a peer's choices \
                 steer routing"
                    .into(),
            );
        }
        for url in &self.urls {
            WorkerUrl::parse_http(url).map_err(|err| format!("peer {url}: {err}"))?;
        }
        if self.batch_interval < Duration::from_millis(1) {
            return Err("the peer batch interval must be at least 1 ms".into());
        }
        if self.max_pending == 0 {
            return Err("the peer queue must hold at least one choice".into());
        }
        Ok(())
    }
}

/// One choice as it travels.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireChoice<'a> {
    #[serde(borrow)]
    model: Cow<'a, str>,
    #[serde(borrow)]
    worker: Cow<'a, str>,
    #[serde(borrow, default, skip_serializing_if = "Option::is_none")]
    text: Option<Cow<'a, str>>,
    /// Borrowed from the queue when sent (no copy of the ids); always
    /// owned when received (JSON numbers are parsed, not borrowed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tokens: Option<Cow<'a, [u32]>>,
}

/// A batch as it travels.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireBatch<'a> {
    #[serde(borrow)]
    choices: Vec<WireChoice<'a>>,
}

/// A choice waiting for the next batch.
#[derive(Debug)]
struct Pending {
    model: Box<str>,
    worker: Arc<str>,
    input: RoutingInputBuf,
}

impl Pending {
    /// About what it weighs in a batch.
    fn wire_size(&self) -> usize {
        let input = match &self.input {
            RoutingInputBuf::None => 0,
            // Escapes can double a character; most text has few.
            RoutingInputBuf::Text(text) => text.len() + text.len() / 8,
            RoutingInputBuf::Tokens(tokens) => tokens.len() * 7,
        };
        self.model.len() + self.worker.len() + input + 48
    }

    fn wire(&self) -> WireChoice<'_> {
        let (text, tokens) = match &self.input {
            RoutingInputBuf::Text(text) => (Some(Cow::Borrowed(text.as_str())), None),
            RoutingInputBuf::Tokens(tokens) => (None, Some(Cow::Borrowed(tokens.as_slice()))),
            RoutingInputBuf::None => (None, None),
        };
        WireChoice {
            model: Cow::Borrowed(&self.model),
            worker: Cow::Borrowed(&self.worker),
            text,
            tokens,
        }
    }
}

/// One peer and its counts.
#[derive(Debug)]
struct Peer {
    url: WorkerUrl,
    /// A batch to it is in flight.
    busy: AtomicBool,
    sent: AtomicU64,
    failed: AtomicU64,
}

/// What a received batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Received {
    /// Choices recorded in a policy's tree.
    pub recorded: u64,
    /// Choices for a worker, or a model, this replica does not know (or
    /// for a policy that keeps no tree).
    pub ignored: u64,
}

/// Why a peer's batch was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Unauthorized,
    Invalid,
    TooLarge,
}

impl Refusal {
    const ALL: [Refusal; 3] = [Self::Unauthorized, Self::Invalid, Self::TooLarge];

    fn as_str(self) -> &'static str {
        match self {
            Self::Unauthorized => "unauthorized",
            Self::Invalid => "invalid",
            Self::TooLarge => "too_large",
        }
    }
}

/// The replica's side of choice sharing: the queue of choices for the
/// peers, the peers, and the counts `/metrics` shows.
#[derive(Debug)]
pub struct PeerSync {
    config: PeerConfig,
    peers: Vec<Peer>,
    pending: Mutex<Vec<Pending>>,
    shared: AtomicU64,
    dropped_full: AtomicU64,
    dropped_busy: AtomicU64,
    recorded: AtomicU64,
    ignored: AtomicU64,
    refused: [AtomicU64; 3],
    /// The receiver's map from endpoint to worker key, for the worker
    /// snapshot it was built from.
    keys: Mutex<Option<KeyMap>>,
}

/// A workers snapshot and its endpoints' keys.
#[derive(Debug)]
struct KeyMap {
    workers: Arc<[Arc<Worker>]>,
    keys: HashMap<String, Arc<str>>,
}

impl PeerSync {
    /// The sharing `config` describes, or `None` when it neither sends
    /// (no peers) nor receives (no token). Fails on an invalid config.
    pub fn new(config: PeerConfig) -> Result<Option<Self>, String> {
        config.validate()?;
        if config.urls.is_empty() && config.token.is_none() {
            return Ok(None);
        }
        let peers = config
            .urls
            .iter()
            .map(|url| {
                Ok(Peer {
                    url: WorkerUrl::parse_http(url).map_err(|err| err.to_string())?,
                    busy: AtomicBool::new(false),
                    sent: AtomicU64::new(0),
                    failed: AtomicU64::new(0),
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Some(Self {
            config,
            peers,
            pending: Mutex::new(Vec::new()),
            shared: AtomicU64::new(0),
            dropped_full: AtomicU64::new(0),
            dropped_busy: AtomicU64::new(0),
            recorded: AtomicU64::new(0),
            ignored: AtomicU64::new(0),
            refused: Default::default(),
            keys: Mutex::new(None),
        }))
    }

    /// The settings in use.
    pub fn config(&self) -> &PeerConfig {
        &self.config
    }

    /// Queues a choice of the regular pool for the peers: `worker` was
    /// given a request for `model` routed on `input`. Never blocks for
    /// more than a queue push; a full queue drops it (counted). Nothing
    /// without peers or without routing input.
    pub fn share(&self, model: &str, worker: &Worker, input: RoutingInput<'_>) {
        if self.peers.is_empty() {
            return;
        }
        let input = match input {
            RoutingInput::None => return,
            RoutingInput::Text("") | RoutingInput::Tokens([]) => return,
            RoutingInput::Text(text) => RoutingInputBuf::Text(text.to_owned()),
            RoutingInput::Tokens(tokens) => RoutingInputBuf::Tokens(tokens.to_vec()),
        };
        let choice = Pending {
            model: model.into(),
            worker: worker.endpoint().to_string().into(),
            input,
        };
        let mut pending = self.pending.lock();
        if pending.len() >= self.config.max_pending {
            drop(pending);
            self.dropped_full.fetch_add(1, Ordering::Relaxed);
            return;
        }
        pending.push(choice);
        drop(pending);
        self.shared.fetch_add(1, Ordering::Relaxed);
    }

    /// Checks a peer's credential: the configured token, presented as a
    /// bearer token. `false` (and counted) otherwise.
    pub(crate) fn authorized(&self, presented: Option<&str>) -> bool {
        let ok = match (&self.config.token, presented) {
            (Some(token), Some(presented)) => crate::bearer::same_key(presented, token),
            _ => false,
        };
        if !ok {
            self.refuse(Refusal::Unauthorized);
        }
        ok
    }

    /// Whether this replica accepts peers' choices (a token is set).
    pub fn accepts(&self) -> bool {
        self.config.token.is_some()
    }

    fn refuse(&self, refusal: Refusal) {
        self.refused[refusal as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a batch refused for its size.
    pub(crate) fn refused_too_large(&self) {
        self.refuse(Refusal::TooLarge);
    }

    /// Records a peer's batch `body` in `policies`, for the `workers` of
    /// the pool they decide for: all of it, or nothing when any part is
    /// invalid (400 naming the problem).
    pub fn receive(
        &self,
        policies: &PolicyRegistry<Arc<Worker>>,
        workers: Arc<[Arc<Worker>]>,
        body: &[u8],
    ) -> Result<Received, ApiError> {
        let batch = match parse_batch(body) {
            Ok(batch) => batch,
            Err(reason) => {
                self.refuse(Refusal::Invalid);
                return Err(ApiError::InvalidRequest(reason));
            }
        };
        let mut received = Received {
            recorded: 0,
            ignored: 0,
        };
        if batch.choices.is_empty() {
            return Ok(received);
        }
        let mut keys = self.keys.lock();
        if !keys
            .as_ref()
            .is_some_and(|map| Arc::ptr_eq(&map.workers, &workers))
        {
            let map = workers
                .iter()
                .map(|w| (w.endpoint().to_string(), Arc::<str>::from(w.key())))
                .collect();
            *keys = Some(KeyMap { workers, keys: map });
        }
        let keys = keys.as_ref().map(|map| &map.keys);
        for choice in &batch.choices {
            let Some(key) = keys.and_then(|keys| keys.get(&*choice.worker)) else {
                received.ignored += 1;
                continue;
            };
            // parse_batch checked that each choice has exactly one.
            let input = match (&choice.text, &choice.tokens) {
                (Some(text), _) => RoutingInput::Text(text),
                (None, Some(tokens)) => RoutingInput::Tokens(tokens),
                (None, None) => continue,
            };
            if policies.learn_choice(&choice.model, input, key) {
                received.recorded += 1;
            } else {
                received.ignored += 1;
            }
        }
        self.recorded
            .fetch_add(received.recorded, Ordering::Relaxed);
        self.ignored.fetch_add(received.ignored, Ordering::Relaxed);
        Ok(received)
    }

    /// Takes the queued choices as batch bodies (JSON, as
    /// [`PEER_CHOICES_PATH`] takes them) of at most about
    /// [`MAX_BATCH_BYTES`] and [`MAX_CHOICES_PER_BATCH`] choices each, with
    /// the number of choices in each. What the sender posts every batch
    /// interval; a host that carries choices its own way calls it itself.
    pub fn take_batches(&self) -> Vec<(Bytes, u64)> {
        let taken = std::mem::take(&mut *self.pending.lock());
        if taken.is_empty() {
            return Vec::new();
        }
        let mut batches = Vec::new();
        let mut rest = taken.as_slice();
        while !rest.is_empty() {
            let mut size = 0;
            let mut count = 0;
            for choice in rest {
                size += choice.wire_size();
                if count > 0 && (size > MAX_BATCH_BYTES || count >= MAX_CHOICES_PER_BATCH) {
                    break;
                }
                count += 1;
            }
            let (batch, after) = rest.split_at(count);
            let wire = WireBatch {
                choices: batch.iter().map(Pending::wire).collect(),
            };
            match serde_json::to_vec(&wire) {
                Ok(body) => batches.push((Bytes::from(body), count as u64)),
                Err(err) => tracing::warn!(error = %err, "a peer batch could not be encoded"),
            }
            rest = after;
        }
        batches
    }

    /// Writes the sharing's series to `/metrics`.
    pub fn render(&self, exposition: &mut Exposition<'_>) {
        exposition
            .family(
                "router_peer_choices_shared_total",
                MetricType::Counter,
                "Routing choices queued for the peer replicas.",
            )
            .sample(&[], self.shared.load(Ordering::Relaxed));
        let mut family = exposition.family(
            "router_peer_choices_dropped_total",
            MetricType::Counter,
            "Routing choices not sent to a peer, by reason (queue full; the peer's previous \
             batch still in flight, counted per peer).",
        );
        family.sample(
            &[("reason", &"queue_full")],
            self.dropped_full.load(Ordering::Relaxed),
        );
        family.sample(
            &[("reason", &"peer_busy")],
            self.dropped_busy.load(Ordering::Relaxed),
        );
        let mut family = exposition.family(
            "router_peer_batches_total",
            MetricType::Counter,
            "Batches of choices posted to each peer, by result.",
        );
        for peer in &self.peers {
            let url = peer.url.as_str();
            family.sample(
                &[("peer", &url), ("result", &"ok")],
                peer.sent.load(Ordering::Relaxed),
            );
            family.sample(
                &[("peer", &url), ("result", &"error")],
                peer.failed.load(Ordering::Relaxed),
            );
        }
        let mut family = exposition.family(
            "router_peer_choices_received_total",
            MetricType::Counter,
            "Peers' choices received, by result (recorded in a tree, or ignored: unknown \
             worker or model).",
        );
        family.sample(
            &[("result", &"recorded")],
            self.recorded.load(Ordering::Relaxed),
        );
        family.sample(
            &[("result", &"ignored")],
            self.ignored.load(Ordering::Relaxed),
        );
        let mut family = exposition.family(
            "router_peer_batches_refused_total",
            MetricType::Counter,
            "Batches posted to this replica and refused, by reason.",
        );
        for refusal in Refusal::ALL {
            family.sample(
                &[("reason", &refusal.as_str())],
                self.refused[refusal as usize].load(Ordering::Relaxed),
            );
        }
    }
}

/// Parses and checks a batch: valid JSON of the wire shape, at most
/// [`MAX_CHOICES_PER_BATCH`] choices, each with exactly one of `text` and
/// `tokens`, non-empty, and non-empty `model` and `worker`.
fn parse_batch(body: &[u8]) -> Result<WireBatch<'_>, String> {
    // serde would also read a struct from an array (`[[]]`): a batch is an
    // object, as peers send it.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err("invalid peer batch: expected a JSON object".into());
    }
    let batch: WireBatch<'_> =
        serde_json::from_slice(body).map_err(|err| format!("invalid peer batch: {err}"))?;
    if batch.choices.len() > MAX_CHOICES_PER_BATCH {
        return Err(format!(
            "a peer batch carries at most {MAX_CHOICES_PER_BATCH} choices, got {}",
            batch.choices.len()
        ));
    }
    for (i, choice) in batch.choices.iter().enumerate() {
        if choice.model.is_empty() || choice.worker.is_empty() {
            return Err(format!(
                "choice {i}: `model` and `worker` must not be empty"
            ));
        }
        match (&choice.text, &choice.tokens) {
            (Some(text), None) if !text.is_empty() => {}
            (None, Some(tokens)) if !tokens.is_empty() => {}
            _ => {
                return Err(format!(
                    "choice {i}: exactly one of `text` and `tokens` must be given, not empty"
                ));
            }
        }
    }
    Ok(batch)
}

/// Posts the queued choices to every peer each batch interval until
/// aborted.
pub(crate) fn spawn(sync: Arc<PeerSync>, client: UpstreamClient) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(sync.config.batch_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            for (body, count) in sync.take_batches() {
                for index in 0..sync.peers.len() {
                    let peer = &sync.peers[index];
                    if peer.busy.swap(true, Ordering::AcqRel) {
                        sync.dropped_busy.fetch_add(count, Ordering::Relaxed);
                        continue;
                    }
                    let sync = Arc::clone(&sync);
                    let client = client.clone();
                    let body = body.clone();
                    tokio::spawn(async move {
                        let peer = &sync.peers[index];
                        let ok = post(&client, &sync.config, &peer.url, body).await;
                        if ok {
                            peer.sent.fetch_add(1, Ordering::Relaxed);
                        } else {
                            peer.failed.fetch_add(1, Ordering::Relaxed);
                        }
                        peer.busy.store(false, Ordering::Release);
                    });
                }
            }
        }
    })
}

/// One batch to one peer: whether it answered 2xx within the timeout.
async fn post(client: &UpstreamClient, config: &PeerConfig, url: &WorkerUrl, body: Bytes) -> bool {
    let token = config.token.as_deref().unwrap_or_default();
    let request = Request::post(url.url_for(PEER_CHOICES_PATH))
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Full::new(body));
    let Ok(request) = request else {
        return false;
    };
    let deadline = tokio::time::Instant::now() + config.timeout;
    match client.send_before(request, Some(deadline)).await {
        Ok(response) => {
            let status = response.status();
            if !status.is_success() {
                tracing::debug!(peer = %url, %status, "a peer refused a batch of choices");
            }
            status.is_success()
        }
        Err(err) => {
            tracing::debug!(peer = %url, error = %err, "a batch of choices did not reach a peer");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_needs_one_input_per_choice() {
        assert!(parse_batch(br#"{"choices":[]}"#).is_ok());
        let ok = br#"{"choices":[{"model":"m","worker":"http://a:1","tokens":[1,2]}]}"#;
        assert_eq!(parse_batch(ok).unwrap().choices.len(), 1);
        for bad in [
            &br#"{"choices":[{"model":"m","worker":"http://a:1"}]}"#[..],
            br#"{"choices":[{"model":"m","worker":"http://a:1","text":"x","tokens":[1]}]}"#,
            br#"{"choices":[{"model":"m","worker":"http://a:1","text":""}]}"#,
            br#"{"choices":[{"model":"","worker":"http://a:1","text":"x"}]}"#,
            br#"{"choices":[{"model":"m","worker":"http://a:1","tokens":[-1]}]}"#,
            br#"{"choices":[{"model":"m","worker":"http://a:1","tokens":[4294967296]}]}"#,
            br#"{"choices":[{"model":"m","worker":"w","text":"x","extra":1}]}"#,
            br#"{"choices":{}}"#,
            b"[[]]",
            b"\xff\xfe",
            b"",
        ] {
            assert!(
                parse_batch(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn peers_need_a_token_and_http_urls() {
        let mut config = PeerConfig {
            urls: vec!["http://127.0.0.1:9".into()],
            ..PeerConfig::default()
        };
        assert!(config.validate().unwrap_err().contains("token"));
        config.token = Some("  ".into());
        assert!(config.validate().is_err());
        config.token = Some("s3cret".into());
        assert!(config.validate().is_ok());
        config.urls.push("ftp://x".into());
        assert!(config.validate().is_err());
        assert!(PeerSync::new(PeerConfig::default()).unwrap().is_none());
    }

    #[test]
    fn the_path_is_a_route() {
        assert_eq!(
            crate::Route::of(&http::Method::POST, PEER_CHOICES_PATH),
            crate::Route::PeerChoices
        );
    }

    #[test]
    fn batches_are_cut_by_size_and_keep_every_choice() {
        let config = PeerConfig {
            urls: vec!["http://127.0.0.1:9".into()],
            token: Some("t".into()),
            ..PeerConfig::default()
        };
        let sync = PeerSync::new(config).unwrap().unwrap();
        // 3 choices of about 1.6 MB of tokens each: two batches.
        for i in 0..3u32 {
            sync.pending.lock().push(Pending {
                model: "m".into(),
                worker: format!("http://w{i}:1").into(),
                input: RoutingInputBuf::Tokens(vec![i; 230_000]),
            });
        }
        let batches = sync.take_batches();
        assert_eq!(batches.iter().map(|b| b.1).sum::<u64>(), 3);
        assert!(batches.len() >= 2, "{}", batches.len());
        for (body, count) in &batches {
            let parsed = parse_batch(body).unwrap();
            assert_eq!(parsed.choices.len() as u64, *count);
            assert!(body.len() <= MAX_PEER_BODY_BYTES);
        }
        assert!(sync.take_batches().is_empty());
    }
}
