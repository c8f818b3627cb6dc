//! The `kubernetes:` discovery section every kvroute component shares: YAML → [`RawKubernetes`]
//! (unknown keys rejected) → validated [`KubernetesSource`]. Every key, its default and meaning:
//! `docs/configuration.md` (generated from the field docs below). Errors name the field relative
//! to the section (`selector`); each component places them (`.within("pools[2].discovery.kubernetes")`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvroute_config::ConfigError;
use schemars::JsonSchema;
use serde::Deserialize;

/// vLLM's default `--kv-events-config` endpoint port (`tcp://*:5557`).
pub const DEFAULT_KV_EVENTS_PORT: u16 = 5557;
/// The replay ROUTER port kvroute assumes (vLLM has no default replay endpoint; 5558 is what
/// vLLM's examples, llm-d and Dynamo deployments bind).
pub const DEFAULT_KV_REPLAY_PORT: u16 = 5558;

/// `kubernetes:`: which pods are the pool's replicas (a GIE InferencePool, or a label selector
/// and a port), and how to reach the API server. Unknown keys are errors.
#[derive(Debug, Default, Clone, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawKubernetes {
    /// Namespace of the pods (default: the client's namespace; in a pod, its own).
    namespace: Option<String>,
    /// A GIE v1 InferencePool in the namespace: its `spec.selector.matchLabels` select the pods,
    /// its `spec.targetPorts` are the ports (one replica per port). Exclusive with `selector`.
    inference_pool: Option<String>,
    /// Pods matching these labels (`matchLabels`, non-empty), e.g. `{app: vllm-llama}`; needs
    /// `target_port`. Exclusive with `inference_pool`.
    selector: Option<BTreeMap<String, String>>,
    /// With `selector`: the port routed to, a number or the name of a container port (resolved
    /// per pod, like a Service's targetPort).
    target_port: Option<RawPort>,
    /// KV-event PUB port of rank 0 when a pod does not annotate one (`kvroute.io/kv-events-port`).
    #[schemars(extend("default" = DEFAULT_KV_EVENTS_PORT))]
    kv_events_port: Option<u16>,
    /// Replay ROUTER port of rank 0 when a pod does not annotate one; `null`: no replay socket.
    /// `Some(None)`: written as `null`.
    #[serde(deserialize_with = "explicit_null")]
    #[schemars(extend("default" = DEFAULT_KV_REPLAY_PORT))]
    kv_replay_port: Option<Option<u16>>,
    /// A kubeconfig file (its current context) instead of the pod's service account.
    kubeconfig: Option<PathBuf>,
    /// A plain API server URL without credentials (tests, `kubectl proxy`), e.g.
    /// `http://127.0.0.1:6443`. Exclusive with `kubeconfig`; default: in-cluster.
    api_url: Option<String>,
    /// Only pods scheduled on this node (the agent's default: its agent id).
    node_name: Option<String>,
}

fn explicit_null<'de, D>(deserializer: D) -> Result<Option<Option<u16>>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    Option::<u16>::deserialize(deserializer).map(Some)
}

/// `pools[].discovery:` as kvroute-ext-proc and kvroute-index write it: where a pool's replicas
/// come from instead of its static `replicas:` list (Kubernetes is the one source today).
#[derive(Debug, Default, Clone, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawPoolDiscovery {
    /// The pool's replicas are the Ready pods this section selects (required in `discovery`).
    pub kubernetes: Option<RawKubernetes>,
}

/// A port as written: a number or a container port's name.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(untagged)]
enum RawPort {
    Number(u16),
    Name(String),
}

/// Which pods, and which of their ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A GIE v1 InferencePool in the namespace: its `spec.selector.matchLabels` select the
    /// pods, its `spec.targetPorts[].number` are the ports (one replica per port: a rank).
    InferencePool(String),
    /// Pods matching these labels, routed on `port`.
    Selector {
        /// `matchLabels` (non-empty).
        labels: BTreeMap<String, String>,
        /// The port.
        port: TargetPort,
    },
}

/// The port a replica is routed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetPort {
    /// The same number on every pod.
    Number(u16),
    /// The pod's container port of this name (its number may differ per pod).
    Name(String),
}

/// How to reach the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Connection {
    /// The pod's service account (`KUBERNETES_SERVICE_HOST`, the mounted token and CA).
    InCluster,
    /// A kubeconfig file (its current context).
    Kubeconfig(PathBuf),
    /// A plain URL, without credentials.
    Url(http::Uri),
}

/// A validated `kubernetes:` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesSource {
    /// The namespace (`None`: the client's default namespace).
    pub namespace: Option<String>,
    /// Which pods.
    pub target: Target,
    /// Only pods scheduled on this node (`spec.nodeName`).
    pub node_name: Option<String>,
    /// KV-event PUB port of rank 0 when a pod does not annotate one.
    pub kv_events_port: u16,
    /// Replay ROUTER port of rank 0 when a pod does not annotate one (`None`: no replay).
    pub kv_replay_port: Option<u16>,
    /// The API server.
    pub connection: Connection,
}

/// A refused value: `field` (relative to the section) and why, with the value as written.
fn invalid(field: &str, value: impl std::fmt::Display, reason: &str) -> ConfigError {
    ConfigError::at(field, format_args!("{reason} (got '{value}')"))
}

impl KubernetesSource {
    /// The same source restricted to pods on `node` (the agent's own node).
    pub fn on_node(mut self, node: impl Into<String>) -> Self {
        self.node_name = Some(node.into());
        self
    }
}

impl TryFrom<RawKubernetes> for KubernetesSource {
    type Error = ConfigError;

    /// Validates the section; errors name the field relative to it.
    fn try_from(raw: RawKubernetes) -> Result<Self, Self::Error> {
        if let Some(namespace) = raw.namespace.as_deref()
            && !is_dns_label(namespace)
        {
            return Err(invalid(
                "namespace",
                namespace,
                "expected a Kubernetes namespace name (DNS label)",
            ));
        }
        let target = match (raw.inference_pool, raw.selector) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "selector",
                    "…",
                    "inference_pool and selector are mutually exclusive",
                ));
            }
            (None, None) => {
                return Err(invalid(
                    "inference_pool",
                    "",
                    "one of inference_pool or selector is required",
                ));
            }
            (Some(pool), None) => {
                if !is_dns_subdomain(&pool) {
                    return Err(invalid("inference_pool", pool, "expected an object name"));
                }
                if let Some(port) = &raw.target_port {
                    return Err(invalid(
                        "target_port",
                        port_text(port),
                        "the InferencePool's targetPorts decide the ports",
                    ));
                }
                Target::InferencePool(pool)
            }
            (None, Some(labels)) => {
                if labels.is_empty() {
                    return Err(invalid(
                        "selector",
                        "{}",
                        "an empty selector would select every pod in the namespace",
                    ));
                }
                if let Some((key, value)) = labels
                    .iter()
                    .find(|(k, v)| !is_label_key(k) || !is_label_value(v))
                {
                    return Err(invalid(
                        "selector",
                        format!("{key}={value}"),
                        "expected a label key and value",
                    ));
                }
                let port = match raw.target_port {
                    None => {
                        return Err(invalid("target_port", "", "required with selector"));
                    }
                    Some(RawPort::Number(0)) => {
                        return Err(invalid("target_port", 0, "must be 1-65535"));
                    }
                    Some(RawPort::Number(n)) => TargetPort::Number(n),
                    Some(RawPort::Name(name)) if is_port_name(&name) => TargetPort::Name(name),
                    Some(RawPort::Name(name)) => {
                        return Err(invalid(
                            "target_port",
                            name,
                            "expected a port number or a container port name",
                        ));
                    }
                };
                Target::Selector { labels, port }
            }
        };
        let connection = match (raw.kubeconfig, raw.api_url) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "api_url",
                    "…",
                    "kubeconfig and api_url are mutually exclusive",
                ));
            }
            (Some(path), None) => Connection::Kubeconfig(path),
            (None, Some(url)) => {
                let uri: http::Uri = url
                    .parse()
                    .map_err(|_| invalid("api_url", &url, "expected a URL"))?;
                if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
                    return Err(invalid(
                        "api_url",
                        url,
                        "expected http:// or https:// with a host",
                    ));
                }
                Connection::Url(uri)
            }
            (None, None) => Connection::InCluster,
        };
        let kv_events_port = raw.kv_events_port.unwrap_or(DEFAULT_KV_EVENTS_PORT);
        let kv_replay_port = raw.kv_replay_port.unwrap_or(Some(DEFAULT_KV_REPLAY_PORT));
        if kv_events_port == 0 || kv_replay_port == Some(0) {
            return Err(invalid("kv_events_port", 0, "ports must be 1-65535"));
        }
        if let Some(node) = raw.node_name.as_deref()
            && !is_dns_subdomain(node)
        {
            return Err(invalid("node_name", node, "expected a node name"));
        }
        Ok(Self {
            namespace: raw.namespace,
            target,
            node_name: raw.node_name,
            kv_events_port,
            kv_replay_port,
            connection,
        })
    }
}

fn port_text(port: &RawPort) -> String {
    match port {
        RawPort::Number(n) => n.to_string(),
        RawPort::Name(name) => name.clone(),
    }
}

/// RFC 1123 label: what namespace names are.
fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// RFC 1123 subdomain: what object and node names are.
fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// A label key: optional `prefix/` (a subdomain) and a name.
fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    prefix.is_none_or(is_dns_subdomain) && !name.is_empty() && is_label_value(name)
}

/// A label value: at most 63 alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric.
fn is_label_value(value: &str) -> bool {
    value.is_empty()
        || (value.len() <= 63
            && value
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && value.starts_with(|c: char| c.is_ascii_alphanumeric())
            && value.ends_with(|c: char| c.is_ascii_alphanumeric()))
}

/// An IANA service name: what container port names are (at most 15, lowercase, a letter).
fn is_port_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 15
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && name.bytes().any(|b| b.is_ascii_lowercase())
        && !name.starts_with('-')
        && !name.ends_with('-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<KubernetesSource, String> {
        let raw: RawKubernetes = kvroute_config::from_yaml(yaml).map_err(|e| e.to_string())?;
        KubernetesSource::try_from(raw).map_err(|e| e.to_string())
    }

    #[test]
    fn an_inference_pool_gets_the_defaults() {
        let source = parse("{namespace: llm, inference_pool: llama}").unwrap();
        assert_eq!(source.target, Target::InferencePool("llama".into()));
        assert_eq!(source.kv_events_port, 5557);
        assert_eq!(source.kv_replay_port, Some(5558));
        assert_eq!(source.connection, Connection::InCluster);
        assert_eq!(source.node_name, None);
    }

    #[test]
    fn a_selector_takes_a_port_number_or_name() {
        let source =
            parse("{selector: {app: vllm}, target_port: http, kv_replay_port: null}").unwrap();
        assert_eq!(
            source.target,
            Target::Selector {
                labels: [("app".to_owned(), "vllm".to_owned())].into(),
                port: TargetPort::Name("http".into()),
            }
        );
        assert_eq!(source.kv_replay_port, None);
        let numbered = parse("{selector: {app: vllm}, target_port: 8000}").unwrap();
        assert!(matches!(
            numbered.target,
            Target::Selector {
                port: TargetPort::Number(8000),
                ..
            }
        ));
    }

    #[test]
    fn errors_name_the_field() {
        for (yaml, field) in [
            ("{inference_pool: a, selector: {app: b}}", "selector"),
            ("{namespace: llm}", "inference_pool"),
            ("{selector: {}, target_port: 1}", "selector"),
            ("{selector: {app: b}}", "target_port"),
            ("{inference_pool: a, target_port: 80}", "target_port"),
            (
                "{selector: {app: b}, target_port: Not_A_Name}",
                "target_port",
            ),
            (
                "{inference_pool: a, kubeconfig: /k, api_url: \"http://x\"}",
                "api_url",
            ),
            ("{inference_pool: a, api_url: \"ftp://x\"}", "api_url"),
            ("{inference_pool: a, namespace: Bad_NS}", "namespace"),
            ("{selector: {\"bad key!\": b}, target_port: 1}", "selector"),
        ] {
            let error = parse(yaml).unwrap_err();
            assert!(error.starts_with(field), "{yaml}: {error}");
        }
        assert!(
            parse("{inference_pool: a, unknown: 1}")
                .unwrap_err()
                .starts_with("unknown: unknown key")
        );
    }

    #[test]
    fn a_config_error_names_its_field_path() {
        let raw: RawKubernetes =
            kvroute_config::from_yaml("{selector: {app: b}, target_port: 0}").unwrap();
        let error = KubernetesSource::try_from(raw)
            .unwrap_err()
            .within("pools[1].discovery.kubernetes");
        assert_eq!(error.path(), "pools[1].discovery.kubernetes.target_port");
        assert_eq!(
            error.to_string(),
            "pools[1].discovery.kubernetes.target_port: must be 1-65535 (got '0')"
        );
        let error = kvroute_config::from_yaml::<Vec<RawPoolDiscovery>>(
            "[{kubernetes: {inference_pool: a}}, {kubernetes: {inference_pool: a, nope: 1}}]",
        )
        .unwrap_err();
        assert_eq!(error.path(), "[1].kubernetes.nope");
    }
}
