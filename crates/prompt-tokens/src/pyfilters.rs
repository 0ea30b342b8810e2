//! Filters, tests and string methods as jinja2 and Python define them,
//! where minijinja has none or another meaning: what real chat templates
//! call and the engine renders with jinja2.
//!
//! - filters `string` and `trim` (Python's `str()` of the value, so a list
//!   or dict prints as Python prints it, not as JSON; `trim` then strips
//!   what `str.strip` strips), `round` (Python's rounding: the float's exact value, ties to
//!   even), `title` (jinja2's: a word starts after whitespace, `-`, `(`,
//!   `{`, `[` or `<`), `center`, `truncate`, `wordcount`, `striptags`,
//!   `urlencode`;
//! - tests `lower` and `upper` (`str.islower()` / `str.isupper()`: every
//!   cased character in that case and at least one), and `iterable`
//!   (Python's `iter()` succeeds: `none`, numbers and booleans are not
//!   iterable, where minijinja iterates `none` as an empty sequence; an
//!   undefined value is, as jinja2's `Undefined` is);
//! - string methods `rsplit`, `swapcase`, `zfill`, before minijinja's
//!   Python-compatibility callback answers the others.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};

/// Registers this module's filters, tests and methods on `env`.
pub(crate) fn register(env: &mut Environment<'_>) {
    env.add_filter("string", string);
    env.add_filter("trim", trim);
    env.add_filter("round", round);
    env.add_filter("title", title);
    env.add_filter("center", center);
    env.add_filter("truncate", truncate);
    env.add_filter("wordcount", wordcount);
    env.add_filter("striptags", striptags);
    env.add_filter("urlencode", urlencode);
    env.add_test("lower", |s: &str| {
        is_cased(s, char::is_lowercase, char::is_uppercase)
    });
    env.add_test("upper", |s: &str| {
        is_cased(s, char::is_uppercase, char::is_lowercase)
    });
    env.add_test("iterable", is_iterable);
    env.set_unknown_method_callback(unknown_method);
}

/// jinja2's `iterable` test: whether Python's `iter()` accepts the value.
/// Real templates guard `tools | length` with `tools is iterable`, and
/// vLLM passes `None` for a request without tools.
pub(crate) fn is_iterable(value: &Value) -> bool {
    match value.kind() {
        ValueKind::None | ValueKind::Number | ValueKind::Bool => false,
        ValueKind::Undefined => true,
        _ => value.try_iter().is_ok(),
    }
}

fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, message.into())
}

/// Python's `str()` of `value`: strings as they are, None, booleans,
/// numbers, lists and dicts as `pyrepr` prints them.
pub(crate) fn python_text(value: &Value) -> String {
    match value.as_str() {
        Some(text) => text.to_owned(),
        None => crate::pyrepr::python_str(value).unwrap_or_else(|| value.to_string()),
    }
}

/// jinja2's `string` filter (`soft_str`): a string stays as it is (safe
/// or not), anything else becomes its Python `str()`.
fn string(value: Value) -> Value {
    if value.kind() == ValueKind::String {
        return value;
    }
    Value::from(python_text(&value))
}

/// jinja2's `trim(value, chars=None)`: `str(value).strip(chars)`, where no
/// `chars` strips what Python counts as whitespace.
fn trim(value: &Value, chars: Option<&str>) -> String {
    let text = python_text(value);
    match chars {
        Some(chars) => text.trim_matches(|c| chars.contains(c)).to_owned(),
        None => crate::template::python_strip(&text).to_owned(),
    }
}

/// jinja2's `round(value, precision=0, method='common')`: a float, rounded
/// as Python's `round` rounds (the binary value's exact decimal expansion,
/// ties to even), or up (`ceil`) or down (`floor`).
fn round(value: Value, precision: Option<i32>, method: Option<&str>) -> Result<Value, Error> {
    let x = f64::try_from(value).map_err(|_| invalid("round: the value must be a number"))?;
    let precision = precision.unwrap_or(0);
    let rounded = match method.unwrap_or("common") {
        "common" => {
            if precision >= 0 {
                // Rust formats a float from its exact value, ties to even:
                // what Python's round does.
                let digits = precision.min(300) as usize;
                format!("{x:.digits$}").parse::<f64>().unwrap_or(x)
            } else {
                let scale = 10f64.powi(-precision);
                (x / scale).round_ties_even() * scale
            }
        }
        method @ ("ceil" | "floor") => {
            let scale = 10f64.powi(precision);
            let scaled = x * scale;
            let whole = if method == "ceil" {
                scaled.ceil()
            } else {
                scaled.floor()
            };
            whole / scale
        }
        other => {
            return Err(invalid(format!(
                "round: method must be 'common', 'ceil' or 'floor', not {other:?}"
            )));
        }
    };
    Ok(Value::from(rounded))
}

/// jinja2's `title`: each word's first character upper-cased, the rest
/// lower-cased, where a word begins after a run of whitespace, `-`, `(`,
/// `{`, `[` or `<`.
fn title(text: &str) -> String {
    let boundary = |c: char| c.is_whitespace() || matches!(c, '-' | '(' | '{' | '[' | '<');
    let mut out = String::with_capacity(text.len());
    let mut at_start = true;
    for c in text.chars() {
        if boundary(c) {
            out.push(c);
            at_start = true;
        } else if at_start {
            out.extend(c.to_uppercase());
            at_start = false;
        } else {
            out.extend(c.to_lowercase());
        }
    }
    out
}

/// `str.islower()` / `str.isupper()`: at least one cased character, and
/// none of the other case.
fn is_cased(text: &str, this: fn(char) -> bool, other: fn(char) -> bool) -> bool {
    let mut any = false;
    for c in text.chars() {
        if other(c) {
            return false;
        }
        any |= this(c);
    }
    any
}

/// jinja2's `center(width=80)`: Python's `str.center` (the odd space on
/// the right when the text's length is odd... as Python places it).
fn center(text: &str, width: Option<usize>) -> String {
    let width = width.unwrap_or(80).min(1 << 20);
    let len = text.chars().count();
    if width <= len {
        return text.to_owned();
    }
    let pad = width - len;
    // CPython: left = pad / 2 + (pad & width & 1).
    let left = pad / 2 + (pad & width & 1);
    let right = pad - left;
    format!("{}{text}{}", " ".repeat(left), " ".repeat(right))
}

/// jinja2's `truncate(length=255, killwords=False, end='...', leeway=0)`
/// as chat templates get it (the environment's default leeway is 5: a
/// text at most `length + 5` long is kept whole).
fn truncate(text: &str, length: Option<usize>, kwargs: Kwargs) -> Result<String, Error> {
    let length = length.unwrap_or(255);
    let killwords: bool = kwargs.get::<Option<bool>>("killwords")?.unwrap_or(false);
    let end: String = kwargs
        .get::<Option<String>>("end")?
        .unwrap_or_else(|| "...".to_owned());
    let leeway: usize = kwargs.get::<Option<usize>>("leeway")?.unwrap_or(5);
    kwargs.assert_all_used()?;
    let chars: Vec<char> = text.chars().collect();
    let end_len = end.chars().count();
    if length < end_len {
        return Err(invalid(
            "truncate: length must be at least the end's length",
        ));
    }
    if chars.len() <= length + leeway {
        return Ok(text.to_owned());
    }
    let kept: String = chars[..length - end_len].iter().collect();
    if killwords {
        return Ok(kept + &end);
    }
    // Drop the last, cut word: Python's rsplit(" ", 1)[0].
    let kept = match kept.rsplit_once(' ') {
        Some((head, _)) => head.to_owned(),
        None => kept,
    };
    Ok(kept + &end)
}

/// jinja2's `wordcount`: the matches of `\w+`.
fn wordcount(text: &str) -> usize {
    let word = |c: char| c.is_alphanumeric() || c == '_';
    let mut count = 0;
    let mut in_word = false;
    for c in text.chars() {
        let w = word(c);
        if w && !in_word {
            count += 1;
        }
        in_word = w;
    }
    count
}

/// jinja2's `striptags`: SGML/XML tags and comments removed, runs of
/// whitespace joined to one space, the ends stripped (and entities
/// unescaped, as Markup.striptags does, for the five XML ones).
fn striptags(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find('<') {
        out.push_str(&rest[..open]);
        let tail = &rest[open..];
        let close = if tail.starts_with("<!--") {
            tail.find("-->").map(|i| i + 3)
        } else {
            tail.find('>').map(|i| i + 1)
        };
        match close {
            Some(close) => rest = &tail[close..],
            None => {
                out.push_str(tail);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    let joined = out.split_whitespace().collect::<Vec<_>>().join(" ");
    joined
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

/// jinja2's `urlencode` of a string: UTF-8 bytes percent-encoded, all but
/// letters, digits, `_.-~` and `/`.
fn urlencode(value: Value) -> Result<String, Error> {
    let text = match value.as_str() {
        Some(s) => s.to_owned(),
        None if value.kind() == ValueKind::Map || value.kind() == ValueKind::Seq => {
            return Err(invalid("urlencode: only strings are supported"));
        }
        None => value.to_string(),
    };
    let mut out = String::with_capacity(text.len() * 3);
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    Ok(out)
}

/// String methods minijinja lacks, then minijinja's Python-compatibility
/// callback for the rest.
fn unknown_method(
    state: &State<'_, '_>,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(text) = value.as_str() {
        match method {
            "swapcase" if args.is_empty() => {
                let swapped: String = text
                    .chars()
                    .flat_map(|c| {
                        if c.is_uppercase() {
                            c.to_lowercase().collect::<Vec<_>>()
                        } else if c.is_lowercase() {
                            c.to_uppercase().collect::<Vec<_>>()
                        } else {
                            vec![c]
                        }
                    })
                    .collect();
                return Ok(Value::from(swapped));
            }
            "zfill" if args.len() == 1 => {
                let width = usize::try_from(args[0].clone())
                    .map_err(|_| invalid("zfill: the width must be a whole number"))?
                    .min(1 << 20);
                let len = text.chars().count();
                if width <= len {
                    return Ok(Value::from(text));
                }
                let zeros = "0".repeat(width - len);
                let out = match text.strip_prefix(['-', '+']) {
                    Some(digits) => format!("{}{zeros}{digits}", &text[..1]),
                    None => format!("{zeros}{text}"),
                };
                return Ok(Value::from(out));
            }
            "rsplit" if args.len() <= 2 => return rsplit(text, args),
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Python's `str.rsplit(sep=None, maxsplit=-1)`.
fn rsplit(text: &str, args: &[Value]) -> Result<Value, Error> {
    let sep = match args.first() {
        Some(v) if v.is_none() => None,
        Some(v) => Some(
            v.as_str()
                .ok_or_else(|| invalid("rsplit: the separator must be a string"))?
                .to_owned(),
        ),
        None => None,
    };
    let maxsplit = match args.get(1) {
        Some(v) => i64::try_from(v.clone())
            .map_err(|_| invalid("rsplit: maxsplit must be a whole number"))?,
        None => -1,
    };
    let limit = if maxsplit < 0 {
        usize::MAX
    } else {
        maxsplit as usize
    };
    let mut parts: Vec<String> = match &sep {
        Some(sep) if sep.is_empty() => return Err(invalid("rsplit: empty separator")),
        Some(sep) => {
            let mut parts = Vec::new();
            let mut rest = text;
            while parts.len() < limit {
                match rest.rfind(sep.as_str()) {
                    Some(at) => {
                        parts.push(rest[at + sep.len()..].to_owned());
                        rest = &rest[..at];
                    }
                    None => break,
                }
            }
            parts.push(rest.to_owned());
            parts
        }
        None => {
            let mut parts = Vec::new();
            let mut rest = text.trim_end();
            while !rest.is_empty() && parts.len() < limit {
                match rest.rfind(char::is_whitespace) {
                    Some(at) => {
                        let c = rest[at..].chars().next().map_or(1, char::len_utf8);
                        parts.push(rest[at + c..].to_owned());
                        rest = rest[..at].trim_end();
                    }
                    None => {
                        parts.push(rest.to_owned());
                        rest = "";
                    }
                }
            }
            if !rest.is_empty() {
                parts.push(rest.to_owned());
            }
            parts
        }
    };
    parts.reverse();
    Ok(Value::from(parts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_semantics() {
        assert_eq!(title("a,b,c a"), "A,b,c A");
        assert_eq!(center("ab", Some(7)), "   ab  ");
        assert_eq!(center("abc", Some(6)), " abc  ");
        assert_eq!(wordcount("one two  three"), 3);
        assert_eq!(striptags("<b>bold</b>  and <i>x</i>"), "bold and x");
        assert!(is_cased("abc!", char::is_lowercase, char::is_uppercase));
        assert!(!is_cased("!!", char::is_lowercase, char::is_uppercase));
        let r = |x: f64, p| f64::try_from(round(Value::from(x), Some(p), None).unwrap()).unwrap();
        assert_eq!(r(2.5, 0), 2.0);
        assert_eq!(r(3.5, 0), 4.0);
        assert_eq!(r(2.675, 2), 2.67);
        assert_eq!(r(1250.0, -2), 1200.0);
    }
}
