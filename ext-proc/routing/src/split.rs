//! Prefill/decode disaggregation: whether a request whose decode replica is chosen has its
//! prompt computed on a prefill replica. One implementation for ext-proc's picker and the
//! replay simulator, so both decide the same on the same facts.

use std::time::Duration;

/// Default `min_prompt_tokens`: llm-d's documented example; below a thousand tokens a prefill
/// is a few milliseconds, less than the KV transfer it would need.
pub const DEFAULT_MIN_PROMPT_TOKENS: usize = 1024;
/// Default `min_uncached_tokens`: llm-d's documented example (half the prompt floor): a mostly
/// cached prompt is cheaper to finish on its decode replica.
pub const DEFAULT_MIN_UNCACHED_TOKENS: usize = 512;

/// Default `max_prefill_queue`. In kvroute-replay it keeps a prefill pool smaller than the
/// traffic's prefill work from queueing every long prompt (one prefill and three decode replicas:
/// the synthetic trace's max rate at the 2 s SLO rose from under 3.9 to 8.0 req/s, shared-prefix's
/// from 6.0 to 27.8) and changes nothing where the decode pool is the smaller side; bounds from
/// 0.25 to 2 s measured within a bisection step or two of each other, 4 s lost most of the gain.
pub const DEFAULT_MAX_PREFILL_QUEUE: Duration = Duration::from_secs(1);

/// The thresholds of the decision (`pools[].disaggregation` in ext-proc's config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitRule {
    /// Prompts shorter than this many tokens are served whole on the decode replica.
    pub min_prompt_tokens: usize,
    /// A prompt is split when at least this many of its tokens are not cached on the chosen
    /// decode replica.
    pub min_uncached_tokens: usize,
    /// A prefill replica whose estimated queue (the scoring policy's `queue_ms`) is at least
    /// this, and longer than the decode replica's, takes no prefill leg; when every ready one is
    /// that busy the request is served whole on its decode replica, which has the time to
    /// compute the prompt. `None`: the prefill pool's load never keeps a request whole.
    pub max_prefill_queue: Option<Duration>,
}

impl SplitRule {
    /// Whether a prefill replica whose estimated queue is `queue_ms` may take a prefill leg of
    /// a request whose decode replica's queue is `decode_queue_ms`. The decode replica's queue
    /// raises the bound: moving the prompt onto a decode replica busier than the prefill pool
    /// only moves the wait there.
    pub fn admits_prefill_queue(&self, queue_ms: f64, decode_queue_ms: f64) -> bool {
        self.max_prefill_queue
            .is_none_or(|max| queue_ms < (max.as_secs_f64() * 1000.0).max(decode_queue_ms))
    }
}

/// The prefill pool as the verdict sees it, once the decode replica is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillSide {
    /// No prefill replica is ready (other than the decode replica).
    Unready,
    /// Every ready prefill replica's queue is at the rule's `max_prefill_queue`.
    Busy,
    /// Some prefill replica can take the leg.
    Available,
}

impl PrefillSide {
    /// From how many prefill replicas are ready and how many of those the rule admits.
    pub fn of(ready: usize, admitted: usize) -> Self {
        if ready == 0 {
            Self::Unready
        } else if admitted == 0 {
            Self::Busy
        } else {
            Self::Available
        }
    }
}

/// Whether a disaggregated pool's request is split off to a prefill replica, and why not (the
/// `decision` label of `disaggregation_decisions_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitVerdict {
    /// Its prompt is computed on a prefill replica.
    Split,
    /// Served whole: the prompt is shorter than `min_prompt_tokens`.
    ShortPrompt,
    /// Served whole: fewer than `min_uncached_tokens` are uncached on the decode replica.
    Cached,
    /// Served whole: no prefill replica is ready.
    NoPrefillReplica,
    /// Served whole: every ready prefill replica's queue is at `max_prefill_queue`.
    PrefillBusy,
    /// Served whole: the prompt is not known (routed on load).
    NoPrompt,
}

impl SplitVerdict {
    /// Metric label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Split => "split",
            Self::ShortPrompt => "short_prompt",
            Self::Cached => "cached",
            Self::NoPrefillReplica => "no_prefill_replica",
            Self::PrefillBusy => "prefill_busy",
            Self::NoPrompt => "no_prompt",
        }
    }

    /// llm-d's prefix-based decider, on kvroute's facts: once the decode replica is chosen, a
    /// prompt of at least `min_prompt_tokens` is split when at least `min_uncached_tokens` of
    /// it are not cached there, and a prefill replica is ready and not too busy
    /// (`max_prefill_queue`: the prefill pool's load, which llm-d's decider does not weigh).
    pub fn of(
        rule: &SplitRule,
        prompt_tokens: usize,
        cached_on_decode: usize,
        prefill: PrefillSide,
    ) -> Self {
        if prompt_tokens < rule.min_prompt_tokens {
            Self::ShortPrompt
        } else if prompt_tokens.saturating_sub(cached_on_decode) < rule.min_uncached_tokens {
            Self::Cached
        } else {
            match prefill {
                PrefillSide::Unready => Self::NoPrefillReplica,
                PrefillSide::Busy => Self::PrefillBusy,
                PrefillSide::Available => Self::Split,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verdict_follows_llm_d_prefix_decider_on_the_decode_replica() {
        let rule = SplitRule {
            min_prompt_tokens: 1000,
            min_uncached_tokens: 500,
            max_prefill_queue: None,
        };
        let available = PrefillSide::Available;
        assert_eq!(
            SplitVerdict::of(&rule, 999, 0, available),
            SplitVerdict::ShortPrompt
        );
        assert_eq!(
            SplitVerdict::of(&rule, 1000, 501, available),
            SplitVerdict::Cached
        );
        assert_eq!(
            SplitVerdict::of(&rule, 1000, 500, available),
            SplitVerdict::Split
        );
        assert_eq!(
            SplitVerdict::of(&rule, 1000, 0, PrefillSide::Unready),
            SplitVerdict::NoPrefillReplica
        );
        assert_eq!(
            SplitVerdict::of(&rule, 1000, 0, PrefillSide::Busy),
            SplitVerdict::PrefillBusy
        );
        // The prompt's own facts come first: a short prompt is short whatever the prefill pool.
        assert_eq!(
            SplitVerdict::of(&rule, 999, 0, PrefillSide::Busy),
            SplitVerdict::ShortPrompt
        );
    }

    #[test]
    fn a_prefill_replica_at_the_queue_bound_takes_no_leg() {
        let bounded = SplitRule {
            min_prompt_tokens: 1000,
            min_uncached_tokens: 500,
            max_prefill_queue: Some(Duration::from_millis(500)),
        };
        assert!(bounded.admits_prefill_queue(499.9, 0.0));
        assert!(!bounded.admits_prefill_queue(500.0, 0.0));
        // A decode replica busier than the prefill replica keeps the leg there.
        assert!(bounded.admits_prefill_queue(800.0, 900.0));
        assert!(!bounded.admits_prefill_queue(900.0, 800.0));
        let unbounded = SplitRule {
            max_prefill_queue: None,
            ..bounded
        };
        assert!(unbounded.admits_prefill_queue(1e12, 0.0));
        assert_eq!(PrefillSide::of(0, 0), PrefillSide::Unready);
        assert_eq!(PrefillSide::of(3, 0), PrefillSide::Busy);
        assert_eq!(PrefillSide::of(3, 1), PrefillSide::Available);
    }
}
