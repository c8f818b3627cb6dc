//! llm-d's inference scheduler with the precise prefix-cache scorer.
//!
//! Score = 3·prefix + 2·queue + 2·kv (the "precise prefix cache" profile's weights); highest
//! wins, ties random:
//! - prefix: the share of the prompt's blocks each pod holds as a leading run, per its
//!   KV-event index (matched blocks / prompt blocks, as llm-d's prefix scorers);
//! - queue: waiting requests, min-max normalised and inverted (`(max − q) / (max − min)`,
//!   all 1 when equal), as the GIE queue scorer;
//! - kv: `1 − KV-cache usage`.
//!
//! Metrics are scraped every 50 ms (GIE's default refresh). The index is fed by the engines'
//! KV events after the configured delay. With speculative indexing the chosen pod is credited
//! with the prompt's blocks at once, for `SPECULATIVE_TTL_US` or until events confirm them.

use std::collections::HashMap;

use kvroute_index::event::KvEvent;
use rand::rngs::StdRng;

use super::{Decision, EventIndex, Router, View, argmin_random, leading};
use crate::trace::Request;

/// Scorer weights: prefix, queue, KV usage.
const WEIGHTS: (f64, f64, f64) = (3.0, 2.0, 2.0);
/// Metrics refresh interval.
const SCRAPE_US: u64 = 50_000;
/// Lifetime of a speculative entry.
const SPECULATIVE_TTL_US: u64 = 2_000_000;

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
        let n = view.engines.len();
        let now = view.now_us;
        let keys = request.keys();
        let matched: Vec<u32> = (0..n)
            .map(|pod| {
                let spec = self.speculative.as_ref().map(|s| &s[pod]);
                leading(keys, |k| {
                    self.index.holds(pod, k)
                        || spec.is_some_and(|s| s.get(&k).is_some_and(|exp| *exp > now))
                })
            })
            .collect();
        let blocks = request.chain.len().max(1) as f64;
        let prefix: Vec<f64> = matched.iter().map(|m| f64::from(*m) / blocks).collect();
        let queue = inverted_min_max(&self.metrics.iter().map(|m| m.waiting).collect::<Vec<_>>());
        let (wp, wq, wk) = WEIGHTS;
        let metrics = &self.metrics;
        let replica = argmin_random(
            n,
            |i| -(wp * prefix[i] + wq * queue[i] + wk * (1.0 - metrics[i].kv_usage)),
            &mut self.rng,
        )
        .unwrap_or(0);
        if let Some(spec) = &mut self.speculative {
            let entries = &mut spec[replica];
            entries.retain(|_, exp| *exp > now);
            for key in keys {
                entries.insert(*key, now + SPECULATIVE_TTL_US);
            }
        }
        Decision {
            replica,
            predicted_blocks: Some(matched[replica]),
        }
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
