//! [`Discovery`]: the watch loop that turns Kubernetes objects into [`Snapshot`]s.
//!
//! One task per source, owned by the caller's `TaskTracker` and stopped by [`Discovery::stop`]
//! (or drop). With an InferencePool it runs two kube-rs watchers: the pool (field selector
//! `metadata.name=<pool>`) and the pods its selector picks; when the pool's selector or target
//! ports change, the pod watch is restarted with the new selector and the old snapshot stays
//! until the new watch has listed (no gap in routing). With a plain selector, only the pod
//! watch runs.
//!
//! kube-rs's watcher does the protocol: list, then watch from the list's resourceVersion with
//! bookmarks, resume from the last seen version after a dropped connection, relist after
//! `410 Gone`; errors are retried as `retry` says (at once after `410 Gone`). Each (re)list
//! buffers the listed pods and replaces the store whole when the list is complete, so pods
//! deleted while the watch was down disappear. Each error and completed relist is counted; a run
//! of errors is logged as `failure_log` says (when it starts, once a minute, when it ends).

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::watcher::{self, Event, ListSemantic};
use tokio::sync::watch as channel;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Connection, KubernetesSource, Target, TargetPort};
use crate::failure_log::FailureLog;
use crate::inference_pool::{InferencePool, PoolSelection};
use crate::metrics::{DiscoveryMetrics, SourceLabels, WatchLabels};
use crate::replica::{PortPlan, Refusal, Replica, Snapshot, replicas_of, snapshot};
use crate::retry::Failed;

const WATCH_PODS: &str = "pods";
const WATCH_POOL: &str = "inference_pool";

/// Why discovery could not start (the watch itself never fails: it retries).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// `Connection::InCluster` outside a pod, or without its service account.
    #[error("cannot load the in-cluster Kubernetes configuration (service account)")]
    InCluster(#[source] kube::config::InClusterError),
    /// The kubeconfig file is unreadable or unusable.
    #[error("cannot use kubeconfig {path}")]
    Kubeconfig {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// The client could not be built from the configuration (TLS setup, URL).
    #[error("cannot build the Kubernetes client")]
    Client(#[source] kube::Error),
}

impl StartError {
    /// Metric/log label.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::InCluster(_) => "in_cluster",
            Self::Kubeconfig { .. } => "kubeconfig",
            Self::Client(_) => "client",
        }
    }
}

/// A running discovery source. Dropping it stops the watch.
#[derive(Debug)]
pub struct Discovery {
    snapshots: channel::Receiver<Arc<Snapshot>>,
    cancel: CancellationToken,
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl Discovery {
    /// Connects to the API server as `source.connection` says and starts watching on `tasks`.
    /// `name` labels the source's metrics and logs (a pool name from config).
    pub async fn start(
        name: &str,
        source: KubernetesSource,
        metrics: &DiscoveryMetrics,
        tasks: &TaskTracker,
    ) -> Result<Self, StartError> {
        let config = match &source.connection {
            Connection::InCluster => kube::Config::incluster().map_err(StartError::InCluster)?,
            Connection::Kubeconfig(path) => {
                let kubeconfig_error = |source| StartError::Kubeconfig {
                    path: path.display().to_string(),
                    source,
                };
                let file = kube::config::Kubeconfig::read_from(path).map_err(kubeconfig_error)?;
                kube::Config::from_custom_kubeconfig(
                    file,
                    &kube::config::KubeConfigOptions::default(),
                )
                .await
                .map_err(kubeconfig_error)?
            }
            Connection::Url(url) => kube::Config::new(url.clone()),
        };
        let namespace = source
            .namespace
            .clone()
            .unwrap_or_else(|| config.default_namespace.clone());
        let client = kube::Client::try_from(config).map_err(StartError::Client)?;
        let (tx, rx) = channel::channel(Arc::new(Snapshot::default()));
        let cancel = CancellationToken::new();
        let run = Run {
            name: name.to_owned(),
            pods_api: Api::namespaced(client.clone(), &namespace),
            pools_api: Api::namespaced(client, &namespace),
            source,
            metrics: metrics.clone(),
            tx,
            pod_failures: FailureLog::new(name, WATCH_PODS),
            pool_failures: FailureLog::new(name, WATCH_POOL),
        };
        tracing::info!(source = name, namespace, "kubernetes discovery starting");
        tasks.spawn(run.run(cancel.clone()));
        Ok(Self {
            snapshots: rx,
            cancel,
        })
    }

    /// The snapshots as they are published (the current one first).
    pub fn snapshots(&self) -> channel::Receiver<Arc<Snapshot>> {
        self.snapshots.clone()
    }

    /// The current snapshot.
    pub fn current(&self) -> Arc<Snapshot> {
        Arc::clone(&self.snapshots.borrow())
    }

    /// Stops the watch (the task ends at its next step).
    pub fn stop(&self) {
        self.cancel.cancel();
    }
}

type EventStream<K> = Pin<Box<dyn Stream<Item = Result<Event<K>, Failed>> + Send>>;

/// The metric label of a watch error.
fn error_label(error: &watcher::Error) -> &'static str {
    match error {
        watcher::Error::InitialListFailed(_) => "list_failed",
        watcher::Error::WatchStartFailed(_) => "watch_start_failed",
        watcher::Error::WatchError(status) if status.code == 410 => "gone",
        watcher::Error::WatchError(_) => "error_event",
        watcher::Error::WatchFailed(_) => "watch_failed",
        watcher::Error::NoResourceVersion => "no_resource_version",
    }
}

/// The pod watch of one selection, with what it has seen.
struct PodWatch {
    stream: EventStream<Pod>,
    plan: PortPlan,
    /// Pod name → its replicas (empty while not routable or refused).
    pods: BTreeMap<String, Vec<Replica>>,
    /// Pods of a (re)list in progress.
    listing: Option<BTreeMap<String, Vec<Replica>>>,
    synced: bool,
    /// `restarts{reason}` of this watch's first list.
    first_reason: &'static str,
    lists: u64,
}

struct Run {
    name: String,
    pods_api: Api<Pod>,
    pools_api: Api<InferencePool>,
    source: KubernetesSource,
    metrics: DiscoveryMetrics,
    tx: channel::Sender<Arc<Snapshot>>,
    pod_failures: FailureLog,
    pool_failures: FailureLog,
}

impl Run {
    async fn run(self, cancel: CancellationToken) {
        let mut pool_stream: Option<EventStream<InferencePool>> = match &self.source.target {
            Target::InferencePool(name) => Some(
                watcher(
                    self.pools_api.clone(),
                    watcher::Config::default().fields(&format!("metadata.name={name}")),
                )
                .boxed(),
            ),
            Target::Selector { .. } => None,
        };
        let mut selection: Option<(String, PortPlan)> = match &self.source.target {
            Target::Selector { labels, port } => {
                Some((label_selector(labels), self.plan(vec![port.clone()])))
            }
            Target::InferencePool(_) => None,
        };
        // The listed pool while a pool (re)list is in progress.
        let mut pool_listing: Option<Option<InferencePool>> = None;
        let mut pods: Option<PodWatch> = None;
        let mut next_reason = "start";
        let mut pool_lists = 0u64;
        loop {
            if pods.is_none()
                && let Some((labels, plan)) = &selection
            {
                pods = Some(self.pod_watch(labels, plan.clone(), next_reason));
                next_reason = "retarget";
            }
            tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                Some(item) = next_of(pool_stream.as_mut()) => {
                    if item.as_ref().is_ok_and(crate::retry::is_progress) {
                        self.pool_failures.succeeded();
                    }
                    let pool = match item {
                        Err(failed) => {
                            self.error(WATCH_POOL, &failed);
                            continue;
                        }
                        Ok(Event::Init) => {
                            pool_listing = Some(None);
                            continue;
                        }
                        Ok(Event::InitApply(pool)) => {
                            pool_listing = Some(Some(pool));
                            continue;
                        }
                        Ok(Event::InitDone) => {
                            let reason = if pool_lists == 0 { "start" } else { "relist" };
                            pool_lists += 1;
                            self.count_restart(WATCH_POOL, reason);
                            tracing::info!(source = self.name, watch = WATCH_POOL, reason, "InferencePool listed");
                            pool_listing.take().flatten()
                        }
                        Ok(Event::Apply(pool)) => Some(pool),
                        Ok(Event::Delete(_)) => None,
                    };
                    self.retarget(pool.as_ref(), &mut selection, &mut pods);
                }
                Some(item) = next_of(pods.as_mut().map(|p| &mut p.stream)) => {
                    if let Some(watch) = pods.as_mut() {
                        self.on_pod_event(watch, item);
                    }
                }
            }
        }
        tracing::info!(
            source = self.name,
            exit_reason = "cancelled",
            "kubernetes discovery stopped"
        );
    }

    fn plan(&self, targets: Vec<TargetPort>) -> PortPlan {
        PortPlan {
            targets,
            kv_events_port: self.source.kv_events_port,
            kv_replay_port: self.source.kv_replay_port,
        }
    }

    fn pod_watch(&self, labels: &str, plan: PortPlan, first_reason: &'static str) -> PodWatch {
        let mut config = watcher::Config::default()
            .labels(labels)
            // A relist (after 410 Gone) reads the current state, not a cache that may be older
            // than what this watch already saw.
            .list_semantic(ListSemantic::MostRecent);
        if let Some(node) = &self.source.node_name {
            config = config.fields(&format!("spec.nodeName={node}"));
        }
        tracing::info!(source = self.name, selector = labels, node = ?self.source.node_name, "watching pods");
        PodWatch {
            stream: watcher(self.pods_api.clone(), config).boxed(),
            plan,
            pods: BTreeMap::new(),
            listing: None,
            synced: false,
            first_reason,
            lists: 0,
        }
    }

    fn on_pod_event(&self, watch: &mut PodWatch, item: Result<Event<Pod>, Failed>) {
        let event = match item {
            Err(failed) => {
                self.error(WATCH_PODS, &failed);
                return;
            }
            Ok(event) => event,
        };
        if crate::retry::is_progress(&event) {
            self.pod_failures.succeeded();
        }
        match event {
            Event::Init => {
                watch.listing = Some(BTreeMap::new());
            }
            Event::InitApply(pod) => {
                let replicas = self.replicas(&pod, &watch.plan);
                if let (Some(listing), Some(name)) = (watch.listing.as_mut(), pod.metadata.name) {
                    listing.insert(name, replicas);
                }
            }
            Event::InitDone => {
                // Counted once the list is complete: a list that fails is retried from `Init`,
                // and only its errors are counted.
                let reason = if watch.lists == 0 {
                    watch.first_reason
                } else {
                    "relist"
                };
                watch.lists += 1;
                self.count_restart(WATCH_PODS, reason);
                tracing::info!(
                    source = self.name,
                    watch = WATCH_PODS,
                    reason,
                    "pods listed"
                );
                watch.pods = watch.listing.take().unwrap_or_default();
                watch.synced = true;
                self.publish(watch);
            }
            Event::Apply(pod) => {
                let replicas = self.replicas(&pod, &watch.plan);
                if let Some(name) = pod.metadata.name {
                    watch.pods.insert(name, replicas);
                }
                self.publish(watch);
            }
            Event::Delete(pod) => {
                if let Some(name) = pod.metadata.name {
                    watch.pods.remove(&name);
                }
                self.publish(watch);
            }
        }
    }

    /// The pool changed (`None`: absent or deleted): re-target the pod watch if its selection did.
    fn retarget(
        &self,
        pool: Option<&InferencePool>,
        selection: &mut Option<(String, PortPlan)>,
        pods: &mut Option<PodWatch>,
    ) {
        let Some(pool) = pool else {
            if selection.take().is_some() || pods.is_some() || !self.tx.borrow().synced {
                tracing::warn!(
                    source = self.name,
                    "InferencePool not found or deleted: no replicas"
                );
            }
            *pods = None;
            self.send(Snapshot {
                replicas: Vec::new(),
                synced: true,
            });
            return;
        };
        let PoolSelection { labels, ports } = match pool.selection() {
            Ok(selection) => selection,
            Err(why) => {
                self.metrics
                    .invalid_pools
                    .get_or_create(&self.labels(WATCH_POOL, why.as_label()))
                    .inc();
                tracing::error!(
                    source = self.name,
                    reason = why.as_label(),
                    "InferencePool spec selects nothing; keeping the previous selection"
                );
                return;
            }
        };
        let next = (
            label_selector(&labels),
            self.plan(ports.iter().copied().map(TargetPort::Number).collect()),
        );
        if selection.as_ref() != Some(&next) {
            tracing::info!(
                source = self.name,
                selector = next.0,
                ?ports,
                "InferencePool selection changed"
            );
            *selection = Some(next);
            *pods = None;
        }
    }

    fn replicas(&self, pod: &Pod, plan: &PortPlan) -> Vec<Replica> {
        replicas_of(pod, plan).unwrap_or_else(|why| {
            self.refused(pod.metadata.name.as_deref().unwrap_or_default(), why);
            Vec::new()
        })
    }

    fn refused(&self, pod: &str, why: Refusal) {
        self.metrics
            .refused
            .get_or_create(&self.labels(WATCH_PODS, why.as_label()))
            .inc();
        tracing::warn!(
            source = self.name,
            pod,
            reason = why.as_label(),
            "pod left out of discovery"
        );
    }

    fn publish(&self, watch: &PodWatch) {
        if !watch.synced {
            return;
        }
        let next = snapshot(&watch.pods, true, |replica, why| {
            self.refused(&replica.id, why)
        });
        self.send(next);
    }

    /// Replaces the published snapshot when it differs; logs who joined and left.
    fn send(&self, next: Snapshot) {
        let labels = SourceLabels {
            source: self.name.clone(),
        };
        let count = next.replicas.len();
        let mut changed = None;
        self.tx.send_if_modified(|current| {
            if **current == next {
                return false;
            }
            let joined: Vec<&str> = next
                .replicas
                .iter()
                .filter(|r| current.get(&r.id) != Some(r))
                .map(|r| r.id.as_str())
                .collect();
            let left: Vec<&str> = current
                .replicas
                .iter()
                .filter(|r| next.get(&r.id).is_none())
                .map(|r| r.id.as_str())
                .collect();
            changed = Some(format!("joined or changed {joined:?}, left {left:?}"));
            *current = Arc::new(next);
            true
        });
        if let Some(change) = changed {
            self.metrics
                .replicas
                .get_or_create(&labels)
                .set(count as i64);
            self.metrics.snapshots.get_or_create(&labels).inc();
            tracing::info!(
                source = self.name,
                replicas = count,
                change,
                "discovery snapshot"
            );
        }
    }

    fn count_restart(&self, watch: &'static str, reason: &'static str) {
        self.metrics
            .restarts
            .get_or_create(&self.labels(watch, reason))
            .inc();
    }

    /// Counts a failed call and its wait; logs it as the watch's [`FailureLog`] says (the first
    /// failure of a run, throttled repeats).
    fn error(&self, watch: &'static str, failed: &Failed) {
        let reason = error_label(&failed.error);
        let labels = self.labels(watch, reason);
        self.metrics
            .retry_waits
            .get_or_create(&labels)
            .observe(failed.retry_in.as_secs_f64());
        self.metrics.errors.get_or_create(&labels).inc();
        let log = if watch == WATCH_POOL {
            &self.pool_failures
        } else {
            &self.pod_failures
        };
        log.failed(reason, failed);
    }

    fn labels(&self, watch: &'static str, reason: &'static str) -> WatchLabels {
        WatchLabels {
            source: self.name.clone(),
            watch,
            reason,
        }
    }
}

/// kube-rs's watcher, waiting after each error as [`RetryPolicy`](crate::retry::RetryPolicy)
/// says (no wait after `410 Gone`, a short cap while the server is unreachable).
fn watcher<K>(
    api: Api<K>,
    config: watcher::Config,
) -> impl Stream<Item = Result<Event<K>, Failed>> + Send
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    crate::retry::with_retry(watcher::watcher(api, config))
}

/// `k=v,k2=v2`: the `labelSelector` of `matchLabels`.
fn label_selector(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The next item of `stream`, or never when there is none (a `select!` branch that sleeps).
async fn next_of<S: Stream + Unpin>(stream: Option<&mut S>) -> Option<S::Item> {
    match stream {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}
