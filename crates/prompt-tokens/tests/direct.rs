//! The direct renderer (`src/direct/`) against minijinja, its reference.
//!
//! The direct renderer is an accelerator that may decline but must never
//! disagree: whenever `render_direct` returns a text, minijinja renders
//! exactly that text, and `render` (direct first, minijinja on decline)
//! returns what minijinja alone returns, errors included. This file holds
//! it to that:
//!
//! - every shipped template compiles for the direct path and renders a
//!   representative conversation directly, equal to minijinja;
//! - a differential proptest over random conversations, tools, generation
//!   prompts and `chat_template_kwargs` for every family, which also
//!   counts how often the direct path answered (so it cannot pass by
//!   declining everything);
//! - a table of small templates probing the Jinja semantics the direct
//!   renderer implements (printing, `and`/`or`, comparisons, indexing,
//!   slices, loops, scoping, namespaces, macros, filters, tests, methods,
//!   `strftime_now`), and the constructs it must decline;
//! - the fuel and output limits at and around their exact thresholds.
//!
//! The divergences this file found while the renderer was written (an
//! empty namespace's truth, `set` in a loop's `else`, a slice being an
//! iterable, minijinja's folding of constant `and`, fuel charged for
//! macro parameters and filtered loops) are fixed, and their tests stay as
//! regression tests.

mod common;

use std::cell::Cell;
use std::sync::{Arc, OnceLock};

use common::NOW;
use prompt_tokens::{
    ChatRequest, ChatTemplate, DirectRendering, Error, FixedClock, RenderLimits, SpecialTokens,
    TemplateFamily,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{Value, json};

// ---- helpers ----

/// A rendering's outcome in a comparable form: the text, or the error's
/// message (which names the error's kind and carries its detail).
type Outcome = Result<String, String>;

/// `result` as an [`Outcome`].
fn outcome(result: prompt_tokens::Result<String>) -> Outcome {
    result.map_err(|e| e.to_string())
}

/// The special tokens a family's template prints.
fn family_tokens(family: TemplateFamily) -> SpecialTokens {
    SpecialTokens {
        bos: family.bos_token().map(str::to_owned),
        eos: Some(family.eos_token().to_owned()),
        ..SpecialTokens::default()
    }
}

/// One template compiled twice: `direct` as shipped (direct renderer
/// first) and `reference` with the direct renderer off, which is
/// minijinja alone.
struct Pair {
    direct: ChatTemplate,
    reference: ChatTemplate,
}

impl Pair {
    /// Compiles `source` both ways with a fixed clock ([`NOW`]).
    fn new(source: &str, special: SpecialTokens, limits: RenderLimits) -> Self {
        let compile = || {
            ChatTemplate::new(source, special.clone(), limits, Arc::new(FixedClock(NOW)))
                .unwrap_or_else(|e| panic!("{e}: {source:?}"))
        };
        let direct = compile();
        let reference = compile().with_direct_rendering(false);
        Self { direct, reference }
    }

    /// A small template with no special tokens and the default limits.
    fn plain(source: &str) -> Self {
        Self::new(source, SpecialTokens::default(), RenderLimits::default())
    }

    /// `render` (direct first) against minijinja alone: the same text, or
    /// the same error. Returns minijinja's outcome.
    fn compare_render(&self, request: &ChatRequest) -> Result<Outcome, String> {
        let reference = outcome(self.reference.render(request));
        let through_render = outcome(self.direct.render(request));
        if through_render != reference {
            return Err(format!(
                "render() differs from minijinja's\n  render(): {through_render:?}\n  minijinja: {reference:?}"
            ));
        }
        Ok(reference)
    }

    /// Renders `request` three ways and checks they agree: `render_direct`
    /// (when it answers) and `render` both equal minijinja's rendering.
    /// Returns the reference outcome and the direct renderer's answer, or
    /// a description of the disagreement.
    fn compare(&self, request: &ChatRequest) -> Result<(Outcome, Option<String>), String> {
        let reference = self.compare_render(request)?;
        let direct = self.direct.render_direct(request);
        if let Some(text) = &direct
            && reference.as_ref() != Ok(text)
        {
            return Err(format!(
                "render_direct() differs from minijinja's\n  direct:    {text:?}\n  minijinja: {reference:?}"
            ));
        }
        Ok((reference, direct))
    }
}

/// A request with these messages and every other field at its default.
fn request(messages: Value) -> ChatRequest {
    ChatRequest::new(&messages).expect("request")
}

/// A request parsed from a whole body, as the router parses one (the
/// path that reads `chat_template_kwargs`, `continue_final_message`, ...).
fn body_request(body: Value) -> ChatRequest {
    ChatRequest::from_json(&serde_json::to_vec(&body).expect("json")).expect("request body")
}

/// A tool definition, OpenAI style.
fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    }})
}

/// system, user, assistant with tool calls (arguments as a JSON string
/// and as an object), tool result, user with content parts.
fn representative_conversation() -> Value {
    json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "metric": true}}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18°C, clear"},
        {"role": "user", "content": [
            {"type": "text", "text": "And tomorrow?"},
            {"type": "text", "text": "In °F, please 🙂"}
        ]}
    ])
}

// ---- 1. every shipped template is on the direct path ----

/// Each shipped template compiles for the direct path, and renders a
/// conversation with every message shape (with and without tools and the
/// generation prompt) directly, to minijinja's text.
#[test]
fn every_shipped_template_renders_directly_and_equals_minijinja() {
    for family in TemplateFamily::ALL {
        let pair = Pair::new(
            family.template(),
            family_tokens(family),
            RenderLimits::default(),
        );
        assert_eq!(
            pair.direct.direct_rendering(),
            DirectRendering::On,
            "{family:?}"
        );
        assert_eq!(
            pair.reference.direct_rendering(),
            DirectRendering::Disabled,
            "{family:?}"
        );
        let plain = request(representative_conversation());
        let with_tools = request(representative_conversation())
            .with_tools(&json!([weather_tool()]))
            .expect("tools");
        let without_prompt =
            request(representative_conversation()).with_add_generation_prompt(false);
        for (name, req) in [
            ("no tools", &plain),
            ("tools", &with_tools),
            ("no generation prompt", &without_prompt),
        ] {
            let (reference, direct) = pair
                .compare(req)
                .unwrap_or_else(|e| panic!("{family:?} {name}: {e}"));
            let reference = reference.unwrap_or_else(|e| panic!("{family:?} {name}: {e}"));
            assert_eq!(
                direct.as_deref(),
                Some(reference.as_str()),
                "{family:?} {name}: the direct renderer declined"
            );
        }
    }
}

// ---- 2. differential proptest ----

/// Message text: plain and arbitrary Unicode, with the shipped formats'
/// special tokens and Jinja-looking text mixed in (a rendering must print
/// it verbatim, never interpret it).
fn text_strategy() -> impl Strategy<Value = String> {
    let fragments = prop_oneof![
        "[a-zA-Z0-9 ,.!?'\n\t]{0,24}",
        "\\PC{0,12}",
        Just("<|im_start|>".to_owned()),
        Just("<|im_end|>".to_owned()),
        Just("<|eot_id|>".to_owned()),
        Just("<|start_header_id|>".to_owned()),
        Just("[INST]".to_owned()),
        Just("</s>".to_owned()),
        Just("<|start|>".to_owned()),
        Just("<|message|>".to_owned()),
        Just("{{ messages }}".to_owned()),
        Just("{\"x\": 1}".to_owned()),
        Just("  ".to_owned()),
        Just("\n\n".to_owned()),
        Just("▁".to_owned()),
        Just("🙂".to_owned()),
    ];
    prop::collection::vec(fragments, 0..6).prop_map(|parts| parts.concat())
}

/// A message's `content`: a string, `null`, or a list of parts (text,
/// refusal, bare string, a text part without its text).
fn content_strategy() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => text_strategy().prop_map(Value::from),
        1 => Just(Value::Null),
        2 => prop::collection::vec(
            prop_oneof![
                3 => text_strategy().prop_map(|t| json!({"type": "text", "text": t})),
                1 => text_strategy().prop_map(|t| json!({"type": "refusal", "refusal": t})),
                1 => text_strategy().prop_map(Value::from),
                1 => Just(json!({"type": "text"})),
            ],
            0..3,
        )
        .prop_map(Value::Array),
    ]
}

/// A tool call's `arguments`: a JSON string (as OpenAI sends it) or an
/// object (as some clients and templates use it).
fn arguments_strategy() -> impl Strategy<Value = Value> {
    prop_oneof![
        text_strategy().prop_map(Value::from),
        Just(Value::from("{\"city\": \"Paris\"}")),
        (text_strategy(), -5i64..100, any::<bool>()).prop_map(|(city, days, metric)| {
            json!({"city": city, "days": days, "metric": metric, "tags": [city, null]})
        }),
        Just(json!({})),
        Just(json!({"ratio": 0.5, "nested": {"a": [1, 2.25, "x"]}})),
    ]
}

/// One entry of an assistant message's `tool_calls`.
fn tool_call_strategy() -> impl Strategy<Value = Value> {
    (
        prop_oneof!["[a-z_]{1,12}", text_strategy()],
        arguments_strategy(),
        0u32..1000,
    )
        .prop_map(|(name, arguments, id)| {
            json!({"id": format!("call_{id}"), "type": "function",
                   "function": {"name": name, "arguments": arguments}})
        })
}

/// An assistant message: content, sometimes tool calls, sometimes
/// `reasoning_content` (which the harmony template prints).
fn assistant_strategy() -> impl Strategy<Value = Value> {
    (
        content_strategy(),
        prop::option::weighted(0.4, prop::collection::vec(tool_call_strategy(), 1..3)),
        prop::option::weighted(0.2, text_strategy()),
    )
        .prop_map(|(content, tool_calls, reasoning)| {
            let mut message = json!({"role": "assistant", "content": content});
            if let Some(calls) = tool_calls {
                message["tool_calls"] = Value::Array(calls);
            }
            if let Some(reasoning) = reasoning {
                message["reasoning_content"] = Value::from(reasoning);
            }
            message
        })
}

/// A tool result, with or without the function's `name`.
fn tool_message_strategy() -> impl Strategy<Value = Value> {
    (
        content_strategy(),
        prop::option::of("[a-z_]{1,8}"),
        0u32..1000,
    )
        .prop_map(|(content, name, id)| {
            let mut message =
                json!({"role": "tool", "tool_call_id": format!("call_{id}"), "content": content});
            if let Some(name) = name {
                message["name"] = Value::from(name);
            }
            message
        })
}

/// A message of any role.
fn message_strategy() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => content_strategy().prop_map(|c| json!({"role": "user", "content": c})),
        3 => assistant_strategy(),
        1 => tool_message_strategy(),
        1 => content_strategy().prop_map(|c| json!({"role": "system", "content": c})),
    ]
}

/// Conversations of two shapes: user/assistant alternating after an
/// optional system message (what every template accepts), and any roles
/// in any order (which Mistral's template refuses with `raise_exception`).
fn conversation_strategy() -> impl Strategy<Value = Vec<Value>> {
    let alternating = (
        prop::option::of(text_strategy()),
        prop::collection::vec((content_strategy(), assistant_strategy()), 1..4),
        any::<bool>(),
    )
        .prop_map(|(system, turns, end_on_user)| {
            let mut messages = Vec::new();
            if let Some(system) = system {
                messages.push(json!({"role": "system", "content": system}));
            }
            for (user, assistant) in turns {
                messages.push(json!({"role": "user", "content": user}));
                messages.push(assistant);
            }
            if end_on_user {
                messages.push(json!({"role": "user", "content": "next?"}));
            }
            messages
        });
    prop_oneof![alternating, prop::collection::vec(message_strategy(), 0..7)]
}

/// `chat_template_kwargs` the shipped templates read (`reasoning_effort`,
/// `date_string`, `model_identity`) as strings, integers, `null`,
/// booleans and floats (which they print), or none.
fn kwargs_strategy() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        3 => Just(None),
        1 => Just(Some(json!({"reasoning_effort": "high"}))),
        1 => Just(Some(json!({"date_string": "1 Jan 2024"}))),
        1 => Just(Some(json!({"model_identity": "You are Rusty.", "reasoning_effort": "low"}))),
        1 => text_strategy().prop_map(|t| Some(json!({"reasoning_effort": t, "unused": [1, 2]}))),
        1 => (-3i64..3).prop_map(|n| Some(json!({"reasoning_effort": n}))),
        1 => prop_oneof![Just(Value::Null), any::<bool>().prop_map(Value::from), Just(json!(0.5))]
            .prop_map(|v| Some(json!({"reasoning_effort": v.clone(), "date_string": v, "model_identity": null}))),
    ]
}

/// A whole request body: messages, optional tools, optional
/// `add_generation_prompt`, sometimes `continue_final_message`, optional
/// `chat_template_kwargs`.
fn body_strategy() -> impl Strategy<Value = Value> {
    (
        conversation_strategy(),
        prop::option::of(prop::collection::vec(
            prop_oneof![
                Just(weather_tool()),
                ("[a-z_]{1,10}", text_strategy()).prop_map(|(name, description)| {
                    json!({"type": "function", "function": {"name": name, "description": description,
                        "parameters": {"type": "object", "properties": {}}}})
                }),
            ],
            0..3,
        )),
        prop::option::of(any::<bool>()),
        prop::option::weighted(0.15, any::<bool>()),
        kwargs_strategy(),
    )
        .prop_map(|(messages, tools, add_generation_prompt, continue_final, kwargs)| {
            let mut body = json!({"model": "m", "messages": messages});
            if let Some(tools) = tools {
                body["tools"] = Value::Array(tools);
            }
            if let Some(yes) = add_generation_prompt {
                body["add_generation_prompt"] = Value::from(yes);
            }
            if let Some(yes) = continue_final {
                body["continue_final_message"] = Value::from(yes);
            }
            if let Some(kwargs) = kwargs {
                body["chat_template_kwargs"] = kwargs;
            }
            body
        })
}

/// The shipped templates, each compiled as a [`Pair`] once per test binary.
fn shipped_pairs() -> &'static [(TemplateFamily, Pair)] {
    static PAIRS: OnceLock<Vec<(TemplateFamily, Pair)>> = OnceLock::new();
    PAIRS.get_or_init(|| {
        TemplateFamily::ALL
            .iter()
            .map(|&family| {
                (
                    family,
                    Pair::new(
                        family.template(),
                        family_tokens(family),
                        RenderLimits::default(),
                    ),
                )
            })
            .collect()
    })
}

/// Random requests × every family: direct and minijinja agree, and the
/// direct renderer answers for nearly every request minijinja renders
/// (counted over the whole run; a direct path that declined everything
/// would pass the agreement checks alone).
#[test]
fn random_requests_render_the_same_directly_and_through_minijinja() {
    let config = Config {
        cases: 64,
        source_file: Some(file!()),
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let rendered = Cell::new(0usize);
    let direct = Cell::new(0usize);
    let result = runner.run(&body_strategy(), |body| {
        let req = body_request(body);
        for (family, pair) in shipped_pairs() {
            let (reference, answer) = pair
                .compare(&req)
                .map_err(|e| TestCaseError::fail(format!("{family:?}: {e}")))?;
            if reference.is_ok() {
                rendered.set(rendered.get() + 1);
                if answer.is_some() {
                    direct.set(direct.get() + 1);
                }
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let (rendered, direct) = (rendered.get(), direct.get());
    // 64 cases × 4 families, less Mistral's refusals of unordered
    // conversations and the requests with `continue_final_message`.
    assert!(rendered >= 100, "only {rendered} renderings succeeded");
    assert!(
        direct * 10 >= rendered * 9,
        "the direct renderer answered {direct} of {rendered} successful renderings"
    );
}

// ---- 3. small templates probing the semantics ----

/// Requests every probe renders: four messages starting with a system
/// message, and two messages (a padded user text, an assistant tool call
/// with `null` content) with tools and without the generation prompt.
fn probe_requests() -> Vec<ChatRequest> {
    vec![
        request(json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye 🙂"}
        ])),
        request(json!([
            {"role": "user", "content": "  padded  "},
            {"role": "assistant", "content": null, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": [true, null]}}}]},
        ]))
        .with_tools(&json!([weather_tool()]))
        .expect("tools")
        .with_add_generation_prompt(false),
    ]
}

/// Requests where only agreement is checked (the direct renderer may
/// decline): no messages at all, and `messages` that is not a list.
fn edge_requests() -> Vec<ChatRequest> {
    vec![
        request(json!([])),
        body_request(json!({"messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"messages": "not a list", "extra": null}})),
    ]
}

/// What a probe expects of the direct renderer on [`probe_requests`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Renders directly (`render_direct` is `Some`) on every probe request.
    Direct,
    /// Declines on every probe request; `render` still equals minijinja.
    Declines,
    /// Either, as long as it agrees with minijinja.
    Agrees,
}

/// Checks one probe template on the probe and edge requests; `Err`
/// describes the first disagreement or unexpected answer.
fn check_probe(source: &str, expect: Expect) -> Result<(), String> {
    let pair = Pair::plain(source);
    if pair.direct.direct_rendering() != DirectRendering::On {
        return Err(format!(
            "template {source:?}: {:?}",
            pair.direct.direct_rendering()
        ));
    }
    for (i, req) in probe_requests().iter().enumerate() {
        let (reference, direct) = pair
            .compare(req)
            .map_err(|e| format!("template {source:?}, request {i}: {e}"))?;
        match (expect, &direct) {
            (Expect::Direct, None) => {
                return Err(format!(
                    "template {source:?}, request {i}: declined (minijinja: {reference:?})"
                ));
            }
            (Expect::Declines, Some(text)) => {
                return Err(format!(
                    "template {source:?}, request {i}: expected a decline, rendered {text:?}"
                ));
            }
            _ => {}
        }
    }
    for (i, req) in edge_requests().iter().enumerate() {
        pair.compare(req)
            .map(drop)
            .map_err(|e| format!("template {source:?}, edge request {i}: {e}"))?;
    }
    Ok(())
}

/// Checks every probe in `sources`, reporting all failures at once.
fn check_probes(sources: &[&str], expect: Expect) {
    let failures: Vec<String> = sources
        .iter()
        .filter_map(|source| check_probe(source, expect).err())
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} probes failed:\n{}",
        failures.len(),
        sources.len(),
        failures.join("\n")
    );
}

/// Probes the direct renderer handles, each equal to minijinja.
const DIRECT_PROBES: &[&str] = &[
    // Printing: strings, integers (negative too), undefined; `none` and
    // booleans as minijinja prints them (`None`, `True`, `False`), through
    // `{{ }}` and `~`.
    "{{ 'text' }}|{{ 42 }}|{{ -7 }}|{{ messages | length }}|{{ nothing }}|{{ messages[0].nope }}|",
    "{{ 'a' ~ 3 ~ -2 ~ nothing ~ messages[0].role ~ (messages | length) }}",
    "{% set n = -12 %}{{ n }}{{ '=' ~ n }}",
    "{{ none }}|{{ true }}|{{ false }}|{{ 'a' ~ none ~ true ~ false }}|{{ not nothing }}|{{ 1 == 1 }}|{{ nothing is defined }}",
    "{{ messages[0].content.startswith('Be') }}|{% for m in messages %}{{ loop.first }}{{ loop.last }}{% endfor %}|\
     {% set ns = namespace(x=none, y=true) %}{{ ns.x }}{{ ns.y ~ ns.x }}|{{ messages[0].nope is none }}",
    // `and` / `or` return an operand, `not` negates.
    "{% set e = '' %}{% set z = 0 %}{{ nothing or 'd' }}|{{ e and 'y' }}|{{ 'x' and 'y' }}|{{ e or '' }}|{{ messages[0].role or 'r' }}|\
     {{ z or 5 }}|{{ 3 and z }}|{{ messages[0].nope and 'y' }}|{{ messages and messages[0].role }}",
    "{% if not nothing %}A{% endif %}{% if not messages %}B{% endif %}{% if not '' %}C{% endif %}{% if not (messages and tools) %}D{% endif %}",
    // Comparisons on strings, lists, ints; `in` / `not in`.
    "{% for c in [1 == 1, 'a' != 'b', 1 < 2, -3 < -2, 2 <= 2, 3 > 4, 4 >= 4, 'a' in 'cat', 'z' not in 'cat', \
     2 in [1, 2], 'user' in ['user'], [1, 2] == [1, 2], [1] != [1, 2], 'role' in messages[0], 'nope' not in messages[0], \
     messages[0].role in ['system', 'user'], messages[-1].role == 'user', messages[0] == messages[0], 1 == 1.0, none == none] %}\
     {{ 'T' if c else 'F' }}{% endfor %}",
    // Indexing: negative, first, out of range, by key.
    "{{ messages[-1].role }}|{{ messages[0].role }}|{{ messages[1]['role'] }}|{{ messages[7] }}|{{ messages[-9] }}|{{ messages[0]['nope'] }}|{{ messages[0].content[0] }}",
    "{{ 'A' if messages[7] is defined else 'U' }}{{ 'A' if messages[-1] is defined else 'U' }}",
    // Slices.
    "{% for m in messages[1:] %}{{ m.role }},{% endfor %}|{% for m in messages[:-1] %}{{ m.role }},{% endfor %}|\
     {{ messages[5:] | length }}|{{ messages[1:-1] | length }}|{{ messages[-2:][0].role }}|{{ messages[:0] | length }}|{{ messages[-99:99] | length }}",
    // The loop variable.
    "{% for m in messages %}{{ loop.index0 }}{{ loop.index }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.length }}\
     {% if loop.first %}F{% endif %}{% if loop.last %}L{% endif %};{% endfor %}",
    "{% for m in messages %}{% for c in [1, 2, 3] %}{{ loop.index }}{% endfor %}/{{ loop.index }};{% endfor %}",
    "{% for m in messages %}{% for c in [] %}{% else %}{{ loop.index }}{% endfor %};{% endfor %}",
    // A filtered loop, and loops' `else`.
    "{% for m in messages if m.role == 'user' %}{{ m.content }};{% endfor %}",
    "{% for m in messages if m.role == 'nobody' %}x{% else %}empty{% endfor %}|{% for m in messages %}{{ m.role }}{% else %}none{% endfor %}|{% for x in [] %}{% else %}E{% endfor %}|{% for x in nothing %}{% else %}U{% endfor %}",
    // Scoping: `set` in a loop does not leak; loop targets do not leak;
    // `set` in a top-level `if` does.
    "{% set r = 'outer' %}{% for m in messages %}{% set r = m.role %}{{ r }},{% endfor %}{{ r }}",
    "{% set m = 'm0' %}{% for m in messages %}{% endfor %}{{ m }}|{% for x in messages %}{% set inner = 1 %}{% endfor %}{{ 'D' if inner is defined else 'U' }}",
    "{% if messages %}{% set first = messages[0].role %}{% endif %}{{ first }}|{% if not messages %}{% set other = 1 %}{% endif %}{{ 'D' if other is defined else 'U' }}",
    "{% set messages = messages[1:] %}{{ messages | length }}{% for m in messages %}{{ m.role }}{% endfor %}",
    // namespace() mutated inside loops.
    "{% set ns = namespace(roles='', last=-1, flag='no') %}{% for m in messages %}{% set ns.roles = ns.roles ~ m.role[0] %}\
     {% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% set ns.flag = 'yes' %}\
     {{ ns.roles }}|{{ ns.last }}|{{ ns.flag }}|{{ ns.missing }}|{{ 'D' if ns.missing is defined else 'U' }}",
    "{% set ns = namespace(a='x') %}{% set alias = ns %}{% set alias.a = 'y' %}{{ ns.a }}{% for m in messages %}{% set ns.a = ns.a ~ loop.index %}{% endfor %}{{ ns.a }}",
    // Macros: fewer arguments than parameters; called in `{{ }}`, inside
    // `~`, through `| trim` and `| length`; nested calls; reading context.
    "{% macro show(a, b) %}[{{ a }}|{{ b }}]{% endmacro %}{{ show('x') }}{{ 'pre' ~ show(1, 'y') ~ 'post' }}{{ show() }}{{ show(show('in')) }}",
    "{% macro pad(a) %}  {{ a }}  {% endmacro %}<{{ pad('q') | trim }}>{{ pad('q') | length }}<{{ pad(messages[0].role) }}>",
    "{% macro text_of(c) %}{% if c is string %}{{ c }}{% elif c is sequence %}{% for p in c %}{{ p.text }}{% endfor %}{% endif %}{% endmacro %}\
     {% for m in messages %}{{ text_of(m.content) | trim }}|{{ (text_of(m.content) ~ '.') if m.content else '-' }};{% endfor %}",
    "{% macro who() %}{{ messages[0].role }}{{ bos }}{% endmacro %}{{ who() }}{{ who() ~ who() }}",
    // Filters.
    "{{ '  x  ' | trim }}|{{ messages | length }}|{{ 'héllo' | length }}|{{ messages[0] | length }}|{{ messages | count }}|{{ 'x' | safe }}",
    "{{ messages[0] | tojson }}|{{ messages[-1] | tojson(indent=2) }}|{{ messages[0] | tojson(sort_keys=true) }}|\
     {{ [1, 'a', none, true, -3] | tojson }}|{{ 'é\"\\n' | tojson }}|{{ tools | tojson if tools is defined else '-' }}|{{ messages | tojson(indent=2, sort_keys=true) }}",
    "{{ nothing | default('x') }}|{{ messages[0].role | default('x') }}|{{ messages[0].nope | d('y') }}|{{ '' | default('z') }}",
    // Tests.
    "{% for v in [messages[0].role, messages, messages[0], none, 3, -1, true, ''] %}\
     {{ 's' if v is string else '' }}{{ 'q' if v is sequence else '' }}{{ 'm' if v is mapping else '' }}\
     {{ 'd' if v is defined else 'u' }}{{ 'n' if v is none else '' }}{{ '#' if v is number else '' }}{{ 'b' if v is boolean else '' }};{% endfor %}",
    "{{ 'd' if nothing is defined else 'u' }}{{ 'd' if messages[0].nope is defined else 'u' }}{{ 'u' if nothing is undefined else 'd' }}{{ 'n' if messages[0].nope is none else '-' }}",
    // Methods.
    "{{ messages[0].content.strip() }}|{{ ' a '.strip() }}|{{ ' a '.lstrip() }}.|{{ ' a '.rstrip() }}|\
     {{ 'y' if messages[0].content.startswith('Be') else 'n' }}{{ 'y' if messages[0].content.endswith('ed  ') else 'n' }}",
    // `+`: strings join (printed straight or kept in a variable),
    // integers sum, inside a macro, a condition and a loop.
    "{{ '<' + messages[0].role + '>' }}|{{ (messages | length) + 2 }}|{{ (messages | length) + (messages | length) + -10 }}|\
     {% set s = messages[0].role + ':' + messages[-1].role %}{{ s }}|{{ s + '' }}|{{ ('[' + s + ']') | length }}|\
     {% macro wrap(x) %}{{ '(' + x + ')' }}{% endmacro %}{{ wrap(messages[0].role) + '!' }}|\
     {% for m in messages %}{{ m.role + '=' + (loop.index + 1 | string if false else m.role) }};{% endfor %}|\
     {{ 'y' if messages[0].role + 'x' == messages[0].role ~ 'x' else 'n' }}",
    // `is iterable` as jinja2 decides it (strings, lists, maps and
    // undefined are; none, numbers and booleans are not).
    "{% for v in [messages[0].role, messages, messages[0], none, 3, true, nothing, ''] %}\
     {{ 'i' if v is iterable else 'n' }}{% endfor %}|{{ 'i' if messages[1:] is iterable else 'n' }}|{{ 'i' if nothing is iterable else 'n' }}",
    // `-` and `%` on integers.
    "{{ (messages | length) - 1 }}|{{ (messages | length) % 3 }}|{{ -7 % (messages | length) }}|{{ 7 % -(messages | length) }}|\
     {% for m in messages %}{{ loop.index0 - 1 }},{% endfor %}|{{ messages[(messages | length) - 1].role }}",
    // A loop over `seq[::-1]`, with `loop.index0`, `loop.index` and
    // `loop.first`, over a slice, nested in a forward loop. (minijinja
    // 2.24 panics on `[::-1]` of an empty sequence: guarded.)
    "{% if messages | length > 1 %}{% for m in messages[::-1] %}{{ m.role }}{{ loop.index0 }}{{ loop.index }}{{ loop.first }},{% endfor %}|\
     {% for m in messages[1:][::-1] %}{{ m.role }},{% endfor %}|\
     {% for m in messages %}{% for n in messages[::-1] %}{{ loop.index }}{% endfor %}{{ loop.index }};{% endfor %}{% endif %}",
    // String methods with arguments, and a mapping's `get`.
    "{{ messages[0].content.split(' ') }}|{{ messages[0].content.split()[-1] }}|{{ 'a,b,,c'.split(',') | length }}|\
     {{ 'a,b,c'.split(',', 1)[1] }}|{{ 'a,b,c'.split(',', -1) | length }}|{{ ' x  y '.split() | length }}|{{ 'ab'.split('') | length }}|\
     {{ '\n\nx\n'.strip('\n') }}|{{ 'xyaxy'.lstrip('yx') }}|{{ 'xxaxx'.rstrip('x') }}|{{ 'a-b-c'.replace('-', '+') }}|{{ 'aaa'.replace('a', '') }}|\
     {{ messages[0].get('role') }}|{{ messages[0].get('nope') }}|{{ messages[0].get('nope', 'd') }}|{{ messages[0].get('role', 'd') }}|\
     {{ messages[-1].get('content') }}",
    // Tests `true` and `false`: booleans only.
    "{{ 'T' if true is true else 'F' }}{{ 'T' if 1 is true else 'F' }}{{ 'T' if false is false else 'F' }}\
     {{ 'T' if nothing is false else 'F' }}{{ 'T' if none is false else 'F' }}{{ 'T' if 0 is false else 'F' }}",
    // Filters `list` and `string`, and `selectattr(..., 'equalto', ...) | list`.
    "{{ messages | list | length }}|{{ (messages[1:] | list)[0].role }}|{{ messages[0].role | string }}|{{ (messages | length) | string }}|\
     {{ none | string }}|{{ nothing | string }}|{{ [1, none, true] | string }}|{{ messages[0].nope | string }}|\
     {% set users = messages | selectattr('role', 'equalto', 'user') | list %}{{ users | length }}{{ users[-1].content }}|\
     {{ messages | selectattr('role', 'eq', 'nobody') | list | length }}|{{ messages[1:] | selectattr('role', '==', messages[0].role) | list | length }}",
    // `for k, v in map.items()` and `map | items`, with `loop.*`.
    "{% for k, v in messages[0].items() %}{{ k }}={{ v }}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }};{% endfor %}|\
     {% for k, v in messages[-1] | items %}{{ k }}{{ loop.last }}{{ loop.length }},{% endfor %}|\
     {% for k, v in messages[0].items() if k == 'role' %}{{ v }}{% endfor %}|{% set k = 'kept' %}{% for k, v in messages[0].items() %}{% endfor %}{{ k }}",
    // Macros with constant defaults: taken for a missing or undefined
    // argument, not for none or false.
    "{% macro f(a, b=false, c='d', d=none) %}[{{ a }}|{{ b }}|{{ c }}|{{ d }}]{% endmacro %}{{ f(1) }}{{ f(1, 2) }}{{ f(1, nothing, none) }}\
     {{ f(messages[0].role, true, 'x', 0) }}{{ f() }}{{ 'in ~ ' ~ f(2) }}{{ f(1, messages[0].nope) | length }}",
    // A macro calling itself; `join` of strings.
    "{% macro down(n) %}{{ n }}{% if n > 0 %},{{ down(n - 1) }}{% endif %}{% endmacro %}{{ down(messages | length) }}|\
     {{ ['a', messages[0].role, ''] | join(' | ') }}|{{ ['x', 'y'] | join }}|{{ [] | join(',') }}|{{ messages[1:] | selectattr('role', 'equalto', 'user') | list | length }}",
    // A block `set` (its `set`s stay in the enclosing scope, not past a
    // loop iteration), and `strftime_now is defined`.
    "{% set x %}hi {{ messages[0].role }}{% set inner = 'i' %}{% endset %}{{ x }}|{{ x | length }}|{{ inner }}|{{ x + '!' }}|\
     {% for m in messages %}{% set y %}[{{ m.role }}]{% endset %}{{ y }}{% endfor %}{{ 'D' if y is defined else 'U' }}|\
     {{ 'd' if strftime_now is defined else 'u' }}{{ 'u' if strftime_now is undefined else 'd' }}",
    // `default(x, true)`, `upper`, `lower`, the `replace` filter.
    "{{ '' | default('e', true) }}|{{ '' | default('e', false) }}|{{ nothing | d('u', true) }}|{{ 0 | default(5, true) }}|\
     {{ messages[0].role | default('r', true) }}|{{ messages | default([], true) | length }}|\
     {{ messages[0].content | upper }}|{{ 'ÉSSß' | lower }}|{{ 'straße' | upper }}|{{ messages[0].content | replace('e', '3') }}|{{ 'aaa' | replace('a', '') }}",
    // `loop.previtem` / `loop.nextitem`, forward and reversed; `break`
    // and `continue`, nested, in an `if`, and a loop's `else` after them.
    "{% for m in messages %}{{ loop.previtem.role if loop.previtem is defined else '-' }}>{{ m.role }}>{{ loop.nextitem.role if loop.nextitem is defined else '-' }};{% endfor %}|\
     {% if messages | length > 1 %}{% for m in messages[::-1] %}{{ loop.previtem.role if not loop.first }}/{{ loop.nextitem.role if loop.nextitem is defined }};{% endfor %}{% endif %}|\
     {% for m in messages[1:] %}{{ 'P' if loop.previtem is undefined }}{{ m.role }}{% endfor %}",
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.role }},{% endfor %}|\
     {% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.role }},{% endfor %}|\
     {% for m in messages %}{% for n in messages %}{% if n.role == m.role %}{% break %}{% endif %}{{ n.role[0] }}{% endfor %};{% endfor %}|\
     {% for m in messages %}{% break %}{% else %}E{% endfor %}|{% for m in [] %}{% break %}{% else %}E{% endfor %}|\
     {% for m in messages %}{% set x = loop.index %}{% continue %}{{ 'never' }}{% endfor %}{{ x }}|\
     {% for k, v in messages[0].items() %}{% if k == 'content' %}{% break %}{% endif %}{{ k }}{% endfor %}",
    // `for i in range(...)` with one, two and three arguments, negative
    // steps, empty ranges, `loop.*` and `break`; `int` of an integer.
    "{% for i in range(messages | length) %}{{ i }}{{ messages[i].role[0] }}{{ loop.last }},{% endfor %}|{% for i in range(2, 5) %}{{ i }}{% endfor %}|\
     {% for i in range((messages | length) - 1, -1, -1) %}{{ i }}{% endfor %}|{% for i in range(0, 10, 3) %}{{ i }}{{ loop.length }}{% endfor %}|\
     {% for i in range(5, 5) %}x{% else %}E{% endfor %}|{% for i in range(-3) %}x{% endfor %}|{% for i in range(10, 0, -4) %}{{ i }};{% endfor %}|\
     {% for i in range(100) %}{% if i > 2 %}{% break %}{% endif %}{{ i }}{% endfor %}|{{ (messages | length) | int }}|{{ 7 | int + 1 }}",
    // Slices of strings (by characters), `trim` of any value (Python's
    // `str()`, stripped), `in` an undefined value.
    "{{ messages[0].content[:4] }}|{{ messages[0].content[3:] }}|{{ messages[0].content[-3:] }}|{{ messages[0].content[:-2] }}|\
     {{ 'héllo🙂'[1:4] }}|{{ 'abc'[5:] }}|{{ 'abc'[2:1] }}|{{ 'abc'[-99:2] }}|{{ 'abc'[:-99] }}|{{ 'abc'[none:2] }}|{{ ('abc'[1:]) | length }}|\
     {{ none | trim }}|{{ 3 | trim }}|{{ [1, ' a '] | trim }}|{{ nothing | trim }}|{{ true | trim }}|{{ messages[-1].content | trim }}|\
     {{ 'x' in nothing }}|{{ 'x' not in messages[0].nope }}",
    // `for k, v in map | dictsort`: sorted by key, case-insensitively.
    "{% for k, v in messages[0] | dictsort %}{{ k }}={{ v }}{{ loop.index }}{{ loop.last }};{% endfor %}|\
     {% for m in messages %}{% for k, v in m | dictsort %}{{ k }},{% endfor %}{% for c in m.tool_calls or [] %}\
     {% for k, v in c.function.arguments | dictsort %}{{ k }}:{{ v }};{% endfor %}{% endfor %}{% endfor %}",
    // A loop over a mapping: its keys, with `loop.*` and a filter.
    "{% for k in messages[0] %}{{ k }}{{ loop.index }}{{ loop.last }}{{ loop.length }},{% endfor %}|\
     {% for k in messages[-1] if k != 'role' %}{{ k }};{% endfor %}|{% for k in messages[0] %}{% break %}{% else %}E{% endfor %}",
    // A loop over `selectattr(name, 'equalto', v)`: the items that pass.
    "{% for m in messages | selectattr('role', 'equalto', 'user') %}{{ m.content }}{{ loop.index }}{{ loop.first }};{% endfor %}|\
     {% for m in messages | selectattr('role', 'eq', 'nobody') %}x{% else %}E{% endfor %}|\
     {% for m in messages %}{% for n in messages | selectattr('role', '==', m.role) %}{{ loop.index0 }}{% endfor %}{% endfor %}",
    // strftime_now with the fixed clock.
    "{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %b %Y') }}|{{ 'Today: ' ~ strftime_now('%A') }}",
    // Conditional expressions, whitespace control, a trailing newline.
    "{{ 'a' if false }}|{{ 'b' if messages else 'c' }}|{{- '  d  ' -}}  |\n{% if true %}\n  x\n{% endif %}\n{{ 'y' }}\n",
    "{%- for m in messages -%}\n  {{- m.role -}}\n{% endfor %}\n  end\n",
];

/// Every probe renders directly on the probe requests, equal to
/// minijinja, and agrees with minijinja on the edge requests.
#[test]
fn probe_templates_render_directly_and_equal_minijinja() {
    check_probes(DIRECT_PROBES, Expect::Direct);
}

/// Probes the direct renderer must decline (`range` outside a loop, a
/// filtered block `set`, `*`, `loop` in a filtered loop, a
/// macro default that is not a constant, a method it does not know, a
/// variable shadowing a function), still rendering what minijinja renders
/// through `render`.
const DECLINED_PROBES: &[&str] = &[
    "{{ range(3) | length }}",
    "{% set x | upper %}hi {{ messages[0].role }}{% endset %}{{ x }}",
    "{{ (messages | length) * 2 }}",
    "{% for m in messages if m.role == 'user' %}{{ loop.index }}{% endfor %}",
    "{% macro f(a=messages | length) %}{{ a }}{% endmacro %}{{ f() }}",
    "{{ messages[0].role.upper() }}",
    "{% macro f() %}{% set strftime_now = 'x' %}{{ strftime_now('%Y') }}{% endmacro %}{{ f() }}",
    "{% for namespace in messages %}{% set ns = namespace(a=1) %}{{ ns.a }}{% endfor %}",
];

/// Every declined probe declines on the probe requests and `render`
/// still equals minijinja.
#[test]
fn probe_templates_outside_the_subset_decline_and_render_through_minijinja() {
    check_probes(DECLINED_PROBES, Expect::Declines);
}

/// Values printed through their `Display` (floats, lists, mappings,
/// slices): the direct renderer may print them itself or decline, and
/// either way the result is minijinja's.
const PRINTED_VALUE_PROBES: &[&str] = &[
    "{{ 1.5 }}|{{ -0.0 }}|{{ 1e100 }}|{{ 2.0 }}",
    "{{ 'x' ~ 0.25 }}|{{ 0.1 ~ '' }}",
    "{{ messages }}",
    "{{ messages[0] }}|{{ messages[-1] ~ '' }}",
    "{{ messages[1:] }}|{{ messages[5:] }}|{{ [messages[0].role, 1, none, true, nothing] }}",
    "{{ tools }}|{{ messages[-1].tool_calls }}",
];

/// `+` on operands other than two strings or two integers (a float, a
/// list, none, undefined, a boolean, a safe string, a null content, an
/// overflowing sum): minijinja answers or raises, and the direct
/// renderer equals it or declines.
const ADD_PROBES: &[&str] = &[
    "{{ messages[0].role + 1 }}",
    "{{ 1 + messages[0].role }}",
    "{{ (messages | length) + 1.5 }}|{{ 0.5 + (messages | length) }}",
    "{{ messages + messages }}|{{ (messages + messages) | length }}",
    "{{ messages[1:] + [1] }}",
    "{{ nothing + 'x' }}|{{ 'x' + nothing }}",
    "{{ none + 'x' }}",
    "{{ true + (messages | length) }}",
    "{{ messages[-1].content + '!' }}",
    "{% set big = 9223372036854775807 %}{{ big + (messages | length) }}",
    "{{ -9223372036854775807 - 1 + (messages | length) * 0 }}",
    "{{ ('<b>' | safe) + messages[0].role }}|{{ messages[0].role + ('<b>' | safe) }}",
    "{% set x = messages[0].role | safe %}{{ x + '<i>' }}",
    "{{ messages[0] + messages[0] }}",
    "{% set ns = namespace(a='x') %}{{ ns + 'y' }}|{{ ns.a + 'y' }}",
    "{% macro m() %}<{{ messages | length }}>{% endmacro %}{{ m() + m() }}|{{ m() + 1 }}",
    "{{ 'a' + 'b' + messages[0].role + 3 }}",
];

/// Other operands for `-`, `%`, the methods, filters and reversed loops
/// the direct renderer runs: minijinja answers or raises, and the direct
/// renderer equals it or declines.
const OTHER_OPERAND_PROBES: &[&str] = &[
    "{{ messages[0].role - 1 }}",
    "{{ (messages | length) % 0 }}",
    "{{ 1.5 - (messages | length) }}|{{ (messages | length) % 1.5 }}",
    "{% set m = -9223372036854775807 - 1 + (messages | length) * 0 %}{{ m - (messages | length) }}|{{ m % -1 }}",
    "{{ nothing - 1 }}",
    "{{ messages[0].content.split(none, 1) }}",
    "{{ messages[0].content.split(1) }}",
    "{{ messages[-1].content.split(',') }}",
    "{{ (messages[0].content | safe).split(' ') }}",
    "{{ messages[0].content.split(' ', 9223372036854775807) }}|{{ messages[0].content.split(' ', 1.0) }}",
    "{{ messages.get('x') }}",
    "{{ messages[0].content.get('x') }}",
    "{{ messages[0].get(1) }}",
    "{% set ns = namespace(a=1) %}{{ ns.get('a') }}",
    "{{ messages[0].content.strip(none) }}",
    "{{ messages[0].content.strip(1) }}",
    "{{ messages[0].content.replace('e', 1) }}",
    "{{ messages[-1].content.replace('e', 'f') }}",
    "{{ messages[0] | list }}|{{ 'abc' | list }}",
    "{{ nothing | list }}",
    "{{ none | list }}",
    "{{ messages | selectattr('role', 'equalto', 'user') }}",
    "{{ [1, 'a'] | selectattr('role', 'equalto', 1) | list }}",
    "{{ messages | selectattr('content.x', 'equalto', 1) | list }}",
    "{{ messages | selectattr('role') | list }}",
    "{% if messages %}{% for m in messages[::-1] %}{{ loop.last }}{{ loop.length }}{% endfor %}{% endif %}",
    "{% for m in nothing[::-1] %}x{% else %}E{% endfor %}",
    "{% for c in messages[0].content[::-1] %}{{ c }}{% endfor %}",
    "{% if messages %}{% for m in messages[::-2] %}{{ m.role }}{% endfor %}{% endif %}",
    "{% if messages %}{{ messages[::-1] }}{% endif %}",
    "{{ 'T' if (messages | length) is true else 'F' }}",
    "{{ [1, 'a', none, true] | join(',') }}|{{ 'abc' | join('-') }}|{{ messages | join(',') }}",
    "{{ ['a', 'b'] | join(1) }}|{{ nothing | join(',') }}|{{ ['a', 'b'] | join(none) }}|{{ ['a', 'b'] | join(',' | safe) }}",
    "{% set x %}{{ messages[0].content }}{% endset %}{{ x.startswith('B') }}|{{ x | safe }}",
    "{% set strftime_now %}x{% endset %}{{ strftime_now }}",
    "{{ 3 | upper }}|{{ nothing | upper }}|{{ ('<a>' | safe) | upper }}|{{ none | lower }}",
    "{{ 3 | replace('3', '4') }}|{{ messages[0].content | replace(1, 2) }}|{{ nothing | replace('a', 'b') }}|{{ ('x' | safe) | replace('x', '<') }}",
    "{{ messages[1:] | default('d', true) }}|{{ none | default('n', true) }}|{{ nothing | default('u', none) }}",
    "{% for m in messages | list %}{{ loop.previtem }}{% endfor %}|{% for k, v in messages[0].items() %}{{ loop.nextitem }}{% endfor %}",
    "{% for m in messages %}{% set x %}a{% break %}b{% endset %}{{ x }}{% endfor %}",
    "{% for i in range(0) %}x{% endfor %}{% for i in range(1, 2, 0) %}x{% endfor %}",
    "{% for i in range(200000) %}{% endfor %}",
    "{% for i in range('3') %}{{ i }}{% endfor %}|{% for i in range(nothing) %}{{ i }}{% endfor %}",
    "{% for i in range(9223372036854775806, 9223372036854775807) %}{{ i }}{% endfor %}",
    "{% for i in range(3) %}{{ loop.previtem }}{% endfor %}",
    "{{ '3' | int }}|{{ 2.5 | int }}|{{ none | int }}|{{ true | int }}|{{ nothing | int }}",
    "{{ 'abc'[1.0:] }}|{{ 'abc'['a':] }}|{{ 'abc'[::2] }}",
    "{{ (messages[0].content | safe)[1:] }}|{{ messages[0] | trim }}|{{ 1.5 | trim }}",
    "{{ 'x' in none }}|{{ 1 in 'abc' }}",
    "{% for k in messages[0] %}{{ loop.previtem }}{% endfor %}|{% set ns = namespace(a=1) %}{% for k in ns %}{{ k }}{% endfor %}",
    "{% for m in messages | selectattr('role', 'equalto', 'user') %}{{ loop.last }}{{ loop.length }}{% endfor %}",
    "{% for m in messages | selectattr('nope', 'equalto', nothing) %}{{ m.role }}{% endfor %}|{{ messages | selectattr('nope', 'equalto', nothing) | list | length }}",
    "{% for m in messages | selectattr('role', 'equalto', 'user') %}{{ loop.previtem }}{% endfor %}",
    "{% for k, v in messages | dictsort %}{{ k }}{% endfor %}",
    "{% for k, v in nothing | dictsort %}{{ k }}{% else %}E{% endfor %}",
    "{% for k, v in messages[0] | dictsort(reverse=true) %}{{ k }}{% endfor %}|{% for k in messages[0] | dictsort %}{{ k }}{% endfor %}",
    "{% macro loop_forever(n) %}{{ loop_forever(n + 1) }}{% endmacro %}{{ loop_forever(0) }}",
    "{% for t in tools %}{% for k, v in t.function.parameters.properties.items() %}{{ k }}:{{ v.type }}{{ loop.last }};{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for k, v in m.items() %}{% for k2, v2 in m | items %}{{ k2 }}{% endfor %}{{ v }}{% endfor %}{% endfor %}",
    "{% for k, v in nothing.items() %}x{% else %}E{% endfor %}",
    "{% for k, v in nothing | items %}x{% else %}E{% endfor %}",
    "{% for k, v in messages.items() %}x{% endfor %}",
    "{% for k, v in messages | items %}{{ k }}{% endfor %}",
    "{% for a, b in messages %}{{ a }}{% endfor %}",
    "{% set ns = namespace(a=1) %}{% for k, v in ns.items() %}{{ k }}{% endfor %}",
    "{% for k, k in messages[0].items() %}{{ k }}{% endfor %}",
    "{% for k, v in messages[0].items() if v %}{{ k }}{{ loop.index }}{% endfor %}",
    "{% for k, v in messages[0].items() %}{{ k }}{% else %}E{% endfor %}{% for k, v in (messages | selectattr('role', 'equalto', 'x') | list) | items %}{{ k }}{% endfor %}",
];

/// Every such probe agrees with minijinja, directly or not.
#[test]
fn other_operands_agree_with_minijinja() {
    check_probes(OTHER_OPERAND_PROBES, Expect::Agrees);
}

/// Every `+` probe agrees with minijinja, directly or not.
#[test]
fn additions_of_other_operands_agree_with_minijinja() {
    check_probes(ADD_PROBES, Expect::Agrees);
}

/// Every printed-value probe agrees with minijinja, directly or not.
#[test]
fn printed_values_agree_with_minijinja() {
    check_probes(PRINTED_VALUE_PROBES, Expect::Agrees);
}

/// `raise_exception` reached: the direct renderer declines and `render`
/// returns minijinja's error; on a branch not taken, the rest of the
/// template still renders directly.
#[test]
fn raise_exception_declines_and_render_returns_minijinjas_error() {
    let pair = Pair::plain(
        "{% if messages[0].role == 'system' %}{{ raise_exception('no system: ' ~ messages[0].content) }}{% endif %}{{ messages[0].role }}",
    );
    let requests = probe_requests();
    let (reference, direct) = pair.compare(&requests[0]).expect("agreement");
    assert_eq!(direct, None);
    assert_eq!(
        reference,
        Err(Error::TemplateRaised("no system: Be brief.".into()).to_string())
    );
    assert!(matches!(
        pair.direct.render(&requests[0]),
        Err(Error::TemplateRaised(m)) if m == "no system: Be brief."
    ));
    let (reference, direct) = pair.compare(&requests[1]).expect("agreement");
    assert_eq!(direct.as_deref(), Some("user"));
    assert_eq!(reference.as_deref(), Ok("user"));
    // Mistral's alternation check, on the shipped template.
    let mistral = &shipped_pairs()
        .iter()
        .find(|(f, _)| *f == TemplateFamily::Mistral)
        .expect("mistral")
        .1;
    let twice =
        request(json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]));
    let (reference, direct) = mistral.compare(&twice).expect("agreement");
    assert_eq!(direct, None);
    assert!(matches!(
        mistral.direct.render(&twice),
        Err(Error::TemplateRaised(m)) if m.contains("alternate")
    ));
    assert!(reference.is_err());
}

/// Inheritance and includes are never compiled for the direct path, nor
/// macros it cannot resolve statically (defined in a block, a parameter
/// shadowing a function other than `namespace`): the template reports
/// why, and `render` is minijinja's (an error for the first four, as
/// there is no other template to extend or include).
#[test]
fn extends_and_include_are_unsupported_and_render_as_minijinja() {
    for source in [
        "{% extends 'base' %}{% block body %}x{% endblock %}",
        "{% include 'part' %}{{ messages[0].role }}",
        "{% block body %}x{% endblock %}",
        "{% import 'macros' as m %}{{ m.f() }}",
        "{% if messages %}{% macro f() %}x{% endmacro %}{% endif %}{{ f() }}",
        "{% macro f(range) %}{{ range }}{% endmacro %}{{ f('n') }}",
    ] {
        let pair = Pair::plain(source);
        assert!(
            matches!(
                pair.direct.direct_rendering(),
                DirectRendering::Unsupported(_)
            ),
            "{source:?}: {:?}",
            pair.direct.direct_rendering()
        );
        for req in probe_requests() {
            let (_, direct) = pair
                .compare(&req)
                .unwrap_or_else(|e| panic!("{source:?}: {e}"));
            assert_eq!(direct, None, "{source:?}");
        }
    }
}

/// A context value named like a function the template calls (here from
/// `chat_template_kwargs`) shadows it in minijinja; the direct renderer
/// declines rather than call its own, and `render` agrees with minijinja.
#[test]
fn kwargs_shadowing_called_functions_decline() {
    let pair = Pair::plain(
        "{% set ns = namespace(a='x') %}{{ ns.a }}|{{ strftime_now('%Y') }}|{{ reasoning_effort | default('medium') }}",
    );
    let plain = body_request(json!({"messages": []}));
    let (reference, direct) = pair.compare(&plain).expect("agreement");
    assert_eq!(reference.as_deref(), Ok("x|2024|medium"));
    assert_eq!(direct.as_deref(), Some("x|2024|medium"));
    let effort =
        body_request(json!({"messages": [], "chat_template_kwargs": {"reasoning_effort": "high"}}));
    let (reference, direct) = pair.compare(&effort).expect("agreement");
    assert_eq!(reference.as_deref(), Ok("x|2024|high"));
    assert_eq!(direct.as_deref(), Some("x|2024|high"));
    for shadow in [
        json!({"namespace": "not a function"}),
        json!({"strftime_now": 1}),
    ] {
        let req = body_request(json!({"messages": [], "chat_template_kwargs": shadow}));
        let (_, direct) = pair
            .compare(&req)
            .unwrap_or_else(|e| panic!("{shadow}: {e}"));
        assert_eq!(direct, None, "{shadow}");
    }
}

/// `namespace()` with no fields is an empty object, and empty objects are
/// false in minijinja.
#[test]
fn an_empty_namespace_is_falsy() {
    check_probes(
        &["{% set ns = namespace() %}{{ 'T' if ns else 'F' }}{% if not ns %}N{% endif %}"],
        Expect::Direct,
    );
}

/// Request JSON reaches printing: a `null` or boolean in
/// `chat_template_kwargs` printed with `~` (`'Reasoning: ' ~
/// reasoning_effort` in the harmony template) is `None` / `True`, as
/// minijinja prints it, and the direct renderer answers.
#[test]
fn shipped_template_prints_null_and_boolean_kwargs_as_minijinja() {
    let harmony = &shipped_pairs()
        .iter()
        .find(|(f, _)| *f == TemplateFamily::Harmony)
        .expect("harmony")
        .1;
    for (effort, printed) in [(json!(null), "None"), (json!(true), "True")] {
        let req = body_request(json!({"messages": [{"role": "user", "content": "Hi"}],
            "chat_template_kwargs": {"reasoning_effort": effort}}));
        let (reference, direct) = harmony.compare(&req).unwrap_or_else(|e| panic!("{e}"));
        let reference = reference.expect("renders");
        assert!(
            reference.contains(&format!("Reasoning: {printed}\n")),
            "{reference}"
        );
        assert_eq!(direct.as_deref(), Some(reference.as_str()));
    }
}

/// A loop's `else` block runs after the loop, in the enclosing scope: a
/// `set` there is visible after the loop in minijinja (as in Jinja2), and
/// in the direct renderer.
#[test]
fn set_in_a_loop_else_block_is_visible_after_the_loop() {
    check_probes(
        &[
            "{% for m in [] %}{% else %}{% set z = 'Z' %}{% endfor %}[{{ z }}]",
            "{% for m in messages if m.role == 'nobody' %}{% else %}{% set z = 'Z' %}{% endfor %}[{{ z }}]",
        ],
        Expect::Direct,
    );
}

/// minijinja's slice of a sequence is a lazy iterable object (kind
/// `iterable`, not `seq`), so `is sequence` is false for it, in the direct
/// renderer too.
#[test]
fn a_slice_is_not_a_sequence() {
    check_probes(
        &[
            "{{ 'T' if messages[1:] is sequence else 'F' }}",
            "{% set rest = messages[1:] %}{% for m in rest %}{{ 'S' if rest is sequence else 'I' }}{% endfor %}",
        ],
        Expect::Direct,
    );
}

/// minijinja folds an operation on constants when compiling, and its
/// folded `and` is `false` when either side is false, where the run-time
/// `and` returns the false operand: `{{ '' and 'y' }}` prints `False`,
/// while `{% set e = '' %}{{ e and 'y' }}` prints nothing. The direct
/// renderer folds constants with minijinja's own folding.
#[test]
fn constant_and_prints_as_minijinja_folds_it() {
    check_probes(
        &[
            "{{ '' and 'y' }}",
            "{{ 3 and 0 }}",
            "{{ 'x' ~ ('' and 'y') }}",
            "{{ ('' and 'y') | default('d') }}",
        ],
        Expect::Direct,
    );
}

// ---- 4. limits ----

/// The smallest fuel with which minijinja renders `request` (a binary
/// search: fuel only ever ends a rendering early).
fn minimal_fuel(source: &str, special: &SpecialTokens, req: &ChatRequest) -> u64 {
    let renders = |fuel: u64| {
        let limits = RenderLimits {
            fuel,
            ..RenderLimits::default()
        };
        ChatTemplate::new(source, special.clone(), limits, Arc::new(FixedClock(NOW)))
            .expect("compile")
            .with_direct_rendering(false)
            .render(req)
            .is_ok()
    };
    let (mut low, mut high) = (0u64, RenderLimits::default().fuel);
    assert!(renders(high));
    while high - low > 1 {
        let mid = low + (high - low) / 2;
        if renders(mid) {
            high = mid;
        } else {
            low = mid;
        }
    }
    high
}

/// Around minijinja's exact fuel need, `render` with the direct renderer
/// on returns what minijinja returns: `FuelExhausted` below it, the text
/// at and above it. The direct renderer never succeeds where minijinja
/// runs out.
#[test]
fn fuel_exhaustion_matches_minijinja_at_the_threshold() {
    let req = request(representative_conversation())
        .with_tools(&json!([weather_tool()]))
        .expect("tools");
    for family in TemplateFamily::ALL {
        let special = family_tokens(family);
        let need = minimal_fuel(family.template(), &special, &req);
        let mut fuels: Vec<u64> = vec![0, 1, 10, 50, need / 4, need / 2, need * 2];
        fuels.extend(need.saturating_sub(3)..=need + 3);
        for fuel in fuels {
            let limits = RenderLimits {
                fuel,
                ..RenderLimits::default()
            };
            let pair = Pair::new(family.template(), special.clone(), limits);
            let (reference, _) = pair
                .compare(&req)
                .unwrap_or_else(|e| panic!("{family:?} fuel {fuel} (need {need}): {e}"));
            if fuel < need {
                assert_eq!(
                    reference,
                    Err(Error::FuelExhausted.to_string()),
                    "{family:?} fuel {fuel}"
                );
                assert!(matches!(
                    pair.direct.render(&req),
                    Err(Error::FuelExhausted)
                ));
            } else {
                assert!(reference.is_ok(), "{family:?} fuel {fuel}: {reference:?}");
            }
        }
        // With fuel to spare the direct renderer answers.
        let roomy = Pair::new(
            family.template(),
            special.clone(),
            RenderLimits {
                fuel: need * 4 + 1000,
                ..RenderLimits::default()
            },
        );
        assert!(roomy.direct.render_direct(&req).is_some(), "{family:?}");
    }
}

/// One unit of fuel short of minijinja's need for `source` on `req`,
/// `render` must fail as minijinja does; `Err` describes a disagreement.
fn fuel_threshold_agrees(source: &str, req: &ChatRequest) -> Result<(), String> {
    let need = minimal_fuel(source, &SpecialTokens::default(), req);
    let short = Pair::new(
        source,
        SpecialTokens::default(),
        RenderLimits {
            fuel: need - 1,
            ..RenderLimits::default()
        },
    );
    let reference = short.compare_render(req).map_err(|e| {
        format!(
            "{source:?}, fuel {} (minijinja needs {need}): {e}",
            need - 1
        )
    })?;
    if reference != Err(Error::FuelExhausted.to_string()) {
        return Err(format!(
            "{source:?}: minijinja at fuel {}: {reference:?}",
            need - 1
        ));
    }
    Ok(())
}

/// The same at the threshold for every probe template: one unit of fuel
/// short of minijinja's need, `render` fails as minijinja does, so no
/// construct lets the direct renderer do more work per unit of fuel than
/// its budget assumes.
#[test]
fn fuel_threshold_matches_minijinja_for_every_probe() {
    let failures: Vec<String> = DIRECT_PROBES
        .iter()
        .flat_map(|source| {
            probe_requests()
                .iter()
                .filter_map(|req| fuel_threshold_agrees(source, req).err())
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// minijinja spends one instruction per macro parameter (binding it) and
/// runs a filtered loop twice (a pass that evaluates the filter and
/// collects the kept items, then the loop proper): the direct renderer
/// charges a step for each, so with a cheap filter or a many-parameter
/// macro it still declines below minijinja's fuel need rather than
/// succeeding where minijinja runs out.
#[test]
fn fuel_threshold_for_macro_parameters_and_filtered_loops() {
    let req = &probe_requests()[0];
    let failures: Vec<String> = [
        "{% macro f(a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20) %}{% endmacro %}\
         {% for m in messages %}{{ f() }}{{ f() }}{{ f() }}{% endfor %}",
        "{% for m in messages if m %}{% endfor %}",
        "{% for m in messages if m.role %}{% endfor %}",
        "{% macro g(a1=1, a2=2, a3=3, a4=4, a5=5, a6=6, a7=7, a8=8, a9=9, a10=10, a11=11, a12=12) %}{% endmacro %}\
         {% for m in messages %}{{ g() }}{{ g() }}{{ g() }}{% endfor %}",
        "{% for m in messages %}{% for k, v in m.items() %}{% endfor %}{% for n in messages[::-1] %}{% endfor %}{% endfor %}",
        "{% for i in range(500) %}{% endfor %}{% for i in range(300) %}{% continue %}{% endfor %}",
    ]
    .iter()
    .filter_map(|source| fuel_threshold_agrees(source, req).err())
    .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Around the rendering's exact length, `render` with the direct renderer
/// on returns what minijinja returns: `OutputTooLarge` one byte short, the
/// text at the exact size; the direct renderer answers at the exact size
/// and declines one byte short.
#[test]
fn output_cap_matches_minijinja_at_the_threshold() {
    let req = request(representative_conversation());
    for family in TemplateFamily::ALL {
        let special = family_tokens(family);
        let full = Pair::new(family.template(), special.clone(), RenderLimits::default())
            .reference
            .render(&req)
            .expect("renders");
        let len = full.len();
        let mut caps = vec![0, 1, 16, len / 2];
        caps.extend(len - 3..=len + 1);
        for max in caps {
            let limits = RenderLimits {
                max_output_bytes: max,
                ..RenderLimits::default()
            };
            let pair = Pair::new(family.template(), special.clone(), limits);
            let (reference, direct) = pair
                .compare(&req)
                .unwrap_or_else(|e| panic!("{family:?} cap {max} (len {len}): {e}"));
            if max < len {
                assert_eq!(
                    reference,
                    Err(Error::OutputTooLarge { max }.to_string()),
                    "{family:?} cap {max}"
                );
                assert!(matches!(
                    pair.direct.render(&req),
                    Err(Error::OutputTooLarge { max: m }) if m == max
                ));
                assert_eq!(direct, None, "{family:?} cap {max}");
            } else {
                assert_eq!(
                    reference.as_deref(),
                    Ok(full.as_str()),
                    "{family:?} cap {max}"
                );
                assert_eq!(
                    direct.as_deref(),
                    Some(full.as_str()),
                    "{family:?} cap {max}"
                );
            }
        }
    }
}

/// A `+` beside a `| safe` string is rewritten at load into a filter the
/// direct renderer does not know (module `markup`): it declines, and
/// minijinja escapes as jinja2 does. The rest of the template (its `~`
/// and plain `+`) still renders alike both ways.
#[test]
fn markup_concatenation_is_left_to_minijinja() {
    let request = request(json!([{"role": "user", "content": "a & \"b\""}]));
    let escaping = Pair::plain("{{ '<b>' | safe + messages[0].content }}");
    let (reference, direct) = escaping.compare(&request).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(direct, None, "the direct renderer declines the rewritten +");
    assert_eq!(reference, Ok("<b>a &amp; &#34;b&#34;".to_owned()));
    let joining = Pair::plain("{{ '<b>' | safe ~ messages[0].content }}");
    let (reference, direct) = joining.compare(&request).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reference, Ok("<b>a & \"b\"".to_owned()));
    assert_eq!(
        direct.as_deref(),
        Some("<b>a & \"b\""),
        "`~` renders directly"
    );
}

/// `dictsort` orders keys as minijinja does (ASCII case folded, ties in
/// the map's order), on keys where the folding decides: the direct
/// renderer answers and equals minijinja.
#[test]
fn dictsort_loops_order_keys_as_minijinja_does() {
    let pair = Pair::plain(
        "{% for t in tools %}{% for k, v in t.function.parameters.properties | dictsort %}{{ k }}={{ v.type }};{% endfor %}{% endfor %}",
    );
    let properties = json!({
        "b": {"type": "string"}, "A": {"type": "integer"}, "a": {"type": "number"},
        "_u": {"type": "string"}, "Z": {"type": "boolean"}, "é": {"type": "string"},
        "E": {"type": "string"}, "10": {"type": "string"}, "9": {"type": "string"}
    });
    let req = request(json!([{"role": "user", "content": "x"}]))
        .with_tools(&json!([{"type": "function", "function": {
            "name": "f", "description": "d",
            "parameters": {"type": "object", "properties": properties}}}]))
        .expect("tools");
    let (reference, direct) = pair.compare(&req).expect("agreement");
    assert_eq!(
        reference.as_deref(),
        Ok("10=string;9=string;_u=string;A=integer;a=number;b=string;E=string;Z=boolean;é=string;")
    );
    assert_eq!(direct, reference.ok());
}

/// Macros reading names the top level assigns (minijinja's closures):
/// the top level's current value, else the context's; never a loop's or
/// another macro's binding.
const CLOSURE_PROBES: &[&str] = &[
    "{% set x = 'a' %}{% macro f() %}{{ x }}{% endmacro %}{{ f() }}{% set x = 'b' %}{{ f() }}",
    "{% macro f() %}[{{ x }}]{% endmacro %}{{ f() }}{% set x = 1 %}{{ f() }}",
    "{% set x = 'top' %}{% macro f() %}{{ x }}{% endmacro %}{% for m in messages %}{% set x = m.role %}{{ f() }}{{ x }}{% endfor %}{{ f() }}",
    "{% macro f() %}{{ messages | length }}{% endmacro %}{{ f() }}{% set messages = [] %}{{ f() }}",
    "{% set ns = namespace(n=0) %}{% macro inc() %}{% set ns.n = ns.n + 1 %}{% endmacro %}{{ inc() }}{{ inc() }}{{ ns.n }}",
    "{% macro f(list) %}{% for m in list if m.role %}{{ m.role }}{% endfor %}{% endmacro %}{% for m in messages %}{{ f(messages) }}{% endfor %}",
    "{% set x = 1 %}{% macro g() %}{{ x }}{% endmacro %}{% macro f(x) %}{{ x }}{{ g() }}{% endmacro %}{{ f(2) }}",
    "{% set x = 1 %}{% macro f() %}{{ x }}{% endmacro %}{% set y %}{% set x = 'in' %}{{ f() }}{% endset %}{{ y }}{{ f() }}",
    "{% set x = 1 %}{% macro f() %}{{ x }}{% endmacro %}{% if messages %}{% set x = 2 %}{% endif %}{{ f() }}",
    "{% macro f() %}{{ x }}{% endmacro %}{% for m in messages %}{% if loop.first %}{% set x = 5 %}{% endif %}{% endfor %}{{ f() }}",
    "{% set x = 'a' %}{% macro f(n) %}{{ x }}{% if n %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(2) }}",
];

/// Closures whose value depends on when the top level stored the name:
/// left to minijinja.
const CLOSURE_DECLINED_PROBES: &[&str] = &[
    "{% set x = 1 %}{% macro f() %}{% if messages %}{% set x = 2 %}{% endif %}{{ x }}{% endmacro %}{{ f() }}",
    "{% set m = 1 %}{% macro f() %}{% for m in messages %}{% endfor %}{{ m }}{% endmacro %}{{ f() }}",
];

/// A macro reads the top level's names as minijinja's closure does, and
/// declines where that depends on the order of stores.
#[test]
fn macros_read_the_top_levels_names_as_minijinjas_closures() {
    check_probes(CLOSURE_PROBES, Expect::Direct);
    check_probes(CLOSURE_DECLINED_PROBES, Expect::Declines);
}

/// `dictsort` loops over mappings other than the request's objects (a
/// constant dict literal, keys of several kinds): the pairs in the order
/// minijinja's `dictsort` gives them.
const DICTSORT_PROBES: &[&str] = &[
    "{% set d = {0: 0, 512: 128, 16384: 1024, 2048: 512} %}{% for k, v in d | dictsort %}{{ k }}={{ v }};{{ loop.last }}{% endfor %}{{ d[512] }}",
    "{% for k, v in {'b': 1, 'A': 'x', 'a': 2, 10: 2, '10': 3, 0: 4} | dictsort %}{{ k }}:{{ v }}|{{ loop.index }}{% endfor %}",
    "{% for k, v in {} | dictsort %}x{% else %}E{% endfor %}",
    "{% for k, v in {'z': 1, 'y': 2} | dictsort %}{% if loop.first %}{{ k }}{% endif %}{{ loop.revindex }}{% endfor %}",
];

#[test]
fn dictsort_loops_over_other_mappings_agree_with_minijinja() {
    check_probes(DICTSORT_PROBES, Expect::Direct);
    // Floats and lists print through minijinja either way.
    check_probe(
        "{% for k, v in {'b': 1, 'A': [1, 'x'], 'a': none, 10: 2, '10': 3, 1.5: 4} | dictsort %}{{ k }}:{{ v }}|{{ loop.index }}{% endfor %}",
        Expect::Agrees,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let pair = Pair::plain(
        "{% for t in tools %}{% for k, v in t.function.parameters.properties | dictsort %}{{ k }}={{ v.type }};{% endfor %}{% endfor %}",
    );
    // More properties than the crate's small maps hold: a map of
    // minijinja's own.
    let properties: serde_json::Map<String, Value> = (0..40)
        .map(|i| {
            (
                format!("{}{i}", if i % 3 == 0 { 'B' } else { 'a' }),
                json!({"type": "string"}),
            )
        })
        .collect();
    let req = request(json!([{"role": "user", "content": "x"}]))
        .with_tools(&json!([{"type": "function", "function": {
            "name": "f", "description": "d",
            "parameters": {"type": "object", "properties": properties}}}]))
        .expect("tools");
    let (reference, direct) = pair.compare(&req).expect("agreement");
    assert!(reference.is_ok());
    assert_eq!(direct, reference.ok());
}

/// Dict literals with values computed at run time: built as minijinja's
/// `BuildMap` builds them (literal order, a repeated key keeps its place
/// and takes the last value).
const DICT_LITERAL_PROBES: &[&str] = &[
    "{% set d = {'role': messages[0].role, 'content': messages[0].content} %}{{ d.role }}|{{ d['content'] }}|{{ d.nope is defined }}",
    "{{ {'a': messages | length} | tojson }}",
    "{% macro f(m) %}{{ m.role }}:{{ m.content }}{% endmacro %}{{ f({'role': 'x', 'content': messages[-1].content}) }}",
    "{% set d = {'a': 1, 'b': messages | length, 'a': 3} %}{{ d | tojson }}{{ d | length }}",
    "{{ {'k': messages[0].role} is mapping }}{{ {messages[0].role: 1}[messages[0].role] }}",
];

/// Uses of a dict literal the direct renderer may leave to minijinja.
const DICT_LITERAL_AGREE_PROBES: &[&str] = &[
    "{{ {'a': messages | length} }}",
    "{% for k, v in {'a': messages | length}.items() %}{{ k }}{{ v }}{% endfor %}",
    "{{ 'a' in {'a': messages | length} }}",
    "{% set ns = namespace(a=1) %}{{ {'n': ns}.n.a }}",
    "{{ {'s': messages[1:]}.s | length }}",
];

#[test]
fn dict_literals_agree_with_minijinja() {
    check_probes(DICT_LITERAL_PROBES, Expect::Direct);
    check_probes(DICT_LITERAL_AGREE_PROBES, Expect::Agrees);
}

/// `+` of sequences: minijinja's lazy concatenation (an iterable of known
/// length), made a list once nested past its maximal depth.
const SEQUENCE_ADD_PROBES: &[&str] = &[
    "{% set ns = namespace(l=[]) %}{% for m in messages %}{% set ns.l = ns.l + [m.role] %}{% endfor %}{{ ns.l | join(',') }}|{{ ns.l | length }}|{{ ns.l is sequence }}|{{ ns.l is iterable }}|{{ ns.l is defined }}|{% if ns.l %}T{% endif %}|{{ 'user' in ns.l }}{{ 'x' not in ns.l }}|{% for r in ns.l %}{{ loop.index }}{{ r }}{{ loop.last }}{% endfor %}",
    "{% set e = messages[:0] + [] %}{% if e %}T{% else %}F{% endif %}{{ e | length }}{% for x in e %}x{% else %}E{% endfor %}",
    "{% set x = messages + messages %}{{ x | length }}{% for m in x %}{{ m.role }}{% endfor %}",
    "{% set x = messages[1:] + ['a'] + [] %}{{ x | length }}{{ x | list | length }}",
    "{% set ns = namespace(l=[]) %}{% for i in range(70) %}{% set ns.l = ns.l + [i] %}{% if ns.l is sequence %}S{% else %}I{% endif %}{% endfor %}{{ ns.l | length }}",
    "{% set ns = namespace(l=[]) %}{% for i in range(40) %}{% set ns.l = ns.l + [i] + [i] %}{{ ns.l is sequence }}{% endfor %}",
    "{% macro f(l) %}{% for x in l %}{{ x }}{% endfor %}{% endmacro %}{{ f([messages[0].role] + ['b']) }}{{ f(['c'] + [messages[0].role] | default(['e'])) }}{{ f(([messages[0].role] + ['b']) | default(['e'])) }}",
    "{% set l = ['a'] + [messages[0].role] %}{{ l | list | tojson }}{{ (l | list)[1] }}",
];

/// Uses of a concatenation the direct renderer may leave to minijinja.
const SEQUENCE_ADD_AGREE_PROBES: &[&str] = &[
    "{{ [1] + [2] }}",
    "{{ ([1] + [2])[0] }}|{{ ([1] + [2]).x }}",
    "{{ [1] + 'a' }}",
    "{{ 'a' + [1] }}",
    "{{ ([1] + [2]) | tojson }}",
    "{{ ([1] + ([2] + [3])) | length }}",
    "{{ ([1] + [2]) == [1, 2] }}",
    "{{ [1] + none }}",
    "{{ [1] + messages[0] }}",
    "{{ (([1] + [2]) + 3) | length }}",
    "{{ ([1] + [2]) | first }}",
    // Folded by minijinja's compiler into a constant of its own.
    "{{ ([] + []) | length }}{% if [] + [] %}T{% endif %}",
];

#[test]
fn sequence_additions_agree_with_minijinja() {
    check_probes(SEQUENCE_ADD_PROBES, Expect::Direct);
    check_probes(SEQUENCE_ADD_AGREE_PROBES, Expect::Agrees);
}

/// An integer index into minijinja's iterables (a slice, a `+` of
/// sequences) takes the `nth` item, a negative one counted back from the
/// length; past either end it is undefined.
#[test]
fn iterables_index_as_minijinja_does() {
    check_probes(
        &[
            "{% set rest = messages[1:] %}{{ rest[-1].role }}|{{ rest[0].role }}|{{ rest[-9] is defined }}|{{ rest[9] is defined }}|{{ rest[-(rest | length)].role }}",
            "{% set l = [messages[0].role] + ['b'] %}{{ l[0] }}{{ l[-1] }}{{ l[1] }}|{{ l[2] is defined }}{{ l[-3] is defined }}",
            "{% set m = messages[1:] if messages[0].role == 'system' else messages %}{% if m[-1].role == 'assistant' %}A{% endif %}{% set m = m[:-1] %}{{ m | length }}",
        ],
        Expect::Direct,
    );
    check_probes(
        &[
            "{{ messages[1:][9223372036854775807] is defined }}|{{ messages[1:]['x'] }}|{{ messages[1:][1.0] }}",
            "{% set l = [1] + [2] %}{{ l['x'] }}|{{ l[true] }}",
        ],
        Expect::Agrees,
    );
}

/// A name a macro sets at its body's own level is bound in its frame for
/// the statements after it, even where the top level assigns it too.
#[test]
fn a_macros_own_sets_bind_its_later_reads() {
    check_probes(
        &[
            "{% set ns = namespace(a=0) %}{% macro f() %}{% set ns = namespace(a=5) %}{% for m in messages %}{% set ns.a = ns.a + 1 %}{% endfor %}{{ ns.a }}{% endmacro %}{{ f() }}{{ ns.a }}",
            "{% set x = 'top' %}{% macro f() %}{{ x }}{% endmacro %}{% macro g() %}{% set x = 'g' %}{{ x }}{{ f() }}{% endmacro %}{{ g() }}",
            "{% set x = 1 %}{% macro f() %}{% set x %}in{% endset %}{% if messages %}{{ x }}{% endif %}{% endmacro %}{{ f() }}",
        ],
        Expect::Direct,
    );
    check_probes(
        &[
            "{% set x = 1 %}{% macro f() %}{{ x }}{% set x = 2 %}{{ x }}{% endmacro %}{{ f() }}",
            "{% set x = 1 %}{% macro f() %}{% if messages %}{% set x = 2 %}{% endif %}{{ x }}{% endmacro %}{{ f() }}",
        ],
        Expect::Declines,
    );
}

/// A string's `format(...)`: pycompat's `str.format`, minijinja's own
/// `format_filter`; errors and other bases are minijinja's.
#[test]
fn string_format_agrees_with_minijinja() {
    check_probes(
        &[
            "{% set t = ':x' %}{{ '<a{}>'.format(t) }}|{{ '{} {}'.format(messages[0].role, messages | length) }}|{{ '{1}-{0}'.format('a', messages[0].role) }}|{{ '{{}}'.format() }}|{{ ('<b>{}' | safe).format(messages[0].role) }}",
            "{{ '{:>6}|{:<4}|{:^5}'.format(messages[0].role, 'ab', messages | length) }}",
        ],
        Expect::Direct,
    );
    check_probes(
        &[
            "{{ '{}'.format() }}",
            "{{ '{x}'.format(x=messages[0].role) }}",
            "{{ messages.format(1) }}|{{ (messages | length).format() }}",
            "{{ '{:.2f}|{!r}'.format(1.5, messages[0].role) }}",
            "{{ '{}'.format(messages[1:]) }}|{{ '{0[role]}'.format(messages[0]) }}",
            "{{ '{}{}'.format(nothing, none) }}",
        ],
        Expect::Agrees,
    );
}

/// `in` a mapping of minijinja's own (a dict literal, a constant): its
/// keys, as minijinja's lookup finds them.
#[test]
fn membership_in_other_mappings_agrees_with_minijinja() {
    check_probes(
        &[
            "{% set nd = {} %}{{ messages[0].role in nd }}|{% set d = {'user': 1, messages[0].role: 2} %}{{ 'user' in d }}{{ 'x' not in d }}{{ messages[0].role in d }}",
            "{% set d = {'a': 'x', 'b': 'y'} %}{% for k in ['a', 'c'] %}{{ k in d }}{% endfor %}",
        ],
        Expect::Direct,
    );
    check_probes(
        &[
            "{% set d = {'a': nothing} %}{{ 'a' in d }}|{{ 'b' in d }}",
            "{% set d = {1: 'x', 'a': 2} %}{{ 'a' in d }}|{{ 1 in d }}",
            "{% set d = {'a': messages | length} %}{{ 1 in d }}|{{ none in d }}",
        ],
        Expect::Agrees,
    );
}

/// A macro calling one the template defines later: minijinja's closure
/// finds it once the later definition has run; before, the call fails.
/// Reading such a name otherwise is left to minijinja.
#[test]
fn macros_call_macros_defined_later_as_minijinja_does() {
    check_probes(
        &[
            "{% macro f(x) %}[{{ g(x) }}]{% endmacro %}{% macro g(y) %}{{ y }}{% endmacro %}{{ f(messages[0].role) }}",
            "{% macro even(n) %}{% if n == 0 %}E{% else %}{{ odd(n - 1) }}{% endif %}{% endmacro %}{% macro odd(n) %}{% if n == 0 %}O{% else %}{{ even(n - 1) }}{% endif %}{% endmacro %}{{ even(messages | length) }}",
        ],
        Expect::Direct,
    );
    check_probes(
        &[
            "{% macro f() %}{{ g() }}{% endmacro %}{{ f() }}{% macro g() %}x{% endmacro %}",
            "{% macro f() %}{{ g is defined }}{% endmacro %}{% macro g() %}x{% endmacro %}{{ f() }}",
            "{% macro f(g) %}{{ g() }}{% endmacro %}{% macro g() %}x{% endmacro %}{{ f(1) }}",
            "{% macro f() %}{{ g(1, 2) }}{% endmacro %}{% macro g(a) %}x{% endmacro %}{{ f() }}",
        ],
        Expect::Declines,
    );
}

/// Keyword arguments of a macro call bind its parameters by name, as
/// minijinja's macro binds them; arguments it refuses decline.
#[test]
fn macro_keyword_arguments_agree_with_minijinja() {
    let f = "{% macro f(a, b='B', c='C') %}{{ a }}{{ b }}{{ c }}{% endmacro %}";
    let direct = [
        format!("{f}{{{{ f(messages[0].role, c='x') }}}}|{{{{ f(c=1, a=2) }}}}|{{{{ f(b=none) }}}}|{{{{ f(c=nothing) }}}}"),
        "{% macro g() %}{{ h(y='k') }}{% endmacro %}{% macro h(x='d', y='e') %}{{ x }}{{ y }}{% endmacro %}{{ g() }}".to_owned(),
        "{% set ns = namespace(n=0) %}{% macro bump() %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{% endmacro %}{% macro f(a, b) %}{{ a }}{{ b }}{% endmacro %}{{ f(b=bump(), a=bump()) }}".to_owned(),
    ];
    let declined = [
        format!("{f}{{{{ f(d=1) }}}}"),
        format!("{f}{{{{ f(1, a=2) }}}}"),
        format!("{f}{{{{ f(1, 2, 3, 4) }}}}"),
        format!("{f}{{{{ f(*messages) }}}}"),
    ];
    check_probes(
        &direct.iter().map(String::as_str).collect::<Vec<_>>(),
        Expect::Direct,
    );
    check_probes(
        &declined.iter().map(String::as_str).collect::<Vec<_>>(),
        Expect::Declines,
    );
}

/// A name set in a conditional's or a loop's statements inside a macro is
/// bound for the statements after it in the same list.
#[test]
fn sets_in_a_macros_nested_statements_bind_the_reads_after_them() {
    check_probes(
        &[
            "{% set ns = namespace(a='top') %}{% macro f(m) %}{% if m is mapping %}{% set ns = namespace(a=0) %}{% for k, v in m | dictsort %}{% set ns.a = ns.a + 1 %}{% endfor %}{{ ns.a }}{% else %}-{% endif %}{% endmacro %}{{ f(messages[0]) }}{{ f(1) }}{{ ns.a }}",
            "{% set x = 'top' %}{% macro f() %}{% for m in messages %}{% set x = m.role %}{{ x }}{% endfor %}{% endmacro %}{{ f() }}{{ x }}",
        ],
        Expect::Direct,
    );
    check_probes(
        &[
            "{% set x = 'top' %}{% macro f() %}{% if messages %}{% set x = 'in' %}{% endif %}{{ x }}{% endmacro %}{{ f() }}",
            "{% set x = 'top' %}{% macro f() %}{% for m in messages %}{% set x = m.role %}{% endfor %}{{ x }}{% endmacro %}{{ f() }}",
        ],
        Expect::Declines,
    );
}

/// `min` and `max` of a sequence of integers; other items are minijinja's.
#[test]
fn min_and_max_of_integers_agree_with_minijinja() {
    check_probes(
        &[
            "{% set n = messages | length %}{{ [n, 3] | min }}|{{ [n, 3, -1] | max }}|{{ [n] | min }}|{{ messages[:0] | min is defined }}|{{ [n, n] | max }}",
            "{% set l = [messages | length, 2] + [0] %}{{ l | min }}{{ l | max }}{{ messages[:0] | max is defined }}",
        ],
        Expect::Direct,
    );
    check_probes(
        &[
            "{{ [messages | length, 1.5] | min }}|{{ ['b', messages[0].role] | max }}|{{ nothing | min }}|{{ [messages | length, none] | max }}",
            "{{ messages | min }}|{{ [messages | length, true] | max }}",
        ],
        Expect::Agrees,
    );
}

/// A macro parameter named `namespace` reads as the parameter; a call of
/// a macro's parameter or local (shadowing a function or a macro) is left
/// to minijinja.
#[test]
fn macro_locals_shadow_functions_and_macros() {
    check_probes(
        &[
            "{% macro f(fns, namespace='functions') %}{{ 'namespace ' + namespace }}{{ fns | length }}{% endmacro %}{{ f(messages) }}|{{ f(messages, messages[0].role) }}|{{ f(messages, namespace='x') }}",
        ],
        Expect::Direct,
    );
    check_probes(
        &[
            "{% macro g() %}G{% endmacro %}{% macro f(g) %}{{ g() }}{% endmacro %}{{ f(messages) }}",
            "{% macro f(namespace) %}{% set ns = namespace(a=1) %}{{ ns.a }}{% endmacro %}{{ f(messages) }}",
        ],
        Expect::Declines,
    );
}
