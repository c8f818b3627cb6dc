//! The YAML document's shape: serde structs, unknown keys rejected, every default a named const
//! beside its key. Nothing here is validated; `build` turns it into a [`super::Config`].

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use kvroute_block_keys::RawKeyScheme;

use super::{BodyMode, DriftAction};

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

/// The YAML document as written. Unknown keys are errors.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    pub(super) listen: RawListen,
    pub(super) index: RawIndex,
    pub(super) budgets: RawBudgets,
    pub(super) max_body_bytes: Option<usize>,
    pub(super) scrape: RawScrape,
    pub(super) scoring: RawScoring,
    pub(super) token_cache_entries: Option<usize>,
    pub(super) token_cache_bytes: Option<usize>,
    pub(super) reload_interval: Option<String>,
    /// Body mode assumed when Envoy does not send `protocol_config` (Envoy < 1.34).
    pub(super) default_body_mode: Option<BodyMode>,
    pub(super) debug_headers: RawDebugHeaders,
    pub(super) limits: RawLimits,
    pub(super) drift: RawDrift,
    pub(super) epp: RawEpp,
    /// The pool of a request that names no model (needed only with several pools).
    pub(super) default_pool: Option<String>,
    pub(super) pools: Vec<RawPool>,
    pub(super) replicas: Vec<RawReplica>,
}

/// Default ext_proc gRPC listen address (GIE's EPP port). Loopback: whoever reaches this port gets
/// routing decisions and holds in-flight slots, so listening wider is a deliberate choice.
pub const DEFAULT_GRPC_ADDR: &str = "127.0.0.1:9002";
/// Default admin HTTP listen address (loopback, like every listener unless configured). GIE's
/// metrics port: its 9003 is the gRPC health port (`listen.health`).
pub const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:9090";
/// The ext_proc port is plaintext unless configured (`listen.secure_serving`): Envoy beside it
/// reaches it over the pod network, and a self-signed certificate needs Envoy set up for it.
pub const DEFAULT_SECURE_SERVING: bool = false;

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawListen {
    pub(super) grpc: Option<String>,
    pub(super) admin: Option<String>,
    pub(super) health: Option<String>,
    pub(super) tls: Option<kvroute_config::RawServerTls>,
    pub(super) secure_serving: Option<bool>,
}

/// Default deadline for one `Match` call on the index (all fail-overs included).
pub const DEFAULT_MATCH_TIMEOUT: Duration = Duration::from_millis(20);
/// How long an index address that failed is skipped before being tried again.
pub const DEFAULT_INDEX_RETRY_AFTER: Duration = Duration::from_secs(2);

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawIndex {
    pub(super) addresses: Vec<String>,
    pub(super) embedded: Option<PathBuf>,
    pub(super) match_timeout: Option<String>,
    pub(super) retry_after: Option<String>,
    pub(super) tls: Option<kvroute_config::RawClientTls>,
    pub(super) token_file: Option<String>,
}

/// Default budget for a whole routing decision (tokenize + match + score).
pub const DEFAULT_DECISION_BUDGET: Duration = Duration::from_millis(50);
/// Default budget for tokenization within a decision.
pub const DEFAULT_TOKENIZE_BUDGET: Duration = Duration::from_millis(30);
/// Default time in-flight streams get to finish on shutdown.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawBudgets {
    pub(super) decision: Option<String>,
    pub(super) tokenize: Option<String>,
    pub(super) drain: Option<String>,
}

/// Default timeout of one `/metrics` scrape.
pub const DEFAULT_SCRAPE_TIMEOUT: Duration = Duration::from_millis(400);
/// Consecutive failed scrapes after which a replica counts as not ready.
pub const DEFAULT_UNREADY_AFTER_FAILURES: u32 = 3;

/// `scrape`; the interval's default is the routing crate's `DEFAULT_SCRAPE_INTERVAL` (load
/// signals age with it).
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawScrape {
    pub(super) interval: Option<String>,
    pub(super) timeout: Option<String>,
    pub(super) unready_after_failures: Option<u32>,
}

/// `scoring`; the defaults are the routing crate's (`kvroute_routing::scoring::DEFAULT_*`),
/// where the score is computed.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawScoring {
    pub(super) prefill_ms_per_token: Option<f64>,
    pub(super) queue_ms_per_request: Option<f64>,
    pub(super) running_ms_per_request: Option<f64>,
    pub(super) kv_usage_ms: Option<f64>,
    pub(super) hotspot_factor: Option<f64>,
    pub(super) hotspot_min_ms: Option<f64>,
    pub(super) recompute_penalty: Option<f64>,
    pub(super) speculative_ttl: Option<String>,
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

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawLimits {
    pub(super) inflight_max_age: Option<String>,
    pub(super) max_streams: Option<usize>,
    pub(super) tokenize_concurrency: Option<usize>,
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

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawDrift {
    pub(super) bound: Option<f64>,
    pub(super) clear_below: Option<f64>,
    pub(super) window: Option<String>,
    pub(super) min_tokens: Option<u64>,
    pub(super) action: Option<DriftAction>,
}

/// Debug response headers are exposed to nobody unless configured (`debug_headers.expose`).
pub const DEFAULT_DEBUG_EXPOSE: DebugExpose = DebugExpose::Never;
/// Request header carrying the debug token (`debug_headers.token_header`).
pub const DEFAULT_DEBUG_TOKEN_HEADER: &str = "x-kvroute-debug-token";

/// `debug_headers.expose`: who gets the debug response headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DebugExpose {
    /// Nobody.
    Never,
    /// Every response.
    Always,
    /// Requests carrying the token (`token_file`) in `token_header`.
    Token,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawDebugHeaders {
    pub(super) expose: Option<DebugExpose>,
    /// Request header carrying the token (`token` mode).
    pub(super) token_header: Option<String>,
    /// File holding the token (`token` mode).
    pub(super) token_file: Option<String>,
}

/// Default fallback endpoints after the chosen one (`epp.fallbacks`): two more replicas cover
/// one failed retry and one more without spreading a conversation's retries over the pool.
pub const DEFAULT_EPP_FALLBACKS: usize = 2;
/// Waiting requests at which a replica counts as saturated for shedding (GIE's default).
pub const DEFAULT_SHED_QUEUE_DEPTH: f64 = 5.0;
/// KV-cache usage (0..1) at which a replica counts as saturated for shedding (GIE's default).
pub const DEFAULT_SHED_KV_CACHE_USAGE: f64 = 0.8;

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawEpp {
    pub(super) fallbacks: Option<usize>,
    pub(super) shedding: Option<RawShedding>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawShedding {
    pub(super) queue_depth: Option<f64>,
    pub(super) kv_cache_usage: Option<f64>,
}

/// Default capacity (blocks) of each replica's approximate prefix memory.
pub const DEFAULT_APPROX_CAPACITY_BLOCKS: usize = 65_536;
/// Whether the index receives a pool's KV events unless configured (`pools[].events`): the
/// precise tier is the point of running an index.
pub const DEFAULT_POOL_EVENTS: bool = true;

/// A pool. `name`, `models`, `block_size` and `key_scheme` are the schema every kvroute
/// component shares (kvroute-index's pools take the same keys with the same defaults, from
/// `kvroute_block_keys`); the rest is ext-proc's own.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawPool {
    pub(super) name: Option<String>,
    pub(super) models: Vec<String>,
    pub(super) block_size: Option<u32>,
    pub(super) key_scheme: RawKeyScheme,
    // ext-proc only:
    pub(super) adapters: Vec<RawAdapter>,
    /// Whether the index receives this pool's KV events (else: approximate tier only).
    pub(super) events: Option<bool>,
    pub(super) approx_capacity_blocks: Option<usize>,
    pub(super) tokenizer: Option<RawTokenizer>,
    /// `pools[].discovery`: where the pool's replicas come from instead of `replicas:`.
    pub(super) discovery: Option<kvroute_discovery::RawPoolDiscovery>,
}

/// An adapter as written: its name, or `{name, id, path}` (what older/newer vLLM hash).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawAdapter {
    Name(String),
    Full {
        name: String,
        #[serde(default)]
        id: Option<i64>,
        #[serde(default)]
        path: Option<String>,
    },
}

/// Default timeout of a remote `/tokenize` call.
pub const DEFAULT_REMOTE_TOKENIZE_TIMEOUT: Duration = Duration::from_millis(25);

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawTokenizer {
    pub(super) model_dir: Option<PathBuf>,
    pub(super) remote: Option<String>,
    pub(super) render: Option<String>,
    pub(super) timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawReplica {
    pub(super) id: Option<String>,
    pub(super) pool: Option<String>,
    pub(super) address: Option<String>,
    pub(super) metrics_url: Option<String>,
    pub(super) envoy_cluster: Option<String>,
}
