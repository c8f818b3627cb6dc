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
use super::{
    EventSink, FeedState, FlagReason, IngestConfig, IngestMetrics, ReplicaKey, ResetReason,
};
use crate::zmtp::{Endpoint, SubEvent, SubSocket, ZmtpError};
use kvroute_config::SocketMode;
use kvroute_index_core::event::EventBatch;
use kvroute_index_core::throttle::LogThrottle;
use kvroute_index_core::wire::{self, DecodedBatch, WireError};

/// `ingest_refused_total` reason of a live message whose topic the socket did not subscribe to.
const TOPIC_MISMATCH: &str = "topic_mismatch";
/// Refusal label: a batch published by another data-parallel rank than the socket's.
const RANK_MISMATCH: &str = "dp_rank_mismatch";

/// Live messages in a row that fail to decode before the stream is flagged unusable
/// (`unknown_encoding`): one bad message is skipped (and the gap repaired), a stream of them
/// means the engine speaks an encoding this index does not know.
const UNDECODABLE_STREAK: u32 = 4;

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
    /// [`ReplayGoal::Resume`]: the engine's buffer does not hold the last batch applied as it
    /// was applied: its stream is not the one indexed (it restarted).
    diverged: bool,
}

impl From<ReplayOutcome> for ReplayResult {
    fn from(outcome: ReplayOutcome) -> Self {
        Self {
            outcome,
            first_applied: None,
            diverged: false,
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
    /// Reconnected to a stream already followed: the buffer must start with the last batch
    /// applied (`seq`, payload `fingerprint`), then everything after it, to its end marker.
    Resume { seq: u64, fingerprint: u64 },
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
    /// Events flow: the socket is open (connect mode) or has a peer (bind mode).
    linked: bool,
    /// `linked` was true once.
    ever_linked: bool,
    /// Publisher peers of a bound socket.
    peers: std::collections::HashSet<String>,
    /// Caught up since the socket (or a bound socket's peer) (re)connected: a catch-up or
    /// resume replay ran, or a live batch was applied in sequence.
    synced: bool,
    /// A bound socket's peer reconnected: check the engine's stream once the current step is done.
    resume_pending: bool,
    /// The state last reported to the sink.
    reported: Option<FeedState>,
    /// Live messages in a row that failed to decode.
    undecodable: u32,
    /// Reported to the sink as `unknown_encoding`.
    encoding_flagged: bool,
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
            linked: false,
            ever_linked: false,
            peers: std::collections::HashSet::new(),
            synced: false,
            resume_pending: false,
            reported: None,
            undecodable: 0,
            encoding_flagged: false,
        }
    }

    /// Tells the sink how the feed stands, when that changed.
    fn report_feed(&mut self) {
        let state = if self.linked {
            if self.synced {
                FeedState::Ready
            } else {
                FeedState::Syncing
            }
        } else if self.ever_linked {
            FeedState::Disconnected
        } else {
            FeedState::NeverConnected
        };
        if self.reported != Some(state) {
            self.reported = Some(state);
            self.sink.feed_state(&self.replica, state);
        }
    }

    /// Events flow again (socket open, or a bound socket's first peer): not synced until the
    /// engine's stream has been checked.
    fn linked_up(&mut self) {
        self.linked = true;
        self.ever_linked = true;
        self.synced = false;
        self.report_feed();
    }

    fn linked_down(&mut self) {
        self.linked = false;
        self.peers.clear();
        self.synced = false;
        self.report_feed();
    }

    fn mark_synced(&mut self) {
        self.synced = true;
        self.report_feed();
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
                    self.linked_down();
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

    /// Whether events flow as soon as the socket is open (a bound socket waits for a peer).
    fn links_on_open(&self) -> bool {
        self.config.mode == SocketMode::Connect
    }

    /// Receives until cancelled or the socket fails.
    async fn pump(&mut self, socket: &mut SubSocket, backoff: &mut Backoff) -> Stop {
        let cancel = self.cancel.clone();
        if self.links_on_open() {
            self.linked_up();
        }
        if let Err(stop) = self.check_stream(socket).await {
            return stop;
        }
        loop {
            if std::mem::take(&mut self.resume_pending)
                && let Err(stop) = self.check_stream(socket).await
            {
                return stop;
            }
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
            SubEvent::PeerConnected { peer } => {
                tracing::info!(
                    replica_id = %self.replica.replica_id,
                    dp_rank = self.replica.dp_rank,
                    peer = %peer,
                    "kv event publisher connected"
                );
                if self.peers.insert(peer) && self.peers.len() == 1 && !self.links_on_open() {
                    let relink = self.ever_linked;
                    self.linked = true;
                    self.ever_linked = true;
                    if relink {
                        // A publisher came back: it may be a restarted engine.
                        self.synced = false;
                        self.resume_pending = true;
                    }
                    self.report_feed();
                }
            }
            SubEvent::PeerDropped { peer, error } => {
                if self.peers.remove(&peer) && self.peers.is_empty() && !self.links_on_open() {
                    self.linked = false;
                    self.synced = false;
                    self.report_feed();
                }
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
                if !self.synced {
                    self.mark_synced();
                }
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
        if outcome != CatchUpOutcome::Failed {
            self.mark_synced();
        }
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

    /// On every (re)connect with a replay endpoint: a fresh stream catches up from 0; a stream
    /// already followed is resumed ([`Self::resume`]), which also tells a restarted engine —
    /// even an idle one that publishes nothing — from the one indexed.
    async fn check_stream(&mut self, socket: &mut SubSocket) -> Result<(), Stop> {
        if self.config.replay_endpoint.is_none() {
            // Nothing to ask: synced by the next live batch in sequence.
            return Ok(());
        }
        if self.tracker.is_fresh() {
            self.catch_up(None, socket).await?;
        } else {
            self.resume(socket).await?;
        }
        self.drain_pending(socket).await
    }

    /// Asks the engine's replay buffer from the last batch applied. The same engine answers with
    /// that batch (same payload) and whatever followed it, which is applied; anything else (an
    /// empty buffer, another first batch or payload) is a new engine stream: the replica is
    /// reset and caught up from 0 as if joined for the first time. If the replay fails the
    /// replica stays syncing until a live batch arrives in sequence.
    async fn resume(&mut self, socket: &mut SubSocket) -> Result<(), Stop> {
        let (Some(endpoint), Some((seq, fingerprint))) = (
            self.config.replay_endpoint.clone(),
            self.tracker.last_applied_entry(),
        ) else {
            // After a reset nothing is held to check: start over from 0.
            self.tracker.forget();
            return self.catch_up(None, socket).await;
        };
        let started = Instant::now();
        let result = self
            .replay(
                &endpoint,
                seq,
                ReplayGoal::Resume { seq, fingerprint },
                socket,
            )
            .await?;
        if result.diverged {
            tracing::info!(
                replica_id = %self.replica.replica_id,
                dp_rank = self.replica.dp_rank,
                last_seq = seq,
                first_replayed = ?result.first_applied,
                elapsed_ms = started.elapsed().as_millis(),
                "reconnected engine's replay buffer does not hold the last batch applied: \
                 engine restarted"
            );
            self.reset(ResetReason::EngineRestart);
            self.tracker.forget();
            return self.catch_up(None, socket).await;
        }
        tracing::info!(
            replica_id = %self.replica.replica_id,
            dp_rank = self.replica.dp_rank,
            last_seq = seq,
            replay = result.outcome.as_label(),
            last_applied = ?self.tracker.last_applied(),
            elapsed_ms = started.elapsed().as_millis(),
            "resumed the engine's stream after a reconnect"
        );
        match result.outcome {
            ReplayOutcome::Ok => self.mark_synced(),
            ReplayOutcome::BufferExceeded | ReplayOutcome::Undecodable => self.give_up(
                ResetReason::GapUnrecoverable,
                "batches published while disconnected are no longer replayable",
            ),
            ReplayOutcome::Timeout | ReplayOutcome::Error => {}
        }
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
        let mut awaiting_first = true;
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
                    if let ReplayGoal::Resume { seq, fingerprint: applied } = goal
                        && std::mem::take(&mut awaiting_first)
                    {
                        let same = matches!(&reply, Ok(ReplayReply::Batch { seq: first, payload })
                            if *first == seq && fingerprint(payload) == applied);
                        match &reply {
                            Err(_) => {}
                            Ok(ReplayReply::Batch { seq: first, .. }) if !same => {
                                return Ok(ReplayResult { outcome: ReplayOutcome::Ok, first_applied: Some(*first), diverged: true });
                            }
                            Ok(ReplayReply::End) => {
                                return Ok(ReplayResult { outcome: ReplayOutcome::Ok, first_applied: None, diverged: true });
                            }
                            // The batch applied last: already indexed, the rest follows.
                            Ok(ReplayReply::Batch { .. }) => continue,
                        }
                    }
                    match reply {
                        Err(error) => {
                            self.replay_error(&error);
                            return Ok(ReplayOutcome::Error.into());
                        }
                        Ok(ReplayReply::End) => {
                            let outcome = match goal {
                                ReplayGoal::CatchUp | ReplayGoal::Resume { .. } => ReplayOutcome::Ok,
                                // The buffer ended before reaching the live stream.
                                ReplayGoal::FillGap { .. } => ReplayOutcome::BufferExceeded,
                            };
                            return Ok(ReplayResult { outcome, first_applied, diverged: false });
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
                            return Ok(ReplayResult { outcome: ReplayOutcome::BufferExceeded, first_applied, diverged: false });
                        }
                        Ok(ReplayReply::Batch { seq, payload }) => {
                            let batch = match wire::decode_engine_batch(self.config.engine, &payload) {
                                Ok(batch) => batch,
                                Err(error) => {
                                    self.decode_failed(&error, "replay");
                                    return Ok(ReplayResult { outcome: ReplayOutcome::Undecodable, first_applied, diverged: false });
                                }
                            };
                            if self.foreign_rank(&batch.batch) {
                                self.refuse_foreign_rank(&batch.batch);
                                continue;
                            }
                            self.apply(seq, fingerprint(&payload), batch);
                            self.replayed_through = Some(seq);
                            first_applied.get_or_insert(seq);
                            // Caught up with the live stream; the rest arrives (or arrived) live.
                            if let ReplayGoal::FillGap { trigger_seq } = goal
                                && seq.saturating_add(1) >= trigger_seq
                            {
                                return Ok(ReplayResult { outcome: ReplayOutcome::Ok, first_applied, diverged: false });
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
        match wire::decode_engine_message(self.config.engine, &frames) {
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
            Ok((_topic, _, batch)) if self.foreign_rank(&batch.batch) => {
                self.refuse_foreign_rank(&batch.batch);
                None
            }
            Ok((_topic, seq, batch)) => {
                self.undecodable = 0;
                if std::mem::take(&mut self.encoding_flagged) {
                    tracing::info!(
                        replica_id = %self.replica.replica_id,
                        dp_rank = self.replica.dp_rank,
                        "kv event messages decode again; unknown_encoding flag cleared"
                    );
                    self.sink
                        .stream_unusable(&self.replica, FlagReason::UnknownEncoding, false);
                }
                Some(LiveMessage {
                    seq,
                    fingerprint: frames.last().map_or(0, |payload| fingerprint(payload)),
                    batch,
                })
            }
            Err(error) => {
                self.decode_failed(&error, "live");
                self.undecodable = self.undecodable.saturating_add(1);
                if self.undecodable >= UNDECODABLE_STREAK && !self.encoding_flagged {
                    self.encoding_flagged = true;
                    tracing::warn!(
                        replica_id = %self.replica.replica_id,
                        dp_rank = self.replica.dp_rank,
                        reason = error.as_label(),
                        in_a_row = self.undecodable,
                        "kv event messages cannot be decoded, several in a row; replica flagged \
                         unknown_encoding (check the engine's kv-events encoding and version)"
                    );
                    self.sink
                        .stream_unusable(&self.replica, FlagReason::UnknownEncoding, true);
                }
                None
            }
        }
    }

    /// Whether `batch` was published by another data-parallel rank than this socket's, where
    /// kvroute derived the socket's rank (`dp_rank_checked`).
    fn foreign_rank(&self, batch: &EventBatch) -> bool {
        self.config.dp_rank_checked
            && batch
                .dp_rank
                .is_some_and(|rank| rank != self.config.dp_rank)
    }

    /// Counts and logs a batch of another rank, which is dropped: applying it would file that
    /// rank's blocks under this one.
    fn refuse_foreign_rank(&mut self, batch: &EventBatch) {
        self.metrics.refused(RANK_MISMATCH);
        self.state.record_error(
            "kv events published by another data-parallel rank than this socket's".into(),
        );
        if let Some(suppressed) = self.decode_warnings.allow() {
            tracing::warn!(
                replica_id = %self.replica.replica_id,
                dp_rank = self.replica.dp_rank,
                published_dp_rank = batch.dp_rank,
                endpoint = %self.config.endpoint,
                suppressed,
                "dropping kv events of another data-parallel rank: the endpoint is not this \
                 rank's publisher (vLLM offsets rank r's ports by r from rank 0's)"
            );
        }
    }

    fn apply(&mut self, seq: u64, fingerprint: u64, decoded: DecodedBatch) {
        if decoded.unknown_events > 0 {
            self.metrics
                .unknown_events_skipped
                .inc_by(u64::from(decoded.unknown_events));
        }
        self.metrics
            .families
            .fields_ignored(&decoded.ignored_fields);
        self.tracker.applied(seq, fingerprint);
        self.sink.apply(&self.replica, seq, decoded.batch);
        // After the sink: whoever sees `last_seq` = N can find batch N in the index.
        self.metrics.batches_applied.inc();
        self.metrics.set_last_sequence(seq);
        self.state.batch_applied(seq);
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
