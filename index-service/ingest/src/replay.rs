//! The DEALER side of vLLM's replay protocol: one fresh socket per request.
//!
//! A new socket per gap keeps stale replies of an abandoned request (timed out, or cut short once
//! the gap was filled) from ever mixing into the next one; gaps are rare, so the extra connect is
//! cheap.

use bytes::Bytes;

use crate::zmtp::{DealerSocket, Endpoint, Limits, ZmtpError};
use kvroute_index_core::wire::{self, ReplayItem, WireError};

/// Why a replay request failed at the transport level.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReplayError {
    /// The engine's ROUTER could not be reached.
    #[error("connecting to replay endpoint {endpoint}")]
    Connect {
        endpoint: String,
        #[source]
        source: ZmtpError,
    },
    /// Sending the request failed.
    #[error("sending replay request")]
    Send(#[source] ZmtpError),
    /// Receiving a reply failed (the ROUTER went away or broke a limit).
    #[error("receiving replay reply")]
    Recv(#[source] ZmtpError),
    /// A reply had a shape no vLLM release sends.
    #[error("malformed replay reply")]
    Malformed(#[source] WireError),
}

impl ReplayError {
    /// The transport error, if the peer was refused for breaking the protocol or a limit.
    pub(crate) fn refusal(&self) -> Option<&ZmtpError> {
        match self {
            ReplayError::Connect { source, .. }
            | ReplayError::Send(source)
            | ReplayError::Recv(source) => Some(source).filter(|error| error.is_refusal()),
            ReplayError::Malformed(_) => None,
        }
    }

    pub(crate) fn as_label(&self) -> &'static str {
        match self {
            ReplayError::Connect { .. } => "connect",
            ReplayError::Send(_) => "send",
            ReplayError::Recv(_) => "recv",
            ReplayError::Malformed(_) => "malformed",
        }
    }
}

/// One reply of a replay.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ReplayReply {
    /// A buffered batch, payload still encoded.
    Batch { seq: u64, payload: Bytes },
    /// Everything buffered from the requested sequence on has been sent.
    End,
}

/// An open replay request.
pub(crate) struct ReplaySession {
    dealer: DealerSocket,
}

impl std::fmt::Debug for ReplaySession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplaySession").finish_non_exhaustive()
    }
}

impl ReplaySession {
    /// Connects to the engine's ROUTER and asks for every buffered batch from `start_seq` on.
    pub(crate) async fn open(
        endpoint: &str,
        start_seq: u64,
        limits: Limits,
    ) -> Result<Self, ReplayError> {
        let connect_error = |source| ReplayError::Connect {
            endpoint: endpoint.to_owned(),
            source,
        };
        let parsed = Endpoint::parse(endpoint).map_err(connect_error)?;
        let mut dealer = DealerSocket::connect(&parsed, limits)
            .await
            .map_err(connect_error)?;
        dealer
            .send(&wire::replay_request(start_seq))
            .await
            .map_err(ReplayError::Send)?;
        Ok(Self { dealer })
    }

    /// The next reply; cancel-safe (a reply is only taken when it is returned).
    pub(crate) async fn next(&mut self) -> Result<ReplayReply, ReplayError> {
        let frames = self.dealer.recv().await.map_err(ReplayError::Recv)?;
        match wire::parse_replay_frames(&frames).map_err(ReplayError::Malformed)? {
            ReplayItem::End => Ok(ReplayReply::End),
            ReplayItem::Batch { seq, payload } => {
                // Every layout carries the payload in the last frame; keep it without copying.
                let payload = match frames.last() {
                    Some(last) if std::ptr::eq(last.as_ptr(), payload.as_ptr()) => last.clone(),
                    _ => Bytes::copy_from_slice(payload),
                };
                Ok(ReplayReply::Batch { seq, payload })
            }
        }
    }
}
