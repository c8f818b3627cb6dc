//! What an operator runs kvroute with, checked against the real processes and a real Prometheus:
//!
//! - the metric catalogue (`docs/metrics.md`) is what the running binaries export: a reference
//!   stack (Envoy, kvroute-ext-proc, kvroute-index, kvroute-agent, engine sims) plus an "edge"
//!   kvroute-ext-proc and kvroute-index made to meet the error paths (a Kubernetes watch that
//!   expires, a refused ext_proc stream, a sequence gap, a refused ZMTP peer) is scraped, and every
//!   family becomes a row (name, type, labels, help). Every name the code registers must be in it,
//!   so a new metric that nothing exercises fails here until the workload exercises it.
//!   Regenerate with [`catalogue::UPDATE_COMMAND`];
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

mod catalogue;
mod edge;
mod prometheus;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::{http, metrics, workspace_root};
use kvroute_tests::stack::{Routing, Stack, StackOptions};
use serde_json::Value;

use super::common::HISTORY_UNSTABLE_TEMPLATE;
use super::drift::conversation_turn;
use super::routing::post_raw;
use catalogue::{
    CATALOGUE_UPDATE_VAR, Family, UPDATE_COMMAND, catalogued, complete, families, is_catalogued,
    metric_names, registered_names, render_catalogue,
};
use edge::Edge;
use prometheus::Prometheus;

/// The generated catalogue, the dashboard, the alert rules and their unit tests.
const CATALOGUE: &str = "docs/metrics.md";
const DASHBOARD: &str = "deploy/grafana/kvroute.json";
const ALERTS: &str = "deploy/prometheus/kvroute-alerts.yaml";
const ALERT_TESTS: &str = "deploy/prometheus/kvroute-alerts.test.yaml";
/// The binaries (each also the name of its Prometheus job, as the alert rules assume), their
/// metric prefix and the sources whose metric families they register.
const BINARIES: [(&str, &str, &[&str]); 3] = [
    (
        "kvroute-ext-proc",
        "kvroute_extproc_",
        &["ext-proc/src", "discovery/src", "runtime/src"],
    ),
    (
        "kvroute-index",
        "kvroute_index_",
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
        &[
            "index-service/agent/src",
            "index-service/ingest/src",
            "discovery/src",
            "runtime/src",
        ],
    ),
];

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

/// A tool of Debian's `prometheus` package on `PATH`; `None` (with a SKIP line for `test`) when
/// absent, a failure under CI, whose setup installs it.
fn prometheus_tool(name: &str, test: &str) -> Option<PathBuf> {
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
        eprintln!("SKIP {test}: no `{name}` on PATH (apt-get install prometheus)");
    }
    found
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
    let Some(promtool) =
        prometheus_tool("promtool", "alert_rules_pass_promtool_and_their_unit_tests")
    else {
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

// ---------------------------------------------------------------------------------------------
// The reference stack.

/// The reference stack: two sims, the first rendering chat with another template than kvroute
/// tokenizes with (it drifts and degrades the pool), the second's events through the agent.
async fn reference_stack() -> Stack {
    Stack::start(StackOptions {
        replicas: 2,
        kv_blocks_per_replica: 1024,
        sim_chat_templates: vec![Some(HISTORY_UNSTABLE_TEMPLATE.to_owned()), None],
        agent_replicas: vec![1],
        // A mode to switch: the workload ends with a few requests in shadow mode.
        pool_extra_config: "mode: route".to_owned(),
        ext_proc_extra_config: format!(
            "drift: {{bound: 0.5, clear_below: 0.25, window: 10m, min_tokens: {DRIFT_MIN_TOKENS}, \
             action: approximate}}\nreload_interval: 100ms\ndecision_records: {{sample: 1.0}}\n"
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
    // A few turns in shadow mode (Envoy places them, kvroute compares), then routing again.
    stack.set_pool_mode("shadow").await.unwrap();
    for turn in 0..3 {
        let body = conversation_turn(1, turn).to_string().into_bytes();
        let response = post_raw(&url, body, &[]).await;
        assert_eq!(response.status, 200, "{}", response.text());
    }
    stack.set_pool_mode("route").await.unwrap();
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
    for ((binary, prefix, _), urls) in BINARIES.iter().zip(urls) {
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
/// Seconds since the Unix epoch, as Prometheus stamps samples.
fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn host_port(url: &str) -> String {
    url.trim_start_matches("http://").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scraped_stack_exports_the_catalogue_and_answers_every_panel() {
    let stack = reference_stack().await;
    let edge = Edge::start(&stack).await;
    let prometheus = match prometheus_tool(
        "prometheus",
        "a_scraped_stack_exports_the_catalogue_and_answers_every_panel (its Prometheus part)",
    ) {
        Some(binary) => {
            let jobs = [
                (
                    BINARIES[0].0,
                    vec![
                        host_port(&stack.ext_proc_admin_url().unwrap()),
                        host_port(&edge.ext_proc.admin_url()),
                    ],
                ),
                (
                    BINARIES[1].0,
                    vec![
                        host_port(&stack.index_admin_url().unwrap()),
                        host_port(&edge.index.admin_url()),
                    ],
                ),
                (
                    BINARIES[2].0,
                    vec![host_port(&stack.agent_admin_url().unwrap())],
                ),
            ];
            Some(Prometheus::start(&binary, &jobs).await)
        }
        None => None,
    };

    workload(&stack).await;
    edge.misbehave().await;
    let workload_done = unix_now();

    // The catalogue.
    let mut binaries = scrape_families(&stack, &edge).await;
    complete(&mut binaries);
    let generated = render_catalogue(&binaries);
    let path = repo_path(CATALOGUE);
    if std::env::var_os(CATALOGUE_UPDATE_VAR).is_some() {
        std::fs::write(&path, &generated).unwrap();
    } else {
        let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            checked_in == generated,
            "{CATALOGUE} is not what the binaries export; update it with:\n    {UPDATE_COMMAND}"
        );
    }
    let mut unexported = Vec::new();
    for ((binary, families), (_, _, sources)) in binaries.iter().zip(BINARIES) {
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
    // Every target scraped at least twice since the workload ended, so each counter it created
    // has two samples for the panels' rates (`up`'s samples over the time since then).
    try_poll_until(
        "every target scraped twice after the workload",
        settle(),
        || {
            let prometheus = &prometheus;
            async move {
                let since_ms = (unix_now() - workload_done) * 1000.0;
                let scrapes = format!("count_over_time(up[{since_ms:.0}ms]) >= 2");
                (prometheus.query(&scrapes).await.ok()?.len() == 5).then_some(())
            }
        },
    )
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
