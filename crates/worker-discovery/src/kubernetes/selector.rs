//! Equality-based label selectors: `--selector app=vllm tier=gpu`.
//!
//! A [`Selector`] is what Kubernetes calls an equality-based selector: a
//! pod matches when it carries every `key=value` pair. It is sent to the API
//! server (`labelSelector=app=vllm,tier=gpu`), so only matching pods travel,
//! and checked again on each pod received, so a pod that no longer matches
//! is never taken for a worker even from a stale event.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// Every `key=value` pair a pod must carry. Built with [`Selector::parse`]
/// from `key=value` items (each may hold several, comma-separated).
///
/// ```
/// use std::collections::BTreeMap;
/// use worker_discovery::kubernetes::Selector;
///
/// let selector = Selector::parse(["app=vllm", "role=prefill,tier=gpu"]).unwrap();
/// assert_eq!(selector.to_string(), "app=vllm,role=prefill,tier=gpu");
///
/// let labels: BTreeMap<String, String> =
///     [("app", "vllm"), ("role", "prefill"), ("tier", "gpu"), ("x", "y")]
///         .into_iter()
///         .map(|(k, v)| (k.to_owned(), v.to_owned()))
///         .collect();
/// assert!(selector.matches(&labels));
///
/// let err = Selector::parse(["app"]).unwrap_err();
/// assert_eq!(err.to_string(), "\"app\": expected KEY=VALUE");
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    labels: BTreeMap<String, String>,
}

/// A `key=value` item that is not a valid Kubernetes label selector term.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{item:?}: {reason}")]
pub struct SelectorError {
    item: String,
    reason: String,
}

impl SelectorError {
    fn new(item: &str, reason: impl Into<String>) -> Self {
        Self {
            item: item.to_owned(),
            reason: reason.into(),
        }
    }

    /// The item refused, as given.
    pub fn item(&self) -> &str {
        &self.item
    }

    /// What is wrong with it.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl Selector {
    /// Parses `key=value` items; an item may hold several terms separated
    /// by commas. Keys and values follow Kubernetes' label syntax (a key is
    /// `[prefix/]name`, a name or value at most 63 characters of
    /// `[A-Za-z0-9_.-]` starting and ending alphanumeric; a value may be
    /// empty). A key given twice with different values is refused: no pod
    /// could match.
    pub fn parse<I, S>(items: I) -> Result<Self, SelectorError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut labels = BTreeMap::new();
        for item in items {
            let item = item.as_ref();
            for term in item.split(',') {
                let term = term.trim();
                if term.is_empty() {
                    if item.trim().is_empty() {
                        return Err(SelectorError::new(item, "expected KEY=VALUE"));
                    }
                    continue;
                }
                let (key, value) = term
                    .split_once('=')
                    .ok_or_else(|| SelectorError::new(item, "expected KEY=VALUE"))?;
                let (key, value) = (key.trim(), value.trim());
                check_key(key).map_err(|reason| SelectorError::new(item, reason))?;
                check_value(value).map_err(|reason| SelectorError::new(item, reason))?;
                if let Some(previous) = labels.insert(key.to_owned(), value.to_owned())
                    && previous != value
                {
                    return Err(SelectorError::new(
                        item,
                        format!(
                            "label {key:?} is required to be both {previous:?} and {value:?}: \
                                 no pod can match"
                        ),
                    ));
                }
            }
        }
        Ok(Self { labels })
    }

    /// Whether no term was given (such a selector matches every pod).
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The required labels.
    pub fn labels(&self) -> &BTreeMap<String, String> {
        &self.labels
    }

    /// Whether `labels` carries every required pair.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.labels
            .iter()
            .all(|(key, value)| labels.get(key) == Some(value))
    }
}

impl fmt::Display for Selector {
    /// The API server's form: `key=value,key=value`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (key, value)) in self.labels.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{key}={value}")?;
        }
        Ok(())
    }
}

impl FromStr for Selector {
    type Err = SelectorError;

    /// Parses one `key=value[,key=value…]` string.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse([s])
    }
}

fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("the label key is empty".to_owned());
    }
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        let valid = !prefix.is_empty()
            && prefix.len() <= 253
            && prefix.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !part.starts_with('-')
                    && !part.ends_with('-')
            });
        if !valid {
            return Err(format!(
                "the label key prefix {prefix:?} is not a DNS subdomain (lowercase letters, \
                 digits, '-' and '.')"
            ));
        }
    }
    check_name(name).map_err(|reason| format!("the label key {key:?} {reason}"))
}

fn check_value(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Ok(());
    }
    check_name(value).map_err(|reason| format!("the label value {value:?} {reason}"))
}

/// A label name or value: 1-63 characters of `[A-Za-z0-9_.-]`, alphanumeric
/// at both ends.
fn check_name(name: &str) -> Result<(), &'static str> {
    let bytes = name.as_bytes();
    match (bytes.first(), bytes.last()) {
        (None, _) | (_, None) => Err("has an empty name"),
        _ if bytes.len() > 63 => Err("is longer than 63 characters"),
        (Some(first), Some(last))
            if !first.is_ascii_alphanumeric() || !last.is_ascii_alphanumeric() =>
        {
            Err("must start and end with a letter or digit")
        }
        _ if !bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')) =>
        {
            Err("may hold only letters, digits, '-', '_' and '.'")
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_terms_and_renders_the_query_form() {
        let s = Selector::parse(["app=vllm", " tier = gpu ,", "example.com/pool=a"]).unwrap();
        assert_eq!(s.to_string(), "app=vllm,example.com/pool=a,tier=gpu");
        assert_eq!("app=vllm".parse::<Selector>().unwrap().labels().len(), 1);
        assert!(Selector::parse(Vec::<String>::new()).unwrap().is_empty());
        // Same pair twice is one term; an empty value is allowed.
        let s = Selector::parse(["a=1", "a=1", "b="]).unwrap();
        assert_eq!(s.to_string(), "a=1,b=");
    }

    #[test]
    fn refuses_bad_terms_with_a_reason() {
        for (item, reason) in [
            ("app", "expected KEY=VALUE"),
            ("", "expected KEY=VALUE"),
            ("=v", "the label key is empty"),
            ("app=-x", "must start and end"),
            ("app=a b", "may hold only"),
            ("Bad_/x=1", "DNS subdomain"),
            ("a/=1", "empty name"),
        ] {
            let err = Selector::parse([item]).unwrap_err();
            assert_eq!(err.item(), item);
            assert!(err.reason().contains(reason), "{item}: {err}");
        }
        let long = format!("k={}", "v".repeat(64));
        assert!(Selector::parse([long.as_str()]).is_err());
        let err = Selector::parse(["a=1", "a=2"]).unwrap_err();
        assert!(err.reason().contains("no pod can match"), "{err}");
    }

    #[test]
    fn matches_every_pair() {
        let s = Selector::parse(["a=1,b=2"]).unwrap();
        let labels = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>()
        };
        assert!(s.matches(&labels(&[("a", "1"), ("b", "2"), ("c", "3")])));
        assert!(!s.matches(&labels(&[("a", "1")])));
        assert!(!s.matches(&labels(&[("a", "1"), ("b", "3")])));
        assert!(Selector::default().matches(&labels(&[])));
    }
}
