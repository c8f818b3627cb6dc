//! Ingest metrics: one family per concept, labelled by replica id and DP rank from config plus
//! fixed enums (`reason`, `outcome`, `stage`), never by message content.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use super::{ReplicaKey, ResetReason};

/// A u64 gauge: sequence numbers use the whole u64 range, and an i64 gauge cannot show the top
/// half of it (it read `i64::MAX` for every sequence number from 2^63 on).
type SequenceGauge = Gauge<u64, AtomicU64>;

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReplicaLabels {
    replica_id: String,
    dp_rank: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    replica_id: String,
    dp_rank: u32,
    reason: &'static str,
}

/// An event field the index decodes and does not use (a fixed name from the decoder).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct FieldLabels {
    field: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabels {
    replica_id: String,
    dp_rank: u32,
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StageLabels {
    replica_id: String,
    dp_rank: u32,
    stage: &'static str,
}

/// How a replay request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ReplayOutcome {
    /// Every missing batch arrived and was applied.
    Ok,
    /// The engine's buffer no longer held the first missing batch, or it ended early.
    BufferExceeded,
    /// A replayed batch could not be decoded.
    Undecodable,
    /// No reply (or no end marker) before the deadline.
    Timeout,
    /// Connecting, sending or receiving failed, or a reply was malformed.
    Error,
}

impl ReplayOutcome {
    pub(crate) fn as_label(self) -> &'static str {
        match self {
            ReplayOutcome::Ok => "ok",
            ReplayOutcome::BufferExceeded => "buffer_exceeded",
            ReplayOutcome::Undecodable => "undecodable",
            ReplayOutcome::Timeout => "timeout",
            ReplayOutcome::Error => "error",
        }
    }
}

/// How catching up on the batches an engine published before the ingest joined its stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum CatchUpOutcome {
    /// The replay held every batch from 0: the replica's blocks are complete.
    Complete,
    /// The replay buffer began after 0 (older batches aged out): blocks stored before it stay
    /// unknown until they are stored again.
    Partial,
    /// The replay failed (see `replays` for why); the stream starts at the live message.
    Failed,
    /// No replay endpoint is configured; the stream starts at the live message.
    NoReplayEndpoint,
}

impl CatchUpOutcome {
    pub(crate) fn as_label(self) -> &'static str {
        match self {
            CatchUpOutcome::Complete => "complete",
            CatchUpOutcome::Partial => "partial",
            CatchUpOutcome::Failed => "failed",
            CatchUpOutcome::NoReplayEndpoint => "no_replay_endpoint",
        }
    }
}

/// Which socket operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum SocketStage {
    /// Connecting or binding the SUB socket.
    Open,
    /// Receiving on the SUB socket.
    Recv,
}

impl SocketStage {
    pub(crate) fn as_label(self) -> &'static str {
        match self {
            SocketStage::Open => "open",
            SocketStage::Recv => "recv",
        }
    }
}

/// Handles to the ingest metric families; cheap to clone, registered once.
#[derive(Debug, Clone)]
pub struct IngestMetrics {
    messages_received: Family<ReplicaLabels, Counter>,
    batches_applied: Family<ReplicaLabels, Counter>,
    decode_errors: Family<ReasonLabels, Counter>,
    duplicates_dropped: Family<ReplicaLabels, Counter>,
    unknown_events_skipped: Family<ReplicaLabels, Counter>,
    gaps: Family<ReplicaLabels, Counter>,
    replays: Family<OutcomeLabels, Counter>,
    catch_ups: Family<OutcomeLabels, Counter>,
    replay_duration: Family<ReplicaLabels, Histogram, fn() -> Histogram>,
    live_dropped_during_replay: Family<ReplicaLabels, Counter>,
    resets: Family<ReasonLabels, Counter>,
    last_sequence: Family<ReplicaLabels, SequenceGauge>,
    connected: Family<ReplicaLabels, Gauge>,
    socket_errors: Family<StageLabels, Counter>,
    refused: Family<ReasonLabels, Counter>,
    task_panics: Family<ReplicaLabels, Counter>,
    event_fields_ignored: Family<FieldLabels, Counter>,
}

fn replay_duration_histogram() -> Histogram {
    // 1 ms .. ~16 s: vLLM answers between publishing steps (up to ~100 ms), big buffers take longer.
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

impl IngestMetrics {
    /// Registers the families under `ingest_` in `registry` (the caller adds the service prefix).
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            messages_received: Family::default(),
            batches_applied: Family::default(),
            decode_errors: Family::default(),
            duplicates_dropped: Family::default(),
            unknown_events_skipped: Family::default(),
            gaps: Family::default(),
            replays: Family::default(),
            catch_ups: Family::default(),
            replay_duration: Family::new_with_constructor(replay_duration_histogram),
            live_dropped_during_replay: Family::default(),
            resets: Family::default(),
            last_sequence: Family::default(),
            connected: Family::default(),
            socket_errors: Family::default(),
            refused: Family::default(),
            task_panics: Family::default(),
            event_fields_ignored: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("ingest");
        r.register(
            "messages_received",
            "ZMQ messages received on the live SUB socket (before validation)",
            metrics.messages_received.clone(),
        );
        r.register(
            "batches_applied",
            "Event batches handed to the index, live or replayed",
            metrics.batches_applied.clone(),
        );
        r.register(
            "decode_errors",
            "Messages or replayed batches dropped as malformed, by wire error kind",
            metrics.decode_errors.clone(),
        );
        r.register(
            "duplicates_dropped",
            "Messages dropped because their sequence number and payload were already applied",
            metrics.duplicates_dropped.clone(),
        );
        r.register(
            "unknown_events_skipped",
            "Events skipped inside applied batches because their kind is unknown (newer vLLM)",
            metrics.unknown_events_skipped.clone(),
        );
        r.register(
            "event_fields_ignored",
            "Events of applied batches that carried a vLLM field the index decodes and does \
             not use (locality, ownership, session_id, lookahead_token_ids), by field",
            metrics.event_fields_ignored.clone(),
        );
        r.register(
            "gaps",
            "Sequence gaps detected on the live stream",
            metrics.gaps.clone(),
        );
        r.register(
            "replays",
            "Replay requests to the engine, by outcome",
            metrics.replays.clone(),
        );
        r.register(
            "catch_ups",
            "Catch-ups on batches an engine published before the ingest joined its stream, by outcome",
            metrics.catch_ups.clone(),
        );
        r.register_with_unit(
            "replay_duration",
            "Time from replay request to the last needed batch or failure",
            Unit::Seconds,
            metrics.replay_duration.clone(),
        );
        r.register(
            "live_dropped_during_replay",
            "Live messages dropped because the hold buffer was full during a replay",
            metrics.live_dropped_during_replay.clone(),
        );
        r.register(
            "resets",
            "Times a replica's indexed state was dropped, by reason",
            metrics.resets.clone(),
        );
        r.register(
            "last_sequence",
            "Sequence number of the last applied batch",
            metrics.last_sequence.clone(),
        );
        r.register(
            "connected",
            "1 while the SUB socket is connected (connect mode) or bound (bind mode)",
            metrics.connected.clone(),
        );
        r.register(
            "socket_errors",
            "SUB socket failures that led to re-creating the socket, by stage",
            metrics.socket_errors.clone(),
        );
        r.register(
            "refused",
            "Peers dropped and messages refused for what they sent or who they are (oversized, \
             malformed_frame, too_many_frames, handshake, socket_type, handshake_timeout, \
             peer_error, not_allowed, too_many_peers, topic_mismatch, dp_rank_mismatch)",
            metrics.refused.clone(),
        );
        r.register(
            "task_panics",
            "Ingest task panics (the task is restarted and the replica reset)",
            metrics.task_panics.clone(),
        );
        metrics
    }

    /// Metrics for a registry nobody reads (tests, tools).
    pub fn unregistered() -> Self {
        Self::register(&mut Registry::default())
    }

    /// Drops a stopped socket's per-replica series, so replicas that come and go (pods) do not
    /// grow the exposition forever. (Series labelled by reason or outcome as well stay: their
    /// label sets are few per replica and keep the history of why it was reset.)
    pub(crate) fn forget(&self, replica: &ReplicaKey) {
        let labels = replica_labels(replica);
        self.messages_received.remove(&labels);
        self.batches_applied.remove(&labels);
        self.duplicates_dropped.remove(&labels);
        self.unknown_events_skipped.remove(&labels);
        self.gaps.remove(&labels);
        self.replay_duration.remove(&labels);
        self.live_dropped_during_replay.remove(&labels);
        self.last_sequence.remove(&labels);
        self.connected.remove(&labels);
        self.task_panics.remove(&labels);
    }

    /// Pre-resolved per-replica handles for the hot path.
    pub(crate) fn for_replica(&self, replica: &ReplicaKey) -> ReplicaMetrics {
        let labels = replica_labels(replica);
        ReplicaMetrics {
            messages_received: self.messages_received.get_or_create(&labels).clone(),
            batches_applied: self.batches_applied.get_or_create(&labels).clone(),
            duplicates_dropped: self.duplicates_dropped.get_or_create(&labels).clone(),
            unknown_events_skipped: self.unknown_events_skipped.get_or_create(&labels).clone(),
            gaps: self.gaps.get_or_create(&labels).clone(),
            replay_duration: self.replay_duration.get_or_create(&labels).clone(),
            live_dropped_during_replay: self
                .live_dropped_during_replay
                .get_or_create(&labels)
                .clone(),
            last_sequence: self.last_sequence.get_or_create(&labels).clone(),
            connected: self.connected.get_or_create(&labels).clone(),
            families: self.clone(),
            replica: replica.clone(),
        }
    }

    pub(crate) fn reset(&self, replica: &ReplicaKey, reason: ResetReason) {
        self.resets
            .get_or_create(&reason_labels(replica, reason.as_label()))
            .inc();
    }

    /// Counts the unused fields a decoded batch carried.
    pub(crate) fn fields_ignored(&self, ignored: &kvroute_index_core::wire::IgnoredFields) {
        for (field, count) in ignored.counts() {
            if count > 0 {
                self.event_fields_ignored
                    .get_or_create(&FieldLabels { field })
                    .inc_by(u64::from(count));
            }
        }
    }

    pub(crate) fn task_panicked(&self, replica: &ReplicaKey) {
        self.task_panics
            .get_or_create(&replica_labels(replica))
            .inc();
    }
}

fn replica_labels(replica: &ReplicaKey) -> ReplicaLabels {
    ReplicaLabels {
        replica_id: replica.replica_id.to_string(),
        dp_rank: replica.dp_rank,
    }
}

fn reason_labels(replica: &ReplicaKey, reason: &'static str) -> ReasonLabels {
    ReasonLabels {
        replica_id: replica.replica_id.to_string(),
        dp_rank: replica.dp_rank,
        reason,
    }
}

/// One replica's metric handles; the rare paths go through the families.
#[derive(Debug, Clone)]
pub(crate) struct ReplicaMetrics {
    pub(crate) messages_received: Counter,
    pub(crate) batches_applied: Counter,
    pub(crate) duplicates_dropped: Counter,
    pub(crate) unknown_events_skipped: Counter,
    pub(crate) gaps: Counter,
    pub(crate) replay_duration: Histogram,
    pub(crate) live_dropped_during_replay: Counter,
    last_sequence: SequenceGauge,
    connected: Gauge,
    pub(crate) families: IngestMetrics,
    replica: ReplicaKey,
}

impl ReplicaMetrics {
    pub(crate) fn decode_error(&self, reason: &'static str) {
        self.families
            .decode_errors
            .get_or_create(&reason_labels(&self.replica, reason))
            .inc();
    }

    pub(crate) fn replay(&self, outcome: ReplayOutcome) {
        self.families
            .replays
            .get_or_create(&OutcomeLabels {
                replica_id: self.replica.replica_id.to_string(),
                dp_rank: self.replica.dp_rank,
                outcome: outcome.as_label(),
            })
            .inc();
    }

    pub(crate) fn catch_up(&self, outcome: CatchUpOutcome) {
        self.families
            .catch_ups
            .get_or_create(&OutcomeLabels {
                replica_id: self.replica.replica_id.to_string(),
                dp_rank: self.replica.dp_rank,
                outcome: outcome.as_label(),
            })
            .inc();
    }

    pub(crate) fn reset(&self, reason: ResetReason) {
        self.families.reset(&self.replica, reason);
    }

    pub(crate) fn socket_error(&self, stage: SocketStage) {
        self.families
            .socket_errors
            .get_or_create(&StageLabels {
                replica_id: self.replica.replica_id.to_string(),
                dp_rank: self.replica.dp_rank,
                stage: stage.as_label(),
            })
            .inc();
    }

    pub(crate) fn refused(&self, reason: &'static str) {
        self.families
            .refused
            .get_or_create(&reason_labels(&self.replica, reason))
            .inc();
    }

    pub(crate) fn set_last_sequence(&self, seq: u64) {
        self.last_sequence.set(seq);
    }

    pub(crate) fn set_connected(&self, connected: bool) {
        self.connected.set(i64::from(connected));
    }
}
