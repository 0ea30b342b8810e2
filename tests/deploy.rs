//! Everything under deploy/ is read the way its consumer reads it, so that a
//! typo fails here and not in someone's cluster.
//!
//! - Every document of every Kubernetes manifest (`deploy/**/*.yaml`) is
//!   deserialized into the `k8s-openapi` type its `apiVersion` and `kind`
//!   name, then written back: a field the type does not have (a misspelt or
//!   misplaced key, which serde would otherwise skip) or a required field
//!   that is missing shows up as a difference, with its path.
//! - The pieces fit together: selectors match their pods, probes use the
//!   router's routes and name ports the container has, the ServiceAccount
//!   a router runs as may get/list/watch pods, every `$(VAR)` in the
//!   arguments is defined, and the router's arguments are flags it knows.
//! - The Dockerfile starts the program the package builds, with flags it
//!   knows.

use affinity_router::cli::Args;
use clap::Parser;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Container, Probe, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One document of a manifest, as the type its `kind` names.
enum Object {
    Deployment(Box<Deployment>),
    Service(Box<Service>),
    ServiceAccount(Box<ServiceAccount>),
    Role(Box<Role>),
    RoleBinding(Box<RoleBinding>),
    ClusterRole(Box<ClusterRole>),
    ClusterRoleBinding(Box<ClusterRoleBinding>),
}

impl Object {
    fn kind(&self) -> &'static str {
        match self {
            Object::Deployment(_) => "Deployment",
            Object::Service(_) => "Service",
            Object::ServiceAccount(_) => "ServiceAccount",
            Object::Role(_) => "Role",
            Object::RoleBinding(_) => "RoleBinding",
            Object::ClusterRole(_) => "ClusterRole",
            Object::ClusterRoleBinding(_) => "ClusterRoleBinding",
        }
    }
}

/// A parsed document and where it came from, for messages.
struct Document {
    origin: String,
    object: Object,
}

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

/// Every `.yaml` / `.yml` file under `dir`, sorted.
fn manifest_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            found.extend(manifest_files(&path));
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        ) {
            found.push(path);
        }
    }
    found.sort();
    found
}

/// Reads `json` as `T`, writes it back and fails with the first path where
/// the two differ.
fn typed<T>(origin: &str, json: &Value) -> T
where
    T: serde::de::DeserializeOwned + serde::Serialize,
{
    let object: T = serde_json::from_value(json.clone())
        .unwrap_or_else(|err| panic!("{origin}: not a valid {}: {err}", type_name::<T>()));
    let back = serde_json::to_value(&object).unwrap();
    if let Some(difference) = first_difference("", json, &back) {
        panic!("{origin}: {difference}");
    }
    object
}

fn type_name<T>() -> &'static str {
    std::any::type_name::<T>().rsplit("::").next().unwrap()
}

/// The first place where what the manifest says (`written`) and what the
/// type kept of it (`read`) differ.
fn first_difference(path: &str, written: &Value, read: &Value) -> Option<String> {
    match (written, read) {
        (Value::Object(written), Value::Object(read)) => {
            for (key, value) in written {
                let here = format!("{path}.{key}");
                match read.get(key) {
                    None => {
                        return Some(format!(
                            "{here} is not a field here (misspelt, misplaced or empty?)"
                        ));
                    }
                    Some(kept) => {
                        if let Some(difference) = first_difference(&here, value, kept) {
                            return Some(difference);
                        }
                    }
                }
            }
            read.keys()
                .find(|key| !written.contains_key(*key))
                .map(|key| format!("{path}.{key} is required but missing"))
        }
        (Value::Array(written), Value::Array(read)) if written.len() == read.len() => written
            .iter()
            .zip(read)
            .enumerate()
            .find_map(|(i, (w, r))| first_difference(&format!("{path}[{i}]"), w, r)),
        _ if written == read => None,
        _ => Some(format!("{path}: written {written}, read back as {read}")),
    }
}

/// Every document of one manifest file, typed by its `apiVersion`/`kind`.
fn parse_file(path: &Path) -> Vec<Document> {
    let text = std::fs::read_to_string(path).unwrap();
    let name = path.strip_prefix(env!("CARGO_MANIFEST_DIR")).unwrap();
    let mut documents = Vec::new();
    for (index, yaml) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let origin = format!("{}, document {}", name.display(), index + 1);
        let yaml = serde_yaml::Value::deserialize(yaml)
            .unwrap_or_else(|err| panic!("{origin}: not YAML: {err}"));
        if yaml.is_null() {
            continue; // a comment-only document, or a trailing `---`
        }
        let json = serde_json::to_value(&yaml)
            .unwrap_or_else(|err| panic!("{origin}: not a JSON-shaped document: {err}"));
        let api_version = json["apiVersion"].as_str().unwrap_or_default();
        let kind = json["kind"].as_str().unwrap_or_default();
        let object = match (api_version, kind) {
            ("apps/v1", "Deployment") => Object::Deployment(typed(&origin, &json)),
            ("v1", "Service") => Object::Service(typed(&origin, &json)),
            ("v1", "ServiceAccount") => Object::ServiceAccount(typed(&origin, &json)),
            ("rbac.authorization.k8s.io/v1", "Role") => Object::Role(typed(&origin, &json)),
            ("rbac.authorization.k8s.io/v1", "RoleBinding") => {
                Object::RoleBinding(typed(&origin, &json))
            }
            ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
                Object::ClusterRole(typed(&origin, &json))
            }
            ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
                Object::ClusterRoleBinding(typed(&origin, &json))
            }
            _ => panic!(
                "{origin}: apiVersion {api_version:?}, kind {kind:?} is not one this test \
                 knows; add its k8s-openapi type to parse_file"
            ),
        };
        documents.push(Document { origin, object });
    }
    documents
}

fn all_documents() -> Vec<Document> {
    let files = manifest_files(&deploy_dir());
    assert!(!files.is_empty(), "no manifests under deploy/");
    files.iter().flat_map(|path| parse_file(path)).collect()
}

fn namespace(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> &str {
    meta.namespace.as_deref().unwrap_or("default")
}

/// The routers: Deployments whose container runs the `affinity-router` image.
fn routers(documents: &[Document]) -> Vec<(&str, &Deployment, &Container)> {
    documents
        .iter()
        .filter_map(|d| match &d.object {
            Object::Deployment(deployment) => Some((d.origin.as_str(), &**deployment)),
            _ => None,
        })
        .flat_map(|(origin, deployment)| {
            let spec = deployment.spec.as_ref().unwrap().template.spec.as_ref();
            spec.into_iter()
                .flat_map(|s| &s.containers)
                .filter(|c| c.image.as_deref().is_some_and(is_router_image))
                .map(move |c| (origin, deployment, c))
        })
        .collect()
}

fn is_router_image(image: &str) -> bool {
    let repository = image.rsplit('/').next().unwrap_or(image);
    repository.split([':', '@']).next() == Some("affinity-router")
}

#[test]
fn every_manifest_is_valid_kubernetes() {
    let documents = all_documents();
    for kind in [
        "Deployment",
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
    ] {
        assert!(
            documents.iter().any(|d| d.object.kind() == kind),
            "deploy/ has no {kind}"
        );
    }
}

#[test]
fn the_difference_check_catches_a_misspelt_field() {
    let json = serde_json::json!({
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "x", "lables": {"a": "b"}},
    });
    let result = std::panic::catch_unwind(|| typed::<ServiceAccount>("test", &json));
    let message = *result.unwrap_err().downcast::<String>().unwrap();
    assert!(message.contains(".metadata.lables"), "{message}");
}

#[test]
fn selectors_match_their_pods_and_services_find_a_deployment() {
    let documents = all_documents();
    let mut pod_labels = Vec::new();
    for d in &documents {
        if let Object::Deployment(deployment) = &d.object {
            let spec = deployment.spec.as_ref().unwrap();
            let labels = spec
                .template
                .metadata
                .as_ref()
                .and_then(|m| m.labels.clone());
            let labels = labels.unwrap_or_default();
            let wanted = spec.selector.match_labels.clone().unwrap_or_default();
            assert!(!wanted.is_empty(), "{}: empty selector", d.origin);
            assert!(
                is_subset(&wanted, &labels),
                "{}: the selector {wanted:?} does not match the pod labels {labels:?}",
                d.origin
            );
            let ports: Vec<_> = spec
                .template
                .spec
                .iter()
                .flat_map(|s| &s.containers)
                .flat_map(|c| c.ports.iter().flatten())
                .filter_map(|p| p.name.clone())
                .collect();
            pod_labels.push((namespace(&deployment.metadata).to_owned(), labels, ports));
        }
    }
    for d in &documents {
        let Object::Service(service) = &d.object else {
            continue;
        };
        let spec = service.spec.as_ref().unwrap();
        let selector = spec.selector.clone().unwrap_or_default();
        let ns = namespace(&service.metadata);
        let target = pod_labels
            .iter()
            .find(|(pod_ns, labels, _)| pod_ns == ns && is_subset(&selector, labels))
            .unwrap_or_else(|| panic!("{}: selector {selector:?} matches no pod", d.origin));
        for port in spec.ports.iter().flatten() {
            if let Some(IntOrString::String(name)) = &port.target_port {
                assert!(
                    target.2.contains(name),
                    "{}: targetPort {name} is no port of the pods",
                    d.origin
                );
            }
        }
    }
}

fn is_subset(wanted: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    wanted.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[test]
fn routers_probe_their_routes_and_run_with_flags_they_know() {
    let documents = all_documents();
    let routers = routers(&documents);
    assert!(routers.len() >= 2, "expected a regular and a P/D router");
    for (origin, _, container) in &routers {
        let ports: Vec<_> = container
            .ports
            .iter()
            .flatten()
            .filter_map(|p| p.name.as_deref())
            .collect();
        let check = |probe: Option<&Probe>, path: &str| {
            let get = probe
                .and_then(|p| p.http_get.as_ref())
                .unwrap_or_else(|| panic!("{origin}: no HTTP probe for {path}"));
            assert_eq!(get.path.as_deref(), Some(path), "{origin}");
            if let IntOrString::String(name) = &get.port {
                assert!(ports.contains(&name.as_str()), "{origin}: no port {name}");
            }
        };
        check(container.readiness_probe.as_ref(), "/readiness");
        check(container.liveness_probe.as_ref(), "/liveness");

        // `$(VAR)` is expanded by Kubernetes from the container's env.
        let env: Vec<_> = container.env.iter().flatten().map(|e| &e.name).collect();
        let mut args = vec!["affinity-router".to_owned()];
        for arg in container.args.iter().flatten() {
            let mut rest = arg.as_str();
            while let Some(start) = rest.find("$(") {
                let end = rest[start..].find(')').expect("unclosed $(") + start;
                let var = &rest[start + 2..end];
                assert!(
                    env.iter().any(|name| *name == var),
                    "{origin}: $({var}) is not in the env"
                );
                rest = &rest[end..];
            }
            args.push(arg.replace("$(POD_NAMESPACE)", "default"));
        }
        if let Err(err) = Args::try_parse_from(&args) {
            panic!("{origin}: the router refuses its arguments: {err}");
        }
    }
}

#[test]
fn routers_may_watch_pods_through_their_service_account() {
    let documents = all_documents();
    // (kind, namespace, name) of the roles that may get/list/watch pods; a
    // ClusterRole has no namespace.
    let pod_readers: Vec<(&str, &str, &str)> = documents
        .iter()
        .filter_map(|d| match &d.object {
            Object::Role(role) if grants_pod_watch(role.rules.iter().flatten()) => Some((
                "Role",
                namespace(&role.metadata),
                role.metadata.name.as_deref().unwrap(),
            )),
            Object::ClusterRole(role) if grants_pod_watch(role.rules.iter().flatten()) => {
                Some(("ClusterRole", "", role.metadata.name.as_deref().unwrap()))
            }
            _ => None,
        })
        .collect();
    for (origin, deployment, _) in routers(&documents) {
        let pod = deployment.spec.as_ref().unwrap().template.spec.as_ref();
        let account = pod
            .and_then(|s| s.service_account_name.as_deref())
            .unwrap_or_else(|| panic!("{origin}: no serviceAccountName"));
        let ns = namespace(&deployment.metadata);
        assert!(
            documents.iter().any(|d| matches!(&d.object,
                Object::ServiceAccount(sa) if sa.metadata.name.as_deref() == Some(account)
                    && namespace(&sa.metadata) == ns)),
            "{origin}: ServiceAccount {account} is not in deploy/"
        );
        let is_the_account = |s: &k8s_openapi::api::rbac::v1::Subject| {
            s.kind == "ServiceAccount" && s.name == account && s.namespace.as_deref() == Some(ns)
        };
        let bound = documents.iter().any(|d| {
            let (binding_ns, role_ref, subjects) = match &d.object {
                // A RoleBinding grants in its own namespace, from a Role
                // there or from a ClusterRole.
                Object::RoleBinding(b) => (namespace(&b.metadata), &b.role_ref, &b.subjects),
                Object::ClusterRoleBinding(b) => ("", &b.role_ref, &b.subjects),
                _ => return false,
            };
            let role_ns = if role_ref.kind == "Role" {
                binding_ns
            } else {
                ""
            };
            (binding_ns.is_empty() || binding_ns == ns)
                && pod_readers.contains(&(role_ref.kind.as_str(), role_ns, role_ref.name.as_str()))
                && subjects.iter().flatten().any(is_the_account)
        });
        assert!(
            bound,
            "{origin}: no binding in deploy/ lets {account} get/list/watch pods in {ns}"
        );
    }
}

fn grants_pod_watch<'a>(
    rules: impl Iterator<Item = &'a k8s_openapi::api::rbac::v1::PolicyRule>,
) -> bool {
    let rules: Vec<_> = rules.collect();
    ["get", "list", "watch"].iter().all(|verb| {
        rules.iter().any(|rule| {
            rule.api_groups.iter().flatten().any(|g| g.is_empty())
                && rule.resources.iter().flatten().any(|r| r == "pods")
                && rule.verbs.iter().any(|v| v == verb)
        })
    })
}

/// The JSON array of a Dockerfile instruction such as `CMD ["a", "b"]`.
fn exec_form(dockerfile: &str, instruction: &str) -> Vec<String> {
    let line = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix(instruction)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("deploy/Dockerfile has no {instruction}"));
    serde_json::from_str(line)
        .unwrap_or_else(|err| panic!("deploy/Dockerfile: {instruction} is not a JSON array: {err}"))
}

#[test]
fn the_dockerfile_runs_the_installed_program_with_flags_it_knows() {
    let dockerfile = std::fs::read_to_string(deploy_dir().join("Dockerfile")).unwrap();
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .unwrap()
        .parse::<toml::Table>()
        .unwrap();
    let bin = manifest["bin"].as_array().unwrap()[0]["name"]
        .as_str()
        .unwrap();
    assert!(
        dockerfile.contains(&format!("--bin {bin}")),
        "deploy/Dockerfile does not build the {bin} program"
    );
    let entrypoint = exec_form(&dockerfile, "ENTRYPOINT");
    assert_eq!(entrypoint, [format!("/usr/local/bin/{bin}")]);
    assert!(
        dockerfile.contains(&format!("target/release/{bin} /out/{bin}"))
            && dockerfile.contains(&format!("/out/{bin} /usr/local/bin/{bin}")),
        "deploy/Dockerfile copies another file than the program it builds"
    );
    let mut args = entrypoint;
    args.extend(exec_form(&dockerfile, "CMD"));
    if let Err(err) = Args::try_parse_from(&args) {
        panic!("deploy/Dockerfile: the router refuses its CMD: {err}");
    }
    // The runtime stage runs as a numeric non-root user (Kubernetes'
    // runAsNonRoot can only check a number).
    let user = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("USER "))
        .next_back()
        .expect("deploy/Dockerfile sets no USER");
    let uid: u32 = user
        .split(':')
        .next()
        .unwrap()
        .parse()
        .expect("numeric USER");
    assert_ne!(uid, 0, "deploy/Dockerfile runs as root");
}
