//! The `tojson` filter as transformers defines it for chat templates:
//! Python's `json.dumps` text (its separators, `ensure_ascii`, `indent`,
//! `sort_keys`, float spelling), written from minijinja values.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{ErrorKind, State};

/// `tojson(value, indent=None, sort_keys=False, ensure_ascii=False, separators=None)`
/// writing Python's `json.dumps` text, as a plain string: transformers'
/// `tojson` returns `json.dumps`'s `str`, not jinja2's `Markup`, so a
/// `Markup` added to it escapes it (module `markup`).
pub(crate) fn tojson(
    state: &State<'_, '_>,
    value: &Value,
    kwargs: Kwargs,
) -> Result<Value, minijinja::Error> {
    let _ = state;
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_usize() {
            Some(n) => Some(" ".repeat(n.min(64))),
            None => match v.as_str() {
                Some(s) => Some(s.to_owned()),
                None => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    ));
                }
            },
        },
    };
    let separators = match separators {
        Some(v) if !v.is_none() => {
            let a = v.get_item(&Value::from(0))?;
            let b = v.get_item(&Value::from(1))?;
            match (a.as_str(), b.as_str()) {
                (Some(a), Some(b)) => Some((a.to_owned(), b.to_owned())),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ));
                }
            }
        }
        _ => None,
    };
    let options = JsonOptions::new(
        indent,
        separators,
        sort_keys.unwrap_or(false),
        ensure_ascii.unwrap_or(false),
    );
    json_text(value, &options).map(Value::from)
}

/// `value` as Python's `json.dumps` writes it with `options`.
pub(crate) fn json_text(value: &Value, options: &JsonOptions) -> Result<String, minijinja::Error> {
    let mut out = String::new();
    write_json(&mut out, value, options, 0)?;
    Ok(out)
}

/// `json.dumps`'s options: `indent` (the text of one level),
/// `separators`, `sort_keys`, `ensure_ascii`.
pub(crate) struct JsonOptions {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonOptions {
    /// Python's defaults for what is not given: `", "` between items
    /// (`","` with an indent) and `": "` after keys.
    pub(crate) fn new(
        indent: Option<String>,
        separators: Option<(String, String)>,
        sort_keys: bool,
        ensure_ascii: bool,
    ) -> Self {
        let (item_sep, key_sep) = separators.unwrap_or_else(|| {
            let item = if indent.is_some() { "," } else { ", " };
            (item.to_owned(), ": ".to_owned())
        });
        Self {
            indent,
            item_sep,
            key_sep,
            sort_keys,
            ensure_ascii,
        }
    }
}

const MAX_JSON_DEPTH: usize = 128;

fn write_json(
    out: &mut String,
    value: &Value,
    options: &JsonOptions,
    depth: usize,
) -> Result<(), minijinja::Error> {
    if depth > MAX_JSON_DEPTH {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    // Python's json refuses a generator (jinja2's `map`, `select`, ...)
    // and `reversed()`'s iterators.
    if let Some(name) = crate::generators::python_type(value) {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: Object of type {name} is not JSON serializable"),
        ));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &options.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            // A float prints as Python's repr, whole or not (`1e+16`,
            // `2.0`); an integer as its digits.
            if !value.is_integer()
                && let Ok(f) = f64::try_from(value.clone())
            {
                out.push_str(&python_float(f));
                return Ok(());
            }
            out.push_str(&value.to_string());
        }
        ValueKind::String => {
            write_json_str(out, value.as_str().unwrap_or(""), options.ensure_ascii)
        }
        ValueKind::Bytes => write_json_str(out, &value.to_string(), options.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&options.item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, options, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if options.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&options.item_sep);
                }
                newline(out, depth + 1);
                match key.as_str() {
                    Some(s) => write_json_str(out, s, options.ensure_ascii),
                    None => write_json_str(out, &key.to_string(), options.ensure_ascii),
                }
                out.push_str(&options.key_sep);
                let item = value.get_item(key)?;
                write_json(out, &item, options, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => write_json_str(out, &value.to_string(), options.ensure_ascii),
    }
    Ok(())
}

/// Python's `repr(float)` as `json.dumps` writes it: `repr` for finite
/// values, `NaN` / `Infinity` / `-Infinity` for the others.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    crate::pyrepr::python_float_repr(f)
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_floats() {
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(0.5), "0.5");
        assert_eq!(python_float(1e16), "1e+16");
        assert_eq!(python_float(1.5e-5), "1.5e-05");
        assert_eq!(python_float(123456.25), "123456.25");
    }
}
