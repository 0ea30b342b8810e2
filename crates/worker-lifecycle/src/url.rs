//! A worker's base URL, parsed once: [`WorkerUrl`].
//!
//! Every crate of the workspace, the admin routes and the command line take
//! worker URLs through this one type, so one set of rules applies
//! everywhere and a URL is parsed once per worker, not per use.
//!
//! # One spelling per address
//!
//! The same engine can be written many ways: `HTTP://Engine:80/`,
//! `http://127.1:8000`, `http://2130706433:8000`, `http://0x7f.0.0.1:8000`,
//! `http://[::ffff:127.0.0.1]:8000` and `http://localhost:8000` all reach
//! one socket (the C resolver reads IPv4 in the `inet_aton` forms). If each
//! spelling became its own worker, one engine would count as several, its
//! load would be split between them and its cache affinity with it. A
//! [`WorkerUrl`] therefore holds the canonical form:
//!
//! - the scheme and host in lower case, trailing dots of the host dropped;
//! - an IPv4 address in any `inet_aton` form (one to four parts, decimal,
//!   octal with a leading `0`, hex with `0x`) as a dotted quad;
//! - an IPv6 address in its RFC 5952 form, and an IPv4-mapped one
//!   (`::ffff:a.b.c.d`) as the IPv4 address it maps;
//! - `localhost` as `127.0.0.1` (RFC 6761: the name is loopback; an engine
//!   bound only to `::1` is written `http://[::1]:PORT`);
//! - the scheme's default port (80, 443) left out, any other port as a
//!   number without leading zeros;
//! - the path prefix without trailing `/`.
//!
//! Other host names are compared as names and never resolved: an ingress
//! can route two names on one address to two different engines.
//!
//! # Path prefixes
//!
//! An engine behind an ingress that routes by path is written with that
//! prefix, `http://gateway/engine-a`: every request path, the health probe
//! included, is sent below it (`/engine-a/v1/chat/completions`,
//! `/engine-a/health`). A prefix ending in `/v1` is refused, with a message
//! saying why: it is the base URL of an OpenAI client, and below it the
//! router's full paths would become `/v1/v1/chat/completions`.
//!
//! User info, queries, fragments and `.`/`..` segments are refused too.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

/// A worker's base URL in its canonical spelling (see the [module
/// docs](self)): scheme, host, optional port and optional path prefix.
/// Cheap to clone.
///
/// ```
/// use worker_lifecycle::WorkerUrl;
///
/// let url = WorkerUrl::parse("HTTP://LocalHost:8000/").unwrap();
/// assert_eq!(url.as_str(), "http://127.0.0.1:8000");
/// assert_eq!(url.url_for("/v1/models"), "http://127.0.0.1:8000/v1/models");
///
/// let behind_ingress = WorkerUrl::parse("http://gateway/engine-a/").unwrap();
/// assert_eq!(behind_ingress.path_prefix(), "/engine-a");
/// assert_eq!(behind_ingress.url_for("/health"), "http://gateway/engine-a/health");
///
/// let error = WorkerUrl::parse("http://engine:8000/v1").unwrap_err();
/// assert!(error.to_string().contains("without /v1"), "{error}");
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerUrl {
    /// The canonical text.
    text: std::sync::Arc<str>,
    /// Where the authority ends and the path prefix starts in `text`.
    prefix_start: usize,
    /// Where the host starts and ends in `text` (IPv6 with its brackets).
    host: (usize, usize),
    /// The port, explicit or the scheme's default.
    port: u16,
    https: bool,
}

/// A worker URL that was refused, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid worker URL {url:?}: {reason}")]
pub struct WorkerUrlError {
    url: String,
    reason: &'static str,
}

impl WorkerUrlError {
    fn new(url: &str, reason: &'static str) -> Self {
        Self {
            url: url.to_owned(),
            reason,
        }
    }

    /// The URL as given.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// What is wrong with it.
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

impl WorkerUrl {
    /// Parses `url` and stores its canonical spelling.
    pub fn parse(url: &str) -> Result<Self, WorkerUrlError> {
        let fail = |reason| WorkerUrlError::new(url, reason);
        if url.is_empty() {
            return Err(fail("the URL is empty"));
        }
        if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(fail("it contains whitespace or control characters"));
        }
        let (scheme, default_port, rest) =
            split_scheme(url).ok_or_else(|| fail("it must start with http:// or https://"))?;
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        if authority.contains('@') {
            return Err(fail(
                "user info (user:password@) is not allowed: it would travel and be logged in clear",
            ));
        }
        if tail.contains(['?', '#']) {
            return Err(fail("a query or fragment is not allowed"));
        }
        let prefix = tail.trim_end_matches('/');
        check_prefix(prefix).map_err(fail)?;
        let (host, port) = split_port(authority)
            .ok_or_else(|| fail("the port is not a number from 0 to 65535"))?;
        let host = canonical_host(host).map_err(fail)?;
        if host.is_empty() {
            return Err(fail("it has no host"));
        }
        let parsed = Self::assemble(
            scheme == "https",
            &host,
            port.unwrap_or(default_port),
            prefix,
        );
        if parsed.text.parse::<http::Uri>().is_err() {
            return Err(fail("it is not a valid URL"));
        }
        Ok(parsed)
    }

    /// The canonical URL of checked parts: `host` canonical (IPv6 in
    /// brackets), the port left out when it is the scheme's default.
    fn assemble(https: bool, host: &str, port: u16, prefix: &str) -> Self {
        let (scheme, default_port) = if https { ("https", 443) } else { ("http", 80) };
        let mut text = String::with_capacity(scheme.len() + host.len() + prefix.len() + 9);
        text.push_str(scheme);
        text.push_str("://");
        let host_start = text.len();
        text.push_str(host);
        let host = (host_start, text.len());
        if port != default_port {
            text.push(':');
            text.push_str(&port.to_string());
        }
        let prefix_start = text.len();
        text.push_str(prefix);
        Self {
            text: text.into(),
            prefix_start,
            host,
            port,
            https,
        }
    }

    /// [`parse`](Self::parse) for a client that speaks plain HTTP only:
    /// an `https` URL is refused with a message saying so, instead of
    /// becoming a worker every request to which fails.
    pub fn parse_http(url: &str) -> Result<Self, WorkerUrlError> {
        if split_scheme(url).is_none() && !url.is_empty() {
            // Not "http:// or https://": only one of them is accepted here.
            return Err(WorkerUrlError::new(url, "it must start with http://"));
        }
        let parsed = Self::parse(url)?;
        if parsed.https {
            return Err(WorkerUrlError::new(
                url,
                "https workers are not supported: the router connects to workers over plain \
                 HTTP (a private network or a sidecar terminates TLS)",
            ));
        }
        Ok(parsed)
    }

    /// The canonical URL, e.g. `http://10.0.0.7:8000` or
    /// `http://gateway/engine-a`.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The canonical URL as shared text: a clone is a reference count,
    /// not a copy (for a record that names the worker, such as a trace
    /// span's attribute).
    pub fn as_shared(&self) -> &std::sync::Arc<str> {
        &self.text
    }

    /// Whether the scheme is `https`.
    pub fn is_https(&self) -> bool {
        self.https
    }

    /// The host, without IPv6 brackets.
    pub fn host(&self) -> &str {
        let host = self.bracketed_host();
        host.strip_prefix('[')
            .and_then(|inner| inner.strip_suffix(']'))
            .unwrap_or(host)
    }

    /// The host as written in the URL (IPv6 in brackets).
    fn bracketed_host(&self) -> &str {
        &self.text[self.host.0..self.host.1]
    }

    /// The port: explicit, or 80/443 from the scheme.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `host:port` as a connection is addressed, IPv6 in brackets, the
    /// port always written.
    pub fn host_port(&self) -> String {
        format!("{}:{}", self.bracketed_host(), self.port)
    }

    /// The path prefix (`/engine-a`), or `""` for an engine at the root.
    pub fn path_prefix(&self) -> &str {
        &self.text[self.prefix_start..]
    }

    /// The URL of `path` on this worker: the prefix, then `path` (a path
    /// starting with `/`, with its query if any).
    pub fn url_for(&self, path: &str) -> String {
        let mut url = String::with_capacity(self.text.len() + path.len() + 1);
        url.push_str(&self.text);
        if !path.starts_with('/') {
            url.push('/');
        }
        url.push_str(path);
        url
    }

    /// The same host with another port and no prefix: a side server of the
    /// engine, such as a Mooncake bootstrap server.
    pub fn with_port(&self, port: u16) -> Self {
        Self::assemble(self.https, self.bracketed_host(), port, "")
    }
}

impl fmt::Display for WorkerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for WorkerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.text, f)
    }
}

impl FromStr for WorkerUrl {
    type Err = WorkerUrlError;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        Self::parse(url)
    }
}

/// The canonical spelling of a worker URL: [`WorkerUrl::parse`] as text.
///
/// ```
/// use worker_lifecycle::url::canonical;
///
/// assert_eq!(canonical("HTTP://LocalHost:8000/").unwrap(), "http://127.0.0.1:8000");
/// assert_eq!(canonical("http://[::ffff:10.0.0.7]:80").unwrap(), "http://10.0.0.7");
/// assert!(canonical("http://host:99999").is_err());
/// ```
pub fn canonical(url: &str) -> Result<String, WorkerUrlError> {
    WorkerUrl::parse(url).map(|url| url.as_str().to_owned())
}

/// Checks a path prefix (without trailing `/`): no empty, `.` or `..`
/// segment, and not the `/v1` of an OpenAI base URL.
fn check_prefix(prefix: &str) -> Result<(), &'static str> {
    if prefix.is_empty() {
        return Ok(());
    }
    let segments = prefix.strip_prefix('/').unwrap_or(prefix).split('/');
    for segment in segments {
        if segment.is_empty() {
            return Err("the path prefix has an empty segment (`//`)");
        }
        if segment == "." || segment == ".." {
            return Err("the path prefix has a `.` or `..` segment");
        }
    }
    if prefix.ends_with("/v1") {
        return Err(
            "give the engine's base URL without /v1: the router sends each route's \
                    full path (/v1/chat/completions), which below /v1 would be /v1/v1/...",
        );
    }
    Ok(())
}

/// The scheme in lower case, its default port, and what follows `://`.
fn split_scheme(url: &str) -> Option<(&'static str, u16, &str)> {
    let (scheme, rest) = url.split_once("://")?;
    if scheme.eq_ignore_ascii_case("http") {
        Some(("http", 80, rest))
    } else if scheme.eq_ignore_ascii_case("https") {
        Some(("https", 443, rest))
    } else {
        None
    }
}

/// Splits `host[:port]` (the host may be a bracketed IPv6 address). `None`
/// when the port is not a number from 0 to 65535; an empty port is no port.
fn split_port(host_port: &str) -> Option<(&str, Option<u16>)> {
    let (host, port) = if host_port.starts_with('[') {
        let close = host_port.find(']')?;
        let (host, after) = host_port.split_at(close + 1);
        match after {
            "" => (host, ""),
            after => (host, after.strip_prefix(':')?),
        }
    } else {
        match host_port.rsplit_once(':') {
            Some((host, port)) => (host, port),
            None => (host_port, ""),
        }
    };
    if port.is_empty() {
        return Some((host, None));
    }
    if !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = port.trim_start_matches('0');
    if digits.len() > 5 {
        return None;
    }
    let port = if digits.is_empty() {
        0
    } else {
        digits.parse().ok()?
    };
    Some((host, Some(port)))
}

/// The canonical host, or why `host` is not a valid one.
fn canonical_host(host: &str) -> Result<String, &'static str> {
    if let Some(inner) = host.strip_prefix('[') {
        let inner = inner
            .strip_suffix(']')
            .ok_or("the IPv6 address must be closed with `]`")?;
        let address: Ipv6Addr = inner
            .parse()
            .map_err(|_| "the host between `[` and `]` is not a valid IPv6 address")?;
        return Ok(match address.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => format!("[{address}]"),
        });
    }
    if host.contains(':') {
        return Err("an IPv6 host must be written in brackets, as in http://[::1]:8000");
    }
    let lower = host.to_ascii_lowercase();
    let name = lower.trim_end_matches('.');
    if name == "localhost" {
        return Ok(Ipv4Addr::LOCALHOST.to_string());
    }
    match lenient_ipv4(name)? {
        Some(address) => Ok(address.to_string()),
        None => Ok(name.to_owned()),
    }
}

/// Reads `host` as the resolver's `inet_aton` does (WHATWG's IPv4 parser):
/// `Ok(None)` when it is a name (its last label is not a number), an error
/// when it looks like an address but is not a valid one.
fn lenient_ipv4(host: &str) -> Result<Option<Ipv4Addr>, &'static str> {
    let parts: Vec<&str> = host.split('.').collect();
    let Some(last) = parts.last() else {
        return Ok(None);
    };
    if ipv4_number(last).is_none() {
        return Ok(None);
    }
    const INVALID: &str = "the host looks like an IPv4 address but is not a valid one";
    if parts.len() > 4 {
        return Err(INVALID);
    }
    let mut numbers = Vec::with_capacity(parts.len());
    for part in &parts {
        numbers.push(ipv4_number(part).ok_or(INVALID)?);
    }
    let (last, leading) = numbers.split_last().ok_or(INVALID)?;
    if leading.iter().any(|&n| n > 255) {
        return Err(INVALID);
    }
    let last_bits = 8 * (5 - numbers.len() as u32);
    if last_bits < 64 && *last >= 1u64 << last_bits {
        return Err(INVALID);
    }
    let mut value = *last;
    for (index, &number) in leading.iter().enumerate() {
        value += number << (8 * (3 - index as u32));
    }
    let value = u32::try_from(value).map_err(|_| INVALID)?;
    Ok(Some(Ipv4Addr::from(value)))
}

/// One part of a lenient IPv4 address: decimal, `0x` hex or `0` octal.
fn ipv4_number(part: &str) -> Option<u64> {
    if part.is_empty() {
        return None;
    }
    let (digits, radix) =
        if let Some(hex) = part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
            (hex, 16)
        } else if part.len() > 1 && part.starts_with('0') {
            (&part[1..], 8)
        } else {
            (part, 10)
        };
    if digits.is_empty() {
        return Some(0);
    }
    if !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    // More than 2^32 in any part is invalid anyway; cap the work.
    let trimmed = digits.trim_start_matches('0');
    if trimmed.len() > 12 {
        return Some(u64::MAX);
    }
    u64::from_str_radix(digits, radix).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_of_one_loopback_engine_is_one_url() {
        for spelling in [
            "http://127.0.0.1:8000",
            "HTTP://127.0.0.1:8000/",
            "http://localhost:8000",
            "http://LocalHost.:8000",
            "http://127.1:8000",
            "http://2130706433:8000",
            "http://0x7f.0.0.1:8000",
            "http://0177.0.0.1:8000",
            "http://127.0.1:8000",
            "http://[::ffff:127.0.0.1]:8000",
            "http://[::FFFF:7f00:1]:8000",
            "http://127.0.0.1:08000",
        ] {
            assert_eq!(
                canonical(spelling).as_deref(),
                Ok("http://127.0.0.1:8000"),
                "{spelling}"
            );
        }
    }

    #[test]
    fn default_ports_case_and_trailing_slashes_are_canonical() {
        assert_eq!(
            canonical("http://Engine.Example:80/").as_deref(),
            Ok("http://engine.example")
        );
        assert_eq!(
            canonical("HTTPS://engine:443").as_deref(),
            Ok("https://engine")
        );
        assert_eq!(
            canonical("http://engine:443").as_deref(),
            Ok("http://engine:443")
        );
        assert_eq!(
            canonical("http://[2001:DB8:0:0::1]:8000//").as_deref(),
            Ok("http://[2001:db8::1]:8000")
        );
        assert_eq!(
            canonical("http://engine:8000/Engine-A/").as_deref(),
            Ok("http://engine:8000/Engine-A"),
            "the path prefix keeps its case"
        );
        assert_eq!(canonical("http://host:").as_deref(), Ok("http://host"));
    }

    #[test]
    fn parts_are_read_from_the_canonical_form() {
        let url = WorkerUrl::parse("http://[2001:DB8::1]:8000/gw/a/").unwrap();
        assert_eq!(url.host(), "2001:db8::1");
        assert_eq!(url.port(), 8000);
        assert_eq!(url.host_port(), "[2001:db8::1]:8000");
        assert_eq!(url.path_prefix(), "/gw/a");
        assert_eq!(
            url.url_for("/v1/completions?x=1"),
            "http://[2001:db8::1]:8000/gw/a/v1/completions?x=1"
        );
        let bootstrap = url.with_port(8998);
        assert_eq!(bootstrap.as_str(), "http://[2001:db8::1]:8998");
        assert_eq!(bootstrap.host(), "2001:db8::1");
        assert_eq!(bootstrap.path_prefix(), "");
        let plain = WorkerUrl::parse("https://engine").unwrap();
        assert!(plain.is_https());
        assert_eq!((plain.host(), plain.port()), ("engine", 443));
        assert_eq!(plain.host_port(), "engine:443");
        assert_eq!(plain.with_port(80).as_str(), "https://engine:80");
        assert_eq!(
            "http://a:1".parse::<WorkerUrl>().unwrap().to_string(),
            "http://a:1"
        );
    }

    #[test]
    fn prefixes_that_would_break_the_paths_are_refused_with_the_reason() {
        for (bad, says) in [
            ("http://h:8000/v1", "without /v1"),
            ("http://h:8000/gw/v1/", "without /v1"),
            ("http://h/a//b", "empty segment"),
            ("http://h/a/../b", "`..`"),
            ("http://user:pw@h:8000", "user info"),
            ("http://h:8000/?q=1", "query"),
            ("http://h:8000#top", "fragment"),
            ("http://::1:80", "brackets"),
        ] {
            let error = WorkerUrl::parse(bad).unwrap_err();
            assert!(error.to_string().contains(says), "{bad}: {error}");
            assert_eq!(error.url(), bad);
        }
        assert!(WorkerUrl::parse("http://h/v1beta").is_ok());
        let https = WorkerUrl::parse_http("https://engine").unwrap_err();
        assert!(
            https
                .to_string()
                .contains("https workers are not supported"),
            "{https}"
        );
        assert!(WorkerUrl::parse_http("http://engine").is_ok());
        // The plain-HTTP parser names the one scheme it takes.
        for other in ["ftp://engine", "engine:8000", "HTTPX://engine"] {
            let error = WorkerUrl::parse_http(other).unwrap_err().to_string();
            assert!(
                error.contains("must start with http://"),
                "{other}: {error}"
            );
            assert!(!error.contains("https://"), "{other}: {error}");
        }
        assert!(
            WorkerUrl::parse_http("")
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
    }

    #[test]
    fn names_that_end_in_a_label_are_names() {
        assert_eq!(
            canonical("http://10.0.0.1.nip.io:8000").as_deref(),
            Ok("http://10.0.0.1.nip.io:8000")
        );
        assert_eq!(
            canonical("http://0xzz:8000").as_deref(),
            Ok("http://0xzz:8000")
        );
    }

    #[test]
    fn invalid_addresses_and_ports_are_refused() {
        for bad in [
            "http://256.0.0.1:8000",
            "http://1.2.3.4.5",
            "http://4294967296",
            "http://1.16777216",
            "http://[::1:8000",
            "http://[not-v6]:8000",
            "http://[::1]x",
            "http://host:99999",
            "http://host:80a",
            "http://host:-1",
            "ftp://host",
            "http://",
            "http://:8000",
            "",
        ] {
            assert!(canonical(bad).is_err(), "{bad} was accepted");
        }
    }
}
