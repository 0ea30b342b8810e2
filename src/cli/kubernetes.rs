//! Kubernetes pod discovery (`--service-discovery`), wired to the router.
//!
//! The watch, the rules of what makes a pod a worker and the registries
//! live in worker-discovery's `kubernetes` module; this module turns
//! vllm-router's flags into its configuration and hands its registries to
//! router-http: the regular role's as [`RouterConfig::worker_registry`],
//! or, with `--vllm-pd-disaggregation`, the prefill and decode ones as the
//! P/D pools' registries. Each request reconciles them first, so a pod that
//! turned ready is routable at once and one that left takes no new request
//! while the requests in flight on it finish.
//!
//! - `--selector KEY=VALUE...`: regular workers (required without P/D);
//! - `--prefill-selector` and `--decode-selector`: both required with
//!   `--vllm-pd-disaggregation`; a pod matching both is a prefill worker;
//! - `--service-discovery-port` (default 80): the port at each pod's IP;
//! - `--service-discovery-namespace`: the one namespace watched (unset: all);
//! - a prefill pod's KV bootstrap port comes from its annotation
//!   `vllm.ai/bootstrap-port`.
//!
//! [`RouterConfig::worker_registry`]: router_http::RouterConfig::worker_registry

use super::args::PolicyName;
use super::settings::{CliError, Mode, Parsed};
use router_http::PdConnector;
use router_http::metrics::{Exposition, MetricsSource};
use std::sync::Arc;
use std::time::Duration;
use worker_discovery::kubernetes::kube;
pub use worker_discovery::kubernetes::{
    DiscoveryMetrics, KubernetesConfig, KubernetesDiscovery, KubernetesError, Selector,
};

/// `--service-discovery`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct KubernetesSettings {
    /// What to watch.
    pub discovery: KubernetesConfig,
    /// With `--vllm-pd-disaggregation`: the connector and each role's
    /// policy (`None`: regular workers).
    pub pd: Option<KubernetesPd>,
    /// The API server to talk to over plain HTTP instead of the client the
    /// environment configures (service account, kubeconfig): no flag sets
    /// it; a host that embeds the router, or a test with a fake API
    /// server, does (default `None`).
    pub api_server: Option<String>,
}

/// The P/D part of [`KubernetesSettings`].
#[derive(Debug, Clone, PartialEq)]
pub struct KubernetesPd {
    /// The KV connector.
    pub kv_connector: PdConnector,
    /// Policy of the prefill workers.
    pub prefill_policy: PolicyName,
    /// Policy of the decode workers.
    pub decode_policy: PolicyName,
}

fn invalid(flag: &str, message: impl Into<String>) -> CliError {
    CliError::Invalid {
        flag: flag.to_owned(),
        message: message.into(),
    }
}

fn selector(flag: &str, items: &[String]) -> Result<Option<Selector>, CliError> {
    if items.is_empty() {
        return Ok(None);
    }
    let selector = Selector::parse(items).map_err(|err| invalid(flag, err.to_string()))?;
    Ok(Some(selector))
}

/// The mode of a command line with `--service-discovery`: the selectors
/// checked, and every worker source it cannot be combined with refused.
pub fn mode(parsed: &Parsed) -> Result<Mode, CliError> {
    let a = &parsed.args;
    for (id, flag) in [
        ("worker_urls", "--worker-urls"),
        ("prefill", "--prefill"),
        ("decode", "--decode"),
        ("vllm_discovery_address", "--vllm-discovery-address"),
        ("sim_workers", "--sim-workers"),
        ("sim_pd", "--sim-pd"),
    ] {
        if parsed.is_explicit(id) {
            return Err(invalid(
                "--service-discovery",
                format!(
                    "takes the workers from Kubernetes pods and cannot be combined with {flag}"
                ),
            ));
        }
    }
    let regular = selector("--selector", &a.selector)?;
    let prefill = selector("--prefill-selector", &a.prefill_selector)?;
    let decode = selector("--decode-selector", &a.decode_selector)?;
    let (discovery, pd) = if a.vllm_pd_disaggregation {
        if regular.is_some() {
            return Err(invalid(
                "--selector",
                "selects regular workers; with --vllm-pd-disaggregation use --prefill-selector \
                 and --decode-selector",
            ));
        }
        let (Some(prefill), Some(decode)) = (prefill, decode) else {
            let missing = if a.prefill_selector.is_empty() {
                "--prefill-selector"
            } else {
                "--decode-selector"
            };
            return Err(invalid(
                missing,
                "is required with --service-discovery and --vllm-pd-disaggregation \
                 (KEY=VALUE...)",
            ));
        };
        let pd = KubernetesPd {
            kv_connector: a.kv_connector,
            prefill_policy: a.prefill_policy.unwrap_or(a.policy),
            decode_policy: a.decode_policy.unwrap_or(a.policy),
        };
        (KubernetesConfig::prefill_decode(prefill, decode), Some(pd))
    } else {
        if prefill.is_some() || decode.is_some() {
            let flag = if prefill.is_some() {
                "--prefill-selector"
            } else {
                "--decode-selector"
            };
            return Err(invalid(
                flag,
                "is a prefill/decode flag: it needs --vllm-pd-disaggregation",
            ));
        }
        let Some(regular) = regular else {
            return Err(invalid(
                "--service-discovery",
                "needs --selector KEY=VALUE... naming the worker pods' labels (or \
                 --vllm-pd-disaggregation with --prefill-selector and --decode-selector)",
            ));
        };
        (KubernetesConfig::regular(regular), None)
    };
    if pd.is_some() && a.kv_connector.is_moriio() {
        return Err(invalid(
            "--kv-connector",
            "moriio needs each engine's MoRI-IO side-channel ports, which pods do not \
             announce; use --vllm-discovery-address",
        ));
    }
    let namespace = match &a.service_discovery_namespace {
        Some(ns) if !valid_namespace(ns) => {
            return Err(invalid(
                "--service-discovery-namespace",
                format!(
                    "{ns:?} is not a namespace name (lowercase letters, digits and '-', at most \
                     63, starting and ending alphanumeric)"
                ),
            ));
        }
        other => other.clone(),
    };
    if a.intra_node_data_parallel_size > 1 {
        // A pod announces one port and no rank count; vLLM balances its
        // own data-parallel ranks behind that port.
        return Err(invalid(
            "--intra-node-data-parallel-size",
            "applies to --worker-urls only: a discovered pod is one worker (vLLM balances its \
             data-parallel ranks behind the pod's port); remove the flag",
        ));
    }
    if a.service_discovery_port == 0 {
        return Err(invalid("--service-discovery-port", "must be 1-65535"));
    }
    let discovery = KubernetesConfig {
        port: a.service_discovery_port,
        namespace,
        ..discovery
    };
    discovery
        .validate()
        .map_err(|err| invalid("--service-discovery", err.to_string()))?;
    Ok(Mode::Kubernetes(KubernetesSettings {
        discovery,
        pd,
        api_server: None,
    }))
}

fn valid_namespace(ns: &str) -> bool {
    let bytes = ns.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
}

/// Starts watching with the client of the environment (the pod's service
/// account in a cluster, else the kubeconfig). A 403 is an error naming
/// the RBAC rule; an API server that does not answer yet is retried in
/// the background.
pub async fn start(settings: &KubernetesSettings) -> Result<KubernetesDiscovery, KubernetesError> {
    let Some(url) = &settings.api_server else {
        return KubernetesDiscovery::connect(settings.discovery.clone()).await;
    };
    let uri = url
        .parse()
        .map_err(|err| KubernetesError::Config(format!("API server URL {url:?}: {err}")))?;
    let client = kube::Client::try_from(kube::Config::new(uri)).map_err(KubernetesError::Client)?;
    KubernetesDiscovery::start(client, settings.discovery.clone()).await
}

/// Waits up to `wait` for the first list of every selector, so that the
/// banner's first request finds the fleet; warns and goes on after that
/// (pods join as they are listed).
pub async fn wait_synced(discovery: &KubernetesDiscovery, wait: Duration) {
    if !discovery.wait_synced(wait).await {
        tracing::warn!(
            ?wait,
            "the first pod list has not completed; serving, and adding pods as they are listed"
        );
    }
}

/// The `router_discovery_*` families on the router's `/metrics`, read from
/// the running discovery at each scrape.
pub fn metrics_source(discovery: &KubernetesDiscovery) -> Arc<dyn MetricsSource> {
    let reader = discovery.metrics_reader();
    Arc::new(move |exposition: &mut Exposition<'_>| reader.snapshot().render(exposition))
}

/// The banner line: what is watched.
pub fn describe(config: &KubernetesConfig) -> String {
    let scope = match &config.namespace {
        Some(ns) => format!("namespace {ns}"),
        None => "all namespaces".to_owned(),
    };
    let mut selectors = Vec::new();
    for (role, selector) in [
        ("prefill", &config.prefill),
        ("decode", &config.decode),
        ("workers", &config.regular),
    ] {
        if let Some(selector) = selector {
            selectors.push(format!("{role} {selector}"));
        }
    }
    format!(
        "Kubernetes pods in {scope}, port {} ({})",
        config.port,
        selectors.join("; ")
    )
}
