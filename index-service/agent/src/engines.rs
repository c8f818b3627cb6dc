//! The engines an agent mirrors, and how that set changes while it runs.
//!
//! The set is the config's `engines:` plus, with `discovery:`, one engine per replica of the
//! Ready pods on the agent's node ([`kvroute_discovery`]): mode `connect` to the replica's
//! `kv_events`, replay from `kv_replay`, topic `kv_topic`, replica id the discovered id (the pod
//! name, or `<pod>-rank<N>`: the id ext-proc and the index use too). A discovered replica whose
//! id a static engine already has is left out, as is any beyond what one `Hello` may claim
//! (`kvroute_agent_engines_refused_total{reason}`, logged).
//!
//! One task (`Supervisor::run`) owns the set and changes it when a discovery snapshot arrives
//! or the config file changes (mtime checked every `reload_interval` by the watcher ext-proc
//! and the index use too, [`kvroute_runtime::config_file`]). A change stops the ingest of
//! each removed (or re-pointed) engine before its mirror goes, adds the new mirrors before
//! their ingest starts, and hands the new set to the [`Hub`], which makes the index streams
//! reopen with a `Hello` claiming it. A file that does not validate, or whose new discovery
//! section cannot start, changes nothing (`config_reloads_total{outcome="rejected"}`); keys
//! only a restart applies keep their running value (`config_restart_required_total{key}`, a
//! warning).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvroute_config::SocketMode;
use kvroute_discovery::{Discovery, DiscoveryMetrics, KubernetesSource, Replica, Snapshot};
use kvroute_index_api::agent_protocol::MAX_REPLICAS_PER_HELLO;
use kvroute_ingest::{EventSink, Ingest, IngestConfig, IngestMetrics};
use kvroute_runtime::config_file::ConfigFileWatch;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::AgentConfig;
use crate::hub::Hub;
use crate::metrics::AgentMetrics;

/// The `source` label of discovery's metrics in the agent.
const DISCOVERY_SOURCE: &str = "engines";

/// Where an engine comes from (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Static,
    Discovered,
}

impl Source {
    fn as_label(self) -> &'static str {
        match self {
            Source::Static => "static",
            Source::Discovered => "discovered",
        }
    }
}

/// Why an engine was left out (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    DuplicateId,
    TooManyReplicas,
}

impl Refusal {
    fn as_label(self) -> &'static str {
        match self {
            Refusal::DuplicateId => "duplicate_id",
            Refusal::TooManyReplicas => "too_many_replicas",
        }
    }
}

type Wanted = BTreeMap<Arc<str>, (Source, IngestConfig)>;

/// The engine of one discovered replica.
fn discovered_engine(replica: &Replica) -> IngestConfig {
    let engine = IngestConfig::new(
        replica.id.as_str(),
        replica.kv_events.clone(),
        SocketMode::Connect,
    );
    let engine = if replica.rank_by_header {
        engine.with_checked_dp_rank(u32::from(replica.rank))
    } else {
        engine.with_dp_rank(u32::from(replica.rank))
    }
    .with_topic_filter(replica.kv_topic.clone());
    match &replica.kv_replay {
        Some(replay) => engine.with_replay_endpoint(replay.clone()),
        None => engine,
    }
}

/// The union of the static engines and the discovered replicas (static first; a discovered id
/// already taken, or beyond [`MAX_REPLICAS_PER_HELLO`], is reported to `refused`).
fn wanted(
    static_engines: &[IngestConfig],
    discovered: &[Replica],
    mut refused: impl FnMut(&str, Refusal),
) -> Wanted {
    let mut wanted: Wanted = static_engines
        .iter()
        .map(|e| (Arc::clone(&e.replica_id), (Source::Static, e.clone())))
        .collect();
    for replica in discovered {
        if wanted.contains_key(replica.id.as_str()) {
            refused(&replica.id, Refusal::DuplicateId);
        } else if wanted.len() >= MAX_REPLICAS_PER_HELLO {
            refused(&replica.id, Refusal::TooManyReplicas);
        } else {
            let engine = discovered_engine(replica);
            wanted.insert(Arc::clone(&engine.replica_id), (Source::Discovered, engine));
        }
    }
    wanted
}

struct Running {
    source: Source,
    engine: IngestConfig,
    /// One ingest per engine, so one can stop without the others.
    ingest: Ingest,
}

/// The running engines: their ingest tasks and the hub's replica set.
pub(crate) struct Engines {
    hub: Arc<Hub>,
    ingest_metrics: IngestMetrics,
    metrics: AgentMetrics,
    cancel: CancellationToken,
    running: BTreeMap<Arc<str>, Running>,
}

impl Engines {
    /// None running yet; every ingest stops with `cancel` at the latest.
    pub(crate) fn new(
        hub: Arc<Hub>,
        ingest_metrics: IngestMetrics,
        metrics: AgentMetrics,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            hub,
            ingest_metrics,
            metrics,
            cancel,
            running: BTreeMap::new(),
        }
    }

    /// Makes `wanted` the running set.
    async fn apply(&mut self, wanted: Wanted) {
        let stale: Vec<Arc<str>> = self
            .running
            .iter()
            .filter(|(id, running)| wanted.get(*id).is_none_or(|(_, e)| *e != running.engine))
            .map(|(id, _)| Arc::clone(id))
            .collect();
        let mut restarted = Vec::new();
        let mut stopping = Vec::with_capacity(stale.len());
        for id in stale {
            if let Some(running) = self.running.remove(&id) {
                tracing::info!(replica_id = %id, source = running.source.as_label(), "engine leaves; stopping its ingest");
                let ingest = running.ingest;
                let id = Arc::clone(&id);
                // `stop` also forgets the engine's per-replica ingest series.
                stopping.push(async move {
                    ingest.stop(&id).await;
                    ingest.shutdown().await;
                });
            }
            if wanted.contains_key(&id) {
                restarted.push(id);
            }
        }
        // Stopped before the mirrors change: no batch of a removed engine lands afterwards.
        futures::future::join_all(stopping).await;
        let ids: Vec<Arc<str>> = wanted.keys().cloned().collect();
        self.hub.set_replicas(&ids, &restarted);
        for (id, (source, engine)) in wanted {
            if let Some(running) = self.running.get_mut(&id) {
                running.source = source;
                continue;
            }
            tracing::info!(replica_id = %id, source = source.as_label(), endpoint = %engine.endpoint, "engine joins");
            let ingest = Ingest::new(
                Arc::clone(&self.hub) as Arc<dyn EventSink>,
                self.ingest_metrics.clone(),
                self.cancel.child_token(),
            );
            ingest.spawn(engine.clone());
            self.running.insert(
                id,
                Running {
                    source,
                    engine,
                    ingest,
                },
            );
        }
        for source in [Source::Static, Source::Discovered] {
            let n = self.running.values().filter(|r| r.source == source).count();
            self.metrics.set_engines(source.as_label(), n);
        }
    }

    async fn shutdown(self) {
        futures::future::join_all(self.running.into_values().map(|r| r.ingest.shutdown())).await;
    }
}

struct RunningDiscovery {
    snapshots: watch::Receiver<Arc<Snapshot>>,
    /// Dropping it stops the watch.
    _discovery: Discovery,
}

/// Owns the engine set; see the module docs.
pub(crate) struct Supervisor {
    engines: Engines,
    config: AgentConfig,
    /// The config file followed (`None`: no reloads).
    config_file: Option<ConfigFileWatch>,
    discovery: Option<RunningDiscovery>,
    /// The replicas of the last synced snapshot (kept while a restarted watch has not listed).
    discovered: Vec<Replica>,
    discovery_metrics: DiscoveryMetrics,
    tasks: TaskTracker,
    metrics: AgentMetrics,
}

impl Supervisor {
    /// Starts discovery (if configured) and the static engines.
    pub(crate) async fn start(
        engines: Engines,
        config: AgentConfig,
        path: Option<PathBuf>,
        discovery_metrics: DiscoveryMetrics,
        tasks: TaskTracker,
    ) -> Result<Self, kvroute_discovery::StartError> {
        let metrics = engines.metrics.clone();
        let config_file = path.map(|path| ConfigFileWatch::new(path, config.reload_interval));
        let mut supervisor = Self {
            engines,
            discovery: None,
            config,
            config_file,
            discovered: Vec::new(),
            discovery_metrics,
            tasks,
            metrics,
        };
        if let Some(source) = supervisor.config.discovery.clone() {
            supervisor.discovery = Some(supervisor.start_discovery(source).await?);
        }
        supervisor.apply().await;
        Ok(supervisor)
    }

    async fn start_discovery(
        &self,
        source: KubernetesSource,
    ) -> Result<RunningDiscovery, kvroute_discovery::StartError> {
        let discovery = Discovery::start(
            DISCOVERY_SOURCE,
            source,
            &self.discovery_metrics,
            &self.tasks,
        )
        .await?;
        Ok(RunningDiscovery {
            snapshots: discovery.snapshots(),
            _discovery: discovery,
        })
    }

    async fn apply(&mut self) {
        let metrics = &self.metrics;
        let wanted = wanted(&self.config.engines, &self.discovered, |id, why| {
            metrics.engine_refused(why.as_label());
            tracing::warn!(
                replica_id = id,
                reason = why.as_label(),
                "discovered engine left out"
            );
        });
        self.engines.apply(wanted).await;
    }

    /// Follows discovery and the config file until `cancel`, then stops every engine.
    pub(crate) async fn run(mut self, cancel: CancellationToken) {
        loop {
            // A reload may change the period.
            if let Some(watch) = &mut self.config_file {
                watch.set_interval(self.config.reload_interval);
            }
            tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                changed = next_snapshot(&mut self.discovery) => {
                    if !changed {
                        // The watch ended (it only does when stopped): stop polling it.
                        self.discovery = None;
                        continue;
                    }
                    let snapshot = self
                        .discovery
                        .as_mut()
                        .map(|d| Arc::clone(&d.snapshots.borrow_and_update()));
                    // Before its first list a watch knows nothing: keep what we have.
                    if let Some(snapshot) = snapshot.filter(|s| s.synced) {
                        self.discovered.clone_from(&snapshot.replicas);
                        self.apply().await;
                    }
                }
                () = next_change(&mut self.config_file) => {
                    let Some(path) = self.config_file.as_ref().map(|w| w.path().to_owned()) else {
                        continue;
                    };
                    self.reload(&path).await;
                }
            }
        }
        self.discovery = None;
        self.engines.shutdown().await;
    }

    async fn reload(&mut self, path: &Path) {
        let reload = std::fs::read_to_string(path)
            .map_err(|error| error.to_string())
            .and_then(|text| {
                self.config
                    .reload_from_yaml(&text)
                    .map_err(|error| error.to_string())
            });
        let reload = match reload {
            Ok(reload) => reload,
            Err(error) => {
                self.metrics.config_reload("rejected");
                tracing::error!(%error, path = %path.display(), "config reload rejected; keeping the running config");
                return;
            }
        };
        for key in &reload.restart_required {
            self.metrics.restart_required(key);
            tracing::warn!(
                key,
                "config key changed; it applies after a restart, the running value is kept"
            );
        }
        let new = reload.config;
        let discovery_changed = new.discovery != self.config.discovery;
        if new.engines == self.config.engines
            && !discovery_changed
            && new.reload_interval == self.config.reload_interval
        {
            self.metrics.config_reload("unchanged");
            return;
        }
        if discovery_changed {
            match new.discovery.clone() {
                Some(source) => match self.start_discovery(source).await {
                    // The old watch stops on drop; its replicas stay until the new one lists.
                    Ok(started) => self.discovery = Some(started),
                    Err(error) => {
                        self.metrics.config_reload("rejected");
                        tracing::error!(error = %error, reason = error.as_label(), path = %path.display(),
                            "config reload rejected: the new discovery section cannot start; keeping the running config");
                        return;
                    }
                },
                None => {
                    self.discovery = None;
                    self.discovered.clear();
                }
            }
        }
        self.config = new;
        self.apply().await;
        self.metrics.config_reload("applied");
        tracing::info!(path = %path.display(), engines = self.engines.running.len(), "config reloaded");
    }
}

/// Resolves when the followed config file changed; never without one.
async fn next_change(config_file: &mut Option<ConfigFileWatch>) {
    match config_file {
        // Cancel-safe (its docs): losing the race to a snapshot loses no change.
        Some(watch) => watch.changed().await,
        None => std::future::pending().await,
    }
}

/// Whether the watch published a new snapshot (`false`: it ended); never resolves without one.
async fn next_snapshot(discovery: &mut Option<RunningDiscovery>) -> bool {
    match discovery {
        Some(running) => running.snapshots.changed().await.is_ok(),
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(id: &str, port: u16) -> Replica {
        Replica {
            id: id.to_owned(),
            pod: id.to_owned(),
            rank: 0,
            rank_by_header: false,
            role: kvroute_config::Role::Both,
            engine: None,
            address: format!("10.0.0.1:{port}").parse().unwrap(),
            metrics_url: String::new(),
            kv_events: format!("tcp://10.0.0.1:{port}"),
            kv_replay: Some(format!("tcp://10.0.0.1:{}", port + 1)),
            kv_topic: "kv".to_owned(),
            model: None,
            node: Some("node-a".to_owned()),
        }
    }

    #[test]
    fn discovered_replicas_join_the_static_engines_and_a_taken_id_is_refused() {
        let static_engine =
            IngestConfig::new("engine-a", "tcp://127.0.0.1:5557", SocketMode::Connect);
        let mut refusals = Vec::new();
        let wanted = wanted(
            std::slice::from_ref(&static_engine),
            &[replica("pod-1", 6000), replica("engine-a", 6100)],
            |id, why| refusals.push((id.to_owned(), why)),
        );
        assert_eq!(
            refusals,
            [("engine-a".to_owned(), Refusal::DuplicateId)],
            "the static engine keeps its id"
        );
        assert_eq!(wanted["engine-a"], (Source::Static, static_engine));
        let (source, engine) = &wanted["pod-1"];
        assert_eq!(*source, Source::Discovered);
        assert_eq!(&*engine.replica_id, "pod-1");
        assert_eq!(engine.endpoint, "tcp://10.0.0.1:6000");
        assert_eq!(engine.mode, SocketMode::Connect);
        assert_eq!(
            engine.replay_endpoint.as_deref(),
            Some("tcp://10.0.0.1:6001")
        );
        assert_eq!(engine.topic_filter, "kv");
    }

    #[test]
    fn discovered_replicas_beyond_one_hello_are_refused() {
        let many: Vec<Replica> = (0..MAX_REPLICAS_PER_HELLO + 2)
            .map(|i| replica(&format!("pod-{i:05}"), 7000))
            .collect();
        let mut refused = 0;
        let wanted = wanted(&[], &many, |_, why| {
            assert_eq!(why, Refusal::TooManyReplicas);
            refused += 1;
        });
        assert_eq!(wanted.len(), MAX_REPLICAS_PER_HELLO);
        assert_eq!(refused, 2);
    }
}
