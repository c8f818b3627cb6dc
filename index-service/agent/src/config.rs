//! `kvroute-agent` configuration (YAML, unknown keys rejected).
//!
//! Every key, its default and meaning: `docs/configuration.md` (generated from [`RawAgentConfig`]).
//! Every error is a [`ConfigError`] naming the field path (`engines[0].mode: ...`).
//!
//! **Discovery**: each discovered replica is an engine with mode `connect`, `endpoint` its
//! `kv_events`, `replay_endpoint` its `kv_replay`, `topic` its `kv_topic`, and replica id the
//! discovered id (pod name, or `<pod>-rank<N>`), which ext-proc and the index use as well. Only
//! pods on one node are watched: `kubernetes.node_name`, or by default the agent id, so with
//! `agent_id_env: NODE_NAME` (below) each agent watches its own node. A discovered id that a
//! static engine already has is left out (counted, logged). The index must list the ids in the
//! agent's `agents[].replicas` to accept them.
//!
//! **Reload**: the running agent re-reads the file when its mtime changes. `engines`,
//! `discovery` and `reload_interval` apply at once ([`RELOADABLE_KEYS`]); a change to any other
//! key is logged and counted (`kvroute_agent_config_restart_required_total{key}`) and its
//! running value kept. A file that does not validate changes nothing
//! (`kvroute_agent_config_reloads_total{outcome="rejected"}`).
//!
//! One config for every node (a DaemonSet's ConfigMap): `agent_id_env: NODE_NAME` takes the
//! agent id from that environment variable (in Kubernetes, `env: [{name: NODE_NAME, valueFrom:
//! {fieldRef: {fieldPath: spec.nodeName}}}]`), and `{agent_id}` in an engine's `replica` is
//! replaced by it, so node `gpu-1` mirrors `replica: "{agent_id}-engine-0"` as `gpu-1-engine-0`.
//! It is the only placeholder; any other `{`/`}` in a replica id is refused. An unset or empty
//! variable, or both `agent_id` and `agent_id_env`, is an error naming the key.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use schemars::JsonSchema;
use serde::Deserialize;
use serde::de::IgnoredAny;

use kvroute_config::{
    ConfigDuration, ConfigError, ListenAddr, RawClientTls, TokenSource, format_duration,
};
use kvroute_ingest::IngestConfig;
use kvroute_ingest::zmtp::PeerFilter;
use kvroute_runtime::token::AgentToken;

/// Default admin listen address.
pub const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:9471";
/// Default longest wait before pending deltas are sent.
pub const DEFAULT_BATCH_DELAY: Duration = Duration::from_millis(20);
/// Default pending-delta size that triggers an immediate send (approximate bytes).
pub const DEFAULT_MAX_BATCH_BYTES: usize = 1 << 20;
/// Default per-replica mirror cap.
pub const DEFAULT_MAX_BLOCKS_PER_REPLICA: usize = 1_000_000;
/// Default interval at which the config file's mtime is checked for a reload (ext-proc's too).
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(2);
/// Delta messages queued per index stream before the stream is restarted from a snapshot.
pub const DEFAULT_SUBSCRIBER_QUEUE: usize = 4096;
/// First delay before reconnecting to an index (doubling up to `reconnect_backoff_max`).
pub const DEFAULT_RECONNECT_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Default cap on the delay between reconnects to an index.
pub const DEFAULT_RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The file as written.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawAgentConfig {
    /// Agent id, as in the index's `agents:` section (exactly one of `agent_id`,
    /// `agent_id_env`).
    pub agent_id: String,
    /// Environment variable holding the agent id, e.g. `NODE_NAME` set from the downward API
    /// (`fieldRef: spec.nodeName`): one config for every node of a DaemonSet. Resolved by
    /// [`RawAgentConfig::resolve_agent_id`].
    pub agent_id_env: Option<String>,
    /// File holding the agent's token (exactly one of `token_file`, `token_env`).
    pub token_file: Option<String>,
    /// Environment variable holding the agent's token.
    pub token_env: Option<String>,
    /// Index gRPC addresses (`http://host:port`, `https://` with `tls`), one stream each.
    pub indexes: Vec<String>,
    /// Admin HTTP address: `/metrics`, `/healthz`.
    #[schemars(extend("default" = DEFAULT_ADMIN_ADDR))]
    pub admin: Option<ListenAddr>,
    /// Longest delay before pending deltas are sent to the indexes.
    #[schemars(extend("default" = format_duration(DEFAULT_BATCH_DELAY)))]
    pub batch_delay: Option<ConfigDuration>,
    /// Blocks mirrored per replica before further stores are refused.
    #[schemars(extend("default" = DEFAULT_MAX_BLOCKS_PER_REPLICA))]
    pub max_blocks_per_replica: Option<std::num::NonZeroUsize>,
    /// Cap on the delay between reconnects to an index.
    #[schemars(extend("default" = format_duration(DEFAULT_RECONNECT_BACKOFF_MAX)))]
    pub reconnect_backoff_max: Option<ConfigDuration>,
    /// Older spelling of `batch_delay` (refused).
    #[schemars(skip)]
    pub batch_delay_ms: Option<IgnoredAny>,
    /// Older spelling of `reconnect_backoff_max` (refused).
    #[schemars(skip)]
    pub reconnect_backoff_max_ms: Option<IgnoredAny>,
    /// Local engines, one entry per data-parallel rank (may be empty with `discovery`).
    pub engines: Vec<RawEngine>,
    /// TLS to the indexes; every index address is then `https://`.
    pub tls: Option<RawClientTls>,
    /// Engines learned from Kubernetes as well: the Ready pods on this agent's node.
    pub discovery: Option<RawDiscovery>,
    /// How often the config file's modification time is checked: `engines`, `discovery` and
    /// `reload_interval` apply at once, any other key after a restart (logged, counted).
    #[schemars(extend("default" = format_duration(DEFAULT_RELOAD_INTERVAL)))]
    pub reload_interval: Option<ConfigDuration>,
    /// How log lines are written: `format: text` (the default) or `json`. Read at start.
    pub log: kvroute_config::RawLog,
}

/// `discovery:`: where engines come from besides `engines:`.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawDiscovery {
    /// The `kubernetes:` section every kvroute component shares (pod annotations set the
    /// KV-event ports and topic); without `node_name`, the node is the agent id. Each pod is an
    /// engine in `connect` mode, its replica id the discovered id (pod name, or
    /// `<pod>-rank<N>`); an id a static engine already has is left out.
    pub kubernetes: Option<kvroute_discovery::RawKubernetes>,
}

/// The placeholder in `engines[].replica` replaced by the agent id.
pub const AGENT_ID_PLACEHOLDER: &str = "{agent_id}";

impl RawAgentConfig {
    /// Takes `agent_id` from the environment variable `agent_id_env` names, looked up through
    /// `env` (the process environment in [`AgentConfig::from_yaml`]; a map in tests).
    pub fn resolve_agent_id(
        &mut self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        let Some(name) = self.agent_id_env.take() else {
            return Ok(());
        };
        if !self.agent_id.is_empty() {
            return Err(ConfigError::at(
                "agent_id_env",
                format_args!("give agent_id or agent_id_env, not both (got {name})"),
            ));
        }
        match env(&name) {
            Some(id) if !id.is_empty() => {
                self.agent_id = id;
                Ok(())
            }
            _ => Err(ConfigError::at(
                "agent_id_env",
                format_args!(
                    "the environment variable {name} is unset or empty (in Kubernetes: set it \
                     from the downward API, fieldRef spec.nodeName)"
                ),
            )),
        }
    }
}

kvroute_config::event_source_section! {
    /// One `engines:` entry: a replica id and the KV-event source keys every kvroute component
    /// shares (the index's `replicas[].events`).
    #[derive(Debug, Default, Deserialize, JsonSchema)]
    #[serde(default, deny_unknown_fields)]
    pub struct RawEngine {
        /// Replica id the index knows the engine by; `{agent_id}` in it is replaced by the agent
        /// id (the only placeholder), so node `gpu-1` writes `{agent_id}-engine-0` as
        /// `gpu-1-engine-0`.
        pub replica: String,
    }
}

/// The keys a running agent applies from a changed file (the rest need a restart).
pub const RELOADABLE_KEYS: [&str; 3] = ["engines", "discovery", "reload_interval"];

/// A re-read config file ([`AgentConfig::reload_from_yaml`]).
#[derive(Debug)]
pub struct Reload {
    /// The config to run: the file's reloadable keys, the running values of the others.
    pub config: AgentConfig,
    /// Keys the file changed that only apply after a restart (their new values are ignored).
    pub restart_required: Vec<&'static str>,
}

fn parse_raw(
    text: &str,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<RawAgentConfig, ConfigError> {
    let mut raw: RawAgentConfig = kvroute_config::from_yaml(text)?;
    raw.resolve_agent_id(env)?;
    Ok(raw)
}

fn load_token(raw: &RawAgentConfig) -> Result<AgentToken, ConfigError> {
    let source = TokenSource::from_keys(raw.token_file.as_deref(), raw.token_env.as_deref())?;
    AgentToken::load(&source).map_err(|e| ConfigError::load(source.key(), e))
}

/// Validated agent configuration.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Agent id.
    pub agent_id: String,
    /// Its token.
    pub token: AgentToken,
    /// Index gRPC URIs.
    pub indexes: Vec<String>,
    /// Admin listen address.
    pub admin_addr: SocketAddr,
    /// Longest delta delay.
    pub batch_delay: Duration,
    /// Pending delta size that triggers a send.
    pub max_batch_bytes: usize,
    /// Mirror cap per replica.
    pub max_blocks_per_replica: usize,
    /// Delta queue per index stream.
    pub subscriber_queue: usize,
    /// First reconnect delay.
    pub reconnect_backoff_min: Duration,
    /// Reconnect delay cap.
    pub reconnect_backoff_max: Duration,
    /// One ingest socket per engine (DP rank).
    pub engines: Vec<IngestConfig>,
    /// TLS to the indexes (`None`: plaintext).
    pub tls: Option<kvroute_runtime::tls::ClientTls>,
    /// Engines from Kubernetes, restricted to one node (`node_name`, or the agent id).
    pub discovery: Option<kvroute_discovery::KubernetesSource>,
    /// How often the config file's mtime is checked (when the agent watches its file).
    pub reload_interval: Duration,
    /// `log.format` (read at start).
    pub log_format: kvroute_config::LogFormat,
}

impl AgentConfig {
    /// Parses, validates and loads the token; `agent_id_env` is read from the process
    /// environment.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        Self::from_yaml_with_env(text, |name| std::env::var(name).ok())
    }

    /// [`AgentConfig::from_yaml`] with `agent_id_env` looked up through `env`.
    pub fn from_yaml_with_env(
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let raw = parse_raw(text, &env)?;
        let token = load_token(&raw)?;
        Self::validate(raw, token)
    }

    /// Re-reads the file of a running agent ([`AgentConfig::from_yaml`]'s rules): the file
    /// must be valid as a whole, and only [`RELOADABLE_KEYS`] take effect; every other key
    /// keeps its running value and is named in [`Reload::restart_required`] if the file
    /// changed it.
    pub fn reload_from_yaml(&self, text: &str) -> Result<Reload, ConfigError> {
        self.reload_from_yaml_with_env(text, |name| std::env::var(name).ok())
    }

    /// [`AgentConfig::reload_from_yaml`] with `agent_id_env` looked up through `env`.
    pub fn reload_from_yaml_with_env(
        &self,
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Reload, ConfigError> {
        let raw = parse_raw(text, &env)?;
        let token = load_token(&raw)?;
        let mut file = Self::validate(raw, token)?;
        let mut restart_required = Vec::new();
        for (key, changed) in [
            ("agent_id", file.agent_id != self.agent_id),
            ("token", file.token != self.token),
            ("indexes", file.indexes != self.indexes),
            ("admin", file.admin_addr != self.admin_addr),
            ("batch_delay", file.batch_delay != self.batch_delay),
            (
                "max_blocks_per_replica",
                file.max_blocks_per_replica != self.max_blocks_per_replica,
            ),
            (
                "reconnect_backoff_max",
                file.reconnect_backoff_max != self.reconnect_backoff_max,
            ),
            ("tls", file.tls != self.tls),
            ("log", file.log_format != self.log_format),
        ] {
            if changed {
                restart_required.push(key);
            }
        }
        if file.agent_id != self.agent_id {
            // `{agent_id}` in replica ids and the default discovery node follow the running id.
            let mut raw = parse_raw(text, &env)?;
            raw.agent_id.clone_from(&self.agent_id);
            file = Self::validate(raw, self.token.clone())?;
        }
        Ok(Reload {
            config: AgentConfig {
                engines: file.engines,
                discovery: file.discovery,
                reload_interval: file.reload_interval,
                ..self.clone()
            },
            restart_required,
        })
    }

    /// Validates a raw config with an already loaded token (`agent_id_env` already resolved:
    /// [`RawAgentConfig::resolve_agent_id`]).
    pub fn validate(raw: RawAgentConfig, token: AgentToken) -> Result<Self, ConfigError> {
        if let Some(name) = &raw.agent_id_env {
            return Err(ConfigError::at(
                "agent_id_env",
                format_args!("{name} not resolved: RawAgentConfig::resolve_agent_id reads it"),
            ));
        }
        for (set, old, new) in [
            (
                raw.batch_delay_ms.is_some(),
                "batch_delay_ms",
                "`batch_delay: \"20ms\"` (a duration string)",
            ),
            (
                raw.reconnect_backoff_max_ms.is_some(),
                "reconnect_backoff_max_ms",
                "`reconnect_backoff_max: \"5s\"` (a duration string)",
            ),
        ] {
            if set {
                return Err(ConfigError::renamed(old, new));
            }
        }
        if raw.agent_id.is_empty() {
            return Err(ConfigError::at("agent_id", "must be non-empty"));
        }
        if raw.indexes.is_empty() {
            return Err(ConfigError::at("indexes", "name at least one index"));
        }
        for (i, index) in raw.indexes.iter().enumerate() {
            if !(index.starts_with("http://") || index.starts_with("https://")) {
                return Err(ConfigError::at(
                    format!("indexes[{i}]"),
                    format_args!("expected http://host:port (got {index:?})"),
                ));
            }
            kvroute_runtime::tls::check_scheme(index, raw.tls.is_some())
                .map_err(|reason| ConfigError::at(format!("indexes[{i}]"), reason))?;
        }
        let tls = raw
            .tls
            .as_ref()
            .map(|tls| kvroute_runtime::tls::ClientTls::load(tls, "tls"))
            .transpose()
            .map_err(|e| ConfigError::load(e.field(), e.reason()))?;
        let admin_addr = match raw.admin {
            Some(admin) => admin.get(),
            None => DEFAULT_ADMIN_ADDR.parse().map_err(|_| {
                ConfigError::at(
                    "admin",
                    format_args!("default {DEFAULT_ADMIN_ADDR} is not ip:port"),
                )
            })?,
        };
        let mut engines: Vec<IngestConfig> = Vec::with_capacity(raw.engines.len());
        for (i, engine) in raw.engines.into_iter().enumerate() {
            let sockets = validate_engine(engine, &raw.agent_id, &engines)
                .map_err(|e| e.within(&format!("engines[{i}]")))?;
            engines.extend(sockets);
        }
        let discovery = match raw.discovery {
            None => None,
            Some(RawDiscovery { kubernetes: None }) => {
                return Err(ConfigError::at(
                    "discovery.kubernetes",
                    "required in discovery",
                ));
            }
            Some(RawDiscovery {
                kubernetes: Some(kubernetes),
            }) => {
                let source = kvroute_discovery::KubernetesSource::try_from(kubernetes)
                    .map_err(|e| e.within("discovery.kubernetes"))?;
                // An agent mirrors its own node's engines: with agent_id_env: NODE_NAME (the
                // downward API's spec.nodeName) the agent id is the node name.
                let node = source
                    .node_name
                    .clone()
                    .unwrap_or_else(|| raw.agent_id.clone());
                Some(source.on_node(node))
            }
        };
        if engines.is_empty() && discovery.is_none() {
            return Err(ConfigError::at(
                "engines",
                "name at least one engine (or discover them: discovery.kubernetes)",
            ));
        }
        let reload_interval = raw
            .reload_interval
            .map_or(DEFAULT_RELOAD_INTERVAL, ConfigDuration::get);
        if reload_interval.is_zero() {
            return Err(ConfigError::at(
                "reload_interval",
                "must be positive (got 0s)",
            ));
        }
        let replicas: std::collections::HashSet<&str> =
            engines.iter().map(|e| &*e.replica_id).collect();
        let max = kvroute_index_api::agent_protocol::MAX_REPLICAS_PER_HELLO;
        if replicas.len() > max {
            return Err(ConfigError::at(
                "engines",
                format_args!(
                    "{} replicas: more than one Hello may claim \
                     (agent_protocol::MAX_REPLICAS_PER_HELLO = {max})",
                    replicas.len()
                ),
            ));
        }
        Ok(AgentConfig {
            agent_id: raw.agent_id,
            token,
            indexes: raw.indexes,
            admin_addr,
            batch_delay: raw
                .batch_delay
                .map_or(DEFAULT_BATCH_DELAY, ConfigDuration::get),
            max_batch_bytes: DEFAULT_MAX_BATCH_BYTES,
            max_blocks_per_replica: raw
                .max_blocks_per_replica
                .map_or(DEFAULT_MAX_BLOCKS_PER_REPLICA, std::num::NonZeroUsize::get),
            subscriber_queue: DEFAULT_SUBSCRIBER_QUEUE,
            reconnect_backoff_min: DEFAULT_RECONNECT_BACKOFF_MIN,
            reconnect_backoff_max: raw
                .reconnect_backoff_max
                .map_or(DEFAULT_RECONNECT_BACKOFF_MAX, ConfigDuration::get),
            engines,
            tls,
            discovery,
            reload_interval,
            log_format: raw.log.format(),
        })
    }
}

/// One `engines:` entry (paths relative to it): the replica id with `{agent_id}` replaced,
/// unique among `earlier`; the event source's own rules. An engine with data-parallel ranks is
/// one socket per rank, each rank the replica `<replica>@dp<rank>` (as the index names it).
fn validate_engine(
    engine: RawEngine,
    agent_id: &str,
    earlier: &[IngestConfig],
) -> Result<Vec<IngestConfig>, ConfigError> {
    let replica = engine.replica.replace(AGENT_ID_PLACEHOLDER, agent_id);
    if replica.contains(['{', '}']) {
        return Err(ConfigError::at(
            "replica",
            format_args!(
                "`{{agent_id}}` is the only placeholder (got {:?})",
                engine.replica
            ),
        ));
    }
    if replica.is_empty() || earlier.iter().any(|e| *e.replica_id == *replica) {
        return Err(ConfigError::at(
            "replica",
            format_args!(
                "must be non-empty and unique (one entry per DP rank, each its own replica id; \
                 got {replica:?})"
            ),
        ));
    }
    engine.check()?;
    if engine.engine != kvroute_config::Engine::Vllm {
        // The agent stream carries vLLM's event fields only (SGLang's salt and token layout
        // would be lost on the way), so SGLang engines publish to the index directly.
        return Err(ConfigError::at(
            "engine",
            "the agent forwards vLLM engines only: list SGLang engines under the index's \
             replicas[].events",
        ));
    }
    let ranks = engine.data_parallel_ranks();
    let mut sockets = Vec::with_capacity(ranks as usize);
    for rank in 0..ranks {
        let (endpoint, replay_endpoint) = engine.rank_endpoints(rank);
        let socket = if ranks > 1 {
            let id = kvroute_config::rank_replica_id(&replica, rank);
            IngestConfig::new(Arc::<str>::from(id), endpoint, engine.mode)
                .with_checked_dp_rank(rank)
        } else {
            IngestConfig::new(Arc::<str>::from(replica.as_str()), endpoint, engine.mode)
                .with_dp_rank(engine.dp_rank)
        };
        let mut socket = socket
            .with_topic_filter(engine.topic.clone())
            .with_allowed_peers(
                engine
                    .allowed_peers
                    .as_deref()
                    .map_or_else(PeerFilter::any, PeerFilter::from_peers),
            );
        socket.max_message_bytes = engine.max_message_bytes_or_default();
        socket.reconnect_backoff_max = engine.reconnect_backoff_max_or_default();
        if let Some(replay) = replay_endpoint {
            socket = socket.with_replay_endpoint(replay);
        }
        sockets.push(socket);
    }
    Ok(sockets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<AgentConfig, ConfigError> {
        AgentConfig::validate(
            kvroute_config::from_yaml(yaml)?,
            AgentToken::from_literal("t"),
        )
    }

    #[test]
    fn parses_and_names_bad_fields() {
        let config = parse(
            "agent_id: a\nindexes: ['http://127.0.0.1:1']\nengines: [{replica: r, endpoint: 'tcp://127.0.0.1:5557', replay_endpoint: 'tcp://127.0.0.1:5558'}]",
        )
        .unwrap();
        assert_eq!(config.engines.len(), 1);
        assert_eq!(config.batch_delay, DEFAULT_BATCH_DELAY);
        assert_eq!(
            config.engines[0].reconnect_backoff_max,
            kvroute_config::DEFAULT_EVENTS_RECONNECT_BACKOFF_MAX
        );
        let config = parse(
            "agent_id: a\nindexes: ['http://127.0.0.1:1']\nengines: [{replica: r, endpoint: 'tcp://127.0.0.1:5557', reconnect_backoff_max: 300ms}]",
        )
        .unwrap();
        assert_eq!(
            config.engines[0].reconnect_backoff_max,
            Duration::from_millis(300)
        );
        let cases = [
            ("agent_id: ''", "agent_id"),
            ("agent_id: a\nindexes: ['127.0.0.1:1']", "indexes[0]"),
            (
                "agent_id: a\nindexes: ['http://h:1']\nengines: [{replica: r, endpoint: x}]",
                "engines[0].endpoint",
            ),
            (
                "agent_id: a\nindexes: ['http://h:1']\nengines: []",
                "engines",
            ),
        ];
        for (yaml, field) in cases {
            let error = parse(yaml).unwrap_err().to_string();
            assert!(error.starts_with(&format!("{field}: ")), "{yaml}: {error}");
        }
    }

    #[test]
    fn durations_are_strings_and_the_ms_keys_are_refused_by_their_new_name() {
        let base = "agent_id: a\nindexes: ['http://127.0.0.1:1']\nengines: [{replica: r, endpoint: 'tcp://127.0.0.1:5557'}]\n";
        let config = parse(&format!(
            "{base}batch_delay: 5ms\nreconnect_backoff_max: 1.5s"
        ))
        .unwrap();
        assert_eq!(config.batch_delay, Duration::from_millis(5));
        assert_eq!(config.reconnect_backoff_max, Duration::from_millis(1500));
        for (yaml, message) in [
            (
                "batch_delay_ms: 5",
                "batch_delay_ms: this key was renamed: write `batch_delay: \"20ms\"`",
            ),
            (
                "reconnect_backoff_max_ms: 200",
                "reconnect_backoff_max_ms: this key was renamed: write `reconnect_backoff_max: \"5s\"`",
            ),
            ("batch_delay: 5", "batch_delay: "),
        ] {
            let error = parse(&format!("{base}{yaml}")).unwrap_err().to_string();
            assert!(error.contains(message), "{yaml}: {error}");
        }
    }

    #[test]
    fn agent_id_from_the_environment_names_every_replica_of_the_node() {
        // One DaemonSet config: NODE_NAME from the downward API gives each node its identity.
        let yaml = "agent_id_env: NODE_NAME\ntoken_file: /nonexistent/token\nindexes: ['http://127.0.0.1:1']\n\
                    engines: [{replica: '{agent_id}-engine-0', endpoint: 'tcp://127.0.0.1:5557'}, \
                    {replica: 'shared-{agent_id}', endpoint: 'tcp://127.0.0.1:5567'}]\n";
        let node =
            |node: &'static str| move |name: &str| (name == "NODE_NAME").then(|| node.to_owned());
        let resolve = |env: &dyn Fn(&str) -> Option<String>| {
            let mut raw: RawAgentConfig = kvroute_config::from_yaml(yaml).unwrap();
            raw.resolve_agent_id(env)?;
            AgentConfig::validate(raw, AgentToken::from_literal("t"))
        };
        for name in ["gpu-1", "gpu-2"] {
            let config = resolve(&node(name)).unwrap();
            assert_eq!(config.agent_id, name);
            let replicas: Vec<&str> = config.engines.iter().map(|e| &*e.replica_id).collect();
            assert_eq!(
                replicas,
                [format!("{name}-engine-0"), format!("shared-{name}")]
            );
        }
        // Unset or empty: refused, naming the key and the variable.
        for env in [
            &(|_: &str| None) as &dyn Fn(&str) -> Option<String>,
            &|_: &str| Some(String::new()),
        ] {
            let error = resolve(env).unwrap_err().to_string();
            assert!(
                error.starts_with("agent_id_env: ") && error.contains("NODE_NAME"),
                "{error}"
            );
        }
        // from_yaml_with_env resolves before the token is loaded (a missing token file is the
        // next error, not the id).
        let error = AgentConfig::from_yaml_with_env(yaml, node("gpu-1")).unwrap_err();
        assert_eq!(
            (error.kind(), error.path()),
            (kvroute_config::ErrorKind::Load, "token_file"),
            "{error}"
        );
        let error = AgentConfig::from_yaml_with_env(yaml, |_| None)
            .unwrap_err()
            .to_string();
        assert!(error.starts_with("agent_id_env: "), "{error}");
    }

    #[test]
    fn agent_id_env_is_refused_beside_agent_id_unresolved_or_with_another_placeholder() {
        let base = "indexes: ['http://127.0.0.1:1']\nengines: [{replica: r, endpoint: 'tcp://127.0.0.1:5557'}]\n";
        let mut raw: RawAgentConfig =
            kvroute_config::from_yaml(&format!("{base}agent_id: a\nagent_id_env: NODE_NAME"))
                .unwrap();
        let error = raw
            .resolve_agent_id(|_| Some("n".into()))
            .unwrap_err()
            .to_string();
        assert!(error.contains("not both"), "{error}");
        let error = parse(&format!("{base}agent_id_env: NODE_NAME"))
            .unwrap_err()
            .to_string();
        assert!(error.contains("not resolved"), "{error}");
        let yaml = "agent_id: a\nindexes: ['http://127.0.0.1:1']\nengines: [{replica: '{node}-0', endpoint: 'tcp://127.0.0.1:5557'}]";
        let error = parse(yaml).unwrap_err().to_string();
        assert!(
            error.starts_with("engines[0].replica: ") && error.contains("only placeholder"),
            "{error}"
        );
    }

    #[test]
    fn discovery_watches_the_agent_id_as_node_unless_named_and_allows_no_static_engines() {
        let base = "agent_id: gpu-1\nindexes: ['http://127.0.0.1:1']\n";
        let config = parse(&format!(
            "{base}discovery: {{kubernetes: {{selector: {{app: vllm}}, target_port: http}}}}"
        ))
        .unwrap();
        assert!(config.engines.is_empty());
        let source = config.discovery.unwrap();
        assert_eq!(source.node_name.as_deref(), Some("gpu-1"));
        let named = parse(&format!(
            "{base}discovery: {{kubernetes: {{inference_pool: llama, node_name: worker-3}}}}"
        ))
        .unwrap();
        assert_eq!(
            named.discovery.unwrap().node_name.as_deref(),
            Some("worker-3")
        );
        for (yaml, field) in [
            ("discovery: {}", "discovery.kubernetes: "),
            (
                "discovery: {kubernetes: {selector: {app: vllm}}}",
                "discovery.kubernetes.target_port: ",
            ),
            (
                "discovery: {kubernetes: {inference_pool: a, nope: 1}}",
                "nope",
            ),
            ("", "engines: "),
        ] {
            let error = parse(&format!("{base}{yaml}")).unwrap_err().to_string();
            assert!(error.contains(field), "{yaml}: {error}");
        }
    }

    #[test]
    fn a_reload_applies_engines_and_keeps_what_needs_a_restart() {
        let token =
            std::env::temp_dir().join(format!("kvroute-agent-reload-{}", std::process::id()));
        std::fs::write(&token, "t").unwrap();
        let file = |index: &str, endpoint: &str, id: &str| {
            format!(
                "agent_id: {id}\ntoken_file: '{}'\nindexes: ['{index}']\n\
                 engines: [{{replica: '{{agent_id}}-e', endpoint: '{endpoint}'}}]\n",
                token.display()
            )
        };
        let env = |_: &str| None;
        let running = AgentConfig::from_yaml_with_env(
            &file("http://127.0.0.1:1", "tcp://127.0.0.1:5557", "a"),
            env,
        )
        .unwrap();

        let same = running
            .reload_from_yaml_with_env(
                &file("http://127.0.0.1:1", "tcp://127.0.0.1:5557", "a"),
                env,
            )
            .unwrap();
        assert!(same.restart_required.is_empty());
        assert_eq!(same.config.engines, running.engines);

        let moved = running
            .reload_from_yaml_with_env(
                &file("http://127.0.0.1:2", "tcp://127.0.0.1:6000", "b"),
                env,
            )
            .unwrap();
        assert_eq!(moved.restart_required, ["agent_id", "indexes"]);
        assert_eq!(moved.config.agent_id, "a", "kept");
        assert_eq!(moved.config.indexes, ["http://127.0.0.1:1"], "kept");
        assert_eq!(moved.config.engines[0].endpoint, "tcp://127.0.0.1:6000");
        assert_eq!(
            &*moved.config.engines[0].replica_id, "a-e",
            "the placeholder follows the running id"
        );

        let error = running
            .reload_from_yaml_with_env("agent_id: a\nengines: 3", env)
            .unwrap_err();
        assert_eq!(error.as_label(), "parse");
        let _ = std::fs::remove_file(&token);
    }

    #[test]
    fn a_config_error_names_its_field_path() {
        let base = "agent_id: a\nindexes: ['http://127.0.0.1:1']\n";
        for (engines, path, message) in [
            (
                "[{replica: r, endpoint: 'tcp://127.0.0.1:5557', mode: pull}]",
                "engines[0].mode",
                "engines[0].mode: unknown variant `pull`, expected `connect` or `bind`",
            ),
            (
                "[{replica: r, endpoint: 'tcp://127.0.0.1:5557'}, {replica: s, endpoint: 'tcp://127.0.0.1:5567', allowed_peers: [10.0.0.1]}]",
                "engines[1].allowed_peers",
                "engines[1].allowed_peers: applies to bind mode only",
            ),
            (
                "[{replica: r, endpoint: 'tcp://127.0.0.1:5557', engine: sglang}]",
                "engines[0].engine",
                "engines[0].engine: the agent forwards vLLM engines only",
            ),
            (
                "[{replica: r, endpoint: 'tcp://127.0.0.1:5557'}, {replica: s, endpoint: 'tcp://127.0.0.1:5567', nope: 1}]",
                "engines[1].nope",
                "engines[1].nope: unknown key, expected one of `replica`, `endpoint`",
            ),
        ] {
            let error = parse(&format!("{base}engines: {engines}")).unwrap_err();
            assert_eq!(error.path(), path, "{engines}");
            assert!(error.to_string().starts_with(message), "{error}");
        }
    }
}
