//! Where a router's decisions err: for every decision, the time to first token an exact
//! simulation of each replica gives (the oracle's view: the engines' state, no later arrivals),
//! set against the soonest one. A decision is *off* when its replica's first token comes more
//! than [`OFF_BY`] later than the soonest; it is then classed by the prefix it reuses against
//! the replicas that would have been that fast: more (it stayed with a cached prefix when a
//! replica holding less was faster), less (it left a cached prefix that was faster), or the
//! same (it misjudged the queues alone).
//!
//! The comparison is greedy, as the oracle is: a decision that costs this request time may
//! still serve later ones (a prefix kept where the next turn will look for it), so a router
//! with more regret is not always the worse one. It says which way an estimate errs, not by how
//! much a run's tail moves.

use super::{Decision, View};
use crate::engine::Prediction;
use crate::trace::Request;

/// A replica within this share of the soonest first token counts as as fast.
pub const OFF_BY: f64 = 0.05;

/// Decisions of one class and the time they cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Off {
    /// How many.
    pub decisions: usize,
    /// Their first tokens' delay past the soonest, summed, µs.
    pub regret_us: u64,
}

impl Off {
    fn add(&mut self, regret_us: u64) {
        self.decisions += 1;
        self.regret_us += regret_us;
    }

    /// Mean delay past the soonest, ms (0 without decisions).
    pub fn mean_ms(&self) -> f64 {
        if self.decisions == 0 {
            0.0
        } else {
            self.regret_us as f64 / self.decisions as f64 / 1e3
        }
    }
}

/// What [`Regret`] found over the measured decisions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegretStats {
    /// Decisions measured (past the warm-up, on a replica that serves the request).
    pub decisions: usize,
    /// All of them: the total delay past the soonest first token.
    pub all: Off,
    /// Off, on a replica reusing more of the prompt than every as-fast replica.
    pub more_cached: Off,
    /// Off, on a replica reusing less of the prompt than every as-fast replica.
    pub less_cached: Off,
    /// Off otherwise.
    pub same_cached: Off,
}

impl RegretStats {
    /// Adds another run's.
    pub fn add(&mut self, other: &RegretStats) {
        self.decisions += other.decisions;
        for (mine, theirs) in [
            (&mut self.all, other.all),
            (&mut self.more_cached, other.more_cached),
            (&mut self.less_cached, other.less_cached),
            (&mut self.same_cached, other.same_cached),
        ] {
            mine.decisions += theirs.decisions;
            mine.regret_us += theirs.regret_us;
        }
    }

    /// Decisions within [`OFF_BY`] of the soonest first token.
    pub fn within(&self) -> usize {
        self.decisions
            - self.more_cached.decisions
            - self.less_cached.decisions
            - self.same_cached.decisions
    }
}

/// Measures decisions against the exact simulation of every replica: shown each decision of the
/// router under study (wrap it in [`super::Observed`]).
#[derive(Debug)]
pub struct Regret {
    /// Requests with a lower id are warm-up.
    skip: usize,
    stats: RegretStats,
}

impl Regret {
    /// Measures decisions for requests from id `skip` on.
    pub fn new(skip: usize) -> Self {
        Regret {
            skip,
            stats: RegretStats::default(),
        }
    }

    /// What was found so far.
    pub fn stats(&self) -> RegretStats {
        self.stats
    }

    /// `decision` was made for `request` on `view`.
    pub fn observe(&mut self, request: &Request, view: &View<'_>, decision: &Decision) {
        if request.id < self.skip {
            return;
        }
        let predictions: Vec<Option<Prediction>> = view
            .engines
            .iter()
            .map(|engine| engine.predict(request, view.timing, view.now_us))
            .collect();
        self.measure(&predictions, decision.replica);
    }

    fn measure(&mut self, predictions: &[Option<Prediction>], chosen: usize) {
        let Some(chosen) = predictions.get(chosen).copied().flatten() else {
            return;
        };
        let Some(soonest) = predictions.iter().flatten().map(|p| p.ttft_us).min() else {
            return;
        };
        let as_fast = |p: &Prediction| p.ttft_us as f64 <= soonest as f64 * (1.0 + OFF_BY);
        let regret_us = chosen.ttft_us - soonest;
        self.stats.decisions += 1;
        self.stats.all.add(regret_us);
        if as_fast(&chosen) {
            return;
        }
        let fast_hits = predictions
            .iter()
            .flatten()
            .filter(|p| as_fast(p))
            .map(|p| p.hit_blocks);
        let most = fast_hits.clone().max().unwrap_or(0);
        let least = fast_hits.min().unwrap_or(0);
        let class = if chosen.hit_blocks > most {
            &mut self.stats.more_cached
        } else if chosen.hit_blocks < least {
            &mut self.stats.less_cached
        } else {
            &mut self.stats.same_cached
        };
        class.add(regret_us);
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::routers::{Observed, Router, TtftOracle};
    use crate::sim::{self, SimConfig};
    use crate::trace;
    use crate::workload::{self, Kind};

    /// Every request to the first replica: the others idle while it queues.
    struct First;

    impl Router for First {
        fn route(&mut self, _request: &Request, _view: &View<'_>) -> Decision {
            Decision::to(0)
        }
    }

    fn measured(router: Box<dyn Router>) -> RegretStats {
        let records = workload::generate(Kind::FanOut, 3);
        let requests = trace::compress(&trace::prepare_all(&records[..300]).unwrap(), 4.0);
        let config = SimConfig::default();
        let mut regret = Regret::new(30);
        let mut observed = Observed::new(router, |request, view, decision| {
            regret.observe(request, view, decision)
        });
        sim::run(&requests, &config, &mut observed).unwrap();
        drop(observed);
        regret.stats()
    }

    #[test]
    fn the_oracle_has_none_and_a_pile_up_is_classed() {
        let oracle = measured(Box::new(TtftOracle::new(StdRng::seed_from_u64(1))));
        assert_eq!(oracle.decisions, 270);
        assert_eq!((oracle.within(), oracle.all.regret_us), (270, 0));

        // Sending everything to one replica: many decisions are off (a quarter here: bursts
        // queue there while the others idle), their delay is counted in the total, and each
        // off one is in exactly one class.
        let first = measured(Box::new(First));
        assert_eq!(first.decisions, 270);
        let off =
            first.more_cached.decisions + first.less_cached.decisions + first.same_cached.decisions;
        assert!(off >= 50, "{first:?}");
        assert_eq!(first.within() + off, first.decisions);
        let classed =
            first.more_cached.regret_us + first.less_cached.regret_us + first.same_cached.regret_us;
        assert!(classed > 0 && classed <= first.all.regret_us, "{first:?}");
        // Its one replica holds every context: what it gets wrong is staying with the cache.
        assert!(
            first.more_cached.decisions > first.less_cached.decisions,
            "{first:?}"
        );
    }
}
