//! Values printed as Python prints them: what `{{ value }}` writes in
//! jinja2 (`str()` of the value) for the kinds whose text differs from
//! minijinja's own: `None`, booleans, numbers, lists and dicts, whose
//! items print with `repr()` (single-quoted strings, `None`, `1e-07`).
//!
//! Templates print lists and dicts without `tojson` more often than one
//! would think (a message's content parts, tool-call arguments), and the
//! engine renders with Python, so the prompt's text must match it byte
//! for byte for the cache's block hashes to.

use std::fmt::Write as _;

use minijinja::value::{Value, ValueKind};

/// Python's `str()` of `value`, for the kinds this module prints (`None`,
/// booleans, numbers, sequences, maps); `None` for the others (strings
/// print as they are, undefined values as nothing, other objects through
/// minijinja), which the caller prints its own way.
pub(crate) fn python_str(value: &Value) -> Option<String> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number => {
            let mut out = String::new();
            write_repr(&mut out, value, 0);
            Some(out)
        }
        ValueKind::Seq | ValueKind::Map => {
            let mut out = String::with_capacity(64);
            write_repr(&mut out, value, 0);
            Some(out)
        }
        _ => None,
    }
}

/// Deeper nesting prints as Python's `[...]` for a recursive container
/// would not arise from JSON; past this the rest is elided rather than
/// recursing without bound.
const MAX_DEPTH: usize = 128;

/// Python's `repr()` of `value` appended to `out`.
fn write_repr(out: &mut String, value: &Value, depth: usize) {
    if depth > MAX_DEPTH {
        out.push_str("...");
        return;
    }
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String => write_str_repr(out, value.as_str().unwrap_or("")),
        // A generator inside a list prints as itself, unread, as Python's
        // repr of it does.
        ValueKind::Iterable if crate::generators::python_type(value).is_some() => {
            let _ = write!(out, "{value}");
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(items) = value.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &item, depth + 1);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &key, depth + 1);
                    out.push_str(": ");
                    let item = value.get_item(&key).unwrap_or_default();
                    write_repr(out, &item, depth + 1);
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// An integer as its digits; a float as Python's `repr(float)`.
fn write_number(out: &mut String, value: &Value) {
    match f64::try_from(value.clone()) {
        Ok(f) if !value.is_integer() => out.push_str(&python_float_repr(f)),
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(float)`: the shortest text that reads back the same,
/// in exponent form below 1e-4 and from 1e16 (`1e-07`, `1e+16`), else
/// with at least one decimal (`100.0`); `nan`, `inf`, `-inf`.
pub(crate) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.into();
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        let pad = if digits.len() < 2 { "0" } else { "" };
        return format!("{mantissa}e{sign}{pad}{digits}");
    }
    format!("{f:?}")
}

/// Python's `repr(str)`: single quotes unless the text holds a single
/// quote and no double quote; backslash, the quote, `\t`, `\n`, `\r`
/// escaped, other characters Python does not print as themselves as
/// `\xNN`, `\uNNNN` or `\UNNNNNNNN`.
fn write_str_repr(out: &mut String, text: &str) {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_printable(c) => out.push(c),
            c if (c as u32) <= 0xff => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) <= 0xffff => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable` for one character, without Unicode's
/// tables: control characters, the separators other than the ASCII space,
/// the format characters and private-use characters are not printable;
/// unassigned code points (which Python also escapes) are taken as
/// printable.
fn is_printable(c: char) -> bool {
    if c == ' ' {
        return true;
    }
    if c.is_control() {
        return false;
    }
    let u = c as u32;
    let separator = matches!(
        u,
        0xa0 | 0x1680 | 0x2000..=0x200a | 0x2028 | 0x2029 | 0x202f | 0x205f | 0x3000
    );
    let format = matches!(
        u,
        0xad | 0x600..=0x605
            | 0x61c
            | 0x6dd
            | 0x70f
            | 0x890
            | 0x891
            | 0x8e2
            | 0x180e
            | 0x200b..=0x200f
            | 0x202a..=0x202e
            | 0x2060..=0x2064
            | 0x2066..=0x206f
            | 0xfeff
            | 0xfff9..=0xfffb
            | 0x110bd
            | 0x110cd
            | 0x13430..=0x1343f
            | 0x1bca0..=0x1bca3
            | 0x1d173..=0x1d17a
            | 0xe0001
            | 0xe0020..=0xe007f
    );
    let private = matches!(u, 0xe000..=0xf8ff | 0xf0000..=0xffffd | 0x100000..=0x10fffd);
    !(separator || format || private)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_print_as_python_prints_them() {
        let v =
            Value::from_serialize(serde_json::json!([1, "a", null, true, 1.5e-7, {"k": "it's"}]));
        assert_eq!(
            python_str(&v).unwrap(),
            r#"[1, 'a', None, True, 1.5e-07, {'k': "it's"}]"#
        );
        assert_eq!(python_float_repr(1e16), "1e+16");
        assert_eq!(python_float_repr(2.5e-5), "2.5e-05");
        assert_eq!(python_float_repr(100.0), "100.0");
        assert_eq!(python_float_repr(f64::NAN), "nan");
        assert_eq!(python_str(&Value::from("text")), None);
        let mut out = String::new();
        write_str_repr(&mut out, "a\u{a0}b\u{7}c\u{200b}\u{1f600}");
        assert_eq!(out, "'a\\xa0b\\x07c\\u200b\u{1f600}'");
    }
}
