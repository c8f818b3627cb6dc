//! llm-d's inference scheduler with the precise prefix-cache scorer.
//!
//! Score = 2·prefix + 1·kv + 1·queue (the precise-prefix-cache-aware guide's scheduling
//! profile); `max-score-picker`: highest wins, ties random:
//! - prefix: each pod's longest run of the prompt's leading blocks in its KV-event index
//!   (`computeScoresFromKeyToPods`), min-max normalised over the pods that matched at least
//!   one block (`indexedScoresToNormalizedScoredPods`: `(s − min) / (max − min)`, 1 when all
//!   matched pods tie); a pod that matched nothing scores 0. So one matched block against none
//!   scores as high as a full hit: the scorer ranks, it does not weigh how much is saved.
//! - queue: waiting requests, min-max normalised and inverted (`(max − q) / (max − min)`,
//!   all 1 when equal), as the GIE queue scorer;
//! - kv: `1 − KV-cache usage` (the kv-cache-utilization scorer).
//!
//! Metrics are scraped every 50 ms (GIE's `refresh-metrics-interval` default). The index is
//! fed by the engines' KV events after the configured delay. With speculative indexing
//! (`speculativeIndexing: true`) the chosen pod is credited with the prompt's blocks at once
//! (`PreRequest`), for the speculative TTL (default 30 s) or until events confirm them.
//!
//! Checked against `llm-d/llm-d-inference-scheduler` `pkg/plugins/scorer/precise_prefix_cache.go`
//! at 17abea8af978 (scoring, speculative TTL) and `pkg/plugins/scorer/utils.go` at 2202f3ca5437
//! (normalisation); `llm-d/llm-d` `guides/precise-prefix-cache-aware/scheduler/
//! precise-prefix-cache-aware.values.yaml` at 019a3f3fb1c1 (weights); the GIE queue scorer
//! (`pkg/epp/scheduling/framework/plugins/scorer/queue.go`) and its refresh flag. Before this
//! check the baseline weighted 3/2/2, scored prefix as matched / prompt blocks (unnormalised)
//! and kept speculative entries 2 s.

use std::collections::HashMap;

use kvroute_index_core::event::KvEvent;
use rand::rngs::StdRng;

use super::{Decision, EventIndex, Router, View, argmin_random, leading};
use crate::trace::Request;

/// Scorer weights: prefix, queue, KV usage.
const WEIGHTS: (f64, f64, f64) = (2.0, 1.0, 1.0);
/// Metrics refresh interval.
const SCRAPE_US: u64 = 50_000;
/// Lifetime of a speculative entry (`defaultSpeculativeTTL`).
const SPECULATIVE_TTL_US: u64 = 30_000_000;

/// Scraped pod metrics.
#[derive(Debug, Clone, Copy, Default)]
struct PodMetrics {
    waiting: f64,
    kv_usage: f64,
}

/// The router.
#[derive(Debug)]
pub struct LlmdPrecise {
    /// Block key → pods holding it (bit per pod; up to 64 pods).
    index: EventIndex,
    /// Per pod, speculative key → expiry (µs).
    speculative: Option<Vec<HashMap<u64, u64>>>,
    metrics: Vec<PodMetrics>,
    rng: StdRng,
}

impl LlmdPrecise {
    /// For `replicas` pods (at most 64).
    pub fn new(replicas: usize, speculative: bool, rng: StdRng) -> Self {
        LlmdPrecise {
            index: EventIndex::default(),
            speculative: speculative.then(|| vec![HashMap::new(); replicas]),
            metrics: vec![PodMetrics::default(); replicas],
            rng,
        }
    }
}

/// llm-d's prefix normalisation: min-max over the pods that matched a block, 0 for the rest.
fn normalized_prefix(matched: &[u32]) -> Vec<f64> {
    let scored = matched.iter().copied().filter(|m| *m > 0);
    let max = scored.clone().max().unwrap_or(0);
    let min = scored.min().unwrap_or(0);
    matched
        .iter()
        .map(|m| {
            if *m == 0 {
                0.0
            } else if max == min {
                1.0
            } else {
                f64::from(m - min) / f64::from(max - min)
            }
        })
        .collect()
}

/// Inverted min-max normalisation to 0..1: the lowest value scores 1 (all 1 when equal).
fn inverted_min_max(values: &[f64]) -> Vec<f64> {
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    values
        .iter()
        .map(|v| {
            if max - min <= f64::EPSILON {
                1.0
            } else {
                (max - v) / (max - min)
            }
        })
        .collect()
}

impl Router for LlmdPrecise {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        let all: Vec<usize> = (0..view.engines.len()).collect();
        self.route_among(request, view.now_us, &all)
    }

    fn on_kv_events(&mut self, replica: usize, events: &[KvEvent], _now_us: u64) {
        self.index.apply(replica, events);
    }

    fn tick_interval_us(&self) -> Option<u64> {
        Some(SCRAPE_US)
    }

    fn on_tick(&mut self, view: &View<'_>) {
        for (metrics, engine) in self.metrics.iter_mut().zip(view.engines) {
            *metrics = PodMetrics {
                waiting: engine.waiting() as f64,
                kv_usage: engine.kv_usage(),
            };
        }
    }
}

impl LlmdPrecise {
    /// One scheduling profile over the pods `pool` (its role filter's survivors): scores
    /// normalised over those pods only, as the profile's scorers see them.
    pub(crate) fn route_among(&mut self, request: &Request, now: u64, pool: &[usize]) -> Decision {
        let n = pool.len();
        let keys = request.keys();
        let matched: Vec<u32> = pool
            .iter()
            .map(|&pod| {
                let spec = self.speculative.as_ref().map(|s| &s[pod]);
                leading(keys, |k| {
                    self.index.holds(pod, k)
                        || spec.is_some_and(|s| s.get(&k).is_some_and(|exp| *exp > now))
                })
            })
            .collect();
        let prefix = normalized_prefix(&matched);
        let queue = inverted_min_max(
            &pool
                .iter()
                .map(|p| self.metrics[*p].waiting)
                .collect::<Vec<_>>(),
        );
        let (wp, wq, wk) = WEIGHTS;
        let metrics = &self.metrics;
        let choice = argmin_random(
            n,
            |i| -(wp * prefix[i] + wq * queue[i] + wk * (1.0 - metrics[pool[i]].kv_usage)),
            &mut self.rng,
        )
        .unwrap_or(0);
        let chosen = pool.get(choice).copied().unwrap_or(0);
        if let Some(spec) = &mut self.speculative {
            let entries = &mut spec[chosen];
            entries.retain(|_, exp| *exp > now);
            for key in keys {
                entries.insert(*key, now + SPECULATIVE_TTL_US);
            }
        }
        Decision {
            replica: chosen,
            predicted_blocks: matched.get(choice).copied(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_scores_rank_matched_pods_and_zero_the_rest() {
        assert_eq!(normalized_prefix(&[0, 3, 7, 5]), [0.0, 0.0, 1.0, 0.5]);
        assert_eq!(normalized_prefix(&[0, 1, 0]), [0.0, 1.0, 0.0]);
        assert_eq!(normalized_prefix(&[2, 2]), [1.0, 1.0]);
        assert_eq!(normalized_prefix(&[0, 0]), [0.0, 0.0]);
    }
}
