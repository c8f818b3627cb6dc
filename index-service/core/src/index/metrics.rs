//! Index metrics. The caller registers them into the registry it passes (normally a
//! sub-registry prefixed `index`, giving `index_events_applied_total` etc.); nothing global.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{FlagReason, RejectReason};
use crate::event::Medium;

/// Event kind label (`kind`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindLabel {
    pub(crate) kind: &'static str,
}

/// Medium label (`medium`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct MediumLabel {
    pub(crate) medium: &'static str,
}

/// Reject/flag reason label (`reason`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabel {
    pub(crate) reason: &'static str,
}

/// Replica label (`replica`): the replica id from config, never request data.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReplicaLabel {
    pub(crate) replica: String,
}

/// The index's metric families, plus pre-resolved handles for the hot fixed-label series so
/// applying an event does not hash label sets. Cheap to clone (handles share the series).
#[derive(Debug, Clone, Default)]
pub struct IndexMetrics {
    events_applied: Family<KindLabel, Counter>,
    blocks_stored: Family<MediumLabel, Counter>,
    blocks_removed: Family<MediumLabel, Counter>,
    blocks_rejected: Family<ReasonLabel, Counter>,
    replica_blocks: Family<ReplicaLabel, Gauge>,
    flagged_replicas: Family<ReasonLabel, Gauge>,
    replica_flags: Family<ReasonLabel, Counter>,
    handles: Handles,
}

/// Counters resolved once at registration, indexed by enum position.
#[derive(Debug, Clone, Default)]
struct Handles {
    events: [Counter; EventKind::ALL.len()],
    stored: [Counter; MEDIA.len()],
    removed: [Counter; MEDIA.len()],
    rejected: [Counter; RejectReason::ALL.len()],
}

const MEDIA: [Medium; 4] = [Medium::Gpu, Medium::Cpu, Medium::Storage, Medium::Other];

fn medium_index(medium: Medium) -> usize {
    MEDIA.iter().position(|&m| m == medium).unwrap_or(0)
}

/// Event kinds for `index_events_applied_total{kind}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventKind {
    BlockStored,
    BlockRemoved,
    AllBlocksCleared,
}

impl EventKind {
    const ALL: [EventKind; 3] = [
        EventKind::BlockStored,
        EventKind::BlockRemoved,
        EventKind::AllBlocksCleared,
    ];

    fn as_label(self) -> &'static str {
        match self {
            EventKind::BlockStored => "block_stored",
            EventKind::BlockRemoved => "block_removed",
            EventKind::AllBlocksCleared => "all_blocks_cleared",
        }
    }
}

impl IndexMetrics {
    /// Creates the families and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = IndexMetrics::unregistered();
        registry.register(
            "events_applied",
            "KV events applied to the index, by kind",
            metrics.events_applied.clone(),
        );
        registry.register(
            "blocks_stored",
            "Block holdings added to the index, by medium",
            metrics.blocks_stored.clone(),
        );
        registry.register(
            "blocks_removed",
            "Block holdings removed from the index by BlockRemoved, by medium",
            metrics.blocks_removed.clone(),
        );
        registry.register(
            "blocks_rejected",
            "Blocks of events the index did not apply, by reason",
            metrics.blocks_rejected.clone(),
        );
        registry.register(
            "replica_blocks",
            "Distinct blocks the index holds for a replica",
            metrics.replica_blocks.clone(),
        );
        registry.register(
            "flagged_replicas",
            "Replicas currently excluded from precise matching, by reason",
            metrics.flagged_replicas.clone(),
        );
        registry.register(
            "replica_flags",
            "Times a replica was flagged, by reason",
            metrics.replica_flags.clone(),
        );
        metrics
    }

    /// Metrics that are recorded but exported nowhere (tests, benches).
    pub fn unregistered() -> Self {
        let mut metrics = IndexMetrics::default();
        // Resolving every fixed-label series up front also makes them export as zeros.
        for (at, kind) in EventKind::ALL.into_iter().enumerate() {
            let label = KindLabel {
                kind: kind.as_label(),
            };
            metrics.handles.events[at] = metrics.events_applied.get_or_create(&label).clone();
        }
        for (at, medium) in MEDIA.into_iter().enumerate() {
            let label = MediumLabel {
                medium: medium.as_label(),
            };
            metrics.handles.stored[at] = metrics.blocks_stored.get_or_create(&label).clone();
            metrics.handles.removed[at] = metrics.blocks_removed.get_or_create(&label).clone();
        }
        for (at, reason) in RejectReason::ALL.into_iter().enumerate() {
            let label = ReasonLabel {
                reason: reason.as_label(),
            };
            metrics.handles.rejected[at] = metrics.blocks_rejected.get_or_create(&label).clone();
        }
        for reason in FlagReason::ALL {
            let label = ReasonLabel {
                reason: reason.as_label(),
            };
            let _ = metrics.flagged_replicas.get_or_create(&label);
            let _ = metrics.replica_flags.get_or_create(&label);
        }
        metrics
    }

    pub(crate) fn event(&self, kind: EventKind) {
        let at = EventKind::ALL.iter().position(|&k| k == kind).unwrap_or(0);
        self.handles.events[at].inc();
    }

    pub(crate) fn stored(&self, medium: Medium, blocks: u64) {
        self.handles.stored[medium_index(medium)].inc_by(blocks);
    }

    pub(crate) fn removed(&self, medium: Medium, blocks: u64) {
        self.handles.removed[medium_index(medium)].inc_by(blocks);
    }

    pub(crate) fn rejected(&self, reason: RejectReason, blocks: u64) {
        let at = RejectReason::ALL
            .iter()
            .position(|&r| r == reason)
            .unwrap_or(0);
        self.handles.rejected[at].inc_by(blocks);
    }

    /// The `replica_blocks` gauge of one replica (kept by the replica; set on every change).
    pub(crate) fn replica_blocks_gauge(&self, replica: &str) -> Gauge {
        self.replica_blocks
            .get_or_create(&ReplicaLabel {
                replica: replica.to_owned(),
            })
            .clone()
    }

    pub(crate) fn forget_replica(&self, replica: &str) {
        self.replica_blocks.remove(&ReplicaLabel {
            replica: replica.to_owned(),
        });
    }

    pub(crate) fn flag_changed(&self, old: Option<FlagReason>, new: Option<FlagReason>) {
        if old == new {
            return;
        }
        if let Some(old) = old {
            self.flagged_replicas
                .get_or_create(&ReasonLabel {
                    reason: old.as_label(),
                })
                .dec();
        }
        if let Some(new) = new {
            let label = ReasonLabel {
                reason: new.as_label(),
            };
            self.flagged_replicas.get_or_create(&label).inc();
            self.replica_flags.get_or_create(&label).inc();
        }
    }
}
