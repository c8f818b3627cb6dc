//! `kvroute-index` configuration: YAML → [`RawConfig`] (`raw.rs`: every key, its default and
//! meaning; reference in `docs/configuration.md`) → validated [`Config`].
//!
//! Values wrong on their own (a duration, an address, an endpoint, an unknown key) are refused
//! while deserializing; the rules between fields live in [`Config::validate`]. Every error is a
//! [`ConfigError`] naming the field path (`replicas[0].events.mode: ...`).
//!
//! Keys renamed when the schema was unified with ext-proc's (`model`, `hash_algo`, `hash_seed`,
//! `vllm_version` and `validate_hashes` on a pool, `model` on a replica, the `_ms` durations) are
//! refused with an error naming the new key.

mod raw;
#[cfg(test)]
mod tests;

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    time::Duration,
};

use kvroute_block_keys::{KeyScheme, PoolKeySettings};
use kvroute_config::{ConfigError, Engine, SocketMode, TokenSource, ZmqEndpoint};
use kvroute_index_core::index::VerifyHashes;
use kvroute_ingest::zmtp::PeerFilter;
use kvroute_runtime::token::AgentToken;

pub use raw::{RawAgent, RawConfig, RawLimits, RawListen, RawPool, RawReadiness, RawReplica};

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
/// Default [`Config::agent_stale_grace`].
pub const DEFAULT_AGENT_STALE_GRACE: Duration = Duration::from_secs(10);
/// Default `pools[].verify_hashes`: flag replicas whose hashes disagree, index what cannot be
/// checked. `required` would refuse every mid-chain run of engines that publish u64 hashes
/// (all vLLM releases before raw digests) and every LoRA block: right for untrusted engines,
/// a silent loss of most cache hits for trusted ones.
pub const DEFAULT_VERIFY_HASHES: VerifyHashes = VerifyHashes::Flag;
/// Default [`Readiness::min_ready_replicas`]: one caught-up replica makes a pool useful.
pub const DEFAULT_MIN_READY_REPLICAS: usize = 1;
/// Default [`Readiness::min_ready_fraction`]: no share required beyond `min_ready_replicas`.
pub const DEFAULT_MIN_READY_FRACTION: f64 = 0.0;

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
            min_ready_fraction: DEFAULT_MIN_READY_FRACTION,
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
    pub node_agents: Option<AgentToken>,
    /// How long an agent-fed replica may be without its agent before it leaves precise scoring.
    pub agent_stale_grace: Duration,
    /// The bearer token the query API requires (`None`: it answers anyone who can connect, so keep
    /// it on loopback or a private network).
    pub query_token: Option<AgentToken>,
    /// When `/readyz` and gRPC health say ready.
    pub readiness: Readiness,
    /// How often the config file is checked for a reload.
    pub reload_interval: Duration,
    /// `log.format` (read at start).
    pub log_format: kvroute_config::LogFormat,
}

/// A validated `agents:` entry (the token is loaded; it is never printed).
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Agent id.
    pub id: String,
    /// Its shared secret.
    pub token: AgentToken,
    /// Replica ids it owns.
    pub replicas: Vec<String>,
}

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
    /// Whether kvroute derived this socket's rank (one of `data_parallel_size` ranks): batches
    /// naming another rank are then refused.
    pub dp_rank_checked: bool,
    /// Bind mode: who may connect.
    pub allowed_peers: PeerFilter,
    /// Largest message accepted.
    pub max_message_bytes: usize,
    /// Cap on the delay between attempts to re-open a failed event socket.
    pub reconnect_backoff_max: Duration,
    /// The engine family publishing (which wire decoder reads it).
    pub engine: Engine,
    /// The node a discovered replica runs on (its node agent feeds it when `node_agents` is
    /// set); `None` for static replicas.
    pub node: Option<String>,
}

impl Config {
    /// Parses and validates a YAML document.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        Self::validate(kvroute_config::from_yaml(text)?)
    }

    /// Turns the raw file into a validated config: the rules between fields (and the files
    /// the config names: tokens, TLS material) are checked here.
    pub fn validate(raw: RawConfig) -> Result<Self, ConfigError> {
        let grpc_addr = listen_addr("listen.grpc", raw.listen.grpc, DEFAULT_GRPC_ADDR)?;
        let admin_addr = listen_addr("listen.admin", raw.listen.admin, DEFAULT_ADMIN_ADDR)?;
        if grpc_addr == admin_addr && grpc_addr.port() != 0 {
            return Err(ConfigError::at(
                "listen.admin",
                format_args!(
                    "must differ from listen.grpc (admin endpoints listen apart; got {admin_addr})"
                ),
            ));
        }
        let tls = raw
            .listen
            .tls
            .as_ref()
            .map(|tls| kvroute_runtime::tls::ServerTls::load(tls, "listen.tls"))
            .transpose()
            .map_err(|e| ConfigError::load(e.field(), e.reason()))?;
        for (set, old, new) in [
            (
                raw.limits.replay_timeout_ms.is_some(),
                "limits.replay_timeout_ms",
                "`limits.replay_timeout: \"2s\"` (a duration string)",
            ),
            (
                raw.limits.agent_stale_grace_ms.is_some(),
                "limits.agent_stale_grace_ms",
                "`limits.agent_stale_grace: \"10s\"` (a duration string)",
            ),
        ] {
            if set {
                return Err(ConfigError::renamed(old, new));
            }
        }

        if raw.pools.is_empty() {
            return Err(ConfigError::at("pools", "at least one pool is required"));
        }
        let mut pools = Vec::with_capacity(raw.pools.len());
        for (i, pool) in raw.pools.into_iter().enumerate() {
            let pool = validate_pool(pool, &pools).map_err(|e| e.within(&format!("pools[{i}]")))?;
            pools.push(pool);
        }

        let agent_owned: HashSet<&str> = raw
            .agents
            .iter()
            .flat_map(|a| a.replicas.iter().map(String::as_str))
            .collect();
        let mut replicas = Vec::with_capacity(raw.replicas.len());
        let mut ids = HashMap::new();
        let mut bound = HashSet::new();
        for (i, replica) in raw.replicas.into_iter().enumerate() {
            let ranks = validate_replica(replica, &pools, &agent_owned, &mut ids, &mut bound)
                .map_err(|e| e.within(&format!("replicas[{i}]")))?;
            replicas.extend(ranks);
        }

        let agents = validate_agents(raw.agents, &ids)?;
        let node_agents = raw
            .node_agents
            .map(|raw| load_token(raw.source(), "node_agents"))
            .transpose()?;
        if node_agents.is_some() && pools.iter().all(|p| p.discovery.is_none()) {
            return Err(ConfigError::at(
                "node_agents",
                "node agents feed discovered replicas: give a pool `discovery:`",
            ));
        }
        let query_token = raw
            .query_auth
            .map(|raw| {
                let source = raw.source();
                let token = load_token(source.clone(), "query_auth")?;
                if !token.expose().bytes().all(|b| b.is_ascii_graphic()) {
                    let key = source.map_or("token_file", |s| s.key());
                    return Err(ConfigError::at(
                        format!("query_auth.{key}"),
                        "the token must be printable ASCII without spaces (it travels in a header)",
                    ));
                }
                Ok(token)
            })
            .transpose()?;

        let min_ready_fraction = raw
            .readiness
            .min_ready_fraction
            .unwrap_or(DEFAULT_MIN_READY_FRACTION);
        if !(0.0..=1.0).contains(&min_ready_fraction) {
            return Err(ConfigError::at(
                "readiness.min_ready_fraction",
                format_args!("must be between 0 and 1 (got {min_ready_fraction})"),
            ));
        }
        let readiness = Readiness {
            min_ready_replicas: raw
                .readiness
                .min_ready_replicas
                .unwrap_or(DEFAULT_MIN_READY_REPLICAS),
            min_ready_fraction,
        };
        Ok(Config {
            log_format: raw.log.format(),
            readiness,
            reload_interval: raw
                .reload_interval
                .map_or(DEFAULT_RELOAD_INTERVAL, |d| d.get()),
            grpc_addr,
            admin_addr,
            tls,
            max_blocks_per_replica: raw
                .limits
                .max_blocks_per_replica
                .map_or(DEFAULT_MAX_BLOCKS_PER_REPLICA, std::num::NonZeroUsize::get),
            replay_timeout: raw
                .limits
                .replay_timeout
                .map_or(DEFAULT_REPLAY_TIMEOUT, |d| d.get()),
            pools,
            replicas,
            agents,
            node_agents,
            agent_stale_grace: raw
                .limits
                .agent_stale_grace
                .map_or(DEFAULT_AGENT_STALE_GRACE, |d| d.get()),
            query_token,
        })
    }
}

/// A listen address, or its default (a constant that parses: an error rather than a panic if
/// it ever did not).
fn listen_addr(
    field: &str,
    value: Option<kvroute_config::ListenAddr>,
    default: &str,
) -> Result<SocketAddr, ConfigError> {
    match value {
        Some(addr) => Ok(addr.get()),
        None => default
            .parse()
            .map_err(|_| ConfigError::at(field, format_args!("default {default} is not ip:port"))),
    }
}

/// A token section (`section` places its errors): exactly one source, loaded now.
fn load_token(
    source: Result<TokenSource, ConfigError>,
    section: &str,
) -> Result<AgentToken, ConfigError> {
    let source = source.map_err(|e| e.within(section))?;
    AgentToken::load(&source)
        .map_err(|e| ConfigError::load(format!("{section}.{}", source.key()), e))
}

/// One `replicas:` entry, paths relative to it: the replica, or each of its data-parallel ranks
/// (`events.data_parallel_size`), as replica `<id>@dp<rank>` fed by that rank's sockets. `ids`
/// gathers each configured id with its rank count.
fn validate_replica(
    replica: RawReplica,
    pools: &[PoolConfig],
    agent_owned: &HashSet<&str>,
    ids: &mut HashMap<String, u32>,
    bound: &mut HashSet<String>,
) -> Result<Vec<ReplicaConfig>, ConfigError> {
    if replica.id.is_empty() || !is_label_safe(&replica.id) {
        return Err(ConfigError::at(
            "id",
            format_args!(
                "must be non-empty and use only [A-Za-z0-9._:-] (got {:?})",
                replica.id
            ),
        ));
    }
    if ids.contains_key(&replica.id) {
        return Err(ConfigError::at(
            "id",
            format_args!("duplicate id {:?}", replica.id),
        ));
    }
    if replica.model.is_some() {
        return Err(ConfigError::renamed(
            "model",
            "`pool: <pool name>` (pools have `name` and `models`)",
        ));
    }
    let pool = pools
        .iter()
        .position(|p| p.name == replica.pool)
        .ok_or_else(|| ConfigError::at("pool", format_args!("no pool named {:?}", replica.pool)))?;
    if pools[pool].discovery.is_some() {
        return Err(ConfigError::at(
            "pool",
            "this pool discovers its replicas (pools[].discovery); a static replica cannot join it",
        ));
    }
    let events = replica.events;
    check_engine(events.engine, &pools[pool].key_scheme).map_err(|e| e.within("events"))?;
    let ranks = events.data_parallel_ranks();
    // A replica fed only by its agent needs no ZMQ endpoint here.
    let agent_fed = events.endpoint.is_none() && agent_owned.contains(replica.id.as_str());
    let allowed_peers = if agent_fed {
        kvroute_config::check_data_parallel_size(ranks)
            .map_err(|reason| ConfigError::at("events.data_parallel_size", reason))?;
        PeerFilter::any()
    } else {
        events.check().map_err(|e| e.within("events"))?;
        events
            .allowed_peers
            .as_deref()
            .map_or_else(PeerFilter::any, PeerFilter::from_peers)
    };
    ids.insert(replica.id.clone(), ranks);
    let mut configs = Vec::with_capacity(ranks as usize);
    for rank in 0..ranks {
        let (endpoint, replay_endpoint) = events.rank_endpoints(rank);
        if events.mode == SocketMode::Bind && !bound.insert(endpoint.clone()) {
            return Err(ConfigError::at(
                "events.endpoint",
                format_args!("another replica already binds {endpoint}"),
            ));
        }
        let (id, dp_rank) = if ranks > 1 {
            (kvroute_config::rank_replica_id(&replica.id, rank), rank)
        } else {
            (replica.id.clone(), events.dp_rank)
        };
        configs.push(ReplicaConfig {
            id,
            pool,
            endpoint,
            mode: events.mode,
            max_message_bytes: events.max_message_bytes_or_default(),
            reconnect_backoff_max: events.reconnect_backoff_max_or_default(),
            replay_endpoint,
            topic: events.topic.clone(),
            dp_rank,
            dp_rank_checked: ranks > 1,
            allowed_peers: allowed_peers.clone(),
            engine: events.engine,
            node: None,
        });
    }
    Ok(configs)
}

/// A pool keyed by one engine's published hashes takes only that engine's replicas.
fn check_engine(engine: Engine, scheme: &KeyScheme) -> Result<(), ConfigError> {
    let Some(expected) = scheme.engine().filter(|&own| own != engine) else {
        return Ok(());
    };
    Err(ConfigError::at(
        "engine",
        format_args!(
            "the pool's key_scheme uses {} engines' own hashes (got {}; key_scheme kind \
             token-chain serves either)",
            expected.as_label(),
            engine.as_label()
        ),
    ))
}

/// Agents: unique ids, exactly one token source (loaded now), replicas that exist and have one
/// owner each.
fn validate_agents(
    raw: Vec<RawAgent>,
    replica_ids: &HashMap<String, u32>,
) -> Result<Vec<AgentConfig>, ConfigError> {
    let mut agents: Vec<AgentConfig> = Vec::with_capacity(raw.len());
    let mut owned = HashSet::new();
    for (i, agent) in raw.into_iter().enumerate() {
        let section = format!("agents[{i}]");
        let field = |name: &str| format!("{section}.{name}");
        if agent.id.is_empty() || agents.iter().any(|a| a.id == agent.id) {
            return Err(ConfigError::at(
                field("id"),
                format_args!("must be non-empty and unique (got {:?})", agent.id),
            ));
        }
        let source =
            TokenSource::from_keys(agent.token_file.as_deref(), agent.token_env.as_deref());
        let token = load_token(source, &section)?;
        // Owning a replica with data-parallel ranks is owning each rank (the agent streams
        // every rank as replica `<id>@dp<rank>`).
        let mut replicas = Vec::with_capacity(agent.replicas.len());
        for replica in &agent.replicas {
            let Some(&ranks) = replica_ids.get(replica) else {
                return Err(ConfigError::at(
                    field("replicas"),
                    format_args!("no such replica {replica:?}"),
                ));
            };
            if !owned.insert(replica.clone()) {
                return Err(ConfigError::at(
                    field("replicas"),
                    format_args!("{replica:?} is already owned by another agent"),
                ));
            }
            if ranks > 1 {
                replicas.extend((0..ranks).map(|r| kvroute_config::rank_replica_id(replica, r)));
            } else {
                replicas.push(replica.clone());
            }
        }
        let max = kvroute_index_api::agent_protocol::MAX_REPLICAS_PER_HELLO;
        if replicas.len() > max {
            return Err(ConfigError::at(
                field("replicas"),
                format_args!(
                    "an agent may own at most {max} replicas, data-parallel ranks counted one \
                     by one (one Hello claims them all; got {})",
                    replicas.len()
                ),
            ));
        }
        agents.push(AgentConfig {
            id: agent.id,
            token,
            replicas,
        });
    }
    Ok(agents)
}

/// One `pools:` entry; paths relative to it.
fn validate_pool(pool: RawPool, earlier: &[PoolConfig]) -> Result<PoolConfig, ConfigError> {
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
        if set {
            return Err(ConfigError::renamed(old, new));
        }
    }
    if pool.name.is_empty() {
        return Err(ConfigError::at("name", "must be non-empty"));
    }
    if earlier.iter().any(|p| p.name == pool.name) {
        return Err(ConfigError::at(
            "name",
            format_args!("duplicate pool name {:?}", pool.name),
        ));
    }
    if pool.models.is_empty() || pool.models.iter().any(String::is_empty) {
        return Err(ConfigError::at(
            "models",
            format_args!(
                "name at least one served model, none empty (got {:?})",
                pool.models
            ),
        ));
    }
    for model in &pool.models {
        if earlier.iter().any(|p| p.models.contains(model)) {
            return Err(ConfigError::at(
                "models",
                format_args!("model {model:?} served by two pools"),
            ));
        }
    }
    let keys = PoolKeySettings::from_raw(pool.block_size, &pool.key_scheme)
        .map_err(|e| ConfigError::at(e.field, format_args!("{} (got {:?})", e.reason, e.value)))?;
    let verify_hashes = pool.verify_hashes.unwrap_or(DEFAULT_VERIFY_HASHES);
    if verify_hashes == VerifyHashes::Required && keys.scheme == KeyScheme::TokenChain {
        return Err(ConfigError::at(
            "verify_hashes",
            "token-chain pools compute their keys from token ids and use no published hash; \
             `required` applies to vllm-exact and sglang-exact pools",
        ));
    }
    let discovery = match pool.discovery {
        None => None,
        Some(kvroute_discovery::RawPoolDiscovery { kubernetes: None }) => {
            return Err(ConfigError::at(
                "discovery.kubernetes",
                "required (the one discovery source)",
            ));
        }
        Some(kvroute_discovery::RawPoolDiscovery {
            kubernetes: Some(kubernetes),
        }) => Some(
            kvroute_discovery::KubernetesSource::try_from(kubernetes)
                .map_err(|e| e.within("discovery.kubernetes"))?,
        ),
    };
    Ok(PoolConfig {
        name: pool.name,
        models: pool.models,
        block_size: keys.block_size,
        key_scheme: keys.scheme,
        verify_hashes,
        attention_chunk_size: pool.attention_chunk_size.map(std::num::NonZeroU32::get),
        discovery,
    })
}

impl ReplicaConfig {
    /// A replica discovery found (`pools[pool].discovery`): kvroute connects to its pod's
    /// KV-event PUB socket and replay ROUTER, with the defaults a static replica gets — or, with
    /// `node_agent_fed`, opens no socket: its node's agent feeds it. `Err` names what is wrong
    /// with the endpoints the pod's annotations produced.
    /// Its engine family is its pod's `kvroute.io/engine`, else the one the pool's key scheme
    /// names (vLLM for token-chain pools).
    pub fn discovered(
        pool: usize,
        scheme: &KeyScheme,
        replica: &kvroute_discovery::Replica,
        node_agent_fed: bool,
    ) -> Result<ReplicaConfig, String> {
        if !is_label_safe(&replica.id) {
            return Err(format!("replica id {:?} is not label-safe", replica.id));
        }
        let mut config = ReplicaConfig {
            id: replica.id.clone(),
            pool,
            endpoint: String::new(),
            mode: SocketMode::Connect,
            replay_endpoint: None,
            topic: String::new(),
            dp_rank: u32::from(replica.rank),
            dp_rank_checked: replica.rank_by_header,
            allowed_peers: PeerFilter::any(),
            max_message_bytes: kvroute_config::DEFAULT_MAX_MESSAGE_BYTES,
            reconnect_backoff_max: kvroute_config::DEFAULT_EVENTS_RECONNECT_BACKOFF_MAX,
            engine: replica.engine.or(scheme.engine()).unwrap_or_default(),
            node: replica.node.clone(),
        };
        if node_agent_fed {
            if replica.node.is_none() {
                return Err("the pod names no node, so no node agent can feed it".to_owned());
            }
            return Ok(config);
        }
        for (key, endpoint) in [
            ("endpoint", Some(&replica.kv_events)),
            ("replay_endpoint", replica.kv_replay.as_ref()),
        ] {
            if let Some(endpoint) = endpoint {
                endpoint
                    .parse::<ZmqEndpoint>()
                    .map_err(|reason| format!("{key} {endpoint}: {reason}"))?;
            }
        }
        config.endpoint.clone_from(&replica.kv_events);
        config.replay_endpoint.clone_from(&replica.kv_replay);
        config.topic.clone_from(&replica.kv_topic);
        Ok(config)
    }
}

/// Replica ids become metric label values; keep them to a safe alphabet.
fn is_label_safe(id: &str) -> bool {
    id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}
