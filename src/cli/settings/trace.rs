//! `--enable-trace` and its settings: which requests get spans (router-http's
//! `TraceConfig`) and where they are exported (its `ExportConfig`).

use super::CliError;
use crate::cli::args::Args;
use router_http::otel::{ExportConfig, TraceConfig};

/// The OTLP/HTTP traces endpoint when `--otlp-traces-endpoint` is not given.
pub(super) const DEFAULT_ENDPOINT: &str = "http://localhost:4318/v1/traces";

/// The trace settings of a command line.
pub(super) struct Trace {
    pub(super) routing: TraceConfig,
    pub(super) export: Option<ExportConfig>,
}

pub(super) fn trace(a: &Args) -> Result<Trace, CliError> {
    if !a.enable_trace {
        return Ok(Trace {
            routing: TraceConfig::default(),
            export: None,
        });
    }
    let endpoint = match &a.otlp_traces_endpoint {
        Some(endpoint) => {
            endpoint_url(endpoint).map_err(|why| CliError::invalid("otlp_traces_endpoint", why))?
        }
        None => DEFAULT_ENDPOINT.to_owned(),
    };
    let excluded_paths = a
        .otel_excluded_paths
        .iter()
        .map(|path| path.trim())
        .filter(|path| !path.is_empty())
        .map(|path| {
            if path.starts_with('/') {
                Ok(path.to_owned())
            } else {
                Err(CliError::invalid(
                    "otel_excluded_paths",
                    format!("`{path}` is not a path (it must start with /)"),
                ))
            }
        })
        .collect::<Result<_, _>>()?;
    Ok(Trace {
        routing: TraceConfig {
            enabled: true,
            excluded_paths,
            sampling_ratio: a.otel_sampling_ratio,
        },
        export: Some(ExportConfig {
            endpoint,
            ..ExportConfig::default()
        }),
    })
}

/// `--otlp-traces-endpoint` as the URL the exporter posts to: an `http://`
/// URL is taken as it is, with `/v1/traces` added when it has no path; a
/// bare `HOST:PORT` is `http://HOST:PORT/v1/traces`. Other schemes are
/// refused: only OTLP over HTTP/protobuf is built in.
fn endpoint_url(endpoint: &str) -> Result<String, String> {
    let endpoint = endpoint.trim();
    let (scheme, rest) = match endpoint.split_once("://") {
        Some((scheme, rest)) => (scheme.to_ascii_lowercase(), rest),
        None => ("http".to_owned(), endpoint),
    };
    if scheme != "http" {
        return Err(format!(
            "`{endpoint}`: only OTLP over HTTP/protobuf (http://HOST:PORT/v1/traces) is \
             supported; gRPC and TLS are not built in"
        ));
    }
    let (authority, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    if authority.is_empty() {
        return Err(format!("`{endpoint}` has no host"));
    }
    let path = if path.is_empty() || path == "/" {
        "/v1/traces"
    } else {
        path
    };
    let url = format!("http://{authority}{path}");
    url.parse::<http::Uri>()
        .map_err(|err| format!("`{endpoint}`: {err}"))?;
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::endpoint_url;

    #[test]
    fn endpoints_become_otlp_http_trace_urls() {
        for (given, url) in [
            ("collector:4318", "http://collector:4318/v1/traces"),
            ("http://collector:4318", "http://collector:4318/v1/traces"),
            ("http://collector:4318/", "http://collector:4318/v1/traces"),
            (
                "http://10.0.0.1:9000/otlp/v1/traces",
                "http://10.0.0.1:9000/otlp/v1/traces",
            ),
            ("HTTP://[::1]:4318/v1/traces", "http://[::1]:4318/v1/traces"),
        ] {
            assert_eq!(endpoint_url(given).unwrap(), url, "{given}");
        }
        for bad in [
            "grpc://collector:4317",
            "https://collector:4318",
            "http://",
            "http://a b:1",
        ] {
            assert!(endpoint_url(bad).is_err(), "{bad}");
        }
    }
}
