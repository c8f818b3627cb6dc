//! Real vLLM tier, real tokenizers: a tool-using multi-turn agent workload through Envoy in front
//! of three real vLLM engines per model, for each real tokenizer folder (Qwen3, Llama 3.1,
//! gpt-oss; tiny random weights sized to each vocabulary, built by
//! `tests/vllm/goldens/make_models.py`).
//!
//! Ignored by default; `bash tests/vllm/run.sh` runs it after [`super::real_vllm`]. Per model:
//!
//! 1. **Parity on the workload**: for every request the agents send, the tokens ext-proc's
//!    decision path computes (body parser, token cache, in-process tokenizer with the folder's
//!    chat template, `tools` and all) equal the engine's own `/v1/chat/completions/render`.
//! 2. **Routing**: the workload by round robin over the engines, then through kvroute (Envoy),
//!    from empty prefix caches; the hit rate is vLLM's
//!    `prefix_cache_hits_total / prefix_cache_queries_total`. The round robin is the test's own,
//!    straight to the engines, dealing each round's requests in a seeded shuffle of their order
//!    (as [`super::real_vllm`] does): what Envoy's round robin does with requests sent at once,
//!    but the same on every run.
//! 3. **Predictions**: the cached tokens ext-proc predicted for each request it routed
//!    (`x-kvroute-predicted-cached-tokens`) agree with vLLM's
//!    `usage.prompt_tokens_details.cached_tokens` within one block for ≥ 95% of them.
//!
//! Environment: `KVROUTE_VLLM_AGENT_MODELS` (comma-separated model folders; default the golden
//! models in `~/.cache/kvroute/golden-models/`), `KVROUTE_VLLM_AGENT_RESULTS` (optional JSON file
//! for the measured numbers).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_ext_proc::server::{DECISION_HEADER, PREDICTED_CACHED_HEADER};
use kvroute_ext_proc::tokenizer::{InProcessTokenizer, Tokenizer};
use kvroute_tests::harness::http;
use kvroute_tests::stack::{Routing, Stack, StackOptions, StackTokenizer, release_binary_dir};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio_util::task::TaskTracker;

use super::common::decision_path_tokens;
use super::real_vllm::{
    EngineCounters, EngineSpec, Placement, ROUND_ROBIN_BASELINE, VllmEngine, cache_dir, counters,
    run_stats, start_engines, tier_stack_options, venv_dir,
};

const ENGINES: usize = 3;
const MODEL: &str = "tiny";
const BLOCK_SIZE: i64 = 32;
/// Agent sessions, replayed step by step (every session's step `s` at once).
const SESSIONS: usize = 16;
/// User turns per session; each turn is two requests: the user's question (the agent answers
/// with tool calls) and the tool results (the agent answers in prose).
const TURNS: usize = 3;
/// Usable KV blocks per engine: ~12k tokens, about a third of the sessions' final prompts, so
/// round robin (every session everywhere) evicts and kvroute (each session on one engine) keeps.
const KV_BLOCKS: usize = 384;
const MAX_MODEL_LEN: usize = 8192;
const WORKLOAD_SEED: u64 = 0x6167_656e_7473_2131;
/// Seeds the round-robin baseline's shuffle of each round's order.
const ROUND_ROBIN_SEED: u64 = 0x7272_6167_656e_7473;
/// Share of kvroute's requests whose prediction must be within one block of vLLM's count.
const MIN_PREDICTION_SHARE: f64 = 0.95;
/// The render endpoint's budget (a CPU engine renders a 1.5k-token agent prompt in ~5-20 ms).
const RENDER_TIMEOUT: Duration = Duration::from_millis(300);

fn model_dirs() -> Vec<PathBuf> {
    match std::env::var("KVROUTE_VLLM_AGENT_MODELS") {
        Ok(list) => list
            .split(',')
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
            .collect(),
        Err(_) => ["qwen3", "llama3_1", "gptoss"]
            .iter()
            .map(|name| cache_dir().join("golden-models").join(name))
            .collect(),
    }
}

// ---------------------------------------------------------------------------------------------
// The agent workload

const WORDS: &[&str] = &[
    "deploy", "service", "latency", "replica", "cache", "prefix", "request", "token", "cluster",
    "node", "pod", "region", "budget", "error", "retry", "queue", "metric", "alert", "window",
    "report", "incident", "config", "rollout", "shard", "index", "trace", "span", "user", "order",
    "invoice", "ticket", "status", "café", "naïve", "日本", "数据", "📈",
];

fn words(rng: &mut StdRng, count: usize) -> String {
    pick_words(WORDS, rng, count)
}

/// `count` words drawn from `list`, space-separated (the real-vLLM tiers' text).
pub(super) fn pick_words(list: &[&str], rng: &mut StdRng, count: usize) -> String {
    (0..count)
        .map(|_| list[rng.random_range(0..list.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

/// The tools every session offers: nested JSON-schema parameters, enums, arrays of objects and
/// unicode descriptions, the shapes agent frameworks send.
fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "search_logs",
            "description": "Search the cluster's logs — returns matching lines, newest first.",
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string", "description": "Lucene query"},
                "window": {"type": "object", "properties": {
                    "start": {"type": "string", "format": "date-time"},
                    "end": {"type": "string", "format": "date-time"}},
                    "required": ["start"]},
                "limit": {"type": "integer", "minimum": 1, "maximum": 500, "default": 50}},
                "required": ["query"]}}},
        {"type": "function", "function": {
            "name": "get_metrics",
            "description": "Read time series (Prometheus) for one service. Résumé: p50/p99 only.",
            "parameters": {"type": "object", "properties": {
                "service": {"type": "string"},
                "series": {"type": "array", "items": {"type": "string",
                    "enum": ["latency_p50", "latency_p99", "error_rate", "qps"]}},
                "step_seconds": {"type": "number"}},
                "required": ["service", "series"]}}},
        {"type": "function", "function": {
            "name": "open_ticket",
            "description": "Open an incident ticket 🎫 with an owner and labels.",
            "parameters": {"type": "object", "properties": {
                "title": {"type": "string"},
                "severity": {"type": "string", "enum": ["sev1", "sev2", "sev3"]},
                "owners": {"type": "array", "items": {"type": "object", "properties": {
                    "team": {"type": "string"}, "oncall": {"type": "boolean"}}}},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}}},
                "required": ["title", "severity"]}}},
        {"type": "function", "function": {
            "name": "run_sql",
            "description": "Run a read-only SQL query on the analytics warehouse (数据仓库).",
            "parameters": {"type": "object", "properties": {
                "sql": {"type": "string"},
                "timeout_ms": {"type": "integer"}},
                "required": ["sql"]}}}
    ])
}

/// A tool call's `arguments` string: compact or spaced JSON, as different clients serialize.
fn arguments(rng: &mut StdRng, tool: &str) -> String {
    let value = match tool {
        "search_logs" => {
            json!({"query": words(rng, 3), "window": {"start": "2026-11-30T10:00:00Z"},
            "limit": rng.random_range(10..200)})
        }
        "get_metrics" => json!({"service": words(rng, 1), "series": ["latency_p99", "error_rate"]}),
        "open_ticket" => json!({"title": words(rng, 5), "severity": "sev2",
            "owners": [{"team": words(rng, 1), "oncall": true}]}),
        _ => json!({"sql": format!("SELECT count(*) FROM {} WHERE day > 3", words(rng, 1))}),
    };
    if rng.random_bool(0.5) {
        value.to_string()
    } else {
        serde_json::to_string_pretty(&value).unwrap_or_default()
    }
}

/// One step of a session: the messages before the request (the agent's scripted replies
/// included, so both routings send exactly the same prompts).
struct Session {
    /// Extra request fields this session always sends (e.g. `chat_template_kwargs`).
    extra: Value,
    /// The conversation, growing: every request sends a prefix of it.
    messages: Vec<Value>,
    /// Where each request's conversation ends (an index into `messages`).
    request_ends: Vec<usize>,
}

struct AgentWorkload {
    sessions: Vec<Session>,
}

impl AgentWorkload {
    fn new() -> Self {
        let mut rng = StdRng::seed_from_u64(WORKLOAD_SEED);
        let system = format!(
            "You are the on-call assistant for the platform team. Use the tools to investigate \
             before answering; cite the evidence you found. {}",
            words(&mut rng, 120)
        );
        let tool_names = ["search_logs", "get_metrics", "open_ticket", "run_sql"];
        let sessions = (0..SESSIONS)
            .map(|session| {
                let mut messages = vec![json!({"role": "system", "content": system})];
                let mut request_ends = Vec::new();
                for turn in 0..TURNS {
                    messages.push(json!({"role": "user", "content": words(&mut rng, 60)}));
                    request_ends.push(messages.len());
                    let calls: Vec<Value> = (0..rng.random_range(1..=2))
                        .map(|call| {
                            let tool = tool_names[rng.random_range(0..tool_names.len())];
                            json!({"id": format!("call_{session}_{turn}_{call}"), "type": "function",
                                "function": {"name": tool, "arguments": arguments(&mut rng, tool)}})
                        })
                        .collect();
                    // OpenAI clients send `content: null` next to tool calls.
                    messages.push(json!({"role": "assistant", "content": null,
                        "tool_calls": calls.clone()}));
                    for call in &calls {
                        messages.push(json!({"role": "tool", "tool_call_id": call["id"],
                            "content": json!({"rows": words(&mut rng, 40)}).to_string()}));
                    }
                    request_ends.push(messages.len());
                    messages.push(json!({"role": "assistant", "content": words(&mut rng, 30)}));
                }
                let extra = match session % 3 {
                    0 => json!({}),
                    1 => json!({"chat_template_kwargs": {"enable_thinking": false}}),
                    _ => json!({"tool_choice": "auto"}),
                };
                Session {
                    extra,
                    messages,
                    request_ends,
                }
            })
            .collect();
        Self { sessions }
    }

    fn steps(&self) -> usize {
        TURNS * 2
    }

    /// The body of session `session`'s request `step`.
    fn body(&self, session: usize, step: usize) -> Value {
        let s = &self.sessions[session];
        let mut body = json!({"model": MODEL, "messages": s.messages[..s.request_ends[step]],
            "tools": tools(), "max_tokens": 2, "temperature": 0});
        if let (Some(body), Some(extra)) = (body.as_object_mut(), s.extra.as_object()) {
            body.extend(extra.clone());
        }
        body
    }
}

/// What one request saw.
#[derive(Debug, Clone)]
struct Outcome {
    session: usize,
    step: usize,
    prompt_tokens: i64,
    cached_tokens: i64,
    predicted_cached_tokens: Option<i64>,
    decision: Option<String>,
}

async fn send(url: &str, body: &Value, session: usize, step: usize) -> Outcome {
    let response = http::post_json(url, body).await.unwrap();
    assert_eq!(response.status, 200, "{}", response.text());
    let usage = response.json().unwrap()["usage"].clone();
    let header = |name: &str| {
        response
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    Outcome {
        session,
        step,
        prompt_tokens: usage["prompt_tokens"].as_i64().unwrap_or(0),
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
            .as_i64()
            .unwrap_or(0),
        predicted_cached_tokens: header(PREDICTED_CACHED_HEADER).and_then(|v| v.parse().ok()),
        decision: header(DECISION_HEADER),
    }
}

/// How sessions arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arrival {
    /// Session `i` starts at round `i`: at any moment sessions are at different steps, and a
    /// new one arrives while the others are mid-conversation (how agent traffic arrives).
    Staggered,
    /// Every session's step `s` in the same round: all sessions start at the same instant, so
    /// their shared system prompt and tools reach the engines together.
    Lockstep,
}

impl Arrival {
    fn as_label(self) -> &'static str {
        match self {
            Self::Staggered => "staggered",
            Self::Lockstep => "lockstep",
        }
    }
}

/// Replays the workload in rounds, the next round when every request of this one answered.
async fn run_workload(
    placement: &mut Placement,
    workload: &AgentWorkload,
    arrival: Arrival,
) -> Vec<Outcome> {
    let steps = workload.steps();
    let offset = |session: usize| match arrival {
        Arrival::Staggered => session,
        Arrival::Lockstep => 0,
    };
    let rounds = steps + offset(SESSIONS - 1);
    let mut outcomes = Vec::new();
    for round in 0..rounds {
        let due: Vec<(usize, usize)> = (0..SESSIONS)
            .filter_map(|session| {
                let step = round.checked_sub(offset(session)).filter(|&s| s < steps)?;
                Some((session, step))
            })
            .collect();
        let requests =
            placement
                .round(due.len())
                .into_iter()
                .zip(due)
                .map(|(base_url, (session, step))| {
                    let body = workload.body(session, step);
                    async move {
                        let url = format!("{base_url}/v1/chat/completions");
                        send(&url, &body, session, step).await
                    }
                });
        outcomes.extend(futures::future::join_all(requests).await);
    }
    outcomes
}

fn within_one_block(outcome: &Outcome) -> bool {
    outcome
        .predicted_cached_tokens
        .is_some_and(|predicted| (predicted - outcome.cached_tokens).abs() <= BLOCK_SIZE)
}

/// kvroute in front of `engines`, tokenizing with `tokenizer`: release binaries (a debug build's
/// tokenizer is several times slower than what production runs, which changes when a
/// conversation's exact tokens are ready).
async fn start_stack(tokenizer: StackTokenizer, engines: &[VllmEngine]) -> Stack {
    Stack::start_external(
        StackOptions {
            tokenizer,
            bin_dir: Some(release_binary_dir()),
            ..tier_stack_options()
        },
        engines.iter().map(|e| e.external.clone()).collect(),
    )
    .await
    .unwrap_or_else(|e| panic!("stack: {e}"))
}

/// One run of the workload: who routes, and how kvroute gets its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    RoundRobin,
    /// kvroute, the model folder's tokenizer and template in process.
    InProcess,
    /// kvroute, every prompt from the engine's own render endpoint (engine 0's).
    Render,
}

impl Run {
    const ALL: [Self; 3] = [Self::RoundRobin, Self::InProcess, Self::Render];

    fn as_label(self) -> &'static str {
        match self {
            Self::RoundRobin => "round_robin",
            Self::InProcess => "kvroute",
            Self::Render => "kvroute_render",
        }
    }

    /// What the run is, in the printed results and the results file.
    fn description(self) -> &'static str {
        match self {
            Self::RoundRobin => ROUND_ROBIN_BASELINE,
            Self::InProcess => "kvroute (through Envoy, in-process tokenizer)",
            Self::Render => "kvroute (through Envoy, the engine's render endpoint)",
        }
    }
}

/// One model: engines, parity on the workload, round robin vs kvroute, predictions.
async fn run_model(model_dir: &Path, failures: &mut Vec<String>) -> Value {
    let name = model_dir
        .file_name()
        .map_or_else(|| "model".to_owned(), |n| n.to_string_lossy().into_owned());
    let logs = tempfile::tempdir().unwrap();
    let spec = EngineSpec {
        model_dir: model_dir.to_path_buf(),
        kv_blocks: KV_BLOCKS,
        max_model_len: MAX_MODEL_LEN,
        // Render endpoints for the parity check; `tools` with tool_choice "auto" need a parser.
        extra_args: [
            "--enable-scale-out",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ]
        .map(str::to_owned)
        .to_vec(),
        data_parallel_size: 1,
        kv_role: None,
    };
    let started = Instant::now();
    let engines = start_engines(ENGINES, logs.path(), &spec).await;
    eprintln!(
        "{name}: {ENGINES} engines ready in {:.1?}",
        started.elapsed()
    );
    let workload = AgentWorkload::new();

    // --- 1. Parity: the decision path's tokens equal the engine's render, request by request.
    let tasks = TaskTracker::new();
    let tokenizer: Arc<dyn Tokenizer> =
        Arc::new(InProcessTokenizer::load(model_dir, tasks.clone()).unwrap());
    let render = format!("{}/v1/chat/completions/render", engines[0].url());
    let (mut mismatches, mut checked, mut longest) = (Vec::new(), 0, 0);
    for session in 0..SESSIONS {
        for step in 0..workload.steps() {
            let body = workload.body(session, step);
            let wire = body.to_string();
            let case = format!("{name} session {session} step {step}");
            let ours =
                decision_path_tokens(&tokenizer, &tasks, &wire, "/v1/chat/completions", &case)
                    .await;
            let response = http::post_json(&render, &body).await.unwrap();
            assert_eq!(response.status, 200, "{case}: {}", response.text());
            let answer = response.json().unwrap();
            let generate = if answer.is_array() {
                answer[0].clone()
            } else {
                answer
            };
            let theirs: Vec<u32> = serde_json::from_value(generate["token_ids"].clone()).unwrap();
            checked += 1;
            longest = longest.max(theirs.len());
            if *ours.tokens != theirs[..] {
                let at = ours
                    .tokens
                    .iter()
                    .zip(&theirs)
                    .position(|(a, b)| a != b)
                    .unwrap_or(ours.tokens.len().min(theirs.len()));
                mismatches.push(format!(
                    "{case}: {} ours vs {} vLLM tokens, first difference at {at}",
                    ours.tokens.len(),
                    theirs.len()
                ));
            }
        }
    }
    tasks.close();
    if !mismatches.is_empty() {
        failures.push(format!(
            "{name}: {} of {checked} workload requests tokenized differently, e.g. {:?}",
            mismatches.len(),
            &mismatches[..mismatches.len().min(3)]
        ));
    }
    eprintln!(
        "{name}: parity {}/{checked} equal, longest prompt {longest} tokens",
        checked - mismatches.len()
    );

    // --- 2 and 3. Round robin, then kvroute, each from empty caches, for both arrivals.
    let mut report = serde_json::Map::new();
    for arrival in [Arrival::Staggered, Arrival::Lockstep] {
        let mut runs = BTreeMap::new();
        for run in Run::ALL {
            // A fresh stack per run: what ext-proc remembers routing (speculative prefixes,
            // in-flight) must not outlive the engines' caches, which are reset before each run.
            // The round-robin run bypasses it and uses it only to reset those caches.
            let tokenizer = match run {
                Run::Render => StackTokenizer::RenderUrl {
                    url: engines[0].url(),
                    timeout: RENDER_TIMEOUT,
                },
                Run::RoundRobin | Run::InProcess => {
                    StackTokenizer::ModelDir(model_dir.to_path_buf())
                }
            };
            let stack = start_stack(tokenizer, &engines).await;
            let mut placement = match run {
                Run::RoundRobin => Placement::round_robin(
                    engines.iter().map(VllmEngine::url).collect(),
                    ROUND_ROBIN_SEED,
                ),
                Run::InProcess | Run::Render => {
                    Placement::Through(stack.url(Routing::Kvroute).unwrap())
                }
            };
            stack.reset_prefix_caches().await.unwrap();
            let before = counters(&engines).await;
            let started = Instant::now();
            let outcomes = run_workload(&mut placement, &workload, arrival).await;
            let elapsed = started.elapsed();
            let after = counters(&engines).await;
            let deltas: Vec<EngineCounters> =
                after.iter().zip(&before).map(|(a, b)| *a - *b).collect();
            let stats = run_stats(&deltas);
            let within = outcomes.iter().filter(|o| within_one_block(o)).count();
            let misses: Vec<String> = outcomes
                .iter()
                .filter(|o| run != Run::RoundRobin && !within_one_block(o))
                .map(|o| {
                    format!(
                        "session {} step {}: predicted {:?}, vLLM cached {} of {} ({:?})",
                        o.session,
                        o.step,
                        o.predicted_cached_tokens,
                        o.cached_tokens,
                        o.prompt_tokens,
                        o.decision
                    )
                })
                .collect();
            eprintln!(
                "{name} {} {}: {stats:?} in {elapsed:.1?}; {within}/{} predictions within one \
                 block; the others: {misses:#?}",
                arrival.as_label(),
                run.description(),
                outcomes.len()
            );
            let share = within as f64 / outcomes.len().max(1) as f64;
            // The claims are made for agent traffic as it arrives; lockstep is reported beside it.
            if arrival == Arrival::Staggered
                && run != Run::RoundRobin
                && share < MIN_PREDICTION_SHARE
            {
                failures.push(format!(
                    "{name} {}: only {within}/{} predictions within one block of vLLM's \
                     cached_tokens: {:?}",
                    run.as_label(),
                    outcomes.len(),
                    &misses[..misses.len().min(8)]
                ));
                eprintln!("{}", stack.logs());
            }
            let mut decisions = BTreeMap::<String, usize>::new();
            for outcome in &outcomes {
                *decisions
                    .entry(outcome.decision.clone().unwrap_or_else(|| "none".into()))
                    .or_default() += 1;
            }
            runs.insert(
                run.as_label(),
                json!({"routing": run.description(),
                    "hit_rate": stats.hit_rate, "max_request_share": stats.max_request_share,
                    "prompt_tokens": outcomes.iter().map(|o| o.prompt_tokens).sum::<i64>(),
                    "cached_tokens_reported": outcomes.iter().map(|o| o.cached_tokens).sum::<i64>(),
                    "seconds": elapsed.as_secs_f64(),
                    "predictions_within_one_block": within, "prediction_share": share,
                    "requests": outcomes.len(), "decisions": decisions}),
            );
        }
        let hit_rate = |label: &str| runs[label]["hit_rate"].as_f64().unwrap_or(0.0);
        if arrival == Arrival::Staggered {
            for run in [Run::InProcess, Run::Render] {
                if hit_rate(run.as_label()) <= hit_rate(Run::RoundRobin.as_label()) {
                    failures.push(format!(
                        "{name}: {} hit rate {:.3} not above {ROUND_ROBIN_BASELINE}'s {:.3}",
                        run.as_label(),
                        hit_rate(run.as_label()),
                        hit_rate(Run::RoundRobin.as_label())
                    ));
                }
            }
        }
        report.insert(arrival.as_label().to_owned(), json!(runs));
    }
    json!({
        "model": name,
        "longest_prompt_tokens": longest,
        "parity": {"requests": checked, "mismatches": mismatches.len()},
        "arrivals": report,
    })
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real vLLM tier: bash tests/vllm/run.sh"]
async fn real_vllm_agent_workload() {
    let dirs = model_dirs();
    assert!(
        venv_dir().join("bin/python").is_file(),
        "no vLLM venv at {}: run `bash tests/vllm/run.sh`",
        venv_dir().display()
    );
    for dir in &dirs {
        assert!(
            dir.join("config.json").is_file() && dir.join("tokenizer.json").is_file(),
            "no model at {}: run `bash tests/vllm/run.sh` (it builds the golden models)",
            dir.display()
        );
    }
    let mut failures = Vec::new();
    let mut results = Vec::new();
    for dir in &dirs {
        results.push(run_model(dir, &mut failures).await);
    }
    let summary = serde_json::to_string_pretty(&Value::Array(results)).unwrap();
    eprintln!("real vLLM agent results:\n{summary}");
    if let Some(path) = std::env::var_os("KVROUTE_VLLM_AGENT_RESULTS")
        && let Err(error) = std::fs::write(&path, &summary)
    {
        failures.push(format!("writing {}: {error}", path.to_string_lossy()));
    }
    assert!(
        failures.is_empty(),
        "real vLLM agent tier failed:\n{}",
        failures.join("\n")
    );
}
