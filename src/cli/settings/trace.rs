//! `--enable-trace` and its settings: which requests get spans (router-http's
//! `TraceConfig`) and where they are exported (its `ExportConfig`).
//!
//! A vllm-router command line means here what it means there: vllm-router
//! always exports over OTLP/gRPC (opentelemetry-otlp's tonic exporter),
//! its `--otlp-traces-endpoint` defaults to `localhost:4317`, a `HOST:PORT`
//! without a scheme is `http://HOST:PORT` (cleartext gRPC) and an
//! `https://` URL is gRPC over TLS. So the protocol defaults to gRPC, and
//! `--otlp-traces-protocol http/protobuf` (OpenTelemetry's
//! `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` values) asks for OTLP/HTTP.

use super::CliError;
use crate::cli::args::Args;
use router_http::otel::{ExportConfig, Protocol, TraceConfig};

/// The traces endpoint when `--otlp-traces-endpoint` is not given:
/// vllm-router's default (OTLP/gRPC's port).
pub(super) const DEFAULT_GRPC_ENDPOINT: &str = "localhost:4317";

/// The traces endpoint for `--otlp-traces-protocol http/protobuf` when
/// `--otlp-traces-endpoint` is not given (OTLP/HTTP's port).
pub(super) const DEFAULT_HTTP_ENDPOINT: &str = "localhost:4318";

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
    let protocol = match &a.otlp_traces_protocol {
        Some(name) => name
            .trim()
            .parse::<Protocol>()
            .map_err(|why| CliError::invalid("otlp_traces_protocol", why))?,
        None => Protocol::Grpc,
    };
    let endpoint = a.otlp_traces_endpoint.as_deref().unwrap_or(match protocol {
        Protocol::HttpProtobuf => DEFAULT_HTTP_ENDPOINT,
        _ => DEFAULT_GRPC_ENDPOINT,
    });
    let endpoint = endpoint_url(endpoint, protocol)
        .map_err(|why| CliError::invalid("otlp_traces_endpoint", why))?;
    let ca_file = match &a.otlp_traces_ca_file {
        Some(path) => {
            if !endpoint.starts_with("https://") {
                return Err(CliError::invalid(
                    "otlp_traces_ca_file",
                    format!("`{endpoint}` is not TLS: a CA file needs an https:// endpoint"),
                ));
            }
            if let Err(err) = std::fs::File::open(path) {
                return Err(CliError::invalid(
                    "otlp_traces_ca_file",
                    format!("cannot read `{path}`: {err}"),
                ));
            }
            Some(std::path::PathBuf::from(path))
        }
        None => None,
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
            protocol,
            ca_file,
            ..ExportConfig::default()
        }),
    })
}

/// `--otlp-traces-endpoint` as the URL the exporter sends to.
///
/// - gRPC: `HOST:PORT`, `http://HOST:PORT` and `grpc://HOST:PORT` (vLLM's
///   spelling) are cleartext gRPC, `https://HOST:PORT` gRPC over TLS; a
///   path is refused (it is OTLP/HTTP's, and gRPC has its own).
/// - HTTP/protobuf: `HOST:PORT` is `http://HOST:PORT/v1/traces`; an
///   `http://` or `https://` URL is taken as it is, with `/v1/traces` added
///   when it has no path.
fn endpoint_url(endpoint: &str, protocol: Protocol) -> Result<String, String> {
    let endpoint = endpoint.trim();
    let (scheme, rest) = match endpoint.split_once("://") {
        Some((scheme, rest)) => (scheme.to_ascii_lowercase(), rest),
        None => ("http".to_owned(), endpoint),
    };
    let scheme = match (scheme.as_str(), protocol) {
        ("http" | "https", _) => scheme,
        ("grpc", Protocol::Grpc) => "http".to_owned(),
        ("grpc", _) => {
            return Err(format!(
                "`{endpoint}` is a gRPC endpoint, but --otlp-traces-protocol is {protocol}"
            ));
        }
        _ => {
            return Err(format!(
                "`{endpoint}`: expected HOST:PORT or an http://, https:// or grpc:// URL"
            ));
        }
    };
    let (authority, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    if authority.is_empty() {
        return Err(format!("`{endpoint}` has no host"));
    }
    let path = match protocol {
        Protocol::HttpProtobuf if path.is_empty() || path == "/" => "/v1/traces",
        Protocol::HttpProtobuf => path,
        _ if path.is_empty() || path == "/" => "",
        _ => {
            return Err(format!(
                "`{endpoint}` has a path: an OTLP/gRPC endpoint is HOST:PORT (for OTLP over \
                 HTTP, add --otlp-traces-protocol http/protobuf)"
            ));
        }
    };
    let url = format!("{scheme}://{authority}{path}");
    url.parse::<http::Uri>()
        .map_err(|err| format!("`{endpoint}`: {err}"))?;
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::{Protocol, endpoint_url};

    #[test]
    fn grpc_endpoints_are_read_as_vllm_router_reads_them() {
        for (given, url) in [
            ("localhost:4317", "http://localhost:4317"),
            ("http://collector:4317", "http://collector:4317"),
            ("http://collector:4317/", "http://collector:4317"),
            ("grpc://collector:4317", "http://collector:4317"),
            ("https://collector:4317", "https://collector:4317"),
            ("HTTPS://[::1]:4317", "https://[::1]:4317"),
        ] {
            assert_eq!(endpoint_url(given, Protocol::Grpc).unwrap(), url, "{given}");
        }
        for bad in [
            "http://collector:4318/v1/traces",
            "ftp://collector:4317",
            "http://",
            "http://a b:1",
        ] {
            assert!(endpoint_url(bad, Protocol::Grpc).is_err(), "{bad}");
        }
    }

    #[test]
    fn http_endpoints_become_otlp_http_trace_urls() {
        for (given, url) in [
            ("collector:4318", "http://collector:4318/v1/traces"),
            ("http://collector:4318", "http://collector:4318/v1/traces"),
            ("http://collector:4318/", "http://collector:4318/v1/traces"),
            ("https://collector:4318", "https://collector:4318/v1/traces"),
            (
                "http://10.0.0.1:9000/otlp/v1/traces",
                "http://10.0.0.1:9000/otlp/v1/traces",
            ),
            ("HTTP://[::1]:4318/v1/traces", "http://[::1]:4318/v1/traces"),
        ] {
            assert_eq!(
                endpoint_url(given, Protocol::HttpProtobuf).unwrap(),
                url,
                "{given}"
            );
        }
        for bad in [
            "grpc://collector:4317",
            "ftp://c:1",
            "http://",
            "http://a b:1",
        ] {
            assert!(endpoint_url(bad, Protocol::HttpProtobuf).is_err(), "{bad}");
        }
    }
}
