//! kvroute-index: the KV block index behind kvroute's routing decisions.
//!
//! (Skeleton: being implemented.)

#[cfg(feature = "server")]
pub mod agent;
#[cfg(feature = "server")]
pub mod config;
pub mod duration;
pub mod event;
pub mod index;
#[cfg(feature = "server")]
pub mod ingest;
#[cfg(feature = "server")]
pub mod process;
#[cfg(feature = "server")]
pub mod server;
#[cfg(all(feature = "server", any(test, feature = "test-util")))]
pub mod testing;
pub mod throttle;
pub mod tls;
pub mod token;
pub mod wire;
#[cfg(feature = "server")]
pub mod zmtp;

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
