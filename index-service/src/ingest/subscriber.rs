//! The task for one publisher socket: receive, check the sequence, repair gaps, apply.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use super::backoff::Backoff;
use super::metrics::{CatchUpOutcome, ReplayOutcome, ReplicaMetrics, SocketStage};
use super::replay::{ReplayReply, ReplaySession};
use super::sequence::{SequenceTracker, Verdict, fingerprint};
use super::state::ReplicaIngestState;
use super::{EventSink, IngestConfig, IngestMetrics, ReplicaKey, ResetReason, SocketMode};
use crate::throttle::LogThrottle;
use crate::wire::{self, DecodedBatch, WireError};
use crate::zmtp::{Endpoint, SubEvent, SubSocket, ZmtpError};

/// `ingest_refused_total` reason of a live message whose topic the socket did not subscribe to.
const TOPIC_MISMATCH: &str = "topic_mismatch";

/// A decoded live message waiting to be applied.
#[derive(Debug)]
struct LiveMessage {
    seq: u64,
    fingerprint: u64,
    batch: DecodedBatch,
}

/// How a replay request went.
#[derive(Debug, Clone, Copy)]
struct ReplayResult {
    outcome: ReplayOutcome,
    /// The first replayed batch applied, if any.
    first_applied: Option<u64>,
}

impl From<ReplayOutcome> for ReplayResult {
    fn from(outcome: ReplayOutcome) -> Self {
        Self {
            outcome,
            first_applied: None,
        }
    }
}

/// What a replay request is for.
#[derive(Debug, Clone, Copy)]
enum ReplayGoal {
    /// Batches up to just before the live message `trigger_seq` are missing.
    FillGap { trigger_seq: u64 },
    /// Everything the engine still buffers, to its end marker (joining a running stream).
    CatchUp,
}

impl ReplayGoal {
    /// Whether a buffer that begins after the requested sequence is used from where it begins:
    /// only when catching up before anything was applied (nothing in between can be missing).
    fn accepts_late_start(self, tracker: &SequenceTracker) -> bool {
        matches!(self, ReplayGoal::CatchUp) && !tracker.has_started()
    }
}

/// Why the receive loop stopped.
#[derive(Debug)]
enum Stop {
    Cancelled,
    /// The socket failed (already logged and counted); re-create it after a backoff.
    SocketFailed,
}

/// State of the task for one publisher socket.
pub(crate) struct Subscriber {
    config: IngestConfig,
    replica: ReplicaKey,
    sink: Arc<dyn EventSink>,
    metrics: ReplicaMetrics,
    state: Arc<ReplicaIngestState>,
    cancel: CancellationToken,
    tracker: SequenceTracker,
    /// Decoded live messages not processed yet, in arrival order (held while a replay runs).
    pending: VecDeque<LiveMessage>,
    /// Highest sequence number applied from the last replay: live copies up to it are expected.
    replayed_through: Option<u64>,
    decode_warnings: LogThrottle,
}

impl Subscriber {
    pub(crate) fn new(
        config: IngestConfig,
        sink: Arc<dyn EventSink>,
        metrics: IngestMetrics,
        state: Arc<ReplicaIngestState>,
        cancel: CancellationToken,
    ) -> Self {
        let replica = config.replica_key();
        Self {
            metrics: metrics.for_replica(&replica),
            replica,
            config,
            sink,
            state,
            cancel,
            tracker: SequenceTracker::default(),
            pending: VecDeque::new(),
            replayed_through: None,
            decode_warnings: LogThrottle::default(),
        }
    }

    /// Runs until cancelled, re-creating the socket with backoff whenever it fails.
    pub(crate) async fn run(mut self) {
        let cancel = self.cancel.clone();
        let mut backoff = Backoff::new(
            self.config.reconnect_backoff_min,
            self.config.reconnect_backoff_max,
        );
        tracing::info!(
            replica_id = %self.replica.replica_id,
            dp_rank = self.replica.dp_rank,
            endpoint = %self.config.endpoint,
            mode = self.config.mode.as_label(),
            replay_endpoint = self.config.replay_endpoint.as_deref().unwrap_or(""),
            "ingest task started"
        );
        let exit_reason = loop {
            let opened = tokio::select! {
                biased;
                () = cancel.cancelled() => break "cancelled",
                opened = self.open() => opened,
            };
            let stop = match opened {
                Ok(mut socket) => {
                    let stop = self.pump(&mut socket, &mut backoff).await;
                    self.set_connected(false);
                    stop
                }
                Err(error) => {
                    self.socket_failed(SocketStage::Open, &error);
                    Stop::SocketFailed
                }
            };
            match stop {
                Stop::Cancelled => break "cancelled",
                Stop::SocketFailed => {
                    let delay = backoff.next_delay();
                    tokio::select! {
                        biased;
                        () = cancel.cancelled() => break "cancelled",
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        };
        let snapshot = self.state.snapshot();
        tracing::info!(
            replica_id = %self.replica.replica_id,
            dp_rank = self.replica.dp_rank,
            exit_reason,
            messages_received = snapshot.messages_received,
            batches_applied = snapshot.batches_applied,
            resets = snapshot.resets,
            last_seq = ?snapshot.last_seq,
            "ingest task stopped"
        );
    }

    /// Connects (and subscribes) or binds the SUB socket.
    async fn open(&self) -> Result<SubSocket, ZmtpError> {
        let topic = &self.config.topic_filter;
        let limits = self.config.limits();
        let socket = match self.config.mode {
            SocketMode::Connect => {
                let endpoint = Endpoint::parse(&self.config.endpoint)?;
                SubSocket::connect(&endpoint, topic, limits).await?
            }
            SocketMode::Bind => {
                // After a re-create, bind the port resolved the first time (engines know it).
                let endpoint = self
                    .state
                    .snapshot()
                    .bound_endpoint
                    .unwrap_or_else(|| self.config.endpoint.clone());
                let endpoint = Endpoint::parse(&endpoint)?;
                let (socket, bound) =
                    SubSocket::bind(&endpoint, topic, limits, self.config.allowed_peers.clone())
                        .await?;
                self.state.set_bound_endpoint(bound);
                socket
            }
        };
        tracing::info!(
            replica_id = %self.replica.replica_id,
            dp_rank = self.replica.dp_rank,
            endpoint = %self.config.endpoint,
            mode = self.config.mode.as_label(),
            "kv event socket open"
        );
        self.set_connected(true);
        Ok(socket)
    }

    /// Receives until cancelled or the socket fails.
    async fn pump(&mut self, socket: &mut SubSocket, backoff: &mut Backoff) -> Stop {
        let cancel = self.cancel.clone();
        if self.tracker.is_fresh() && self.config.replay_endpoint.is_some() {
            let caught_up = match self.catch_up(None, socket).await {
                Ok(()) => self.drain_pending(socket).await,
                Err(stop) => Err(stop),
            };
            if let Err(stop) = caught_up {
                return stop;
            }
        }
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => return Stop::Cancelled,
                received = socket.recv() => match received {
                    Ok(SubEvent::Message(message)) => {
                        backoff.reset();
                        if let Some(live) = self.decode_live(message) {
                            self.pending.push_back(live);
                        }
                        if let Err(stop) = self.drain_pending(socket).await {
                            return stop;
                        }
                    }
                    Ok(event) => self.peer_event(event),
                    Err(error) => {
                        self.socket_failed(SocketStage::Recv, &error);
                        return Stop::SocketFailed;
                    }
                },
            }
        }
    }

    /// A bound socket's peer came or went; a refused one is counted and logged (rate-limited).
    fn peer_event(&mut self, event: SubEvent) {
        match event {
            SubEvent::Message(_) => {}
            SubEvent::PeerConnected { peer } => tracing::info!(
                replica_id = %self.replica.replica_id,
                dp_rank = self.replica.dp_rank,
                peer,
                "kv event publisher connected"
            ),
            SubEvent::PeerDropped { peer, error } => {
                if !error.is_refusal() {
                    tracing::info!(
                        replica_id = %self.replica.replica_id,
                        dp_rank = self.replica.dp_rank,
                        peer,
                        reason = error.as_label(),
                        "kv event publisher disconnected"
                    );
                    return;
                }
                self.refused(&error, &peer);
            }
        }
    }

    /// Counts and logs (rate-limited) a peer dropped for what it sent or who it is.
    fn refused(&mut self, error: &ZmtpError, peer: &str) {
        self.metrics.refused(error.as_label());
        self.state
            .record_error(format!("peer {peer} refused: {error}"));
        if let Some(suppressed) = self.decode_warnings.allow() {
            tracing::warn!(
                replica_id = %self.replica.replica_id,
                dp_rank = self.replica.dp_rank,
                peer,
                reason = error.as_label(),
                error = %error_chain(error),
                suppressed,
                "kv event peer refused and dropped"
            );
        }
    }

    /// Processes held messages in order; a gap inside may hold more.
    async fn drain_pending(&mut self, socket: &mut SubSocket) -> Result<(), Stop> {
        while let Some(live) = self.pending.pop_front() {
            self.process(live, socket).await?;
        }
        self.replayed_through = None;
        Ok(())
    }

    async fn process(&mut self, live: LiveMessage, socket: &mut SubSocket) -> Result<(), Stop> {
        let mut verdict = self.tracker.classify(live.seq, live.fingerprint);
        if verdict == Verdict::Restart {
            tracing::info!(
                replica_id = %self.replica.replica_id,
                dp_rank = self.replica.dp_rank,
                seq = live.seq,
                last_seq = ?self.tracker.last_applied(),
                "sequence went backwards: engine restarted"
            );
            self.reset(ResetReason::EngineRestart);
            self.tracker.restart();
            // The new stream starts at 0: anything later means its head is missing (a gap).
            verdict = self.tracker.classify(live.seq, live.fingerprint);
        }
        match verdict {
            // `Restart` cannot come twice: after `restart()` every sequence is >= the expected 0.
            Verdict::First | Verdict::Next | Verdict::Restart => {
                self.apply(live.seq, live.fingerprint, live.batch);
            }
            Verdict::Duplicate => {
                let covered_by_replay = self.replayed_through.is_some_and(|t| live.seq <= t);
                if !covered_by_replay {
                    self.metrics.duplicates_dropped.inc();
                    tracing::debug!(
                        replica_id = %self.replica.replica_id,
                        dp_rank = self.replica.dp_rank,
                        seq = live.seq,
                        "duplicate message dropped"
                    );
                }
            }
            Verdict::Gap { missing_from } => self.repair_gap(missing_from, live, socket).await?,
            Verdict::Joined => self.catch_up(Some(live), socket).await?,
        }
        Ok(())
    }

    /// Catches up on the batches the engine published before this task joined its stream (the
    /// index or agent started or restarted after the engine): replays from 0 to the end of the
    /// engine's buffer, so the blocks stored before the join are indexed too.
    ///
    /// Proactive (`trigger` `None`): when the socket opens, before any live message — an idle
    /// engine's blocks are known at once. Reactive (`trigger` the first live message, which
    /// showed earlier batches exist): when the proactive one could not run or failed; at most
    /// once, so a failing replay cannot repeat.
    async fn catch_up(
        &mut self,
        trigger: Option<LiveMessage>,
        socket: &mut SubSocket,
    ) -> Result<(), Stop> {
        let trigger_seq = trigger.as_ref().map(|live| live.seq);
        if let Some(live) = trigger {
            self.tracker.caught_up();
            // Processed right after the replay: a duplicate of a replayed batch, or the start.
            self.pending.push_front(live);
        }
        let Some(endpoint) = self.config.replay_endpoint.clone() else {
            tracing::info!(
                replica_id = %self.replica.replica_id,
                dp_rank = self.replica.dp_rank,
                seq = ?trigger_seq,
                "joined the engine's stream late and no replay endpoint is configured: blocks \
                 stored before it stay unknown until stored again"
            );
            self.metrics.catch_up(CatchUpOutcome::NoReplayEndpoint);
            return Ok(());
        };
        let started = Instant::now();
        let result = self
            .replay(&endpoint, 0, ReplayGoal::CatchUp, socket)
            .await?;
        let outcome = match (result.outcome, result.first_applied) {
            (ReplayOutcome::Ok, Some(0)) => CatchUpOutcome::Complete,
            (ReplayOutcome::Ok, Some(_)) => CatchUpOutcome::Partial,
            (ReplayOutcome::Ok, None) => {
                // An empty buffer: the engine has published nothing yet, so its stream starts
                // at 0 and a later first message means the head was missed (a gap to repair).
                if trigger_seq.is_none() {
                    self.tracker.restart();
                }
                CatchUpOutcome::Complete
            }
            _ => CatchUpOutcome::Failed,
        };
        self.metrics.catch_up(outcome);
        tracing::info!(
            replica_id = %self.replica.replica_id,
            dp_rank = self.replica.dp_rank,
            seq = ?trigger_seq,
            outcome = outcome.as_label(),
            replay = result.outcome.as_label(),
            first_replayed = ?result.first_applied,
            last_applied = ?self.tracker.last_applied(),
            elapsed_ms = started.elapsed().as_millis(),
            "caught up on the batches published before joining the engine's stream"
        );
        Ok(())
    }

    /// Fetches `missing_from..trigger.seq` from the engine's replay buffer, or resets the replica.
    async fn repair_gap(
        &mut self,
        missing_from: u64,
        trigger: LiveMessage,
        socket: &mut SubSocket,
    ) -> Result<(), Stop> {
        self.metrics.gaps.inc();
        let trigger_seq = trigger.seq;
        tracing::warn!(
            replica_id = %self.replica.replica_id,
            dp_rank = self.replica.dp_rank,
            missing_from,
            seq = trigger_seq,
            missing = trigger_seq - missing_from,
            "sequence gap on the live stream"
        );
        // Processed right after the replay, ahead of whatever arrives meanwhile.
        self.pending.push_front(trigger);
        let Some(endpoint) = self.config.replay_endpoint.clone() else {
            self.give_up(
                ResetReason::GapUnrecoverable,
                "gap and no replay endpoint configured",
            );
            return Ok(());
        };
        let started = Instant::now();
        let outcome = self
            .replay(
                &endpoint,
                missing_from,
                ReplayGoal::FillGap { trigger_seq },
                socket,
            )
            .await?
            .outcome;
        self.metrics
            .replay_duration
            .observe(started.elapsed().as_secs_f64());
        self.metrics.replay(outcome);
        match outcome {
            ReplayOutcome::Ok => tracing::info!(
                replica_id = %self.replica.replica_id,
                dp_rank = self.replica.dp_rank,
                missing_from,
                seq = trigger_seq,
                elapsed_ms = started.elapsed().as_millis(),
                "gap repaired by replay"
            ),
            ReplayOutcome::BufferExceeded => self.give_up(
                ResetReason::GapUnrecoverable,
                "replay buffer no longer holds the missing batches",
            ),
            ReplayOutcome::Undecodable => {
                self.give_up(
                    ResetReason::GapUnrecoverable,
                    "a missing batch cannot be decoded",
                );
            }
            ReplayOutcome::Timeout => {
                self.give_up(ResetReason::ReplayFailed, "replay timed out");
            }
            ReplayOutcome::Error => {
                self.give_up(ResetReason::ReplayFailed, "replay request failed")
            }
        }
        Ok(())
    }

    /// Runs one replay request, applying replayed batches in order and holding live messages.
    async fn replay(
        &mut self,
        endpoint: &str,
        missing_from: u64,
        goal: ReplayGoal,
        socket: &mut SubSocket,
    ) -> Result<ReplayResult, Stop> {
        let mut first_applied = None;
        let cancel = self.cancel.clone();
        let deadline = tokio::time::Instant::now() + self.config.replay_timeout;
        let opened = tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(Stop::Cancelled),
            () = tokio::time::sleep_until(deadline) => return Ok(ReplayOutcome::Timeout.into()),
            opened = ReplaySession::open(endpoint, missing_from, self.config.limits()) => opened,
        };
        let mut session = match opened {
            Ok(session) => session,
            Err(error) => {
                self.replay_error(&error);
                return Ok(ReplayOutcome::Error.into());
            }
        };
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => return Err(Stop::Cancelled),
                () = tokio::time::sleep_until(deadline) => return Ok(ReplayOutcome::Timeout.into()),
                received = socket.recv() => match received {
                    Ok(SubEvent::Message(message)) => self.hold(message),
                    Ok(event) => self.peer_event(event),
                    Err(error) => {
                        self.socket_failed(SocketStage::Recv, &error);
                        return Err(Stop::SocketFailed);
                    }
                },
                reply = session.next() => {
                    let expected = self.tracker.expected().unwrap_or(missing_from);
                    match reply {
                        Err(error) => {
                            self.replay_error(&error);
                            return Ok(ReplayOutcome::Error.into());
                        }
                        Ok(ReplayReply::End) => {
                            let outcome = match goal {
                                ReplayGoal::CatchUp => ReplayOutcome::Ok,
                                // The buffer ended before reaching the live stream.
                                ReplayGoal::FillGap { .. } => ReplayOutcome::BufferExceeded,
                            };
                            return Ok(ReplayResult { outcome, first_applied });
                        }
                        // Already applied (after u64::MAX every batch is).
                        Ok(ReplayReply::Batch { seq, .. })
                            if seq < expected || self.tracker.is_past_max() => {}
                        Ok(ReplayReply::Batch { seq, .. })
                            if seq > expected && !goal.accepts_late_start(&self.tracker) =>
                        {
                            // vLLM silently starts from its oldest entry when asked for older ones.
                            tracing::warn!(
                                replica_id = %self.replica.replica_id,
                                dp_rank = self.replica.dp_rank,
                                expected,
                                first_replayed = seq,
                                "replay does not start at the first missing batch"
                            );
                            return Ok(ReplayResult { outcome: ReplayOutcome::BufferExceeded, first_applied });
                        }
                        Ok(ReplayReply::Batch { seq, payload }) => {
                            let batch = match wire::decode_batch(&payload) {
                                Ok(batch) => batch,
                                Err(error) => {
                                    self.decode_failed(&error, "replay");
                                    return Ok(ReplayResult { outcome: ReplayOutcome::Undecodable, first_applied });
                                }
                            };
                            self.apply(seq, fingerprint(&payload), batch);
                            self.replayed_through = Some(seq);
                            first_applied.get_or_insert(seq);
                            // Caught up with the live stream; the rest arrives (or arrived) live.
                            if let ReplayGoal::FillGap { trigger_seq } = goal
                                && seq.saturating_add(1) >= trigger_seq
                            {
                                return Ok(ReplayResult { outcome: ReplayOutcome::Ok, first_applied });
                            }
                        }
                    }
                }
            }
        }
    }

    /// Holds a live message that arrived during a replay (bounded).
    fn hold(&mut self, message: Vec<Bytes>) {
        let Some(live) = self.decode_live(message) else {
            return;
        };
        if self.pending.len() >= self.config.buffered_live_limit {
            // Dropped here, it shows up as a new gap once the replay is done.
            self.metrics.live_dropped_during_replay.inc();
            return;
        }
        self.pending.push_back(live);
    }

    /// Validates and decodes a live message; malformed ones, and ones whose topic this socket
    /// did not subscribe to (a PUB filters by topic, a rogue one may not), are counted and dropped.
    fn decode_live(&mut self, frames: Vec<Bytes>) -> Option<LiveMessage> {
        self.metrics.messages_received.inc();
        self.state.message_received();
        match wire::decode_message(&frames) {
            Ok((topic, _, _)) if !topic.starts_with(self.config.topic_filter.as_str()) => {
                self.metrics.refused(TOPIC_MISMATCH);
                self.state
                    .record_error("live message with a topic this replica does not publish".into());
                if let Some(suppressed) = self.decode_warnings.allow() {
                    tracing::warn!(
                        replica_id = %self.replica.replica_id,
                        dp_rank = self.replica.dp_rank,
                        topic_filter = %self.config.topic_filter,
                        suppressed,
                        "dropping kv event message with a foreign topic"
                    );
                }
                None
            }
            Ok((_topic, seq, batch)) => Some(LiveMessage {
                seq,
                fingerprint: frames.last().map_or(0, |payload| fingerprint(payload)),
                batch,
            }),
            Err(error) => {
                self.decode_failed(&error, "live");
                None
            }
        }
    }

    fn apply(&mut self, seq: u64, fingerprint: u64, decoded: DecodedBatch) {
        if decoded.unknown_events > 0 {
            self.metrics
                .unknown_events_skipped
                .inc_by(u64::from(decoded.unknown_events));
        }
        // Bookkeeping first, so whoever sees the batch in the sink also sees it in the snapshot.
        self.tracker.applied(seq, fingerprint);
        self.metrics.batches_applied.inc();
        self.metrics.set_last_sequence(seq);
        self.state.batch_applied(seq);
        self.sink.apply(&self.replica, seq, decoded.batch);
    }

    fn reset(&mut self, reason: ResetReason) {
        self.metrics.reset(reason);
        self.state.replica_reset();
        self.sink.reset(&self.replica, reason);
    }

    /// Resets the replica after an unrecoverable gap; the next message starts the stream again.
    fn give_up(&mut self, reason: ResetReason, detail: &'static str) {
        tracing::warn!(
            replica_id = %self.replica.replica_id,
            dp_rank = self.replica.dp_rank,
            reason = reason.as_label(),
            detail,
            "resetting replica: its indexed blocks can no longer be trusted"
        );
        self.state.record_error(detail.to_owned());
        self.reset(reason);
        self.tracker.resync();
    }

    fn decode_failed(&mut self, error: &WireError, source: &'static str) {
        self.metrics.decode_error(error.as_label());
        self.state
            .record_error(format!("{source} message: {error}"));
        if let Some(suppressed) = self.decode_warnings.allow() {
            tracing::warn!(
                replica_id = %self.replica.replica_id,
                dp_rank = self.replica.dp_rank,
                source,
                reason = error.as_label(),
                %error,
                suppressed,
                "dropping malformed kv event message"
            );
        }
    }

    fn replay_error(&mut self, error: &super::replay::ReplayError) {
        if let Some(refusal) = error.refusal() {
            self.refused(refusal, "replay");
        }
        self.state
            .record_error(format!("replay: {}", error_chain(error)));
        tracing::warn!(
            replica_id = %self.replica.replica_id,
            dp_rank = self.replica.dp_rank,
            stage = error.as_label(),
            error = %error_chain(error),
            "replay request failed"
        );
    }

    fn socket_failed(&mut self, stage: SocketStage, error: &ZmtpError) {
        if error.is_refusal() {
            self.refused(error, &self.config.endpoint.clone());
        }
        self.metrics.socket_error(stage);
        self.state
            .record_error(format!("{} failed: {error}", stage.as_label()));
        tracing::warn!(
            replica_id = %self.replica.replica_id,
            dp_rank = self.replica.dp_rank,
            endpoint = %self.config.endpoint,
            stage = stage.as_label(),
            error = %error_chain(error),
            "kv event socket failed; re-creating it after a backoff"
        );
    }

    fn set_connected(&self, connected: bool) {
        self.state.set_connected(connected);
        self.metrics.set_connected(connected);
    }
}

/// `error: cause: cause` for logs.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
