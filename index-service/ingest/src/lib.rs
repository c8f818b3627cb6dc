//! ZeroMQ ingest of vLLM KV-cache events: one task per engine publisher socket.
//!
//! Each [`IngestConfig`] names one vLLM publisher (a replica, or one data-parallel rank of it).
//! [`Ingest::spawn`] starts a task that subscribes to it, checks the 8-byte sequence frame of every
//! message, and hands decoded batches to an [`EventSink`] strictly in sequence order:
//!
//! - **Joining**: when the socket opens, the task first catches up on what the engine published
//!   before it joined (the index or agent started after the engine): it asks the replay ROUTER
//!   for everything from sequence 0 and applies it, holding live messages meanwhile, so an idle
//!   engine's blocks are known at once. If the engine's buffer no longer reaches back to 0 the
//!   catch-up is partial (older blocks stay unknown until re-stored); if it fails (engine not up
//!   yet), the first live message with a sequence number above 0 triggers it once more. Counted
//!   in `ingest_catch_ups_total{outcome}`. Without a replay endpoint the first message starts the
//!   stream, whatever its sequence number.
//! - **Reconnecting** (the socket re-opened, or a bound socket's publisher came back): the task
//!   asks the replay buffer from the last batch applied. The same engine answers with that batch
//!   (same payload fingerprint) and what followed; anything else — an empty buffer, another
//!   first batch — is a restarted engine, even an idle one: [`ResetReason::EngineRestart`], then
//!   a catch-up from 0. The sink hears [`FeedState`]s: `Syncing` until the check (or a live batch
//!   in sequence) is done, `Ready`, `Disconnected` when the socket or its last peer goes.
//! - **Undecodable stream**: several live messages in a row that fail
//!   to decode flag the replica `unknown_encoding` (cleared by the next one that decodes).
//! - **`seq == last + 1`**: applied.
//! - **`seq <= last`**: a message we already applied (same sequence number *and* same payload,
//!   within the last [`DUPLICATE_WINDOW`] messages) is dropped and counted. Anything else means
//!   the engine restarted (its counter starts again at 0): [`ResetReason::EngineRestart`], then
//!   the message starts the new stream (and if it is not 0, the missing head is replayed).
//! - **`seq > last + 1`**: a gap. The missing batches are requested over a DEALER from the
//!   engine's replay ROUTER, applied in order, and live messages that arrive meanwhile are held
//!   (bounded) and applied after. If there is no replay endpoint, the replay times out, or the
//!   engine's buffer no longer holds the first missing batch, the replica is reset
//!   ([`ResetReason::GapUnrecoverable`] / [`ResetReason::ReplayFailed`]) and the stream continues
//!   from the live message: the index never keeps serving a silently diverged replica.
//! - **After `u64::MAX`** no message can be `last + 1`: a repeat of the last payloads is a
//!   duplicate, anything else a restart (so a peer sending `MAX` over and over resets the replica
//!   each time instead of piling batches onto it). `ingest_last_sequence` is a u64 gauge and
//!   shows every sequence number exactly.
//!
//! A message that fails to decode is counted by [`WireError::as_label`](kvroute_index_core::wire::WireError::as_label)
//! and skipped without touching the sequence state; if it was a real batch, the next good message
//! shows a gap and the replay path decides. Socket errors re-create the socket with capped
//! exponential backoff; a panic inside the task is caught, counted, the replica reset, and the
//! task restarted.
//!
//! Known blind spot: restart detection relies on the counter going backwards. If an engine
//! restarts and we miss exactly enough of its new messages that the first one we see is beyond
//! the old stream's last sequence number, that looks like a gap, not a restart. Real engines
//! publish thousands of batches, so this needs a very young old engine.
//!
//! Lifecycle: `Ingest::new(sink, metrics, cancel)` → `spawn(config)` per socket →
//! [`Ingest::snapshot`] for the admin API → cancel the token and `shutdown().await`.

mod backoff;
mod config;
mod metrics;
mod replay;
mod sequence;
mod state;
mod subscriber;

#[cfg(test)]
mod tests;

#[cfg(any(test, feature = "test-util"))]
pub mod testing;
pub mod zmtp;

use std::sync::Arc;

use futures::FutureExt as _;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use kvroute_index_core::event::EventBatch;
use kvroute_index_core::index::{FeedState, FlagReason};

#[cfg(any(test, feature = "test-util"))]
pub(crate) use config::wildcard_to_unspecified;
pub use config::{
    DEFAULT_BUFFERED_LIVE_LIMIT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_RECONNECT_BACKOFF_MAX,
    DEFAULT_RECONNECT_BACKOFF_MIN, DEFAULT_REPLAY_TIMEOUT, IngestConfig,
};
pub use metrics::IngestMetrics;
pub use sequence::DUPLICATE_WINDOW;
pub use state::ReplicaIngestSnapshot;

use state::ReplicaIngestState;

/// Which publisher a batch came from: the replica id from config and the engine's DP rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaKey {
    /// Replica id as configured (also the metric label).
    pub replica_id: Arc<str>,
    /// Global data-parallel rank of the engine core behind the socket (0 without DP).
    pub dp_rank: u32,
}

impl std::fmt::Display for ReplicaKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/dp{}", self.replica_id, self.dp_rank)
    }
}

/// Why the ingest told the sink to forget everything it holds for a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResetReason {
    /// The sequence number went backwards: the engine restarted and its cache is empty.
    EngineRestart,
    /// Missing batches cannot be recovered: no replay endpoint, the engine's replay buffer no
    /// longer holds them, or a batch in the gap cannot be decoded.
    GapUnrecoverable,
    /// The replay request failed (connect error, timeout, malformed reply).
    ReplayFailed,
    /// The ingest task panicked mid-batch and was restarted; what was applied is unknown.
    TaskRestarted,
}

impl ResetReason {
    /// Metric label value.
    pub fn as_label(self) -> &'static str {
        match self {
            ResetReason::EngineRestart => "engine_restart",
            ResetReason::GapUnrecoverable => "gap_unrecoverable",
            ResetReason::ReplayFailed => "replay_failed",
            ResetReason::TaskRestarted => "task_restarted",
        }
    }
}

/// Where ingested batches go (the index, or an agent's outbound stream).
///
/// Calls for one replica come from one task, in sequence order; implementations must not block
/// for long (they run on the ingest task).
pub trait EventSink: Send + Sync + 'static {
    /// Applies one engine batch with its sequence number.
    fn apply(&self, replica: &ReplicaKey, seq: u64, batch: EventBatch);
    /// Drops everything held for `replica`: later batches start from an empty cache.
    fn reset(&self, replica: &ReplicaKey, reason: ResetReason);
    /// How the socket stands: connected, caught up, lost. Only a [`FeedState::Ready`] socket's
    /// replica is precise. (Default: ignored, for sinks that do not answer matches.)
    fn feed_state(&self, _replica: &ReplicaKey, _state: FeedState) {}
    /// The stream is (`unusable`) or is no longer unusable for `reason` (e.g. its messages
    /// cannot be decoded). (Default: ignored.)
    fn stream_unusable(&self, _replica: &ReplicaKey, _reason: FlagReason, _unusable: bool) {}
}

/// Owns the ingest tasks: spawns one per publisher socket and stops them on cancellation.
pub struct Ingest {
    sink: Arc<dyn EventSink>,
    metrics: IngestMetrics,
    cancel: CancellationToken,
    tasks: TaskTracker,
    replicas: Mutex<Vec<Socket>>,
}

/// One running socket task: its state for the admin API and how to stop it alone.
struct Socket {
    key: ReplicaKey,
    state: Arc<ReplicaIngestState>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Ingest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingest")
            .field("tasks", &self.tasks)
            .field("replicas", &self.replicas.lock().len())
            .finish_non_exhaustive()
    }
}

impl Ingest {
    /// Creates an ingest that feeds `sink`; tasks stop when `cancel` is cancelled.
    pub fn new(
        sink: Arc<dyn EventSink>,
        metrics: IngestMetrics,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            sink,
            metrics,
            cancel,
            tasks: TaskTracker::new(),
            replicas: Mutex::new(Vec::new()),
        }
    }

    /// Starts the task for one publisher socket (tracked by `self.tasks`, stopped by `self.cancel`
    /// or [`Ingest::stop`]).
    pub fn spawn(&self, config: IngestConfig) {
        let state = Arc::new(ReplicaIngestState::new(&config));
        let stop = self.cancel.child_token();
        let key = config.replica_key();
        let task = supervise(
            config,
            Arc::clone(&self.sink),
            self.metrics.clone(),
            Arc::clone(&state),
            stop.clone(),
        );
        let task = self.tasks.spawn(task);
        self.replicas.lock().push(Socket {
            key,
            state,
            stop,
            task,
        });
    }

    /// Stops every socket task of `replica_id` (all its data-parallel ranks) and waits until they
    /// have closed their sockets, so nothing they received reaches the sink afterwards (a replica
    /// of the same name may be added again at once). Forgets their metric series. Returns how
    /// many were stopped.
    pub async fn stop(&self, replica_id: &str) -> usize {
        let stopped: Vec<Socket> = {
            let mut replicas = self.replicas.lock();
            let (stopped, kept) = std::mem::take(&mut *replicas)
                .into_iter()
                .partition(|socket| &*socket.key.replica_id == replica_id);
            *replicas = kept;
            stopped
        };
        for socket in &stopped {
            socket.stop.cancel();
        }
        let count = stopped.len();
        for socket in stopped {
            // The task only ends by cancellation or a panic already caught by `supervise`.
            let _ = socket.task.await;
            self.metrics.forget(&socket.key);
        }
        count
    }

    /// Per-socket ingest state, cheap enough for every admin request.
    pub fn snapshot(&self) -> Vec<ReplicaIngestSnapshot> {
        self.replicas
            .lock()
            .iter()
            .map(|socket| socket.state.snapshot())
            .collect()
    }

    /// Cancels every task and waits until they have closed their sockets.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// Runs the subscriber loop, restarting it (after a reset and a backoff) if it panics.
async fn supervise(
    config: IngestConfig,
    sink: Arc<dyn EventSink>,
    metrics: IngestMetrics,
    state: Arc<ReplicaIngestState>,
    cancel: CancellationToken,
) {
    let replica = config.replica_key();
    let mut backoff =
        backoff::Backoff::new(config.reconnect_backoff_min, config.reconnect_backoff_max);
    loop {
        let run = subscriber::Subscriber::new(
            config.clone(),
            Arc::clone(&sink),
            metrics.clone(),
            Arc::clone(&state),
            cancel.clone(),
        )
        .run();
        match std::panic::AssertUnwindSafe(run).catch_unwind().await {
            Ok(()) => break,
            Err(panic) => {
                let message = panic_message(panic.as_ref());
                metrics.task_panicked(&replica);
                state.record_error(format!("ingest task panicked: {message}"));
                tracing::error!(
                    replica_id = %replica.replica_id,
                    dp_rank = replica.dp_rank,
                    panic = %message,
                    "ingest task panicked; resetting the replica and restarting"
                );
                // Whatever the panicking batch half-did is unknown: start the replica over.
                let reset = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    sink.reset(&replica, ResetReason::TaskRestarted)
                }));
                if reset.is_ok() {
                    metrics.reset(&replica, ResetReason::TaskRestarted);
                    state.replica_reset();
                }
                let delay = backoff.next_delay();
                tokio::select! {
                    biased;
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
    state.set_connected(false);
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
