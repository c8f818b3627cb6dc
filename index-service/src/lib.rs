//! kvroute-index, the service: learns which replica holds which prompt blocks from vLLM's
//! KV-cache events and answers "how many leading blocks of these keys does each replica hold".
//!
//! - [`server`]: the gRPC `Match`/`ReplicaState` API, the agents' stream, admin HTTP
//!   (`/metrics`, `/healthz`, `/readyz`, `/v1/...`), and [`server::LocalMatcher`] for an index
//!   embedded in another process (ext-proc's `embedded-index`);
//! - [`config`] (YAML, validated whole before anything starts);
//! - [`cli`]: the binary `kvroute-index` (its command line, run by `kvroute_runtime::main`).
//!
//! It stands on `kvroute-index-core` (events, wire decoding, the index; no I/O),
//! `kvroute-ingest` (ZMTP sockets and the per-publisher ingest), `kvroute-index-api` (the
//! protocol) and `kvroute-runtime` (what every binary runs on). The per-node agent is the
//! `kvroute-agent` crate; it shares ingest with this crate, not this crate itself.

#![deny(missing_docs)]

pub mod cli;
pub mod config;
pub mod server;
