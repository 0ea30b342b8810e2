//! Where the workers come from: simulated engines, real ones, a
//! prefill/decode deployment or Kubernetes pods, and the flags that choose
//! between them (which may not be mixed).

use super::CliError;
use super::checks::{check_host_port, check_unique, check_url};
use super::parse::Parsed;
use crate::cli::args::{PolicyName, long_flag};
use pd_orchestrator::PdConnector;

/// Where the workers come from.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Mode {
    /// No arguments at all, or `--sim-workers N`: start this many engine-sim
    /// engines in-process.
    Simulated {
        /// Engines to start (0: none).
        engines: usize,
    },
    /// `--sim-pd P:D`: simulated prefill and decode engines.
    SimulatedPd {
        /// Prefill engines.
        prefill: usize,
        /// Decode engines.
        decode: usize,
    },
    /// `--worker-urls`: real engines. None (an empty fleet, workers added
    /// later through `POST /add_worker`) for `--worker-urls` without a URL
    /// and for any command line without a worker source that does not ask
    /// for simulated engines.
    Workers {
        /// The URLs, validated.
        urls: Vec<String>,
    },
    /// `--vllm-pd-disaggregation`.
    PrefillDecode(PdDeployment),
    /// `--service-discovery`: workers are Kubernetes pods.
    Kubernetes(crate::cli::kubernetes::KubernetesSettings),
}

/// The prefill/decode deployment a command line describes, validated: the
/// static engines, each role's policy by name, the KV connector and the
/// discovery address.
///
/// It describes the deployment rather than holding pd-orchestrator's
/// [`PdConfig`](router_http::PdConfig), because that configuration can only
/// be made at start: each role's policy is the router's main policy
/// renamed, the discovery registries exist once the listener is bound, and
/// the static workers (one per data-parallel rank) join the pools only after
/// their first healthy probe (`cli::app`).
#[derive(Debug, Clone, PartialEq)]
pub struct PdDeployment {
    /// Prefill engines with their optional bootstrap port.
    pub prefill: Vec<(String, Option<u16>)>,
    /// Decode engines.
    pub decode: Vec<String>,
    /// Policy of the prefill engines.
    pub prefill_policy: PolicyName,
    /// Policy of the decode engines.
    pub decode_policy: PolicyName,
    /// The KV connector.
    pub kv_connector: PdConnector,
    /// The ZMQ discovery address, if any.
    pub discovery: Option<String>,
}

const PD_FLAGS: [&str; 8] = [
    "pd_kv_events",
    "vllm_discovery_ttl_secs",
    "prefill",
    "decode",
    "prefill_policy",
    "decode_policy",
    "kv_connector",
    "vllm_discovery_address",
];

pub(super) fn mode(parsed: &Parsed) -> Result<Mode, CliError> {
    let a = &parsed.args;
    if a.service_discovery {
        return crate::cli::kubernetes::mode(parsed);
    }
    if !a.vllm_pd_disaggregation
        && a.sim_pd.is_none()
        && let Some(flag) = PD_FLAGS.iter().find(|id| parsed.is_explicit(id))
    {
        return Err(CliError::invalid(
            flag,
            "is a prefill/decode flag: it needs --vllm-pd-disaggregation",
        ));
    }
    let workers_given = parsed.is_explicit("worker_urls");
    if let Some(spec) = &a.sim_pd {
        let (prefill, decode) = parse_sim_pd(spec)?;
        for id in [
            "worker_urls",
            "prefill",
            "decode",
            "vllm_discovery_address",
            "sim_workers",
        ] {
            if parsed.is_explicit(id) {
                return Err(CliError::invalid(
                    "sim_pd",
                    format!(
                        "starts its own engines and cannot be combined with {}",
                        long_flag(id)
                    ),
                ));
            }
        }
        return Ok(Mode::SimulatedPd { prefill, decode });
    }
    if a.vllm_pd_disaggregation {
        if workers_given {
            return Err(CliError::invalid(
                "worker_urls",
                "cannot be combined with --vllm-pd-disaggregation (use --prefill and --decode)",
            ));
        }
        if parsed.is_explicit("sim_workers") {
            return Err(CliError::invalid(
                "sim_workers",
                "cannot be combined with --vllm-pd-disaggregation (use --sim-pd P:D)",
            ));
        }
        let prefill = prefill_engines(&a.prefill)?;
        let decode = a
            .decode
            .iter()
            .map(|url| check_url("decode", url))
            .collect::<Result<Vec<_>, _>>()?;
        let prefill_urls: Vec<String> = prefill.iter().map(|(url, _)| url.clone()).collect();
        check_unique("prefill", &prefill_urls)?;
        check_unique("decode", &decode)?;
        if let Some(address) = &a.vllm_discovery_address {
            check_host_port("vllm_discovery_address", address)?;
        }
        if a.vllm_discovery_address.is_some()
            && let Some(id) = ["prefill", "decode"]
                .iter()
                .find(|id| parsed.is_explicit(id))
        {
            return Err(CliError::invalid(
                id,
                "cannot be combined with --vllm-discovery-address: each role takes its \
                     workers either from static URLs or from discovery",
            ));
        }
        if a.kv_connector.is_moriio() && !prefill.is_empty() {
            return Err(CliError::invalid(
                "kv_connector",
                "moriio needs each engine's MoRI-IO side-channel ports, which static \
                 --prefill/--decode URLs do not carry; use --vllm-discovery-address",
            ));
        }
        if prefill.is_empty() && decode.is_empty() && a.vllm_discovery_address.is_none() {
            return Err(CliError::invalid(
                "vllm_pd_disaggregation",
                "needs --prefill and --decode engines or --vllm-discovery-address",
            ));
        }
        if a.vllm_discovery_address.is_none() && (prefill.is_empty() || decode.is_empty()) {
            let missing = if prefill.is_empty() {
                "prefill"
            } else {
                "decode"
            };
            return Err(CliError::invalid(
                missing,
                "at least one is needed in P/D mode without --vllm-discovery-address",
            ));
        }
        return Ok(Mode::PrefillDecode(PdDeployment {
            prefill,
            decode,
            prefill_policy: a.prefill_policy.unwrap_or(a.policy),
            decode_policy: a.decode_policy.unwrap_or(a.policy),
            kv_connector: a.kv_connector,
            discovery: a.vllm_discovery_address.clone(),
        }));
    }
    if workers_given {
        if parsed.is_explicit("sim_workers") {
            return Err(CliError::invalid(
                "sim_workers",
                "cannot be combined with --worker-urls",
            ));
        }
        let urls = a
            .worker_urls
            .iter()
            .map(|url| check_url("worker_urls", url))
            .collect::<Result<Vec<_>, _>>()?;
        check_unique("worker_urls", &urls)?;
        return Ok(Mode::Workers { urls });
    }
    if starts_simulated_engines(parsed) {
        return Ok(Mode::Simulated {
            engines: a.sim_workers,
        });
    }
    // vllm-router's behaviour: no worker source, no workers until
    // `POST /add_worker`.
    Ok(Mode::Workers { urls: Vec::new() })
}

/// Without a worker source, simulated engines start only for a command line
/// with no arguments at all (nothing given on the command line, in the
/// environment or in a `--config` file) or with `--sim-workers N` given
/// explicitly. Any other command line starts an empty fleet, as
/// vllm-router's does, so that tools driving it through `/add_worker` see
/// no foreign workers.
fn starts_simulated_engines(parsed: &Parsed) -> bool {
    parsed.explicit.is_empty() || parsed.is_explicit("sim_workers")
}

/// Groups `--prefill URL [BOOTSTRAP_PORT|none]` values: a port (or
/// `none`) belongs to the URL before it.
fn prefill_engines(values: &[String]) -> Result<Vec<(String, Option<u16>)>, CliError> {
    let mut engines: Vec<(String, Option<u16>, bool)> = Vec::new();
    for value in values {
        let is_none = value.eq_ignore_ascii_case("none");
        let is_number = !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit());
        if is_none || is_number {
            let Some(last) = engines.last_mut().filter(|(_, _, has_port)| !has_port) else {
                return Err(CliError::invalid(
                    "prefill",
                    format!(
                        "{value:?} must follow a prefill URL (--prefill URL [BOOTSTRAP_PORT|none])"
                    ),
                ));
            };
            last.2 = true;
            if is_number {
                last.1 = Some(value.parse::<u16>().map_err(|_| {
                    CliError::invalid(
                        "prefill",
                        format!("bootstrap port must be 0-65535 or `none`, got {value:?}"),
                    )
                })?);
            }
        } else {
            engines.push((check_url("prefill", value)?, None, false));
        }
    }
    Ok(engines
        .into_iter()
        .map(|(url, port, _)| (url, port))
        .collect())
}

fn parse_sim_pd(spec: &str) -> Result<(usize, usize), CliError> {
    let bad = || {
        CliError::invalid(
            "sim_pd",
            format!("expected PREFILL:DECODE engine counts like 2:2, got {spec:?}"),
        )
    };
    let (p, d) = spec.split_once(':').ok_or_else(bad)?;
    let p: usize = p.trim().parse().map_err(|_| bad())?;
    let d: usize = d.trim().parse().map_err(|_| bad())?;
    if p == 0 || d == 0 || p > 64 || d > 64 {
        return Err(CliError::invalid(
            "sim_pd",
            format!("needs 1 to 64 engines of each role, got {spec:?}"),
        ));
    }
    Ok((p, d))
}
