//! The index config's tests: what is accepted, the defaults, and that every refusal names its
//! field path.

use std::time::Duration;

use kvroute_block_keys::{DEFAULT_BLOCK_SIZE, KeyScheme};
use kvroute_config::SocketMode;
use kvroute_index_core::index::VerifyHashes;

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
fn an_event_socket_reconnects_within_its_configured_cap() {
    let config = Config::from_yaml(
        "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: m, events: {endpoint: 'tcp://h:1', reconnect_backoff_max: 250ms}}]",
    )
    .unwrap();
    assert_eq!(
        config.replicas[0].reconnect_backoff_max,
        Duration::from_millis(250)
    );
    let socket = crate::server::Directory::ingest_config(&config, &config.replicas[0]).unwrap();
    assert_eq!(socket.reconnect_backoff_max, Duration::from_millis(250));
    let error = error_of(
        "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: m, events: {endpoint: 'tcp://h:1', reconnect_backoff_max: 250}}]",
    );
    assert!(
        error.starts_with("replicas[0].events.reconnect_backoff_max: "),
        "{error}"
    );
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
        kvroute_config::DEFAULT_MAX_MESSAGE_BYTES
    );
    assert_eq!(
        config.replicas[1].reconnect_backoff_max,
        kvroute_config::DEFAULT_EVENTS_RECONNECT_BACKOFF_MAX
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
    let error = error_of("limits: {replay_timeout: 5}\npools: [{name: p, models: [m]}]");
    assert!(error.starts_with("limits.replay_timeout: "), "{error}");
}

#[test]
fn keys_of_the_older_schema_are_refused_by_their_new_name() {
    let pool = "{name: p, models: [m]}";
    for (yaml, message) in [
        (
            format!("limits: {{replay_timeout_ms: 500}}\npools: [{pool}]"),
            "limits.replay_timeout_ms: this key was renamed: write `limits.replay_timeout: \"2s\"`",
        ),
        (
            format!("limits: {{agent_stale_grace_ms: 500}}\npools: [{pool}]"),
            "limits.agent_stale_grace_ms: this key was renamed: write `limits.agent_stale_grace: \"10s\"`",
        ),
        (
            "pools: [{model: m}]".to_owned(),
            "pools[0].model: this key was renamed: write `name: <pool name>` and `models: [<served model>, …]`",
        ),
        (
            "pools: [{name: p, models: [m], hash_algo: sha256}]".to_owned(),
            "pools[0].hash_algo: this key was renamed: write `key_scheme.hash_algo`",
        ),
        (
            "pools: [{name: p, models: [m], hash_seed: '0'}]".to_owned(),
            "pools[0].hash_seed: this key was renamed: write `key_scheme.seed`",
        ),
        (
            "pools: [{name: p, models: [m], vllm_version: 0.32.0}]".to_owned(),
            "pools[0].vllm_version: this key was renamed: write `key_scheme.vllm_version`",
        ),
        (
            "pools: [{name: p, models: [m], validate_hashes: true}]".to_owned(),
            "pools[0].validate_hashes: this key was renamed: write `verify_hashes: off | flag | required`",
        ),
        (
            "pools: [{name: p, models: [m], key_scheme: vllm-exact}]".to_owned(),
            "`key_scheme: vllm-exact` is now `key_scheme: {kind: vllm-exact}`",
        ),
        (
            format!(
                "pools: [{pool}]\nreplicas: [{{id: a, model: m, events: {{endpoint: 'tcp://h:1'}}}}]"
            ),
            "replicas[0].model: this key was renamed: write `pool: <pool name>`",
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
        assert!(err.starts_with(field), "{yaml}: {err}");
    }
}

#[test]
fn a_config_error_names_its_field_path() {
    let pool = "{name: m, models: [m]}";
    for (yaml, path, message) in [
        (
            "pools: [{name: p, models: [p]}, {name: q, models: [q], block_size: 0}]".to_owned(),
            "pools[1].block_size",
            "pools[1].block_size: expected 1..=4096 (got \"0\")",
        ),
        (
            format!(
                "pools: [{pool}]\nreplicas: [{{id: a, pool: m, events: {{endpoint: 'tcp://h:1', mode: pull}}}}]"
            ),
            "replicas[0].events.mode",
            "replicas[0].events.mode: unknown variant `pull`, expected `connect` or `bind`",
        ),
        (
            format!(
                "pools: [{pool}]\nreplicas: [{{id: a, pool: m, events: {{endpoint: 'tcp://h:1', allowed_peers: [10.0.0.1]}}}}]"
            ),
            "replicas[0].events.allowed_peers",
            "replicas[0].events.allowed_peers: applies to bind mode only (in connect mode kvroute chooses its peer)",
        ),
        (
            format!("pools: [{pool}]\nlimits: {{replay_timeout: 2}}"),
            "limits.replay_timeout",
            "limits.replay_timeout: expected a duration such as 50ms, 2s, 1m (got \"2\")",
        ),
    ] {
        let error = Config::from_yaml(&yaml).unwrap_err();
        assert_eq!(error.path(), path, "{yaml}");
        assert!(error.to_string().starts_with(message), "{yaml}: {error}");
    }
}

#[test]
fn an_unknown_key_inside_a_list_element_names_its_path() {
    let error = Config::from_yaml(
        "pools: [{name: m, models: [m]}]\nreplicas: [{id: a, pool: m, events: {endpoint: 'tcp://h:1'}}, \
         {id: b, pool: m, events: {endpoint: 'tcp://h:2', topik: kv}}]",
    )
    .unwrap_err();
    assert_eq!(error.path(), "replicas[1].events.topik");
    assert!(
        error
            .to_string()
            .starts_with("replicas[1].events.topik: unknown key, expected one of"),
        "{error}"
    );
}

#[test]
fn data_parallel_ranks_are_replicas_of_their_own_fed_by_each_ranks_sockets() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "agent-secret\n").unwrap();
    let yaml = format!(
        r#"
listen: {{grpc: "127.0.0.1:0", admin: "127.0.0.1:0"}}
pools:
  - {{name: tiny, models: [tiny], key_scheme: {{kind: token-chain}}}}
replicas:
  - id: pod-a
    pool: tiny
    events: {{endpoint: "tcp://10.0.0.5:5557", replay_endpoint: "tcp://10.0.0.5:5600", data_parallel_size: 3}}
  - id: pod-b
    pool: tiny
    events: {{data_parallel_size: 2}}
agents:
  - {{id: node-1, token_file: "{}", replicas: [pod-b]}}
"#,
        token.display()
    );
    let config = Config::from_yaml(&yaml).unwrap();
    let ranks: Vec<(&str, &str, Option<&str>, u32, bool)> = config
        .replicas
        .iter()
        .map(|r| {
            (
                r.id.as_str(),
                r.endpoint.as_str(),
                r.replay_endpoint.as_deref(),
                r.dp_rank,
                r.dp_rank_checked,
            )
        })
        .collect();
    assert_eq!(
        ranks,
        [
            (
                "pod-a@dp0",
                "tcp://10.0.0.5:5557",
                Some("tcp://10.0.0.5:5600"),
                0,
                true
            ),
            (
                "pod-a@dp1",
                "tcp://10.0.0.5:5558",
                Some("tcp://10.0.0.5:5601"),
                1,
                true
            ),
            (
                "pod-a@dp2",
                "tcp://10.0.0.5:5559",
                Some("tcp://10.0.0.5:5602"),
                2,
                true
            ),
            ("pod-b@dp0", "", None, 0, true),
            ("pod-b@dp1", "", None, 1, true),
        ]
    );
    assert_eq!(
        config.agents[0].replicas,
        ["pod-b@dp0", "pod-b@dp1"],
        "owning a replica is owning each of its ranks"
    );

    let error = Config::from_yaml(&GOOD.replace(
        "replay_endpoint: \"tcp://127.0.0.1:5558\"}",
        "replay_endpoint: \"tcp://127.0.0.1:5558\", data_parallel_size: 300}",
    ))
    .unwrap_err()
    .to_string();
    assert!(
        error.starts_with("replicas[0].events.data_parallel_size:"),
        "{error}"
    );
}

#[test]
fn a_replicas_engine_must_publish_the_hashes_its_pool_keys_on() {
    let yaml = |pool_kind: &str, engine: &str| {
        format!(
            r#"
listen: {{grpc: "127.0.0.1:0", admin: "127.0.0.1:0"}}
pools:
  - {{name: s, models: [s], key_scheme: {{kind: {pool_kind}}}}}
replicas:
  - {{id: a, pool: s, events: {{endpoint: "tcp://127.0.0.1:5557", engine: {engine}}}}}
"#
        )
    };
    let config = Config::from_yaml(&yaml("sglang-exact", "sglang")).unwrap();
    assert_eq!(config.replicas[0].engine, Engine::Sglang);
    let config = Config::from_yaml(&yaml("token-chain", "sglang")).unwrap();
    assert_eq!(config.replicas[0].engine, Engine::Sglang);
    for (kind, engine) in [("sglang-exact", "vllm"), ("vllm-exact", "sglang")] {
        let error = error_of(&yaml(kind, engine));
        assert!(error.contains("replicas[0].events.engine"), "{error}");
    }
    assert!(error_of(&yaml("token-chain", "trtllm")).contains("engine"));
}
