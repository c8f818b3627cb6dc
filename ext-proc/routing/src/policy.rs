//! The default scoring policy: estimated time to first token (TTFT), lowest wins.
//!
//! For each candidate replica:
//!
//! ```text
//! work_ms    = prefill_ms_per_token   × in-flight prompt tokens (routed by kvroute, no first token yet)
//! waiting_ms = queue_ms_per_request   × (waiting + routed_since_scrape)
//! queue_ms   = max(work_ms, waiting_ms)
//!            + running_ms_per_request × running
//!            + kv_usage_ms            × kv_usage
//! credit_ms  = prefill_ms_per_token   × in-flight prompt tokens it shares
//! ttft_ms    = max(queue_ms − credit_ms, credit_ms)
//!            + prefill_ms_per_token × uncached prompt tokens
//! ```
//!
//! Queued work counts once: `work_ms` and `waiting_ms` measure the same queue (the requests
//! kvroute routed there and the engine has not answered), the first in tokens (exact for what
//! kvroute routed: a 40k-token prompt is not one 4k-token one), the second in requests (the only
//! sign of traffic kvroute did not route). Adding them would price every request kvroute routed
//! twice and make it leave its cache too eagerly; the larger of the two is the better estimate.
//!
//! A burst of siblings (requests sharing a long prefix, sent at once): the first one's prefill of
//! the prefix is in flight on its replica, and a sibling sent there joins that prefill rather than
//! waiting for it (the engine batches them), so the shared part is not queueing for it. Without
//! that credit a sibling would see the same cost either way (wait for the prefix there, or compute
//! it elsewhere) and the burst would spread, computing the prefix once per replica. With it, the
//! siblings co-locate until the running batch itself costs more than a fresh prefill elsewhere
//! (`running_ms_per_request × siblings ≈ prefill_ms_per_token × prefix tokens`).
//! Joining is not free, though: the sibling gets its first token only once the shared prefill
//! is done, so it waits for the longer of that prefill and the rest of the queue (they run in
//! the same steps). Subtracting the whole credit priced a sibling as if the prefix were already
//! cached, which made a holder look free to a whole burst while an idle replica holding the
//! same earlier prefix would have computed it as fast (kvroute-replay's fan-out workload).
//!
//! Hotspot guard: a replica whose `queue_ms` (its whole load, credit not subtracted) exceeds the
//! candidates' mean by `hotspot_factor` and is above `hotspot_min_ms` is skipped, unless every
//! candidate is — but only when it is a pile-up of this prompt's prefix: at least
//! [`HOTSPOT_MIN_QUEUED`] requests in flight there that carry as much of this prompt as the
//! replica holds or computes for it (without the prompt, any requests queued or in flight
//! there). Requests that share only the start of the prompt are no pile of it: other
//! conversations in flight on the replica that holds this one's history share its system prompt,
//! and skipping the holder for them recomputes the history elsewhere (counted by first block,
//! a real-vLLM run's hit rate fell from 0.587 to 0.517 that way; counted so, 0.584). The guard exists for what
//! the per-request estimate gets wrong, a popular prefix drawing request after request to one
//! replica. Other work queued there is no such pile: a single long prompt in flight is priced by
//! `work_ms`, and skipping its replica would send the requests that share *its* prefix to
//! recompute it elsewhere; unrelated prompts queued beside a holder are priced by the estimate
//! too, and skipping the holder for them recomputes this prefix elsewhere (in kvroute-replay a
//! group's 12k-token system prompt, left for another group's long first request in flight on
//! its holder). When the other replicas are idle the factor always holds, so `hotspot_min_ms`
//! is the load at which a burst starts to spill.
//!
//! How busy the pool has been ([`PoolState`]): the candidates' queued prefill
//! ([`queued_prefill_ms`]) averaged over the last seconds (`scoring::POOL_LOAD_AVERAGING`) — a
//! burst is a moment of load, not a busy pool. Below `idle_pool_ms` (default 100 ms) the pool
//! is idle: it has prefill to spare, and a burst of siblings is better computed in parallel
//! than batched on one replica. So on an idle pool the sibling credit and kvroute's own recent
//! inserts do not count on the replicas the index vouches for: a candidate is scored on the
//! prefix the index confirms there, and siblings of a context the index holds spread over its
//! holders by their queues, each replica computing the new part beside the others and holding
//! it for what follows. (Kept on one holder, the context stays there alone and every later
//! round of an agent queues on it, a cost no per-request estimate sees: in kvroute-replay's
//! fan-out workload the TTFT-greedy oracle spread an agent's first burst over all four
//! replicas; scored this way kvroute's TTFT p90 at ×1–×2 fell from 1.01 of Dynamo w2's to
//! 0.99–1.00 over 16 seeds, and multi-turn's by 2–3 %, where an earlier idle setting of the
//! hotspot guard, spilling piles early, had left fan-out at 1.01.) Without the index (the
//! approximate tier) what kvroute's memory saw computed stands for what the index confirms: the
//! keys of requests that got their first token there (`prefix_memory` module docs). Believed
//! whole instead, an idle pool without events piled every burst on one replica (kvroute-replay's
//! fan-out workload without events: TTFT p90 1.06–1.10 of least-loaded's at ×1–×2; counted so,
//! kvroute's with events). Busy, batching siblings where their prefix is computed saves capacity
//! every later request waits for, and both count.
//!
//! Recomputation once every replica is busy: a candidate that would compute prompt tokens
//! another candidate holds cached is charged their prefill again, twice
//! (`ScoringConfig::recompute_penalty`, default 2), scaled by how busy the least busy replica is
//! (its `queue_ms` over `queue_ms_per_request`, capped at 1). The estimate is per request and
//! greedy; what it does not see is that the recomputed prefix is work every later request on
//! that replica waits behind — more than one request's worth once queues form. While some
//! replica is idle that work costs spare time, nothing is charged, and a burst still spreads
//! over idle replicas; once all have a request's worth of queue the penalty is whole, so a
//! holder keeps its prefix unless its queue is longer by more than three times the prefill
//! saved. (In kvroute-replay, 6 seeds: at 1 against none the synthetic trace's max rate at the
//! 2 s SLO rose from 10.6 to 11.1 req/s and shared-prefix's from 33.1 to 34.5; at 2 against 1,
//! the synthetic trace's ×3 p90 fell by a tenth and fan-out's max rate rose from 78.3 to 80.0
//! req/s, raw and jittered, for 1 % on fan-out's ×1.) It ranks the candidates; the
//! reported estimate ([`Choice::ttft_ms`]) and the fallback order leave it out.
//!
//! Overload: once even the least busy candidate has `overload_queue_ms` queued (default 8 s),
//! the pool is past saturation and every replica will be busy for as long as anyone can see.
//! Then the per-request estimate is the wrong objective: moving a request to a slightly shorter
//! queue saves it little of a long wait, while recomputing its prefix there adds work every
//! later request on that replica waits behind, so throughput falls as the queues grow. The
//! request goes to the longest cached prefix among the candidates whose queue is within
//! `overload_imbalance` (default 1.5) of the least busy one's (then the best estimate), as
//! SGLang's cache-aware policy balances only beyond an imbalance threshold; a replica queued
//! beyond that gives its prefix up. The hotspot guard does not apply (the imbalance bound is the
//! guard). Shedding (`epp.shedding`) stays the operator's lever for refusing work instead.
//!
//! Ties: estimates within `TIE_TOLERANCE` of the best count as equal; among them the longest
//! cached prefix wins, then a random one, so identical replicas share work.

use rand::Rng;

use crate::load::LoadSnapshot;
use crate::scoring::ScoringConfig;

/// Scores within this many milliseconds count as equal.
const TIE_EPSILON_MS: f64 = 1e-6;

/// Scores within this share of the best count as equal too. The estimate is not better than a
/// few percent (the weights are rough), and between near-equal choices the longest cached prefix
/// is the better one: the other computes the prefix again, work that delays every later request
/// there. (In kvroute-replay this tolerance turned coin flips that recomputed a cached system
/// prompt into hits; 10% began to cost load balance.)
const TIE_TOLERANCE: f64 = 0.05;

/// Fallback endpoints ranked per decision ([`fallback_order`]): more than a proxy retries
/// (`epp.fallbacks`), with room for data-parallel ranks sharing an address.
pub const FALLBACKS_KEPT: usize = 16;

/// Requests queued or in flight on a replica before the hotspot guard may skip it: one request
/// alone, however long, is priced by the estimate and is not a pile-up.
pub const HOTSPOT_MIN_QUEUED: f64 = 2.0;

/// How busy the least busy candidate is, 0..1: its queue (`least`, ms) in waiting requests'
/// worth, capped at one. Scales `ScoringConfig::recompute_penalty`.
fn pool_busy(least: f64, weights: &ScoringConfig) -> f64 {
    if !least.is_finite() || least <= 0.0 {
        return 0.0;
    }
    if weights.queue_ms_per_request <= 0.0 {
        return 1.0;
    }
    (least / weights.queue_ms_per_request).min(1.0)
}

/// One candidate as the policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    /// Leading prompt blocks believed cached there: the index's answer, with kvroute's own
    /// recent inserts and siblings' prefill in flight past it.
    pub matched_blocks: u32,
    /// Of those, what is known computed there: the index's answer where it vouches for the
    /// replica, else the keys kvroute's memory saw a first token for (the approximate tier);
    /// `None` on the load tier.
    pub confirmed_blocks: Option<u32>,
    /// Prompt tokens of this request whose prefill is already in flight there (a sibling's).
    pub shared_inflight_tokens: usize,
    /// Requests in flight there that carry as much of this prompt as the replica holds or
    /// computes for it ([`crate::load::InflightOverlap::siblings`]): a pile-up of this prefix.
    /// `None` when the prompt is unknown (the load tier).
    pub inflight_siblings: Option<u32>,
    /// Current load.
    pub load: LoadSnapshot,
}

impl Candidate {
    /// The leading blocks the policy counts as cached there (module docs: an idle pool counts
    /// only what the index confirms, where it vouches).
    fn counted_blocks(&self, pool: PoolState) -> u32 {
        match (pool, self.confirmed_blocks) {
            (PoolState::Idle, Some(confirmed)) => confirmed,
            _ => self.matched_blocks,
        }
    }

    /// The prompt tokens whose prefill in flight there the request would join.
    fn joined_tokens(&self, pool: PoolState) -> usize {
        match (pool, self.confirmed_blocks) {
            (PoolState::Idle, Some(_)) => 0,
            _ => self.shared_inflight_tokens,
        }
    }
}

/// How busy the pool has been over the last seconds (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PoolState {
    /// Prefill to spare: bursts spread.
    Idle,
    /// Bursts batch where their prefix is computed.
    #[default]
    Busy,
}

impl PoolState {
    /// From the candidates' queued prefill averaged over the last seconds, ms.
    pub fn of(recent_prefill_ms: f64, weights: &ScoringConfig) -> Self {
        if recent_prefill_ms < weights.idle_pool_ms {
            Self::Idle
        } else {
            Self::Busy
        }
    }
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
    /// The pool was overloaded: the longest prefix among the balanced candidates won.
    Overload,
}

impl Reason {
    /// Metric label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::CacheHit => "cache_hit",
            Self::NoCacheMatch => "no_cache_match",
            Self::LoadOverCache => "load_over_cache",
            Self::HotspotGuard => "hotspot_guard",
            Self::Overload => "overload",
        }
    }
}

/// The policy's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// Index into the candidates.
    pub index: usize,
    /// Why.
    pub reason: Reason,
    /// Estimated TTFT of the winner, ms.
    pub ttft_ms: f64,
    /// The other candidates, best first ([`fallback_order`], from the same estimates).
    pub fallbacks: Vec<usize>,
}

/// Requests the engine holds but has not admitted: the scraped queue, plus requests routed since
/// that scrape when it showed the engine saturated.
///
/// Requests routed since the last scrape join the running batch unless that scrape showed the
/// engine saturated (requests waiting): only then do they queue. (Counting every one as queued
/// would scatter a burst of siblings instead of batching them where their prefix is cached.)
fn waiting_and_running(load: &LoadSnapshot) -> (f64, f64) {
    if load.scraped.waiting > 0.0 {
        (
            load.scraped.waiting + load.routed_since_scrape,
            load.scraped.running,
        )
    } else {
        (0.0, load.scraped.running + load.routed_since_scrape)
    }
}

/// Queueing estimate of a replica, in ms (see the module docs: queued work counted once).
pub fn queue_ms(load: &LoadSnapshot, weights: &ScoringConfig) -> f64 {
    let (_, running) = waiting_and_running(load);
    queued_prefill_ms(load, weights)
        + weights.running_ms_per_request * running
        + weights.kv_usage_ms * load.scraped.kv_usage
}

/// The prefill a replica has queued, in ms: its [`queue_ms`] without the running batch and the
/// KV-cache usage (a replica only decoding has spare prefill).
pub fn queued_prefill_ms(load: &LoadSnapshot, weights: &ScoringConfig) -> f64 {
    let (waiting, _) = waiting_and_running(load);
    let work_ms = weights.prefill_ms_per_token * load.inflight_prompt_tokens;
    let waiting_ms = weights.queue_ms_per_request * waiting;
    work_ms.max(waiting_ms)
}

/// Requests ahead of a new one's prefill: kvroute's own not yet answered, or the engine's
/// queue if that is longer (traffic kvroute did not route).
fn queued_requests(load: &LoadSnapshot) -> f64 {
    load.inflight_requests.max(waiting_and_running(load).0)
}

/// The pile-up the hotspot guard looks for on a candidate: its in-flight siblings of this
/// prompt; without the prompt (the load tier), every request queued or in flight there.
fn piled_requests(c: &Candidate) -> f64 {
    c.inflight_siblings
        .map_or_else(|| queued_requests(&c.load), f64::from)
}

/// Estimated time to first token on `candidate`, ms: its queue ([`queue_ms`]) less a sibling's
/// prefill already in flight there, plus the prefill of what it does not hold.
pub fn estimated_ttft_ms(
    candidate: &Candidate,
    pool: PoolState,
    prompt_tokens: usize,
    block_size: u32,
    weights: &ScoringConfig,
) -> f64 {
    let queue = queue_ms(&candidate.load, weights);
    ttft_after_queue_ms(candidate, pool, queue, prompt_tokens, block_size, weights)
}

/// [`estimated_ttft_ms`] with the candidate's queue already estimated.
fn ttft_after_queue_ms(
    candidate: &Candidate,
    pool: PoolState,
    queue_ms: f64,
    prompt_tokens: usize,
    block_size: u32,
    weights: &ScoringConfig,
) -> f64 {
    let cached = (candidate.counted_blocks(pool) as usize).saturating_mul(block_size as usize);
    let shared = (candidate.joined_tokens(pool) as f64)
        .min(candidate.load.inflight_prompt_tokens)
        .min(prompt_tokens as f64);
    let credit = weights.prefill_ms_per_token * shared;
    // Joined, not queued behind — but not done before the shared prefill is (module docs).
    (queue_ms - credit).max(credit)
        + weights.prefill_ms_per_token * prompt_tokens.saturating_sub(cached) as f64
}

/// The best [`FALLBACKS_KEPT`] candidates other than `chosen`, best first by estimated TTFT
/// (ties: longer prefix, then index): the fallback endpoints a proxy's retries walk when the
/// chosen one fails (GIE's endpoint list). Hotspots are not skipped here: a fallback is only
/// used when better ones failed. Only the head is ordered: a pool of a thousand replicas would
/// otherwise sort them all for every decision.
pub fn fallback_order(
    candidates: &[Candidate],
    pool: PoolState,
    chosen: usize,
    prompt_tokens: usize,
    block_size: u32,
    weights: &ScoringConfig,
) -> Vec<usize> {
    let ttfts: Vec<f64> = candidates
        .iter()
        .map(|c| estimated_ttft_ms(c, pool, prompt_tokens, block_size, weights))
        .collect();
    rank_fallbacks(candidates, pool, &ttfts, chosen)
}

/// [`fallback_order`] from the candidates' estimated TTFTs (`ttfts`, ms), already computed.
fn rank_fallbacks(
    candidates: &[Candidate],
    pool: PoolState,
    ttfts: &[f64],
    chosen: usize,
) -> Vec<usize> {
    let order = |a: &(f64, u32, usize), b: &(f64, u32, usize)| {
        a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2))
    };
    // The best few kept in order as the candidates stream by: in a large pool most candidates
    // cost one comparison with the last kept.
    let mut kept: Vec<(f64, u32, usize)> = Vec::with_capacity(FALLBACKS_KEPT + 1);
    for (i, (c, ttft)) in candidates.iter().zip(ttfts).enumerate() {
        if i == chosen {
            continue;
        }
        let entry = (*ttft, c.counted_blocks(pool), i);
        if kept.len() == FALLBACKS_KEPT
            && kept.last().is_some_and(|last| order(&entry, last).is_ge())
        {
            continue;
        }
        let at = kept.partition_point(|k| order(k, &entry).is_lt());
        kept.insert(at, entry);
        kept.truncate(FALLBACKS_KEPT);
    }
    kept.into_iter().map(|(_, _, i)| i).collect()
}

/// In overload (every candidate queued at least `overload_queue_ms`), which candidates are
/// balanced: queued within `overload_imbalance` of the least busy one (`least`, ms). `None`
/// below overload.
fn overload_balanced<'a>(
    queues: &'a [f64],
    least: f64,
    weights: &ScoringConfig,
) -> Option<impl Fn(usize) -> bool + 'a> {
    if weights.overload_queue_ms <= 0.0 || !least.is_finite() || least < weights.overload_queue_ms {
        return None;
    }
    let bound = least * weights.overload_imbalance.max(1.0);
    Some(move |i: usize| queues[i] <= bound)
}

/// Among `eligible`, the lowest score; scores within [`TIE_TOLERANCE`] count as equal, and among
/// them the longest prefix (keeps a conversation where its cache is), then a random one.
fn pick_best(
    eligible: impl Iterator<Item = usize> + Clone,
    candidates: &[Candidate],
    pool: PoolState,
    score: impl Fn(usize) -> f64,
    rng: &mut impl Rng,
) -> usize {
    let best = eligible.clone().map(&score).fold(f64::INFINITY, f64::min);
    let ties: Vec<usize> = eligible
        .filter(|i| score(*i) <= best * (1.0 + TIE_TOLERANCE) + TIE_EPSILON_MS)
        .collect();
    let longest_tied = ties
        .iter()
        .map(|i| candidates[*i].counted_blocks(pool))
        .max()
        .unwrap_or(0);
    let ties: Vec<usize> = ties
        .into_iter()
        .filter(|i| candidates[*i].counted_blocks(pool) == longest_tied)
        .collect();
    ties.get(rng.random_range(0..ties.len().max(1)))
        .copied()
        .unwrap_or(0)
}

/// Picks the candidate with the lowest estimated TTFT. `recent_prefill_ms` is the candidates'
/// mean [`queued_prefill_ms`] averaged over the last seconds, which says whether the pool is idle
/// ([`PoolState`], module docs). `None` only when `candidates` is empty.
pub fn choose(
    candidates: &[Candidate],
    recent_prefill_ms: f64,
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
    let least = queues.iter().copied().fold(f64::INFINITY, f64::min);
    let mean = queues.iter().sum::<f64>() / queues.len() as f64;
    let pool = PoolState::of(recent_prefill_ms, weights);
    let hot: Vec<bool> = candidates
        .iter()
        .zip(&queues)
        .map(|(c, q)| {
            *q > weights.hotspot_factor * mean
                && *q > weights.hotspot_min_ms
                && piled_requests(c) >= HOTSPOT_MIN_QUEUED
        })
        .collect();
    let all_hot = hot.iter().all(|h| *h);
    let eligible = |i: usize| all_hot || !hot[i];
    let ttfts: Vec<f64> = candidates
        .iter()
        .zip(&queues)
        .map(|(c, queue)| ttft_after_queue_ms(c, pool, *queue, prompt_tokens, block_size, weights))
        .collect();
    let cached_tokens =
        |c: &Candidate| (c.counted_blocks(pool) as usize).saturating_mul(block_size as usize);
    let held = candidates
        .iter()
        .map(cached_tokens)
        .max()
        .unwrap_or(0)
        .min(prompt_tokens);
    let penalty_ms_per_token =
        weights.recompute_penalty * pool_busy(least, weights) * weights.prefill_ms_per_token;
    let scores: Vec<f64> = (0..candidates.len())
        .map(|i| {
            let recomputed = held.saturating_sub(cached_tokens(&candidates[i]));
            ttfts[i] + penalty_ms_per_token * recomputed as f64
        })
        .collect();
    let score = |i: usize| scores[i];
    let overload = overload_balanced(&queues, least, weights);
    let overloaded = overload.is_some();
    let index = match overload {
        Some(balanced) => {
            // Overloaded: the longest cached prefix among the balanced candidates, then the
            // best estimate.
            let longest = (0..candidates.len())
                .filter(|i| balanced(*i))
                .map(|i| candidates[i].counted_blocks(pool))
                .max()
                .unwrap_or(0);
            pick_best(
                (0..candidates.len())
                    .filter(|i| balanced(*i) && candidates[*i].counted_blocks(pool) == longest),
                candidates,
                pool,
                score,
                rng,
            )
        }
        None => pick_best(
            (0..candidates.len()).filter(|i| eligible(*i)),
            candidates,
            pool,
            score,
            rng,
        ),
    };
    let max_matched = candidates
        .iter()
        .map(|c| c.counted_blocks(pool))
        .max()
        .unwrap_or(0);
    let chosen_matched = candidates[index].counted_blocks(pool);
    let reason = if overloaded {
        Reason::Overload
    } else if max_matched == 0 {
        Reason::NoCacheMatch
    } else if chosen_matched == max_matched {
        Reason::CacheHit
    } else if candidates
        .iter()
        .enumerate()
        .any(|(i, c)| c.counted_blocks(pool) == max_matched && !eligible(i))
    {
        Reason::HotspotGuard
    } else {
        Reason::LoadOverCache
    };
    Some(Choice {
        index,
        reason,
        ttft_ms: ttfts[index],
        fallbacks: rank_fallbacks(candidates, pool, &ttfts, index),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::Scraped;
    use rand::SeedableRng;

    /// How busy the pool has been, for tests of everything but that: busier than any
    /// `idle_pool_ms`.
    const BUSY: f64 = 1e9;

    fn weights() -> ScoringConfig {
        ScoringConfig {
            prefill_ms_per_token: 0.1,
            queue_ms_per_request: 50.0,
            running_ms_per_request: 5.0,
            kv_usage_ms: 0.0,
            hotspot_factor: 2.0,
            hotspot_min_ms: 100.0,
            idle_pool_ms: 0.0,
            recompute_penalty: 1.0,
            speculative_ttl: std::time::Duration::from_secs(1),
            overload_queue_ms: 0.0,
            overload_imbalance: 1.5,
        }
    }

    fn candidate(matched_blocks: u32, waiting: f64) -> Candidate {
        Candidate {
            matched_blocks,
            confirmed_blocks: None,
            shared_inflight_tokens: 0,
            inflight_siblings: None,
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
    fn fallbacks_are_the_others_best_estimate_first() {
        // r1 holds most but is chosen; r2 holds some, r0 none; r3 holds as much as r2 but queues.
        let c = [
            candidate(0, 0.0),
            candidate(60, 0.0),
            candidate(10, 0.0),
            candidate(10, 3.0),
        ];
        assert_eq!(
            fallback_order(&c, PoolState::Busy, 1, 1024, 16, &weights()),
            vec![2, 0, 3]
        );
        assert_eq!(
            fallback_order(&c[..1], PoolState::Busy, 0, 1024, 16, &weights()),
            Vec::<usize>::new()
        );
    }

    #[test]
    fn a_large_pool_keeps_the_best_fallbacks_in_order() {
        // Many candidates, many of them equal (ties: longer prefix, then index).
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let c: Vec<Candidate> = (0..300)
            .map(|_| {
                candidate(
                    rng.random_range(0..3) * 10,
                    f64::from(rng.random_range(0..4u32)),
                )
            })
            .collect();
        let w = weights();
        let mut everyone: Vec<(f64, u32, usize)> = c
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 7)
            .map(|(i, x)| {
                (
                    estimated_ttft_ms(x, PoolState::Busy, 1024, 16, &w),
                    x.matched_blocks,
                    i,
                )
            })
            .collect();
        everyone.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
        let best: Vec<usize> = everyone
            .iter()
            .take(FALLBACKS_KEPT)
            .map(|(_, _, i)| *i)
            .collect();
        assert_eq!(fallback_order(&c, PoolState::Busy, 7, 1024, 16, &w), best);
    }

    #[test]
    fn cache_wins_when_load_is_equal() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let c = [candidate(0, 0.0), candidate(60, 0.0), candidate(10, 0.0)];
        let choice = choose(&c, BUSY, 1024, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::CacheHit));
    }

    #[test]
    fn queue_outweighs_saved_prefill() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // 64 blocks cached saves 102 ms of prefill; 3 waiting requests cost 150 ms.
        let c = [candidate(64, 3.0), candidate(0, 0.0)];
        let choice = choose(&c, BUSY, 1024, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::LoadOverCache));
    }

    #[test]
    fn hotspot_is_skipped_unless_all_are_hot() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut w = weights();
        w.prefill_ms_per_token = 10.0; // cache would win on TTFT alone
        let c = [candidate(64, 20.0), candidate(0, 0.0), candidate(0, 1.0)];
        let choice = choose(&c, BUSY, 1024, 16, &w, &mut rng).unwrap();
        // r1 and r2 are within the tie tolerance of each other.
        assert_ne!(choice.index, 0);
        assert_eq!(choice.reason, Reason::HotspotGuard);
        let all_hot = [candidate(64, 20.0)];
        assert_eq!(
            choose(&all_hot, BUSY, 1024, 16, &w, &mut rng)
                .unwrap()
                .index,
            0
        );
    }

    #[test]
    fn queued_work_counts_once() {
        // The engine's one waiting request is the one kvroute routed there (4000 tokens): its
        // prefill is the queue, not its prefill plus a request's worth.
        let mut routed = candidate(0, 1.0);
        routed.load.inflight_requests = 1.0;
        routed.load.inflight_prompt_tokens = 4000.0;
        assert_eq!(queue_ms(&routed.load, &weights()), 400.0);
        // Traffic kvroute did not route shows only in the engine's count.
        assert_eq!(queue_ms(&candidate(0, 3.0).load, &weights()), 150.0);
    }

    #[test]
    fn one_long_prompt_in_flight_is_not_a_hotspot() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // r0 holds the whole 4096-token prompt and prefills one 2000-token request (200 ms, far
        // above twice the mean and `hotspot_min_ms`): waiting there beats recomputing 410 ms on r1.
        let mut holder = candidate(256, 0.0);
        holder.load.inflight_requests = 1.0;
        holder.load.inflight_prompt_tokens = 2000.0;
        let idle = candidate(0, 0.0);
        let choice = choose(&[holder, idle, idle], BUSY, 4096, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (0, Reason::CacheHit));
        // The same work as a pile of requests is a hotspot.
        holder.load.inflight_requests = 2.0;
        let choice = choose(&[holder, idle, idle], BUSY, 4096, 16, &weights(), &mut rng).unwrap();
        assert_eq!(choice.reason, Reason::HotspotGuard);
        assert_ne!(choice.index, 0);
    }

    #[test]
    fn only_a_pile_of_this_prefix_is_a_hotspot() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // r0 holds the whole prompt but prefills two unrelated prompts (3000 tokens, 300 ms:
        // far above twice the mean and `hotspot_min_ms`). No request there starts as this one:
        // the estimate decides, and waiting there (300 + 0.1 ms) beats recomputing the prompt
        // on idle r1 or r2 (409.6 ms).
        let mut holder = candidate(256, 0.0);
        holder.load.inflight_requests = 2.0;
        holder.load.inflight_prompt_tokens = 3000.0;
        holder.inflight_siblings = Some(0);
        let mut idle = candidate(0, 0.0);
        idle.inflight_siblings = Some(0);
        let choice = choose(&[holder, idle, idle], BUSY, 4097, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (0, Reason::CacheHit));
        // The same work as two requests of this prefix is the pile the guard is for.
        holder.inflight_siblings = Some(2);
        let choice = choose(&[holder, idle, idle], BUSY, 4097, 16, &weights(), &mut rng).unwrap();
        assert_eq!(choice.reason, Reason::HotspotGuard);
        assert_ne!(choice.index, 0);
    }

    #[test]
    fn an_idle_pool_spreads_a_burst_over_the_holders_the_index_confirms() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let weights = ScoringConfig {
            idle_pool_ms: 100.0,
            ..weights()
        };
        // A 1536-token sibling (96 blocks): a 60-block context both replicas hold, by the
        // index, then a 32-block part new to both and 4 blocks of its own. r0 prefills the
        // first sibling (576 tokens: the new part and its own), which this one would join; r1
        // decodes 4 requests (20 ms).
        let mut joined = candidate(92, 0.0);
        joined.confirmed_blocks = Some(60);
        joined.shared_inflight_tokens = 92 * 16;
        joined.load.inflight_requests = 1.0;
        joined.load.inflight_prompt_tokens = 576.0;
        let mut holder = candidate(60, 0.0);
        holder.confirmed_blocks = Some(60);
        holder.load.scraped.running = 4.0;
        let pool = [joined, holder];
        // Busy over the last seconds: the sibling joins the prefill in flight (57.6 + 6.4 ms,
        // against 20 + 57.6 ms and the recomputation charged on r1).
        let choice = choose(&pool, 500.0, 1536, 16, &weights, &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (0, Reason::CacheHit));
        // Idle: only what the index confirms counts, so r1 computes the new part beside r0
        // (77.6 ms, against 57.6 + 57.6 ms queued behind the first sibling on r0).
        let choice = choose(&pool, 10.0, 1536, 16, &weights, &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::CacheHit));
        assert!((choice.ttft_ms - 77.6).abs() < 1e-9, "{choice:?}");
        // 0 never counts a pool as idle.
        let never = ScoringConfig {
            idle_pool_ms: 0.0,
            ..weights.clone()
        };
        let choice = choose(&pool, 0.0, 1536, 16, &never, &mut rng).unwrap();
        assert_eq!(choice.index, 0);
        // Where nothing is known computed (`None`), what kvroute believes counts, idle or busy.
        let unvouched = [
            Candidate {
                confirmed_blocks: None,
                ..joined
            },
            Candidate {
                confirmed_blocks: None,
                ..holder
            },
        ];
        let choice = choose(&unvouched, 10.0, 1536, 16, &weights, &mut rng).unwrap();
        assert_eq!(choice.index, 0);
    }

    #[test]
    fn a_sibling_joins_the_prefill_it_shares() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // r0 is prefilling the first sibling (1024 tokens, 63 blocks shared) and a short
        // unrelated prompt; without the credit waiting for that prefill costs more than redoing it
        // on idle r1. With it the sibling waits only for the shared prefill (the unrelated prompt
        // runs beside it): as long as r1's, a tie, and the tie keeps the cache.
        let mut first = candidate(63, 0.0);
        first.load.inflight_prompt_tokens = 1200.0;
        first.load.inflight_requests = 1.0;
        let mut sibling = first;
        sibling.shared_inflight_tokens = 1008;
        let idle = candidate(0, 0.0);
        let choice = choose(&[sibling, idle], BUSY, 1024, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (0, Reason::CacheHit));
        let choice = choose(&[first, idle], BUSY, 1024, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::LoadOverCache));
    }

    #[test]
    fn a_sibling_still_waits_for_the_prefill_it_joins() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // r0 prefills the first sibling (1200 tokens in flight, 1008 of them this prompt's);
        // idle r1 already holds the prompt's first 40 blocks. Joining r0 means waiting ≈ 100 ms
        // for the shared prefill; r1 computes the missing 384 tokens in 38 ms.
        let mut joined = candidate(63, 0.0);
        joined.load.inflight_prompt_tokens = 1200.0;
        joined.load.inflight_requests = 1.0;
        joined.shared_inflight_tokens = 1008;
        let warm = candidate(40, 0.0);
        let choice = choose(&[joined, warm], BUSY, 1024, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::LoadOverCache));
        assert!((choice.ttft_ms - 38.4).abs() < 1e-9, "{choice:?}");
    }

    #[test]
    fn recomputing_a_held_prefix_is_charged_only_when_every_replica_is_busy() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // Keep the hotspot guard out of it.
        let mut w = weights();
        w.hotspot_factor = 3.0;
        // r0 holds 768 of 1024 tokens but has 3 requests waiting: 150 + 25.6 ms, against
        // 50 + 102.4 ms on r1 (1 waiting, nothing held): r1 is faster...
        let holder = candidate(48, 3.0);
        let busy = candidate(0, 1.0);
        let idle = candidate(0, 0.0);
        // ...but with every replica busy, recomputing the 768 held tokens costs r1 76.8 ms
        // more (a whole request's worth of queue on the least busy one: penalty 1).
        let choice = choose(&[holder, busy], BUSY, 1024, 16, &w, &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (0, Reason::CacheHit));
        assert!((choice.ttft_ms - 175.6).abs() < 1e-9, "{choice:?}");
        // With an idle replica the recomputation costs spare time only: the idle one wins.
        let choice = choose(&[holder, busy, idle], BUSY, 1024, 16, &w, &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (2, Reason::LoadOverCache));
        // The penalty is the operator's (`scoring.recompute_penalty`): 0 leaves the greedy
        // estimate alone and r1 wins.
        w.recompute_penalty = 0.0;
        let choice = choose(&[holder, busy], BUSY, 1024, 16, &w, &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::LoadOverCache));
    }

    #[test]
    fn a_near_tie_keeps_the_cache() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // r0 holds 896 of 1024 tokens but is prefilling 940 others: 94 + 12.8 ms against 102.4 ms
        // on idle r1. Within the tolerance: recomputing the prefix on r1 is not worth 5%.
        let mut holder = candidate(56, 0.0);
        holder.load.inflight_requests = 1.0;
        holder.load.inflight_prompt_tokens = 940.0;
        let idle = candidate(0, 0.0);
        let choice = choose(&[holder, idle], BUSY, 1024, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (0, Reason::CacheHit));
        // Clearly slower is still left.
        holder.load.inflight_prompt_tokens = 1200.0;
        let choice = choose(&[holder, idle], BUSY, 1024, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::LoadOverCache));
    }

    #[test]
    fn ties_are_spread() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let c = [candidate(0, 0.0), candidate(0, 0.0), candidate(0, 0.0)];
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[choose(&c, BUSY, 100, 16, &weights(), &mut rng)
                .unwrap()
                .index] += 1;
        }
        assert!(seen.iter().all(|n| *n > 50), "{seen:?}");
    }

    /// The test weights with the overload rule on: 1 s of queue, 1.5 times the least busy.
    fn overload_weights() -> ScoringConfig {
        ScoringConfig {
            overload_queue_ms: 1000.0,
            overload_imbalance: 1.5,
            ..weights()
        }
    }

    #[test]
    fn an_overloaded_pool_keeps_a_prefix_on_a_holder_within_the_imbalance() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // 64 blocks cached save 102 ms of prefill; the holder's 30 waiting requests cost 500 ms
        // more than the other's 20: the estimate would leave the holder.
        let c = [candidate(64, 30.0), candidate(0, 20.0)];
        let choice = choose(&c, BUSY, 1024, 16, &weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::LoadOverCache));
        // Overloaded (both queued at least 1 s), 1.5 times the least busy queue is 1.5 s, and the
        // holder's 1.5 s is within it: the prefix stays where it is cached.
        let choice = choose(&c, BUSY, 1024, 16, &overload_weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (0, Reason::Overload));
    }

    #[test]
    fn an_overloaded_holder_beyond_the_imbalance_gives_its_prefix_up() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // The holder's 31 waiting requests (1.55 s) are beyond 1.5 times the other's 20 (1 s).
        let c = [candidate(64, 31.0), candidate(0, 20.0)];
        let choice = choose(&c, BUSY, 1024, 16, &overload_weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::Overload));
        // Among balanced candidates holding as much, the best estimate wins.
        let c = [candidate(64, 25.0), candidate(64, 21.0), candidate(0, 20.0)];
        let choice = choose(&c, BUSY, 1024, 16, &overload_weights(), &mut rng).unwrap();
        assert_eq!(choice.index, 1);
    }

    #[test]
    fn below_the_overload_queue_the_estimate_decides() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // The least busy candidate has 950 ms queued, under the 1 s bound.
        let c = [candidate(64, 25.0), candidate(0, 19.0)];
        let choice = choose(&c, BUSY, 1024, 16, &overload_weights(), &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::LoadOverCache));
        // Off (0), however long the queues.
        let off = ScoringConfig {
            overload_queue_ms: 0.0,
            ..overload_weights()
        };
        let c = [candidate(64, 300.0), candidate(0, 200.0)];
        let choice = choose(&c, BUSY, 1024, 16, &off, &mut rng).unwrap();
        assert_eq!((choice.index, choice.reason), (1, Reason::LoadOverCache));
    }
}
