//! The TTFT-greedy oracle: for every replica, simulate exactly (a clone of its engine with the
//! request added, no later arrivals) when the request would get its first token; pick the
//! soonest, ties at random. Greedy, so not optimal over the whole trace, but it knows every
//! engine's exact state — a bound no real router can see.

use rand::rngs::StdRng;

use super::{Decision, Router, View, argmin_random};
use crate::trace::Request;

/// The router.
#[derive(Debug)]
pub struct TtftOracle {
    rng: StdRng,
}

impl TtftOracle {
    /// With its own RNG (ties).
    pub fn new(rng: StdRng) -> Self {
        TtftOracle { rng }
    }
}

impl Router for TtftOracle {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        let predictions: Vec<_> = view
            .engines
            .iter()
            .map(|engine| engine.predict(request, view.timing, view.now_us))
            .collect();
        let replica = argmin_random(
            predictions.len(),
            |i| predictions[i].map_or(f64::INFINITY, |p| p.ttft_us as f64),
            &mut self.rng,
        )
        .unwrap_or(0);
        Decision {
            replica,
            predicted_blocks: predictions[replica].map(|p| p.hit_blocks),
        }
    }
}
