//! The YAML document's shape: serde structs (unknown keys rejected) whose `///` docs are the
//! configuration reference, every default a named const beside its key. Leaf values (durations,
//! addresses) validate while deserializing, so their errors carry the field path; `build` checks
//! the rest and turns this into a [`super::Config`].

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use kvroute_block_keys::{DEFAULT_BLOCK_SIZE, RawKeyScheme};
use kvroute_config::{ConfigDuration, ListenAddr, RawClientTls, RawServerTls, format_duration};
use kvroute_routing::load::DEFAULT_SCRAPE_INTERVAL;
use kvroute_routing::scoring::{
    DEFAULT_HOTSPOT_FACTOR, DEFAULT_HOTSPOT_MIN_MS, DEFAULT_IDLE_POOL_MS, DEFAULT_KV_USAGE_MS,
    DEFAULT_OVERLOAD_IMBALANCE, DEFAULT_OVERLOAD_QUEUE_MS, DEFAULT_PREFILL_MS_PER_TOKEN,
    DEFAULT_QUEUE_MS_PER_REQUEST, DEFAULT_RECOMPUTE_PENALTY, DEFAULT_RUNNING_MS_PER_REQUEST,
    DEFAULT_SPECULATIVE_TTL,
};

use super::{BodyMode, DisaggregationMode, DriftAction, Engine, PoolMode, Role};

/// Default request body limit (Envoy's default BUFFERED limit is 1 MiB; FULL_DUPLEX passes more).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Default number of cached tokenizations (whole prompts / conversation prefixes).
pub const DEFAULT_TOKEN_CACHE_ENTRIES: usize = 4096;
/// Default bytes the token cache may account for (`token_cache_bytes`): 256 MiB ≈ 64M tokens.
pub const DEFAULT_TOKEN_CACHE_BYTES: usize = 256 * 1024 * 1024;
/// Default interval at which the config file's mtime is checked for reloads.
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(2);
/// Default body mode when Envoy sends no `protocol_config` (`default_body_mode`): what Envoy's
/// ext_proc filter defaults to.
pub const DEFAULT_BODY_MODE: BodyMode = BodyMode::Buffered;
/// Default `pools[].disaggregation.min_prompt_tokens`: llm-d's documented example; below a
/// thousand tokens a prefill is a few milliseconds, less than the KV transfer it would need.
pub const DEFAULT_DISAGGREGATION_MIN_PROMPT_TOKENS: usize =
    kvroute_routing::split::DEFAULT_MIN_PROMPT_TOKENS;
/// Default `pools[].disaggregation.prefill_timeout`: a long prompt's prefill, queueing included,
/// on a loaded replica; Envoy's ext_proc `message_timeout` in the shipped configs (60 s) is
/// longer, so ext-proc's own fallback answers before Envoy stops waiting.
pub const DEFAULT_PREFILL_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `pools[].disaggregation.prefill_retries` (llm-d's sidecar retries transient answers
/// too).
pub const DEFAULT_PREFILL_RETRIES: u32 = 2;
/// Default `pools[].disaggregation.max_concurrent_prefills`.
pub const DEFAULT_MAX_CONCURRENT_PREFILLS: usize = 256;
/// Default `pools[].disaggregation.max_prefill_queue` (measured in kvroute-replay).
pub const DEFAULT_MAX_PREFILL_QUEUE: Duration = kvroute_routing::split::DEFAULT_MAX_PREFILL_QUEUE;
/// Default `pools[].disaggregation.min_uncached_tokens`: llm-d's documented example (half the
/// prompt floor): a mostly cached prompt is cheaper to finish on its decode replica.
pub const DEFAULT_DISAGGREGATION_MIN_UNCACHED_TOKENS: usize =
    kvroute_routing::split::DEFAULT_MIN_UNCACHED_TOKENS;

/// The YAML document as written. Unknown keys are errors.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    /// ext-proc's own ports: ext_proc gRPC, admin HTTP, an optional plaintext health port, TLS.
    pub(super) listen: RawListen,
    /// The kvroute-index asked which replica holds a prompt's blocks: its addresses, or one run
    /// inside this process. Without either, decisions use the approximate and load tiers.
    pub(super) index: RawIndex,
    /// Time budgets of a routing decision and of shutdown.
    pub(super) budgets: RawBudgets,
    /// Largest request body accepted, in bytes (8 MiB); a larger one is refused with 413.
    /// Envoy's default BUFFERED limit is 1 MiB; FULL_DUPLEX_STREAMED passes more.
    #[schemars(extend("default" = DEFAULT_MAX_BODY_BYTES))]
    pub(super) max_body_bytes: Option<usize>,
    /// Reading each replica's `/metrics` (queue depth, running requests, KV-cache usage).
    pub(super) scrape: RawScrape,
    /// Weights of the routing score, in milliseconds of expected delay.
    pub(super) scoring: RawScoring,
    /// Most cached tokenizations (whole prompts and conversation prefixes). Read at
    /// start.
    #[schemars(extend("default" = DEFAULT_TOKEN_CACHE_ENTRIES))]
    pub(super) token_cache_entries: Option<usize>,
    /// Most bytes the token cache accounts for (tokens at 4 bytes each plus a fixed cost per
    /// entry), in bytes (256 MiB). Read at start.
    #[schemars(extend("default" = DEFAULT_TOKEN_CACHE_BYTES))]
    pub(super) token_cache_bytes: Option<usize>,
    /// How often the config file's mtime is checked; a changed file is reloaded (listen
    /// addresses and TLS apply after a restart).
    #[schemars(extend("default" = format_duration(DEFAULT_RELOAD_INTERVAL)))]
    pub(super) reload_interval: Option<ConfigDuration>,
    /// Body mode assumed when Envoy sends no `protocol_config` (Envoy < 1.34): `buffered` or
    /// `full_duplex_streamed`; it must match the filter's `processing_mode`.
    #[schemars(extend("default" = DEFAULT_BODY_MODE))]
    pub(super) default_body_mode: Option<BodyMode>,
    /// Debug response headers (`x-kvroute-decision`, `x-kvroute-predicted-cached-tokens`). They
    /// reveal whether a prompt was cached, so they are off unless configured.
    pub(super) debug_headers: RawDebugHeaders,
    /// Limits on in-flight state, streams and in-process tokenization.
    pub(super) limits: RawLimits,
    /// Several ext-proc replicas acting as one: each tells the others, through the index service
    /// (`index.addresses`), every request it sent and when the engine answered, and counts
    /// theirs as its own in-flight load and routed prefixes.
    pub(super) peers: RawPeers,
    /// Drift between kvroute's predicted and the engines' reported cached tokens: a warning, and
    /// optionally the approximate tier for a drifting replica's pool.
    pub(super) drift: RawDrift,
    /// GIE endpoint-picker protocol: fallback endpoints and load shedding.
    pub(super) epp: RawEpp,
    /// Decision records ("why this replica"): every candidate's matched blocks, load and
    /// estimated time to first token, the tier, reason and tokens, for sampled requests and those
    /// carrying the debug token; the last ones are served at the admin port's `/v1/decisions`.
    pub(super) decision_records: RawDecisionRecords,
    /// The pool of a request naming no model (vLLM then serves its base model). Default: the
    /// only pool; with several pools and none named, such a request is refused with 400.
    pub(super) default_pool: Option<String>,
    /// The pools (required, at least one): replicas serving the same models with one block size
    /// and key scheme.
    pub(super) pools: Vec<RawPool>,
    /// Static replicas (required unless every pool has `discovery`).
    pub(super) replicas: Vec<RawReplica>,
    /// How log lines are written: `format: text` (the default) or `json`. Read at start.
    pub(super) log: kvroute_config::RawLog,
}

/// Default ext_proc gRPC listen address (GIE's EPP port). Loopback: whoever reaches this port gets
/// routing decisions and holds in-flight slots, so listening wider is a deliberate choice.
pub const DEFAULT_GRPC_ADDR: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9002));
/// Default admin HTTP listen address (loopback, like every listener unless configured). GIE's
/// metrics port: its 9003 is the gRPC health port (`listen.health`).
pub const DEFAULT_ADMIN_ADDR: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9090));
/// The ext_proc port is plaintext unless configured (`listen.secure_serving`): Envoy beside it
/// reaches it over the pod network, and a self-signed certificate needs Envoy set up for it.
pub const DEFAULT_SECURE_SERVING: bool = false;

/// The chart flags (`--grpc-port`, `--grpc-health-port`, `--metrics-port`, `--secure-serving`,
/// `--cert-path`) override these keys.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawListen {
    /// ext_proc gRPC address (GIE's EPP port), `ip:port`: loopback unless configured (in a pod,
    /// Envoy or the gateway reaches it from outside: `0.0.0.0:9002`). gRPC health
    /// (`grpc.health.v1`: "", liveness, readiness, inference-extension and the ext_proc service)
    /// is always served here.
    #[schemars(extend("default" = DEFAULT_GRPC_ADDR))]
    pub(super) grpc: Option<ListenAddr>,
    /// Admin HTTP address (`/metrics`, `/healthz`, `/readyz`), `ip:port`. Must differ
    /// from `grpc`.
    #[schemars(extend("default" = DEFAULT_ADMIN_ADDR))]
    pub(super) admin: Option<ListenAddr>,
    /// A second, plaintext gRPC health port for probes (GIE's 9003), `ip:port`; default none.
    /// Must differ from `grpc` and `admin`.
    pub(super) health: Option<ListenAddr>,
    /// TLS on the ext_proc port; with `client_ca`, clients must present a certificate it signs
    /// (mTLS). Envoy's ext_proc cluster then needs an UpstreamTlsContext. Default: plaintext.
    pub(super) tls: Option<RawServerTls>,
    /// Without `tls`: serve TLS with a self-signed certificate made at start (GIE's and llm-d's
    /// `--secure-serving`; Envoy then needs an UpstreamTlsContext that does not verify it).
    #[schemars(extend("default" = DEFAULT_SECURE_SERVING))]
    pub(super) secure_serving: Option<bool>,
}

/// Default deadline for one `Match` call on the index (all fail-overs included).
pub const DEFAULT_MATCH_TIMEOUT: Duration = Duration::from_millis(20);
/// How long an index address that failed is skipped before being tried again.
pub const DEFAULT_INDEX_RETRY_AFTER: Duration = Duration::from_secs(2);

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawIndex {
    /// kvroute-index addresses, tried in order (HA): `http://host:port`, or `https://` with
    /// `tls`. Default none.
    pub(super) addresses: Vec<String>,
    /// A kvroute-index config file: that index runs inside this process and is asked first
    /// (a `Match` without a network hop). Needs the `embedded-index` build feature.
    pub(super) embedded: Option<PathBuf>,
    /// Deadline of one `Match` call, all fail-overs included.
    #[schemars(extend("default" = format_duration(DEFAULT_MATCH_TIMEOUT)))]
    pub(super) match_timeout: Option<ConfigDuration>,
    /// How long an address that failed is skipped before it is tried again.
    #[schemars(extend("default" = format_duration(DEFAULT_INDEX_RETRY_AFTER)))]
    pub(super) retry_after: Option<ConfigDuration>,
    /// TLS to the index (`ca`, optional `server_name` and client `cert`/`key`); the addresses
    /// are then `https://`. Default: plaintext.
    pub(super) tls: Option<RawClientTls>,
    /// File holding the index's `query_auth` token (printable ASCII, no spaces; trailing
    /// whitespace ignored), sent as `authorization: Bearer <token>` with every `Match`. Only
    /// with `addresses` (the embedded index needs none).
    pub(super) token_file: Option<String>,
}

/// Default budget for a whole routing decision (tokenize + match + score).
pub const DEFAULT_DECISION_BUDGET: Duration = Duration::from_millis(50);
/// Default budget for tokenization within a decision.
pub const DEFAULT_TOKENIZE_BUDGET: Duration = Duration::from_millis(30);
/// Default time in-flight streams get to finish on shutdown.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawBudgets {
    /// Budget of a whole routing decision (tokenize, match, score); positive.
    /// Past it the decision routes on load alone.
    #[schemars(extend("default" = format_duration(DEFAULT_DECISION_BUDGET)))]
    pub(super) decision: Option<ConfigDuration>,
    /// Budget of tokenization within a decision; at most `decision`.
    #[schemars(extend("default" = format_duration(DEFAULT_TOKENIZE_BUDGET)))]
    pub(super) tokenize: Option<ConfigDuration>,
    /// Time in-flight streams get to finish on shutdown.
    #[schemars(extend("default" = format_duration(DEFAULT_DRAIN_TIMEOUT)))]
    pub(super) drain: Option<ConfigDuration>,
}

/// Default timeout of one `/metrics` scrape.
pub const DEFAULT_SCRAPE_TIMEOUT: Duration = Duration::from_millis(400);
/// Consecutive failed scrapes after which a replica counts as not ready.
pub const DEFAULT_UNREADY_AFTER_FAILURES: u32 = 3;

// The interval's default is the routing crate's `DEFAULT_SCRAPE_INTERVAL`: load signals age
// with it.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawScrape {
    /// Interval between scrapes of each replica's `metrics_url`; positive.
    #[schemars(extend("default" = format_duration(DEFAULT_SCRAPE_INTERVAL)))]
    pub(super) interval: Option<ConfigDuration>,
    /// Timeout of one scrape.
    #[schemars(extend("default" = format_duration(DEFAULT_SCRAPE_TIMEOUT)))]
    pub(super) timeout: Option<ConfigDuration>,
    /// Consecutive failed scrapes after which a replica counts as not ready.
    #[schemars(extend("default" = DEFAULT_UNREADY_AFTER_FAILURES))]
    pub(super) unready_after_failures: Option<u32>,
}

// The defaults are the routing crate's (`kvroute_routing::scoring::DEFAULT_*`), where the score
// is computed.
/// Every weight is a finite number >= 0.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawScoring {
    /// Prefill cost of each uncached prompt token, in ms.
    #[schemars(extend("default" = DEFAULT_PREFILL_MS_PER_TOKEN))]
    pub(super) prefill_ms_per_token: Option<f64>,
    /// Cost of each waiting (queued) request ahead, in ms.
    #[schemars(extend("default" = DEFAULT_QUEUE_MS_PER_REQUEST))]
    pub(super) queue_ms_per_request: Option<f64>,
    /// Cost of each running request (batch interference), in ms.
    #[schemars(extend("default" = DEFAULT_RUNNING_MS_PER_REQUEST))]
    pub(super) running_ms_per_request: Option<f64>,
    /// Cost at 100% KV-cache usage (preemption risk), in ms.
    #[schemars(extend("default" = DEFAULT_KV_USAGE_MS))]
    pub(super) kv_usage_ms: Option<f64>,
    /// Hotspot guard: a replica whose load exceeds the candidates' mean by this factor (and
    /// `hotspot_min_ms`) is skipped when two or more requests carrying as much of the routed
    /// prompt as the replica holds are in flight there, unless every candidate is; at least 1.
    #[schemars(extend("default" = DEFAULT_HOTSPOT_FACTOR))]
    pub(super) hotspot_factor: Option<f64>,
    /// Loads below this never trip the hotspot guard, in ms.
    #[schemars(extend("default" = DEFAULT_HOTSPOT_MIN_MS))]
    pub(super) hotspot_min_ms: Option<f64>,
    /// The pool counts as idle while its candidates' queued prefill (estimated, in ms), averaged
    /// over the last seconds, is below this: a burst of requests sharing a prefix then spreads
    /// over the replicas holding its context (scored on what is known computed there: the
    /// index's answer, or without events the prompts that got their first token there), so
    /// replicas with spare prefill compute the new part in parallel and hold it for what
    /// follows; busy, the burst batches where its prefill is in flight. 0: never idle.
    #[schemars(extend("default" = DEFAULT_IDLE_POOL_MS))]
    pub(super) idle_pool_ms: Option<f64>,
    /// Share of a held prefix's prefill charged again to a replica that would recompute it, once
    /// every replica is busy.
    #[schemars(extend("default" = DEFAULT_RECOMPUTE_PENALTY))]
    pub(super) recompute_penalty: Option<f64>,
    /// How long a routed prefix counts as held by its replica before the engine's KV events
    /// confirm it.
    #[schemars(extend("default" = format_duration(DEFAULT_SPECULATIVE_TTL)))]
    pub(super) speculative_ttl: Option<ConfigDuration>,
    /// Overload: once every candidate has at least this much queued (estimated, in ms), a
    /// request goes to the longest cached prefix among the candidates within
    /// `overload_imbalance` of the least busy one, instead of the lowest estimated time to first
    /// token (recomputing a prefix then delays every request behind it). 0 turns it off.
    #[schemars(extend("default" = DEFAULT_OVERLOAD_QUEUE_MS))]
    pub(super) overload_queue_ms: Option<f64>,
    /// Overload: how much longer than the least busy candidate's a queue may be and still take a
    /// request for its cached prefix (a factor, at least 1).
    #[schemars(extend("default" = DEFAULT_OVERLOAD_IMBALANCE))]
    pub(super) overload_imbalance: Option<f64>,
}

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
/// Default largest prompt (text, or the messages and other prompt fields' JSON) tokenized whole
/// in process (`limits.tokenize_max_prompt_bytes`): a fast-encoder tokenization of this much
/// takes ≈ 25 ms in a release build, within the default tokenize budget.
pub const DEFAULT_TOKENIZE_MAX_PROMPT_BYTES: usize = 2 * 1024 * 1024;
/// Default most in-process tokenizations on blocking threads at once
/// (`limits.tokenize_concurrency`): the number of CPUs (this when it cannot be read).
pub const DEFAULT_TOKENIZE_CONCURRENCY_FALLBACK: usize = 2;

/// The default of `limits.tokenize_concurrency`: the number of CPUs this process may use.
pub fn default_tokenize_concurrency() -> usize {
    std::thread::available_parallelism().map_or(
        DEFAULT_TOKENIZE_CONCURRENCY_FALLBACK,
        std::num::NonZero::get,
    )
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawPeers {
    /// Share decisions with the other ext-proc replicas using the same index addresses (a lone
    /// replica shares with nobody, at no cost). Needs `index.addresses`; ignored with
    /// `index.embedded` alone (one process, nobody to share with).
    #[schemars(extend("default" = DEFAULT_PEERS_SHARE))]
    pub(super) share: Option<bool>,
    /// A peer's news older than this when it arrives is dropped (counted `stale`): a decision
    /// that late no longer describes the replica's queue; positive.
    #[schemars(extend("default" = format_duration(DEFAULT_PEERS_MAX_STALENESS)))]
    pub(super) max_staleness: Option<ConfigDuration>,
}

/// Default `peers.share`: in kvroute-replay, four pickers sharing nothing but the index lose
/// 12-18 % of one picker's max rate at the SLO; sharing within a millisecond recovers it.
pub const DEFAULT_PEERS_SHARE: bool = true;
/// Default `peers.max_staleness`.
pub const DEFAULT_PEERS_MAX_STALENESS: Duration = Duration::from_millis(250);

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawLimits {
    /// A routed request whose response headers never come stops counting as its replica's load
    /// after this; positive.
    #[schemars(extend("default" = format_duration(DEFAULT_INFLIGHT_MAX_AGE)))]
    pub(super) inflight_max_age: Option<ConfigDuration>,
    /// Most ext_proc streams open at once; more are refused (Envoy then fails open);
    /// positive.
    #[schemars(extend("default" = DEFAULT_MAX_STREAMS))]
    pub(super) max_streams: Option<usize>,
    /// Most in-process tokenizations on blocking threads at once; default the number of CPUs,
    /// positive. A decision that gets no slot within its tokenize budget falls back
    /// (`fallbacks_total{stage="tokenize",cause="busy"}`). Read at start.
    pub(super) tokenize_concurrency: Option<usize>,
    /// Largest prompt (text, or the messages' JSON) tokenized whole in process, in bytes;
    /// 2 MiB. A larger one has only its leading tokens tokenized
    /// (`cause="prompt_too_large"`). Read at start.
    #[schemars(extend("default" = DEFAULT_TOKENIZE_MAX_PROMPT_BYTES))]
    pub(super) tokenize_max_prompt_bytes: Option<usize>,
}

/// Default drift above which a replica counts as drifting (`drift.bound`, 0..1).
pub const DEFAULT_DRIFT_BOUND: f64 = 0.5;
/// Default span of the drift window (`drift.window`): long enough to average a few hundred
/// requests on a busy replica, short enough to notice a bad rollout within minutes.
pub const DEFAULT_DRIFT_WINDOW: Duration = Duration::from_secs(300);
/// Default predicted cached tokens a window needs before it gives a verdict (`drift.min_tokens`):
/// a few dozen requests with a shared prefix, so one request's eviction cannot trip the bound.
pub const DEFAULT_DRIFT_MIN_TOKENS: u64 = 16_384;
/// Default action past the bound (`drift.action`).
pub const DEFAULT_DRIFT_ACTION: DriftAction = DriftAction::Warn;

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawDrift {
    /// Drift (share of predicted cached tokens the engine did not report, 0..=1) over `window`
    /// above which a replica is drifting (a rate-limited warning).
    #[schemars(extend("default" = DEFAULT_DRIFT_BOUND))]
    pub(super) bound: Option<f64>,
    /// Drift at or below which a drifting replica stops drifting, 0..=bound; default bound / 2.
    pub(super) clear_below: Option<f64>,
    /// Span of the drift window; positive.
    #[schemars(extend("default" = format_duration(DEFAULT_DRIFT_WINDOW)))]
    pub(super) window: Option<ConfigDuration>,
    /// Predicted cached tokens a window needs before it gives a verdict.
    #[schemars(extend("default" = DEFAULT_DRIFT_MIN_TOKENS))]
    pub(super) min_tokens: Option<u64>,
    /// What a drifting replica causes: `warn` or `approximate` (its pool routes on
    /// the approximate tier until the drift is back at `clear_below`).
    #[schemars(extend("default" = DEFAULT_DRIFT_ACTION))]
    pub(super) action: Option<DriftAction>,
}

/// Debug response headers are exposed to nobody unless configured (`debug_headers.expose`).
pub const DEFAULT_DEBUG_EXPOSE: DebugExpose = DebugExpose::Never;
/// Request header carrying the debug token (`debug_headers.token_header`).
pub const DEFAULT_DEBUG_TOKEN_HEADER: &str = "x-kvroute-debug-token";

/// `debug_headers.expose`: who gets the debug response headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DebugExpose {
    /// Nobody.
    Never,
    /// Every response (trusted clients only: tests, benchmarks, a private deployment).
    Always,
    /// Requests carrying the token (`token_file`) in `token_header`.
    Token,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawDebugHeaders {
    /// Who gets the headers: `never`, `always`, or `token` (requests carrying the
    /// secret, compared in constant time and removed before the request goes upstream).
    #[schemars(extend("default" = DEFAULT_DEBUG_EXPOSE))]
    pub(super) expose: Option<DebugExpose>,
    /// `expose: token` only: the request header carrying the token, any case.
    #[schemars(extend("default" = DEFAULT_DEBUG_TOKEN_HEADER))]
    pub(super) token_header: Option<String>,
    /// `expose: token` only (required there): the file holding the token.
    pub(super) token_file: Option<String>,
}

/// Default fallback endpoints after the chosen one (`epp.fallbacks`): two more replicas cover
/// one failed retry and one more without spreading a conversation's retries over the pool.
pub const DEFAULT_EPP_FALLBACKS: usize = 2;
/// Waiting requests at which a replica counts as saturated for shedding (GIE's default).
pub const DEFAULT_SHED_QUEUE_DEPTH: f64 = 5.0;
/// KV-cache usage (0..1) at which a replica counts as saturated for shedding (GIE's default).
pub const DEFAULT_SHED_KV_CACHE_USAGE: f64 = 0.8;

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawEpp {
    /// Fallback endpoints after the chosen one, best first, in
    /// `x-gateway-destination-endpoint` and its `envoy.lb` metadata (a proxy's retries walk
    /// them); 0 sends the chosen endpoint alone; at most 16.
    #[schemars(extend("default" = DEFAULT_EPP_FALLBACKS))]
    pub(super) fallbacks: Option<usize>,
    /// Refuse a request with 429 when every ready replica of its pool is saturated (either
    /// bound reached). Off unless configured.
    pub(super) shedding: Option<RawShedding>,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawShedding {
    /// Waiting requests (scraped queue depth) at which a replica is saturated; at least
    /// 1.
    #[schemars(extend("default" = DEFAULT_SHED_QUEUE_DEPTH))]
    pub(super) queue_depth: Option<f64>,
    /// KV-cache usage at which a replica is saturated, in (0, 1].
    #[schemars(extend("default" = DEFAULT_SHED_KV_CACHE_USAGE))]
    pub(super) kv_cache_usage: Option<f64>,
}

/// Default capacity (blocks) of each replica's approximate prefix memory.
pub const DEFAULT_APPROX_CAPACITY_BLOCKS: usize = 65_536;
/// Whether the index receives a pool's KV events unless configured (`pools[].events`): the
/// precise tier is the point of running an index.
pub const DEFAULT_POOL_EVENTS: bool = true;

/// A pool. `name`, `models`, `block_size` and `key_scheme` are the schema every kvroute
/// component shares (paste them into kvroute-index's config unchanged: same keys, same
/// defaults, from `kvroute_block_keys`); the rest is ext-proc's own.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawPool {
    /// Pool name (required, unique; a metric label).
    pub(super) name: Option<String>,
    /// Served base model names (required, non-empty; a model is served by one pool): what
    /// requests send as `model`.
    pub(super) models: Vec<String>,
    /// KV block size in tokens, as the engines run (`--block-size`).
    #[schemars(extend("default" = DEFAULT_BLOCK_SIZE))]
    pub(super) block_size: Option<u32>,
    /// How block keys are computed: the engines' own block hashes (`kind: vllm-exact`, with
    /// their hash algorithm, `PYTHONHASHSEED` and vLLM release) or `kind: token-chain`.
    pub(super) key_scheme: RawKeyScheme,
    /// The engine family serving the pool's replicas, `vllm` or `sglang` (a replica may say
    /// otherwise): which metric names carry their load. The key scheme must compute what they
    /// publish: `sglang-exact` for SGLang, `vllm-exact` for vLLM, `token-chain` for either.
    /// Default: the key scheme's family (`vllm` for `token-chain`).
    pub(super) engine: Option<Engine>,
    /// LoRA adapters served: a name, or `{name, id, path}` as vLLM's `LoRARequest` (vLLM <=
    /// 0.11.0 hashes the id, >= 0.31 the path). Clients send an adapter's name as `model`.
    pub(super) adapters: Vec<RawAdapter>,
    /// `route`: kvroute picks the replica. `shadow`: kvroute decides every request exactly as it
    /// would but leaves the choice to Envoy's own load balancing, then compares (what kvroute's
    /// choice would have had cached against what the replica Envoy chose did): `/v1/shadow`,
    /// `kvroute_extproc_shadow_*`. A reload switches it.
    #[schemars(extend("default" = DEFAULT_POOL_MODE))]
    pub(super) mode: Option<PoolMode>,
    /// Whether the index receives this pool's KV events (else the approximate tier only).
    #[schemars(extend("default" = DEFAULT_POOL_EVENTS))]
    pub(super) events: Option<bool>,
    /// Capacity of each replica's approximate prefix memory, in blocks (about the replica's KV
    /// cache); positive. The memory keeps the most recently routed one to two times this many.
    #[schemars(extend("default" = DEFAULT_APPROX_CAPACITY_BLOCKS))]
    pub(super) approx_capacity_blocks: Option<usize>,
    /// Where prompt tokens come from: exactly one of `model_dir`, `remote` or `render`.
    /// Default none: every decision uses the load tier.
    pub(super) tokenizer: Option<RawTokenizer>,
    /// Replicas from Kubernetes (the Ready pods of a GIE InferencePool or a label selector,
    /// kept up to date) instead of `replicas:`, which may then not name this pool. Pod
    /// annotations (`kvroute.io/model`, `kvroute.io/metrics-port`, ...) set per-pod values.
    pub(super) discovery: Option<kvroute_discovery::RawPoolDiscovery>,
    /// Prefill/decode disaggregation: a request goes to the decode replica kvroute's scoring
    /// chooses (any but `role: prefill` ones), and its prompt is computed on a prefill replica
    /// (any but `role: decode` ones, chosen by prefix and load) when it is long and mostly
    /// uncached on that decode replica. Without a ready prefill replica it is served whole.
    pub(super) disaggregation: Option<RawDisaggregation>,
    /// Built from GIE's chart flags without `--model`: `models` is empty and the pool serves
    /// every model (not writable in a file, where `models` is required).
    #[serde(skip)]
    #[schemars(skip)]
    pub(super) any_model: bool,
}

/// Default of a pool's `mode`: kvroute routes.
pub const DEFAULT_POOL_MODE: PoolMode = PoolMode::Route;
/// Default share of decisions recorded (`decision_records.sample`): none but flagged ones.
pub const DEFAULT_RECORD_SAMPLE: f64 = 0.0;
/// Default number of decision records kept for `/v1/decisions`.
pub const DEFAULT_RECORDS_KEPT: usize = 256;
/// Most decision records `decision_records.keep` may ask for (bounded memory).
pub const MAX_RECORDS_KEPT: usize = 100_000;

/// `decision_records`: which decisions are explained, and how many explanations are kept.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawDecisionRecords {
    /// Share of decisions recorded, 0 to 1. Requests carrying the debug token
    /// (`debug_headers.expose: token`, or every request with `always`) are always recorded and
    /// get the record, compact, in the `x-kvroute-explain` response header.
    #[schemars(extend("default" = DEFAULT_RECORD_SAMPLE))]
    pub(super) sample: Option<f64>,
    /// Records kept (the most recent), 0 to 100000; each is a few hundred bytes per candidate.
    #[schemars(extend("default" = DEFAULT_RECORDS_KEPT))]
    pub(super) keep: Option<usize>,
}

/// An adapter as written: its name, or `{name, id, path}` (what older/newer vLLM hash).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(untagged)]
pub(super) enum RawAdapter {
    /// The adapter's name only (vLLM versions that hash neither id nor path).
    Name(String),
    /// As vLLM's `LoRARequest` names it.
    Full {
        /// `lora_name`: what clients send as `model`.
        name: String,
        /// `lora_int_id` (hashed by vLLM <= 0.11.0).
        #[serde(default)]
        id: Option<i64>,
        /// `lora_path` (hashed by vLLM >= 0.31).
        #[serde(default)]
        path: Option<String>,
    },
}

/// Default timeout of a remote `/tokenize` call.
pub const DEFAULT_REMOTE_TOKENIZE_TIMEOUT: Duration = Duration::from_millis(25);

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawTokenizer {
    /// A Hugging Face model folder (`tokenizer.json`, chat template), loaded in process.
    pub(super) model_dir: Option<PathBuf>,
    /// A vLLM-compatible `/tokenize` endpoint's full `http://` URL.
    pub(super) remote: Option<String>,
    /// The engine's base `http://` URL: the request body goes to its render endpoint (vLLM 0.32
    /// `--enable-scale-out`; exact by construction).
    pub(super) render: Option<String>,
    /// With `remote` or `render`: timeout of one call.
    #[schemars(extend("default" = format_duration(DEFAULT_REMOTE_TOKENIZE_TIMEOUT)))]
    pub(super) timeout: Option<ConfigDuration>,
}

/// `pools[].disaggregation`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawDisaggregation {
    /// How the prefill leg runs: `sidecar` (the decode replica's llm-d `pd-sidecar` runs it;
    /// the request names the prefill replica in `x-prefiller-host-port: ip:port`) or `envoy`
    /// (ext-proc sends the prompt to the prefill replica itself, with `max_tokens: 1` and
    /// `kv_transfer_params: {do_remote_decode: true, ...}`, and answers Envoy with the decode
    /// replica and the request body carrying the `kv_transfer_params` the prefill answered; a
    /// failed leg serves the request whole on the decode replica). `envoy` needs Envoy's
    /// ext_proc `message_timeout` above `prefill_timeout` plus the decision budget.
    #[schemars(extend("default" = "sidecar"))]
    pub(super) mode: Option<DisaggregationMode>,
    /// `envoy` mode: the whole prefill leg, retries included, as a duration (`30s`); past it
    /// the request is served whole on the decode replica.
    #[schemars(extend("default" = format_duration(DEFAULT_PREFILL_TIMEOUT)))]
    pub(super) prefill_timeout: Option<ConfigDuration>,
    /// `envoy` mode: further attempts of a prefill leg answered 502, 503 or 504 or refused a
    /// connection (after 50 ms, then twice as long each time), within `prefill_timeout`.
    #[schemars(extend("default" = DEFAULT_PREFILL_RETRIES))]
    pub(super) prefill_retries: Option<u32>,
    /// `envoy` mode: prefill legs of this pool in flight at once (at least 1); a split request
    /// beyond them is served whole, counted as `busy`.
    #[schemars(extend("default" = DEFAULT_MAX_CONCURRENT_PREFILLS))]
    pub(super) max_concurrent_prefills: Option<usize>,
    /// Prompts shorter than this many tokens are served whole on the decode replica (llm-d's
    /// `promptTokens`).
    #[schemars(extend("default" = DEFAULT_DISAGGREGATION_MIN_PROMPT_TOKENS))]
    pub(super) min_prompt_tokens: Option<usize>,
    /// A prompt is split when at least this many of its tokens are not cached on the chosen
    /// decode replica (llm-d's `nonCachedTokens`).
    #[schemars(extend("default" = DEFAULT_DISAGGREGATION_MIN_UNCACHED_TOKENS))]
    pub(super) min_uncached_tokens: Option<usize>,
    /// The prefill pool's load, as a duration (`1s`): a prefill replica whose estimated queue
    /// (the scoring weights' queue estimate) is at least this, and longer than the chosen decode
    /// replica's, takes no prefill leg; when every ready prefill replica is that busy the
    /// request is served whole on its decode replica, counted as `prefill_busy`. Set it high
    /// (`1h`) to split regardless of the prefill pool's load.
    #[schemars(extend("default" = format_duration(DEFAULT_MAX_PREFILL_QUEUE)))]
    pub(super) max_prefill_queue: Option<ConfigDuration>,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawReplica {
    /// Stable id, as the index knows it (required, unique; a metric label).
    pub(super) id: Option<String>,
    /// Name of its pool (required).
    pub(super) pool: Option<String>,
    /// `ip:port` Envoy routes to (required, unique).
    pub(super) address: Option<ListenAddr>,
    /// Data-parallel ranks behind this address (vLLM `--data-parallel-size` with one API
    /// server): each rank becomes a routing target of its own, `<id>@dp<rank>` (as the index
    /// names it), sent there with the `x-data-parallel-rank` header; its load is read from the
    /// `engine="<rank>"` series of `metrics_url`.
    #[schemars(extend("default" = 1))]
    pub(super) data_parallel_size: Option<u32>,
    /// Its part in prefill/decode disaggregation (`pools[].disaggregation`): `both` (serves
    /// requests, and prompts for others), `prefill` (only computes prompts for decode replicas,
    /// never a request's destination) or `decode` (serves requests, pulling a split prompt's KV).
    #[schemars(extend("default" = "both"))]
    pub(super) role: Option<Role>,
    /// The engine family serving it, `vllm` or `sglang`; default: its pool's `engine`. A pool
    /// whose replicas are of both families routes one model across them (`token-chain` keys).
    pub(super) engine: Option<Engine>,
    /// The engine's Prometheus endpoint, `http://`; default none (not scraped).
    pub(super) metrics_url: Option<String>,
    /// Envoy cluster for `cluster_header` routes (no whitespace); default none.
    pub(super) envoy_cluster: Option<String>,
}
