//! The token cache: recent tokenizations by pool and prompt (and conversation prefix), and how a
//! decision's tokens are found or computed within its budget.
//!
//! A decision's request is looked up first (the client's token ids, the whole prompt cached, or
//! its longest cached conversation prefix); on a miss `schedule` takes it through its steps
//! (an earlier turn resumed, the leading part, the whole prompt), `blocking` bounds the work on
//! blocking threads, and `later` finishes whole tokenizations no decision waits for.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_tokenize::ResumePoint;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio_util::task::TaskTracker;

use super::background::BackgroundLane;
use super::cache_keys::prompt_keys;
use super::{CachedKeys, KeysJob, LeadingStep, MultiModalPlaces, Tokenized, Tokenizer};
use crate::config::Config;
use crate::error::TokenizeError;
use crate::lru::Lru;
use crate::metrics::Metrics;
use crate::request::Prompt;
use schedule::{CachedPrefix, Miss};

mod blocking;
mod later;
mod schedule;
#[cfg(test)]
mod tests;

/// Tokens a decision routes on.
#[derive(Debug, Clone)]
pub struct PromptTokens {
    /// Token ids: the whole prompt, or a known prefix of it (see `exact`).
    pub tokens: Arc<[u32]>,
    /// Whether `tokens` is the whole prompt.
    pub exact: bool,
    /// Estimated prompt length in tokens (equals `tokens.len()` when exact).
    pub estimated_len: usize,
    /// Where the tokens came from.
    pub source: TokenSource,
    /// The block keys of `tokens`, when they came from the cache with keys a background
    /// tokenization computed for them (check the fingerprint before use).
    pub keys: Option<CachedKeys>,
    /// The media items the engine placed in `tokens` (render mode), whose identifiers are part
    /// of the keys of the blocks they overlap.
    pub multimodal: Option<Arc<MultiModalPlaces>>,
}

/// Where a decision's tokens came from (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenSource {
    /// The client sent token ids.
    Client,
    /// The whole prompt was in the cache.
    Cache,
    /// A conversation prefix was in the cache.
    PrefixCache,
    /// Tokenized now.
    Tokenizer,
    /// Only the prompt's leading part was tokenized now (exact first tokens; not cached).
    Leading,
    /// Tokenized now from a cached earlier turn on: only the new text encoded (exact).
    Resumed,
}

impl TokenSource {
    /// Metric label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Cache => "cache",
            Self::PrefixCache => "prefix_cache",
            Self::Tokenizer => "tokenizer",
            Self::Leading => "leading",
            Self::Resumed => "resumed",
        }
    }
}

/// Bounds of a [`TokenCache`] and of the in-process tokenizations it starts (config:
/// `token_cache_entries`, `token_cache_bytes`, `limits.tokenize_concurrency`,
/// `limits.tokenize_max_prompt_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenLimits {
    /// Most cached tokenizations.
    pub cache_entries: usize,
    /// Most bytes the cached tokenizations account for ([`cache_entry_bytes`] each).
    pub cache_bytes: usize,
    /// Most tokenizations on blocking threads at once, abandoned ones included.
    pub concurrency: usize,
    /// Largest prompt tokenized whole on a blocking thread, in bytes.
    pub max_prompt_bytes: usize,
}

impl TokenLimits {
    /// The limits `config` sets.
    pub fn from_config(config: &Config) -> Self {
        Self {
            cache_entries: config.token_cache_entries,
            cache_bytes: config.token_cache_bytes,
            concurrency: config.tokenize_concurrency,
            max_prompt_bytes: config.tokenize_max_prompt_bytes,
        }
    }
}

impl Default for TokenLimits {
    /// The config's defaults.
    fn default() -> Self {
        Self {
            cache_entries: crate::config::DEFAULT_TOKEN_CACHE_ENTRIES,
            cache_bytes: crate::config::DEFAULT_TOKEN_CACHE_BYTES,
            concurrency: crate::config::default_tokenize_concurrency(),
            max_prompt_bytes: crate::config::DEFAULT_TOKENIZE_MAX_PROMPT_BYTES,
        }
    }
}

/// What one cached tokenization accounts for besides its tokens: its 16-byte key, the `Arc`'s
/// counts, its slot in the map (value with its resume point, age, weight; the table at most half
/// empty) and in the age index.
const CACHE_ENTRY_OVERHEAD_BYTES: usize = 256;

/// The bytes a cached tokenization of `tokens` accounts for: 4 per token plus
/// `CACHE_ENTRY_OVERHEAD_BYTES`.
pub fn cache_entry_bytes(tokens: &[u32]) -> usize {
    CACHE_ENTRY_OVERHEAD_BYTES + std::mem::size_of_val(tokens)
}

/// What a decision asks the token cache for.
#[derive(Debug, Clone, Copy)]
pub struct TokensRequest<'a> {
    /// The pool's index: each pool has its own entries.
    pub pool: usize,
    /// The model the tokenizer is asked for (base or adapter name, as the client sent it).
    pub model: &'a str,
    /// The request's prompt.
    pub prompt: &'a Prompt<'a>,
    /// The pool's tokenizer (`None`: none configured; only the client's tokens and the cache
    /// answer).
    pub tokenizer: Option<&'a Arc<dyn Tokenizer>>,
    /// How long the decision waits for its tokens.
    pub budget: Duration,
    /// A prompt of at least twice this many bytes that neither the cache nor a cached
    /// conversation prefix knows gets only its exact leading tokens from here on
    /// ([`super::InProcess::tokenize_leading`]; [`TokenSource::Leading`], `exact` false, not
    /// cached) when the tokenizer can. `None`: always the whole prompt.
    pub leading_from: Option<usize>,
    /// How the decision computes block keys: the tokens this request caches (a resumed turn,
    /// a whole tokenization left to the background for the next turn) are cached with them.
    pub keys_job: Option<&'a KeysJob>,
    /// The decision's leading steps so far: a longer leading part takes over the last one's
    /// render and tokens, and leaves its own here for the next. With steps, a leading part
    /// leaves the whole prompt's tokenization to the caller's
    /// [`TokenCache::complete_leading`] once the decision settled on its part.
    pub leading_steps: Option<&'a LeadingSteps>,
}

/// One decision's leading parts of its prompt as they grow ([`TokensRequest::leading_steps`]):
/// the last one, whose rendered chat and tokens the next, longer one takes over, with the prompt
/// it was cut from (its cache key, size and owned copy, for the whole tokenization that follows).
#[derive(Debug, Default)]
pub struct LeadingSteps(Mutex<Option<LastStep>>);

#[derive(Debug, Clone)]
struct LastStep {
    step: LeadingStep,
    key: u128,
    bytes: usize,
    input: Arc<super::TokenizeInput>,
}

impl LeadingSteps {
    fn last(&self) -> Option<LeadingStep> {
        self.0.lock().as_ref().map(|last| last.step.clone())
    }

    fn record(&self, last: LastStep) {
        *self.0.lock() = Some(last);
    }

    fn take(&self) -> Option<LastStep> {
        self.0.lock().take()
    }
}

/// Recent tokenizations, keyed by (pool, prompt or conversation-prefix hash), bounded by entries
/// and bytes; and the slots bounding the blocking tokenizations started for them.
#[derive(Debug)]
pub struct TokenCache {
    entries: Arc<Mutex<Lru<u128, CacheEntry>>>,
    /// Whole tokenizations for a later turn, at low CPU priority (`None`: its thread could not
    /// start; they then run on the blocking pool, bounded by `refills`).
    lane: Option<Arc<BackgroundLane>>,
    /// Cache keys with a lane job queued or running: a prompt is queued once (a decision whose
    /// leading part grows asks again).
    lane_pending: Arc<Mutex<std::collections::HashSet<u128>>>,
    /// Background full tokenizations after a prefix hit; bounded so they never pile up.
    refills: Arc<tokio::sync::Semaphore>,
    /// One permit per tokenization running on a blocking thread.
    blocking: Arc<tokio::sync::Semaphore>,
    max_prompt_bytes: usize,
    /// Recent cost of whole blocking tokenizations, picoseconds per prompt byte (0: none yet).
    blocking_ps_per_byte: Arc<std::sync::atomic::AtomicU64>,
    gauges: CacheGauges,
    last_too_large_log: Mutex<Option<Instant>>,
    tasks: TaskTracker,
}

/// The cache's gauges (unregistered until [`TokenCache::with_metrics`]).
#[derive(Debug, Clone, Default)]
struct CacheGauges {
    bytes: Gauge,
    entries: Gauge,
    blocking_in_flight: Gauge,
    abandoned: Counter,
    /// Whole tokenizations for a later turn not started (lane full, no free slot, too large).
    background_skipped: Counter,
    /// Whole tokenizations for a later turn queued or running on the lane.
    background_queued: Gauge,
}

/// A cached tokenization.
#[derive(Debug)]
struct CacheEntry {
    tokens: Arc<[u32]>,
    /// The media items placed in `tokens` (render mode).
    multimodal: Option<Arc<MultiModalPlaces>>,
    keys: Option<CachedKeys>,
    /// Where the conversation's next turn can take over these tokens.
    resume: Option<ResumePoint>,
}

/// Concurrent background tokenizations finishing after a conversation-prefix hit.
const MAX_CONCURRENT_REFILLS: usize = 2;

/// What the cache lookup found for a request.
enum Lookup {
    /// The decision's tokens: the client's, or the whole prompt's cached.
    Found(PromptTokens),
    /// The whole prompt is not cached.
    Missed {
        /// The whole prompt's cache key.
        key: u128,
        /// The whole prompt's size in bytes (as its cache keys count them).
        bytes: usize,
        /// Its longest cached conversation prefix.
        prefix: Option<CachedPrefix>,
    },
}

impl TokenCache {
    /// A cache within `limits`; refills and blocking tokenizations run on `tasks`.
    pub fn new(limits: TokenLimits, tasks: TaskTracker) -> Self {
        Self {
            entries: Arc::new(Mutex::new(Lru::new(
                limits.cache_entries,
                limits.cache_bytes,
            ))),
            lane: match BackgroundLane::start() {
                Ok(lane) => Some(Arc::new(lane)),
                Err(error) => {
                    tracing::warn!(%error, "no background tokenization thread: later turns' tokenizations share the blocking pool");
                    None
                }
            },
            lane_pending: Arc::default(),
            refills: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_REFILLS)),
            blocking: Arc::new(tokio::sync::Semaphore::new(limits.concurrency.max(1))),
            max_prompt_bytes: limits.max_prompt_bytes,
            blocking_ps_per_byte: Arc::default(),
            gauges: CacheGauges::default(),
            last_too_large_log: Mutex::new(None),
            tasks,
        }
    }

    /// Reports the cache's size and the blocking tokenizations in `metrics`.
    pub fn with_metrics(mut self, metrics: &Metrics) -> Self {
        self.gauges = CacheGauges {
            bytes: metrics.token_cache_bytes.clone(),
            entries: metrics.token_cache_entries.clone(),
            blocking_in_flight: metrics.tokenize_blocking_in_flight.clone(),
            abandoned: metrics.tokenize_abandoned.clone(),
            background_skipped: metrics.tokenize_background_skipped.clone(),
            background_queued: metrics.tokenize_background_queued.clone(),
        };
        self
    }

    /// Bytes the cached tokenizations account for.
    pub fn bytes(&self) -> usize {
        self.entries.lock().bytes()
    }

    /// Tokens of `prompt`, from the client, the cache or `tokenizer` (bounded by `budget`):
    /// [`Self::tokens_for`] of the whole prompt, without block keys.
    pub async fn tokens(
        &self,
        pool: usize,
        model: &str,
        prompt: &Prompt<'_>,
        tokenizer: Option<&Arc<dyn Tokenizer>>,
        budget: Duration,
    ) -> Result<PromptTokens, TokenizeError> {
        self.tokens_for(TokensRequest {
            pool,
            model,
            prompt,
            tokenizer,
            budget,
            leading_from: None,
            keys_job: None,
            leading_steps: None,
        })
        .await
    }

    /// Tokens of `request`'s prompt, from the client, the cache or its tokenizer, within its
    /// budget.
    pub async fn tokens_for(
        &self,
        request: TokensRequest<'_>,
    ) -> Result<PromptTokens, TokenizeError> {
        let deadline = tokio::time::Instant::now() + request.budget;
        let (key, bytes, prefix) = match self.lookup(request.pool, request.prompt)? {
            Lookup::Found(tokens) => return Ok(tokens),
            Lookup::Missed { key, bytes, prefix } => (key, bytes, prefix),
        };
        let tokenizer = request
            .tokenizer
            .ok_or_else(|| TokenizeError::NotConfigured {
                pool: request.pool.to_string(),
            })?;
        let miss = Miss::new(request, tokenizer, deadline, key, bytes, prefix);
        if let Some(tokens) = self.resumed_inline(&miss) {
            return Ok(tokens);
        }
        if let Some(tokens) = self.leading_part(&miss).await? {
            return Ok(tokens);
        }
        self.whole_prompt(&miss).await
    }

    /// The client's tokens, the whole prompt's cached ones, or what the cache knows of it.
    fn lookup(&self, pool: usize, prompt: &Prompt<'_>) -> Result<Lookup, TokenizeError> {
        let client = |tokens: Arc<[u32]>| {
            Lookup::Found(PromptTokens {
                estimated_len: tokens.len(),
                tokens,
                exact: true,
                source: TokenSource::Client,
                keys: None,
                multimodal: None,
            })
        };
        match prompt {
            Prompt::Tokens(ids) => return Ok(client(ids.as_slice().into())),
            Prompt::Absent => return Ok(client(Arc::from([]))),
            Prompt::Text { .. } | Prompt::Chat { .. } | Prompt::Api { .. } => {}
        }
        let keys = prompt_keys(pool, prompt);
        let Some(&(key, bytes)) = keys.last() else {
            return Err(TokenizeError::InProcess {
                reason: "empty prompt".to_owned(),
            });
        };
        let mut entries = self.entries.lock();
        if let Some(entry) = entries.get(&key) {
            return Ok(Lookup::Found(PromptTokens {
                tokens: Arc::clone(&entry.tokens),
                exact: true,
                estimated_len: entry.tokens.len(),
                source: TokenSource::Cache,
                keys: entry.keys.clone(),
                multimodal: entry.multimodal.clone(),
            }));
        }
        let prefix = keys.iter().rev().skip(1).find_map(|(key, bytes)| {
            entries.get(key).map(|entry| CachedPrefix {
                tokens: Arc::clone(&entry.tokens),
                multimodal: entry.multimodal.clone(),
                bytes: *bytes,
                keys: entry.keys.clone(),
                resume: entry.resume,
            })
        });
        Ok(Lookup::Missed { key, bytes, prefix })
    }
}

/// A whole tokenization as the cache keeps it: the tokens, with the media items placed in them.
#[derive(Debug, Clone)]
pub(super) struct Whole {
    pub(super) tokens: Arc<[u32]>,
    pub(super) multimodal: Option<Arc<MultiModalPlaces>>,
}

impl From<Tokenized> for Whole {
    fn from(tokenized: Tokenized) -> Self {
        Self {
            tokens: tokenized.tokens.into(),
            multimodal: tokenized.multimodal,
        }
    }
}

/// Caches `whole` under `key` (an entry heavier than the whole cache is not kept).
fn insert_into(
    entries: &Mutex<Lru<u128, CacheEntry>>,
    gauges: &CacheGauges,
    key: u128,
    whole: Whole,
) {
    insert_entry(
        entries,
        gauges,
        key,
        CacheEntry {
            tokens: whole.tokens,
            multimodal: whole.multimodal,
            keys: None,
            resume: None,
        },
    );
}

/// Caches `entry` (its keys weigh in beside its tokens).
fn insert_entry(
    entries: &Mutex<Lru<u128, CacheEntry>>,
    gauges: &CacheGauges,
    key: u128,
    entry: CacheEntry,
) {
    let bytes = cache_entry_bytes(&entry.tokens)
        + entry
            .keys
            .as_ref()
            .map_or(0, |k| std::mem::size_of_val(&*k.keys))
        + entry
            .multimodal
            .as_ref()
            .map_or(0, |places| places.cache_bytes());
    let mut entries = entries.lock();
    entries.insert(key, entry, bytes);
    gauges.bytes.set(entries.bytes() as i64);
    gauges.entries.set(entries.len() as i64);
}
