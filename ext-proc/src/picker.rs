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

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use kvroute_index_api::api::{MatchRequest, MatchResponse, ReplicaCondition};
use kvroute_routing::load::{InflightGuard, LoadBoard, ReplicaLoad};
use kvroute_routing::policy::{Reason, queue_ms};
use kvroute_routing::{
    Indexed, PoolSide, PrefillSide, PromptFacts, ReplicaHandle, RouteRequest, Router, RouterEpoch,
};
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

use crate::config::{Config, Disaggregation, Pool, PoolMode, Replica, TokenizerSource};
use crate::error::RequestError;
use crate::index_client::IndexClient;
use crate::metrics::{
    DecisionLabels, DisaggregationLabels, FallbackLabels, KindLabel, Metrics, ReplicaLabel,
    ReplicaStateLabels,
};
use crate::records::Explained;
use crate::records::{DecisionRecord, DecisionRecords, TokenFacts};
use crate::request::ParsedRequest;
use crate::scrape::Scraper;
use crate::shadow::ShadowBook;
use crate::tokenizer::{
    KeysJob, LeadingSteps, PromptTokens, TokenCache, TokenLimits, TokenSource, Tokenizer,
    TokensRequest,
};
use kvroute_config::ConfigError;

use kvroute_routing::Tier;

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
    /// The request carries media an in-process tokenizer cannot place (render mode can).
    MultiModal,
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
            Self::MultiModal => "multimodal",
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
/// for the next turn. The smaller the leading part, the cheaper a miss (4 KiB against 1 KiB:
/// docs/benchmarks-history-2026-12.md, "Latency through Envoy with real tokenizers").
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
        format!("{}/{adapter:?}/{salt:?}", pool.keys_fingerprint).as_bytes(),
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
    /// The prompt's leading parts tokenized so far: each longer one takes over the last.
    leading_steps: LeadingSteps,
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
    /// Where the tokens came from.
    token_source: TokenSource,
    /// Time spent getting them (every leading step), seconds.
    tokenize_seconds: f64,
}

/// A routing decision. Dropping it ends the replica's in-flight accounting for the request.
#[derive(Debug)]
pub struct Decision {
    /// Chosen replica id.
    pub replica_id: String,
    /// Its `ip:port`.
    pub address: SocketAddr,
    /// Its data-parallel rank behind that address, when it is one of several (sent in the
    /// `x-data-parallel-rank` header).
    pub dp_rank: Option<u32>,
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
    /// The pool's mode: in `shadow` the answer names no destination (Envoy's choice stands).
    pub mode: PoolMode,
    /// What every candidate looked like, kept for shadow pools and recorded decisions.
    pub explained: Option<Box<Explained>>,
    /// The decision's record, when it was recorded.
    pub record: Option<Arc<DecisionRecord>>,
    /// Whether the pool splits requests (`disaggregation`): a request it does not split goes
    /// without any `x-prefiller-host-port` a client sent.
    pub disaggregated: bool,
    /// Where the prompt is computed, when a disaggregated pool split it off.
    pub prefill: Option<PrefillLeg>,
    /// Shared with the other pickers: dropping it tells them the request was answered.
    pub peer_ticket: Option<crate::peers::PeerTicket>,
}

/// The prefill replica of a split request. Dropping it ends that replica's in-flight accounting.
#[derive(Debug)]
pub struct PrefillLeg {
    /// Its id.
    pub replica_id: String,
    /// Its `ip:port` (what `x-prefiller-host-port` names).
    pub address: SocketAddr,
    /// In-flight accounting of the prompt computed there.
    pub inflight: InflightGuard,
    /// Its pool's name (a metric label).
    pub pool: String,
    /// How the pool splits: who runs the leg (`mode`), and how ext-proc runs it (`envoy`).
    pub disaggregation: Disaggregation,
}

/// The split decision: one implementation, shared with the replay simulator.
pub use kvroute_routing::SplitVerdict;

/// One config snapshot with what was built from it.
#[derive(Debug)]
pub struct Runtime {
    /// The validated config.
    pub config: Arc<Config>,
    tokenizers: Vec<Option<Arc<dyn Tokenizer>>>,
    index: IndexClient,
    /// Every configured replica's routing state, in `config.replicas`' order, as of the
    /// router's epoch ([`Picker::replica_handles`]).
    handles: arc_swap::ArcSwapOption<ResolvedReplicas>,
}

/// Replicas' routing state resolved by name once, kept while the router's tables are unchanged.
#[derive(Debug)]
struct ResolvedReplicas {
    epoch: RouterEpoch,
    handles: Vec<ReplicaHandle>,
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
                    // The engine family decides how the tokenizer builds prompts.
                    .position(|old| old.tokenizer == pool.tokenizer && old.engine == pool.engine)?;
                p.tokenizers[j].clone()
            });
            let tokenizer = match (&pool.tokenizer, reused) {
                (TokenizerSource::None, _) => None,
                (_, Some(reused)) => Some(reused),
                (source, None) => crate::tokenizer::from_source(source, pool.engine, i, tasks)?,
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
            handles: arc_swap::ArcSwapOption::empty(),
        })
    }

    /// The index client of this snapshot.
    pub fn index_client(&self) -> &IndexClient {
        &self.index
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
    records: DecisionRecords,
    shadow: ShadowBook,
    /// Decisions shared with the other ext-proc replicas.
    peers: crate::peers::Peers,
}

/// Why a decision is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Explain {
    /// Not recorded (unless sampled).
    Unflagged,
    /// The request carries the debug token: always recorded, and its record goes back to it.
    Flagged,
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
            records: DecisionRecords::default(),
            shadow: ShadowBook::new(metrics.clone()),
            peers: crate::peers::Peers::new(metrics.clone()),
            metrics,
        }
    }

    /// Decisions shared with the other ext-proc replicas.
    pub fn peers(&self) -> &crate::peers::Peers {
        &self.peers
    }

    /// The routing core (loads, routed-prefix memory).
    pub fn router(&self) -> &Router {
        &self.router
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

    /// Every configured replica's routing state (`runtime.config.replicas`' order): looked up by
    /// name once per config and router state, not per decision (in a pool of a thousand replicas
    /// the lookups were a tenth of a decision).
    fn replica_handles(&self, runtime: &Runtime) -> Arc<ResolvedReplicas> {
        // Read before resolving: a change in between leaves this copy stale, so not reused.
        let epoch = self.router.epoch();
        if let Some(resolved) = runtime.handles.load_full()
            && resolved.epoch == epoch
        {
            return resolved;
        }
        let config = &runtime.config;
        let named: Vec<(&str, usize)> = config
            .replicas
            .iter()
            .map(|r| (r.id.as_str(), config.pools[r.pool].approx_capacity_blocks))
            .collect();
        let resolved = Arc::new(ResolvedReplicas {
            epoch,
            handles: self.router.replica_handles(&named),
        });
        runtime.handles.store(Some(Arc::clone(&resolved)));
        resolved
    }

    /// Scrapes every replica's engine once (the scrape loop's step); logs shadow pools' last
    /// minute when due.
    pub async fn scrape_all(&self, config: &Config) {
        self.scraper
            .scrape_all(self.router.loads(), config, &self.shadow)
            .await;
        self.shadow.log_if_due(config);
    }

    /// The most recent decision records, newest first (`/v1/decisions`).
    pub fn records(&self) -> &DecisionRecords {
        &self.records
    }

    /// Shadow mode's tallies (`/v1/shadow`).
    pub fn shadow(&self) -> &ShadowBook {
        &self.shadow
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
        self.decide_explained(request, subset, Explain::Unflagged)
            .await
    }

    /// [`Self::decide`], recording the decision when `explain` flags it (or it is sampled).
    pub async fn decide_explained(
        &self,
        request: &ParsedRequest<'_>,
        subset: Option<&[SocketAddr]>,
        explain: Explain,
    ) -> Result<Decision, RequestError> {
        let started = Instant::now();
        let runtime = self.runtime.load_full();
        let records = &runtime.config.decision_records;
        let recorded = match explain {
            Explain::Flagged => Some("flagged"),
            Explain::Unflagged
                if records.sample > 0.0 && rand::random::<f64>() < records.sample =>
            {
                Some("sampled")
            }
            Explain::Unflagged => None,
        };
        let mut result = self
            .decide_in(&runtime, request, subset, started, recorded.is_some(), true)
            .await;
        let elapsed = started.elapsed();
        self.metrics
            .decision_duration
            .observe(elapsed.as_secs_f64());
        if let (Some(why), Ok(decision)) = (recorded, &mut result) {
            let record = Arc::new(DecisionRecord::of(decision, request, elapsed));
            self.metrics
                .decision_records
                .get_or_create(&KindLabel { kind: why })
                .inc();
            self.records
                .push(Arc::clone(&record), runtime.config.decision_records.keep);
            decision.record = Some(record);
            // A routed pool's candidates were kept only for the record.
            if decision.mode == PoolMode::Route {
                decision.explained = None;
            }
        }
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

    /// What deciding `request` now would conclude, as a record, without routing it: nothing is
    /// committed (no speculative insert, no in-flight load, no decision counted), so asking is
    /// free of side effects on later decisions (`/v1/explain`, `kvroute-check --explain`).
    pub async fn explain(
        &self,
        request: &ParsedRequest<'_>,
    ) -> Result<DecisionRecord, RequestError> {
        let started = Instant::now();
        let runtime = self.runtime.load_full();
        let decision = self
            .decide_in(&runtime, request, None, started, true, false)
            .await?;
        Ok(DecisionRecord::of(&decision, request, started.elapsed()))
    }

    async fn decide_in(
        &self,
        runtime: &Runtime,
        request: &ParsedRequest<'_>,
        subset: Option<&[SocketAddr]>,
        started: Instant,
        recorded: bool,
        commit: bool,
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
        if pool.disaggregation.is_some() && request.kv_transfer_params {
            // They would reach the decode replica of a request served whole, naming any
            // engine (any address) to pull a prompt from: only kvroute's prefill leg sets them.
            return Err(RequestError::InvalidField {
                field: "kv_transfer_params",
                reason: "is set by the gateway in a disaggregated pool, not by clients",
            });
        }
        if kvroute_runtime::telemetry::request_spans() {
            tracing::Span::current().record("kvroute.pool", pool.name.as_str());
        }
        // The pool's ready replicas, with their routing state.
        let resolved = self.replica_handles(runtime);
        let (ready, ready_handles): (Vec<&Replica>, Vec<&ReplicaHandle>) = config
            .replicas
            .iter()
            .zip(&resolved.handles)
            .filter(|(r, _)| r.pool == pool_index)
            .filter(|(_, handle)| handle.load().is_ready(config.scrape.unready_after_failures))
            .unzip();
        // A request goes to a replica that decodes (within the GIE subset hint); a split one's
        // prompt is computed on one that prefills. Their state goes along (scoring reads it).
        let (candidates, candidate_handles): (Vec<&Replica>, Vec<&ReplicaHandle>) = ready
            .iter()
            .zip(ready_handles)
            .filter(|(r, _)| r.role.decodes())
            .filter(|(r, _)| subset.is_none_or(|s| s.contains(&r.address)))
            .map(|(r, handle)| (*r, handle))
            .unzip();
        let prefill_candidates: Vec<&Replica> = match pool.disaggregation {
            Some(_) => ready
                .iter()
                .copied()
                .filter(|r| r.role.prefills())
                .collect(),
            None => Vec::new(),
        };
        // The index is asked about both, each once in the pool's order; a pool that splits
        // nothing asks about its candidates alone, with nothing more built per decision.
        let both: Vec<&Replica>;
        let queried: &[&Replica] = if prefill_candidates.is_empty() {
            &candidates
        } else {
            both = config
                .replicas
                .iter()
                .filter(|r| candidates.contains(r) || prefill_candidates.contains(r))
                .collect();
            &both
        };
        if candidates.is_empty() {
            return Err(RequestError::NoReadyReplica {
                model: request.model.to_string(),
            });
        }
        if let Some(shedding) = &config.epp.shedding
            && candidate_handles
                .iter()
                .all(|handle| is_saturated(handle.load(), shedding))
        {
            return Err(RequestError::Saturated {
                model: request.model.to_string(),
            });
        }
        let deadline = started + config.decision_budget;
        let facts = tokio::time::timeout_at(
            deadline.into(),
            self.prefix_facts(runtime, pool_index, adapter, request, queried, deadline),
        )
        .await
        .unwrap_or_else(|_| {
            self.count_fallback("decision", "budget_exhausted");
            Err(LoadCause::BudgetExhausted)
        });
        let prompt_tokens = facts.as_ref().map_or(0, |facts| facts.prompt_tokens);
        let explain = recorded || pool.mode == PoolMode::Shadow;
        // The prefill side is scored on the same facts, after the decode replica is chosen.
        let split_facts = pool.disaggregation.and_then(|_| {
            let facts = facts.as_ref().ok()?;
            Some(SplitFacts {
                keys: facts.keys.clone(),
                index_answer: facts.index_answer.clone(),
                prompt_tokens: facts.prompt_tokens,
            })
        });
        let mut decision = kvroute_runtime::trace_span!("kvroute.score")
            .in_scope(|| {
                self.score_and_commit(
                    config,
                    pool_index,
                    (&candidates, &candidate_handles),
                    facts,
                    explain,
                    commit,
                )
            })
            .ok_or_else(|| RequestError::NoReadyReplica {
                model: request.model.to_string(),
            })?;
        if let Some(disaggregation) = &pool.disaggregation {
            decision.prefill = self.split(
                config,
                pool_index,
                disaggregation,
                &prefill_candidates,
                split_facts,
                &decision,
                commit,
            );
            if decision.prefill.is_some() {
                // The decode replica loads the prompt's KV instead of computing it: its queue
                // no longer holds this prefill (a failed leg, served whole, is not re-counted).
                decision.inflight.prefilled_elsewhere();
            }
        }
        // The other pickers count it too (a shadow pool's choice goes nowhere: not shared).
        if commit && pool.mode == PoolMode::Route {
            decision.peer_ticket = self.peers.announce(
                &request.model,
                &decision.replica_id,
                decision.inflight.keys(),
                prompt_tokens,
                decision.inflight.pending_prompt_tokens(),
            );
        }
        Ok(decision)
    }

    /// A disaggregated pool's second step: whether the request's prompt is computed on a
    /// prefill replica (its verdict counted), and which, by prefix and load among the prefill
    /// candidates other than the decode replica chosen. The prefill replica's choice is
    /// committed as any (it will hold the prompt's blocks, and computes it now).
    #[allow(clippy::too_many_arguments)]
    fn split(
        &self,
        config: &Arc<Config>,
        pool_index: usize,
        disaggregation: &Disaggregation,
        prefill_candidates: &[&Replica],
        facts: Option<SplitFacts>,
        decision: &Decision,
        commit: bool,
    ) -> Option<PrefillLeg> {
        let pool = &config.pools[pool_index];
        // Nor one whose event stream the index finds broken: an engine that died closed its
        // socket at once, and its prefill leg would fail before ext-proc's scrapes find it
        // unready.
        let disconnected = |replica: &Replica| {
            facts
                .as_ref()
                .and_then(|facts| facts.index_answer.as_ref())
                .is_some_and(|answer| {
                    answer.replicas.iter().any(|m| {
                        m.replica_id == replica.id
                            && m.state == ReplicaCondition::Disconnected as i32
                    })
                })
        };
        let rule = disaggregation.rule();
        let ready: Vec<&Replica> = prefill_candidates
            .iter()
            .copied()
            .filter(|r| r.id != decision.replica_id && !disconnected(r))
            .collect();
        // The prefill pool's load: a replica queued past the bound and past the decode replica
        // (whose queue holds this request already, committed) takes no leg.
        let queue_of = |id: &str| queue_ms(&self.loads().replica(id).snapshot(), &config.scoring);
        let decode_queue_ms = queue_of(&decision.replica_id);
        let others: Vec<&Replica> = ready
            .iter()
            .copied()
            .filter(|r| rule.admits_prefill_queue(queue_of(&r.id), decode_queue_ms))
            .collect();
        let verdict = match &facts {
            None => SplitVerdict::NoPrompt,
            Some(facts) => SplitVerdict::of(
                &rule,
                facts.prompt_tokens,
                decision.predicted_cached_tokens,
                PrefillSide::of(ready.len(), others.len()),
            ),
        };
        self.metrics
            .disaggregation_decisions
            .get_or_create(&DisaggregationLabels {
                pool: pool.name.clone(),
                decision: verdict.as_label(),
            })
            .inc();
        let facts = facts.filter(|_| verdict == SplitVerdict::Split)?;
        let ids: Vec<&str> = others.iter().map(|r| r.id.as_str()).collect();
        let routed = self.router.score_and_commit(RouteRequest {
            pool: PoolSide::prefill(&pool.name),
            candidates: &ids,
            handles: None,
            prompt: Some(PromptFacts {
                indexed: indexed_answers(facts.index_answer.as_ref(), &others),
                keys: facts.keys,
                prompt_tokens: facts.prompt_tokens,
            }),
            block_size: pool.block_size,
            capacity_blocks: pool.approx_capacity_blocks,
            scoring: &config.scoring,
            now: Instant::now(),
            commit,
        })?;
        let replica = others[routed.choice];
        Some(PrefillLeg {
            replica_id: replica.id.clone(),
            address: replica.address,
            inflight: routed.inflight,
            pool: pool.name.clone(),
            disaggregation: *disaggregation,
        })
    }

    /// The quick step: the routing core scores and records the choice (speculative insert,
    /// in-flight load) under its commit stripe, so a sibling decided next sees it. `None` only
    /// without candidates.
    fn score_and_commit(
        &self,
        config: &Arc<Config>,
        pool_index: usize,
        (candidates, handles): (&[&Replica], &[&ReplicaHandle]),
        facts: Result<PrefixFacts, LoadCause>,
        explain: bool,
        commit: bool,
    ) -> Option<Decision> {
        let pool = &config.pools[pool_index];
        let ids: Vec<&str> = candidates.iter().map(|r| r.id.as_str()).collect();
        let tokens = facts.as_ref().ok().map(|facts| TokenFacts {
            source: facts.token_source.as_label(),
            prompt_tokens: facts.prompt_tokens,
            blocks: facts.keys.len(),
            tokenize_ms: facts.tokenize_seconds * 1000.0,
        });
        let (prompt, load_cause) = match facts {
            Ok(facts) => {
                let indexed = indexed_answers(facts.index_answer.as_ref(), candidates);
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
            pool: PoolSide::serving(&pool.name),
            candidates: &ids,
            handles: Some(handles),
            prompt,
            block_size: pool.block_size,
            capacity_blocks: pool.approx_capacity_blocks,
            scoring: &config.scoring,
            now: Instant::now(),
            commit,
        })?;
        if routed.tier != Tier::Load && prompt_tokens > 0 {
            self.metrics
                .predicted_cached_share
                .observe(routed.cached_tokens as f64 / prompt_tokens as f64);
        }
        let replica = candidates[routed.choice];
        // Retries go to other addresses: another rank behind the chosen one's is not another
        // endpoint to Envoy.
        let mut fallbacks: Vec<SocketAddr> = Vec::with_capacity(config.epp.fallbacks);
        for &i in &routed.fallbacks {
            if fallbacks.len() == config.epp.fallbacks {
                break;
            }
            let address = candidates[i].address;
            if address != replica.address && !fallbacks.contains(&address) {
                fallbacks.push(address);
            }
        }
        let explained = explain.then(|| {
            Box::new(Explained {
                config: Arc::clone(config),
                pool: pool_index,
                candidates: positions_in(&config.replicas, candidates),
                scored: routed.scored,
                chosen: routed.choice,
                tokens,
            })
        });
        Some(Decision {
            mode: pool.mode,
            explained,
            record: None,
            fallbacks,
            replica_id: replica.id.clone(),
            address: replica.address,
            dp_rank: replica.dp_rank,
            envoy_cluster: replica.envoy_cluster.clone(),
            tier: routed.tier,
            reason: routed
                .reason
                .map_or(load_cause.as_label(), Reason::as_label),
            predicted_cached_tokens: routed.cached_tokens,
            inflight: routed.inflight,
            disaggregated: pool.disaggregation.is_some(),
            prefill: None,
            peer_ticket: None,
        })
    }

    /// The response to `decision`'s request began on `served` (as far as Envoy said): a shadow
    /// pool's decision is compared with it; one served elsewhere than chosen is remembered there
    /// (`served_elsewhere`).
    ///
    /// A shadow decision is committed as a routed one is (kvroute's own insert and in-flight
    /// load on its choice): what routing would capture is what kvroute believes its choice holds,
    /// its own earlier choices included (a sibling of a burst it would have co-located, the next
    /// turn of a conversation it would have kept together), not only what Envoy's placement left
    /// there. The replica Envoy chose is judged by what it holds now (`reusable`).
    pub fn responded(&self, decision: &mut Decision, served: Option<SocketAddr>) {
        if decision.mode == PoolMode::Shadow
            && let Some(explained) = decision.explained.as_deref()
        {
            self.shadow.compare_decision(explained, served);
        }
        if let Some(served) = served
            && served != decision.address
        {
            self.served_elsewhere(decision, served);
        }
    }

    /// Envoy served `decision`'s request on `served`, not the chosen replica (a retry walked the
    /// fallback list, the proxy ignored the destination, or the pool is in shadow mode): the
    /// served replica is remembered as holding the prompt's blocks, and the chosen one gets no
    /// prediction for it. An address that is no replica of the running config, or that several
    /// data-parallel ranks share, is left alone.
    fn served_elsewhere(&self, decision: &mut Decision, served: SocketAddr) {
        let keys = decision.inflight.served_elsewhere();
        let runtime = self.runtime();
        let config = &runtime.config;
        // Several ranks behind the served address: which one served is not known.
        let mut at_served = config.replicas.iter().filter(|r| r.address == served);
        let (Some(replica), None) = (at_served.next(), at_served.next()) else {
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
            leading_steps: LeadingSteps::default(),
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
            let Ok(mut larger) = self.tokens_and_facts(&context, leading_bytes).await else {
                break;
            };
            larger.1.tokenize_seconds += facts.tokenize_seconds;
            (source, facts) = larger;
        }
        // The decision routed on a leading part: the whole prompt follows in the background,
        // from the longest part's cut, for the conversation's next turn.
        if source == TokenSource::Leading {
            self.token_cache.complete_leading(tokens_request(
                &context,
                leading_bytes,
                Duration::ZERO,
            ));
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
        let tokenize_started = Instant::now();
        let tokens = self.prompt_tokens(context, leading_bytes).await?;
        let tokenize_seconds = tokenize_started.elapsed().as_secs_f64();
        let (keys, index_answer) = self.keys_and_index(context, &tokens).await?;
        Ok((
            tokens.source,
            PrefixFacts {
                keys,
                index_answer,
                prompt_tokens: tokens.estimated_len,
                token_source: tokens.source,
                tokenize_seconds,
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
            pool,
            deadline,
            ..
        } = *context;
        let config = &runtime.config;
        let tokenize_started = Instant::now();
        let tokenize_budget = config
            .tokenize_budget
            .min(deadline.saturating_duration_since(tokenize_started));
        let span = kvroute_runtime::trace_span!(
            "kvroute.tokenize",
            kvroute.token_source = tracing::field::Empty,
            kvroute.prompt_tokens = tracing::field::Empty,
        );
        let tokens = self
            .token_cache
            .tokens_for(tokens_request(context, leading_bytes, tokenize_budget))
            .instrument(span.clone())
            .await
        .map_err(|e| {
            self.count_fallback("tokenize", e.as_label());
            tracing::debug!(error = %e, pool = %pool.name, "tokenization failed, routing on load");
            match e {
                crate::error::TokenizeError::NotConfigured { .. } => LoadCause::NoTokenizer,
                crate::error::TokenizeError::Timeout { .. } => LoadCause::TokenizerTimeout,
                crate::error::TokenizeError::Busy { .. } => LoadCause::TokenizerBusy,
                crate::error::TokenizeError::PromptTooLarge { .. } => LoadCause::PromptTooLarge,
                crate::error::TokenizeError::MultiModal { .. } => LoadCause::MultiModal,
                crate::error::TokenizeError::Remote { .. }
                | crate::error::TokenizeError::Render { .. }
                | crate::error::TokenizeError::MultiModalFeatures { .. }
                | crate::error::TokenizeError::InProcess { .. } => LoadCause::TokenizerFailed,
            }
        })?;
        self.metrics
            .tokenize_duration
            .get_or_create(&KindLabel {
                kind: tokens.source.as_label(),
            })
            .observe(tokenize_started.elapsed().as_secs_f64());
        span.record("kvroute.token_source", tokens.source.as_label());
        span.record("kvroute.prompt_tokens", tokens.estimated_len);
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
        let keys_span = kvroute_runtime::trace_span!("kvroute.block_keys");
        let keys_entered = keys_span.enter();
        let keys = match &tokens.keys {
            // Cached keys are computed for text only (media items come from render mode, whose
            // keys are hashed here).
            Some(cached)
                if cached.fingerprint == keys_job.fingerprint
                    && tokens.multimodal.is_none()
                    && cached.keys.len() == tokens.tokens.len() / pool.block_size as usize =>
            {
                cached.keys.to_vec()
            }
            _ => pool
                .media_prompt_keys(
                    &tokens.tokens,
                    adapter,
                    request.cache_salt.as_deref(),
                    &crate::tokenizer::block_key_items(tokens.multimodal.as_deref()),
                )
                .map_err(|e| {
                    self.count_fallback("keys", e.as_label());
                    LoadCause::KeyError
                })?,
        };
        drop(keys_entered);
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
                model: pool.base_model(&request.model).to_owned(),
                adapter: adapter.map(|a| a.name.clone()).unwrap_or_default(),
                block_size: pool.block_size,
                keys: keys[..match_blocks(tokens, pool.block_size, keys.len())].to_vec(),
                candidates: candidates.iter().map(|r| r.id.clone()).collect(),
            };
            let span = kvroute_runtime::trace_span!(
                "kvroute.index_match",
                otel.kind = "client",
                kvroute.blocks = request.keys.len(),
            );
            match runtime
                .index
                .match_prefix(request, match_deadline)
                .instrument(span)
                .await
            {
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

/// What the prefill side of a split is scored on: the decode side's facts, kept.
#[derive(Debug)]
struct SplitFacts {
    keys: Vec<u64>,
    index_answer: Option<MatchResponse>,
    prompt_tokens: usize,
}

/// The token cache's request for `context`'s prompt, its leading part from `leading_bytes` on,
/// waiting at most `budget`.
fn tokens_request<'c>(
    context: &'c DecisionContext<'c>,
    leading_bytes: usize,
    budget: Duration,
) -> TokensRequest<'c> {
    let DecisionContext {
        runtime,
        pool_index,
        pool,
        request,
        ..
    } = *context;
    TokensRequest {
        pool: pool_index,
        // A request naming no model is the pool's base model (the name vLLM serves first).
        model: match request.model.as_ref() {
            "" => pool.base_model(""),
            named => named,
        },
        prompt: &request.prompt,
        tokenizer: runtime.tokenizers[pool_index].as_ref(),
        budget,
        leading_from: Some(leading_bytes),
        keys_job: Some(&context.keys_job),
        leading_steps: Some(&context.leading_steps),
    }
}

/// Per candidate (same order), the index's answer for it, where the index vouches for it. One
/// pass over each: an answer names up to every replica of the pool, and a pool of a thousand
/// searched once per candidate would be a million comparisons.
fn indexed_answers(
    answer: Option<&MatchResponse>,
    candidates: &[&Replica],
) -> Vec<Option<Indexed>> {
    let Some(answer) = answer else {
        return vec![None; candidates.len()];
    };
    let mut vouched: HashMap<&str, Indexed, foldhash::fast::RandomState> = HashMap::default();
    for m in answer.replicas.iter().filter(|m| m.precise) {
        vouched.entry(m.replica_id.as_str()).or_insert(Indexed {
            matched_blocks: m.matched_blocks,
            // An older index leaves it 0: its answers are dense ones.
            prefix_blocks: m.prefix_blocks.max(m.matched_blocks),
        });
    }
    candidates
        .iter()
        .map(|replica| vouched.get(replica.id.as_str()).copied())
        .collect()
}

/// GIE's saturation test on a replica's last scrape: queue or KV cache at its bound.
fn is_saturated(load: &ReplicaLoad, shedding: &crate::config::Shedding) -> bool {
    let scraped = load.snapshot().scraped;
    scraped.waiting >= shedding.queue_depth || scraped.kv_usage >= shedding.kv_cache_usage
}

/// Where each of `candidates` (borrowed from `replicas`, in its order: a filter of it) stands in
/// `replicas`: one pass over both.
fn positions_in(replicas: &[Replica], candidates: &[&Replica]) -> Vec<usize> {
    let mut next = candidates.iter().peekable();
    replicas
        .iter()
        .enumerate()
        .filter_map(|(i, replica)| {
            next.next_if(|candidate| std::ptr::eq(**candidate, replica))
                .map(|_| i)
        })
        .collect()
}

#[cfg(test)]
mod tests;
