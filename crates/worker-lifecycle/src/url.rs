//! One spelling per worker address.
//!
//! The same engine can be written many ways: `HTTP://Engine:80/`,
//! `http://127.1:8000`, `http://2130706433:8000`, `http://0x7f.0.0.1:8000`,
//! `http://[::ffff:127.0.0.1]:8000` and `http://localhost:8000` all reach
//! one socket (the C resolver reads IPv4 in the `inet_aton` forms). If each
//! spelling became its own worker, one engine would count as several, its
//! load would be split between them and its cache affinity with it. An
//! [`Endpoint`](crate::Endpoint) therefore stores the canonical form:
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
//! - the path without trailing `/`.
//!
//! Other host names are compared as names and never resolved: an ingress
//! can route two names on one address to two different engines.

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::worker::EndpointError;

/// The canonical spelling of a worker URL (see the [module docs](self)):
/// what [`Endpoint::new`](crate::Endpoint::new) stores.
///
/// ```
/// use worker_lifecycle::url::canonical;
///
/// assert_eq!(canonical("HTTP://LocalHost:8000/").unwrap(), "http://127.0.0.1:8000");
/// assert_eq!(canonical("http://[::ffff:10.0.0.7]:80").unwrap(), "http://10.0.0.7");
/// assert!(canonical("http://host:99999").is_err());
/// ```
pub fn canonical(url: &str) -> Result<String, EndpointError> {
    if url.is_empty() {
        return Err(EndpointError::Empty);
    }
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(EndpointError::BadCharacter(url.to_owned()));
    }
    let (scheme, default_port, rest) = split_scheme(url)?;
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    // User info is kept as written; only the host and port are canonical.
    let (user_info, host_port) = match authority.rsplit_once('@') {
        Some((user, host_port)) => (Some(user), host_port),
        None => (None, authority),
    };
    let (host, port) = split_port(host_port).ok_or_else(|| EndpointError::Port(url.to_owned()))?;
    let host = canonical_host(host).map_err(|why| EndpointError::Host {
        url: url.to_owned(),
        why,
    })?;
    if host.is_empty() {
        return Err(EndpointError::NoHost(url.to_owned()));
    }
    let mut out = String::with_capacity(url.len());
    out.push_str(scheme);
    out.push_str("://");
    if let Some(user) = user_info {
        out.push_str(user);
        out.push('@');
    }
    out.push_str(&host);
    if let Some(port) = port.filter(|&port| port != default_port) {
        out.push(':');
        out.push_str(&port.to_string());
    }
    out.push_str(tail.trim_end_matches('/'));
    Ok(out)
}

/// The scheme in lower case, its default port, and what follows `://`.
fn split_scheme(url: &str) -> Result<(&'static str, u16, &str), EndpointError> {
    let scheme_error = || EndpointError::Scheme(url.to_owned());
    let (scheme, rest) = url.split_once("://").ok_or_else(scheme_error)?;
    if scheme.eq_ignore_ascii_case("http") {
        Ok(("http", 80, rest))
    } else if scheme.eq_ignore_ascii_case("https") {
        Ok(("https", 443, rest))
    } else {
        Err(scheme_error())
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
            .ok_or("an IPv6 address must be closed with `]`")?;
        let address: Ipv6Addr = inner
            .parse()
            .map_err(|_| "not a valid IPv6 address between `[` and `]`")?;
        return Ok(match address.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => format!("[{address}]"),
        });
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
    const INVALID: &str = "looks like an IPv4 address but is not a valid one";
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
            canonical("http://engine:8000/V1/").as_deref(),
            Ok("http://engine:8000/V1"),
            "the path keeps its case"
        );
        assert_eq!(canonical("http://host:").as_deref(), Ok("http://host"));
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
