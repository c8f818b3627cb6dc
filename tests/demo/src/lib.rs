//! The demo workload and its measurements, shared by the `kvroute-demo` binary and its test.
//!
//! Workload: `groups` system prompts (one per "application", several KV blocks long), each used by
//! `users_per_group` users who chat for `turns` turns; every turn's prompt is the whole history so
//! far plus a new user message. It is a replay: the assistant replies in the history are part of
//! the recorded workload (generated from the seed), not the simulator's output, so both routing
//! modes send exactly the same prompts. Users run concurrently (at most `concurrency` at once);
//! each user's turns are sequential.
//!
//! Measurements, per phase:
//! - prefix-cache hit rate: deltas of the sims' `vllm:prefix_cache_hits_total` over
//!   `vllm:prefix_cache_queries_total` (tokens), summed over replicas;
//! - time to first token, measured by the client: from sending the streaming request until the
//!   first SSE chunk carrying content arrives (so it includes Envoy, kvroute and queueing);
//! - per-replica request share: deltas of each sim's `vllm:request_success_total`;
//! - failed requests: transport errors, non-200 answers, or streams without a token or `[DONE]`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt as _;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use kvroute_tests::harness::{HarnessError, http, metrics};
use kvroute_tests::stack::{MODEL, Routing, Stack, StackError};

/// Longest a single request may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Words the synthetic text is drawn from (common English; the tiny tokenizer splits most into
/// one or two tokens).
const WORDS: &[&str] = &[
    "the",
    "model",
    "answer",
    "question",
    "system",
    "user",
    "data",
    "cache",
    "request",
    "server",
    "time",
    "first",
    "token",
    "prompt",
    "block",
    "prefix",
    "route",
    "replica",
    "engine",
    "memory",
    "fast",
    "slow",
    "good",
    "small",
    "large",
    "long",
    "short",
    "simple",
    "clear",
    "careful",
    "always",
    "never",
    "often",
    "please",
    "help",
    "write",
    "read",
    "explain",
    "summarize",
    "list",
    "table",
    "number",
    "value",
    "result",
    "error",
    "policy",
    "rule",
    "order",
    "account",
    "price",
    "customer",
    "support",
    "product",
    "service",
    "report",
    "document",
    "section",
    "example",
    "format",
    "language",
    "code",
    "test",
    "build",
    "deploy",
    "config",
    "network",
    "latency",
    "throughput",
    "queue",
    "batch",
    "score",
    "weight",
    "load",
    "balance",
    "share",
    "group",
];

/// Shape and size of the workload.
#[derive(Debug, Clone)]
pub struct WorkloadOptions {
    /// Distinct system prompts.
    pub groups: usize,
    /// Users sharing each system prompt.
    pub users_per_group: usize,
    /// Turns per user.
    pub turns: usize,
    /// Words in each system prompt.
    pub system_words: usize,
    /// Words in each user message.
    pub user_words: usize,
    /// Words in each (recorded) assistant reply.
    pub assistant_words: usize,
    /// `max_tokens` of every request.
    pub max_tokens: usize,
    /// Users chatting at once.
    pub concurrency: usize,
    /// Seed of all generated text.
    pub seed: u64,
}

impl Default for WorkloadOptions {
    fn default() -> Self {
        Self {
            groups: 8,
            users_per_group: 4,
            turns: 5,
            system_words: 300,
            user_words: 40,
            assistant_words: 40,
            max_tokens: 8,
            concurrency: 16,
            seed: 7,
        }
    }
}

/// One user's conversation.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// The system prompt (shared by the group).
    pub system: Arc<str>,
    /// `(user message, recorded assistant reply)` per turn.
    pub turns: Vec<(String, String)>,
}

impl Conversation {
    /// The chat messages of turn `turn` (0-based): system, the history, the new user message.
    pub fn messages(&self, turn: usize) -> Value {
        let mut messages = vec![json!({"role": "system", "content": &*self.system})];
        for (user, assistant) in &self.turns[..turn] {
            messages.push(json!({"role": "user", "content": user}));
            messages.push(json!({"role": "assistant", "content": assistant}));
        }
        messages.push(json!({"role": "user", "content": &self.turns[turn].0}));
        Value::Array(messages)
    }
}

/// A deterministic generator (splitmix64): the workload must not change with a library version.
#[derive(Debug)]
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn text(&mut self, words: usize) -> String {
        let mut text = String::new();
        for i in 0..words {
            if i > 0 {
                text.push(' ');
            }
            text.push_str(WORDS[(self.next() % WORDS.len() as u64) as usize]);
        }
        text
    }
}

/// The conversations, ordered so consecutive users belong to different groups.
pub fn build_workload(options: &WorkloadOptions) -> Vec<Conversation> {
    let mut rng = SplitMix(options.seed);
    let systems: Vec<Arc<str>> = (0..options.groups)
        .map(|group| {
            // A distinct opening makes every group's first block distinct.
            Arc::from(format!(
                "You are assistant number {group}. {}",
                rng.text(options.system_words)
            ))
        })
        .collect();
    let mut conversations = Vec::with_capacity(options.groups * options.users_per_group);
    for user in 0..options.users_per_group {
        for system in &systems {
            let turns = (0..options.turns)
                .map(|turn| {
                    let question = format!(
                        "User {user} asks, turn {turn}: {}",
                        rng.text(options.user_words)
                    );
                    (question, rng.text(options.assistant_words))
                })
                .collect();
            conversations.push(Conversation {
                system: Arc::clone(system),
                turns,
            });
        }
    }
    conversations
}

/// Outcome of one request.
#[derive(Debug, Clone)]
struct RequestOutcome {
    /// Time to first token, if the request succeeded.
    ttft: Option<Duration>,
    /// Why it failed.
    error: Option<String>,
}

/// The counters read from each sim's `/metrics`.
#[derive(Debug, Clone, Copy, Default)]
struct SimCounters {
    hits: f64,
    queries: f64,
    successes: f64,
}

async fn sim_counters(stack: &Stack) -> Result<Vec<SimCounters>, HarnessError> {
    let mut all = Vec::new();
    for url in stack.sim_urls() {
        let text = http::get(&format!("{url}/metrics")).await?.text();
        all.push(SimCounters {
            hits: metrics::sum(&text, "vllm:prefix_cache_hits_total", &[]),
            queries: metrics::sum(&text, "vllm:prefix_cache_queries_total", &[]),
            successes: metrics::sum(&text, "vllm:request_success_total", &[]),
        });
    }
    Ok(all)
}

/// What one phase measured.
#[derive(Debug, Clone)]
pub struct PhaseReport {
    /// How requests were routed.
    pub routing: Routing,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub failed: usize,
    /// The first failure, for the log.
    pub first_error: Option<String>,
    /// Hit tokens over queried tokens, all replicas.
    pub hit_rate: f64,
    /// Prompt tokens the replicas served from their prefix caches (delivered).
    pub hit_tokens: f64,
    /// Client-side times to first token of the successful requests, sorted.
    pub ttfts: Vec<Duration>,
    /// Requests each replica completed.
    pub per_replica: Vec<u64>,
    /// Wall time of the phase.
    pub wall: Duration,
}

impl PhaseReport {
    /// Mean time to first token.
    pub fn ttft_mean(&self) -> Duration {
        if self.ttfts.is_empty() {
            return Duration::ZERO;
        }
        self.ttfts.iter().sum::<Duration>() / self.ttfts.len() as u32
    }

    /// The `q` quantile (0..=1) of time to first token (nearest rank).
    pub fn ttft_quantile(&self, q: f64) -> Duration {
        if self.ttfts.is_empty() {
            return Duration::ZERO;
        }
        let rank = (q * self.ttfts.len() as f64).ceil() as usize;
        self.ttfts[rank.clamp(1, self.ttfts.len()) - 1]
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Runs the whole workload through Envoy's `routing` listener and measures it (through kvroute's,
/// once kvroute has forgotten an earlier phase: [`until_kvroute_forgot`]).
pub async fn run_phase(
    stack: &Stack,
    routing: Routing,
    conversations: &[Conversation],
    options: &WorkloadOptions,
) -> Result<PhaseReport, StackError> {
    let url = stack.url(routing).ok_or(StackError::NotRunning {
        what: "that listener",
    })?;
    let endpoint = format!("{url}/v1/chat/completions");
    if routing == Routing::Kvroute {
        until_kvroute_forgot(stack, conversations, options).await?;
    }
    let before = sim_counters(stack).await?;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let started = Instant::now();
    let outcomes: Vec<Vec<RequestOutcome>> = futures::stream::iter(conversations)
        .map(|conversation| run_conversation(&client, &endpoint, conversation, options))
        .buffer_unordered(options.concurrency.max(1))
        .collect()
        .await;
    let wall = started.elapsed();
    let after = sim_counters(stack).await?;

    let outcomes: Vec<RequestOutcome> = outcomes.into_iter().flatten().collect();
    let mut ttfts: Vec<Duration> = outcomes.iter().filter_map(|o| o.ttft).collect();
    ttfts.sort();
    let delta = |f: fn(&SimCounters) -> f64| -> f64 {
        before.iter().zip(&after).map(|(b, a)| f(a) - f(b)).sum()
    };
    let queries = delta(|c| c.queries);
    Ok(PhaseReport {
        routing,
        requests: outcomes.len(),
        failed: outcomes.iter().filter(|o| o.error.is_some()).count(),
        first_error: outcomes.iter().find_map(|o| o.error.clone()),
        hit_rate: if queries > 0.0 {
            delta(|c| c.hits) / queries
        } else {
            0.0
        },
        hit_tokens: delta(|c| c.hits),
        ttfts,
        per_replica: before
            .iter()
            .zip(&after)
            .map(|(b, a)| (a.successes - b.successes).max(0.0) as u64)
            .collect(),
        wall,
    })
}

async fn run_conversation(
    client: &HttpClient,
    endpoint: &str,
    conversation: &Conversation,
    options: &WorkloadOptions,
) -> Vec<RequestOutcome> {
    let mut outcomes = Vec::with_capacity(conversation.turns.len());
    for turn in 0..conversation.turns.len() {
        let body = json!({
            "model": MODEL,
            "messages": conversation.messages(turn),
            "max_tokens": options.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let outcome =
            match tokio::time::timeout(REQUEST_TIMEOUT, stream_request(client, endpoint, &body))
                .await
            {
                Ok(Ok(ttft)) => RequestOutcome {
                    ttft: Some(ttft),
                    error: None,
                },
                Ok(Err(error)) => RequestOutcome {
                    ttft: None,
                    error: Some(error),
                },
                Err(_) => RequestOutcome {
                    ttft: None,
                    error: Some(format!("no answer within {REQUEST_TIMEOUT:?}")),
                },
            };
        outcomes.push(outcome);
    }
    outcomes
}

/// Sends one streaming chat request; returns the time to the first content chunk once the stream
/// ended properly with `[DONE]`.
async fn stream_request(
    client: &HttpClient,
    endpoint: &str,
    body: &Value,
) -> Result<Duration, String> {
    let request = hyper::Request::post(endpoint)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let response = client
        .request(request)
        .await
        .map_err(|e| format!("transport: {e:?}"))?;
    let status = response.status();
    let mut body = response.into_body();
    if !status.is_success() {
        let text = body
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        return Err(format!("HTTP {status}: {text}"));
    }
    let mut pending = Vec::new();
    let mut first_token = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("stream: {e}"))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        pending.extend_from_slice(data);
        while let Some(end) = find(&pending, b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(payload) = text.trim().strip_prefix("data: ") else {
                continue;
            };
            if payload == "[DONE]" {
                return first_token.ok_or_else(|| "stream ended without a token".to_owned());
            }
            if first_token.is_none() {
                let chunk: Value = serde_json::from_str(payload)
                    .map_err(|e| format!("bad SSE chunk: {e}: {payload}"))?;
                let content = &chunk["choices"][0]["delta"]["content"];
                if content.as_str().is_some_and(|c| !c.is_empty()) {
                    first_token = Some(started.elapsed());
                }
            }
        }
    }
    Err("stream ended without [DONE]".to_owned())
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

/// kvroute-ext-proc's shadow-mode totals for the demo's pool (`/v1/shadow`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ShadowTotals {
    /// Decisions compared with the replica Envoy served.
    pub requests: f64,
    /// Decisions Envoy reported no served replica for.
    pub unobserved: f64,
    /// Cached prompt tokens kvroute's choices held (what routing would capture).
    pub captured_tokens: f64,
    /// Cached prompt tokens the best candidates held.
    pub held_tokens: f64,
}

impl ShadowTotals {
    fn since(self, before: Self) -> Self {
        Self {
            requests: self.requests - before.requests,
            unobserved: self.unobserved - before.unobserved,
            captured_tokens: self.captured_tokens - before.captured_tokens,
            held_tokens: self.held_tokens - before.held_tokens,
        }
    }
}

/// The demo pool's shadow totals so far.
pub async fn shadow_totals(stack: &Stack) -> Result<ShadowTotals, StackError> {
    let url = format!("{}/v1/shadow", stack.ext_proc_admin_url()?);
    let summary: Value = http::get(&url)
        .await?
        .json()
        .map_err(|e| StackError::Component {
            component: "kvroute-ext-proc",
            detail: format!("/v1/shadow: {e}"),
            log: String::new(),
        })?;
    let pool = &summary["pools"][0];
    let number = |key: &str| pool[key].as_f64().unwrap_or(0.0);
    Ok(ShadowTotals {
        requests: number("requests"),
        unobserved: number("unobserved"),
        captured_tokens: number("captured_tokens"),
        held_tokens: number("held_tokens"),
    })
}

/// Waits until kvroute-ext-proc believes no replica holds any of the workload's system prompts.
/// After the engines' prefix caches are reset, kvroute's own placements of the last
/// `scoring.speculative_ttl` still count as held (their events "have not landed yet"), so a phase
/// started at once would inherit the previous phase's beliefs. Asks `/v1/explain` (nothing is
/// routed) for the first turn of one conversation per system prompt until every candidate's
/// matched blocks are 0.
pub async fn until_kvroute_forgot(
    stack: &Stack,
    conversations: &[Conversation],
    options: &WorkloadOptions,
) -> Result<(), StackError> {
    let url = format!(
        "{}/v1/explain?path=/v1/chat/completions",
        stack.ext_proc_admin_url()?
    );
    let firsts: Vec<Value> = conversations
        .iter()
        .take(options.groups)
        .map(|conversation| {
            json!({"model": MODEL, "messages": conversation.messages(0), "max_tokens": 1})
        })
        .collect();
    kvroute_test_support::try_poll_until(
        "kvroute-ext-proc to forget the previous phase's placements",
        kvroute_test_support::deadline(Duration::from_secs(60)),
        || async {
            for body in &firsts {
                let record: Value = http::post_json(&url, body).await.ok()?.json().ok()?;
                let held = record["candidates"]
                    .as_array()?
                    .iter()
                    .any(|c| c["matched_blocks"].as_u64() != Some(0));
                if held {
                    return None;
                }
            }
            Some(())
        },
    )
    .await
    .map_err(|e| StackError::Component {
        component: "kvroute-ext-proc",
        detail: e.to_string(),
        log: String::new(),
    })
}

/// The workload run through kvroute's listener with the pool in shadow mode: Envoy's own load
/// balancing places every request, kvroute decides each and says what its choices would have
/// served from cache.
#[derive(Debug, Clone)]
pub struct ShadowReport {
    /// The phase as measured (hit tokens: what Envoy's placement delivered).
    pub phase: PhaseReport,
    /// kvroute's totals over the phase.
    pub totals: ShadowTotals,
}

impl ShadowReport {
    /// Prompt tokens kvroute projects routing would add to what was delivered.
    pub fn projected_gain_tokens(&self) -> f64 {
        self.totals.captured_tokens - self.phase.hit_tokens
    }
}

/// Runs the workload in shadow mode (the pool is switched to `shadow` and back to `route`).
pub async fn run_shadow_phase(
    stack: &Stack,
    conversations: &[Conversation],
    options: &WorkloadOptions,
) -> Result<ShadowReport, StackError> {
    stack.set_pool_mode("shadow").await?;
    let before = shadow_totals(stack).await?;
    let phase = run_phase(stack, Routing::Kvroute, conversations, options).await;
    // Every response has begun by now, so every comparison is counted.
    let after = shadow_totals(stack).await;
    stack.set_pool_mode("route").await?;
    Ok(ShadowReport {
        phase: phase?,
        totals: after?.since(before),
    })
}

/// What shadow mode projected against what routing then delivered, in words.
pub fn render_projection(shadow: &ShadowReport, routed: &PhaseReport) -> String {
    let projected = shadow.projected_gain_tokens();
    let measured = routed.hit_tokens - shadow.phase.hit_tokens;
    let mut text = String::new();
    let _ = writeln!(
        text,
        "shadow mode (Envoy's least-request placed all {} requests, kvroute decided each):\n  \
         the engines served {:.0} prompt tokens from cache, kvroute's choices would have served \
         {:.0}: projected gain {:.0} tokens",
        shadow.phase.requests, shadow.phase.hit_tokens, shadow.totals.captured_tokens, projected
    );
    let _ = writeln!(
        text,
        "  routing the same workload then served {:.0}: measured gain {:.0} tokens ({})",
        routed.hit_tokens,
        measured,
        if projected > 0.0 {
            format!("{:.2}x the projection", measured / projected)
        } else {
            "no projection to compare".to_owned()
        }
    );
    text
}

/// The side-by-side table of two phases.
pub fn render_table(baseline: &PhaseReport, kvroute: &PhaseReport) -> String {
    let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1000.0);
    let pct = |x: f64| format!("{:.1}%", x * 100.0);
    let share = |report: &PhaseReport, replica: usize| {
        let total: u64 = report.per_replica.iter().sum();
        let count = report.per_replica.get(replica).copied().unwrap_or(0);
        let fraction = if total == 0 {
            0.0
        } else {
            count as f64 / total as f64
        };
        format!("{count} ({})", pct(fraction))
    };
    let mut rows: Vec<(String, String, String)> = vec![
        (
            "prefix-cache hit rate".to_owned(),
            pct(baseline.hit_rate),
            pct(kvroute.hit_rate),
        ),
        (
            "TTFT mean".to_owned(),
            ms(baseline.ttft_mean()),
            ms(kvroute.ttft_mean()),
        ),
        (
            "TTFT p90".to_owned(),
            ms(baseline.ttft_quantile(0.9)),
            ms(kvroute.ttft_quantile(0.9)),
        ),
        (
            "requests".to_owned(),
            baseline.requests.to_string(),
            kvroute.requests.to_string(),
        ),
        (
            "requests failed".to_owned(),
            baseline.failed.to_string(),
            kvroute.failed.to_string(),
        ),
    ];
    let replicas = baseline.per_replica.len().max(kvroute.per_replica.len());
    for replica in 0..replicas {
        rows.push((
            format!("served by sim-{replica}"),
            share(baseline, replica),
            share(kvroute, replica),
        ));
    }
    rows.push((
        "phase wall time".to_owned(),
        format!("{:.1} s", baseline.wall.as_secs_f64()),
        format!("{:.1} s", kvroute.wall.as_secs_f64()),
    ));
    let mut table = String::new();
    let _ = writeln!(
        table,
        "{:<24} {:>18} {:>18}",
        "",
        baseline.routing.as_label(),
        kvroute.routing.as_label()
    );
    let _ = writeln!(table, "{}", "-".repeat(62));
    for (name, left, right) in rows {
        let _ = writeln!(table, "{name:<24} {left:>18} {right:>18}");
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_is_deterministic_and_grows_history() {
        let options = WorkloadOptions {
            groups: 2,
            users_per_group: 2,
            turns: 3,
            ..WorkloadOptions::default()
        };
        let a = build_workload(&options);
        let b = build_workload(&options);
        assert_eq!(a.len(), 4);
        assert_eq!(a[1].turns, b[1].turns);
        // Consecutive users are from different groups; the same group shares its system prompt.
        assert_ne!(a[0].system, a[1].system);
        assert_eq!(a[0].system, a[2].system);
        let last = a[0].messages(2);
        assert_eq!(last.as_array().unwrap().len(), 6);
        assert_eq!(last[2]["content"], a[0].turns[0].1.as_str());
    }

    #[test]
    fn quantiles_use_nearest_rank() {
        let report = PhaseReport {
            routing: Routing::Kvroute,
            requests: 10,
            failed: 0,
            first_error: None,
            hit_rate: 0.0,
            hit_tokens: 0.0,
            ttfts: (1..=10).map(Duration::from_millis).collect(),
            per_replica: vec![],
            wall: Duration::ZERO,
        };
        assert_eq!(report.ttft_quantile(0.9), Duration::from_millis(9));
        assert_eq!(report.ttft_mean(), Duration::from_micros(5500));
    }
}
