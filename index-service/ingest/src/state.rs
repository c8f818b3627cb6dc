//! Per-socket ingest state for the admin API: written by the task, read as a snapshot.

use std::time::SystemTime;

use parking_lot::Mutex;

use kvroute_config::SocketMode;

use super::{IngestConfig, ReplicaKey};

/// What an operator wants to know about one publisher socket.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaIngestSnapshot {
    /// Replica id and DP rank.
    pub replica: ReplicaKey,
    /// Configured endpoint.
    pub endpoint: String,
    /// Connect or bind.
    pub mode: SocketMode,
    /// The endpoint actually bound (port resolved) in bind mode, once bound.
    pub bound_endpoint: Option<String>,
    /// Whether the SUB socket is connected (connect mode) or bound (bind mode).
    pub connected: bool,
    /// Sequence number of the last applied batch.
    pub last_seq: Option<u64>,
    /// When the last batch was applied.
    pub last_applied_at: Option<SystemTime>,
    /// Messages received on the live socket.
    pub messages_received: u64,
    /// Batches applied (live and replayed).
    pub batches_applied: u64,
    /// Resets of this replica since start.
    pub resets: u64,
    /// The last error (socket, decode, replay), with when it happened.
    pub last_error: Option<(SystemTime, String)>,
}

/// Shared between the task (writer) and [`super::Ingest::snapshot`] (reader).
#[derive(Debug)]
pub(crate) struct ReplicaIngestState {
    inner: Mutex<ReplicaIngestSnapshot>,
}

impl ReplicaIngestState {
    pub(crate) fn new(config: &IngestConfig) -> Self {
        Self {
            inner: Mutex::new(ReplicaIngestSnapshot {
                replica: config.replica_key(),
                endpoint: config.endpoint.clone(),
                mode: config.mode,
                bound_endpoint: None,
                connected: false,
                last_seq: None,
                last_applied_at: None,
                messages_received: 0,
                batches_applied: 0,
                resets: 0,
                last_error: None,
            }),
        }
    }

    pub(crate) fn snapshot(&self) -> ReplicaIngestSnapshot {
        self.inner.lock().clone()
    }

    pub(crate) fn set_connected(&self, connected: bool) {
        self.inner.lock().connected = connected;
    }

    pub(crate) fn set_bound_endpoint(&self, endpoint: String) {
        self.inner.lock().bound_endpoint = Some(endpoint);
    }

    pub(crate) fn message_received(&self) {
        self.inner.lock().messages_received += 1;
    }

    pub(crate) fn batch_applied(&self, seq: u64) {
        let mut inner = self.inner.lock();
        inner.last_seq = Some(seq);
        inner.last_applied_at = Some(SystemTime::now());
        inner.batches_applied += 1;
    }

    pub(crate) fn replica_reset(&self) {
        let mut inner = self.inner.lock();
        inner.resets += 1;
        inner.last_seq = None;
    }

    pub(crate) fn record_error(&self, error: String) {
        self.inner.lock().last_error = Some((SystemTime::now(), error));
    }
}
