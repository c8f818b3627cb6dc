//! The configs a stack renders from what its processes bound: the index's, ext-proc's, the agent's and Envoy's (the shipped example patched with real addresses).

#[allow(clippy::wildcard_imports)]
use super::*;

/// The stack's pool in the schema ext-proc and the index share (`name`, `models`, `block_size`,
/// `key_scheme`), as the keys of a flow mapping: the same text goes into both configs, so both
/// key prompts alike by construction.
/// The pool's shared schema keys (`name, models, block_size, key_scheme`) for the sims of
/// `options`, as a YAML flow-mapping body.
pub fn pool_schema(options: &StackOptions) -> String {
    let engines: Vec<kvroute_config::Engine> = (0..options.replicas)
        .map(|i| options.engine_of(i))
        .collect();
    let key_scheme = if engines.iter().all(|&e| e == kvroute_config::Engine::Vllm) {
        format!(
            "{{kind: vllm-exact, hash_algo: {algo}, seed: \"{seed}\"}}",
            algo = options.hash_algo,
            seed = options.hash_seed,
        )
    } else if engines.iter().all(|&e| e == kvroute_config::Engine::Sglang) {
        "{kind: sglang-exact}".to_owned()
    } else {
        // Each family publishes its own hashes: one pool over both keys on their tokens.
        "{kind: token-chain}".to_owned()
    };
    format!(
        "name: {MODEL}, models: [{MODEL}], block_size: {bs}, key_scheme: {key_scheme}",
        bs = options.block_size,
    )
}

pub(super) fn agent_replica_ids(options: &StackOptions) -> Vec<String> {
    options
        .agent_replicas
        .iter()
        .map(|&replica| replica_id(replica))
        .collect()
}

/// The agent's config: it mirrors [`StackOptions::agent_replicas`] and streams to every index.
pub(super) fn agent_config(
    options: &StackOptions,
    sources: &[EventSource],
    indexes: &[SocketAddr],
    token: &Path,
) -> String {
    let engines: String = options
        .agent_replicas
        .iter()
        .filter_map(|&replica| sources.get(replica).map(|source| (replica, source)))
        .map(|(replica, source)| {
            format!(
                "  - {{replica: {id}, endpoint: \"{endpoint}\", mode: {mode}, \
                 replay_endpoint: \"{replay}\", topic: \"{topic}\", \
                 data_parallel_size: {ranks}, reconnect_backoff_max: {RECONNECT_BACKOFF_MAX}}}\n",
                ranks = options.data_parallel_size.max(1),
                id = replica_id(replica),
                endpoint = source.endpoint,
                mode = source.mode.as_label(),
                replay = source.replay,
                topic = source.topic,
            )
        })
        .collect();
    let indexes = indexes
        .iter()
        .map(|addr| format!("\"http://{addr}\""))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "agent_id: {AGENT_ID}\ntoken_file: \"{}\"\nindexes: [{indexes}]\n\
         admin: \"127.0.0.1:0\"\nbatch_delay: 10ms\nreconnect_backoff_max: 200ms\n\
         engines:\n{engines}",
        token.display()
    )
}

pub(super) fn no_replica(replica: usize) -> StackError {
    StackError::NoSuchReplica {
        operation: "cuttable_event_streams",
        detail: format!("no replica {replica}"),
    }
}

/// How ext-proc reaches the index.
pub(super) enum IndexTarget<'a> {
    /// kvroute-index processes' gRPC listeners, tried in order.
    Addresses(&'a [SocketAddr]),
    /// A kvroute-index config file ext-proc runs itself.
    Embedded(&'a Path),
}

pub(super) fn ext_proc_config(
    options: &StackOptions,
    replicas: &[SocketAddr],
    refusing: &[SocketAddr],
    index: IndexTarget<'_>,
) -> String {
    let tokenizer = match &options.tokenizer {
        StackTokenizer::ModelDir(dir) => format!("{{model_dir: \"{}\"}}", dir.display()),
        StackTokenizer::RenderSim { sim, timeout } => format!(
            "{{render: \"http://{}\", timeout: {}ms}}",
            replicas
                .get(*sim)
                .map_or_else(String::new, ToString::to_string),
            timeout.as_millis()
        ),
        StackTokenizer::RenderUrl { url, timeout } => {
            format!("{{render: \"{url}\", timeout: {}ms}}", timeout.as_millis())
        }
    };
    let index = match index {
        IndexTarget::Addresses(indexes) => {
            let addresses = indexes
                .iter()
                .map(|addr| format!("\"http://{addr}\""))
                .collect::<Vec<_>>()
                .join(", ");
            format!("addresses: [{addresses}]")
        }
        IndexTarget::Embedded(config) => format!("embedded: \"{}\"", config.display()),
    };
    // Refusing replicas stay ready for ext-proc by scraping the first sim.
    let scraped = replicas
        .first()
        .map_or_else(String::new, ToString::to_string);
    let replicas: String = replicas
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            format!(
                "- {{id: {id}, pool: {MODEL}, address: \"{addr}\", metrics_url: \"http://{addr}/metrics\", \
                 data_parallel_size: {ranks}, engine: {engine}{role}}}\n",
                id = replica_id(i),
                engine = options.engine_of(i).as_label(),
                ranks = options.data_parallel_size.max(1),
                role = options
                    .replica_roles
                    .get(i)
                    .copied()
                    .flatten()
                    .map_or_else(String::new, |role| format!(", role: {}", role.as_label())),
            )
        })
        .collect();
    let refusing: String = refusing
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            format!(
                "- {{id: refusing-{i}, pool: {MODEL}, address: \"{addr}\", metrics_url: \"http://{scraped}/metrics\"}}\n"
            )
        })
        .collect();
    let replicas = replicas + &refusing;
    format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
         index: {{{index}, match_timeout: {match_ms}ms}}\n\
         budgets: {{decision: {decision_ms}ms, tokenize: {tokenize_ms}ms}}\n\
         scrape: {{interval: 200ms}}\n\
         scoring: {{prefill_ms_per_token: {prefill}, queue_ms_per_request: {queue}, \
         running_ms_per_request: {running}, kv_usage_ms: {kv}, hotspot_min_ms: {hot}{scoring_extra}}}\n\
         pools:\n- {{{pool}, tokenizer: {tokenizer}{pool_extra}}}\n\
         replicas:\n{replicas}",
        // The scoring's prefill cost is the sims' own, so its TTFT estimate is in real ms.
        prefill = options.timing.prefill_ms_per_token(),
        match_ms = options.budgets.match_timeout.as_millis(),
        decision_ms = options.budgets.decision.as_millis(),
        tokenize_ms = options.budgets.tokenize.as_millis(),
        // The other weights are ext-proc's defaults on the same (scaled) clock: a waiting or
        // running request costs the sims as much less as their prefill does.
        queue = 50.0 * options.timing.time_scale,
        running = 5.0 * options.timing.time_scale,
        kv = 100.0 * options.timing.time_scale,
        hot = 200.0 * options.timing.time_scale,
        pool = pool_schema(options),
        scoring_extra = if options.scoring_extra_config.is_empty() {
            String::new()
        } else {
            format!(", {}", options.scoring_extra_config)
        },
        pool_extra = if options.pool_extra_config.is_empty() {
            String::new()
        } else {
            format!(", {}", options.pool_extra_config)
        },
    )
}

/// Patches the production override_host config for this stack: admin and listener on port 0,
/// the pool's endpoints are the sims, the ext-proc cluster points at ext-proc; then adds the
/// plain round-robin listener and cluster of [`round_robin_config`].
pub fn render_envoy_config(
    production: &str,
    sims: &[SocketAddr],
    ext_proc: SocketAddr,
) -> Result<String, StackError> {
    let bad = |detail: &str| StackError::EnvoyConfig {
        detail: detail.to_owned(),
    };
    let parse = |text: &str| {
        serde_yaml::from_str::<Value>(text).map_err(|e| StackError::EnvoyConfig {
            detail: e.to_string(),
        })
    };
    let mut config = parse(production)?;
    let round_robin = parse(&round_robin_config(sims))?;

    *port_of(&mut config["admin"]["address"]).ok_or_else(|| bad("no admin address"))? =
        Value::from(0);
    let resources = &mut config["static_resources"];
    let listener = named(&mut resources["listeners"], KVROUTE_LISTENER)
        .ok_or_else(|| bad("no `kvroute` listener"))?;
    *port_of(&mut listener["address"]).ok_or_else(|| bad("no listener port"))? = Value::from(0);

    let pool = named(&mut resources["clusters"], "llm_pool")
        .ok_or_else(|| bad("no `llm_pool` cluster"))?;
    pool["load_assignment"]["endpoints"] = endpoints(sims);
    let ext_proc_cluster = named(&mut resources["clusters"], EXT_PROC_CLUSTER)
        .ok_or_else(|| bad("no `kvroute_ext_proc` cluster"))?;
    ext_proc_cluster["load_assignment"]["endpoints"] = endpoints(&[ext_proc]);

    let mut rr_listener = round_robin["static_resources"]["listeners"][0].clone();
    rr_listener["name"] = Value::from(ROUND_ROBIN_LISTENER);
    let rr_cluster = round_robin["static_resources"]["clusters"][0].clone();
    for (list, item) in [("listeners", rr_listener), ("clusters", rr_cluster)] {
        resources[list]
            .as_sequence_mut()
            .ok_or_else(|| bad(&format!("no {list} list")))?
            .push(item);
    }
    serde_yaml::to_string(&config).map_err(|e| StackError::EnvoyConfig {
        detail: e.to_string(),
    })
}

/// The shipped config with its ext_proc filter streaming request bodies (FULL_DUPLEX_STREAMED,
/// trailers sent) instead of buffering them.
pub fn with_full_duplex(config: &str) -> Result<String, StackError> {
    let bad = |detail: String| StackError::EnvoyConfig { detail };
    let mut config: Value = serde_yaml::from_str(config).map_err(|e| bad(e.to_string()))?;
    let filters = config
        .get_mut("static_resources")
        .and_then(|resources| named(resources.get_mut("listeners")?, KVROUTE_LISTENER))
        .and_then(|listener| listener.get_mut("filter_chains")?.get_mut(0))
        .and_then(|chain| chain.get_mut("filters")?.get_mut(0))
        .and_then(|manager| manager.get_mut("typed_config")?.get_mut("http_filters"))
        .ok_or_else(|| bad("no http_filters on the `kvroute` listener".to_owned()))?;
    let mode = named(filters, "envoy.filters.http.ext_proc")
        .and_then(|filter| filter.get_mut("typed_config")?.get_mut("processing_mode"))
        .and_then(Value::as_mapping_mut)
        .ok_or_else(|| bad("no ext_proc processing_mode".to_owned()))?;
    mode.insert("request_body_mode".into(), "FULL_DUPLEX_STREAMED".into());
    mode.insert("request_trailer_mode".into(), "SEND".into());
    serde_yaml::to_string(&config).map_err(|e| bad(e.to_string()))
}

/// `config` (a rendered [`OVERRIDE_HOST_CONFIG`]) with [`ENGINE_RETRY_POLICY`] on every route of
/// the kvroute listener.
pub fn with_engine_retries(config: &str) -> Result<String, StackError> {
    let bad = |detail: String| StackError::EnvoyConfig { detail };
    let mut config: Value = serde_yaml::from_str(config).map_err(|e| bad(e.to_string()))?;
    let policy: Value =
        serde_yaml::from_str(ENGINE_RETRY_POLICY).map_err(|e| bad(e.to_string()))?;
    let routes = config
        .get_mut("static_resources")
        .and_then(|resources| named(resources.get_mut("listeners")?, KVROUTE_LISTENER))
        .and_then(|listener| listener.get_mut("filter_chains")?.get_mut(0))
        .and_then(|chain| chain.get_mut("filters")?.get_mut(0))
        .and_then(|manager| manager.get_mut("typed_config")?.get_mut("route_config"))
        .and_then(|routes| routes.get_mut("virtual_hosts")?.as_sequence_mut())
        .ok_or_else(|| bad("no virtual_hosts on the `kvroute` listener".to_owned()))?;
    for host in routes {
        let Some(list) = host.get_mut("routes").and_then(Value::as_sequence_mut) else {
            continue;
        };
        for route in list {
            if let Some(action) = route.get_mut("route").and_then(Value::as_mapping_mut) {
                action.insert(Value::from("retry_policy"), policy.clone());
            }
        }
    }
    serde_yaml::to_string(&config).map_err(|e| bad(e.to_string()))
}

/// `config` (a rendered [`OVERRIDE_HOST_CONFIG`]) whose pool cluster falls back to round robin
/// (Envoy's choice when kvroute names no destination) instead of least-request.
pub fn with_round_robin_fallback(config: &str) -> Result<String, StackError> {
    let bad = |detail: String| StackError::EnvoyConfig { detail };
    let mut config: Value = serde_yaml::from_str(config).map_err(|e| bad(e.to_string()))?;
    let round_robin: Value = serde_yaml::from_str(
        "policies: [{typed_extension_config: {name: envoy.load_balancing_policies.round_robin, \
         typed_config: {\"@type\": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin}}}]",
    )
    .map_err(|e| bad(e.to_string()))?;
    let override_host = config
        .get_mut("static_resources")
        .and_then(|resources| named(resources.get_mut("clusters")?, "llm_pool"))
        .and_then(|pool| {
            pool.get_mut("load_balancing_policy")?
                .get_mut("policies")?
                .get_mut(0)
        })
        .and_then(|policy| {
            policy
                .get_mut("typed_extension_config")?
                .get_mut("typed_config")
        })
        .and_then(Value::as_mapping_mut)
        .ok_or_else(|| bad("no override_host policy on `llm_pool`".to_owned()))?;
    override_host.insert(Value::from("fallback_policy"), round_robin);
    serde_yaml::to_string(&config).map_err(|e| bad(e.to_string()))
}

/// `config` with every one of `ext_procs` behind the ext_proc cluster (Envoy balances the
/// per-request ext_proc streams over them round robin, the cluster's default).
pub fn with_ext_procs(config: &str, ext_procs: &[SocketAddr]) -> Result<String, StackError> {
    let bad = |detail: String| StackError::EnvoyConfig { detail };
    let mut config: Value = serde_yaml::from_str(config).map_err(|e| bad(e.to_string()))?;
    let cluster = config
        .get_mut("static_resources")
        .and_then(|resources| named(resources.get_mut("clusters")?, EXT_PROC_CLUSTER))
        .ok_or_else(|| bad("no `kvroute_ext_proc` cluster".to_owned()))?;
    cluster["load_assignment"]["endpoints"] = endpoints(ext_procs);
    serde_yaml::to_string(&config).map_err(|e| bad(e.to_string()))
}

/// `config` with Envoy's own tracing on the `kvroute` listener: the OpenTelemetry tracer (service
/// `envoy`) exporting over OTLP/gRPC to `collector`. Envoy then passes its context to ext_proc as
/// gRPC metadata.
pub fn with_envoy_tracing(config: &str, collector: SocketAddr) -> Result<String, StackError> {
    let bad = |detail: String| StackError::EnvoyConfig { detail };
    let mut config: Value = serde_yaml::from_str(config).map_err(|e| bad(e.to_string()))?;
    let tracing: Value = serde_yaml::from_str(
        r#"{provider: {name: envoy.tracers.opentelemetry, typed_config: {
            "@type": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig,
            grpc_service: {envoy_grpc: {cluster_name: otel_collector}, timeout: 1s},
            service_name: envoy}}}"#,
    )
    .map_err(|e| bad(e.to_string()))?;
    let cluster: Value = serde_yaml::from_str(&format!(
        r#"{{name: otel_collector, type: STATIC, connect_timeout: 1s,
            typed_extension_protocol_options: {{envoy.extensions.upstreams.http.v3.HttpProtocolOptions: {{
              "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions,
              explicit_http_config: {{http2_protocol_options: {{}}}}}}}},
            load_assignment: {{cluster_name: otel_collector, endpoints: [{{lb_endpoints: [
              {{endpoint: {{address: {{socket_address: {{address: "{}", port_value: {}}}}}}}}}]}}]}}}}"#,
        collector.ip(),
        collector.port()
    ))
    .map_err(|e| bad(e.to_string()))?;
    let resources = config
        .get_mut("static_resources")
        .ok_or_else(|| bad("no static_resources".to_owned()))?;
    let manager = named(
        resources
            .get_mut("listeners")
            .ok_or_else(|| bad("no listeners".to_owned()))?,
        KVROUTE_LISTENER,
    )
    .and_then(|listener| listener.get_mut("filter_chains")?.get_mut(0))
    .and_then(|chain| chain.get_mut("filters")?.get_mut(0))
    .and_then(|manager| manager.get_mut("typed_config")?.as_mapping_mut())
    .ok_or_else(|| bad("no http_connection_manager on the `kvroute` listener".to_owned()))?;
    manager.insert(Value::from("tracing"), tracing);
    resources
        .get_mut("clusters")
        .and_then(Value::as_sequence_mut)
        .ok_or_else(|| bad("no clusters".to_owned()))?
        .push(cluster);
    serde_yaml::to_string(&config).map_err(|e| bad(e.to_string()))
}

pub(super) fn port_of(address: &mut Value) -> Option<&mut Value> {
    address.get_mut("socket_address")?.get_mut("port_value")
}

pub(super) fn named<'a>(list: &'a mut Value, name: &str) -> Option<&'a mut Value> {
    list.as_sequence_mut()?
        .iter_mut()
        .find(|item| item["name"] == name)
}

pub(super) fn endpoints(addrs: &[SocketAddr]) -> Value {
    let lb_endpoints: Vec<Value> = addrs
        .iter()
        .map(|addr| {
            serde_yaml::from_str(&format!(
                "endpoint: {{address: {{socket_address: {{address: \"{}\", port_value: {}}}}}}}",
                addr.ip(),
                addr.port()
            ))
            .unwrap_or(Value::Null)
        })
        .collect();
    let mut group = serde_yaml::Mapping::new();
    group.insert(Value::from("lb_endpoints"), Value::Sequence(lb_endpoints));
    Value::Sequence(vec![Value::Mapping(group)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_production_config_with_real_addresses() {
        let production =
            std::fs::read_to_string(workspace_root().join(OVERRIDE_HOST_CONFIG)).unwrap();
        let sims: Vec<SocketAddr> = vec![
            "127.0.0.1:4001".parse().unwrap(),
            "127.0.0.1:4002".parse().unwrap(),
            "127.0.0.1:4003".parse().unwrap(),
        ];
        let rendered =
            render_envoy_config(&production, &sims, "127.0.0.1:5001".parse().unwrap()).unwrap();
        let config: Value = serde_yaml::from_str(&rendered).unwrap();
        let resources = &config["static_resources"];
        assert_eq!(
            config["admin"]["address"]["socket_address"]["port_value"],
            0
        );
        let names: Vec<&str> = resources["listeners"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|l| l["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, [KVROUTE_LISTENER, ROUND_ROBIN_LISTENER]);
        assert!(!rendered.contains("18001") && !rendered.contains("50051"));
        assert!(rendered.contains("4003") && rendered.contains("5001"));
        // The production semantics survive: fail-open BUFFERED ext_proc, override_host pool.
        assert!(rendered.contains("failure_mode_allow: true"));
        assert!(rendered.contains("request_body_mode: BUFFERED"));
        assert!(rendered.contains("envoy.load_balancing_policies.override_host"));
        assert!(rendered.contains("remove: x-gateway-destination-endpoint"));
    }

    #[test]
    fn engine_retries_go_on_the_kvroute_route() {
        let production =
            std::fs::read_to_string(workspace_root().join(OVERRIDE_HOST_CONFIG)).unwrap();
        let sims: Vec<SocketAddr> = vec!["127.0.0.1:4001".parse().unwrap()];
        let rendered =
            render_envoy_config(&production, &sims, "127.0.0.1:5001".parse().unwrap()).unwrap();
        let kvroute_route = |config: &Value| {
            let listener = &config["static_resources"]["listeners"][0];
            assert_eq!(listener["name"], KVROUTE_LISTENER);
            listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
                ["virtual_hosts"][0]["routes"][0]["route"]
                .clone()
        };
        // The shipped policy retries refused connections only; the stack's adds `reset`.
        let shipped: Value = serde_yaml::from_str(&rendered).unwrap();
        assert_eq!(
            kvroute_route(&shipped)["retry_policy"]["retry_on"],
            "connect-failure,refused-stream"
        );
        let config: Value = serde_yaml::from_str(&with_engine_retries(&rendered).unwrap()).unwrap();
        let route = kvroute_route(&config);
        assert_eq!(route["cluster"], "llm_pool");
        assert_eq!(
            route["retry_policy"]["retry_on"],
            "connect-failure,refused-stream,reset"
        );
        assert_eq!(
            route["retry_policy"]["retry_host_predicate"][0]["name"],
            "envoy.retry_host_predicates.previous_hosts"
        );
        // The round-robin listener is left alone.
        assert!(
            config["static_resources"]["listeners"][1]
                .get("retry_policy")
                .is_none()
        );
    }

    fn listeners(grpc: u16, admin: u16) -> Listeners {
        Listeners {
            grpc: ([127, 0, 0, 1], grpc).into(),
            admin: ([127, 0, 0, 1], admin).into(),
        }
    }

    #[test]
    fn ready_files_parse() {
        assert_eq!(
            parse_ready_file("grpc=127.0.0.1:1\nadmin=127.0.0.1:2\n"),
            Some(ReadyFile {
                listeners: listeners(1, 2),
                embedded_index: None,
            })
        );
        assert_eq!(parse_ready_file("grpc=127.0.0.1:1\n"), None);
        assert_eq!(
            parse_ready_file(
                "grpc=127.0.0.1:1\nadmin=127.0.0.1:2\nindex_grpc=127.0.0.1:3\nindex_admin=127.0.0.1:4\n"
            ),
            Some(ReadyFile {
                listeners: listeners(1, 2),
                embedded_index: Some(listeners(3, 4)),
            })
        );
        // Half an embedded index is none.
        assert_eq!(
            parse_ready_file("grpc=127.0.0.1:1\nadmin=127.0.0.1:2\nindex_admin=127.0.0.1:4\n")
                .unwrap()
                .embedded_index,
            None
        );
    }

    #[test]
    fn embedded_index_configs_pin_their_bound_ports() {
        let config = index_config(&StackOptions::default(), &[], None);
        let pinned = pin_ports(&config, listeners(3, 4));
        assert!(pinned.starts_with("listen: {grpc: \"127.0.0.1:3\", admin: \"127.0.0.1:4\"}"));
        let ext_proc = ext_proc_config(
            &StackOptions::default(),
            &[],
            &[],
            IndexTarget::Embedded(Path::new("/tmp/x/index.yaml")),
        );
        assert!(ext_proc.contains("index: {embedded: \"/tmp/x/index.yaml\", match_timeout: "));
        assert!(!ext_proc.contains("addresses"));
    }
}
