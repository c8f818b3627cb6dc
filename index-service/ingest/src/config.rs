//! Settings for one publisher socket (already validated; YAML parsing lives elsewhere).

use std::sync::Arc;
use std::time::Duration;

use super::ReplicaKey;
use kvroute_config::{Engine, SocketMode};

use crate::zmtp::{self, PeerFilter};

/// How long one replay request may take, end marker included. vLLM serves replay between
/// publishing steps (about 100 ms latency), so this leaves room for a large buffer.
pub const DEFAULT_REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// Live messages held while a replay runs; beyond this they are dropped (and show up as a
/// new gap once the replay is done).
pub const DEFAULT_BUFFERED_LIVE_LIMIT: usize = 10_000;
/// Bound on one connect attempt (TCP + ZMTP handshake) before backing off.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// First delay before re-creating a failed socket.
pub const DEFAULT_RECONNECT_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Cap of the exponential reconnect backoff (the config key's default).
pub const DEFAULT_RECONNECT_BACKOFF_MAX: Duration =
    kvroute_config::DEFAULT_EVENTS_RECONNECT_BACKOFF_MAX;

/// One engine publisher socket to ingest (one replica, or one DP rank of it).
#[derive(Debug, Clone, PartialEq)]
pub struct IngestConfig {
    /// Replica id from config; the metric label and half of the [`ReplicaKey`].
    pub replica_id: Arc<str>,
    /// The engine family publishing: which wire decoder reads its batches.
    pub engine: Engine,
    /// Global DP rank of the engine core publishing on this socket (0 without DP). With DP,
    /// vLLM offsets both ports by the rank (`offset_endpoint_port`), one socket per rank.
    pub dp_rank: u32,
    /// Whether a batch naming another rank than `dp_rank` is refused: set where kvroute derived
    /// this socket's ports from rank 0's (`data_parallel_size`), so another rank's batches mean
    /// the base port is wrong and would file one rank's blocks under another.
    pub dp_rank_checked: bool,
    /// ZMQ endpoint of the live stream: the engine's address (`Connect`) or ours (`Bind`).
    /// `tcp://*:port` is accepted for `Bind` and means all interfaces.
    pub endpoint: String,
    /// Connect or bind.
    pub mode: SocketMode,
    /// The engine's replay ROUTER (always bound by the engine), if it has one.
    pub replay_endpoint: Option<String>,
    /// SUB topic prefix filter; `""` receives everything.
    pub topic_filter: String,
    /// Deadline for one replay request.
    pub replay_timeout: Duration,
    /// Live messages held while a replay runs.
    pub buffered_live_limit: usize,
    /// Bound on one connect attempt.
    pub connect_timeout: Duration,
    /// First reconnect delay.
    pub reconnect_backoff_min: Duration,
    /// Reconnect delay cap.
    pub reconnect_backoff_max: Duration,
    /// Bind mode: the peer addresses that may connect (default: any).
    pub allowed_peers: PeerFilter,
    /// Largest message accepted on the live or replay socket; a peer sending more is dropped.
    pub max_message_bytes: usize,
}

impl IngestConfig {
    /// A config with every tunable at its default.
    pub fn new(
        replica_id: impl Into<Arc<str>>,
        endpoint: impl Into<String>,
        mode: SocketMode,
    ) -> Self {
        Self {
            replica_id: replica_id.into(),
            engine: Engine::Vllm,
            dp_rank: 0,
            dp_rank_checked: false,
            endpoint: endpoint.into(),
            mode,
            replay_endpoint: None,
            topic_filter: String::new(),
            replay_timeout: DEFAULT_REPLAY_TIMEOUT,
            buffered_live_limit: DEFAULT_BUFFERED_LIVE_LIMIT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            reconnect_backoff_min: DEFAULT_RECONNECT_BACKOFF_MIN,
            reconnect_backoff_max: DEFAULT_RECONNECT_BACKOFF_MAX,
            allowed_peers: PeerFilter::any(),
            max_message_bytes: zmtp::DEFAULT_MAX_MESSAGE_BYTES,
        }
    }

    /// Bind mode: only peers inside `allowed_peers` may connect.
    pub fn with_allowed_peers(mut self, allowed_peers: PeerFilter) -> Self {
        self.allowed_peers = allowed_peers;
        self
    }

    /// Sets the engine family publishing on the socket.
    pub fn with_engine(mut self, engine: Engine) -> Self {
        self.engine = engine;
        self
    }

    /// Sets the engine's replay endpoint.
    pub fn with_replay_endpoint(mut self, replay_endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(replay_endpoint.into());
        self
    }

    /// Sets the DP rank.
    pub fn with_dp_rank(mut self, dp_rank: u32) -> Self {
        self.dp_rank = dp_rank;
        self
    }

    /// Sets the DP rank and refuses batches naming another (`dp_rank_checked`).
    pub fn with_checked_dp_rank(mut self, dp_rank: u32) -> Self {
        self.dp_rank = dp_rank;
        self.dp_rank_checked = true;
        self
    }

    /// Sets the SUB topic prefix filter.
    pub fn with_topic_filter(mut self, topic_filter: impl Into<String>) -> Self {
        self.topic_filter = topic_filter.into();
        self
    }

    /// The key batches from this socket are applied under.
    pub fn replica_key(&self) -> ReplicaKey {
        ReplicaKey {
            replica_id: Arc::clone(&self.replica_id),
            dp_rank: self.dp_rank,
        }
    }

    /// The transport bounds for this socket's live and replay connections.
    pub(crate) fn limits(&self) -> zmtp::Limits {
        zmtp::Limits {
            max_message_bytes: self.max_message_bytes,
            handshake_timeout: self.connect_timeout,
            ..zmtp::Limits::default()
        }
    }
}

/// ZMQ's `tcp://*:port` as an address the `zeromq` crate (the test publisher) can bind.
#[cfg(any(test, feature = "test-util"))]
pub(crate) fn wildcard_to_unspecified(endpoint: &str) -> String {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_owned(),
    }
}
