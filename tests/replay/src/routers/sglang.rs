//! SGLang's cache-aware router (sgl-router / sgl-model-gateway `cache_aware` policy).
//!
//! - Per worker an approximate prefix tree of what the router sent there (no engine events).
//!   SGLang's tree is over characters; here over block keys (chained keys make a key set a
//!   tree), bounded per worker by [`SglangConfig::max_tree_blocks`] with LRU eviction.
//! - Load is the router's own count of requests sent and not finished.
//! - If the system is imbalanced — `max − min > balance_abs_threshold` and
//!   `max > balance_rel_threshold · min` — route to the least loaded worker.
//! - Otherwise, if the best match rate (matched / prompt tokens) exceeds `cache_threshold`,
//!   route to that worker; else to the least loaded worker. (Older `sgl-router` releases sent
//!   a low-match request to the worker with the smallest tree; the current policy uses the
//!   least loaded, which the baseline did not.)
//! - The prompt is inserted into the chosen worker's tree (in the imbalanced branch too).
//!
//! Defaults are the gateway's command-line ones (cache_threshold 0.3, balance_abs_threshold
//! 64, balance_rel_threshold 1.5, max_tree_size 2^26 characters); the library's
//! `CacheAwareConfig::default()` (0.5 / 32 / 1.1) applies only when the policy is built in code.
//!
//! Checked against `sgl-project/sglang` `sgl-model-gateway/src/policies/cache_aware.rs`
//! (`CacheAwarePolicy::select_worker`) at b93974f140de. Deviation kept: when several workers
//! share the longest match, SGLang's tree names one tenant of the deepest node; here the tie is
//! random.

use rand::rngs::StdRng;

use super::{Decision, InFlight, Router, View, argmin_random, leading};
use crate::BLOCK_TOKENS;
use crate::trace::Request;
use kvroute_engine_model::lru::KeyLru;

/// The policy's knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SglangConfig {
    /// Minimum match rate to follow the cache.
    pub cache_threshold: f64,
    /// Absolute load gap that may trigger balancing.
    pub balance_abs_threshold: u32,
    /// Relative load ratio that may trigger balancing.
    pub balance_rel_threshold: f64,
    /// Tree bound per worker, blocks (SGLang's `max_tree_size` 2^26 characters ≈ 2^24 tokens
    /// ≈ 32768 blocks of 512).
    pub max_tree_blocks: usize,
}

impl Default for SglangConfig {
    fn default() -> Self {
        SglangConfig {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            max_tree_blocks: 32_768,
        }
    }
}

/// The router.
#[derive(Debug)]
pub struct SglangApprox {
    config: SglangConfig,
    trees: Vec<KeyLru>,
    inflight: InFlight,
    rng: StdRng,
}

impl SglangApprox {
    /// For `replicas` workers.
    pub fn new(replicas: usize, config: SglangConfig, rng: StdRng) -> Self {
        SglangApprox {
            config,
            trees: (0..replicas)
                .map(|_| KeyLru::new(config.max_tree_blocks))
                .collect(),
            inflight: InFlight::new(replicas),
            rng,
        }
    }
}

impl Router for SglangApprox {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        let n = view.engines.len();
        let loads: Vec<u32> = (0..n).map(|i| self.inflight.get(i)).collect();
        let max = loads.iter().copied().max().unwrap_or(0);
        let min = loads.iter().copied().min().unwrap_or(0);
        let imbalanced = max - min > self.config.balance_abs_threshold
            && f64::from(max) > self.config.balance_rel_threshold * f64::from(min);
        let keys = request.keys();
        let matched: Vec<u32> = self
            .trees
            .iter()
            .map(|tree| leading(keys, |k| tree.contains(k)))
            .collect();
        let replica = if imbalanced {
            argmin_random(n, |i| f64::from(loads[i]), &mut self.rng)
        } else {
            let best = argmin_random(n, |i| -f64::from(matched[i]), &mut self.rng);
            let rate = best.map_or(0.0, |b| {
                f64::from(matched[b] * BLOCK_TOKENS) / f64::from(request.input_tokens)
            });
            if rate > self.config.cache_threshold {
                best
            } else {
                argmin_random(n, |i| f64::from(loads[i]), &mut self.rng)
            }
        }
        .unwrap_or(0);
        for key in keys {
            self.trees[replica].touch(*key);
        }
        self.inflight.add(replica);
        Decision {
            replica,
            predicted_blocks: Some(matched[replica]),
        }
    }

    fn on_finish(&mut self, replica: usize, _request: &Request, _now_us: u64) {
        self.inflight.remove(replica);
    }
}
