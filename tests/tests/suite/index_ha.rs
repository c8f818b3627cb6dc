//! Index high availability: two kvroute-index instances, both subscribed to every sim, and
//! kvroute-ext-proc configured with both. One index is SIGKILLed while requests flow; ext-proc
//! must fail over to the other within its decision budget: no request fails, and every decision
//! stays on the precise tier (no fallback to routing memory or load).
//!
//! Needs the binaries and Envoy: `cargo build --bins` before
//! `cargo test -p kvroute-tests --test integration index_ha`.

use std::time::Duration;

use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::http;
use kvroute_tests::harness::metrics::sum;
use kvroute_tests::stack::{MODEL, Routing, Stack, StackOptions};
use serde_json::{Value, json};

use super::routing::{post_raw, text};

const REQUESTS_PER_WORKER: usize = 15;
const WORKERS: usize = 2;
/// Completed requests (all workers) after which the first index is killed.
const KILL_AFTER: usize = 8;

async fn ext_proc_metrics(stack: &Stack) -> String {
    let url = format!("{}/metrics", stack.ext_proc_admin_url().unwrap());
    http::get(&url).await.unwrap().text()
}

/// Per replica block counts as one index reports them.
async fn block_counts(admin: &str) -> Option<Vec<(String, u64)>> {
    let body: Value = http::get(&format!("{admin}/v1/replicas"))
        .await
        .ok()?
        .json()
        .ok()?;
    let mut counts: Vec<(String, u64)> = body
        .as_array()?
        .iter()
        .filter_map(|r| Some((r["id"].as_str()?.to_owned(), r["blocks"].as_u64()?)))
        .collect();
    counts.sort();
    Some(counts)
}

fn completion(prompt: &str) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 2})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext_proc_keeps_routing_precisely_when_one_of_two_indexes_dies_mid_load() {
    let options = StackOptions {
        index_instances: 2,
        ..StackOptions::default()
    };
    let block_size = options.block_size;
    let mut stack = Stack::start(options).await.unwrap();
    let url = format!("{}/v1/completions", stack.url(Routing::Kvroute).unwrap());
    let prefixes: Vec<String> = (0..WORKERS).map(|w| text(700 + w as u64, 150)).collect();

    // Warm: each prefix cached once, and both indexes hold the same blocks, all of them (at
    // least every full block of each warm prompt but its last token's: a total above zero
    // alone could be one prefix's blocks while the other's events are still on their way).
    let mut warm_blocks = 0;
    for prefix in &prefixes {
        let response = post_raw(
            &url,
            completion(&format!("{prefix} warm"))
                .to_string()
                .into_bytes(),
            &[],
        )
        .await;
        assert_eq!(response.status, 200, "{}", response.text());
        let usage: Value = response.json().unwrap();
        let prompt_tokens = usage["usage"]["prompt_tokens"].as_u64().unwrap();
        warm_blocks += prompt_tokens.saturating_sub(1) / u64::from(block_size);
    }
    assert!(warm_blocks > 0);
    let admins = stack.index_admin_urls();
    assert_eq!(admins.len(), 2);
    try_poll_until(
        "both indexes agree",
        deadline(Duration::from_secs(20)),
        || async {
            let first = block_counts(&admins[0]).await?;
            let second = block_counts(&admins[1]).await?;
            let total: u64 = first.iter().map(|(_, b)| b).sum();
            (first == second && total >= warm_blocks).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", stack.logs()));
    let before = ext_proc_metrics(&stack).await;

    // Workers send prefixed requests one after another; the test kills the first index (the
    // one ext-proc tries first) once KILL_AFTER have completed, while others are in flight.
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    let workers: Vec<_> = prefixes
        .iter()
        .enumerate()
        .map(|(w, prefix)| {
            let (url, prefix, done) = (url.clone(), prefix.clone(), done_tx.clone());
            async move {
                let mut cached = Vec::new();
                for i in 0..REQUESTS_PER_WORKER {
                    let body = completion(&format!("{prefix} worker {w} request {i}"));
                    let response = post_raw(&url, body.to_string().into_bytes(), &[]).await;
                    assert_eq!(response.status, 200, "{}", response.text());
                    let body: Value = response.json().unwrap();
                    cached.push(
                        body["usage"]["prompt_tokens_details"]["cached_tokens"]
                            .as_u64()
                            .unwrap_or(0),
                    );
                    let _ = done.send(());
                }
                cached
            }
        })
        .collect();
    drop(done_tx);
    let killer = async {
        for _ in 0..KILL_AFTER {
            done_rx.recv().await;
        }
        stack.kill_index_instance(0).unwrap();
    };
    let (cached, ()) = tokio::join!(futures::future::join_all(workers), killer);

    let after = ext_proc_metrics(&stack).await;
    let delta =
        |family: &str, label: &str| sum(&after, family, &[label]) - sum(&before, family, &[label]);
    let requests = (WORKERS * REQUESTS_PER_WORKER) as f64;
    assert_eq!(
        delta("kvroute_extproc_decisions_total", ""),
        requests,
        "{after}"
    );
    assert_eq!(
        delta("kvroute_extproc_decisions_total", "tier=\"precise\""),
        requests,
        "every decision used an index answer\n{after}"
    );
    assert_eq!(
        delta("kvroute_extproc_fallbacks_total", "stage=\"index\""),
        0.0,
        "{after}"
    );
    // Precisely: every decision found the request's prefix in the index's answer, and every
    // request found it cached where it was sent — but for those the policy sent elsewhere on
    // purpose (the holder's queue, as scraped from the sims, outweighing the prefill: on a
    // loaded test host it can).
    assert_eq!(
        delta(
            "kvroute_extproc_decisions_total",
            "reason=\"no_cache_match\""
        ),
        0.0,
        "every prefix was in the index's answer\n{after}"
    );
    let load_over_cache = delta(
        "kvroute_extproc_decisions_total",
        "reason=\"load_over_cache\"",
    ) + delta(
        "kvroute_extproc_decisions_total",
        "reason=\"hotspot_guard\"",
    );
    let missed = cached.iter().flatten().filter(|&&c| c == 0).count() as f64;
    assert!(
        missed <= load_over_cache,
        "{missed} requests missed the cache, {load_over_cache} were sent off it on purpose: \
         {cached:?}\n{after}"
    );
    // The survivor still answers and the dead one does not.
    assert!(block_counts(&admins[1]).await.is_some());
    assert!(block_counts(&admins[0]).await.is_none());
}
