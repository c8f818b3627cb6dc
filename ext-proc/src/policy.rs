//! The default scoring policy: estimated time to first token (TTFT), lowest wins.
//!
//! For each candidate replica:
//!
//! ```text
//! queue_ms = queue_ms_per_request   × (waiting + routed_since_scrape)
//!          + running_ms_per_request × running
//!          + prefill_ms_per_token   × in-flight prompt tokens
//!          + kv_usage_ms            × kv_usage
//! ttft_ms  = queue_ms − prefill_ms_per_token × in-flight prompt tokens it shares
//!          + prefill_ms_per_token × uncached prompt tokens
//! ```
//!
//! A burst of siblings (requests sharing a long prefix, sent at once): the first one's prefill of
//! the prefix is in flight on its replica, and a sibling sent there joins that prefill rather than
//! waiting for it (the engine batches them), so the shared part is not queueing for it. Without
//! that credit a sibling would see the same cost either way (wait for the prefix there, or compute
//! it elsewhere) and the burst would spread, computing the prefix once per replica. With it, the
//! siblings co-locate until the running batch itself costs more than a fresh prefill elsewhere
//! (`running_ms_per_request × siblings ≈ prefill_ms_per_token × prefix tokens`).
//!
//! Hotspot guard: a replica whose `queue_ms` (its whole load, credit not subtracted) exceeds the
//! candidates' mean by `hotspot_factor` and is above `hotspot_min_ms` is skipped, unless every
//! candidate is. When the other replicas are idle the factor always holds, so `hotspot_min_ms`
//! is the load at which a burst starts to spill: the default 200 ms is about 4 waiting requests or
//! 40 running ones, above what a 16-sibling burst of a few thousand tokens adds (so it co-locates)
//! and below a melting replica. Equal scores are broken at random so identical replicas share work.

use rand::Rng;

use crate::config::ScoringConfig;
use crate::load::LoadSnapshot;

/// Scores within this many milliseconds count as equal.
const TIE_EPSILON_MS: f64 = 1e-6;

/// One candidate as the policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    /// Leading prompt blocks believed cached there.
    pub matched_blocks: u32,
    /// Prompt tokens of this request whose prefill is already in flight there (a sibling's).
    pub shared_inflight_tokens: usize,
    /// Current load.
    pub load: LoadSnapshot,
}

/// Why the chosen replica won (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// It holds the longest cached prefix.
    CacheHit,
    /// No candidate holds any of the prompt.
    NoCacheMatch,
    /// A replica with a longer prefix was slower overall (queueing outweighed the saved prefill).
    LoadOverCache,
    /// The replica with the longest prefix was skipped as a hotspot.
    HotspotGuard,
}

impl Reason {
    /// Metric label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::CacheHit => "cache_hit",
            Self::NoCacheMatch => "no_cache_match",
            Self::LoadOverCache => "load_over_cache",
            Self::HotspotGuard => "hotspot_guard",
        }
    }
}

/// The policy's answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// Index into the candidates.
    pub index: usize,
    /// Why.
    pub reason: Reason,
    /// Estimated TTFT of the winner, ms.
    pub ttft_ms: f64,
}

/// Queueing estimate of a replica, in ms.
///
/// Requests routed since the last scrape join the running batch unless that scrape showed the
/// engine saturated (requests waiting): only then do they queue. (Counting every one as queued
/// would scatter a burst of siblings instead of batching them where their prefix is cached.)
pub fn queue_ms(load: &LoadSnapshot, weights: &ScoringConfig) -> f64 {
    let (unseen_waiting, unseen_running) = if load.scraped.waiting > 0.0 {
        (load.routed_since_scrape, 0.0)
    } else {
        (0.0, load.routed_since_scrape)
    };
    weights.queue_ms_per_request * (load.scraped.waiting + unseen_waiting)
        + weights.running_ms_per_request * (load.scraped.running + unseen_running)
        + weights.prefill_ms_per_token * load.inflight_prompt_tokens
        + weights.kv_usage_ms * load.scraped.kv_usage
}

/// Picks the candidate with the lowest estimated TTFT. `None` only when `candidates` is empty.
pub fn choose(
    candidates: &[Candidate],
    prompt_tokens: usize,
    block_size: u32,
    weights: &ScoringConfig,
    rng: &mut impl Rng,
) -> Option<Choice> {
    if candidates.is_empty() {
        return None;
    }
    let queues: Vec<f64> = candidates
        .iter()
        .map(|c| queue_ms(&c.load, weights))
        .collect();
    let mean = queues.iter().sum::<f64>() / queues.len() as f64;
    let hot = |q: f64| q > weights.hotspot_factor * mean && q > weights.hotspot_min_ms;
    let all_hot = queues.iter().all(|q| hot(*q));
    let eligible = |i: usize| all_hot || !hot(queues[i]);
    let ttft = |i: usize| {
        let candidate = &candidates[i];
        let cached = (candidate.matched_blocks as usize).saturating_mul(block_size as usize);
        let shared = (candidate.shared_inflight_tokens as f64)
            .min(candidate.load.inflight_prompt_tokens)
            .min(prompt_tokens as f64);
        (queues[i] - weights.prefill_ms_per_token * shared).max(0.0)
            + weights.prefill_ms_per_token * prompt_tokens.saturating_sub(cached) as f64
    };
    let best = (0..candidates.len())
        .filter(|i| eligible(*i))
        .map(ttft)
        .fold(f64::INFINITY, f64::min);
    let ties: Vec<usize> = (0..candidates.len())
        .filter(|i| eligible(*i) && ttft(*i) <= best + TIE_EPSILON_MS)
        .collect();
    // Among equal scores prefer the longest prefix (keeps a conversation where its cache is),
    // then pick at random.
    let longest_tied = ties
        .iter()
        .map(|i| candidates[*i].matched_blocks)
        .max()
        .unwrap_or(0);
    let ties: Vec<usize> = ties
        .into_iter()
        .filter(|i| candidates[*i].matched_blocks == longest_tied)
        .collect();
    let index = ties[rng.random_range(0..ties.len())];
    let max_matched = candidates
        .iter()
        .map(|c| c.matched_blocks)
        .max()
        .unwrap_or(0);
    let chosen_matched = candidates[index].matched_blocks;
    let reason = if max_matched == 0 {
        Reason::NoCacheMatch
    } else if chosen_matched == max_matched {
        Reason::CacheHit
    } else if candidates
        .iter()
        .enumerate()
        .any(|(i, c)| c.matched_blocks == max_matched && !eligible(i))
    {
        Reason::HotspotGuard
    } else {
        Reason::LoadOverCache
    };
    Some(Choice {
        index,
        reason,
        ttft_ms: ttft(index),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::Scraped;
    use rand::SeedableRng;

    fn weights() -> ScoringConfig {
        ScoringConfig {
            prefill_ms_per_token: 0.1,
            queue_ms_per_request: 50.0,
            running_ms_per_request: 5.0,
            kv_usage_ms: 0.0,
            hotspot_factor: 2.0,
            hotspot_min_ms: 100.0,
            speculative_ttl: std::time::Duration::from_secs(1),
        }
    }

    fn candidate(matched_blocks: u32, waiting: f64) -> Candidate {
        Candidate {
            matched_blocks,
            shared_inflight_tokens: 0,
            load: LoadSnapshot {
                scraped: Scraped {
                    waiting,
                    ..Scraped::default()
                },
                ..LoadSnapshot::default()
            },
        }
    }

    #[test]
    fn cache_wins_when_load_is_equal() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let c = [candidate(0, 0.0), candidate(60, 0.0), candidate(10, 0.0)];
        let choice = choose(&c, 1024, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::CacheHit));
    }

    #[test]
    fn queue_outweighs_saved_prefill() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // 64 blocks cached saves 102 ms of prefill; 3 waiting requests cost 150 ms.
        let c = [candidate(64, 3.0), candidate(0, 0.0)];
        let choice = choose(&c, 1024, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::LoadOverCache));
    }

    #[test]
    fn hotspot_is_skipped_unless_all_are_hot() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut w = weights();
        w.prefill_ms_per_token = 10.0; // cache would win on TTFT alone
        let c = [candidate(64, 20.0), candidate(0, 0.0), candidate(0, 1.0)];
        let choice = choose(&c, 1024, 16, &w, &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::HotspotGuard));
        let all_hot = [candidate(64, 20.0)];
        assert_eq!(choose(&all_hot, 1024, 16, &w, &mut rng).unwrap().index, 0);
    }

    #[test]
    fn a_sibling_joins_the_prefill_it_shares() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // r0 is prefilling the first sibling (1024 tokens, 63 blocks shared); without the credit
        // waiting for that prefill costs as much as redoing it on idle r1.
        let mut first = candidate(63, 0.0);
        first.load.inflight_prompt_tokens = 1024.0;
        first.load.inflight_requests = 1.0;
        let mut sibling = first;
        sibling.shared_inflight_tokens = 1008;
        let idle = candidate(0, 0.0);
        let choice = choose(&[sibling, idle], 1024, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (0, Reason::CacheHit));
        let choice = choose(&[first, idle], 1024, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::LoadOverCache));
    }

    #[test]
    fn ties_are_spread() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let c = [candidate(0, 0.0), candidate(0, 0.0), candidate(0, 0.0)];
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[choose(&c, 100, 16, &weights(), &mut rng).unwrap().index] += 1;
        }
        assert!(seen.iter().all(|n| *n > 50), "{seen:?}");
    }
}
