//! The config's tests: what is accepted, its defaults, and errors naming their field.

use super::*;
use kvroute_config::parse_duration;

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
    let remote = Config::from_yaml(&with(r#"{remote: "http://10.0.0.5:8000/tokenize"}"#)).unwrap();
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
    assert_eq!(config.admin_addr, DEFAULT_ADMIN_ADDR);
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
        log_format: Some(kvroute_config::LogFormat::Json),
    };
    let file = format!("{MINIMAL}listen: {{grpc: \"127.0.0.1:1\", secure_serving: false}}\n");
    let config = Config::from_yaml_with(&file, &overrides).unwrap();
    assert_eq!(config.log_format, kvroute_config::LogFormat::Json);
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
    assert_eq!(config.grpc_addr, DEFAULT_GRPC_ADDR);
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
    let overload = format!("{MINIMAL}scoring: {{overload_queue_ms: 0, overload_imbalance: 1.2}}\n");
    let config = Config::from_yaml(&overload).unwrap();
    assert_eq!(config.scoring.overload_queue_ms, 0.0);
    assert_eq!(config.scoring.overload_imbalance, 1.2);
    let below_one = format!("{MINIMAL}scoring: {{overload_imbalance: 0.9}}\n");
    assert!(error_of(&below_one).contains("scoring.overload_imbalance"));
    let negative = format!("{MINIMAL}scoring: {{overload_queue_ms: -5}}\n");
    assert!(error_of(&negative).contains("scoring.overload_queue_ms"));
    let idle = format!("{MINIMAL}scoring: {{idle_pool_ms: 0}}\n");
    assert_eq!(Config::from_yaml(&idle).unwrap().scoring.idle_pool_ms, 0.0);
    // The idle pool's own hotspot guard is gone (an idle pool spreads bursts by what the index
    // confirms): its keys are refused by name, not ignored.
    let removed = format!("{MINIMAL}scoring: {{idle_hotspot_factor: 1.3}}\n");
    assert!(error_of(&removed).contains("idle_hotspot_factor"));
    let negative = format!("{MINIMAL}scoring: {{idle_pool_ms: -1}}\n");
    assert!(error_of(&negative).contains("scoring.idle_pool_ms"));
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
    assert_eq!(match_timeout("250ms").unwrap(), Duration::from_millis(250));
    assert_eq!(match_timeout("1.5s").unwrap(), Duration::from_millis(1500));
    assert!(match_timeout("-1s").is_err());
    assert!(match_timeout("5").is_err());
}

/// `index.match_timeout: text` read through the whole config (any duration key reads alike).
fn match_timeout(text: &str) -> Result<Duration, ConfigError> {
    Config::from_yaml(&format!("{MINIMAL}index: {{match_timeout: \"{text}\"}}\n"))
        .map(|config| config.match_timeout)
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
            match_timeout(text).ok(),
            parse_duration(text).ok(),
            "{text}"
        );
    }
}

#[cfg(feature = "embedded-index")]
#[test]
fn embedded_index_is_loaded_and_validated_with_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let with =
        |path: &std::path::Path| format!("{MINIMAL}index: {{embedded: \"{}\"}}\n", path.display());
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

/// The keys that name a mode or an action take exactly the spellings they always took.
#[test]
fn enum_keys_accept_exactly_their_spellings() {
    for (yaml, mode) in [
        ("", BodyMode::Buffered),
        ("default_body_mode: buffered", BodyMode::Buffered),
        (
            "default_body_mode: full_duplex_streamed",
            BodyMode::FullDuplexStreamed,
        ),
    ] {
        let config = Config::from_yaml(&format!("{MINIMAL}{yaml}\n")).unwrap();
        assert_eq!(config.default_body_mode, mode, "{yaml}");
    }
    for (yaml, field) in [
        ("default_body_mode: Buffered", "default_body_mode"),
        ("default_body_mode: streamed", "default_body_mode"),
        ("default_body_mode: 1", "default_body_mode"),
        ("drift: {action: Warn}", "drift.action"),
        ("debug_headers: {expose: Always}", "debug_headers.expose"),
        ("debug_headers: {expose: true}", "debug_headers.expose"),
    ] {
        let error = error_of(&format!("{MINIMAL}{yaml}\n"));
        assert!(error.contains(field), "{yaml}: {error}");
    }
    let warn = Config::from_yaml(&format!("{MINIMAL}drift: {{action: warn}}\n")).unwrap();
    assert_eq!(warn.drift.action, DriftAction::Warn);
    let never = Config::from_yaml(&format!("{MINIMAL}debug_headers: {{expose: never}}\n")).unwrap();
    assert_eq!(never.debug_headers, DebugHeaders::Never);
}

/// The error of `yaml` (MINIMAL plus a second pool `q` and `extra`), which must be refused.
fn refused(extra: &str) -> ConfigError {
    let two_pools = MINIMAL.replace(
        "replicas:\n",
        "- {name: q, models: [other], block_size: 16, key_scheme: {kind: token-chain}}\nreplicas:\n",
    );
    let yaml = format!("{two_pools}{extra}");
    match Config::from_yaml(&yaml) {
        Ok(_) => panic!("config should be rejected:\n{yaml}"),
        Err(error) => {
            // One format: `path: reason`.
            assert_eq!(
                error.to_string(),
                format!("{}: {}", error.path(), error.reason())
            );
            error
        }
    }
}

#[test]
fn a_serde_error_in_a_list_element_names_its_path() {
    let yaml = MINIMAL.replace(
        "replicas:\n",
        "- {name: q, models: [other], blok_size: 16}\nreplicas:\n",
    );
    let error = Config::from_yaml(&yaml).unwrap_err();
    assert_eq!(error.path(), "pools[1].blok_size", "{error}");
    assert!(
        error
            .to_string()
            .starts_with("pools[1].blok_size: unknown key"),
        "{error}"
    );
    let error = refused("- {id: r1, pool: q, address: \"127.0.0.1:8001\", weight: 2}\n");
    assert_eq!(error.path(), "replicas[1].weight", "{error}");
    let error = refused("- {id: r1, pool: q, address: [1]}\n");
    assert_eq!(error.path(), "replicas[1].address", "{error}");
    let error = refused("index: {addresses: [{url: x}]}\n");
    assert_eq!(error.path(), "index.addresses[0]", "{error}");
}

#[test]
fn a_leaf_validation_error_names_its_path() {
    let error = Config::from_yaml(&MINIMAL.replace(
        "  block_size: 16\n",
        "  block_size: 16\n  tokenizer: {remote: \"http://a:1/tokenize\", timeout: soon}\n",
    ))
    .unwrap_err();
    assert_eq!(error.path(), "pools[0].tokenizer.timeout", "{error}");
    assert!(
        error
            .to_string()
            .starts_with("pools[0].tokenizer.timeout: expected a duration"),
        "{error}"
    );
    for (extra, path) in [
        ("budgets: {decision: 5}\n", "budgets.decision"),
        ("drift: {window: 1h}\n", "drift.window"),
        ("listen: {grpc: nowhere}\n", "listen.grpc"),
        (
            "- {id: r1, pool: q, address: \"10.0.0.1\"}\n",
            "replicas[1].address",
        ),
        ("drift: {action: degrade}\n", "drift.action"),
    ] {
        let error = refused(extra);
        assert_eq!(error.path(), path, "{extra}: {error}");
    }
}

#[test]
fn a_cross_field_error_names_its_path() {
    for (extra, path) in [
        (
            "- {id: r1, pool: q, address: \"127.0.0.1:8000\"}\n",
            "replicas[1].address",
        ),
        (
            "- {id: r1, pool: nope, address: \"127.0.0.1:8001\"}\n",
            "replicas[1].pool",
        ),
        (
            "budgets: {decision: 10ms, tokenize: 20ms}\n",
            "budgets.tokenize",
        ),
        (
            "index: {addresses: [\"https://index:7070\"]}\n",
            "index.addresses[0]",
        ),
        (
            "drift: {bound: 0.3, clear_below: 0.4}\n",
            "drift.clear_below",
        ),
        (
            "epp: {shedding: {queue_depth: 0}}\n",
            "epp.shedding.queue_depth",
        ),
        ("default_pool: nope\n", "default_pool"),
        (
            "debug_headers: {token_file: /x}\n",
            "debug_headers.token_file",
        ),
        ("listen: {admin: \"127.0.0.1:9002\"}\n", "listen.admin"),
    ] {
        let error = refused(extra);
        assert_eq!(error.path(), path, "{extra}: {error}");
    }
    let dup = MINIMAL.replace(
        "replicas:\n",
        "- {name: p, models: [other], block_size: 16}\nreplicas:\n",
    );
    let error = Config::from_yaml(&dup).unwrap_err();
    assert_eq!(error.path(), "pools[1].name", "{error}");
    let bad_block = MINIMAL.replace(
        "replicas:\n",
        "- {name: q, models: [other], block_size: 0}\nreplicas:\n",
    );
    let error = Config::from_yaml(&bad_block).unwrap_err();
    assert_eq!(error.path(), "pools[1].block_size", "{error}");
    let lora = MINIMAL.replace("{name: lora-a, path: /adapters/lora-a}", "lora-a");
    let error = Config::from_yaml(&lora).unwrap_err();
    assert_eq!(error.path(), "pools[0].adapters[0]", "{error}");
}

/// The reference is generated from the raw structs' schema: every key of every section (ours
/// and the shared ones) carries its doc.
#[test]
fn every_key_of_the_schema_is_documented() {
    let schema = serde_json::to_value(schemars::schema_for!(RawConfig)).unwrap();
    let mut undocumented = Vec::new();
    let mut sections = vec![("".to_owned(), &schema)];
    if let Some(defs) = schema.get("$defs").and_then(|d| d.as_object()) {
        sections.extend(defs.iter().map(|(name, def)| (name.clone(), def)));
    }
    let mut count = 0;
    while let Some((name, section)) = sections.pop() {
        for variant in section
            .get("anyOf")
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
        {
            sections.push((name.clone(), variant));
        }
        for (key, field) in section
            .get("properties")
            .and_then(|p| p.as_object())
            .into_iter()
            .flatten()
        {
            count += 1;
            if field.get("description").is_none() {
                undocumented.push(format!("{name}.{key}"));
            }
        }
    }
    assert!(count > 60, "{count} keys");
    assert!(undocumented.is_empty(), "undocumented: {undocumented:?}");
    assert_eq!(
        schema.pointer("/$defs/RawIndex/properties/match_timeout/default"),
        Some(&serde_json::json!("20ms"))
    );
    assert_eq!(
        schema.pointer("/$defs/RawListen/properties/grpc/default"),
        Some(&serde_json::json!("127.0.0.1:9002"))
    );
}

#[test]
fn a_pool_routes_unless_it_is_in_shadow_mode() {
    assert_eq!(
        Config::from_yaml(MINIMAL).unwrap().pools[0].mode,
        PoolMode::Route
    );
    let shadow = MINIMAL.replace("  block_size: 16\n", "  block_size: 16\n  mode: shadow\n");
    assert_eq!(
        Config::from_yaml(&shadow).unwrap().pools[0].mode,
        PoolMode::Shadow
    );
    let wrong = MINIMAL.replace("  block_size: 16\n", "  block_size: 16\n  mode: mirror\n");
    assert!(
        error_of(&wrong).contains("pools[0].mode"),
        "{}",
        error_of(&wrong)
    );
}

#[test]
fn decision_records_are_bounded_and_off_unless_sampled() {
    let defaults = Config::from_yaml(MINIMAL).unwrap().decision_records;
    assert_eq!(
        (defaults.sample, defaults.keep),
        (DEFAULT_RECORD_SAMPLE, DEFAULT_RECORDS_KEPT)
    );
    assert_eq!(DEFAULT_RECORD_SAMPLE, 0.0);
    let sampled = format!("{MINIMAL}decision_records: {{sample: 0.25, keep: 10}}\n");
    let sampled = Config::from_yaml(&sampled).unwrap().decision_records;
    assert_eq!((sampled.sample, sampled.keep), (0.25, 10));
    let share = error_of(&format!("{MINIMAL}decision_records: {{sample: 1.5}}\n"));
    assert!(share.contains("decision_records.sample"), "{share}");
    let keep = error_of(&format!("{MINIMAL}decision_records: {{keep: 1000000}}\n"));
    assert!(keep.contains("decision_records.keep"), "{keep}");
}

#[test]
fn data_parallel_ranks_are_targets_of_their_own_behind_one_address() {
    let config = Config::from_yaml(&MINIMAL.replace(
        "address: \"127.0.0.1:8000\"}",
        "address: \"127.0.0.1:8000\", data_parallel_size: 2, metrics_url: \"http://127.0.0.1:8000/metrics\"}\n- {id: r1, pool: p, address: \"127.0.0.1:8001\"}",
    ))
    .unwrap();
    let targets: Vec<(&str, String, Option<u32>)> = config
        .replicas
        .iter()
        .map(|r| (r.id.as_str(), r.address.to_string(), r.dp_rank))
        .collect();
    assert_eq!(
        targets,
        [
            ("r0@dp0", "127.0.0.1:8000".to_owned(), Some(0)),
            ("r0@dp1", "127.0.0.1:8000".to_owned(), Some(1)),
            ("r1", "127.0.0.1:8001".to_owned(), None),
        ]
    );
    assert!(config.replicas[..2].iter().all(|r| r.metrics_url.is_some()));
    assert!(
        error_of(&MINIMAL.replace(
            "address: \"127.0.0.1:8000\"}",
            "address: \"127.0.0.1:8000\", data_parallel_size: 0}"
        ))
        .contains("replicas[0].data_parallel_size")
    );
}

#[test]
fn a_prefill_only_replica_needs_a_disaggregated_pool() {
    let error = error_of(&MINIMAL.replace(
        "address: \"127.0.0.1:8000\"}",
        "address: \"127.0.0.1:8000\", role: prefill}",
    ));
    assert!(error.contains("replicas[0].role"), "{error}");
    let config = Config::from_yaml(&MINIMAL.replace(
        "  key_scheme: {kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}\n",
        "  key_scheme: {kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}\n  disaggregation: {}\n",
    )
    .replace(
        "address: \"127.0.0.1:8000\"}",
        "address: \"127.0.0.1:8000\", role: prefill}\n- {id: r1, pool: p, address: \"127.0.0.1:8001\", role: decode}",
    ))
    .unwrap();
    let disaggregation = config.pools[0].disaggregation.unwrap();
    assert_eq!(
        (
            disaggregation.min_prompt_tokens,
            disaggregation.min_uncached_tokens
        ),
        (1024, 512),
        "llm-d's documented example"
    );
}

#[test]
fn the_prefill_leg_keys_have_defaults_and_belong_to_envoy_mode() {
    let with = |disaggregation: &str| {
        MINIMAL.replace(
            "  key_scheme: {kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}\n",
            &format!(
                "  key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}}\n  disaggregation: {disaggregation}\n"
            ),
        )
    };
    let sidecar = Config::from_yaml(&with("{}")).unwrap();
    let rule = sidecar.pools[0].disaggregation.unwrap();
    assert_eq!(rule.mode, DisaggregationMode::Sidecar);
    assert_eq!(rule.max_prefill_queue, Some(DEFAULT_MAX_PREFILL_QUEUE));
    let bounded = Config::from_yaml(&with("{max_prefill_queue: 250ms}")).unwrap();
    assert_eq!(
        bounded.pools[0]
            .disaggregation
            .unwrap()
            .rule()
            .max_prefill_queue,
        Some(Duration::from_millis(250))
    );
    assert_eq!(
        rule.prefill,
        PrefillLegSettings {
            timeout: DEFAULT_PREFILL_TIMEOUT,
            retries: DEFAULT_PREFILL_RETRIES,
            max_concurrent: DEFAULT_MAX_CONCURRENT_PREFILLS,
        }
    );
    let envoy = Config::from_yaml(&with(
        "{mode: envoy, prefill_timeout: 5s, prefill_retries: 0, max_concurrent_prefills: 8}",
    ))
    .unwrap();
    let rule = envoy.pools[0].disaggregation.unwrap();
    assert_eq!(rule.mode, DisaggregationMode::Envoy);
    assert_eq!(
        rule.prefill,
        PrefillLegSettings {
            timeout: Duration::from_secs(5),
            retries: 0,
            max_concurrent: 8,
        }
    );
    for (yaml, field) in [
        (
            "{prefill_timeout: 5s}",
            "pools[0].disaggregation.prefill_timeout",
        ),
        (
            "{mode: sidecar, prefill_retries: 1}",
            "pools[0].disaggregation.prefill_retries",
        ),
        (
            "{mode: envoy, max_concurrent_prefills: 0}",
            "pools[0].disaggregation.max_concurrent_prefills",
        ),
        (
            "{mode: envoy, prefill_timeout: 0s}",
            "pools[0].disaggregation.prefill_timeout",
        ),
        ("{mode: proxy}", "pools[0].disaggregation.mode"),
        (
            "{max_prefill_queue: 0s}",
            "pools[0].disaggregation.max_prefill_queue",
        ),
    ] {
        let error = error_of(&with(yaml));
        assert!(error.contains(field), "{yaml}: {error}");
    }
}

#[test]
fn sglang_replicas_need_keys_recomputed_from_their_tokens() {
    let sglang_pool = MINIMAL.replace("  block_size: 16\n", "  block_size: 16\n  engine: sglang\n");
    let error = error_of(&sglang_pool);
    assert!(error.contains("pools[0].engine"), "{error}");
    let sglang_replica = MINIMAL.replace(
        "address: \"127.0.0.1:8000\"}",
        "address: \"127.0.0.1:8000\", engine: sglang}",
    );
    let error = error_of(&sglang_replica);
    assert!(error.contains("replicas[0].engine"), "{error}");

    // A mixed pool on token-chain keys: each replica keeps its own family.
    let mixed = MINIMAL
        .replace(
            "  key_scheme: {kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}\n",
            "  key_scheme: {kind: token-chain}\n  engine: sglang\n",
        )
        .replace(
            "address: \"127.0.0.1:8000\"}",
            "address: \"127.0.0.1:8000\"}\n- {id: r1, pool: p, address: \"127.0.0.1:8001\", engine: vllm}",
        );
    let config = Config::from_yaml(&mixed).unwrap();
    assert_eq!(config.pools[0].engine, Engine::Sglang);
    let engines: Vec<Engine> = config.replicas.iter().map(|r| r.engine).collect();
    assert_eq!(engines, [Engine::Sglang, Engine::Vllm]);
    assert_eq!(
        Config::from_yaml(MINIMAL).unwrap().replicas[0].engine,
        Engine::Vllm,
        "vLLM unless said otherwise"
    );
}
