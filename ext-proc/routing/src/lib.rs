//! kvroute's routing core: given a request's block keys, what the index says each replica holds
//! and each replica's load, choose a replica and record the choice.
//!
//! - [`policy`]: the default scoring policy (estimated time to first token, lowest wins) and
//!   [`ScoringConfig`], its weights, with the shipped defaults.
//! - [`load`]: replica load — the engine's scraped gauges and kvroute's in-flight accounting.
//! - [`prefix_memory`]: what kvroute itself routed where (approximate tier, speculative inserts).
//! - [`Router`]: the one score-and-commit step over them.
//!
//! Synchronous and free of I/O: ext-proc's picker calls it after tokenizing and asking the index;
//! kvroute-replay calls the same step on simulated time, so its routing-quality figures are the
//! shipped router's.

#![deny(missing_docs)]

pub mod load;
pub mod policy;
pub mod prefix_memory;
mod router;
pub mod scoring;
pub mod split;

pub use router::{
    Indexed, PeerDecision, PoolSide, PromptFacts, ReplicaHandle, RouteRequest, Routed, Router,
    RouterEpoch, Scored, Tier,
};
pub use scoring::ScoringConfig;
pub use split::{PrefillSide, SplitRule, SplitVerdict};

/// Per-replica state by replica id. Ids come from configuration and discovery, never from
/// requests, so a fast unkeyed-quality hash is safe; a decision over a pool of a thousand looks
/// every candidate up several times, where SipHash was the largest per-candidate cost.
type ByReplica<V> = std::collections::HashMap<String, V, foldhash::fast::RandomState>;

/// A number no other call in this process gets: what per-replica tables stamp their state with
/// ([`load::LoadBoard::epoch`], [`prefix_memory::PrefixMemory::epoch`]).
fn next_epoch() -> u64 {
    static EPOCHS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    EPOCHS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}
