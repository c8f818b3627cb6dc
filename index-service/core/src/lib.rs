//! kvroute-index-core: which replica holds which prompt blocks, as vLLM's KV-cache events say.
//!
//! Synchronous and free of I/O: no sockets, no runtime, no config files. The index service
//! (`kvroute-index`), the agent (`kvroute-agent`), ext-proc's embedded index and the replay
//! simulator all build on it.
//!
//! - [`event`]: the domain events (blocks stored, removed, all cleared) every decoder produces;
//! - [`wire`]: every vLLM msgpack encoding of those events, the ZMQ live and replay frames — the
//!   only module that knows msgpack (the encoder, test support, behind the `encode` feature);
//! - [`index`]: the block index (per-shard tables, replica bitsets, copy counts, replica states)
//!   and its one query, "how many leading blocks of these keys does each replica hold";
//! - [`throttle`]: rate-limited warnings, so a flood of bad input is counted in full but logged
//!   once per interval.

#![deny(missing_docs)]

pub mod event;
pub mod index;
pub mod throttle;
pub mod wire;
