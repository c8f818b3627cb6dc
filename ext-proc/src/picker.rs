//! The routing decision: request → replica, through the tiers of design.md, within the budget.
//!
//! 1. **precise**: tokens → block keys → `Match` on the index; per replica the index's leading
//!    blocks, merged with speculative inserts (`max(index, speculative)`);
//! 2. **approximate**: for replicas the index cannot vouch for (pool without events, replica not
//!    `precise`, index down or late), the routed-prefix memory;
//! 3. **load**: no tokens (tokenizer missing, failed, late) or the budget ran out: lowest queue.
//!
//! A decision has two steps. The slow one (tokenize, index call) runs concurrently with other
//! decisions, under the budget. The quick one (read the prefix memory and loads, score, then record
//! the speculative insert and the in-flight load) has no await and runs under a lock striped by
//! the prompt's first block key: siblings of a burst, which share that key, each see all earlier
//! siblings' choices, while unrelated prompts do not wait on each other.
//!
//! Every decision with tokens also records what it predicts the replica's engine will report as
//! cached (the `drift` module); while a replica of the pool drifts and `drift.action` is
//! `approximate`, the pool's decisions skip the index (counted as fallback stage `index`, cause
//! `drift`) and route on the approximate tier.
//!
//! Nothing inside kvroute fails a request: every fallback is counted in
//! `kvroute_extproc_fallbacks_total{stage, cause}` and the decision in
//! `kvroute_extproc_decisions_total{tier, reason}`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use kvroute_index_api::api::{MatchRequest, MatchResponse};
use kvroute_routing::load::{InflightGuard, LoadBoard};
use kvroute_routing::policy::Reason;
use kvroute_routing::{Indexed, PromptFacts, RouteRequest, Router};
use tokio_util::task::TaskTracker;

use crate::config::{Config, Pool, Replica, TokenizerSource};
use crate::error::{ConfigError, RequestError};
use crate::index_client::IndexClient;
use crate::metrics::{
    DecisionLabels, FallbackLabels, KindLabel, Metrics, ReplicaLabel, ReplicaStateLabels,
};
use crate::request::ParsedRequest;
use crate::scrape::Scraper;
use crate::tokenizer::{KeysJob, PromptTokens, TokenCache, TokenLimits, TokenSource, Tokenizer};

pub use kvroute_routing::Tier;

/// Why a load-tier decision had no prefix information (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LoadCause {
    NoTokenizer,
    TokenizerFailed,
    TokenizerTimeout,
    /// Every in-process tokenization slot stayed taken for the whole budget.
    TokenizerBusy,
    /// The prompt exceeds `limits.tokenize_max_prompt_bytes` (and has no usable leading part).
    PromptTooLarge,
    KeyError,
    NoPrompt,
    BudgetExhausted,
}

impl LoadCause {
    fn as_label(self) -> &'static str {
        match self {
            Self::NoTokenizer => "no_tokenizer",
            Self::TokenizerFailed => "tokenizer_failed",
            Self::TokenizerTimeout => "tokenizer_timeout",
            Self::TokenizerBusy => "tokenizer_busy",
            Self::PromptTooLarge => "prompt_too_large",
            Self::KeyError => "key_error",
            Self::NoPrompt => "no_prompt",
            Self::BudgetExhausted => "budget_exhausted",
        }
    }
}

/// Why a decision with keys did not ask the index (a fallback cause label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IndexSkip {
    /// The pool has no KV events (`events: false`).
    PoolWithoutEvents,
    /// A replica of the pool drifts and `drift.action` is `approximate`.
    Drift,
}

impl IndexSkip {
    fn as_label(self) -> &'static str {
        match self {
            Self::PoolWithoutEvents => "pool_without_events",
            Self::Drift => "drift",
        }
    }
}

/// A prompt of at least twice this many bytes is first tokenized only up to the first exact cut
/// from here (`kvroute_tokenize::leading_cut`; ≈ 350 tokens, 20-odd blocks): enough to show that
/// no replica holds the prompt, which is all a miss needs; a 1k-token miss encodes a third of its
/// prompt, a 32k-token one a hundredth, and the background lane encodes the rest from the cut
/// for the next turn (docs/benchmarks-history-2026-12.md, "Latency through Envoy with real tokenizers": 4 KiB
/// measured 1.31–1.34× the no-op ext_proc at 1k tokens, 1 KiB 1.24–1.25×).
const LEADING_BYTES: usize = 1024;
/// When some candidate holds every block of the leading part, the next part is this many times
/// longer (4, 16, 64 KiB, …, then the whole prompt): a long shared system prompt costs a few
/// steps, not a whole-prompt tokenization.
const LEADING_GROWTH: usize = 4;

/// How a request's block keys are computed (`pool`'s scheme and block size, its adapter and
/// salt), for a background whole tokenization to cache them with the tokens.
fn keys_job(pool: &Pool, adapter: Option<&crate::config::Adapter>, salt: Option<&str>) -> KeysJob {
    let scheme = pool.key_scheme.clone();
    let block_size = pool.block_size;
    let adapter = adapter.cloned();
    let salt = salt.map(str::to_owned);
    let fingerprint = xxhash_rust::xxh3::xxh3_64(
        format!("{scheme:?}/{block_size}/{adapter:?}/{salt:?}").as_bytes(),
    );
    KeysJob {
        fingerprint,
        block_size: block_size as usize,
        compute: Arc::new(move |from, tokens, mark, out| {
            let lora = adapter.as_ref().map(crate::config::Adapter::as_lora_ref);
            scheme.extend_prompt_keys(
                from,
                tokens,
                block_size as usize,
                lora.as_ref(),
                salt.as_deref(),
                mark,
                out,
            )
        }),
    }
}

/// How many of a prompt's `keys` the index is asked about: vLLM recomputes at least the last
/// prompt token, so at most `(prompt_tokens - 1) / block_size` blocks can hit. For a dense model
/// that only caps the answer; for a hybrid one the cut decides which window blocks the hit needs,
/// so the index must see the same cut. A leading part's keys are all asked about (the whole
/// prompt is longer).
fn match_blocks(tokens: &PromptTokens, block_size: u32, keys: usize) -> usize {
    if !tokens.exact {
        return keys;
    }
    let most = tokens.tokens.len().saturating_sub(1) / block_size.max(1) as usize;
    keys.min(most)
}

/// What every step of a decision's slow part reads: the request, where it may go, by when, and
/// how its block keys are computed.
struct DecisionContext<'a> {
    runtime: &'a Runtime,
    pool_index: usize,
    pool: &'a Pool,
    adapter: Option<&'a crate::config::Adapter>,
    request: &'a ParsedRequest<'a>,
    candidates: &'a [&'a Replica],
    deadline: Instant,
    keys_job: KeysJob,
}

/// What the slow step learned about a prompt.
#[derive(Debug)]
struct PrefixFacts {
    /// Its block keys.
    keys: Vec<u64>,
    /// The index's answer, when it was asked and answered in time.
    index_answer: Option<MatchResponse>,
    /// Estimated prompt length in tokens.
    prompt_tokens: usize,
}

/// A routing decision. Dropping it ends the replica's in-flight accounting for the request.
#[derive(Debug)]
pub struct Decision {
    /// Chosen replica id.
    pub replica_id: String,
    /// Its `ip:port`.
    pub address: SocketAddr,
    /// Its Envoy cluster, for `cluster_header` routes.
    pub envoy_cluster: Option<String>,
    /// Tier that decided.
    pub tier: Tier,
    /// Reason label.
    pub reason: &'static str,
    /// Prompt tokens predicted to be cached on the chosen replica (0 on the load tier).
    pub predicted_cached_tokens: usize,
    /// In-flight accounting (released at response headers or stream end).
    pub inflight: InflightGuard,
    /// Where a proxy's retries go if the chosen replica fails, best first (`epp.fallbacks`).
    pub fallbacks: Vec<SocketAddr>,
}

impl Decision {
    /// The GIE destination value: the chosen `ip:port`, then the fallbacks, comma-separated
    /// (the same string goes in the header and in `envoy.lb` metadata).
    pub fn destination(&self) -> String {
        let mut value = self.address.to_string();
        for fallback in &self.fallbacks {
            value.push(',');
            value.push_str(&fallback.to_string());
        }
        value
    }
}

/// One config snapshot with what was built from it.
#[derive(Debug)]
pub struct Runtime {
    /// The validated config.
    pub config: Arc<Config>,
    tokenizers: Vec<Option<Arc<dyn Tokenizer>>>,
    index: IndexClient,
}

impl Runtime {
    /// Builds tokenizers and the index client. Reuses tokenizers of `previous` whose source did
    /// not change (loading a model folder is slow).
    pub fn build(
        config: Config,
        previous: Option<&Runtime>,
        tasks: &TaskTracker,
    ) -> Result<Self, ConfigError> {
        let mut tokenizers = Vec::with_capacity(config.pools.len());
        for (i, pool) in config.pools.iter().enumerate() {
            let reused = previous.and_then(|p| {
                let j = p
                    .config
                    .pools
                    .iter()
                    .position(|old| old.tokenizer == pool.tokenizer)?;
                p.tokenizers[j].clone()
            });
            let tokenizer = match (&pool.tokenizer, reused) {
                (TokenizerSource::None, _) => None,
                (_, Some(reused)) => Some(reused),
                (source, None) => crate::tokenizer::from_source(source, i, tasks)?,
            };
            tokenizers.push(tokenizer);
        }
        // The embedded index lives as long as the process: a reload keeps it (and says so when
        // the reloaded config asks for another).
        if let Some(previous) = previous
            && previous.config.embedded_index != config.embedded_index
        {
            tracing::warn!(
                "index.embedded changed: it takes effect when kvroute-ext-proc restarts"
            );
        }
        let index = IndexClient::new(
            &config.index_addresses,
            config.index_retry_after,
            config.index_tls.as_ref(),
        )
        .with_token(config.index_token.as_ref())
        .with_local(previous.and_then(|p| p.index.local().cloned()));
        Ok(Self {
            config: Arc::new(config),
            tokenizers,
            index,
        })
    }

    /// Answers `Match` from `local`, the index embedded in this process.
    pub fn with_local_index(mut self, local: crate::embedded::LocalMatcher) -> Self {
        self.index = self.index.with_local(Some(local));
        self
    }

    /// Installs a tokenizer for a pool (tests and embedders).
    pub fn with_tokenizer(mut self, pool: usize, tokenizer: Arc<dyn Tokenizer>) -> Self {
        if let Some(slot) = self.tokenizers.get_mut(pool) {
            *slot = Some(tokenizer);
        }
        self
    }
}

/// The endpoint picker.
#[derive(Debug)]
pub struct Picker {
    runtime: ArcSwap<Runtime>,
    /// Loads, routed-prefix memory and the score-and-commit step.
    router: Router,
    scraper: Scraper,
    token_cache: TokenCache,
    metrics: Metrics,
}

impl Picker {
    /// A picker over `runtime`.
    pub fn new(runtime: Runtime, metrics: Metrics, tasks: TaskTracker) -> Self {
        let token_cache = TokenCache::new(TokenLimits::from_config(&runtime.config), tasks)
            .with_metrics(&metrics);
        Self {
            runtime: ArcSwap::from_pointee(runtime),
            router: Router::new(Scraper::load_board(&metrics)),
            scraper: Scraper::new(metrics.clone()),
            token_cache,
            metrics,
        }
    }

    /// Breaks ties between equal estimates with a generator seeded by `seed` (reproducible runs:
    /// simulations, and the test that the replay simulator decides as this picker does); by
    /// default the generator is seeded from the OS. Call before routing: it starts a fresh board.
    pub fn with_tie_seed(mut self, seed: u64) -> Self {
        self.router = Router::with_rng(
            Scraper::load_board(&self.metrics),
            rand::SeedableRng::seed_from_u64(seed),
        );
        self
    }

    /// The current snapshot.
    pub fn runtime(&self) -> Arc<Runtime> {
        self.runtime.load_full()
    }

    /// Swaps in a new snapshot (config reload).
    pub fn replace_runtime(&self, runtime: Runtime) {
        let ids: std::collections::HashSet<String> = runtime
            .config
            .replicas
            .iter()
            .map(|r| r.id.clone())
            .collect();
        self.router.retain(|id| ids.contains(id));
        self.scraper.retain(|id| ids.contains(id));
        self.runtime.store(Arc::new(runtime));
    }

    /// Replica load records (scraper and tests).
    pub fn loads(&self) -> &LoadBoard {
        self.router.loads()
    }

    /// Scrapes every replica's engine once (the scrape loop's step).
    pub async fn scrape_all(&self, config: &Config) {
        self.scraper.scrape_all(self.router.loads(), config).await;
    }

    /// Metric handles.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Decides where `request` goes. `subset` (GIE subset hint) restricts the candidates.
    pub async fn decide(
        &self,
        request: &ParsedRequest<'_>,
        subset: Option<&[SocketAddr]>,
    ) -> Result<Decision, RequestError> {
        let started = Instant::now();
        let runtime = self.runtime.load_full();
        let result = self.decide_in(&runtime, request, subset, started).await;
        self.metrics
            .decision_duration
            .observe(started.elapsed().as_secs_f64());
        match &result {
            Ok(decision) => {
                self.metrics
                    .decisions
                    .get_or_create(&DecisionLabels {
                        tier: decision.tier.as_label(),
                        reason: decision.reason,
                    })
                    .inc();
            }
            Err(e) => {
                self.metrics
                    .request_errors
                    .get_or_create(&KindLabel { kind: e.as_label() })
                    .inc();
            }
        }
        result
    }

    async fn decide_in(
        &self,
        runtime: &Runtime,
        request: &ParsedRequest<'_>,
        subset: Option<&[SocketAddr]>,
        started: Instant,
    ) -> Result<Decision, RequestError> {
        let config = &runtime.config;
        let (pool_index, adapter) = config.pool_for_model(&request.model).ok_or_else(|| {
            if request.model.is_empty() {
                // Several pools and no `default_pool`: which base model is meant is unknown.
                RequestError::MissingField { field: "model" }
            } else {
                RequestError::UnknownModel {
                    model: request.model.to_string(),
                }
            }
        })?;
        let pool = &config.pools[pool_index];
        let candidates: Vec<&Replica> = config
            .replicas
            .iter()
            .filter(|r| r.pool == pool_index)
            .filter(|r| subset.is_none_or(|s| s.contains(&r.address)))
            .filter(|r| {
                self.loads()
                    .replica(&r.id)
                    .is_ready(config.scrape.unready_after_failures)
            })
            .collect();
        if candidates.is_empty() {
            return Err(RequestError::NoReadyReplica {
                model: request.model.to_string(),
            });
        }
        if let Some(shedding) = &config.epp.shedding
            && candidates
                .iter()
                .all(|r| self.is_saturated(&r.id, shedding))
        {
            return Err(RequestError::Saturated {
                model: request.model.to_string(),
            });
        }
        let deadline = started + config.decision_budget;
        let facts = tokio::time::timeout_at(
            deadline.into(),
            self.prefix_facts(runtime, pool_index, adapter, request, &candidates, deadline),
        )
        .await
        .unwrap_or_else(|_| {
            self.count_fallback("decision", "budget_exhausted");
            Err(LoadCause::BudgetExhausted)
        });
        self.score_and_commit(config, pool, &candidates, facts)
            .ok_or_else(|| RequestError::NoReadyReplica {
                model: request.model.to_string(),
            })
    }

    /// GIE's saturation test on the last scrape: queue or KV cache at its bound.
    fn is_saturated(&self, replica: &str, shedding: &crate::config::Shedding) -> bool {
        let scraped = self.loads().replica(replica).snapshot().scraped;
        scraped.waiting >= shedding.queue_depth || scraped.kv_usage >= shedding.kv_cache_usage
    }

    /// The quick step: the routing core scores and records the choice (speculative insert,
    /// in-flight load) under its commit stripe, so a sibling decided next sees it. `None` only
    /// without candidates.
    fn score_and_commit(
        &self,
        config: &Config,
        pool: &Pool,
        candidates: &[&Replica],
        facts: Result<PrefixFacts, LoadCause>,
    ) -> Option<Decision> {
        let ids: Vec<&str> = candidates.iter().map(|r| r.id.as_str()).collect();
        let (prompt, load_cause) = match facts {
            Ok(facts) => {
                let indexed = candidates
                    .iter()
                    .map(|replica| {
                        let answer = facts.index_answer.as_ref()?;
                        answer
                            .replicas
                            .iter()
                            .find(|m| m.replica_id == replica.id && m.precise)
                            .map(|m| Indexed {
                                matched_blocks: m.matched_blocks,
                                // An older index leaves it 0: its answers are dense ones.
                                prefix_blocks: m.prefix_blocks.max(m.matched_blocks),
                            })
                    })
                    .collect();
                let prompt = PromptFacts {
                    keys: facts.keys,
                    prompt_tokens: facts.prompt_tokens,
                    indexed,
                };
                (Some(prompt), LoadCause::NoPrompt)
            }
            Err(cause) => (None, cause),
        };
        let prompt_tokens = prompt.as_ref().map_or(0, |p| p.prompt_tokens);
        let routed = self.router.score_and_commit(RouteRequest {
            candidates: &ids,
            prompt,
            block_size: pool.block_size,
            capacity_blocks: pool.approx_capacity_blocks,
            scoring: &config.scoring,
            now: Instant::now(),
        })?;
        if routed.tier != Tier::Load && prompt_tokens > 0 {
            self.metrics
                .predicted_cached_share
                .observe(routed.cached_tokens as f64 / prompt_tokens as f64);
        }
        let replica = candidates[routed.choice];
        let fallbacks = routed
            .fallbacks
            .iter()
            .take(config.epp.fallbacks)
            .map(|&i| candidates[i].address)
            .collect();
        Some(Decision {
            fallbacks,
            replica_id: replica.id.clone(),
            address: replica.address,
            envoy_cluster: replica.envoy_cluster.clone(),
            tier: routed.tier,
            reason: routed
                .reason
                .map_or(load_cause.as_label(), Reason::as_label),
            predicted_cached_tokens: routed.cached_tokens,
            inflight: routed.inflight,
        })
    }

    /// Envoy served `decision`'s request on `served`, not the chosen replica (a retry walked the
    /// fallback list, or the proxy ignored the destination): the served replica is remembered as
    /// holding the prompt's blocks, and the chosen one gets no prediction for it. An address that
    /// is no replica of the running config is left alone.
    pub fn served_elsewhere(&self, decision: &mut Decision, served: SocketAddr) {
        let keys = decision.inflight.served_elsewhere();
        let runtime = self.runtime();
        let config = &runtime.config;
        let Some(replica) = config.replicas.iter().find(|r| r.address == served) else {
            return;
        };
        let capacity = config.pools[replica.pool].approx_capacity_blocks;
        self.router
            .remember_served(&replica.id, capacity, &keys, Instant::now());
    }

    /// The slow step: tokens, keys and the index's answer.
    async fn prefix_facts(
        &self,
        runtime: &Runtime,
        pool_index: usize,
        adapter: Option<&crate::config::Adapter>,
        request: &ParsedRequest<'_>,
        candidates: &[&Replica],
        deadline: Instant,
    ) -> Result<PrefixFacts, LoadCause> {
        let config = &runtime.config;
        if matches!(request.prompt, crate::request::Prompt::Absent) {
            return Err(LoadCause::NoPrompt);
        }
        let context = DecisionContext {
            runtime,
            pool_index,
            pool: &config.pools[pool_index],
            adapter,
            request,
            candidates,
            deadline,
            keys_job: keys_job(
                &config.pools[pool_index],
                adapter,
                request.cache_salt.as_deref(),
            ),
        };
        // A long prompt first gets only its exact leading tokens. Keys are chained, so a replica
        // holding fewer than all of their blocks holds no block past them either: unless some
        // replica holds all of them, the match (and so the decision) is the whole prompt's.
        let mut leading_bytes = LEADING_BYTES;
        let (mut source, mut facts) = self.tokens_and_facts(&context, leading_bytes).await?;
        // Some replica holds the whole leading part: the rest can matter, so a larger one (in
        // the end the whole prompt, once the part would be over half of it). Should that fail
        // or be late, the smaller part still names the holders (a lower bound of what they
        // hold, the fallback counted).
        while source == TokenSource::Leading
            && self.holds_all(candidates, &facts.keys, facts.index_answer.as_ref(), config)
        {
            leading_bytes = leading_bytes.saturating_mul(LEADING_GROWTH);
            let Ok(larger) = self.tokens_and_facts(&context, leading_bytes).await else {
                break;
            };
            (source, facts) = larger;
        }
        Ok(facts)
    }

    /// One step of [`Self::prefix_facts`]: the prompt's tokens (only the leading ones from
    /// `leading_bytes` on when possible), their keys and the index's answer.
    async fn tokens_and_facts(
        &self,
        context: &DecisionContext<'_>,
        leading_bytes: usize,
    ) -> Result<(TokenSource, PrefixFacts), LoadCause> {
        let tokens = self.prompt_tokens(context, leading_bytes).await?;
        let (keys, index_answer) = self.keys_and_index(context, &tokens).await?;
        Ok((
            tokens.source,
            PrefixFacts {
                keys,
                index_answer,
                prompt_tokens: tokens.estimated_len,
            },
        ))
    }

    /// The prompt's tokens within the tokenize budget: only the leading ones from
    /// `leading_bytes` on when possible; a whole tokenization left for the next turn caches the
    /// keys the context's `keys_job` computes. Timed by source.
    async fn prompt_tokens(
        &self,
        context: &DecisionContext<'_>,
        leading_bytes: usize,
    ) -> Result<PromptTokens, LoadCause> {
        let DecisionContext {
            runtime,
            pool_index,
            pool,
            request,
            deadline,
            ..
        } = *context;
        let config = &runtime.config;
        // A request naming no model is the pool's base model (the name vLLM serves first).
        let model = match request.model.as_ref() {
            "" => pool.models[0].as_str(),
            named => named,
        };
        let tokenize_started = Instant::now();
        let tokenize_budget = config
            .tokenize_budget
            .min(deadline.saturating_duration_since(tokenize_started));
        let tokenizer = runtime.tokenizers[pool_index].as_ref();
        let tokens = self
            .token_cache
            .leading_tokens(
                pool_index,
                model,
                &request.prompt,
                tokenizer,
                tokenize_budget,
                leading_bytes,
                Some(&context.keys_job),
            )
            .await
        .map_err(|e| {
            self.count_fallback("tokenize", e.as_label());
            tracing::debug!(error = %e, pool = %pool.name, "tokenization failed, routing on load");
            match e {
                crate::error::TokenizeError::NotConfigured { .. } => LoadCause::NoTokenizer,
                crate::error::TokenizeError::Timeout { .. } => LoadCause::TokenizerTimeout,
                crate::error::TokenizeError::Busy { .. } => LoadCause::TokenizerBusy,
                crate::error::TokenizeError::PromptTooLarge { .. } => LoadCause::PromptTooLarge,
                crate::error::TokenizeError::Remote { .. }
                | crate::error::TokenizeError::Render { .. }
                | crate::error::TokenizeError::InProcess { .. } => LoadCause::TokenizerFailed,
            }
        })?;
        self.metrics
            .tokenize_duration
            .get_or_create(&KindLabel {
                kind: tokens.source.as_label(),
            })
            .observe(tokenize_started.elapsed().as_secs_f64());
        Ok(tokens)
    }

    /// Whether some candidate holds every block of `keys`, by the index, kvroute's memory or a
    /// request in flight there (everything the prefix score reads).
    fn holds_all(
        &self,
        candidates: &[&Replica],
        keys: &[u64],
        index_answer: Option<&MatchResponse>,
        config: &Config,
    ) -> bool {
        let all = keys.len();
        // A hybrid model's hit can grow past its leading part's answer as long as its
        // full-attention group holds every key (`prefix_blocks`; 0 from an older index).
        let indexed = index_answer.is_some_and(|answer| {
            answer
                .replicas
                .iter()
                .any(|m| m.precise && m.matched_blocks.max(m.prefix_blocks) as usize >= all)
        });
        let ids: Vec<&str> = candidates.iter().map(|r| r.id.as_str()).collect();
        indexed
            || self
                .router
                .remembers_all(&ids, keys, Instant::now(), config.scoring.speculative_ttl)
    }

    /// The block keys of `tokens` (cached with them when their fingerprint is the context's
    /// `keys_job`'s) and, when the pool asks the index, its answer.
    async fn keys_and_index(
        &self,
        context: &DecisionContext<'_>,
        tokens: &PromptTokens,
    ) -> Result<(Vec<u64>, Option<MatchResponse>), LoadCause> {
        let DecisionContext {
            runtime,
            pool,
            adapter,
            request,
            candidates,
            deadline,
            ref keys_job,
            ..
        } = *context;
        let config = &runtime.config;
        // Keys.
        let keys = match &tokens.keys {
            Some(cached)
                if cached.fingerprint == keys_job.fingerprint
                    && cached.keys.len() == tokens.tokens.len() / pool.block_size as usize =>
            {
                cached.keys.to_vec()
            }
            _ => pool
                .prompt_keys(&tokens.tokens, adapter, request.cache_salt.as_deref())
                .map_err(|e| {
                    self.count_fallback("keys", e.as_label());
                    LoadCause::KeyError
                })?,
        };
        // Index.
        let asks_index = pool.events && runtime.index.is_configured() && !keys.is_empty();
        let skip = if !pool.events {
            Some(IndexSkip::PoolWithoutEvents)
        } else if asks_index && self.scraper.pool_degraded(&pool.name) {
            Some(IndexSkip::Drift)
        } else {
            None
        };
        let index_answer = if let Some(skip) = skip {
            self.count_fallback("index", skip.as_label());
            None
        } else if asks_index {
            let match_started = Instant::now();
            let match_deadline = deadline.min(match_started + config.match_timeout);
            let request = MatchRequest {
                model: pool.models[0].clone(),
                adapter: adapter.map(|a| a.name.clone()).unwrap_or_default(),
                block_size: pool.block_size,
                keys: keys[..match_blocks(tokens, pool.block_size, keys.len())].to_vec(),
                candidates: candidates.iter().map(|r| r.id.clone()).collect(),
            };
            match runtime.index.match_prefix(request, match_deadline).await {
                Ok(answer) => {
                    self.metrics
                        .match_duration
                        .observe(match_started.elapsed().as_secs_f64());
                    self.count_untrusted_candidates(pool, candidates, &answer);
                    Some(answer)
                }
                Err(e) => {
                    self.count_fallback("index", e.as_label());
                    tracing::debug!(error = %e, "index match failed, using the approximate tier");
                    None
                }
            }
        } else {
            None
        };
        Ok((keys, index_answer))
    }

    /// Counts (and logs at debug) every candidate the index did not vouch for: those it answered
    /// `precise: false` for, by state, and those it left out (ids it does not know; the first
    /// time per replica is a warning, since that is a configuration mismatch).
    fn count_untrusted_candidates(
        &self,
        pool: &Pool,
        candidates: &[&Replica],
        answer: &MatchResponse,
    ) {
        for replica in candidates {
            match answer.replicas.iter().find(|m| m.replica_id == replica.id) {
                Some(found) if found.precise => {}
                Some(found) => {
                    let state = found.state().label();
                    self.metrics
                        .nonprecise_replicas
                        .get_or_create(&ReplicaStateLabels {
                            replica: replica.id.clone(),
                            state,
                        })
                        .inc();
                    tracing::debug!(
                        replica_id = %replica.id,
                        pool = %pool.name,
                        state,
                        reason = %found.reason,
                        "index does not vouch for the replica: approximate tier"
                    );
                }
                None => {
                    let seen = self
                        .metrics
                        .unknown_replicas
                        .get_or_create(&ReplicaLabel {
                            replica: replica.id.clone(),
                        })
                        .inc();
                    if seen == 0 {
                        tracing::warn!(
                            replica_id = %replica.id,
                            pool = %pool.name,
                            "the index does not know this replica id (configured here, absent \
                             from its answer): approximate tier; check both configs"
                        );
                    } else {
                        tracing::debug!(replica_id = %replica.id, pool = %pool.name, "replica unknown to the index");
                    }
                }
            }
        }
    }

    fn count_fallback(&self, stage: &'static str, cause: &'static str) {
        self.metrics
            .fallbacks
            .get_or_create(&FallbackLabels { stage, cause })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use prometheus_client::registry::Registry;
    use tokio::sync::Barrier;

    use super::*;
    use crate::request::{Endpoint, parse};
    use crate::tokenizer::{TokenizeFuture, TokenizeInput};

    const BURST: usize = 16;

    #[test]
    fn the_index_is_asked_about_the_blocks_vllm_can_reuse() {
        let tokens = |len: u32, exact| PromptTokens {
            tokens: (0..len).collect(),
            exact,
            estimated_len: len as usize,
            source: TokenSource::Tokenizer,
            keys: None,
        };
        // 64 tokens in blocks of 32: two keys, but vLLM recomputes the last token: one block.
        assert_eq!(match_blocks(&tokens(64, true), 32, 2), 1);
        assert_eq!(match_blocks(&tokens(65, true), 32, 2), 2);
        assert_eq!(match_blocks(&tokens(1, true), 32, 0), 0);
        // A leading part: the whole prompt is longer, every key counts.
        assert_eq!(match_blocks(&tokens(64, false), 32, 2), 2);
    }

    /// One token per byte; every call waits until `BURST` calls are in flight, so all siblings
    /// finish tokenizing together and race to score (the case a burst hits in production).
    #[derive(Debug)]
    struct LockstepTokenizer(Arc<Barrier>);

    impl Tokenizer for LockstepTokenizer {
        fn tokenize(&self, _model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
            let barrier = Arc::clone(&self.0);
            Box::pin(async move {
                barrier.wait().await;
                match input.as_ref() {
                    TokenizeInput::Text { text, .. } => Ok(text.bytes().map(u32::from).collect()),
                    TokenizeInput::Chat { messages, .. } => {
                        Ok(messages.get().bytes().map(u32::from).collect())
                    }
                    TokenizeInput::Api { request, .. } => {
                        Ok(request.get().bytes().map(u32::from).collect())
                    }
                }
            })
        }
    }

    fn picker(scoring: &str) -> Picker {
        let yaml = format!(
            "budgets: {{decision: 2s, tokenize: 2s}}\n\
             scoring: {scoring}\n\
             pools:\n- {{name: p, models: [m], block_size: 16, key_scheme: {{kind: token-chain}}}}\n\
             replicas:\n\
             - {{id: r0, pool: p, address: \"10.0.0.1:8000\"}}\n\
             - {{id: r1, pool: p, address: \"10.0.0.2:8000\"}}\n\
             - {{id: r2, pool: p, address: \"10.0.0.3:8000\"}}\n\
             - {{id: r3, pool: p, address: \"10.0.0.4:8000\"}}\n"
        );
        let config = Config::from_yaml(&yaml).unwrap();
        let tasks = TaskTracker::new();
        let runtime = Runtime::build(config, None, &tasks)
            .unwrap()
            .with_tokenizer(
                0,
                Arc::new(LockstepTokenizer(Arc::new(Barrier::new(BURST)))),
            );
        Picker::new(runtime, Metrics::register(&mut Registry::default()), tasks)
    }

    /// Decides `BURST` siblings (a 2000-token shared prefix) at once; keeps their in-flight guards.
    async fn burst(picker: Arc<Picker>) -> Vec<Decision> {
        let prefix = "ab".repeat(1000);
        let decisions = (0..BURST).map(|i| {
            let picker = Arc::clone(&picker);
            let body = serde_json::json!({"model": "m", "prompt": format!("{prefix} sibling {i}")})
                .to_string();
            async move {
                let request = parse(body.as_bytes(), Endpoint::Completions).unwrap();
                picker.decide(&request, None).await.unwrap()
            }
        });
        #[expect(
            clippy::disallowed_methods,
            reason = "test: decide on several worker threads"
        )]
        let handles: Vec<_> = decisions.map(tokio::spawn).collect();
        let mut out = Vec::new();
        for handle in handles {
            out.push(handle.await.unwrap());
        }
        out
    }

    fn per_replica(decisions: &[Decision]) -> HashMap<&str, usize> {
        let mut counts = HashMap::new();
        for decision in decisions {
            *counts.entry(decision.replica_id.as_str()).or_insert(0) += 1;
        }
        counts
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_siblings_co_locate() {
        let picker = Arc::new(picker("{}"));
        let decisions = burst(Arc::clone(&picker)).await;
        let counts = per_replica(&decisions);
        let most = counts.values().copied().max().unwrap_or(0);
        assert!(most >= 12, "siblings spread: {counts:?}");
        // Only the first sibling found no cached prefix; the others saw its speculative insert.
        let cold = decisions
            .iter()
            .filter(|d| d.reason == "no_cache_match")
            .count();
        assert_eq!(cold, 1, "{counts:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn hotspot_guard_still_spills_a_burst() {
        // A low threshold: the replica holding the prefix turns hot after a few siblings.
        let picker = Arc::new(picker("{hotspot_min_ms: 120}"));
        let decisions = burst(Arc::clone(&picker)).await;
        let counts = per_replica(&decisions);
        let most = counts.values().copied().max().unwrap_or(0);
        assert!(most < BURST, "{counts:?}");
        assert!(
            decisions.iter().any(|d| d.reason == "hotspot_guard"),
            "{counts:?}"
        );
    }

    #[cfg(feature = "embedded-index")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn embedded_index_answers_in_process_and_survives_a_reload() {
        let index = kvroute_index::server::IndexServer::start(
            kvroute_index::config::Config::from_yaml(
                "listen: {grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}\n\
                 pools:\n  - {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}\n\
                 replicas:\n  - {id: r0, pool: p, events: {endpoint: \"tcp://127.0.0.1:9\"}}\n",
            )
            .unwrap(),
        )
        .await
        .unwrap();
        let yaml = "pools:\n- {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}\n\
                    replicas:\n- {id: r0, pool: p, address: \"10.0.0.1:8000\"}\n";
        let tasks = TaskTracker::new();
        let runtime = Runtime::build(Config::from_yaml(yaml).unwrap(), None, &tasks)
            .unwrap()
            .with_local_index(index.matcher());
        async fn ask(runtime: &Runtime) -> Result<MatchResponse, crate::error::IndexError> {
            let request = MatchRequest {
                model: "m".to_owned(),
                block_size: 16,
                keys: vec![1, 2, 3],
                candidates: vec!["r0".to_owned()],
                ..MatchRequest::default()
            };
            let deadline = Instant::now() + std::time::Duration::from_secs(1);
            runtime.index.match_prefix(request, deadline).await
        }
        let answer = ask(&runtime).await.unwrap();
        assert_eq!(answer.replicas.len(), 1, "{answer:?}");
        assert_eq!(answer.replicas[0].matched_blocks, 0);

        // A reload (no index addresses at all) keeps asking the embedded index.
        let reloaded =
            Runtime::build(Config::from_yaml(yaml).unwrap(), Some(&runtime), &tasks).unwrap();
        assert!(reloaded.index.is_configured());
        assert!(ask(&reloaded).await.is_ok());
        // A model the index does not know is refused, not a transport failure.
        let refused = reloaded
            .index
            .match_prefix(
                MatchRequest {
                    model: "other".to_owned(),
                    ..MatchRequest::default()
                },
                Instant::now() + std::time::Duration::from_secs(1),
            )
            .await;
        assert!(
            matches!(refused, Err(crate::error::IndexError::Refused(_))),
            "{refused:?}"
        );
        index.shutdown().await;
    }

    const TINY_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-model");

    /// An in-process tokenizer that cannot give leading tokens: every decision tokenizes the
    /// whole prompt (the reference the leading rule must agree with).
    #[derive(Debug)]
    struct WholePromptOnly(Arc<dyn Tokenizer>);

    impl Tokenizer for WholePromptOnly {
        fn tokenize(&self, model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
            self.0.tokenize(model, input)
        }
    }

    /// A picker over three replicas (no index: prefix memory and in-flight keys only) with
    /// `tokenizer`, and the registry its metrics are in.
    fn model_picker(tokenizer: Arc<dyn Tokenizer>) -> (Picker, Registry) {
        let yaml = "budgets: {decision: 5s, tokenize: 5s}\n\
                    pools:\n- {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}\n\
                    replicas:\n\
                    - {id: r0, pool: p, address: \"10.0.0.1:8000\"}\n\
                    - {id: r1, pool: p, address: \"10.0.0.2:8000\"}\n\
                    - {id: r2, pool: p, address: \"10.0.0.3:8000\"}\n";
        let tasks = TaskTracker::new();
        let runtime = Runtime::build(Config::from_yaml(yaml).unwrap(), None, &tasks)
            .unwrap()
            .with_tokenizer(0, tokenizer);
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        (Picker::new(runtime, metrics, tasks), registry)
    }

    /// How many decisions took their tokens from `source` (`tokenize_duration_seconds` count).
    fn tokenized_by(registry: &Registry, source: &str) -> u64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        let prefix =
            format!("kvroute_extproc_tokenize_duration_seconds_count{{kind=\"{source}\"}} ");
        text.lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .map_or(0, |count| count.parse().unwrap())
    }

    /// Waits (10 s at most) until the token cache holds `entries` entries.
    async fn wait_for_cached_entries(registry: &Registry, entries: i64) {
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
            let held = text
                .lines()
                .find_map(|line| line.strip_prefix("kvroute_extproc_token_cache_entries "))
                .map_or(0, |n| n.parse().unwrap());
            if held >= entries {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{held} cache entries, not {entries}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// A long request to `dir`'s model (chat when it has a template) of seeded mixed text.
    fn long_body(direct: &kvroute_tokenize::ModelTokenizer, seed: u64, turns: usize) -> String {
        let text = |i: u64| kvroute_tokenize::testing::mixed_text(seed + i, 48 * 1024, &[]);
        if !direct.has_chat_template() {
            let prompt: String = (0..turns as u64).map(text).collect();
            return serde_json::json!({"model": "m", "prompt": prompt}).to_string();
        }
        let mut messages = vec![serde_json::json!({"role": "user", "content": text(0)})];
        for i in 1..turns as u64 {
            messages.push(serde_json::json!({"role": "assistant", "content": "Noted."}));
            messages.push(serde_json::json!({"role": "user", "content": text(i)}));
        }
        serde_json::json!({"model": "m", "messages": messages}).to_string()
    }

    fn endpoint(body: &str) -> Endpoint {
        if body.contains("\"messages\"") {
            Endpoint::ChatCompletions
        } else {
            Endpoint::Completions
        }
    }

    /// What one decision of `body` shows: replica, predicted cached tokens (header and drift).
    async fn decide_body(picker: &Picker, body: &str) -> (String, usize, u64) {
        let request = parse(body.as_bytes(), endpoint(body)).unwrap();
        let decision = picker.decide(&request, None).await.unwrap();
        let (replica, cached) = (
            decision.replica_id.clone(),
            decision.predicted_cached_tokens,
        );
        let before = picker.loads().replica(&replica).predicted().cached_tokens;
        drop(decision);
        let drift = picker.loads().replica(&replica).predicted().cached_tokens - before;
        (replica, cached, drift)
    }

    /// The leading-tokens rule on `dir`'s model: a long prompt nobody holds whole-leading-part
    /// decides from its leading tokens exactly as from all of them; a replica holding all leading
    /// blocks (memory or in flight) makes the decision tokenize the whole prompt; the next turn
    /// and a repeat still find the conversation and the cache.
    async fn leading_rule_on(dir: &std::path::Path) {
        let direct = Arc::new(kvroute_tokenize::ModelTokenizer::from_dir(dir).unwrap());
        assert!(
            direct.uses_fast_path(),
            "{}: no fast encoder",
            dir.display()
        );
        // Loaded once (the fast encoder's self-check is slow in a debug build), shared by all.
        let tokenizer: Arc<dyn Tokenizer> = Arc::new(crate::tokenizer::InProcessTokenizer::new(
            Arc::clone(&direct),
            TaskTracker::new(),
        ));
        let load = || Arc::clone(&tokenizer);
        let body = long_body(&direct, 15, 1);
        let request = parse(body.as_bytes(), endpoint(&body)).unwrap();
        let input = Arc::new(TokenizeInput::from_prompt(&request.prompt).unwrap());
        let whole = load().tokenize("m", Arc::clone(&input)).await.unwrap();
        let leading = load()
            .tokenize_leading("m", Arc::clone(&input), LEADING_BYTES)
            .unwrap()
            .await
            .unwrap();
        assert!(!leading.complete && leading.tokens.len() < whole.len());
        assert_eq!(
            leading.tokens,
            whole[..leading.tokens.len()],
            "not a prefix"
        );
        let pool_keys = |picker: &Picker, tokens: &[u32]| {
            picker.runtime().config.pools[0]
                .prompt_keys(tokens, None, None)
                .unwrap()
        };
        let leading_blocks = leading.tokens.len() / 16;

        // Nobody holds every leading block: r1 holds a few, r2 all but one.
        let (with_leading, leading_metrics) = model_picker(load());
        let (reference, _) = model_picker(Arc::new(WholePromptOnly(load())));
        for picker in [&with_leading, &reference] {
            let keys = pool_keys(picker, &whole);
            let now = Instant::now();
            picker
                .router
                .memory()
                .record("r1", 1 << 20, &keys[..3], now);
            picker
                .router
                .memory()
                .record("r2", 1 << 20, &keys[..leading_blocks - 1], now);
        }
        let decided = decide_body(&with_leading, &body).await;
        assert_eq!(decided, decide_body(&reference, &body).await);
        assert_eq!(decided.0, "r2");
        assert_eq!(decided.1, (leading_blocks - 1) * 16);
        assert_eq!(tokenized_by(&leading_metrics, "leading"), 1);
        assert_eq!(tokenized_by(&leading_metrics, "tokenizer"), 0);

        // r2 holds the first leading part whole and a few blocks more, fewer than the next
        // part's: the part grows once, and the decision is still the whole prompt's.
        let second_part = load()
            .tokenize_leading("m", Arc::clone(&input), LEADING_BYTES * LEADING_GROWTH)
            .unwrap()
            .await
            .unwrap();
        let second_blocks = second_part.tokens.len() / 16;
        assert!(!second_part.complete && second_blocks > leading_blocks + 2);
        let (growing, growing_metrics) = model_picker(load());
        let (reference, _) = model_picker(Arc::new(WholePromptOnly(load())));
        for picker in [&growing, &reference] {
            let keys = pool_keys(picker, &whole);
            picker.router.memory().record(
                "r2",
                1 << 20,
                &keys[..leading_blocks + 2],
                Instant::now(),
            );
        }
        let decided = decide_body(&growing, &body).await;
        assert_eq!(decided, decide_body(&reference, &body).await);
        assert_eq!(
            (decided.0.as_str(), decided.1),
            ("r2", (leading_blocks + 2) * 16)
        );
        // The second part, unless the background job turn 1 left ended first (then: cached).
        assert_eq!(
            tokenized_by(&growing_metrics, "leading") + tokenized_by(&growing_metrics, "cache"),
            2
        );
        assert_eq!(tokenized_by(&growing_metrics, "tokenizer"), 0);

        // Only a chat has message boundaries the token cache can find a cached prefix at (a
        // completion prompt is one text; its next turn tokenizes a leading part again).
        if direct.has_chat_template() {
            // Turn 1 was decided from its leading tokens; its whole tokenization finishes in the
            // background, so turn 2 (same start) finds it as its cached prefix instead of paying
            // for a leading part and then the whole prompt. r2 remembers turn 1's leading blocks.
            wait_for_cached_entries(&leading_metrics, 1).await;
            let turn2 = long_body(&direct, 15, 2);
            let (replica, cached, _) = decide_body(&with_leading, &turn2).await;
            assert_eq!(replica, "r2");
            assert_eq!(cached, leading_blocks * 16, "turn 1's leading blocks on r2");
            assert_eq!(
                tokenized_by(&leading_metrics, "leading"),
                1,
                "turn 2 not leading"
            );
            assert_eq!(
                tokenized_by(&leading_metrics, "tokenizer")
                    + tokenized_by(&leading_metrics, "prefix_cache"),
                1
            );
            // A repeat of turn 2 comes from the cache.
            wait_for_cached_entries(&leading_metrics, 2).await;
            let repeat = decide_body(&with_leading, &turn2).await;
            assert_eq!(repeat.0, "r2");
            assert_eq!(tokenized_by(&leading_metrics, "cache"), 1);
        }

        // A replica holding the whole prompt (memory on r1, a request in flight on r2): the
        // decision tokenizes it whole and predicts what the reference does.
        for holds in ["memory", "inflight"] {
            let (with_leading, leading_metrics) = model_picker(load());
            let (reference, _) = model_picker(Arc::new(WholePromptOnly(load())));
            let mut guards = Vec::new();
            for picker in [&with_leading, &reference] {
                let keys = pool_keys(picker, &whole);
                match holds {
                    "memory" => picker
                        .router
                        .memory()
                        .record("r1", 1 << 20, &keys, Instant::now()),
                    _ => guards.push(picker.loads().start_request("r2", 0, keys)),
                }
            }
            let decided = decide_body(&with_leading, &body).await;
            let expected = decide_body(&reference, &body).await;
            assert_eq!((decided.1, decided.2), (expected.1, expected.2), "{holds}");
            // Every leading part is held whole, so it grows until the whole prompt is tokenized
            // — or is found cached, when the background job turn 1's first part left ended
            // before a later step asked.
            let leading_steps =
                std::iter::successors(Some(LEADING_BYTES), |b| Some(b * LEADING_GROWTH))
                    .take_while(|&b| input.len_bytes() >= 2 * b)
                    .count() as u64;
            assert!(leading_steps >= 2, "the test prompt grows its leading part");
            let leading = tokenized_by(&leading_metrics, "leading");
            let cached = tokenized_by(&leading_metrics, "cache");
            assert_eq!(
                tokenized_by(&leading_metrics, "tokenizer") + cached,
                1,
                "{holds}: the whole prompt once"
            );
            assert!((1..=leading_steps).contains(&leading), "{holds}: {leading}");
            if cached == 0 {
                assert_eq!(leading, leading_steps, "{holds}");
            }
            if holds == "memory" {
                assert_eq!(
                    (&decided.0, &expected.0),
                    (&"r1".to_owned(), &"r1".to_owned())
                );
                let keys = pool_keys(&with_leading, &whole);
                // What vLLM reuses of it: at most (tokens - 1) / 16 blocks.
                let reusable =
                    kvroute_routing::load::engine_hit_tokens(keys.len() as u32, whole.len(), 16);
                assert_eq!(decided.1, reusable);
            }
        }
    }

    #[tokio::test]
    async fn long_prompts_decide_from_leading_tokens_exactly_on_the_tiny_model() {
        leading_rule_on(TINY_MODEL.as_ref()).await;
    }

    #[tokio::test]
    async fn long_prompts_decide_from_leading_tokens_exactly_on_real_tokenizers() {
        let models = std::env::var_os("KVROUTE_MODELS")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME")
                    .map(|home| std::path::PathBuf::from(home).join(".cache/kvroute/models"))
            });
        for name in ["qwen3", "llama3_1", "gptoss"] {
            let Some(dir) = models.as_ref().map(|m| m.join(name)) else {
                continue;
            };
            if !dir.join("tokenizer.json").is_file() {
                eprintln!(
                    "SKIP leading tokens for {name}: no tokenizer folder; run `bash scripts/models.sh` \
                     (sets KVROUTE_MODELS)"
                );
                continue;
            }
            leading_rule_on(&dir).await;
        }
    }

    /// One token per byte on a blocking slot; every call but the first returns at once, the first
    /// waits until `release` is notified (a long prompt holding the only slot).
    #[derive(Debug)]
    struct SlotHoldingTokenizer {
        calls: std::sync::atomic::AtomicUsize,
        release: Arc<tokio::sync::Notify>,
    }

    impl Tokenizer for SlotHoldingTokenizer {
        fn tokenize(&self, _model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
            let first = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
            let release = Arc::clone(&self.release);
            Box::pin(async move {
                if first {
                    release.notified().await;
                }
                match input.as_ref() {
                    TokenizeInput::Text { text, .. } => Ok(text.bytes().map(u32::from).collect()),
                    other => Ok(vec![0; other.len_bytes()]),
                }
            })
        }

        fn runs_blocking(&self, _input: &TokenizeInput, _leading: bool) -> bool {
            true
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_tokenization_says_why_in_the_load_decision() {
        let yaml = "budgets: {decision: 2s, tokenize: 200ms}\n\
                    limits: {tokenize_concurrency: 1, tokenize_max_prompt_bytes: 1024}\n\
                    pools:\n- {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}\n\
                    replicas:\n- {id: r0, pool: p, address: \"10.0.0.1:8000\"}\n";
        let release = Arc::new(tokio::sync::Notify::new());
        let tasks = TaskTracker::new();
        let runtime = Runtime::build(Config::from_yaml(yaml).unwrap(), None, &tasks)
            .unwrap()
            .with_tokenizer(
                0,
                Arc::new(SlotHoldingTokenizer {
                    calls: std::sync::atomic::AtomicUsize::new(0),
                    release: Arc::clone(&release),
                }),
            );
        let picker = Picker::new(runtime, Metrics::register(&mut Registry::default()), tasks);
        let decide = |prompt: String| {
            let picker = &picker;
            async move {
                let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
                let request = parse(body.as_bytes(), Endpoint::Completions).unwrap();
                let decision = picker.decide(&request, None).await.unwrap();
                (decision.tier, decision.reason)
            }
        };

        assert_eq!(
            decide("x".repeat(2048)).await,
            (Tier::Load, "prompt_too_large")
        );
        // The first prompt outlives its budget on the only slot; the next one finds no slot.
        assert_eq!(
            decide("first ".repeat(20)).await,
            (Tier::Load, "tokenizer_timeout")
        );
        assert_eq!(
            decide("second ".repeat(20)).await,
            (Tier::Load, "tokenizer_busy")
        );
        release.notify_one();
    }

    #[test]
    fn the_index_holding_every_leading_block_precisely_asks_for_the_whole_prompt() {
        let (picker, _) = model_picker(Arc::new(LockstepTokenizer(Arc::new(Barrier::new(1)))));
        let runtime = picker.runtime();
        let candidates: Vec<&Replica> = runtime.config.replicas.iter().collect();
        let keys = [1, 2, 3];
        let answer = |precise, matched_blocks| MatchResponse {
            replicas: vec![kvroute_index_api::api::ReplicaMatch {
                replica_id: "r1".to_owned(),
                matched_blocks,
                precise,
                ..Default::default()
            }],
            ..Default::default()
        };
        let holds = |answer: Option<MatchResponse>| {
            picker.holds_all(&candidates, &keys, answer.as_ref(), &runtime.config)
        };
        assert!(holds(Some(answer(true, 3))));
        assert!(!holds(Some(answer(true, 2))));
        // An answer the index does not vouch for counts only through kvroute's memory.
        assert!(!holds(Some(answer(false, 3))));
        assert!(!holds(None));
    }
}
