//! What the router needs to know about a request body, from one parse.
//!
//! The body is parsed once, into borrowed views that skip every field the
//! router does not use; the original bytes are what is forwarded, so the
//! router never re-serializes a request on the regular path. From that one
//! parse come the model id, whether the client asked for a stream, the hash
//! keys (`user`) and the *routing text*: the text whose prefix the cache-aware
//! policy matches against its tree.
//!
//! A request whose whole body is needed as a JSON value downstream (a P/D
//! request: its prefill and decode legs are the client's body rewritten) is
//! parsed once into that value instead, by [`ParsedBody::parse`];
//! [`ParsedBody::extract`] reads the same views from the value, the prompt's
//! token ids are computed from it (`tokens`), and the P/D flow rewrites it
//! ([`ParsedBody::into_value`]). Reading from the value gives what reading
//! the text gives: the same [`RequestInfo`], the same 400s with the same
//! messages. Two rare kinds of body are read from the text as well: one
//! where some object repeats a key (the value keeps the last one, where the
//! views refuse a repeated field), and one refused for a field of the wrong
//! type (only the text's parse says where in the body the field is, and the
//! error message carries it).
//!
//! The routing text of a chat request is every message rendered in order,
//! role and text content (text parts of multi-part content included), so that
//! turn *n* of a conversation is a prefix of turn *n + 1*, the way the engine's
//! own prefix cache sees it. Rendering only the first message, or a session id,
//! sends every conversation with the same system prompt to the same place
//! regardless of what the worker actually holds.

use crate::error::ApiError;
pub use lb_policies::RoutingInputBuf;
use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;

/// Which OpenAI-style route a body was sent to; decides how it is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ApiKind {
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /v1/rerank` and `/rerank`.
    Rerank,
    /// `POST /v1/responses`.
    Responses,
    /// `POST /generate` (SGLang/vLLM native).
    Generate,
    /// Any other path: proxied transparently, routed without text.
    Other,
}

/// The longest `model` a request may name, in bytes. Model ids are short
/// (a Hugging Face id, a served name, a local path); the name becomes a
/// label of the router's per-model `/metrics` series, a key of its
/// per-model state (up to `--max-routed-models` of them) and a span
/// attribute, so an unbounded one would let a client make every scrape
/// and that state megabytes larger. A longer one is answered 400.
pub const MAX_MODEL_BYTES: usize = 1024;

/// Everything the router reads from a request body.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestInfo {
    /// The `model` field, when present.
    pub model: Option<String>,
    /// Whether the client asked for a streamed (SSE) response.
    pub stream: bool,
    /// The `user` field, a hash key for session-affine policies.
    pub user: Option<String>,
    /// What the cache-aware policy matches.
    pub routing: RoutingInputBuf,
    /// For a chat request routed on token ids the router computed (feature
    /// `tokens`), how the tokenizer's segment cache served them; `None`
    /// otherwise.
    pub segment_cache: Option<SegmentCacheUse>,
}

/// How the tokenizer's segment cache served one request's token ids: the
/// rendering's segments (the text between two added tokens, about a
/// message each) found in the cache, and those tokenized because it did
/// not have them. A warm multi-turn chat has every earlier message a hit
/// and its new message a miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SegmentCacheUse {
    /// Segments whose ids came from the cache.
    pub hits: u32,
    /// Segments tokenized on a miss.
    pub misses: u32,
}

/// Parses `body` as sent to `route` and extracts the [`RequestInfo`].
///
/// An empty body on [`ApiKind::Other`] is fine (a plain proxied call);
/// anything that is not a JSON object on the OpenAI routes is a 400 whose
/// message says what is wrong. Nesting deeper than serde_json's recursion
/// limit (128) inside a field the router reads is refused the same way;
/// fields it does not read are skipped iteratively (no recursion, linear
/// work) and reach the worker untouched.
pub fn extract(route: ApiKind, body: &[u8]) -> Result<RequestInfo, ApiError> {
    extract_deferred(route, body).map(Extracted::into_info)
}

/// [`extract`] with a chat request's routing text left unbuilt until
/// [`Extracted::into_info`] asks for it: a router whose model routes on the
/// engine's token ids computes them from the body itself, and the text (a
/// copy of every message) would be thrown away. The body is parsed and
/// checked exactly as `extract` does it, in the same single pass: the same
/// 400s, and the messages kept as views borrowed from the body.
pub fn extract_deferred(route: ApiKind, body: &[u8]) -> Result<Extracted<'_>, ApiError> {
    let (info, messages) = extract_body(route, body)?;
    Ok(Extracted { info, messages })
}

/// What [`extract_deferred`] read: a chat request's routing text is built
/// only when asked for.
pub struct Extracted<'a> {
    info: RequestInfo,
    messages: Option<Vec<Message<'a>>>,
}

impl fmt::Debug for Extracted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Extracted")
            .field("info", &self.info)
            .field("messages", &self.messages.as_ref().map(Vec::len))
            .finish()
    }
}

impl Extracted<'_> {
    /// The `model` field, when present.
    pub fn model(&self) -> Option<&str> {
        self.info.model.as_deref()
    }

    /// The routing input read so far: a chat request's stays
    /// [`RoutingInputBuf::None`] until [`into_info`](Self::into_info).
    #[cfg(feature = "tokens")]
    pub(crate) fn routing(&self) -> &RoutingInputBuf {
        &self.info.routing
    }

    /// Everything but a chat request's routing text, which stays
    /// [`RoutingInputBuf::None`] (other routes carry theirs).
    pub fn without_text(self) -> RequestInfo {
        self.info
    }

    /// Everything, as [`extract`] gives it: a chat request's routing text
    /// is rendered now from the messages already read.
    pub fn into_info(self) -> RequestInfo {
        match self.messages {
            Some(messages) => RequestInfo {
                routing: RoutingInputBuf::Text(render_messages(&messages)),
                ..self.info
            },
            None => self.info,
        }
    }
}

/// The one parse behind [`extract`] and [`extract_deferred`]: a chat
/// request's messages are returned beside the info (whose routing is then
/// [`RoutingInputBuf::None`]).
fn extract_body(
    route: ApiKind,
    body: &[u8],
) -> Result<(RequestInfo, Option<Vec<Message<'_>>>), ApiError> {
    if route == ApiKind::Other {
        // Best effort: an unknown path may carry anything, or nothing.
        let info = serde_json::from_slice::<Body<'_>>(body)
            .map(|body| body.into_info(RoutingInputBuf::None))
            .unwrap_or_default();
        return Ok((info, None));
    }
    if is_blank(body) {
        return Err(empty_body());
    }
    // The body's UTF-8 is checked once, ASCII a word at a time; parsing
    // bytes, serde_json would check every string it borrows on its own,
    // which cost a quarter of the parse. JSON outside strings is ASCII, so
    // a body that fails here is one serde_json would refuse too.
    let text = std::str::from_utf8(body).map_err(|err| {
        ApiError::InvalidJson(format!(
            "the body is not valid UTF-8 (invalid byte at offset {})",
            err.valid_up_to()
        ))
    })?;
    let parsed: Body<'_> = serde_json::from_str(text).map_err(|err| {
        if err.is_data() {
            ApiError::InvalidRequest(err.to_string())
        } else {
            ApiError::InvalidJson(err.to_string())
        }
    })?;
    read_fields(route, parsed)
}

/// The route's fields of a parsed body (text or value alike): a chat
/// request's messages beside the info, any other route's routing input in
/// it.
fn read_fields(
    route: ApiKind,
    mut parsed: Body<'_>,
) -> Result<(RequestInfo, Option<Vec<Message<'_>>>), ApiError> {
    let routing = match route {
        ApiKind::ChatCompletions => {
            let messages = parsed.messages.take().ok_or_else(|| missing("messages"))?;
            return Ok((parsed.into_info(RoutingInputBuf::None), Some(messages)));
        }
        ApiKind::Completions => parsed
            .prompt
            .take()
            .ok_or_else(|| missing("prompt"))?
            .into_routing(),
        ApiKind::Embeddings | ApiKind::Responses => parsed
            .input
            .take()
            .map(Prompt::into_routing)
            .unwrap_or_default(),
        ApiKind::Rerank => parsed
            .query
            .take()
            .map(|query| RoutingInputBuf::Text(query.into_owned()))
            .unwrap_or_default(),
        ApiKind::Generate => match (parsed.text.take(), parsed.input_ids.take()) {
            (Some(text), _) => text.into_routing(),
            (None, Some(ids)) => RoutingInputBuf::Tokens(ids),
            (None, None) => RoutingInputBuf::None,
        },
        ApiKind::Other => RoutingInputBuf::None,
    };
    Ok((parsed.into_info(routing), None))
}

/// Whether a body is empty but for whitespace (refused on the OpenAI
/// routes before any parse).
fn is_blank(body: &[u8]) -> bool {
    body.iter().all(u8::is_ascii_whitespace)
}

fn empty_body() -> ApiError {
    ApiError::InvalidRequest("the request body is empty; a JSON object is required".into())
}

/// [`extract`] of a body that is needed as a JSON value downstream: one
/// parse, into the value ([`ParsedBody::parse`]), from which the
/// [`RequestInfo`] is read ([`ParsedBody::extract`]). The same answer as
/// `extract`, the same 400s; the value goes on with the request.
pub fn extract_parsed(route: ApiKind, body: &[u8]) -> Result<(RequestInfo, ParsedBody), ApiError> {
    let parsed = ParsedBody::parse(body);
    let info = parsed.extract(route, body)?.into_info();
    Ok((info, parsed))
}

/// A request body parsed once into a JSON value, for a request whose value
/// is needed downstream (see the module docs): the router's views, the
/// prompt's token ids and a P/D request's legs all come from it.
#[derive(Debug)]
pub struct ParsedBody {
    /// The value, or serde_json's message for a body that is not one.
    value: Result<Value, String>,
    /// Whether some object of the body repeats a key: the value keeps the
    /// last, where the typed views of the text refuse a repeated field, so
    /// views are then read from the text.
    repeated_key: bool,
}

impl ParsedBody {
    /// Parses `body` into the JSON value `serde_json::from_slice` gives
    /// (with the workspace's `preserve_order`, keys in the client's order),
    /// or its error.
    pub fn parse(body: &[u8]) -> Self {
        let repeated = Cell::new(false);
        // As in `extract`: one UTF-8 check of the whole body rather than
        // one per string; a body that fails it takes the byte parser, whose
        // error is the one `from_slice` gives.
        let value = match std::str::from_utf8(body) {
            Ok(text) => parse_value(serde_json::Deserializer::from_str(text), &repeated),
            Err(_) => parse_value(serde_json::Deserializer::from_slice(body), &repeated),
        };
        Self {
            value: value.map_err(|err| err.to_string()),
            repeated_key: repeated.get(),
        }
    }

    /// The value, when reading the request from it is reading the body's
    /// text: `None` for a body that is not a JSON value, and for one where
    /// some object repeats a key (the value kept the last one; a typed
    /// view of the text refuses the repeated field).
    pub fn value(&self) -> Option<&Value> {
        self.value.as_ref().ok().filter(|_| !self.repeated_key)
    }

    /// [`extract_deferred`] of `body` (the bytes this was parsed from),
    /// read from the value: the same [`Extracted`], the same 400s with the
    /// same messages. A body [`value`](Self::value) does not stand for is
    /// read from the text; so is one whose fields do not read (a field of
    /// the wrong type), only for the error's position in the text.
    pub fn extract<'a>(
        &'a self,
        route: ApiKind,
        body: &'a [u8],
    ) -> Result<Extracted<'a>, ApiError> {
        if route != ApiKind::Other && is_blank(body) {
            return Err(empty_body());
        }
        let Some(value) = self.value() else {
            return extract_deferred(route, body);
        };
        let Ok(parsed) = Body::deserialize(value) else {
            return extract_deferred(route, body);
        };
        let (info, messages) = read_fields(route, parsed)?;
        Ok(Extracted { info, messages })
    }

    /// The value, for the legs of a P/D request: a body that is not a JSON
    /// value is a 400 `invalid_json` with serde_json's message.
    pub fn into_value(self) -> Result<Value, ApiError> {
        self.value.map_err(ApiError::InvalidJson)
    }
}

/// What `serde_json::from_slice::<Value>` does, through [`ValueSeed`].
fn parse_value<'de, R: serde_json::de::Read<'de>>(
    mut de: serde_json::Deserializer<R>,
    repeated: &Cell<bool>,
) -> serde_json::Result<Value> {
    let value = ValueSeed(repeated).deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// Builds a [`Value`] as serde_json's own `Deserialize` does (an object
/// through [`Map::insert`]: a repeated key keeps its first place and takes
/// the last value), and sets the flag when an object repeats a key, which
/// serde_json's does not tell.
#[derive(Clone, Copy)]
struct ValueSeed<'r>(&'r Cell<bool>);

impl<'de> DeserializeSeed<'de> for ValueSeed<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any valid JSON value")
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<Value, E> {
        Ok(Value::Bool(value))
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Value, E> {
        Ok(Value::from(value))
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Value, E> {
        Ok(Value::from(value))
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<Value, E> {
        // A float JSON cannot hold becomes null, as in serde_json's.
        Ok(Value::from(value))
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Value, E> {
        Ok(Value::String(value.to_owned()))
    }

    fn visit_string<E: de::Error>(self, value: String) -> Result<Value, E> {
        Ok(Value::String(value))
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        self.deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(self)?;
            if object.insert(key, value).is_some() {
                self.0.set(true);
            }
        }
        Ok(Value::Object(object))
    }
}

fn missing(field: &str) -> ApiError {
    ApiError::InvalidRequest(format!("missing required field `{field}`"))
}

/// Renders chat messages in order as `role: text\n`, text parts of
/// multi-part content concatenated, other parts (images, audio) skipped.
fn render_messages(messages: &[Message<'_>]) -> String {
    routing_text(messages.iter().map(|message| {
        let (whole, parts) = match &message.content {
            Content::Text(text) => (Some(&**text), &[][..]),
            Content::Parts(parts) => (None, &parts[..]),
            Content::Missing | Content::Other => (None, &[][..]),
        };
        let pieces = whole
            .into_iter()
            .chain(parts.iter().filter_map(|part| part.text.as_deref()));
        (&*message.role, pieces)
    }))
}

/// The routing text of a conversation given as each message's role and the
/// pieces of its text: `role: text\n` per message, in order (the format of
/// a chat request's [`RequestInfo::routing`]).
pub(crate) fn routing_text<'t, P>(messages: impl Iterator<Item = (&'t str, P)> + Clone) -> String
where
    P: Iterator<Item = &'t str>,
{
    let capacity = messages
        .clone()
        .map(|(role, pieces)| role.len() + 3 + pieces.map(str::len).sum::<usize>())
        .sum();
    let mut text = String::with_capacity(capacity);
    for (role, pieces) in messages {
        text.push_str(role);
        text.push_str(": ");
        for piece in pieces {
            text.push_str(piece);
        }
        text.push('\n');
    }
    text
}

/// The fields of every route the router reads; everything else is skipped
/// without being buffered. One struct for all routes keeps it to one parse.
#[derive(Deserialize, Default)]
struct Body<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<Prompt<'a>>,
    #[serde(borrow, default)]
    input: Option<Prompt<'a>>,
    #[serde(borrow, default)]
    query: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Prompt<'a>>,
    #[serde(default)]
    input_ids: Option<Vec<u32>>,
}

impl Body<'_> {
    fn into_info(self, routing: RoutingInputBuf) -> RequestInfo {
        RequestInfo {
            model: self.model.map(Cow::into_owned),
            stream: self.stream.unwrap_or(false),
            user: self.user.map(Cow::into_owned),
            routing,
            segment_cache: None,
        }
    }
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Content<'a>,
}

/// `visit_borrowed_str`, `visit_str` and `visit_string` of a visitor that
/// wraps the text (borrowed from the body when it has no escapes) with
/// `$wrap`.
macro_rules! visit_strings {
    ($wrap:expr) => {
        fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Self::Value, E> {
            Ok(($wrap)(Cow::Borrowed(text)))
        }

        fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
            Ok(($wrap)(Cow::Owned(text.to_owned())))
        }

        fn visit_string<E: de::Error>(self, text: String) -> Result<Self::Value, E> {
            Ok(($wrap)(Cow::Owned(text)))
        }
    };
}

/// The visitor methods of values the router does not route by: objects
/// (skipped without recursion), `null`, booleans and floats all become
/// `$other`.
macro_rules! visit_other_values {
    ($other:expr) => {
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            drain_map(map)?;
            Ok($other)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($other)
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($other)
        }

        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($other)
        }

        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($other)
        }
    };
}

/// Integers, where they are not token ids, become `$other`.
macro_rules! visit_other_integers {
    ($other:expr) => {
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($other)
        }

        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($other)
        }
    };
}

/// A message's content as the router reads it.
///
/// Deserialized by hand rather than as an untagged enum: serde tries an
/// untagged enum's variants in order against a buffered copy of the value,
/// and every failed attempt formats an error message that quotes the whole
/// string, which cost more than the rest of the parse on long prompts.
#[derive(Default)]
enum Content<'a> {
    #[default]
    Missing,
    Text(Cow<'a, str>),
    Parts(Vec<ContentPart<'a>>),
    /// `null` content (assistant tool calls) and anything unexpected.
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ContentVisitor<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for ContentVisitor<'a> {
            type Value = Content<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("message content: a string or a list of content parts")
            }

            visit_strings!(Content::Text);

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(part) = seq.next_element::<ContentPart<'a>>()? {
                    parts.push(part);
                }
                Ok(Content::Parts(parts))
            }

            visit_other_values!(Content::Other);
            visit_other_integers!(Content::Other);
        }

        deserializer.deserialize_any(ContentVisitor(PhantomData))
    }
}

/// One part of multi-part content: only its `text` is read. A part is an
/// object (as in the OpenAI API) or a bare string, which is text (vLLM
/// accepts both); a `text` that is not a string counts as no text. Any
/// other part (a list, a number) is refused, so nesting stays shallow.
struct ContentPart<'a> {
    text: Option<Cow<'a, str>>,
}

impl<'de: 'a, 'a> Deserialize<'de> for ContentPart<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PartVisitor<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for PartVisitor<'a> {
            type Value = ContentPart<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a content part object or string")
            }

            visit_strings!(|text| ContentPart { text: Some(text) });

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut text = None;
                while let Some(key) = map.next_key::<IsTextKey>()? {
                    if key.0 && text.is_none() {
                        text = map.next_value::<MaybeStr<'a>>()?.0;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(ContentPart { text })
            }
        }

        deserializer.deserialize_any(PartVisitor(PhantomData))
    }
}

/// Whether an object key is `text`, compared without allocating.
struct IsTextKey(bool);

impl<'de> Deserialize<'de> for IsTextKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;

        impl Visitor<'_> for KeyVisitor {
            type Value = IsTextKey;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object key")
            }

            fn visit_str<E: de::Error>(self, key: &str) -> Result<Self::Value, E> {
                Ok(IsTextKey(key == "text"))
            }
        }

        deserializer.deserialize_str(KeyVisitor)
    }
}

/// A string, borrowed from the body when it has no escapes; anything else
/// (skipped without recursion) is `None`.
struct MaybeStr<'a>(Option<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for MaybeStr<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StrVisitor<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for StrVisitor<'a> {
            type Value = MaybeStr<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any value")
            }

            visit_strings!(|text| MaybeStr(Some(text)));

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(MaybeStr(None))
            }

            visit_other_values!(MaybeStr(None));
            visit_other_integers!(MaybeStr(None));
        }

        deserializer.deserialize_any(StrVisitor(PhantomData))
    }
}

fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// A prompt as the OpenAI API accepts it: a string, a batch of strings, token
/// ids, or a batch of token-id lists. A batch routes by its first element, the
/// one whose prefix the engine processes first, so only that element is kept.
/// Structured inputs (the Responses API's item lists) route without text.
/// Deserialized by hand for the reason given on [`Content`].
enum Prompt<'a> {
    Text(Cow<'a, str>),
    Tokens(Vec<u32>),
    Other,
}

impl Prompt<'_> {
    fn into_routing(self) -> RoutingInputBuf {
        match self {
            Self::Text(text) => RoutingInputBuf::Text(text.into_owned()),
            Self::Tokens(tokens) => RoutingInputBuf::Tokens(tokens),
            Self::Other => RoutingInputBuf::None,
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Prompt<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PromptVisitor<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for PromptVisitor<'a> {
            type Value = Prompt<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a prompt: a string, token ids, or a batch of either")
            }

            visit_strings!(Prompt::Text);

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let prompt = match seq.next_element::<PromptItem<'a>>()? {
                    None | Some(PromptItem::Other) => Prompt::Other,
                    // A batch: the first element routes, the rest is skipped.
                    Some(PromptItem::Text(text)) => Prompt::Text(text),
                    Some(PromptItem::Tokens(tokens)) => Prompt::Tokens(tokens),
                    // One token-id prompt: every element must be an id.
                    Some(PromptItem::Token(first)) => {
                        let mut tokens = Vec::with_capacity(seq.size_hint().unwrap_or(0) + 1);
                        tokens.push(first);
                        let mut all_ids = true;
                        while let Some(item) = seq.next_element::<PromptItem<'a>>()? {
                            match item {
                                PromptItem::Token(id) if all_ids => tokens.push(id),
                                _ => all_ids = false,
                            }
                        }
                        return Ok(if all_ids {
                            Prompt::Tokens(tokens)
                        } else {
                            Prompt::Other
                        });
                    }
                };
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(prompt)
            }

            visit_other_values!(Prompt::Other);
            visit_other_integers!(Prompt::Other);
        }

        deserializer.deserialize_any(PromptVisitor(PhantomData))
    }
}

/// One element of a prompt array.
enum PromptItem<'a> {
    Text(Cow<'a, str>),
    Token(u32),
    Tokens(Vec<u32>),
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptItem<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ItemVisitor<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for ItemVisitor<'a> {
            type Value = PromptItem<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a token id or a list of token ids")
            }

            visit_strings!(PromptItem::Text);

            fn visit_u64<E: de::Error>(self, id: u64) -> Result<Self::Value, E> {
                Ok(u32::try_from(id).map_or(PromptItem::Other, PromptItem::Token))
            }

            fn visit_i64<E: de::Error>(self, id: i64) -> Result<Self::Value, E> {
                Ok(u32::try_from(id).map_or(PromptItem::Other, PromptItem::Token))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut tokens = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                let mut all_ids = true;
                while let Some(item) = seq.next_element::<PromptItem<'a>>()? {
                    match item {
                        PromptItem::Token(id) if all_ids => tokens.push(id),
                        _ => all_ids = false,
                    }
                }
                Ok(if all_ids {
                    PromptItem::Tokens(tokens)
                } else {
                    PromptItem::Other
                })
            }

            visit_other_values!(PromptItem::Other);
        }

        deserializer.deserialize_any(ItemVisitor(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> RequestInfo {
        extract(ApiKind::ChatCompletions, body.as_bytes()).unwrap()
    }

    #[test]
    fn chat_renders_every_message_in_order() {
        let info = chat(
            r#"{"model":"m","stream":true,"user":"u1","messages":[
                {"role":"system","content":"You are terse."},
                {"role":"user","content":[{"type":"text","text":"Hi "},
                    {"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"there"}]},
                {"role":"assistant","content":null,"tool_calls":[]}]}"#,
        );
        assert_eq!(info.model.as_deref(), Some("m"));
        assert!(info.stream);
        assert_eq!(info.user.as_deref(), Some("u1"));
        assert_eq!(
            info.routing.text(),
            Some("system: You are terse.\nuser: Hi there\nassistant: \n")
        );
    }

    #[test]
    fn a_later_turn_extends_the_earlier_turn() {
        let first = chat(r#"{"messages":[{"role":"user","content":"a \"quoted\" q"}]}"#);
        let second = chat(
            r#"{"messages":[{"role":"user","content":"a \"quoted\" q"},
                {"role":"assistant","content":"answer"},{"role":"user","content":"more"}]}"#,
        );
        let (first, second) = (
            first.routing.text().unwrap(),
            second.routing.text().unwrap(),
        );
        assert!(
            second.starts_with(first),
            "{second:?} must extend {first:?}"
        );
    }

    #[test]
    fn completions_accept_text_batches_and_tokens() {
        let text = extract(ApiKind::Completions, br#"{"prompt":"hello"}"#).unwrap();
        assert_eq!(text.routing, RoutingInputBuf::Text("hello".into()));
        let batch = extract(ApiKind::Completions, br#"{"prompt":["a","b"]}"#).unwrap();
        assert_eq!(batch.routing, RoutingInputBuf::Text("a".into()));
        let tokens = extract(ApiKind::Completions, br#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(tokens.routing.tokens(), Some(&[1, 2, 3][..]));
        let batches = extract(ApiKind::Completions, br#"{"prompt":[[7,8],[9]]}"#).unwrap();
        assert_eq!(batches.routing.tokens(), Some(&[7, 8][..]));
    }

    #[test]
    fn malformed_and_missing_fields_are_distinct_400s() {
        let malformed = extract(ApiKind::ChatCompletions, b"{\"messages\": [").unwrap_err();
        assert!(
            matches!(malformed, ApiError::InvalidJson(_)),
            "{malformed:?}"
        );
        let missing = extract(ApiKind::ChatCompletions, br#"{"model":"m"}"#).unwrap_err();
        assert!(matches!(&missing, ApiError::InvalidRequest(m) if m.contains("messages")));
        let empty = extract(ApiKind::Completions, b"  ").unwrap_err();
        assert_eq!(empty.status(), http::StatusCode::BAD_REQUEST);
    }

    #[test]
    fn deep_nesting_in_a_read_field_is_refused_cleanly() {
        let depth = 100_000;
        let nested = |prefix: &str, suffix: &str| {
            let mut body = String::from(prefix);
            body.extend(std::iter::repeat_n('[', depth));
            body.extend(std::iter::repeat_n(']', depth));
            body.push_str(suffix);
            body
        };
        // Token-id batches nest lists: past serde_json's limit it refuses.
        let body = nested(r#"{"prompt":"#, "}");
        let error = extract(ApiKind::Completions, body.as_bytes()).unwrap_err();
        assert_eq!(error.status(), http::StatusCode::BAD_REQUEST);
        assert!(error.to_string().contains("recursion limit"), "{error}");
        // A content part must be an object; a list is refused at once.
        let body = nested(r#"{"messages":[{"role":"user","content":"#, "}]}");
        let error = extract(ApiKind::ChatCompletions, body.as_bytes()).unwrap_err();
        assert_eq!(error.status(), http::StatusCode::BAD_REQUEST);
        assert!(error.to_string().contains("content part"), "{error}");
    }

    #[test]
    fn unexpected_content_and_prompt_shapes_route_without_text() {
        let info = chat(
            r#"{"messages":[{"role":"user","content":{"odd":[1,{"x":2}]}},
                {"role":"tool","content":7},{"role":"user","content":[{"type":"text","text":5},
                {"type":"text","text":"kept","text":"second text key ignored"}]}]}"#,
        );
        assert_eq!(info.routing.text(), Some("user: \ntool: \nuser: kept\n"));
        for prompt in [r#"[1,"a"]"#, r#"{"k":1}"#, "[]", "-1"] {
            let body = format!(r#"{{"prompt":{prompt}}}"#);
            let info = extract(ApiKind::Completions, body.as_bytes()).unwrap();
            assert_eq!(info.routing, RoutingInputBuf::None, "{prompt}");
        }
        let mixed = extract(ApiKind::Completions, br#"{"prompt":[[1,"x"],[2]]}"#).unwrap();
        assert_eq!(mixed.routing, RoutingInputBuf::None);
    }

    #[test]
    fn deferred_extraction_reads_all_and_renders_the_text_when_asked() {
        let body = br#"{"model":"m","stream":true,"user":"u","messages":[{"role":"user","content":"Hi"}]}"#;
        let chat = ApiKind::ChatCompletions;
        let deferred = extract_deferred(chat, body).unwrap();
        assert_eq!(deferred.model(), Some("m"));
        let info = deferred.without_text();
        assert_eq!(
            (info.model.as_deref(), info.stream, info.user.as_deref()),
            (Some("m"), true, Some("u"))
        );
        assert_eq!(info.routing, RoutingInputBuf::None);
        assert_eq!(
            extract_deferred(chat, body).unwrap().into_info(),
            extract(chat, body).unwrap()
        );
        // Malformed messages are refused by the one parse, text or not.
        let malformed = br#"{"model":"m","messages":[{"role":"user","content":["a",7]}]}"#;
        assert_eq!(
            extract_deferred(chat, malformed).unwrap_err().status(),
            http::StatusCode::BAD_REQUEST
        );
        let no_role = br#"{"model":"m","messages":[{"content":"x"}]}"#;
        assert!(extract_deferred(chat, no_role).is_err());
        // Other routes carry their routing input either way.
        let completion = br#"{"model":"m","prompt":"once upon"}"#;
        assert_eq!(
            extract_deferred(ApiKind::Completions, completion)
                .unwrap()
                .without_text(),
            extract(ApiKind::Completions, completion).unwrap()
        );
    }

    #[test]
    fn a_body_that_is_not_utf8_is_malformed_json_naming_the_byte() {
        // A lone continuation byte inside a message's text, and a Latin-1
        // byte outside any string: both 400 invalid_json, the offset named.
        for (body, offset) in [
            (
                &b"{\"messages\":[{\"role\":\"user\",\"content\":\"caf\x80\"}]}"[..],
                42,
            ),
            (&b"{\"model\":\"m\",\xe9\"messages\":[]}"[..], 13),
        ] {
            let error = extract(ApiKind::ChatCompletions, body).unwrap_err();
            assert!(matches!(error, ApiError::InvalidJson(_)), "{error:?}");
            assert_eq!(error.status(), http::StatusCode::BAD_REQUEST);
            assert!(
                error
                    .to_string()
                    .contains(&format!("UTF-8 (invalid byte at offset {offset})")),
                "{error}"
            );
        }
        // Multi-byte text and escapes still parse, borrowed or not.
        let info = chat(r#"{"messages":[{"role":"user","content":"café \u00e9 日本 \"q\""}]}"#);
        assert_eq!(info.routing.text(), Some("user: café é 日本 \"q\"\n"));
    }

    #[test]
    fn bare_strings_in_a_content_list_are_text_parts() {
        let info = chat(
            r#"{"messages":[{"role":"user","content":["a",{"type":"text","text":"b"},"c"]}]}"#,
        );
        assert_eq!(info.routing.text(), Some("user: abc\n"));
        // Other bare values are still refused, naming what a part may be.
        let error = extract(
            ApiKind::ChatCompletions,
            br#"{"messages":[{"role":"user","content":["a",7]}]}"#,
        )
        .unwrap_err();
        assert_eq!(error.status(), http::StatusCode::BAD_REQUEST);
        assert!(
            error.to_string().contains("content part object or string"),
            "{error}"
        );
    }

    #[test]
    fn escaped_strings_are_unescaped_in_the_routing_text() {
        let info = chat(r#"{"messages":[{"role":"user","content":"tab\there \u00e9"}]}"#);
        assert_eq!(info.routing.text(), Some("user: tab\there \u{e9}\n"));
        let parts =
            chat(r#"{"messages":[{"role":"user","content":[{"text":"a\"b"},{"text":"c"}]}]}"#);
        assert_eq!(parts.routing.text(), Some("user: a\"bc\n"));
        let prompt = extract(ApiKind::Completions, br#"{"prompt":["x\ny","z"]}"#).unwrap();
        assert_eq!(prompt.routing, RoutingInputBuf::Text("x\ny".into()));
    }

    #[test]
    fn deep_nesting_in_an_unread_field_is_skipped_without_recursion() {
        // serde_json skips ignored values iteratively: no stack growth, linear work.
        let depth = 100_000;
        let mut body = String::from(r#"{"messages":[],"extra":"#);
        body.extend(std::iter::repeat_n('[', depth));
        body.extend(std::iter::repeat_n(']', depth));
        body.push('}');
        let info = extract(ApiKind::ChatCompletions, body.as_bytes()).unwrap();
        assert_eq!(info.routing.text(), Some(""));
    }

    #[test]
    fn other_routes_tolerate_any_body() {
        assert_eq!(
            extract(ApiKind::Other, b"not json").unwrap(),
            RequestInfo::default()
        );
        let info = extract(ApiKind::Other, br#"{"model":"m"}"#).unwrap();
        assert_eq!(info.model.as_deref(), Some("m"));
    }

    /// Bodies of every shape the views read or refuse: the value's reading
    /// must be the text's, answer and error message alike.
    const BODIES: &[&[u8]] = &[
        br#"{"model":"m","stream":true,"user":"u","messages":[{"role":"system","content":"Be terse."},
            {"role":"user","content":[{"type":"text","text":"Hi "},{"type":"image_url","image_url":{"url":"x"}},"there"]},
            {"role":"assistant","content":null,"tool_calls":[{"function":{"arguments":{"b":1,"a":2}}}]}]}"#,
        br#"{"messages":[{"role":"user","content":"tab\there \u00e9 \"q\""}],"model":"m"}"#,
        br#"{"prompt":"hello","model":"m"}"#,
        br#"{"prompt":["a","b"]}"#,
        br#"{"prompt":[1,2,3]}"#,
        br#"{"prompt":[[7,8],[9]]}"#,
        br#"{"prompt":[[1,"x"],[2]]}"#,
        br#"{"prompt":[1,"a"]}"#,
        br#"{"prompt":-1}"#,
        br#"{"input":"embed me","query":"q","text":"t","input_ids":[4,5]}"#,
        br#"{"input_ids":[4,5]}"#,
        br#"{"model":"m"}"#,
        br#"{"model":5,"messages":[]}"#,
        br#"{"model":"m","stream":"yes","prompt":"p"}"#,
        br#"{"messages":[{"content":"x"}]}"#,
        br#"{"messages":[{"role":"user","content":["a",7]}]}"#,
        br#"{"messages":[{"role":"user","content":{"odd":[1,{"x":2}]}},{"role":"tool","content":7}]}"#,
        br#"{"messages":[{"role":"user","role":"system","content":"x"}]}"#,
        br#"{"model":"a","model":"b","prompt":"p"}"#,
        br#"{"prompt":"p","extra":{"k":1,"k":2}}"#,
        br#"{"input_ids":[1,2,4294967296]}"#,
        br#"{"messages":[],"big":1e400}"#,
        br#"["m",true]"#,
        br#""text""#,
        b"{\"messages\": [",
        br#"{"prompt":"p"} trailing"#,
        b"  ",
        b"",
        b"not json",
        b"{\"model\":\"m\",\xe9\"messages\":[]}",
        b"{\"messages\":[{\"role\":\"user\",\"content\":\"caf\x80\"}]}",
    ];

    use crate::fuzzing::ROUTES;

    /// An answer as a comparable string: the info, or the error's status
    /// and message.
    fn answer(result: Result<RequestInfo, ApiError>) -> String {
        match result {
            Ok(info) => format!("{info:?}"),
            Err(error) => format!("{} {} {error}", error.status(), error.code()),
        }
    }

    #[test]
    fn the_parsed_value_reads_as_the_text_does() {
        let nested = {
            let mut body = String::from(r#"{"messages":[],"extra":"#);
            body.extend(std::iter::repeat_n('[', 100_000));
            body.extend(std::iter::repeat_n(']', 100_000));
            body.push('}');
            body
        };
        let deep_read = {
            let mut body = String::from(r#"{"prompt":"#);
            body.extend(std::iter::repeat_n('[', 200));
            body.extend(std::iter::repeat_n(']', 200));
            body.push('}');
            body
        };
        let bodies = BODIES
            .iter()
            .copied()
            .chain([nested.as_bytes(), deep_read.as_bytes()]);
        for body in bodies {
            for route in ROUTES {
                let parsed = ParsedBody::parse(body);
                let from_value = parsed.extract(route, body).map(Extracted::into_info);
                assert_eq!(
                    answer(from_value),
                    answer(extract(route, body)),
                    "{route:?} {}",
                    String::from_utf8_lossy(&body[..body.len().min(120)])
                );
                let deferred = ParsedBody::parse(body)
                    .extract(route, body)
                    .map(Extracted::without_text);
                let text = extract_deferred(route, body).map(Extracted::without_text);
                assert_eq!(answer(deferred), answer(text), "{route:?}");
            }
        }
    }

    #[test]
    fn the_parsed_value_is_serde_jsons_in_the_clients_order() {
        let nested = {
            let mut body = String::from(r#"{"prompt":"p","extra":"#);
            body.extend(std::iter::repeat_n('[', 200));
            body.extend(std::iter::repeat_n(']', 200));
            body.push('}');
            body
        };
        for body in BODIES.iter().copied().chain([nested.as_bytes()]) {
            let ours = ParsedBody::parse(body).into_value();
            match serde_json::from_slice::<Value>(body) {
                Ok(theirs) => {
                    let ours = ours.unwrap();
                    // Key order too: the legs are written from this value.
                    assert_eq!(ours.to_string(), theirs.to_string());
                    assert_eq!(ours, theirs);
                }
                Err(theirs) => {
                    let ours = ours.unwrap_err();
                    assert!(matches!(ours, ApiError::InvalidJson(_)), "{ours:?}");
                    assert_eq!(
                        ours.to_string(),
                        ApiError::InvalidJson(theirs.to_string()).to_string()
                    );
                }
            }
        }
        let value = ParsedBody::parse(br#"{"z":1,"a":{"y":2,"b":3}}"#)
            .into_value()
            .unwrap();
        assert_eq!(value.to_string(), r#"{"z":1,"a":{"y":2,"b":3}}"#);
    }

    #[test]
    fn a_repeated_key_anywhere_is_read_from_the_text() {
        // serde_json keeps the last value quietly; a typed view refuses a
        // repeated field, so the value does not stand for the body.
        for body in [
            &br#"{"model":"a","model":"b","prompt":"p"}"#[..],
            br#"{"messages":[{"role":"user","content":{"k":1,"k":2}}]}"#,
        ] {
            let parsed = ParsedBody::parse(body);
            assert!(parsed.value().is_none());
            assert!(parsed.into_value().is_ok(), "the legs still get it");
        }
        let parsed = ParsedBody::parse(br#"{"model":"a","prompt":"p"}"#);
        assert!(parsed.value().is_some());
        let (info, parsed) =
            extract_parsed(ApiKind::Completions, br#"{"model":"a","prompt":"p"}"#).unwrap();
        assert_eq!(info.model.as_deref(), Some("a"));
        assert!(parsed.value().is_some());
    }

    #[test]
    fn generate_prefers_text_then_input_ids() {
        let text = extract(ApiKind::Generate, br#"{"text":"t","input_ids":[1]}"#).unwrap();
        assert_eq!(text.routing.text(), Some("t"));
        let ids = extract(ApiKind::Generate, br#"{"input_ids":[4,5]}"#).unwrap();
        assert_eq!(ids.routing.tokens(), Some(&[4, 5][..]));
    }
}
