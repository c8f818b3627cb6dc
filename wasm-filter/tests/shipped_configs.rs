//! Every plugin configuration we ship (Envoy bootstrap and Istio manifests) is accepted by the
//! filter's own validation, so a typo there is caught here rather than by a refused plugin at load.

use std::path::{Path, PathBuf};

use kvroute_wasm_filter::{Config, Role};
use serde::Deserialize as _;
use serde_yaml::Value;

fn envoy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../envoy")
}

/// All `PluginConfig.configuration.value` strings under a YAML tree.
fn envoy_plugin_configs(node: &Value, out: &mut Vec<String>) {
    match node {
        Value::Mapping(map) => {
            let is_wasm = map.get("vm_config").is_some();
            if let (true, Some(value)) = (
                is_wasm,
                map.get("configuration").and_then(|c| c.get("value")),
            ) {
                out.push(value.as_str().unwrap_or_default().to_owned());
            }
            map.values().for_each(|v| envoy_plugin_configs(v, out));
        }
        Value::Sequence(items) => items.iter().for_each(|v| envoy_plugin_configs(v, out)),
        _ => {}
    }
}

#[test]
fn full_chain_plugin_configs_are_valid_and_share_a_table() {
    let text = std::fs::read_to_string(envoy_dir().join("kvroute-full-chain.yaml")).unwrap();
    let mut configs = Vec::new();
    envoy_plugin_configs(&serde_yaml::from_str(&text).unwrap(), &mut configs);
    let parsed: Vec<Config> = configs
        .iter()
        .map(|c| Config::from_json(c.as_bytes()).unwrap())
        .collect();
    let roles: Vec<Role> = parsed.iter().map(|c| c.role).collect();
    assert_eq!(roles, vec![Role::FastPath, Role::Fallback]);
    // Learning (fallback) and lookup (fast path) must agree on the table layout and session header.
    assert_eq!(parsed[0].affinity, parsed[1].affinity);
    assert_eq!(parsed[0].session_header, parsed[1].session_header);
}

#[test]
fn istio_wasm_plugin_configs_are_valid() {
    let text = std::fs::read_to_string(envoy_dir().join("istio/wasmplugin.yaml")).unwrap();
    let mut roles = Vec::new();
    for document in serde_yaml::Deserializer::from_str(&text) {
        let document = Value::deserialize(document).unwrap();
        assert_eq!(document["kind"].as_str(), Some("WasmPlugin"));
        // Istio hands pluginConfig to the module as JSON.
        let json = serde_json::to_vec(&document["spec"]["pluginConfig"]).unwrap();
        roles.push(Config::from_json(&json).unwrap().role);
    }
    assert_eq!(roles, vec![Role::FastPath, Role::Fallback]);
}
