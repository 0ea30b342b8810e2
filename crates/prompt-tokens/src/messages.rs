//! What vLLM does to a conversation before the chat template sees it.
//!
//! vLLM does not hand the client's `messages` to the template as they came.
//! It rebuilds each message (`vllm/entrypoints/chat_utils.py`,
//! `_parse_chat_message_content`), and this module does the same, so the
//! router renders what the engine renders:
//!
//! - **content** becomes what the template's *content format* expects.
//!   The format is found once per template ([`ContentFormat::detect`]):
//!   `openai` when the template loops over a message's `content`, else
//!   `string`. In the `string` format the text parts are joined with `"\n"`
//!   into one string; in the `openai` format content is a list of
//!   `{"type": "text", "text": ...}` parts (a plain string content becomes a
//!   one-part list). `null` content is `""` (string) or `[]` (openai).
//! - **parts** are read by type: `text`, `input_text`, `output_text`,
//!   `refusal` and `thinking` give text (a `text` or `refusal` part without
//!   it is skipped), `tool_reference` its tool name, a bare string is text.
//!   A part of any other type is a bad request ([`Error::InvalidRequest`],
//!   vLLM's "Unsupported chat content part type"); a media part (image,
//!   audio, video, embeddings) is one this crate cannot tokenize, since the
//!   engine's prompt then holds the model processor's placeholders
//!   ([`Error::Unsupported`]).
//! - **other fields** are kept only where vLLM keeps them: `name` and
//!   `task` (strings), an assistant's `tool_calls` (whose string
//!   `arguments` are parsed from JSON into objects, an unparsable one
//!   becoming `{}`; an empty list is dropped) and `reasoning` (also given
//!   as `reasoning_content`), a tool message's `tool_call_id` (and, in the
//!   openai format, its text parts joined into one string), a developer
//!   message's `tools` (`none` when absent). Anything else is dropped.
//!
//! Messages already in their final form (a string role, string content,
//! at most a string `name`, in the `string` format) are passed through
//! without copying: the common case costs one scan.
//!
//! Not mirrored: a part with a `uuid` (vLLM then ignores its `type` and
//! looks for a media key) is read by its `type` here.

use std::collections::{HashMap, VecDeque};

use minijinja::Value;
use minijinja::value::ValueKind;
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::request::{object_from_pairs, small_map_entries, small_map_identity};

/// How a chat template expects a message's `content`: vLLM's
/// `--chat-template-content-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContentFormat {
    /// Content is one string (text parts joined with `"\n"`).
    #[default]
    String,
    /// Content is a list of typed parts (`{"type": "text", "text": ...}`).
    OpenAi,
}

impl ContentFormat {
    /// The format's name as vLLM's flag spells it: `"string"` or `"openai"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::String => "string",
            Self::OpenAi => "openai",
        }
    }

    /// Parses `"string"` or `"openai"`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "string" => Some(Self::String),
            "openai" => Some(Self::OpenAi),
            _ => None,
        }
    }

    /// The format vLLM detects for `template` (its `auto` setting):
    /// `openai` when some `{% for x in m.content %}` (or `m['content']`,
    /// possibly sliced or filtered) loops over the content of a message `m`,
    /// where `m` is the target of a loop over `messages` or over a variable
    /// set from it (`{% set loop_messages = messages[1:] %}`); else
    /// `string`. vLLM walks Jinja's syntax tree; this reads the template's
    /// `for` and `set` tags, which is the same walk for templates whose tags
    /// do not hide `%}` inside string literals.
    pub fn detect(template: &str) -> Self {
        let tags = statement_tags(template);
        // Variables holding the message list: `messages`, then every
        // variable set from one of them, to a fixed point.
        let mut lists: Vec<&str> = vec!["messages"];
        let mut at = 0;
        while at < lists.len() {
            let source = lists[at];
            for tag in &tags {
                if let Tag::Set { name, value } = *tag
                    && refers_to(value, source, None)
                    && !lists.contains(&name)
                {
                    lists.push(name);
                }
            }
            at += 1;
        }
        let message_vars: Vec<&str> = tags
            .iter()
            .filter_map(|tag| match *tag {
                Tag::For { target, iter } if lists.iter().any(|l| refers_to(iter, l, None)) => {
                    Some(target)
                }
                _ => None,
            })
            .collect();
        let loops_over_content = tags.iter().any(|tag| match *tag {
            Tag::For { iter, .. } => message_vars
                .iter()
                .any(|m| refers_to(iter, m, Some("content"))),
            Tag::Set { .. } => false,
        });
        if loops_over_content {
            Self::OpenAi
        } else {
            Self::String
        }
    }
}

/// The `for` and `set` statements of a template, in order.
#[derive(Debug, Clone, Copy)]
enum Tag<'a> {
    For { target: &'a str, iter: &'a str },
    Set { name: &'a str, value: &'a str },
}

fn statement_tags(template: &str) -> Vec<Tag<'_>> {
    let mut tags = Vec::new();
    let mut rest = template;
    loop {
        let comment = rest.find("{#");
        let Some(open) = rest.find("{%") else { break };
        if let Some(c) = comment
            && c < open
        {
            match rest[c..].find("#}") {
                Some(end) => rest = &rest[c + end + 2..],
                None => break,
            }
            continue;
        }
        let body_start = open + 2;
        let Some(close) = rest[body_start..].find("%}") else {
            break;
        };
        let body = rest[body_start..body_start + close]
            .trim_start_matches(['-', '+', '~'])
            .trim_end_matches(['-', '+', '~'])
            .trim();
        rest = &rest[body_start + close + 2..];
        if let Some(tag) = parse_tag(body) {
            tags.push(tag);
        }
    }
    tags
}

fn parse_tag(body: &str) -> Option<Tag<'_>> {
    let (keyword, rest) = body.split_once(char::is_whitespace)?;
    let rest = rest.trim_start();
    match keyword {
        "for" => {
            let (target, iter) = rest.split_once(" in ")?;
            let target = target.trim();
            if !is_identifier(target) {
                return None;
            }
            // `for x in xs if cond recursive`: the condition and the
            // modifier are not part of the iterated expression.
            let mut iter = iter.trim();
            if let Some(stripped) = iter.strip_suffix("recursive") {
                iter = stripped.trim_end();
            }
            if let Some(at) = find_top_level(iter, " if ") {
                iter = iter[..at].trim_end();
            }
            Some(Tag::For { target, iter })
        }
        "set" => {
            let (name, value) = rest.split_once('=')?;
            let name = name.trim();
            // `{% set ns.x = ... %}` and `{% set a, b = ... %}` assign no
            // plain variable.
            if !is_identifier(name) || value.starts_with('=') {
                return None;
            }
            Some(Tag::Set {
                name,
                value: value.trim(),
            })
        }
        _ => None,
    }
}

fn is_identifier(text: &str) -> bool {
    let mut chars = text.chars();
    matches!(chars.next(), Some(c) if c.is_alphabetic() || c == '_')
        && chars.all(|c| c.is_alphanumeric() || c == '_')
}

/// The byte offset of `needle` in `text` outside brackets and quotes.
fn find_top_level(text: &str, needle: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut quote: Option<u8> = None;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match quote {
            Some(q) => {
                if b == b'\\' {
                    i += 1;
                } else if b == q {
                    quote = None;
                }
            }
            None => match b {
                b'\'' | b'"' => quote = Some(b),
                b'(' | b'[' | b'{' => depth += 1,
                b')' | b']' | b'}' => depth = depth.saturating_sub(1),
                // Compared as bytes: `i` may be inside a multi-byte
                // character (slicing the text there would panic). The
                // needles are ASCII, so a match starts on a character
                // boundary and the offset is one the callers can slice at.
                _ if depth == 0 && bytes[i..].starts_with(needle.as_bytes()) => return Some(i),
                _ => {}
            },
        }
        i += 1;
    }
    None
}

/// vLLM's `_is_var_or_elems_access`: whether `expr` is `var` (with `key`:
/// `var.key` or `var['key']`), possibly sliced (`[a:b]`), filtered
/// (`| f`) or tested (`is t`).
fn refers_to(expr: &str, var: &str, key: Option<&str>) -> bool {
    let mut expr = expr.trim();
    while let Some(inner) = expr.strip_prefix('(').and_then(|e| e.strip_suffix(')')) {
        expr = inner.trim();
    }
    if let Some(at) = find_top_level(expr, "|") {
        return refers_to(&expr[..at], var, key);
    }
    if let Some(at) = find_top_level(expr, " is ") {
        return refers_to(&expr[..at], var, key);
    }
    // A trailing slice: `x[1:]`, `x[:-1]`.
    if let Some(stripped) = expr.strip_suffix(']')
        && let Some(open) = stripped.rfind('[')
        && find_top_level(&stripped[open + 1..], ":").is_some()
    {
        return refers_to(&stripped[..open], var, key);
    }
    match key {
        None => expr == var,
        Some(key) => {
            let Some(rest) = expr.strip_prefix(var) else {
                return false;
            };
            let rest = rest.trim();
            if let Some(attr) = rest.strip_prefix('.') {
                return attr.trim() == key;
            }
            rest.strip_prefix('[')
                .and_then(|r| r.strip_suffix(']'))
                .map(str::trim)
                .and_then(|r| {
                    r.strip_prefix('\'')
                        .and_then(|r| r.strip_suffix('\''))
                        .or_else(|| r.strip_prefix('"').and_then(|r| r.strip_suffix('"')))
                })
                .is_some_and(|k| k == key)
        }
    }
}

/// Part types vLLM reads as text, with the field that holds the text, and
/// whether a part without it is skipped (else an error).
const TEXT_PARTS: [(&str, &str, bool); 6] = [
    ("text", "text", true),
    ("refusal", "refusal", true),
    ("input_text", "text", false),
    ("output_text", "text", false),
    ("thinking", "thinking", false),
    ("tool_reference", "name", false),
];

/// Part types vLLM accepts that carry media (or embeddings).
const MEDIA_PARTS: [&str; 10] = [
    "image_url",
    "input_image",
    "image_pil",
    "image_embeds",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
    "prompt_embeds",
    "file",
];

/// Keys that mark a media part that has no `type`.
const MEDIA_KEYS: [&str; 8] = [
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
];

fn invalid(message: impl Into<String>) -> Error {
    Error::InvalidRequest(message.into())
}

/// One content part, read.
enum Part {
    Text(Value),
    ToolReference(Value),
}

/// Reads a content part: `Ok(None)` for a part vLLM skips.
fn read_part(part: &Value) -> Result<Option<Part>> {
    if part.kind() == ValueKind::String {
        return Ok(Some(Part::Text(part.clone())));
    }
    if part.kind() != ValueKind::Map {
        return Err(invalid("each content part must be an object or a string"));
    }
    let kind = part.get_attr("type").unwrap_or_default();
    let Some(kind) = kind.as_str() else {
        if !(kind.is_undefined() || kind.is_none()) {
            return Err(invalid("a content part's 'type' must be a string"));
        }
        if let Some(key) = MEDIA_KEYS.iter().find(|k| {
            part.get_attr(k)
                .is_ok_and(|v| !v.is_undefined() && !v.is_none())
        }) {
            return Err(media(key));
        }
        if let Ok(name) = part.get_attr("tool_reference")
            && !name.is_undefined()
        {
            return Ok(Some(Part::ToolReference(string_field(
                part,
                "name",
                "tool_reference",
            )?)));
        }
        return Err(invalid("a content part has no 'type'"));
    };
    if let Some(&(_, field, skip_if_missing)) = TEXT_PARTS.iter().find(|(t, ..)| *t == kind) {
        let value = part.get_attr(field).unwrap_or_default();
        if skip_if_missing && (value.is_undefined() || value.is_none()) {
            return Ok(None);
        }
        let text = string_field(part, field, kind)?;
        return Ok(Some(if kind == "tool_reference" {
            Part::ToolReference(text)
        } else {
            Part::Text(text)
        }));
    }
    if MEDIA_PARTS.contains(&kind) {
        return Err(media(kind));
    }
    let supported: Vec<&str> = TEXT_PARTS
        .iter()
        .map(|(t, ..)| *t)
        .chain(MEDIA_PARTS)
        .collect();
    Err(invalid(format!(
        "unsupported chat content part type '{kind}'; supported types: {}",
        supported.join(", ")
    )))
}

fn string_field(part: &Value, field: &str, kind: &str) -> Result<Value> {
    let value = part.get_attr(field).unwrap_or_default();
    if value.kind() == ValueKind::String {
        Ok(value)
    } else {
        Err(invalid(format!(
            "a '{kind}' content part needs a string '{field}'"
        )))
    }
}

fn media(kind: &str) -> Error {
    Error::Unsupported(format!(
        "a '{kind}' content part: multimodal prompts hold the model processor's \
         placeholders, which only the engine computes"
    ))
}

/// The fields of a message that survive, in vLLM's order.
fn attr(message: &Value, key: &str) -> Value {
    message.get_attr(key).unwrap_or_default()
}

fn present(value: &Value) -> bool {
    !value.is_undefined() && !value.is_none()
}

/// Whether `message` is already what [`prepare`] would make of it in the
/// `string` format: nothing to copy.
fn is_final_string_form(message: &Value) -> bool {
    let mut role_ok = false;
    let mut content_ok = false;
    let mut check = |key: &Value, value: &Value| {
        match key.as_str() {
            Some("role") => {
                // A developer message gains `tools`.
                role_ok = value.as_str().is_some_and(|r| r != "developer");
            }
            Some("content") => content_ok = value.kind() == ValueKind::String,
            Some("name") if value.kind() == ValueKind::String => {}
            _ => return false,
        }
        true
    };
    // Messages parsed from JSON are small maps: read their pairs in place
    // (this runs on every message of every request).
    if let Some(entries) = small_map_entries(message) {
        if !entries.iter().all(|(key, value)| check(key, value)) {
            return false;
        }
    } else {
        let Ok(keys) = message.try_iter() else {
            return false;
        };
        for key in keys {
            let value = attr(message, key.as_str().unwrap_or(""));
            if !check(&key, &value) {
                return false;
            }
        }
    }
    role_ok && content_ok
}

/// The messages as vLLM hands them to a template of `format` (see the
/// module docs). Errors name the problem: a message that is not an
/// object, a missing role, content of the wrong kind, an unknown part
/// type ([`Error::InvalidRequest`]) or a media part ([`Error::Unsupported`]).
pub fn prepare(messages: &Value, format: ContentFormat) -> Result<Value> {
    prepare_with(messages, format, None)
}

/// [`prepare`], taking each message that `memo` has seen from it: the
/// memo of a template ([`PreparedMemo`]), for messages that are the same
/// objects from one request to the next (the router's
/// [`MessageMemo`](crate::MessageMemo) hands a conversation's earlier
/// messages out again, shared).
pub(crate) fn prepare_with(
    messages: &Value,
    format: ContentFormat,
    memo: Option<&PreparedMemo>,
) -> Result<Value> {
    if messages.kind() != ValueKind::Seq {
        return Err(invalid("messages must be a list"));
    }
    let count = messages.len().unwrap_or(0);
    let is_final = |m: &Value| {
        format == ContentFormat::String && m.kind() == ValueKind::Map && is_final_string_form(m)
    };
    if format == ContentFormat::String {
        // Messages parsed from JSON are a vector: read it in place rather
        // than through minijinja's boxed iterator (this runs on every chat).
        let all_final = match messages.downcast_object_ref::<Vec<Value>>() {
            Some(list) => list.iter().all(is_final),
            None => messages
                .try_iter()
                .map_err(|_| invalid("messages must be a list"))?
                .all(|m| is_final(&m)),
        };
        if all_final {
            return Ok(messages.clone());
        }
    }
    let iter = messages
        .try_iter()
        .map_err(|_| invalid("messages must be a list"))?;
    let Some(memo) = memo else {
        let mut out = Vec::with_capacity(count);
        for message in iter {
            if is_final(&message) {
                out.push(message);
            } else {
                out.push(prepare_message(&message, format)?);
            }
        }
        return Ok(Value::from(out));
    };
    // One lock for the lookups, the preparation of what was missing
    // outside it, one lock for the inserts.
    let mut out = Vec::with_capacity(count);
    let mut missing = Vec::new();
    {
        let state = memo.state.lock();
        for message in iter {
            if is_final(&message) {
                out.push(message);
                continue;
            }
            let key = small_map_identity(&message);
            match key.and_then(|key| state.entries.get(&key)) {
                Some(entry) => out.push(entry.prepared.clone()),
                None => {
                    missing.push((out.len(), key, message));
                    out.push(Value::UNDEFINED);
                }
            }
        }
    }
    let mut made = Vec::with_capacity(missing.len());
    for (at, key, message) in missing {
        let prepared = prepare_message(&message, format)?;
        out[at] = prepared.clone();
        if let Some(key) = key {
            made.push((key, message, prepared));
        }
    }
    if !made.is_empty() {
        memo.keep(made);
    }
    Ok(Value::from(out))
}

/// Messages prepared for one template ([`prepare_with`]), kept by the
/// identity of the message object they were made from: a conversation's
/// next request, read through the router's message memo, holds its
/// earlier messages as the same objects, and each is prepared once
/// instead of on every turn (in the `openai` format, every message is
/// rebuilt with its content as a list of parts: 3,400 instructions a
/// message, 229,000 for a 68-message conversation on Mistral Small 3.2).
///
/// Exact by construction: an entry keeps a clone of its message, so no
/// other object can be at that address while the entry exists, and a
/// message object never changes (template values are immutable), so the
/// same address is the same message; its preparation depends only on it
/// and on the format, which is the template's. Bounded by bytes: an entry
/// is charged its message's text (which it keeps alive, perhaps past the
/// message memo's own eviction) and the prepared copy's structure; the
/// oldest entries go first.
pub(crate) struct PreparedMemo {
    state: Mutex<PreparedState>,
    budget: usize,
}

/// The bytes a [`PreparedMemo`] holds by default: about 800 conversations
/// of 68 messages and 8 KB (some 600 bytes charged a message).
pub(crate) const PREPARED_MEMO_BYTES: usize = 32 * 1024 * 1024;

/// What an entry is charged beyond its message's text: the map entry, the
/// prepared message's maps and lists.
const PREPARED_ENTRY_BYTES: usize = 384;

#[derive(Default)]
struct PreparedState {
    entries: HashMap<usize, PreparedEntry, ahash::RandomState>,
    order: VecDeque<usize>,
    bytes: usize,
}

struct PreparedEntry {
    /// Keeps the message, and so its address, alive.
    _message: Value,
    prepared: Value,
    cost: usize,
}

impl Default for PreparedMemo {
    fn default() -> Self {
        Self::with_budget(PREPARED_MEMO_BYTES)
    }
}

impl PreparedMemo {
    /// A memo of at most `budget` bytes (0 keeps nothing).
    pub(crate) fn with_budget(budget: usize) -> Self {
        PreparedMemo {
            state: Mutex::new(PreparedState::default()),
            budget,
        }
    }

    /// Messages held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.state.lock().entries.len()
    }

    /// Bytes charged.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.state.lock().bytes
    }

    fn keep(&self, made: Vec<(usize, Value, Value)>) {
        if self.budget == 0 {
            return;
        }
        let made: Vec<_> = made
            .into_iter()
            .map(|(key, message, prepared)| {
                let cost = PREPARED_ENTRY_BYTES + text_bytes(&message, 0);
                (key, message, prepared, cost)
            })
            .collect();
        let mut state = self.state.lock();
        for (key, message, prepared, cost) in made {
            if cost > self.budget {
                continue;
            }
            // Two requests may prepare the same message at once: the
            // first entry stays (both are the same preparation).
            if let std::collections::hash_map::Entry::Vacant(slot) = state.entries.entry(key) {
                slot.insert(PreparedEntry {
                    _message: message,
                    prepared,
                    cost,
                });
                state.order.push_back(key);
                state.bytes += cost;
            }
        }
        while state.bytes > self.budget {
            let Some(oldest) = state.order.pop_front() else {
                break;
            };
            if let Some(entry) = state.entries.remove(&oldest) {
                state.bytes -= entry.cost;
            }
        }
    }
}

/// About how many bytes `value` holds: its strings' lengths and 16 a
/// value, read to a depth of 16 (below it, 1 KiB a value: JSON nesting is
/// bounded, and this is an estimate for a bound, not a measure).
fn text_bytes(value: &Value, depth: usize) -> usize {
    const VALUE_BYTES: usize = 16;
    if depth >= 16 {
        return 1024;
    }
    match value.kind() {
        ValueKind::String => VALUE_BYTES + value.as_str().map_or(0, str::len),
        ValueKind::Map => {
            let pairs = small_map_entries(value).map(|entries| {
                entries
                    .iter()
                    .map(|(key, item)| text_bytes(key, depth + 1) + text_bytes(item, depth + 1))
                    .sum::<usize>()
            });
            VALUE_BYTES
                + pairs.unwrap_or_else(|| {
                    value.try_iter().map_or(0, |keys| {
                        keys.map(|key| {
                            let item = value.get_item(&key).unwrap_or_default();
                            text_bytes(&key, depth + 1) + text_bytes(&item, depth + 1)
                        })
                        .sum()
                    })
                })
        }
        ValueKind::Seq => {
            VALUE_BYTES
                + value.try_iter().map_or(0, |items| {
                    items.map(|item| text_bytes(&item, depth + 1)).sum()
                })
        }
        _ => VALUE_BYTES,
    }
}

fn prepare_message(message: &Value, format: ContentFormat) -> Result<Value> {
    if message.kind() != ValueKind::Map {
        return Err(invalid("each message must be an object"));
    }
    let role = attr(message, "role");
    let Some(role_name) = role.as_str() else {
        return Err(invalid("each message needs a string 'role'"));
    };
    let content = attr(message, "content");
    let mut parts = Vec::new();
    match content.kind() {
        ValueKind::Undefined | ValueKind::None => {}
        ValueKind::String => parts.push(Part::Text(content.clone())),
        ValueKind::Seq => {
            for part in content
                .try_iter()
                .map_err(|_| invalid("content parts must be a list"))?
            {
                parts.extend(read_part(&part)?);
            }
        }
        _ => {
            return Err(invalid(
                "a message's content must be a string, a list of parts or null",
            ));
        }
    }
    let joined = || {
        let mut text = String::new();
        for (i, part) in parts.iter().enumerate() {
            if i > 0 {
                text.push('\n');
            }
            let (Part::Text(v) | Part::ToolReference(v)) = part;
            text.push_str(v.as_str().unwrap_or(""));
        }
        Value::from(text)
    };
    let content = match format {
        ContentFormat::String => joined(),
        // A tool result of text parts only is one string (most templates
        // print tool content as a string).
        ContentFormat::OpenAi
            if role_name == "tool" && parts.iter().all(|p| matches!(p, Part::Text(_))) =>
        {
            joined()
        }
        ContentFormat::OpenAi => Value::from(
            parts
                .iter()
                .map(|part| match part {
                    Part::Text(text) => object_from_pairs(vec![
                        (Value::from("type"), Value::from("text")),
                        (Value::from("text"), text.clone()),
                    ]),
                    Part::ToolReference(name) => object_from_pairs(vec![
                        (Value::from("type"), Value::from("tool_reference")),
                        (Value::from("name"), name.clone()),
                    ]),
                })
                .collect::<Vec<_>>(),
        ),
    };
    let mut fields = vec![
        (Value::from("role"), role.clone()),
        (Value::from("content"), content),
    ];
    match role_name {
        "assistant" => {
            let tool_calls = attr(message, "tool_calls");
            if present(&tool_calls)
                && let Some(calls) = prepare_tool_calls(&tool_calls)?
            {
                fields.push((Value::from("tool_calls"), calls));
            }
            let reasoning = attr(message, "reasoning");
            if present(&reasoning) {
                fields.push((Value::from("reasoning"), reasoning.clone()));
                fields.push((Value::from("reasoning_content"), reasoning));
            }
        }
        "tool" => {
            if let Ok(id) = message.get_attr("tool_call_id")
                && !id.is_undefined()
            {
                fields.push((Value::from("tool_call_id"), id));
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        let value = attr(message, key);
        if value.kind() == ValueKind::String {
            fields.push((Value::from(key), value));
        }
    }
    if role_name == "developer" {
        let tools = attr(message, "tools");
        let tools = if tools.is_undefined() {
            Value::from(())
        } else {
            tools
        };
        fields.push((Value::from("tools"), tools));
    }
    Ok(object_from_pairs(fields))
}

/// An assistant's `tool_calls` as vLLM passes them on: `None` for an empty
/// list (dropped), string `arguments` parsed from JSON (`{}` when they do
/// not parse), arguments that are neither objects nor lists as `{}`.
fn prepare_tool_calls(calls: &Value) -> Result<Option<Value>> {
    if calls.kind() != ValueKind::Seq {
        // vLLM leaves a non-list alone; the template decides.
        return Ok(Some(calls.clone()));
    }
    if calls.len() == Some(0) {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(calls.len().unwrap_or(0));
    for call in calls
        .try_iter()
        .map_err(|_| invalid("tool_calls must be a list"))?
    {
        let function = attr(&call, "function");
        if call.kind() != ValueKind::Map || function.kind() != ValueKind::Map {
            return Err(invalid("each tool call needs a 'function' object"));
        }
        let arguments = attr(&function, "arguments");
        let parsed = match arguments.kind() {
            ValueKind::Map | ValueKind::Seq => arguments,
            ValueKind::String => serde_json::from_str::<crate::request::TemplateValue>(
                arguments.as_str().unwrap_or(""),
            )
            .map(|v| v.0)
            .unwrap_or_else(|_| object_from_pairs(Vec::new())),
            _ => object_from_pairs(Vec::new()),
        };
        let function = replace_field(&function, "arguments", parsed);
        out.push(replace_field(&call, "function", function));
    }
    Ok(Some(Value::from(out)))
}

/// A copy of the object `object` with `key` set to `value` (in place when
/// present, else last).
fn replace_field(object: &Value, key: &str, value: Value) -> Value {
    let mut pairs: Vec<(Value, Value)> = object
        .try_iter()
        .map(|keys| {
            keys.map(|k| {
                let v = object.get_item(&k).unwrap_or_default();
                (k, v)
            })
            .collect()
        })
        .unwrap_or_default();
    match pairs.iter_mut().find(|(k, _)| k.as_str() == Some(key)) {
        Some(slot) => slot.1 = value,
        None => pairs.push((Value::from(key), value)),
    }
    object_from_pairs(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::TemplateValue;

    /// An expression with a multi-byte character outside quotes and
    /// brackets (a template that minijinja loads, in a `set` the detection
    /// reads) is scanned, not sliced inside the character: cargo fuzz
    /// found the panic (`start byte index 6 is not a char boundary`).
    #[test]
    fn expressions_with_non_ascii_text_are_scanned_without_a_panic() {
        assert_eq!(find_top_level("names\u{fffd}ace(x) | y", "|"), Some(15));
        assert_eq!(find_top_level("caf\u{e9} is defined", " is "), Some(5));
        assert_eq!(find_top_level("\u{e9}\u{e9}", "|"), None);
        assert!(!refers_to("caf\u{e9} | length", "messages", None));
        assert!(refers_to(
            "messages | selectattr('r', '\u{e9}')",
            "messages",
            None
        ));
        let template =
            "{% set x = caf\u{e9} | length %}{% for m in messages %}{{ m.content }}{% endfor %}";
        let _ = ContentFormat::detect(template);
    }

    fn messages(json: &str) -> Value {
        serde_json::from_str::<TemplateValue>(json).unwrap().0
    }

    fn render(template: &str, messages: &Value) -> String {
        let env = minijinja::Environment::new();
        env.render_str(template, minijinja::context! { messages => messages })
            .unwrap()
    }

    #[test]
    fn detects_loops_over_message_content() {
        let openai = [
            "{% for message in messages %}{% for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}",
            "{%- set loop_messages = messages[1:] -%}{%- for m in loop_messages -%}{%- for c in m.content | selectattr('type', 'equalto', 'text') -%}{{ c.text }}{%- endfor -%}{%- endfor -%}",
            "{% set a = messages %}{% set b = a | list %}{% for m in b if m.role != 'x' %}{% if m.content is string %}{{ m.content }}{% else %}{% for c in m[\"content\"] %}{{ c }}{% endfor %}{% endif %}{% endfor %}",
        ];
        for template in openai {
            assert_eq!(
                ContentFormat::detect(template),
                ContentFormat::OpenAi,
                "{template}"
            );
        }
        let string = [
            "{% for message in messages %}{{ message['content'] }}{% endfor %}",
            // A loop over content of something that is not a message.
            "{% for m in tools %}{% for c in m.content %}{{ c }}{% endfor %}{% endfor %}",
            // Commented out.
            "{# {% for m in messages %}{% for c in m.content %}{% endfor %}{% endfor %} #}{{ messages }}",
            // The first message is not a loop target.
            "{% set first = messages[0] %}{% for c in first.content %}{{ c }}{% endfor %}",
        ];
        for template in string {
            assert_eq!(
                ContentFormat::detect(template),
                ContentFormat::String,
                "{template}"
            );
        }
    }

    #[test]
    fn bundled_templates_take_the_string_format() {
        for family in crate::TemplateFamily::ALL {
            assert_eq!(
                ContentFormat::detect(family.template()),
                ContentFormat::String,
                "{family:?}"
            );
        }
    }

    #[test]
    fn string_format_joins_text_parts_and_skips_empty_ones() {
        let m = messages(
            r#"[{"role": "user", "content": [{"type": "text", "text": "a"}, "b",
                 {"type": "text"}, {"type": "refusal", "refusal": "c"},
                 {"type": "input_text", "text": "d"}], "extra": 1},
                {"role": "assistant", "content": null}]"#,
        );
        let out = prepare(&m, ContentFormat::String).unwrap();
        let t = "{% for m in messages %}[{{ m.role }}:{{ m.content }}:{{ m.extra is defined }}]{% endfor %}";
        assert_eq!(render(t, &out), "[user:a\nb\nc\nd:False][assistant::False]");
    }

    /// A conversation with what the `openai` format rebuilds: string and
    /// part content, a tool call with string arguments, a tool result.
    const AGENT_TURNS: &str = r#"[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}, "now"]},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
        {"role": "assistant", "content": "Sunny.", "reasoning": "it said so"}
    ]"#;

    fn as_json(value: &Value) -> serde_json::Value {
        serde_json::to_value(value).unwrap()
    }

    #[test]
    fn a_memo_serves_the_preparation_each_message_object_had() {
        for format in [ContentFormat::String, ContentFormat::OpenAi] {
            let memo = PreparedMemo::default();
            let list = messages(AGENT_TURNS);
            let fresh = prepare(&list, format).unwrap();
            let first = prepare_with(&list, format, Some(&memo)).unwrap();
            // The final-form string messages (here the system one, in the
            // string format) are passed through, not kept.
            let kept = if format == ContentFormat::String {
                4
            } else {
                5
            };
            assert_eq!(memo.len(), kept, "{format:?}");
            let again = prepare_with(&list, format, Some(&memo)).unwrap();
            assert_eq!(memo.len(), kept);
            assert_eq!(as_json(&first), as_json(&fresh), "{format:?}");
            assert_eq!(as_json(&again), as_json(&fresh), "{format:?}");
            // The same text parsed again is other objects: prepared anew,
            // to the same value, and kept beside the first ones.
            let reparsed = messages(AGENT_TURNS);
            let other = prepare_with(&reparsed, format, Some(&memo)).unwrap();
            assert_eq!(as_json(&other), as_json(&fresh));
            assert_eq!(memo.len(), 2 * kept);
        }
    }

    #[test]
    fn a_memo_keeps_within_its_budget_and_still_prepares_everything() {
        let list = messages(AGENT_TURNS);
        let fresh = prepare(&list, ContentFormat::OpenAi).unwrap();
        let all = PreparedMemo::default();
        prepare_with(&list, ContentFormat::OpenAi, Some(&all)).unwrap();
        assert_eq!(all.len(), 5);
        // Room for about three of the five messages.
        let budget = all.bytes() * 3 / 5;
        let memo = PreparedMemo::with_budget(budget);
        for _ in 0..3 {
            let out = prepare_with(&list, ContentFormat::OpenAi, Some(&memo)).unwrap();
            assert_eq!(as_json(&out), as_json(&fresh));
            assert!(memo.bytes() <= budget, "{} > {budget}", memo.bytes());
            assert!((1..5).contains(&memo.len()), "{}", memo.len());
        }
        // A message larger than the whole budget is prepared, not kept.
        let long = format!(
            r#"[{{"role": "user", "content": "{}"}}]"#,
            "x".repeat(budget)
        );
        let long = messages(&long);
        let out = prepare_with(&long, ContentFormat::OpenAi, Some(&memo)).unwrap();
        assert_eq!(
            as_json(&out),
            as_json(&prepare(&long, ContentFormat::OpenAi).unwrap())
        );
        assert!(memo.bytes() <= budget);
        let none = PreparedMemo::with_budget(0);
        let out = prepare_with(&list, ContentFormat::OpenAi, Some(&none)).unwrap();
        assert_eq!(as_json(&out), as_json(&fresh));
        assert_eq!(none.len(), 0);
    }

    #[test]
    fn a_bad_message_is_refused_through_a_memo_as_without_and_not_kept() {
        let memo = PreparedMemo::default();
        let list = messages(
            r#"[{"role": "user", "content": "ok"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]"#,
        );
        let without = prepare(&list, ContentFormat::OpenAi).unwrap_err();
        let with = prepare_with(&list, ContentFormat::OpenAi, Some(&memo)).unwrap_err();
        assert_eq!(with.to_string(), without.to_string());
        assert_eq!(memo.len(), 0);
    }

    #[test]
    fn final_string_messages_pass_through() {
        let m = messages(r#"[{"role": "user", "content": "hi", "name": "bob"}]"#);
        let out = prepare(&m, ContentFormat::String).unwrap();
        assert_eq!(out, m);
    }

    #[test]
    fn openai_format_makes_every_content_a_list_of_parts() {
        let m = messages(
            r#"[{"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "7", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
                {"role": "user", "content": null}]"#,
        );
        let out = prepare(&m, ContentFormat::OpenAi).unwrap();
        let t = "{% for m in messages %}[{% if m.content is string %}s:{{ m.content }}{% else %}{% for c in m.content %}{{ c.type }}={{ c.text }};{% endfor %}{% endif %}{{ m.tool_call_id }}]{% endfor %}";
        assert_eq!(render(t, &out), "[text=hi;][s:x\ny7][]");
    }

    #[test]
    fn tool_call_arguments_become_objects() {
        let m = messages(
            r#"[{"role": "assistant", "content": null, "reasoning": "r", "tool_calls": [
                 {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2]}"}},
                 {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
                {"role": "assistant", "content": "x", "tool_calls": []}]"#,
        );
        let out = prepare(&m, ContentFormat::String).unwrap();
        let t = "{% for m in messages %}[{{ m.reasoning_content }}|{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments | tojson }};{% endfor %}{{ m.tool_calls is defined }}]{% endfor %}";
        assert_eq!(render(t, &out), r#"[r|f{"b":1,"a":[2]};g{};True][|False]"#);
    }

    #[test]
    fn developer_messages_carry_tools() {
        let m = messages(r#"[{"role": "developer", "content": "d"}]"#);
        let out = prepare(&m, ContentFormat::String).unwrap();
        assert_eq!(render("{{ messages[0].tools is none }}", &out), "True");
    }

    #[test]
    fn bad_parts_are_named() {
        let cases = [
            (
                r#"[{"role": "user", "content": [{"type": "bogus"}]}]"#,
                "'bogus'",
            ),
            (
                r#"[{"role": "user", "content": [{"text": "x"}]}]"#,
                "no 'type'",
            ),
            (
                r#"[{"role": "user", "content": [{"type": 3}]}]"#,
                "'type' must be a string",
            ),
            (
                r#"[{"role": "user", "content": [{"type": "input_text"}]}]"#,
                "needs a string 'text'",
            ),
            (
                r#"[{"role": "user", "content": [7]}]"#,
                "object or a string",
            ),
            (r#"[{"role": "user", "content": 5}]"#, "content must be"),
            (r#"[{"content": "x"}]"#, "'role'"),
            (r#"["x"]"#, "must be an object"),
        ];
        for (json, needle) in cases {
            let error = prepare(&messages(json), ContentFormat::String).unwrap_err();
            assert!(matches!(error, Error::InvalidRequest(_)), "{json}: {error}");
            assert!(error.to_string().contains(needle), "{json}: {error}");
        }
        for json in [
            r#"[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]"#,
            r#"[{"role": "user", "content": [{"image_url": "http://x"}]}]"#,
        ] {
            let error = prepare(&messages(json), ContentFormat::OpenAi).unwrap_err();
            assert!(matches!(error, Error::Unsupported(_)), "{json}: {error}");
        }
    }
}
