//! Prefill/decode disaggregation: whether a request whose decode replica is chosen has its
//! prompt computed on a prefill replica. One implementation for ext-proc's picker and the
//! replay simulator, so both decide the same on the same facts.

/// Default `min_prompt_tokens`: llm-d's documented example; below a thousand tokens a prefill
/// is a few milliseconds, less than the KV transfer it would need.
pub const DEFAULT_MIN_PROMPT_TOKENS: usize = 1024;
/// Default `min_uncached_tokens`: llm-d's documented example (half the prompt floor): a mostly
/// cached prompt is cheaper to finish on its decode replica.
pub const DEFAULT_MIN_UNCACHED_TOKENS: usize = 512;

/// The thresholds of the decision (`pools[].disaggregation` in ext-proc's config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitRule {
    /// Prompts shorter than this many tokens are served whole on the decode replica.
    pub min_prompt_tokens: usize,
    /// A prompt is split when at least this many of its tokens are not cached on the chosen
    /// decode replica.
    pub min_uncached_tokens: usize,
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
            Self::NoPrompt => "no_prompt",
        }
    }

    /// llm-d's prefix-based decider, on kvroute's facts: once the decode replica is chosen, a
    /// prompt of at least `min_prompt_tokens` is split when at least `min_uncached_tokens` of
    /// it are not cached there, and a prefill replica is ready.
    pub fn of(
        rule: &SplitRule,
        prompt_tokens: usize,
        cached_on_decode: usize,
        prefill_ready: bool,
    ) -> Self {
        if prompt_tokens < rule.min_prompt_tokens {
            Self::ShortPrompt
        } else if prompt_tokens.saturating_sub(cached_on_decode) < rule.min_uncached_tokens {
            Self::Cached
        } else if !prefill_ready {
            Self::NoPrefillReplica
        } else {
            Self::Split
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
        };
        assert_eq!(
            SplitVerdict::of(&rule, 999, 0, true),
            SplitVerdict::ShortPrompt
        );
        assert_eq!(
            SplitVerdict::of(&rule, 1000, 501, true),
            SplitVerdict::Cached
        );
        assert_eq!(
            SplitVerdict::of(&rule, 1000, 500, true),
            SplitVerdict::Split
        );
        assert_eq!(
            SplitVerdict::of(&rule, 1000, 0, false),
            SplitVerdict::NoPrefillReplica
        );
    }
}
