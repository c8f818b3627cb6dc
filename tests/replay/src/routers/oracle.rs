//! The TTFT-greedy oracle: for every replica, simulate exactly (a clone of its engine with the
//! request added, no later arrivals) when the request would get its first token; pick the
//! soonest, ties at random. Greedy, so not optimal over the whole trace, but it knows every
//! engine's exact state — a bound no real router can see.
//!
//! Replicas are simulated least-loaded first, and each only until it is later than the best
//! found so far (plus the tie tolerance of [`argmin_random`]): past that it can neither win nor
//! tie, so it scores as never served. The choice, the tie set and the random draw are the
//! same as simulating every queue to the end; the overloaded replicas' long queues, which
//! dominated the oracle's run time, are no longer simulated.

use rand::rngs::StdRng;

use super::{Decision, Router, View, argmin_random};
use crate::engine::Prediction;
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

/// The largest TTFT (µs) that still ties with `best` under [`argmin_random`]'s tolerance.
fn tie_limit_us(best: u64) -> u64 {
    let best = best as f64;
    // One µs of slack over the tolerance: a cut must never drop a tie to float rounding.
    (best + 1e-9 * best.max(1.0)).ceil() as u64 + 1
}

impl Router for TtftOracle {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        let n = view.engines.len();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| {
            let engine = &view.engines[i];
            (
                engine.waiting(),
                engine.step_end_us().unwrap_or(0),
                engine.running(),
            )
        });
        let mut predictions: Vec<Option<Prediction>> = vec![None; n];
        let mut best: Option<u64> = None;
        for i in order {
            let limit = best.map_or(u64::MAX, tie_limit_us);
            let prediction =
                view.engines[i].predict_within(request, view.timing, view.now_us, limit);
            if let Some(p) = prediction {
                best = Some(best.map_or(p.ttft_us, |b| b.min(p.ttft_us)));
            }
            predictions[i] = prediction;
        }
        let replica = argmin_random(
            n,
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

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;
    use crate::sim::{self, SimConfig};
    use crate::trace;
    use crate::workload::{self, Kind};

    /// The oracle as it was: every replica simulated to the request's first token.
    struct Exhaustive {
        rng: StdRng,
    }

    impl Router for Exhaustive {
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

    #[test]
    fn cutting_losing_queues_short_changes_no_decision() {
        // Bursts of siblings, compressed until queues build up: ties between idle replicas,
        // close races and long losing queues all occur.
        let records = workload::generate(Kind::FanOut, 3);
        let requests = trace::compress(&trace::prepare_all(&records[..500]).unwrap(), 6.0);
        let config = SimConfig::default();
        let fast = sim::run(
            &requests,
            &config,
            &mut TtftOracle::new(StdRng::seed_from_u64(5)),
        )
        .unwrap();
        let slow = sim::run(
            &requests,
            &config,
            &mut Exhaustive {
                rng: StdRng::seed_from_u64(5),
            },
        )
        .unwrap();
        assert_eq!(fast, slow);
    }
}
