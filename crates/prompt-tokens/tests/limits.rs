//! Template errors and limits: raise_exception, fuel, output cap, template
//! size, syntax; and the fuzz entry point on a few seeds.

use std::sync::Arc;

use prompt_tokens::{
    ChatRequest, ChatTemplate, Error, FixedClock, RenderLimits, SpecialTokens, TemplateFamily,
};
use serde_json::json;

fn compile(source: &str, limits: RenderLimits) -> prompt_tokens::Result<ChatTemplate> {
    ChatTemplate::new(
        source,
        SpecialTokens::default(),
        limits,
        Arc::new(FixedClock(0)),
    )
}

fn req() -> ChatRequest {
    ChatRequest::new(&json!([{"role": "user", "content": "hi"}])).unwrap()
}

#[test]
fn raise_exception_message_is_surfaced() {
    let t = compile(
        "{% if messages[0].role == 'user' %}{{ raise_exception('users may not speak first') }}{% endif %}",
        RenderLimits::default(),
    )
    .unwrap();
    match t.render(&req()) {
        Err(Error::TemplateRaised(msg)) => assert_eq!(msg, "users may not speak first"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn endless_work_runs_out_of_fuel() {
    let limits = RenderLimits {
        fuel: 10_000,
        ..RenderLimits::default()
    };
    let t = compile(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        limits,
    )
    .unwrap();
    assert!(matches!(t.render(&req()), Err(Error::FuelExhausted)));
}

#[test]
fn output_is_capped() {
    let limits = RenderLimits {
        max_output_bytes: 1000,
        ..RenderLimits::default()
    };
    let t = compile(
        "{% for i in range(600) %}{{ messages[0].content }}{% endfor %}",
        limits,
    )
    .unwrap();
    assert!(matches!(
        t.render(&req()),
        Err(Error::OutputTooLarge { max: 1000 })
    ));
    let small = compile(
        "{% for i in range(10) %}{{ messages[0].content }}{% endfor %}",
        limits,
    )
    .unwrap();
    assert_eq!(small.render(&req()).unwrap(), "hi".repeat(10));
}

#[test]
fn template_size_and_syntax_are_checked_at_compile_time() {
    let limits = RenderLimits {
        max_template_bytes: 10,
        ..RenderLimits::default()
    };
    assert!(matches!(
        compile("{{ messages }} and more", limits),
        Err(Error::TemplateTooLarge { len: 23, max: 10 })
    ));
    assert!(matches!(
        compile("{% for %}", RenderLimits::default()),
        Err(Error::TemplateSyntax(_))
    ));
}

#[test]
fn pycompat_methods_and_python_tojson() {
    let t = compile(
        "{{ messages[0].content.strip().upper() }}|{{ messages[0].content.startswith(' h') }}|\
         {% for k, v in messages[0].items() %}{{ k }}={{ v | trim }};{% endfor %}|\
         {{ {'b': [1, 2.5, none, true], 'a': 'é\"\\n'} | tojson }}|{{ {'x': 1} | tojson(indent=2) }}",
        RenderLimits::default(),
    )
    .unwrap();
    let r = ChatRequest::new(&json!([{"role": "user", "content": " hi "}])).unwrap();
    assert_eq!(
        t.render(&r).unwrap(),
        // The message's keys in the order they were written, as Python's
        // dict iterates them.
        "HI|True|role=user;content=hi;|{\"b\": [1, 2.5, null, true], \"a\": \"é\\\"\\n\"}|{\n  \"x\": 1\n}"
    );
}

#[test]
fn python_style_printing_of_constants() {
    let t = compile(
        "{{ true }} {{ false }} {{ none }} {{ [1, 'a'] }}",
        RenderLimits::default(),
    )
    .unwrap();
    // As Python prints them, lists with their items' repr.
    assert_eq!(t.render(&req()).unwrap(), "True False None [1, 'a']");
}

#[test]
fn strftime_now_uses_the_injected_clock() {
    let t = ChatTemplate::new(
        "{{ strftime_now('%d %b %Y') }}",
        SpecialTokens::default(),
        RenderLimits::default(),
        Arc::new(FixedClock(1_721_997_296)),
    )
    .unwrap();
    assert_eq!(t.render(&req()).unwrap(), "26 Jul 2024");
}

#[test]
fn shipped_templates_compile_and_render_empty_conversations() {
    for family in TemplateFamily::ALL {
        let t = compile(family.template(), RenderLimits::default()).unwrap();
        let empty = ChatRequest::new(&json!([])).unwrap();
        assert!(t.render(&empty).is_ok(), "{family:?}");
    }
}

#[test]
fn fuzz_entry_point_on_seeds() {
    let seeds: &[&[u8]] = &[
        b"",
        b"{{ messages }}\0[]",
        b"{% for m in messages %}{{ m.content }}{% endfor %}\0{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}",
        b"{% for i in range(99999999) %}x{% endfor %}\0[]",
        b"{{ 'x' * 100000 }}{{ 'y' * 100000 }}\0[]",
        b"{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}\0[]",
        b"{{ raise_exception('no') }}\0{\"messages\": 3}",
        b"{{ tools | tojson }}\0{\"messages\":[], \"tools\": [{\"a\": [[[[[]]]]]}]}",
        b"{{ strftime_now('%Y %-d %q %') }}\0[{\"role\": 1, \"content\": {\"type\": \"text\"}}]",
        b"\xff\xfe{{\0\xff",
        b"{{ messages[0].content.split().join() }}\0[{\"role\":\"user\",\"content\":[{\"type\":\"image\"}]}]",
        // The constructs real templates use, on the direct renderer.
        b"{% set ns = namespace(i=0) %}{% for m in messages[::-1] %}{% set ns.i = ns.i + 1 %}{{ m.role + ':' + m.content.strip() }}{% endfor %}\
          {{ ns.i - 1 }}{% for k, v in messages[0].items() %}{{ k }}{% endfor %}{{ messages[0].content.split(' ', 1)[-1] }}\0\
          [{\"role\":\"user\",\"content\":\" a b \"},{\"role\":\"assistant\",\"content\":\"\\u00e9\"}]",
        b"{% macro f(x, y=none) %}{{ x + (y or '') }}{% endmacro %}{{ f(messages[0].content, 1) }}{{ f('a') }}\
          {% set b %}{{ messages | length }}{% endset %}{{ b + '!' }}\0[{\"role\":\"user\",\"content\":7}]",
    ];
    for seed in seeds {
        prompt_tokens::fuzzing::render(seed);
    }
    // The committed seed corpus of the cargo-fuzz target.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus/prompt_tokens_render");
    let mut committed = 0;
    for entry in std::fs::read_dir(&dir).expect("the render seed corpus") {
        let path = entry.expect("a seed").path();
        if path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("seed-"))
        {
            prompt_tokens::fuzzing::render(&std::fs::read(&path).expect("a seed"));
            committed += 1;
        }
    }
    assert!(committed >= 3, "{committed} committed seeds");
    // A template past the fuzz limits' cap is refused, not rendered.
    let big = [
        b"x".repeat(prompt_tokens::fuzzing::FUZZ_LIMITS.max_template_bytes + 1),
        b"\0[]".to_vec(),
    ]
    .concat();
    prompt_tokens::fuzzing::render(&big);
}

/// minijinja 2.24 panics when it reverses an empty sequence or string
/// (`[][::-1]`: its backwards range yields index 0 of nothing), and six of
/// the corpus's templates loop over `messages[::-1]`. Whatever minijinja
/// does, a request gets an error, never a panic: the router then routes
/// it on text.
#[test]
fn a_panic_inside_minijinja_is_an_error_not_a_panic() {
    let reverse_messages = "{% for m in messages[::-1] %}{{ m.role }}{% endfor %}";
    let reverse_content = "{{ messages[0].content[::-1] }}";
    let render = |source: &str, messages: serde_json::Value| {
        let t = compile(source, RenderLimits::default())
            .unwrap()
            .with_direct_rendering(false);
        let request = ChatRequest::new(&messages).unwrap();
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.render(&request)))
            .unwrap_or_else(|_| panic!("rendering {source} of {messages} panicked"))
    };
    for (source, messages) in [
        (reverse_messages, json!([])),
        (reverse_content, json!([{"role": "user", "content": ""}])),
    ] {
        match render(source, messages) {
            Err(Error::Render(message)) => assert!(
                message.contains("internal error of the template engine"),
                "{message}"
            ),
            other => panic!("{other:?}"),
        }
    }
    // What minijinja does not panic on still renders.
    let one = json!([{"role": "user", "content": "ab"}]);
    assert_eq!(render(reverse_messages, one.clone()).unwrap(), "user");
    assert_eq!(render(reverse_content, one).unwrap(), "ba");
}
