//! The catalogue: metric families as the binaries export them, completed with the shared code's
//! and the declared ones, rendered as `docs/metrics.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::{BINARIES, CATALOGUE, repo_path};

/// Set, the test writes the catalogue instead of comparing it.
pub(super) const CATALOGUE_UPDATE_VAR: &str = "KVROUTE_UPDATE_METRICS_CATALOGUE";
/// How to regenerate the catalogue.
pub(super) const UPDATE_COMMAND: &str = "KVROUTE_UPDATE_METRICS_CATALOGUE=1 cargo nextest run -p kvroute-tests \
     -E 'test(a_scraped_stack_exports_the_catalogue_and_answers_every_panel)'";

/// One metric family as the exposition text shows it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Family {
    pub(super) kind: String,
    pub(super) help: String,
    pub(super) labels: BTreeSet<String>,
    /// How the catalogue knows it: [`EXPORTED`] or [`DECLARED`].
    pub(super) source: &'static str,
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

/// Families the reference stack never meets (a task panic, an agent refused, a debug token, a
/// shadow decision whose served host Envoy did not report, a disaggregated pool, an
/// engine restart, an invalid InferencePool, a stray replica id, an expired in-flight slot, the
/// agent's own config reloads and discovery), declared from their label types:
/// `(binary, family, type, labels, help)`. A declared family the stack does export must agree.
const UNEXERCISED: &[(&str, &str, &str, &[&str], &str)] = &[
    (
        "kvroute-ext-proc",
        "kvroute_extproc_disaggregation_decisions",
        "counter",
        &["decision", "pool"],
        "Requests of a disaggregated pool, by decision: split (prompt computed on a prefill \
         replica), or served whole: short_prompt, cached, no_prefill_replica, prefill_busy, no_prompt",
    ),
    (
        "kvroute-ext-proc",
        "kvroute_extproc_disaggregation_prefill_legs",
        "counter",
        &["outcome", "pool"],
        "Prefill legs ext-proc sent itself (disaggregation mode envoy), by outcome: ok, or \
         served whole on the decode replica: busy, connect_error, transport_error, status, \
         timeout, no_kv_transfer_params, unsupported_request",
    ),
    (
        "kvroute-ext-proc",
        "kvroute_extproc_disaggregation_prefill_retries",
        "counter",
        &["pool"],
        "Prefill-leg attempts repeated after a 502, 503 or 504 answer or a refused connection",
    ),
    (
        "kvroute-ext-proc",
        "kvroute_extproc_shadow_unobserved",
        "counter",
        &["pool"],
        "Shadow-mode decisions Envoy reported no served replica for (not compared)",
    ),
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
pub(super) fn families(text: &str) -> BTreeMap<String, Family> {
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
pub(super) fn render_catalogue(binaries: &[(&str, BTreeMap<String, Family>)]) -> String {
    let mut text = format!(
        "# Metric catalogue\n\n\
         Every metric family each kvroute binary exports on its admin port's `/metrics`, generated \
         from the running binaries (`tests/tests/suite/operate/` scrapes a reference stack made \
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
pub(super) fn catalogued() -> BTreeMap<String, String> {
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
pub(super) fn is_catalogued(catalogue: &BTreeMap<String, String>, name: &str) -> bool {
    catalogue.contains_key(name)
        || ["_bucket", "_sum", "_count"].iter().any(|suffix| {
            name.strip_suffix(suffix)
                .and_then(|base| catalogue.get(base))
                .is_some_and(|kind| kind == "histogram")
        })
}

/// The kvroute metric names in a PromQL expression (label values in quotes skipped).
pub(super) fn metric_names(expr: &str) -> BTreeSet<String> {
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
pub(super) fn registered_names(sources: &[&str]) -> BTreeSet<String> {
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
    for (_, _, sources) in BINARIES {
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
pub(super) fn complete(binaries: &mut [(&'static str, BTreeMap<String, Family>)]) {
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
    for (i, (_, prefix, dirs)) in BINARIES.iter().enumerate() {
        for (dir, sub) in SHARED_CODE {
            if !dirs.contains(&dir) {
                continue;
            }
            for name in registered_names(&[dir]) {
                let base = format!("{sub}{name}");
                if family_named(&binaries[i].1, prefix, &base).is_some() {
                    continue;
                }
                let found = BINARIES.iter().enumerate().find_map(|(j, (_, other, _))| {
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
