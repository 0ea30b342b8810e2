//! Which addresses workers may have: an optional CIDR allow-list checked
//! before the router sends anything to a URL it was given at run time
//! (`POST /add_worker`, registration).
//!
//! Without a list any address is accepted, as in vllm-router. With one,
//! an IP literal must fall inside a listed block, and a host name is
//! resolved first and *every* address it resolves to must; a name that does
//! not resolve (within the time given) is refused. The check happens once,
//! when the worker joins: a name whose DNS answer changes afterwards is not
//! re-checked, so deployments that need that guarantee list workers by IP.

use crate::error::ApiError;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::time::Duration;
use worker_lifecycle::WorkerUrl;

/// An IP network: an address and a prefix length (`10.0.0.0/8`,
/// `fd00::/8`). Bits past the prefix are ignored, so `10.1.2.3/8` is
/// `10.0.0.0/8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CidrBlock {
    network: IpAddr,
    prefix: u8,
}

/// Why a CIDR block did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CidrError {
    /// The part before `/` is not an IPv4 or IPv6 address.
    #[error("`{0}` is not an IP address")]
    Address(String),
    /// The prefix length is not a number within the address family's width.
    #[error("`{0}` is not a valid prefix length (0-32 for IPv4, 0-128 for IPv6)")]
    Prefix(String),
}

impl CidrBlock {
    /// The block of `address` with `prefix` leading bits.
    pub fn new(address: IpAddr, prefix: u8) -> Result<Self, CidrError> {
        let width = match address {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        if prefix > width {
            return Err(CidrError::Prefix(prefix.to_string()));
        }
        let network = match address {
            IpAddr::V4(v4) => IpAddr::V4((u32::from(v4) & mask32(prefix)).into()),
            IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & mask128(prefix)).into()),
        };
        Ok(Self { network, prefix })
    }

    /// The network address (host bits cleared).
    pub fn network(&self) -> IpAddr {
        self.network
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Whether `address` lies in this block. An IPv4-mapped IPv6 address
    /// (`::ffff:10.0.0.1`) is compared as the IPv4 address it maps.
    pub fn contains(&self, address: IpAddr) -> bool {
        match (self.network, address.to_canonical()) {
            (IpAddr::V4(network), IpAddr::V4(address)) => {
                u32::from(address) & mask32(self.prefix) == u32::from(network)
            }
            (IpAddr::V6(network), IpAddr::V6(address)) => {
                u128::from(address) & mask128(self.prefix) == u128::from(network)
            }
            _ => false,
        }
    }
}

fn mask32(prefix: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0)
}

fn mask128(prefix: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0)
}

impl FromStr for CidrBlock {
    type Err = CidrError;

    /// `address/prefix`, or a bare address for a single host.
    fn from_str(text: &str) -> Result<Self, CidrError> {
        let text = text.trim();
        let (address, prefix) = match text.split_once('/') {
            Some((address, prefix)) => (address, Some(prefix)),
            None => (text, None),
        };
        let address: IpAddr = address
            .parse()
            .map_err(|_| CidrError::Address(address.to_owned()))?;
        let prefix = match prefix {
            Some(prefix) => prefix
                .parse::<u8>()
                .map_err(|_| CidrError::Prefix(prefix.to_owned()))?,
            None if address.is_ipv4() => 32,
            None => 128,
        };
        Self::new(address, prefix)
    }
}

impl fmt::Display for CidrBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

/// Checks that the worker at `uri` is inside `allowed` (any address when
/// `allowed` is empty), resolving a host name within `resolve_timeout`.
/// Nothing is sent to the worker.
pub async fn check_worker_address(
    url: &WorkerUrl,
    allowed: &[CidrBlock],
    resolve_timeout: Duration,
) -> Result<(), ApiError> {
    if allowed.is_empty() {
        return Ok(());
    }
    let refused = |why: String| ApiError::WorkerAddressNotAllowed(format!("{url}: {why}"));
    let (host, port) = (url.host(), url.port());
    let addresses: Vec<IpAddr> = match host.parse::<IpAddr>() {
        Ok(address) => vec![address],
        Err(_) => {
            let lookup = tokio::net::lookup_host((host, port));
            match tokio::time::timeout(resolve_timeout, lookup).await {
                Ok(Ok(resolved)) => resolved.map(|socket| socket.ip()).collect(),
                Ok(Err(err)) => return Err(refused(format!("cannot resolve `{host}`: {err}"))),
                Err(_) => {
                    return Err(refused(format!(
                        "`{host}` did not resolve within {resolve_timeout:?}"
                    )));
                }
            }
        }
    };
    if addresses.is_empty() {
        return Err(refused(format!("`{host}` resolves to no address")));
    }
    match addresses
        .iter()
        .find(|address| !allowed.iter().any(|block| block.contains(**address)))
    {
        Some(outside) => Err(refused(format!(
            "{outside} is outside the allowed networks ({})",
            allowed
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(text: &str) -> CidrBlock {
        text.parse().unwrap()
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn blocks_parse_normalise_and_print() {
        assert_eq!(block("10.1.2.3/8").to_string(), "10.0.0.0/8");
        assert_eq!(block("192.168.0.7").to_string(), "192.168.0.7/32");
        assert_eq!(block("fd00::1/8").to_string(), "fd00::/8");
        assert_eq!(block("::1").prefix(), 128);
        assert_eq!(block("0.0.0.0/0").network(), ip("0.0.0.0"));
        for bad in [
            "10.0.0.0/33",
            "::/129",
            "10.0.0/8",
            "host/8",
            "10.0.0.0/x",
            "",
        ] {
            assert!(bad.parse::<CidrBlock>().is_err(), "{bad}");
        }
    }

    #[test]
    fn membership_follows_the_prefix() {
        let private = block("10.0.0.0/8");
        assert!(private.contains(ip("10.255.0.1")));
        assert!(!private.contains(ip("11.0.0.1")));
        assert!(private.contains(ip("::ffff:10.0.0.9")), "IPv4-mapped");
        assert!(!private.contains(ip("fd00::1")), "other family");
        assert!(block("0.0.0.0/0").contains(ip("203.0.113.5")));
        assert!(block("127.0.0.1").contains(ip("127.0.0.1")));
        assert!(!block("127.0.0.1").contains(ip("127.0.0.2")));
        let ula = block("fd00::/8");
        assert!(ula.contains(ip("fd12:3456::1")));
        assert!(!ula.contains(ip("fe80::1")));
        assert!(block("::/0").contains(ip("2001:db8::1")));
    }

    #[tokio::test]
    async fn worker_addresses_are_checked_against_the_list() {
        let timeout = Duration::from_secs(5);
        let allowed = [block("127.0.0.0/8"), block("::1/128")];
        let uri = |text: &str| WorkerUrl::parse(text).unwrap();
        for good in [
            "http://127.0.0.1:8000",
            "http://[::1]:8000",
            "http://localhost:8000",
        ] {
            check_worker_address(&uri(good), &allowed, timeout)
                .await
                .unwrap_or_else(|err| panic!("{good}: {err}"));
        }
        let err = check_worker_address(&uri("http://10.0.0.1:8000"), &allowed, timeout)
            .await
            .unwrap_err();
        assert_eq!(err.status(), http::StatusCode::FORBIDDEN);
        assert!(err.to_string().contains("10.0.0.1 is outside"), "{err}");
        let err = check_worker_address(&uri("http://no-such-host.invalid:80"), &allowed, timeout)
            .await
            .unwrap_err();
        assert_eq!(err.status(), http::StatusCode::FORBIDDEN);
        // No list: anything goes, and nothing is resolved.
        check_worker_address(&uri("http://no-such-host.invalid:80"), &[], timeout)
            .await
            .unwrap();
    }
}
