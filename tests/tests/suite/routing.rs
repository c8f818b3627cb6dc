//! End-to-end routing through the product as real processes: Envoy (the shipped
//! `envoy/kvroute-override-host.yaml`) → kvroute-ext-proc → kvroute-index, in front of
//! `kvroute-engine-sim` replicas ([`Stack`]).
//!
//! Which replica served a request is read from the sims themselves (`vllm:request_success_total`
//! moves on exactly one sim per sequential request), and cache reuse from the response's
//! `usage.prompt_tokens_details.cached_tokens`, so the assertions hold whatever kvroute claims.
//!
//! Needs the binaries next to the test executable: `cargo build -p kvroute-index -p
//! kvroute-ext-proc -p kvroute-tests --bins` before `cargo test -p kvroute-tests --test integration routing`.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_ext_proc::server::{CLUSTER_HEADER, DECISION_HEADER, DESTINATION_HEADER};
use kvroute_test_support::{deadline, poll_until, try_poll_until};
use kvroute_tests::harness::http::{self, HttpResponse};
use kvroute_tests::harness::{Envoy, SimProcess, metrics, workspace_root};
use kvroute_tests::stack::{
    MODEL, OVERRIDE_HOST_CONFIG, Routing, Stack, StackOptions, render_envoy_config,
};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::common::{SIM_BIN, family_total, sim_args, until_indexed};

/// How long a test waits for counters/metrics to settle.
fn settle() -> Duration {
    deadline(Duration::from_secs(20))
}

/// Deterministic filler text: `words` pseudo-words from `seed` (different seeds share no words
/// in practice, so their prompts share no KV block).
pub fn text(seed: u64, words: usize) -> String {
    const SYLLABLES: [&str; 16] = [
        "ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "zi", "pa", "do", "fe", "gu", "hi", "jo",
        "be",
    ];
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::new();
    for i in 0..words {
        if i > 0 {
            out.push(' ');
        }
        for _ in 0..3 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            out.push_str(SYLLABLES[(state % 16) as usize]);
        }
    }
    out
}

/// `POST url` with a raw body and extra headers.
pub async fn post_raw(url: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> HttpResponse {
    let mut request = hyper::Request::post(url).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let client = Client::builder(TokioExecutor::new()).build_http();
    let response = client
        .request(request.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e:?}"));
    let (parts, body) = response.into_parts();
    HttpResponse {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

fn completion(prompt: &str) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 2})
}

/// Finished requests per sim (`vllm:request_success_total`, or an SGLang sim's
/// `sglang:num_requests_total`), in replica order.
pub(super) async fn finished(stack: &Stack) -> Vec<u64> {
    let mut counts = Vec::new();
    for url in stack.sim_urls() {
        let text = http::get(&format!("{url}/metrics")).await.unwrap().text();
        let family = if text.contains("sglang:") {
            "sglang:num_requests_total"
        } else {
            "vllm:request_success_total"
        };
        counts.push(family_total(&text, family) as u64);
    }
    counts
}

/// Waits until the sims finished `expected` more requests than `before`; returns the per-sim deltas.
pub(super) async fn served_since(stack: &Stack, before: &[u64], expected: u64) -> Vec<u64> {
    try_poll_until("the sims to count the requests", settle(), || async {
        let now = finished(stack).await;
        let delta: Vec<u64> = now.iter().zip(before).map(|(n, b)| n - b).collect();
        (delta.iter().sum::<u64>() == expected).then_some(delta)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", stack.logs()))
}

/// Sends one request through kvroute's listener; returns the serving replica and the body.
async fn route(
    stack: &Stack,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (usize, Value) {
    let (replica, response) = route_response(stack, path, body, headers).await;
    (replica, response.json().unwrap())
}

/// [`route`], returning the whole response (headers included).
pub(super) async fn route_response(
    stack: &Stack,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (usize, HttpResponse) {
    stack
        .until_replicas_idle()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", stack.logs()));
    let before = finished(stack).await;
    let url = format!("{}{path}", stack.url(Routing::Kvroute).unwrap());
    let response = post_raw(&url, body.to_string().into_bytes(), headers).await;
    assert_eq!(
        response.status,
        200,
        "{}\n{}",
        response.text(),
        stack.logs()
    );
    let delta = served_since(stack, &before, 1).await;
    let replica = delta.iter().position(|d| *d == 1).unwrap();
    (replica, response)
}

/// One completion through kvroute's listener, sent alone.
pub(super) struct Routed {
    /// The replica that served it.
    pub replica: usize,
    /// `x-kvroute-decision` (`tier/reason`), empty when absent.
    pub decision: String,
    /// The prompt tokens the serving engine found cached.
    pub cached_tokens: u64,
}

/// (Needs `debug_headers` on for the decision.)
pub(super) async fn route_decided(stack: &Stack, prompt: &str) -> Routed {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let (replica, response) = route_response(stack, "/v1/completions", &body, &[]).await;
    let decision = response.header(DECISION_HEADER);
    let answer: Value = response.json().unwrap();
    Routed {
        replica,
        decision,
        cached_tokens: answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    }
}

fn cached_tokens(body: &Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// kvroute-ext-proc's `/metrics` text.
pub(super) async fn ext_proc_metrics(stack: &Stack) -> String {
    let url = format!("{}/metrics", stack.ext_proc_admin_url().unwrap());
    http::get(&url).await.unwrap().text()
}

/// Leading blocks of `prompt` (as the sims tokenize it) the index says each replica holds.
pub(super) async fn index_matches(stack: &Stack, prompt: &str) -> Vec<u64> {
    let tokens = http::post_json(
        &format!("{}/tokenize", stack.sim_urls()[0]),
        &json!({"model": MODEL, "prompt": prompt}),
    )
    .await
    .unwrap()
    .json()
    .unwrap()["tokens"]
        .clone();
    let url = format!("{}/v1/match", stack.index_admin_url().unwrap());
    let answer = http::post_json(&url, &json!({"model": MODEL, "token_ids": tokens}))
        .await
        .unwrap()
        .json()
        .unwrap();
    let ids = stack.replica_ids();
    ids.iter()
        .map(|id| {
            answer["replicas"]
                .as_array()
                .and_then(|all| all.iter().find(|r| r["id"] == id.as_str()))
                .and_then(|r| r["matched_blocks"].as_u64())
                .unwrap_or(0)
        })
        .collect()
}

#[tokio::test]
async fn shared_prefixes_follow_their_cache_and_unrelated_prompts_spread() {
    let stack = Stack::start(StackOptions::default()).await.unwrap();
    let prefix = text(1, 150);
    let (holder, first) = route(
        &stack,
        "/v1/completions",
        &completion(&format!("{prefix} q0")),
        &[],
    )
    .await;
    assert_eq!(cached_tokens(&first), 0);
    // The engine's KV events reach the index: later decisions are precise, not speculative.
    poll_until("the index to learn the prefix", settle(), || async {
        let matches = index_matches(&stack, &prefix).await;
        (matches[holder] > 0).then_some(())
    })
    .await;

    for i in 1..=6 {
        let prompt = format!("{prefix} q{i}");
        let (replica, body) = route(&stack, "/v1/completions", &completion(&prompt), &[]).await;
        assert_eq!(
            replica, holder,
            "request {i} left the replica holding its prefix"
        );
        let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(
            cached_tokens(&body) * 10 >= prompt_tokens * 8,
            "request {i}: {} of {prompt_tokens} tokens cached",
            cached_tokens(&body)
        );
    }
    let metrics = ext_proc_metrics(&stack).await;
    assert!(
        metrics::sum(
            &metrics,
            "kvroute_extproc_decisions_total",
            &["tier=\"precise\"", "reason=\"cache_hit\""]
        ) >= 6.0,
        "{metrics}"
    );

    let mut used = [0u32; 4];
    for i in 0..16 {
        let (replica, _) = route(
            &stack,
            "/v1/completions",
            &completion(&text(100 + i, 200)),
            &[],
        )
        .await;
        used[replica] += 1;
    }
    assert!(
        used.iter().filter(|n| **n > 0).count() >= 3,
        "unrelated prompts should spread over the replicas: {used:?}"
    );
}

#[tokio::test]
async fn a_burst_of_siblings_co_locates() {
    // A busy pool's batching: an idle one scores candidates on what the index confirms, and the
    // siblings spread over the replicas holding their context (the policy's tests).
    let stack = Stack::start(StackOptions {
        scoring_extra_config: "idle_pool_ms: 0".to_owned(),
        ..StackOptions::default()
    })
    .await
    .unwrap();
    let prefix = text(2, 300);
    let url = format!("{}/v1/completions", stack.url(Routing::Kvroute).unwrap());
    let before = finished(&stack).await;
    let requests = (0..16).map(|i| {
        let body = completion(&format!("{prefix} sibling {i}"))
            .to_string()
            .into_bytes();
        let url = url.clone();
        async move { post_raw(&url, body, &[]).await }
    });
    for response in futures::future::join_all(requests).await {
        assert_eq!(response.status, 200, "{}", response.text());
    }
    let served = served_since(&stack, &before, 16).await;
    let holders = served.iter().filter(|&&n| n > 0).count();
    let decisions: Vec<String> = ext_proc_metrics(&stack)
        .await
        .lines()
        .filter(|l| l.starts_with("kvroute_extproc_decisions_total"))
        .map(str::to_owned)
        .collect();
    // The shared prefix (~1.3k tokens) is worth about 10 running requests on these weights: the
    // siblings batch on one replica until its running load costs more than a fresh prefill
    // elsewhere, and the overflow then shares the second holder's copy. A third replica would pay
    // off only past ~20 in flight, so 16 siblings occupy at most two replicas however they
    // interleave (how many land on each depends on how many finished before the rest arrived).
    assert!(
        holders <= 2,
        "16 siblings sent at once should co-locate on at most two replicas: {served:?}\n{decisions:#?}"
    );
}

#[tokio::test]
async fn a_busy_replica_stops_receiving_work_even_for_its_cached_prefix() {
    // Every decision is recorded: the checks below read what each one saw.
    let stack = Stack::start(StackOptions {
        ext_proc_extra_config: "decision_records: {sample: 1.0}\n".to_owned(),
        ..StackOptions::default()
    })
    .await
    .unwrap();
    let prefix = text(3, 150);
    let (holder, _) = route(
        &stack,
        "/v1/completions",
        &completion(&format!("{prefix} q0")),
        &[],
    )
    .await;
    // An idle pool scores a replica on what the index confirms there: the next one follows the
    // prefix once its events have landed.
    until_indexed(&stack, holder).await;
    let (again, _) = route(
        &stack,
        "/v1/completions",
        &completion(&format!("{prefix} q1")),
        &[],
    )
    .await;
    assert_eq!(again, holder);

    // Keep the holder busy directly (not through Envoy) with looping generations, few enough
    // KV blocks that the prefix stays cached there.
    let hog_url = format!("{}/v1/completions", stack.sim_urls()[holder]);
    let stop = CancellationToken::new();
    let hogs = futures::future::join_all((0..24).map(|i| {
        let (url, stop) = (hog_url.clone(), stop.clone());
        async move {
            while !stop.is_cancelled() {
                let body = json!({"model": MODEL, "prompt": text(1000 + i, 10), "max_tokens": 100});
                let _ = http::post_json(&url, &body).await;
            }
        }
    }));
    let holder_id = stack.replica_ids()[holder].clone();
    let probe = async {
        let running = format!("replica=\"{holder_id}\"");
        for i in 2..8 {
            // The hogs share this test's thread: on a loaded host the holder can drain between
            // two probes, so each probe waits until kvroute sees it busy again.
            poll_until("kvroute to see the busy replica", settle(), || async {
                let metrics = ext_proc_metrics(&stack).await;
                let seen = metrics::sum(
                    &metrics,
                    "kvroute_extproc_replica_running_requests",
                    &[&running],
                );
                (seen >= 16.0).then_some(())
            })
            .await;
            send_through_kvroute(&stack, &completion(&format!("{prefix} q{i}"))).await;
        }
        stop.cancel();
    };
    tokio::join!(hogs, probe);

    // Judged by what each probe's decision saw (a scrape can still land between the wait and
    // the decision): none that saw the holder busy chose it, and the first of those left the
    // cached prefix for load; later ones follow the prefix to its new home.
    let records: Value = http::get(&format!(
        "{}/v1/decisions",
        stack.ext_proc_admin_url().unwrap()
    ))
    .await
    .unwrap()
    .json()
    .unwrap();
    let mut probes: Vec<&Value> = records["decisions"].as_array().unwrap().iter().collect();
    probes.reverse();
    assert_eq!(probes.len(), 8, "{records:#}");
    let saw_busy: Vec<&Value> =
        probes[2..]
            .iter()
            .copied()
            .filter(|decision| {
                decision["candidates"].as_array().unwrap().iter().any(|c| {
                    c["replica"] == holder_id.as_str() && c["running"].as_f64() >= Some(16.0)
                })
            })
            .collect();
    assert!(
        !saw_busy.is_empty(),
        "no probe saw the holder busy: {records:#}"
    );
    assert!(
        saw_busy.iter().all(|d| d["chosen"] != holder_id.as_str()),
        "new work went to the busy replica {holder_id}: {records:#}"
    );
    let first = saw_busy[0];
    let only_the_holder_held_it =
        first["candidates"].as_array().unwrap().iter().all(|c| {
            (c["replica"] == holder_id.as_str()) == (c["matched_blocks"].as_u64() > Some(0))
        });
    if only_the_holder_held_it {
        assert!(
            ["load_over_cache", "hotspot_guard"].contains(&first["reason"].as_str().unwrap()),
            "{first:#}"
        );
    }
}

/// Sends `body` through kvroute and checks it was served.
async fn send_through_kvroute(stack: &Stack, body: &Value) {
    let url = format!("{}/v1/completions", stack.url(Routing::Kvroute).unwrap());
    let response = post_raw(&url, body.to_string().into_bytes(), &[]).await;
    assert_eq!(response.status, 200, "{}", response.text());
}

#[tokio::test]
async fn requests_keep_flowing_when_the_index_or_ext_proc_dies() {
    let mut stack = Stack::start(StackOptions::default()).await.unwrap();
    let prefix = text(4, 150);
    let (holder, _) = route(
        &stack,
        "/v1/completions",
        &completion(&format!("{prefix} q0")),
        &[],
    )
    .await;

    stack.kill_index().unwrap();
    for i in 1..=10 {
        // Same prefix: the approximate tier (kvroute's own routing memory) keeps it on its replica.
        let (replica, _) = route(
            &stack,
            "/v1/completions",
            &completion(&format!("{prefix} q{i}")),
            &[],
        )
        .await;
        assert_eq!(replica, holder, "approximate tier lost the prefix");
    }
    let metrics = ext_proc_metrics(&stack).await;
    assert!(
        metrics::sum(
            &metrics,
            "kvroute_extproc_fallbacks_total",
            &["stage=\"index\""]
        ) >= 10.0,
        "{metrics}"
    );
    assert!(
        metrics::sum(
            &metrics,
            "kvroute_extproc_decisions_total",
            &["tier=\"approximate\""]
        ) >= 10.0,
        "{metrics}"
    );

    stack.kill_ext_proc().unwrap();
    let url = format!("{}/v1/completions", stack.url(Routing::Kvroute).unwrap());
    let before = finished(&stack).await;
    for i in 0..20 {
        let response = post_raw(
            &url,
            completion(&text(200 + i, 50)).to_string().into_bytes(),
            &[],
        )
        .await;
        assert_eq!(response.status, 200, "{}", response.text());
    }
    served_since(&stack, &before, 20).await;
    let allowed = stack
        .envoy()
        .stat("http.kvroute.ext_proc.failure_mode_allowed")
        .await
        .unwrap()
        .unwrap_or(0);
    assert!(allowed >= 20, "Envoy counted {allowed} fail-open requests");

    // Both come back and kvroute routes again.
    stack.restart_index().await.unwrap();
    stack.restart_ext_proc().await.unwrap();
    let (_, body) = route(
        &stack,
        "/v1/completions",
        &completion(&format!("{prefix} again")),
        &[],
    )
    .await;
    assert_eq!(body["object"], "text_completion");
    let metrics = ext_proc_metrics(&stack).await;
    assert!(
        metrics::sum(&metrics, "kvroute_extproc_decisions_total", &[]) >= 1.0,
        "{metrics}"
    );
}

#[tokio::test]
async fn bad_requests_get_json_errors_and_spoofed_destinations_are_ignored() {
    let mut stack = Stack::start(StackOptions::default()).await.unwrap();
    let base = stack.url(Routing::Kvroute).unwrap();
    let completions = format!("{base}/v1/completions");
    let error = |response: &HttpResponse, status: u16| {
        assert_eq!(response.status, status, "{}", response.text());
        let body = response.json().unwrap();
        assert!(body["error"]["message"].is_string(), "{body}");
    };

    error(
        &post_raw(
            &completions,
            b"{\"model\": \"tiny\", \"prompt\": ".to_vec(),
            &[],
        )
        .await,
        400,
    );
    error(
        &post_raw(
            &completions,
            json!({"model": "no-such-model", "prompt": "hi"})
                .to_string()
                .into_bytes(),
            &[],
        )
        .await,
        404,
    );
    let huge = completion(&"x".repeat(1536 * 1024))
        .to_string()
        .into_bytes();
    let too_large = post_raw(&completions, huge, &[]).await;
    assert_eq!(too_large.status, 413, "{}", too_large.text());
    error(
        &post_raw(
            &format!("{base}/v1/chat/completions"),
            json!({"model": MODEL}).to_string().into_bytes(),
            &[],
        )
        .await,
        400,
    );

    // Still serving, and a client cannot pick the upstream.
    let prefix = text(5, 150);
    let (holder, _) = route(
        &stack,
        "/v1/completions",
        &completion(&format!("{prefix} q0")),
        &[],
    )
    .await;
    let other = (holder + 1) % stack.sims().len();
    let spoof = stack.sims()[other].ready.http.to_string();
    let spoofed = [(DESTINATION_HEADER, spoof.as_str())];
    for i in 1..=4 {
        let (replica, _) = route(
            &stack,
            "/v1/completions",
            &completion(&format!("{prefix} q{i}")),
            &spoofed,
        )
        .await;
        assert_eq!(replica, holder, "the client header overrode kvroute");
    }
    // Without kvroute (fail-open) the stripped header cannot steer either: Envoy balances.
    stack.kill_ext_proc().unwrap();
    let mut used = vec![0u32; stack.sims().len()];
    for i in 0..12 {
        let (replica, _) = route(
            &stack,
            "/v1/completions",
            &completion(&text(300 + i, 30)),
            &spoofed,
        )
        .await;
        used[replica] += 1;
    }
    assert!(
        used[other] < 12,
        "fail-open traffic followed the client's header: {used:?}"
    );
}

/// kvroute-ext-proc in this process with a config of the test's own (stopped on drop).
struct LocalExtProc {
    grpc: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    stop: CancellationToken,
    tasks: tokio_util::task::TaskTracker,
}

impl LocalExtProc {
    async fn start(yaml: &str) -> Self {
        let config = kvroute_ext_proc::Config::from_yaml(yaml).unwrap();
        let server = kvroute_ext_proc::ExtProc::builder(config)
            .bind()
            .await
            .unwrap();
        let (grpc, admin) = (server.grpc_addr().unwrap(), server.admin_addr().unwrap());
        let stop = CancellationToken::new();
        let tasks = tokio_util::task::TaskTracker::new();
        let shutdown = stop.clone().cancelled_owned();
        tasks.spawn(async move { server.serve(shutdown).await.unwrap() });
        Self {
            grpc,
            admin,
            stop,
            tasks,
        }
    }

    async fn metrics(&self) -> String {
        http::get(&format!("http://{}/metrics", self.admin))
            .await
            .unwrap()
            .text()
    }

    async fn shutdown(&self) {
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

impl Drop for LocalExtProc {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// ext-proc YAML for `sims` (replica `i` has Envoy cluster `replica_r{i}`), one pool `tiny`.
fn local_ext_proc_config(sims: &[SimProcess], tokenizer: &str) -> String {
    let replicas: String = sims
        .iter()
        .enumerate()
        .map(|(i, sim)| {
            let addr = sim.ready.http;
            format!(
                "- {{id: sim-{i}, pool: tiny, address: \"{addr}\", metrics_url: \"http://{addr}/metrics\", \
                 envoy_cluster: replica_r{i}}}\n"
            )
        })
        .collect();
    // Prefill weighs 0.05 ms a token, a hundred times the sims' own cost: these tests are about
    // the deployment, not the trade of cache against load, so a cached prefix of a few hundred
    // tokens outweighs a request the scrape or the in-flight count still shows on its holder
    // (the previous one, answered a moment ago).
    format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
         scrape: {{interval: 200ms}}\n\
         scoring: {{prefill_ms_per_token: 0.05, queue_ms_per_request: 0.5, running_ms_per_request: 0.05, \
         kv_usage_ms: 1.0, hotspot_min_ms: 2.0}}\n\
         pools:\n- name: tiny\n  models: [tiny]\n  block_size: 32\n  \
         key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}}\n  events: false\n  \
         tokenizer: {tokenizer}\n\
         replicas:\n{replicas}"
    )
}

/// Waits until Envoy's gRPC health check marks `ext_proc` healthy in cluster `kvroute_ext_proc`.
async fn wait_healthy_in_envoy(envoy: &Envoy, ext_proc: std::net::SocketAddr) {
    let url = format!("http://{}/clusters", envoy.admin);
    let healthy = format!("kvroute_ext_proc::{ext_proc}::health_flags::healthy");
    poll_until(
        "envoy to see kvroute-ext-proc healthy",
        settle(),
        || async {
            let text = http::get(&url).await.ok()?.text();
            text.lines().any(|l| l.trim() == healthy).then_some(())
        },
    )
    .await;
}

async fn two_sims() -> Vec<SimProcess> {
    vec![
        SimProcess::spawn(SIM_BIN, &sim_args(&[])).await.unwrap(),
        SimProcess::spawn(SIM_BIN, &sim_args(&[])).await.unwrap(),
    ]
}

#[tokio::test]
async fn a_failing_tokenizer_routes_on_load_and_is_counted() {
    let sims = two_sims().await;
    // The pool tokenizes through a `/tokenize` that is down.
    let ext_proc = LocalExtProc::start(&local_ext_proc_config(
        &sims,
        "{remote: \"http://127.0.0.1:1/tokenize\", timeout: 20ms}",
    ))
    .await;
    let production = std::fs::read_to_string(workspace_root().join(OVERRIDE_HOST_CONFIG)).unwrap();
    let addrs: Vec<_> = sims.iter().map(|s| s.ready.http).collect();
    let envoy = Envoy::start(&render_envoy_config(&production, &addrs, ext_proc.grpc).unwrap())
        .await
        .unwrap();
    wait_healthy_in_envoy(&envoy, ext_proc.grpc).await;
    let url = format!(
        "http://{}/v1/completions",
        envoy.listener("kvroute").unwrap()
    );
    for i in 0..10 {
        let response = post_raw(
            &url,
            completion(&text(400 + i, 40)).to_string().into_bytes(),
            &[],
        )
        .await;
        assert_eq!(response.status, 200, "{}", response.text());
    }
    let metrics = ext_proc.metrics().await;
    let load_tier = metrics::sum(
        &metrics,
        "kvroute_extproc_decisions_total",
        &["tier=\"load\"", "reason=\"tokenizer_failed\""],
    );
    assert_eq!(load_tier, 10.0, "{metrics}");
    assert!(
        metrics::sum(
            &metrics,
            "kvroute_extproc_fallbacks_total",
            &["stage=\"tokenize\""]
        ) >= 10.0,
        "{metrics}"
    );
    assert_eq!(
        envoy
            .stat("http.kvroute.ext_proc.failure_mode_allowed")
            .await
            .unwrap()
            .unwrap_or(0),
        0
    );
}

/// `envoy/kvroute-cluster-header.yaml` with its example addresses replaced by real ones.
fn cluster_header_config(sims: &[SimProcess], ext_proc: std::net::SocketAddr) -> String {
    let text = std::fs::read_to_string(workspace_root().join("envoy/kvroute-cluster-header.yaml"))
        .unwrap();
    let mut rendered = text
        .replace("port_value: 8080", "port_value: 0")
        .replace("port_value: 9901", "port_value: 0")
        .replace(
            "port_value: 50051",
            &format!("port_value: {}", ext_proc.port()),
        );
    for (i, example) in ["18001", "18002"].into_iter().enumerate() {
        let port = sims[i].ready.http.port();
        rendered = rendered.replace(
            &format!("port_value: {example}"),
            &format!("port_value: {port}"),
        );
    }
    assert!(!rendered.contains("port_value: 18001") && !rendered.contains("port_value: 50051"));
    rendered
}

#[tokio::test]
async fn cluster_header_deployment_routes_per_replica_cluster_and_fails_open() {
    let sims = two_sims().await;
    let model_dir = format!(
        "{{model_dir: \"{}\"}}",
        kvroute_tests::harness::tiny_model_dir().display()
    );
    let ext_proc = LocalExtProc::start(&local_ext_proc_config(&sims, &model_dir)).await;
    let envoy = Envoy::start(&cluster_header_config(&sims, ext_proc.grpc))
        .await
        .unwrap();
    wait_healthy_in_envoy(&envoy, ext_proc.grpc).await;
    let url = format!(
        "http://{}/v1/completions",
        envoy.listener("kvroute").unwrap()
    );
    let served = |cluster: &'static str| {
        let envoy = &envoy;
        async move {
            envoy
                .stat(&format!("cluster.{cluster}.upstream_rq_200"))
                .await
                .unwrap()
                .unwrap_or(0)
        }
    };

    // A shared prefix stays on one replica's cluster, even when the client names the other one.
    let prefix = text(6, 150);
    let first = post_raw(
        &url,
        completion(&format!("{prefix} q0")).to_string().into_bytes(),
        &[],
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let (r0, r1) = (served("replica_r0").await, served("replica_r1").await);
    assert_eq!(r0 + r1, 1);
    let (holder, other) = if r0 == 1 {
        ("replica_r0", "replica_r1")
    } else {
        ("replica_r1", "replica_r0")
    };
    for i in 1..=4 {
        let body = completion(&format!("{prefix} q{i}"))
            .to_string()
            .into_bytes();
        let response = post_raw(&url, body, &[(CLUSTER_HEADER, other)]).await;
        assert_eq!(response.status, 200, "{}", response.text());
        let cached = cached_tokens(&response.json().unwrap());
        assert!(cached > 0, "request {i} missed the cache");
    }
    assert_eq!((served(holder).await, served(other).await), (5, 0));
    assert_eq!(served("llm_pool").await, 0);

    // kvroute gone: the default route serves every request through the pool cluster.
    ext_proc.shutdown().await;
    for i in 0..6 {
        let response = post_raw(
            &url,
            completion(&text(500 + i, 20)).to_string().into_bytes(),
            &[(CLUSTER_HEADER, other)],
        )
        .await;
        assert_eq!(response.status, 200, "{}", response.text());
    }
    assert_eq!(
        served("llm_pool").await,
        6,
        "{}",
        http::get(&format!(
            "http://{}/stats?filter=(upstream_rq_200|ext_proc)",
            envoy.admin
        ))
        .await
        .unwrap()
        .text()
    );
    assert_eq!(served(other).await, 0, "a client header chose the cluster");
}
