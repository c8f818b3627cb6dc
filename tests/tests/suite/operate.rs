//! What an operator runs kvroute with, checked against the real processes and a real Prometheus:
//!
//! - the metric catalogue (`docs/metrics.md`) is what the running binaries export: a reference
//!   stack (Envoy, kvroute-ext-proc, kvroute-index, kvroute-agent, engine sims) plus an "edge"
//!   kvroute-ext-proc and kvroute-index made to meet the error paths (a Kubernetes watch that
//!   expires, a refused ext_proc stream, a sequence gap, a refused ZMTP peer) is scraped, and every
//!   family becomes a row (name, type, labels, help). Every name the code registers must be in it,
//!   so a new metric that nothing exercises fails here until the workload exercises it.
//!   Regenerate with [`UPDATE_COMMAND`];
//! - the Grafana dashboard (`deploy/grafana/kvroute.json`) is dashboard JSON, and every metric
//!   it and the alert rules (`deploy/prometheus/kvroute-alerts.yaml`) name is in the catalogue;
//! - the alert rules pass `promtool check rules` and their unit tests (`promtool test rules`);
//! - a real `prometheus` scraping the reference stack loads the rules and answers every panel's
//!   query with at least one series.
//!
//! `prometheus` and `promtool` come from Debian's `prometheus` package (`.ci/run` installs it);
//! without them the Prometheus parts skip, saying so — under CI (`CI` set) they fail instead.
//!
//! Needs the binaries: `cargo build --bins` first (see `routing.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use kvroute_discovery::testing::{ApiServer, TestPod};
use kvroute_ingest::testing::MockVllmPublisher;
use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::ext_proc::ExtProcClient;
use kvroute_tests::harness::{
    ChildGuard, http, metrics, reserve_port, tiny_model_dir, workspace_root,
};
use kvroute_tests::stack::{
    ExtProcProcess, MODEL, Routing, ServerProcess, Stack, StackOptions, pool_schema,
};
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::agent::{payload, stored};
use super::common::HISTORY_UNSTABLE_TEMPLATE;
use super::drift::conversation_turn;
use super::routing::{post_raw, text};

const CATALOGUE: &str = "docs/metrics.md";
const DASHBOARD: &str = "deploy/grafana/kvroute.json";
const ALERTS: &str = "deploy/prometheus/kvroute-alerts.yaml";
const ALERT_TESTS: &str = "deploy/prometheus/kvroute-alerts.test.yaml";
const UPDATE_VAR: &str = "KVROUTE_UPDATE_METRICS_CATALOGUE";
const UPDATE_COMMAND: &str = "KVROUTE_UPDATE_METRICS_CATALOGUE=1 cargo nextest run -p kvroute-tests \
     -E 'test(a_scraped_stack_exports_the_catalogue_and_answers_every_panel)'";

/// The binaries: name, metric prefix, the Prometheus job the dashboard and rules call them, and
/// the sources whose metric families they register.
const BINARIES: [(&str, &str, &str, &[&str]); 3] = [
    (
        "kvroute-ext-proc",
        "kvroute_extproc_",
        "kvroute-ext-proc",
        &["ext-proc/src", "discovery/src", "runtime/src"],
    ),
    (
        "kvroute-index",
        "kvroute_index_",
        "kvroute-index",
        &[
            "index-service/src",
            "index-service/ingest/src",
            "index-service/core/src",
            "discovery/src",
            "runtime/src",
        ],
    ),
    (
        "kvroute-agent",
        "kvroute_agent_",
        "kvroute-agent",
        &[
            "index-service/agent/src",
            "index-service/ingest/src",
            "discovery/src",
            "runtime/src",
        ],
    ),
];

/// Kubernetes namespace of the edge ext-proc's discovered pool.
const NS: &str = "llm";
/// The pod the edge ext-proc discovers (its replica id). The edge index knows it by a bound
/// event socket no engine connects to, so it answers for it without vouching (`never_connected`).
const EDGE_POD: &str = "edge-0";
/// The edge ext-proc's second pool (and model): its tokenizer is a render endpoint nothing
/// listens on, so its decisions fall back to the load tier (tokenize fallback).
const BROKEN_POOL: &str = "broken";
/// The edge index's pool that follows the pods too (`pools[].discovery` in kvroute-index).
const WATCHED_POOL: &str = "watched";
/// A pod the edge ext-proc discovers at an address its static config already routes.
const DUPLICATE_POD: &str = "edge-duplicate";
/// Predicted cached tokens a drift window needs for a verdict (as in `drift.rs`).
const DRIFT_MIN_TOKENS: u64 = 256;
/// Most conversations sent while waiting for the drifting replica to degrade its pool.
const MAX_CONVERSATIONS: u64 = 40;

fn settle() -> Duration {
    deadline(Duration::from_secs(60))
}

fn repo_path(relative: &str) -> PathBuf {
    workspace_root().join(relative)
}

/// A tool of Debian's `prometheus` package on `PATH`; `None` (with a SKIP line) when absent,
/// a failure under CI, whose setup installs it.
fn prometheus_tool(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI: no `{name}` on PATH (.ci/run installs Debian's prometheus package)"
        );
        eprintln!("SKIP: no `{name}` on PATH (apt-get install prometheus)");
    }
    found
}

// ---------------------------------------------------------------------------------------------
// The catalogue.

/// One metric family as the exposition text shows it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Family {
    kind: String,
    help: String,
    labels: BTreeSet<String>,
    /// How the catalogue knows it: [`EXPORTED`] or [`DECLARED`].
    source: &'static str,
}

/// Scraped from the reference stack: from the binary's `/metrics`, or for code it shares with
/// another binary ([`SHARED_CODE`]) from that binary's (same type, labels and help).
const EXPORTED: &str = "exported";
/// Declared in [`UNEXERCISED`]: the reference stack never meets what it counts.
const DECLARED: &str = "declared";

/// Code several binaries register the same families with, under a sub-prefix of their own.
const SHARED_CODE: [(&str, &str); 2] = [
    ("index-service/ingest/src", "ingest_"),
    ("discovery/src", "discovery_"),
];

/// Families the reference stack never meets (a task panic, an agent refused, a debug token, an
/// engine restart, an invalid InferencePool, a stray replica id, an expired in-flight slot, the
/// agent's own config reloads and discovery), declared from their label types:
/// `(binary, family, type, labels, help)`. A declared family the stack does export must agree.
const UNEXERCISED: &[(&str, &str, &str, &[&str], &str)] = &[
    (
        "kvroute-ext-proc",
        "kvroute_extproc_debug_header_requests",
        "counter",
        &["kind"],
        "Requests checked for the debug-header token, by result",
    ),
    (
        "kvroute-ext-proc",
        "kvroute_extproc_discovery_invalid_pools",
        "counter",
        &["reason", "source", "watch"],
        "InferencePool specs that select nothing, by reason",
    ),
    (
        "kvroute-ext-proc",
        "kvroute_extproc_drift_counter_resets",
        "counter",
        &["replica"],
        "Engine prefix-cache counters that went down (engine restarts)",
    ),
    (
        "kvroute-ext-proc",
        "kvroute_extproc_replica_inflight_expired",
        "counter",
        &["replica"],
        "In-flight requests released after limits.inflight_max_age without response headers",
    ),
    (
        "kvroute-ext-proc",
        "kvroute_extproc_unknown_replicas",
        "counter",
        &["replica"],
        "Candidates absent from the index's answer (replica id unknown to the index)",
    ),
    (
        "kvroute-index",
        "kvroute_index_agent_refused",
        "counter",
        &["reason"],
        "Agent streams or writes refused, by reason",
    ),
    (
        "kvroute-index",
        "kvroute_index_discovery_invalid_pools",
        "counter",
        &["reason", "source", "watch"],
        "InferencePool specs that select nothing, by reason",
    ),
    (
        "kvroute-index",
        "kvroute_index_ingest_event_fields_ignored",
        "counter",
        &["field"],
        "Events of applied batches that carried a vLLM field the index decodes and does not use \
      (locality, ownership, session_id, lookahead_token_ids), by field",
    ),
    (
        "kvroute-index",
        "kvroute_index_ingest_task_panics",
        "counter",
        &["dp_rank", "replica_id"],
        "Ingest task panics (the task is restarted and the replica reset)",
    ),
    (
        "kvroute-index",
        "kvroute_index_query_auth_refusals",
        "counter",
        &["api", "reason"],
        "Query API requests refused for want of the query_auth token, by API and reason",
    ),
    (
        "kvroute-agent",
        "kvroute_agent_config_reloads",
        "counter",
        &["outcome"],
        "Config file changes seen, by outcome (applied, unchanged, rejected)",
    ),
    (
        "kvroute-agent",
        "kvroute_agent_config_restart_required",
        "counter",
        &["key"],
        "Reloads that changed a key only a restart applies (the running value is kept), by key",
    ),
    (
        "kvroute-agent",
        "kvroute_agent_engines_refused",
        "counter",
        &["reason"],
        "Discovered engines left out each time the engine set is recomputed, by reason \
      (duplicate_id: a static engine has the id; too_many_replicas: beyond one Hello)",
    ),
    (
        "kvroute-agent",
        "kvroute_agent_stream_ends",
        "counter",
        &["reason"],
        "Index streams that ended, by reason",
    ),
    (
        "kvroute-agent",
        "kvroute_agent_subscribers_dropped",
        "counter",
        &["reason"],
        "Index streams dropped by the hub (they reconnect with a snapshot), by reason",
    ),
];

impl Family {
    /// The name PromQL uses for the family `name`: counters carry `_total`.
    fn query_name(&self, name: &str) -> String {
        if self.kind == "counter" {
            format!("{name}_total")
        } else {
            name.to_owned()
        }
    }
}

/// Families of an exposition text (`# HELP`, `# TYPE` and the samples' label names; `le` and
/// `quantile` are the histogram's and summary's own).
fn families(text: &str) -> BTreeMap<String, Family> {
    let mut all: BTreeMap<String, Family> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            all.entry(name.to_owned()).or_default().help = help.to_owned();
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            let family = all.entry(name.to_owned()).or_default();
            family.kind = kind.to_owned();
            family.source = EXPORTED;
        }
    }
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let series = line.rsplit_once(' ').map_or(line, |(series, _)| series);
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        let family = [
            "_total", "_bucket", "_sum", "_count", "_created", "_info", "",
        ]
        .iter()
        .find_map(|suffix| {
            name.strip_suffix(suffix)
                .filter(|base| all.contains_key(*base))
        });
        let Some(family) = family.and_then(|base| all.get_mut(base)) else {
            continue;
        };
        for pair in labels.trim_end_matches('}').split(',') {
            if let Some((key, _)) = pair.split_once('=')
                && key != "le"
                && key != "quantile"
            {
                family.labels.insert(key.trim().to_owned());
            }
        }
    }
    all
}

/// The catalogue's text from each binary's families.
fn render_catalogue(binaries: &[(&str, BTreeMap<String, Family>)]) -> String {
    let mut text = format!(
        "# Metric catalogue\n\n\
         Every metric family each kvroute binary exports on its admin port's `/metrics`, generated \
         from the running binaries (`tests/tests/suite/operate.rs` scrapes a reference stack made \
         to meet every path that counts something); do not edit by hand. After adding or changing \
         a metric, run `{UPDATE_COMMAND}`.\n\n\
         Names are as PromQL sees them: counters end in `_total`; a histogram `x` is the series \
         `x_bucket{{le}}`, `x_sum` and `x_count`. Label values come from configuration (replica, \
         pool and source names) and fixed enums, never from request data. The Grafana dashboard \
         (`deploy/grafana/kvroute.json`) and the alert rules \
         (`deploy/prometheus/kvroute-alerts.yaml`) use only these names.\n\n\
         *Known from*: `{EXPORTED}` — scraped from the reference stack (for the ingest and \
         discovery code two binaries share, from either); `{DECLARED}` — counts what the \
         reference stack never meets (a panic, a refused agent, an engine restart…), declared in \
         the test from its label types.\n"
    );
    for (binary, families) in binaries {
        text.push_str(&format!(
            "\n## {binary}\n\n| metric | type | labels | help | known from |\n|---|---|---|---|---|\n"
        ));
        for (name, family) in families {
            let labels = family
                .labels
                .iter()
                .map(|label| format!("`{label}`"))
                .collect::<Vec<_>>()
                .join(", ");
            text.push_str(&format!(
                "| `{}` | {} | {} | {} | {} |\n",
                family.query_name(name),
                family.kind,
                labels,
                family.help.replace('|', "\\|"),
                family.source
            ));
        }
    }
    text
}

/// The catalogue's metric names with their types, read back from `docs/metrics.md`.
fn catalogued() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(repo_path(CATALOGUE)).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut cells = line.strip_prefix("| `")?.split(" | ");
            let name = cells.next()?.strip_suffix('`')?;
            Some((name.to_owned(), cells.next()?.to_owned()))
        })
        .collect()
}

/// Whether `name` (as a query writes it) is a catalogued series: a family's name, or a
/// histogram's `_bucket`, `_sum` or `_count`.
fn is_catalogued(catalogue: &BTreeMap<String, String>, name: &str) -> bool {
    catalogue.contains_key(name)
        || ["_bucket", "_sum", "_count"].iter().any(|suffix| {
            name.strip_suffix(suffix)
                .and_then(|base| catalogue.get(base))
                .is_some_and(|kind| kind == "histogram")
        })
}

/// The kvroute metric names in a PromQL expression (label values in quotes skipped).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut in_quotes = false;
    let mut current = String::new();
    for c in expr.chars().chain([' ']) {
        if c == '"' {
            in_quotes = !in_quotes;
        }
        if !in_quotes && (c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            current.push(c);
            continue;
        }
        if current.starts_with("kvroute_") {
            names.insert(current.clone());
        }
        current.clear();
    }
    names
}

/// The Rust files under `dir`, tests left out (`tests/` folders, `tests.rs`).
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "tests") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs")
            && path.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push(path);
        }
    }
}

/// The names the code under `sources` registers (the first argument of `register(` /
/// `register_with_unit(`), outside tests.
fn registered_names(sources: &[&str]) -> BTreeSet<String> {
    let mut files = Vec::new();
    for dir in sources {
        rust_files(&repo_path(dir), &mut files);
    }
    let mut names = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        for call in [".register(", ".register_with_unit("] {
            for (at, _) in code.match_indices(call) {
                let rest = code[at + call.len()..].trim_start();
                if let Some(name) = rest
                    .strip_prefix('"')
                    .and_then(|rest| rest.split_once('"'))
                    .map(|(name, _)| name)
                {
                    names.insert(name.to_owned());
                }
            }
        }
    }
    names
}

/// The product sources' text with string continuations (`\` + newline + indentation) joined,
/// so a help text reads as one literal.
fn joined_sources() -> String {
    let mut text = String::new();
    for (_, _, _, sources) in BINARIES {
        for dir in sources {
            let mut files = Vec::new();
            rust_files(&repo_path(dir), &mut files);
            for file in files {
                text.push_str(&std::fs::read_to_string(file).unwrap());
            }
        }
    }
    let mut joined = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(at) = rest.find("\\\n") {
        joined.push_str(&rest[..at]);
        rest = rest[at + 2..].trim_start();
    }
    joined.push_str(rest);
    joined
}

/// The family of `families` whose name is `prefix` + `base` (a unit suffix allowed).
fn family_named<'a>(
    families: &'a BTreeMap<String, Family>,
    prefix: &str,
    base: &str,
) -> Option<(&'a String, &'a Family)> {
    families.iter().find(|(name, _)| {
        name.strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix(base))
            .is_some_and(|unit| ["", "_seconds", "_bytes"].contains(&unit))
    })
}

/// Adds the [`UNEXERCISED`] families, then the shared code's families ([`SHARED_CODE`]) a
/// binary registers and did not export, as another binary exported (or declared) them. The
/// shared families a binary exports in one run and not in another (an agent's replays) read
/// the same either way.
fn complete(binaries: &mut [(&'static str, BTreeMap<String, Family>)]) {
    let sources = joined_sources();
    for &(binary, name, kind, labels, help) in UNEXERCISED {
        assert!(
            sources.contains(&format!("\"{help}\"")),
            "UNEXERCISED {name}: its help is not a help text in the code: {help:?}"
        );
        let declared = Family {
            kind: kind.to_owned(),
            help: format!("{help}."),
            labels: labels.iter().map(|l| (*l).to_owned()).collect(),
            source: DECLARED,
        };
        let (_, families) = binaries.iter_mut().find(|(b, _)| *b == binary).unwrap();
        // Declared even when this run met it, so the catalogue does not depend on the run.
        if let Some(scraped) = families.get(name) {
            assert!(
                Family {
                    source: DECLARED,
                    ..scraped.clone()
                } == declared,
                "UNEXERCISED {name} disagrees with what {binary} exports: {scraped:?}"
            );
        }
        families.insert(name.to_owned(), declared);
    }
    for (i, (_, prefix, _, dirs)) in BINARIES.iter().enumerate() {
        for (dir, sub) in SHARED_CODE {
            if !dirs.contains(&dir) {
                continue;
            }
            for name in registered_names(&[dir]) {
                let base = format!("{sub}{name}");
                if family_named(&binaries[i].1, prefix, &base).is_some() {
                    continue;
                }
                let found = BINARIES
                    .iter()
                    .enumerate()
                    .find_map(|(j, (_, other, _, _))| {
                        let (full, family) = family_named(&binaries[j].1, other, &base)?;
                        Some((format!("{prefix}{}", &full[other.len()..]), family.clone()))
                    });
                if let Some((full, family)) = found {
                    binaries[i].1.insert(full, family);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The dashboard and the rules as files.

fn dashboard() -> Value {
    let text = std::fs::read_to_string(repo_path(DASHBOARD)).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{DASHBOARD} is not JSON: {e}"))
}

/// Every panel (rows' nested panels included), with its title.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut all = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        all.push(panel);
        all.extend(panel["panels"].as_array().into_iter().flatten());
    }
    all
}

/// `(panel title, expr)` of every query of every panel.
fn panel_queries(dashboard: &Value) -> Vec<(String, String)> {
    panels(dashboard)
        .into_iter()
        .flat_map(|panel| {
            let title = panel["title"].as_str().unwrap_or_default().to_owned();
            panel["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(move |target| {
                    Some((title.clone(), target["expr"].as_str()?.to_owned()))
                })
        })
        .collect()
}

/// `(alert name, expr)` of every rule of the alert rules file.
fn alert_rules() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo_path(ALERTS)).unwrap();
    let rules: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    rules["groups"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|group| group["rules"].as_sequence().into_iter().flatten())
        .map(|rule| {
            (
                rule["alert"]
                    .as_str()
                    .or(rule["record"].as_str())
                    .unwrap_or_default()
                    .to_owned(),
                rule["expr"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// A panel query as Prometheus takes it: Grafana's interval variables get fixed windows.
fn instant_query(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__interval", "15s")
        .replace("$__range", "5m")
}

#[test]
fn the_dashboard_is_a_grafana_dashboard_over_catalogued_metrics() {
    let dashboard = dashboard();
    for key in ["uid", "title"] {
        assert!(
            dashboard[key].as_str().is_some_and(|v| !v.is_empty()),
            "{DASHBOARD}: no {key}"
        );
    }
    assert!(
        dashboard["schemaVersion"].as_u64().is_some(),
        "{DASHBOARD}: no schemaVersion"
    );
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    assert!(
        variables.iter().any(|v| v["name"] == "datasource"
            && v["type"] == "datasource"
            && v["query"] == "prometheus"),
        "{DASHBOARD}: no `datasource` variable of type prometheus"
    );
    let mut ids = BTreeSet::new();
    let mut rows = 0;
    for panel in panels(&dashboard) {
        let title = panel["title"].as_str().unwrap_or_default();
        assert!(!title.is_empty(), "a panel without a title: {panel}");
        let id = panel["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("{title}: no id"));
        assert!(ids.insert(id), "{title}: id {id} used twice");
        for key in ["h", "w", "x", "y"] {
            assert!(
                panel["gridPos"][key].as_u64().is_some(),
                "{title}: no gridPos.{key}"
            );
        }
        if panel["type"] == "row" {
            rows += 1;
            continue;
        }
        assert!(
            panel["datasource"]["type"] == "prometheus"
                && panel["datasource"]["uid"] == "${datasource}",
            "{title}: datasource is not the `datasource` variable"
        );
        let targets = panel["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("{title}: no targets"));
        assert!(!targets.is_empty(), "{title}: no targets");
        for target in targets {
            assert!(
                target["expr"].as_str().is_some_and(|e| !e.is_empty())
                    && target["refId"].as_str().is_some(),
                "{title}: a target without expr or refId"
            );
        }
    }
    assert!(rows > 0, "{DASHBOARD}: no rows");

    let catalogue = catalogued();
    assert!(!catalogue.is_empty(), "{CATALOGUE} lists nothing");
    let queries = panel_queries(&dashboard)
        .into_iter()
        .map(|(title, expr)| (format!("panel {title:?}"), expr))
        .chain(
            alert_rules()
                .into_iter()
                .map(|(alert, expr)| (format!("alert {alert}"), expr)),
        );
    for (place, expr) in queries {
        let names = metric_names(&expr);
        // An alert may watch Prometheus's own `up`; a panel shows kvroute's metrics.
        assert!(
            !names.is_empty() || place.starts_with("alert"),
            "{place} names no kvroute metric: {expr}"
        );
        for name in names {
            assert!(
                is_catalogued(&catalogue, &name),
                "{place} uses {name}, which is not in {CATALOGUE}"
            );
        }
    }
}

#[test]
fn alert_rules_pass_promtool_and_their_unit_tests() {
    let Some(promtool) = prometheus_tool("promtool") else {
        return;
    };
    let check = Command::new(&promtool)
        .args(["check", "rules"])
        .arg(repo_path(ALERTS))
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "promtool check rules {ALERTS}:\n{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    // The test file names the rules file relative to itself.
    let tests = repo_path(ALERT_TESTS);
    let run = Command::new(&promtool)
        .args(["test", "rules"])
        .arg(&tests)
        .current_dir(tests.parent().unwrap())
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "promtool test rules {ALERT_TESTS}:\n{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    // Every alert is exercised by the unit tests.
    let tests_text = std::fs::read_to_string(&tests).unwrap();
    for (alert, _) in alert_rules() {
        assert!(
            tests_text.contains(&format!("alertname: {alert}")),
            "{ALERT_TESTS} never checks {alert}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The reference stack.

/// The edge processes: a kvroute-ext-proc discovering its pool from the API server double (one
/// ext_proc stream at most) and a kvroute-index whose engines misbehave.
struct Edge {
    api: ApiServer,
    ext_proc: ExtProcProcess,
    index: ServerProcess,
    publisher: MockVllmPublisher,
    bound: SocketAddr,
}

impl Edge {
    async fn start(stack: &Stack) -> Self {
        let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
        let bound: SocketAddr = ([127, 0, 0, 1], reserve_port().unwrap()).into();
        let options = stack.options();
        let api = ApiServer::start().await.unwrap();
        let index = ServerProcess::start_index_listening(
            &format!(
                "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
                 reload_interval: 100ms\n\
                 pools:\n- {{{schema}, verify_hashes: off}}\n\
                 - {{name: {WATCHED_POOL}, models: [{WATCHED_POOL}], block_size: {block_size}, \
                 key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}}, \
                 discovery: {{kubernetes: {{namespace: {NS}, selector: {{app: sim}}, \
                 target_port: http, api_url: \"{api}\"}}}}}}\n\
                 replicas:\n\
                 - {{id: published, pool: {MODEL}, events: {{endpoint: \"{live}\", \
                 replay_endpoint: \"{replay}\"}}}}\n\
                 - {{id: {EDGE_POD}, pool: {MODEL}, events: {{endpoint: \"tcp://{bound}\", \
                 mode: bind}}}}\n",
                schema = pool_schema(options),
                block_size = options.block_size,
                api = api.url(),
                live = publisher.pub_endpoint().unwrap(),
                replay = publisher.replay_endpoint().unwrap(),
            ),
            None,
        )
        .await
        .unwrap();
        let pod = |name: &str, port: u16| {
            TestPod::new(name)
                .label("app", "sim")
                .ip("127.0.0.1")
                .ready(true)
                .node("node-0")
                .port("http", port)
        };
        let (sim, other) = (stack.sims()[0].ready.http, stack.sims()[1].ready.http);
        api.apply_pod(NS, &pod(EDGE_POD, sim.port()));
        // Another pod at the address of the broken pool's static replica: left out of routing
        // (`duplicate_address`).
        api.apply_pod(NS, &pod(DUPLICATE_POD, other.port()));
        // A Ready pod without the named port: refused by discovery (`pods_refused`).
        api.apply_pod(
            NS,
            &TestPod::new("edge-portless")
                .label("app", "sim")
                .ip("127.0.0.1")
                .ready(true)
                .node("node-0")
                .port("metrics", other.port()),
        );
        // Nothing listens there: the broken pool's tokenizer and its second replica (never
        // ready: its metrics cannot be scraped).
        let unreachable = SocketAddr::from(([127, 0, 0, 1], reserve_port().unwrap()));
        let ext_proc = ExtProcProcess::start(
            &format!(
                "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
                 index: {{addresses: [\"http://{index}\"]}}\n\
                 limits: {{max_streams: 1}}\n\
                 reload_interval: 100ms\n\
                 scrape: {{interval: 200ms}}\n\
                 pools:\n- {{{schema}, tokenizer: {{model_dir: \"{model}\"}},\n   \
                 discovery: {{kubernetes: {{namespace: {NS}, selector: {{app: sim}}, \
                 target_port: http, api_url: \"{api}\"}}}}}}\n\
                 - {{name: {BROKEN_POOL}, models: [{BROKEN_POOL}], block_size: {block_size}, \
                 events: false, tokenizer: {{render: \"http://{unreachable}\", timeout: 1s}}}}\n\
                 replicas:\n\
                 - {{id: {BROKEN_POOL}-0, pool: {BROKEN_POOL}, address: \"{sim}\", \
                 metrics_url: \"http://{sim}/metrics\"}}\n\
                 - {{id: {BROKEN_POOL}-1, pool: {BROKEN_POOL}, address: \"{unreachable}\", \
                 metrics_url: \"http://{unreachable}/metrics\"}}\n",
                block_size = options.block_size,
                unreachable = unreachable,
                sim = other,
                index = index.grpc(),
                schema = pool_schema(options),
                model = tiny_model_dir().display(),
                api = api.url(),
            ),
            None,
        )
        .await
        .unwrap();
        Edge {
            api,
            ext_proc,
            index,
            publisher,
            bound,
        }
    }

    /// Meets every error path the edge is there for, each confirmed in its `/metrics`.
    async fn misbehave(&self) {
        // A sequence gap on the live stream (repaired by replay).
        let index_metrics = format!("{}/metrics", self.index.admin_url());
        try_poll_until("a gap counted by the edge index", settle(), || {
            let url = index_metrics.clone();
            async move {
                self.publisher.publish(payload(stored(&[11]))).await.ok()?;
                self.publisher.skip_seq(payload(stored(&[12]))).await;
                self.publisher.publish(payload(stored(&[13]))).await.ok()?;
                let text = http::get(&url).await.ok()?.text();
                (metrics::sum(&text, "kvroute_index_ingest_gaps_total", &[]) > 0.0).then_some(())
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.index.log()));
        // A peer that is no ZMTP engine on the bound SUB socket.
        let bound = self.bound;
        try_poll_until("a refused peer counted by the edge index", settle(), || {
            let url = index_metrics.clone();
            async move {
                // A whole greeting's worth of bytes (64) that is no ZMTP greeting; the index
                // closes the connection, which the read waits for.
                if let Ok(mut stream) = tokio::net::TcpStream::connect(bound).await {
                    let mut request = b"GET / HTTP/1.1\r\nHost: kvroute\r\n".to_vec();
                    request.resize(64, b' ');
                    if stream.write_all(&request).await.is_ok() {
                        let mut rest = Vec::new();
                        let _ = tokio::time::timeout(settle(), stream.read_to_end(&mut rest)).await;
                    }
                }
                let text = http::get(&url).await.ok()?.text();
                (metrics::sum(&text, "kvroute_index_ingest_refused_total", &[]) > 0.0).then_some(())
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.index.log()));

        // A message that is no event batch, then an engine restart (sequence from 0 again).
        let undecodable = vec![
            Vec::new(),
            self.publisher.next_seq().to_be_bytes().to_vec(),
            vec![0xc1],
        ];
        self.publisher.send_raw(undecodable).await.unwrap();
        self.publisher.restart().await;
        try_poll_until(
            "a decode error and a reset counted by the edge index",
            settle(),
            || {
                let url = index_metrics.clone();
                async move {
                    self.publisher.publish(payload(stored(&[21]))).await.ok()?;
                    let text = http::get(&url).await.ok()?.text();
                    let errors =
                        metrics::sum(&text, "kvroute_index_ingest_decode_errors_total", &[]);
                    let resets = metrics::sum(&text, "kvroute_index_ingest_resets_total", &[]);
                    (errors > 0.0 && resets > 0.0).then_some(())
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.index.log()));
        // A Match for a model the index does not serve.
        let refused = http::post_json(
            &format!("{}/v1/match", self.index.admin_url()),
            &serde_json::json!({"model": "unserved", "token_ids": [1, 2, 3]}),
        )
        .await
        .unwrap();
        assert_ne!(refused.status, 200, "{}", refused.text());
        // Both config files rewritten (a comment more): each process reloads it.
        for (process, family) in [
            (&self.index, "kvroute_index_config_reloads_total"),
            (&self.ext_proc, "kvroute_extproc_config_reloads_total"),
        ] {
            let path = process.config_path();
            let text = std::fs::read_to_string(&path).unwrap();
            std::fs::write(&path, format!("{text}\n# rewritten\n")).unwrap();
            let url = format!("{}/metrics", process.admin_url());
            try_poll_until("a config reload counted", settle(), || {
                let url = url.clone();
                async move {
                    let text = http::get(&url).await.ok()?.text();
                    (metrics::sum(&text, family, &[]) > 0.0).then_some(())
                }
            })
            .await
            .unwrap_or_else(|e| panic!("{e}: {family}\n{}", process.log()));
        }

        // Every watch expires (410 Gone): counted as an error, then a relist.
        let ext_proc_metrics = format!("{}/metrics", self.ext_proc.admin_url());
        self.api.expire_watches();
        for (url, errors, log) in [
            (
                &ext_proc_metrics,
                "kvroute_extproc_discovery_watch_errors_total",
                self.ext_proc.log(),
            ),
            (
                &index_metrics,
                "kvroute_index_discovery_watch_errors_total",
                self.index.log(),
            ),
        ] {
            try_poll_until(
                "discovery relisted after 410 Gone",
                settle(),
                || async move {
                    let text = http::get(url).await.ok()?.text();
                    (metrics::sum(&text, errors, &["reason=\"gone\""]) > 0.0).then_some(())
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}: {errors}\n{log}"));
        }

        // Decisions on the edge: one with tokens (the index does not vouch for the replica), one
        // without (its pool's tokenizer is unreachable).
        let routable = "kvroute_extproc_discovery_routable_replicas";
        try_poll_until(
            "the edge ext-proc routes its discovered pod",
            settle(),
            || {
                let url = ext_proc_metrics.clone();
                async move {
                    let text = http::get(&url).await.ok()?.text();
                    (metrics::sum(&text, routable, &[]) >= 1.0).then_some(())
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.ext_proc.log()));
        let client = ExtProcClient::connect(self.ext_proc.grpc(), settle())
            .await
            .unwrap();
        for model in [MODEL, BROKEN_POOL] {
            let body = serde_json::json!({"model": model, "prompt": text(5, 20), "max_tokens": 1});
            // One stream at a time: the previous one may not be released yet.
            try_poll_until("an edge decision", settle(), || {
                let (client, body) = (client.clone(), body.to_string().into_bytes());
                async move {
                    client
                        .buffered("/v1/completions", body)
                        .await
                        .ok()
                        .map(|_| ())
                }
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", self.ext_proc.log()));
        }
        let text = http::get(&ext_proc_metrics).await.unwrap().text();
        for (family, labels) in [
            (
                "kvroute_extproc_nonprecise_replicas_total",
                &["state=\"never_connected\""][..],
            ),
            (
                "kvroute_extproc_fallbacks_total",
                &["stage=\"tokenize\""][..],
            ),
        ] {
            assert!(
                metrics::sum(&text, family, labels) > 0.0,
                "no {family} {labels:?}:\n{text}"
            );
        }

        // A second ext_proc stream while one is open (`limits.max_streams: 1`) is refused.
        let mut raw = ExternalProcessorClient::connect(format!("http://{}", self.ext_proc.grpc()))
            .await
            .unwrap();
        // The edge decisions' streams may not be released yet: retried until one is taken.
        let _held = try_poll_until("an ext_proc stream held open", settle(), || {
            let mut client = raw.clone();
            async move {
                let (open, held) = tokio::sync::mpsc::channel::<ProcessingRequest>(1);
                let stream = tokio_stream::wrappers::ReceiverStream::new(held);
                let response = client.process(stream).await.ok()?;
                Some((open, response))
            }
        })
        .await
        .unwrap();
        let second = raw.process(futures::stream::pending()).await;
        assert!(
            second.is_err(),
            "a second stream was accepted past max_streams: 1"
        );
        let text = http::get(&ext_proc_metrics).await.unwrap().text();
        assert!(
            metrics::sum(&text, "kvroute_extproc_stream_refusals_total", &[]) > 0.0,
            "{text}"
        );
    }
}

/// The reference stack: two sims, the first rendering chat with another template than kvroute
/// tokenizes with (it drifts and degrades the pool), the second's events through the agent.
async fn reference_stack() -> Stack {
    Stack::start(StackOptions {
        replicas: 2,
        kv_blocks_per_replica: 1024,
        sim_chat_templates: vec![Some(HISTORY_UNSTABLE_TEMPLATE.to_owned()), None],
        agent_replicas: vec![1],
        ext_proc_extra_config: format!(
            "drift: {{bound: 0.5, clear_below: 0.25, window: 10m, min_tokens: {DRIFT_MIN_TOKENS}, \
             action: approximate}}\n"
        ),
        ..StackOptions::default()
    })
    .await
    .unwrap()
}

/// Multi-turn conversations until the drifting replica degrades the pool, a few more decided on
/// the approximate tier because of it, and requests ext-proc refuses.
async fn workload(stack: &Stack) {
    let url = format!(
        "{}/v1/chat/completions",
        stack.url(Routing::Kvroute).unwrap()
    );
    let ext_proc_metrics = format!("{}/metrics", stack.ext_proc_admin_url().unwrap());
    let mut degraded_after = None;
    for seed in 1..=MAX_CONVERSATIONS {
        for turn in 0..3 {
            let body = conversation_turn(seed, turn).to_string().into_bytes();
            let response = post_raw(&url, body, &[]).await;
            assert_eq!(
                response.status,
                200,
                "{}\n{}",
                response.text(),
                stack.logs()
            );
        }
        let text = http::get(&ext_proc_metrics).await.unwrap().text();
        if metrics::sum(&text, "kvroute_extproc_drift_degraded", &[]) >= 1.0 {
            let first = *degraded_after.get_or_insert(seed);
            if seed >= first + 2 {
                break;
            }
        }
    }
    assert!(
        degraded_after.is_some(),
        "the drifting replica never degraded the pool\n{}",
        stack.logs()
    );
    // Bodies ext-proc cannot route: refused with an error response, counted by kind.
    let response = post_raw(&url, b"{\"model\": ".to_vec(), &[]).await;
    assert_ne!(response.status, 200, "a truncated body was routed");
}

/// Every binary's families, the two processes of ext-proc and of the index merged.
async fn scrape_families(
    stack: &Stack,
    edge: &Edge,
) -> Vec<(&'static str, BTreeMap<String, Family>)> {
    let urls = [
        vec![
            stack.ext_proc_admin_url().unwrap(),
            edge.ext_proc.admin_url(),
        ],
        vec![stack.index_admin_url().unwrap(), edge.index.admin_url()],
        vec![stack.agent_admin_url().unwrap()],
    ];
    let mut all = Vec::new();
    for ((binary, prefix, _, _), urls) in BINARIES.iter().zip(urls) {
        let mut merged: BTreeMap<String, Family> = BTreeMap::new();
        for url in urls {
            let text = http::get(&format!("{url}/metrics")).await.unwrap().text();
            for (name, family) in families(&text) {
                assert!(
                    name.starts_with(prefix),
                    "{binary} exports {name}, outside its prefix {prefix}"
                );
                let entry = merged.entry(name).or_insert_with(|| Family {
                    labels: BTreeSet::new(),
                    ..family.clone()
                });
                entry.labels.extend(family.labels);
            }
        }
        all.push((*binary, merged));
    }
    all
}

/// A real Prometheus scraping the given admin addresses every second, with the alert rules.
struct Prometheus {
    process: ChildGuard,
    url: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    async fn start(binary: &Path, jobs: &[(&str, Vec<String>)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let scrape_configs: String = jobs
            .iter()
            .map(|(job, targets)| {
                let targets = targets
                    .iter()
                    .map(|t| format!("\"{t}\""))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!("  - job_name: {job}\n    static_configs: [{{targets: [{targets}]}}]\n")
            })
            .collect();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
                 rule_files: [\"{rules}\"]\n\
                 scrape_configs:\n{scrape_configs}",
                rules = repo_path(ALERTS).display()
            ),
        )
        .unwrap();
        let port = reserve_port().unwrap();
        let mut command = Command::new(binary);
        command
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"));
        let process =
            ChildGuard::spawn("prometheus", command, dir.path().join("prometheus.log")).unwrap();
        let url = format!("http://127.0.0.1:{port}");
        let ready = format!("{url}/-/ready");
        try_poll_until("prometheus ready", settle(), || {
            let ready = ready.clone();
            async move {
                http::get(&ready)
                    .await
                    .ok()
                    .filter(|r| r.status == 200)
                    .map(|_| ())
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", process.log()));
        Prometheus {
            process,
            url,
            _dir: dir,
        }
    }

    /// The result vector of an instant query (`None` when Prometheus refused it).
    async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let url = format!("{}/api/v1/query?query={}", self.url, percent_encode(expr));
        let answer = http::get(&url).await.map_err(|e| e.to_string())?;
        let body = answer
            .json()
            .map_err(|e| format!("{e}: {}", answer.text()))?;
        if body["status"] != "success" {
            return Err(body.to_string());
        }
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn host_port(url: &str) -> String {
    url.trim_start_matches("http://").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scraped_stack_exports_the_catalogue_and_answers_every_panel() {
    let stack = reference_stack().await;
    let edge = Edge::start(&stack).await;
    let prometheus = match prometheus_tool("prometheus") {
        Some(binary) => {
            let jobs = [
                (
                    BINARIES[0].2,
                    vec![
                        host_port(&stack.ext_proc_admin_url().unwrap()),
                        host_port(&edge.ext_proc.admin_url()),
                    ],
                ),
                (
                    BINARIES[1].2,
                    vec![
                        host_port(&stack.index_admin_url().unwrap()),
                        host_port(&edge.index.admin_url()),
                    ],
                ),
                (
                    BINARIES[2].2,
                    vec![host_port(&stack.agent_admin_url().unwrap())],
                ),
            ];
            Some(Prometheus::start(&binary, &jobs).await)
        }
        None => None,
    };

    workload(&stack).await;
    edge.misbehave().await;
    let workload_done = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();

    // The catalogue.
    let mut binaries = scrape_families(&stack, &edge).await;
    complete(&mut binaries);
    let generated = render_catalogue(&binaries);
    let path = repo_path(CATALOGUE);
    if std::env::var_os(UPDATE_VAR).is_some() {
        std::fs::write(&path, &generated).unwrap();
    } else {
        let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            checked_in == generated,
            "{CATALOGUE} is not what the binaries export; update it with:\n    {UPDATE_COMMAND}"
        );
    }
    let mut unexported = Vec::new();
    for ((binary, families), (_, _, _, sources)) in binaries.iter().zip(BINARIES) {
        for name in registered_names(sources) {
            let found = families.keys().any(|family| {
                family.match_indices(&format!("_{name}")).any(|(at, m)| {
                    let rest = &family[at + m.len()..];
                    rest.is_empty() || rest.starts_with('_')
                })
            });
            if !found {
                unexported.push(format!("{binary}: {name}"));
            }
        }
    }
    assert!(
        unexported.is_empty(),
        "families registered but neither exported by the reference stack nor declared in \
         UNEXERCISED (make the workload exercise them, or declare them):\n{}",
        unexported.join("\n")
    );

    let Some(prometheus) = prometheus else {
        return;
    };
    // Every target scraped after the workload, and at least three times in the window the
    // panels' rates look at (Prometheus's first scrape may come seconds after its start).
    let after =
        format!("min(timestamp(up)) > {workload_done} and min(count_over_time(up[1m])) >= 3");
    try_poll_until("every target scraped after the workload", settle(), || {
        let after = after.clone();
        let prometheus = &prometheus;
        async move {
            let up = prometheus.query("up == 1").await.ok()?;
            (up.len() == 5 && !prometheus.query(&after).await.ok()?.is_empty()).then_some(())
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", prometheus.process.log()));

    let mut empty = Vec::new();
    for (title, expr) in panel_queries(&dashboard()) {
        let query = instant_query(&expr);
        match prometheus.query(&query).await {
            Ok(series) if !series.is_empty() => {}
            Ok(_) => empty.push(format!("{title}: {query} returned no series")),
            Err(error) => empty.push(format!("{title}: {query} refused: {error}")),
        }
    }
    assert!(
        empty.is_empty(),
        "panels without series:\n{}",
        empty.join("\n")
    );

    // The rules loaded and evaluate without error.
    let rules: Value = http::get(&format!("{}/api/v1/rules", prometheus.url))
        .await
        .unwrap()
        .json()
        .unwrap();
    let loaded: Vec<&Value> = rules["data"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .collect();
    assert_eq!(loaded.len(), alert_rules().len(), "{rules}");
    try_poll_until("every rule evaluated", settle(), || {
        let url = format!("{}/api/v1/rules", prometheus.url);
        async move {
            let rules = http::get(&url).await.ok()?.json().ok()?;
            let all: Vec<Value> = rules["data"]["groups"]
                .as_array()?
                .iter()
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .collect();
            all.iter()
                .all(|r| {
                    r["lastEvaluation"]
                        .as_str()
                        .is_some_and(|t| !t.starts_with("0001"))
                })
                .then_some(all)
        }
    })
    .await
    .unwrap()
    .iter()
    .for_each(|rule| {
        assert_eq!(rule["health"], "ok", "{rule}");
    });
}
