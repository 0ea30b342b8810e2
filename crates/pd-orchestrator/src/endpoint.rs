//! What the orchestrator needs to know about one prefill or decode worker.
//!
//! An [`Endpoint`] is plain data: the HTTP base URL, the data-parallel rank
//! when the worker is one rank of a DP engine, the address other engines use
//! to reach its KV side channel, and the connector-specific facts learned at
//! registration (Mooncake engine ids from the bootstrap server, MoRI-IO
//! ports). It is built once per worker lifetime and shared, never per
//! request.

use std::collections::BTreeMap;
use std::fmt;

use crate::error::EndpointError;

/// Default port of a Mooncake prefill engine's bootstrap server
/// (`VLLM_MOONCAKE_BOOTSTRAP_PORT`).
pub const DEFAULT_MOONCAKE_BOOTSTRAP_PORT: u16 = 8998;

/// One prefill or decode worker as the two-phase flow addresses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    base_url: String,
    authority: Authority,
    dp_rank: Option<u32>,
    kv_addr: Option<String>,
    mooncake: Option<MooncakeEndpoint>,
    moriio: Option<MoriIoEndpoint>,
}

impl Endpoint {
    /// Parses `base_url` (`http://host:port`, optionally with a trailing
    /// slash; `https` is accepted too) into an endpoint without DP rank or
    /// connector metadata.
    ///
    /// # Errors
    /// [`EndpointError::InvalidUrl`] when the scheme is not http/https, the
    /// host is empty, the port is not a number, or the URL carries a path,
    /// query or user info.
    pub fn new(base_url: &str) -> Result<Self, EndpointError> {
        let authority = Authority::parse(base_url)?;
        Ok(Self {
            base_url: base_url.trim_end_matches('/').to_owned(),
            authority,
            dp_rank: None,
            kv_addr: None,
            mooncake: None,
            moriio: None,
        })
    }

    /// Sets the data-parallel rank this endpoint addresses; every leg sent
    /// to it then carries `X-data-parallel-rank`.
    #[must_use]
    pub fn with_dp_rank(mut self, rank: u32) -> Self {
        self.dp_rank = Some(rank);
        self
    }

    /// Sets the KV side-channel address used in the P2P request-id
    /// convention (for the NCCL connector, the engine's ZMQ `host:port`).
    /// Without it the HTTP `host:port` is used.
    #[must_use]
    pub fn with_kv_addr(mut self, kv_addr: impl Into<String>) -> Self {
        self.kv_addr = Some(kv_addr.into());
        self
    }

    /// Attaches what the Mooncake bootstrap server reported for this
    /// prefill engine.
    #[must_use]
    pub fn with_mooncake(mut self, mooncake: MooncakeEndpoint) -> Self {
        self.mooncake = Some(mooncake);
        self
    }

    /// Attaches the MoRI-IO registration facts of this engine.
    #[must_use]
    pub fn with_moriio(mut self, moriio: MoriIoEndpoint) -> Self {
        self.moriio = Some(moriio);
        self
    }

    /// The base URL without a trailing slash, e.g. `http://10.0.0.1:8000`.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The full URL of `path` on this endpoint.
    pub fn url_for(&self, path: &str) -> String {
        let mut url = String::with_capacity(self.base_url.len() + path.len() + 1);
        url.push_str(&self.base_url);
        if !path.starts_with('/') {
            url.push('/');
        }
        url.push_str(path);
        url
    }

    /// The host, without IPv6 brackets.
    pub fn host(&self) -> &str {
        &self.authority.host
    }

    /// The HTTP port (explicit, or 80/443 from the scheme).
    pub fn port(&self) -> u16 {
        self.authority.port
    }

    /// The data-parallel rank, when set.
    pub fn dp_rank(&self) -> Option<u32> {
        self.dp_rank
    }

    /// The address used in the request-id convention: the KV side-channel
    /// address when set, else the HTTP `host:port` (IPv6 hosts bracketed).
    pub fn kv_addr(&self) -> String {
        match &self.kv_addr {
            Some(addr) => addr.clone(),
            None => self.authority.to_string(),
        }
    }

    /// Mooncake bootstrap facts, when learned.
    pub fn mooncake(&self) -> Option<&MooncakeEndpoint> {
        self.mooncake.as_ref()
    }

    /// MoRI-IO registration facts, when registered.
    pub fn moriio(&self) -> Option<&MoriIoEndpoint> {
        self.moriio.as_ref()
    }

    /// The default Mooncake bootstrap address of this endpoint's host:
    /// `http://{host}:{port or 8998}`.
    pub fn mooncake_bootstrap_addr(&self, bootstrap_port: Option<u16>) -> String {
        let port = bootstrap_port.unwrap_or(DEFAULT_MOONCAKE_BOOTSTRAP_PORT);
        format!("http://{}:{port}", self.authority.bracketed_host())
    }
}

/// Host and port parsed from a base URL.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Authority {
    host: String,
    port: u16,
    ipv6: bool,
}

impl Authority {
    fn parse(base_url: &str) -> Result<Self, EndpointError> {
        let invalid = |reason: &'static str| EndpointError::InvalidUrl {
            url: base_url.to_owned(),
            reason,
        };
        let (rest, default_port) = if let Some(rest) = base_url.strip_prefix("http://") {
            (rest, 80)
        } else if let Some(rest) = base_url.strip_prefix("https://") {
            (rest, 443)
        } else {
            return Err(invalid("scheme must be http:// or https://"));
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains(['/', '?', '#', '@']) {
            return Err(invalid("a base URL carries no path, query or user info"));
        }
        let (host, port_text, ipv6) = if let Some(bracketed) = rest.strip_prefix('[') {
            let (host, after) = bracketed
                .split_once(']')
                .ok_or_else(|| invalid("unclosed IPv6 bracket"))?;
            let port_text = match after {
                "" => None,
                _ => Some(
                    after
                        .strip_prefix(':')
                        .ok_or_else(|| invalid("junk after IPv6 host"))?,
                ),
            };
            (host, port_text, true)
        } else {
            match rest.rsplit_once(':') {
                Some((host, port)) => (host, Some(port), false),
                None => (rest, None, false),
            }
        };
        if host.is_empty() {
            return Err(invalid("empty host"));
        }
        if !ipv6 && host.contains(':') {
            return Err(invalid("IPv6 hosts must be bracketed"));
        }
        let port = match port_text {
            None => default_port,
            Some(text) => text.parse::<u16>().map_err(|_| invalid("invalid port"))?,
        };
        Ok(Self {
            host: host.to_owned(),
            port,
            ipv6,
        })
    }

    fn bracketed_host(&self) -> String {
        if self.ipv6 {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        }
    }
}

impl fmt::Display for Authority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ipv6 {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// What a Mooncake prefill engine's bootstrap server reported: its address
/// and the KV engine id of each data-parallel rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MooncakeEndpoint {
    /// `http://host:port` of the bootstrap server; the decode engine appends
    /// `/query` to it, so it must carry the scheme.
    pub bootstrap_addr: String,
    /// Engine id per DP rank, as returned by `GET {bootstrap_addr}/query`.
    pub engine_ids: BTreeMap<u32, String>,
}

impl MooncakeEndpoint {
    /// The engine id of `rank` (rank 0 when the endpoint has no DP rank).
    pub fn engine_id(&self, rank: Option<u32>) -> Option<&str> {
        self.engine_ids.get(&rank.unwrap_or(0)).map(String::as_str)
    }

    /// Number of data-parallel ranks the bootstrap server reported.
    pub fn dp_size(&self) -> usize {
        self.engine_ids.len()
    }
}

/// The facts a MoRI-IO engine registers with: side-channel ports and its
/// parallel layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoriIoEndpoint {
    /// Handshake port of the engine's MoRI-IO side channel.
    pub handshake_port: u16,
    /// Notify port of the engine's MoRI-IO side channel.
    pub notify_port: u16,
    /// Data-parallel size of the engine.
    pub dp_size: u32,
    /// Tensor-parallel size of the engine.
    pub tp_size: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_host_port_and_defaults() {
        let e = Endpoint::new("http://10.0.0.1:8000/").unwrap();
        assert_eq!(e.base_url(), "http://10.0.0.1:8000");
        assert_eq!((e.host(), e.port()), ("10.0.0.1", 8000));
        assert_eq!(e.kv_addr(), "10.0.0.1:8000");
        assert_eq!(
            e.url_for("/v1/completions"),
            "http://10.0.0.1:8000/v1/completions"
        );
        let e = Endpoint::new("https://example.com").unwrap();
        assert_eq!(e.port(), 443);
        let e = Endpoint::new("http://example.com").unwrap();
        assert_eq!(e.port(), 80);
    }

    #[test]
    fn parses_ipv6_and_keeps_brackets_where_addresses_need_them() {
        let e = Endpoint::new("http://[::1]:9000").unwrap();
        assert_eq!(e.host(), "::1");
        assert_eq!(e.kv_addr(), "[::1]:9000");
        assert_eq!(e.mooncake_bootstrap_addr(None), "http://[::1]:8998");
    }

    #[test]
    fn rejects_bad_urls() {
        for bad in [
            "10.0.0.1:8000",
            "ftp://x:1",
            "http://",
            "http://:80",
            "http://h:notaport",
            "http://h:70000",
            "http://h:1/v1",
            "http://u@h:1",
            "http://[::1",
            "http://::1:80",
            "http://[::1]x",
        ] {
            assert!(Endpoint::new(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn kv_addr_override_and_bootstrap_port() {
        let e = Endpoint::new("http://p:8000")
            .unwrap()
            .with_kv_addr("p:21001")
            .with_dp_rank(1);
        assert_eq!(e.kv_addr(), "p:21001");
        assert_eq!(e.dp_rank(), Some(1));
        assert_eq!(e.mooncake_bootstrap_addr(Some(9000)), "http://p:9000");
    }
}
