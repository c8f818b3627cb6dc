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
use kvroute_tests::harness::http::{self, HttpResponse};
use kvroute_tests::harness::wait_until;
use kvroute_tests::stack::{MODEL, Routing, Stack, StackOptions};
use serde_json::{Value, json};

use super::common::metric;

/// How long a test waits for counters/metrics to settle.
const SETTLE: Duration = Duration::from_secs(20);

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

/// Finished requests per sim (`vllm:request_success_total`), in replica order.
async fn finished(stack: &Stack) -> Vec<u64> {
    let mut counts = Vec::new();
    for url in stack.sim_urls() {
        let text = http::get(&format!("{url}/metrics")).await.unwrap().text();
        counts.push(metric(&text, "vllm:request_success_total{") as u64);
    }
    counts
}

/// Waits until the sims finished `expected` more requests than `before`; returns the per-sim deltas.
async fn served_since(stack: &Stack, before: &[u64], expected: u64) -> Vec<u64> {
    wait_until("the sims to count the requests", SETTLE, || async {
        let now = finished(stack).await;
        let delta: Vec<u64> = now.iter().zip(before).map(|(n, b)| n - b).collect();
        (delta.iter().sum::<u64>() == expected).then_some(delta)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", stack.logs()))
}

/// Sends one request through kvroute's listener; returns the serving replica and the body.
async fn route(stack: &Stack, path: &str, body: &Value, headers: &[(&str, &str)]) -> (usize, Value) {
    let before = finished(stack).await;
    let url = format!("{}{path}", stack.url(Routing::Kvroute).unwrap());
    let response = post_raw(&url, body.to_string().into_bytes(), headers).await;
    assert_eq!(response.status, 200, "{}\n{}", response.text(), stack.logs());
    let delta = served_since(stack, &before, 1).await;
    let replica = delta.iter().position(|d| *d == 1).unwrap();
    (replica, response.json().unwrap())
}

fn cached_tokens(body: &Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// kvroute-ext-proc's `/metrics` text.
async fn ext_proc_metrics(stack: &Stack) -> String {
    let url = format!("{}/metrics", stack.ext_proc_admin_url().unwrap());
    http::get(&url).await.unwrap().text()
}

/// Sum of every sample of `family` whose labels contain all of `labels` (0 when none).
fn sum_samples(text: &str, family: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter(|line| {
            line.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|line| labels.iter().all(|l| line.contains(l)))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Leading blocks of `prompt` (as the sims tokenize it) the index says each replica holds.
async fn index_matches(stack: &Stack, prompt: &str) -> Vec<u64> {
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
    let prefix = text(1, 300);
    let (holder, first) = route(&stack, "/v1/completions", &completion(&format!("{prefix} q0")), &[]).await;
    assert_eq!(cached_tokens(&first), 0);
    // The engine's KV events reach the index: later decisions are precise, not speculative.
    wait_until("the index to learn the prefix", SETTLE, || async {
        let matches = index_matches(&stack, &prefix).await;
        (matches[holder] > 0).then_some(())
    })
    .await
    .unwrap();

    for i in 1..=6 {
        let prompt = format!("{prefix} q{i}");
        let (replica, body) = route(&stack, "/v1/completions", &completion(&prompt), &[]).await;
        assert_eq!(replica, holder, "request {i} left the replica holding its prefix");
        let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(
            cached_tokens(&body) * 10 >= prompt_tokens * 8,
            "request {i}: {} of {prompt_tokens} tokens cached",
            cached_tokens(&body)
        );
    }
    let metrics = ext_proc_metrics(&stack).await;
    assert!(
        sum_samples(&metrics, "kvroute_extproc_decisions_total", &["tier=\"precise\"", "reason=\"cache_hit\""]) >= 6.0,
        "{metrics}"
    );

    let mut used = [0u32; 4];
    for i in 0..16 {
        let (replica, _) = route(&stack, "/v1/completions", &completion(&text(100 + i, 200)), &[]).await;
        used[replica] += 1;
    }
    assert!(
        used.iter().filter(|n| **n > 0).count() >= 3,
        "unrelated prompts should spread over the replicas: {used:?}"
    );
}

#[tokio::test]
async fn a_burst_of_siblings_co_locates() {
    let stack = Stack::start(StackOptions::default()).await.unwrap();
    let prefix = text(2, 600);
    let url = format!("{}/v1/completions", stack.url(Routing::Kvroute).unwrap());
    let before = finished(&stack).await;
    let requests = (0..16).map(|i| {
        let body = completion(&format!("{prefix} sibling {i}")).to_string().into_bytes();
        let url = url.clone();
        async move { post_raw(&url, body, &[]).await }
    });
    for response in futures::future::join_all(requests).await {
        assert_eq!(response.status, 200, "{}", response.text());
    }
    let served = served_since(&stack, &before, 16).await;
    let most = served.iter().max().copied().unwrap_or(0);
    assert!(most >= 12, "16 siblings sent at once should mostly co-locate: {served:?}");
}

#[tokio::test]
async fn a_busy_replica_stops_receiving_work_even_for_its_cached_prefix() {
    let stack = Stack::start(StackOptions::default()).await.unwrap();
    let prefix = text(3, 300);
    let (holder, _) = route(&stack, "/v1/completions", &completion(&format!("{prefix} q0")), &[]).await;
    let (again, _) = route(&stack, "/v1/completions", &completion(&format!("{prefix} q1")), &[]).await;
    assert_eq!(again, holder);

    // Load the holder directly (not through Envoy): long generations that keep it busy.
    let busy_url = format!("{}/v1/completions", stack.sim_urls()[holder]);
    let hogs: Vec<_> = (0..48)
        .map(|i| {
            let body = json!({"model": MODEL, "prompt": text(1000 + i, 20), "max_tokens": 1500});
            let url = busy_url.clone();
            async move { http::post_json(&url, &body).await }
        })
        .collect();
    let hogs = futures::future::join_all(hogs);
    let check = async {
        let gauge = format!("kvroute_extproc_replica_running_requests{{replica=\"{}\"}}", stack.replica_ids()[holder]);
        wait_until("kvroute to see the busy replica", SETTLE, || async {
            let metrics = ext_proc_metrics(&stack).await;
            (sum_samples(&metrics, &gauge[..gauge.find('{').unwrap()], &[&gauge[gauge.find('{').unwrap() + 1..gauge.len() - 1]]) >= 40.0).then_some(())
        })
        .await
        .unwrap();
        let mut elsewhere = 0;
        for i in 2..8 {
            let (replica, _) = route(&stack, "/v1/completions", &completion(&format!("{prefix} q{i}")), &[]).await;
            elsewhere += u32::from(replica != holder);
        }
        elsewhere
    };
    let (_, elsewhere) = tokio::join!(hogs, check);
    assert_eq!(elsewhere, 6, "new work went to the busy replica");
    let metrics = ext_proc_metrics(&stack).await;
    assert!(
        sum_samples(&metrics, "kvroute_extproc_decisions_total", &["reason=\"hotspot_guard\""])
            + sum_samples(&metrics, "kvroute_extproc_decisions_total", &["reason=\"load_over_cache\""])
            >= 6.0,
        "{metrics}"
    );
}

#[tokio::test]
async fn requests_keep_flowing_when_the_index_or_ext_proc_dies() {
    let mut stack = Stack::start(StackOptions::default()).await.unwrap();
    let prefix = text(4, 300);
    let (holder, _) = route(&stack, "/v1/completions", &completion(&format!("{prefix} q0")), &[]).await;

    stack.kill_index().unwrap();
    for i in 1..=10 {
        // Same prefix: the approximate tier (kvroute's own routing memory) keeps it on its replica.
        let (replica, _) = route(&stack, "/v1/completions", &completion(&format!("{prefix} q{i}")), &[]).await;
        assert_eq!(replica, holder, "approximate tier lost the prefix");
    }
    let metrics = ext_proc_metrics(&stack).await;
    assert!(sum_samples(&metrics, "kvroute_extproc_fallbacks_total", &["stage=\"index\""]) >= 10.0, "{metrics}");
    assert!(
        sum_samples(&metrics, "kvroute_extproc_decisions_total", &["tier=\"approximate\""]) >= 10.0,
        "{metrics}"
    );

    stack.kill_ext_proc().unwrap();
    let url = format!("{}/v1/completions", stack.url(Routing::Kvroute).unwrap());
    let before = finished(&stack).await;
    for i in 0..20 {
        let response = post_raw(&url, completion(&text(200 + i, 50)).to_string().into_bytes(), &[]).await;
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
    let (_, body) = route(&stack, "/v1/completions", &completion(&format!("{prefix} again")), &[]).await;
    assert_eq!(body["object"], "text_completion");
    let metrics = ext_proc_metrics(&stack).await;
    assert!(sum_samples(&metrics, "kvroute_extproc_decisions_total", &[]) >= 1.0, "{metrics}");
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

    error(&post_raw(&completions, b"{\"model\": \"tiny\", \"prompt\": ".to_vec(), &[]).await, 400);
    error(
        &post_raw(&completions, json!({"model": "no-such-model", "prompt": "hi"}).to_string().into_bytes(), &[]).await,
        404,
    );
    let huge = completion(&"x".repeat(1536 * 1024)).to_string().into_bytes();
    let too_large = post_raw(&completions, huge, &[]).await;
    assert_eq!(too_large.status, 413, "{}", too_large.text());
    error(
        &post_raw(&format!("{base}/v1/chat/completions"), json!({"model": MODEL}).to_string().into_bytes(), &[]).await,
        400,
    );

    // Still serving, and a client cannot pick the upstream.
    let prefix = text(5, 300);
    let (holder, _) = route(&stack, "/v1/completions", &completion(&format!("{prefix} q0")), &[]).await;
    let other = (holder + 1) % stack.sims().len();
    let spoof = stack.sims()[other].ready.http.to_string();
    let spoofed = [("x-gateway-destination-endpoint", spoof.as_str())];
    for i in 1..=4 {
        let (replica, _) = route(&stack, "/v1/completions", &completion(&format!("{prefix} q{i}")), &spoofed).await;
        assert_eq!(replica, holder, "the client header overrode kvroute");
    }
    // Without kvroute (fail-open) the stripped header cannot steer either: Envoy balances.
    stack.kill_ext_proc().unwrap();
    let mut used = vec![0u32; stack.sims().len()];
    for i in 0..12 {
        let (replica, _) = route(&stack, "/v1/completions", &completion(&text(300 + i, 30)), &spoofed).await;
        used[replica] += 1;
    }
    assert!(used[other] < 12, "fail-open traffic followed the client's header: {used:?}");
}
