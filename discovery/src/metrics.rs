//! Discovery's metrics, registered by the component that owns them (no global registry).
//!
//! Label values are fixed enums, except `source`: the name the caller gives the source (a pool
//! name from its config).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// `{source, watch, reason}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct WatchLabels {
    pub(crate) source: String,
    /// `pods` or `inference_pool`.
    pub(crate) watch: &'static str,
    pub(crate) reason: &'static str,
}

/// `{source}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SourceLabels {
    pub(crate) source: String,
}

/// Upper bounds (seconds) of `discovery_watch_retry_wait_seconds`: 0 (retried at once: 410
/// Gone) apart, then the short backoff of an unreachable server up to its 2 s cap, then the long
/// one of a refused list up to 60 s.
const RETRY_WAIT_BUCKETS: [f64; 10] = [0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 15.0, 30.0, 60.0];

/// `{source, watch, reason}` → histogram.
pub(crate) type RetryWaits = Family<WatchLabels, Histogram, fn() -> Histogram>;

fn retry_wait_histogram() -> Histogram {
    Histogram::new(RETRY_WAIT_BUCKETS)
}

/// Discovery's metric families.
#[derive(Debug, Clone)]
pub struct DiscoveryMetrics {
    /// `discovery_watch_restarts_total{source, watch, reason}`: completed (re)lists (a list that
    /// fails counts in `errors` only, however often it is retried). `reason`: `start`
    /// (the first list), `relist` (after a stream ended beyond repair, e.g. 410 Gone) or
    /// `retarget` (the InferencePool's selector or ports changed).
    pub(crate) restarts: Family<WatchLabels, Counter>,
    /// `discovery_watch_errors_total{source, watch, reason}`: failed list/watch calls and error
    /// events (`reason`: see `watch::error_label`).
    pub(crate) errors: Family<WatchLabels, Counter>,
    /// `discovery_watch_retry_wait_seconds{source, watch, reason}`: how long a watch waited
    /// before its next attempt after each error (`reason` as in `errors`): 0 after `410 Gone`,
    /// at most 2 s while the server is unreachable, up to 60 s after refused lists.
    pub(crate) retry_waits: RetryWaits,
    /// `discovery_pods_refused_total{source, watch="pods", reason}`: pods that look routable but
    /// cannot be used (bad annotation, missing named port, duplicate address).
    pub(crate) refused: Family<WatchLabels, Counter>,
    /// `discovery_invalid_pools_total{source, watch="inference_pool", reason}`.
    pub(crate) invalid_pools: Family<WatchLabels, Counter>,
    /// `discovery_replicas{source}`: replicas in the current snapshot.
    pub(crate) replicas: Family<SourceLabels, Gauge>,
    /// `discovery_snapshots_total{source}`: snapshots published (each replaces the last).
    pub(crate) snapshots: Family<SourceLabels, Counter>,
}

impl Default for DiscoveryMetrics {
    fn default() -> Self {
        Self {
            restarts: Family::default(),
            errors: Family::default(),
            retry_waits: Family::new_with_constructor(retry_wait_histogram),
            refused: Family::default(),
            invalid_pools: Family::default(),
            replicas: Family::default(),
            snapshots: Family::default(),
        }
    }
}

impl DiscoveryMetrics {
    /// Registers the families in `registry` (names prefixed `discovery_`).
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        let registry = registry.sub_registry_with_prefix("discovery");
        registry.register(
            "watch_restarts",
            "Kubernetes list/watch (re)starts by reason",
            metrics.restarts.clone(),
        );
        registry.register(
            "watch_errors",
            "Kubernetes list/watch errors by reason",
            metrics.errors.clone(),
        );
        registry.register(
            "watch_retry_wait_seconds",
            "Wait before a Kubernetes list/watch's next attempt after an error, by error reason",
            metrics.retry_waits.clone(),
        );
        registry.register(
            "pods_refused",
            "Ready pods left out of discovery by reason",
            metrics.refused.clone(),
        );
        registry.register(
            "invalid_pools",
            "InferencePool specs that select nothing, by reason",
            metrics.invalid_pools.clone(),
        );
        registry.register(
            "replicas",
            "Replicas in the current discovery snapshot",
            metrics.replicas.clone(),
        );
        registry.register(
            "snapshots",
            "Discovery snapshots published",
            metrics.snapshots.clone(),
        );
        metrics
    }
}
