//! Shadow mode and decision records end to end: real Envoy → kvroute-ext-proc → kvroute-index in
//! front of two engine sims. With the pool in `mode: shadow` kvroute decides every request but
//! names no destination, so Envoy's own round robin (the override_host fallback) places them;
//! kvroute compares its choice with the replica Envoy served, and the engines' own prefix-cache
//! counters say what was delivered. A config reload then switches the pool to routing.
//!
//! The scripted workload: each prompt is sent three times in a row. Round robin alternates the
//! two replicas, so the second copy lands on the replica that has not seen the prompt (a cold
//! repeat: kvroute would have captured the hit, nothing is delivered) and the third on the one
//! that has (captured and delivered). Hand-computed, per prompt with `h` the engine's hit on a
//! warm copy: held = captured = 2h, served (predicted) = delivered = h, two repeats, one cold.
//! Once routing, the three copies stay on one replica: delivered = 2h, the projection.
//!
//! Needs the binaries: `cargo build --bins` first (see `routing.rs`).

use std::time::Duration;

use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::{http, metrics};
use kvroute_tests::stack::{DebugHeaders, MODEL, Stack, StackOptions};
use serde_json::{Value, json};

use super::check::report as check_report;
use super::routing::{ext_proc_metrics, index_matches, route_response, text};

/// Prompts sent in shadow mode.
const SHADOW_PROMPTS: u64 = 3;
/// Copies of each prompt.
const COPIES: usize = 3;
/// Decision records kept.
const KEEP: usize = 4;

fn settle() -> Duration {
    deadline(Duration::from_secs(30))
}

fn completion(prompt: &str) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 2})
}

/// One pool counter of ext-proc's `/metrics`.
fn pool_counter(metrics: &str, name: &str) -> f64 {
    metrics::sum(
        metrics,
        &format!("kvroute_extproc_{name}_total"),
        &[&format!("pool=\"{MODEL}\"")],
    )
}

/// Sends `prompt` `COPIES` times, each alone, waiting after each until the index knows the
/// serving replica holds it (so kvroute's view is the engines'). Returns, per copy, the serving
/// replica, the engine's cached tokens and kvroute's prediction for its own choice
/// (`x-kvroute-predicted-cached-tokens`).
async fn send_copies(stack: &Stack, prompt: &str) -> Vec<(usize, u64, u64)> {
    let mut served = Vec::new();
    for _ in 0..COPIES {
        let (replica, response) =
            route_response(stack, "/v1/completions", &completion(prompt), &[]).await;
        let predicted = response
            .header("x-kvroute-predicted-cached-tokens")
            .parse()
            .unwrap();
        let body: Value = response.json().unwrap();
        let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        try_poll_until("the index to learn the prompt", settle(), || async {
            (index_matches(stack, prompt).await[replica] > 0).then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", stack.logs()));
        served.push((replica, cached, predicted));
    }
    served
}

/// Waits until the engines' counters, as ext-proc scraped them, reach `delivered`.
async fn until_delivered(stack: &Stack, delivered: f64) -> String {
    let reached = try_poll_until("ext-proc to scrape the engines' hits", settle(), || async {
        let metrics = ext_proc_metrics(stack).await;
        (pool_counter(&metrics, "pool_engine_cached_tokens") >= delivered).then_some(metrics)
    })
    .await;
    match reached {
        Ok(metrics) => metrics,
        Err(e) => panic!("{e}\n{}\n{}", ext_proc_metrics(stack).await, stack.logs()),
    }
}

#[tokio::test]
async fn shadow_mode_projects_the_gain_that_routing_then_delivers() {
    let stack = Stack::start(StackOptions {
        replicas: 2,
        kv_blocks_per_replica: 1024,
        pool_extra_config: "mode: shadow".to_owned(),
        envoy_fallback_round_robin: true,
        debug_headers: DebugHeaders::Always,
        ext_proc_extra_config: format!(
            "decision_records: {{keep: {KEEP}}}\nreload_interval: 50ms\n"
        ),
        ..StackOptions::default()
    })
    .await
    .unwrap();

    // Shadow mode: Envoy's round robin places every copy.
    let mut hit = 0;
    for seed in 0..SHADOW_PROMPTS {
        let prompt = text(700 + seed, 150);
        let served = send_copies(&stack, &prompt).await;
        let replicas: Vec<usize> = served.iter().map(|(r, _, _)| *r).collect();
        assert_eq!(
            (replicas[1] != replicas[0], replicas[2] == replicas[0]),
            (true, true),
            "round robin alternates the two replicas: {replicas:?}"
        );
        let cached: Vec<u64> = served.iter().map(|(_, c, _)| *c).collect();
        assert_eq!(
            (cached[0], cached[1]),
            (0, 0),
            "the first two copies met cold replicas"
        );
        assert!(cached[2] > 0, "the third copy met its first copy's blocks");
        assert!(hit == 0 || hit == cached[2], "equal prompt lengths");
        hit = cached[2];
    }
    let hit = hit as f64;
    let prompts = SHADOW_PROMPTS as f64;
    let metrics = until_delivered(&stack, prompts * hit).await;
    let counter = |name| pool_counter(&metrics, name);
    assert_eq!(counter("shadow_requests"), prompts * COPIES as f64);
    assert_eq!(
        counter("shadow_unobserved"),
        0.0,
        "Envoy reports the served host"
    );
    assert_eq!(counter("shadow_held_tokens"), prompts * 2.0 * hit);
    assert_eq!(counter("shadow_captured_tokens"), prompts * 2.0 * hit);
    assert_eq!(counter("shadow_served_predicted_tokens"), prompts * hit);
    assert_eq!(counter("shadow_repeat_requests"), prompts * 2.0);
    assert_eq!(counter("shadow_repeat_cold_requests"), prompts);
    assert_eq!(
        counter("pool_engine_cached_tokens"),
        prompts * hit,
        "delivered, by the engines' own counters"
    );

    // The summary says the same, with the projected gain.
    let admin = stack.ext_proc_admin_url().unwrap();
    let summary: Value = http::get(&format!("{admin}/v1/shadow"))
        .await
        .unwrap()
        .json()
        .unwrap();
    let pool = &summary["pools"][0];
    assert_eq!(pool["pool"], MODEL);
    assert_eq!(pool["mode"], "shadow");
    assert_eq!(pool["captured_tokens"].as_f64(), Some(prompts * 2.0 * hit));
    assert_eq!(pool["delivered_tokens"].as_f64(), Some(prompts * hit));
    assert_eq!(pool["projected_gain_tokens"].as_f64(), Some(prompts * hit));
    assert_eq!(pool["repeat_cold_share"].as_f64(), Some(0.5));

    // "Why this replica": the last decisions, newest first, with every candidate.
    let records: Value = http::get(&format!("{admin}/v1/decisions"))
        .await
        .unwrap()
        .json()
        .unwrap();
    let records = records["decisions"].as_array().unwrap();
    assert_eq!(records.len(), KEEP, "only the last {KEEP} are kept");
    let newest = &records[0];
    assert_eq!(
        (&newest["mode"], &newest["tier"], &newest["reason"]),
        (&json!("shadow"), &json!("precise"), &json!("cache_hit"))
    );
    let candidates = newest["candidates"].as_array().unwrap();
    assert_eq!(candidates.len(), 2);
    assert!(
        candidates
            .iter()
            .all(|c| c["indexed_blocks"].as_u64().is_some_and(|b| b > 0)),
        "both replicas hold the last prompt by the time of its third copy: {newest}"
    );
    assert_eq!(newest["tokens"]["source"], "cache");

    // Switching the pool to routing is a reload.
    let config = std::fs::read_to_string(stack.ext_proc_config_path().unwrap()).unwrap();
    assert!(config.contains("mode: shadow"));
    stack.set_pool_mode("route").await.unwrap();

    // Routing: every copy stays where the first went; delivered rises to the projection.
    let prompt = text(799, 150);
    let served = send_copies(&stack, &prompt).await;
    assert!(
        served.iter().all(|(r, _, _)| *r == served[0].0),
        "kvroute keeps the copies together: {served:?}"
    );
    assert!(
        served
            .iter()
            .all(|(_, cached, predicted)| cached == predicted),
        "routing delivers what it predicts: {served:?}"
    );
    assert_eq!(served[0].1, 0);
    assert!(served[1].1 > 0 && served[1].1 == served[2].1);
    let response = route_response(&stack, "/v1/completions", &completion(&prompt), &[])
        .await
        .1;
    let explain = response.header("x-kvroute-explain");
    assert!(
        explain.starts_with("precise/cache_hit tokens=") && explain.contains(" *sim-"),
        "the record comes back compact to a flagged request: {explain:?}"
    );
    let routed_delivered = served.iter().map(|(_, c, _)| *c as f64).sum::<f64>();
    let metrics = until_delivered(
        &stack,
        prompts * hit + routed_delivered + served[2].1 as f64,
    )
    .await;
    assert_eq!(
        pool_counter(&metrics, "shadow_requests"),
        prompts * COPIES as f64,
        "routed decisions are not compared"
    );

    // `kvroute-check --explain`: how ext-proc would decide the prompt now, routing nothing.
    let decisions = |metrics: &str| metrics::sum(metrics, "kvroute_extproc_decisions_total", &[]);
    let before = decisions(&metrics);
    let record = check_report(
        &["/v1/completions", "--explain", &admin],
        &completion(&prompt).to_string(),
    );
    assert_eq!(
        (&record["mode"], &record["tier"], &record["reason"]),
        (&json!("route"), &json!("precise"), &json!("cache_hit")),
        "{record}"
    );
    let holder = format!("sim-{}", served[0].0);
    assert_eq!(record["chosen"], holder.as_str(), "{record}");
    assert_eq!(
        record["predicted_cached_tokens"].as_u64(),
        Some(served[2].1),
        "{record}"
    );
    assert_eq!(
        decisions(&ext_proc_metrics(&stack).await),
        before,
        "explaining is not deciding"
    );
    let refused =
        super::check::run_check(&["/v1/completions", "--explain", &admin], "{\"model\": 7}");
    assert!(!refused.status.success(), "a refused body is an error");
}
