//! Configuration: YAML → [`RawConfig`] (through `kvroute_config::from_yaml`, unknown keys
//! rejected) → validated [`Config`]. Every error is a `kvroute_config::ConfigError` naming its
//! field path, e.g. `replicas[2].address: expected ip:port (got "x")`.
//!
//! Every key, its meaning, unit and default: `docs/configuration.md`, generated from the `///`
//! docs and defaults of the raw structs in `raw`. The flags GIE's and llm-d's charts pass override
//! the file (see [`Overrides`]).
//!
//! Files: `raw` (the document's shape and every default), `overrides` (the chart flags), `chart`
//! (the whole config GIE's chart flags imply when there is no file), `build` and `pools` (each
//! section validated), `validate` (rules across sections); the validated types are here.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use kvroute_block_keys::{KeyScheme, LoraRef};
use kvroute_routing::ScoringConfig;
use kvroute_runtime::token::AgentToken;

use kvroute_config::ConfigError;

mod build;
mod chart;
mod overrides;
mod pools;
mod raw;
#[cfg(test)]
mod tests;
mod validate;

pub use chart::{
    CHART_GRPC_PORT, CHART_HEALTH_PORT, CHART_METRICS_PORT, CHART_SECURE_SERVING, ChartPool,
    ChartSelection, DEFAULT_POOL_GROUP, DEFAULT_SELECTOR_POOL_NAME,
};
pub use kvroute_config::{Engine, Role};
pub use overrides::Overrides;
pub use raw::{
    DEFAULT_ADMIN_ADDR, DEFAULT_APPROX_CAPACITY_BLOCKS, DEFAULT_BODY_MODE, DEFAULT_DEBUG_EXPOSE,
    DEFAULT_DEBUG_TOKEN_HEADER, DEFAULT_DECISION_BUDGET, DEFAULT_DISAGGREGATION_MIN_PROMPT_TOKENS,
    DEFAULT_DISAGGREGATION_MIN_UNCACHED_TOKENS, DEFAULT_DRAIN_TIMEOUT, DEFAULT_DRIFT_ACTION,
    DEFAULT_DRIFT_BOUND, DEFAULT_DRIFT_MIN_TOKENS, DEFAULT_DRIFT_WINDOW, DEFAULT_EPP_FALLBACKS,
    DEFAULT_GRPC_ADDR, DEFAULT_INDEX_RETRY_AFTER, DEFAULT_INFLIGHT_MAX_AGE, DEFAULT_MATCH_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENT_PREFILLS, DEFAULT_MAX_PREFILL_QUEUE,
    DEFAULT_MAX_STREAMS, DEFAULT_POOL_EVENTS, DEFAULT_POOL_MODE, DEFAULT_PREFILL_RETRIES,
    DEFAULT_PREFILL_TIMEOUT, DEFAULT_RECORD_SAMPLE, DEFAULT_RECORDS_KEPT, DEFAULT_RELOAD_INTERVAL,
    DEFAULT_REMOTE_TOKENIZE_TIMEOUT, DEFAULT_SCRAPE_TIMEOUT, DEFAULT_SECURE_SERVING,
    DEFAULT_SHED_KV_CACHE_USAGE, DEFAULT_SHED_QUEUE_DEPTH, DEFAULT_TOKEN_CACHE_BYTES,
    DEFAULT_TOKEN_CACHE_ENTRIES, DEFAULT_TOKENIZE_BUDGET, DEFAULT_TOKENIZE_CONCURRENCY_FALLBACK,
    DEFAULT_TOKENIZE_MAX_PROMPT_BYTES, DEFAULT_UNREADY_AFTER_FAILURES, DebugExpose, RawConfig,
    default_tokenize_concurrency,
};

/// Validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// ext_proc gRPC (and gRPC health) listen address.
    pub grpc_addr: SocketAddr,
    /// Admin HTTP listen address (`/metrics`, `/healthz`, `/readyz`).
    pub admin_addr: SocketAddr,
    /// A second, plaintext gRPC health listener for probes (`listen.health`).
    pub health_addr: Option<SocketAddr>,
    /// TLS with a self-signed certificate when `grpc_tls` is not given (`listen.secure_serving`).
    pub secure_serving: bool,
    /// GIE endpoint-picker protocol settings (`epp`).
    pub epp: EppConfig,
    /// TLS (and optionally client certificates) on the ext_proc gRPC port (`None`: plaintext).
    pub grpc_tls: Option<kvroute_runtime::tls::ServerTls>,
    /// kvroute-index addresses, tried in order (HA).
    pub index_addresses: Vec<http::Uri>,
    /// A kvroute-index run inside this process and asked first (`index.embedded`).
    pub embedded_index: Option<EmbeddedIndex>,
    /// TLS to the index (`None`: plaintext).
    pub index_tls: Option<kvroute_runtime::tls::ClientTls>,
    /// The index's `query_auth` token (`index.token_file`), sent with every `Match`.
    pub index_token: Option<AgentToken>,
    /// Deadline for one `Match`, fail-overs included.
    pub match_timeout: Duration,
    /// How long a failed index address is skipped.
    pub index_retry_after: Duration,
    /// Budget of a whole decision.
    pub decision_budget: Duration,
    /// Budget of tokenization within a decision.
    pub tokenize_budget: Duration,
    /// Shutdown drain timeout.
    pub drain_timeout: Duration,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Scrape settings.
    pub scrape: ScrapeConfig,
    /// Scoring weights.
    pub scoring: ScoringConfig,
    /// Entries of the tokenization cache.
    pub token_cache_entries: usize,
    /// Bytes the tokenization cache may account for.
    pub token_cache_bytes: usize,
    /// Most in-process tokenizations running on blocking threads at once.
    pub tokenize_concurrency: usize,
    /// Largest prompt tokenized whole in process, in bytes.
    pub tokenize_max_prompt_bytes: usize,
    /// Config file poll interval.
    pub reload_interval: Duration,
    /// `log.format` (read at start).
    pub log_format: kvroute_config::LogFormat,
    /// Body mode assumed when Envoy sends no `protocol_config`.
    pub default_body_mode: BodyMode,
    /// Who gets the debug response headers.
    pub debug_headers: DebugHeaders,
    /// Longest time a routed request holds its in-flight slot without response headers.
    pub inflight_max_age: Duration,
    /// Sharing decisions with the other ext-proc replicas (`peers`).
    pub peers: PeerSharing,
    /// Most ext_proc streams open at once.
    pub max_streams: usize,
    /// Drift detection (`drift`).
    pub drift: DriftConfig,
    /// Which decisions are recorded, and how many records are kept (`decision_records`).
    pub decision_records: DecisionRecordsConfig,
    /// The pool of a request that names no model (vLLM serves its base model): `default_pool`,
    /// or the only pool; `None` with several pools and no `default_pool`.
    pub default_pool: Option<usize>,
    /// Pools (non-empty).
    pub pools: Vec<Pool>,
    /// Replicas (non-empty); `Replica::pool` indexes `pools`.
    pub replicas: Vec<Replica>,
}

/// `index.embedded`: a kvroute-index config file, run in this process.
#[derive(Debug, Clone)]
pub struct EmbeddedIndex {
    /// The file, as configured.
    pub path: PathBuf,
    /// Its text (a changed file is a changed config).
    text: String,
    /// The validated index config.
    pub config: crate::embedded::IndexConfig,
}

impl PartialEq for EmbeddedIndex {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path && self.text == other.text
    }
}

impl EmbeddedIndex {
    fn load(path: &std::path::Path) -> Result<Self, ConfigError> {
        let rejected = |reason: &dyn std::fmt::Display| {
            ConfigError::load(
                "index.embedded",
                format_args!(
                    "kvroute-index config '{}' rejected: {reason}",
                    path.display()
                ),
            )
        };
        let text = std::fs::read_to_string(path).map_err(|e| rejected(&e))?;
        let config = crate::embedded::IndexConfig::from_yaml(&text)
            .map_err(|e| rejected(&format_args!("{:#}", anyhow::Error::from(e))))?;
        Ok(Self {
            path: path.to_path_buf(),
            text,
            config,
        })
    }
}

/// Who gets the debug response headers (`x-kvroute-decision`, `x-kvroute-predicted-cached-tokens`).
/// They tell a client whether its prompt (or a guess at someone else's) was cached, so they are
/// off unless configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DebugHeaders {
    /// Nobody (the default).
    Never,
    /// Every response (trusted clients only: tests, benchmarks, a private deployment).
    Always,
    /// Requests whose `header` carries `token`; the header never goes upstream.
    Token {
        /// Lowercase request header name.
        header: String,
        /// The secret (never printed), compared in constant time.
        token: AgentToken,
    },
}

impl DebugHeaders {
    /// Metric/log label.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::Never => "never",
            Self::Always => "always",
            Self::Token { .. } => "token",
        }
    }
}

/// `decision_records`, validated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecisionRecordsConfig {
    /// Share of decisions recorded (flagged ones always are).
    pub sample: f64,
    /// Most recent records kept.
    pub keep: usize,
}

/// A pool's `mode`: whether kvroute's choice is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PoolMode {
    /// kvroute picks the replica.
    Route,
    /// kvroute decides and compares, Envoy picks.
    Shadow,
}

impl PoolMode {
    /// Config value and label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Route => "route",
            Self::Shadow => "shadow",
        }
    }
}

/// How a pool's split requests reach their prefill replica.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DisaggregationMode {
    /// The decode replica's sidecar runs the prefill leg: the request names the prefill replica
    /// in `x-prefiller-host-port`, as llm-d's `pd-sidecar` expects.
    #[default]
    Sidecar,
    /// ext-proc runs the prefill leg itself before it answers Envoy, and the request goes to
    /// the decode replica with the prefill's `kv_transfer_params` in its body: no sidecar.
    Envoy,
}

impl DisaggregationMode {
    /// Config value and label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Sidecar => "sidecar",
            Self::Envoy => "envoy",
        }
    }
}

/// `pools[].disaggregation`: when a request's prompt is computed on a prefill replica and its KV
/// pulled by the decode replica that serves it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Disaggregation {
    /// How the prefill leg runs.
    pub mode: DisaggregationMode,
    /// Prompts shorter than this many tokens are served whole on the decode replica.
    pub min_prompt_tokens: usize,
    /// A prompt is split when at least this many of its tokens are not cached on the chosen
    /// decode replica.
    pub min_uncached_tokens: usize,
    /// A prefill replica whose estimated queue is at least this takes no leg; with every one
    /// that busy the request is served whole. `None`: no bound.
    pub max_prefill_queue: Option<Duration>,
    /// `envoy` mode: how ext-proc runs the prefill leg.
    pub prefill: PrefillLegSettings,
}

impl Disaggregation {
    /// The split thresholds, as the shared decision takes them.
    pub fn rule(&self) -> kvroute_routing::SplitRule {
        kvroute_routing::SplitRule {
            min_prompt_tokens: self.min_prompt_tokens,
            min_uncached_tokens: self.min_uncached_tokens,
            max_prefill_queue: self.max_prefill_queue,
        }
    }
}

/// How ext-proc runs a prefill leg itself (`disaggregation.mode: envoy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillLegSettings {
    /// The whole leg, retries included; past it the request is served whole.
    pub timeout: Duration,
    /// Further attempts after a 502, 503 or 504 answer (or a refused connection).
    pub retries: u32,
    /// Legs of the pool in flight at once; a split beyond them is served whole.
    pub max_concurrent: usize,
}

/// `peers`: decisions shared with the other ext-proc replicas through the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerSharing {
    /// Whether to share (and there is an index address to share through).
    pub share: bool,
    /// Older news is dropped.
    pub max_staleness: Duration,
}

/// `drift`: when a replica's predicted cached tokens stop matching what its engine reports
/// (see the `drift` module).
#[derive(Debug, Clone, PartialEq)]
pub struct DriftConfig {
    /// Drift above which a replica starts drifting.
    pub bound: f64,
    /// Drift at or below which a drifting replica stops drifting (hysteresis).
    pub clear_below: f64,
    /// Span of the window.
    pub window: Duration,
    /// Predicted cached tokens the window needs for a verdict.
    pub min_tokens: u64,
    /// What a drifting replica causes beyond the warning.
    pub action: DriftAction,
}

/// What a drifting replica causes (`drift.action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DriftAction {
    /// A rate-limited warning and the metrics only.
    Warn,
    /// Also its pool's decisions skip the index (the approximate tier) while it drifts.
    Approximate,
}

impl DriftAction {
    /// Config value and log label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Warn => "warn",
            Self::Approximate => "approximate",
        }
    }
}

impl Default for DriftConfig {
    fn default() -> Self {
        Self {
            bound: DEFAULT_DRIFT_BOUND,
            clear_below: DEFAULT_DRIFT_BOUND / 2.0,
            window: DEFAULT_DRIFT_WINDOW,
            min_tokens: DEFAULT_DRIFT_MIN_TOKENS,
            action: DEFAULT_DRIFT_ACTION,
        }
    }
}

/// `epp`: what the endpoint-picker protocol answers beyond the chosen endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct EppConfig {
    /// Fallback endpoints after the chosen one, best first.
    pub fallbacks: usize,
    /// Refuse with 429 when every ready replica is saturated (`None`: never).
    pub shedding: Option<Shedding>,
}

/// When a replica counts as saturated: either bound reached (GIE's saturation detector).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shedding {
    /// Waiting requests (scraped queue depth).
    pub queue_depth: f64,
    /// KV-cache usage, 0..1.
    pub kv_cache_usage: f64,
}

/// How Envoy sends the request body to us (`default_body_mode`: `buffered` or
/// `full_duplex_streamed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BodyMode {
    /// One message with the whole body; headers are answered right away.
    Buffered,
    /// Chunks; the header answer waits for the body, which is echoed back.
    FullDuplexStreamed,
}

/// `/metrics` scraping.
#[derive(Debug, Clone, PartialEq)]
pub struct ScrapeConfig {
    /// Interval between scrapes.
    pub interval: Duration,
    /// Timeout of one scrape.
    pub timeout: Duration,
    /// Consecutive failures after which the replica is not ready.
    pub unready_after_failures: u32,
}

/// A pool: replicas serving the same model(s) with one block size and key scheme.
#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    /// Pool name (a metric label).
    pub name: String,
    /// Served (base) model names; empty (a pool built from GIE's chart flags without `--model`):
    /// every model no other pool names.
    pub models: Vec<String>,
    /// LoRA adapters served by the pool.
    pub adapters: Vec<Adapter>,
    /// KV block size in tokens.
    pub block_size: u32,
    /// How block keys are computed (same code as the index).
    pub key_scheme: KeyScheme,
    /// A 64-bit hash of `key_scheme` and `block_size`, which cached block keys carry (hashed
    /// once here: writing the scheme out per request was a twentieth of a long decision).
    pub keys_fingerprint: u64,
    /// Whether kvroute's choice is applied (`route`) or only compared (`shadow`).
    pub mode: PoolMode,
    /// Whether the index has this pool's events (precise tier possible).
    pub events: bool,
    /// Capacity of each replica's approximate prefix memory, in blocks: it keeps the most recently
    /// routed one to two times this many.
    pub approx_capacity_blocks: usize,
    /// Where tokens come from.
    pub tokenizer: TokenizerSource,
    /// Replicas discovered from Kubernetes (`discovery.kubernetes`) instead of `replicas:`.
    pub discovery: Option<kvroute_discovery::KubernetesSource>,
    /// Prefill/decode disaggregation, when the pool splits requests.
    pub disaggregation: Option<Disaggregation>,
    /// The engine family of its replicas unless one says otherwise.
    pub engine: Engine,
}

impl Pool {
    /// Whether the pool takes every model no other pool names (built from GIE's chart flags
    /// without `--model`).
    pub fn serves_any_model(&self) -> bool {
        self.models.is_empty()
    }

    /// Whether this pool's block keys match what a replica of `engine` publishes: the engines'
    /// own hashes are vLLM's under `vllm-exact`, while `token-chain` keys are recomputed from
    /// any engine's tokens.
    pub fn keys_serve(&self, engine: Engine) -> bool {
        self.key_scheme.serves(engine)
    }

    /// Whether `model` is one of the pool's models or adapters (any, for such a pool).
    pub fn serves(&self, model: &str) -> bool {
        self.serves_any_model()
            || self.models.iter().any(|m| m == model)
            || self.adapters.iter().any(|a| a.name == model)
    }

    /// The base model a request for `requested` runs (`""`: the request named none): the
    /// pool's first model, as vLLM serves it, or what was requested when the pool takes any.
    pub fn base_model<'a>(&'a self, requested: &'a str) -> &'a str {
        self.models.first().map_or(requested, String::as_str)
    }

    /// The key of every full block of `tokens`, with the extra keys (`adapter`, `cache_salt`)
    /// the pool's vLLM era hashes: what the picker asks the index for, and what
    /// `kvroute-check` prints.
    pub fn prompt_keys(
        &self,
        tokens: &[u32],
        adapter: Option<&Adapter>,
        cache_salt: Option<&str>,
    ) -> Result<Vec<u64>, kvroute_block_keys::KeyError> {
        let lora = adapter.map(Adapter::as_lora_ref);
        self.key_scheme
            .prompt_keys(tokens, self.block_size as usize, lora.as_ref(), cache_salt)
    }

    /// [`Self::prompt_keys`] of a prompt whose media items (`media`, in vLLM's order; render
    /// mode) are hashed into the blocks they overlap
    /// ([`KeyScheme::media_prompt_keys`](kvroute_block_keys::KeyScheme::media_prompt_keys)).
    pub fn media_prompt_keys(
        &self,
        tokens: &[u32],
        adapter: Option<&Adapter>,
        cache_salt: Option<&str>,
        media: &[kvroute_block_keys::MultiModalItem<'_>],
    ) -> Result<Vec<u64>, kvroute_block_keys::KeyError> {
        if media.is_empty() {
            return self.prompt_keys(tokens, adapter, cache_salt);
        }
        let lora = adapter.map(Adapter::as_lora_ref);
        self.key_scheme.media_prompt_keys(
            tokens,
            self.block_size as usize,
            lora.as_ref(),
            cache_salt,
            media,
        )
    }
}

/// A LoRA adapter, as vLLM's `LoRARequest` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapter {
    /// `lora_name` (what clients send as `model`).
    pub name: String,
    /// `lora_int_id` (keys of vLLM <= 0.11.0).
    pub id: Option<i64>,
    /// `lora_path` (keys of vLLM >= 0.31).
    pub path: Option<String>,
}

impl Adapter {
    /// The adapter as block-keys wants it.
    pub fn as_lora_ref(&self) -> LoraRef<'_> {
        LoraRef {
            id: self.id,
            name: &self.name,
            path: self.path.as_deref(),
        }
    }
}

/// Where a pool's tokens come from.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenizerSource {
    /// An HF model folder loaded in-process.
    ModelDir(PathBuf),
    /// A `/tokenize` endpoint (vLLM-compatible).
    Remote {
        /// Full URL of the endpoint.
        url: http::Uri,
        /// Per-call timeout.
        timeout: Duration,
    },
    /// The engine's render endpoints (`{url}/v1/chat/completions/render` and the like): the
    /// whole request body goes to the one matching the request's endpoint.
    Render {
        /// Base URL of the engine (scheme, authority, optional path prefix).
        url: http::Uri,
        /// Per-call timeout.
        timeout: Duration,
    },
    /// No tokenizer: every decision uses the load tier.
    None,
}

/// One engine replica.
#[derive(Debug, Clone, PartialEq)]
pub struct Replica {
    /// Stable id, as the index knows it (a metric label).
    pub id: String,
    /// Index into `Config::pools`.
    pub pool: usize,
    /// `ip:port` Envoy routes to.
    pub address: SocketAddr,
    /// The data-parallel rank this replica is, when several ranks share `address` (one API
    /// server in front of them): routing here names it in the `x-data-parallel-rank` header, and
    /// its load is the `engine="<rank>"` series of the server's metrics.
    pub dp_rank: Option<u32>,
    /// Its part in prefill/decode disaggregation.
    pub role: Role,
    /// The engine family serving it (its metric names).
    pub engine: Engine,
    /// The engine's Prometheus endpoint.
    pub metrics_url: Option<http::Uri>,
    /// Envoy cluster for `cluster_header` routes.
    pub envoy_cluster: Option<String>,
}

impl Replica {
    /// Where a request routed here goes: the address, and the rank behind it when it has ranks.
    pub fn target(&self) -> (SocketAddr, Option<u32>) {
        (self.address, self.dp_rank)
    }
}

impl Config {
    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        Self::from_yaml_with(text, &Overrides::default())
    }

    /// Parses and validates YAML with command-line `overrides` applied first.
    pub fn from_yaml_with(text: &str, overrides: &Overrides) -> Result<Self, ConfigError> {
        let mut raw: RawConfig = kvroute_config::from_yaml(text)?;
        overrides.apply(&mut raw);
        Self::try_from(raw)
    }

    /// Reads, parses and validates a YAML file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        Self::from_file_with(path, &Overrides::default())
    }

    /// Reads, parses and validates a YAML file with command-line `overrides` applied.
    pub fn from_file_with(
        path: &std::path::Path,
        overrides: &Overrides,
    ) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::load(
                "",
                format_args!("cannot read config file {}: {e}", path.display()),
            )
        })?;
        Self::from_yaml_with(&text, overrides)
    }

    /// The pool serving `model`, and the adapter when `model` is a LoRA adapter. An empty
    /// `model` (the request named none) is the default pool's base model, as vLLM serves it.
    pub fn pool_for_model(&self, model: &str) -> Option<(usize, Option<&Adapter>)> {
        if model.is_empty() {
            return self.default_pool.map(|pool| (pool, None));
        }
        self.pools
            .iter()
            .enumerate()
            .find_map(|(i, pool)| {
                if pool.models.iter().any(|m| m == model) {
                    Some((i, None))
                } else {
                    pool.adapters
                        .iter()
                        .find(|a| a.name == model)
                        .map(|a| (i, Some(a)))
                }
            })
            .or_else(|| {
                self.pools
                    .iter()
                    .position(Pool::serves_any_model)
                    .map(|i| (i, None))
            })
    }
}
