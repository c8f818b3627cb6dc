//! Agent metrics (`kvroute_agent_*`). Labels come from config (replica ids, index addresses)
//! or fixed enums only.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReplicaLabel {
    replica: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct IndexLabel {
    index: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SourceLabel {
    source: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KeyLabel {
    key: &'static str,
}

/// Agent metrics; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct AgentMetrics {
    mirror_blocks: Family<ReplicaLabel, Gauge>,
    blocks_refused: Counter,
    deltas_sent: Counter,
    delta_events_sent: Counter,
    snapshot_blocks: Counter,
    snapshot_events: Counter,
    subscribers_dropped: Family<ReasonLabel, Counter>,
    connected: Family<IndexLabel, Gauge>,
    connects: Family<IndexLabel, Counter>,
    stream_ends: Family<ReasonLabel, Counter>,
    refused_by_index: Counter,
    engines: Family<SourceLabel, Gauge>,
    engines_refused: Family<ReasonLabel, Counter>,
    config_reloads: Family<OutcomeLabel, Counter>,
    restart_required: Family<KeyLabel, Counter>,
}

impl AgentMetrics {
    /// Registers every metric in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = AgentMetrics::default();
        registry.register(
            "mirror_blocks",
            "Blocks mirrored per replica",
            m.mirror_blocks.clone(),
        );
        registry.register(
            "blocks_refused",
            "New blocks refused because a replica's mirror is at its cap",
            m.blocks_refused.clone(),
        );
        registry.register(
            "deltas_sent",
            "Delta messages queued to index streams",
            m.deltas_sent.clone(),
        );
        registry.register(
            "delta_events_sent",
            "Events in delta messages",
            m.delta_events_sent.clone(),
        );
        registry.register(
            "snapshot_blocks",
            "Blocks included in snapshots",
            m.snapshot_blocks.clone(),
        );
        registry.register(
            "snapshot_events",
            "BlockStored events in snapshots",
            m.snapshot_events.clone(),
        );
        registry.register(
            "subscribers_dropped",
            "Index streams dropped by the hub (they reconnect with a snapshot), by reason",
            m.subscribers_dropped.clone(),
        );
        registry.register(
            "index_connected",
            "1 while the stream to an index is up",
            m.connected.clone(),
        );
        registry.register(
            "index_connects",
            "Streams opened to an index",
            m.connects.clone(),
        );
        registry.register(
            "stream_ends",
            "Index streams that ended, by reason",
            m.stream_ends.clone(),
        );
        registry.register(
            "refused_by_index",
            "Writes the index refused (see its kvroute_index_agent_refused_total)",
            m.refused_by_index.clone(),
        );
        registry.register(
            "engines",
            "Engines mirrored, by source (static: engines:, discovered: Kubernetes)",
            m.engines.clone(),
        );
        registry.register(
            "engines_refused",
            "Discovered engines left out each time the engine set is recomputed, by reason \
             (duplicate_id: a static engine has the id; too_many_replicas: beyond one Hello)",
            m.engines_refused.clone(),
        );
        registry.register(
            "config_reloads",
            "Config file changes seen, by outcome (applied, unchanged, rejected)",
            m.config_reloads.clone(),
        );
        registry.register(
            "config_restart_required",
            "Reloads that changed a key only a restart applies (the running value is kept), by key",
            m.restart_required.clone(),
        );
        m
    }

    pub(crate) fn forget_replica(&self, replica: &str) {
        self.mirror_blocks.remove(&ReplicaLabel {
            replica: replica.to_owned(),
        });
    }

    pub(crate) fn set_engines(&self, source: &'static str, engines: usize) {
        self.engines
            .get_or_create(&SourceLabel { source })
            .set(i64::try_from(engines).unwrap_or(i64::MAX));
    }

    pub(crate) fn engine_refused(&self, reason: &'static str) {
        self.engines_refused
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    pub(crate) fn config_reload(&self, outcome: &'static str) {
        self.config_reloads
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    pub(crate) fn restart_required(&self, key: &'static str) {
        self.restart_required.get_or_create(&KeyLabel { key }).inc();
    }

    pub(crate) fn set_mirror_blocks(&self, replica: &str, blocks: usize) {
        self.mirror_blocks
            .get_or_create(&ReplicaLabel {
                replica: replica.to_owned(),
            })
            .set(i64::try_from(blocks).unwrap_or(i64::MAX));
    }

    pub(crate) fn blocks_refused(&self, blocks: usize) {
        self.blocks_refused.inc_by(blocks as u64);
    }

    pub(crate) fn delta_sent(&self, events: usize) {
        self.deltas_sent.inc();
        self.delta_events_sent.inc_by(events as u64);
    }

    pub(crate) fn snapshot_built(&self, blocks: usize, events: usize) {
        self.snapshot_blocks.inc_by(blocks as u64);
        self.snapshot_events.inc_by(events as u64);
    }

    pub(crate) fn subscriber_dropped(&self, reason: &'static str) {
        self.subscribers_dropped
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    pub(crate) fn set_connected(&self, index: &str, up: bool) {
        let label = IndexLabel {
            index: index.to_owned(),
        };
        self.connected.get_or_create(&label).set(i64::from(up));
        if up {
            self.connects.get_or_create(&label).inc();
        }
    }

    pub(crate) fn stream_ended(&self, reason: &'static str) {
        self.stream_ends
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    pub(crate) fn refused_by_index(&self) {
        self.refused_by_index.inc();
    }
}
