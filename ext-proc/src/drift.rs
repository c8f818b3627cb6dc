//! Drift detection: do kvroute's predictions of cached prompt tokens still match what the engines
//! report hitting?
//!
//! kvroute predicts, for every request it routes with tokens (precise or approximate tier), how many
//! prompt tokens the chosen replica already has cached: the matched leading blocks × block size,
//! capped as vLLM caps a hit (`KVCacheManager.get_computed_blocks`: the last prompt token is always
//! recomputed, so at most `(prompt_len - 1) / block_size` full blocks hit; [`kvroute_routing::load::engine_hit_tokens`]).
//! If kvroute's tokens differ from the engine's (another chat template, tokenizer revision or
//! template kwarg default), those predictions stop matching silently: the index cannot confirm
//! kvroute's keys, and kvroute's own routing memory predicts reuse the engine does not find.
//!
//! **Sides.** Per replica, kvroute sums the predictions of the requests it routed there once they
//! are answered (their in-flight slot released: by then the engine has scheduled them, and counted
//! their hits). The engine side is the deltas of vLLM's `vllm:prefix_cache_hits_total` and
//! `vllm:prefix_cache_queries_total` (tokens; `PrefixCacheStats`, which leaves preempted requests
//! out) between two successful scrapes of its `/metrics`. A counter that goes down is an engine
//! restart: the delta is the new value (counted since the restart), never negative. kvroute's
//! side is read just before each scrape: a request counted there was answered, so the engine
//! counted its hits before the scrape reads them (vLLM updates its counters with the scheduler
//! step, before the response), and timing can make drift read low, not high.
//!
//! **Drift** over a sliding window (`drift.window`) of scrape samples, with `P` the predicted and
//! `H` the observed cached tokens in it:
//!
//! ```text
//! drift = max(0, P - H) / P        (0 when kvroute's predictions come true, 1 when none does)
//! ```
//!
//! No verdict is given until the window holds `drift.min_tokens` predicted cached tokens, so an
//! idle or low-traffic replica keeps its last verdict instead of flapping. A replica starts
//! drifting above `drift.bound` and stops at or below `drift.clear_below` (hysteresis).
//!
//! **Limits.** `H` counts every request the engine served, so hits kvroute did not predict only
//! lower the drift: other routers' or direct traffic, kvroute's own load-tier requests (no tokens,
//! no prediction) and engines batching siblings can hide drift, never create it. What raises drift
//! without a tokenization mismatch: blocks evicted between the decision and the engine scheduling
//! the request, speculative predictions for siblings the engine schedules before their shared
//! prefill finished, requests the engine refused after kvroute counted them, and a request at the
//! window's trailing edge whose hits fell in the sample before its prediction. On a busy replica
//! these are a few percent; a mismatch reads near 1. A mismatch that keeps kvroute's prefixes and
//! the engine's equally stable (say, another role marker) is not over-prediction: the index never
//! confirms kvroute's keys, so beyond `scoring.speculative_ttl` kvroute predicts nothing there,
//! and it shows as observed well above predicted. Under-prediction (the engine hits
//! more than predicted) is not drift here; the counters are exported for it. Several engines
//! behind one `/metrics` (label sets) are summed, so one of them restarting while the others
//! count on can go unnoticed as a reset and shorten one delta.

use std::collections::VecDeque;
use std::time::Instant;

use kvroute_routing::load::Prediction;

use crate::config::DriftConfig;

/// The engine's cumulative prefix-cache counters, as scraped.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineCounters {
    /// `vllm:prefix_cache_hits_total` (tokens).
    pub hits: f64,
    /// `vllm:prefix_cache_queries_total` (tokens).
    pub queries: f64,
}

/// One scrape interval's deltas.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    predicted_cached: u64,
    observed_hits: u64,
}

/// A state change of the drifting flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Drift went above `drift.bound`.
    Started,
    /// Drift fell to `drift.clear_below` or below.
    Cleared,
}

/// What one scrape taught about a replica.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Observation {
    /// Predicted cached and prompt tokens since the previous observation.
    pub predicted: Prediction,
    /// Engine hit tokens since the previous observation.
    pub observed_hits: u64,
    /// Engine queried tokens since the previous observation.
    pub observed_queries: u64,
    /// Whether an engine counter went down (a restart) since the previous observation.
    pub reset: bool,
    /// Predicted cached tokens in the window.
    pub window_predicted: u64,
    /// Engine hit tokens in the window.
    pub window_observed: u64,
    /// The window's drift, when it holds enough predicted tokens for a verdict.
    pub drift: Option<f64>,
    /// Whether the replica counts as drifting after this observation.
    pub drifting: bool,
    /// A change of `drifting`.
    pub transition: Option<Transition>,
}

/// One replica's drift window and verdict.
#[derive(Debug, Default)]
pub struct DriftWindow {
    samples: VecDeque<Sample>,
    /// Engine counters at the previous observation (`None` before the first: a baseline only).
    last_engine: Option<EngineCounters>,
    /// kvroute's cumulative prediction at the previous observation.
    last_predicted: Prediction,
    drifting: bool,
}

impl DriftWindow {
    /// Whether the last verdict said drifting (kept while there is too little traffic to judge).
    pub fn is_drifting(&self) -> bool {
        self.drifting
    }

    /// Records a scrape at `now` of the engine's counters, with kvroute's cumulative prediction
    /// for the replica (answered requests) at the same moment.
    pub fn observe(
        &mut self,
        now: Instant,
        engine: EngineCounters,
        predicted: Prediction,
        config: &DriftConfig,
    ) -> Observation {
        let since = Prediction {
            cached_tokens: predicted
                .cached_tokens
                .saturating_sub(self.last_predicted.cached_tokens),
            prompt_tokens: predicted
                .prompt_tokens
                .saturating_sub(self.last_predicted.prompt_tokens),
        };
        self.last_predicted = predicted;
        let Some(last) = self.last_engine.replace(engine) else {
            // The first scrape is a baseline: what came before it belongs to no window.
            return Observation {
                drifting: self.drifting,
                ..Observation::default()
            };
        };
        let (observed_hits, hits_reset) = counter_delta(last.hits, engine.hits);
        let (observed_queries, queries_reset) = counter_delta(last.queries, engine.queries);
        self.samples.push_back(Sample {
            at: now,
            predicted_cached: since.cached_tokens,
            observed_hits,
        });
        while self
            .samples
            .front()
            .is_some_and(|s| now.duration_since(s.at) >= config.window)
        {
            self.samples.pop_front();
        }
        let (predicted_sum, observed_sum) = self.samples.iter().fold((0u64, 0u64), |(p, h), s| {
            (
                p.saturating_add(s.predicted_cached),
                h.saturating_add(s.observed_hits),
            )
        });
        let drift = (predicted_sum > 0 && predicted_sum >= config.min_tokens)
            .then(|| drift_ratio(predicted_sum, observed_sum));
        let was = self.drifting;
        if let Some(drift) = drift {
            if !was && drift > config.bound {
                self.drifting = true;
            } else if was && drift <= config.clear_below {
                self.drifting = false;
            }
        }
        Observation {
            predicted: since,
            observed_hits,
            observed_queries,
            reset: hits_reset || queries_reset,
            window_predicted: predicted_sum,
            window_observed: observed_sum,
            drift,
            drifting: self.drifting,
            transition: match (was, self.drifting) {
                (false, true) => Some(Transition::Started),
                (true, false) => Some(Transition::Cleared),
                _ => None,
            },
        }
    }
}

/// The share of `predicted` cached tokens the engine did not report hitting (0..=1).
pub fn drift_ratio(predicted: u64, observed: u64) -> f64 {
    if predicted == 0 {
        return 0.0;
    }
    predicted.saturating_sub(observed) as f64 / predicted as f64
}

/// Growth of a cumulative counter from `before` to `now`, and whether it was reset: a counter
/// that went down restarted from zero, so all of `now` is new.
fn counter_delta(before: f64, now: f64) -> (u64, bool) {
    let tokens = |value: f64| {
        if value.is_finite() && value > 0.0 {
            value.round() as u64
        } else {
            0
        }
    };
    if now < before {
        (tokens(now), true)
    } else {
        (tokens(now).saturating_sub(tokens(before)), false)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::DriftAction;

    fn config() -> DriftConfig {
        DriftConfig {
            bound: 0.5,
            clear_below: 0.2,
            window: Duration::from_secs(60),
            min_tokens: 1000,
            action: DriftAction::Warn,
        }
    }

    /// Feeds cumulative (predicted cached, engine hits) pairs one second apart.
    struct Replay {
        window: DriftWindow,
        start: Instant,
        second: u64,
        predicted: u64,
        hits: f64,
        queries: f64,
        config: DriftConfig,
    }

    impl Replay {
        fn new(config: DriftConfig) -> Self {
            let mut replay = Self {
                window: DriftWindow::default(),
                start: Instant::now(),
                second: 0,
                predicted: 0,
                hits: 0.0,
                queries: 0.0,
                config,
            };
            replay.step(0, 0); // the baseline
            replay
        }

        /// One scrape after `predicted` more predicted and `hits` more observed tokens.
        fn step(&mut self, predicted: u64, hits: u64) -> Observation {
            self.predicted += predicted;
            self.hits += hits as f64;
            self.queries += (hits * 2) as f64;
            self.scrape()
        }

        fn scrape(&mut self) -> Observation {
            self.second += 1;
            self.window.observe(
                self.start + Duration::from_secs(self.second),
                EngineCounters {
                    hits: self.hits,
                    queries: self.queries,
                },
                Prediction {
                    cached_tokens: self.predicted,
                    prompt_tokens: self.predicted * 2,
                },
                &self.config,
            )
        }
    }

    #[test]
    fn matching_predictions_read_zero_and_over_prediction_reads_high() {
        let mut matching = Replay::new(config());
        let mut last = None;
        for _ in 0..10 {
            last = matching.step(300, 300).drift;
        }
        assert_eq!(last, Some(0.0));
        // Unpredicted hits (other traffic) never make drift negative.
        assert_eq!(matching.step(100, 900).drift, Some(0.0));

        let mut mismatched = Replay::new(config());
        for _ in 0..10 {
            mismatched.step(300, 30);
        }
        let observation = mismatched.step(300, 30);
        assert_eq!(observation.drift, Some(0.9));
        assert!(observation.drifting);
    }

    #[test]
    fn no_verdict_below_min_tokens() {
        let mut replay = Replay::new(config());
        // 900 predicted tokens, none hit: too little to judge.
        for _ in 0..9 {
            let observation = replay.step(100, 0);
            assert_eq!(observation.drift, None);
            assert!(!observation.drifting);
        }
        let observation = replay.step(100, 0);
        assert_eq!(observation.drift, Some(1.0));
        assert_eq!(observation.transition, Some(Transition::Started));
        // Idle afterwards: the window empties, the verdict stays.
        for _ in 0..120 {
            let observation = replay.scrape();
            assert!(observation.drifting);
            assert_eq!(observation.transition, None);
        }
        assert_eq!(replay.scrape().drift, None);
    }

    #[test]
    fn the_window_forgets_old_samples() {
        let mut replay = Replay::new(config());
        for _ in 0..30 {
            replay.step(100, 0);
        }
        assert_eq!(replay.window.samples.len(), 30);
        // 60 s later only matching samples are left.
        let mut last = None;
        for _ in 0..60 {
            last = replay.step(100, 100).drift;
        }
        assert_eq!(
            replay.window.samples.len(),
            60,
            "samples older than the window"
        );
        assert_eq!(last, Some(0.0));
        assert!(!replay.window.is_drifting());
    }

    #[test]
    fn hysteresis_holds_between_clear_below_and_bound() {
        let mut replay = Replay::new(DriftConfig {
            window: Duration::from_secs(10),
            ..config()
        });
        for _ in 0..10 {
            replay.step(200, 0);
        }
        assert!(replay.window.is_drifting());
        // Drift 0.3: under the bound, above clear_below: still drifting.
        for _ in 0..20 {
            let observation = replay.step(200, 140);
            assert!(observation.drifting, "{observation:?}");
        }
        // Drift 0.1: cleared, once.
        let mut transitions = Vec::new();
        for _ in 0..20 {
            transitions.extend(replay.step(200, 180).transition);
        }
        assert_eq!(transitions, vec![Transition::Cleared]);
        // Back to 0.3: not drifting again (needs > bound).
        for _ in 0..20 {
            assert!(!replay.step(200, 140).drifting);
        }
    }

    #[test]
    fn an_engine_restart_is_a_reset_not_negative_drift() {
        let mut replay = Replay::new(config());
        for _ in 0..10 {
            replay.step(200, 200);
        }
        // The engine restarts: its counters start again from zero and count 150 hits.
        replay.predicted += 200;
        replay.hits = 150.0;
        replay.queries = 300.0;
        let observation = replay.scrape();
        assert!(observation.reset);
        assert_eq!(observation.observed_hits, 150);
        assert_eq!(observation.observed_queries, 300);
        // 2200 predicted, 2150 hit.
        let drift = observation.drift.unwrap();
        assert!((drift - 50.0 / 2200.0).abs() < 1e-9, "{drift}");
        // Counting on from the new baseline.
        let observation = replay.step(200, 200);
        assert!(!observation.reset);
        assert_eq!(observation.observed_hits, 200);
    }

    #[test]
    fn the_first_scrape_is_a_baseline() {
        let mut window = DriftWindow::default();
        let now = Instant::now();
        // Whatever the engine counted before kvroute started belongs to no window.
        let first = window.observe(
            now,
            EngineCounters {
                hits: 1e6,
                queries: 2e6,
            },
            Prediction {
                cached_tokens: 5000,
                prompt_tokens: 9000,
            },
            &config(),
        );
        assert_eq!(first.drift, None);
        assert_eq!(first.observed_hits, 0);
        let second = window.observe(
            now + Duration::from_secs(1),
            EngineCounters {
                hits: 1e6 + 1200.0,
                queries: 2e6 + 2000.0,
            },
            Prediction {
                cached_tokens: 6200,
                prompt_tokens: 11000,
            },
            &config(),
        );
        assert_eq!(second.observed_hits, 1200);
        assert_eq!(
            second.predicted,
            Prediction {
                cached_tokens: 1200,
                prompt_tokens: 2000
            }
        );
        assert_eq!(second.drift, Some(0.0));
    }

    #[test]
    fn counter_deltas() {
        assert_eq!(counter_delta(10.0, 25.0), (15, false));
        assert_eq!(counter_delta(25.0, 25.0), (0, false));
        assert_eq!(counter_delta(25.0, 7.0), (7, true));
        assert_eq!(counter_delta(0.0, f64::INFINITY), (0, false));
        assert_eq!(drift_ratio(0, 5), 0.0);
        assert_eq!(drift_ratio(4, 1), 0.75);
    }
}
