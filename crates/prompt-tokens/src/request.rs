//! The request views: what of an OpenAI-style body decides the prompt.
//!
//! [`ChatRequest`] keeps `messages`, `tools`, `documents` and
//! `chat_template_kwargs` as template values built straight from the JSON,
//! **in the order the client wrote the keys** (a chat template that prints
//! `tools | tojson` or iterates `.items()` must see what the engine sees;
//! Python dicts keep insertion order). Parse it from the body bytes with
//! [`ChatRequest::from_json`] for that guarantee. [`ChatRequest::from_value`]
//! takes an already parsed [`serde_json::Value`]; its objects are in whatever
//! order `serde_json` kept (sorted keys unless `serde_json`'s
//! `preserve_order` feature is on), which matters only for templates that
//! print whole objects.

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;

use minijinja::Value;
use minijinja::value::{Enumerator, Object, ObjectExt};
use serde::de::{self as de, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::error::{Error, Result};
use crate::message_memo::MessageMemo;

/// A JSON value as the template engine sees it (order-preserving).
#[derive(Debug, Clone, Default)]
pub(crate) struct TemplateValue(pub(crate) Value);

impl<'de> Deserialize<'de> for TemplateValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let repeated = Cell::new(false);
        JsonSeed(&repeated)
            .deserialize(deserializer)
            .map(TemplateValue)
    }
}

/// A request's `messages` as the template sees them, and whether some
/// object in them repeated a key (the template sees the last value; a
/// reader of the JSON that refuses repeated fields would not read it).
#[derive(Debug, Clone, Default)]
pub(crate) struct MessagesValue(pub(crate) Value, bool);

impl<'de> Deserialize<'de> for MessagesValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let repeated = Cell::new(false);
        let value = JsonSeed(&repeated).deserialize(deserializer)?;
        Ok(Self(value, repeated.get()))
    }
}

/// Reads `messages` through a [`MessageMemo`]: an array's elements as
/// their raw JSON text, each looked up and parsed only when not found;
/// any other value as [`MessagesValue`] reads it. Only for serde_json's
/// deserializers of text (`from_str`, `from_slice`), which lend the raw
/// text of a value.
struct MessagesSeed<'m>(&'m MessageMemo);

impl<'de> DeserializeSeed<'de> for MessagesSeed<'_> {
    type Value = MessagesValue;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<MessagesValue, D::Error> {
        deserializer.deserialize_any(MessagesVisitor(self.0))
    }
}

struct MessagesVisitor<'m>(&'m MessageMemo);

/// A visitor's methods for JSON's scalars: each scalar as minijinja's own
/// deserializer makes it (`Value::from`), then through `$wrap` into the
/// visitor's value.
macro_rules! visit_primitives {
    ($wrap:expr) => {
        visit_primitives!($wrap;
            visit_bool: bool,
            visit_i64: i64,
            visit_i128: i128,
            visit_u64: u64,
            visit_u128: u128,
            visit_f64: f64,
            visit_str: &str,
            visit_string: String,
            visit_bytes: &[u8],
        );
    };
    ($wrap:expr; $($name:ident: $ty:ty),* $(,)?) => {
        $(fn $name<E: serde::de::Error>(self, v: $ty) -> Result<Self::Value, E> {
            Ok(($wrap)(Value::from(v)))
        })*
    };
}

impl<'de> Visitor<'de> for MessagesVisitor<'_> {
    type Value = MessagesValue;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    // Anything but an array is read as the whole-body parse reads it.
    visit_primitives!(|value| MessagesValue(value, false));

    fn visit_none<E: serde::de::Error>(self) -> Result<MessagesValue, E> {
        Ok(MessagesValue(Value::from(()), false))
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<MessagesValue, E> {
        Ok(MessagesValue(Value::from(()), false))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MessagesValue, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        let mut repeated = false;
        while let Some(raw) = seq.next_element::<&'de serde_json::value::RawValue>()? {
            let (item, repeats) = self.0.value_of(raw.get()).map_err(de::Error::custom)?;
            repeated |= repeats;
            items.push(item);
        }
        Ok(MessagesValue(Value::from(items), repeated))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<MessagesValue, A::Error> {
        let repeated = Cell::new(false);
        let value = JsonVisitor(&repeated).visit_map(map)?;
        Ok(MessagesValue(value, repeated.get()))
    }
}

/// Objects with at most this many keys become a [`SmallMap`]; larger ones
/// minijinja's own (hashed, insertion-ordered) map.
const SMALL_MAP_KEYS: usize = 16;

/// A JSON object of a few keys, in the client's order: a vector searched
/// linearly. Chat messages and content parts are such objects; building
/// one costs one allocation, where minijinja's map (an `IndexMap` with a
/// freshly seeded SipHash) hashes every key on insert. Lookups compare
/// strings, as minijinja's map itself does for maps of up to 12 keys.
/// Behaves as that map in templates: a mapping whose iteration yields the
/// keys, `items()` the pairs, in order.
#[derive(Debug)]
struct SmallMap {
    entries: Vec<(Value, Value)>,
}

impl SmallMap {
    fn get(&self, key: &str) -> Option<&Value> {
        self.entries
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v)
    }
}

impl Object for SmallMap {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str() {
            Some(name) => self.get_value_by_str(name),
            None => self
                .entries
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone()),
        }
    }

    fn get_value_by_str(self: &Arc<Self>, key: &str) -> Option<Value> {
        self.get(key).cloned()
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        self.mapped_rev_key_value_enumerator(|this| {
            Box::new(this.entries.iter().map(|(k, v)| (k.clone(), v.clone())))
        })
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.entries.len())
    }
}

/// The key/value pairs, in order, of an object [`JsonSeed`] built as a
/// [`SmallMap`]; `None` for any other value. Lets hot checks read a
/// message's fields without minijinja's boxed iteration.
pub(crate) fn small_map_entries(value: &Value) -> Option<&[(Value, Value)]> {
    value
        .downcast_object_ref::<SmallMap>()
        .map(|map| map.entries.as_slice())
}

/// Where an object [`JsonSeed`] built as a [`SmallMap`] lives: an
/// identity that holds while some clone of `value` is alive (no other
/// object can have this address then), for memos keyed by the object
/// itself rather than by its contents. `None` for any other value.
pub(crate) fn small_map_identity(value: &Value) -> Option<usize> {
    value
        .downcast_object_ref::<SmallMap>()
        .map(|map| std::ptr::from_ref(map) as usize)
}

/// The value under the string `key` in an object [`JsonSeed`] built as a
/// [`SmallMap`], borrowed: `None` for any other value, `Some(None)` when
/// the key is absent.
pub(crate) fn small_map_get<'v>(value: &'v Value, key: &str) -> Option<Option<&'v Value>> {
    value
        .downcast_object_ref::<SmallMap>()
        .map(|map| map.get(key))
}

/// An object from its key/value pairs in order; a repeated key keeps its
/// first position and takes the last value (as a Python dict does, and as
/// minijinja's own map does).
pub(crate) fn object_from_pairs(pairs: Vec<(Value, Value)>) -> Value {
    object_noting_repeats(pairs).0
}

/// [`object_from_pairs`], and whether some key was repeated.
fn object_noting_repeats(mut pairs: Vec<(Value, Value)>) -> (Value, bool) {
    let given = pairs.len();
    if given > SMALL_MAP_KEYS {
        let object = Value::from_iter(pairs);
        let repeated = object.len() != Some(given);
        return (object, repeated);
    }
    let mut at = 1;
    while at < pairs.len() {
        if let Some(first) = pairs[..at].iter().position(|(k, _)| *k == pairs[at].0) {
            let (_, value) = pairs.remove(at);
            pairs[first].1 = value;
        } else {
            at += 1;
        }
    }
    let repeated = pairs.len() != given;
    (Value::from_object(SmallMap { entries: pairs }), repeated)
}

/// Deserializes any self-describing input (JSON) straight into template
/// values: strings, numbers, booleans and `null` as minijinja's own
/// deserializer makes them, arrays as value vectors, objects through
/// [`object_from_pairs`]. Sets the flag when some object repeats a key
/// (the value keeps the last, as a Python dict does).
#[derive(Clone, Copy)]
pub(crate) struct JsonSeed<'f>(pub(crate) &'f Cell<bool>);

impl<'de> DeserializeSeed<'de> for JsonSeed<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(JsonVisitor(self.0))
    }
}

struct JsonVisitor<'f>(&'f Cell<bool>);

impl<'de> Visitor<'de> for JsonVisitor<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    visit_primitives!(|value| value);

    fn visit_none<E: serde::de::Error>(self) -> Result<Value, E> {
        Ok(Value::from(()))
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Value, E> {
        Ok(Value::from(()))
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        JsonSeed(self.0).deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(item) = seq.next_element_seed(JsonSeed(self.0))? {
            items.push(item);
        }
        Ok(Value::from(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut pairs = Vec::with_capacity(map.size_hint().unwrap_or(4).min(SMALL_MAP_KEYS));
        while let Some(key) = map.next_key_seed(JsonSeed(self.0))? {
            let value = map.next_value_seed(JsonSeed(self.0))?;
            pairs.push((key, value));
        }
        let (object, repeated) = object_noting_repeats(pairs);
        if repeated {
            self.0.set(true);
        }
        Ok(object)
    }
}

fn yes() -> bool {
    true
}

/// The parts of a `/v1/chat/completions` body that decide the prompt.
///
/// Unknown fields are ignored, so the whole request body deserializes into
/// it. Defaults follow vLLM's `ChatCompletionRequest`:
/// `add_generation_prompt = true`, `continue_final_message = false`,
/// `add_special_tokens = false`.
#[derive(Clone, Deserialize)]
pub struct ChatRequest {
    pub(crate) messages: MessagesValue,
    #[serde(default)]
    pub(crate) tools: Option<TemplateValue>,
    #[serde(default)]
    pub(crate) documents: Option<TemplateValue>,
    #[serde(default)]
    pub(crate) chat_template_kwargs: Option<TemplateValue>,
    #[serde(default = "yes")]
    pub(crate) add_generation_prompt: bool,
    #[serde(default)]
    pub(crate) continue_final_message: bool,
    #[serde(default)]
    pub(crate) add_special_tokens: bool,
    /// The body's length when parsed from bytes: a size hint for the
    /// rendering (which is mostly the messages' text).
    #[serde(skip)]
    pub(crate) body_len: usize,
    /// Whether `messages` were read through a [`MessageMemo`], whose
    /// messages come back as the same objects in a conversation's next
    /// request: worth keeping their preparation by identity
    /// (`messages::PreparedMemo`); fresh objects would never be seen again.
    #[serde(skip)]
    pub(crate) messages_shared: bool,
}

/// The request's fields; not how its messages were read (through a
/// message memo or not), which changes nothing it renders to.
impl fmt::Debug for ChatRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatRequest")
            .field("messages", &self.messages)
            .field("tools", &self.tools)
            .field("documents", &self.documents)
            .field("chat_template_kwargs", &self.chat_template_kwargs)
            .field("add_generation_prompt", &self.add_generation_prompt)
            .field("continue_final_message", &self.continue_final_message)
            .field("add_special_tokens", &self.add_special_tokens)
            .field("body_len", &self.body_len)
            .finish_non_exhaustive()
    }
}

impl ChatRequest {
    /// Parses a request body (the whole `/v1/chat/completions` JSON).
    pub fn from_json(body: &[u8]) -> Result<Self> {
        // One UTF-8 check of the whole body is cheaper than serde_json's
        // check of each string; invalid UTF-8 takes the byte path, whose
        // error names the position.
        let parsed = match std::str::from_utf8(body) {
            Ok(text) => serde_json::from_str(text),
            Err(_) => serde_json::from_slice(body),
        };
        let mut request: Self = parsed.map_err(|e| Error::InvalidRequest(e.to_string()))?;
        request.body_len = body.len();
        Ok(request)
    }

    /// [`from_json`](Self::from_json), with each element of `messages`
    /// taken from `memo` when an earlier request had it byte for byte (and
    /// kept there when not): a conversation's next request parses only its
    /// new messages (see [`MessageMemo`]). The same request as `from_json`'s,
    /// and the same errors but the wording of some. A body under
    /// [`MIN_BODY_BYTES`](crate::MIN_BODY_BYTES) is read by
    /// `from_json`.
    pub fn from_json_with(body: &[u8], memo: &MessageMemo) -> Result<Self> {
        if body.len() < crate::message_memo::MIN_BODY_BYTES {
            return Self::from_json(body);
        }
        let Ok(text) = std::str::from_utf8(body) else {
            return Self::from_json(body);
        };
        struct Body<'m>(&'m MessageMemo);
        impl<'de> Visitor<'de> for Body<'_> {
            type Value = ChatFields;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("struct ChatRequest")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ChatFields, A::Error> {
                let mut fields = ChatFields::default();
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if !fields.read_with_memo(&key, &mut map, self.0)? {
                        map.next_value::<de::IgnoredAny>()?;
                    }
                }
                Ok(fields)
            }
        }
        let mut de = serde_json::Deserializer::from_str(text);
        let fields = de
            .deserialize_map(Body(memo))
            .and_then(|fields| de.end().map(|()| fields))
            .map_err(|e| Error::InvalidRequest(e.to_string()))?;
        fields.finish(body.len())
    }

    /// Reads a request body that is already parsed. Object keys come in
    /// `serde_json`'s order (see the module docs). Give it the body's
    /// length with [`with_body_len`](Self::with_body_len) when known.
    pub fn from_value(body: &serde_json::Value) -> Result<Self> {
        Self::deserialize(body).map_err(|e| Error::InvalidRequest(e.to_string()))
    }

    /// Sets the length of the body this request was read from, which
    /// [`from_json`](Self::from_json) sets itself: the rendering, mostly
    /// the messages' text, reserves about that much at once rather than
    /// growing step by step.
    pub fn with_body_len(mut self, bytes: usize) -> Self {
        self.body_len = bytes;
        self
    }

    /// A request with these messages (a JSON array of message objects) and
    /// every other field at its default.
    pub fn new(messages: &serde_json::Value) -> Result<Self> {
        let messages = MessagesValue::deserialize(messages)
            .map_err(|e| Error::InvalidRequest(e.to_string()))?;
        Ok(Self {
            messages,
            tools: None,
            documents: None,
            chat_template_kwargs: None,
            add_generation_prompt: true,
            continue_final_message: false,
            add_special_tokens: false,
            body_len: 0,
            messages_shared: false,
        })
    }

    /// Sets `tools` (a JSON array of tool definitions).
    pub fn with_tools(mut self, tools: &serde_json::Value) -> Result<Self> {
        self.tools = Some(
            TemplateValue::deserialize(tools).map_err(|e| Error::InvalidRequest(e.to_string()))?,
        );
        Ok(self)
    }

    /// Sets `add_generation_prompt` (default `true`).
    pub fn with_add_generation_prompt(mut self, yes: bool) -> Self {
        self.add_generation_prompt = yes;
        self
    }

    /// The number of messages, when `messages` is a list.
    pub fn message_count(&self) -> Option<usize> {
        self.messages.0.len()
    }

    /// Whether the request asks for the generation prompt.
    pub fn add_generation_prompt(&self) -> bool {
        self.add_generation_prompt
    }
}

/// The fields of a `/v1/chat/completions` body that decide the prompt,
/// read during a parse the caller drives: a host that reads other fields of
/// the same body (a router's `model` and `stream`) parses it once, handing
/// each key to [`read`](Self::read), and gets from
/// [`finish`](Self::finish) the request [`ChatRequest::from_json`] gives for
/// that body.
///
/// ```
/// use prompt_tokens::ChatFields;
/// use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
///
/// /// A body's `model`, with its prompt's fields, from one parse.
/// struct ModelAndPrompt;
///
/// impl<'de> Visitor<'de> for ModelAndPrompt {
///     type Value = (Option<String>, ChatFields);
///
///     fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         f.write_str("a chat request")
///     }
///
///     fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
///         let (mut model, mut fields) = (None, ChatFields::default());
///         while let Some(key) = map.next_key::<String>()? {
///             if key == "model" {
///                 model = Some(map.next_value()?);
///             } else if !fields.read(&key, &mut map)? {
///                 map.next_value::<IgnoredAny>()?;
///             }
///         }
///         Ok((model, fields))
///     }
/// }
///
/// let body = br#"{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}"#;
/// let mut de = serde_json::Deserializer::from_slice(body);
/// let (model, fields) = de.deserialize_map(ModelAndPrompt).unwrap();
/// let request = fields.finish(body.len()).unwrap();
/// assert_eq!(model.as_deref(), Some("m"));
/// assert_eq!(request.message_count(), Some(1));
/// ```
#[derive(Debug, Default)]
pub struct ChatFields {
    messages: Option<MessagesValue>,
    tools: Option<TemplateValue>,
    documents: Option<TemplateValue>,
    chat_template_kwargs: Option<TemplateValue>,
    add_generation_prompt: Option<bool>,
    continue_final_message: bool,
    add_special_tokens: bool,
    /// One bit per field read, in [`CHAT_FIELDS`]'s order.
    seen: u8,
    /// `messages` were read through a memo.
    messages_shared: bool,
}

/// The fields [`ChatFields`] reads, by name.
const CHAT_FIELDS: [&str; 7] = [
    "messages",
    "tools",
    "documents",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
];

impl ChatFields {
    /// Reads the value of `key` from `map` when `key` is one of the
    /// prompt's fields (`messages`, `tools`, `documents`,
    /// `chat_template_kwargs`, `add_generation_prompt`,
    /// `continue_final_message`, `add_special_tokens`) and answers `true`;
    /// answers `false` and reads nothing for any other key, whose value the
    /// caller reads or skips. A field given twice is an error, as it is for
    /// [`ChatRequest::from_json`].
    pub fn read<'de, A: MapAccess<'de>>(
        &mut self,
        key: &str,
        map: &mut A,
    ) -> Result<bool, A::Error> {
        self.read_field(key, map, None)
    }

    /// [`read`](Self::read), with the elements of `messages` taken from
    /// `memo` when an earlier request had them byte for byte (see
    /// [`MessageMemo`]). Only for serde_json's deserializers of text
    /// (`from_str`, `from_slice`): another deserializer's `messages` is an
    /// error.
    pub fn read_with_memo<'de, A: MapAccess<'de>>(
        &mut self,
        key: &str,
        map: &mut A,
        memo: &MessageMemo,
    ) -> Result<bool, A::Error> {
        self.read_field(key, map, Some(memo))
    }

    fn read_field<'de, A: MapAccess<'de>>(
        &mut self,
        key: &str,
        map: &mut A,
        memo: Option<&MessageMemo>,
    ) -> Result<bool, A::Error> {
        let Some(index) = CHAT_FIELDS.iter().position(|name| *name == key) else {
            return Ok(false);
        };
        let bit = 1u8 << index;
        if self.seen & bit != 0 {
            return Err(de::Error::duplicate_field(CHAT_FIELDS[index]));
        }
        self.seen |= bit;
        match index {
            0 => {
                self.messages = Some(match memo {
                    Some(memo) => map.next_value_seed(MessagesSeed(memo))?,
                    None => map.next_value()?,
                });
                self.messages_shared = memo.is_some();
            }
            1 => self.tools = map.next_value()?,
            2 => self.documents = map.next_value()?,
            3 => self.chat_template_kwargs = map.next_value()?,
            4 => self.add_generation_prompt = Some(map.next_value()?),
            5 => self.continue_final_message = map.next_value()?,
            _ => self.add_special_tokens = map.next_value()?,
        }
        Ok(true)
    }

    /// The request, given the length of the body read (a size hint for the
    /// rendering); an error when the body had no `messages`.
    pub fn finish(self, body_len: usize) -> Result<ChatRequest> {
        let messages = self
            .messages
            .ok_or_else(|| Error::InvalidRequest("missing field `messages`".into()))?;
        Ok(ChatRequest {
            messages,
            tools: self.tools,
            documents: self.documents,
            chat_template_kwargs: self.chat_template_kwargs,
            add_generation_prompt: self.add_generation_prompt.unwrap_or(true),
            continue_final_message: self.continue_final_message,
            add_special_tokens: self.add_special_tokens,
            body_len,
            messages_shared: self.messages_shared,
        })
    }
}

impl ChatRequest {
    /// The conversation as plain text, for a reader that routes or logs on
    /// text rather than on the rendered prompt: each message's `role` and
    /// the text of its `content` (a string; or a list whose strings and
    /// objects' string `text` fields are its text; anything else has
    /// none).
    ///
    /// `None` for messages of another shape: not a list; a message that is
    /// not an object with a string `role`, or that has more than 16 keys;
    /// a content list holding something other than strings and objects of
    /// at most 16 keys; some object of the messages repeating a key.
    pub fn conversation(&self) -> Option<Conversation<'_>> {
        if self.messages.1 {
            return None;
        }
        let messages = self.messages.0.downcast_object_ref::<Vec<Value>>()?;
        let readable = messages.iter().all(|message| {
            let Some(fields) = small_map_entries(message) else {
                return false;
            };
            let role_is_text = field(fields, "role").is_some_and(|role| role.as_str().is_some());
            role_is_text
                && field(fields, "content").is_none_or(|content| {
                    content
                        .downcast_object_ref::<Vec<Value>>()
                        .is_none_or(|parts| parts.iter().all(part_is_readable))
                })
        });
        readable.then_some(Conversation { messages })
    }
}

/// The value under `key` among an object's fields, when it has one.
fn field<'v>(fields: &'v [(Value, Value)], key: &str) -> Option<&'v Value> {
    fields
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// Whether a content list's item is a string or a (small) object.
fn part_is_readable(part: &Value) -> bool {
    part.as_str().is_some() || small_map_entries(part).is_some()
}

/// The text of a content part: the string itself, or an object's string
/// `text`.
fn part_text(part: &Value) -> Option<&str> {
    match small_map_get(part, "text") {
        Some(text) => text.and_then(Value::as_str),
        None => part.as_str(),
    }
}

/// A chat request's messages as plain text ([`ChatRequest::conversation`]).
#[derive(Debug, Clone, Copy)]
pub struct Conversation<'a> {
    messages: &'a [Value],
}

impl<'a> Conversation<'a> {
    /// Each message's role and the text pieces of its content, in order.
    pub fn messages(&self) -> impl Iterator<Item = (&'a str, TextPieces<'a>)> + Clone + 'a {
        self.messages.iter().map(|message| {
            let fields = small_map_entries(message).unwrap_or_default();
            let role = field(fields, "role")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let pieces = match field(fields, "content") {
                Some(content) => match content.downcast_object_ref::<Vec<Value>>() {
                    Some(parts) => Pieces::Parts(parts.iter()),
                    None => Pieces::One(content.as_str()),
                },
                None => Pieces::One(None),
            };
            (role, TextPieces(pieces))
        })
    }
}

/// The text pieces of one message's content, in order.
#[derive(Debug, Clone)]
pub struct TextPieces<'a>(Pieces<'a>);

#[derive(Debug, Clone)]
enum Pieces<'a> {
    /// A content that is one string, or none.
    One(Option<&'a str>),
    /// A content list: the text of each part that has one.
    Parts(std::slice::Iter<'a, Value>),
}

impl<'a> Iterator for TextPieces<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        match &mut self.0 {
            Pieces::One(text) => text.take(),
            Pieces::Parts(parts) => parts.find_map(part_text),
        }
    }
}

/// One prompt of a `/v1/completions` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompletionPrompt {
    /// A text prompt: tokenized (with special tokens unless the request
    /// says `add_special_tokens: false`).
    Text(String),
    /// A prompt of token ids: used as given.
    Tokens(Vec<u32>),
}

/// The shapes OpenAI's `prompt` field takes: one text, one list of token
/// ids, or a batch of either.
#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// Reads a completion's `prompt` field: a text or a list of token ids, or
/// a batch of exactly one of them. A batch of several is refused (it has
/// no single token sequence to route on or to serve as one request); the
/// error says so. engine-sim's `/v1/completions` reads its prompt with
/// this too, so the router and the stand-in engine accept the same
/// prompts.
impl<'de> Deserialize<'de> for CompletionPrompt {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(match PromptField::deserialize(deserializer)? {
            PromptField::Text(text) => Self::Text(text),
            PromptField::Tokens(tokens) => Self::Tokens(tokens),
            PromptField::Texts(mut texts) if texts.len() == 1 => {
                Self::Text(texts.pop().unwrap_or_default())
            }
            PromptField::TokenLists(mut lists) if lists.len() == 1 => {
                Self::Tokens(lists.pop().unwrap_or_default())
            }
            _ => {
                return Err(serde::de::Error::custom(
                    "one prompt per request: batched prompts have no single token sequence",
                ));
            }
        })
    }
}

/// The parts of a `/v1/completions` body that decide the prompt.
/// `add_special_tokens` defaults to `true`, as in vLLM's `CompletionRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: CompletionPrompt,
    /// Whether the tokenizer adds its special tokens (BOS) to a text prompt.
    pub add_special_tokens: bool,
}

impl<'de> Deserialize<'de> for CompletionRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Body {
            prompt: CompletionPrompt,
            #[serde(default = "yes")]
            add_special_tokens: bool,
        }
        let body = Body::deserialize(deserializer)?;
        Ok(Self {
            prompt: body.prompt,
            add_special_tokens: body.add_special_tokens,
        })
    }
}

impl CompletionRequest {
    /// Parses a request body (the whole `/v1/completions` JSON).
    pub fn from_json(body: &[u8]) -> Result<Self> {
        serde_json::from_slice(body).map_err(|e| Error::InvalidRequest(e.to_string()))
    }

    /// Reads a request body that is already parsed: the request
    /// [`from_json`](Self::from_json) gives for the same body.
    pub fn from_value(body: &serde_json::Value) -> Result<Self> {
        Self::deserialize(body).map_err(|e| Error::InvalidRequest(e.to_string()))
    }

    /// A text prompt with vLLM's default (`add_special_tokens = true`).
    pub fn text(prompt: impl Into<String>) -> Self {
        Self {
            prompt: CompletionPrompt::Text(prompt.into()),
            add_special_tokens: true,
        }
    }

    /// A token-id prompt.
    pub fn tokens(ids: Vec<u32>) -> Self {
        Self {
            prompt: CompletionPrompt::Tokens(ids),
            add_special_tokens: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use minijinja::Environment;
    use proptest::prelude::*;

    use super::TemplateValue;

    /// Everything a template can ask of a mapping, printed.
    const PROBE: &str = "{{ m | length }}|{{ m is mapping }}|{{ 'a' in m }}|{{ m.a }}|\
        {{ m['b'] }}|{{ m.get('c', 'none') }}|{% for k in m %}{{ k }},{% endfor %}|\
        {% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}|{{ m.keys() | list }}|\
        {{ m.values() | list }}|{{ m | dictsort }}|{{ m }}|{{ m | tojson }}|{{ m == m }}|\
        {% if m %}true{% else %}false{% endif %}";

    fn render(m: minijinja::Value) -> String {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.render_str(PROBE, minijinja::context! { m => m })
            .unwrap_or_else(|e| format!("error: {e}"))
    }

    /// A JSON object text with these (possibly repeated) keys, in order.
    fn object_text(pairs: &[(String, i64)]) -> String {
        let body: Vec<String> = pairs.iter().map(|(k, v)| format!("{k:?}: {v}")).collect();
        format!("{{{}}}", body.join(", "))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Objects of up to 24 keys (both sides of the small-map bound),
        /// repeated keys included, look the same to a template as through
        /// minijinja's own deserializer.
        #[test]
        fn objects_render_as_minijinjas_own_maps(
            pairs in prop::collection::vec(("[a-e]{1,2}", -5i64..5), 0..24)
        ) {
            let text = object_text(&pairs);
            let ours: TemplateValue = serde_json::from_str(&text).unwrap();
            let theirs: minijinja::Value = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(render(ours.0), render(theirs));
        }
    }

    #[test]
    fn repeated_keys_keep_first_position_and_last_value() {
        let ours: TemplateValue = serde_json::from_str(r#"{"b": 1, "a": 2, "b": 3}"#).unwrap();
        let keys: Vec<String> = ours.0.try_iter().unwrap().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["b", "a"]);
        assert_eq!(ours.0.get_attr("b").unwrap(), minijinja::Value::from(3));
        assert_eq!(ours.0.len(), Some(2));
    }
}
