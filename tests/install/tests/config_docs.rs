//! The configuration docs stay true: `docs/configuration.md` is what the config types' field docs
//! generate (regenerate it with `KVROUTE_UPDATE_CONFIG_REFERENCE=1 cargo test -p
//! kvroute-install-tests --test config_docs`), and every YAML example in `README.md`, the docs
//! and `deploy/` parses — a kvroute config block through its component's own parser.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a panic is a failure"
)]

use std::path::{Path, PathBuf};

use kvroute_config::reference::{render, schema_of};
use kvroute_install_tests::repo_root;

const REFERENCE: &str = "docs/configuration.md";
const UPDATE_VAR: &str = "KVROUTE_UPDATE_CONFIG_REFERENCE";
const UPDATE_COMMAND: &str =
    "KVROUTE_UPDATE_CONFIG_REFERENCE=1 cargo test -p kvroute-install-tests --test config_docs";

fn reference() -> String {
    let mut text = format!(
        "# Configuration reference\n\n\
         Generated from the `///` docs of each component's raw config type; do not edit by hand. \
         After changing a config key or its doc, run `{UPDATE_COMMAND}`.\n\n\
         Every component reads YAML (the proxy-wasm filter: JSON) and refuses unknown keys. \
         Durations are strings with a unit (`250ms`, `1.5s`, `500us`, `1m`). An error names the \
         field path and why, in one format: `pools[2].block_size: expected 1..=4096 (got \"0\")`.\n\n"
    );
    for chapter in [
        render(
            "ext-proc (kvroute-ext-proc)",
            &schema_of::<kvroute_ext_proc::config::RawConfig>(),
        ),
        render(
            "index (kvroute-index)",
            &schema_of::<kvroute_index::config::RawConfig>(),
        ),
        render(
            "agent (kvroute-agent)",
            &schema_of::<kvroute_agent::config::RawAgentConfig>(),
        ),
        render(
            "wasm filter (kvroute-wasm-filter, JSON plugin configuration)",
            &schema_of::<kvroute_wasm_filter::config::RawConfig>(),
        ),
    ] {
        text.push_str(&chapter);
    }
    text.trim_end().to_owned() + "\n"
}

#[test]
fn config_reference() {
    let path = repo_root().join(REFERENCE);
    let generated = reference();
    if std::env::var_os(UPDATE_VAR).is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "{REFERENCE} is not what the config types generate; update it with:\n    {UPDATE_COMMAND}"
    );
}

/// A fenced ```yaml block of a markdown file, with the components its `<!-- config: ... -->`
/// marker (the line before the fence) names.
struct Block {
    place: String,
    components: Vec<String>,
    text: String,
}

fn yaml_blocks(file: &Path) -> Vec<Block> {
    let text = std::fs::read_to_string(file).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() == "```yaml" {
            let marker = i
                .checked_sub(1)
                .and_then(|p| lines[p].trim().strip_prefix("<!-- config:"))
                .and_then(|m| m.strip_suffix("-->"));
            let place = format!("{}:{}", file.display(), i + 1);
            let Some(marker) = marker else {
                panic!(
                    "{place}: a ```yaml block needs a `<!-- config: COMPONENTS -->` line before it \
                     (ext-proc, index, agent, or none for YAML that is not a kvroute config)"
                );
            };
            let end = (i + 1..lines.len())
                .find(|&j| lines[j].trim() == "```")
                .unwrap_or_else(|| panic!("{place}: unterminated block"));
            blocks.push(Block {
                place,
                components: marker
                    .split(',')
                    .map(|c| c.trim().to_owned())
                    .filter(|c| !c.is_empty() && c != "none")
                    .collect(),
                text: lines[i + 1..end].join("\n"),
            });
            i = end;
        }
        i += 1;
    }
    blocks
}

/// Every `.yaml` file under `dir`, Helm templates (Go templates, not YAML) left out.
fn yaml_files(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "templates") {
                yaml_files(&path, files);
            }
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            files.push(path);
        }
    }
}

#[test]
fn every_yaml_example_parses() {
    let root = repo_root();
    let mut checked = 0;
    for doc in [
        "README.md",
        REFERENCE,
        "deploy/kubernetes/README.md",
        "ARCHITECTURE.md",
    ] {
        let path = root.join(doc);
        if !path.exists() {
            continue;
        }
        for block in yaml_blocks(&path) {
            let place = &block.place;
            for document in serde_yaml::Deserializer::from_str(&block.text) {
                serde_yaml::Value::deserialize(document)
                    .unwrap_or_else(|e| panic!("{place}: not YAML: {e}"));
            }
            for component in &block.components {
                let parsed = match component.as_str() {
                    "ext-proc" => kvroute_config::from_yaml::<kvroute_ext_proc::config::RawConfig>(
                        &block.text,
                    )
                    .map(drop),
                    "index" => {
                        kvroute_config::from_yaml::<kvroute_index::config::RawConfig>(&block.text)
                            .map(drop)
                    }
                    "agent" => kvroute_config::from_yaml::<kvroute_agent::config::RawAgentConfig>(
                        &block.text,
                    )
                    .map(drop),
                    other => panic!("{place}: unknown component {other:?} in the marker"),
                };
                parsed.unwrap_or_else(|e| panic!("{place}: not a valid {component} config: {e}"));
            }
            checked += 1;
        }
    }
    let mut files = Vec::new();
    yaml_files(&root.join("deploy"), &mut files);
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for document in serde_yaml::Deserializer::from_str(&text) {
            serde_yaml::Value::deserialize(document)
                .unwrap_or_else(|e| panic!("{}: not YAML: {e}", file.display()));
        }
        checked += 1;
    }
    assert!(checked > 0, "no YAML example found");
}

use serde::Deserialize as _;
