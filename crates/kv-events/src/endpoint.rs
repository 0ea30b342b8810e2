//! The address of a ZMQ socket the router connects to: [`ZmqEndpoint`],
//! `tcp://HOST:PORT`, the one parser of such addresses in the workspace.
//!
//! # Why one strict parser
//!
//! Endpoints reach the router from its operator (the command line, a config
//! file) and from engines: a registration names the KV event endpoints the
//! router will dial, and an engine is not trusted. Every path parses with
//! the same rules, so an address refused on one path is refused on all and
//! a log line or an answer gives the same reason. Checked in this order,
//! each refusal its own [`ZmqEndpointError`]:
//!
//! - at most [`ZmqEndpoint::MAX_LEN`] bytes, not empty;
//! - no whitespace or control character (nothing that could end a header
//!   line or a log line), no user info (`user@`), and nothing outside the
//!   characters of a host name, an IP literal and a port (so no zone id,
//!   no `*` wildcard, no query);
//! - the `tcp://` transport: `ipc://` and `inproc://` are local to the
//!   engine's machine or process, never an engine's address for a router;
//! - then `HOST:PORT`: an IPv6 address in brackets and valid, a name
//!   without brackets, of at most 253 bytes (RFC 1035: longer names do not
//!   resolve) and not only dots; no path; the port written, a number from
//!   1 to 65535 (0 is not a port anyone listens on).
//!
//! # What it does not do
//!
//! It keeps the host as written: it resolves nothing and picks no
//! canonical spelling. Spelling is the job of worker-lifecycle's
//! `WorkerUrl`, which worker-discovery applies to the endpoints an engine
//! announces, so that the address its allow-list checked is the text that
//! is dialled. A wildcard (`tcp://*:5557`) is how an engine *binds*; a
//! router cannot connect to it, so it is refused here.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

/// How much of a refused port an error quotes.
const QUOTED_CHARS: usize = 64;

/// The longest host name accepted, in bytes (RFC 1035's 255 octets on the
/// wire are 253 characters of text).
const MAX_NAME_LEN: usize = 253;

/// A validated `tcp://HOST:PORT` ZMQ endpoint: what a router connects its
/// SUB and DEALER sockets to. See the [module docs](self) for the rules.
///
/// Displays as `tcp://HOST:PORT` (an IPv6 host in brackets, the port
/// without leading zeros), which parses back to the same endpoint.
///
/// ```
/// use kv_events::ZmqEndpoint;
///
/// let endpoint: ZmqEndpoint = "tcp://10.0.0.5:5557".parse().unwrap();
/// assert_eq!((endpoint.host(), endpoint.port()), ("10.0.0.5", 5557));
/// assert_eq!(endpoint.to_string(), "tcp://10.0.0.5:5557");
///
/// let v6: ZmqEndpoint = "tcp://[::1]:5558".parse().unwrap();
/// assert_eq!(v6.host(), "::1");
/// assert_eq!(v6.host_port(), "[::1]:5558");
///
/// for bad in ["10.0.0.5:5557", "tcp://*:5557", "tcp://h:0", "tcp://u@h:1", "tcp://h:1\r\n"] {
///     assert!(bad.parse::<ZmqEndpoint>().is_err(), "{bad}");
/// }
/// let error = "tcp://10.0.0.5".parse::<ZmqEndpoint>().unwrap_err();
/// assert_eq!(error.to_string(), "it has no :PORT");
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ZmqEndpoint {
    /// As written, without the brackets of an IPv6 address.
    host: Box<str>,
    /// 1 to 65535.
    port: u16,
}

/// Why a text is not a [`ZmqEndpoint`]. The message is the reason alone
/// (`it has no :PORT`), for a caller to put after the field or flag it
/// read; it quotes at most 64 characters of the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ZmqEndpointError {
    /// The text is empty.
    #[error("it is empty")]
    Empty,
    /// The text is longer than [`ZmqEndpoint::MAX_LEN`] bytes.
    #[error("it is longer than {max} bytes")]
    TooLong {
        /// The limit.
        max: usize,
    },
    /// The text holds whitespace or a control character.
    #[error("it contains whitespace or a control character ({0:?})")]
    Whitespace(char),
    /// The text holds user info (`user@host`).
    #[error("user info (user@) is not allowed")]
    UserInfo,
    /// The text holds a character that no host, IP literal or port has
    /// (`*`, `%`, `?`, non-ASCII, ...).
    #[error("it contains {0:?}, not allowed in an address")]
    Character(char),
    /// The text does not start with `tcp://`.
    #[error("it must be tcp://HOST:PORT")]
    Scheme,
    /// An IPv6 address opens with `[` and never closes.
    #[error("an IPv6 address lacks its `]`")]
    UnclosedBracket,
    /// No `:PORT` follows the host.
    #[error("it has no :PORT")]
    NoPort,
    /// An IPv6 address is written without brackets, so its last group
    /// cannot be told from the port.
    #[error("an IPv6 address must be written in brackets")]
    UnbracketedIpv6,
    /// The host is followed by a path.
    #[error("a path is not allowed")]
    Path,
    /// The port is not a number from 1 to 65535.
    #[error("the port {0:?} is not a number from 1 to 65535")]
    InvalidPort(String),
    /// The port is 0.
    #[error("port 0 is not a port an engine listens on (1-65535)")]
    PortZero,
    /// There is no host before the `:PORT` (or only dots).
    #[error("it has no host")]
    NoHost,
    /// The text between `[` and `]` is not an IPv6 address.
    #[error("the host between `[` and `]` is not a valid IPv6 address")]
    InvalidIpv6,
    /// A host name holds `[` or `]`, which only enclose an IPv6 address.
    #[error("`[` and `]` may only enclose an IPv6 address")]
    BracketInName,
    /// A host name is longer than a DNS name can be.
    #[error("the host name is longer than 253 bytes")]
    NameTooLong,
}

impl ZmqEndpoint {
    /// The longest text [`parse`](Self::parse) (and
    /// [`parse_address`](Self::parse_address)) accepts, in bytes: a DNS name
    /// (at most 253) in brackets, a colon and a port behind `tcp://`, with
    /// room to spare. Checked before anything else, so a hostile length
    /// costs nothing.
    pub const MAX_LEN: usize = 300;

    /// Parses `tcp://HOST:PORT`.
    ///
    /// # Errors
    ///
    /// The first rule of the [module docs](self) that `text` breaks.
    pub fn parse(text: &str) -> Result<Self, ZmqEndpointError> {
        check_address_text(text)?;
        let address = text
            .strip_prefix("tcp://")
            .ok_or(ZmqEndpointError::Scheme)?;
        Self::parse_host_port(address)
    }

    /// Parses `HOST:PORT` without the transport: a ZMQ address as vLLM's
    /// registrations write one (`zmq_address`), and the same rules for any
    /// `host:port` (worker-discovery's announced addresses).
    ///
    /// ```
    /// use kv_events::ZmqEndpoint;
    ///
    /// let address = ZmqEndpoint::parse_address("10.0.0.1:21001").unwrap();
    /// assert_eq!(address.to_string(), "tcp://10.0.0.1:21001");
    /// assert!(ZmqEndpoint::parse_address("tcp://10.0.0.1:21001").is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// As [`parse`](Self::parse), less the transport.
    pub fn parse_address(text: &str) -> Result<Self, ZmqEndpointError> {
        check_address_text(text)?;
        Self::parse_host_port(text)
    }

    /// The endpoint at `host` (an IPv6 address without brackets) and
    /// `port`, under the same rules as a parsed one.
    ///
    /// ```
    /// use kv_events::ZmqEndpoint;
    ///
    /// let endpoint = ZmqEndpoint::new("2001:db8::1", 5557).unwrap();
    /// assert_eq!(endpoint.to_string(), "tcp://[2001:db8::1]:5557");
    /// assert!(ZmqEndpoint::new("10.0.0.1", 0).is_err());
    /// assert!(ZmqEndpoint::new("h/x", 1).is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// When `host` or `port` breaks a rule of the [module docs](self).
    pub fn new(host: &str, port: u16) -> Result<Self, ZmqEndpointError> {
        // Through the parser, so that no host it would refuse gets in.
        let text = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        Self::parse_address(&text)
    }

    /// The host as written, without the brackets of an IPv6 address.
    #[must_use]
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port, never 0.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `HOST:PORT`, an IPv6 host in brackets: the endpoint without its
    /// transport.
    #[must_use]
    pub fn host_port(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The socket address, when the host is an IP address (a dotted-quad
    /// IPv4 or an IPv6 address), as libzmq reports a bound endpoint;
    /// `None` for a name.
    ///
    /// ```
    /// use kv_events::ZmqEndpoint;
    ///
    /// let bound: ZmqEndpoint = "tcp://127.0.0.1:40123".parse().unwrap();
    /// assert_eq!(bound.socket_addr(), Some("127.0.0.1:40123".parse().unwrap()));
    /// let named: ZmqEndpoint = "tcp://engine-a:5557".parse().unwrap();
    /// assert_eq!(named.socket_addr(), None);
    /// ```
    #[must_use]
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        let ip = if self.host.contains(':') {
            IpAddr::V6(self.host.parse::<Ipv6Addr>().ok()?)
        } else {
            IpAddr::V4(self.host.parse::<Ipv4Addr>().ok()?)
        };
        Some(SocketAddr::new(ip, self.port))
    }

    /// `HOST:PORT` of a text whose length and characters were checked.
    fn parse_host_port(text: &str) -> Result<Self, ZmqEndpointError> {
        let (host, port) = if let Some(bracketed) = text.strip_prefix('[') {
            let close = bracketed
                .find(']')
                .ok_or(ZmqEndpointError::UnclosedBracket)?;
            let (inner, after) = bracketed.split_at(close);
            let port = after[1..]
                .strip_prefix(':')
                .ok_or(ZmqEndpointError::NoPort)?;
            (inner, port)
        } else {
            let (host, port) = text.rsplit_once(':').ok_or(ZmqEndpointError::NoPort)?;
            if host.contains(':') {
                return Err(ZmqEndpointError::UnbracketedIpv6);
            }
            (host, port)
        };
        if host.contains('/') {
            return Err(ZmqEndpointError::Path);
        }
        let port = match port.parse::<u16>() {
            Ok(0) => return Err(ZmqEndpointError::PortZero),
            Ok(port) => port,
            Err(_) => return Err(ZmqEndpointError::InvalidPort(quoted(port))),
        };
        if host.bytes().all(|b| b == b'.') {
            return Err(ZmqEndpointError::NoHost);
        }
        if text.starts_with('[') {
            // An IPv6 literal; `to_string` would lose the spelling, so
            // only its validity is taken from the parse.
            host.parse::<Ipv6Addr>()
                .map_err(|_| ZmqEndpointError::InvalidIpv6)?;
        } else if host.contains(['[', ']']) {
            return Err(ZmqEndpointError::BracketInName);
        } else if host.len() > MAX_NAME_LEN {
            return Err(ZmqEndpointError::NameTooLong);
        }
        Ok(Self {
            host: host.into(),
            port,
        })
    }
}

/// The rules on the whole text, checked before it is split: bounded
/// length ([`ZmqEndpoint::MAX_LEN`]), then only the characters of a host
/// name, an IP literal, a port, a transport or a path (ASCII letters and
/// digits and `-._:[]/`). Refusing the rest here, rather than relying on
/// the split to stumble on it, keeps CR/LF out of headers and logs and user
/// info or zone ids away from a dialler.
///
/// Public for text that holds an address without being an endpoint, such
/// as an engine's `http://host:port/path` URL, so that it is held to the
/// same characters.
///
/// ```
/// use kv_events::endpoint::check_address_text;
///
/// assert!(check_address_text("http://10.0.0.2:8200/v1/completions").is_ok());
/// assert!(check_address_text("http://h:1/v1\r\n").is_err());
/// ```
///
/// # Errors
///
/// The first rule `text` breaks.
pub fn check_address_text(text: &str) -> Result<(), ZmqEndpointError> {
    if text.is_empty() {
        return Err(ZmqEndpointError::Empty);
    }
    if text.len() > ZmqEndpoint::MAX_LEN {
        return Err(ZmqEndpointError::TooLong {
            max: ZmqEndpoint::MAX_LEN,
        });
    }
    if let Some(c) = text.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(ZmqEndpointError::Whitespace(c));
    }
    if text.contains('@') {
        return Err(ZmqEndpointError::UserInfo);
    }
    if let Some(c) = text
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "-._:[]/".contains(*c)))
    {
        return Err(ZmqEndpointError::Character(c));
    }
    Ok(())
}

/// At most [`QUOTED_CHARS`] characters of `text`, for an error message.
fn quoted(text: &str) -> String {
    match text.char_indices().nth(QUOTED_CHARS) {
        Some((end, _)) => format!("{}... ({} bytes)", &text[..end], text.len()),
        None => text.to_owned(),
    }
}

impl FromStr for ZmqEndpoint {
    type Err = ZmqEndpointError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

impl TryFrom<&str> for ZmqEndpoint {
    type Error = ZmqEndpointError;

    fn try_from(text: &str) -> Result<Self, Self::Error> {
        Self::parse(text)
    }
}

impl fmt::Display for ZmqEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "tcp://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "tcp://{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Debug for ZmqEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ZmqEndpoint({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(text: &str) -> ZmqEndpointError {
        match ZmqEndpoint::parse(text) {
            Ok(endpoint) => panic!("{text:?} parsed as {endpoint}"),
            Err(error) => error,
        }
    }

    #[test]
    fn names_ipv4_and_ipv6_hosts_parse() {
        for (text, host, port) in [
            ("tcp://10.0.0.5:5557", "10.0.0.5", 5557),
            (
                "tcp://engine-a.svc.cluster.local:1",
                "engine-a.svc.cluster.local",
                1,
            ),
            ("tcp://ENGINE_b:65535", "ENGINE_b", 65535),
            ("tcp://[::1]:5558", "::1", 5558),
            ("tcp://[::ffff:10.0.0.1]:5557", "::ffff:10.0.0.1", 5557),
            // Spellings a resolver reads as IPv4 are kept as written.
            ("tcp://0x7f.0.0.2:5558", "0x7f.0.0.2", 5558),
        ] {
            let endpoint = ZmqEndpoint::parse(text).unwrap();
            assert_eq!((endpoint.host(), endpoint.port()), (host, port), "{text}");
            assert_eq!(endpoint.to_string(), text);
            assert_eq!(text.parse::<ZmqEndpoint>().unwrap(), endpoint);
        }
    }

    #[test]
    fn the_port_is_displayed_without_leading_zeros() {
        let endpoint = ZmqEndpoint::parse("tcp://h:05557").unwrap();
        assert_eq!(endpoint.port(), 5557);
        assert_eq!(endpoint.to_string(), "tcp://h:5557");
    }

    /// Each rule's refusal, with the reason it gives: the cases the four
    /// parsers this one replaced refused (worker-discovery's registration
    /// check, the command line's, engine-sim's reading of a bound address,
    /// the subscriber's rank offset), and the ones added.
    #[test]
    fn every_rule_refuses_with_its_reason() {
        use ZmqEndpointError as E;
        let long = format!("tcp://{}:1", "a".repeat(400));
        let long_name = format!("tcp://{}:1", "a".repeat(254));
        let cases: Vec<(&str, E)> = vec![
            ("", E::Empty),
            (&long, E::TooLong { max: 300 }),
            ("tcp://10.0.0.1:1\r\nx: y", E::Whitespace('\r')),
            ("tcp://10.0.0.1:1\n", E::Whitespace('\n')),
            ("tcp://h\u{0}:1", E::Whitespace('\u{0}')),
            ("tcp://u:p@10.0.0.1:1", E::UserInfo),
            ("tcp://a:b@[::1]%x/y:5557", E::UserInfo),
            ("tcp://[fe80::1%eth0]:1", E::Character('%')),
            ("tcp://*:5557", E::Character('*')),
            ("tcp://h:1?x", E::Character('?')),
            ("tcp://hé:1", E::Character('é')),
            ("10.0.0.1:5557", E::Scheme),
            ("TCP://10.0.0.1:5557", E::Scheme),
            ("ipc:///tmp/kv", E::Scheme),
            ("inproc://cache", E::Scheme),
            ("tcp://[::1:5557", E::UnclosedBracket),
            ("tcp://[::1]", E::NoPort),
            ("tcp://[::1]5557", E::NoPort),
            ("tcp://10.0.0.1", E::NoPort),
            ("tcp://::1:5555", E::UnbracketedIpv6),
            ("tcp://h/x:1", E::Path),
            ("tcp://10.0.0.1:5557/x", E::InvalidPort("5557/x".into())),
            ("tcp://10.0.0.1:port", E::InvalidPort("port".into())),
            ("tcp://10.0.0.1:", E::InvalidPort(String::new())),
            ("tcp://10.0.0.1:65536", E::InvalidPort("65536".into())),
            ("tcp://10.0.0.1:0", E::PortZero),
            ("tcp://:5557", E::NoHost),
            ("tcp://..:5557", E::NoHost),
            ("tcp://[zz]:1", E::InvalidIpv6),
            ("tcp://[]:1", E::NoHost),
            ("tcp://a[b]:1", E::BracketInName),
            ("tcp://a]:1", E::BracketInName),
            (&long_name, E::NameTooLong),
        ];
        for (text, expected) in cases {
            assert_eq!(refused(text), expected, "{text:?}");
        }
    }

    #[test]
    fn messages_name_the_problem_and_quote_little() {
        assert_eq!(
            refused("tcp://10.0.0.1:0").to_string(),
            "port 0 is not a port an engine listens on (1-65535)"
        );
        assert_eq!(
            refused("tcp://h:1\r\n").to_string(),
            "it contains whitespace or a control character ('\\r')"
        );
        let long_port = format!("tcp://h:{}", "9".repeat(200));
        let message = refused(&long_port).to_string();
        assert!(message.len() < 160, "{message}");
        assert!(message.contains("(200 bytes)"), "{message}");
    }

    #[test]
    fn an_address_is_a_host_and_port_without_the_transport() {
        let address = ZmqEndpoint::parse_address("[2001:db8::1]:21001").unwrap();
        assert_eq!(address.host(), "2001:db8::1");
        assert_eq!(address.host_port(), "[2001:db8::1]:21001");
        assert_eq!(address.to_string(), "tcp://[2001:db8::1]:21001");
        for (bad, expected) in [
            ("h", ZmqEndpointError::NoPort),
            ("10.0.0.1:0", ZmqEndpointError::PortZero),
            ("u:p@10.0.0.1:1", ZmqEndpointError::UserInfo),
            ("[::1%eth0]:1", ZmqEndpointError::Character('%')),
            ("::1:5555", ZmqEndpointError::UnbracketedIpv6),
            ("h:1/x", ZmqEndpointError::InvalidPort("1/x".into())),
        ] {
            assert_eq!(ZmqEndpoint::parse_address(bad), Err(expected), "{bad}");
        }
    }

    #[test]
    fn new_takes_the_parsers_rules() {
        assert_eq!(
            ZmqEndpoint::new("::1", 5557).unwrap(),
            ZmqEndpoint::parse("tcp://[::1]:5557").unwrap()
        );
        assert_eq!(ZmqEndpoint::new("h", 0), Err(ZmqEndpointError::PortZero));
        assert!(ZmqEndpoint::new("a]:1", 2).is_err());
        assert!(ZmqEndpoint::new("h:1\n", 2).is_err());
        assert!(ZmqEndpoint::new("", 2).is_err());
    }

    #[test]
    fn socket_addresses_only_for_ip_hosts() {
        let v6 = ZmqEndpoint::parse("tcp://[::1]:5557").unwrap();
        assert_eq!(v6.socket_addr(), Some("[::1]:5557".parse().unwrap()));
        // A resolver reads 127.1 as 127.0.0.1, but it is not an address
        // libzmq reports: only dotted quads are taken as IPv4.
        let short = ZmqEndpoint::parse("tcp://127.1:5557").unwrap();
        assert_eq!(short.socket_addr(), None);
    }
}
