//! kvroute-discovery: which engine replicas exist, learned from Kubernetes.
//!
//! A [`Discovery`] watches the Pods of one namespace selected by a Gateway API Inference
//! Extension v1 `InferencePool` ([`inference_pool`]: its `spec.selector.matchLabels` and
//! `spec.targetPorts`) or by a plain label selector, optionally only those on one node (the
//! agent's), and publishes a [`Snapshot`]: the Ready pods' replicas ([`Replica`]: id, `ip:port`,
//! metrics URL, KV-event and replay endpoints, model), ordered and deduplicated. Each snapshot
//! replaces the last whole; a consumer swaps its replica set to it.
//!
//! Lifecycle: [`KubernetesSource`] is parsed from the shared `kubernetes:` config section
//! ([`config`]); [`Discovery::start`] connects (in-cluster service account, a kubeconfig, or a
//! URL) and spawns the watch on the caller's `TaskTracker`; [`Discovery::snapshots`] yields a
//! `tokio::sync::watch` receiver; [`Discovery::stop`] (or drop) ends the task. The watch never
//! gives up: kube-rs's watcher resumes from resource versions, relists at once after `410 Gone`,
//! and retries with a backoff that depends on the error (at most 2 s apart while the server is
//! unreachable, 1 s doubling to 60 s while it refuses the list); every relist and error is
//! counted ([`DiscoveryMetrics`]), and a run of failures is logged when it starts (with its
//! reason), every minute while it lasts, and when the watch recovers.
//!
//! Pod annotations and defaults (ports, model, replica ids): [`replica`].
//!
//! RBAC the watch needs in its namespace: `get`, `list`, `watch` on `pods` (core) and, with an
//! InferencePool, on `inferencepools` (`inference.networking.k8s.io`).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use kvroute_discovery::{Discovery, DiscoveryMetrics, KubernetesSource, RawKubernetes};
//! let raw: RawKubernetes = serde_json::from_str(r#"{"namespace": "llm", "inference_pool": "llama"}"#)?;
//! let source = KubernetesSource::try_from(raw)?;
//! let metrics = DiscoveryMetrics::register(&mut prometheus_client::registry::Registry::default());
//! let tasks = tokio_util::task::TaskTracker::new();
//! let discovery = Discovery::start("llama", source, &metrics, &tasks).await?;
//! let mut snapshots = discovery.snapshots();
//! while snapshots.changed().await.is_ok() {
//!     let snapshot = snapshots.borrow_and_update().clone();
//!     println!("{:?}", snapshot.ids());
//! }
//! # Ok(()) }
//! ```
//!
//! `testing` (feature `test-util`): an API server double speaking the list/watch wire
//! protocol, for tests of every crate that discovers through this one.
#![deny(missing_docs)]

pub mod config;
mod failure_log;
pub mod inference_pool;
mod metrics;
pub mod replica;
mod retry;
#[cfg(feature = "test-util")]
pub mod testing;
mod watch;

pub use config::{
    Connection, KubernetesSource, RawKubernetes, RawPoolDiscovery, Target, TargetPort,
};
pub use metrics::DiscoveryMetrics;
pub use replica::{Replica, Snapshot};
pub use watch::{Discovery, StartError};
