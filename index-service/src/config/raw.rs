//! The `kvroute-index` config file as written: every key, its type, default and meaning (the
//! source of `docs/configuration.md`). Unknown keys are errors, so a typo is never silently
//! ignored; values that are wrong on their own are refused while deserializing, with their path.

use schemars::JsonSchema;
use serde::Deserialize;
use serde::de::IgnoredAny;

use kvroute_block_keys::{DEFAULT_BLOCK_SIZE, RawKeyScheme};
use kvroute_config::{
    ConfigDuration, ListenAddr, RawEventSource, RawServerTls, RawTokenSource, format_duration,
};
use kvroute_index_core::index::VerifyHashes;

use super::{
    DEFAULT_ADMIN_ADDR, DEFAULT_AGENT_STALE_GRACE, DEFAULT_GRPC_ADDR,
    DEFAULT_MAX_BLOCKS_PER_REPLICA, DEFAULT_MIN_READY_FRACTION, DEFAULT_MIN_READY_REPLICAS,
    DEFAULT_RELOAD_INTERVAL, DEFAULT_REPLAY_TIMEOUT, DEFAULT_VERIFY_HASHES,
};

/// The file as written.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    /// Listen addresses and TLS.
    pub listen: RawListen,
    /// Memory and timing limits.
    pub limits: RawLimits,
    /// One pool per served model (at least one): the pool schema kvroute-ext-proc shares
    /// (`name`, `models`, `block_size`, `key_scheme`) and the index's own keys.
    pub pools: Vec<RawPool>,
    /// Engines (one entry per data-parallel rank) whose KV events are ingested.
    pub replicas: Vec<RawReplica>,
    /// kvroute-agents allowed to stream events for the replicas they own.
    pub agents: Vec<RawAgent>,
    /// With `pools[].discovery`: one kvroute-agent per node (its id the node name) feeds the
    /// discovered replicas on its node, all presenting this token. Without it the index
    /// subscribes to discovered pods directly.
    pub node_agents: Option<RawTokenSource>,
    /// A bearer token the query API (gRPC `Match`/`ReplicaState`, admin `/v1/*`) requires;
    /// without it the API answers anyone who can connect (keep it on loopback or a private
    /// network).
    pub query_auth: Option<RawTokenSource>,
    /// When `/readyz` and gRPC health say ready: every pool has enough ready replicas.
    pub readiness: RawReadiness,
    /// How often the config file's modification time is checked: a change to `replicas:`
    /// applies at once, anything else after a restart (logged).
    #[schemars(extend("default" = format_duration(DEFAULT_RELOAD_INTERVAL)))]
    pub reload_interval: Option<ConfigDuration>,
    /// How log lines are written: `format: text` (the default) or `json`. Read at start.
    pub log: kvroute_config::RawLog,
}

/// `readiness:` section.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawReadiness {
    /// Ready replicas each pool needs (a pool with fewer replicas needs all of them).
    #[schemars(extend("default" = DEFAULT_MIN_READY_REPLICAS))]
    pub min_ready_replicas: Option<usize>,
    /// Share of each pool's replicas that must be ready, 0.0–1.0 (e.g. 0.5: half).
    #[schemars(extend("default" = DEFAULT_MIN_READY_FRACTION))]
    pub min_ready_fraction: Option<f64>,
}

/// One `agents:` entry: an agent's identity, its secret, and the replicas it may write for.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawAgent {
    /// Agent id (the agent's `agent_id`).
    pub id: String,
    /// File holding the agent's token (exactly one of `token_file`, `token_env`).
    pub token_file: Option<String>,
    /// Environment variable holding the agent's token.
    pub token_env: Option<String>,
    /// Replica ids this agent owns; a replica fed only by its agent may omit `events.endpoint`.
    pub replicas: Vec<String>,
}

/// `listen:` section.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawListen {
    /// gRPC address (`Match` / `ReplicaState` API for kvroute-ext-proc, the agents' stream).
    #[schemars(extend("default" = DEFAULT_GRPC_ADDR))]
    pub grpc: Option<ListenAddr>,
    /// Admin HTTP address: `/metrics`, `/healthz`, `/readyz`, `/v1/replicas`, `/v1/match`.
    #[schemars(extend("default" = DEFAULT_ADMIN_ADDR))]
    pub admin: Option<ListenAddr>,
    /// TLS on the gRPC listener (clients then use `https://`); the admin HTTP server stays
    /// plaintext, for probes.
    pub tls: Option<RawServerTls>,
}

/// `limits:` section.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawLimits {
    /// Blocks indexed per replica before further stores are refused (a flood of events cannot
    /// exhaust memory).
    #[schemars(extend("default" = DEFAULT_MAX_BLOCKS_PER_REPLICA))]
    pub max_blocks_per_replica: Option<std::num::NonZeroUsize>,
    /// How long to wait for a replay to complete before the replica is reset instead.
    #[schemars(extend("default" = format_duration(DEFAULT_REPLAY_TIMEOUT)))]
    pub replay_timeout: Option<ConfigDuration>,
    /// How long an agent-fed replica may be without its agent before it leaves precise scoring.
    #[schemars(extend("default" = format_duration(DEFAULT_AGENT_STALE_GRACE)))]
    pub agent_stale_grace: Option<ConfigDuration>,
    /// Older spelling of `replay_timeout` (refused with the new key).
    #[schemars(skip)]
    pub replay_timeout_ms: Option<IgnoredAny>,
    /// Older spelling of `agent_stale_grace` (refused with the new key).
    #[schemars(skip)]
    pub agent_stale_grace_ms: Option<IgnoredAny>,
}

/// One `pools:` entry. `name`, `models`, `block_size` and `key_scheme` are the schema every
/// kvroute component shares (kvroute-ext-proc's pools take the same keys with the same
/// defaults: paste them unchanged); `verify_hashes`, `attention_chunk_size` are the index's own.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawPool {
    /// Pool name (unique; what replicas name in `pool`, and ReplicaState reports).
    pub name: String,
    /// Served model names (as in requests' `model`; at least one, each in one pool only);
    /// Match selects the pool by them.
    pub models: Vec<String>,
    /// Tokens per KV block (the engines' `--block-size`).
    #[schemars(extend("default" = DEFAULT_BLOCK_SIZE))]
    pub block_size: Option<u32>,
    /// How block keys are computed (the engines' hashing settings).
    pub key_scheme: RawKeyScheme,
    /// vllm-exact pools: `off` (trust the engines), `flag` (re-hash stored blocks from their
    /// token ids and flag replicas that disagree) or `required` (also refuse every run that is
    /// not verified: mid-chain runs without a parent digest, LoRA, extra keys, mismatches).
    #[schemars(extend("default" = DEFAULT_VERIFY_HASHES))]
    pub verify_hashes: Option<VerifyHashes>,
    /// Tokens per attention chunk of the model's chunked local attention layers (Llama 4's
    /// `attention_chunk_size`), for hybrid models with such a KV-cache group: vLLM's events do
    /// not carry it, and without it such a replica is flagged (matches approximate).
    pub attention_chunk_size: Option<std::num::NonZeroU32>,
    /// Where the pool's replicas come from instead of `replicas:` (Kubernetes; the section
    /// kvroute-ext-proc's pools take): discovered replicas are subscribed to directly at their
    /// pods' KV-event ports, or fed by their node's agent with `node_agents`. A pod that leaves
    /// takes its blocks along.
    pub discovery: Option<kvroute_discovery::RawPoolDiscovery>,
    /// Older keys, refused with the new spelling.
    #[schemars(skip)]
    pub model: Option<IgnoredAny>,
    /// Older spelling of `key_scheme.hash_algo`.
    #[schemars(skip)]
    pub hash_algo: Option<IgnoredAny>,
    /// Older spelling of `key_scheme.seed`.
    #[schemars(skip)]
    pub hash_seed: Option<IgnoredAny>,
    /// Older spelling of `key_scheme.vllm_version`.
    #[schemars(skip)]
    pub vllm_version: Option<IgnoredAny>,
    /// Older spelling of `verify_hashes`.
    #[schemars(skip)]
    pub validate_hashes: Option<IgnoredAny>,
}

/// One `replicas:` entry.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawReplica {
    /// Replica id (unique, `[A-Za-z0-9._:-]`; used in metric labels and routing decisions).
    pub id: String,
    /// Name of its pool (one without `discovery`).
    pub pool: String,
    /// Where its KV events come from. A bound socket (`mode: bind`) accepts any peer that can
    /// reach it unless `allowed_peers` is set.
    pub events: RawEventSource,
    /// Older spelling of `pool` (refused).
    #[schemars(skip)]
    pub model: Option<IgnoredAny>,
}
