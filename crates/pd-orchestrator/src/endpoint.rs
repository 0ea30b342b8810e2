//! What the orchestrator needs to know about one prefill or decode worker.
//!
//! An [`PdEndpoint`] is plain data: the HTTP base URL, the data-parallel rank
//! when the worker is one rank of a DP engine, the address other engines use
//! to reach its KV side channel, and the connector-specific facts learned at
//! registration (Mooncake engine ids from the bootstrap server, MoRI-IO
//! ports). It is built once per worker lifetime and shared, never per
//! request.

use std::collections::BTreeMap;

use worker_lifecycle::{WorkerUrl, WorkerUrlError};

/// Default port of a Mooncake prefill engine's bootstrap server
/// (`VLLM_MOONCAKE_BOOTSTRAP_PORT`).
pub const DEFAULT_MOONCAKE_BOOTSTRAP_PORT: u16 = 8998;

/// One prefill or decode worker as the two-phase flow addresses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdEndpoint {
    url: WorkerUrl,
    dp_rank: Option<u32>,
    kv_addr: Option<String>,
    mooncake: Option<MooncakeEndpoint>,
    moriio: Option<MoriIoEndpoint>,
}

impl PdEndpoint {
    /// Parses `base_url` ([`WorkerUrl`]'s rules: `http://host:port`, or
    /// with a path prefix for an engine behind an ingress) into an endpoint
    /// without DP rank or connector metadata.
    ///
    /// # Errors
    /// The [`WorkerUrlError`] naming what is wrong with the URL.
    pub fn new(base_url: &str) -> Result<Self, WorkerUrlError> {
        Ok(Self::from_url(WorkerUrl::parse(base_url)?))
    }

    /// An endpoint at an already parsed URL (a worker's, parsed once).
    pub fn from_url(url: WorkerUrl) -> Self {
        Self {
            url,
            dp_rank: None,
            kv_addr: None,
            mooncake: None,
            moriio: None,
        }
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

    /// The base URL in canonical form, e.g. `http://10.0.0.1:8000`.
    pub fn base_url(&self) -> &str {
        self.url.as_str()
    }

    /// The base URL as parsed.
    pub fn worker_url(&self) -> &WorkerUrl {
        &self.url
    }

    /// The full URL of `path` on this endpoint (below its path prefix).
    pub fn url_for(&self, path: &str) -> String {
        self.url.url_for(path)
    }

    /// The host, without IPv6 brackets.
    pub fn host(&self) -> &str {
        self.url.host()
    }

    /// The HTTP port (explicit, or 80/443 from the scheme).
    pub fn port(&self) -> u16 {
        self.url.port()
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
            None => self.url.host_port(),
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
        // A side server of the engine: plain HTTP on the same host.
        format!("http://{}", self.url.with_port(port).host_port())
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
        let e = PdEndpoint::new("http://10.0.0.1:8000/").unwrap();
        assert_eq!(e.base_url(), "http://10.0.0.1:8000");
        assert_eq!((e.host(), e.port()), ("10.0.0.1", 8000));
        assert_eq!(e.kv_addr(), "10.0.0.1:8000");
        assert_eq!(
            e.url_for("/v1/completions"),
            "http://10.0.0.1:8000/v1/completions"
        );
        let e = PdEndpoint::new("https://example.com").unwrap();
        assert_eq!(e.port(), 443);
        let e = PdEndpoint::new("http://example.com").unwrap();
        assert_eq!(e.port(), 80);
    }

    #[test]
    fn parses_ipv6_and_keeps_brackets_where_addresses_need_them() {
        let e = PdEndpoint::new("http://[::1]:9000").unwrap();
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
            "http://h:1/?q",
            "http://u@h:1",
            "http://[::1",
            "http://::1:80",
            "http://[::1]x",
        ] {
            assert!(PdEndpoint::new(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn kv_addr_override_and_bootstrap_port() {
        let e = PdEndpoint::new("http://p:8000")
            .unwrap()
            .with_kv_addr("p:21001")
            .with_dp_rank(1);
        assert_eq!(e.kv_addr(), "p:21001");
        assert_eq!(e.dp_rank(), Some(1));
        assert_eq!(e.mooncake_bootstrap_addr(Some(9000)), "http://p:9000");
    }
}
