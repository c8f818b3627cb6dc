//! Index side of the agent event plane: the `kvroute.index.v1.AgentIngest/AgentStream` RPC.
//!
//! 1. The first message must be `Hello` (within [`HELLO_TIMEOUT`]). The agent id and token are
//!    checked against `agents:` (constant-time compare; the token is never logged). Unknown
//!    agent or wrong token → `UNAUTHENTICATED`; nothing is applied. A `Hello` claiming more than
//!    [`MAX_REPLICAS_PER_HELLO`] replicas is refused whole (`INVALID_ARGUMENT`,
//!    `too_many_replicas`), and an agent with [`MAX_STREAMS_PER_AGENT`] streams open already
//!    gets `RESOURCE_EXHAUSTED` (`too_many_streams`): an honest agent reaches neither.
//! 2. Replicas the `Hello` claims but the agent does not own are refused (counted); the stream
//!    goes on for the rest. Every later write for an unowned replica is refused too.
//!
//! Every per-stream queue is bounded: the outbox of `Refused` messages holds at most
//! [`MAX_QUEUED_REFUSALS`] (the `Hello`'s refusals included; the rest are only counted), and
//! it is drained before the next inbound message is read, so an agent that does not read its
//! responses stalls its own stream (HTTP/2 flow control) instead of growing the index's memory.
//! 3. `Snapshot{first}` makes this stream the replica's writer, resets the replica and keeps it
//!    out of precise scoring (`Resyncing`) until `Snapshot{last}`. Writes from an older stream
//!    of the same replica are refused as `superseded`.
//! 4. `Delta`s are applied in order. Malformed events are refused and counted; a stream that
//!    cannot be decoded (garbage, oversized) ends and is counted.
//! 5. When no stream of its owner is connected for `agent_stale_grace`, a replica is flagged
//!    `Stale` (out of precise scoring) by [`sweep_stale`]; the next snapshot replaces its state.
//!
//! Refusal reasons (`kvroute_index_agent_refused_total{reason}`): see [`Refusal`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::Stream;
use parking_lot::Mutex;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument as _;

use super::Directory;
use crate::config::Config;
use kvroute_index_api::agent_protocol::event_from_proto;
use kvroute_index_api::agent_protocol::{MAX_MESSAGE_BYTES, MAX_REPLICAS_PER_HELLO};
use kvroute_index_api::api::{self, agent_ingest_server::AgentIngestServer};
use kvroute_index_core::event::KvEvent;
use kvroute_index_core::index::{BlockIndex, Feed, FeedState, FlagReason, KvIndex, ReplicaId};
use kvroute_index_core::throttle::LogThrottle;
use kvroute_runtime::token::AgentToken;

/// How long a new stream may take to send `Hello`.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How often agent-fed replicas are checked for staleness.
const SWEEP_INTERVAL: Duration = Duration::from_millis(200);
/// `Refused` messages queued per stream; beyond that they are only counted.
pub const MAX_QUEUED_REFUSALS: usize = 64;
/// Streams one agent may have open at once. It opens one per index instance (a second one
/// while a reconnect overlaps a dying stream); each stream holds a task, buffers and liveness.
pub const MAX_STREAMS_PER_AGENT: usize = 8;
/// Distinct node agents (`node_agents`) the index keeps stream counts for: a cluster's node count
/// with room to spare; past it a new agent id is refused (ids are authenticated, but bounded all
/// the same).
pub const MAX_NODE_AGENTS: usize = 16_384;
/// Ownership changes queued for open node-agent streams; a stream that falls further behind
/// closes (its agent reconnects and claims afresh).
const RECLAIM_QUEUE: usize = 256;
/// At most one warning per this interval for refusals of an authenticated agent's stream.
const REFUSAL_WARN_INTERVAL: Duration = Duration::from_secs(10);

/// Why an agent write (or stream) was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// Unknown agent id or wrong token.
    Unauthenticated,
    /// The first message was not `Hello` (or none came in time).
    NoHello,
    /// A write for a replica this agent does not own.
    NotOwner,
    /// A write for a replica another (newer) stream of the agent has taken over.
    Superseded,
    /// A delta for a replica this stream has not sent a snapshot for.
    NoSnapshot,
    /// An event whose shape is invalid (list lengths, absurd block counts, empty body).
    InvalidEvent,
    /// A message without a body, or a second `Hello`.
    Protocol,
    /// The stream could not be decoded (garbage bytes, truncated frames).
    Malformed,
    /// A message above the size limit.
    Oversized,
    /// A `Hello` claiming more than [`MAX_REPLICAS_PER_HELLO`] replicas.
    TooManyReplicas,
    /// The agent already has [`MAX_STREAMS_PER_AGENT`] streams open.
    TooManyStreams,
}

impl Refusal {
    /// Metric label value.
    pub fn as_label(self) -> &'static str {
        match self {
            Refusal::Unauthenticated => "unauthenticated",
            Refusal::NoHello => "no_hello",
            Refusal::NotOwner => "not_owner",
            Refusal::Superseded => "superseded",
            Refusal::NoSnapshot => "no_snapshot",
            Refusal::InvalidEvent => "invalid_event",
            Refusal::Protocol => "protocol",
            Refusal::Malformed => "malformed",
            Refusal::Oversized => "oversized",
            Refusal::TooManyReplicas => "too_many_replicas",
            Refusal::TooManyStreams => "too_many_streams",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Debug, Clone, Default)]
struct AgentStreamMetrics {
    refused: Family<ReasonLabel, Counter>,
    streams: Gauge,
    snapshots: Counter,
    deltas: Counter,
    events: Counter,
}

impl AgentStreamMetrics {
    fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "agent_refused",
            "Agent streams or writes refused, by reason",
            m.refused.clone(),
        );
        registry.register(
            "agent_streams",
            "Authenticated agent streams open",
            m.streams.clone(),
        );
        registry.register(
            "agent_snapshots",
            "Replica snapshots received from agents",
            m.snapshots.clone(),
        );
        registry.register(
            "agent_deltas",
            "Delta messages applied from agents",
            m.deltas.clone(),
        );
        registry.register(
            "agent_events",
            "Events applied from agent streams",
            m.events.clone(),
        );
        m
    }

    fn refused(&self, refusal: Refusal) {
        self.refused_by(refusal, 1);
    }

    fn refused_by(&self, refusal: Refusal, count: u64) {
        self.refused
            .get_or_create(&ReasonLabel {
                reason: refusal.as_label(),
            })
            .inc_by(count);
    }
}

/// Who an authenticated stream belongs to.
enum Owner<'a> {
    /// A static `agents:` entry: it owns the replicas listed there.
    Listed(&'a AgentEntry),
    /// A node agent (`node_agents`): it owns the agent-fed replicas discovered on the node its
    /// id names, whatever they are now.
    Node(Arc<AtomicUsize>),
}

impl Owner<'_> {
    fn streams(&self) -> &Arc<AtomicUsize> {
        match self {
            Owner::Listed(entry) => &entry.streams,
            Owner::Node(streams) => streams,
        }
    }

    fn owns(&self, directory: &Directory, agent_id: &str, replica: &str) -> bool {
        match self {
            Owner::Listed(entry) => entry.replicas.contains(replica),
            Owner::Node(_) => directory
                .replica(replica)
                .is_some_and(|r| r.agent_fed && r.node.as_deref() == Some(agent_id)),
        }
    }
}

#[derive(Debug)]
struct AgentEntry {
    token: AgentToken,
    replicas: HashSet<String>,
    /// Authenticated streams of this agent open now (at most [`MAX_STREAMS_PER_AGENT`]).
    streams: Arc<AtomicUsize>,
}

/// One of an agent's [`MAX_STREAMS_PER_AGENT`] stream slots; released on drop.
#[derive(Debug)]
struct StreamSlot(Arc<AtomicUsize>);

impl StreamSlot {
    fn take(streams: &Arc<AtomicUsize>) -> Option<Self> {
        streams
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < MAX_STREAMS_PER_AGENT).then_some(open + 1)
            })
            .ok()
            .map(|_| StreamSlot(Arc::clone(streams)))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Per agent-fed replica: who writes it and whether its agent is around.
#[derive(Debug)]
struct ReplicaLiveness {
    /// Stream id of the current writer (the last one that started a snapshot).
    writer: Option<u64>,
    /// Streams of the owner currently connected that claimed this replica.
    connected: usize,
    /// When the last stream went away (or the service started).
    since: Instant,
    stale: bool,
    /// The current writer has sent its whole snapshot (`Snapshot{last}`).
    snapshot_done: bool,
}

/// Agent streams state, shared by the RPC handler and the stale sweeper.
#[derive(Debug)]
pub(crate) struct AgentStreams {
    index: Arc<BlockIndex>,
    directory: Directory,
    agents: HashMap<String, AgentEntry>,
    /// `node_agents`: the token every node agent presents.
    node_token: Option<AgentToken>,
    /// Open streams per node agent id (bounded by [`MAX_NODE_AGENTS`]).
    node_streams: Mutex<HashMap<String, Arc<AtomicUsize>>>,
    /// A replica joined a node (node, its id): that node's open streams that did not claim it end,
    /// so the agent reconnects and claims it.
    reclaim: tokio::sync::broadcast::Sender<(String, ReplicaId)>,
    liveness: Mutex<HashMap<ReplicaId, ReplicaLiveness>>,
    grace: Duration,
    next_stream: AtomicU64,
    metrics: AgentStreamMetrics,
    /// Rate limit of warnings about refused streams and claims.
    warnings: LogThrottle,
    /// Cancelled when the server shuts down: open streams end with UNAVAILABLE instead of holding
    /// the drain until its timeout (agents reconnect, to another instance if there is one).
    shutdown: CancellationToken,
}

impl AgentStreams {
    pub(crate) fn new(
        config: &Config,
        index: Arc<BlockIndex>,
        directory: Directory,
        registry: &mut Registry,
        shutdown: CancellationToken,
    ) -> Arc<Self> {
        let now = Instant::now();
        let mut liveness = HashMap::new();
        let mut agents = HashMap::new();
        for agent in &config.agents {
            for replica in &agent.replicas {
                if let Some(id) = directory.replica_id(replica) {
                    liveness.insert(
                        id,
                        ReplicaLiveness {
                            writer: None,
                            connected: 0,
                            since: now,
                            stale: false,
                            snapshot_done: false,
                        },
                    );
                }
            }
            agents.insert(
                agent.id.clone(),
                AgentEntry {
                    token: agent.token.clone(),
                    replicas: agent.replicas.iter().cloned().collect(),
                    streams: Arc::new(AtomicUsize::new(0)),
                },
            );
        }
        Arc::new(Self {
            index,
            directory,
            agents,
            node_token: config.node_agents.clone(),
            node_streams: Mutex::new(HashMap::new()),
            reclaim: tokio::sync::broadcast::channel(RECLAIM_QUEUE).0,
            liveness: Mutex::new(liveness),
            grace: config.agent_stale_grace,
            next_stream: AtomicU64::new(1),
            metrics: AgentStreamMetrics::register(registry),
            warnings: LogThrottle::new(REFUSAL_WARN_INTERVAL),
            shutdown,
        })
    }

    /// The tonic service.
    pub(crate) fn service(self: &Arc<Self>) -> AgentIngestServer<AgentService> {
        AgentIngestServer::new(AgentService {
            streams: Arc::clone(self),
        })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    fn authenticate(&self, hello: &api::Hello) -> Option<Owner<'_>> {
        let entry = self.agents.get(&hello.agent_id);
        // Compare against something even for unknown ids, so timing does not reveal them.
        match (entry, &self.node_token) {
            (Some(entry), _) => entry
                .token
                .matches(&hello.token)
                .then_some(Owner::Listed(entry)),
            (None, Some(token)) => {
                if !token.matches(&hello.token) || hello.agent_id.is_empty() {
                    return None;
                }
                let mut streams = self.node_streams.lock();
                if !streams.contains_key(&hello.agent_id) && streams.len() >= MAX_NODE_AGENTS {
                    tracing::warn!(
                        limit = MAX_NODE_AGENTS,
                        "node agent refused: too many node agents"
                    );
                    return None;
                }
                let count = streams.entry(hello.agent_id.clone()).or_default();
                Some(Owner::Node(Arc::clone(count)))
            }
            (None, None) => {
                let _ = AgentToken::from_literal("\u{0}unknown-agent").matches(&hello.token);
                None
            }
        }
    }

    /// An agent-fed replica joined (discovery, reload): its liveness is tracked from now (stale
    /// after the grace period if no agent claims it), and the open streams of its node's agent
    /// are told, so one that did not claim it reconnects and does.
    pub(crate) fn track(&self, replica: ReplicaId, node: Option<&str>) {
        self.liveness
            .lock()
            .entry(replica)
            .or_insert_with(|| ReplicaLiveness {
                writer: None,
                connected: 0,
                since: Instant::now(),
                stale: false,
                snapshot_done: false,
            });
        if let Some(node) = node {
            // No receiver: no stream of that node is open, nothing to tell.
            let _ = self.reclaim.send((node.to_owned(), replica));
        }
    }

    /// A replica left the index: nothing of it is tracked any more.
    pub(crate) fn untrack(&self, replica: ReplicaId) {
        self.liveness.lock().remove(&replica);
    }

    /// Checks a `Hello` and opens the stream's session: the answers to send first (`Welcome`,
    /// then refused claims), or the status that refuses the stream.
    fn open_session(
        self: &Arc<Self>,
        hello: api::Hello,
    ) -> Result<(Session, VecDeque<api::IndexMessage>), Status> {
        let Some(agent) = self.authenticate(&hello) else {
            self.metrics.refused(Refusal::Unauthenticated);
            if let Some(suppressed) = self.warnings.allow() {
                tracing::warn!(agent_id = %hello.agent_id, suppressed,
                    "agent stream refused: invalid credentials");
            }
            return Err(Status::unauthenticated("invalid agent credentials"));
        };

        if hello.replicas.len() > MAX_REPLICAS_PER_HELLO {
            self.metrics.refused(Refusal::TooManyReplicas);
            self.warn_refused(
                &hello.agent_id,
                Refusal::TooManyReplicas,
                hello.replicas.len(),
            );
            return Err(Status::invalid_argument(format!(
                "Hello claims {} replicas; at most {MAX_REPLICAS_PER_HELLO}",
                hello.replicas.len()
            )));
        }
        let Some(slot) = StreamSlot::take(agent.streams()) else {
            self.metrics.refused(Refusal::TooManyStreams);
            self.warn_refused(
                &hello.agent_id,
                Refusal::TooManyStreams,
                MAX_STREAMS_PER_AGENT,
            );
            return Err(Status::resource_exhausted(format!(
                "agent has {MAX_STREAMS_PER_AGENT} streams open already"
            )));
        };

        let stream_id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let mut outbox = VecDeque::new();
        let mut claimed = HashSet::new();
        let mut unowned = HashSet::new();
        for name in &hello.replicas {
            match self
                .directory
                .replica_id(name)
                .filter(|_| agent.owns(&self.directory, &hello.agent_id, name))
            {
                Some(id) => {
                    claimed.insert(id);
                }
                // Each distinct name is refused once (all counted below), at most
                // MAX_QUEUED_REFUSALS of them by message.
                None if unowned.insert(name.as_str()) && outbox.len() < MAX_QUEUED_REFUSALS => {
                    outbox.push_back(refused(name, Refusal::NotOwner));
                }
                None => {}
            }
        }
        if !unowned.is_empty() {
            self.metrics
                .refused_by(Refusal::NotOwner, unowned.len() as u64);
            self.warn_refused(&hello.agent_id, Refusal::NotOwner, unowned.len());
        }
        let accepted: Vec<String> = claimed
            .iter()
            .filter_map(|&id| self.directory.replica_name(id).map(|n| n.to_string()))
            .collect();
        outbox.push_front(api::IndexMessage {
            body: Some(api::index_message::Body::Welcome(api::Welcome { accepted })),
        });
        tracing::info!(agent_id = %hello.agent_id, stream_id, replicas = claimed.len(), "agent stream open");

        let reclaim = matches!(agent, Owner::Node(_)).then(|| self.reclaim.subscribe());
        let session = Session::open(
            Arc::clone(self),
            stream_id,
            hello.agent_id,
            claimed,
            slot,
            reclaim,
        );
        Ok((session, outbox))
    }

    /// Logs a refusal of an agent's stream or claims, rate-limited (they are counted in
    /// `agent_refused_total` whether logged or not).
    fn warn_refused(&self, agent_id: &str, refusal: Refusal, count: usize) {
        if let Some(suppressed) = self.warnings.allow() {
            tracing::warn!(
                agent_id,
                reason = refusal.as_label(),
                count,
                suppressed,
                "agent stream or claims refused"
            );
        }
    }

    fn flag_stale_replicas(&self) {
        let now = Instant::now();
        let mut liveness = self.liveness.lock();
        for (&id, state) in liveness.iter_mut() {
            if state.connected == 0 && !state.stale && now.duration_since(state.since) >= self.grace
            {
                state.stale = true;
                if let Err(error) = self.index.flag_replica(id, FlagReason::Stale) {
                    tracing::warn!(replica = %id, %error, "cannot flag a stale replica");
                } else {
                    tracing::warn!(replica_id = ?self.directory.replica_name(id),
                        grace_ms = self.grace.as_millis() as u64,
                        "agent gone: replica flagged stale");
                }
            }
        }
    }
}

/// Flags agent-fed replicas whose agent has been away longer than the grace period.
pub(crate) async fn sweep_stale(streams: Arc<AgentStreams>, cancel: CancellationToken) {
    let mut ticker = tokio::time::interval(SWEEP_INTERVAL);
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            _ = ticker.tick() => streams.flag_stale_replicas(),
        }
    }
}

/// The gRPC service.
#[derive(Debug, Clone)]
pub struct AgentService {
    streams: Arc<AgentStreams>,
}

type IndexMessages = Pin<Box<dyn Stream<Item = Result<api::IndexMessage, Status>> + Send>>;

impl AgentService {
    /// Reads the stream's Hello and opens its session.
    async fn open(
        streams: &Arc<AgentStreams>,
        mut inbound: Streaming<api::AgentMessage>,
    ) -> Result<
        (
            Streaming<api::AgentMessage>,
            Session,
            VecDeque<api::IndexMessage>,
        ),
        Status,
    > {
        let hello = match tokio::time::timeout(HELLO_TIMEOUT, inbound.message()).await {
            Ok(Ok(Some(api::AgentMessage {
                body: Some(api::agent_message::Body::Hello(hello)),
            }))) => hello,
            Ok(Err(status)) => {
                streams.metrics.refused(decode_refusal(&status));
                return Err(Status::invalid_argument("cannot decode the first message"));
            }
            _ => {
                streams.metrics.refused(Refusal::NoHello);
                return Err(Status::invalid_argument("the first message must be Hello"));
            }
        };
        let (session, outbox) = streams.open_session(hello)?;
        Ok((inbound, session, outbox))
    }
}

#[tonic::async_trait]
impl api::agent_ingest_server::AgentIngest for AgentService {
    type AgentStreamStream = IndexMessages;

    async fn agent_stream(
        &self,
        request: Request<Streaming<api::AgentMessage>>,
    ) -> Result<Response<IndexMessages>, Status> {
        let streams = &self.streams;
        // The stream's opening (its Hello, the session) is a span of the agent's trace; the
        // stream itself lives for as long as the agent runs, so it is no span.
        let span = kvroute_runtime::trace_span!(
            "kvroute.index.v1.AgentIngest/AgentStream",
            otel.kind = "server",
            rpc.system = "grpc",
        );
        kvroute_runtime::telemetry::continue_grpc_trace(&span, request.metadata());
        let (inbound, session, outbox) = Self::open(streams, request.into_inner())
            .instrument(span)
            .await?;
        let state = Some((inbound, session, outbox));
        let responses = futures::stream::unfold(state, |state| async move {
            let (mut inbound, mut session, mut outbox) = state?;
            loop {
                if let Some(message) = outbox.pop_front() {
                    return Some((Ok(message), Some((inbound, session, outbox))));
                }
                let received = tokio::select! {
                    received = inbound.message() => received,
                    () = session.streams.shutdown.cancelled() => {
                        tracing::info!(agent_id = %session.agent_id, "agent stream closed: the index is shutting down");
                        let closing = Status::unavailable("kvroute-index is shutting down");
                        return Some((Err(closing), None));
                    }
                    () = unclaimed_replica_joined(&mut session.reclaim, &session.agent_id, &session.claimed) => {
                        tracing::info!(agent_id = %session.agent_id, "agent stream closed: a replica joined its node; the agent reconnects to claim it");
                        let closing = Status::unavailable("a replica joined this node: reconnect and claim it");
                        return Some((Err(closing), None));
                    }
                };
                match received {
                    Ok(Some(message)) => {
                        for refusal in session.handle(message) {
                            if outbox.len() < MAX_QUEUED_REFUSALS {
                                outbox.push_back(refusal);
                            }
                        }
                    }
                    Ok(None) => return None,
                    Err(status) => {
                        let refusal = decode_refusal(&status);
                        session.streams.metrics.refused(refusal);
                        tracing::warn!(agent_id = %session.agent_id, reason = refusal.as_label(),
                            error = %status.message(), "agent stream ended");
                        return None;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(responses)))
    }
}

/// Resolves when a replica joins `node`'s agent (this stream's `agent_id`) that the stream did not
/// claim, or the stream fell behind the queue of such changes; never for a listed agent's stream
/// (`reclaim` is `None`).
async fn unclaimed_replica_joined(
    reclaim: &mut Option<tokio::sync::broadcast::Receiver<(String, ReplicaId)>>,
    node: &str,
    claimed: &HashSet<ReplicaId>,
) {
    let Some(reclaim) = reclaim else {
        return std::future::pending().await;
    };
    loop {
        match reclaim.recv().await {
            Ok((joined, replica)) if joined == node && !claimed.contains(&replica) => return,
            Ok(_) => {}
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => return,
            Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                return std::future::pending().await;
            }
        }
    }
}

fn decode_refusal(status: &Status) -> Refusal {
    match status.code() {
        tonic::Code::OutOfRange | tonic::Code::ResourceExhausted => Refusal::Oversized,
        _ => Refusal::Malformed,
    }
}

fn refused(replica: &str, refusal: Refusal) -> api::IndexMessage {
    api::IndexMessage {
        body: Some(api::index_message::Body::Refused(api::Refused {
            replica_id: replica.to_owned(),
            reason: refusal.as_label().to_owned(),
        })),
    }
}

/// One authenticated stream; dropping it (stream over) updates the replicas' liveness.
struct Session {
    streams: Arc<AgentStreams>,
    id: u64,
    agent_id: String,
    claimed: HashSet<ReplicaId>,
    /// Replicas this stream has started a snapshot for.
    snapshotted: HashSet<ReplicaId>,
    /// The agent's stream slot, released when the session ends.
    _slot: StreamSlot,
    /// A node agent's: replicas joining its node (see [`unclaimed_replica_joined`]).
    reclaim: Option<tokio::sync::broadcast::Receiver<(String, ReplicaId)>>,
}

impl Session {
    fn open(
        streams: Arc<AgentStreams>,
        id: u64,
        agent_id: String,
        claimed: HashSet<ReplicaId>,
        slot: StreamSlot,
        reclaim: Option<tokio::sync::broadcast::Receiver<(String, ReplicaId)>>,
    ) -> Self {
        {
            let mut liveness = streams.liveness.lock();
            for replica in &claimed {
                if let Some(state) = liveness.get_mut(replica) {
                    state.connected += 1;
                    // What the index holds is the last writer's until this stream's snapshot.
                    let _ = streams
                        .index
                        .set_feed_state(*replica, Feed::Agent, FeedState::Syncing);
                }
            }
        }
        streams.metrics.streams.inc();
        Self {
            streams,
            id,
            agent_id,
            claimed,
            snapshotted: HashSet::new(),
            _slot: slot,
            reclaim,
        }
    }

    /// Applies one message; returns refusals to report.
    fn handle(&mut self, message: api::AgentMessage) -> Vec<api::IndexMessage> {
        use api::agent_message::Body;
        match message.body {
            Some(Body::Snapshot(snapshot)) => {
                self.streams.metrics.snapshots.inc();
                self.write(
                    &snapshot.replica_id,
                    snapshot.first,
                    snapshot.events,
                    Some(snapshot.last),
                )
            }
            Some(Body::Delta(delta)) => {
                self.streams.metrics.deltas.inc();
                self.write(&delta.replica_id, delta.reset, delta.events, None)
            }
            Some(Body::Hello(_)) | None => {
                self.streams.metrics.refused(Refusal::Protocol);
                vec![refused("", Refusal::Protocol)]
            }
        }
    }

    /// A snapshot chunk (`snapshot_last` is `Some`) or a delta; `reset` is `first` / `reset`.
    fn write(
        &mut self,
        name: &str,
        reset: bool,
        events: Vec<api::Event>,
        snapshot_last: Option<bool>,
    ) -> Vec<api::IndexMessage> {
        let streams = Arc::clone(&self.streams);
        let refuse = |refusal: Refusal| {
            streams.metrics.refused(refusal);
            vec![refused(name, refusal)]
        };
        let Some(id) = streams
            .directory
            .replica_id(name)
            .filter(|id| self.claimed.contains(id))
        else {
            return refuse(Refusal::NotOwner);
        };
        let snapshot_first = snapshot_last.is_some() && reset;
        {
            let mut liveness = streams.liveness.lock();
            let Some(state) = liveness.get_mut(&id) else {
                return refuse(Refusal::NotOwner);
            };
            if snapshot_first {
                state.writer = Some(self.id);
                state.stale = false;
                state.snapshot_done = false;
                self.snapshotted.insert(id);
            } else if !self.snapshotted.contains(&id) {
                return refuse(Refusal::NoSnapshot);
            } else if state.writer != Some(self.id) {
                return refuse(Refusal::Superseded);
            }
        }
        let mut decoded: Vec<KvEvent> = Vec::with_capacity(events.len());
        let mut invalid = 0;
        for event in events {
            match event_from_proto(event) {
                Ok(event) => decoded.push(event),
                Err(error) => {
                    invalid += 1;
                    tracing::debug!(
                        replica_id = name,
                        reason = error.as_label(),
                        "agent event refused"
                    );
                }
            }
        }
        if reset && let Err(error) = streams.index.reset_replica(id) {
            tracing::warn!(replica_id = name, %error, "reset failed");
        }
        if snapshot_first {
            // Out of precise scoring until the whole snapshot is in.
            let _ = streams.index.flag_replica(id, FlagReason::Resyncing);
        }
        streams.metrics.events.inc_by(decoded.len() as u64);
        if let Err(error) = streams.index.apply_events(id, &decoded) {
            tracing::warn!(replica_id = name, %error, "agent events not applied");
        }
        if snapshot_last == Some(true) {
            if let Some(state) = streams.liveness.lock().get_mut(&id)
                && state.writer == Some(self.id)
            {
                state.snapshot_done = true;
                let _ = streams
                    .index
                    .set_feed_state(id, Feed::Agent, FeedState::Ready);
            }
            let flagged = streams.index.replica_status(id).ok().and_then(|s| s.flag);
            if flagged == Some(FlagReason::Resyncing) {
                let _ = streams.index.clear_flag(id);
            }
        }
        if invalid > 0 {
            streams
                .metrics
                .refused
                .get_or_create(&ReasonLabel {
                    reason: Refusal::InvalidEvent.as_label(),
                })
                .inc_by(invalid);
            return vec![refused(name, Refusal::InvalidEvent)];
        }
        Vec::new()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut liveness = self.streams.liveness.lock();
        for replica in &self.claimed {
            if let Some(state) = liveness.get_mut(replica) {
                state.connected = state.connected.saturating_sub(1);
                if state.connected == 0 {
                    state.since = now;
                    let _ = self.streams.index.set_feed_state(
                        *replica,
                        Feed::Agent,
                        FeedState::Disconnected,
                    );
                }
            }
        }
        self.streams.metrics.streams.dec();
        tracing::info!(agent_id = %self.agent_id, stream_id = self.id, "agent stream closed");
    }
}

/// What the index does with an agent's messages once they are decoded, without the network:
/// for fuzz targets (`fuzz/`), behind the `fuzzing` feature (and in this crate's tests, so the
/// harness itself is tested by the normal suite).
///
/// The replicas name ZMQ endpoints only because the config requires a source for replicas its
/// file does not give an agent; nothing here opens a socket.
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing {
    use std::sync::Arc;

    use prometheus_client::registry::Registry;
    use tokio_util::sync::CancellationToken;

    use super::{AgentStreams, Session};
    use crate::config::{AgentConfig, Config};
    use crate::server::Directory;
    use kvroute_index_api::api;
    use kvroute_index_core::index::{BlockIndex, IndexConfig, IndexMetrics};
    use kvroute_runtime::token::AgentToken;

    /// The agent id [`AgentStreamHarness`] knows.
    pub const AGENT_ID: &str = "fuzz-agent";
    /// Its token.
    pub const TOKEN: &str = "fuzz-token";
    /// The replicas it owns (`engine-a`, `engine-b`); `engine-c` exists and is not its own.
    pub const REPLICAS: [&str; 3] = ["engine-a", "engine-b", "engine-c"];

    const CONFIG: &str = r#"
pools:
  - {name: tiny, models: [tiny], block_size: 4, key_scheme: {kind: vllm-exact, hash_algo: sha256_cbor, seed: "0"}, verify_hashes: required}
  - {name: chain, models: [chain], block_size: 4, key_scheme: {kind: token-chain}}
replicas:
  - {id: engine-a, pool: tiny, events: {endpoint: "tcp://127.0.0.1:9"}}
  - {id: engine-b, pool: chain, events: {endpoint: "tcp://127.0.0.1:9"}}
  - {id: engine-c, pool: tiny, events: {endpoint: "tcp://127.0.0.1:9"}}
"#;

    /// An index with the agent-stream handling of the server and no network.
    #[derive(Debug)]
    pub struct AgentStreamHarness {
        streams: Arc<AgentStreams>,
        index: Arc<BlockIndex>,
    }

    /// An open stream of the harness.
    pub struct HarnessSession(Session);

    impl std::fmt::Debug for HarnessSession {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("HarnessSession").finish_non_exhaustive()
        }
    }

    impl Default for AgentStreamHarness {
        fn default() -> Self {
            Self::new()
        }
    }

    impl AgentStreamHarness {
        /// Two pools (vllm-exact with `verify_hashes: required`, token-chain), three replicas,
        /// one agent owning two of them.
        ///
        /// # Panics
        ///
        /// If the fixed configuration does not validate (a bug in this harness).
        #[expect(clippy::expect_used, reason = "fixed configuration of a fuzz harness")]
        pub fn new() -> Self {
            let mut config = Config::from_yaml(CONFIG).expect("the harness config is valid");
            config.agents.push(AgentConfig {
                id: AGENT_ID.to_owned(),
                token: AgentToken::from_literal(TOKEN),
                replicas: vec![REPLICAS[0].to_owned(), REPLICAS[1].to_owned()],
            });
            let mut registry = Registry::default();
            let index = Arc::new(BlockIndex::new(
                IndexConfig::default(),
                IndexMetrics::register(&mut registry),
            ));
            let directory =
                Directory::register(&config, &index).expect("the harness config registers");
            let streams = AgentStreams::new(
                &config,
                Arc::clone(&index),
                directory,
                &mut registry,
                CancellationToken::new(),
            );
            Self { streams, index }
        }

        /// The first message of a stream: `Some` session if it is an acceptable `Hello`.
        pub fn open(&self, first: api::AgentMessage) -> Option<HarnessSession> {
            let Some(api::agent_message::Body::Hello(hello)) = first.body else {
                return None;
            };
            self.streams
                .open_session(hello)
                .ok()
                .map(|(session, _answers)| HarnessSession(session))
        }

        /// The index behind the streams.
        pub fn index(&self) -> &BlockIndex {
            &self.index
        }
    }

    impl HarnessSession {
        /// One later message of the stream, applied as the server applies it; returns how many
        /// answers (refusals) it produced.
        pub fn handle(&mut self, message: api::AgentMessage) -> usize {
            self.0.handle(message).len()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fuzzing::{AGENT_ID, AgentStreamHarness, REPLICAS, TOKEN};
    use kvroute_index_api::api;
    use kvroute_index_core::index::KvIndex as _;

    fn hello(token: &str, replicas: &[&str]) -> api::AgentMessage {
        api::AgentMessage {
            body: Some(api::agent_message::Body::Hello(api::Hello {
                agent_id: AGENT_ID.into(),
                token: token.into(),
                replicas: replicas.iter().map(|r| r.to_string()).collect(),
            })),
        }
    }

    /// The fuzz harness's first finding was its own config (replicas without a source); this
    /// runs it the way the `agent_message` target does.
    #[test]
    fn the_fuzz_harness_opens_streams_and_applies_writes() {
        let harness = AgentStreamHarness::new();
        assert!(harness.open(hello("wrong", &REPLICAS)).is_none());
        let mut session = harness
            .open(hello(TOKEN, &REPLICAS))
            .expect("authenticated");
        let snapshot = |replica: &str| api::AgentMessage {
            body: Some(api::agent_message::Body::Snapshot(api::Snapshot {
                replica_id: replica.into(),
                first: true,
                last: true,
                events: vec![api::Event {
                    kind: Some(api::event::Kind::Stored(api::BlockStored {
                        block_hashes: vec![1],
                        token_ids: vec![1, 2, 3, 4],
                        block_size: 4,
                        ..Default::default()
                    })),
                }],
            })),
        };
        // engine-a: vllm-exact with verify_hashes: required (hash 1 is not the tokens' hash);
        // engine-b: token-chain; engine-c: not the agent's.
        assert_eq!(session.handle(snapshot("engine-a")), 0);
        assert_eq!(session.handle(snapshot("engine-b")), 0);
        assert_eq!(session.handle(snapshot("engine-c")), 1);
        assert!(harness.index().find_matches("tiny", &[1], None).is_ok());
    }
}
