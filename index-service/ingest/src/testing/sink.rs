//! [`RecordingSink`]: an [`EventSink`] that records every call (tests poll it for conditions).

use parking_lot::Mutex;

use crate::{EventSink, ReplicaKey, ResetReason};
use kvroute_index_core::event::EventBatch;

/// One call an ingest made.
#[derive(Debug, Clone, PartialEq)]
pub enum SinkCall {
    /// `EventSink::apply`.
    Apply {
        /// Which publisher.
        replica: ReplicaKey,
        /// Sequence number.
        seq: u64,
        /// The batch.
        batch: EventBatch,
    },
    /// `EventSink::reset`.
    Reset {
        /// Which publisher.
        replica: ReplicaKey,
        /// Why.
        reason: ResetReason,
    },
}

/// Records calls in order.
#[derive(Debug, Default)]
pub struct RecordingSink {
    calls: Mutex<Vec<SinkCall>>,
}

impl RecordingSink {
    /// Every call so far.
    pub fn calls(&self) -> Vec<SinkCall> {
        self.calls.lock().clone()
    }

    /// Sequence numbers applied, in order.
    pub fn applied_seqs(&self) -> Vec<u64> {
        applied_seqs(&self.calls.lock())
    }

    /// Reset reasons, in order.
    pub fn resets(&self) -> Vec<ResetReason> {
        self.calls
            .lock()
            .iter()
            .filter_map(|call| match call {
                SinkCall::Reset { reason, .. } => Some(*reason),
                SinkCall::Apply { .. } => None,
            })
            .collect()
    }

    /// Forgets the calls recorded so far.
    pub fn clear(&self) {
        self.calls.lock().clear();
    }

    fn record(&self, call: SinkCall) {
        self.calls.lock().push(call);
    }
}

/// Sequence numbers of the `Apply` calls in `calls`.
pub fn applied_seqs(calls: &[SinkCall]) -> Vec<u64> {
    calls
        .iter()
        .filter_map(|call| match call {
            SinkCall::Apply { seq, .. } => Some(*seq),
            SinkCall::Reset { .. } => None,
        })
        .collect()
}

impl EventSink for RecordingSink {
    fn apply(&self, replica: &ReplicaKey, seq: u64, batch: EventBatch) {
        self.record(SinkCall::Apply {
            replica: replica.clone(),
            seq,
            batch,
        });
    }

    fn reset(&self, replica: &ReplicaKey, reason: ResetReason) {
        self.record(SinkCall::Reset {
            replica: replica.clone(),
            reason,
        });
    }
}
