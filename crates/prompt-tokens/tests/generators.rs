//! jinja2's `map`, `select`, `reject`, `selectattr`, `rejectattr`,
//! `items`, `unique`, `batch` and `slice` return generators, and its
//! `reverse` of a list Python's `reversed()` iterator; the renderer
//! emulates them (module `generators`). Each case's expected text
//! is what jinja2 3.1.6 rendered in `ImmutableSandboxedEnvironment` (as
//! transformers 4.57.1 configures it) over the same values, written in
//! the comment above it; "raises" means jinja2 raised, with the error it
//! raised.

use std::sync::Arc;

use prompt_tokens::{ChatRequest, ChatTemplate, Error, FixedClock, RenderLimits, SpecialTokens};
use serde_json::json;

/// `source` rendered with `xs`, `ns`, `d` and `tools` as values.
fn render(source: &str) -> Result<String, Error> {
    let template = ChatTemplate::new(
        source,
        SpecialTokens::default(),
        RenderLimits::default(),
        Arc::new(FixedClock(0)),
    )?;
    let request = ChatRequest::from_value(&json!({
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {
            "xs": [{"n": "a", "k": 1}, {"n": "b", "k": 2}, {"n": "c", "k": 3}],
            "ns": [1, 2, 3, 4],
            "d": {"a": 1, "b": 2},
        },
    }))?;
    template.render(&request)
}

#[track_caller]
fn renders(source: &str, expected: &str) {
    match render(source) {
        Ok(text) => assert_eq!(text, expected, "{source}"),
        Err(e) => panic!("{source}: expected {expected:?}, raised {e}"),
    }
}

#[track_caller]
fn raises(source: &str) {
    if let Ok(text) = render(source) {
        panic!("{source}: expected an error, rendered {text:?}");
    }
}

#[test]
fn a_generator_is_read_once() {
    // 'abc|'
    renders(
        "{% set g = xs|map(attribute='n') %}{% for x in g %}{{ x }}{% endfor %}|{% for x in g %}{{ x }}{% endfor %}",
        "abc|",
    );
    // "['a', 'b', 'c']|[]"
    renders(
        "{% set g = xs|map(attribute='n') %}{{ g|list }}|{{ g|list }}",
        "['a', 'b', 'c']|[]",
    );
    // 'a,b,c|'
    renders(
        "{% set g = xs|map(attribute='n') %}{{ g|join(',') }}|{{ g|join(',') }}",
        "a,b,c|",
    );
    // "['c', 'b', 'a']|[]"
    renders(
        "{% set g = xs|map(attribute='n') %}{{ g|reverse|list }}|{{ g|list }}",
        "['c', 'b', 'a']|[]",
    );
    // 'a=1;b=2;|'
    renders(
        "{% set g = d|items %}{% for k, v in g %}{{ k }}={{ v }};{% endfor %}|{% for k, v in g %}{{ k }}{% endfor %}",
        "a=1;b=2;|",
    );
    // '1,2|'
    renders(
        "{% set g = [1, 1, 2]|unique %}{{ g|join(',') }}|{{ g|join(',') }}",
        "1,2|",
    );
    // '[[1, 2, 3], [4, 0, 0]]|[]'
    renders(
        "{% set g = ns|batch(3, 0) %}{{ g|list|tojson }}|{{ g|list|tojson }}",
        "[[1, 2, 3], [4, 0, 0]]|[]",
    );
}

#[test]
fn first_and_in_read_only_as_far_as_they_need() {
    // "a|['b', 'c']"
    renders(
        "{% set g = xs|map(attribute='n') %}{{ g|first }}|{{ g|list }}",
        "a|['b', 'c']",
    );
    // '1:234'
    renders(
        "{% set g = ns|select %}{{ g|first }}:{% for x in g %}{{ x }}{% endfor %}",
        "1:234",
    );
    // '[]' (`first` of an empty generator is undefined)
    renders("[{{ ns|select('gt', 9)|first }}]", "[]");
    // 'True|[3]'
    renders(
        "{% set g = ns|select('odd') %}{{ 1 in g }}|{{ g|list }}",
        "True|[3]",
    );
    // 'False|[]'
    renders(
        "{% set g = ns|select('odd') %}{{ 9 in g }}|{{ g|list }}",
        "False|[]",
    );
    // 'TrueFalse'
    renders(
        "{% set g = ns|map('string') %}{{ '2' in g }}{{ '1' in g }}{{ g|join }}",
        "TrueFalse",
    );
}

#[test]
fn tojson_length_count_and_last_of_a_generator_raise() {
    // TypeError: Object of type generator is not JSON serializable (the
    // line of llama.cpp's DeepSeek R1 template)
    raises("{{ tools | map(attribute='function') | tojson(indent=2) }}");
    raises("{{ xs|map(attribute='n')|tojson }}");
    raises("{{ {'a': ns|select}|tojson }}");
    raises("{{ d|items|tojson }}");
    raises("{{ [1, 1]|unique|tojson }}");
    raises("{{ ns|slice(2)|tojson }}");
    raises("{{ xs|selectattr('k', 'gt', 1)|tojson }}");
    raises("{{ xs|rejectattr('k', 'gt', 1)|tojson }}");
    raises("{{ ns|reject('odd')|tojson }}");
    // TypeError: object of type 'generator' has no len()
    raises("{{ xs|map(attribute='n')|length }}");
    raises("{{ xs|map(attribute='n')|count }}");
    raises("{{ d|items|length }}");
    // TypeError: 'generator' object is not reversible
    raises("{{ xs|map(attribute='n')|last }}");
    // '[2, 4]': a list made of one serialises
    renders("{{ ns|select('even')|list|tojson }}", "[2, 4]");
    // 'c': `last` of a list is unchanged
    renders("{{ xs|map(attribute='n')|list|last }}", "c");
}

#[test]
fn a_loop_over_a_generator_knows_its_length() {
    // '1/3False,2/3False,3/3True,'
    renders(
        "{% for x in xs|map(attribute='n') %}{{ loop.index }}/{{ loop.length }}{{ loop.last }},{% endfor %}",
        "1/3False,2/3False,3/3True,",
    );
    // '321'
    renders(
        "{% for x in xs|map(attribute='n') %}{{ loop.revindex }}{% endfor %}",
        "321",
    );
    // '2False3True'
    renders(
        "{% for x in xs|map(attribute='k') if x > 1 %}{{ x }}{{ loop.last }}{% endfor %}",
        "2False3True",
    );
    // '1333': the length of what is left
    renders(
        "{% set g = ns|select %}{{ g|first }}{% for x in g %}{{ loop.length }}{% endfor %}",
        "1333",
    );
    // '2,3,4,,'
    renders(
        "{% for x in ns|select %}{{ loop.nextitem }},{% endfor %}",
        "2,3,4,,",
    );
    // '10'
    renders(
        "{% set acc = namespace(a=0) %}{% for x in ns|select %}{% set acc.a = acc.a + x %}{% endfor %}{{ acc.a }}",
        "10",
    );
}

#[test]
fn a_generator_is_true_iterable_not_a_sequence_and_indexes_to_undefined() {
    // 'T' (even empty)
    renders("{% if ns|select('gt', 9) %}T{% else %}F{% endif %}", "T");
    // 'False'
    renders("{{ not (ns|select('gt', 9)) }}", "False");
    // 'True', 'False', 'False', 'True', 'False'
    renders("{{ (ns|select) is iterable }}", "True");
    renders("{{ (ns|select) is sequence }}", "False");
    renders("{{ (ns|select) is mapping }}", "False");
    renders("{{ (ns|select) is defined }}", "True");
    renders("{{ (ns|select) is none }}", "False");
    // '[]'
    renders("[{{ (xs|map(attribute='n'))[0] }}]", "[]");
    // UndefinedError: generator object has no element 0
    raises("{{ (xs|map(attribute='n'))[0].x }}");
    // "['a', 'b', 'c']": indexing did not read it
    renders(
        "{% set g = xs|map(attribute='n') %}{{ g[1] }}{{ g|list }}",
        "['a', 'b', 'c']",
    );
    // '[1, 2, 3, 4]'
    renders("{{ (ns|select)|default('d')|list }}", "[1, 2, 3, 4]");
}

#[test]
fn other_filters_read_a_generator_as_jinja2s_do() {
    // '[2, 4]', '4', '1', '3', '[1, 3]'
    renders("{{ ns|reject('odd')|sort|list }}", "[2, 4]");
    renders("{{ ns|select('odd')|sum }}", "4");
    renders("{{ ns|select('odd')|min }}", "1");
    renders("{{ ns|select('odd')|max }}", "3");
    renders("{{ ns|select('odd')|unique|list }}", "[1, 3]");
    // 'b+c', "['a']"
    renders(
        "{{ xs|selectattr('k', 'gt', 1)|map(attribute='n')|join('+') }}",
        "b+c",
    );
    renders(
        "{{ xs|rejectattr('k', 'gt', 1)|map(attribute='n')|list }}",
        "['a']",
    );
    // '[[1, 2], [3, 4]]' twice
    renders("{{ ns|select|batch(2)|list }}", "[[1, 2], [3, 4]]");
    renders("{{ ns|select|slice(2)|list }}", "[[1, 2], [3, 4]]");
    // "[1]", "['D']"
    renders("{{ [{'a': {'b': 1}}]|map(attribute='a.b')|list }}", "[1]");
    renders(
        "{{ [{'a': 1}]|map(attribute='z', default='D')|list }}",
        "['D']",
    );
    // 'zb'
    renders("{{ ['a','b']|map('replace', 'a', 'z')|join }}", "zb");
    // "['A', 'B', 'C']"
    renders("{{ 'abc'|map('upper')|list }}", "['A', 'B', 'C']");
    // '[]', '[]', '[]' (none and undefined yield nothing)
    renders("{{ none|map(attribute='x')|list }}", "[]");
    renders("{{ none|select|list }}", "[]");
    renders("{{ nosuch|map(attribute='x')|list }}", "[]");
    renders("[{% for k, v in nosuch|items %}{{ k }}{% endfor %}]", "[]");
    // "['a', 'b']"
    renders("{{ {'a': 1, 'b': 2}|select|list }}", "['a', 'b']");
}

#[test]
fn a_generator_prints_as_python_prints_it_but_for_the_address() {
    // '<generator object sync_do_map at 0x7fda7c20fc40>': the address is
    // the object's, so this prints a placeholder in its place.
    let printed = render("{{ xs|map(attribute='n') }}").unwrap();
    assert!(
        printed.starts_with("<generator object sync_do_map at 0x") && printed.ends_with('>'),
        "{printed}"
    );
    // '<generator object select_or_reject at 0x7fda7c2f03a0>', inside a
    // list, unread
    let printed = render("{% set g = ns|select %}{{ [g] }}{{ g|list }}").unwrap();
    assert!(
        printed.starts_with("[<generator object select_or_reject at 0x")
            && printed.ends_with(">][1, 2, 3, 4]"),
        "{printed}"
    );
    // '<generator object do_items at 0x...>' through `string` and `~`
    let printed = render("{{ d|items|string }}|{{ d|items ~ 'x' }}").unwrap();
    assert!(
        printed.starts_with("<generator object do_items at 0x") && printed.ends_with(">x"),
        "{printed}"
    );
}

#[test]
fn reverse_of_a_list_or_dict_is_a_one_shot_iterator() {
    // '[4, 3, 2, 1]|[]'
    renders(
        "{% set r = ns|reverse %}{{ r|list }}|{{ r|list }}",
        "[4, 3, 2, 1]|[]",
    );
    // '4|[3, 2, 1]'
    renders(
        "{% set r = ns|reverse %}{{ r|first }}|{{ r|list }}",
        "4|[3, 2, 1]",
    );
    // '44False34False24False14True'
    renders(
        "{% for x in ns|reverse %}{{ x }}{{ loop.length }}{{ loop.last }}{% endfor %}",
        "44False34False24False14True",
    );
    // 'T' (even empty)
    renders("{% if []|reverse %}T{% else %}F{% endif %}", "T");
    // "['b', 'a']": a dict's keys
    renders("{{ d|reverse|list }}", "['b', 'a']");
    // 'cba', '[4, 3, 2, 1]', '[1, 2, 3, 4]': a string reversed, a
    // generator or an iterator read into a list
    renders("{{ 'abc'|reverse }}", "cba");
    renders("{{ ns|select|reverse }}", "[4, 3, 2, 1]");
    renders("{{ ns|reverse|reverse }}", "[1, 2, 3, 4]");
    // '[]|T' (undefined reversed is an empty `reversed` object)
    renders(
        "{{ nosuch|reverse|list }}|{% if nosuch|reverse %}T{% endif %}",
        "[]|T",
    );
    // TypeError: 'list_reverseiterator' object is not reversible
    raises("{{ ns|reverse|last }}");
    // TypeError: object of type 'list_reverseiterator' has no len()
    raises("{{ ns|reverse|length }}");
    // TypeError: Object of type list_reverseiterator is not JSON serializable
    raises("{{ ns|reverse|tojson }}");
    // FilterArgumentError: argument must be iterable
    raises("{{ none|reverse }}");
    // '<list_reverseiterator object at 0x7f6ad5abc400>'
    let printed = render("{{ ns|reverse }}").unwrap();
    assert!(
        printed.starts_with("<list_reverseiterator object at 0x") && printed.ends_with('>'),
        "{printed}"
    );
    // '<reversed object at 0x7f1e1c7cb010>'
    let printed = render("{{ nosuch|reverse }}").unwrap();
    assert!(
        printed.starts_with("<reversed object at 0x") && printed.ends_with('>'),
        "{printed}"
    );
}
