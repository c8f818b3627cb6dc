//! NVIDIA Dynamo's KV router (`KvScheduler` cost function, temperature 0).
//!
//! ```text
//! logit = overlap_weight · potential_prefill_blocks + potential_decode_blocks   (lowest wins)
//! potential_prefill_blocks = (prompt tokens − overlap blocks · block size) / block size
//! potential_decode_blocks  = the worker's active blocks + this request's blocks not already active
//! ```
//!
//! Overlap comes from the router's index of the engines' KV events (after the configured delay).
//! Active blocks are tracked by the router itself: each routed request's prompt blocks are
//! added (shared prefix blocks counted once per worker) and removed when it finishes. Ties are
//! broken at random. Dynamo's default overlap weight is 1.

use std::collections::HashMap;

use kvroute_index::event::KvEvent;
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
    rng: StdRng,
}

impl DynamoCost {
    /// For `replicas` workers (at most 64) and this overlap weight.
    pub fn new(replicas: usize, overlap_weight: f64, rng: StdRng) -> Self {
        DynamoCost {
            overlap_weight,
            index: EventIndex::default(),
            active: vec![Active::default(); replicas],
            rng,
        }
    }
}

fn anonymous_blocks(request: &Request) -> u64 {
    (request.chain.len() - request.full_blocks) as u64
}

impl Router for DynamoCost {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        let n = view.engines.len();
        let keys = request.keys();
        let overlap: Vec<u32> = (0..n)
            .map(|w| leading(keys, |k| self.index.holds(w, k)))
            .collect();
        let cost = |w: usize| {
            let active = &self.active[w];
            let uncached = request
                .input_tokens
                .saturating_sub(overlap[w] * BLOCK_TOKENS);
            let prefill_blocks = f64::from(uncached) / f64::from(BLOCK_TOKENS);
            let new_blocks = keys
                .iter()
                .filter(|k| !active.keyed.contains_key(k))
                .count() as u64
                + anonymous_blocks(request);
            self.overlap_weight * prefill_blocks + (active.blocks() + new_blocks) as f64
        };
        let costs: Vec<f64> = (0..n).map(cost).collect();
        let replica = argmin_random(n, |w| costs[w], &mut self.rng).unwrap_or(0);
        let active = &mut self.active[replica];
        for key in keys {
            *active.keyed.entry(*key).or_insert(0) += 1;
        }
        active.anonymous += anonymous_blocks(request);
        Decision {
            replica,
            predicted_blocks: Some(overlap[replica]),
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
