//! NVIDIA Dynamo's KV router (the default worker selector's cost, temperature 0).
//!
//! ```text
//! logit = w · potential_prefill_blocks + potential_decode_blocks                  (lowest wins)
//! potential_prefill_blocks = (active prefill tokens + prompt tokens − overlap blocks · block size)
//!                            / block size
//! potential_decode_blocks  = the worker's active blocks + this request's blocks not already active
//! ```
//!
//! - **Active prefill tokens** (`potential_prefill_tokens` in `sequences/`): each request routed
//!   to the worker adds its uncached tokens at routing time; they leave when its prefill
//!   completes (Dynamo's `mark_prefill_completed`, at the first token). Without an AIC perf model
//!   Dynamo does not decay them over time (`PrefillLoadSnapshot::active_tokens_at` subtracts
//!   nothing when a prefill has no expected duration), so neither does this.
//! - Overlap comes from the router's index of the engines' KV events (after the configured
//!   delay). Active blocks are tracked by the router itself: each routed request's prompt blocks
//!   are added (shared prefix blocks counted once per worker) and removed when it finishes.
//! - `w` is `prefill_load_scale` in the current selector and `overlap_score_weight` in releases
//!   (both default 1); the overlap credit (`overlap_score_credit`, default 1, in [0, 1]) is 1 and
//!   its decay off (default 0). Host/disk tiers and the per-request active-request term
//!   (`decode_active_request_weight`, default 0) do not apply here. Ties are broken at random,
//!   as `minimum_cost_index` does.
//!
//! Checked against `ai-dynamo/dynamo`: `lib/kv-router/src/scheduling/selector/default.rs`
//! (`DefaultWorkerScorer::worker_logit`) at 07a6c9ce3bb0, the `raw_prefill_blocks` assembly in
//! `scheduling/selector/` (`active_prefill_tokens + uncached + cached`), and
//! `lib/kv-router/src/sequences/prefill_tracker.rs` at 0b6b9200b004. The previous baseline
//! charged only the new request's uncached tokens, leaving out the queued prefill.

use std::collections::HashMap;

use kvroute_index_core::event::KvEvent;
use rand::rngs::StdRng;

use super::{Decision, EventIndex, Router, View, argmin_random, leading};
use crate::BLOCK_TOKENS;
use crate::trace::Request;

/// One worker's active blocks.
#[derive(Debug, Clone, Default)]
struct Active {
    /// Shared-able (keyed) blocks → requests using them.
    keyed: HashMap<u64, u32>,
    /// Unkeyed blocks (partial last blocks), per request.
    anonymous: u64,
}

impl Active {
    fn blocks(&self) -> u64 {
        self.keyed.len() as u64 + self.anonymous
    }
}

/// The router.
#[derive(Debug)]
pub struct DynamoCost {
    overlap_weight: f64,
    index: EventIndex,
    active: Vec<Active>,
    /// Per worker, uncached tokens of the requests routed there whose prefill has not completed.
    prefill_tokens: Vec<u64>,
    /// Request id → (worker, its uncached tokens at routing), until its first token.
    prefilling: HashMap<usize, (usize, u64)>,
    rng: StdRng,
}

impl DynamoCost {
    /// For `replicas` workers (at most 64) and this overlap weight.
    pub fn new(replicas: usize, overlap_weight: f64, rng: StdRng) -> Self {
        DynamoCost {
            overlap_weight,
            index: EventIndex::default(),
            active: vec![Active::default(); replicas],
            prefill_tokens: vec![0; replicas],
            prefilling: HashMap::new(),
            rng,
        }
    }
}

fn anonymous_blocks(request: &Request) -> u64 {
    (request.chain.len() - request.full_blocks) as u64
}

impl Router for DynamoCost {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        let all: Vec<usize> = (0..view.engines.len()).collect();
        self.route_among(request, &all)
    }

    fn on_first_token(&mut self, _replica: usize, request: &Request, _now_us: u64) {
        if let Some((worker, tokens)) = self.prefilling.remove(&request.id)
            && let Some(pending) = self.prefill_tokens.get_mut(worker)
        {
            *pending = pending.saturating_sub(tokens);
        }
    }

    fn on_finish(&mut self, replica: usize, request: &Request, _now_us: u64) {
        let Some(active) = self.active.get_mut(replica) else {
            return;
        };
        for key in request.keys() {
            if let Some(count) = active.keyed.get_mut(key) {
                *count -= 1;
                if *count == 0 {
                    active.keyed.remove(key);
                }
            }
        }
        active.anonymous = active.anonymous.saturating_sub(anonymous_blocks(request));
    }

    fn on_kv_events(&mut self, replica: usize, events: &[KvEvent], _now_us: u64) {
        self.index.apply(replica, events);
    }
}

impl DynamoCost {
    /// The selector over the workers `pool` (one worker type's instances).
    pub(crate) fn route_among(&mut self, request: &Request, pool: &[usize]) -> Decision {
        let n = pool.len();
        let keys = request.keys();
        let overlap: Vec<u32> = (0..self.active.len())
            .map(|w| {
                if pool.contains(&w) {
                    leading(keys, |k| self.index.holds(w, k))
                } else {
                    0
                }
            })
            .collect();
        let uncached = |w: usize| {
            request
                .input_tokens
                .saturating_sub(overlap[w] * BLOCK_TOKENS)
        };
        let cost = |w: usize| {
            let active = &self.active[w];
            let prefill_tokens = self.prefill_tokens[w] as f64 + f64::from(uncached(w));
            let prefill_blocks = prefill_tokens / f64::from(BLOCK_TOKENS);
            let new_blocks = keys
                .iter()
                .filter(|k| !active.keyed.contains_key(k))
                .count() as u64
                + anonymous_blocks(request);
            self.overlap_weight * prefill_blocks + (active.blocks() + new_blocks) as f64
        };
        let costs: Vec<f64> = pool.iter().map(|w| cost(*w)).collect();
        let choice = argmin_random(n, |i| costs[i], &mut self.rng).unwrap_or(0);
        let replica = pool.get(choice).copied().unwrap_or(0);
        let active = &mut self.active[replica];
        for key in keys {
            *active.keyed.entry(*key).or_insert(0) += 1;
        }
        active.anonymous += anonymous_blocks(request);
        let tokens = u64::from(uncached(replica));
        self.prefill_tokens[replica] += tokens;
        self.prefilling.insert(request.id, (replica, tokens));
        Decision {
            replica,
            predicted_blocks: Some(overlap[replica]),
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;
    use crate::engine::{Engine, EngineConfig};
    use crate::timing::MockerFit;
    use crate::trace::{TraceRecord, prepare};

    fn request(id: usize, first_id: u64) -> Request {
        let record = TraceRecord {
            timestamp: 0,
            input_length: 8 * BLOCK_TOKENS,
            output_length: 10,
            hash_ids: (first_id..first_id + 8).collect(),
            session_id: None,
        };
        prepare(id, &record).unwrap()
    }

    #[test]
    fn queued_prefill_counts_until_the_first_token() {
        let engines = vec![Engine::new(EngineConfig::default()); 2];
        let timing = MockerFit::default();
        let view = View {
            now_us: 0,
            engines: &engines,
            requests: &[],
            timing: &timing,
            prefill_replicas: 0,
        };
        for seed in 0..16 {
            let mut router = DynamoCost::new(2, 1.0, StdRng::seed_from_u64(seed));
            let a = request(0, 100);
            let x = router.route(&a, &view).replica;
            router.on_first_token(x, &a, 1);
            // Both workers now hold 8 active blocks; only the new one still has them to prefill.
            let b = router.route(&request(1, 200), &view).replica;
            assert_ne!(b, x, "a worker with active blocks loses to an idle one");
            let c = router.route(&request(2, 300), &view).replica;
            assert_eq!(c, x, "seed {seed}: the worker still prefilling costs more");
        }
    }
}
