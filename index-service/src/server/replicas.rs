//! The replicas the index serves, as they change: the static `replicas:` of the config file
//! (reloaded when the file changes) plus, for each pool with `discovery:`, the Ready pods its
//! Kubernetes watch sees ([`kvroute_discovery`]).
//!
//! Every change goes through one step, [`ReplicaSet::reconcile`]: the wanted set (static, then
//! discovered; an id seen twice keeps its first entry, counted) is compared with the running one
//! by id and endpoints. A replica that left, or whose endpoints changed, has its ingest stopped
//! and awaited, then leaves the directory and the index — its blocks are dropped, so a `Match`
//! never names it again and its memory is freed. A new one is registered (`never_connected`
//! until its feed catches up) and its ingest started. Nothing restarts the process.
//!
//! A discovering pool keeps its replicas while its watch has not listed yet (just started, or
//! restarted): an empty snapshot before the first list is not "every pod left".

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use kvroute_discovery::{Discovery, DiscoveryMetrics, Snapshot};
use kvroute_runtime::config_file::ConfigFileWatch;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Directory, Shared};
use crate::config::{Config, ReplicaConfig};

/// `{change}`: `added` or `removed`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChangeLabels {
    change: &'static str,
}

/// `{pool, reason}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusedLabels {
    pool: String,
    reason: &'static str,
}

/// `{outcome}`: `applied`, `unchanged`, `rejected`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// `{source}`: `static` or `discovered`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    source: &'static str,
}

/// Why a discovered replica was left out (a metric label).
#[derive(Debug, Clone, Copy)]
enum Refusal {
    /// Its pod's annotations produced an unusable endpoint or id.
    BadEndpoint,
    /// Another replica (static or discovered) has its id.
    DuplicateId,
    /// Its `kvroute.io/model` is not one of the pool's models.
    ModelMismatch,
    /// Its `kvroute.io/engine` publishes other hashes than the pool's key scheme computes.
    EngineMismatch,
}

impl Refusal {
    fn as_label(self) -> &'static str {
        match self {
            Refusal::BadEndpoint => "bad_endpoint",
            Refusal::DuplicateId => "duplicate_id",
            Refusal::ModelMismatch => "model_mismatch",
            Refusal::EngineMismatch => "engine_mismatch",
        }
    }
}

/// What is wanted and what runs.
struct State {
    /// The running config (its `replicas:` the static set).
    config: Arc<Config>,
    /// Per discovering pool (by index in `config.pools`), its latest synced snapshot.
    discovered: BTreeMap<usize, Arc<Snapshot>>,
    /// Replicas running now, by id.
    running: HashMap<String, ReplicaConfig>,
}

/// See the module docs.
pub(crate) struct ReplicaSet {
    state: tokio::sync::Mutex<State>,
    changes: Family<ChangeLabels, Counter>,
    refused: Family<RefusedLabels, Counter>,
    replicas: Family<SourceLabels, Gauge>,
    reloads: Family<OutcomeLabels, Counter>,
    discovery_metrics: DiscoveryMetrics,
    /// Discovery watches and their followers.
    tasks: TaskTracker,
    cancel: CancellationToken,
    sources: parking_lot::Mutex<Vec<Discovery>>,
}

impl std::fmt::Debug for ReplicaSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaSet").finish_non_exhaustive()
    }
}

/// Whether two configs of one replica id need a new ingest (a different engine or socket).
fn same_engine(a: &ReplicaConfig, b: &ReplicaConfig) -> bool {
    a.pool == b.pool
        && a.endpoint == b.endpoint
        && a.mode == b.mode
        && a.replay_endpoint == b.replay_endpoint
        && a.topic == b.topic
        && a.dp_rank == b.dp_rank
        && a.dp_rank_checked == b.dp_rank_checked
        && a.max_message_bytes == b.max_message_bytes
}

impl ReplicaSet {
    /// Registers the metrics (`kvroute_index_replica_changes_total{change}`,
    /// `kvroute_index_replicas{source}`, `kvroute_index_discovery_*`); starts nothing. The
    /// config's static replicas are running already (registered with the directory and their
    /// ingest started by the server).
    pub(crate) fn new(config: Arc<Config>, registry: &mut Registry) -> Self {
        let changes = Family::default();
        let refused = Family::default();
        let replicas = Family::default();
        let reloads = Family::default();
        registry.register(
            "config_reloads",
            "Config file reloads, by outcome (applied, unchanged, rejected)",
            reloads.clone(),
        );
        registry.register(
            "replica_changes",
            "Replicas added to or removed from the index (discovery, config reloads)",
            changes.clone(),
        );
        registry.register(
            "replicas",
            "Replicas the index serves, by where they come from",
            replicas.clone(),
        );
        let discovery_metrics = DiscoveryMetrics::register(registry);
        registry.sub_registry_with_prefix("discovery").register(
            "replicas_refused",
            "Discovered replicas left out of the index, by pool and reason",
            refused.clone(),
        );
        ReplicaSet {
            state: tokio::sync::Mutex::new(State {
                running: config
                    .replicas
                    .iter()
                    .map(|r| (r.id.clone(), r.clone()))
                    .collect(),
                config,
                discovered: BTreeMap::new(),
            }),
            changes,
            refused,
            replicas,
            reloads,
            discovery_metrics,
            tasks: TaskTracker::new(),
            cancel: CancellationToken::new(),
            sources: parking_lot::Mutex::new(Vec::new()),
        }
    }

    /// Starts the watch of every discovering pool and applies the static replicas. A watch that
    /// cannot start (no API server credentials) fails the start: an index that silently serves
    /// no replicas would look healthy and be useless.
    pub(crate) async fn start(shared: &Arc<Shared>) -> Result<(), kvroute_discovery::StartError> {
        let set = &shared.replicas;
        let config = Arc::clone(&set.state.lock().await.config);
        for (pool_index, pool) in config.pools.iter().enumerate() {
            let Some(source) = pool.discovery.clone() else {
                continue;
            };
            let discovery =
                Discovery::start(&pool.name, source, &set.discovery_metrics, &set.tasks).await?;
            let snapshots = discovery.snapshots();
            set.tasks.spawn(follow(
                Arc::clone(shared),
                pool_index,
                snapshots,
                set.cancel.clone(),
            ));
            set.sources.lock().push(discovery);
        }
        set.reconcile(shared).await;
        Ok(())
    }

    /// A reloaded config: its static replicas replace the old ones; everything else applies
    /// after a restart (logged when it differs).
    async fn reload(&self, shared: &Shared, mut config: Config) {
        let outcome = {
            let mut state = self.state.lock().await;
            let current = &state.config;
            if restart_only(&config) != restart_only(current) {
                tracing::warn!(
                    "config changes other than `replicas:` apply after a restart; running on"
                );
                // Keep running what started: only the static replicas change.
                let replicas = std::mem::take(&mut config.replicas);
                config = Config {
                    replicas,
                    ..(**current).clone()
                };
            }
            let unchanged = config.replicas.len() == current.replicas.len()
                && config
                    .replicas
                    .iter()
                    .zip(&current.replicas)
                    .all(|(a, b)| a.id == b.id && same_engine(a, b));
            state.config = Arc::new(config);
            if unchanged { "unchanged" } else { "applied" }
        };
        self.reconcile(shared).await;
        self.count_reload(outcome);
    }

    fn count_reload(&self, outcome: &'static str) {
        self.reloads.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    /// Brings the running replicas to the wanted set (module docs).
    pub(crate) async fn reconcile(&self, shared: &Shared) {
        let mut state = self.state.lock().await;
        let wanted = self.wanted(&state);
        let gone: Vec<String> = state
            .running
            .iter()
            .filter(|(id, running)| {
                wanted
                    .get(id.as_str())
                    .is_none_or(|replica| !same_engine(replica, running))
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            state.running.remove(&id);
            shared.ingest.stop(&id).await;
            if let Some(replica) = shared.directory.remove(&shared.index, &id) {
                shared.agents.untrack(replica);
                self.count_change("removed");
                tracing::info!(replica_id = %id, "replica left; its blocks are dropped");
            }
        }
        for (id, replica) in wanted {
            if state.running.contains_key(&id) {
                continue;
            }
            match shared.directory.add(&state.config, &shared.index, &replica) {
                Ok(replica_id) => {
                    if let Some(entry) = shared.directory.replica(&id)
                        && entry.agent_fed
                    {
                        shared.agents.track(replica_id, entry.node.as_deref());
                    }
                    if let Some(socket) = Directory::ingest_config(&state.config, &replica) {
                        shared.ingest.spawn(socket);
                    }
                    self.count_change("added");
                    tracing::info!(replica_id = %id, endpoint = %replica.endpoint, "replica joined");
                    state.running.insert(id, replica);
                }
                Err(error) => {
                    tracing::error!(replica_id = %id, %error, "replica not added");
                }
            }
        }
        let discovered = state
            .running
            .values()
            .filter(|r| state.config.pools[r.pool].discovery.is_some())
            .count();
        let total = state.running.len();
        for (source, n) in [("static", total - discovered), ("discovered", discovered)] {
            self.replicas
                .get_or_create(&SourceLabels { source })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Static replicas first, then each discovering pool's, by id; refusals counted.
    fn wanted(&self, state: &State) -> BTreeMap<String, ReplicaConfig> {
        let config = &state.config;
        let mut wanted: BTreeMap<String, ReplicaConfig> = config
            .replicas
            .iter()
            .map(|r| (r.id.clone(), r.clone()))
            .collect();
        for (pool_index, pool) in config.pools.iter().enumerate() {
            if pool.discovery.is_none() {
                continue;
            }
            let discovered: Vec<ReplicaConfig> = match state.discovered.get(&pool_index) {
                Some(snapshot) => self.usable(config, pool_index, snapshot),
                // Not listed yet: keep what runs.
                None => state
                    .running
                    .values()
                    .filter(|r| r.pool == pool_index)
                    .cloned()
                    .collect(),
            };
            let mut seen = HashSet::new();
            for replica in discovered {
                if !seen.insert(replica.id.clone()) || wanted.contains_key(&replica.id) {
                    self.refuse(&pool.name, &replica.id, Refusal::DuplicateId);
                    continue;
                }
                wanted.insert(replica.id.clone(), replica);
            }
        }
        wanted
    }

    /// The snapshot's replicas the index can subscribe to.
    fn usable(
        &self,
        config: &Config,
        pool_index: usize,
        snapshot: &Snapshot,
    ) -> Vec<ReplicaConfig> {
        let pool = &config.pools[pool_index];
        snapshot
            .replicas
            .iter()
            .filter_map(|replica| {
                if let Some(model) = &replica.model
                    && !pool.models.contains(model)
                {
                    self.refuse(&pool.name, &replica.id, Refusal::ModelMismatch);
                    return None;
                }
                if let Some(engine) = replica.engine
                    && !pool.key_scheme.serves(engine)
                {
                    self.refuse(&pool.name, &replica.id, Refusal::EngineMismatch);
                    return None;
                }
                match ReplicaConfig::discovered(
                    pool_index,
                    &pool.key_scheme,
                    replica,
                    config.node_agents.is_some(),
                ) {
                    Ok(replica) => Some(replica),
                    Err(why) => {
                        tracing::warn!(pool = %pool.name, replica_id = %replica.id, %why, "discovered replica not usable");
                        self.refuse(&pool.name, &replica.id, Refusal::BadEndpoint);
                        None
                    }
                }
            })
            .collect()
    }

    fn refuse(&self, pool: &str, replica: &str, reason: Refusal) {
        self.refused
            .get_or_create(&RefusedLabels {
                pool: pool.to_owned(),
                reason: reason.as_label(),
            })
            .inc();
        tracing::warn!(
            pool,
            replica_id = replica,
            reason = reason.as_label(),
            "discovered replica left out of the index"
        );
    }

    fn count_change(&self, change: &'static str) {
        self.changes.get_or_create(&ChangeLabels { change }).inc();
    }

    /// Stops the watches and their followers, and waits for them.
    pub(crate) async fn shutdown(&self) {
        self.cancel.cancel();
        for source in self.sources.lock().drain(..) {
            source.stop();
        }
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// Applies each synced snapshot of one pool's watch until cancelled or the watch stops.
async fn follow(
    shared: Arc<Shared>,
    pool_index: usize,
    mut snapshots: tokio::sync::watch::Receiver<Arc<Snapshot>>,
    cancel: CancellationToken,
) {
    loop {
        let snapshot = Arc::clone(&snapshots.borrow_and_update());
        if snapshot.synced {
            shared
                .replicas
                .state
                .lock()
                .await
                .discovered
                .insert(pool_index, snapshot);
            shared.replicas.reconcile(&shared).await;
        }
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            changed = snapshots.changed() => {
                if changed.is_err() {
                    break;
                }
            }
        }
    }
}

/// The config without its reloadable part, for comparing what needs a restart. (`Debug` prints
/// no secret: tokens print redacted, so a changed token alone goes unnoticed until a restart.)
fn restart_only(config: &Config) -> String {
    let mut config = config.clone();
    config.replicas.clear();
    format!("{config:?}")
}

/// [`super::IndexServer::watch_config`]'s loop.
pub(crate) async fn follow_config_file(
    shared: Arc<Shared>,
    mut watch: ConfigFileWatch,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            () = watch.changed() => {}
        }
        let path = watch.path();
        let parsed = std::fs::read_to_string(path)
            .map_err(|e| e.to_string())
            .and_then(|text| Config::from_yaml(&text).map_err(|e| e.to_string()));
        match parsed {
            Ok(config) => {
                shared.replicas.reload(&shared, config).await;
                tracing::info!(path = %path.display(), "config reloaded");
            }
            Err(error) => {
                shared.replicas.count_reload("rejected");
                tracing::error!(%error, path = %path.display(), "config reload rejected; keeping the running replicas");
            }
        }
    }
}
