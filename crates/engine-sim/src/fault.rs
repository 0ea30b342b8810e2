//! Fault injection.
//!
//! Per engine: [`crate::FaultConfig`] (flags of the binary). Per request: the
//! `x-sim-fault` header, a comma-separated list of
//!
//! | item | effect |
//! |---|---|
//! | `status=CODE` | answer CODE with a vLLM-style JSON error |
//! | `stall-before-headers[=DUR]` | wait DUR (default: forever) before the headers |
//! | `stall-after-headers[=DUR]` | send 200 headers, then nothing for DUR (default: forever), then the body |
//! | `reset-mid-body` | send the headers and part of the body, then reset the TCP connection |
//!
//! `DUR` is `20us`, `250ms`, `2s` or a bare number of milliseconds. An unknown item
//! is a 400 error, so a typo never silently disables a test's fault.
//! Per-engine faults apply in this order: slow start (wait until ready),
//! fixed status, fail first N, failure rate, stall before headers; the
//! body faults (stall after headers, reset) apply to successful answers.

use std::time::Duration;

/// "Forever" for stalls: long enough for any test, small enough for timers.
pub const FOREVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// The name of the per-request fault header.
pub const FAULT_HEADER: &str = "x-sim-fault";

/// Faults requested by one request's header.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestFaults {
    /// Answer with this status.
    pub status: Option<u16>,
    /// Wait before sending headers.
    pub stall_before_headers: Option<Duration>,
    /// Stall the body after the headers.
    pub stall_after_headers: Option<Duration>,
    /// Reset the connection after part of the body.
    pub reset_mid_body: bool,
}

/// Why a fault header could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FaultHeaderError {
    /// An item is not one of the known faults.
    #[error("unknown fault {0:?} in x-sim-fault")]
    UnknownFault(String),
    /// A value could not be parsed.
    #[error("bad value {value:?} for {fault} in x-sim-fault")]
    BadValue {
        /// The fault.
        fault: &'static str,
        /// The value given.
        value: String,
    },
}

/// Parses a duration: `20us`, `250ms`, `2s` (fractions allowed), or a bare
/// number of milliseconds.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    if let Some(us) = text.strip_suffix("us") {
        us.trim().parse().ok().map(Duration::from_micros)
    } else if let Some(ms) = text.strip_suffix("ms") {
        ms.trim().parse().ok().map(Duration::from_millis)
    } else if let Some(s) = text.strip_suffix('s') {
        s.trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0 && *s < 1e9)
            .map(Duration::from_secs_f64)
    } else {
        text.parse().ok().map(Duration::from_millis)
    }
}

/// Parses an `x-sim-fault` header value.
pub fn parse_fault_header(value: &str) -> Result<RequestFaults, FaultHeaderError> {
    let mut faults = RequestFaults::default();
    for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (name, arg) = match item.split_once('=') {
            Some((n, a)) => (n.trim(), Some(a.trim())),
            None => (item, None),
        };
        let duration = |fault: &'static str| -> Result<Duration, FaultHeaderError> {
            match arg {
                None => Ok(FOREVER),
                Some(a) => parse_duration(a).ok_or_else(|| FaultHeaderError::BadValue {
                    fault,
                    value: a.to_owned(),
                }),
            }
        };
        match name {
            "status" => {
                let code = arg
                    .and_then(|a| a.parse::<u16>().ok())
                    .filter(|c| (100..=599).contains(c))
                    .ok_or_else(|| FaultHeaderError::BadValue {
                        fault: "status",
                        value: arg.unwrap_or_default().to_owned(),
                    })?;
                faults.status = Some(code);
            }
            "stall-before-headers" => {
                faults.stall_before_headers = Some(duration("stall-before-headers")?);
            }
            "stall-after-headers" => {
                faults.stall_after_headers = Some(duration("stall-after-headers")?);
            }
            "reset-mid-body" => faults.reset_mid_body = true,
            other => return Err(FaultHeaderError::UnknownFault(other.to_owned())),
        }
    }
    Ok(faults)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_items_parse() {
        let f = parse_fault_header("status=503, stall-after-headers=250ms,reset-mid-body")
            .expect("valid");
        assert_eq!(f.status, Some(503));
        assert_eq!(f.stall_after_headers, Some(Duration::from_millis(250)));
        assert!(f.reset_mid_body);
        let f = parse_fault_header("stall-before-headers").expect("valid");
        assert_eq!(f.stall_before_headers, Some(FOREVER));
        assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("20us"), Some(Duration::from_micros(20)));
        assert_eq!(parse_duration("7"), Some(Duration::from_millis(7)));
        assert_eq!(parse_duration("-1s"), None);
        assert!(parse_fault_header("explode").is_err());
        assert!(parse_fault_header("status=abc").is_err());
    }
}
