//! What a template's source becomes before minijinja compiles it, where
//! jinja2 as transformers runs it and minijinja differ in a way no filter
//! or setting can reach.

use std::borrow::Cow;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// The template with transformers' `{% generation %}` ... `{% endgeneration %}`
/// tags (its assistant-mask extension) turned into `{% if true %}` ...
/// `{% endif %}`, whitespace control kept: transformers renders the
/// block's body unchanged when it is not collecting masks, as vLLM calls
/// it.
pub(crate) fn generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    rewrite_statements(source, |inner| {
        let (left, body) = match inner.strip_prefix(['-', '+']) {
            Some(body) => (&inner[..1], body),
            None => ("", inner),
        };
        let (body, right) = match body.strip_suffix(['-', '+']) {
            Some(body) => (body, &inner[inner.len() - 1..]),
            None => (body, ""),
        };
        let statement = match body.trim() {
            "generation" => "if true",
            "endgeneration" => "endif",
            _ => return None,
        };
        Some(format!("{left} {statement} {right}"))
    })
}

/// `source` with the inside of each `{% ... %}` statement replaced by what
/// `rewrite` returns for it (`None`: left as written). Comments, `{% raw
/// %}` blocks and `{{ ... }}` expressions are copied unchanged, and a tag
/// ends where minijinja's lexer ends it: at its first `%}` outside string
/// literals and brackets, so a `{%` or `%}` inside a string is text.
fn rewrite_statements(source: &str, rewrite: impl Fn(&str) -> Option<String>) -> Cow<'_, str> {
    let mut out = String::with_capacity(source.len() + 256);
    let mut rest = source;
    let mut changed = false;
    while let Some(open) = rest.find('{') {
        let delimiter = rest.as_bytes().get(open + 1).copied();
        if !matches!(delimiter, Some(b'%' | b'{' | b'#')) {
            out.push_str(&rest[..=open]);
            rest = &rest[open + 1..];
            continue;
        }
        out.push_str(&rest[..open]);
        let tag = &rest[open..];
        let end = match delimiter {
            // A comment ends at the first `#}` after its opening (`{#}`
            // opens one and does not close it).
            Some(b'#') => tag[2..].find("#}").map(|at| at + 2),
            Some(b'{') => block_end(tag, b'}'),
            _ => block_end(tag, b'%'),
        };
        let Some(close) = end else {
            // Never closed: minijinja refuses it; left as written.
            out.push_str(tag);
            rest = "";
            break;
        };
        if delimiter != Some(b'%') {
            out.push_str(&tag[..close + 2]);
            rest = &tag[close + 2..];
            continue;
        }
        let inner = &tag[2..close];
        let body = inner.trim_start_matches(['-', '+']).trim_start();
        if is_keyword_at(body, "raw") {
            // Copy through the matching endraw untouched.
            let end = find_endraw(tag).unwrap_or(tag.len());
            out.push_str(&tag[..end]);
            rest = &tag[end..];
            continue;
        }
        match rewrite(inner) {
            Some(rewritten) => {
                out.push_str("{%");
                out.push_str(&rewritten);
                out.push_str("%}");
                changed = true;
            }
            None => out.push_str(&tag[..close + 2]),
        }
        rest = &tag[close + 2..];
    }
    out.push_str(rest);
    if changed {
        Cow::Owned(out)
    } else {
        Cow::Borrowed(source)
    }
}

/// Where the tag or expression opening at the start of `text` (`{%` or
/// `{{`) closes: the offset of its closing `%}` or `}}` (`first` is its
/// first byte), as minijinja's lexer finds it. The search starts after the
/// opening and skips string literals (quotes with backslash escapes) and
/// anything inside brackets, braces or parentheses; `None` when the tag
/// never closes there.
fn block_end(text: &str, first: u8) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut balance = 0isize;
    let mut at = 2;
    while at < bytes.len() {
        match bytes[at] {
            quote @ (b'"' | b'\'') => {
                // Past the closing quote; an unclosed string never ends.
                at += 1;
                loop {
                    match bytes.get(at)? {
                        b'\\' => at += 2,
                        &b if b == quote => break,
                        _ => at += 1,
                    }
                }
            }
            b'}' if first == b'}' && balance == 0 && bytes.get(at + 1) == Some(&b'}') => {
                return Some(at);
            }
            b'%' if first == b'%' && balance == 0 && bytes.get(at + 1) == Some(&b'}') => {
                return Some(at);
            }
            b'(' | b'[' | b'{' => balance += 1,
            b')' | b']' | b'}' => balance -= 1,
            _ => {}
        }
        at += 1;
    }
    None
}

/// The filter [`guard_for_loops`] puts on every loop's sequence.
pub(crate) const ITERABLE_GUARD: &str = "__python_iterable";

/// Python's refusal to iterate `None`: the value itself, or the error
/// jinja2 raises (`TypeError: 'NoneType' object is not iterable`), which
/// vLLM answers with a 400. vLLM passes `tools=None` to a request without
/// tools, and templates that loop over `tools` unguarded (Hermes, Command
/// R+) refuse such a request in the engine; minijinja would loop over
/// nothing.
pub(crate) fn iterable_guard(value: Value) -> Result<Value, Error> {
    if value.kind() == ValueKind::None {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "'NoneType' object is not iterable",
        ));
    }
    Ok(value)
}

/// The template with each `{% for TARGET in SEQ ... %}` turned into
/// `{% for TARGET in (SEQ) | __python_iterable ... %}`, whitespace control,
/// a loop filter (`if ...`) and `recursive` kept, line breaks unchanged.
/// `{% raw %}` blocks and comments are left alone.
pub(crate) fn guard_for_loops(source: &str) -> Cow<'_, str> {
    if !source.contains("for") {
        return Cow::Borrowed(source);
    }
    rewrite_statements(source, guarded_for)
}

/// Whether `text` starts with the word `word` (followed by a non-word
/// character or the end).
fn is_keyword_at(text: &str, word: &str) -> bool {
    text.strip_prefix(word)
        .is_some_and(|after| !after.starts_with(|c: char| c.is_alphanumeric() || c == '_'))
}

/// The end (past its `%}`) of the `{% endraw %}` that closes the raw block
/// starting at the beginning of `tag`.
fn find_endraw(tag: &str) -> Option<usize> {
    let mut from = 2;
    while let Some(at) = tag[from..].find("{%") {
        let start = from + at;
        let close = start + 2 + tag[start + 2..].find("%}")?;
        let body = tag[start + 2..close].trim_start_matches(['-', '+']).trim();
        let body = body.trim_end_matches(['-', '+']).trim_end();
        if body == "endraw" {
            return Some(close + 2);
        }
        // Raw text is not lexed: the next `{%` may start inside this one.
        from = start + 2;
    }
    None
}

/// The inside of a `for` tag with its sequence guarded, or `None` when the
/// tag is not a `for` (or is not one this can read: it is then left as
/// written).
fn guarded_for(inner: &str) -> Option<String> {
    let lead = inner.len() - inner.trim_start_matches(['-', '+']).len();
    let after_marker = &inner[lead..];
    let body_start = lead + (after_marker.len() - after_marker.trim_start().len());
    if !is_keyword_at(&inner[body_start..], "for") {
        return None;
    }
    let words = top_level_words(inner, body_start + 3);
    let seq_start = words
        .iter()
        .find(|(_, w)| *w == "in")
        .map(|(at, _)| at + 2)?;
    let seq_end = words
        .iter()
        .filter(|(at, _)| *at > seq_start)
        .find(|(_, w)| *w == "if" || *w == "recursive")
        .map(|(at, _)| *at)
        .unwrap_or_else(|| {
            let trimmed = inner.trim_end_matches(['-', '+']);
            trimmed.len()
        });
    let sequence = inner[seq_start..seq_end].trim();
    if sequence.is_empty() {
        return None;
    }
    let mut out = String::with_capacity(inner.len() + 32);
    out.push_str(&inner[..seq_start]);
    out.push_str(" (");
    out.push_str(sequence);
    out.push_str(") | ");
    out.push_str(ITERABLE_GUARD);
    out.push(' ');
    out.push_str(&inner[seq_end..]);
    Some(out)
}

/// The words (identifier-like runs) of `text` from `from` on that stand
/// outside brackets and string literals, with their byte offsets.
fn top_level_words(text: &str, from: usize) -> Vec<(usize, &str)> {
    let bytes = text.as_bytes();
    let mut words = Vec::new();
    let (mut depth, mut at) = (0usize, from);
    while at < bytes.len() {
        match bytes[at] {
            quote @ (b'\'' | b'"') => {
                at += 1;
                while at < bytes.len() && bytes[at] != quote {
                    at += if bytes[at] == b'\\' { 2 } else { 1 };
                }
                at += 1;
            }
            b'(' | b'[' | b'{' => {
                depth += 1;
                at += 1;
            }
            b')' | b']' | b'}' => {
                depth = depth.saturating_sub(1);
                at += 1;
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = at;
                while at < bytes.len() && (bytes[at].is_ascii_alphanumeric() || bytes[at] == b'_') {
                    at += 1;
                }
                if depth == 0 {
                    words.push((start, &text[start..at]));
                }
            }
            c if c.is_ascii_digit() => {
                while at < bytes.len()
                    && (bytes[at].is_ascii_alphanumeric() || bytes[at] == b'_' || bytes[at] == b'.')
                {
                    at += 1;
                }
            }
            _ => at += 1,
        }
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn for_loops_get_their_sequence_guarded() {
        let cases = [
            (
                "{% for t in tools %}x{% endfor %}",
                "{% for t in (tools) | __python_iterable %}x{% endfor %}",
            ),
            (
                "{%- for m in messages[1:] if m.role != 'system' -%}",
                "{%- for m in (messages[1:]) | __python_iterable if m.role != 'system' -%}",
            ),
            (
                "{% for k, v in d.items() recursive %}",
                "{% for k, v in (d.items()) | __python_iterable recursive %}",
            ),
            (
                "{% for x in ['if', \"in\"] + more %}",
                "{% for x in (['if', \"in\"] + more) | __python_iterable %}",
            ),
            (
                "{%+ for i in range(3) +%}",
                "{%+ for i in (range(3)) | __python_iterable +%}",
            ),
        ];
        for (source, want) in cases {
            assert_eq!(guard_for_loops(source), want, "{source}");
        }
    }

    #[test]
    fn raw_blocks_comments_and_other_tags_are_left_alone() {
        for source in [
            "{% raw %}{% for x in y %}{% endraw %}",
            "{# {% for x in y %} #}",
            "{% if format %}{{ for_each }}{% endif %}",
            "{% set forward = 1 %}",
        ] {
            assert_eq!(guard_for_loops(source), source);
        }
    }

    /// `{%}` and `{#}` open a tag without closing it (minijinja's lexer
    /// looks for the close after the opening); the rewrites read them so,
    /// and never slice inside them (the fuzz target found `{%}` panicking
    /// both walkers).
    #[test]
    fn an_opening_that_overlaps_its_close_closes_nothing() {
        for (source, want) in [
            // The first tag runs to the first `%}` after `{%`: a syntax
            // error for minijinja, left as written.
            (
                "{%} {% for x in y %}x{% endfor %}",
                "{%} {% for x in y %}x{% endfor %}",
            ),
            // The `}` is a closing brace to the lexer: the tag never ends.
            (
                "{%} %}{% for x in y %}x{% endfor %}",
                "{%} %}{% for x in y %}x{% endfor %}",
            ),
            ("{#} {% for x in y %} #}", "{#} {% for x in y %} #}"),
            ("{% raw %}{%}{% endraw %}", "{% raw %}{%}{% endraw %}"),
            ("{%}", "{%}"),
        ] {
            assert_eq!(guard_for_loops(source), want, "{source}");
        }
        assert_eq!(
            generation_tags("{#}#}{% generation %}a{% endgeneration %}{%}"),
            "{#}#}{% if true %}a{% endif %}{%}"
        );
    }

    /// A tag ends at its first `%}` outside strings and brackets, as
    /// minijinja lexes it, so tags written inside a string literal or an
    /// expression are text (the fuzz target found a `{% for %}` inside a
    /// `set` string rewritten: the rendering then printed the guard).
    #[test]
    fn tags_inside_strings_and_expressions_are_text() {
        for source in [
            r#"{% set s = "a %} {% for x in y %} b" %}{{ s }}"#,
            r#"{% set s = 'it\'s %}{% for x in y %}' %}"#,
            "{{ '{% for x in y %}' }}",
            "{{ {'a': {'b': '%}'}} }}{{ \"}}{% for x in y %}\" }}",
            "{# {% for x in y %} #}{#} {% for x in y %} #}",
            "{% raw %}{%{% endraw %}",
        ] {
            assert_eq!(guard_for_loops(source), source, "{source}");
        }
        for (source, want) in [
            (
                r#"{% set s = "%}" %}{% for x in y %}"#,
                r#"{% set s = "%}" %}{% for x in (y) | __python_iterable %}"#,
            ),
            (
                "{% for x in {'a': 1} %}{{ x }}{% endfor %}",
                "{% for x in ({'a': 1}) | __python_iterable %}{{ x }}{% endfor %}",
            ),
            (
                "{% raw %}{%{% endraw %}{% for x in y %}",
                "{% raw %}{%{% endraw %}{% for x in (y) | __python_iterable %}",
            ),
        ] {
            assert_eq!(guard_for_loops(source), want, "{source}");
        }
    }

    #[test]
    fn only_none_is_refused() {
        assert!(iterable_guard(Value::from(())).is_err());
        for value in [Value::from(vec![1]), Value::from("ab"), Value::UNDEFINED] {
            assert!(iterable_guard(value).is_ok());
        }
    }
}
