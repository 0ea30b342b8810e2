//! A chat request routed on tokens, read in one parse.
//!
//! [`extract`](crate::extract()) reads a body into borrowed views of what
//! routing needs; the prompt's token ids need more of it (every field of
//! every message, `tools`, `documents`, the template's options), as
//! [`prompt_tokens::ChatRequest`] reads it. Parsing the body twice, once
//! for each, cost about 15 % of a warm 8 KB chat's tokenized routing.
//! [`ChatOnce::read`] parses it once: the router's fields (`model`,
//! `stream`, `user`) here, the prompt's through [`ChatFields`], and the
//! routing text, when the ids cannot be computed, from the same messages
//! ([`ChatRequest::conversation`]).
//!
//! It stands for the two parses only where they would read the body
//! alike: a body it answers for gives the [`RequestInfo`] `extract` gives
//! and the request `ChatRequest::from_json` gives. Anything unusual is
//! left to them (`read` answers `None`): a body that is refused or does
//! not parse (so the 400 and its message are `extract`'s), a field of
//! another route (`prompt`, `input`, `query`, `text`, `input_ids`, which
//! `extract` reads and may refuse on a chat route too), a field given
//! twice, and messages of a shape `extract` reads differently from the
//! template's value ([`ChatRequest::conversation`] says which). The fuzz
//! target `request_body` and the tests below check the equality.
//!
//! A completion is read the same way ([`CompletionOnce`]): the router's
//! fields, `prompt` and `add_special_tokens` in one visit, for a prompt
//! that is one text, a batch of one text, or one list of token ids (used
//! as given); anything else is left to `extract` and
//! `CompletionRequest::from_json`.

use std::borrow::Cow;
use std::fmt;

use prompt_tokens::{ChatFields, ChatRequest, CompletionPrompt, CompletionRequest, MessageMemo};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::extract::{RequestInfo, RoutingInputBuf, routing_text};

/// A chat request's router fields and prompt, from one parse of its body.
pub(crate) struct ChatOnce {
    /// The request's info; its routing input is [`RoutingInputBuf::None`]
    /// until the ids or [`routing_text`](Self::routing_text) fill it.
    pub(crate) info: RequestInfo,
    /// What decides the prompt.
    pub(crate) request: ChatRequest,
}

impl fmt::Debug for ChatOnce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatOnce")
            .field("info", &self.info)
            .field("messages", &self.request.message_count())
            .finish()
    }
}

impl ChatOnce {
    /// Reads a `/v1/chat/completions` body in one parse, or `None` for a
    /// body the two parses must read (see the module docs).
    /// The elements of `messages` an earlier request had byte for byte
    /// come from `memo` (see [`MessageMemo`]).
    pub(crate) fn read(body: &[u8], memo: &MessageMemo) -> Option<Self> {
        // As in `extract`: one UTF-8 check of the whole body.
        let text = std::str::from_utf8(body).ok()?;
        let mut de = serde_json::Deserializer::from_str(text);
        // A short body parses in about the time its messages' lookups
        // would take.
        let memo = (body.len() >= prompt_tokens::MIN_BODY_BYTES).then_some(memo);
        let read = de.deserialize_map(ChatVisit(memo)).ok()?;
        de.end().ok()?;
        let request = read.prompt.finish(body.len()).ok()?;
        request.conversation()?;
        let info = read.router.into_info();
        Some(Self { info, request })
    }

    /// The routing text `extract` renders for these messages.
    pub(crate) fn routing_text(&self) -> String {
        match self.request.conversation() {
            Some(conversation) => routing_text(conversation.messages()),
            // `read` checked the messages; nothing changes them since.
            None => String::new(),
        }
    }

    /// The info with the routing text, for a request whose ids are not
    /// computed.
    pub(crate) fn into_text_info(self) -> RequestInfo {
        RequestInfo {
            routing: RoutingInputBuf::Text(self.routing_text()),
            ..self.info
        }
    }
}

/// The fields the router reads on every route: `model`, `stream`, `user`.
#[derive(Default)]
struct RouterFields<'a> {
    model: Option<Cow<'a, str>>,
    stream: Option<bool>,
    user: Option<Cow<'a, str>>,
    /// Which of the three were given, to refuse a repeat as `extract` does.
    seen: [bool; 3],
}

impl<'de> RouterFields<'de> {
    /// Reads `key`'s value when it is one of the three and answers `true`.
    fn read<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<bool, A::Error> {
        match key {
            "model" => self.model = once(&mut self.seen[0], "model", map)?,
            "stream" => self.stream = once(&mut self.seen[1], "stream", map)?,
            "user" => self.user = once(&mut self.seen[2], "user", map)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The info, its routing input still [`RoutingInputBuf::None`].
    fn into_info(self) -> RequestInfo {
        RequestInfo {
            model: self.model.map(Cow::into_owned),
            stream: self.stream.unwrap_or(false),
            user: self.user.map(Cow::into_owned),
            routing: RoutingInputBuf::None,
            segment_cache: None,
        }
    }
}

/// The value of a field that may be given once.
fn once<'de, A: MapAccess<'de>, T: de::Deserialize<'de>>(
    seen: &mut bool,
    name: &'static str,
    map: &mut A,
) -> Result<T, A::Error> {
    if std::mem::replace(seen, true) {
        return Err(de::Error::duplicate_field(name));
    }
    map.next_value()
}

/// Gives up on a body: the two parses read it.
fn give_up<E: de::Error>() -> E {
    E::custom("left to the two parses")
}

/// What the chat visit reads.
struct ChatRead<'a> {
    router: RouterFields<'a>,
    prompt: ChatFields,
}

/// A chat body's object, key by key, with the memo of its messages
/// (none for a short body).
struct ChatVisit<'m>(Option<&'m MessageMemo>);

/// The fields `extract` reads on other routes than the chat's: a chat body
/// that has one is left to `extract`, which reads (and may refuse) it.
const NOT_CHAT: [&str; 5] = ["prompt", "input", "query", "text", "input_ids"];

impl<'de> Visitor<'de> for ChatVisit<'_> {
    type Value = ChatRead<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a chat completion request object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut read = ChatRead {
            router: RouterFields::default(),
            prompt: ChatFields::default(),
        };
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if read.router.read(&key, &mut map)? {
                continue;
            }
            if NOT_CHAT.contains(&&*key) {
                return Err(give_up());
            }
            let read_prompt = match self.0 {
                Some(memo) => read.prompt.read_with_memo(&key, &mut map, memo)?,
                None => read.prompt.read(&key, &mut map)?,
            };
            if !read_prompt {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(read)
    }
}

/// A `/v1/completions` request's router fields and prompt, from one parse
/// of its body (the completion's counterpart of [`ChatOnce`]).
#[derive(Debug)]
pub(crate) struct CompletionOnce {
    /// The request's info: its routing input is the ids as given, or
    /// [`RoutingInputBuf::Text`] of the prompt.
    pub(crate) info: RequestInfo,
    /// What decides a text prompt's ids; `None` for ids as given.
    pub(crate) request: Option<CompletionRequest>,
}

impl CompletionOnce {
    /// Reads a `/v1/completions` body in one parse, or `None` for a body
    /// the two parses must read: one they refuse or read differently, a
    /// prompt other than one text, a batch of one text or one list of
    /// token ids, a repeated field, a field of another route.
    pub(crate) fn read(body: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(body).ok()?;
        let mut de = serde_json::Deserializer::from_str(text);
        let read = de.deserialize_map(CompletionVisit).ok()?;
        de.end().ok()?;
        let mut info = read.router.into_info();
        let request = match read.prompt? {
            CompletionText::Text(text) => {
                info.routing = RoutingInputBuf::Text(text.clone().into_owned());
                Some(CompletionRequest {
                    prompt: CompletionPrompt::Text(text.into_owned()),
                    add_special_tokens: read.add_special_tokens.unwrap_or(true),
                })
            }
            CompletionText::Tokens(ids) => {
                info.routing = RoutingInputBuf::Tokens(ids);
                None
            }
        };
        Some(Self { info, request })
    }
}

/// What the completion visit reads.
struct CompletionRead<'a> {
    router: RouterFields<'a>,
    prompt: Option<CompletionText<'a>>,
    add_special_tokens: Option<bool>,
}

/// The prompts [`CompletionOnce`] reads.
enum CompletionText<'a> {
    /// One text, or a batch of one text.
    Text(Cow<'a, str>),
    /// One list of token ids (not empty).
    Tokens(Vec<u32>),
}

impl<'de> de::Deserialize<'de> for CompletionText<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PromptVisit;

        impl<'de> Visitor<'de> for PromptVisit {
            type Value = CompletionText<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a text or token ids")
            }

            fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Self::Value, E> {
                Ok(CompletionText::Text(Cow::Borrowed(text)))
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
                Ok(CompletionText::Text(Cow::Owned(text.to_owned())))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                match seq.next_element::<IdOrText<'de>>()? {
                    Some(IdOrText::Text(text)) => match seq.next_element::<IgnoredAny>()? {
                        None => Ok(CompletionText::Text(text)),
                        // A batch of several: `extract` routes on the first,
                        // the prompt's parse refuses it.
                        Some(_) => Err(give_up()),
                    },
                    Some(IdOrText::Id(first)) => {
                        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0) + 1);
                        ids.push(first);
                        while let Some(id) = seq.next_element::<u32>()? {
                            ids.push(id);
                        }
                        Ok(CompletionText::Tokens(ids))
                    }
                    None => Err(give_up()),
                }
            }
        }

        deserializer.deserialize_any(PromptVisit)
    }
}

/// The first element of a prompt list: a token id or a text.
enum IdOrText<'a> {
    Id(u32),
    Text(Cow<'a, str>),
}

impl<'de> de::Deserialize<'de> for IdOrText<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ItemVisit;

        impl<'de> Visitor<'de> for ItemVisit {
            type Value = IdOrText<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id or a text")
            }

            fn visit_u64<E: de::Error>(self, id: u64) -> Result<Self::Value, E> {
                u32::try_from(id).map(IdOrText::Id).map_err(|_| give_up())
            }

            fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Self::Value, E> {
                Ok(IdOrText::Text(Cow::Borrowed(text)))
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
                Ok(IdOrText::Text(Cow::Owned(text.to_owned())))
            }
        }

        deserializer.deserialize_any(ItemVisit)
    }
}

/// A completion body's object, key by key.
struct CompletionVisit;

/// The fields `extract` reads on other routes than the completion's.
const NOT_COMPLETION: [&str; 5] = ["messages", "input", "query", "text", "input_ids"];

impl<'de> Visitor<'de> for CompletionVisit {
    type Value = CompletionRead<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a completion request object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut read = CompletionRead {
            router: RouterFields::default(),
            prompt: None,
            add_special_tokens: None,
        };
        let (mut prompt, mut special) = (false, false);
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if read.router.read(&key, &mut map)? {
                continue;
            }
            match &*key {
                "prompt" => read.prompt = Some(once(&mut prompt, "prompt", &mut map)?),
                "add_special_tokens" => {
                    read.add_special_tokens =
                        Some(once(&mut special, "add_special_tokens", &mut map)?);
                }
                other if NOT_COMPLETION.contains(&other) => return Err(give_up()),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(read)
    }
}

/// Checks [`ChatOnce::read`] against the two parses for `body`: when it
/// reads the body, `extract` gives the same info (the routing text
/// included) and `ChatRequest::from_json` the same request. Answers
/// whether it read the body. For the tests and the fuzz target
/// `request_body`; panics on a difference.
pub(crate) fn check_against_two_parses(body: &[u8]) -> bool {
    // A memo of the checks' whole run (an element of an earlier body is a
    // hit), and a fresh one: the two must read the body alike.
    static SHARED: std::sync::LazyLock<MessageMemo> =
        std::sync::LazyLock::new(MessageMemo::default);
    let fresh = ChatOnce::read(body, &MessageMemo::default());
    let Some(once) = ChatOnce::read(body, &SHARED) else {
        assert!(fresh.is_none(), "read with one memo, not another");
        return false;
    };
    let shown = String::from_utf8_lossy(body);
    let fresh = fresh.unwrap_or_else(|| panic!("read with one memo, not another: {shown}"));
    assert_eq!(
        format!("{:?}", fresh.request),
        format!("{:?}", once.request),
        "the prompt of {shown}, read with a fresh memo"
    );
    // prompt-tokens' own reading through a memo agrees too.
    let with_memo = ChatRequest::from_json_with(body, &SHARED)
        .unwrap_or_else(|err| panic!("read once, not by the memo's parse ({err}): {shown}"));
    assert_eq!(
        format!("{with_memo:?}"),
        format!("{:?}", once.request),
        "the prompt of {shown}, from_json_with"
    );
    let info = crate::extract(crate::ApiKind::ChatCompletions, body)
        .unwrap_or_else(|err| panic!("read once, refused by extract ({err}): {shown}"));
    let request = ChatRequest::from_json(body)
        .unwrap_or_else(|err| panic!("read once, not by the prompt's parse ({err}): {shown}"));
    assert_eq!(
        format!("{:?}", once.request),
        format!("{request:?}"),
        "the prompt of {shown}"
    );
    assert_eq!(once.into_text_info(), info, "the info of {shown}");
    true
}

/// [`check_against_two_parses`] for [`CompletionOnce::read`]: `extract`
/// gives the same info, and `CompletionRequest::from_json` the same request
/// for a text prompt.
pub(crate) fn check_completion_against_two_parses(body: &[u8]) -> bool {
    let Some(once) = CompletionOnce::read(body) else {
        return false;
    };
    let shown = String::from_utf8_lossy(body);
    let info = crate::extract(crate::ApiKind::Completions, body)
        .unwrap_or_else(|err| panic!("read once, refused by extract ({err}): {shown}"));
    assert_eq!(once.info, info, "the info of {shown}");
    if let Some(request) = once.request {
        let theirs = CompletionRequest::from_json(body)
            .unwrap_or_else(|err| panic!("read once, not by the prompt's parse ({err}): {shown}"));
        assert_eq!(request, theirs, "the prompt of {shown}");
    }
    true
}

#[cfg(test)]
mod tests {
    use super::{ChatOnce, check_against_two_parses, check_completion_against_two_parses};

    fn check(body: &str) -> bool {
        check_against_two_parses(body.as_bytes())
    }

    #[test]
    fn ordinary_chats_are_read_once_as_the_two_parses_read_them() {
        for body in [
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}"#,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},"b",{"type":"image_url","image_url":{"url":"x"}}]}],"stream":true,"user":"u1"}"#,
            r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","content":"42","tool_call_id":"c"}],"tools":[{"type":"function","function":{"name":"f"}}],"add_generation_prompt":false}"#,
            r#"{"messages":[{"role":"user","content":"\u00e9\n\"q\""}],"model":"m\u0031","chat_template_kwargs":{"enable_thinking":false},"documents":[{"title":"t"}]}"#,
            r#"{"messages":[{"role":"user","content":{"unexpected":"object"}},{"role":"user","content":7},{"role":"user"}],"continue_final_message":true,"add_special_tokens":true}"#,
            r#"{"messages":[],"stream":null,"model":null}"#,
        ] {
            assert!(check(body), "not read once: {body}");
        }
    }

    #[test]
    fn unusual_bodies_are_left_to_the_two_parses() {
        for body in [
            // Refused by extract (the 400 is its): no messages, a message
            // without a role, a role that is not text, a part that is a
            // number, a field of the wrong type, not an object, trailing
            // bytes, a body that is not UTF-8.
            r#"{"model":"m"}"#,
            r#"{"messages":null}"#,
            r#"{"messages":[{"content":"x"}]}"#,
            r#"{"messages":[{"role":1,"content":"x"}]}"#,
            r#"{"messages":[{"role":"user","content":[1]}]}"#,
            r#"{"messages":[],"stream":"yes"}"#,
            r#"[]"#,
            r#"{"messages":[]} x"#,
            // Read differently by the views and the template's value: a
            // repeated key, a message given as a list.
            r#"{"messages":[{"role":"user","role":"system","content":"x"}]}"#,
            r#"{"messages":[{"role":"user","content":[{"text":"a","text":"b"}]}]}"#,
            r#"{"messages":[["user","x"]]}"#,
            r#"{"model":"a","model":"b","messages":[]}"#,
            r#"{"messages":[],"messages":[]}"#,
            // Fields of other routes, which extract reads on a chat too.
            r#"{"messages":[],"prompt":"p"}"#,
            r#"{"messages":[],"input_ids":"not ids"}"#,
            // A template option of the wrong type: the prompt's parse fails
            // where extract's does not (the request routes on text).
            r#"{"messages":[],"add_generation_prompt":"yes"}"#,
        ] {
            assert!(!check(body), "read once: {body}");
        }
        assert!(
            ChatOnce::read(
                b"{\"messages\":[],\"model\":\"\xff\"}",
                &prompt_tokens::MessageMemo::default()
            )
            .is_none()
        );
    }

    #[test]
    fn a_message_of_many_keys_is_left_to_the_two_parses() {
        let keys: String = (0..17).map(|i| format!(r#","k{i}":0"#)).collect();
        let body = format!(r#"{{"messages":[{{"role":"user","content":"x"{keys}}}]}}"#);
        assert!(!check(&body));
    }

    #[test]
    fn completions_are_read_once_as_the_two_parses_read_them() {
        let read = |body: &str| check_completion_against_two_parses(body.as_bytes());
        for body in [
            r#"{"model":"m","prompt":"Once upon a time","max_tokens":8}"#,
            r#"{"prompt":["one \u00e9"],"add_special_tokens":false,"stream":true,"user":"u"}"#,
            r#"{"prompt":[1,2,3],"model":"m"}"#,
            r#"{"prompt":"p","temperature":0.2,"logit_bias":{"5":1}}"#,
        ] {
            assert!(read(body), "not read once: {body}");
        }
        for body in [
            r#"{"model":"m"}"#,
            r#"{"prompt":null}"#,
            r#"{"prompt":["a","b"]}"#,
            r#"{"prompt":[[1,2]]}"#,
            r#"{"prompt":[]}"#,
            r#"{"prompt":[1,-2]}"#,
            r#"{"prompt":[1,"a"]}"#,
            r#"{"prompt":[4294967296]}"#,
            r#"{"prompt":"a","prompt":"b"}"#,
            r#"{"prompt":"a","add_special_tokens":"yes"}"#,
            r#"{"prompt":"a","add_special_tokens":true,"add_special_tokens":false}"#,
            r#"{"prompt":"a","messages":[]}"#,
            r#"{"prompt":"a","input_ids":[1]}"#,
            r#"{"prompt":"a"} x"#,
        ] {
            assert!(!read(body), "read once: {body}");
        }
    }

    mod generated {
        use super::check;
        use proptest::prelude::*;

        /// JSON texts of the shapes a message's parts take, usual and not.
        fn value() -> impl Strategy<Value = String> {
            prop_oneof![
                Just(r#""plain""#.to_owned()),
                Just(r#""esc\u00e9\n""#.to_owned()),
                Just("null".to_owned()),
                Just("7".to_owned()),
                Just("1e400".to_owned()),
                Just("true".to_owned()),
                Just(r#"{"a":[1,{"b":2}]}"#.to_owned()),
                Just("[]".to_owned()),
                // Long enough that a body with it is read through the
                // message memo (`prompt_tokens::MIN_BODY_BYTES`).
                Just(format!(r#""{}""#, "a long text ".repeat(180))),
            ]
        }

        fn part() -> impl Strategy<Value = String> {
            prop_oneof![
                value(),
                value().prop_map(|text| format!(r#"{{"type":"text","text":{text}}}"#)),
                value().prop_map(|text| format!(r#"{{"text":{text},"text":"again"}}"#)),
                Just(r#"{"type":"image_url","image_url":{"url":"u"}}"#.to_owned()),
            ]
        }

        fn content() -> impl Strategy<Value = String> {
            prop_oneof![
                value(),
                prop::collection::vec(part(), 0..4)
                    .prop_map(|parts| format!("[{}]", parts.join(","))),
            ]
        }

        fn message() -> impl Strategy<Value = String> {
            let role = prop_oneof![
                Just(r#""user""#.to_owned()),
                Just(r#""assistant""#.to_owned()),
                Just("3".to_owned()),
            ];
            (role, prop::option::of(content()), 0u8..8).prop_map(|(role, content, extra)| {
                let mut fields = vec![format!(r#""role":{role}"#)];
                if let Some(content) = content {
                    fields.push(format!(r#""content":{content}"#));
                }
                match extra {
                    0 => fields.reverse(),
                    1 => fields.push(r#""role":"system""#.to_owned()),
                    2 => fields.clear(),
                    3 => fields.push(r#""name":"n","tool_calls":[{"id":"c"}]"#.to_owned()),
                    _ => {}
                }
                format!("{{{}}}", fields.join(","))
            })
        }

        fn body() -> impl Strategy<Value = String> {
            let field = prop_oneof![
                Just(r#""model":"m""#.to_owned()),
                Just(r#""model":null"#.to_owned()),
                Just(r#""stream":true"#.to_owned()),
                Just(r#""stream":"yes""#.to_owned()),
                Just(r#""user":"u""#.to_owned()),
                Just(r#""tools":[{"type":"function","function":{"name":"f"}}]"#.to_owned()),
                Just(r#""add_generation_prompt":false"#.to_owned()),
                Just(r#""temperature":0.5"#.to_owned()),
                Just(r#""prompt":"p""#.to_owned()),
            ];
            let messages = prop::collection::vec(message(), 0..5)
                .prop_map(|messages| format!(r#""messages":[{}]"#, messages.join(",")));
            (
                messages,
                prop::collection::vec(field, 0..4),
                any::<prop::sample::Index>(),
            )
                .prop_map(|(messages, mut fields, at)| {
                    fields.insert(at.index(fields.len() + 1), messages);
                    format!("{{{}}}", fields.join(","))
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

            /// Whatever the shapes, a body read once reads as the two
            /// parses read it (`check` panics otherwise).
            #[test]
            fn a_body_read_once_reads_as_the_two_parses_do(body in body()) {
                check(&body);
            }
        }

        /// The usual shapes: text, text parts, media parts, no content.
        fn usual_message() -> impl Strategy<Value = String> {
            let part = prop_oneof![
                Just(r#"{"type":"text","text":"a\u00e9"}"#),
                Just(r#""bare""#),
                Just(r#"{"type":"image_url","image_url":{"url":"u"}}"#),
            ];
            let content = prop_oneof![
                Just(r#""text""#.to_owned()),
                Just("null".to_owned()),
                prop::collection::vec(part, 0..4)
                    .prop_map(|parts| format!("[{}]", parts.join(","))),
            ];
            (
                prop_oneof![Just("user"), Just("assistant"), Just("tool")],
                content,
            )
                .prop_map(|(role, content)| format!(r#"{{"role":"{role}","content":{content}}}"#))
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

            /// Every chat of the usual shapes is read once.
            #[test]
            fn usual_chats_are_read_once(messages in prop::collection::vec(usual_message(), 0..6)) {
                let body = format!(r#"{{"model":"m","stream":true,"messages":[{}]}}"#, messages.join(","));
                prop_assert!(check(&body), "left to the two parses: {}", body);
            }
        }
    }
}
