//! A pod → the replicas it serves; replicas → a [`Snapshot`].
//!
//! A pod counts only when it is Ready (condition `Ready` is `True`), has a pod IP and is not
//! terminating (`metadata.deletionTimestamp` unset: a deleted pod leaves before its containers
//! stop). One replica per target port; with several ports (GIE `targetPorts`, one per
//! data-parallel rank) rank `N` is the `N`-th port.
//!
//! The pod label `llm-d.ai/role` (llm-d's: `prefill`, `decode`, `prefill-decode`) gives its
//! part in prefill/decode disaggregation (`both` without it; another value refuses the pod).
//!
//! Pod annotations (all optional; a malformed one refuses the pod, counted and logged):
//!
//! | annotation | meaning | default |
//! |---|---|---|
//! | `kvroute.io/model` | the model the pod serves | the pool's |
//! | `kvroute.io/metrics-port` | Prometheus port of rank 0 | the rank's target port |
//! | `kvroute.io/metrics-path` | Prometheus path | `/metrics` |
//! | `kvroute.io/kv-events-port` | KV-event ZMQ PUB port of rank 0 (`--kv-events-config` `endpoint`) | `kv_events_port` (5557) |
//! | `kvroute.io/kv-replay-port` | replay ROUTER port of rank 0 (`replay_endpoint`), or `none` | `kv_replay_port` (5558) |
//! | `kvroute.io/kv-events-topic` | the KV-event topic (`topic`) | empty (vLLM's default) |
//! | `kvroute.io/data-parallel-size` | data-parallel ranks behind the pod's one API server (vLLM `--data-parallel-size`, internal load balancing); the replay port must then leave that many ports after the KV-event port | 1 |
//! | `kvroute.io/engine` | the engine family serving it, `vllm` or `sglang` (its events' wire format, block hashes and metric names); another value refuses the pod | the pool's |
//!
//! Two data-parallel layouts:
//! - one API server per rank (GIE `targetPorts`, one per rank): rank `N` is the `N`-th port, its
//!   own address;
//! - one API server for every rank (`kvroute.io/data-parallel-size: N`, one target port): every
//!   rank has the pod's address and is chosen by the `x-data-parallel-rank` request header.
//!
//! Rank `N`'s KV-event and replay ports are rank 0's plus `N` (vLLM offsets its KV-event
//! endpoints by the data-parallel rank), and so is its metrics port in the first layout; in the
//! second the one API server exports every rank's gauges, labelled `engine="N"`.
//!
//! Replica ids: the pod name with one port and one rank; `<pod>-rank<N>` with several ports;
//! `<pod>@dp<N>` with several ranks behind one port (pod names are unique in a namespace, so ids
//! are too). Ids are metric labels: they come from discovery, never from requests.

use std::collections::BTreeMap;
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::Pod;

use crate::config::TargetPort;

/// Annotation: the model the pod serves.
pub const ANNOTATION_MODEL: &str = "kvroute.io/model";
/// Annotation: Prometheus port of rank 0.
pub const ANNOTATION_METRICS_PORT: &str = "kvroute.io/metrics-port";
/// Annotation: Prometheus path.
pub const ANNOTATION_METRICS_PATH: &str = "kvroute.io/metrics-path";
/// Annotation: KV-event PUB port of rank 0.
pub const ANNOTATION_KV_EVENTS_PORT: &str = "kvroute.io/kv-events-port";
/// Annotation: replay ROUTER port of rank 0, or `none`.
pub const ANNOTATION_KV_REPLAY_PORT: &str = "kvroute.io/kv-replay-port";
/// Annotation: the KV-event topic.
pub const ANNOTATION_KV_EVENTS_TOPIC: &str = "kvroute.io/kv-events-topic";
/// Annotation: data-parallel ranks behind the pod's one API server.
pub const ANNOTATION_DATA_PARALLEL_SIZE: &str = "kvroute.io/data-parallel-size";
/// Annotation: the engine family serving the pod (`vllm`, `sglang`).
pub const ANNOTATION_ENGINE: &str = "kvroute.io/engine";
/// Pod label: the pod's part in prefill/decode disaggregation (llm-d's).
pub const LABEL_ROLE: &str = "llm-d.ai/role";
/// Prometheus path when no annotation sets one.
pub const DEFAULT_METRICS_PATH: &str = "/metrics";

/// One routable engine (a pod's rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replica {
    /// Stable id: the pod name, or `<pod>-rank<N>` when the pool has several ports.
    pub id: String,
    /// The pod's name.
    pub pod: String,
    /// Data-parallel rank (the index into the target ports, or into the ranks behind one).
    pub rank: u16,
    /// Whether several ranks share this replica's address (`kvroute.io/data-parallel-size`): a
    /// request routed to it names `rank` in the `x-data-parallel-rank` header.
    pub rank_by_header: bool,
    /// Its part in prefill/decode disaggregation (label `llm-d.ai/role`; `both` without one).
    pub role: kvroute_config::Role,
    /// The engine family `kvroute.io/engine` names (`None`: the pool's).
    pub engine: Option<kvroute_config::Engine>,
    /// `podIP:port` Envoy routes to.
    pub address: SocketAddr,
    /// `http://podIP:port/path` of the engine's Prometheus metrics.
    pub metrics_url: String,
    /// `tcp://podIP:port` of the engine's KV-event PUB socket.
    pub kv_events: String,
    /// `tcp://podIP:port` of its replay ROUTER socket (`None`: no replay).
    pub kv_replay: Option<String>,
    /// Its KV-event topic.
    pub kv_topic: String,
    /// `kvroute.io/model` (`None`: the pool's model).
    pub model: Option<String>,
    /// The node it runs on.
    pub node: Option<String>,
}

/// Every replica discovery currently sees: ordered by id, no id or address twice. A new
/// snapshot replaces the previous one whole.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// The replicas.
    pub replicas: Vec<Replica>,
    /// Whether the watch has listed at least once (before that the snapshot is empty because
    /// nothing is known yet, not because nothing runs).
    pub synced: bool,
}

impl Snapshot {
    /// The replica with this id.
    pub fn get(&self, id: &str) -> Option<&Replica> {
        self.replicas
            .binary_search_by(|r| r.id.as_str().cmp(id))
            .ok()
            .map(|i| &self.replicas[i])
    }

    /// The ids, in order.
    pub fn ids(&self) -> Vec<&str> {
        self.replicas.iter().map(|r| r.id.as_str()).collect()
    }
}

/// Why a pod that looks routable was refused (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// An annotation does not parse.
    BadAnnotation,
    /// The named target port is not among the pod's container ports.
    NoSuchPort,
    /// The pod IP does not parse.
    BadPodIp,
    /// Another replica already has this address.
    DuplicateAddress,
    /// A port offset by the rank passes 65535.
    PortOverflow,
    /// A `llm-d.ai/role` label that names no role kvroute routes to (e.g. llm-d's `encode`).
    UnknownRole,
    /// A `kvroute.io/engine` annotation that names no engine family kvroute reads.
    UnknownEngine,
    /// Ranks behind one API server whose KV-event ports, offset by the rank, meet their replay
    /// ports (`kvroute.io/kv-replay-port` must leave `data-parallel-size` ports after the events').
    RankPortsOverlap,
}

impl Refusal {
    /// Metric/log label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::BadAnnotation => "bad_annotation",
            Self::NoSuchPort => "no_such_port",
            Self::BadPodIp => "bad_pod_ip",
            Self::DuplicateAddress => "duplicate_address",
            Self::PortOverflow => "port_overflow",
            Self::RankPortsOverlap => "rank_ports_overlap",
            Self::UnknownRole => "unknown_role",
            Self::UnknownEngine => "unknown_engine",
        }
    }
}

/// How ports are chosen for this source's pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PortPlan {
    /// One per rank.
    pub(crate) targets: Vec<TargetPort>,
    pub(crate) kv_events_port: u16,
    pub(crate) kv_replay_port: Option<u16>,
}

/// Whether `pod` is routable now: Ready, with an IP, not terminating.
pub(crate) fn is_routable(pod: &Pod) -> bool {
    if pod.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let Some(status) = &pod.status else {
        return false;
    };
    let has_ip = status.pod_ip.as_deref().is_some_and(|ip| !ip.is_empty());
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    has_ip && ready
}

/// The replicas `pod` serves (empty when it is not routable), or why it was refused.
pub(crate) fn replicas_of(pod: &Pod, plan: &PortPlan) -> Result<Vec<Replica>, Refusal> {
    if !is_routable(pod) {
        return Ok(Vec::new());
    }
    let name = pod.metadata.name.clone().unwrap_or_default();
    let ip: IpAddr = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse().ok())
        .ok_or(Refusal::BadPodIp)?;
    let annotations = pod.metadata.annotations.as_ref();
    let annotation = |key: &str| annotations.and_then(|a| a.get(key)).map(String::as_str);
    let port_annotation = |key: &str| -> Result<Option<u16>, Refusal> {
        annotation(key)
            .map(|v| {
                v.trim()
                    .parse::<u16>()
                    .ok()
                    .filter(|&p| p != 0)
                    .ok_or(Refusal::BadAnnotation)
            })
            .transpose()
    };
    let metrics_port = port_annotation(ANNOTATION_METRICS_PORT)?;
    let metrics_path = annotation(ANNOTATION_METRICS_PATH).unwrap_or(DEFAULT_METRICS_PATH);
    if !metrics_path.starts_with('/') || metrics_path.contains(char::is_whitespace) {
        return Err(Refusal::BadAnnotation);
    }
    let kv_events_port = port_annotation(ANNOTATION_KV_EVENTS_PORT)?.unwrap_or(plan.kv_events_port);
    let kv_replay_port = match annotation(ANNOTATION_KV_REPLAY_PORT) {
        Some("none") => None,
        Some(_) => port_annotation(ANNOTATION_KV_REPLAY_PORT)?,
        None => plan.kv_replay_port,
    };
    let kv_topic = annotation(ANNOTATION_KV_EVENTS_TOPIC)
        .unwrap_or_default()
        .to_owned();
    let model = annotation(ANNOTATION_MODEL)
        .filter(|m| !m.is_empty())
        .map(str::to_owned);
    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    let host = match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    };
    let role = match pod
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(LABEL_ROLE))
    {
        None => kvroute_config::Role::default(),
        Some(value) => kvroute_config::Role::from_pod_label(value).ok_or(Refusal::UnknownRole)?,
    };
    let engine = annotation(ANNOTATION_ENGINE)
        .map(|value| kvroute_config::Engine::from_annotation(value).ok_or(Refusal::UnknownEngine))
        .transpose()?;
    let shared_ranks = match annotation(ANNOTATION_DATA_PARALLEL_SIZE) {
        None => 1,
        Some(size) => size
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|&size| kvroute_config::check_data_parallel_size(size).is_ok())
            .and_then(|size| u16::try_from(size).ok())
            .ok_or(Refusal::BadAnnotation)?,
    };
    if shared_ranks > 1 && plan.targets.len() > 1 {
        // Ranks are either ports of their own or behind one port, not both.
        return Err(Refusal::BadAnnotation);
    }
    let rank_by_header = shared_ranks > 1;
    if let Some(replay) = kv_replay_port {
        let (events, replay, ranks) = (
            u32::from(kv_events_port),
            u32::from(replay),
            u32::from(shared_ranks),
        );
        if rank_by_header && events < replay + ranks && replay < events + ranks {
            return Err(Refusal::RankPortsOverlap);
        }
    }
    let ranked = plan.targets.len() > 1;
    let ranks = plan.targets.len().max(usize::from(shared_ranks));
    let mut replicas = Vec::with_capacity(ranks);
    for rank in 0..ranks {
        let target = &plan.targets[if rank_by_header { 0 } else { rank }];
        let rank = u16::try_from(rank).map_err(|_| Refusal::PortOverflow)?;
        let offset = |base: u16| base.checked_add(rank).ok_or(Refusal::PortOverflow);
        let port = match target {
            TargetPort::Number(n) => *n,
            TargetPort::Name(name) => container_port(pod, name).ok_or(Refusal::NoSuchPort)?,
        };
        let metrics_port = match metrics_port {
            Some(base) if !rank_by_header => offset(base)?,
            Some(base) => base,
            None => port,
        };
        replicas.push(Replica {
            id: if rank_by_header {
                kvroute_config::rank_replica_id(&name, u32::from(rank))
            } else if ranked {
                format!("{name}-rank{rank}")
            } else {
                name.clone()
            },
            pod: name.clone(),
            rank,
            rank_by_header,
            role,
            engine,
            address: SocketAddr::new(ip, port),
            metrics_url: format!("http://{host}:{metrics_port}{metrics_path}"),
            kv_events: format!("tcp://{host}:{}", offset(kv_events_port)?),
            kv_replay: kv_replay_port
                .map(|p| offset(p).map(|p| format!("tcp://{host}:{p}")))
                .transpose()?,
            kv_topic: kv_topic.clone(),
            model: model.clone(),
            node: node.clone(),
        });
    }
    Ok(replicas)
}

/// The number of the pod's container port named `name`.
fn container_port(pod: &Pod, name: &str) -> Option<u16> {
    pod.spec
        .as_ref()?
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(name))
        .and_then(|p| u16::try_from(p.container_port).ok())
}

/// The snapshot of `pods` (pod name → its replicas): ordered by id; a replica whose address an
/// earlier one (by id) already has is left out and reported.
pub(crate) fn snapshot(
    pods: &BTreeMap<String, Vec<Replica>>,
    synced: bool,
    mut refused: impl FnMut(&Replica, Refusal),
) -> Snapshot {
    let mut replicas: Vec<Replica> = pods.values().flatten().cloned().collect();
    replicas.sort_by(|a, b| a.id.cmp(&b.id));
    replicas.dedup_by(|b, a| a.id == b.id);
    let mut addresses = HashSet::with_capacity(replicas.len());
    replicas.retain(|r| {
        // Ranks behind one API server share its address, each its own rank.
        let fresh = addresses.insert((r.address, r.rank_by_header.then_some(r.rank)));
        if !fresh {
            refused(r, Refusal::DuplicateAddress);
        }
        fresh
    });
    Snapshot { replicas, synced }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    fn ready_pod(name: &str, ip: &str, annotations: serde_json::Value) -> Pod {
        pod(serde_json::json!({
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"nodeName": "n1", "containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": 8123}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
        }))
    }

    fn plan(targets: Vec<TargetPort>) -> PortPlan {
        PortPlan {
            targets,
            kv_events_port: 5557,
            kv_replay_port: Some(5558),
        }
    }

    #[test]
    fn a_ready_pod_is_one_replica_with_the_defaults() {
        let replicas = replicas_of(
            &ready_pod("vllm-0", "10.0.0.5", serde_json::json!({})),
            &plan(vec![TargetPort::Number(8000)]),
        )
        .unwrap();
        assert_eq!(
            replicas,
            vec![Replica {
                id: "vllm-0".into(),
                pod: "vllm-0".into(),
                rank: 0,
                rank_by_header: false,
                role: kvroute_config::Role::Both,
                engine: None,
                address: "10.0.0.5:8000".parse().unwrap(),
                metrics_url: "http://10.0.0.5:8000/metrics".into(),
                kv_events: "tcp://10.0.0.5:5557".into(),
                kv_replay: Some("tcp://10.0.0.5:5558".into()),
                kv_topic: String::new(),
                model: None,
                node: Some("n1".into()),
            }]
        );
    }

    #[test]
    fn annotations_and_ranks_offset_every_port() {
        let annotated = ready_pod(
            "vllm-1",
            "fd00::7",
            serde_json::json!({
                "kvroute.io/model": "llama", "kvroute.io/metrics-port": "9000",
                "kvroute.io/metrics-path": "/m", "kvroute.io/kv-events-port": "6000",
                "kvroute.io/kv-replay-port": "none", "kvroute.io/kv-events-topic": "kv@a"
            }),
        );
        let replicas = replicas_of(
            &annotated,
            &plan(vec![TargetPort::Number(8000), TargetPort::Number(8001)]),
        )
        .unwrap();
        assert_eq!(replicas.len(), 2);
        let rank1 = &replicas[1];
        assert_eq!(rank1.id, "vllm-1-rank1");
        assert_eq!(rank1.address, "[fd00::7]:8001".parse().unwrap());
        assert_eq!(rank1.metrics_url, "http://[fd00::7]:9001/m");
        assert_eq!(rank1.kv_events, "tcp://[fd00::7]:6001");
        assert_eq!(rank1.kv_replay, None);
        assert_eq!(rank1.kv_topic, "kv@a");
        assert_eq!(rank1.model.as_deref(), Some("llama"));
        assert_eq!(replicas[0].id, "vllm-1-rank0");
    }

    #[test]
    fn ranks_behind_one_api_server_share_its_address_and_metrics() {
        let pod = ready_pod(
            "vllm-2",
            "10.0.0.9",
            serde_json::json!({
                "kvroute.io/data-parallel-size": "2", "kvroute.io/metrics-port": "9000",
                "kvroute.io/kv-replay-port": "5600"
            }),
        );
        let replicas = replicas_of(&pod, &plan(vec![TargetPort::Number(8000)])).unwrap();
        let ids: Vec<&str> = replicas.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["vllm-2@dp0", "vllm-2@dp1"]);
        for (rank, replica) in replicas.iter().enumerate() {
            assert_eq!(usize::from(replica.rank), rank);
            assert!(replica.rank_by_header);
            assert_eq!(replica.address, "10.0.0.9:8000".parse().unwrap());
            assert_eq!(replica.metrics_url, "http://10.0.0.9:9000/metrics");
            assert_eq!(replica.kv_events, format!("tcp://10.0.0.9:{}", 5557 + rank));
            assert_eq!(
                replica.kv_replay.as_deref(),
                Some(format!("tcp://10.0.0.9:{}", 5600 + rank).as_str())
            );
        }
        let mut pods = BTreeMap::new();
        pods.insert("vllm-2".to_owned(), replicas);
        let snapshot = snapshot(&pods, true, |r, why| panic!("{} refused: {why:?}", r.id));
        assert_eq!(
            snapshot.replicas.len(),
            2,
            "ranks are not duplicate addresses"
        );
        let ported = replicas_of(
            &pod,
            &plan(vec![TargetPort::Number(8000), TargetPort::Number(8001)]),
        );
        assert_eq!(
            ported,
            Err(Refusal::BadAnnotation),
            "ports and shared ranks at once"
        );
    }

    #[test]
    fn the_engine_annotation_names_the_family_and_an_unknown_one_refuses_the_pod() {
        let plan = plan(vec![TargetPort::Number(8000)]);
        let plain = ready_pod("p", "10.0.0.1", serde_json::json!({}));
        assert_eq!(replicas_of(&plain, &plan).unwrap()[0].engine, None);
        let sglang = ready_pod(
            "p",
            "10.0.0.1",
            serde_json::json!({"kvroute.io/engine": "sglang"}),
        );
        assert_eq!(
            replicas_of(&sglang, &plan).unwrap()[0].engine,
            Some(kvroute_config::Engine::Sglang)
        );
        let unknown = ready_pod(
            "p",
            "10.0.0.1",
            serde_json::json!({"kvroute.io/engine": "trtllm"}),
        );
        assert_eq!(replicas_of(&unknown, &plan), Err(Refusal::UnknownEngine));
    }

    #[test]
    fn llm_ds_role_label_gives_the_role_and_an_unknown_one_refuses_the_pod() {
        let mut pod = ready_pod("p", "10.0.0.1", serde_json::json!({}));
        let plan = plan(vec![TargetPort::Number(8000)]);
        for (label, role) in [
            ("prefill", kvroute_config::Role::Prefill),
            ("decode", kvroute_config::Role::Decode),
            ("prefill-decode", kvroute_config::Role::Both),
        ] {
            pod.metadata.labels = Some(BTreeMap::from([(LABEL_ROLE.to_owned(), label.to_owned())]));
            assert_eq!(replicas_of(&pod, &plan).unwrap()[0].role, role, "{label}");
        }
        pod.metadata.labels = Some(BTreeMap::from([(
            LABEL_ROLE.to_owned(),
            "encode".to_owned(),
        )]));
        assert_eq!(replicas_of(&pod, &plan), Err(Refusal::UnknownRole));
    }

    #[test]
    fn a_named_port_is_resolved_per_pod() {
        let replicas = replicas_of(
            &ready_pod("p", "10.0.0.1", serde_json::json!({})),
            &plan(vec![TargetPort::Name("http".into())]),
        )
        .unwrap();
        assert_eq!(replicas[0].address.port(), 8123);
        assert_eq!(
            replicas_of(
                &ready_pod("p", "10.0.0.1", serde_json::json!({})),
                &plan(vec![TargetPort::Name("grpc".into())]),
            ),
            Err(Refusal::NoSuchPort)
        );
    }

    #[test]
    fn unready_terminating_or_ipless_pods_serve_nothing() {
        let unready = pod(serde_json::json!({
            "metadata": {"name": "a"},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "False"}]}
        }));
        let no_ip = pod(serde_json::json!({
            "metadata": {"name": "b"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        }));
        let mut terminating = ready_pod("c", "10.0.0.3", serde_json::json!({}));
        terminating.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-01-01T00:00:00Z".parse().unwrap(),
            ));
        for pod in [unready, no_ip, terminating] {
            assert_eq!(
                replicas_of(&pod, &plan(vec![TargetPort::Number(1)])),
                Ok(vec![])
            );
        }
    }

    #[test]
    fn malformed_annotations_refuse_the_pod() {
        for (key, value) in [
            ("kvroute.io/metrics-port", "x"),
            ("kvroute.io/kv-events-port", "0"),
            ("kvroute.io/kv-replay-port", "70000"),
            ("kvroute.io/metrics-path", "metrics"),
            ("kvroute.io/data-parallel-size", "0"),
            ("kvroute.io/data-parallel-size", "two"),
            ("kvroute.io/data-parallel-size", "100000"),
        ] {
            let pod = ready_pod("p", "10.0.0.1", serde_json::json!({ key: value }));
            assert_eq!(
                replicas_of(&pod, &plan(vec![TargetPort::Number(1)])),
                Err(Refusal::BadAnnotation),
                "{key}={value}"
            );
        }
    }

    #[test]
    fn snapshots_are_ordered_and_deduplicated_by_address() {
        let plan = plan(vec![TargetPort::Number(8000)]);
        let mut pods = BTreeMap::new();
        for (name, ip) in [("c", "10.0.0.3"), ("a", "10.0.0.1"), ("b", "10.0.0.1")] {
            pods.insert(
                name.to_owned(),
                replicas_of(&ready_pod(name, ip, serde_json::json!({})), &plan).unwrap(),
            );
        }
        let mut refused = Vec::new();
        let snapshot = snapshot(&pods, true, |r, why| refused.push((r.id.clone(), why)));
        assert_eq!(snapshot.ids(), vec!["a", "c"]);
        assert_eq!(refused, vec![("b".to_owned(), Refusal::DuplicateAddress)]);
        assert_eq!(snapshot.get("c").unwrap().address.port(), 8000);
        assert!(snapshot.get("b").is_none());
    }
}
