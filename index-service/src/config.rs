//! `kvroute-index` configuration: YAML in two layers.
//!
//! [`RawConfig`] mirrors the file (`deny_unknown_fields`, so a typo is an error, not a silently
//! ignored key); [`Config::from_yaml`] validates it into typed values and names the offending
//! field and value in every error. All cross-field rules live in [`Config::validate`].
//!
//! ```yaml
//! listen:
//!   grpc: 127.0.0.1:50061      # Match / ReplicaState API for kvroute-ext-proc
//!   admin: 127.0.0.1:9461      # /metrics, /healthz, /readyz, /v1/replicas, /v1/match
//!   tls:                       # optional, gRPC only (kvroute_runtime::tls); clients then use https://
//!     cert: /tls/tls.crt
//!     key: /tls/tls.key
//!     client_ca: /tls/ca.crt   # optional: require client certificates signed by it
//! query_auth:                  # optional: Match, ReplicaState and /v1/* need this bearer token
//!   token_file: /etc/kvroute/query-token   # or token_env: KVROUTE_QUERY_TOKEN
//! limits:
//!   max_blocks_per_replica: 1000000
//!   replay_timeout: 2s         # durations are strings: 500ms, 2s, 1m (one parser: parse_duration)
//!   agent_stale_grace: 10s
//! reload_interval: 2s         # the file is re-read when it changes: `replicas:` apply at once,
//!                              # anything else after a restart (logged)
//! node_agents:                 # with discovery: each node's kvroute-agent (id = node name) feeds
//!   token_file: /etc/kvroute/agent-token   # the discovered replicas on its node; one shared token
//! readiness:                   # /readyz and gRPC health: every pool has enough ready replicas
//!   min_ready_replicas: 1      # default 1 (a smaller pool needs all of its replicas)
//!   min_ready_fraction: 0.0    # default 0; e.g. 0.5 = half of each pool's replicas
//! pools:                      # the pool schema shared with kvroute-ext-proc (kvroute_block_keys::schema)
//!   - name: tiny
//!     models: [tiny]           # served model names (as in requests' `model`)
//!     block_size: 32           # default 16
//!     key_scheme: {kind: vllm-exact, hash_algo: sha256_cbor, seed: "0", vllm_version: 0.32.0}
//!     verify_hashes: flag      # index only: off | flag | required (refuse blocks that cannot be verified)
//!     attention_chunk_size: 8192   # index only, optional: the model's chunked local attention
//!                              # chunk (Llama 4); vLLM does not publish it, and without it a replica
//!                              # with such a KV-cache group is flagged (matches approximate)
//!   - name: llama              # replicas from Kubernetes instead of `replicas:` (the section
//!     models: [llama]          # kvroute-ext-proc's pools take, kvroute_discovery::config): the
//!     discovery:               # Ready pods' KV-event ports are subscribed to directly; a pod
//!       kubernetes: {namespace: llm, inference_pool: llama}   # that leaves takes its blocks along
//! replicas:
//!   - id: engine-a
//!     pool: tiny
//!     events:
//!       endpoint: tcp://10.0.0.5:5557   # the engine binds tcp://*:5557, so we connect
//!       replay_endpoint: tcp://10.0.0.5:5558
//!   - id: engine-b
//!     pool: tiny
//!     events:
//!       endpoint: tcp://0.0.0.0:6000   # the engine connects to us (its endpoint names this host)
//!       mode: bind
//!       allowed_peers: [10.0.0.6]      # only these IPs / CIDR blocks may connect (default: any)
//!       topic: kv@engine-b             # messages with another topic are refused and counted
//!       max_message_bytes: 67108864    # a peer sending a larger message is dropped (default 64 MiB)
//! ```
//!
//! Keys renamed when the schema was unified with ext-proc's (`model`, `hash_algo`, `hash_seed`,
//! `vllm_version` and `validate_hashes` on a pool, `model` on a replica, the `_ms` durations) are
//! refused with an error naming the new key.
//!
//! A bound socket accepts any peer that can reach it unless `allowed_peers` is set: with engines
//! you do not control on the network, set it, or run the engines in their default bind mode and
//! let kvroute connect.

use std::{collections::HashSet, net::SocketAddr, time::Duration};

use kvroute_block_keys::{KeyScheme, PoolKeySettings, RawKeyScheme};
use serde::Deserialize;
use serde::de::IgnoredAny;

pub use kvroute_index_core::index::VerifyHashes;
use kvroute_ingest as ingest;
use kvroute_ingest::zmtp::PeerFilter;

/// Default gRPC listen address.
pub const DEFAULT_GRPC_ADDR: &str = "127.0.0.1:50061";
/// Default admin HTTP listen address.
pub const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:9461";
/// Default interval at which the config file's modification time is checked for a reload.
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(2);
/// Default cap on blocks indexed per replica (a flood of events cannot exhaust memory).
pub const DEFAULT_MAX_BLOCKS_PER_REPLICA: usize = 1_000_000;
/// Default wait for a replay to complete before the replica is reset instead.
pub const DEFAULT_REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
pub use kvroute_block_keys::{DEFAULT_BLOCK_SIZE, DEFAULT_VLLM_VERSION, MAX_BLOCK_SIZE};
/// Default `pools[].verify_hashes`: flag replicas whose hashes disagree, index what cannot be
/// checked. `required` would refuse every mid-chain run of engines that publish u64 hashes
/// (all vLLM releases before raw digests) and every LoRA block: right for untrusted engines,
/// a silent loss of most cache hits for trusted ones.
pub const DEFAULT_VERIFY_HASHES: VerifyHashes = VerifyHashes::Flag;

/// A configuration error, naming the field and the value at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The YAML could not be parsed (syntax, unknown key, wrong type).
    #[error("invalid config: {0}")]
    Parse(#[from] serde_yaml::Error),
    /// A field has a value that is not allowed.
    #[error("invalid value for `{field}`: {value:?}: {reason}")]
    InvalidValue {
        /// Dotted path of the field, e.g. `replicas[2].events.endpoint`.
        field: String,
        /// The offending value as written.
        value: String,
        /// Why it is rejected.
        reason: String,
    },
    /// `listen.tls` is unusable (missing file, not PEM, key and certificate disagree).
    #[error("invalid TLS settings: {0}")]
    Tls(#[from] kvroute_runtime::tls::TlsError),
    /// A key of the older schema: refused, so a file never means two things.
    #[error("`{old}` is now {new}")]
    Renamed {
        /// Dotted path of the old key, e.g. `limits.replay_timeout_ms`.
        old: String,
        /// The key (and form) that replaces it.
        new: String,
    },
}

/// Refuses a key of the older schema if it is set.
fn renamed(set: bool, old: impl FnOnce() -> String, new: &str) -> Result<(), ConfigError> {
    if set {
        return Err(ConfigError::Renamed {
            old: old(),
            new: new.to_owned(),
        });
    }
    Ok(())
}

pub use kvroute_config::{DurationError, parse_duration};

/// An optional duration key: its value, or `default` when absent.
fn duration(field: &str, value: Option<&str>, default: Duration) -> Result<Duration, ConfigError> {
    value.map_or(Ok(default), |text| {
        parse_duration(text).map_err(|e| ConfigError::invalid(field, text, e.to_string()))
    })
}

impl ConfigError {
    fn invalid(field: impl Into<String>, value: impl ToString, reason: impl Into<String>) -> Self {
        ConfigError::InvalidValue {
            field: field.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

/// The file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawConfig {
    /// Listen addresses.
    pub listen: RawListen,
    /// Memory and timing limits.
    pub limits: RawLimits,
    /// One pool per served model.
    pub pools: Vec<RawPool>,
    /// Engines (one per data-parallel rank) whose events are ingested.
    pub replicas: Vec<RawReplica>,
    /// kvroute-agents allowed to stream events for the replicas they own.
    pub agents: Vec<RawAgent>,
    /// With `pools[].discovery`: one kvroute-agent per node feeds the discovered replicas on its
    /// node (its id the node name), all sharing this token. Without it the index subscribes to
    /// discovered pods directly.
    pub node_agents: Option<RawQueryAuth>,
    /// A bearer token the query API (gRPC `Match`/`ReplicaState`, admin `/v1/*`) requires.
    pub query_auth: Option<RawQueryAuth>,
    /// When `/readyz` and gRPC health say ready.
    pub readiness: RawReadiness,
    /// How often the config file's modification time is checked for a reload (`2s`).
    pub reload_interval: Option<String>,
}

/// `readiness:` section.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawReadiness {
    /// Ready replicas each pool needs (default 1; capped at the pool's replica count).
    pub min_ready_replicas: Option<usize>,
    /// Share of each pool's replicas that must be ready, 0.0–1.0 (default 0).
    pub min_ready_fraction: Option<f64>,
}

/// Default [`Readiness::min_ready_replicas`]: one caught-up replica makes a pool useful.
pub const DEFAULT_MIN_READY_REPLICAS: usize = 1;

/// When a pool counts as ready: both thresholds hold. A pool with fewer replicas than
/// `min_ready_replicas` needs all of them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Readiness {
    /// Ready replicas each pool needs.
    pub min_ready_replicas: usize,
    /// Share of each pool's replicas that must be ready.
    pub min_ready_fraction: f64,
}

impl Default for Readiness {
    fn default() -> Self {
        Readiness {
            min_ready_replicas: DEFAULT_MIN_READY_REPLICAS,
            min_ready_fraction: 0.0,
        }
    }
}

impl Readiness {
    /// Ready replicas a pool of `replicas` needs.
    pub fn required(&self, replicas: usize) -> usize {
        // The fraction is validated to 0..=1, so the product fits.
        let by_fraction = (self.min_ready_fraction * replicas as f64).ceil() as usize;
        self.min_ready_replicas.max(by_fraction).min(replicas)
    }
}

/// `query_auth:` section: where the query API's bearer token comes from (exactly one source).
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawQueryAuth {
    /// File holding the token.
    pub token_file: Option<String>,
    /// Environment variable holding the token.
    pub token_env: Option<String>,
}

/// One `agents:` entry: an agent's identity, its secret, and the replicas it may write for.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawAgent {
    /// Agent id (as in the agent's `agent_id`).
    pub id: String,
    /// File holding the agent's token.
    pub token_file: Option<String>,
    /// Environment variable holding the agent's token.
    pub token_env: Option<String>,
    /// Replica ids this agent owns; a replica fed only by an agent may omit `events.endpoint`.
    pub replicas: Vec<String>,
}

/// `listen:` section.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawListen {
    /// gRPC address (`host:port`).
    pub grpc: Option<String>,
    /// Admin HTTP address (`host:port`).
    pub admin: Option<String>,
    /// TLS on the gRPC listener (the admin HTTP server stays plaintext, for probes).
    pub tls: Option<kvroute_config::RawServerTls>,
}

/// `limits:` section.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawLimits {
    /// Blocks indexed per replica before further stores are refused.
    pub max_blocks_per_replica: Option<usize>,
    /// How long to wait for a replay before resetting the replica (`2s`).
    pub replay_timeout: Option<String>,
    /// How long an agent-fed replica may go without its agent before it is flagged stale.
    pub agent_stale_grace: Option<String>,
    /// Older spelling of `replay_timeout` (refused).
    pub replay_timeout_ms: Option<IgnoredAny>,
    /// Older spelling of `agent_stale_grace` (refused).
    pub agent_stale_grace_ms: Option<IgnoredAny>,
}

/// One `pools:` entry. `name`, `models`, `block_size` and `key_scheme` are the schema every
/// kvroute component shares (kvroute-ext-proc's pools take the same keys with the same
/// defaults); `verify_hashes` is the index's own.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawPool {
    /// Pool name (what replicas name in `pool`, and ReplicaState reports).
    pub name: String,
    /// Served model names (as in requests' `model`); Match selects the pool by them.
    pub models: Vec<String>,
    /// Tokens per KV block (the engines' `--block-size`).
    pub block_size: Option<u32>,
    /// How keys are computed: `{kind, hash_algo, seed, vllm_version}`.
    pub key_scheme: RawKeyScheme,
    /// vllm-exact pools: `off`, `flag` (default: re-hash stored blocks from their token ids
    /// and flag replicas that disagree) or `required` (also refuse every run that is not
    /// verified: mid-chain runs without a parent digest, LoRA, extra keys, mismatches).
    pub verify_hashes: Option<String>,
    /// Tokens per attention chunk of the model's chunked local attention layers (Llama 4's
    /// `attention_chunk_size`), for hybrid models with such a KV-cache group: vLLM's events do
    /// not carry it.
    pub attention_chunk_size: Option<u32>,
    /// Where the pool's replicas come from instead of `replicas:` (Kubernetes; the section
    /// kvroute-ext-proc's pools take, `kvroute_discovery::config`). Discovered replicas are
    /// subscribed to directly at their pods' KV-event ports.
    pub discovery: Option<kvroute_discovery::RawPoolDiscovery>,
    /// Older keys, refused with the new spelling.
    pub model: Option<IgnoredAny>,
    /// Older spelling of `key_scheme.hash_algo`.
    pub hash_algo: Option<IgnoredAny>,
    /// Older spelling of `key_scheme.seed`.
    pub hash_seed: Option<IgnoredAny>,
    /// Older spelling of `key_scheme.vllm_version`.
    pub vllm_version: Option<IgnoredAny>,
    /// Older spelling of `verify_hashes`.
    pub validate_hashes: Option<IgnoredAny>,
}

/// One `replicas:` entry.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawReplica {
    /// Replica id (unique; used in metrics labels and routing decisions).
    pub id: String,
    /// Name of its pool.
    pub pool: String,
    /// Where its KV events come from.
    pub events: RawEvents,
    /// Older spelling of `pool` (refused).
    pub model: Option<IgnoredAny>,
}

/// `replicas[].events:` section.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RawEvents {
    /// ZMQ endpoint of the engine's PUB socket (or where to bind for engines that connect).
    pub endpoint: String,
    /// `connect` (the engine binds, e.g. `tcp://*:5557`) or `bind` (the engine connects to us).
    pub mode: Option<String>,
    /// The engine's ROUTER replay endpoint, if it has one.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (default: everything).
    pub topic: Option<String>,
    /// Data-parallel rank this socket carries.
    pub dp_rank: Option<u32>,
    /// Bind mode: the engine addresses (IPs or CIDR blocks) that may connect; default any.
    pub allowed_peers: Option<Vec<String>>,
    /// Largest message accepted from the engine, in bytes (default 64 MiB); a peer that sends
    /// more is dropped and counted.
    pub max_message_bytes: Option<usize>,
}

/// Whether kvroute's SUB socket connects or binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketMode {
    /// Connect to an engine that binds (vLLM endpoint with `*`).
    Connect,
    /// Bind; engines connect to us (vLLM endpoint naming this host).
    Bind,
}

/// Validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// gRPC listen address.
    pub grpc_addr: SocketAddr,
    /// Admin HTTP listen address.
    pub admin_addr: SocketAddr,
    /// TLS for the gRPC listener (`None`: plaintext).
    pub tls: Option<kvroute_runtime::tls::ServerTls>,
    /// Cap on blocks per replica.
    pub max_blocks_per_replica: usize,
    /// Replay deadline.
    pub replay_timeout: Duration,
    /// Pools, in file order.
    pub pools: Vec<PoolConfig>,
    /// Replicas, in file order.
    pub replicas: Vec<ReplicaConfig>,
    /// Agents allowed to stream events, in file order.
    pub agents: Vec<AgentConfig>,
    /// `node_agents`: the token every node's agent presents; `None`: discovered replicas are
    /// subscribed to directly.
    pub node_agents: Option<kvroute_runtime::token::AgentToken>,
    /// How long an agent-fed replica may be without its agent before it leaves precise scoring.
    pub agent_stale_grace: Duration,
    /// The bearer token the query API requires (`None`: it answers anyone who can connect, so keep
    /// it on loopback or a private network).
    pub query_token: Option<kvroute_runtime::token::AgentToken>,
    /// When `/readyz` and gRPC health say ready.
    pub readiness: Readiness,
    /// How often the config file is checked for a reload.
    pub reload_interval: Duration,
}

/// A validated `agents:` entry (the token is loaded; it is never printed).
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Agent id.
    pub id: String,
    /// Its shared secret.
    pub token: kvroute_runtime::token::AgentToken,
    /// Replica ids it owns.
    pub replicas: Vec<String>,
}

/// Default [`Config::agent_stale_grace`].
pub const DEFAULT_AGENT_STALE_GRACE: Duration = Duration::from_secs(10);

/// A validated pool.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Pool name (the index's pool key).
    pub name: String,
    /// Served model names.
    pub models: Vec<String>,
    /// Tokens per block.
    pub block_size: u32,
    /// How prompts and published hashes become keys.
    pub key_scheme: KeyScheme,
    /// What is done with published block hashes (vllm-exact pools).
    pub verify_hashes: VerifyHashes,
    /// The model's chunked local attention chunk, when configured.
    pub attention_chunk_size: Option<u32>,
    /// Replicas discovered from Kubernetes instead of `replicas:`.
    pub discovery: Option<kvroute_discovery::KubernetesSource>,
}

/// A validated replica.
#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    /// Unique id.
    pub id: String,
    /// Index into [`Config::pools`].
    pub pool: usize,
    /// ZMQ endpoint; empty for a replica fed only by its agent (no direct ZMQ ingest).
    pub endpoint: String,
    /// Connect or bind.
    pub mode: SocketMode,
    /// Replay endpoint.
    pub replay_endpoint: Option<String>,
    /// Topic prefix filter.
    pub topic: String,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Bind mode: who may connect.
    pub allowed_peers: PeerFilter,
    /// Largest message accepted.
    pub max_message_bytes: usize,
    /// The node a discovered replica runs on (its node agent feeds it when `node_agents` is
    /// set); `None` for static replicas.
    pub node: Option<String>,
}

impl Config {
    /// Parses and validates a YAML document.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = serde_yaml::from_str(text)?;
        Self::validate(raw)
    }

    /// Turns the raw file into a validated config; every rule lives here.
    pub fn validate(raw: RawConfig) -> Result<Self, ConfigError> {
        let grpc_addr = parse_addr("listen.grpc", raw.listen.grpc.as_deref(), DEFAULT_GRPC_ADDR)?;
        let admin_addr = parse_addr(
            "listen.admin",
            raw.listen.admin.as_deref(),
            DEFAULT_ADMIN_ADDR,
        )?;
        if grpc_addr == admin_addr && grpc_addr.port() != 0 {
            return Err(ConfigError::invalid(
                "listen.admin",
                admin_addr,
                "must differ from listen.grpc (admin endpoints listen apart)",
            ));
        }
        let tls = raw
            .listen
            .tls
            .as_ref()
            .map(|tls| kvroute_runtime::tls::ServerTls::load(tls, "listen.tls"))
            .transpose()?;
        let max_blocks_per_replica = raw
            .limits
            .max_blocks_per_replica
            .unwrap_or(DEFAULT_MAX_BLOCKS_PER_REPLICA);
        if max_blocks_per_replica == 0 {
            return Err(ConfigError::invalid(
                "limits.max_blocks_per_replica",
                0,
                "must be at least 1",
            ));
        }
        renamed(
            raw.limits.replay_timeout_ms.is_some(),
            || "limits.replay_timeout_ms".into(),
            "`limits.replay_timeout: \"2s\"` (a duration string)",
        )?;
        renamed(
            raw.limits.agent_stale_grace_ms.is_some(),
            || "limits.agent_stale_grace_ms".into(),
            "`limits.agent_stale_grace: \"10s\"` (a duration string)",
        )?;
        let replay_timeout = duration(
            "limits.replay_timeout",
            raw.limits.replay_timeout.as_deref(),
            DEFAULT_REPLAY_TIMEOUT,
        )?;
        let agent_stale_grace = duration(
            "limits.agent_stale_grace",
            raw.limits.agent_stale_grace.as_deref(),
            DEFAULT_AGENT_STALE_GRACE,
        )?;

        if raw.pools.is_empty() {
            return Err(ConfigError::invalid(
                "pools",
                "[]",
                "at least one pool is required",
            ));
        }
        let mut pools = Vec::with_capacity(raw.pools.len());
        for (i, pool) in raw.pools.into_iter().enumerate() {
            pools.push(validate_pool(i, pool, &pools)?);
        }

        let agent_owned: HashSet<&str> = raw
            .agents
            .iter()
            .flat_map(|a| a.replicas.iter().map(String::as_str))
            .collect();
        let mut replicas = Vec::with_capacity(raw.replicas.len());
        let mut ids = HashSet::new();
        let mut bound = HashSet::new();
        for (i, replica) in raw.replicas.into_iter().enumerate() {
            let field = |name: &str| format!("replicas[{i}].{name}");
            if replica.id.is_empty() || !is_label_safe(&replica.id) {
                return Err(ConfigError::invalid(
                    field("id"),
                    &replica.id,
                    "must be non-empty and use only [A-Za-z0-9._:-]",
                ));
            }
            if !ids.insert(replica.id.clone()) {
                return Err(ConfigError::invalid(
                    field("id"),
                    &replica.id,
                    "duplicate id",
                ));
            }
            renamed(
                replica.model.is_some(),
                || field("model"),
                "`pool: <pool name>` (pools have `name` and `models`)",
            )?;
            let pool = pools
                .iter()
                .position(|p| p.name == replica.pool)
                .ok_or_else(|| {
                    ConfigError::invalid(field("pool"), &replica.pool, "no pool with this name")
                })?;
            if pools[pool].discovery.is_some() {
                return Err(ConfigError::invalid(
                    field("pool"),
                    &replica.pool,
                    "this pool discovers its replicas (pools[].discovery); a static replica cannot join it",
                ));
            }
            let events = replica.events;
            let mode = match events.mode.as_deref() {
                None | Some("connect") => SocketMode::Connect,
                Some("bind") => SocketMode::Bind,
                Some(other) => {
                    return Err(ConfigError::invalid(
                        field("events.mode"),
                        other,
                        "expected `connect` or `bind`",
                    ));
                }
            };
            let ingest_mode = match mode {
                SocketMode::Connect => ingest::SocketMode::Connect,
                SocketMode::Bind => ingest::SocketMode::Bind,
            };
            // A replica fed only by its agent needs no ZMQ endpoint here.
            let agent_fed = events.endpoint.is_empty() && agent_owned.contains(replica.id.as_str());
            let allowed_peers = if agent_fed {
                PeerFilter::any()
            } else {
                ingest::transport_settings(
                    &events.endpoint,
                    ingest_mode,
                    events.allowed_peers.as_deref(),
                )
                .map_err(|(name, reason)| {
                    let value = if name == "endpoint" {
                        events.endpoint.clone()
                    } else {
                        format!("{:?}", events.allowed_peers)
                    };
                    ConfigError::invalid(field(&format!("events.{name}")), value, reason)
                })?
            };
            let max_message_bytes = match events.max_message_bytes {
                None => ingest::DEFAULT_MAX_MESSAGE_BYTES,
                Some(0) => {
                    return Err(ConfigError::invalid(
                        field("events.max_message_bytes"),
                        0,
                        "must be positive",
                    ));
                }
                Some(bytes) => bytes,
            };
            if mode == SocketMode::Bind && !bound.insert(events.endpoint.clone()) {
                return Err(ConfigError::invalid(
                    field("events.endpoint"),
                    &events.endpoint,
                    "another replica already binds this endpoint",
                ));
            }
            if let Some(replay) = &events.replay_endpoint {
                check_endpoint(&field("events.replay_endpoint"), replay)?;
            }
            replicas.push(ReplicaConfig {
                id: replica.id,
                pool,
                endpoint: events.endpoint,
                mode,
                replay_endpoint: events.replay_endpoint,
                topic: events.topic.unwrap_or_default(),
                dp_rank: events.dp_rank.unwrap_or(0),
                allowed_peers,
                max_message_bytes,
                node: None,
            });
        }

        let agents = validate_agents(raw.agents, &ids)?;
        let node_agents = raw
            .node_agents
            .map(|raw| load_token(raw, "node_agents"))
            .transpose()?;
        if node_agents.is_some() && pools.iter().all(|p| p.discovery.is_none()) {
            return Err(ConfigError::invalid(
                "node_agents",
                "<secret source>",
                "node agents feed discovered replicas: give a pool `discovery:`",
            ));
        }
        let query_token = raw.query_auth.map(validate_query_auth).transpose()?;

        let fraction = raw.readiness.min_ready_fraction.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&fraction) {
            return Err(ConfigError::invalid(
                "readiness.min_ready_fraction",
                fraction,
                "must be between 0 and 1",
            ));
        }
        let readiness = Readiness {
            min_ready_replicas: raw
                .readiness
                .min_ready_replicas
                .unwrap_or(DEFAULT_MIN_READY_REPLICAS),
            min_ready_fraction: fraction,
        };

        let reload_interval = duration(
            "reload_interval",
            raw.reload_interval.as_deref(),
            DEFAULT_RELOAD_INTERVAL,
        )?;
        Ok(Config {
            readiness,
            reload_interval,
            grpc_addr,
            admin_addr,
            tls,
            max_blocks_per_replica,
            replay_timeout,
            pools,
            replicas,
            agents,
            node_agents,
            agent_stale_grace,
            query_token,
        })
    }
}

/// Agents: unique ids, exactly one token source (loaded now), replicas that exist and have one
/// owner each.
/// `query_auth`: exactly one token source; the token must fit an `authorization` header.
fn validate_query_auth(
    raw: RawQueryAuth,
) -> Result<kvroute_runtime::token::AgentToken, ConfigError> {
    let field = if raw.token_env.is_some() && raw.token_file.is_none() {
        "query_auth.token_env"
    } else {
        "query_auth.token_file"
    };
    let token = load_token(raw, "query_auth")?;
    if !token.expose().bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::invalid(
            field,
            "<secret>",
            "the token must be printable ASCII without spaces (it travels in a header)",
        ));
    }
    Ok(token)
}

/// A `{token_file | token_env}` section (`section` names it in errors): exactly one source,
/// loaded now.
fn load_token(
    raw: RawQueryAuth,
    section: &str,
) -> Result<kvroute_runtime::token::AgentToken, ConfigError> {
    use kvroute_config::TokenSource;
    use kvroute_runtime::token::AgentToken;
    let (source, field) = match (raw.token_file, raw.token_env) {
        (Some(path), None) => (TokenSource::File(path), format!("{section}.token_file")),
        (None, Some(name)) => (TokenSource::Env(name), format!("{section}.token_env")),
        _ => {
            return Err(ConfigError::invalid(
                format!("{section}.token_file"),
                "<secret source>",
                "give exactly one of token_file or token_env",
            ));
        }
    };
    AgentToken::load(&source)
        .map_err(|e| ConfigError::invalid(field, "<secret source>", e.to_string()))
}

fn validate_agents(
    raw: Vec<RawAgent>,
    replica_ids: &HashSet<String>,
) -> Result<Vec<AgentConfig>, ConfigError> {
    use kvroute_config::TokenSource;
    use kvroute_runtime::token::AgentToken;
    let mut agents: Vec<AgentConfig> = Vec::with_capacity(raw.len());
    let mut owned = HashSet::new();
    for (i, agent) in raw.into_iter().enumerate() {
        let field = |name: &str| format!("agents[{i}].{name}");
        if agent.id.is_empty() || agents.iter().any(|a| a.id == agent.id) {
            return Err(ConfigError::invalid(
                field("id"),
                &agent.id,
                "must be non-empty and unique",
            ));
        }
        let source = match (agent.token_file, agent.token_env) {
            (Some(path), None) => TokenSource::File(path),
            (None, Some(name)) => TokenSource::Env(name),
            _ => {
                return Err(ConfigError::invalid(
                    field("token_file"),
                    "",
                    "give exactly one of token_file or token_env",
                ));
            }
        };
        let token = AgentToken::load(&source).map_err(|e| {
            ConfigError::invalid(field("token_file"), "<secret source>", e.to_string())
        })?;
        let max = kvroute_index_api::agent_protocol::MAX_REPLICAS_PER_HELLO;
        if agent.replicas.len() > max {
            return Err(ConfigError::invalid(
                field("replicas"),
                agent.replicas.len(),
                format!("an agent may own at most {max} replicas (one Hello claims them all)"),
            ));
        }
        for replica in &agent.replicas {
            if !replica_ids.contains(replica) {
                return Err(ConfigError::invalid(
                    field("replicas"),
                    replica,
                    "no such replica",
                ));
            }
            if !owned.insert(replica.clone()) {
                return Err(ConfigError::invalid(
                    field("replicas"),
                    replica,
                    "already owned by another agent",
                ));
            }
        }
        agents.push(AgentConfig {
            id: agent.id,
            token,
            replicas: agent.replicas,
        });
    }
    Ok(agents)
}

fn validate_pool(
    i: usize,
    pool: RawPool,
    earlier: &[PoolConfig],
) -> Result<PoolConfig, ConfigError> {
    let field = |name: &str| format!("pools[{i}].{name}");
    for (old, set, new) in [
        (
            "model",
            pool.model.is_some(),
            "`name: <pool name>` and `models: [<served model>, …]`",
        ),
        (
            "hash_algo",
            pool.hash_algo.is_some(),
            "`key_scheme.hash_algo`",
        ),
        ("hash_seed", pool.hash_seed.is_some(), "`key_scheme.seed`"),
        (
            "vllm_version",
            pool.vllm_version.is_some(),
            "`key_scheme.vllm_version`",
        ),
        (
            "validate_hashes",
            pool.validate_hashes.is_some(),
            "`verify_hashes: off | flag | required`",
        ),
    ] {
        renamed(set, || field(old), new)?;
    }
    if pool.name.is_empty() {
        return Err(ConfigError::invalid(field("name"), "", "must be non-empty"));
    }
    if earlier.iter().any(|p| p.name == pool.name) {
        return Err(ConfigError::invalid(
            field("name"),
            &pool.name,
            "duplicate pool name",
        ));
    }
    if pool.models.is_empty() || pool.models.iter().any(String::is_empty) {
        return Err(ConfigError::invalid(
            field("models"),
            format!("{:?}", pool.models),
            "name at least one served model, none empty",
        ));
    }
    for model in &pool.models {
        if earlier.iter().any(|p| p.models.contains(model)) {
            return Err(ConfigError::invalid(
                field("models"),
                model,
                "model served by two pools",
            ));
        }
    }
    let keys = PoolKeySettings::from_raw(pool.block_size, &pool.key_scheme)
        .map_err(|e| ConfigError::invalid(field(e.field), e.value, e.reason))?;
    let verify_hashes = match pool.verify_hashes.as_deref() {
        None => DEFAULT_VERIFY_HASHES,
        Some("off") => VerifyHashes::Off,
        Some("flag") => VerifyHashes::Flag,
        Some("required") => VerifyHashes::Required,
        Some(other) => {
            return Err(ConfigError::invalid(
                field("verify_hashes"),
                other,
                "expected `off`, `flag` or `required`",
            ));
        }
    };
    if verify_hashes == VerifyHashes::Required && keys.scheme == KeyScheme::TokenChain {
        return Err(ConfigError::invalid(
            field("verify_hashes"),
            "required",
            "token-chain pools compute their keys from token ids and use no published hash; \
             `required` applies to vllm-exact pools",
        ));
    }
    if pool.attention_chunk_size == Some(0) {
        return Err(ConfigError::invalid(
            field("attention_chunk_size"),
            "0",
            "the chunk of chunked local attention, in tokens: leave it out or give a positive size",
        ));
    }
    let discovery = match pool.discovery {
        None => None,
        Some(kvroute_discovery::RawPoolDiscovery { kubernetes: None }) => {
            return Err(ConfigError::invalid(
                field("discovery.kubernetes"),
                "",
                "required (the one discovery source)",
            ));
        }
        Some(kvroute_discovery::RawPoolDiscovery {
            kubernetes: Some(kubernetes),
        }) => Some(
            kvroute_discovery::KubernetesSource::try_from(kubernetes).map_err(|e| {
                ConfigError::invalid(
                    field(&format!("discovery.kubernetes.{}", e.field)),
                    e.value,
                    e.reason,
                )
            })?,
        ),
    };
    Ok(PoolConfig {
        name: pool.name,
        models: pool.models,
        block_size: keys.block_size,
        key_scheme: keys.scheme,
        verify_hashes,
        attention_chunk_size: pool.attention_chunk_size,
        discovery,
    })
}

impl ReplicaConfig {
    /// A replica discovery found (`pools[pool].discovery`): kvroute connects to its pod's
    /// KV-event PUB socket and replay ROUTER, with the defaults a static replica gets — or, with
    /// `node_agent_fed`, opens no socket: its node's agent feeds it. `Err` names what is wrong
    /// with the endpoints the pod's annotations produced.
    pub fn discovered(
        pool: usize,
        replica: &kvroute_discovery::Replica,
        node_agent_fed: bool,
    ) -> Result<ReplicaConfig, String> {
        if !is_label_safe(&replica.id) {
            return Err(format!("replica id {:?} is not label-safe", replica.id));
        }
        if node_agent_fed {
            let Some(node) = replica.node.clone() else {
                return Err("the pod names no node, so no node agent can feed it".to_owned());
            };
            return Ok(ReplicaConfig {
                id: replica.id.clone(),
                pool,
                endpoint: String::new(),
                mode: SocketMode::Connect,
                replay_endpoint: None,
                topic: String::new(),
                dp_rank: 0,
                allowed_peers: PeerFilter::any(),
                max_message_bytes: ingest::DEFAULT_MAX_MESSAGE_BYTES,
                node: Some(node),
            });
        }
        let allowed_peers =
            ingest::transport_settings(&replica.kv_events, ingest::SocketMode::Connect, None)
                .map_err(|(name, reason)| format!("{name} {}: {reason}", replica.kv_events))?;
        if let Some(replay) = &replica.kv_replay {
            check_endpoint("replay_endpoint", replay).map_err(|e| e.to_string())?;
        }
        Ok(ReplicaConfig {
            id: replica.id.clone(),
            pool,
            endpoint: replica.kv_events.clone(),
            mode: SocketMode::Connect,
            replay_endpoint: replica.kv_replay.clone(),
            topic: replica.kv_topic.clone(),
            dp_rank: 0,
            allowed_peers,
            max_message_bytes: ingest::DEFAULT_MAX_MESSAGE_BYTES,
            node: replica.node.clone(),
        })
    }
}

fn parse_addr(field: &str, value: Option<&str>, default: &str) -> Result<SocketAddr, ConfigError> {
    let value = value.unwrap_or(default);
    value
        .parse()
        .map_err(|_| ConfigError::invalid(field, value, "expected ip:port"))
}

fn check_endpoint(field: &str, endpoint: &str) -> Result<(), ConfigError> {
    kvroute_ingest::zmtp::Endpoint::parse(endpoint)
        .map(drop)
        .map_err(|error| ConfigError::invalid(field, endpoint, error.to_string()))
}

/// Replica ids become metric label values; keep them to a safe alphabet.
fn is_label_safe(id: &str) -> bool {
    id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
listen: {grpc: "127.0.0.1:0", admin: "127.0.0.1:0"}
pools:
  - {name: tiny, models: [tiny], block_size: 32, key_scheme: {kind: vllm-exact, hash_algo: sha256_cbor, seed: "0"}}
  - {name: other, models: [other, other-alias], key_scheme: {kind: token-chain}}
replicas:
  - id: a
    pool: tiny
    events: {endpoint: "tcp://127.0.0.1:5557", replay_endpoint: "tcp://127.0.0.1:5558"}
  - id: b
    pool: other
    events: {endpoint: "tcp://127.0.0.1:6000", mode: bind, topic: "kv@"}
"#;

    #[test]
    fn query_auth_is_optional_and_validated() {
        assert!(Config::from_yaml(GOOD).unwrap().query_token.is_none());
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "q-secret\n").unwrap();
        let with = |section: &str| format!("{GOOD}query_auth: {section}\n");
        let config =
            Config::from_yaml(&with(&format!("{{token_file: \"{}\"}}", file.display()))).unwrap();
        assert!(config.query_token.unwrap().matches("q-secret"));
        let spaced = dir.path().join("spaced");
        std::fs::write(&spaced, "two words\n").unwrap();
        for (section, field) in [
            ("{}".to_owned(), "query_auth.token_file"),
            (
                "{token_file: /nonexistent/token}".to_owned(),
                "query_auth.token_file",
            ),
            (
                format!("{{token_file: \"{}\"}}", spaced.display()),
                "query_auth.token_file",
            ),
            (
                "{token_file: a, token_env: B}".to_owned(),
                "query_auth.token_file",
            ),
        ] {
            let error = Config::from_yaml(&with(&section)).unwrap_err().to_string();
            assert!(error.contains(field), "{section}: {error}");
        }
    }

    #[test]
    fn parses_a_good_config() {
        let config = Config::from_yaml(GOOD).unwrap();
        assert_eq!(config.pools.len(), 2);
        assert_eq!(config.pools[0].block_size, 32);
        assert_eq!(config.pools[1].block_size, DEFAULT_BLOCK_SIZE);
        assert_eq!(config.pools[1].key_scheme, KeyScheme::TokenChain);
        assert_eq!(config.pools[1].models, ["other", "other-alias"]);
        assert_eq!(config.replicas[1].pool, 1);
        assert_eq!(config.replicas[1].mode, SocketMode::Bind);
        assert!(config.replicas[1].allowed_peers.is_open());
        assert_eq!(
            config.replicas[1].max_message_bytes,
            ingest::DEFAULT_MAX_MESSAGE_BYTES
        );
        assert_eq!(
            config.replicas[0].replay_endpoint.as_deref(),
            Some("tcp://127.0.0.1:5558")
        );
        assert_eq!(
            config.max_blocks_per_replica,
            DEFAULT_MAX_BLOCKS_PER_REPLICA
        );
    }

    #[test]
    fn verify_hashes_defaults_to_flag() {
        let verify = |pool: &str| {
            Config::from_yaml(&format!("pools: [{{name: p, models: [m]{pool}}}]"))
                .unwrap()
                .pools[0]
                .verify_hashes
        };
        assert_eq!(verify(""), VerifyHashes::Flag);
        assert_eq!(verify(", verify_hashes: off"), VerifyHashes::Off);
        assert_eq!(verify(", verify_hashes: flag"), VerifyHashes::Flag);
        assert_eq!(verify(", verify_hashes: required"), VerifyHashes::Required);
    }

    #[test]
    fn attention_chunk_size_is_optional_and_positive() {
        let chunk = |pool: &str| {
            Config::from_yaml(&format!("pools: [{{name: p, models: [m]{pool}}}]"))
                .map(|config| config.pools[0].attention_chunk_size)
                .map_err(|e| e.to_string())
        };
        assert_eq!(chunk(""), Ok(None));
        assert_eq!(chunk(", attention_chunk_size: 8192"), Ok(Some(8192)));
        let error = chunk(", attention_chunk_size: 0").unwrap_err();
        assert!(error.contains("pools[0].attention_chunk_size"), "{error}");
    }

    #[test]
    fn durations_are_strings() {
        let config = Config::from_yaml(
            "limits: {replay_timeout: 500ms, agent_stale_grace: 1m}\npools: [{name: p, models: [m]}]",
        )
        .unwrap();
        assert_eq!(config.replay_timeout, Duration::from_millis(500));
        assert_eq!(config.agent_stale_grace, Duration::from_secs(60));
        let defaults = Config::from_yaml("pools: [{name: p, models: [m]}]").unwrap();
        assert_eq!(defaults.replay_timeout, DEFAULT_REPLAY_TIMEOUT);
        assert_eq!(defaults.agent_stale_grace, DEFAULT_AGENT_STALE_GRACE);
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("500us"), Ok(Duration::from_micros(500)));
        for bad in ["5", "-1s", "1h", "", "ms", "1.2.3s"] {
            assert_eq!(parse_duration(bad), Err(DurationError), "{bad}");
        }
    }

    #[test]
    fn keys_of_the_older_schema_are_refused_by_their_new_name() {
        let pool = "{name: p, models: [m]}";
        for (yaml, message) in [
            (
                format!("limits: {{replay_timeout_ms: 500}}\npools: [{pool}]"),
                "`limits.replay_timeout_ms` is now `limits.replay_timeout: \"2s\"`",
            ),
            (
                format!("limits: {{agent_stale_grace_ms: 500}}\npools: [{pool}]"),
                "`limits.agent_stale_grace_ms` is now `limits.agent_stale_grace: \"10s\"`",
            ),
            (
                "pools: [{model: m}]".to_owned(),
                "`pools[0].model` is now `name: <pool name>` and `models: [<served model>, …]`",
            ),
            (
                "pools: [{name: p, models: [m], hash_algo: sha256}]".to_owned(),
                "`pools[0].hash_algo` is now `key_scheme.hash_algo`",
            ),
            (
                "pools: [{name: p, models: [m], hash_seed: '0'}]".to_owned(),
                "`pools[0].hash_seed` is now `key_scheme.seed`",
            ),
            (
                "pools: [{name: p, models: [m], vllm_version: 0.32.0}]".to_owned(),
                "`pools[0].vllm_version` is now `key_scheme.vllm_version`",
            ),
            (
                "pools: [{name: p, models: [m], validate_hashes: true}]".to_owned(),
                "`pools[0].validate_hashes` is now `verify_hashes: off | flag | required`",
            ),
            (
                "pools: [{name: p, models: [m], key_scheme: vllm-exact}]".to_owned(),
                "`key_scheme: vllm-exact` is now `key_scheme: {kind: vllm-exact}`",
            ),
            (
                format!(
                    "pools: [{pool}]\nreplicas: [{{id: a, model: m, events: {{endpoint: 'tcp://h:1'}}}}]"
                ),
                "`replicas[0].model` is now `pool: <pool name>`",
            ),
        ] {
            let error = error_of(&yaml);
            assert!(error.contains(message), "{yaml}: {error}");
        }
    }

    fn error_of(yaml: &str) -> String {
        Config::from_yaml(yaml).unwrap_err().to_string()
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_name() {
        let err = error_of("pools: [{name: p, models: [m], blocksize: 16}]");
        assert!(err.contains("blocksize"), "{err}");
    }

    #[test]
    fn bad_values_name_the_field() {
        let cases = [
            ("pools: []", "pools"),
            (
                "pools: [{name: p, models: [m], block_size: 0}]",
                "pools[0].block_size",
            ),
            (
                "pools: [{name: p, models: [m], key_scheme: {kind: exact}}]",
                "pools[0].key_scheme.kind",
            ),
            (
                "pools: [{name: p, models: [m], key_scheme: {hash_algo: md5}}]",
                "pools[0].key_scheme.hash_algo",
            ),
            (
                "pools: [{name: p, models: [m], key_scheme: {hash_algo: xxhash}}]",
                "pools[0].key_scheme.seed",
            ),
            (
                "pools: [{name: p, models: [m], key_scheme: {vllm_version: banana}}]",
                "pools[0].key_scheme.vllm_version",
            ),
            (
                "pools: [{name: p, models: [m]}, {name: p, models: [n]}]",
                "pools[1].name",
            ),
            (
                "pools: [{name: p, models: [m], verify_hashes: always}]",
                "pools[0].verify_hashes",
            ),
            (
                "pools: [{name: p, models: [m], key_scheme: {kind: token-chain}, verify_hashes: required}]",
                "pools[0].verify_hashes",
            ),
            (
                "pools: [{name: p, models: [m]}, {name: q, models: [m]}]",
                "pools[1].models",
            ),
            ("pools: [{name: p}]", "pools[0].models"),
            (
                "listen: {grpc: nope}\npools: [{name: m, models: [m]}]",
                "listen.grpc",
            ),
            (
                "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: x, events: {endpoint: 'tcp://h:1'}}]",
                "replicas[0].pool",
            ),
            (
                "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: m, events: {endpoint: 'h:1'}}]",
                "replicas[0].events.endpoint",
            ),
            (
                "pools: [{name: m, models: [m]}]\nreplicas: [{id: 'a b', pool: m, events: {endpoint: 'tcp://h:1'}}]",
                "replicas[0].id",
            ),
            (
                "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: m, events: {endpoint: 'tcp://h:1'}}, {id: a, pool: m, events: {endpoint: 'tcp://h:2'}}]",
                "replicas[1].id",
            ),
            (
                "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: m, events: {endpoint: 'tcp://h:1', mode: pull}}]",
                "replicas[0].events.mode",
            ),
            (
                "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: m, events: {endpoint: 'tcp://h:1', allowed_peers: [10.0.0.1]}}]",
                "replicas[0].events.allowed_peers",
            ),
            (
                "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: m, events: {endpoint: 'tcp://0.0.0.0:1', mode: bind, allowed_peers: [10.0.0.0/33]}}]",
                "replicas[0].events.allowed_peers",
            ),
            (
                "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: m, events: {endpoint: 'ipc:///tmp/kv', mode: bind, allowed_peers: [10.0.0.1]}}]",
                "replicas[0].events.allowed_peers",
            ),
            (
                "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: m, events: {endpoint: 'tcp://0.0.0.0:1', mode: bind, allowed_peers: []}}]",
                "replicas[0].events.allowed_peers",
            ),
            (
                "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: m, events: {endpoint: 'inproc://kv'}}]",
                "replicas[0].events.endpoint",
            ),
            (
                "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: m, events: {endpoint: 'tcp://h:1', max_message_bytes: 0}}]",
                "replicas[0].events.max_message_bytes",
            ),
        ];
        for (yaml, field) in cases {
            let err = error_of(yaml);
            assert!(err.contains(&format!("`{field}`")), "{yaml}: {err}");
        }
    }
}
