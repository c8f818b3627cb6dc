//! kvroute-index, the service: learns which replica holds which prompt blocks from vLLM's
//! KV-cache events and answers "how many leading blocks of these keys does each replica hold".
//!
//! - [`zmtp`]: kvroute's own bounded ZMTP 3 SUB and DEALER sockets (engines' `PUB` and replay
//!   `ROUTER`);
//! - [`ingest`]: subscription, replay catch-up, sequence tracking and resets per replica;
//! - [`server`]: the gRPC `Match`/`ReplicaState` API, the agents' stream, admin HTTP
//!   (`/metrics`, `/healthz`, `/readyz`, `/v1/...`), and [`server::LocalMatcher`] for an index
//!   embedded in another process (ext-proc's `embedded-index`);
//! - [`config`] (YAML, validated whole before anything starts) and [`process`] (logging, signals);
//! - the binary `kvroute-index`.
//!
//! The parts other components share live in their own crates and are re-exported here:
//! `kvroute-index-core` ([`event`], [`wire`], [`index`], [`throttle`]; no I/O) and
//! `kvroute-index-api` ([`api`], [`agent_protocol`], [`tls`], [`token`], [`duration`]; what a
//! client needs). The per-node agent is the `kvroute-agent` crate. `test-util` adds `testing`: a
//! vLLM-exact publisher for tests.

#![deny(missing_docs)]

pub mod config;
pub mod ingest;
pub mod process;
pub mod server;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
pub mod zmtp;

pub use kvroute_index_api::{agent_protocol, api, duration, tls, token};
pub use kvroute_index_core::{event, index, throttle, wire};
