//! kvroute-index-api: the index's protocol, and nothing of the service.
//!
//! - [`api`]: the generated gRPC types, clients and service traits of `kvroute.index.v1`
//!   (`Match`, `ReplicaState`, the agent's `AgentStream`; see `proto/`);
//! - [`agent_protocol`]: the agent stream's limits and the conversion between domain events and
//!   its protobuf messages (both ends use it: the agent sends, the index validates and applies).
//!
//! ext-proc depends on this crate (and on the I/O-free `kvroute-index-core`) to query a remote
//! index; only its `embedded-index` feature brings in the service.

#![deny(missing_docs)]

pub mod agent_protocol;

/// Generated gRPC types and client/server for `kvroute.index.v1` (see `proto/`).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod api {
    tonic::include_proto!("kvroute.index.v1");

    impl ReplicaCondition {
        /// The state's name in metrics, logs and the admin API (`/v1/replicas`, `/v1/match`).
        pub fn label(self) -> &'static str {
            match self {
                Self::Unspecified => "unspecified",
                Self::Ready => "ready",
                Self::Syncing => "syncing",
                Self::Stale => "stale",
                Self::Disconnected => "disconnected",
                Self::NeverConnected => "never_connected",
                Self::Flagged => "flagged",
            }
        }
    }
}
