//! `pools[].discovery`: a pool whose replicas come from Kubernetes ([`kvroute_discovery`])
//! instead of `replicas:`.
//!
//! One [`Discovery`] per discovering pool, named by the pool (its metrics' `source` label). Each
//! snapshot it publishes replaces that pool's replicas in the running config through the same
//! swap a config reload uses ([`Picker::replace_runtime`], tokenizers reused): a new Ready pod
//! is a candidate from the next decision on, and a pod that left the snapshot is not — no
//! decision that starts after the swap can choose it. A config reload keeps the discovered
//! replicas ([`ReplicaDiscovery::merge_into`]) and restarts only the sources whose section
//! changed ([`ReplicaDiscovery::reconcile`]).
//!
//! A discovered replica is left out (counted in
//! `kvroute_extproc_discovery_replicas_refused_total{pool, reason}`, logged) when its
//! `kvroute.io/model` is not a model or adapter of the pool, or its id or address is already
//! another replica's.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use kvroute_discovery::{Discovery, DiscoveryMetrics, KubernetesSource, Snapshot, StartError};
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, Replica};
use crate::picker::{Picker, Runtime};

/// `{pool, reason}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusedLabels {
    pool: String,
    reason: &'static str,
}

/// `{pool}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
}

/// Why a discovered replica was left out of routing (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    ModelMismatch,
    /// The pod's engine family publishes block hashes the pool's keys are not.
    EngineMismatch,
    DuplicateId,
    DuplicateAddress,
    BadMetricsUrl,
}

impl Refusal {
    fn as_label(self) -> &'static str {
        match self {
            Self::ModelMismatch => "model_mismatch",
            Self::EngineMismatch => "engine_mismatch",
            Self::DuplicateId => "duplicate_id",
            Self::DuplicateAddress => "duplicate_address",
            Self::BadMetricsUrl => "bad_metrics_url",
        }
    }
}

struct Running {
    source: KubernetesSource,
    discovery: Discovery,
}

/// The discovering pools of one ext-proc process.
pub(crate) struct ReplicaDiscovery {
    picker: Arc<Picker>,
    tasks: TaskTracker,
    metrics: DiscoveryMetrics,
    refused: Family<RefusedLabels, Counter>,
    routable: Family<PoolLabels, Gauge>,
    sources: Mutex<BTreeMap<String, Running>>,
    /// Serialises read-merge-swap of the runtime (snapshot followers, reconcile).
    swap: Mutex<()>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for ReplicaDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaDiscovery")
            .field("pools", &self.sources.lock().keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl ReplicaDiscovery {
    /// Registers the metrics (under `kvroute_extproc_discovery_`); starts nothing yet.
    pub(crate) fn new(
        picker: Arc<Picker>,
        registry: &mut Registry,
        tasks: TaskTracker,
    ) -> Arc<Self> {
        let registry = registry.sub_registry_with_prefix("kvroute_extproc");
        let metrics = DiscoveryMetrics::register(registry);
        let refused = Family::default();
        let routable = Family::default();
        let registry = registry.sub_registry_with_prefix("discovery");
        registry.register(
            "replicas_refused",
            "Discovered replicas left out of routing, by reason",
            refused.clone(),
        );
        registry.register(
            "routable_replicas",
            "Discovered replicas in the routing config, per pool",
            routable.clone(),
        );
        Arc::new(Self {
            picker,
            tasks,
            metrics,
            refused,
            routable,
            sources: Mutex::new(BTreeMap::new()),
            swap: Mutex::new(()),
            cancel: CancellationToken::new(),
        })
    }

    /// Starts, restarts or stops sources to match the running config's `pools[].discovery`,
    /// then applies the current snapshots.
    pub(crate) async fn reconcile(self: &Arc<Self>) -> Result<(), StartError> {
        let config = Arc::clone(&self.picker.runtime().config);
        let wanted: BTreeMap<String, KubernetesSource> = config
            .pools
            .iter()
            .filter_map(|p| Some((p.name.clone(), p.discovery.clone()?)))
            .collect();
        self.sources.lock().retain(|pool, running| {
            let keep = wanted.get(pool) == Some(&running.source);
            if !keep {
                tracing::info!(
                    pool,
                    "discovery section changed or removed; stopping its watch"
                );
            }
            keep
        });
        for (pool, source) in wanted {
            if self.sources.lock().contains_key(&pool) {
                continue;
            }
            let discovery =
                Discovery::start(&pool, source.clone(), &self.metrics, &self.tasks).await?;
            let snapshots = discovery.snapshots();
            self.tasks
                .spawn(follow(Arc::clone(self), snapshots, self.cancel.clone()));
            self.sources
                .lock()
                .insert(pool, Running { source, discovery });
        }
        self.apply();
        Ok(())
    }

    /// `config` with every discovering pool's replicas set to its current snapshot.
    pub(crate) fn merge_into(&self, config: &mut Config) {
        let snapshots: BTreeMap<String, Arc<Snapshot>> = self
            .sources
            .lock()
            .iter()
            .map(|(pool, running)| (pool.clone(), running.discovery.current()))
            .collect();
        merge(config, &snapshots, |pool, replica, why| {
            self.refused
                .get_or_create(&RefusedLabels {
                    pool: pool.to_owned(),
                    reason: why.as_label(),
                })
                .inc();
            tracing::warn!(
                pool,
                replica,
                reason = why.as_label(),
                "discovered replica left out of routing"
            );
        });
    }

    /// Swaps in the running config with the current snapshots (if they change it).
    fn apply(&self) {
        let _swap = self.swap.lock();
        let current = self.picker.runtime();
        let mut config = (*current.config).clone();
        self.merge_into(&mut config);
        if config == *current.config {
            return;
        }
        let counts: Vec<(String, i64)> = config
            .pools
            .iter()
            .enumerate()
            .filter(|(_, p)| p.discovery.is_some())
            .map(|(i, p)| {
                let n = config.replicas.iter().filter(|r| r.pool == i).count();
                (p.name.clone(), i64::try_from(n).unwrap_or(i64::MAX))
            })
            .collect();
        // Tokenizers and the embedded index are reused: only the replica set changes.
        match Runtime::build(config, Some(&current), &self.tasks) {
            Ok(runtime) => {
                self.picker.replace_runtime(runtime);
                for (pool, n) in counts {
                    self.routable.get_or_create(&PoolLabels { pool }).set(n);
                }
            }
            Err(error) => {
                tracing::error!(%error, "discovered replicas not applied: the runtime could not be rebuilt");
            }
        }
    }

    /// Stops every source and follower (shutdown).
    pub(crate) fn stop(&self) {
        self.cancel.cancel();
        self.sources.lock().clear();
    }
}

/// Applies each new snapshot of one source until cancelled or the source stops.
async fn follow(
    discovery: Arc<ReplicaDiscovery>,
    mut snapshots: tokio::sync::watch::Receiver<Arc<Snapshot>>,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            changed = snapshots.changed() => {
                if changed.is_err() {
                    break;
                }
                discovery.apply();
            }
        }
    }
}

/// Replaces the replicas of every pool with a synced snapshot in `snapshots` (by pool name) with
/// the snapshot's, in its order; reports each one left out.
fn merge(
    config: &mut Config,
    snapshots: &BTreeMap<String, Arc<Snapshot>>,
    mut refused: impl FnMut(&str, &str, Refusal),
) {
    // A source that has not listed yet (just started or restarted) leaves its pool as it is.
    let replaced = |pool: &crate::config::Pool| {
        pool.discovery.is_some() && snapshots.get(&pool.name).is_some_and(|s| s.synced)
    };
    let pools = &config.pools;
    config.replicas.retain(|r| !replaced(&pools[r.pool]));
    let mut ids: HashSet<String> = config.replicas.iter().map(|r| r.id.clone()).collect();
    let mut addresses: HashSet<_> = config.replicas.iter().map(Replica::target).collect();
    for (pool_index, pool) in config.pools.iter().enumerate() {
        if !replaced(pool) {
            continue;
        }
        let Some(snapshot) = snapshots.get(&pool.name) else {
            continue;
        };
        for discovered in &snapshot.replicas {
            let dp_rank = discovered
                .rank_by_header
                .then_some(u32::from(discovered.rank));
            let engine = discovered.engine.unwrap_or(pool.engine);
            let why = if discovered.model.as_deref().is_some_and(|m| !pool.serves(m)) {
                Some(Refusal::ModelMismatch)
            } else if !pool.keys_serve(engine) {
                Some(Refusal::EngineMismatch)
            } else if ids.contains(&discovered.id) {
                Some(Refusal::DuplicateId)
            } else if addresses.contains(&(discovered.address, dp_rank)) {
                Some(Refusal::DuplicateAddress)
            } else {
                None
            };
            let metrics_url = discovered.metrics_url.parse::<http::Uri>();
            let why = why.or(metrics_url.is_err().then_some(Refusal::BadMetricsUrl));
            if let Some(why) = why {
                refused(&pool.name, &discovered.id, why);
                continue;
            }
            ids.insert(discovered.id.clone());
            addresses.insert((discovered.address, dp_rank));
            config.replicas.push(Replica {
                id: discovered.id.clone(),
                pool: pool_index,
                address: discovered.address,
                dp_rank,
                role: discovered.role,
                engine,
                metrics_url: metrics_url.ok(),
                envoy_cluster: None,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = "pools:\n\
        - {name: static, models: [a]}\n\
        - {name: found, models: [b], discovery: {kubernetes: {namespace: llm, inference_pool: b, api_url: \"http://127.0.0.1:1\"}}}\n\
        replicas:\n- {id: s0, pool: static, address: \"10.0.0.1:8000\"}\n";

    fn replica(id: &str, address: &str, model: Option<&str>) -> kvroute_discovery::Replica {
        kvroute_discovery::Replica {
            id: id.to_owned(),
            pod: id.to_owned(),
            rank: 0,
            rank_by_header: false,
            role: kvroute_config::Role::Both,
            engine: None,
            address: address.parse().unwrap(),
            metrics_url: format!("http://{address}/metrics"),
            kv_events: String::new(),
            kv_replay: None,
            kv_topic: String::new(),
            model: model.map(str::to_owned),
            node: None,
        }
    }

    #[test]
    fn a_snapshot_replaces_the_pools_replicas_and_leaves_the_static_ones() {
        let mut config = Config::from_yaml(CONFIG).unwrap();
        let snapshot = |replicas| {
            BTreeMap::from([(
                "found".to_owned(),
                Arc::new(Snapshot {
                    replicas,
                    synced: true,
                }),
            )])
        };
        let mut refusals = Vec::new();
        merge(
            &mut config,
            &snapshot(vec![
                replica("p0", "10.0.0.2:8000", None),
                replica("p1", "10.0.0.3:8000", Some("b")),
                replica("p2", "10.0.0.4:8000", Some("other-model")),
                replica("s0", "10.0.0.5:8000", None),
                replica("p3", "10.0.0.1:8000", None),
                kvroute_discovery::Replica {
                    engine: Some(kvroute_config::Engine::Sglang),
                    ..replica("p4", "10.0.0.6:8000", None)
                },
            ]),
            |pool, id, why| refusals.push((pool.to_owned(), id.to_owned(), why)),
        );
        let ids: Vec<&str> = config.replicas.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["s0", "p0", "p1"]);
        assert_eq!(config.replicas[1].pool, 1);
        assert_eq!(
            config.replicas[1].metrics_url.as_ref().unwrap().to_string(),
            "http://10.0.0.2:8000/metrics"
        );
        assert_eq!(
            refusals
                .iter()
                .map(|(_, id, why)| (id.as_str(), *why))
                .collect::<Vec<_>>(),
            [
                ("p2", Refusal::ModelMismatch),
                ("s0", Refusal::DuplicateId),
                ("p3", Refusal::DuplicateAddress),
                ("p4", Refusal::EngineMismatch)
            ]
        );
        // The next snapshot replaces, never accumulates.
        merge(
            &mut config,
            &snapshot(vec![replica("p9", "10.0.0.9:8000", None)]),
            |_, _, _| {},
        );
        let ids: Vec<&str> = config.replicas.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["s0", "p9"]);
    }

    #[test]
    fn discovery_and_static_replicas_are_exclusive_per_pool() {
        let pool = "- {name: found, models: [b], discovery: {kubernetes: {inference_pool: b}}}";
        let only_discovered = Config::from_yaml(&format!("pools:\n{pool}\n")).unwrap();
        assert!(only_discovered.replicas.is_empty());
        assert!(only_discovered.pools[0].discovery.is_some());
        let error = |yaml: &str| Config::from_yaml(yaml).unwrap_err().to_string();
        let joined = error(&format!(
            "pools:\n{pool}\nreplicas:\n- {{id: r0, pool: found, address: \"10.0.0.1:1\"}}\n"
        ));
        assert!(
            joined.contains("replicas[0].pool") && joined.contains("discovers"),
            "{joined}"
        );
        let both = error(
            "pools:\n- {name: p, models: [b], discovery: {kubernetes: {inference_pool: b, selector: {app: x}}}}\n",
        );
        assert!(
            both.contains("pools[0].discovery.kubernetes.selector"),
            "{both}"
        );
        let empty = error("pools:\n- {name: p, models: [b], discovery: {}}\n");
        assert!(empty.contains("pools[0].discovery.kubernetes"), "{empty}");
        let none = error("pools:\n- {name: p, models: [b]}\n");
        assert!(none.contains("replicas"), "{none}");
    }
}
