//! The default policy's weights and their defaults (ext-proc's `scoring:` config section).

use std::time::Duration;

/// Default per-token prefill cost, in milliseconds (uncached prompt tokens).
pub const DEFAULT_PREFILL_MS_PER_TOKEN: f64 = 0.05;
/// Default cost of each waiting (queued) request ahead, in milliseconds.
pub const DEFAULT_QUEUE_MS_PER_REQUEST: f64 = 50.0;
/// Default cost of each running request (batch interference), in milliseconds.
pub const DEFAULT_RUNNING_MS_PER_REQUEST: f64 = 5.0;
/// Default penalty at 100% KV-cache usage (preemption risk), in milliseconds.
pub const DEFAULT_KV_USAGE_MS: f64 = 100.0;
/// A replica whose load exceeds the pool mean by this factor is skipped (hotspot guard). A guard
/// that spills a burst early spends a busy pool's capacity recomputing contexts: in
/// kvroute-replay at 1.1 it cut fan-out's max rate at the 2 s objective from 80.7 to 70.9 req/s;
/// 1.75 keeps it.
pub const DEFAULT_HOTSPOT_FACTOR: f64 = 1.75;
/// Loads below this (ms) never trip the hotspot guard while the pool is busy (an idle pool has
/// tiny means).
pub const DEFAULT_HOTSPOT_MIN_MS: f64 = 200.0;
/// The pool counts as idle while its candidates' queued prefill, averaged over the last seconds
/// ([`POOL_LOAD_AVERAGING`]), is below this (ms): about two 1k-token prompts' worth. Idle, a
/// burst of siblings spreads over the replicas holding its context instead of batching where
/// its prefill is in flight (`policy` module docs).
pub const DEFAULT_IDLE_POOL_MS: f64 = 100.0;
/// How long a moment of load weighs in the pool's average (the time constant of its
/// exponential decay): long enough that a burst does not make an idle pool busy, short enough
/// that a pool grown busy stops spilling within seconds. (In kvroute-replay 1–4 s measured the
/// same.)
pub const POOL_LOAD_AVERAGING: Duration = Duration::from_secs(2);
/// Share of a held prefix's prefill charged again to a candidate that would recompute it, once
/// every replica is busy (`policy` module docs). 2: the recomputation is paid by the request and
/// by the requests queued behind it, more than one once queues form. (In kvroute-replay, 0.5 or 1
/// charged at any load, or 2 scaled by the mean queue, cost fan-out and multi-turn what they
/// gained elsewhere; 1 left fan-out's max rate one bisection step below llm-d's, and 3 gave it
/// back on 4 seeds.)
pub const DEFAULT_RECOMPUTE_PENALTY: f64 = 2.0;
/// How long a routed prefix counts as held by its replica before the engine's events confirm it.
pub const DEFAULT_SPECULATIVE_TTL: Duration = Duration::from_secs(5);

/// Default queue (ms) of the least busy candidate from which the pool counts as overloaded and
/// the policy keeps prefixes where they are cached (`policy` module docs). 0 turns it off. In
/// kvroute-replay 8 s moved TTFT p90 at 1.5 and 2 times each workload's saturation rate to
/// 0.90–1.03 of the best anchor's (off: 0.93–1.11); lower bounds also fired in the bursts of a
/// pool just past saturation, which still gains from balancing, and cost the synthetic trace a
/// fifth of its max rate at the 2 s objective (2 s) or half its p90 just past saturation (6 s,
/// jittered arrivals).
pub const DEFAULT_OVERLOAD_QUEUE_MS: f64 = 8000.0;
/// Default imbalance tolerated in overload: a candidate whose queue is within this factor of
/// the least busy one's is as good a place to wait as any.
pub const DEFAULT_OVERLOAD_IMBALANCE: f64 = 1.5;

/// Weights of the default policy (estimated time to first token, in ms).
#[derive(Debug, Clone, PartialEq)]
pub struct ScoringConfig {
    /// Prefill cost per uncached prompt token.
    pub prefill_ms_per_token: f64,
    /// Cost per waiting request.
    pub queue_ms_per_request: f64,
    /// Cost per running request.
    pub running_ms_per_request: f64,
    /// Cost at 100% KV-cache usage.
    pub kv_usage_ms: f64,
    /// Hotspot guard factor over the pool mean load.
    pub hotspot_factor: f64,
    /// Loads below this never trip the guard.
    pub hotspot_min_ms: f64,
    /// Pool's average queued prefill (ms) below which it counts as idle; 0: never.
    pub idle_pool_ms: f64,
    /// Share of a held prefix's prefill charged to recomputing it when every replica is busy.
    pub recompute_penalty: f64,
    /// Lifetime of a speculative prefix insert.
    pub speculative_ttl: Duration,
    /// Least busy candidate's queue (ms) from which the pool is overloaded; 0: never.
    pub overload_queue_ms: f64,
    /// Queue imbalance (factor over the least busy candidate) tolerated in overload.
    pub overload_imbalance: f64,
}

impl Default for ScoringConfig {
    /// The shipped defaults (what an empty `scoring:` section gives).
    fn default() -> Self {
        Self {
            prefill_ms_per_token: DEFAULT_PREFILL_MS_PER_TOKEN,
            queue_ms_per_request: DEFAULT_QUEUE_MS_PER_REQUEST,
            running_ms_per_request: DEFAULT_RUNNING_MS_PER_REQUEST,
            kv_usage_ms: DEFAULT_KV_USAGE_MS,
            hotspot_factor: DEFAULT_HOTSPOT_FACTOR,
            hotspot_min_ms: DEFAULT_HOTSPOT_MIN_MS,
            idle_pool_ms: DEFAULT_IDLE_POOL_MS,
            recompute_penalty: DEFAULT_RECOMPUTE_PENALTY,
            speculative_ttl: DEFAULT_SPECULATIVE_TTL,
            overload_queue_ms: DEFAULT_OVERLOAD_QUEUE_MS,
            overload_imbalance: DEFAULT_OVERLOAD_IMBALANCE,
        }
    }
}
