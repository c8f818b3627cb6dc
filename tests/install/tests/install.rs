//! The Kubernetes install (deploy/helm/kvroute), rendered by Helm's own engine for the default
//! values and every example values file: each document is the kind it claims (typed round trip),
//! each kvroute binary accepts the config its pod would read (files laid out as the pod mounts
//! them), all three discover the one pool (no static replicas; the agents are the index's node
//! agents), the RBAC grants exactly what discovery reads to each account, and names and ports
//! agree across Services, containers, probes (ext-proc's: gRPC `inference-extension` on 9003),
//! configs, the InferencePool, the routes and the example vLLM pool, whose pod the rendered
//! `discovery:` sections find through kvroute-discovery's API server double (a real API server
//! cannot be installed here). Skips, saying so, without the engine
//! (`bash scripts/setup.sh` installs it; under CI its absence fails).

// Helpers outside `#[test]` fns fail the test by panicking, exactly like the tests themselves.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a panic is a failure"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Container, PodSpec, Probe, Service};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kvroute_discovery::testing::{ApiServer, Resource};
use kvroute_install_tests::{
    Doc, NAMESPACE, Object, crd, parse_stream, render, renderer, repo_root,
};
use tokio_util::task::TaskTracker;

/// Every install the tests render: the default values, then each example alone.
const INSTALLS: &[(&str, &[&str])] = &[
    ("defaults", &[]),
    ("istio", &["deploy/helm/examples/istio.yaml"]),
    (
        "envoy-gateway",
        &["deploy/helm/examples/envoy-gateway.yaml"],
    ),
    (
        "envoy-ai-gateway",
        &["deploy/helm/examples/envoy-ai-gateway.yaml"],
    ),
    ("agentless", &["deploy/helm/examples/agentless.yaml"]),
    (
        "istio-envoyfilter",
        &["deploy/helm/examples/istio-envoyfilter.yaml"],
    ),
    (
        "chunked-local-attention",
        &["deploy/helm/examples/chunked-local-attention.yaml"],
    ),
    ("tracing", &["deploy/helm/examples/tracing.yaml"]),
];

struct Install {
    name: &'static str,
    docs: Vec<Doc>,
}

impl Install {
    fn find(&self, kind: &str, name: &str) -> &Doc {
        self.docs
            .iter()
            .find(|d| d.kind() == kind && d.name() == name)
            .unwrap_or_else(|| panic!("{}: no {kind} {name:?}", self.name))
    }

    fn of_kind<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = &'a Doc> + 'a {
        self.docs.iter().filter(move |d| d.kind() == kind)
    }

    /// Deployments, StatefulSets and DaemonSets: (doc, pod labels, pod spec).
    fn workloads(&self) -> Vec<(&Doc, BTreeMap<String, String>, &PodSpec)> {
        self.docs
            .iter()
            .filter_map(|doc| {
                let template = match &doc.object {
                    Object::Deployment(d) => &d.spec.template,
                    Object::StatefulSet(s) => &s.spec.template,
                    Object::DaemonSet(d) => &d.spec.template,
                    _ => return None,
                };
                let labels = template
                    .metadata
                    .as_ref()?
                    .labels
                    .clone()
                    .unwrap_or_default();
                Some((doc, labels, template.spec.as_ref()?))
            })
            .collect()
    }

    fn service(&self, name: &str) -> &Service {
        match &self.find("Service", name).object {
            Object::Service(s) => s,
            _ => unreachable!(),
        }
    }
}

/// The renders, or `None` (printed SKIP) without the Helm engine.
fn installs(test: &str) -> Option<Vec<Install>> {
    let Some(python) = renderer() else {
        eprintln!(
            "SKIP {test}: no Python with Helm's engine (helm_python; bash scripts/setup.sh installs helm-python-sdk)"
        );
        return None;
    };
    Some(
        INSTALLS
            .iter()
            .map(|(name, values)| {
                let stream = render(&python, values).unwrap_or_else(|e| panic!("{name}: {e}"));
                let docs = parse_stream(&stream).unwrap_or_else(|e| panic!("{name}: {e}"));
                Install { name, docs }
            })
            .collect(),
    )
}

#[test]
fn every_example_values_file_is_rendered() {
    let dir = repo_root().join("deploy/helm/examples");
    let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| {
            format!(
                "deploy/helm/examples/{}",
                e.unwrap().file_name().to_string_lossy()
            )
        })
        .collect();
    let tested: BTreeSet<String> = INSTALLS
        .iter()
        .flat_map(|(_, files)| files.iter().map(|f| f.to_string()))
        .collect();
    assert_eq!(on_disk, tested, "add each example to INSTALLS");
}

#[test]
fn every_install_renders_and_every_document_is_its_kind() {
    let Some(installs) = installs("every_install_renders_and_every_document_is_its_kind") else {
        return;
    };
    for install in &installs {
        let agents = install.name != "agentless";
        let count = |kind| install.of_kind(kind).count();
        let expected = [
            ("Deployment", 1),
            // Two pickers acting as one, one of them kept through voluntary disruptions.
            ("PodDisruptionBudget", 1),
            ("StatefulSet", 1),
            ("DaemonSet", usize::from(agents)),
            ("Service", 3),
            ("ConfigMap", 2 + usize::from(agents)),
            // The tokens; ext_proc's self-signed certificate is made by each pod at start.
            ("Secret", 2),
            ("ServiceAccount", 2 + usize::from(agents)),
            ("Role", 1),
            ("RoleBinding", 1),
            (
                "InferencePool",
                usize::from(install.name != "istio-envoyfilter"),
            ),
            (
                "HTTPRoute",
                usize::from(matches!(install.name, "istio" | "envoy-gateway")),
            ),
            (
                "AIGatewayRoute",
                usize::from(install.name == "envoy-ai-gateway"),
            ),
        ];
        for (kind, n) in expected {
            assert_eq!(count(kind), n, "{}: {kind}", install.name);
        }
        assert_eq!(
            install.docs.len(),
            expected.iter().map(|(_, n)| n).sum::<usize>(),
            "{}: unexpected documents",
            install.name
        );
        let picker = install.of_kind("Deployment").next().unwrap();
        let budget = install.of_kind("PodDisruptionBudget").next().unwrap();
        assert!(
            picker.value["spec"]["replicas"].as_u64() > Some(1),
            "{}: several pickers",
            install.name
        );
        assert_eq!(
            budget.value["spec"]["selector"]["matchLabels"],
            picker.value["spec"]["template"]["metadata"]["labels"],
            "{}: the budget covers the pickers",
            install.name
        );
        let mut seen = BTreeSet::new();
        for doc in &install.docs {
            assert!(
                seen.insert((doc.kind(), doc.name())),
                "{}: {} {} twice",
                install.name,
                doc.kind(),
                doc.name()
            );
            assert_eq!(
                doc.value["metadata"]["namespace"], NAMESPACE,
                "{}: {}",
                install.name, doc.source
            );
        }
        // Tokens are generated, never empty, and not the same secret twice.
        let tokens: BTreeSet<Vec<u8>> = install
            .of_kind("Secret")
            .filter_map(|doc| match &doc.object {
                Object::Secret(s) => Some(s.data.as_ref()?.get("token")?.0.clone()),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(tokens.len(), 2, "{}", install.name);
        assert!(tokens.iter().all(|t| t.len() >= 32), "{}", install.name);
    }
}

#[test]
fn a_misspelled_or_misplaced_key_fails_the_kind_check() {
    let deployment = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replica: 2\n  selector: {matchLabels: {a: b}}\n  template: {metadata: {labels: {a: b}}, spec: {containers: [{name: c, image: i}]}}\n";
    let error = parse_stream(deployment).unwrap_err();
    assert!(error.contains("/spec/replica (lost)"), "{error}");
    assert!(parse_stream(&deployment.replace("replica:", "replicas:")).is_ok());
    // The pre-v1 spelling of the picker's port is not InferencePool v1.
    let pool = "apiVersion: inference.networking.k8s.io/v1\nkind: InferencePool\nmetadata: {name: p}\nspec:\n  selector: {matchLabels: {app: v}}\n  targetPorts: [{number: 8000}]\n  endpointPickerRef: {name: epp, portNumber: 9002}\n";
    let error = parse_stream(pool).unwrap_err();
    assert!(error.contains("portNumber"), "{error}");
    assert!(parse_stream(&pool.replace("portNumber: 9002", "port: {number: 9002}")).is_ok());
    let error = parse_stream("apiVersion: v1\nkind: Pdo\nmetadata: {name: x}\n").unwrap_err();
    assert!(error.contains("no type"), "{error}");
}

/// A kvroute config as the binary that reads it parsed it.
enum Parsed {
    ExtProc(Box<kvroute_ext_proc::Config>),
    Index(Box<kvroute_index::config::Config>),
    /// One per node the DaemonSet runs on (its NODE_NAME).
    Agent(Vec<(String, kvroute_agent::AgentConfig)>),
}

struct Loaded<'a> {
    workload: &'a Doc,
    labels: BTreeMap<String, String>,
    pod: &'a PodSpec,
    container: &'a Container,
    config: Parsed,
}

/// Each kvroute container's config, read as its pod would: the ConfigMaps and Secrets it
/// mounts written out under a temporary root, the `--config` file taken from there (so a file
/// no ConfigMap holds fails), the paths inside the config pointed at the same root.
fn load_configs(install: &Install) -> Vec<Loaded<'_>> {
    let mut loaded = Vec::new();
    for (workload, labels, pod) in install.workloads() {
        for container in &pod.containers {
            let command = container.command.clone().unwrap_or_default();
            let binary = Path::new(&command[0])
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let at = command
                .iter()
                .position(|a| a == "--config")
                .expect("--config");
            let config_path = &command[at + 1];
            let root = tempfile::tempdir().unwrap();
            let mut mounts = Vec::new();
            for mount in container.volume_mounts.iter().flatten() {
                let volume = pod
                    .volumes
                    .iter()
                    .flatten()
                    .find(|v| v.name == mount.name)
                    .unwrap_or_else(|| {
                        panic!(
                            "{}: {}: mount {} has no volume",
                            install.name,
                            workload.name(),
                            mount.name
                        )
                    });
                let files: Vec<(String, Vec<u8>)> = if let Some(cm) = &volume.config_map {
                    match &install.find("ConfigMap", &cm.name).object {
                        Object::ConfigMap(c) => c
                            .data
                            .clone()
                            .unwrap_or_default()
                            .into_iter()
                            .map(|(k, v)| (k, v.into_bytes()))
                            .collect(),
                        _ => unreachable!(),
                    }
                } else if let Some(secret) = &volume.secret {
                    match &install
                        .find("Secret", secret.secret_name.as_deref().unwrap())
                        .object
                    {
                        Object::Secret(s) => s
                            .data
                            .clone()
                            .unwrap_or_default()
                            .into_iter()
                            .map(|(k, v)| (k, v.0))
                            .collect(),
                        _ => unreachable!(),
                    }
                } else {
                    panic!(
                        "{}: volume {} is neither a ConfigMap nor a Secret",
                        install.name, volume.name
                    );
                };
                let dir = root.path().join(mount.mount_path.trim_start_matches('/'));
                std::fs::create_dir_all(&dir).unwrap();
                for (key, bytes) in files {
                    std::fs::write(dir.join(key), bytes).unwrap();
                }
                mounts.push((
                    format!("{}/", mount.mount_path),
                    format!("{}/", dir.display()),
                ));
            }
            let on_disk = root.path().join(config_path.trim_start_matches('/'));
            let mut text = std::fs::read_to_string(&on_disk).unwrap_or_else(|e| {
                panic!(
                    "{}: {}: {config_path} is in no mounted ConfigMap: {e}",
                    install.name,
                    workload.name()
                )
            });
            for (in_pod, here) in &mounts {
                text = text.replace(in_pod, here);
            }
            let context = format!("{}: {} ({binary})", install.name, workload.name());
            let config = match binary.as_str() {
                "kvroute-ext-proc" => Parsed::ExtProc(Box::new(
                    kvroute_ext_proc::Config::from_yaml(&text)
                        .unwrap_or_else(|e| panic!("{context}: {e}\n{text}")),
                )),
                "kvroute-index" => Parsed::Index(Box::new(
                    kvroute_index::config::Config::from_yaml(&text)
                        .unwrap_or_else(|e| panic!("{context}: {e}\n{text}")),
                )),
                "kvroute-agent" => Parsed::Agent(
                    NODES
                        .iter()
                        .map(|node| node.to_string())
                        .map(|node| {
                            let env = |name: &str| container_env(container, name, &node);
                            let config = kvroute_agent::AgentConfig::from_yaml_with_env(&text, env)
                                .unwrap_or_else(|e| panic!("{context} on {node}: {e}\n{text}"));
                            (node, config)
                        })
                        .collect(),
                ),
                other => panic!("{context}: not a kvroute binary: {other}"),
            };
            loaded.push(Loaded {
                workload,
                labels: labels.clone(),
                pod,
                container,
                config,
            });
        }
    }
    loaded
}

/// The nodes the agent DaemonSet's pods are modelled on (it runs on every node its selector and
/// tolerations allow; any names do).
const NODES: [&str; 2] = ["gpu-node-1", "gpu-node-2"];

/// What the kubelet would put in the container's environment for `name` on `node`.
fn container_env(container: &Container, name: &str, node: &str) -> Option<String> {
    let var = container.env.iter().flatten().find(|v| v.name == name)?;
    if let Some(value) = &var.value {
        return Some(value.clone());
    }
    let field = var.value_from.as_ref()?.field_ref.as_ref()?;
    assert_eq!(
        field.field_path, "spec.nodeName",
        "{name}: only spec.nodeName is modelled"
    );
    Some(node.to_owned())
}

#[test]
fn every_binary_accepts_the_config_its_pod_mounts_and_all_discover_the_one_pool() {
    let Some(installs) =
        installs("every_binary_accepts_the_config_its_pod_mounts_and_all_discover_the_one_pool")
    else {
        return;
    };
    for install in &installs {
        let loaded = load_configs(install);
        let index = loaded.iter().find_map(|l| match &l.config {
            Parsed::Index(c) => Some(c),
            _ => None,
        });
        let index = index.unwrap_or_else(|| panic!("{}: no index", install.name));
        let ext_proc = loaded.iter().find_map(|l| match &l.config {
            Parsed::ExtProc(c) => Some(c),
            _ => None,
        });
        let ext_proc = ext_proc.unwrap_or_else(|| panic!("{}: no ext-proc", install.name));
        assert_eq!(ext_proc.pools[0].name, index.pools[0].name);
        // `pool.attentionChunkSize` reaches the index (only the chunked-local example sets it).
        let chunk = (install.name == "chunked-local-attention").then_some(8192);
        assert_eq!(
            index.pools[0].attention_chunk_size, chunk,
            "{}",
            install.name
        );
        assert_eq!(ext_proc.pools[0].block_size, index.pools[0].block_size);
        assert!(
            ext_proc.index_token.is_some(),
            "{}: ext-proc sends the query token",
            install.name
        );
        assert!(
            index.query_token.is_some(),
            "{}: the index requires it",
            install.name
        );
        // No static replicas: both discover the pool's pods, in-cluster, in the release
        // namespace.
        assert!(
            ext_proc.replicas.is_empty() && index.replicas.is_empty() && index.agents.is_empty(),
            "{}: static replicas",
            install.name
        );
        let source = ext_proc.pools[0]
            .discovery
            .clone()
            .unwrap_or_else(|| panic!("{}: ext-proc discovers no pool", install.name));
        assert_eq!(index.pools[0].discovery.as_ref(), Some(&source));
        assert_eq!(source.namespace.as_deref(), Some(NAMESPACE));
        match install.of_kind("InferencePool").next() {
            Some(pool) => assert_eq!(
                source.target,
                kvroute_discovery::Target::InferencePool(pool.name().to_owned()),
                "{}: the pool the chart creates",
                install.name
            ),
            // Without GIE's CRDs: the pods by label (the example vLLM pool's test discovers
            // them with this section).
            None => assert!(
                matches!(&source.target, kvroute_discovery::Target::Selector { labels, .. } if !labels.is_empty()),
                "{}: {:?}",
                install.name,
                source.target
            ),
        }
        assert_eq!(source.connection, kvroute_discovery::Connection::InCluster);
        assert_eq!(
            source.node_name, None,
            "ext-proc and the index see every node"
        );
        let agents: Vec<&(String, kvroute_agent::AgentConfig)> = loaded
            .iter()
            .filter_map(|l| match &l.config {
                Parsed::Agent(per_node) => Some(per_node),
                _ => None,
            })
            .flatten()
            .collect();
        if install.name == "agentless" {
            assert!(agents.is_empty());
            assert!(
                index.node_agents.is_none(),
                "{}: the index subscribes to the discovered pods itself",
                install.name
            );
            continue;
        }
        // Each node's agent is the node agent the index expects: its id the node name, the
        // shared token, the same pool's pods on its own node only, nothing static.
        let node_agents = index
            .node_agents
            .as_ref()
            .unwrap_or_else(|| panic!("{}: the index takes no node agents", install.name));
        assert_eq!(agents.len(), NODES.len(), "{}", install.name);
        for (node, agent) in &agents {
            assert_eq!(&agent.agent_id, node);
            assert!(agent.engines.is_empty(), "{node}: static engines");
            assert_eq!(
                agent.discovery.as_ref(),
                Some(&source.clone().on_node(node.as_str())),
                "{node}: the agent discovers the pool's pods on its node"
            );
            assert!(
                node_agents.matches(agent.token.expose()),
                "{node}: the index expects the token the agent sends"
            );
        }
    }
}

/// The container port a Service's or probe's target names (by name or number).
fn container_port(container: &Container, target: &IntOrString) -> Option<u16> {
    container.ports.iter().flatten().find_map(|p| {
        let hit = match target {
            IntOrString::Int(n) => p.container_port == *n,
            IntOrString::String(name) => p.name.as_deref() == Some(name.as_str()),
        };
        hit.then(|| u16::try_from(p.container_port).unwrap())
    })
}

/// The ports a kvroute config listens on, by container port name; every one on all interfaces.
fn listen_ports(config: &Parsed) -> Vec<(&'static str, std::net::SocketAddr)> {
    match config {
        Parsed::ExtProc(c) => {
            let mut ports = vec![("grpc", c.grpc_addr), ("admin", c.admin_addr)];
            ports.extend(c.health_addr.map(|a| ("grpc-health", a)));
            ports
        }
        Parsed::Index(c) => vec![("grpc", c.grpc_addr), ("admin", c.admin_addr)],
        Parsed::Agent(per_node) => vec![("admin", per_node[0].1.admin_addr)],
    }
}

/// `http://<pod>.<headless service>.<namespace>.svc:<port>` of every index pod, in order.
fn index_urls(install: &Install, loaded: &[Loaded<'_>]) -> Vec<String> {
    let doc = install.of_kind("StatefulSet").next().unwrap();
    let Object::StatefulSet(sts) = &doc.object else {
        unreachable!()
    };
    let sts: &StatefulSet = sts;
    let spec = &sts.spec;
    let headless = install.service(spec.service_name.as_deref().unwrap());
    let headless_spec = headless.spec.as_ref().unwrap();
    assert_eq!(
        headless_spec.cluster_ip.as_deref(),
        Some("None"),
        "per-pod names need a headless Service"
    );
    assert_eq!(
        headless_spec.publish_not_ready_addresses,
        Some(true),
        "agents must reach index pods before they are ready"
    );
    let port = &headless_spec.ports.as_ref().unwrap()[0];
    let index = loaded
        .iter()
        .find(|l| l.workload.name() == doc.name())
        .unwrap();
    let Parsed::Index(config) = &index.config else {
        unreachable!()
    };
    assert_eq!(
        container_port(index.container, port.target_port.as_ref().unwrap()),
        Some(config.grpc_addr.port()),
        "the headless Service reaches the index's gRPC listener"
    );
    (0..spec.replicas.unwrap())
        .map(|i| {
            format!(
                "http://{}-{i}.{}.{NAMESPACE}.svc:{}",
                doc.name(),
                headless.metadata.name.as_deref().unwrap(),
                port.port
            )
        })
        .collect()
}

#[test]
fn services_containers_probes_configs_and_references_agree_on_names_and_ports() {
    let Some(installs) =
        installs("services_containers_probes_configs_and_references_agree_on_names_and_ports")
    else {
        return;
    };
    for install in &installs {
        let loaded = load_configs(install);
        // Containers declare the ports their binary listens on, on all interfaces.
        for l in &loaded {
            for (name, addr) in listen_ports(&l.config) {
                assert!(
                    addr.ip().is_unspecified(),
                    "{}: {} listens on {addr}: a Service cannot reach loopback",
                    install.name,
                    l.workload.name()
                );
                assert_eq!(
                    container_port(l.container, &IntOrString::String(name.into())),
                    Some(addr.port()),
                    "{}: {} container port {name}",
                    install.name,
                    l.workload.name()
                );
            }
            // Probes ask a port the binary serves.
            let served: BTreeSet<u16> = listen_ports(&l.config)
                .iter()
                .map(|(_, a)| a.port())
                .collect();
            let probes: [&Option<Probe>; 2] =
                [&l.container.liveness_probe, &l.container.readiness_probe];
            for probe in probes.into_iter().flatten() {
                let port = match (&probe.http_get, &probe.grpc) {
                    (Some(http), None) => container_port(l.container, &http.port),
                    (None, Some(grpc)) => u16::try_from(grpc.port).ok(),
                    _ => panic!(
                        "{}: {}: a probe is one of httpGet or grpc",
                        install.name,
                        l.workload.name()
                    ),
                };
                assert!(
                    port.is_some_and(|p| served.contains(&p)),
                    "{}: {} probes {port:?}, serves {served:?}",
                    install.name,
                    l.workload.name()
                );
            }
            if let Parsed::ExtProc(c) = &l.config {
                // TLS on the ext_proc port exactly where a gateway dials it with TLS (and
                // accepts any certificate): self-signed at start, no certificate to mount.
                let tls = install.name.starts_with("envoy-");
                assert_eq!(c.secure_serving, tls, "{}", install.name);
                assert!(c.grpc_tls.is_none(), "{}", install.name);
                // GIE's and llm-d's probes: gRPC health `inference-extension` on the plaintext
                // health port, 9003, whatever the ext_proc port speaks.
                let health = c.health_addr.expect("listen.health");
                assert_eq!(health.port(), 9003, "{}", install.name);
                for (what, probe) in [
                    ("liveness", &l.container.liveness_probe),
                    ("readiness", &l.container.readiness_probe),
                ] {
                    let grpc = probe
                        .as_ref()
                        .and_then(|p| p.grpc.as_ref())
                        .unwrap_or_else(|| panic!("{}: {what}: not a gRPC probe", install.name));
                    assert_eq!(grpc.port, i32::from(health.port()), "{what}");
                    assert_eq!(
                        grpc.service.as_deref(),
                        Some("inference-extension"),
                        "{what}"
                    );
                }
                assert_eq!(c.admin_addr.port(), 9090, "metrics on the admin port");
            }
        }
        // Every Service selects exactly one workload, and each of its ports reaches a port the
        // workload's binary listens on.
        for doc in install.of_kind("Service") {
            let Object::Service(service) = &doc.object else {
                unreachable!()
            };
            let spec = service.spec.as_ref().unwrap();
            let selector = spec.selector.clone().unwrap_or_default();
            let selected: Vec<&Loaded<'_>> = loaded
                .iter()
                .filter(|l| {
                    !selector.is_empty() && selector.iter().all(|(k, v)| l.labels.get(k) == Some(v))
                })
                .collect();
            assert_eq!(
                selected.len(),
                1,
                "{}: Service {} selects {} workloads",
                install.name,
                doc.name(),
                selected.len()
            );
            let target = selected[0];
            let served: BTreeSet<u16> = listen_ports(&target.config)
                .iter()
                .map(|(_, a)| a.port())
                .collect();
            for port in spec.ports.iter().flatten() {
                let reached = container_port(target.container, port.target_port.as_ref().unwrap());
                assert!(
                    reached.is_some_and(|p| served.contains(&p)),
                    "{}: Service {} port {} reaches {reached:?}",
                    install.name,
                    doc.name(),
                    port.port
                );
            }
        }
        // ext-proc and the agents reach every index pod by its stable name.
        let urls = index_urls(install, &loaded);
        for l in &loaded {
            match &l.config {
                Parsed::ExtProc(c) => {
                    let got: Vec<String> = c
                        .index_addresses
                        .iter()
                        .map(|u| u.to_string().trim_end_matches('/').to_owned())
                        .collect();
                    assert_eq!(got, urls, "{}: ext-proc index.addresses", install.name);
                }
                Parsed::Agent(per_node) => {
                    for (node, agent) in per_node {
                        assert_eq!(
                            agent.indexes, urls,
                            "{}: {node}'s agent indexes",
                            install.name
                        );
                    }
                }
                Parsed::Index(_) => {}
            }
        }
        // Least privilege: read-only pods and InferencePools (what discovery watches), bound
        // to the account of every kvroute workload, each of which mounts its token.
        let Object::Role(role) = &install.of_kind("Role").next().unwrap().object else {
            unreachable!()
        };
        let mut granted = BTreeSet::new();
        for rule in role.rules.iter().flatten() {
            assert_eq!(rule.verbs, ["get", "list", "watch"], "{}", install.name);
            for group in rule.api_groups.iter().flatten() {
                for resource in rule.resources.iter().flatten() {
                    granted.insert((group.as_str(), resource.as_str()));
                }
            }
        }
        assert_eq!(
            granted,
            [
                ("", "pods"),
                ("inference.networking.k8s.io", "inferencepools")
            ]
            .into(),
            "{}",
            install.name
        );
        let Object::RoleBinding(binding) = &install.of_kind("RoleBinding").next().unwrap().object
        else {
            unreachable!()
        };
        assert_eq!(binding.role_ref.kind, "Role");
        assert_eq!(Some(&binding.role_ref.name), role.metadata.name.as_ref());
        let subjects: BTreeSet<&str> = binding
            .subjects
            .iter()
            .flatten()
            .inspect(|s| {
                assert_eq!(s.kind, "ServiceAccount");
                assert_eq!(s.namespace.as_deref(), Some(NAMESPACE));
            })
            .map(|s| s.name.as_str())
            .collect();
        let accounts: BTreeSet<&str> = loaded
            .iter()
            .map(|l| {
                assert_ne!(
                    l.pod.automount_service_account_token,
                    Some(false),
                    "{}: {}: discovery needs the account's token",
                    install.name,
                    l.workload.name()
                );
                l.pod.service_account_name.as_deref().unwrap()
            })
            .collect();
        assert_eq!(accounts.len(), loaded.len(), "one account per workload");
        assert_eq!(subjects, accounts, "{}", install.name);
        let service_accounts: BTreeSet<&str> =
            install.of_kind("ServiceAccount").map(Doc::name).collect();
        assert_eq!(service_accounts, accounts, "{}", install.name);
        // The InferencePool's picker is the ext-proc Service's gRPC port.
        let Some(pool) = install.of_kind("InferencePool").next() else {
            // No pool (istio-envoyfilter): nothing routes to one.
            assert_eq!(
                install.of_kind("HTTPRoute").count() + install.of_kind("AIGatewayRoute").count(),
                0,
                "{}",
                install.name
            );
            continue;
        };
        let Object::InferencePool(pool) = &pool.object else {
            unreachable!()
        };
        let picker = &pool.spec.endpoint_picker_ref;
        assert_eq!(picker.kind.as_deref(), Some("Service"));
        assert_eq!(
            picker.failure_mode,
            Some(crd::FailureMode::FailOpen),
            "kvroute never refuses a request because a part of kvroute is unwell"
        );
        let service = install.service(&picker.name);
        let number = picker.port.unwrap().number;
        let port = service
            .spec
            .as_ref()
            .unwrap()
            .ports
            .iter()
            .flatten()
            .find(|p| p.port == i32::from(number))
            .expect("picker port on the Service");
        let ext_proc = loaded
            .iter()
            .find(|l| matches!(l.config, Parsed::ExtProc(_)))
            .unwrap();
        let Parsed::ExtProc(config) = &ext_proc.config else {
            unreachable!()
        };
        assert_eq!(
            container_port(ext_proc.container, port.target_port.as_ref().unwrap()),
            Some(config.grpc_addr.port())
        );
        assert_eq!(
            port.app_protocol.as_deref(),
            Some("http2"),
            "ext_proc is gRPC: the gateway's cluster must speak HTTP/2"
        );
        // The routes name the pool.
        let pool_name = pool.metadata.name.as_deref().unwrap();
        let mut backends = Vec::new();
        for doc in &install.docs {
            match &doc.object {
                Object::HttpRoute(r) => backends.extend(
                    r.spec
                        .rules
                        .iter()
                        .flat_map(|r| r.backend_refs.iter().flatten()),
                ),
                Object::AiGatewayRoute(r) => {
                    backends.extend(r.spec.rules.iter().flat_map(|r| r.backend_refs.iter()))
                }
                _ => {}
            }
        }
        for backend in backends {
            assert_eq!(
                backend.group.as_deref(),
                Some("inference.networking.k8s.io")
            );
            assert_eq!(backend.kind.as_deref(), Some("InferencePool"));
            assert_eq!(backend.name, pool_name);
        }
    }
}

/// `--name=value` from a container's args.
fn arg<'a>(container: &'a Container, name: &str) -> &'a str {
    container
        .args
        .iter()
        .flatten()
        .find_map(|a| a.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("vLLM arg {name}"))
}

#[tokio::test]
async fn the_example_vllm_pool_is_the_one_the_chart_defaults_describe() {
    let Some(installs) = installs("the_example_vllm_pool_is_the_one_the_chart_defaults_describe")
    else {
        return;
    };
    let install = &installs[0];
    let text =
        std::fs::read_to_string(repo_root().join("deploy/kubernetes/vllm-example.yaml")).unwrap();
    let example = Install {
        name: "vllm-example",
        docs: parse_stream(&text).unwrap(),
    };
    let (_, labels, pod) = example.workloads().into_iter().next().unwrap();
    let vllm = &pod.containers[0];
    let Object::InferencePool(pool) = &install.of_kind("InferencePool").next().unwrap().object
    else {
        unreachable!()
    };
    assert!(
        pool.spec
            .selector
            .match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v)),
        "the pool selects the vLLM pods"
    );
    let port = pool.spec.target_ports[0].number;
    assert_eq!(
        container_port(vllm, &IntOrString::String("http".into())),
        Some(port)
    );
    assert_eq!(arg(vllm, "--port"), port.to_string());
    // The engines hash blocks the way the pool's key scheme says.
    let loaded = load_configs(install);
    let Some(Parsed::ExtProc(ext_proc)) = loaded
        .iter()
        .map(|l| &l.config)
        .find(|c| matches!(c, Parsed::ExtProc(_)))
    else {
        unreachable!()
    };
    let config_map = install.find("ConfigMap", "kvroute-ext-proc");
    let written: serde_yaml::Value =
        serde_yaml::from_str(config_map.value["data"]["ext-proc.yaml"].as_str().unwrap()).unwrap();
    let scheme = &written["pools"][0]["key_scheme"];
    assert_eq!(
        arg(vllm, "--block-size"),
        ext_proc.pools[0].block_size.to_string()
    );
    assert_eq!(
        arg(vllm, "--prefix-caching-hash-algo"),
        scheme["hash_algo"].as_str().unwrap()
    );
    let seed = vllm
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "PYTHONHASHSEED")
        .and_then(|e| e.value.clone());
    assert_eq!(seed.as_deref(), scheme["seed"].as_str(), "PYTHONHASHSEED");
    // The tokenizer asks the engines' Service, which reaches their API port.
    let kvroute_ext_proc::config::TokenizerSource::Remote { url, .. } =
        &ext_proc.pools[0].tokenizer
    else {
        panic!("the defaults tokenize through the engines' /tokenize");
    };
    let service = example.service(url.host().unwrap());
    let service_port = service
        .spec
        .as_ref()
        .unwrap()
        .ports
        .iter()
        .flatten()
        .find(|p| Some(p.port) == url.port_u16().map(i32::from))
        .expect("tokenizer port");
    assert_eq!(
        container_port(vllm, service_port.target_port.as_ref().unwrap()),
        Some(port)
    );
    // The engine binds its KV-event sockets on the pod's addresses, at the ports its
    // annotations tell discovery.
    let events: serde_json::Value = serde_json::from_str(arg(vllm, "--kv-events-config")).unwrap();
    assert_eq!(events["enable_kv_cache_events"], true);
    let template = &example.workloads().into_iter().next().unwrap().0.value["spec"]["template"];
    let annotation = |key: &str| template["metadata"]["annotations"][key].as_str().unwrap();
    for (key, annotation_key, port_name) in [
        (
            "endpoint",
            kvroute_discovery::replica::ANNOTATION_KV_EVENTS_PORT,
            "kv-events",
        ),
        (
            "replay_endpoint",
            kvroute_discovery::replica::ANNOTATION_KV_REPLAY_PORT,
            "kv-replay",
        ),
    ] {
        let port = annotation(annotation_key);
        assert_eq!(
            events[key].as_str(),
            Some(format!("tcp://*:{port}").as_str()),
            "{key}"
        );
        assert_eq!(
            container_port(vllm, &IntOrString::String(port_name.into())).map(|p| p.to_string()),
            Some(port.to_owned()),
            "{port_name}"
        );
    }
    // What each component discovers from this pod (Ready, on the first node) and the pool the
    // chart renders, served by the API server double: the endpoint Envoy routes to, the
    // metrics ext-proc scrapes, and the KV-event sockets the engine binds.
    let server = ApiServer::start().await.unwrap();
    let pool_doc = install.of_kind("InferencePool").next().unwrap();
    server.apply(Resource::InferencePools, NAMESPACE, pool_doc.value.clone());
    let mut pod = serde_json::json!({
        "metadata": template["metadata"].clone(),
        "spec": template["spec"].clone(),
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "podIPs": [{"ip": "10.1.2.3"}],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    });
    pod["metadata"]["name"] = "vllm-llama-0".into();
    pod["spec"]["nodeName"] = NODES[0].into();
    server.apply(Resource::Pods, NAMESPACE, pod);
    let replay_port = annotation(kvroute_discovery::replica::ANNOTATION_KV_REPLAY_PORT);
    let expected = kvroute_discovery::Replica {
        id: "vllm-llama-0".into(),
        pod: "vllm-llama-0".into(),
        rank: 0,
        rank_by_header: false,
        role: kvroute_config::Role::Both,
        engine: None,
        address: format!("10.1.2.3:{port}").parse().unwrap(),
        metrics_url: format!("http://10.1.2.3:{port}/metrics"),
        kv_events: format!(
            "tcp://10.1.2.3:{}",
            annotation(kvroute_discovery::replica::ANNOTATION_KV_EVENTS_PORT)
        ),
        kv_replay: Some(format!("tcp://10.1.2.3:{replay_port}")),
        kv_topic: String::new(),
        model: None,
        node: Some(NODES[0].into()),
    };
    let Some(Parsed::Agent(per_node)) = loaded
        .iter()
        .map(|l| &l.config)
        .find(|c| matches!(c, Parsed::Agent(_)))
    else {
        unreachable!()
    };
    let mut sources = vec![(
        "ext-proc",
        ext_proc.pools[0].discovery.clone().unwrap(),
        true,
    )];
    for (node, agent) in per_node {
        let on_this_node = node == NODES[0];
        sources.push(("agent", agent.discovery.clone().unwrap(), on_this_node));
    }
    // Without an InferencePool: the chart's selector and target port find the same pod.
    let by_selector = installs
        .iter()
        .find(|i| i.name == "istio-envoyfilter")
        .unwrap();
    let selector_source = load_configs(by_selector)
        .iter()
        .find_map(|l| match &l.config {
            Parsed::ExtProc(c) => c.pools[0].discovery.clone(),
            _ => None,
        })
        .unwrap();
    sources.push(("ext-proc by selector", selector_source, true));
    for (who, mut source, sees_pod) in sources {
        source.connection = kvroute_discovery::Connection::Url(server.url().parse().unwrap());
        let node = source.node_name.clone();
        let snapshot = discover(source).await;
        let expected: Vec<_> = if sees_pod {
            vec![expected.clone()]
        } else {
            Vec::new()
        };
        assert_eq!(snapshot.replicas, expected, "{who} on {node:?}");
    }
}

/// The first complete snapshot `source` discovers (a deadline, not a sleep).
async fn discover(source: kvroute_discovery::KubernetesSource) -> kvroute_discovery::Snapshot {
    let within = kvroute_test_support::deadline(Duration::from_secs(30));
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = kvroute_discovery::DiscoveryMetrics::register(&mut registry);
    let tasks = TaskTracker::new();
    let discovery = kvroute_discovery::Discovery::start("llama", source, &metrics, &tasks)
        .await
        .unwrap();
    let mut snapshots = discovery.snapshots();
    let snapshot: kvroute_discovery::Snapshot = {
        let synced = tokio::time::timeout(within, snapshots.wait_for(|s| s.synced))
            .await
            .expect("a synced snapshot within the deadline")
            .unwrap();
        (**synced).clone()
    };
    discovery.stop();
    tasks.close();
    tokio::time::timeout(within, tasks.wait()).await.unwrap();
    snapshot
}

#[test]
fn every_kvroute_pod_exports_spans_and_logs_json_only_when_the_values_ask() {
    let Some(installs) =
        installs("every_kvroute_pod_exports_spans_and_logs_json_only_when_the_values_ask")
    else {
        return;
    };
    for install in &installs {
        let traced = install.name == "tracing";
        let loaded = load_configs(install);
        assert!(!loaded.is_empty(), "{}", install.name);
        for pod in &loaded {
            let name = format!("{}: {}", install.name, pod.container.name);
            let formats: Vec<kvroute_config::LogFormat> = match &pod.config {
                Parsed::ExtProc(config) => vec![config.log_format],
                Parsed::Index(config) => vec![config.log_format],
                Parsed::Agent(configs) => configs.iter().map(|(_, c)| c.log_format).collect(),
            };
            let expected = if traced {
                kvroute_config::LogFormat::Json
            } else {
                kvroute_config::LogFormat::Text
            };
            assert!(
                formats.iter().all(|f| *f == expected),
                "{name}: {formats:?}"
            );
            // What the binary reads from its environment, as the runtime reads it.
            let otlp = kvroute_runtime::telemetry::OtlpSettings::from_env(
                |var| container_env(pod.container, var, NODES[0]),
                "kvroute",
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            match otlp {
                Some(otlp) => {
                    assert!(traced, "{name}: exports without being asked");
                    assert_eq!(
                        otlp.endpoint, "http://otel-collector.observability:4318/v1/traces",
                        "{name}"
                    );
                    assert_eq!(
                        otlp.sampler,
                        kvroute_runtime::telemetry::SamplerSetting::ParentBasedRatio(0.1),
                        "{name}"
                    );
                }
                None => assert!(!traced, "{name}: the example's endpoint is not set"),
            }
        }
    }
}
