//! kvroute-index: which replica holds which prompt blocks, learned from vLLM's KV-cache events,
//! answered as "how many leading blocks of these keys does each replica hold".
//!
//! Always compiled (what a client such as ext-proc needs, and the index core):
//! - [`event`]: the domain events (blocks stored, removed, all cleared) every decoder produces;
//! - [`wire`]: every vLLM msgpack encoding of those events, the ZMQ live and replay frames — the
//!   only module that knows msgpack;
//! - [`index`]: the block index (per-shard tables, replica bitsets, copy counts, replica states);
//! - [`api`]: the gRPC types and client of `kvroute.index.v1` (`Match`, `ReplicaState`);
//! - [`tls`], [`token`] (shared secrets, the `authorization` header), [`duration`] (the one
//!   duration format of every kvroute config), [`throttle`] (rate-limited warnings).
//!
//! The `server` feature (default) adds the service: [`zmtp`] (kvroute's own bounded ZMTP 3 SUB and
//! DEALER sockets), [`ingest`] (subscription, replay catch-up, sequence tracking and resets per
//! replica), [`agent`] (the per-node mirror and its stream), [`server`] (gRPC, the agent stream,
//! admin HTTP), [`config`] and [`process`]; the binaries `kvroute-index` and `kvroute-agent`.
//! `test-util` adds `testing`: a vLLM-exact publisher for tests.

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
