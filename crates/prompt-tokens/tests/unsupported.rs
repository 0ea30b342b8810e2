//! A template that uses what jinja2 has and the renderer does not is
//! refused when it is loaded, naming the line and the construct (issue 35:
//! never a failure at request time for what vLLM renders); what the
//! renderer has, what a template defines for itself, and what neither
//! renderer has (both fail alike where the line runs) load.

use std::sync::Arc;

use prompt_tokens::{ChatTemplate, Error, FixedClock, RenderLimits, SpecialTokens, TemplateFamily};

fn load(source: &str) -> Result<ChatTemplate, Error> {
    ChatTemplate::new(
        source,
        SpecialTokens::default(),
        RenderLimits::default(),
        Arc::new(FixedClock(0)),
    )
}

fn refusal(source: &str) -> (usize, String) {
    match load(source) {
        Err(Error::TemplateUnsupported { line, construct }) => (line, construct),
        other => panic!("expected a refusal of {source:?}, got {other:?}"),
    }
}

#[test]
fn a_filter_jinja2_has_and_the_renderer_lacks_is_refused_with_its_line() {
    let source = "{% for m in messages %}\n{{ m.content }}\n{{ m.content | urlize }}\n{% endfor %}";
    assert_eq!(refusal(source), (3, "the filter `urlize`".to_owned()));
    let message = load(source).unwrap_err().to_string();
    assert!(
        message.contains("line 3") && message.contains("`urlize`"),
        "{message}"
    );
}

#[test]
fn a_test_method_or_function_jinja2_has_and_the_renderer_lacks_is_refused() {
    assert_eq!(
        refusal("{% if messages is callable %}x{% endif %}"),
        (1, "the test `callable`".to_owned())
    );
    assert_eq!(
        refusal("\n\n{{ messages[0].content.translate({}) }}"),
        (3, "the method `translate`".to_owned())
    );
    assert_eq!(
        refusal("{{ lipsum(1) }}"),
        (1, "the function `lipsum`".to_owned())
    );
}

#[test]
fn what_neither_renderer_has_loads_and_fails_where_it_runs_as_in_jinja2() {
    // llama.cpp's `from_json` in a branch vLLM's preprocessing never takes
    // (DeepSeek V3.2's template), a mutating method jinja2's immutable
    // sandbox refuses (Kimi K2's), a misspelt macro: jinja2 raises only
    // where the line runs, and so does the renderer.
    let source =
        "{% if false %}{{ x | from_json }}{{ ids.append(1) }}{{ render_tols() }}{% endif %}ok";
    let template = load(source).expect("not the router's gap");
    let request =
        prompt_tokens::ChatRequest::new(&serde_json::json!([{"role": "user", "content": "Hi"}]))
            .unwrap();
    assert_eq!(template.render(&request).unwrap(), "ok");
    let runs = load("{{ 'x' | from_json }}").expect("loads");
    assert!(template_fails(&runs, &request), "fails where it runs");
}

fn template_fails(template: &ChatTemplate, request: &prompt_tokens::ChatRequest) -> bool {
    template.render(request).is_err()
}

#[test]
fn python_percent_formatting_is_refused() {
    let (line, construct) = refusal("{{ 'Today is %s' % date }}");
    assert_eq!(line, 1);
    assert!(construct.contains('%'), "{construct}");
}

#[test]
fn a_refused_name_inside_a_branch_no_request_takes_yet_is_still_refused() {
    // The tool branch is rendered only for requests with tools: a render
    // test of a plain chat would not find it; the load does.
    let source = "{% if tools %}{{ tools | wordwrap }}{% endif %}{{ messages[0].content }}";
    assert_eq!(refusal(source), (1, "the filter `wordwrap`".to_owned()));
}

#[test]
fn what_the_renderer_has_and_what_a_template_defines_loads() {
    let source = r#"
{%- macro show(m, sep=': ') -%}{{ m.role | upper }}{{ sep }}{{ caller() if false else m.content | trim }}{%- endmacro -%}
{%- set ns = namespace(first=true) -%}
{%- set render = show -%}
{%- for m in messages if m.role != 'tool' -%}
{{ loop.cycle('a', 'b') }}{{ render(m) }}{{ m.content.strip().split(' ') | join(',') }}
{%- if m.content.startswith('x') or m.get is defined %}{{ {'k': 1}.items() | list | tojson }}{% endif -%}
{%- set ns.first = false -%}
{%- endfor -%}
{{ raise_exception('no') if messages is none }}{{ strftime_now('%Y') }}{{ range(2) | list }}
{%- call show({'role': 'r', 'content': 'c'}) %}inner{% endcall %}
"#;
    load(source).expect("every name is the renderer's or the template's own");
    for family in TemplateFamily::ALL {
        load(family.template()).expect("the crate's own templates load");
    }
}
