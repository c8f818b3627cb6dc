//! kvroute's own ZMTP 3 transport: the SUB and DEALER sides vLLM's KV-event publisher talks to,
//! with every length a peer declares checked before anything is allocated for it.
//!
//! Why not the `zeromq` crate: its decoder reserves whatever length a frame header declares, so
//! nine bytes (`06 0000010000000000`, a 1 TiB command frame) from anyone who can reach a socket
//! aborted the process on a failed allocation, before any handshake. This module speaks exactly
//! what ingest needs and bounds everything:
//!
//! - **Sizes**: a frame is refused from its header when the message it belongs to would exceed
//!   [`Limits::max_message_bytes`]; handshake commands are capped at [`MAX_COMMAND_BYTES`]; a
//!   message has at most [`Limits::max_frames`] frames. Memory per connection stays below about
//!   twice the message limit whatever a peer declares or how slowly it sends.
//! - **Time**: greeting and READY must complete within [`Limits::handshake_timeout`].
//! - **Peers** (bound SUB): at most [`Limits::max_peers`] at once, and only addresses in the
//!   [`PeerFilter`] when one is configured. A refused or misbehaving peer is dropped alone; the
//!   socket and every other peer go on.
//!
//! Every connection decodes its peer's bytes with [`Inbound`], a state machine without I/O
//! (greeting, READY, messages), which is also what `fuzz/` drives.
//!
//! Protocol: ZMTP 3.0 (RFC 23) with the NULL mechanism, which is what vLLM's pyzmq sockets speak
//! (libzmq downgrades from 3.1). Subscriptions are sent as messages (`0x01` + prefix), the 3.0
//! form every PUB accepts. Transports: `tcp://host:port` (`*` binds every interface) and
//! `ipc://path`. Interoperability is tested against libzmq (pyzmq) and the `zeromq` crate.

mod codec;
mod endpoint;
mod socket;

pub use codec::{Frame, FrameDecoder, GREETING_LEN, SocketType};
pub use endpoint::{Endpoint, PeerFilter, PeerFilterError};
pub use socket::{DealerSocket, Inbound, InboundEvent, SubEvent, SubSocket};

use std::time::Duration;

/// Default cap on one message (all its frames): the `max_message_bytes` key's default.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = kvroute_config::DEFAULT_MAX_MESSAGE_BYTES;
/// Default cap on frames per message: vLLM sends 3 (live) or 4 (replay, with the delimiter).
pub const DEFAULT_MAX_FRAMES: usize = 8;
/// Default bound on greeting + READY exchange.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default cap on peers connected to one bound SUB socket at once (an engine needs one; a
/// restarting engine briefly two).
pub const DEFAULT_MAX_PEERS: usize = 16;
/// Cap on a handshake command (READY, ERROR); libzmq's READY is well under 100 bytes.
pub const MAX_COMMAND_BYTES: usize = 64 << 10;

/// Bounds on what peers can make a socket hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest message (sum of its frames' bodies) accepted.
    pub max_message_bytes: usize,
    /// Most frames in one message.
    pub max_frames: usize,
    /// Bound on the greeting and READY exchange (and a connect's TCP handshake).
    pub handshake_timeout: Duration,
    /// Most peers on one bound socket at once.
    pub max_peers: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            max_frames: DEFAULT_MAX_FRAMES,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            max_peers: DEFAULT_MAX_PEERS,
        }
    }
}

/// A peer broke the protocol or a limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The greeting or READY exchange was not ZMTP 3 with the NULL mechanism.
    #[error("handshake: {0}")]
    Handshake(&'static str),
    /// The peer's socket type cannot talk to ours.
    #[error("peer socket type {peer:?} cannot talk to a {ours} socket")]
    SocketType {
        /// What the peer announced.
        peer: String,
        /// Our type.
        ours: &'static str,
    },
    /// A frame header or command that no ZMTP peer sends.
    #[error("malformed frame: {0}")]
    MalformedFrame(&'static str),
    /// A frame whose declared size would take its message past the limit.
    #[error("frame of {declared} bytes refused (limit {limit})")]
    Oversized {
        /// The size the header declared.
        declared: u64,
        /// What was still allowed.
        limit: usize,
    },
    /// A message with more frames than allowed.
    #[error("message of more than {limit} frames refused")]
    TooManyFrames {
        /// The cap.
        limit: usize,
    },
    /// The peer sent an ERROR command.
    #[error("peer reported an error: {0}")]
    PeerError(String),
}

/// Why a socket operation failed or a peer was dropped.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The endpoint string is not one this transport serves.
    #[error("endpoint {endpoint:?}: {reason}")]
    Endpoint {
        /// As configured.
        endpoint: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Connect, bind, read or write failed.
    #[error("i/o")]
    Io(#[from] std::io::Error),
    /// The peer closed the connection.
    #[error("peer closed the connection")]
    Closed,
    /// Connecting did not finish in time.
    #[error("connect timed out")]
    ConnectTimeout,
    /// The peer did not finish the greeting and READY exchange in time.
    #[error("handshake timed out")]
    HandshakeTimeout,
    /// The peer broke the protocol or a limit.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A peer address outside the configured allow-list.
    #[error("peer {peer} is not in allowed_peers")]
    NotAllowed {
        /// The refused address.
        peer: String,
    },
    /// A bound socket already has its maximum of peers.
    #[error("already {limit} peers connected")]
    TooManyPeers {
        /// The cap.
        limit: usize,
    },
}

impl ZmtpError {
    /// Metric label.
    pub fn as_label(&self) -> &'static str {
        match self {
            ZmtpError::Endpoint { .. } => "endpoint",
            ZmtpError::Io(_) => "io",
            ZmtpError::Closed => "closed",
            ZmtpError::ConnectTimeout => "connect_timeout",
            ZmtpError::HandshakeTimeout => "handshake_timeout",
            ZmtpError::Protocol(error) => match error {
                ProtocolError::Handshake(_) => "handshake",
                ProtocolError::SocketType { .. } => "socket_type",
                ProtocolError::MalformedFrame(_) => "malformed_frame",
                ProtocolError::Oversized { .. } => "oversized",
                ProtocolError::TooManyFrames { .. } => "too_many_frames",
                ProtocolError::PeerError(_) => "peer_error",
            },
            ZmtpError::NotAllowed { .. } => "not_allowed",
            ZmtpError::TooManyPeers { .. } => "too_many_peers",
        }
    }

    /// Whether the peer was refused for what it did or who it is (counted as a refusal), as
    /// opposed to a connection simply going away.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            ZmtpError::Protocol(_)
                | ZmtpError::HandshakeTimeout
                | ZmtpError::NotAllowed { .. }
                | ZmtpError::TooManyPeers { .. }
        )
    }
}
