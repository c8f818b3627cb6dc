//! Configuration: YAML → [`RawConfig`] (serde, unknown keys rejected) → validated [`Config`].
//!
//! Every default is a named const beside its key. Validation rejects (never skips) a bad entry and
//! names the field, e.g. `replicas[2].address: invalid value 'x': expected ip:port`.
//!
//! Every key, its default and meaning: `docs/configuration.md` (generated from the field docs of
//! [`RawConfig`]).
//!
//! The flags GIE's and llm-d's charts pass override the file (see [`Overrides`]).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use kvroute_block_keys::{KeyScheme, LoraRef, PoolKeySettings, RawKeyScheme};
use kvroute_config::{TokenSource, parse_duration};
use kvroute_runtime::token::{AgentToken, TokenError};

use kvroute_routing::ScoringConfig;
use kvroute_routing::load::DEFAULT_SCRAPE_INTERVAL;
use kvroute_routing::scoring::{
    DEFAULT_HOTSPOT_FACTOR, DEFAULT_HOTSPOT_MIN_MS, DEFAULT_KV_USAGE_MS,
    DEFAULT_PREFILL_MS_PER_TOKEN, DEFAULT_QUEUE_MS_PER_REQUEST, DEFAULT_RECOMPUTE_PENALTY,
    DEFAULT_RUNNING_MS_PER_REQUEST, DEFAULT_SPECULATIVE_TTL,
};

use crate::error::ConfigError;

/// Default ext_proc gRPC listen address (GIE's EPP port). Loopback: whoever reaches this port gets
/// routing decisions and holds in-flight slots, so listening wider is a deliberate choice.
pub const DEFAULT_GRPC_ADDR: &str = "127.0.0.1:9002";
/// Default admin HTTP listen address (loopback, like every listener unless configured). GIE's
/// metrics port: its 9003 is the gRPC health port (`listen.health`).
pub const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:9090";
/// Default fallback endpoints after the chosen one (`epp.fallbacks`): two more replicas cover
/// one failed retry and one more without spreading a conversation's retries over the pool.
pub const DEFAULT_EPP_FALLBACKS: usize = 2;
/// Waiting requests at which a replica counts as saturated for shedding (GIE's default).
pub const DEFAULT_SHED_QUEUE_DEPTH: f64 = 5.0;
/// KV-cache usage (0..1) at which a replica counts as saturated for shedding (GIE's default).
pub const DEFAULT_SHED_KV_CACHE_USAGE: f64 = 0.8;
/// Default deadline for one `Match` call on the index (all fail-overs included).
pub const DEFAULT_MATCH_TIMEOUT: Duration = Duration::from_millis(20);
/// How long an index address that failed is skipped before being tried again.
pub const DEFAULT_INDEX_RETRY_AFTER: Duration = Duration::from_secs(2);
/// Default budget for a whole routing decision (tokenize + match + score).
pub const DEFAULT_DECISION_BUDGET: Duration = Duration::from_millis(50);
/// Default budget for tokenization within a decision.
pub const DEFAULT_TOKENIZE_BUDGET: Duration = Duration::from_millis(30);
/// Default time in-flight streams get to finish on shutdown.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Default request body limit (Envoy's default BUFFERED limit is 1 MiB; FULL_DUPLEX passes more).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Default timeout of one `/metrics` scrape.
pub const DEFAULT_SCRAPE_TIMEOUT: Duration = Duration::from_millis(400);
/// Consecutive failed scrapes after which a replica counts as not ready.
pub const DEFAULT_UNREADY_AFTER_FAILURES: u32 = 3;
/// Default capacity (blocks) of each replica's approximate prefix memory.
pub const DEFAULT_APPROX_CAPACITY_BLOCKS: usize = 65_536;
/// Default number of cached tokenizations (whole prompts / conversation prefixes).
pub const DEFAULT_TOKEN_CACHE_ENTRIES: usize = 4096;
/// Default bytes the token cache may account for (`token_cache_bytes`): 256 MiB ≈ 64M tokens.
pub const DEFAULT_TOKEN_CACHE_BYTES: usize = 256 * 1024 * 1024;
/// Default largest prompt (text, or the messages and other prompt fields' JSON) tokenized whole
/// in process (`limits.tokenize_max_prompt_bytes`): a fast-encoder tokenization of this much
/// takes ≈ 25 ms in a release build, within the default tokenize budget.
pub const DEFAULT_TOKENIZE_MAX_PROMPT_BYTES: usize = 2 * 1024 * 1024;
/// Default most in-process tokenizations on blocking threads at once
/// (`limits.tokenize_concurrency`): the number of CPUs (this when it cannot be read).
pub const DEFAULT_TOKENIZE_CONCURRENCY_FALLBACK: usize = 2;
/// Default timeout of a remote `/tokenize` call.
pub const DEFAULT_REMOTE_TOKENIZE_TIMEOUT: Duration = Duration::from_millis(25);
/// Default interval at which the config file's mtime is checked for reloads.
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(2);
/// Pool key defaults, shared with kvroute-index (`kvroute_block_keys::schema`): vLLM 0.32's.
pub use kvroute_block_keys::{DEFAULT_BLOCK_SIZE, DEFAULT_HASH_ALGO, DEFAULT_VLLM_VERSION};
/// Default longest time a routed request counts in its replica's in-flight load while Envoy has
/// not reported its response headers (`limits.inflight_max_age`). Streaming responses report them
/// when the engine starts answering, non-streaming ones when generation ends, so a long generation
/// legitimately holds its slot for minutes; ten minutes covers that and still frees the slot of a
/// stream that is never finished. Releasing early costs little: the engine's scraped
/// `num_requests_running` still counts the request.
pub const DEFAULT_INFLIGHT_MAX_AGE: Duration = Duration::from_secs(600);
/// Default most ext_proc streams open at once (`limits.max_streams`); more are refused with
/// RESOURCE_EXHAUSTED (Envoy then fails open). Above the ext_proc cluster's circuit breaker in the
/// shipped Envoy configs (40 000), so only a peer that is not that Envoy meets it.
pub const DEFAULT_MAX_STREAMS: usize = 65_536;
/// Debug response headers are exposed to nobody unless configured (`debug_headers.expose`).
pub const DEFAULT_DEBUG_EXPOSE: &str = "never";
/// Request header carrying the debug token (`debug_headers.token_header`).
pub const DEFAULT_DEBUG_TOKEN_HEADER: &str = "x-kvroute-debug-token";
/// Default drift above which a replica counts as drifting (`drift.bound`, 0..1).
pub const DEFAULT_DRIFT_BOUND: f64 = 0.5;
/// Default span of the drift window (`drift.window`): long enough to average a few hundred
/// requests on a busy replica, short enough to notice a bad rollout within minutes.
pub const DEFAULT_DRIFT_WINDOW: Duration = Duration::from_secs(300);
/// Default predicted cached tokens a window needs before it gives a verdict (`drift.min_tokens`):
/// a few dozen requests with a shared prefix, so one request's eviction cannot trip the bound.
pub const DEFAULT_DRIFT_MIN_TOKENS: u64 = 16_384;
/// Default action past the bound (`drift.action`).
pub const DEFAULT_DRIFT_ACTION: &str = "warn";

/// The default of `limits.tokenize_concurrency`: the number of CPUs this process may use.
pub fn default_tokenize_concurrency() -> usize {
    std::thread::available_parallelism().map_or(
        DEFAULT_TOKENIZE_CONCURRENCY_FALLBACK,
        std::num::NonZero::get,
    )
}

/// The YAML document as written. Unknown keys are errors.
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    /// Listen addresses, TLS and health port.
    listen: RawListen,
    /// The kvroute-index to query (`addresses`), or the index run inside this process (`embedded`).
    index: RawIndex,
    /// Time budgets of a routing decision and of shutdown.
    budgets: RawBudgets,
    /// Largest request body buffered for routing (Envoy's BUFFERED limit is 1 MiB; FULL_DUPLEX
    /// passes more).
    #[schemars(extend("default" = DEFAULT_MAX_BODY_BYTES))]
    max_body_bytes: Option<usize>,
    /// Scraping the replicas' `/metrics` for load.
    scrape: RawScrape,
    /// Weights of the routing score (milliseconds of expected delay).
    scoring: RawScoring,
    /// Cached tokenizations (whole prompts, conversation prefixes) at most.
    #[schemars(extend("default" = DEFAULT_TOKEN_CACHE_ENTRIES))]
    token_cache_entries: Option<usize>,
    /// Bytes the token cache may account for (tokens at 4 bytes each plus a fixed cost per entry).
    #[schemars(extend("default" = DEFAULT_TOKEN_CACHE_BYTES))]
    token_cache_bytes: Option<usize>,
    /// How often the config file's modification time is checked for a reload.
    #[schemars(extend("default" = kvroute_config::format_duration(DEFAULT_RELOAD_INTERVAL)))]
    reload_interval: Option<String>,
    /// Body mode assumed when Envoy does not send `protocol_config` (Envoy < 1.34): `buffered` or
    /// `full_duplex_streamed`.
    default_body_mode: Option<String>,
    /// Debug response headers (`x-kvroute-decision`, `x-kvroute-predicted-cached-tokens`) reveal
    /// whether a prompt was cached: off unless configured.
    debug_headers: RawDebugHeaders,
    /// Load accounting, stream and tokenization limits.
    limits: RawLimits,
    /// Drift between kvroute's predicted and the engines' reported cached tokens: a replica past
    /// `bound` is warned about, or with `action: approximate` its pool routes on the approximate
    /// tier until the drift is back under `clear_below`.
    drift: RawDrift,
    /// GIE endpoint-picker protocol: fallback endpoints and load shedding.
    epp: RawEpp,
    /// The pool of a request that names no model (vLLM serves its base model): needed only with
    /// several pools (without it: 400).
    default_pool: Option<String>,
    /// One pool per served model: the pool schema kvroute-index shares (`name`, `models`,
    /// `block_size`, `key_scheme`: paste them unchanged) and ext-proc's own keys.
    pools: Vec<RawPool>,
    /// Static replicas (a pool with `discovery` takes none).
    replicas: Vec<RawReplica>,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawListen {
    /// ext_proc gRPC address (GIE's EPP port); gRPC health is always served on it too. Loopback
    /// unless configured: in a pod, listen on `0.0.0.0`.
    #[schemars(extend("default" = DEFAULT_GRPC_ADDR))]
    grpc: Option<String>,
    /// Admin HTTP address (`/metrics`, `/healthz`, `/readyz`).
    #[schemars(extend("default" = DEFAULT_ADMIN_ADDR))]
    admin: Option<String>,
    /// A plaintext gRPC health port for probes (GIE's 9003), besides the ext_proc port.
    health: Option<String>,
    /// TLS on the ext_proc port, optionally requiring client certificates signed by `client_ca`
    /// (Envoy's ext_proc cluster then needs an UpstreamTlsContext).
    tls: Option<kvroute_config::RawServerTls>,
    /// `true` without `tls`: serve TLS with a self-signed certificate made at start (GIE's and
    /// llm-d's `--secure-serving`).
    secure_serving: Option<bool>,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawEpp {
    /// Fallback endpoints (best first) after the chosen one in `x-gateway-destination-endpoint` and
    /// its `envoy.lb` metadata, which a proxy's retries walk; 0 sends the chosen endpoint alone.
    #[schemars(extend("default" = DEFAULT_EPP_FALLBACKS))]
    fallbacks: Option<usize>,
    /// Refuse a request with 429 when every ready replica of its pool is saturated; off unless
    /// configured.
    shedding: Option<RawShedding>,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawShedding {
    /// Waiting requests at which a replica counts as saturated (GIE's default).
    #[schemars(extend("default" = DEFAULT_SHED_QUEUE_DEPTH))]
    queue_depth: Option<f64>,
    /// KV-cache usage (0..1) at which a replica counts as saturated (GIE's default).
    #[schemars(extend("default" = DEFAULT_SHED_KV_CACHE_USAGE))]
    kv_cache_usage: Option<f64>,
}

/// Command-line settings that override the file: the flags GIE's and llm-d's EPP charts pass
/// (`--grpc-port`, `--grpc-health-port`, `--metrics-port`, `--secure-serving`, `--cert-path`).
/// A port flag listens on all interfaces (`0.0.0.0:port`), as those charts expect. Applied on
/// every reload too.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Overrides {
    /// `listen.grpc` = `0.0.0.0:port`.
    pub grpc_port: Option<u16>,
    /// `listen.health` = `0.0.0.0:port`.
    pub health_port: Option<u16>,
    /// `listen.admin` = `0.0.0.0:port` (`/metrics`).
    pub metrics_port: Option<u16>,
    /// `listen.secure_serving`.
    pub secure_serving: Option<bool>,
    /// `listen.tls` = `{cert: DIR/tls.crt, key: DIR/tls.key}` (a Kubernetes TLS Secret's keys).
    pub cert_dir: Option<PathBuf>,
}

impl Overrides {
    fn apply(&self, raw: &mut RawConfig) {
        let all_interfaces = |port: u16| format!("0.0.0.0:{port}");
        if let Some(port) = self.grpc_port {
            raw.listen.grpc = Some(all_interfaces(port));
        }
        if let Some(port) = self.health_port {
            raw.listen.health = Some(all_interfaces(port));
        }
        if let Some(port) = self.metrics_port {
            raw.listen.admin = Some(all_interfaces(port));
        }
        if let Some(secure) = self.secure_serving {
            raw.listen.secure_serving = Some(secure);
        }
        if let Some(dir) = &self.cert_dir {
            raw.listen.tls = Some(kvroute_config::RawServerTls {
                cert: dir.join("tls.crt").display().to_string(),
                key: dir.join("tls.key").display().to_string(),
                client_ca: None,
            });
        }
    }
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawIndex {
    /// kvroute-index gRPC addresses (`http://host:port`, `https://` with `tls`), tried in order.
    addresses: Vec<String>,
    /// A kvroute-index config file: the index runs inside this process (Match without a network
    /// hop). Exclusive with `addresses`.
    embedded: Option<PathBuf>,
    /// Deadline of one `Match` call (all fail-overs included).
    #[schemars(extend("default" = kvroute_config::format_duration(DEFAULT_MATCH_TIMEOUT)))]
    match_timeout: Option<String>,
    /// How long an index address that failed is skipped before being tried again.
    #[schemars(extend("default" = kvroute_config::format_duration(DEFAULT_INDEX_RETRY_AFTER)))]
    retry_after: Option<String>,
    /// TLS to the index; `addresses` are then `https://`.
    tls: Option<kvroute_config::RawClientTls>,
    /// File holding the index's `query_auth` token, sent as `authorization: Bearer <token>` with
    /// every Match.
    token_file: Option<String>,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawLimits {
    /// Longest time a routed request counts in its replica's in-flight load while Envoy has not
    /// reported its response headers.
    #[schemars(extend("default" = kvroute_config::format_duration(DEFAULT_INFLIGHT_MAX_AGE)))]
    inflight_max_age: Option<String>,
    /// Most ext_proc streams open at once; more are refused with RESOURCE_EXHAUSTED (Envoy then
    /// fails open).
    #[schemars(extend("default" = DEFAULT_MAX_STREAMS))]
    max_streams: Option<usize>,
    /// Most in-process tokenizations on blocking threads at once (default: the number of CPUs); a
    /// decision that gets no slot within its tokenize budget falls back.
    tokenize_concurrency: Option<usize>,
    /// Largest prompt tokenized whole in process (its leading tokens still are beyond it).
    #[schemars(extend("default" = DEFAULT_TOKENIZE_MAX_PROMPT_BYTES))]
    tokenize_max_prompt_bytes: Option<usize>,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawDrift {
    /// Drift (0..1) above which a replica counts as drifting.
    #[schemars(extend("default" = DEFAULT_DRIFT_BOUND))]
    bound: Option<f64>,
    /// Drift under which a drifting replica counts as recovered (default: `bound` / 2).
    clear_below: Option<f64>,
    /// Span of the drift window.
    #[schemars(extend("default" = kvroute_config::format_duration(DEFAULT_DRIFT_WINDOW)))]
    window: Option<String>,
    /// Predicted cached tokens a window needs before it gives a verdict.
    #[schemars(extend("default" = DEFAULT_DRIFT_MIN_TOKENS))]
    min_tokens: Option<u64>,
    /// Past the bound: `warn` (rate-limited log) or `approximate` (the pool routes on the
    /// approximate tier).
    #[schemars(extend("default" = DEFAULT_DRIFT_ACTION))]
    action: Option<String>,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawDebugHeaders {
    /// Who gets the debug headers: `never`, `always`, or `token` (requests carrying the secret,
    /// compared in constant time and removed before the request goes upstream).
    #[schemars(extend("default" = DEFAULT_DEBUG_EXPOSE))]
    expose: Option<String>,
    /// Request header carrying the debug token (`token` mode).
    #[schemars(extend("default" = DEFAULT_DEBUG_TOKEN_HEADER))]
    token_header: Option<String>,
    /// File holding the debug token (`token` mode).
    token_file: Option<String>,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawBudgets {
    /// Budget of a whole routing decision (tokenize + match + score).
    #[schemars(extend("default" = kvroute_config::format_duration(DEFAULT_DECISION_BUDGET)))]
    decision: Option<String>,
    /// Budget of tokenization within a decision.
    #[schemars(extend("default" = kvroute_config::format_duration(DEFAULT_TOKENIZE_BUDGET)))]
    tokenize: Option<String>,
    /// Time in-flight streams get to finish on shutdown.
    #[schemars(extend("default" = kvroute_config::format_duration(DEFAULT_DRAIN_TIMEOUT)))]
    drain: Option<String>,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawScrape {
    /// How often each replica's `/metrics` is scraped.
    #[schemars(extend("default" = kvroute_config::format_duration(DEFAULT_SCRAPE_INTERVAL)))]
    interval: Option<String>,
    /// Timeout of one scrape.
    #[schemars(extend("default" = kvroute_config::format_duration(DEFAULT_SCRAPE_TIMEOUT)))]
    timeout: Option<String>,
    /// Consecutive failed scrapes after which a replica counts as not ready.
    #[schemars(extend("default" = DEFAULT_UNREADY_AFTER_FAILURES))]
    unready_after_failures: Option<u32>,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawScoring {
    /// Expected prefill time per uncached prompt token (ms).
    #[schemars(extend("default" = DEFAULT_PREFILL_MS_PER_TOKEN))]
    prefill_ms_per_token: Option<f64>,
    /// Expected delay per waiting request (ms).
    #[schemars(extend("default" = DEFAULT_QUEUE_MS_PER_REQUEST))]
    queue_ms_per_request: Option<f64>,
    /// Expected delay per running request (ms).
    #[schemars(extend("default" = DEFAULT_RUNNING_MS_PER_REQUEST))]
    running_ms_per_request: Option<f64>,
    /// Delay at full KV-cache usage (ms), scaled by the usage.
    #[schemars(extend("default" = DEFAULT_KV_USAGE_MS))]
    kv_usage_ms: Option<f64>,
    /// Penalty factor for a replica far busier than its pool.
    #[schemars(extend("default" = DEFAULT_HOTSPOT_FACTOR))]
    hotspot_factor: Option<f64>,
    /// Smallest expected delay (ms) at which the hotspot penalty applies.
    #[schemars(extend("default" = DEFAULT_HOTSPOT_MIN_MS))]
    hotspot_min_ms: Option<f64>,
    /// Weight of prompt tokens a replica would recompute.
    #[schemars(extend("default" = DEFAULT_RECOMPUTE_PENALTY))]
    recompute_penalty: Option<f64>,
    /// How long a routed prompt's blocks count as cached on its replica before the index confirms
    /// them.
    #[schemars(extend("default" = kvroute_config::format_duration(DEFAULT_SPECULATIVE_TTL)))]
    speculative_ttl: Option<String>,
}

/// A pool. `name`, `models`, `block_size` and `key_scheme` are the schema every kvroute
/// component shares (kvroute-index's pools take the same keys with the same defaults); the rest
/// is ext-proc's own.
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawPool {
    /// Pool name (unique; what replicas name in `pool`).
    name: Option<String>,
    /// Served model names (as in requests' `model`).
    models: Vec<String>,
    /// Tokens per KV block (the engines' `--block-size`).
    #[schemars(extend("default" = DEFAULT_BLOCK_SIZE))]
    block_size: Option<u32>,
    /// How block keys are computed (the engines' hashing settings).
    key_scheme: RawKeyScheme,
    // ext-proc only:
    /// LoRA adapters served: a name, or `{name, id, path}` (vLLM 0.31+ hashes the adapter's path).
    adapters: Vec<RawAdapter>,
    /// Whether the index receives this pool's KV events (else: approximate tier only).
    events: Option<bool>,
    /// Capacity (blocks) of each replica's approximate prefix memory.
    #[schemars(extend("default" = DEFAULT_APPROX_CAPACITY_BLOCKS))]
    approx_capacity_blocks: Option<usize>,
    /// Where prompts are tokenized: `model_dir` (in process), `remote` (a `/tokenize` endpoint) or
    /// `render` (the engine's own render endpoints, exact by construction).
    tokenizer: Option<RawTokenizer>,
    /// Where the pool's replicas come from instead of `replicas:` (Kubernetes: the Ready pods of a
    /// GIE InferencePool or a label selector, kept up to date while running).
    discovery: Option<kvroute_discovery::RawPoolDiscovery>,
}

/// An adapter as written: its name, or `{name, id, path}` (what older/newer vLLM hash).
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
enum RawAdapter {
    Name(String),
    Full {
        name: String,
        #[serde(default)]
        id: Option<i64>,
        #[serde(default)]
        path: Option<String>,
    },
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawTokenizer {
    /// Directory with the model's `tokenizer.json` (tokenized in process).
    model_dir: Option<PathBuf>,
    /// A `/tokenize` endpoint URL.
    remote: Option<String>,
    /// The engine's render endpoint base URL (vLLM 0.32 `--enable-scale-out`).
    render: Option<String>,
    /// Timeout of one remote or render call.
    #[schemars(extend("default" = kvroute_config::format_duration(DEFAULT_REMOTE_TOKENIZE_TIMEOUT)))]
    timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
struct RawReplica {
    /// Replica id (unique; the index's replica id).
    id: Option<String>,
    /// Name of its pool.
    pool: Option<String>,
    /// The engine's `ip:port` (the routing decision's value).
    address: Option<String>,
    /// The engine's Prometheus `/metrics` URL (load scraping).
    metrics_url: Option<String>,
    /// The Envoy cluster of this replica, when each replica is its own cluster.
    envoy_cluster: Option<String>,
}

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
    /// Body mode assumed when Envoy sends no `protocol_config`.
    pub default_body_mode: BodyMode,
    /// Who gets the debug response headers.
    pub debug_headers: DebugHeaders,
    /// Longest time a routed request holds its in-flight slot without response headers.
    pub inflight_max_age: Duration,
    /// Most ext_proc streams open at once.
    pub max_streams: usize,
    /// Drift detection (`drift`).
    pub drift: DriftConfig,
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
        let invalid = |reason: String| ConfigError::EmbeddedIndex {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| invalid(e.to_string()))?;
        let config = crate::embedded::IndexConfig::from_yaml(&text)
            .map_err(|e| invalid(format!("{:#}", anyhow::Error::from(e))))?;
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

/// `debug_headers`, validated.
fn debug_headers(raw: &RawDebugHeaders) -> Result<DebugHeaders, ConfigError> {
    let expose = raw.expose.as_deref().unwrap_or(DEFAULT_DEBUG_EXPOSE);
    let token_only = |field: &str| {
        ConfigError::invalid(
            format!("debug_headers.{field}"),
            "…",
            "only used with `expose: token`",
        )
    };
    match expose {
        "never" | "always" => {
            if raw.token_file.is_some() {
                return Err(token_only("token_file"));
            }
            if raw.token_header.is_some() {
                return Err(token_only("token_header"));
            }
            Ok(if expose == "never" {
                DebugHeaders::Never
            } else {
                DebugHeaders::Always
            })
        }
        "token" => {
            let header = raw
                .token_header
                .as_deref()
                .unwrap_or(DEFAULT_DEBUG_TOKEN_HEADER)
                .to_ascii_lowercase();
            if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
                return Err(ConfigError::invalid(
                    "debug_headers.token_header",
                    &header,
                    "expected an HTTP header name",
                ));
            }
            let path = raw
                .token_file
                .as_deref()
                .ok_or_else(|| ConfigError::missing("debug_headers.token_file"))?;
            let token = AgentToken::load(&TokenSource::File(path.to_owned())).map_err(|e| {
                ConfigError::invalid(
                    "debug_headers.token_file",
                    path,
                    match e {
                        TokenError::Empty { .. } => "the file holds no token",
                        _ => "cannot read the file",
                    },
                )
            })?;
            Ok(DebugHeaders::Token { header, token })
        }
        other => Err(ConfigError::invalid(
            "debug_headers.expose",
            other,
            "expected never, always or token",
        )),
    }
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
            action: DriftAction::Warn,
        }
    }
}

/// `drift`, validated.
fn drift(raw: &RawDrift) -> Result<DriftConfig, ConfigError> {
    let share = |field: &str, value: f64| {
        if value.is_finite() && (0.0..=1.0).contains(&value) {
            Ok(value)
        } else {
            Err(ConfigError::invalid(
                format!("drift.{field}"),
                value,
                "expected a number in 0..=1",
            ))
        }
    };
    let bound = share("bound", raw.bound.unwrap_or(DEFAULT_DRIFT_BOUND))?;
    let clear_below = share("clear_below", raw.clear_below.unwrap_or(bound / 2.0))?;
    if clear_below > bound {
        return Err(ConfigError::invalid(
            "drift.clear_below",
            clear_below,
            "must not exceed drift.bound",
        ));
    }
    let window = duration("drift.window", raw.window.as_deref(), DEFAULT_DRIFT_WINDOW)?;
    if window.is_zero() {
        return Err(ConfigError::invalid(
            "drift.window",
            "0",
            "must be positive",
        ));
    }
    let action = match raw.action.as_deref().unwrap_or(DEFAULT_DRIFT_ACTION) {
        "warn" => DriftAction::Warn,
        "approximate" => DriftAction::Approximate,
        other => {
            return Err(ConfigError::invalid(
                "drift.action",
                other,
                "expected warn or approximate",
            ));
        }
    };
    Ok(DriftConfig {
        bound,
        clear_below,
        window,
        min_tokens: raw.min_tokens.unwrap_or(DEFAULT_DRIFT_MIN_TOKENS),
        action,
    })
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

/// How Envoy sends the request body to us.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// Served (base) model names.
    pub models: Vec<String>,
    /// LoRA adapters served by the pool.
    pub adapters: Vec<Adapter>,
    /// KV block size in tokens.
    pub block_size: u32,
    /// How block keys are computed (same code as the index).
    pub key_scheme: KeyScheme,
    /// Whether the index has this pool's events (precise tier possible).
    pub events: bool,
    /// Capacity of each replica's approximate prefix memory, in blocks: it keeps the most recently
    /// routed half to all of this many.
    pub approx_capacity_blocks: usize,
    /// Where tokens come from.
    pub tokenizer: TokenizerSource,
    /// Replicas discovered from Kubernetes (`discovery.kubernetes`) instead of `replicas:`.
    pub discovery: Option<kvroute_discovery::KubernetesSource>,
}

impl Pool {
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
    /// The engine's Prometheus endpoint.
    pub metrics_url: Option<http::Uri>,
    /// Envoy cluster for `cluster_header` routes.
    pub envoy_cluster: Option<String>,
}

impl Config {
    /// Parses and validates YAML text.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        Self::from_yaml_with(text, &Overrides::default())
    }

    /// Parses and validates YAML with command-line `overrides` applied first.
    pub fn from_yaml_with(text: &str, overrides: &Overrides) -> Result<Self, ConfigError> {
        let mut raw: RawConfig =
            serde_yaml::from_str(text).map_err(|source| ConfigError::Yaml { source })?;
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
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_yaml_with(&text, overrides)
    }

    /// The pool serving `model`, and the adapter when `model` is a LoRA adapter. An empty
    /// `model` (the request named none) is the default pool's base model, as vLLM serves it.
    pub fn pool_for_model(&self, model: &str) -> Option<(usize, Option<&Adapter>)> {
        if model.is_empty() {
            return self.default_pool.map(|pool| (pool, None));
        }
        self.pools.iter().enumerate().find_map(|(i, pool)| {
            if pool.models.iter().any(|m| m == model) {
                Some((i, None))
            } else {
                pool.adapters
                    .iter()
                    .find(|a| a.name == model)
                    .map(|a| (i, Some(a)))
            }
        })
    }
}

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(raw: RawConfig) -> Result<Self, Self::Error> {
        let grpc_addr = socket_addr("listen.grpc", raw.listen.grpc.as_deref(), DEFAULT_GRPC_ADDR)?;
        let admin_addr = socket_addr(
            "listen.admin",
            raw.listen.admin.as_deref(),
            DEFAULT_ADMIN_ADDR,
        )?;
        let health_addr = raw
            .listen
            .health
            .as_deref()
            .map(|addr| socket_addr("listen.health", Some(addr), addr))
            .transpose()?;
        let epp = epp(&raw.epp)?;
        let grpc_tls = raw
            .listen
            .tls
            .as_ref()
            .map(|tls| kvroute_runtime::tls::ServerTls::load(tls, "listen.tls"))
            .transpose()?;
        let index_addresses = raw
            .index
            .addresses
            .iter()
            .enumerate()
            .map(|(i, a)| index_uri(&format!("index.addresses[{i}]"), a, raw.index.tls.is_some()))
            .collect::<Result<Vec<_>, _>>()?;
        let index_tls = raw
            .index
            .tls
            .as_ref()
            .map(|tls| kvroute_runtime::tls::ClientTls::load(tls, "index.tls"))
            .transpose()?;
        let index_token = match raw.index.token_file.as_deref() {
            None => None,
            Some(_) if index_addresses.is_empty() => {
                return Err(ConfigError::invalid(
                    "index.token_file",
                    "…",
                    "only used with index.addresses (the embedded index needs no token)",
                ));
            }
            Some(path) => {
                let token = AgentToken::load(&TokenSource::File(path.to_owned())).map_err(|e| {
                    ConfigError::invalid(
                        "index.token_file",
                        path,
                        match e {
                            TokenError::Empty { .. } => "the file holds no token",
                            _ => "cannot read the file",
                        },
                    )
                })?;
                if !token.expose().bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(ConfigError::invalid(
                        "index.token_file",
                        path,
                        "the token must be printable ASCII without spaces",
                    ));
                }
                Some(token)
            }
        };
        let budgets = &raw.budgets;
        let decision_budget = duration(
            "budgets.decision",
            budgets.decision.as_deref(),
            DEFAULT_DECISION_BUDGET,
        )?;
        let tokenize_budget = duration(
            "budgets.tokenize",
            budgets.tokenize.as_deref(),
            DEFAULT_TOKENIZE_BUDGET,
        )?;
        let scoring = scoring(&raw.scoring)?;
        let pools = raw
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| pool(i, p))
            .collect::<Result<Vec<_>, _>>()?;
        let replicas = raw
            .replicas
            .iter()
            .enumerate()
            .map(|(i, r)| replica(i, r, &pools))
            .collect::<Result<Vec<_>, _>>()?;
        let default_pool = match raw.default_pool.as_deref() {
            Some(name) => Some(pools.iter().position(|p| p.name == name).ok_or_else(|| {
                ConfigError::invalid("default_pool", name, "no pool of that name")
            })?),
            None => (pools.len() == 1).then_some(0),
        };
        let config = Config {
            grpc_addr,
            admin_addr,
            health_addr,
            secure_serving: raw.listen.secure_serving.unwrap_or(false),
            epp,
            grpc_tls,
            index_addresses,
            embedded_index: raw
                .index
                .embedded
                .as_deref()
                .map(EmbeddedIndex::load)
                .transpose()?,
            index_tls,
            index_token,
            match_timeout: duration(
                "index.match_timeout",
                raw.index.match_timeout.as_deref(),
                DEFAULT_MATCH_TIMEOUT,
            )?,
            index_retry_after: duration(
                "index.retry_after",
                raw.index.retry_after.as_deref(),
                DEFAULT_INDEX_RETRY_AFTER,
            )?,
            decision_budget,
            tokenize_budget,
            drain_timeout: duration(
                "budgets.drain",
                budgets.drain.as_deref(),
                DEFAULT_DRAIN_TIMEOUT,
            )?,
            max_body_bytes: raw.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES),
            scrape: ScrapeConfig {
                interval: duration(
                    "scrape.interval",
                    raw.scrape.interval.as_deref(),
                    DEFAULT_SCRAPE_INTERVAL,
                )?,
                timeout: duration(
                    "scrape.timeout",
                    raw.scrape.timeout.as_deref(),
                    DEFAULT_SCRAPE_TIMEOUT,
                )?,
                unready_after_failures: raw
                    .scrape
                    .unready_after_failures
                    .unwrap_or(DEFAULT_UNREADY_AFTER_FAILURES),
            },
            scoring,
            token_cache_entries: raw
                .token_cache_entries
                .unwrap_or(DEFAULT_TOKEN_CACHE_ENTRIES),
            token_cache_bytes: raw.token_cache_bytes.unwrap_or(DEFAULT_TOKEN_CACHE_BYTES),
            tokenize_concurrency: raw
                .limits
                .tokenize_concurrency
                .unwrap_or_else(default_tokenize_concurrency),
            tokenize_max_prompt_bytes: raw
                .limits
                .tokenize_max_prompt_bytes
                .unwrap_or(DEFAULT_TOKENIZE_MAX_PROMPT_BYTES),
            reload_interval: duration(
                "reload_interval",
                raw.reload_interval.as_deref(),
                DEFAULT_RELOAD_INTERVAL,
            )?,
            default_body_mode: match raw.default_body_mode.as_deref() {
                None | Some("buffered") => BodyMode::Buffered,
                Some("full_duplex_streamed") => BodyMode::FullDuplexStreamed,
                Some(other) => {
                    return Err(ConfigError::invalid(
                        "default_body_mode",
                        other,
                        "expected buffered or full_duplex_streamed",
                    ));
                }
            },
            debug_headers: debug_headers(&raw.debug_headers)?,
            inflight_max_age: duration(
                "limits.inflight_max_age",
                raw.limits.inflight_max_age.as_deref(),
                DEFAULT_INFLIGHT_MAX_AGE,
            )?,
            max_streams: raw.limits.max_streams.unwrap_or(DEFAULT_MAX_STREAMS),
            drift: drift(&raw.drift)?,
            default_pool,
            pools,
            replicas,
        };
        validate(&config)?;
        Ok(config)
    }
}

/// Cross-field rules, all in one place.
fn validate(config: &Config) -> Result<(), ConfigError> {
    if config.pools.is_empty() {
        return Err(ConfigError::missing("pools"));
    }
    let discovered = |pool: usize| config.pools[pool].discovery.is_some();
    if config.replicas.is_empty() && !(0..config.pools.len()).any(discovered) {
        return Err(ConfigError::missing("replicas"));
    }
    if let Some((i, replica)) = config
        .replicas
        .iter()
        .enumerate()
        .find(|(_, r)| discovered(r.pool))
    {
        return Err(ConfigError::invalid(
            format!("replicas[{i}].pool"),
            &config.pools[replica.pool].name,
            "this pool discovers its replicas (pools[].discovery); a static replica cannot join it",
        ));
    }
    if config.tokenize_budget > config.decision_budget {
        return Err(ConfigError::invalid(
            "budgets.tokenize",
            format!("{:?}", config.tokenize_budget),
            "must not exceed budgets.decision",
        ));
    }
    if config.decision_budget.is_zero() {
        return Err(ConfigError::invalid(
            "budgets.decision",
            "0",
            "must be positive",
        ));
    }
    if config.max_body_bytes == 0 {
        return Err(ConfigError::invalid(
            "max_body_bytes",
            0,
            "must be positive",
        ));
    }
    if config.inflight_max_age.is_zero() {
        return Err(ConfigError::invalid(
            "limits.inflight_max_age",
            "0",
            "must be positive",
        ));
    }
    if config.tokenize_concurrency == 0 {
        return Err(ConfigError::invalid(
            "limits.tokenize_concurrency",
            0,
            "must be positive",
        ));
    }
    if config.max_streams == 0 {
        return Err(ConfigError::invalid(
            "limits.max_streams",
            0,
            "must be positive",
        ));
    }
    if config.scrape.interval.is_zero() {
        return Err(ConfigError::invalid(
            "scrape.interval",
            "0",
            "must be positive",
        ));
    }
    if config.grpc_addr == config.admin_addr && config.grpc_addr.port() != 0 {
        return Err(ConfigError::invalid(
            "listen.admin",
            config.admin_addr,
            "must differ from listen.grpc",
        ));
    }
    if let Some(health) = config.health_addr
        && health.port() != 0
        && (health == config.grpc_addr || health == config.admin_addr)
    {
        return Err(ConfigError::invalid(
            "listen.health",
            health,
            "must differ from listen.grpc and listen.admin",
        ));
    }
    let mut names = HashMap::new();
    for (i, pool) in config.pools.iter().enumerate() {
        if names.insert(pool.name.as_str(), i).is_some() {
            return Err(ConfigError::invalid(
                format!("pools[{i}].name"),
                &pool.name,
                "duplicate",
            ));
        }
    }
    let mut served = HashSet::new();
    for (i, pool) in config.pools.iter().enumerate() {
        for name in pool
            .models
            .iter()
            .chain(pool.adapters.iter().map(|a| &a.name))
        {
            if !served.insert(name.as_str()) {
                return Err(ConfigError::invalid(
                    format!("pools[{i}].models"),
                    name,
                    "model or adapter name served by two pools",
                ));
            }
        }
    }
    let mut ids = HashSet::new();
    let mut addresses = HashSet::new();
    for (i, replica) in config.replicas.iter().enumerate() {
        if !ids.insert(replica.id.as_str()) {
            return Err(ConfigError::invalid(
                format!("replicas[{i}].id"),
                &replica.id,
                "duplicate",
            ));
        }
        if !addresses.insert(replica.address) {
            return Err(ConfigError::invalid(
                format!("replicas[{i}].address"),
                replica.address,
                "duplicate",
            ));
        }
    }
    Ok(())
}

fn scoring(raw: &RawScoring) -> Result<ScoringConfig, ConfigError> {
    let non_negative = |field: &str, value: Option<f64>, default: f64| {
        let v = value.unwrap_or(default);
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(ConfigError::invalid(
                format!("scoring.{field}"),
                v,
                "must be a finite number >= 0",
            ))
        }
    };
    let hotspot_factor =
        non_negative("hotspot_factor", raw.hotspot_factor, DEFAULT_HOTSPOT_FACTOR)?;
    if hotspot_factor < 1.0 {
        return Err(ConfigError::invalid(
            "scoring.hotspot_factor",
            hotspot_factor,
            "must be >= 1",
        ));
    }
    Ok(ScoringConfig {
        prefill_ms_per_token: non_negative(
            "prefill_ms_per_token",
            raw.prefill_ms_per_token,
            DEFAULT_PREFILL_MS_PER_TOKEN,
        )?,
        queue_ms_per_request: non_negative(
            "queue_ms_per_request",
            raw.queue_ms_per_request,
            DEFAULT_QUEUE_MS_PER_REQUEST,
        )?,
        running_ms_per_request: non_negative(
            "running_ms_per_request",
            raw.running_ms_per_request,
            DEFAULT_RUNNING_MS_PER_REQUEST,
        )?,
        kv_usage_ms: non_negative("kv_usage_ms", raw.kv_usage_ms, DEFAULT_KV_USAGE_MS)?,
        hotspot_factor,
        hotspot_min_ms: non_negative("hotspot_min_ms", raw.hotspot_min_ms, DEFAULT_HOTSPOT_MIN_MS)?,
        recompute_penalty: non_negative(
            "recompute_penalty",
            raw.recompute_penalty,
            DEFAULT_RECOMPUTE_PENALTY,
        )?,
        speculative_ttl: duration(
            "scoring.speculative_ttl",
            raw.speculative_ttl.as_deref(),
            DEFAULT_SPECULATIVE_TTL,
        )?,
    })
}

fn pool(i: usize, raw: &RawPool) -> Result<Pool, ConfigError> {
    let field = |name: &str| format!("pools[{i}].{name}");
    let name = raw
        .name
        .clone()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ConfigError::missing(field("name")))?;
    if raw.models.is_empty() {
        return Err(ConfigError::missing(field("models")));
    }
    if raw.models.iter().any(String::is_empty) {
        return Err(ConfigError::invalid(
            field("models"),
            "",
            "empty model name",
        ));
    }
    let adapters = raw
        .adapters
        .iter()
        .map(|a| match a {
            RawAdapter::Name(name) => Adapter {
                name: name.clone(),
                id: None,
                path: None,
            },
            RawAdapter::Full { name, id, path } => Adapter {
                name: name.clone(),
                id: *id,
                path: path.clone(),
            },
        })
        .collect::<Vec<_>>();
    if adapters.iter().any(|a| a.name.is_empty()) {
        return Err(ConfigError::invalid(
            field("adapters"),
            "",
            "empty adapter name",
        ));
    }
    let PoolKeySettings {
        block_size,
        scheme: key_scheme,
    } = PoolKeySettings::from_raw(raw.block_size, &raw.key_scheme)
        .map_err(|e| ConfigError::invalid(field(e.field), e.value, e.reason))?;
    if let KeyScheme::VllmExact { era, .. } = &key_scheme {
        // Check the adapters carry what this era hashes, at startup rather than per request.
        for (j, adapter) in adapters.iter().enumerate() {
            era.block_extra_keys(Some(&adapter.as_lora_ref()), None, 0).map_err(|_| {
                ConfigError::invalid(
                    format!("pools[{i}].adapters[{j}]"),
                    &adapter.name,
                    "this vLLM version hashes the adapter's id (<=0.11.0) or path (>=0.31): add it",
                )
            })?;
        }
    }
    let tokenizer = match &raw.tokenizer {
        None => TokenizerSource::None,
        Some(RawTokenizer {
            model_dir: Some(dir),
            remote: None,
            render: None,
            timeout: None,
        }) => TokenizerSource::ModelDir(dir.clone()),
        Some(RawTokenizer {
            model_dir: None,
            remote: None,
            render: Some(url),
            timeout,
        }) => TokenizerSource::Render {
            url: http_uri(&field("tokenizer.render"), url)?,
            timeout: duration(
                &field("tokenizer.timeout"),
                timeout.as_deref(),
                DEFAULT_REMOTE_TOKENIZE_TIMEOUT,
            )?,
        },
        Some(RawTokenizer {
            model_dir: None,
            remote: Some(url),
            render: None,
            timeout,
        }) => TokenizerSource::Remote {
            url: http_uri(&field("tokenizer.remote"), url)?,
            timeout: duration(
                &field("tokenizer.timeout"),
                timeout.as_deref(),
                DEFAULT_REMOTE_TOKENIZE_TIMEOUT,
            )?,
        },
        Some(_) => {
            return Err(ConfigError::invalid(
                field("tokenizer"),
                "…",
                "expected exactly one of model_dir, remote or render (timeout only with remote or render)",
            ));
        }
    };
    let approx_capacity_blocks = raw
        .approx_capacity_blocks
        .unwrap_or(DEFAULT_APPROX_CAPACITY_BLOCKS);
    if approx_capacity_blocks == 0 {
        return Err(ConfigError::invalid(
            field("approx_capacity_blocks"),
            0,
            "must be positive",
        ));
    }
    let discovery = match &raw.discovery {
        None => None,
        Some(kvroute_discovery::RawPoolDiscovery { kubernetes: None }) => {
            return Err(ConfigError::missing(field("discovery.kubernetes")));
        }
        Some(kvroute_discovery::RawPoolDiscovery {
            kubernetes: Some(kubernetes),
        }) => Some(
            kvroute_discovery::KubernetesSource::try_from(kubernetes.clone()).map_err(|e| {
                ConfigError::invalid(
                    field(&format!("discovery.kubernetes.{}", e.path())),
                    "",
                    e.reason(),
                )
            })?,
        ),
    };
    Ok(Pool {
        name,
        models: raw.models.clone(),
        adapters,
        block_size,
        key_scheme,
        events: raw.events.unwrap_or(true),
        approx_capacity_blocks,
        tokenizer,
        discovery,
    })
}

fn replica(i: usize, raw: &RawReplica, pools: &[Pool]) -> Result<Replica, ConfigError> {
    let field = |name: &str| format!("replicas[{i}].{name}");
    let id = raw
        .id
        .clone()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| ConfigError::missing(field("id")))?;
    let pool_name = raw
        .pool
        .as_deref()
        .ok_or_else(|| ConfigError::missing(field("pool")))?;
    let pool = pools
        .iter()
        .position(|p| p.name == pool_name)
        .ok_or_else(|| ConfigError::invalid(field("pool"), pool_name, "no pool with this name"))?;
    let address = raw
        .address
        .as_deref()
        .ok_or_else(|| ConfigError::missing(field("address")))?;
    let address = address
        .parse::<SocketAddr>()
        .map_err(|_| ConfigError::invalid(field("address"), address, "expected ip:port"))?;
    let metrics_url = raw
        .metrics_url
        .as_deref()
        .map(|u| http_uri(&field("metrics_url"), u))
        .transpose()?;
    if let Some(cluster) = raw
        .envoy_cluster
        .as_deref()
        .filter(|c| c.is_empty() || c.contains(char::is_whitespace))
    {
        return Err(ConfigError::invalid(
            field("envoy_cluster"),
            cluster,
            "expected a cluster name",
        ));
    }
    Ok(Replica {
        id,
        pool,
        address,
        metrics_url,
        envoy_cluster: raw.envoy_cluster.clone(),
    })
}

fn epp(raw: &RawEpp) -> Result<EppConfig, ConfigError> {
    let shedding = raw
        .shedding
        .as_ref()
        .map(|shed| {
            let queue_depth = shed.queue_depth.unwrap_or(DEFAULT_SHED_QUEUE_DEPTH);
            if !(queue_depth.is_finite() && queue_depth >= 1.0) {
                return Err(ConfigError::invalid(
                    "epp.shedding.queue_depth",
                    queue_depth,
                    "must be at least 1",
                ));
            }
            let kv_cache_usage = shed.kv_cache_usage.unwrap_or(DEFAULT_SHED_KV_CACHE_USAGE);
            if !(kv_cache_usage > 0.0 && kv_cache_usage <= 1.0) {
                return Err(ConfigError::invalid(
                    "epp.shedding.kv_cache_usage",
                    kv_cache_usage,
                    "must be in (0, 1]",
                ));
            }
            Ok(Shedding {
                queue_depth,
                kv_cache_usage,
            })
        })
        .transpose()?;
    Ok(EppConfig {
        fallbacks: raw.fallbacks.unwrap_or(DEFAULT_EPP_FALLBACKS),
        shedding,
    })
}

fn socket_addr(field: &str, value: Option<&str>, default: &str) -> Result<SocketAddr, ConfigError> {
    let value = value.unwrap_or(default);
    value
        .parse()
        .map_err(|_| ConfigError::invalid(field, value, "expected ip:port"))
}

fn http_uri(field: &str, value: &str) -> Result<http::Uri, ConfigError> {
    let uri: http::Uri = value
        .parse()
        .map_err(|_| ConfigError::invalid(field, value, "expected an http:// URL"))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(ConfigError::invalid(
            field,
            value,
            "expected an http:// URL",
        ));
    }
    Ok(uri)
}

/// An index address: `http://` plaintext, or `https://` when `index.tls` is set.
fn index_uri(field: &str, value: &str, tls: bool) -> Result<http::Uri, ConfigError> {
    let uri: http::Uri = value
        .parse()
        .map_err(|_| ConfigError::invalid(field, value, "expected an http(s):// URL"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err(ConfigError::invalid(
            field,
            value,
            "expected an http(s):// URL",
        ));
    }
    kvroute_runtime::tls::check_scheme(value, tls)
        .map_err(|reason| ConfigError::invalid(field, value, reason))?;
    Ok(uri)
}

/// An optional duration key (`250ms`, `2s`, `1m`: [`kvroute_config::parse_duration`],
/// the one parser of every kvroute config), or `default` when absent.
fn duration(field: &str, value: Option<&str>, default: Duration) -> Result<Duration, ConfigError> {
    value.map_or(Ok(default), |text| {
        parse_duration(text).map_err(|e| ConfigError::invalid(field, text, e.to_string()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
pools:
- name: p
  models: [m]
  adapters: [{name: lora-a, path: /adapters/lora-a}]
  block_size: 16
  key_scheme: {kind: vllm-exact, hash_algo: sha256_cbor, seed: "0"}
replicas:
- {id: r0, pool: p, address: "127.0.0.1:8000"}
"#;

    fn error_of(yaml: &str) -> String {
        match Config::from_yaml(yaml) {
            Ok(_) => panic!("config should be rejected:\n{yaml}"),
            Err(e) => format!("{:#}", anyhow::Error::from(e)),
        }
    }

    #[test]
    fn a_request_naming_no_model_goes_to_the_default_pool() {
        let one = Config::from_yaml(MINIMAL).unwrap();
        assert_eq!(one.pool_for_model("").map(|(pool, _)| pool), Some(0));
        let two = MINIMAL.replace(
            "replicas:\n",
            "- {name: q, models: [other], block_size: 16, key_scheme: {kind: token-chain}}\nreplicas:\n",
        );
        assert_eq!(Config::from_yaml(&two).unwrap().pool_for_model(""), None);
        let chosen = Config::from_yaml(&format!("{two}default_pool: q\n")).unwrap();
        assert_eq!(chosen.pool_for_model("").map(|(pool, _)| pool), Some(1));
        assert_eq!(chosen.pool_for_model("m").map(|(pool, _)| pool), Some(0));
        assert!(error_of(&format!("{two}default_pool: nope\n")).contains("default_pool"));
    }

    #[test]
    fn tokenizer_sources() {
        let with = |tokenizer: &str| {
            MINIMAL.replace(
                "  block_size: 16\n",
                &format!("  block_size: 16\n  tokenizer: {tokenizer}\n"),
            )
        };
        let render =
            Config::from_yaml(&with(r#"{render: "http://10.0.0.5:8000", timeout: 40ms}"#)).unwrap();
        assert_eq!(
            render.pools[0].tokenizer,
            TokenizerSource::Render {
                url: "http://10.0.0.5:8000".parse().unwrap(),
                timeout: Duration::from_millis(40),
            }
        );
        let remote =
            Config::from_yaml(&with(r#"{remote: "http://10.0.0.5:8000/tokenize"}"#)).unwrap();
        assert!(matches!(
            remote.pools[0].tokenizer,
            TokenizerSource::Remote { timeout, .. } if timeout == DEFAULT_REMOTE_TOKENIZE_TIMEOUT
        ));
        for bad in [
            r#"{render: "http://a:1", remote: "http://a:1/tokenize"}"#,
            r#"{render: "http://a:1", model_dir: /m}"#,
            r#"{model_dir: /m, timeout: 5ms}"#,
        ] {
            assert!(error_of(&with(bad)).contains("pools[0].tokenizer"), "{bad}");
        }
        assert!(error_of(&with(r#"{render: "not a url"}"#)).contains("pools[0].tokenizer.render"));
    }

    #[test]
    fn epp_defaults_overrides_and_bad_values() {
        let config = Config::from_yaml(MINIMAL).unwrap();
        assert_eq!(config.epp.fallbacks, DEFAULT_EPP_FALLBACKS);
        assert_eq!(config.epp.shedding, None);
        assert_eq!(config.admin_addr, DEFAULT_ADMIN_ADDR.parse().unwrap());
        assert_eq!((config.health_addr, config.secure_serving), (None, false));

        let shedding = format!("{MINIMAL}epp: {{fallbacks: 0, shedding: {{queue_depth: 3}}}}\n");
        let config = Config::from_yaml(&shedding).unwrap();
        assert_eq!(config.epp.fallbacks, 0);
        assert_eq!(
            config.epp.shedding,
            Some(Shedding {
                queue_depth: 3.0,
                kv_cache_usage: DEFAULT_SHED_KV_CACHE_USAGE
            })
        );
        for (bad, field) in [
            (
                "epp: {shedding: {queue_depth: 0}}",
                "epp.shedding.queue_depth",
            ),
            (
                "epp: {shedding: {kv_cache_usage: 1.5}}",
                "epp.shedding.kv_cache_usage",
            ),
            ("listen: {health: \"127.0.0.1:9090\"}", "listen.health"),
            ("listen: {health: nowhere}", "listen.health"),
        ] {
            let error = Config::from_yaml(&format!("{MINIMAL}{bad}\n")).unwrap_err();
            assert!(error.to_string().contains(field), "{bad}: {error}");
        }

        // The chart flags win over the file, on all interfaces.
        let dir = tempfile::tempdir().unwrap();
        let overrides = Overrides {
            grpc_port: Some(9002),
            health_port: Some(9003),
            metrics_port: Some(9090),
            secure_serving: Some(true),
            cert_dir: None,
        };
        let file = format!("{MINIMAL}listen: {{grpc: \"127.0.0.1:1\", secure_serving: false}}\n");
        let config = Config::from_yaml_with(&file, &overrides).unwrap();
        assert_eq!(config.grpc_addr, "0.0.0.0:9002".parse().unwrap());
        assert_eq!(config.health_addr, Some("0.0.0.0:9003".parse().unwrap()));
        assert_eq!(config.admin_addr, "0.0.0.0:9090".parse().unwrap());
        assert!(config.secure_serving);
        // `--cert-path` names a TLS Secret's directory: its files must be there.
        let with_certs = Overrides {
            cert_dir: Some(dir.path().to_path_buf()),
            ..Overrides::default()
        };
        let error = Config::from_yaml_with(MINIMAL, &with_certs).unwrap_err();
        assert!(error.to_string().contains("listen.tls.cert"), "{error}");
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let config = Config::from_yaml(MINIMAL).unwrap();
        assert_eq!(config.decision_budget, DEFAULT_DECISION_BUDGET);
        assert_eq!(config.token_cache_bytes, DEFAULT_TOKEN_CACHE_BYTES);
        assert_eq!(
            config.tokenize_max_prompt_bytes,
            DEFAULT_TOKENIZE_MAX_PROMPT_BYTES
        );
        assert!(config.tokenize_concurrency >= 1);
        assert_eq!(config.grpc_addr, DEFAULT_GRPC_ADDR.parse().unwrap());
        assert!(config.grpc_addr.ip().is_loopback() && config.admin_addr.ip().is_loopback());
        assert_eq!(config.pools[0].tokenizer, TokenizerSource::None);
        assert_eq!(
            config
                .pool_for_model("lora-a")
                .map(|(p, a)| (p, a.map(|a| a.name.as_str()))),
            Some((0, Some("lora-a")))
        );
        assert_eq!(config.pool_for_model("m"), Some((0, None)));
        assert_eq!(config.pool_for_model("x"), None);
        assert_eq!(config.scoring, ScoringConfig::default());
    }

    #[test]
    fn scoring_weights_are_read_and_checked() {
        let yaml = format!("{MINIMAL}scoring: {{recompute_penalty: 0.5, hotspot_factor: 3}}\n");
        let config = Config::from_yaml(&yaml).unwrap();
        assert_eq!(config.scoring.recompute_penalty, 0.5);
        assert_eq!(config.scoring.hotspot_factor, 3.0);
        let negative = format!("{MINIMAL}scoring: {{recompute_penalty: -1}}\n");
        assert!(error_of(&negative).contains("scoring.recompute_penalty"));
        let low_factor = format!("{MINIMAL}scoring: {{hotspot_factor: 0.5}}\n");
        assert!(error_of(&low_factor).contains("scoring.hotspot_factor"));
    }

    #[test]
    fn errors_name_the_field() {
        let bad_address = MINIMAL.replace("127.0.0.1:8000", "nowhere");
        assert!(
            error_of(&bad_address).contains("replicas[0].address"),
            "{}",
            error_of(&bad_address)
        );
        let bad_block = MINIMAL.replace("block_size: 16", "block_size: 0");
        assert!(error_of(&bad_block).contains("pools[0].block_size"));
        let bad_pool = MINIMAL.replace("pool: p,", "pool: q,");
        assert!(error_of(&bad_pool).contains("replicas[0].pool"));
        let unknown_key = format!("{MINIMAL}bogus: 1\n");
        assert!(error_of(&unknown_key).contains("bogus"));
        let bad_budget = format!("{MINIMAL}budgets: {{decision: 10ms, tokenize: 20ms}}\n");
        assert!(error_of(&bad_budget).contains("budgets.tokenize"));
        let token_without_addresses = format!("{MINIMAL}index: {{token_file: /x}}\n");
        assert!(error_of(&token_without_addresses).contains("index.token_file"));
        let missing_token = format!(
            "{MINIMAL}index: {{addresses: [\"http://127.0.0.1:1\"], token_file: /nonexistent/t}}\n"
        );
        assert!(error_of(&missing_token).contains("index.token_file"));
        let bad_age = format!("{MINIMAL}limits: {{inflight_max_age: 0s}}\n");
        assert!(error_of(&bad_age).contains("limits.inflight_max_age"));
        let no_streams = format!("{MINIMAL}limits: {{max_streams: 0}}\n");
        assert!(error_of(&no_streams).contains("limits.max_streams"));
        let no_slots = format!("{MINIMAL}limits: {{tokenize_concurrency: 0}}\n");
        assert!(error_of(&no_slots).contains("limits.tokenize_concurrency"));
        let bad_duration = format!("{MINIMAL}index: {{match_timeout: soon}}\n");
        assert!(error_of(&bad_duration).contains("index.match_timeout"));
        let no_seed = MINIMAL.replace("sha256_cbor, seed: \"0\"", "xxhash");
        assert!(
            error_of(&no_seed).contains("pools[0].key_scheme.seed"),
            "{}",
            error_of(&no_seed)
        );
        let dup = format!("{MINIMAL}- {{id: r0, pool: p, address: \"127.0.0.1:8001\"}}\n");
        assert!(error_of(&dup).contains("replicas[1].id"));
    }

    #[test]
    fn drift_defaults_and_validation() {
        assert_eq!(
            Config::from_yaml(MINIMAL).unwrap().drift,
            DriftConfig::default()
        );
        let set = format!(
            "{MINIMAL}drift: {{bound: 0.4, window: 30s, min_tokens: 512, action: approximate}}\n"
        );
        assert_eq!(
            Config::from_yaml(&set).unwrap().drift,
            DriftConfig {
                bound: 0.4,
                clear_below: 0.2,
                window: Duration::from_secs(30),
                min_tokens: 512,
                action: DriftAction::Approximate,
            }
        );
        for (bad, field) in [
            ("{bound: 1.5}", "drift.bound"),
            ("{bound: .nan}", "drift.bound"),
            ("{bound: 0.3, clear_below: 0.4}", "drift.clear_below"),
            ("{window: 0s}", "drift.window"),
            ("{action: degrade}", "drift.action"),
            ("{bogus: 1}", "bogus"),
        ] {
            let error = error_of(&format!("{MINIMAL}drift: {bad}\n"));
            assert!(error.contains(field), "{bad}: {error}");
        }
    }

    #[test]
    fn debug_headers_are_off_unless_configured() {
        assert_eq!(
            Config::from_yaml(MINIMAL).unwrap().debug_headers,
            DebugHeaders::Never
        );
        let always = format!("{MINIMAL}debug_headers: {{expose: always}}\n");
        assert_eq!(
            Config::from_yaml(&always).unwrap().debug_headers,
            DebugHeaders::Always
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "s3cret\n").unwrap();
        let token = format!(
            "{MINIMAL}debug_headers: {{expose: token, token_header: X-Debug, token_file: \"{}\"}}\n",
            file.display()
        );
        match Config::from_yaml(&token).unwrap().debug_headers {
            DebugHeaders::Token { header, token } => {
                assert_eq!(header, "x-debug");
                assert!(token.matches("s3cret") && !token.matches("s3cre"));
                assert!(!format!("{token:?}").contains("s3cret"));
            }
            other => panic!("{other:?}"),
        }
        for (yaml, field) in [
            ("{expose: sometimes}", "debug_headers.expose"),
            ("{expose: token}", "debug_headers.token_file"),
            (
                "{expose: token, token_file: /nonexistent/token}",
                "debug_headers.token_file",
            ),
            (
                "{expose: always, token_file: /x}",
                "debug_headers.token_file",
            ),
            (
                "{expose: token, token_header: \"a b\", token_file: /x}",
                "debug_headers.token_header",
            ),
            ("{expose: token, bogus: 1}", "bogus"),
        ] {
            let error = error_of(&format!("{MINIMAL}debug_headers: {yaml}\n"));
            assert!(error.contains(field), "{yaml}: {error}");
        }
    }

    #[test]
    fn durations_parse() {
        assert_eq!(
            duration("f", Some("250ms"), Duration::ZERO).unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(
            duration("f", Some("1.5s"), Duration::ZERO).unwrap(),
            Duration::from_millis(1500)
        );
        assert!(duration("f", Some("-1s"), Duration::ZERO).is_err());
        assert!(duration("f", Some("5"), Duration::ZERO).is_err());
    }

    /// The pool schema is one: the same `pools:` block in ext-proc's and in kvroute-index's
    /// config gives the same block size and keys, defaults included.
    #[cfg(feature = "embedded-index")]
    #[test]
    fn one_pool_block_means_the_same_in_ext_proc_and_the_index() {
        for pool in [
            "- {name: p, models: [m]}",
            "- {name: p, models: [m], block_size: 32, key_scheme: {kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\", vllm_version: 0.11.1}}",
            "- {name: p, models: [m], key_scheme: {hash_algo: xxhash, seed: \"7\"}}",
            "- {name: p, models: [m], block_size: 64, key_scheme: {kind: token-chain}}",
        ] {
            let ext_proc = Config::from_yaml(&format!(
                "pools:\n{pool}\nreplicas:\n- {{id: r0, pool: p, address: \"127.0.0.1:8000\"}}\n"
            ))
            .unwrap();
            let index = kvroute_index::config::Config::from_yaml(&format!(
                "pools:\n{pool}\nreplicas:\n- {{id: r0, pool: p, events: {{endpoint: \"tcp://127.0.0.1:5557\"}}}}\n"
            ))
            .unwrap();
            let (ours, theirs) = (&ext_proc.pools[0], &index.pools[0]);
            assert_eq!(ours.name, theirs.name, "{pool}");
            assert_eq!(ours.models, theirs.models, "{pool}");
            assert_eq!(ours.block_size, theirs.block_size, "{pool}");
            assert_eq!(ours.key_scheme, theirs.key_scheme, "{pool}");
            // And the keys themselves agree.
            let tokens: Vec<u32> = (0..200).collect();
            assert_eq!(
                ours.prompt_keys(&tokens, None, None).unwrap(),
                theirs
                    .key_scheme
                    .prompt_keys(&tokens, theirs.block_size as usize, None, None)
                    .unwrap(),
                "{pool}"
            );
        }
        // The defaults are vLLM 0.32's: sha256, PYTHONHASHSEED unset, 0.32's extra keys, 16.
        let defaults = Config::from_yaml(
            "pools:\n- {name: p, models: [m]}\nreplicas:\n- {id: r0, pool: p, address: \"127.0.0.1:8000\"}\n",
        )
        .unwrap();
        let explicit = Config::from_yaml(
            "pools:\n- {name: p, models: [m], block_size: 16, key_scheme: {kind: vllm-exact, hash_algo: sha256, vllm_version: 0.32.0}}\nreplicas:\n- {id: r0, pool: p, address: \"127.0.0.1:8000\"}\n",
        )
        .unwrap();
        assert_eq!(defaults.pools[0].key_scheme, explicit.pools[0].key_scheme);
        assert_eq!(defaults.pools[0].block_size, 16);
    }

    #[test]
    fn ext_proc_durations_use_the_shared_parser() {
        for text in ["250ms", "1.5s", "500us", "1m", "5", "-1s", "1h"] {
            assert_eq!(
                duration("f", Some(text), Duration::ZERO).ok(),
                parse_duration(text).ok(),
                "{text}"
            );
        }
    }

    #[cfg(feature = "embedded-index")]
    #[test]
    fn embedded_index_is_loaded_and_validated_with_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let with = |path: &std::path::Path| {
            format!("{MINIMAL}index: {{embedded: \"{}\"}}\n", path.display())
        };
        let missing = dir.path().join("absent.yaml");
        let error = error_of(&with(&missing));
        assert!(
            error.contains("index.embedded") && error.contains("absent.yaml"),
            "{error}"
        );

        let invalid = dir.path().join("invalid.yaml");
        std::fs::write(&invalid, "listen: {grpc: \"nowhere\"}\n").unwrap();
        let error = error_of(&with(&invalid));
        assert!(
            error.contains("index.embedded") && error.contains("listen.grpc"),
            "{error}"
        );

        let valid = dir.path().join("index.yaml");
        std::fs::write(
            &valid,
            "listen: {grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}\n\
             pools:\n  - {name: p, models: [m], block_size: 16, key_scheme: {kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}}\n\
             replicas:\n  - {id: r0, pool: p, events: {endpoint: \"tcp://127.0.0.1:5557\"}}\n",
        )
        .unwrap();
        let config = Config::from_yaml(&with(&valid)).unwrap();
        let embedded = config.embedded_index.as_ref().unwrap();
        assert_eq!(embedded.path, valid);
        assert_eq!(embedded.config.replicas.len(), 1);
        assert!(config.index_addresses.is_empty());
    }
}
