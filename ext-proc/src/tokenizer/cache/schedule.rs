//! A cache miss's steps, in order: a conversation's next turn resumed from the turn before (on
//! the calling task), only the prompt's leading part, then the whole prompt, or its cached
//! conversation prefix when the whole one is not expected in time.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_tokenize::{ResumableTokens, ResumePoint};

use super::blocking::{BlockingSlot, record_rate};
use super::later::EarlierTurn;
use super::{
    CacheEntry, LastStep, LeadingSteps, PromptTokens, TokenCache, TokenSource, TokensRequest,
    Whole, insert_entry, insert_into,
};
use crate::error::TokenizeError;
use crate::request::Prompt;
use crate::tokenizer::block_keys::mark_at;
use crate::tokenizer::input::owned_input;
use crate::tokenizer::{
    CachedKeys, LeadingStep, MultiModalPlaces, RequestFuture, TokenizeInput, Tokenized, Tokenizer,
};

/// Rough bytes per token, to estimate the length of text that was not tokenized.
const ESTIMATED_BYTES_PER_TOKEN: usize = 4;

/// How long a request whose conversation prefix is cached waits for its exact tokens, unless an
/// engine computes them over the network (then: the whole budget).
pub(super) const PREFIX_HIT_WAIT: Duration = Duration::from_millis(5);

/// A conversation-prefix hit waits for its exact tokens only when a blocking whole tokenization
/// of its size is expected within this: past it, waiting costs a long prompt more than routing on
/// its cached prefix does (the measurement: docs/benchmarks-history-2026-12.md, "Latency through Envoy with real tokenizers").
const PREFIX_HIT_MAX_EXPECTED: Duration = Duration::from_millis(1);

/// Largest chat (bytes of messages) whose next turn is tokenized from the turn before on the
/// calling task ([`crate::tokenizer::InProcess::tokenize_resumable`]): past it the parse, render
/// and block keys of the whole chat cost more than routing on the cached turn at once and
/// leaving the exact tokens to the background lane (which resumes too; the measurement:
/// docs/benchmarks-history-2026-12.md, "Latency through Envoy with real tokenizers").
const RESUME_INLINE_MAX_BYTES: usize = 32 * 1024;

/// A cached conversation prefix of a prompt.
#[derive(Debug)]
pub(super) struct CachedPrefix {
    pub(super) tokens: Arc<[u32]>,
    /// The media items placed in `tokens` (render mode).
    pub(super) multimodal: Option<Arc<MultiModalPlaces>>,
    /// The prefix's size in bytes (as its cache key counts them).
    pub(super) bytes: usize,
    pub(super) keys: Option<CachedKeys>,
    /// Where this prompt can take over the prefix's tokens.
    pub(super) resume: Option<ResumePoint>,
}

/// A request whose whole prompt is not cached, as each step after the lookup takes it.
pub(super) struct Miss<'a> {
    pub(super) request: TokensRequest<'a>,
    pub(super) tokenizer: &'a Arc<dyn Tokenizer>,
    /// The prompt, owned for the tokenizer.
    pub(super) input: Arc<TokenizeInput>,
    /// When the decision's budget ends.
    pub(super) deadline: tokio::time::Instant,
    /// The whole prompt's cache key and size in bytes.
    pub(super) key: u128,
    pub(super) bytes: usize,
    /// Its longest cached conversation prefix.
    pub(super) prefix: Option<CachedPrefix>,
}

impl<'a> Miss<'a> {
    pub(super) fn new(
        request: TokensRequest<'a>,
        tokenizer: &'a Arc<dyn Tokenizer>,
        deadline: tokio::time::Instant,
        key: u128,
        bytes: usize,
        prefix: Option<CachedPrefix>,
    ) -> Self {
        Self {
            request,
            tokenizer,
            input: Arc::new(owned_input(request.prompt)),
            deadline,
            key,
            bytes,
            prefix,
        }
    }

    /// The prior turn whose tokens this one can take over, if it left a resume point.
    fn prior(&self) -> Option<(&ResumePoint, &[u32])> {
        let prefix = self.prefix.as_ref()?;
        Some((prefix.resume.as_ref()?, &prefix.tokens[..]))
    }

    /// The prior turn's keys, which this turn's extend.
    fn prior_keys(&self) -> Option<(&[u32], &CachedKeys)> {
        let prefix = self.prefix.as_ref()?;
        Some((&prefix.tokens[..], prefix.keys.as_ref()?))
    }

    /// Whether tokenizing the prompt (only its leading part when `leading`) takes a blocking
    /// slot.
    pub(super) fn runs_blocking(&self, leading: bool) -> bool {
        self.tokenizer
            .in_process()
            .is_some_and(|in_process| in_process.runs_blocking(&self.input, leading))
    }

    /// The whole tokenization of the prompt: the request's own body goes along for tokenizers
    /// that send it on (render, which also places the request's media items).
    pub(super) fn start_tokenizing(&self) -> RequestFuture {
        let (tokenizer, model, input) = (self.tokenizer, self.request.model, &self.input);
        match self.request.prompt {
            Prompt::Text { body, .. } | Prompt::Chat { body, .. } | Prompt::Api { body, .. } => {
                tokenizer.tokenize_request(model, Arc::clone(input), body)
            }
            Prompt::Tokens(_) | Prompt::Absent => {
                let tokenizing = tokenizer.tokenize(model, Arc::clone(input));
                Box::pin(async move { tokenizing.await.map(Tokenized::text) })
            }
        }
    }

    /// How long a conversation-prefix hit waits for the exact tokens.
    fn prefix_hit_wait(&self) -> Duration {
        let most = if self.tokenizer.mode().is_network() {
            Duration::MAX
        } else {
            PREFIX_HIT_WAIT
        };
        self.request.budget.min(most)
    }
}

impl TokenCache {
    /// A conversation's next turn: only the text it added is encoded, on this task (the whole
    /// chat is parsed and rendered: tens of microseconds at this size).
    pub(super) fn resumed_inline(&self, miss: &Miss<'_>) -> Option<PromptTokens> {
        let prior = miss.prior()?;
        if miss.input.len_bytes() > RESUME_INLINE_MAX_BYTES {
            return None;
        }
        let Some(Ok(resumed)) = miss
            .tokenizer
            .in_process()?
            .tokenize_resumable(&miss.input, Some(prior))
        else {
            return None;
        };
        Some(self.cache_resumed(miss, resumed))
    }

    /// Only the prompt's exact leading tokens, when the request settles for them, nothing of the
    /// prompt is cached, it is long enough and the tokenizer can cut it; a complete one is
    /// cached, otherwise the whole prompt is left for the background (`None`: not this step).
    pub(super) async fn leading_part(
        &self,
        miss: &Miss<'_>,
    ) -> Result<Option<PromptTokens>, TokenizeError> {
        let Some(min_bytes) = miss.request.leading_from else {
            return Ok(None);
        };
        let Some(in_process) = miss.tokenizer.in_process() else {
            return Ok(None);
        };
        if miss.prefix.is_some() || miss.bytes < 2 * min_bytes {
            return Ok(None);
        }
        let budget = miss.request.budget;
        let slot = if miss.runs_blocking(true) {
            Some(self.blocking_slot(miss.deadline, budget).await?)
        } else {
            None
        };
        let steps = miss.request.leading_steps;
        let shorter = steps.and_then(LeadingSteps::last);
        let Some(leading) =
            in_process.tokenize_leading(Arc::clone(&miss.input), min_bytes, shorter)
        else {
            return Ok(None);
        };
        let leading = self.bounded(leading, slot, miss.deadline, budget).await?;
        let rendered = leading.rendered;
        let tokens: Arc<[u32]> = leading.tokens.into();
        if let (Some(steps), Some(rendered), Some(resume)) = (steps, &rendered, leading.resume) {
            steps.record(LastStep {
                step: LeadingStep {
                    rendered: Arc::clone(rendered),
                    tokens: Arc::clone(&tokens),
                    resume,
                },
                key: miss.key,
                bytes: miss.bytes,
                input: Arc::clone(&miss.input),
            });
        }
        if leading.complete {
            let keys = miss
                .request
                .keys_job
                .and_then(|job| job.keys_for(&tokens, None, mark_at(&tokens, leading.resume)));
            let entry = CacheEntry {
                tokens: Arc::clone(&tokens),
                multimodal: None,
                keys: keys.clone(),
                resume: leading.resume,
            };
            insert_entry(&self.entries, &self.gauges, miss.key, entry);
            return Ok(Some(PromptTokens {
                keys,
                ..tokenized(Whole {
                    tokens,
                    multimodal: None,
                })
            }));
        }
        // The next turn starts with this whole prompt and, were it not cached, would pay for its
        // leading part and then all of it. The lane encodes only the rest: from this part's cut,
        // or, for a decision that may grow its part, from its longest part's once it is done
        // (`TokenCache::complete_leading`).
        if steps.is_none() {
            let earlier = leading.resume.map(|resume| EarlierTurn {
                resume,
                tokens: Arc::clone(&tokens),
                keys: None,
            });
            self.complete_later(miss, earlier, rendered);
        }
        // The rest of the prompt at the leading part's own bytes per token (a chat rendered
        // only up to its leading part: its request's size in bytes stands for the rendering's).
        let total_bytes = leading.total_bytes.unwrap_or(miss.bytes);
        let rest = total_bytes.saturating_sub(leading.text_bytes);
        let estimated_len = tokens.len() + rest * tokens.len() / leading.text_bytes.max(1);
        Ok(Some(PromptTokens {
            tokens,
            exact: false,
            estimated_len,
            source: TokenSource::Leading,
            keys: None,
            multimodal: None,
        }))
    }

    /// Ends a decision's leading steps ([`TokensRequest::leading_steps`]) that routed on a
    /// leading part: the whole prompt is tokenized in the background from the longest part's
    /// cut, with the chat it rendered, and cached for the conversation's next turn.
    pub fn complete_leading(&self, request: TokensRequest<'_>) {
        let (Some(last), Some(tokenizer)) = (
            request.leading_steps.and_then(LeadingSteps::take),
            request.tokenizer,
        ) else {
            return;
        };
        let miss = Miss {
            request,
            tokenizer,
            input: last.input,
            deadline: tokio::time::Instant::now(),
            key: last.key,
            bytes: last.bytes,
            prefix: None,
        };
        let earlier = EarlierTurn {
            resume: last.step.resume,
            tokens: last.step.tokens,
            keys: None,
        };
        self.complete_later(&miss, Some(earlier), Some(last.step.rendered));
    }

    /// The whole prompt's tokens within the budget, or its cached conversation prefix when they
    /// are not expected (or do not come) in time.
    pub(super) async fn whole_prompt(
        &self,
        miss: &Miss<'_>,
    ) -> Result<PromptTokens, TokenizeError> {
        if let Some(tokens) = self.prefix_at_once(miss) {
            return Ok(tokens);
        }
        let budget = miss.request.budget;
        let slot = if miss.runs_blocking(false) {
            let bytes = miss.input.len_bytes();
            if bytes > self.max_prompt_bytes {
                self.log_too_large(bytes);
                return Err(TokenizeError::PromptTooLarge {
                    bytes,
                    limit: self.max_prompt_bytes,
                });
            }
            Some(self.blocking_slot(miss.deadline, budget).await?)
        } else {
            None
        };
        if slot.is_none()
            && let Some(Ok(resumed)) = miss
                .tokenizer
                .in_process()
                .and_then(|in_process| in_process.tokenize_resumable(&miss.input, miss.prior()))
        {
            return Ok(self.cache_resumed(miss, resumed));
        }
        let caching = self.caching(miss, slot.is_some());
        match &miss.prefix {
            Some(prefix) => Ok(self.wait_on_prefix_hit(miss, prefix, caching, slot).await),
            None => self
                .bounded(caching, slot, miss.deadline, budget)
                .await
                .map(tokenized),
        }
    }

    /// The cached prefix at once, when the prompt's whole tokenization is blocking work not
    /// expected within `PREFIX_HIT_MAX_EXPECTED`: waiting would add more than the routing path
    /// may cost (32k tokens take ≈ 3 ms). The cached prefix is exact; the whole tokens follow in
    /// the background for the next turn.
    fn prefix_at_once(&self, miss: &Miss<'_>) -> Option<PromptTokens> {
        let prefix = miss.prefix.as_ref()?;
        let too_slow = miss.runs_blocking(false)
            && self.expected_blocking(miss.bytes)
                > PREFIX_HIT_MAX_EXPECTED.min(miss.prefix_hit_wait());
        if !too_slow {
            return None;
        }
        let earlier = prefix.resume.map(|resume| EarlierTurn {
            resume,
            tokens: Arc::clone(&prefix.tokens),
            keys: prefix.keys.clone(),
        });
        self.complete_later(miss, earlier, None);
        Some(on_cached_prefix(prefix, miss.bytes))
    }

    /// The prompt's whole tokenization, caching its result as it ends: whoever finishes it
    /// caches it (this decision, or, once it stopped waiting, the task left running it). A
    /// tokenization holding a blocking slot (`timed`) updates the recent cost per byte.
    fn caching(
        &self,
        miss: &Miss<'_>,
        timed: bool,
    ) -> impl Future<Output = Result<Whole, TokenizeError>> + Send + 'static + use<> {
        let tokenizing = miss.start_tokenizing();
        let entries = Arc::clone(&self.entries);
        let gauges = self.gauges.clone();
        let rate = timed.then(|| Arc::clone(&self.blocking_ps_per_byte));
        let (key, bytes) = (miss.key, miss.bytes);
        async move {
            let started = Instant::now();
            let whole = Whole::from(tokenizing.await?);
            if let Some(rate) = rate {
                record_rate(&rate, started.elapsed(), bytes);
            }
            insert_into(&entries, &gauges, key, whole.clone());
            Ok(whole)
        }
    }

    /// The exact tokens are worth a short wait (the fast encoder needs well under a millisecond
    /// for a long conversation; a network tokenizer gets the whole budget); past it, route on
    /// the conversation's cached prefix and let the tokenization finish in the background for
    /// the next turn.
    async fn wait_on_prefix_hit(
        &self,
        miss: &Miss<'_>,
        prefix: &CachedPrefix,
        caching: impl Future<Output = Result<Whole, TokenizeError>> + Send + 'static,
        slot: Option<BlockingSlot>,
    ) -> PromptTokens {
        let wait = miss.prefix_hit_wait();
        let wait_until = tokio::time::Instant::now() + wait;
        let exact = match slot {
            // Already a task of its own, which finishes (and caches) if this stops waiting.
            Some(slot) => self.bounded(caching, Some(slot), wait_until, wait).await,
            None => {
                let mut caching = Box::pin(caching);
                match tokio::time::timeout_at(wait_until, &mut caching).await {
                    Ok(result) => result,
                    Err(_) => {
                        self.finish_in_background(caching);
                        Err(TokenizeError::Timeout { after: wait })
                    }
                }
            }
        };
        match exact {
            Ok(tokens) => return tokenized(tokens),
            Err(TokenizeError::Timeout { .. }) => {}
            Err(error) => {
                tracing::debug!(%error, "tokenizing a conversation failed; routing on its cached prefix");
            }
        }
        on_cached_prefix(prefix, miss.bytes)
    }

    /// Caches a chat's whole tokenization with its resume point, as the decision's tokens.
    /// With the request's keys job, the keys too (extending the prior turn's where they share
    /// its blocks), so that the next turn extends these.
    fn cache_resumed(&self, miss: &Miss<'_>, resumed: ResumableTokens) -> PromptTokens {
        let tokens: Arc<[u32]> = resumed.tokens.into();
        let keys = miss.request.keys_job.and_then(|job| {
            job.keys_for(&tokens, miss.prior_keys(), mark_at(&tokens, resumed.resume))
        });
        let entry = CacheEntry {
            tokens: Arc::clone(&tokens),
            multimodal: None,
            keys: keys.clone(),
            resume: resumed.resume,
        };
        insert_entry(&self.entries, &self.gauges, miss.key, entry);
        PromptTokens {
            source: if resumed.prior_taken {
                TokenSource::Resumed
            } else {
                TokenSource::Tokenizer
            },
            keys,
            ..tokenized(Whole {
                tokens,
                multimodal: None,
            })
        }
    }
}

/// A prompt of `full_bytes` routed on its conversation's cached `prefix`; the rest estimated.
fn on_cached_prefix(prefix: &CachedPrefix, full_bytes: usize) -> PromptTokens {
    let tail = full_bytes.saturating_sub(prefix.bytes) / ESTIMATED_BYTES_PER_TOKEN;
    PromptTokens {
        estimated_len: prefix.tokens.len() + tail,
        tokens: Arc::clone(&prefix.tokens),
        exact: false,
        source: TokenSource::PrefixCache,
        keys: prefix.keys.clone(),
        multimodal: prefix.multimodal.clone(),
    }
}

/// A whole tokenization as a decision's tokens.
fn tokenized(whole: Whole) -> PromptTokens {
    let estimated_len = whole.tokens.len();
    PromptTokens {
        tokens: whole.tokens,
        exact: true,
        estimated_len,
        source: TokenSource::Tokenizer,
        keys: None,
        multimodal: whole.multimodal,
    }
}
