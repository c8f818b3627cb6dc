//! The configuration GIE's and llm-d's endpoint-picker charts imply, for a kvroute-ext-proc
//! started by one of them with no kvroute config file: `--pool-name NAME [--pool-namespace NS]`
//! (or llm-d's standalone `--endpoint-selector k=v --endpoint-target-ports PORT`).
//!
//! It is the config a user would write for that pool, built as a [`RawConfig`] and validated
//! like a file (so every rule and default is the file's):
//!
//! ```yaml
//! listen: {grpc: 0.0.0.0:9002, health: 0.0.0.0:9003, admin: 0.0.0.0:9090, secure_serving: true}
//! index: {addresses: [<--index-address>]}           # only when given
//! pools:
//! - name: <pool name>
//!   models: [<--model>]                              # none given: every model is this pool's
//!   events: <an index address is given>
//!   tokenizer: {model_dir: <--tokenizer-model-dir>}  # or {render: <--tokenizer-render>}; else none
//!   discovery: {kubernetes: {inference_pool: <pool name>, namespace: <ns>, kubeconfig: <--kubeconfig>}}
//! ```
//!
//! Listeners are GIE's EPP ports on all interfaces, TLS self-signed as GIE's EPP defaults
//! (`--secure-serving=false` turns it off); the other chart flags ([`Overrides`]) apply on top.
//! Block size and key scheme are the file's defaults, which are vLLM's (16 tokens, `sha256`).
//! What routing this gives, truthfully labelled in `decisions_total{tier}`: with neither
//! tokenizer flag, the load tier (`reason="no_tokenizer"`: no prompt tokens, no prefix
//! affinity); with a tokenizer, the approximate tier (kvroute's own routed-prefix memory) and
//! load; with a tokenizer and an index address, the precise tier.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvroute_config::{ConfigError, ListenAddr};
use kvroute_discovery::{RawKubernetes, RawPoolDiscovery};

use super::raw::{RawConfig, RawPool, RawTokenizer};
use super::{Config, Overrides};

/// `--pool-group` when not given: GIE's v1 API group, the one kvroute discovers.
pub const DEFAULT_POOL_GROUP: &str = kvroute_discovery::inference_pool::GROUP;
/// ext_proc port in chart mode (GIE's EPP), on all interfaces.
pub const CHART_GRPC_PORT: u16 = 9002;
/// Plaintext gRPC health port in chart mode (GIE's EPP; the charts' probes ask it).
pub const CHART_HEALTH_PORT: u16 = 9003;
/// Admin/metrics port in chart mode (GIE's EPP).
pub const CHART_METRICS_PORT: u16 = 9090;
/// TLS on the ext_proc port in chart mode: GIE's EPP serves TLS unless `--secure-serving=false`,
/// and the gateways its charts configure expect it.
pub const CHART_SECURE_SERVING: bool = true;
/// The pool's name with `--endpoint-selector` and no `--pool-name` (a metric label).
pub const DEFAULT_SELECTOR_POOL_NAME: &str = "endpoints";

/// Which pods the chart's flags select.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChartSelection {
    /// `--pool-name`, `--pool-group`: an InferencePool.
    InferencePool {
        /// Its name.
        name: String,
        /// Its API group.
        group: String,
    },
    /// `--endpoint-selector`, `--endpoint-target-ports`: pods by label (llm-d standalone).
    Selector {
        /// `k=v,k2=v2`.
        labels: String,
        /// The target port(s) as given.
        ports: String,
        /// `--pool-name`, else [`DEFAULT_SELECTOR_POOL_NAME`].
        name: Option<String>,
    },
}

/// What a chart's command line says about the pool, when there is no kvroute config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChartPool {
    /// Which pods.
    pub selection: ChartSelection,
    /// `--pool-namespace`, else `NAMESPACE` / `POD_NAMESPACE`; `None`: the client's namespace
    /// (in a pod, its service account's).
    pub namespace: Option<String>,
    /// `--kubeconfig`/`KUBECONFIG`; default: the pod's service account.
    pub kubeconfig: Option<PathBuf>,
    /// `--index-address`/`KVROUTE_INDEX_ADDRESS` (`index.addresses`).
    pub index_addresses: Vec<String>,
    /// `--model`/`KVROUTE_POOL_MODELS` (`pools[].models`); none: every model is the pool's.
    pub models: Vec<String>,
    /// `--tokenizer-model-dir`/`KVROUTE_TOKENIZER_MODEL_DIR` (`pools[].tokenizer.model_dir`).
    pub tokenizer_model_dir: Option<PathBuf>,
    /// `--tokenizer-render`/`KVROUTE_TOKENIZER_RENDER` (`pools[].tokenizer.render`).
    pub tokenizer_render: Option<String>,
}

impl ChartPool {
    /// The pool's name (a metric label).
    pub fn name(&self) -> &str {
        match &self.selection {
            ChartSelection::InferencePool { name, .. } => name,
            ChartSelection::Selector { name, .. } => {
                name.as_deref().unwrap_or(DEFAULT_SELECTOR_POOL_NAME)
            }
        }
    }

    /// The routing tier the flags allow at best (`precise`, `approximate` or `load`).
    pub fn best_tier(&self) -> &'static str {
        let tokenizer = self.tokenizer_model_dir.is_some() || self.tokenizer_render.is_some();
        match (tokenizer, self.index_addresses.is_empty()) {
            (false, _) => "load",
            (true, true) => "approximate",
            (true, false) => "precise",
        }
    }

    /// The discovery section (`pools[0].discovery.kubernetes`) these flags mean.
    fn kubernetes(&self) -> Result<RawKubernetes, ConfigError> {
        let mut section = serde_json::Map::new();
        match &self.selection {
            ChartSelection::InferencePool { name, group } => {
                if group != DEFAULT_POOL_GROUP {
                    return Err(ConfigError::at(
                        "--pool-group",
                        format_args!(
                            "kvroute discovers GIE v1 InferencePools ({DEFAULT_POOL_GROUP}); \
                             {group:?} is not supported (got {group:?})"
                        ),
                    ));
                }
                section.insert("inference_pool".into(), name.clone().into());
            }
            ChartSelection::Selector { labels, ports, .. } => {
                section.insert("selector".into(), selector(labels)?.into_iter().collect());
                let port: u16 = ports.trim().parse().map_err(|_| {
                    ConfigError::at(
                        "--endpoint-target-ports",
                        format_args!("one port number is supported (got {ports:?})"),
                    )
                })?;
                section.insert("target_port".into(), port.into());
            }
        }
        if let Some(namespace) = &self.namespace {
            section.insert("namespace".into(), namespace.clone().into());
        }
        if let Some(path) = &self.kubeconfig {
            section.insert("kubeconfig".into(), path.display().to_string().into());
        }
        serde_json::from_value(section.into())
            .map_err(|e| ConfigError::at("--pool-name", format_args!("{e}")))
    }

    /// The raw config these flags stand for (see the module docs).
    fn raw(&self) -> Result<RawConfig, ConfigError> {
        let all_interfaces = |port: u16| {
            Some(ListenAddr(std::net::SocketAddr::from((
                std::net::Ipv4Addr::UNSPECIFIED,
                port,
            ))))
        };
        let mut raw = RawConfig::default();
        raw.listen.grpc = all_interfaces(CHART_GRPC_PORT);
        raw.listen.health = all_interfaces(CHART_HEALTH_PORT);
        raw.listen.admin = all_interfaces(CHART_METRICS_PORT);
        raw.listen.secure_serving = Some(CHART_SECURE_SERVING);
        raw.index.addresses.clone_from(&self.index_addresses);
        let tokenizer = (self.tokenizer_model_dir.is_some() || self.tokenizer_render.is_some())
            .then(|| RawTokenizer {
                model_dir: self.tokenizer_model_dir.clone(),
                render: self.tokenizer_render.clone(),
                ..RawTokenizer::default()
            });
        raw.pools.push(RawPool {
            name: Some(self.name().to_owned()),
            models: self.models.clone(),
            any_model: self.models.is_empty(),
            events: Some(!self.index_addresses.is_empty()),
            tokenizer,
            discovery: Some(RawPoolDiscovery {
                kubernetes: Some(self.kubernetes()?),
            }),
            ..RawPool::default()
        });
        Ok(raw)
    }
}

/// `k=v,k2=v2` (`matchLabels` only; no set-based operators).
fn selector(labels: &str) -> Result<BTreeMap<String, serde_json::Value>, ConfigError> {
    labels
        .split(',')
        .map(|pair| match pair.trim().split_once('=') {
            Some((key, value)) if !key.is_empty() && !key.contains('!') => {
                Ok((key.trim().to_owned(), value.trim_start_matches('=').into()))
            }
            _ => Err(ConfigError::at(
                "--endpoint-selector",
                format_args!("expected key=value[,key=value] (got {labels:?})"),
            )),
        })
        .collect()
}

impl Config {
    /// The configuration a chart's flags imply (no config file), with the other chart flags
    /// (`overrides`) applied on top.
    pub fn from_chart_flags(pool: &ChartPool, overrides: &Overrides) -> Result<Self, ConfigError> {
        let mut raw = pool.raw()?;
        overrides.apply(&mut raw);
        Self::try_from(raw)
    }

    /// With both `--config` and the pool flags, the file must be what the flags name: a pool
    /// discovering that InferencePool (or that selector), in that namespace when the file names
    /// one; the flags that only build a config (index address, model, tokenizer) must go in the
    /// file instead. Refused otherwise, so neither silently wins. (`--kubeconfig`, which
    /// `KUBECONFIG` may set for other tools, is left to the file's own connection.)
    pub fn check_chart_flags(&self, pool: &ChartPool) -> Result<(), ConfigError> {
        let only_without_file = [
            ("--index-address", !pool.index_addresses.is_empty()),
            ("--model", !pool.models.is_empty()),
            ("--tokenizer-model-dir", pool.tokenizer_model_dir.is_some()),
            ("--tokenizer-render", pool.tokenizer_render.is_some()),
        ];
        if let Some((flag, _)) = only_without_file.iter().find(|(_, given)| *given) {
            return Err(ConfigError::at(
                *flag,
                "builds a configuration without --config; with --config, set it in the file",
            ));
        }
        let wanted = pool.kubernetes()?;
        let wanted = kvroute_discovery::KubernetesSource::try_from(wanted)
            .map_err(|e| e.within("--pool-name"))?;
        let found = self
            .pools
            .iter()
            .filter_map(|p| p.discovery.as_ref())
            .any(|source| {
                source.target == wanted.target
                    && (source.namespace.is_none()
                        || wanted.namespace.is_none()
                        || source.namespace == wanted.namespace)
            });
        if found {
            Ok(())
        } else {
            Err(ConfigError::at(
                "--pool-name",
                format_args!(
                    "the config file has no pool discovering {:?}{}: with --config the pools come \
                     from the file, so name it there (pools[].discovery.kubernetes) or drop --config",
                    pool.name(),
                    wanted
                        .namespace
                        .as_deref()
                        .map(|ns| format!(" in namespace {ns:?}"))
                        .unwrap_or_default()
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(name: &str) -> ChartPool {
        ChartPool {
            selection: ChartSelection::InferencePool {
                name: name.into(),
                group: DEFAULT_POOL_GROUP.into(),
            },
            namespace: Some("llm".into()),
            kubeconfig: None,
            index_addresses: Vec::new(),
            models: Vec::new(),
            tokenizer_model_dir: None,
            tokenizer_render: None,
        }
    }

    #[test]
    fn the_flags_build_the_config_a_user_would_write() {
        let config = Config::from_chart_flags(&chart("llama"), &Overrides::default()).unwrap();
        assert_eq!(config.grpc_addr, "0.0.0.0:9002".parse().unwrap());
        assert_eq!(config.health_addr, Some("0.0.0.0:9003".parse().unwrap()));
        assert_eq!(config.admin_addr, "0.0.0.0:9090".parse().unwrap());
        assert!(config.secure_serving);
        let pool = &config.pools[0];
        assert_eq!(pool.name, "llama");
        assert!(pool.serves_any_model() && !pool.events);
        assert_eq!(pool.tokenizer, super::super::TokenizerSource::None);
        let source = pool.discovery.as_ref().unwrap();
        assert_eq!(
            source.target,
            kvroute_discovery::Target::InferencePool("llama".into())
        );
        assert_eq!(source.namespace.as_deref(), Some("llm"));
        assert_eq!(source.connection, kvroute_discovery::Connection::InCluster);
        // Every model is the pool's, a model-less request too.
        assert_eq!(config.pool_for_model("any").map(|(i, _)| i), Some(0));
        assert_eq!(config.pool_for_model("").map(|(i, _)| i), Some(0));

        let written = Config::from_yaml(
            "listen: {grpc: 0.0.0.0:9002, health: 0.0.0.0:9003, admin: 0.0.0.0:9090, secure_serving: true}\n\
             pools:\n- {name: llama, models: [m], events: false, discovery: {kubernetes: {inference_pool: llama, namespace: llm}}}\n",
        )
        .unwrap();
        let mut built = config.clone();
        built.pools[0].models = vec!["m".into()];
        assert_eq!(built, written, "the same config as the file");
    }

    #[test]
    fn an_index_and_a_tokenizer_make_it_precise_and_chart_flags_apply_on_top() {
        let pool = ChartPool {
            index_addresses: vec!["http://kvroute-index:9460".into()],
            models: vec!["llama".into()],
            tokenizer_model_dir: Some("/models/llama".into()),
            ..chart("llama")
        };
        let overrides = Overrides {
            grpc_port: Some(9100),
            secure_serving: Some(false),
            ..Overrides::default()
        };
        let config = Config::from_chart_flags(&pool, &overrides).unwrap();
        assert_eq!(config.grpc_addr, "0.0.0.0:9100".parse().unwrap());
        assert!(!config.secure_serving);
        assert!(config.pools[0].events);
        assert_eq!(config.pools[0].models, ["llama"]);
        assert_eq!(config.pool_for_model("other"), None);
        assert_eq!(pool.best_tier(), "precise");
    }

    #[test]
    fn what_kvroute_cannot_discover_is_refused() {
        let alpha = ChartPool {
            selection: ChartSelection::InferencePool {
                name: "p".into(),
                group: "inference.networking.x-k8s.io".into(),
            },
            ..chart("p")
        };
        let error = Config::from_chart_flags(&alpha, &Overrides::default()).unwrap_err();
        assert!(error.to_string().starts_with("--pool-group"), "{error}");
        let two_ports = ChartPool {
            selection: ChartSelection::Selector {
                labels: "app=vllm".into(),
                ports: "8000,8001".into(),
                name: None,
            },
            ..chart("p")
        };
        let error = Config::from_chart_flags(&two_ports, &Overrides::default()).unwrap_err();
        assert!(
            error.to_string().starts_with("--endpoint-target-ports"),
            "{error}"
        );
        let selector = ChartPool {
            selection: ChartSelection::Selector {
                labels: "app=vllm,tier=gpu".into(),
                ports: "8000".into(),
                name: None,
            },
            ..chart("p")
        };
        let config = Config::from_chart_flags(&selector, &Overrides::default()).unwrap();
        assert_eq!(config.pools[0].name, DEFAULT_SELECTOR_POOL_NAME);
    }

    #[test]
    fn with_a_file_the_flags_must_name_its_pool() {
        let file = Config::from_yaml(
            "pools:\n- {name: p, models: [m], discovery: {kubernetes: {inference_pool: llama, namespace: llm}}}\n",
        )
        .unwrap();
        assert!(file.check_chart_flags(&chart("llama")).is_ok());
        let other = file.check_chart_flags(&chart("other")).unwrap_err();
        assert!(other.to_string().starts_with("--pool-name"), "{other}");
        let elsewhere = ChartPool {
            namespace: Some("prod".into()),
            ..chart("llama")
        };
        assert!(file.check_chart_flags(&elsewhere).is_err());
        let indexed = ChartPool {
            index_addresses: vec!["http://i:9460".into()],
            ..chart("llama")
        };
        let error = file.check_chart_flags(&indexed).unwrap_err();
        assert!(error.to_string().starts_with("--index-address"), "{error}");
    }
}
